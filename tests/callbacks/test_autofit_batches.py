"""Issue 46 items 1, 2 and 5: AutoFit's plan is the run's. The batches the loader really yields are read off
the loader itself (which dimension holds the samples, and whether the batch size attribute reaches it at
all), the first real batch is checked against the plan before the first optimizer step, and a set-up that
fits is kept as the user wrote it."""

from __future__ import annotations

import warnings

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from helpers import cpu_trainer
from lightning.pytorch.loggers import CSVLogger
from models import MLPModule
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from lightning_memkit import MemoryMonitor, plan_fit
from lightning_memkit._estimating.lightning_step import (
    batch_size,
    batch_slice,
    default_axes,
    loader_axes,
    repeat_batch,
)
from lightning_memkit.callbacks.auto_fit import AutoFit


def _fit(tmp_path, module, callbacks, datamodule=None, **overrides):
    trainer = cpu_trainer(tmp_path, callbacks, **{"max_steps": 2, "logger": False, **overrides})
    trainer.fit(module, datamodule=datamodule)
    return trainer


# --- the sample axes, read off batches ----------------------------------------------------------------


def test_sample_axes_follow_the_dimension_that_moves_with_the_batch_size():
    """(T, B) sequences, a (1, T) tensor every sample shares and a scalar: only the moving dimension is
    cut or repeated, and a mismatch is named by the tensors' own names."""
    T = 5

    def batch(b):
        x, y = torch.randn(T, b, 3), torch.zeros(b, dtype=torch.long)
        return {"x": x, "y": y, "pos": torch.arange(T)[None], "scale": torch.tensor(2.0)}

    axes = loader_axes([(batch(8), 8), (batch(4), 4)])
    assert axes == (1, 0, None, None)
    whole = batch(8)
    assert batch_size(whole, axes) == 8
    part = batch_slice(whole, 3, 1, axes)
    assert part["x"].shape == (T, 2, 3) and torch.equal(part["x"], whole["x"][:, 1:3])
    assert part["pos"].shape == (1, T) and part["scale"].dim() == 0
    doubled = repeat_batch(whole, 2, axes)
    assert doubled["x"].shape == (T, 16, 3) and doubled["y"].shape == (16,) and doubled["pos"].shape == (1, T)
    # A loader that ignores the batch size moves nothing.
    assert loader_axes([(batch(8), 8), (batch(8), 4)]) is None
    # Without a loader: dim 0, and a tensor of size 1 there beside larger ones is shared (HF's position_ids).
    hf = {"input_ids": torch.zeros(4, T, dtype=torch.long), "position_ids": torch.arange(T)[None]}
    assert default_axes(hf) == (0, None)
    assert batch_size(hf) == 4
    with pytest.raises(ValueError, match=r"batch\['a'\] 4 \(dim 0\), batch\['b'\] 3 \(dim 0\)"):
        batch_size({"a": torch.zeros(4, 2), "b": torch.zeros(3, 2)})


def test_plan_fit_plans_a_hugging_face_batch_with_position_ids_of_one_row():
    """Refused before as 'got sizes [1, 4]': the (1, T) position_ids are shared by the micro-batches."""
    model = _Positional()
    batch = _Positional.batch(8)
    plan = plan_fit(model, batch, "100TB", device="cpu", cost="flops", micro_batch_size=8)
    assert plan.micro_batch_size * plan.accumulate_grad_batches == 8


# --- loaders that do not read the attribute: refused before any planning ------------------------------


def _rows(n=64):
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 16, generator=g), torch.randn(n, 1, generator=g))


class _Fixed(MLPModule):
    """Its loader hard-codes the batch size: the attribute is there but never read."""

    def train_dataloader(self):
        return DataLoader(_rows(), batch_size=16)


class _PreMade(MLPModule):
    """Batches made beforehand, with DataLoader(batch_size=None)."""

    def train_dataloader(self):
        x, y = _rows().tensors
        return DataLoader(list(zip(x.split(16), y.split(16), strict=True)), batch_size=None)


