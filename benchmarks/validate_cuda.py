"""The GPU truth (issue 17): the figures the README measured on the CPU, measured on one CUDA device.

    python benchmarks/validate_cuda.py             # one CUDA device: one table (about 5 minutes on an H200)
    python benchmarks/validate_cuda.py --dry-run   # the CPU at tiny sizes: what CI runs, so it cannot rot
    python benchmarks/validate_cuda.py --minutes 7 --out t.md  # a lease's worth; the table kept as it grows

On the device the exit status says whether every row ran and met its bar; with ``--dry-run`` only whether
every row ran (a row that raises, or one ``--minutes`` left out, is a row of the table, not the end of the
run): a bar meant for a 1B model on a GPU, judged at tiny sizes next to a floor that moves with the CPU's
kernels, would only be brittle.

One table, a row per figure, each with its bar and whether it is met:

1. `MemoryMonitor` against the allocator on every step (the GPT example in bf16-mixed, and a Hugging Face
   LLaMA-family model, ~1B parameters from random init): the largest error, bar 0.1 %; on CUDA the logged
   ``memory/reserved`` and ``memory/alloc_retries`` keys are checked too.
2. `estimate_memory(device=...)` against the steady step's real peak, bar 1 % (2 % hard).
3. `ActivationCheckpointing` at a budget 60 % of the way from full checkpointing's peak to none's: the real
   peak within the budget, and its step time against no checkpointing and full, side by side.
4. `OptimizerSwap` to bitsandbytes' 8-bit AdamW: the real state bytes against the estimate's.
5. `AutoFit` with the device capped (``torch.cuda.set_per_process_memory_fraction``) below what the
   default run needs (70 % of it, or halfway to the leanest plan where that is closer): OOMs, the real
   peak against the budget, and throughput against the best cell of a small grid of micro-batch x
   checkpointing (bar 0.95).
6. An OOM in the first steps, recovered by AutoFit's guard: every step done, none lost.
7. `MemoryMonitor`'s overhead: step time with it over without, interleaved runs (bar 1 %).
8. `plan_fit` (what ``memkit plan`` runs) for the LLaMA model at the capped size: its estimate against the
   real run's peak (bar 2 %).
9. `OptimizerOffload` on the GPT example with bf16 weights: the device's steady peak against
   `estimate_memory(lever="offload")` (bar 2 %), and no optimizer state left on the device.
10. `MemoryMonitor` under FSDP2 (``fully_shard`` on each LLaMA layer and the model, ModelParallelStrategy
   over one device) against the allocator on every step (bar 0.1 %).
11. The LLaMA model compiled in ``configure_model``: `MemoryMonitor` against the allocator on every step
   (bar 1 %), the estimate of the compiled step (bar 3 %; simulated from the code inductor generates for
   the CPU, so this row shows what Triton's fusion changes), and `ActivationCheckpointing` at 0.9 of it,
   met through torch.compile's activation budget (the steady steps' real peak within the budget; the
   first step, which compiles, is shown beside).
12. QLoRA on the LLaMA shape (nf4 base with double quantization, bf16 compute, peft's LoRA r=8):
   rows 1 and 2's checks (bars 0.1 % and 1 %, 2 % hard): bitsandbytes' CUDA kernels are not the CPU ones
   the tests hold these figures to.
13. `MemoryMonitor` under Lightning's ``DeepSpeedStrategy(stage=2)`` over one device (the LLaMA model)
   against the allocator on every step (bar 0.1 %).
14. `MemoryMonitor` under Lightning's ``FSDPStrategy`` (FSDP1, full shard, each decoder layer a unit) over one
   device, against the allocator on every step (bar 0.1 %). Rows 13 and 14 are n/a with ``--dry-run``: both
   strategies refuse a CPU.

The truth is ``torch.cuda.max_memory_allocated`` reset at each step's start on CUDA; with ``--dry-run``,
torch.profiler's memory timeline (`lightning_memkit.testing.AllocatorPeaks`), the device is capped only
by the budget, and the OOM of row 6 is `lightning_memkit.testing.PretendOOM`'s.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import math
import os
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, Dataset

from lightning_memkit import (
    CHECKPOINT_MODES,
    ActivationCheckpointing,
    AutoFit,
    MemoryMonitor,
    OptimizerOffload,
    OptimizerSwap,
    estimate_memory,
    plan_checkpointing,
)
from lightning_memkit._breakdown import format_bytes
from lightning_memkit._measuring.storages import optimizer_tensors, storage_bytes
from lightning_memkit.demos.gpt import GPTLightningModule
from lightning_memkit.testing import AllocatorPeaks, PretendOOM

MiB = 2**20


@dataclass(frozen=True)
class Sizes:
    """The models and steps of one run of the script."""

    gpt: str | dict  # a GPT example preset, or its GPTConfig fields
    gpt_batch: tuple[int, int]  # (batch, tokens)
    llama: dict  # LlamaConfig fields
    llama_batch: tuple[int, int]
    steps: int  # steps of each measured fit
    timed_steps: int  # steps of each timed fit
    rounds: int  # interleaved rounds of timed fits
    checkpointing: tuple[str, ...]  # the modes AutoFit's and ActivationCheckpointing's plans may give a block
    grid: tuple[tuple[int, str], ...]  # (accumulation, checkpointing) cells AutoFit's throughput is held to


DRY = Sizes(
    gpt=dict(n_layer=2, n_head=2, n_embd=32, vocab_size=256, block_size=32), gpt_batch=(4, 16),
    llama=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=128),
    llama_batch=(4, 16), steps=2, timed_steps=3, rounds=1, checkpointing=("none", "full"),
    grid=((2, "full"), (4, "full")),
)  # fmt: skip
#: TinyLlama-1.1B's shape.
CUDA = Sizes(
    gpt="gpt2", gpt_batch=(8, 1024),
    llama=dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
               num_key_value_heads=4, vocab_size=32000),
    llama_batch=(8, 1024), steps=4, timed_steps=12, rounds=3, checkpointing=CHECKPOINT_MODES,
    grid=tuple((k, mode) for k in (1, 2, 4) for mode in ("none", "selective", "full")),
)  # fmt: skip


@dataclass
class Row:
    what: str
    figure: str
    bar: str
    met: bool | None  # None: not applicable on this device
    note: str = ""


@dataclass
class Run:
    """What a row's fit gives back: the allocator's peak of every step, their times, the callbacks."""

    peaks: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    trainer: pl.Trainer | None = None

    @property
    def steady(self) -> int:
        """The highest peak after the first step (which has no optimizer state yet)."""
        return max(self.peaks[1:] or self.peaks)

    @property
    def step_time(self) -> float:
        """The median step time after the first two steps (compilation, allocator warm-up)."""
        return statistics.median(self.times[2:] or self.times)


# --- the models -------------------------------------------------------------------------------------------


class Tokens(Dataset):
    def __init__(self, n: int, seq_len: int, vocab: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.data = torch.randint(0, vocab, (n, seq_len + 1), generator=g)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[i, :-1], self.data[i, 1:]


class Llama(pl.LightningModule):
    """A Hugging Face LLaMA from a random init, trained on random tokens with AdamW (its defaults kept:
    ``use_cache=True``, SDPA attention)."""

    def __init__(self, config: dict, batch_size: int, seq_len: int, steps: int) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        self.model = LlamaForCausalLM(LlamaConfig(**config))
        self.batch_size, self.seq_len, self.steps = batch_size, seq_len, steps

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, _ = batch
        return self.model(input_ids=x, labels=x).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)

    def train_dataloader(self) -> DataLoader:
        data = Tokens(self.batch_size * (self.steps + 1), self.seq_len, self.model.config.vocab_size)
        return DataLoader(data, batch_size=self.batch_size)


class ShardedLlama(Llama):
    """`Llama` sharded as Lightning documents FSDP2: ``fully_shard`` on each decoder layer, then the whole
    model, over the data-parallel mesh (of one device here). The root is the Hugging Face model, which
    ``training_step`` calls: a root whose own forward never runs never gathers its parameters."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)


