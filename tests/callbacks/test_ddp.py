"""Callbacks under 2-process DDP on CPU (gloo): MemoryMonitor's figures from every rank reach rank 0's
logger, and match each rank's allocator, a compiled model's too; AutoFit and ActivationCheckpointing plan on
rank 0 and every rank installs that plan; OptimizerSwap counts DDP's buckets.

Starting a rank (a Python that imports torch and Lightning) costs more than any of these runs, so they
share one pair of ranks: the `ddp` fixture starts them once per test session, each rank runs every scenario
of `SCENARIOS` in turn under Lightning's DDP strategy (the processes exist already, as under torchrun) and
writes what it saw to the scenario's folder, and each test reads its scenario's folder.
"""

import csv
import json
import re
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch.distributed
from helpers import counted_ranks, needs_distributed, run_in_turn, trainer_arguments
from lightning.pytorch.loggers import CSVLogger
from models import EncoderLM
from torch.nn.parallel import DistributedDataParallel

from lightning_memkit import (
    ActivationCheckpointing,
    AutoFit,
    MemoryBreakdown,
    MemoryMonitor,
    OptimizerSwap,
    apply_checkpointing,
    estimate_memory,
)
from lightning_memkit._checkpointing.policies import applied_modes
from lightning_memkit._estimating.analytic import shard
from lightning_memkit.testing import AllocatorPeaks, counting_allocator

MiB = 2**20  # the unit of the logged keys
# The ranks' scenarios run once, on the worker that runs these tests: one pair of rank processes at a time
# next to the other worker's tests, and no worker waiting for another's ranks.
pytestmark = pytest.mark.xdist_group("ddp-ranks")


def _trainer(out: Path, **kwargs) -> pl.Trainer:
    """The suite's Trainer (`helpers.trainer_arguments`) on 2 DDP ranks."""
    return pl.Trainer(**trainer_arguments(out, devices=2, strategy="ddp", **kwargs))


# --- the scenarios, as each rank runs them ----------------------------------------------------------


class _Record(pl.Callback):
    """Writes each rank's allocator peaks and MemoryMonitor history to ``out`` (ranks are processes)."""

    def __init__(self, out: Path, peaks: AllocatorPeaks, monitor: MemoryMonitor) -> None:
        self.out, self.peaks, self.monitor = out, peaks, monitor

    def on_train_end(self, trainer, pl_module):
        record = {"allocator": self.peaks.peaks, "monitor": [b.peak for _, b in self.monitor.history]}
        (self.out / f"peaks_{trainer.global_rank}.json").write_text(json.dumps(record))


def _monitor(out: Path) -> None:
    peaks, monitor = AllocatorPeaks(all_threads=True), MemoryMonitor()
    callbacks = [*peaks.around(monitor), _Record(out, peaks, monitor)]
    trainer = _trainer(
        out, max_steps=3, log_every_n_steps=1, logger=CSVLogger(out, name="ddp"), callbacks=callbacks
    )
    trainer.fit(EncoderLM())


def _compiled(out: Path) -> None:
    """A decoder compiled in ``configure_model`` (dynamo's DDP optimizer splits its graph at the buckets)."""
    from models import CompiledDecoder

    peaks, monitor = AllocatorPeaks(all_threads=True), MemoryMonitor(plot=False, summary=False)
    callbacks = [*peaks.around(monitor), _Record(out, peaks, monitor)]
    logger = CSVLogger(out, name="compiled")
    _trainer(out, max_steps=3, logger=logger, callbacks=callbacks).fit(CompiledDecoder(batch_size=4))


class _RecordCompileBudget(pl.Callback):
    """Writes each rank's plan, torch.compile's activation budget at each step, and the allocator's peaks."""

    def __init__(self, out: Path, autofit: AutoFit, peaks: AllocatorPeaks) -> None:
        self.out, self.autofit, self.peaks, self.during = out, autofit, peaks, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        from torch._functorch import config

        self.during.append(config.activation_memory_budget)

    def on_train_end(self, trainer, pl_module):
        record = {"plan": self.autofit.plan.as_dict(), "during": self.during, "allocator": self.peaks.peaks}
        (self.out / f"rank_{trainer.global_rank}.json").write_text(json.dumps(record))


