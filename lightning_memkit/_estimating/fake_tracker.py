"""The storage tracker of a simulated step: `measure`'s `Tracker` over fake CPU tensors.

`_SimTracker` counts the fake tensors' storages in the target device's rounding, answers the values a
fake tensor does not have (from the batch's shadows, or a placeholder), sizes value-shaped ops from a
recorded routing, and tells what it sees to its listeners (`TrackerListener`): an optional history
(`_estimating.repeated`), tracer (`_estimating.trace`) and timeline (`Timeline`: `estimate_memory`'s
result's ``timeline``). `track` runs one step under a fresh one, with CUDA's step counters and cuBLAS's
workspaces (`cublas_workspace_bytes`) accounted as a CUDA step holds them. Why the fakes are CPU
tensors: `_estimating.simulate`.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import re
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import DynamicOutputShapeException, FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_memkit._estimating import repeated
from lightning_memkit._estimating import routing as _routing
from lightning_memkit._estimating import shadow as _shadow
from lightning_memkit._estimating.lightning_step import TrainingStep
from lightning_memkit._estimating.trace import Tracer
from lightning_memkit._measuring import claims
from lightning_memkit._measuring import kernels as _kernels
from lightning_memkit._measuring.listening import TrackerListener
from lightning_memkit._measuring.ops import _value_shaped
from lightning_memkit._measuring.storages import _iter_tensors, allocation_rounding
from lightning_memkit._measuring.tracker import Tracker

__all__ = [
    "NOT_RECORDED",
    "SIM_DEVICE",
    "Placeholders",
    "Timeline",
    "TimelineEvent",
    "cublas_workspace_bytes",
    "track",
]


SIM_DEVICE = torch.device("cpu")  # where the fake tensors live; `_estimating.simulate` says why
# Left out of the timeline: metadata queries (fake tensors answer ``.device`` through dispatch) and the
# profiler's record_function markers. They allocate nothing.
_UNTIMED = frozenset({"prim", "profiler"})
# A fake tensor's ``.device``, asked through dispatch: three in five of a simulated step's dispatches.
_DEVICE_QUERY = torch.ops.prim.device.default


class TimelineEvent(NamedTuple):
    """One op of the simulated step, as in ``estimate_memory(..., timeline=True).timeline``."""

    phase: str  # "forward" | "zero_grad" | "backward" | "optimizer"
    op: str  # the aten overload that ran, e.g. "aten.mm.default"
    live: int  # bytes live on the device right after the op (the peak is the highest of these)


def _placeholder_scalar(func: Any, args: tuple) -> Any:
    """A stand-in for ``.item()`` of a fake tensor, whose value does not exist; ``None`` otherwise.

    1 for numbers keeps optimizers' bias corrections finite (AdamW divides by ``1 - beta ** step``);
    False for booleans keeps "skip this step if the loss is NaN" branches on the common path.
    """
    if func is torch.ops.aten._local_scalar_dense.default and isinstance(args[0], FakeTensor):
        dtype = args[0].dtype
        if dtype == torch.bool:
            return False
        return 1.0 if dtype.is_floating_point or dtype.is_complex else 1
    return None


#: ``aten._grouped_mm``, in the torch versions that have it
_GROUPED_MM = _kernels._ops("_grouped_mm")


def _is_float_not_bf16(t: Any) -> bool:
    return isinstance(t, Tensor) and t.is_floating_point() and t.dtype != torch.bfloat16


def _grouped_mm_output(args: tuple, kwargs: dict) -> Tensor:
    """``_grouped_mm``'s output (mixture-of-experts layers' experts, all in one call) where its meta kernel
    refuses the operands' dtype: it takes bf16 only, while the CPU and CUDA kernels run fp32 too. The
    output's shape and strides are those of the same call in bf16, its dtype the operands' (or
    ``out_dtype``). Called with the tracker off the stack: the bf16 stand-ins are not the step's."""
    dtype = kwargs.get("out_dtype") or args[0].dtype
    as_bf16 = [a.to(torch.bfloat16) if _is_float_not_bf16(a) else a for a in args]
    shaped = torch.ops.aten._grouped_mm.default(
        *as_bf16, **{k: v for k, v in kwargs.items() if k != "out_dtype"}
    )
    return shaped.new_empty_strided(shaped.shape, shaped.stride(), dtype=dtype)


