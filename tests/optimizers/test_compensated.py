"""bf16 weights with a compensated update (issue 15, lever 3): an update below a bf16 weight's resolution
is lost by a plain optimizer and kept by torch-optimi's Kahan summation; `plan_fit` plans 16-bit weights
only with the compensated optimizers (`COMPENSATED`), and the simulator prices them as the allocator
sees them."""

from __future__ import annotations

import optimi
import pytest
import torch
from helpers import cpu_trainer

from lightning_memkit import estimate_memory, fit_optimizer, plan_fit, swap_optimizer
from lightning_memkit._fitting.space import _pairs
from lightning_memkit._optimizers.choice import compensated_candidates
from lightning_memkit._optimizers.swap import identify
from lightning_memkit.demos.gpt import GPTDataModule, GPTLightningModule
from lightning_memkit.testing import AllocatorPeaks

B, T = 8, 64


def test_kahan_keeps_the_updates_bf16_rounds_away():
    """A weight of 1.0 in bf16 moves in steps of 2**-7; AdamW's steps of about lr = 1e-3 round away
    every time with torch's AdamW, and add up with the Kahan-summed one (as they do in fp32)."""
    moved = {}
    for name, make in {
        "fp32": lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.0),
        "bf16": lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.0),
        "bf16 kahan": lambda p: optimi.AdamW(p, lr=1e-3, weight_decay=0.0, kahan_sum=True),
    }.items():
        dtype = torch.float32 if name == "fp32" else torch.bfloat16
        weight = torch.nn.Parameter(torch.ones(4, dtype=dtype))
        optimizer = make([weight])
        for _ in range(50):
            weight.grad = torch.ones_like(weight)
            optimizer.step()
        moved[name] = 1.0 - weight.float().mean().item()
    assert moved["bf16"] == 0.0  # every step lost
    assert moved["fp32"] == pytest.approx(0.05, rel=0.01)
    assert moved["bf16 kahan"] == pytest.approx(moved["fp32"], abs=2**-8)  # within a bf16 rounding


@pytest.mark.slow
def test_plan_fit_plans_bf16_weights_with_the_kahan_twin():
    """A budget AdamW's fp32 parameters, gradients and state do not fit (14 MB): the plan falls to
    bf16-true, with AdamW's Kahan-summed twin, not AdamW rounding its updates away (``compensate=False``,
    AutoFit's, keeps it: `test_pairs_follow_the_precision_preference`)."""
    torch.manual_seed(0)
    module = GPTLightningModule("tiny", max_steps=10)
    x = torch.randint(0, 256, (B, T))
    kwargs = {
        "margin": 0,
        "device": "cpu",
        "cost": "flops",
        "checkpointing": ("none",),
        "optimizers": ["adamw"],
    }
    plan = plan_fit(module, (x, x), 12_500_000, precision=("32-true", "bf16-true"), **kwargs)
    assert (plan.optimizer, plan.precision) == ("adamw_kahan", "bf16-true")
    assert ("adamw", "bf16-true") not in {(a.optimizer, a.precision) for a in plan.alternatives}
    with pytest.raises(ValueError, match="keeps small updates with 16-bit weights"):
        plan_fit(module, (x, x), 12_500_000, precision="bf16-true", **{**kwargs, "optimizers": ["lion"]})


@pytest.mark.slow
def test_the_bf16_step_with_kahan_is_as_estimated(tmp_path):
    """bf16-true with AdamW swapped for the Kahan-summed one (as `memkit plan` prints it) in a Trainer:
    the allocator's first and steady peaks are the estimates, and the state holds the bf16 moments and
    Kahan buffer (6 bytes per parameter)."""
    torch.manual_seed(0)
    module, peaks = GPTLightningModule("tiny", max_steps=3, optimizer="adamw_kahan"), AllocatorPeaks()
    trainer = cpu_trainer(tmp_path, peaks.around(), max_steps=3, precision="bf16-true")
    trainer.fit(module, GPTDataModule(batch_size=B, seq_len=T, num_sentences=300))
    (optimizer,) = trainer.optimizers
    assert type(optimizer) is optimi.AdamW
    state = next(iter(optimizer.state.values()))
    assert {state[k].dtype for k in ("exp_avg", "exp_avg_sq", "kahan_comp")} == {torch.bfloat16}
    x = torch.randint(0, 256, (B, T))
    first = estimate_memory(module, (x, x), device="cpu", precision="bf16-true", first_step=True)
    steady = estimate_memory(module, (x, x), device="cpu", precision="bf16-true")
    n = sum(p.numel() for p in module.parameters())
    assert steady.optimizer_state == 6 * n
    assert first.peak == pytest.approx(peaks.peaks[0], rel=0.01)
    assert steady.peak == pytest.approx(max(peaks.peaks[1:]), rel=0.01)


def test_a_swap_keeps_the_compensation_and_the_optimizers_own_hyperparameters():
    """Found by a hostile review. On bf16 weights, plain AdamW's state is smaller than the Kahan-summed
    one's, so a tight budget would trade the compensation away: the candidates become the Kahan twins.
    Swapping from a user-built optimi AdamW keeps its betas (optimi names them beta1, beta2), and one
    that decays without the learning rate (decouple_lr) is not taken for AdamW."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)).to(torch.bfloat16)
    kahan = optimi.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), kahan_sum=True)
    assert compensated_candidates(("adamw", "adamw8bit", "sgd"), [kahan], "bf16-true") == (
        "adamw_kahan",
        "sgd_kahan",
    )
    assert compensated_candidates(("adamw", "sgd"), [kahan], "bf16-mixed") == ("adamw", "sgd")  # fp32 weights
    six = sum(6 * p.numel() for p in model.parameters())
    choice = fit_optimizer(model, kahan, six, precision="bf16-true", device="cpu")  # static: below 6 B/param
    assert choice.name == "sgd_kahan" and type(choice.optimizer) is optimi.SGD
    assert swap_optimizer(kahan, "adamw").param_groups[0]["betas"] == (0.9, 0.95)
    assert identify(optimi.AdamW(model.parameters(), lr=1e-3, decouple_lr=True)) is None


def test_pairs_follow_the_precision_preference():
    """bf16-true first means the Kahan twin at bf16-true before AdamW at 32-true; an optimizer without a
    twin is planned at fp32 weights only; with the fused step the Kahan entries are not planned at all."""
    assert _pairs(("adamw", "lion"), ("bf16-true", "32-true"), True) == [
        ("adamw_kahan", "bf16-true"),
        ("adamw", "32-true"),
        ("lion", "32-true"),
    ]
    assert _pairs(("adamw",), ("32-true", "bf16-true"), True, fused=True) == [("adamw", "32-true")]
    assert _pairs(("adamw",), ("bf16-true",), False) == [("adamw", "bf16-true")]
