"""The private torch entry points the storage tracker (`_measuring.tracker`, `_measuring.patches`) binds,
reached in one place.

torch keeps these where it likes between releases. Each is looked up here, by a lookup that never raises,
so a torch that moves one cannot break ``import lightning_memkit.callbacks``. Where the tracker can do
without one, a fallback measures a little less exactly (said at each); where it cannot, using it raises a
`RuntimeError` naming the entry point and the torch version.
"""

from __future__ import annotations

import functools
import importlib
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor


def _find(module: str, *attributes: str) -> Any:
    """``module.attribute1.attribute2...`` or ``None`` where this torch has no such thing."""
    try:
        found: Any = importlib.import_module(module)
    except Exception:  # a torch that moved or broke it: the caller's fallback or error says so
        return None
    for name in attributes:
        found = getattr(found, name, None)
        if found is None:
            return None
    return found


def _missing(where: str) -> RuntimeError:
    return RuntimeError(
        f"lightning_memkit's measurement needs torch's private `{where}`, which torch {torch.__version__} "
        "does not have (the project runs torch 2.11 to 2.13, which have it): measure with one of those."
    )


def _required(found: Any, where: str) -> Any:
    """``found``, or the error saying this torch lacks ``where``."""
    if found is None:
        raise _missing(where)
    return found


#: ``CompileContext.try_get``, bound once (asked on every op). Fallback: `torch.compiler.is_compiling`,
#: true while dynamo traces.
_compile_context: Callable[[], Any] = _find("torch._guards", "CompileContext", "try_get") or (
    lambda: True if torch.compiler.is_compiling() else None
)


def compiling() -> bool:
    """Whether torch.compile is compiling in this thread."""
    return _compile_context() is not None


#: ``torch._C._current_autograd_node``. Fallback: no node is ever running, so the engine's gradient sums
#: are not told apart (the measurement may then read high on such a step, never low).
current_autograd_node: Callable[[], Any] = _find("torch._C", "_current_autograd_node") or (lambda: None)

_top_hooks = _find("torch._C._autograd", "_top_saved_tensors_default_hooks")
_push_hooks = _find("torch._C._autograd", "_push_saved_tensors_default_hooks")
_pop_hooks = _find("torch._C._autograd", "_pop_saved_tensors_default_hooks")


def top_saved_tensors_hooks() -> tuple[Any, Any] | None:
    """The innermost (pack, unpack) saved-tensor default hooks in force, or ``None``."""
    return _required(_top_hooks, "torch._C._autograd._top_saved_tensors_default_hooks")(False)


def push_saved_tensors_hooks(pack: Callable, unpack: Callable) -> None:
    _required(_push_hooks, "torch._C._autograd._push_saved_tensors_default_hooks")(pack, unpack)


def pop_saved_tensors_hooks() -> None:
    _required(_pop_hooks, "torch._C._autograd._pop_saved_tensors_default_hooks")()


_disable_dispatch = _find("torch._C", "_DisableTorchDispatch")


def disable_torch_dispatch() -> Any:
    """A context in which no dispatch mode sees the ops run (``torch._C._DisableTorchDispatch``)."""
    return _required(_disable_dispatch, "torch._C._DisableTorchDispatch")()


_mode_stack = _find("torch.utils._python_dispatch", "_get_current_dispatch_mode_stack")


def dispatch_mode_stack() -> list[Any]:
    """The dispatch modes in force in this thread, outermost first (autograd carries them into its backward
    threads)."""
    return _required(_mode_stack, "torch.utils._python_dispatch._get_current_dispatch_mode_stack")()


#: Whether tensors of a class wrap others (DTensor): ``is_traceable_wrapper_subclass_type``. Fallback: the
#: protocol it checks (``__tensor_flatten__`` and ``__tensor_unflatten__``).
wraps_tensors: Callable[[type], bool] = _find(
    "torch.utils._python_dispatch", "is_traceable_wrapper_subclass_type"
) or (lambda cls: hasattr(cls, "__tensor_flatten__") and hasattr(cls, "__tensor_unflatten__"))

#: ``is_non_overlapping_and_dense_or_false``. Fallback: ``False``, so no engine sum counts as made in place
#: (the measurement may then read high, never low).
non_overlapping_and_dense: Callable[[Tensor], bool] = _find(
    "torch._prims_common", "is_non_overlapping_and_dense_or_false"
) or (lambda t: False)

#: torch's ``FakeTensor`` class, or ``()`` (nothing is one) for a torch without it: no simulation runs there.
FakeTensor: type | tuple = _find("torch._subclasses.fake_tensor", "FakeTensor") or ()


@functools.cache
def _hidden(dynamo: Any, package: str) -> None:
    add = getattr(getattr(dynamo, "trace_rules", None), "add", None)
    if add is not None:
        add(package)


def hide_from_dynamo(package: str) -> None:
    """Have dynamo, once it is imported (nothing is compiled before), skip every frame of ``package``
    (``trace_rules.add``, once per process). Fallback: nothing; then dynamo may compile the tracker's hooks
    (a compiled step may then read high)."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:
        _hidden(dynamo, package)


def compiled_allocator_home() -> Any:
    """``torch._C._dynamo.guards``, where inductor's generated code finds its allocation fast paths, or
    ``None``."""
    return getattr(getattr(torch._C, "_dynamo", None), "guards", None)


def generated_modules() -> list[Any]:
    """The modules of inductor's generated code loaded in this process so far (none before inductor is
    imported: then nothing was compiled)."""
    codecache = sys.modules.get("torch._inductor.codecache")
    cache = getattr(codecache, "PyCodeCache", None)
    modules = [*getattr(cache, "modules", ()), *getattr(cache, "modules_no_attr", {}).values()]
    return list({id(m): m for m in modules}.values())


def checkpoint_version_wrapper() -> type | None:
    """``torch.utils.checkpoint._VersionWrapper``, which wraps what selective checkpointing caches, or
    ``None`` (then those outputs count as temporary; the peak is the same)."""
    return _find("torch.utils.checkpoint", "_VersionWrapper")


def work_class() -> type | None:
    """``torch.distributed.Work``, whose ``wait`` finishes a collective, or ``None``."""
    if not torch.distributed.is_available():
        return None
    return getattr(torch.distributed, "Work", None)
