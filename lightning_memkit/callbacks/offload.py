"""OptimizerOffload: the optimizer's state, fp32 master weights and gradient accumulation in host memory.

The lever is `offload_optimizer`; this callback installs it on the fit's optimizers (`StepHooks`: right
before a training backward, again whenever the optimizers or the trained parameters change) and keeps the
masters across installs and in checkpoints. Lightning's loop is unchanged: ``training_step``,
``zero_grad``, ``backward``, gradient clipping and ``optimizer.step(closure)`` run as always, on an
optimizer whose param groups hold the host masters.

Resume without a device spike: Lightning loads a checkpoint's optimizer state onto the device
(``_optimizer_to_device``) before training starts, which for a model that only fits because its optimizer
state is elsewhere is an OOM. ``on_load_checkpoint`` therefore hands Lightning the param groups only, and
the state is loaded straight onto the host masters when the hooks are installed.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import SingleDeviceStrategy
from torch.utils.weak import WeakIdKeyDictionary

from lightning_memkit._levers.fused_step import needs_closure
from lightning_memkit._levers.offload import Offload, offload_optimizer
from lightning_memkit.callbacks._step_hooks import StepHooks
from lightning_memkit.callbacks.fused_step import FusedOptimizerStep

__all__ = ["OptimizerOffload"]


class OptimizerOffload(StepHooks):
    """Keep every optimizer's state, fp32 master weights and the gradients' accumulation in host memory.

    The device holds the weights in the run's precision and the gradients of the backward in flight,
    nothing of the optimizer: with ``precision="bf16-true"`` a 7B model's AdamW needs 13.5 GB on the device
    instead of 108 GB (and 94 GB of host memory: masters, their fp32 gradients, AdamW's moments). The update
    is computed on fp32 masters, so 16-bit weights lose no small step. Gradient accumulation and gradient
    clipping work as usual (both act on the host's gradients). Training with fp32 weights is the same as
    without it (bit-identical on the CPU). It costs time: each micro-batch's gradients travel to the host,
    the weights back after each step, and the update runs on the host's cores.

    Refused, with the reason: several processes (DDP and the sharded strategies reduce each gradient after
    the hook has moved it), the fp16 grad scaler (``precision="16-mixed"``), manual optimization,
    optimizers that take a closure (LBFGS), and `FusedOptimizerStep` beside it (in either order: the device
    already holds only the gradients in flight). Code that reads ``p.grad`` of the module after backward
    finds ``None``; the gradients are the optimizer's parameters' (``optimizer.param_groups``), on the host.

    Example::

        trainer = Trainer(precision="bf16-true", accumulate_grad_batches=16, callbacks=[OptimizerOffload()])
    """

    def __init__(self) -> None:
        super().__init__()
        self._masters = WeakIdKeyDictionary()  # device parameter -> host master, kept across installs
        self._offload: Offload | None = None
        self._loaded_masters: list[torch.Tensor] | None = None
        self._loaded_states: list[dict[str, Any]] | None = None

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (a spawned process, a deepcopy) without what belongs to this process's fit: the masters
        are keyed by the live parameters, the installed hooks by this process's tensors; a checkpoint
        (`state_dict`) is what carries the masters across processes."""
        state = self.__dict__.copy()
        state.update(_masters=None, _offload=None, _handles=[], _installed_for=None)
        state.pop("_trainer", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._masters = WeakIdKeyDictionary()

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._refuse(trainer, pl_module)
            self._loaded_masters = self._loaded_states = None  # a checkpoint of an earlier fit's

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._refuse(trainer, pl_module)

    def installed_for(self, trainer: pl.Trainer) -> tuple[int, ...]:
        device = self._offload.device_param if self._offload is not None else (lambda t: t)
        return tuple(
            id(x)
            for optimizer in trainer.optimizers
            for x in (
                optimizer,
                *(p for g in optimizer.param_groups for p in map(device, g["params"]) if p.requires_grad),
            )
        )

    def install(self, trainer: pl.Trainer) -> list[Offload]:
        params = [p for opt in trainer.optimizers for g in opt.param_groups for p in g["params"]]
        if self._loaded_masters is not None:  # a resumed fit: the fp32 masters the checkpoint kept
            for p, master in zip(params, self._loaded_masters, strict=True):
                self._masters[p] = master
            self._loaded_masters = None
        self._offload = offload_optimizer(trainer.optimizers, masters=self._masters)
        if self._loaded_states is not None:
            for optimizer, saved in zip(trainer.optimizers, self._loaded_states, strict=True):
                # Cast onto the masters (host, their dtype); the groups are the live ones (a scheduler's).
                groups = optimizer.state_dict()["param_groups"]
                optimizer.load_state_dict({"state": saved, "param_groups": groups})
            self._loaded_states = None
        return [self._offload]

    def _remove(self) -> None:
        super()._remove()
        self._offload = None

    # --- checkpoints ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The fp32 masters of 16-bit weights (in the optimizers' parameter order), which the weights in the
        checkpoint hold only rounded; nothing when the weights are the masters' dtype. Masters loaded from
        a checkpoint and not yet installed (a resumed fit that trained nothing) are given back as loaded."""
        if self._loaded_masters is not None:
            return {"masters": self._loaded_masters}
        trainer = getattr(self, "_trainer", None)
        if trainer is None:
            return {}
        offload = self._offload
        device = offload.device_param if offload is not None else (lambda t: t)
        params = [device(p) for opt in trainer.optimizers for g in opt.param_groups for p in g["params"]]
        masters = [self._masters.get(p) for p in params]
        pairs = zip(masters, params, strict=True)
        if any(m is None for m in masters) or all(m.dtype == p.dtype for m, p in pairs):
            return {}
        return {"masters": masters}  # saved as they are now: no second host copy

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._loaded_masters = state_dict.get("masters")

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if self._loaded_states is not None:  # loaded, not installed yet: the state is still ours to keep
            for saved, state in zip(
                checkpoint.get("optimizer_states", []), self._loaded_states, strict=False
            ):
                saved["state"] = state

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        states = checkpoint.get("optimizer_states")
        if states:
            self._loaded_states = [state["state"] for state in states]
            checkpoint["optimizer_states"] = [{**state, "state": {}} for state in states]

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._trainer = trainer

    def _refuse(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        why = refusal(trainer, pl_module)
        if why is not None:
            raise ValueError(f"OptimizerOffload cannot run here: {why}")


def refusal(trainer: pl.Trainer, pl_module: pl.LightningModule) -> str | None:
    """Why the optimizer cannot be offloaded in this fit (what, why, the fix), or ``None``."""
    if not pl_module.automatic_optimization:
        return (
            "the module uses manual optimization, where training_step steps the optimizer itself. Call "
            "lightning_memkit.offload_optimizer(optimizer) in its set-up instead."
        )
    if any(isinstance(c, FusedOptimizerStep) for c in trainer.callbacks):
        return (
            "FusedOptimizerStep is among the callbacks too. The offloaded optimizer updates the host's "
            "masters after backward, once their gradients have arrived; a step fused into backward would "
            "update the device's weights while this callback is moving their gradients to the host. The two "
            "do not combine, and need not: with OptimizerOffload the device already holds only the gradients "
            "of the backward in flight. Keep OptimizerOffload to take the optimizer off the device, or "
            "FusedOptimizerStep to keep its state there and skip the transfers."
        )
    if getattr(trainer.precision_plugin, "scaler", None) is not None:
        return (
            f'precision="{trainer.precision}" unscales and checks the gradients for inf on the device, '
            'after backward, and the gradients have left for the host by then. Use precision="bf16-mixed" '
            'or "bf16-true", which need no scaler.'
        )
    if not isinstance(trainer.strategy, SingleDeviceStrategy):
        return (
            f"{type(trainer.strategy).__name__} reduces each gradient across the {trainer.world_size} "
            "processes after backward, and the hook moves it to the host before that. Train on one device, "
            "or use the strategy's own offloading (DeepSpeed ZeRO-Offload, FSDP's CPUOffload)."
        )
    for optimizer in trainer.optimizers:
        if needs_closure(optimizer):
            name = type(optimizer).__name__
            return f"{name} re-evaluates the loss in step(closure), inside Lightning's: use another."
    return None
