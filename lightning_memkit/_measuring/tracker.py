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
  are seen as ops, the buffers its generated code allocates are reported by inductor's allocation fast
  paths, and dynamo is told to skip this package, or it would compile the tracker's own hooks (both in
  `_measuring.patches`): compiled tiny LLaMA and CNN steps are within 0.002 % of the CPU allocator's own
  count. While torch.compile compiles with the tracker on the mode stack (a module under DDP), the tracker
  steps aside. A batch that only generated kernels read is seen where it is given (``measure(...,
  batch=)``, as `MemoryMonitor` does).
* torch.func: its transforms refuse to run under saved-tensor hooks. The tracker's hooks step aside for the
  transform and the measurement is marked ``unfollowed`` (what the transform saved is not seen);
  `MemoryMonitor` leaves such steps unmeasured.
* autograd's in-place check: a tensor saved through hooks is not version-checked by autograd, so the
  tracker's unpack hook checks it and raises autograd's own error (`_measuring.saved_tensors`).
* autograd's gradient sums: under a dispatch mode the engine sums two gradients of one input out of place
  where unwatched it adds in place (a packed sequence's LSTM read 4.5 % high). The tracker recognises
  these sums (`_measuring.ops`) and counts one as made in place when its first operand dies at once (see
  `_settle`). On CUDA, where the peak is read from the allocator, such a step may still read high.

Nor must its own errors reach the step: an exception of the bookkeeping inside the step (in an op, a
saved-tensor or gradient hook) is kept in `MemoryMeasurement.failure`, the op's result goes back untouched,
and nothing more is followed. A sparse tensor has no storage of its own: it counts as its members
(indices and values), which the allocator holds.

Around the tracker: `_measuring.measurement` is `measure`, `_measuring.claims` names what the step's owners
hold (parameters, optimizer state, the batch), `_measuring.storages` reads what memory tensors hold,
`_measuring.patches` reports what no dispatch mode sees (checkpointing's RNG states, FSDP2's resizes,
compiled buffers, ...), `_sharding.accounting` names FSDP2's part, and `_measuring._torch_private` reaches
torch's private entry points.

Who else follows a tracked step attaches a `TrackerListener` (`_measuring.listening`): the tracker tells it
each storage registered and freed, each resize, each candidate peak, gradients and RNG states as they come.
The simulator (`_estimating.fake_tracker`) records its timeline, history and trace that way, and changes
what is counted only through the tracker's named hooks: ``rounding``, ``counts_fakes`` and ``kernel``.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_memkit._breakdown import MemoryBreakdown
from lightning_memkit._measuring import _torch_private, ops, patches
from lightning_memkit._measuring.kernels import hides_memory, kernel_peak
from lightning_memkit._measuring.listening import TrackerListener
from lightning_memkit._measuring.ops import _value_shaped
from lightning_memkit._measuring.saved_tensors import SavedTensorHooks
from lightning_memkit._measuring.storages import (
    _SPARSE_MEMBERS,
    Storage,
    _iter_tensors,
    _wraps,
    allocation_rounding,
    leaves,
    rounded,
)
from lightning_memkit._sharding import accounting

__all__ = ["Tracker"]


def _is_fake(t: Tensor) -> bool:
    return isinstance(t, _torch_private.FakeTensor)


_Method = TypeVar("_Method", bound=Callable[..., Any])


def _guarded(method: _Method) -> _Method:
    """A bookkeeping method run inside the step (in an op, a saved-tensor, gradient or patched hook): it does
    nothing once the bookkeeping has broken, and an error it raises goes to `Tracker._broke` (kept, or
    raised, as the tracker says), never half-done into the step."""

    @functools.wraps(method)
    def guarded(self: Tracker, *args: Any, **kwargs: Any) -> Any:
        if self.failure is not None:
            return None
        try:
            return method(self, *args, **kwargs)
        except Exception as err:
            self._broke(err)
            return None

    return guarded  # type: ignore[return-value]


#: How an op's kernel is run: ``kernel(func, args, kwargs)`` returns ``func(*args, **kwargs)``'s outputs
Kernel = Callable[[Any, tuple, dict], Any]


class Tracker(TorchDispatchMode, patches.Listener):
    """Follows storage lifetimes on one device; keeps the live set at the highest point.

    What is counted, where a caller changes it (the simulator, `_estimating.fake_tracker`):

    * ``rounding``: the allocator's granularity each storage's size is rounded up to (`rounded`); by default
      ``device``'s;
    * ``counts_fakes``: whether fake tensors are storages of the step (the simulator's) or of a simulation
      run inside it (not counted);
    * ``kernel``: how an op's kernel runs (`Kernel`); by default the op itself. The simulator's sizes what
      the meta kernels refuse or leave out.

    And who is told what it sees: ``listeners``, each a `TrackerListener`, in order (`listen` adds one).
    """

    #: whether the CPU RNG states checkpointing keeps are on this tracker's device
    counts_rng_states = True

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Let torch.compile compile and run its graphs while we watch. Dynamo refuses to compile a frame
        first called under any other dispatch mode, and never compiles it afterwards: the monitor would
        turn compilation off for the whole run. The compiled code's own intermediates bypass the
        dispatcher; its inputs, outputs and saved tensors are still seen (see `measure`)."""
        return True

    def __init__(
        self,
        device: torch.device,
        *,
        survives_errors: bool = False,
        rounding: int | None = None,
        counts_fakes: bool = False,
        kernel: Kernel | None = None,
    ) -> None:
        super().__init__()
        self.device = device
        self.rounding = allocation_rounding(device) if rounding is None else rounding
        self.counts_fakes = counts_fakes
        self.kernel = kernel
        #: who is told what the tracker sees (`TrackerListener`), in order
        self.listeners: tuple[TrackerListener, ...] = ()
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
        self._saved_hooks = SavedTensorHooks(self.pack, self.kept)
        #: whether what CPU kernels allocate outside the dispatcher (`_measuring.kernels`) is this device's
        #: memory
        self.counts_cpu_kernels = device.type == "cpu"
        #: the sizes of `peak_live`'s storages at the peak, once a storage has been resized in the step
        #: (FSDP2's unsharded parameters): a record's ``nbytes`` is its size now, not then
        self.peak_nbytes: list[int] | None = None
        self._waiting = 0  # inside a collective's Work.wait() (see `collective_wait`)
        #: whether an error of the bookkeeping inside the step is kept in `failure` rather than raised there
        self.survives_errors = survives_errors
        #: the error the bookkeeping hit inside the step, if any: nothing is followed after it
        self.failure: Exception | None = None
        #: the backward node whose op is being recorded (its sequence number; see `Storage.born_in`)
        self._node: int | None = None
        #: an engine's gradient sum just made (`_measuring.ops.engine_sum`): its first operand's storage
        #: key, until the next event says whether that operand died with it (see `_settle`)
        self._summed: int | None = None

    def listen(self, listener: TrackerListener) -> None:
        """Tell ``listener`` what the tracker sees from now on, after the listeners attached before it."""
        self.listeners = (*self.listeners, listener)

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
        return self._register(storage, rounded(storage.nbytes(), self.rounding), preexisting=preexisting, t=t)

    def records(self, t: Tensor, *, preexisting: bool = False) -> Iterator[Storage]:
        """The records of every storage holding ``t`` (several for some tensor subclasses)."""
        for leaf in leaves(t):
            rec = self.record(leaf, preexisting=preexisting)
            if rec is not None:
                yield rec

    def _register(
        self, storage: torch.UntypedStorage, nbytes: int, *, preexisting: bool, t: Tensor | None = None
    ) -> Storage:
        """Count ``storage`` from now on, at ``nbytes`` (``t``: the tensor it was seen through, for the
        listener)."""
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
        for listener in self.listeners:
            listener.registered(self, rec, t, preexisting=preexisting)
        return rec

    def on_resize(self, storage: torch.UntypedStorage, before: int) -> None:
        """``storage.resize_`` ran, from ``before`` bytes: how FSDP2 allocates and frees the unsharded
        parameters, which no dispatch mode sees."""
        if not self.listeners:
            self._resized(storage, before)
            return
        for listener in self.listeners:
            listener.resizing(self, storage)
        try:
            self._resized(storage, before)
        finally:
            for listener in self.listeners:
                listener.resizing(self, None)

    @_guarded
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
            for listener in self.listeners:
                listener.freed(self, entry[1])

    def enter_phase(self, phase: str) -> None:
        """From now on the step is in ``phase`` (forward, backward, optimizer step: the caller's names; a
        phase entered again goes on with its highest): `phase_peaks` keeps each phase's highest total."""
        self._settle()
        self.named_phase = phase
        self.phase_peaks[phase] = max(self.phase_peaks.get(phase, 0), self.current)

    def _check_peak(self) -> None:
        for listener in self.listeners:
            listener.candidate(self, 0)
        self._settle()
        if self.named_phase is not None and self.current > self.phase_peaks[self.named_phase]:
            self.phase_peaks[self.named_phase] = self.current
        if self.current > self.peak:
            self.peak = self.current
            self.peak_clock = self.clock
            self.peak_live = [rec for _, rec in self.live.values()]
            if self.peak_nbytes is not None:
                self.peak_nbytes = [rec.nbytes for rec in self.peak_live]

    # --- the ops ------------------------------------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        if _torch_private.compiling():
            # torch.compile compiling with this mode on the stack: its traces are not the step's.
            return func(*args, **(kwargs or {}))
        if any(map(_wraps, types)):
            # A tensor subclass wrapping others (DTensor): it runs its local ops, which come back here.
            return NotImplemented
        kwargs = kwargs or {}
        self._before_op(args, kwargs)
        before = self.current
        # the step's own op: its errors are the step's
        out = func(*args, **kwargs) if self.kernel is None else self.kernel(func, args, kwargs)
        self._after_op(func, args, kwargs, out, before)
        return out

    @_guarded
    def _before_op(self, args: tuple, kwargs: dict) -> None:
        """An op's inputs not seen yet were live since the step began."""
        self._settle()
        for t in itertools.chain(_iter_tensors(args), _iter_tensors(kwargs)):
            self.record(t, preexisting=True)

    @_guarded
    def _after_op(self, func: Any, args: tuple, kwargs: dict, out: Any, before: int) -> None:
        """Register what ``func`` made (``before``: the live total as it began) and check the peak."""
        self.clock += 1
        # In the backward (grad mode off there, but for a create_graph backward, which sums out of place
        # anyway), the node running: what it makes is born in it.
        node = None if torch.is_grad_enabled() else _torch_private.current_autograd_node()
        seq = self._node = None if node is None else node._sequence_nr()
        try:
            for t in _iter_tensors(out):
                self.record(t)
        finally:
            self._node = None
        if accounting.is_collective(func):
            tensors = itertools.chain(_iter_tensors(args), _iter_tensors(out))
            accounting.communicated(self.record, func, args, tensors, self.clock)
        if self.value_shaped is None and _value_shaped(func, args):
            self.value_shaped = str(func)
        if seq is not None and (
            ops.engine_sum(func, args, kwargs, out, seq, self.live, self._plain)
            or ops.scattered(func, args, out, seq, self.live, self._plain)
        ):
            self._summed = id(args[0].untyped_storage())  # whether it counts is known at the next event
        else:
            self._check_peak()
        if self.counts_cpu_kernels and hides_memory(func, args):
            self._unseen(before, func, args, kwargs)

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
        for listener in self.listeners:
            listener.candidate(self, unseen)
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

    # --- hooks (the patches' `Listener` too) ----------------------------------------------------

    def pack(self, t: Tensor) -> Tensor:
        """Autograd saves ``t`` for backward (our saved-tensor pack hook)."""
        self._saved(t)
        return t

    @_guarded
    def _saved(self, t: Tensor) -> None:
        for rec in self.records(t, preexisting=True):
            if rec.saved_at is None:
                rec.saved_at = self.clock

    def kept(self, packed: Any) -> None:
        """What a saved-tensor pack hook of the user's returned: autograd keeps it for backward
        (``save_on_cpu``'s copy, on a CPU run, is memory of this device)."""
        for t in _iter_tensors([packed]):
            self.pack(t)

    @_guarded
    def on_grad(self, param: Tensor) -> None:
        """``param.grad`` is a gradient (a post-accumulate-grad hook, or `gradient_consumed`)."""
        for listener in self.listeners:
            listener.gradient(self, param)  # even when a fused step has consumed the gradient already
        if param.grad is None:
            return
        for rec in self.records(param.grad, preexisting=True):
            if rec.grad_at is None:
                rec.grad_at = self.clock

    def on_unsharded_grad(self, param: Tensor) -> None:
        """A gradient FSDP2's backward accumulated into an unsharded parameter, before its reduce-scatter."""
        self.on_grad(param)
        self._unsharded_grad(param)

    @_guarded
    def _unsharded_grad(self, param: Tensor) -> None:
        accounting.unsharded_gradient(self.records, param)

    @_guarded
    def on_compiled_buffer(self, t: Tensor) -> None:
        """A buffer torch.compile's generated code just allocated, where no op shows it (see
        `_measuring.patches`): born now, like an op's output."""
        if self.record(t) is not None:
            self.clock += 1
            self._check_peak()

    @_guarded
    def on_compiled_inputs(self, tensors: Iterable[Any]) -> None:
        """A compiled graph's generated code runs on ``tensors``: those its kernels alone read (the
        simulator's stubs: no op shows them) are live all the same, since the step began."""
        for t in tensors:
            if isinstance(t, Tensor):
                self.record(t, preexisting=True)

    @_guarded
    def on_rng_state(self, state: Tensor) -> None:
        """A CPU RNG state activation checkpointing keeps for its recompute: kept for backward."""
        for listener in self.listeners:
            listener.rng_state(self, state)
        if not self.counts_rng_states:
            return
        rec = self.record(state)
        if rec is not None:
            rec.saved_at = self.clock
            self._check_peak()

    @contextlib.contextmanager
    def collective_wait(self) -> Iterator[None]:
        """A collective's ``Work.wait()`` runs inside: a tensor first seen here is its own buffer (see
        `record`)."""
        self._waiting += 1
        try:
            yield
        finally:
            self._waiting -= 1

    @contextlib.contextmanager
    def transform_running(self) -> Iterator[None]:
        """A torch.func transform (``grad``, ``vjp``, ``jacrev``) runs inside: it refuses to run under any
        saved-tensor hook, so ours step aside for it, and the step is marked as not followed: its figures
        would miss what the transform saved, so `MemoryMonitor` leaves it unmeasured instead of breaking
        it."""
        with self._saved_hooks.stepped_aside() as stepped_aside:
            if stepped_aside:
                self.unfollowed = "a torch.func transform (grad, vjp, jacrev, hessian) ran in the step"
            yield

    # --- a step's set-up -----------------------------------------------------------------------

    @contextlib.contextmanager
    def watching(self, model: nn.Module) -> Iterator[Tracker]:
        """Follow the ops, saved tensors and gradient accumulations of the step run inside (FSDP2's
        unsharded parameters too, where they exist: backward accumulates into them), and what no op
        shows (`_measuring.patches`)."""
        handles = [
            p.register_post_accumulate_grad_hook(self.on_grad) for p in model.parameters() if p.requires_grad
        ]
        handles += [
            p.register_post_accumulate_grad_hook(self.on_unsharded_grad)
            for p in accounting.trainable_unsharded(model)
        ]
        try:
            with self._saved_hooks.installed(), patches.watched(self), self:
                yield self
        finally:
            for handle in handles:
                handle.remove()

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
        """FSDP2's part of the peak by `_sharding.accounting.SHARDED_KINDS` (bytes)."""
        return accounting.sharded_breakdown(self._at_peak(), self._category)
