"""Measure one training step's peak memory and split it into categories, exactly.

How: a `TorchDispatchMode` sees every op of the step (forward, backward and ``optimizer.step()``), so
every storage an op allocates is seen when it is born, and a weak reference tells when it dies. The
running sum of live storages gives the peak, op by op, and a snapshot of what was live at that moment.
Categories are assigned afterwards from identity, not guessed from sizes:

* parameters and buffers, optimizer state: the storages the model and optimizer hold (a quantized weight's
  quantization state is its parameter's; each parameter is trainable or frozen, for `parameter_split`);
* gradients: storages that became some parameter's ``.grad`` (post-accumulate-grad hooks) before the
  peak;
* activations: storages that autograd saved for backward (saved-tensor hooks) before the peak;
* temporary: everything else that was live at the peak.

Some CPU kernels (oneDNN convolutions, 16-bit matmuls, flash attention) allocate buffers straight from
the allocator, where no op shows them; for those ops the kernel's own highest allocation is measured once
per shape in a helper process (`_measuring.kernels`) and counted as ``temporary``.

This is the accounting of torch's own allocator trace: on CPU it agrees with torch.profiler's memory
timeline (the tests hold it to 0.1 %), and on CUDA the peak itself is read from the caching allocator
(``torch.cuda.max_memory_allocated``), so allocator-only buffers such as cuBLAS workspaces land in
``temporary``. The per-op bookkeeping is Python, so a measured step costs more than a plain one:
`MemoryMonitor` measures only the steps it has not seen the like of (see there).

Watching must not change the step. Four things the tracker's mode and hooks would otherwise change:

* torch.compile: dynamo refuses to compile a frame first called under a dispatch mode, and never tries it
  again. The tracker declares ``ignore_compile_internals``: compiled code compiles and runs as it would
  unwatched (bit-identical, the same frames, graphs and graph breaks). Its extern kernels and fallback ops
  are seen as ops; the buffers its generated code allocates, which bypass the dispatcher, are reported by
  inductor's allocation fast paths while a tracker watches (`_compiled_allocator`), so a compiled step is
  followed buffer by buffer (compiled tiny LLaMA and CNN steps: within 0.002 % of the CPU allocator's own
  count). While torch.compile compiles with the tracker on the mode stack (a module under DDP), the
  tracker steps aside (`_compiling`). A batch that only generated kernels read is seen where it is given
  (``measure(..., batch=)``, as `MemoryMonitor` does). The tracker's own hooks (saved tensors, gradients,
  weak references) run from eager code that dynamo may be watching, after a graph break or under a frame
  it skips: dynamo is told to skip this package (`_hidden_from_dynamo`), or it would compile them, break
  graphs in them and recompile them.
* torch.func: its transforms refuse to run under saved-tensor hooks. The tracker's hooks step aside for the
  transform and the measurement is marked ``unfollowed`` (what the transform saved is not seen);
  `MemoryMonitor` leaves such steps unmeasured.
* autograd's in-place check: a tensor saved through hooks is not version-checked by autograd, so the
  tracker's unpack hook checks it and raises autograd's own error.
* autograd's gradient sums: where two gradients reach one input, the engine adds the second into the
  first in place when it holds the first's only reference, but out of place whenever a dispatch mode is
  on (``at::isTensorSubclassLike`` says yes to every tensor then). The watched step holds both operands
  and the new sum for a moment, which the plain step never does: a packed sequence's LSTM (every time step
  a slice of the hidden state, its gradients summed step by step) read 4.5 % high. The tracker recognises
  the engine's sums (`_engine_sum`) and counts one as made in place when its first operand dies at once,
  the reference the engine held being the only one (see `_settle`). The watched step still makes the
  extra buffer: on CUDA, where the peak is read from the allocator, such a step may still read high.

Nor must its own errors reach the step: an exception of the bookkeeping inside the step (in an op, a
saved-tensor or gradient hook) is kept in `MemoryMeasurement.failure`, the op's result goes back untouched,
and nothing more is followed. A sparse tensor has no storage of its own: it counts as its members
(indices and values), which the allocator holds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import sys
import threading
import weakref
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch._prims_common import is_non_overlapping_and_dense_or_false
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _get_current_dispatch_mode_stack,
    is_traceable_wrapper_subclass_type,
)

from lightning_memkit._breakdown import MemoryBreakdown
from lightning_memkit._measuring.kernels import hides_memory, kernel_peak
from lightning_memkit._sharding import fsdp2

__all__ = ["MemoryMeasurement", "gradient_consumed", "measure", "storage_bytes"]

#: What a sharded (FSDP2) step's peak holds, each with the one of the five categories it is part of: the
#: sharded parameters and the unsharded copies in flight, the sharded gradients after their reduce-scatter
#: and the unsharded ones before it, and the collectives' buffers.
SHARDED_KINDS = {
    "sharded_parameters": "parameters",
    "unsharded_parameters": "parameters",
    "sharded_gradients": "gradients",
    "unsharded_gradients": "gradients",
    "communication": "temporary",
}
#: The op the autograd engine sums two gradients of one input with, under a dispatch mode.
_ADD = torch.ops.aten.add.Tensor
#: Ops autograd's formulas run out of place into zeros they just made, where unwatched they write into
#: them in place: ``index``'s backward (``index_put``, accumulating), ``gather``'s (``scatter_add``) and
#: ``index_select``'s (``index_add``) take the out-of-place variant when any tensor is subclass-like, and
#: under a dispatch mode every tensor is (``areAnyTensorSubclassLike``).
_SCATTERED = frozenset(
    {torch.ops.aten.index_put.default, torch.ops.aten.scatter_add.default, torch.ops.aten.index_add.default}
)
#: Op namespaces of collectives and FSDP2's copies in and out of them.
_COLLECTIVES = frozenset({"c10d", "_c10d_functional", "fsdp"})


@functools.cache
def _collective(func: Any) -> bool:
    return getattr(func, "namespace", None) in _COLLECTIVES


#: Ops whose outputs' shapes come from their inputs' values, without torch's tag for it: a packed
#: sequence's (its lengths).
_VALUE_SHAPED = frozenset({torch.ops.aten._pack_padded_sequence.default})


@functools.cache
def _may_size_by_values(func: Any) -> bool:
    """Whether ``func`` can size its outputs by its inputs' values (once per op: every op of a measured step
    asks)."""
    return func in _VALUE_SHAPED or torch.Tag.dynamic_output_shape in getattr(func, "tags", ())


def _value_shaped(func: Any, args: tuple) -> bool:
    """Whether ``func``'s outputs are sized by its inputs' values (``nonzero``, a boolean mask's
    selection, a packing by lengths): then a step of the same shapes may allocate otherwise."""
    if not _may_size_by_values(func):
        return False
    if func is torch.ops.aten.index.Tensor:  # integer indices give a shape of their own: only masks count
        indices = args[1] if len(args) > 1 else ()
        return any(isinstance(i, Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices)
    return True


def _reduce_scatters() -> frozenset:
    """The in-place reduce-scatter ops (their first argument is the output), where torch has them."""
    c10d = getattr(torch.ops, "c10d", None)
    names = ("_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_")
    return frozenset(getattr(c10d, n).default for n in names if c10d is not None and hasattr(c10d, n))


_REDUCE_SCATTERS = _reduce_scatters()

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
    return is_traceable_wrapper_subclass_type(cls)


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
    with torch._C._DisableTorchDispatch():
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
        #: what a sharded step holds it as (`SHARDED_KINDS`), where FSDP2 runs; ``None`` elsewhere
        self.kind: str | None = None
        self.origin: Any = None  # what created it, when a tracer asks (`_estimating.simulate.trace_step`)
        self.category: str | None = None  # "parameters" / "optimizer_state", fixed by identity
        #: a parameter's storage that no gradient reaches (a frozen weight, its quantization state, a buffer)
        self.frozen = False
        self.grad_at: int | None = None  # clock when it became some parameter's .grad
        self.saved_at: int | None = None  # clock when autograd first saved it for backward
        #: the sequence number of the backward node whose ops made it; ``None`` outside the backward
        self.born_in: int | None = None


class Tracker(TorchDispatchMode):
    """Follows storage lifetimes on one device; keeps the live set at the highest point."""

    #: whether fake tensors are storages of the step (the simulator's) or of a simulation run inside it
    counts_fakes = False
    #: whether the CPU RNG states checkpointing keeps are on this tracker's device
    counts_rng_states = True

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Let torch.compile compile and run its graphs while we watch. Dynamo refuses to compile a frame
        first called under any other dispatch mode, and never compiles it afterwards: the monitor would
        turn compilation off for the whole run. The compiled code's own intermediates bypass the
        dispatcher; its inputs, outputs and saved tensors are still seen (see `measure`)."""
        return True

    def __init__(self, device: torch.device, *, survives_errors: bool = False) -> None:
        super().__init__()
        self.device = device
        self.rounding = allocation_rounding(device)
        self.clock = 0
        self.live: dict[int, tuple[weakref.ref, Storage]] = {}
        self.current = 0
        self.peak = 0
        self.peak_clock = 0
        self.peak_live: list[Storage] = []
        #: the phase of the step running now, as the caller names it (`enter_phase`); ``None``: not followed
        self.named_phase: str | None = None
        #: the highest total in each phase entered so far (bytes): their maximum is `peak`
        self.phase_peaks: dict[str, int] = {}
        #: why the step could not be followed (a torch.func transform turned saved-tensor hooks off)
        self.unfollowed: str | None = None
        #: the first op whose outputs were sized by the values of its inputs (`_value_shaped`), or ``None``:
        #: another step of the same shapes may then allocate otherwise (`MemoryMonitor` measures each)
        self.value_shaped: str | None = None
        self._hooks: tuple[Any, Any] | None = None
        #: whether what CPU kernels allocate outside the dispatcher (`_measuring.kernels`) is this device's
        #: memory
        self.counts_cpu_kernels = device.type == "cpu"
        #: the sizes of `peak_live`'s storages at the peak, once a storage has been resized in the step
        #: (FSDP2's unsharded parameters): a record's ``nbytes`` is its size now, not then
        self.peak_nbytes: list[int] | None = None
        self._waiting = 0  # inside a collective's Work.wait() (see `_wait`)
        #: whether an error of the bookkeeping inside the step is kept in `failure` rather than raised there
        self.survives_errors = survives_errors
        #: the error the bookkeeping hit inside the step, if any: nothing is followed after it
        self.failure: Exception | None = None
        #: the backward node whose op is being recorded (its sequence number; see `Storage.born_in`)
        self._node: int | None = None
        #: an engine's gradient sum just made (`_engine_sum`): its first operand's storage key, until the
        #: next event says whether that operand died with it (see `_settle`)
        self._summed: int | None = None

    # --- bookkeeping --------------------------------------------------------------------------

    def record(self, t: Tensor, *, preexisting: bool = False) -> Storage | None:
        """The record of ``t``'s storage, registering it if this is the first sight of it. A tensor
        subclass wrapping others (DTensor) is its inner tensors, a sparse tensor its members: the record
        of the last is returned."""
        if t.device != self.device:
            return None
        if _wraps(type(t)) or t.layout in _SPARSE_MEMBERS:
            rec = None
            for leaf in leaves(t):
                rec = self.record(leaf, preexisting=preexisting)
            return rec
        if not self.counts_fakes and _is_fake(t):  # a simulation run inside a measured step
            return None
        storage = t.untyped_storage()
        entry = self.live.get(id(storage))
        if entry is not None:
            return entry[1]
        if self._waiting and preexisting:
            # A collective's own buffer (gloo allocates it in its worker thread, where no op is seen), first
            # seen as its Work finishes: born in the step, not live since its start.
            rec = self._register(storage, rounded(storage.nbytes(), self.rounding), preexisting=False)
            rec.kind = "communication"
            return rec
        return self._register(storage, rounded(storage.nbytes(), self.rounding), preexisting=preexisting)

    def records(self, t: Tensor, *, preexisting: bool = False) -> Iterator[Storage]:
        """The records of every storage holding ``t`` (several for some tensor subclasses)."""
        for leaf in leaves(t):
            rec = self.record(leaf, preexisting=preexisting)
            if rec is not None:
                yield rec

    def _register(self, storage: torch.UntypedStorage, nbytes: int, *, preexisting: bool) -> Storage:
        self._settle()
        rec = Storage(nbytes)
        rec.born_in = self._node
        key = id(storage)
        self.live[key] = (weakref.ref(storage, lambda _, key=key: self._free(key)), rec)
        self.current += nbytes
        if preexisting:
            # It was live since the step began, so it was live at the highest point seen so far too.
            self.peak += nbytes
            for phase in self.phase_peaks:  # and at each phase's
                self.phase_peaks[phase] += nbytes
            self.peak_live.append(rec)
            if self.peak_nbytes is not None:
                self.peak_nbytes.append(nbytes)
        return rec

    def on_resize(self, storage: torch.UntypedStorage, before: int) -> None:
        """``storage.resize_`` ran, from ``before`` bytes: how FSDP2 allocates and frees the unsharded
        parameters, which no dispatch mode sees."""
        if self.failure is not None:
            return
        try:
            self._resized(storage, before)
        except Exception as err:
            self._broke(err)

    def _resized(self, storage: torch.UntypedStorage, before: int) -> None:
        entry = self.live.get(id(storage))
        if entry is None:
            # A fake tensor's storage is on the meta device: the simulator's (counts_fakes) are its own.
            mine = storage.device == self.device or (self.counts_fakes and storage.device.type == "meta")
            if not mine or (before == 0 and storage.nbytes() == 0):
                return
            rec = self._register(storage, rounded(before, self.rounding), preexisting=before > 0)
        else:
            rec = entry[1]
        if self.peak_nbytes is None:  # from now on the sizes at the peak are kept as well
            self.peak_nbytes = [r.nbytes for r in self.peak_live]
        nbytes = rounded(storage.nbytes(), self.rounding)
        self.current += nbytes - rec.nbytes
        rec.nbytes = nbytes
        self.clock += 1
        self._check_peak()

    def ignore(self, t: Tensor) -> None:
        """Count ``t``'s storage as zero bytes (a simulation's tensor that the real run keeps on another
        device)."""
        storage, key = t.untyped_storage(), id(t.untyped_storage())
        if key not in self.live:
            self.live[key] = (weakref.ref(storage, lambda _, key=key: self._free(key)), Storage(0))

    def _free(self, key: int) -> None:
        self._settle(freed=key)
        entry = self.live.pop(key, None)
        if entry is not None:
            self.current -= entry[1].nbytes

    def enter_phase(self, phase: str) -> None:
        """From now on the step is in ``phase`` (forward, backward, optimizer step: the caller's names; a
        phase entered again goes on with its highest): `phase_peaks` keeps each phase's highest total."""
        self._settle()
        self.named_phase = phase
        self.phase_peaks[phase] = max(self.phase_peaks.get(phase, 0), self.current)

    def _check_peak(self) -> None:
        self._settle()
        if self.named_phase is not None and self.current > self.phase_peaks[self.named_phase]:
            self.phase_peaks[self.named_phase] = self.current
        if self.current > self.peak:
            self.peak = self.current
            self.peak_clock = self.clock
            self.peak_live = [rec for _, rec in self.live.values()]
            if self.peak_nbytes is not None:
                self.peak_nbytes = [rec.nbytes for rec in self.peak_live]

    # --- hooks --------------------------------------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        if _compiling():
            # torch.compile compiling with this mode on the stack: its traces are not the step's.
            return func(*args, **(kwargs or {}))
        if any(map(_wraps, types)):
            # A tensor subclass wrapping others (DTensor): it runs its local ops, which come back here.
            return NotImplemented
        kwargs = kwargs or {}
        before = self.current
        if self.failure is None:
            try:
                self._settle()
                for t in _iter_tensors(args):
                    self.record(t, preexisting=True)
                for t in _iter_tensors(kwargs):
                    self.record(t, preexisting=True)
                before = self.current
            except Exception as err:
                self._broke(err)
        out = self._run(func, args, kwargs)  # the step's own op: its errors are the step's
        if self.failure is None:
            try:
                self._after_op(func, args, kwargs, out, before)
            except Exception as err:
                self._broke(err)
        return out

    def _run(self, func: Any, args: tuple, kwargs: dict) -> Any:
        return func(*args, **kwargs)

    def _after_op(self, func: Any, args: tuple, kwargs: dict, out: Any, before: int) -> None:
        self.clock += 1
        # In the backward (grad mode off there, but for a create_graph backward, which sums out of place
        # anyway), the node running: what it makes is born in it.
        node = None if torch.is_grad_enabled() else torch._C._current_autograd_node()
        seq = self._node = None if node is None else node._sequence_nr()
        try:
            for t in _iter_tensors(out):
                self.record(t)
        finally:
            self._node = None
        if _collective(func):
            self._communicated(func, args, out)
        if self.value_shaped is None and _value_shaped(func, args):
            self.value_shaped = str(func)
        if seq is not None and (
            self._engine_sum(func, args, kwargs, out, seq) or self._scattered(func, args, out, seq)
        ):
            self._summed = id(args[0].untyped_storage())  # whether it counts is known at the next event
        else:
            self._check_peak()
        if self.counts_cpu_kernels and hides_memory(func, args):
            self._unseen(before, func, args, kwargs)

    def _engine_sum(self, func: Any, args: tuple, kwargs: dict, out: Any, node: int) -> bool:
        """Whether ``func(*args)``, run while backward node ``node`` runs, is the engine summing two
        gradients of one input (``InputBuffer::accumulate``: ``old + new``) where, unwatched, it would add
        ``new`` into ``old`` in place if it held ``old``'s only reference: ``old`` a plain dense tensor,
        not a view (a weight's gradient through ``t()``), made by an earlier node, and ``new`` made by this
        one (a sum inside a node's formula adds what that node made to what it was given, or to what the
        forward saved). Whether the engine held the only reference, `_settle` learns from ``old``'s death.
        A gradient a node passes on as it came (``AddBackward0``'s) is not summed as made in place: the
        measurement may read high there, never low."""
        if func is not _ADD or kwargs or len(args) != 2:
            return False
        old, new = args
        if not (isinstance(old, Tensor) and isinstance(new, Tensor) and isinstance(out, Tensor)):
            return False
        if not (self._plain(old) and self._plain(new)) or old.shape != out.shape:
            return False
        if old.layout != torch.strided or new.layout != torch.strided or old._is_zerotensor():
            return False
        if old._is_view():  # its base holds the storage too: ``storage().use_count() == 1`` fails
            return False
        summed, added = self.live.get(id(old.untyped_storage())), self.live.get(id(new.untyped_storage()))
        if summed is None or added is None or summed[1].born_in in (None, node) or added[1].born_in != node:
            return False
        return is_non_overlapping_and_dense_or_false(old)

    def _scattered(self, func: Any, args: tuple, out: Any, node: int) -> bool:
        """Whether ``func(*args)``, run while backward node ``node`` runs, is a formula scattering a
        gradient into zeros this node just made (`_SCATTERED`), which unwatched it does in place: like an
        engine's sum, when the zeros die with it (`_settle`), the two never coexisted (+25 % on a step
        gathering half the rows of an activation, measured and simulated alike)."""
        if func not in _SCATTERED or not args or not isinstance(out, Tensor):
            return False
        if func is torch.ops.aten.index_put.default and not (len(args) > 3 and args[3]):
            return False  # not accumulating: not the index formula
        zeros = args[0]
        if not isinstance(zeros, Tensor) or not self._plain(zeros) or zeros._is_view():
            return False
        made = self.live.get(id(zeros.untyped_storage()))
        return made is not None and made[1].born_in == node and zeros.shape == out.shape

    def _plain(self, t: Tensor) -> bool:
        """Not a tensor subclass, as the engine asks before adding in place (the simulator's fakes stand
        for plain tensors)."""
        return type(t) is Tensor or (self.counts_fakes and _is_fake(t))

    def _settle(self, freed: int | None = None) -> None:
        """Settle the engine's sum `_after_op` left open, at the next event (an op, a storage born or
        freed, a peak checked): if that event is its first operand's death (``freed``), the engine held
        the operand's only reference, and unwatched would have summed into it in place: the sum never
        coexisted with it, and its moment is no candidate peak. Otherwise it is one, checked now, when
        nothing has changed since the sum."""
        summed, self._summed = self._summed, None
        if summed is not None and summed != freed:
            self._check_peak()

    def _broke(self, err: Exception) -> None:
        """The bookkeeping raised ``err`` inside the step (in an op, a saved-tensor or gradient hook): a
        measurement that survives errors (`measure`'s) keeps it in `failure` and follows nothing more, so
        the step runs on untouched; the others (the simulator's) raise it."""
        if not self.survives_errors:
            raise err
        self.failure = err

    def _communicated(self, func: Any, args: tuple, out: Any) -> None:
        """Buffers a collective reads or writes are communication buffers, unless they are more; what a
        reduce-scatter writes becomes the sharded gradients (FSDP2's, viewed or cast from it)."""
        for t in itertools.chain(_iter_tensors(args), _iter_tensors(out)):
            rec = self.record(t)
            if rec is not None and rec.kind is None:
                rec.kind = "communication"
        if func in _REDUCE_SCATTERS and args and isinstance(args[0], Tensor):
            rec = self.record(args[0])
            if rec is not None and rec.grad_at is None:
                rec.grad_at, rec.kind = self.clock, "sharded_gradients"

    def _unseen(self, before: int, func: Any, args: tuple, kwargs: dict) -> None:
        """Count what ``func``'s CPU kernel allocated where no op shows it (see `_measuring.kernels`) at its
        highest:
        ``before`` (live when the op began) plus the kernel's own highest total is a candidate peak."""
        if not self.counts_fakes and any(map(_is_fake, _iter_tensors(args))):
            return  # a simulation run inside the measured step
        highest = kernel_peak(func, args, kwargs)
        if highest is None:
            return
        unseen = before + rounded(highest, self.rounding) - self.current
        if unseen > 0:
            self._kernel_high(unseen)

    def _kernel_high(self, unseen: int) -> None:
        """A kernel held ``unseen`` bytes more than the live storages show, at its highest."""
        self._settle()
        if self.named_phase is not None and self.current + unseen > self.phase_peaks[self.named_phase]:
            self.phase_peaks[self.named_phase] = self.current + unseen
        if self.current + unseen > self.peak:
            self.peak = self.current + unseen
            self.peak_clock = self.clock
            self.peak_live = [rec for _, rec in self.live.values()]
            self.peak_live.append(Storage(unseen))  # owned by no one: temporary
            if self.peak_nbytes is not None:
                self.peak_nbytes = [rec.nbytes for rec in self.peak_live]

    def pack(self, t: Tensor) -> Tensor:
        if self.failure is None:
            try:
                for rec in self.records(t, preexisting=True):
                    if rec.saved_at is None:
                        rec.saved_at = self.clock
            except Exception as err:
                self._broke(err)
        return t

    def kept(self, packed: Any) -> None:
        """What a saved-tensor pack hook of the user's returned: autograd keeps it for backward
        (``save_on_cpu``'s copy, on a CPU run, is memory of this device)."""
        for t in _iter_tensors([packed]):
            self.pack(t)

    def on_grad(self, param: Tensor) -> None:
        if param.grad is None or self.failure is not None:
            return
        try:
            for rec in self.records(param.grad, preexisting=True):
                if rec.grad_at is None:
                    rec.grad_at = self.clock
        except Exception as err:
            self._broke(err)

    def on_unsharded_grad(self, param: Tensor) -> None:
        """A gradient FSDP2's backward accumulated into an unsharded parameter, before its reduce-scatter."""
        self.on_grad(param)
        if self.failure is not None:
            return
        try:
            for rec in () if param.grad is None else self.records(param.grad):
                rec.kind = rec.kind or "unsharded_gradients"
        except Exception as err:
            self._broke(err)

    # --- a step's set-up -----------------------------------------------------------------------

    def adopt(self, model: nn.Module, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        """Register what is live when the step begins, with the categories their owners give them."""
        self.claim_parameters(model, preexisting=True)
        self.claim_optimizer_state(optimizers, preexisting=True)
        for t in gradient_tensors(model):
            for rec in self.records(t, preexisting=True):
                if rec.category is None:
                    rec.grad_at = 0
        self.claim_sharded(model, preexisting=True)

    def claim_parameters(self, model: nn.Module, *, preexisting: bool = False) -> None:
        """Mark the model's parameters, their quantization state and its buffers as parameters, each
        trainable (``requires_grad``) or frozen. At the step's start and again at its end: a parameter's
        data replaced inside the step (bitsandbytes repacks a 4-bit weight for its CPU kernel at the first
        forward without gradients) is a parameter too."""
        for p in model.parameters():
            for t in (p, *quantization_state(p)):
                for rec in self.records(t, preexisting=preexisting):
                    if rec.category in (None, "parameters"):
                        rec.category, rec.frozen = "parameters", not (t is p and p.requires_grad)
        for t in itertools.chain(model.buffers(), layer_quantization_state(model)):
            for rec in self.records(t, preexisting=preexisting):
                if rec.category is None:
                    rec.category, rec.frozen = "parameters", True

    def adopt_batch(self, batch: Any) -> None:
        """Register the batch's tensors as live since the step began. An eager step's ops read them, and
        so register them; a compiled step's generated kernels read them where no op shows it (a compiled
        CNN's images, copied to channels-last inside the graph)."""
        for t in batch_tensors(batch):
            for _ in self.records(t, preexisting=True):
                pass

    def claim_sharded(self, model: nn.Module, *, preexisting: bool = False) -> bool:
        """Name what FSDP2 holds (`SHARDED_KINDS`): the sharded parameters and their gradients, and the
        unsharded copies, which are parameters too (their storage is empty while sharded). At the step's
        start and again at its end, when the first step's copies exist and its gradients are reduced.
        Returns whether ``model`` has FSDP2 units."""
        sharded_model = False
        for fsdp_param in fsdp2.fsdp_params(model):
            sharded_model = True
            sharded = fsdp2.sharded_param(fsdp_param)
            unsharded = fsdp2.unsharded_param(fsdp_param)
            for t, kind in ((sharded, "sharded_parameters"), (unsharded, "unsharded_parameters")):
                for rec in () if t is None else self.records(t, preexisting=preexisting):
                    rec.category, rec.kind = "parameters", kind
            for t, kind in ((sharded, "sharded_gradients"), (unsharded, "unsharded_gradients")):
                grad = None if t is None else t.grad
                for rec in () if grad is None else self.records(grad, preexisting=preexisting):
                    if rec.category is None:
                        rec.kind = kind
                        if rec.grad_at is None:  # held as a gradient since it was made (see _communicated)
                            rec.grad_at = 0
        return sharded_model

    def claim_optimizer_state(
        self, optimizers: Iterable[torch.optim.Optimizer], *, preexisting: bool = False
    ) -> None:
        """Mark the optimizers' tensors; after the step this also catches state born inside it. The
        weights an optimizer holds that are not the model's (an offloaded optimizer's host masters) are
        its state too."""
        optimizers = list(optimizers)
        held = (p for optimizer in optimizers for group in optimizer.param_groups for p in group["params"])
        for t in itertools.chain(optimizer_tensors(optimizers), held):
            for rec in self.records(t, preexisting=preexisting):
                if rec.category is None:
                    rec.category = "optimizer_state"

    @contextlib.contextmanager
    def watching(self, model: nn.Module) -> Iterator[Tracker]:
        """Follow the ops, saved tensors and gradient accumulations of the step run inside (FSDP2's
        unsharded parameters too, where they exist: backward accumulates into them)."""
        handles = [
            p.register_post_accumulate_grad_hook(self.on_grad) for p in model.parameters() if p.requires_grad
        ]
        for fsdp_param in fsdp2.fsdp_params(model):
            p = fsdp2.unsharded_param(fsdp_param)
            if p is not None and p.requires_grad:
                handles.append(p.register_post_accumulate_grad_hook(self.on_unsharded_grad))
        try:
            with self._saved_tensors_hooks(), _watched_elsewhere(self), self:
                yield self
        finally:
            for handle in handles:
                handle.remove()

    def _saved_tensors_hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """Our pack hook, over the saved-tensor hooks in force (only the innermost pair runs): theirs still
        pack and unpack, and what they return is what counts as kept. Our own unpack checks the version
        counter as autograd does for a tensor saved without hooks (hooks turn its check off): an in-place
        change of a saved tensor must raise, not train on wrong gradients."""
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if outer is None:

            def pack(t: Tensor) -> tuple[Tensor, int]:
                return self.pack(t), t._version

            self._hooks = (pack, _unpack_checked)
        else:
            outer_pack, outer_unpack = outer

            def pack(t: Tensor) -> Any:
                packed = outer_pack(t)
                self.kept(packed)
                return packed

            self._hooks = (pack, outer_unpack)
        return torch.autograd.graph.saved_tensors_hooks(*self._hooks)

    def owns_top_hooks(self) -> bool:
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        return self._hooks is not None and top is not None and top[0] is self._hooks[0]

    def on_compiled_buffer(self, t: Tensor) -> None:
        """A buffer torch.compile's generated code just allocated, where no op shows it (see
        `_compiled_allocator`): born now, like an op's output."""
        if self.failure is not None:
            return
        try:
            if self.record(t) is not None:
                self.clock += 1
                self._check_peak()
        except Exception as err:
            self._broke(err)

    def on_rng_state(self, state: Tensor) -> None:
        """A CPU RNG state activation checkpointing keeps for its recompute: kept for backward."""
        if not self.counts_rng_states or self.failure is not None:
            return
        try:
            rec = self.record(state)
            if rec is not None:
                rec.saved_at = self.clock
                self._check_peak()
        except Exception as err:
            self._broke(err)

    # --- result -------------------------------------------------------------------------------

    def _at_peak(self) -> Iterable[tuple[Storage, int]]:
        """`peak_live`'s storages with their sizes at the peak."""
        if self.peak_nbytes is None:
            return ((rec, rec.nbytes) for rec in self.peak_live)
        return zip(self.peak_live, self.peak_nbytes, strict=True)

    def _category(self, rec: Storage) -> str:
        if rec.category is not None:
            return rec.category
        if rec.grad_at is not None and rec.grad_at <= self.peak_clock:
            return "gradients"
        if rec.saved_at is not None and rec.saved_at <= self.peak_clock:
            return "activations"
        return "temporary"

    def breakdown(self, peak: int | None = None) -> MemoryBreakdown:
        """Bytes by category at the highest point; ``peak`` (the allocator's, on CUDA) sets the total."""
        self._settle()
        sums = dict.fromkeys(("parameters", "gradients", "optimizer_state", "activations"), 0)
        for rec, nbytes in self._at_peak():
            category = self._category(rec)
            if category != "temporary":
                sums[category] += nbytes
        total = self.peak if peak is None else peak
        return MemoryBreakdown(**sums, temporary=max(total - sum(sums.values()), 0))

    def parameter_split(self) -> dict[str, int]:
        """The parameters at the peak split by whether a gradient reaches them (bytes):
        ``trainable_parameters`` and ``frozen_parameters`` (frozen weights with their quantization state, and
        buffers)."""
        split = {"trainable_parameters": 0, "frozen_parameters": 0}
        for rec, nbytes in self._at_peak():
            if self._category(rec) == "parameters":
                split["frozen_parameters" if rec.frozen else "trainable_parameters"] += nbytes
        return split

    def sharded_breakdown(self) -> dict[str, int]:
        """FSDP2's part of the peak by `SHARDED_KINDS` (bytes): the sharded and unsharded parameters and
        gradients, and the collectives' buffers (temporary). Each is part of one of the five categories."""
        sums = dict.fromkeys(SHARDED_KINDS, 0)
        for rec, nbytes in self._at_peak():
            if rec.kind is None:
                continue
            category = self._category(rec)
            if SHARDED_KINDS[rec.kind] == category:
                sums[rec.kind] += nbytes
            elif category == "temporary":  # a gradient still in its reduce-scatter at the peak
                sums["communication"] += nbytes
        return sums


class MemoryMeasurement:
    """Context manager returned by `measure`; read `breakdown` after the ``with`` block."""

    def __init__(
        self,
        model: nn.Module,
        optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer] | None = None,
        *,
        device: torch.device | str | None = None,
        batch: Any = None,
    ) -> None:
        self.model = model
        self.batch = batch
        if optimizers is None:
            optimizers = ()
        elif isinstance(optimizers, torch.optim.Optimizer):
            optimizers = (optimizers,)
        elif isinstance(optimizers, str):
            raise TypeError(
                f"measure() takes the optimizer the step uses, not its name ({optimizers!r}): pass the "
                "torch.optim.Optimizer instance, or None (estimate_memory takes optimizer names)."
            )
        self.optimizers = tuple(optimizers)
        wrong = [type(o).__name__ for o in self.optimizers if not isinstance(o, torch.optim.Optimizer)]
        if wrong:
            raise TypeError(f"measure() takes torch.optim.Optimizer instances, got {', '.join(wrong)}")
        self.device = torch.device(device) if device is not None else model_device(model)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._breakdown: MemoryBreakdown | None = None
        #: why the step could not be followed in full, or ``None``: a torch.func transform ran in it,
        #: and what it saved is missing from `breakdown`
        self.unfollowed: str | None = None
        #: the first op whose outputs were sized by its inputs' values (``aten.nonzero.default``, a boolean
        #: mask's selection, a packing by lengths), or ``None``: a step of the same shapes may allocate
        #: otherwise
        self.value_shaped: str | None = None
        #: under FSDP2 (``fully_shard``), the peak's FSDP2 part by `SHARDED_KINDS` (bytes); else ``None``
        self.sharded: dict[str, int] | None = None
        #: where some parameters are frozen (an adapter fine-tune: LoRA, QLoRA), the peak's ``parameters``
        #: split into ``trainable_parameters`` and ``frozen_parameters`` (with their quantization state, and
        #: the buffers), in bytes; else ``None``
        self.parameter_split: dict[str, int] | None = None
        #: the highest total of each phase the caller named (`enter_phase`), in bytes, by phase; ``None``
        #: when none was named. The tracker's own count: on CUDA without the allocator's workspaces
        self.phase_peaks: dict[str, int] | None = None
        #: the error the measurement's own bookkeeping hit inside the step, or ``None``: the step ran on
        #: untouched (the error never reaches it), and there is no `breakdown`
        self.failure: Exception | None = None
        self._tracker: Tracker | None = None
        self._watching: contextlib.AbstractContextManager | None = None

    @property
    def breakdown(self) -> MemoryBreakdown:
        """The step's peak by category (bytes). Available once the ``with`` block has exited; a
        ``RuntimeError`` when the measurement failed (`failure`)."""
        if self.failure is not None:
            raise RuntimeError(
                f"The measurement failed inside the step, which ran on untouched: {self.failure!r}"
            ) from self.failure
        if self._breakdown is None:
            raise RuntimeError("The measurement is not finished: read `breakdown` after the `with` block.")
        return self._breakdown

    @property
    def peak(self) -> int:
        return self.breakdown.peak

    def enter_phase(self, phase: str) -> None:
        """Name the part of the step that begins now (``"forward"``, ``"backward"``, ...): `phase_peaks`
        gets each named phase's highest total. What ran before the first name belongs to none."""
        if self._tracker is not None:
            self._tracker.enter_phase(phase)

    def __enter__(self) -> MemoryMeasurement:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        tracker = self._tracker = Tracker(self.device, survives_errors=True)
        tracker.adopt(self.model, self.optimizers)
        tracker.adopt_batch(self.batch)
        self._watching = tracker.watching(self.model)
        self._watching.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        tracker, watching = self._tracker, self._watching
        assert tracker is not None and watching is not None, "measure() exited without entering"
        self._tracker = self._watching = None
        watching.__exit__(None, None, None)
        self.failure = tracker.failure
        if self.failure is not None:
            return
        # Optimizer state born during this step (the first step of a lazily initialised optimizer), a
        # parameter's data replaced in it, and FSDP2's first unsharded copies and this step's sharded
        # gradients, are known only now.
        tracker.claim_optimizer_state(self.optimizers)
        tracker.claim_parameters(self.model)
        sharded = tracker.claim_sharded(self.model)
        allocator_peak = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            allocator_peak = torch.cuda.max_memory_allocated(self.device)
        self._breakdown = tracker.breakdown(allocator_peak)
        self.sharded = tracker.sharded_breakdown() if sharded else None
        frozen = any(not p.requires_grad for p in self.model.parameters())
        self.parameter_split = tracker.parameter_split() if frozen else None
        self.unfollowed = tracker.unfollowed
        self.value_shaped = tracker.value_shaped
        self.phase_peaks = dict(tracker.phase_peaks) or None


