"""Routing: the sizes a step's value-shaped ops give, taken from a real forward of the batch.

A mixture of experts that gathers each expert's tokens one expert at a time (Hugging Face's
``experts_implementation="eager"``: ``nonzero`` of the router's choice, per expert) sizes its buffers by
the router's values, which come from the weights. A simulation on fake tensors has no such values (the
shadows of `_estimating.shadow` follow values of the batch alone), so fake tensor mode cannot size the
op's output. The weights are real, though, wherever the model was built on a device rather than on
``meta``: `recording` runs the forward once for real, without autograd, and notes the output shapes of
every op whose outputs are sized by values (`_measuring.ops._value_shaped`), per call site: the
module running (named from forward hooks, not read off the Python frames, whose locals a read would keep
alive), the op, and its inputs' shapes. `Routes.replay` then gives the simulated
step's same call the same shape, in the same order. A block checkpointing recomputes calls its sites
again in the backward: each site's shapes are replayed from the start there.

What this follows is the routing of the batch given, under the weights as they are: another batch, or
the same batch after the router has trained, routes otherwise and allocates otherwise. The planners say
so in their plans (`routed`). Where the simulated step's calls do not line up with the recorded ones (a
branch on a value the simulation only has a placeholder for), `Routes.check` refuses the estimate.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_memkit._measuring.ops import _value_shaped
from lightning_memkit._measuring.storages import _iter_tensors

__all__ = ["ROUTING_ASSUMED", "Routes", "UnknownShape", "recording", "recording_now", "rewound", "routed"]

#: One output tensor's (shape, stride, dtype).
_Layout = tuple[tuple[int, ...], tuple[int, ...], torch.dtype]

#: What a plan made on a model whose simulated step followed a recorded routing assumed (`routed`).
ROUTING_ASSUMED = (
    "routing: the planned batch's, under the weights as they were (its experts' tokens sized from a real "
    "forward; another routing allocates otherwise)"
)

# Models whose simulated step followed a recorded routing.
_ROUTED: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()


class UnknownShape(NotImplementedError):
    """An op of the simulated step is sized by values the simulation does not have."""


def routed(model: nn.Module) -> bool:
    """Whether ``model``'s simulated step has followed a recorded routing (`Routes`)."""
    return _ROUTED.get(model, False)


def _layouts(out: Any) -> tuple[bool, list[_Layout]]:
    """Whether ``out`` is one tensor, and the layout of each of its tensors."""
    one = isinstance(out, Tensor)
    return one, [(tuple(t.shape), tuple(t.stride()), t.dtype) for t in ([out] if one else out)]


