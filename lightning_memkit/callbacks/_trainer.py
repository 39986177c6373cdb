"""What the Trainer's strategy adds to one rank's memory, read the way every callback needs it."""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.strategies import DDPStrategy
from torch import nn

from lightning_memkit._analytic import scheme, static_breakdown

__all__ = ["accumulates", "ddp_bucket_bytes", "sharding"]


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
    shapes = [tuple(p.shape) for p in module.parameters() if p.requires_grad]
    return static_breakdown(shapes, precision=scheme(str(trainer.precision)), optimizer="sgd").gradients


def accumulates(trainer: pl.Trainer) -> bool:
    """Whether any step of the fit accumulates gradients: now, or in a later epoch of a
    ``GradientAccumulationScheduler``."""
    schedulers = [c for c in trainer.callbacks if isinstance(c, GradientAccumulationScheduler)]
    scheduled = [n for c in schedulers for n in c.scheduling.values()]
    return trainer.accumulate_grad_batches > 1 or any(n > 1 for n in scheduled)
