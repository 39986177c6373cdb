"""When a step does not fit: what it needs, by category, and the plans that would fit, as code to paste.

A run that dies of ``torch.OutOfMemoryError`` ends with a traceback that says where, not why nor what to
change. `explain_oom` writes what `MemoryMonitor` and `AutoFit` print before it: the memory the step had,
what it needs by category (`step_need`: measured on an earlier step of the same signature, else simulated
for this very batch), the phase it died in, and the fastest plans that fit (`plans_section`: `plan_fit` at
that size), each with its simulated peak and the code that sets it (`plan_code`, which ``memkit plan``
prints whole). ``memkit estimate --gpu`` prints the same plans for a step that does not fit a card.

Nothing here allocates on the device that ran out: the need and the plans are simulated on fake tensors
(from a CPU copy of the batch), and the plans are ranked by counted FLOPs, never timed. A large model's
step takes seconds to simulate, and a plan dozens of them: at most `PLAN_REFINE_LIMIT` micro-batches get a
block-by-block checkpointing plan. A count, not a clock: the answer is the same on a busy machine.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.pytorch import LightningModule
from torch import Tensor, nn

from lightning_memkit._breakdown import MemoryBreakdown, format_bytes
from lightning_memkit._budget import GPUS, Budget, parse_budget
from lightning_memkit._checkpointing.blocks import find_blocks
from lightning_memkit._checkpointing.policies import CHECKPOINT_MODES, apply_plan, budget_before_plans
from lightning_memkit._estimating.analytic import model_static, shard
from lightning_memkit._estimating.lightning_step import batch_size, repeat_batch
from lightning_memkit._estimating.simulate import estimate_step
from lightning_memkit._fitting.plan import FitPlan
from lightning_memkit._fitting.search import plan_fit
from lightning_memkit._optimizers.swap import (
    COMPENSATED,
    DEFAULT_CANDIDATES,
    KAHAN,
    configured_optimizer,
    constructor,
    constructor_arguments,
    identify,
    lighter_candidates,
)
from lightning_memkit._sharding import fsdp2 as _fsdp2
from lightning_memkit._sharding import layout as _layout
from lightning_memkit._step import Step

__all__ = [
    "MAX_PLANS",
    "PHASES",
    "PLAN_REFINE_LIMIT",
    "StepInFlight",
    "autofit_code",
    "by_hand_code",
    "explain_oom",
    "fastest_plans",
    "on_cpu",
    "optimizer_code",
    "plan_code",
    "plans_section",
    "run_candidates",
    "size_text",
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
    n_gpus: int = 1,
    **run: Any,
) -> tuple[MemoryBreakdown, str]:
    """What one rank's training step of ``model`` on ``batch`` needs, by category, and how that is known.

    ``measured`` (the breakdown of an earlier step of the same signature) when there is one, else ``step``
    simulated (``run``: ``optimizer``, ``device``) on a CPU copy of the batch, divided as ``strategy``
    shards it over ``n_gpus``; a step with FSDP2's `Sharding`: one rank's sharded step simulated
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
    if n_gpus > 1:
        grads = model_static(model, step.precision).gradients
        need = shard(need, strategy, n_gpus, gradient_bytes=grads)
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
    copies = accumulate * plan_options.get("n_gpus", 1)  # (micro, ...) -> (micro * copies, ...)
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
    fsdp2 = _by_the_strategy(plan)
    planner = "AutoFitStrategy" if fsdp2 else "AutoFit"
    names = {planner}
    for i, (option, relative) in enumerate(ranked, 1):
        lines.append(
            f"  {i}. {_brief(option)}: peak {format_bytes(option.estimated_peak)}, time {relative:.2f}x"
        )
        lines += [f"       {line}" for code in by_hand_code(option, model) for line in code.splitlines()]
        names.update(c.split("(")[0] for c in _levers(option))
    per_gpu = batch_size(batch, plan_options.get("batch_axes")) // plan.n_gpus
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


# --- the plan as code -----------------------------------------------------------------------------


