"""What `plan_fit` returns, and the throughput model it ranks plans by.

A `FitPlan` is plain data: the micro-batch, accumulation, checkpointing (block by block), optimizer and
precision of a run that fits, with every configuration simulated on the way as `Alternative` rows. It
applies itself to a LightningModule (`FitPlan.apply`) and steps down one notch after an OOM
(`FitPlan.leaner`). `StepCost` is the time of a micro-step, measured on the device or counted from FLOPs.
"""

from __future__ import annotations

import contextlib
import statistics
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from torch import nn

from lightning_memkit._breakdown import format_bytes
from lightning_memkit._budget import Budget
from lightning_memkit._checkpointing.compiled import COMPILE_BUDGET, label_budget
from lightning_memkit._checkpointing.policies import CHECKPOINT_MODES, CheckpointPlan, apply_checkpointing
from lightning_memkit._diagnosis.report import render_table
from lightning_memkit._estimating.isolate import isolated
from lightning_memkit._estimating.lightning_step import (
    SampleAxes,
    batch_slice,
    is_lightning,
    lightning_stand_ins,
    loss_of,
)
from lightning_memkit._measuring.storages import model_device
from lightning_memkit._optimizers.schedulers import rebind_scheduler
from lightning_memkit._optimizers.swap import identify, lr_factor, swap_optimizer
from lightning_memkit._step import LEVER_CALLBACKS, valid_lever

__all__ = ["Alternative", "FitPlan", "StepCost", "flops_cost", "measured_cost"]

#: Seconds of overhead per op of a micro-step (kernel launch + dispatch), for offline plans.
LAUNCH_SECONDS: dict[str, float] = {"cuda": 10e-6, "cpu": 5e-6}
#: Sustained FLOP/s assumed for offline plans: an A100-class GPU in bf16, a few CPU cores.
DEVICE_FLOPS: dict[str, float] = {"cuda": 150e12, "cpu": 50e9}
#: The line under `FitPlan`'s table that says what its terse columns mean.
COLUMNS_LEGEND = (
    "m: the micro-batch, the DataLoader's batch_size on each GPU; accumulate: "
    "Trainer(accumulate_grad_batches); m x accumulate: the global batch per GPU"
)
#: `FitPlan.leaner`'s note on a plan the search did not simulate
_NOT_SIMULATED = "its peak not simulated: at most the previous plan's"


# --------------------------------------------------------------------------------------------------
# Cost model
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepCost:
    """Seconds of one micro-step: ``fixed + per_sample * m * (1 + recompute)``, and ``per_step`` once per
    global batch.

    ``recompute`` is what checkpointing adds: the recomputed ops' cost as a fraction of the checkpointed
    blocks' forward + backward, as the checkpointing planner measures it for the plan
    (`CheckpointPlan.overhead`: 0 without checkpointing, about 1/3 for full checkpointing of every block).

    Attributes:
        fixed: per-micro-step overhead in seconds (launches, Python, the loss).
        per_sample: seconds per sample of forward + backward without checkpointing.
        source: ``"measured"`` (timed on the device) or ``"flops"`` (counted, offline).
        per_step: seconds added once per global batch: an offloaded optimizer's transfers and host update
            (`transfer_seconds`; its per-micro-batch share is in ``fixed``); the optimizer's own step on the
            device is the same for every plan and left out.
    """

    fixed: float
    per_sample: float
    source: str = "flops"
    per_step: float = 0.0

    def time(self, micro_batch_size: int, accumulate: int, recompute: float = 0.0) -> float:
        """Seconds of one global batch (per rank)."""
        micro = self.fixed + self.per_sample * micro_batch_size * (1 + recompute)
        return accumulate * micro + self.per_step


def flops_cost(flops: int, ops: int, m: int, device: str) -> StepCost:
    """`StepCost` from a simulated step of ``m`` samples without checkpointing, its ``flops`` counted by
    ``torch.utils.flop_counter`` and its forward and backward ``ops``: FLOPs / `DEVICE_FLOPS` per sample,
    ops x `LAUNCH_SECONDS` per micro-step."""
    return StepCost(ops * LAUNCH_SECONDS[device], flops / m / DEVICE_FLOPS[device], "flops")


