"""Issue 49 item 7: blocks that are not in a list. A diffusion-style UNet (`models.AttributeUNet`) holds its
`ResBlock` and `AttnBlock` blocks as plain attributes: they are found as blocks, `advise` prices their
checkpointing, and `AutoFit` plans with the blocks a user names (or an `ActivationCheckpointing` beside it
names). Each real run is held to the allocator (`lightning_memkit.testing`)."""

from __future__ import annotations

import pytest
import torch
from helpers import cpu_trainer
from models import AttnBlock, ResBlock, UNetModule
from torch import nn

from lightning_memkit import ActivationCheckpointing, AutoFit, advise, estimate_memory, find_blocks, plan_fit
from lightning_memkit.testing import AllocatorPeaks

pytestmark = pytest.mark.usefixtures("one_thread")

#: the simulation against the CPU allocator on this model: within a few dozen bytes (the profiler's rounding)
EXACT = 1024
#: a planned step that accumulates against its real micro-steps (`test_autofit`'s bar is 1 %; 0.16 % here)
ACCUMULATING = 0.005
UNET_BLOCKS = ["down1", "down2", "down_attn", "mid1", "mid_attn", "mid2", "up1", "up_attn", "up2"]


def _peaks(tmp_path, module: UNetModule, *callbacks, max_steps: int = 2) -> list[int]:
    peaks = AllocatorPeaks()
    cpu_trainer(tmp_path, peaks.around(*callbacks), max_steps=max_steps, logger=False).fit(module)
    return peaks.peaks


def _unet(batch_size: int = 8, samples: int = 16) -> UNetModule:
    torch.manual_seed(0)
    return UNetModule(batch_size=batch_size, samples=samples)


def test_blocks_held_as_attributes_are_found_and_a_tower_holding_a_stack_is_not_one():
    assert [name for name, _ in find_blocks(_unet())] == [f"unet.{n}" for n in UNET_BLOCKS]

    class Tower(nn.Module):  # two of them, each holding a stack: the stacks' layers are the blocks
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.ReLU()) for _ in range(3))

    towers = nn.Module()
    towers.left, towers.right = Tower(), Tower()
    assert [n for n, _ in find_blocks(towers)] == [
        f"{s}.layers.{i}" for s in ("left", "right") for i in range(3)
    ]


@pytest.mark.slow  # 15 s on 2 cores: three simulated steps and two profiled ones
def test_advise_prices_checkpointing_the_attribute_blocks_as_the_allocator_then_sees_it(tmp_path):
    """It said "No waste found" beside the activations of blocks that were not in a ModuleList."""
    module = _unet()
    advice = advise(module, module.batch(8), device="cpu")
    found = advice["activations"]
    assert "in 9 blocks (unet.down1, ...)" in found.what
    assert "ActivationCheckpointing(checkpointing='full')" in found.fix
    plain = _peaks(tmp_path / "plain", _unet(samples=8), max_steps=1)
    checkpointed = _peaks(
        tmp_path / "full", _unet(samples=8), ActivationCheckpointing(checkpointing="full"), max_steps=1
    )
    assert abs(plain[-1] - advice.breakdown.peak) <= EXACT, (plain, advice.breakdown.peak)
    real_saving = plain[-1] - checkpointed[-1]
    assert real_saving > 0.4 * plain[-1]  # 46 % of this step's peak
    assert abs(real_saving - found.saved) <= EXACT, (real_saving, found.saved)


def _limit_between(module: UNetModule, n: int, lower: set, upper: set | None) -> int:
    """A step limit halfway between the peaks of micro-batch ``n`` accumulating with ``lower`` and with
    ``upper`` (``None``: nothing) fully checkpointed."""

    def peak(blocks):
        plan = None if blocks is None else {f"unet.{b}": "full" for b in blocks}
        batch = module.batch(n)
        return estimate_memory(module, batch, device="cpu", checkpointing=plan, accumulating=True).peak

    return (peak(lower) + peak(upper)) // 2


RES = {b for b in UNET_BLOCKS if "attn" not in b}


@pytest.mark.slow  # 7-16 s: the planner's simulations, 8 profiled micro-steps
def test_autofit_plans_the_blocks_it_is_given_and_the_run_peaks_as_planned(tmp_path):
    """Only the residual blocks named: at a limit that micro-batch 1 meets only with some of them
    checkpointed, the plan names residual blocks alone, and the run peaks where it said."""
    module = _unet(samples=8)
    limit = _limit_between(module, 1, RES, None)
    autofit = AutoFit(limit, margin=0.0, blocks={ResBlock}, cost="flops")
    peaks = _peaks(tmp_path, module, autofit, max_steps=1)
    plan = autofit.plan
    assert (plan.micro_batch_size, plan.accumulate_grad_batches) == (1, 8)
    checkpointed = {name for name, mode in plan.checkpoint_plan.modes.items() if mode != "none"}
    assert checkpointed and checkpointed <= {f"unet.{b}" for b in RES}, str(plan)
    assert max(peaks) <= limit and max(peaks) == pytest.approx(plan.estimated_peak, rel=ACCUMULATING)


@pytest.mark.slow  # 15 s: the planner's simulations, 8 profiled micro-steps
def test_autofit_takes_the_blocks_activation_checkpointing_names_beside_it(tmp_path):
    """It refused ("cannot be told which blocks. Keep one"); now the plan checkpoints the blocks named there,
    the attention blocks among them where the limit needs them, and the run peaks as planned."""
    module = _unet(samples=8)
    limit = _limit_between(module, 1, set(UNET_BLOCKS), RES)  # below every residual block checkpointed
    autofit = AutoFit(limit, margin=0.0, cost="flops")
    beside = ActivationCheckpointing(checkpointing="full", blocks={ResBlock, AttnBlock})
    peaks = _peaks(tmp_path, module, beside, autofit, max_steps=1)
    checkpointed = {name for name, mode in autofit.plan.checkpoint_plan.modes.items() if mode != "none"}
    assert any("attn" in name for name in checkpointed), str(autofit.plan)
    assert max(peaks) <= limit and max(peaks) == pytest.approx(autofit.plan.estimated_peak, rel=ACCUMULATING)


def test_autofit_and_activation_checkpointing_naming_other_blocks_are_refused(tmp_path):
    autofit = AutoFit("1GiB", blocks={ResBlock})
    beside = ActivationCheckpointing(checkpointing="full", blocks={AttnBlock})
    with pytest.raises(ValueError, match=r"blocks=\{AttnBlock\}\) and AutoFit\(blocks=\{ResBlock\}\)"):
        cpu_trainer(tmp_path, [beside, autofit], max_steps=1, logger=False).fit(_unet())


def test_plan_fit_refuses_blocks_the_model_does_not_have():
    module = _unet()
    with pytest.raises(
        ValueError, match=r"No module of type LSTM is in UNetModule.*Its repeated layers: ResBlock"
    ):
        plan_fit(module, module.batch(8), "1GiB", device="cpu", cost="flops", blocks={nn.LSTM})
