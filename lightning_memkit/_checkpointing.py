"""Activation checkpointing that fits a memory budget at the least recompute cost.

Users pick checkpointed layers by trial and error, or checkpoint every block and pay about a third more
compute. Here every candidate block (the model's repeated layers) gets one of four policies, and the
cheapest assignment whose whole-step peak fits the budget is chosen exactly:

======================  ====================================================================================
``"none"``              the block as written.
``"selective"``         op-level (``create_selective_checkpoint_contexts``): the outputs of matmuls and fused
                        attention kernels are kept; pointwise ops, norms, softmax, dropout are recomputed.
``"selective_half"``    as ``"selective"``, but every second matmul is recomputed too (torchtitan's op-level
                        policy): more memory saved for one matmul of recompute.
``"full"``              only the block's inputs are kept; the whole forward is recomputed in backward.
======================  ====================================================================================

The pieces, in order:

1. Policies: small classes sharing one `apply_checkpointing(model, plan | policy)`, which replaces each
   chosen block's ``forward`` by an instance attribute that runs the class's forward under
   ``torch.utils.checkpoint.checkpoint(use_reentrant=False, preserve_rng_state=True)``. Parameters keep
   their identity and ``state_dict`` keys do not change; a block is never wrapped twice; the returned
   handle undoes everything (``with apply_checkpointing(...):`` for a temporary plan, as a simulation
   needs). The model's state ends as without checkpointing: a recompute updates scratch copies of
   BatchNorm's running statistics, and Hugging Face's key/value cache (``config.use_cache``) is off while
   any block is checkpointed, as ``gradient_checkpointing_enable()`` does in training.
2. Discovery: `find_blocks` takes the repeated layers of the model's ``ModuleList``/``Sequential``
   containers, or the instances of the layer classes the user names.
3. Costs, measured on fake tensors inside one simulated step (`_simulate.estimate_memory`, so nothing
   is allocated and precision/autocast are those of the real step): each distinct block is run forward
   and backward once per policy, and a storage ledger reads

   - ``R``: bytes the block keeps after its forward (what autograd saved, SAC's cache, checkpoint inputs),
   - ``X``: the block's highest footprint during its backward (``R`` + recomputed tensors + gradients),
   - the ops recomputed (the ops of forward+backward under the policy minus those without it), and their
     FLOPs by ``torch.utils.flop_counter``'s formulas;
   - the recompute cost: with ``cost="time"`` (the default) the recomputed ops are benchmarked one by one
     on the device with random data of their shapes; with ``cost="flops"`` they are counted.
4. The peak model, with blocks ``1..n`` in execution order and ``G_i`` the bytes of block ``i``'s
   gradients: the backward of block ``j`` holds the earlier blocks' kept tensors, its own footprint and
   the gradients of the blocks after it; the loss and what follows the last block (a language model's
   logits and their gradient) run while every block's kept tensors are held, so

       A(plan) = max( max_j  sum_{i<j} R_i(p_i) + X_j(p_j) + sum_{i>j} G_i,   sum_i R_i(p_i) + T )
       peak(plan) ~= C + A(plan)

   Checkpointing the last block saves nothing during the blocks' backward (its activations come back at
   once), but it does at the loss. ``C`` (the rest of the step: parameters, optimizer state...) and ``T``
   (what the loss adds) are read from two simulated whole steps, without checkpointing and at the floor,
   the peak with the strongest allowed policy on every block (a budget below the floor is an error): each
   constant is the least that explains both peaks, so the model is exact at the two ends when the peak of
   one lies in the blocks' backward and the other's at the loss.
5. The plan: a knapsack over blocks solved exactly by dynamic programming over the kept bytes so far
   (Pareto-pruned, integer costs), minimising recompute cost under ``peak(plan) <= cap``; ties go to
   fewer kept bytes, then to the lighter policy on the earliest block. The model errs both ways (it misses
   what happens outside the blocks' backward, e.g. Lightning's gradients still live during the forward,
   and the peak at the loss, where checkpointing the last block does save), so the simulated step decides:
   the DP's plans for a rising cap are cheaper and peak higher, and the plan returned is the one at the
   highest cap whose simulated peak fits, found by starting at ``cap = budget``, galloping towards the
   side not yet simulated (cheaper plans while they fit, costlier ones while they miss) and bisecting the
   bracket. With an accurate model that is two or three simulated steps; the floor's plan is the
   fallback. The peaks a plan reports are simulated.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import math
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, get_args
from weakref import ref

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
    noop_context_fn,
)
from torch.utils.flop_counter import flop_registry

from lightning_memkit._breakdown import MemoryBreakdown, format_bytes
from lightning_memkit._budget import Budget, parse_budget
from lightning_memkit._kernels import hashable
from lightning_memkit._measure import allocation_rounding, model_device

__all__ = [
    "CHECKPOINT_MODES",
    "POLICIES",
    "BlockPlan",
    "CheckpointHandle",
    "CheckpointMode",
    "CheckpointPlan",
    "CheckpointPlanner",
    "apply_checkpointing",
    "checkpoint_policies",
    "find_blocks",
    "plan_checkpointing",
]

log = logging.getLogger(__name__)

LayerClasses = type[nn.Module] | Iterable[type[nn.Module]]

# --------------------------------------------------------------------------------------------------
# Policies
# --------------------------------------------------------------------------------------------------

_aten = torch.ops.aten


def _ops(*names: str) -> frozenset:
    """The default overloads of the named aten ops that this build of torch has."""
    found = []
    for name in names:
        packet = getattr(_aten, name, None)
        if packet is not None and hasattr(packet, "default"):
            found.append(packet.default)
    return frozenset(found)


#: Matmul-class ops whose outputs selective checkpointing keeps (``linear`` decomposes into ``addmm``).
#: ``bmm`` is left out on purpose: in eager attention it computes the (T, T) scores, which selective
#: checkpointing exists to drop (the "attention core" of Korthikanti et al.).
MATMUL_OPS = _ops("mm", "addmm", "_scaled_mm", "convolution", "_convolution")
#: Fused attention kernels: their outputs (and log-sum-exp) are small and expensive to recompute.
ATTENTION_OPS = _ops(
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
)


class NoCheckpoint:
    """The block as written."""

    name = "none"
    checkpoints = False

    def context(self) -> Any:
        raise AssertionError("NoCheckpoint runs no checkpoint")


class FullCheckpoint:
    """Keep only the block's inputs; recompute its whole forward in backward."""

    name = "full"
    checkpoints = True

    def context(self) -> Any:
        return noop_context_fn()