def _unpack_checked(packed: tuple[Tensor, int]) -> Tensor:
    t, version = packed
    if t._version != version:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an inplace "
            f"operation: [{t.type()} {list(t.shape)}] is at version {t._version}; expected version {version} "
            "instead. (Raised by lightning_memkit's measurement, whose saved-tensor hooks replace autograd's "
            "own check: without it autograd raises the same error.)"
        )
    return t


try:
    from torch._subclasses.fake_tensor import FakeTensor
except ImportError:  # pragma: no cover - a torch without it has no simulations to tell apart either
    FakeTensor = ()  # type: ignore[assignment,misc]


def _is_fake(t: Tensor) -> bool:
    return isinstance(t, FakeTensor)


_compile_context = torch._guards.CompileContext.try_get  # bound once: asked on every op


def _compiling() -> bool:
    """Whether torch.compile is compiling in this thread. It takes the dispatch modes off the stack while
    it compiles, but not for a module under DDP (dynamo's DDP optimizer, which splits the graph at the
    buckets): there the trackers would see its traces, functional wrappers whose storages hold no memory
    (+1.1 MB, 50 %, on a tiny LLaMA's first step under DDP while inductor's cache was cold)."""
    return _compile_context() is not None


# Two allocations of activation checkpointing bypass both the dispatcher and autograd's saved-tensor hooks:
# the CPU RNG state ``torch.utils.checkpoint`` keeps per region for its recompute (``torch.get_rng_state``,
# 5,056 bytes), and the outputs selective checkpointing's policy saves in its own cache, each wrapped in the
# private ``torch.utils.checkpoint._VersionWrapper`` (without that class they count as temporary; the peak is
# the same, and tests/test_measure.py says so). And saved-tensor hooks the step pushes itself
# (``save_on_cpu``) replace the tracker's while they are in force: what they pack is reported all the same.
# FSDP2 allocates and frees its unsharded parameters with ``UntypedStorage.resize_``, which no dispatch mode
# sees, and gloo's collectives allocate buffers in their worker threads that the calling thread first meets
# while the collective's ``Work.wait()`` finishes it: both are reported too.
# These functions are patched once, while any tracker watches, and report to the innermost tracker of the
# calling thread only.
# torch.compile's generated code (inductor's Python wrapper) allocates its buffers with the fast paths
# ``torch._C._dynamo.guards._empty_strided_{cpu,cuda,...}``, which bypass the dispatcher: see
# `_compiled_allocator`.
_WATCHING = threading.local()
_PATCH_LOCK = threading.Lock()
_patched: dict[str, Any] = {}
_users = 0  # trackers watching, in all threads


