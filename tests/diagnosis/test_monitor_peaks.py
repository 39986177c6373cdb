"""Issue 49: MemoryMonitor's logs never hide a peak between two logging steps, the tracker's per-phase
peaks, and the end-of-fit pictures (report, snapshot, advice) of the step that peaked, not the first."""

from __future__ import annotations

import csv
import html
import json
import pickle
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from helpers import cpu_trainer
from lightning.pytorch.loggers import CSVLogger
from models import EncoderLM
from test_html_report import _parse
from test_snapshot import _peak
from torch import nn

from lightning_memkit import CATEGORIES, MemoryMonitor, estimate_memory, measure
from lightning_memkit.testing import AllocatorPeaks, allocator_peak, cpu_profiler, profile_peak

MiB = 2**20
LONG = 2  # the step whose batch is twice as long as the others'


class _Growing(EncoderLM):
    """Batches of 8 x 32 tokens, but for step `LONG`'s: 8 x 64 (dynamic padding's longest batch)."""

    def __init__(self, n_batches=8):
        super().__init__(d_model=32, n_layer=1, vocab=64, n_batches=n_batches)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        batches = []
        for i in range(self.hparams.n_batches):
            x = torch.randint(0, 64, (8, 64 if i == LONG else 32), generator=g)
            batches.append((x, x.roll(-1, dims=1)))
        return torch.utils.data.DataLoader(batches, batch_size=None)


def _logged(trainer) -> list[dict[str, float]]:
    trainer.logger.save()
    with open(Path(trainer.logger.log_dir) / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("memory/peak")]
    return [{k: float(v) for k, v in row.items() if v} for row in rows]


@pytest.mark.slow
def test_a_peak_between_logging_steps_is_logged_with_its_step(trainer_kwargs):
    """Logging every 4 steps, the longest batch (step 2's) is logged at step 3 as ``memory/peak`` with its
    breakdown and ``memory/peak_step``, held to the allocator; step 7's log holds steps 4-7 alone."""
    monitor, probe = MemoryMonitor(log_every_n_steps=4, plot=False, summary=False), AllocatorPeaks()
    kwargs = {**trainer_kwargs, "logger": CSVLogger(trainer_kwargs["default_root_dir"])}
    trainer = pl.Trainer(callbacks=probe.around(monitor), **{**kwargs, "max_steps": 8})
    trainer.fit(_Growing())
    truths = probe.peaks
    assert len(truths) == 8 and max(range(8), key=truths.__getitem__) == LONG
    first, second = _logged(trainer)
    assert (first["step"], second["step"]) == (3, 7)
    for row, window in ((first, range(0, 4)), (second, range(4, 8))):
        highest = max(window, key=truths.__getitem__)
        assert row["memory/peak_step"] == highest
        assert row["memory/peak"] * MiB == pytest.approx(truths[highest], rel=1e-3)
        assert sum(row[f"memory/{c}"] for c in CATEGORIES) == pytest.approx(row["memory/peak"], rel=1e-9)
        assert row["memory/step_peak"] * MiB == pytest.approx(truths[int(row["step"])], rel=1e-3)
        phases = [row[f"memory/{p}_peak"] for p in ("forward", "backward", "optimizer_step")]
        assert max(phases) == pytest.approx(row["memory/peak"], rel=1e-9)  # the highest phase is the peak
    # step 7's own figure is the highest of 4-7 (alike steps); step 3's alone would hide the long batch
    assert first["memory/step_peak"] < first["memory/peak"]
    assert second["memory/step_peak"] == second["memory/peak"]


