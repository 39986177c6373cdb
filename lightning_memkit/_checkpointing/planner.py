"""Activation checkpointing that fits a memory budget at the least recompute cost.

Users pick checkpointed layers by trial and error, or checkpoint every block and pay about a third more
compute. Here every candidate block gets one of the modes `apply_checkpointing` knows, and the cheapest
assignment whose whole-step peak fits the budget is chosen exactly, from measured figures: each block's
kept bytes ``R``, backward footprint ``X`` and recompute cost per mode, read inside one simulated step.

The peak model, with blocks ``1..n`` in execution order and ``G_i`` the bytes of block ``i``'s gradients:
the backward of block ``j`` holds the earlier blocks' kept tensors, its own footprint and the gradients of
the blocks after it; the loss and what follows the last block (a language model's logits and their
gradient) run while every block's kept tensors are held, so

    A(plan) = max( max_j  sum_{i<j} R_i(p_i) + X_j(p_j) + sum_{i>j} G_i,   sum_i R_i(p_i) + T )
    peak(plan) ~= C + A(plan)

Checkpointing the last block saves nothing during the blocks' backward (its activations come back at
once), but it does at the loss. ``C`` (the rest of the step: parameters, optimizer state...) and ``T``
(what the loss adds) are read from two simulated whole steps, without checkpointing and at the floor, the
peak with the strongest allowed mode on every block (a budget below the floor is an error): each constant
is the least that explains both peaks, so the model is exact at the two ends when the peak of one lies in
the blocks' backward and the other's at the loss.

The plan: a knapsack over blocks solved exactly by dynamic programming over the kept bytes so far
(Pareto-pruned, integer costs), minimising recompute cost under ``peak(plan) <= cap``; ties go to fewer
kept bytes, then to the lighter mode on the earliest block. The model errs both ways (it misses what
happens outside the blocks' backward, e.g. Lightning's gradients still live during the forward, and the
peak at the loss, where checkpointing the last block does save), so the simulated step decides: the DP's
plans for a rising cap are cheaper and peak higher, and the plan returned is the one at the highest cap
whose simulated peak fits, found by starting at ``cap = budget``, galloping towards the side not yet
simulated (cheaper plans while they fit, costlier ones while they miss) and bisecting the bracket. With an
accurate model that is two or three simulated steps; the floor's plan is the fallback. The peaks a plan
reports are simulated.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from lightning_memkit._breakdown import MemoryBreakdown, format_bytes
from lightning_memkit._budget import Budget, parse_budget
from lightning_memkit._checkpointing.blocks import LayerClasses, find_blocks, no_blocks_message
from lightning_memkit._checkpointing.checkpointers import MUTATED_NOTE
from lightning_memkit._checkpointing.compiled import plan_compiled
from lightning_memkit._checkpointing.costs import BlockCosts, BlockProfiler, OpTimer, block_options
from lightning_memkit._checkpointing.policies import (
    CHECKPOINT_MODES,
    BlockPlan,
    CheckpointHandle,
    CheckpointPlan,
    applied_modes,
    apply_plan,
    caching_configs,
    without_cache,
)
from lightning_memkit._estimating.compiled import compiled_modules
from lightning_memkit._estimating.repeated import repeated_blocks, truncated
from lightning_memkit._estimating.routing import ROUTING_ASSUMED, routed
from lightning_memkit._estimating.simulate import estimate_step
from lightning_memkit._measuring.storages import allocation_rounding, model_device
from lightning_memkit._step import Step
from lightning_memkit._vocabulary import AUTO, allowed_modes, unbudgeted_mode

__all__ = ["CheckpointPlanner", "plan_checkpointing"]

log = logging.getLogger(__name__)

#: Mode order for ties: the lighter mode (earlier in `CHECKPOINT_MODES`) wins.
_RANK = {name: i for i, name in enumerate(CHECKPOINT_MODES)}


# --------------------------------------------------------------------------------------------------
# The peak model and the DP
# --------------------------------------------------------------------------------------------------


def _activation_peak(blocks: Sequence[BlockCosts], choice: Sequence[str], tail: int = 0) -> int:
    """``A(plan) = max(max_j sum_{i<j} R_i + X_j + sum_{i>j} G_i, sum_i R_i + tail)`` (module docstring)."""
    return max(_backward_peak(blocks, choice), _kept(blocks, choice) + tail)


def _backward_peak(blocks: Sequence[BlockCosts], choice: Sequence[str]) -> int:
    """The first term of ``A(plan)``: the highest point of the blocks' backward."""
    grads_after = _suffix_grads(blocks)
    kept, worst = 0, 0
    for j, (block, name) in enumerate(zip(blocks, choice, strict=True)):
        option = block.options[name]
        worst = max(worst, kept + option.footprint + grads_after[j])
        kept += option.retained
    return worst


