"""Estimate a training step's memory exactly by running it on fake tensors: nothing is allocated.

This is the simulated half of the estimator. `estimate_memory` runs one real training step of the
user's model — forward, backward, ``optimizer.step()``, ``zero_grad()``, with the user's own code — but
every parameter, buffer, batch tensor and intermediate is a ``FakeTensor``: it has a shape, a dtype and a
storage size, and no data. The same storage tracker `measure` uses (`_measuring.tracker.Tracker`) watches the
step, so the result is the breakdown `measure` would report for the real step, and a 70B model can be
planned on a laptop. Compared with `_estimating.analytic`, nothing is assumed about the architecture:
whatever the code allocates is counted. How the step runs (precision, checkpointing, accumulation, the
lever on the optimizer step, FSDP2's sharding) arrives as one `Step`; `estimate_memory` makes it from
its keywords.

How the pieces are faked, in order:

1. The model's parameters and buffers are swapped, in place and only for the duration of the call, for
   fake tensors of the same shape (tied weights stay tied); the user's own tensors are put back untouched
   and never read. Parameters on the meta device work the same way, so a model built under
   ``torch.device("meta")`` is planned without ever being materialized.
2. The optimizer is built over the fake parameters (the LightningModule's ``configure_optimizers``, an
   optimizer name, a factory, or a copy of a given optimizer's hyperparameters) and, unless
   ``first_step=True``, stepped once untracked so its state exists, as in every step after the first.
3. The step runs under the tracker. Precision follows Lightning's plugins: ``*-mixed`` runs the forward
   under ``torch.autocast(cache_enabled=False)`` (the low-precision weight copies are real allocations
   and are counted), ``*-true`` converts the parameters and floating-point inputs and sets the default
   dtype during the forward.

The simulation always runs on fake *CPU* tensors: fake CUDA tensors abort the process on a CPU-only
build of torch. For ``device="cuda"`` the CUDA-specific behaviour that moves the peak is modelled on
top: the caching allocator's 512-byte rounding, foreach optimizer kernels (torch's default on CUDA and
the reason for a parameter-sized temporary in ``step()``), and torch.optim's ``step`` counters living on
the CPU (except on a first step, where they are born inside the step: 512 B per parameter tensor, counted
as optimizer state), and cuBLAS's two workspaces (`cublas_workspace_bytes`: 64 MiB on an H100 or H200,
held from the first matmul on and seen by no op). Not modelled: cuBLASLt's 1 MiB workspace (a bf16 linear
layer with a bias), autocast's CUDA-only op lists (CUDA runs e.g. ``softmax`` and ``sum`` in fp32 under
autocast, CPU does not), GradScaler's few scalars, and CUDA's choice among attention kernels (the CPU
flash kernel saves the same ``out``/``logsumexp`` tensors as CUDA's flash and cuDNN kernels; CUDA's math
fallback would save the T×T matrix). ``benchmarks/validate_cuda.py`` measures what is left against the
device's allocator (docs/gpu-check.md).

A module compiled with torch.compile (inductor) runs, during the simulation, as inductor runs it: its
forward and backward traced and partitioned as compile does, their graphs run op by op with inductor's
fused kernels and buffer reuse (`_estimating.compiled`).

The batch is real, though, and so the step takes the branches the real batch takes: a Python value read
from a tensor (``.item()``, ``bool(mask.all())``) that depends only on the batch and on constants (the
attention mask, positions built with ``torch.arange``) is computed for real on small "shadow" copies, and
so is the shape of a boolean-mask selection; transformers' ``is_tracing`` is told that the simulation's
fake tensors are no trace (see `_estimating.shadow`). Any other value read, one that depends on the
weights (a NaN check on the loss), is a placeholder: ``1`` for numbers, ``False`` for booleans.
Data-dependent shapes of values that are not known (``nonzero`` of an activation: a mixture-of-experts
layer that picks its experts' tokens one expert at a time) are taken from one real forward of the batch,
run without autograd on the real weights (`_estimating.routing`), and the step is simulated again with
them; weights on the meta device show none, and the step raises `NotImplementedError`, naming the op and
the module and what to do instead.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import os
import re
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Literal, NamedTuple, overload

import optimi
import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torch._subclasses.fake_tensor import DynamicOutputShapeException, FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from lightning_memkit._breakdown import MemoryBreakdown
from lightning_memkit._budget import valid_name
from lightning_memkit._checkpointing.blocks import find_blocks
from lightning_memkit._checkpointing.policies import CheckpointPlan, apply_checkpointing
from lightning_memkit._estimating import quantized as _quantized
from lightning_memkit._estimating import repeated
from lightning_memkit._estimating import routing as _routing
from lightning_memkit._estimating import shadow as _shadow
from lightning_memkit._estimating.compiled import compiled_as_inductor, compiled_modules
from lightning_memkit._estimating.isolate import isolated
from lightning_memkit._estimating.lightning_step import (
    TrainingStep,
    is_lightning,
    lightning_stand_ins,
    loss_of,
    optimizers_from,
    without_parameters,
)
from lightning_memkit._estimating.optimizer_state import OPTIMIZERS
from lightning_memkit._estimating.trace import Tracer
from lightning_memkit._levers.offload import offload_optimizer
from lightning_memkit._measuring import kernels as _kernels
from lightning_memkit._measuring.ops import _value_shaped
from lightning_memkit._measuring.storages import Storage, _iter_tensors, allocation_rounding
from lightning_memkit._measuring.tracker import Tracker
from lightning_memkit._optimizers.swap import load_bitsandbytes
from lightning_memkit._sharding import fsdp2 as _fsdp2
from lightning_memkit._sharding import layout as _layout
from lightning_memkit._step import Sharding, Step
from lightning_memkit._vocabulary import DEVICES, PRECISIONS

__all__ = [
    "PRECISION_DTYPES",
    "TimelineEvent",
    "counted_step",
    "estimate_memory",
    "simulated_layout",
    "sixteen_bit_weights",
]

#: Lightning precision string -> (dtype the parameters are converted to, dtype autocast computes in).
#: ``None`` means "leave as it is" / "no autocast".
PRECISION_DTYPES: dict[str, tuple[torch.dtype | None, torch.dtype | None]] = {
    "64-true": (torch.float64, None),
    "32-true": (None, None),
    "16-mixed": (None, torch.float16),
    "bf16-mixed": (None, torch.bfloat16),
    "16-true": (torch.float16, None),
    "bf16-true": (torch.bfloat16, None),
}
assert tuple(PRECISION_DTYPES) == PRECISIONS


def sixteen_bit_weights(precision: str) -> bool:
    """Whether ``precision`` converts the weights to 16 bits (``"bf16-true"``, ``"16-true"``), where an
    update below the weight's resolution rounds away."""
    return PRECISION_DTYPES.get(precision, (None, None))[0] in (torch.bfloat16, torch.float16)


