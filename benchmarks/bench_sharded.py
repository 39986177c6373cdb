"""FSDP2 (torch's ``fully_shard`` under Lightning's ModelParallelStrategy) on 2 and 4 gloo CPU ranks: per
configuration, the worst error over every rank and step of MemoryMonitor against the allocator (the CPU
allocator's own count in every thread, `lightning_memkit.testing.counting_allocator`); each configuration's
step simulated in this process (``estimate_memory(strategy="fsdp2", world_size=N)`` with its keywords,
``memkit estimate --gpus N --strategy fsdp2``), and for the default layout the analytic fallback that
divides the one-device step (`shard(..., "fsdp", N)`), against rank 0's steady step; and what FSDP2
holds at rank 0's peak.

The ranks and configurations are tests/sharding/test_fsdp.py's (a Hugging Face LLaMA, uneven shards, AdamW).

Then tensor parallel 4, TP 2 x FSDP2 2 and HSDP 2 x 2 on 4 ranks, each applied by the module's
``configure_model`` under ModelParallelStrategy (tests/sharding/test_parallel_layouts.py's layouts and LLaMA,
4 key/value heads): MemoryMonitor against the allocator, every rank and step; the step simulated with the
module's ``configure_model`` as the layout (``parallelize_fn=ConfigureModel()``) and with the default
layout's keywords (``tensor_parallel_size``, ``replicate_size``), against every rank's steady step; and
`AutoFit`'s plan at a budget of the plain run's highest rank (every rank's peak in the plan's own run).

    python benchmarks/bench_sharded.py             # both tables
    python benchmarks/bench_sharded.py --layouts   # the second only
"""

import dataclasses
import json
import math
import os
import sys
import tempfile
import traceback
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import ModelParallelStrategy

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "sharding"))  # its test modules
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # helpers, models
from helpers import counted_rank, spawn_ranks
from test_fsdp import BATCH, BF16_POLICY, SCENARIOS, SEQ, STEPS, ShardedLlama, per_step_truth, read, run_ranks
from test_parallel_layouts import LAYOUTS, ParallelLlama
from zoo import zoo_batch

from lightning_memkit import AutoFit, ConfigureModel, MemoryMonitor, Sharding, estimate_memory
from lightning_memkit._breakdown import format_bytes
from lightning_memkit._estimating.analytic import shard
from lightning_memkit.testing import AllocatorPeaks, build_counting_allocator

#: Each configuration as `estimate_memory(strategy="fsdp2")` simulates it: its keywords.
SIMULATED = {
    "default": {},
    "no_reshard": {"reshard_after_forward": False},
    "full_checkpointing": {"checkpointing": "full"},
    "selective_checkpointing": {"checkpointing": "selective"},
    "bf16_policy": {"mp_policy": BF16_POLICY},
    "accumulation": {"accumulating": True},
    "gradient_release": {"lever": "release_gradients"},
    "fused_step": {"lever": "fused_step"},
}


def _fsdp2_peak(module: pl.LightningModule, batch: torch.Tensor, world: int, options: dict) -> int:
    """One rank's simulated peak over ``world`` ranks, ``options`` `estimate_memory`'s and the layout's."""
    fields = {f.name for f in dataclasses.fields(Sharding)}
    layout = Sharding(world, **{k: v for k, v in options.items() if k in fields})
    rest = {k: v for k, v in options.items() if k not in fields}
    return estimate_memory(module, batch, device="cpu", sharding=layout, **rest).peak


