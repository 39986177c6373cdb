"""The guard `AutoFit` puts around a module's training step: an out-of-memory error becomes a leaner plan.

Where. The guard replaces the module's ``training_step`` and ``backward`` hooks (instance attributes,
removed afterwards), so it sees an OOM raised in the forward or in the backward. The ``training_step``
Lightning calls runs the module's own forward and hands Lightning a detached copy of the loss; the real
loss, with its graph, stays with the guard, which back-propagates it when Lightning calls ``backward`` (after
its ``zero_grad``). Lightning scales what it back-propagates (``1 / accumulate_grad_batches``, then the AMP
grad scaler); the guard reads that factor as the gradient of Lightning's tensor with respect to the copy and
applies it to the real loss. Holding the only reference to the graph is what lets an OOM in the backward
free the failed attempt's activations before the retry.

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
them; anything ``training_step`` logs is logged once per slice.

Not covered: an OOM in the optimizer step (a partly applied update cannot be undone), manual optimization
(the module runs its own backward) and several processes (the other ranks would wait in the all-reduce).
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor

from lightning_memkit._autofit import FitPlan, _batch_size, pieces

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
        module: the LightningModule (automatic optimization, one process).
        replan: switches to the next leaner plan and returns it; raises when none is left.
    """

    def __init__(self, module: pl.LightningModule, replan: Callable[[], FitPlan]) -> None:
        self.module, self.replan = module, replan
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
        self.catch(True)

    @property
    def catching(self) -> bool:
        """Whether an OOM is recovered from (the first steps); otherwise it propagates."""
        return bool(self._hooks)

    def catch(self, enabled: bool) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if enabled:
            trainable = (p for p in self.module.parameters() if p.requires_grad)
            self._hooks = [p.register_post_accumulate_grad_hook(self._touched.add) for p in trainable]

    def remove(self) -> None:
        """Give the module its own hooks back."""
        self.catch(False)
        for name, original in self._originals.items():
            self.module.__dict__.pop(name, None)
            if original is not None:
                self.module.__dict__[name] = original

    # --- the two hooks ------------------------------------------------------------------------------

    def training_step(self, batch: Any, *args: Any, **kwargs: Any) -> Any:
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
        return {**output, "loss": copy} if isinstance(output, Mapping) else copy

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
                        with _logging_as_training_step(self.module):
                            real = _loss_of(self._step(piece.batch, *self._args, **self._kwargs))
                    if real is not None:
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

    def _recover(self, piece: _Piece, touched: Iterable[Tensor] = ()) -> None:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        self.size = self.replan().micro_batch_size
        self._queue[:0] = self._cut(replace(piece, frozen=piece.frozen | frozenset(touched)))

    def _cut(self, piece: _Piece) -> list[_Piece]:
        if self.size is None:
            return [piece]
        try:
            rows = _batch_size(piece.batch)
        except ValueError as error:
            raise RuntimeError(
                f"AutoFit re-planned to micro-batch {self.size} and must cut each batch along dim 0, but "
                f"this batch cannot be cut: {error}"
            ) from error
        if rows <= self.size:
            return [piece]
        return [
            replace(piece, batch=part, weight=piece.weight * _batch_size(part) / rows)
            for part in pieces(piece.batch, self.size)
        ]


def _loss_of(output: Any) -> Tensor | None:
    return output.get("loss") if isinstance(output, Mapping) else output


@contextmanager
def _frozen(params: frozenset[Tensor]) -> Iterator[None]:
    for p in params:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in params:
            p.requires_grad_(True)


@contextmanager
def _logging_as_training_step(module: pl.LightningModule) -> Iterator[None]:
    """``self.log`` in a slice run from ``backward`` files its values under ``training_step``, as usual."""
    previous = module._current_fx_name
    module._current_fx_name = "training_step"
    try:
        yield
    finally:
        module._current_fx_name = previous
