"""OptimizerOffload / offload_optimizer (issue 15, lever 4): the optimizer's state, fp32 master weights and
gradient accumulation in host memory. With fp32 weights training is bit-identical to the plain step
(accumulation, the GPT example's two param groups and schedule, clipping); with bf16 weights the update is
the fp32 masters' and survives a resume exactly; on the CPU (host = device) the allocator's peak is what
`estimate_memory(lever="offload")` predicts, and for a CUDA target the host's bytes leave the estimate."""

from __future__ import annotations

import json
import re

import bitsandbytes as bnb
import lightning.pytorch as pl
import pytest
import torch
from helpers import Losses, cpu_trainer, run_cli, tiny_gpt
from lightning.pytorch.plugins import MixedPrecision
from torch.utils.data import DataLoader
from zoo import ZooModule, zoo_batch

from lightning_memkit import AutoFit, MemoryMonitor, OptimizerOffload, estimate_memory, offload_optimizer
from lightning_memkit._estimating.fake_tracker import cublas_workspace_bytes
from lightning_memkit.demos.gpt import GPTDataModule, GPTLightningModule
from lightning_memkit.testing import AllocatorPeaks


def _trainer(tmp_path, callbacks, max_steps=3, **kwargs) -> pl.Trainer:
    return cpu_trainer(tmp_path, callbacks, max_steps, **kwargs)


_Losses = Losses


def _gpt():
    return tiny_gpt(max_steps=6)


def _zoo(name: str):
    def make():
        torch.manual_seed(0)
        return ZooModule(name, batch_size=4, seq_len=64, n_batches=6), None, zoo_batch(name, 4, 64)

    return make


def _fit(make, offload: bool, tmp_path, watch: bool = False, **kwargs):
    module, data, batch = make()
    losses, peaks, monitor = _Losses(), AllocatorPeaks(), MemoryMonitor(plot=False, summary=False)
    callbacks = [
        losses,
        *([OptimizerOffload()] if offload else []),
        *(peaks.around(monitor) if watch else []),
    ]
    _trainer(tmp_path / f"{offload}-{watch}", callbacks, **kwargs).fit(module, data)
    if watch:
        for (_, measured), truth in zip(monitor.history, peaks.peaks, strict=True):
            assert measured.peak == pytest.approx(truth, rel=0.001)  # categories sum to the allocator's
    return module, batch, peaks.peaks, torch.stack(losses.losses)


@pytest.mark.parametrize(
    "make",
    [_gpt, _zoo("qwen2"), pytest.param(_zoo("resnet"), marks=pytest.mark.slow)],
    ids=["gpt", "qwen2", "resnet"],
)
@pytest.mark.slow
def test_training_is_bit_identical_and_the_peak_is_as_estimated(make, tmp_path):
    """fp32 weights, two micro-batches per step and gradient clipping: the same losses, parameters and
    buffers (the CNN's BatchNorm statistics) with the optimizer offloaded as without. One micro-batch per
    step, measured: every step's allocator peak as the monitor reports it, the first and steady ones as
    estimated (on the CPU the host is the device: the masters and state count, and the peak is above the
    plain step's)."""
    kwargs = {"accumulate_grad_batches": 2, "gradient_clip_val": 0.5, "max_steps": 2}
    plain, _, _, plain_losses = _fit(make, False, tmp_path, **kwargs)
    offloaded, _, _, offloaded_losses = _fit(make, True, tmp_path, **kwargs)
    assert len(plain_losses) == 4 and torch.equal(offloaded_losses, plain_losses)
    for a, b in zip(offloaded.state_dict().values(), plain.state_dict().values(), strict=True):
        assert torch.equal(a, b)

    module, batch, peaks, _ = _fit(make, True, tmp_path, watch=True)
    first = estimate_memory(module, batch, device="cpu", lever="offload", first_step=True)
    steady = estimate_memory(module, batch, device="cpu", lever="offload")
    assert first.peak == pytest.approx(peaks[0], rel=0.01)
    assert steady.peak == pytest.approx(max(peaks[1:]), rel=0.01)


def test_a_cuda_estimate_leaves_the_host_bytes_out():
    """For a CUDA target the optimizer state and the fp32 masters are not the device's, and the device
    never holds all the gradients; the accumulation's earlier micro-batches wait on the host too."""
    module, _, batch = _gpt()
    for accumulating in (False, True):
        plain = estimate_memory(module, batch, precision="bf16-true", accumulating=accumulating)
        offloaded = estimate_memory(
            module, batch, precision="bf16-true", lever="offload", accumulating=accumulating
        )
        assert plain.optimizer_state > 0 and offloaded.optimizer_state == 0
        assert offloaded.gradients <= plain.gradients / 4
        assert offloaded.peak <= plain.peak - plain.optimizer_state
    with pytest.raises(ValueError, match="Unknown lever 'OptimizerOffload'; valid: release_gradients"):
        estimate_memory(module, batch, lever="OptimizerOffload")  # the callback's name is no lever


