"""FusedOptimizerStep / fuse_optimizer_step (issue 15, lever 2): each parameter is stepped inside backward
and its gradient freed. Training is bit-identical to the unfused step (torch's AdamW on the CPU, with the
GPT example's two param groups and its warm-up/cosine scheduler), the allocator's peak is what
`estimate_memory(lever="fused_step")` predicts, the monitor still matches the allocator, and set-ups whose
update would differ (clipping, accumulation, the fp16 scaler, DDP, manual optimization, LBFGS) are refused."""

from __future__ import annotations

import types

import bitsandbytes as bnb
import lightning.pytorch as pl
import optimi
import pytest
import torch
from helpers import B, Losses, T, cpu_trainer, tiny_gpt
from lightning.pytorch.plugins import MixedPrecision
from lightning.pytorch.strategies import ModelParallelStrategy
from zoo import ZooModule, zoo_batch

from lightning_memkit import (
    AutoFit,
    FusedOptimizerStep,
    GradientRelease,
    MemoryMonitor,
    OptimizerSwap,
    estimate_memory,
    fuse_optimizer_step,
)
from lightning_memkit._estimating.analytic import model_static
from lightning_memkit.callbacks.fused_step import refusal
from lightning_memkit.demos.gpt import GPTDataModule, GPTLightningModule
from lightning_memkit.testing import AllocatorPeaks


def _trainer(tmp_path, callbacks, max_steps=4, **kwargs) -> pl.Trainer:
    return cpu_trainer(tmp_path, callbacks, max_steps, **kwargs)


_Losses = Losses
_gpt = tiny_gpt


def _zoo(name: str):
    def make():
        torch.manual_seed(0)
        return ZooModule(name, batch_size=4, seq_len=64, n_batches=4), None, zoo_batch(name, 4, 64)

    return make


def _run(make, fused: bool, tmp_path):
    """Three steps of ``make``'s module; the fused run also measured (allocator and monitor, every step)."""
    module, data, batch = make()
    losses, peaks, monitor = _Losses(), AllocatorPeaks(), MemoryMonitor(plot=False, summary=False)
    watched = [FusedOptimizerStep(), *peaks.around(monitor)] if fused else []
    _trainer(tmp_path / str(fused), [losses, *watched], max_steps=3).fit(module, data)
    for (_, measured), truth in zip(monitor.history, peaks.peaks, strict=True):
        assert measured.peak == pytest.approx(truth, rel=0.001)  # categories sum to the allocator's peak
    return module, batch, peaks.peaks, losses.losses


@pytest.mark.parametrize(
    "make",
    [_gpt, pytest.param(_zoo("qwen2"), marks=pytest.mark.slow), _zoo("resnet")],
    ids=["gpt", "qwen2", "resnet"],
)
@pytest.mark.slow
def test_training_is_bit_identical_and_the_peak_is_as_estimated(make, tmp_path):
    """The unchanged LightningModule with and without FusedOptimizerStep: the same losses, parameters and
    buffers (the CNN's BatchNorm statistics);
    every fused step's allocator peak as the monitor reports it, and the first and steady steps' peaks as
    estimated. No gradient is whole at the peak (the unfused step's peak is checked against the allocator
    in ``test_gradient_release.py`` and ``test_zoo.py``)."""
    plain, batch, _, plain_losses = _run(make, False, tmp_path)
    fused, _, fused_peaks, fused_losses = _run(make, True, tmp_path)
    assert len(fused_peaks) == 3
    assert torch.equal(torch.stack(fused_losses), torch.stack(plain_losses))
    for a, b in zip(fused.state_dict().values(), plain.state_dict().values(), strict=True):
        assert torch.equal(a, b)

    first = estimate_memory(fused, batch, device="cpu", lever="fused_step", first_step=True)
    steady = estimate_memory(fused, batch, device="cpu", lever="fused_step")
    assert first.peak == pytest.approx(fused_peaks[0], rel=0.01)
    assert steady.peak == pytest.approx(max(fused_peaks[1:]), rel=0.01)
    unfused = estimate_memory(plain, batch, device="cpu")
    assert steady.gradients <= unfused.gradients / 4  # a few parameters' gradients at most
    assert max(fused_peaks[1:]) <= unfused.peak


