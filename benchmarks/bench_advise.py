"""The advisor (issue 16): each finding's bytes against what applying its fix really saves.

For the GPT example and tiny Hugging Face models at their defaults (``tests/zoo.py``) and the CNN with
BatchNorm, `advise` names what the step's peak holds that it need not; each finding's fix is applied (a
callback; for the logits, `chunked_cross_entropy` in the training step: the GPT example's ``loss_chunks``,
or over a Hugging Face causal LM's base model and head) to a LightningModule in a Trainer on the CPU, and
the allocator's steady-step peak (torch.profiler's memory timeline, the highest step after the first) is
measured again:

- plain: the real steady peak, MiB;
- finding: the finding's kind and its ``saved`` (MiB);
- real: the real peak's drop with the fix applied (MiB), and finding / real - 1;
- seconds: how long `advise` took (all its simulated steps).

    python benchmarks/bench_advise.py
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from zoo import ChunkedLossModule, ZooModule, zoo_batch

from lightning_memkit import (
    ActivationCheckpointing,
    FusedOptimizerStep,
    GradientRelease,
    advise,
)
from lightning_memkit._diagnosis.advise import LOSS_CHUNKS
from lightning_memkit.demos.gpt import GPTDataModule, GPTLightningModule
from lightning_memkit.testing import AllocatorPeaks

MiB = 2**20

#: (batch, sequence) per model
SIZES = {
    "gpt": (8, 64),
    "qwen2": (2, 32),
    "gpt_neox": (2, 32),
    "gpt2": (2, 32),
    "bert": (2, 32),
    "t5": (4, 64),
    "resnet": (4, 64),
}


CAUSAL = ("qwen2", "gpt_neox", "gpt2")


def _model(name: str, chunked: bool = False):
    """A fresh module, its data (None: its own loader) and the first batch the loader gives; ``chunked``:
    its loss computed by `chunked_cross_entropy`."""
    torch.manual_seed(0)
    b, t = SIZES[name]
    if name == "gpt":
        x = torch.randint(0, 256, (b, t))
        data = GPTDataModule(batch_size=b, seq_len=t, num_sentences=300)
        module = GPTLightningModule("tiny", max_steps=3, loss_chunks=LOSS_CHUNKS if chunked else 1)
        return module, data, (x, x.roll(-1, 1))
    module = (ChunkedLossModule if chunked else ZooModule)(name, batch_size=b, seq_len=t, n_batches=4)
    return module, None, zoo_batch(name, b, t)


def _fix(name: str, kind: str, fix: str) -> tuple[list[pl.Callback], bool] | None:
    """The callbacks, and whether the loss is chunked, that apply a finding's fix; ``None``: not without
    editing the model."""
    if kind == "gradients":
        fused = fix.startswith("Trainer(callbacks=[FusedOptimizerStep")
        return [FusedOptimizerStep() if fused else GradientRelease()], False
    if kind == "activations":
        return [ActivationCheckpointing(checkpointing="full")], False
    if kind == "logits" and name in ("gpt", *CAUSAL):
        return [], True
    return None


def _steady_peak(module, data, callbacks) -> int:
    allocator = AllocatorPeaks()
    with tempfile.TemporaryDirectory() as root:
        trainer = pl.Trainer(
            default_root_dir=root, accelerator="cpu", devices=1, max_steps=3, limit_val_batches=0,
            logger=False, callbacks=[*callbacks, *allocator.around()], enable_progress_bar=False,
            enable_model_summary=False, enable_checkpointing=False,
        )  # fmt: skip
        trainer.fit(module, data)
    return max(allocator.peaks[1:])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("models", nargs="*", default=list(SIZES))
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    columns = ["plain (MiB)", "finding", "finding saves (MiB)", "real saving (MiB)", "finding / real - 1"]
    print(f"| model | {' | '.join(columns)} | advise (s) |")
    print("|---|---|---|---|---|---|---|")
    for name in args.models:
        module, data, batch = _model(name)
        start = time.perf_counter()
        advice = advise(module, batch, device="cpu")
        seconds = time.perf_counter() - start
        plain = _steady_peak(module, data, [])
        for finding in advice:
            fix = _fix(name, finding.kind, finding.fix)
            cells = [f"{plain / MiB:.2f}", finding.kind, f"{finding.saved / MiB:.2f}"]
            if fix is None:
                cells += ["(fix edits the model)", ""]
            else:
                callbacks, chunked = fix
                module, data, _ = _model(name, chunked)
                real = plain - _steady_peak(module, data, callbacks)
                cells += [f"{real / MiB:.2f}", f"{finding.saved / real - 1:+.1%}" if real else "n/a"]
            print(f"| {name} | {' | '.join(cells)} | {seconds:.1f} |", flush=True)
        if not advice.findings:
            print(f"| {name} | {plain / MiB:.2f} | (none) | | | | {seconds:.1f} |", flush=True)


if __name__ == "__main__":
    main()