class SelectiveCheckpoint:
    """Keep the outputs of matmuls and fused attention; recompute the rest (pointwise, norms, softmax).

    ``save_every=2`` keeps only every second matmul output (the first, third, ...), as torchtitan's
    op-level policy does: the block's output projections are usually the ones recomputed, and the last
    one of a block is never needed in backward at all (non-reentrant checkpointing stops recomputing
    once it has what backward needs).
    """

    checkpoints = True

    def __init__(self, save_every: int = 1) -> None:
        self.save_every = save_every
        self.name = "selective" if save_every == 1 else "selective_half"

    def context(self) -> Any:
        matmuls = itertools.count()  # a fresh count for every forward: the policy sees forward ops only

        def policy_fn(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            if op in ATTENTION_OPS:
                return CheckpointPolicy.MUST_SAVE
            if op in MATMUL_OPS and next(matmuls) % self.save_every == 0:
                return CheckpointPolicy.MUST_SAVE
            return CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(policy_fn)


#: A checkpointing mode by name: what one block (or, given as one string, every block) gets.
CheckpointMode = Literal["none", "selective", "selective_half", "full"]
#: The modes, from the least to the most memory saved.
CHECKPOINT_MODES: tuple[str, ...] = get_args(CheckpointMode)

#: The policies by mode.
POLICIES: dict[str, Any] = {
    "none": NoCheckpoint(),
    "selective": SelectiveCheckpoint(save_every=1),
    "selective_half": SelectiveCheckpoint(save_every=2),
    "full": FullCheckpoint(),
}
assert tuple(POLICIES) == CHECKPOINT_MODES
_RANK = {name: i for i, name in enumerate(POLICIES)}
#: What ``policy=`` lets the planner choose from, per block.
LEVELS: dict[str, tuple[str, ...]] = {
    "auto": CHECKPOINT_MODES,
    "selective": ("none", "selective"),
    "selective_half": ("none", "selective_half"),
    "full": ("none", "full"),
}
#: What every block gets when there is no budget to fit.
_WITHOUT_BUDGET = {
    "auto": "selective",
    "selective": "selective",
    "selective_half": "selective_half",
    "full": "full",
}


def _policy(name: str) -> Any:
    if name not in POLICIES:
        raise ValueError(
            f"Unknown checkpointing policy {name!r}; choose one of {', '.join(map(repr, POLICIES))}"
        )
    return POLICIES[name]


# --------------------------------------------------------------------------------------------------
# Applying: forward patched in place
# --------------------------------------------------------------------------------------------------


class _CheckpointedForward:
    """Set as ``module.forward``: runs the module's own forward under ``checkpoint`` with a policy.

    ``previous`` is the instance-level ``forward`` that was there before (``None`` for the class's), so
    removing the patch restores exactly what was. Under ``torch.no_grad()`` (validation, generation) there
    is nothing to save and the forward runs plainly.
    """

    def __init__(self, module: nn.Module, policy: Any, previous: Callable | None) -> None:
        self.module = module
        self.policy = policy
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
            context_fn=self.policy.context,
            **kwargs,
        )

    def __repr__(self) -> str:
        return f"CheckpointedForward({type(self.module).__name__}, policy={self.policy.name!r})"


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


class CheckpointHandle:
    """What `apply_checkpointing` did, to undo it: ``handle.remove()``, or use it as a context manager."""

    def __init__(self) -> None:
        self._undo: list[tuple[nn.Module, Any]] = []
        #: Hugging Face configs whose ``use_cache`` this handle turned off, with the value it had.
        self._configs: list[tuple[Any, Any]] = []

    def _set(self, module: nn.Module, policy: Any) -> bool:
        """Give ``module`` ``policy``; returns whether it is now checkpointed by this handle."""
        current = module.__dict__.get("forward")
        ours = isinstance(current, _CheckpointedForward)
        if not ours and policy.checkpoints and _checkpointed_elsewhere(module, current):
            warnings.warn(
                f"{type(module).__name__} is already checkpointed by other code (torch's CheckpointWrapper, "
                "a checkpoint partial, Hugging Face's gradient checkpointing); it is left as it is, not "
                "wrapped twice.",
                stacklevel=4,
            )
            return False
        self._undo.append((module, current))
        previous = current.previous if ours else current
        if policy.checkpoints:
            module.__dict__["forward"] = _CheckpointedForward(module, policy, previous)
        elif previous is None:
            module.__dict__.pop("forward", None)
        else:
            module.__dict__["forward"] = previous
        return bool(policy.checkpoints)

    def _turn_off_cache(self, model: nn.Module, announce: bool) -> None:
        """``use_cache = False`` on the Hugging Face configs in ``model`` that have it on; ``announce``
        (`apply_checkpointing`'s own plans, not the planner's) also says so and remembers the value, so
        that ``apply_checkpointing(model, "none")`` can give it back without this handle."""
        configs = _caching_configs(model)
        for config in configs:
            self._configs.append((config, config.use_cache))
            if announce:
                _CACHE_TURNED_OFF[id(config)] = (ref(config), config.use_cache)
            config.use_cache = False
        if configs and announce:
            _announce_cache_off(configs)

    def remove(self) -> None:
        """Put every patched ``forward`` and every ``use_cache`` back as it was, in reverse order."""
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


def _caching_configs(model: nn.Module) -> list[Any]:
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


def _announce_cache_off(configs: Sequence[Any]) -> None:
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
def _without_cache(model: nn.Module) -> Iterator[None]:
    """``use_cache`` off in ``model``'s Hugging Face configs while inside (silently: for simulations)."""
    handle = CheckpointHandle()
    handle._turn_off_cache(model, announce=False)
    with handle:
        yield


