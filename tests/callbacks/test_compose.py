"""Callbacks that compose (issue 27): two callbacks that both decide the same thing either agree on who
decides, whatever their order in ``callbacks=[...]``, or the pair is refused at setup with the reason."""

from __future__ import annotations

import pickle
import warnings

import pytest
import torch
from helpers import Losses, Regression, cpu_trainer, tiny_gpt
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import Logger

from lightning_memkit import (
    ActivationCheckpointing,
    AutoFit,
    FusedOptimizerStep,
    GradientRelease,
    MemoryMonitor,
    OptimizerOffload,
    OptimizerSwap,
)
from lightning_memkit._checkpointing.policies import applied_modes
from lightning_memkit._optimizers.swap import identify, lighter_candidates
from lightning_memkit.demos.gpt import Block
from lightning_memkit.testing import AllocatorPeaks

#: bytes: the tiny GPT's step at micro-batch 8 needs about 27 MB without checkpointing
#: (tests/fitting/test_autofit.py)
TIGHT = 24_000_000


class _Applied(Callback):
    """The checkpointing each training batch runs with."""

    def __init__(self) -> None:
        self.modes: list[dict[str, str]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.modes.append(applied_modes(pl_module))


def _orders(a: Callback, b: Callback) -> list[list[Callback]]:
    return [[a, b], [b, a]]


@pytest.mark.parametrize("first", ["autofit", pytest.param("checkpointing", marks=pytest.mark.slow)])
@pytest.mark.slow
def test_activation_checkpointing_defers_to_autofit_in_either_order(tmp_path, first):
    torch.manual_seed(0)
    model, data, _ = tiny_gpt(batch_size=8, max_steps=2)
    autofit = AutoFit(budget=TIGHT, cost="flops", verify_steps=2)
    checkpointing = ActivationCheckpointing(budget="100TB", checkpointing="full")
    peaks, applied = AllocatorPeaks(), _Applied()
    callbacks = [autofit, checkpointing] if first == "autofit" else [checkpointing, autofit]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cpu_trainer(tmp_path, [*callbacks, applied, *peaks.around()], max_steps=2).fit(model, data)
    assert checkpointing.plan is None  # it planned nothing: AutoFit's plan is the one applied
    plan = autofit.plan
    assert set(plan.modes) <= {"none", "full"}  # within the deferring callback's policy
    assert plan.checkpointing != "none"  # what the pair is about: the budget needs checkpointing
    expected = plan.checkpoint_plan.modes if plan.checkpoint_plan else None
    for policies in applied.modes:
        if expected is not None:
            assert policies == {k: v for k, v in expected.items() if v != "none"}
        else:
            assert set(policies.values()) == {plan.checkpointing}
    assert max(peaks.peaks) <= plan.limit  # the plan the run trains with is the plan that fits
    assert not [w for w in caught if "did not run" in str(w.message)]


@pytest.mark.slow  # 12-17 s: a planned fit each
@pytest.mark.parametrize("order", [0, 1])
def test_the_blocks_checkpointing_names_beside_autofit_are_the_blocks_it_plans(tmp_path, order):
    """Whichever comes first, AutoFit plans with the blocks ActivationCheckpointing names (both were refused
    at setup: AutoFit "cannot be told which blocks"), and the run trains its plan."""
    model, data, _ = tiny_gpt(batch_size=8)
    autofit = AutoFit(budget=TIGHT, cost="flops")
    pair = _orders(autofit, ActivationCheckpointing(checkpointing="full", blocks={Block}))[order]
    losses = Losses()
    cpu_trainer(tmp_path, [*pair, losses], max_steps=1).fit(model, data)
    assert losses.losses
    modules = dict(model.named_modules())
    checkpointed = [name for name, mode in autofit.plan.checkpoint_plan.modes.items() if mode != "none"]
    assert checkpointed and all(isinstance(modules[name], Block) for name in checkpointed), str(autofit.plan)


def test_a_policy_autofit_cannot_plan_is_refused_with_the_modes_to_give():
    checkpointing = ActivationCheckpointing(checkpointing="full")
    with pytest.raises(ValueError, match=r"AutoFit\(checkpointing=\('none', 'selective'\)\).* 'full'"):
        checkpointing.modes_for(("none", "selective"))
    assert checkpointing.modes_for(("none", "selective", "full")) == ("none", "full")
    assert ActivationCheckpointing().modes_for(("none", "selective")) == ("none", "selective")


@pytest.mark.parametrize("order", [0, pytest.param(1, marks=pytest.mark.slow)])
@pytest.mark.slow
def test_optimizer_swap_defers_to_autofit_in_either_order(tmp_path, order, lightning_log):
    """Both chose the optimizer: AutoFit planned AdamW, OptimizerSwap then swapped to another, so the run
    trained with an optimizer the plan had not fitted (and AutoFit warned of a backward that did not run,
    from OptimizerSwap's probe of its wrapped step)."""
    model, data, _ = tiny_gpt(batch_size=8, max_steps=2)
    autofit = AutoFit(budget=TIGHT, cost="flops", verify_steps=2)
    swap = OptimizerSwap(budget="18MB", optimizers=("adafactor",))  # alone: AdamW -> Adafactor
    trained = []
    recorder = _OnFirstBatch(lambda trainer: trained.append(identify(trainer.optimizers[0])))
    peaks = AllocatorPeaks()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pair = _orders(autofit, swap)[order]
        cpu_trainer(tmp_path, [*pair, recorder, *peaks.around()], max_steps=2).fit(model, data)
    plan = autofit.plan
    assert swap.choice is None  # it decided nothing
    assert trained == [plan.optimizer]  # the run trains with the plan's optimizer
    assert {a.optimizer for a in plan.alternatives} <= {"adamw", "adafactor"}  # the swap's candidates
    assert max(peaks.peaks) <= plan.limit
    assert "OptimizerSwap defers to AutoFit (its budget='18MB' is not used)" in lightning_log.text
    assert not [w for w in caught if "did not run" in str(w.message)]


def test_autofit_plans_the_swaps_candidates_after_the_modules_own():
    """The first candidate was dropped when the module's own optimizer was not among them: beside
    ``OptimizerSwap(optimizers=("adafactor",))`` AutoFit planned AdamW alone and found that nothing fit."""
    module, _, _ = tiny_gpt()  # AdamW
    trainer = cpu_trainer(None, [OptimizerSwap("1GB", optimizers=("adafactor",))])
    assert AutoFit(budget="1GB")._optimizers(trainer, module) == ("adamw", "adafactor")
    assert lighter_candidates(module, ("sgd", "adafactor")) == ("adamw", "sgd", "adafactor")
    assert lighter_candidates(module, ("lion", "adamw", "sgd")) == ("adamw", "sgd")  # lighter than its own
    assert lighter_candidates(module)[:2] == ("adamw", "adamw8bit")


@pytest.mark.slow
def test_resuming_a_swapped_run_beside_autofit_says_how_to_resume(tmp_path):
    """The checkpoint holds Adafactor's state; beside AutoFit, OptimizerSwap defers and AutoFit built
    AdamW, whose first step failed with ``KeyError: 'betas'``."""
    model, data, _ = tiny_gpt(batch_size=8, max_steps=2)
    trainer = cpu_trainer(tmp_path, [OptimizerSwap(budget="28MB", optimizers=("adafactor",))], max_steps=1)
    trainer.fit(model, data)
    assert identify(trainer.optimizers[0]) == "adafactor"
    trainer.save_checkpoint(tmp_path / "swapped.ckpt")
    model, data, _ = tiny_gpt(batch_size=8, max_steps=2)
    pair = [AutoFit(budget="1000GB", cost="flops"), OptimizerSwap(budget="28MB", optimizers=("adafactor",))]
    losses = Losses()
    with pytest.raises(
        RuntimeError, match=r"trained with OptimizerSwap's choice, adafactor.*without AutoFit"
    ):
        cpu_trainer(tmp_path, [*pair, losses], max_steps=2).fit(
            model, data, ckpt_path=tmp_path / "swapped.ckpt"
        )
    assert losses.losses == []


class _OnFirstBatch(Callback):
    def __init__(self, fn) -> None:
        self.fn, self.done = fn, False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if not self.done:
            self.fn(trainer)
            self.done = True


@pytest.mark.parametrize("order", [0, 1])
def test_fused_step_beside_offload_is_refused_in_either_order(tmp_path, order):
    model, data, _ = tiny_gpt()
    pair = _orders(FusedOptimizerStep(), OptimizerOffload())[order]
    losses = Losses()
    with pytest.raises(ValueError, match="OptimizerOffload cannot run here: FusedOptimizerStep is among"):
        cpu_trainer(tmp_path, [*pair, losses]).fit(model, data)
    assert losses.losses == []


@pytest.mark.parametrize("order", [0, 1])
def test_gradient_release_beside_offload_trains_as_offload_alone(tmp_path, order):
    """Both act after the step: the release (first in the list) freed the host masters' gradients before
    the offload copied the update back, which then skipped every weight: nothing trained."""

    def weights(callbacks):
        torch.manual_seed(0)
        module = _Plain()
        cpu_trainer(tmp_path, callbacks, max_steps=3).fit(module)
        return [p.detach().clone() for p in module.parameters()]

    torch.manual_seed(0)
    before = [p.detach().clone() for p in _Plain().parameters()]
    alone = weights([OptimizerOffload()])
    paired = weights(_orders(GradientRelease(), OptimizerOffload())[order])
    assert all(not torch.equal(a, b) for a, b in zip(alone, before, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(alone, paired, strict=True))


def test_optimizer_offload_pickles_before_and_after_a_fit(tmp_path):
    offload = OptimizerOffload()
    assert isinstance(pickle.loads(pickle.dumps(offload)), OptimizerOffload)
    model, data, _ = tiny_gpt()
    cpu_trainer(tmp_path, [offload], max_steps=1).fit(model, data)
    copy = pickle.loads(pickle.dumps(offload))
    assert isinstance(copy, OptimizerOffload) and len(copy._masters) == 0  # keyed by live parameters


class _Broken(Logger):
    """A logger whose every write of ours fails, as a full disk or a lost connection makes it."""

    name, version = "broken", 0

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def log_metrics(self, metrics, step=None):
        self.calls += 1
        raise OSError("disk full")

    def log_hyperparams(self, params, *args, **kwargs):
        if any(str(k).startswith(("optimizer_swap/", "autofit/")) for k in dict(params)):
            self.calls += 1
            raise OSError("disk full")


def _Plain() -> Regression:
    return Regression()


@pytest.mark.parametrize(
    "make",
    [lambda: OptimizerSwap(budget="100TB"), lambda: AutoFit(budget="100TB", cost="flops")],
    ids=["optimizer_swap", "autofit"],
)
def test_a_raising_logger_is_warned_about_once_and_training_goes_on(tmp_path, make):
    torch.manual_seed(0)
    logger, losses = _Broken(), Losses()
    trainer = cpu_trainer(tmp_path, [make(), losses], max_steps=3, logger=logger, log_every_n_steps=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(_Plain())
    assert trainer.global_step == 3 and len(losses.losses) == 3
    assert logger.calls >= 1  # the callback did log, and the logger did raise
    said = [str(w.message) for w in caught if "disk full" in str(w.message)]
    assert said and all("training goes on" in s for s in said)
    assert len(said) == len(set(said))  # once per logger method


@pytest.mark.parametrize(("monitor_budget", "warned"), [("24GB", True), ("40MB", False), (None, False)])
def test_a_monitor_budget_that_is_not_autofits_is_warned_about(tmp_path, monitor_budget, warned):
    """Issue 29: MemoryMonitor(budget="24GB") beside AutoFit(budget="40MB") said nothing, and each then
    judged the run by another budget."""
    monitor = MemoryMonitor(budget=monitor_budget, plot=False, summary=False)
    trainer = cpu_trainer(tmp_path, [AutoFit(budget="40MB", cost="flops"), monitor], max_steps=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(_Plain())
    said = [str(w.message) for w in caught if "beside AutoFit" in str(w.message)]
    assert len(said) == int(warned)
    if warned:
        assert "MemoryMonitor(budget='24GB') beside AutoFit(budget='40MB')" in said[0]
        assert "22.35 GiB" in said[0] and "38.15 MiB" in said[0]
