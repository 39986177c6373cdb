"""Whether a checkpoint's `FitPlan` still holds for the run that resumes from it.

A plan fits the run it was made for: its world size and layout, tensor-parallel degree and HSDP split
included (one rank's share of a sharded step grows as the ranks sharding it get fewer), its budget and
margin, its precision, the device it was simulated for, the step lever beside it, the checkpointing modes
allowed and the batch each rank splits. Installed in a run that
differs in any of them it fits something else: a plan saved on 4 FSDP2 ranks and installed on 2 runs every
step over its limit. `stale` names what differs; `AutoFit` and `AutoFitStrategy` install a checkpoint's plan
only where nothing does, and otherwise plan for the run at hand, with the checkpoint's optimizer, whose
state the checkpoint holds (`refusal` says what to do where that cannot be).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning_memkit._breakdown import format_bytes
from lightning_memkit._fitting.plan import FitPlan

__all__ = ["Change", "optimizer_name", "refusal", "said", "stale"]

#: what differs, as a message names it, with the saved plan's value and this run's (``"world size"``,
#: ``"4"``, ``"2"``)
Change = tuple[str, str, str]


def stale(saved: FitPlan, current: FitPlan) -> list[Change]:
    """What the run ``current`` was made for differs in from the run ``saved`` was made for, each with
    both values; empty where ``saved`` holds for this run."""
    changes: list[Change] = []

    def differ(what: str, old: Any, new: Any, show: Callable[[Any], str] = str) -> None:
        if old != new:
            changes.append((what, show(old), show(new)))

    differ("world size", saved.world_size, current.world_size)
    differ("strategy", _layout(saved), _layout(current))
    # tensor parallel, HSDP: another rank's share (beside the world size, which says itself)
    degrees = (
        (saved.tensor_parallel_size, saved.replicate_size),
        (current.tensor_parallel_size, current.replicate_size),
    )
    if saved.strategy == current.strategy == "fsdp2" and degrees[0] != degrees[1]:
        differ("parallel layout", saved.layout, current.layout)
    differ("FSDP2 bf16 MixedPrecisionPolicy", saved.mp_policy, current.mp_policy)
    usable = (saved.budget.total, saved.budget.usable), (current.budget.total, current.budget.usable)
    if usable[0] != usable[1]:
        changes.append(("budget", _budget(saved), _budget(current)))
    differ("margin", saved.margin, current.margin, "{:.0%}".format)
    differ("precision", saved.precision, current.precision)
    differ("device", saved.device, current.device)
    differ("step lever", saved.lever, current.lever, lambda lever: lever or "none")
    differ("samples per rank and optimizer step", _per_rank(saved), _per_rank(current))
    differ("checkpointing modes", saved.modes, current.modes, ", ".join)
    return changes


def said(changes: list[Change]) -> str:
    """``changes`` in words: ``"world size 4 -> 2; precision 32-true -> bf16-mixed"``."""
    return "; ".join(f"{what} {old} -> {new}" for what, old, new in changes)


def optimizer_name(plan: FitPlan) -> str:
    """The plan's optimizer, as a message names it."""
    return plan.optimizer or "the module's own optimizer"


def refusal(saved: FitPlan, current: FitPlan, changed: list[Change], why: str, fix: str) -> str:
    """Why a checkpoint's optimizer state cannot go on in this run, and what to do: the checkpoint holds
    ``saved``'s optimizer's state, and this run (``changed`` from the checkpoint's) plans ``current``."""
    differs = f" (this run: {said(changed)})" if changed else ""
    return (
        f"the checkpoint holds the state of {optimizer_name(saved)}, saved with the plan "
        f"{saved.summary()}{differs}; this run's plan steps {optimizer_name(current)}, {why}. {fix}"
    )


def _layout(plan: FitPlan) -> str:
    """The plan's strategy, one device read alike whatever its name (``"auto"``; ``"ddp"``, the default of a
    plan saved without one)."""
    return "one device" if plan.world_size == 1 and plan.strategy in ("auto", "ddp") else plan.strategy


def _per_rank(plan: FitPlan) -> int:
    return plan.micro_batch_size * plan.accumulate_grad_batches


def _budget(plan: FitPlan) -> str:
    return f"{format_bytes(plan.budget.usable)} ({plan.budget.source})"
