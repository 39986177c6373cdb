"""AutoFit: fit a run to a memory budget from the estimate, before the first step; no trial OOMs.

The search is the plain function `plan_fit`; this callback picks the moment (``setup("fit")``, rank 0
planning and broadcasting), installs the plan in the Trainer, puts everything back at the end of the fit,
and keeps the plan for a resume. Logged once: ``autofit/micro_batch_size``,
``autofit/accumulate_grad_batches``, ``autofit/estimated_peak_mib`` (MiB). Design notes, with the reasons:
``docs/design/autofit-callback.md``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.parsing import lightning_setattr
from torch import nn
from typing_extensions import override

from lightning_memkit._breakdown import MiB
from lightning_memkit._budget import (
    Budget,
    names,
    parse_budget,
    reads_device,
    share,
    valid_name,
    whole_number,
)
from lightning_memkit._checkpointing.blocks import LayerClasses, block_classes
from lightning_memkit._checkpointing.policies import named_plan
from lightning_memkit._diagnosis.oom import StepInFlight
from lightning_memkit._estimating.compiled import compiled_modules
from lightning_memkit._estimating.isolate import isolated
from lightning_memkit._estimating.lightning_step import SampleAxes, repeat_batch
from lightning_memkit._fitting.plan import FitPlan, StepCost
from lightning_memkit._fitting.resume import optimizer_name, stale
from lightning_memkit._fitting.search import plan_fit
from lightning_memkit._optimizers.swap import CATALOGUE
from lightning_memkit._sharding.layout import Layout
from lightning_memkit._vocabulary import AUTO, COSTS, allowed_modes
from lightning_memkit.callbacks._autofit_batches import (
    check_example,
    check_first_batch,
    check_plannable,
    drop_train_loader,
    first_batch,
    sample_axes,
    settable_batch_size,
)
from lightning_memkit.callbacks._autofit_choices import (
    FSDP2Options,
    blocks_to_plan,
    check_blocks,
    modes_to_plan,
    optimizers_to_plan,
)
from lightning_memkit.callbacks._autofit_resume import (
    blocks_changed,
    head,
    not_replanned,
    optimizers_set_aside,
    replan_failed,
    weights_only,
)
from lightning_memkit.callbacks._autofit_settings import UserSettings
from lightning_memkit.callbacks._autofit_verify import (
    budgets_differ,
    no_leaner_plan,
    not_recovered,
    over_limit,
    unrecoverable,
)
from lightning_memkit.callbacks._oom_report import report_oom
from lightning_memkit.callbacks._progress import count_batches
from lightning_memkit.callbacks._step_guard import StepGuard
from lightning_memkit.callbacks._trainer import (
    built_late,
    call_logger,
    data_parallel_ranks,
    hold_layout,
    on_rank_zero,
    parameters_of,
    planned_layout,
    precision,
    sharding,
    step_lever,
    trainer_sharding,
)
from lightning_memkit.callbacks.memory_monitor import MemoryMonitor

__all__ = ["AutoFit"]


class AutoFit(Callback):
    """Choose micro-batch, gradient accumulation, checkpointing and optimizer so the step fits ``budget``.

    Args:
        budget: per device: bytes, ``"24GB"``, a GPU name (``"A100-40GB"``), a fraction of the current
            CUDA device (a float in (0, 1]) or ``"auto"`` (the current CUDA device). On CPU give a size.
            A size is the step's limit as given; a card's size less its CUDA context and reserve is
            ``parse_budget("24GB", device_size=True)``. Sizes and names are read here; a fraction or
            ``"auto"`` at ``setup``, on the run's device.
        margin: share of the budget kept free for what the estimate cannot see.
        batch_arg_name: the attribute holding the micro-batch size, on the module, its ``hparams`` or the
            datamodule (Lightning's word and default, as ``BatchSizeFinder``'s).
        optimizers: candidate catalogue names in quality order (default: the module's own, then lighter;
            beside an `OptimizerSwap`, which defers to AutoFit, the module's own, then the swap's
            ``candidates``).
        checkpointing: the checkpointing modes a block may get (the plan chooses block by block), as
            `ActivationCheckpointing` takes them: ``"auto"`` (every mode), one mode (that one or none), or
            the modes (``("none", "full")``); a
            module without repeated blocks is planned without checkpointing (the plan's ``note``, in the
            info line, says so).
        blocks: the layer classes whose instances are the blocks to checkpoint (``{ResBlock, AttnBlock}``),
            as `ActivationCheckpointing` takes them; default: the repeated layers `find_blocks` finds (in
            containers or as attributes). An ``ActivationCheckpointing(blocks=...)`` beside AutoFit gives
            its blocks to AutoFit's plan.
        cost: the throughput model (`plan_fit`'s ``cost``).
        verify_steps: first steps whose measured peak is checked (CUDA) and whose OOM in the forward or
            backward is recovered from (one process, automatic optimization); 0 turns both off.

    Resume a run saved with it with an ``AutoFit`` among the callbacks too: the checkpoint holds the
    plan's optimizer state, which only the saved plan can load (docs/design/autofit-callback.md, "Resume").
    """

    def __init__(
        self,
        budget: int | float | str | Budget = "auto",
        *,
        margin: float = 0.1,
        batch_arg_name: str = "batch_size",
        optimizers: Sequence[str] | None = None,
        checkpointing: str | Sequence[str] = AUTO,
        blocks: LayerClasses | None = None,
        cost: str = "auto",
        verify_steps: int = 3,
    ) -> None:
        _check_budget(budget)
        margin = share("margin", margin, of="the budget kept free")
        if not isinstance(batch_arg_name, str) or not batch_arg_name:
            raise (TypeError if not isinstance(batch_arg_name, str) else ValueError)(
                "batch_arg_name must name the attribute that holds the micro-batch size, such as "
                f"'batch_size'; got {batch_arg_name!r}"
            )
        if optimizers is not None:  # a name alone is one candidate, not its letters
            optimizers = names("optimizers", optimizers, CATALOGUE, none=True)
        checkpointing = allowed_modes(checkpointing)
        #: the layer classes whose instances are the blocks; ``None``: the repeated layers (`find_blocks`)
        self.blocks = None if blocks is None else block_classes(blocks)
        if not isinstance(cost, StepCost):  # a StepCost is plan_fit's too
            cost = valid_name("cost", cost, COSTS)
        verify_steps = whole_number("verify_steps", verify_steps, of="steps", at_least=0)
        self.budget, self.margin, self.batch_arg_name = budget, margin, batch_arg_name
        self.optimizers, self.checkpointing, self.cost = optimizers, checkpointing, cost
        self.verify_steps = verify_steps
        self.plan: FitPlan | None = None
        self._warned: set[str] = set()  # the loggers' failures said (`call_logger`)
        self._applied: Any = None
        self._guard: StepGuard | None = None
        self._target: tuple[pl.Trainer, pl.LightningModule] | None = None
        self._first_step = 0  # the global step this process started training at
        self._compiled = False  # whether the model was planned compiled
        self._resumed = False  # whether this fit runs a checkpoint's plan (`resume_with`)
        #: what the fit changes of the user's settings, to put back at its end (read at ``setup``)
        self._settings = UserSettings(batch_arg_name)
        #: what the plan was made for (`parameters_of` at ``setup``): configure_model must not add to it
        self._planned: tuple[int, set[str]] = (0, set())
        #: each tensor's sample dimension in the train dataloader's batches, as read at planning
        self._axes: SampleAxes | None = None
        #: under ModelParallelStrategy, the layout the plan simulated (`simulated_layout`), held to the run's
        self._layout: Layout | None = None
        #: whether the fit's first batch is still to be checked against the plan (`check_first_batch`)
        self._unchecked = False
        #: the batch in flight and its phase, for explaining an OOM
        self._step = StepInFlight()
        #: what gives the progress bar its own class back (`count_batches`), while the fit runs
        self._bar: Any = None

    @property
    def sample_axes(self) -> SampleAxes | None:
        """Which dimension of each tensor in the train dataloader's batches holds the samples, as read at
        planning (`SampleAxes`); ``None`` before."""
        return self._axes

    # --- planning -----------------------------------------------------------------------------

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        check_plannable(trainer, pl_module, self.batch_arg_name)
        modes = modes_to_plan(
            trainer, self.checkpointing
        )  # refused before any planning work if they cannot be honoured
        self._resumed = False
        # Each fit plans afresh from the user's settings (a resume then installs its saved plan instead).
        self._settings = UserSettings.read(trainer, pl_module, self.batch_arg_name)
        self._target = (trainer, pl_module)
        self._compiled = bool(compiled_modules(pl_module))
        self._planned = parameters_of(pl_module)
        self._decide(trainer, pl_module, modes)

    def _decide(self, trainer: pl.Trainer, pl_module: pl.LightningModule, modes: Sequence[str]) -> None:
        # A plan made again (a model compiled in configure_model, a resume for another run) simulates the
        # module's own step: an earlier plan's checkpointing and guard are set aside first (`_install` puts
        # the new plan's on).
        self._set_aside()

        def decide() -> tuple[dict[str, Any], SampleAxes, Layout | None]:
            with isolated(pl_module, "AutoFit's planning"):  # the run goes on as if nothing had run
                plan = self._plan(trainer, pl_module, modes)
            return plan.as_dict(), self._axes, planned_layout(pl_module, self._sharding(trainer, plan))

        plan, self._axes, self._layout = on_rank_zero(trainer, decide, "AutoFit's planning")
        self.plan = FitPlan.from_dict(plan)
        self._install(self.plan)
        if self._bar is None:  # the bar counts the plan's batches, not its optimizer steps (`_progress`)
            self._bar = count_batches(trainer)
        rank_zero_info(f"AutoFit: {self.plan}")

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Layers ``configure_model`` built after ``setup`` were never planned (nor are they in the optimizer
        # the plan chose): refused, naming them.
        if self.plan is not None and (why := built_late("AutoFit", pl_module, self._planned)):
            raise RuntimeError(why)
        # The layout configure_model applied is the one the plan simulated (held on every rank alike).
        hold_layout(trainer, pl_module, self._layout if self.plan is not None else None, "AutoFit")
        # A model compiled in ``configure_model`` (after ``setup``) is planned again, as compiled: its
        # checkpointing is then torch.compile's activation_memory_budget, and its step is not the eager one.
        if self.plan is None or self._compiled or self._resumed or not compiled_modules(pl_module):
            return
        self._compiled = True
        rank_zero_info("AutoFit: the model was compiled in configure_model; planning its compiled step.")
        self._decide(trainer, pl_module, modes_to_plan(trainer, self.checkpointing))

    def _optimizers(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> Sequence[str | None] | None:
        """The optimizers to plan: this callback's, or with an `OptimizerSwap` beside it, the swap's
        (`optimizers_to_plan`)."""
        return optimizers_to_plan(trainer, pl_module, self.optimizers)

    def _plan(self, trainer: pl.Trainer, pl_module: pl.LightningModule, modes: Sequence[str]) -> FitPlan:
        strategy, ranks = sharding(trainer)
        layout = self._sharding(trainer)
        # Each data-parallel rank takes its own batch; a tensor-parallel group shares one.
        copies = trainer.accumulate_grad_batches * data_parallel_ranks(trainer)
        users = settable_batch_size(pl_module, self.batch_arg_name)
        example = first_batch(trainer)
        check_example(example, users, self.batch_arg_name)
        self._axes = self._sample_axes(trainer, pl_module, example, users)
        check_blocks(trainer, pl_module, modes, self.blocks)
        # (micro, ...) -> (micro * accumulate * data-parallel ranks, ...): one optimizer step's global batch.
        example = repeat_batch(example, copies, self._axes)
        device = trainer.strategy.root_device.type
        fsdp2 = self._fsdp2_options(trainer)
        return plan_fit(
            pl_module,
            example,
            self._budget(device),
            margin=self.margin,
            optimizers=self._optimizers(trainer, pl_module),
            precision=precision(trainer),
            checkpointing=modes,
            device="cuda" if device == "cuda" else "cpu",
            strategy=strategy,
            world_size=ranks,
            cost=self.cost,
            progress=lambda line: rank_zero_info(f"AutoFit: {line}"),
            compensate=False,  # the Trainer's precision is the user's: their optimizer stays a candidate
            cpu_offload=fsdp2.cpu_offload if strategy == "fsdp2" else False,
            mp_policy=fsdp2.mp_policy and strategy == "fsdp2",
            link=fsdp2.link,
            batch_axes=self._axes,
            micro_batch_size=users,
            sharding=layout,
            blocks=blocks_to_plan(trainer, self.blocks),
            lever=step_lever(trainer),
        )

    def _fsdp2_options(self, trainer: pl.Trainer) -> FSDP2Options:
        """What the plan may choose of an FSDP2 step's sharding: nothing under a plain
        ModelParallelStrategy (the user's configure_model shards). With `_sharding`, the interface
        AutoFitStrategy's planner overrides."""
        return FSDP2Options()

    def _sharding(self, trainer: pl.Trainer, plan: FitPlan | None = None) -> Any:
        """The layout to plan (`plan_fit`'s ``sharding=``), or the one ``plan`` was made for: the run's
        (`trainer_sharding`). AutoFitStrategy's planner answers with the layouts it chooses among."""
        return trainer_sharding(trainer)

    def _sample_axes(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, example: Any, users: int
    ) -> SampleAxes:
        """Each tensor's sample dimension in the train dataloader's batches (`sample_axes`), the batch size
        attribute put back at the user's value after each size probed."""
        put_back = self._settings.put_back_batch_sizes
        return sample_axes(trainer, pl_module, example, users, self.batch_arg_name, put_back)

    def recovery_note(self, trainer: pl.Trainer, pl_module: pl.LightningModule, phase: str | None) -> str:
        """Why this fit's out-of-memory error in ``phase`` was not recovered from (`report_oom` says it)."""
        steps = trainer.global_step - self._first_step
        return not_recovered(trainer, pl_module, phase, self.verify_steps, steps)

    def _budget(self, device: str) -> Budget:
        """The budget read for a run on ``device``: a fraction or ``"auto"`` only on CUDA."""
        if device != "cuda" and reads_device(self.budget):
            raise ValueError(
                f"AutoFit(budget={self.budget!r}) reads the CUDA device, but the run is on {device}; "
                "give the budget as a size, e.g. AutoFit(budget='8GiB')."
            )
        return parse_budget(self.budget)

    def _install(self, plan: FitPlan) -> None:
        assert self._target is not None
        trainer, pl_module = self._target
        lightning_setattr(pl_module, self.batch_arg_name, plan.micro_batch_size)
        trainer.accumulate_grad_batches = plan.accumulate_grad_batches
        drop_train_loader(trainer)
        self._settings.scale_counts(trainer, pl_module, plan, self._warned)
        self._apply(plan)
        self._unchecked = True
        if self._guard is None and self.verify_steps > 0 and unrecoverable(trainer, pl_module) is None:
            self._guard = StepGuard(trainer, pl_module, self._replan, plan.micro_batch_size, self._axes)
        elif self._guard is not None:  # a resume installs the saved plan over the fresh one
            self._guard.micro_batch_size, self._guard.size = plan.micro_batch_size, None

    def _apply(self, plan: FitPlan) -> None:
        assert self._target is not None
        trainer, module = self._target
        if self._applied is not None:
            self._applied.remove()
        if plan.checkpoint_plan is None and (
            named := named_plan(module, plan.checkpointing, blocks_to_plan(trainer, self.blocks))
        ):
            plan = dataclasses.replace(
                plan, checkpoint_plan=named
            )  # a leaner row's mode, on the blocks named
        self._applied = plan.apply(module)

    # --- after planning -------------------------------------------------------------------------

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.plan is None:
            return
        self._compare_budgets(trainer)
        self._first_step = trainer.global_step
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(trainer.strategy.root_device)
        metrics = {
            "autofit/micro_batch_size": float(self.plan.micro_batch_size),
            "autofit/accumulate_grad_batches": float(self.plan.accumulate_grad_batches),
            "autofit/estimated_peak_mib": self.plan.estimated_peak / MiB,
        }
        for logger in trainer.loggers:
            log = lambda lg=logger: lg.log_metrics(metrics, step=trainer.global_step)  # noqa: E731
            call_logger(logger, "log_metrics", log, "AutoFit", self._warned)

    def _compare_budgets(self, trainer: pl.Trainer) -> None:
        """A `MemoryMonitor` with a budget of its own warns over it and reports fractions of it: say so
        when it is not the budget this plan fits (their figures would then disagree)."""
        assert self.plan is not None
        for monitor in trainer.callbacks:
            if isinstance(monitor, MemoryMonitor) and (
                message := budgets_differ(monitor, self.plan, self.budget)
            ):
                rank_zero_warn(message)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._unchecked:
            self._unchecked = False
            assert self.plan is not None
            planned, accumulate = self.plan.micro_batch_size, self.plan.accumulate_grad_batches
            check_first_batch(trainer, batch, batch_idx, planned, accumulate, self._axes, self.batch_arg_name)
        self._step.start(batch, batch_idx)

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Any) -> None:
        self._step.enter("backward")

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        self._step.enter("optimizer step")

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._step.end()
        steps = trainer.global_step - self._first_step
        if self.plan is None or steps > self.verify_steps:
            return
        if steps == self.verify_steps and self._guard is not None:
            self._guard.catch(False)
            if self._guard.size is None:  # nothing to cut: the module gets its own hooks back
                self._release()
        device = trainer.strategy.root_device
        if device.type != "cuda":
            return
        measured = torch.cuda.max_memory_allocated(device)
        if (message := over_limit(trainer.global_step, measured, self.plan)) is not None:
            rank_zero_warn(message)

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        """Explain an out-of-memory error while the plan is still applied (`report_oom`, against the plan's
        budget): a `MemoryMonitor` in the Trainer does it, with its measurements, else AutoFit. Then the
        module gets its own back."""
        self._release()
        if isinstance(exception, torch.OutOfMemoryError):
            monitor = next((c for c in trainer.callbacks if isinstance(c, MemoryMonitor)), None)
            if monitor is not None:
                monitor.on_exception(trainer, pl_module, exception)  # explains once, whichever asks first
            else:  # on the rank that ran out
                report_oom(trainer, pl_module, self._step, None, who="AutoFit")
        self._step.end()
        self._unapply()
        self._settings.restore()
        self._restore_bar()

    def _restore_bar(self) -> None:
        """The progress bar gets its own class back (`count_batches`), after a fit or an exception."""
        if self._bar is not None:
            self._bar()
            self._bar = None

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """The module leaves the fit as it came: its own hooks, no checkpointing, its own
        ``configure_optimizers``, its batch size attribute (and the datamodule's, and their hparams') and
        the Trainer's ``accumulate_grad_batches`` at the user's values (the plan stays in `plan` and in the
        checkpoint)."""
        if stage == "fit":
            self._restore_bar()
            self._release()
            self._unapply()
            self._settings.restore()
            self._step.end()

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """The checkpoint's hyperparameters hold the batch size the user set, not the plan's micro-batch
        (which the checkpoint keeps in AutoFit's state): a module loaded from it plans from it again."""
        self._settings.hparams_in(checkpoint, trainer, pl_module)

    def _set_aside(self) -> None:
        """Setup's plan off the module before planning again: its checkpointing (else the simulated steps
        are checkpointed and labelled as not: a resumed re-plan read 7 % low) and its guard (else the
        simulations run through it)."""
        self._release()
        self._unapply()

    def _release(self) -> None:
        if self._guard is not None:
            self._guard.remove()
            self._guard = None

    def _unapply(self) -> None:
        if self._applied is not None:
            self._applied.remove()
            self._applied = None

    def _replan(self) -> FitPlan:
        """Switch to the plan one notch leaner (`FitPlan.leaner`) after an OOM; raises an OOM that says so
        if none is left.

        The checkpointing changes at once; the micro-batch by cutting batches (`StepGuard`): the Trainer's
        accumulation and the dataloader stay as they are, so the global batch does.
        """
        assert self.plan is not None
        leaner = self.plan.leaner(self.checkpointing)
        if leaner is None:
            raise no_leaner_plan(self.plan, self.checkpointing)
        rank_zero_warn(f"AutoFit: out of memory; re-planned one notch leaner: {leaner.summary()}")
        self.plan = leaner
        self._apply(leaner)
        return leaner

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"plan": self.plan.as_dict() if self.plan is not None else None}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume from the checkpoint's plan (`resume_with`). Lightning restores callbacks after ``setup``
        and, for one device and DDP, before ``configure_optimizers``; the strategies that restore them after
        building the optimizers (``restore_checkpoint_after_setup``: FSDP, DeepSpeed, ModelParallelStrategy)
        can neither install another plan nor plan again then."""
        saved = FitPlan.from_dict(state_dict["plan"]) if state_dict.get("plan") else None
        if saved is None or saved == self.plan:
            return
        built = self._target is not None and self._target[0].strategy.restore_checkpoint_after_setup
        self.resume_with(saved, install=not built, replan=not built)

    def resume_with(self, saved: FitPlan, *, install: bool = True, replan: bool = True) -> bool:
        """Resume from ``saved``, a checkpoint's plan. Where it was made for this run (`stale`: the same
        world size, layout, budget, margin, precision, device, step lever, batch and checkpointing modes) it
        is installed over the one this fit made, and the run goes on as it was. Otherwise this fit's plan,
        made for this run, stays, with the checkpoint's optimizer, whose state the checkpoint holds: planned
        again with it where this fit chose another, and refused, with what to do, where no plan with it
        fits or the optimizers cannot be planned again. A warning names what differed, both values.

        ``install``: the optimizers are built after this (so ``saved``'s can be); ``replan``: this fit can
        plan again. `AutoFitStrategy` loads the checkpoint once the model is sharded, and rebuilds the
        optimizers itself for an installed plan: it passes ``replan=False``. Returns whether ``saved`` was
        installed.
        """
        trainer, current = (self._target[0] if self._target else None), self.plan
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        if not fitting or trainer.state.status != TrainerStatus.RUNNING or current is None:
            self.plan = saved  # outside a fit: the checkpoint's plan, to read
            return False
        self._resumed = True
        module = self._target[1]
        # configure_model compiled the model after setup planned its eager step: the run's plan is the
        # compiled step's (on_fit_start would make it), so the saved plan is held to that, and planned so.
        recompiled = not self._compiled and bool(compiled_modules(module))
        changed = stale(saved, current) + blocks_changed(saved, module, blocks_to_plan(trainer, self.blocks))
        if recompiled:  # the eager plan's checkpointing modes, against the compiled plan's budget
            changed = [change for change in changed if change[0] != "checkpointing modes"]
            self._compiled = True
        if not changed and install:
            self._install_saved(saved, module)
            return True
        opening = head(changed, saved, type(trainer.strategy).__name__)
        if saved.optimizer == current.optimizer and not recompiled:
            self._warn_once(
                f"{opening}: this fit's plan, made for this run, goes on with {optimizer_name(saved)}, whose "
                f"state the checkpoint holds: {current.summary()}"
            )
            return False
        weights = weights_only(module, current)
        if not replan:
            raise RuntimeError(
                not_replanned(saved, current, changed, type(trainer.strategy).__name__, weights)
            )
        self._warn_once(
            f"{opening}: planning again for this run, with {optimizer_name(saved)}, whose state the "
            "checkpoint holds"
        )
        try:
            self._replan_with(saved.optimizer)
        except ValueError as error:
            raise RuntimeError(replan_failed(saved, current, changed, error, weights)) from error
        return False

    def _install_saved(self, saved: FitPlan, module: nn.Module) -> None:
        """Install ``saved``, a checkpoint's plan made for this run, over the one this fit made."""
        self.plan = saved
        self._install(saved)
        rank_zero_info(f"AutoFit: resumed with the saved plan: {saved.summary()}")
        if (message := optimizers_set_aside(self.optimizers, saved, module)) is not None:
            rank_zero_warn(message)

    def _replan_with(self, optimizer: str) -> None:
        """Plan this fit again, from the user's batch and accumulation as at setup, with ``optimizer``
        alone (a checkpoint's, whose state it holds)."""
        assert self._target is not None
        trainer, module = self._target
        self._settings.put_back_batch_sizes()
        self._settings.put_back_accumulation()
        asked, self.optimizers = self.optimizers, (optimizer,)
        try:
            self._decide(trainer, module, modes_to_plan(trainer, self.checkpointing))
        finally:
            self.optimizers = asked

    def _warn_once(self, message: str) -> None:
        """Warn ``message`` once a fit (load_state_dict comes after AutoFitStrategy's `resume_with`)."""
        if message not in self._warned:
            self._warned.add(message)
            rank_zero_warn(message)


def _check_budget(budget: Any) -> None:
    """Refuse a budget that can never be read, at construction rather than at ``setup``: a float outside
    (0, 1] (`reads_device` says why), an unknown size or GPU name. ``"auto"`` and fractions need the run's
    device and are read at ``setup``."""
    if not reads_device(budget):
        parse_budget(budget)
