"""Activation checkpointing at its edges: the plan search, messages, a callback reused for another fit, GPU
names as budgets, LBFGS, planning that leaves no trace."""

from __future__ import annotations

import itertools

import lightning.pytorch as pl
import pytest
import torch
from helpers import cpu_trainer
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from models import BlockNet, PlainGPT, lm_loss
from torch import nn

from lightning_memkit import apply_checkpointing, estimate_memory, parse_budget, plan_checkpointing
from lightning_memkit._checkpointing.planner import CheckpointPlanner
from lightning_memkit._checkpointing.policies import applied_modes
from lightning_memkit.callbacks.activation_checkpointing import ActivationCheckpointing
from lightning_memkit.testing import AllocatorPeaks

pytestmark = pytest.mark.usefixtures("one_thread")


class Manual(BlockNet):
    """`BlockNet` stepping its optimizer itself (manual optimization)."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(super().training_step(batch, batch_idx))
        opt.step()


def _trainer(tmp_path, callbacks) -> pl.Trainer:
    return cpu_trainer(tmp_path, callbacks, max_steps=2, logger=False, limit_val_batches=None)


def _peaks(module: BlockNet) -> tuple[int, int]:
    """The simulated step peaks of ``module`` without checkpointing and with full checkpointing."""
    batch = next(iter(module.train_dataloader()))
    return tuple(estimate_memory(module, batch, checkpointing=p, device="cpu").peak for p in ("none", "full"))


# --------------------------------------------------------------------------------------------------
# Item 16: the cheapest plan that fits, against brute force
# --------------------------------------------------------------------------------------------------


def test_plan_is_the_cheapest_that_fits_by_brute_force():
    """Every budget between the simulated peaks of the 8 plans of a 3-block GPT gets the least recompute
    among the plans that fit. The peak is at the loss, where checkpointing the last block saves memory
    that the blocks' backward alone does not show: the search used to return full/full/full (+22.3 %
    recompute) for the budget that two full blocks and one none (+14.9 %) fit exactly."""
    torch.manual_seed(0)
    batch = torch.randint(0, 256, (4, 32)), torch.randint(0, 256, (4, 32))
    model = PlainGPT(vocab_size=256, block_size=32, n_layer=3, n_head=2, n_embd=32)
    planner = CheckpointPlanner(
        model, batch, checkpointing="full", cost="flops", optimizer="sgd", loss_fn=lm_loss
    )
    peaks = {
        choice: planner.simulate(choice).peak for choice in itertools.product(("none", "full"), repeat=3)
    }
    levels = sorted(set(peaks.values()))
    for budget in sorted({*levels, *((a + b) // 2 for a, b in itertools.pairwise(levels))}):
        plan = planner.plan(budget)
        cheapest = min(planner.overhead(c) for c, peak in peaks.items() if peak <= budget)
        assert plan.peak <= budget and plan.overhead == cheapest, (budget, str(plan))
    mixed = planner.plan(peaks[("full", "full", "none")])
    assert sorted(mixed.modes.values()) == ["full", "full", "none"], str(mixed)
    assert mixed.overhead < planner.plan(peaks[("full",) * 3] + 1).overhead


# --------------------------------------------------------------------------------------------------
# Item 15: messages that fit what was asked
# --------------------------------------------------------------------------------------------------


def test_layer_class_not_in_the_model_says_so_and_names_the_repeated_ones(tmp_path):
    expected = r"No module of type GRU is in BlockNet.*ResidualMLP \(x3, blocks\.0.*blocks=\{ResidualMLP\}"
    with pytest.raises(ValueError, match=expected):
        _trainer(tmp_path, [ActivationCheckpointing(checkpointing="full", blocks={nn.GRU})]).fit(BlockNet())
    with pytest.raises(ValueError, match=r"No module of type GRU is in BlockNet.*blocks=\{ResidualMLP\}"):
        module = BlockNet()
        plan_checkpointing(
            module, next(iter(module.train_dataloader())), "1GB", blocks={nn.GRU}, cost="flops"
        )
    applying = r"No module of type GRU is in BlockNet.*apply_checkpointing\(model, \{ResidualMLP\}"
    with pytest.raises(ValueError, match=applying):
        apply_checkpointing(BlockNet(), {nn.GRU})


def test_budget_under_manual_optimization_says_what_the_callback_can_do(tmp_path):
    match = r"manual optimization.*checkpointing='selective'"
    with pytest.raises(MisconfigurationException, match=match) as info:
        _trainer(tmp_path, [ActivationCheckpointing(budget="1GB", cost="flops")]).fit(Manual())
    assert "loss_fn" not in str(info.value) and "optimizer=" not in str(info.value)


# --------------------------------------------------------------------------------------------------
# Item 8: every fit plans afresh
# --------------------------------------------------------------------------------------------------


def test_callback_reused_for_a_bigger_model_plans_again_and_undoes_the_first(tmp_path):
    budget = 1_400_000  # both need checkpointing: none/full peaks 1.59/1.08 MB and 2.47/1.25 MB
    torch.manual_seed(0)
    small, big = BlockNet(n_blocks=2, batch_size=512), BlockNet(n_blocks=4, width=48, batch_size=256)
    callback = ActivationCheckpointing(budget=budget, checkpointing="full", cost="flops")
    _trainer(tmp_path, [callback]).fit(small)
    assert applied_modes(small)
    first = callback.plan

    peaks = AllocatorPeaks()
    _trainer(tmp_path, peaks.around(callback)).fit(big)
    assert applied_modes(small) == {}  # the first fit's wrapping is gone
    assert callback.plan != first and len(callback.plan.blocks) == 4
    assert applied_modes(big) == {n: p for n, p in callback.plan.modes.items() if p != "none"}
    assert callback.plan.peak <= budget and max(peaks.peaks) <= budget, (peaks.peaks, str(callback.plan))


# --------------------------------------------------------------------------------------------------
# Item 11: a budget as a GPU name; device fractions read in setup
# --------------------------------------------------------------------------------------------------


def test_gpu_names_are_budgets_and_device_fractions_wait_for_setup(tmp_path):
    usable = parse_budget("A100-40GB").usable  # the card less the CUDA context and the 5 % reserve
    assert ActivationCheckpointing(budget="H200").budget == parse_budget("H200").usable
    module = BlockNet()
    plan = plan_checkpointing(module, next(iter(module.train_dataloader())), "A100-40GB", cost="flops")
    assert plan.budget == usable and set(plan.modes.values()) == {"none"}
    callback = ActivationCheckpointing(budget="A100-40GB", cost="flops")
    _trainer(tmp_path, [callback]).fit(BlockNet())
    assert callback.plan.budget == usable

    with pytest.raises(ValueError, match=r"Unknown GPU or size 'H2000'"):
        ActivationCheckpointing(budget="H2000")
    with pytest.raises(
        ValueError, match=r"A float budget is a fraction of the current CUDA device, in \(0, 1\]; got 1.5"
    ):
        ActivationCheckpointing(budget=1.5)
    fraction = ActivationCheckpointing(budget=0.9)  # read from the run's CUDA device, in setup
    with pytest.raises(MisconfigurationException, match=r"budget=0.9\) is read from the CUDA device.*on cpu"):
        _trainer(tmp_path, [fraction]).fit(BlockNet())


# --------------------------------------------------------------------------------------------------
# Item 12: LBFGS, whose step needs a closure
# --------------------------------------------------------------------------------------------------


def test_lbfgs_is_planned_and_the_run_fits(tmp_path):
    torch.manual_seed(0)
    module = BlockNet(optimizer="lbfgs", batch_size=128)
    none, full = _peaks(module)
    budget = (none + full) // 2
    callback = ActivationCheckpointing(budget=budget, checkpointing="full", cost="flops")
    peaks = AllocatorPeaks()
    _trainer(tmp_path, peaks.around(callback)).fit(module)
    plan = callback.plan
    assert "full" in plan.modes.values() and plan.peak <= budget
    assert max(peaks.peaks) <= budget, (peaks.peaks, str(plan))


# --------------------------------------------------------------------------------------------------
# Item 4: planning leaves the run as it would be without the callback
# --------------------------------------------------------------------------------------------------


def test_planning_leaves_no_trace_on_the_run(tmp_path):
    """BatchNorm, dropout, a shuffled loader and a list of losses: with a budget the whole step fits (the
    plan checkpoints nothing) the run is bit for bit the run without the callback."""

    def run(callbacks: list) -> tuple[BlockNet, torch.Tensor]:
        torch.manual_seed(0)
        module = BlockNet(norm=True, shuffle=True)
        _trainer(tmp_path, callbacks).fit(module)
        return module, torch.random.get_rng_state()

    callback = ActivationCheckpointing(budget="1GB", cost="flops")
    (plain, rng), (planned, rng_planned) = run([]), run([callback])
    assert set(callback.plan.modes.values()) == {"none"}
    assert torch.equal(rng, rng_planned)
    assert len(plain.losses) == len(planned.losses) == 2
    assert all(torch.equal(a, b) for a, b in zip(plain.losses, planned.losses, strict=True))
    for (name, a), b in zip(plain.state_dict().items(), planned.state_dict().values(), strict=True):
        assert torch.equal(a, b), name  # parameters and BatchNorm's buffers, num_batches_tracked too


def test_a_keyword_estimate_memory_does_not_take_is_refused_in_the_callers_name():
    """`plan_checkpointing` passes its other keywords on as `estimate_memory`'s: one it does not take (the
    lever's old boolean) is refused naming `plan_checkpointing` and what it takes, not a function inside."""
    module, batch = BlockNet(), (torch.zeros(8, 32), torch.zeros(8, 1))
    refusal = r"plan_checkpointing\(\) got an unexpected keyword argument 'release_gradients': .* lever,"
    with pytest.raises(TypeError, match=refusal):
        plan_checkpointing(module, batch, "1GB", device="cpu", release_gradients=True)
    plan = plan_checkpointing(module, batch, "1GB", device="cpu", lever="release_gradients")
    assert set(plan.modes) == {"blocks.0", "blocks.1", "blocks.2"}
