"""Packed sequences (``pack_padded_sequence``) into an LSTM or GRU on the CPU. Their packed path runs the
cell step by step on slices of the hidden state, and autograd sums the slices' gradients: in place when the
engine holds the only reference, but out of place under any dispatch mode, so the watched step held one
more buffer at its peak (measured 4.5 % high, LSTM batch 8; 4.1 % GRU). And the simulation stopped: the
packing's ``batch_sizes`` was a fake tensor that the recurrent kernels read on the host, and
``pad_packed_sequence`` writes the lengths it returns through ``data_ptr``."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from helpers import cpu_trainer, steady_step_and_estimate
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence
from torch.utils.data import DataLoader

from lightning_memkit import MemoryMonitor, estimate_memory, measure, plan_fit
from lightning_memkit.testing import AllocatorPeaks, allocator_peak

VOCAB, SEQ = 100, 32
#: Batch 8 (batch 4's peak is elsewhere in the step, and read exact before the fix as well); the quick tier
#: runs one of the two.
AT_BATCH_8 = [pytest.param(nn.LSTM, 8, marks=pytest.mark.slow), (nn.GRU, 8)]


class PackedTagger(nn.Module):
    """An embedding, a 2-layer recurrent net over the packed batch, padded back, and a per-token head."""

    def __init__(self, rnn: type[nn.RNNBase]) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 64)
        self.rnn = rnn(64, 128, num_layers=2, batch_first=True)
        self.head = nn.Linear(128, VOCAB)

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:  # (B, T) -> (B, T, VOCAB)
        ids, lengths = batch
        packed = pack_padded_sequence(self.embed(ids), lengths, batch_first=True, enforce_sorted=False)
        out, _ = pad_packed_sequence(self.rnn(packed)[0], batch_first=True, total_length=ids.shape[1])
        return self.head(out)


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())  # padding: -100, ignored


def _batch(batch_size: int, seed: int = 0) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Token ids of lengths SEQ/4 to SEQ (on the CPU, as packing needs), labels -100 past each length."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch_size, SEQ), generator=g)
    lengths = torch.randint(SEQ // 4, SEQ + 1, (batch_size,), generator=g)
    labels = torch.randint(0, VOCAB, (batch_size, SEQ), generator=g)
    labels[torch.arange(SEQ) >= lengths[:, None]] = -100
    return (ids, lengths), labels


def test_the_engines_gradient_sums_count_as_made_in_place():
    """The cause, alone: a 1 MiB activation whose gradient is summed from four slices. Unwatched, the
    engine adds each slice's gradient into the sum in place; watched, out of place (3 MiB at once, where
    the plain step holds 2): the measurement read 30.7 % high."""
    torch.manual_seed(0)
    layer, x = nn.Linear(16, 64), torch.randn(4096, 16)

    def step() -> None:
        h = layer(x)  # (4096, 64)
        sum(h[:n].sum() for n in (4096, 3072, 2048, 1024)).backward()

    step()
    truth = allocator_peak(step)
    with measure(layer) as measured:
        step()
    assert measured.peak == pytest.approx(truth, rel=1e-3)


@pytest.mark.parametrize(("rnn", "batch_size"), AT_BATCH_8)
def test_measure_is_the_allocators_peak(rnn, batch_size):
    torch.manual_seed(0)
    model = PackedTagger(rnn)
    optimizer = torch.optim.AdamW(model.parameters())
    inputs, labels = _batch(batch_size)

    def step() -> None:
        _loss(model(inputs), labels).backward()
        optimizer.step()
        optimizer.zero_grad()

    step()  # the optimizer's state exists from here on
    truth = allocator_peak(step)
    with measure(model, optimizer) as measured:
        step()
    breakdown = measured.breakdown
    assert breakdown.peak == pytest.approx(truth, rel=1e-3)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert breakdown.parameters == params
    assert breakdown.optimizer_state == pytest.approx(2 * params, rel=1e-3)  # AdamW's two moments
    assert breakdown.activations > 0 and breakdown.temporary > 0


@pytest.mark.parametrize(("rnn", "batch_size"), AT_BATCH_8)
def test_the_estimate_is_the_allocators_steady_step(rnn, batch_size):
    torch.manual_seed(0)
    model = PackedTagger(rnn)
    optimizer = torch.optim.AdamW(model.parameters())
    truth, estimate = steady_step_and_estimate(model, _batch(batch_size), optimizer, _loss)
    assert estimate == pytest.approx(truth, rel=1e-3)
    assert "_pad_packed_sequence" not in vars(torch._VF)  # the simulation's stand-in is gone again


class PackedModule(pl.LightningModule):
    def __init__(self, rnn: type[nn.RNNBase], batch_size: int = 4) -> None:
        super().__init__()
        self.batch_size = batch_size
        torch.manual_seed(0)
        self.model = PackedTagger(rnn)

    def training_step(self, batch, batch_idx):
        ids, lengths, labels = batch
        return _loss(self.model((ids, lengths)), labels)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        (ids, lengths), labels = _batch(4 * self.batch_size)
        return DataLoader(list(zip(ids, lengths, labels, strict=True)), batch_size=self.batch_size)


@pytest.mark.slow  # Trainer fits: the full run's tier
@pytest.mark.parametrize("rnn", [nn.LSTM, nn.GRU])
def test_the_monitor_and_the_estimate_are_the_allocators_every_step(rnn, tmp_path):
    """Every logged step within 0.1 % of the allocator's, and the estimate of the second batch within
    0.1 % of its step. The batches have one shape and different lengths, so their memory differs: a
    batch's signature is its shapes, and the monitor reused the first steady step's figures for the
    next ones (1.8 % and 0.5 % high). A step that packs by lengths is measured every time, and says so."""
    peaks = AllocatorPeaks()
    monitor = MemoryMonitor(plot=False, summary=False)  # re-measuring alike steps every 100
    trainer = cpu_trainer(tmp_path, peaks.around(monitor))
    module = PackedModule(rnn)
    with pytest.warns(UserWarning, match=r"sizes tensors by the values.*_pack_padded_sequence.*every step"):
        trainer.fit(module)
    assert len(monitor.history) == len(peaks.peaks) == monitor.measured_steps == 4
    for (_, measured), truth in zip(monitor.history, peaks.peaks, strict=True):
        assert measured.peak == pytest.approx(truth, rel=1e-3)
    second = list(module.train_dataloader())[1]  # the first step has no AdamW state yet
    estimate = estimate_memory(module, second, device="cpu")
    assert estimate.peak == pytest.approx(peaks.peaks[1], rel=1e-3)


@pytest.mark.slow  # plans: the full run's tier
def test_a_plan_fits_a_packed_lstm():
    """The planners simulate the step as `estimate_memory` does: they stopped with "data is not allocated
    yet" too. A budget the full batch fits: the plan keeps it, and its peak is the estimate's."""
    module = PackedModule(nn.LSTM, batch_size=8)
    batch = next(iter(module.train_dataloader()))
    estimate = estimate_memory(module, batch, device="cpu", optimizer="adamw")
    budget = int(estimate.peak * 1.2)
    plan = plan_fit(module, batch, budget, margin=0.01, device="cpu", cost="flops", optimizers=["adamw"])
    assert plan.micro_batch_size == 8 and plan.accumulate_grad_batches == 1
    assert plan.estimated_peak == estimate.peak <= budget * 0.99
