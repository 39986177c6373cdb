"""Fit a training run to a memory budget from the estimate: micro-batch, accumulation, checkpointing,
optimizer.

"Make this run fit a 24 GB card" is answered here without a single trial OOM. Lightning's
``BatchSizeFinder`` turns only the batch-size knob, by provoking OOMs, and lands at the limit; here every
candidate is a simulated training step (`_simulate.estimate_memory`, fake tensors), a reserve (``margin``)
is kept below the budget, and all the levers are searched:

- micro-batch ``m`` over the divisors of the per-rank global batch ``G`` (``accumulate = G / m``, so the
  global batch stays what the user set; micro-batches are slices of the example batch along dim 0);
- activation checkpointing, uniform over the model's repeated blocks: ``"none"``, ``"selective"``,
  ``"full"`` (`_checkpointing.apply_checkpointing`, simulated with the policy applied); a model without
  repeated blocks (an MLP, one layer) has nothing to checkpoint and is planned with ``"none"`` only, which
  the plan's `FitPlan.note` (and its summary) says;
- the optimizer, in the catalogue's quality order (`_optim.DEFAULT_CANDIDATES`), starting at the model's
  own (a model with AdamW may get AdamW8bit, never the reverse);
- precision, only among the Lightning precision strings the caller allows, in the order given.

Order of preference (lexicographic): the best-quality optimizer that fits at all, then the first allowed
precision that fits with it, then the highest estimated throughput. Optimizer quality is never traded for
speed: AdamW at micro-batch 1 with full checkpointing beats SGD at micro-batch 64, because a run that trains
worse is not made good by training faster.

Pruning (assumptions, each true of the models we know): the peak grows with ``m`` (binary search over the
sorted divisors: about ``log2(#divisors)`` simulations per checkpointing level), and stronger checkpointing
never raises the peak (a level only searches micro-batches above what the lighter level reached, and is
skipped when even ``m = G`` could not beat the best time found). Before any simulation, an optimizer whose
static memory (parameters + gradients + state, `_analytic.static_breakdown`, sharded) is over the limit is
dropped. Every plan reported is a simulated step; nothing is extrapolated.

Throughput model: the time of one global batch is

    accumulate * (t_fixed + t_per_sample * m * (1 + recompute))

with ``recompute`` = 0 (none), 0.1 (selective: pointwise ops and norms redone) or 1/3 (full: the forward
redone, a third of forward + backward), `RECOMPUTE`. ``t_fixed`` (per-micro-step overhead: kernel launches,
Python) and ``t_per_sample`` come from `StepCost`: measured, by timing real forward+backward passes at two
micro-batch sizes when the model has real weights on the CPU, or from counts when planning offline: FLOPs per
sample (`torch.utils.flop_counter` over a simulated step) / `DEVICE_FLOPS`, and the number of forward and
backward ops x `LAUNCH_SECONDS`. The optimizer step, once per global batch, is the same for every plan and
left out. The recompute fractions are GPU figures; on the CPU, op-level selective checkpointing costs far more
(tiny GPT, 1 thread: +65 % at micro-batch 8 against +30 % for full), so CPU plans that pick "selective" are
optimistic about its time.

Why a margin (default 10 %): on the tiny GPT on CPU the measured peak exceeded the simulated one by up to
1.7 % without checkpointing and up to 6 % (selective) and 9 % (full) with it (benchmarks/bench_autofit.py);
on CUDA the allocator's fragmentation comes on top (`Budget` already keeps `FRAGMENTATION_RESERVE`).

Memory of a multi-GPU plan is one rank's: the per-rank batch is ``G / n_gpus`` and the simulated step is
sharded with `_analytic.shard` for the strategy (``"fsdp"``, ``"deepspeed_stage_2"``, ...), whose Lightning
name the plan reports; the run itself uses Lightning's strategies.
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
from torch import Tensor, nn

from lightning_memkit._analytic import STRATEGIES, model_static, shard, valid_name
from lightning_memkit._breakdown import MemoryBreakdown, format_bytes
from lightning_memkit._budget import GPUS, Budget, parse_budget
from lightning_memkit._isolate import isolated
from lightning_memkit._lightning import (
    batch_size,
    batch_slice,
    is_lightning,
    lightning_stand_ins,
    loss_of,
    optimizers_from,
)
from lightning_memkit._measure import model_device

__all__ = ["RECOMPUTE", "Alternative", "FitPlan", "StepCost", "plan_fit"]

#: Extra compute of a checkpointing level, as a fraction of the forward + backward it replaces.
RECOMPUTE: dict[str, float] = {"none": 0.0, "selective": 0.1, "full": 1 / 3}
#: Seconds of overhead per op of a micro-step (kernel launch + dispatch), for offline plans.
LAUNCH_SECONDS: dict[str, float] = {"cuda": 10e-6, "cpu": 5e-6}
#: Sustained FLOP/s assumed for offline plans: an A100-class GPU in bf16, a few CPU cores.
DEVICE_FLOPS: dict[str, float] = {"cuda": 150e12, "cpu": 50e9}
#: Lightning's strategy name for each sharding scheme `_analytic.shard` knows.
LIGHTNING_STRATEGY: dict[str, str] = {
    "ddp": "ddp",
    "zero1": "deepspeed_stage_1",
    "zero2": "deepspeed_stage_2",
    "zero3": "deepspeed_stage_3",
    "fsdp": "fsdp",
    "deepspeed_stage_1": "deepspeed_stage_1",
    "deepspeed_stage_2": "deepspeed_stage_2",
    "deepspeed_stage_3": "deepspeed_stage_3",
}
_SUGGESTED_GPUS = (2, 4, 8, 16, 32, 64)
#: Seconds of planning after which each further simulation is reported to ``plan_fit(progress=...)``.
PROGRESS_AFTER_S = 2.0


# --------------------------------------------------------------------------------------------------
# Cost model
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepCost:
    """Seconds of one micro-step: ``fixed + per_sample * m * (1 + RECOMPUTE[checkpointing])``.

    Attributes:
        fixed: per-micro-step overhead in seconds (launches, Python, the loss).
        per_sample: seconds per sample of forward + backward without checkpointing.
        source: ``"measured"`` (timed on the device) or ``"flops"`` (counted, offline).
    """

    fixed: float
    per_sample: float
    source: str = "flops"

    def time(self, micro_batch_size: int, accumulate: int, checkpointing: str) -> float:
        """Seconds of one global batch (per rank)."""
        per_micro = self.fixed + self.per_sample * micro_batch_size * (1 + RECOMPUTE[checkpointing])
        return accumulate * per_micro


def flops_cost(estimate: Callable[..., Any], device: str, m: int = 1) -> StepCost:
    """`StepCost` from a simulated step of ``m`` samples: FLOPs / `DEVICE_FLOPS` per sample, ops x
    `LAUNCH_SECONDS` per micro-step."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        _, timeline = estimate(m, "none", return_timeline=True)
    ops = sum(event.phase in ("forward", "backward") for event in timeline)
    per_sample = counter.get_total_flops() / m / DEVICE_FLOPS[device]
    return StepCost(ops * LAUNCH_SECONDS[device], per_sample, "flops")


