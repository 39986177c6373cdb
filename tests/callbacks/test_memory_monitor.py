"""MemoryMonitor inside a real Trainer, checked against the allocator on the very same Trainer steps."""

from __future__ import annotations

import csv
import dataclasses
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from models import EncoderLM, MLPModule
from torch import nn

from lightning_memkit import CATEGORIES, MemoryMonitor
from lightning_memkit.testing import AllocatorPeaks

KEYS = [f"memory/{c}" for c in (*CATEGORIES, "peak")]
MiB = 2**20  # the unit of the logged keys


def _fit(model, monitor, trainer_kwargs, *, profile=False, **overrides):
    probe = AllocatorPeaks()
    callbacks = probe.around(monitor) if profile else [monitor]
    kwargs = {**trainer_kwargs, "logger": CSVLogger(trainer_kwargs["default_root_dir"]), **overrides}
    trainer = pl.Trainer(callbacks=callbacks, **kwargs)
    trainer.fit(model)
    return trainer, probe.peaks


def _csv_rows(trainer) -> list[dict[str, str]]:
    trainer.logger.save()
    with open(Path(trainer.logger.log_dir) / "metrics.csv") as f:
        return [row for row in csv.DictReader(f) if row.get("memory/peak")]


@pytest.mark.parametrize(
    "foreach", [pytest.param(True, marks=pytest.mark.slow), False], ids=["foreach", "for-loop"]
)
def test_every_step_matches_the_allocator_on_torch_encoder(trainer_kwargs, foreach):
    """Measured steps and steps that reuse a measured twin both match the profiler on the same step."""
    monitor = MemoryMonitor()
    model = EncoderLM(n_layer=1, foreach=foreach)  # one layer: each profiled step costs half as much
    trainer, truths = _fit(model, monitor, trainer_kwargs, profile=True)
    peaks = [b.peak for _, b in monitor.history]
    assert len(peaks) == len(truths) == 4
    for step, (peak, truth) in enumerate(zip(peaks, truths, strict=True)):
        assert abs(peak - truth) <= 0.02 * truth, f"step {step}: measured {peak} vs allocator {truth}"
    # Step 0 (no gradients, no optimizer state yet) and step 1 are measured; steps 2 and 3 reuse step 1.
    assert monitor.measured_steps == 2
    # The keys reached the CSV logger, in MiB.
    rows = _csv_rows(trainer)
    assert len(rows) == 4
    assert set(KEYS) <= set(rows[0])
    assert float(rows[-1]["memory/peak"]) == pytest.approx(peaks[-1] / MiB)


def test_remeasures_periodically_and_when_shapes_change(trainer_kwargs):
    class Ragged(EncoderLM):
        def training_step(self, batch, batch_idx):
            x, y = batch
            cut = 32 if batch_idx % 4 == 3 else 64  # every 4th batch is shorter
            return super().training_step((x[:, :cut], y[:, :cut]), batch_idx)

    monitor = MemoryMonitor(remeasure_every_n_steps=3)
    _fit(Ragged(), monitor, trainer_kwargs, max_steps=8)
    # Shapes inside training_step are invisible to the signature; steps 0 and 1 differ in signature
    # (no gradients/state yet), then every 3rd step is measured again: steps 0, 1, 4, 7.
    assert monitor.measured_steps == 4

    every = MemoryMonitor(remeasure_every_n_steps=1)
    _fit(Ragged(), every, trainer_kwargs, max_steps=8)
    assert every.measured_steps == 8
    peaks = {s: b.peak for s, b in every.history}
    assert peaks[3] < peaks[2] and peaks[7] < peaks[6]  # the short batches really are measured


