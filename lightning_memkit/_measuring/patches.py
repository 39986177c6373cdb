"""The process-wide patches a storage tracker needs while it watches, and the interface they report to.

Some allocations of a training step bypass both the dispatcher and autograd's saved-tensor hooks, so no
dispatch mode sees them:

* activation checkpointing's CPU RNG state, kept per region for its recompute (``torch.get_rng_state``,
  5,056 bytes), and the outputs selective checkpointing's policy saves in its own cache, each wrapped in
  the private ``torch.utils.checkpoint._VersionWrapper`` (without that class they count as temporary; the
  peak is the same, and tests/measuring/test_measure.py says so);
* saved-tensor hooks the step pushes itself (``save_on_cpu``) replace the tracker's while in force: what
  they pack is reported all the same;
* FSDP2 allocates and frees its unsharded parameters with ``UntypedStorage.resize_``, and gloo's
  collectives allocate buffers in their worker threads that the calling thread first meets while the
  collective's ``Work.wait()`` finishes it;
* torch.func's transforms refuse to run under saved-tensor hooks (``disable_saved_tensors_hooks``): the
  tracker's hooks step aside for them;
* torch.compile's generated code (inductor's Python wrapper) allocates its buffers with the fast paths
  ``torch._C._dynamo.guards._empty_strided_{cpu,cuda,...}`` (`_COMPILED_ALLOCATORS`).

`watched` installs these patches when the first tracker starts watching (in any thread) and restores
torch's own functions when the last one stops, as torch's ``MemTracker`` patches ``resize_`` only while
it runs. Each patch reports to a `Listener`: the innermost one watching the calling thread, or, for the
compiled allocators and `gradient_consumed`, the listeners on the dispatch mode stack, which torch.compile
keeps there while its code runs and autograd carries into its backward threads.
"""

from __future__ import annotations

import abc
import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import Tensor

from lightning_memkit._measuring import _torch_private


class Listener(abc.ABC):
    """What the patches tell a watching tracker: each method is one thing no dispatch mode sees."""

    @abc.abstractmethod
    def on_rng_state(self, state: Tensor) -> None:
        """Checkpointing kept a CPU RNG state for its recompute."""

    @abc.abstractmethod
    def pack(self, t: Tensor) -> Tensor:
        """``t`` is saved for backward (by selective checkpointing's cache); returns ``t``."""

    @abc.abstractmethod
    def kept(self, packed: Any) -> None:
        """A saved-tensor pack hook of the step's own returned ``packed``: autograd keeps it for backward."""

    @abc.abstractmethod
    def on_resize(self, storage: torch.UntypedStorage, before: int) -> None:
        """``storage.resize_`` ran, from ``before`` bytes."""

    @abc.abstractmethod
    def collective_wait(self) -> AbstractContextManager[None]:
        """A collective's ``Work.wait()`` runs inside."""

    @abc.abstractmethod
    def transform_running(self) -> AbstractContextManager[None]:
        """A torch.func transform runs inside, with saved-tensor hooks disabled."""

    @abc.abstractmethod
    def on_compiled_buffer(self, t: Tensor) -> None:
        """torch.compile's generated code just allocated ``t``."""

    @abc.abstractmethod
    def on_grad(self, param: Tensor) -> None:
        """``param.grad`` is a gradient (its post-accumulate-grad hook ran)."""

    @abc.abstractmethod
    def on_compiled_inputs(self, tensors: Iterable[Any]) -> None:
        """A compiled graph's generated code runs on ``tensors`` (those among them): its kernels read them
        where no op shows it."""


_WATCHING = threading.local()  # .stack: the listeners watching this thread, innermost last
_PATCH_LOCK = threading.Lock()
_original: dict[str, Any] = {}  # torch's own functions while patched, by `_patch_points`' names
_users = 0  # listeners watching, in all threads


def _innermost() -> Listener | None:
    stack = getattr(_WATCHING, "stack", None)
    return stack[-1] if stack else None


def _listeners_on_mode_stack() -> Iterator[Listener]:
    for mode in _torch_private.dispatch_mode_stack():
        if isinstance(mode, Listener):
            yield mode


def _get_rng_state(*args: Any, **kwargs: Any) -> Tensor:
    state = _original["get_rng_state"](*args, **kwargs)
    listener = _innermost()
    if listener is not None:
        listener.on_rng_state(state)
    return state


