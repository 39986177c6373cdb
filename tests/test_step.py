"""`Step`: the training step as configured, the one value the estimators, planners and callbacks pass."""

from __future__ import annotations

import pytest
import torch

from lightning_memkit import estimate_memory
from lightning_memkit._estimating.simulate import estimate_step
from lightning_memkit._step import LEVERS, Sharding, Step
from lightning_memkit.demos.gpt import GPTLightningModule


def test_the_keywords_make_one_step_and_back() -> None:
    """`estimate_memory`'s keywords and `Step.keywords` describe the same step, both ways."""
    step = Step.of(precision="bf16-mixed", checkpointing="full", accumulating=True, lever="release_gradients")
    assert step == Step("bf16-mixed", "full", accumulating=True, lever="release_gradients")
    assert Step.of(**step.keywords()) == step
    sharded = Step.of(sharding=Sharding(4, reshard_after_forward=False))
    assert sharded.sharding == Sharding(4, reshard_after_forward=False)
    assert Step.of(**sharded.keywords()) == sharded
    assert sharded.keywords() == {"precision": "32-true", "sharding": sharded.sharding}
    # Only what differs from the defaults, FSDP2's own layout in the short form `advise` takes too.
    assert Step.of().keywords() == {"precision": "32-true"}
    assert Step.of(strategy="fsdp2", world_size=2).keywords() == {
        "precision": "32-true",
        "strategy": "fsdp2",
        "world_size": 2,
    }


@pytest.mark.parametrize(
    ("keywords", "error", "match"),
    [
        ({"lever": "fused"}, ValueError, "Unknown lever 'fused'.*Did you mean 'fused_step'"),
        ({"fused_step": True}, TypeError, "unexpected keyword argument 'fused_step'"),
        ({"lever": "fused_step", "accumulating": True}, ValueError, "cannot accumulate gradients"),
        ({"lever": "offload", "strategy": "fsdp2"}, NotImplementedError, "CPUOffloadPolicy"),
        ({"world_size": 2}, ValueError, "world_size is FSDP2's .* pass strategy='fsdp2'"),
        ({"strategy": "fsdp"}, ValueError, "Unknown strategy 'fsdp'; valid: fsdp2"),
        ({"strategy": "fsdp2", "world_size": 0}, ValueError, "world_size must be a whole number of ranks"),
        ({"strategy": "fsdp2", "mp_policy": None}, TypeError, "unexpected keyword argument 'mp_policy'"),
        ({"precision": "bf16"}, ValueError, "Unknown precision 'bf16'.*Did you mean 'bf16-true'"),
        ({"checkpointing": "fulll"}, ValueError, "Unknown checkpointing 'fulll'"),
    ],
)
def test_a_step_that_cannot_run_is_refused_once_with_the_reason(keywords, error, match) -> None:
    with pytest.raises(error, match=match):
        Step.of(**keywords)


def test_a_changed_step_is_checked_again() -> None:
    step = Step.of(lever="fused_step")
    assert step.fused_step and not step.release_gradients and not step.offload
    with pytest.raises(ValueError, match="cannot accumulate gradients"):
        step.but(accumulating=True)
    with pytest.raises(ValueError, match="Unknown lever 'fused'"):
        step.but(lever="fused")
    assert {Step(lever=lever).lever for lever in LEVERS} == set(LEVERS)


def test_split_takes_a_step_or_its_keywords_not_both() -> None:
    step, rest = Step.split({"precision": "bf16-true", "optimizer": "sgd", "device": "cpu"})
    assert step == Step("bf16-true") and rest == {"optimizer": "sgd", "device": "cpu"}
    given = Step(accumulating=True)
    assert Step.split({"step": given, "optimizer": "sgd"}) == (given, {"optimizer": "sgd"})
    with pytest.raises(TypeError, match="give step= or precision, not both"):
        Step.split({"step": given, "precision": "bf16-true"})


def test_estimate_memory_is_the_step_it_describes() -> None:
    """The public keywords and the internal `Step` simulate the same step, byte for byte."""
    model = GPTLightningModule("tiny")
    x = torch.randint(0, 100, (2, 16))
    keywords = {"precision": "bf16-mixed", "checkpointing": "selective", "lever": "release_gradients"}
    by_keywords = estimate_memory(model, (x, x), device="cpu", **keywords)
    by_step = estimate_step(model, (x, x), Step.of(**keywords), device="cpu")
    assert by_keywords == by_step
    assert by_step != estimate_step(model, (x, x), Step.of(precision="bf16-mixed"), device="cpu")
