"""FSDP2 on gloo CPU ranks, measured per rank: `MemoryMonitor` against each rank's allocator, every step.

What runs on CPU with torch 2.13 and Lightning 2.6: Lightning's ``ModelParallelStrategy`` with torch's
``fully_shard`` (FSDP2) on a gloo mesh. Lightning's ``FSDPStrategy`` (FSDP1) does not: the Trainer refuses
it without a CUDA accelerator, and torch's ``FullyShardedDataParallel`` refuses a CPU-only machine itself
("FSDP needs a non-CPU accelerator device") when the Trainer's check is bypassed.

The model is a Hugging Face LLaMA from a random config (defaults kept, a vocabulary that shards
unevenly), sharded as Lightning documents FSDP2: ``fully_shard`` on each decoder layer, then on the whole
module, in ``configure_model``. The truth is the CPU allocator's own count in every thread
(`lightning_memkit.testing.counting_allocator`): torch.profiler's timeline misses what gloo's worker
threads allocate and free, and read a rank's steady step growing from step to step. The monitor and the
truth run in the same fit: gloo's threads time some frees, so two fits of the same steps can differ.

The ranks start once per world size and test session and run every `SCENARIOS` entry in turn, as
test_ddp's do.
"""

import hashlib
import json
import os
import traceback
import warnings
from functools import partial
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch.distributed
from helpers import COLLECTIVE_TIMEOUT, cpu_trainer, needs_distributed, spawn_ranks
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import MixedPrecisionPolicy
from zoo import ZooModule, zoo_batch

from lightning_memkit import (
    FusedOptimizerStep,
    GradientRelease,
    MemoryMonitor,
    Sharding,
    apply_checkpointing,
    estimate_memory,
)
from lightning_memkit._breakdown import format_bytes
from lightning_memkit._estimating.analytic import shard
from lightning_memkit._measuring.storages import storage_bytes
from lightning_memkit._sharding.accounting import SHARDED_KINDS
from lightning_memkit.testing import AllocatorPeaks, build_counting_allocator, counting_allocator

pytestmark = pytest.mark.xdist_group("ddp-ranks")  # one set of rank processes at a time, with test_ddp's

STEPS = 3  # optimizer steps of each fit: the first (no optimizer state yet) and two steady ones
BATCH, SEQ = 4, 32  # a rank's micro-batch
BF16_POLICY = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
OOM_BUDGET = "850KiB"  # `_diagnosis.oom`'s pretend device: below the first step's need at 2 and 4 ranks

#: name -> how the module is sharded and trained (ShardedLlama's and the Trainer's arguments)
SCENARIOS = {
    "default": {},
    "no_reshard": {"reshard_after_forward": False},
    "full_checkpointing": {"checkpointing": "full"},
    "selective_checkpointing": {"checkpointing": "selective"},
    "bf16_policy": {"bf16": True},
    "accumulation": {"accumulate_grad_batches": 2},
    "gradient_release": {"lever": GradientRelease},
    "fused_step": {"lever": FusedOptimizerStep},
    "compiled": {"compile_layers": True},  # each decoder layer compiled, as torchtitan does
}


