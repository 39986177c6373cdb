"""The training step as Lightning runs it, outside a Trainer: the adapters every planner shares.

`estimate_memory` simulates a step, AutoFit times real ones and the checkpointing planner profiles
blocks inside one; all of them run a ``LightningModule``'s own ``training_step`` and
``configure_optimizers`` without a ``Trainer.fit`` around them. What that takes lives here, once:

- `lightning_stand_ins`: ``self.log`` that logs nothing, a stand-in Trainer for ``configure_optimizers``
  that reads ``self.trainer``, and ``self.device`` set to the device the step's tensors are on;
- `optimizers_from` and `loss_of`: the optimizers and the loss in whatever Lightning's hooks return;
- `TrainingStep`: forward, ``zero_grad``, backward and ``optimizer.step`` in Lightning's order (or a plain
  loop's), closures for LBFGS, gradient accumulation;
- `batch_size`, `batch_slice`, `pieces`, `repeat_batch`: a batch's samples (along each tensor's sample
  dimension, `SampleAxes`: dim 0 unless the loader shows another) and cutting it into micro-batches.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from torch import Tensor, nn

from lightning_memkit._levers.fused_step import fuse_optimizer_step, needs_closure
from lightning_memkit._levers.offload import Offload

__all__ = [
    "AmbiguousAxes",
    "SampleAxes",
    "TrainingStep",
    "batch_size",
    "batch_slice",
    "batch_tensors",
    "default_axes",
    "is_lightning",
    "lightning_stand_ins",
    "loader_axes",
    "loss_of",
    "optimizers_from",
    "parts_without_samples",
    "pieces",
    "repeat_batch",
]


# --------------------------------------------------------------------------------------------------
# Lightning's hooks outside a Trainer
# --------------------------------------------------------------------------------------------------


def is_lightning(model: nn.Module) -> bool:
    return isinstance(model, pl.LightningModule)


def without_parameters(model: nn.Module) -> str | None:
    """Why ``model``'s step cannot be estimated or planned where it has no parameters, in a sentence
    (``None`` where it has some): it trains nothing, or its ``configure_model`` has yet to build them."""
    if any(True for _ in model.parameters()):
        return None
    from lightning.pytorch.utilities.model_helpers import is_overridden

    name = type(model).__name__
    if not (is_lightning(model) and is_overridden("configure_model", model)):
        return f"{name} has no parameters: its step trains nothing, so there is nothing to estimate or plan."
    return (
        f"{name} has no parameters yet: its configure_model builds them, which a Trainer runs after AutoFit "
        "and AutoFitStrategy plan (at setup), and estimate_memory does not run. Build the layers in __init__ "
        '(under `with torch.device("meta"):` for a model too large for the host, with AutoFitStrategy, '
        "which materializes it once sharded), so that they are planned."
    )


@contextlib.contextmanager
def lightning_stand_ins(module: nn.Module, device: torch.device) -> Iterator[None]:
    """Make a LightningModule's hooks runnable outside ``Trainer.fit``, and undo it afterwards.

    - ``self.log``/``self.log_dict`` become no-ops (they would log fake tensors);
    - a module attached to no Trainer gets a stand-in ``Trainer(max_steps=1000, max_epochs=-1)``, so that
      ``configure_optimizers`` may read ``self.trainer.estimated_stepping_batches`` (it is 1000);
    - ``self.device`` is ``device`` (where the step's tensors live: the CPU of the fake tensors in a
      simulation, the model's device when the step runs for real).
    """
    saved = {k: module.__dict__[k] for k in ("log", "log_dict") if k in module.__dict__}
    module.__dict__["log"] = module.__dict__["log_dict"] = _no_op
    saved_device = module._device  # DeviceDtypeModuleMixin's: `self.device` has no setter
    module._device = device
    try:
        attach = module.trainer is None  # attached to a Trainer, or to Fabric (a shim Trainer)
    except RuntimeError:  # "... is not attached to a `Trainer`"
        attach = True
    if attach:
        pl_logger = logging.getLogger("lightning.pytorch")
        level = pl_logger.level
        pl_logger.setLevel(logging.WARNING)  # "GPU available: ..." and tips
        try:
            module.trainer = pl.Trainer(
                max_steps=1000, max_epochs=-1, accelerator="cpu", devices=1, logger=False,
                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            )  # fmt: skip
        finally:
            pl_logger.setLevel(level)
    try:
        yield
    finally:
        if attach:
            module.trainer = None
        module._device = saved_device
        for k in ("log", "log_dict"):
            module.__dict__.pop(k, None)
        module.__dict__.update(saved)


def _no_op(*args: Any, **kwargs: Any) -> None:
    return None


def loss_of(output: Any) -> Tensor:
    """The loss in what ``training_step`` returned: a tensor, or a dict with ``"loss"``."""
    loss = output.get("loss") if isinstance(output, dict) else output
    if not isinstance(loss, Tensor):
        raise TypeError(
            f"training_step() returned {type(output).__name__}; the estimate needs the loss to run the "
            "backward pass: return a tensor or a dict with a 'loss' tensor."
        )
    return loss


def optimizers_from(config: Any) -> list[torch.optim.Optimizer]:
    """The optimizers in whatever ``configure_optimizers`` returned (all of Lightning's forms)."""
    if config is None:
        return []
    if isinstance(config, torch.optim.Optimizer):
        return [config]
    if isinstance(config, dict):
        return optimizers_from(config.get("optimizer"))
    if isinstance(config, (list, tuple)):
        if len(config) == 2 and isinstance(config[0], (list, tuple)):  # ([optimizers], [schedulers])
            return optimizers_from(list(config[0]))
        return [opt for item in config for opt in optimizers_from(item)]
    raise TypeError(f"configure_optimizers() returned {type(config).__name__}, which holds no optimizer")


# --------------------------------------------------------------------------------------------------
# The step
# --------------------------------------------------------------------------------------------------


@dataclass
class TrainingStep:
    """What runs in one simulated step; ``lightning`` selects Lightning's order of the phases,
    ``release_gradients`` frees the gradients once the optimizers have stepped (`release_gradients`), so
    that Lightning's next forward runs without them, ``fused_step`` steps each parameter inside backward
    (`fuse_optimizer_step`), and ``offload`` is the optimizers' `offload_optimizer`, already installed: the
    gradients leave for the host as they complete and accumulate there."""

    forward: Callable[[], Tensor]
    optimizers: list[torch.optim.Optimizer]
    lightning: bool
    accumulating: bool = False
    release_gradients: bool = False
    fused_step: bool = False
    offload: Offload | None = None
    #: installs ``offload`` when the first backward starts (a first step: the masters are made there)
    offload_at_backward: Callable[[], Offload] | None = None

    @property
    def frees_after_step(self) -> bool:
        """Whether the gradients are gone once the optimizers have stepped: a plain loop's ``zero_grad``
        after the step, released, or consumed inside backward; Lightning's own ``zero_grad`` comes after
        the next forward."""
        return not self.lightning or self.release_gradients or self.fused_step or self.offload is not None

    @property
    def with_closure(self) -> bool:
        """Whether an optimizer's ``step`` runs the forward and backward itself (`needs_closure`)."""
        return any(needs_closure(optimizer) for optimizer in self.optimizers)

    def zero_grad(self) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)

    def step(self, closure: Callable[[], Tensor] | None = None) -> None:
        for optimizer in self.optimizers:
            if closure is None:
                optimizer.step()
            else:
                optimizer.step(closure)

    def run(self, tracker: Any = None) -> None:
        """One step; ``tracker.phase`` (when given) is set to the phase running."""

        def phase(name: str) -> None:
            if tracker is not None:
                tracker.phase = name

        if self.fused_step:  # the optimizers step inside backward; Lightning's step() after it does nothing
            with fuse_optimizer_step(self.optimizers):  # refuses an optimizer that needs a closure
                self._forward_backward(phase)
            return
        if self.with_closure:
            self._run_in_step(phase)
            return
        self._forward_backward(phase)
        phase("optimizer")
        self.step()
        if self.frees_after_step:
            phase("zero_grad")
            self.zero_grad()

    def _forward_backward(self, phase: Callable[[str], None]) -> Tensor:
        """The loss and its backward. Lightning's automatic optimization runs training_step, zero_grad,
        backward: the previous step's gradients are still live during the forward."""
        phase("forward")
        loss = self.forward()
        if self.lightning and not self.accumulating:
            phase("zero_grad")
            self.zero_grad()
        phase("backward")
        if self.offload_at_backward is not None:
            self.offload, self.offload_at_backward = self.offload_at_backward(), None
        loss.backward()
        return loss.detach()

    def _run_in_step(self, phase: Callable[[str], None]) -> None:
        """The step of an optimizer that evaluates the loss itself (LBFGS): ``optimizer.step(closure)``,
        the closure being what Lightning's is (training_step, zero_grad, backward) or a plain loop's
        (zero_grad, forward, backward). The optimizer calls it as often as its own logic decides."""

        def closure() -> Tensor:
            if not self.lightning and not self.accumulating:
                phase("zero_grad")
                self.zero_grad()
            loss = self._forward_backward(phase)
            phase("optimizer")
            return loss

        phase("optimizer")
        self.step(closure)
        if self.frees_after_step:
            phase("zero_grad")
            self.zero_grad()

    def warm_up(self, model: nn.Module, *, state: bool = True) -> None:
        """Create the optimizer state a real first step would (``state``), without running forward or
        backward, and leave the gradients the measured step starts with."""
        self._zero_gradients(model)
        if state:
            # An optimizer that wants a closure gets one returning a loss; the gradients are the zeros above.
            self.step(_zero_loss if self.with_closure else None)
            for optimizer in self.optimizers:
                _full_lbfgs_history(optimizer)
        # In Lightning the gradients live on until the next zero_grad (unless released); an accumulating
        # micro-batch finds the earlier micro-batches' gradients.
        if self.frees_after_step and not self.accumulating:
            self.zero_grad()
        elif self.offload is not None:  # the step freed them on the host: the cycle's earlier ones, there
            self._zero_gradients(model)

    def _zero_gradients(self, model: nn.Module) -> None:
        for p in model.parameters():
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
        if self.offload is not None:
            self.offload.take_gradients()


def _zero_loss() -> Tensor:
    return torch.zeros(())


def _full_lbfgs_history(optimizer: torch.optim.Optimizer) -> None:
    """Give an LBFGS its steady-state curvature history: ``history_size`` pairs of flattened-parameter
    vectors (``old_dirs``, ``old_stps``) and their scalars (``ro``, ``al``).

    LBFGS adds a pair at each inner iteration whose curvature ``y.s`` is positive, a value fake tensors do
    not have; a real run fills the history within ``history_size / max_iter`` steps and keeps it full,
    dropping the oldest pair for each new one. The simulated step computes the new pair ``y, s`` and keeps
    it alive through the closure but, reading ``y.s > 0`` as False, does not store it: so ``history_size -
    1`` pairs are stored here, and the step holds ``history_size`` pairs at its peak, as a real one does.
    """
    if not isinstance(optimizer, torch.optim.LBFGS):
        return
    state = optimizer.state[optimizer._params[0]]
    flat = state.get("prev_flat_grad")  # (n_params,), made by the warm-up step's first iteration
    if flat is None:
        return
    size = optimizer.param_groups[0]["history_size"]
    state["old_dirs"] = [torch.zeros_like(flat) for _ in range(size - 1)]
    state["old_stps"] = [torch.zeros_like(flat) for _ in range(size - 1)]
    state["ro"] = [flat.new_ones(()) for _ in range(size - 1)]  # 1 / (y.s), 0-dim
    state["al"] = [flat.new_zeros(()) for _ in range(size)]  # the two-loop recursion's coefficients


# --------------------------------------------------------------------------------------------------
# Batches
# --------------------------------------------------------------------------------------------------


#: Which dimension of each tensor in a batch counts its samples, one entry per tensor in the order
#: ``apply_to_collection`` visits them: a dimension; ``(dimension, rows)`` for a tensor of ``rows`` rows a
#: sample (two augmented views of each: 2); or ``None`` for a tensor every sample shares (kept whole when
#: the batch is cut or repeated: Hugging Face's ``position_ids`` of shape (1, T), a 0-dim scalar).
#: `default_axes` reads it off one batch; `loader_axes` off batches of one loader at several sizes.
SampleAxes = tuple[int | tuple[int, int] | None, ...]


class AmbiguousAxes(ValueError):
    """A tensor moved with the batch size along more than one dimension: batches at another size tell."""


def _dim_rows(axis: int | tuple[int, int]) -> tuple[int, int]:
    """An entry of `SampleAxes` as (dimension, rows a sample)."""
    return (axis, 1) if isinstance(axis, int) else axis


def default_axes(batch: Any) -> SampleAxes:
    """Dimension 0 of every tensor, except 0-dim tensors and tensors whose dimension 0 is 1 beside others
    with more (broadcast over the samples, as Hugging Face's ``position_ids`` of shape (1, T) are)."""
    firsts = [t.shape[0] if t.dim() > 0 else None for _, t in _named_tensors(batch)]
    most = max((n for n in firsts if n is not None), default=0)
    return tuple(None if n is None or (n == 1 and most > 1) else 0 for n in firsts)


def loader_axes(batches: list[tuple[Any, int]]) -> SampleAxes | None:
    """`SampleAxes` read off batches of one loader, each ``(batch, n)`` built with ``n`` samples a batch:
    each tensor's samples lie along the dimension whose size moved in proportion to ``n`` (which is not
    always dimension 0: torch's RNNs take (T, B, ...); a padded time dimension moves too, but not in
    proportion), ``rows`` a sample where it is a multiple of ``n``. A tensor whose sizes did not move is
    shared by the samples. ``None`` when no tensor moved: the loader ignores the batch size it was given.

    Raises:
        AmbiguousAxes: a tensor moved in proportion along several dimensions (more batches may tell).
        ValueError: the batches hold different tensors, so they cannot be matched; a tensor moved by a
            fraction of a row a sample.
    """
    named = [_named_tensors(batch) for batch, _ in batches]
    n_first, n_second = batches[0][1], batches[1][1]
    xs, ys = named[0], named[1]
    if [name for name, _ in xs] != [name for name, _ in ys]:
        if len(xs) != len(ys) and len(xs) * n_second == len(ys) * n_first:
            raise ValueError(
                f"its batches list their samples, one tensor each ({len(xs)} tensors at {n_first} samples, "
                f"{len(ys)} at {n_second}), which cannot be cut into micro-batches: collate each field into "
                "one tensor with a batch dimension"
            )
        raise ValueError(
            f"its batches hold different tensors at {n_first} and at {n_second} samples "
            f"({', '.join(n for n, _ in xs)} against {', '.join(n for n, _ in ys)}), so their samples "
            "cannot be matched: give the loader a fixed structure (the same keys and tensors in every batch)"
        )
    axes: list[int | tuple[int, int] | None] = []
    for i, (name, x) in enumerate(xs):
        shapes = [tuple(tensors[i][1].shape) for tensors in named]
        sizes = [n for _, n in batches]
        if len({len(shape) for shape in shapes}) != 1:
            raise ValueError(f"{name} has {len(shapes[0])} dimensions at {n_first} samples and "
                             f"{len(shapes[1])} at {n_second}")  # fmt: skip
        moved = [
            d
            for d in range(x.dim())
            if len({shape[d] for shape in shapes}) > 1
            and all(
                shapes[k][d] * sizes[k + 1] == shapes[k + 1][d] * sizes[k] for k in range(len(shapes) - 1)
            )
        ]
        if len(moved) > 1:
            raise AmbiguousAxes(
                f"{name} moved with the batch size along dimensions {', '.join(map(str, moved))} "
                f"({' then '.join(map(str, shapes))} at {', '.join(map(str, sizes))} samples), so which one "
                "holds the samples cannot be told"
            )
        if not moved:
            axes.append(None)
            continue
        d = moved[0]
        rows, left = divmod(shapes[0][d], sizes[0])
        if left or rows == 0:
            raise ValueError(
                f"{name} holds {shapes[0][d]} rows along dimension {d} at {sizes[0]} samples and "
                f"{shapes[1][d]} at {sizes[1]}: a fraction of a row a sample (an attribute that counts the "
                "global batch, divided among the ranks?); AutoFit sets the number of samples each "
                "rank's batch holds"
            )
        axes.append(d if rows == 1 else (d, rows))
    return tuple(axes) if any(axis is not None for axis in axes) else None


def parts_without_samples(batch: Any, axes: SampleAxes, parts: list[Any]) -> list[Any]:
    """Of ``batch``'s top-level ``parts`` (its keys, or its indices), those none of whose tensors holds
    samples: one loader's batch, of several combined, that ignores the batch size."""
    named = [name for name, _ in _named_tensors(batch)]

    def within(name: str, part: Any) -> bool:
        head = f"batch[{part!r}]"
        return name == head or name.startswith((f"{head}[", f"{head}."))

    return [
        part
        for part in parts
        if any(within(n, part) for n in named)
        and all(axis is None for n, axis in zip(named, axes, strict=True) if within(n, part))
    ]


def batch_size(batch: Any, axes: SampleAxes | None = None) -> int:
    """The number of samples in ``batch``: its tensors' sizes along their sample dimension (``axes``,
    default `default_axes`), which must agree."""
    axes = default_axes(batch) if axes is None else axes
    named = _named_tensors(batch)
    _check_axes(named, axes)
    sizes = {
        name: (t.shape[_dim_rows(axis)[0]] // _dim_rows(axis)[1], _dim_rows(axis)[0])
        for (name, t), axis in zip(named, axes, strict=True)
        if axis is not None
    }
    counts = {n for n, _ in sizes.values()}
    if len(counts) != 1:
        said = ", ".join(f"{name} {n} (dim {axis})" for name, (n, axis) in sizes.items()) or "no tensor"
        raise ValueError(
            f"The batch's tensors disagree on how many samples it holds: {said}. Each tensor's samples "
            "are read along one dimension (dim 0 unless the loader shows another); a tensor every sample "
            "shares may have size 1 there."
        )
    size = counts.pop()
    if size == 0:
        raise ValueError(
            "The example batch is empty: its tensors have 0 samples, and a plan needs at least one sample "
            "per GPU. Pass a batch of the global batch size, e.g. the train dataloader's first."
        )
    return size


def batch_slice(batch: Any, stop: int, start: int = 0, axes: SampleAxes | None = None) -> Any:
    """Samples ``start:stop`` of every tensor in ``batch`` (along ``axes``, default `default_axes`); other
    leaves, and tensors the samples share, are kept whole."""
    return _per_sample(batch, axes, lambda t, dim, k: rows(t, start * k, stop * k, dim))


def repeat_batch(batch: Any, copies: int, axes: SampleAxes | None = None) -> Any:
    """``batch`` with its samples ``copies`` times (`repeat_rows` along ``axes``): the global batch of a
    step that accumulates or runs on several ranks, from one micro-batch."""
    return _per_sample(batch, axes, lambda t, dim, k: repeat_rows(t, copies, dim))


def _per_sample(batch: Any, axes: SampleAxes | None, fn: Callable[[Tensor, int, int], Tensor]) -> Any:
    """``fn(t, dimension, rows a sample)`` on each tensor of ``batch`` that holds samples (`SampleAxes`)."""
    axes = default_axes(batch) if axes is None else axes
    _check_axes(_named_tensors(batch), axes)
    each = iter(axes)

    def one(t: Tensor) -> Tensor:
        axis = next(each)
        return t if axis is None else fn(t, *_dim_rows(axis))

    return apply_to_collection(batch, Tensor, one)


def _check_axes(named: list[tuple[str, Tensor]], axes: SampleAxes) -> None:
    if len(named) != len(axes):
        raise ValueError(
            f"the batch holds {len(named)} tensors ({', '.join(n for n, _ in named)}), but its sample "
            f"dimensions were read for {len(axes)}: the loader's batches changed their structure"
        )


def batch_tensors(batch: Any) -> list[Tensor]:
    """The tensors of ``batch``, in the order ``apply_to_collection`` visits them (`SampleAxes`' order)."""
    found: list[Tensor] = []
    apply_to_collection(batch, Tensor, found.append)
    return found


def _named_tensors(batch: Any) -> list[tuple[str, Tensor]]:
    """The tensors of ``batch`` in the order ``apply_to_collection`` visits them, each with a name for
    messages (``batch['input_ids']``, ``batch[0]``)."""
    found = batch_tensors(batch)
    names: list[str] = []

    def walk(obj: Any, name: str) -> None:
        if isinstance(obj, Tensor):
            names.append(name)
        elif isinstance(obj, Mapping):
            for key, value in obj.items():
                walk(value, f"{name}[{key!r}]")
        elif isinstance(obj, (list, tuple)):
            for i, value in enumerate(obj):
                walk(value, f"{name}[{i}]")
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            for field in dataclasses.fields(obj):
                walk(getattr(obj, field.name), f"{name}.{field.name}")

    walk(batch, "batch")
    if len(names) != len(found):  # a collection only apply_to_collection knows: numbered
        names = [f"tensor {i}" for i in range(len(found))]
    return list(zip(names, found, strict=True))


def rows(t: Tensor, start: int, stop: int, axis: int = 0) -> Tensor:
    """Samples ``start:stop`` of ``t`` along ``axis``, for a tensor of any layout: sparse ones (COO, CSR,
    CSC, BSR, BSC), which cannot be sliced, are cut through COO and given their layout back."""
    stop = min(stop, t.shape[axis])
    if t.layout == torch.strided:
        return t.narrow(axis, start, max(0, stop - start))
    index = torch.arange(start, stop, device=t.device)
    return _layout_of(t, _coo(t).index_select(axis, index))


def repeat_rows(t: Tensor, copies: int, axis: int = 0) -> Tensor:
    """``t`` ``copies`` times along ``axis``, for a tensor of any layout (see `rows`)."""
    if t.layout == torch.strided:
        return torch.cat([t] * copies, dim=axis)
    return _layout_of(t, torch.cat([_coo(t)] * copies, dim=axis))


def _coo(t: Tensor) -> Tensor:
    return t if t.layout == torch.sparse_coo else t.to_sparse_coo()


def _layout_of(like: Tensor, coo: Tensor) -> Tensor:
    """``coo`` in the sparse layout of ``like``."""
    if like.layout == torch.sparse_coo:
        return coo.coalesce()
    if like.layout in (torch.sparse_bsr, torch.sparse_bsc):
        blocks = tuple(like.values().shape[1:3])
        if all(n % b == 0 for n, b in zip(coo.shape[-2:], blocks, strict=True)):
            return coo.to_sparse(layout=like.layout, blocksize=blocks)
        # Rows (columns) that the blocks do not divide (a planner's micro-batch of 1, a slice across a
        # block): compressed rows (columns) instead, the same values.
        return coo.to_sparse(layout=torch.sparse_csr if like.layout == torch.sparse_bsr else torch.sparse_csc)
    return coo.to_sparse(layout=like.layout)


def pieces(batch: Any, size: int, axes: SampleAxes | None = None) -> list[Any]:
    """``batch`` cut into consecutive slices of ``size`` samples (along ``axes``; the last may be shorter).

    Only tensors are cut; a batch that also holds strings or numbers (per-sample lists, say) is refused
    rather than cut out of step with its tensors.
    """
    others: list[Any] = []
    apply_to_collection(batch, (str, bytes, int, float), others.append)
    if others:
        kind = type(others[0]).__name__
        raise ValueError(f"it holds values other than tensors ({kind}), which cannot be cut")
    axes = default_axes(batch) if axes is None else axes
    total = batch_size(batch, axes)
    return [batch_slice(batch, min(start + size, total), start, axes) for start in range(0, total, size)]
