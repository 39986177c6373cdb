"""Which training steps `MemoryMonitor` measures, and what the others reuse: a measured *twin*.

A measured step follows every op (about 1.3x a plain step on CPU), so it is done only for steps unlike any
measured before. Two steps are alike when their *signature* matches: the shape, dtype and device of every
tensor in the batch, however it is nested (`batch_signature`), which parameters hold a gradient when the
step begins, how many tensors and bytes the optimizers keep (`optimizer_signature`), and whether the step
accumulates or steps. Steps alike allocate alike, so a later step reuses the exact breakdown of its
measured twin (`Twins`). A batch the signature cannot see into and an optimizer whose step allocates by
value (LBFGS) have no twins, nor has a step that sized a tensor by the values of others: such steps are
measured every time. So are all steps of FSDP2 and tensor parallel on the CPU, where gloo's worker threads
time when a collective's buffers are freed, and one step in ``remeasure_every_n_steps`` anyway.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import types
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_memkit._breakdown import MemoryBreakdown
from lightning_memkit._diagnosis.oom import PHASES
from lightning_memkit._measuring.measurement import MemoryMeasurement, measure
from lightning_memkit._measuring.storages import leaves, optimizer_tensors, storage_bytes
from lightning_memkit._sharding.layout import layout_of
from lightning_memkit.callbacks._trainer import accumulating_now

#: Signatures whose breakdowns are kept at most (the least recently measured goes first).
_MAX_SIGNATURES = 64
#: Objects a batch signature walks at most; a larger batch is measured every step rather than guessed at.
_MAX_NODES = 10_000
#: Nesting a batch signature follows at most.
_MAX_DEPTH = 32

#: What a step logs besides its breakdown (`parts`, and each phase's highest), by key; ``None``: nothing.
Extras = tuple[dict[str, int] | None, dict[str, int] | None]


class Twins:
    """The breakdowns of the measured steps by signature, and the measurement of the step in flight.

    Per step: `start` (measure it, or leave it to its twin), `enter_phase` as the step goes on, `finish`
    (its breakdown, measured or the twin's) and `extras` (what it logs besides). ``warn(key, message)``
    says what a step's measurement found once per key.
    """

    def __init__(self, remeasure_every_n_steps: int, warn: Callable[[str, str], None]) -> None:
        self.remeasure_every_n_steps = remeasure_every_n_steps
        self._warn = warn
        #: How many steps were measured from scratch (the rest reused a twin's breakdown).
        self.measured_steps = 0
        #: the signature of the step in flight (``None``: it has no twins) and its measurement, if measured
        self.signature: tuple | None = None
        self.measurement: MemoryMeasurement | None = None
        self._breakdowns: OrderedDict[tuple, MemoryBreakdown | None] = OrderedDict()  # None: unmeasurable
        #: the extras of each measured signature that has any
        self._extras: dict[tuple, Extras] = {}
        self._since_measured = 0
        #: whether steps alike allocate alike: not for FSDP2 and tensor parallel on the CPU, where gloo's
        #: worker threads time when a collective's buffers are freed (the same step peaked up to a layer's
        #: buffers higher); decided at the first step
        self._alike: bool | None = None
        #: the last measured step's breakdown, extras and the op that sized a tensor by values in it
        #: (`MemoryMeasurement.value_shaped`)
        self._last = MemoryBreakdown()
        self._last_parts: dict[str, int] | None = None
        self._last_phases: dict[str, int] | None = None
        self._last_value_shaped: str | None = None

    def start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, device: torch.device
    ) -> bool:
        """Begin a training step: measure it (``True``) unless a twin's breakdown will do (``False``; on
        CUDA the allocator's peak is reset, to read this very step's)."""
        self.close()  # one a skipped step left open (see `MemoryMonitor.on_train_epoch_end`)
        self.signature = step_signature(trainer, pl_module, batch)
        if self._needs_measuring(pl_module, device):
            self.measurement = measure(pl_module, trainer.optimizers, device=device, batch=batch)
            self.measurement.__enter__()
            self.measurement.enter_phase(PHASES[0])
            return True
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        return False

    def _needs_measuring(self, pl_module: pl.LightningModule, device: torch.device) -> bool:
        """Whether the step in flight is measured: it has no twin, a re-measure is due, or steps alike
        do not allocate alike on this run."""
        every = self.remeasure_every_n_steps
        due = every and self._since_measured + 1 >= every
        if self._alike is None:
            # FSDP2's shards are DTensors too: the layout names both
            self._alike = not (device.type == "cpu" and layout_of(pl_module))
        return (
            self.signature is None or self.signature not in self._breakdowns or bool(due) or not self._alike
        )

    def enter_phase(self, phase: str) -> None:
        """The measured step in flight enters ``phase`` (one of `PHASES`), for each phase's highest."""
        if self.measurement is not None:
            self.measurement.enter_phase(phase)

    def finish(self, step: int, device: torch.device) -> MemoryBreakdown | None:
        """The breakdown of the step in flight (``step``: its index, for a warning); ``None`` for a step that
        cannot be measured (nor its twins)."""
        if self.measurement is not None:
            return self._finish_measured(step)
        self._since_measured += 1
        twin = self._breakdowns[self.signature]
        if twin is None or device.type != "cuda":
            return twin
        # The allocator knows this very step's peak; what differs from the twin is not a known tensor.
        peak = torch.cuda.max_memory_allocated(device)
        return dataclasses.replace(twin, temporary=max(peak - (twin.peak - twin.temporary), 0))

    def _finish_measured(self, step: int) -> MemoryBreakdown | None:
        unfollowed = self.close()
        breakdown = None if unfollowed else self._last
        if unfollowed:
            self._warn(
                "unfollowed",
                f"MemoryMonitor: step {step} is not measured: {unfollowed}, which the measurement cannot "
                "follow. Steps like it are left unmeasured; training is unaffected.",
            )
        if self._last_value_shaped is not None:  # the step's values sized it: no twin of any other
            self._warn(
                "value_shaped",
                f"MemoryMonitor: this model's step sizes tensors by the values of others "
                f"({self._last_value_shaped}: mixture-of-experts routing token by token, sequences packed by "
                "their lengths), so steps of the same shapes allocate differently: every step is measured "
                "(about 1.3x a plain step on the CPU), none takes another's figures.",
            )
        elif self.signature is not None:  # a batch it cannot see into is no twin of any other
            self._remember(self.signature, breakdown)
        self.measured_steps += breakdown is not None
        self._since_measured = 0
        return breakdown

    def _remember(self, signature: tuple, breakdown: MemoryBreakdown | None) -> None:
        """Keep a measured step's breakdown and extras for its twins (the oldest out past
        `_MAX_SIGNATURES`)."""
        self._breakdowns[signature] = breakdown
        self._breakdowns.move_to_end(signature)
        while len(self._breakdowns) > _MAX_SIGNATURES:
            self._extras.pop(self._breakdowns.popitem(last=False)[0], None)
        if self._last_parts is not None or self._last_phases is not None:
            self._extras[signature] = (self._last_parts, self._last_phases)

    def extras(self) -> Extras:
        """What the step in flight logs besides its breakdown: its twin's, else the last measured step's."""
        return self._extras.get(self.signature, (self._last_parts, self._last_phases))  # type: ignore[arg-type]

    def twin(self) -> MemoryBreakdown | None:
        """The measured breakdown of the step in flight's signature, if any (for an OOM's explanation)."""
        return None if self.signature is None else self._breakdowns.get(self.signature)

    def close(self) -> str | None:
        """Close the measurement in flight, if any; returns why its step could not be followed, if so."""
        if self.measurement is None:
            return None
        measurement, self.measurement = self.measurement, None
        measurement.__exit__(None, None, None)
        self._last, self._last_parts = measurement.breakdown, _parts(measurement)
        self._last_phases = measurement.phase_peaks
        self._last_value_shaped = measurement.value_shaped
        return measurement.unfollowed

    def close_quietly(self) -> None:
        """`close`, for a run already failing or ending: an error closing it is dropped with it."""
        try:
            self.close()
        except Exception:
            self.measurement = None


