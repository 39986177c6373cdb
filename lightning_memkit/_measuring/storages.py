"""What memory tensors hold, read the way the allocator counts it: the plain tensors behind a tensor (a
DTensor's local shard, a quantized tensor's data and scales, a sparse tensor's members), their distinct
storages in the allocator's rounding, and the tensors a model, its optimizers, its gradients and a batch
hold. `Storage` is one storage's record in a measured step (`_measuring.tracker`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from lightning_memkit._measuring import _torch_private

# The CUDA caching allocator hands out blocks in multiples of 512 bytes; max_memory_allocated counts
# the rounded sizes, so the tracker must too. The CPU allocator counts the bytes asked for.
_CUDA_BLOCK = 512


def allocation_rounding(device: torch.device) -> int:
    """Bytes the allocator rounds each block up to on ``device``: 512 on CUDA, 1 elsewhere."""
    return _CUDA_BLOCK if device.type == "cuda" else 1


def rounded(nbytes: int, rounding: int) -> int:
    """``nbytes`` rounded up to a multiple of ``rounding``."""
    return -(-nbytes // rounding) * rounding


def _iter_tensors(obj: Any) -> Iterator[Tensor]:
    """Tensors in an op's args/kwargs/outputs (flat tuples, lists and dicts: what aten ops take)."""
    if isinstance(obj, Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            if isinstance(item, Tensor):
                yield item
            elif isinstance(item, (list, tuple, dict)):
                yield from _iter_tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _iter_tensors(item)


def batch_tensors(batch: Any) -> Iterator[Tensor]:
    """The tensors of a training batch however it is nested: mappings (``dict``, ``UserDict`` and so Hugging
    Face's ``BatchEncoding``), lists, tuples, sets and dataclasses; an object met twice is read once."""
    seen: set[int] = set()
    stack = [batch]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, Tensor):
            yield obj
        elif isinstance(obj, Mapping):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            stack.extend(getattr(obj, f.name, None) for f in dataclasses.fields(obj))


def optimizer_tensors(optimizers: Iterable[torch.optim.Optimizer]) -> Iterator[Tensor]:
    """Every tensor held in the optimizers' ``state`` (moments, 8-bit states, scales, step counters)."""
    for optimizer in optimizers:
        for state in optimizer.state.values():
            yield from state_tensors(state)


def state_tensors(state: Any) -> Iterator[Tensor]:
    """The tensors of one parameter's optimizer state (a dict of tensors, numbers, nested containers)."""
    yield from _iter_tensors(state)


def model_tensors(model: nn.Module) -> Iterator[Tensor]:
    """The model's parameters with their quantization state (`quantization_state`), and its buffers."""
    for p in model.parameters():
        yield p
        yield from quantization_state(p)
    yield from model.buffers()
    yield from layer_quantization_state(model)


#: Where bitsandbytes keeps a quantized parameter's state: ``Params4bit.quant_state`` (a ``QuantState``),
#: ``Int8Params.CB`` (its int8 data) and ``.SCB`` (the row scales). Read by name: bitsandbytes is not
#: imported here.
_QUANTIZED_ATTRIBUTES = ("quant_state", "CB", "SCB")


def quantization_state(t: Tensor) -> Iterator[Tensor]:
    """The tensors a quantized parameter keeps beside its data, memory of that parameter: a bitsandbytes
    ``Params4bit``'s ``quant_state`` (the blocks' ``absmax``, the ``code`` table; with double quantization
    the ``offset`` and ``state2``'s own absmax and code) and an ``Int8Params``' ``CB`` and ``SCB``. A plain
    tensor has none."""
    if type(t) in (Tensor, nn.Parameter):
        return
    for name in _QUANTIZED_ATTRIBUTES:
        yield from _state_tensors(getattr(t, name, None))


def layer_quantization_state(model: nn.Module) -> Iterator[Tensor]:
    """The tensors quantized layers keep outside their parameters: bitsandbytes' ``Linear8bitLt`` moves
    its weight's ``CB`` and ``SCB`` into its ``state`` (a ``MatmulLtState``) at its first forward, and a
    ``Linear4bit`` keeps its weight's ``quant_state`` too, the one copy left where the weight is no longer a
    ``Params4bit`` (FSDP2's sharded DTensor); the same tensors as the weight's where it is."""
    for module in model.modules():
        state = getattr(module, "state", None)
        if type(state).__name__ == "MatmulLtState":
            yield from (t for t in vars(state).values() if isinstance(t, Tensor))
        if not isinstance(module, Tensor):
            yield from _state_tensors(getattr(module, "quant_state", None))


