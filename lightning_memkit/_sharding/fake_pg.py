"""The patches of torch a sharded step simulated over its fake process group needs (`fsdp2.fake_mesh`).

Each part is a patch of private torch API, installed for the simulation's length and restored after, and a
no-op where torch looks otherwise: ``init_device_mesh`` answered with fake meshes of the simulated world,
device meshes built on real tensors and kept apart from a running job's, DTensor's sharding propagation
out of the tracker's sight, FSDP2's chunks made only as the simulated rank reads them, and fake process
groups beside a running job's own.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator, Sequence
from typing import Any

from torch import Tensor

__all__ = ["fake_init_device_mesh", "side_group", "simulating", "unfaked"]


@contextlib.contextmanager
def simulating(world: int, make: Any) -> Iterator[None]:
    """What a simulation on the fake mesh needs from torch (private API; each part a no-op where torch
    looks otherwise): FSDP2's chunks made as read (`_Chunks`), device meshes built on real tensors inside
    the fake mode (FSDP2 joins a tensor-parallel mesh to its own when it shards a DTensor), and
    ``init_device_mesh`` answered with fake meshes (`fake_init_device_mesh`)."""
    answered = fake_init_device_mesh(world, make)
    with _rank_zero_chunks(), _meshes_outside_fake_mode(), _propagation_unseen(), answered:
        yield


@contextlib.contextmanager
def fake_init_device_mesh(world: int, make: Any) -> Iterator[Any]:
    """``torch.distributed``'s ``init_device_mesh`` answering with ``make(shape, names)``, a fake mesh, for
    the length of the block; returns the stand-in, to bind where a function imported the original (see
    `_sharding.layout.laid_out_copy`). A mesh of another world than the simulated one is refused: the
    layout was asked for ``world`` ranks."""
    import torch.distributed as dist
    import torch.distributed.device_mesh as device_mesh

    original = device_mesh.init_device_mesh

    def init_device_mesh(device_type: str, mesh_shape: tuple[int, ...], *, mesh_dim_names=None, **_: Any):
        if math.prod(mesh_shape) != world:
            raise ValueError(
                f"The layout built a device mesh of {math.prod(mesh_shape)} ranks {tuple(mesh_shape)}, but "
                f"the step is simulated for {world}: give the simulation that world size."
            )
        return make(tuple(mesh_shape), None if mesh_dim_names is None else tuple(mesh_dim_names))

    init_device_mesh.original = original  # type: ignore[attr-defined]
    holders = [device_mesh, *([dist] if getattr(dist, "init_device_mesh", None) is original else [])]
    for holder in holders:
        holder.init_device_mesh = init_device_mesh
    try:
        yield init_device_mesh
    finally:
        for holder in holders:
            holder.init_device_mesh = original


@contextlib.contextmanager
def unfaked() -> Iterator[None]:
    """Real tensors for the block, inside a fake mode (a device mesh's rank grid)."""
    try:
        from torch._subclasses.fake_tensor import unset_fake_temporarily
    except ImportError:
        yield
        return
    with unset_fake_temporarily():
        yield


@contextlib.contextmanager
def _propagation_unseen() -> Iterator[None]:
    """DTensor's sharding propagation out of the simulation's sight: it runs each new op signature once on
    fake tensors of the global shape to learn the output's shape (``ShardingPropagator.
    _propagate_tensor_meta_non_cached``, private), in the fake mode it finds, which is the simulation's;
    the tracker then counted those ops in the first step that met them, and not in the next (cached), so
    the repeated blocks' steps did not line up. Run with the dispatch modes off, the propagation makes its
    own fake mode, as on a GPU run."""
    try:
        from torch.distributed.tensor._sharding_prop import ShardingPropagator
        from torch.utils._python_dispatch import _disable_current_modes
    except ImportError:
        yield
        return
    own = getattr(ShardingPropagator, "_propagate_tensor_meta_non_cached", None)
    if own is None:
        yield
        return

    @functools.wraps(own)
    def unseen(self: Any, *args: Any, **kwargs: Any) -> Any:
        with _disable_current_modes():
            return own(self, *args, **kwargs)

    ShardingPropagator._propagate_tensor_meta_non_cached = unseen
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = own


@contextlib.contextmanager
def _meshes_outside_fake_mode() -> Iterator[None]:
    """Every ``DeviceMesh`` made while simulating built on real tensors, and the simulation's own.

    Real tensors: FSDP2 joins a tensor-parallel mesh to its own (``DeviceMesh._concatenate``) when it
    shards a DTensor, inside the fake mode, which cannot compute a fake grid's coordinates (a
    data-dependent ``nonzero``). Its own: DTensor caches its sharding decisions by mesh, and meshes compare
    by shape, dimension names, device type and ``_thread_id`` (private; ``None`` outside torch's threaded
    test backend), not by process group; a fake mesh of the run's shape would stand in for the run's (the
    run's ops handed fake groups that no longer exist) and the run's for the fake one (a simulation's
    collective waiting for ranks that never come). Each simulation's meshes get a ``_thread_id`` of their
    own, so no cached decision crosses between a simulation and a run, or two simulations."""
    from torch.distributed.device_mesh import DeviceMesh

    own = DeviceMesh.__init__
    _meshes_outside_fake_mode.count = getattr(_meshes_outside_fake_mode, "count", 0) + 1
    identity = ("lightning_memkit simulation", _meshes_outside_fake_mode.count)

    @functools.wraps(own)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        with unfaked():
            own(self, *args, **kwargs)
        if hasattr(self, "_thread_id"):
            self._thread_id = identity
            self.__dict__.pop("_hash", None)

    DeviceMesh.__init__ = __init__
    try:
        yield
    finally:
        DeviceMesh.__init__ = own


class _Chunks(Sequence):
    """``torch.chunk(tensor, n, dim)`` padded with empty chunks to ``n`` (FSDP2's ``_chunk_with_empty``),
    each chunk made when read: the simulated rank (0) reads its own and chunk 0, so sharding costs the same
    at 8 ranks as at 100,000 (made eagerly, the other ranks' chunks are one fake op each per parameter)."""

    def __init__(self, tensor: Tensor, n: int, dim: int) -> None:
        self.tensor, self.n, self.dim = tensor, n, dim
        rows = tensor.size(dim)
        self.rows_per_chunk = -(-rows // n)  # torch.chunk's: ceil(rows / n)
        self.made = -(-rows // self.rows_per_chunk) if rows else 1  # chunks torch.chunk returns

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self.n))]
        i = i + self.n if i < 0 else i
        if not 0 <= i < self.n:
            raise IndexError(i)
        if i >= self.made:
            return self[0].new_empty(0)
        start = i * self.rows_per_chunk
        rows = min(self.rows_per_chunk, self.tensor.size(self.dim) - start)
        return self.tensor.narrow(self.dim, start, rows)