class CompiledLlama(Llama):
    """`Llama` compiled in ``configure_model`` (inductor), as Lightning's docs show."""

    def configure_model(self) -> None:
        self.model = torch.compile(self.model)


class QLoraLlama(Llama):
    """`Llama` fine-tuned as QLoRA: every ``nn.Linear`` but the head a bitsandbytes ``Linear4bit`` (nf4,
    double quantization, bf16 compute), quantized on ``device`` as the model is built, under peft's LoRA
    (r=8 on q/v/up/down); AdamW on the adapters alone."""

    def __init__(self, config: dict, batch_size: int, seq_len: int, steps: int, device: str) -> None:
        super().__init__(config, batch_size, seq_len, steps)
        import bitsandbytes as bnb
        import peft

        for parent in list(self.model.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is not torch.nn.Linear or name == "lm_head":
                    continue
                options = dict(quant_type="nf4", compress_statistics=True)
                layer = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                          compute_dtype=torch.bfloat16, **options)  # fmt: skip
                layer.weight = bnb.nn.Params4bit(child.weight.data.cpu(), requires_grad=False, **options)
                setattr(parent, name, layer.to(device))  # quantized as it lands there
        config = peft.LoraConfig(
            r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"]
        )
        self.model = peft.get_peft_model(self.model, config)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-4)