@pytest.mark.parametrize(
    "optimizer",
    [
        lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
        lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9),
        lambda p: bnb.optim.AdamW8bit(p, lr=1e-2, min_8bit_size=64),
    ],
    ids=["adamw", "sgd_momentum", "adamw8bit"],
)
def test_plain_loop_trains_as_without_and_keeps_fp32_masters(optimizer):
    """A plain loop with accumulation: fp32 weights train bit-identically offloaded; bf16 weights are the
    fp32 masters rounded, the masters move by steps a bf16 weight would round away, and the state lives
    on the host in the masters' dtype."""

    def run(offload: bool, dtype: torch.dtype):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16)).to(
            dtype
        )
        opt = optimizer(model.parameters())
        handle = offload_optimizer(opt) if offload else None
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            for _ in range(2):
                model(torch.randn(8, 16, generator=g).to(dtype)).square().mean().backward()
            assert all(p.grad is None for p in model.parameters()) or not offload
            opt.step()
            opt.zero_grad()
        return model, opt, handle

    plain, _, _ = run(False, torch.float32)
    offloaded, _, handle = run(True, torch.float32)
    for a, b in zip(plain.parameters(), offloaded.parameters(), strict=True):
        assert torch.equal(a, b)
    handle.remove()

    model, opt, handle = run(True, torch.bfloat16)
    masters = [m for g in opt.param_groups for m in g["params"]]
    assert all(m.dtype == torch.float32 for m in masters)
    for p, m in zip(model.parameters(), masters, strict=True):
        assert torch.equal(p, m.to(torch.bfloat16))
    assert any(not torch.equal(m, m.to(torch.bfloat16).float()) for m in masters)  # below bf16's resolution
    handle.remove()
    assert [p for g in opt.param_groups for p in g["params"]] == list(model.parameters())
    state = opt.state[next(model.parameters())]
    assert all(v.device.type == "cpu" for v in state.values() if isinstance(v, torch.Tensor))


