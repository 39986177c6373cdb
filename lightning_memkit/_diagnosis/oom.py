"""When a step does not fit: what it needs, by category, and the plans that would fit, as code to paste.

A run that dies of ``torch.OutOfMemoryError`` ends with a traceback that says where, not why nor what to
change. `explain_oom` writes what `MemoryMonitor` and `AutoFit` print before it: the memory the step had,
what it needs by category (`step_need`: measured on an earlier step of the same signature, else simulated
for this very batch), the phase it died in, and the fastest plans that fit (`plans_section`: `plan_fit` at
that size), each with its simulated peak and the code that sets it (`_diagnosis.plan_code`, which ``memkit
plan`` prints whole). ``memkit estimate --gpu`` prints the same plans for a step that does not fit a card.

Nothing here allocates on the device that ran out: the need and the plans are simulated on fake tensors
(from a CPU copy of the batch), and the plans are ranked by counted FLOPs, never timed. A large model's
step takes seconds to simulate, and a plan dozens of them: at most `PLAN_REFINE_LIMIT` micro-batches get a
block-by-block checkpointing plan. A count, not a clock: the answer is the same on a busy machine.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from torch import Tensor, nn

from lightning_memkit._breakdown import MemoryBreakdown, format_bytes
from lightning_memkit._budget import Budget
from lightning_memkit._checkpointing.policies import apply_plan, budget_before_plans
from lightning_memkit._diagnosis.plan_code import autofit_code, by_hand_code, by_the_strategy, lever_callbacks
from lightning_memkit._estimating.analytic import model_static, shard
from lightning_memkit._estimating.lightning_step import batch_size, repeat_batch
from lightning_memkit._estimating.simulate import estimate_step
from lightning_memkit._fitting.plan import FitPlan
from lightning_memkit._fitting.search import plan_fit
from lightning_memkit._optimizers.swap import lighter_candidates
from lightning_memkit._sharding import fsdp2 as _fsdp2
from lightning_memkit._sharding import layout as _layout
from lightning_memkit._step import Step

__all__ = [
    "MAX_PLANS",
    "PHASES",
    "PLAN_REFINE_LIMIT",
    "StepInFlight",
    "explain_oom",
    "fastest_plans",
    "on_cpu",
    "plans_section",
    "run_candidates",
    "step_need",
]

#: The phases of a training step, as the callbacks' hooks tell them apart.
PHASES = ("forward", "backward", "optimizer step")
#: Plans an explanation shows at most.
MAX_PLANS = 3
#: Micro-batches an explanation's plan gives a block-by-block checkpointing plan (`plan_fit`'s
#: ``refine_limit``); the others get full checkpointing, where it fits.
PLAN_REFINE_LIMIT = 2


class StepInFlight:
    """The training step running now, as a callback's hooks see it: its batch, index and phase.

    What an OOM explanation needs, kept only while the step runs: ``start`` in ``on_train_batch_start``,
    ``enter("backward")`` in ``on_before_backward``, ``enter("optimizer step")`` in
    ``on_before_optimizer_step`` (Lightning calls it after the closure's backward, before the optimizer's
    update) and ``end`` in ``on_train_batch_end`` or once the OOM is explained, which drops the batch.
    """

    def __init__(self) -> None:
        self.batch: Any = None
        self.batch_idx = -1
        #: one of `PHASES`; ``None`` between steps
        self.phase: str | None = None

    def start(self, batch: Any, batch_idx: int) -> None:
        self.batch, self.batch_idx, self.phase = batch, batch_idx, PHASES[0]

    def enter(self, phase: str) -> None:
        if self.phase is not None:
            self.phase = phase

    def end(self) -> None:
        self.batch, self.phase = None, None


def step_need(
    model: nn.Module,
    batch: Any,
    step: Step,
    *,
    measured: MemoryBreakdown | None = None,
    strategy: str = "ddp",
    world_size: int = 1,
    **run: Any,
) -> tuple[MemoryBreakdown, str]:
    """What one rank's training step of ``model`` on ``batch`` needs, by category, and how that is known.

    ``measured`` (the breakdown of an earlier step of the same signature) when there is one, else ``step``
    simulated (``run``: ``optimizer``, ``device``) on a CPU copy of the batch, divided as ``strategy``
    shards it over ``world_size``; a step with FSDP2's `Sharding`: one rank's sharded step simulated
    (``model`` unsharded: `simulable`).
    """
    if measured is not None:
        return measured, "measured on an earlier step of the same shapes"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        need = estimate_step(model, on_cpu(batch), step, **run)
    if step.sharding is not None:
        layout = f"{step.sharding.world_size} under {step.sharding.describe()}"
        return need, f"one rank's step of {layout}, simulated for this batch"
    if world_size > 1:
        grads = model_static(model, step.precision).gradients
        need = shard(need, strategy, world_size, gradient_bytes=grads)
    return need, "simulated for this batch"


def simulable(model: nn.Module, optimizer: Any) -> tuple[nn.Module, Any]:
    """``model`` and ``optimizer`` as a simulation can copy them: a model ``fully_shard`` was applied to (in
    ``configure_model``, before the step that failed) or tensor parallelism as its unsharded twin, and the
    optimizer over the twin's parameters (`_sharding.fsdp2.unsharded_twin`); any other model as it is."""
    if not _fsdp2.is_sharded(model) and not _layout.layout_of(model):
        return model, optimizer
    twin, tensors = _fsdp2.unsharded_twin(model)
    if isinstance(optimizer, torch.optim.Optimizer):
        optimizer = _fsdp2.over_twins(optimizer, tensors)
    return twin, optimizer


