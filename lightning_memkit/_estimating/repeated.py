"""A deep model's simulated step from three shallow ones: repeated blocks allocate alike.

A simulated step costs in proportion to the ops it dispatches, and most of a transformer's ops are its
blocks': a 7B LLaMA's step is 32 copies of one block's ops between the embedding and the head, an 80-layer
70B's 80. When the blocks are copies of one another (one class, the same parameters, the same settings
but their index), the step of a model cut to ``k`` blocks is the step at ``k + 1`` with one block's ops
taken out of each phase, and what every other op sees live moves by a fixed amount per block. So the step
is simulated at 1, 2 and 3 blocks (at 2, 3 and 4 where the 1-block step fails or the three do not agree:
`estimate_memory(checkpointing=...)` finds the blocks to checkpoint by their repetition), with every
candidate peak recorded (`History`). Described for 2, 3 and 4 blocks (the rule is the same one lower):

1. In each phase (forward, zero_grad, backward, optimizer), the step at 3 blocks is the step at 2 with
   runs of ops inserted, one for each loop over the blocks (most phases have one; FSDP2's forward views
   every parameter before it runs the blocks, a first step creates the optimizer state and then updates):
   every other op is the 2-block step's, its live figure moved by its own amount.
2. That rule predicts the 4-block step: every other op moved twice, each inserted run twice, the second
   copy moved from the first as the ops after the run moved past it (an earlier block's saved activations
   in the forward, a later block's gradients in the backward). Every figure of the real 4-block step must
   be the predicted one, byte for byte, with the same ops; otherwise the shortcut is not taken.
3. The rule then gives the step at the model's own depth, and its first highest point; the breakdown
   there is the 3- and 4-block steps' breakdowns at the same point, extended in proportion (checked
   against the 2-block step's where that point exists).

Where anything does not hold (blocks that differ in any setting, a non-uniform checkpointing plan, a
step that fails when cut, a prediction that misses) the whole model is simulated instead. The tests hold
it to the full simulation byte for byte on the zoo. A known limit: what the *parent's* loop does by a
block's position past the shallow steps' (checkpointing only the first N blocks by hand with
``torch.utils.checkpoint``, an extra op after every k-th block) is seen neither in the blocks' settings
nor in the shallow steps, and is extrapolated as if absent (a strict xfail in the tests records it).
"""

from __future__ import annotations

import contextlib
import difflib
import enum
import itertools
import logging
import types
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from lightning_memkit._breakdown import CATEGORIES, MemoryBreakdown
from lightning_memkit._checkpointing.blocks import find_blocks
from lightning_memkit._checkpointing.policies import applied_modes
from lightning_memkit._measuring.listening import TrackerListener

if TYPE_CHECKING:
    from torch import Tensor

    from lightning_memkit._measuring.storages import Storage
    from lightning_memkit._measuring.tracker import Tracker

__all__ = ["MIN_DEPTH", "History", "Shortcut", "cost_ratio", "shortcut"]

log = logging.getLogger(__name__)

#: Fewest repeated blocks for the shortcut: three shallow steps (at most 2 + 3 + 4 blocks) must cost less
#: than one.
MIN_DEPTH = 12
#: The shallow steps tried, in order: 2, 3 and 4 blocks where 1, 2 and 3 fail or do not agree.
_DEPTHS = ((1, 2, 3), (2, 3, 4))


@dataclass(frozen=True)
class _Point:
    phase: str
    op: Any
    current: int  # live bytes then, as the tracker counted them
    preexisting: int  # bytes registered as live-since-the-start by then (counted later for earlier points)
    clock: int
    index: int  # its place in the history