def checkpoint_policies(model: nn.Module) -> dict[str, str]:
    """``{qualified name: policy}`` of the submodules `apply_checkpointing` has wrapped in ``model``."""
    return {
        name: m.__dict__["forward"].policy.name
        for name, m in model.named_modules()
        if isinstance(m.__dict__.get("forward"), _CheckpointedForward)
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
            planned on), a ``{module name: policy}`` mapping, one policy name for every block (``"full"``,
            ``"selective"``, ``"selective_half"``; ``"none"`` removes all checkpointing applied here), or a
            set of layer classes to checkpoint fully (the form FSDPStrategy's
            ``activation_checkpointing_policy`` takes).
        blocks: with a policy name, the layer classes whose instances are the blocks (default: `find_blocks`).

    Each block's ``forward`` becomes an instance attribute that calls the class's forward under
    ``torch.utils.checkpoint.checkpoint(use_reentrant=False, preserve_rng_state=True)``, so parameters,
    ``state_dict`` keys and hooks are unchanged and dropout draws the same masks when recomputed. Applying
    again replaces a block's policy instead of wrapping it twice. Example::

        with apply_checkpointing(model, "selective"):  # undone on exit
            loss = model(x).sum(); loss.backward()

    When at least one block gets checkpointed, Hugging Face's key/value cache is turned off for training
    (``use_cache = False`` on every config in ``model`` that has it on, as ``gradient_checkpointing_enable()``
    does; one warning line says so): ``handle.remove()`` or ``apply_checkpointing(model, "none")`` turns it
    back on.
    """
    return _apply(model, plan, blocks, announce=True)


def _apply(
    model: nn.Module, plan: Any, blocks: LayerClasses | None = None, *, announce: bool
) -> CheckpointHandle:
    """`apply_checkpointing`; ``announce=False`` for the planner's temporary plans (nothing logged)."""
    assignment = _assignment(model, plan, blocks)
    handle = CheckpointHandle()
    checkpointed = False
    for module, policy in assignment:
        checkpointed |= handle._set(module, policy)
    if checkpointed:
        handle._turn_off_cache(model, announce)
    elif announce and not checkpoint_policies(model):
        _give_back_cache(model)
    return handle


def _assignment(model: nn.Module, plan: Any, blocks: LayerClasses | None) -> list[tuple[nn.Module, Any]]:
    if isinstance(plan, CheckpointPlan):
        plan = plan.policies
    if isinstance(plan, Mapping):
        return [(model.get_submodule(name), _policy(policy)) for name, policy in plan.items()]
    if plan == "none" and blocks is None:  # remove every wrapper, wherever it is
        return [(model.get_submodule(name), POLICIES["none"]) for name in checkpoint_policies(model)]
    if isinstance(plan, str):
        policy = _policy(plan)
        found = find_blocks(model, blocks)
        if not found and policy.checkpoints:
            raise ValueError(
                _no_blocks_message(model, "apply_checkpointing(model, plan, blocks={MyBlock})", blocks)
            )
        return [(module, policy) for _, module in found]
    classes = _classes(plan)
    found = find_blocks(model, classes)
    if not found:
        raise ValueError(_no_blocks_message(model, "apply_checkpointing(model, {MyBlock})", classes))
    return [(module, POLICIES["full"]) for _, module in found]


def _classes(layer_classes: LayerClasses) -> tuple[type[nn.Module], ...]:
    classes = (layer_classes,) if isinstance(layer_classes, type) else tuple(layer_classes)
    if not classes or not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
        raise TypeError(f"Expected nn.Module subclasses such as {{Block}}, got {layer_classes!r}")
    return classes


# --------------------------------------------------------------------------------------------------
# Discovery
# --------------------------------------------------------------------------------------------------


def find_blocks(model: nn.Module, layer_classes: LayerClasses | None = None) -> list[tuple[str, nn.Module]]:
    """The blocks worth checkpointing, as ``(qualified name, module)`` in registration order.

    With ``layer_classes``, every instance of them (the outermost, where they nest). Otherwise the
    repeated layers: children of ``nn.ModuleList``/``nn.Sequential`` containers grouped by class, the class
    with two or more instances and the most parameters winning (a GPT's ``Block``, torch's
    ``TransformerEncoderLayer``, Hugging Face's ``*DecoderLayer``, a ResNet's ``Bottleneck``). Children
    without submodules (a lone ``Linear``) are not candidates: checkpointing one saves nothing, since its
    input is kept either way.
    """
    if layer_classes is not None:
        classes = _classes(layer_classes)
        found = [(name, m) for name, m in model.named_modules() if isinstance(m, classes)]
        return _outermost(found)
    groups = _repeated(model)
    return _outermost(groups[0]) if groups else []


def _repeated(model: nn.Module) -> list[list[tuple[str, nn.Module]]]:
    """The composite children of ``model``'s ``ModuleList``/``Sequential`` containers, grouped by class,
    for the classes with two or more; the heaviest group (parameters, then instances) first."""
    groups: dict[type, list[tuple[str, nn.Module]]] = {}
    seen: set[int] = set()
    for prefix, container in model.named_modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        for child_name, child in container.named_children():
            if id(child) in seen or next(child.children(), None) is None:
                continue
            seen.add(id(child))
            groups.setdefault(type(child), []).append(
                (f"{prefix}.{child_name}" if prefix else child_name, child)
            )

    def weight(found: list[tuple[str, nn.Module]]) -> tuple[int, int]:
        return sum(p.numel() for _, m in found for p in m.parameters()), len(found)

    return sorted((found for found in groups.values() if len(found) >= 2), key=weight, reverse=True)


