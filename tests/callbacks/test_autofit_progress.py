"""AutoFit's plan, read by Lightning's progress bar: the same bar as the plan's values set by hand."""

import pickle

import lightning as L
import pytest
import torch
from helpers import Regression, cpu_trainer
from lightning.pytorch.callbacks import TQDMProgressBar

from lightning_memkit import estimate_memory
from lightning_memkit._estimating.lightning_step import batch_slice
from lightning_memkit.callbacks.auto_fit import AutoFit


class _Scheduled(Regression):
    """A learning rate decayed over the run's optimizer steps, as `trainer.estimated_stepping_batches`
    counts them (Lightning's recipe for OneCycleLR and linear warm-up schedules)."""

    def configure_optimizers(self):
        optimizer = super().configure_optimizers()
        self.stepping_batches = self.trainer.estimated_stepping_batches
        schedule = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.1, total_iters=self.stepping_batches)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class _Bar(L.Callback):
    """What the progress bar counted each epoch (Lightning's ``total_train_batches`` and the Trainer's
    ``num_training_batches`` as the epoch starts; the tqdm bar's description, count and total as it
    ends), and the rows of each training batch."""

    def __init__(self) -> None:
        self.read: list[tuple] = []
        self.rows: list[int] = []

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self.read.append((trainer.progress_bar_callback.total_train_batches, trainer.num_training_batches))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.rows.append(len(batch[0]))

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        bar = trainer.progress_bar_callback.train_progress_bar
        self.read.append((bar.desc, bar.n, bar.total))


def _fit(tmp_path, batch_size: int, accumulate: int, autofit: AutoFit | None, **limits) -> tuple:
    torch.manual_seed(0)
    module = _Scheduled(width=256, hidden=512, samples=32, batch_size=batch_size)  # 4 batches of 8
    seen = _Bar()
    trainer = L.Trainer(
        default_root_dir=tmp_path, accelerator="cpu", devices=1, accumulate_grad_batches=accumulate,
        limit_val_batches=0, logger=False, enable_model_summary=False, enable_checkpointing=False,
        callbacks=[TQDMProgressBar(), seen, *([autofit] if autofit else [])], **limits,
    )  # fmt: skip
    trainer.fit(module)
    return seen.read, seen.rows, trainer.current_epoch, trainer.global_step, module.stepping_batches


@pytest.mark.parametrize("limits", [{"max_epochs": 1}, {"max_steps": 3}], ids=["max_epochs", "max_steps"])
def test_the_bar_reads_as_the_plan_set_by_hand(tmp_path, limits):
    """With ``max_epochs``, ``configure_optimizers`` reading ``trainer.estimated_stepping_batches`` built
    the train loader while AutoFit planned, at the user's batch of 8, and the fit kept it: 4 batches of 8
    rows, accumulated 2 at a time (2 steps of 16 samples where the user asked for 4 of 8), and the bar
    read 4/4, where the plan's 4 x 2 set by hand runs 8 batches of 4 and reads 8/8. With ``max_steps``
    alone (``max_epochs=-1``) Lightning's own total, ``min(num_training_batches, max_steps - global_step)``,
    counts steps, not batches: the plan set by hand reads 6/3, and under AutoFit the bar counts the batches
    those steps take, 6/6 (issue 49 item 8)."""
    module = Regression(width=256, hidden=512)
    batch = next(iter(module.train_dataloader()))
    whole = estimate_memory(module, batch, device="cpu").peak
    half = estimate_memory(module, batch_slice(batch, 4), device="cpu").peak
    budget = int((half + whole) / 2 / 0.9)  # micro-batch 4 fits, 8 does not
    # optimizers=(None,): the module's own only, so that planning runs its configure_optimizers
    autofit = AutoFit(budget=budget, cost="flops", optimizers=(None,), checkpointing=("none",))
    planned = _fit(tmp_path / "autofit", 8, 1, autofit, **limits)
    assert (autofit.plan.micro_batch_size, autofit.plan.accumulate_grad_batches) == (4, 2)
    by_hand = _fit(tmp_path / "by_hand", 4, 2, None, **limits)
    assert set(planned[1]) == {4}  # the plan's micro-batch ran
    if "max_epochs" in limits:
        assert planned == by_hand
        return
    assert planned[1:] == by_hand[1:]  # the same batches and steps
    assert by_hand[0] == [(3, 8), ("Epoch 0: ", 6, 3)]  # Lightning's: steps for a total
    assert planned[0] == [(6, 8), ("Epoch 0: ", 6, 6)]


