"""Mixture-of-experts on the simulated step (issue 26 item 1, in part). Hugging Face's MoE layers run their
experts in one grouped matmul (``aten._grouped_mm``), whose meta kernel takes bf16 only: every
estimator-backed feature crashed on an fp32 MoE ("Expected inputs of BF16 type"). The simulation takes the
output's shape from the bf16 call and keeps the operands' dtype. The zoo's Mixtral (tests/zoo.py) is held
to the allocator by the zoo's tests; this is the other family, with a shared expert beside the routed ones.
"""

from __future__ import annotations

import pytest
import torch
from helpers import steady_step_and_estimate
from zoo import _qwen2_moe

from lightning_memkit import estimate_memory
from lightning_memkit.testing import allocator_peak


def _loss(out, labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), labels.flatten())


@pytest.mark.parametrize("batch_size", [pytest.param(2, marks=pytest.mark.slow), 8])
def test_an_fp32_moe_step_is_estimated_as_the_allocator_counts_it(batch_size):
    torch.manual_seed(0)
    model = _qwen2_moe()
    optimizer = torch.optim.AdamW(model.parameters())
    ids = torch.randint(0, 128, (batch_size, 16), generator=torch.Generator().manual_seed(1))
    truth, estimate = steady_step_and_estimate(model, (ids, ids), optimizer, _loss)
    assert estimate == pytest.approx(truth, rel=1e-3)
    assert next(model.parameters()).dtype == torch.float32  # the simulation cast nothing of the model's


def _eager_moe() -> tuple[torch.nn.Module, torch.Tensor]:
    """Qwen2-MoE with Hugging Face's eager experts: each expert's tokens gathered with ``nonzero`` of the
    router's choice, a buffer whose size depends on the routing."""
    torch.manual_seed(0)
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1))
    return _qwen2_moe(experts_implementation="eager"), ids


def test_experts_chosen_token_by_token_are_refused_with_the_module_and_what_to_do():
    """The eager experts' ``nonzero`` has a size computed from the weights, which fake tensors do not have:
    the estimate and the planners built on it say so, naming the op and the module, where they once raised
    torch's DynamicOutputShapeException (and AutoFit's search tried every micro-batch first)."""
    from lightning_memkit import plan_fit

    model, ids = _eager_moe()
    expected = (
        r"cannot follow aten\.nonzero\.default in Qwen2MoeExperts\.forward.*"
        r"experts_implementation='grouped_mm'.*measure, MemoryMonitor"
    )
    with pytest.raises(NotImplementedError, match=expected):
        estimate_memory(model, (ids, ids), optimizer="adamw", loss_fn=_loss, device="cpu")
    with pytest.raises(NotImplementedError, match=expected):
        plan_fit(model, (ids, ids), "1GiB", loss_fn=_loss, device="cpu", cost="flops")


def test_eager_experts_measured_as_the_unmeasured_step_allocates():
    """`measure` follows any routing. Under any Python dispatch mode the autograd engine adds the
    gradients that several experts' selects send to one parameter out of place, so the measured step
    holds one more parameter-sized buffer than the same step unmeasured (it read +345,912 B here); the
    tracker counts such a sum as the plain step makes it, in place (tests/test_packed.py)."""
    from lightning_memkit import measure

    model, ids = _eager_moe()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)  # the same weights, the same routing

    def step() -> None:
        _loss(model(ids), ids).backward()
        optimizer.step()
        optimizer.zero_grad()

    step()  # the optimizer's state
    truth = allocator_peak(step)
    with measure(model, optimizer) as measured:
        step()
    assert measured.breakdown.peak == pytest.approx(truth, rel=1e-3)


def _monitored_fit(tmp_path, batch_size: int):
    """A 4-step fit of the eager experts under MemoryMonitor: the monitor and the allocator's peaks."""
    from helpers import cpu_trainer
    from zoo import ZooModule

    from lightning_memkit import MemoryMonitor
    from lightning_memkit.testing import AllocatorPeaks

    peaks, monitor = AllocatorPeaks(), MemoryMonitor(plot=False, summary=False)
    trainer = cpu_trainer(tmp_path, peaks.around(monitor))
    with pytest.warns(UserWarning, match=r"sizes tensors by the values.*aten\.nonzero"):
        trainer.fit(ZooModule("qwen2_moe_eager", batch_size=batch_size))
    return monitor, peaks.peaks


@pytest.mark.slow  # a Trainer fit: the full run's tier
def test_routing_that_changes_between_steps_is_measured_every_step(tmp_path):
    """Under MemoryMonitor the eager experts' steps of one shape route their tokens differently as the
    weights learn and the batches change: no step takes an earlier one's figures (the monitor measures
    each, and says why once), and every logged step is the allocator's."""
    monitor, peaks = _monitored_fit(tmp_path, batch_size=8)
    assert monitor.measured_steps == len(monitor.history) == len(peaks) == 4
    for (_, measured), truth in zip(monitor.history, peaks, strict=True):
        assert measured.peak == pytest.approx(truth, rel=1e-3)


@pytest.mark.slow  # a Trainer fit: the full run's tier
@pytest.mark.xfail(
    strict=True,
    reason="the first step (no AdamW state yet) at batch 16 reads 4.9 % low: the tracker counts the "
    "engine's gradient sums as made in place (tests/test_packed.py), and here the plain step holds a third "
    "parameter-sized buffer at that moment by another way, not found yet",
)
def test_the_first_step_at_batch_16_is_the_allocators(tmp_path):
    monitor, peaks = _monitored_fit(tmp_path, batch_size=16)
    (_, first), truth = monitor.history[0], peaks[0]
    assert first.peak == pytest.approx(truth, rel=1e-3)
