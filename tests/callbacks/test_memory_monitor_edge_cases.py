"""MemoryMonitor at its edges: sparse batches, an error of its own tracker inside the step, two monitors
in one Trainer, ``fast_dev_run``, and the end-of-fit report's warning."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from helpers import Losses, cpu_trainer
from torch import nn

import lightning_memkit.callbacks._fit_end as fit_end
from lightning_memkit import AutoFit, MemoryMonitor, OptimizerSwap, estimate_memory, measure
from lightning_memkit._estimating.lightning_step import batch_slice, repeat_rows, rows
from lightning_memkit._measuring.storages import leaves, rounded
from lightning_memkit._measuring.tracker import Tracker
from lightning_memkit.callbacks._twins import batch_signature
from lightning_memkit.testing import AllocatorPeaks, allocator_peak

N, D = 64, 128

SPARSE = {
    "coo": lambda d: d.to_sparse(),
    "csr": lambda d: d.to_sparse_csr(),
    "csc": lambda d: d.to_sparse_csc(),
    "bsr": lambda d: d.to_sparse_bsr((4, 4)),
    "bsc": lambda d: d.to_sparse_bsc((4, 4)),
}


def _dense(seed: int, density: float = 0.1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, D, generator=g) * (torch.rand(N, D, generator=g) < density)


class SparseInput(pl.LightningModule):
    """A regression on batches whose input is a sparse tensor of ``layout``, made dense in the step."""

    def __init__(self, layout: str) -> None:
        super().__init__()
        self.layout = layout
        self.net = nn.Sequential(nn.Linear(D, 64), nn.ReLU(), nn.Linear(64, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return ((self.net(x.to_dense()).squeeze(-1) - y) ** 2).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        data = [(SPARSE[self.layout](_dense(i)), torch.randn(N)) for i in range(4)]
        return torch.utils.data.DataLoader(data, batch_size=None)


def _fit_losses(tmp_path: Path, model: Callable[[], pl.LightningModule], *monitors, ckpt_path=None, **kwargs):
    """Fit ``model()``, built and trained from the same seed, on one CPU (`helpers.cpu_trainer`);
    the trainer and its losses."""
    losses = Losses()
    torch.manual_seed(0)
    module = model()
    trainer = cpu_trainer(tmp_path, [*monitors, losses], **kwargs)
    trainer.fit(module, ckpt_path=ckpt_path)
    return trainer, losses.losses


def _internal_errors(caught) -> list[str]:
    return [str(w.message) for w in caught if "MemoryMonitor" in str(w.message)]


# --- item 2: sparse batches, and the tracker's own errors ------------------------------------------


@pytest.mark.parametrize("layout", ["csr", "csc", "bsr"])
def test_a_compressed_sparse_batch_trains_as_without_the_monitor(tmp_path, layout):
    """``Cannot access storage of SparseCsrTensorImpl`` was raised in the user's ``to_dense()``."""
    _, plain = _fit_losses(tmp_path / "plain", lambda: SparseInput(layout))
    monitor = MemoryMonitor(plot=False, summary=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer, watched = _fit_losses(tmp_path / "watched", lambda: SparseInput(layout), monitor)
    assert trainer.global_step == 4
    assert len(watched) == len(plain) == 4
    assert all(torch.equal(a, b) for a, b in zip(plain, watched, strict=True))
    assert _internal_errors(caught) == []
    assert len(monitor.history) == 4 and monitor.measured_steps == 4  # every batch has its own nnz


@pytest.mark.parametrize("layout", list(SPARSE))
def test_sparse_members_count_as_the_allocator_sees_them(layout):
    """A sparse tensor made in the step and live at its peak holds its indices and values there: the
    allocator's (the profiler's) peak has them, and so must the measurement (COO's were left out: 3 %
    low; the compressed layouts raised). The conversion's own buffers are inside its kernel, where no op
    shows them: the step peaks later, in the backward, where they are gone."""
    model = nn.Linear(D, 2048)
    x = _dense(0, density=0.5)

    def step():
        s = SPARSE[layout](x)
        model(s.to_dense()).relu().sum().backward()
        model.zero_grad(set_to_none=True)
        del s

    step()  # warm up: lazy initialisations are not the step's
    truth = allocator_peak(step)
    with measure(model) as m:
        step()
    assert abs(m.peak - truth) <= 0.001 * truth, f"{layout}: measured {m.peak} vs allocator {truth}"


@pytest.mark.parametrize("layout", list(SPARSE))
def test_sparse_rows_and_repeats_are_the_dense_ones(layout):
    """The planners cut and repeat batches along dim 0: sparse tensors cannot be sliced (as_strided) or
    concatenated in their compressed layouts, which crashed AutoFit on such a batch."""
    x = _dense(1, density=0.3)[:16]
    s = SPARSE[layout](x)
    piece, twice = rows(s, 4, 12), repeat_rows(s, 2)
    assert piece.layout == twice.layout == s.layout
    assert torch.equal(piece.to_dense(), x[4:12]) and torch.equal(twice.to_dense(), torch.cat([x, x]))


class SparseBatches(SparseInput):
    """`SparseInput` with a batch size attribute for AutoFit, its batches collated into ``layout``."""

    def __init__(self, layout: str, batch_size: int = 16) -> None:
        super().__init__(layout)
        self.batch_size = batch_size

    def train_dataloader(self):
        x = torch.randn(N, D) * (torch.arange(D) % 8 == 0)  # every micro-batch holds as many non-zeros
        data = torch.utils.data.TensorDataset(x, torch.randn(N))
        convert = SPARSE[self.layout]

        def collate(samples):
            return convert(torch.stack([x for x, _ in samples])), torch.stack([y for _, y in samples])

        return torch.utils.data.DataLoader(data, batch_size=self.batch_size, collate_fn=collate)


@pytest.mark.parametrize(
    "layout",
    [pytest.param("coo", marks=pytest.mark.slow), "csr", pytest.param("bsr", marks=pytest.mark.slow)],
)
def test_autofit_plans_a_sparse_batch_and_the_run_fits_the_plan(tmp_path, layout):
    """AutoFit raised in its planning (``aten::as_strided`` on SparseCPU; ``Sparse CSR tensors do not have
    is_contiguous``). At a budget the batch of 16 does not fit, it cuts the micro-batch, and the steps peak
    on the allocator above its estimate by at most the micro-batch's own bytes (torch's fake twin of a
    sparse tensor has no non-zeros), within the budget."""
    torch.manual_seed(0)
    module = SparseBatches(layout)
    batch = next(iter(module.train_dataloader()))
    whole = estimate_memory(module, batch, device="cpu").peak
    half = estimate_memory(module, batch_slice(batch, 8), device="cpu").peak
    assert half < whole
    autofit = AutoFit(budget=int((half + whole) / 2 / 0.9), cost="flops", optimizers=("adamw",))
    peaks = AllocatorPeaks()
    trainer = cpu_trainer(tmp_path, [autofit, *peaks.around()], max_steps=2)
    trainer.fit(module)
    plan = autofit.plan
    assert plan.micro_batch_size < 16 and trainer.global_step == 2
    peak = max(peaks.peaks)
    # A sparse batch's fake twin holds no non-zeros: the estimate misses the micro-batch's own bytes (each
    # member at the CPU allocator's 64-byte alignment), no more
    members = sum(rounded(m.untyped_storage().nbytes(), 64) for m in leaves(batch_slice(batch, 8)[0]))
    assert plan.estimated_peak <= peak <= plan.estimated_peak + members
    assert peak <= plan.budget.usable  # what the margin is for


class SparseMatmul(SparseBatches):
    """Multiplies the compressed batch itself, as sparse-input models do (no ``to_dense`` first)."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        first = self.net[0]
        h = (x @ first.weight.T) + first.bias
        return ((self.net[1:](h).squeeze(-1) - y) ** 2).mean()


@pytest.mark.parametrize("layout", ["csr", pytest.param("csc", marks=pytest.mark.slow)])
def test_a_step_that_multiplies_a_compressed_batch_is_planned(tmp_path, layout):
    """``Sparse CSR tensors do not have strides``: the kernel check read a sparse operand's strides. And
    OptimizerSwap at a budget that changes nothing changed the losses: the dataloader it built for the
    first batch drew this dataset's random data from torch's RNG before the streams were kept."""
    _, plain = _fit_losses(tmp_path / "plain", lambda: SparseMatmul(layout))
    for callback in (AutoFit(budget="1000GB", cost="flops"), OptimizerSwap(budget="1000GB")):
        trainer, planned = _fit_losses(
            tmp_path / type(callback).__name__, lambda: SparseMatmul(layout), callback
        )
        assert trainer.global_step == 4
        assert all(torch.equal(a, b) for a, b in zip(plain, planned, strict=True))


def test_sparse_batches_with_different_non_zeros_are_no_twins():
    """Their members' sizes are their memory: a step reusing the twin of another nnz was off by it."""
    a, b = SPARSE["csr"](_dense(0, 0.1)), SPARSE["csr"](_dense(0, 0.3))
    assert a.shape == b.shape
    assert batch_signature((a,)) != batch_signature((b,))
    assert batch_signature((a,)) == batch_signature((SPARSE["csr"](_dense(0, 0.1)),))


class _Boom(RuntimeError):
    pass


def test_an_error_in_the_trackers_bookkeeping_never_reaches_the_step(tmp_path, monkeypatch):
    """The tracker's own failure inside an op: the op's result goes back untouched, the monitor warns once
    and stops, and training is bit-identical to a run without it."""
    from models import EncoderLM

    _, plain = _fit_losses(tmp_path / "plain", lambda: EncoderLM(n_layer=1))

    def broken(self):
        raise _Boom("bookkeeping exploded")

    monkeypatch.setattr(Tracker, "_check_peak", broken)
    monitor = MemoryMonitor(plot=False, summary=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer, watched = _fit_losses(tmp_path / "watched", lambda: EncoderLM(n_layer=1), monitor)
    assert trainer.global_step == 4
    assert all(torch.equal(a, b) for a, b in zip(plain, watched, strict=True))
    said = _internal_errors(caught)
    assert len(said) == 1 and "stops monitoring" in said[0] and "bookkeeping exploded" in said[0], said
    assert monitor.history == []


def test_an_error_in_a_saved_tensor_hook_never_reaches_the_step(monkeypatch):
    """The same inside autograd's pack hook: the step's gradients are those of an unwatched step, and the
    measurement says it failed instead of giving a figure."""
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1)), torch.randn(8, 16)
    model(x).sum().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    records = Tracker.records

    def broken(self, t, *, preexisting=False):
        if self.clock > 0:  # inside the step: the pack and gradient hooks, not the set-up
            raise _Boom("pack exploded")
        return records(self, t, preexisting=preexisting)

    monkeypatch.setattr(Tracker, "records", broken)
    with measure(model) as m:
        model(x).sum().backward()
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), expected, strict=True))
    assert isinstance(m.failure, _Boom)
    with pytest.raises(RuntimeError, match=r"failed inside the step, which ran on untouched: _Boom\('pack"):
        m.breakdown  # noqa: B018


