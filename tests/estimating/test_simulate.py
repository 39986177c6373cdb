"""`estimate_memory` against the allocator's record of the same step run for real, on CPU.

Each accuracy test builds a twin of the estimated model with the same seed, runs its step for real and
reads the peak from torch.profiler's memory timeline (`allocator_peak`): the issue's target is 3 %.
"""

import functools
import math

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from models import EncoderLM, encoder_step
from torch import nn
from torch.profiler import ProfilerActivity, profile
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_memkit import Sharding, Step, TimelineEvent, estimate_memory
from lightning_memkit._estimating import analytic
from lightning_memkit._estimating.optimizer_state import adamw_state_bytes
from lightning_memkit.demos.gpt import GPT, GPTConfig, GPTLightningModule
from lightning_memkit.testing import AllocatorPeaks, allocator_peak, profile_peak

TOLERANCE = 0.03  # the target: |estimate - allocator| <= 3 %


def _assert_close(estimate: int, truth: int) -> None:
    error = (estimate - truth) / truth
    assert abs(error) <= TOLERANCE, f"estimate {estimate:,} vs allocator {truth:,} ({100 * error:+.2f} %)"


def _lm_loss(output, target):
    logits = output[0] if isinstance(output, tuple) else output  # GPT returns (logits, loss)
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def _tokens(batch=16, seq_len=128, vocab=256):
    x = torch.randint(0, vocab, (batch, seq_len), generator=torch.Generator().manual_seed(0))
    return x, x.roll(-1, 1)


# --------------------------------------------------------------------------------------------------
# Accuracy
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("first_step", [True, False], ids=["first-step", "steady"])
def test_torch_transformer_encoder_stack_with_adamw(first_step):
    """A model we did not write (torch's nn.TransformerEncoderLayer), as a plain module."""
    _, _, real_step = encoder_step()
    if not first_step:
        real_step()  # AdamW's state exists from the second step on
    truth = allocator_peak(real_step)
    model, optimizer, _ = encoder_step()
    estimate = estimate_memory(
        model, _tokens(8, 64), optimizer=optimizer, loss_fn=_lm_loss, device="cpu", first_step=first_step
    )
    _assert_close(estimate.peak, truth)
    assert estimate.activations > estimate.parameters  # a 64-token encoder step is activation-bound
    assert (estimate.optimizer_state > 0) is not first_step  # the first step peaks before AdamW's state


def _trainer_peak(module, batch, precision, index, trainer_kwargs):
    x, y = batch
    loader = DataLoader(TensorDataset(x.repeat(index + 1, 1), y.repeat(index + 1, 1)), batch_size=len(x))
    probe = AllocatorPeaks()
    trainer_kwargs.update(max_steps=index + 1, logger=False, precision=precision, callbacks=probe.around())
    pl.Trainer(**trainer_kwargs).fit(module, loader)
    return probe.peaks[index]


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.slow
def test_gpt_lightning_module_against_a_real_trainer_step(precision, trainer_kwargs):
    """The demo's own training_step and configure_optimizers (AdamW, 2 groups, LambdaLR), as Trainer runs
    them: training_step, zero_grad, backward, step, with the previous step's gradients live."""
    batch = _tokens(8, 128)
    torch.manual_seed(0)
    truth = _trainer_peak(GPTLightningModule("tiny", max_steps=10), batch, precision, 1, trainer_kwargs)
    estimate = estimate_memory(GPTLightningModule("tiny"), batch, precision=precision, device="cpu")
    _assert_close(estimate.peak, truth)
    assert estimate.gradients > 0  # live from the previous step through this step's forward