def fsdp2_table() -> None:
    rows = []
    for world in (2, 4):
        module = ShardedLlama(world)
        whole = estimate_memory(module, zoo_batch("qwen2", BATCH, SEQ), optimizer="adamw", device="cpu")
        grads = 4 * sum(p.numel() for p in module.parameters())
        divided = shard(whole, "fsdp", world, gradient_bytes=grads).peak
        batch = zoo_batch("qwen2", BATCH, SEQ)
        simulated = {name: _fsdp2_peak(module, batch, world, options) for name, options in SIMULATED.items()}
        with tempfile.TemporaryDirectory() as tmp:
            run_ranks(Path(tmp), world)
            for name, config in SCENARIOS.items():
                records = [read(Path(tmp), name, rank) for rank in range(world)]
                accumulate = config.get("accumulate_grad_batches", 1)
                errors = [
                    m["peak"] / t - 1
                    for r in records
                    for m, t in zip(r["monitor"], per_step_truth(r, accumulate), strict=True)
                ]
                steady = per_step_truth(records[0], accumulate)[-1]
                split = records[0]["sharded"][-1]
                default = name == "default"
                rows.append(
                    (str(world), name, format_bytes(steady), f"{max(errors, key=abs):+.3%}",
                     f"{simulated[name] / steady - 1:+.2%}" if name in simulated else "—",
                     f"{divided / steady - 1:+.1%}" if default else "—",
                     format_bytes(split["sharded_parameters"]), format_bytes(split["unsharded_parameters"]),
                     format_bytes(split["sharded_gradients"] + split["unsharded_gradients"]),
                     format_bytes(split["communication"]))
                )  # fmt: skip
    print(f"LLaMA (tiny, vocabulary 131), AdamW, fp32 weights, {BATCH} x {SEQ} tokens a rank, {STEPS} steps")
    header = (
        "ranks", "configuration", "rank 0 steady", "monitor, worst err", "simulated fsdp2 err",
        "divided by N err", "sharded params", "unsharded params", "FSDP2 gradients", "communication",
    )  # fmt: skip
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")


# --- tensor parallel, 2-D and HSDP --------------------------------------------------------------------

WORLD = 4
#: Each layout's name in the table, and `estimate_memory`'s keywords for its default layout (pure tensor
#: parallel has none: the default layout shards with FSDP2 too).
LAYOUT_ROWS = {
    "tp4": ("TP 4", None),
    "tp2x2": ("TP 2 x FSDP2 2", {"tensor_parallel_size": 2}),
    "hsdp2x2": ("HSDP 2 x 2", {"replicate_size": 2}),
}


class _Peaks(pl.Callback):
    """Writes each rank's allocator peaks (per batch), and the monitor's or AutoFit's figures."""

    def __init__(self, out: Path, peaks: AllocatorPeaks, watcher: MemoryMonitor | AutoFit, budget=None):
        self.out, self.peaks, self.watcher, self.budget = out, peaks, watcher, budget

    def on_train_end(self, trainer, pl_module):
        record = {"allocator": self.peaks.peaks, "global_step": trainer.global_step}
        if isinstance(self.watcher, MemoryMonitor):
            record["monitor"] = [b.peak for _, b in self.watcher.history]
        else:
            record |= {"plan": self.watcher.plan.as_dict(), "budget": self.budget}
        (self.out / f"rank_{trainer.global_rank}.json").write_text(json.dumps(record))


def _fit(out: Path, layout: str, callbacks: list) -> None:
    data_parallel, tensor_parallel = LAYOUTS[layout]
    strategy = ModelParallelStrategy(data_parallel_size=data_parallel, tensor_parallel_size=tensor_parallel)
    torch.manual_seed(0)
    pl.Trainer(
        default_root_dir=out, accelerator="cpu", devices=WORLD, max_steps=STEPS, log_every_n_steps=1,
        strategy=strategy, logger=CSVLogger(out, name=layout), callbacks=callbacks, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False,
    ).fit(ParallelLlama(layout))  # fmt: skip


def _watched(out: Path, layout: str) -> None:
    peaks, monitor = AllocatorPeaks(all_threads=True), MemoryMonitor(plot=False, summary=False)
    _fit(out, layout, [*peaks.around(monitor), _Peaks(out, peaks, monitor)])


def _autofit(out: Path, layout: str) -> None:
    """AutoFit at a budget of the watched run's highest rank: the plain step does not fit within its
    margin."""
    record = out.parent / f"{layout}-watched" / f"rank_{torch.distributed.get_rank()}.json"
    plain = torch.tensor(max(json.loads(record.read_text())["allocator"]) if record.exists() else 0)
    torch.distributed.all_reduce(plain, op=torch.distributed.ReduceOp.MAX)
    budget = math.ceil(plain.item())
    peaks, autofit = AllocatorPeaks(all_threads=True), AutoFit(budget=budget, cost="flops")
    _fit(out, layout, [*peaks.around(autofit), _Peaks(out, peaks, autofit, budget)])