class History(TrackerListener):
    """Every candidate peak of a tracked step (after each op, resize and kernel high), and every storage's
    life, so the step can be read at any point, not only at its peak: a listener of the tracker."""

    def __init__(self) -> None:
        self.points: list[_Point] = []
        self.op: Any = None  # the op running (as the tracker tells it)
        self._resizing: torch.UntypedStorage | None = None  # the storage being resized, if any
        self._preexisting = 0
        self._lives: dict[int, tuple[Storage, int, list[tuple[int, int]]]] = {}  # id -> rec, born, sizes
        self._deaths: dict[int, int] = {}

    # --- what the tracker tells (`TrackerListener`) ----------------------------------------------

    def registered(self, tracker: Tracker, rec: Storage, t: Tensor | None, *, preexisting: bool) -> None:
        self.born(rec, preexisting=preexisting)

    def freed(self, tracker: Tracker, rec: Storage) -> None:
        self.died(rec)

    def candidate(self, tracker: Tracker, unseen: int) -> None:
        self.point(tracker, unseen)

    def op_started(self, tracker: Tracker, func: Any, args: tuple, kwargs: dict) -> None:
        self.op = func

    def rng_state(self, tracker: Tracker, state: Tensor) -> None:
        self.op = "rng_state"

    def resizing(self, tracker: Tracker, storage: torch.UntypedStorage | None) -> None:
        if storage is not None:
            self.op = "resize_"
        self._resizing = storage

    # --- the record ------------------------------------------------------------------------------

    def born(self, rec: Storage, *, preexisting: bool) -> None:
        self._lives[id(rec)] = (rec, 0 if preexisting else len(self.points), [(0, rec.nbytes)])
        if preexisting:
            self._preexisting += rec.nbytes

    def died(self, rec: Storage) -> None:
        self._deaths.setdefault(id(rec), len(self.points))

    def point(self, tracker: Tracker, unseen: int) -> None:
        if self._resizing is not None:  # the resized storage's size from this point on
            entry = tracker.live.get(id(self._resizing))
            life = None if entry is None else self._lives.get(id(entry[1]))
            if life is not None:
                life[2].append((len(self.points), entry[1].nbytes))
            self._resizing = None
        op = self.op if unseen == 0 else ("kernel", self.op)
        self.points.append(
            _Point(
                tracker.phase,  # type: ignore[attr-defined]
                op,
                tracker.current + unseen,
                self._preexisting,
                tracker.clock,
                len(self.points),
            )
        )

    def live(self, point: _Point) -> int:
        """Bytes live at ``point``, with what was first seen later but live since the step began."""
        return point.current + self._preexisting - point.preexisting

    def breakdown_at(self, tracker: Tracker, point: _Point) -> MemoryBreakdown:
        """The breakdown at ``point``, as the tracker's `breakdown` gives it at its peak."""
        sums = dict.fromkeys(CATEGORIES[:4], 0)
        clock, tracker.peak_clock = tracker.peak_clock, point.clock  # categories as of that point
        try:
            for key, (rec, born, sizes) in self._lives.items():
                if born > point.index or self._deaths.get(key, len(self.points) + 1) <= point.index:
                    continue
                nbytes = next(n for at, n in reversed(sizes) if at <= point.index)
                category = tracker._category(rec)
                if category != "temporary":
                    sums[category] += nbytes
        finally:
            tracker.peak_clock = clock
        return MemoryBreakdown(**sums, temporary=max(self.live(point) - sum(sums.values()), 0))


# --------------------------------------------------------------------------------------------------
# Which models: one container of identical blocks
# --------------------------------------------------------------------------------------------------


class Run(NamedTuple):
    """A run of consecutive alike blocks in one container: ``container``'s blocks ``start`` to ``start +
    length``, of ``total``; the blocks before and after it (``total - length``) are simulated as they are."""

    container: nn.Module
    start: int
    length: int
    total: int

    @property
    def others(self) -> int:
        return self.total - self.length


