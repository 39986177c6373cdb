"""What each block costs under each checkpointing mode, measured rather than assumed.

The planner needs, per block and mode, three figures, and reads them from the block's own ops inside one
simulated step (`estimate_memory`: fake tensors, so nothing is allocated, and precision and autocast are
those of the real step). Each distinct block is run forward and backward once per mode, in a ledger:

- ``R``: bytes the block keeps after its forward (what autograd saved, SAC's cache, checkpoint inputs);
- ``X``: the block's highest footprint during its backward (``R`` + recomputed tensors + gradients);
- the ops recomputed: those of forward+backward under the mode beyond those without it, with their FLOPs
  by ``torch.utils.flop_counter``'s formulas. Their cost is, with ``cost="measured"``, their time benchmarked
  one by one on the device with random data of their shapes; with ``cost="flops"``, their count.

The ledger is not `measure`'s storage tracker, though it counts storages the same way (one record per
storage, dead when its weak reference fires, in the allocator's rounding): the tracker follows a whole
step and sorts its peak into categories, counting everything the step touches; the ledger follows one
block run alone and counts only what the block allocates, less its output and the incoming gradient, so
that ``R`` and ``X`` add up block by block in the planner's peak model.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any
from weakref import ref

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.flop_counter import flop_registry

from lightning_memkit._checkpointing.checkpointers import CHECKPOINTERS, mutates_cached_output
from lightning_memkit._checkpointing.policies import CheckpointedForward
from lightning_memkit._estimating.routing import recording_now, rewound
from lightning_memkit._measuring.kernels import hashable
from lightning_memkit._measuring.storages import Storage, rounded

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _TensorSpec:
    """What an op needs to know about a tensor argument to be re-run on random data (a pytree leaf)."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    def materialize(self, device: torch.device) -> Tensor:
        t = torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=device)
        if t.is_floating_point() or t.is_complex():
            return t.normal_()
        return t.zero_()  # indices, masks and counts: zeros are valid everywhere


def _spec(x: Any) -> Any:
    """A hashable stand-in for an op's or a block's argument: what identifies the op run or the block."""
    if isinstance(x, Tensor):
        return _TensorSpec(tuple(x.shape), tuple(x.stride()), x.dtype)
    if x is None or isinstance(
        x, (bool, int, float, str, torch.dtype, torch.device, torch.layout, torch.memory_format)
    ):
        return x
    return type(x).__name__  # a generator, a cache object: its type is what we can compare


def _flops(func: Any, args: tuple, kwargs: dict, out: Any) -> int:
    formula = flop_registry.get(getattr(func, "overloadpacket", None))
    if formula is None:
        return 0
    return int(formula(*args, **kwargs, out_val=out))


def _numel(out: Any) -> int:
    return sum(t.numel() for t in tree_leaves(out) if isinstance(t, Tensor))


@dataclass(frozen=True)
class _Op:
    """One op run, as the cost model needs it: ``key`` identifies the op and its argument shapes."""

    key: tuple
    flops: int
    numel: int  # elements written (the ``cost="flops"`` stand-in for ops without a FLOP formula)
    view: bool


class _Ledger(TorchDispatchMode):
    """Storages born while active (live bytes and their highest point) and every op run."""

    def __init__(self, rounding: int) -> None:
        super().__init__()
        self.rounding = rounding
        self.live: dict[int, tuple[ref, Storage]] = {}  # id(storage) -> (weakref, record)
        self.current = 0
        self.peak = 0
        self.ops: list[_Op] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        key = (func, hashable(tree_map(_spec, args)), hashable(tree_map(_spec, kwargs)))
        self.ops.append(_Op(key, _flops(func, args, kwargs, out), _numel(out), func.is_view))
        for t in tree_leaves(out):
            if isinstance(t, Tensor):
                self._born(t)
        self.peak = max(self.peak, self.current)
        return out

    def _born(self, t: Tensor) -> None:
        storage = t.untyped_storage()
        key = id(storage)
        if key in self.live:
            return
        record = Storage(rounded(storage.nbytes(), self.rounding))
        self.live[key] = (ref(storage, lambda _, key=key: self._free(key)), record)
        self.current += record.nbytes

    def _free(self, key: int) -> None:
        entry = self.live.pop(key, None)
        if entry is not None:
            self.current -= entry[1].nbytes

    def exclude(self, t: Tensor) -> None:
        """Stop counting ``t``'s storage (the block's output and its incoming gradient)."""
        entry = self.live.get(id(t.untyped_storage()))
        if entry is not None:
            self.current -= entry[1].nbytes
            entry[1].nbytes = 0


@dataclass
class _Run:
    """One block under one mode: kept bytes, backward footprint, and the ops of forward+backward."""

    retained: int
    footprint: int
    ops: list[_Op]