def _kept(blocks: Sequence[BlockCosts], choice: Sequence[str]) -> int:
    """``sum_i R_i``: what every block keeps for its backward, all held when the loss runs."""
    return sum(block.options[name].retained for block, name in zip(blocks, choice, strict=True))


def _suffix_grads(blocks: Sequence[BlockCosts]) -> list[int]:
    after, total = [], 0
    for block in reversed(blocks):
        after.append(total)
        total += block.grads
    return after[::-1]


def _solve(
    blocks: Sequence[BlockCosts], cap: float, modes: Sequence[str], tail: int = 0
) -> tuple[str, ...] | None:
    """The cheapest choice of modes with ``A(plan) <= cap`` (``tail`` as `_activation_peak` takes it),
    exactly; ``None`` if there is none.

    Dynamic programming over the blocks in execution order; the state is the bytes kept by the blocks so
    far (all the future depends on), and a state is dropped when another keeps no more bytes at no more
    cost. Ties: fewer kept bytes, then the lighter mode on the earliest block.
    """
    grads_after = _suffix_grads(blocks)
    # kept bytes -> (cost, mode ranks, mode names)
    states: dict[int, tuple[int, tuple[int, ...], tuple[str, ...]]] = {0: (0, (), ())}
    for j, block in enumerate(blocks):
        new: dict[int, tuple[int, tuple[int, ...], tuple[str, ...]]] = {}
        for kept, (cost, ranks, names) in states.items():
            for name in modes:
                option = block.options.get(name)
                if option is None:  # a mode the block cannot run under (`BlockCosts.refused`)
                    continue
                if kept + option.footprint + grads_after[j] > cap:
                    continue
                state = (cost + option.cost, (*ranks, _RANK[name]), (*names, name))
                key = kept + option.retained
                if key not in new or state[:2] < new[key][:2]:
                    new[key] = state
        states = {}
        best_cost = math.inf
        for kept in sorted(new):  # Pareto front: more kept bytes must buy a lower cost
            if new[kept][0] < best_cost:
                states[kept] = new[kept]
                best_cost = new[kept][0]
        if not states:
            return None
    feasible = [
        (cost, kept, ranks, names) for kept, (cost, ranks, names) in states.items() if kept + tail <= cap
    ]
    return min(feasible)[3] if feasible else None


# --------------------------------------------------------------------------------------------------
# Planning
# --------------------------------------------------------------------------------------------------