def repeated_run(model: nn.Module) -> Run | None:
    """The longest run of ``model``'s blocks that are copies of one another (one class, the same parameters
    and buffers, every setting alike but an index, one checkpointing mode), consecutive in a container
    that holds nothing else, at least `MIN_DEPTH` long and four times as long as the blocks outside it
    (which every shallow step runs, so that they cost less than the whole); ``None`` otherwise. A
    per-block checkpointing plan that gives a few blocks another mode (the planner's) leaves such a run."""
    found = find_blocks(model)
    if len(found) < MIN_DEPTH:
        return None
    parents = {name.rpartition(".")[0] for name, _ in found}
    if len(parents) != 1:
        return None
    container = model.get_submodule(parents.pop())
    if not isinstance(container, (nn.ModuleList, nn.Sequential)) or len(container) != len(found):
        return None
    if list(container) != [m for _, m in found] or len({id(m) for _, m in found}) != len(found):
        return None
    signatures = [_signature(m) for _, m in found]
    if any(s.keys() != signatures[0].keys() for s in signatures):
        return None
    indices = {key for key in signatures[0] if _an_index([s[key] for s in signatures])}
    modes = applied_modes(model)
    keys = [
        (tuple((k, v) for k, v in s.items() if k not in indices), modes.get(name, "none"))
        for s, (name, _) in zip(signatures, found, strict=True)
    ]
    best = (0, 0)  # (start, length) of the longest run of equal keys
    start = 0
    for i in range(1, len(keys) + 1):
        if i == len(keys) or not _same(keys[i], keys[start]):
            if i - start > best[1]:
                best = (start, i - start)
            start = i
    run = Run(container, best[0], best[1], len(found))
    if run.length < MIN_DEPTH or run.others > run.length // 4:
        return None
    return run


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # a setting that does not compare (a tensor's truth value)
        return False


def repeated_blocks(model: nn.Module) -> tuple[nn.Module, int] | None:
    """The container of ``model``'s repeated blocks and their number, when every block is in the one run
    of copies (`repeated_run`) and the container holds nothing else; ``None`` otherwise."""
    run = repeated_run(model)
    if run is None or run.others:
        return None
    return run.container, run.length


def _signature(block: nn.Module) -> dict[tuple[str, str], Any]:
    """What decides how ``block`` allocates, but its weights' values: its modules' classes, tensors' shapes
    and every other attribute (`_setting`), ``nn.Module``'s own bookkeeping and ``forward`` (where
    checkpointing wraps it; `applied_modes` compares the modes) left out."""
    signature: dict[tuple[str, str], Any] = {}
    for name, module in block.named_modules():
        signature[(name, "__class__")] = type(module)
        for table in ("_parameters", "_buffers"):
            for key, t in module.__dict__[table].items():
                spec = None if t is None else (tuple(t.shape), t.dtype, t.requires_grad)
                signature[(name, f"{table}.{key}")] = spec
        for key, value in vars(module).items():
            if key not in _MODULE_BOOKKEEPING and not isinstance(value, (nn.Module, torch.Tensor)):
                signature[(name, key)] = _setting(value)
    return signature


#: What every ``nn.Module`` holds for itself (its tables and hooks), and the ``forward`` checkpointing sets.
_MODULE_BOOKKEEPING = frozenset(vars(nn.Module())) | {"forward"}


def _setting(value: Any, depth: int = 0) -> Any:
    """``value`` as something compared by equality across blocks: plain values as they are, containers
    element by element, a function by its qualified name, another object by its class and attributes (two
    levels deep); past that, or without attributes, the object itself, so two blocks alike hold the same
    one (a shared config) and blocks with objects of their own differ."""
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes, enum.Enum, torch.dtype)):
        return value
    if isinstance(value, torch.device):
        return str(value)
    if isinstance(value, (tuple, list, set, frozenset)):
        items = [_setting(v, depth) for v in value]
        return (type(value), tuple(sorted(items, key=repr) if isinstance(value, (set, frozenset)) else items))
    if isinstance(value, dict):
        return (dict, tuple(sorted(((repr(k), _setting(v, depth)) for k, v in value.items()), key=repr)))
    if isinstance(value, types.MethodType):  # a bound method: its function, whoever it is bound to
        value = value.__func__
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType)):
        return ("function", value.__module__, value.__qualname__)
    attributes = getattr(value, "__dict__", None)
    if depth < 2 and isinstance(attributes, dict):
        return (type(value), _setting(attributes, depth + 1))
    return ("object", id(value))