class Gpt(GPTLightningModule):
    """The GPT example on random tokens, its batch size an attribute (for AutoFit)."""

    def __init__(self, preset: str | dict, batch_size: int, seq_len: int, steps: int) -> None:
        torch.manual_seed(0)
        super().__init__(preset, max_steps=steps)
        self.batch_size, self.seq_len, self.steps = batch_size, seq_len, steps

    def train_dataloader(self) -> DataLoader:
        data = Tokens(self.batch_size * (self.steps + 1), self.seq_len, self.config.vocab_size)
        return DataLoader(data, batch_size=self.batch_size)


def example_batch(module: Gpt | Llama) -> tuple[torch.Tensor, torch.Tensor]:
    return next(iter(module.train_dataloader()))


# --- measuring a fit --------------------------------------------------------------------------------------


class CudaPeaks:
    """`AllocatorPeaks` on CUDA: ``max_memory_allocated`` reset as each batch starts, read as it ends."""

    def __init__(self) -> None:
        self.peaks: list[int] = []

    def around(self, *callbacks: pl.Callback) -> list[pl.Callback]:
        return [_ResetPeak(), *callbacks, _ReadPeak(self.peaks)]


class _ResetPeak(pl.Callback):
    def on_train_batch_start(self, *args: Any) -> None:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


class _ReadPeak(pl.Callback):
    def __init__(self, peaks: list[int]) -> None:
        self.peaks = peaks

    def on_train_batch_end(self, *args: Any) -> None:
        torch.cuda.synchronize()
        self.peaks.append(torch.cuda.max_memory_allocated())


class _Clock(pl.Callback):
    def __init__(self, cuda: bool) -> None:
        self.cuda, self.times, self._start = cuda, [], 0.0

    def on_train_batch_start(self, *args: Any) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        self._start = time.perf_counter()

    def on_train_batch_end(self, *args: Any) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        self.times.append(time.perf_counter() - self._start)


class _StateOnDevice(pl.Callback):
    """The optimizer's class and its state's bytes on the device as training ends: Lightning's teardown
    then moves the state to the CPU, so reading it after ``fit`` finds none on a CUDA device."""

    def __init__(self, device: str) -> None:
        self.device, self.name, self.nbytes = torch.device(device), "", 0

    def on_train_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.name = type(trainer.optimizers[0]).__name__
        self.nbytes = storage_bytes(optimizer_tensors(trainer.optimizers), self.device)


class Bench:
    """Runs fits on one device and keeps the rows."""

    def __init__(self, sizes: Sizes, cuda: bool, root: Path) -> None:
        self.sizes, self.cuda, self.root = sizes, cuda, root
        self.device = "cuda" if cuda else "cpu"
        self.precision = "bf16-mixed"
        self.rows: list[Row] = []
        self.llama_peak = 0  # the LLaMA model's default run's steady peak (row 1), capped below in row 5
        self.raised: list[str] = []  # the rows that raised instead of giving a figure
        self.not_run: list[str] = []  # the rows `--minutes` left out

    def gpt(self) -> Gpt:
        b, t = self.sizes.gpt_batch
        with torch.device(self.device):  # built where it trains: a 1B model's init on the CPU takes long
            return Gpt(self.sizes.gpt, b, t, self.sizes.timed_steps)

    def llama(self) -> Llama:
        b, t = self.sizes.llama_batch
        with torch.device(self.device):
            return Llama(self.sizes.llama, b, t, self.sizes.timed_steps)

    def fit(
        self, module: pl.LightningModule, callbacks: list[pl.Callback] = (), *, steps: int | None = None,
        around: list[pl.Callback] = (), logger: bool = False, **trainer_kwargs: Any,
    ) -> Run:  # fmt: skip
        """Fit ``module``; the allocator's peaks bracket ``around`` (the callbacks to compare with them)."""
        gc.collect()  # the last fit's module and optimizer are gone before this one's first step
        if self.cuda:
            torch.cuda.empty_cache()
        peaks = CudaPeaks() if self.cuda else AllocatorPeaks()
        clock = _Clock(self.cuda)
        trainer = pl.Trainer(
            accelerator=self.device, devices=1, max_steps=steps or self.sizes.steps, precision=self.precision,
            limit_val_batches=0, enable_progress_bar=False, enable_model_summary=False,
            enable_checkpointing=False, default_root_dir=self.root,
            logger=CSVLogger(self.root, name="validate") if logger else False,
            callbacks=[*callbacks, clock, *peaks.around(*around)], **trainer_kwargs,
        )  # fmt: skip
        trainer.fit(module)
        return Run(peaks.peaks, clock.times, trainer)

    def add(self, what: str, figure: str, bar: str, met: bool | None, note: str = "") -> None:
        self.rows.append(Row(what, figure, bar, met, note))
        mark = {True: "met", False: "MISSED", None: "n/a"}[met]
        print(f"  {what}: {figure} (bar {bar}) {mark} {note}", file=sys.stderr, flush=True)


