"""GradientRelease (issue 15, lever 1): what freeing the gradients after the optimizer step saves, and costs.

For the GPT example and tiny Hugging Face models at their defaults (``tests/zoo.py``), an unchanged
LightningModule in a Trainer on the CPU, with torch.profiler's memory timeline as the truth:

- peak without / with: the allocator's peak of the steady step (the highest after the first), MiB;
- gradients: their bytes (what Lightning's order keeps alive through the forward), MiB;
- saved / gradients: the share of them the peak loses (100 % where the step still peaks in its forward;
  less where the backward's first ops rise above what the forward left);
- estimate: `estimate_memory(release_gradients=True)` against the released step's real peak;
- step time: with / without, the median of per-pair ratios of interleaved runs (``--rounds``).

    python benchmarks/bench_gradient_release.py
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from zoo import ZooModule, zoo_batch

from lightning_memkit import GradientRelease, estimate_memory
from lightning_memkit.demos.gpt import GPTDataModule, GPTLightningModule
from lightning_memkit.testing import AllocatorPeaks

MiB = 2**20


class _Clock(pl.Callback):
    def __init__(self) -> None:
        self.starts: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.starts.append(time.perf_counter())


def _model(name: str):
    """A fresh module, its data (None: its own loader) and the first batch the loader gives."""
    torch.manual_seed(0)
    if name == "gpt":
        x = torch.randint(0, 256, (8, 64))
        return GPTLightningModule("tiny"), GPTDataModule(batch_size=8, seq_len=64, num_sentences=2000), (x, x)
    b, t = SIZES[name]
    return ZooModule(name, batch_size=b, seq_len=t, n_batches=40), None, zoo_batch(name, b, t)


#: (batch, sequence) per zoo model: small batches, where these tiny models' steps peak in the forward (at
#: larger ones their backward or optimizer step peaks higher, and releasing saves nothing)
SIZES = {"qwen2": (2, 32), "gpt_neox": (2, 32), "gpt2": (2, 32), "bert": (2, 32), "t5": (4, 64)}


def _fit(module, data, callbacks, max_steps: int) -> None:
    with tempfile.TemporaryDirectory() as root:
        trainer = pl.Trainer(
            default_root_dir=root, accelerator="cpu", devices=1, max_steps=max_steps, limit_val_batches=0,
            logger=False, callbacks=callbacks, enable_progress_bar=False, enable_model_summary=False,
            enable_checkpointing=False,
        )  # fmt: skip
        trainer.fit(module, data)


def peaks(name: str) -> dict[str, float]:
    row = {}
    for release in (False, True):
        module, data, batch = _model(name)
        allocator = AllocatorPeaks()
        _fit(module, data, [*([GradientRelease()] if release else []), *allocator.around()], 3)
        row[release] = max(allocator.peaks[1:])
        if release:
            estimate = estimate_memory(module, batch, device="cpu", release_gradients=True)
            row["estimate"] = estimate.peak / row[True] - 1
            row["gradients"] = estimate_memory(module, batch, device="cpu").gradients
    return row


def step_time_ratio(name: str, rounds: int, steps: int) -> float:
    ratios = []
    for _ in range(rounds):
        means = {}
        for release in (False, True):  # interleaved: each pair shares the machine's state
            module, data, _ = _model(name)
            clock = _Clock()
            _fit(module, data, [clock, *([GradientRelease()] if release else [])], steps)
            gaps = [b - a for a, b in zip(clock.starts[2:], clock.starts[3:], strict=False)]
            means[release] = statistics.mean(gaps)
        ratios.append(means[True] / means[False])
    return statistics.median(ratios)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("models", nargs="*", default=["gpt", *SIZES])
    parser.add_argument("--rounds", type=int, default=5, help="interleaved pairs of timed runs")
    parser.add_argument("--steps", type=int, default=20, help="steps per timed run")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    columns = ["peak without (MiB)", "peak with (MiB)", "gradients (MiB)", "saved / gradients", "estimate"]
    print(f"| model | {' | '.join(columns)} | step time |")
    print("|---|---|---|---|---|---|---|")
    for name in args.models:
        row = peaks(name)
        saved = (row[False] - row[True]) / row["gradients"]
        ratio = step_time_ratio(name, args.rounds, args.steps)
        print(
            f"| {name} | {row[False] / MiB:.2f} | {row[True] / MiB:.2f} | {row['gradients'] / MiB:.2f} | "
            f"{saved:.1%} | {row['estimate']:+.2%} | {ratio:.3f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
