"""The life of the hooks a step lever puts on the fit's optimizers or parameters (`GradientRelease`,
`FusedOptimizerStep`): installed right before a training backward, installed again whenever what they are
for changes, and taken off for validation, at the end of training and after an exception."""

from __future__ import annotations

from typing import Any, Protocol

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from torch import Tensor

__all__ = ["StepHooks"]


class _Removable(Protocol):
    def remove(self) -> None: ...


class StepHooks(Callback):
    """A callback whose hooks follow the fit's optimizers. Subclasses say what the hooks are for
    (`installed_for`: compared at every backward, so it must be cheap) and install them (`install`).

    Installed as late as possible, right before a training backward: `OptimizerSwap` installs its choice at
    the first batch, after ``on_train_start``. Taken off for validation (a backward there, under
    ``enable_grad``, must not act) and in ``on_exception``, where Lightning calls neither ``on_train_end``
    nor ``teardown``."""

    def __init__(self) -> None:
        self._handles: list[_Removable] = []
        self._installed_for: Any = None

    def installed_for(self, trainer: pl.Trainer) -> Any:
        """What the hooks are for; they are installed again when it changes."""
        raise NotImplementedError

    def install(self, trainer: pl.Trainer) -> list[_Removable]:
        raise NotImplementedError

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        key = self.installed_for(trainer)
        if key != self._installed_for:
            self._remove()
            self._handles = self.install(trainer)
            self._installed_for = key

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._remove()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._remove()

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._remove()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._remove()

    def _remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._installed_for = None
