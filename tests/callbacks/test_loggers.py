"""W&B (offline) and MLflow (local file store) receive MemoryMonitor's keys through Lightning's loggers."""

from pathlib import Path

import lightning.pytorch as pl
import pytest
from models import EncoderLM

from lightning_memkit import MemoryMonitor

KEYS = {"memory/parameters", "memory/gradients", "memory/optimizer_state", "memory/activations"}
KEYS |= {"memory/temporary", "memory/peak"}


def test_mlflow_local_file_store(tmp_path, trainer_kwargs, monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps the file store behind a flag
    from lightning.pytorch.loggers import MLFlowLogger

    logger = MLFlowLogger(experiment_name="memkit", tracking_uri=f"file:{tmp_path / 'mlruns'}")
    trainer = pl.Trainer(callbacks=[MemoryMonitor()], logger=logger, **trainer_kwargs)
    trainer.fit(EncoderLM())
    run = logger.experiment.get_run(logger.run_id)
    assert set(run.data.metrics) >= KEYS
    history = logger.experiment.get_metric_history(logger.run_id, "memory/peak")
    assert len(history) == 4 and all(m.value > 0 for m in history)
    artifacts = [a.path for a in logger.experiment.list_artifacts(logger.run_id)]
    assert "memory.png" in artifacts
    assert list(Path(tmp_path, "mlruns").glob(f"*/{logger.run_id}/memory.png"))


def test_wandb_offline(tmp_path, trainer_kwargs, monkeypatch):
    pytest.importorskip("wandb")
    from lightning.pytorch.loggers import WandbLogger

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = WandbLogger(project="memkit", save_dir=str(tmp_path), offline=True)
    trainer = pl.Trainer(callbacks=[MemoryMonitor()], logger=logger, **trainer_kwargs)
    trainer.fit(EncoderLM())
    summary = dict(logger.experiment.summary)
    assert set(summary) >= KEYS
    assert summary["memory/peak"] > 0
    # Issue 13, item 2: the plot went to save_dir, which every run shares; it belongs to this run.
    assert (Path(logger.experiment.dir) / "memory.png").exists()
    assert not list(Path(tmp_path).glob("*.png"))
    logger.experiment.finish()
    assert list(Path(tmp_path).rglob("*.wandb"))  # the offline run file that `wandb sync` uploads later
