"""What `AutoFit.resume_with` decides and says about a checkpoint's plan: whether the blocks it checkpoints
are this run's, and the warnings and refusals that name what differed and what to do.

Which plan a resumed fit trains with, with the reasons: ``docs/design/autofit-callback.md``, "Resume";
the comparison of the rest of the plan is `_fitting.resume.stale`.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from lightning_memkit._checkpointing.blocks import LayerClasses, find_blocks
from lightning_memkit._fitting.plan import FitPlan
from lightning_memkit._fitting.resume import Change, optimizer_name, refusal, said

__all__ = ["blocks_changed", "head", "not_replanned", "optimizers_set_aside", "replan_failed", "weights_only"]


def blocks_changed(saved: FitPlan, module: nn.Module, blocks: LayerClasses | None) -> list[Change]:
    """Where ``saved`` (a checkpoint's plan) names the blocks it checkpoints and this run's ``blocks`` (the
    layer classes it plans) give others in ``module``, the change (`stale` compares the rest): the plan is
    then this run's, not the saved."""
    if saved.checkpoint_plan is None or not saved.checkpoint_plan.blocks:
        return []  # installed on the blocks this run names (`AutoFit._apply`)
    theirs = [block.name for block in saved.checkpoint_plan.blocks]
    ours = [name for name, _ in find_blocks(module, blocks)]
    if set(theirs) == set(ours):
        return []

    def show(names: list[str]) -> str:
        return f"{len(names)} ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"

    return [("checkpointed blocks", show(theirs), show(ours))]


def optimizers_set_aside(optimizers: Sequence[str] | None, saved: FitPlan, module: nn.Module) -> str | None:
    """The warning that ``AutoFit(optimizers=...)`` is set aside for the installed ``saved`` plan's
    optimizer, or ``None`` where it names that optimizer (or was not given)."""
    if optimizers is None or saved.optimizer in optimizers:
        return None
    return (
        f"AutoFit(optimizers={list(optimizers)!r}) set aside: the checkpoint's plan, made "
        f"for this run, trains with {saved.optimizer}, whose state the checkpoint holds. To "
        f"change the optimizer, start from its weights alone ({type(module).__name__}."
        "load_from_checkpoint(path), then fit without ckpt_path)."
    )


def head(changed: list[Change], saved: FitPlan, strategy: str) -> str:
    """The opening of what is said of a checkpoint's plan this fit does not install: what differed, or
    that ``strategy`` restores it too late."""
    if changed:
        return f"AutoFit: the checkpoint's plan was made for another run ({said(changed)})"
    return (
        f"AutoFit: the checkpoint's plan ({saved.summary()}) is not this fit's, and {strategy} "
        "restores it after building the optimizers"
    )


def weights_only(module: nn.Module, current: FitPlan) -> str:
    """The way out that keeps the checkpoint's weights alone, with this fit's optimizer afresh."""
    return (
        f"(its state goes on), or start from its weights alone ({type(module).__name__}"
        f".load_from_checkpoint(path), then fit without ckpt_path), {optimizer_name(current)} afresh."
    )


def not_replanned(
    saved: FitPlan, current: FitPlan, changed: list[Change], strategy: str, weights: str
) -> str:
    """Why a fit that cannot plan again (the optimizers built before the checkpoint is restored) refuses
    a checkpoint whose optimizer this fit's plan does not step."""
    who = "AutoFitStrategy" if strategy == "AutoFitStrategy" else "AutoFit"
    fix = f"Give {who}(..., optimizers=[{saved.optimizer!r}]) to plan with the checkpoint's optimizer"
    why = f"and {strategy} built it before restoring the checkpoint"
    return "AutoFit: " + refusal(saved, current, changed, why, f"{fix} {weights}")


def replan_failed(
    saved: FitPlan, current: FitPlan, changed: list[Change], error: ValueError, weights: str
) -> str:
    """Why a fit planned again with the checkpoint's optimizer refuses it: no plan with it fits here."""
    made_for = "; ".join(f"{what} {old}" for what, old, _ in changed)
    why = f"and no plan with {optimizer_name(saved)} fits here ({str(error).splitlines()[0]})"
    fix = f"Resume where the checkpoint's plan fits ({made_for}) {weights}"
    return "AutoFit: " + refusal(saved, current, changed, why, fix)
