"""The Trainer as the callbacks read it: its precision, strategy, accumulation, loop state, and one
decision taken on rank 0 for every rank. Every read of a Lightning internal is here, so that a Lightning
upgrade that moves one breaks this file only (the versions tested are bounded in pyproject.toml)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import lightning.pytorch as pl
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.strategies import DDPStrategy
from torch import nn

from lightning_memkit._analytic import model_static, scheme

__all__ = [
    "accumulates",
    "accumulating_now",
    "ddp_bucket_bytes",
    "on_rank_zero",
    "optimizer_steps_done",
    "precision",
    "sharding",
]

T = TypeVar("T")


def precision(trainer: pl.Trainer) -> str:
    """The Trainer's precision as the estimators know it; one they do not know is read as 32-true."""
    return scheme(str(trainer.precision))


def on_rank_zero(trainer: pl.Trainer, decide: Callable[[], T], what: str) -> T:
    """``decide()`` on global rank 0, its (picklable) result broadcast to every rank. An error there is
    raised on every rank once all have left the broadcast, so none waits for a decision that never comes:
    rank 0 raises its own, the others a ``ValueError`` or ``RuntimeError`` with its message."""
    outcome: tuple[str, ...] | tuple[str, T] | None = None
    error: Exception | None = None
    if trainer.is_global_zero:
        try:
            outcome = ("value", decide())
        except Exception as e:
            error, outcome = e, ("error", type(e).__name__, str(e))
    outcome = trainer.strategy.broadcast(outcome, src=0)
    assert outcome is not None
    if error is not None:
        raise error
    if outcome[0] == "error":
        _, kind, message = outcome
        raise (ValueError if kind == "ValueError" else RuntimeError)(
            f"{what} failed on global rank 0: {kind}: {message}"
        )
    return outcome[1]  # type: ignore[return-value]


def sharding(trainer: pl.Trainer) -> tuple[str, int]:
    """The Trainer's strategy as `_analytic.STRATEGIES` names it, and its number of ranks."""
    ranks, strategy = trainer.world_size, trainer.strategy
    if ranks == 1:
        return "ddp", 1
    kind = type(strategy).__name__
    if kind == "DeepSpeedStrategy":
        stage = (getattr(strategy, "config", None) or {}).get("zero_optimization", {}).get("stage", 0)
        return (f"deepspeed_stage_{stage}" if stage in (1, 2, 3) else "ddp"), ranks
    if kind == "FSDPStrategy":
        mode = str(getattr(strategy, "sharding_strategy", "FULL_SHARD"))
        if "HYBRID" in mode or "NO_SHARD" in mode:  # hybrid shards within a node only: read as unsharded
            return "ddp", ranks
        return ("zero2" if "SHARD_GRAD_OP" in mode else "fsdp"), ranks
    return "ddp", ranks  # DDP and anything else: nothing sharded, the conservative reading


def ddp_bucket_bytes(trainer: pl.Trainer, module: nn.Module) -> int:
    """Bytes of DDP's all-reduce buckets on each rank: a copy of every trainable parameter's gradient in
    the precision the run trains in (`_analytic.shard`); 0 unless the strategy is DDP (one rank too: the
    model is wrapped all the same)."""
    if not isinstance(trainer.strategy, DDPStrategy):
        return 0
    return model_static(module, precision(trainer)).gradients


def accumulates(trainer: pl.Trainer) -> bool:
    """Whether any step of the fit accumulates gradients: now, or in a later epoch of a
    ``GradientAccumulationScheduler``."""
    schedulers = [c for c in trainer.callbacks if isinstance(c, GradientAccumulationScheduler)]
    scheduled = [n for c in schedulers for n in c.scheduling.values()]
    return trainer.accumulate_grad_batches > 1 or any(n > 1 for n in scheduled)


def accumulating_now(trainer: pl.Trainer) -> bool:
    """Whether the batch in flight accumulates (no optimizer step follows it)."""
    return trainer.fit_loop.epoch_loop._should_accumulate()


def optimizer_steps_done(trainer: pl.Trainer) -> int:
    """Optimizer steps taken so far, counted as Lightning's loggers count them (``step`` in metrics)."""
    return trainer.fit_loop.epoch_loop._batches_that_stepped