def test_tensorboard_receives_every_key(tmp_path, trainer_kwargs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = TensorBoardLogger(tmp_path, name="tb")
    trainer = pl.Trainer(callbacks=[MemoryMonitor(budget="1GiB")], logger=logger, **trainer_kwargs)
    trainer.fit(EncoderLM())
    events = EventAccumulator(logger.log_dir)
    events.Reload()
    scalars = set(events.Tags()["scalars"])
    assert set(KEYS) | {"memory/peak_fraction"} <= scalars
    peak = [e.value for e in events.Scalars("memory/peak")]
    fraction = [e.value for e in events.Scalars("memory/peak_fraction")]
    assert len(peak) == 4
    assert fraction[-1] == pytest.approx(peak[-1] * MiB / 2**30, rel=1e-5)
    assert "memory/breakdown" in events.Tags()["images"]
    assert (Path(logger.log_dir) / "memory.png").stat().st_size > 10_000


def test_summary_table_and_plot_at_fit_end(trainer_kwargs, capsys):
    monitor = MemoryMonitor()
    trainer, _ = _fit(EncoderLM(), monitor, trainer_kwargs)
    out = capsys.readouterr().out
    assert "Peak training memory" in out
    for category in CATEGORIES:
        assert category in out
    png = Path(trainer.logger.log_dir) / "memory.png"
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_logger_false_is_a_clear_error(trainer_kwargs):
    trainer = pl.Trainer(callbacks=[MemoryMonitor()], logger=False, **trainer_kwargs)
    with pytest.raises(MisconfigurationException, match=r"logger=False.*CSVLogger"):
        trainer.fit(EncoderLM())


def test_a_raising_logger_does_not_stop_training(trainer_kwargs):
    class Broken(Logger):
        name, version = "broken", 0
        calls = 0

        def log_metrics(self, metrics, step=None):
            Broken.calls += 1
            raise OSError("disk full")

        def log_hyperparams(self, params, *args, **kwargs):
            pass

    monitor = MemoryMonitor()
    trainer = pl.Trainer(callbacks=[monitor], logger=Broken(), **trainer_kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(EncoderLM())
    assert trainer.global_step == 4
    assert len(monitor.history) == 4
    ours = [w for w in caught if "disk full" in str(w.message)]
    assert len(ours) == 1  # warned once, although every step's log raised
    assert Broken.calls >= 4


def test_training_step_returning_none_and_no_trainable_parameters(trainer_kwargs):
    class Frozen(EncoderLM):
        def __init__(self):
            super().__init__()
            self.requires_grad_(False)

        def training_step(self, batch, batch_idx):
            self(batch[0])  # forward only; nothing to train
            return None

    monitor = MemoryMonitor()
    _fit(Frozen(), monitor, trainer_kwargs)
    assert monitor.history
    for _, b in monitor.history:
        assert b.gradients == 0 and b.optimizer_state == 0 and b.activations == 0
        assert b.parameters > 0


def test_gradient_accumulation_logs_one_entry_per_optimizer_step(trainer_kwargs):
    monitor = MemoryMonitor()
    model = EncoderLM(d_model=32, n_layer=1, vocab=64)  # six profiled micro-batches: the smallest encoder
    trainer, truths = _fit(
        model, monitor, trainer_kwargs, profile=True, max_steps=3, accumulate_grad_batches=2
    )
    assert [s for s, _ in monitor.history] == [0, 1, 2]
    assert len(truths) == 6  # micro-batches
    for (_, b), pair in zip(monitor.history, zip(truths[::2], truths[1::2], strict=True), strict=True):
        assert abs(b.peak - max(pair)) <= 0.02 * max(pair)
    assert len(_csv_rows(trainer)) == 3


class TwoOptimizers(EncoderLM):
    """Manual optimization with two optimizers (a GAN-style split of the model)."""

    def __init__(self):
        super().__init__(n_layer=1)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt_body, opt_head = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss)
        opt_body.step()
        opt_head.step()
        opt_body.zero_grad()
        opt_head.zero_grad()

    def configure_optimizers(self):
        body = [*self.embed.parameters(), *self.encoder.parameters()]
        return torch.optim.AdamW(body), torch.optim.SGD(self.head.parameters(), lr=0.1, momentum=0.9)


def test_manual_optimization_with_two_optimizers_counts_both_states(trainer_kwargs):
    monitor = MemoryMonitor()
    _, truths = _fit(TwoOptimizers(), monitor, trainer_kwargs, profile=True, max_steps=3)
    model = TwoOptimizers()
    n_body = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("head"))
    n_head = sum(p.numel() for p in model.head.parameters())
    last = monitor.history[-1][1]
    # AdamW: two fp32 moments + a 4-byte step per tensor; SGD momentum: one buffer.
    n_body_tensors = len([n for n, _ in model.named_parameters() if not n.startswith("head")])
    assert last.optimizer_state == 8 * n_body + 4 * n_body_tensors + 4 * n_head
    # Manual optimization steps twice per batch (global_step counts optimizer steps) and logs per batch.
    assert len(monitor.history) == len(truths)
    for (_, b), truth in zip(monitor.history, truths, strict=True):
        assert abs(b.peak - truth) <= 0.02 * truth


