"""What several test files share: a CPU Trainer that saves nothing, a callback keeping the losses, the tiny
GPT example with its data and a batch, ``memkit`` run in-process, and a plain step against its estimate."""

from __future__ import annotations

import contextlib
import faulthandler
import io
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from unittest import mock

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from lightning_memkit import estimate_memory
from lightning_memkit._measuring.storages import (
    gradient_tensors,
    model_tensors,
    optimizer_tensors,
    storage_bytes,
)
from lightning_memkit.cli import main
from lightning_memkit.demos.gpt import GPTDataModule, GPTLightningModule
from lightning_memkit.testing import allocator_peak, build_counting_allocator, counting_allocator

B, T = 8, 64
#: How long a spawned rank's collective waits for its peers: longer than `spawn_ranks` lets ranks run, so
#: that the runner, which tells a hang from a loaded machine by the ranks' CPU time, decides, not gloo's
#: timer. At 3 minutes, a rank left alone (rank 0 profiling on its own; a peer descheduled among eight
#: processes on two cores) timed out, went on to its next run and met its peer's collectives out of order.
COLLECTIVE_TIMEOUT = timedelta(minutes=40)


def trainer_arguments(tmp_path, max_steps=4, **overrides) -> dict:
    """The suite's Trainer arguments: one CPU, no validation, progress bar, summary or checkpoints, logging
    to CSV in ``tmp_path`` (``None``: no folder, no logger); ``overrides`` replace any of these
    (``logger=False``) or add to them."""
    defaults = dict(
        accelerator="cpu", devices=1, max_steps=max_steps, limit_val_batches=0, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False,
    )  # fmt: skip
    if tmp_path is None:
        return {**defaults, "logger": False, **overrides}
    return {**defaults, "default_root_dir": tmp_path, "logger": CSVLogger(tmp_path), **overrides}


def cpu_trainer(tmp_path, callbacks, max_steps=4, **overrides) -> pl.Trainer:
    """The suite's Trainer (`trainer_arguments`) with ``callbacks``."""
    return pl.Trainer(callbacks=list(callbacks), **trainer_arguments(tmp_path, max_steps, **overrides))


class Losses(pl.Callback):
    """Every training batch's loss, in order."""

    def __init__(self) -> None:
        self.losses: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(outputs["loss"].detach().clone())


def tiny_gpt(batch_size: int = B, max_steps: int = 4):
    """The GPT example (tiny), its data and a batch of ``batch_size`` x `T`, seeded."""
    torch.manual_seed(0)
    data = GPTDataModule(batch_size=batch_size, seq_len=T, num_sentences=300)
    x = torch.randint(0, 256, (batch_size, T))
    return GPTLightningModule("tiny", max_steps=max_steps), data, (x, x.roll(-1, 1))


def run_cli(argv):
    """``memkit`` with ``argv``, in-process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(argv)
    return status, out.getvalue(), err.getvalue()


#: marks a test that starts gloo ranks: skipped where this torch was built without torch.distributed
needs_distributed = pytest.mark.skipif(
    not torch.distributed.is_available(), reason="torch.distributed is not available"
)


def spawn_ranks(rank_fn, args: tuple, world: int, what: str, timeout_s: float = 600) -> None:
    """``rank_fn(rank, *args)`` in ``world`` spawned processes, joined; a rank's exception is raised here.
    Past ``timeout_s`` the ranks are given up to twice as long again while they still compute (a loaded
    machine is slow, not hung), then killed with a ``TimeoutError`` that says what was measured: each
    rank's CPU seconds, whether it computed in its last seconds, and the machine's load. The ranks share an
    empty inductor cache, as on a fresh machine: what they compile, they compile in the step."""
    with tempfile.TemporaryDirectory(prefix="inductor-") as cache:
        logs = Path(cache) / "stderr"
        logs.mkdir()
        with mock.patch.dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache):  # the spawned ranks inherit it
            ranks = torch.multiprocessing.start_processes(
                _logged_rank, (logs, rank_fn, *args), nprocs=world, join=False, start_method="spawn"
            )
        start = time.monotonic()
        deadline, hard = start + timeout_s, start + 3 * timeout_s
        cpu = _cpu_seconds(ranks.processes)
        while True:
            try:
                if ranks.join(timeout=10):
                    return
            except torch.multiprocessing.ProcessExitedException as error:  # killed: no Python traceback
                log = _tail(logs / f"{error.error_index}.txt")
                raise AssertionError(f"{error}; its last output:\n{log}") from error
            now = time.monotonic()
            before, cpu = cpu, _cpu_seconds(ranks.processes)
            computing = any(after - was > 0.5 for after, was in zip(cpu, before, strict=True))
            if now > hard or (now > deadline and not computing):
                for process in ranks.processes:
                    process.kill()
                raise TimeoutError(_unfinished(world, what, now - start, cpu, computing))


def _logged_rank(rank: int, logs: Path, rank_fn, *args) -> None:
    """``rank_fn(rank, *args)`` with the rank's standard error also written to ``logs/<rank>.txt``, and
    Python's stacks dumped there if the process is killed by a signal (an abort in C++ says nothing else)."""
    tee = subprocess.Popen(["tee", str(logs / f"{rank}.txt")], stdin=subprocess.PIPE, stdout=2)
    os.dup2(tee.stdin.fileno(), 2)
    sys.stderr = io.TextIOWrapper(os.fdopen(2, "wb", buffering=0), write_through=True)
    faulthandler.enable(file=sys.stderr, all_threads=True)
    rank_fn(rank, *args)


