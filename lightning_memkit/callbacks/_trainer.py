"""The Trainer as the callbacks read it: its precision, strategy, accumulation, loop state, and one
decision taken on rank 0 for every rank. Every read of a Lightning internal is here, so that a Lightning
upgrade that moves one breaks this file only (the versions tested are bounded in pyproject.toml)."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, GradientAccumulationScheduler
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from lightning.pytorch.utilities import CombinedLoader, rank_zero_warn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn

from lightning_memkit._estimating.analytic import SHARD_GRAD_OP, model_static, scheme
from lightning_memkit._estimating.isolate import rng_kept
from lightning_memkit._sharding.layout import ConfigureModel, Layout, layout_mismatch, layout_of
from lightning_memkit._step import Lever, Sharding, Step
from lightning_memkit.callbacks.fused_step import FusedOptimizerStep
from lightning_memkit.callbacks.gradient_release import GradientRelease
from lightning_memkit.callbacks.offload import OptimizerOffload

__all__ = [
    "accumulates",
    "accumulating_now",
    "call_logger",
    "data_parallel_ranks",
    "ddp_bucket_bytes",
    "first_batch",
    "fit_data_source",
    "fsdp_checkpointing",
    "hold_layout",
    "logging_as_training_step",
    "on_rank_zero",
    "optimizer_steps_done",
    "planned_layout",
    "precision",
    "sharding",
    "step_lever",
    "trainer_sharding",
    "trainer_step",
]

T = TypeVar("T")


def precision(trainer: pl.Trainer) -> str:
    """The Trainer's precision as the estimators know it; one they do not know is read as 32-true."""
    return scheme(str(trainer.precision))


def on_rank_zero(trainer: pl.Trainer, decide: Callable[[], T], what: str) -> T:
    """``decide()`` on global rank 0, its (picklable) result broadcast to every rank. An error there is
    raised on every rank once all have left the broadcast, so none waits for a decision that never comes:
    rank 0 raises its own, the others a ``ValueError`` or ``RuntimeError`` with its message."""
    outcome: tuple[str, ...] | tuple[str, T] | None = None
    error: Exception | None = None
    if trainer.is_global_zero:
        try:
            outcome = ("value", decide())
        except Exception as e:
            error, outcome = e, ("error", type(e).__name__, str(e))
    outcome = trainer.strategy.broadcast(outcome, src=0)
    assert outcome is not None
    if error is not None:
        raise error
    if outcome[0] == "error":
        _, kind, message = outcome
        raise (ValueError if kind == "ValueError" else RuntimeError)(
            f"{what} failed on global rank 0: {kind}: {message}"
        )
    return outcome[1]  # type: ignore[return-value]


def sharding(trainer: pl.Trainer) -> tuple[str, int]:
    """The Trainer's strategy as `_estimating.analytic.STRATEGIES` names it, and its number of ranks;
    ``"fsdp2"`` for every ``ModelParallelStrategy`` (its layout: `trainer_sharding`)."""
    ranks, strategy = trainer.world_size, trainer.strategy
    kind = type(strategy).__name__
    if kind == "ModelParallelStrategy" or isinstance(strategy, ModelParallelStrategy):
        # One rank too: FSDP2 all-gathers its units into storages of their own all the same.
        return "fsdp2", ranks
    if kind == "DeepSpeedStrategy":  # one rank too: DeepSpeed's precision scheme all the same
        stage = (getattr(strategy, "config", None) or {}).get("zero_optimization", {}).get("stage", 0)
        return (f"deepspeed_stage_{stage}" if stage in (1, 2, 3) else "ddp"), ranks
    if ranks == 1:
        return "ddp", 1
    if kind == "FSDPStrategy":
        mode = str(getattr(strategy, "sharding_strategy", "FULL_SHARD"))
        if "HYBRID" in mode or "NO_SHARD" in mode:  # hybrid shards within a node only: read as unsharded
            return "ddp", ranks
        return (SHARD_GRAD_OP if "SHARD_GRAD_OP" in mode else "fsdp"), ranks
    return "ddp", ranks  # DDP and anything else: nothing sharded, the conservative reading