def test_resume_keeps_the_history(tmp_path, trainer_kwargs):
    kwargs = {**trainer_kwargs, "enable_checkpointing": True}
    first = MemoryMonitor()
    trainer, _ = _fit(EncoderLM(), first, kwargs, max_steps=3)
    ckpt = trainer.checkpoint_callback.best_model_path or str(next(Path(tmp_path).rglob("*.ckpt")))
    resumed = MemoryMonitor()
    trainer = pl.Trainer(callbacks=[resumed], logger=CSVLogger(tmp_path), **{**kwargs, "max_steps": 5})
    trainer.fit(EncoderLM(), ckpt_path=ckpt)
    assert [s for s, _ in resumed.history] == [0, 1, 2, 3, 4]
    assert resumed.history[:3] == first.history


def test_arguments_are_validated():
    with pytest.raises(ValueError, match="log_every_n_steps"):
        MemoryMonitor(log_every_n_steps=0)
    with pytest.raises(ValueError, match="Unknown GPU or size 'lots'"):
        MemoryMonitor(budget="lots")


class _LoggingLM(EncoderLM):
    """EncoderLM logging its loss, as modules do: Lightning's own logging steps."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss)
        return loss


def _rows_by_key(trainer) -> dict[str, list[int]]:
    trainer.logger.save()
    with open(Path(trainer.logger.log_dir) / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    return {key: [int(r["step"]) for r in rows if r.get(key)] for key in ("memory/peak", "train_loss")}


def test_log_every_n_steps(trainer_kwargs):
    """On Lightning's logging steps (issue 29: memory landed at 0, 2, 4 and train_loss at 1, 3, so in the
    CSV they never shared a row)."""
    trainer, _ = _fit(_LoggingLM(), MemoryMonitor(log_every_n_steps=2), trainer_kwargs, max_steps=5)
    # and at the end of fit, the step after the last logging one (issue 49: no peak may go unlogged)
    assert _rows_by_key(trainer) == {"memory/peak": [1, 3, 4], "train_loss": [0, 1, 2, 3, 4]}  # Trainer's: 1


def test_the_logging_period_follows_the_trainer_by_default(trainer_kwargs):
    """Issue 13, item 8: memory keys were logged every step while Lightning's own follow the Trainer's
    ``log_every_n_steps``; issue 29: on the same steps."""
    kwargs = {**trainer_kwargs, "log_every_n_steps": 3}
    trainer, _ = _fit(_LoggingLM(), MemoryMonitor(), kwargs, max_steps=7)
    # step 6, after the last logging step, is logged at the end of fit (issue 49: no peak unlogged)
    assert _rows_by_key(trainer) == {"memory/peak": [2, 5, 6], "train_loss": [2, 5]}
    rows = {tuple(r.items()) for r in _csv_rows(trainer)}
    assert len(rows) == 3  # one row each: steps 2 and 5 shared with the loss


def test_over_budget_warns_with_numbers(trainer_kwargs):
    with pytest.warns(UserWarning, match=r"over the budget of 1\.00 MiB by .*Largest consumer: activations"):
        _fit(EncoderLM(), MemoryMonitor(budget="1MiB"), trainer_kwargs, max_steps=2)


def test_internal_error_disables_monitoring_but_not_training(trainer_kwargs, monkeypatch):
    import lightning_memkit.callbacks._twins as twins

    def broken(*args, **kwargs):
        raise RuntimeError("tracker exploded")

    monkeypatch.setattr(twins, "measure", broken)
    trainer = pl.Trainer(
        callbacks=[MemoryMonitor()], logger=CSVLogger(trainer_kwargs["default_root_dir"]), **trainer_kwargs
    )
    with pytest.warns(UserWarning, match="tracker exploded"):
        trainer.fit(EncoderLM())
    assert trainer.global_step == 4


def test_plain_model_without_lightning_helpers(trainer_kwargs):
    """A LightningModule that wraps a user's plain nn.Sequential, with a dict batch."""

    class DictBatch(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))

        def training_step(self, batch, batch_idx):
            return nn.functional.mse_loss(self.net(batch["x"]), batch["y"])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            data = [{"x": torch.randn(32), "y": torch.randn(1)} for _ in range(64)]
            return torch.utils.data.DataLoader(data, batch_size=16)

    monitor = MemoryMonitor()
    _, truths = _fit(DictBatch(), monitor, trainer_kwargs, profile=True)
    for (_, b), truth in zip(monitor.history, truths, strict=True):
        assert abs(b.peak - truth) <= 0.02 * truth