def test_steps_after_the_last_logging_step_are_logged_at_the_end(trainer_kwargs):
    """Six steps logged every 4: the long batch between logging steps is logged at step 3, with its step;
    steps 4-5 at the end of fit, at step 5 (the allocator's figures: the slow test above)."""
    monitor = MemoryMonitor(log_every_n_steps=4, plot=False, summary=False)
    kwargs = {**trainer_kwargs, "logger": CSVLogger(trainer_kwargs["default_root_dir"]), "max_steps": 6}
    trainer = pl.Trainer(callbacks=[monitor], **kwargs)
    trainer.fit(_Growing())
    rows = _logged(trainer)
    assert [r["step"] for r in rows] == [3, 5]
    peaks = dict(monitor.history)
    assert rows[1]["memory/peak"] * MiB == pytest.approx(max(peaks[4].peak, peaks[5].peak))
    assert rows[0]["memory/peak_step"] == LONG
    assert (
        rows[0]["memory/peak"] * MiB == peaks[LONG].peak > peaks[3].peak == rows[0]["memory/step_peak"] * MiB
    )


def test_each_phase_peak_is_the_allocators(one_thread):
    """`measure`'s phase peaks, held to the allocator: the forward's is the peak of the forward alone; the
    highest of forward and backward, the peak of both; the highest of all three, the step's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 64))
    optimizer = torch.optim.AdamW(model.parameters())
    x = torch.randn(256, 64)

    def forward():
        return model(x).square().mean()

    def touch():  # make the profile see every tensor live since before it (the optimizer's state too)
        for t in [*model.parameters(), *(v for s in optimizer.state.values() for v in s.values())]:
            t.sum()

    forward().backward()
    optimizer.step()  # AdamW's state exists: a steady step
    optimizer.zero_grad()
    truth_forward = allocator_peak(lambda: (touch(), forward()))
    truth_backward = allocator_peak(lambda: (touch(), forward().backward()))
    optimizer.zero_grad()
    with cpu_profiler() as prof, measure(model, optimizer) as m:
        touch()
        m.enter_phase("forward")
        loss = forward()
        m.enter_phase("backward")
        loss.backward()
        m.enter_phase("optimizer step")
        optimizer.step()
        optimizer.zero_grad()
    phases = m.phase_peaks
    assert phases["forward"] == pytest.approx(truth_forward, rel=1e-3)
    assert max(phases["forward"], phases["backward"]) == pytest.approx(truth_backward, rel=1e-3)
    assert max(phases.values()) == m.breakdown.peak == pytest.approx(profile_peak(prof), rel=1e-3)
    assert phases["backward"] > phases["forward"] and phases["optimizer step"] > phases["forward"]


def _pictures(tmp_path, advise: bool):
    monitor = MemoryMonitor(plot=False, summary=False, snapshot=True, report=True, advise=advise)
    model = _Growing(n_batches=6)
    trainer = cpu_trainer(tmp_path, [monitor], max_steps=6)
    trainer.fit(model)
    long_batch = model.train_dataloader().dataset[LONG]
    first_batch = model.train_dataloader().dataset[0]
    kwargs = {"optimizer": trainer.optimizers[0], "device": "cpu"}
    return (
        trainer,
        monitor,
        estimate_memory(model, long_batch, **kwargs),
        estimate_memory(model, first_batch, **kwargs),
    )


def test_the_report_and_snapshot_show_the_step_that_peaked(tmp_path, lightning_log):
    trainer, monitor, longest, first = _pictures(tmp_path, advise=False)
    assert max(monitor.history, key=lambda item: item[1].peak)[0] == LONG
    assert longest.peak > first.peak
    folder = Path(trainer.logger.log_dir)
    with open(folder / "memory_snapshot.pickle", "rb") as f:
        peak, categories = _peak(pickle.load(f))
    assert peak == longest.peak and categories == {c: getattr(longest, c) for c in CATEGORIES}
    page = (folder / "memory_report.html").read_text(encoding="utf-8")
    assert json.loads(_parse(page).data)["peak"] == longest.peak
    assert f"training step {LONG}, the run's highest measured step" in html.unescape(page)
    assert f"step {LONG}'s batch, the highest measured step" in lightning_log.text


def test_the_advice_is_on_the_step_that_peaked(tmp_path, lightning_log):
    _, monitor, longest, _ = _pictures(tmp_path, advise=True)
    assert monitor.advice.breakdown.peak == longest.peak
    assert f"memory advice for step {LONG}'s batch (the highest measured step" in lightning_log.text