def llama() -> torch.nn.Module:
    """A Hugging Face LLaMA from a random tiny config (grouped-query attention, defaults kept) whose
    vocabulary, 131 rows, shards unevenly over 2 and 4 ranks: FSDP2 pads the last shards."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=131, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    return LlamaForCausalLM(config)


class ShardedLlama(ZooModule):
    """`llama` with FSDP2 applied in ``configure_model`` as Lightning documents it: checkpointing first (as
    torchtitan orders it), then ``fully_shard`` on each decoder layer and on the whole module; with
    ``compile_layers``, each decoder layer then compiled (``layer.compile()``)."""

    def __init__(
        self, world=2, reshard_after_forward=True, checkpointing=None, bf16=False, compile_layers=False
    ):
        # The zoo's causal-LM batches; enough for every rank's steps in one epoch (the sampler splits them).
        super().__init__("qwen2", batch_size=BATCH, seq_len=SEQ, n_batches=2 * STEPS * world)
        self.model = llama()
        self.reshard_after_forward, self.checkpointing, self.bf16 = reshard_after_forward, checkpointing, bf16
        self.compile_layers = compile_layers

    def configure_model(self):
        from torch.distributed.fsdp import fully_shard

        if self.checkpointing:
            apply_checkpointing(self.model, self.checkpointing)
        mesh = self.device_mesh["data_parallel"]
        kwargs = dict(mesh=mesh, reshard_after_forward=self.reshard_after_forward)
        if self.bf16:
            kwargs["mp_policy"] = BF16_POLICY
        for layer in self.model.model.layers:
            fully_shard(layer, **kwargs)
        fully_shard(self, **kwargs)
        if self.compile_layers:
            for layer in self.model.model.layers:
                layer.compile()


class CallsInsideTheRoot(ShardedLlama):
    """A ``training_step`` that calls the Hugging Face model directly, under ``fully_shard(self)``: the
    root's own forward never runs, so its parameters (embeddings, final norm, head) stay sharded."""

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss


class OutOfMemory(ShardedLlama):
    """A step that runs out of memory on real tensors, as on a device too small for it; the fake ones of
    a simulation go through. (`PretendOOM` wraps the module's step from outside: under FSDP2 the simulated
    twin would call the sharded module's.)"""

    def training_step(self, batch, batch_idx):
        if type(batch["input_ids"]) is torch.Tensor:
            raise torch.OutOfMemoryError("out of memory (pretend: a small device)")
        return super().training_step(batch, batch_idx)


class _Record(pl.Callback):
    """Writes each rank's losses and local shards' digest, and with a monitor its figures (per optimizer
    step) and the allocator's peaks (per batch)."""

    def __init__(self, out: Path, peaks: AllocatorPeaks | None, monitor: MemoryMonitor | None) -> None:
        self.out, self.peaks, self.monitor, self.losses = out, peaks, monitor, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].item())

    def record(self, trainer, pl_module) -> dict:
        digest = hashlib.sha256()
        for p in pl_module.parameters():
            digest.update(p.to_local().detach().contiguous().numpy().tobytes())
        record = {"losses": self.losses, "parameters": digest.hexdigest(), "global_step": trainer.global_step}
        if self.monitor is not None:
            record |= {
                "allocator": self.peaks.peaks,
                "monitor": [b.as_dict() for _, b in self.monitor.history],
                "sharded": [s for _, s in self.monitor.sharded_history],
                "disabled": self.monitor._disabled,
                "buffers": storage_bytes(pl_module.buffers()),
                "advice": self.monitor.advice.as_dict() if self.monitor.advice is not None else None,
            }
        return record

    def on_train_end(self, trainer, pl_module):
        record = self.record(trainer, pl_module)
        (self.out / f"rank_{trainer.global_rank}.json").write_text(json.dumps(record))


def _scenario(out: Path, world: int, config: dict, watched: bool = True) -> None:
    config = dict(config)
    accumulate = config.pop("accumulate_grad_batches", 1)
    levers = [config.pop("lever")()] if "lever" in config else []
    advise = config.pop("advise", False)
    callbacks = [_Record(out, None, None)]
    if watched:
        peaks = AllocatorPeaks(all_threads=True)
        monitor = MemoryMonitor(plot=False, summary=False, advise=advise)
        callbacks = [*peaks.around(monitor), _Record(out, peaks, monitor)]
    callbacks = [*levers, *callbacks]
    torch.manual_seed(0)
    trainer = cpu_trainer(
        out, callbacks, STEPS, devices=world, log_every_n_steps=1, logger=CSVLogger(out, name="fsdp"),
        strategy=ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1),
        accumulate_grad_batches=accumulate,
    )  # fmt: skip
    trainer.fit(ShardedLlama(world, **config))


