"""Planning work that leaves no trace on the run: `isolated`.

The planners (`AutoFit`, `ActivationCheckpointing` with a budget, `estimate_memory`) run the user's own
``training_step`` before the first real step: to time it, to profile which blocks to checkpoint, or on fake
tensors to estimate it. That code has side effects a plan that changes nothing must not leave behind:
BatchNorm's running statistics and ``num_batches_tracked``, dropout's draws from the RNG streams, gradients
accumulated by a backward, torchmetrics states, a ``self.outputs.append(...)``, and ``torch.compile``'s
decision for each frame (a frame first called under a dispatch mode is never compiled afterwards).

`isolated` snapshots what it can restore exactly and puts it back:

* the RNG streams: torch's CPU and CUDA generators, Python's ``random`` and NumPy's global state;
* buffers (values, and the tensor objects themselves when code rebinds them); ``.grad`` tensors are set
  aside by reference (``None`` inside) and put back;
* ``train()``/``eval()`` flags of every submodule;
* torchmetrics ``Metric`` states (``update`` counts and values);
* the contents of public ``list``/``dict``/``set``/``deque`` attributes of every submodule (the usual
  ``self.step_outputs.append(...)``);
* torch.compile: the work runs under ``torch.compiler.set_stance("force_eager")``, so dynamo neither
  compiles nor marks a frame to skip while planning.

What it cannot restore it checks: a parameter changed in place (an optimizer step inside ``training_step``)
gets a warning, since copying every parameter up front would double the model's memory. Other objects the
step touches (a global counter, a file it writes, ``self.log`` outside a Trainer loop) are the user's code
running once more; the planners document that.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import random
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["isolated", "rng_kept"]

_CONTAINERS = (list, dict, set, collections.deque)


@contextlib.contextmanager
def isolated(module: nn.Module, what: str = "Planning") -> Iterator[None]:
    """Run the block, then put ``module``'s state, the RNG streams and torch.compile's state back."""
    restore = [
        _rng(),
        _buffers(module),
        _grads(module),
        _modes(module),
        _metrics(module),
        _containers(module),
    ]
    versions = [(name, p, p._version) for name, p in module.named_parameters()]
    try:
        with _eager():
            yield
    finally:
        for undo in reversed(restore):
            undo()
        changed = [name for name, p, version in versions if p._version != version]
        if changed:
            warnings.warn(
                f"{what} ran training_step, which changed {len(changed)} parameter(s) in place "
                f"({', '.join(changed[:3])}{', ...' if len(changed) > 3 else ''}); they are not restored. "
                "Step optimizers in the training loop, not in training_step.",
                stacklevel=3,
            )


@contextlib.contextmanager
def rng_kept() -> Iterator[None]:
    """Put back every RNG stream `isolated` keeps (torch's CPU and CUDA generators, Python's ``random``,
    NumPy's global state) after the block, for work that draws from them on the run's behalf (a dataset
    that augments with ``random`` or NumPy, iterated for a first batch)."""
    undo = _rng()
    try:
        yield
    finally:
        undo()


def _eager() -> contextlib.AbstractContextManager:
    set_stance = getattr(torch.compiler, "set_stance", None)
    return set_stance("force_eager") if set_stance is not None else contextlib.nullcontext()


def _rng() -> Any:
    cuda = torch.cuda.is_initialized()
    cpu_state = torch.random.get_rng_state()
    cuda_states = torch.cuda.get_rng_state_all() if cuda else None
    python_state = random.getstate()
    numpy = sys.modules.get("numpy")
    numpy_state = numpy.random.get_state() if numpy is not None else None

    def undo() -> None:
        torch.random.set_rng_state(cpu_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)
        random.setstate(python_state)
        if numpy_state is not None:
            numpy.random.set_state(numpy_state)

    return undo


def _buffers(module: nn.Module) -> Any:
    saved = [
        (owner, name, buffer, buffer.detach().clone() if _is_real(buffer) else None)
        for owner in module.modules()
        for name, buffer in owner._buffers.items()
        if buffer is not None
    ]

    def undo() -> None:
        with torch.no_grad():
            for owner, name, buffer, value in saved:
                owner._buffers[name] = buffer
                if value is not None and not torch.equal(buffer, value):
                    buffer.copy_(value)

    return undo


def _grads(module: nn.Module) -> Any:
    """Gradients are set aside by reference while inside (``None`` there), never copied: a copy would
    double their memory on a re-plan mid-run, and planning's own backward accumulates into fresh ones."""
    saved = [(p, p.grad) for p in module.parameters()]
    for p, _ in saved:
        p.grad = None

    def undo() -> None:
        for p, grad in saved:
            p.grad = grad

    return undo


def _modes(module: nn.Module) -> Any:
    saved = [(m, m.training) for m in module.modules()]

    def undo() -> None:
        for m, training in saved:
            m.training = training

    return undo


def _metrics(module: nn.Module) -> Any:
    try:
        from torchmetrics import Metric
    except ImportError:
        return lambda: None
    names = ("_update_count", "_computed", "_forward_cache")
    saved = [
        (m, {name: copy.deepcopy(getattr(m, name)) for name in (*m._defaults, *names) if hasattr(m, name)})
        for m in module.modules()
        if isinstance(m, Metric)
    ]

    def undo() -> None:
        for m, state in saved:
            for name, value in state.items():
                setattr(m, name, value)

    return undo


def _containers(module: nn.Module) -> Any:
    saved = [
        (value, copy.copy(value))
        for m in module.modules()
        for name, value in vars(m).items()
        if not name.startswith("_") and type(value) in _CONTAINERS
    ]

    def undo() -> None:
        for value, contents in saved:
            value.clear()
            if isinstance(value, (dict, set)):
                value.update(contents)
            else:
                value.extend(contents)

    return undo


def _is_real(t: Tensor | None) -> bool:
    """A tensor with data to copy (not meta, not fake)."""
    if t is None or t.device.type == "meta":
        return False
    from torch._subclasses.fake_tensor import FakeTensor

    return not isinstance(t, FakeTensor)