def plan_checkpointing(
    model: nn.Module,
    batch: Any,
    budget: int | float | str | Budget | None = None,
    *,
    checkpointing: str | Sequence[str] = AUTO,
    blocks: LayerClasses | None = None,
    cost: str = "measured",
    device: str | torch.device | None = None,
    **estimate_kwargs: Any,
) -> CheckpointPlan:
    """The cheapest checkpointing plan whose simulated whole-step peak fits ``budget``.

    Args:
        model: a ``LightningModule`` or an ``nn.Module``, as `estimate_memory` takes it (a plain module needs
            ``optimizer=`` and ``loss_fn=``). It is left unchanged: nothing stays applied, and the model
            only runs in `estimate_memory`'s simulated steps, on fake tensors.
        batch: one training batch (only shapes and dtypes are read).
        budget: the whole step's peak to fit, as `parse_budget` reads it: bytes, a size (``"6GiB"``,
            ``"24GB"``), a GPU name (``"A100-40GB"``, ``"H200"``: the card's memory less the CUDA context
            and a 5 % reserve), or a fraction of the current CUDA device (``0.9``) or ``"auto"`` (these
            two need one). ``None``: no search; every block gets ``"selective"`` (``checkpointing="auto"``) or
            the strongest mode allowed, with its figures.
        checkpointing: the modes each block may get: ``"auto"`` (all four), ``"selective"`` /
            ``"selective_half"`` / ``"full"`` (that one or none), or the modes themselves, ``"none"`` among
            them (``("none", "selective", "full")``).
        blocks: layer classes whose instances are the candidates (default: `find_blocks`).
        cost: what the DP minimises for the recomputed ops: ``"measured"`` (their time, benchmarked op by
            op on the device; ``"flops"`` when that device is not present) or ``"flops"`` (FLOP formulas
            for matmuls and attention, elements written for other ops).
        device: the device type the run will use, ``"cuda"`` or ``"cpu"`` (default: the model's; ``"cuda"``
            for a model on the meta device).
        estimate_kwargs: passed to `estimate_memory`: ``optimizer``, ``loss_fn``, ``precision``,
            ``accumulating``; ``strategy="fsdp2"`` and ``world_size``: the plan fits one rank's FSDP2 step
            (the blocks' costs are profiled on one device, every plan's step simulated sharded).

    A model with compiled modules (``torch.compile(module)``, ``module.compile()``) is simulated compiled
    (`_estimating.compiled`) and planned with torch.compile's own lever, its partitioner's
    ``activation_memory_budget`` (`_checkpointing.compiled`): as configured where its step fits, otherwise
    the highest budget below it, a tenth at a time, whose step fits; the plan names it, and applying the
    plan sets it.

    Returns:
        A `CheckpointPlan`; ``print(plan)`` shows it as a table. Apply it with `apply_checkpointing`.

    Raises:
        ValueError: no candidate blocks; or a budget below the peak of full checkpointing (the message
            gives that floor and what else would lower it), or below every compiled step the activation
            budgets give.
    """
    limit = None if budget is None else parse_budget(budget)  # a bad budget fails before any simulation
    if limit is not None and compiled_modules(model):
        step, run = Step.split(estimate_kwargs, caller="plan_checkpointing")
        target = torch.device(device).type if device is not None else model_device(model).type
        plan = plan_compiled(model, batch, limit.usable, step, **run, device=target)
    else:
        planner = CheckpointPlanner(
            model,
            batch,
            checkpointing=checkpointing,
            blocks=blocks,
            cost=cost,
            device=device,
            **estimate_kwargs,
        )
        plan = planner.plan(limit)
    return dataclasses.replace(plan, note=ROUTING_ASSUMED) if routed(model) else plan