def _an_index(values: Sequence[Any]) -> bool:
    """Whether ``values`` count up by one, block after block (a ``layer_idx``)."""
    return all(type(v) is int for v in values) and all(b - a == 1 for a, b in itertools.pairwise(values))


@contextlib.contextmanager
def truncated(container: nn.Module, depth: int, run: Run | None = None) -> Iterator[None]:
    """``container`` holding only its first ``depth`` blocks while inside; with ``run``, only the first
    ``depth`` blocks of the run, and every block before and after it."""
    modules = container._modules
    kept = dict(modules)
    items = list(kept.items())
    if run is not None:
        items = items[: run.start] + items[run.start : run.start + depth] + items[run.start + run.length :]
    else:
        items = items[:depth]
    try:
        container._modules = dict(items)  # type: ignore[assignment]
        yield
    finally:
        container._modules = kept  # type: ignore[assignment]


# --------------------------------------------------------------------------------------------------
# The shortcut
# --------------------------------------------------------------------------------------------------


class Shortcut(NamedTuple):
    """The deep step as `shortcut` gives it: the breakdown at its peak and, when counted, its FLOPs and
    its forward and backward ops (``None`` otherwise)."""

    breakdown: MemoryBreakdown
    flops: int | None = None
    ops: int | None = None


def cost_ratio(model: nn.Module) -> float:
    """What the whole step of ``model`` costs against the shortcut's three shallow steps (a step that cannot
    take the shortcut, such as a per-block checkpointing plan's), by the blocks each runs."""
    run = repeated_run(model)
    return 1.0 if run is None else run.total / sum(d + run.others for d in _DEPTHS[0])


def shortcut(model: nn.Module, simulate: Callable[[], Tracker], *, count: bool = False) -> Shortcut | None:
    """``simulate()``'s step of ``model``, from its step at 1, 2 and 3 blocks (or 2, 3 and 4); ``None`` where
    the shortcut does not hold (`repeated_blocks`, the module docstring). ``count``: also the step's FLOPs
    and forward and backward ops (``simulate`` must keep a timeline), which grow by the same amount with
    each block."""
    run = repeated_run(model)
    if run is None:
        return None
    steps: dict[int, tuple[Tracker, tuple[int, int] | None] | None] = {}

    def step(shallow: int) -> tuple[Tracker, tuple[int, int] | None] | None:
        if shallow not in steps:
            counter = FlopCounterMode(display=False) if count else contextlib.nullcontext()
            with truncated(run.container, shallow, run), counter as c:
                try:
                    tracker = simulate()
                except Exception as error:  # a step that needs more blocks
                    log.debug("The %d-block step fails (%s).", shallow, error)
                    steps[shallow] = None
                    return None
            if tracker.history is None:  # type: ignore[attr-defined]
                raise AssertionError("shortcut needs trackers with a history")
            ops = sum(e.phase in ("forward", "backward") for e in tracker.timeline) if count else 0  # type: ignore[attr-defined]
            steps[shallow] = (tracker, (c.get_total_flops(), ops) if count else None)
        return steps[shallow]

    for depths in _DEPTHS:
        found = _from(run.length, [step(d) for d in depths], depths[0], count)
        if found is not None:
            return found
        log.debug("The steps at %s blocks do not predict one another.", depths)
    log.debug("No shallow steps predict the deep one: the whole model is simulated.")
    return None


def _from(depth: int, steps: list, first: int, count: bool) -> Shortcut | None:
    """The deep step from three shallow ones, ``first`` blocks and one and two more; ``None`` if they
    fail or do not predict one another."""
    if any(s is None for s in steps):
        return None
    n = depth - first
    breakdown = _extrapolate([tracker for tracker, _ in steps], n)
    if breakdown is None:
        return None
    if not count:
        return Shortcut(breakdown)
    deep = []
    for a, b, c in zip(*(counts for _, counts in steps), strict=True):
        if c - b != b - a:
            return None
        deep.append(a + n * (b - a))
    return Shortcut(breakdown, *deep)


