"""The parallel layout planned with the rest: tensor-parallel degree and HSDP's replicate x shard split.

`plan_fit` plans one layout (`Sharding`). Where the user leaves the layout open (`Layouts`, or
``sharding="auto"``), `plan_layouts` lists the layouts a world of ranks can run (`candidates`), orders them
by the seconds their collectives take (`collectives`, the cost model below), and plans each in that order
with `plan_fit`; the first whose plan fits every rank is the answer. Why the first and not the fastest:
the order already is the step-time model's for what differs between layouts (their collectives: compute
is the same work split over the same ranks), and each layout's plan costs simulated steps (seconds each
for a 7B model), so the search stops at the first fit: at most one plan per candidate, a count, never a
clock.

The cost model, seconds of one rank's collectives (`_sharding.fsdp2.Link`: latency + bytes / bandwidth,
a ring collective moving ``(N - 1) / N`` of the bytes for an all-gather or reduce-scatter, twice that for
an all-reduce):

- FSDP2 (`_sharding.fsdp2.collective_seconds`), over the shard group: each unit's all-gathers (forward and
  backward) and reduce-scatter, of a rank's tensor-parallel part of the parameters and gradients.
- HSDP: beside it, each unit's all-reduce of its gradient shard across the replicas.
- Tensor parallelism (torchtitan's plan as DTensor runs it, one collective per module): in forward each
  row-wise projection all-reduces its output (tokens x out features), in backward each column-wise one
  all-reduces its input's gradient (tokens x in features), in the activations' dtype (2 bytes under a
  16-bit precision, else 4); per sample, so it grows with the micro-batch.

A tensor-parallel group is a divisor of the node's devices (its all-reduces stay on the node's link);
a shard group or the replicas that span nodes use `INTER_NODE_LINKS`, so HSDP's shard group within a node
comes first. A layout the plan cannot apply is skipped with a note: a model whose blocks have no
projections torchtitan's plan names (`_sharding.layout.tp_plan`), a degree that does not divide the
attention heads (`_sharding.layout.check_heads`), HSDP with the user's ``parallelize_fn`` (the function
builds its own mesh), a global batch the data-parallel ranks cannot split.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from torch import nn

from lightning_memkit._budget import whole_number
from lightning_memkit._checkpointing.blocks import find_blocks
from lightning_memkit._estimating.analytic import model_static
from lightning_memkit._estimating.lightning_step import SampleAxes, batch_size, batch_tensors
from lightning_memkit._sharding import fsdp2 as _fsdp2
from lightning_memkit._sharding.layout import check_heads, tp_plan
from lightning_memkit._step import Sharding

__all__ = ["INTER_NODE_LINKS", "Layouts", "candidates", "collectives", "plan_layouts"]

#: Links between nodes where none was timed: a 200 Gb/s InfiniBand port per GPU; processes of one machine
#: (gloo on the CPU) as within it.
INTER_NODE_LINKS = {"cuda": _fsdp2.Link(50e-6, 25e9), "cpu": _fsdp2.LINKS["cpu"]}
#: Precisions whose activations (what tensor parallelism all-reduces) are 2 bytes an element.
_SIXTEEN_BIT = ("bf16-mixed", "16-mixed", "bf16-true", "16-true", "bf16", "16")

Size = int | Literal["auto"]


@dataclass(frozen=True)
class Layouts:
    """The layouts `plan_fit` may choose among (its ``sharding=``; ``"auto"`` is ``Layouts()``): each a
    tensor-parallel degree and an HSDP split of the data-parallel ranks, FSDP2 over the rest.

    Attributes:
        tensor_parallel_size: the ranks of a tensor-parallel group (Lightning's word), or ``"auto"``: every
            divisor of ``devices_per_node``.
        replicate_size: HSDP's replicas of the data-parallel ranks (1: FSDP2 over them all), or ``"auto"``:
            every split leaving a shard group of at least 2.
        devices_per_node: the devices of one node (``None``: every rank on one node).
        parallelize_fn: the user's layout, ``fn(model, device_mesh)`` over a mesh named
            ``("data_parallel", "tensor_parallel")`` (`Sharding.parallelize_fn`), planned at each
            tensor-parallel degree; ``None``: torchtitan's LLaMA plan, then FSDP2 or HSDP.
    """

    tensor_parallel_size: Size = "auto"
    replicate_size: Size = "auto"
    devices_per_node: int | None = None
    parallelize_fn: Callable[[Any, Any], Any] | None = None

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "replicate_size"):
            if getattr(self, name) != "auto":
                whole_number(name, getattr(self, name), of="ranks", at_least=1)
        if self.devices_per_node is not None:
            whole_number("devices_per_node", self.devices_per_node, of="devices", at_least=1)


def candidates(model: nn.Module, world_size: int, layouts: Layouts) -> tuple[list[Sharding], list[str]]:
    """Every layout of ``world_size`` ranks ``layouts`` allows that the plan can apply to ``model``, and a
    note for each it cannot (`plan_layouts`' order is not theirs: see `collectives`)."""
    per_node = layouts.devices_per_node or world_size
    if layouts.tensor_parallel_size == "auto":
        degrees = [t for t in _divisors(per_node) if world_size % t == 0]
    else:
        degrees = [layouts.tensor_parallel_size]
    blocks = [name for name, _ in find_blocks(model)]
    found: list[Sharding] = []
    skipped: list[str] = []
    for tp in degrees:
        if world_size % tp or (tp > 1 and per_node % tp):
            skipped.append(
                f"TP {tp}: not a divisor of the {per_node} devices of a node and {world_size} ranks"
            )
            continue
        if tp > 1 and (why := _cannot_split(model, blocks, tp, layouts.parallelize_fn)):
            skipped.append(f"TP {tp}: {why}")
            continue
        dp = world_size // tp
        if layouts.replicate_size == "auto":
            replicas = [r for r in _divisors(dp) if r == 1 or dp // r >= 2]
        else:
            replicas = [layouts.replicate_size]
        for r in replicas:
            if dp % r:
                skipped.append(f"HSDP {r} x {dp / r:g} (TP {tp}): {r} replicas do not divide {dp} ranks")
            elif r > 1 and layouts.parallelize_fn is not None:
                skipped.append(
                    f"HSDP {r} x {dp // r} (TP {tp}): parallelize_fn's layout is its own (it builds the "
                    "(replicate, shard) mesh itself)"
                )
            else:
                found.append(Sharding(world_size, tensor_parallel_size=tp, replicate_size=r,
                                      parallelize_fn=layouts.parallelize_fn))  # fmt: skip
    return found, skipped


def _cannot_split(model: nn.Module, blocks: Sequence[str], tp: int, parallelize_fn: Any) -> str:
    """Why torchtitan's plan cannot split ``model``'s blocks over ``tp`` ranks (``""``: it can). A user's
    ``parallelize_fn`` is theirs to make work (the simulation runs it)."""
    if parallelize_fn is not None:
        return ""
    if not tp_plan(model, blocks):
        return (
            f"{type(model).__name__}'s blocks have no projections torchtitan's LLaMA plan names; give "
            "parallelize_fn= your own plan"
        )
    try:
        check_heads(model, tp)
    except ValueError as error:
        return str(error)
    return ""


def collectives(
    model: nn.Module,
    sharding: Sharding,
    precision: str,
    tokens: int,
    link: _fsdp2.Link,
    *,
    devices_per_node: int | None = None,
    inter_node: _fsdp2.Link | None = None,
) -> tuple[float, float]:
    """Seconds of one rank's collectives under ``sharding`` (the module docstring's cost model): per
    micro-step (FSDP2's and HSDP's, and tensor parallelism's latencies), and per sample of a micro-step
    (tensor parallelism's bytes, ``tokens`` a sample). ``link`` within a node of ``devices_per_node``
    (default: every rank), ``inter_node`` between nodes (default: the same link)."""
    per_node = devices_per_node or sharding.world_size
    across = inter_node or link
    tp, shard, replicas = sharding.tensor_parallel_size, sharding.shard_size, sharding.replicate_size
    blocks = [name for name, _ in find_blocks(model)]
    projections = _projections(model, blocks) if tp > 1 else {}
    static = model_static(model, precision)
    split = sum(
        m.weight.numel() + (m.bias.numel() if m.bias is not None else 0) for m, _ in projections.values()
    )
    total = sum(p.numel() for p in model.parameters() if p.requires_grad) or 1
    params = static.parameters - static.parameters * split // total * (tp - 1) // tp
    grads = static.gradients - static.gradients * split // total * (tp - 1) // tp
    n_units = len(blocks) + 1
    fixed = 0.0
    if shard > 1:
        shard_link = link if tp * shard <= per_node else across
        fixed += _fsdp2.collective_seconds(params, grads, n_units, shard, True, shard_link)
    if replicas > 1:
        replica_link = link if sharding.world_size <= per_node else across
        moved = 2 * (replicas - 1) / replicas * grads / shard
        fixed += n_units * replica_link.latency_s + moved / replica_link.bytes_per_s
    if not projections:
        return fixed, 0.0
    itemsize = 2 if precision in _SIXTEEN_BIT else 4
    # forward: a row-wise projection's output; backward: a column-wise one's input gradient
    features = sum(
        m.out_features if style == "rowwise" else m.in_features for m, style in projections.values()
    )
    fixed += len(projections) * link.latency_s
    return fixed, 2 * (tp - 1) / tp * tokens * features * itemsize / link.bytes_per_s


def _projections(model: nn.Module, blocks: Sequence[str]) -> dict[str, tuple[nn.Linear, str]]:
    """The projections torchtitan's plan splits (`tp_plan`), each with ``"colwise"`` or ``"rowwise"``."""
    return {
        name: (model.get_submodule(name), "rowwise" if type(style).__name__.startswith("Row") else "colwise")
        for name, style in tp_plan(model, blocks).items()
    }


def tokens_per_sample(batch: Any, axes: SampleAxes | None = None) -> int:
    """The positions a sample carries through the model, for tensor parallelism's activations: its first
    tensor's elements a sample (token ids: the sequence), less the last dimension of a floating tensor
    (its features)."""
    tensors = batch_tensors(batch)
    if not tensors:
        return 1
    first, samples = tensors[0], max(batch_size(batch, axes), 1)
    per_sample = first.numel() // samples
    if first.is_floating_point() and first.dim() > 1:
        per_sample //= first.shape[-1]
    return max(per_sample, 1)


def ordered(
    model: nn.Module,
    layouts: Sequence[Sharding],
    precision: str,
    batch: Any,
    axes: SampleAxes | None,
    link: _fsdp2.Link,
    inter_node: _fsdp2.Link,
    devices_per_node: int | None,
) -> list[tuple[float, Sharding]]:
    """``layouts`` by the seconds of their collectives in one global batch (each data-parallel rank's
    share in one micro-step), least first; ties to the fewer tensor-parallel ranks, then fewer replicas."""
    total, tokens = batch_size(batch, axes), tokens_per_sample(batch, axes)
    timed = []
    for layout in layouts:
        fixed, per_sample = collectives(
            model, layout, precision, tokens, link, devices_per_node=devices_per_node, inter_node=inter_node
        )
        seconds = fixed + per_sample * total // layout.data_parallel_size
        timed.append((seconds, layout.tensor_parallel_size, layout.replicate_size, layout))
    return [(seconds, layout) for seconds, _, _, layout in sorted(timed, key=lambda row: row[:3])]


def plan_layouts(
    plan: Callable[[Sharding], Any],
    model: nn.Module,
    batch: Any,
    axes: SampleAxes | None,
    world_size: int,
    layouts: Layouts,
    precision: str,
    link: _fsdp2.Link,
    device: str,
) -> Any:
    """The plan (``plan(layout)``, `plan_fit` with that layout) of the first layout, in the order of least
    communication (`ordered`), that fits every rank; its note names the layout and those passed over.
    Raises `ValueError` where none fits, with each layout's reason."""
    found, skipped = candidates(model, world_size, layouts)
    total = batch_size(batch, axes)
    fitting = [layout for layout in found if total % layout.data_parallel_size == 0]
    skipped += [
        f"{describe(layout)}: the global batch of {total} does not split over {layout.data_parallel_size} "
        "data-parallel ranks"
        for layout in found
        if layout not in fitting
    ]
    order = ordered(
        model, fitting, precision, batch, axes, link, INTER_NODE_LINKS.get(device, link),
        layouts.devices_per_node,
    )  # fmt: skip
    refused: list[str] = []
    for seconds, layout in order:
        try:
            chosen = plan(layout)
        except ValueError as error:  # nothing fits this layout: the next one
            refused.append(f"{describe(layout)}: {_why_not(error)}")
            continue
        why = f"layout {describe(layout)}: the least communication that fits (collectives about "
        why += f"{seconds:.3g} s a global batch)"
        notes = [why, *(f"does not fit: {r}" for r in refused), *(f"skipped: {s}" for s in skipped)]
        note = "; ".join(n for n in [chosen.note, *notes] if n)
        return dataclasses.replace(chosen, note=note)
    reasons = [*refused, *(f"skipped: {s}" for s in skipped)]
    raise ValueError(f"No layout of {world_size} ranks fits: " + ("; ".join(reasons) or "no layout to plan"))


def _why_not(error: ValueError) -> str:
    """`plan_fit`'s no-fit message in a few words: its leanest plan's peak (else the message's start)."""
    text = str(error)
    leanest = re.search(r"the leanest plan \(([^)]*)\) peaks at ([^;]+)", text)
    return f"its leanest plan ({leanest[1]}) peaks at {leanest[2]}" if leanest else text.split(". What")[0]


def describe(layout: Sharding) -> str:
    """A layout in words, with its ranks: ``"FSDP2 4"``, else as `Sharding.describe` says it
    (``"TP 2 x FSDP2 2"``, ``"HSDP 2 x 2"``)."""
    plain = layout.tensor_parallel_size == layout.replicate_size == 1 and layout.parallelize_fn is None
    return f"FSDP2 {layout.world_size}" if plain else layout.describe()


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