def plan_code(
    plan: FitPlan,
    model: nn.Module,
    *,
    global_batch: int,
    optimizers: Sequence[str | None] | None,
) -> str:
    """The plan as Python a user pastes: the Trainer with ``AutoFit``, which makes this plan as the fit
    starts (`autofit_code`), then the same set by hand (`by_hand_code`). ``optimizers`` are the candidates
    planned, if given (``--optimizer``). The callback that changes the step the plan was made for
    (`FitPlan.lever`, ``"FusedOptimizerStep"``) is in both Trainers."""
    named = plan.budget.source in GPUS
    fsdp2 = _by_the_strategy(plan)
    planner = "AutoFitStrategy" if fsdp2 else "AutoFit"
    imports = sorted({planner, *(c.split("(")[0] for c in _levers(plan))})
    card = f"#    The budget is what a {plan.budget.source} card leaves after the CUDA context and reserve."
    if _budget_argument(plan.budget) == '"auto"':  # a card by its size, as it reads on the run's device
        card = (
            f'#    budget="auto" reads the card the run is on: a {plan.budget.source} card leaves '
            f"{format_bytes(plan.budget.usable)} after the CUDA context and reserve."
        )
    named = named or plan.budget.usable == plan.budget.total  # a plain limit: nothing was taken off
    per_gpu = global_batch // plan.data_parallel_size  # a tensor-parallel group shares its batch
    return "\n".join(
        [
            "from lightning.pytorch import Trainer",
            *(["from lightning.pytorch.strategies import ModelParallelStrategy"] if fsdp2 else []),
            f"from lightning_memkit import {', '.join(imports)}",
            "",
            *_autofit_section(plan, optimizers, per_gpu, [] if named else [card]),
            *([fsdp2_layout(plan, model)] if fsdp2 else []),
            *by_hand_code(plan, model),
        ]
    )


def _autofit_section(
    plan: FitPlan, optimizers: Sequence[str | None] | None, per_gpu: int, card: list[str]
) -> list[str]:
    fsdp2 = _by_the_strategy(plan)
    first = (
        ["# 1. AutoFitStrategy makes this plan as fit starts (rank 0, broadcast), shards the model as",
         "#    planned and reads batch_size (module or DataModule) as the"]
        if fsdp2
        else ["# 1. AutoFit makes this plan as fit starts, reading batch_size (module or DataModule) as the"]
    )  # fmt: skip
    return [
        *first,
        f"#    global batch per GPU, here {per_gpu}; it sets micro-batch and accumulation itself.",
        *card,
        autofit_code(plan, optimizers=optimizers),
        "",
        "# 2. Or by hand: batch_size is the micro-batch, the DataLoader's batch size.",
    ]


def autofit_code(plan: FitPlan, *, optimizers: Sequence[str | None] | None) -> str:
    """``trainer = Trainer(...)`` with the ``AutoFit`` that makes ``plan``: its budget (a GPU by name; a
    size as the step's limit, which is what AutoFit reads it as), margin and optimizer candidates."""
    autofit = {"budget": _budget_argument(plan.budget)}
    if plan.margin != 0.1:
        autofit["margin"] = repr(plan.margin)
    if plan.optimizer in KAHAN:  # AutoFit plans them only when named (it keeps the Trainer's optimizer)
        kahan = dict.fromkeys(COMPENSATED.get(o) for o in (optimizers or DEFAULT_CANDIDATES))
        autofit["optimizers"] = json.dumps([o for o in kahan if o is not None])
    elif optimizers is not None:
        autofit["optimizers"] = json.dumps(list(optimizers))
    levers = [f"{plan.lever}()"] if plan.lever else []
    if _by_the_strategy(plan):  # the strategy plans: no AutoFit callback
        if plan.tensor_parallel_size > 1 or plan.replicate_size > 1:  # the layout it planned, given
            autofit |= _layout_arguments(plan)
        arguments = {**_trainer_arguments(plan), "strategy": f"AutoFitStrategy({_arguments(autofit)})"}
        return _call(
            "trainer = Trainer", arguments | ({"callbacks": f"[{', '.join(levers)}]"} if levers else {})
        )
    callbacks = [f"AutoFit({_arguments(autofit)})", *levers]
    return _call("trainer = Trainer", {**_trainer_arguments(plan), "callbacks": f"[{', '.join(callbacks)}]"})