def _error(a: float, b: float) -> float:
    return a / b - 1


def _label(plan: Any) -> str:
    return f"micro-batch {plan.micro_batch_size} x {plan.accumulate_grad_batches}, {plan.checkpointing}"


# --- the rows ---------------------------------------------------------------------------------------------


def gpt_monitor_and_estimate(bench: Bench) -> None:
    monitor_and_estimate(bench, "GPT example", bench.gpt)


def llama_monitor_and_estimate(bench: Bench) -> None:
    bench.llama_peak = monitor_and_estimate(bench, "LLaMA", bench.llama)


def monitor_and_estimate(
    bench: Bench, name: str, make: Callable[[], pl.LightningModule], rows: tuple[str, str] = ("1", "2")
) -> int:
    """Rows 1 and 2 (numbered ``rows``) for one model; returns the steady step's real peak."""
    module = make()
    monitor = MemoryMonitor(plot=False, summary=False, log_every_n_steps=1)
    run = bench.fit(module, around=[monitor], logger=True)
    measured = [b.peak for _, b in monitor.history]
    worst = max(abs(_error(m, p)) for m, p in zip(measured, run.peaks, strict=True))
    keys = ""
    if bench.cuda:
        logged = (Path(run.trainer.logger.log_dir) / "metrics.csv").read_text().splitlines()[0]
        keys = (
            ", reserved/retries logged"
            if "memory/reserved" in logged and "memory/alloc_retries" in logged
            else ", KEYS MISSING"
        )
    bench.add(
        f"{rows[0]}. MemoryMonitor vs allocator, {name}",
        f"{worst:.3%} worst of {len(measured)} steps{keys}",
        "≤ 0.1 %",
        worst <= 0.001 and "MISSING" not in keys,
    )
    estimate = estimate_memory(module, example_batch(module), precision=bench.precision, device=bench.device)
    error = _error(estimate.peak, run.steady)
    bench.add(
        f"{rows[1]}. estimate vs real step, {name}",
        f"{error:+.2%} ({estimate.peak / MiB:,.1f} vs {run.steady / MiB:,.1f} MiB)",
        "≤ 1 % (2 %)",
        abs(error) <= 0.02,
    )
    return run.steady


def checkpointing(bench: Bench) -> None:
    """Row 3: a budget halfway between full checkpointing's peak and none's, on the GPT example."""
    module = bench.gpt()
    plan = plan_checkpointing(
        module,
        example_batch(module),
        checkpointing="full",
        device=bench.device,
        precision=bench.precision,
        cost="flops",
    )
    budget = plan.peak + 6 * (plan.peak_none - plan.peak) // 10  # past halfway: not on a plan's own peak
    runs = {}
    for label, callback in (
        ("planned", ActivationCheckpointing(budget=budget, checkpointing=bench.sizes.checkpointing)),
        ("none", None),
        ("full", ActivationCheckpointing(checkpointing="full")),
    ):
        module = bench.gpt()
        runs[label] = bench.fit(module, [callback] if callback else [], steps=bench.sizes.timed_steps)
    worst = max(runs["planned"].peaks)
    t_none, t_full = runs["none"].step_time, runs["full"].step_time
    times = f"time x{runs['planned'].step_time / t_none:.2f} of none, x{t_full / t_none:.2f} full"
    bench.add(
        "3. ActivationCheckpointing at 60 %",
        f"peak {worst / MiB:,.1f} ≤ {budget / MiB:,.1f} MiB; {times}",
        "peak ≤ budget",
        worst <= budget,
    )