# --- item 10: two monitors ---------------------------------------------------------------------------


def test_two_monitors_checkpoint_and_resume_each_their_own(tmp_path):
    """Lightning refused them: "Found more than one stateful callback of type `MemoryMonitor`"."""
    from models import EncoderLM

    def monitors():
        return MemoryMonitor(plot=False, summary=False), MemoryMonitor(
            budget="1GiB", log_every_n_steps=2, plot=False, summary=False
        )

    first = monitors()
    assert first[0].state_key != first[1].state_key
    _fit_losses(tmp_path, lambda: EncoderLM(n_layer=1), *first, max_steps=3, enable_checkpointing=True)
    ckpt = next(Path(tmp_path).rglob("*.ckpt"))
    checkpoint = torch.load(ckpt, weights_only=False)
    states = checkpoint["callbacks"]
    assert states[first[0].state_key] == first[0].state_dict()
    # Tell their states apart: the second's history as saved is a made-up one.
    made_up = [[7, 1, 2, 3, 4, 5]]
    states[first[1].state_key] = {"history": made_up}
    torch.save(checkpoint, ckpt)

    resumed = monitors()
    _fit_losses(tmp_path, lambda: EncoderLM(n_layer=1), *resumed, max_steps=5, ckpt_path=str(ckpt))
    assert resumed[0].history[:3] == first[0].history
    assert [s for s, _ in resumed[0].history] == [0, 1, 2, 3, 4]
    assert resumed[1].history[0][0] == 7 and resumed[1].history[0][1].peak == 15
    assert [s for s, _ in resumed[1].history] == [7, 3, 4]

    # A checkpoint written before the monitor had a state key: the only monitor takes its history.
    states["MemoryMonitor"] = states.pop(first[0].state_key)
    del states[first[1].state_key]
    torch.save(checkpoint, ckpt)
    alone = MemoryMonitor(plot=False, summary=False)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*callbacks used to create the checkpoint")
        _fit_losses(tmp_path, lambda: EncoderLM(n_layer=1), alone, max_steps=4, ckpt_path=str(ckpt))
    assert alone.history[:3] == first[0].history