def measured_cost(
    model: nn.Module,
    batch: Any,
    *,
    loss_fn: Callable | None = None,
    sizes: tuple[int, int] = (1, 4),
    axes: SampleAxes | None = None,
) -> StepCost:
    """`StepCost` from timing real forward + backward passes at two micro-batch sizes (median of 3 each).

    No optimizer step is taken, and the passes run `isolated`: the model's gradients, buffers (BatchNorm
    statistics), train/eval flags, torchmetrics states and public list/dict attributes, and the RNG
    streams dropout draws from, are put back as they were. Sizes that are equal (a batch of one sample)
    give a cost that is all per sample. ``axes``: the batch's sample dimensions (`SampleAxes`).
    """

    lightning = is_lightning(model)

    def once(m: int) -> float:
        part = batch_slice(batch, m, axes=axes)
        start = time.perf_counter()
        if lightning:
            loss = loss_of(model.training_step(part, 0))
        else:
            inputs, target = part
            loss = loss_fn(model(inputs), target)  # type: ignore[misc]
        loss.backward()
        for p in model.parameters():
            p.grad = None
        if next(model.parameters()).device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    small, large = sizes
    stand_ins = lightning_stand_ins(model, model_device(model)) if lightning else contextlib.nullcontext()
    with isolated(model, "AutoFit's timing"), stand_ins, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        once(small)  # warm-up: first-call allocations and kernel selection
        times = {m: statistics.median(once(m) for _ in range(3)) for m in {small, large}}
    if large == small:  # nothing to tell the fixed part from the per-sample one
        return StepCost(0.0, times[small] / small, "measured")
    per_sample = max((times[large] - times[small]) / (large - small), 1e-9)
    return StepCost(max(times[small] - per_sample * small, 0.0), per_sample, "measured")


# --------------------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Alternative:
    """One simulated configuration. ``peak`` is one rank's step peak in bytes; ``time`` is relative to the
    chosen plan's (1.0; larger is slower), ``step_seconds`` the same in seconds per global batch (per rank,
    by the plan's `StepCost`); both ``None`` for configurations without a cost (another optimizer or
    precision)."""

    micro_batch_size: int
    accumulate_grad_batches: int
    checkpointing: str
    optimizer: str | None
    precision: str
    peak: int
    time: float | None
    fits: bool
    step_seconds: float | None = None