# --- batches and optimizer state the signature must see into --------------------------------------


@dataclasses.dataclass
class _Tokens:
    x: torch.Tensor
    y: torch.Tensor


def _batch_encoding(x, y):
    from transformers import BatchEncoding

    return BatchEncoding({"input_ids": x, "labels": y})


class _Varying(EncoderLM):
    """Sequence lengths vary from batch to batch, inside a container ``tree_leaves`` sees as one leaf."""

    LENGTHS = (32, 32, 16, 16, 32)  # steps 0, 1 (gradients appear), 2 (shorter) are measured; 3, 4 reuse

    def __init__(self, wrap):
        super().__init__(d_model=32, n_layer=1, vocab=64)
        self.wrap = wrap

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        ids = [torch.randint(0, 64, (4, t), generator=g) for t in self.LENGTHS]
        batches = [self.wrap(x, x.roll(-1, 1)) for x in ids]
        return torch.utils.data.DataLoader(batches, batch_size=None, collate_fn=lambda b: b)

    def training_step(self, batch, batch_idx):
        x, y = (batch.x, batch.y) if isinstance(batch, _Tokens) else (batch["input_ids"], batch["labels"])
        return super().training_step((x, y), batch_idx)


@pytest.mark.parametrize(
    "wrap",
    [_batch_encoding, pytest.param(_Tokens, marks=pytest.mark.slow)],
    ids=["BatchEncoding", "dataclass"],
)
def test_batches_of_varying_shape_in_any_container_match_the_allocator(trainer_kwargs, wrap):
    monitor = MemoryMonitor(plot=False, summary=False)
    _, truths = _fit(_Varying(wrap), monitor, trainer_kwargs, profile=True, max_steps=5)
    assert len(monitor.history) == len(truths) == 5
    for step, ((_, b), truth) in enumerate(zip(monitor.history, truths, strict=True)):
        assert b.peak == pytest.approx(truth, rel=0.001), f"step {step}"
    assert monitor.measured_steps == 3  # steps alike still reuse their twin