class CheckpointPlanner:
    """Plans for one model and batch, sharing the profile and the simulated steps between budgets.

    ``CheckpointPlanner(model, batch, ...).plan(budget)`` is `plan_checkpointing`; keep the planner to ask
    for several budgets (a memory/time curve) at a few simulated steps per new plan. Arguments as there,
    plus ``max_rounds``: how many new plans one budget may simulate; the search then keeps the cheapest plan
    that fitted (the floor's plan if none did).
    """

    def __init__(
        self,
        model: nn.Module,
        batch: Any,
        *,
        checkpointing: str | Sequence[str] = AUTO,
        blocks: LayerClasses | None = None,
        cost: str = "measured",
        device: str | torch.device | None = None,
        max_rounds: int = 8,
        **estimate_kwargs: Any,
    ) -> None:
        modes = planned_modes(checkpointing)
        if cost not in ("measured", "flops"):
            raise ValueError(f"Unknown cost {cost!r}; choose 'measured' or 'flops'")
        target = torch.device(torch.device(device).type if device is not None else model_device(model).type)
        if cost == "measured" and target.type == "cuda" and not torch.cuda.is_available():
            log.info("No CUDA device to time the recomputed ops on: cost='flops' instead.")
            cost = "flops"
        found = find_blocks(model, blocks)
        if not found:
            raise ValueError(no_blocks_message(model, "plan_checkpointing(..., blocks={MyBlock})", blocks))
        self.model, self.batch, self.cost = model, batch, cost
        #: The mode every block gets without a budget (`unbudgeted_mode`).
        self.unbudgeted = unbudgeted_mode(checkpointing)
        self.max_rounds = max_rounds
        self.modes = modes
        #: The step every plan is simulated in (`Step`), and the rest of `estimate_memory`'s arguments.
        self.step, run = Step.split(estimate_kwargs, caller="plan_checkpointing")
        self.run = {**run, "device": target.type}
        self._simulated: dict[tuple[str, ...], MemoryBreakdown] = {}
        self._model: tuple[int, int] | None = None  # the peak model's (offset, tail), once calibrated

        # Profile every distinct block inside one simulated step (the step's own result is not used), with
        # Hugging Face's key/value cache off: every plan that checkpoints a block runs so (apply_checkpointing
        # turns it off), and the block options are only read for such plans.
        profiler = BlockProfiler(found, self.modes, rounding=allocation_rounding(target))
        # A sharded step (``strategy="fsdp2"``) runs on a sharded copy the profiler's hooks are not on: the
        # blocks are profiled on one device (their activations are a rank's either way), and every plan's
        # step is simulated sharded.
        unsharded = self.step.but(sharding=None)
        repeated = repeated_blocks(model)
        if repeated is not None and list(repeated[0]) != [m for _, m in found]:  # others named (`blocks`)
            repeated = None
        with self._bare(), without_cache(model), profiler.hooks(), torch.random.fork_rng(devices=[]):
            if repeated is None:
                estimate_step(model, batch, unsharded, **self.run)
            # copies of one block (`_estimating.repeated`): the first two are profiled, the rest are alike
            else:
                with truncated(repeated[0], 2):
                    estimate_step(model, batch, unsharded, **self.run)
                profiler.alike([name for name, _ in found])
        if not profiler.order:
            raise ValueError(f"None of the {len(found)} candidate blocks ran in the training step.")
        timer = OpTimer(target) if cost == "measured" else None
        options = {sig: block_options(runs, cost, timer) for sig, runs in profiler.runs.items()}
        if timer is not None and timer.failed:
            log.info("Not timed (counted as free): %s", ", ".join(sorted(map(str, timer.failed))))
        self.blocks = [
            BlockCosts(
                name,
                options[profiler.signature[name]][0],
                profiler.grads[name],
                frozenset(profiler.refused[profiler.signature[name]]),
            )
            for name in profiler.order
        ]
        self.names = [b.name for b in self.blocks]
        #: The blocks' forward+backward cost without checkpointing, in the DP's units.
        self.baseline = sum(options[profiler.signature[name]][1] for name in profiler.order)

    def _estimate(self) -> MemoryBreakdown:
        return estimate_step(self.model, self.batch, self.step, **self.run)

    def _bare(self) -> CheckpointHandle:
        """Remove any checkpointing `apply_checkpointing` left on the model, while planning."""
        return apply_plan(self.model, {name: "none" for name in applied_modes(self.model)}, announce=False)

    def simulate(self, choice: Sequence[str]) -> MemoryBreakdown:
        """The simulated step's breakdown with ``choice`` (one mode per block, in `names` order).

        As the plan will run: a choice that checkpoints a block runs with Hugging Face's key/value cache off
        (`apply_checkpointing` turns it off), one that checkpoints nothing with the model's own setting.
        """
        choice = tuple(choice)
        if choice not in self._simulated:
            plan = dict(zip(self.names, choice, strict=True))
            with self._bare(), apply_plan(self.model, plan, announce=False):
                self._simulated[choice] = self._estimate()
        return self._simulated[choice]

    def remember(self, choice: Sequence[str], breakdown: MemoryBreakdown) -> None:
        """Take ``breakdown`` as the simulated step of ``choice``, simulated elsewhere (as `simulate` would:
        the same model, batch and estimate arguments, the plan applied with `apply_checkpointing`)."""
        self._simulated.setdefault(tuple(choice), breakdown)

    def _peak_none_without_cache(self, peak_none: int) -> int:
        """The peak without checkpointing as the plans that checkpoint see the rest of the step: with
        Hugging Face's key/value cache off (``peak_none`` itself where the model has none on)."""
        if not caching_configs(self.model):
            return peak_none
        key = ("none, without cache",)
        if key not in self._simulated:
            with self._bare(), without_cache(self.model):
                self._simulated[key] = self._estimate()
        return self._simulated[key].peak

    def uniform(self, mode: str) -> tuple[str, ...]:
        """``mode`` on every block that can run under it, the next stronger mode on the others."""
        return tuple(b.allowed(mode) for b in self.blocks)

    def overhead(self, choice: Sequence[str]) -> float:
        """The recompute cost of ``choice`` as a fraction of the blocks' forward+backward cost without
        checkpointing (a plan's ``overhead``)."""
        spent = sum(b.options[c].cost for b, c in zip(self.blocks, choice, strict=True))
        return spent / self.baseline if self.baseline else 0.0

    def plan(
        self,
        budget: int | float | str | Budget | None = None,
        *,
        modes: Sequence[str] | None = None,
    ) -> CheckpointPlan:
        """The cheapest plan whose simulated peak fits ``budget`` (see `plan_checkpointing`); ``modes``: the
        modes a block may get, a subset of the planner's (``("selective_half", "full")``: every block is
        checkpointed, one way or the other)."""
        modes = self.modes if modes is None else tuple(m for m in self.modes if m in modes)
        if not modes:
            raise ValueError(f"modes must name some of the planner's modes {self.modes}")
        limit = None if budget is None else parse_budget(budget).usable
        peak_none = self.simulate(self.uniform("none")).peak
        if limit is None:
            choice = self.uniform(self.unbudgeted if self.unbudgeted in modes else modes[-1])
        else:
            floor = self.simulate(self.uniform(modes[-1]))
            if limit < floor.peak:
                raise ValueError(_floor_message(limit, floor, modes[-1], len(self.blocks), peak_none))
            choice = self._fit(limit, peak_none, modes)
        return self.plan_for(choice, limit)

    def modeled_peak(self, choice: Sequence[str]) -> int | None:
        """The peak model's figure for ``choice`` (module docstring), once a plan for a budget has
        calibrated it; ``None`` before."""
        if self._model is None:
            return None
        offset, tail = self._model
        return offset + _activation_peak(self.blocks, tuple(choice), tail)

    def plan_for(self, choice: Sequence[str], budget: int | None = None) -> CheckpointPlan:
        """``choice`` (one mode per block, in `names` order) as a `CheckpointPlan`, with its simulated
        peak and the blocks' measured figures; ``budget``: the limit it was chosen for, in bytes."""
        choice = tuple(choice)
        breakdown = self.simulate(choice)
        full = self._simulated.get(self.uniform("full"))
        return CheckpointPlan(
            blocks=tuple(
                BlockPlan(
                    name=b.name,
                    mode=c,
                    saved_bytes=b.options["none"].retained - b.options[c].retained,
                    recompute_flops=b.options[c].flops,
                    recompute_time=b.options[c].seconds,
                    note=_refused_note(b, c),
                )
                for b, c in zip(self.blocks, choice, strict=True)
            ),
            budget=budget,
            peak=breakdown.peak,
            peak_none=self.simulate(self.uniform("none")).peak,
            peak_full=full.peak if full is not None else None,
            overhead=self.overhead(choice),
            cost=self.cost,
            breakdown=breakdown,
        )

    def _calibrate(self, peak_none: int, peak_floor: int, floor_level: str) -> tuple[int, int]:
        """``C`` and ``T`` of the peak model (module docstring), as ``(C, T - C)``: the offset and the
        ``tail`` that `_activation_peak` and `_solve` take.

        ``peak_none`` is the step without checkpointing as the plans that checkpoint see the rest of the
        step (Hugging Face's cache off), ``peak_floor`` the floor's (``floor_level`` on every block). Each
        of the two terms of the model is at most the simulated peak, at both ends; each constant is the
        largest that keeps it so.
        """
        none, floor = self.uniform("none"), self.uniform(floor_level)
        backward = min(
            peak_none - _backward_peak(self.blocks, none), peak_floor - _backward_peak(self.blocks, floor)
        )
        at_loss = min(peak_none - _kept(self.blocks, none), peak_floor - _kept(self.blocks, floor))
        return backward, at_loss - backward

    def _fit(self, limit: int, peak_none: int, modes: tuple[str, ...]) -> tuple[str, ...]:
        """The DP's plan at the highest cap whose simulated peak fits ``limit``.

        ``plan_at(cap)``, the cheapest plan whose modeled peak is at most ``cap``, gets cheaper as the cap
        rises, and its simulated peak higher. The search starts at ``cap = limit`` (where an accurate model
        puts the answer), gallops away from it, doubling the step, until a cap whose plan fits lies below
        one whose plan misses, and bisects between them. A plan is simulated only when it differs from the
        plans at both ends of the bracket, and at most `max_rounds` new plans are; the caps searched run
        from the floor's modeled peak up, so the floor's plan (simulated: it fits) is the fallback.
        """
        floor = self.uniform(modes[-1])
        peak_floor = self.simulate(floor).peak
        offset, tail = self._calibrate(self._peak_none_without_cache(peak_none), peak_floor, modes[-1])
        self._model = (offset, tail)
        solved: dict[float, tuple[str, ...]] = {}

        def plan_at(cap: float) -> tuple[str, ...]:
            if cap not in solved:
                choice = _solve(self.blocks, cap - offset, modes, tail)
                assert choice is not None, "no cap below the floor's modeled peak is searched"
                solved[cap] = choice
            return solved[cap]

        new = 0

        def fits(choice: tuple[str, ...]) -> bool:
            nonlocal new
            new += choice not in self._simulated
            return self.simulate(choice).peak <= limit

        # The floor's plan qualifies from here up.
        bottom = offset + _activation_peak(self.blocks, floor, tail)
        cheapest = plan_at(math.inf)
        top = offset + _activation_peak(self.blocks, cheapest, tail)
        if fits(cheapest):
            return cheapest
        cap, step = max(bottom, min(limit, top - 1)), 1
        lo: int | None = None  # a cap whose plan fits
        hi = top  # a cap whose plan misses
        if fits(plan_at(cap)):
            lo = cap
            while hi - lo > 1 and new < self.max_rounds:  # cheaper plans, while they fit
                cap, step = min(lo + step, hi - 1), 2 * step
                if plan_at(cap) == plan_at(lo) or fits(plan_at(cap)):
                    lo = cap
                else:
                    hi = cap
                    break
        else:
            hi = cap
            while hi > bottom and new < self.max_rounds:  # costlier plans, until one fits
                cap, step = max(hi - step, bottom), 2 * step
                if plan_at(cap) != plan_at(hi) and fits(plan_at(cap)):
                    lo = cap
                    break
                hi = cap
            if lo is None:
                return floor
        while hi - lo > 1 and new < self.max_rounds:
            mid = (lo + hi) // 2
            choice = plan_at(mid)
            if choice == plan_at(lo) or (choice != plan_at(hi) and fits(choice)):
                lo = mid
            else:
                hi = mid
        log.debug("plan %s fits %d (%d plans simulated)", plan_at(lo), limit, len(self._simulated))
        return plan_at(lo)


