"""The simulated steps of one model and batch, each a `Candidate`: one rank's peak, cached, with the
checkpointing planners and compiled activation budgets that read them.

`plan_fit`'s driver (`_fitting.search`) and its ranking (`_fitting.ranking`) ask `Simulations` for peaks;
nothing here decides which plan wins. The figures behind the constants: ``docs/design/plan-fit.md``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple

from lightning_memkit._breakdown import MemoryBreakdown
from lightning_memkit._budget import valid_name
from lightning_memkit._checkpointing.blocks import LayerClasses, find_blocks
from lightning_memkit._checkpointing.compiled import COMPILE_BUDGET, budget_label, label_budget, plan_compiled
from lightning_memkit._checkpointing.planner import CheckpointPlanner
from lightning_memkit._checkpointing.policies import CheckpointPlan, apply_plan, named_plan
from lightning_memkit._estimating.analytic import model_static, shard
from lightning_memkit._estimating.compiled import compiled_modules
from lightning_memkit._estimating.lightning_step import SampleAxes, batch_size, batch_slice, default_axes
from lightning_memkit._estimating.precision import sixteen_bit_weights
from lightning_memkit._estimating.simulate import counted_step, estimate_step
from lightning_memkit._fitting.plan import StepCost, flops_cost, measured_cost
from lightning_memkit._fitting.space import SearchSpace
from lightning_memkit._measuring.storages import model_device
from lightning_memkit._sharding import fsdp2 as _fsdp2
from lightning_memkit._step import Lever, Sharding, Step
from lightning_memkit._vocabulary import AUTO

#: How far over the limit the checkpointing planner's peak model must put a uniform mode for its simulation
#: to be skipped (the model is calibrated to the simulated peak at no checkpointing and at the floor).
MODEL_SLACK = 0.05
#: Forward and backward ops of a whole step (`counted_step`'s) above which the checkpointing planner
#: refines a micro-batch's plan once, not three times: a step of that many takes about 2 s to simulate on
#: two cores (GPT-2's 1,447 ops 0.7 s, LLaMA-7B's 7,841 ops 7 s). A count, so that the plan does not
#: depend on how busy the machine is.
SLOW_SIMULATION_OPS = 3_000
#: Seconds of planning after which each further simulation is reported to ``plan_fit(progress=...)``.
PROGRESS_AFTER_S = 2.0


class Candidate(NamedTuple):
    """One configuration of a rank's step: the key of every step simulated, counted or planned."""

    #: the micro-batch, in samples
    m: int
    #: the checkpointing: a mode on every block, a compiled step's activation budget (`budget_label`),
    #: `COMPILE_BUDGET` (the budget planned at ``m``) or `AUTO` (block by block: a planner's)
    mode: str
    #: a catalogue name; ``None``: the model's own
    optimizer: str | None
    #: a Lightning precision string
    precision: str

    def at(self, mode: str) -> Candidate:
        """The same step with checkpointing ``mode``."""
        return self._replace(mode=mode)


