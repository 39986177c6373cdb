"""The model and the batch of a simulated step, on fake tensors.

`fake_parameters` swaps every parameter and buffer for a fake twin while inside (tied weights stay tied,
quantized weights keep their quantization state: `_estimating.quantized`) and puts the user's own back
untouched; `fake_batch` fakes the batch and lets the shadows (`_estimating.shadow`) learn its real values;
`sharded_copy` lays a copy out over a fake device mesh as FSDP2 and tensor parallelism would, and
`simulated_layout` reads that layout without running a step.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensorMode

from lightning_memkit._checkpointing.blocks import find_blocks
from lightning_memkit._estimating import quantized as _quantized
from lightning_memkit._estimating import shadow as _shadow
from lightning_memkit._estimating.compiled import compiled_modules
from lightning_memkit._estimating.fake_tracker import SIM_DEVICE
from lightning_memkit._estimating.isolate import isolated
from lightning_memkit._estimating.trace import Tracer
from lightning_memkit._sharding import fsdp2 as _fsdp2
from lightning_memkit._sharding import layout as _layout
from lightning_memkit._step import Sharding

__all__ = [
    "fake_batch",
    "fake_parameters",
    "sharded_copy",
    "simulated_layout",
    "twinned",
]


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
        return torch.empty_strided(t.shape, t.stride(), dtype=dtype, device=SIM_DEVICE)


def simulated_layout(model: nn.Module, sharding: Sharding) -> _layout.Layout:
    """The layout ``sharding`` gives ``model`` where its step is simulated (`_sharding.layout.layout_of` of
    the laid-out copy, on fake tensors over the fake mesh), without running a step: what a run's own model
    is held to once its layout is applied. ``model`` is untouched."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with contextlib.ExitStack() as stack:
        stack.enter_context(isolated(model, "the simulated layout"))
        stack.enter_context(fake_parameters(model, mode, None))
        mesh = stack.enter_context(_fsdp2.fake_mesh(*_layout.mesh_shape(sharding)))
        with mode:
            blocks = [name for name, _ in find_blocks(model)]
            return _layout.layout_of(_layout.laid_out_copy(model, mesh, sharding, blocks))


@contextlib.contextmanager
def fake_parameters(model: nn.Module, mode: FakeTensorMode, dtype: torch.dtype | None) -> Iterator[None]:
    """Every parameter and buffer of ``model`` swapped for a fake twin while inside (`twinned`); a
    bitsandbytes quantized weight for one carrying its quantization state, faked (`_estimating.quantized`),
    and a quantized layer's own state too; a torchao quantized weight for its subclass over fake inner
    tensors."""
    fake = functools.partial(_fake_like, mode=mode, dtype=dtype)
    twins = _quantized.QuantizedTwins(mode, fake)

    def make(t: Tensor) -> Tensor:
        if _quantized.is_torchao_quantized(t):
            return twins.wrapper(t)
        return twins.parameter(t) if _quantized.is_quantized(t) else fake(t)

    with twinned(model, make), _quantized.fake_layer_states(model, twins):
        yield


@contextlib.contextmanager
def twinned(model: nn.Module, make: Callable[[Tensor], Tensor]) -> Iterator[None]:
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


def fake_batch(batch: Any, mode: FakeTensorMode, dtype: torch.dtype | None, shadows: _shadow.Shadows) -> Any:
    """The batch with fake twins for its tensors; ``shadows`` learns the real values of the twins."""

    def fake(t: Tensor) -> Tensor:
        twin = _fake_like(t, mode, dtype)
        shadows.adopt(t, twin)
        return twin

    return apply_to_collection(batch, Tensor, fake)


def sharded_copy(
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