def _layout_rank(rank: int, out: Path) -> None:
    counted_rank(out, rank, WORLD)
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")  # Lightning then launches no processes itself
    for layout in LAYOUT_ROWS:
        for name, run in (("watched", _watched), ("autofit", _autofit)):
            folder = out / f"{layout}-{name}"
            folder.mkdir(exist_ok=True)
            try:
                run(folder, layout)
            except Exception:
                (folder / f"error_{rank}.txt").write_text(traceback.format_exc())
    torch.distributed.destroy_process_group()


def _simulated(layout: str, **keywords) -> int:
    """One rank's steady step of ``layout``, simulated in this process."""
    keywords.setdefault("tensor_parallel_size", LAYOUTS[layout][1])
    return estimate_memory(
        ParallelLlama(layout), zoo_batch("qwen2", BATCH, SEQ), device="cpu",
        sharding=Sharding(WORLD, **keywords),
    ).peak  # fmt: skip


def _worst(estimate: int, steady: list[int]) -> str:
    return f"{max((estimate / t - 1 for t in steady), key=abs):+.2%}"


def _plan(out: Path, layout: str) -> list[str]:
    errors = sorted((out / f"{layout}-autofit").glob("error_*.txt"))
    if errors:
        return [errors[0].read_text().strip().splitlines()[-1][:120], "—", "—", "—"]
    records = [read(out, f"{layout}-autofit", rank) for rank in range(WORLD)]
    plan, budget = records[0]["plan"], records[0]["budget"]
    checkpointing = plan["checkpointing"] if plan["checkpoint_plan"] is None else "per block"
    worst = max(max(r["allocator"]) for r in records)
    batches = f"{plan['micro_batch_size']} x {plan['accumulate_grad_batches']}"
    return [
        format_bytes(budget),
        f"{batches}, {checkpointing}, {plan['optimizer']}",
        format_bytes(plan["estimated_peak"]),
        f"{format_bytes(worst)} ({worst / budget:.0%})",
    ]


def layouts_table() -> None:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        build_counting_allocator()  # compiled here once, not by every rank at the same time
        spawn_ranks(_layout_rank, (out,), WORLD, "tensor-parallel and HSDP")
        for layout, (name, keywords) in LAYOUT_ROWS.items():
            records = [read(out, f"{layout}-watched", rank) for rank in range(WORLD)]
            errors = [
                m / t - 1 for r in records for m, t in zip(r["monitor"], per_step_truth(r, 1), strict=True)
            ]
            steady = [per_step_truth(r, 1)[-1] for r in records]
            function = _simulated(layout, parallelize_fn=ConfigureModel())
            default = "—" if keywords is None else _worst(_simulated(layout, **keywords), steady)
            rows.append(
                (str(WORLD), name, format_bytes(steady[0]), f"{max(errors, key=abs):+.3%}",
                 _worst(function, steady), default, *_plan(out, layout))
            )  # fmt: skip
    print(
        f"\nLLaMA (tiny, vocabulary 131, 4 key/value heads), AdamW, fp32 weights, {BATCH} x {SEQ} tokens a "
        f"data-parallel rank, {STEPS} steps, {WORLD} gloo ranks, the layout applied in configure_model"
    )
    header = (
        "ranks", "layout", "rank 0 steady", "monitor, worst err", "simulated (configure_model), worst err",
        "simulated (keywords), worst err", "AutoFit budget", "plan (micro-batch x accumulation, "
        "checkpointing, optimizer)", "plan's estimate", "every rank's peak, highest (of budget)",
    )  # fmt: skip
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")


def main() -> None:
    if "--layouts" not in sys.argv[1:]:
        fsdp2_table()
    layouts_table()


if __name__ == "__main__":
    main()
