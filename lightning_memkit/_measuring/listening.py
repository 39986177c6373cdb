"""What a `Tracker` tells those who follow its step besides it: `TrackerListener`.

A tracker counts; a listener attached to it (``tracker.listen(listener)``) is told what the tracker sees,
event by event: a storage registered or freed, a resize, a candidate peak, a gradient, an RNG state, and,
from the simulator's dispatch, each op of the step. The simulator's timeline (`_estimating.fake_tracker`),
history (`_estimating.repeated`) and trace (`_estimating.trace`) are listeners. A tracker without one
iterates an empty tuple per event (`Tracker.listeners`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import Tensor

    from lightning_memkit._measuring.storages import Storage
    from lightning_memkit._measuring.tracker import Tracker

__all__ = ["TrackerListener"]


class TrackerListener:
    """What a `Tracker` tells the listener attached to it (`Tracker.listeners`), as the step runs. Every
    method does nothing here: a listener overrides those it needs. ``tracker`` is the tracker telling; each
    call comes after the tracker's own bookkeeping of the event unless it says "before".

    The ops themselves are told by whoever defines a step's ops: `op_started` and `op_finished` come from
    the simulator's dispatch (`_estimating.fake_tracker`), once per op of the simulated step."""

    def registered(self, tracker: Tracker, rec: Storage, t: Tensor | None, *, preexisting: bool) -> None:
        """A storage was first seen and counted (``rec``): ``t`` the tensor it was seen through (``None``
        where no tensor showed it: a resize, a collective's own buffer); ``preexisting``: live since the
        step began."""

    def freed(self, tracker: Tracker, rec: Storage) -> None:
        """A counted storage died."""

    def resizing(self, tracker: Tracker, storage: torch.UntypedStorage | None) -> None:
        """Before: ``storage.resize_`` ran and is being counted (the candidate peak it makes follows);
        ``None``: done."""

    def rng_state(self, tracker: Tracker, state: Tensor) -> None:
        """Before: checkpointing kept the CPU RNG state ``state`` (counted where
        `Tracker.counts_rng_states`)."""

    def candidate(self, tracker: Tracker, unseen: int) -> None:
        """Before: a candidate peak is checked, at ``tracker.current + unseen`` live bytes (``unseen``: what a
        CPU kernel held beyond the live storages, `_measuring.kernels`; 0 after an op, a resize, a buffer)."""

    def gradient(self, tracker: Tracker, param: Tensor) -> None:
        """Before: a gradient reached ``param`` (its post-accumulate-grad hook ran; ``param.grad`` may be
        gone already, freed by a fused optimizer step)."""

    def op_started(self, tracker: Tracker, func: Any, args: tuple, kwargs: dict) -> None:
        """Before: ``func`` runs on ``args`` and ``kwargs``, one op of the step."""

    def op_finished(self, tracker: Tracker, func: Any) -> None:
        """``func`` ran, and what it made is counted."""
