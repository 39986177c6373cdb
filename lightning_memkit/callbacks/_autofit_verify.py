"""The run held to `AutoFit`'s plan: where its out-of-memory recovery (`StepGuard`) can run and why it did
not, what is said when no leaner plan is left, a first step that peaked over the plan's limit, and a
`MemoryMonitor` beside AutoFit that warns over another budget.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import SingleDeviceStrategy

from lightning_memkit._breakdown import format_bytes
from lightning_memkit._fitting.plan import FitPlan
from lightning_memkit.callbacks._trainer import step_lever

__all__ = ["budgets_differ", "no_leaner_plan", "not_recovered", "over_limit", "unrecoverable"]


def unrecoverable(trainer: pl.Trainer, module: pl.LightningModule) -> str | None:
    """Why `StepGuard` cannot recover from an OOM here, or ``None`` if it can: it needs one device that
    runs the module unwrapped, a precision plugin whose backward calls the module's ``backward`` hook,
    automatic optimization, and no optimizer step inside backward."""
    if not isinstance(trainer.strategy, SingleDeviceStrategy):
        return f"it recovers on one device, and {type(trainer.strategy).__name__} runs several"
    if type(trainer.precision_plugin).backward is not Precision.backward:
        return f"{type(trainer.precision_plugin).__name__} runs the backward itself, where it cannot cut it"
    if not module.automatic_optimization:
        return "the module's optimization is manual"
    if step_lever(trainer) == "fused_step":
        return (
            "FusedOptimizerStep steps each parameter inside the backward: a retried slice would step them "
            "again. Without FusedOptimizerStep, AutoFit re-plans one notch leaner and runs the batch again"
        )
    return None


def not_recovered(
    trainer: pl.Trainer, module: pl.LightningModule, phase: str | None, verify_steps: int, steps: int
) -> str:
    """Why an out-of-memory error in ``phase``, ``steps`` optimizer steps into the fit, was not recovered
    from (`report_oom` says it)."""
    why = unrecoverable(trainer, module)
    if verify_steps == 0:
        why = "verify_steps=0 turns the recovery off"
    elif why is None and phase == "optimizer step":
        why = "it recovers in the forward and the backward, not in the optimizer step"
    elif why is None and steps >= verify_steps:
        why = f"it recovers in the first verify_steps={verify_steps} steps only"
    elif why is None:
        why = "the leanest plan ran out of memory too"
    return f"AutoFit did not re-plan and retry: {why}."


def no_leaner_plan(plan: FitPlan, checkpointing: Sequence[str]) -> torch.OutOfMemoryError:
    """The OOM raised where ``plan`` ran out of memory and no plan one notch leaner is left: an OOM still,
    so that the run's end explains it (`AutoFit.on_exception`), with the plan applied."""
    allowed = [m for m in checkpointing if m in plan.modes]
    strongest = (
        f"torch.compile's activation budget {plan.compile_budget:g} (a lower one need not peak lower)"
        if plan.compile_budget is not None
        else f"{plan.checkpointing} checkpointing, the strongest this model is planned with "
        f"({', '.join(allowed)})"
    )
    return torch.OutOfMemoryError(
        f"AutoFit: out of memory at micro-batch {plan.micro_batch_size} with {strongest}: no "
        "leaner plan is left; lower the budget given to AutoFit so that a lighter optimizer is "
        "chosen."
    )


def over_limit(step: int, measured: int, plan: FitPlan) -> str | None:
    """The warning for a step that peaked at ``measured`` bytes over ``plan``'s limit, else ``None``."""
    if measured <= plan.limit:
        return None
    return (
        f"AutoFit: step {step} peaked at {format_bytes(measured)}, over the plan's "
        f"limit of {format_bytes(plan.limit)} (estimated "
        f"{format_bytes(plan.estimated_peak)}); "
        "raise margin= or lower the budget."
    )


def budgets_differ(monitor: Any, plan: FitPlan, budget: Any) -> str | None:
    """Where a `MemoryMonitor`'s own budget (it warns over it and reports fractions of it) is not the one
    ``plan`` fits (AutoFit's ``budget``, as given), the warning: their figures would disagree."""
    theirs, mine = getattr(monitor, "budget", None), plan.budget
    if theirs is None or abs(theirs - mine.usable) <= 0.01 * mine.usable:
        return None
    return (
        f"MemoryMonitor(budget={monitor._budget.given!r}) beside AutoFit(budget={budget!r}): "
        f"the monitor warns over {format_bytes(theirs)} and logs peaks as fractions of it, while "
        f"AutoFit plans for {format_bytes(mine.usable)} (a limit of "
        f"{format_bytes(plan.limit)} after its margin). Give both the same budget, or the "
        "monitor none (AutoFit checks the first steps against its plan)."
    )