def run_candidates(model: nn.Module, optimizer: str | None) -> tuple[str | None, ...] | None:
    """The optimizers to plan a run with, in quality order: the catalogue name of the one it runs and the
    lighter ones after it (`lighter_candidates`); ``None`` where that is `plan_fit`'s default (the
    module's own ``configure_optimizers`` one) or the optimizer is not known."""
    default = lighter_candidates(model)
    if optimizer is None or (default and default[0] == optimizer):
        return None
    return default[default.index(optimizer) :] if optimizer in default else (optimizer,)


def explain_oom(
    model: nn.Module,
    batch: Any,
    budget: Budget | None,
    *,
    title: str,
    need: MemoryBreakdown,
    source: str,
    accumulate: int = 1,
    **plan_options: Any,
) -> str:
    """The message for a training step that ran out of memory.

    ``title``, then the memory ``budget`` gives the step and what the step ``need``\\ s by category (known as
    ``source`` says: `step_need`), then the fastest plans for the global batch (``batch``, one rank's
    micro-batch, times ``accumulate`` and the ranks) that fit ``budget`` (`plans_section`, given
    ``plan_options``). Without a budget (a CPU run) no plan is made. When the need fits the budget by these
    figures, what ran out is memory they do not see, and the plans are made for the need itself: leaner
    than the step that ran out.
    """
    lines = [title]
    table = [f"    {line}" for line in str(need).splitlines()]
    if budget is None:
        lines += [
            f"The step needs {format_bytes(need.peak)} ({source}); the memory available is unknown here "
            '(no budget, not CUDA), so no plan is made: give one, e.g. MemoryMonitor(budget="8GB").',
            *table,
        ]
        return "\n".join(lines)
    available = _describe(budget)
    if need.peak > budget.usable:
        lines.append(
            f"The step needs {format_bytes(need.peak)} ({source}), {format_bytes(need.peak - budget.usable)} "
            f"more than the {available} there is:"
        )
    else:
        lines.append(
            f"The step needs {format_bytes(need.peak)} ({source}) of the {available} there is: by these "
            "figures it fits, so what ran out is memory they do not see (the caching allocator's "
            "fragmentation: try PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; another process on the "
            "device). The plans below are for the step's own figure, so they are leaner than this step:"
        )
        budget = Budget(need.peak, need.peak, f"{format_bytes(need.peak)}, this step's need")
    copies = accumulate * plan_options.get("world_size", 1)  # (micro, ...) -> (micro * copies, ...)
    whole = repeat_batch(on_cpu(batch), copies, plan_options.get("batch_axes"))
    lines += [*table, *plans_section(model, whole, budget, **plan_options)]
    return "\n".join(lines)