def _tail(path: Path, lines: int = 60) -> str:
    """The last ``lines`` lines of a rank's log, or why there is none."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as error:
        return f"(no log: {error})"


def _cpu_seconds(processes) -> list[float]:
    """Each process's CPU seconds so far (user and system, Linux's /proc); 0 where it cannot be read."""
    seconds = []
    for process in processes:
        try:
            fields = Path(f"/proc/{process.pid}/stat").read_text().rsplit(")", 1)[1].split()
            seconds.append((int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"))
        except (OSError, ValueError, IndexError):
            seconds.append(0.0)
    return seconds


def _unfinished(world: int, what: str, elapsed: float, cpu: list[float], computing: bool) -> str:
    """Why ``world`` ranks were stopped, in what was measured rather than a guess."""
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    state = (
        "still computing in the last 10 s: a machine too loaded for them, not a hang"
        if computing
        else "none computed in the last 10 s: waiting on each other (a hang) or on a starved peer"
    )
    used = ", ".join(f"rank {rank} {seconds:.0f} s" for rank, seconds in enumerate(cpu))
    return (
        f"the {world} {what} ranks did not finish in {elapsed / 60:.1f} minutes; {state}. CPU time: {used}; "
        f"load average {load} (1, 5, 15 min) on {os.cpu_count()} cores. Run them on an idle machine, or "
        "alone: `python -m pytest -m slow -k <test>`"
    )


def counted_ranks(once, name: str, rank_fn, world: int, what: str) -> Path:
    """The folder where ``rank_fn(rank, folder)`` ran on ``world`` spawned ranks, once per test session
    (`once`), after the counting allocator was built here (not by every rank at once)."""

    def run(out: Path) -> None:
        build_counting_allocator()
        spawn_ranks(rank_fn, (out,), world, what)

    return once(name, run)


def counted_rank(out: Path, rank: int, world: int):
    """A spawned rank set up to be counted: the counting allocator installed (every thread), one thread,
    and its gloo process group through a file in ``out``; returns the allocator's counter."""
    counter = counting_allocator()
    torch.set_num_threads(1)
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{out / 'store'}", rank=rank, world_size=world, timeout=COLLECTIVE_TIMEOUT
    )
    return counter


def run_in_turn(out: Path, rank: int, world: int, runs: dict[str, Callable[[Path], None]]) -> None:
    """One spawned rank running Lightning fits: counted (`counted_rank`), Lightning told it is this rank
    (it then launches no processes itself), then each of ``runs`` in turn in its folder ``out/<name>``,
    a run's error written there as ``error_<rank>.txt``; the process group destroyed after."""
    counted_rank(out, rank, world)
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")
    for name, run in runs.items():
        folder = out / name
        folder.mkdir(exist_ok=True)
        try:
            run(folder)
        except Exception:
            (folder / f"error_{rank}.txt").write_text(traceback.format_exc())
    torch.distributed.destroy_process_group()


def counted_step(counter, model, optimizers, batch, step) -> int:
    """``step()``'s peak on ``counter`` (`counting_allocator`, every thread) as `AllocatorPeaks(all_threads=
    True)` counts a step: what was live before it and is not its own (the model and its quantization state,
    gradients, the optimizers' state, ``batch``) taken off."""
    own = [*model_tensors(model), *gradient_tensors(model), *optimizer_tensors(optimizers), batch]
    counter.reset_peak()
    not_the_steps = counter.live_bytes() - storage_bytes(own, torch.device("cpu"))
    step()
    return counter.peak_bytes() - not_the_steps


class Regression(pl.LightningModule):
    """A two-layer regression that logs nothing itself, ``batch_size`` its loaders' batch size: ``samples``
    training rows of ``width`` features (and, with ``val_samples``, a validation loader), seeded."""

    def __init__(
        self, width: int = 16, hidden: int = 32, samples: int = 64, val_samples: int = 0, batch_size: int = 8
    ) -> None:
        super().__init__()
        self.batch_size, self.samples, self.val_samples = batch_size, samples, val_samples
        self.net = torch.nn.Sequential(
            torch.nn.Linear(width, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1)
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        return self.training_step(batch, batch_idx)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def _loader(self, n: int) -> torch.utils.data.DataLoader:
        x = torch.randn(n, self.net[0].in_features, generator=torch.Generator().manual_seed(n))
        data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
        return torch.utils.data.DataLoader(data, batch_size=self.batch_size)

    def train_dataloader(self):
        return self._loader(self.samples)

    def val_dataloader(self):
        return self._loader(self.val_samples)


def steady_step_and_estimate(model, batch: tuple, optimizer, loss_fn) -> tuple[int, int]:
    """A plain module's steady training step (after one that makes the optimizer's state): the allocator's
    peak of it, and `estimate_memory`'s, on the CPU. ``batch`` is ``(inputs, target)``."""
    inputs, target = batch

    def step() -> None:
        loss_fn(model(inputs), target).backward()
        optimizer.step()
        optimizer.zero_grad()

    step()
    truth = allocator_peak(step)
    estimate = estimate_memory(model, batch, optimizer=optimizer, loss_fn=loss_fn, device="cpu")
    return truth, estimate.peak
