"""Issue 49 item 4: a run whose own set-up fits is planned with one simulated step, not four set-ups.

AutoFit passes ``plan_fit`` the micro-batch the run is set up with; where that step fits without
checkpointing it is the plan, so nothing else is simulated (counted here, not timed: the seconds move with
the machine's load), and no real step is timed (``cost="auto"`` on a CPU times steps to rank plans, and
there is nothing to rank)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import cpu_trainer
from models import MLPModule

import lightning_memkit._fitting.search as search
import lightning_memkit._fitting.simulations as simulated
from lightning_memkit import plan_fit
from lightning_memkit.callbacks.auto_fit import AutoFit


@pytest.fixture
def simulations(monkeypatch) -> list[tuple]:
    """Each simulated step the planner runs (micro-batch, in samples) and each real step it times."""
    seen: list[tuple] = []
    for name in ("estimate_step", "counted_step", "measured_cost"):
        real = getattr(simulated, name)

        def counting(model, batch, *args, _real=real, _name=name, **kwargs):
            seen.append((_name, len(batch[0])))
            return _real(model, batch, *args, **kwargs)

        monkeypatch.setattr(simulated, name, counting)
    return seen


def _module() -> MLPModule:
    torch.manual_seed(0)
    return MLPModule(batch_size=4, samples=64)


def _batch(n: int) -> tuple:
    return torch.randn(n, 16), torch.randn(n, 1)


def test_a_set_up_that_fits_is_planned_with_one_simulated_step(simulations):
    plan = plan_fit(_module(), _batch(8), "100TB", device="cpu", micro_batch_size=4)
    assert (plan.micro_batch_size, plan.accumulate_grad_batches, plan.checkpointing) == (4, 2, "none")
    assert simulations == [("counted_step", 4)]  # no other micro-batch, no timed step
    assert "kept as set up: it fits" in plan.note
    assert plan.cost.source == "flops"  # from the one step's FLOPs
    [row] = plan.alternatives
    assert (row.micro_batch_size, row.peak, row.fits) == (4, plan.estimated_peak, True)


def test_a_set_up_over_the_budget_is_searched_as_before(simulations):
    whole = plan_fit(_module(), _batch(8), "100TB", device="cpu", cost="flops", micro_batch_size=8)
    assert whole.micro_batch_size == 8 and len(simulations) == 1
    simulations.clear()
    limit = whole.estimated_peak - 1  # micro-batch 8 no longer fits; a smaller one does
    plan = plan_fit(_module(), _batch(8), limit, margin=0.0, device="cpu", cost="flops", micro_batch_size=8)
    assert plan.micro_batch_size < 8 and plan.estimated_peak <= limit
    assert len(simulations) > 1 and "kept as set up" not in plan.note


def test_autofit_over_a_set_up_that_fits_simulates_one_step(tmp_path, simulations):
    module = _module()
    autofit = AutoFit(budget="100TB")  # cost "auto": timed steps on a CPU, were there plans to rank
    cpu_trainer(tmp_path, [autofit], max_steps=2, logger=False, accumulate_grad_batches=2).fit(module)
    assert (autofit.plan.micro_batch_size, autofit.plan.accumulate_grad_batches) == (4, 2)
    assert simulations == [("counted_step", 4)]


def test_on_equal_time_the_plan_without_checkpointing_wins():
    """Issue 49 item 8: under AutoFitStrategy on a CPU the time column showed none and full checkpointing
    at the same time (a timed recompute within the noise reads 0) and the tie went to full, first by name."""
    from lightning_memkit._checkpointing.policies import CheckpointPlan

    def option(label: str, overhead: float | None) -> search._Option:
        plan = None if label == "none" else CheckpointPlan.uniform(["blocks.0", "blocks.1"], label)
        return search._Option(1.0, 8, label, 100, plan and dataclasses.replace(plan, overhead=overhead))

    full, none = option("full", 0.0), option("none", None)  # full's timed recompute within the noise: 0
    assert min([full, none]).label == "full"  # the trap: a NamedTuple's order, the label last
    assert min([full, none], key=search._quickest).label == "none"
    half = option("selective", 0.1)  # where both checkpoint, the lesser recompute
    assert min([option("full", 0.3), half], key=search._quickest) == half