def _parts(measurement: Any) -> dict[str, int] | None:
    """The parts of categories a measured step logs besides them (bytes), by key after ``memory/``: FSDP2's
    (``fsdp/sharded_parameters``, ...) and the parameters' split where some are frozen
    (``trainable_parameters``, ``frozen_parameters``); ``None`` for a step that has neither."""
    parts = {f"fsdp/{kind}": value for kind, value in (measurement.sharded or {}).items()}
    parts.update(measurement.parameter_split or {})
    return parts or None


# --- signatures -----------------------------------------------------------------------------------

#: Optimizers whose step allocates by the values it sees, so that no earlier step is a twin: LBFGS runs
#: the closure until it converges (up to ``max_iter`` times) and keeps a curvature pair only where
#: ``y·s > 1e-10``, so two steps that begin with the same state can peak differently (tiny MLP, history 10:
#: 6.4 % apart).
_VALUE_DEPENDENT: tuple[type, ...] = (torch.optim.LBFGS,)

_ATOMS = (
    type(None), bool, int, float, complex, str, bytes, range, slice, enum.Enum, torch.dtype, torch.device,
    datetime.date, datetime.time, datetime.timedelta,
)  # fmt: skip


_CODE = (type, types.ModuleType, types.FunctionType, types.MethodType, types.BuiltinFunctionType)


