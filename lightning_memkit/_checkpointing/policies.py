"""Activation checkpointing modes, and applying them to a model in place.

Every block a plan names (see `find_blocks`) gets one of four modes (a `CheckpointMode`), from the least to
the most memory saved:

======================  ====================================================================================
``"none"``              the block as written.
``"selective"``         op-level (``create_selective_checkpoint_contexts``): the outputs of matmuls and fused
                        attention kernels are kept; pointwise ops, norms, softmax, dropout are recomputed.
``"selective_half"``    as ``"selective"``, but every second matmul is recomputed too (torchtitan's op-level
                        policy): more memory saved for one matmul of recompute.
``"full"``              only the block's inputs are kept; the whole forward is recomputed in backward.
======================  ====================================================================================

Each mode is a small checkpointer class (`_checkpointing.checkpointers`; its ``context`` is torch's
checkpoint policy), all sharing one `apply_checkpointing(model, plan | mode)`, which replaces each chosen
block's ``forward`` by an instance attribute that runs the class's forward under
``torch.utils.checkpoint.checkpoint(use_reentrant=False, preserve_rng_state=True)``. Patching in place
rather than wrapping keeps what the rest of training sees: parameters keep their identity, ``state_dict``
keys do not change, and the optimizer, DDP and checkpoints see the same model. A block is never wrapped
twice, and the returned handle undoes everything (``with apply_checkpointing(...):`` for a temporary plan,
as a simulation needs). The model's state ends as without checkpointing: a recompute updates scratch
copies of BatchNorm's running statistics, and Hugging Face's key/value cache (``config.use_cache``) is off
while any block is checkpointed, as ``gradient_checkpointing_enable()`` does in training.

A plan is a plain value (`CheckpointPlan`, one `BlockPlan` per block): `plan_checkpointing` makes one for a
budget, `estimate_memory` simulates a step with one, and a callback saves one in its ``state_dict``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any
from weakref import ref

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.checkpoint import (
    checkpoint,
)

from lightning_memkit._breakdown import MemoryBreakdown, format_bytes
from lightning_memkit._checkpointing.blocks import LayerClasses, block_classes, find_blocks, no_blocks_message
from lightning_memkit._checkpointing.checkpointers import CHECKPOINTERS, checkpointer
from lightning_memkit._vocabulary import CHECKPOINT_MODES, CheckpointMode

__all__ = [
    "CHECKPOINT_MODES",
    "BlockPlan",
    "CheckpointHandle",
    "CheckpointMode",
    "CheckpointPlan",
    "applied_modes",
    "apply_checkpointing",
]

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------------
# Applying: forward patched in place
# --------------------------------------------------------------------------------------------------


class CheckpointedForward:
    """Set as ``module.forward``: runs the module's own forward under ``checkpoint`` in a mode's way.

    ``previous`` is the instance-level ``forward`` that was there before (``None`` for the class's), so
    removing the patch restores exactly what was. Under ``torch.no_grad()`` (validation, generation) there
    is nothing to save and the forward runs plainly.
    """

    def __init__(self, module: nn.Module, checkpointer: Any, previous: Callable | None) -> None:
        self.module = module
        self.checkpointer = checkpointer
        self.previous = previous

    def original(self) -> Callable:
        if self.previous is not None:
            return self.previous
        return functools.partial(type(self.module).forward, self.module)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        forward = self.original()
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(
            _Recomputable(forward, self.module),
            *args,
            use_reentrant=False,
            preserve_rng_state=True,
            context_fn=self.checkpointer.context,
            **kwargs,
        )

    def __repr__(self) -> str:
        return f"CheckpointedForward({type(self.module).__name__}, mode={self.checkpointer.name!r})"


class _Recomputable:
    """The function one ``checkpoint`` call runs: the first call is the forward, later ones recompute it.

    Non-reentrant checkpointing calls the function again in backward. A recompute must leave the module's
    state as the forward alone would: BatchNorm in training mode updates its running statistics on every
    call, so during a recompute each ``_BatchNorm`` of the block updates scratch copies of its buffers
    instead (what fairscale's checkpoint wrapper achieves by pausing the tracking); the recomputed outputs
    and saved tensors are identical in number and shape, the batch statistics being the same.
    """

    def __init__(self, forward: Callable, module: nn.Module) -> None:
        self.forward = forward
        self.module = module
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls == 1:
            return self.forward(*args, **kwargs)
        with _scratch_running_stats(self.module):
            return self.forward(*args, **kwargs)


_RUNNING_STATS = ("running_mean", "running_var", "num_batches_tracked")


@contextlib.contextmanager
def _scratch_running_stats(module: nn.Module) -> Iterator[None]:
    """While inside, the training-mode BatchNorms in ``module`` update copies of their running statistics;
    the module's own buffers (the same tensor objects) are back on exit, untouched, even on error (early
    stop of a recompute raises through here)."""
    swapped: list[tuple[nn.Module, str, Tensor]] = []
    try:
        for m in module.modules():
            if not (isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training and m.track_running_stats):
                continue
            for name in _RUNNING_STATS:
                buffer = m._buffers.get(name)
                if buffer is not None:
                    # Outside the recompute's dispatch modes: selective checkpointing replays only the ops
                    # the forward ran, and a simulation's ledger need not count these few bytes.
                    with _disable_current_modes(), torch.no_grad():
                        scratch = buffer.clone()
                    swapped.append((m, name, buffer))
                    m._buffers[name] = scratch
        yield
    finally:
        for m, name, buffer in reversed(swapped):
            m._buffers[name] = buffer


def _checkpointed_elsewhere(module: nn.Module, current: Any) -> bool:
    """Whether ``module`` is already checkpointed by other code: torch's ``CheckpointWrapper``, a
    ``partial(checkpoint, ...)`` forward, a Hugging Face layer after ``gradient_checkpointing_enable()``."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    if isinstance(module, CheckpointWrapper) or getattr(module, "gradient_checkpointing", False) is True:
        return True
    return isinstance(current, functools.partial) and current.func is checkpoint


def _compile_with(budget: float) -> None:
    """torch.compile's activation budget set to ``budget``; where that changes it, what dynamo compiled is
    forgotten (``torch.compiler.reset()``): a graph compiled under the other value (this model's, or its
    class's earlier in the process) would otherwise be reused as it is."""
    from torch._functorch import config

    if config.activation_memory_budget != budget:
        config.activation_memory_budget = budget
        torch.compiler.reset()


#: the handles whose plans set torch.compile's activation budget, oldest first (`budget_before_plans`)
_SETTING_BUDGET: list[CheckpointHandle] = []


def budget_before_plans() -> float | None:
    """torch.compile's activation budget as it was before the plans applied now set it (``None``: no plan
    applied sets it): what a compiled model is planned at again "as written" (`_diagnosis.oom`)."""
    return _SETTING_BUDGET[0]._compile_budget if _SETTING_BUDGET else None


class CheckpointHandle:
    """What `apply_checkpointing` did, to undo it: ``handle.remove()``, or use it as a context manager."""

    def __init__(self) -> None:
        self._undo: list[tuple[nn.Module, Any]] = []
        #: Hugging Face configs whose ``use_cache`` this handle turned off, with the value it had.
        self._configs: list[tuple[Any, Any]] = []
        #: torch.compile's activation budget before this handle set it (a compiled model's plan)
        self._compile_budget: float | None = None

    def _set(self, module: nn.Module, checkpointer: Any) -> bool:
        """Give ``module`` ``checkpointer``'s mode; returns whether it is now checkpointed by this handle."""
        current = module.__dict__.get("forward")
        ours = isinstance(current, CheckpointedForward)
        if not ours and checkpointer.checkpoints and _checkpointed_elsewhere(module, current):
            warnings.warn(
                f"{type(module).__name__} is already checkpointed by other code (torch's CheckpointWrapper, "
                "a checkpoint partial, Hugging Face's gradient checkpointing); it is left as it is, not "
                "wrapped twice.",
                stacklevel=4,
            )
            return False
        self._undo.append((module, current))
        previous = current.previous if ours else current
        if checkpointer.checkpoints:
            module.__dict__["forward"] = CheckpointedForward(module, checkpointer, previous)
        elif previous is None:
            module.__dict__.pop("forward", None)
        else:
            module.__dict__["forward"] = previous
        return bool(checkpointer.checkpoints)

    def _turn_off_cache(self, model: nn.Module, announce: bool) -> None:
        """``use_cache = False`` on the Hugging Face configs in ``model`` that have it on; ``announce``
        (`apply_checkpointing`'s own plans, not the planner's) also says so and remembers the value, so
        that ``apply_checkpointing(model, "none")`` can give it back without this handle."""
        configs = caching_configs(model)
        for config in configs:
            self._configs.append((config, config.use_cache))
            if announce:
                _CACHE_TURNED_OFF[id(config)] = (ref(config), config.use_cache)
            config.use_cache = False
        if configs and announce:
            _announce_cache_off(configs)

    def _set_compile_budget(self, budget: float) -> None:
        from torch._functorch import config

        self._compile_budget = config.activation_memory_budget
        _SETTING_BUDGET.append(self)
        _compile_with(budget)

    def restore_compile_budget(self) -> None:
        """Put torch.compile's activation budget back as it was before this handle set it (a compiled
        model's plan); the blocks stay as they are."""
        if self._compile_budget is not None:
            _compile_with(self._compile_budget)
            self._compile_budget = None
            _SETTING_BUDGET.remove(self)

    def remove(self) -> None:
        """Put every patched ``forward``, every ``use_cache`` and torch.compile's activation budget back as
        they were, in reverse order."""
        self.restore_compile_budget()
        for config, previous in reversed(self._configs):
            config.use_cache = previous
            _CACHE_TURNED_OFF.pop(id(config), None)
        self._configs = []
        for module, previous in reversed(self._undo):
            if previous is None:
                module.__dict__.pop("forward", None)
            else:
                module.__dict__["forward"] = previous
        self._undo = []

    def __enter__(self) -> CheckpointHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def caching_configs(model: nn.Module) -> list[Any]:
    """The distinct Hugging Face configs reachable from ``model``'s submodules with ``use_cache`` on.

    Hugging Face's key/value cache is for generation. In a training step it fills on the first forward, so
    a checkpointed block recomputes against a cache that differs from the one its forward saw (a different
    number of saved tensors, shapes that do not match, a graph backpropagated twice), and it keeps every
    layer's keys and values alive, which checkpointing exists to free. ``gradient_checkpointing_enable()``
    turns it off in training for the same reasons. T5's encoder and decoder stacks hold configs of their own.
    """
    found: dict[int, Any] = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and getattr(config, "use_cache", None) is True:
            found.setdefault(id(config), config)
    return list(found.values())


#: ``id(config) -> (weakref, use_cache before)``: configs `apply_checkpointing` turned the cache off on.
_CACHE_TURNED_OFF: dict[int, tuple[Any, Any]] = {}


def _give_back_cache(model: nn.Module) -> None:
    """``use_cache`` as it was on ``model``'s configs, once none of its blocks is checkpointed any more."""
    for module in model.modules():
        config = getattr(module, "config", None)
        entry = _CACHE_TURNED_OFF.get(id(config)) if config is not None else None
        if entry is not None and entry[0]() is config:
            config.use_cache = entry[1]
            del _CACHE_TURNED_OFF[id(config)]


#: ``id(config) -> weakref``: configs `_announce_cache_off` has named (configs are not hashable), once
#: each however often a planner checkpoints their model
_ANNOUNCED: dict[int, Any] = {}


def _announce_cache_off(configs: Sequence[Any]) -> None:
    configs = [c for c in configs if (seen := _ANNOUNCED.get(id(c))) is None or seen() is not c]
    if not configs:
        return
    _ANNOUNCED.update((id(c), ref(c)) for c in configs)
    names = Counter(type(c).__name__ for c in configs)
    which = ", ".join(f"{n} x{k}" if k > 1 else n for n, k in names.items())
    log.warning(  # a warning, as Hugging Face's own gradient_checkpointing_enable() says it
        "Turned off Hugging Face's key/value cache (config.use_cache=False on %s) while checkpointing: it "
        "is for generation, and in training it keeps every layer's keys/values alive and makes the "
        "recomputed forward differ from the first (as gradient_checkpointing_enable() does; "
        "apply_checkpointing(model, 'none') or handle.remove() turns it back on).",
        which,
    )


@contextlib.contextmanager
def without_cache(model: nn.Module) -> Iterator[None]:
    """``use_cache`` off in ``model``'s Hugging Face configs while inside (silently: for simulations)."""
    handle = CheckpointHandle()
    handle._turn_off_cache(model, announce=False)
    with handle:
        yield


def applied_modes(model: nn.Module) -> dict[str, str]:
    """``{qualified name: mode}`` of the submodules `apply_checkpointing` has wrapped in ``model``."""
    return {
        name: m.__dict__["forward"].checkpointer.name
        for name, m in model.named_modules()
        if isinstance(m.__dict__.get("forward"), CheckpointedForward)
    }


def apply_checkpointing(
    model: nn.Module,
    plan: CheckpointPlan | Mapping[str, str] | str | LayerClasses = "full",
    *,
    blocks: LayerClasses | None = None,
) -> CheckpointHandle:
    """Checkpoint ``model``'s blocks in place; returns a handle that undoes it.

    Args:
        model: any ``nn.Module``.
        plan: a `CheckpointPlan` (from `plan_checkpointing`; its names are relative to the module it was
            planned on), a ``{module name: mode}`` mapping, one mode for every block (``"full"``,
            ``"selective"``, ``"selective_half"``; ``"none"`` removes all checkpointing applied here), or a
            set of layer classes to checkpoint fully (the form FSDPStrategy's
            ``activation_checkpointing_policy`` takes).
        blocks: with a mode, the layer classes whose instances are the blocks (default: `find_blocks`).

    Each block's ``forward`` becomes an instance attribute that calls the class's forward under
    ``torch.utils.checkpoint.checkpoint(use_reentrant=False, preserve_rng_state=True)``, so parameters,
    ``state_dict`` keys and hooks are unchanged and dropout draws the same masks when recomputed. Applying
    again replaces a block's mode instead of wrapping it twice. Example::

        with apply_checkpointing(model, "selective"):  # undone on exit
            loss = model(x).sum(); loss.backward()

    When at least one block gets checkpointed, Hugging Face's key/value cache is turned off for training
    (``use_cache = False`` on every config in ``model`` that has it on, as ``gradient_checkpointing_enable()``
    does; one warning line says so): ``handle.remove()`` or ``apply_checkpointing(model, "none")`` turns it
    back on.
    """
    return apply_plan(model, plan, blocks, announce=True)


def apply_plan(
    model: nn.Module, plan: Any, blocks: LayerClasses | None = None, *, announce: bool
) -> CheckpointHandle:
    """`apply_checkpointing`; ``announce=False`` for the planner's temporary plans (nothing logged)."""
    assignment = _assignment(model, plan, blocks)
    handle = CheckpointHandle()
    if isinstance(plan, CheckpointPlan) and plan.compile_budget is not None:
        handle._set_compile_budget(plan.compile_budget)
    checkpointed = False
    for module, mode in assignment:
        checkpointed |= handle._set(module, mode)
    if checkpointed:
        handle._turn_off_cache(model, announce)
    elif announce and not applied_modes(model):
        _give_back_cache(model)
    return handle


def named_plan(model: nn.Module, mode: Any, blocks: LayerClasses | None) -> CheckpointPlan | None:
    """``mode`` on every instance of ``blocks`` in ``model``, as a plan of their names: a plan that names the
    blocks a user chose (applied, a mode alone checkpoints `find_blocks`' repeated layers). ``None`` where
    no blocks were named, or ``mode`` is ``"none"`` or no mode (a plan, a compiled model's budget)."""
    if blocks is None or mode not in CHECKPOINT_MODES or mode == "none":
        return None
    return CheckpointPlan.uniform([name for name, _ in find_blocks(model, blocks)], mode)


def _assignment(model: nn.Module, plan: Any, blocks: LayerClasses | None) -> list[tuple[nn.Module, Any]]:
    if isinstance(plan, CheckpointPlan):
        plan = plan.modes
    if isinstance(plan, Mapping):
        return [(model.get_submodule(name), checkpointer(mode)) for name, mode in plan.items()]
    if plan == "none" and blocks is None:  # remove every wrapper, wherever it is
        return [(model.get_submodule(name), CHECKPOINTERS["none"]) for name in applied_modes(model)]
    if isinstance(plan, str):
        chosen = checkpointer(plan)
        found = find_blocks(model, blocks)
        if not found and chosen.checkpoints:
            raise ValueError(
                no_blocks_message(model, "apply_checkpointing(model, plan, blocks={MyBlock})", blocks)
            )
        return [(module, chosen) for _, module in found]
    classes = block_classes(plan)
    found = find_blocks(model, classes)
    if not found:
        raise ValueError(no_blocks_message(model, "apply_checkpointing(model, {MyBlock})", classes))
    return [(module, CHECKPOINTERS["full"]) for _, module in found]


# --------------------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BlockPlan:
    """One block's mode and what it buys and costs. Bytes are ints; ``None`` where not measured.

    Attributes:
        name: the block's qualified name in the planned module (``"model.blocks.3"``).
        mode: ``"none"``, ``"selective"``, ``"selective_half"`` or ``"full"`` (a `CheckpointMode`).
        saved_bytes: activation bytes the block no longer keeps from forward to backward, vs ``"none"``.
        recompute_flops: FLOPs of the ops recomputed in backward (``torch.utils.flop_counter``'s formulas:
            matmuls, convolutions and attention kernels; pointwise ops count zero).
        recompute_time: seconds of the recomputed ops, benchmarked op by op on the device
            (``cost="measured"``; on CPU one thread's CPU time).
        note: why the block does not have a mode it was offered (``""``: it has), e.g. selective
            checkpointing refused where the block mutates an output the mode would keep.
    """

    name: str
    mode: str
    saved_bytes: int | None = None
    recompute_flops: int | None = None
    recompute_time: float | None = None
    note: str = ""


@dataclass(frozen=True)
class CheckpointPlan:
    """The chosen mode of every candidate block, with the measured figures behind the choice.

    Attributes:
        blocks: one `BlockPlan` per candidate block, in execution order.
        budget: the whole-step peak the plan was made to fit, in bytes (``None``: no budget).
        peak: the simulated whole-step peak with the plan, in bytes.
        peak_none: the simulated peak without checkpointing.
        peak_full: the simulated peak with every block fully checkpointed (the lowest checkpointing reaches).
        overhead: recompute cost as a fraction of the blocks' forward+backward cost (the rest of the step,
            embeddings, head, loss and optimizer, is not counted, so the share of the whole step is lower).
        cost: what ``overhead`` and the choice were measured in: ``"measured"`` (time) or ``"flops"``.
        compile_budget: a compiled model's plan: the torch.compile ``activation_memory_budget`` it sets
            (``torch._functorch.config``, for the whole process while the plan is applied), or ``None``:
            as configured.
        note: what the plan assumed, where the step's memory hangs on more than shapes (a mixture of
            experts' routing: the planned batch's); ``""``: nothing.
        breakdown: the simulated `MemoryBreakdown` of the step with the plan (not saved by `as_dict`).

    A compiled model's plan (`_checkpointing.compiled`) has no blocks: its step fits as compiled, with
    torch.compile's activation budget as configured or as ``compile_budget`` sets it.
    """

    blocks: tuple[BlockPlan, ...]
    budget: int | None = None
    peak: int | None = None
    peak_none: int | None = None
    peak_full: int | None = None
    overhead: float | None = None
    cost: str | None = None
    compile_budget: float | None = None
    note: str = ""
    breakdown: MemoryBreakdown | None = field(default=None, compare=False, repr=False)

    @property
    def modes(self) -> dict[str, str]:
        """``{block name: mode}``: what `apply_checkpointing` reads."""
        return {b.name: b.mode for b in self.blocks}

    @property
    def saved_bytes(self) -> int | None:
        if any(b.saved_bytes is None for b in self.blocks):
            return None
        return sum(b.saved_bytes for b in self.blocks)  # type: ignore[misc]

    @property
    def recompute_flops(self) -> int | None:
        if any(b.recompute_flops is None for b in self.blocks):
            return None
        return sum(b.recompute_flops for b in self.blocks)  # type: ignore[misc]

    @classmethod
    def uniform(cls, names: Sequence[str], mode: str) -> CheckpointPlan:
        """The same mode for every named block, without figures."""
        checkpointer(mode)
        return cls(blocks=tuple(BlockPlan(name, mode) for name in names))

    def as_dict(self) -> dict[str, Any]:
        """Plain data (for ``state_dict``); `from_dict` reads it back."""
        data = asdict(self)
        data.pop("breakdown")
        data["blocks"] = list(data["blocks"])
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CheckpointPlan:
        blocks = tuple(BlockPlan(**b) for b in data.get("blocks", ()))
        keys = ("budget", "peak", "peak_none", "peak_full", "overhead", "cost", "compile_budget")
        return cls(blocks=blocks, note=data.get("note") or "", **{k: data.get(k) for k in keys})

    def __str__(self) -> str:
        text = self._compiled_str() if not self.blocks and self.peak is not None else self._table()
        return f"{text}\n  ({self.note})" if self.note else text

    def _table(self) -> str:
        counts = Counter(b.mode for b in self.blocks)
        summary = ", ".join(f"{counts[m]} {m}" for m in CHECKPOINT_MODES if counts[m])
        budget = f", budget {format_bytes(self.budget)}" if self.budget is not None else ""
        lines = [f"Activation checkpointing plan: {len(self.blocks)} blocks ({summary}){budget}"]
        width = max([len("block"), *(len(b.name) for b in self.blocks)])
        lines.append(f"  {'block':<{width}}  {'mode':<14}  {'saved':>11}  {'recompute':>11}  {'time':>9}")
        for b in self.blocks:
            saved = format_bytes(b.saved_bytes) if b.saved_bytes is not None else "-"
            flops = _format_flops(b.recompute_flops) if b.recompute_flops is not None else "-"
            seconds = f"{1e3 * b.recompute_time:.1f} ms" if b.recompute_time is not None else "-"
            lines.append(f"  {b.name:<{width}}  {b.mode:<14}  {saved:>11}  {flops:>11}  {seconds:>9}")
            if b.note:
                lines.append(f"  {'':<{width}}  ({b.note})")
        if self.saved_bytes is not None:
            overhead = f"{100 * self.overhead:.1f} %" if self.overhead is not None else "-"
            lines.append(
                f"  saved {format_bytes(self.saved_bytes)} of activations; recompute +{overhead} of the "
                f"blocks' forward+backward ({self.cost})"
            )
        if self.peak is not None:
            extremes = ""
            if self.peak_none is not None and self.peak_full is not None:
                extremes = (
                    f" (no checkpointing: {format_bytes(self.peak_none)}, "
                    f"full: {format_bytes(self.peak_full)})"
                )
            lines.append(f"  step peak {format_bytes(self.peak)}{extremes}")
        return "\n".join(lines)

    def _compiled_str(self) -> str:
        """A compiled model's plan (`_checkpointing.compiled`): no block checkpointed."""
        assert self.peak is not None
        budget = f", budget {format_bytes(self.budget)}" if self.budget is not None else ""
        head = f"Activation checkpointing plan (compiled model{budget}): "
        if self.compile_budget is None:
            return (
                f"{head}nothing to change; the compiled step peaks at {format_bytes(self.peak)} with "
                "torch.compile's activation_memory_budget as configured"
            )
        configured = f" ({format_bytes(self.peak_none)} as configured)" if self.peak_none is not None else ""
        return (
            f"{head}torch.compile's activation_memory_budget = {self.compile_budget:g}, the highest that "
            "fits (its partitioner recomputes in the backward what it no longer saves): the compiled step "
            f"peaks at {format_bytes(self.peak)}{configured}"
        )


def _format_flops(n: int) -> str:
    for unit, scale in (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} FLOP" if n else "0"
