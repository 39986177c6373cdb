"""OptimizerSwap at its edges: a reused callback decides afresh, a budget nothing fits fails at fit start with
its figures, resuming needs the callback and restores the stored choice whatever it is configured with,
optimizers whose step needs a closure are refused up front."""

from __future__ import annotations

import functools
import re

import lightning.pytorch as pl
import pytest
import torch
from helpers import cpu_trainer
from models import MLPModule
from torch.utils.data import DataLoader, TensorDataset, default_collate

from lightning_memkit import OptimizerSwap, estimate_memory, fit_optimizer, format_bytes, parse_budget

N, BATCH = 32, 8  # samples, batch size: 4 batches per epoch


class Net(MLPModule):
    """`MLPModule` ``width`` wide on ``N`` rows in batches of ``BATCH``; records every real training batch and
    what ran, in order."""

    def __init__(self, width: int = 8, optimizer: str = "adamw", shuffle: bool = False) -> None:
        super().__init__(width, width, samples=N, batch_size=BATCH, optimizer=optimizer, shuffle=shuffle)
        self.width = width
        self.events: list[str] = []
        self.batches: list[torch.Tensor] = []

    def on_train_batch_start(self, batch, batch_idx):  # not in training_step: the estimate runs that
        self.events.append("train_batch")
        self.batches.append(batch[0].clone())

    def on_before_optimizer_step(self, optimizer):
        self.events.append("optimizer_step")


class ValidatedNet(Net):
    """With a validation loop, so the sanity check would run two real forwards before training."""

    def validation_step(self, batch, batch_idx):
        self.events.append("validation_step")

    def val_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(N, self.width)), batch_size=BATCH)


def _trainer(tmp_path, *callbacks, **kwargs) -> pl.Trainer:
    return cpu_trainer(
        tmp_path, callbacks, **{"max_steps": 2, "logger": False, "limit_val_batches": None, **kwargs}
    )


@functools.cache
def _peak(width: int, optimizer: str) -> int:
    """``Net(width)``'s estimated step peak with ``optimizer`` (one estimate per test process)."""
    batch = torch.zeros(BATCH, width), torch.zeros(BATCH, 1)
    return estimate_memory(Net(width), batch, optimizer=optimizer, device="cpu").peak


def _between(width: int, fits: str, over: str) -> int:
    """A budget for ``Net(width)`` that ``fits`` fits and ``over`` does not."""
    low, high = _peak(width, fits), _peak(width, over)
    assert low < high
    return (low + high) // 2


# --------------------------------------------------------------------------------------------------
# Item 8: each fit decides afresh
# --------------------------------------------------------------------------------------------------


def test_a_reused_callback_decides_afresh_for_each_fit(tmp_path):
    """Small (AdamW fits), big (it does not: SGD), small again (AdamW again), with one callback."""
    budget = _between(64, "sgd", "adamw")
    assert _peak(8, "adamw") < budget
    swap = OptimizerSwap(budget, optimizers=("sgd",))
    for width, kind in [(8, torch.optim.AdamW), (64, torch.optim.SGD), (8, torch.optim.AdamW)]:
        trainer = _trainer(tmp_path, swap)
        trainer.fit(Net(width))
        assert type(trainer.optimizers[0]) is kind
        assert swap.choice.optimizers[0] is trainer.optimizers[0]
        assert swap.state_dict()["swapped"] is (kind is torch.optim.SGD)


# --------------------------------------------------------------------------------------------------
# Item 10: a budget nothing fits fails at fit start, with the figures
# --------------------------------------------------------------------------------------------------


