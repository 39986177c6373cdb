"""One word per idea. `plan_fit` in the step's own words: `world_size` for the ranks (as `estimate_memory`
and Lightning say it), a `Step` in place of the keywords it holds, the lever as `Step` names it, FSDP2's
`mp_policy`; nothing was released, so no other spelling runs. A budget is one thing to every callback: the
same forms, read once."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from torch import nn

from lightning_memkit import ActivationCheckpointing, Budget, FitPlan, MemoryMonitor, OptimizerSwap, plan_fit
from lightning_memkit._budget import parse_budget
from lightning_memkit._step import Sharding, Step

BUDGET = 4_000_000


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))


def _plan(**kwargs) -> FitPlan:
    batch = (torch.randn(4, 32), torch.randn(4, 32))
    options = dict(device="cpu", cost="flops", optimizers=["adamw"], loss_fn=nn.functional.mse_loss)
    return plan_fit(_model(), batch, BUDGET, **(options | kwargs))


def test_world_size_names_the_ranks() -> None:
    plan = _plan(strategy="ddp", world_size=2)
    assert plan.world_size == 2 and plan.micro_batch_size * plan.accumulate_grad_batches == 2


def test_a_step_stands_for_its_keywords() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new spelling warns of nothing
        by_step = _plan(step=Step(precision="bf16-mixed", lever="release_gradients"))
    assert by_step == _plan(precision="bf16-mixed", lever="release_gradients")
    assert (by_step.lever, by_step.lever_callback) == ("release_gradients", "GradientRelease")
    # a keyword the step stands for beside it is refused, as estimate_memory refuses it (Step.split)
    with pytest.raises(TypeError, match=r"give step= or precision, lever, not both"):
        _plan(step=Step(), precision="bf16-mixed", lever="fused_step")
    with pytest.raises(
        TypeError, match=r"give step= or strategy, world_size, not both"
    ):  # never planned as something else
        _plan(step=Step(sharding=Sharding(world_size=2)), strategy="ddp", world_size=2)
    assert _plan(step=Step(lever="offload"), strategy="ddp").lever == "offload"  # DDP is no step's
    with pytest.raises(ValueError, match="plan_fit chooses the step's checkpointing, accumulating itself"):
        _plan(step=Step(checkpointing="full", accumulating=True))
    with pytest.raises(TypeError, match="step= must be a Step; got 'bf16-mixed'"):
        _plan(step="bf16-mixed")


def test_a_plan_is_saved_in_the_same_words() -> None:
    plan = _plan(lever="release_gradients", strategy="ddp", world_size=2)
    saved = plan.as_dict()
    assert (saved["lever"], saved["world_size"]) == ("release_gradients", 2)
    assert FitPlan.from_dict(saved) == plan
    assert "with GradientRelease" in plan.summary()


def test_a_sharded_step_and_mp_policy_are_fsdp2s_words_in_the_planner_too() -> None:
    step = Step(precision="bf16-mixed", sharding=Sharding(world_size=2))
    plan = _plan(step=step, mp_policy=True, checkpointing="none")
    assert (plan.strategy, plan.world_size, plan.precision) == ("fsdp2", 2, "bf16-mixed")
    assert plan.mp_policy and "gathered in bf16 (MixedPrecisionPolicy)" in plan.summary()
    assert FitPlan.from_dict(plan.as_dict()) == plan
    # a Sharding alone says the strategy and the ranks, as estimate_memory reads it; a disagreement is refused
    alone = _plan(sharding=Sharding(2), precision="bf16-mixed", mp_policy=True, checkpointing="none")
    assert alone == plan
    with pytest.raises(ValueError, match="sharding= is the layout of strategy='fsdp2' over world_size ranks"):
        _plan(sharding=Sharding(2), strategy="ddp", world_size=2)


@pytest.mark.parametrize("callback", [MemoryMonitor, ActivationCheckpointing, OptimizerSwap])
def test_every_callback_reads_a_budget_the_same_way(callback) -> None:
    """Bytes, a size, a GPU name and a `Budget` are read at construction, to the bytes `parse_budget`
    gives; ``"auto"`` and a fraction wait for the run's device; a bad one fails at once."""
    card = Budget.for_device(24 * 2**30, "mine")
    expected = {6_000_000: 6_000_000, "6GiB": 6 * 2**30, "A100-40GB": parse_budget("A100-40GB").usable}
    for given, usable in (expected | {card: card.usable}).items():
        assert callback(budget=given).budget == usable
    assert callback(budget="auto").budget is None and callback(budget=0.9).budget is None
    with pytest.raises(ValueError, match="Unknown GPU or size 'A100-41GB'"):
        callback(budget="A100-41GB")
    with pytest.raises(ValueError, match="A float budget is a fraction"):
        callback(budget=1.5)


def test_a_layouts_own_policy_and_an_unknown_lever_are_refused() -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    fp16 = Sharding(world_size=2, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16))
    with pytest.raises(ValueError, match="plan_fit plans FSDP2's bf16 MixedPrecisionPolicy itself"):
        _plan(step=Step(precision="16-mixed", sharding=fp16))
    with pytest.raises(TypeError, match="mp_policy must be True or False"):
        _plan(strategy="fsdp2", world_size=2, mp_policy=fp16.mp_policy)
    plan = _plan()
    with pytest.raises(ValueError, match="Unknown lever 'GradientRelease'"):  # a callback, no lever
        dataclasses.replace(plan, lever="GradientRelease")
    with pytest.raises(ValueError, match=r"Unknown lever 'fused'; valid: .* Did you mean 'fused_step'"):
        _plan(lever="fused")  # one keyword, Step's words
    with pytest.raises(TypeError, match="unexpected keyword argument 'fused_step'"):
        _plan(fused_step=True)


def test_estimate_memory_takes_fsdp2s_layout_as_one_sharding() -> None:
    """The layout's five options are `Sharding`'s fields, not five more keywords of `estimate_memory`: a
    field given as a keyword of its own is an unknown keyword; a world size that disagrees, a strategy that
    is not FSDP2 or a value that is not a Sharding are refused."""
    from lightning_memkit import estimate_memory

    model, batch = _model(), (torch.randn(4, 32), torch.randn(4, 32))
    options = dict(optimizer="adamw", loss_fn=nn.functional.mse_loss, device="cpu")
    layout = Sharding(2, reshard_after_forward=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        new = estimate_memory(model, batch, sharding=layout, **options)
        assert (
            estimate_memory(model, batch, strategy="fsdp2", world_size=2, sharding=layout, **options) == new
        )
    assert new.parameters > estimate_memory(model, batch, sharding=Sharding(4), **options).parameters
    for old in ("reshard_after_forward", "return_timeline"):
        with pytest.raises(TypeError, match=f"unexpected keyword argument '{old}'"):
            estimate_memory(model, batch, strategy="fsdp2", world_size=2, **{old: False}, **options)
    with pytest.raises(TypeError, match="give sharding= or world_size, not both"):
        estimate_memory(model, batch, sharding=layout, strategy="fsdp2", world_size=4, **options)
    with pytest.raises(TypeError, match="give step= or strategy, world_size, not both"):
        estimate_memory(model, batch, step=Step(), strategy="fsdp2", world_size=2, **options)
    with pytest.raises(ValueError, match="sharding= is FSDP2's layout"):
        estimate_memory(model, batch, sharding=layout, strategy="ddp", **options)
    with pytest.raises(TypeError, match="sharding= must be a Sharding; got 2"):
        estimate_memory(model, batch, sharding=2, **options)
