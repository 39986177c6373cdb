"""Shadow values: the simulated step takes the branches the real batch takes.

`estimate_memory` runs the step on fake tensors, which have no values, so a Python value read from a tensor
(``.item()``, ``bool(mask.all())``, ``torch.equal``) would be a placeholder, and a data-dependent shape
(``nonzero``, boolean-mask indexing) would not exist. Yet the batch is real and small, and what the model
reads from it is mostly a function of the batch and of constants alone: the attention mask, position ids
built with ``torch.arange``, "is there any padding", "are sequences packed". Those are computed for real.

How: every fake tensor whose value is known gets a *shadow*, a real CPU tensor with that value, kept in a
weak map keyed by the fake tensor (`Shadows`).

* Real batch tensors (not on the meta device) get a copy of themselves; real constants the step creates
  (``torch.tensor(...)``) stand for themselves (copied before an op that writes to them or views them).
* An aten op whose tensor inputs all have shadows, or that has none (factories: ``arange``, ``ones``),
  runs again on the shadows, on the CPU, with every dispatch mode switched off (the fake mode and the
  tracker never see it), and its outputs' shadows are the results. Not for random ops
  (``torch.Tag.nondeterministic_seeded``: the real RNG stream must not move), not for other namespaces'
  ops, and not above `MAX_NUMEL` elements in any input or output: a shadow costs real memory and time,
  and is meant for masks and indices. Values that depend on the weights never have shadows.
* An op that writes to a tensor and cannot be replayed drops the shadows of every tensor on that storage.
* A Python value read from shadowed tensors (``_local_scalar_dense``, ``equal``, ``is_nonzero``: aten
  ops that return no tensor) is the real value; otherwise the caller falls back to its placeholder.
* An op whose output shape depends on the values (``nonzero``, ``masked_select``, ``x[mask]``) gets a fake
  output of the real result's shape when its inputs are shadowed, or, for ``x[mask]``,
  ``masked_select`` and ``pack_padded_sequence``, when the mask or the lengths are (``x``'s values do
  not change the shape: zeros stand in for them); otherwise it raises as before. A packed sequence's
  ``batch_sizes``, which the recurrent kernels read on the host where no mode sees it, is the real
  tensor, not a fake one (`_HOST_READ`).

``pad_packed_sequence`` runs aten's ``_pad_packed_sequence``, whose C++ writes the lengths it returns through
``data_ptr``: a fake tensor has no data to write. While a simulation runs, `not_tracing` has torch's ``_VF``
run it for the simulation's tensors as `_pad_packed_sequence` (the same ops, the lengths made on the host).

Hugging Face's transformers asks ``is_tracing(tensor)`` before it reads such values, and answers yes for any
`FakeTensor` (it cannot tell a simulation from ``torch.export``). `not_tracing` makes it answer for the
simulation's own fake tensors as for real ones, while the simulation runs: the patched function replaces
the original under every name a loaded ``transformers`` module holds it by, and the originals are put back
afterwards. transformers is never imported here.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import DynamicOutputShapeException, FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten
from torch.utils.weak import WeakTensorKeyDictionary

__all__ = ["MAX_NUMEL", "NO_VALUE", "Shadows", "not_tracing"]

#: The largest tensor (elements) given a shadow, or read by an op that computes one.
MAX_NUMEL = 1 << 22

#: Returned by `Shadows.value` when the real value is unknown.
NO_VALUE: Any = object()

_MISSING: Any = object()

# Data-dependent shapes: the arguments whose values never change the output's shape (only the mask's do).
# Without a shadow they are stood in for by zeros of their shape, for the shape alone.
_SHAPE_ONLY: dict[Any, tuple[int, ...]] = {
    torch.ops.aten.index.Tensor: (0,),
    torch.ops.aten.masked_select.default: (0,),
    torch.ops.aten._pack_padded_sequence.default: (0,),  # (input, lengths, batch_first)
}
# Outputs, by index, that later kernels read on the host with no op that a mode sees: a packed sequence's
# ``batch_sizes`` (a CPU tensor whatever the device), which the LSTM/GRU/RNN kernels and the packing's
# backward read through ``data_ptr``. A fake one has no data there; its values follow from the lengths
# alone, so where those are known it is the real tensor itself (its own shadow, as a user's tensor is).
_HOST_READ: dict[Any, tuple[int, ...]] = {
    torch.ops.aten._pack_padded_sequence.default: (1,),
}


def _written(func: Any, args: tuple, kwargs: dict) -> Iterator[Any]:
    """The arguments ``func`` writes to (a tensor, a list of tensors, or ``None``)."""
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            if arg.kwarg_only:
                yield kwargs.get(arg.name)
            elif i < len(args):
                yield args[i]
            else:
                yield kwargs.get(arg.name)


class Shadows:
    """The real values behind the fake tensors of one simulated step, op by op (see the module docstring)."""

    def __init__(self, max_numel: int = MAX_NUMEL) -> None:
        self.max_numel = max_numel
        self.real = WeakTensorKeyDictionary()
        self._storages: set[int] = set()  # storages some shadowed fake tensor lives on (may hold stale ids)

    # --- set-up ----------------------------------------------------------------------------------

    def adopt(self, real: Tensor, fake: Tensor) -> None:
        """Give ``fake``, the twin of the user's batch tensor ``real``, a copy of ``real`` as its shadow."""
        if isinstance(real, FakeTensor) or real.is_meta or real.layout != torch.strided:
            return  # sparse: no storage to shadow (its branches are not followed)
        if real.numel() > self.max_numel:
            return
        with _disable_current_modes(), torch.no_grad():
            try:
                copy = torch.empty_strided(real.shape, real.stride(), dtype=fake.dtype, device="cpu")
                copy.copy_(real)
            except RuntimeError:  # overlapping strides (an expanded tensor)
                copy = real.detach().to("cpu", fake.dtype, copy=True)
        self._set(fake, copy)

    def _set(self, fake: Tensor, real: Tensor) -> None:
        self.real[fake] = real
        self._storages.add(fake.untyped_storage()._cdata)

    # --- the dispatch hooks ------------------------------------------------------------------------

    def value(self, func: Any, args: tuple, kwargs: dict | None) -> Any:
        """The real Python value an aten op that returns no tensor gives on the shadows, or `NO_VALUE`."""
        returns = func._schema.returns
        if func.namespace != "aten" or not returns or any(_returns_tensor(r) for r in returns):
            return NO_VALUE
        flat, spec = tree_flatten((args, kwargs or {}))
        if not any(isinstance(a, FakeTensor) for a in flat):
            return NO_VALUE
        real = self._reals(flat)
        if real is None:
            return NO_VALUE
        real_args, real_kwargs = tree_unflatten(real, spec)
        try:
            with _disable_current_modes():
                return func(*real_args, **real_kwargs)
        except Exception:  # e.g. a kernel the CPU lacks: the caller's placeholder, as without a shadow
            return NO_VALUE

    def run(
        self, func: Any, args: tuple, kwargs: dict | None, call: Callable[[Any, tuple, dict], Any]
    ) -> Any:
        """``call(func, args, kwargs)`` (the tracker's dispatch, on the fake tensors), with the shadows of
        its outputs computed too. An output whose shape depends on the values is made with
        ``call(aten.empty_strided, ...)`` in the real result's shape, when the inputs are shadowed."""
        kwargs = kwargs or {}
        try:
            out = call(func, args, kwargs)
        except DynamicOutputShapeException:
            real_out = self._replay(func, args, kwargs)
            known = real_out is not _MISSING
            if not known:
                real_out = self._replay(func, self._stand_ins(func, args), kwargs)
            if real_out is _MISSING:
                raise
            host_read = _HOST_READ.get(func, ())
            if host_read and isinstance(real_out, tuple):
                return tuple(
                    real if i in host_read else self._fake_of(real, call, known)
                    for i, real in enumerate(real_out)
                )
            return tree_map(lambda real: self._fake_of(real, call, known), real_out)
        self._follow(func, args, kwargs, out)
        return out

    def follows(self, func: Any, args: tuple, kwargs: dict | None) -> bool:
        """Whether `run` sizes ``func``'s output, one sized by values, from the shadows: every input whose
        values it reads has one."""
        flat, _ = tree_flatten((self._stand_ins(func, args), kwargs or {}))
        return self._reals(flat) is not None

    # --- internals -------------------------------------------------------------------------------

    def _reals(self, flat: list, copy: bool = False) -> list | None:
        """``flat`` with every tensor replaced by its shadow; ``None`` if one has none or is too large.

        A real tensor of the user's (not fake) is its own shadow; with ``copy``, a copy of it, so that an
        op that writes to its inputs or returns a view of them never reaches the user's tensor.
        """
        out = []
        for a in flat:
            if isinstance(a, Tensor):
                if a.numel() > self.max_numel:
                    return None
                if isinstance(a, FakeTensor):
                    a = self.real.get(a, _MISSING)
                    if a is _MISSING:
                        return None
                elif a.is_meta:
                    return None
                elif copy:
                    with _disable_current_modes():
                        a = a.detach().clone()
            out.append(a)
        return out

    def _replay(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """``func`` run on the shadows of ``args``/``kwargs``, or `_MISSING` where that is not allowed."""
        if func.namespace != "aten" or torch.Tag.nondeterministic_seeded in func.tags:
            return _MISSING
        if kwargs.get("device") is not None:  # shadows live on the CPU, whatever device the step names
            kwargs = {**kwargs, "device": torch.device("cpu")}
        flat, spec = tree_flatten((args, kwargs))
        schema = func._schema
        aliasing = schema.is_mutable or any(r.alias_info is not None for r in schema.returns)
        real = self._reals(flat, copy=aliasing)
        if real is None:
            return _MISSING
        real_args, real_kwargs = tree_unflatten(real, spec)
        try:
            with _disable_current_modes(), torch.no_grad():
                return func(*real_args, **real_kwargs)
        except Exception:  # a kernel the CPU lacks for this dtype, say: no shadow, as for a random op
            return _MISSING

    def _follow(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        fakes, _ = tree_flatten(out)
        if not func._schema.is_mutable and not any(isinstance(t, FakeTensor) for t in fakes):
            return
        if any(isinstance(t, Tensor) and t.numel() > self.max_numel for t in fakes):
            real_out = _MISSING
        else:
            real_out = self._replay(func, args, kwargs)
        if real_out is _MISSING:
            self._drop_written(func, args, kwargs)
            return
        reals, _ = tree_flatten(real_out)
        if len(reals) != len(fakes):
            self._drop_written(func, args, kwargs)
            return
        for fake, real in zip(fakes, reals, strict=True):
            if isinstance(fake, FakeTensor) and isinstance(real, Tensor) and _alike(fake, real):
                self._set(fake, real)
            elif isinstance(fake, FakeTensor):
                self.real.pop(fake, None)  # an in-place op that could not be followed

    def _drop_written(self, func: Any, args: tuple, kwargs: dict) -> None:
        """Forget the values of the storages ``func`` wrote without being replayed on the shadows."""
        if not self._storages or not func._schema.is_mutable:
            return
        written: set[int] = set()
        for target in _written(func, args, kwargs):
            for t in tree_flatten(target)[0]:
                if isinstance(t, Tensor):
                    written.add(t.untyped_storage()._cdata)
        hit = written & self._storages
        if not hit:
            return
        for fake in [f for f in list(self.real.keys()) if f.untyped_storage()._cdata in hit]:
            del self.real[fake]
        self._storages -= hit

    def _fake_of(self, real: Any, call: Callable[[Any, tuple, dict], Any], shadow: bool) -> Any:
        """A fake tensor like ``real`` (anything else as it is), with ``real`` as its shadow if ``shadow``."""
        if not isinstance(real, Tensor):
            return real
        kwargs = {"dtype": real.dtype, "device": torch.device("cpu")}
        fake = call(torch.ops.aten.empty_strided.default, (real.shape, real.stride()), kwargs)
        if shadow:
            self._set(fake, real)
        return fake

    def _stand_ins(self, func: Any, args: tuple) -> tuple:
        """``args`` with the unshadowed ones whose values cannot change ``func``'s shape as zeros (in a
        one-element storage, expanded); unchanged where ``func`` has none such."""
        positions = _SHAPE_ONLY.get(func, ())
        args = list(args)
        for i in positions:
            a = args[i] if i < len(args) else None
            if isinstance(a, FakeTensor) and a not in self.real:
                with _disable_current_modes():
                    args[i] = torch.zeros((), dtype=a.dtype).expand(a.shape)
        return tuple(args)


def _alike(fake: Tensor, real: Tensor) -> bool:
    return real.shape == fake.shape and real.dtype == fake.dtype


def _returns_tensor(ret: Any) -> bool:
    kind = ret.type
    if isinstance(kind, torch.OptionalType):
        kind = kind.getElementType()
    if isinstance(kind, torch.ListType):
        kind = kind.getElementType()
    return isinstance(kind, torch.TensorType)


# --------------------------------------------------------------------------------------------------
# transformers' is_tracing
# --------------------------------------------------------------------------------------------------

_LOCK = threading.Lock()
_modes: dict[int, int] = {}  # id(FakeTensorMode) of running simulations -> how many
_originals: dict[str, Callable] = {}  # "is_tracing" / "is_fake_tensor" -> transformers' function
_patches: dict[str, Callable] = {}


def _simulated(x: Any) -> bool:
    return isinstance(x, FakeTensor) and id(x.fake_mode) in _modes


def _make_patches(originals: dict[str, Callable]) -> dict[str, Callable]:
    is_tracing, is_fake_tensor = originals.get("is_tracing"), originals.get("is_fake_tensor")
    patches: dict[str, Callable] = {}
    if is_tracing is not None:

        def patched_is_tracing(tensor: Any = None) -> bool:
            return is_tracing(None if _simulated(tensor) else tensor)

        patches["is_tracing"] = patched_is_tracing
    if is_fake_tensor is not None:

        def patched_is_fake_tensor(x: Any) -> bool:
            return False if _simulated(x) else is_fake_tensor(x)

        patches["is_fake_tensor"] = patched_is_fake_tensor
    return patches


def _pad_packed_sequence(
    data: Tensor, batch_sizes: Tensor, batch_first: bool, padding_value: float, total_length: int
) -> tuple[Tensor, Tensor]:
    """aten's ``_pad_packed_sequence`` (CompositeImplicit: its ops are the step's), op for op as its C++
    runs them, for a simulation's fake ``data``: the C++ writes the returned lengths through ``data_ptr``,
    which a fake tensor has none of; here they are a real host tensor (as in the real step, a CPU one),
    made from the real ``batch_sizes`` (`_HOST_READ`). Anything else goes to aten's own."""
    if not _simulated(data) or isinstance(batch_sizes, FakeTensor):
        return _VF_PAD(data, batch_sizes, batch_first, padding_value, total_length)
    aten = torch.ops.aten
    with _disable_current_modes():
        sizes = batch_sizes.tolist()
    max_batch, real_length = sizes[0], len(sizes)
    length = total_length if total_length > 0 else real_length
    if length < real_length:
        raise ValueError(
            f"Expected total_length to be at least the length of the longest sequence ({real_length}), "
            f"got {total_length}"
        )
    output = torch.full((length, max_batch, *data.shape[1:]), padding_value, dtype=data.dtype)
    lengths = [0] * max_batch
    offset, previous, start = 0, max_batch, 0
    for i in range(real_length + 1):
        batch = sizes[i] if i < real_length else 0
        if batch != previous:  # output[start:i, :previous] = the packed rows of steps start..i-1
            rows = previous * (i - start)
            block = aten.slice.Tensor(data, 0, offset, offset + rows)
            target = aten.slice.Tensor(aten.slice.Tensor(output, 0, start, i), 1, 0, previous)
            target.copy_(block.view(i - start, previous, *data.shape[1:]))
            offset, start = offset + rows, i
        lengths[batch:previous] = [i] * (previous - batch)  # the sequences that end at step i
        previous = batch
    with _disable_current_modes():
        real_lengths = torch.tensor(lengths, dtype=torch.int64)
    return (output.transpose(0, 1) if batch_first else output), real_lengths


_VF_PAD = torch._C._VariableFunctions._pad_packed_sequence


def _transformers_modules() -> list[Any]:
    modules = list(sys.modules.items())
    return [m for name, m in modules if m is not None and name.split(".")[0] == "transformers"]


def _swap(names: dict[str, Callable], by: dict[str, Callable]) -> None:
    """Wherever a transformers module holds ``names[k]`` (under any attribute name), put ``by[k]``."""
    swap = {id(f): by[k] for k, f in names.items() if k in by}
    for module in _transformers_modules():
        table = getattr(module, "__dict__", None)
        if not isinstance(table, dict):
            continue
        for attr, value in list(table.items()):
            new = swap.get(id(value))
            if new is not None and callable(value):
                table[attr] = new


@contextlib.contextmanager
def not_tracing(mode: FakeTensorMode) -> Iterator[None]:
    """While inside, transformers' ``is_tracing``/``is_fake_tensor`` treat ``mode``'s tensors as real ones,
    and torch's ``_VF._pad_packed_sequence`` pads them as `_pad_packed_sequence` (real tensors as before).

    Nested and concurrent simulations share one patch.
    """
    key = id(mode)
    with _LOCK:
        first = not _modes
        _modes[key] = _modes.get(key, 0) + 1
        if first:
            utils = sys.modules.get("transformers.utils.import_utils")
            found = {k: getattr(utils, k) for k in ("is_tracing", "is_fake_tensor") if hasattr(utils, k)}
            _originals.update(found)
            _patches.update(_make_patches(found))
            _swap(_originals, _patches)
            # An instance attribute, found before _VF's __getattr__ gives torch's own.
            torch._VF._pad_packed_sequence = _pad_packed_sequence
    try:
        yield
    finally:
        with _LOCK:
            _modes[key] -= 1
            if not _modes[key]:
                del _modes[key]
            if not _modes:
                _swap(_patches, _originals)  # also in modules imported while the simulation ran
                torch._VF.__dict__.pop("_pad_packed_sequence", None)
                _originals.clear()
                _patches.clear()
