"""AutoFitStrategy on 2 gloo CPU ranks: FSDP2 planned to fit a budget, against each rank's allocator.

The model is test_fsdp's Hugging Face LLaMA (a random tiny config, an unevenly sharded vocabulary) in a
LightningModule that does not shard itself: the strategy finds the decoder layers, plans on rank 0 (one
rank's FSDP2 step simulated over a fake process group beside the job's own) and shards. The truth is the CPU
allocator's count in every thread (`counting_allocator`), as in test_fsdp. The ranks start once per test
session and run every `RUNS` entry in turn.
"""

import json
import os
import shutil
import subprocess
import sys
import traceback
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import test_fsdp as fsdp_test
import torch.distributed
from helpers import COLLECTIVE_TIMEOUT, cpu_trainer, needs_distributed, spawn_ranks
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import ModelParallelStrategy
from models import BuiltLater
from test_fsdp import STEPS, ShardedLlama, llama, matches_the_rank
from zoo import ZooModule, zoo_batch

from lightning_memkit import (
    ActivationCheckpointing,
    AutoFit,
    AutoFitStrategy,
    Sharding,
    chunked_cross_entropy,
    estimate_memory,
    parse_bytes,
    plan_fit,
)
from lightning_memkit._diagnosis.plan_code import plan_code
from lightning_memkit._fitting.plan import StepCost
from lightning_memkit._sharding.fsdp2 import Link, collective_seconds, shard_bytes
from lightning_memkit.strategies.auto_fit import _check_root
from lightning_memkit.testing import AllocatorPeaks, build_counting_allocator, counting_allocator

#: the tests that read the ranks' runs: one set of rank processes at a time, with test_ddp's and test_fsdp's
ranks = pytest.mark.xdist_group("ddp-ranks")

WORLD = 2
BATCH, SEQ = 4, 32  # the user's batch size a rank: the plan's global batch is BATCH x WORLD


class Llama(ZooModule):
    """The LLaMA in a LightningModule with no ``configure_model``: AutoFitStrategy shards it."""

    def __init__(self, batch_size: int = BATCH):
        super().__init__("qwen2", batch_size=batch_size, seq_len=SEQ, n_batches=4 * STEPS * WORLD)
        self.model = llama()


class SameSharding(Llama):
    """Llama sharded by hand as AutoFitStrategy shards it (each decoder layer, then ``self.model``)."""

    def __init__(self, reshard_after_forward: bool):
        super().__init__()
        self.reshard_after_forward = reshard_after_forward

    def configure_model(self):
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh, reshard_after_forward=self.reshard_after_forward)
        fully_shard(self.model, mesh=mesh, reshard_after_forward=self.reshard_after_forward)


class _Record(fsdp_test._Record):
    """test_fsdp's record (losses, local shards' digest) with the allocator's peaks (per batch), the plan
    and what it installed."""

    def __init__(self, out: Path, peaks: AllocatorPeaks) -> None:
        super().__init__(out, peaks, None)

    def record(self, trainer, pl_module) -> dict:
        strategy = trainer.strategy
        return super().record(trainer, pl_module) | {
            "allocator": self.peaks.peaks,
            "plan": strategy.plan.as_dict() if isinstance(strategy, AutoFitStrategy) else None,
            "callback_plans": {
                type(c).__name__: c.plan.as_dict() for c in trainer.callbacks if getattr(c, "plan", None)
            },
            "units": getattr(strategy, "units", None),
            "link": getattr(strategy, "_link", None),  # the collectives as timed, held by the strategy
            "offload": [_offloads(pl_module.get_submodule(name)) for name in getattr(strategy, "units", [])],
            "param_dtypes": [
                _param_dtype(pl_module.get_submodule(n)) for n in getattr(strategy, "units", [])
            ],
            "optimizer": type(trainer.optimizers[0]).__name__,
            # AdamW's step count: the checkpoint's state continued on resume, not restarted
            "optimizer_steps": sorted({float(v["step"]) for v in trainer.optimizers[0].state.values()}),
            "batch_size": pl_module.hparams.batch_size,
            "accumulate": trainer.accumulate_grad_batches,
        }


