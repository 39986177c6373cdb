"""Selective checkpointing on blocks that change a kept output in place (timm's EfficientNet: a convolution
then ``ReLU(inplace=True)``): torch refuses such a plan in backward ("Tensor cached during selective
activation checkpoint has been mutated"). The planners give those blocks another mode, with the reason,
and never crash."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from helpers import cpu_trainer
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_memkit import (
    ActivationCheckpointing,
    advise,
    apply_checkpointing,
    estimate_memory,
    plan_checkpointing,
    plan_fit,
)


class InPlaceBlock(nn.Module):
    """A residual conv block whose second convolution's output is changed in place, as timm's
    squeeze-excite reduce conv (no norm between the conv and its in-place activation)."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(c)
        self.act = nn.SiLU(inplace=True)
        self.conv2 = nn.Conv2d(c, c, 1, bias=False)
        self.act2 = nn.ReLU(inplace=True)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x):
        return x + self.bn2(self.act2(self.conv2(self.act(self.bn(self.conv(x))))))


class InPlaceNet(nn.Module):
    def __init__(self, c: int = 16, n: int = 4) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.blocks = nn.ModuleList(InPlaceBlock(c) for _ in range(n))
        self.head = nn.Linear(c, 10)

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean((2, 3)))


def _loss(out, target):
    return F.cross_entropy(out, target)


@pytest.fixture
def net_and_batch():
    torch.manual_seed(0)
    return InPlaceNet(), (torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,)))


def _estimate(model, batch, mode):
    return estimate_memory(model, batch, loss_fn=_loss, optimizer="adamw", device="cpu", checkpointing=mode)


def test_torch_refuses_selective_on_this_block(net_and_batch):
    """The premise: applied by hand, selective checkpointing fails in backward, on the real model."""
    model, (x, y) = net_and_batch
    with apply_checkpointing(model, "selective"), pytest.raises(RuntimeError, match="has been mutated"):
        F.cross_entropy(model(x), y).backward()


def test_the_planner_gives_the_block_another_mode_and_says_why(net_and_batch):
    model, batch = net_and_batch
    none, full = _estimate(model, batch, "none").peak, _estimate(model, batch, "full").peak
    plan = plan_checkpointing(
        model, batch, budget=(none + full) // 2, loss_fn=_loss, optimizer="adamw", device="cpu"
    )
    assert plan.peak <= plan.budget
    assert "selective" not in plan.modes.values()
    noted = [b for b in plan.blocks if b.note]
    assert noted and all(b.mode in ("selective_half", "full") for b in noted)
    assert all(b.note.startswith("selective refused: an in-place op") for b in noted)
    assert "selective refused" in str(plan)
    # the plan runs for real, and its simulated peak is the estimate with it applied
    with apply_checkpointing(model, plan):
        F.cross_entropy(model(batch[0]), batch[1]).backward()
        assert _estimate(model, batch, "none").peak == plan.peak


def test_selective_without_a_budget_is_the_next_mode_on_those_blocks(net_and_batch):
    model, batch = net_and_batch
    kwargs = {"loss_fn": _loss, "optimizer": "adamw", "device": "cpu"}
    plan = plan_checkpointing(model, batch, checkpointing="selective", **kwargs)
    assert set(plan.modes.values()) == {"full"}  # selective's next mode, where it is refused
    assert all(b.note == plan.blocks[0].note != "" for b in plan.blocks)


@pytest.mark.slow
def test_autofit_and_advise_plan_around_it(net_and_batch):
    model, batch = net_and_batch
    none, full = _estimate(model, batch, "none").peak, _estimate(model, batch, "full").peak
    fit = plan_fit(
        model, batch, budget=int((none + full) / 2 / 0.9), loss_fn=_loss, device="cpu", optimizers=["adamw"]
    )
    assert fit.estimated_peak <= fit.limit
    assert fit.checkpoint_plan is None or "selective" not in fit.checkpoint_plan.modes.values()
    advice = advise(model, batch, loss_fn=_loss, optimizer="adamw", device="cpu")
    assert advice.findings  # it ran, and priced its fixes


def test_activation_checkpointing_in_a_trainer_trains(tmp_path, net_and_batch):
    model, (x, y) = net_and_batch

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = model

        def training_step(self, batch, _):
            return _loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    data = DataLoader(TensorDataset(x.repeat(2, 1, 1, 1), y.repeat(2)), batch_size=4)
    none, full = _estimate(model, (x, y), "none").peak, _estimate(model, (x, y), "full").peak
    callback = ActivationCheckpointing(budget=(none + full) // 2)
    trainer = cpu_trainer(tmp_path, [callback], max_steps=2, logger=False)
    trainer.fit(Module(), data)
    assert trainer.global_step == 2
    assert "selective" not in callback.plan.modes.values()