@contextlib.contextmanager
def _rank_zero_chunks() -> Iterator[None]:
    """FSDP2 shards each parameter through `_Chunks` while the fake mesh is up (private torch API; a torch
    whose FSDP2 does not chunk so keeps its own)."""
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_param
    except ImportError:
        yield
        return
    if not hasattr(_fsdp_param, "_chunk_with_empty"):
        yield
        return
    own, _fsdp_param._chunk_with_empty = _fsdp_param._chunk_with_empty, _Chunks
    try:
        yield
    finally:
        _fsdp_param._chunk_with_empty = own


def side_group(ranks: list[int], store: Any) -> Any:
    """A fake process group of the global ``ranks`` (this process the first) beside the job's own."""
    import torch.distributed.distributed_c10d as c10d

    side_group.count = getattr(side_group, "count", 0) + 1
    try:
        group, _ = c10d._new_process_group_helper(
            len(ranks), 0, list(ranks), "fake", store,
            group_name=f"lightning_memkit_simulation_{side_group.count}", timeout=c10d.default_pg_timeout,
        )  # fmt: skip
        c10d._world.pg_group_ranks[group] = {rank: i for i, rank in enumerate(ranks)}
    except Exception as error:  # torch's bookkeeping changed: see the docstring
        raise RuntimeError(
            "a process group is already initialized in this process, and this torch does not let the "
            f"simulated sharded step have a fake one beside it ({type(error).__name__}: {error}): estimate "
            "before torch.distributed.init_process_group, or in another process (memkit estimate --gpus N "
            "--strategy fsdp2)"
        ) from error
    return group
