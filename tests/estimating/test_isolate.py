"""Planning work leaves no trace: `_estimating.isolate.isolated` (issue 12, item 4)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torchmetrics
from torch import nn

from lightning_memkit._estimating.isolate import isolated


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 1))
        self.metric = torchmetrics.MeanMetric()
        self.outputs: list[float] = []

    def step(self, x: torch.Tensor) -> torch.Tensor:
        loss = self.body(x).pow(2).mean()
        self.metric.update(loss.detach())
        self.outputs.append(loss.item())
        random.random(), np.random.rand()
        return loss


def state_of(net: Net) -> dict:
    return {
        "buffers": {k: v.clone() for k, v in net.named_buffers()},
        "grads": [None if p.grad is None else p.grad.clone() for p in net.parameters()],
        "metric": (net.metric.mean_value.clone(), net.metric.weight.clone(), net.metric._update_count),
        "outputs": list(net.outputs),
        "training": [m.training for m in net.modules()],
        "rng": (torch.random.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()),
    }


def assert_same(a: dict, b: dict) -> None:
    for key in a["buffers"]:
        assert torch.equal(a["buffers"][key], b["buffers"][key]), key
    for x, y in zip(a["grads"], b["grads"], strict=True):
        assert (x is None and y is None) or torch.equal(x, y)
    assert all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
        for x, y in zip(a["metric"], b["metric"], strict=True)
    )
    assert a["outputs"] == b["outputs"] and a["training"] == b["training"]
    assert torch.equal(a["rng"][0], b["rng"][0]) and a["rng"][1] == b["rng"][1]
    assert (a["rng"][2] == b["rng"][2]).all()


@pytest.mark.parametrize("grads", [False, True])
def test_a_step_run_isolated_leaves_module_state_and_rng_as_they_were(grads):
    torch.manual_seed(0)
    net, x = Net(), torch.randn(16, 4)
    if grads:  # a re-plan mid-run: last step's gradients must come back unchanged
        net.step(x).backward()
    before = state_of(net)
    with isolated(net):
        net.eval()
        net.train()
        net.step(x).backward()
        net.step(x).backward()
    assert_same(before, state_of(net))
    assert net.body[1].num_batches_tracked.item() == (1 if grads else 0)


def test_without_isolation_the_same_step_does_change_them():
    """The check above can fail: the step does touch everything it restores."""
    torch.manual_seed(0)
    net, x = Net(), torch.randn(16, 4)
    before = state_of(net)
    net.step(x).backward()
    after = state_of(net)
    with pytest.raises(AssertionError):
        assert_same(before, after)


def test_compiled_code_called_while_planning_still_compiles_afterwards():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    fn = torch.compile(lambda t: torch.sin(t) * 2, backend="eager")
    with isolated(nn.Linear(1, 1)), torch._subclasses.fake_tensor.FakeTensorMode():
        fn(torch.empty(3))  # under a dispatch mode: dynamo would mark the frame to skip
    fn(torch.ones(3))
    assert counters["frames"]["ok"] == 1


def test_a_parameter_changed_in_place_is_reported():
    net = nn.Linear(2, 2)
    warned = pytest.warns(UserWarning, match=r"changed 1 parameter\(s\) in place \(weight\)")
    with warned, isolated(net, "AutoFit"), torch.no_grad():
        net.weight.add_(1)