@dataclass(frozen=True)
class _Phase:
    """One phase's points at the three depths and where one block's ops go in: ``inserts`` are the runs
    of ops the 3-block step adds to the 2-block step's, as ``(position in the 2-block step's points,
    length)``, in order (a phase can loop over the blocks more than once: FSDP2's forward views every
    parameter before it runs the blocks; a first step creates the optimizer state, then updates)."""

    points: tuple[list[_Point], list[_Point], list[_Point]]
    lives: tuple[list[int], list[int], list[int]]
    inserts: tuple[tuple[int, int], ...]


def _phases(history: History) -> list[tuple[str, list[_Point]]]:
    runs: list[tuple[str, list[_Point]]] = []
    for p in history.points:
        if runs and runs[-1][0] == p.phase:
            runs[-1][1].append(p)
        else:
            runs.append((p.phase, [p]))
    return runs


def _extrapolate(trackers: Sequence[Tracker], n: int) -> MemoryBreakdown | None:
    histories = [t.history for t in trackers]  # type: ignore[attr-defined]
    runs = [_phases(h) for h in histories]
    if not len(runs[0]) == len(runs[1]) == len(runs[2]) or any(
        not (a[0] == b[0] == c[0]) for a, b, c in zip(*runs, strict=True)
    ):
        return None
    phases = []
    for a, b, c in zip(*runs, strict=True):
        points = (a[1], b[1], c[1])
        lives = tuple([h.live(p) for p in pts] for h, pts in zip(histories, points, strict=True))
        phase = _aligned(points, lives)  # type: ignore[arg-type]
        if phase is None:
            return None
        phases.append(phase)
    # The first highest point of the deep step, phase by phase in order (the tracker keeps the first).
    best: tuple[int, _Phase, int] | None = None
    for phase in phases:
        lives = _predicted(phase, n)
        top = max(lives, default=None)
        if top is not None and (best is None or top > best[0]):
            best = (top, phase, lives.index(top))
    if best is None:
        return None
    peak, phase, at = best
    return _breakdown(trackers, histories, phase, at, n, peak)


def _aligned(points: tuple[list[_Point], ...], lives: tuple[list[int], ...]) -> _Phase | None:
    """Where the 3-block step's extra ops go in among the 2-block step's, such that the rule predicts the
    4-block step exactly; ``None`` if no place does."""
    a, b, c = ([p.op for p in pts] for pts in points)
    if len(c) - len(b) != len(b) - len(a):
        return None
    matcher = difflib.SequenceMatcher(a=a, b=b, autojunk=False)
    found = [(i1, j2 - j1) for tag, i1, _, j1, j2 in matcher.get_opcodes() if tag != "equal"]
    if any(tag not in ("equal", "insert") for tag, *_ in matcher.get_opcodes()):
        return None
    # An inserted run of repeated ops can sit anywhere it slides to with the same ops around it: the
    # place that predicts the 4-block step is the one (each run's, in turn).
    inserts = list(found)
    for k, (at, width) in enumerate(found):
        offset = sum(w for _, w in inserts[:k])
        run = b[at + offset : at + offset + width]
        places = [at]
        lo = at
        while lo > 0 and a[lo - 1] == run[(lo - 1 - at) % width] and lo - 1 > _end(inserts, k - 1):
            lo -= 1
            places.append(lo)
        hi = at
        while (
            hi < len(a)
            and a[hi] == run[(hi - at) % width]
            and (k + 1 == len(found) or hi + 1 < found[k + 1][0])
        ):
            hi += 1
            places.append(hi)
        best = None
        for place in places:
            inserts[k] = (place, width)
            missed = _missed(_Phase(points, lives, tuple(inserts)), c)  # type: ignore[arg-type]
            if best is None or missed < best[0]:
                best = (missed, place)
            if missed == 0:  # the first place that predicts it: no later one is taken over it
                break
        inserts[k] = (best[1], width) if best is not None else (at, width)
    phase = _Phase(points, lives, tuple(inserts))  # type: ignore[arg-type]
    return phase if _missed(phase, c) == 0 else None


