"""What fits a card: micro-batch x sequence length x precision, each cell a simulated step.

`fit_table` fills the grid ``memkit fit-table`` prints: at each precision, sequence length and micro-batch,
the lightest checkpointing mode whose simulated step (`estimate_memory`, fake tensors) fits the budget less
the margin, and its peak; then, with the strongest mode, the largest micro-batch at each sequence length
(`limits.largest_fitting`: any whole number, not a power of two) and the longest sequence at micro-batch
1. Three rules keep the work a small count of simulations, never a clock, and hide no answer:

1. A precision whose static floor (parameters, gradients and optimizer state, counted without a
   simulation) is over the limit fits nowhere: none of its cells is simulated.
2. A step's peak grows with its batch and its sequence: a mode over the limit at a cell is over at every
   cell with at least that batch and that sequence, so it is not tried there; a cell where every mode is
   known over that way is shown over without a simulation.
3. ``max_simulations`` bounds the rest: the cells past it say "not simulated", and a largest micro-batch
   or longest sequence whose search it stopped is ``None`` ("not searched"), never "nothing fits".

A 16-bit-weight precision (``bf16-true``, ``16-true``) steps AdamW and SGD as their Kahan-summed twins, as
`plan_fit` plans them (a plain update there rounds small steps away).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn

from lightning_memkit._budget import Budget, parse_budget
from lightning_memkit._checkpointing.blocks import find_blocks
from lightning_memkit._estimating.analytic import model_static
from lightning_memkit._estimating.precision import sixteen_bit_weights
from lightning_memkit._estimating.simulate import estimate_memory
from lightning_memkit._fitting.limits import MAX_MICRO_BATCH, largest_fitting
from lightning_memkit._optimizers.swap import COMPENSATED

__all__ = ["Cell", "FitTable", "fit_table"]

#: The checkpointing modes a cell tries, lightest first (selective between them costs a simulation more
#: at every cell where none is over).
TABLE_MODES = ("none", "full")
#: `fit_table`'s default bound on the simulations (a 7B model's take about a second each).
MAX_SIMULATIONS = 120
#: The longest sequence is searched in steps of this many tokens.
SEQ_STEP = 128


@dataclass(frozen=True)
class Cell:
    """One micro-batch x sequence length at one precision.

    Attributes:
        checkpointing: the lightest mode whose step fits; ``None`` where none does (or none was tried).
        peak: the simulated peak with that mode, or, where none fits, with the strongest mode simulated
            there; ``None``: not simulated (known over, or past ``max_simulations``).
        known_over: over without a simulation: the precision's static floor is over the limit, or every
            mode is over at a cell with at most this batch and sequence.
    """

    precision: str
    batch_size: int
    seq_len: int
    checkpointing: str | None
    peak: int | None
    known_over: bool = False

    @property
    def fits(self) -> bool:
        return self.checkpointing is not None

    @property
    def state(self) -> str:
        """``"fits"``, ``"over"`` (simulated over, or known over) or ``"not simulated"`` (past
        ``max_simulations``: whether it fits is unknown)."""
        if self.fits:
            return "fits"
        return "over" if self.peak is not None or self.known_over else "not simulated"


@dataclass(frozen=True)
class FitTable:
    """`fit_table`'s answer. Bytes are ints.

    Attributes:
        limit: ``budget.usable * (1 - margin)``: a cell fits where its peak is at most this.
        optimizers: the optimizer stepped at each precision (a Kahan twin at 16-bit weights).
        floors: each precision's static floor (parameters, gradients, optimizer state).
        largest: ``(precision, seq_len) -> (micro-batch, peak)``: the largest micro-batch whose step fits
            with the strongest mode, any whole number up to ``max_batch`` (0: none fits; ``None``: the
            search was stopped by ``max_simulations``).
        at_max_batch: the ``(precision, seq_len)`` keys of `largest` that reached ``max_batch`` with every
            size fitting: the true largest is at least that.
        longest: ``precision -> (tokens, peak)``: the longest sequence (in steps of `SEQ_STEP` tokens and
            `max_seq_len` itself) whose step at micro-batch 1 fits with the strongest mode (0: none fits;
            ``None``: stopped by ``max_simulations``).
        max_seq_len: the longest sequence searched: the model's block size, or 4 x the longest column.
        simulations: the steps simulated; ``truncated``: whether ``max_simulations`` stopped the work.
    """

    budget: Budget
    margin: float
    limit: int
    precisions: tuple[str, ...]
    batch_sizes: tuple[int, ...]
    seq_lens: tuple[int, ...]
    modes: tuple[str, ...]
    optimizers: dict[str, str | None]
    floors: dict[str, int]
    cells: tuple[Cell, ...]
    largest: dict[tuple[str, int], tuple[int, int] | None] = field(default_factory=dict)
    longest: dict[str, tuple[int, int] | None] = field(default_factory=dict)
    at_max_batch: frozenset[tuple[str, int]] = frozenset()
    max_seq_len: int = 0
    simulations: int = 0
    truncated: bool = False

    def cell(self, precision: str, batch_size: int, seq_len: int) -> Cell:
        return next(
            c
            for c in self.cells
            if (c.precision, c.batch_size, c.seq_len) == (precision, batch_size, seq_len)
        )


class _Grid:
    """The simulations of one model, cached and counted (`max_simulations`)."""

    def __init__(self, model, make_batch, optimizer, loss_fn, device, limit, max_simulations) -> None:
        self.model, self.make_batch, self.loss_fn, self.device = model, make_batch, loss_fn, device
        self.optimizer, self.limit, self.left = optimizer, limit, max_simulations
        self.peaks: dict[tuple[str, str, int, int], int] = {}  # (precision, mode, B, T) -> peak
        self.count = 0

    def peak(self, precision: str, mode: str, b: int, t: int) -> int | None:
        """The simulated peak (``None`` past the bound)."""
        key = (precision, mode, b, t)
        if key not in self.peaks:
            if self.left <= 0:
                return None
            self.left -= 1
            self.count += 1
            self.peaks[key] = estimate_memory(
                self.model, self.make_batch(b, t), optimizer=_optimizer(self.optimizer, precision),
                loss_fn=self.loss_fn, precision=precision, checkpointing=None if mode == "none" else mode,
                device=self.device,
            ).peak  # fmt: skip
        return self.peaks[key]

    def known_over(self, precision: str, mode: str, b: int, t: int) -> bool:
        """Whether a cell with at most ``b`` and ``t`` is over the limit with ``mode`` (rule 2)."""
        return any(
            p > self.limit and bb <= b and tt <= t
            for (pp, m, bb, tt), p in self.peaks.items()
            if (pp, m) == (precision, mode)
        )


def fit_table(
    model: nn.Module,
    make_batch: Callable[[int, int], Any],
    budget: int | float | str | Budget,
    *,
    batch_sizes: Sequence[int],
    seq_lens: Sequence[int],
    precisions: Sequence[str] = ("32-true", "bf16-mixed", "bf16-true"),
    modes: Sequence[str] = TABLE_MODES,
    optimizer: str | None = "adamw",
    loss_fn: Callable[[Any, Any], Tensor] | None = None,
    device: str = "cuda",
    margin: float = 0.1,
    max_batch: int = MAX_MICRO_BATCH,
    max_seq_len: int | None = None,
    max_simulations: int = MAX_SIMULATIONS,
) -> FitTable:
    """Fill the micro-batch x sequence length x precision grid for ``budget`` (see the module docstring).

    ``make_batch(batch_size, seq_len)`` builds the batch of each cell (``memkit fit-table``'s: token ids on
    the meta device). ``modes``: the checkpointing modes tried, in any order (they are tried lightest
    first: none, selective, selective_half, full; only ``"none"`` for a model without repeated blocks).
    ``precisions``: repeats are dropped. ``max_seq_len``: the longest sequence searched (default: 4 x the
    longest of ``seq_lens``).
    """
    budget = parse_budget(budget)
    limit = int(budget.usable * (1 - margin))
    modes = tuple(sorted(set(modes), key=_strength)) if find_blocks(model) else ("none",)
    precisions = tuple(dict.fromkeys(precisions))
    grid = _Grid(model, make_batch, optimizer, loss_fn, device, limit, max_simulations)
    floors = {p: _floor(model, optimizer, p) for p in precisions}
    batch_sizes, seq_lens = tuple(sorted(set(batch_sizes))), tuple(sorted(set(seq_lens)))
    cells = [
        _cell(grid, p, modes, b, t, floors[p] > limit)
        for p in precisions
        for t in seq_lens
        for b in batch_sizes
    ]
    strongest = modes[-1]
    longest_seq = max_seq_len or 4 * seq_lens[-1]
    largest: dict[tuple[str, int], tuple[int, int] | None] = {}
    longest: dict[str, tuple[int, int] | None] = {}
    for p in (p for p in precisions if floors[p] <= limit):
        for t in seq_lens:
            largest[(p, t)] = _largest(grid, p, strongest, t, max_batch)
        longest[p] = _longest(grid, p, strongest, longest_seq)
    return FitTable(
        budget=budget, margin=margin, limit=limit, precisions=tuple(precisions), batch_sizes=batch_sizes,
        seq_lens=seq_lens, modes=modes, optimizers={p: _optimizer(optimizer, p) for p in precisions},
        floors=floors, cells=tuple(cells), largest=largest, longest=longest,
        at_max_batch=frozenset(k for k, v in largest.items() if v is not None and v[0] >= max_batch),
        max_seq_len=longest_seq, simulations=grid.count, truncated=grid.left <= 0,
    )  # fmt: skip


def _cell(grid: _Grid, precision: str, modes: tuple[str, ...], b: int, t: int, floored: bool) -> Cell:
    """The lightest mode that fits at ``b`` x ``t``, trying none a smaller cell already put over."""
    if floored:
        return Cell(precision, b, t, None, None, known_over=True)
    over: int | None = None
    for mode in modes:
        if grid.known_over(precision, mode, b, t):
            continue
        peak = grid.peak(precision, mode, b, t)
        if peak is None:  # past max_simulations
            break
        if peak <= grid.limit:
            return Cell(precision, b, t, mode, peak)
        over = peak
    known = over is None and all(grid.known_over(precision, m, b, t) for m in modes)
    return Cell(precision, b, t, None, over, known_over=known)


def _largest(grid: _Grid, precision: str, mode: str, t: int, max_batch: int) -> tuple[int, int] | None:
    """The largest micro-batch at ``t`` tokens with ``mode``, from the cells' peaks on (0: none;
    ``None``: stopped by ``max_simulations``)."""
    known = [(b, p) for (pp, m, b, tt), p in grid.peaks.items() if (pp, m, tt) == (precision, mode, t)]
    if grid.known_over(precision, mode, 1, t):
        return 0, 0
    try:
        size, seen = largest_fitting(
            lambda b: _or_over(grid.peak(precision, mode, b, t)), grid.limit, max_size=max_batch, known=known
        )
    except _Bound:
        return None
    return size, seen.get(size, 0)


def seq_candidate(k: int, max_seq_len: int) -> int:
    """The ``k``-th sequence length `fit_table`'s longest-sequence search tries: ``k`` `SEQ_STEP`s, the
    last one ``max_seq_len`` itself (a block size that is no multiple of `SEQ_STEP` is searched too)."""
    return min(k * SEQ_STEP, max_seq_len)


def _longest(grid: _Grid, precision: str, mode: str, max_seq_len: int) -> tuple[int, int] | None:
    """The longest sequence, in `SEQ_STEP`s and ``max_seq_len`` itself, whose micro-batch 1 fits with
    ``mode`` (0: none; ``None``: stopped by ``max_simulations``)."""
    cap = -(-max_seq_len // SEQ_STEP)
    known = [
        (-(-t // SEQ_STEP), p)
        for (pp, m, b, t), p in grid.peaks.items()
        if (pp, m, b) == (precision, mode, 1) and t == seq_candidate(-(-t // SEQ_STEP), max_seq_len)
    ]
    if cap < 1:
        return 0, 0
    try:
        steps, seen = largest_fitting(
            lambda k: _or_over(grid.peak(precision, mode, 1, seq_candidate(k, max_seq_len))), grid.limit,
            max_size=cap, known=known,
        )  # fmt: skip
    except _Bound:
        return None
    return (seq_candidate(steps, max_seq_len) if steps else 0), seen.get(steps, 0)


#: The checkpointing modes from the lightest (most memory) to the strongest.
_STRENGTH = ("none", "selective", "selective_half", "full")


def _strength(mode: str) -> int:
    return _STRENGTH.index(mode) if mode in _STRENGTH else len(_STRENGTH)


class _Bound(Exception):
    """``max_simulations`` reached inside a search."""


def _or_over(peak: int | None) -> int:
    if peak is None:
        raise _Bound
    return peak


def _optimizer(optimizer: str | None, precision: str) -> str | None:
    """``optimizer`` at ``precision``: its Kahan-summed twin over 16-bit weights, as `plan_fit` plans."""
    if optimizer is not None and sixteen_bit_weights(precision):
        return COMPENSATED.get(optimizer, optimizer)
    return optimizer


def _floor(model: nn.Module, optimizer: str | None, precision: str) -> int:
    """Parameters + gradients + optimizer state at ``precision``: no cell's peak is below it."""
    try:
        return model_static(model, precision, _optimizer(optimizer, precision) or "sgd").static
    except ValueError:  # an optimizer the catalogue cannot count: the cells say
        return 0