def _outermost(found: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    kept: list[tuple[str, nn.Module]] = []
    for name, module in found:
        if not any(name.startswith(outer + ".") for outer, _ in kept):
            kept.append((name, module))
    return kept


def _no_blocks_message(model: nn.Module, option: str, layer_classes: LayerClasses | None = None) -> str:
    """Why there is nothing to checkpoint, and the option to pass (``option`` names ``MyBlock``)."""
    if layer_classes is None:
        return (
            f"Found no repeated blocks to checkpoint in {type(model).__name__}: no nn.ModuleList or "
            "nn.Sequential holds two or more composite layers of the same class. Name the layer classes to "
            f"checkpoint: {option}."
        )
    asked = " or ".join(c.__name__ for c in _classes(layer_classes))
    groups = _repeated(model)
    if not groups:
        return (
            f"No module of type {asked} is in {type(model).__name__}, so there is nothing to checkpoint; "
            "it has no repeated layers either (no nn.ModuleList or nn.Sequential holds two or more "
            f"composite layers of one class). Name a layer class the model has: {option}."
        )
    found = ", ".join(
        f"{type(group[0][1]).__name__} (x{len(group)}, {group[0][0]}, ...)" for group in groups[:4]
    )
    return (
        f"No module of type {asked} is in {type(model).__name__}, so there is nothing to checkpoint. "
        f"Its repeated layers: {found}. Name one of those: "
        f"{option.replace('MyBlock', type(groups[0][0][1]).__name__)}."
    )


# --------------------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BlockPlan:
    """One block's policy and what it buys and costs. Bytes are ints; ``None`` where not measured.

    Attributes:
        name: the block's qualified name in the planned module (``"model.blocks.3"``).
        policy: ``"none"``, ``"selective"``, ``"selective_half"`` or ``"full"``.
        saved_bytes: activation bytes the block no longer keeps from forward to backward, vs ``"none"``.
        recompute_flops: FLOPs of the ops recomputed in backward (``torch.utils.flop_counter``'s formulas:
            matmuls, convolutions and attention kernels; pointwise ops count zero).
        recompute_time: seconds of the recomputed ops, benchmarked op by op on the device
            (``cost="time"``; on CPU one thread's CPU time).
    """

    name: str
    policy: str
    saved_bytes: int | None = None
    recompute_flops: int | None = None
    recompute_time: float | None = None


@dataclass(frozen=True)
class CheckpointPlan:
    """The chosen policy of every candidate block, with the measured figures behind the choice.

    Attributes:
        blocks: one `BlockPlan` per candidate block, in execution order.
        budget: the whole-step peak the plan was made to fit, in bytes (``None``: no budget).
        peak: the simulated whole-step peak with the plan, in bytes.
        peak_none: the simulated peak without checkpointing.
        peak_full: the simulated peak with every block fully checkpointed (the lowest checkpointing reaches).
        overhead: recompute cost as a fraction of the blocks' forward+backward cost (the rest of the step,
            embeddings, head, loss and optimizer, is not counted, so the share of the whole step is lower).
        cost: what ``overhead`` and the choice were measured in: ``"time"`` or ``"flops"``.
        breakdown: the simulated `MemoryBreakdown` of the step with the plan (not saved by `as_dict`).
    """

    blocks: tuple[BlockPlan, ...]
    budget: int | None = None
    peak: int | None = None
    peak_none: int | None = None
    peak_full: int | None = None
    overhead: float | None = None
    cost: str | None = None
    breakdown: MemoryBreakdown | None = field(default=None, compare=False, repr=False)

    @property
    def policies(self) -> dict[str, str]:
        """``{block name: policy}``: what `apply_checkpointing` reads."""
        return {b.name: b.policy for b in self.blocks}

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
    def uniform(cls, names: Sequence[str], policy: str) -> CheckpointPlan:
        """The same policy for every named block, without figures."""
        _policy(policy)
        return cls(blocks=tuple(BlockPlan(name, policy) for name in names))

    def as_dict(self) -> dict[str, Any]:
        """Plain data (for ``state_dict``); `from_dict` reads it back."""
        data = asdict(self)
        data.pop("breakdown")
        data["blocks"] = list(data["blocks"])
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CheckpointPlan:
        blocks = tuple(BlockPlan(**b) for b in data.get("blocks", ()))
        keys = ("budget", "peak", "peak_none", "peak_full", "overhead", "cost")
        return cls(blocks=blocks, **{k: data.get(k) for k in keys})

    def __str__(self) -> str:
        counts = Counter(b.policy for b in self.blocks)
        summary = ", ".join(f"{counts[p]} {p}" for p in POLICIES if counts[p])
        budget = f", budget {format_bytes(self.budget)}" if self.budget is not None else ""
        lines = [f"Activation checkpointing plan: {len(self.blocks)} blocks ({summary}){budget}"]
        width = max([len("block"), *(len(b.name) for b in self.blocks)])
        lines.append(f"  {'block':<{width}}  {'policy':<14}  {'saved':>11}  {'recompute':>11}  {'time':>9}")
        for b in self.blocks:
            saved = format_bytes(b.saved_bytes) if b.saved_bytes is not None else "-"
            flops = _format_flops(b.recompute_flops) if b.recompute_flops is not None else "-"
            seconds = f"{1e3 * b.recompute_time:.1f} ms" if b.recompute_time is not None else "-"
            lines.append(f"  {b.name:<{width}}  {b.policy:<14}  {saved:>11}  {flops:>11}  {seconds:>9}")
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


def _format_flops(n: int) -> str:
    for unit, scale in (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} FLOP" if n else "0"


# --------------------------------------------------------------------------------------------------
# Costs: a ledger of storages and ops, on fake (or real) tensors
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _TensorSpec:
    """What an op needs to know about a tensor argument to be re-run on random data (a pytree leaf)."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    def materialize(self, device: torch.device) -> Tensor:
        t = torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=device)
        if t.is_floating_point() or t.is_complex():
            return t.normal_()
        return t.zero_()  # indices, masks and counts: zeros are valid everywhere


def _spec(x: Any) -> Any:
    """A hashable stand-in for an op's or a block's argument: what identifies the op run or the block."""
    if isinstance(x, Tensor):
        return _TensorSpec(tuple(x.shape), tuple(x.stride()), x.dtype)
    if x is None or isinstance(
        x, (bool, int, float, str, torch.dtype, torch.device, torch.layout, torch.memory_format)
    ):
        return x
    return type(x).__name__  # a generator, a cache object: its type is what we can compare


def _flops(func: Any, args: tuple, kwargs: dict, out: Any) -> int:
    formula = flop_registry.get(getattr(func, "overloadpacket", None))
    if formula is None:
        return 0
    return int(formula(*args, **kwargs, out_val=out))


def _numel(out: Any) -> int:
    return sum(t.numel() for t in tree_leaves(out) if isinstance(t, Tensor))


@dataclass(frozen=True)
class _Op:
    """One op run, as the cost model needs it: ``key`` identifies the op and its argument shapes."""

    key: tuple
    flops: int
    numel: int  # elements written (the ``cost="flops"`` stand-in for ops without a FLOP formula)
    view: bool


class _Ledger(TorchDispatchMode):
    """Storages born while active (live bytes and their highest point) and every op run."""

    def __init__(self, rounding: int) -> None:
        super().__init__()
        self.rounding = rounding
        self.live: dict[int, list] = {}  # id(storage) -> [weakref, nbytes]
        self.current = 0
        self.peak = 0
        self.ops: list[_Op] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        key = (func, hashable(tree_map(_spec, args)), hashable(tree_map(_spec, kwargs)))
        self.ops.append(_Op(key, _flops(func, args, kwargs, out), _numel(out), func.is_view))
        for t in tree_leaves(out):
            if isinstance(t, Tensor):
                self._born(t)
        self.peak = max(self.peak, self.current)
        return out

    def _born(self, t: Tensor) -> None:
        storage = t.untyped_storage()
        key = id(storage)
        if key in self.live:
            return
        nbytes = -(-storage.nbytes() // self.rounding) * self.rounding
        self.live[key] = [ref(storage, lambda _, key=key: self._free(key)), nbytes]
        self.current += nbytes

    def _free(self, key: int) -> None:
        entry = self.live.pop(key, None)
        if entry is not None:
            self.current -= entry[1]

    def exclude(self, t: Tensor) -> None:
        """Stop counting ``t``'s storage (the block's output and its incoming gradient)."""
        entry = self.live.get(id(t.untyped_storage()))
        if entry is not None:
            self.current -= entry[1]
            entry[1] = 0


@dataclass
class _Run:
    """One block under one policy: kept bytes, backward footprint, and the ops of forward+backward."""

    retained: int
    footprint: int
    ops: list[_Op]


def _detached(x: Any) -> Any:
    if not isinstance(x, Tensor):
        return x
    y = x.detach()
    return y.requires_grad_() if x.requires_grad else y


def _without_kv_cache(x: Any) -> Any:
    """``None`` for a Hugging Face ``Cache`` (``DynamicCache``, ``EncoderDecoderCache``...), else ``x``."""
    if isinstance(x, (Tensor, type(None), bool, int, float, str)):
        return x
    is_cache = any(c.__name__ == "Cache" and c.__module__.startswith("transformers") for c in type(x).__mro__)
    return None if is_cache else x


def _run_block(block: nn.Module, policy: Any, args: tuple, kwargs: dict, rounding: int) -> _Run:
    """Forward and backward of ``block`` alone on (detached) ``args``, under ``policy``, in a ledger."""
    params = [p for p in block.parameters() if p.requires_grad]
    grads = [p.grad for p in params]
    for p in params:
        p.grad = None
    previous = block.__dict__.get("forward")
    if isinstance(previous, _CheckpointedForward):
        previous = previous.previous
    call = _CheckpointedForward(block, policy, previous)
    forward = call if policy.checkpoints else call.original()
    # Hugging Face's key/value cache is shared by the whole step and filled as it goes: running the block
    # again with it would extend it (and backpropagate through the step's graph). The planner profiles with
    # the cache off; should a caller pass one all the same, the block runs as without it.
    args, kwargs = tree_map(_without_kv_cache, args), tree_map(_without_kv_cache, kwargs)
    args, kwargs = tree_map(_detached, args), tree_map(_detached, kwargs)
    ledger = _Ledger(rounding)
    try:
        with ledger:
            out = forward(*args, **kwargs)
            outs = [t for t in tree_leaves(out) if isinstance(t, Tensor)]
            for t in outs:
                ledger.exclude(t)
            retained = ledger.current
            ledger.peak = ledger.current
            roots = [t for t in outs if t.requires_grad]
            seeds = [torch.ones_like(t) for t in roots]
            for s in seeds:
                ledger.exclude(s)
            if roots:
                torch.autograd.backward(roots, seeds)
            footprint = ledger.peak
            del out, outs, roots, seeds
    finally:
        for p, g in zip(params, grads, strict=True):
            p.grad = g
    return _Run(retained, footprint, ledger.ops)


@dataclass(frozen=True)
class _Option:
    """A block under one policy, as the DP sees it. ``cost`` is an integer (ns or FLOP units)."""

    retained: int
    footprint: int
    cost: int
    flops: int = 0
    seconds: float | None = None


@dataclass(frozen=True)
class _Block:
    """A DP item: the block's options by policy name (in `POLICIES` order) and its gradients' bytes."""

    name: str
    options: dict[str, _Option]
    grads: int


class _OpTimer:
    """Seconds per op, benchmarked on ``device`` with random data of the recorded shapes.

    Op by op rather than whole blocks: an op is short, so the best of a few runs is stable even on a shared
    machine, where a block's forward+backward varies by more than what recomputation costs; and no policy
    can come out free by chance. On CPU an op runs on one thread and is read by that thread's CPU clock
    (the best of five runs); on CUDA ten runs go between two synchronizations. In place, recomputation
    costs somewhat more than the sum of its ops (cold caches, allocations): the figures rank the policies
    and report their order of magnitude; the benchmark measures real steps.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seconds: dict[tuple, float] = {}
        self.failed: set[Any] = set()

    def __call__(self, op: _Op) -> float:
        if op.view:
            return 0.0
        if op.key not in self.seconds:
            self.seconds[op.key] = self._time(op.key)
        return self.seconds[op.key]

    def _time(self, key: tuple) -> float:
        func, args, kwargs = key

        def make(x: Any) -> Any:
            if isinstance(x, _TensorSpec):
                return x.materialize(self.device)
            return self.device if isinstance(x, torch.device) else x

        cuda = self.device.type == "cuda"
        threads = torch.get_num_threads()
        with torch.random.fork_rng(devices=[self.device] if cuda else []), torch.no_grad():
            try:
                if not cuda:
                    torch.set_num_threads(1)
                a, kw = tree_map(make, list(args)), tree_map(make, dict(kwargs))
                func(*a, **kw)  # warm-up, and a check that random data is acceptable
                if cuda:
                    torch.cuda.synchronize(self.device)
                    start = time.perf_counter()
                    for _ in range(10):
                        func(*a, **kw)
                    torch.cuda.synchronize(self.device)
                    return (time.perf_counter() - start) / 10
                best = math.inf
                for _ in range(5):
                    start = time.thread_time()
                    func(*a, **kw)
                    best = min(best, time.thread_time() - start)
                return best
            except (RuntimeError, ValueError, TypeError, IndexError) as e:
                # An op that needs particular values (valid offsets, sorted indices), or an argument that
                # cannot be recreated: left out of the cost, and named in the log.
                log.debug("Could not time %s on random data: %s", func, e)
                self.failed.add(func)
                return 0.0
            finally:
                torch.set_num_threads(threads)


