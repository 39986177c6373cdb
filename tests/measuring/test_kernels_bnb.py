"""bitsandbytes' optimizer steps on the CPU: their fp32 working copies, made inside one custom op where no
dispatch mode sees them, measured, simulated and monitored as the allocator counts them."""

from __future__ import annotations

import functools
import warnings

import lightning.pytorch as pl
import pytest
import torch
from models import MLPModule
from torch import nn

from lightning_memkit import MemoryMonitor, estimate_memory, measure
from lightning_memkit._measuring.kernels import _WORKER, _coarse, hides_memory
from lightning_memkit.testing import AllocatorPeaks, allocator_peak

bnb = pytest.importorskip("bitsandbytes")

#: class name -> the name `estimate_memory` knows it by
OPTIMIZERS = {
    "AdamW8bit": "adamw8bit",
    "Lion": "lion",
    "Lion8bit": "lion8bit",
    "PagedAdamW8bit": "paged_adamw8bit",
}


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():  # PagedAdamW8bit on the CPU: "falling back to non-paged"
        warnings.filterwarnings("ignore", message="Paged optimizers are not supported on CPU")
        yield


def _build(name: str, dtype: torch.dtype = torch.float32, **options):
    """An MLP whose weights take the 8-bit update (over 4096 elements) and biases the 32-bit one."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 128)).to(dtype)
    opt = getattr(bnb.optim, name)(model.parameters(), lr=1e-3, **options)
    return model, opt, torch.randn(16, 128, dtype=dtype)


def _loss(out, _):
    return out.float().sum()


def _plain_steps(model, opt, x):
    def step():
        _loss(model(x), None).backward()
        opt.step()
        opt.zero_grad()

    return step


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.slow
def test_measure_matches_the_allocator_at_step_0_and_later(name, one_thread):
    """The update dequantizes the state into fp32 copies and works on a copy of the gradient: -49 %
    (AdamW8bit), -33 % (Lion) without them."""
    model, opt, x = _build(name)
    step = _plain_steps(model, opt, x)
    truth0 = allocator_peak(step)  # step 0: the state is created, then updated
    twin, twin_opt, _ = _build(name)
    twin_step = _plain_steps(twin, twin_opt, x)
    with measure(twin, twin_opt) as m0:
        twin_step()
    assert m0.peak == pytest.approx(truth0, rel=1e-3)
    step()
    truth = allocator_peak(step)  # step 2 on the profiled model; step 2 measured on the twin
    twin_step()
    with measure(twin, twin_opt) as m:
        twin_step()
    assert m.peak == pytest.approx(truth, rel=1e-3)
    b = m.breakdown
    assert b.parameters + b.gradients + b.optimizer_state + b.activations + b.temporary == m.peak


@pytest.mark.parametrize(
    "name, dtype, options",
    [("AdamW8bit", torch.bfloat16, {"weight_decay": 0.1}), ("LAMB", torch.float32, {"max_unorm": 1.0})],
    ids=["AdamW8bit-bf16", "LAMB-trust-ratio"],
)
def test_parameter_dtypes_and_options_that_change_the_update(name, dtype, options, one_thread):
    """bf16 parameters: the update casts the gradient and the parameter to fp32 as well; LAMB's trust
    ratio takes a norm of the update; a learning rate that changes every step. As the allocator counts."""
    model, opt, x = _build(name, dtype, **options)
    step = _plain_steps(model, opt, x)
    for _ in range(2):
        step()
    for i in range(2):
        for group in opt.param_groups:
            group["lr"] = 1e-3 / (i + 2)
        truth = allocator_peak(step)
        with measure(model, opt) as m:
            step()
        # The next step measured is a later one: the same bytes.
        assert m.peak == pytest.approx(truth, rel=1e-3)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_estimate_matches_the_allocator(name, one_thread):
    model, opt, x = _build(name)
    step = _plain_steps(model, opt, x)
    estimate = estimate_memory(model, (x, None), optimizer=OPTIMIZERS[name], loss_fn=_loss, device="cpu")
    step()
    truth = allocator_peak(step)  # a step with the state in place: the one the estimate is of
    assert estimate.peak == pytest.approx(truth, rel=0.01)


def _mlp(name: str | None = None) -> MLPModule:
    """`MLPModule` 128 -> 256 -> 1 on 48 rows in batches of 16, with the bitsandbytes optimizer of class
    ``name`` (``None``: torch's AdamW, for AutoFit to swap)."""
    optimizer = "adamw" if name is None else functools.partial(getattr(bnb.optim, name), lr=1e-3)
    return MLPModule(128, 256, samples=48, batch_size=16, optimizer=optimizer)


@pytest.mark.parametrize("name", ["AdamW8bit", "Lion"])
def test_memory_monitor_in_a_trainer_matches_the_allocator(name, trainer_kwargs, one_thread):
    """Every step, the first (state created) and those after: -11.85 % and -7.25 % without the fix."""
    monitor = MemoryMonitor(plot=False, summary=False)
    probe = AllocatorPeaks()
    trainer = pl.Trainer(callbacks=probe.around(monitor), **{**trainer_kwargs, "max_steps": 3})
    trainer.fit(_mlp(name))
    assert len(monitor.history) == len(probe.peaks) == 3
    for step, ((_, b), truth) in enumerate(zip(monitor.history, probe.peaks, strict=True)):
        assert b.peak == pytest.approx(truth, rel=0.01), f"step {step}"


@pytest.mark.parametrize("name", ["adamw8bit", "lion"])
@pytest.mark.slow  # planning-heavy
def test_autofit_plans_the_peak_the_swapped_optimizer_reaches(name, trainer_kwargs, one_thread):
    """AutoFit's plan for a swapped-in bitsandbytes optimizer: -62 % (AdamW8bit), -45 % (Lion) without."""
    from lightning_memkit.callbacks.auto_fit import AutoFit

    torch.manual_seed(0)
    autofit = AutoFit(budget=4_000_000, cost="flops", optimizers=[name], checkpointing=("none",))
    monitor, probe = MemoryMonitor(plot=False, summary=False), AllocatorPeaks()
    trainer = pl.Trainer(callbacks=[autofit, *probe.around(monitor)], **{**trainer_kwargs, "max_steps": 3})
    trainer.fit(_mlp())
    assert autofit.plan.optimizer == name and autofit.plan.accumulate_grad_batches == 1
    for step, ((_, b), truth) in enumerate(zip(monitor.history, probe.peaks, strict=True)):
        assert b.peak == pytest.approx(truth, rel=0.01), f"step {step}"
    assert autofit.plan.estimated_peak == pytest.approx(max(probe.peaks[1:]), rel=0.01)


def test_the_helper_is_asked_once_per_shape_not_once_per_step(one_thread):
    """The learning rate and step count are sent coarse (zero or not, their sign, step 1 or later): later
    steps, whatever their scalars, are answered from the cache."""
    update = torch.ops.bitsandbytes.optimizer_update_8bit_blockwise.default
    assert hides_memory(update, ()) and hides_memory(
        torch.ops.bitsandbytes.optimizer_update_32bit.default, ()
    )
    assert not hides_memory(torch.ops.bitsandbytes.quantize_blockwise.default, ())
    assert _coarse(("adam", 0.0, 3e-4, -2.0, 1, 7, True, None)) == ("adam", 0.0, 0.5, -0.5, 1, 2, True, None)
    model, opt, x = _build("Lion8bit")
    step = _plain_steps(model, opt, x)
    for _ in range(2):
        with measure(model, opt):
            step()
    known = len(_WORKER.cache)
    for i in range(2):
        for group in opt.param_groups:
            group["lr"] = 1e-4 * (i + 2)
        with measure(model, opt):
            step()
    assert len(_WORKER.cache) == known
