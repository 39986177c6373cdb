"""The optimizer step fused into backward: each parameter is updated as soon as its gradient is complete.

A post-accumulate-grad hook on every trained parameter calls its optimizer's ``step()`` and then frees that
gradient, so at most the gradients of the parameters whose backward is in flight exist at once, instead of
all of them (PyTorch's recipe, "How to save memory by fusing the optimizer step into the backward pass";
torchtune's ``optimizer_in_bwd``; LOMO). When the hook of parameter ``p`` runs, ``p`` is the only parameter
with a gradient (the others are not yet computed, or already stepped and freed), and ``torch.optim``
optimizers, bitsandbytes' and torchao's skip parameters whose ``.grad`` is ``None``: the ordinary
``step()`` of the user's own optimizer updates exactly ``p``, with the same per-parameter arithmetic as a
step after backward. Nothing else changes: the optimizer object, its state (and its ``state_dict`` in a
checkpoint), its learning-rate scheduler and the step ``Lightning`` calls after backward, which finds no
gradient left and does nothing.

Why not torch-optimi's gradient release: it works only with optimi's own optimizers (the optimizer ladder
here is torch's and bitsandbytes') and keeps each parameter's param group inside the optimizer state
(``state[p]["group"]``), which a Lightning checkpoint would then carry.

torch-optimi's own optimizers keep one step count per param group, which a step per parameter would
advance once per parameter: they are stepped through optimi's per-parameter path (``step(param=p)``) when
built with ``gradient_release=True``, and refused otherwise.

What it cannot do, and refuses (`refusal`): an optimizer that re-evaluates the loss (LBFGS's closure);
anything that needs all gradients before any update — gradient clipping by global norm, accumulation over
micro-batches, the fp16 grad scaler's inf check, DDP's or FSDP1's reduction across ranks (the hook would
step on one rank's unreduced gradient). FSDP2 is served: it runs a sharded parameter's post-accumulate-grad
hooks once its reduce-scatter has handed it its gradient's shard.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterable

import torch
from optimi.optimizer import OptimiOptimizer
from torch import Tensor
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from lightning_memkit._measuring.patches import gradient_consumed

__all__ = ["FusedStep", "fuse_optimizer_step", "needs_closure"]


class FusedStep:
    """The hooks `fuse_optimizer_step` installed; ``remove()`` (or leaving a ``with`` block) takes them
    off, and the optimizers step after backward again."""

    def __init__(self, handles: list[RemovableHandle]) -> None:
        self.handles = handles

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def __enter__(self) -> FusedStep:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def fuse_optimizer_step(optimizers: Optimizer | Iterable[Optimizer]) -> FusedStep:
    """Step each parameter inside backward, as soon as its gradient is complete, and free the gradient.

    The peak no longer holds the model's gradients: during backward only the gradients not yet consumed
    exist (one layer's, give or take), and none in the forward. Training is the same as calling
    ``optimizer.step()`` after ``loss.backward()`` (bit-identical for torch's AdamW on the CPU,
    ``tests/levers/test_fused_step.py``); ``optimizer.step()`` and ``zero_grad()`` may still be called, and do
    nothing more. Learning-rate schedulers and ``state_dict`` work as before: it is the same optimizer.

    Any gradient present when it is installed is freed (it would otherwise join the first update).

    Raises:
        ValueError: an optimizer needs a closure (LBFGS), or a parameter belongs to two optimizers.

    Example::

        fused = fuse_optimizer_step(optimizer)
        for x, y in loader:
            loss_fn(model(x), y).backward()  # each parameter is updated as its gradient completes
        fused.remove()
    """
    optimizers = [optimizers] if isinstance(optimizers, Optimizer) else _optimizers(optimizers)
    owners: dict[int, tuple[Optimizer, dict]] = {}  # each parameter's optimizer and param group
    params: list[Tensor] = []
    for optimizer in optimizers:
        if needs_closure(optimizer):
            raise ValueError(
                f"{type(optimizer).__name__} re-evaluates the loss in step(closure), which cannot run inside "
                "backward: the optimizer step cannot be fused with it. Use an optimizer whose step() takes "
                "no closure, or GradientRelease, which frees the gradients after the step instead."
            )
        if isinstance(optimizer, OptimiOptimizer) and not optimizer.defaults.get("gradient_release"):
            kind = type(optimizer).__name__
            raise ValueError(
                f"torch-optimi's {kind} counts its steps per param group, so one step per parameter inside "
                "backward would advance its bias correction once per parameter. Build it with "
                f"optimi.{kind}(..., gradient_release=True), which steps one parameter at a time, or use "
                "GradientRelease instead."
            )
        for group in optimizer.param_groups:
            for p in group["params"]:
                if owners.setdefault(id(p), (optimizer, group))[0] is not optimizer:
                    raise ValueError(
                        f"A parameter of shape {tuple(p.shape)} is in two optimizers; each parameter's "
                        "update must come from one optimizer to be fused into backward."
                    )
                if p.requires_grad:
                    params.append(p)
        optimizer.zero_grad(set_to_none=True)
    handles = [
        p.register_post_accumulate_grad_hook(functools.partial(_step_one, owner=owners[id(p)]))
        for p in params
    ]
    return FusedStep(handles)


def needs_closure(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step`` requires a closure (``torch.optim.LBFGS``: it re-evaluates the loss)."""
    try:
        closure = inspect.signature(type(optimizer).step).parameters.get("closure")
    except (TypeError, ValueError):  # no signature to read (a C extension): assume the usual step()
        return False
    return closure is not None and closure.default is inspect.Parameter.empty


@torch.no_grad()
def _step_one(param: Tensor, owner: tuple[Optimizer, dict]) -> None:
    optimizer, group = owner
    gradient_consumed(param)  # a tracker watching the step counts it as a gradient before it goes
    if isinstance(optimizer, OptimiOptimizer):
        # Its per-parameter path (gradient_release=True) reads the hyperparameters from
        # state[param]["group"], which Lightning's optimizer_to_device and load_state_dict replace with a
        # copy: a scheduler's learning rate would no longer reach it. Point it at the live group.
        optimizer.state[param]["group"] = group
        optimizer.step(param=param)
    else:
        optimizer.step()  # only `param` has a gradient now: the others are None
    param.grad = None


def _optimizers(given: object) -> list[Optimizer]:
    """``given``, an iterable of optimizers, as a list; else the ``TypeError``/``ValueError`` saying so."""
    expected = "fuse_optimizer_step takes a torch.optim.Optimizer or a list of them"
    if isinstance(given, str) or not isinstance(given, Iterable):
        raise TypeError(f"{expected}; got {type(given).__name__}")
    optimizers = list(given)
    wrong = [type(o).__name__ for o in optimizers if not isinstance(o, Optimizer)]
    if wrong:
        raise TypeError(f"{expected}; got a list with {', '.join(wrong)}")
    if not optimizers:
        raise ValueError(f"{expected}; got none: there is nothing to fuse into backward")
    return optimizers