def _options(runs: dict[str, _Run], cost: str, timer: _OpTimer | None) -> tuple[dict[str, _Option], int]:
    """Per policy, the DP's option; and the block's forward+backward cost without checkpointing.

    The recomputed ops are those run under the policy beyond the ones run without it. ``cost="time"``:
    their benchmarked time, in integer nanoseconds (the DP's sums stay exact). ``cost="flops"``: their FLOP
    formula, or the elements they write where there is none.
    """

    def op_cost(op: _Op) -> int:
        if timer is not None:
            return round(1e9 * timer(op))
        return op.flops if op.flops else (0 if op.view else op.numel)

    base = runs["none"]
    base_keys = Counter(op.key for op in base.ops)
    options = {}
    for name, run in runs.items():
        recomputed = Counter(op.key for op in run.ops) - base_keys  # the positive part: ops run again
        by_key = {op.key: op for op in run.ops}
        ops = [by_key[k] for k, n in recomputed.items() for _ in range(n)]
        spent = sum(op_cost(op) for op in ops)
        options[name] = _Option(
            retained=run.retained,
            footprint=run.footprint,
            cost=spent,
            flops=sum(op.flops for op in ops),
            seconds=spent / 1e9 if timer is not None else None,
        )
    return options, sum(op_cost(op) for op in base.ops)


