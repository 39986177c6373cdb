"""Fit a training run to a memory budget from the estimate: micro-batch, accumulation, checkpointing,
optimizer.

Every candidate is a simulated training step (`estimate_memory`, fake tensors), kept a ``margin`` below the
budget; the fastest candidate that fits wins (`StepCost`). `plan_fit` is the search, `FitPlan` its answer.
It reads as Lightning's ``_scale_batch_size``: the arguments checked once (`_fitting.space.SearchSpace`),
then a driver over named steps: the optimizer and precision whose leanest step fits (`_choose`, or the
refusal: `_fitting.refusal`), the time model (`_step_cost`), the fastest micro-batch and checkpointing
(`_fitting.ranking`), FSDP2's resharding (`_reshard`). The steps simulated are `_fitting.simulations`'.
Design notes, with the reasons and the measured margins: ``docs/design/plan-fit.md``.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

import torch
from torch import Tensor, nn

from lightning_memkit._budget import Budget
from lightning_memkit._checkpointing.blocks import LayerClasses
from lightning_memkit._checkpointing.policies import CHECKPOINT_MODES, named_plan
from lightning_memkit._estimating.analytic import model_static, shard
from lightning_memkit._estimating.lightning_step import SampleAxes, batch_size, default_axes
from lightning_memkit._estimating.routing import ROUTING_ASSUMED, routed
from lightning_memkit._fitting import layouts as _layouts
from lightning_memkit._fitting.plan import FitPlan, StepCost
from lightning_memkit._fitting.ranking import Ranking, _Option, _quickest
from lightning_memkit._fitting.refusal import no_fit_message
from lightning_memkit._fitting.simulations import Simulations
from lightning_memkit._fitting.space import (
    Pair,
    SearchSpace,
    _candidates,
    _divisors,
    _pairs,
    loads,
)
from lightning_memkit._levers.offload import transfer_seconds
from lightning_memkit._sharding import fsdp2 as _fsdp2
from lightning_memkit._step import Lever, Sharding, Step, valid_lever
from lightning_memkit._vocabulary import AUTO

__all__ = ["grid", "plan_fit", "static_floor"]

#: `FitPlan.note` where the plans were ranked by real steps timed (``cost="measured"``).
TIMED_NOTE = (
    "ranked by real steps timed on this machine, whose times move with its load: another run can rank "
    "the plans otherwise (cost='flops' counts FLOPs, the same every run)"
)


def plan_fit(
    model: nn.Module,
    batch: Any,
    budget: int | float | str | Budget,
    *,
    margin: float = 0.1,
    optimizers: Sequence[str | None] | None = None,
    precision: str | Sequence[str] = "32-true",
    checkpointing: str | Sequence[str] = AUTO,
    strategy: str | None = None,
    world_size: int = 1,
    device: str = "cuda",
    loss_fn: Callable[[Any, Any], Tensor] | None = None,
    cost: str | StepCost = "auto",
    progress: Callable[[str], None] | None = None,
    lever: Lever | None = None,
    compensate: bool = True,
    refine_limit: int | None = None,
    cpu_offload: bool | None = False,
    link: _fsdp2.Link | None = None,
    mp_policy: bool = False,
    batch_axes: SampleAxes | None = None,
    micro_batch_size: int | None = None,
    sharding: Sharding | _layouts.Layouts | Literal["auto"] | None = None,
    blocks: LayerClasses | None = None,
    step: Step | None = None,
) -> FitPlan:
    """The fastest configuration whose simulated peak is at most ``budget.usable * (1 - margin)``; or, with
    ``micro_batch_size``, the run as set up where that fits.

    Args:
        model: a ``LightningModule`` (its own ``training_step``/``configure_optimizers``) or an
            ``nn.Module`` with ``loss_fn``; real or on the meta device.
        batch: an example batch at the global batch size (all ranks); micro-batches are its slices along
            each tensor's sample dimension (``batch_axes``). Only shapes are read, except to time the step
            (``cost="measured"``).
        budget: bytes, ``"24GB"``, a GPU name (``"A100-40GB"``), a fraction of the current device or
            ``"auto"`` (`parse_budget`); per rank.
        margin: share of the budget kept free, for what the estimate cannot see.
        optimizers: candidate catalogue names in quality order (default: the model's own, then the
            lighter ones of `DEFAULT_CANDIDATES`).
        precision: a Lightning precision string, or several allowed, in order of preference.
        checkpointing: the checkpointing modes a block may get: ``"auto"`` (all of `CHECKPOINT_MODES`),
            one mode (that one or none), or the modes (``("none", "full")``); the plan chooses block by
            block.
        strategy, world_size: shard one rank's step over ``world_size`` ranks, by Lightning's strategy name
            (``"ddp"``, ``"fsdp"``, ``"deepspeed_stage_1"`` to ``"deepspeed_stage_3"``: the whole step
            divided; ``"fsdp_shard_grad_op"``: ``FSDPStrategy(sharding_strategy="SHARD_GRAD_OP")``, which
            Lightning's registry does not name, and the plan's code writes); the batch is split across ranks.
            ``"fsdp2"`` (Lightning's ``ModelParallelStrategy`` with ``fully_shard``): one rank's FSDP2 step
            simulated (`estimate_memory`'s ``strategy="fsdp2"``), checkpointing planned block by block on
            it. Default: ``"ddp"``, or ``"fsdp2"`` for a ``step=`` with a `Sharding`.
        device: ``"cuda"`` or ``"cpu"``: what the simulation models and the offline cost assumes.
        cost: ``"auto"`` (``"measured"`` for a model with real weights on the CPU and ``device="cpu"``,
            else ``"flops"``), ``"measured"``, ``"flops"``, or a `StepCost`.
        progress: called with a line before each simulation once planning has taken
            ``PROGRESS_AFTER_S`` seconds (a large model's simulations take seconds each).
        lever: plan for a run whose optimizer step a lever changes (`Lever`), or ``None``.
            ``"release_gradients"``: the gradients freed after each optimizer step (`release_gradients`,
            `GradientRelease`): the forward without the previous step's gradients. ``"fused_step"``: each
            parameter stepped inside backward (`fuse_optimizer_step`, `FusedOptimizerStep`): no gradient is
            whole at once, and no accumulation (the micro-batch is the global batch per GPU); one process
            only. ``"offload"``: the optimizer in host memory (`offload_optimizer`, `OptimizerOffload`): no
            optimizer state and no whole gradient on the device, the update on fp32 masters (so 16-bit
            weights need no Kahan twin), accumulation allowed; one process only. The plan gives the host
            memory it needs (`FitPlan.host_bytes`) and, on CUDA, the time its transfers and host update add
            (`transfer_seconds`, in the ranking too).
        compensate: plan 16-bit weights (``"bf16-true"``, ``"16-true"``) only with an update that keeps the
            small steps a 16-bit weight would round away: AdamW and SGD become their Kahan-summed
            ``"adamw_kahan"``, ``"sgd_kahan"`` (torch-optimi; `COMPENSATED`) there, and the other
            optimizers are not planned there. ``False`` plans every optimizer at every precision (AutoFit:
            the Trainer's precision and optimizer are the user's).
        refine_limit: how many micro-batches may get a block-by-block checkpointing plan (a planner costs
            several simulated steps, seconds each for a 7B model; a compiled model's activation-budget
            search up to ten): the micro-batches past it, the smaller ones, are planned with every block
            fully checkpointed, where that was simulated already, and `FitPlan.note` says so. A count, so
            the plan is the same on a busy machine. ``None``: no limit.
        link: with ``strategy="fsdp2"``, how fast the ranks' collectives run (`_sharding.fsdp2.Link`; default
            `_sharding.fsdp2.LINKS` for ``device``): each micro-step's all-gathers and reduce-scatters are
            added to
            its time (`collective_seconds`), so fewer, larger micro-batches rank higher.
        cpu_offload: with ``strategy="fsdp2"``, plan for FSDP2's ``CPUOffloadPolicy`` (the sharded
            parameters, gradients and optimizer state in host memory; `Simulations.offloaded`: an upper bound
            of what stays on the device, not simulated as such). ``None``: only where nothing fits
            without it (`AutoFitStrategy`, ``memkit plan``). `FitPlan.cpu_offload` and
            `FitPlan.host_bytes` say so.
        mp_policy: with ``strategy="fsdp2"``, ``True``: the ``bf16-mixed`` plans shard each unit with
            FSDP2's ``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``
            (parameters all-gathered and computed in bf16, gradients reduce-scattered in fp32; the policy
            `estimate_memory`'s and `Sharding`'s ``mp_policy`` simulate), as `AutoFitStrategy` does;
            `FitPlan.mp_policy` says whether the plan has it.
        sharding: with ``strategy="fsdp2"``, the layout the run applies (`Sharding`: tensor parallelism,
            HSDP, or a ``parallelize_fn`` such as a LightningModule's own ``configure_model``), simulated as
            it is; its ``world_size`` is the run's, and the global batch splits over its data-parallel
            ranks (``strategy`` and ``world_size`` left out, the `Sharding` gives them). Default: FSDP2's
            documented layout over ``world_size``. ``"auto"`` or a `Layouts`: the
            layout planned too, among tensor-parallel degrees (torchtitan's LLaMA plan, or the user's
            ``parallelize_fn``) and HSDP splits, the global batch the same for each: the first, in the
            order of least communication, whose plan fits every rank (`_fitting.layouts`; its cost model
            there). `FitPlan.tensor_parallel_size` and `FitPlan.replicate_size` say which.
        batch_axes: which dimension of each tensor of ``batch`` counts its samples (`SampleAxes`, one entry
            per tensor; AutoFit reads it off the train dataloader); default: dimension 0, except tensors of
            size 1 there beside larger ones, which every sample shares (`default_axes`).
        micro_batch_size: the micro-batch the run is set up with (AutoFit: the batch size attribute; its
            accumulation is the global batch over it): where that micro-batch fits without checkpointing
            with the first optimizer and precision, it is the plan, even if another is faster (a user's
            accumulation is theirs: a merged one changes the sums, BatchNorm's statistics and the RNG),
            settled by that one simulated step (timed by its FLOPs) outside FSDP2.
        blocks: the layer classes whose instances are the blocks to checkpoint (``{ResBlock, AttnBlock}``,
            as `ActivationCheckpointing` takes them); default: the repeated layers `find_blocks` finds. A
            plan that checkpoints names its blocks (`FitPlan.checkpoint_plan`).
        step: the `Step` every candidate starts from, in place of the keywords it holds: its precision
            (the one planned), its ``lever`` and its `Sharding` (``strategy="fsdp2"`` over its
            ``world_size``, the layout simulated as it is). What
            the planner chooses, it must leave at its default: checkpointing (give the modes a block may get
            as ``checkpointing=``), the accumulating and first step (every candidate's are planned), and
            torch.compile's budget. One of the keywords it stands for given beside it is a ``TypeError``.

    Side effects: none on ``model``. The simulations run `estimate_memory` (which restores what it runs)
    and the timing (``cost="measured"``) runs `isolated` (see `measured_cost`): a plan that changes nothing
    leaves the run as it would have been without planning.

    Raises:
        ValueError: no configuration fits; the message gives the static floor, the leanest plan's peak and
            what would fit (more GPUs with FSDP, a larger GPU). Also for an empty ``batch``.
        NotImplementedError: a LightningModule with manual optimization.
    """
    if step is not None:  # spelled as the keywords it stands for
        return plan_fit(
            **_step_as_keywords({name: value for name, value in locals().items() if name in _ARGUMENTS})
        )
    if sharding == "auto" or isinstance(sharding, _layouts.Layouts):  # the layout planned too
        return _plan_layouts({name: value for name, value in locals().items() if name in _ARGUMENTS})
    if isinstance(sharding, Sharding):  # its strategy and ranks, as estimate_memory reads them
        strategy = strategy or Sharding.strategy
        world_size = sharding.world_size if world_size == 1 else world_size
    space = SearchSpace.of(
        model, batch, budget, margin=margin, optimizers=optimizers, precision=precision,
        checkpointing=checkpointing, strategy=strategy, world_size=world_size, device=device, loss_fn=loss_fn,
        cost=cost, progress=progress, lever=lever, compensate=compensate, refine_limit=refine_limit,
        cpu_offload=cpu_offload, link=link, mp_policy=mp_policy, batch_axes=batch_axes,
        micro_batch_size=micro_batch_size, sharding=sharding, blocks=blocks,
    )  # fmt: skip
    search = Simulations.of(space)
    notes = list(space.notes)
    sizes, chosen, set_up = _choose(space, search)
    step_cost, transfers = _step_cost(space, search, chosen, set_up)
    if step_cost.source == "measured":  # the only part of a plan the machine's load can change
        notes.append(TIMED_NOTE)
    ranking = Ranking(search, step_cost, *chosen, space.limit, space.accumulated)
    options = ranking.fastest(sizes, ("none",) if set_up else space.modes)
    if set_up:
        notes.append(_kept_note(space.micro_batch_size, space.accumulated))
    best = min(options, key=_quickest)
    kept = _as_set_up(space, ranking, sizes)
    if kept is not None and kept != best:
        options, best = [*options, kept], kept
        notes.append(_kept_note(kept.m, space.accumulated))
    reshard, options, best = _reshard(space, ranking, options, best, notes)
    if search.unrefined:
        notes.append(
            "block-by-block checkpointing not searched at every micro-batch (past "
            f"refine_limit={space.refine_limit} micro-batches)"
        )
    if routed(model):
        notes.append(ROUTING_ASSUMED)
    return _fit_plan(space, ranking, options, best, reshard, transfers, "; ".join(notes))


def _plan_layouts(arguments: dict[str, Any]) -> FitPlan:
    """`plan_fit` with the layout left open (``sharding=`` a `Layouts` or ``"auto"``): each layout in the
    order of least communication planned with the other ``arguments``, the first that fits every rank
    (`_fitting.layouts.plan_layouts`). ``cpu_offload=None`` (where nothing fits without it): only where no
    layout fits, for FSDP2 over every rank."""
    layouts = arguments["sharding"]
    layouts = _layouts.Layouts() if layouts == "auto" else layouts
    if arguments["strategy"] != Sharding.strategy:
        raise ValueError(
            f"sharding={layouts!r} plans FSDP2's layout (tensor parallel, HSDP): pass strategy='fsdp2', not "
            f"{arguments['strategy']!r}"
        )

    asked = arguments["cpu_offload"]

    def plan(layout: Sharding, offload: bool | None = bool(asked)) -> FitPlan:
        return plan_fit(**{**arguments, "sharding": layout, "cpu_offload": offload})

    precision = arguments["precision"]
    batch, axes, device = arguments["batch"], arguments["batch_axes"], arguments["device"]
    try:
        return _layouts.plan_layouts(
            plan, arguments["model"], batch, default_axes(batch) if axes is None else axes,
            arguments["world_size"], layouts, precision if isinstance(precision, str) else precision[0],
            arguments["link"] or _fsdp2.LINKS[device], device,
        )  # fmt: skip
    except ValueError as error:
        if asked is not None:
            raise
        no_layout = str(error)
    # CPU offload (None: where nothing fits without it) last, on FSDP2's layout over every rank, the only
    # one it is planned for: its transfers cost more than any layout's collectives
    try:
        offloaded = plan(Sharding(arguments["world_size"]), None)
    except ValueError as error:
        raise ValueError(f"{no_layout}. With CPU offload: {error}") from None
    return dataclasses.replace(offloaded, note="; ".join(filter(None, (offloaded.note, no_layout))))


#: `plan_fit`'s arguments, as `_plan_layouts` and `_step_as_keywords` pass them on.
_ARGUMENTS = frozenset(inspect.signature(plan_fit).parameters)


def _step_as_keywords(arguments: dict[str, Any]) -> dict[str, Any]:
    """`plan_fit`'s ``arguments`` with its ``step=`` given as the keywords the step stands for: precision,
    lever and FSDP2 layout. One of those keywords set beside it is refused by `Step.split`, as every public
    function refuses it; so is a part of the step the planner chooses itself."""
    step = arguments.pop("step")
    sharded = getattr(step, "sharding", None) is not None
    covered = ["precision", "lever", *(("strategy", "world_size") if sharded else ())]
    step, _ = Step.split({"step": step, **{name: arguments[name] for name in covered}})
    if sharded and arguments["sharding"] is not None:
        raise TypeError("give step= or sharding, not both: the Step holds the layout")
    chosen = {
        "checkpointing": step.checkpointing is not None,
        "accumulating": step.accumulating,
        "first_step": step.first_step,
        "compile_budget": step.compile_budget is not None,
    }
    if any(chosen.values()):
        raise ValueError(
            f"plan_fit chooses the step's {', '.join(k for k, v in chosen.items() if v)} itself: give a step "
            "of precision, lever and sharding only (the modes a block may get go in checkpointing=)"
        )
    given: dict[str, Any] = {"precision": step.precision, "lever": step.lever}
    if step.sharding is not None:
        given |= {
            "strategy": Sharding.strategy,
            "world_size": step.sharding.world_size,
            "sharding": step.sharding,
        }
    return arguments | given


class _Transfers(NamedTuple):
    """What a plan keeps in host memory and the seconds its transfers and host update add (`FitPlan`'s
    ``host_bytes`` and ``offload_seconds``)."""

    host: int = 0
    #: seconds every micro-step
    micro: float = 0.0
    #: seconds every optimizer step
    per_step: float = 0.0


def _choose(space: SearchSpace, search: Simulations) -> tuple[list[int], Pair, bool]:
    """The micro-batches to rank, the (optimizer, precision) pair chosen, and whether the run as set up is
    the plan. The pair is the first in quality order whose leanest step fits (`_first_fitting`); the run
    as set up, where it fits, settles it with one simulation (`_set_up_fits`). Raises the refusal
    (`no_fit_message`) where no pair fits."""
    first = space.pairs[0]
    # The pairs in order of preference whose static memory alone is not over the limit (no simulation).
    viable = [pair for pair in space.pairs if search.static(*pair) <= space.limit]
    if _set_up_fits(search, space.micro_batch_size, space.sizes, first, viable, space.limit):
        return [space.micro_batch_size], first, True
    sizes = search.runnable(space.sizes, *(viable or space.pairs)[0])
    # FSDP2's CPU offload: as asked, or (None) where nothing fits without it
    offloads = (False, True) if space.offload_when_needed else (search.cpu_offload,)
    leanest = (sizes[0], space.modes[-1])
    chosen = _first_fitting(search, space.pairs, viable, *leanest, space.limit, offloads=offloads)
    if chosen is None:
        raise ValueError(no_fit_message(space, search))
    return sizes, chosen, False


def _step_cost(
    space: SearchSpace, search: Simulations, chosen: Pair, set_up: bool
) -> tuple[StepCost, _Transfers]:
    """The time model the plans are ranked by (`Simulations.step_cost`; as set up nothing is ranked, so
    FLOPs time it), with FSDP2's collectives every micro-step and what the offloading keeps on the host and
    adds to the time."""
    opt, prec = chosen
    timing = "flops" if set_up and isinstance(space.cost, str) else space.cost
    step_cost = search.step_cost(timing, opt, prec)
    if (
        search.sharding and space.world_size > 1
    ):  # the layout's collectives every micro-step, each rank's on `link`
        fixed, per_sample = _layouts.collectives(
            space.model,
            search.sharding,
            prec,
            _layouts.tokens_per_sample(space.batch, space.axes),
            space.link or _fsdp2.LINKS[space.device],
        )
        step_cost = dataclasses.replace(
            step_cost, fixed=step_cost.fixed + fixed, per_sample=step_cost.per_sample + per_sample
        )
    transfers = _Transfers()
    if search.cpu_offload:  # FSDP2's CPUOffloadPolicy: a rank's shards, their gradients and the state
        on_host = shard(model_static(space.model, prec, opt or "sgd"), "fsdp", space.world_size)
        moved = (on_host.parameters, on_host.gradients, on_host.optimizer_state)
        step_cost, transfers = _offloaded(space, step_cost, on_host.static, moved)
    if space.lever == "offload":  # the optimizer on the host
        static = model_static(space.model, prec)
        state = model_static(space.model, "32-true", opt or "sgd").optimizer_state  # on the fp32 masters
        host = 2 * model_static(space.model, "32-true").parameters + state  # the masters and their gradients
        moved = (static.parameters, static.gradients, state)
        step_cost, transfers = _offloaded(space, step_cost, host, moved)
    return step_cost, transfers


def _offloaded(
    space: SearchSpace, step_cost: StepCost, host: int, moved: tuple[int, int, int]
) -> tuple[StepCost, _Transfers]:
    """``host`` bytes in host memory; on CUDA the ``moved`` parameters up and gradients down every
    micro-step, and the host's update of that optimizer state every step (`transfer_seconds`), added to
    ``step_cost``. On the CPU the host is the device: nothing travels."""
    if space.device != "cuda":
        return step_cost, _Transfers(host)
    micro, per_step = transfer_seconds(*moved)
    step_cost = dataclasses.replace(step_cost, fixed=step_cost.fixed + micro, per_step=per_step)
    return step_cost, _Transfers(host, micro, per_step)


def _kept_note(m: int, accumulated: int) -> str:
    return f"micro-batch {m} x accumulate {accumulated // m} kept as set up: it fits"


def _as_set_up(space: SearchSpace, ranking: Ranking, sizes: Sequence[int]) -> _Option | None:
    """The run as set up: micro-batch ``space.micro_batch_size`` without checkpointing, where the chosen
    optimizer and precision are the first asked for and it fits; else ``None``."""
    m = space.micro_batch_size
    if m is None or (ranking.optimizer, ranking.precision) != space.pairs[0] or m not in sizes:
        return None
    peak = ranking.peak(m, "none")
    return ranking.option(m, "none", peak) if peak <= ranking.limit else None


def _reshard(
    space: SearchSpace, ranking: Ranking, options: list[_Option], best: _Option, notes: list[str]
) -> tuple[bool | None, list[_Option], _Option]:
    """FSDP2's ``reshard_after_forward`` for the ``best`` plan: ``False`` (no all-gather in backward) where
    that step fits too, then its peak the plan's; ``True`` where it does not, or past ``refine_limit``,
    untried (a note says so); ``None`` where the run does not shard, or a user's ``parallelize_fn`` does."""
    search = ranking.search
    if not search.sharding:
        return None, options, best
    if search.unrefined:  # the work past refine_limit: FSDP2's default
        notes.append(f"reshard_after_forward=False not tried (past refine_limit={space.refine_limit})")
        return True, options, best
    if not _reshards_as_planned(search.sharding):
        return None, options, best
    opt, prec = ranking.optimizer, ranking.precision
    whole = search.estimate(
        best.m, best.plan or best.label, optimizer=opt, precision=prec, reshard_after_forward=False
    )
    kept = search.per_rank(whole, prec)
    if kept.peak > space.limit:
        return True, options, best
    # the chosen row of the table too
    options = [o._replace(peak=kept.peak) if o == best else o for o in options]
    return False, options, best._replace(peak=kept.peak)


def _fit_plan(
    space: SearchSpace, ranking: Ranking, options: list[_Option], best: _Option, reshard: bool | None,
    transfers: _Transfers, note: str,
) -> FitPlan:  # fmt: skip
    """The `FitPlan` of the ``best`` option among ``options``."""
    search, opt, prec, G = ranking.search, ranking.optimizer, ranking.precision, space.accumulated
    sharding = search.sharding
    return FitPlan(
        micro_batch_size=best.m,
        accumulate_grad_batches=G // best.m,
        checkpointing=best.label,
        optimizer=opt,
        precision=prec,
        estimated_peak=best.peak,
        budget=space.budget,
        margin=space.margin,
        alternatives=ranking.alternatives(options, space.planned_optimizers, space.precisions),
        strategy=space.strategy if space.world_size > 1 else "auto",
        world_size=space.world_size,
        cost=ranking.cost,
        modes=space.modes,
        note=note,
        checkpoint_plan=best.plan or named_plan(space.model, best.label, search.blocks),
        lever=space.lever,
        host_bytes=transfers.host,
        offload_seconds=transfers.per_step + transfers.micro * (G // best.m),
        reshard_after_forward=reshard,
        cpu_offload=search.cpu_offload,
        mp_policy=getattr(search.sharded(prec), "mp_policy", None) is not None,
        device=torch.device(space.device).type,
        tensor_parallel_size=sharding.tensor_parallel_size if sharding else 1,
        replicate_size=sharding.replicate_size if sharding else 1,
    )


def _first_fitting(search, pairs, viable, m, strongest, limit, *, offloads: Sequence[bool]):
    """The first (optimizer, precision) pair in quality order whose leanest step (micro-batch ``m``, the
    ``strongest`` checkpointing) fits ``limit`` under one of the CPU-offload settings ``offloads``, tried in
    turn (``(False, True)``: a better optimizer offloaded before a lighter one that is not). Leaves ``search``
    at the choice's offloading; ``None`` if nothing fits."""
    for pair in pairs:
        if not loads(pair[0]):
            continue
        for on in offloads:
            search.offloading(on)
            if (on or pair in viable) and search.peak(m, strongest, *pair).peak <= limit:
                return pair
    search.offloading(offloads[0])
    return None


def _set_up_fits(search, m, sizes, first, viable, limit) -> bool:
    """Whether the run as set up (micro-batch ``m`` without checkpointing, with the ``first`` optimizer and
    precision asked for) fits ``limit``: then it is the plan, from this one simulated step (its FLOPs
    counted: the plan's time, with nothing to rank it against), and ``search.smallest`` is ``m``. FSDP2's
    steps, whose ``reshard_after_forward`` is planned too, are searched as usual."""
    if m not in sizes or first not in viable or search.sharding is not None or not loads(first[0]):
        return False
    try:
        search.counted(m, *first)
    except ValueError:  # a micro-batch the step refuses (BatchNorm's one sample a channel): searched
        return False
    if search.peak(m, "none", *first).peak > limit:
        return False
    search.smallest = m  # nothing smaller is planned
    return True


def _reshards_as_planned(sharding: Sharding) -> bool:
    """Whether the run shards with the plan's ``reshard_after_forward``: its default layout, or the one
    AutoFitStrategy applies where configure_model shards nothing; a user's ``parallelize_fn`` (their
    configure_model) calls ``fully_shard`` with their own."""
    fn = sharding.parallelize_fn
    return fn is None or bool(getattr(fn, "shard_unsharded", False))


def static_floor(
    model: nn.Module,
    optimizers: Sequence[str | None] | None,
    precision: str | Sequence[str],
    *,
    strategy: str = "ddp",
    world_size: int = 1,
    compensate: bool = True,
    lever: Lever | None = None,
) -> int | None:
    """The least static memory per GPU (parameters, gradients and optimizer state, as the step levers keep
    them on the device, sharded) of the optimizer and precision pairs `plan_fit` would plan with these
    arguments: no plan fits a limit below it. No simulation; ``None`` when no pair would be planned."""
    precisions = (precision,) if isinstance(precision, str) else tuple(precision)
    lever = valid_lever(lever)
    search = Simulations(model, None, None, "cuda", strategy, world_size, lever=lever)
    candidates, _ = _candidates(model, optimizers, strategy, world_size)
    pairs = _pairs(candidates, precisions, compensate and lever != "offload", lever == "fused_step")
    return min((search.static(o, p) for o, p in pairs), default=None)


def grid(
    model: nn.Module,
    batch: Any,
    *,
    optimizer: str | None,
    precision: str = "32-true",
    checkpointing: Sequence[str] = CHECKPOINT_MODES,
    device: str = "cuda",
    loss_fn: Callable | None = None,
) -> dict[tuple[int, str], int]:
    """Every (micro-batch, checkpointing) of one optimizer simulated: ``{(m, mode): peak bytes}``.

    The exhaustive search `plan_fit` prunes; for tests and the benchmark.
    """
    search = Simulations(model, batch, loss_fn, device, "ddp", 1)
    return {
        (m, c): search.peak(m, c, optimizer, precision).peak
        for c in checkpointing
        for m in _divisors(batch_size(batch))
    }
