"""bf16 weights and the compensated update (issue 15, lever 3): what 16-bit weights save, and what an
uncompensated update loses.

The GPT example (tiny, 8 × 64, its warm-up/cosine schedule) trained for ``--steps`` steps on the CPU:

- fp32 AdamW (``precision="32-true"``): the reference;
- bf16-true with torch's AdamW: bf16 weights and bf16 moments, each update rounded to bf16;
- bf16-true with torch-optimi's AdamW, Kahan-summed (``"adamw_kahan"``, what `plan_fit` plans for
  bf16-true): a bf16 compensation buffer keeps the low bits the rounding loses;
- bf16-true with ``"adamw_kahan"`` and `FusedOptimizerStep` (lever 2 on top);
- bf16-true with torch's AdamW offloaded (`OptimizerOffload`, lever 4): the update on fp32 master weights,
  with AdamW's state and the gradients' sum, in host memory;
- fp32 AdamW with the loss over 8 slices of the tokens (``loss_chunks=8``, `chunked_cross_entropy`,
  lever 5): the whole batch's logits never exist.

For each: the allocator's steady-step peak (torch.profiler's memory timeline, MiB) and the estimate's
error against it (3 profiled steps; on the CPU the host is the device, so an offloaded optimizer's masters
and state are in that peak), what `estimate_memory` gives for the same step on a CUDA device (MiB: there
the host's bytes are not the device's), the step time over fp32 AdamW's (median of per-step times of the
unprofiled run, all runs in one process),
and the validation loss after the same steps (nats per byte, the example's 4 validation batches).

    python benchmarks/bench_bf16_update.py --steps 300
"""

from __future__ import annotations

import argparse
import functools
import logging
import statistics
import tempfile
import time
import warnings

import lightning.pytorch as pl
import torch

from lightning_memkit import FusedOptimizerStep, OptimizerOffload, estimate_memory
from lightning_memkit.demos.gpt import GPTDataModule, GPTLightningModule
from lightning_memkit.testing import AllocatorPeaks

MiB = 2**20
B, T = 8, 64


class _CompensatedFused(GPTLightningModule):
    """The example on the catalogue's Kahan-summed AdamW (``optimizer="adamw_kahan"``), rebuilt with
    optimi's ``gradient_release=True``: its per-parameter step, which `FusedOptimizerStep` requires of
    torch-optimi's optimizers (they count steps per param group). Same hyperparameters as the unfused
    row's."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, optimizer="adamw_kahan", **kwargs)

    def configure_optimizers(self):
        config = super().configure_optimizers()
        kahan = config["optimizer"]
        groups = [dict(group, gradient_release=True) for group in kahan.param_groups]
        # Every hyperparameter is in the groups, copied; the constructor's are only defaults.
        config["optimizer"] = type(kahan)(groups, lr=groups[0]["lr"], kahan_sum=True, gradient_release=True)
        config["lr_scheduler"]["scheduler"].optimizer = config["optimizer"]
        return config


KAHAN = functools.partial(GPTLightningModule, optimizer="adamw_kahan")

#: name -> (module class, precision, extra callbacks)
RUNS = {
    "fp32 AdamW": (GPTLightningModule, "32-true", []),
    "bf16-true AdamW": (GPTLightningModule, "bf16-true", []),
    "bf16-true AdamW, Kahan": (
        functools.partial(GPTLightningModule, optimizer="adamw_kahan"),
        "bf16-true",
        [],
    ),
    "bf16-true AdamW, Kahan, fused step": (_CompensatedFused, "bf16-true", [FusedOptimizerStep]),
    "bf16-true AdamW, offloaded": (GPTLightningModule, "bf16-true", [OptimizerOffload]),
    "fp32 AdamW, chunked loss": (functools.partial(GPTLightningModule, loss_chunks=8), "32-true", []),
}


class _Clock(pl.Callback):
    def __init__(self) -> None:
        self.starts: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.starts.append(time.perf_counter())


def _fit(name: str, steps: int, callbacks: list) -> tuple[pl.LightningModule, pl.Trainer]:
    cls, precision, extra = RUNS[name]
    torch.manual_seed(0)
    module = cls("tiny", max_steps=steps)
    data = GPTDataModule(batch_size=B, seq_len=T, num_sentences=2000)
    with tempfile.TemporaryDirectory() as root:
        trainer = pl.Trainer(
            default_root_dir=root, accelerator="cpu", devices=1, max_steps=steps, precision=precision,
            limit_val_batches=4, val_check_interval=steps, check_val_every_n_epoch=None, logger=False,
            callbacks=[*callbacks, *(c() for c in extra)], enable_progress_bar=False,
            enable_model_summary=False, enable_checkpointing=False,
        )  # fmt: skip
        trainer.fit(module, data)
    return module, trainer


def run(name: str, steps: int) -> dict[str, float]:
    """Three profiled steps for the peak (every profiled step is slower), then the timed run."""
    _, precision, extra = RUNS[name]
    peaks = AllocatorPeaks()
    module, _ = _fit(name, 3, peaks.around())
    x = torch.randint(0, 256, (B, T))
    lever = "fused_step" if FusedOptimizerStep in extra else "offload" if OptimizerOffload in extra else None
    estimate = estimate_memory(module, (x, x), device="cpu", precision=precision, lever=lever)
    cuda = estimate_memory(module, (x, x), device="cuda", precision=precision, lever=lever)
    clock = _Clock()
    _, trainer = _fit(name, steps, [clock])
    gaps = [b - a for a, b in zip(clock.starts[3:], clock.starts[4:], strict=False)]
    peak = max(peaks.peaks[1:])
    return {
        "peak": peak,
        "estimate": estimate.peak / peak - 1,
        "cuda": cuda.peak,
        "step": statistics.median(gaps),
        "val_loss": float(trainer.callback_metrics["val_loss"]),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    rows = {name: run(name, args.steps) for name in RUNS}
    reference = rows["fp32 AdamW"]
    print(f"GPT example (tiny, {B} x {T}), {args.steps} steps, CPU")
    print("| run | peak (MiB) | saved vs fp32 AdamW | estimate | on CUDA (MiB) | step time | val loss |")
    print("|---|---|---|---|---|---|---|")
    for name, row in rows.items():
        saved = 1 - row["peak"] / reference["peak"]
        print(
            f"| {name} | {row['peak'] / MiB:.2f} | {saved:.1%} | {row['estimate']:+.2%} | "
            f"{row['cuda'] / MiB:.2f} | "
            f"{row['step'] / reference['step']:.2f} | {row['val_loss']:.3f} |"
        )


if __name__ == "__main__":
    main()