_SIM_DEVICE = torch.device("cpu")  # where the fake tensors live; see the module docstring for why
# Left out of the timeline: metadata queries (fake tensors answer ``.device`` through dispatch) and the
# profiler's record_function markers. They allocate nothing.
_UNTIMED = frozenset({"prim", "profiler"})
# A fake tensor's ``.device``, asked through dispatch: three in five of a simulated step's dispatches.
_DEVICE_QUERY = torch.ops.prim.device.default


class TimelineEvent(NamedTuple):
    """One op of the simulated step, as returned by ``estimate_memory(..., return_timeline=True)``."""

    phase: str  # "forward" | "zero_grad" | "backward" | "optimizer"
    op: str  # the aten overload that ran, e.g. "aten.mm.default"
    live: int  # bytes live on the device right after the op (the peak is the highest of these)


# --------------------------------------------------------------------------------------------------
# The tracker, on fake tensors
# --------------------------------------------------------------------------------------------------


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


class _Placeholders(TorchDispatchMode):
    """Answers ``.item()`` on fake tensors (used while the optimizer is warmed up, untracked)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        value = _placeholder_scalar(func, args)
        return value if value is not None else func(*args, **(kwargs or {}))


class _SimTracker(Tracker):
    """`Tracker` over fake CPU tensors, in the target device's rounding, with an optional timeline."""

    counts_fakes = True

    def __init__(
        self,
        target: torch.device,
        timeline: bool,
        shadows: _shadow.Shadows,
        tracer: Tracer | None = None,
        history: bool | repeated.History = False,
        routes: _routing.Routes | None = None,
    ) -> None:
        super().__init__(_SIM_DEVICE)
        self.rounding = allocation_rounding(target)
        # Checkpointing's RNG states are real CPU tensors, and CPU kernels' own buffers
        # (`_measuring.kernels`) are
        # the CPU's: device memory only when the target is the CPU.
        self.counts_rng_states = self.counts_cpu_kernels = target.type == "cpu"
        self.shadows = shadows  # the real values the batch gives (see _shadow)
        self.phase = "forward"
        self.timeline: list[TimelineEvent] | None = [] if timeline else None
        self.tracer = tracer
        #: every candidate peak and every storage's life, to read the step at any point
        #: (`_estimating.repeated`; a given one: `_diagnosis.snapshot`'s)
        self.history: repeated.History | None = (
            history if isinstance(history, repeated.History) else repeated.History() if history else None
        )
        self.workspaces: Tensor | None = None  # cuBLAS's, for a CUDA target (`cublas_workspace_bytes`)
        #: the sizes the real forward's value-shaped ops gave (`_estimating.routing`), or ``None``
        self.routes = routes

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
        if self.tracer is not None:
            self.tracer.before_op(func, args, kwargs, self.live)
        if self.history is not None:
            self.history.op = func
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
                raise _routing.UnknownShape(_unknown_shape_message(func, _NOT_RECORDED)) from err
        if self.tracer is not None:
            self.tracer.after_op(self)
        if self.timeline is not None and func.namespace not in _UNTIMED:
            self.timeline.append(TimelineEvent(self.phase, str(func), self.current))
        return out

    def _run(self, func: Any, args: tuple, kwargs: dict) -> Any:
        if func in _GROUPED_MM and _is_float_not_bf16(args[0]):
            out = _grouped_mm_output(args, kwargs)
        else:
            out = func(*args, **kwargs)
        if self.counts_cpu_kernels and func in _kernels.PLACEHOLDER_OUTPUTS:
            out = _kernels.real_outputs(func, args, kwargs, out)  # a size the meta kernel leaves out
        return out

    # What the tracer (`advise`'s) is told; without one, the tracker's own methods run unchanged.

    def record(self, t: Tensor, *, preexisting: bool = False) -> Storage | None:
        if self.tracer is None or preexisting:
            return super().record(t, preexisting=preexisting)
        known = len(self.live)
        rec = super().record(t)
        if len(self.live) > known:  # a new storage
            assert rec is not None
            self.tracer.created(rec, t, self.phase)
        return rec

    def _free(self, key: int) -> None:
        if self.tracer is None and self.history is None:
            super()._free(key)
            return
        entry = self.live.get(key)
        super()._free(key)
        if entry is not None and self.tracer is not None:
            self.tracer.freed(entry[1])
        if entry is not None and self.history is not None:
            self.history.died(entry[1])

    # What the history is told (`_estimating.repeated`); without one, the tracker's own methods run unchanged.

    def _register(self, storage: torch.UntypedStorage, nbytes: int, *, preexisting: bool) -> Storage:
        rec = super()._register(storage, nbytes, preexisting=preexisting)
        if self.history is not None:
            self.history.born(rec, preexisting=preexisting)
        return rec

    def on_resize(self, storage: torch.UntypedStorage, before: int) -> None:
        if self.history is None:
            super().on_resize(storage, before)
            return
        self.history.op, self.history.resizing = "resize_", storage
        try:
            super().on_resize(storage, before)
        finally:
            self.history.resizing = None

    def on_rng_state(self, state: Tensor) -> None:
        if self.history is not None:
            self.history.op = "rng_state"
        super().on_rng_state(state)

    def _check_peak(self) -> None:
        if self.history is not None:
            self.history.point(self, 0)
        super()._check_peak()

    def _kernel_high(self, unseen: int) -> None:
        if self.history is not None:
            self.history.point(self, unseen)
        super()._kernel_high(unseen)

    def on_grad(self, param: Tensor) -> None:
        if self.tracer is not None:
            self.tracer.reached(param)  # even when a fused step has consumed the gradient already
        super().on_grad(param)


# --------------------------------------------------------------------------------------------------
# Faking the model, the batch and the optimizer
# --------------------------------------------------------------------------------------------------


