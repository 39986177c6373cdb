"""The storage tracker's saved-tensor hooks: how it learns what autograd keeps for backward.

The tracker's pack hook goes over the saved-tensor hooks in force (only the innermost pair runs): theirs
still pack and unpack, and what they return is what counts as kept. Without hooks of the step's own, the
tracker's unpack checks the version counter as autograd does for a tensor saved without hooks (hooks turn
its check off): an in-place change of a saved tensor must raise, not train on wrong gradients.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from lightning_memkit._measuring import _torch_private


class SavedTensorHooks:
    """The pack and unpack hooks reporting to a tracker: ``saved`` is told of each tensor saved for backward
    (and returns it), ``kept`` of what hooks in force beneath returned for one."""

    def __init__(self, saved: Callable[[Tensor], Tensor], kept: Callable[[Any], None]) -> None:
        self._saved, self._kept = saved, kept
        #: the (pack, unpack) pair `installed` last made
        self.hooks: tuple[Callable, Callable] | None = None

    def installed(self) -> torch.autograd.graph.saved_tensors_hooks:
        """The hooks, over those in force now, as a context that installs them."""
        outer = _torch_private.top_saved_tensors_hooks()
        if outer is None:

            def pack(t: Tensor) -> tuple[Tensor, int]:
                return self._saved(t), t._version

            self.hooks = (pack, _unpack_checked)
        else:
            outer_pack, outer_unpack = outer

            def pack(t: Tensor) -> Any:
                packed = outer_pack(t)
                self._kept(packed)
                return packed

            self.hooks = (pack, outer_unpack)
        return torch.autograd.graph.saved_tensors_hooks(*self.hooks)

    def on_top(self) -> bool:
        """Whether these hooks are the innermost in force (the pair autograd runs)."""
        top = _torch_private.top_saved_tensors_hooks()
        return self.hooks is not None and top is not None and top[0] is self.hooks[0]

    @contextlib.contextmanager
    def stepped_aside(self) -> Iterator[bool]:
        """These hooks off the top while inside, where they are on it (a torch.func transform runs no hook);
        yields whether they were."""
        on_top = self.on_top()
        if on_top:
            _torch_private.pop_saved_tensors_hooks()
        try:
            yield on_top
        finally:
            if on_top:
                _torch_private.push_saved_tensors_hooks(*self.hooks)  # type: ignore[misc]


def _unpack_checked(packed: tuple[Tensor, int]) -> Tensor:
    t, version = packed
    if t._version != version:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an inplace "
            f"operation: [{t.type()} {list(t.shape)}] is at version {t._version}; expected version {version} "
            "instead. (Raised by lightning_memkit's measurement, whose saved-tensor hooks replace autograd's "
            "own check: without it autograd raises the same error.)"
        )
    return t
