"""The train dataloader's batches as `AutoFit` reads them: the run it can plan, the first batch it plans
from, which dimension of each tensor holds the samples (read off the loader built at other batch sizes),
and the fit's first batch held to the plan.

AutoFit sets the micro-batch through one attribute (``batch_arg_name``) that ``train_dataloader()`` reads;
everything here refuses, before any planning, a loader through which that setting would never reach the
batches, or would reach only some of them.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import CombinedLoader
from lightning.pytorch.utilities.parsing import lightning_getattr, lightning_hasattr, lightning_setattr
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature

from lightning_memkit._estimating.lightning_step import (
    AmbiguousAxes,
    SampleAxes,
    batch_size,
    batch_tensors,
    default_axes,
    loader_axes,
    parts_without_samples,
)
from lightning_memkit.callbacks._trainer import fit_data_source

__all__ = [
    "check_example",
    "check_first_batch",
    "check_plannable",
    "drop_train_loader",
    "first_batch",
    "sample_axes",
    "samples",
    "settable_batch_size",
]


def check_plannable(trainer: pl.Trainer, pl_module: pl.LightningModule, name: str) -> None:
    """Refuse, at ``setup("fit")``, a fit whose micro-batch AutoFit cannot set through the attribute
    ``name``: a dataloader given ready-made, an attribute nothing holds, a ``training_step`` that fetches
    its own batches, manual optimization."""
    if not fit_data_source(trainer).is_module():
        raise ValueError(
            f"AutoFit plans the micro-batch and sets it through the attribute your train_dataloader() "
            f"reads (`{name}`), but the train dataloader was passed to fit() ready-made, "
            "so nothing AutoFit sets reaches it: pass a LightningDataModule (datamodule=) or define "
            "train_dataloader() on the module, building the DataLoader there from that attribute."
        )
    if not lightning_hasattr(pl_module, name):
        raise AttributeError(
            f"AutoFit sets the micro-batch through `{name}`, which neither the module, "
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


def samples(value: Any) -> int | None:
    """A batch size attribute's value as a number of samples (a whole number, at least 1; a numpy integer
    too), else ``None``."""
    whole = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    return int(value) if whole and value >= 1 else None


def settable_batch_size(pl_module: pl.LightningModule, name: str) -> int:
    """The batch size attribute ``name``'s value, a whole number of samples, and one AutoFit can set."""
    value = lightning_getattr(pl_module, name)
    if samples(value) is None:
        raise ValueError(
            f"AutoFit sets the micro-batch through `{name}`, which holds {value!r}: it "
            "must be the number of samples each batch of the train dataloader holds (a whole number, "
            "at least 1), read by train_dataloader() as DataLoader(..., batch_size=self."
            f"{name}). Over batches made beforehand (batch_size=None) AutoFit cannot "
            "change the micro-batch: remove it, or let the loader batch the samples."
        )
    try:
        lightning_setattr(pl_module, name, int(value))
    except AttributeError as error:
        raise ValueError(
            f"AutoFit sets the micro-batch through `{name}`, but it cannot be set "
            f"({error}): make it a plain attribute (or give the property a setter)."
        ) from error
    return int(value)


def first_batch(trainer: pl.Trainer) -> Any:
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


def check_example(example: Any, users: int, name: str) -> None:
    """Refuse to plan from no first batch (``example`` ``None``), or one of 0 samples (a tensor with no
    elements), built with ``name`` = ``users``."""
    if example is not None and not any(t.dim() > 0 and t.numel() == 0 for t in batch_tensors(example)):
        return
    what = "yields no batch" if example is None else "yields a first batch of 0 samples"
    raise ValueError(
        f"AutoFit plans from the train dataloader's first batch, but the dataloader {what}, with "
        f"{name} = {users}: planning needs at least one sample; check the dataset's "
        "length and the batch size."
    )


def sample_axes(
    trainer: pl.Trainer,
    pl_module: pl.LightningModule,
    example: Any,
    users: int,
    name: str,
    put_back: Callable[[], None],
) -> SampleAxes:
    """Each tensor's sample dimension (`SampleAxes`), read off the train dataloader built again at
    other batch sizes (the attribute ``name`` set, then ``put_back``): the dimension that moved in
    proportion is the one the micro-batches are cut along (torch's RNNs take (T, B, ...)), and a tensor that
    did not move is shared by the samples. A loader that ignores the attribute is refused here, before any
    planning: the plan's micro-batch would never reach it; so is one loader of several."""

    def built_at(size: int) -> Any:
        try:
            lightning_setattr(pl_module, name, size)
            return first_batch(trainer)
        finally:
            put_back()

    axes, probes = _probe(example, users, built_at)
    if axes is None and users == 1 and batch_size(example) == 1:  # a loader of one sample, at any size
        return default_axes(example)  # (the first real batch is checked all the same)
    if axes is None:
        raise ValueError(_unread(example, users, name, probes))
    _check_every_loader_reads(trainer, example, axes, name)
    return axes


