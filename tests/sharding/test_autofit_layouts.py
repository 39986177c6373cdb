"""The parallel layout planned with the rest (issue 47, item 3): tensor-parallel degree and HSDP split.

Quick tier: the layout search on a fake process group in this one process (`plan_fit(sharding="auto")`,
`_fitting.layouts`), the plan's record of the layout and its code. Slow tier: `AutoFitStrategy` with the
layout left open on 4 gloo ranks, at a budget only tensor parallel 2 x FSDP2 2 fits, each rank against its
all-thread counting allocator (as tests/sharding/test_autofit_strategy.py), the ranks started once per
session.

The model is tests/sharding/test_parallel_layouts.py's tiny LLaMA with 4 key/value heads. Its leanest AdamW
plans (micro-batch 1, full checkpointing, global batch 8 over 4 ranks) peak at about 362 KiB a rank under
FSDP2 4, 486 KiB under HSDP 2 x 2, 344 KiB under TP 4 and 319 KiB under TP 2 x FSDP2 2: at `BUDGET` with a
10 % margin (a 333 KiB limit) only the last fits.
"""

import json
import math
import warnings
from dataclasses import replace
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from helpers import counted_ranks, cpu_trainer, needs_distributed, run_in_turn
from test_parallel_layouts import llama
from zoo import ZooModule, zoo_batch

from lightning_memkit import AutoFitStrategy, parse_bytes, plan_fit
from lightning_memkit._budget import parse_budget
from lightning_memkit._diagnosis.plan_code import plan_code
from lightning_memkit._fitting.layouts import Layouts, candidates, collectives, ordered
from lightning_memkit._fitting.plan import FitPlan
from lightning_memkit._fitting.resume import stale
from lightning_memkit._sharding.fsdp2 import LINKS
from lightning_memkit._step import Sharding
from lightning_memkit.strategies.auto_fit import _layout_sizes, _resolved
from lightning_memkit.testing import AllocatorPeaks

WORLD, BATCH, SEQ, STEPS = 4, 2, 32, 2  # BATCH: the user's batch size a rank; the global batch 8
BUDGET = "370KiB"
#: what the quick tier plans: adamw alone (a lighter optimizer would fit FSDP2 4), the FLOP cost
PLANNED = {
    "strategy": "fsdp2",
    "world_size": WORLD,
    "device": "cpu",
    "cost": "flops",
    "optimizers": ["adamw"],
}


class Llama(ZooModule):
    """The 4-head LLaMA in a LightningModule whose ``configure_model`` shards nothing: AutoFitStrategy
    lays it out."""

    def __init__(self, batch_size: int = BATCH):
        super().__init__("qwen2", batch_size=batch_size, seq_len=SEQ, n_batches=4 * STEPS * WORLD)
        self.model = llama()