def _innermost() -> Tracker | None:
    stack = getattr(_WATCHING, "stack", None)
    return stack[-1] if stack else None


def _get_rng_state(*args: Any, **kwargs: Any) -> Tensor:
    state = _patched["get_rng_state"](*args, **kwargs)
    tracker = _innermost()
    if tracker is not None:
        tracker.on_rng_state(state)
    return state


def _version_wrapper_init(cached: Any, *args: Any, **kwargs: Any) -> None:
    _patched["_VersionWrapper.__init__"](cached, *args, **kwargs)
    tracker, value = _innermost(), getattr(cached, "val", None)
    if tracker is not None and isinstance(value, Tensor):
        tracker.pack(value)


def _resize(storage: torch.UntypedStorage, size: int) -> Any:
    before = storage.nbytes()
    out = _patched["UntypedStorage.resize_"](storage, size)
    tracker = _innermost()
    if tracker is not None:
        tracker.on_resize(storage, before)
    return out


def _wait(work: Any, *args: Any, **kwargs: Any) -> Any:
    tracker = _innermost()
    if tracker is None:
        return _patched["Work.wait"](work, *args, **kwargs)
    tracker._waiting += 1
    try:
        return _patched["Work.wait"](work, *args, **kwargs)
    finally:
        tracker._waiting -= 1


