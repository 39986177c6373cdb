"""GradientRelease: free the gradients once the optimizer has stepped, so the next forward runs without them.

The lever is `release_gradients`; this callback installs it on every optimizer of the fit. It acts in
``on_train_start``, after the strategy has built the optimizers and after `OptimizerSwap` (which decides
in ``on_fit_start``) has swapped them, and removes its hooks when training ends. Training is
bit-identical with and without it (``tests/test_gradient_release.py``); the budget callbacks in the same
Trainer (`AutoFit`, `ActivationCheckpointing`, `OptimizerSwap`) see it and estimate the step without the
previous step's gradients in the forward.
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
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

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._remove()
        self._handles = [release_gradients(optimizer) for optimizer in trainer.optimizers]

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._remove()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._remove()  # also after an exception, where on_train_end is not called

    def _remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