def _mixed(out: Path, world: int) -> None:
    """A fit that fails with DTensor's "mixed torch.Tensor and DTensor": what the monitor says."""
    trainer = cpu_trainer(
        out, [MemoryMonitor(plot=False, summary=False)], 1, devices=world,
        strategy=ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1),
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.fit(CallsInsideTheRoot(world))
        except RuntimeError as error:
            record = {"error": str(error), "warnings": [str(w.message) for w in caught]}
            (out / f"rank_{trainer.global_rank}.json").write_text(json.dumps(record))


def _oom(out: Path, world: int) -> None:
    """A fit whose first step runs out of memory on every rank (`PretendOOM`): what the monitor says."""
    module = OutOfMemory(world)
    trainer = cpu_trainer(
        out, [MemoryMonitor(budget=OOM_BUDGET, plot=False, summary=False)], 1, devices=world,
        strategy=ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1),
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.fit(module)
        except torch.OutOfMemoryError as error:
            record = {"error": str(error), "warnings": [str(w.message) for w in caught]}
            (out / f"rank_{trainer.global_rank}.json").write_text(json.dumps(record))


def _rank(rank: int, out: Path, world: int) -> None:
    """One FSDP rank: the allocator's counter before anything is allocated, the process group, then every
    scenario in turn; a scenario's error goes to its folder."""
    counting_allocator()
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")  # Lightning then launches no processes itself
    torch.set_num_threads(1)
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{out / 'store'}", rank=rank, world_size=world,
        timeout=COLLECTIVE_TIMEOUT,
    )  # fmt: skip
    runs = [(name, partial(_scenario, config=config)) for name, config in SCENARIOS.items()]
    runs += [("unwatched", partial(_scenario, config={}, watched=False)), ("mixed", _mixed), ("oom", _oom)]
    # The monitor's advice at the end of fit; apart: on a CPU its copy of the first batch is the allocator's.
    runs += [("advised", partial(_scenario, config={"advise": True}))]
    for name, run in runs:
        try:
            run(out / name, world)
        except Exception:
            (out / name / f"error_{rank}.txt").write_text(traceback.format_exc())
    torch.distributed.destroy_process_group()


def run_ranks(out: Path, world: int) -> None:
    """Run `SCENARIOS` on ``world`` spawned ranks, writing into ``out/<scenario>``."""
    build_counting_allocator()  # compiled here once, not by every rank at the same time
    for name in [*SCENARIOS, "unwatched", "mixed", "oom", "advised"]:
        (out / name).mkdir(parents=True)
    spawn_ranks(_rank, (out, world), world, "FSDP")


def staged_bytes() -> int:
    """The most a gloo all-gather can hold in gloo's own worker thread at a rank's peak: the largest
    unit's gathered parameters (in fp32). gloo sometimes stages a gather there, where no op of the step
    shows it; whether the copy overlaps the peak is a matter of timing (docs/sharded.md)."""
    from lightning_memkit._checkpointing.blocks import find_blocks
    from lightning_memkit._sharding.fsdp2 import largest_unit_shard

    module = ShardedLlama(1)
    return largest_unit_shard(module, [name for name, _ in find_blocks(module)], 1, itemsize=4)


def matches_the_rank(estimate: int, truth: int) -> bool:
    """An estimate (or plan) of a rank's step against its allocator: within 1 %, or below it by at most a
    gather gloo staged in its worker thread (`staged_bytes`), which no simulation of the step can see."""
    return abs(estimate - truth) <= 0.01 * truth or 0 < truth - estimate <= 0.01 * truth + staged_bytes()


def read(out: Path, scenario: str, rank: int) -> dict:
    folder = out / scenario
    errors = [p.read_text() for p in sorted(folder.glob("error_*.txt"))]
    assert not errors, "\n".join(errors)
    return json.loads((folder / f"rank_{rank}.json").read_text())


def per_step_truth(record: dict, accumulate: int) -> list[int]:
    """The allocator's peak of each optimizer step: the highest of its micro-batches."""
    batches = record["allocator"]
    return [max(batches[i : i + accumulate]) for i in range(0, len(batches), accumulate)]


