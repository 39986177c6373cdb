"""The training step as Lightning runs it, outside a Trainer: the adapters every planner shares.

`estimate_memory` simulates a step, AutoFit times real ones and the checkpointing planner profiles
blocks inside one; all of them run a ``LightningModule``'s own ``training_step`` and
``configure_optimizers`` without a ``Trainer.fit`` around them. What that takes lives here, once:

- `lightning_stand_ins`: ``self.log`` that logs nothing, a stand-in Trainer for ``configure_optimizers``
  that reads ``self.trainer``, and ``self.device`` set to the device the step's tensors are on;
- `optimizers_from` and `loss_of`: the optimizers and the loss in whatever Lightning's hooks return;
- `TrainingStep`: forward, ``zero_grad``, backward and ``optimizer.step`` in Lightning's order (or a plain
  loop's), closures for LBFGS, gradient accumulation;
- `batch_size`, `batch_slice`, `pieces`: a batch's samples along dim 0 and cutting it into micro-batches.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from torch import Tensor, nn

from lightning_memkit._levers.fused_step import fuse_optimizer_step, needs_closure
from lightning_memkit._levers.offload import Offload

__all__ = [
    "TrainingStep",
    "batch_size",
    "batch_slice",
    "is_lightning",
    "lightning_stand_ins",
    "loss_of",
    "optimizers_from",
    "pieces",
]


# --------------------------------------------------------------------------------------------------
# Lightning's hooks outside a Trainer
# --------------------------------------------------------------------------------------------------


def is_lightning(model: nn.Module) -> bool:
    return isinstance(model, pl.LightningModule)


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


def batch_size(batch: Any) -> int:
    """The number of samples in ``batch``: the size of its tensors along dim 0, which must agree."""
    sizes: set[int] = set()
    apply_to_collection(batch, Tensor, lambda t: sizes.add(t.shape[0]) if t.dim() > 0 else None)
    if len(sizes) != 1:
        raise ValueError(
            f"The example batch must hold tensors of one size along dim 0 (the global batch); got sizes "
            f"{sorted(sizes) or 'none'}"
        )
    size = sizes.pop()
    if size == 0:
        raise ValueError(
            "The example batch is empty: its tensors have 0 samples along dim 0, and a plan needs at least "
            "one sample per GPU. Pass a batch of the global batch size, e.g. the train dataloader's first."
        )
    return size


def batch_slice(batch: Any, stop: int, start: int = 0) -> Any:
    """Samples ``start:stop`` of every tensor in ``batch`` (dim 0); other leaves are kept whole."""
    return apply_to_collection(batch, Tensor, lambda t: rows(t, start, stop) if t.dim() > 0 else t)


def rows(t: Tensor, start: int, stop: int) -> Tensor:
    """``t[start:stop]`` for a tensor of any layout: sparse ones (COO, CSR, CSC, BSR, BSC), which cannot be
    sliced, are cut through COO and given their layout back."""
    if t.layout == torch.strided:
        return t[start:stop]
    index = torch.arange(start, min(stop, t.shape[0]), device=t.device)
    return _layout_of(t, _coo(t).index_select(0, index))


def repeat_rows(t: Tensor, copies: int) -> Tensor:
    """``t`` ``copies`` times along dim 0, for a tensor of any layout (see `rows`)."""
    if t.layout == torch.strided:
        return torch.cat([t] * copies)
    return _layout_of(t, torch.cat([_coo(t)] * copies))


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


def pieces(batch: Any, size: int) -> list[Any]:
    """``batch`` cut along dim 0 into consecutive slices of ``size`` samples (the last may be shorter).

    Only tensors are cut; a batch that also holds strings or numbers (per-sample lists, say) is refused
    rather than cut out of step with its tensors.
    """
    others: list[Any] = []
    apply_to_collection(batch, (str, bytes, int, float), others.append)
    if others:
        kind = type(others[0]).__name__
        raise ValueError(f"it holds values other than tensors ({kind}), which cannot be cut")
    total = batch_size(batch)
    return [batch_slice(batch, min(start + size, total), start) for start in range(0, total, size)]