# --------------------------------------------------------------------------------------------------
# The peak model and the DP
# --------------------------------------------------------------------------------------------------


def _activation_peak(blocks: Sequence[_Block], choice: Sequence[str], tail: int = 0) -> int:
    """``A(plan) = max(max_j sum_{i<j} R_i + X_j + sum_{i>j} G_i, sum_i R_i + tail)`` (module docstring)."""
    return max(_backward_peak(blocks, choice), _kept(blocks, choice) + tail)


def _backward_peak(blocks: Sequence[_Block], choice: Sequence[str]) -> int:
    """The first term of ``A(plan)``: the highest point of the blocks' backward."""
    grads_after = _suffix_grads(blocks)
    kept, worst = 0, 0
    for j, (block, name) in enumerate(zip(blocks, choice, strict=True)):
        option = block.options[name]
        worst = max(worst, kept + option.footprint + grads_after[j])
        kept += option.retained
    return worst


def _kept(blocks: Sequence[_Block], choice: Sequence[str]) -> int:
    """``sum_i R_i``: what every block keeps for its backward, all held when the loss runs."""
    return sum(block.options[name].retained for block, name in zip(blocks, choice, strict=True))


def _suffix_grads(blocks: Sequence[_Block]) -> list[int]:
    after, total = [], 0
    for block in reversed(blocks):
        after.append(total)
        total += block.grads
    return after[::-1]


def _solve(
    blocks: Sequence[_Block], cap: float, levels: Sequence[str], tail: int = 0
) -> tuple[str, ...] | None:
    """The cheapest choice of policies with ``A(plan) <= cap`` (``tail`` as `_activation_peak` takes it),
    exactly; ``None`` if there is none.

    Dynamic programming over the blocks in execution order; the state is the bytes kept by the blocks so
    far (all the future depends on), and a state is dropped when another keeps no more bytes at no more
    cost. Ties: fewer kept bytes, then the lighter policy on the earliest block.
    """
    grads_after = _suffix_grads(blocks)
    # kept bytes -> (cost, policy ranks, policy names)
    states: dict[int, tuple[int, tuple[int, ...], tuple[str, ...]]] = {0: (0, (), ())}
    for j, block in enumerate(blocks):
        new: dict[int, tuple[int, tuple[int, ...], tuple[str, ...]]] = {}
        for kept, (cost, ranks, names) in states.items():
            for name in levels:
                option = block.options[name]
                if kept + option.footprint + grads_after[j] > cap:
                    continue
                state = (cost + option.cost, (*ranks, _RANK[name]), (*names, name))
                key = kept + option.retained
                if key not in new or state[:2] < new[key][:2]:
                    new[key] = state
        states = {}
        best_cost = math.inf
        for kept in sorted(new):  # Pareto front: more kept bytes must buy a lower cost
            if new[kept][0] < best_cost:
                states[kept] = new[kept]
                best_cost = new[kept][0]
        if not states:
            return None
    feasible = [
        (cost, kept, ranks, names) for kept, (cost, ranks, names) in states.items() if kept + tail <= cap
    ]
    return min(feasible)[3] if feasible else None


# --------------------------------------------------------------------------------------------------
# Planning
# --------------------------------------------------------------------------------------------------


