"""GradientRelease: free the gradients once the optimizer has stepped, so the next forward runs without them.

The lever is `release_gradients`; this callback installs it on every optimizer of the fit right before a
training backward (after `OptimizerSwap` has installed its choice at the first batch; again if the
optimizers change), and removes its hooks when training ends or fails. Training is
bit-identical with and without it (``tests/test_gradient_release.py``); the budget callbacks in the same
Trainer (`AutoFit`, `ActivationCheckpointing`, `OptimizerSwap`) see it and estimate the step without the
previous step's gradients in the forward.
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from torch import Tensor
from torch.utils.hooks import RemovableHandle

from lightning_memkit._gradient_release import release_gradients

__all__ = ["GradientRelease"]


class GradientRelease(Callback):
    """Free every optimizer's gradients right after its ``step()``.

    Lightning keeps a step's gradients until the next step's ``zero_grad``, which runs after that step's
    ``training_step``: the forward, where a step usually peaks, carries them. With this callback the peak
    drops by up to the gradients' bytes (measured: `MemoryMonitor`'s ``memory/gradients`` at the peak),
    and losses, parameters and optimizer state are bit-identical. Gradient accumulation is unaffected:
    gradients are freed only when the optimizer steps.

    Read gradients in ``on_before_optimizer_step`` (norms, clipping), not after the step: they are gone
    by ``on_train_batch_end``.

    Example::

        trainer = Trainer(callbacks=[GradientRelease(), MemoryMonitor()])
    """

    def __init__(self) -> None:
        self._handles: list[RemovableHandle] = []
        self._installed_for: tuple[int, ...] = ()

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        """Hook the optimizers that will step after this backward: checked at every backward, since
        `OptimizerSwap` installs its choice at the first batch."""
        key = tuple(map(id, trainer.optimizers))
        if key != self._installed_for:
            self._remove()
            self._handles = [release_gradients(optimizer) for optimizer in trainer.optimizers]
            self._installed_for = key

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._remove()

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._remove()  # Lightning calls neither on_train_end nor teardown then

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._remove()

    def _remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._installed_for = ()
