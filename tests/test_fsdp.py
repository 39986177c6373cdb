"""FSDP on 2 CPU ranks (gloo), measured per rank: what runs, and how `MemoryMonitor` and the estimate's FSDP
division (`shard(..., "fsdp", 2)`, as ``memkit estimate --gpus 2 --strategy fsdp`` divides) compare with
the allocator.

What runs on CPU with torch 2.13 and Lightning 2.6: Lightning's ``ModelParallelStrategy`` with torch's
``fully_shard`` (FSDP2) on a gloo mesh. Lightning's ``FSDPStrategy`` (FSDP1) does not: the Trainer refuses
it without a CUDA accelerator, and torch's ``FullyShardedDataParallel`` refuses a CPU-only machine itself
("FSDP needs a non-CPU accelerator device") when the Trainer's check is bypassed.

The ranks start once per test session and run `SCENARIOS` in turn, as test_ddp's do (its `_Record` writes
each rank's figures). The allocator's profile and the monitor run in two fits of the same steps (same seed,
same shapes): in one fit, a rank died of SIGSEGV in 2 of 3 runs, right after the monitor's internal error.
torch.profiler's memory timeline now and then rejects its own trace of an FSDP2 step on a rank ("version
mismatch" in its data-flow graph; up to 2 steps in 3): that step's figure is None, and the tests read the
steps that have one. Steps after the first are not all alike: gloo's threads time when the collectives'
buffers are freed, and the same step peaks 7.32 to 8.05 MB per rank here.
"""

import csv
import json
import os
import time
import traceback
from datetime import timedelta
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch.distributed
from conftest import EncoderLM
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import ModelParallelStrategy
from test_ddp import MiB, _Record, needs_distributed

from lightning_memkit import MemoryMonitor, estimate_memory
from lightning_memkit._analytic import shard
from lightning_memkit.testing import AllocatorPeaks

pytestmark = pytest.mark.xdist_group("ddp-ranks")  # one pair of rank processes at a time, with test_ddp's

#: Parameters and AdamW's state outweigh the activations (1.9 MB of parameters, 64 tokens a step), so
#: what sharding divides is most of the step.
MODEL = dict(d_model=128, n_layer=2, seq_len=16, batch_size=4, n_batches=4)
STEPS = 4  # the allocator's fit; the monitor's stops measuring at its second step, so it runs two


class ShardedEncoderLM(EncoderLM):
    """EncoderLM with each encoder layer and the root sharded by ``fully_shard`` over the data-parallel
    mesh."""

    def configure_model(self):
        mesh = self.device_mesh["data_parallel"]
        for layer in self.encoder.layers:
            torch.distributed.fsdp.fully_shard(layer, mesh=mesh)
        torch.distributed.fsdp.fully_shard(self, mesh=mesh)


class _TolerantPeaks(AllocatorPeaks):
    """AllocatorPeaks that records None for a step whose profile torch.profiler cannot read back."""

    def _close(self) -> None:
        try:
            super()._close()
        except AssertionError as error:
            if "version mismatch" not in str(error) and "duplicate outputs" not in str(error):
                raise
            self._prof = None
            self.peaks.append(None)


def _fit(out: Path, model: dict, callbacks: list, logger=False, steps: int = STEPS) -> pl.Trainer:
    torch.manual_seed(0)
    trainer = pl.Trainer(
        default_root_dir=out, accelerator="cpu", devices=2, max_steps=steps, log_every_n_steps=1,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1), logger=logger,
        callbacks=callbacks, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False,
    )  # fmt: skip
    trainer.fit(ShardedEncoderLM(**model))
    return trainer


# --- the scenarios, as each rank runs them ----------------------------------------------------------


def _allocator(out: Path, model: dict) -> None:
    peaks = _TolerantPeaks()
    _fit(out, model, [*peaks.around(), _Record(out, peaks, MemoryMonitor())])


class _RecordMonitor(_Record):
    def on_train_end(self, trainer, pl_module):
        record = {
            "monitor": [b.peak for _, b in self.monitor.history],
            "disabled": self.monitor._disabled,
            "global_step": trainer.global_step,
        }
        (self.out / f"monitor_{trainer.global_rank}.json").write_text(json.dumps(record))


def _monitor(out: Path, model: dict) -> None:
    monitor = MemoryMonitor(plot=False, summary=False)
    callbacks = [monitor, _RecordMonitor(out, AllocatorPeaks(), monitor)]
    _fit(out, model, callbacks, logger=CSVLogger(out, name="fsdp"), steps=2)


SCENARIOS = dict(allocator=_allocator, monitor=_monitor)


def _rank(rank: int, out: Path, model: dict) -> None:
    """One FSDP rank: the process group, then every scenario in turn; a scenario's error goes to its
    folder."""
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")  # Lightning then launches no processes itself
    torch.set_num_threads(1)
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{out / 'store'}", rank=rank, world_size=2, timeout=timedelta(minutes=3)
    )
    for name, scenario in SCENARIOS.items():
        try:
            scenario(out / name, model)
        except Exception:
            (out / name / f"error_{rank}.txt").write_text(traceback.format_exc())
    torch.distributed.destroy_process_group()


