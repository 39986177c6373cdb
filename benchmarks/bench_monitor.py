"""MemoryMonitor figures: (a) measured peak vs the allocator's, per workload; (b) step-time overhead.

(a) Each workload is trained for a few steps in a Trainer with MemoryMonitor, and the allocator's peak of
    the very same Trainer step is taken alongside (CPU: torch.profiler's memory timeline; CUDA:
    ``torch.cuda.max_memory_allocated``, reset each step). Steps 0 and 1 are measured from scratch, later
    steps reuse their measured twin, so both paths are compared.
(b) The GPT example (``tiny``) trained with and without MemoryMonitor at its default settings, in
    interleaved runs; each run's mean step time (all steps but the first two, which are warm-up in both)
    is compared and the median of the per-pair ratios printed.

    python benchmarks/bench_monitor.py [--accelerator cpu|gpu] [--steps 150] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger

from lightning_memkit import MemoryMonitor
from lightning_memkit.demos.gpt import GPTDataModule, GPTLightningModule
from lightning_memkit.testing import AllocatorPeaks

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from models import EncoderLM


class StepTimer(pl.Callback):
    """Wall time from one batch start to the next: the whole loop iteration, callbacks included."""

    def __init__(self) -> None:
        self.starts: list[float] = []

    def on_train_batch_start(self, *args):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.starts.append(time.perf_counter())

    def step_times(self) -> list[float]:
        return [b - a for a, b in zip(self.starts, self.starts[1:], strict=False)]


def _trainer(
    root: str, accelerator: str, callbacks: list, steps: int, precision: str = "32-true"
) -> pl.Trainer:
    return pl.Trainer(
        default_root_dir=root,
        accelerator=accelerator,
        devices=1,
        max_steps=steps,
        precision=precision,
        logger=CSVLogger(root),
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=0,
    )


def accuracy(accelerator: str, steps: int = 4) -> None:
    device = torch.device("cuda" if accelerator == "gpu" else "cpu")
    workloads = {
        "gpt tiny (ours)": lambda: (GPTLightningModule("tiny"), GPTDataModule(batch_size=16, seq_len=128)),
        "gpt tiny bf16-mixed": lambda: (
            GPTLightningModule("tiny"),
            GPTDataModule(batch_size=16, seq_len=128),
        ),
        "nn.TransformerEncoder x4": lambda: (
            EncoderLM(d_model=128, n_layer=4, seq_len=128, batch_size=16),
            None,
        ),
        "nn.TransformerEncoder foreach=False": lambda: (
            EncoderLM(d_model=128, n_layer=4, foreach=False),
            None,
        ),
    }
    print("(a) measured peak vs allocator peak, same Trainer step")
    print(f"{'workload':<38}{'step':>5}{'measured MiB':>14}{'allocator MiB':>15}{'error':>9}")
    worst = 0.0
    for name, make in workloads.items():
        model, data = make()
        probe, monitor = AllocatorPeaks(device), MemoryMonitor(plot=False, summary=False)
        precision = "bf16-mixed" if "bf16" in name else "32-true"
        with tempfile.TemporaryDirectory() as root:
            trainer = _trainer(root, accelerator, probe.around(monitor), steps, precision)
            trainer.fit(model, datamodule=data)
        for (step, b), truth in zip(monitor.history, probe.peaks, strict=True):
            error = (b.peak - truth) / truth
            worst = max(worst, abs(error))
            print(f"{name:<38}{step:>5}{b.peak / 2**20:>14.2f}{truth / 2**20:>15.2f}{100 * error:>+8.2f}%")
    print(f"worst |error|: {100 * worst:.3f}%\n")


def overhead(accelerator: str, steps: int, rounds: int) -> None:
    print(
        f"(b) overhead of MemoryMonitor(defaults) on the GPT example, "
        f"{rounds} interleaved pairs of {steps} steps"
    )
    ratios, plain_means, monitored_means = [], [], []
    for _ in range(rounds):
        means = {}
        for with_monitor in (False, True):
            torch.manual_seed(0)
            timer = StepTimer()
            callbacks = [timer, MemoryMonitor(plot=False, summary=False)] if with_monitor else [timer]
            with tempfile.TemporaryDirectory() as root:
                trainer = _trainer(root, accelerator, callbacks, steps)
                trainer.fit(GPTLightningModule("tiny"), datamodule=GPTDataModule(batch_size=16, seq_len=128))
            times = timer.step_times()[2:]  # the first two steps are warm-up for both runs
            means[with_monitor] = statistics.fmean(times)
        plain_means.append(means[False])
        monitored_means.append(means[True])
        ratios.append(means[True] / means[False])
    print(f"mean step time without: {1000 * statistics.median(plain_means):.1f} ms (median of runs)")
    print(f"mean step time with:    {1000 * statistics.median(monitored_means):.1f} ms (median of runs)")
    print(
        f"overhead ratio (median of pairs): {statistics.median(ratios):.4f}  pairs: "
        + " ".join(f"{r:.3f}" for r in ratios)
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--accelerator", default="cpu", choices=["cpu", "gpu"])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--skip-overhead", action="store_true")
    args = parser.parse_args()
    accuracy(args.accelerator)
    if not args.skip_overhead:
        overhead(args.accelerator, args.steps, args.rounds)


if __name__ == "__main__":
    import warnings

    warnings.filterwarnings("ignore")
    main()
