"""OptimizerSwap: train with a lighter optimizer when the configured one does not fit the memory budget.

The catalogue, the translation rules and the decision live in `lightning_memkit._optim`; this callback
picks the moment and installs the result in the Trainer.

When. A fresh run decides in ``on_train_batch_start`` of its first batch: the strategy has built the
optimizers and schedulers, no optimizer has state yet, and the batch is the very one the step will see
(after the transfer hooks), so the estimate simulates exactly that step. A resumed run must build the
*stored* choice before Lightning loads the optimizer state from the checkpoint (8-bit state does not load
into AdamW). Lightning restores callback state before ``strategy.setup`` and optimizer state after
``on_fit_start`` (``Trainer._run``: ``_restore_modules_and_callbacks`` -> ``strategy.setup`` ->
``on_fit_start`` -> ``restore_training_state``), so the stored choice is built in ``on_fit_start``.

How. ``trainer.strategy.optimizers`` is replaced (its setter also rebuilds the ``LightningOptimizer``
wrappers that ``self.optimizers()`` returns) and every LR scheduler of a replaced optimizer is rebound to
the new one, its learning rates scaled by the translation rule, so a warmup-cosine keeps its shape.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.optim import Optimizer

from lightning_memkit._breakdown import MemoryBreakdown, MiB
from lightning_memkit._budget import Budget, parse_budget
from lightning_memkit._optim import (
    CATALOGUE,
    DEFAULT_CANDIDATES,
    Estimator,
    OptimizerChoice,
    _validate_candidates,
    choose,
    identify,
    lr_factor,
    rebind_scheduler,
    simulated_estimator,
    static_estimator,
    swap_optimizer,
)
from lightning_memkit.callbacks._trainer import accumulates, ddp_bucket_bytes, precision


class OptimizerSwap(Callback):
    r"""Replace the configured optimizer with the best lighter one whose training step fits ``budget``.

    Before the first training step, the step is estimated with the optimizer ``configure_optimizers``
    returned (`estimate_memory`: the LightningModule's own step on fake tensors, with the first batch and
    the Trainer's precision). If it fits, nothing changes. Otherwise the ``candidates`` are tried in
    order and the first that fits replaces it: same param groups (per-group ``lr`` and
    ``weight_decay`` translated, see `lightning_memkit._optim` for the rules), LR schedulers rebound
    with their shape kept. The decision is printed with its numbers and stored in checkpoints; a run
    resumed from one builds the same optimizer and loads its state.

    Logged once, at the decision (memory keys in **MiB**, 2**20 bytes):

    - ``optimizer_swap/peak``: the estimated step peak with the optimizer trained with.
    - ``optimizer_swap/optimizer_state``: its optimizer state in that estimate.
    - ``optimizer_swap/budget``: the budget.
    - ``optimizer_swap/swapped``: 1 if the optimizer was replaced, else 0.
    - hyperparameter ``optimizer_swap/optimizer``: the catalogue name trained with (``"unknown"`` for an
      optimizer outside the catalogue that was kept).

    Behaviour in the less common set-ups:

    - **Manual optimization / several optimizers**: the step cannot be simulated, so the decision is on
      parameters + gradients + optimizer state (leave room for activations in ``budget``). Every known
      optimizer is swapped to the same candidate, deciding on their sum. ``self.optimizers()`` returns
      the new ones (Lightning rebuilds its wrappers from ``trainer.strategy.optimizers``); do not keep
      references to optimizers taken before the first training batch.
    - **Optimizers outside the catalogue** (see ``CATALOGUE``; e.g. RMSprop, a subclass of AdamW, any
      optimizer with ``maximize=True``): left alone with a warning unless ``allow_unknown=True``, which
      reads their ``lr`` and ``weight_decay`` as AdamW's.
    - **bitsandbytes missing or failing to load**: the candidates that need it (8-bit ones and Lion) are
      skipped with one info line.
    - **Strategies that wrap or shard the optimizer and restore its state themselves** (DeepSpeed, FSDP,
      ModelParallel): the callback warns at setup and does nothing.
    - **Resuming** from a checkpoint saved with this callback builds the stored choice, whatever the
      budget is now (the checkpoint holds that optimizer's state). A checkpoint saved without it is
      decided afresh; a swap then starts the new optimizer's state from zero.
    - **Nothing fits**: ``ValueError`` at the first batch, with the numbers and what else could help.
    - The estimate runs ``training_step`` once more, on fake tensors (``self.log`` is a no-op there):
      other Python side effects in it, such as appending ``loss.item()`` to a list, happen once more.
    - Optimizer hooks registered on the original optimizer are not carried over; LR schedulers that
      cycle momentum (``OneCycleLR``, ``CyclicLR``) keep writing the original's momentum key.

    Args:
        budget: what one training step may use at its peak, per device: bytes, a size (``"24GiB"``), a
            GPU name (``"A100-40GB"``), a fraction of the current CUDA device (``0.9``) or ``"auto"``
            (`lightning_memkit._budget.parse_budget`; devices lose the CUDA context and a fragmentation
            reserve).
        candidates: catalogue names to try, best first (default: adamw, adamw8bit, lion, lion8bit,
            adafactor, sgd_momentum, sgd).
        allow_unknown: also swap optimizers the catalogue does not know.

    Example::

        model = GPTLightningModule("gpt2")  # AdamW, decay / no-decay groups, warmup-cosine
        trainer = Trainer(callbacks=[OptimizerSwap(budget="24GiB")], precision="bf16-mixed")
        trainer.fit(model, GPTDataModule())
        # OptimizerSwap: AdamW -> adamw8bit: estimated step peak 25.1 GiB is over the budget ...
    """

    def __init__(
        self,
        budget: int | float | str | Budget,
        candidates: Sequence[str] = DEFAULT_CANDIDATES,
        allow_unknown: bool = False,
    ) -> None:
        self._budget_spec = budget
        #: Bytes the step's peak may reach; read from the device in ``setup`` for ``"auto"`` or a fraction.
        self.budget: int | None = None if _reads_device(budget) else parse_budget(budget).usable
        self.candidates = _validate_candidates(candidates)
        self.allow_unknown = allow_unknown
        #: The decision, once made (``None`` before the first batch, and in a resumed run).
        self.choice: OptimizerChoice | None = None
        self._state: dict[str, Any] = {}  # what state_dict() saves; set by the decision or a checkpoint
        self._disabled = False

    # --- Lightning hooks ----------------------------------------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if self.budget is None:
            self.budget = parse_budget(self._budget_spec).usable
        strategy = trainer.strategy
        if strategy.restore_checkpoint_after_setup or not strategy.lightning_restore_optimizer:
            rank_zero_warn(
                f"OptimizerSwap does nothing with {type(strategy).__name__}: it wraps or shards the "
                "optimizer and restores its state itself. Configure the lighter optimizer in "
                "configure_optimizers, or let the strategy shard the optimizer state (ZeRO / FSDP) instead."
            )
            self._disabled = True

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._disabled or not self._state:
            return
        # Resuming: build the stored choice now, before Lightning loads the optimizer state into it.
        name = self._state.get("optimizer")
        if self._state.get("swapped", False) and name in CATALOGUE:
            allow = self._state.get("allow_unknown", self.allow_unknown)
            old = list(trainer.strategy.optimizers)
            new = [self._swap(o, name, allow) for o in old]
            self._install(trainer, old, new, name)
            rank_zero_info(f"OptimizerSwap: resumed with {name}, as stored in the checkpoint.")

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._disabled or self._state:
            return
        assert self.budget is not None  # resolved in setup
        old = list(trainer.strategy.optimizers)
        estimate, method = self._estimator(trainer, pl_module, batch)
        choice = choose(
            old, self.budget, estimate, candidates=self.candidates, allow_unknown=self.allow_unknown,
            method=method, info=rank_zero_info, warn=rank_zero_warn,
        )  # fmt: skip
        # Every rank must train with the same optimizer: rank 0's decision holds.
        local = choice.name if choice.changed else None
        name = trainer.strategy.broadcast(local, src=0)
        if name != local:
            new = old if name is None else [self._swap(o, name, self.allow_unknown) for o in old]
            choice = OptimizerChoice(name, choice.originals, tuple(new), tuple(old), self.budget, None)
        if choice.changed:
            if any(o.state for o in old):
                rank_zero_warn(
                    "OptimizerSwap replaces an optimizer that already holds state (from a checkpoint saved "
                    "without OptimizerSwap?); the new optimizer starts from zero state."
                )
            self._install(trainer, old, list(choice.optimizers), choice.name)
        self.choice = choice
        self._state = {
            "optimizer": choice.name,
            "swapped": choice.changed,
            "originals": list(choice.originals),
            "allow_unknown": self.allow_unknown,
            "budget": self.budget,
            "peak": choice.peak,
            "optimizer_state": choice.state_bytes,
        }
        rank_zero_info(f"OptimizerSwap: {choice.summary()}")
        self._log(trainer, choice)

    def state_dict(self) -> dict[str, Any]:
        return dict(self._state)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "swapped" not in state_dict:  # saved before the first batch: nothing was decided yet
            return
        self._state = {
            "optimizer": state_dict.get("optimizer"),
            "swapped": state_dict.get("swapped", False),
            "originals": state_dict.get("originals", []),
            "allow_unknown": state_dict.get("allow_unknown", self.allow_unknown),
            "budget": state_dict.get("budget", self.budget),
            "peak": state_dict.get("peak"),
            "optimizer_state": state_dict.get("optimizer_state"),
        }

    # --- helpers ------------------------------------------------------------------------------

    @staticmethod
    def _estimator(trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> tuple[Estimator, str]:
        device = trainer.strategy.root_device.type
        device = device if device in ("cuda", "cpu") else "cpu"
        if pl_module.automatic_optimization and len(trainer.strategy.optimizers) == 1:
            estimator = simulated_estimator(
                pl_module,
                batch,
                precision=precision(trainer),
                device=device,
                accumulating=accumulates(trainer),
            )
            method = "simulated"
        else:
            rank_zero_info(
                "OptimizerSwap: manual optimization cannot be simulated, so the budget is checked against "
                "parameters + gradients + optimizer state only; leave room for activations in it."
            )
            estimator, method = static_estimator(pl_module, device=device), "static"
        buckets = ddp_bucket_bytes(trainer, pl_module)
        if not buckets:
            return estimator, method

        def with_buckets(optimizers: Sequence[Optimizer]) -> MemoryBreakdown:
            step = estimator(optimizers)  # and DDP's all-reduce buckets, there all along
            return replace(step, gradients=step.gradients + buckets)

        return with_buckets, method

    @staticmethod
    def _swap(optimizer: Optimizer, name: str, allow_unknown: bool) -> Optimizer:
        if allow_unknown or identify(optimizer) is not None:
            return swap_optimizer(optimizer, name, allow_unknown=True)
        return optimizer

    @staticmethod
    def _install(trainer: pl.Trainer, old: list[Optimizer], new: list[Optimizer], name: str | None) -> None:
        trainer.strategy.optimizers = new  # the setter rebuilds the LightningOptimizer wrappers too
        for config in trainer.strategy.lr_scheduler_configs:
            for before, after in zip(old, new, strict=True):
                if config.scheduler.optimizer is before and after is not before:
                    assert name is not None
                    rebind_scheduler(config.scheduler, after, lr_factor(identify(before), name))

    @staticmethod
    def _log(trainer: pl.Trainer, choice: OptimizerChoice) -> None:
        metrics = {
            "optimizer_swap/budget": choice.budget / MiB,
            "optimizer_swap/swapped": float(choice.changed),
        }
        if choice.breakdown is not None:
            metrics["optimizer_swap/peak"] = choice.breakdown.peak / MiB
            metrics["optimizer_swap/optimizer_state"] = choice.breakdown.optimizer_state / MiB
        for logger in trainer.loggers:
            logger.log_hyperparams({"optimizer_swap/optimizer": choice.name or "unknown"})
            logger.log_metrics(metrics, step=trainer.global_step)


def _reads_device(budget: Any) -> bool:
    """``"auto"`` and fractions are read from the CUDA device, once the run is on it."""
    return isinstance(budget, float) or (isinstance(budget, str) and budget.strip().lower() == "auto")