def _end(inserts: list[tuple[int, int]], k: int) -> int:
    return -1 if k < 0 else inserts[k][0]


def _missed(phase: _Phase, ops: list[Any]) -> int:
    """How many of the 4-block step's points the rule gets wrong (ops or bytes)."""
    predicted = _predicted(phase, 2)
    a_ops = [p.op for p in phase.points[0]]
    b_ops = [p.op for p in phase.points[1]]
    expected: list[Any] = []
    j, shift = 0, 0
    for at, width in phase.inserts:
        expected += a_ops[j:at] + b_ops[at + shift : at + shift + width] * 2
        j, shift = at, shift + width
    expected += a_ops[j:]
    truth = phase.lives[2]
    if len(predicted) != len(truth) or len(expected) != len(ops):
        return len(truth) + 1
    return sum(x != y for x, y in zip(predicted, truth, strict=True)) + sum(
        x != y for x, y in zip(expected, ops, strict=True)
    )


def _predicted(phase: _Phase, n: int) -> list[int]:
    """The phase's live figures with ``n`` more blocks than the 2-block step."""
    a, b, _ = phase.lives
    out: list[int] = []
    j, shift = 0, 0  # the next of the 2-block step's points; where it sits in the 3-block step
    for at, width in phase.inserts:
        out += [a[k] + n * (b[k + shift] - a[k]) for k in range(j, at)]
        if n:
            if at == 0 or at == len(a):
                return []  # nothing either side to tell how the inserted runs move: unpredictable
            # how the points either side moved with one more block
            before, after = b[at - 1 + shift] - a[at - 1], b[at + shift + width] - a[at]
            run = b[at + shift : at + shift + width]
            out += [live + (n - 1) * before + r * (after - before) for r in range(n) for live in run]
        j, shift = at, shift + width
    out += [a[k] + n * (b[k + shift] - a[k]) for k in range(j, len(a))]
    return out


def _breakdown(trackers, histories, phase: _Phase, at: int, n: int, peak: int) -> MemoryBreakdown | None:
    """The breakdown at point ``at`` of the deep step's ``phase``: the 3- and 4-block steps' at the same
    point, extended ``n - 1`` blocks further."""
    same: tuple[int | None, int, int] | None = None
    j, shift, deep = 0, 0, 0  # the 2-block step's next point, its offset at 3 blocks, the deep step's
    for start, width in (*phase.inserts, (len(phase.points[0]), 0)):
        if at < deep + start - j:  # one of the 2-block step's points
            k = j + at - deep
            same = (k, k + shift, k + 2 * shift)
            break
        deep += start - j
        if at < deep + n * width:  # in the first or the last copy of this inserted run
            r, e = divmod(at - deep, width)
            if r not in (0, n - 1):
                return None
            last = width if r == n - 1 and n > 1 else 0
            same = (None, start + shift + e, start + 2 * shift + last + e)
            break
        deep += n * width
        j, shift = start, shift + width
    if same is None or same[2] >= len(phase.points[2]):
        return None
    at_depth = [
        None if k is None else h.breakdown_at(t, phase.points[d][k])
        for d, (k, h, t) in enumerate(zip(same, histories, trackers, strict=True))
    ]
    _, one, two = at_depth
    assert one is not None and two is not None
    steps = n - 1
    values = {c: getattr(one, c) + steps * (getattr(two, c) - getattr(one, c)) for c in CATEGORIES}
    if at_depth[0] is not None:  # three depths: the same steps each time
        zero = at_depth[0]
        if any(getattr(one, c) - getattr(zero, c) != getattr(two, c) - getattr(one, c) for c in CATEGORIES):
            return None
    if any(v < 0 for v in values.values()) or sum(values.values()) != peak:
        return None
    return MemoryBreakdown(**values)
