"""The largest micro-batch a budget holds: probes upwards, then bisection, over simulated steps.

Lightning's ``BatchSizeFinder`` answers "how large a batch fits" with real steps until one runs out of
memory: in its default power mode it doubles the batch until a trial fails and keeps the last power of two
that ran, so a card that holds 23 samples is told 16. Here a trial is a step simulated on fake tensors
(`estimate_memory`: nothing allocated, seconds for a 7B model), so the search can afford to look between
the powers: it probes upwards where the line through the peaks so far crosses the limit until one is
over, then bisects the integers between (`ranking._largest_fitting`, probing the same way: a step's peak is
close to linear in its micro-batch), and answers the largest micro-batch whose peak fits,
with the peak one sample more as the proof that it is the largest. The work is a count of simulations
(three or four where the peak grows linearly), never a clock.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_memkit._breakdown import format_bytes
from lightning_memkit._budget import Budget, parse_budget, whole_number
from lightning_memkit._estimating.fake_optimizers import OptimizerLike
from lightning_memkit._estimating.lightning_step import (
    SampleAxes,
    _per_sample,
    batch_size,
    batch_slice,
    default_axes,
    repeat_rows,
)
from lightning_memkit._estimating.lightning_step import rows as rows_of
from lightning_memkit._estimating.simulate import estimate_memory
from lightning_memkit._fitting.ranking import _largest_fitting

__all__ = ["BatchLimit", "largest_fitting", "largest_micro_batch"]

#: `largest_micro_batch`'s default ``max_size``: past it the search stops (and says so).
MAX_MICRO_BATCH = 4096


@dataclass(frozen=True)
class BatchLimit:
    """The largest micro-batch a budget holds (`largest_micro_batch`). Bytes are ints.

    Attributes:
        micro_batch_size: the largest micro-batch whose simulated peak is at most `limit`; 0 where not
            even one sample fits.
        peak: its simulated peak (0 where none fits).
        next_peak: the simulated peak one sample more, over `limit`: the proof that `micro_batch_size` is
            the largest; ``None`` where the search stopped at ``max_size`` with every size fitting.
        limit: the bytes the peak may reach: ``budget.usable * (1 - margin)``.
        budget: the `Budget` searched for.
        precision: the Lightning precision the steps were simulated with.
        checkpointing: the checkpointing mode of every repeated block (``"none"``: none).
        simulated: every ``(micro-batch, peak)`` simulated, in the order simulated.
    """

    micro_batch_size: int
    peak: int
    next_peak: int | None
    limit: int
    budget: Budget
    precision: str
    checkpointing: str
    simulated: tuple[tuple[int, int], ...]

    def __str__(self) -> str:
        within = f"{format_bytes(self.limit)} ({self.budget.source} less the margin)"
        if self.micro_batch_size == 0:
            over = self.next_peak if self.next_peak is not None else 0
            return f"no micro-batch fits {within}: one sample peaks at {format_bytes(over)}"
        proof = (
            f"; {self.micro_batch_size + 1} peaks at {format_bytes(self.next_peak)}"
            if self.next_peak is not None
            else " (the largest size searched)"
        )
        return (
            f"largest micro-batch {self.micro_batch_size}: peak {format_bytes(self.peak)} of {within}{proof} "
            f"({self.precision}, checkpointing {self.checkpointing}, {len(self.simulated)} steps simulated)"
        )


def largest_fitting(
    peak: Callable[[int], int], limit: int, *, start: int = 1, max_size: int = MAX_MICRO_BATCH,
    known: Iterable[tuple[int, int]] = (),
) -> tuple[int, dict[int, int]]:  # fmt: skip
    """The largest size in ``start..max_size`` whose ``peak(size)`` is at most ``limit`` (0: none), and
    every peak known by then. Until a size over the limit is known it probes upwards: where the line
    through the two largest fitting sizes crosses the limit, one past it (doubling while fewer than two
    fit); then it bisects between (`ranking._largest_fitting`, which probes where the peaks' line crosses
    the limit). ``known``: ``(size, peak)`` pairs simulated already; the peak is assumed to grow with the
    size. A peak linear in the size is settled in three or four probes."""
    seen = dict(known)

    def probe(size: int) -> int:
        if size not in seen:
            seen[size] = peak(size)
        return seen[size]

    while not any(p > limit for p in seen.values()):
        fitting = sorted(s for s, p in seen.items() if p <= limit)
        if fitting and fitting[-1] >= max_size:
            return max_size, seen
        probe(_upwards(fitting, seen, limit, start, max_size))
    top = min(s for s, p in seen.items() if p > limit)
    if top <= start:
        return 0, seen
    largest = _largest_fitting(probe, limit, range(start, top + 1), list(seen.items()))
    return largest or 0, seen


def _upwards(fitting: list[int], seen: dict[int, int], limit: int, start: int, max_size: int) -> int:
    """The next size `largest_fitting` probes while none is known over the limit."""
    if not fitting:
        return start
    if len(fitting) == 1:
        return min(2 * fitting[-1], max_size)
    (m0, p0), (m1, p1) = [(m, seen[m]) for m in fitting[-2:]]
    if p1 <= p0:  # flat so far: double
        return min(2 * m1, max_size)
    crossing = m1 + (limit - p1) * (m1 - m0) / (p1 - p0)
    return min(max(int(crossing) + 1, m1 + 1), max_size)


def largest_micro_batch(
    model: nn.Module,
    batch: Any | Callable[[int], Any],
    budget: int | float | str | Budget,
    *,
    margin: float = 0.1,
    precision: str = "32-true",
    checkpointing: str = "none",
    optimizer: OptimizerLike | None = None,
    loss_fn: Callable[[Any, Any], Tensor] | None = None,
    device: str = "cuda",
    max_size: int = MAX_MICRO_BATCH,
    batch_axes: SampleAxes | None = None,
) -> BatchLimit:
    """The largest micro-batch whose simulated training step fits ``budget`` less ``margin``.

    Where `plan_fit` chooses among the divisors of a global batch, this answers "how large a batch fits":
    any whole number, not the last power of two that ran (Lightning's ``BatchSizeFinder`` in its power
    mode). Every trial is `estimate_memory` on fake tensors: nothing is allocated and nothing runs out of
    memory (a size past the example batch's is its samples repeated on the meta device: shapes only).
    Probing upwards where the line through the peaks so far crosses the limit finds a size over it;
    bisection between finds the largest that fits and the size above it that does not
    (`BatchLimit.next_peak`).

    Args:
        model, optimizer, loss_fn, precision, device: as `estimate_memory` takes them.
        batch: an example batch of any number of samples, cut (or repeated, on the meta device: without
            values) along each tensor's sample dimension (``batch_axes``, default dimension 0) to each size
            tried; or a callable
            ``size -> batch`` (``memkit fit-table``'s: token ids of shape (size, seq_len) on the meta
            device).
        budget: bytes, ``"24GB"``, a GPU name (``"A100-80GB"``: less the CUDA context and reserve), as
            `parse_budget` reads it.
        margin: share of the budget kept free, as `plan_fit` keeps it.
        checkpointing: the mode of every repeated block (``"none"``, ``"selective"``,
            ``"selective_half"``, ``"full"``).
        max_size: the largest micro-batch tried.

    Returns:
        A `BatchLimit`: the size, its peak, the peak one sample more, every step simulated.

    Raises:
        ValueError: a margin outside [0, 1), a ``max_size`` below 1, or an empty batch.
    """
    budget = parse_budget(budget)
    if not 0.0 <= margin < 1.0:
        raise ValueError(f"margin must be in [0, 1), got {margin}")
    max_size = whole_number("max_size", max_size, of="samples", at_least=1)
    limit = int(budget.usable * (1 - margin))
    make = batch if callable(batch) else _resized(batch, batch_axes)
    n = (
        None
        if callable(batch)
        else batch_size(batch, default_axes(batch) if batch_axes is None else batch_axes)
    )
    mode = None if checkpointing == "none" else checkpointing

    def peak(size: int) -> int:
        try:
            return estimate_memory(
                model, make(size), optimizer=optimizer, loss_fn=loss_fn, precision=precision,
                checkpointing=mode, device=device,
            ).peak  # fmt: skip
        except Exception as e:
            if n is not None and size > n:
                e.add_note(
                    f"largest_micro_batch: the step of {size} samples was the example batch's {n} "
                    "repeated on the meta device (shapes, no values); a step that reads the batch's values "
                    "needs batch= a callable size -> batch"
                )
            raise

    size, seen = largest_fitting(peak, limit, max_size=max_size)
    return BatchLimit(
        micro_batch_size=size,
        peak=seen.get(size, 0),
        next_peak=seen.get(size + 1),
        limit=limit,
        budget=budget,
        precision=precision,
        checkpointing=checkpointing,
        simulated=tuple(seen.items()),
    )


def _resized(batch: Any, axes: SampleAxes | None) -> Callable[[int], Any]:
    """``size -> batch`` from an example batch: its samples cut to ``size`` (views: nothing allocated), or,
    past its own size, tensors of ``size`` samples on the meta device (shapes without storage: a probe of
    4096 images allocates nothing; a sparse tensor is repeated for real)."""
    axes = default_axes(batch) if axes is None else axes
    n = batch_size(batch, axes)

    def grown(t: Tensor, dim: int, rows: int, size: int) -> Tensor:
        if t.layout != torch.strided:
            return rows_of(repeat_rows(t, -(-size // n), dim), 0, size * rows, dim)
        shape = list(t.shape)
        shape[dim] = size * rows
        return t.new_empty(shape, device="meta")

    def make(size: int) -> Any:
        if size <= n:
            return batch_slice(batch, size, axes=axes)
        return _per_sample(batch, axes, lambda t, dim, rows: grown(t, dim, rows, size))

    return make
