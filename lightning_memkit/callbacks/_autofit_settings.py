"""What a fit under `AutoFit` changes of the user's settings, read before the plan is installed and put
back at the fit's end: the batch size attribute on every holder (the module, its hparams, the datamodule,
its hparams), the Trainer's ``accumulate_grad_batches``, and the Trainer's counts of training batches,
scaled to the plan's micro-batches while the fit runs.
"""

from __future__ import annotations

import contextlib
import copy
import math
from fractions import Fraction
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.parsing import _lightning_get_all_attr_holders, lightning_getattr
from torch.nn.modules.batchnorm import _BatchNorm

from lightning_memkit._estimating.isolate import rng_kept
from lightning_memkit._fitting.plan import FitPlan
from lightning_memkit.callbacks._autofit_batches import samples
from lightning_memkit.callbacks._trainer import fit_data_source

__all__ = ["BATCH_COUNTS", "UserSettings"]

#: the Trainer's arguments that count training batches, scaled to the plan's micro-batches
BATCH_COUNTS = ("limit_train_batches", "val_check_interval")


class UserSettings:
    """The user's values of what AutoFit sets, for the batch size attribute ``name``: empty until `read`."""

    def __init__(self, name: str) -> None:
        self.name = name
        #: [(holder, value)] of the batch size attribute, on every holder
        self.batch_sizes: list[tuple[Any, Any]] = []
        #: the batch size attribute as the loader reads it (a number of samples, else ``None``)
        self.users: int | None = None
        #: the Trainer and its ``accumulate_grad_batches``
        self.accumulate: tuple[pl.Trainer, int] | None = None
        #: the Trainer's `BATCH_COUNTS` as the user set them
        self.counts: dict[str, Any] = {}

    @classmethod
    def read(cls, trainer: pl.Trainer, pl_module: pl.LightningModule, name: str) -> UserSettings:
        """The user's values now, before a plan changes them."""
        settings = cls(name)
        holders = _lightning_get_all_attr_holders(pl_module, name)
        settings.batch_sizes = [(holder, _get(holder, name)) for holder in holders]
        settings.users = samples(lightning_getattr(pl_module, name))
        settings.accumulate = (trainer, trainer.accumulate_grad_batches)
        settings.counts = {count: getattr(trainer, count) for count in BATCH_COUNTS}
        return settings

    def put_back_batch_sizes(self) -> None:
        """The batch size attribute at the user's values, on every holder (one that cannot be set, a
        property, was never changed)."""
        for holder, value in self.batch_sizes:
            if isinstance(holder, dict):
                holder[self.name] = value
            else:
                with contextlib.suppress(AttributeError):
                    setattr(holder, self.name, value)

    def put_back_accumulation(self) -> None:
        """The Trainer's ``accumulate_grad_batches`` at the user's value."""
        if self.accumulate is not None:
            trainer, accumulate = self.accumulate
            trainer.accumulate_grad_batches = accumulate

    def restore(self) -> None:
        """The batch size attribute and the Trainer's accumulation and batch counts back at the user's
        values; nothing is held after."""
        self.put_back_batch_sizes()
        if self.accumulate is not None:
            self.put_back_accumulation()
            trainer = self.accumulate[0]
            for name, value in self.counts.items():
                setattr(trainer, name, value)
        self.batch_sizes, self.accumulate, self.counts = [], None, {}

    def hparams_in(
        self, checkpoint: dict[str, Any], trainer: pl.Trainer, pl_module: pl.LightningModule
    ) -> None:
        """The checkpoint's hyperparameters hold the batch size the user set, not the plan's micro-batch: a
        module loaded from it plans from it again."""
        users = {id(holder): value for holder, value in self.batch_sizes}
        for obj, key in ((pl_module, pl.LightningModule), (trainer.datamodule, pl.LightningDataModule)):
            stored = checkpoint.get(key.CHECKPOINT_HYPER_PARAMS_KEY)
            hparams = getattr(obj, "hparams", None) if obj is not None else None
            if stored is None or id(hparams) not in users or self.name not in stored:
                continue
            stored = copy.copy(stored)  # an omegaconf container there is the module's own hparams
            stored[self.name] = users[id(hparams)]
            checkpoint[key.CHECKPOINT_HYPER_PARAMS_KEY] = stored

    def scale_counts(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, plan: FitPlan, warned: set[str]
    ) -> None:
        """Whole numbers of training batches (``limit_train_batches``, ``val_check_interval``) count the
        plan's micro-batches: scaled so that they cover the samples the user's batches did. Said in one line;
        ``limit_val_batches``, which counts validation batches the plan may not change, is warned about
        (once: ``warned``)."""
        users = self.users  # the value the loader reads (of the module's, its hparams' or the datamodule's)
        if users is None:
            return
        ratio = Fraction(users, plan.micro_batch_size)
        changed, rounded_up = self._scale(trainer, ratio)
        if ratio < 1:  # the user's accumulation merged into a larger micro-batch
            self._say_merged(pl_module, plan)
        if changed:
            rank_zero_info(
                f"AutoFit: {', '.join(changed)}: they count training batches, now of "
                f"{plan.micro_batch_size} samples where you gave {users}, so the fit covers "
                + (
                    "at least the samples asked for (rounded up, within the epoch)."
                    if rounded_up
                    else "the same samples."
                )
            )
        limit = trainer.limit_val_batches
        if ratio != 1 and _whole(limit) and limit > 0 and "limit_val_batches" not in warned:
            warned.add("limit_val_batches")
            rank_zero_warn(
                f"AutoFit sets `{self.name}` to the micro-batch {plan.micro_batch_size} (you gave "
                f"{users}): a val_dataloader that reads it gives batches of that size, and "
                f"limit_val_batches={limit} then validates on {float(ratio):.3g}x fewer samples. Give "
                "limit_val_batches as a fraction, or a val_dataloader with a batch size of its own."
            )

    def _scale(self, trainer: pl.Trainer, ratio: Fraction) -> tuple[list[str], bool]:
        """Set each whole-number `BATCH_COUNTS` to cover ``ratio`` times its batches; returns what changed
        (``"name=given -> scaled"``) and whether any was rounded up."""
        changed, rounded_up = [], False
        for name in BATCH_COUNTS:
            given = self.counts.get(name)
            if ratio == 1 or not _whole(given) or given == 0:  # nothing to scale (nor a loader to build)
                continue
            scaled = max(1, math.ceil(given * ratio))  # at least the samples asked for
            if name == "val_check_interval" and trainer.check_val_every_n_epoch is not None:
                # Within an epoch, as Lightning requires: a last batch of fewer samples makes the epoch
                # shorter than the scaled count (an interval of the user's whole epoch, say).
                scaled = min(scaled, _epoch_batches(trainer) or scaled)
            setattr(trainer, name, scaled)
            if scaled != given:
                exact = "" if given * ratio == scaled else f" (from {float(given * ratio):.2f})"
                rounded_up |= bool(exact)
                changed.append(f"{name}={given} -> {scaled}{exact}")
        return changed, rounded_up

    def _say_merged(self, pl_module: pl.LightningModule, plan: FitPlan) -> None:
        """Say that the plan merged the user's accumulation into larger micro-batches; warn where batch
        norms then normalize over more samples."""
        assert self.accumulate is not None
        users = self.users
        norms = sorted({type(m).__name__ for m in pl_module.modules() if isinstance(m, _BatchNorm)})
        say = rank_zero_warn if norms else rank_zero_info
        say(
            f"AutoFit: micro-batch {plan.micro_batch_size} x accumulate {plan.accumulate_grad_batches} "
            f"in place of your {users} x {self.accumulate[1]}: the same global batch in fewer, larger "
            "micro-batches (faster)"
            + (
                f"; {', '.join(norms)} then normalize over {plan.micro_batch_size} samples, not {users}. "
                "Where the model needs your micro-batch, train it without AutoFit."
                if norms
                else "."
            )
        )


def _epoch_batches(trainer: pl.Trainer) -> int | None:
    """Training batches per epoch at the plan's micro-batch (the loader's length, within a whole-number
    ``limit_train_batches``), or ``None`` for a loader without a length."""
    with rng_kept():  # building the loader may draw from them
        try:
            n = len(fit_data_source(trainer).dataloader())
        except TypeError:  # an iterable dataset
            return None
    limit = trainer.limit_train_batches
    return min(n, limit) if _whole(limit) and limit > 0 else n


def _whole(value: Any) -> bool:
    """Whether a Trainer's batch count is a whole number of batches (not a fraction, not ``True``)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _get(holder: Any, name: str) -> Any:
    return holder[name] if isinstance(holder, dict) else getattr(holder, name)