@pytest.fixture(scope="module", params=[2, 4], ids=["2-ranks", "4-ranks"])
def fsdp(request, once):
    world = request.param
    return world, once(f"fsdp{world}", lambda out: run_ranks(out, world))


# --- the tests ---------------------------------------------------------------------------------------


def test_lightning_fsdp_strategy_refuses_the_cpu():
    """Lightning's FSDPStrategy (FSDP1) needs CUDA: what stops it on this machine. (Past this check, torch's
    FullyShardedDataParallel raises "FSDP needs a non-CPU accelerator device".) When this fails, Lightning
    runs FSDP1 on CPU: measure it here as the ModelParallelStrategy run is."""
    with pytest.raises(ValueError, match="requires a GPU accelerator"):
        cpu_trainer(None, [], devices=2, strategy="fsdp")


@pytest.mark.slow
@needs_distributed
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_monitor_matches_every_ranks_allocator_every_step(fsdp, scenario):
    """Every rank, every optimizer step, every configuration: MemoryMonitor's peak within 0.1 % of the
    allocator's, and it never switches itself off; its FSDP2 split is part of its categories."""
    world, out = fsdp
    accumulate = SCENARIOS[scenario].get("accumulate_grad_batches", 1)
    for rank in range(world):
        record = read(out, scenario, rank)
        assert record["global_step"] == STEPS and not record["disabled"]
        truth = per_step_truth(record, accumulate)
        measured = [b["peak"] for b in record["monitor"]]
        assert len(measured) == len(truth) == STEPS
        for step, (m, t) in enumerate(zip(measured, truth, strict=True)):
            assert m == pytest.approx(t, rel=1e-3), f"rank {rank}, step {step}: {m:,} vs allocator {t:,}"
        for breakdown, sharded in zip(record["monitor"], record["sharded"], strict=True):
            assert set(sharded) == set(SHARDED_KINDS)
            weights = sharded["sharded_parameters"] + sharded["unsharded_parameters"]
            assert weights + record["buffers"] == breakdown["parameters"]  # buffers are not sharded
            assert sharded["sharded_gradients"] + sharded["unsharded_gradients"] <= breakdown["gradients"]
            assert sharded["communication"] <= breakdown["temporary"]


@pytest.mark.slow
@needs_distributed
def test_watching_changes_nothing_on_any_rank(fsdp):
    """The monitor (and the allocator's counter) leave training as it was: the same losses and the same
    local shards, bit for bit, on every rank."""
    world, out = fsdp
    for rank in range(world):
        watched, unwatched = read(out, "default", rank), read(out, "unwatched", rank)
        assert watched["losses"] == unwatched["losses"] and len(watched["losses"]) == STEPS
        assert watched["parameters"] == unwatched["parameters"]


@pytest.mark.slow
@needs_distributed
@pytest.mark.parametrize("lever", ["gradient_release", "fused_step"])
def test_the_step_levers_act_on_the_sharded_gradients_and_train_alike(fsdp, lever):
    """`GradientRelease` frees each rank's sharded gradients after the step; `FusedOptimizerStep` steps
    each shard as its reduce-scatter hands it its gradient. Either way: the same losses and local shards as
    without the lever, bit for bit, and no step peaks higher."""
    world, out = fsdp
    for rank in range(world):
        levered, default = read(out, lever, rank), read(out, "default", rank)
        assert levered["losses"] == default["losses"] and levered["parameters"] == default["parameters"]
        steps = zip(per_step_truth(levered, 1), per_step_truth(default, 1), strict=True)
        assert all(with_lever <= without + staged_bytes() for with_lever, without in steps)  # gloo's timing