def test_bf16_true_gpt():
    """Lightning's bf16-true: bf16 parameters and inputs, the default dtype bf16 during the forward."""
    config = GPTConfig.from_name("tiny")
    torch.manual_seed(0)
    twin = GPT(config).bfloat16()
    adamw = torch.optim.AdamW(twin.parameters())
    x, y = _tokens(8, 64)

    def step():
        torch.set_default_dtype(torch.bfloat16)
        try:
            loss = _lm_loss(twin(x), y)
        finally:
            torch.set_default_dtype(torch.float32)
        loss.backward()
        adamw.step()
        adamw.zero_grad()

    step()
    truth = allocator_peak(step)
    model = GPT(config)
    estimate = estimate_memory(
        model, (x, y), optimizer="adamw", loss_fn=_lm_loss, precision="bf16-true", device="cpu"
    )
    _assert_close(estimate.peak, truth)
    assert estimate.parameters == 2 * model.num_parameters()
    assert estimate.optimizer_state == 2 * estimate.parameters + 4 * len(list(model.parameters()))


def test_torch_encoder_as_a_lightning_module(trainer_kwargs):
    batch = _tokens(8, 64)
    torch.manual_seed(0)
    truth = _trainer_peak(EncoderLM(), batch, "32-true", 1, trainer_kwargs)
    _assert_close(estimate_memory(EncoderLM(), batch, device="cpu").peak, truth)


def test_accumulating_micro_batch_against_a_trainer_with_accumulation(trainer_kwargs):
    """With ``accumulate_grad_batches=2`` a cycle peaks in its last micro-batch, whose backward adds to
    the gradients already there before the optimizer steps: ``accumulating=True`` simulates that one."""
    x, y = batch = _tokens(8, 64)
    loader = DataLoader(TensorDataset(x.repeat(4, 1), y.repeat(4, 1)), batch_size=len(x))
    probe = AllocatorPeaks()
    trainer_kwargs.update(max_steps=2, logger=False, accumulate_grad_batches=2, callbacks=probe.around())
    torch.manual_seed(0)
    pl.Trainer(**trainer_kwargs).fit(EncoderLM(n_layer=1), loader)  # four profiled micro-batches: one layer
    truth = max(probe.peaks[2:])  # the second cycle: the optimizer state exists
    accumulating = estimate_memory(EncoderLM(n_layer=1), batch, device="cpu", accumulating=True)
    _assert_close(accumulating.peak, truth)
    assert estimate_memory(EncoderLM(n_layer=1), batch, device="cpu").peak < accumulating.peak


def test_mlp_with_sgd():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512))
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(64, 512), torch.randn(64, 512)

    def step():
        F.mse_loss(model(x), y).backward()
        sgd.step()
        sgd.zero_grad()

    truth = allocator_peak(step)
    estimate = estimate_memory(model, (x, y), optimizer=sgd, loss_fn=F.mse_loss, device="cpu")
    _assert_close(estimate.peak, truth)
    assert estimate.optimizer_state == 0


def test_full_checkpointing_matches_a_checkpointed_twin():
    config = GPTConfig.from_name("tiny", n_layer=3)
    torch.manual_seed(0)
    twin = GPT(config)
    for block in twin.blocks:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    adamw = torch.optim.AdamW(twin.parameters())
    x, y = _tokens(8, 128)

    def step():
        _lm_loss(twin(x), y).backward()
        adamw.step()
        adamw.zero_grad()

    step()
    truth = allocator_peak(step)
    model = GPT(config)
    kwargs = dict(optimizer="adamw", loss_fn=_lm_loss, device="cpu")
    full = estimate_memory(model, (x, y), checkpointing="full", **kwargs)
    _assert_close(full.peak, truth)
    assert full.activations < estimate_memory(model, (x, y), **kwargs).activations / 4
    assert "forward" not in model.blocks[0].__dict__  # the wrapping is undone


# --------------------------------------------------------------------------------------------------
# No allocation, no side effects
# --------------------------------------------------------------------------------------------------