def by_hand_code(plan: FitPlan, model: nn.Module) -> list[str]:
    """``plan`` set by hand, as lines: the micro-batch (the DataLoader's batch size), the Trainer's
    arguments, checkpointing as a callback (its mode, or the step's limit when the blocks' modes differ:
    ActivationCheckpointing then plans the split) and the plan's optimizer, built in
    ``configure_optimizers`` (`optimizer_code`)."""
    by_hand = {"accumulate_grad_batches": str(plan.accumulate_grad_batches), **_trainer_arguments(plan)}
    levers = _levers(plan)
    if levers:
        by_hand["callbacks"] = f"[{', '.join(levers)}]"
    lines = [f"batch_size = {plan.micro_batch_size}", _call("trainer = Trainer", by_hand)]
    if plan.compile_budget is not None:  # set before the model is compiled, for the whole process
        lines[1:1] = [
            f"torch._functorch.config.activation_memory_budget = {plan.compile_budget:g}",
            "#    torch.compile's partitioner then keeps that share of the activations (before compiling).",
        ]
    elif plan.checkpointing not in CHECKPOINT_MODES and _sharded(plan):
        lines.append(
            f"#    The plan checkpoints block by block ({plan.checkpointing}); under {plan.strategy} "
            f"every block gets {_strongest(plan)}: it fits too, for more recompute."
        )
    elif plan.checkpointing not in CHECKPOINT_MODES:
        lines.append(
            f"#    Checkpointing block by block ({plan.checkpointing}), planned for the step's limit."
        )
    return lines + optimizer_code(plan, model)


def optimizer_code(plan: FitPlan, model: nn.Module) -> list[str]:
    """``configure_optimizers`` building ``plan``'s optimizer where the module builds another: the
    catalogue's class (`constructor`: ``bitsandbytes.optim.AdamW8bit``) over ``self.parameters()``, with the
    module's hyper-parameters translated as `swap_optimizer` translates them; a plain ``nn.Module`` (the
    CLI's presets) is planned as trained with AdamW, so only another optimizer is written, from AdamW's
    defaults. What the lines leave out (param groups, a scheduler) is said under them."""
    configured, more = configured_optimizer(model)
    own = None if configured is None else identify(configured)
    lightning = isinstance(model, LightningModule)
    if plan.optimizer is None or plan.optimizer == (own if lightning else "adamw"):
        return []
    path = constructor(plan.optimizer)
    kwargs = constructor_arguments(plan.optimizer, configured if own is not None else None)
    arguments = ["self.parameters()", *(f"{k}={v!r}" for k, v in kwargs.items())]
    call = f"    return {path}({', '.join(arguments)})"
    if len(call) > 100:
        call = "\n".join([f"    return {path}(", *(f"        {a}," for a in arguments), "    )"])
    was = own or ("the configured one" if lightning else "AdamW")
    where = f"{own}'s lr and decay kept" if own is not None else "AdamW's default lr: give yours"
    lines = [
        f"# The plan's optimizer in your LightningModule: {plan.optimizer} in place of {was} ({where}):",
        "def configure_optimizers(self):",
        f"    import {path.split('.')[0]}",
        call,
    ]
    groups = len(configured.param_groups) if configured is not None else 1
    if groups > 1 or more:
        yours = " and ".join([f"{groups} param groups"] * (groups > 1) + ["learning-rate scheduler"] * more)
        lines += [
            f"#    To keep your {yours}, build the optimizer as before, then",
            f"#    optimizer = lightning_memkit.swap_optimizer(optimizer, {json.dumps(plan.optimizer)}).",
        ]
    return lines


def _levers(plan: FitPlan) -> list[str]:
    """The callbacks that set ``plan``'s step by hand: its lever, then checkpointing. ActivationCheckpointing
    plans a budget on the unsharded step (and refuses to under FSDP): with a sharded strategy a per-block
    plan is written as its strongest mode on every block, which fits too."""
    levers = [f"{plan.lever}()"] if plan.lever else []
    if plan.compile_budget is not None:  # torch's configuration, not a callback (`by_hand_code`)
        return levers
    if plan.checkpointing not in CHECKPOINT_MODES and not _sharded(plan):  # no one mode names it
        levers.append(f"ActivationCheckpointing(budget={json.dumps(size_text(plan.limit))})")
    elif plan.checkpointing != "none":
        levers.append(f"ActivationCheckpointing(checkpointing={json.dumps(_strongest(plan))})")
    return levers