def _version_wrapper_init(cached: Any, *args: Any, **kwargs: Any) -> None:
    _original["_VersionWrapper.__init__"](cached, *args, **kwargs)
    listener, value = _innermost(), getattr(cached, "val", None)
    if listener is not None and isinstance(value, Tensor):
        listener.pack(value)


def _resize(storage: torch.UntypedStorage, size: int) -> Any:
    before = storage.nbytes()
    out = _original["UntypedStorage.resize_"](storage, size)
    listener = _innermost()
    if listener is not None:
        listener.on_resize(storage, before)
    return out


def _wait(work: Any, *args: Any, **kwargs: Any) -> Any:
    listener = _innermost()
    with contextlib.nullcontext() if listener is None else listener.collective_wait():
        return _original["Work.wait"](work, *args, **kwargs)


def _hooks_enter(hooks: torch.autograd.graph.saved_tensors_hooks) -> None:
    """``saved_tensors_hooks.__enter__`` while a tracker watches: hooks the step pushes (``save_on_cpu``)
    run instead of the tracker's, so what they pack is reported to it. Checkpointing's own hooks keep no
    tensor in their packs; they are left as they are."""
    if type(hooks).__module__ == "torch.utils.checkpoint":
        _original["saved_tensors_hooks.__enter__"](hooks)
        return
    user_pack = hooks.pack_hook

    def pack(t: Tensor) -> Any:
        packed = user_pack(t)
        listener = _innermost()
        if listener is not None:
            listener.kept(packed)
        return packed

    _torch_private.push_saved_tensors_hooks(pack, hooks.unpack_hook)


@contextlib.contextmanager
def _disable_saved_tensors_hooks(error_message: str) -> Iterator[None]:
    """``disable_saved_tensors_hooks`` while a tracker watches: torch.func's transforms (``grad``,
    ``vjp``, ``jacrev``) refuse to run under any saved-tensor hook, so the tracker's own step aside for the
    transform (`Listener.transform_running`)."""
    listener = _innermost()
    stepping_aside = contextlib.nullcontext() if listener is None else listener.transform_running()
    with stepping_aside, _original["disable_saved_tensors_hooks"](error_message):
        yield


def _patch_points() -> list[tuple[str, Any, str, Callable]]:
    """``(name, owner, attribute, replacement)`` of each function patched, where this torch has it."""
    graph, version_wrapper = torch.autograd.graph, _torch_private.checkpoint_version_wrapper()
    points = [
        ("disable_saved_tensors_hooks", graph, "disable_saved_tensors_hooks", _disable_saved_tensors_hooks),
        ("get_rng_state", torch, "get_rng_state", _get_rng_state),
        ("saved_tensors_hooks.__enter__", graph.saved_tensors_hooks, "__enter__", _hooks_enter),
        ("_VersionWrapper.__init__", version_wrapper, "__init__", _version_wrapper_init),
        ("UntypedStorage.resize_", torch.UntypedStorage, "resize_", _resize),
        ("Work.wait", _torch_private.work_class(), "wait", _wait),
    ]  # fmt: skip
    return [point for point in points if point[1] is not None]


#: The allocation fast paths of inductor's generated code: each generated module binds them as globals of
#: these names, from ``torch._C._dynamo.guards`` with a leading underscore (other devices call
#: ``torch.empty_strided``, an op the tracker sees).
_COMPILED_ALLOCATORS = (
    "empty_strided_cpu", "empty_strided_cpu_pinned", "empty_strided_cuda", "empty_strided_xpu",
    "empty_strided_mtia",
)  # fmt: skip


def _compiled_allocator(allocate: Any) -> Any:
    """``allocate`` (an `_COMPILED_ALLOCATORS` fast path) reporting each buffer to the listeners watching.

    Without it a compiled graph's buffers are seen late or never: a buffer only generated kernels write
    and the graph frees is never seen, one an extern kernel writes (``out=``) or the graph returns is first
    seen as an op's input and so counted from the step's start (+27 % on a compiled tiny LLaMA's step).
    The listeners are found on the dispatch mode stack: torch.compile keeps them there while its code runs
    (``ignore_compile_internals``), autograd carries them into its backward threads, and another thread's
    compiled code finds none."""

    def allocate_seen(*args: Any, **kwargs: Any) -> Tensor:
        t = allocate(*args, **kwargs)
        for listener in _listeners_on_mode_stack():
            listener.on_compiled_buffer(t)
        return t

    allocate_seen.__wrapped__ = allocate  # type: ignore[attr-defined]
    return allocate_seen