def _work_class() -> type | None:
    if not torch.distributed.is_available():
        return None
    return getattr(torch.distributed, "Work", None)


def _hooks_enter(hooks: torch.autograd.graph.saved_tensors_hooks) -> None:
    """``saved_tensors_hooks.__enter__`` while a tracker watches: hooks the step pushes (``save_on_cpu``)
    run instead of the tracker's, so what they pack is reported to it. Checkpointing's own hooks keep no
    tensor in their packs; they are left as they are."""
    if type(hooks).__module__ == "torch.utils.checkpoint":
        _patched["saved_tensors_hooks.__enter__"](hooks)
        return
    user_pack = hooks.pack_hook

    def pack(t: Tensor) -> Any:
        packed = user_pack(t)
        tracker = _innermost()
        if tracker is not None:
            tracker.kept(packed)
        return packed

    torch._C._autograd._push_saved_tensors_default_hooks(pack, hooks.unpack_hook)


@contextlib.contextmanager
def _disable_saved_tensors_hooks(error_message: str) -> Iterator[None]:
    """``disable_saved_tensors_hooks`` while a tracker watches: torch.func's transforms (``grad``,
    ``vjp``, ``jacrev``) refuse to run under any saved-tensor hook. The tracker's own hooks step aside for
    the transform, and the step is marked as not followed: its figures would miss what the transform
    saved, so `MemoryMonitor` leaves it unmeasured instead of breaking it."""
    tracker = _innermost()
    stepped_aside = tracker is not None and tracker.owns_top_hooks()
    if stepped_aside:
        torch._C._autograd._pop_saved_tensors_default_hooks()
        tracker.unfollowed = "a torch.func transform (grad, vjp, jacrev, hessian) ran in the step"
    try:
        with _patched["disable_saved_tensors_hooks"](error_message):
            yield
    finally:
        if stepped_aside:
            torch._C._autograd._push_saved_tensors_default_hooks(*tracker._hooks)


