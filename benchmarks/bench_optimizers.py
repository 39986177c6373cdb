"""OptimizerSwap quality: the GPT example trained with each candidate of the catalogue vs AdamW.

Each run trains the ``tiny`` GPT preset (AdamW, decay / no-decay groups, warmup-cosine) for ``--steps``
optimizer steps from the same seed, on the same batches. The baseline keeps AdamW; every other run puts
``OptimizerSwap(budget=..., optimizers=(name,))`` in the Trainer with a budget the candidate's simulated
step fits and AdamW's does not, so the swap, the hyperparameter translation and the scheduler rebinding
are exactly what a user gets. Reported per candidate: the translated hyperparameters, the bytes of the
real ``optimizer.state`` after training (and per parameter), the estimated step peak, and the final
validation loss relative to AdamW's. The 8-bit AdamW must land within 2 % of AdamW (exit status 1 if not).

    python benchmarks/bench_optimizers.py [--steps 300] [--candidates adamw8bit lion ...]
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings

import lightning.pytorch as pl
import torch

from lightning_memkit import CATALOGUE, OptimizerSwap, estimate_memory, format_bytes, storage_bytes
from lightning_memkit._optimizers.swap import DEFAULT_CANDIDATES
from lightning_memkit.demos.gpt import GPTDataModule, GPTLightningModule

TOLERANCE = 0.02  # 8-bit AdamW's final validation loss may be at most 2 % above AdamW's


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per run (default: 300)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--learning-rate", type=float, default=3e-3, help="AdamW's peak lr (default: 3e-3)")
    parser.add_argument("--val-batches", type=int, default=20, help="validation batches at the end")
    parser.add_argument(
        "--candidates",
        nargs="+",
        default=[c for c in DEFAULT_CANDIDATES if c != "adamw"],
        choices=list(CATALOGUE),
    )
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


class _Lr(pl.Callback):
    """The decay group's highest lr over the run (the schedule's peak, after warmup)."""

    def __init__(self) -> None:
        self.peak = 0.0

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.peak = max(self.peak, optimizer.param_groups[0]["lr"])


def budget_for(name: str, args: argparse.Namespace) -> int:
    """A budget ``name``'s simulated step fits and AdamW's does not."""
    model = GPTLightningModule("tiny", learning_rate=args.learning_rate, max_steps=args.steps)
    x = torch.zeros(args.batch_size, args.seq_len, dtype=torch.long)
    adamw = estimate_memory(model, (x, x), optimizer="adamw", device="cpu").peak
    mine = estimate_memory(model, (x, x), optimizer=name, device="cpu").peak
    if mine >= adamw:
        raise SystemExit(
            f"{name}'s step ({format_bytes(mine)}) is not lighter than AdamW's ({format_bytes(adamw)})"
        )
    return mine


def train(name: str, args: argparse.Namespace, data: GPTDataModule) -> dict:
    callbacks: list[pl.Callback] = [lr := _Lr()]
    swap = None
    if name != "adamw":
        swap = OptimizerSwap(budget=budget_for(name, args), optimizers=(name,))
        callbacks.insert(0, swap)
    pl.seed_everything(args.seed, verbose=False)
    model = GPTLightningModule("tiny", learning_rate=args.learning_rate, max_steps=args.steps)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=args.steps,
        val_check_interval=args.steps,
        check_val_every_n_epoch=None,
        limit_val_batches=args.val_batches,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    start = time.perf_counter()
    trainer.fit(model, data)
    seconds = time.perf_counter() - start
    optimizer = trainer.optimizers[0]
    if swap is not None and (swap.choice is None or swap.choice.name != name):
        raise SystemExit(f"OptimizerSwap did not pick {name}: {swap.choice}")
    groups = optimizer.param_groups
    return {
        "name": name,
        "type": type(optimizer).__name__,
        "lr": lr.peak,
        "wd": groups[0]["weight_decay"],
        "state": storage_bytes(t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)),
        "params": sum(p.numel() for p in model.parameters()),
        "peak": swap.choice.peak if swap is not None else None,
        "val_loss": float(trainer.callback_metrics["val_loss"]),
        "train_loss": float(trainer.callback_metrics["train_loss"]),
        "seconds": seconds,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*[Pp]aged optimizers are not supported on CPU.*")
    data = GPTDataModule(batch_size=args.batch_size, seq_len=args.seq_len, seed=args.seed)
    rows = []
    for name in ["adamw", *[c for c in args.candidates if c != "adamw"]]:
        rows.append(train(name, args, data))
        r = rows[-1]
        print(
            f"{name}: val {r['val_loss']:.4f}, state {format_bytes(r['state'])}, {r['seconds']:.0f}s",
            flush=True,
        )

    base = rows[0]["val_loss"]
    print(
        f"\nGPT tiny, {rows[0]['params']:,} parameters, {args.steps} steps of {args.batch_size} x "
        f"{args.seq_len} tokens, AdamW lr {args.learning_rate:g} (warmup-cosine), seed {args.seed}\n"
    )
    header = (
        f"{'optimizer':<16} {'class':<15} {'peak lr':>9} {'wd':>8} {'state':>11} {'B/param':>8} "
        f"{'est. peak':>11} {'val loss':>9} {'vs AdamW':>9} {'time':>6}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        peak = format_bytes(r["peak"]) if r["peak"] is not None else "-"
        print(
            f"{r['name']:<16} {r['type']:<15} {r['lr']:>9.2e} {r['wd']:>8.3g} {format_bytes(r['state']):>11} "
            f"{r['state'] / r['params']:>8.2f} {peak:>11} {r['val_loss']:>9.4f} "
            f"{100 * (r['val_loss'] / base - 1):>+8.1f}% {r['seconds']:>5.0f}s"
        )
    eight = next((r for r in rows if r["name"] == "adamw8bit"), None)
    if eight is None:
        return 0
    gap = eight["val_loss"] / base - 1
    verdict = "PASS" if gap <= TOLERANCE else "FAIL"
    print(
        f"\n{verdict}: AdamW8bit's final validation loss is {100 * gap:+.2f}% off AdamW's "
        f"(limit +{TOLERANCE:.0%})."
    )
    return 0 if gap <= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main())
