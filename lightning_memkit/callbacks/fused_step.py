"""FusedOptimizerStep: each parameter is updated inside backward, as soon as its gradient is complete.

The lever is `fuse_optimizer_step`; this callback installs it on the fit's optimizers (`StepHooks`: right
before a training backward, again whenever the optimizers or the trained parameters change, off for
validation, at the end of training and after an exception).
Lightning's loop is unchanged: it still calls ``training_step``, ``zero_grad``,
``backward`` and ``optimizer.step(closure)``; the parameters are updated inside that backward, and the step
after it finds no gradient and does nothing.

A callback rather than a strategy: the hooks compose with the strategy, precision and accelerator the
Trainer already has, and a set-up the fused step cannot serve is refused with the reason
(`FusedOptimizerStep.refusal`), not silently trained differently.
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.strategies import ModelParallelStrategy, SingleDeviceStrategy

from lightning_memkit._levers.fused_step import FusedStep, fuse_optimizer_step
from lightning_memkit.callbacks._step_hooks import StepHooks

__all__ = ["FusedOptimizerStep"]

_INSTEAD = "GradientRelease() frees the gradients after the step instead, and keeps the rest"


class FusedOptimizerStep(StepHooks):
    """Fuse every optimizer's step into backward: no step holds all the gradients at once.

    Lightning keeps all of a step's gradients from the backward to the next ``zero_grad``; with this
    callback each parameter is stepped and its gradient freed as soon as it is complete, so the peak holds
    at most the gradients still in flight. Training is the same as without it (bit-identical for torch's
    AdamW on the CPU); the optimizer, its learning-rate scheduler and its checkpointed state are the ones
    ``configure_optimizers`` returned.

    Refused, with the reason (the update would differ): gradient clipping (``gradient_clip_val``), gradient
    accumulation (``accumulate_grad_batches > 1``), the fp16 grad scaler (``precision="16-mixed"``;
    ``"bf16-mixed"`` and ``"bf16-true"`` are fine), a strategy over several processes that reduces
    gradients after backward (DDP, FSDP1, DeepSpeed, tensor parallelism), manual optimization, and
    optimizers that take a closure (LBFGS). The gradients never exist all at once: code that reads
    ``p.grad`` after backward (``on_after_backward``, ``on_before_optimizer_step``) finds ``None``; read a
    gradient in a parameter's own ``register_post_accumulate_grad_hook``, registered before this callback's
    (in ``setup``).
    Reentrant activation checkpointing (``torch.utils.checkpoint(..., use_reentrant=True)``) runs an inner
    backward per segment: a parameter used both inside and outside a segment would be stepped twice, on
    partial gradients; the default non-reentrant checkpointing (this package's, Hugging Face's) is safe.

    Under FSDP2 (``ModelParallelStrategy`` with ``fully_shard``, no tensor parallelism) each sharded
    parameter is stepped once its unit's reduce-scatter has handed it its gradient's shard.

    Example::

        trainer = Trainer(precision="bf16-true", callbacks=[FusedOptimizerStep(), MemoryMonitor()])
    """

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._refuse(trainer, pl_module)  # before the sanity check: what can be said at once

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._refuse(trainer, pl_module)  # again: AutoFit sets the accumulation in on_fit_start

    def installed_for(self, trainer: pl.Trainer) -> tuple[int, ...]:
        """The optimizers and the parameters each trains: a parameter unfrozen later
        (``BackboneFinetuning``) or a param group added must be stepped once, by its own hook, not by every
        other parameter's ``step()`` while its gradient waits."""
        return tuple(
            id(x)
            for optimizer in trainer.optimizers
            for x in (optimizer, *(p for g in optimizer.param_groups for p in g["params"] if p.requires_grad))
        )

    def install(self, trainer: pl.Trainer) -> list[FusedStep]:
        return [fuse_optimizer_step(trainer.optimizers)]

    def _refuse(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        why = refusal(trainer, pl_module)
        if why is not None:
            raise ValueError(f"FusedOptimizerStep cannot run here: {why}")


def refusal(trainer: pl.Trainer, pl_module: pl.LightningModule) -> str | None:
    """Why the optimizer step cannot be fused into backward in this fit (what, why, the fix), or ``None``.

    Each reason is something that needs all of a step's gradients before any parameter is updated."""
    if not pl_module.automatic_optimization:
        return (
            "the module uses manual optimization, where training_step decides when to step and clip. Call "
            "lightning_memkit.fuse_optimizer_step(optimizers) in training_step's set-up yourself, or "
            f"{_INSTEAD}."
        )
    if trainer.gradient_clip_val:
        return (
            f"gradient_clip_val={trainer.gradient_clip_val} clips by the norm of all gradients together, "
            "and inside backward each parameter is stepped before the others' gradients exist. Drop "
            f"gradient_clip_val, or {_INSTEAD}."
        )
    if trainer.accumulate_grad_batches > 1:
        return (
            f"accumulate_grad_batches={trainer.accumulate_grad_batches} adds several backward passes' "
            "gradients before one step; the fused step updates at every backward. Use "
            f"accumulate_grad_batches=1 (a larger micro-batch, which the fused step leaves room for), or "
            f"{_INSTEAD}."
        )
    if getattr(trainer.precision_plugin, "scaler", None) is not None:
        return (
            f'precision="{trainer.precision}" scales the loss and skips steps whose gradients hold inf or '
            'NaN, which it knows only after backward. Use precision="bf16-mixed" (or "bf16-true"), which '
            f"needs no scaler, or {_INSTEAD}."
        )
    if isinstance(trainer.strategy, ModelParallelStrategy):
        # FSDP2 runs a sharded parameter's post-accumulate-grad hooks once its reduce-scatter has given it
        # the reduced shard of its gradient: the fused step updates the shard. Tensor parallelism reduces
        # some gradients elsewhere.
        tensor_parallel = trainer.strategy.device_mesh["tensor_parallel"].size()
        if tensor_parallel == 1:
            return None
        return (
            f"tensor_parallel_size={tensor_parallel}: tensor parallelism leaves some gradients partial "
            "(summed across the tensor-parallel ranks later), so a step inside backward would use one "
            f"rank's part. Use ModelParallelStrategy(tensor_parallel_size=1) (FSDP2 alone), or {_INSTEAD}."
        )
    if not isinstance(trainer.strategy, SingleDeviceStrategy):
        return (
            f"{type(trainer.strategy).__name__} reduces each gradient across the {trainer.world_size} "
            "processes after it is computed; a step inside backward would use this process's gradient "
            f"alone. Train on one device, or {_INSTEAD}."
        )
    return None