#: The allocation fast paths of inductor's generated code: each generated module binds them as globals of
#: these names, from ``torch._C._dynamo.guards`` with a leading underscore (other devices call
#: ``torch.empty_strided``, an op the tracker sees).
_COMPILED_ALLOCATORS = (
    "empty_strided_cpu", "empty_strided_cpu_pinned", "empty_strided_cuda", "empty_strided_xpu",
    "empty_strided_mtia",
)  # fmt: skip


def _compiled_allocator(allocate: Any) -> Any:
    """``allocate`` (an `_COMPILED_ALLOCATORS` fast path) reporting each buffer to the trackers watching.

    Without it a compiled graph's buffers are seen late or never: a buffer only generated kernels write
    and the graph frees is never seen, one an extern kernel writes (``out=``) or the graph returns is first
    seen as an op's input and so counted from the step's start (+27 % on a compiled tiny LLaMA's step).
    The trackers are found on the dispatch mode stack, as for `gradient_consumed`: torch.compile keeps
    them there while its code runs (``ignore_compile_internals``), autograd carries them into its backward
    threads, and another thread's compiled code finds none."""

    def allocate_seen(*args: Any, **kwargs: Any) -> Tensor:
        t = allocate(*args, **kwargs)
        for mode in _get_current_dispatch_mode_stack():
            if isinstance(mode, Tracker):
                mode.on_compiled_buffer(t)
        return t

    allocate_seen.__wrapped__ = allocate  # type: ignore[attr-defined]
    return allocate_seen


