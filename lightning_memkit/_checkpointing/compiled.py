"""Checkpointing a compiled model: torch.compile's own ``activation_memory_budget``, searched.

Inside a compiled model, what is kept from the forward to the backward is decided by AOTAutograd's min-cut
partitioner, not by eager autograd: it already recomputes cheap pointwise ops instead of saving them, and
``torch._functorch.config.activation_memory_budget`` (1.0 by default) lets it trade more: below 1 it keeps
at most that share of the activations, choosing what to recompute by its runtime estimate, across the
whole graph rather than block by block. Measured earlier on Hugging Face BERT and GPT-2 (issue 26): it kept
0.717 / 0.732 of the activations at +11 % / +0.1 % time where the eager planner's block checkpointing kept
0.744 / 0.769 at +16 % / +1.6 %. An eager checkpoint wrapper inside a compiled module is traced by dynamo
into the same partitioner, and the simulation cannot follow it (`_estimating.compiled`), so a compiled
model is planned with compile's budget.

`plan_compile_budget` simulates the compiled step (`_estimating.compiled`) at torch's budget: where it fits,
nothing changes. Otherwise it looks for the largest share whose step fits (the least recompute): down a
grid of eighths of the configured budget to 0 (the partitioner recomputes all it can), then bisecting
towards the eighth above, to 1/64. The peak does not fall steadily with the budget (recomputing everything
moves it into the backward), so no bisection from the ends. The plan's recompute
cost is in FLOPs: the simulated step's at that budget less its own (the recomputed matmuls and attention;
pointwise ops count zero).

Below the configured budget the simulation is less exact: inductor fuses the backward's recomputation
with the gradient kernels that read the same tensors and allocates their buffers together, which the
simulation models only in part, so it has read up to 5 % low there (the zoo's LLaMA at batch 8: -2.8 %,
-5.0 %, -4.2 % at budgets 0.5, 0.3, 0.1; exact at 0.9 and 0.7). A budget found below the configured one
must therefore fit `MARGIN` under the limit.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_memkit._breakdown import MemoryBreakdown, format_bytes
from lightning_memkit._checkpointing.policies import CheckpointPlan, applied_modes, apply_plan
from lightning_memkit._estimating.simulate import counted_step
from lightning_memkit._step import Step

__all__ = ["plan_compile_budget"]

#: The budgets tried first: the configured one times 7/8, 6/8, ... 0.
GRID = 8
#: Bisection steps between two of them: the budget found is within 1/64 of the largest that fits.
STEPS = 3
#: The share of the limit a budget below the configured one leaves free (module docstring).
MARGIN = 0.06


def configured_budget() -> float:
    """torch.compile's ``activation_memory_budget`` as configured now."""
    from torch._functorch import config

    return float(config.activation_memory_budget)


def plan_compile_budget(model: nn.Module, batch: Any, limit: int, step: Step, **run: Any) -> CheckpointPlan:
    """The largest ``activation_memory_budget`` (to 1/64) whose simulated compiled step fits ``limit``
    bytes, as a `CheckpointPlan` with no eager block checkpointing; ``compile_budget`` is ``None`` where
    the configured budget fits already (the plan changes nothing). ``run``: `estimate_memory`'s
    ``optimizer``, ``loss_fn`` and ``device``."""
    configured = configured_budget()
    simulated: dict[float, tuple[MemoryBreakdown, int]] = {}

    def at(budget: float) -> tuple[MemoryBreakdown, int]:
        if budget not in simulated:
            # without the eager checkpointing `apply_checkpointing` left on the model: the plan replaces it
            bare = {name: "none" for name in applied_modes(model)}
            with apply_plan(model, bare, announce=False):
                breakdown, flops, _ = counted_step(model, batch, step.but(compile_budget=budget), **run)
            simulated[budget] = (breakdown, flops)
        return simulated[budget]

    top, top_flops = at(configured)
    if top.peak <= limit:
        return _plan(limit, None, top, top, None, 0.0)
    guarded = int(limit * (1 - MARGIN))
    # The peak is no monotone function of the budget: recomputing everything moves it into the backward,
    # where the recomputed tensors live together. The recompute only grows as the budget falls, so the
    # plan is the largest budget that fits: the first of a falling grid, then bisected towards the one
    # above it.
    grid = [configured * (GRID - i) / GRID for i in range(1, GRID + 1)]
    fitting = next((b for b in grid if at(b)[0].peak <= guarded), None)
    if fitting is None:
        floor = min((at(b)[0] for b in grid), key=lambda breakdown: breakdown.peak)
        raise ValueError(_floor_message(limit, guarded, floor, top))
    low, high = fitting, fitting + configured / GRID  # fits, misses
    for _ in range(STEPS):
        middle = (low + high) / 2
        if at(middle)[0].peak <= guarded:
            low = middle
        else:
            high = middle
    floor = min((at(b)[0] for b in grid if b in simulated), key=lambda breakdown: breakdown.peak)
    chosen, flops = at(low)
    overhead = max(flops - top_flops, 0) / top_flops if top_flops else 0.0
    return _plan(limit, low, chosen, top, floor, overhead)


def _plan(
    limit: int,
    budget: float | None,
    chosen: MemoryBreakdown,
    top: MemoryBreakdown,
    floor: MemoryBreakdown | None,
    overhead: float,
) -> CheckpointPlan:
    return CheckpointPlan(
        blocks=(),
        budget=limit,
        peak=chosen.peak,
        peak_none=top.peak,
        peak_full=None if floor is None else floor.peak,
        overhead=overhead,
        cost="flops",
        breakdown=chosen,
        compile_budget=budget,
    )


def _floor_message(limit: int, guarded: int, floor: MemoryBreakdown, top: MemoryBreakdown) -> str:
    return (
        f"The budget of {format_bytes(limit)} ({limit:,} bytes) is below what the compiled model's step can "
        f"reach: at its lowest over torch.compile's activation_memory_budget from 0 (its partitioner "
        f"recomputes every activation it can) to as configured, the step peaks at {format_bytes(floor.peak)} "
        f"({floor.peak:,} bytes; "
        f"{format_bytes(top.peak)} as configured), above {format_bytes(guarded)}, the budget less the "
        f"{MARGIN:.0%} kept free below the configured activation budget (the simulation reads up to 5 % low "
        f"there). At that peak: parameters "
        f"{format_bytes(floor.parameters)}, gradients {format_bytes(floor.gradients)}, optimizer state "
        f"{format_bytes(floor.optimizer_state)}, activations {format_bytes(floor.activations)}, temporary "
        f"{format_bytes(floor.temporary)}. To go lower: a smaller micro-batch (with gradient accumulation to "
        "keep the effective batch), a lighter optimizer (8-bit AdamW, Adafactor, SGD), lower precision "
        "(bf16-true); or raise the budget."
    )
