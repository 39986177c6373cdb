"""MemoryMonitor under 2-process DDP on CPU (gloo): every rank's figure reaches rank 0's logger."""

import csv
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch.distributed
from conftest import EncoderLM
from lightning.pytorch.loggers import CSVLogger

from lightning_memkit import MemoryMonitor


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")
def test_ddp_logs_each_rank_without_deadlock(tmp_path):
    logger = CSVLogger(tmp_path, name="ddp")
    trainer = pl.Trainer(
        default_root_dir=tmp_path,
        accelerator="cpu",
        devices=2,
        strategy="ddp_spawn",
        max_steps=3,
        logger=logger,
        callbacks=[MemoryMonitor()],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(EncoderLM())
    (log_dir,) = {p.parent for p in Path(tmp_path, "ddp").rglob("metrics.csv")}  # rank 0 wrote it
    with open(log_dir / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("memory/peak")]
    assert len(rows) == 3
    for row in rows:
        rank0, rank1 = float(row["memory/rank_0/peak"]), float(row["memory/rank_1/peak"])
        assert float(row["memory/peak"]) == rank0
        # Same model, same batch shapes: the ranks' peaks agree to within the DDP buckets' layout.
        assert rank1 == pytest.approx(rank0, rel=0.25)
    assert (log_dir / "memory.png").exists()
