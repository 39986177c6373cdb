"""AutoFit's plan against the run it gets, for loaders whose samples are not along dimension 0 of every
tensor (issue 46 items 1, 2 and 5).

    python benchmarks/bench_loaders.py

Each case fits for real on the CPU with `MemoryMonitor` beside `AutoFit` (``cost="flops"``, no
checkpointing, no margin), at a budget halfway between the step at half the user's batch and the step at
the whole batch, so the plan must split it:

- ``lstm (T, B)``: a 2-layer LSTM fed torch's default RNN layout, (T=24, B, 8);
- ``position_ids (1, T)``: token and position embeddings, the position ids one row every sample shares;
- ``4 x 2 as set up``: a regression at micro-batch 4 with ``accumulate_grad_batches=2`` and a budget that
  fits it as it is.

Printed: the plan, the shape of the batches the steps got, the planned peak, the steady real peak (the
monitor's, exact on the CPU: tests/callbacks/test_memory_monitor.py) and whether every step stayed in the
budget. For the LSTM, ``before`` is what taking dimension 0 for the samples gave: its inputs (T, B, 8) and
targets (B, 1) disagree there, so it was refused (with time-major targets too, it planned along T while the
loader went on yielding B).
"""

from __future__ import annotations

import logging
import tempfile
import warnings

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader

from lightning_memkit import AutoFit, MemoryMonitor, plan_fit
from lightning_memkit._estimating.lightning_step import batch_slice


class LSTM(L.LightningModule):
    def __init__(self, batch_size: int = 16) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.rnn, self.head = nn.LSTM(8, 64, num_layers=2), nn.Linear(64, 1)
        self.shapes: list[tuple] = []

    def training_step(self, batch, batch_idx):
        x, y = batch  # (T, B, 8), (B, 1)
        self.shapes.append(tuple(x.shape))
        out, _ = self.rnn(x)
        return F.mse_loss(self.head(out[-1]), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        rows = list(zip(torch.randn(64, 24, 8, generator=g), torch.randn(64, 1, generator=g), strict=True))
        return DataLoader(rows, batch_size=self.batch_size, collate_fn=time_major)


def time_major(rows):
    x, y = zip(*rows, strict=True)
    return torch.stack(x, dim=1), torch.stack(y)


class Positional(L.LightningModule):
    T = 16

    def __init__(self, batch_size: int = 8) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.tok, self.pos = nn.Embedding(64, 32), nn.Embedding(self.T, 32)
        self.out = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 64))
        self.shapes: list[tuple] = []

    def training_step(self, batch, batch_idx):
        self.shapes.append(tuple(batch["input_ids"].shape))
        h = self.tok(batch["input_ids"]) + self.pos(batch["position_ids"])
        return F.cross_entropy(self.out(h).flatten(0, 1), batch["input_ids"].flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        ids = torch.randint(0, 64, (64, self.T), generator=torch.Generator().manual_seed(0))
        return DataLoader(list(ids), batch_size=self.batch_size, collate_fn=self.collate)

    def collate(self, rows):
        return {"input_ids": torch.stack(rows), "position_ids": torch.arange(self.T)[None]}


class Regression(L.LightningModule):
    def __init__(self, batch_size: int = 4) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
        self.shapes: list[tuple] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.shapes.append(tuple(x.shape))
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(64, 16, generator=g)
        return DataLoader(list(zip(x, x.sum(1, keepdim=True), strict=True)), batch_size=self.batch_size)


def first_batch(module):
    return next(iter(module.train_dataloader()))


def peak(module, batch, axes=None) -> int:
    plan = plan_fit(module, batch, "100TB", margin=0.0, device="cpu", cost="flops", checkpointing="none",
                    batch_axes=axes, micro_batch_size=None)  # fmt: skip
    return plan.alternatives[-1].peak if plan.alternatives else plan.estimated_peak


def fit(module, budget, accumulate=1):
    monitor = MemoryMonitor()
    autofit = AutoFit(budget=budget, margin=0.0, cost="flops", checkpointing="none")
    with tempfile.TemporaryDirectory() as out, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        L.Trainer(
            default_root_dir=out, accelerator="cpu", devices=1, max_steps=3, logger=CSVLogger(out),
            log_every_n_steps=1, enable_progress_bar=False, enable_model_summary=False,
            enable_checkpointing=False, accumulate_grad_batches=accumulate, callbacks=[monitor, autofit],
        ).fit(module)  # fmt: skip
    return autofit.plan, [b.peak for _, b in monitor.history]


def main() -> None:
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    torch.manual_seed(0)
    rows = []
    lstm = LSTM(16)
    batch, axes = first_batch(lstm), (1, 0)
    budget = (peak(lstm, batch_slice(batch, 8, axes=axes), axes) + peak(lstm, batch, axes)) // 2
    try:
        dim0 = plan_fit(lstm, batch, budget, margin=0.0, device="cpu", cost="flops", checkpointing="none",
                        batch_axes=(0, 0))  # fmt: skip
        before = f"{dim0.micro_batch_size} x {dim0.accumulate_grad_batches} along T"
    except ValueError:  # (24, 16, 8) and (16, 1) disagree along dimension 0
        before = "refused (dim 0: 24 against 16)"
    rows.append(("lstm (T, B)", lstm, budget, 1, before))
    positional = Positional(8)
    batch = first_batch(positional)
    budget = (peak(positional, batch_slice(batch, 4)) + peak(positional, batch)) // 2
    rows.append(("position_ids (1, T)", positional, budget, 1, "refused"))
    regression = Regression(4)
    rows.append(("4 x 2 as set up", regression, 10**12, 2, "8 x 1 (merged)"))
    print(
        "| case | budget (B) | before | plan | batches run | planned peak (B) | steady real peak (B) "
        "| in budget |"
    )
    print("|---|---:|---|---|---|---:|---:|---|")
    for name, module, budget, accumulate, before in rows:
        plan, peaks = fit(module, budget, accumulate)
        shapes = sorted(set(module.shapes))
        steady = max(peaks[1:])
        print(
            f"| {name} | {budget:,} | {before} | {plan.micro_batch_size} x {plan.accumulate_grad_batches} | "
            f"{', '.join(map(str, shapes))} | {plan.estimated_peak:,} | {steady:,} | "
            f"{'yes' if max(peaks) <= budget else 'no'} |"
        )


if __name__ == "__main__":
    main()