def _budget_argument(budget: Budget) -> str:
    """``budget`` as a user writes it, in a form AutoFit reads as the same budget: a GPU by name; a card
    read from the device (``"auto"``, a fraction) as that; a card given by its size (``--gpu 24GB``) by
    name where a GPU has that size, else ``"auto"``, which reads the card the run is on; a size that is the
    step's limit as given (``"40MB"``), and bytes as given (``40_000_000``). A budget made of figures (an
    OOM report's "this step's need") as a size (`size_text`)."""
    source = budget.source
    if source in GPUS or source.startswith("cuda:"):  # a name; "cuda:0" ("auto"), "cuda:0 x 0.9"
        return json.dumps(source) if source in GPUS else source.partition(" x ")[2] or '"auto"'
    if source == f"{budget.usable} bytes":
        return f"{budget.usable:_}"
    with contextlib.suppress(TypeError, ValueError):
        if parse_budget(source) == budget:
            return json.dumps(source)
        if parse_budget(source, device_size=True) == budget:  # a card by its size
            same = [name for name, mib in GPUS.items() if mib * 2**20 == budget.total]
            return json.dumps(same[0] if same else "auto")
    return json.dumps(size_text(budget.usable))


def size_text(nbytes: int) -> str:
    """``nbytes`` as a size string `parse_bytes` reads back: exact in the largest unit that divides it
    (``"9MiB"``, ``"36MB"``), else in MB (kB below 100 MB) rounded down, less than 0.1 % under it."""
    for unit, size in (("GiB", 2**30), ("GB", 10**9), ("MiB", 2**20), ("MB", 10**6), ("KiB", 2**10)):
        if nbytes >= size and nbytes % size == 0:
            return f"{nbytes // size}{unit}"
    unit, size = ("MB", 10**6) if nbytes >= 10**8 else ("kB", 10**3) if nbytes >= 10**5 else ("B", 1)
    return f"{nbytes // size}{unit}"


def _strongest(plan: FitPlan) -> str:
    """The strongest checkpointing mode ``plan`` gives a block (a per-block label, "2 selective, 2 full",
    is read when the plan has no `CheckpointPlan`)."""
    if plan.checkpoint_plan is not None:
        modes = list(plan.checkpoint_plan.modes.values())
    else:
        modes = [part.split()[-1] for part in plan.checkpointing.split(", ")]
    return max(modes, key=CHECKPOINT_MODES.index)


def _sharded(plan: FitPlan) -> bool:
    return plan.n_gpus > 1 and plan.strategy != "ddp"


def _by_the_strategy(plan: FitPlan) -> bool:
    """Whether ``plan`` is `AutoFitStrategy`'s to make (FSDP2 over several ranks), not AutoFit's."""
    return plan.n_gpus > 1 and plan.strategy == "fsdp2"


def _trainer_arguments(plan: FitPlan) -> dict[str, str]:
    trainer = {"precision": json.dumps(plan.precision)}
    if plan.device == "cpu":
        trainer = {"accelerator": '"cpu"', **trainer}
    if _by_the_strategy(plan):
        dp, tp = plan.data_parallel_size, plan.tensor_parallel_size
        strategy = f"ModelParallelStrategy(data_parallel_size={dp}, tensor_parallel_size={tp})"
        trainer |= {"strategy": strategy, "devices": str(plan.n_gpus)}
    elif plan.n_gpus > 1:
        trainer |= {"strategy": json.dumps(plan.strategy), "devices": str(plan.n_gpus)}
    return trainer


def _layout_arguments(plan: FitPlan) -> dict[str, str]:
    """`AutoFitStrategy`'s arguments for ``plan``'s layout: its tensor-parallel degree, and the data-parallel
    ranks as a number or HSDP's ``(replicate, shard)``."""
    dp, replicas = plan.data_parallel_size, plan.replicate_size
    data = f"({replicas}, {dp // replicas})" if replicas > 1 else str(dp)
    return {"tensor_parallel_size": str(plan.tensor_parallel_size), "data_parallel_size": data}


