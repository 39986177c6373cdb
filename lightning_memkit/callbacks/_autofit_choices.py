"""What `AutoFit`'s plan chooses among: its own arguments, within those of the callbacks in the same fit
that then defer to it (`ActivationCheckpointing`'s checkpointing modes and blocks, `OptimizerSwap`'s
optimizers), and of an FSDP2 step what the strategy lets it choose (`FSDP2Options`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
from torch import nn

from lightning_memkit._checkpointing.blocks import find_blocks, no_blocks_message
from lightning_memkit._optimizers.swap import lighter_candidates
from lightning_memkit.callbacks.activation_checkpointing import ActivationCheckpointing
from lightning_memkit.callbacks.optimizer_swap import OptimizerSwap

__all__ = ["FSDP2Options", "blocks_to_plan", "check_blocks", "modes_to_plan", "optimizers_to_plan"]


@dataclasses.dataclass(frozen=True)
class FSDP2Options:
    """What AutoFit's plan may choose of an FSDP2 step beyond the user's sharding (`plan_fit`'s keywords of
    the same names): the planner of a strategy that shards itself (`AutoFitStrategy`) gives more."""

    #: FSDP2's CPU offload: never (``False``), or ``None``: where nothing fits without it
    cpu_offload: bool | None = False
    #: a bf16-mixed run sharded with FSDP2's bf16 ``MixedPrecisionPolicy``
    mp_policy: bool = False
    #: the ranks' collectives as timed (``None``: `_sharding.fsdp2.LINKS`' for the device)
    link: Any = None


def _beside(trainer: pl.Trainer) -> ActivationCheckpointing | None:
    return next((c for c in trainer.callbacks if isinstance(c, ActivationCheckpointing)), None)


def modes_to_plan(trainer: pl.Trainer, checkpointing: Sequence[str]) -> tuple[str, ...]:
    """The checkpointing modes to plan: AutoFit's ``checkpointing``, within the modes of an
    `ActivationCheckpointing` in the same fit."""
    beside = _beside(trainer)
    return tuple(checkpointing) if beside is None else beside.modes_for(checkpointing)


def blocks_to_plan(
    trainer: pl.Trainer, blocks: tuple[type[nn.Module], ...] | None
) -> tuple[type[nn.Module], ...] | None:
    """The blocks to checkpoint: AutoFit's ``blocks``, or those of an `ActivationCheckpointing` beside it."""
    beside = _beside(trainer)
    return blocks if beside is None else beside.blocks_for(blocks)


def check_blocks(
    trainer: pl.Trainer, module: nn.Module, modes: Sequence[str], blocks: tuple[type[nn.Module], ...] | None
) -> None:
    """Named blocks the model does not have are refused, naming the argument the user gave them in
    (``AutoFit(blocks=...)``, AutoFit's ``blocks``, or ``ActivationCheckpointing(blocks=...)``), not
    `plan_fit`'s."""
    planned = blocks_to_plan(trainer, blocks)
    if planned is None or set(modes) == {"none"} or find_blocks(module, planned):
        return
    who = "AutoFit" if blocks is not None else "ActivationCheckpointing"
    raise ValueError(no_blocks_message(module, f"{who}(blocks={{MyBlock}})", planned))


def optimizers_to_plan(
    trainer: pl.Trainer, pl_module: pl.LightningModule, optimizers: Sequence[str] | None
) -> Sequence[str | None] | None:
    """The optimizers to plan: AutoFit's ``optimizers``; without them, with an `OptimizerSwap` in the same
    fit, the module's own and then the swap's ``candidates``."""
    if optimizers is not None:
        return optimizers
    swap = next((c for c in trainer.callbacks if isinstance(c, OptimizerSwap)), None)
    return None if swap is None else lighter_candidates(pl_module, swap.optimizers)
