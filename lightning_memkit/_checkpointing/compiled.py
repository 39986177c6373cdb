"""Checkpointing a compiled model: torch.compile's own activation budget, searched (`plan_compiled`).

Inside a compiled model, what is kept from the forward to the backward is decided by AOTAutograd's min-cut
partitioner, not by eager autograd: it already recomputes cheap pointwise ops instead of saving them, and
``torch._functorch.config.activation_memory_budget`` (1.0 by default) lets it trade more, across the whole
graph. Measured earlier on Hugging Face BERT and GPT-2 (issue 26), that budget kept 0.717 / 0.732 of the
activations at +11 % / +0.1 % time where eager block checkpointing kept 0.744 / 0.769 at +16 % / +1.6 %:
the lever a compiled model is planned with. Eager checkpoint wrappers inside a compiled module are traced
by dynamo into the same partitioner, which the simulation does not follow, so they are not planned.

The simulation of a compiled step (`_estimating.compiled`) runs the code inductor generates for each budget,
its kernels stubbed, so it follows the partitioner's choice and inductor's schedule at any budget (the zoo's
LLaMA at budgets 0.984 to 0.1: to the byte of the CPU allocator, `benchmarks/bench_compiled_estimate.py`).
The step's peak is not monotonic in the budget (recomputation allocated in the backward can outweigh what
the forward no longer saves), so the budgets are tried from the configured one down, a tenth at a time, and
the first whose step fits is the plan: the least recomputation that fits.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from torch import nn

from lightning_memkit._breakdown import MemoryBreakdown, format_bytes
from lightning_memkit._checkpointing.policies import CheckpointPlan, applied_modes, apply_plan
from lightning_memkit._estimating.simulate import estimate_step
from lightning_memkit._step import Step

__all__ = ["COMPILE_BUDGET", "budget_label", "configured_budget", "label_budget", "plan_compiled"]

log = logging.getLogger(__name__)


#: torch.compile activation budgets tried below the configured one, highest first
BUDGETS = tuple(round(0.1 * i, 1) for i in range(9, -1, -1))
#: `plan_fit`'s checkpointing mode for a compiled model: the activation budget `plan_compiled` finds
COMPILE_BUDGET = "compile budget"
#: how `plan_fit` names a compiled step at one of `BUDGETS`, as a checkpointing mode
_LABEL = f"{COMPILE_BUDGET} "


def budget_label(budget: float) -> str:
    """A compiled step at torch.compile's activation budget ``budget``, as `plan_fit` names its
    checkpointing (``"compile budget 0.5"``)."""
    return f"{_LABEL}{budget:g}"


def label_budget(label: Any) -> float | None:
    """The activation budget a `budget_label` names; ``None`` for anything else (a checkpointing mode)."""
    return float(label[len(_LABEL) :]) if isinstance(label, str) and label.startswith(_LABEL) else None


def configured_budget(step: Step | None = None) -> float:
    """torch.compile's activation budget the step runs at: the `Step`'s, else torch's configuration."""
    from torch._functorch import config

    if step is not None and step.compile_budget is not None:
        return step.compile_budget
    return config.activation_memory_budget


def _below(step: Step | None) -> tuple[float, ...]:
    """`BUDGETS` below the step's configured activation budget, highest first: the ones tried."""
    return tuple(b for b in BUDGETS if b < configured_budget(step))


def plan_compiled(
    model: nn.Module,
    batch: Any,
    limit: int,
    step: Step,
    simulate: Callable[[float | None], MemoryBreakdown] | None = None,
    **run: Any,
) -> CheckpointPlan:
    """A compiled model's checkpointing plan for ``limit`` bytes: no block checkpointed, and torch.compile's
    activation budget as configured where its simulated step fits, otherwise the highest of `BUDGETS` below
    it whose step fits; a `ValueError` saying why where none does. ``run``: `estimate_memory`'s
    ``optimizer``, ``loss_fn`` and ``device``. ``simulate``: the step at an activation budget (``None``: as
    configured), where the caller keeps its simulations (`plan_fit`'s search); `estimate_step` otherwise."""

    def simulated(budget: float | None) -> MemoryBreakdown:
        if simulate is not None:
            return simulate(budget)
        return estimate_step(model, batch, step if budget is None else step.but(compile_budget=budget), **run)

    configured = configured_budget(step)
    bare = {name: "none" for name in applied_modes(model)}  # the eager checkpointing left on it goes
    with apply_plan(model, bare, announce=False):
        first = simulated(None)
        if first.peak <= limit:
            return CheckpointPlan(
                blocks=(), budget=limit, peak=first.peak, peak_none=first.peak, breakdown=first
            )
        tried = {configured: first}
        for budget in _below(step):
            tried[budget] = breakdown = simulated(budget)
            log.info(
                "The compiled step at torch.compile's activation_memory_budget=%g peaks at %s (budget %s).",
                budget, format_bytes(breakdown.peak), format_bytes(limit),
            )  # fmt: skip
            if breakdown.peak <= limit:
                return CheckpointPlan(
                    blocks=(), budget=limit, peak=breakdown.peak, peak_none=first.peak, breakdown=breakdown,
                    compile_budget=budget,
                )  # fmt: skip
    lowest = min(tried, key=lambda b: tried[b].peak)
    b = tried[lowest]
    raise ValueError(
        f"The budget of {format_bytes(limit)} ({limit:,} bytes) is below every compiled step torch.compile's "
        f"activation_memory_budget gives this model: the lowest peaks at {format_bytes(b.peak)} ({b.peak:,} "
        f"bytes, at activation_memory_budget={lowest:g}: {b.in_words()}); as configured "
        f"({configured:g}) it peaks at {format_bytes(first.peak)}. To fit: AutoFit (a smaller micro-batch "
        "with accumulation, a lighter optimizer), a lower precision, or a larger budget."
    )