class _OnceData(L.LightningDataModule):
    """Builds its loader once, in setup(), from the batch size then."""

    def __init__(self, batch_size=16):
        super().__init__()
        self.batch_size = batch_size

    def setup(self, stage):
        self.loader = DataLoader(_rows(), batch_size=self.batch_size)

    def train_dataloader(self):
        return self.loader


class _NoAttribute(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(16, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("case", ["hard-coded", "batch_size=None", "built in setup()"])
def test_a_loader_that_ignores_the_batch_size_is_refused_before_planning(tmp_path, case):
    """AutoFit would set micro-batch 8 x accumulate 2 and every batch would stay 16: refused, in words
    naming the attribute and the fix, before any step (the parameters are untouched)."""
    if case == "built in setup()":
        module, data = _NoAttribute(), _OnceData(16)  # the datamodule's attribute is the one AutoFit sets
    else:
        module, data = (_Fixed if case == "hard-coded" else _PreMade)(samples=64, batch_size=16), None
    before = [p.detach().clone() for p in module.parameters()]
    with pytest.raises(
        ValueError, match=r"does not read it: built with batch_size = 8 or 1, its first batch is the same"
    ):
        _fit(tmp_path, module, [AutoFit(budget="100TB", cost="flops")], data)
    assert all(torch.equal(a, b) for a, b in zip(before, module.parameters(), strict=True))


def test_a_ready_made_loader_gets_its_own_message_before_the_attribute_one(tmp_path):
    """A module without `batch_size` given a DataLoader to fit(): told that a ready-made loader cannot be
    planned, not to set batch_arg_name (which could not help)."""
    data = TensorDataset(torch.randn(32, 16), torch.randn(32, 1))
    trainer = cpu_trainer(tmp_path, [AutoFit(budget="100TB", cost="flops")], max_steps=1, logger=False)
    with pytest.raises(ValueError, match=r"passed to fit\(\) ready-made.*datamodule="):
        trainer.fit(_NoAttribute(), train_dataloaders=DataLoader(data, batch_size=8))


def test_the_first_batch_is_checked_against_the_plan_before_the_first_optimizer_step(tmp_path, monkeypatch):
    """Where the loader got past the reading of its axes (here: that reading skipped), the first real batch
    of 16 against a plan of 8 stops the run before any parameter moves."""
    monkeypatch.setattr(AutoFit, "_sample_axes", lambda self, trainer, module, example, users: (0, 0))
    module = _Fixed(samples=64, batch_size=16)
    budget = _budget_for_half(module)
    before = [p.detach().clone() for p in module.parameters()]
    with pytest.raises(RuntimeError, match=r"planned micro-batch 8 x accumulate 2 .* holds 16 samples"):
        _fit(tmp_path, module, [AutoFit(budget=budget, margin=0.0, cost="flops", checkpointing="none")])
    assert all(torch.equal(a, b) for a, b in zip(before, module.parameters(), strict=True))


def _budget_for_half(module) -> int:
    """A budget whose largest fitting micro-batch of `module`'s 16 is 8: the peak at 8 and at 16, averaged."""
    x, y = _rows().tensors
    plan = plan_fit(module, (x[:16], y[:16]), "100TB", margin=0.0, device="cpu", cost="flops",
                    checkpointing="none")  # fmt: skip
    peaks = {a.micro_batch_size: a.peak for a in plan.alternatives}
    if 8 not in peaks:
        peaks[8] = plan_fit(module, (x[:8], y[:8]), "100TB", margin=0.0, device="cpu", cost="flops",
                            checkpointing="none").estimated_peak  # fmt: skip
    return (peaks[8] + peaks[16]) // 2


# --- the batch axis: an RNN fed (T, B) batches -------------------------------------------------------


class _Sequences(Dataset):
    def __init__(self, n=64, T=24, d=8):
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, T, d, generator=g), torch.randn(n, 1, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def _time_major(samples):
    """torch's RNN layout: (T, B, d) inputs, (B, 1) targets."""
    x, y = zip(*samples, strict=True)
    return torch.stack(x, dim=1), torch.stack(y)


class _LSTM(L.LightningModule):
    def __init__(self, batch_size=16):
        super().__init__()
        self.batch_size = batch_size
        self.rnn = nn.LSTM(8, 64, num_layers=2)
        self.head = nn.Linear(64, 1)
        self.shapes: list[tuple[int, ...]] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.shapes.append(tuple(x.shape))
        out, _ = self.rnn(x)  # (T, B, 64)
        return F.mse_loss(self.head(out[-1]), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        return DataLoader(_Sequences(), batch_size=self.batch_size, collate_fn=_time_major)


def test_an_rnn_fed_time_major_batches_is_planned_along_its_batch_dimension(tmp_path):
    """Planned along time before (micro-batch 16 x 4 of (64, 16) batches, 2.9-3.3x over the budget): the
    micro-batches are cut along dim 1, and each real step is the plan's peak."""
    module = _LSTM(batch_size=16)
    x, y = _time_major([_Sequences()[i] for i in range(16)])
    axes = (1, 0)
    plan = plan_fit(module, (x, y), "100TB", margin=0.0, device="cpu", cost="flops", checkpointing="none",
                    batch_axes=axes)  # fmt: skip
    peaks = {a.micro_batch_size: a.peak for a in plan.alternatives}
    half = plan_fit(module, batch_slice((x, y), 8, axes=axes), "100TB", margin=0.0, device="cpu",
                    cost="flops", checkpointing="none", batch_axes=axes).estimated_peak  # fmt: skip
    assert half < peaks[16]
    budget = (half + peaks[16]) // 2
    monitor = MemoryMonitor()
    autofit = AutoFit(budget=budget, margin=0.0, cost="flops", checkpointing="none")
    _fit(tmp_path, module, [monitor, autofit], max_steps=3, logger=CSVLogger(tmp_path), log_every_n_steps=1)
    assert (autofit.plan.micro_batch_size, autofit.plan.accumulate_grad_batches) == (8, 2)
    assert set(module.shapes) == {(24, 8, 8)}  # (T, micro-batch, d): never cut along time
    steady = [b.peak for _, b in monitor.history[1:]]
    assert steady and all(peak <= budget for peak in steady)
    assert max(steady) == pytest.approx(autofit.plan.estimated_peak, rel=0.01)


# --- an HF-style batch with (1, T) position_ids, through a real loader --------------------------------


class _Positional(L.LightningModule):
    """Token and position embeddings, the position ids a (1, T) tensor as Hugging Face's collators make."""

    T = 16

    def __init__(self, batch_size=8):
        super().__init__()
        self.batch_size = batch_size
        self.tok, self.pos = nn.Embedding(64, 32), nn.Embedding(self.T, 32)
        self.blocks = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 64))
        self.shapes: list[tuple] = []

    @classmethod
    def batch(cls, b):
        ids = torch.randint(0, 64, (b, cls.T), generator=torch.Generator().manual_seed(b))
        return {"input_ids": ids, "position_ids": torch.arange(cls.T)[None]}

    def training_step(self, batch, batch_idx):
        self.shapes.append((tuple(batch["input_ids"].shape), tuple(batch["position_ids"].shape)))
        h = self.tok(batch["input_ids"]) + self.pos(batch["position_ids"])
        logits = self.blocks(h)
        return F.cross_entropy(logits.flatten(0, 1), batch["input_ids"].flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        ids = torch.randint(0, 64, (64, self.T), generator=torch.Generator().manual_seed(0))

        def collate(rows):
            return {"input_ids": torch.stack(rows), "position_ids": torch.arange(self.T)[None]}

        return DataLoader(list(ids), batch_size=self.batch_size, collate_fn=collate)


def test_autofit_plans_a_batch_whose_position_ids_every_sample_shares(tmp_path):
    module = _Positional(batch_size=8)
    full = plan_fit(module, _Positional.batch(8), "100TB", margin=0.0, device="cpu", cost="flops",
                    checkpointing="none")  # fmt: skip
    peaks = {a.micro_batch_size: a.peak for a in full.alternatives}
    half = plan_fit(module, _Positional.batch(4), "100TB", margin=0.0, device="cpu", cost="flops",
                    checkpointing="none").estimated_peak  # fmt: skip
    autofit = AutoFit(budget=(half + peaks[8]) // 2, margin=0.0, cost="flops", checkpointing="none")
    _fit(tmp_path, module, [autofit])
    assert (autofit.plan.micro_batch_size, autofit.plan.accumulate_grad_batches) == (4, 2)
    assert set(module.shapes) == {((4, 16), (1, 16))}


# --- item 5: the user's accumulation is theirs -------------------------------------------------------


def test_a_set_up_that_fits_is_kept_as_written_and_the_run_is_bit_identical(tmp_path):
    """4 x 2 at a budget that changes nothing was merged into 8 x 1 (|dparam| 1.2e-7 after 8 steps): now
    kept, so the run is the one without AutoFit, to the bit."""
    runs = []
    for callbacks in ([], [AutoFit(budget="100TB", cost="flops")]):
        L.seed_everything(0, verbose=False)
        module = MLPModule(batch_size=4, samples=64)
        _fit(tmp_path, module, callbacks, accumulate_grad_batches=2, max_steps=4)
        runs.append((module, callbacks))
    (plain, _), (fitted, (autofit,)) = runs
    assert (autofit.plan.micro_batch_size, autofit.plan.accumulate_grad_batches) == (4, 2)
    assert "kept as set up" in autofit.plan.note
    for a, b in zip(plain.parameters(), fitted.parameters(), strict=True):
        assert torch.equal(a, b)


# --- several loaders: a dict of them, which the fit loop combines --------------------------------------


class _TwoLoaders(MLPModule):
    """Two regression loaders, one of them time-major ((T, B, d) through a collate), as a dict: the fit loop
    combines them into one batch of both."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.shapes: list[tuple] = []

    def training_step(self, batch, batch_idx):
        x, y = batch["rows"]
        seq = batch["seq"]  # (T, B, 16)
        self.shapes.append((tuple(x.shape), tuple(seq.shape)))
        return F.mse_loss(self.net(x), y) + self.net(seq).mean()

    def train_dataloader(self):
        seq = DataLoader(list(torch.randn(64, 3, 16)), batch_size=self.batch_size,
                         collate_fn=lambda rows: torch.stack(rows, dim=1))  # fmt: skip
        return {"rows": DataLoader(_rows(), batch_size=self.batch_size), "seq": seq}


def test_a_dict_of_loaders_is_planned_as_the_fit_loop_combines_them(tmp_path):
    """The first batch was the dict's first key, a string, before: now one batch of each loader, each
    tensor cut along its own sample dimension."""
    module = _TwoLoaders(batch_size=16)
    autofit = AutoFit(budget="100TB", cost="flops")
    _fit(tmp_path, module, [autofit], max_steps=1)
    assert autofit._axes == (0, 0, 1)  # rows' x and y along dim 0, the sequences along dim 1
    assert (autofit.plan.micro_batch_size, autofit.plan.accumulate_grad_batches) == (16, 1)
    assert module.shapes == [((16, 16), (3, 16, 16))]


def test_a_loader_of_one_sample_is_planned_not_refused(tmp_path):
    """At batch size 1 the loader is built again at 2: a dataset of one sample gives one sample either way,
    which is not a loader ignoring the attribute."""

    class One(MLPModule):
        def train_dataloader(self):
            return DataLoader(_rows(1), batch_size=self.batch_size)

    autofit = AutoFit(budget="100TB", cost="flops")
    _fit(tmp_path, One(batch_size=1), [autofit], max_steps=1)
    assert autofit.plan.micro_batch_size == 1


class _RunsOut(_LSTM):
    """`_LSTM` on a device that runs out in the second batch's forward (real tensors only: the planning's
    fake ones pass)."""

    def training_step(self, batch, batch_idx):
        if batch_idx == 1 and not isinstance(batch[0], torch._subclasses.FakeTensor):
            raise torch.OutOfMemoryError("pretend: out of memory")
        return super().training_step(batch, batch_idx)


def test_an_oom_report_plans_along_the_loaders_batch_dimension(tmp_path):
    """The report counted the (T, B) batch's samples along T and planned from a global batch repeated along
    it (so the inputs and targets disagreed and no plan came): now along B, as AutoFit read it."""
    module = _RunsOut(batch_size=16)
    x, y = _time_major([_Sequences()[i] for i in range(16)])
    axes = (1, 0)
    plan = plan_fit(module, (x, y), "100TB", margin=0.0, device="cpu", cost="flops", checkpointing="none",
                    batch_axes=axes)  # fmt: skip
    whole = next(a.peak for a in plan.alternatives if a.micro_batch_size == 16)
    half = plan_fit(module, batch_slice((x, y), 8, axes=axes), "100TB", margin=0.0, device="cpu",
                    cost="flops", checkpointing="none", batch_axes=axes).estimated_peak  # fmt: skip
    budget = (half + whole) // 2  # micro-batch 8 x 2, as in the test above
    autofit = AutoFit(budget=budget, margin=0.0, cost="flops", checkpointing="none", verify_steps=0)
    trainer = cpu_trainer(tmp_path, [autofit], max_steps=3, logger=False)
    with warnings.catch_warnings(record=True) as caught, pytest.raises(torch.OutOfMemoryError):
        warnings.simplefilter("always")
        trainer.fit(module)
    (message,) = [str(w.message) for w in caught if "out of memory in" in str(w.message)]
    assert (autofit.plan.micro_batch_size, autofit.plan.accumulate_grad_batches) == (8, 2)
    assert "(batch 1, 8 samples)" in message
    assert "with batch_size = 16 (the global batch per GPU)" in message
    assert "No plan" not in message


class _GrowsInConfigureModel(MLPModule):
    """A head built in configure_model, after AutoFit planned the module at setup."""

    def configure_model(self):
        if not hasattr(self, "extra"):
            self.extra = nn.Linear(1, 1)


def test_layers_configure_model_builds_after_the_plan_are_refused_by_name(tmp_path):
    module = _GrowsInConfigureModel(batch_size=16)
    with pytest.raises(
        RuntimeError, match=r"configure_model built 2 parameters \(`extra.weight`, `extra.bias`\)"
    ):
        _fit(tmp_path, module, [AutoFit(budget="100TB", cost="flops")])


# --- a hostile pass's loaders (issue 46, "Then try again") -------------------------------------------


def test_a_padded_time_dimension_that_moves_is_not_taken_for_the_samples():
    """(T, B) batches padded to their longest sequence: T moved too (16 at 16 samples, 10 at 8), which was
    taken for the samples (the first dimension that moved); only B moved in proportion."""
    axes = loader_axes(
        [((torch.zeros(16, 16, 3), torch.zeros(16)), 16), ((torch.zeros(10, 8, 3), torch.zeros(8)), 8)]
    )
    assert axes == (1, 0)


def test_a_loader_of_two_views_a_sample_is_cut_by_its_rows_a_sample(tmp_path):
    """SimCLR's collate: two augmented views of each sample, 2B rows. Refused before as a loader that did
    not read the attribute; now 2 rows a sample, micro-batch m runs 2m rows, and the first batch passes."""
    assert loader_axes([((torch.zeros(32, 4),), 16), ((torch.zeros(16, 4),), 8)]) == ((0, 2),)
    assert batch_size((torch.zeros(32, 4),), ((0, 2),)) == 16
    assert batch_slice((torch.zeros(32, 4),), 3, axes=((0, 2),))[0].shape == (6, 4)

    class TwoViews(MLPModule):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.shapes: list[tuple] = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            self.shapes.append(tuple(x.shape))
            return F.mse_loss(self.net(x), y)

        def train_dataloader(self):
            def views(rows):
                x, y = (torch.stack(t) for t in zip(*rows, strict=True))
                return torch.cat([x, x + 0.1]), torch.cat([y, y])

            return DataLoader(_rows(), batch_size=self.batch_size, collate_fn=views)

    module = TwoViews(batch_size=8)
    autofit = AutoFit(budget="100TB", cost="flops")
    _fit(tmp_path, module, [autofit], max_steps=1)
    assert autofit.sample_axes == ((0, 2), (0, 2))
    assert (autofit.plan.micro_batch_size, module.shapes[-1]) == (8, (16, 16))


def test_one_loader_of_several_that_ignores_the_batch_size_is_refused_by_name(tmp_path):
    """`b` kept its own 16 while `a` read the attribute: b's tensors were taken as shared by the samples, and
    each optimizer step trained 4x b's rows."""

    class Two(MLPModule):
        def training_step(self, batch, batch_idx):
            return sum(F.mse_loss(self.net(x), y) for x, y in batch.values())

        def train_dataloader(self):
            return {
                "a": DataLoader(_rows(), batch_size=self.batch_size),
                "b": DataLoader(_rows(), batch_size=16),
            }

    with pytest.raises(ValueError, match=r"of the train loaders 'a', 'b', 'b' does not read it"):
        _fit(tmp_path, Two(batch_size=16), [AutoFit(budget="100TB", cost="flops")])


class _Setup(MLPModule):
    """Its dataset built in its own setup(), which Lightning calls after the callbacks' setup."""

    def setup(self, stage):
        self.data = _rows()

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=self.batch_size)


class _Iter(MLPModule):
    def training_step(self, dataloader_iter):
        x, y = next(dataloader_iter)
        return F.mse_loss(self.net(x), y)


class _ReadOnly(MLPModule):
    batch_size = property(lambda self: 16)

    def __init__(self):
        L.LightningModule.__init__(self)
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))

    def train_dataloader(self):
        return DataLoader(_rows(), batch_size=16)


