"""The suite's fixtures and the `cuda` marker's skip (the shared models are in models.py, the shared
helpers in helpers.py)."""

from __future__ import annotations

import logging
import os
import traceback
from collections.abc import Callable
from pathlib import Path

# Under pytest-xdist (`pytest -n 2`, as CI runs), one thread per worker: two workers of two threads each
# on 2 cores only take turns. Subprocesses the tests start (scripts, DDP ranks) inherit it.
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"

import pytest
import torch
from filelock import FileLock
from helpers import trainer_arguments

if "PYTEST_XDIST_WORKER" in os.environ:
    torch.set_num_threads(1)  # torch may have been imported before this file (by a plugin)


def pytest_collection_modifyitems(config, items):
    """``@pytest.mark.cuda`` tests are skipped, with the reason, where no CUDA device is visible."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; torch.cuda.is_available() is False")
    for item in items:
        if item.get_closest_marker("cuda"):
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def cublas_workspaces_as_on_a_hopper(monkeypatch):
    """CUDA estimates count cuBLAS's two workspaces, whose size follows ``CUBLAS_WORKSPACE_CONFIG``: the
    tests' small cards are sized for 32 MiB each (an H100's), whatever the machine's environment sets."""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run as fast on one thread, and a shared CPU cannot stall them: with two, every op's
    OpenMP barrier waits whenever the other thread is descheduled (60x slower on a loaded machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def lightning_log(caplog, monkeypatch):
    """What ``rank_zero_info`` prints (Lightning's logger may not propagate to pytest's handler)."""
    monkeypatch.setattr(logging.getLogger("lightning.pytorch"), "propagate", True)
    with caplog.at_level(logging.INFO):
        yield caplog


@pytest.fixture
def trainer_kwargs(tmp_path):
    """`helpers.trainer_arguments` as keywords to extend, logging every step, with Lightning's own
    validation and logger (the monitor's tests read both)."""
    kwargs = trainer_arguments(tmp_path, log_every_n_steps=1)
    return {k: v for k, v in kwargs.items() if k not in ("logger", "limit_val_batches")}


@pytest.fixture(scope="session")
def once(tmp_path_factory) -> Callable[[str, Callable[[Path], None]], Path]:
    """``once(name, produce)``: ``produce(folder)`` runs once per test session; every call returns its folder.

    For work that several tests read and no test should pay for twice (two DDP ranks starting Python,
    torch and Lightning). Under pytest-xdist the workers share it: the first to ask runs it while the others
    wait on a lock, then read the same folder; a failure is re-raised in each test that asks.
    """
    root = tmp_path_factory.getbasetemp()
    if "PYTEST_XDIST_WORKER" in os.environ:
        root = root.parent  # shared by this session's workers, and by nothing else

    def run(name: str, produce: Callable[[Path], None]) -> Path:
        folder, failed, done = root / name, root / f"{name}.failed", root / f"{name}.done"
        with FileLock(root / f"{name}.lock"):
            if not done.exists() and not failed.exists():
                folder.mkdir(exist_ok=True)
                try:
                    produce(folder)
                except BaseException:
                    failed.write_text(traceback.format_exc())
                    raise
                done.touch()
        if failed.exists():
            pytest.fail(f"{name} failed (in this or another pytest worker):\n{failed.read_text()}")
        return folder

    return run
