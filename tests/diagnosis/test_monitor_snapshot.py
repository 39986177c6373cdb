"""``MemoryMonitor(snapshot=True, report=True)``: the first batch's step, simulated as the run takes it,
saved beside ``memory.png`` as a PyTorch memory snapshot and as an HTML page; the run itself unchanged
(issue 29 item 8)."""

from __future__ import annotations

import json
import pickle

import pytest
import torch
from helpers import Losses, cpu_trainer, tiny_gpt
from test_html_report import _parse
from test_snapshot import _peak

from lightning_memkit import CATEGORIES, MemoryMonitor, estimate_memory


class _FirstBatch(Losses):
    """The losses, and the first training batch as the monitor sees it."""

    def __init__(self) -> None:
        super().__init__()
        self.first = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.first is None:
            self.first = [t.clone() for t in batch]


def _fit(tmp_path, saves: bool):
    model, data, _ = tiny_gpt(batch_size=4)
    seen = _FirstBatch()
    monitor = MemoryMonitor(plot=False, summary=False, snapshot=saves, report=saves, advise=saves)
    trainer = cpu_trainer(tmp_path, [monitor, seen], 3)
    trainer.fit(model, data)
    return trainer, model, seen


@pytest.mark.slow
def test_the_snapshot_is_the_first_steps_simulation_and_changes_nothing(tmp_path, lightning_log):
    trainer, model, seen = _fit(tmp_path / "with", saves=True)
    folder = tmp_path / "with" / "lightning_logs" / "version_0"
    path = folder / "memory_snapshot.pickle"
    assert path.exists(), sorted(p.name for p in path.parent.iterdir())
    with open(path, "rb") as f:
        snapshot = pickle.load(f)
    # the step as the run took it: the trained model, its AdamW with state (a steady step), fp32, the CPU
    estimate = estimate_memory(model, seen.first, optimizer=trainer.optimizers[0], device="cpu")
    peak, categories = _peak(snapshot)
    assert peak == estimate.peak, (peak, estimate)
    assert categories == {c: getattr(estimate, c) for c in CATEGORIES}
    assert f"saved as a PyTorch memory snapshot to {path}" in lightning_log.text
    # the page: the same step's figures, and the advice the monitor printed
    page = (folder / "memory_report.html").read_text(encoding="utf-8")
    data = json.loads(_parse(page).data)
    assert data["peak"] == estimate.peak
    assert data["at_peak"] == {c: getattr(estimate, c) for c in CATEGORIES}
    monitor = next(c for c in trainer.callbacks if isinstance(c, MemoryMonitor))
    assert [f["fix"] for f in data["findings"]] == [f.fix for f in monitor.advice.findings]
    assert monitor.advice.findings  # the GPT example keeps the last step's gradients through the forward
    # observe-only: the same losses and weights as a run without it
    _, plain_model, plain = _fit(tmp_path / "without", saves=False)
    assert torch.equal(torch.stack(seen.losses), torch.stack(plain.losses))
    for (name, a), b in zip(model.state_dict().items(), plain_model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_without_files_there_is_no_snapshot(tmp_path):
    model, data, _ = tiny_gpt(batch_size=4)
    monitor = MemoryMonitor(plot=False, summary=False, snapshot=True, report=True)
    trainer = cpu_trainer(tmp_path, [monitor], fast_dev_run=2, max_steps=-1)
    trainer.fit(model, data)
    assert not list(tmp_path.rglob("memory_snapshot.pickle")) and not list(tmp_path.rglob("*.html"))


@pytest.mark.parametrize("name", ["snapshot", "report"])
def test_snapshot_and_report_are_flags(name):
    with pytest.raises(TypeError, match=rf"{name} must be True or False"):
        MemoryMonitor(**{name: "yes"})