def _fake_like(t: Tensor, mode: FakeTensorMode, dtype: torch.dtype | None) -> Tensor:
    """A fake CPU tensor with ``t``'s shape and strides; floating point ones converted to ``dtype``."""
    if dtype is None or not t.is_floating_point():
        dtype = t.dtype
    if t.layout != torch.strided:
        # Sparse: no strides. torch's fake twin keeps the shape (COO: and the sparse dimensions; CSR:
        # the compressed indices) but no non-zeros, so the batch's own indices and values are not counted
        # (the margin covers them: a batch's bytes, not the step's).
        twin = mode.from_tensor(t.detach().cpu())
        with mode:
            return twin if twin.dtype == dtype else twin.to(dtype)
    with mode:
        return torch.empty_strided(t.shape, t.stride(), dtype=dtype, device=_SIM_DEVICE)


def simulated_layout(model: nn.Module, sharding: Sharding) -> _layout.Layout:
    """The layout ``sharding`` gives ``model`` where its step is simulated (`_sharding.layout.layout_of` of
    the laid-out copy, on fake tensors over the fake mesh), without running a step: what a run's own model
    is held to once its layout is applied. ``model`` is untouched."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with contextlib.ExitStack() as stack:
        stack.enter_context(isolated(model, "the simulated layout"))
        stack.enter_context(_fake_parameters(model, mode, None))
        mesh = stack.enter_context(_fsdp2.fake_mesh(*_layout.mesh_shape(sharding)))
        with mode:
            blocks = [name for name, _ in find_blocks(model)]
            return _layout.layout_of(_layout.laid_out_copy(model, mesh, sharding, blocks))


@contextlib.contextmanager
def _fake_parameters(model: nn.Module, mode: FakeTensorMode, dtype: torch.dtype | None) -> Iterator[None]:
    """Every parameter and buffer of ``model`` swapped for a fake twin while inside (`_twinned`); a
    bitsandbytes quantized weight for one carrying its quantization state, faked (`_estimating.quantized`),
    and a quantized layer's own state too; a torchao quantized weight for its subclass over fake inner
    tensors."""
    fake = functools.partial(_fake_like, mode=mode, dtype=dtype)
    twins = _quantized.QuantizedTwins(mode, fake)

    def make(t: Tensor) -> Tensor:
        if _quantized.is_torchao_quantized(t):
            return twins.wrapper(t)
        return twins.parameter(t) if _quantized.is_quantized(t) else fake(t)

    with _twinned(model, make), _quantized.fake_layer_states(model, twins):
        yield


@contextlib.contextmanager
def _twinned(model: nn.Module, make: Callable[[Tensor], Tensor]) -> Iterator[None]:
    """Swap every parameter and buffer ``t`` of ``model`` for ``make(t)`` while inside; put the originals
    back.

    The swap goes through ``_parameters``/``_buffers`` directly, so no hook or ``__setattr__`` override
    runs; a tensor registered under several names (tied weights) gets one twin.
    """
    twins: dict[int, Tensor] = {}
    swapped: list[tuple[dict[str, Any], str, Tensor]] = []
    try:
        for module in model.modules():  # a shared module is visited once; its tables are swapped in place
            for table, is_param in ((module._parameters, True), (module._buffers, False)):
                for name, t in table.items():
                    if t is None:
                        continue
                    twin = twins.get(id(t))
                    if twin is None:
                        twin = make(t)
                        if is_param and not isinstance(twin, nn.Parameter):  # a quantized twin is one
                            twin = nn.Parameter(twin, requires_grad=t.requires_grad)
                        twins[id(t)] = twin
                    swapped.append((table, name, t))
                    table[name] = twin
        yield
    finally:
        for table, name, t in reversed(swapped):
            table[name] = t


def _fake_batch(batch: Any, mode: FakeTensorMode, dtype: torch.dtype | None, shadows: _shadow.Shadows) -> Any:
    """The batch with fake twins for its tensors; ``shadows`` learns the real values of the twins."""

    def fake(t: Tensor) -> Tensor:
        twin = _fake_like(t, mode, dtype)
        shadows.adopt(t, twin)
        return twin

    return apply_to_collection(batch, Tensor, fake)


def _named_optimizer(name: str) -> Callable[[Iterable[Tensor]], torch.optim.Optimizer]:
    """The optimizer class an `OPTIMIZERS` name stands for, with its defaults (SGD: lr=1e-3)."""
    name = valid_name("optimizer", name, OPTIMIZERS)
    if name == "adamw":
        return torch.optim.AdamW
    if name == "adafactor":
        return torch.optim.Adafactor
    if name == "sgd":
        return functools.partial(torch.optim.SGD, lr=1e-3)
    if name == "sgd_momentum":
        return functools.partial(torch.optim.SGD, lr=1e-3, momentum=0.9)
    if name == "adamw_kahan":
        return functools.partial(optimi.AdamW, lr=1e-3, kahan_sum=True)
    if name == "sgd_kahan":
        return functools.partial(optimi.SGD, lr=1e-3, kahan_sum=True)
    bnb = load_bitsandbytes()
    if bnb is None:
        raise ValueError(
            f"optimizer {name!r} needs bitsandbytes, which is not installed or fails to load here"
        )

    return {
        "adamw8bit": bnb.optim.AdamW8bit,
        "paged_adamw8bit": bnb.optim.PagedAdamW8bit,
        "lion": bnb.optim.Lion,
        "lion8bit": bnb.optim.Lion8bit,
    }[name]


OptimizerLike = str | torch.optim.Optimizer | Callable[[Iterable[Tensor]], torch.optim.Optimizer]


def _rebuild(
    optimizer: torch.optim.Optimizer, real: Sequence[Tensor], fake: Sequence[Tensor]
) -> torch.optim.Optimizer:
    """The same optimizer class and hyperparameters over the ``fake`` twins of the ``real`` parameters.

    ``optimizer`` was built over the user's real parameters; it is read, never stepped.
    """
    fake_of = {id(r): f for r, f in zip(real, fake, strict=True)}
    groups = []
    for group in optimizer.param_groups:
        missing = [p for p in group["params"] if id(p) not in fake_of]
        if missing:
            raise ValueError(
                f"The optimizer holds {len(missing)} tensor(s) that are not parameters of the model; "
                "pass an optimizer built over model.parameters(), or a factory such as "
                "functools.partial(torch.optim.AdamW, lr=1e-3)."
            )
        # torch-optimi keeps its run state in the group ("setup", a "step" tensor): the twin starts afresh.
        kept = {k: v for k, v in group.items() if k not in _GROUP_RUN_STATE}
        groups.append({**kept, "params": [fake_of[id(p)] for p in group["params"]]})
    try:
        return type(optimizer)(groups, **optimizer.defaults)
    except TypeError:  # a constructor whose keywords are not its defaults' keys: the groups carry them,
        # and only the keywords it takes are passed (torch-optimi's lr is required; its beta1 is not one)
        accepted = inspect.signature(type(optimizer)).parameters
        return type(optimizer)(groups, **{k: v for k, v in optimizer.defaults.items() if k in accepted})


#: Keys of a param group that are an optimizer's running state, not its hyperparameters (torch-optimi's).
_GROUP_RUN_STATE = ("setup", "step")


def _use_device_defaults(optimizers: Sequence[torch.optim.Optimizer], device: torch.device) -> None:
    """Pick the kernels torch.optim would pick for real tensors on ``device`` (fakes confuse its check).

    On CUDA torch defaults to the foreach kernels, whose ``step()`` allocates temporaries as large as
    all parameters at once; on CPU to the per-tensor loop.
    """
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            if (
                group.get("foreach", False) is None
                and not group.get("fused")
                and not group.get("differentiable")
            ):
                group["foreach"] = device.type == "cuda"


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


def _track(
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
    tracker.adopt(model, step.optimizers)
    if device.type == "cuda":
        with FakeTensorMode():  # what cuBLAS keeps between steps: no op makes it, so no op shows it
            tracker.workspaces = torch.empty(cublas_workspace_bytes(), dtype=torch.uint8, device=_SIM_DEVICE)
        for rec in tracker.records(tracker.workspaces, preexisting=True):
            rec.category = "temporary"
    if tracer is not None:
        tracer.started(tracker, model, step.optimizers)
    modules = tracer.watching_modules() if tracer is not None else contextlib.nullcontext()
    with tracker.watching(model), modules:
        step.run(tracker)
    if routes is not None:
        routes.check()
    # State born during a first step, a parameter's data replaced in it, and FSDP2's first unsharded
    # copies, are known only now.
    tracker.claim_optimizer_state(step.optimizers)
    tracker.claim_parameters(model)
    tracker.claim_sharded(model)
    return tracker


@overload
def estimate_memory(
    model: nn.Module,
    batch: Any,
    *,
    optimizer: OptimizerLike | None = ...,
    loss_fn: Callable[[Any, Any], Tensor] | None = ...,
    precision: str = ...,
    checkpointing: str | CheckpointPlan | None = ...,
    device: str | torch.device = ...,
    first_step: bool = ...,
    accumulating: bool = ...,
    release_gradients: bool = ...,
    fused_step: bool = ...,
    offload: bool = ...,
    strategy: str | None = ...,
    world_size: int = ...,
    reshard_after_forward: bool = ...,
    mp_policy: Any = ...,
    tensor_parallel_size: int = ...,
    replicate_size: int = ...,
    parallelize_fn: Callable[[nn.Module, Any], Any] | None = ...,
    compile_budget: float | None = ...,
    return_timeline: Literal[False] = ...,
) -> MemoryBreakdown: ...


@overload
def estimate_memory(
    model: nn.Module,
    batch: Any,
    *,
    optimizer: OptimizerLike | None = ...,
    loss_fn: Callable[[Any, Any], Tensor] | None = ...,
    precision: str = ...,
    checkpointing: str | CheckpointPlan | None = ...,
    device: str | torch.device = ...,
    first_step: bool = ...,
    accumulating: bool = ...,
    release_gradients: bool = ...,
    fused_step: bool = ...,
    offload: bool = ...,
    strategy: str | None = ...,
    world_size: int = ...,
    reshard_after_forward: bool = ...,
    mp_policy: Any = ...,
    tensor_parallel_size: int = ...,
    replicate_size: int = ...,
    parallelize_fn: Callable[[nn.Module, Any], Any] | None = ...,
    compile_budget: float | None = ...,
    return_timeline: Literal[True],
) -> tuple[MemoryBreakdown, list[TimelineEvent]]: ...


def estimate_memory(
    model: nn.Module,
    batch: Any,
    *,
    optimizer: OptimizerLike | None = None,
    loss_fn: Callable[[Any, Any], Tensor] | None = None,
    precision: str = "32-true",
    checkpointing: str | CheckpointPlan | None = None,
    device: str | torch.device = "cuda",
    first_step: bool = False,
    accumulating: bool = False,
    release_gradients: bool = False,
    fused_step: bool = False,
    offload: bool = False,
    strategy: str | None = None,
    world_size: int = 1,
    reshard_after_forward: bool = True,
    mp_policy: Any = None,
    tensor_parallel_size: int = 1,
    replicate_size: int = 1,
    parallelize_fn: Callable[[nn.Module, Any], Any] | None = None,
    compile_budget: float | None = None,
    return_timeline: bool = False,
) -> MemoryBreakdown | tuple[MemoryBreakdown, list[TimelineEvent]]:
    """The peak memory of one training step of ``model`` on ``batch``, by category, without running it.

    The step runs on fake tensors (see the module docstring), so nothing proportional to the model or the
    batch is allocated.

    Side effects. The user's step code runs once more (``training_step``, or ``forward`` and ``loss_fn``),
    on fake tensors, and what it can leave behind is put back: the parameters and
    buffers are fake twins during the step, so the real ones (BatchNorm's statistics among them) are never
    written; the real gradients are set aside, not copied, and given back; the train/eval flag of every
    submodule; torchmetrics states (values and ``update`` counts); the contents of the public ``list``,
    ``dict``, ``set`` and ``deque`` attributes of every submodule (``self.outputs.append(loss)``); the RNG
    streams (torch's CPU and CUDA generators, Python's ``random``, NumPy's global state); and torch.compile,
    which neither compiles nor skips a frame for the simulation. Not restored: any other attribute the step
    rebinds (``self.calls += 1``), attributes whose name starts with ``_``, objects outside the module
    (globals, files, loggers). ``self.log``/``self.log_dict`` do nothing during the step.

    Args:
        model: a ``LightningModule`` — its ``training_step(batch, 0)`` and ``configure_optimizers()`` run
            as written, in the order of Lightning's automatic optimization (training_step, zero_grad,
            backward, step) — or a plain ``nn.Module``, stepped as ``loss_fn(model(input), target)`` with
            ``input, target = batch``, then backward, step, zero_grad. Its parameters may be real or on
            the meta device.
        batch: what ``training_step`` receives, or ``(input, target)`` for a plain module. Its values are
            read (on copies, never changed) where the step branches on them, e.g. on the attention mask;
            its tensors may be on the meta device, and the step then takes placeholder branches.
        optimizer: overrides ``configure_optimizers``: an optimizer name (``"adamw"``, ``"sgd"``,
            ``"sgd_momentum"``, ``"adafactor"``, or bitsandbytes' ``"adamw8bit"``, ``"paged_adamw8bit"``,
            ``"lion"``, ``"lion8bit"``, each with its defaults), a factory ``params -> Optimizer``, or an
            optimizer built over ``model.parameters()`` (its class and hyperparameters are copied).
            Required for a plain module. An optimizer whose ``step`` needs a closure (``torch.optim.LBFGS``)
            is stepped as ``step(closure)``, the closure running the forward and backward (in Lightning's
            order: training_step, zero_grad, backward); the optimizer calls it as often as its logic
            decides on the placeholder values: LBFGS without line search twice (its first evaluation and
            one after its first update, with its direction and history alive: the step's peak), with
            ``line_search_fn="strong_wolfe"`` up to ``max_eval`` times, along the search's longest path
            (high: +16 % on a small MLP, and that many simulated passes). LBFGS's curvature history is
            counted at its steady-state size, ``history_size`` pairs of flattened-parameter vectors; with
            ``first_step=True``, the pairs the first step's later inner iterations add are not counted.
        loss_fn: ``(output, target) -> loss`` for a plain module; not used for a LightningModule.
        precision: a Lightning precision string: ``"32-true"``, ``"16-mixed"``, ``"bf16-mixed"``,
            ``"16-true"``, ``"bf16-true"``, ``"64-true"``.
        checkpointing: ``None`` (or ``"none"``): the model as written. A mode (``"full"``,
            ``"selective"``, ``"selective_half"``) for every block `find_blocks` finds, or a
            `CheckpointPlan` / ``{module name: mode}`` mapping: applied with `apply_checkpointing` for
            the simulation only, and undone after it.
        device: the device type to plan for, ``"cuda"`` (the default: 512-byte allocator blocks, foreach
            optimizer kernels) or ``"cpu"``.
        first_step: estimate the first step, before the optimizer has state, instead of the steady state.
        accumulating: estimate the last micro-batch of a gradient accumulation cycle
            (``accumulate_grad_batches > 1``), the cycle's highest: its backward adds to gradients that
            are already there (no ``zero_grad`` before it), then the optimizer steps.
        release_gradients: the gradients are freed as soon as the optimizers have stepped
            (`release_gradients`, `GradientRelease`): a LightningModule's forward then runs without the
            previous step's gradients, which Lightning's order (training_step, zero_grad, backward)
            otherwise keeps through it. A plain module's step (zero_grad after the step) is the same.
            With ``strategy="fsdp2"``: each rank's sharded gradients.
        fused_step: each parameter is stepped inside backward as soon as its gradient is complete, and
            the gradient freed (`fuse_optimizer_step`, `FusedOptimizerStep`): no step holds all the
            gradients. Not with ``accumulating`` (it steps at every backward), nor with an optimizer that
            needs a closure. With ``strategy="fsdp2"``: each shard steps once its reduce-scatter is done.
        offload: the optimizers keep their state, fp32 master weights and the gradients' accumulation in
            host memory (`offload_optimizer`, `OptimizerOffload`): each gradient leaves the device as it
            completes. On ``device="cuda"`` the host's bytes are not counted; on ``"cpu"`` they are the
            same memory, and are. Not with ``strategy`` (FSDP2's own is ``CPUOffloadPolicy``).
        strategy: ``"fsdp2"``: one rank's step under FSDP2, ``fully_shard`` on each block `find_blocks`
            finds and then on the whole model (the layout Lightning documents), over ``world_size`` ranks:
            the real FSDP2 step runs on a copy of the model, on fake tensors over torch's fake process
            group (in this process; it must have no process group of its own), so the root's and the
            running layer's unsharded parameters, a layer's unsharded gradient before its reduce-scatter
            and the padding of uneven shards are all counted. ``batch`` is one rank's micro-batch. The
            CPU's FSDP2 step is simulated: on CUDA, prefetching on a second stream can keep one more
            layer's parameters unsharded than counted here. ``None`` (default): one device.
        world_size: the number of ranks the model is sharded over, with ``strategy``.
        reshard_after_forward: with ``strategy``, ``fully_shard``'s own: ``False`` keeps every unit's
            unsharded parameters from its forward to its backward (no all-gather in backward).
        mp_policy: with ``strategy``, ``fully_shard``'s own: a ``MixedPrecisionPolicy``, e.g.
            ``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)`` (all-gathered
            and computed in bf16, gradients reduce-scattered in fp32). ``None``: none.
        tensor_parallel_size: with ``strategy``, the ranks of one tensor-parallel group (Lightning's
            ``ModelParallelStrategy``'s word): ``world_size // tensor_parallel_size`` ranks each take their
            own ``batch``. Without ``parallelize_fn``, each block's projections are split as torchtitan
            splits LLaMA's (query, key, value, gate and up by column; output and down by row:
            `_sharding.layout.tp_plan`), then FSDP2 shards over the data-parallel ranks.
        replicate_size: with ``strategy``, HSDP: ``fully_shard`` over a (replicate, shard) mesh, each
            parameter sharded over ``world_size // tensor_parallel_size // replicate_size`` ranks and
            replicated across ``replicate_size`` such groups.
        parallelize_fn: with ``strategy``, ``fn(model, device_mesh)`` that applies the layout (Fabric's
            ``ModelParallelStrategy``'s word), run on the simulated copy of ``model`` with a fake mesh
            named ``("data_parallel", "tensor_parallel")``, as Lightning hands ``self.device_mesh`` to
            ``configure_model``; a mesh it builds with ``init_device_mesh`` (HSDP's) is a fake one of the
            same world. For a LightningModule whose ``configure_model`` applies the layout,
            ``parallelize_fn=ConfigureModel()`` runs it so (`lightning_memkit.ConfigureModel`).
        compile_budget: for a model with compiled modules (``torch.compile(module)`` or
            ``module.compile()``, inductor's backend): torch.compile's ``activation_memory_budget`` to
            simulate, the share of the activations its partitioner may keep (0 to 1); ``None``: as
            configured (``torch._functorch.config``). Each such module's step is simulated as inductor runs
            it (`_estimating.compiled`: the code inductor generates for it, run with its kernels stubbed),
            at any budget.
        return_timeline: also return the step op by op, as a list of `TimelineEvent`.

    Returns:
        The `MemoryBreakdown` at the step's peak, in bytes, with ``parameters``, ``gradients``,
        ``optimizer_state``, ``activations`` and ``temporary`` as `measure` defines them; with
        ``return_timeline=True``, ``(breakdown, timeline)``.

    Example::

        with torch.device("meta"):
            model = GPTLightningModule("llama-7b")
        x = torch.zeros(1, 2048, dtype=torch.long, device="meta")
        print(estimate_memory(model, (x, x), precision="bf16-mixed"))
    """
    if (empty := without_parameters(model)) is not None:
        raise ValueError(f"estimate_memory: {empty}")
    runs_it = isinstance(parallelize_fn, _layout.ConfigureModel)  # configure_model runs on the copy
    if not runs_it and _configure_model_pending(model):
        name = type(model).__name__
        warnings.warn(
            f"estimate_memory: {name} overrides configure_model, which a Trainer runs before the first step, "
            "and no Trainer is attached: the step simulated is the module as it is now (a model that "
            f"configure_model compiles is simulated eagerly). Call {name}.configure_model() first, as the "
            "Trainer will, or estimate from a callback once fit has started.",
            stacklevel=2,
        )
    step = Step.of(
        precision=precision,
        checkpointing=checkpointing,
        accumulating=accumulating,
        first_step=first_step,
        release_gradients=release_gradients,
        fused_step=fused_step,
        offload=offload,
        strategy=strategy,
        world_size=world_size,
        reshard_after_forward=reshard_after_forward,
        mp_policy=mp_policy,
        tensor_parallel_size=tensor_parallel_size,
        replicate_size=replicate_size,
        parallelize_fn=parallelize_fn,
        compile_budget=compile_budget,
    )
    return estimate_step(
        model,
        batch,
        step,
        optimizer=optimizer,
        loss_fn=loss_fn,
        device=device,
        return_timeline=return_timeline,
    )


def _configure_model_pending(model: nn.Module) -> bool:
    """Whether ``model`` is a LightningModule whose ``configure_model`` a Trainer has yet to run and would
    change: the hook overridden, no Trainer attached, nothing compiled yet, and the hook, run on a copy of
    the module (its parameters and buffers on the meta device: nothing copied), builds, replaces or
    compiles a module there. Where the copy or the hook fails, it cannot be known: pending."""
    from lightning.pytorch.utilities.model_helpers import is_overridden

    if not (is_lightning(model) and model._trainer is None and is_overridden("configure_model", model)):
        return False
    if compiled_modules(model):
        return False

    def layout(module: nn.Module) -> list:
        modules = [(name, type(m)) for name, m in module.named_modules()]
        return [*modules, *((name, p.shape) for name, p in module.named_parameters())]

    memo: dict[int, Any] = {id(b): b.detach().to("meta") for b in model.buffers()}
    memo |= {id(p): nn.Parameter(p.detach().to("meta"), p.requires_grad) for p in model.parameters()}
    try:
        twin = copy.deepcopy(model, memo)
        before = layout(twin)
        meta = torch.device("meta")
        with meta, lightning_stand_ins(twin, meta), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            twin.configure_model()
    except Exception:
        return True
    return layout(twin) != before or bool(compiled_modules(twin))


def estimate_step(
    model: nn.Module,
    batch: Any,
    step: Step,
    *,
    optimizer: OptimizerLike | None = None,
    loss_fn: Callable[[Any, Any], Tensor] | None = None,
    device: str | torch.device = "cuda",
    return_timeline: bool = False,
) -> Any:
    """`estimate_memory` of a `Step` (the planners' and callbacks' form: one value for how the step runs)."""
    simulate = functools.partial(
        simulate_step, model, batch, step, optimizer=optimizer, loss_fn=loss_fn, device=device
    )
    shortcut = None if return_timeline else _shortcut(model, step, optimizer, simulate)
    if shortcut is not None:
        return shortcut.breakdown
    tracker = simulate(timeline=return_timeline)
    breakdown = tracker.breakdown()
    if return_timeline:
        assert tracker.timeline is not None
        return breakdown, tracker.timeline
    return breakdown


def _shortcut(
    model: nn.Module, step: Step, optimizer: Any, simulate: Callable[..., _SimTracker], *, count: bool = False
) -> repeated.Shortcut | None:
    """A deep stack of identical blocks: its step from three shallow ones (``simulate``'s), exactly, or
    ``None`` (`_estimating.repeated`). Not for an optimizer built over the whole model's parameters, nor
    for a per-block checkpointing plan (the blocks would not run alike)."""
    if isinstance(optimizer, torch.optim.Optimizer) or not (
        step.checkpointing is None or isinstance(step.checkpointing, str)
    ):
        return None
    if compiled_modules(model):  # a compiled module's graph is traced whole: no shallow copies of it
        return None
    # A routed step runs each block by its own routing: its shallow steps do not predict it.
    shallow = functools.partial(simulate, history=True, follow_routing=False)
    return repeated.shortcut(model, shallow, count=count)


def counted_step(model: nn.Module, batch: Any, step: Step, **kwargs: Any) -> tuple[MemoryBreakdown, int, int]:
    """`estimate_step`'s breakdown (same arguments but ``return_timeline``), with the step's FLOPs and
    its forward and backward ops: for deep stacks of identical blocks from three shallow steps too."""
    simulate = functools.partial(simulate_step, model, batch, step, **kwargs, timeline=True)
    shortcut = _shortcut(model, step, kwargs.get("optimizer"), simulate, count=True)
    if shortcut is not None:
        assert shortcut.flops is not None and shortcut.ops is not None
        return shortcut.breakdown, shortcut.flops, shortcut.ops
    with FlopCounterMode(display=False) as counter:
        tracker = simulate()
    assert tracker.timeline is not None
    ops = sum(event.phase in ("forward", "backward") for event in tracker.timeline)
    return tracker.breakdown(), counter.get_total_flops(), ops


#: Why a step's value-shaped op is not followed on the first try (`simulate_step` then records them).
_NOT_RECORDED = "no real forward of the batch was recorded"


def _dtypes(precision: str, device: torch.device) -> tuple[torch.dtype | None, torch.dtype | None]:
    """The weights' and autocast's dtypes of ``precision`` on ``device`` (`PRECISION_DTYPES`), fp16 AMP
    becoming bf16 on the CPU, as Lightning does: fp16 autocast is not supported there."""
    param_dtype, autocast_dtype = PRECISION_DTYPES[precision]
    if autocast_dtype == torch.float16 and device.type == "cpu":
        autocast_dtype = torch.bfloat16
    return param_dtype, autocast_dtype


def _converted(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t`` in ``dtype`` if it is floating point (Lightning's 16-bit precisions' ``convert_input``, and
    what ``module.to(dtype)`` makes of a parameter or buffer), detached."""
    return t.detach().to(dtype) if t.is_floating_point() else t


def _routes(model: nn.Module, batch: Any, loss_fn: Any, failure: str, precision: str) -> _routing.Routes:
    """The routing of ``batch`` through ``model``'s real weights (`_estimating.routing`): a forward run
    for real on the weights' device, without autograd, leaving no trace (`isolated`), at every call (a
    forward costs far less than the simulation, and the batch's values or the weights may have changed
    since), at the step's ``precision``: under its autocast (on the weights' device), or with a 16-bit copy
    of the weights, and the batch in 16 bits (a router's near-tie goes otherwise there: a run with 16-bit
    weights holds that copy anyway). ``failure``: the first try's refusal, raised again with the
    reason where no real forward can run or the forward fails."""
    params = list(model.parameters())
    device = params[0].device if params else torch.device("cpu")
    if device.type == "meta":
        raise _routing.UnknownShape(
            failure.replace(_NOT_RECORDED, "the weights are on the meta device, where no real forward runs")
        )
    lightning = is_lightning(model)
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(isolated(model, "estimate_memory"))
            model.train()  # as a training step runs; `isolated` gives every module its flag back
            if lightning:
                stack.enter_context(lightning_stand_ins(model, device))
            param_dtype, autocast_dtype = _dtypes(precision, device)
            batch = move_data_to_device(batch, device)
            if param_dtype is not None:  # 16-bit weights: a 16-bit copy of them for this forward, and
                convert = functools.partial(_converted, dtype=param_dtype)  # the batch's floats, as Lightning
                stack.enter_context(_twinned(model, convert))
                batch = apply_to_collection(batch, Tensor, convert)
            forward = _forward_fn(
                model, batch, loss_fn, lightning, param_dtype, autocast_dtype, autocast_device=device.type
            )
            routes = stack.enter_context(_routing.recording(model))
            forward()
    except Exception as error:
        why = f"the real forward of the batch that would show them failed ({type(error).__name__}: {error})"
        raise _routing.UnknownShape(failure.replace(_NOT_RECORDED, why)) from error
    return routes


def _restorer(obj: Any) -> Callable[[], None]:
    """Put ``obj``'s attributes back as they are now (containers copied: a fresh tracer's or history's
    are empty); nothing for ``None`` or a flag."""
    if obj is None or isinstance(obj, bool):
        return lambda: None
    saved = {name: copy.copy(value) for name, value in vars(obj).items()}

    def restore() -> None:
        vars(obj).clear()
        vars(obj).update({name: copy.copy(value) for name, value in saved.items()})

    return restore


def simulate_step(
    model: nn.Module,
    batch: Any,
    step: Step,
    *,
    optimizer: OptimizerLike | None = None,
    loss_fn: Callable[[Any, Any], Tensor] | None = None,
    device: str | torch.device = "cuda",
    timeline: bool = False,
    tracer: Tracer | None = None,
    history: bool | repeated.History = False,
    follow_routing: bool = True,
    routes: _routing.Routes | None = None,
) -> _SimTracker:
    """`estimate_memory`'s step, returning its tracker (``tracer``: also what created each storage;
    ``history``: every candidate peak, `_estimating.repeated.History`, or the one given). A step with an op
    sized by values of the weights (a mixture of experts' routing) is simulated again with the sizes a real
    forward of the batch gives (``routes``, `_estimating.routing`), unless ``follow_routing`` is off."""
    if follow_routing and routes is None:
        again = functools.partial(
            simulate_step, model, batch, step, optimizer=optimizer, loss_fn=loss_fn, device=device,
            timeline=timeline, tracer=tracer, history=history,
        )  # fmt: skip
        return _following_routes(again, model, batch, loss_fn, step.precision, tracer, history)
    target = torch.device(device)
    valid_name("device", target.type, DEVICES)
    param_dtype, autocast_dtype = _dtypes(step.precision, target)
    lightning = is_lightning(model)
    _check_steppable(model, lightning, optimizer, loss_fn)

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with contextlib.ExitStack() as stack:
        stack.enter_context(isolated(model, "estimate_memory"))
        real_params = list(model.parameters())  # references only, to pair them with their twins
        stack.enter_context(_fake_parameters(model, mode, param_dtype))
        model.train()  # as a training step runs; `isolated` gives every module its flag back
        stack.enter_context(warnings.catch_warnings())
        warnings.filterwarnings("ignore", message=".*[Pp]aged optimizers are not supported on CPU.*")
        if lightning:
            stack.enter_context(lightning_stand_ins(model, _SIM_DEVICE))
        if step.checkpointing is not None and step.checkpointing != "none":
            stack.enter_context(apply_checkpointing(model, step.checkpointing))  # undone on exit
        stack.enter_context(compiled_as_inductor(model, step.compile_budget))
        shadows = _shadow.Shadows()
        fake_batch = _fake_batch(batch, mode, param_dtype, shadows)
        stack.enter_context(_shadow.not_tracing(mode))  # transformers: our fakes are not a trace
        stepped = model  # what steps: the model, or its sharded copy
        if step.sharding is not None:
            stepped = _sharded_copy(stack, model, mode, step.sharding, tracer)
        # Built outside the fake mode, as the real ones are: bitsandbytes computes its quantization maps
        # from real values when constructed. The parameters they hold are already fake.
        optimizers = _optimizers_of(stepped, optimizer, real_params)
        _use_device_defaults(optimizers, target)

        forward = _forward_fn(stepped, fake_batch, loss_fn, lightning, param_dtype, autocast_dtype)
        accumulating, first_step = step.accumulating, step.first_step
        training = TrainingStep(
            forward, optimizers, lightning, accumulating, step.release_gradients, step.fused_step
        )
        stack.enter_context(mode)
        if step.offload:
            _offloaded(stack, training, optimizers, target, first_step and lightning and not accumulating)
        if not first_step or accumulating:
            with _Placeholders():
                training.warm_up(stepped, state=not first_step)
        if routes is not None:
            routes.bind(stepped)
            stack.enter_context(routes.watching())
        tracker = _track(training, stepped, target, timeline, shadows, tracer, history, routes)
        if tracer is not None:
            tracer.finish(stepped, training.optimizers, tracker)
    return tracker


def _following_routes(
    again: Callable[..., _SimTracker],
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[[Any, Any], Tensor] | None,
    precision: str,
    tracer: Tracer | None,
    history: bool | repeated.History,
) -> _SimTracker:
    """The step simulated by ``again``: once as its fake weights route it, and where an op's size hangs on
    the weights' values (`_routing.UnknownShape`), again with the routes a real forward of the batch
    records, the ``tracer`` and ``history`` put back as they were given first."""
    fresh = [_restorer(tracer), _restorer(history)]
    try:
        return again(follow_routing=False)
    except _routing.UnknownShape as err:
        recorded = _routes(model, batch, loss_fn, str(err), precision)
    for restore in fresh:  # as they were given: the first try wrote into them
        restore()
    return again(routes=recorded)


def _check_steppable(
    model: nn.Module,
    lightning: bool,
    optimizer: OptimizerLike | None,
    loss_fn: Callable[[Any, Any], Tensor] | None,
) -> None:
    """Refuse a step that cannot be simulated: a LightningModule's manual optimization (it needs a running
    Trainer), or a plain module without the optimizer and loss function that a LightningModule brings."""
    if lightning and not model.automatic_optimization:
        raise NotImplementedError(
            f"{type(model).__name__} uses manual optimization, which needs a running Trainer; estimate a "
            "step of the underlying nn.Module with loss_fn= and optimizer= instead."
        )
    if not lightning and optimizer is None:
        raise TypeError(
            f"A plain {type(model).__name__} needs optimizer= (a name, a factory or an optimizer)."
        )
    if not lightning and loss_fn is None:
        raise TypeError(
            f"A plain {type(model).__name__} needs loss_fn=(output, target) -> loss; a LightningModule "
            "brings its own training_step."
        )


def _sharded_copy(
    stack: contextlib.ExitStack,
    model: nn.Module,
    mode: FakeTensorMode,
    sharding: Sharding,
    tracer: Tracer | None,
) -> nn.Module:
    """``model``'s copy laid out as ``sharding`` says over a fake device mesh (entered on ``stack``), its
    blocks sharded as FSDP2 shards them; the ``tracer`` follows the copy. A compiled model's copy runs
    eagerly, with a warning."""
    if compiled_modules(model):
        warnings.warn(
            f"estimate_memory: {type(model).__name__} is compiled, but FSDP2's sharded step is "
            "simulated eagerly (its sharded copy runs each module's own forward): a compiled run "
            "saves and fuses otherwise, and torch.compile's activation budget changes nothing here.",
            stacklevel=3,  # simulate_step's caller
        )
    mesh = stack.enter_context(_fsdp2.fake_mesh(*_layout.mesh_shape(sharding)))
    with mode:
        blocks = [name for name, _ in find_blocks(model)]
        stepped = _layout.laid_out_copy(model, mesh, sharding, blocks)
    if tracer is not None:
        tracer.follow(stepped)
    return stepped


def _optimizers_of(
    stepped: nn.Module, optimizer: OptimizerLike | None, real_params: list[nn.Parameter]
) -> list[torch.optim.Optimizer]:
    """The optimizers over ``stepped``'s (fake) parameters: its ``configure_optimizers``' (``None``), a
    catalogue name's, a given optimizer's rebuilt over them (``real_params``: the parameters it holds, in
    ``stepped``'s order), or a factory's."""
    if optimizer is None:
        return optimizers_from(stepped.configure_optimizers())
    if isinstance(optimizer, str):
        return [_named_optimizer(optimizer)(p for p in stepped.parameters() if p.requires_grad)]
    if isinstance(optimizer, torch.optim.Optimizer):
        return [_rebuild(optimizer, real_params, list(stepped.parameters()))]
    return [optimizer(p for p in stepped.parameters() if p.requires_grad)]


def _offloaded(
    stack: contextlib.ExitStack,
    training: TrainingStep,
    optimizers: list[torch.optim.Optimizer],
    target: torch.device,
    at_backward: bool,
) -> None:
    """``training``'s ``optimizers`` kept in host memory, as `offload_optimizer` keeps them: the host's
    memory is not the device's, so their fakes are on the meta device, uncounted (on the CPU, the CPU's).
    ``at_backward``: they move at the first backward, as OptimizerOffload does on a LightningModule's first
    step; otherwise at once."""
    host = "cpu" if target.type == "cpu" else "meta"
    install = functools.partial(_entered, stack, offload_optimizer, optimizers, host=host)
    if at_backward:
        training.offload_at_backward = install
    else:
        training.offload = install()


def _entered(stack: contextlib.ExitStack, make: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``make(*args, **kwargs)`` entered on ``stack``: undone when the stack closes."""
    return stack.enter_context(make(*args, **kwargs))


def _forward_fn(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[[Any, Any], Tensor] | None,
    lightning: bool,
    param_dtype: torch.dtype | None,
    autocast_dtype: torch.dtype | None,
    autocast_device: str = _SIM_DEVICE.type,
) -> Callable[[], Tensor]:
    """The forward pass to the loss, inside the precision plugin's context (its autocast for the ops on
    ``autocast_device``: the simulation's, or a real forward's weights')."""

    def context() -> contextlib.AbstractContextManager:
        if autocast_dtype is not None:
            return torch.autocast(autocast_device, dtype=autocast_dtype, cache_enabled=False)
        if param_dtype is not None:
            return _default_dtype(param_dtype)
        return contextlib.nullcontext()

    def forward() -> Tensor:
        with context():
            if lightning:
                return loss_of(model.training_step(batch, 0))
            assert loss_fn is not None
            inputs, target = batch
            return loss_fn(model(inputs), target)

    return forward


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