class Plain(torch.nn.Module):
    """Repeated blocks with no projection torchtitan's plan names."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
            for _ in range(2)
        )

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def _plan(budget: str, **options) -> FitPlan:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return plan_fit(Llama(), zoo_batch("qwen2", BATCH * WORLD, SEQ), budget, **PLANNED, **options)


# --- quick: the search -------------------------------------------------------------------------------


@pytest.mark.slow
def test_tensor_parallel_is_planned_where_fsdp2_over_every_rank_does_not_fit():
    """At `BUDGET` FSDP2 over the 4 ranks, HSDP 2 x 2 and TP 4 do not fit: the plan is TP 2 x FSDP2 2, the
    global batch kept (4 samples a data-parallel rank), and its note says what did not fit. CPU offload
    where nothing fits without it (AutoFitStrategy's) comes after every layout: FSDP2 4 would fit with it."""
    plan = _plan(BUDGET, sharding="auto", cpu_offload=None)
    assert not plan.cpu_offload
    assert (plan.tensor_parallel_size, plan.replicate_size, plan.data_parallel_size) == (2, 1, 2)
    assert plan.micro_batch_size * plan.accumulate_grad_batches == 4 and plan.global_batch_size == 8
    assert plan.estimated_peak <= plan.limit
    assert "layout TP 2 x FSDP2 2" in plan.note and "does not fit: FSDP2 4" in plan.note, plan.note
    assert "(TP 2 x FSDP2 2)" in plan.summary()


def test_the_least_communication_wins_where_several_fit():
    """A roomy budget fits every layout: the first in the order of least communication is planned (FSDP2
    over every rank, on one machine's link), as the plan without a search plans it."""
    model, batch = Llama(), zoo_batch("qwen2", BATCH * WORLD, SEQ)
    found, skipped = candidates(model, WORLD, Layouts())
    assert not skipped and len(found) == 4
    first = ordered(model, found, "32-true", batch, None, LINKS["cpu"], LINKS["cpu"], None)[0][1]
    plan = _plan("4MiB", sharding="auto")
    assert (plan.tensor_parallel_size, plan.replicate_size) == (
        first.tensor_parallel_size,
        first.replicate_size,
    )
    assert (plan.tensor_parallel_size, plan.replicate_size) == (1, 1)
    assert plan.micro_batch_size == _plan("4MiB").micro_batch_size


def test_the_cost_model():
    """Tensor parallelism's all-reduces grow with the tokens a sample; HSDP's shard group within a node
    ranks before FSDP2 across two nodes' slower link; FSDP2 over every rank is what plan_fit counted
    before (`collective_seconds`)."""
    model = Llama()
    link, slow = LINKS["cuda"], LINKS["cuda"]._replace(bytes_per_s=5e9, latency_s=1e-3)
    tp2 = Sharding(WORLD, tensor_parallel_size=2)
    assert (
        collectives(model, tp2, "32-true", 64, link)[1] == 2 * collectives(model, tp2, "32-true", 32, link)[1]
    )
    assert collectives(model, Sharding(WORLD), "32-true", 32, link)[1] == 0.0
    fsdp2, hsdp = Sharding(WORLD), Sharding(WORLD, replicate_size=2)
    one_node = (
        collectives(model, hsdp, "32-true", 32, link)[0],
        collectives(model, fsdp2, "32-true", 32, link)[0],
    )
    two = {
        s.replicate_size: collectives(model, s, "32-true", 32, link, devices_per_node=2, inter_node=slow)[0]
        for s in (fsdp2, hsdp)
    }
    assert two[2] < two[1] and two[1] > one_node[1]


def test_what_cannot_apply_is_skipped_never_planned_as_another():
    """Blocks without known projections: no tensor-parallel degree; a degree that does not divide the
    attention heads (test_fsdp's LLaMA has 2 key/value heads): skipped with why; HSDP beside a user's
    ``parallelize_fn``: skipped; asked for alone, a layout that cannot apply is refused, not replaced."""
    from test_fsdp import llama as two_heads

    found, skipped = candidates(Plain(), WORLD, Layouts())
    assert {s.tensor_parallel_size for s in found} == {1}
    assert any(s.startswith("TP 2: Plain's blocks have no projections") for s in skipped), skipped
    found, skipped = candidates(two_heads(), WORLD, Layouts())
    assert {s.tensor_parallel_size for s in found} == {1, 2}
    assert any("TP 4: tensor_parallel_size=4 does not divide" in s for s in skipped), skipped
    found, skipped = candidates(Llama(), WORLD, Layouts(parallelize_fn=lambda model, mesh: None))
    assert {s.replicate_size for s in found} == {1} and any("HSDP 2 x 2" in s for s in skipped), skipped
    with pytest.raises(ValueError, match="No layout of 4 ranks fits: skipped: TP 4: tensor_parallel_size=4"):
        plan_fit(two_heads(), zoo_batch("qwen2", 8, SEQ), "1GiB", **PLANNED, sharding=Layouts(4, 1))


# --- quick: the plan's record of it ------------------------------------------------------------------


def _fit_plan(**layout) -> FitPlan:
    plan = FitPlan(1, 4, "full", "adamw", "32-true", 300_000, parse_budget(BUDGET), strategy="fsdp2",
                   world_size=WORLD, device="cpu")  # fmt: skip
    return replace(plan, **layout)


def test_the_plan_keeps_its_layout_and_a_resume_reads_another_as_another_run():
    plan = _fit_plan(tensor_parallel_size=2)
    assert FitPlan.from_dict(json.loads(json.dumps(plan.as_dict()))) == plan
    old = {
        k: v for k, v in _fit_plan().as_dict().items() if k not in ("tensor_parallel_size", "replicate_size")
    }
    assert FitPlan.from_dict(old).layout == "FSDP2 4"  # a plan saved before the layout was planned
    assert ("parallel layout", "FSDP2 4", "TP 2 x FSDP2 2") in stale(_fit_plan(), plan)
    assert ("parallel layout", "TP 2 x FSDP2 2", "HSDP 2 x 2") in stale(plan, _fit_plan(replicate_size=2))
    assert not stale(plan, _fit_plan(tensor_parallel_size=2))


def _configure_model(code: str) -> str:
    """The commented ``configure_model`` of a plan's code, uncommented."""
    lines = code.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("#     def configure_model"))
    body = [line[2:] for line in lines[start:] if line.startswith("#     ")]
    return "\n".join(line[4:] for line in body)