class _AveragedSGD(torch.optim.Optimizer):
    """Steps along the mean of every gradient so far, kept in a list per parameter: as many state entries
    each step, more bytes in them (as LBFGS's ``old_dirs``/``old_stps``)."""

    def __init__(self, params, lr=0.01):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        with torch.enable_grad():
            loss = closure() if closure is not None else None
        for group in self.param_groups:
            for p in group["params"]:
                history = self.state[p].setdefault("history", [])
                history.append(p.grad.clone())
                p.sub_(group["lr"] * torch.stack(history).mean(0))
        return loss


@pytest.mark.parametrize(
    "optimizer",
    [
        lambda params: torch.optim.LBFGS(params, lr=0.1, max_iter=4, history_size=10),
        lambda params: _AveragedSGD(params),
    ],
    ids=["LBFGS-closure", "state-growing-in-lists"],
)
def test_optimizer_state_that_grows_inside_its_entries_matches_the_allocator(trainer_kwargs, optimizer):
    monitor = MemoryMonitor(plot=False, summary=False)
    # Steps 0 and 1 are measured; step 2, alike in its state's entries but not in their bytes, is the one
    # a signature of the entries alone would reuse step 1 for.
    torch.manual_seed(0)
    model = MLPModule(32, 64, samples=96, batch_size=16, activation=nn.Tanh, optimizer=optimizer)
    _, truths = _fit(model, monitor, trainer_kwargs, profile=True, max_steps=3)
    assert len(monitor.history) == len(truths) == 3
    for step, ((_, b), truth) in enumerate(zip(monitor.history, truths, strict=True)):
        assert b.peak == pytest.approx(truth, rel=0.001), f"step {step}"


def test_batch_signature_sees_every_tensor_and_refuses_what_it_cannot_read():
    from collections import namedtuple

    from lightning_memkit.callbacks._twins import batch_signature

    def ids(t):
        return torch.zeros(2, t, dtype=torch.long)

    Pair = namedtuple("Pair", "x y")

    class Holder:  # a user's batch class: tensors in its __dict__
        def __init__(self, t):
            self.inputs = {"ids": [ids(t)]}

    class Slotted:
        __slots__ = ("x",)

        def __init__(self, t):
            self.x = ids(t)

    makers = [
        lambda t: _batch_encoding(ids(t), ids(t)),
        lambda t: _Tokens(ids(t), ids(t)),
        lambda t: Pair(ids(t), ids(t)),
        Holder,
        Slotted,
        lambda t: [{"a": (Holder(t),)}],
    ]
    for make in makers:
        assert batch_signature(make(8)) == batch_signature(make(8)) is not None
        assert batch_signature(make(8)) != batch_signature(make(16))
    cyclic = {"x": ids(8)}
    cyclic["self"] = cyclic
    assert batch_signature(cyclic) is not None  # no endless walk
    assert batch_signature(["a", "b", 3]) is None  # no tensor: nothing to tell steps apart by
    assert batch_signature({"x": ids(8), "opaque": object()}) is None  # an object it cannot read


# --- saved-tensor hooks of the user's own -------------------------------------------------------


class _OffloadedEncoder(EncoderLM):
    def __init__(self, offload):
        super().__init__(d_model=32, n_layer=1, vocab=64)
        self.offload = offload

    def training_step(self, batch, batch_idx):
        if not self.offload:
            return super().training_step(batch, batch_idx)
        with torch.autograd.graph.save_on_cpu():  # on a CPU run, the "CPU copies" are the tensors themselves
            return super().training_step(batch, batch_idx)


def test_save_on_cpu_in_training_step_keeps_its_activations_on_a_cpu_run(trainer_kwargs):
    """Hooks the step pushes run instead of the tracker's; what they pack is still kept for backward."""
    runs = {}
    for offload in (False, True):
        monitor = MemoryMonitor(plot=False, summary=False)
        _, truths = _fit(_OffloadedEncoder(offload), monitor, trainer_kwargs, profile=True, max_steps=2)
        runs[offload] = monitor.history[-1][1]
        assert runs[offload].peak == pytest.approx(truths[-1], rel=0.001)
    assert runs[True].activations == runs[False].activations > 0


