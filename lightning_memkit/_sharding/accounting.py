"""FSDP2's part of a measured step: which storages the sharded step's peak holds as what.

The storage tracker (`_measuring.tracker`) follows every storage; under FSDP2 (``fully_shard``) this
module names what FSDP2 holds (`SHARDED_KINDS`): the sharded parameters and the unsharded copies in
flight, the sharded gradients after their reduce-scatter and the unsharded ones before it, and the
collectives' buffers. Kept apart from the tracker as torch keeps ``fsdp2_mem_tracker.py`` apart from
``mem_tracker.py``. The tracker's storage records are read and marked here through its ``records``
(every storage record of a tensor, registering those first seen) and ``record`` (the last of them).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from lightning_memkit._sharding import fsdp2

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
#: Op namespaces of collectives and FSDP2's copies in and out of them.
_COLLECTIVES = frozenset({"c10d", "_c10d_functional", "fsdp"})

#: The storage records of a tensor (``Tracker.records``); ``preexisting``: live since the step began.
Records = Callable[..., Iterable[Any]]


@functools.cache
def is_collective(func: Any) -> bool:
    """Whether op ``func`` is a collective or one of FSDP2's copies in and out of one."""
    return getattr(func, "namespace", None) in _COLLECTIVES


def _reduce_scatters() -> frozenset:
    """The in-place reduce-scatter ops (their first argument is the output), where torch has them."""
    c10d = getattr(torch.ops, "c10d", None)
    names = ("_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_")
    return frozenset(getattr(c10d, n).default for n in names if c10d is not None and hasattr(c10d, n))


_REDUCE_SCATTERS = _reduce_scatters()


def communicated(
    record: Callable[[Tensor], Any], func: Any, args: tuple, tensors: Iterable[Tensor], clock: int
) -> None:
    """Collective ``func(*args)`` read or wrote ``tensors``: they are communication buffers, unless they are
    more; what a reduce-scatter writes becomes the sharded gradients (FSDP2's, viewed or cast from it),
    held as gradients from ``clock``."""
    for t in tensors:
        rec = record(t)
        if rec is not None and rec.kind is None:
            rec.kind = "communication"
    if func in _REDUCE_SCATTERS and args and isinstance(args[0], Tensor):
        rec = record(args[0])
        if rec is not None and rec.grad_at is None:
            rec.grad_at, rec.kind = clock, "sharded_gradients"


def claim_sharded(records: Records, model: nn.Module, *, preexisting: bool = False) -> bool:
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
            for rec in () if t is None else records(t, preexisting=preexisting):
                rec.category, rec.kind = "parameters", kind
        for t, kind in ((sharded, "sharded_gradients"), (unsharded, "unsharded_gradients")):
            grad = None if t is None else t.grad
            for rec in () if grad is None else records(grad, preexisting=preexisting):
                if rec.category is None:
                    rec.kind = kind
                    if rec.grad_at is None:  # held as a gradient since it was made (see `communicated`)
                        rec.grad_at = 0
    return sharded_model


def trainable_unsharded(model: nn.Module) -> Iterator[Tensor]:
    """FSDP2's unsharded parameters that backward accumulates gradients into."""
    for fsdp_param in fsdp2.fsdp_params(model):
        p = fsdp2.unsharded_param(fsdp_param)
        if p is not None and p.requires_grad:
            yield p


def unsharded_gradient(records: Records, param: Tensor) -> None:
    """A gradient FSDP2's backward accumulated into unsharded ``param``, before its reduce-scatter."""
    for rec in () if param.grad is None else records(param.grad):
        rec.kind = rec.kind or "unsharded_gradients"


def sharded_breakdown(at_peak: Iterable[tuple[Any, int]], category: Callable[[Any], str]) -> dict[str, int]:
    """FSDP2's part of the peak by `SHARDED_KINDS` (bytes), from the storage records live at the peak with
    their sizes then (``at_peak``) and the ``category`` of each: the sharded and unsharded parameters and
    gradients, and the collectives' buffers (temporary). Each is part of one of the five categories."""
    sums = dict.fromkeys(SHARDED_KINDS, 0)
    for rec, nbytes in at_peak:
        if rec.kind is None:
            continue
        rec_category = category(rec)
        if SHARDED_KINDS[rec.kind] == rec_category:
            sums[rec.kind] += nbytes
        elif rec_category == "temporary":  # a gradient still in its reduce-scatter at the peak
            sums["communication"] += nbytes
    return sums