def plans_section(
    model: nn.Module,
    batch: Any,
    budget: Budget,
    *,
    margin: float = 0.1,
    optimizers: Sequence[str | None] | None = None,
    planner_present: bool = False,
    **plan_options: Any,
) -> list[str]:
    """Lines that give the fastest plans (at most `MAX_PLANS`) that fit ``budget``, each with its simulated
    peak, its time relative to the fastest and its code, then the ``AutoFit`` line that makes the first
    as the fit starts (``planner_present``: the run has an AutoFit already, whose arguments these are).

    ``batch`` is the global batch (all ranks); ``plan_options`` are `plan_fit`'s keywords. The model is
    planned as written: checkpointing a callback applied is set aside while planning, and so is the
    torch.compile activation budget a plan set (the simulation reads it; nothing compiled is forgotten).
    When nothing fits, the lines give `plan_fit`'s reason (the floor and what would fit); a plan that
    fails otherwise is one line. The work is bounded by a count (`PLAN_REFINE_LIMIT`), never by time.
    """
    options = {"cost": "flops", "refine_limit": PLAN_REFINE_LIMIT, **plan_options}
    from torch._functorch import config

    # a compiled model's activation budget as the user's run sets it, for the simulations only: dynamo's
    # compiled graphs are kept (no torch.compiler.reset(), which setting it for a run does)
    before = budget_before_plans()
    as_written = contextlib.nullcontext() if before is None else config.patch(activation_memory_budget=before)
    try:
        with apply_plan(model, "none", announce=False), as_written, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = plan_fit(model, batch, budget, margin=margin, optimizers=optimizers, **options)
    except ValueError as err:  # nothing fits: plan_fit says the floor and what would
        return [f"  {err}"]
    except Exception as err:
        return [f"  No plan: {err!r}."]
    ranked = fastest_plans(plan)
    lines = [
        f"Plans that fit in {format_bytes(plan.limit)} (the {format_bytes(budget.usable)} less a "
        f"{margin:.0%} margin), fastest first, each with its simulated peak and its time per global batch:"
    ]
    fsdp2 = by_the_strategy(plan)
    planner = "AutoFitStrategy" if fsdp2 else "AutoFit"
    names = {planner}
    for i, (option, relative) in enumerate(ranked, 1):
        lines.append(
            f"  {i}. {_brief(option)}: peak {format_bytes(option.estimated_peak)}, time {relative:.2f}x"
        )
        lines += [f"       {line}" for code in by_hand_code(option, model) for line in code.splitlines()]
        names.update(c.split("(")[0] for c in lever_callbacks(option))
    per_gpu = batch_size(batch, plan_options.get("batch_axes")) // plan.world_size
    verb = "give" if planner_present else "use" if fsdp2 else "add"
    what = f"{planner} these arguments, which make" if planner_present else f"{planner}, which makes"
    lines += [
        f"  Or {verb} {what} plan 1 as the fit starts, with batch_size = {per_gpu} (the global batch per "
        "GPU):",
        *(f"       {line}" for line in autofit_code(plan, optimizers=optimizers).splitlines()),
        f"  (from lightning_memkit import {', '.join(sorted(names))})",
    ]
    return lines


def fastest_plans(plan: FitPlan, n: int = MAX_PLANS) -> list[tuple[FitPlan, float]]:
    """``plan`` and its alternatives that fit, with their times relative to it, fastest first: at most ``n``.

    Only alternatives with a known time count (the plan's optimizer and precision); each is a `FitPlan` of
    its own, whose checkpointing is the alternative's mode (a per-block one other than the plan's is left to
    ``ActivationCheckpointing``'s budget, as `plan_code` writes it)."""
    chosen = (plan.micro_batch_size, plan.checkpointing, plan.optimizer, plan.precision)
    ranked: dict[tuple, tuple[FitPlan, float]] = {chosen: (plan, 1.0)}
    rows = sorted(
        (a for a in plan.alternatives if a.fits and a.time is not None), key=lambda a: (a.time, a.peak)
    )
    for a in rows:
        key = (a.micro_batch_size, a.checkpointing, a.optimizer, a.precision)
        if key not in ranked:
            option = replace(
                plan,
                micro_batch_size=a.micro_batch_size,
                accumulate_grad_batches=a.accumulate_grad_batches,
                checkpointing=a.checkpointing,
                optimizer=a.optimizer,
                precision=a.precision,
                estimated_peak=a.peak,
                alternatives=(),
                checkpoint_plan=None,
            )
            ranked[key] = (option, a.time)
    return list(ranked.values())[:n]


# --- helpers --------------------------------------------------------------------------------------


def _brief(plan: FitPlan) -> str:
    gpus = f" x {plan.world_size} GPUs ({plan.strategy})" if plan.world_size > 1 else ""
    return (
        f"micro-batch {plan.micro_batch_size} x accumulate {plan.accumulate_grad_batches}{gpus}, "
        f"checkpointing {plan.checkpointing}, {plan.optimizer or 'configured optimizer'}, {plan.precision}"
    )


def _describe(budget: Budget) -> str:
    """``"3.81 MiB (4000000 bytes)"``; a device's with its size: ``"35.18 GiB usable of A100-40GB"``."""
    if budget.total == budget.usable:
        return f"{format_bytes(budget.usable)} ({budget.source})"
    return f"{format_bytes(budget.usable)} usable of {budget.source} ({format_bytes(budget.total)})"


def on_cpu(batch: Any, *, copy: bool = False) -> Any:
    """``batch`` with its tensors on the CPU: a copy of what is elsewhere (the device is full); ``copy``:
    of CPU tensors too (a batch kept for later)."""
    return apply_to_collection(batch, Tensor, lambda t: t.detach().to("cpu", copy=copy))