def _offloads(unit) -> bool:
    """Whether an FSDP2 unit offloads its parameters to the CPU (FSDP2's own state, private)."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    group = unit._get_fsdp_state()._fsdp_param_group
    return isinstance(group.offload_policy, CPUOffloadPolicy)


def _param_dtype(unit) -> str:
    """The dtype an FSDP2 unit all-gathers its parameters in (its MixedPrecisionPolicy's; FSDP2's state)."""
    return str(unit._get_fsdp_state()._fsdp_param_group.mp_policy.param_dtype)


def _fit(
    out: Path,
    strategy,
    module,
    *,
    max_steps=STEPS,
    ckpt_path=None,
    save=None,
    callbacks=(),
    precision="32-true",
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    peaks = AllocatorPeaks(all_threads=True)
    torch.manual_seed(0)
    trainer = cpu_trainer(
        out, [*callbacks, *peaks.around(), _Record(out, peaks)], max_steps, devices=WORLD,
        log_every_n_steps=1, strategy=strategy, logger=CSVLogger(out, name="autofit"), precision=precision,
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, ckpt_path=ckpt_path)
    (out / f"warnings_{trainer.global_rank}.json").write_text(json.dumps([str(w.message) for w in caught]))
    if save is not None:
        trainer.save_checkpoint(save)


class BuiltLate(Llama):
    """Llama with a layer ``configure_model`` adds after AutoFitStrategy planned (64 x 64 + 64 parameters)."""

    def configure_model(self):
        if not hasattr(self, "extra"):
            self.extra = torch.nn.Linear(64, 64)


class ChunkedLlama(Llama):
    """The chunked-loss pattern (`advise`'s fix): the decoder's output, then the head a slice at a time;
    ``self.model``, the smallest module holding every parameter, never runs its own forward."""

    def training_step(self, batch, batch_idx):
        hidden = self.model.model(input_ids=batch["input_ids"]).last_hidden_state
        return chunked_cross_entropy(hidden[:, :-1], self.model.lm_head, batch["labels"][:, 1:])


def _refused(out: Path, budget: str = "200KiB", module=Llama) -> None:
    out.mkdir(parents=True, exist_ok=True)
    trainer = cpu_trainer(out, [], 1, devices=WORLD, logger=False, strategy=AutoFitStrategy(budget=budget))
    try:
        trainer.fit(module())
    except (ValueError, RuntimeError) as error:
        (out / f"error_{trainer.global_rank}.txt").write_text(str(error))


def _resume(out: Path) -> None:
    """Two steps under a roomy budget, saved; resumed under a tight one (a plan for another budget: the
    tight one's goes on, with the checkpoint's optimizer), and resumed from the checkpoint with its plan
    rewritten: to 2 x 2 (for this run: installed), and to 2 x 2 on 4 ranks (not installed)."""
    checkpoint = out / "first.ckpt"
    _fit(out / "first", AutoFitStrategy(budget="1GiB"), Llama(), max_steps=2, save=checkpoint)
    _fit(out / "resumed", AutoFitStrategy(budget="900KiB"), Llama(), ckpt_path=checkpoint)
    for name, world_size in (("same_run", WORLD), ("four_ranks", 4)):
        rewritten = out / f"{name}.ckpt"
        if torch.distributed.get_rank() == 0:
            _rewrite_plan(
                checkpoint, rewritten, micro_batch_size=2, accumulate_grad_batches=2, world_size=world_size
            )
        torch.distributed.barrier()
        _fit(out / name, AutoFitStrategy(budget="1GiB"), Llama(), ckpt_path=rewritten)


def _rewrite_plan(source: Path, target: Path, **plan) -> None:
    """A copy of the distributed checkpoint ``source`` whose AutoFit plan has the fields ``plan``."""
    from lightning.fabric.utilities.load import _METADATA_FILENAME

    shutil.copytree(source, target)
    metadata = torch.load(target / _METADATA_FILENAME, weights_only=False)
    metadata["callbacks"]["AutoFit"]["plan"].update(plan)
    torch.save(metadata, target / _METADATA_FILENAME)


def _plain() -> ModelParallelStrategy:
    return ModelParallelStrategy(data_parallel_size=WORLD, tensor_parallel_size=1)


#: name -> what one rank runs, in this order
RUNS = {
    "900KiB": lambda out: _fit(out, AutoFitStrategy(budget="900KiB"), Llama()),
    "600KiB": lambda out: _fit(out, AutoFitStrategy(budget="600KiB"), Llama()),
    "roomy": lambda out: _fit(out, AutoFitStrategy(budget="1GiB"), Llama()),
    "by_hand": lambda out: _fit(out, _plain(), SameSharding(False)),
    "own_sharding": lambda out: _fit(out, AutoFitStrategy(budget="1GiB"), ShardedLlama(WORLD)),
    # the callbacks in a plain FSDP2 run plan the sharded step too
    "autofit_callback": lambda out: _fit(out, _plain(), SameSharding(True), callbacks=[AutoFit("900KiB")]),
    "checkpointing_callback": lambda out: _fit(
        out, _plain(), SameSharding(True), callbacks=[ActivationCheckpointing(budget="900KiB", cost="flops")]
    ),
    "offloaded": lambda out: _fit(out, AutoFitStrategy(budget="400KiB"), Llama()),
    # bf16-mixed: every unit gathered in bf16 (MixedPrecisionPolicy), as planned
    "bf16": lambda out: _fit(out, AutoFitStrategy(budget="600KiB"), Llama(), precision="bf16-mixed"),
    "refused": _refused,
    "built_late": lambda out: _refused(out, "1GiB", BuiltLate),
    "chunked": lambda out: _refused(out, "1GiB", ChunkedLlama),
    "resume": _resume,
}


def _rank(rank: int, out: Path) -> None:
    counting_allocator()
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")
    torch.set_num_threads(1)
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{out / 'store'}", rank=rank, world_size=WORLD,
        timeout=COLLECTIVE_TIMEOUT,
    )  # fmt: skip
    for name, run in RUNS.items():
        try:
            run(out / name)
        except Exception:
            (out / name).mkdir(parents=True, exist_ok=True)
            (out / name / f"crash_{rank}.txt").write_text(traceback.format_exc())
    torch.distributed.destroy_process_group()


def run_ranks(out: Path) -> None:
    build_counting_allocator()
    spawn_ranks(_rank, (out,), WORLD, "AutoFitStrategy")


def read(folder: Path, rank: int) -> dict:
    crashes = [p.read_text() for p in sorted(folder.glob("crash_*.txt"))]
    assert not crashes, "\n".join(crashes)
    return json.loads((folder / f"rank_{rank}.json").read_text())


def _warned(folder: Path, text: str) -> bool:
    """Whether global rank 0 of the run in ``folder`` warned ``text`` (rank_zero_warn: rank 0's only)."""
    return any(text in said for said in json.loads((folder / "warnings_0.json").read_text()))


@pytest.fixture(scope="module")
def runs(once):
    return once("autofit_strategy", run_ranks)


# --- the tests ---------------------------------------------------------------------------------------


def test_the_strategy_is_registered_by_name():
    """``Trainer(strategy="autofit")`` (and LightningCLI's ``--trainer.strategy autofit``) reach it."""
    trainer = cpu_trainer(None, [], strategy="autofit")
    assert isinstance(trainer.strategy, AutoFitStrategy)
    assert trainer.strategy.autofit.budget == "auto"


#: a fresh process: lightning_memkit imported before Lightning, AutoFitStrategy never imported by name
_BY_NAME = """
import sys
import lightning_memkit
assert "lightning" not in sys.modules and "lightning_memkit.strategies" not in sys.modules
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.demos.boring_classes import BoringModel

common = ["--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.logger=false"]
named = LightningCLI(BoringModel, run=False, args=[*common, "--trainer.strategy=autofit"])
sized = LightningCLI(BoringModel, run=False, args=[
    *common, "--trainer.strategy=lightning_memkit.AutoFitStrategy", "--trainer.strategy.budget=8GiB"])
print(type(named.trainer.strategy).__name__, named.trainer.strategy.autofit.budget,
      sized.trainer.strategy.autofit.budget)
"""


class _Scaled(pl.LightningModule):
    """A parameter on the LightningModule itself (a learned scale), beside ``self.model``: the smallest module
    holding every parameter is the LightningModule, whose forward the step never calls."""

    def __init__(self) -> None:
        super().__init__()
        self.model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
        self.scale = torch.nn.Parameter(torch.ones(1))

    def training_step(self, batch, batch_idx):
        return (self.model(batch) * self.scale).mean()


def test_a_root_unit_the_step_never_calls_is_refused_naming_the_parameter(tmp_path):
    """AutoFitStrategy refuses, as the fit starts, to make the LightningModule the root FSDP2 unit where it
    has no forward (the first op then met a sharded ``scale``: "mixed torch.Tensor and DTensor", raised
    from inside the plan's simulation)."""
    trainer = cpu_trainer(tmp_path, [], strategy=AutoFitStrategy(budget="1GiB"), logger=False, max_steps=1)
    refusal = r"holding every parameter is _Scaled itself \(it holds `scale`"
    with pytest.raises(ValueError, match=refusal) as refused:
        trainer.fit(_Scaled())
    assert "Move `scale` into the module training_step calls" in str(refused.value)


def test_a_module_without_parameters_yet_is_left_to_the_planners_sentence():
    """No parameters at all (configure_model builds them) is no root unit to refuse: planning then says
    why, in `without_parameters`' words (test_refusals.py), not "its parameters are in , ..."."""
    _check_root(BuiltLater(build_later=True))  # nothing raised
    with pytest.raises(ValueError, match="is _Scaled itself"):
        _check_root(_Scaled())


@pytest.mark.slow  # a fresh process importing Lightning
def test_importing_lightning_memkit_registers_the_strategy_by_name():
    """``import lightning_memkit`` alone, before Lightning, registers ``"autofit"`` (it failed with
    "invalid strategy name" unless AutoFitStrategy itself was imported), and LightningCLI gives the budget
    through the class's path."""
    done = subprocess.run([sys.executable, "-c", _BY_NAME], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-3:] == ["AutoFitStrategy", "auto", "8GiB"]


def test_by_name_on_a_cpu_the_strategy_says_how_to_give_a_budget(tmp_path):
    """By name the budget is the CUDA device; without one the run is refused at its start, with the two
    ways to give a size (it was AutoFit's message, naming a callback the user never wrote)."""
    from lightning.pytorch.demos.boring_classes import BoringModel

    trainer = cpu_trainer(tmp_path, [], strategy="autofit", logger=False, max_steps=1)
    refusal = r"AutoFitStrategy\(budget='auto'\) reads the CUDA device"
    with pytest.raises(ValueError, match=refusal) as refused:
        trainer.fit(BoringModel())
    assert 'AutoFitStrategy(budget="8GiB")' in str(refused.value)
    assert "--trainer.strategy.budget=8GiB" in str(refused.value)


@pytest.mark.slow
@needs_distributed
@ranks
@pytest.mark.parametrize("budget", ["900KiB", "600KiB"])
def test_every_rank_fits_the_budget_it_was_planned_for(runs, budget):
    """Every rank's every step within the budget, by the allocator (the plan keeps its estimate under the
    limit, the budget less the 10 % margin: on gloo an all-gather sometimes stages a copy in its worker
    thread, unseen by any op, which the margin is for); the steady step is the plan's estimate within 1 %;
    the plan is the same on every rank, and installed."""
    limit = int(parse_bytes(budget) * 0.9)
    plans = []
    for rank in range(WORLD):
        record = read(runs / budget, rank)
        plan = record["plan"]
        plans.append(plan)
        assert record["global_step"] == STEPS and plan["world_size"] == WORLD and plan["strategy"] == "fsdp2"
        assert plan["limit"] == limit and plan["estimated_peak"] <= limit
        assert max(record["allocator"]) <= parse_bytes(budget), f"rank {rank}: {record['allocator']}"
        assert matches_the_rank(plan["estimated_peak"], record["allocator"][-1]), record["allocator"]
        assert (
            record["batch_size"] == plan["micro_batch_size"]
            and record["accumulate"] == (plan["accumulate_grad_batches"])
        )
        assert record["units"] == ["model.model.layers.0", "model.model.layers.1", "model"]
        latency, bandwidth = record["link"]  # this job's collectives, timed as the processes started
        assert 0 < latency < 1 and bandwidth > 1e6
    assert plans[0] == plans[1]


@pytest.mark.slow
@needs_distributed
@ranks
def test_a_tighter_budget_gets_a_leaner_plan(runs):
    """What the tighter budget changed (micro-batch or checkpointing), not only the figure."""
    roomy, tight = read(runs / "900KiB", 0)["plan"], read(runs / "600KiB", 0)["plan"]
    assert tight["estimated_peak"] < roomy["estimated_peak"]
    assert (tight["micro_batch_size"], tight["checkpointing"]) != (
        roomy["micro_batch_size"],
        roomy["checkpointing"],
    )


@pytest.mark.slow
@needs_distributed
@ranks
def test_a_plan_that_changes_nothing_trains_as_plain_fsdp2(runs):
    """A roomy budget plans the user's micro-batch, no checkpointing, their optimizer, and no resharding
    after forward: the run is bit-identical (losses and local shards, every rank) to ModelParallelStrategy
    with the same fully_shard calls by hand."""
    for rank in range(WORLD):
        planned, by_hand = read(runs / "roomy", rank), read(runs / "by_hand", rank)
        plan = planned["plan"]
        assert (plan["micro_batch_size"], plan["accumulate_grad_batches"]) == (BATCH, 1)
        assert plan["checkpointing"] == "none" and plan["reshard_after_forward"] is False
        assert planned["optimizer"] == by_hand["optimizer"] == "AdamW"
        assert planned["losses"] == by_hand["losses"] and len(planned["losses"]) == STEPS
        assert planned["parameters"] == by_hand["parameters"]


@pytest.mark.slow
@needs_distributed
@ranks
def test_a_users_own_sharding_is_kept_and_the_difference_named(runs):
    """ShardedLlama applies fully_shard itself (its layers, then the LightningModule): kept, and a warning
    (rank 0 only) says the plan simulated the layers and ``self.model``."""
    for rank in range(WORLD):
        record = read(runs / "own_sharding", rank)
        assert record["units"] == ["model.model.layers.0", "model.model.layers.1", ""]
        assert record["global_step"] == STEPS
        said = [w for w in json.loads((runs / "own_sharding" / f"warnings_{rank}.json").read_text())]
        hints = [w for w in said if "configure_model sharded" in w]
        assert len(hints) == (rank == 0), said
        if rank == 0:
            assert "`model`" in hints[0] and "`the LightningModule`" in hints[0]


@pytest.mark.slow
@needs_distributed
@ranks
def test_a_budget_only_offload_meets_trains_with_cpu_offload(runs):
    """FSDP2's CPUOffloadPolicy where nothing fits without it: planned, applied to every unit, and the run
    trains (on the CPU the host is the device: what it saves is not measurable here)."""
    for rank in range(WORLD):
        record = read(runs / "offloaded", rank)
        assert record["plan"]["cpu_offload"] and record["global_step"] == STEPS
        assert record["offload"] == [True] * 3


@pytest.mark.slow
@needs_distributed
@ranks
def test_a_budget_nothing_meets_is_refused_on_every_rank_with_the_figures(runs):
    for rank in range(WORLD):
        error = (runs / "refused" / f"error_{rank}.txt").read_text()
        assert "No plan fits 180.00 KiB" in error and "Static floor" in error and "peaks at" in error


@pytest.mark.slow
@needs_distributed
@ranks
def test_layers_configure_model_builds_after_the_plan_are_refused_on_every_rank(runs):
    """configure_model adds a layer after the plan was made (at setup): refused before sharding, naming it
    and its size, and where to build it."""
    for rank in range(WORLD):
        error = (runs / "built_late" / f"error_{rank}.txt").read_text()
        assert "BuiltLate.configure_model built 4,160 parameters (`extra.weight`, `extra.bias`)" in error
        assert "Build those layers in __init__" in error


@pytest.mark.slow
@needs_distributed
@ranks
def test_a_step_around_the_root_units_forward_is_refused_naming_the_unit(runs):
    """The chunked loss calls the decoder and the head, never ``self.model``'s forward, so the root unit's
    own parameters (embeddings, norm, head) stay sharded: refused on every rank, naming the unit and them,
    where the simulation said only "mixed torch.Tensor and DTensor"."""
    for rank in range(WORLD):
        error = (runs / "chunked" / f"error_{rank}.txt").read_text()
        assert "the smallest module holding every parameter, is `model` (LlamaForCausalLM)" in error
        assert "`model.model.embed_tokens.weight`" in error and "Call self.model(...)" in error


@pytest.mark.slow
@needs_distributed
@ranks
def test_a_resumed_run_trains_on_with_the_saved_plan(runs):
    """The checkpoint keeps the plan. Resumed under the budget it was made for, the run installs it over
    its own (micro-batch, accumulation, reshard_after_forward, the optimizer rebuilt before its state loads)
    and finishes its steps; resumed under a tighter budget, the tight plan trains, with the checkpoint's
    optimizer state."""
    for rank in range(WORLD):
        first = read(runs / "resume" / "first", rank)
        same, tight = read(runs / "resume" / "same_run", rank), read(runs / "resume" / "resumed", rank)
        assert first["global_step"] == 2 and first["optimizer_steps"] == [2.0]
        assert (first["plan"]["micro_batch_size"], first["plan"]["accumulate_grad_batches"]) != (2, 2)
        assert (same["plan"]["micro_batch_size"], same["plan"]["accumulate_grad_batches"]) == (2, 2)
        assert (same["batch_size"], same["accumulate"]) == (2, 2)
        assert tight["plan"]["budget"]["source"] == "900KiB" and tight["plan"]["optimizer"] == "adamw"
        assert tight["batch_size"] == tight["plan"]["micro_batch_size"]
        for resumed in (same, tight):
            assert resumed["global_step"] == STEPS and resumed["optimizer_steps"] == [float(STEPS)]
            assert len(resumed["losses"]) == (STEPS - 2) * resumed["accumulate"]  # one a micro-batch
    assert _warned(runs / "resume" / "resumed", "made for another run (budget 1.00 GiB (1GiB) -> 900.00 KiB")


@pytest.mark.slow
@needs_distributed
@ranks
def test_a_plan_saved_on_four_ranks_is_not_installed_on_two(runs):
    """The checkpoint's plan rewritten as 4 ranks would have saved it (2 x 2 each): on 2 ranks it would
    peak over its limit, so this run's own plan trains (its micro-batch, "x 2 GPUs"), with the checkpoint's
    optimizer state, and a warning names the world size, both values."""
    for rank in range(WORLD):
        four = read(runs / "resume" / "four_ranks", rank)
        assert four["plan"]["world_size"] == WORLD and (four["batch_size"], four["accumulate"]) != (2, 2)
        assert four["batch_size"] == four["plan"]["micro_batch_size"]
        assert four["global_step"] == STEPS and four["optimizer_steps"] == [float(STEPS)]
    assert _warned(runs / "resume" / "four_ranks", "made for another run (world size 4 -> 2)")


@pytest.mark.slow
@needs_distributed
@ranks
def test_autofit_and_activation_checkpointing_plan_the_sharded_step_under_model_parallel(runs):
    """Under plain ModelParallelStrategy (the user's fully_shard), AutoFit and ActivationCheckpointing plan
    one rank's FSDP2 step: every rank within the budget by the allocator, the steady step the plan's
    figure within 1 %."""
    budget = parse_bytes("900KiB")
    for rank in range(WORLD):
        fit = read(runs / "autofit_callback", rank)
        plan = fit["callback_plans"]["AutoFit"]
        assert plan["strategy"] == "fsdp2" and plan["world_size"] == WORLD
        assert max(fit["allocator"]) <= budget
        assert (fit["batch_size"], fit["accumulate"]) == (
            plan["micro_batch_size"],
            plan["accumulate_grad_batches"],
        )
        checkpointed = read(runs / "checkpointing_callback", rank)
        plan = checkpointed["callback_plans"]["ActivationCheckpointing"]
        assert {block["mode"] for block in plan["blocks"]} - {"none"}, plan  # it had to checkpoint
        assert max(checkpointed["allocator"]) <= budget
        assert matches_the_rank(plan["peak"], checkpointed["allocator"][-1]), checkpointed["allocator"]


def test_the_strategy_and_the_callback_do_not_plan_twice():
    trainer = cpu_trainer(None, [AutoFit("1GiB")], strategy=AutoFitStrategy(budget="1GiB"), max_steps=1)
    with pytest.raises(ValueError, match="remove AutoFit from the Trainer's callbacks"):
        trainer.fit(Llama())


# --- CPU offload: planned where nothing else fits (in this process, no ranks) --------------------------


def _offload_plan(budget, cost="flops", **kwargs):
    return plan_fit(
        Llama(), zoo_batch("qwen2", BATCH * WORLD, SEQ), budget, strategy="fsdp2", world_size=WORLD,
        device="cpu", cost=cost, optimizers=["adamw"], **kwargs,
    )  # fmt: skip


@pytest.mark.slow  # planning-heavy: a dozen sharded simulations
def test_cpu_offload_is_planned_only_where_nothing_else_fits():
    """A budget the sharded step fits is planned without offload; one it fits only with the shards and the
    optimizer state on the host gets FSDP2's CPUOffloadPolicy, its device figure the simulated step less
    those (an upper bound: the gradients still counted), with the host memory it needs; the code says so."""
    roomy = _offload_plan("600KiB", cpu_offload=None)
    assert not roomy.cpu_offload and roomy.host_bytes == 0
    tight = _offload_plan("400KiB", cpu_offload=None)
    assert tight.cpu_offload and tight.estimated_peak <= tight.limit
    model = Llama()
    plan = tight.checkpoint_plan or tight.checkpointing
    batch = zoo_batch("qwen2", tight.micro_batch_size, SEQ)
    on_device = estimate_memory(
        model, batch, device="cpu", checkpointing=plan, accumulating=tight.accumulate_grad_batches > 1,
        sharding=Sharding(WORLD, reshard_after_forward=tight.reshard_after_forward),
    )  # fmt: skip
    shards = shard_bytes(model, WORLD)
    assert tight.estimated_peak < on_device.peak
    assert tight.estimated_peak >= on_device.peak - shards - on_device.optimizer_state
    assert tight.host_bytes >= shards
    assert "offloaded to the CPU" in tight.summary()
    code = plan_code(tight, model, global_batch=BATCH * WORLD, optimizers=["adamw"])
    assert "offload_policy=CPUOffloadPolicy()" in code and "import CPUOffloadPolicy, fully_shard" in code
    with pytest.raises(ValueError, match="With FSDP2's CPU offload"):
        _offload_plan("200KiB", cpu_offload=None)
    with pytest.raises(ValueError, match=r"No plan fits"):  # not offered unless asked
        _offload_plan("400KiB")
    forced = _offload_plan("600KiB", cpu_offload=True)  # asked for: planned even where not needed
    assert forced.cpu_offload and forced.estimated_peak < roomy.estimated_peak
    with pytest.raises(ValueError, match="plan it with strategy='fsdp2'"):
        plan_fit(Llama(), zoo_batch("qwen2", 8, SEQ), "1GiB", world_size=2, device="cpu", cpu_offload=True)


@pytest.mark.slow  # planning-heavy
def test_a_slow_link_plans_fewer_larger_micro_batches():
    """Each micro-step all-gathers and reduce-scatters the model: with compute alone (no fixed cost a
    micro-step) the plan prefers no recompute at a smaller micro-batch; over a slow link it takes the
    largest micro-batch that fits, checkpointing more."""
    compute = StepCost(0.0, 1.0, "flops")
    free = _offload_plan("700KiB", link=Link(0.0, float("inf")), cost=compute)
    slow = _offload_plan("700KiB", link=Link(0.1, 1e6), cost=compute)
    assert slow.micro_batch_size > free.micro_batch_size
    assert slow.micro_batch_size == max(
        a.micro_batch_size for a in slow.alternatives if a.fits
    )  # the largest that fits at all
    seconds = collective_seconds(4000, 4000, 3, 2, True, Link(0.1, 1e6))
    assert seconds == pytest.approx((3 + 2 + 3) * 0.1 + 0.5 * (8000 + 4000) / 1e6)


@pytest.mark.slow
def test_one_rank_of_fsdp2_plans_no_optimizer_dtensor_cannot_run():
    """On one rank the step still runs on DTensors: the same optimizers are left out as on many."""
    plan = plan_fit(Llama(), zoo_batch("qwen2", 4, SEQ), "1GiB", strategy="fsdp2", world_size=1, device="cpu",
                    cost="flops", optimizers=["adamw", "adamw8bit", "adafactor"])  # fmt: skip
    assert plan.optimizer == "adamw" and "adamw8bit" in plan.note and "adafactor" in plan.note


@pytest.mark.slow  # planning-heavy
def test_the_fused_step_is_planned_on_the_sharded_step():
    """Under FSDP2 each shard steps inside backward once its reduce-scatter is done: `plan_fit` plans the
    fused step there, with no accumulation (it steps at every backward); DDP is refused, saying why."""
    plan = _offload_plan("1MiB", lever="fused_step")
    assert plan.lever == "fused_step" and plan.accumulate_grad_batches == 1
    assert plan.estimated_peak <= plan.limit
    with pytest.raises(ValueError, match="cannot run under ddp: it reduces each gradient"):
        plan_fit(Llama(), zoo_batch("qwen2", 8, SEQ), "1MiB", world_size=2, device="cpu", lever="fused_step")


@pytest.mark.slow
@ranks
@needs_distributed
def test_a_bf16_mixed_run_is_sharded_and_planned_with_a_bf16_policy(runs):
    """``precision="bf16-mixed"``: every unit all-gathers in bf16 (FSDP2's MixedPrecisionPolicy, gradients
    reduced in fp32), the plan simulated that, and every rank's steady step is the plan's estimate (1 %),
    within the budget."""
    for rank in range(WORLD):
        record = read(runs / "bf16", rank)
        plan = record["plan"]
        assert plan["mp_policy"] and plan["precision"] == "bf16-mixed"
        assert set(record["param_dtypes"]) == {"torch.bfloat16"}
        assert max(record["allocator"]) <= parse_bytes("600KiB")
        assert matches_the_rank(plan["estimated_peak"], record["allocator"][-1]), record["allocator"]


@pytest.mark.slow  # planning-heavy: two sharded plans
def test_a_bf16_mixed_plan_simulates_and_prints_the_bf16_policy():
    """`plan_fit(mp_policy=True)`: a bf16-mixed plan's step simulated with FSDP2's bf16
    MixedPrecisionPolicy (leaner: at this budget, a micro-batch twice as large fits), said in the summary
    and in the code by hand."""
    options = dict(cost="flops", precision="bf16-mixed", checkpointing=("none",))
    plan = _offload_plan("1MiB", mp_policy=True, **options)
    plain = _offload_plan("1MiB", **options)
    assert plan.mp_policy and not plain.mp_policy
    assert (plan.micro_batch_size, plain.micro_batch_size) == (4, 2)
    assert "gathered in bf16 (MixedPrecisionPolicy)" in plan.summary()
    code = plan_code(plan, Llama(), global_batch=BATCH * WORLD, optimizers=["adamw"])
    assert "policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)" in code
    assert "mp_policy=policy" in code and "import MixedPrecisionPolicy, fully_shard" in code
    with pytest.raises(ValueError, match="mp_policy is FSDP2's MixedPrecisionPolicy"):
        plan_fit(Llama(), zoo_batch("qwen2", 8, SEQ), "1MiB", world_size=2, device="cpu", mp_policy=True)
