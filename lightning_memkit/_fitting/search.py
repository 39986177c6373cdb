"""Fit a training run to a memory budget from the estimate: micro-batch, accumulation, checkpointing,
optimizer.

Every candidate is a simulated training step (`estimate_memory`, fake tensors), kept a ``margin`` below the
budget; the fastest candidate that fits wins (`StepCost`). `plan_fit` is the search, `FitPlan` its answer.
Design notes, with the reasons and the measured margins: ``docs/design/plan-fit.md``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
import numbers
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal, NamedTuple

import torch
from torch import Tensor, nn

from lightning_memkit._breakdown import MemoryBreakdown, format_bytes
from lightning_memkit._budget import GPUS, Budget, parse_budget, valid_name, whole_number
from lightning_memkit._checkpointing.blocks import LayerClasses, block_classes, find_blocks, no_blocks_message
from lightning_memkit._checkpointing.compiled import (
    COMPILE_BUDGET,
    budget_label,
    configured_budget,
    label_budget,
    plan_compiled,
)
from lightning_memkit._checkpointing.planner import CheckpointPlanner
from lightning_memkit._checkpointing.policies import CHECKPOINT_MODES, CheckpointPlan, apply_plan, named_plan
from lightning_memkit._estimating.analytic import STRATEGIES, model_static, shard
from lightning_memkit._estimating.compiled import compiled_modules
from lightning_memkit._estimating.lightning_step import (
    SampleAxes,
    batch_size,
    batch_slice,
    default_axes,
    is_lightning,
    without_parameters,
)
from lightning_memkit._estimating.routing import ROUTING_ASSUMED, routed
from lightning_memkit._estimating.simulate import counted_step, estimate_step, sixteen_bit_weights
from lightning_memkit._fitting import layouts as _layouts
from lightning_memkit._fitting.plan import Alternative, FitPlan, StepCost, flops_cost, measured_cost
from lightning_memkit._levers.offload import transfer_seconds
from lightning_memkit._measuring.storages import model_device
from lightning_memkit._optimizers.swap import (
    CATALOGUE,
    COMPENSATED,
    KAHAN,
    lighter_candidates,
    load_bitsandbytes,
)
from lightning_memkit._sharding import fsdp2 as _fsdp2
from lightning_memkit._step import Lever, Sharding, Step
from lightning_memkit._vocabulary import AUTO, allowed_modes, renamed

__all__ = ["grid", "plan_fit", "static_floor"]

#: Lightning's strategy name for each sharding scheme `shard` knows.
LIGHTNING_STRATEGY: dict[str, str] = {
    "ddp": "ddp",
    "zero1": "deepspeed_stage_1",
    "zero2": "deepspeed_stage_2",
    "zero3": "deepspeed_stage_3",
    "fsdp": "fsdp",
    "fsdp2": "fsdp2",  # ModelParallelStrategy with fully_shard in configure_model: see plan_code
    "deepspeed_stage_1": "deepspeed_stage_1",
    "deepspeed_stage_2": "deepspeed_stage_2",
    "deepspeed_stage_3": "deepspeed_stage_3",
}
_SUGGESTED_GPUS = (2, 4, 8, 16, 32, 64)
#: How far over the limit the checkpointing planner's peak model must put a uniform mode for its simulation
#: to be skipped (the model is calibrated to the simulated peak at no checkpointing and at the floor).
MODEL_SLACK = 0.05
#: Full checkpointing's recompute as a share of forward + backward, where no planner measured it: the
#: forward again, a third of the FLOPs (a bound for the other modes).
FULL_RECOMPUTE = 1 / 3
#: Forward and backward ops of a whole step (`counted_step`'s) above which the checkpointing planner
#: refines a micro-batch's plan once, not three times: a step of that many takes about 2 s to simulate on
#: two cores (GPT-2's 1,447 ops 0.7 s, LLaMA-7B's 7,841 ops 7 s). A count, so that the plan does not
#: depend on how busy the machine is.
SLOW_SIMULATION_OPS = 3_000
#: Seconds a deprecated ``refine_seconds`` counts for one micro-batch refined (`refine_limit_for`): a
#: LLaMA-7B planner on two idle cores (docs/repeated-blocks.md).
REFINE_SECONDS_EACH = 4.0
#: The step levers, `plan_fit`'s keywords, cheapest first, and the callback that makes each in a Trainer.
LEVER_CALLBACKS = {
    "release_gradients": "GradientRelease",
    "fused_step": "FusedOptimizerStep",
    "offload": "OptimizerOffload",
}
#: The end of the no-fit message where no 16-bit weights were allowed.
LOWER_PRECISION_HINT = "; or allow a lower precision (bf16-true)"
#: `FitPlan.note` where the plans were ranked by real steps timed (``cost="measured"``).
TIMED_NOTE = (
    "ranked by real steps timed on this machine, whose times move with its load: another run can rank "
    "the plans otherwise (cost='flops' counts FLOPs, the same every run)"
)
#: Seconds of planning after which each further simulation is reported to ``plan_fit(progress=...)``.
PROGRESS_AFTER_S = 2.0


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


class _Search:
    """Simulations of one model and batch, cached by configuration; one rank's (sharded) peak."""

    def __init__(
        self, model, batch, loss_fn, device, strategy, n_gpus, progress=None, lever=None, axes=None,
        layout=None,
    ) -> None:  # fmt: skip
        self.model, self.batch, self.loss_fn, self.device = model, batch, loss_fn, device
        #: each tensor's sample dimension (`SampleAxes`): the micro-batches are cut along it
        self.axes: SampleAxes = default_axes(batch) if axes is None else axes
        #: what changes the optimizer step (`Step.lever`), planned for
        self.lever: Lever | None = lever
        self.strategy, self.n_gpus = strategy, n_gpus
        #: FSDP2's step is simulated sharded (one rank's, in the run's layout); the other strategies
        #: divide the whole step
        self.sharding = (layout or Sharding(n_gpus)) if strategy == "fsdp2" else None
        #: FSDP2 with a bf16 MixedPrecisionPolicy for the bf16-mixed steps (`plan_fit`'s keyword)
        self.mixed_precision_policy = False
        self.cache: dict[tuple, MemoryBreakdown] = {}  # one rank's
        self.counts: dict[tuple, tuple[int, int]] = {}  # FLOPs and ops of the steps `counted`
        self.whole: dict[tuple, MemoryBreakdown] = {}  # the same steps, unsharded
        #: the checkpointing planner of each (micro-batch, optimizer, precision) asked for
        self.planners: dict[tuple, CheckpointPlanner] = {}
        #: a forward + backward timed at each micro-batch, without checkpointing (`timed_recompute`)
        self.timed: dict[int, StepCost] = {}
        #: the smallest micro-batch the step accepts (`_runnable`)
        self.smallest = 1
        self.progress = progress
        self.started = time.perf_counter()
        #: FSDP2's CPUOffloadPolicy: the sharded parameters and optimizer state on the host (`offloaded`)
        self.cpu_offload = False
        self._shard_bytes: dict[int | None, tuple[int, int]] = {}  # `offloaded`'s, by element size
        #: micro-batches that may get a block-by-block plan (`plan_fit`'s refine_limit); ``None``: all
        self.refine_limit: int | None = None
        self.refined = 0  # micro-batches that got one (a planner, or a compiled model's budget search)
        self.unrefined = False  # whether a micro-batch was left at full checkpointing past the limit
        #: the bytes a step may peak at (`plan_fit`'s limit): what a compiled model's activation budget is
        #: planned for (`compiled_plan`)
        self.limit: int | None = None
        #: a compiled model's plan at each (micro-batch, optimizer, precision) (`compiled_plan`): the plan
        #: (``None`` where no activation budget fits) and the mode of its step, or of the lowest step tried
        self.compiled: dict[tuple, tuple[CheckpointPlan | None, str]] = {}
        #: the classes whose instances are the blocks (`plan_fit`'s ``blocks``); ``None``: `find_blocks`'
        self.blocks: LayerClasses | None = None
        #: whether the model has compiled modules: its checkpointing is torch.compile's activation budget
        self.compiling = bool(compiled_modules(model))

    def sharded(self, precision: str) -> Sharding | None:
        """The FSDP2 layout of a step at ``precision`` (``None``: not sharded)."""
        if self.sharding is not None and self.mixed_precision_policy and precision == "bf16-mixed":
            return dataclasses.replace(self.sharding, mp_policy=_fsdp2.bf16_policy())
        return self.sharding

    def step(self, m: int, precision: str, **changes: Any) -> Step:
        """The step of micro-batch ``m`` at ``precision`` as planned (``changes``: to the `Step`, or
        ``reshard_after_forward`` to its `Sharding`)."""
        sharding = self.sharded(precision)
        if "reshard_after_forward" in changes:
            assert sharding is not None, "reshard_after_forward is FSDP2's"
            sharding = dataclasses.replace(
                sharding, reshard_after_forward=changes.pop("reshard_after_forward")
            )
        # the cycle's last micro-batch is its peak
        accumulating = m < batch_size(self.batch, self.axes)
        return Step(precision, accumulating=accumulating, lever=self.lever, sharding=sharding).but(**changes)

    def micro_batch(self, m: int) -> Any:
        """The batch's first ``m`` samples: one micro-batch."""
        return batch_slice(self.batch, m, axes=self.axes)

    def refining(self) -> bool:
        """Whether one more micro-batch may get its block-by-block plan (`refine_limit`), counted if so."""
        if self.refine_limit is not None and self.refined >= self.refine_limit:
            self.unrefined = True
            return False
        self.refined += 1
        return True

    def estimate(self, m, checkpointing, *, optimizer=None, precision="32-true", counting=False, **changes):
        """One rank's simulated step (``counting``: `counted_step`'s breakdown, FLOPs and ops)."""
        checkpointing = self.resolved(m, checkpointing, optimizer, precision)
        budget = label_budget(checkpointing)
        if budget is not None:  # a compiled step: torch.compile's activation budget, no block wrapped
            checkpointing, changes["compile_budget"] = "none", budget
        checkpointing = (
            named_plan(self.model, checkpointing, self.blocks) or checkpointing
        )  # the blocks named
        # a candidate, not the run: nothing logged (the plan applied says what it turns off)
        ctx = apply_plan(self.model, checkpointing, announce=False) if checkpointing != "none" else None
        with ctx or contextlib.nullcontext(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return (counted_step if counting else estimate_step)(
                self.model,
                self.micro_batch(m),
                self.step(m, precision, **changes),
                optimizer=optimizer,
                loss_fn=self.loss_fn,
                device=self.device,
            )

    def counted(
        self, m: int, optimizer: str | None, precision: str, checkpointing: str = "none"
    ) -> tuple[int, int]:
        """The FLOPs and the forward and backward ops of micro-batch ``m`` (without checkpointing: the step
        that tells which micro-batches run, and the offline cost's), from one simulated step, whose peak is
        known from then on."""
        key = (m, checkpointing, optimizer, precision)
        if key not in self.counts:
            self._report(f"simulating micro-batch {m}, checkpointing {checkpointing}, counting its FLOPs")
            breakdown, flops, ops = self.estimate(
                m, checkpointing, optimizer=optimizer, precision=precision, counting=True
            )
            self.whole[key] = breakdown
            self.cache[key] = self.per_rank(breakdown, precision)
            self.counts[key] = (flops, ops)
        return self.counts[key]

    def resolved(self, m: int, checkpointing: str, optimizer: str | None, precision: str) -> str:
        """The mode whose step stands for ``checkpointing`` at micro-batch ``m``: `COMPILE_BUDGET`'s is the
        activation budget planned there, or the lowest step's (`compiled_plan`); any other, itself."""
        if checkpointing == COMPILE_BUDGET:
            return self.compiled_plan(m, optimizer, precision)[1]
        return checkpointing

    def peak(self, m: int, checkpointing: str, optimizer: str | None, precision: str) -> MemoryBreakdown:
        checkpointing = self.resolved(m, checkpointing, optimizer, precision)
        key = (m, checkpointing, optimizer, precision)
        compiled_step = checkpointing == "none" or label_budget(checkpointing) is not None
        if key not in self.cache and self.compiling and compiled_step:
            self.counted(m, optimizer, precision, checkpointing)  # its FLOPs too: a budget's recompute
        if key not in self.cache:
            self._report(
                f"simulating micro-batch {m}, checkpointing {checkpointing}, optimizer "
                f"{optimizer or 'as configured'}, {precision}"
            )
            self.whole[key] = self.estimate(m, checkpointing, optimizer=optimizer, precision=precision)
            self.cache[key] = self.per_rank(self.whole[key], precision)
        return self.cache[key]

    def peaks(self, checkpointing: str, optimizer: str | None, precision: str) -> list[tuple[int, int]]:
        """``(micro-batch, peak)`` of every step simulated with these settings so far."""
        if checkpointing == COMPILE_BUDGET:
            return [
                (m, self.peak(m, mode, optimizer, precision).peak)
                for (m, *key), (_, mode) in self.compiled.items()
                if key == [optimizer, precision]
            ]
        return [
            (m, b.peak) for (m, *key), b in self.cache.items() if key == [checkpointing, optimizer, precision]
        ]

    def per_rank(self, breakdown: MemoryBreakdown, precision: str) -> MemoryBreakdown:
        """One rank's share of a whole step's ``breakdown`` (`shard`); FSDP2's is simulated as one rank's
        (with `cpu_offload`, what stays on the device)."""
        if self.sharding:
            return self.offloaded(breakdown, precision) if self.cpu_offload else breakdown
        grads = self._static(None, precision).gradients
        return shard(breakdown, self.strategy, self.n_gpus, gradient_bytes=grads)

    def offloaded(self, breakdown: MemoryBreakdown, precision: str) -> MemoryBreakdown:
        """What of one rank's FSDP2 step stays on the device under ``CPUOffloadPolicy``: the sharded
        parameters and the optimizer state live on the host (the optimizer steps there), and a unit's shard
        is copied to the device before its all-gather (counted as temporary, the largest unit's). An upper
        bound, not a simulation: the sharded gradients, which the policy moves to the host after their
        reduce-scatter, are still counted where the simulated step held them."""
        itemsize = 2 if sixteen_bit_weights(precision) else None
        if itemsize not in self._shard_bytes:  # the model's shards, once per element size
            blocks = [name for name, _ in find_blocks(self.model)]
            self._shard_bytes[itemsize] = (
                _fsdp2.shard_bytes(self.model, self.n_gpus, itemsize),
                _fsdp2.largest_unit_shard(self.model, blocks, self.n_gpus, itemsize),
            )
        shards, in_flight = self._shard_bytes[itemsize]
        return dataclasses.replace(
            breakdown,
            parameters=max(breakdown.parameters - shards, 0),
            optimizer_state=0,
            temporary=breakdown.temporary + in_flight,
        )

    def planner(
        self, m: int, modes: tuple[str, ...], optimizer: str | None, precision: str
    ) -> CheckpointPlanner:
        """The checkpointing planner of micro-batch ``m``: the blocks' saved bytes and recompute costs,
        measured once, and the simulated steps of the plans it tries."""
        key = (m, optimizer, precision)
        if key not in self.planners:
            self._report(f"measuring the blocks' checkpointing costs at micro-batch {m}")
            # A per-block plan's step is simulated whole (`_estimating.repeated`'s shortcut does not take
            # every plan): its ops, those of the step first counted, say how long it takes.
            ops = next(iter(self.counts.values()), (0, 0))[1]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self.planners[key] = CheckpointPlanner(
                    self.model,
                    self.micro_batch(m),
                    checkpointing=("none", *modes) if "none" not in modes else modes,
                    cost="flops",  # the FLOPs of the ops recomputed; a measured step times plans
                    blocks=self.blocks,
                    device=self.device,
                    optimizer=optimizer,
                    loss_fn=self.loss_fn,
                    step=self.step(m, precision),  # FSDP2: every plan's step simulated sharded
                    # a few plans per micro-batch (uniform modes are candidates too); one where each
                    # simulation takes seconds (a 7B model's)
                    max_rounds=1 if ops > SLOW_SIMULATION_OPS else 3,
                )
            for (m_, mode, optimizer_, precision_), breakdown in self.whole.items():
                if (m_, optimizer_, precision_) == key:  # steps the search simulated already
                    self.planners[key].remember(self.planners[key].uniform(mode), breakdown)
        return self.planners[key]

    def checkpoint_plans(
        self, m: int, modes: tuple[str, ...], optimizer: str | None, precision: str, limit: int
    ) -> list[tuple[CheckpointPlan, MemoryBreakdown]]:
        """The plans that fit ``limit`` at micro-batch ``m``, least recompute (in FLOPs) first, each with one
        rank's breakdown: the planner's per-block plan, a uniform mode where one fits at less cost (the
        planner's search stops after a few rounds), and the strongest mode (the floor, simulated anyway:
        where the step is timed it can be the fastest, see `timed_recompute`). Empty if nothing fits."""
        planner = self.planner(m, modes, optimizer, precision)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            floor = planner.simulate(planner.uniform(modes[-1]))
            # The planner fits the whole step; one rank keeps only its share of what is sharded.
            offset = floor.peak - self.per_rank(floor, precision).peak
            options = []
            with contextlib.suppress(ValueError):  # raised below the floor
                plan = planner.plan(limit + offset, modes=modes)  # block by block, among `modes`
                options.append((plan.overhead or 0.0, plan))
        cheapest = min((o for o, _ in options), default=float("inf"))
        for mode in modes[1:] if modes[0] == "none" else modes:
            uniform = planner.uniform(mode)
            if planner.overhead(uniform) >= cheapest:
                continue  # not cheaper than the planner's plan: not worth a simulation
            modeled = planner.modeled_peak(uniform)
            if modeled is not None and modeled > (limit + offset) * (1 + MODEL_SLACK):
                continue  # the planner's peak model puts it clearly over: not worth a simulation
            if self.per_rank(planner.simulate(uniform), precision).peak <= limit:
                options.append((planner.overhead(uniform), planner.plan_for(uniform)))
        strongest = planner.uniform(modes[-1])
        if all(tuple(b.mode for b in plan.blocks) != strongest for _, plan in options):
            options.append((planner.overhead(strongest), planner.plan_for(strongest)))
        fitting = []
        for _, option in sorted(options, key=lambda o: o[0]):
            breakdown = self.per_rank(option.breakdown, precision)
            if breakdown.peak <= limit:
                fitting.append((option, breakdown))
        return fitting

    def compiled_plan(
        self, m: int, optimizer: str | None, precision: str
    ) -> tuple[CheckpointPlan | None, str]:
        """A compiled model's plan at micro-batch ``m`` for `limit` (`plan_compiled`: the highest activation
        budget whose step fits, tried from the configured one down), its ``overhead`` the FLOPs the
        partitioner's recompute adds as a share of the configured step's; ``None`` where no budget fits. And
        the mode of its step (``"none"``: as configured; `budget_label`), or of the lowest step tried."""
        key = (m, optimizer, precision)
        if key not in self.compiled:
            assert self.limit is not None, "a compiled model's activation budget is planned for a limit"

            def simulate(budget: float | None) -> MemoryBreakdown:  # counted too (`peak`): the recompute
                return self.peak(m, "none" if budget is None else budget_label(budget), optimizer, precision)

            step = self.step(m, precision)
            try:
                plan = plan_compiled(self.model, self.micro_batch(m), self.limit, step, simulate)
            except ValueError:  # the lowest step tried stands for the micro-batch
                tried = [
                    (b.peak, mode)
                    for (m_, mode, *k), b in self.cache.items()
                    if (m_, *k) == key and (mode == "none" or label_budget(mode) is not None)
                ]
                self.compiled[key] = (None, min(tried)[1])
            else:
                mode = "none" if plan.compile_budget is None else budget_label(plan.compile_budget)
                overhead = self.recompute(m, mode, optimizer, precision)
                self.compiled[key] = (dataclasses.replace(plan, overhead=overhead), mode)
        return self.compiled[key]

    def recompute(self, m: int, mode: str, optimizer: str | None, precision: str) -> float | None:
        """What a compiled step at activation budget ``mode`` (`budget_label`) recomputes, as the FLOPs it
        adds to the configured step's (``"none"``); ``None`` where either was not counted."""
        counts = self.counts.get((m, mode, optimizer, precision))
        configured = self.counts.get((m, "none", optimizer, precision))
        if counts is None or configured is None or not configured[0]:
            return None
        return max(counts[0] / configured[0] - 1.0, 0.0)

    def timed_recompute(self, m: int, plan: CheckpointPlan) -> float:
        """What ``plan`` adds to a forward + backward of micro-batch ``m``, timed for real (`measured_cost`)
        against the same without checkpointing, as a fraction of the latter.

        For a measured step cost the recompute is timed too: on the CPU, op-mode (selective) checkpointing
        costs far more than its recomputed ops (its dispatch mode runs on every op of the forward)."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if m not in self.timed:
                self.timed[m] = measured_cost(
                    self.model, self.batch, loss_fn=self.loss_fn, sizes=(m, m), axes=self.axes
                )
            with apply_plan(self.model, plan, announce=False):
                checkpointed = measured_cost(
                    self.model, self.batch, loss_fn=self.loss_fn, sizes=(m, m), axes=self.axes
                )
        return max(checkpointed.per_sample / self.timed[m].per_sample - 1.0, 0.0)

    def _report(self, line: str) -> None:
        elapsed = time.perf_counter() - self.started
        if self.progress is not None and elapsed >= PROGRESS_AFTER_S:
            self.progress(f"{line} ({len(self.cache)} steps simulated in {elapsed:.0f} s)")

    def static(self, optimizer: str | None, precision: str) -> int:
        """A lower bound of the peak: sharded parameters + gradients + optimizer state, no simulation."""
        if optimizer is None or self.cpu_offload:
            return 0
        try:
            return shard(self._static(optimizer, precision), self.strategy, self.n_gpus).static
        except ValueError:
            return 0

    def _static(self, optimizer: str | None, precision: str) -> MemoryBreakdown:
        static = model_static(self.model, precision, optimizer or "sgd")
        if self.lever == "offload":  # the state on the host, a parameter's gradient at a time
            return dataclasses.replace(static, gradients=0, optimizer_state=0)
        if self.lever == "fused_step":  # never all at once: a parameter's gradient at a time
            return dataclasses.replace(static, gradients=0)
        return static


def static_floor(
    model: nn.Module,
    optimizers: Sequence[str | None] | None,
    precision: str | Sequence[str],
    *,
    strategy: str = "ddp",
    n_gpus: int = 1,
    compensate: bool = True,
    release_gradients: bool = False,
    fused_step: bool = False,
    offload: bool = False,
) -> int | None:
    """The least static memory per GPU (parameters, gradients and optimizer state, as the step levers keep
    them on the device, sharded) of the optimizer and precision pairs `plan_fit` would plan with these
    arguments: no plan fits a limit below it. No simulation; ``None`` when no pair would be planned."""
    precisions = (precision,) if isinstance(precision, str) else tuple(precision)
    lever = Step.of(release_gradients=release_gradients, fused_step=fused_step, offload=offload).lever
    search = _Search(
        model,
        None,
        None,
        "cuda",
        strategy if n_gpus > 1 or strategy == "fsdp2" else "ddp",
        n_gpus,
        lever=lever,
    )
    candidates, _ = _candidates(model, optimizers, strategy, n_gpus)
    pairs = _pairs(candidates, precisions, compensate and not offload, fused_step)
    return min((search.static(o, p) for o, p in pairs), default=None)


def _runnable(search: _Search, sizes: list[int], optimizer: str | None, precision: str) -> list[int]:
    """``sizes`` from the smallest micro-batch the model's step accepts: BatchNorm refuses one sample per
    channel in training ("Expected more than 1 value per channel"), so such a model's plans start at 2.
    The step tried is counted too (`_Search.counted`): the offline cost is read from it."""
    for i, m in enumerate(sizes):
        try:
            search.counted(m, optimizer, precision)
        except ValueError as err:
            refused = err
            continue
        search.smallest = m
        return sizes[i:]
    raise ValueError(f"The training step fails on every micro-batch of {sizes}: {refused}") from refused


def _largest_fitting(
    peak: Callable[[int], int], limit: int, sizes: Sequence[int], known: Iterable[tuple[int, int]] = ()
) -> int | None:
    """The largest of ``sizes`` (ascending) whose ``peak`` is at most ``limit``, assuming the peak grows
    with the size; ``None`` if none does. ``known``: ``(size, peak)`` pairs simulated already, of any size.

    A bisection that probes where the line through the nearest known peaks either side of the limit crosses
    it (a step's peak is close to linear in its micro-batch), so that once a size too large is known it
    mostly ends after two probes, the size predicted and the next one up; the same answer as halving."""
    seen = dict(known)
    lo, hi = -1, len(sizes)  # sizes[lo] fits (or none is known to), sizes[hi] does not (or none is known)
    for i, m in enumerate(sizes):
        if m in seen:
            lo, hi = (max(lo, i), hi) if seen[m] <= limit else (lo, min(hi, i))
    while hi - lo > 1:
        i = _probe(seen, limit, sizes, lo, hi)
        seen[sizes[i]] = peak(sizes[i])
        lo, hi = (i, hi) if seen[sizes[i]] <= limit else (lo, i)
    return sizes[lo] if lo >= 0 else None


def _probe(seen: dict[int, int], limit: int, sizes: Sequence[int], lo: int, hi: int) -> int:
    """Which of ``sizes[lo + 1 : hi]`` to simulate next (`_largest_fitting`)."""
    fitting = [(m, p) for m, p in seen.items() if p <= limit]
    over = [(m, p) for m, p in seen.items() if p > limit]
    if not fitting or not over:
        return (lo + hi) // 2
    (m0, p0), (m1, p1) = max(fitting), min(over)
    if m1 <= m0 or p1 <= p0:  # not increasing there: halve
        return (lo + hi) // 2
    crossing = m0 + (limit - p0) * (m1 - m0) / (p1 - p0)
    below = [i for i in range(lo + 1, hi) if sizes[i] <= crossing]
    return below[-1] if below else lo + 1


def _also(note: str, more: str) -> str:
    """``note`` with ``more`` after it (`FitPlan.note`'s "; "-separated parts)."""
    return f"{note}; {more}" if note else more


def plan_fit(
    model: nn.Module,
    batch: Any,
    budget: int | float | str | Budget,
    *,
    margin: float = 0.1,
    optimizers: Sequence[str | None] | None = None,
    precision: str | Sequence[str] = "32-true",
    checkpointing: str | Sequence[str] = AUTO,
    strategy: str = "ddp",
    n_gpus: int = 1,
    device: str = "cuda",
    loss_fn: Callable[[Any, Any], Tensor] | None = None,
    cost: str | StepCost = "auto",
    progress: Callable[[str], None] | None = None,
    release_gradients: bool = False,
    fused_step: bool = False,
    offload: bool = False,
    compensate: bool = True,
    refine_limit: int | None = None,
    refine_seconds: float | None = None,
    cpu_offload: bool | None = False,
    link: _fsdp2.Link | None = None,
    mixed_precision_policy: bool = False,
    batch_axes: SampleAxes | None = None,
    micro_batch_size: int | None = None,
    sharding: Sharding | _layouts.Layouts | Literal["auto"] | None = None,
    blocks: LayerClasses | None = None,
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
        strategy, n_gpus: shard one rank's step (``"ddp"``, ``"fsdp"``, ``"zero1"`` to ``"zero3"``,
            ``"deepspeed_stage_1"`` to ``"deepspeed_stage_3"``: the whole step divided); the batch is split
            across ranks. ``"fsdp2"``: one rank's FSDP2 step simulated (`estimate_memory`'s
            ``strategy="fsdp2"``), checkpointing planned block by block on it.
        device: ``"cuda"`` or ``"cpu"``: what the simulation models and the offline cost assumes.
        cost: ``"auto"`` (``"measured"`` for a model with real weights on the CPU and ``device="cpu"``,
            else ``"flops"``), ``"measured"``, ``"flops"``, or a `StepCost`.
        progress: called with a line before each simulation once planning has taken
            ``PROGRESS_AFTER_S`` seconds (a large model's simulations take seconds each).
        release_gradients: plan for a run that frees the gradients after each optimizer step
            (`release_gradients`, `GradientRelease`): the forward without the previous step's gradients.
        fused_step: plan for a run that steps each parameter inside backward (`fuse_optimizer_step`,
            `FusedOptimizerStep`): no gradient is whole at once, and no accumulation (the micro-batch is
            the global batch per GPU); one process only.
        offload: plan for a run whose optimizer lives in host memory (`offload_optimizer`,
            `OptimizerOffload`): no optimizer state and no whole gradient on the device, the update on fp32
            masters (so 16-bit weights need no Kahan twin), accumulation allowed; one process only. The plan
            gives the host memory it needs (`FitPlan.host_bytes`) and, on CUDA, the time its transfers and
            host update add (`transfer_seconds`, in the ranking too).
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
        refine_seconds: deprecated, for ``refine_limit``: read as ``refine_seconds / 4`` micro-batches
            (`refine_limit_for`; a 7B model's planner takes about 4 s on two cores), never as time.
        link: with ``strategy="fsdp2"``, how fast the ranks' collectives run (`_sharding.fsdp2.Link`; default
            `_sharding.fsdp2.LINKS` for ``device``): each micro-step's all-gathers and reduce-scatters are
            added to
            its time (`collective_seconds`), so fewer, larger micro-batches rank higher.
        cpu_offload: with ``strategy="fsdp2"``, plan for FSDP2's ``CPUOffloadPolicy`` (the sharded
            parameters, gradients and optimizer state in host memory; `_Search.offloaded`: an upper bound
            of what stays on the device, not simulated as such). ``None``: only where nothing fits
            without it (`AutoFitStrategy`, ``memkit plan``). `FitPlan.cpu_offload` and
            `FitPlan.host_bytes` say so.
        mixed_precision_policy: with ``strategy="fsdp2"``, the ``bf16-mixed`` plans shard each unit with
            FSDP2's ``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``
            (parameters all-gathered and computed in bf16, gradients reduce-scattered in fp32), as
            `AutoFitStrategy` does; `FitPlan.mixed_precision_policy` says whether the plan has it.
        sharding: with ``strategy="fsdp2"``, the layout the run applies (`Sharding`: tensor parallelism,
            HSDP, or a ``parallelize_fn`` such as a LightningModule's own ``configure_model``), simulated as
            it is; its ``world_size`` is ``n_gpus``, and the global batch splits over its data-parallel
            ranks. Default: FSDP2's documented layout over ``n_gpus``. ``"auto"`` or a `Layouts`: the layout
            planned too, among tensor-parallel degrees (torchtitan's LLaMA plan, or the user's
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

    Side effects: none on ``model``. The simulations run `estimate_memory` (which restores what it runs)
    and the timing (``cost="measured"``) runs `isolated` (see `measured_cost`): a plan that changes nothing
    leaves the run as it would have been without planning.

    Raises:
        ValueError: no configuration fits; the message gives the static floor, the leanest plan's peak and
            what would fit (more GPUs with FSDP, a larger GPU). Also for an empty ``batch``.
        NotImplementedError: a LightningModule with manual optimization.
    """
    if sharding == "auto" or isinstance(sharding, _layouts.Layouts):  # the layout planned too
        return _plan_layouts({name: value for name, value in locals().items() if name in _ARGUMENTS})
    if is_lightning(model) and not model.automatic_optimization:
        raise NotImplementedError(
            f"{type(model).__name__} uses manual optimization, whose steps are its own code and cannot be "
            "simulated: plan the underlying nn.Module instead, with loss_fn= (and optimizers= to name the "
            "candidates)."
        )
    if (empty := without_parameters(model)) is not None:
        raise ValueError(empty)
    budget = parse_budget(budget)
    if not 0.0 <= margin < 1.0:
        raise ValueError(f"margin must be in [0, 1), got {margin}")
    if refine_seconds is not None and refine_limit is not None:
        raise TypeError("refine_seconds is the deprecated form of refine_limit: give refine_limit alone")
    if refine_seconds is not None:
        counted = " (a count of micro-batches, so that the plan does not depend on the machine's load)"
        refine_limit = renamed(
            "plan_fit", "refine_seconds", "refine_limit", refine_limit_for(refine_seconds), also=counted
        )
    if refine_limit is not None:
        refine_limit = whole_number("refine_limit", refine_limit, of="micro-batches", at_least=0)
    limit = int(budget.usable * (1 - margin))
    precisions = (precision,) if isinstance(precision, str) else tuple(precision)
    if not precisions:
        raise ValueError(
            "precision= is empty: give a Lightning precision string, e.g. '32-true' or 'bf16-mixed'"
        )
    if isinstance(n_gpus, bool) or not isinstance(n_gpus, int) or n_gpus < 1:
        raise ValueError(f"n_gpus must be a whole number of GPUs, at least 1; got {n_gpus!r}")
    strategy = valid_name("strategy", strategy, STRATEGIES)
    ranks = _data_parallel_ranks(sharding, strategy, n_gpus, cpu_offload)
    modes, note = _checkpointable(
        model, allowed_modes(checkpointing), sharded=strategy == "fsdp2", blocks=blocks
    )
    axes = default_axes(batch) if batch_axes is None else batch_axes
    total = batch_size(batch, axes)
    if total % ranks:
        what = f"{ranks} data-parallel ranks" if ranks != n_gpus else f"{n_gpus} GPUs"
        raise ValueError(f"The global batch of {total} does not split evenly across {what}")
    per_rank = batch_slice(batch, total // ranks, axes=axes)
    sizes = _divisors(total // ranks)
    if fused_step:
        if n_gpus > 1 and strategy != "fsdp2":
            raise ValueError(
                f"The optimizer step fused into backward cannot run under {strategy}: it reduces each "
                "gradient across ranks after backward. Plan it with n_gpus=1 or strategy='fsdp2' (each "
                "shard steps once its reduce-scatter is done), or plan release_gradients=True instead."
            )
        sizes = sizes[-1:]  # it steps at every backward: no accumulation
    if offload and (fused_step or n_gpus > 1):
        raise ValueError(
            "The offloaded optimizer runs on one process, its step after backward: plan it with n_gpus=1 "
            "and without fused_step."
        )
    lever = Step.of(release_gradients=release_gradients, fused_step=fused_step, offload=offload).lever
    search = _Search(
        model,
        per_rank,
        loss_fn,
        device,
        strategy if n_gpus > 1 or strategy == "fsdp2" else "ddp",
        n_gpus,
        progress,
        lever,
        axes,
        sharding,
    )
    candidates, unsharded = _candidates(model, optimizers, strategy, n_gpus)
    if unsharded:
        note = _also(note, unsharded)
    if not candidates:
        raise ValueError(f"No optimizer to plan: {unsharded}; name a torch or torch-optimi one (adamw, sgd)")
    pairs = _pairs(candidates, precisions, compensate and not offload, fused_step)  # masters are fp32
    if not pairs and fused_step:
        raise ValueError(
            f"With 16-bit weights ({', '.join(precisions)}) only the Kahan-summed optimizers keep the small "
            "updates, and the fused step cannot take them as the catalogue builds them (torch-optimi counts "
            "steps per group): allow a precision with fp32 weights (32-true, bf16-mixed), or plan without "
            "fused_step."
        )
    if not pairs:
        raise ValueError(
            f"None of the optimizers {', '.join(map(str, candidates))} keeps small updates with 16-bit "
            f"weights ({', '.join(precisions)}): allow adamw or sgd (planned as their Kahan-summed "
            "adamw_kahan, sgd_kahan), or a precision with fp32 weights (32-true, bf16-mixed)."
        )
    search.refine_limit = refine_limit
    search.blocks = None if blocks is None else block_classes(blocks)
    search.limit = limit
    if cpu_offload and strategy != "fsdp2":
        raise ValueError(
            f"cpu_offload is FSDP2's CPUOffloadPolicy: plan it with strategy='fsdp2', not {strategy!r}"
        )
    search.cpu_offload = bool(cpu_offload) and strategy == "fsdp2"
    if mixed_precision_policy and strategy != "fsdp2":
        raise ValueError(
            f"mixed_precision_policy is FSDP2's MixedPrecisionPolicy: plan it with strategy='fsdp2', not "
            f"{strategy!r}"
        )
    search.mixed_precision_policy = mixed_precision_policy
    asked, candidates = candidates, tuple(dict.fromkeys(o for o, _ in pairs))  # with the Kahan twins
    # The pairs in order of preference whose static memory alone is not over the limit (no simulation).
    viable = [pair for pair in pairs if search.static(*pair) <= limit]
    # The run as set up, where it fits, is the plan: one simulation settles it (`_set_up_fits`).
    set_up = _set_up_fits(search, micro_batch_size, sizes, pairs[0], viable, limit)
    sizes = [micro_batch_size] if set_up else _runnable(search, sizes, *(viable or pairs)[0])
    # FSDP2's CPU offload: as asked, or (None) where nothing fits without it
    # (`offloaded` shards over every rank: not under tensor parallelism, nor HSDP)
    plain = search.sharding is not None and search.sharding.shard_size == n_gpus
    offloads = (False, True) if cpu_offload is None and plain else (search.cpu_offload,)
    chosen = (
        pairs[0]
        if set_up
        else _first_fitting(search, pairs, viable, sizes[0], modes[-1], limit, offloads=offloads)
    )
    if chosen is None:
        pairs = [pair for pair in pairs if _loads(pair[0])] or pairs  # known by now: all were tried
        lever_fits = _lever_that_fits(search, asked, precisions, modes, limit, compensate)
        message = _infeasible(search, pairs, precisions, modes, limit, budget, margin, total, lever_fits)
        if cpu_offload is None and plain:
            leanest = search.whole[(search.smallest, modes[-1], *pairs[-1])]  # FSDP2: no COMPILE_BUDGET
            offloaded = search.offloaded(leanest, pairs[-1][1]).peak
            message += (
                f" With FSDP2's CPU offload (CPUOffloadPolicy) the leanest plan still needs about "
                f"{format_bytes(offloaded)} a rank."
            )
        raise ValueError(message)

    opt, prec = chosen
    timing = "flops" if set_up and isinstance(cost, str) else cost  # as set up nothing is ranked
    step_cost = _cost(timing, model, per_rank, loss_fn, device, search, prec, opt)
    if step_cost.source == "measured":  # the only part of a plan the machine's load can change
        note = _also(note, TIMED_NOTE)
    if search.sharding and n_gpus > 1:  # the layout's collectives, every micro-step (every rank on `link`)
        fixed, per_sample = _layouts.collectives(
            model,
            search.sharding,
            prec,
            _layouts.tokens_per_sample(batch, axes),
            link or _fsdp2.LINKS[device],
        )
        step_cost = dataclasses.replace(
            step_cost, fixed=step_cost.fixed + fixed, per_sample=step_cost.per_sample + per_sample
        )
    G = total // ranks
    host, micro, per_step = 0, 0.0, 0.0
    if search.cpu_offload:  # FSDP2's CPUOffloadPolicy: a rank's shards, their gradients and the state
        on_host = shard(model_static(model, prec, opt or "sgd"), "fsdp", n_gpus)
        host = on_host.static
        if device == "cuda":  # the shards up and the gradients down every micro-step, the host's update
            micro, per_step = transfer_seconds(on_host.parameters, on_host.gradients, on_host.optimizer_state)
            step_cost = dataclasses.replace(step_cost, fixed=step_cost.fixed + micro, per_step=per_step)
    if offload:
        static = model_static(model, prec)
        state = model_static(model, "32-true", opt or "sgd").optimizer_state  # on the fp32 masters
        host = 2 * model_static(model, "32-true").parameters + state  # the masters and their gradients
        if device == "cuda":  # on the CPU the host is the device: nothing travels
            micro, per_step = transfer_seconds(static.parameters, static.gradients, state)
            step_cost = dataclasses.replace(step_cost, fixed=step_cost.fixed + micro, per_step=per_step)
    options = _fastest(search, step_cost, sizes, ("none",) if set_up else modes, opt, prec, limit, G)
    if set_up:
        note = _also(
            note,
            f"micro-batch {micro_batch_size} x accumulate {G // micro_batch_size} kept as set up: it fits",
        )
    best = min(options, key=_quickest)
    kept = _as_set_up(search, step_cost, micro_batch_size, sizes, chosen, pairs[0], limit, G)
    if kept is not None and kept != best:
        options, best = [*options, kept], kept
        note = _also(note, f"micro-batch {kept.m} x accumulate {G // kept.m} kept as set up: it fits")
    reshard = None
    if search.sharding and search.unrefined:  # the work past refine_limit: FSDP2's default
        reshard = True
        untried = f"reshard_after_forward=False not tried (past refine_limit={refine_limit})"
        note = _also(note, untried)
    elif search.sharding and _reshards_as_planned(search.sharding):
        # FSDP2: without resharding after forward (no all-gather in backward) if it fits
        whole = search.estimate(
            best.m, best.plan or best.label, optimizer=opt, precision=prec, reshard_after_forward=False
        )
        kept = search.per_rank(whole, prec)
        reshard = kept.peak > limit
        if not reshard:  # the chosen row of the table too
            options = [o._replace(peak=kept.peak) if o == best else o for o in options]
            best = best._replace(peak=kept.peak)
    if search.unrefined:
        late = (
            "block-by-block checkpointing not searched at every micro-batch (past "
            f"refine_limit={refine_limit} micro-batches)"
        )
        note = _also(note, late)
    if routed(model):
        note = _also(note, ROUTING_ASSUMED)
    return FitPlan(
        micro_batch_size=best.m,
        accumulate_grad_batches=G // best.m,
        checkpointing=best.label,
        optimizer=opt,
        precision=prec,
        estimated_peak=best.peak,
        budget=budget,
        margin=margin,
        alternatives=_alternatives(search, step_cost, options, candidates, precisions, chosen, limit, G),
        strategy=LIGHTNING_STRATEGY[strategy] if n_gpus > 1 else "auto",
        n_gpus=n_gpus,
        cost=step_cost,
        modes=modes,
        note=note,
        checkpoint_plan=best.plan or named_plan(model, best.label, search.blocks),
        lever=LEVER_CALLBACKS.get(lever),
        host_bytes=host,
        offload_seconds=per_step + micro * (G // best.m),
        reshard_after_forward=reshard,
        cpu_offload=search.cpu_offload,
        mixed_precision_policy=getattr(search.sharded(prec), "mp_policy", None) is not None,
        device=torch.device(device).type,
        tensor_parallel_size=search.sharding.tensor_parallel_size if search.sharding else 1,
        replicate_size=search.sharding.replicate_size if search.sharding else 1,
    )


def _plan_layouts(arguments: dict[str, Any]) -> FitPlan:
    """`plan_fit` with the layout left open (``sharding=`` a `Layouts` or ``"auto"``): each layout in the
    order of least communication planned with the other ``arguments``, the first that fits every rank
    (`_fitting.layouts.plan_layouts`). ``cpu_offload=None`` (where nothing fits without it): only where no
    layout fits, for FSDP2 over every rank."""
    layouts = arguments["sharding"]
    layouts = _layouts.Layouts() if layouts == "auto" else layouts
    if arguments["strategy"] != "fsdp2":
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
            arguments["n_gpus"], layouts, precision if isinstance(precision, str) else precision[0],
            arguments["link"] or _fsdp2.LINKS[device], device,
        )  # fmt: skip
    except ValueError as error:
        if asked is not None:
            raise
        no_layout = str(error)
    # CPU offload (None: where nothing fits without it) last, on FSDP2's layout over every rank, the only
    # one it is planned for: its transfers cost more than any layout's collectives
    try:
        offloaded = plan(Sharding(arguments["n_gpus"]), None)
    except ValueError as error:
        raise ValueError(f"{no_layout}. With CPU offload: {error}") from None
    return dataclasses.replace(offloaded, note=_also(offloaded.note, no_layout))


#: `plan_fit`'s arguments, as `_plan_layouts` passes them on.
_ARGUMENTS = frozenset(inspect.signature(plan_fit).parameters)


def _as_set_up(search, step_cost, m, sizes, chosen, first, limit, G) -> _Option | None:
    """The run as set up: micro-batch ``m`` without checkpointing, where the ``chosen`` optimizer and
    precision are the ``first`` asked for and it fits; else ``None``."""
    if m is None or chosen != first or m not in sizes:
        return None
    opt, prec = chosen
    peak = search.peak(m, "none", opt, prec).peak
    return _Option(step_cost.time(m, G // m), m, "none", peak, None) if peak <= limit else None


def _set_up_fits(search, m, sizes, first, viable, limit) -> bool:
    """Whether the run as set up (micro-batch ``m`` without checkpointing, with the ``first`` optimizer and
    precision asked for) fits ``limit``: then it is the plan, from this one simulated step (its FLOPs
    counted: the plan's time, with nothing to rank it against), and ``search.smallest`` is ``m``. FSDP2's
    steps, whose ``reshard_after_forward`` is planned too, are searched as usual."""
    if m not in sizes or first not in viable or search.sharding is not None or not _loads(first[0]):
        return False
    try:
        search.counted(m, *first)
    except ValueError:  # a micro-batch the step refuses (BatchNorm's one sample a channel): searched
        return False
    if search.peak(m, "none", *first).peak > limit:
        return False
    search.smallest = m  # nothing smaller is planned
    return True


def refine_limit_for(seconds: float) -> int | None:
    """The `plan_fit` ``refine_limit`` a deprecated ``refine_seconds`` stands for: a micro-batch refined per
    `REFINE_SECONDS_EACH` seconds, rounded down (30 s: 7); ``None`` (no limit) for infinity. Never a clock."""
    if isinstance(seconds, bool) or not isinstance(seconds, numbers.Real) or not seconds >= 0:
        raise ValueError(f"refine_seconds must be a number of seconds, at least 0; got {seconds!r}")
    return None if math.isinf(seconds) else math.floor(seconds / REFINE_SECONDS_EACH)


def _first_fitting(search, pairs, viable, m, strongest, limit, *, offloads: Sequence[bool]):
    """The first (optimizer, precision) pair in quality order whose leanest step (micro-batch ``m``, the
    ``strongest`` checkpointing) fits ``limit`` under one of the CPU-offload settings ``offloads``, tried in
    turn (``(False, True)``: a better optimizer offloaded before a lighter one that is not). Leaves ``search``
    at the choice's offloading; ``None`` if nothing fits."""

    def offloading(on: bool) -> None:
        if search.cpu_offload != on:
            search.cpu_offload = on
            search.cache = {key: search.per_rank(whole, key[3]) for key, whole in search.whole.items()}

    for pair in pairs:
        if not _loads(pair[0]):
            continue
        for on in offloads:
            offloading(on)
            if (on or pair in viable) and search.peak(m, strongest, *pair).peak <= limit:
                return pair
    offloading(offloads[0])
    return None


def _loads(optimizer: str | None) -> bool:
    """Whether ``optimizer`` can be built here: a bitsandbytes one only where bitsandbytes loads (the
    candidates list it where it is installed, `lighter_candidates`; it is imported when first needed)."""
    entry = CATALOGUE.get(optimizer) if optimizer is not None else None
    return entry is None or not entry.needs_bitsandbytes or load_bitsandbytes() is not None


def _reshards_as_planned(sharding: Sharding) -> bool:
    """Whether the run shards with the plan's ``reshard_after_forward``: its default layout, or the one
    AutoFitStrategy applies where configure_model shards nothing; a user's ``parallelize_fn`` (their
    configure_model) calls ``fully_shard`` with their own."""
    fn = sharding.parallelize_fn
    return fn is None or bool(getattr(fn, "shard_unsharded", False))


def _data_parallel_ranks(sharding: Sharding | None, strategy: str, n_gpus: int, cpu_offload: Any) -> int:
    """The ranks the global batch splits over: ``n_gpus``, less tensor parallelism's groups of the run's
    layout (``sharding``, checked against the other arguments)."""
    if sharding is None:
        return n_gpus
    if not isinstance(sharding, Sharding):
        raise TypeError(f"sharding= must be a Sharding; got {sharding!r} ({type(sharding).__name__})")
    if strategy != "fsdp2" or sharding.world_size != n_gpus:
        raise ValueError(
            f"sharding= is the layout of strategy='fsdp2' over n_gpus ranks; got strategy={strategy!r}, "
            f"n_gpus={n_gpus} and a layout over {sharding.world_size} ranks ({sharding.describe()})"
        )
    plain = sharding.parallelize_fn is None and sharding.tensor_parallel_size == sharding.replicate_size == 1
    if cpu_offload and not plain:
        raise ValueError(
            f"cpu_offload is planned for FSDP2's own layout over every rank, not {sharding.describe()}: "
            "plan without it"
        )
    return sharding.data_parallel_size


def _candidates(
    model: nn.Module, optimizers: Sequence[str | None] | None, strategy: str, n_gpus: int
) -> tuple[tuple[str | None, ...], str]:
    """The optimizers to plan, in quality order (the model's own, then lighter, unless named), and a note
    on those left out: under FSDP2 the bitsandbytes optimizers, whose kernels DTensor cannot shard ("does
    not have a sharding strategy registered"), and torch's Adafactor, whose step reads a value from a tensor
    that the simulation's sharded fake tensors cannot give."""
    candidates = tuple(optimizers) if optimizers is not None else lighter_candidates(model)
    if strategy != "fsdp2":  # one rank too: its step runs on DTensors all the same
        return candidates, ""
    bnb = [o for o in candidates if o in CATALOGUE and CATALOGUE[o].needs_bitsandbytes]
    notes = [f"{', '.join(bnb)}: bitsandbytes' kernels do not run on FSDP2's DTensors"] if bnb else []
    if "adafactor" in candidates:
        notes.append("adafactor: its sharded step is not simulated")
    left_out = {*bnb, "adafactor"}
    kept = tuple(o for o in candidates if o not in left_out)
    return kept, f"not planned under FSDP2: {'; '.join(notes)}" if notes else ""


class _Option(NamedTuple):
    """A micro-batch with its checkpointing, timed: a row of the plan's table."""

    time: float
    m: int
    label: str
    peak: int
    plan: CheckpointPlan | None


def _quickest(option: _Option) -> tuple:
    """What ranks the options: the time, then no checkpointing before any, then less recompute, then as
    before. On a CPU a timed checkpointing plan can read no slower than none within the timing noise (its
    recompute clamped at 0): the tie went to ``"full"``, first by name."""
    recompute = getattr(option.plan, "overhead", None)
    return (
        option.time,
        option.label != "none",
        FULL_RECOMPUTE if recompute is None else recompute,
        *option[1:3],
    )


def _label(modes: Sequence[str]) -> str:
    """A checkpointing plan in a word: its mode if every block has it, else the count of each mode."""
    counts = Counter(modes)
    if len(counts) == 1:
        return next(iter(counts))
    return ", ".join(f"{counts[mode]} {mode}" for mode in CHECKPOINT_MODES if counts[mode])


def _plan_label(plan: CheckpointPlan) -> str:
    """A checkpointing plan as `FitPlan.checkpointing` names it: `_label`, or a compiled model's
    activation budget (`budget_label`)."""
    if plan.compile_budget is not None:
        return budget_label(plan.compile_budget)
    return _label([b.mode for b in plan.blocks]) if plan.blocks else "none"


def _fastest(search, step_cost, sizes, modes, opt, prec, limit, G) -> list[_Option]:
    """The micro-batches and checkpointing worth ranking: the largest micro-batch without checkpointing,
    and larger ones up to the largest the strongest mode fits, each with the planner's cheapest plan."""
    options: list[_Option] = []
    reached = 0
    known = search.cache.get((sizes[0], "none", opt, prec))  # the FLOP count's step, if it was simulated
    if modes[0] == "none" and (known is None or known.peak <= limit):  # else no micro-batch fits without
        m = _largest_fitting(
            lambda m: search.peak(m, "none", opt, prec).peak, limit, sizes, search.peaks("none", opt, prec)
        )
        if m is not None:
            reached = m
            peak = search.peak(m, "none", opt, prec).peak
            options.append(_Option(step_cost.time(m, G // m), m, "none", peak, None))
    above = [m for m in sizes if m > reached]
    if modes != ("none",) and above:
        top = _largest_fitting(
            lambda m: search.peak(m, modes[-1], opt, prec).peak,
            limit,
            above,
            search.peaks(modes[-1], opt, prec),
        )
        # From the largest down: a smaller micro-batch takes more micro-steps, so once the best plan found
        # beats one's time without any recompute, that micro-batch needs no planner.
        for m in reversed([m for m in above if top is not None and m <= top]):
            if options and step_cost.time(m, G // m) >= min(options).time:
                continue
            if modes[-1] == COMPILE_BUDGET:  # torch.compile's activation budget: no planner, no timing
                if (m, opt, prec) not in search.compiled and not search.refining():
                    continue  # up to ten simulations: not past refine_limit
                plan, _ = search.compiled_plan(m, opt, prec)
                if plan is not None:  # its recompute in FLOPs, under either cost
                    seconds = step_cost.time(m, G // m, plan.overhead or 0.0)
                    kept = plan if plan.compile_budget is not None else None  # else: as configured
                    options.append(_Option(seconds, m, _plan_label(plan), plan.peak, kept))
                continue
            if not search.refining():  # no time for a planner: the strongest mode, if simulated and fits
                strongest = search.cache.get((m, modes[-1], opt, prec))
                if strongest is not None and strongest.peak <= limit:
                    slowest = step_cost.time(m, G // m, FULL_RECOMPUTE)  # at most full's recompute
                    options.append(_Option(slowest, m, modes[-1], strongest.peak, None))
                continue
            found = search.checkpoint_plans(m, modes, opt, prec, limit)
            # FLOPs rank the plans (the first); a timed step times each (its recompute is not its FLOPs)
            timed = step_cost.source == "measured"
            for plan, breakdown in found if timed else found[:1]:
                recompute = search.timed_recompute(m, plan) if timed else plan.overhead
                options.append(
                    _Option(step_cost.time(m, G // m, recompute), m, _plan_label(plan), breakdown.peak, plan)
                )
    assert options, "the smallest runnable micro-batch at the strongest mode fits"
    return options


def _alternatives(
    search, step_cost, options, candidates, precisions, chosen, limit, G
) -> tuple[Alternative, ...]:
    """Every configuration simulated, as rows: uniform modes, and the planner's plans with their times.

    A row's time (relative to the chosen plan's, and in seconds per global batch) is known for rows of the
    chosen optimizer and precision, at the recompute `_uniform_recompute` gives; ``None`` otherwise."""
    rows: dict[tuple, Alternative] = {}
    fastest = min(options).time
    opt, prec = chosen
    for (m, mode, o, p), breakdown in search.cache.items():
        recompute = _uniform_recompute(search, m, mode, o, p)
        seconds = None if (o, p) != chosen or recompute is None else step_cost.time(m, G // m, recompute)
        rows[(m, mode, o, p)] = Alternative(
            m, G // m, mode, o, p, breakdown.peak, None if seconds is None else seconds / fastest,
            breakdown.peak <= limit, seconds,
        )  # fmt: skip
    for option in options:  # the plans ranked, at the recompute they were ranked by
        row = Alternative(
            option.m, G // option.m, option.label, opt, prec, option.peak, option.time / fastest, True,
            option.time,
        )  # fmt: skip
        rows[(option.m, option.label, opt, prec)] = row
    order = {mode: i for i, mode in enumerate(CHECKPOINT_MODES)}
    return tuple(
        row
        for _, row in sorted(
            rows.items(),
            key=lambda kv: (
                candidates.index(kv[0][2]),
                precisions.index(kv[0][3]),
                kv[0][0],
                order.get(kv[0][1], len(order)),
            ),
        )
    )


def _uniform_recompute(search, m: int, mode: str, optimizer: str | None, precision: str) -> float | None:
    """The recompute of ``mode`` on every block as a fraction of the blocks' compute: as a planner measured
    it at this micro-batch, else at another (the fraction hardly moves with the micro-batch: both scale
    with it), else full checkpointing's one forward in three (`FULL_RECOMPUTE`); ``None`` for another mode
    no planner measured."""
    if mode == "none":
        return 0.0
    if label_budget(mode) is not None:
        return search.recompute(m, mode, optimizer, precision)
    planner = search.planners.get((m, optimizer, precision)) or next(iter(search.planners.values()), None)
    if planner is not None and mode in planner.modes:
        return planner.overhead(planner.uniform(mode))
    return FULL_RECOMPUTE if mode == "full" else None


def _pairs(
    candidates: Sequence[str | None], precisions: Sequence[str], compensate: bool, fused: bool = False
) -> list[tuple[str | None, str]]:
    """The (optimizer, precision) pairs to plan, best first: each optimizer at each precision in the order
    given, except that with ``compensate`` a precision with 16-bit weights takes the optimizer's Kahan
    twin (`COMPENSATED`), and an optimizer without one is not planned there. ``None`` (the configured
    optimizer, not in the catalogue) is kept as is. With the ``fused`` step the Kahan entries are left
    out: torch-optimi's optimizers count steps per group, and `fuse_optimizer_step` takes them only built
    with ``gradient_release=True``."""
    pairs: list[tuple[str | None, str]] = []
    for opt in candidates:
        for prec in precisions:  # in the order of preference given
            candidate = opt
            if compensate and opt is not None and sixteen_bit_weights(prec):
                candidate = COMPENSATED.get(opt)  # a Kahan entry is its own twin
            if (candidate is None and opt is not None) or (fused and candidate in KAHAN):
                continue
            pairs.append((candidate, prec))
    return list(dict.fromkeys(pairs))


def _checkpointable(
    model: nn.Module, modes: tuple[str, ...], *, sharded: bool = False, blocks: LayerClasses | None = None
) -> tuple[tuple[str, ...], str]:
    """The modes that are candidates for ``model``, and a note on those that are not.

    Checkpointing applies to the repeated blocks `find_blocks` finds, or the instances of ``blocks``; a model
    with none (an MLP, a single layer) has nothing to checkpoint, so only ``"none"`` is planned, whatever was
    allowed. A compiled model's blocks are not checkpointed either: inside a compiled graph what is kept
    for backward is torch.compile's partitioner's choice, so its mode is `COMPILE_BUDGET`, the activation
    budget `plan_compiled` finds at each micro-batch; except under FSDP2 (``sharded``), whose sharded step
    of a compiled model is simulated eagerly, so no activation budget would change it.
    """
    if modes != ("none",) and compiled_modules(model) and sharded:
        return ("none",), (
            f"checkpointing not planned: {type(model).__name__} is compiled, and FSDP2's sharded step is "
            "simulated eagerly, where torch.compile's activation budget changes nothing"
        )
    if modes != ("none",) and compiled_modules(model):
        return ("none", COMPILE_BUDGET), (
            f"{type(model).__name__} is compiled: its checkpointing is torch.compile's "
            f"activation_memory_budget ({COMPILE_BUDGET} in the table; its partitioner recomputes what it "
            f"no longer saves), the highest whose step fits, tried from {configured_budget():g} down a "
            "tenth at a time; no block is wrapped"
        )
    if modes == ("none",) or find_blocks(model, blocks):
        return modes, ""
    if blocks is not None:
        raise ValueError(no_blocks_message(model, "plan_fit(..., blocks={MyBlock})", blocks))
    dropped = ", ".join(mode for mode in modes if mode != "none")
    return ("none",), (
        f"checkpointing {dropped} not planned: {type(model).__name__} has no repeated blocks to checkpoint"
    )


def _cost(cost, model, batch, loss_fn, device, search, precision, optimizer) -> StepCost:
    if isinstance(cost, StepCost):
        return cost
    cost = valid_name("cost", cost, ("auto", "measured", "flops"))
    real_cpu = model_device(model).type == "cpu"
    if cost == "measured" or (cost == "auto" and real_cpu and device == "cpu"):
        size = batch_size(batch, search.axes)
        small = search.smallest
        sizes = (small, max(small, min(4 * small, size)))
        return measured_cost(model, batch, loss_fn=loss_fn, sizes=sizes, axes=search.axes)
    flops, ops = search.counted(search.smallest, optimizer, precision)
    return flops_cost(flops, ops, search.smallest, device)


def _lever_that_fits(search, candidates, precisions, modes, limit, compensate) -> str:
    """Where nothing fits as asked and no step lever was, the cheapest lever (`LEVER_CALLBACKS`) whose
    leanest plan fits ``limit``, as the fix the refusal names, with its figure; ``""`` if none does (or a
    lever was asked, or several ranks). One simulation a lever, of the step `plan_fit` plans with that
    lever's keyword: its leanest optimizer and precision (`_pairs` as it forms them), the strongest
    checkpointing, and for the fused step one micro-batch, the global batch per GPU. Where it fits, that
    `plan_fit` finds a plan: a refusal never contradicts the planner."""
    if search.lever is not None or search.n_gpus > 1 or search.sharding:
        return ""
    strongest = modes[-1] if modes[-1] in CHECKPOINT_MODES else "none"  # compiled: the budget configured
    for keyword, callback in LEVER_CALLBACKS.items():
        fused = keyword == "fused_step"
        pairs = _pairs(candidates, precisions, compensate and keyword != "offload", fused)
        pairs = [p for p in pairs if _loads(p[0])]
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
                f"{callback}() (plan_fit's {keyword}=True): its leanest plan, micro-batch {m}, {strongest} "
                f"checkpointing, {optimizer}, {precision}, peaks at {format_bytes(peak)}"
            )
    return ""


def _infeasible(search, pairs, precisions, modes, limit, budget, margin, total, lever_fits="") -> str:
    """The error text: static floor, leanest plan's peak, and what would fit (``lever_fits`` first: the
    step lever that fits, `_lever_that_fits`)."""
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
            (n for n in _SUGGESTED_GPUS if n <= total and shard(whole, "fsdp", n).peak <= limit),
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
    ranks = f" over {search.n_gpus} GPUs ({search.strategy})" if search.n_gpus > 1 else ""
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
    lower = "" if {"bf16-true", "16-true"} & set(precisions) else LOWER_PRECISION_HINT
    return (
        f"No plan fits {format_bytes(limit)} ({budget.source}, usable {format_bytes(budget.usable)} less the "
        f"{margin:.0%} margin){ranks}. Static floor ({static_parts}) with "
        f"{leanest_opt or 'the configured optimizer'}, {leanest_prec}: {format_bytes(floor.static)}; the "
        f"leanest plan (micro-batch {search.smallest}, {strongest} checkpointing, {leanest_opt}) peaks at "
        f"{format_bytes(floor.peak)}; with {first_opt or 'the configured optimizer'} at micro-batch "
        f"{search.smallest}: {format_bytes(best.peak)}. What would fit: {hint}{lower}."
    )


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
    search = _Search(model, batch, loss_fn, device, "ddp", 1)
    return {
        (m, c): search.peak(m, c, optimizer, precision).peak
        for c in checkpointing
        for m in _divisors(batch_size(batch))
    }
