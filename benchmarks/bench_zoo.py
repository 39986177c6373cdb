"""The model zoo's table: every feature against the allocator on models this project did not write.

For each model of ``tests/zoo.py`` (tiny random Hugging Face configs at their defaults, and a ResNet with
BatchNorm), or of its `FAMILIES` when named, on the CPU, with torch.profiler's memory timeline as the truth:

- monitor: the largest error of `MemoryMonitor` over 3 Trainer steps;
- estimate: `estimate_memory` against the steady Trainer step (the previous gradients alive);
- checkpointing: the real peak with full checkpointing of every block, against without (plain steps);
- plan: AutoFit at a budget 45 % of the way from the static memory to the naive peak, global batch 8:
  the plan, and its highest real micro-step against the budget.

A compiled model's batch is read only by generated kernels, which torch.profiler's timeline misses (see
tests/measuring/test_compiled.py, whose truth there is the CPU allocator's own count): its monitor error here
is mostly the profiler's.

A column that does not apply says why in its first words: "refused" where the library refuses the model
(NotImplementedError: the eager experts' ``nonzero``), "n/a" where the model has nothing for it
(ValueError: an RNN has no repeated blocks to checkpoint).

    python benchmarks/bench_zoo.py                # all models; prints a Markdown table (README's)
    python benchmarks/bench_zoo.py qwen2 t5       # some
    python benchmarks/bench_zoo.py efficientnet lstm gru qwen2_moe_eager compiled_llama   # issue 26's
"""

from __future__ import annotations

import logging
import re
import sys
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

import lightning.pytorch as pl
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from zoo import MODELS, ZOO, ZooModule, zoo_batch

from lightning_memkit import AutoFit, MemoryMonitor, apply_checkpointing, estimate_memory
from lightning_memkit.testing import AllocatorPeaks, allocator_peak


def _fit(module: pl.LightningModule, callbacks: list, max_steps: int) -> pl.Trainer:
    with tempfile.TemporaryDirectory() as root:
        trainer = pl.Trainer(
            default_root_dir=root, accelerator="cpu", devices=1, max_steps=max_steps, limit_val_batches=0,
            logger=pl.loggers.CSVLogger(root), callbacks=callbacks, enable_progress_bar=False,
            enable_model_summary=False, enable_checkpointing=False,
        )  # fmt: skip
        trainer.fit(module)
    return trainer


def monitor_and_estimate(name: str) -> tuple[str, str]:
    """The monitor's error and the estimate's, as cells. The estimate is asked before the fit, as a user asks,
    of the model as it trains: a "compiled" one compiled (``configure_model`` first)."""
    module = ZooModule(name)
    module.configure_model()
    estimate = _cell(lambda: estimate_memory(module, zoo_batch(name), device="cpu").peak)
    peaks, monitor = AllocatorPeaks(), MemoryMonitor(plot=False, summary=False)
    _fit(module, peaks.around(monitor), max_steps=3)
    monitor_error = max(abs(b.peak / t - 1) for (_, b), t in zip(monitor.history, peaks.peaks, strict=True))
    if isinstance(estimate, int):
        estimate = f"{estimate / max(peaks.peaks[1:]) - 1:+.3%}"
    return f"{monitor_error:.3%}", estimate


def _real_peak(name: str, mode: str) -> int:
    """The allocator's peak of a plain step (backward, step, zero_grad) with ``mode`` on every block."""
    module, batch = ZooModule(name), zoo_batch(name)
    module.configure_model()
    if hasattr(module.model, "config"):  # as checkpointing turns it off: the same computation
        module.model.config.use_cache = False
    opt = module.configure_optimizers()

    def step() -> None:
        module(batch).backward()
        opt.step()
        opt.zero_grad()

    with apply_checkpointing(module, mode):
        step()
        return allocator_peak(step)


def checkpointing_saving(name: str) -> float:
    return 1 - _real_peak(name, "full") / _real_peak(name, "none")


def plan(name: str) -> str:
    module = ZooModule(name, batch_size=8, n_batches=16)
    module.configure_model()  # a "compiled" model compiled, as it trains
    naive = estimate_memory(module, zoo_batch(name, 8), device="cpu")
    static = naive.parameters + naive.gradients + naive.optimizer_state
    budget = int(static + 0.45 * (naive.peak - static))
    peaks, callback = AllocatorPeaks(), AutoFit(budget=budget, cost="flops", optimizers=["adamw"])
    _fit(module, [callback, *peaks.around()], max_steps=2)
    p = callback.plan
    return (
        f"{p.micro_batch_size} x {p.accumulate_grad_batches}, {p.checkpointing}: "
        f"{max(peaks.peaks) / budget:.1%} of the budget"
    )


def _cell(compute: Callable[[], object]) -> object:
    """``compute``'s figure, or why there is none in a few words of the error: "refused" where the library
    refuses the model (NotImplementedError), "n/a" where the model has nothing for it (ValueError)."""
    try:
        return compute()
    except (NotImplementedError, ValueError) as error:
        verdict = "refused" if isinstance(error, NotImplementedError) else "n/a"
        return f"{verdict}: {_gist(str(error))}"


def _gist(message: str) -> str:
    if follow := re.search(r"cannot follow aten\.(\w+)\S* in (\S+?):", message):
        return f"{follow[1]} in {follow[2]}"
    if "no repeated blocks" in message:
        return "no repeated blocks"
    if fits := re.match(r"No plan fits (\S+ \S+) .*?the leanest plan \(.*?\) peaks at (\S+ \S+);", message):
        return f"no plan fits {fits[1]} (the leanest peaks at {fits[2]})"
    return message.split(":")[0][:60]


def row(name: str) -> str:
    torch.manual_seed(0)
    monitor, estimate = monitor_and_estimate(name)
    saving = _cell(lambda: f"{checkpointing_saving(name):.1%}")
    return f"| {name} | {monitor} | {estimate} | {saving} | {_cell(lambda: plan(name))} |"


def main(names: list[str]) -> None:
    columns = ("model", "monitor error", "estimate error", "full checkpointing saves", "AutoFit plan (peak)")
    rows = ["| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]
    for name in names:
        rows.append(row(name))
        print(rows[-1], file=sys.stderr, flush=True)
    print("\n".join(rows))


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("lightning_memkit").setLevel(logging.ERROR)
    unknown = [name for name in sys.argv[1:] if name not in ZOO]
    if unknown:
        sys.exit(f"Unknown model {', '.join(unknown)}; choose from {', '.join(ZOO)}")
    main(sys.argv[1:] or list(MODELS))
