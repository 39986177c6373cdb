"""Every zoo model (tests/zoo.py: Hugging Face families at their defaults, a ResNet with BatchNorm) against
the allocator: the monitor on each Trainer step, the estimate, and AutoFit's plan at a tight budget.
Checkpointing on the zoo is in test_checkpointing_hf.py."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from helpers import cpu_trainer
from zoo import MODELS, ZooModule, zoo_batch

from lightning_memkit import AutoFit, MemoryMonitor, estimate_memory
from lightning_memkit.testing import AllocatorPeaks

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")

NAMES = list(MODELS)


def _fit(
    module: pl.LightningModule, callbacks: list, tmp_path, max_steps: int, precision: str = "32-true"
) -> pl.Trainer:
    trainer = cpu_trainer(tmp_path, callbacks, max_steps, precision=precision)
    trainer.fit(module)
    return trainer


@pytest.mark.slow  # the zoo sweep and planning-heavy checks: the full run's tier
@pytest.mark.parametrize("name", NAMES)
def test_monitor_and_estimate_match_the_allocator(name, tmp_path):
    """MemoryMonitor within 0.1 % of the allocator on every Trainer step, estimate_memory within 1 % of the
    steady steps (the previous step's gradients alive through the forward, as in Lightning's order)."""
    module = ZooModule(name)
    estimate = estimate_memory(module, zoo_batch(name), device="cpu")
    peaks, monitor = AllocatorPeaks(), MemoryMonitor(plot=False, summary=False)
    _fit(module, peaks.around(monitor), tmp_path, max_steps=2)
    assert len(monitor.history) == len(peaks.peaks) == 2
    for (_, measured), truth in zip(monitor.history, peaks.peaks, strict=True):
        assert measured.peak == pytest.approx(truth, rel=1e-3)
    assert estimate.peak == pytest.approx(max(peaks.peaks[1:]), rel=0.01)


# Every kind once: an encoder-decoder with a dict batch and the cache on (T5), a decoder with the cache on
# (Qwen2, the LLaMA family), and an image model, the CNN with BatchNorm in bf16 (its oneDNN reorders).
# BERT, GPT-2, GPT-NeoX, ViT and the fp32 CNN add no kind of step here that these and the monitor test above
# do not cover, for 7-8 s of planning each (`tests/checkpointing/test_checkpointing_hf.py` plans every zoo
# model).
AUTOFIT = [
    ("t5", "32-true"),
    ("qwen2", "32-true"),
    ("resnet", "bf16-true"),
    ("mixtral", "32-true"),  # mixture-of-experts: AutoFit crashed in its first simulation (grouped matmul)
]


@pytest.mark.slow  # the zoo sweep and planning-heavy checks: the full run's tier
@pytest.mark.parametrize(("name", "precision"), AUTOFIT)
def test_autofit_at_a_tight_budget_keeps_the_global_batch_and_fits(name, precision, tmp_path):
    """A budget 45 % of the way from the static memory to the naive peak: AutoFit plans (micro-batch,
    accumulation, checkpointing), the global batch is kept, and every real step fits. bf16 weights on the
    CPU: the oneDNN reorders are in the plan (its estimate read -13 % before)."""
    global_batch = 4
    module = ZooModule(name, batch_size=global_batch, n_batches=8)  # enough micro-batches for 2 steps
    naive = estimate_memory(module, zoo_batch(name, global_batch), precision=precision, device="cpu")
    static = naive.parameters + naive.gradients + naive.optimizer_state
    budget = int(static + 0.45 * (naive.peak - static))
    # A 1 % margin, so that an estimate a few percent low shows; the model's own AdamW only, and per-block
    # plans of none and full only (the optimizer search and the planner's other modes on these models are
    # tested elsewhere, and each doubles the plan's time).
    autofit = AutoFit(
        budget=budget, margin=0.01, cost="flops", optimizers=["adamw"], checkpointing=("none", "full")
    )
    peaks, callback = AllocatorPeaks(), autofit
    trainer = _fit(module, [callback, *peaks.around()], tmp_path, max_steps=2, precision=precision)
    plan = callback.plan
    assert plan.micro_batch_size * plan.accumulate_grad_batches == global_batch
    assert trainer.accumulate_grad_batches == 1  # the user's, back after the fit
    assert plan.micro_batch_size < global_batch or plan.checkpointing != "none"  # it had to do something
    assert len(peaks.peaks) == 2 * plan.accumulate_grad_batches
    assert max(peaks.peaks) <= budget


def test_zoo_models_keep_their_defaults():
    """The zoo is what users bring: the decoders keep Hugging Face's key/value cache on."""
    for name in ("qwen2", "gpt_neox", "gpt2", "t5"):
        assert ZooModule(name).model.config.use_cache is True
    assert torch.is_tensor(zoo_batch("bert")["attention_mask"])


class _Losses(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(outputs["loss"].detach().clone())


@pytest.mark.parametrize("name", ["bert", "qwen2", "resnet"])
def test_the_monitor_leaves_the_run_bit_identical(name, tmp_path):
    """Observe-only: with MemoryMonitor (every step measured, the kernel helper asked, saved-tensor hooks
    composed) the losses, parameters, buffers (BatchNorm statistics) and RNG stream are those of the run
    without it, bit for bit. bert has dropout; qwen2 Hugging Face's cache; resnet BatchNorm and
    convolutions."""
    runs = []
    for callbacks in ([], [MemoryMonitor(plot=False, summary=False, remeasure_every_n_steps=1)]):
        pl.seed_everything(0)
        module, losses = ZooModule(name), _Losses()
        _fit(module, [*callbacks, losses], tmp_path, max_steps=3)
        runs.append((losses.losses, module.state_dict(), torch.get_rng_state()))
    (losses, state, rng), (losses_m, state_m, rng_m) = runs
    assert len(losses) == 3 and all(torch.equal(a, b) for a, b in zip(losses, losses_m, strict=True))
    assert state.keys() == state_m.keys() and all(torch.equal(state[k], state_m[k]) for k in state)
    assert torch.equal(rng, rng_m)