def trainer_sharding(trainer: pl.Trainer) -> Sharding | None:
    """Under ``ModelParallelStrategy``, the layout the run applies (`Sharding`): its device mesh's
    data-parallel and tensor-parallel sizes, and the module's own ``configure_model`` run on the simulated
    copy with a fake mesh of that shape (`ConfigureModel`; where it shards nothing, under ``AutoFitStrategy``
    FSDP2's documented layout, as the strategy applies it, else the module whole). ``None`` for any other
    strategy."""
    strategy = trainer.strategy
    if type(strategy).__name__ != "ModelParallelStrategy" and not isinstance(strategy, ModelParallelStrategy):
        return None
    mesh = getattr(strategy, "_device_mesh", None)
    names = (mesh.mesh_dim_names or ()) if mesh is not None else ()
    tp = mesh["tensor_parallel"].size() if "tensor_parallel" in names else 1
    module = trainer.lightning_module
    own = module is not None and is_overridden("configure_model", module, pl.LightningModule)
    # AutoFitStrategy shards a module whose configure_model does not; ModelParallelStrategy trains it whole
    layout = ConfigureModel(shard_unsharded=hasattr(strategy, "autofit")) if own else None
    return Sharding(trainer.world_size, tensor_parallel_size=tp, parallelize_fn=layout)


def planned_layout(module: nn.Module, layout: Sharding | None) -> Layout | None:
    """The layout a plan made now simulates for ``module`` (``layout`` applied to a copy of it:
    `simulated_layout`), to hold the run's own to once configure_model has run (`hold_layout`); ``None``
    without a layout, or for a module already laid out (nothing to compare later)."""
    from lightning_memkit._estimating.fake_model import simulated_layout

    return None if layout is None or layout_of(module) else simulated_layout(module, layout)


def hold_layout(trainer: pl.Trainer, module: nn.Module, planned: Layout | None, planner: str) -> None:
    """Refuse a run whose layout (`layout_of` ``module`` after configure_model) is not ``planned``, the one
    ``planner``'s plan simulated (`planned_layout`): a plan for one layout does not hold for another. Every
    rank reads the same layout, so every rank raises alike."""
    layout = trainer_sharding(trainer)
    why = (
        None
        if planned is None or layout is None
        else layout_mismatch(planned, layout_of(module), planner, layout)
    )
    if why is not None:
        raise RuntimeError(why)


def data_parallel_ranks(trainer: pl.Trainer) -> int:
    """The ranks that each take their own batch: all of them, less tensor parallelism's groups."""
    layout = trainer_sharding(trainer)
    return trainer.world_size if layout is None else layout.data_parallel_size


def ddp_bucket_bytes(trainer: pl.Trainer, module: nn.Module) -> int:
    """Bytes of DDP's all-reduce buckets on each rank: a copy of every trainable parameter's gradient in
    the precision the run trains in (`_estimating.analytic.shard`); 0 unless the strategy is DDP (one rank
    too: the
    model is wrapped all the same)."""
    if not isinstance(trainer.strategy, DDPStrategy):
        return 0
    return model_static(module, precision(trainer)).gradients


def accumulates(trainer: pl.Trainer) -> bool:
    """Whether any step of the fit accumulates gradients: now, or in a later epoch of a
    ``GradientAccumulationScheduler``."""
    schedulers = [c for c in trainer.callbacks if isinstance(c, GradientAccumulationScheduler)]
    scheduled = [n for c in schedulers for n in c.scheduling.values()]
    return trainer.accumulate_grad_batches > 1 or any(n > 1 for n in scheduled)


def step_lever(trainer: pl.Trainer) -> Lever | None:
    """How the fit's callbacks change the step, as `estimate_memory`'s ``lever``: ``"fused_step"`` (a
    `FusedOptimizerStep`: each parameter stepped inside backward), ``"offload"`` (an `OptimizerOffload`:
    the optimizer in host memory) or ``"release_gradients"`` (a `GradientRelease`: no previous step's
    gradients in the forward, what the other two give anyway: either stands for both); ``None`` without
    one. The budget callbacks plan that step."""
    callbacks: dict[Lever, type] = {
        "fused_step": FusedOptimizerStep, "offload": OptimizerOffload, "release_gradients": GradientRelease,
    }  # fmt: skip
    installed = [
        lever for lever, kind in callbacks.items() if any(isinstance(c, kind) for c in trainer.callbacks)
    ]
    if "fused_step" in installed and "offload" in installed:
        raise ValueError(
            "The optimizer step cannot be both fused into backward and offloaded to the host: choose one."
        )
    return installed[0] if installed else None


