"""What `MemoryMonitor` and `AutoFit` print when a training step runs out of memory: the run read from the
Trainer (its budget or plan, precision, sharding, step levers, optimizer), explained by
`_diagnosis.oom.explain_oom`, on the rank that ran out (rank 1's OOM is rank 1's step: its own batch)."""

from __future__ import annotations

import logging
import warnings

import lightning.pytorch as pl
import torch

from lightning_memkit._breakdown import MemoryBreakdown
from lightning_memkit._budget import Budget
from lightning_memkit._checkpointing.policies import CHECKPOINT_MODES
from lightning_memkit._diagnosis.oom import StepInFlight, explain_oom, run_candidates, simulable, step_need
from lightning_memkit._estimating.lightning_step import batch_size
from lightning_memkit._fitting.plan import FitPlan
from lightning_memkit._optimizers.swap import identify
from lightning_memkit.callbacks._step_guard import StepGuard
from lightning_memkit.callbacks._trainer import (
    into_gradients,
    precision,
    sharding,
    step_lever,
    the_optimizer,
    trainer_step,
)


def report_oom(
    trainer: pl.Trainer,
    pl_module: pl.LightningModule,
    step: StepInFlight,
    budget: Budget | None,
    *,
    who: str,
    measured: MemoryBreakdown | None = None,
) -> None:
    """Warn what `explain_run_oom` says of an OOM in ``step``, on the rank it struck (named where there are
    several: another rank may never see an error, only wait in its next collective). Never raises: the
    OOM, not an error of explaining it, is what the run dies of; such an error is one line."""
    try:
        message = explain_run_oom(trainer, pl_module, step, budget, who=who, measured=measured)
    except Exception as err:
        message = f"{who}: out of memory; explaining it failed ({err!r}). The error follows."
    if trainer.world_size > 1:
        message = f"[rank {trainer.global_rank}] {message}"
    try:
        warnings.warn(message, UserWarning, stacklevel=2)
    except Exception:  # warnings turned into errors (-W error): say it as information instead
        logging.getLogger(__name__).info(message)


def explain_run_oom(
    trainer: pl.Trainer,
    pl_module: pl.LightningModule,
    step: StepInFlight,
    budget: Budget | None,
    *,
    who: str,
    measured: MemoryBreakdown | None = None,
) -> str:
    """`explain_oom` for an OOM in the training ``step`` in flight, the run read from the Trainer.

    The memory is ``budget``, else the budget of a callback that planned the run (AutoFit's `FitPlan`, with
    its margin and checkpointing modes), else a CUDA device's memory less the context and reserve. The
    plans keep the Trainer's precision, strategy, step levers and global batch (the batch times
    ``accumulate_grad_batches``), and start from the optimizer the run has. ``measured`` is the breakdown of
    an earlier step like this one. AutoFit's `StepGuard`, if still on the module, is removed first: it serves
    the run, which is ending, and the step simulated is the module's own.
    """
    if step.phase is None:
        return (
            f"{who}: out of memory outside a training step (in validation, a hook or between steps); only "
            "training steps are explained."
        )
    guard = getattr(pl_module.__dict__.get("training_step"), "__self__", None)
    if isinstance(guard, StepGuard):
        guard.remove()
    planner = next((c for c in trainer.callbacks if isinstance(getattr(c, "plan", None), FitPlan)), None)
    plan = None if planner is None else planner.plan
    axes = getattr(planner, "sample_axes", None)  # as AutoFit read them off the loader; else dim 0
    device = trainer.strategy.root_device
    if budget is None and plan is not None:
        budget = plan.budget
    elif budget is None and device.type == "cuda":
        budget = Budget.for_device(torch.cuda.get_device_properties(device).total_memory, str(device))
    kind = "cuda" if device.type == "cuda" else "cpu"
    strategy, ranks = sharding(trainer)
    lever = step_lever(trainer)
    # Under FSDP2 the module is sharded by now: its unsharded twin is simulated and planned.
    model, optimizer = simulable(pl_module, the_optimizer(trainer))
    as_run = trainer_step(
        trainer,
        first_step=trainer.global_step == 0,  # not `not optimizer.state`: SGD keeps none
        accumulating=into_gradients(trainer, step.batch_idx),
    )
    need, source = step_need(
        model,
        step.batch,
        as_run,
        measured=measured,
        strategy=strategy,
        world_size=ranks,
        optimizer=optimizer,
        device=kind,
    )
    try:
        samples = f", {batch_size(step.batch, axes)} samples"
    except ValueError:  # tensors that disagree on their samples
        samples = ""
    where = f"the {step.phase} of step {trainer.global_step} (batch {step.batch_idx}{samples})"
    title = f"{who}: out of memory in {where}."
    if plan is not None:
        title += f"\nThe run had AutoFit's plan: {plan.summary()}."
        if hasattr(planner, "recovery_note"):
            title += f"\n{planner.recovery_note(trainer, pl_module, step.phase)}"
    # The plans start from the run's optimizer; read only where something is planned (it loads bitsandbytes).
    candidates = None
    if budget is not None:
        candidates = run_candidates(model, identify(optimizer) if optimizer is not None else None)
    return explain_oom(
        model,
        step.batch,
        budget,
        title=title,
        need=need,
        source=source,
        accumulate=trainer.accumulate_grad_batches,
        margin=plan.margin if plan is not None else 0.1,
        optimizers=candidates,
        precision=precision(trainer),
        checkpointing=plan.checkpointing_asked if plan is not None else CHECKPOINT_MODES,
        strategy=strategy,
        world_size=ranks,
        device=kind,
        compensate=False,  # the Trainer's precision is the user's: their optimizer stays a candidate
        planner_present=plan is not None,
        batch_axes=axes,
        lever=lever,
    )