def _generated_modules() -> list[Any]:
    """The modules of inductor's generated code loaded in this process so far (none before inductor is
    imported: then nothing was compiled)."""
    codecache = sys.modules.get("torch._inductor.codecache")
    cache = getattr(codecache, "PyCodeCache", None)
    modules = [*getattr(cache, "modules", ()), *getattr(cache, "modules_no_attr", {}).values()]
    return list({id(m): m for m in modules}.values())


def _rebind_compiled_allocators(swap: dict[int, Any]) -> None:
    """In every generated module loaded so far, rebind each `_COMPILED_ALLOCATORS` global found in
    ``swap`` (by identity) to its replacement."""
    for module in _generated_modules():
        namespace = vars(module)
        for name in _COMPILED_ALLOCATORS:
            replacement = swap.get(id(namespace.get(name)))
            if replacement is not None:
                namespace[name] = replacement


def _patch_compiled_allocators() -> None:
    """Route inductor's buffers to the trackers: in ``guards`` (read by a module compiled while a tracker
    watches, as it loads) and in the generated modules already loaded."""
    guards = getattr(getattr(torch._C, "_dynamo", None), "guards", None)
    swap: dict[int, Any] = {}
    for name in _COMPILED_ALLOCATORS:
        allocate = getattr(guards, f"_{name}", None)
        if allocate is None:
            continue
        seen = _compiled_allocator(allocate)
        _patched[f"guards._{name}"] = allocate
        setattr(guards, f"_{name}", seen)
        swap[id(allocate)] = seen
    _patched["compiled allocators"] = swap
    _rebind_compiled_allocators(swap)