def test_meta_device_model_is_planned_without_allocating():
    # GPT-2's width and vocabulary, 2 of its 12 layers (a profile 6x shorter, still far over the bound
    # below); its configure_optimizers reads trainer.estimated_stepping_batches, and there is no trainer.
    with torch.device("meta"):
        module = GPTLightningModule(GPTConfig.from_name("gpt2", n_layer=2))
    n_params = sum(p.numel() for p in module.parameters())
    x = torch.zeros(1, 128, dtype=torch.long, device="meta")
    box = {}

    def run():
        box["estimate"] = estimate_memory(module, (x, x), device="cpu")

    # Every real CPU allocation the estimate makes. Python stacks are left out of this profile: recording
    # them through the fake tensors' Python dispatch would take minutes, and allocations need none.
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    allocated = profile_peak(prof)
    estimate = box["estimate"]
    assert estimate.parameters == 4 * n_params  # 53,561,088 fp32 parameters: 214 MB, never allocated
    assert estimate.optimizer_state == adamw_state_bytes([tuple(p.shape) for p in module.parameters()])
    assert allocated < 32 * 2**20, allocated
    assert all(p.is_meta for p in module.parameters())


def test_the_users_model_is_left_untouched():
    torch.manual_seed(0)
    module = GPTLightningModule("tiny", max_steps=10).eval()
    params = list(module.parameters())
    before = [(p.data_ptr(), p.detach().clone()) for p in params]
    optimizer = torch.optim.AdamW(module.parameters())
    estimate_memory(module, _tokens(2, 16), optimizer=optimizer, precision="bf16-true", device="cpu")
    assert list(module.parameters()) == params
    for p, (ptr, value) in zip(params, before, strict=True):
        assert p.data_ptr() == ptr and torch.equal(p, value) and p.dtype == torch.float32
        assert p.grad is None
    assert not optimizer.state  # read for its hyperparameters, never stepped
    assert not module.training and not any(m.training for m in module.modules())
    assert module._trainer is None and "log" not in module.__dict__


# --------------------------------------------------------------------------------------------------
# Devices, optimizers, timeline
# --------------------------------------------------------------------------------------------------


def test_cuda_target_rounds_blocks_uses_foreach_and_keeps_step_counters_on_cpu():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(100, 300), nn.GELU(), nn.Linear(300, 10))
    batch = (torch.randn(8, 100), torch.randint(0, 10, (8,)))
    estimate = estimate_memory(
        model, batch, optimizer="adamw", loss_fn=F.cross_entropy, device="cuda", timeline=True
    )
    timeline = estimate.timeline
    blocks = [math.ceil(4 * p.numel() / 512) * 512 for p in model.parameters()]  # caching allocator
    assert estimate.parameters == sum(blocks)
    assert estimate.optimizer_state == 2 * sum(blocks)  # exp_avg, exp_avg_sq; "step" lives on the CPU
    assert any(e.op.startswith("aten._foreach") for e in timeline if e.phase == "optimizer")
    cpu_timeline = estimate_memory(
        model, batch, optimizer="adamw", loss_fn=F.cross_entropy, device="cpu", timeline=True
    ).timeline
    assert not any(e.op.startswith("aten._foreach") for e in cpu_timeline)


def test_timeline_peaks_at_the_breakdowns_peak():
    estimate = estimate_memory(GPTLightningModule("tiny"), _tokens(4, 64), device="cpu", timeline=True)
    timeline = estimate.timeline
    assert all(isinstance(e, TimelineEvent) for e in timeline)
    assert max(e.live for e in timeline) == estimate.peak
    phases = [e.phase for e in timeline]  # zero_grad(set_to_none=True) runs no op
    assert sorted(set(phases), key=phases.index) == ["forward", "backward", "optimizer"]
    # The timeline rides along: the breakdown's value, dict and repr are the five categories'.
    plain = estimate_memory(GPTLightningModule("tiny"), _tokens(4, 64), device="cpu")
    assert plain.timeline is None
    assert plain == estimate and hash(plain) == hash(estimate)
    assert plain.as_dict() == estimate.as_dict() and "timeline" not in repr(estimate)


@pytest.mark.parametrize(
    "keywords",
    [
        {
            "precision": "bf16-mixed",
            "checkpointing": "full",
            "accumulating": True,
            "lever": "release_gradients",
        },
        {"sharding": Sharding(2, reshard_after_forward=False)},
    ],
)
def test_a_step_value_estimates_as_its_keywords(keywords):
    module, batch = GPTLightningModule("tiny"), _tokens(2, 32)
    given = estimate_memory(module, batch, device="cpu", **keywords)
    assert estimate_memory(module, batch, device="cpu", step=Step.of(**keywords)) == given
    with pytest.raises(TypeError, match="give step= or precision, not both"):
        estimate_memory(module, batch, step=Step.of(**keywords), precision="16-mixed")


