"""What `MemoryMonitor` logs at a logging step: the highest step since the last log, not only its own.

Lightning logs every ``log_every_n_steps`` (50 by default); a step that peaks between two logging steps
would never reach the logger if only the logged step's figures were logged. `LogWindow` keeps, over the
steps since the last log, the highest step (its breakdown, parts and index), each phase's highest, the
highest of every rank and the CUDA allocator's reserved high-water mark, and turns them into the
``memory/*`` keys (MiB) when the logging step comes. `PendingStep` gathers one optimizer step's figures
over its micro-batches before it joins the window.
"""

from __future__ import annotations

import dataclasses

import torch

from lightning_memkit._breakdown import MemoryBreakdown, MiB

#: The key after ``memory/`` of each phase's highest (`_diagnosis.oom.PHASES` names the phases).
PHASE_KEYS = {"forward": "forward_peak", "backward": "backward_peak", "optimizer step": "optimizer_step_peak"}


@dataclasses.dataclass
class StepMemory:
    """One optimizer step's figures, in bytes (with gradient accumulation, of its micro-batches)."""

    #: the optimizer step's index, counted from 0 as Lightning's loggers count steps
    step: int
    #: the step's peak by category: its highest micro-batch's
    breakdown: MemoryBreakdown
    #: the parts of categories logged besides them at the peak (FSDP2's, the parameters' split), by key
    parts: dict[str, int] = dataclasses.field(default_factory=dict)
    #: each phase's highest (`PHASE_KEYS`' phases), over the micro-batches; empty where not known
    phases: dict[str, int] = dataclasses.field(default_factory=dict)
    #: the CUDA allocator's figures (already in their units: MiB and counts), by key
    cuda: dict[str, float] = dataclasses.field(default_factory=dict)


class LogWindow:
    """The steps since the last log, as much of them as the next log needs."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.highest: StepMemory | None = None
        self.last: StepMemory | None = None
        self.phases: dict[str, int] = {}
        self.rank_peaks: list[int] = []
        self.reserved: float | None = None

    def add(self, figures: StepMemory, rank_peaks: list[int]) -> None:
        """One more optimizer step, with every rank's peak (``-1``: a rank without a figure)."""
        if self.highest is None or figures.breakdown.peak > self.highest.breakdown.peak:
            self.highest = figures
        self.last = figures
        for phase, peak in figures.phases.items():
            self.phases[phase] = max(self.phases.get(phase, 0), peak)
        if len(self.rank_peaks) < len(rank_peaks):
            self.rank_peaks += [-1] * (len(rank_peaks) - len(self.rank_peaks))
        self.rank_peaks = [max(old, new) for old, new in zip(self.rank_peaks, rank_peaks, strict=False)]
        reserved = figures.cuda.get("memory/reserved")
        if reserved is not None:
            self.reserved = reserved if self.reserved is None else max(self.reserved, reserved)

    def metrics(self, budget: int | None, device_total: int | None) -> dict[str, float]:
        """The keys to log at the last step added (the logging step), in MiB: the highest step's
        breakdown and peak, its index, the last step's own peak, each phase's highest, every rank's
        highest, and the peak's fraction of ``budget`` (else of ``device_total``, a CUDA device's memory)."""
        highest, last = self.highest, self.last
        assert highest is not None and last is not None, "metrics() of a window without steps"
        metrics = {f"memory/{key}": value / MiB for key, value in highest.breakdown.as_dict().items()}
        metrics.update({f"memory/{key}": value / MiB for key, value in highest.parts.items()})
        metrics["memory/peak_step"] = float(highest.step)
        metrics["memory/step_peak"] = last.breakdown.peak / MiB
        metrics.update(
            {f"memory/{PHASE_KEYS[p]}": v / MiB for p, v in self.phases.items() if p in PHASE_KEYS}
        )
        metrics.update(last.cuda)  # the counts are cumulative: the last step's say all
        if self.reserved is not None:
            metrics["memory/reserved"] = self.reserved
        whole = budget if budget is not None else device_total
        if whole:
            metrics["memory/peak_fraction"] = highest.breakdown.peak / whole
        if len(self.rank_peaks) > 1:
            metrics.update(
                {f"memory/rank_{r}/peak": p / MiB for r, p in enumerate(self.rank_peaks) if p >= 0}
            )
        return metrics


class PendingStep:
    """The optimizer step in flight, over its micro-batches: the highest one's breakdown, CUDA figures
    and parts, and each phase's highest (with gradient accumulation a step is its highest micro-batch)."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.breakdown: MemoryBreakdown | None = None
        self.cuda: dict[str, float] = {}
        self.parts: dict[str, int] | None = None
        self.phases: dict[str, int] = {}

    @property
    def peak(self) -> int:
        """The step's peak so far (bytes); ``-1`` before a micro-batch has a figure."""
        return -1 if self.breakdown is None else self.breakdown.peak

    def add(
        self,
        breakdown: MemoryBreakdown,
        parts: dict[str, int] | None,
        phases: dict[str, int] | None,
        device: torch.device,
    ) -> None:
        """One more micro-batch's figures (``device``'s allocator read if it is the highest so far)."""
        if self.breakdown is None or breakdown.peak >= self.breakdown.peak:
            self.breakdown, self.cuda, self.parts = breakdown, cuda_stats(device), parts
        for phase, peak in (phases or {}).items():
            self.phases[phase] = max(self.phases.get(phase, 0), peak)

    def take(self, step: int) -> StepMemory:
        """The step's figures as optimizer step ``step``; the next step starts from nothing."""
        assert self.breakdown is not None, "take() of a step without figures"
        figures = StepMemory(step, self.breakdown, self.parts or {}, self.phases, self.cuda)
        self.clear()
        return figures


def cuda_stats(device: torch.device) -> dict[str, float]:
    """The CUDA allocator's figures a step logs (MiB and cumulative counts); none off CUDA."""
    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    return {
        "memory/reserved": torch.cuda.max_memory_reserved(device) / MiB,
        "memory/alloc_retries": float(stats.get("num_alloc_retries", 0)),
        "memory/ooms": float(stats.get("num_ooms", 0)),
    }
