"""Issue 49 item 4: the first measured step waited 2-4 s for the CPU kernel helper to start (import torch,
first profile); MemoryMonitor now starts it in the background at setup and waits in on_train_start.
The figures: ``benchmarks/bench_first_step.py``."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from helpers import cpu_trainer
from models import EncoderLM

from lightning_memkit import MemoryMonitor
from lightning_memkit._measuring import kernels
from lightning_memkit._measuring.kernels import _Worker

MM = torch.ops.aten.mm.default


@pytest.fixture
def fresh_helper(monkeypatch):
    """A helper of the test's own in place of the process's: started by what the test runs, stopped after."""
    worker = _Worker()
    monkeypatch.setattr(kernels, "_WORKER", worker)
    yield worker
    worker.stop()


@pytest.mark.slow
def test_a_started_helper_answers_each_question_with_its_own_answer():
    """The warm-up's answer is read before the first real one, whether or not `ready` was called."""
    a, b = torch.randn(64, 32, dtype=torch.bfloat16), torch.randn(32, 16, dtype=torch.bfloat16)
    plain = _Worker()
    expected = plain.ask(MM, (a, b), {})
    plain.stop()
    assert expected and expected > 0
    for wait in (False, True):
        worker = _Worker()
        try:
            assert worker.start() and not worker.start()  # one process, started once
            if wait:
                worker.ready()
                assert worker.unread == 0
            assert worker.ask(MM, (a, b), {}) == expected
            assert worker.ask(MM, (a.t().contiguous().t(), b), {}) is not None  # and the next question
        finally:
            worker.stop()


class _HelperAtFirstStep(pl.Callback):
    def __init__(self) -> None:
        self.ready: list[bool] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        worker = kernels._WORKER
        self.ready.append(worker.process is not None and worker.process.poll() is None and not worker.unread)


def test_the_helper_is_ready_before_the_first_step(tmp_path, fresh_helper, lightning_log):
    seen = _HelperAtFirstStep()
    cpu_trainer(tmp_path, [MemoryMonitor(plot=False, summary=False), seen], max_steps=2).fit(
        EncoderLM(n_layer=1)
    )
    assert seen.ready == [True, True]
    assert "started its CPU kernel helper process before the first step (" in lightning_log.text
    assert fresh_helper.cache  # the embedding's backward was asked about, of this helper
