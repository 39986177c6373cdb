"""Which micro-batch and checkpointing plan of the chosen optimizer and precision is fastest: the rows
`plan_fit` ranks, and the table of every configuration simulated (`FitPlan.alternatives`).

A step's peak grows with its micro-batch, so the largest micro-batch that fits at each checkpointing is
found by bisection (`_largest_fitting`); a larger micro-batch takes fewer micro-steps, so once a plan beats
a micro-batch's time without any recompute that micro-batch needs no checkpointing planner.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

from lightning_memkit._checkpointing.compiled import COMPILE_BUDGET, budget_label, label_budget
from lightning_memkit._checkpointing.policies import CHECKPOINT_MODES, CheckpointPlan
from lightning_memkit._fitting.plan import Alternative, StepCost
from lightning_memkit._fitting.simulations import Candidate, Simulations
from lightning_memkit._vocabulary import AUTO

#: Full checkpointing's recompute as a share of forward + backward, where no planner measured it: the
#: forward again, a third of the FLOPs (a bound for the other modes).
FULL_RECOMPUTE = 1 / 3


class _Option(NamedTuple):
    """A micro-batch with its checkpointing, timed: a row of the plan's table."""

    time: float
    m: int
    label: str
    peak: int
    plan: CheckpointPlan | None


def _quickest(option: _Option) -> tuple:
    """What ranks the options: the time, then no checkpointing before any, then less recompute, then as
    before. On a CPU a timed checkpointing plan can read no slower than none within the timing noise (its
    recompute clamped at 0): the tie went to ``"full"``, first by name."""
    recompute = getattr(option.plan, "overhead", None)
    return (
        option.time,
        option.label != "none",
        FULL_RECOMPUTE if recompute is None else recompute,
        *option[1:3],
    )


def _label(modes: Sequence[str]) -> str:
    """A checkpointing plan in a word: its mode if every block has it, else the count of each mode."""
    counts = Counter(modes)
    if len(counts) == 1:
        return next(iter(counts))
    return ", ".join(f"{counts[mode]} {mode}" for mode in CHECKPOINT_MODES if counts[mode])


def _plan_label(plan: CheckpointPlan) -> str:
    """A checkpointing plan as `FitPlan.checkpointing` names it: `_label`, or a compiled model's
    activation budget (`budget_label`)."""
    if plan.compile_budget is not None:
        return budget_label(plan.compile_budget)
    return _label([b.mode for b in plan.blocks]) if plan.blocks else "none"


def _largest_fitting(
    peak: Callable[[int], int], limit: int, sizes: Sequence[int], known: Iterable[tuple[int, int]] = ()
) -> int | None:
    """The largest of ``sizes`` (ascending) whose ``peak`` is at most ``limit``, assuming the peak grows
    with the size; ``None`` if none does. ``known``: ``(size, peak)`` pairs simulated already, of any size.

    A bisection that probes where the line through the nearest known peaks either side of the limit crosses
    it (a step's peak is close to linear in its micro-batch), so that once a size too large is known it
    mostly ends after two probes, the size predicted and the next one up; the same answer as halving."""
    seen = dict(known)
    lo, hi = -1, len(sizes)  # sizes[lo] fits (or none is known to), sizes[hi] does not (or none is known)
    for i, m in enumerate(sizes):
        if m in seen:
            lo, hi = (max(lo, i), hi) if seen[m] <= limit else (lo, min(hi, i))
    while hi - lo > 1:
        i = _probe(seen, limit, sizes, lo, hi)
        seen[sizes[i]] = peak(sizes[i])
        lo, hi = (i, hi) if seen[sizes[i]] <= limit else (lo, i)
    return sizes[lo] if lo >= 0 else None


