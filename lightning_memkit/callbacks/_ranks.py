"""How the ranks of a run agree at every optimizer step whether `MemoryMonitor` goes on, and share their
peaks (``memory/rank_{r}/peak``).

Every rank measures its own step. An internal error on one rank must stop the monitor on all of them
together: a rank that left the protocol alone would leave the others waiting in its next collective. So
every rank that is not disabled gathers, at every optimizer step, whether it is well and its peak; one
failure anywhere (or a failure of the gather itself) turns the monitor off everywhere.
"""

from __future__ import annotations

import dataclasses

import lightning.pytorch as pl
import torch


@dataclasses.dataclass
class Agreement:
    """What the ranks agreed at one optimizer step."""

    #: every rank's peak for the step (bytes; ``-1``: a rank without a figure); ``None``: stop monitoring
    peaks: list[int] | None
    #: this rank's own failure, if any: the one it brought, or the gather's
    failure: Exception | None
    #: the other ranks that reported a failure
    failed: list[int] = dataclasses.field(default_factory=list)


def agree(trainer: pl.Trainer, peak: int, failure: Exception | None, device: torch.device) -> Agreement:
    """Gather every rank's health and ``peak`` (this rank's, ``-1`` for none), ``failure`` being this rank's
    internal error not yet shared. A collective with several ranks: every rank that still monitors calls it
    at every optimizer step, failed or not."""
    if trainer.world_size == 1:
        return Agreement(None if failure is not None else [peak], failure)
    try:
        state = torch.tensor([failure is None, peak], dtype=torch.int64, device=device)
        gathered = trainer.strategy.all_gather(state).reshape(-1, 2).tolist()
    except Exception as err:
        gathered, failure = [], failure or err
    failed = [rank for rank, (ok, _) in enumerate(gathered) if not ok]
    if failure is None and not failed:
        return Agreement([rank_peak for _, rank_peak in gathered], None)
    return Agreement(None, failure, failed)