def _unknown_shape_message(func: Any, why: str) -> str:
    """Why a step whose op's output shape depends on values the simulation does not have cannot be
    simulated, in which module (the innermost ``forward`` running), and what to do."""
    where, frame = "", inspect.currentframe()
    while frame is not None and not where:
        owner = frame.f_locals.get("self")
        if frame.f_code.co_name == "forward" and isinstance(owner, nn.Module):
            where = f" in {type(owner).__name__}.forward"
        frame = frame.f_back
    return (
        f"The simulated step cannot follow {func}{where}: the size of its output depends on values computed "
        f"from the weights, which a simulation on fake tensors does not have, and {why}. A "
        "mixture-of-experts layer that gathers each expert's tokens with nonzero does this (Hugging Face's "
        "experts_implementation='eager'); the grouped one, Hugging Face's default "
        "(experts_implementation='grouped_mm'), holds the same memory whatever the routing and is simulated "
        "exactly. Otherwise measure real steps (measure, MemoryMonitor), which follow any routing."
    )


class Placeholders(TorchDispatchMode):
    """Answers ``.item()`` on fake tensors (used while the optimizer is warmed up, untracked)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        value = _placeholder_scalar(func, args)
        return value if value is not None else func(*args, **(kwargs or {}))


class Timeline(TrackerListener):
    """The simulated step's ops, each with the bytes live after it (`TimelineEvent`): a listener of the
    tracker (``estimate_memory(..., timeline=True).timeline``)."""

    def __init__(self) -> None:
        self.events: list[TimelineEvent] = []

    def op_finished(self, tracker: Tracker, func: Any) -> None:
        if func.namespace not in _UNTIMED:
            self.events.append(TimelineEvent(tracker.phase, str(func), tracker.current))  # type: ignore[attr-defined]


def _kernel(func: Any, args: tuple, kwargs: dict, *, cpu: bool) -> Any:
    """An op's kernel on the fakes (`Tracker`'s ``kernel``): ``_grouped_mm`` where its meta kernel refuses
    the dtype, and for a CPU target the sizes the meta kernels leave out (`_measuring.kernels`)."""
    if func in _GROUPED_MM and _is_float_not_bf16(args[0]):
        out = _grouped_mm_output(args, kwargs)
    else:
        out = func(*args, **kwargs)
    if cpu and func in _kernels.PLACEHOLDER_OUTPUTS:
        out = _kernels.real_outputs(func, args, kwargs, out)  # a size the meta kernel leaves out
    return out


class _SimTracker(Tracker):
    """`Tracker` over fake CPU tensors, in the target device's rounding, with an optional timeline.

    What it counts differently goes through the tracker's hooks (``rounding``, ``counts_fakes``,
    ``kernel``); what follows the step listens to it (`TrackerListener`): the history, the tracer and the
    timeline, told in that order. Its own dispatch answers what fake tensors cannot (values, value-shaped
    ops' sizes) and tells the listeners each op of the step."""

    def __init__(
        self,
        target: torch.device,
        timeline: bool,
        shadows: _shadow.Shadows,
        tracer: Tracer | None = None,
        history: bool | repeated.History = False,
        routes: _routing.Routes | None = None,
    ) -> None:
        cpu = target.type == "cpu"
        kernel = functools.partial(_kernel, cpu=cpu)
        super().__init__(SIM_DEVICE, rounding=allocation_rounding(target), counts_fakes=True, kernel=kernel)
        # Checkpointing's RNG states are real CPU tensors, and CPU kernels' own buffers
        # (`_measuring.kernels`) are the CPU's: device memory only when the target is the CPU.
        self.counts_rng_states = self.counts_cpu_kernels = cpu
        self.shadows = shadows  # the real values the batch gives (see _shadow)
        self.phase = "forward"
        self.tracer = tracer
        #: every candidate peak and every storage's life, to read the step at any point
        #: (`_estimating.repeated`; a given one: `_diagnosis.snapshot`'s)
        self.history: repeated.History | None = (
            history if isinstance(history, repeated.History) else repeated.History() if history else None
        )
        self.workspaces: Tensor | None = None  # cuBLAS's, for a CUDA target (`cublas_workspace_bytes`)
        #: the sizes the real forward's value-shaped ops gave (`_estimating.routing`), or ``None``
        self.routes = routes
        for listener in (self.history, tracer):
            if listener is not None:
                self.listen(listener)
        self.timeline: list[TimelineEvent] | None = None
        if timeline:
            recorder = Timeline()
            self.listen(recorder)
            self.timeline = recorder.events

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        if func is _DEVICE_QUERY:  # most dispatches of a step, and nothing to follow: straight to the fakes
            return func(*args, **(kwargs or {}))
        value = self.shadows.value(func, args, kwargs)  # .item() and the like, from the batch's real values
        if value is _shadow.NO_VALUE:
            value = _placeholder_scalar(func, args)
        if value is not None:
            return value
        dispatch = (
            super().__torch_dispatch__
        )  # the same dispatch, with the real values of the outputs followed
        for listener in self.listeners:
            listener.op_started(self, func, args, kwargs)
        routed = self.routes is not None and _value_shaped(func, args)
        if routed and not self.shadows.follows(func, args, kwargs):
            # Sized by the weights' values: as the real forward's same call (no fake kernel is tried, whose
            # exception's frames would keep the step's tensors alive until the next garbage collection).

            floating = next((t.dtype for t in _iter_tensors(args) if t.is_floating_point()), None)

            def make(layout: tuple) -> Tensor:  # allocated where the real op allocated it: now
                shape, stride, dtype = layout
                if dtype.is_floating_point and floating is not None:  # selected values: the step's dtype
                    dtype = floating
                empty = torch.ops.aten.empty_strided.default
                return dispatch(empty, types, (shape, stride), {"dtype": dtype})

            # a checkpointed block's recompute runs in an autograd node: the step's backward's, or one of a
            # backward the checkpointing planner runs inside the forward (its profile of a block)
            backward = torch._C._current_autograd_node() is not None
            out = self.routes.replay(func, args, make, backward=backward)  # type: ignore[union-attr]
        else:
            try:
                out = self.shadows.run(func, args, kwargs, lambda f, a, k: dispatch(f, types, a, k))
            except DynamicOutputShapeException as err:
                raise _routing.UnknownShape(_unknown_shape_message(func, NOT_RECORDED)) from err
        for listener in self.listeners:
            listener.op_finished(self, func)
        return out


#: Why a step's value-shaped op is not followed on the first try (`simulate_step` then records them).
NOT_RECORDED = "no real forward of the batch was recorded"


def cublas_workspace_bytes() -> int:
    """The cuBLAS workspaces a CUDA training step keeps in the caching allocator (bytes): one per thread
    that multiplies matrices, each made at its first matmul and kept for the process's life (torch's
    ``getNewWorkspace``): the forward's thread and the autograd engine's device thread, where the backward
    (and a checkpointed recompute) runs. Measured on an H200 with torch 2.11: 64 MiB held at every step's
    start that no tensor accounts for.

    Each one's size: torch's own answer (``torch.backends.cuda.cublas_workspace_size()``) once CUDA is
    initialized in this process; else ``CUBLAS_WORKSPACE_CONFIG`` (``:SIZE:COUNT`` pairs, SIZE in KiB);
    else 32 MiB, torch's size on compute capability 9 and later (8 MiB + 128 KiB before), read only from an
    initialized device: asking would initialize CUDA, which a forked DDP start refuses afterwards, and
    the device planned for may not be this one. A plan for an older card errs towards fitting.
    """
    initialized = torch.cuda.is_initialized()  # False on a CPU-only build too
    query = getattr(torch.backends.cuda, "cublas_workspace_size", None)
    pairs = re.findall(r":(\d+):(\d+)", os.environ.get("CUBLAS_WORKSPACE_CONFIG") or "")
    if initialized and query is not None:
        each = query()
    elif pairs:
        each = sum(int(size) * int(count) for size, count in pairs) * 1024
    elif initialized and torch.cuda.get_device_capability() < (9, 0):
        each = 4096 * 1024 * 2 + 16 * 1024 * 8
    else:
        each = 4096 * 1024 * 8
    return 2 * each


def track(
    step: TrainingStep,
    model: nn.Module,
    device: torch.device,
    timeline: bool,
    shadows: _shadow.Shadows,
    tracer: Tracer | None = None,
    history: bool | repeated.History = False,
    routes: _routing.Routes | None = None,
) -> _SimTracker:
    """Run ``step`` under a fresh tracker, with the categories fixed from identity as `measure` does."""
    tracker = _SimTracker(device, timeline, shadows, tracer, history, routes)
    if device.type == "cuda":
        # torch.optim keeps each parameter's "step" counter on the CPU unless capturable or fused.
        for optimizer in step.optimizers:
            for group in optimizer.param_groups:
                if group.get("capturable") or group.get("fused"):
                    continue
                for p in group["params"]:
                    counter = optimizer.state.get(p, {}).get("step")
                    if isinstance(counter, Tensor):
                        tracker.ignore(counter)
    claims.at_start(tracker, model, step.optimizers)
    if device.type == "cuda":
        with FakeTensorMode():  # what cuBLAS keeps between steps: no op makes it, so no op shows it
            tracker.workspaces = torch.empty(cublas_workspace_bytes(), dtype=torch.uint8, device=SIM_DEVICE)
        for rec in tracker.records(tracker.workspaces, preexisting=True):
            rec.category = "temporary"
    if tracer is not None:
        tracer.started(tracker, model, step.optimizers)
    modules = tracer.watching_modules() if tracer is not None else contextlib.nullcontext()
    with tracker.watching(model), modules:
        step.run(tracker)
    if routes is not None:
        routes.check()
    claims.at_end(tracker, model, step.optimizers)
    return tracker