class _NoneBatches(MLPModule):
    """Batches made beforehand: the attribute is None, the loader's own batch size."""

    def train_dataloader(self):
        x, y = _rows().tensors
        return DataLoader(list(zip(x.split(16), y.split(16), strict=True)), batch_size=self.batch_size)


@pytest.mark.parametrize(
    ("make", "error", "said"),
    [
        (
            lambda: _NoneBatches(batch_size=None),
            ValueError,
            r"which holds None: it must be the number of samples",
        ),
        (
            lambda: _Setup(batch_size=16),
            RuntimeError,
            r"building it failed: AttributeError.*own setup\(\) runs after",
        ),
        (
            lambda: _Iter(batch_size=16),
            NotImplementedError,
            r"takes dataloader_iter and fetches its batches itself",
        ),
        (_ReadOnly, ValueError, r"through `batch_size`, but it cannot be set"),
    ],
    ids=["None", "module-setup", "dataloader_iter", "read-only"],
)
def test_set_ups_autofit_cannot_plan_get_a_sentence(tmp_path, make, error, said):
    """Each ran into a raw traceback, or (None) trained 16 batches made beforehand as one, 6.3x over the
    budget, past the first-batch check."""
    with pytest.raises(error, match=said):
        _fit(tmp_path, make(), [AutoFit(budget="100TB", cost="flops")])