def test_saved_tensor_hooks_around_the_fit_stay_in_force(trainer_kwargs):
    """A measured step runs the user's saved-tensor hooks as an unmeasured one does."""
    calls = {}
    for watched in (False, True):
        packs = []

        def pack(t, packs=packs):
            packs.append(1)
            return t

        callbacks = [MemoryMonitor(plot=False, summary=False)] if watched else []
        kwargs = {**trainer_kwargs, "max_steps": 2}
        trainer = pl.Trainer(callbacks=callbacks, logger=CSVLogger(kwargs["default_root_dir"]), **kwargs)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            trainer.fit(EncoderLM(d_model=32, n_layer=1, vocab=64))
        calls[watched] = len(packs)
    assert calls[True] == calls[False] > 0


class _SkipsTheRestOfEpochZero(EncoderLM):
    def on_train_batch_start(self, batch, batch_idx):
        if self.current_epoch == 0 and batch_idx == 1:
            return -1  # Lightning skips the rest of the epoch, after the callbacks' on_train_batch_start
        return None


def test_a_skipped_step_leaves_no_measurement_open(trainer_kwargs):
    """Issue 12, item 6: the measurement opened for a step the module skips used to stay on through the
    validation and into the next epoch."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    modes = []

    class Probe(pl.Callback):
        def on_train_epoch_end(self, *args):
            modes.append(len(_get_current_dispatch_mode_stack()))

    monitor = MemoryMonitor(plot=False, summary=False)
    kwargs = {**trainer_kwargs, "max_steps": -1, "max_epochs": 2}
    trainer = pl.Trainer(callbacks=[monitor, Probe()], logger=CSVLogger(kwargs["default_root_dir"]), **kwargs)
    trainer.fit(_SkipsTheRestOfEpochZero(d_model=32, n_layer=1, vocab=64, n_batches=3))
    assert modes == [0, 0] and not _get_current_dispatch_mode_stack()
    assert len(monitor.history) == trainer.global_step == 4  # epoch 0's first step, then all of epoch 1


def test_the_same_monitor_on_a_second_fit_measures_the_new_model(trainer_kwargs):
    """Issue 12, item 7: a monitor reused for a bigger model logged the first model's twins (about 6x low)."""
    monitor = MemoryMonitor(plot=False, summary=False)
    logger = CSVLogger(trainer_kwargs["default_root_dir"])
    trainer_kwargs = {**trainer_kwargs, "max_steps": 3}  # step 2 of the second fit reuses a twin
    small = pl.Trainer(callbacks=[monitor], logger=logger, **trainer_kwargs)
    small.fit(EncoderLM(d_model=32, n_layer=1, vocab=64))
    peaks = AllocatorPeaks()
    big = pl.Trainer(callbacks=peaks.around(monitor), logger=logger, **trainer_kwargs)
    big.fit(EncoderLM(d_model=128, n_layer=2, vocab=64))
    assert len(monitor.history) == len(peaks.peaks) == trainer_kwargs["max_steps"]
    for (_, measured), truth in zip(monitor.history, peaks.peaks, strict=True):
        assert measured.peak == pytest.approx(truth, rel=1e-3)


def test_the_plot_is_logged_once_at_the_last_step(trainer_kwargs, monkeypatch):
    """Issue 29: the image went to TensorBoard at the worst step (step 1) and W&B at another; once, at the
    run's last logging step, W&B (which refuses steps that go back) and TensorBoard agree."""
    import lightning_memkit.callbacks._fit_end as fit_end

    logged = []
    monkeypatch.setattr(fit_end, "log_image", lambda logger, figure, path, step: logged.append(step))
    pytest.importorskip("matplotlib")
    _fit(EncoderLM(), MemoryMonitor(summary=False), trainer_kwargs, max_steps=4)
    assert logged == [3]
