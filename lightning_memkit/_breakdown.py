"""The one value object every part of lightning_memkit speaks: a step's peak memory by category.

The measurer (`measure`, `MemoryMonitor`), the estimators and the actors that fit a run to a budget
(checkpointing, optimizer swap, auto-fit) all produce or read a `MemoryBreakdown`, so "where is
activation memory counted?" has a single answer: here, with the same five fields everywhere.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the annotation only: the simulated step's events are the estimator's
    from lightning_memkit._estimating.fake_tracker import TimelineEvent

MiB = 2**20
GiB = 2**30

#: The five categories, in the order they are logged and plotted (static first, then dynamic).
CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "temporary")


def format_bytes(n: int | float) -> str:
    """``1536`` -> ``'1.5 KiB'``; binary units, as torch's own memory summaries use."""
    # "5" and True are no number of bytes; NumPy's numbers and a 0-dim tensor (it has __float__) are
    if isinstance(n, bool) or not (isinstance(n, numbers.Real) or hasattr(type(n), "__float__")):
        raise TypeError(
            f"format_bytes takes a number of bytes, an int or a float; got {n!r} ({type(n).__name__})"
        )
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes live at the peak of one training step, split into the four consumers plus the rest.

    The five categories are integers in bytes; the optional ``timeline`` is not a category and takes no
    part in equality, ``repr`` or `as_dict`.

    Attributes:
        parameters: the model's parameters and buffers (storages shared by ties/views counted once), a
            quantized weight with its quantization state (bitsandbytes' absmax and code tables).
        gradients: the ``.grad`` tensors of the parameters.
        optimizer_state: every tensor in ``optimizer.state`` (AdamW's moments, 8-bit states and their
            quantization scales, ...).
        activations: tensors saved for backward by autograd that are none of the above.
        temporary: everything else live at the peak: workspaces, the batch, logits/loss copies,
            gradient buffers not yet accumulated, optimizer temporaries, autocast weight copies.
        timeline: the simulated step op by op (`TimelineEvent`), from ``estimate_memory(...,
            timeline=True)``; ``None`` otherwise.
    """

    parameters: int = 0
    gradients: int = 0
    optimizer_state: int = 0
    activations: int = 0
    temporary: int = 0
    timeline: list[TimelineEvent] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        for name in CATEGORIES:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"MemoryBreakdown.{name} must be an int number of bytes, got {value!r}")
            if value < 0:
                raise ValueError(
                    f"MemoryBreakdown.{name} must be a number of bytes, at least 0; got {value} (what is "
                    "live at a peak is never less than nothing)"
                )

    @property
    def peak(self) -> int:
        """The step's peak in bytes: the sum of the five categories."""
        return self.parameters + self.gradients + self.optimizer_state + self.activations + self.temporary

    @property
    def static(self) -> int:
        """Parameters + gradients + optimizer state: what does not shrink with the batch."""
        return self.parameters + self.gradients + self.optimizer_state

    def as_dict(self) -> dict[str, int]:
        """The five categories and ``peak``, in bytes."""
        return {**{name: getattr(self, name) for name in CATEGORIES}, "peak": self.peak}

    def in_words(self) -> str:
        """The five categories in a sentence: ``"parameters 1.00 MiB, gradients ..., temporary 12 KiB"``."""
        return ", ".join(
            f"{name.replace('_', ' ')} {format_bytes(getattr(self, name))}" for name in CATEGORIES
        )

    def __add__(self, other: MemoryBreakdown) -> MemoryBreakdown:
        if not isinstance(other, MemoryBreakdown):
            return NotImplemented
        return MemoryBreakdown(**{c: getattr(self, c) + getattr(other, c) for c in CATEGORIES})

    def __str__(self) -> str:
        peak = self.peak or 1
        rows = [(name, getattr(self, name)) for name in CATEGORIES] + [("peak", self.peak)]
        width = max(len(name) for name, _ in rows)
        lines = [f"{'category':<{width}}  {'memory':>12}  {'share':>6}"]
        for name, value in rows:
            lines.append(f"{name:<{width}}  {format_bytes(value):>12}  {100 * value / peak:5.1f}%")
        return "\n".join(lines)