class Simulations:
    """Simulations of one model and batch, cached by `Candidate`; one rank's (sharded) peak."""

    def __init__(
        self, model, batch, loss_fn, device, strategy, world_size, *, progress=None, lever=None, axes=None,
        layout=None, limit=None, refine_limit=None, cpu_offload=False, mp_policy=False,
        blocks=None,
    ) -> None:  # fmt: skip
        self.model, self.batch, self.loss_fn, self.device = model, batch, loss_fn, device
        #: each tensor's sample dimension (`SampleAxes`): the micro-batches are cut along it
        self.axes: SampleAxes = default_axes(batch) if axes is None else axes
        #: what changes the optimizer step (`Step.lever`), planned for
        self.lever: Lever | None = lever
        #: how one rank's share is cut (`shard`): one process runs its whole step
        self.strategy = strategy if world_size > 1 or strategy == "fsdp2" else "ddp"
        self.world_size = world_size
        #: FSDP2's step is simulated sharded (one rank's, in the run's layout); the other strategies
        #: divide the whole step
        self.sharding = (layout or Sharding(world_size)) if strategy == "fsdp2" else None
        #: FSDP2 with a bf16 MixedPrecisionPolicy for the bf16-mixed steps (`plan_fit`'s keyword)
        self.mp_policy = mp_policy
        self.cache: dict[Candidate, MemoryBreakdown] = {}  # one rank's
        self.counts: dict[Candidate, tuple[int, int]] = {}  # FLOPs and ops of the steps `counted`
        self.whole: dict[Candidate, MemoryBreakdown] = {}  # the same steps, unsharded
        #: the checkpointing planner of each micro-batch, optimizer and precision asked for (mode `AUTO`)
        self.planners: dict[Candidate, CheckpointPlanner] = {}
        #: a forward + backward timed at each micro-batch, without checkpointing (`timed_recompute`)
        self.timed: dict[int, StepCost] = {}
        #: the smallest micro-batch the step accepts (`runnable`)
        self.smallest = 1
        self.progress = progress
        self.started = time.perf_counter()
        #: FSDP2's CPUOffloadPolicy: the sharded parameters and optimizer state on the host (`offloaded`)
        self.cpu_offload = cpu_offload
        self._shard_bytes: dict[int | None, tuple[int, int]] = {}  # `offloaded`'s, by element size
        #: micro-batches that may get a block-by-block plan (`plan_fit`'s refine_limit); ``None``: all
        self.refine_limit: int | None = refine_limit
        self.refined = 0  # micro-batches that got one (a planner, or a compiled model's budget search)
        self.unrefined = False  # whether a micro-batch was left at full checkpointing past the limit
        #: the bytes a step may peak at (`plan_fit`'s limit): what a compiled model's activation budget is
        #: planned for (`compiled_plan`)
        self.limit: int | None = limit
        #: a compiled model's plan at each micro-batch, optimizer and precision (mode `COMPILE_BUDGET`): the
        #: plan (``None`` where no activation budget fits) and the mode of its step, or of the lowest step
        #: tried
        self.compiled: dict[Candidate, tuple[CheckpointPlan | None, str]] = {}
        #: the classes whose instances are the blocks (`plan_fit`'s ``blocks``); ``None``: `find_blocks`'
        self.blocks: LayerClasses | None = blocks
        #: whether the model has compiled modules: its checkpointing is torch.compile's activation budget
        self.compiling = bool(compiled_modules(model))

    @classmethod
    def of(cls, space: SearchSpace) -> Simulations:
        """The simulations of one rank's step in ``space``: its batch, strategy, lever and limit."""
        return cls(
            space.model, space.per_rank, space.loss_fn, space.device, space.strategy, space.world_size,
            progress=space.progress, lever=space.lever, axes=space.axes, layout=space.sharding,
            limit=space.limit, refine_limit=space.refine_limit, cpu_offload=bool(space.cpu_offload),
            mp_policy=space.mp_policy, blocks=space.blocks,
        )  # fmt: skip

    def sharded(self, precision: str) -> Sharding | None:
        """The FSDP2 layout of a step at ``precision`` (``None``: not sharded)."""
        if self.sharding is not None and self.mp_policy and precision == "bf16-mixed":
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
        key = Candidate(m, checkpointing, optimizer, precision)
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
        key = Candidate(m, checkpointing, optimizer, precision)
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
                (c.m, self.peak(c.m, mode, optimizer, precision).peak)
                for c, (_, mode) in self.compiled.items()
                if (c.optimizer, c.precision) == (optimizer, precision)
            ]
        wanted = (checkpointing, optimizer, precision)
        return [(c.m, b.peak) for c, b in self.cache.items() if c[1:] == wanted]

    def per_rank(self, breakdown: MemoryBreakdown, precision: str) -> MemoryBreakdown:
        """One rank's share of a whole step's ``breakdown`` (`shard`); FSDP2's is simulated as one rank's
        (with `cpu_offload`, what stays on the device)."""
        if self.sharding:
            return self.offloaded(breakdown, precision) if self.cpu_offload else breakdown
        grads = self._static(None, precision).gradients
        return shard(breakdown, self.strategy, self.world_size, gradient_bytes=grads)

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
                _fsdp2.shard_bytes(self.model, self.world_size, itemsize),
                _fsdp2.largest_unit_shard(self.model, blocks, self.world_size, itemsize),
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
        key = Candidate(m, AUTO, optimizer, precision)
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
            for candidate, breakdown in self.whole.items():
                if candidate.at(AUTO) == key:  # steps the search simulated already
                    self.planners[key].remember(self.planners[key].uniform(candidate.mode), breakdown)
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
        key = Candidate(m, COMPILE_BUDGET, optimizer, precision)
        if key not in self.compiled:
            assert self.limit is not None, "a compiled model's activation budget is planned for a limit"

            def simulate(budget: float | None) -> MemoryBreakdown:  # counted too (`peak`): the recompute
                return self.peak(m, "none" if budget is None else budget_label(budget), optimizer, precision)

            step = self.step(m, precision)
            try:
                plan = plan_compiled(self.model, self.micro_batch(m), self.limit, step, simulate)
            except ValueError:  # the lowest step tried stands for the micro-batch
                tried = [
                    (b.peak, c.mode)
                    for c, b in self.cache.items()
                    if c.at(COMPILE_BUDGET) == key and (c.mode == "none" or label_budget(c.mode) is not None)
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
        counts = self.counts.get(Candidate(m, mode, optimizer, precision))
        configured = self.counts.get(Candidate(m, "none", optimizer, precision))
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

    def offloading(self, on: bool) -> None:
        """Plan with FSDP2's CPU offload ``on`` or off from now: the steps simulated so far, one rank's
        share read again."""
        if self.cpu_offload != on:
            self.cpu_offload = on
            self.cache = {key: self.per_rank(whole, key.precision) for key, whole in self.whole.items()}

    def runnable(self, sizes: Sequence[int], optimizer: str | None, precision: str) -> list[int]:
        """``sizes`` from the smallest micro-batch the model's step accepts: BatchNorm refuses one sample per
        channel in training ("Expected more than 1 value per channel"), so such a model's plans start at 2.
        The step tried is counted too (`counted`): the offline cost is read from it."""
        for i, m in enumerate(sizes):
            try:
                self.counted(m, optimizer, precision)
            except ValueError as err:
                refused = err
                continue
            self.smallest = m
            return list(sizes[i:])
        tried = list(sizes)
        raise ValueError(f"The training step fails on every micro-batch of {tried}: {refused}") from refused

    def step_cost(self, cost: str | StepCost, optimizer: str | None, precision: str) -> StepCost:
        """The time model plans are ranked by (`plan_fit`'s ``cost``): given, timed on this machine, or
        counted from the smallest runnable step's FLOPs."""
        if isinstance(cost, StepCost):
            return cost
        cost = valid_name("cost", cost, ("auto", "measured", "flops"))
        real_cpu = model_device(self.model).type == "cpu"
        if cost == "measured" or (cost == "auto" and real_cpu and self.device == "cpu"):
            size = batch_size(self.batch, self.axes)
            small = self.smallest
            sizes = (small, max(small, min(4 * small, size)))
            return measured_cost(self.model, self.batch, loss_fn=self.loss_fn, sizes=sizes, axes=self.axes)
        flops, ops = self.counted(self.smallest, optimizer, precision)
        return flops_cost(flops, ops, self.smallest, self.device)

    def _report(self, line: str) -> None:
        elapsed = time.perf_counter() - self.started
        if self.progress is not None and elapsed >= PROGRESS_AFTER_S:
            self.progress(f"{line} ({len(self.cache)} steps simulated in {elapsed:.0f} s)")

    def static(self, optimizer: str | None, precision: str) -> int:
        """A lower bound of the peak: sharded parameters + gradients + optimizer state, no simulation."""
        if optimizer is None or self.cpu_offload:
            return 0
        try:
            return shard(self._static(optimizer, precision), self.strategy, self.world_size).static
        except ValueError:
            return 0

    def _static(self, optimizer: str | None, precision: str) -> MemoryBreakdown:
        static = model_static(self.model, precision, optimizer or "sgd")
        if self.lever == "offload":  # the state on the host, a parameter's gradient at a time
            return dataclasses.replace(static, gradients=0, optimizer_state=0)
        if self.lever == "fused_step":  # never all at once: a parameter's gradient at a time
            return dataclasses.replace(static, gradients=0)
        return static