class _Profiler:
    """Forward pre-hooks that profile every distinct block the first time it runs in a simulated step."""

    def __init__(self, blocks: list[tuple[str, nn.Module]], levels: Sequence[str], rounding: int) -> None:
        self.blocks = blocks
        self.levels = levels
        self.rounding = rounding
        self.order: list[str] = []  # block names in execution order
        self.signature: dict[str, tuple] = {}
        self.runs: dict[tuple, dict[str, _Run]] = {}
        self.grads: dict[str, int] = {}
        self._busy = False

    @contextlib.contextmanager
    def hooks(self) -> Iterator[None]:
        handles = [
            module.register_forward_pre_hook(functools.partial(self._hook, name), with_kwargs=True)
            for name, module in self.blocks
        ]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def _hook(self, name: str, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._busy or name in self.signature:
            return
        self.order.append(name)
        params = tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in module.named_parameters())
        inputs = hashable(tree_map(_spec, (args, kwargs)))
        signature = (type(module), params, inputs, module.training)
        self.signature[name] = signature
        self.grads[name] = sum(
            -(-p.untyped_storage().nbytes() // self.rounding) * self.rounding
            for p in module.parameters()
            if p.requires_grad
        )
        if signature in self.runs:
            return
        self._busy = True
        try:
            self.runs[signature] = {
                level: _run_block(module, POLICIES[level], args, kwargs, self.rounding)
                for level in self.levels
            }
        finally:
            self._busy = False


def plan_checkpointing(
    model: nn.Module,
    batch: Any,
    budget: int | float | str | Budget | None = None,
    *,
    policy: str = "auto",
    blocks: LayerClasses | None = None,
    cost: str = "time",
    device: str | torch.device | None = None,
    **estimate_kwargs: Any,
) -> CheckpointPlan:
    """The cheapest checkpointing plan whose simulated whole-step peak fits ``budget``.

    Args:
        model: a ``LightningModule`` or an ``nn.Module``, as `estimate_memory` takes it (a plain module needs
            ``optimizer=`` and ``loss_fn=``). It is left unchanged: nothing stays applied, and the model
            only runs in `estimate_memory`'s simulated steps, on fake tensors.
        batch: one training batch (only shapes and dtypes are read).
        budget: the whole step's peak to fit, as `parse_budget` reads it: bytes, a size (``"6GiB"``,
            ``"24GB"``), a GPU name (``"A100-40GB"``, ``"H200"``: the card's memory less the CUDA context
            and a 5 % reserve), or a fraction of the current CUDA device (``0.9``) or ``"auto"`` (these
            two need one). ``None``: no search; every block gets ``"selective"`` (``policy="auto"``) or the
            named policy, with its figures.
        policy: the policies each block may get: ``"auto"`` (all four), ``"selective"`` /
            ``"selective_half"`` / ``"full"`` (that one or none).
        blocks: layer classes whose instances are the candidates (default: `find_blocks`).
        cost: what the DP minimises for the recomputed ops: ``"time"`` (benchmarked op by op on the
            device; ``"flops"`` when that device is not present) or ``"flops"`` (FLOP formulas for matmuls
            and attention, elements written for other ops).
        device: the device type the run will use, ``"cuda"`` or ``"cpu"`` (default: the model's; ``"cuda"``
            for a model on the meta device).
        estimate_kwargs: passed to `estimate_memory`: ``optimizer``, ``loss_fn``, ``precision``,
            ``accumulating``.

    Returns:
        A `CheckpointPlan`; ``print(plan)`` shows it as a table. Apply it with `apply_checkpointing`.

    Raises:
        ValueError: no candidate blocks; or a budget below the peak of full checkpointing (the message
            gives that floor and what else would lower it).
    """
    limit = None if budget is None else parse_budget(budget)  # a bad budget fails before any simulation
    planner = CheckpointPlanner(
        model, batch, policy=policy, blocks=blocks, cost=cost, device=device, **estimate_kwargs
    )
    return planner.plan(limit)


class CheckpointPlanner:
    """Plans for one model and batch, sharing the profile and the simulated steps between budgets.

    ``CheckpointPlanner(model, batch, ...).plan(budget)`` is `plan_checkpointing`; keep the planner to ask
    for several budgets (a memory/time curve) at a few simulated steps per new plan. Arguments as there,
    plus ``max_rounds``: how many new plans one budget may simulate; the search then keeps the cheapest plan
    that fitted (the floor's plan if none did).
    """

    def __init__(
        self,
        model: nn.Module,
        batch: Any,
        *,
        policy: str = "auto",
        blocks: LayerClasses | None = None,
        cost: str = "time",
        device: str | torch.device | None = None,
        max_rounds: int = 8,
        **estimate_kwargs: Any,
    ) -> None:
        if policy not in LEVELS:
            raise ValueError(f"Unknown policy {policy!r}; choose one of {', '.join(map(repr, LEVELS))}")
        if cost not in ("time", "flops"):
            raise ValueError(f"Unknown cost {cost!r}; choose 'time' or 'flops'")
        target = torch.device(torch.device(device).type if device is not None else model_device(model).type)
        if cost == "time" and target.type == "cuda" and not torch.cuda.is_available():
            log.info("No CUDA device to time the recomputed ops on: cost='flops' instead.")
            cost = "flops"
        found = find_blocks(model, blocks)
        if not found:
            raise ValueError(_no_blocks_message(model, "plan_checkpointing(..., blocks={MyBlock})", blocks))
        self.model, self.batch, self.policy, self.cost = model, batch, policy, cost
        self.max_rounds = max_rounds
        self.levels = LEVELS[policy]
        self.estimate_kwargs = {**estimate_kwargs, "device": target.type}
        self._simulated: dict[tuple[str, ...], MemoryBreakdown] = {}

        # Profile every distinct block inside one simulated step (the step's own result is not used), with
        # Hugging Face's key/value cache off: every plan that checkpoints a block runs so (apply_checkpointing
        # turns it off), and the block options are only read for such plans.
        profiler = _Profiler(found, self.levels, rounding=allocation_rounding(target))
        with self._bare(), _without_cache(model), profiler.hooks(), torch.random.fork_rng(devices=[]):
            self._estimate()
        if not profiler.order:
            raise ValueError(f"None of the {len(found)} candidate blocks ran in the training step.")
        timer = _OpTimer(target) if cost == "time" else None
        options = {sig: _options(runs, cost, timer) for sig, runs in profiler.runs.items()}
        if timer is not None and timer.failed:
            log.info("Not timed (counted as free): %s", ", ".join(sorted(map(str, timer.failed))))
        self.blocks = [
            _Block(name, options[profiler.signature[name]][0], profiler.grads[name])
            for name in profiler.order
        ]
        self.names = [b.name for b in self.blocks]
        #: The blocks' forward+backward cost without checkpointing, in the DP's units.
        self.baseline = sum(options[profiler.signature[name]][1] for name in profiler.order)

    def _estimate(self) -> MemoryBreakdown:
        from lightning_memkit._simulate import estimate_memory

        return estimate_memory(self.model, self.batch, **self.estimate_kwargs)

    def _bare(self) -> CheckpointHandle:
        """Remove any checkpointing `apply_checkpointing` left on the model, while planning."""
        return _apply(self.model, {name: "none" for name in checkpoint_policies(self.model)}, announce=False)

    def simulate(self, choice: Sequence[str]) -> MemoryBreakdown:
        """The simulated step's breakdown with ``choice`` (one policy per block, in `names` order).

        As the plan will run: a choice that checkpoints a block runs with Hugging Face's key/value cache off
        (`apply_checkpointing` turns it off), one that checkpoints nothing with the model's own setting.
        """
        choice = tuple(choice)
        if choice not in self._simulated:
            plan = dict(zip(self.names, choice, strict=True))
            with self._bare(), _apply(self.model, plan, announce=False):
                self._simulated[choice] = self._estimate()
        return self._simulated[choice]

    def _peak_none_without_cache(self, peak_none: int) -> int:
        """The peak without checkpointing as the plans that checkpoint see the rest of the step: with
        Hugging Face's key/value cache off (``peak_none`` itself where the model has none on)."""
        if not _caching_configs(self.model):
            return peak_none
        key = ("none, without cache",)
        if key not in self._simulated:
            with self._bare(), _without_cache(self.model):
                self._simulated[key] = self._estimate()
        return self._simulated[key].peak

    def uniform(self, policy: str) -> tuple[str, ...]:
        return (policy,) * len(self.blocks)

    def plan(self, budget: int | float | str | Budget | None = None) -> CheckpointPlan:
        """The cheapest plan whose simulated peak fits ``budget`` (see `plan_checkpointing`)."""
        limit = None if budget is None else parse_budget(budget).usable
        peak_none = self.simulate(self.uniform("none")).peak
        if limit is None:
            choice = self.uniform(_WITHOUT_BUDGET[self.policy])
        else:
            floor = self.simulate(self.uniform(self.levels[-1]))
            if limit < floor.peak:
                raise ValueError(_floor_message(limit, floor, self.levels[-1], len(self.blocks), peak_none))
            choice = self._fit(limit, peak_none)
        breakdown = self.simulate(choice)
        full = self._simulated.get(self.uniform("full"))
        spent = sum(b.options[c].cost for b, c in zip(self.blocks, choice, strict=True))
        return CheckpointPlan(
            blocks=tuple(
                BlockPlan(
                    name=b.name,
                    policy=c,
                    saved_bytes=b.options["none"].retained - b.options[c].retained,
                    recompute_flops=b.options[c].flops,
                    recompute_time=b.options[c].seconds,
                )
                for b, c in zip(self.blocks, choice, strict=True)
            ),
            budget=limit,
            peak=breakdown.peak,
            peak_none=peak_none,
            peak_full=full.peak if full is not None else None,
            overhead=spent / self.baseline if self.baseline else 0.0,
            cost=self.cost,
            breakdown=breakdown,
        )

    def _calibrate(self, peak_none: int, peak_floor: int) -> tuple[int, int]:
        """``C`` and ``T`` of the peak model (module docstring, 4.), as ``(C, T - C)``: the offset and the
        ``tail`` that `_activation_peak` and `_solve` take.

        ``peak_none`` is the step without checkpointing as the plans that checkpoint see the rest of the
        step (Hugging Face's cache off), ``peak_floor`` the floor's. Each of the two terms of the model is
        at most the simulated peak, at both ends; each constant is the largest that keeps it so.
        """
        none, floor = self.uniform("none"), self.uniform(self.levels[-1])
        backward = min(
            peak_none - _backward_peak(self.blocks, none), peak_floor - _backward_peak(self.blocks, floor)
        )
        at_loss = min(peak_none - _kept(self.blocks, none), peak_floor - _kept(self.blocks, floor))
        return backward, at_loss - backward

    def _fit(self, limit: int, peak_none: int) -> tuple[str, ...]:
        """The DP's plan at the highest cap whose simulated peak fits ``limit``.

        ``plan_at(cap)``, the cheapest plan whose modeled peak is at most ``cap``, gets cheaper as the cap
        rises, and its simulated peak higher. The search starts at ``cap = limit`` (where an accurate model
        puts the answer), gallops away from it, doubling the step, until a cap whose plan fits lies below
        one whose plan misses, and bisects between them. A plan is simulated only when it differs from the
        plans at both ends of the bracket, and at most `max_rounds` new plans are; the caps searched run
        from the floor's modeled peak up, so the floor's plan (simulated: it fits) is the fallback.
        """
        floor = self.uniform(self.levels[-1])
        offset, tail = self._calibrate(self._peak_none_without_cache(peak_none), self.simulate(floor).peak)
        solved: dict[float, tuple[str, ...]] = {}

        def plan_at(cap: float) -> tuple[str, ...]:
            if cap not in solved:
                choice = _solve(self.blocks, cap - offset, self.levels, tail)
                assert choice is not None, "no cap below the floor's modeled peak is searched"
                solved[cap] = choice
            return solved[cap]

        new = 0

        def fits(choice: tuple[str, ...]) -> bool:
            nonlocal new
            new += choice not in self._simulated
            return self.simulate(choice).peak <= limit

        bottom = offset + _activation_peak(
            self.blocks, floor, tail
        )  # the floor's plan qualifies from here up
        cheapest = plan_at(math.inf)
        top = offset + _activation_peak(self.blocks, cheapest, tail)
        if fits(cheapest):
            return cheapest
        cap, step = max(bottom, min(limit, top - 1)), 1
        lo: int | None = None  # a cap whose plan fits
        hi = top  # a cap whose plan misses
        if fits(plan_at(cap)):
            lo = cap
            while hi - lo > 1 and new < self.max_rounds:  # cheaper plans, while they fit
                cap, step = min(lo + step, hi - 1), 2 * step
                if plan_at(cap) == plan_at(lo) or fits(plan_at(cap)):
                    lo = cap
                else:
                    hi = cap
                    break
        else:
            hi = cap
            while hi > bottom and new < self.max_rounds:  # costlier plans, until one fits
                cap, step = max(hi - step, bottom), 2 * step
                if plan_at(cap) != plan_at(hi) and fits(plan_at(cap)):
                    lo = cap
                    break
                hi = cap
            if lo is None:
                return floor
        while hi - lo > 1 and new < self.max_rounds:
            mid = (lo + hi) // 2
            choice = plan_at(mid)
            if choice == plan_at(lo) or (choice != plan_at(hi) and fits(choice)):
                lo = mid
            else:
                hi = mid
        log.debug("plan %s fits %d (%d plans simulated)", plan_at(lo), limit, len(self._simulated))
        return plan_at(lo)


def _floor_message(limit: int, floor: MemoryBreakdown, policy: str, n: int, peak_none: int) -> str:
    full = floor
    hint = "" if policy == "full" else " or allow full checkpointing (policy='auto'),"
    return (
        f"The budget of {format_bytes(limit)} ({limit:,} bytes) is below what activation checkpointing can "
        f"reach: {policy} checkpointing of all {n} blocks peaks at {format_bytes(floor.peak)} "
        f"({floor.peak:,} bytes; {format_bytes(peak_none)} without checkpointing). At that peak: parameters "
        f"{format_bytes(full.parameters)}, gradients {format_bytes(full.gradients)}, optimizer state "
        f"{format_bytes(full.optimizer_state)}, activations {format_bytes(full.activations)}, temporary "
        f"{format_bytes(full.temporary)}. To go lower, shrink what checkpointing cannot: a smaller "
        "micro-batch (with gradient accumulation to keep the effective batch), a lighter optimizer "
        f"(8-bit AdamW, Adafactor, SGD), or lower precision (bf16-true);{hint} or raise the budget."
    )