def step_signature(trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> tuple | None:
    """What decides a step's allocations, cheaply: shapes, gradients held, optimizer state, stepping.

    ``None`` when the batch cannot be seen into (`batch_signature`) or an optimizer's step depends on
    values (`optimizer_signature`): such a step is always measured.
    """
    shapes = batch_signature(batch)
    if shapes is None or any(isinstance(opt, _VALUE_DEPENDENT) for opt in trainer.optimizers):
        return None
    grads = tuple(p.grad is not None for p in pl_module.parameters())
    states = tuple(optimizer_signature(opt) for opt in trainer.optimizers)
    return shapes, grads, states, accumulating_now(trainer)


class _Opaque(Exception):
    """The batch holds something the signature cannot see into."""


def batch_signature(batch: Any) -> tuple | None:
    """Every tensor in ``batch`` (shape, dtype, device) with the structure around it; ``None`` when it
    cannot be read.

    Walks what users pass as batches, nested arbitrarily: tensors (and arrays with ``shape``/``dtype``),
    sequences, sets, mappings (``dict``, ``UserDict`` and so Hugging Face's ``BatchEncoding``), dataclasses,
    named tuples and any object whose ``__dict__`` or ``__slots__`` holds them; an object met twice (a
    cycle, a shared tensor) is referred back to. Values of numbers and strings are not part of it (a batch
    of per-sample strings would otherwise never match), only their types. ``None`` (measure the step, never
    reuse a twin) when the batch holds no tensor, an object with no attributes to read (a C extension's),
    or more than ``_MAX_NODES`` objects or ``_MAX_DEPTH`` levels.
    """
    seen: dict[int, int] = {}
    found = [0]

    def walk(obj: Any, depth: int) -> Any:
        if isinstance(obj, _ATOMS):
            return type(obj).__name__
        if depth > _MAX_DEPTH or len(seen) >= _MAX_NODES:
            raise _Opaque
        if id(obj) in seen:
            return ("ref", seen[id(obj)])
        seen[id(obj)] = len(seen)
        kind = f"{type(obj).__module__}.{type(obj).__qualname__}"
        if isinstance(obj, torch.Tensor):
            found[0] += 1
            if obj.layout is not torch.strided:  # a sparse tensor's memory is its members': nnz varies
                return (kind, tuple(obj.shape), obj.dtype, obj.device, obj.layout, _member_shapes(obj))
            return (kind, tuple(obj.shape), obj.dtype, obj.device)
        shape, dtype = getattr(obj, "shape", None), getattr(obj, "dtype", None)
        if isinstance(shape, tuple) and dtype is not None and not isinstance(obj, type):  # numpy and the like
            found[0] += 1
            return (kind, shape, str(dtype))
        if isinstance(obj, Mapping):
            return (kind, tuple((_key(k), walk(v, depth + 1)) for k, v in obj.items()))
        if isinstance(obj, (list, tuple)):
            return (kind, tuple(walk(v, depth + 1) for v in obj))
        if isinstance(obj, (set, frozenset)):
            return (kind, tuple(sorted(map(repr, (walk(v, depth + 1) for v in obj)))))
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            fields = [(f.name, getattr(obj, f.name, None)) for f in dataclasses.fields(obj)]
            return (kind, tuple((name, walk(v, depth + 1)) for name, v in fields))
        attributes = _attributes(obj)
        if attributes is None:
            raise _Opaque
        return (kind, tuple((name, walk(v, depth + 1)) for name, v in attributes))

    try:
        signature = walk(batch, 0)
    except Exception:  # _Opaque, or an attribute that raised when read: measure rather than guess
        return None
    return signature if found[0] else None


def _member_shapes(t: torch.Tensor) -> tuple:
    """The shapes of the tensors holding a sparse ``t``'s memory (indices, values: their sizes vary with
    the number of its non-zeros); a layout whose members cannot be read is opaque (measured every step)."""
    try:
        return tuple(tuple(m.shape) for m in leaves(t))
    except Exception:
        raise _Opaque from None


def _key(key: Any) -> Any:
    return key if isinstance(key, _ATOMS) else repr(key)


def _attributes(obj: Any) -> list[tuple[str, Any]] | None:
    """``obj``'s instance attributes (``__dict__`` and ``__slots__``); ``None`` for an object without any.
    Classes, modules and functions are read as their types alone: they are code, not data."""
    if isinstance(obj, _CODE) or (callable(obj) and not hasattr(obj, "__dict__")):
        return []
    names: list[str] = []
    for cls in type(obj).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        names += (
            [slots] if isinstance(slots, str) else [n for n in slots if n not in ("__dict__", "__weakref__")]
        )
    items = [(n, getattr(obj, n)) for n in names if hasattr(obj, n)]
    if hasattr(obj, "__dict__"):
        items += list(vars(obj).items())
    elif not names:
        return None
    return items


def optimizer_signature(optimizer: torch.optim.Optimizer) -> tuple[int, int, int]:
    """(entries, tensors, bytes) of ``optimizer.state``: its count alone misses state that grows inside
    an entry, as LBFGS's history (``old_dirs``, ``old_stps``, ``ro``: lists of tensors) does."""
    tensors = list(optimizer_tensors([optimizer]))
    return len(optimizer.state), len(tensors), storage_bytes(tensors)
