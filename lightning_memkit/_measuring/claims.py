"""What a tracked step's owners hold, named for its `Tracker`: the model's parameters and buffers, the
optimizers' state, the gradients and the batch live when the step begins (`at_start`), and what the step
gave them, known only when it ends (`at_end`): optimizer state born in a first step, a parameter's data
replaced inside it, FSDP2's first unsharded copies. `measure` and the simulator (`_estimating.fake_tracker`)
name them alike, through the tracker's ``records``; FSDP2's own part is `_sharding.accounting`'s."""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from lightning_memkit._measuring.storages import (
    batch_tensors,
    gradient_tensors,
    layer_quantization_state,
    optimizer_tensors,
    quantization_state,
)
from lightning_memkit._sharding import accounting

if TYPE_CHECKING:
    import torch
    from torch import nn

    from lightning_memkit._measuring.tracker import Tracker

__all__ = ["at_end", "at_start"]


def at_start(
    tracker: Tracker, model: nn.Module, optimizers: Iterable[torch.optim.Optimizer], batch: Any = ()
) -> None:
    """Register what is live when the step begins, with the categories their owners give them, and
    ``batch``'s tensors: an eager step's ops read them, and so register them; a compiled step's generated
    kernels read them where no op shows it (a compiled CNN's images, copied to channels-last inside the
    graph)."""
    optimizers = list(optimizers)
    _claim_parameters(tracker, model, preexisting=True)
    _claim_optimizer_state(tracker, optimizers, preexisting=True)
    for t in gradient_tensors(model):
        for rec in tracker.records(t, preexisting=True):
            if rec.category is None:
                rec.grad_at = 0
    accounting.claim_sharded(tracker.records, model, preexisting=True)
    for t in batch_tensors(batch):
        for _ in tracker.records(t, preexisting=True):
            pass


def at_end(tracker: Tracker, model: nn.Module, optimizers: Iterable[torch.optim.Optimizer]) -> bool:
    """Name what the step gave its owners, known only now: optimizer state born in it (a lazily initialised
    optimizer's first step), a parameter's data replaced in it, FSDP2's first unsharded copies and this
    step's sharded gradients. Returns whether ``model`` has FSDP2 units."""
    _claim_optimizer_state(tracker, optimizers, preexisting=False)
    _claim_parameters(tracker, model, preexisting=False)
    return accounting.claim_sharded(tracker.records, model, preexisting=False)


def _claim_parameters(tracker: Tracker, model: nn.Module, *, preexisting: bool) -> None:
    """Mark the model's parameters, their quantization state and its buffers as parameters, each trainable
    (``requires_grad``) or frozen. At the step's start and again at its end: a parameter's data replaced
    inside the step (bitsandbytes repacks a 4-bit weight for its CPU kernel at the first forward without
    gradients) is a parameter too."""
    for p in model.parameters():
        for t in (p, *quantization_state(p)):
            for rec in tracker.records(t, preexisting=preexisting):
                if rec.category in (None, "parameters"):
                    rec.category, rec.frozen = "parameters", not (t is p and p.requires_grad)
    for t in itertools.chain(model.buffers(), layer_quantization_state(model)):
        for rec in tracker.records(t, preexisting=preexisting):
            if rec.category is None:
                rec.category, rec.frozen = "parameters", True


def _claim_optimizer_state(
    tracker: Tracker, optimizers: Iterable[torch.optim.Optimizer], *, preexisting: bool
) -> None:
    """Mark the optimizers' tensors; after the step this also catches state born inside it. The weights an
    optimizer holds that are not the model's (an offloaded optimizer's host masters) are its state too."""
    optimizers = list(optimizers)
    held = (p for optimizer in optimizers for group in optimizer.param_groups for p in group["params"])
    for t in itertools.chain(optimizer_tensors(optimizers), held):
        for rec in tracker.records(t, preexisting=preexisting):
            if rec.category is None:
                rec.category = "optimizer_state"