@pytest.mark.parametrize("name", ["adamw", "sgd_momentum", "adafactor", "adamw8bit", "lion8bit"])
def test_optimizer_state_by_name_equals_the_analytic_bytes(name):
    module = GPTLightningModule("tiny")
    estimate = estimate_memory(module, _tokens(2, 32), optimizer=name, device="cpu")
    shapes = [tuple(p.shape) for p in module.parameters()]
    assert estimate.optimizer_state == analytic.optimizer_state_bytes(name, shapes)


def test_a_factory_optimizer_is_built_over_the_fake_parameters():
    model = nn.Linear(64, 64)
    factory = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
    estimate = estimate_memory(
        model, (torch.randn(4, 64), torch.randn(4, 64)), optimizer=factory, loss_fn=F.mse_loss, device="cpu"
    )
    assert estimate.optimizer_state == 4 * (64 * 64 + 64)  # one momentum buffer per parameter


# --------------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------------


def test_errors_name_the_valid_choices():
    model, batch = nn.Linear(4, 4), (torch.randn(2, 4), torch.randn(2, 4))
    kwargs = dict(optimizer="adamw", loss_fn=F.mse_loss)
    with pytest.raises(ValueError, match=r"Unknown precision 'bf16'; valid: 64-true, 32-true.*bf16-true"):
        estimate_memory(model, batch, precision="bf16", **kwargs)
    with pytest.raises(ValueError, match=r"Unknown optimizer 'adam'; valid: adamw.*Did you mean 'adamw'"):
        estimate_memory(model, batch, optimizer="adam", loss_fn=F.mse_loss)
    with pytest.raises(ValueError, match="Unknown device 'mps'; valid: cuda, cpu"):
        estimate_memory(model, batch, device="mps", **kwargs)
    with pytest.raises(ValueError, match="Unknown checkpointing 'some'"):
        estimate_memory(model, batch, checkpointing="some", **kwargs)
    with pytest.raises(ValueError, match="Found no repeated blocks"):
        estimate_memory(model, batch, checkpointing="full", **kwargs)
    with pytest.raises(TypeError, match="needs loss_fn="):
        estimate_memory(model, batch, optimizer="adamw")
    with pytest.raises(TypeError, match="needs optimizer="):
        estimate_memory(model, batch, loss_fn=F.mse_loss)
    assert model.weight.grad is None


def test_cublas_workspaces_follow_torchs_sizes(monkeypatch):
    """Two workspaces (the forward's thread and the autograd engine's), each as torch sizes it: the
    environment's ``:SIZE:COUNT`` pairs (KiB), else 32 MiB; counted in every CUDA estimate's temporaries,
    never on the CPU, and on a model built under ``torch.device("meta")`` too."""
    from lightning_memkit._estimating.fake_tracker import cublas_workspace_bytes

    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:2:16:8")
    assert cublas_workspace_bytes() == 2 * (4096 * 1024 * 2 + 16 * 1024 * 8)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
    assert cublas_workspace_bytes() == 2 * 32 * 2**20  # no CUDA initialized here: the larger size
    model, x = nn.Linear(8, 8), torch.randn(4, 8)
    loss_fn = lambda out, _: out.sum()  # noqa: E731
    on_cpu = estimate_memory(model, (x, None), optimizer="sgd", loss_fn=loss_fn, device="cpu")
    on_cuda = estimate_memory(model, (x, None), optimizer="sgd", loss_fn=loss_fn, device="cuda")
    assert on_cpu.temporary < 2**20 <= 64 * 2**20 <= on_cuda.temporary < 65 * 2**20
    with torch.device("meta"):
        meta = estimate_memory(model, (x, None), optimizer="sgd", loss_fn=loss_fn, device="cuda")
    assert meta.temporary == on_cuda.temporary