def _compiled_budget(out: Path) -> None:
    """AutoFit on a decoder compiled in ``configure_model``, at a limit 0.9 of one rank's compiled step (with
    DDP's buckets): rank 0 plans a lower activation budget, and every rank sets it for the fit."""
    from models import CompiledDecoder
    from torch._functorch import config

    probe = CompiledDecoder(batch_size=4)
    probe.configure_model()
    step = estimate_memory(probe, next(iter(probe.train_dataloader())), device="cpu")
    grads = 4 * sum(p.numel() for p in probe.parameters())
    limit = int(0.9 * shard(step, "ddp", 2, gradient_bytes=grads).peak)
    autofit = AutoFit(budget=int(limit / 0.9), cost="flops", optimizers=["adamw"])
    peaks = AllocatorPeaks(all_threads=True)
    before = config.activation_memory_budget
    callbacks = [*peaks.around(autofit), _RecordCompileBudget(out, autofit, peaks)]
    _trainer(out, max_steps=3, logger=False, callbacks=callbacks).fit(CompiledDecoder(batch_size=4))
    after = {"before": before, "after": config.activation_memory_budget, "limit": limit}
    (out / f"config_{torch.distributed.get_rank()}.json").write_text(json.dumps(after))


class _RecordingAutoFit(AutoFit):
    """AutoFit that notes, per rank, whether the rank planned and what it installed."""

    def __init__(self, out: Path, **kwargs) -> None:
        super().__init__(**kwargs)
        self.out = out

    def _plan(self, trainer, pl_module, modes):
        (self.out / f"planned_{trainer.global_rank}").touch()
        return super()._plan(trainer, pl_module, modes)

    def on_train_end(self, trainer, pl_module):
        record = {
            "plan": self.plan.as_dict(),
            "batch_size": pl_module.hparams.batch_size,
            "accumulate": trainer.accumulate_grad_batches,
            "guarded": "training_step" in pl_module.__dict__,
        }
        (self.out / f"rank_{trainer.global_rank}.json").write_text(json.dumps(record))


def _autofit(out: Path) -> None:
    # One optimizer, no checkpointing: what is checked is that every rank installs rank 0's plan, and a
    # plan of micro-batch and accumulation alone takes the fewest simulations on rank 0.
    autofit = _RecordingAutoFit(
        out, budget=8_000_000, cost="flops", optimizers=["adamw"], checkpointing=["none"]
    )
    _trainer(out, max_steps=2, logger=False, callbacks=[autofit]).fit(EncoderLM(batch_size=8))


class _RecordSwap(pl.Callback):
    def __init__(self, out: Path, swap: OptimizerSwap, monitor: MemoryMonitor) -> None:
        self.out, self.swap, self.monitor = out, swap, monitor

    def on_train_end(self, trainer, pl_module):
        record = {"optimizer": self.swap.choice.name, "peaks": [b.peak for _, b in self.monitor.history]}
        (self.out / f"swap_{trainer.global_rank}.json").write_text(json.dumps(record))


def _swap(out: Path) -> None:
    swap, monitor = OptimizerSwap(budget=13_000_000), MemoryMonitor(plot=False, summary=False)
    callbacks = [swap, monitor, _RecordSwap(out, swap, monitor)]
    _trainer(out, max_steps=3, logger=CSVLogger(out), callbacks=callbacks).fit(EncoderLM())


