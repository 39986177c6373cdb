"""ActivationCheckpointing: checkpoint the model's blocks, choosing the cheapest plan that fits a budget.

The planning and the wrapping are plain functions (`plan_checkpointing`, `apply_checkpointing`); this
callback picks the moment and the inputs. It acts in ``setup("fit")``: after
the LightningModule's layers exist and before ``configure_optimizers`` or any strategy wraps the model
(checkpointing patches each block's ``forward`` in place, so parameters keep their identity and the
optimizer, DDP and ``state_dict`` keys see the same model). With a budget it needs one training batch to
simulate the step, and takes it from the training dataloader the Trainer was given.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn

from lightning_memkit._breakdown import format_bytes
from lightning_memkit._budget import Budget, BudgetSetting
from lightning_memkit._checkpointing.blocks import block_classes, find_blocks, no_blocks_message
from lightning_memkit._checkpointing.planner import plan_checkpointing, planned_modes
from lightning_memkit._checkpointing.policies import (
    CheckpointHandle,
    CheckpointPlan,
    apply_checkpointing,
)
from lightning_memkit._estimating.compiled import compiled_modules
from lightning_memkit._estimating.isolate import isolated
from lightning_memkit._sharding.layout import Layout
from lightning_memkit._vocabulary import (
    AUTO,
    CHECKPOINT_MODES,
    allowed_modes,
    unbudgeted_mode,
)
from lightning_memkit.callbacks._trainer import (
    autofit_in,
    ddp_bucket_bytes,
    first_batch,
    fsdp_checkpointing,
    hold_layout,
    on_rank_zero,
    planned_layout,
    trainer_step,
)

_OPTION = "ActivationCheckpointing(blocks={MyBlock})"


class ActivationCheckpointing(Callback):
    r"""Activation checkpointing of the model's repeated blocks, per block none / selective / full, chosen
    so that the whole training step fits ``budget`` at the least recompute cost.

    What each block may get (see `lightning_memkit.plan_checkpointing` for the planner):

    - ``"selective"``: op-level checkpointing; matmul and attention outputs are kept, pointwise ops, norms
      and softmax are recomputed. About a third of the activations for a few percent of step time.
    - ``"selective_half"``: as selective, but every second matmul is recomputed too.
    - ``"full"``: only the block's input is kept; its forward runs again in backward (~+33 % compute).

    Without a budget every block gets the strongest mode ``checkpointing`` allows (``"auto"``:
    ``"selective"``). With a budget the plan is the cheapest whose simulated step peak fits it: one
    training batch is taken from the training dataloader (the datamodule's or the module's
    ``train_dataloader()``, or the loader passed to ``fit``),
    and the step is simulated on fake tensors with `estimate_memory` (nothing is allocated, so a model that
    does not fit yet can be planned) at the Trainer's precision and device type. Global rank 0 plans and
    broadcasts the plan, so every rank checkpoints alike.

    Planning runs the module's ``training_step`` (on fake tensors) and draws a batch from the dataloader;
    it leaves no trace on the run: buffers (BatchNorm's statistics), the RNG streams, gradients, metrics
    and list attributes are put back, so a plan that checkpoints nothing trains
    exactly as without the callback. An optimizer whose ``step`` needs a closure (LBFGS) is simulated as
    `estimate_memory` does it.

    The model stays checkpointed after fit (under ``torch.no_grad()``, as in validation, the wrapped blocks
    run their plain forward); ``apply_checkpointing(model, "none")`` removes it. Every fit plans afresh: the
    same instance used for another ``fit`` first undoes what it applied at the previous one, on whichever
    model that was.

    The plan is printed (``rank_zero_info``) and kept in :attr:`plan`; it is saved in the checkpoint, and a
    run resumed with the same ``budget`` and ``checkpointing`` re-applies the saved plan instead of a new one
    (Lightning calls ``setup`` before it loads callback states, so a resumed run plans once and then
    switches to the saved plan in ``load_state_dict``, before the optimizer state is restored).

    Strategies: DDP and single-device runs use the in-place wrapping. Under ``ModelParallelStrategy``
    (FSDP2, tensor parallelism, HSDP, applied in ``configure_model``, which runs after this ``setup``: apply
    no checkpointing of your own there) the plan fits one rank's step in the layout the run applies: the
    module's ``configure_model`` run on a copy over a fake device mesh of the run's shape
    (`Sharding`'s ``parallelize_fn``), and the run's layout is held to it at ``on_fit_start``.
    ``FSDPStrategy`` wraps the model itself: full checkpointing without a budget is handed to it in its own
    form (as if it had been built with ``activation_checkpointing_policy={BlockClass}``), selective
    checkpointing is applied in place (FSDPStrategy's own form has no selective variant), and a budget is
    refused, because the simulated step is not sharded yet.

    Compiled models (``torch.compile`` on the module or a submodule, in ``__init__`` or in
    ``configure_model``, inductor's backend): with a budget, the compiled step is simulated as inductor runs
    it; where it fits, no block is wrapped (the plan changes nothing), and otherwise the plan lowers
    torch.compile's own ``activation_memory_budget`` (``torch._functorch.config``) to the highest value, a
    tenth at a time, whose step fits, set for the fit and given back at its end (`plan_checkpointing`);
    below every such step the budget is refused with the reason. A model compiled in ``configure_model``,
    which runs after ``setup``,
    is planned again once compiled, at ``on_fit_start`` (the eager step's plan made at ``setup`` is undone).

    Args:
        budget: the whole step's peak memory to fit (parameters, gradients, optimizer state, activations
            and temporaries), as `parse_budget` reads it: bytes, a size (``"6GiB"``, ``"24GB"``), a GPU
            name (``"A100-40GB"``, ``"H200"``: the card's memory less the CUDA context and a 5 % reserve),
            or, read from the CUDA device the run trains on at ``setup``, a fraction of it (``0.9``) or
            ``"auto"``. ``None``: no planning.
        checkpointing: the modes a block may get: ``"auto"`` (every mode; without a budget, ``"selective"``),
            ``"selective"``, ``"selective_half"``, ``"full"`` (that mode or none per block), or the modes
            themselves with ``"none"`` (``("none", "selective", "full")``), as `AutoFit` takes them.
        blocks: the layer classes whose instances are the blocks (default: `find_blocks`, the repeated
            layers), the set ``FSDPStrategy(activation_checkpointing_policy=...)`` takes.
        cost: what the planner minimises: ``"measured"`` (the recomputed ops' time, benchmarked on the
            device) or ``"flops"``.

    Example::

        trainer = Trainer(callbacks=[ActivationCheckpointing(budget="6GiB")])

    Raises:
        ValueError: at once for a budget that is no size, GPU name, fraction or ``"auto"``; at setup, if the
            budget is below what full checkpointing reaches (the message gives that floor in bytes and what
            else would help), if the model has no repeated blocks (pass ``blocks={MyBlock}``) or none of
            the classes in ``blocks``.
        MisconfigurationException: at setup, with a budget under FSDPStrategy or manual optimization, a
            fraction or ``"auto"`` on a run without CUDA, or when FSDPStrategy is already configured with
            ``activation_checkpointing_policy``.
    """

    def __init__(
        self,
        budget: int | float | str | Budget | None = None,
        checkpointing: str | Sequence[str] = AUTO,
        *,
        blocks: Iterable[type[nn.Module]] | None = None,
        cost: str = "measured",
    ) -> None:
        self._budget = BudgetSetting(budget)
        # A generator is read once, here: the checks below and `allowed_modes` read it again.
        if isinstance(checkpointing, Iterable) and not isinstance(checkpointing, (str, type)):
            checkpointing = tuple(checkpointing)
        if checkpointing is None:
            raise TypeError(
                f"checkpointing=None: choose {AUTO!r} or one of {', '.join(map(repr, CHECKPOINT_MODES))} "
                "(layer classes such as {MyBlock} go in blocks=); to turn checkpointing off, leave "
                "ActivationCheckpointing out of the callbacks."
            )
        if _layer_classes(checkpointing) or not isinstance(checkpointing, (str, Iterable)):
            raise TypeError(
                f"checkpointing must be {AUTO!r}, one of {', '.join(map(repr, CHECKPOINT_MODES))} or several "
                f"of them (layer classes such as {{MyBlock}} go in blocks=); got {checkpointing!r} "
                f"({type(checkpointing).__name__})"
            )
        #: The modes a block may get (`allowed_modes` of the ``checkpointing`` given); with a budget the
        #: plan starts from the blocks as written, so ``"none"`` is among them (`planned_modes`).
        self.modes = allowed_modes(checkpointing) if budget is None else planned_modes(checkpointing)
        #: ``checkpointing`` as given: ``"auto"``, a mode, or the modes.
        self.checkpointing = checkpointing if isinstance(checkpointing, str) else self.modes
        #: The layer classes whose instances are the blocks; ``None``: the repeated layers (`find_blocks`).
        self.layer_classes = None if blocks is None else block_classes(blocks)
        if cost not in ("measured", "flops"):
            raise ValueError(f"Unknown cost {cost!r}; choose 'measured' or 'flops'")
        self.cost = cost
        #: The plan in use (block name -> mode, with the figures behind it when planned for a budget).
        self.plan: CheckpointPlan | None = None
        self._handle: CheckpointHandle | None = None
        self._module: pl.LightningModule | None = None
        self._loaded = False  # a plan from load_state_dict outside fit, for the next setup
        self._deferring = False  # an AutoFit in the fit plans the checkpointing (`_defer`)
        self._compiled = False  # whether the model was planned compiled
        self._unfit: ValueError | None = None  # setup's plan failed; the compiled model may still fit
        #: under ModelParallelStrategy, the layout the plan simulated (`planned_layout`), held to the run's
        self._layout: Layout | None = None

    @property
    def budget(self) -> int | None:
        """The budget in bytes; one read from the device (a fraction, ``"auto"``) is known from ``setup``
        on."""
        return self._budget.usable

    @property
    def state_key(self) -> str:
        classes = None if self.layer_classes is None else sorted(c.__qualname__ for c in self.layer_classes)
        # A budget read from the device keys as given: its bytes differ from card to card.
        budget = self._budget.key
        # keyed ``policy=`` as the first checkpoints were, so that they still resume this callback
        return self._generate_state_key(budget=budget, policy=self.checkpointing, layer_classes=classes)

    # --- Lightning hooks ----------------------------------------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        # Another fit of this instance: what the previous one applied goes, on whichever model it was.
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self._deferring = False
        if self._budget.from_device:
            _check_cuda(self._budget.given, trainer)
            self._budget.resolve()
        planner = autofit_in(trainer)
        if planner is not None:
            self._defer(planner)
            return
        self._module = pl_module
        if _is_fsdp(trainer.strategy) and self._hand_to_fsdp(trainer.strategy, pl_module):
            return
        self._compiled = bool(compiled_modules(pl_module))
        try:
            plan = self._make_plan(trainer, pl_module)
        except ValueError as err:  # the eager step does not fit: a compiled one may, planned at on_fit_start
            if self.budget is None or self._compiled or not is_overridden("configure_model", pl_module):
                raise
            self._unfit = err
            return
        self._use(pl_module, plan)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The layout configure_model applied is the one the plan simulated (rank 0 simulated it; every
        # rank learns it from the plan's broadcast).
        if self.budget is not None and not self._deferring and self.plan is not None:
            hold_layout(trainer, pl_module, self._layout, "ActivationCheckpointing")
        # A model compiled in ``configure_model`` (after ``setup``) is planned again, as compiled.
        unfit, self._unfit = self._unfit, None
        if self.budget is None or self._deferring or self._module is None or self._compiled:
            return
        if not compiled_modules(pl_module):
            if unfit is not None:
                raise unfit
            return
        self._compiled = True
        rank_zero_info(
            "Activation checkpointing: the model was compiled in configure_model; planning its compiled step."
        )
        if self._handle is not None:  # setup's plan was for the eager step
            self._handle.remove()
            self._handle, self.plan = None, None
        self._use(pl_module, self._make_plan(trainer, pl_module))

    def modes_for(self, modes: Sequence[str], planner: str = "AutoFit") -> tuple[str, ...]:
        """The checkpointing modes a planner beside this callback may give a block: ``modes`` (the
        planner's own) narrowed to this callback's ``checkpointing``. What cannot be honoured is refused."""
        kept = tuple(m for m in modes if m in self.modes)
        if not any(m != "none" for m in kept) and any(m != "none" for m in self.modes):
            raise ValueError(
                f"ActivationCheckpointing(checkpointing={self.checkpointing!r}) allows "
                f"{', '.join(self.modes)} per block, and {planner}(checkpointing={tuple(modes)!r}) beside it "
                f"plans none of those checkpointing modes: give {planner} checkpointing= with "
                f"{' or '.join(repr(m) for m in self.modes if m != 'none')}, or keep one callback."
            )
        return kept

    def blocks_for(
        self, blocks: tuple[type[nn.Module], ...] | None, planner: str = "AutoFit"
    ) -> tuple[type[nn.Module], ...] | None:
        """The blocks a planner beside this callback checkpoints: this callback's ``blocks``, or ``blocks``
        (the planner's own; ``None``: the repeated layers `find_blocks` finds). Two different sets are
        refused."""
        if self.layer_classes is None or blocks is None or set(blocks) == set(self.layer_classes):
            return self.layer_classes or blocks
        mine, theirs = (", ".join(sorted(c.__name__ for c in b)) for b in (self.layer_classes, blocks))
        raise ValueError(
            f"ActivationCheckpointing(blocks={{{mine}}}) and {planner}(blocks={{{theirs}}}) beside it name "
            f"different blocks to checkpoint; {planner} plans the checkpointing for both: give the same "
            f"blocks to both, or to {planner} alone."
        )

    def _defer(self, planner: Callback) -> None:
        """Leave the checkpointing to ``planner`` (an `AutoFit` in the same fit), which plans it with the
        micro-batch and optimizer, within this callback's modes."""
        modes = self.modes_for(planner.checkpointing)  # type: ignore[attr-defined]
        self._deferring, self.plan, self._loaded = True, None, False
        budget = "" if self._budget.given is None else f" (its budget={self._budget.given!r} is not used)"
        rank_zero_info(
            f"ActivationCheckpointing defers to AutoFit{budget}: AutoFit plans the checkpointing together "
            f"with the micro-batch and the optimizer, with {', '.join(modes)} per block; its plan is "
            "AutoFit.plan.checkpoint_plan."
        )

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._module = None  # the model stays checkpointed; a later load_state_dict waits for setup
            if self._handle is not None:  # torch.compile's activation budget is the process's: given back
                self._handle.restore_compile_budget()

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        # a fit that raises skips ``teardown``: the process's activation budget is given back here too
        if self._handle is not None:
            self._handle.restore_compile_budget()

    def state_dict(self) -> dict[str, Any]:
        return {"plan": None if self.plan is None else self.plan.as_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        stored = state_dict.get("plan")
        if stored is None:
            return
        if self._deferring:  # AutoFit's plan (and its saved state) decides this fit's checkpointing
            rank_zero_info(
                "ActivationCheckpointing: the checkpoint's plan is not applied; AutoFit plans this fit's "
                "checkpointing."
            )
            return
        plan = CheckpointPlan.from_dict(stored)
        if self._module is None:  # loaded outside fit: applied at the next setup
            self.plan, self._loaded = plan, True
            return
        missing = [b.name for b in plan.blocks if _submodule(self._module, b.name) is None]
        if missing:
            rank_zero_warn(
                f"The checkpoint's activation checkpointing plan names blocks this model does not have "
                f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}); keeping the new plan."
            )
            return
        if plan.modes != (self.plan.modes if self.plan is not None else None):
            rank_zero_info("Activation checkpointing: resuming with the plan saved in the checkpoint.")
            self._use(self._module, plan)

    # --- helpers ------------------------------------------------------------------------------

    def _make_plan(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> CheckpointPlan:
        loaded, self._loaded = self._loaded, False
        if loaded and self.plan is not None and all(_submodule(pl_module, b.name) for b in self.plan.blocks):
            return self.plan  # loaded before this fit
        found = find_blocks(pl_module, self.layer_classes)
        if not found:  # before the planner, whose message names plan_checkpointing's argument
            raise ValueError(no_blocks_message(pl_module, _OPTION, self.layer_classes))
        if self.budget is None:
            return CheckpointPlan.uniform([name for name, _ in found], unbudgeted_mode(self.checkpointing))
        if not pl_module.automatic_optimization:
            raise MisconfigurationException(
                f"ActivationCheckpointing(budget=...) cannot plan for {type(pl_module).__name__}, which uses "
                "manual optimization (automatic_optimization = False): the planner simulates the step "
                "Lightning runs itself (training_step, backward, optimizer step), and a manual training_step "
                "drives its own backward and optimizers. Choose the mode without a budget instead: "
                "ActivationCheckpointing(checkpointing='selective') (about a third of the activations for a "
                "few percent of compute) or checkpointing='full' (the least memory, ~+33 % compute)."
            )
        budget = self.budget

        def decide() -> tuple[dict[str, Any], Layout | None]:
            # DDP's all-reduce buckets are there all along: what is left is the step's to fit in.
            buckets = ddp_bucket_bytes(trainer, pl_module)
            if buckets:
                rank_zero_info(
                    f"Activation checkpointing: DDP's all-reduce buckets take {format_bytes(buckets)} "
                    f"of the {format_bytes(budget)} budget; the step is planned to fit the rest."
                )
            with isolated(pl_module, "Planning activation checkpointing"):
                step = trainer_step(trainer)
                plan = plan_checkpointing(
                    pl_module,
                    _example_batch(trainer),
                    max(budget - buckets, 1),
                    checkpointing=self.modes,
                    blocks=self.layer_classes,
                    cost=self.cost,
                    device=trainer.strategy.root_device.type,
                    # under ModelParallelStrategy: one rank's step in its layout, over a fake process group
                    step=step,
                )
                return plan.as_dict(), planned_layout(pl_module, step.sharding)

        plan, self._layout = on_rank_zero(trainer, decide, "Planning activation checkpointing")
        return CheckpointPlan.from_dict(plan)

    def _use(self, pl_module: nn.Module, plan: CheckpointPlan) -> None:
        if self._handle is not None:
            self._handle.remove()
        self._handle = apply_checkpointing(pl_module, plan)
        self.plan = plan
        rank_zero_info(str(plan))

    def _hand_to_fsdp(self, strategy: Any, pl_module: nn.Module) -> bool:
        """Configure FSDPStrategy's own activation checkpointing where it can express the plan.

        Returns whether it took the plan; otherwise the plan is applied in place as for other strategies.
        """
        if fsdp_checkpointing(strategy):
            raise MisconfigurationException(
                "FSDPStrategy(activation_checkpointing_policy=...) and the ActivationCheckpointing callback "
                "both configure activation checkpointing; keep one of them."
            )
        if self._budget.given is not None:
            raise MisconfigurationException(
                "ActivationCheckpointing(budget=...) cannot plan under FSDPStrategy yet: the simulated step "
                "does not shard parameters, gradients and optimizer state, so its peak is not the run's. "
                "Pass checkpointing='full' or checkpointing='selective' (with blocks={MyBlock} to name the "
                "blocks) instead."
            )
        if unbudgeted_mode(self.checkpointing) != "full":
            return False  # selective checkpointing has no FSDPStrategy form: applied in place
        classes = self.layer_classes
        if classes is None:
            found = find_blocks(pl_module)
            if not found:
                raise ValueError(no_blocks_message(pl_module, _OPTION))
            classes = tuple({type(m) for _, m in found})
        names = [name for name, _ in find_blocks(pl_module, classes)]
        if not names:
            raise ValueError(no_blocks_message(pl_module, _OPTION, classes))
        fsdp_checkpointing(strategy, set(classes))
        self.plan = CheckpointPlan.uniform(names, "full")
        rank_zero_info(
            "Activation checkpointing handed to FSDPStrategy as activation_checkpointing_policy="
            f"{{{', '.join(c.__name__ for c in classes)}}} ({len(names)} blocks, full)."
        )
        return True


def _check_cuda(budget: float | str, trainer: pl.Trainer) -> None:
    """A fraction or ``"auto"`` is read from the CUDA device the run trains on: refuse it on another."""
    device = trainer.strategy.root_device
    if device.type != "cuda":
        raise MisconfigurationException(
            f"ActivationCheckpointing(budget={budget!r}) is read from the CUDA device the run trains on, but "
            f"this run trains on {device.type}. Give a size ('24GB', '6GiB') or a GPU name ('A100-40GB') "
            "instead."
        )


def _layer_classes(value: Any) -> bool:
    """Whether ``value`` is a layer class or a collection of them: those go in ``blocks=``, not
    ``checkpointing=``."""
    if isinstance(value, type):
        return True
    if isinstance(value, str) or not isinstance(value, Iterable):
        return False
    return bool(value) and all(isinstance(v, type) for v in value)


def _is_fsdp(strategy: Any) -> bool:
    from lightning.pytorch.strategies import FSDPStrategy

    return isinstance(strategy, FSDPStrategy)


def _submodule(module: nn.Module, name: str) -> nn.Module | None:
    try:
        return module.get_submodule(name)
    except AttributeError:
        return None


def _example_batch(trainer: pl.Trainer) -> Any:
    """One batch of the training dataloader the Trainer was given (for the simulated step)."""
    batch = first_batch(trainer)
    if batch is None:
        raise MisconfigurationException(
            "ActivationCheckpointing(budget=...) simulates one training step and needs a batch, but the "
            "Trainer has no training dataloader yet, or it yields no batch. Pass one to `fit` (or a "
            "datamodule), or plan yourself with `lightning_memkit.plan_checkpointing(model, batch, budget)` "
            "and apply the plan in `configure_model`."
        )
    return batch
