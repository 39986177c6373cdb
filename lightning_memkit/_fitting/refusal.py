"""Why no plan fits, in numbers, and what would: `plan_fit`'s refusal.

Where no optimizer and precision fits at its leanest step, the message gives the static floor, the
leanest plan's peak and the fixes in order of cost: a step lever (one simulation each, so a refusal never
names a lever whose plan would not fit), more FSDP ranks, a larger GPU, FSDP2's CPU offload.
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning_memkit._breakdown import format_bytes
from lightning_memkit._budget import GPUS, Budget
from lightning_memkit._checkpointing.compiled import COMPILE_BUDGET
from lightning_memkit._checkpointing.policies import CHECKPOINT_MODES
from lightning_memkit._estimating.analytic import shard
from lightning_memkit._estimating.lightning_step import batch_size
from lightning_memkit._fitting.simulations import Candidate, Simulations
from lightning_memkit._fitting.space import Pair, SearchSpace, _pairs, loads
from lightning_memkit._step import LEVER_CALLBACKS

_SUGGESTED_GPUS = (2, 4, 8, 16, 32, 64)
#: The end of the no-fit message where no 16-bit weights were allowed.
LOWER_PRECISION_HINT = "; or allow a lower precision (bf16-true)"


def no_fit_message(space: SearchSpace, search: Simulations) -> str:
    """Why no (optimizer, precision) pair fits ``space.limit`` at its leanest step, and what would: the
    pairs that can be built here (all of them tried by now), the cheapest step lever that fits, and with
    ``cpu_offload=None`` what FSDP2's CPU offload would leave on the device."""
    pairs = [pair for pair in space.pairs if loads(pair[0])] or list(space.pairs)
    message = _infeasible(space, search, pairs, _lever_that_fits(space, search))
    if space.offload_when_needed:
        leanest = search.whole[Candidate(search.smallest, space.modes[-1], *pairs[-1])]  # no COMPILE_BUDGET
        offloaded = search.offloaded(leanest, pairs[-1][1]).peak
        message += (
            f" With FSDP2's CPU offload (CPUOffloadPolicy) the leanest plan still needs about "
            f"{format_bytes(offloaded)} a rank."
        )
    return message


def _lever_that_fits(space: SearchSpace, search: Simulations) -> str:
    """Where nothing fits as asked and no step lever was, the cheapest lever (`LEVER_CALLBACKS`) whose
    leanest plan fits ``limit``, as the fix the refusal names, with its figure; ``""`` if none does (or a
    lever was asked, or several ranks). One simulation a lever, of the step `plan_fit` plans with that
    lever's keyword: its leanest optimizer and precision (`_pairs` as it forms them), the strongest
    checkpointing, and for the fused step one micro-batch, the global batch per GPU. Where it fits, that
    `plan_fit` finds a plan: a refusal never contradicts the planner."""
    if search.lever is not None or search.world_size > 1 or search.sharding:
        return ""
    modes, limit = space.modes, space.limit
    strongest = modes[-1] if modes[-1] in CHECKPOINT_MODES else "none"  # compiled: the budget configured
    for keyword, callback in LEVER_CALLBACKS.items():
        fused = keyword == "fused_step"
        pairs = _pairs(space.optimizers, space.precisions, space.compensate and keyword != "offload", fused)
        pairs = [p for p in pairs if loads(p[0])]
        if not pairs:
            continue
        optimizer, precision = pairs[-1]
        m = batch_size(search.batch, search.axes) if fused else search.smallest
        try:
            peak = search.estimate(m, strongest, optimizer=optimizer, precision=precision, lever=keyword).peak
        except ValueError:  # the step refuses the lever (an optimizer the fused step cannot take)
            continue
        if peak <= limit:
            return (
                f"{callback}() (plan_fit's lever={keyword!r}): its leanest plan, micro-batch {m}, "
                f"{strongest} checkpointing, {optimizer}, {precision}, peaks at {format_bytes(peak)}"
            )
    return ""


def _infeasible(space: SearchSpace, search: Simulations, pairs: Sequence[Pair], lever_fits: str) -> str:
    """The error text: static floor, leanest plan's peak, and what would fit (``lever_fits`` first: the
    step lever that fits, `_lever_that_fits`)."""
    limit, budget, margin, modes = space.limit, space.budget, space.margin, space.modes
    (first_opt, first_prec), (leanest_opt, leanest_prec) = pairs[0], pairs[-1]
    strongest = modes[-1]
    if strongest == COMPILE_BUDGET and search.static(leanest_opt, leanest_prec) > limit:
        strongest = "none"  # below the static floor no activation budget helps: not worth ten simulations
    strongest = search.resolved(search.smallest, strongest, leanest_opt, leanest_prec)
    floor = search.peak(search.smallest, strongest, leanest_opt, leanest_prec)
    best = search.peak(search.smallest, strongest, first_opt, first_prec)
    # Unsharded smallest steps: what more GPUs (FSDP) or a larger card would have to hold.
    whole = search.estimate(search.smallest, strongest, optimizer=first_opt, precision=first_prec)
    fused = search.lever == "fused_step"  # no FSDP1 or DeepSpeed to suggest
    fsdp = (
        None
        if fused
        else next(
            (n for n in _SUGGESTED_GPUS if n <= space.total and shard(whole, "fsdp", n).peak <= limit),
            None,
        )
    )
    gpu = next(
        (
            name
            for name, mib in sorted(GPUS.items(), key=lambda kv: kv[1])
            if Budget.for_device(mib * 2**20, name).usable * (1 - margin) >= whole.peak
        ),
        None,
    )
    ranks = f" over {search.world_size} GPUs ({search.strategy})" if search.world_size > 1 else ""
    fixes = []
    if fsdp is not None:
        fixes.append(f"{fsdp} GPUs of this size with strategy='fsdp' (or deepspeed_stage_3) keep {first_opt}")
    if gpu is not None:
        fixes.append(f"one {gpu} ({GPUS[gpu] / 1024:.0f} GiB) fits it at micro-batch {search.smallest}")
    hint = "; ".join(fixes) or "no single GPU or up to 64 FSDP ranks fits it"
    if search.device == "cpu":  # a CPU run: no card to name, the memory its step needs
        needed = format_bytes(int(whole.peak / (1 - margin)) + 1)
        hint = f"{needed} of host memory at micro-batch {search.smallest}"
    if lever_fits:  # the step's own lever first: no other device, no other card
        hint = f"{lever_fits}; or {hint}"
    static_parts = (
        "parameters + optimizer state: the fused step holds no gradients"
        if fused
        else ("parameters + gradients + optimizer state")
    )
    lower = "" if {"bf16-true", "16-true"} & set(space.precisions) else LOWER_PRECISION_HINT
    return (
        f"No plan fits {format_bytes(limit)} ({budget.source}, usable {format_bytes(budget.usable)} less the "
        f"{margin:.0%} margin){ranks}. Static floor ({static_parts}) with "
        f"{leanest_opt or 'the configured optimizer'}, {leanest_prec}: {format_bytes(floor.static)}; the "
        f"leanest plan (micro-batch {search.smallest}, {strongest} checkpointing, {leanest_opt}) peaks at "
        f"{format_bytes(floor.peak)}; with {first_opt or 'the configured optimizer'} at micro-batch "
        f"{search.smallest}: {format_bytes(best.peak)}. What would fit: {hint}{lower}."
    )
