"""OptimizerSwap: train with a lighter optimizer when the configured one does not fit the memory budget.

The catalogue and its translation rules (`lightning_memkit.CATALOGUE`, `lightning_memkit.swap_optimizer`)
and the decision (`lightning_memkit.fit_optimizer`, here over the Trainer's own estimate) are plain
functions that need no Trainer; this callback picks the moment and installs the result in the Trainer.

When. Each fit starts from nothing in ``setup`` (a reused callback decides afresh for the new model); a
resumed fit gets its stored choice back in ``load_state_dict``, which Lightning calls after ``setup``.
A fresh fit decides in ``on_fit_start``: the strategy has built the optimizers and schedulers, and no
forward has run yet (not even the sanity check), so a budget nothing fits fails before any training
work. The simulated estimate needs the step's batch: the first batch of the training dataloader, taken
with the transfer hooks applied, the RNG streams (torch's, Python's ``random``, NumPy's) and the loader's
generators put back afterwards, so the epoch still starts with that very batch. The choice is installed at
the first training batch, after Lightning has loaded any optimizer state (a checkpoint saved without this
callback). Where no batch can be taken at fit start (an empty loader), the first training batch
decides, as it installs.

A resumed run must build the *stored* choice before Lightning loads the optimizer state from the
checkpoint (8-bit state does not load into AdamW). Lightning restores callback state before
``strategy.setup`` and optimizer state after ``on_fit_start`` (``Trainer._run``: ``setup`` ->
``_restore_modules_and_callbacks`` -> ``strategy.setup`` -> ``on_fit_start`` ->
``restore_training_state``), so the stored choice is built in ``on_fit_start``.

How. ``trainer.strategy.optimizers`` is replaced (its setter also rebuilds the ``LightningOptimizer``
wrappers that ``self.optimizers()`` returns) and every LR scheduler of a replaced optimizer is rebound to
the new one, every learning rate it holds (``base_lrs``, floors such as ``eta_min``) scaled by the
translation rule, so its schedule keeps its shape: every later lr is the original's times that factor,
for each of torch's schedulers (`lightning_memkit.rebind_scheduler`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.optim import Optimizer

from lightning_memkit._breakdown import MemoryBreakdown, MiB
from lightning_memkit._budget import Budget, BudgetSetting, flag, parse_budget
from lightning_memkit._optimizers.choice import (
    Estimator,
    OptimizerChoice,
    choose_optimizer,
    compensated_candidates,
    simulated_estimator,
    static_estimator,
)
from lightning_memkit._optimizers.schedulers import rebind_scheduler
from lightning_memkit._optimizers.swap import (
    CATALOGUE,
    DEFAULT_CANDIDATES,
    identify,
    lr_factor,
    swap_optimizer,
    valid_candidates,
)
from lightning_memkit.callbacks._trainer import (
    autofit_in,
    call_logger,
    ddp_bucket_bytes,
    first_batch,
    on_rank_zero,
    precision,
    trainer_step,
)


class OptimizerSwap(Callback):
    r"""Replace the configured optimizer with the best lighter one whose training step fits ``budget``.

    At the start of the fit, before the sanity check and any forward, the step is estimated with the
    optimizer ``configure_optimizers`` returned (`lightning_memkit.estimate_memory`: the
    LightningModule's own step on fake tensors, with the first training batch and the Trainer's
    precision). If it fits, nothing changes. Otherwise the ``optimizers`` are tried in order and the
    first that fits replaces it, at the first training batch: same param groups (per-group ``lr`` and
    ``weight_decay`` translated, see `lightning_memkit.swap_optimizer` for the rules), LR schedulers
    rebound with their shape kept. The decision (`lightning_memkit.fit_optimizer`'s, over the Trainer's
    step) is printed with its numbers and stored in checkpoints; a run resumed from one builds the same
    optimizer and loads its state. Every ``trainer.fit`` decides afresh for the model it is given, also
    with a callback reused from an earlier fit.

    Logged once, at the first training batch (memory keys in **MiB**, 2**20 bytes):

    - ``optimizer_swap/peak``: the estimated step peak with the optimizer trained with.
    - ``optimizer_swap/optimizer_state``: its optimizer state in that estimate.
    - ``optimizer_swap/budget``: the budget.
    - ``optimizer_swap/swapped``: 1 if the optimizer was replaced, else 0.
    - hyperparameter ``optimizer_swap/optimizer``: the catalogue name trained with (``"unknown"`` for an
      optimizer outside the catalogue that was kept).

    Behaviour in the less common set-ups:

    - **Nothing fits**: ``ValueError`` in ``on_fit_start``, before the sanity check and any forward or
      optimizer step, with each candidate's estimate against the budget (a decimal-unit budget is shown in
      MiB too: ``"60MB (57.22 MiB)"``) and what else could help: a larger budget, the
      ``ActivationCheckpointing`` callback, a smaller micro-batch, lower precision, sharding.
    - **The first batch** is taken from the training dataloader at fit start (its ``train_dataloader()``
      is called once more, and iterated for one batch), and ``on_before_batch_transfer``,
      ``transfer_batch_to_device`` and ``on_after_batch_transfer`` run on it once more. The RNG streams
      (torch's, Python's ``random``, NumPy's) and the loader's and sampler's generators are put back, so
      the training data, augmentation included, is unchanged.
    - **Manual optimization / several optimizers**: the step cannot be simulated, so the decision is on
      parameters + gradients + optimizer state (leave room for activations in ``budget``). Every known
      optimizer is swapped to the same candidate, deciding on their sum. ``self.optimizers()`` returns
      the new ones (Lightning rebuilds its wrappers from ``trainer.strategy.optimizers``); do not keep
      references to optimizers taken before the first training batch.
    - **Optimizers outside the catalogue** (see `lightning_memkit.CATALOGUE`; e.g. RMSprop, a subclass of
      AdamW, any optimizer with ``maximize=True``): left alone with a warning unless
      ``allow_unknown=True``, which reads their ``lr`` and ``weight_decay`` as AdamW's.
    - **Optimizers whose step() needs a closure** (``torch.optim.LBFGS``): never swapped. Replacing a
      line-search quasi-Newton method with a first-order one changes the algorithm, not its memory, and its
      step cannot be simulated without running it; ``allow_unknown=True`` with one raises ``ValueError``
      at fit start, ``allow_unknown=False`` leaves it alone with a warning.
    - **bitsandbytes missing or failing to load**: the candidates that need it (8-bit ones and Lion) are
      skipped with one info line.
    - **Strategies that wrap or shard the optimizer and restore its state themselves** (DeepSpeed, FSDP):
      the callback warns at setup and does nothing. Under ``ModelParallelStrategy`` (FSDP2) it defers to
      `AutoFitStrategy`, which chooses the optimizer for one rank's sharded step, and says so.
    - **Beside** `AutoFit`, in either order: this callback defers, and says so. AutoFit chooses the
      optimizer with the micro-batch and the checkpointing, from the module's own and then ``optimizers``
      (unless it is given ``optimizers=`` itself), and keeps the choice in its own checkpoint state.
    - **Resuming** from a checkpoint saved with this callback: pass an ``OptimizerSwap`` to the resumed
      Trainer too. It builds the stored choice whatever its own ``budget``, ``optimizers`` and
      ``allow_unknown`` are now (the checkpoint holds that optimizer's state; the state is found under
      the key ``"OptimizerSwap"``). A Trainer without it cannot read the choice: Lightning warns ("Please
      add the following callbacks: ['OptimizerSwap']") and loads the swapped optimizer's state into the
      configured one, whose first step then fails (``KeyError: 'exp_avg'`` for AdamW after Lion). A
      checkpoint saved without this callback is decided afresh; a swap then starts the new optimizer's
      state from zero.
    - The estimate runs ``training_step`` once more, on fake tensors (``self.log`` is a no-op there):
      other Python side effects in it, such as appending ``loss.item()`` to a list, happen once more.
    - Optimizer hooks registered on the original optimizer are not carried over. LR schedulers that
      cycle momentum (``OneCycleLR``, ``CyclicLR``) cycle the new optimizer's ``betas`` or ``momentum``;
      where it has neither (Adafactor, SGD without momentum) the momentum cycle is dropped, with a warning.

    Args:
        budget: what one training step may use at its peak, per device: bytes, a size (``"24GiB"``), a
            GPU name (``"A100-40GB"``, ``"H200"``), a fraction of the current CUDA device (``0.9``) or
            ``"auto"`` (`lightning_memkit.parse_budget`; devices lose the CUDA context and a
            fragmentation reserve).
        optimizers: catalogue names to try, best first (default: adamw, adamw8bit, lion, lion8bit,
            adafactor, sgd_momentum, sgd); `AutoFit`'s word for the same list.
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
        optimizers: Sequence[str] = DEFAULT_CANDIDATES,
        allow_unknown: bool = False,
    ) -> None:
        if budget is None:  # the one callback that cannot run without one
            parse_budget(budget)  # the error every budget gets that is no size
        self._budget = BudgetSetting(budget)
        if not isinstance(optimizers, Iterable):  # a name alone is one candidate
            raise TypeError(
                f"optimizers must be an optimizer name or a list of them from {', '.join(CATALOGUE)}; got "
                f"{optimizers!r} ({type(optimizers).__name__})"
            )
        #: The catalogue names to try, best first.
        self.optimizers = valid_candidates(optimizers)
        self.allow_unknown = flag("allow_unknown", allow_unknown)
        self._reset()

    @property
    def budget(self) -> int | None:
        """Bytes the step's peak may reach (``None`` until ``setup`` for ``"auto"`` or a fraction)."""
        return self._budget.usable

    def _reset(self) -> None:
        """What one fit decides: a second fit (another model, another batch) starts from nothing."""
        #: The decision, once installed (``None`` before the first training batch, and in a resumed run).
        self.choice: OptimizerChoice | None = None
        self._state: dict[str, Any] = {}  # what state_dict() saves; set at the install or by a checkpoint
        # Made in on_fit_start, installed at the first batch: (name to swap to, or None to keep; rank 0's
        # full choice, or None on the other ranks).
        self._decision: tuple[str | None, OptimizerChoice | None] | None = None
        self._disabled = False
        self._beside_autofit = False  # deferring to an AutoFit in the fit (`setup`)
        self._warned: set[str] = set()  # the loggers' failures said (`call_logger`)

    # --- Lightning hooks ----------------------------------------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._reset()  # a resumed fit gets its stored choice back in load_state_dict, called after setup
        self._budget.resolve()  # "auto" and fractions: this fit's device
        strategy = trainer.strategy
        if isinstance(strategy, ModelParallelStrategy):
            # FSDP2: the strategy shards the optimizer and loads its state after on_fit_start, so a swap
            # there could not be resumed. AutoFitStrategy chooses the optimizer for the sharded step.
            if hasattr(strategy, "autofit"):  # AutoFitStrategy
                why = (
                    "which chooses the optimizer for every rank's sharded step itself: remove OptimizerSwap."
                )
            else:
                why = (
                    "which shards the optimizer and restores its state after the fit has started, where a "
                    "swapped optimizer could not be resumed. Use Trainer(strategy=AutoFitStrategy(budget="
                    f"{self._budget.given!r})): it chooses the optimizer (with the micro-batch, "
                    "checkpointing and resharding) for one rank's sharded step, and keeps the choice in the "
                    "checkpoint."
                )
            rank_zero_warn(f"OptimizerSwap defers to {type(strategy).__name__}, {why}")
            self._disabled = True
        elif (planner := autofit_in(trainer)) is not None:
            among = (
                f"among AutoFit's optimizers={tuple(planner.optimizers)!r}"
                if planner.optimizers is not None
                else f"among the module's own and then this callback's candidates {self.optimizers!r}"
            )
            rank_zero_info(
                f"OptimizerSwap defers to AutoFit (its budget={self._budget.given!r} is not used): AutoFit "
                f"chooses the optimizer together with the micro-batch and the checkpointing, {among}; its "
                "choice is AutoFit.plan.optimizer."
            )
            self._disabled = self._beside_autofit = True
        elif strategy.restore_checkpoint_after_setup or not strategy.lightning_restore_optimizer:
            rank_zero_warn(
                f"OptimizerSwap does nothing with {type(strategy).__name__}: it wraps or shards the "
                "optimizer and restores its state itself. Configure the lighter optimizer in "
                "configure_optimizers, or let the strategy shard the optimizer state (ZeRO / FSDP) instead."
            )
            self._disabled = True

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._disabled:
            return
        if self._state:  # resuming: build the stored choice now, before Lightning loads its state
            self._resume(trainer)
        else:  # before the sanity check: a budget nothing fits fails before any forward
            self._decide(trainer, pl_module, lambda: first_batch(trainer))

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._disabled or self._state:
            return
        if self._decision is None:  # no batch could be taken at fit start: this one decides
            self._decide(trainer, pl_module, lambda: batch)
        self._apply(trainer)

    def state_dict(self) -> dict[str, Any]:
        return dict(self._state)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "swapped" not in state_dict:  # saved before the first batch: nothing was decided yet
            return
        if self._beside_autofit and state_dict.get("swapped"):
            raise RuntimeError(
                f"The checkpoint was trained with OptimizerSwap's choice, {state_dict.get('optimizer')}, "
                "whose state it holds; beside AutoFit, OptimizerSwap defers and AutoFit plans the optimizer "
                "afresh, which cannot load that state. Resume as the run was saved: without AutoFit, with "
                "OptimizerSwap among the callbacks."
            )
        self._state = {
            "optimizer": state_dict.get("optimizer"),
            "swapped": state_dict.get("swapped", False),
            "originals": state_dict.get("originals", []),
            "allow_unknown": state_dict.get("allow_unknown", self.allow_unknown),
            "budget": state_dict.get("budget", self.budget),
            "peak": state_dict.get("peak"),
            "optimizer_state": state_dict.get("optimizer_state"),
        }

    # --- the decision and its install ---------------------------------------------------------

    def _resume(self, trainer: pl.Trainer) -> None:
        name = self._state.get("optimizer")
        if self._state.get("swapped", False) and name in CATALOGUE:
            allow = self._state.get("allow_unknown", self.allow_unknown)
            old = list(trainer.strategy.optimizers)
            new = [self._swap(o, name, allow) for o in old]
            self._install(trainer, old, new, name)
            rank_zero_info(f"OptimizerSwap: resumed with {name}, as stored in the checkpoint.")

    def _decide(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, first_batch: Callable[[], Any]
    ) -> None:
        """Rank 0 estimates and chooses; every rank learns the name to swap to (``None``: keep). Leaves
        ``_decision`` unset when the step needs a batch and ``first_batch()`` has none."""
        budget = self._budget.budget
        assert budget is not None  # resolved in setup
        optimizers = list(trainer.strategy.optimizers)
        made: list[OptimizerChoice] = []

        def decide() -> tuple[bool, str | None]:
            simulated = _simulates(trainer, pl_module)
            batch = first_batch() if simulated else None
            if simulated and batch is None:
                return False, None
            estimate, method = self._estimator(trainer, pl_module, batch)
            candidates = compensated_candidates(self.optimizers, optimizers, precision(trainer))
            choice = choose_optimizer(
                optimizers, budget, estimate, candidates=candidates, allow_unknown=self.allow_unknown,
                method=method, info=rank_zero_info, warn=rank_zero_warn,
            )  # fmt: skip
            made.append(choice)
            return True, choice.name if choice.changed else None

        decided, name = on_rank_zero(trainer, decide, "OptimizerSwap's decision")
        if not decided:
            return
        choice = made[0] if made else None
        if choice is not None:
            rank_zero_info(f"OptimizerSwap: {choice.summary()}")
        self._decision = (name, choice)

    def _apply(self, trainer: pl.Trainer) -> None:
        """Install the decision on the optimizers as they are now (with any state Lightning loaded)."""
        assert self._decision is not None and self.budget is not None
        name, decided = self._decision
        old = list(trainer.strategy.optimizers)
        new = old if name is None else [self._swap(o, name, self.allow_unknown) for o in old]
        if decided is not None:  # rank 0: the estimate's numbers, with the optimizers installed
            choice = replace(decided, optimizers=tuple(new), replaced=tuple(old))
        else:
            originals = tuple(identify(o) for o in old)
            choice = OptimizerChoice(name, originals, tuple(new), tuple(old), self.budget, None)
        if choice.changed:
            if any(o.state for o in old):
                rank_zero_warn(
                    "OptimizerSwap replaces an optimizer that already holds state (from a checkpoint saved "
                    "without OptimizerSwap?); the new optimizer starts from zero state."
                )
            self._install(trainer, old, new, name)
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
        self._log(trainer, choice)

    # --- helpers ------------------------------------------------------------------------------

    @staticmethod
    def _estimator(trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> tuple[Estimator, str]:
        device = trainer.strategy.root_device.type
        device = device if device in ("cuda", "cpu") else "cpu"
        if _simulates(trainer, pl_module):
            # the unsharded step: the swap decides on the module's optimizer as configure_optimizers built it
            step = trainer_step(trainer, sharding=None)
            estimator = simulated_estimator(pl_module, batch, step, device=device)
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

    def _log(self, trainer: pl.Trainer, choice: OptimizerChoice) -> None:
        metrics = {
            "optimizer_swap/budget": choice.budget / MiB,
            "optimizer_swap/swapped": float(choice.changed),
        }
        if choice.breakdown is not None:
            metrics["optimizer_swap/peak"] = choice.breakdown.peak / MiB
            metrics["optimizer_swap/optimizer_state"] = choice.breakdown.optimizer_state / MiB
        hyperparams, step = {"optimizer_swap/optimizer": choice.name or "unknown"}, trainer.global_step
        for logger in trainer.loggers:
            hyper = lambda lg=logger: lg.log_hyperparams(hyperparams)  # noqa: E731
            call_logger(logger, "log_hyperparams", hyper, "OptimizerSwap", self._warned)
            log = lambda lg=logger: lg.log_metrics(metrics, step=step)  # noqa: E731
            call_logger(logger, "log_metrics", log, "OptimizerSwap", self._warned)


def _simulates(trainer: pl.Trainer, pl_module: pl.LightningModule) -> bool:
    """Whether the step can be simulated: automatic optimization with one optimizer."""
    return pl_module.automatic_optimization and len(trainer.strategy.optimizers) == 1