def _unpatch_compiled_allocators() -> None:
    """Put inductor's own allocators back everywhere, modules compiled while a tracker watched included."""
    swap = _patched.pop("compiled allocators")
    _rebind_compiled_allocators({id(seen): seen.__wrapped__ for seen in swap.values()})
    for name in _COMPILED_ALLOCATORS:
        allocate = _patched.pop(f"guards._{name}", None)
        if allocate is not None:
            setattr(torch._C._dynamo.guards, f"_{name}", allocate)


@functools.cache
def _hidden_from_dynamo(dynamo: Any) -> None:
    """Have dynamo skip every frame of this package, as it skips torch's own.

    Autograd calls the tracker's saved-tensor and gradient hooks, and Python its weak-reference callbacks,
    from eager code; where that code runs inside a torch.compile'd call (after a graph break, or in a frame
    dynamo skips: ``nn.Sequential.compile()`` compiles no frame of its own), dynamo would otherwise
    compile those callbacks as new frames: a tiny compiled CNN's measured step compiled 33 frames of the
    tracker with 16 graph breaks, hit the recompile limit and measured +69 %. Once per process, at the
    first watch with dynamo imported (nothing is compiled before it is)."""
    dynamo.trace_rules.add(__package__)


def _patch() -> None:
    from torch.utils import checkpoint

    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:
        _hidden_from_dynamo(dynamo)

    graph = torch.autograd.graph
    _patched["disable_saved_tensors_hooks"] = graph.disable_saved_tensors_hooks
    graph.disable_saved_tensors_hooks = _disable_saved_tensors_hooks

    _patched["get_rng_state"], torch.get_rng_state = torch.get_rng_state, _get_rng_state
    hooks = torch.autograd.graph.saved_tensors_hooks
    _patched["saved_tensors_hooks.__enter__"], hooks.__enter__ = hooks.__enter__, _hooks_enter
    wrapper = getattr(checkpoint, "_VersionWrapper", None)
    if wrapper is not None:
        _patched["_VersionWrapper.__init__"], wrapper.__init__ = wrapper.__init__, _version_wrapper_init
    storage = torch.UntypedStorage
    _patched["UntypedStorage.resize_"], storage.resize_ = storage.resize_, _resize
    work = _work_class()
    if work is not None:
        _patched["Work.wait"], work.wait = work.wait, _wait
    _patch_compiled_allocators()


