"""GradientRelease: free the gradients once the optimizer has stepped, so the next forward runs without them.

The lever is `release_gradients`; this callback installs it on every optimizer of the fit (`StepHooks`:
right before a training backward, again if the optimizers change, off when training ends or fails).
Training is bit-identical with and without it (``tests/levers/test_gradient_release.py``); the budget
callbacks in the same Trainer (`AutoFit`, `ActivationCheckpointing`, `OptimizerSwap`) see it and estimate the
step without the previous step's gradients in the forward.
"""

from __future__ import annotations

import lightning.pytorch as pl
from torch.utils.hooks import RemovableHandle

from lightning_memkit._levers.gradient_release import release_gradients
from lightning_memkit.callbacks._step_hooks import StepHooks

__all__ = ["GradientRelease"]


class GradientRelease(StepHooks):
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

    def installed_for(self, trainer: pl.Trainer) -> tuple[int, ...]:
        return tuple(map(id, trainer.optimizers))

    def install(self, trainer: pl.Trainer) -> list[RemovableHandle]:
        return [release_gradients(optimizer) for optimizer in trainer.optimizers]