@pytest.mark.slow
@needs_distributed
def test_each_rank_holds_its_shard_and_less_than_the_whole_step(fsdp):
    """What FSDP2 divides: a rank's sharded parameters are its share of the model (the padded rows of the
    uneven vocabulary included), and its steady step peaks below the whole model's step on one device."""
    world, out = fsdp
    module = ShardedLlama(world)
    numel = sum(p.numel() for p in module.parameters())
    whole = estimate_memory(module, zoo_batch("qwen2", BATCH, SEQ), optimizer="adamw", device="cpu").peak
    for rank in range(world):
        record = read(out, "default", rank)
        sharded = record["sharded"][-1]["sharded_parameters"]
        assert 4 * numel / world <= sharded < 4 * numel / world * 1.05
        assert record["monitor"][-1]["peak"] < whole


def simulated_rank(world: int, layout: dict | None = None, **kwargs) -> int:
    """One rank's step as `estimate_memory` simulates it: FSDP2 on fake tensors over a fake process group,
    ``layout`` the `Sharding`'s fields beside ``world``."""
    module = ShardedLlama(world)
    batch = zoo_batch("qwen2", BATCH, SEQ)
    sharding = Sharding(world, **(layout or {}))
    return estimate_memory(module, batch, device="cpu", sharding=sharding, **kwargs).peak


@pytest.mark.slow
@needs_distributed
@pytest.mark.parametrize(
    ("scenario", "options"),
    [
        ("default", {}),
        ("full_checkpointing", {"checkpointing": "full"}),
        ("no_reshard", {"layout": {"reshard_after_forward": False}}),
        ("gradient_release", {"lever": "release_gradients"}),
        ("fused_step", {"lever": "fused_step"}),
        ("bf16_policy", {"layout": {"mp_policy": BF16_POLICY}}),
    ],
)
def test_the_simulated_sharded_step_is_every_ranks_step(fsdp, scenario, options):
    """``estimate_memory(strategy="fsdp2", world_size=N)``, in this one process, against every real rank's
    allocator: the first step (no optimizer state yet) and the steady one, within 1 %."""
    world, out = fsdp
    first = simulated_rank(world, first_step=True, **options)
    steady = simulated_rank(world, **options)
    for rank in range(world):
        truth = per_step_truth(read(out, scenario, rank), 1)
        assert matches_the_rank(first, truth[0]), f"rank {rank}, first step: {first:,} vs {truth[0]:,}"
        assert matches_the_rank(steady, truth[-1]), f"rank {rank}, steady: {steady:,} vs {truth[-1]:,}"


@pytest.mark.slow
@needs_distributed
@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="the analytic fallback (shard(..., 'fsdp', N): the one-device step divided) leaves out what FSDP2 "
    "holds unsharded: the root's parameters for the whole step, the running layer's, a layer's gradient "
    "before its reduce-scatter; estimate_memory(strategy='fsdp2') simulates them",
)
def test_the_analytic_fsdp_division_misses_the_unsharded_units(fsdp):
    world, out = fsdp
    module = ShardedLlama(world)
    whole = estimate_memory(module, zoo_batch("qwen2", BATCH, SEQ), optimizer="adamw", device="cpu")
    grads = 4 * sum(p.numel() for p in module.parameters())
    one_rank = shard(whole, "fsdp", world, gradient_bytes=grads).peak
    for rank in range(world):
        assert one_rank == pytest.approx(per_step_truth(read(out, "default", rank), 1)[-1], rel=0.01)


@pytest.mark.slow
@needs_distributed
def test_a_step_that_bypasses_the_roots_forward_is_told_what_to_shard(fsdp):
    world, out = fsdp
    for rank in range(world):
        record = read(out, "mixed", rank)
        assert "mixed torch.Tensor and DTensor" in record["error"]
        hints = [w for w in record["warnings"] if "fully_shard(self.model)" in w]
        assert len(hints) == (rank == 0), record["warnings"]  # said once, on rank 0
        if rank == 0:
            assert "outermost unit (`self`)" in hints[0]


