"""GradientRelease / release_gradients (issue 15, lever 1): the gradients are freed once the optimizer has
stepped, so a Lightning step's forward runs without the previous step's gradients. The peak falls by what
`estimate_memory(lever="release_gradients")` predicts (the allocator's figures), the monitor still matches the
allocator, and training is bit-identical (`tests/callbacks/test_observe_only.py` runs it in 14 usages)."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from helpers import cpu_trainer
from zoo import ZooModule, zoo_batch

from lightning_memkit import (
    FusedOptimizerStep,
    GradientRelease,
    MemoryMonitor,
    OptimizerSwap,
    estimate_memory,
    plan_fit,
    release_gradients,
)
from lightning_memkit.demos.gpt import GPTDataModule, GPTLightningModule
from lightning_memkit.testing import AllocatorPeaks

B, T = 8, 64


def _fit(module, data, callbacks, tmp_path, max_steps=3, **kwargs) -> pl.Trainer:
    trainer = cpu_trainer(tmp_path, callbacks, max_steps, **kwargs)
    trainer.fit(module, data)
    return trainer


def _gpt():
    torch.manual_seed(0)
    data = GPTDataModule(batch_size=B, seq_len=T, num_sentences=300)
    x = torch.randint(0, 256, (B, T))
    return GPTLightningModule("tiny", max_steps=3), data, (x, x.roll(-1, 1))


def _zoo(name: str, batch_size: int, seq_len: int):
    def make():
        torch.manual_seed(0)
        module = ZooModule(name, batch_size=batch_size, seq_len=seq_len, n_batches=4)
        return module, None, zoo_batch(name, batch_size, seq_len)  # the first batch the loader gives

    return make


# The GPT example; T5 at its default use_cache=True, whose step still peaks in the forward without the
# gradients, so it saves all of them; the CNN with BatchNorm, whose step peaks in its backward, so it saves
# nothing (benchmarks/bench_step_levers.py: the rest of the zoo).
MODELS = {"gpt": _gpt, "t5": _zoo("t5", 2, 32), "resnet": _zoo("resnet", 4, 64)}


@pytest.mark.slow  # the zoo sweep and planning-heavy checks: the full run's tier
@pytest.mark.parametrize("name", list(MODELS))
def test_the_peak_falls_as_estimated_and_the_monitor_matches_the_allocator(name, tmp_path):
    """The unchanged LightningModule, with and without GradientRelease: every step's allocator peak, the
    monitor's figure of it, and the estimate of the steady step. From the second step on the peak falls
    by what the estimator predicts: the gradient bytes, less what the backward's first ops add where they
    rise above the forward (`test_the_saving_is_the_gradients_unless_the_backward_peaks_higher`)."""
    steady, estimates = {}, {}
    for release in (False, True):
        module, data, batch = MODELS[name]()
        peaks, monitor = AllocatorPeaks(), MemoryMonitor(plot=False, summary=False)
        callbacks = [GradientRelease()] if release else []
        _fit(module, data, [*callbacks, *peaks.around(monitor)], tmp_path / str(release))
        for (_, measured), truth in zip(monitor.history, peaks.peaks, strict=True):
            assert measured.peak == pytest.approx(truth, rel=0.001)
        estimates[release] = estimate_memory(
            module, batch, device="cpu", lever="release_gradients" if release else None
        )
        steady[release] = max(peaks.peaks[1:])
        assert estimates[release].peak == pytest.approx(steady[release], rel=0.01)
    saved, predicted = steady[False] - steady[True], estimates[False].peak - estimates[True].peak
    gradients = estimates[False].gradients
    if name == "resnet":  # the peak is in the backward, where the last step's gradients are gone anyway
        assert predicted == 0 and saved == pytest.approx(0, abs=0.001 * steady[False])
        return
    assert 0 < predicted <= gradients
    assert saved == pytest.approx(predicted, rel=0.02)
    if name == "t5":
        assert predicted == gradients and saved == pytest.approx(gradients, rel=0.05)


def test_the_saving_is_the_gradients_unless_the_backward_peaks_higher():
    """Without the gradients the forward's highest point is exactly the gradient bytes lower; the step's
    peak is then that or the backward's, whichever is higher. In the GPT example at 8 x 64 the backward's
    first ops (the loss's gradient over the logits) rise above it: 85 % of the gradients are saved."""
    module, _, batch = _gpt()
    with_grads = estimate_memory(module, batch, device="cpu", timeline=True)
    released = estimate_memory(module, batch, device="cpu", lever="release_gradients", timeline=True)
    timeline, released_timeline = with_grads.timeline, released.timeline
    peak = max(timeline, key=lambda e: e.live)
    assert peak.phase == "forward" and with_grads.gradients > 0  # Lightning's order: last step's grads
    at = max(released_timeline, key=lambda e: e.live)
    forward = max(e.live for e in released_timeline if e.phase == "forward")
    assert forward == peak.live - with_grads.gradients
    assert at.phase == "backward" and released.peak == at.live > forward
    assert 0.8 < (with_grads.peak - released.peak) / with_grads.gradients < 0.9


def test_plain_pytorch_loop_keeps_training_and_frees_after_each_step():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    reference = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    reference.load_state_dict(model.state_dict())
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.1)
    handle = release_gradients(optimizer)
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    for step in range(6):
        for net, opt in ((model, optimizer), (reference, reference_optimizer)):
            torch.nn.functional.mse_loss(net(x), y).backward()
            if step % 2 == 1:  # accumulate over two backward passes, then step
                opt.step()
                if opt is reference_optimizer:
                    opt.zero_grad()
        stepped = step % 2 == 1
        assert all((p.grad is None) == stepped for p in model.parameters())
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(a, b)
    handle.remove()
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
    assert all(p.grad is not None for p in model.parameters())  # removed: the loop's own zero_grad again


def test_the_callback_removes_its_hooks_after_the_fit(tmp_path):
    module, data, _ = _gpt()
    callback = GradientRelease()
    trainer = _fit(module, data, [callback], tmp_path, max_steps=2)
    assert callback._handles == []
    (optimizer,) = trainer.optimizers
    assert not optimizer._optimizer_step_post_hooks


@pytest.mark.parametrize("lever", [GradientRelease, FusedOptimizerStep])
@pytest.mark.slow
def test_the_budget_callbacks_plan_for_the_step_the_levers_make(lever, tmp_path):
    """At 31 MB the GPT example's AdamW step fits only without all its gradients (32.4 MB with them, 29.5
    MB released after the step or stepped inside backward): OptimizerSwap keeps AdamW beside either lever
    and would swap without one (the step does not fit); plan_fit keeps the whole batch without
    checkpointing when told (AutoFit beside FusedOptimizerStep: ``test_fused_step.py``)."""
    budget = 31_000_000
    kwargs = {"lever": "release_gradients" if lever is GradientRelease else "fused_step"}
    module, data, _ = _gpt()
    swap = OptimizerSwap(budget=budget)
    _fit(module, data, [swap, lever()], tmp_path / "swap", 1)
    assert swap.choice.name == "adamw"
    without = estimate_memory(module, _gpt()[2], device="cpu")
    assert without.peak > budget  # what OptimizerSwap alone finds, and swaps to adamw8bit for
    module, _, batch = _gpt()
    kept = plan_fit(module, batch, budget, margin=0, device="cpu", cost="flops", **kwargs)
    assert (kept.micro_batch_size, kept.checkpointing, kept.optimizer) == (B, "none", "adamw")