def optimizer_swap(bench: Bench) -> None:
    """Row 4: OptimizerSwap to bitsandbytes' 8-bit AdamW; the real state bytes against the estimate's. The
    budget lies halfway between the two optimizers' estimated peaks: AdamW does not fit, 8-bit AdamW does."""
    module = bench.gpt()
    batch = example_batch(module)
    estimate = estimate_memory(
        module, batch, optimizer="adamw8bit", precision=bench.precision, device=bench.device
    )
    adamw = estimate_memory(module, batch, optimizer="adamw", precision=bench.precision, device=bench.device)
    swap = OptimizerSwap(budget=(estimate.peak + adamw.peak) // 2, optimizers=["adamw8bit"])
    state = _StateOnDevice(bench.device)
    bench.fit(module, [swap, state])
    figure = f"{state.name}: {state.nbytes:,} B real vs {estimate.optimizer_state:,} B estimated"
    bench.add(
        "4. OptimizerSwap to adamw8bit, state",
        figure,
        "equal",
        state.name == "AdamW8bit" and state.nbytes == estimate.optimizer_state,
    )


@contextlib.contextmanager
def capped(bench: Bench, budget: int) -> Iterator[None]:
    """The CUDA device capped at ``budget`` bytes for this process; nothing on the CPU."""
    if not bench.cuda:
        yield
        return
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(budget / total)
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()


def _ooms() -> int:
    return torch.cuda.memory_stats().get("num_ooms", 0) if torch.cuda.is_available() else 0


def capped_budget(bench: Bench, margin: float = 0.1) -> int:
    """Row 5's cap: 70 % of what the LLaMA model's default run needs, or, where that is too close to the
    leanest plan (tiny sizes, whose floor moves with the CPU's bf16 kernels), halfway from the leanest
    plan's need (micro-batch 1, full checkpointing, AutoFit's margin) to the default run's."""
    module = bench.llama()
    one = [t[:1] for t in example_batch(module)]
    leanest = estimate_memory(
        module, one, precision=bench.precision, device=bench.device, checkpointing="full", accumulating=True
    ).peak
    need = math.ceil(leanest / (1 - margin))
    return max(int(0.7 * bench.llama_peak), (need + bench.llama_peak) // 2)


def autofit_and_plan(bench: Bench) -> None:
    """Rows 5 and 8: AutoFit on the LLaMA model with the device capped below what its default run needs
    (`capped_budget`); `plan_fit`'s estimate of its plan (the same AutoFit makes) against the real peak;
    throughput against the grid's cells that fit."""
    if not bench.llama_peak:
        bench.llama_peak = bench.fit(bench.llama()).steady
    budget = capped_budget(bench)
    kwargs = dict(cost="flops", optimizers=["adamw"], checkpointing=bench.sizes.checkpointing)
    before = _ooms()
    with capped(bench, budget):
        autofit = AutoFit(budget=budget, **kwargs)
        run = bench.fit(bench.llama(), [autofit], steps=bench.sizes.timed_steps)
    ooms, real = _ooms() - before, max(run.peaks)
    plan = autofit.plan  # plan_fit's, as `memkit plan` prints it for this budget
    error = _error(plan.estimated_peak, real)
    figure = f"{error:+.2%} ({_label(plan)}: {plan.estimated_peak / MiB:,.1f} vs {real / MiB:,.1f} MiB)"
    bench.add("8. plan_fit at the capped size vs real", figure, "≤ 2 %", abs(error) <= 0.02)
    throughput = autofit.plan.micro_batch_size / run.step_time  # samples/s: a training batch is a micro-batch
    best, best_cell, b = 0.0, "none fits", bench.sizes.llama_batch[0]
    for micro, mode in bench.sizes.grid:
        module = bench.llama()
        module.batch_size = b // micro
        callbacks = [ActivationCheckpointing(checkpointing=mode)] if mode != "none" else []
        try:
            with capped(bench, budget):
                cell = bench.fit(
                    module, callbacks, steps=bench.sizes.timed_steps, accumulate_grad_batches=micro
                )
        except torch.OutOfMemoryError:
            continue
        held = max(cell.peaks) <= autofit.plan.limit  # held to the limit AutoFit plans to (its margin kept)
        if held and module.batch_size / cell.step_time > best:
            best = module.batch_size / cell.step_time
            best_cell = f"micro-batch {module.batch_size} x {micro}, {mode}: {b / best:.3f} s"
    ratio = throughput / best if best else math.nan
    figure = (
        f"{ooms} OOMs, peak {real / MiB:,.1f} ≤ {budget / MiB:,.1f} MiB, x{ratio:.2f} the grid's best "
        f"({b / throughput:.3f} s a batch of {b}; best {best_cell})"
    )
    fits = ooms == 0 and real <= budget
    note = "" if bench.cuda else "(CPU: the throughput is not judged)"
    met = fits and (ratio >= 0.95 or not bench.cuda)
    bench.add("5. AutoFit on the capped device", figure, "0 OOMs, ≤ budget, ≥ 0.95", met, note)


class _FirstPlan(pl.Callback):
    """AutoFit's plan as training starts, before an OOM re-plans it."""

    def __init__(self, autofit: AutoFit) -> None:
        self.autofit, self.plan = autofit, None

    def on_train_start(self, *args: Any) -> None:
        self.plan = self.autofit.plan


def oom_recovery(bench: Bench) -> None:
    """Row 6: an OOM in the first step's forward, recovered by AutoFit's guard (a real one on CUDA: the
    device capped below the plan AutoFit makes for a larger budget; PretendOOM's on the CPU)."""
    module = bench.gpt()
    batch = example_batch(module)
    naive = estimate_memory(module, batch, precision=bench.precision, device=bench.device)
    kwargs = dict(cost="flops", optimizers=["adamw"], checkpointing=bench.sizes.checkpointing)
    pretend = None if bench.cuda else PretendOOM(module, rows=module.batch_size // 2)
    with capped(bench, int(0.8 * naive.peak)):
        autofit = AutoFit(budget=2 * naive.peak, **kwargs)
        first = _FirstPlan(autofit)
        run = bench.fit(module, [autofit, first])
    if pretend is not None:
        pretend.remove()
    done, plan = run.trainer.global_step, autofit.plan
    figure = f"{done}/{bench.sizes.steps} steps; {_label(first.plan)} -> {_label(plan)}"
    met = done == bench.sizes.steps and plan != first.plan
    bench.add("6. an OOM in the first step recovered", figure, "every step, a leaner plan", met)


def monitor_overhead(bench: Bench) -> None:
    """Row 7: step time with MemoryMonitor over without, interleaved rounds, median of the ratios."""
    ratios = []
    for _ in range(bench.sizes.rounds):
        times = {}
        for label in ("plain", "monitor"):
            callbacks = [MemoryMonitor(plot=False, summary=False)] if label == "monitor" else []
            times[label] = bench.fit(
                bench.gpt(), callbacks, steps=bench.sizes.timed_steps, logger=True
            ).step_time
        ratios.append(times["monitor"] / times["plain"])
    ratio = statistics.median(ratios)
    bench.add(
        "7. MemoryMonitor overhead",
        f"x{ratio:.3f} step time",
        "≤ 1 %",
        ratio <= 1.01 if bench.cuda else None,
        "" if bench.cuda else "(CPU: timing only)",
    )


def fsdp2(bench: Bench) -> None:
    """Row 10: MemoryMonitor under FSDP2 (``fully_shard`` under ModelParallelStrategy, a world of one
    device) against the allocator, every step: the sharded parameters, the unsharded copies FSDP2 makes
    with ``storage.resize_`` and the collectives' buffers, followed."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    b, t = bench.sizes.llama_batch
    with torch.device(bench.device):
        module = ShardedLlama(bench.sizes.llama, b, t, bench.sizes.timed_steps)
    monitor = MemoryMonitor(plot=False, summary=False, log_every_n_steps=1)
    strategy = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1)
    worst, steps = monitor_one_rank(bench, module, monitor, strategy)
    split = monitor.sharded_history[-1][1] if monitor.sharded_history else {}
    bench.add(
        "10. MemoryMonitor under FSDP2 vs allocator, LLaMA",
        f"{worst:.3%} worst of {steps} steps; unsharded copies at the peak "
        f"{format_bytes(split.get('unsharded_parameters', 0))}",
        "≤ 0.1 %",
        worst <= 0.001 and not monitor._disabled,
    )


def monitor_one_rank(
    bench: Bench, module: pl.LightningModule, monitor: MemoryMonitor, strategy: Any
) -> tuple[float, int]:
    """Fit ``module`` under ``strategy`` over one device (a process group of one rank, destroyed after, and
    the variables Lightning sets for it put back); the monitor's worst error against the allocator and the
    steps it logged."""
    environ = dict(os.environ)
    try:
        run = bench.fit(module, around=[monitor], logger=True, strategy=strategy)
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()  # the next fits run without a process group
        os.environ.clear()
        os.environ.update(environ)
    measured = [b.peak for _, b in monitor.history]
    return max(abs(_error(m, p)) for m, p in zip(measured, run.peaks, strict=True)), len(measured)


def deepspeed_stage_2(bench: Bench) -> None:
    """Row 13: MemoryMonitor under Lightning's ``DeepSpeedStrategy(stage=2)`` over one device, every step
    against the allocator: DeepSpeed's flat 16-bit buffers, fp32 partitions and reduce buckets are its own
    allocations, which the monitor has never been held to (the strategy refuses a CPU)."""
    from lightning.pytorch.strategies import DeepSpeedStrategy

    monitor_other_strategy(bench, "13", "DeepSpeed stage 2", lambda: DeepSpeedStrategy(stage=2))


def fsdp1(bench: Bench) -> None:
    """Row 14: MemoryMonitor under Lightning's ``FSDPStrategy`` (FSDP1, FULL_SHARD, each LLaMA decoder layer
    a unit) over one device, every step against the allocator (the strategy refuses a CPU)."""
    from lightning.pytorch.strategies import FSDPStrategy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    monitor_other_strategy(bench, "14", "FSDP1", lambda: FSDPStrategy(auto_wrap_policy={LlamaDecoderLayer}))


def monitor_other_strategy(bench: Bench, number: str, name: str, make: Callable[[], Any]) -> None:
    """Rows 13 and 14: row 10's check under a strategy that needs a CUDA device; with ``--dry-run``, n/a."""
    what, bar = f"{number}. MemoryMonitor under {name} vs allocator, LLaMA", "≤ 0.1 %"
    if not bench.cuda:
        bench.add(what, "not run", bar, None, "(CPU: the strategy needs a GPU accelerator)")
        return
    monitor = MemoryMonitor(plot=False, summary=False, log_every_n_steps=1)
    worst, steps = monitor_one_rank(bench, bench.llama(), monitor, make())
    bench.add(what, f"{worst:.3%} worst of {steps} steps", bar, worst <= 0.001 and not monitor._disabled)


def compiled(bench: Bench) -> None:
    """Row 11: the LLaMA compiled in ``configure_model``: MemoryMonitor against the allocator every step (bar
    1 %, issue 26), the estimate of the compiled step (simulated from the code inductor generates, for the
    CPU: bar 3 %), and ActivationCheckpointing at 0.9 of that estimate, met through torch.compile's
    activation budget (the real peaks within it)."""
    b, t = bench.sizes.llama_batch
    with torch.device(bench.device):
        module = CompiledLlama(bench.sizes.llama, b, t, bench.sizes.timed_steps)
    monitor = MemoryMonitor(plot=False, summary=False, log_every_n_steps=1)
    run = bench.fit(module, around=[monitor], logger=True)
    measured = [b.peak for _, b in monitor.history]
    worst = max(abs(_error(m, p)) for m, p in zip(measured, run.peaks, strict=True))
    bench.add(
        "11. MemoryMonitor vs allocator, compiled LLaMA",
        f"{worst:.3%} worst of {len(measured)} steps",
        "≤ 1 %",
        worst <= 0.01,
        "" if bench.cuda else "(CPU: the profiler misses the batch, read only by generated kernels)",
    )
    estimate = estimate_memory(module, example_batch(module), precision=bench.precision, device=bench.device)
    error = _error(estimate.peak, run.steady)
    bench.add(
        "11. estimate vs real step, compiled LLaMA",
        f"{error:+.2%} ({estimate.peak / MiB:,.1f} vs {run.steady / MiB:,.1f} MiB)",
        "≤ 3 %",
        abs(error) <= 0.03,
    )
    budget = int(0.9 * estimate.peak)
    with torch.device(bench.device):
        module = CompiledLlama(bench.sizes.llama, b, t, bench.sizes.timed_steps)
    callback = ActivationCheckpointing(budget=budget)
    planned = bench.fit(module, [callback])
    plan = callback.plan
    chosen = plan.compile_budget if plan is not None else None
    bench.add(
        "11. ActivationCheckpointing at 0.9, compiled LLaMA",
        f"activation budget {chosen}; steady peak {planned.steady / MiB:,.1f} ≤ {budget / MiB:,.1f} MiB "
        f"(first step, compiling: {planned.peaks[0] / MiB:,.1f} MiB)",
        "a budget planned; steady peak ≤ budget",
        chosen is not None and planned.steady <= budget,
    )


def qlora(bench: Bench) -> None:
    """Row 12: QLoRA on the LLaMA shape (issue 45 item 7): rows 1 and 2's figures, the monitor against the
    allocator on every step and the estimate against the steady step, so that a device shows whether
    bitsandbytes' CUDA kernels allocate as its CPU ones do (they are other code)."""
    b, t = bench.sizes.llama_batch
    make = lambda: QLoraLlama(bench.sizes.llama, b, t, bench.sizes.timed_steps, bench.device)  # noqa: E731
    monitor_and_estimate(bench, "QLoRA LLaMA", make, rows=("12", "12"))


def offload(bench: Bench) -> None:
    """Row 9: the optimizer in host memory, bf16 weights: the device's peak as estimated, no state there."""
    module = bench.gpt()
    precision, bench.precision = bench.precision, "bf16-true"
    try:
        batch = example_batch(module)
        estimate = estimate_memory(module, batch, precision="bf16-true", device=bench.device, lever="offload")
        state = _StateOnDevice(bench.device)
        run = bench.fit(module, [OptimizerOffload(), state])
    finally:
        bench.precision = precision
    error = _error(estimate.peak, run.steady)
    on_device = state.nbytes
    bench.add(
        "9. OptimizerOffload, bf16 weights",
        f"{error:+.2%} ({estimate.peak / MiB:,.1f} vs {run.steady / MiB:,.1f} MiB); state on the device "
        f"{on_device:,} B",
        "≤ 2 %; state 0 B",
        abs(error) <= 0.02 and (on_device == 0 or not bench.cuda),
        "" if bench.cuda else "(CPU: the host is the device)",
    )


#: The quick rows first: a run cut short by ``--minutes`` keeps the most figures. Row 5's cap needs row 1's
#: LLaMA peak (measured again when that row was not run).
ROWS = (
    gpt_monitor_and_estimate,
    llama_monitor_and_estimate,
    fsdp2,
    optimizer_swap,
    offload,
    checkpointing,
    oom_recovery,
    autofit_and_plan,
    monitor_overhead,
    compiled,
    qlora,
    deepspeed_stage_2,
    fsdp1,
)


def table(bench: Bench, device: str, seconds: float) -> str:
    mark = {True: "met", False: "**missed**", None: "n/a"}
    lines = [
        f"{device}, {time.strftime('%Y-%m-%d')}, {seconds / 60:.1f} min",
        "",
        "| check | figure | bar | |",
        "|---|---|---|---|",
    ]
    lines += [f"| {r.what} | {r.figure} {r.note} | {r.bar} | {mark[r.met]} |" for r in bench.rows]
    return "\n".join(lines)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Warnings and Lightning's and the project's info logs off while the rows run, and back as they were
    after (a test runs `main` in a process whose other tests read them)."""
    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning_memkit")]
    levels = [logger.level for logger in loggers]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for logger in loggers:
            logger.setLevel(logging.ERROR)
        try:
            yield
        finally:
            for logger, level in zip(loggers, levels, strict=True):
                logger.setLevel(level)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU (what CI runs)")
    names = [row.__name__ for row in ROWS]
    parser.add_argument(
        "--rows", default=",".join(names), help=f"the rows to run, comma-separated, of: {', '.join(names)}"
    )
    parser.add_argument(
        "--minutes", type=float, default=math.inf,
        help="start no row after this many minutes: the rows left are listed as not run (a device's lease)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, help="also write the table here, again after every row")
    args = parser.parse_args(argv)
    chosen = [name.strip() for name in args.rows.split(",") if name.strip()]
    if unknown := sorted(set(chosen) - set(names)):
        parser.error(f"no row named {', '.join(unknown)}; the rows are {', '.join(names)}")
    if not args.dry_run and not torch.cuda.is_available():
        parser.error("no CUDA device here: run with --dry-run for the CPU check")
    device = torch.cuda.get_device_name(0) if not args.dry_run else "CPU (--dry-run)"
    start = time.perf_counter()
    with _quiet(), tempfile.TemporaryDirectory() as root:
        bench = Bench(DRY if args.dry_run else CUDA, cuda=not args.dry_run, root=Path(root))
        for row in (row for row in ROWS if row.__name__ in chosen):
            began = time.perf_counter()
            if began - start > 60 * args.minutes:
                bench.add(f"{row.__name__} not run", f"out of time ({args.minutes:g} min)", "runs", None)
                bench.not_run.append(row.__name__)
            else:
                try:
                    row(bench)
                except Exception as error:  # a failed row is a row of the table; the device time is not lost
                    traceback.print_exc()
                    figure = f"{type(error).__name__}: {error}"[:300]
                    bench.add(f"{row.__name__} raised", figure, "runs", False)
                    bench.raised.append(row.__name__)
                print(f"  ({row.__name__}: {time.perf_counter() - began:.0f} s)", file=sys.stderr, flush=True)
            if args.out:
                args.out.write_text(table(bench, device, time.perf_counter() - start) + "\n")
    print(table(bench, device, time.perf_counter() - start))
    unfinished = bench.raised or bench.not_run
    if args.dry_run:  # the bars are for the device: at tiny CPU sizes a row only has to run
        return 1 if unfinished else 0
    return 0 if not unfinished and all(r.met is not False for r in bench.rows) else 1


if __name__ == "__main__":
    sys.exit(main())