@pytest.mark.slow
@needs_distributed
def test_the_end_of_fit_advice_is_one_ranks_sharded_step(fsdp):
    """``MemoryMonitor(advise=True)`` under FSDP2: rank 0 advises one rank's step (the module's unsharded
    twin, simulated sharded), the figure `estimate_memory(strategy="fsdp2")` gives, with the fixes priced on
    that step; the other ranks advise nothing."""
    world, out = fsdp
    advice = [read(out, "advised", rank)["advice"] for rank in range(world)]
    assert all(a is None for a in advice[1:])
    assert advice[0]["scope"] == f"one rank of {world} under FSDP2"
    assert advice[0]["breakdown"]["peak"] == simulated_rank(world)
    findings = {f["kind"]: f for f in advice[0]["findings"]}
    assert (
        "activations" in findings and "in 2 blocks (model.model.layers.0" in findings["activations"]["what"]
    )
    full = simulated_rank(world, checkpointing="full")
    assert findings["activations"]["saved"] == advice[0]["breakdown"]["peak"] - full


@pytest.mark.slow
@needs_distributed
def test_an_oom_under_fsdp2_is_explained_per_rank(fsdp):
    """An out-of-memory error in a sharded step: each rank that ran out (here every one) says what one
    rank's step needs, simulated on the model's unsharded twin (the module is sharded by then), and plans
    that fit, for FSDP2 again."""
    world, out = fsdp
    explanations = []
    for rank in range(world):
        record = read(out, "oom", rank)
        assert "pretend" in record["error"]
        explanations += [w for w in record["warnings"] if "MemoryMonitor: out of memory" in w]
    assert len(explanations) == world, explanations  # said once on each rank, which names itself
    assert sorted(m.split("]")[0] for m in explanations) == [f"[rank {r}" for r in range(world)]
    message = explanations[0]
    need = format_bytes(simulated_rank(world, first_step=True))
    assert f"The step needs {need} (one rank's step of {world} under FSDP2, simulated" in message
    assert "Plans that fit in" in message and "fsdp2" in message, message
    assert (
        "Or use AutoFitStrategy, which makes plan 1" in message
        and "AutoFitStrategy)" in message.splitlines()[-1]
    )
    assert "explaining it failed" not in message


@needs_distributed
@pytest.mark.slow
def test_the_simulated_sharded_step_runs_beside_the_jobs_own_group(tmp_path):
    """A Trainer's rank plans its sharded step with its own process group up: the simulation's fake group
    is one beside it, the figure is the one a process without a group gets, and the job's group is left
    as it was (still the default, its world size unchanged, no group of the simulation's left behind)."""
    alone = simulated_rank(4)
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        groups = len(torch.distributed.distributed_c10d._world.pg_map)
        assert simulated_rank(4) == alone
        assert torch.distributed.is_initialized() and torch.distributed.get_world_size() == 1
        assert len(torch.distributed.distributed_c10d._world.pg_map) == groups
    finally:
        torch.distributed.destroy_process_group()


