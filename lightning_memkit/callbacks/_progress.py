"""Lightning's progress bar under gradient accumulation, counted in batches.

With ``max_steps`` alone (``max_epochs=-1``) Lightning's bar totals ``min(num_training_batches, max_steps -
global_step)``: optimizer steps, while it advances once per batch, so AutoFit's accumulation of 4 over
``max_steps=4`` read "16/4"; and the rich bar printed the epoch as "Epoch 0/-2" (``max_epochs - 1``). While a
fit runs under AutoFit its bar is an instance of a subclass of its own class (``isinstance`` still holds)
whose total counts the batches those steps take, ``min(num_training_batches, (max_steps - global_step) x
accumulate_grad_batches)``, and whose rich description leaves out an epoch limit there is none of. A bar
whose class has its own ``total_train_batches`` keeps it; the bar pickles (and copies) as its own class.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import lightning.pytorch as pl
from lightning.pytorch.callbacks.progress.progress_bar import ProgressBar


def count_batches(trainer: pl.Trainer) -> Callable[[], None] | None:
    """Make ``trainer``'s progress bar count batches under accumulation; returns what undoes it (``None``:
    no bar, or one already counting)."""
    bar = trainer.progress_bar_callback
    if not isinstance(bar, ProgressBar) or getattr(type(bar), "_counts_batches", False):
        return None
    own = type(bar)
    bar.__class__ = _counting(own)
    return functools.partial(setattr, bar, "__class__", own)  # picklable, as the bar's trainer is


def _steps_only(trainer: pl.Trainer) -> bool:
    """Whether the fit is bounded by ``max_steps`` alone (Lightning then sets ``max_epochs=-1``)."""
    return trainer.max_epochs == -1 and trainer.max_steps is not None and trainer.max_steps > 0


@functools.cache
def _counting(bar: type[ProgressBar]) -> type[ProgressBar]:
    own_total = bar.total_train_batches is not ProgressBar.total_train_batches  # the user's own: kept

    class Counting(bar):  # type: ignore[valid-type,misc]
        _counts_batches = True

        @property
        def total_train_batches(self) -> int | float:
            trainer = self.trainer
            if own_total or not _steps_only(trainer):
                return super().total_train_batches
            left = (trainer.max_steps - trainer.global_step) * trainer.accumulate_grad_batches
            return min(trainer.num_training_batches, left)

        def _get_train_description(self, current_epoch: int) -> str:  # RichProgressBar's
            text = super()._get_train_description(current_epoch)  # type: ignore[misc]
            if not _steps_only(self.trainer):
                return text
            return text.replace(f"Epoch {current_epoch}/-2", f"Epoch {current_epoch}   ", 1)  # same width

        def __reduce_ex__(self, protocol: int):  # type: ignore[no-untyped-def]
            # as the bar's own class: this one is made at run time, where pickle cannot find it by name
            reduced = super().__reduce_ex__(protocol)
            if isinstance(reduced, tuple) and len(reduced) > 1 and reduced[1][:1] == (Counting,):
                reduced = (_new, (bar,), *reduced[2:])
            return reduced

    Counting.__name__ = Counting.__qualname__ = bar.__name__
    return Counting


def _new(cls: type) -> object:
    """An instance of ``cls`` to unpickle a counting bar's state into (``copyreg.__newobj__`` refuses one
    of another class than the pickled object's)."""
    return cls.__new__(cls)