def _buckets(out: Path) -> None:
    """Rank 0: the allocator's peak of two plain AdamW steps, and of the same steps wrapped in DDP over a
    group of rank 0 alone (the reducer's buckets do not depend on the group; rank 1 need not wait)."""
    alone = torch.distributed.new_group([0])  # every rank makes every group
    if torch.distributed.get_rank() != 0:
        return
    x = torch.randint(0, 256, (8, 64))

    def job(wrap: bool) -> None:  # the model is built inside the window: the count holds all of it
        torch.manual_seed(0)
        model = EncoderLM()
        net = DistributedDataParallel(model, process_group=alone) if wrap else model
        optimizer = torch.optim.AdamW(model.parameters())
        for _ in range(2):
            torch.nn.functional.cross_entropy(net(x).flatten(0, 1), x.flatten()).backward()
            optimizer.step()
            optimizer.zero_grad()

    counter = counting_allocator()  # installed when the rank started: this returns it

    def run(wrap: bool) -> int:
        counter.reset_peak()
        before = counter.live_bytes()
        job(wrap)
        return counter.peak_bytes() - before

    record = {"plain": run(False), "ddp": run(True)}
    (out / "buckets.json").write_text(json.dumps(record))


class _RecordPolicies(pl.Callback):
    def __init__(self, out: Path, callback: ActivationCheckpointing) -> None:
        self.out, self.callback = out, callback

    def on_train_end(self, trainer, pl_module):
        record = {"applied": applied_modes(pl_module), "planned": self.callback.plan.modes}
        (self.out / f"rank_{trainer.global_rank}.json").write_text(json.dumps(record))