def test_the_unsharded_twin_of_a_sharded_model_simulates_as_the_model_did():
    """What an OOM explanation simulates once ``configure_model`` has sharded the module: its unsharded
    twin (original classes, no FSDP2 hooks, meta parameters of the global shapes), whose simulated sharded
    step is the unsharded module's, with checkpointing applied before sharding kept; the sharded module is
    left as it was."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    from lightning_memkit._diagnosis.oom import simulable
    from lightning_memkit._sharding.fsdp2 import fake_mesh, is_sharded

    batch = zoo_batch("qwen2", BATCH, SEQ)
    for checkpointing in (None, "full"):
        module = ShardedLlama(2)
        if checkpointing:
            apply_checkpointing(module.model, checkpointing)
        expected = estimate_memory(
            module, batch, device="cpu", strategy="fsdp2", world_size=2, first_step=True
        )
        with fake_mesh(2) as mesh:
            for layer in module.model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(module, mesh=mesh)
            optimizer = module.configure_optimizers()
        twin, over_twin = simulable(module, optimizer)
        assert isinstance(module, FSDPModule) and is_sharded(module)  # untouched
        assert type(twin) is ShardedLlama and not is_sharded(twin)
        assert not any(isinstance(m, FSDPModule) for m in twin.modules())
        assert {p.device.type for p in twin.parameters()} == {"meta"}
        assert [p.shape for p in twin.parameters()] == [p.shape for p in module.parameters()]
        assert {id(p) for g in over_twin.param_groups for p in g["params"]} == {
            id(p) for p in twin.parameters()
        }
        got = estimate_memory(
            twin, batch, device="cpu", strategy="fsdp2", world_size=2, first_step=True, optimizer=over_twin
        )
        assert got.as_dict() == expected.as_dict()


class _HookOwner:
    """A hook bound to an object that is not the model's: it holds a real tensor, which no copy of the
    model may copy."""

    def __init__(self) -> None:
        self.big, self.calls = torch.zeros(64, 64), 0

    def hook(self, module, args, output) -> None:
        self.calls += 1


def test_copies_of_the_model_leave_torchs_composable_apis_and_hook_owners_alone():
    """The simulated sharded step's copy and the OOM's unsharded twin: torch's composable ``checkpoint`` on
    each layer stays the user's (the copy's ``fully_shard`` is recorded on the copy only, so estimating
    twice, or sharding the model afterwards, works; the twin keeps ``checkpoint`` and drops only FSDP2),
    and a hook bound to another object calls that object, not a copy of it."""
    import importlib

    from torch.distributed._composable import checkpoint
    from torch.distributed.fsdp import fully_shard

    from lightning_memkit._diagnosis.oom import simulable
    from lightning_memkit._sharding.fsdp2 import fake_mesh

    registry = importlib.import_module("torch.distributed._composable.contract").REGISTRY_KEY
    module, batch = ShardedLlama(2), zoo_batch("qwen2", BATCH, SEQ)
    for layer in module.model.model.layers:
        checkpoint(layer)
    owner = _HookOwner()
    module.model.model.norm.register_forward_hook(owner.hook)
    options = dict(device="cpu", strategy="fsdp2", world_size=2, first_step=True)
    expected = estimate_memory(module, batch, **options)
    assert estimate_memory(module, batch, **options) == expected  # estimated again: nothing left behind
    assert owner.calls == 2  # the same object called, by each estimate's copy
    assert list(vars(module.model.model.layers[0])[registry]) == ["checkpoint"]
    with fake_mesh(2) as mesh:
        for layer in module.model.model.layers:
            fully_shard(layer, mesh=mesh)  # the user's own sharding still applies
        fully_shard(module, mesh=mesh)
    twin, _ = simulable(module, None)
    assert list(vars(twin.model.model.layers[0])[registry]) == ["checkpoint"]
    assert twin.model.model.norm._forward_hooks and owner.big.untyped_storage() is not None
    assert estimate_memory(twin, batch, **options) == expected
    assert owner.calls == 3


def test_fsdp2_options_without_the_strategy_are_refused():
    """``world_size`` means something under FSDP2 only: without ``strategy="fsdp2"`` it is refused, not
    ignored; ``reshard_after_forward`` and ``mp_policy`` are `Sharding`'s fields, no keywords of their own;
    a policy that is not one is refused by type."""
    module, batch = ShardedLlama(2), zoo_batch("qwen2", BATCH, SEQ)
    with pytest.raises(ValueError, match=r"world_size is FSDP2's .*pass strategy='fsdp2'"):
        estimate_memory(module, batch, device="cpu", world_size=2)
    for options in ({"reshard_after_forward": False}, {"mp_policy": BF16_POLICY}):
        with pytest.raises(TypeError, match=f"unexpected keyword argument '{next(iter(options))}'"):
            estimate_memory(module, batch, device="cpu", **options)
    with pytest.raises(TypeError, match="mp_policy must be FSDP2's MixedPrecisionPolicy"):
        estimate_memory(module, batch, device="cpu", sharding=Sharding(2, mp_policy="bf16"))