def _rebind_compiled_allocators(swap: dict[int, Any]) -> None:
    """In every generated module loaded so far, rebind each `_COMPILED_ALLOCATORS` global found in
    ``swap`` (by identity) to its replacement."""
    for module in _torch_private.generated_modules():
        namespace = vars(module)
        for name in _COMPILED_ALLOCATORS:
            replacement = swap.get(id(namespace.get(name)))
            if replacement is not None:
                namespace[name] = replacement


def _patch_compiled_allocators() -> None:
    """Route inductor's buffers to the listeners: in ``guards`` (read by a module compiled while a tracker
    watches, as it loads) and in the generated modules already loaded."""
    guards = _torch_private.compiled_allocator_home()
    swap: dict[int, Any] = {}
    for name in _COMPILED_ALLOCATORS:
        allocate = getattr(guards, f"_{name}", None)
        if allocate is None:
            continue
        seen = _compiled_allocator(allocate)
        _original[f"guards._{name}"] = allocate
        setattr(guards, f"_{name}", seen)
        swap[id(allocate)] = seen
    _original["compiled allocators"] = swap
    _rebind_compiled_allocators(swap)


def _unpatch_compiled_allocators() -> None:
    """Put inductor's own allocators back everywhere, modules compiled while a tracker watched included."""
    swap = _original.pop("compiled allocators")
    _rebind_compiled_allocators({id(seen): seen.__wrapped__ for seen in swap.values()})
    guards = _torch_private.compiled_allocator_home()
    for name in _COMPILED_ALLOCATORS:
        allocate = _original.pop(f"guards._{name}", None)
        if allocate is not None:
            setattr(guards, f"_{name}", allocate)


def _patch() -> None:
    # Autograd calls the tracker's saved-tensor and gradient hooks, and Python its weak-reference
    # callbacks, from eager code; where that code runs inside a torch.compile'd call (after a graph break,
    # or in a frame dynamo skips: ``nn.Sequential.compile()`` compiles no frame of its own), dynamo would
    # otherwise compile those callbacks as new frames: a tiny compiled CNN's measured step compiled 33
    # frames of the tracker with 16 graph breaks, hit the recompile limit and measured +69 %.
    _torch_private.hide_from_dynamo(__package__)
    for name, owner, attribute, replacement in _patch_points():
        _original[name] = getattr(owner, attribute)
        setattr(owner, attribute, replacement)
    _patch_compiled_allocators()


def _unpatch() -> None:
    for name, owner, attribute, _ in _patch_points():
        if name in _original:
            setattr(owner, attribute, _original.pop(name))
    _unpatch_compiled_allocators()


@contextlib.contextmanager
def watched(listener: Listener) -> Iterator[None]:
    """Report what no dispatch mode sees to ``listener`` while it watches this thread: the patches are
    installed for the first listener watching (in any thread) and removed after the last."""
    global _users
    with _PATCH_LOCK:
        if _users == 0:
            _patch()
        _users += 1
    stack = _WATCHING.__dict__.setdefault("stack", [])
    stack.append(listener)
    try:
        yield
    finally:
        stack.remove(listener)  # listeners may close out of order
        with _PATCH_LOCK:
            _users -= 1
            if _users == 0:
                _unpatch()


def compiled_inputs(tensors: Iterable[Any]) -> bool:
    """Tell the tracker running the step's ops (the innermost dispatch mode, where it is one) that a compiled
    graph's generated code runs on ``tensors``: the simulator's stubbed kernels read them where no op shows
    it. Returns whether a tracker was told."""
    stack = _torch_private.dispatch_mode_stack()
    if stack and isinstance(stack[-1], Listener):
        stack[-1].on_compiled_inputs(tensors)
        return True
    return False


def gradient_consumed(param: Tensor) -> None:
    """Tell the trackers watching this step that ``param.grad`` is a gradient, before a post-accumulate-grad
    hook registered ahead of theirs frees it (the fused optimizer step): theirs would find ``None``.

    The trackers are found on the dispatch mode stack, which autograd carries into its backward threads."""
    for listener in _listeners_on_mode_stack():
        listener.on_grad(param)
