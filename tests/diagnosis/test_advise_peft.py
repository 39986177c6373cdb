"""advise on adapter fine-tunes (issue 45 item 3): what a LoRA or QLoRA user can still do, with bytes.

Each finding's bytes are the drop of the simulated step's peak with its fix applied, so the tests simulate
the step with and without the fix (`estimate_memory`) and compare; the slow test runs the fixes for real
against the CPU allocator. The frozen base has no gradients and no optimizer state: nothing advises on
them. The adapters here are rank 64, so most of their tensors have the 4096 elements bitsandbytes' 8-bit
optimizers need before they quantize a state (r=8 over the tiny LLaMA's 64 features gives none).
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from helpers import cpu_trainer
from peft_models import SETUPS, TARGETS, AdapterModule, llama, quantized, token_batch
from torch import nn

from lightning_memkit import advise, estimate_memory
from lightning_memkit._breakdown import format_bytes
from lightning_memkit.testing import AllocatorPeaks

#: The kinds of finding an adapter run can have; none of the others (untrained gradients, unused or stale
#: parameters) is the frozen base's.
ADAPTER_KINDS = {"activations", "optimizer_state", "logits", "gradients"}


def _adapted(setup: str, rank: int = 64, batch_size: int = 2) -> AdapterModule:
    """``setup``'s module (tests/peft_models.py) with rank-``rank`` LoRA adapters on the same targets."""
    import peft

    module = AdapterModule(setup, batch_size=batch_size)
    base = llama()
    options = SETUPS[setup]
    if options is not None:
        for parent in list(base.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is nn.Linear and name != "lm_head":
                    setattr(parent, name, quantized(child, options))
    module.model = peft.get_peft_model(base, peft.LoraConfig(r=rank, lora_alpha=16, target_modules=TARGETS))
    return module


@pytest.fixture(scope="module")
def qlora():
    """QLoRA (nf4 base), its batch and its advice on the CPU."""
    module, batch = _adapted("qlora-nf4"), token_batch(2)
    return module, batch, advise(module, batch, device="cpu")


def test_qlora_advice_names_the_8bit_and_paged_optimizer_with_simulated_bytes(qlora):
    module, batch, advice = qlora
    plain = estimate_memory(module, batch, device="cpu")
    eight_bit = estimate_memory(module, batch, device="cpu", optimizer="adamw8bit")
    paged = estimate_memory(module, batch, device="cpu", optimizer="paged_adamw8bit")
    assert advice.breakdown.peak == plain.peak
    finding = advice["optimizer_state"]
    assert finding.saved == plain.peak - eight_bit.peak > 0
    assert finding.saved <= plain.optimizer_state - eight_bit.optimizer_state  # the state is all it saves
    assert "bitsandbytes.optim.AdamW8bit(" in finding.fix and "PagedAdamW8bit" in finding.fix
    assert f"saves {format_bytes(plain.peak - paged.peak)} as simulated" in finding.fix
    assert format_bytes(paged.optimizer_state) in finding.fix
    assert "host RAM only when the GPU runs out" in finding.fix and "on a CPU it pages nothing" in finding.fix
    trained = [p for p in module.parameters() if p.requires_grad]
    frozen = sum(p.numel() for p in module.parameters() if not p.requires_grad)
    assert f"{len(trained)} trainable parameter tensor(s)" in finding.what
    assert f"{frozen:,} frozen elements have no gradient and no state" in finding.what
    large = sum(1 for p in trained if p.numel() >= 4096)
    assert 0 < large < len(trained) and f"{large} of the tensors" in finding.what


def test_qlora_advice_checkpointing_is_its_simulated_saving(qlora):
    module, batch, advice = qlora
    plain = estimate_memory(module, batch, device="cpu")
    checkpointed = estimate_memory(module, batch, device="cpu", checkpointing="full")
    finding = advice["activations"]
    assert finding.saved == plain.peak - checkpointed.peak > 0
    assert "ActivationCheckpointing(checkpointing='full')" in finding.fix
    assert "non-reentrant" in finding.fix and "use_reentrant=True" in finding.fix
    assert "leave out the 4-bit base's matmuls" in finding.fix  # its recompute cost reads low: said so


def test_qlora_advice_says_nothing_about_the_frozen_base(qlora):
    """No finding is the base's: it has no gradients and no optimizer state, and its 4-bit weights are not
    something to quantize again; the gradients and state the findings name are the adapters'."""
    module, _, advice = qlora
    assert {f.kind for f in advice} <= ADAPTER_KINDS
    assert {"activations", "optimizer_state", "logits"} <= {f.kind for f in advice}
    trained = [p for p in module.parameters() if p.requires_grad]
    adapters = sum(p.numel() * p.element_size() for p in trained)
    assert advice.breakdown.gradients <= adapters  # the adapters' gradients, none of the base's
    # AdamW's two fp32 moments and a step counter per adapter tensor, and nothing for the base
    assert advice.breakdown.optimizer_state <= 2 * adapters + 64 * len(trained)
    text = str(advice).lower()
    for advice_on_the_base in ("quantize the", "load_in_4bit", "bitsandbytesconfig", "untrained", "freeze"):
        assert advice_on_the_base not in text
    assert "get_output_embeddings()" in advice["logits"].fix


def test_no_optimizer_finding_where_8_bits_save_nothing():
    """LoRA r=8 over the tiny LLaMA: every adapter tensor is under 4096 elements, where bitsandbytes keeps
    fp32 moments, so the 8-bit optimizer's simulated step saves only torch AdamW's step counters (a 4-byte
    tensor per parameter; bitsandbytes counts in Python) and advise says nothing of it."""
    module, batch = AdapterModule("lora-fp32", batch_size=2), token_batch(2)
    plain = estimate_memory(module, batch, device="cpu")
    eight_bit = estimate_memory(module, batch, device="cpu", optimizer="adamw8bit")
    trained = [p for p in module.parameters() if p.requires_grad]
    assert all(p.numel() < 4096 for p in trained)
    assert plain.optimizer_state - eight_bit.optimizer_state == 4 * len(trained)
    advice = advise(module, batch, device="cpu")
    assert "optimizer_state" not in advice and {f.kind for f in advice} <= ADAPTER_KINDS
    assert "4-bit" not in advice["activations"].fix  # an fp32 base's matmuls are all counted


def test_lora_over_fp32_gets_the_same_optimizer_advice():
    """LoRA over an fp32 base: the same adapters, the same 8-bit saving as over the 4-bit base."""
    module, batch = _adapted("lora-fp32"), token_batch(2)
    advice = advise(module, batch, device="cpu")
    eight_bit = estimate_memory(module, batch, device="cpu", optimizer="adamw8bit")
    assert advice["optimizer_state"].saved == advice.breakdown.peak - eight_bit.peak > 0
    assert {f.kind for f in advice} <= ADAPTER_KINDS


def test_no_optimizer_finding_for_an_8bit_optimizer_or_a_full_fine_tune(qlora):
    module, batch, _ = qlora
    assert "optimizer_state" not in advise(module, batch, device="cpu", optimizer="adamw8bit")
    model = nn.Sequential(nn.Embedding(64, 64), nn.Linear(64, 4096))  # nothing frozen: OptimizerSwap's
    x = torch.randint(0, 64, (2, 8))
    advice = advise(model, (x, x), optimizer="adamw", loss_fn=_loss, device="cpu")
    assert "optimizer_state" not in advice


@pytest.mark.slow  # a fit and the advice again: about 8 s
def test_memory_monitor_advises_a_qlora_run(qlora):
    """``MemoryMonitor(advise=True)`` on the QLoRA fit: the same findings as `advise`, the optimizer's read
    from the Trainer's AdamW, and logged as ``memory/advice/optimizer_state`` (MiB)."""
    from lightning_memkit import MemoryMonitor

    _, _, advice = qlora
    monitor = MemoryMonitor(plot=False, summary=False, advise=True)
    logged = {}

    class Metrics(pl.loggers.Logger):
        name, version = "metrics", 0

        def log_metrics(self, metrics, step=None):
            logged.update(metrics)

        def log_hyperparams(self, *args, **kwargs):
            pass

    trainer = cpu_trainer(None, [monitor], max_steps=1, logger=Metrics())
    trainer.fit(_adapted("qlora-nf4"))
    assert [(f.kind, f.saved) for f in monitor.advice] == [(f.kind, f.saved) for f in advice]
    assert logged["memory/advice/optimizer_state"] == pytest.approx(advice["optimizer_state"].saved / 2**20)


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _steady_peak(module: pl.LightningModule, callbacks=()) -> int:
    """The CPU allocator's highest peak from the second training step on."""
    peaks = AllocatorPeaks()
    trainer = cpu_trainer(None, [*callbacks, *peaks.around()], max_steps=3)
    trainer.fit(module)
    return max(peaks.peaks[1:])


@pytest.mark.slow  # three real runs
def test_qlora_findings_are_what_their_fixes_save_for_real(qlora):
    """The 8-bit optimizer and full checkpointing applied to the real QLoRA run: the allocator's steady peak
    falls by the findings' bytes (±5 %)."""
    from lightning_memkit import ActivationCheckpointing

    _, _, advice = qlora
    plain = _steady_peak(_adapted("qlora-nf4"))
    assert advice.breakdown.peak == pytest.approx(plain, rel=0.01)
    import bitsandbytes as bnb

    eight_bit = _adapted("qlora-nf4")
    trained = [p for p in eight_bit.parameters() if p.requires_grad]
    eight_bit.configure_optimizers = lambda: bnb.optim.AdamW8bit(trained, lr=1e-3)  # the finding's fix
    assert plain - _steady_peak(eight_bit) == pytest.approx(advice["optimizer_state"].saved, rel=0.05)
    checkpointed = _steady_peak(_adapted("qlora-nf4"), [ActivationCheckpointing(checkpointing="full")])
    assert plain - checkpointed == pytest.approx(advice["activations"].saved, rel=0.05)
