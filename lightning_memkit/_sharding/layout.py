"""A sharded layout as it runs: applied to the simulated copy of a model, and read off a model.

A rank's memory depends on the layout the run applies: which parameters are DTensors, over which mesh and
with which placements. The planners never assume it from the strategy's class: the step is simulated with
the layout applied to a copy of the model on a fake mesh of the run's shape (`laid_out_copy`: the default
layout of a `Sharding`, or the user's ``parallelize_fn``, or a LightningModule's own ``configure_model``,
which Lightning runs with ``self.device_mesh``), and what a run applied is read back (`layout_of`) and
held to what was simulated.
"""

from __future__ import annotations

import contextlib
import functools
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any

from torch import nn

from lightning_memkit._sharding import fsdp2 as _fsdp2
from lightning_memkit._step import Sharding

__all__ = [
    "ConfigureModel",
    "Layout",
    "apply_layout",
    "check_heads",
    "describe_layout",
    "laid_out_copy",
    "layout_mismatch",
    "layout_of",
    "mesh_shape",
    "tp_plan",
]

#: Lightning's names for ``ModelParallelStrategy``'s device mesh, as ``configure_model`` reads it.
LIGHTNING_MESH = ("data_parallel", "tensor_parallel")

#: Each repeated block's projections, by the names the LLaMA family's decoder layers give them in Hugging
#: Face (LLaMA, Mistral, Qwen2, Gemma and others whose attention reads its head count off the projected
#: width): split by output features (column-wise: attention's query, key and value; the MLP's gate and
#: up) or by input features (row-wise: attention's output, the MLP's down), the layout torchtitan gives
#: LLaMA's layers. Names other families give the same layers (``out_proj``, ``fc1``, ``dense``) are left
#: out: OPT reshapes by its configured head count, which a split projection no longer has, and BERT's
#: ``dense`` is both an output and an up projection.
COLUMNWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROWWISE = ("o_proj", "down_proj")

#: A layout read off a model: for each (mesh dimensions, mesh shape, placements), how many parameters.
Layout = tuple[tuple[tuple[tuple[str, ...] | None, tuple[int, ...], tuple[str, ...]], int], ...]


def mesh_shape(sharding: Sharding) -> tuple[tuple[int, ...], tuple[str, ...] | None]:
    """The fake mesh a layout is simulated on: Lightning's (data_parallel, tensor_parallel) for a
    ``parallelize_fn``, as ``configure_model`` gets it; for the default layout, its (replicate, shard,
    tensor_parallel) dimensions that are there (one unnamed dimension for plain FSDP2)."""
    if sharding.parallelize_fn is not None:
        return (sharding.data_parallel_size, sharding.tensor_parallel_size), LIGHTNING_MESH
    if sharding.replicate_size == 1 and sharding.tensor_parallel_size == 1:
        return (sharding.world_size,), None
    dims = [("replicate", sharding.replicate_size)] if sharding.replicate_size > 1 else []
    dims.append(("shard", sharding.shard_size))
    if sharding.tensor_parallel_size > 1:
        dims.append(("tensor_parallel", sharding.tensor_parallel_size))
    return tuple(size for _, size in dims), tuple(name for name, _ in dims)