def trainer_step(trainer: pl.Trainer, **changes: Any) -> Step:
    """The step this fit runs, as the estimators take it (`Step`): the Trainer's precision, whether it
    accumulates (`accumulates`), the lever its callbacks install (`step_lever`) and, under
    ModelParallelStrategy, the layout it applies (`trainer_sharding`); ``changes`` to that `Step`."""
    # ``changes`` first, then the checks: a step that accumulates later in the fit (a scheduler) may be
    # asked about now, when it does not.
    step = Step.of(precision=precision(trainer), lever=step_lever(trainer))
    changes = {"sharding": trainer_sharding(trainer), "accumulating": accumulates(trainer), **changes}
    return step.but(**changes)


def accumulating_now(trainer: pl.Trainer) -> bool:
    """Whether the batch in flight accumulates (no optimizer step follows it)."""
    return trainer.fit_loop.epoch_loop._should_accumulate()


def optimizer_steps_done(trainer: pl.Trainer) -> int:
    """Optimizer steps taken so far, counted as Lightning's loggers count them (``step`` in metrics)."""
    return trainer.fit_loop.epoch_loop._batches_that_stepped


def first_batch(trainer: pl.Trainer) -> Any | None:
    """The first batch of the training dataloader as ``training_step`` will receive it, or ``None`` when
    the Trainer has no training dataloader or it yields no batch.

    For a callback that simulates the step before training (from ``setup`` on: the dataloader is
    attached). The loader comes from the fit's data source (the ``train_dataloader`` hook or the
    datamodule's, called once more), and ``None`` batches are skipped as the fit loop skips them. The
    batch goes through ``on_before_batch_transfer``, ``transfer_batch_to_device`` (to the strategy's root
    device) and ``on_after_batch_transfer``, as the fit loop does. The global RNG streams (torch's,
    Python's ``random``, NumPy's) and every loader's and sampler's own generator are put back afterwards,
    so the epoch that follows starts with this very batch and draws the same random numbers.
    """
    source = trainer.fit_loop._data_source
    with rng_kept():  # the hook itself may draw from them (a dataset of random data, a split)
        loader = source.dataloader() if source.is_defined() else None
        if loader is None:
            return None
        combined = loader if isinstance(loader, CombinedLoader) else CombinedLoader(loader, "max_size_cycle")
        with _rng_kept(combined.flattened):
            batch = next((b for b, _, _ in combined if b is not None), None)
            if batch is None:
                return None
            batch = trainer.lightning_module._on_before_batch_transfer(batch, dataloader_idx=0)
            return trainer.strategy.batch_to_device(batch, dataloader_idx=0)


@contextlib.contextmanager
def _rng_kept(loaders: Sequence[Any]) -> Iterator[None]:
    """Put back the global RNG streams (torch's, Python's ``random``, NumPy's: a dataset may augment with
    any of them) and every loader's and sampler's own generator: a shuffling sampler draws its
    permutation from them when iterated."""
    generators: dict[int, torch.Generator] = {}
    for loader in loaders:
        batch_sampler = getattr(loader, "batch_sampler", None)
        for holder in (loader, getattr(loader, "sampler", None), getattr(batch_sampler, "sampler", None)):
            g = getattr(holder, "generator", None)
            if isinstance(g, torch.Generator):
                generators[id(g)] = g
    states = [(g, g.get_state()) for g in generators.values()]
    with rng_kept():
        try:
            yield
        finally:
            for g, state in states:
                g.set_state(state)


def call_logger(logger: Any, what: str, call: Callable[[], Any], who: str, warned: set[str]) -> None:
    """Make one call of a callback (``who``) into a logger. A logger that raises (a full disk, a lost
    connection) fails its own logging, not the run it logs: rank 0 warns once per logger and method
    (``warned`` keeps the keys said), and training goes on."""
    try:
        call()
    except Exception as err:
        key = f"{type(logger).__name__}.{what}"
        if key not in warned:
            warned.add(key)
            rank_zero_warn(
                f"{who}: {key} raised {err!r}; training goes on, and this logger's further failures are "
                "not reported again."
            )