def _detached(x: Any) -> Any:
    if not isinstance(x, Tensor):
        return x
    y = x.detach()
    return y.requires_grad_() if x.requires_grad else y


def _without_kv_cache(x: Any) -> Any:
    """``None`` for a Hugging Face ``Cache`` (``DynamicCache``, ``EncoderDecoderCache``...), else ``x``."""
    if isinstance(x, (Tensor, type(None), bool, int, float, str)):
        return x
    is_cache = any(c.__name__ == "Cache" and c.__module__.startswith("transformers") for c in type(x).__mro__)
    return None if is_cache else x


def _run_block(block: nn.Module, checkpointer: Any, args: tuple, kwargs: dict, rounding: int) -> _Run:
    """Forward and backward of ``block`` alone on (detached) ``args``, under ``checkpointer``, in a ledger."""
    params = [p for p in block.parameters() if p.requires_grad]
    grads = [p.grad for p in params]
    for p in params:
        p.grad = None
    previous = block.__dict__.get("forward")
    if isinstance(previous, CheckpointedForward):
        previous = previous.previous
    call = CheckpointedForward(block, checkpointer, previous)
    forward = call if checkpointer.checkpoints else call.original()
    # Hugging Face's key/value cache is shared by the whole step and filled as it goes: running the block
    # again with it would extend it (and backpropagate through the step's graph). The planner profiles with
    # the cache off; should a caller pass one all the same, the block runs as without it.
    args, kwargs = tree_map(_without_kv_cache, args), tree_map(_without_kv_cache, kwargs)
    args, kwargs = tree_map(_detached, args), tree_map(_detached, kwargs)
    ledger = _Ledger(rounding)
    try:
        with ledger:
            out = forward(*args, **kwargs)
            outs = [t for t in tree_leaves(out) if isinstance(t, Tensor)]
            for t in outs:
                ledger.exclude(t)
            retained = ledger.current
            ledger.peak = ledger.current
            roots = [t for t in outs if t.requires_grad]
            seeds = [torch.ones_like(t) for t in roots]
            for s in seeds:
                ledger.exclude(s)
            if roots:
                torch.autograd.backward(roots, seeds)
            footprint = ledger.peak
            del out, outs, roots, seeds
    finally:
        for p, g in zip(params, grads, strict=True):
            p.grad = g
    return _Run(retained, footprint, ledger.ops)


@dataclass(frozen=True)
class _Option:
    """A block under one mode, as the DP sees it. ``cost`` is an integer (ns or FLOP units)."""

    retained: int
    footprint: int
    cost: int
    flops: int = 0
    seconds: float | None = None


@dataclass(frozen=True)
class BlockCosts:
    """A DP item: the block's options by mode (in `CHECKPOINT_MODES` order) and its gradients' bytes."""

    name: str
    options: dict[str, _Option]
    grads: int
    #: modes the block cannot run under: selective ones where it mutates an output they keep
    refused: frozenset[str] = frozenset()

    def allowed(self, mode: str) -> str:
        """``mode``, or the next stronger mode the block can run under (``"full"`` always can)."""
        if mode not in self.refused:
            return mode
        modes = list(CHECKPOINTERS)
        return next((m for m in modes[modes.index(mode) :] if m in self.options), "full")