def tp_plan(model: nn.Module, blocks: Sequence[str]) -> dict[str, Any]:
    """Tensor parallelism's plan for ``blocks``: each block's projections (`COLUMNWISE`, `ROWWISE`, by
    their last name) as ``parallelize_module`` takes it, keyed by qualified name. Empty when no block has
    both kinds (a model whose layers this plan does not know)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, Any] = {}
    for block in blocks:
        prefix = f"{block}." if block else ""
        found = {}
        for name, module in model.get_submodule(block).named_modules():
            leaf = name.rsplit(".", 1)[-1]
            if isinstance(module, nn.Linear) and leaf in COLUMNWISE:
                found[prefix + name] = ColwiseParallel()
            elif isinstance(module, nn.Linear) and leaf in ROWWISE:
                found[prefix + name] = RowwiseParallel()
        kinds = {type(style) for style in found.values()}
        if len(kinds) == 2:
            plan.update(found)
    return plan


def apply_layout(model: nn.Module, mesh: Any, sharding: Sharding, blocks: Sequence[str]) -> None:
    """The default layout of ``sharding``: each block's projections split over the tensor-parallel
    dimension (`tp_plan`), then ``fully_shard`` on each block and the root over the data-parallel
    dimensions (HSDP's two, or one)."""
    options = _fully_shard_options(sharding)
    names = mesh.mesh_dim_names or ()
    if sharding.tensor_parallel_size > 1:
        from torch.distributed.tensor.parallel import parallelize_module

        plan = tp_plan(model, blocks)
        check_heads(model, sharding.tensor_parallel_size)
        if not plan:
            raise ValueError(
                f"tensor_parallel_size={sharding.tensor_parallel_size}: {type(model).__name__}'s blocks have "
                f"no projections the built-in plan knows (the LLaMA family's "
                f"{', '.join(COLUMNWISE + ROWWISE)}); pass parallelize_fn=fn(model, device_mesh) that "
                "applies your own parallelize_module plan (with memkit, an hf: model of the LLaMA family)"
            )
        parallelize_module(model, mesh["tensor_parallel"], plan)
    data = tuple(name for name in ("replicate", "shard") if name in names)
    _fsdp2.shard_layout(model, mesh[data] if data else mesh, blocks, **options)


def check_heads(model: nn.Module, tp: int) -> None:
    """Refuse a tensor-parallel degree that does not divide the attention heads of a Hugging Face config
    in ``model`` (each rank computes whole heads: its query, key and value projections' rows)."""
    for module in model.modules():
        config = getattr(module, "config", None)
        heads = {
            name: getattr(config, name, None)
            for name in ("num_attention_heads", "num_key_value_heads")
            if isinstance(getattr(config, name, None), int)
        }
        uneven = {name: n for name, n in heads.items() if n % tp}
        if uneven:
            said = ", ".join(f"{name}={n}" for name, n in uneven.items())
            raise ValueError(
                f"tensor_parallel_size={tp} does not divide {type(module).__name__}'s {said}: each "
                "tensor-parallel rank computes whole attention heads; choose a divisor of the heads"
            )
        if heads:
            return


class ConfigureModel:
    """A LightningModule's own ``configure_model`` as the layout: run on the simulated copy with the fake
    mesh as ``self.device_mesh`` (as ``ModelParallelStrategy`` runs it). With ``shard_unsharded``, a copy
    it leaves with nothing sharded is then sharded as Lightning documents FSDP2 over the data-parallel
    dimension, with the `Sharding`'s ``fully_shard`` options (as ``AutoFitStrategy`` shards such a module
    itself: `laid_out_copy`)."""

    def __init__(self, shard_unsharded: bool = False) -> None:
        self.shard_unsharded = shard_unsharded

    def __call__(self, module: nn.Module, mesh: Any) -> None:
        module._device_mesh = mesh  # what LightningModule.device_mesh reads
        module.configure_model()

    def __eq__(self, other: object) -> bool:  # one layout: steps with it compare (and cache) as equal
        return type(other) is type(self) and other.shard_unsharded == self.shard_unsharded

    def __hash__(self) -> int:
        return hash((type(self), self.shard_unsharded))

    def __repr__(self) -> str:
        return "configure_model"


def _fully_shard_options(sharding: Sharding) -> dict[str, Any]:
    """``fully_shard``'s options of ``sharding``: ``reshard_after_forward`` and ``mp_policy``."""
    options: dict[str, Any] = {"reshard_after_forward": sharding.reshard_after_forward}
    if sharding.mp_policy is not None:
        options["mp_policy"] = sharding.mp_policy
    return options


def laid_out_copy(model: nn.Module, mesh: Any, sharding: Sharding, blocks: Sequence[str]) -> nn.Module:
    """A copy of ``model`` (`_sharding.fsdp2.model_copy`) with ``sharding``'s layout applied over ``mesh``:
    its ``parallelize_fn``, else the default (`apply_layout`). The original is untouched."""
    copy = _fsdp2.model_copy(model)
    if sharding.parallelize_fn is None:
        apply_layout(copy, mesh, sharding, blocks)
        return copy
    fn = sharding.parallelize_fn
    with _own_meshes_answered(fn, copy):
        fn(copy, mesh)
    if isinstance(fn, ConfigureModel) and not layout_of(copy):
        # A configure_model that shards nothing: AutoFitStrategy shards such a module itself; under a plain
        # ModelParallelStrategy each rank trains it whole, as simulated.
        if fn.shard_unsharded:
            _fsdp2.shard_layout(copy, mesh["data_parallel"], blocks, **_fully_shard_options(sharding))
        return copy
    if not layout_of(copy):
        raise ValueError(
            f"parallelize_fn ({sharding.parallelize_fn!r}) left no parameter of {type(model).__name__} "
            "sharded: a layout is tensor parallelism (parallelize_module) or fully_shard, on the mesh given"
        )
    return copy


@contextlib.contextmanager
def _own_meshes_answered(fn: Any, module: nn.Module) -> Iterator[None]:
    """``init_device_mesh`` as a function imported it (``from torch.distributed.device_mesh import
    init_device_mesh`` binds the original in its module) answered with the fake mesh's stand-in, for
    ``fn`` and, for a LightningModule, its ``configure_model``."""
    import torch.distributed.device_mesh as device_mesh

    stand_in = device_mesh.init_device_mesh
    original = getattr(stand_in, "original", None)
    if original is None:  # not inside a fake mesh: nothing to answer
        yield
        return
    functions = [fn, getattr(type(module), "configure_model", None)]
    scopes = {id(g): g for f in functions if (g := _globals(f)) is not None}.values()
    bound = [(scope, name) for scope in scopes for name, value in list(scope.items()) if value is original]
    for scope, name in bound:
        scope[name] = stand_in
    try:
        yield
    finally:
        for scope, name in bound:
            scope[name] = original


def _globals(fn: Any) -> dict[str, Any] | None:
    """The module globals ``fn`` (a function, bound method, partial or callable object) reads."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    fn = getattr(fn, "__func__", fn)
    found = getattr(fn, "__globals__", None)
    if found is None and not isinstance(fn, type):
        found = getattr(vars(type(fn)).get("__call__"), "__globals__", None)
    return found


def layout_of(model: nn.Module) -> Layout:
    """The layout ``model``'s parameters have: for each (mesh dimension names, mesh shape, placements), how
    many parameters are DTensors so; empty for a model with none (one device, DDP)."""
    from torch.distributed.tensor import DTensor

    seen: Counter = Counter()
    params = {id(p): p for p in model.parameters()}  # a sharded unit's gathered copy is not a parameter
    for fsdp_param in _fsdp2.fsdp_params(model):
        sharded = _fsdp2.sharded_param(fsdp_param)
        if sharded is not None:
            params[id(sharded)] = sharded
    for p in params.values():
        if isinstance(p, DTensor):
            mesh = p.device_mesh
            key = (mesh.mesh_dim_names, tuple(mesh.shape), tuple(str(pl) for pl in p.placements))
            seen[key] += 1
    return tuple(sorted(seen.items(), key=repr))


def layout_mismatch(planned: Layout, run: Layout, planner: str, sharding: Sharding) -> str | None:
    """What to tell the user where the layout a run applied (``run``, `layout_of` its model) is not the one
    its plan simulated (``planned``): the meshes' shapes and the placements compared, the dimensions'
    names not (the default layout's mesh has none); ``None`` where they agree."""

    def unnamed(layout: Layout) -> Counter:
        return Counter({(shape, placements): n for (_, shape, placements), n in layout})

    if unnamed(planned) == unnamed(run):
        return None
    return (
        f"{planner} planned each rank's step of {sharding.world_size} under {sharding.describe()}: "
        f"{describe_layout(planned)}; but the run's model has {describe_layout(run)}. A plan for one layout "
        "does not hold for another: make configure_model shard the same way wherever it runs (it ran on a "
        "copy of the module with a fake device mesh of the run's shape, before the Trainer's own call), or "
        f"remove {planner}."
    )


def describe_layout(layout: Layout) -> str:
    """A layout in words: ``"12 parameters (Shard(dim=0),) over data_parallel=2; ..."``; ``"nothing
    sharded"`` for an empty one."""
    if not layout:
        return "nothing sharded"
    parts = []
    for (names, shape, placements), count in layout:
        dims = " x ".join(
            f"{name}={size}"
            for name, size in zip(names or [f"dim{i}" for i in range(len(shape))], shape, strict=True)
        )
        parts.append(f"{count} parameters ({', '.join(placements)}) over {dims}")
    return "; ".join(parts)