def test_resume_restores_the_optimizer_and_schedule(tmp_path):
    """Two steps, a checkpoint, two more resumed: with the fused step as without it (the optimizer, its
    state and the scheduler are Lightning's own), the same losses and parameters."""
    results = {}
    for fused in (False, True):
        module, data, _ = _gpt()
        callbacks = [FusedOptimizerStep()] if fused else []
        trainer = _trainer(tmp_path / str(fused), callbacks, max_steps=2)
        trainer.fit(module, data)
        ckpt = tmp_path / f"{fused}.ckpt"
        trainer.save_checkpoint(ckpt)
        torch.manual_seed(1)  # the resumed weights come from the checkpoint, not the seed
        module, data, _ = _gpt()
        losses = _Losses()
        callbacks = [FusedOptimizerStep()] if fused else []
        _trainer(tmp_path / f"{fused}-resumed", [*callbacks, losses]).fit(module, data, ckpt_path=ckpt)
        results[fused] = torch.stack(losses.losses), [p.detach() for p in module.parameters()]
        assert module.trainer.optimizers[0].state_dict()["state"][0]["step"] == 4
    assert torch.equal(results[True][0], results[False][0]) and len(results[True][0]) == 2
    for a, b in zip(results[True][1], results[False][1], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "optimizer",
    [
        lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
        lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9),
        lambda p: bnb.optim.AdamW8bit(p, lr=1e-2, min_8bit_size=64),
        lambda p: bnb.optim.Lion(p, lr=1e-3),
    ],
    ids=["adamw", "sgd_momentum", "adamw8bit", "lion"],
)
def test_plain_loop_trains_as_the_unfused_step(optimizer):
    """A plain PyTorch loop (zero_grad, backward, step, as the optimizer's own docs write it): the fused
    step trains the same, with torch's and bitsandbytes' optimizers, and leaves no gradient behind."""
    torch.manual_seed(0)
    models = [torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))]
    models.append(torch.nn.Sequential(*(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))))
    models[1].load_state_dict(models[0].state_dict())
    optimizers = [optimizer(m.parameters()) for m in models]
    fused = fuse_optimizer_step(optimizers[1])
    x, y = torch.randn(32, 16), torch.randn(32, 4)
    for _ in range(5):
        for model, opt in zip(models, optimizers, strict=True):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    assert all(p.grad is None for p in models[1].parameters())
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        assert torch.equal(a, b)
    fused.remove()  # unfused again: the gradients stay until zero_grad
    torch.nn.functional.mse_loss(models[1](x), y).backward()
    assert all(p.grad is not None for p in models[1].parameters())


def test_refuses_what_needs_all_gradients_before_a_step(tmp_path):
    """Each set-up whose update would differ inside backward is refused as the fit starts, saying why and
    what to use instead."""
    cases = {
        "gradient_clip_val=1.0 clips by the norm of all gradients": {"gradient_clip_val": 1.0},
        "accumulate_grad_batches=2 adds several backward": {"accumulate_grad_batches": 2},
        "DDPStrategy reduces each gradient": {"strategy": "ddp"},
    }
    for message, kwargs in cases.items():
        module, data, _ = _gpt()
        match = f"FusedOptimizerStep cannot run here: {message}.*GradientRelease"
        with pytest.raises(ValueError, match=match):
            _trainer(tmp_path, [FusedOptimizerStep()], max_steps=1, **kwargs).fit(module, data)
    # FSDP2 alone is served (tests/sharding/test_fsdp.py trains it bit-identically on gloo ranks); tensor
    # parallelism is not. The mesh is the one setup would make: a CPU cannot run two tensor-parallel ranks.
    trainer = cpu_trainer(
        None, [], devices=2, strategy=ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2)
    )
    module, _, _ = _gpt()
    trainer.strategy._device_mesh = {"tensor_parallel": types.SimpleNamespace(size=lambda: 2)}
    why = refusal(trainer, module)
    assert why.startswith("tensor_parallel_size=2: tensor parallelism leaves some gradients partial")
    assert "ModelParallelStrategy(tensor_parallel_size=1)" in why and "GradientRelease" in why
    trainer.strategy._device_mesh = {"tensor_parallel": types.SimpleNamespace(size=lambda: 1)}
    assert refusal(trainer, module) is None
    module, data, _ = _gpt()
    module.automatic_optimization = False
    with pytest.raises(ValueError, match="manual optimization"):
        _trainer(tmp_path, [FusedOptimizerStep()], max_steps=1).fit(module, data)
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match="LBFGS re-evaluates the loss"):
        fuse_optimizer_step(torch.optim.LBFGS(model.parameters()))
    shared = list(model.parameters())
    with pytest.raises(ValueError, match=r"A parameter of shape \(4, 4\) is in two optimizers"):
        fuse_optimizer_step([torch.optim.SGD(shared, lr=0.1), torch.optim.SGD(shared[:1], lr=0.1)])
    module, _, batch = _gpt()
    with pytest.raises(ValueError, match="cannot accumulate gradients"):
        estimate_memory(module, batch, device="cpu", lever="fused_step", accumulating=True)


def test_fp16_scaler_is_refused(tmp_path):
    """fp16 AMP with its grad scaler (Lightning gives CUDA one; here it is given on the CPU)."""
    module, data, _ = _gpt()
    scaled = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    trainer = _trainer(tmp_path, [FusedOptimizerStep()], max_steps=1, plugins=[scaled])
    with pytest.raises(ValueError, match='precision="16-mixed" scales the loss'):
        trainer.fit(module, data)


class _Losses2(_Losses):
    """Losses, and a layer of the optimizer frozen as training starts, unfrozen at the second batch (as
    BackboneFinetuning does)."""

    def on_train_start(self, trainer, pl_module) -> None:
        pl_module.model.blocks[0].requires_grad_(False)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == 1:
            pl_module.model.blocks[0].requires_grad_(True)