def _checkpointing(out: Path) -> None:
    """A budget halfway between the step without checkpointing and with every block checkpointed."""
    model = EncoderLM(d_model=32, n_layer=3, seq_len=32, batch_size=4, n_batches=4)
    batch = next(iter(model.train_dataloader()))
    none = estimate_memory(model, batch, device="cpu").peak
    with apply_checkpointing(model, "full"):
        full = estimate_memory(model, batch, device="cpu").peak
    callback = ActivationCheckpointing(budget=(none + full) // 2, cost="flops")
    (out / "budget.json").write_text(json.dumps({"none": none, "full": full}))
    _trainer(out, max_steps=2, logger=False, callbacks=[callback, _RecordPolicies(out, callback)]).fit(model)


class _FailingOnRankOne(MemoryMonitor):
    """A monitor whose measurement breaks on rank 1 at the second step; it notes what each rank saw."""

    def __init__(self, out: Path) -> None:
        super().__init__()
        self.out, self.shown = out, []

    def setup(self, trainer, pl_module, stage):
        self._warnings = warnings.catch_warnings()  # undone in teardown: the ranks run other scenarios
        self._warnings.__enter__()
        warnings.simplefilter("always")
        warnings.showwarning = lambda message, *args, **kwargs: self.shown.append(str(message))
        super().setup(trainer, pl_module, stage)

    def _finish_step(self, trainer):
        if trainer.global_rank == 1 and trainer.global_step == 2:  # the end of the second step
            raise RuntimeError("injected")
        return super()._finish_step(trainer)

    def on_train_end(self, trainer, pl_module):
        super().on_train_end(trainer, pl_module)
        record = {"disabled": self._disabled, "steps": len(self.history), "shown": self.shown}
        record["global_step"] = trainer.global_step
        (self.out / f"rank_{trainer.global_rank}.json").write_text(json.dumps(record))

    def teardown(self, trainer, pl_module, stage):
        super().teardown(trainer, pl_module, stage)
        self._warnings.__exit__(None, None, None)


def _failing(out: Path) -> None:
    callbacks = [_FailingOnRankOne(out)]
    _trainer(out, max_steps=3, logger=CSVLogger(out, name="ddp"), callbacks=callbacks).fit(EncoderLM())


class _RankOneFixed(EncoderLM):
    """Rank 1's loader keeps the batch size of 8 (a sampler of its own, say); rank 0's reads the attribute,
    and rank 0 is the rank that plans."""

    def train_dataloader(self):
        loader = super().train_dataloader()
        if self.trainer.global_rank == 1:
            loader = torch.utils.data.DataLoader(loader.dataset, batch_size=8)
        return loader


def _first_batch(out: Path) -> None:
    autofit = AutoFit(budget=8_000_000, cost="flops", optimizers=["adamw"], checkpointing=["none"])
    torch.manual_seed(0)  # the same weights on both ranks: DDP broadcasts rank 0's as it wraps the module
    module = _RankOneFixed(batch_size=8)
    before = [p.detach().clone() for p in module.parameters()]
    rank = torch.distributed.get_rank()
    try:
        _trainer(out, max_steps=2, logger=False, callbacks=[autofit]).fit(module)
    except RuntimeError as error:
        (out / f"refused_{rank}.txt").write_text(str(error))
    unchanged = all(torch.equal(a, b) for a, b in zip(before, module.parameters(), strict=True))
    (out / f"unchanged_{rank}.json").write_text(json.dumps(unchanged))


#: In the order the ranks run them. A rank whose scenario fails inside a Trainer goes on to the next one
#: while the other still waits in the failed step's all-reduce, and their collectives then differ (gloo
#: aborts the waiting rank): the ranks' truth is the CPU allocator's own count (`AllocatorPeaks(all_threads=
#: True)`), not torch.profiler, whose memory timeline now and then rejects its own trace of a DDP step.
SCENARIOS = dict(
    autofit=_autofit,
    checkpointing=_checkpointing,
    swap=_swap,
    failing=_failing,
    first_batch=_first_batch,
    buckets=_buckets,
    compiled=_compiled,
    compiled_budget=_compiled_budget,
    monitor=_monitor,
)


def _rank(rank: int, out: Path) -> None:
    """One DDP rank, counted (`helpers.run_in_turn`): every scenario in turn, under Lightning's DDP strategy
    (the process group exists already, as under torchrun); a scenario's error goes to its folder."""
    run_in_turn(out, rank, 2, SCENARIOS)


@pytest.fixture(scope="module")
def ddp(once):
    """The folder of every scenario, run by one pair of ranks per test session."""

    def scenario(name: str) -> Path:
        folder = out / name
        errors = [p.read_text() for p in sorted(folder.glob("error_*.txt"))]
        assert not errors, "\n".join(errors)
        return folder

    out = counted_ranks(once, "ddp", _rank, 2, "DDP")
    return scenario


# --- the tests ---------------------------------------------------------------------------------------


@pytest.mark.slow
@needs_distributed
def test_ddp_logs_each_rank_matching_the_allocator(ddp):
    """Every rank's figure reaches rank 0's logger without a deadlock; each rank's measured peak matches
    its allocator; the estimate for one DDP rank (`shard` adds the all-reduce buckets) matches it too."""
    out = ddp("monitor")
    (log_dir,) = {p.parent for p in Path(out, "ddp").rglob("metrics.csv")}  # rank 0 wrote it
    with open(log_dir / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("memory/peak")]
    assert len(rows) == 3
    for row in rows:
        assert float(row["memory/peak"]) == float(row["memory/rank_0/peak"])
    assert (log_dir / "memory.png").exists()

    model = EncoderLM()
    x = torch.randint(0, 256, (8, 64))
    estimate = estimate_memory(model, (x, x), optimizer="adamw", device="cpu")
    grads = 4 * sum(p.numel() for p in model.parameters())
    one_rank = shard(estimate, "ddp", 2, gradient_bytes=grads).peak
    for rank in (0, 1):
        record = json.loads((out / f"peaks_{rank}.json").read_text())
        assert len(record["monitor"]) == len(record["allocator"]) == 3
        for measured, truth in zip(record["monitor"], record["allocator"], strict=True):
            assert abs(measured - truth) <= 0.001 * truth, (rank, record)
        logged = float(rows[-1][f"memory/rank_{rank}/peak"]) * MiB
        assert logged == pytest.approx(record["monitor"][-1], rel=1e-4)
        steady = min(record["allocator"][1:])  # steps with last step's grads
        assert one_rank == pytest.approx(steady, rel=0.01)


@pytest.mark.slow
@needs_distributed
def test_ddp_a_compiled_step_is_measured_on_each_rank(ddp):
    """MemoryMonitor on a model compiled in ``configure_model``, under DDP: each rank's every step as its
    allocator counts it, within 0.1 %."""
    out = ddp("compiled")
    for rank in (0, 1):
        record = json.loads((out / f"peaks_{rank}.json").read_text())
        assert len(record["monitor"]) == len(record["allocator"]) == 3
        for measured, truth in zip(record["monitor"], record["allocator"], strict=True):
            assert abs(measured - truth) <= 0.001 * truth, (rank, record)


@pytest.mark.slow
@needs_distributed
def test_ddp_a_compiled_models_activation_budget_is_set_on_every_rank(ddp):
    """AutoFit on a compiled model under DDP: rank 0 plans torch.compile's activation budget, and every rank
    sets it in its own process for the fit (each compiles its own graph) and gives it back after. Each
    rank's steps peak under the limit, as its allocator counts them."""
    out = ddp("compiled_budget")
    rank0, rank1 = (json.loads((out / f"rank_{r}.json").read_text()) for r in (0, 1))
    assert rank0["plan"] == rank1["plan"]
    plan = rank0["plan"]
    budget = plan["checkpoint_plan"]["compile_budget"]
    assert plan["checkpointing"] == f"compile budget {budget:g}" and budget < 1.0, plan
    assert (plan["micro_batch_size"], plan["accumulate_grad_batches"]) == (4, 1), plan
    for rank, record in enumerate((rank0, rank1)):
        config = json.loads((out / f"config_{rank}.json").read_text())
        assert config["after"] == config["before"] and plan["limit"] == config["limit"]
        assert record["during"] == [budget] * 3
        assert max(record["allocator"]) <= plan["limit"], (rank, record["allocator"], plan["limit"])


@pytest.mark.slow
@needs_distributed
def test_ddp_autofit_rank_zero_plans_for_all(ddp):
    """Rank 0 plans, every rank installs the same plan. The OOM guard stays off: one rank cannot retry a
    step alone while the others wait in the all-reduce."""
    out = ddp("autofit")
    assert (out / "planned_0").exists() and not (out / "planned_1").exists()
    rank0, rank1 = (json.loads((out / f"rank_{r}.json").read_text()) for r in (0, 1))
    assert rank0 == rank1
    plan = rank0["plan"]
    m, accumulate = plan["micro_batch_size"], plan["accumulate_grad_batches"]
    assert m < 8 and plan["estimated_peak"] <= plan["limit"]  # the default micro-batch does not fit
    assert (rank0["batch_size"], rank0["accumulate"]) == (m, accumulate)
    assert m * accumulate == 8 and (plan["world_size"], plan["strategy"]) == (2, "ddp")
    assert not rank0["guarded"]


@pytest.mark.slow
@needs_distributed
def test_ddp_checkpointing_plans_once_and_every_rank_applies_it(ddp):
    """ActivationCheckpointing under DDP: every rank applies the plan rank 0 broadcast (what it planned,
    blocks without checkpointing left alone), the same blocks the same way."""
    out = ddp("checkpointing")
    rank0, rank1 = (json.loads((out / f"rank_{r}.json").read_text()) for r in (0, 1))
    assert rank0 == rank1
    assert rank0["applied"] == {name: mode for name, mode in rank0["planned"].items() if mode != "none"}
    assert rank0["applied"] and len(rank0["planned"]) == 3


@pytest.mark.slow
@needs_distributed
def test_ddp_buckets_cost_one_copy_of_the_gradients(ddp):
    """What `shard(..., "ddp", n)` adds, checked against the allocator: a DDP step peaks higher than the same
    step unwrapped by the gradient bytes."""
    record = json.loads((ddp("buckets") / "buckets.json").read_text())
    grads = 4 * sum(p.numel() for p in EncoderLM().parameters())
    assert record["ddp"] - record["plain"] == pytest.approx(grads, rel=0.01)
    step = MemoryBreakdown(parameters=grads, gradients=grads)
    assert shard(step, "ddp", 2).peak - step.peak == grads


@pytest.mark.slow
@needs_distributed
def test_ddp_optimizer_swap_counts_the_buckets(ddp):
    """13 MB fits the encoder's AdamW step alone (12.8 MB) but not under DDP (13.3 MB, with the buckets):
    OptimizerSwap must see the buckets, swap, and every rank's real peak then fits."""
    out = ddp("swap")
    x = torch.randint(0, 256, (8, 64))
    assert estimate_memory(EncoderLM(), (x, x), device="cpu").peak < 13_000_000  # alone, AdamW fits
    for rank in (0, 1):
        record = json.loads((out / f"swap_{rank}.json").read_text())
        assert record["optimizer"] == "adamw8bit"
        assert max(record["peaks"]) <= 13_000_000


def test_which_strategies_keep_ddp_buckets_and_accumulate():
    """`ddp_bucket_bytes` and `accumulates`, as the budget callbacks read the Trainer."""
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    from lightning_memkit.callbacks._trainer import accumulates, ddp_bucket_bytes, sharding

    module = EncoderLM()
    grads = 4 * sum(p.numel() for p in module.parameters())

    def trainer(**kwargs):
        return pl.Trainer(accelerator="cpu", logger=False, **{"devices": 1, **kwargs})

    assert ddp_bucket_bytes(trainer(), module) == 0
    assert ddp_bucket_bytes(trainer(strategy="ddp"), module) == grads  # wrapped even on one device
    assert ddp_bucket_bytes(trainer(strategy="ddp_spawn", devices=2), module) == grads
    assert ddp_bucket_bytes(trainer(strategy="ddp", precision="bf16-true"), module) == grads // 2
    assert sharding(trainer(strategy="ddp_spawn", devices=2)) == ("ddp", 2)
    assert not accumulates(trainer())
    assert accumulates(trainer(accumulate_grad_batches=2))
    assert accumulates(trainer(callbacks=[GradientAccumulationScheduler({0: 1, 2: 4})]))


def test_fsdp_shard_grad_op_and_deepspeed_stage_2_are_two_strategies():
    """Issue 48: ``"zero2"`` named both. FSDPStrategy's SHARD_GRAD_OP is read as ``"fsdp_shard_grad_op"``,
    DeepSpeed's stage 2 as ``"deepspeed_stage_2"``: the same categories divided. A SHARD_GRAD_OP plan keeps
    its name, so a resumed run tells it from FULL_SHARD's (``"fsdp"``), and its code writes Lightning's
    ``FSDPStrategy(sharding_strategy="SHARD_GRAD_OP")`` (the registry has no name for it)."""
    from types import SimpleNamespace

    from lightning.pytorch.strategies import FSDPStrategy

    from lightning_memkit import plan_fit
    from lightning_memkit._diagnosis.plan_code import plan_code
    from lightning_memkit._estimating.analytic import SHARD_GRAD_OP, STRATEGIES
    from lightning_memkit._fitting.resume import stale
    from lightning_memkit.callbacks._trainer import sharding

    def read(strategy):  # the strategies refuse a CPU Trainer: the two fields sharding reads
        return sharding(SimpleNamespace(world_size=2, strategy=strategy))

    assert read(FSDPStrategy(sharding_strategy="SHARD_GRAD_OP")) == (SHARD_GRAD_OP, 2)
    assert read(FSDPStrategy()) == ("fsdp", 2)
    assert STRATEGIES[SHARD_GRAD_OP] == STRATEGIES["deepspeed_stage_2"]
    batch = (torch.zeros(4, 2), torch.zeros(4, 2))
    model = torch.nn.Linear(2, 2)
    plans = [
        plan_fit(
            model, batch, "1GB", device="cpu", cost="flops", optimizers=["adamw"],
            loss_fn=torch.nn.functional.mse_loss, strategy=strategy, world_size=2,
        )
        for strategy in (SHARD_GRAD_OP, "deepspeed_stage_2", "fsdp")
    ]  # fmt: skip
    assert [plan.strategy for plan in plans] == [SHARD_GRAD_OP, "deepspeed_stage_2", "fsdp"]
    assert plans[0].estimated_peak == plans[1].estimated_peak > plans[2].estimated_peak
    assert stale(plans[2], plans[0]) == [("strategy", "fsdp", SHARD_GRAD_OP)]
    code = plan_code(plans[0], model, global_batch=4, optimizers=None)
    assert 'strategy=FSDPStrategy(sharding_strategy="SHARD_GRAD_OP")' in code
    assert "from lightning.pytorch.strategies import FSDPStrategy" in code
    pytest.importorskip("deepspeed")
    from lightning.pytorch.strategies import DeepSpeedStrategy

    assert read(DeepSpeedStrategy(stage=2)) == ("deepspeed_stage_2", 2)


def test_a_decision_that_fails_on_rank_zero_fails_on_every_rank():
    """`on_rank_zero`: rank 0 raises its own error; another rank gets its kind and message from the
    broadcast instead of waiting for a decision (here the broadcast is played by hand)."""
    from types import SimpleNamespace

    from lightning_memkit.callbacks._trainer import on_rank_zero

    sent = []

    def zero_broadcast(obj, src):
        sent.append(obj)
        return obj

    rank0 = SimpleNamespace(is_global_zero=True, strategy=SimpleNamespace(broadcast=zero_broadcast))
    with pytest.raises(ValueError, match="no plan fits") as own:
        on_rank_zero(rank0, lambda: (_ for _ in ()).throw(ValueError("no plan fits")), "Planning")
    rank1 = SimpleNamespace(
        is_global_zero=False, strategy=SimpleNamespace(broadcast=lambda obj, src: sent[0])
    )
    with pytest.raises(ValueError, match="Planning failed on global rank 0: ValueError: no plan") as copy:
        on_rank_zero(rank1, lambda: pytest.fail("only rank 0 decides"), "Planning")
    assert copy.value is not own.value
    assert on_rank_zero(rank0, lambda: {"plan": 1}, "Planning") == {"plan": 1} == sent[-1][1]


@pytest.mark.slow
@needs_distributed
def test_ddp_autofit_checks_every_ranks_first_batch_against_the_plan(ddp):
    """Issue 46 item 1: rank 1's loader keeps 8 samples a batch while the plan's micro-batch is smaller: both
    ranks stop before the first optimizer step (none waits in DDP's all-reduce), rank 1 naming its batch."""
    out = ddp("first_batch")
    refused = [(out / f"refused_{r}.txt").read_text() for r in (0, 1)]
    assert all(re.match(r"AutoFit planned micro-batch [124] x accumulate [248] ", t) for t in refused), (
        refused
    )
    assert "but the first training batch on rank 1 holds 8 samples" in refused[1]
    assert "but another rank's first training batch does not hold that (rank 0's does)" in refused[0]
    assert [json.loads((out / f"unchanged_{r}.json").read_text()) for r in (0, 1)] == [True, True]


@pytest.mark.slow
@needs_distributed
def test_an_internal_error_on_one_rank_stops_the_monitor_on_every_rank_without_a_hang(ddp):
    """Issue 12, item 5: rank 1's error left rank 0 waiting in the all_gather (hung), and rank 1's warning
    went through rank_zero_warn, so nobody saw it. Now each rank says what happened to it, both stop
    monitoring at the same optimizer step, and the run finishes."""
    out = ddp("failing")
    ranks = [json.loads((out / f"rank_{r}.json").read_text()) for r in (0, 1)]
    assert [r["global_step"] for r in ranks] == [3, 3]
    assert [r["disabled"] for r in ranks] == [True, True]
    assert [r["steps"] for r in ranks] == [1, 1]  # step 0 logged; the monitor stopped at step 1 everywhere
    assert any(
        re.search(r"\[rank: 1\] MemoryMonitor hit an internal error.*injected", m) for m in ranks[1]["shown"]
    )
    assert any(re.search(r"\[rank: 0\] MemoryMonitor stops monitoring on every rank: rank\(s\) \[1\]", m)
               for m in ranks[0]["shown"])  # fmt: skip