def _unpatch() -> None:
    from torch.utils import checkpoint

    torch.autograd.graph.disable_saved_tensors_hooks = _patched.pop("disable_saved_tensors_hooks")
    torch.get_rng_state = _patched.pop("get_rng_state")
    torch.autograd.graph.saved_tensors_hooks.__enter__ = _patched.pop("saved_tensors_hooks.__enter__")
    if "_VersionWrapper.__init__" in _patched:
        checkpoint._VersionWrapper.__init__ = _patched.pop("_VersionWrapper.__init__")
    torch.UntypedStorage.resize_ = _patched.pop("UntypedStorage.resize_")
    if "Work.wait" in _patched:
        _work_class().wait = _patched.pop("Work.wait")
    _unpatch_compiled_allocators()


@contextlib.contextmanager
def _watched_elsewhere(tracker: Tracker) -> Iterator[None]:
    """Route the two checkpointing allocations above to ``tracker`` while it watches this thread."""
    global _users
    with _PATCH_LOCK:
        if _users == 0:
            _patch()
        _users += 1
    stack = _WATCHING.__dict__.setdefault("stack", [])
    stack.append(tracker)
    try:
        yield
    finally:
        stack.remove(tracker)  # trackers may close out of order
        with _PATCH_LOCK:
            _users -= 1
            if _users == 0:
                _unpatch()


def gradient_consumed(param: Tensor) -> None:
    """Tell the trackers watching this step that ``param.grad`` is a gradient, before a post-accumulate-grad
    hook registered ahead of theirs frees it (the fused optimizer step): theirs would find ``None``.

    The trackers are found on the dispatch mode stack, which autograd carries into its backward threads."""
    for mode in _get_current_dispatch_mode_stack():
        if isinstance(mode, Tracker):
            mode.on_grad(param)


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


def measure(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | Iterable[torch.optim.Optimizer] | None = None,
    *,
    device: torch.device | str | None = None,
    batch: Any = None,
) -> MemoryMeasurement:
    """Measure the peak memory of the training step run inside the ``with`` block, by category.

    Example::

        with measure(model, optimizer) as m:
            loss = model(x).sum()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        print(m.breakdown)  # parameters / gradients / optimizer_state / activations / temporary

    Works for any ``nn.Module`` and ``torch.optim.Optimizer`` (several may be given), on CPU and CUDA.
    The peak is the highest total of live tensor storages on ``device`` (default: the model's), counting
    what was already allocated when the block began (parameters, gradients, optimizer state, the tensors
    of ``batch``, and any other tensor the step touches). On CUDA it is ``torch.cuda.max_memory_allocated``
    over the block.

    Pass the step's ``batch`` (any nesting of tensors) where the model is compiled: a compiled graph's
    kernels read their inputs where no op shows it, so a batch no op reads is otherwise left out.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"measure() takes the nn.Module whose step it measures; got {type(model).__name__}")
    if not isinstance(optimizer, (torch.optim.Optimizer, str, Iterable)) and optimizer is not None:
        raise TypeError(
            "measure() takes the torch.optim.Optimizer the step uses (or a list of them, or None); got "
            f"{type(optimizer).__name__}"
        )
    return MemoryMeasurement(model, optimizer, device=device, batch=batch)