@dataclass(frozen=True)
class FitPlan:
    """How to run a training step within a memory budget. Bytes are ints.

    Attributes:
        micro_batch_size: samples per forward/backward (per rank): the dataloader's batch size.
        accumulate_grad_batches: micro-batches per optimizer step; ``micro_batch_size *
            accumulate_grad_batches`` is the per-rank global batch.
        checkpointing: the checkpointing mode of every repeated block (``"none"``, ``"selective"``,
            ``"selective_half"``, ``"full"``) or, where the blocks' modes differ, a summary of them
            (``"2 selective, 2 full"``); `checkpoint_plan` then has the mode of each block. A compiled
            model's blocks are not wrapped: ``"compile budget 0.5"`` names torch.compile's
            ``activation_memory_budget`` its `checkpoint_plan` sets (`CheckpointPlan.compile_budget`).
        optimizer: the `CATALOGUE` name of the optimizer to train with; ``None``:
            whatever ``configure_optimizers`` returns (an optimizer the catalogue does not know).
        precision: the Lightning precision string the plan was simulated with.
        estimated_peak: one rank's simulated step peak with the plan.
        budget: the `Budget` planned for; the plan keeps ``estimated_peak <= budget.usable * (1 - margin)``.
        margin: the reserve kept below ``budget.usable``, as a fraction.
        alternatives: every configuration simulated, as `Alternative` rows.
        strategy: Lightning's strategy name (``"ddp"``, ``"fsdp"``, ``"deepspeed_stage_2"``, ...),
            ``"fsdp2"``, or ``"fsdp_shard_grad_op"`` (``FSDPStrategy(sharding_strategy="SHARD_GRAD_OP")``);
            ``"auto"`` for one GPU.
        world_size: ranks the global batch is split across.
        cost: the throughput model the times came from.
        modes: the checkpointing modes that were candidates (``("none",)`` for a model without
            repeated blocks, which cannot be checkpointed; ``("none", "compile budget")`` for a compiled
            model); `leaner` keeps to them.
        note: why some modes asked for were not candidates (``""`` when all were); `summary` shows it.
        checkpoint_plan: the checkpointing planner's plan, block by block, with its measured savings and
            recompute cost (`CheckpointPlan`); ``None`` where every block has the mode `checkpointing` names.
        lever: what changes the step the plan was made for, as `Step` says it (``"release_gradients"``,
            ``"fused_step"``, ``"offload"``), or ``None``; `lever_callback` names the callback that makes
            it in a Trainer.
        host_bytes: host memory the plan needs besides the device's: an offloaded optimizer's fp32
            masters, their gradients and its state (0 without offloading).
        offload_seconds: of the time per global batch, what the offloaded optimizer adds (transfers and
            the host's update, `transfer_seconds`).
        reshard_after_forward: FSDP2's ``fully_shard`` option for every unit (``strategy="fsdp2"``):
            ``False`` where the step fits keeping each unit's parameters gathered from its forward to its
            backward (no all-gather in backward); ``None`` for the other strategies.
        cpu_offload: FSDP2's ``CPUOffloadPolicy`` (``strategy="fsdp2"``): the sharded parameters, their
            gradients and the optimizer state in host memory (`host_bytes`, about), because nothing fit
            without it; its device peak is an upper bound (see `plan_fit`).
        mp_policy: FSDP2's ``MixedPrecisionPolicy(param_dtype=torch.bfloat16,
            reduce_dtype=torch.float32)`` on every unit (a ``bf16-mixed`` plan of `AutoFitStrategy`).
        device: the device type the step was simulated for: ``"cuda"`` (the caching allocator's 512-byte
            blocks, foreach optimizers) or ``"cpu"``.
        tensor_parallel_size: FSDP2's layout (``strategy="fsdp2"``): the ranks of a tensor-parallel group
            (each block's projections split, torchtitan's plan); `data_parallel_size` ranks take a batch.
        replicate_size: HSDP's replicas of the data-parallel ranks (1: FSDP2 over them all); each
            parameter is sharded over ``data_parallel_size // replicate_size`` ranks.
    """

    micro_batch_size: int
    accumulate_grad_batches: int
    checkpointing: str
    optimizer: str | None
    precision: str
    estimated_peak: int
    budget: Budget
    margin: float = 0.1
    alternatives: tuple[Alternative, ...] = ()
    strategy: str = "auto"
    world_size: int = 1
    cost: StepCost | None = field(default=None, compare=False)
    modes: tuple[str, ...] = field(default=CHECKPOINT_MODES, compare=False)
    note: str = field(default="", compare=False)
    checkpoint_plan: CheckpointPlan | None = None
    lever: str | None = None
    host_bytes: int = 0
    offload_seconds: float = 0.0
    reshard_after_forward: bool | None = None
    cpu_offload: bool = False
    mp_policy: bool = False
    device: str = "cuda"
    tensor_parallel_size: int = 1
    replicate_size: int = 1

    def __post_init__(self) -> None:
        valid_lever(self.lever)

    @property
    def limit(self) -> int:
        """Bytes the step's peak may reach: ``budget.usable * (1 - margin)``."""
        return int(self.budget.usable * (1 - self.margin))

    @property
    def global_batch_size(self) -> int:
        """Samples per optimizer step across all ranks (a tensor-parallel group shares its batch)."""
        return self.micro_batch_size * self.accumulate_grad_batches * self.data_parallel_size

    @property
    def data_parallel_size(self) -> int:
        """The ranks that each take their own batch: ``world_size // tensor_parallel_size``."""
        return self.world_size // self.tensor_parallel_size

    @property
    def lever_callback(self) -> str | None:
        """The callback that makes `lever` in a Trainer (``"GradientRelease"``, ``"FusedOptimizerStep"``,
        ``"OptimizerOffload"``), or ``None``."""
        return None if self.lever is None else LEVER_CALLBACKS[self.lever]

    @property
    def layout(self) -> str:
        """The parallel layout in words: ``"FSDP2 4"``, ``"TP 2 x FSDP2 2"``, ``"HSDP 2 x 2"``,
        ``"TP 2 x HSDP 2 x 2"``; the strategy's name for one that is not FSDP2's."""
        if self.strategy != "fsdp2":
            return self.strategy
        shard = self.data_parallel_size // self.replicate_size
        data = f"HSDP {self.replicate_size} x {shard}" if self.replicate_size > 1 else f"FSDP2 {shard}"
        return f"TP {self.tensor_parallel_size} x {data}" if self.tensor_parallel_size > 1 else data

    @property
    def compile_budget(self) -> float | None:
        """A compiled model's plan: the torch.compile ``activation_memory_budget`` it runs at (its
        `checkpointing` reads ``"compile budget 0.9"``); ``None`` otherwise."""
        return label_budget(self.checkpointing)

    @property
    def checkpointing_asked(self) -> tuple[str, ...]:
        """The ``checkpointing=`` that plans with `modes` again (`plan_fit`, `AutoFit`): a compiled model's
        ``"compile budget"`` is what any mode but ``"none"`` is planned as."""
        asked = tuple(mode for mode in self.modes if mode in CHECKPOINT_MODES)
        return (*asked, "full") if COMPILE_BUDGET in self.modes else asked

    def leaner(self, modes: Sequence[str] = CHECKPOINT_MODES) -> FitPlan | None:
        """The next plan one notch leaner (after an OOM): every block at the next mode allowed (``modes``)
        stronger than the strongest the plan uses, at the same micro-batch (a per-block plan that already
        uses the strongest: that mode on every block), else half the micro-batch (the largest divisor of
        it at most half) with accumulation multiplied to keep the global batch, checkpointing unchanged;
        ``None`` at micro-batch 1 with the strongest mode allowed. Its ``estimated_peak`` is the alternative's
        of the same plan where the search simulated one; otherwise it is not simulated now, and the current
        peak stands for it (a bound: a leaner plan peaks no higher), as its ``note`` says."""
        allowed = [mode for mode in CHECKPOINT_MODES if mode in modes and mode in self.modes]
        used = set(self.checkpoint_plan.modes.values()) if self.checkpoint_plan else {self.checkpointing}
        if self.compile_budget is not None or not used:  # a compiled model's: its activation budget kept,
            used = {"none"}  # at half the micro-batch (a lower one need not be leaner: not monotonic)
        strongest = max(CHECKPOINT_MODES.index(mode) for mode in used)
        # Every block at the next mode stronger than the strongest in use; a per-block plan that already
        # uses the strongest mode allowed gets it on every block.
        rank = CHECKPOINT_MODES.index
        stronger = [m for m in allowed if rank(m) > strongest] or [
            m for m in allowed if rank(m) == strongest and used != {m}
        ]
        if stronger:
            return self._with_peak(replace(self, checkpointing=stronger[0], checkpoint_plan=None))
        m = self.micro_batch_size
        smaller = max((d for d in range(1, m // 2 + 1) if m % d == 0), default=None)
        if smaller is None:
            return None
        return self._with_peak(
            replace(
                self,
                micro_batch_size=smaller,
                accumulate_grad_batches=self.accumulate_grad_batches * (m // smaller),
            )
        )

    def _with_peak(self, leaner: FitPlan) -> FitPlan:
        """``leaner`` with the peak the search simulated for it, or a note that it was not simulated."""
        key = (leaner.micro_batch_size, leaner.checkpointing, leaner.optimizer, leaner.precision)
        peak = next(
            (a.peak for a in self.alternatives
             if (a.micro_batch_size, a.checkpointing, a.optimizer, a.precision) == key),
            None,
        )  # fmt: skip
        notes = [n for n in leaner.note.split("; ") if n and n != _NOT_SIMULATED]
        if peak is not None:
            return replace(leaner, estimated_peak=peak, note="; ".join(notes))
        return replace(leaner, note="; ".join([*notes, _NOT_SIMULATED]))

    def apply(self, module: nn.Module) -> _Applied:
        """Checkpoint ``module``'s blocks and make its ``configure_optimizers`` return the plan's optimizer.

        The micro-batch and accumulation are the Trainer's and the dataloader's to set (`AutoFit` does
        both). Returns a handle whose ``remove()`` undoes both changes.
        """
        applied = _Applied(module)
        checkpointing = self.checkpoint_plan or self.checkpointing
        if self.compile_budget is not None:  # a compiled model's (an alternative's row has no plan)
            checkpointing = CheckpointPlan(blocks=(), compile_budget=self.compile_budget)
        applied.checkpointing = apply_checkpointing(module, checkpointing)
        configure = getattr(module, "configure_optimizers", None)
        if self.optimizer is not None and callable(configure):
            module.__dict__["configure_optimizers"] = _swapped_configure(configure, self.optimizer)
            applied.patched = True
        return applied

    def as_dict(self) -> dict[str, Any]:
        """Plain data (JSON, ``strategy.broadcast``, ``state_dict``); `from_dict` reads it back."""
        data = asdict(self)
        data["alternatives"] = [asdict(a) for a in self.alternatives]
        if self.checkpoint_plan is not None:
            data["checkpoint_plan"] = self.checkpoint_plan.as_dict()
        data["limit"] = self.limit
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> FitPlan:
        keys = ("micro_batch_size", "accumulate_grad_batches", "checkpointing", "optimizer", "precision")
        cost, checkpoints = data.get("cost"), data.get("checkpoint_plan")
        return cls(
            **{k: data[k] for k in keys},
            estimated_peak=data["estimated_peak"],
            budget=Budget(**data["budget"]),
            margin=data.get("margin", 0.1),
            alternatives=tuple(Alternative(**a) for a in data.get("alternatives", ())),
            strategy=data.get("strategy", "ddp"),
            world_size=data.get("world_size", 1),
            cost=StepCost(**cost) if cost else None,
            modes=tuple(data.get("modes", CHECKPOINT_MODES)),
            note=data.get("note", ""),
            checkpoint_plan=CheckpointPlan.from_dict(checkpoints) if checkpoints else None,
            lever=data.get("lever"),
            host_bytes=data.get("host_bytes", 0),
            offload_seconds=data.get("offload_seconds", 0.0),
            reshard_after_forward=data.get("reshard_after_forward"),
            cpu_offload=data.get("cpu_offload", False),
            mp_policy=data.get("mp_policy", False),
            device=data.get("device", "cuda"),
            tensor_parallel_size=data.get("tensor_parallel_size", 1),
            replicate_size=data.get("replicate_size", 1),
        )

    def summary(self) -> str:
        """One line: the plan and its peak against the limit."""
        gpus = f" x {self.world_size} GPUs ({self.strategy})" if self.world_size > 1 else ""
        if self.world_size > 1 and (self.tensor_parallel_size > 1 or self.replicate_size > 1):
            gpus = f" x {self.world_size} GPUs ({self.layout})"
        return (
            f"micro-batch {self.micro_batch_size} x accumulate {self.accumulate_grad_batches}{gpus}, "
            f"checkpointing {self.checkpointing}, optimizer {self.optimizer or 'as configured'}, "
            f"{self.precision}: estimated peak {format_bytes(self.estimated_peak)} of "
            f"{format_bytes(self.limit)} ({self.budget.source} less {self.margin:.0%} margin)"
            + (
                ""
                if self.reshard_after_forward is None
                else f", reshard_after_forward={self.reshard_after_forward}"
            )
            + (f"; with {self.lever_callback}" if self.lever else "")
            + ("; gathered in bf16 (MixedPrecisionPolicy)" if self.mp_policy else "")
            + ("; offloaded to the CPU (CPUOffloadPolicy)" if self.cpu_offload else "")
            + (f" ({format_bytes(self.host_bytes)} of host memory" if self.host_bytes else "")
            + (
                f"; transfers and the host's update add about {self.offload_seconds:.2g} s per global batch"
                + (
                    f" to {self.step_seconds - self.offload_seconds:.2g} s of compute"
                    if self.step_seconds
                    else ""
                )
                if self.offload_seconds
                else ""
            )
            + (")" if self.host_bytes else "")
            + (f"; {self.note}" if self.note else "")
        )

    @property
    def step_seconds(self) -> float | None:
        """Seconds of one global batch (per rank) by the plan's `StepCost`: compute and, offloaded, the
        transfers and the host's update; ``None`` without a cost."""
        return next((a.step_seconds for a in self.alternatives if self._is_chosen(a)), None)

    def __str__(self) -> str:
        header = (
            "m", "accumulate", "checkpointing", "optimizer", "precision", "peak", "rel. time", "s / batch",
            "fits",
        )  # fmt: skip
        rows = [
            (
                str(a.micro_batch_size),
                str(a.accumulate_grad_batches),
                a.checkpointing,
                a.optimizer or "configured",
                a.precision,
                format_bytes(a.peak),
                "—" if a.time is None else f"{a.time:.2f}",
                "—" if a.step_seconds is None else f"{a.step_seconds:.3g}",
                ("chosen" if self._is_chosen(a) else "yes") if a.fits else "no",
            )
            for a in self.alternatives
        ]
        table = render_table(
            header,
            rows,
            title=(
                "configurations simulated (peak per rank; time per global batch, 1.00 = chosen; "
                f"{self._basis()})"
            ),
            left=("checkpointing", "optimizer"),
            bold=lambda row: row[-1] == "chosen",
        )
        return "\n".join([self.summary(), table, COLUMNS_LEGEND])

    def _basis(self) -> str:
        """Where the times come from, in a few words."""
        if self.cost is None:
            return "no time model"
        if self.cost.source == "measured":
            return "timed on this device"
        return (
            f"FLOPs at {DEVICE_FLOPS[self.device] / 1e12:g} TFLOP/s sustained and "
            f"{LAUNCH_SECONDS[self.device] * 1e6:g} µs a kernel launch"
            + (", plus the offload's transfers" if self.offload_seconds else "")
        )

    def _is_chosen(self, a: Alternative) -> bool:
        return (a.micro_batch_size, a.checkpointing, a.optimizer, a.precision) == (
            self.micro_batch_size,
            self.checkpointing,
            self.optimizer,
            self.precision,
        )


def _swapped_configure(original: Callable[[], Any], name: str) -> Callable[[], Any]:
    """``configure_optimizers`` that returns the user's configuration with the optimizer swapped (a plain
    function: Lightning's ``is_overridden`` reads its ``__code__``)."""

    def configure_optimizers() -> Any:
        return _swap_config(original(), name)

    return configure_optimizers


def _swap_config(config: Any, name: str) -> Any:
    """``configure_optimizers``'s output with every optimizer replaced by a ``name`` one (hyperparameters
    translated by `swap_optimizer`) and its LR schedulers rebound, in all of Lightning's forms."""
    swapped: dict[int, torch.optim.Optimizer] = {}

    def new(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        if id(optimizer) not in swapped:
            if identify(optimizer) == name:
                swapped[id(optimizer)] = optimizer
            else:
                swapped[id(optimizer)] = swap_optimizer(optimizer, name, allow_unknown=True)
        return swapped[id(optimizer)]

    def walk(item: Any) -> Any:
        if isinstance(item, torch.optim.Optimizer):
            return new(item)
        if isinstance(item, torch.optim.lr_scheduler.LRScheduler) or hasattr(item, "optimizer"):
            old = item.optimizer
            if isinstance(old, torch.optim.Optimizer) and new(old) is not old:
                rebind_scheduler(item, new(old), lr_factor(identify(old), name))
            return item
        if isinstance(item, dict):
            return {k: walk(v) for k, v in item.items()}
        if isinstance(item, (list, tuple)):
            return type(item)(walk(v) for v in item)
        return item

    return walk(config)


class _Applied:
    """What `FitPlan.apply` changed on a module; ``remove()`` undoes it (also a context manager)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.checkpointing: Any = None
        self.patched = False

    def remove(self) -> None:
        if self.checkpointing is not None:
            self.checkpointing.remove()
            self.checkpointing = None
        if self.patched:
            self.module.__dict__.pop("configure_optimizers", None)
            self.patched = False

    def __enter__(self) -> _Applied:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()