def _probe(seen: dict[int, int], limit: int, sizes: Sequence[int], lo: int, hi: int) -> int:
    """Which of ``sizes[lo + 1 : hi]`` to simulate next (`_largest_fitting`)."""
    fitting = [(m, p) for m, p in seen.items() if p <= limit]
    over = [(m, p) for m, p in seen.items() if p > limit]
    if not fitting or not over:
        return (lo + hi) // 2
    (m0, p0), (m1, p1) = max(fitting), min(over)
    if m1 <= m0 or p1 <= p0:  # not increasing there: halve
        return (lo + hi) // 2
    crossing = m0 + (limit - p0) * (m1 - m0) / (p1 - p0)
    below = [i for i in range(lo + 1, hi) if sizes[i] <= crossing]
    return below[-1] if below else lo + 1


@dataclasses.dataclass(frozen=True)
class Ranking:
    """The plans of one optimizer and precision, each micro-step's peak at most ``limit``, timed by
    ``cost`` for a rank's batch of ``accumulated`` samples an optimizer step."""

    search: Simulations
    cost: StepCost
    optimizer: str | None
    precision: str
    limit: int
    accumulated: int

    def option(self, m: int, label: str, peak: int, plan: CheckpointPlan | None = None, recompute=0.0):
        """The row of micro-batch ``m`` at checkpointing ``label``, timed with ``recompute``."""
        return _Option(self.cost.time(m, self.accumulated // m, recompute), m, label, peak, plan)

    def peak(self, m: int, mode: str) -> int:
        """One rank's simulated peak of micro-batch ``m`` at checkpointing ``mode``."""
        return self.search.peak(m, mode, self.optimizer, self.precision).peak

    def fastest(self, sizes: Sequence[int], modes: tuple[str, ...]) -> list[_Option]:
        """The micro-batches and checkpointing worth ranking: the largest micro-batch without checkpointing,
        and larger ones up to the largest the strongest mode fits, each with the planner's cheapest plan."""
        options = self.unchecked(sizes, modes)
        reached = options[0].m if options else 0
        above = [m for m in sizes if m > reached]
        if modes != ("none",) and above:
            self.extend_checkpointed(options, above, modes)
        assert options, "the smallest runnable micro-batch at the strongest mode fits"
        return options

    def extend_checkpointed(self, options: list[_Option], above: list[int], modes: tuple[str, ...]) -> None:
        """``options`` with the plans of the micro-batches ``above`` the largest without checkpointing, up
        to the largest the strongest mode fits: from the largest down, as long as one's time without any
        recompute beats the best plan found (a smaller micro-batch takes more micro-steps)."""
        strongest = modes[-1]
        known = self.search.peaks(strongest, self.optimizer, self.precision)
        top = _largest_fitting(lambda m: self.peak(m, strongest), self.limit, above, known)
        for m in reversed([m for m in above if top is not None and m <= top]):
            if options and self.cost.time(m, self.accumulated // m) >= min(options).time:
                continue  # once the best plan beats this micro-batch without recompute: no planner
            options.extend(self.checkpointed(m, modes))

    def unchecked(self, sizes: Sequence[int], modes: tuple[str, ...]) -> list[_Option]:
        """The largest micro-batch that fits without checkpointing, if ``"none"`` is allowed and one does."""
        key = Candidate(sizes[0], "none", self.optimizer, self.precision)
        known = self.search.cache.get(key)  # the FLOP count's step, if it was simulated
        if modes[0] != "none" or (known is not None and known.peak > self.limit):
            return []  # no micro-batch fits without
        simulated = self.search.peaks("none", self.optimizer, self.precision)
        m = _largest_fitting(lambda m: self.peak(m, "none"), self.limit, sizes, simulated)
        return [] if m is None else [self.option(m, "none", self.peak(m, "none"))]

    def checkpointed(self, m: int, modes: tuple[str, ...]) -> list[_Option]:
        """Micro-batch ``m``'s checkpointing plans that fit: a compiled model's activation budget, the
        planner's cheapest plan (every plan that fits, where each is timed), or, past ``refine_limit``, the
        strongest mode where it was simulated."""
        if modes[-1] == COMPILE_BUDGET:  # torch.compile's activation budget: no planner, no timing
            return self.compiled(m)
        if not self.search.refining():  # no time for a planner: the strongest mode, if simulated and fits
            strongest = self.search.cache.get(Candidate(m, modes[-1], self.optimizer, self.precision))
            if strongest is None or strongest.peak > self.limit:
                return []
            return [self.option(m, modes[-1], strongest.peak, recompute=FULL_RECOMPUTE)]  # at most full's
        found = self.search.checkpoint_plans(m, modes, self.optimizer, self.precision, self.limit)
        # FLOPs rank the plans (the first); a timed step times each (its recompute is not its FLOPs)
        timed = self.cost.source == "measured"
        options = []
        for plan, breakdown in found if timed else found[:1]:
            recompute = self.search.timed_recompute(m, plan) if timed else plan.overhead
            options.append(self.option(m, _plan_label(plan), breakdown.peak, plan, recompute))
        return options

    def compiled(self, m: int) -> list[_Option]:
        """A compiled model's plan at micro-batch ``m``: the highest activation budget that fits, its
        recompute in FLOPs under either cost; none past ``refine_limit`` (up to ten simulations)."""
        key = Candidate(m, COMPILE_BUDGET, self.optimizer, self.precision)
        if key not in self.search.compiled and not self.search.refining():
            return []
        plan, _ = self.search.compiled_plan(m, self.optimizer, self.precision)
        if plan is None:
            return []
        kept = plan if plan.compile_budget is not None else None  # else: as configured
        return [self.option(m, _plan_label(plan), plan.peak, kept, plan.overhead or 0.0)]

    def alternatives(
        self, options: Sequence[_Option], optimizers: Sequence[str | None], precisions: Sequence[str]
    ) -> tuple[Alternative, ...]:
        """Every configuration simulated, as rows: uniform modes, and the planner's plans with their times.

        A row's time (relative to the chosen plan's, and in seconds per global batch) is known for rows of
        the chosen optimizer and precision, at the recompute `_uniform_recompute` gives; ``None``
        otherwise."""
        rows: dict[Candidate, Alternative] = {}
        fastest = min(options).time
        G = self.accumulated
        for c, breakdown in self.search.cache.items():
            recompute = _uniform_recompute(self.search, c.m, c.mode, c.optimizer, c.precision)
            chosen = (c.optimizer, c.precision) == (self.optimizer, self.precision)
            seconds = None if not chosen or recompute is None else self.cost.time(c.m, G // c.m, recompute)
            rows[c] = Alternative(
                c.m, G // c.m, c.mode, c.optimizer, c.precision, breakdown.peak,
                None if seconds is None else seconds / fastest, breakdown.peak <= self.limit, seconds,
            )  # fmt: skip
        for option in options:  # the plans ranked, at the recompute they were ranked by
            rows[Candidate(option.m, option.label, self.optimizer, self.precision)] = Alternative(
                option.m, G // option.m, option.label, self.optimizer, self.precision, option.peak,
                option.time / fastest, True, option.time,
            )  # fmt: skip
        order = {mode: i for i, mode in enumerate(CHECKPOINT_MODES)}

        def row_order(c: Candidate) -> tuple:
            mode_order = order.get(c.mode, len(order))
            return optimizers.index(c.optimizer), precisions.index(c.precision), c.m, mode_order

        return tuple(rows[c] for c in sorted(rows, key=row_order))


def _uniform_recompute(search, m: int, mode: str, optimizer: str | None, precision: str) -> float | None:
    """The recompute of ``mode`` on every block as a fraction of the blocks' compute: as a planner measured
    it at this micro-batch, else at another (the fraction hardly moves with the micro-batch: both scale
    with it), else full checkpointing's one forward in three (`FULL_RECOMPUTE`); ``None`` for another mode
    no planner measured."""
    if mode == "none":
        return 0.0
    if label_budget(mode) is not None:
        return search.recompute(m, mode, optimizer, precision)
    key = Candidate(m, AUTO, optimizer, precision)
    planner = search.planners.get(key) or next(iter(search.planners.values()), None)
    if planner is not None and mode in planner.modes:
        return planner.overhead(planner.uniform(mode))
    return FULL_RECOMPUTE if mode == "full" else None