def test_the_rich_bar_under_autofit_counts_batches_and_no_epoch_limit(tmp_path):
    """The default bar where rich is installed: "Epoch 0/-2 16/4" under AutoFit's 8 x 4 plan over
    max_steps=4; now "Epoch 0 16/16", and the bar is the Trainer's own class again after the fit."""
    from lightning.pytorch.callbacks import RichProgressBar

    module = _Scheduled(width=256, hidden=512, samples=128, batch_size=32)
    autofit = AutoFit(budget="100TB", cost="flops", optimizers=(None,), checkpointing=("none",))
    bar = RichProgressBar()
    seen = []

    class _Read(L.Callback):
        def on_train_epoch_end(self, trainer, pl_module) -> None:
            task = trainer.progress_bar_callback.progress.tasks[
                trainer.progress_bar_callback.train_progress_bar_id
            ]
            seen.append((task.description.strip(), task.completed, task.total))

    trainer = cpu_trainer(
        tmp_path,
        [bar, _Read(), autofit],
        accumulate_grad_batches=4,
        max_steps=1,
        logger=False,
        enable_progress_bar=True,
    )
    trainer.fit(module)
    assert (autofit.plan.micro_batch_size, autofit.plan.accumulate_grad_batches) == (32, 4)  # kept
    assert seen == [("Epoch 0", 4, 4)]
    assert type(bar) is RichProgressBar


class _OwnTotal(TQDMProgressBar):
    @property
    def total_train_batches(self) -> int:
        return 999


class _Pickled(L.Callback):
    """At the first batch: the class of the bar pickled and unpickled, and its total."""

    def __init__(self, seen: list) -> None:
        self.seen = seen

    def on_train_batch_end(self, trainer, *args) -> None:
        bar = trainer.progress_bar_callback
        if not self.seen:
            self.seen.append((type(pickle.loads(pickle.dumps(bar))), bar.total_train_batches))


class _Boom(Regression):
    def training_step(self, batch, batch_idx):
        if batch_idx == 2:
            raise RuntimeError("boom at batch 2")
        return super().training_step(batch, batch_idx)


def test_the_bar_pickles_keeps_a_users_total_and_gets_its_class_back_after_an_exception(tmp_path):
    """The counting bar's class is made at run time: pickling the bar mid-fit raised PicklingError; a fit that
    raised left the bar's class swapped; a bar class's own ``total_train_batches`` (999) read 12."""
    seen = []

    def fit(bar, module) -> L.Trainer:
        autofit = AutoFit(budget="100TB", cost="flops", optimizers=(None,), checkpointing=("none",))
        trainer = cpu_trainer(
            tmp_path,
            [bar, _Pickled(seen), autofit],
            accumulate_grad_batches=4,
            max_steps=3,
            logger=False,
            enable_progress_bar=True,
        )
        trainer.fit(module)
        return trainer

    fit(TQDMProgressBar(), Regression(width=8, hidden=8, samples=64, batch_size=4))
    assert seen == [(TQDMProgressBar, 12)]  # 3 steps x 4 batches, pickled as the user's own class
    seen.clear()
    fit(own := _OwnTotal(), Regression(width=8, hidden=8, samples=64, batch_size=4))
    assert seen == [(_OwnTotal, 999)] and type(own) is _OwnTotal
    bar = TQDMProgressBar()
    with pytest.raises(RuntimeError, match="boom at batch 2"):
        fit(bar, _Boom(width=8, hidden=8, samples=64, batch_size=4))
    assert type(bar) is TQDMProgressBar