class OpTimer:
    """Seconds per op, benchmarked on ``device`` with random data of the recorded shapes.

    Op by op rather than whole blocks: an op is short, so the best of a few runs is stable even on a shared
    machine, where a block's forward+backward varies by more than what recomputation costs; and no mode
    can come out free by chance. On CPU an op runs on one thread and is read by that thread's CPU clock
    (the best of five runs); on CUDA ten runs go between two synchronizations. In place, recomputation
    costs somewhat more than the sum of its ops (cold caches, allocations): the figures rank the modes
    and report their order of magnitude; the benchmark measures real steps.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seconds: dict[tuple, float] = {}
        self.failed: set[Any] = set()

    def __call__(self, op: _Op) -> float:
        if op.view:
            return 0.0
        if op.key not in self.seconds:
            self.seconds[op.key] = self._time(op.key)
        return self.seconds[op.key]

    def _time(self, key: tuple) -> float:
        func, args, kwargs = key

        def make(x: Any) -> Any:
            if isinstance(x, _TensorSpec):
                return x.materialize(self.device)
            return self.device if isinstance(x, torch.device) else x

        cuda = self.device.type == "cuda"
        threads = torch.get_num_threads()
        with torch.random.fork_rng(devices=[self.device] if cuda else []), torch.no_grad():
            try:
                if not cuda:
                    torch.set_num_threads(1)
                a, kw = tree_map(make, list(args)), tree_map(make, dict(kwargs))
                func(*a, **kw)  # warm-up, and a check that random data is acceptable
                if cuda:
                    torch.cuda.synchronize(self.device)
                    start = time.perf_counter()
                    for _ in range(10):
                        func(*a, **kw)
                    torch.cuda.synchronize(self.device)
                    return (time.perf_counter() - start) / 10
                best = math.inf
                for _ in range(5):
                    start = time.thread_time()
                    func(*a, **kw)
                    best = min(best, time.thread_time() - start)
                return best
            except (RuntimeError, ValueError, TypeError, IndexError) as e:
                # An op that needs particular values (valid offsets, sorted indices), or an argument that
                # cannot be recreated: left out of the cost, and named in the log.
                log.debug("Could not time %s on random data: %s", func, e)
                self.failed.add(func)
                return 0.0
            finally:
                torch.set_num_threads(threads)


def block_options(runs: dict[str, _Run], cost: str, timer: OpTimer | None) -> tuple[dict[str, _Option], int]:
    """Per mode, the DP's option; and the block's forward+backward cost without checkpointing.

    The recomputed ops are those run under the mode beyond the ones run without it. ``cost="measured"``:
    their benchmarked time, in integer nanoseconds (the DP's sums stay exact). ``cost="flops"``: their FLOP
    formula, or the elements they write where there is none.
    """

    def op_cost(op: _Op) -> int:
        if timer is not None:
            return round(1e9 * timer(op))
        return op.flops if op.flops else (0 if op.view else op.numel)

    base = runs["none"]
    base_keys = Counter(op.key for op in base.ops)
    options = {}
    for name, run in runs.items():
        recomputed = Counter(op.key for op in run.ops) - base_keys  # the positive part: ops run again
        by_key = {op.key: op for op in run.ops}
        ops = [by_key[k] for k, n in recomputed.items() for _ in range(n)]
        spent = sum(op_cost(op) for op in ops)
        options[name] = _Option(
            retained=run.retained,
            footprint=run.footprint,
            cost=spent,
            flops=sum(op.flops for op in ops),
            seconds=spent / 1e9 if timer is not None else None,
        )
    return options, sum(op_cost(op) for op in base.ops)


class BlockProfiler:
    """Forward pre-hooks that profile every distinct block the first time it runs in a simulated step."""

    def __init__(self, blocks: list[tuple[str, nn.Module]], modes: Sequence[str], rounding: int) -> None:
        self.blocks = blocks
        self.modes = modes
        self.rounding = rounding
        self.order: list[str] = []  # block names in execution order
        self.signature: dict[str, tuple] = {}
        self.runs: dict[tuple, dict[str, _Run]] = {}
        #: per signature, the modes the block could not run under (selective where it mutates a kept output)
        self.refused: dict[tuple, set[str]] = {}
        self.grads: dict[str, int] = {}
        self._busy = False

    @contextlib.contextmanager
    def hooks(self) -> Iterator[None]:
        handles = [
            module.register_forward_pre_hook(functools.partial(self._hook, name), with_kwargs=True)
            for name, module in self.blocks
        ]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def alike(self, names: Sequence[str]) -> None:
        """The blocks ``names``, in order, profiled as the last one profiled: copies of one block
        (`_estimating.repeated.repeated_blocks`) of which only the first ran."""
        last = self.order[-1]
        for name in names:
            if name not in self.signature:
                self.order.append(name)
                self.signature[name], self.grads[name] = self.signature[last], self.grads[last]

    def _hook(self, name: str, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._busy or name in self.signature or recording_now():  # the routing's real forward: not ours
            return
        self.order.append(name)
        params = tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in module.named_parameters())
        inputs = hashable(tree_map(_spec, (args, kwargs)))
        signature = (type(module), params, inputs, module.training)
        self.signature[name] = signature
        self.grads[name] = sum(
            rounded(p.untyped_storage().nbytes(), self.rounding)
            for p in module.parameters()
            if p.requires_grad
        )
        if signature in self.runs:
            return
        self._busy = True
        runs, refused = {}, set()
        try:
            for mode in self.modes:
                try:
                    with rewound():  # a routed block's runs replay the routing its call will
                        runs[mode] = _run_block(module, CHECKPOINTERS[mode], args, kwargs, self.rounding)
                except RuntimeError as e:
                    if not mutates_cached_output(e):
                        raise
                    refused.add(mode)
            if refused and "full" not in runs:  # what such a block gets instead (`BlockCosts.allowed`)
                with rewound():
                    runs["full"] = _run_block(module, CHECKPOINTERS["full"], args, kwargs, self.rounding)
        finally:
            self._busy = False
        self.runs[signature], self.refused[signature] = runs, refused
