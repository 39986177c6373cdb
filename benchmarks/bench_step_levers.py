"""The levers that change the step (issue 15): what each saves, and costs, on models we did not write.

Lever 1, `GradientRelease`: the gradients freed right after the optimizer step. Lever 2,
`FusedOptimizerStep`: each parameter stepped inside backward and its gradient freed. For the GPT example
and tiny Hugging Face models at their defaults (``tests/zoo.py``) and the CNN with BatchNorm, an unchanged
LightningModule in a Trainer on the CPU, with torch.profiler's memory timeline as the truth:

- plain: the allocator's peak of the steady step (the highest after the first), MiB;
- gradients: the model's gradient bytes, MiB;
- released / fused: the lever's steady peak, MiB, and what it saves as a share of the gradients;
- estimate: `estimate_memory(lever="release_gradients")` / `(lever="fused_step")` against the lever's real
  peak;
- step time: the lever's over plain, the median of per-pair ratios of interleaved runs (``--rounds``).

    python benchmarks/bench_step_levers.py
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

from lightning_memkit import FusedOptimizerStep, GradientRelease, estimate_memory
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
    if name in GPT:
        b, t = GPT[name]
        x = torch.randint(0, 256, (b, t))
        return GPTLightningModule("tiny"), GPTDataModule(batch_size=b, seq_len=t, num_sentences=2000), (x, x)
    b, t = SIZES[name]
    return ZooModule(name, batch_size=b, seq_len=t, n_batches=40), None, zoo_batch(name, b, t)


#: (batch, sequence) per zoo model: small batches, where these tiny models' steps peak in the forward (at
#: larger ones their backward or optimizer step peaks higher, and releasing saves nothing); the CNN peaks in
#: its backward at any size
SIZES = {
    "qwen2": (2, 32),
    "gpt_neox": (2, 32),
    "gpt2": (2, 32),
    "bert": (2, 32),
    "t5": (4, 64),
    "resnet": (4, 64),
}

#: the GPT example at its test size, and at one short sequence, where parameters, gradients and optimizer
#: state outweigh the activations (a large model's fine-tune): its step peaks in the optimizer step
GPT = {"gpt": (8, 64), "gpt_1x16": (1, 16)}

#: the step as each lever runs it: its callbacks and `estimate_memory`'s keywords
LEVERS = {
    "plain": ([], {}),
    "released": ([GradientRelease], {"lever": "release_gradients"}),
    "fused": ([FusedOptimizerStep], {"lever": "fused_step"}),
}


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
    for lever, (callbacks, kwargs) in LEVERS.items():
        module, data, batch = _model(name)
        allocator = AllocatorPeaks()
        _fit(module, data, [*(c() for c in callbacks), *allocator.around()], 3)
        row[lever] = max(allocator.peaks[1:])
        estimate = estimate_memory(module, batch, device="cpu", **kwargs)
        row[f"{lever} estimate"] = estimate.peak / row[lever] - 1
        if lever == "plain":
            trained = [p for p in module.parameters() if p.requires_grad]
            row["gradients"] = sum(p.numel() * p.element_size() for p in trained)
    return row


def step_time_ratios(name: str, rounds: int, steps: int) -> dict[str, float]:
    ratios: dict[str, list[float]] = {lever: [] for lever in LEVERS if lever != "plain"}
    for _ in range(rounds):
        means = {}
        for lever, (callbacks, _) in LEVERS.items():  # interleaved: each round shares the machine's state
            module, data, _ = _model(name)
            clock = _Clock()
            _fit(module, data, [clock, *(c() for c in callbacks)], steps)
            gaps = [b - a for a, b in zip(clock.starts[2:], clock.starts[3:], strict=False)]
            means[lever] = statistics.mean(gaps)
        for lever in ratios:
            ratios[lever].append(means[lever] / means["plain"])
    return {lever: statistics.median(r) for lever, r in ratios.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("models", nargs="*", default=[*GPT, *SIZES])
    parser.add_argument("--rounds", type=int, default=5, help="interleaved pairs of timed runs")
    parser.add_argument("--steps", type=int, default=20, help="steps per timed run")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    columns = ["plain", "gradients", "released", "fused", "estimate released / fused", "step time r. / f."]
    print(f"| model | {' | '.join(columns)} |")
    print("|---|---|---|---|---|---|---|")
    for name in args.models:
        row = peaks(name)
        cells = [f"{row['plain'] / MiB:.2f}", f"{row['gradients'] / MiB:.2f}"]
        for lever in ("released", "fused"):
            saved = (row["plain"] - row[lever]) / row["gradients"]
            cells.append(f"{row[lever] / MiB:.2f} ({saved:.0%})")
        cells.append(f"{row['released estimate']:+.2%} / {row['fused estimate']:+.2%}")
        times = step_time_ratios(name, args.rounds, args.steps)
        cells.append(f"{times['released']:.3f} / {times['fused']:.3f}")
        print(f"| {name} | {' | '.join(cells)} |", flush=True)


if __name__ == "__main__":
    main()