def fsdp2_layout(plan: FitPlan, model: nn.Module | None = None) -> str:
    """The layout ``plan`` simulated, as a comment for the LightningModule (`plan_code`, by hand:
    AutoFitStrategy applies it itself): tensor parallel first where it has it (torchtitan's plan, by
    ``model``'s projection names), then FSDP2 on each repeated block and the model, over the data-parallel
    ranks or HSDP's (replicate, shard) mesh."""
    option = "" if plan.reshard_after_forward in (None, True) else ", reshard_after_forward=False"
    names = ["fully_shard"]
    if plan.cpu_offload:
        option += ", offload_policy=CPUOffloadPolicy()"
        names.append("CPUOffloadPolicy")
    policy = []
    if plan.mixed_precision_policy:
        option += ", mp_policy=policy"
        names.append("MixedPrecisionPolicy")
        policy.append("policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)")
    lines = []
    tp, replicas = plan.tensor_parallel_size, plan.replicate_size
    imports = [f"from torch.distributed.fsdp import {', '.join(sorted(names))}"]
    mesh, tp_mesh = 'self.device_mesh["data_parallel"]', 'self.device_mesh["tensor_parallel"]'
    if replicas > 1:  # HSDP: its own mesh, the tensor-parallel ranks innermost as Lightning's
        imports.append("from torch.distributed.device_mesh import init_device_mesh")
        shape = (replicas, plan.data_parallel_size // replicas, *((tp,) if tp > 1 else ()))
        dims = ("replicate", "shard", *(("tensor_parallel",) if tp > 1 else ()))
        device = "cpu" if plan.device == "cpu" else "cuda"
        names_ = ", ".join(f'"{dim}"' for dim in dims)
        mesh = f'init_device_mesh("{device}", {shape}, mesh_dim_names=({names_}))'
        if tp > 1:
            lines.append(f"hsdp = {mesh}")
            mesh, tp_mesh = 'hsdp["replicate", "shard"]', 'hsdp["tensor_parallel"]'
    lines += [f"mesh = {mesh}", *policy]
    if tp > 1:
        parallel = "ColwiseParallel, RowwiseParallel, parallelize_module"
        imports.append(f"from torch.distributed.tensor.parallel import {parallel}")
        lines += [
            "plan = {  # torchtitan's LLaMA plan: split by output features, then by input features",
            *(f'    "{name}": {style}(),' for name, style in _tp_styles(model)),
            "}",
            "for layer in self.model.layers:  # your blocks, e.g. a Hugging Face model's model.model.layers",
            f"    parallelize_module(layer, {tp_mesh}, plan)",
        ]
    lines += [
        "for layer in self.model.layers:  # your blocks, e.g. a Hugging Face model's model.model.layers",
        f"    fully_shard(layer, mesh=mesh{option})",
        f"fully_shard(self.model, mesh=mesh{option})  # the module training_step calls",
    ]
    what = "FSDP2" if tp == replicas == 1 else plan.layout
    order = "each repeated block, then the model"
    if tp > 1:
        order = f"\n# tensor parallel in each repeated block, then FSDP2 on {order}"
    body = "\n".join(f"#         {line}" for line in [*imports, *lines])
    return f"""\
# {what} as the plan simulated it, in your LightningModule ({order}):
#     def configure_model(self):
{body}"""


def _tp_styles(model: nn.Module | None) -> list[tuple[str, str]]:
    """Each projection torchtitan's plan splits in a block of ``model`` (`tp_plan`), by its name in the
    block, with its style's class name; Hugging Face LLaMA's names where no block has them."""
    blocks = [name for name, _ in find_blocks(model)] if model is not None else []
    styles: dict[str, str] = {}
    for name, style in (_layout.tp_plan(model, blocks) if blocks else {}).items():
        block = next(b for b in blocks if name.startswith(f"{b}."))
        styles.setdefault(name[len(block) + 1 :], type(style).__name__)
    if styles:
        return list(styles.items())
    colwise = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"]
    return [(n, "ColwiseParallel") for n in colwise] + [
        ("self_attn.o_proj", "RowwiseParallel"),
        ("mlp.down_proj", "RowwiseParallel"),
    ]


def _arguments(kwargs: Mapping[str, str]) -> str:
    return ", ".join(f"{k}={v}" for k, v in kwargs.items())


def _call(head: str, kwargs: Mapping[str, str]) -> str:
    """``head(k=v, ...)`` on one line, or one argument a line when that is over 100 characters."""
    one_line = f"{head}({_arguments(kwargs)})"
    if len(one_line) <= 100:
        return one_line
    return "\n".join([f"{head}(", *(f"    {k}={v}," for k, v in kwargs.items()), ")"])


# --- helpers --------------------------------------------------------------------------------------


def _brief(plan: FitPlan) -> str:
    gpus = f" x {plan.n_gpus} GPUs ({plan.strategy})" if plan.n_gpus > 1 else ""
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
