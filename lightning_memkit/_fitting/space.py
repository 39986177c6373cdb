"""What `plan_fit` may choose among, checked once: the micro-batches, checkpointing modes and (optimizer,
precision) pairs of one model, batch and budget.

`SearchSpace.of` reads `plan_fit`'s arguments and refuses a bad one before any simulation, with the fix in
the message, as Lightning's tuner checks its options before it scales; the simulations
(`_fitting.simulations`) and the driver (`_fitting.search`) read the space and check nothing again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor, nn

from lightning_memkit._budget import Budget, flag, parse_budget, valid_name, whole_number
from lightning_memkit._checkpointing.blocks import LayerClasses, block_classes, find_blocks, no_blocks_message
from lightning_memkit._checkpointing.compiled import COMPILE_BUDGET, configured_budget
from lightning_memkit._estimating.analytic import STRATEGIES
from lightning_memkit._estimating.compiled import compiled_modules
from lightning_memkit._estimating.lightning_step import (
    SampleAxes,
    batch_size,
    batch_slice,
    default_axes,
    is_lightning,
    without_parameters,
)
from lightning_memkit._estimating.precision import sixteen_bit_weights
from lightning_memkit._fitting.plan import StepCost
from lightning_memkit._optimizers.swap import (
    CATALOGUE,
    COMPENSATED,
    KAHAN,
    lighter_candidates,
    load_bitsandbytes,
)
from lightning_memkit._sharding import fsdp2 as _fsdp2
from lightning_memkit._step import Lever, Sharding, valid_lever
from lightning_memkit._vocabulary import allowed_modes

Pair = tuple[str | None, str]
"""An optimizer (catalogue name; ``None``: the model's own) and a Lightning precision string."""


@dataclasses.dataclass(frozen=True)
class SearchSpace:
    """`plan_fit`'s arguments, checked (`of`), and what follows from them before any simulation."""

    model: nn.Module
    #: the example batch at the global batch size (all ranks)
    batch: Any
    #: one data-parallel rank's share of ``batch``: the batch the micro-batches are cut from
    per_rank: Any
    #: each tensor's sample dimension (`SampleAxes`)
    axes: SampleAxes
    #: the global batch size
    total: int
    #: the micro-batches planned, ascending: the divisors of a rank's batch (the fused step: all of it)
    sizes: tuple[int, ...]
    budget: Budget
    margin: float
    #: the bytes a rank's step may peak at: ``budget.usable * (1 - margin)``
    limit: int
    #: the precisions allowed, in order of preference
    precisions: tuple[str, ...]
    #: the checkpointing modes a block may get (`_checkpointable`), weakest first
    modes: tuple[str, ...]
    strategy: str
    world_size: int
    #: the ranks the global batch splits over (`_data_parallel_ranks`)
    ranks: int
    lever: Lever | None
    #: the optimizers asked for, in quality order, less those not planned under FSDP2 (`_candidates`)
    optimizers: tuple[str | None, ...]
    #: the (optimizer, precision) pairs to plan, best first (`_pairs`)
    pairs: tuple[Pair, ...]
    compensate: bool
    #: `FitPlan.note`'s parts known before any simulation: modes and optimizers not planned
    notes: tuple[str, ...]
    device: str
    loss_fn: Callable[[Any, Any], Tensor] | None
    cost: str | StepCost
    progress: Callable[[str], None] | None
    refine_limit: int | None
    #: FSDP2's CPUOffloadPolicy: asked for, not, or (``None``) where nothing fits without it
    cpu_offload: bool | None
    link: _fsdp2.Link | None
    mp_policy: bool
    #: the run's FSDP2 layout (``None``: FSDP2's default, or not FSDP2)
    sharding: Sharding | None
    #: the classes whose instances are the blocks (``None``: `find_blocks`')
    blocks: LayerClasses | None
    micro_batch_size: int | None

    @classmethod
    def of(
        cls, model, batch, budget, *, margin, optimizers, precision, checkpointing, strategy, world_size,
        device, loss_fn, cost, progress, lever, compensate, refine_limit, cpu_offload, link, mp_policy,
        batch_axes, micro_batch_size, sharding, blocks,
    ) -> SearchSpace:  # fmt: skip
        """The space `plan_fit` searches with these arguments (its own), each checked in the order the
        errors are documented; raises the first error found."""
        _check_model(model)
        budget = parse_budget(budget)
        if not 0.0 <= margin < 1.0:
            raise ValueError(f"margin must be in [0, 1), got {margin}")
        if refine_limit is not None:
            refine_limit = whole_number("refine_limit", refine_limit, of="micro-batches", at_least=0)
        precisions = (precision,) if isinstance(precision, str) else tuple(precision)
        if not precisions:
            raise ValueError(
                "precision= is empty: give a Lightning precision string, e.g. '32-true' or 'bf16-mixed'"
            )
        world_size = whole_number("world_size", world_size, of="ranks", at_least=1)
        strategy = "ddp" if strategy is None else valid_name("strategy", strategy, STRATEGIES)
        ranks = _data_parallel_ranks(sharding, strategy, world_size, cpu_offload)
        modes, dropped = _checkpointable(
            model, allowed_modes(checkpointing), sharded=strategy == "fsdp2", blocks=blocks
        )
        axes = default_axes(batch) if batch_axes is None else batch_axes
        total = batch_size(batch, axes)
        if total % ranks:
            what = f"{ranks} data-parallel ranks" if ranks != world_size else f"{world_size} GPUs"
            raise ValueError(f"The global batch of {total} does not split evenly across {what}")
        per_rank = batch_slice(batch, total // ranks, axes=axes)
        sizes = _divisors(total // ranks)
        lever = valid_lever(lever)
        fused_step, offload = lever == "fused_step", lever == "offload"
        _check_levers(strategy, world_size, fused_step, offload)
        optimizers, unsharded = _candidates(model, optimizers, strategy, world_size)
        if not optimizers:
            raise ValueError(
                f"No optimizer to plan: {unsharded}; name a torch or torch-optimi one (adamw, sgd)"
            )
        pairs = _pairs(optimizers, precisions, compensate and not offload, fused_step)  # masters are fp32
        _check_pairs(pairs, optimizers, precisions, fused_step)
        blocks = None if blocks is None else block_classes(blocks)
        _check_fsdp2_options(strategy, cpu_offload, mp_policy, sharding)
        return cls(
            model, batch, per_rank, axes, total,
            tuple(sizes[-1:] if fused_step else sizes),  # the fused step steps at every backward
            budget, margin, int(budget.usable * (1 - margin)), precisions, modes, strategy, world_size, ranks,
            lever,
            optimizers, tuple(pairs), compensate, tuple(note for note in (dropped, unsharded) if note),
            device, loss_fn, cost, progress, refine_limit, cpu_offload if strategy == "fsdp2" else False,
            link, mp_policy, sharding, blocks, micro_batch_size,
        )  # fmt: skip

    @property
    def accumulated(self) -> int:
        """A rank's batch: the samples of one optimizer step, accumulated."""
        return self.total // self.ranks

    @property
    def planned_optimizers(self) -> tuple[str | None, ...]:
        """The optimizers of `pairs` in quality order: those asked, with their Kahan twins."""
        return tuple(dict.fromkeys(optimizer for optimizer, _ in self.pairs))

    @property
    def offload_when_needed(self) -> bool:
        """Whether FSDP2's CPU offload is tried only where nothing fits without it (``cpu_offload=None``):
        on FSDP2's own layout over every rank, the only one `Simulations.offloaded` models."""
        plain = self.sharding is None or self.sharding.shard_size == self.world_size
        return self.cpu_offload is None and self.strategy == "fsdp2" and plain


def _check_model(model: nn.Module) -> None:
    """Refuse a model whose step cannot be simulated: manual optimization, or no parameters."""
    if is_lightning(model) and not model.automatic_optimization:
        raise NotImplementedError(
            f"{type(model).__name__} uses manual optimization, whose steps are its own code and cannot be "
            "simulated: plan the underlying nn.Module instead, with loss_fn= (and optimizers= to name the "
            "candidates)."
        )
    if (empty := without_parameters(model)) is not None:
        raise ValueError(empty)


def _check_levers(strategy: str, world_size: int, fused_step: bool, offload: bool) -> None:
    """Refuse a step lever the strategy cannot run: the fused step under DDP and the like, the offloaded
    optimizer on several processes."""
    if fused_step and world_size > 1 and strategy != "fsdp2":
        raise ValueError(
            f"The optimizer step fused into backward cannot run under {strategy}: it reduces each "
            "gradient across ranks after backward. Plan it with world_size=1 or strategy='fsdp2' (each "
            "shard steps once its reduce-scatter is done), or plan lever='release_gradients' instead."
        )
    if offload and world_size > 1:
        raise ValueError(
            "The offloaded optimizer runs on one process, its step after backward: plan it with world_size=1."
        )


def _check_pairs(
    pairs: list[Pair], optimizers: Sequence[str | None], precisions: Sequence[str], fused_step: bool
) -> None:
    """Refuse optimizers and precisions of which no pair is planned (`_pairs`)."""
    if not pairs and fused_step:
        raise ValueError(
            f"With 16-bit weights ({', '.join(precisions)}) only the Kahan-summed optimizers keep the small "
            "updates, and the fused step cannot take them as the catalogue builds them (torch-optimi counts "
            "steps per group): allow a precision with fp32 weights (32-true, bf16-mixed), or plan without "
            "lever='fused_step'."
        )
    if not pairs:
        raise ValueError(
            f"None of the optimizers {', '.join(map(str, optimizers))} keeps small updates with 16-bit "
            f"weights ({', '.join(precisions)}): allow adamw or sgd (planned as their Kahan-summed "
            "adamw_kahan, sgd_kahan), or a precision with fp32 weights (32-true, bf16-mixed)."
        )


def _check_fsdp2_options(
    strategy: str, cpu_offload: bool | None, mp_policy: bool, sharding: Sharding | None
) -> None:
    """Refuse FSDP2's own options under another strategy, and a layout's own mixed precision policy: the
    planner plans its one policy (``mp_policy=True``), as `AutoFitStrategy` applies it."""
    flag("mp_policy", mp_policy)
    if sharding is not None and sharding.mp_policy is not None:
        raise ValueError(
            "plan_fit plans FSDP2's bf16 MixedPrecisionPolicy itself (mp_policy=True: bf16 parameters, fp32 "
            f"reductions), not a layout's own ({sharding.mp_policy!r}): leave mp_policy out of the Sharding"
        )
    if cpu_offload and strategy != "fsdp2":
        raise ValueError(
            f"cpu_offload is FSDP2's CPUOffloadPolicy: plan it with strategy='fsdp2', not {strategy!r}"
        )
    if mp_policy and strategy != "fsdp2":
        raise ValueError(
            f"mp_policy is FSDP2's MixedPrecisionPolicy: plan it with strategy='fsdp2', not {strategy!r}"
        )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _data_parallel_ranks(sharding: Sharding | None, strategy: str, world_size: int, cpu_offload: Any) -> int:
    """The ranks the global batch splits over: ``world_size``, less tensor parallelism's groups of the run's
    layout (``sharding``, checked against the other arguments)."""
    if sharding is None:
        return world_size
    if not isinstance(sharding, Sharding):
        raise TypeError(f"sharding= must be a Sharding; got {sharding!r} ({type(sharding).__name__})")
    if strategy != "fsdp2" or sharding.world_size != world_size:
        raise ValueError(
            f"sharding= is the layout of strategy='fsdp2' over world_size ranks; got strategy={strategy!r}, "
            f"world_size={world_size} and a layout over {sharding.world_size} ranks ({sharding.describe()})"
        )
    plain = sharding.parallelize_fn is None and sharding.tensor_parallel_size == sharding.replicate_size == 1
    if cpu_offload and not plain:
        raise ValueError(
            f"cpu_offload is planned for FSDP2's own layout over every rank, not {sharding.describe()}: "
            "plan without it"
        )
    return sharding.data_parallel_size


def _candidates(
    model: nn.Module, optimizers: Sequence[str | None] | None, strategy: str, world_size: int
) -> tuple[tuple[str | None, ...], str]:
    """The optimizers to plan, in quality order (the model's own, then lighter, unless named), and a note
    on those left out: under FSDP2 the bitsandbytes optimizers, whose kernels DTensor cannot shard ("does
    not have a sharding strategy registered"), and torch's Adafactor, whose step reads a value from a tensor
    that the simulation's sharded fake tensors cannot give."""
    candidates = tuple(optimizers) if optimizers is not None else lighter_candidates(model)
    if strategy != "fsdp2":  # one rank too: its step runs on DTensors all the same
        return candidates, ""
    bnb = [o for o in candidates if o in CATALOGUE and CATALOGUE[o].needs_bitsandbytes]
    notes = [f"{', '.join(bnb)}: bitsandbytes' kernels do not run on FSDP2's DTensors"] if bnb else []
    if "adafactor" in candidates:
        notes.append("adafactor: its sharded step is not simulated")
    left_out = {*bnb, "adafactor"}
    kept = tuple(o for o in candidates if o not in left_out)
    return kept, f"not planned under FSDP2: {'; '.join(notes)}" if notes else ""


def _pairs(
    candidates: Sequence[str | None], precisions: Sequence[str], compensate: bool, fused: bool = False
) -> list[Pair]:
    """The (optimizer, precision) pairs to plan, best first: each optimizer at each precision in the order
    given, except that with ``compensate`` a precision with 16-bit weights takes the optimizer's Kahan
    twin (`COMPENSATED`), and an optimizer without one is not planned there. ``None`` (the configured
    optimizer, not in the catalogue) is kept as is. With the ``fused`` step the Kahan entries are left
    out: torch-optimi's optimizers count steps per group, and `fuse_optimizer_step` takes them only built
    with ``gradient_release=True``."""
    pairs: list[Pair] = []
    for opt in candidates:
        for prec in precisions:  # in the order of preference given
            candidate = opt
            if compensate and opt is not None and sixteen_bit_weights(prec):
                candidate = COMPENSATED.get(opt)  # a Kahan entry is its own twin
            if (candidate is None and opt is not None) or (fused and candidate in KAHAN):
                continue
            pairs.append((candidate, prec))
    return list(dict.fromkeys(pairs))


def loads(optimizer: str | None) -> bool:
    """Whether ``optimizer`` can be built here: a bitsandbytes one only where bitsandbytes loads (the
    candidates list it where it is installed, `lighter_candidates`; it is imported when first needed)."""
    entry = CATALOGUE.get(optimizer) if optimizer is not None else None
    return entry is None or not entry.needs_bitsandbytes or load_bitsandbytes() is not None


def _checkpointable(
    model: nn.Module, modes: tuple[str, ...], *, sharded: bool = False, blocks: LayerClasses | None = None
) -> tuple[tuple[str, ...], str]:
    """The modes that are candidates for ``model``, and a note on those that are not.

    Checkpointing applies to the repeated blocks `find_blocks` finds, or the instances of ``blocks``; a model
    with none (an MLP, a single layer) has nothing to checkpoint, so only ``"none"`` is planned, whatever was
    allowed. A compiled model's blocks are not checkpointed either: inside a compiled graph what is kept
    for backward is torch.compile's partitioner's choice, so its mode is `COMPILE_BUDGET`, the activation
    budget `plan_compiled` finds at each micro-batch; except under FSDP2 (``sharded``), whose sharded step
    of a compiled model is simulated eagerly, so no activation budget would change it.
    """
    if modes != ("none",) and compiled_modules(model) and sharded:
        return ("none",), (
            f"checkpointing not planned: {type(model).__name__} is compiled, and FSDP2's sharded step is "
            "simulated eagerly, where torch.compile's activation budget changes nothing"
        )
    if modes != ("none",) and compiled_modules(model):
        return ("none", COMPILE_BUDGET), (
            f"{type(model).__name__} is compiled: its checkpointing is torch.compile's "
            f"activation_memory_budget ({COMPILE_BUDGET} in the table; its partitioner recomputes what it "
            f"no longer saves), the highest whose step fits, tried from {configured_budget():g} down a "
            "tenth at a time; no block is wrapped"
        )
    if modes == ("none",) or find_blocks(model, blocks):
        return modes, ""
    if blocks is not None:
        raise ValueError(no_blocks_message(model, "plan_fit(..., blocks={MyBlock})", blocks))
    dropped = ", ".join(mode for mode in modes if mode != "none")
    return ("none",), (
        f"checkpointing {dropped} not planned: {type(model).__name__} has no repeated blocks to checkpoint"
    )
