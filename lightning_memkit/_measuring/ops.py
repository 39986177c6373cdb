"""What the storage tracker (`_measuring.tracker`) must know of some ops to follow a step as it runs
unwatched.

* Ops whose outputs are sized by their inputs' values (`_value_shaped`): a step of the same shapes may then
  allocate otherwise, so `MemoryMonitor` measures each such step.
* autograd's gradient sums: where two gradients reach one input, the engine adds the second into the
  first in place when it holds the first's only reference, but out of place whenever a dispatch mode is
  on (``at::isTensorSubclassLike`` says yes to every tensor then); some backward formulas likewise scatter
  into zeros out of place (`_SCATTERED`). `engine_sum` and `scattered` recognise these; the tracker counts
  one as made in place when its first operand dies at once (`Tracker._settle`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from lightning_memkit._measuring import _torch_private

#: The op the autograd engine sums two gradients of one input with, under a dispatch mode.
_ADD = torch.ops.aten.add.Tensor
#: Ops autograd's formulas run out of place into zeros they just made, where unwatched they write into
#: them in place: ``index``'s backward (``index_put``, accumulating), ``gather``'s (``scatter_add``) and
#: ``index_select``'s (``index_add``) take the out-of-place variant when any tensor is subclass-like, and
#: under a dispatch mode every tensor is (``areAnyTensorSubclassLike``).
_SCATTERED = frozenset(
    {torch.ops.aten.index_put.default, torch.ops.aten.scatter_add.default, torch.ops.aten.index_add.default}
)
#: Ops whose outputs' shapes come from their inputs' values, without torch's tag for it: a packed
#: sequence's (its lengths).
_VALUE_SHAPED = frozenset({torch.ops.aten._pack_padded_sequence.default})

#: The tracker's live storages, by storage key: ``(weak reference, record)``; a record's ``born_in`` is the
#: backward node that made it.
Live = Mapping[int, tuple[Any, Any]]
#: Whether a tensor counts as a plain tensor (not a subclass) for the engine (`Tracker._plain`).
Plain = Callable[[Tensor], bool]


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


def engine_sum(func: Any, args: tuple, kwargs: dict, out: Any, node: int, live: Live, plain: Plain) -> bool:
    """Whether ``func(*args)``, run while backward node ``node`` runs, is the engine summing two
    gradients of one input (``InputBuffer::accumulate``: ``old + new``) where, unwatched, it would add
    ``new`` into ``old`` in place if it held ``old``'s only reference: ``old`` a plain dense tensor,
    not a view (a weight's gradient through ``t()``), made by an earlier node, and ``new`` made by this
    one (a sum inside a node's formula adds what that node made to what it was given, or to what the
    forward saved). Whether the engine held the only reference, the tracker learns from ``old``'s death.
    A gradient a node passes on as it came (``AddBackward0``'s) is not summed as made in place: the
    measurement may read high there, never low."""
    if func is not _ADD or kwargs or len(args) != 2:
        return False
    old, new = args
    if not (isinstance(old, Tensor) and isinstance(new, Tensor) and isinstance(out, Tensor)):
        return False
    if not _summable(old, new, out, plain):
        return False
    summed, added = live.get(id(old.untyped_storage())), live.get(id(new.untyped_storage()))
    if summed is None or added is None or summed[1].born_in in (None, node) or added[1].born_in != node:
        return False
    return _torch_private.non_overlapping_and_dense(old)


def _summable(old: Tensor, new: Tensor, out: Tensor, plain: Plain) -> bool:
    """Whether the engine could add ``new`` into ``old`` in place, giving ``out``: both plain strided
    tensors, ``old`` of ``out``'s shape, not a zero tensor and not a view (its base holds the storage too:
    ``storage().use_count() == 1`` fails)."""
    if not (plain(old) and plain(new)) or old.shape != out.shape:
        return False
    if old.layout != torch.strided or new.layout != torch.strided or old._is_zerotensor():
        return False
    return not old._is_view()


def scattered(func: Any, args: tuple, out: Any, node: int, live: Live, plain: Plain) -> bool:
    """Whether ``func(*args)``, run while backward node ``node`` runs, is a formula scattering a
    gradient into zeros this node just made (`_SCATTERED`), which unwatched it does in place: like an
    engine's sum, when the zeros die with it, the two never coexisted (+25 % on a step gathering half the
    rows of an activation, measured and simulated alike)."""
    if func not in _SCATTERED or not args or not isinstance(out, Tensor):
        return False
    if func is torch.ops.aten.index_put.default and not (len(args) > 3 and args[3]):
        return False  # not accumulating: not the index formula
    zeros = args[0]
    if not isinstance(zeros, Tensor) or not plain(zeros) or zeros._is_view():
        return False
    made = live.get(id(zeros.untyped_storage()))
    return made is not None and made[1].born_in == node and zeros.shape == out.shape