class Routes:
    """The output layouts of a real forward's value-shaped ops, per call site, to replay in order: in the
    forward once each, and again in a checkpointed block's recompute."""

    def __init__(self, model: nn.Module) -> None:
        self._recorded: dict[tuple, list[tuple[bool, list[_Layout]]]] = defaultdict(list)
        self._calls: dict[tuple[tuple, bool], int] = defaultdict(int)  # (site, in the backward): calls
        self._names = {id(m): name for name, m in model.named_modules()}
        self._running: list[str] = []  # the names of the modules whose forward runs, outermost first
        self._entered: dict[str, int] = defaultdict(int)  # per module: how often the real forward ran it
        self._recording = True

    def bind(self, model: nn.Module) -> None:
        """Name the call sites by ``model``'s modules (the stepped one: a sharded copy has its own), and
        start every site's replay afresh, with ``model`` marked as `routed`."""
        self._names = {id(m): name for name, m in model.named_modules()}
        self._calls.clear()
        self._recording = False
        _ROUTED[model] = True

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """Follow which modules run in this thread (every module's, through global forward hooks) in the
        block; other threads' modules are not this step's."""
        thread = threading.get_ident()

        def enter(module: nn.Module, args: Any) -> None:
            if threading.get_ident() == thread:
                self._running.append(self._names.get(id(module), ""))
                if self._recording:
                    self._entered[self._running[-1]] += 1

        def leave(module: nn.Module, args: Any, out: Any) -> None:
            if threading.get_ident() == thread:
                self._running.pop()

        handles = [
            register_module_forward_pre_hook(enter),
            register_module_forward_hook(leave, always_call=True),
        ]
        _watching.stack = [*getattr(_watching, "stack", []), self]
        try:
            yield
        finally:
            _watching.stack.pop()
            for handle in handles:
                handle.remove()
            self._running.clear()

    def _site(self, func: Any, args: tuple) -> tuple:
        """The innermost module running, the op, and its inputs' shapes."""
        shapes = tuple(tuple(t.shape) for t in _iter_tensors(args))
        return self._running[-1] if self._running else "", str(func), shapes

    def add(self, func: Any, args: tuple, out: Any) -> None:
        self._recorded[self._site(func, args)].append(_layouts(out))

    def replay(self, func: Any, args: tuple, make: Callable[[_Layout], Tensor], *, backward: bool) -> Any:
        """The output of the simulated ``func(*args)`` (``backward``: in a checkpointed block's recompute),
        each tensor made by ``make`` with the layout the real forward's same call gave; `UnknownShape` where
        the real forward made no such call."""
        site = self._site(func, args)
        recorded = self._recorded.get(site, [])
        call = self._calls[site, backward]
        if backward and self._entered[site[0]] > 1:
            raise UnknownShape(
                f"The simulated step recomputes {func} in {_where(site)}, a module the real forward of the "
                f"batch ran {self._entered[site[0]]} times: which of its calls a checkpointed recompute "
                "repeats is not known, and its routing cannot be followed there."
            )
        if call >= len(recorded):
            raise UnknownShape(
                f"The simulated step called {func} in {_where(site)} on inputs of shapes {list(site[2])} "
                f"{call + 1} time(s){' in a recompute' if backward else ''}, where the real forward of the "
                f"batch called it {len(recorded)} time(s): it took another branch on a value it does not "
                "have, and its routing cannot be followed."
            )
        self._calls[site, backward] += 1
        one, layouts = recorded[call]
        made = [make(layout) for layout in layouts]
        return made[0] if one else tuple(made)

    @contextlib.contextmanager
    def kept(self) -> Iterator[None]:
        """Every call site's replay put back, after the block, where it stands before it."""
        saved = dict(self._calls)
        try:
            yield
        finally:
            self._calls.clear()
            self._calls.update(saved)

    def check(self) -> None:
        """Refuse a step whose forward did not make every call the real forward made (a branch on a value
        the simulation only has a placeholder for skipped one)."""
        for site, recorded in self._recorded.items():
            calls = self._calls.get((site, False), 0)
            if calls != len(recorded):
                raise UnknownShape(
                    f"The simulated step called {site[1]} in {_where(site)} {calls} time(s), where the real "
                    f"forward of the batch called it {len(recorded)} time(s): it took another branch on a "
                    "value it does not have, and its routing cannot be followed."
                )


_watching = threading.local()  # per thread: the `Routes` whose modules are being watched, innermost last


def recording_now() -> bool:
    """Whether a real forward is being recorded in this thread (`recording`): what runs is not the step."""
    stack = getattr(_watching, "stack", [])
    return bool(stack) and stack[-1]._recording


@contextlib.contextmanager
def rewound() -> Iterator[None]:
    """A block run once more on the inputs its own call will get (the checkpointing planner profiles each
    mode so, before the call): inside, every call site's replay goes on from where it stands, and is put
    back there afterwards, so the runs and the call itself replay the same routing."""
    stack = getattr(_watching, "stack", [])
    with stack[-1].kept() if stack else contextlib.nullcontext():
        yield


def _where(site: tuple) -> str:
    return site[0] or "no module"


class _Recording(TorchDispatchMode):
    def __init__(self, routes: Routes) -> None:
        super().__init__()
        self.routes = routes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        out = func(*args, **(kwargs or {}))
        if _value_shaped(func, args):
            self.routes.add(func, args, out)
        return out


@contextlib.contextmanager
def recording(model: nn.Module) -> Iterator[Routes]:
    """Record, into the `Routes` yielded, the value-shaped ops of what runs in the block (``model``'s
    real forward, under ``torch.no_grad()``)."""
    routes = Routes(model)
    with torch.no_grad(), routes.watching(), _Recording(routes):
        yield routes