def test_a_budget_nothing_fits_fails_before_any_forward_with_the_figures(tmp_path):
    model = ValidatedNet(width=64)
    floor = 2 * 4 * sum(p.numel() for p in model.parameters())  # parameters + gradients, fp32
    kb = (floor + _peak(64, "sgd")) // 2 // 1000  # over the static floor, under the step: activations
    assert floor < kb * 1000 < _peak(64, "sgd")
    trainer = _trainer(tmp_path, OptimizerSwap(f"{kb}KB", optimizers=("adafactor", "sgd")))
    with pytest.raises(ValueError, match=re.escape(f"budget of {kb}KB ({format_bytes(kb * 1000)})")) as err:
        trainer.fit(model)
    assert model.events == []  # no sanity check, no training batch, no optimizer step
    message = str(err.value)
    tried = re.search(r"Tried \(estimated step peak, each over the budget\): (.*?)\. ", message)
    assert tried is not None
    assert [entry.split()[0] for entry in tried.group(1).split(", ")] == ["original", "adafactor", "sgd"]
    for hint in ("raise the budget to at least", "ActivationCheckpointing", "smaller micro-batch"):
        assert hint in message


def test_a_decimal_budget_is_shown_in_mib_too():
    model = Net(width=64)
    optimizer = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match=r"budget of 0\.01MB \(9\.77 KiB\).*parameters and gradients alone"):
        fit_optimizer(model, optimizer, "0.01MB", optimizers=("sgd",), device="cpu")


def test_the_early_decision_leaves_data_order_and_rng_alone(tmp_path):
    """The first batch is taken from a shuffling loader at fit start: the epoch still sees the same
    batches, and the global RNG ends where it ends without the callback."""

    def run(*callbacks):
        torch.manual_seed(0)
        model = Net(width=64, shuffle=True)
        _trainer(tmp_path, *callbacks, max_steps=4).fit(model)
        return torch.stack(model.batches), torch.rand(1)

    alone = run()
    budget = _between(64, "sgd", "adamw")
    for swap in (OptimizerSwap("1GiB"), OptimizerSwap(budget, optimizers=("sgd",))):
        batches, after = run(swap)
        torch.testing.assert_close(batches, alone[0], rtol=0, atol=0)
        assert after == alone[1]


class LateData(Net):
    """Its first ``train_dataloader()``, the one OptimizerSwap takes a batch from at fit start, is empty."""

    loaders = 0

    def train_dataloader(self):
        self.loaders += 1
        return (
            super().train_dataloader() if self.loaders > 1 else DataLoader(TensorDataset(torch.zeros(0, 1)))
        )


def test_no_batch_at_fit_start_decides_at_the_first_batch(tmp_path):
    model = LateData(width=64)
    trainer = _trainer(tmp_path, OptimizerSwap(_between(64, "sgd", "adamw"), optimizers=("sgd",)))
    trainer.fit(model)
    assert model.loaders == 2  # the empty one at fit start, the fit loop's
    assert type(trainer.optimizers[0]) is torch.optim.SGD


def test_a_none_first_batch_is_skipped_as_the_fit_loop_skips_it(tmp_path):
    """A loader whose first batch is ``None``: the decision at fit start takes the next one."""

    class NoneFirst(Net):
        def train_dataloader(self):
            loader = super().train_dataloader()
            first = iter([True])
            loader.collate_fn = lambda items: None if next(first, False) else default_collate(items)
            return loader

    model = NoneFirst(width=64)
    swap = OptimizerSwap(_between(64, "sgd", "adamw"), optimizers=("sgd",))
    with pytest.warns(UserWarning, match="train_dataloader yielded None"):
        _trainer(tmp_path, swap).fit(model)
    assert swap.choice.name == "sgd" and swap.choice.method == "simulated"


@pytest.mark.parametrize("name", ["H200", "A100-40GB"])
def test_a_gpu_name_is_a_budget(tmp_path, name):
    swap = OptimizerSwap(name)
    assert swap.budget == parse_budget(name).usable
    trainer = _trainer(tmp_path, swap)
    trainer.fit(Net())
    assert not swap.choice.changed and swap.choice.budget == parse_budget(name).usable