def test_bf16_weights_are_updated_as_the_fp32_master_recipe():
    """The GPT example in bf16 for 10 steps: offloaded, the weights are bit for bit those of the textbook
    mixed-precision recipe written by hand (fp32 masters, fp32 gradients, AdamW on the masters, the
    weights the masters rounded)."""

    def model():
        torch.manual_seed(0)
        return GPTLightningModule("tiny").model.to(torch.bfloat16)

    def batches():
        g = torch.Generator().manual_seed(1)
        for _ in range(10):
            x = torch.randint(0, 256, (4, 32), generator=g)
            yield x, x.roll(-1, 1)

    offloaded = model()
    optimizer = torch.optim.AdamW(offloaded.parameters(), lr=3e-3, weight_decay=0.1)
    offload_optimizer(optimizer)
    for x, y in batches():
        offloaded(x, y)[1].backward()
        optimizer.step()
        optimizer.zero_grad()

    by_hand = model()
    masters = [p.detach().float().clone() for p in by_hand.parameters()]
    optimizer = torch.optim.AdamW(masters, lr=3e-3, weight_decay=0.1)
    for x, y in batches():
        by_hand(x, y)[1].backward()
        for p, master in zip(by_hand.parameters(), masters, strict=True):
            master.grad, p.grad = p.grad.float(), None
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            for p, master in zip(by_hand.parameters(), masters, strict=True):
                p.copy_(master.to(p.dtype))
    for a, b in zip(offloaded.parameters(), by_hand.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_weight_changed_outside_the_optimizer_reaches_its_master(tmp_path):
    """Weight clipping between steps (in a plain loop, and in a callback of a Trainer) and a second fit
    after ``load_state_dict`` with the callback reused: the change is taken into the master before the
    next update, so training is what it is without offloading."""
    for offload in (False, True):
        torch.manual_seed(0)
        lin = torch.nn.Linear(4, 1)
        optimizer = torch.optim.SGD(lin.parameters(), lr=0.1)
        handle = offload_optimizer(optimizer) if offload else None
        for _ in range(2):
            lin(torch.ones(1, 4)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            with torch.no_grad():
                lin.weight.clamp_(-0.01, 0.01)
        if handle is None:
            plain = lin.weight.detach().clone()
    assert torch.equal(lin.weight, plain)

    class Clamp(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            with torch.no_grad():
                pl_module.model.lm_head.weight.clamp_(-0.02, 0.02)

    results = []
    for callbacks in ([], [OptimizerOffload()]):
        module, data, _ = _gpt()
        start = {k: v.clone() for k, v in module.state_dict().items()}
        _trainer(tmp_path / str(len(results)), [Clamp(), *callbacks], max_steps=2).fit(module, data)
        module.load_state_dict(start)  # the same callbacks, a second fit from the start
        losses = Losses()
        _trainer(tmp_path / f"{len(results)}b", [Clamp(), losses, *callbacks], max_steps=2).fit(module, data)
        results.append((torch.stack(losses.losses), [p.detach() for p in module.parameters()]))
    assert torch.equal(results[0][0], results[1][0])
    for a, b in zip(results[0][1], results[1][1], strict=True):
        assert torch.equal(a, b)


@pytest.mark.slow
def test_resume_keeps_the_fp32_masters_and_the_state(tmp_path):
    """bf16-true on one batch seen over and over: four steps straight, or two, a checkpoint and two
    resumed, give the same losses and weights, because the checkpoint carries the fp32 masters the bf16
    weights are rounded from, and the optimizer state is loaded onto the host masters (Lightning is handed
    the param groups only, so nothing of the state is put on the device first). Resumed from the rounded
    weights alone (the masters taken out of the checkpoint), the run differs; resumed at its last step (a
    fit that trains nothing), a checkpoint saved then still holds the state and the masters."""
    _, _, batch = _gpt()
    data = DataLoader([batch] * 8, batch_size=None)

    def fit(max_steps, ckpt=None, callbacks=()):
        torch.manual_seed(0)
        module, losses = GPTLightningModule("tiny", max_steps=6), _Losses()
        trainer = _trainer(
            tmp_path / str(len(list(tmp_path.iterdir()))), [OptimizerOffload(), losses, *callbacks],
            max_steps=max_steps, precision="bf16-true",
        )  # fmt: skip
        trainer.fit(module, data, ckpt_path=ckpt)
        return trainer, module, torch.tensor(losses.losses)

    _, straight, straight_losses = fit(4)
    trainer, _, _ = fit(2)
    ckpt = tmp_path / "two.ckpt"
    trainer.save_checkpoint(ckpt)
    saved = torch.load(ckpt, weights_only=False)
    (key,) = [k for k in saved["callbacks"] if "OptimizerOffload" in k]
    assert all(m.dtype == torch.float32 for m in saved["callbacks"][key]["masters"])

    trainer, resumed, losses = fit(4, ckpt)
    assert len(losses) == 2 and torch.equal(losses, straight_losses[2:])
    for a, b in zip(resumed.parameters(), straight.parameters(), strict=True):
        assert torch.equal(a, b)
    state = trainer.optimizers[0].state_dict()["state"][0]
    assert state["step"] == 4 and state["exp_avg"].dtype == torch.float32

    # Resumed at its last step, a fit trains nothing and installs nothing: a checkpoint saved then still
    # holds the state and the masters it was resumed from.
    trainer, _, losses = fit(2, ckpt)
    trainer.save_checkpoint(tmp_path / "again.ckpt")
    again = torch.load(tmp_path / "again.ckpt", weights_only=False)
    assert len(losses) == 0 and again["optimizer_states"][0]["state"][0]["step"] == 2
    pairs = zip(again["callbacks"][key]["masters"], saved["callbacks"][key]["masters"], strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)

    saved["callbacks"][key] = {}
    torch.save(saved, tmp_path / "rounded.ckpt")
    _, rounded, _ = fit(4, tmp_path / "rounded.ckpt")
    assert any(
        not torch.equal(a, b) for a, b in zip(rounded.parameters(), straight.parameters(), strict=True)
    )


def test_refuses_what_it_cannot_serve(tmp_path):
    """Several processes, the fp16 scaler and manual optimization are refused as the fit starts, each
    with the reason and what to use instead; a failed fit leaves no hook behind."""
    module, data, _ = _gpt()
    try:
        with pytest.raises(
            ValueError, match=r"OptimizerOffload cannot run here: DDPStrategy reduces.*ZeRO-Offload"
        ):
            _trainer(tmp_path, [OptimizerOffload()], max_steps=1, strategy="ddp").fit(module, data)
    finally:  # DDP's one-process group outlives the refused fit: the next test in this process starts its own
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    scaled = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match='precision="16-mixed" unscales'):
        _trainer(tmp_path, [OptimizerOffload()], max_steps=1, plugins=[scaled]).fit(module, data)
    module.automatic_optimization = False
    with pytest.raises(ValueError, match="manual optimization"):
        _trainer(tmp_path, [OptimizerOffload()], max_steps=1).fit(module, data)

    class Fail(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if batch_idx == 1:
                raise RuntimeError("stop")

    module, data, _ = _gpt()
    trainer = _trainer(tmp_path, [OptimizerOffload(), Fail()], max_steps=3)
    with pytest.raises(RuntimeError, match="stop"):
        trainer.fit(module, data)
    assert not any(p._post_accumulate_grad_hooks for p in module.parameters())
    (optimizer,) = trainer.optimizers
    assert not optimizer._optimizer_step_post_hooks
    assert {id(p) for g in optimizer.param_groups for p in g["params"]} == {
        id(p) for p in module.parameters()
    }


@pytest.mark.slow  # the zoo sweep and planning-heavy checks: the full run's tier
def test_autofit_plans_the_offloaded_step_with_accumulation(tmp_path):
    """AutoFit beside OptimizerOffload plans the offloaded step, which may accumulate (the gradients sum on
    the host): every micro-batch's real peak is within the budget and the highest at the estimate (on
    the CPU the host's masters and state count: host and device are one memory)."""
    torch.manual_seed(0)
    module = GPTLightningModule("tiny", max_steps=3)
    fit, peaks = AutoFit(budget=25_000_000, margin=0, cost="flops"), AllocatorPeaks()
    trainer = _trainer(tmp_path, [fit, OptimizerOffload(), *peaks.around()], max_steps=3)
    trainer.fit(module, GPTDataModule(batch_size=8, seq_len=64, num_sentences=300))
    plan = fit.plan
    assert (plan.lever, plan.optimizer, plan.micro_batch_size, plan.accumulate_grad_batches) == (
        "offload", "adamw", 4, 2,
    )  # fmt: skip
    assert len(peaks.peaks) == 6 and max(peaks.peaks) <= 25_000_000
    assert max(peaks.peaks[2:]) == pytest.approx(plan.estimated_peak, rel=0.01)
    assert plan.host_bytes > 0 and plan.offload_seconds == 0  # nothing travels on the CPU


@pytest.mark.slow  # the zoo sweep and planning-heavy checks: the full run's tier
def test_memkit_plan_relaxes_what_was_left_open_and_offloads_where_nothing_else_fits():
    """The tiny GPT with AdamW on a card nothing fits without a lever at any precision beside cuBLAS's
    64 MiB of workspaces (static floors 13.4 MiB at 32-true, 8.4 MiB with bf16 weights and the Kahan-summed
    AdamW, 10.0 MiB fused): memkit plan tries the levers and precisions left open and keeps AdamW, its
    weights in fp32 where that fits, by offloading the optimizer; it says what the plan gives up and prints
    OptimizerOffload in both Trainers. With --precision 32-true forced on a smaller card it says no, with
    the floor; without, it plans bf16 weights on fp32 masters (AdamW, not its Kahan twin)."""
    argv = ["plan", "--model", "tiny", "--margin", "0", "--global-batch", "8", "--seq-len", "32"]
    argv += ["--optimizer", "adamw"]
    status, out, err = run_cli([*argv, "--gpu", "613.6MB"])
    assert status == 0, err
    assert "Nothing fits at 32-true without a step lever; this plan gives up:" in out
    assert "of host memory" in out and "optimizer adamw, 32-true" in out
    # the offload's time beside the compute's, so its share shows
    assert re.search(r"update add about [0-9.e+-]+ s per global batch to [0-9.e+-]+ s of compute", out)
    status, out, _ = run_cli([*argv, "--gpu", "613.6MB", "--json"])
    report = json.loads(out)
    assert (report["lever"], report["optimizer"], report["precision"]) == (
        "offload",
        "adamw",
        "32-true",
    )
    assert report["accumulate_grad_batches"] > 1  # the offloaded optimizer accumulates on the host
    # the static floor would not fit beside cuBLAS's workspaces
    assert report["estimated_peak"] <= report["limit"] < 13_360_000 + cublas_workspace_bytes()
    # fp32 masters, their gradients and AdamW's two moments, 16 B for each of the 875,264 parameters, and
    # the 53 parameter tensors' step counters
    assert report["host_bytes"] == 16 * 875_264 + 4 * 53
    assert "OptimizerOffload()]" in report["code"] and "callbacks=[OptimizerOffload(), " in report["code"]

    status, out, err = run_cli([*argv, "--gpu", "611.6MB", "--precision", "32-true"])
    assert status == 2 and "No plan fits" in err and "Static floor (parameters" in err
    assert "at 32-true with OptimizerOffload: no plan fits" in err
    status, out, err = run_cli([*argv, "--gpu", "611.6MB", "--json"])
    report = json.loads(out)
    assert (report["lever"], report["optimizer"], report["precision"]) == (
        "offload",
        "adamw",
        "bf16-true",
    )
    assert any(
        "bf16-true instead of 32-true (the update runs on fp32 master weights" in g
        for g in report["gives_up"]
    )
    # bf16 weights asked for: the fused step cannot take AdamW there (no Kahan twin inside backward), which
    # rules that set-up out, not the search
    status, out, err = run_cli([*argv, "--gpu", "611.6MB", "--precision", "bf16-true", "--json"])
    assert status == 0, err
    assert json.loads(out)["lever"] == "offload"
