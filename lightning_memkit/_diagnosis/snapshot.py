"""A simulated training step as a PyTorch memory snapshot, for the viewer users already know.

`memory_snapshot` runs `estimate_memory`'s step on fake tensors and writes it in the format of
``torch.cuda.memory._snapshot()`` (what ``torch.cuda.memory._dump_snapshot`` pickles): a
``"device_traces"`` list of alloc / free events and a ``"segments"`` list holding the blocks live when the
trace ends. torch's viewer opens it (``python -m torch.cuda._memory_viz trace_plot FILE -o out.html``, or
drag the file onto https://pytorch.org/memory_viz), so a 7B step planned on a laptop can be looked at
allocation by allocation before any GPU is spent on it.

What the picture holds, and why it is the estimate's:

- Every storage the tracker counts (`_measuring.tracker`), with its size in the target's rounding (512-byte
  blocks for ``device="cuda"``), cuBLAS's two workspaces and the CPU kernels' own buffers included.
  Storages live when the step starts (parameters, optimizer state, the previous step's gradients, the
  batch) carry no alloc event: those still live at the end are ``active_allocated`` blocks of the segment,
  those freed in the step have only their free events, which is how torch records blocks allocated
  before its history was turned on, and how its viewer counts them from the trace's start.
- The events are placed on the tracker's own clock: between two of its counts (after each op) the frees
  come first, then what the op allocated. The highest running total in the snapshot is therefore the
  estimate's peak, byte for byte, and what is live there sums, category by category, to its breakdown.
- Each allocation's frames (innermost first, as torch lists them) name the op and its output, the tensor
  where one is known (``transformer.h.0.attn.c_attn.weight.grad``), the module (in backward: the module
  whose forward made the autograd node), the phase (``before the step``, ``forward``, ``zero_grad``,
  ``backward``, ``optimizer``) and the category at the peak (``parameters``, ``gradients``,
  ``optimizer_state``, ``activations``, ``temporary``; for what is not live at the peak, what it became).

Invented: the addresses (first fit in one segment, 512-byte aligned; every live storage has its own range)
and the times (``time_us`` is the tracker's count of ops, not microseconds: a simulation has no clock).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import sys
from bisect import bisect_left, bisect_right
from collections import defaultdict
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves

from lightning_memkit._diagnosis.advise import Advice, advise_traced
from lightning_memkit._estimating.fake_step import simulate_step
from lightning_memkit._estimating.fake_tracker import _SimTracker
from lightning_memkit._estimating.repeated import History
from lightning_memkit._estimating.trace import Tracer, module_hooks
from lightning_memkit._measuring.storages import Storage, leaves
from lightning_memkit._step import Step

__all__ = ["memory_snapshot", "simulated_snapshot", "write_snapshot"]

#: Where the invented addresses start (a CUDA-like pointer; JavaScript's numbers hold it exactly).
BASE_ADDRESS = 0x7F0000000000
#: Alignment of the invented addresses.
ALIGNMENT = 512
#: The pickle protocol written: the viewer's own unpickler (MemoryViz.js) reads protocols 2 to 4 only.
PICKLE_PROTOCOL = 4
#: The phase frame of what was live before the step began.
BEFORE = "before the step"


def memory_snapshot(
    model: nn.Module, batch: Any, path: str | os.PathLike | None = None, **kwargs: Any
) -> dict:
    """One simulated training step as a PyTorch memory snapshot, to open in torch's memory viewer.

    The step is `estimate_memory`'s (same arguments, same side effects: none; nothing is allocated, no GPU
    is needed), simulated in full. The snapshot's highest allocated total is `estimate_memory`'s ``.peak``
    and what is live there sums, by category, to its breakdown; each allocation's frames name the op, the
    module, the phase and the category. See the module docstring for the format.

    Args:
        model: the model, as `estimate_memory` takes it (real or on the meta device).
        batch: the batch, as `estimate_memory` takes it.
        path: where to write the pickle (``torch.cuda.memory._dump_snapshot``'s format); ``None``: nowhere.
        **kwargs: `estimate_memory`'s keyword arguments (``optimizer``, ``step`` or ``precision``,
            ``device``, ``checkpointing``, ...), but ``timeline`` (the snapshot is the step op by op).

    Returns:
        The snapshot dict: ``{"segments": [...], "device_traces": [[...]]}``. Open a written file with
        ``python -m torch.cuda._memory_viz trace_plot FILE -o out.html``, or at https://pytorch.org/memory_viz.
    """
    snapshot, _ = simulated_snapshot(model, batch, **kwargs)
    if path is not None:
        write_snapshot(snapshot, path)
    return snapshot


def simulated_snapshot(
    model: nn.Module, batch: Any, *, timeline: bool = False, **kwargs: Any
) -> tuple[dict, _SimTracker]:
    """`memory_snapshot`'s dict and the tracker of the step (its ``breakdown()``; with ``timeline``, its
    `TimelineEvent`s), from one simulation."""
    recorder = _Recorder()
    namer = _Namer(model, recorder)
    step, run = Step.split(kwargs, caller="memory_snapshot")
    tracker = simulate_step(model, batch, step, timeline=timeline, tracer=namer, history=recorder, **run)
    return _build(tracker, recorder, namer), tracker


def advised_snapshot(
    model: nn.Module, batch: Any, *, memory_stats: Any = None, **kwargs: Any
) -> tuple[Advice, dict]:
    """`advise`'s advice and `memory_snapshot`'s dict of the step it advises, from one simulation of that
    step (``kwargs``: as `advise_traced` takes them)."""
    recorder = _Recorder()
    namer = _Namer(model, recorder)
    advice, tracker = advise_traced(
        model, batch, namer, history=recorder, memory_stats=memory_stats, **kwargs
    )
    return advice, _build(tracker, recorder, namer)


def write_snapshot(snapshot: dict, path: str | os.PathLike) -> None:
    """Pickle ``snapshot`` to ``path`` as ``torch.cuda.memory._dump_snapshot`` does, in a protocol the web
    viewer reads."""
    with open(path, "wb") as f:
        pickle.dump(snapshot, f, protocol=PICKLE_PROTOCOL)


# --------------------------------------------------------------------------------------------------
# Recording the step
# --------------------------------------------------------------------------------------------------


class _Recorder(History):
    """The tracker's `History`, which also knows which storages were live since the step began, the CPU
    kernels' own buffers at each count, and stops at the step's end (what dies afterwards, as the
    simulation's fakes are put away, is still live in the picture)."""

    def __init__(self) -> None:
        super().__init__()
        self.preexisting: set[int] = set()  # ids of the records live since the step began
        #: point index -> (bytes a CPU kernel held beyond its outputs, the module running it)
        self.unseen: dict[int, tuple[int, str]] = {}
        self.closed = False

    def born(self, rec: Storage, *, preexisting: bool) -> None:
        if self.closed:
            return
        super().born(rec, preexisting=preexisting)
        if preexisting:
            self.preexisting.add(id(rec))

    def died(self, rec: Storage) -> None:
        if not self.closed:
            super().died(rec)

    def point(self, tracker: Any, unseen: int) -> None:
        if unseen:
            tracer = tracker.tracer
            module = tracer.running(tracker.phase)[0] if isinstance(tracer, _Namer) else ""
            self.unseen[len(self.points)] = (unseen, module)
        super().point(tracker, unseen)

    def lives(self) -> Iterator[tuple[Storage, int, list[tuple[int, int]], int | None]]:
        """Each storage's record, the point it was born at, its sizes from each point on, and the point it
        was gone by (``None``: live at the end)."""
        for key, (rec, born, sizes) in self._lives.items():
            yield rec, born, sizes, self._deaths.get(key)


class _Namer(Tracer):
    """`Tracer` that also names the storages live when the step starts (parameters, buffers, gradients,
    optimizer state, cuBLAS's workspaces) and the gradients it makes, and knows, in backward, the module
    whose forward made the running autograd node."""

    def __init__(self, model: nn.Module, recorder: _Recorder) -> None:
        super().__init__(model)
        self.recorder = recorder
        #: id of a record -> (what the tensor is, the module owning it)
        self.labels: dict[int, tuple[str, str]] = {}
        #: id of a record made in the step -> (the module running, or in backward the one whose forward made
        #: the running autograd node; that node's name in backward)
        self.made_in: dict[int, tuple[str, str | None]] = {}
        self._stack: list[str] = []  # the modules running, named as the model names them
        # The module running as each autograd node was made, by the nodes' sequence numbers (they count up
        # as forward makes them): from each bound on, its name ("": none).
        self._bounds: list[int] = []
        self._bound_names: list[str] = []

    def started(self, tracker: Any, model: nn.Module, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        self._name(tracker, model, optimizers)
        if tracker.workspaces is not None:
            self._label(tracker, tracker.workspaces, "cuBLAS workspaces (two, kept between steps)", "")

    def finish(self, model: nn.Module, optimizers: Iterable[torch.optim.Optimizer], tracker: Any) -> None:
        optimizers = list(optimizers)
        super().finish(model, optimizers, tracker)
        self._name(tracker, model, optimizers)  # this step's gradients, a first step's optimizer state
        self.recorder.closed = True

    def created(self, rec: Storage, t: Tensor, phase: str) -> None:
        super().created(rec, t, phase)
        self.made_in[id(rec)] = self.running(phase)

    def running(self, phase: str) -> tuple[str, str | None]:
        """The module running (``""``: none), or in backward the one whose forward made the running autograd
        node; and that node's name."""
        module = self._stack[-1] if self._stack else ""
        node = torch._C._current_autograd_node() if phase == "backward" else None
        if node is not None and not self._stack:  # a recompute runs inside its module: named there
            at = bisect_right(self._bounds, node._sequence_nr()) - 1
            module = self._bound_names[at] if at >= 0 else ""
        return module, None if node is None else node.name()

    @contextlib.contextmanager
    def watching_modules(self) -> Iterator[None]:
        """Also note which module runs from which autograd sequence number on (the innermost one)."""

        def bound(name: str) -> None:
            seq = torch.autograd._get_sequence_nr()
            if self._bounds and self._bounds[-1] == seq:
                self._bound_names[-1] = name
            elif not self._bounds or self._bounds[-1] < seq:  # one thread's count: always up
                self._bounds.append(seq)
                self._bound_names.append(name)

        def enter(module: nn.Module, args: Any) -> None:
            name = self.names.get(id(module))  # a module made on the fly (a kernel's wrapper): its caller's
            self._stack.append(
                name if name is not None else self._stack[-1] if self._stack else type(module).__name__
            )
            bound(self._stack[-1])

        def leave(module: nn.Module, args: Any, output: Any) -> None:
            if self._stack:
                self._stack.pop()
            bound(self._stack[-1] if self._stack else "")

        with super().watching_modules(), module_hooks(enter, leave):
            yield

    # --- naming -------------------------------------------------------------------------------------

    def _name(self, tracker: Any, model: nn.Module, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        """Label the storages of ``model``'s parameters, buffers and gradients and of the optimizers' state
        that the tracker holds now (looked up only: nothing is registered)."""
        param_names: dict[int, str] = {}
        for name, p in model.named_parameters():
            param_names.setdefault(id(p), name)
            owner = name.rpartition(".")[0]
            self._label(tracker, p, name, owner)
            if p.grad is not None:
                self._label(tracker, p.grad, f"{name}.grad", owner)
        for name, b in model.named_buffers():
            self._label(tracker, b, name, name.rpartition(".")[0])
        for optimizer in optimizers:
            for p, state in optimizer.state.items():
                pname = param_names.get(id(p), "a parameter")
                owner = pname.rpartition(".")[0]
                for key, value in state.items() if isinstance(state, dict) else ():
                    for t in _tensors(value):
                        self._label(tracker, t, f"{key} of {pname}", owner)
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if id(p) not in param_names and isinstance(p, Tensor):  # an offloaded optimizer's masters
                        self._label(tracker, p, "a weight the optimizer holds", "")

    def _label(self, tracker: Any, t: Tensor, what: str, owner: str) -> None:
        for leaf in leaves(t):
            entry = tracker.live.get(id(leaf.untyped_storage()))
            if entry is not None and id(entry[1]) not in self.labels:
                self.labels[id(entry[1])] = (f"{what} {_describe(leaf.dtype, leaf.shape)}", owner)


def _tensors(obj: Any) -> list[Tensor]:
    return [t for t in tree_leaves(obj) if isinstance(t, Tensor)]


def _describe(dtype: torch.dtype, shape: Iterable[int]) -> str:
    return f"{str(dtype).removeprefix('torch.')}[{', '.join(str(int(n)) for n in shape)}]"


# --------------------------------------------------------------------------------------------------
# Building the snapshot
# --------------------------------------------------------------------------------------------------


class _Arena:
    """First-fit addresses in one segment: a freed range is reused by the next allocation it fits."""

    def __init__(self) -> None:
        self.top = 0  # end of the highest range in use or held by a hole below it
        self.high = 0  # the highest `top` ever: the segment's size
        self.holes: list[tuple[int, int]] = []  # (start, size), sorted, coalesced, all below `top`

    def alloc(self, nbytes: int) -> int:
        size = -(-nbytes // ALIGNMENT) * ALIGNMENT
        for i, (start, hole) in enumerate(self.holes):
            if hole >= size:
                if hole == size:
                    del self.holes[i]
                else:
                    self.holes[i] = (start + size, hole - size)
                return start
        start = self.top
        if self.holes and sum(self.holes[-1]) == self.top:  # grow the last hole past the top
            start, _ = self.holes.pop()
        self.top = start + size
        self.high = max(self.high, self.top)
        return start

    def free(self, start: int, nbytes: int) -> None:
        size = -(-nbytes // ALIGNMENT) * ALIGNMENT
        i = bisect_left(self.holes, (start, 0))
        if i < len(self.holes) and start + size == self.holes[i][0]:  # merge with the hole above
            size += self.holes.pop(i)[1]
        if i > 0 and sum(self.holes[i - 1]) == start:  # and with the one below
            start, below = self.holes.pop(i - 1)
            size += below
            i -= 1
        if start + size == self.top:
            self.top = start
        else:
            self.holes.insert(i, (start, size))


class _Piece:
    """One allocation of the picture: a storage at one size, from one point to another."""

    __slots__ = ("addr", "end", "nbytes", "rec", "start")

    def __init__(self, rec: Storage, nbytes: int, start: int, end: int | None) -> None:
        self.rec, self.nbytes, self.start, self.end = rec, nbytes, start, end
        self.addr = 0


def _pieces(recorder: _Recorder, points: int) -> list[_Piece]:
    """Every storage's life at each of its sizes (FSDP2 resizes its unsharded parameters), as pieces that
    are live at one point at least or since the step began (``start`` -1); born after the last point:
    never counted, left out."""
    pieces = []
    for rec, born, sizes, death in recorder.lives():
        preexisting = id(rec) in recorder.preexisting
        for i, (at, nbytes) in enumerate(sizes):
            start = (-1 if preexisting else born) if i == 0 else at
            end = sizes[i + 1][0] if i + 1 < len(sizes) else death
            if nbytes == 0 or start >= points or (end is not None and end <= start):
                continue
            pieces.append(_Piece(rec, nbytes, start, end))
    return pieces


class _Frames:
    """The frames of each allocation, innermost first; equal frames are one object (pickled once)."""

    def __init__(self, tracker: _SimTracker, namer: _Namer, peak_point: int) -> None:
        self.tracker, self.namer, self.peak_point = tracker, namer, peak_point
        self._frames: dict[tuple[str, str], dict] = {}
        self._lists: dict[tuple, list[dict]] = {}

    def frame(self, kind: str, name: str) -> dict:
        key = (kind, name)
        frame = self._frames.get(key)
        if frame is None:
            frame = self._frames[key] = {"filename": kind, "line": 0, "name": name}
        return frame

    def category(self, piece: _Piece) -> str:
        """The category at the peak for what is live there, else what the storage became."""
        tracker = self.tracker
        if piece.start <= self.peak_point and (piece.end is None or piece.end > self.peak_point):
            return tracker._category(piece.rec)
        clock, tracker.peak_clock = tracker.peak_clock, sys.maxsize
        try:
            return tracker._category(piece.rec)
        finally:
            tracker.peak_clock = clock

    def of(self, piece: _Piece, points: list[Any]) -> list[dict]:
        rec, namer = piece.rec, self.namer
        origin = rec.origin
        label = namer.labels.get(id(rec))
        if piece.start == -1:
            phase, op, module = BEFORE, None, label[1] if label else ""
        elif origin is not None:
            phase = origin.phase
            op = f"{origin.op} -> {_describe(origin.dtype, origin.shape)}"
            module, node = namer.made_in.get(id(rec), ("", None))
            if node is not None:
                op = f"{op} (in {node})"
        else:  # born where no op shows it (a resize, a collective's buffer)
            point = points[piece.start]
            phase, op, module = point.phase, _op_name(point.op), ""
        if label is None and piece.start == -1:
            what = "held when the step began (the batch, or another tensor the step reads)"
            label = (what, "")
        key = (op, label, module, phase, self.category(piece), rec.kind)
        frames = self._lists.get(key)
        if frames is None:
            frames = []
            if op is not None:
                frames.append(self.frame("op", op))
            if label is not None:
                frames.append(self.frame("tensor", label[0]))
            frames.append(self.frame("module", module or _outside(phase)))
            frames.append(self.frame("phase", phase))
            if rec.kind is not None:
                frames.append(self.frame("fsdp2", rec.kind))
            frames.append(self.frame("category", key[4]))
            self._lists[key] = frames
        return frames

    def kernel(self, op: Any, phase: str, module: str) -> list[dict]:
        key = ("kernel", _op_name(op), phase, module)
        frames = self._lists.get(key)
        if frames is None:
            frames = self._lists[key] = [
                self.frame("op", f"{_op_name(op)}: the CPU kernel's own buffers, at their highest"),
                self.frame("module", module or _outside(phase)),
                self.frame("phase", phase),
                self.frame("category", "temporary"),
            ]
        return frames


def _outside(phase: str) -> str:
    """The module frame of what no module made."""
    return {
        "optimizer": "optimizer.step()",
        "zero_grad": "optimizer.zero_grad()",
        BEFORE: "(none)",
    }.get(phase, "(outside every module: the loss, training_step)")


def _op_name(op: Any) -> str:
    if isinstance(op, tuple):  # a kernel high point: ("kernel", op)
        op = op[-1]
    if op is None:
        return "(no op)"
    return str(getattr(op, "__name__", op)).split(".")[0]


def _build(tracker: _SimTracker, recorder: _Recorder, namer: _Namer) -> dict:
    """The snapshot of the recorded step (see the module docstring)."""
    points = recorder.points
    n = len(points)
    pieces = _pieces(recorder, n)
    initial = [p for p in pieces if p.start == -1]
    start_total = sum(p.nbytes for p in initial)
    # The tracker's peak: the step's start, or the first point at the highest total.
    peak_point = -1
    if tracker.peak > start_total:
        peak_point = next((i for i, p in enumerate(points) if recorder.live(p) == tracker.peak), -1)
    frames = _Frames(tracker, namer, peak_point)

    starting: dict[int, list[_Piece]] = defaultdict(list)
    ending: dict[int, list[_Piece]] = defaultdict(list)
    for piece in pieces:
        if piece.start >= 0:
            starting[piece.start].append(piece)
        if piece.end is not None:
            ending[piece.end].append(piece)

    arena = _Arena()
    for piece in initial:
        piece.addr = BASE_ADDRESS + arena.alloc(piece.nbytes)
    trace: list[dict] = []

    def alloc(nbytes: int, frames_: list[dict], at: int) -> int:
        addr = BASE_ADDRESS + arena.alloc(nbytes)
        trace.append(_event("alloc", addr, nbytes, frames_, at))
        return addr

    def free(addr: int, nbytes: int, frames_: list[dict], at: int) -> None:
        arena.free(addr - BASE_ADDRESS, nbytes)
        trace.append(_event("free_requested", addr, nbytes, frames_, at))
        trace.append(_event("free_completed", addr, nbytes, frames_, at))

    kernel: tuple[int, int, list[dict]] | None = None
    for i in range(n + 1):
        if kernel is not None:
            free(*kernel, at=i)
            kernel = None
        for piece in ending.get(i, ()):
            free(piece.addr, piece.nbytes, frames.of(piece, points), at=i)
        if i == n:
            break
        for piece in starting.get(i, ()):
            piece.addr = alloc(piece.nbytes, frames.of(piece, points), at=i)
        if i in recorder.unseen:
            unseen, module = recorder.unseen[i]
            kernel_frames = frames.kernel(points[i].op, points[i].phase, module)
            kernel = (alloc(unseen, kernel_frames, at=i), unseen, kernel_frames)

    at_end = sorted((p for p in pieces if p.end is None), key=lambda p: p.addr)
    return {"segments": [_segment(at_end, arena, frames, points)], "device_traces": [trace]}


def _event(action: str, addr: int, size: int, frames: list[dict], at: int) -> dict:
    return {"action": action, "addr": addr, "size": size, "stream": 0, "frames": frames, "time_us": at}


def _segment(at_end: list[_Piece], arena: _Arena, frames: _Frames, points: list[Any]) -> dict:
    """The one segment, as the allocator holds it when the trace ends: the live blocks and the free gaps
    between them."""
    blocks = []
    addr = BASE_ADDRESS
    for piece in at_end:
        if piece.addr > addr:
            blocks.append(_block(addr, piece.addr - addr, "inactive", []))
        blocks.append(_block(piece.addr, piece.nbytes, "active_allocated", frames.of(piece, points)))
        addr = piece.addr + piece.nbytes
    end = BASE_ADDRESS + max(arena.high, ALIGNMENT)
    if end > addr:
        blocks.append(_block(addr, end - addr, "inactive", []))
    allocated = sum(p.nbytes for p in at_end)
    return {
        "device": 0,
        "address": BASE_ADDRESS,
        "total_size": end - BASE_ADDRESS,
        "allocated_size": allocated,
        "active_size": allocated,
        "requested_size": allocated,
        "stream": 0,
        "segment_type": "large",
        "segment_pool_id": (0, 0),
        "blocks": blocks,
    }


def _block(addr: int, size: int, state: str, frames: list[dict]) -> dict:
    requested = size if state == "active_allocated" else 0
    return {"address": addr, "size": size, "requested_size": requested, "state": state, "frames": frames}