def _state_tensors(value: Any) -> Iterator[Tensor]:
    """The tensors of a bitsandbytes ``QuantState`` (its nested ``state2`` too), or ``value`` if a tensor."""
    if isinstance(value, Tensor):
        yield value
    elif type(value).__name__ == "QuantState":
        for item in vars(value).values():
            yield from _state_tensors(item)


def gradient_tensors(model: nn.Module) -> Iterator[Tensor]:
    for p in model.parameters():
        if p.grad is not None:
            yield p.grad


@functools.cache
def _wraps(cls: type) -> bool:
    """Whether tensors of class ``cls`` wrap others (DTensor); asked once per class, on the per-op path."""
    return _torch_private.wraps_tensors(cls)


#: How to read the member tensors of each sparse layout: a sparse tensor has no storage of its own.
_SPARSE_MEMBERS: dict[torch.layout, tuple[str, ...]] = {
    torch.sparse_coo: ("_indices", "_values"),
    torch.sparse_csr: ("crow_indices", "col_indices", "values"),
    torch.sparse_bsr: ("crow_indices", "col_indices", "values"),
    torch.sparse_csc: ("ccol_indices", "row_indices", "values"),
    torch.sparse_bsc: ("ccol_indices", "row_indices", "values"),
}


def _sparse_members(t: Tensor) -> Iterator[Tensor]:
    """The dense tensors a sparse ``t`` keeps its memory in (COO: indices and values; compressed layouts:
    the compressed and plain indices and the values), read without any dispatch mode seeing it: they are
    views of its members, so the allocator sees them as ``t``'s own allocations."""
    with _torch_private.disable_torch_dispatch():
        members = [getattr(t, name)() for name in _SPARSE_MEMBERS[t.layout]]
    yield from members


def leaves(t: Tensor) -> Iterator[Tensor]:
    """The plain tensors that hold ``t``'s memory: ``t`` itself, the inner tensors of a tensor subclass
    that wraps others (a DTensor's local shard, a quantized tensor's data and scales), read through its
    ``__tensor_flatten__``, or a sparse tensor's members (`_SPARSE_MEMBERS`). A wrapper's own storage is
    its global size with no data: not memory here."""
    if t.layout in _SPARSE_MEMBERS:
        for member in _sparse_members(t):
            yield from leaves(member)
        return
    if not _wraps(type(t)):
        yield t
        return
    names, _ = t.__tensor_flatten__()
    for name in names:
        inner = getattr(t, name)
        if isinstance(inner, Tensor):  # DTensor names its device mesh too
            yield from leaves(inner)


def storage_bytes(tensors: Iterable[Tensor], device: torch.device | str | None = None) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views and tied weights counted once; a sharded
    DTensor by its local shard).

    With ``device``, only tensors on that device count, in the allocator's rounding for it; a device without
    an index (``"cuda"``) takes every device of its type.
    """
    seen: set[int] = set()
    total = 0
    device = None if device is None else torch.device(device)
    for t in (leaf for tensor in tensors for leaf in leaves(tensor)):
        if device is not None and not _on(t.device, device):
            continue
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in seen:
            continue
        seen.add(ptr)
        total += rounded(storage.nbytes(), allocation_rounding(t.device))
    return total


def _on(place: torch.device, device: torch.device) -> bool:
    return place.type == device.type and device.index in (None, place.index)


class Storage:
    """One storage's life inside the measured step. ``clock`` values are op counts."""

    __slots__ = (
        "__weakref__", "born_in", "category", "frozen", "grad_at", "kind", "nbytes", "origin", "saved_at"
    )  # fmt: skip

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        #: what a sharded step holds it as (`_sharding.accounting.SHARDED_KINDS`), where FSDP2 runs;
        #: ``None`` elsewhere
        self.kind: str | None = None
        self.origin: Any = None  # what created it, when a tracer asks (`_estimating.simulate.trace_step`)
        self.category: str | None = None  # "parameters" / "optimizer_state", fixed by identity
        #: a parameter's storage that no gradient reaches (a frozen weight, its quantization state, a buffer)
        self.frozen = False
        self.grad_at: int | None = None  # clock when it became some parameter's .grad
        self.saved_at: int | None = None  # clock when autograd first saved it for backward
        #: the sequence number of the backward node whose ops made it; ``None`` outside the backward
        self.born_in: int | None = None


def model_device(model: nn.Module) -> torch.device:
    """Where ``model`` runs: the device of its first parameter or buffer not on the meta device.

    A model entirely on the meta device is planned for the GPU (``cuda``), as `estimate_memory` assumes;
    one without tensors for the CPU.
    """
    on_meta = False
    for t in model_tensors(model):
        if t.device.type != "meta":
            return t.device
        on_meta = True
    return torch.device("cuda" if on_meta else "cpu")
