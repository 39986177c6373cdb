"""`measure`: the peak memory of one training step, by category, read by the storage tracker
(`_measuring.tracker`, whose docstring says how) around the step run inside a ``with`` block.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from lightning_memkit._breakdown import MemoryBreakdown
from lightning_memkit._measuring import claims
from lightning_memkit._measuring.storages import model_device
from lightning_memkit._measuring.tracker import Tracker

__all__ = ["MemoryMeasurement", "measure"]


class MemoryMeasurement:
    """Context manager returned by `measure`; read `breakdown` after the ``with`` block."""

    def __init__(
        self,
        model: nn.Module,
        optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer] | None = None,
        *,
        device: torch.device | str | None = None,
        batch: Any = None,
    ) -> None:
        self.model = model
        self.batch = batch
        if optimizers is None:
            optimizers = ()
        elif isinstance(optimizers, torch.optim.Optimizer):
            optimizers = (optimizers,)
        elif isinstance(optimizers, str):
            raise TypeError(
                f"measure() takes the optimizer the step uses, not its name ({optimizers!r}): pass the "
                "torch.optim.Optimizer instance, or None (estimate_memory takes optimizer names)."
            )
        self.optimizers = tuple(optimizers)
        wrong = [type(o).__name__ for o in self.optimizers if not isinstance(o, torch.optim.Optimizer)]
        if wrong:
            raise TypeError(f"measure() takes torch.optim.Optimizer instances, got {', '.join(wrong)}")
        self.device = torch.device(device) if device is not None else model_device(model)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._breakdown: MemoryBreakdown | None = None
        #: why the step could not be followed in full, or ``None``: a torch.func transform ran in it,
        #: and what it saved is missing from `breakdown`
        self.unfollowed: str | None = None
        #: the first op whose outputs were sized by its inputs' values (``aten.nonzero.default``, a boolean
        #: mask's selection, a packing by lengths), or ``None``: a step of the same shapes may allocate
        #: otherwise
        self.value_shaped: str | None = None
        #: under FSDP2 (``fully_shard``), the peak's FSDP2 part by `_sharding.accounting.SHARDED_KINDS`
        #: (bytes); else ``None``
        self.sharded: dict[str, int] | None = None
        #: where some parameters are frozen (an adapter fine-tune: LoRA, QLoRA), the peak's ``parameters``
        #: split into ``trainable_parameters`` and ``frozen_parameters`` (with their quantization state, and
        #: the buffers), in bytes; else ``None``
        self.parameter_split: dict[str, int] | None = None
        #: the highest total of each phase the caller named (`enter_phase`), in bytes, by phase; ``None``
        #: when none was named. The tracker's own count: on CUDA without the allocator's workspaces
        self.phase_peaks: dict[str, int] | None = None
        #: the error the measurement's own bookkeeping hit inside the step, or ``None``: the step ran on
        #: untouched (the error never reaches it), and there is no `breakdown`
        self.failure: Exception | None = None
        self._tracker: Tracker | None = None
        self._watching: contextlib.AbstractContextManager | None = None

    @property
    def breakdown(self) -> MemoryBreakdown:
        """The step's peak by category (bytes). Available once the ``with`` block has exited; a
        ``RuntimeError`` when the measurement failed (`failure`)."""
        if self.failure is not None:
            raise RuntimeError(
                f"The measurement failed inside the step, which ran on untouched: {self.failure!r}"
            ) from self.failure
        if self._breakdown is None:
            raise RuntimeError("The measurement is not finished: read `breakdown` after the `with` block.")
        return self._breakdown

    @property
    def peak(self) -> int:
        return self.breakdown.peak

    def enter_phase(self, phase: str) -> None:
        """Name the part of the step that begins now (``"forward"``, ``"backward"``, ...): `phase_peaks`
        gets each named phase's highest total. What ran before the first name belongs to none."""
        if self._tracker is not None:
            self._tracker.enter_phase(phase)

    def __enter__(self) -> MemoryMeasurement:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        tracker = self._tracker = Tracker(self.device, survives_errors=True)
        claims.at_start(tracker, self.model, self.optimizers, self.batch)
        self._watching = tracker.watching(self.model)
        self._watching.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        tracker, watching = self._tracker, self._watching
        assert tracker is not None and watching is not None, "measure() exited without entering"
        self._tracker = self._watching = None
        watching.__exit__(None, None, None)
        self.failure = tracker.failure
        if self.failure is not None:
            return
        sharded = claims.at_end(tracker, self.model, self.optimizers)
        allocator_peak = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            allocator_peak = torch.cuda.max_memory_allocated(self.device)
        self._breakdown = tracker.breakdown(allocator_peak)
        self.sharded = tracker.sharded_breakdown() if sharded else None
        frozen = any(not p.requires_grad for p in self.model.parameters())
        self.parameter_split = tracker.parameter_split() if frozen else None
        self.unfollowed = tracker.unfollowed
        self.value_shaped = tracker.value_shaped
        self.phase_peaks = dict(tracker.phase_peaks) or None


def measure(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | Iterable[torch.optim.Optimizer] | None = None,
    *,
    device: torch.device | str | None = None,
    batch: Any = None,
) -> MemoryMeasurement:
    """Measure the peak memory of the training step run inside the ``with`` block, by category.

    Example::

        with measure(model, optimizer) as m:
            loss = model(x).sum()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        print(m.breakdown)  # parameters / gradients / optimizer_state / activations / temporary

    Works for any ``nn.Module`` and ``torch.optim.Optimizer`` (several may be given), on CPU and CUDA.
    The peak is the highest total of live tensor storages on ``device`` (default: the model's), counting
    what was already allocated when the block began (parameters, gradients, optimizer state, the tensors
    of ``batch``, and any other tensor the step touches). On CUDA it is ``torch.cuda.max_memory_allocated``
    over the block.

    Pass the step's ``batch`` (any nesting of tensors) where the model is compiled: a compiled graph's
    kernels read their inputs where no op shows it, so a batch no op reads is otherwise left out.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"measure() takes the nn.Module whose step it measures; got {type(model).__name__}")
    if not isinstance(optimizer, (torch.optim.Optimizer, str, Iterable)) and optimizer is not None:
        raise TypeError(
            "measure() takes the torch.optim.Optimizer the step uses (or a list of them, or None); got "
            f"{type(optimizer).__name__}"
        )
    return MemoryMeasurement(model, optimizer, device=device, batch=batch)