def _floor_message(limit: int, floor: MemoryBreakdown, mode: str, n: int, peak_none: int) -> str:
    hint = "" if mode == "full" else " or allow full checkpointing (checkpointing='auto'),"
    return (
        f"The budget of {format_bytes(limit)} ({limit:,} bytes) is below what activation checkpointing can "
        f"reach: {mode} checkpointing of all {n} blocks peaks at {format_bytes(floor.peak)} "
        f"({floor.peak:,} bytes; {format_bytes(peak_none)} without checkpointing). At that peak: "
        f"{floor.in_words()}. To go lower, shrink what checkpointing cannot: a smaller "
        "micro-batch (with gradient accumulation to keep the effective batch), a lighter optimizer "
        f"(8-bit AdamW, Adafactor, SGD), or lower precision (bf16-true);{hint} or raise the budget."
    )


def _refused_note(block: BlockCosts, mode: str) -> str:
    """Why ``block`` got ``mode`` and not a lighter one it was offered (`MUTATED_NOTE`); ``""``."""
    order = CHECKPOINT_MODES.index
    refused = sorted((m for m in block.refused if order(m) < order(mode)), key=order)
    return MUTATED_NOTE.format(mode=" and ".join(refused), instead=mode) if refused else ""


def planned_modes(checkpointing: str | Sequence[str]) -> tuple[str, ...]:
    """`allowed_modes`, with ``"none"`` among them: the planner's search starts from the model as written."""
    modes = allowed_modes(checkpointing)
    if "none" not in modes:
        raise ValueError(
            f"checkpointing must include 'none' when it names modes (the plan starts from the model as "
            f"written): got {tuple(checkpointing)!r}; give ('none', {', '.join(map(repr, modes))})"
        )
    return modes
