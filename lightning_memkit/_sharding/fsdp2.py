"""FSDP2 (``fully_shard``) as the project reads and simulates it: the one module that touches its internals.

FSDP2 keeps each parameter twice: the sharded DTensor the module and optimizer hold between steps, and an
unsharded copy whose storage it grows (``UntypedStorage.resize_``) to all-gather into and shrinks to zero
to free. Which tensor is which is not public API (``FSDPParam`` and its fields are private to
``torch.distributed.fsdp._fully_shard``); read here only, with a fallback: on a torch whose FSDP2 state
looks otherwise, no unit is found, the totals stay exact and the sharded split is not given.

A sharded step is simulated on fake tensors over torch's fake process group (`fake_mesh`; the patches of
torch it needs meanwhile, FSDP2's chunking among them, are `_sharding.fake_pg`'s), on a copy of the model
sharded as Lightning documents FSDP2 (`sharded_copy`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import itertools
import math
import types
import warnings
from collections.abc import Iterator, Sequence
from copy import deepcopy
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from lightning_memkit._sharding.fake_pg import side_group, simulating, unfaked

#: gloo between 2 processes of this machine (2 cores), timed with `time_link`
LINK_CPU_LATENCY_S, LINK_CPU_BYTES_PER_S = 1e-3, 1e9

__all__ = [
    "LINKS",
    "Link",
    "bf16_policy",
    "collective_seconds",
    "explain_mixed_tensors",
    "fake_mesh",
    "fsdp_params",
    "is_sharded",
    "largest_unit_shard",
    "model_copy",
    "over_twins",
    "root_name",
    "shard_bytes",
    "shard_layout",
    "sharded_copy",
    "sharded_param",
    "time_link",
    "units",
    "unsharded_param",
    "unsharded_twin",
]


def _state(module: nn.Module) -> Any:
    get = getattr(module, "_get_fsdp_state", None)  # FSDPModule's, on every module fully_shard was given
    if get is None:
        return None
    try:
        return get()
    except Exception:  # a state torch changed: no unit found, see above
        return None


def fsdp_params(model: nn.Module) -> Iterator[Any]:
    """Every ``FSDPParam`` of the FSDP2 units in ``model`` (nothing for a model without ``fully_shard``)."""
    for module in model.modules():
        state = _state(module)
        group = getattr(state, "_fsdp_param_group", None)
        yield from getattr(group, "fsdp_params", ())


def is_sharded(model: nn.Module) -> bool:
    """Whether ``fully_shard`` was applied to ``model`` or a module in it."""
    return any(_state(module) is not None for module in model.modules())


def sharded_param(fsdp_param: Any) -> Tensor | None:
    """The sharded parameter (a DTensor) the module holds between steps."""
    return getattr(fsdp_param, "sharded_param", None)


def unsharded_param(fsdp_param: Any) -> Tensor | None:
    """The unsharded copy, once FSDP2 has made it (at the first forward); its storage is empty while the
    parameter is sharded."""
    return getattr(fsdp_param, "_unsharded_param", None)


def _roots(model: nn.Module) -> list[str]:
    """The names of the outermost modules ``fully_shard`` was given (``""`` for ``model`` itself)."""
    roots: list[str] = []
    for name, module in model.named_modules():  # parents before their children
        inside = any(root == "" or name.startswith(f"{root}.") for root in roots)
        if _state(module) is not None and not inside:
            roots.append(name)
    return roots


def explain_mixed_tensors(error: BaseException, model: nn.Module) -> str | None:
    """What to shard, when a step of an FSDP2 model failed with DTensor's "mixed torch.Tensor and DTensor":
    FSDP2 gathers a unit's parameters in that unit's forward, so a step that calls a submodule of the root
    directly (``self.model(...)`` in ``training_step`` with ``fully_shard(self)``) meets the root's own
    parameters still sharded. ``None`` for any other error."""
    if "mixed torch.Tensor and DTensor" not in str(error) or not is_sharded(model):
        return None
    roots = ", ".join(f"`self.{name}`" if name else "`self`" for name in _roots(model))
    return (
        f"The step used parameters FSDP2 had not gathered ({type(error).__name__}: mixed torch.Tensor and "
        f"DTensor). fully_shard's outermost unit ({roots}) gathers its own parameters (embeddings, final "
        "norm, head) only when its forward runs, and the step called a module inside it without that "
        "forward. Apply the last fully_shard to the module the step calls (e.g. fully_shard(self.model) "
        "instead of fully_shard(self) when training_step calls self.model(...)), or call self(...)."
    )


@contextlib.contextmanager
def fake_mesh(shape: int | Sequence[int], names: Sequence[str] | None = None) -> Iterator[Any]:
    """A device mesh of ``shape`` ranks (an int: one dimension; ``names``: its dimensions' names), this
    process rank 0, over torch's fake process group (collectives that move nothing): where a sharded step
    is simulated on fake tensors, as torchtitan's memory estimator runs FSDP2. Private torch API
    (``torch.testing._internal``), read here only.

    In a process without a process group the fake one is the default group for the simulation's length.
    In a running job (a Trainer's rank planning its sharded step) the job's group stays the default, and
    each dimension's group is a fake one beside it, registered as ``torch.distributed.new_group`` registers
    its groups (that function would ask every rank of the job to take part) and destroyed after. While the
    mesh is up, ``init_device_mesh`` answers with fake meshes of the same world
    (`fake_pg.fake_init_device_mesh`), so that a layout function building its own mesh (HSDP's (replicate,
    shard)) never reaches the job's ranks, and every mesh made is the simulation's own
    (`fake_pg._meshes_outside_fake_mode`). Raises `RuntimeError` where it cannot be had: torch has no fake
    process group, or its bookkeeping looks otherwise."""
    import torch
    import torch.distributed as dist

    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    names = None if names is None else tuple(names)
    world = math.prod(shape)
    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this torch build")
    try:
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError as error:  # a torch without them
        raise RuntimeError(f"this torch has no fake process group to simulate on ({error})") from error
    store, groups = FakeStore(), []
    if not dist.is_initialized():
        dist.init_process_group("fake", store=store, rank=0, world_size=world)

        def make(shape: tuple[int, ...], names: tuple[str, ...] | None) -> Any:
            with unfaked():  # the mesh's rank grid is real, in or out of the simulation's fake mode
                return init_device_mesh("cpu", shape, mesh_dim_names=names)

        try:
            with simulating(world, make):
                yield make(shape, names)
        finally:
            dist.destroy_process_group()
        return

    def make(shape: tuple[int, ...], names: tuple[str, ...] | None) -> Any:
        with unfaked():
            grid = torch.arange(math.prod(shape)).view(shape)
            lines = [grid.movedim(dim, -1).reshape(-1, shape[dim])[0].tolist() for dim in range(len(shape))]
            made = [side_group(line, store) for line in lines]
            groups.extend(made)
            return DeviceMesh.from_group(
                made if len(made) > 1 else made[0], "cpu", mesh=grid.tolist(), mesh_dim_names=names
            )

    try:
        with simulating(world, make):
            yield make(shape, names)
    finally:
        for group in groups:
            dist.destroy_process_group(group)


def bf16_policy() -> Any:
    """The ``MixedPrecisionPolicy`` `AutoFitStrategy` shards a ``bf16-mixed`` run with: parameters
    all-gathered and computed in bf16, gradients reduce-scattered in fp32 (torchtitan's default)."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def sharded_copy(model: nn.Module, mesh: Any, blocks: Sequence[str], **options: Any) -> nn.Module:
    """A copy of ``model`` (`model_copy`) with ``fully_shard`` on each of ``blocks`` (qualified names) and
    then on the root, over ``mesh``: the layout Lightning documents for FSDP2 (`shard_layout`). The
    original is untouched. ``options`` go to every ``fully_shard``."""
    copy = model_copy(model)
    shard_layout(copy, mesh, blocks, **options)
    return copy


def model_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model``'s modules and tensors, to apply a layout to; every other attribute shared, not
    copied (a data set held by a LightningModule is not duplicated), and the hooks' owners shared."""
    memo: dict[int, Any] = {}
    composable = _composable_keys()
    for module in model.modules():
        for key, value in vars(module).items():
            if key in _COPIED or key in composable or isinstance(value, nn.Module):
                continue
            memo[id(value)] = value  # shared with the original
    _share_hook_owners(model, memo)
    for t in itertools.chain(model.parameters(), model.buffers()):
        twin = _fake_twin(t)
        if twin is not None:
            memo[id(t)] = twin
    with warnings.catch_warnings():  # torch's Tensor.__deepcopy__ asks a fake tensor for its data pointer
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
        copy = deepcopy(model, memo)
    for original, twin in zip(model.modules(), copy.modules(), strict=True):
        for key, value in vars(original).items():  # what a __getstate__ leaves out (Lightning's trainer)
            if key in composable:  # torch's composable APIs' records: the copy's own (its fully_shard's)
                twin.__dict__[key] = type(value)(value)
            elif key not in _COPIED and not isinstance(value, nn.Module):
                twin.__dict__[key] = value
    return copy


def _fake_twin(t: Tensor) -> Tensor | None:
    """A new fake tensor like ``t`` in ``t``'s own fake mode (a parameter stays one), for a plain fake ``t``;
    ``None`` otherwise. ``deepcopy`` makes a fake tensor's copy in a fake mode of its own, which the
    simulation's mode then takes for a real input and fakes again at every op it meets: a new storage of
    the whole tensor each time, counted, and held where autograd saves the op's output (a weight's
    transpose). A layout that replaces every parameter (``fully_shard``) never stepped the copies; one that
    keeps some (tensor parallelism alone) did: +2.3 % at TP 4."""
    from torch._subclasses.fake_tensor import FakeTensor

    if type(t) is not FakeTensor:
        return None
    with t.fake_mode:
        twin = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    if isinstance(t, nn.Parameter):
        return nn.Parameter(twin, requires_grad=t.requires_grad)
    return twin.requires_grad_(t.requires_grad)


def _composable_keys() -> frozenset[str]:
    """The attributes where torch's composable APIs (``fully_shard``, ``checkpoint``, ``replicate``) record
    themselves on a module: its registry and its states (private; none on a torch without them)."""
    try:  # the module (``torch.distributed._composable.contract`` as an attribute is its function)
        contract = importlib.import_module("torch.distributed._composable.contract")
        return frozenset({contract.STATE_KEY, contract.REGISTRY_KEY})
    except (ImportError, AttributeError):
        return frozenset()


def _share_hook_owners(model: nn.Module, memo: dict[int, Any]) -> None:
    """Let a copy of ``model`` call the same hook objects: the object a bound-method hook is bound to, or a
    callable object, is shared unless it is one of the model's modules (those are copied with the model).
    A hook's owner can hold anything (a Trainer, a real tensor); copying it would copy that."""
    modules = {id(m) for m in model.modules()}
    for module in model.modules():
        for key in _HOOK_TABLES:
            for hook in getattr(module, key, {}).values():
                owner = getattr(hook, "__self__", None)
                if owner is None and not isinstance(hook, (types.FunctionType, functools.partial)):
                    owner = hook  # a callable object
                if owner is not None and id(owner) not in modules:
                    memo[id(owner)] = owner


def shard_layout(model: nn.Module, mesh: Any, blocks: Sequence[str], **options: Any) -> list[str]:
    """``fully_shard`` on each of ``blocks`` (qualified names) and then on the root, the smallest module
    holding every parameter (see `sharded_copy`), over ``mesh``, with ``options`` for each; returns the
    units' names, the root's last (``""`` for ``model`` itself). ``reshard_after_forward=True`` is left to
    FSDP2's default, which is that for every unit but the root (it keeps its parameters gathered to the
    backward; an explicit ``True`` would free and gather them again), as a plain ``fully_shard`` does."""
    from torch.distributed.fsdp import fully_shard

    if options.get("reshard_after_forward") is True:
        options = {key: value for key, value in options.items() if key != "reshard_after_forward"}

    for name in blocks:
        fully_shard(model.get_submodule(name), mesh=mesh, **options)
    fully_shard(_root(model), mesh=mesh, **options)
    return [*blocks, root_name(model)]


def root_name(model: nn.Module) -> str:
    """The qualified name of the smallest module holding every parameter (``""``: ``model`` itself)."""
    root = _root(model)
    return next(name for name, module in model.named_modules() if module is root)


def shard_bytes(module: nn.Module, world_size: int, itemsize: int | None = None) -> int:
    """Bytes of one rank's shards of ``module``'s parameters, as ``fully_shard`` cuts them (dim 0, padded
    to a multiple of ``world_size``), at ``itemsize`` bytes an element (default: the parameter's own)."""
    total = 0
    for p in module.parameters():
        rows = p.shape[0] if p.dim() else 1
        total += -(-rows // world_size) * (p.numel() // max(rows, 1)) * (itemsize or p.element_size())
    return total


def largest_unit_shard(
    model: nn.Module, blocks: Sequence[str], world_size: int, itemsize: int | None = None
) -> int:
    """The largest of one rank's shards of a unit of the layout `shard_layout` makes: a block's, or the
    root's own parameters (those in no block)."""
    per_block = [shard_bytes(model.get_submodule(name), world_size, itemsize) for name in blocks]
    root = shard_bytes(model, world_size, itemsize) - sum(per_block)
    return max([root, *per_block])


class Link(NamedTuple):
    """How fast a collective runs between the ranks: ``latency_s`` per collective, ``bytes_per_s`` of what
    each rank sends or receives."""

    latency_s: float
    bytes_per_s: float


#: Links assumed where none was timed: NVLink/InfiniBand-class GPUs (NCCL), and gloo between processes
#: of one machine (timed here: `time_link` on 2 CPU ranks).
LINKS = {"cuda": Link(30e-6, 50e9), "cpu": Link(LINK_CPU_LATENCY_S, LINK_CPU_BYTES_PER_S)}


def collective_seconds(
    param_bytes: int, grad_bytes: int, n_units: int, world_size: int, reshard_after_forward: bool, link: Link
) -> float:
    """Seconds of FSDP2's collectives in one micro-step: each unit's all-gather in forward, again in
    backward when it resharded after forward (not the root's, which keeps its parameters), and each unit's
    reduce-scatter of its gradients; a rank moves ``(N - 1) / N`` of the bytes of each."""
    share = (world_size - 1) / world_size
    gathers = n_units + (n_units - 1 if reshard_after_forward else 0)
    gathered = param_bytes * (2 if reshard_after_forward and n_units > 1 else 1)
    moved = share * (gathered + grad_bytes)
    return (gathers + n_units) * link.latency_s + moved / link.bytes_per_s


def time_link(group: Any = None, device: Any = "cpu", repeats: int = 5) -> Link:
    """The `Link` of ``group``, timed: all-gathers of 1 element (the latency) and of 4 MiB a rank (the
    bandwidth), the median of ``repeats`` each. A collective: every rank of ``group`` calls it."""
    import statistics
    import time

    import torch
    import torch.distributed as dist

    world = dist.get_world_size(group)

    def median_seconds(numel: int) -> float:
        local = torch.zeros(numel, device=device)
        out = torch.empty(numel * world, device=device)
        times = []
        for _ in range(repeats + 1):  # the first warms up
            if torch.device(device).type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            dist.all_gather_into_tensor(out, local, group=group)
            if torch.device(device).type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
        return statistics.median(times[1:])

    latency = median_seconds(1)
    numel = 2**20  # 4 MiB of fp32 a rank
    moved = 4 * numel * (world - 1)
    return Link(latency, moved / max(median_seconds(numel) - latency, 1e-9))


def unsharded_twin(model: nn.Module) -> tuple[nn.Module, dict[int, Tensor]]:
    """``model`` as it was before ``fully_shard``, to simulate its step where only the sharded model is at
    hand (an out-of-memory error's explanation, the end-of-fit advice), and what each of its tensors became.

    Every module is a new instance of its own class (FSDP2's ``FSDP<Class>`` dropped) with FSDP2's hooks
    left out and the other hooks (and an instance ``forward``: activation checkpointing's) copied onto the
    twin; each parameter, sharded or gathered, is one meta tensor of its global shape in the sharded
    parameter's dtype, each buffer a meta tensor; every other attribute is shared, not copied. The model is
    untouched; nothing is allocated. The dict maps ``id`` of each tensor of ``model`` (a sharded parameter
    and its unsharded copy alike) to its twin, for an optimizer over the sharded parameters."""
    import torch
    from torch.distributed.fsdp import FSDPModule

    def meta(t: Tensor) -> Tensor:
        twin = torch.empty(t.shape, dtype=t.dtype, device="meta")
        return nn.Parameter(twin, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else twin

    memo: dict[int, Any] = {}
    for fsdp_param in fsdp_params(model):
        sharded = sharded_param(fsdp_param)
        if sharded is None:
            continue
        twin = meta(sharded)
        for t in (sharded, unsharded_param(fsdp_param)):
            if t is not None:
                memo[id(t)] = twin
    for module in model.modules():
        for t in [*module._parameters.values(), *module._buffers.values()]:
            if t is not None and id(t) not in memo:
                memo[id(t)] = meta(t)
    tensors = dict(memo)
    for module in model.modules():
        cls = type(module)
        if isinstance(module, FSDPModule):
            cls = next(base for base in cls.__bases__ if base is not FSDPModule)
        memo[id(module)] = cls.__new__(cls)
    composable = _composable_keys()  # where fully_shard records itself on a module, beside other APIs
    _share_hook_owners(model, memo)
    for module in model.modules():
        twin_state: dict[str, Any] = {}
        for key, value in vars(module).items():
            if key in _LAYOUT_MARKS:  # tensor parallelism's record that it was applied: the twin is unsplit
                continue
            if key in composable:
                value = type(value)(
                    (k, v) for k, v in value.items() if not _from_fsdp(k) and not _from_fsdp(v)
                )
            elif key in ("_parameters", "_buffers", "_modules"):
                value = {name: None if v is None else memo[id(v)] for name, v in value.items()}
            elif key in _COPIED:
                if isinstance(value, dict):
                    value = type(value)((k, v) for k, v in value.items() if not _from_fsdp(v))
                value = deepcopy(value, memo)
            twin_state[key] = value
        memo[id(module)].__dict__.update(twin_state)
    return memo[id(model)], tensors


def over_twins(optimizer: Any, tensors: dict[int, Tensor]) -> Any:
    """A shallow copy of ``optimizer`` whose param groups hold the twins (`unsharded_twin`'s ``tensors``) of
    its parameters: to be read by a simulation (its class, hyperparameters and groups), never stepped."""
    from copy import copy

    twin = copy(optimizer)
    twin.param_groups = [
        {**group, "params": [tensors.get(id(p), p) for p in group["params"]]}
        for group in optimizer.param_groups
    ]
    return twin


def _from_fsdp(thing: Any) -> bool:
    """Whether ``thing`` (a hook: a function, a bound method or a ``functools.partial`` of one; a
    composable API's registry key or state) is FSDP2's or tensor parallelism's (``distribute_module``'s
    input and output hooks): a layout the twin leaves out, to be applied to it again."""
    if isinstance(thing, str):  # the composable registry's key
        return thing == "fully_shard"
    function = getattr(thing, "func", thing)
    module = getattr(function, "__module__", None)
    if not isinstance(module, str):
        module = type(function).__module__
    return module.startswith(("torch.distributed.fsdp", "torch.distributed.tensor"))


def units(model: nn.Module) -> list[str]:
    """The names of the modules ``fully_shard`` was given, parents after their children (as they are
    sharded)."""
    names = [name for name, module in model.named_modules() if _state(module) is not None]
    return sorted(names, key=lambda name: -(name.count(".") + bool(name)))  # the deepest first, stably


def _root(model: nn.Module) -> nn.Module:
    """The smallest module holding all of ``model``'s parameters: down through modules without parameters
    of their own and a single child with parameters."""
    module = model
    while not any(True for _ in module.parameters(recurse=False)):
        holders = [child for child in module.children() if any(True for _ in child.parameters())]
        if len(holders) != 1:
            break
        module = holders[0]
    return module


#: What a module's copy gets its own of: its tensors and children, the hook tables fully_shard adds to,
#: and an instance ``forward`` (activation checkpointing's wrapper holds the module it runs).
_COPIED = frozenset(
    {
        "_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "forward",
        "_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
        "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks",
        "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
        "_load_state_dict_post_hooks",
    }
)  # fmt: skip

#: What a layout marks a module with, left off its unsharded twin (`unsharded_twin`), which is laid out
#: again: ``distribute_module``'s (tensor parallelism's) "already distributed" flag.
_LAYOUT_MARKS = frozenset({"_distribute_module_applied"})

#: The hook tables among what a module's copy gets its own of (`_share_hook_owners` reads them).
_HOOK_TABLES = tuple(key for key in _COPIED if key.endswith("hooks"))