# --- item 12: fast_dev_run, the report's warning, integer arguments ----------------------------------


def test_fast_dev_run_writes_no_plot_and_says_so(tmp_path, monkeypatch, lightning_log):
    """``memory.png`` landed in the current directory."""
    from models import EncoderLM

    cwd, root = tmp_path / "cwd", tmp_path / "root"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    trainer = cpu_trainer(root, [(monitor := MemoryMonitor(summary=False))], fast_dev_run=2)
    trainer.fit(EncoderLM(n_layer=1))
    assert len(monitor.history) == 2
    assert list(tmp_path.rglob("memory.png")) == []
    assert "no memory plot (memory.png) under `fast_dev_run`" in lightning_log.text


def test_the_report_warning_names_the_path(tmp_path, monkeypatch):
    from models import EncoderLM

    def full(*args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr(fit_end, "plot_history", full)
    trainer = cpu_trainer(tmp_path, [MemoryMonitor(summary=False)], max_steps=1)
    with pytest.warns(UserWarning, match="could not write its end-of-fit report") as caught:
        trainer.fit(EncoderLM(n_layer=1))
    path = Path(trainer.logger.log_dir) / "memory.png"
    message = next(str(w.message) for w in caught if "end-of-fit" in str(w.message))
    assert f"({path})" in message and "No space left" in message


def test_numpy_integers_are_whole_numbers_and_bools_are_not():
    monitor = MemoryMonitor(remeasure_every_n_steps=np.int64(3), log_every_n_steps=np.int64(2))
    assert monitor.remeasure_every_n_steps == 3 and type(monitor.remeasure_every_n_steps) is int
    assert monitor.log_every_n_steps == 2 and type(monitor.log_every_n_steps) is int
    with pytest.raises(TypeError, match="remeasure_every_n_steps"):
        MemoryMonitor(remeasure_every_n_steps=True)
    with pytest.raises(TypeError, match="remeasure_every_n_steps"):
        MemoryMonitor(remeasure_every_n_steps=2.0)