def measured_cost(
    model: nn.Module, batch: Any, *, loss_fn: Callable | None = None, sizes: tuple[int, int] = (1, 4)
) -> StepCost:
    """`StepCost` from timing real forward + backward passes at two micro-batch sizes (median of 3 each).

    No optimizer step is taken, and the passes run `isolated`: the model's gradients, buffers (BatchNorm
    statistics), train/eval flags, torchmetrics states and public list/dict attributes, and the RNG
    streams dropout draws from, are put back as they were. Sizes that are equal (a batch of one sample)
    give a cost that is all per sample.
    """

    lightning = is_lightning(model)

    def once(m: int) -> float:
        part = batch_slice(batch, m)
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
    chosen plan's (1.0; larger is slower), ``None`` for configurations without a cost."""

    micro_batch_size: int
    accumulate_grad_batches: int
    checkpointing: str
    optimizer: str | None
    precision: str
    peak: int
    time: float | None
    fits: bool


@dataclass(frozen=True)
class FitPlan:
    """How to run a training step within a memory budget. Bytes are ints.

    Attributes:
        micro_batch_size: samples per forward/backward (per rank): the dataloader's batch size.
        accumulate_grad_batches: micro-batches per optimizer step; ``micro_batch_size *
            accumulate_grad_batches`` is the per-rank global batch.
        checkpointing: ``"none"``, ``"selective"`` or ``"full"``, for every repeated block.
        optimizer: the catalogue name (`_optim.CATALOGUE`) of the optimizer to train with; ``None``:
            whatever ``configure_optimizers`` returns (an optimizer the catalogue does not know).
        precision: the Lightning precision string the plan was simulated with.
        estimated_peak: one rank's simulated step peak with the plan.
        budget: the `Budget` planned for; the plan keeps ``estimated_peak <= budget.usable * (1 - margin)``.
        margin: the reserve kept below ``budget.usable``, as a fraction.
        alternatives: every configuration simulated, as `Alternative` rows.
        strategy: Lightning's strategy name (``"ddp"``, ``"fsdp"``, ``"deepspeed_stage_2"``, ...); ``"auto"``
            for one GPU.
        n_gpus: ranks the global batch is split across.
        cost: the throughput model the times came from.
        levels: the checkpointing levels that were candidates (``("none",)`` for a model without
            repeated blocks, which cannot be checkpointed); `leaner` keeps to them.
        note: why some levels asked for were not candidates (``""`` when all were); `summary` shows it.
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
    n_gpus: int = 1
    cost: StepCost | None = field(default=None, compare=False)
    levels: tuple[str, ...] = field(default=tuple(RECOMPUTE), compare=False)
    note: str = field(default="", compare=False)

    @property
    def limit(self) -> int:
        """Bytes the step's peak may reach: ``budget.usable * (1 - margin)``."""
        return int(self.budget.usable * (1 - self.margin))

    @property
    def global_batch_size(self) -> int:
        """Samples per optimizer step across all ranks."""
        return self.micro_batch_size * self.accumulate_grad_batches * self.n_gpus

    def leaner(self, levels: Sequence[str] = tuple(RECOMPUTE)) -> FitPlan | None:
        """The next plan one notch leaner (after an OOM): the next stronger checkpointing level allowed
        (``levels``) at the same micro-batch, else half the micro-batch (the largest divisor of it at most
        half) with accumulation multiplied to keep the global batch, checkpointing unchanged; ``None`` at
        micro-batch 1 with the strongest level allowed. Its ``estimated_peak`` is not simulated: it is the
        current one."""
        stronger = [level for level in RECOMPUTE if level in levels and level in self.levels]
        stronger = (
            stronger[stronger.index(self.checkpointing) + 1 :] if self.checkpointing in stronger else []
        )
        if stronger:
            return replace(self, checkpointing=stronger[0])
        m = self.micro_batch_size
        smaller = max((d for d in range(1, m // 2 + 1) if m % d == 0), default=None)
        if smaller is None:
            return None
        return replace(
            self,
            micro_batch_size=smaller,
            accumulate_grad_batches=self.accumulate_grad_batches * (m // smaller),
        )

    def apply(self, module: nn.Module) -> _Applied:
        """Checkpoint ``module``'s blocks and make its ``configure_optimizers`` return the plan's optimizer.

        The micro-batch and accumulation are the Trainer's and the dataloader's to set (`AutoFit` does
        both). Returns a handle whose ``remove()`` undoes both changes.
        """
        from lightning_memkit._checkpointing import apply_checkpointing

        applied = _Applied(module)
        applied.checkpointing = apply_checkpointing(module, self.checkpointing)
        configure = getattr(module, "configure_optimizers", None)
        if self.optimizer is not None and callable(configure):
            module.__dict__["configure_optimizers"] = _swapped_configure(configure, self.optimizer)
            applied.patched = True
        return applied

    def as_dict(self) -> dict[str, Any]:
        """Plain data (JSON, ``strategy.broadcast``, ``state_dict``); `from_dict` reads it back."""
        data = asdict(self)
        data["alternatives"] = [asdict(a) for a in self.alternatives]
        data["limit"] = self.limit
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> FitPlan:
        keys = ("micro_batch_size", "accumulate_grad_batches", "checkpointing", "optimizer", "precision")
        cost = data.get("cost")
        return cls(
            **{k: data[k] for k in keys},
            estimated_peak=data["estimated_peak"],
            budget=Budget(**data["budget"]),
            margin=data.get("margin", 0.1),
            alternatives=tuple(Alternative(**a) for a in data.get("alternatives", ())),
            strategy=data.get("strategy", "ddp"),
            n_gpus=data.get("n_gpus", 1),
            cost=StepCost(**cost) if cost else None,
            levels=tuple(data.get("levels", RECOMPUTE)),
            note=data.get("note", ""),
        )

    def summary(self) -> str:
        """One line: the plan and its peak against the limit."""
        gpus = f" x {self.n_gpus} GPUs ({self.strategy})" if self.n_gpus > 1 else ""
        return (
            f"micro-batch {self.micro_batch_size} x accumulate {self.accumulate_grad_batches}{gpus}, "
            f"checkpointing {self.checkpointing}, optimizer {self.optimizer or 'as configured'}, "
            f"{self.precision}: estimated peak {format_bytes(self.estimated_peak)} of "
            f"{format_bytes(self.limit)} ({self.budget.source} less {self.margin:.0%} margin)"
            + (f"; {self.note}" if self.note else "")
        )

    def __str__(self) -> str:
        header = ("m", "accumulate", "checkpointing", "optimizer", "precision", "peak", "rel. time", "fits")
        rows = [
            (
                str(a.micro_batch_size),
                str(a.accumulate_grad_batches),
                a.checkpointing,
                a.optimizer or "configured",
                a.precision,
                format_bytes(a.peak),
                "—" if a.time is None else f"{a.time:.2f}",
                ("chosen" if self._is_chosen(a) else "yes") if a.fits else "no",
            )
            for a in self.alternatives
        ]
        try:
            from rich.console import Console
            from rich.table import Table
        except ImportError:
            widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
            lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in [header, *rows]]
            return "\n".join([self.summary(), *lines])
        table = Table(title="configurations simulated (peak per rank; time per global batch, 1.00 = chosen)")
        for name in header:
            table.add_column(name, justify="left" if name in ("checkpointing", "optimizer") else "right")
        for row in rows:
            table.add_row(*row, style="bold" if row[-1] == "chosen" else None)
        console = Console(width=110, record=True, force_terminal=False)
        with console.capture() as capture:
            console.print(table)
        return "\n".join([self.summary(), capture.get().rstrip("\n")])

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
    translated by `_optim.swap_optimizer`) and its LR schedulers rebound, in all of Lightning's forms."""
    from lightning_memkit._optim import identify, lr_factor, rebind_scheduler, swap_optimizer

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


# --------------------------------------------------------------------------------------------------
# The search
# --------------------------------------------------------------------------------------------------


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def own_optimizer(model: nn.Module) -> str | None:
    """The catalogue name of the optimizer ``configure_optimizers`` builds; ``None`` if unknown or absent."""
    from lightning_memkit._optim import identify

    if not is_lightning(model):
        return None
    try:
        with lightning_stand_ins(model, model_device(model)), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            optimizers = optimizers_from(model.configure_optimizers())
    except Exception:
        return None
    return identify(optimizers[0]) if len(optimizers) == 1 else None


def _candidates(model: nn.Module, optimizers: Sequence[str | None] | None) -> tuple[str | None, ...]:
    from lightning_memkit._optim import DEFAULT_CANDIDATES, load_bitsandbytes

    if optimizers is not None:
        return tuple(optimizers)
    own = own_optimizer(model)
    if own is None:
        return (None,) if is_lightning(model) else DEFAULT_CANDIDATES
    order = list(DEFAULT_CANDIDATES)
    start = order.index(own) if own in order else 0
    names = [own] + [n for n in order[start + 1 :] if n != own]
    if load_bitsandbytes() is None:
        from lightning_memkit._optim import CATALOGUE

        names = [n for n in names if not CATALOGUE[n].needs_bitsandbytes]
    return tuple(names)


class _Search:
    """Simulations of one model and batch, cached by configuration; one rank's (sharded) peak."""

    def __init__(self, model, batch, loss_fn, device, strategy, n_gpus, progress=None) -> None:
        self.model, self.batch, self.loss_fn, self.device = model, batch, loss_fn, device
        self.strategy, self.n_gpus = strategy, n_gpus
        self.cache: dict[tuple, MemoryBreakdown] = {}
        #: the smallest micro-batch the step accepts (`_runnable`)
        self.smallest = 1
        self.seconds = 0.0
        self.progress = progress
        self.started = time.perf_counter()

    def estimate(self, m, checkpointing, *, optimizer=None, precision="32-true", return_timeline=False):
        from lightning_memkit._checkpointing import apply_checkpointing
        from lightning_memkit._simulate import estimate_memory

        start = time.perf_counter()
        ctx = apply_checkpointing(self.model, checkpointing) if checkpointing != "none" else None
        try:
            with ctx or contextlib.nullcontext(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return estimate_memory(
                    self.model,
                    batch_slice(self.batch, m),
                    accumulating=m < batch_size(self.batch),  # the cycle's last micro-batch is its peak
                    optimizer=optimizer,
                    loss_fn=self.loss_fn,
                    precision=precision,
                    device=self.device,
                    return_timeline=return_timeline,
                )
        finally:
            self.seconds += time.perf_counter() - start

    def peak(self, m: int, checkpointing: str, optimizer: str | None, precision: str) -> MemoryBreakdown:
        key = (m, checkpointing, optimizer, precision)
        if key not in self.cache:
            elapsed = time.perf_counter() - self.started
            if self.progress is not None and elapsed >= PROGRESS_AFTER_S:
                self.progress(
                    f"simulating micro-batch {m}, checkpointing {checkpointing}, optimizer "
                    f"{optimizer or 'as configured'}, {precision} ({len(self.cache)} simulated in "
                    f"{elapsed:.0f} s)"
                )
            b = self.estimate(m, checkpointing, optimizer=optimizer, precision=precision)
            grads = self._static(None, precision).gradients
            self.cache[key] = shard(b, self.strategy, self.n_gpus, gradient_bytes=grads)
        return self.cache[key]

    def static(self, optimizer: str | None, precision: str) -> int:
        """A lower bound of the peak: sharded parameters + gradients + optimizer state, no simulation."""
        if optimizer is None:
            return 0
        try:
            return shard(self._static(optimizer, precision), self.strategy, self.n_gpus).static
        except ValueError:
            return 0

    def _static(self, optimizer: str | None, precision: str) -> MemoryBreakdown:
        return model_static(self.model, precision, optimizer or "sgd")


def _runnable(
    search: _Search, sizes: list[int], level: str, optimizer: str | None, precision: str
) -> list[int]:
    """``sizes`` from the smallest micro-batch the model's step accepts: BatchNorm refuses one sample per
    channel in training ("Expected more than 1 value per channel"), so such a model's plans start at 2."""
    for i, m in enumerate(sizes):
        try:
            search.peak(m, level, optimizer, precision)
        except ValueError as err:
            refused = err
            continue
        search.smallest = m
        return sizes[i:]
    raise ValueError(f"The training step fails on every micro-batch of {sizes}: {refused}") from refused


def _largest_fitting(fits: Callable[[int], bool], sizes: Sequence[int]) -> int | None:
    """The largest size for which ``fits`` holds, assuming it is monotone (true, then false)."""
    lo, hi, best = 0, len(sizes) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        if fits(sizes[mid]):
            best, lo = sizes[mid], mid + 1
        else:
            hi = mid - 1
    return best


def plan_fit(
    model: nn.Module,
    batch: Any,
    budget: int | float | str | Budget,
    *,
    margin: float = 0.1,
    optimizers: Sequence[str | None] | None = None,
    precision: str | Sequence[str] = "32-true",
    checkpointing: Sequence[str] = ("none", "selective", "full"),
    strategy: str = "ddp",
    n_gpus: int = 1,
    device: str = "cuda",
    loss_fn: Callable[[Any, Any], Tensor] | None = None,
    cost: str | StepCost = "auto",
    progress: Callable[[str], None] | None = None,
) -> FitPlan:
    """The fastest configuration whose simulated peak is at most ``budget.usable * (1 - margin)``.

    Args:
        model: a ``LightningModule`` (its own ``training_step``/``configure_optimizers``) or an
            ``nn.Module`` with ``loss_fn``; real or on the meta device.
        batch: an example batch at the global batch size (all ranks); micro-batches are its slices along
            dim 0. Only shapes are read, except to time the step (``cost="measured"``).
        budget: bytes, ``"24GB"``, a GPU name (``"A100-40GB"``), a fraction of the current device or
            ``"auto"`` (`parse_budget`); per rank.
        margin: share of the budget kept free, for what the estimate cannot see.
        optimizers: candidate catalogue names in quality order (default: the model's own, then the
            lighter ones of `_optim.DEFAULT_CANDIDATES`).
        precision: a Lightning precision string, or several allowed, in order of preference.
        checkpointing: the uniform checkpointing levels allowed, from ``"none"``, ``"selective"``, ``"full"``.
        strategy, n_gpus: shard one rank's step (`_analytic.STRATEGIES`); the batch is split across ranks.
        device: ``"cuda"`` or ``"cpu"``: what the simulation models and the offline cost assumes.
        cost: ``"auto"`` (``"measured"`` for a model with real weights on the CPU and ``device="cpu"``,
            else ``"flops"``), ``"measured"``, ``"flops"``, or a `StepCost`.
        progress: called with a line before each simulation once planning has taken
            ``PROGRESS_AFTER_S`` seconds (a large model's simulations take seconds each).

    Side effects: none on ``model``. The simulations run `estimate_memory` (which restores what it runs)
    and the timing (``cost="measured"``) runs `isolated` (see `measured_cost`): a plan that changes nothing
    leaves the run as it would have been without planning.

    Raises:
        ValueError: no configuration fits; the message gives the static floor, the leanest plan's peak and
            what would fit (more GPUs with FSDP, a larger GPU). Also for an empty ``batch``.
        NotImplementedError: a LightningModule with manual optimization.
    """
    if is_lightning(model) and not model.automatic_optimization:
        raise NotImplementedError(
            f"{type(model).__name__} uses manual optimization, whose steps are its own code and cannot be "
            "simulated: plan the underlying nn.Module instead, with loss_fn= (and optimizers= to name the "
            "candidates)."
        )
    budget = parse_budget(budget)
    if not 0.0 <= margin < 1.0:
        raise ValueError(f"margin must be in [0, 1), got {margin}")
    limit = int(budget.usable * (1 - margin))
    precisions = (precision,) if isinstance(precision, str) else tuple(precision)
    if not precisions:
        raise ValueError(
            "precision= is empty: give a Lightning precision string, e.g. '32-true' or 'bf16-mixed'"
        )
    if isinstance(n_gpus, bool) or not isinstance(n_gpus, int) or n_gpus < 1:
        raise ValueError(f"n_gpus must be a whole number of GPUs, at least 1; got {n_gpus!r}")
    levels = tuple(c for c in RECOMPUTE if c in checkpointing)
    if not levels or len(levels) != len(set(checkpointing)):
        raise ValueError(f"checkpointing must be a subset of {tuple(RECOMPUTE)}, got {tuple(checkpointing)}")
    levels, note = _checkpointable(model, levels)
    strategy = valid_name("strategy", strategy, STRATEGIES)
    total = batch_size(batch)
    if total % n_gpus:
        raise ValueError(f"The global batch of {total} does not split evenly across {n_gpus} GPUs")
    per_rank = batch_slice(batch, total // n_gpus)
    sizes = _divisors(total // n_gpus)
    search = _Search(model, per_rank, loss_fn, device, strategy if n_gpus > 1 else "ddp", n_gpus, progress)
    candidates = _candidates(model, optimizers)
    sizes = _runnable(search, sizes, levels[-1], candidates[0], precisions[0])

    chosen: tuple[str | None, str] | None = None
    for opt in candidates:
        for prec in precisions:
            if search.static(opt, prec) > limit:
                continue
            if search.peak(sizes[0], levels[-1], opt, prec).peak <= limit:
                chosen = (opt, prec)
                break
        if chosen:
            break
    if chosen is None:
        raise ValueError(_infeasible(search, candidates, precisions, levels, limit, budget, margin, total))

    opt, prec = chosen
    step_cost = _cost(cost, model, per_rank, loss_fn, device, search, prec, opt)
    G = total // n_gpus
    best: tuple[float, int, str] | None = None
    reached = 0  # the largest micro-batch a lighter level fit; stronger levels only search above it
    for level in levels:
        above = [m for m in sizes if m > reached] if reached else sizes
        if best is not None and step_cost.time(G, 1, level) >= best[0]:
            continue  # even the whole batch in one micro-step with this level would be slower
        if not above:
            continue
        m = _largest_fitting(lambda m, lv=level: search.peak(m, lv, opt, prec).peak <= limit, above)
        if m is None:
            continue
        reached = m
        t = step_cost.time(m, G // m, level)
        if best is None or t < best[0]:
            best = (t, m, level)
    assert best is not None  # the smallest runnable micro-batch at the strongest level fits
    _, m, level = best
    alternatives = tuple(
        Alternative(
            micro_batch_size=k[0],
            accumulate_grad_batches=G // k[0],
            checkpointing=k[1],
            optimizer=k[2],
            precision=k[3],
            peak=b.peak,
            time=step_cost.time(k[0], G // k[0], k[1]) / best[0] if (k[2], k[3]) == chosen else None,
            fits=b.peak <= limit,
        )
        for k, b in sorted(search.cache.items(), key=lambda kv: _row_order(kv[0], candidates, precisions))
    )
    return FitPlan(
        micro_batch_size=m,
        accumulate_grad_batches=G // m,
        checkpointing=level,
        optimizer=opt,
        precision=prec,
        estimated_peak=search.peak(m, level, opt, prec).peak,
        budget=budget,
        margin=margin,
        alternatives=alternatives,
        strategy=LIGHTNING_STRATEGY[strategy] if n_gpus > 1 else "auto",
        n_gpus=n_gpus,
        cost=step_cost,
        levels=levels,
        note=note,
    )


def _checkpointable(model: nn.Module, levels: tuple[str, ...]) -> tuple[tuple[str, ...], str]:
    """The levels that are candidates for ``model``, and a note on those that are not.

    Checkpointing is uniform over the repeated blocks `_checkpointing.find_blocks` finds; a model with
    none (an MLP, a single layer) has nothing to checkpoint, so only ``"none"`` is planned, whatever was
    allowed.
    """
    from lightning_memkit._checkpointing import find_blocks

    if levels == ("none",) or find_blocks(model):
        return levels, ""
    dropped = ", ".join(level for level in levels if level != "none")
    return ("none",), (
        f"checkpointing {dropped} not planned: {type(model).__name__} has no repeated blocks to checkpoint"
    )


def _row_order(key: tuple, candidates: Sequence, precisions: Sequence) -> tuple:
    m, level, optimizer, precision = key
    return (candidates.index(optimizer), precisions.index(precision), list(RECOMPUTE).index(level), m)


def _cost(cost, model, batch, loss_fn, device, search, precision, optimizer) -> StepCost:
    if isinstance(cost, StepCost):
        return cost
    cost = valid_name("cost", cost, ("auto", "measured", "flops"))
    real_cpu = model_device(model).type == "cpu"
    if cost == "measured" or (cost == "auto" and real_cpu and device == "cpu"):
        size = batch_size(batch)
        small = search.smallest
        return measured_cost(model, batch, loss_fn=loss_fn, sizes=(small, max(small, min(4 * small, size))))
    return flops_cost(
        lambda m, ck, **kw: search.estimate(m, ck, optimizer=optimizer, precision=precision, **kw),
        device,
        search.smallest,
    )


def _infeasible(search, candidates, precisions, levels, limit, budget, margin, total) -> str:
    """The error text: static floor, leanest plan's peak, and what would fit."""
    leanest_opt = candidates[-1]
    leanest_prec = precisions[-1]
    strongest = levels[-1]
    floor = search.peak(search.smallest, strongest, leanest_opt, leanest_prec)
    best = search.peak(search.smallest, strongest, candidates[0], precisions[0])
    # Unsharded smallest steps: what more GPUs (FSDP) or a larger card would have to hold.
    whole = search.estimate(search.smallest, strongest, optimizer=candidates[0], precision=precisions[0])
    fsdp = next(
        (n for n in _SUGGESTED_GPUS if n <= total and shard(whole, "fsdp", n).peak <= limit),
        None,
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
        fixes.append(
            f"{fsdp} GPUs of this size with strategy='fsdp' (or deepspeed_stage_3) keep {candidates[0]}"
        )
    if gpu is not None:
        fixes.append(f"one {gpu} ({GPUS[gpu] / 1024:.0f} GiB) fits it at micro-batch {search.smallest}")
    hint = "; ".join(fixes) or "no single GPU or up to 64 FSDP ranks fits it"
    lower = "" if {"bf16-true", "16-true"} & set(precisions) else "; or allow a lower precision (bf16-true)"
    return (
        f"No plan fits {format_bytes(limit)} ({budget.source}, usable {format_bytes(budget.usable)} less the "
        f"{margin:.0%} margin){ranks}. Static floor (parameters + gradients + optimizer state) with "
        f"{leanest_opt or 'the configured optimizer'}, {leanest_prec}: {format_bytes(floor.static)}; the "
        f"leanest plan (micro-batch {search.smallest}, {strongest} checkpointing, {leanest_opt}) peaks at "
        f"{format_bytes(floor.peak)}; with {candidates[0] or 'the configured optimizer'} at micro-batch "
        f"{search.smallest}: {format_bytes(best.peak)}. What would fit: {hint}{lower}."
    )


def grid(
    model: nn.Module,
    batch: Any,
    *,
    optimizer: str | None,
    precision: str = "32-true",
    checkpointing: Sequence[str] = ("none", "selective", "full"),
    device: str = "cuda",
    loss_fn: Callable | None = None,
) -> dict[tuple[int, str], int]:
    """Every (micro-batch, checkpointing) of one optimizer simulated: ``{(m, level): peak bytes}``.

    The exhaustive search `plan_fit` prunes; for tests and the benchmark.
    """
    search = _Search(model, batch, loss_fn, device, "ddp", 1)
    return {
        (m, c): search.peak(m, c, optimizer, precision).peak
        for c in checkpointing
        for m in _divisors(batch_size(batch))
    }