class _Optimi(GPTLightningModule):
    """The example on torch-optimi's Kahan-summed AdamW, built for its per-parameter step."""

    def configure_optimizers(self):
        config = super().configure_optimizers()
        groups = [dict(g, gradient_release=True) for g in config["optimizer"].param_groups]
        config["optimizer"] = optimi.AdamW(groups, lr=groups[0]["lr"], kahan_sum=True, gradient_release=True)
        config["lr_scheduler"]["scheduler"].optimizer = config["optimizer"]
        return config


@pytest.mark.parametrize("case", ["unfrozen", "optimi"])
def test_the_hooks_follow_what_trains(case, tmp_path):
    """A layer frozen at the start and unfrozen at the second batch gets its own hook then (else every
    other parameter's step() would step it again while its gradient waits); torch-optimi's AdamW, which
    counts steps per group, is stepped through its per-parameter path with the live learning rate (the
    warm-up schedule moves it every step; Lightning's optimizer_to_device copies the group optimi keeps).
    Both train as without the fused step."""
    results = []
    for fused in (False, True):
        torch.manual_seed(0)
        module = _Optimi("tiny", max_steps=4) if case == "optimi" else GPTLightningModule("tiny", max_steps=4)
        data = GPTDataModule(batch_size=B, seq_len=T, num_sentences=300)
        losses = _Losses2() if case == "unfrozen" else _Losses()
        callbacks = [losses, *([FusedOptimizerStep()] if fused else [])]
        _trainer(tmp_path / str(fused), callbacks, max_steps=4).fit(module, data)
        results.append((torch.stack(losses.losses), [p.detach() for p in module.parameters()]))
    assert torch.equal(results[0][0], results[1][0])
    for a, b in zip(results[0][1], results[1][1], strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match=r"optimi.AdamW\(..., gradient_release=True\)"):
        fuse_optimizer_step(optimi.AdamW(torch.nn.Linear(2, 2).parameters(), lr=0.1))


def test_the_swapped_optimizer_is_the_one_stepped_and_hooks_go_on_failure(tmp_path):
    """OptimizerSwap installs its choice at the first batch, after on_train_start: the fused step hooks
    that one (its 8-bit state steps), not the configured AdamW. A fit that fails leaves no hook behind,
    for either lever."""
    module, data, _ = _gpt()
    swap = OptimizerSwap(budget=27_000_000)  # AdamW's fused step needs 29.5 MB, 8-bit AdamW's fits
    trainer = _trainer(tmp_path, [swap, FusedOptimizerStep()], max_steps=2)
    trainer.fit(module, data)
    (optimizer,) = trainer.optimizers
    assert swap.choice.name == "adamw8bit" and isinstance(optimizer, bnb.optim.AdamW8bit)
    assert {int(s["step"]) for s in optimizer.state.values()} == {2}

    class Fail(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if batch_idx == 1:
                raise RuntimeError("stop")

    for lever in (FusedOptimizerStep(), GradientRelease()):
        module, data, _ = _gpt()
        trainer = _trainer(tmp_path, [lever, Fail()], max_steps=3)
        with pytest.raises(RuntimeError, match="stop"):
            trainer.fit(module, data)
        assert not any(p._post_accumulate_grad_hooks for p in module.parameters())
        assert not trainer.optimizers[0]._optimizer_step_post_hooks


@pytest.mark.slow  # planning-heavy: the full run's tier
def test_autofit_meets_a_budget_below_adamws_static_floor(tmp_path):
    """13 MB is below what AdamW's parameters, gradients and state take on their own (14.0 MB): AutoFit
    beside FusedOptimizerStep keeps AdamW (no gradient is ever whole), plans no accumulation and
    checkpoints the blocks to fit; every real step is within the budget, at the estimate. Its OOM guard
    stays off (it would run a batch again in slices, and each slice's backward would step)."""
    torch.manual_seed(0)
    module = GPTLightningModule("tiny", max_steps=3)
    assert model_static(module, "32-true", "adamw").static > 13_000_000
    fit, peaks = AutoFit(budget=13_000_000, margin=0, cost="flops"), AllocatorPeaks()
    trainer = _trainer(tmp_path, [fit, FusedOptimizerStep(), *peaks.around()], max_steps=3)
    trainer.fit(module, GPTDataModule(batch_size=2, seq_len=T, num_sentences=300))
    plan = fit.plan
    assert (plan.optimizer, plan.micro_batch_size, trainer.accumulate_grad_batches) == ("adamw", 2, 1)
    assert plan.checkpointing != "none" and len(peaks.peaks) == 3
    assert fit._guard is None  # no OOM recovery by slices: each slice's backward would step
    assert max(peaks.peaks) <= 13_000_000
    assert max(peaks.peaks[1:]) == pytest.approx(plan.estimated_peak, rel=0.01)