def test_the_plan_code_names_the_layout():
    """The strategy's arguments (AutoFitStrategy's and ModelParallelStrategy's), and a configure_model that
    compiles: tensor parallel with torchtitan's plan in the model's own names, then FSDP2; HSDP's mesh."""
    tp = plan_code(_fit_plan(tensor_parallel_size=2), Llama(), global_batch=8, optimizers=None)
    assert "ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2)" in tp
    assert "tensor_parallel_size=2, data_parallel_size=2)" in tp
    assert '"self_attn.q_proj": ColwiseParallel()' in tp and '"mlp.down_proj": RowwiseParallel()' in tp
    assert 'parallelize_module(layer, self.device_mesh["tensor_parallel"], plan)' in tp
    compile(_configure_model(tp), "configure_model", "exec")
    hsdp = plan_code(_fit_plan(replicate_size=2), Llama(), global_batch=8, optimizers=None)
    assert 'init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))' in hsdp
    assert "data_parallel_size=(2, 2)" in hsdp and "parallelize_module" not in hsdp
    both = plan_code(_fit_plan(tensor_parallel_size=2, replicate_size=2, world_size=8), Llama(),
                     global_batch=8, optimizers=None)  # fmt: skip
    assert '(2, 2, 2), mesh_dim_names=("replicate", "shard", "tensor_parallel"))' in both
    compile(_configure_model(both), "configure_model", "exec")


def test_the_strategy_reads_its_layout_arguments():
    """``"auto"`` plans; numbers give a layout (checked against the world); the default plans nothing new."""
    assert _resolved(*_layout_sizes(1, None), 4, 4) is None
    assert _resolved(*_layout_sizes("auto", None), 4, 4) == Layouts("auto", 1, 4)
    assert _resolved(*_layout_sizes("auto", "auto"), 8, 4) == Layouts("auto", "auto", 4)
    assert _resolved(*_layout_sizes(2, None), 4, 4) == Sharding(4, tensor_parallel_size=2)
    assert _resolved(*_layout_sizes("auto", (2, 2)), 4, 4) == Sharding(4, replicate_size=2)
    assert _resolved(*_layout_sizes("auto", 2), 4, 4) == Sharding(4, tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3, data_parallel_size=None\) does not lay"):
        _resolved(*_layout_sizes(3, None), 4, 4)
    with pytest.raises(ValueError, match="data_parallel_size must be"):
        AutoFitStrategy(budget="1GiB", data_parallel_size="half")
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        AutoFitStrategy(budget="1GiB", tensor_parallel_size=0)


# --- slow: AutoFitStrategy on 4 gloo ranks -----------------------------------------------------------


class _Record(pl.Callback):
    """Each rank's plan, losses, allocator peaks (per batch), the sampler's data-parallel share and the
    parameters' meshes."""

    def __init__(self, out: Path, peaks: AllocatorPeaks) -> None:
        self.out, self.peaks, self.losses = out, peaks, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].item())

    def on_train_end(self, trainer, pl_module):
        from lightning_memkit._sharding.layout import layout_of

        record = {
            "plan": trainer.strategy.plan.as_dict(), "allocator": self.peaks.peaks, "losses": self.losses,
            "sampler": trainer.strategy.distributed_sampler_kwargs, "global_step": trainer.global_step,
            "meshes": sorted({str(shape) for (_, shape, _), _ in layout_of(pl_module)}),
        }  # fmt: skip
        (self.out / f"rank_{trainer.global_rank}.json").write_text(json.dumps(record))


def _fit(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    peaks = AllocatorPeaks(all_threads=True)
    strategy = AutoFitStrategy(budget=BUDGET, optimizers=["adamw"], cost="flops", tensor_parallel_size="auto",
                               data_parallel_size="auto")  # fmt: skip
    torch.manual_seed(0)
    callbacks = [*peaks.around(), _Record(out, peaks)]
    trainer = cpu_trainer(out, callbacks, STEPS, devices=WORLD, logger=False, strategy=strategy)
    trainer.fit(Llama())


def _rank(rank: int, out: Path) -> None:
    run_in_turn(out, rank, WORLD, {"auto": _fit})


@pytest.fixture(scope="module")
def ranks(once) -> Path:
    return counted_ranks(once, "autofit_layouts", _rank, WORLD, "AutoFitStrategy's planned layout")


@pytest.mark.slow
@needs_distributed
@pytest.mark.xdist_group("ddp-ranks")
def test_autofit_strategy_plans_and_runs_tensor_parallel_within_the_budget(ranks):
    """Every rank trains TP 2 x FSDP2 2, as planned (FSDP2 over the 4 ranks does not fit), each tensor-
    parallel pair sharing its batch (2 data-parallel ranks), every step's allocator peak within the budget
    and every loss finite."""
    errors = [p.read_text() for p in sorted((ranks / "auto").glob("error_*.txt"))]
    assert not errors, "\n".join(errors)
    budget = parse_bytes(BUDGET)
    for rank in range(WORLD):
        record = json.loads((ranks / "auto" / f"rank_{rank}.json").read_text())
        plan = FitPlan.from_dict(record["plan"])
        assert record["global_step"] == STEPS and plan.layout == "TP 2 x FSDP2 2", plan.summary()
        assert record["sampler"] == {"num_replicas": 2, "rank": rank // 2}
        assert "[2, 2]" in record["meshes"] or "(2, 2)" in record["meshes"], record["meshes"]
        assert max(record["allocator"]) <= budget, f"rank {rank}: {record['allocator']} B of {budget:,} B"
        assert all(math.isfinite(loss) for loss in record["losses"]), record["losses"]