def test_a_short_dataset_is_told(tmp_path):
    """A dataset of 5 samples at batch size 16 gives 5 at every size, which cannot be told from a loader
    that ignores the attribute: the refusal says both."""

    class Short(MLPModule):
        def train_dataloader(self):
            return DataLoader(_rows(5), batch_size=self.batch_size)

    with pytest.raises(ValueError, match=r"or the dataset holds 5 samples, fewer than 16"):
        _fit(tmp_path, Short(batch_size=16), [AutoFit(budget="100TB", cost="flops")])


def test_whole_batch_counts_scale_by_the_batch_size_the_loader_reads(tmp_path):
    """hparams' batch_size 32 beside the datamodule's 16, which the loader reads: limit_train_batches=4 was
    scaled by 32 / 8 (the epoch trained 128 samples where the user's trained 64)."""

    class HP(_NoAttribute):
        def __init__(self, batch_size=32):
            super().__init__()
            self.save_hyperparameters()

    class Data(L.LightningDataModule):
        def __init__(self):
            super().__init__()
            self.batch_size = 16

        def train_dataloader(self):
            return DataLoader(_rows(), batch_size=self.batch_size)

    module = HP()
    autofit = AutoFit(budget=_budget_for_half(module), margin=0.0, cost="flops", checkpointing="none")
    trainer = _fit(tmp_path, module, [autofit], Data(), max_steps=-1, max_epochs=1, limit_train_batches=4)
    assert (autofit.plan.micro_batch_size, autofit.plan.accumulate_grad_batches) == (8, 2)
    assert trainer.global_step == 4  # 4 x 16 samples, as the user's