def run_ranks(out: Path, model: dict = MODEL) -> None:
    """Run `SCENARIOS` on two spawned ranks, writing into ``out/<scenario>``."""
    for name in SCENARIOS:
        (out / name).mkdir(parents=True)
    ranks = torch.multiprocessing.start_processes(
        _rank, (out, model), nprocs=2, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + 300
    while not ranks.join(timeout=2):
        if time.monotonic() > deadline:
            for process in ranks.processes:
                process.kill()
            raise TimeoutError("the two FSDP ranks did not finish in 5 minutes: a hang")


def steady(out: Path, rank: int) -> list[int]:
    """The allocator's figures of a rank's steps after the first (they hold optimizer state), where known."""
    return [p for p in read(out, "allocator", rank)["allocator"][1:] if p is not None]


def read(out: Path, scenario: str, rank: int) -> dict:
    folder = out / scenario
    errors = [p.read_text() for p in sorted(folder.glob("error_*.txt"))]
    assert not errors, "\n".join(errors)
    name = "peaks" if scenario == "allocator" else "monitor"
    return json.loads((folder / f"{name}_{rank}.json").read_text())


def estimate_per_rank(model: dict = MODEL) -> tuple[int, int]:
    """The simulated step of the whole model, and one rank's share as ``memkit estimate --gpus 2
    --strategy fsdp`` divides it."""
    module = EncoderLM(**model)
    x = torch.randint(0, module.hparams.vocab, (model["batch_size"], model["seq_len"]))
    whole = estimate_memory(module, (x, x), optimizer="adamw", device="cpu")
    grads = 4 * sum(p.numel() for p in module.parameters())
    return whole.peak, shard(whole, "fsdp", 2, gradient_bytes=grads).peak


@pytest.fixture(scope="module")
def fsdp(once):
    return once("fsdp", run_ranks)


# --- the tests ---------------------------------------------------------------------------------------


def test_lightning_fsdp_strategy_refuses_the_cpu():
    """Lightning's FSDPStrategy (FSDP1) needs CUDA: what stops it on this machine. (Past this check, torch's
    FullyShardedDataParallel raises "FSDP needs a non-CPU accelerator device".) When this fails, Lightning
    runs FSDP1 on CPU: measure it here as the ModelParallelStrategy run is."""
    with pytest.raises(ValueError, match="requires a GPU accelerator"):
        pl.Trainer(accelerator="cpu", devices=2, strategy="fsdp", logger=False)


@pytest.mark.slow
@needs_distributed
def test_fully_shard_runs_on_two_cpu_ranks_and_divides_the_step(fsdp):
    """FSDP2 under ModelParallelStrategy trains on 2 gloo ranks; each rank's step peaks below the whole
    model's step (the simulated one, which the allocator matches within 0.1 % unsharded): 0.79 to 0.87 of
    it here, as gloo's threads time the collectives' buffers."""
    ranks = [read(fsdp, "allocator", r)["allocator"] for r in (0, 1)]
    assert [len(r) for r in ranks] == [STEPS, STEPS]
    known = [p for r in (0, 1) for p in steady(fsdp, r)]
    whole, _ = estimate_per_rank()
    assert known and max(known) < 0.9 * whole


@pytest.mark.slow
@needs_distributed
def test_monitor_logs_every_rank_and_stops_cleanly_under_fsdp(fsdp):
    """The monitor logs ``memory/rank_{r}/peak`` for its first step, then its internal error on the sharded
    (DTensor) optimizer state stops it on every rank at the same step, and training finishes."""
    ranks = [read(fsdp, "monitor", r) for r in (0, 1)]
    assert [r["global_step"] for r in ranks] == [2, 2]
    assert [r["disabled"] for r in ranks] == [True, True]
    (metrics,) = Path(fsdp, "monitor", "fsdp").rglob("metrics.csv")
    with open(metrics) as f:
        rows = [r for r in csv.DictReader(f) if r.get("memory/peak")]
    assert rows and all(rows[0][f"memory/rank_{r}/peak"] for r in (0, 1))
    assert float(rows[0]["memory/rank_1/peak"]) * MiB == pytest.approx(ranks[1]["monitor"][0], rel=1e-4)


@pytest.mark.slow
@needs_distributed
@pytest.mark.xfail(
    strict=True,
    reason="MemoryMonitor under FSDP2 reads 3.25x the allocator at step 0 (17.57 MB vs 5.41 MB per rank) "
    "and stops at step 1: a DTensor's storage is its global size with no data pointer (storage_bytes "
    "raises), its local shard is never seen, and the unsharded parameters FSDP2 frees by "
    "storage.resize_(0) are never seen freed",
)
def test_monitor_per_rank_matches_the_allocator_under_fsdp(fsdp):
    for rank in (0, 1):
        allocator = read(fsdp, "allocator", rank)["allocator"][:2]
        monitor = read(fsdp, "monitor", rank)["monitor"]
        assert len(monitor) == 2
        for m, t in zip(monitor, allocator, strict=True):
            assert t is None or m == pytest.approx(t, rel=0.001)


@pytest.mark.slow
@needs_distributed
@pytest.mark.xfail(
    strict=True,
    reason="shard(..., 'fsdp', 2) is 24 % under the per-rank peak (5.54 MB vs 7.32 MB at the lowest step, "
    "31 % under the highest, 8.05 MB): it halves parameters, gradients and optimizer state, but FSDP2 also "
    "holds unsharded copies it does not model: the root unit's all-gathered parameters (0.26 MB) for the "
    "whole step, each encoder layer's (0.79 MB) while it runs and the next one's prefetched, and a layer's "
    "full gradient until it is reduce-scattered",
)
def test_estimate_fsdp_division_matches_the_per_rank_peak(fsdp):
    _, one_rank = estimate_per_rank()
    for rank in (0, 1):
        assert one_rank == pytest.approx(min(steady(fsdp, rank)), rel=0.02)  # the lowest, most lenient