def autofit_in(trainer: pl.Trainer) -> Callback | None:
    """The fit's `AutoFit`, or ``None``: the callbacks that decide what it plans (checkpointing, the
    optimizer) defer to it."""
    from lightning_memkit.callbacks.auto_fit import AutoFit  # auto_fit imports the callbacks that ask

    return next((c for c in getattr(trainer, "callbacks", ()) if isinstance(c, AutoFit)), None)


def fit_data_source(trainer: pl.Trainer) -> Any:
    """The fit's training data source (what ``BatchSizeFinder`` reads): ``is_module()`` tells whether the
    dataloader comes from a hook that may be called again, ``dataloader()`` calls it."""
    return trainer.fit_loop._data_source


@contextlib.contextmanager
def logging_as_training_step(module: pl.LightningModule) -> Iterator[None]:
    """``self.log`` called outside the loop's ``training_step`` (from a slice run in ``backward``) files its
    values under ``training_step``, as usual."""
    previous = module._current_fx_name
    module._current_fx_name = "training_step"
    try:
        yield
    finally:
        module._current_fx_name = previous


def fsdp_checkpointing(strategy: Any, classes: set[type[nn.Module]] | None = None) -> bool:
    """Whether ``strategy`` (an ``FSDPStrategy``) checkpoints activations itself; with ``classes``, make it
    checkpoint every instance of them (``activation_checkpointing_policy=classes``) first."""
    if classes is not None:
        from lightning.fabric.strategies.fsdp import _activation_checkpointing_kwargs  # FSDP's own import

        strategy._activation_checkpointing_kwargs = _activation_checkpointing_kwargs(None, classes)
    return bool(getattr(strategy, "_activation_checkpointing_kwargs", None))


def into_gradients(trainer: pl.Trainer, batch_idx: int) -> bool:
    """Whether the batch's backward adds to gradients already there (`estimate_memory`'s ``accumulating``):
    with gradient accumulation, every micro-batch but a cycle's first, after which Lightning zeroes them."""
    return trainer.accumulate_grad_batches > 1 and batch_idx % trainer.accumulate_grad_batches != 0


def the_optimizer(trainer: pl.Trainer) -> torch.optim.Optimizer | None:
    """The run's optimizer when it has one, for a simulation to copy; ``None`` with several (the simulation
    then calls ``configure_optimizers``)."""
    return trainer.optimizers[0] if len(trainer.optimizers) == 1 else None


#: Where a parameter's name moves when torch.compile, checkpoint_wrapper or FSDP1 wrap its module.
_WRAPPED = re.compile(r"(_orig_mod|_checkpoint_wrapped_module|_fsdp_wrapped_module)\.")


def parameters_of(module: nn.Module) -> tuple[int, set[str]]:
    """How many parameter elements ``module`` has and their names: what a plan is made for."""
    return sum(p.numel() for p in module.parameters()), {n for n, _ in module.named_parameters()}


def built_late(who: str, module: nn.Module, planned: tuple[int, set[str]]) -> str | None:
    """Why the plan made for ``planned`` (`parameters_of` at ``setup``) is not ``module``'s, whose
    ``configure_model`` added parameters after it (a refusal's words), or ``None``."""
    count, names = planned
    now = sum(p.numel() for p in module.parameters())
    if now <= count:
        return None
    built = [name for name, _ in module.named_parameters() if _WRAPPED.sub("", name) not in names]
    shown = ", ".join(f"`{n}`" for n in built[:3]) + (
        f", ... ({len(built)} in all)" if len(built) > 3 else ""
    )
    return (
        f"{who}: {type(module).__name__}.configure_model built {now - count:,} parameters ({shown}) after "
        f"the plan was made (at setup, for {count:,}): the plan is not this model's. Build those layers in "
        '__init__ (under `with torch.device("meta"):` for a model too large for the host), so that they '
        "are planned."
    )
