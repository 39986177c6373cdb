"""AutoFit: fit a run to a memory budget from the estimate, before the first step; no trial OOMs.

The search is the plain function `plan_fit`; this callback picks the moment (``setup("fit")``, rank 0
planning and broadcasting), installs the plan in the Trainer, puts everything back at the end of the fit,
and keeps the plan for a resume. Logged once: ``autofit/micro_batch_size``,
``autofit/accumulate_grad_batches``, ``autofit/estimated_peak_mib`` (MiB). Design notes, with the reasons:
``docs/design/autofit-callback.md``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import numbers
from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities import CombinedLoader, rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.parsing import (
    _lightning_get_all_attr_holders,
    lightning_getattr,
    lightning_hasattr,
    lightning_setattr,
)
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from lightning_memkit._breakdown import MiB, format_bytes
from lightning_memkit._budget import (
    Budget,
    names,
    parse_budget,
    reads_device,
    share,
    valid_name,
    whole_number,
)
from lightning_memkit._checkpointing.blocks import LayerClasses, block_classes, find_blocks, no_blocks_message
from lightning_memkit._checkpointing.policies import named_plan
from lightning_memkit._diagnosis.oom import StepInFlight
from lightning_memkit._estimating.compiled import compiled_modules
from lightning_memkit._estimating.isolate import isolated, rng_kept
from lightning_memkit._estimating.lightning_step import (
    AmbiguousAxes,
    SampleAxes,
    batch_size,
    batch_tensors,
    default_axes,
    loader_axes,
    parts_without_samples,
    repeat_batch,
)
from lightning_memkit._fitting.plan import FitPlan, StepCost
from lightning_memkit._fitting.resume import Change, optimizer_name, refusal, said, stale
from lightning_memkit._fitting.search import plan_fit
from lightning_memkit._optimizers.swap import CATALOGUE, lighter_candidates
from lightning_memkit._sharding.layout import Layout
from lightning_memkit._vocabulary import AUTO, COSTS, allowed_modes
from lightning_memkit.callbacks._oom_report import report_oom
from lightning_memkit.callbacks._progress import count_batches
from lightning_memkit.callbacks._step_guard import StepGuard
from lightning_memkit.callbacks._trainer import (
    built_late,
    call_logger,
    data_parallel_ranks,
    fit_data_source,
    hold_layout,
    on_rank_zero,
    parameters_of,
    planned_layout,
    precision,
    sharding,
    step_levers,
    trainer_sharding,
)
from lightning_memkit.callbacks.activation_checkpointing import ActivationCheckpointing
from lightning_memkit.callbacks.memory_monitor import MemoryMonitor
from lightning_memkit.callbacks.optimizer_swap import OptimizerSwap

__all__ = ["AutoFit"]

#: the throughput models `plan_fit` reads by name
#: the Trainer's arguments that count training batches, scaled to the plan's micro-batches
_BATCH_COUNTS = ("limit_train_batches", "val_check_interval")


@dataclasses.dataclass(frozen=True)
class FSDP2Options:
    """What AutoFit's plan may choose of an FSDP2 step beyond the user's sharding (`plan_fit`'s keywords of
    the same names): the planner of a strategy that shards itself (`AutoFitStrategy`) gives more."""

    #: FSDP2's CPU offload: never (``False``), or ``None``: where nothing fits without it
    cpu_offload: bool | None = False
    #: a bf16-mixed run sharded with FSDP2's bf16 ``MixedPrecisionPolicy``
    mixed_precision_policy: bool = False
    #: the ranks' collectives as timed (``None``: `_sharding.fsdp2.LINKS`' for the device)
    link: Any = None


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
        # What the fit changed, to put back at its end: [(holder, value)] of the batch size attribute
        # (module, hparams, datamodule, its hparams), and the Trainer's accumulate_grad_batches.
        self._batch_sizes: list[tuple[Any, Any]] = []
        self._users: int | None = None  # the batch size attribute as the loader reads it, at setup
        self._accumulate: tuple[pl.Trainer, int] | None = None
        self._counts: dict[str, Any] = {}  # the Trainer's `_BATCH_COUNTS` as the user set them
        #: what the plan was made for (`parameters_of` at ``setup``): configure_model must not add to it
        self._planned: tuple[int, set[str]] = (0, set())
        #: each tensor's sample dimension in the train dataloader's batches, as read at planning
        self._axes: SampleAxes | None = None
        #: under ModelParallelStrategy, the layout the plan simulated (`simulated_layout`), held to the run's
        self._layout: Layout | None = None
        #: whether the fit's first batch is still to be checked against the plan (`_check_batch`)
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

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if not fit_data_source(trainer).is_module():
            raise ValueError(
                f"AutoFit plans the micro-batch and sets it through the attribute your train_dataloader() "
                f"reads (`{self.batch_arg_name}`), but the train dataloader was passed to fit() ready-made, "
                "so nothing AutoFit sets reaches it: pass a LightningDataModule (datamodule=) or define "
                "train_dataloader() on the module, building the DataLoader there from that attribute."
            )
        if not lightning_hasattr(pl_module, self.batch_arg_name):
            raise AttributeError(
                f"AutoFit sets the micro-batch through `{self.batch_arg_name}`, which neither the module, "
                "its hparams nor the datamodule has; set batch_arg_name= to the attribute your dataloader "
                "reads."
            )
        if is_param_in_hook_signature(pl_module.training_step, "dataloader_iter", explicit=True):
            raise NotImplementedError(
                f"AutoFit plans a training_step(batch, batch_idx), but {type(pl_module).__name__}."
                "training_step takes dataloader_iter and fetches its batches itself, so no micro-batch "
                "AutoFit sets is one step's: remove AutoFit, or take (batch, batch_idx) and let Lightning "
                "fetch the batch."
            )
        if not pl_module.automatic_optimization:
            raise NotImplementedError(
                f"AutoFit plans Lightning's automatic optimization (training_step, zero_grad, backward, "
                f"step), but {type(pl_module).__name__} sets automatic_optimization = False: its steps are "
                "its own code, which AutoFit can neither simulate nor cut into micro-batches. Remove "
                "AutoFit, or plan the underlying nn.Module with plan_fit(module, batch, budget, loss_fn=...) "
                "and set the batch size and checkpointing it reports yourself."
            )
        modes = self._modes(trainer)  # refused before any planning work if they cannot be honoured
        self._resumed = False
        # Each fit plans afresh from the user's settings (a resume then installs its saved plan instead).
        holders = _lightning_get_all_attr_holders(pl_module, self.batch_arg_name)
        self._batch_sizes = [(holder, _get(holder, self.batch_arg_name)) for holder in holders]
        self._users = _samples(lightning_getattr(pl_module, self.batch_arg_name))
        self._accumulate = (trainer, trainer.accumulate_grad_batches)
        self._counts = {name: getattr(trainer, name) for name in _BATCH_COUNTS}

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
        self._decide(trainer, pl_module, self._modes(trainer))

    def _modes(self, trainer: pl.Trainer) -> tuple[str, ...]:
        """The checkpointing modes to plan: this callback's, within the modes of an
        `ActivationCheckpointing` in the same fit (which then defers to this plan)."""
        beside = next((c for c in trainer.callbacks if isinstance(c, ActivationCheckpointing)), None)
        return tuple(self.checkpointing) if beside is None else beside.modes_for(self.checkpointing)

    def _blocks(self, trainer: pl.Trainer) -> tuple[type[nn.Module], ...] | None:
        """The blocks to checkpoint: this callback's, or those of an `ActivationCheckpointing` beside it."""
        beside = next((c for c in trainer.callbacks if isinstance(c, ActivationCheckpointing)), None)
        return self.blocks if beside is None else beside.blocks_for(self.blocks)

    def _check_blocks(self, trainer: pl.Trainer, module: nn.Module, modes: Sequence[str]) -> None:
        """Named blocks the model does not have are refused, naming the argument the user gave them in
        (``AutoFit(blocks=...)`` or ``ActivationCheckpointing(blocks=...)``), not `plan_fit`'s."""
        blocks = self._blocks(trainer)
        if blocks is None or set(modes) == {"none"} or find_blocks(module, blocks):
            return
        who = "AutoFit" if self.blocks is not None else "ActivationCheckpointing"
        raise ValueError(no_blocks_message(module, f"{who}(blocks={{MyBlock}})", blocks))

    def _blocks_changed(self, saved: FitPlan, module: nn.Module) -> list[Change]:
        """Where ``saved`` (a checkpoint's plan) names the blocks it checkpoints and this run's ``blocks``
        give others, the change (`stale` compares the rest): the plan is then this run's, not the saved."""
        if saved.checkpoint_plan is None or not saved.checkpoint_plan.blocks or self._target is None:
            return []  # installed on the blocks this run names (`_apply`)
        theirs = [block.name for block in saved.checkpoint_plan.blocks]
        ours = [name for name, _ in find_blocks(module, self._blocks(self._target[0]))]
        if set(theirs) == set(ours):
            return []

        def show(names: list[str]) -> str:
            return f"{len(names)} ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"

        return [("checkpointed blocks", show(theirs), show(ours))]

    def _optimizers(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> Sequence[str | None] | None:
        """The optimizers to plan: this callback's; without them, with an `OptimizerSwap` in the same fit
        (which then defers to this plan), the module's own and then the swap's ``candidates``."""
        if self.optimizers is not None:
            return self.optimizers
        swap = next((c for c in trainer.callbacks if isinstance(c, OptimizerSwap)), None)
        return None if swap is None else lighter_candidates(pl_module, swap.optimizers)

    def _plan(self, trainer: pl.Trainer, pl_module: pl.LightningModule, modes: Sequence[str]) -> FitPlan:
        strategy, ranks = sharding(trainer)
        layout = self._sharding(trainer)
        # Each data-parallel rank takes its own batch; a tensor-parallel group shares one.
        copies = trainer.accumulate_grad_batches * data_parallel_ranks(trainer)
        users = self._batch_size(pl_module)
        example = self._first_batch(trainer)
        if example is None or _is_empty(example):
            what = "yields no batch" if example is None else "yields a first batch of 0 samples"
            raise ValueError(
                f"AutoFit plans from the train dataloader's first batch, but the dataloader {what}, with "
                f"{self.batch_arg_name} = {users}: planning needs at least one sample; check the dataset's "
                "length and the batch size."
            )
        self._axes = self._sample_axes(trainer, pl_module, example, users)
        self._check_blocks(trainer, pl_module, modes)
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
            n_gpus=ranks,
            cost=self.cost,
            progress=lambda line: rank_zero_info(f"AutoFit: {line}"),
            compensate=False,  # the Trainer's precision is the user's: their optimizer stays a candidate
            cpu_offload=fsdp2.cpu_offload if strategy == "fsdp2" else False,
            mixed_precision_policy=fsdp2.mixed_precision_policy and strategy == "fsdp2",
            link=fsdp2.link,
            batch_axes=self._axes,
            micro_batch_size=users,
            sharding=layout,
            blocks=self._blocks(trainer),
            **step_levers(trainer),
        )

    def _fsdp2_options(self, trainer: pl.Trainer) -> FSDP2Options:
        """What the plan may choose of an FSDP2 step's sharding: nothing under a plain
        ModelParallelStrategy (the user's configure_model shards); AutoFitStrategy's planner more."""
        return FSDP2Options()

    def _sharding(self, trainer: pl.Trainer, plan: FitPlan | None = None) -> Any:
        """The layout to plan (`plan_fit`'s ``sharding=``), or the one ``plan`` was made for: the run's
        (`trainer_sharding`). AutoFitStrategy's planner answers with the layouts it chooses among."""
        return trainer_sharding(trainer)

    def _batch_size(self, pl_module: pl.LightningModule) -> int:
        """The batch size attribute's value, a whole number of samples, and one AutoFit can set."""
        value = lightning_getattr(pl_module, self.batch_arg_name)
        if _samples(value) is None:
            raise ValueError(
                f"AutoFit sets the micro-batch through `{self.batch_arg_name}`, which holds {value!r}: it "
                "must be the number of samples each batch of the train dataloader holds (a whole number, "
                "at least 1), read by train_dataloader() as DataLoader(..., batch_size=self."
                f"{self.batch_arg_name}). Over batches made beforehand (batch_size=None) AutoFit cannot "
                "change the micro-batch: remove it, or let the loader batch the samples."
            )
        try:
            lightning_setattr(pl_module, self.batch_arg_name, int(value))
        except AttributeError as error:
            raise ValueError(
                f"AutoFit sets the micro-batch through `{self.batch_arg_name}`, but it cannot be set "
                f"({error}): make it a plain attribute (or give the property a setter)."
            ) from error
        return int(value)

    def _first_batch(self, trainer: pl.Trainer) -> Any:
        """The train dataloader's first batch as the fit loop yields it, built now from the batch size
        attribute (``None``: none): several loaders (a dict or list of them, or a `CombinedLoader`) give
        one batch of each, as the fit loop's ``CombinedLoader`` does."""
        try:
            loaders = fit_data_source(trainer).dataloader()
            if not isinstance(loaders, CombinedLoader):
                loaders = CombinedLoader(loaders, "max_size_cycle")  # the fit loop's mode
            return next((batch for batch, _, _ in loaders if batch is not None), None)  # Lightning skips None
        except Exception as error:
            raise RuntimeError(
                f"AutoFit plans at setup('fit') from the train dataloader's first batch, but building it "
                f"failed: {type(error).__name__}: {error}. The LightningModule's own setup() runs after the "
                "callbacks' (after AutoFit's): build what train_dataloader() reads in __init__ or "
                "prepare_data(), or in a LightningDataModule's setup(), which runs before."
            ) from error

    def _sample_axes(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, example: Any, users: int
    ) -> SampleAxes:
        """Each tensor's sample dimension (`SampleAxes`), read off the train dataloader built again at
        other batch sizes: the dimension that moved in proportion is the one the micro-batches are cut along
        (torch's RNNs take (T, B, ...)), and a tensor that did not move is shared by the samples. A loader
        that ignores the attribute is refused here, before any planning: the plan's micro-batch would never
        reach it; so is one loader of several."""
        probes = [(example, users)]
        sizes = [size for size in dict.fromkeys((users // 2, 1, users * 2)) if size >= 1 and size != users]
        axes, ambiguous = None, None
        for size in sizes[:2]:  # a second size; a third where the second tells nothing (a short dataset)
            try:
                lightning_setattr(pl_module, self.batch_arg_name, size)
                batch = self._first_batch(trainer)
            finally:
                self._put_back_batch_sizes()
            if batch is None:
                continue
            probes.append((batch, size))
            try:
                axes, ambiguous = loader_axes(probes), None
            except AmbiguousAxes as error:
                axes, ambiguous = None, error
                continue
            except ValueError as error:
                raise ValueError(
                    f"AutoFit reads which dimension of each tensor holds the samples from the train "
                    f"dataloader built at {' and '.join(str(n) for _, n in probes)} samples, but {error}."
                ) from error
            if axes is not None:
                break
        if ambiguous is not None:
            raise ValueError(f"AutoFit cannot plan this train dataloader's batches: {ambiguous}.")
        if axes is None and users == 1 and batch_size(example) == 1:  # a loader of one sample, at any size
            return default_axes(example)  # (the first real batch is checked all the same)
        if axes is None:
            tensors = batch_tensors(example)
            shapes = ", ".join(f"{tuple(t.shape)}" for t in tensors[:3]) or "none: it holds no tensor"
            short = min((t.shape[0] for t in tensors if t.dim()), default=users)
            if short < users:  # or the dataset holds fewer samples than either size asked
                shapes += (
                    f"; or the dataset holds {short} samples, fewer than {users}, and gives them all at any "
                    "batch size: then give a batch size at most its length"
                )
            raise ValueError(
                f"AutoFit sets the micro-batch through `{self.batch_arg_name}` ({users} now), but the train "
                f"dataloader does not read it: built with {self.batch_arg_name} = "
                f"{' or '.join(str(n) for _, n in probes[1:])}, its first batch is the same as with {users} "
                f"(tensors of shapes {shapes}). So every batch would stay as it is while AutoFit set the "
                "accumulation for its plan: another global batch, and a step over the budget. Build the "
                f"DataLoader in train_dataloader() from self.{self.batch_arg_name} each time it is called "
                "(not once in setup(), nor with a fixed batch size or batch_size=None over batches made "
                "beforehand), or set AutoFit(batch_arg_name=...) to the attribute it reads."
            )
        loaders = fit_data_source(trainer).dataloader()
        loaders = loaders.iterables if isinstance(loaders, CombinedLoader) else loaders
        parts = list(loaders) if isinstance(loaders, Mapping) else None
        if isinstance(loaders, (list, tuple)):
            parts = list(range(len(loaders)))
        if parts and (fixed := parts_without_samples(example, axes, parts)):
            raise ValueError(
                f"AutoFit sets the micro-batch through `{self.batch_arg_name}`, but of the train loaders "
                f"{', '.join(map(repr, parts))}, {', '.join(map(repr, fixed))} does not read it: its batches "
                "stay the same at every batch size, so with AutoFit's accumulation each optimizer step "
                f"would train more of its samples than you set. Build every loader from "
                f"self.{self.batch_arg_name}, or plan without AutoFit."
            )
        return axes

    def recovery_note(self, trainer: pl.Trainer, pl_module: pl.LightningModule, phase: str | None) -> str:
        """Why this fit's out-of-memory error in ``phase`` was not recovered from (`report_oom` says it)."""
        why = _unrecoverable(trainer, pl_module)
        if self.verify_steps == 0:
            why = "verify_steps=0 turns the recovery off"
        elif why is None and phase == "optimizer step":
            why = "it recovers in the forward and the backward, not in the optimizer step"
        elif why is None and trainer.global_step - self._first_step >= self.verify_steps:
            why = f"it recovers in the first verify_steps={self.verify_steps} steps only"
        elif why is None:
            why = "the leanest plan ran out of memory too"
        return f"AutoFit did not re-plan and retry: {why}."

    def _budget(self, device: str) -> Budget:
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
        _drop_train_loader(trainer)
        self._scale_counts(trainer, plan)
        self._apply(plan)
        self._unchecked = True
        if self._guard is None and self.verify_steps > 0 and _unrecoverable(trainer, pl_module) is None:
            self._guard = StepGuard(trainer, pl_module, self._replan, plan.micro_batch_size, self._axes)
        elif self._guard is not None:  # a resume installs the saved plan over the fresh one
            self._guard.micro_batch_size, self._guard.size = plan.micro_batch_size, None

    def _scale_counts(self, trainer: pl.Trainer, plan: FitPlan) -> None:
        """Whole numbers of training batches (``limit_train_batches``, ``val_check_interval``) count the
        plan's micro-batches: scaled so that they cover the samples the user's batches did. Said in one line;
        ``limit_val_batches``, which counts validation batches the plan may not change, is warned about."""
        users = self._users  # the value the loader reads (of the module's, its hparams' or the datamodule's)
        if users is None:
            return
        ratio = Fraction(users, plan.micro_batch_size)
        changed, rounded_up = [], False
        for name in _BATCH_COUNTS:
            given = self._counts.get(name)
            if ratio == 1 or not _whole(given) or given == 0:  # nothing to scale (nor a loader to build)
                continue
            scaled = max(1, math.ceil(given * ratio))  # at least the samples asked for
            if name == "val_check_interval" and trainer.check_val_every_n_epoch is not None:
                # Within an epoch, as Lightning requires: a last batch of fewer samples makes the epoch
                # shorter than the scaled count (an interval of the user's whole epoch, say).
                scaled = min(scaled, self._epoch_batches(trainer) or scaled)
            setattr(trainer, name, scaled)
            if scaled != given:
                exact = "" if given * ratio == scaled else f" (from {float(given * ratio):.2f})"
                rounded_up |= bool(exact)
                changed.append(f"{name}={given} -> {scaled}{exact}")
        if ratio < 1:  # the user's accumulation merged into a larger micro-batch
            norms = sorted({type(m).__name__ for m in self._target[1].modules() if isinstance(m, _BatchNorm)})
            say = rank_zero_warn if norms else rank_zero_info
            say(
                f"AutoFit: micro-batch {plan.micro_batch_size} x accumulate {plan.accumulate_grad_batches} "
                f"in place of your {users} x {self._accumulate[1]}: the same global batch in fewer, larger "
                "micro-batches (faster)"
                + (
                    f"; {', '.join(norms)} then normalize over {plan.micro_batch_size} samples, not {users}. "
                    "Where the model needs your micro-batch, train it without AutoFit."
                    if norms
                    else "."
                )
            )
        if changed:
            rank_zero_info(
                f"AutoFit: {', '.join(changed)}: they count training batches, now of "
                f"{plan.micro_batch_size} samples where you gave {users}, so the fit covers "
                + (
                    "at least the samples asked for (rounded up, within the epoch)."
                    if rounded_up
                    else "the same samples."
                )
            )
        limit = trainer.limit_val_batches
        if ratio != 1 and _whole(limit) and limit > 0 and "limit_val_batches" not in self._warned:
            self._warned.add("limit_val_batches")
            rank_zero_warn(
                f"AutoFit sets `{self.batch_arg_name}` to the micro-batch {plan.micro_batch_size} (you gave "
                f"{users}): a val_dataloader that reads it gives batches of that size, and "
                f"limit_val_batches={limit} then validates on {float(ratio):.3g}x fewer samples. Give "
                "limit_val_batches as a fraction, or a val_dataloader with a batch size of its own."
            )

    def _epoch_batches(self, trainer: pl.Trainer) -> int | None:
        """Training batches per epoch at the plan's micro-batch (the loader's length, within a whole-number
        ``limit_train_batches``), or ``None`` for a loader without a length."""
        with rng_kept():  # building the loader may draw from them
            try:
                n = len(fit_data_source(trainer).dataloader())
            except TypeError:  # an iterable dataset
                return None
        limit = trainer.limit_train_batches
        return min(n, limit) if _whole(limit) and limit > 0 else n

    def _apply(self, plan: FitPlan) -> None:
        assert self._target is not None
        trainer, module = self._target
        if self._applied is not None:
            self._applied.remove()
        if plan.checkpoint_plan is None and (
            named := named_plan(module, plan.checkpointing, self._blocks(trainer))
        ):
            plan = dataclasses.replace(
                plan, checkpoint_plan=named
            )  # a leaner row's mode, on the blocks named
        self._applied = plan.apply(module)

    # --- after planning -------------------------------------------------------------------------

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
        mine = self.plan.budget
        for monitor in trainer.callbacks:
            theirs = getattr(monitor, "budget", None) if isinstance(monitor, MemoryMonitor) else None
            if theirs is not None and abs(theirs - mine.usable) > 0.01 * mine.usable:
                rank_zero_warn(
                    f"MemoryMonitor(budget={monitor._budget_spec!r}) beside AutoFit(budget={self.budget!r}): "
                    f"the monitor warns over {format_bytes(theirs)} and logs peaks as fractions of it, while "
                    f"AutoFit plans for {format_bytes(mine.usable)} (a limit of "
                    f"{format_bytes(self.plan.limit)} after its margin). Give both the same budget, or the "
                    "monitor none (AutoFit checks the first steps against its plan)."
                )

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._unchecked:
            self._unchecked = False
            self._check_batch(trainer, batch, batch_idx)
        self._step.start(batch, batch_idx)

    def _check_batch(self, trainer: pl.Trainer, batch: Any, batch_idx: int) -> None:
        """The fit's first batch against the plan, on every rank, before its first optimizer step: a batch
        of another size than the plan's micro-batch (a loader that stopped reading the attribute, a
        sampler of its own) would train another global batch, over the budget or under it. Only an
        epoch's last batch may be shorter."""
        assert self.plan is not None
        planned = self.plan.micro_batch_size
        try:
            rows, why = batch_size(batch, self._axes), ""
        except ValueError as error:
            rows, why = None, str(error)
        last = batch_idx + 1 == trainer.num_training_batches
        fine = rows == planned or (rows is not None and rows < planned and last)
        if trainer.strategy.reduce_boolean_decision(fine, all=True):
            return
        if fine:
            rank = trainer.global_rank
            got = f"another rank's first training batch does not hold that (rank {rank}'s does)"
        else:
            got = f"the first training batch on rank {trainer.global_rank} holds " + (
                f"{rows} samples" if rows is not None else f"a batch AutoFit cannot count ({why})"
            )
        raise RuntimeError(
            f"AutoFit planned micro-batch {planned} x accumulate {self.plan.accumulate_grad_batches} and "
            f"set `{self.batch_arg_name}` = {planned}, but {got}"
            ": the run would not be the plan (another global batch, another peak). Build the DataLoader "
            f"in train_dataloader() from self.{self.batch_arg_name} each time it is called, with no "
            "sampler or collate function of its own that sets the batch size, or remove AutoFit."
        )

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Any) -> None:
        self._step.enter("backward")

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        self._step.enter("optimizer step")

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
        if measured > self.plan.limit:
            rank_zero_warn(
                f"AutoFit: step {trainer.global_step} peaked at {format_bytes(measured)}, over the plan's "
                f"limit of {format_bytes(self.plan.limit)} (estimated "
                f"{format_bytes(self.plan.estimated_peak)}); "
                "raise margin= or lower the budget."
            )

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
        self._restore()
        self._restore_bar()

    def _restore_bar(self) -> None:
        """The progress bar gets its own class back (`count_batches`), after a fit or an exception."""
        if self._bar is not None:
            self._bar()
            self._bar = None

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """The module leaves the fit as it came: its own hooks, no checkpointing, its own
        ``configure_optimizers``, its batch size attribute (and the datamodule's, and their hparams') and
        the Trainer's ``accumulate_grad_batches`` at the user's values (the plan stays in `plan` and in the
        checkpoint)."""
        if stage == "fit":
            self._restore_bar()
            self._release()
            self._unapply()
            self._restore()
            self._step.end()

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """The checkpoint's hyperparameters hold the batch size the user set, not the plan's micro-batch
        (which the checkpoint keeps in AutoFit's state): a module loaded from it plans from it again."""
        users = {id(holder): value for holder, value in self._batch_sizes}
        for obj, key in ((pl_module, pl.LightningModule), (trainer.datamodule, pl.LightningDataModule)):
            stored = checkpoint.get(key.CHECKPOINT_HYPER_PARAMS_KEY)
            hparams = getattr(obj, "hparams", None) if obj is not None else None
            if stored is None or id(hparams) not in users or self.batch_arg_name not in stored:
                continue
            stored = copy.copy(stored)  # an omegaconf container there is the module's own hparams
            stored[self.batch_arg_name] = users[id(hparams)]
            checkpoint[key.CHECKPOINT_HYPER_PARAMS_KEY] = stored

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

    def _put_back_batch_sizes(self) -> None:
        """The batch size attribute at the user's values, on every holder (one that cannot be set, a
        property, was never changed)."""
        for holder, value in self._batch_sizes:
            if isinstance(holder, dict):
                holder[self.batch_arg_name] = value
            else:
                with contextlib.suppress(AttributeError):
                    setattr(holder, self.batch_arg_name, value)

    def _restore(self) -> None:
        """The batch size attribute and the Trainer's accumulation back at the user's values."""
        self._put_back_batch_sizes()
        if self._accumulate is not None:
            trainer, accumulate = self._accumulate
            trainer.accumulate_grad_batches = accumulate
            for name, value in self._counts.items():
                setattr(trainer, name, value)
        self._batch_sizes, self._accumulate, self._counts = [], None, {}

    def _replan(self) -> FitPlan:
        """Switch to the plan one notch leaner (`FitPlan.leaner`) after an OOM; raises an OOM that says so
        if none is left.

        The checkpointing changes at once; the micro-batch by cutting batches (`StepGuard`): the Trainer's
        accumulation and the dataloader stay as they are, so the global batch does.
        """
        assert self.plan is not None
        leaner = self.plan.leaner(self.checkpointing)
        if leaner is None:
            allowed = [m for m in self.checkpointing if m in self.plan.modes]
            strongest = (
                f"torch.compile's activation budget {self.plan.compile_budget:g} (a lower one need not peak "
                "lower)"
                if self.plan.compile_budget is not None
                else f"{self.plan.checkpointing} checkpointing, the strongest this model is planned with "
                f"({', '.join(allowed)})"
            )
            # An OOM still, so that the run's end explains it (`on_exception`), with the plan applied.
            raise torch.OutOfMemoryError(
                f"AutoFit: out of memory at micro-batch {self.plan.micro_batch_size} with {strongest}: no "
                "leaner plan is left; lower the budget given to AutoFit so that a lighter optimizer is "
                "chosen."
            )
        rank_zero_warn(f"AutoFit: out of memory; re-planned one notch leaner: {leaner.summary()}")
        self.plan = leaner
        self._apply(leaner)
        return leaner

    def state_dict(self) -> dict[str, Any]:
        return {"plan": self.plan.as_dict() if self.plan is not None else None}

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
        changed = stale(saved, current) + self._blocks_changed(saved, module)
        if recompiled:  # the eager plan's checkpointing modes, against the compiled plan's budget
            changed = [change for change in changed if change[0] != "checkpointing modes"]
            self._compiled = True
        if not changed and install:
            self.plan = saved
            self._install(saved)
            rank_zero_info(f"AutoFit: resumed with the saved plan: {saved.summary()}")
            if self.optimizers is not None and saved.optimizer not in self.optimizers:
                rank_zero_warn(
                    f"AutoFit(optimizers={list(self.optimizers)!r}) set aside: the checkpoint's plan, made "
                    f"for this run, trains with {saved.optimizer}, whose state the checkpoint holds. To "
                    f"change the optimizer, start from its weights alone ({type(module).__name__}."
                    "load_from_checkpoint(path), then fit without ckpt_path)."
                )
            return True

        def warn_once(message: str) -> None:  # load_state_dict comes after AutoFitStrategy's call
            if message not in self._warned:
                self._warned.add(message)
                rank_zero_warn(message)

        strategy = type(trainer.strategy).__name__
        head = (
            f"AutoFit: the checkpoint's plan was made for another run ({said(changed)})"
            if changed
            else f"AutoFit: the checkpoint's plan ({saved.summary()}) is not this fit's, and {strategy} "
            "restores it after building the optimizers"
        )
        if saved.optimizer == current.optimizer and not recompiled:
            warn_once(
                f"{head}: this fit's plan, made for this run, goes on with {optimizer_name(saved)}, whose "
                f"state the checkpoint holds: {current.summary()}"
            )
            return False
        weights = (
            f"(its state goes on), or start from its weights alone ({type(module).__name__}"
            f".load_from_checkpoint(path), then fit without ckpt_path), {optimizer_name(current)} afresh."
        )
        if not replan:
            who = "AutoFitStrategy" if strategy == "AutoFitStrategy" else "AutoFit"
            fix = f"Give {who}(..., optimizers=[{saved.optimizer!r}]) to plan with the checkpoint's optimizer"
            why = f"and {strategy} built it before restoring the checkpoint"
            raise RuntimeError("AutoFit: " + refusal(saved, current, changed, why, f"{fix} {weights}"))
        name = optimizer_name(saved)
        warn_once(f"{head}: planning again for this run, with {name}, whose state the checkpoint holds")
        self._put_back_batch_sizes()  # planned from the user's batch and accumulation, as at setup
        if self._accumulate is not None:
            trainer.accumulate_grad_batches = self._accumulate[1]
        asked, self.optimizers = self.optimizers, (saved.optimizer,)
        try:
            self._decide(trainer, module, self._modes(trainer))
        except ValueError as error:
            made_for = "; ".join(f"{what} {old}" for what, old, _ in changed)
            why = f"and no plan with {name} fits here ({str(error).splitlines()[0]})"
            fix = f"Resume where the checkpoint's plan fits ({made_for}) {weights}"
            raise RuntimeError("AutoFit: " + refusal(saved, current, changed, why, fix)) from error
        finally:
            self.optimizers = asked
        return False


def _unrecoverable(trainer: pl.Trainer, module: pl.LightningModule) -> str | None:
    """Why `StepGuard` cannot recover from an OOM here, or ``None`` if it can: it needs one device that
    runs the module unwrapped, a precision plugin whose backward calls the module's ``backward`` hook,
    automatic optimization, and no optimizer step inside backward."""
    if not isinstance(trainer.strategy, SingleDeviceStrategy):
        return f"it recovers on one device, and {type(trainer.strategy).__name__} runs several"
    if type(trainer.precision_plugin).backward is not Precision.backward:
        return f"{type(trainer.precision_plugin).__name__} runs the backward itself, where it cannot cut it"
    if not module.automatic_optimization:
        return "the module's optimization is manual"
    if step_levers(trainer)["fused_step"]:
        return (
            "FusedOptimizerStep steps each parameter inside the backward: a retried slice would step them "
            "again. Without FusedOptimizerStep, AutoFit re-plans one notch leaner and runs the batch again"
        )
    return None


def _drop_train_loader(trainer: pl.Trainer) -> None:
    """Drop a train loader the fit loop built before the plan, at the user's batch size, so that the loop
    builds it again as it starts (``_FitLoop.setup_data``), at the micro-batch, as Lightning's
    ``BatchSizeFinder`` does (``_reset_dataloaders``). ``trainer.estimated_stepping_batches`` builds it
    when ``configure_optimizers``, which planning runs, reads it (a learning-rate schedule's length) and
    ``max_epochs`` is set; kept, the fit would run the user's batches, accumulated by the plan's count, and
    the progress bar, the schedule and ``val_check_interval`` would count them."""
    loop = trainer.fit_loop
    if loop._combined_loader is None:
        return
    if loop._data_fetcher is not None:  # its iterator, and any workers, read the dropped loader
        loop._data_fetcher.teardown()
        loop._data_fetcher = None
    loop._combined_loader = None


def _whole(value: Any) -> bool:
    """Whether a Trainer's batch count is a whole number of batches (not a fraction, not ``True``)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _check_budget(budget: Any) -> None:
    """Refuse a budget that can never be read, at construction rather than at ``setup``: a float outside
    (0, 1] (`reads_device` says why), an unknown size or GPU name. ``"auto"`` and fractions need the run's
    device and are read at ``setup``."""
    if not reads_device(budget):
        parse_budget(budget)


def _get(holder: Any, name: str) -> Any:
    return holder[name] if isinstance(holder, dict) else getattr(holder, name)


def _samples(value: Any) -> int | None:
    """A batch size attribute's value as a number of samples (a whole number, at least 1; a numpy integer
    too), else ``None``."""
    whole = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    return int(value) if whole and value >= 1 else None


def _is_empty(batch: Any) -> bool:
    """Whether a tensor of ``batch`` has no elements (0 samples along some dimension)."""
    return any(t.dim() > 0 and t.numel() == 0 for t in batch_tensors(batch))
