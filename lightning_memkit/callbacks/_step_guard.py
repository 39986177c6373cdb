"""The guard `AutoFit` puts around a module's training step: an out-of-memory error becomes a leaner plan.

Where. The guard replaces the module's ``training_step`` and ``backward`` hooks (instance attributes,
removed afterwards), so it sees an OOM raised in the forward or in the backward. The ``training_step``
Lightning calls runs the module's own forward and hands Lightning a detached copy of the loss (and of any
other tensor it returns); the real loss, with its graph, stays with the guard, which back-propagates it
when Lightning calls ``backward`` (after its ``zero_grad``). Lightning scales what it back-propagates
(``1 / accumulate_grad_batches``, then the AMP grad scaler); the guard reads that factor as the gradient of
Lightning's tensor with respect to the copy and applies it to the real loss. Holding the only reference to
the graph is what lets an OOM in the backward free the failed attempt's activations before the retry.
Slices run from ``backward`` enter the precision plugin's ``train_step_context`` (autocast) as Lightning's
own ``training_step`` call does.

Exactness. A retried batch must not count any gradient twice. An OOM in the forward leaves the gradients
as they were. An OOM in the backward may leave some parameters' gradients accumulated: autograd runs a
parameter's ``AccumulateGrad`` once, with its complete gradient for the loss, so every parameter holds all of
the failed attempt's contribution or none of it. Post-accumulate-grad hooks record which ones hold it, and
the retry runs with those frozen (``requires_grad=False``), so each of the others receives its share once.

Slicing. A leaner plan's smaller micro-batch takes effect at once: the dataloader keeps its batch size (it
is not rebuilt mid-epoch), and the guard cuts each batch into slices of the new size, run one after the
other, each loss weighted by its slice's share of the batch. Like Lightning's own gradient accumulation,
this assumes ``training_step`` returns a mean over the batch. The first slice runs inside Lightning's
``training_step`` call, the others inside its ``backward`` call, so Lightning's ``zero_grad`` precedes all of
them. What Lightning sees of the step is the first slice's: the loss it reports and the outputs
``on_train_batch_end`` receives; ``self.log(..., on_step=True)`` keeps the last slice's value. A retried
forward runs the module's code again: BatchNorm statistics, metrics and epoch aggregates see the failed
attempt too, and BatchNorm normalizes each slice by its own statistics, so gradients are exact for models
without batch-dependent layers.

Not covered: an OOM in the optimizer step (a partly applied update cannot be undone), manual optimization
(the module runs its own backward), strategies that wrap the model or run their own backward (DDP, FSDP,
DeepSpeed) and several processes (the other ranks would wait in the all-reduce). `AutoFit` installs the
guard only where it applies.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from lightning_memkit._estimating.lightning_step import SampleAxes, batch_size, pieces
from lightning_memkit._fitting.plan import FitPlan
from lightning_memkit.callbacks._trainer import logging_as_training_step

__all__ = ["StepGuard"]

_HOOKS = ("training_step", "backward")


@dataclass(frozen=True)
class _Piece:
    """Part of a dataloader batch still to run."""

    batch: Any
    #: its loss's weight: its share of the dataloader's batch
    weight: float = 1.0
    #: parameters whose gradient for these samples is already accumulated (kept out of the retry)
    frozen: frozenset[Tensor] = frozenset()


class StepGuard:
    """Runs a module's training steps so that an OOM re-plans (``replan``) and retries instead of crashing.

    Args:
        trainer: the Trainer running ``module`` (one device, automatic optimization).
        module: the LightningModule.
        replan: switches to the next leaner plan and returns it; raises when none is left.
        micro_batch_size: the dataloader's batch size.
        axes: each tensor's sample dimension in its batches (`SampleAxes`; default `default_axes`).
    """

    def __init__(
        self,
        trainer: pl.Trainer,
        module: pl.LightningModule,
        replan: Callable[[], FitPlan],
        micro_batch_size: int,
        axes: SampleAxes | None = None,
    ) -> None:
        self.trainer, self.module, self.replan = trainer, module, replan
        self.micro_batch_size, self.axes = micro_batch_size, axes
        #: the micro-batch the batches are cut into; ``None`` while the dataloader's batches are run whole
        self.size: int | None = None
        self._originals = {name: module.__dict__.get(name) for name in _HOOKS}
        self._step, self._backward = module.training_step, module.backward
        self._queue: list[_Piece] = []
        self._pending: tuple[_Piece, Tensor, Tensor] | None = None  # (piece, loss with graph, detached copy)
        self._args: tuple[Any, ...] = ()
        self._kwargs: dict[str, Any] = {}
        self._touched: set[Tensor] = set()
        self._hooks: list[Any] = []
        module.__dict__.update(training_step=self.training_step, backward=self.backward)
        #: whether an OOM is recovered from (the first steps); otherwise it propagates
        self.catching = True

    def catch(self, enabled: bool) -> None:
        self.catching = enabled
        self._unhook()

    def _hook(self) -> None:
        """Watch which parameters receive a gradient. Registered at each guarded step, not once: layers
        that ``configure_model`` creates after ``setup`` are watched too."""
        self._unhook()
        trainable = (p for p in self.module.parameters() if p.requires_grad)
        self._hooks = [p.register_post_accumulate_grad_hook(self._touched.add) for p in trainable]

    def _unhook(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def remove(self) -> None:
        """Give the module its own hooks back."""
        self.catch(False)
        for name, original in self._originals.items():
            self.module.__dict__.pop(name, None)
            if original is not None:
                self.module.__dict__[name] = original

    # --- the two hooks ------------------------------------------------------------------------------

    def training_step(self, batch: Any, *args: Any, **kwargs: Any) -> Any:
        if self._pending is not None or self._queue:
            rank_zero_warn(
                "AutoFit: the last step's backward did not run (a callback skipped it?); its remaining "
                "slices are dropped."
            )
            self._pending, self._queue = None, []
        if self.catching:
            self._hook()
        self._args, self._kwargs = args, kwargs
        self._queue = self._cut(_Piece(batch))
        while True:
            piece = self._queue.pop(0)
            self._touched.clear()
            try:
                output = self._step(piece.batch, *args, **kwargs)
                break
            except torch.OutOfMemoryError:
                if not self.catching:
                    raise
            self._recover(piece)  # outside the except block: the failed attempt's frames are gone
        loss = _loss_of(output)
        if loss is None:  # the module skips this batch
            self._queue.clear()
            return output
        copy = loss.detach().requires_grad_()
        self._pending = (piece, loss, copy)
        if not isinstance(output, Mapping):
            return copy
        rest = apply_to_collection({k: v for k, v in output.items() if k != "loss"}, Tensor, Tensor.detach)
        return {**rest, "loss": copy}

    def backward(self, loss: Tensor, *args: Any, **kwargs: Any) -> None:
        if self._pending is None:  # not a loss this guard handed out
            self._backward(loss, *args, **kwargs)
            return
        piece, real, copy = self._pending
        self._pending = None
        (scale,) = torch.autograd.grad(loss, copy)  # Lightning's 1 / accumulate_grad_batches and AMP scale
        while True:
            self._touched.clear()
            try:
                with _frozen(piece.frozen):
                    if real is None:
                        with logging_as_training_step(self.module), self._precision():
                            real = _loss_of(self._step(piece.batch, *self._args, **self._kwargs))
                    # Every parameter may already hold its share (an OOM after the last accumulation).
                    if real is not None and real.requires_grad:
                        self._backward(real * (scale * piece.weight), *args, **kwargs)
                failed = False
            except torch.OutOfMemoryError:
                if not self.catching:
                    raise
                failed = True
            real = None  # the graph (of a failed attempt: its saved activations) is freed here
            if failed:
                self._recover(piece, self._touched)
            if not self._queue:
                return
            piece = self._queue.pop(0)

    # --- recovery -----------------------------------------------------------------------------------

    def _precision(self) -> Any:
        return self.trainer.precision_plugin.train_step_context()

    def _recover(self, piece: _Piece, touched: Iterable[Tensor] = ()) -> None:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        size = self.replan().micro_batch_size
        if size < self.micro_batch_size:  # else only the checkpointing changed: nothing to cut
            self.size = size
        # The failed piece and those still queued at the old size, all cut to the new one.
        failed = replace(piece, frozen=piece.frozen | frozenset(touched))
        self._queue = [part for queued in (failed, *self._queue) for part in self._cut(queued)]

    def _cut(self, piece: _Piece) -> list[_Piece]:
        if self.size is None:
            return [piece]
        try:
            rows = batch_size(piece.batch, self.axes)
            parts = pieces(piece.batch, self.size, self.axes) if rows > self.size else [piece.batch]
        except ValueError as error:
            raise RuntimeError(
                f"AutoFit re-planned to micro-batch {self.size} and must cut each batch into its samples, "
                f"but this batch cannot be cut: {error}. Lower the budget given to AutoFit so that the plan "
                "starts at this micro-batch."
            ) from error
        if len(parts) == 1:
            return [piece]
        return [
            replace(piece, batch=part, weight=piece.weight * batch_size(part, self.axes) / rows)
            for part in parts
        ]


def _loss_of(output: Any) -> Tensor | None:
    return output.get("loss") if isinstance(output, Mapping) else output


@contextmanager
def _frozen(params: frozenset[Tensor]) -> Iterator[None]:
    flags = [(p, p.requires_grad) for p in params]
    for p in params:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)