# --------------------------------------------------------------------------------------------------
# Item 15: resuming restores the stored choice; without the callback, Lightning names it
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def swapped_checkpoint(tmp_path_factory) -> tuple[str, dict]:
    """A checkpoint of ``Net(64)`` after two steps with AdamW swapped to SGD with momentum, and the
    optimizer's state in it."""
    tmp_path = tmp_path_factory.mktemp("swapped")
    swap = OptimizerSwap(_between(64, "sgd_momentum", "adamw"), optimizers=("sgd_momentum",))
    trainer = _trainer(tmp_path, swap)
    trainer.fit(Net(width=64))
    path = str(tmp_path / "swapped.ckpt")
    trainer.save_checkpoint(path)
    return path, trainer.optimizers[0].state_dict()


def test_resume_with_a_differently_configured_callback_restores_the_stored_choice(
    tmp_path, swapped_checkpoint
):
    path, saved = swapped_checkpoint
    loaded = {}

    class Inspect(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            loaded["type"] = type(trainer.optimizers[0])
            loaded["momentum"] = trainer.optimizers[0].param_groups[0]["momentum"]
            loaded["state"] = {
                k: v["momentum_buffer"].clone()
                for k, v in trainer.optimizers[0].state_dict()["state"].items()
            }

    # Another budget (AdamW fits it), other candidates and allow_unknown, and a fit of its own before
    # (AdamW kept): the checkpoint's choice holds.
    swap = OptimizerSwap("1GiB", optimizers=("adafactor",), allow_unknown=True)
    _trainer(tmp_path, swap).fit(Net(width=64))
    assert swap.state_dict()["swapped"] is False
    trainer = _trainer(tmp_path, swap, Inspect(), max_steps=3)
    trainer.fit(Net(width=64), ckpt_path=path)
    assert loaded["type"] is torch.optim.SGD and loaded["momentum"] == 0.9
    for k, v in saved["state"].items():
        torch.testing.assert_close(loaded["state"][k], v["momentum_buffer"], rtol=0, atol=0)
    assert trainer.global_step == 3 and swap.state_dict()["optimizer"] == "sgd_momentum"


def test_resume_without_the_callback_is_named_by_lightning(tmp_path, swapped_checkpoint):
    path, _ = swapped_checkpoint  # SGD's momentum buffers, which AdamW's step() cannot read
    trainer = _trainer(tmp_path, max_steps=3)
    with (
        pytest.warns(UserWarning, match=r"Please add the following callbacks: \['OptimizerSwap'\]"),
        pytest.raises(KeyError, match="step"),  # AdamW's step() reads its counter first
    ):
        trainer.fit(Net(width=64), ckpt_path=path)


# --------------------------------------------------------------------------------------------------
# Item 12: an optimizer whose step needs a closure
# --------------------------------------------------------------------------------------------------


def test_lbfgs_with_allow_unknown_is_refused_up_front(tmp_path):
    model = ValidatedNet(optimizer="lbfgs")
    trainer = _trainer(tmp_path, OptimizerSwap(1, allow_unknown=True))
    with pytest.raises(
        ValueError, match=r"LBFGS cannot be swapped for a lighter optimizer: its step\(\) needs a closure"
    ):
        trainer.fit(model)
    assert model.events == []
    lbfgs = torch.optim.LBFGS(model.parameters())
    with pytest.raises(ValueError, match="LBFGS cannot be swapped"):
        fit_optimizer(model, lbfgs, "1GiB", device="cpu", allow_unknown=True)


def test_lbfgs_without_allow_unknown_trains_unchanged(tmp_path):
    model = Net(optimizer="lbfgs")
    trainer = _trainer(tmp_path, OptimizerSwap(1))
    with pytest.warns(UserWarning, match=r"LBFGS is not in the optimizer catalogue.*needs a closure"):
        trainer.fit(model)
    assert type(trainer.optimizers[0]) is torch.optim.LBFGS and trainer.global_step == 2