def _probe(
    example: Any, users: int, built_at: Callable[[int], Any]
) -> tuple[SampleAxes | None, list[tuple[Any, int]]]:
    """The axes the loader's first batches at ``users`` (``example``) and at a second size
    (``built_at(size)``) give (a third where the second tells nothing: a short dataset), and the (batch,
    size) probes read; ``None`` where no size moved any tensor."""
    probes = [(example, users)]
    sizes = [size for size in dict.fromkeys((users // 2, 1, users * 2)) if size >= 1 and size != users]
    axes, ambiguous = None, None
    for size in sizes[:2]:
        batch = built_at(size)
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
    return axes, probes


def _unread(example: Any, users: int, name: str, probes: list[tuple[Any, int]]) -> str:
    """Why a loader whose first batch stayed the same at every size probed cannot be planned."""
    tensors = batch_tensors(example)
    shapes = ", ".join(f"{tuple(t.shape)}" for t in tensors[:3]) or "none: it holds no tensor"
    short = min((t.shape[0] for t in tensors if t.dim()), default=users)
    if short < users:  # or the dataset holds fewer samples than either size asked
        shapes += (
            f"; or the dataset holds {short} samples, fewer than {users}, and gives them all at any "
            "batch size: then give a batch size at most its length"
        )
    return (
        f"AutoFit sets the micro-batch through `{name}` ({users} now), but the train "
        f"dataloader does not read it: built with {name} = "
        f"{' or '.join(str(n) for _, n in probes[1:])}, its first batch is the same as with {users} "
        f"(tensors of shapes {shapes}). So every batch would stay as it is while AutoFit set the "
        "accumulation for its plan: another global batch, and a step over the budget. Build the "
        f"DataLoader in train_dataloader() from self.{name} each time it is called "
        "(not once in setup(), nor with a fixed batch size or batch_size=None over batches made "
        "beforehand), or set AutoFit(batch_arg_name=...) to the attribute it reads."
    )


def _check_every_loader_reads(trainer: pl.Trainer, example: Any, axes: SampleAxes, name: str) -> None:
    """Refuse several train loaders (a dict or list of them) of which one does not read the attribute:
    its batches would stay the same at every batch size."""
    loaders = fit_data_source(trainer).dataloader()
    loaders = loaders.iterables if isinstance(loaders, CombinedLoader) else loaders
    parts = list(loaders) if isinstance(loaders, Mapping) else None
    if isinstance(loaders, (list, tuple)):
        parts = list(range(len(loaders)))
    if parts and (fixed := parts_without_samples(example, axes, parts)):
        raise ValueError(
            f"AutoFit sets the micro-batch through `{name}`, but of the train loaders "
            f"{', '.join(map(repr, parts))}, {', '.join(map(repr, fixed))} does not read it: its batches "
            "stay the same at every batch size, so with AutoFit's accumulation each optimizer step "
            f"would train more of its samples than you set. Build every loader from "
            f"self.{name}, or plan without AutoFit."
        )


def check_first_batch(
    trainer: pl.Trainer, batch: Any, batch_idx: int, planned: int, accumulate: int, axes: Any, name: str
) -> None:
    """The fit's first batch against the plan's micro-batch ``planned``, on every rank, before its first
    optimizer step: a batch of another size (a loader that stopped reading the attribute, a sampler of its
    own) would train another global batch, over the budget or under it. Only an epoch's last batch may be
    shorter."""
    try:
        rows, why = batch_size(batch, axes), ""
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
        f"AutoFit planned micro-batch {planned} x accumulate {accumulate} and "
        f"set `{name}` = {planned}, but {got}"
        ": the run would not be the plan (another global batch, another peak). Build the DataLoader "
        f"in train_dataloader() from self.{name} each time it is called, with no "
        "sampler or collate function of its own that sets the batch size, or remove AutoFit."
    )


def drop_train_loader(trainer: pl.Trainer) -> None:
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
