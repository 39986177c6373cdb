"""What an FSDP2 (``fully_shard``) model holds, read from torch's FSDP2 state: the one module that reads it.

FSDP2 keeps each parameter twice: the sharded DTensor the module and optimizer hold between steps, and an
unsharded copy whose storage it grows (``UntypedStorage.resize_``) to all-gather into and shrinks to zero
to free. Which tensor is which is not public API (``FSDPParam`` and its fields are private to
``torch.distributed.fsdp._fully_shard``); read here only, with a fallback: on a torch whose FSDP2 state
looks otherwise, no unit is found, the totals stay exact and the sharded split is not given.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch import Tensor, nn

__all__ = ["explain_mixed_tensors", "fsdp_params", "is_sharded", "sharded_param", "unsharded_param"]


def _state(module: nn.Module) -> Any:
    get = getattr(module, "_get_fsdp_state", None)  # FSDPModule's, on every module fully_shard was given
    if get is None:
        return None
    try:
        return get()
    except Exception:  # a state torch changed: no unit found, see above
        return None


def fsdp_params(model: nn.Module) -> Iterator[Any]:
    """Every ``FSDPParam`` of the FSDP2 units in ``model`` (nothing for a model without ``fully_shard``)."""
    for module in model.modules():
        state = _state(module)
        group = getattr(state, "_fsdp_param_group", None)
        yield from getattr(group, "fsdp_params", ())


def is_sharded(model: nn.Module) -> bool:
    """Whether ``fully_shard`` was applied to ``model`` or a module in it."""
    return any(_state(module) is not None for module in model.modules())


def sharded_param(fsdp_param: Any) -> Tensor | None:
    """The sharded parameter (a DTensor) the module holds between steps."""
    return getattr(fsdp_param, "sharded_param", None)


def unsharded_param(fsdp_param: Any) -> Tensor | None:
    """The unsharded copy, once FSDP2 has made it (at the first forward); its storage is empty while the
    parameter is sharded."""
    return getattr(fsdp_param, "_unsharded_param", None)


def _roots(model: nn.Module) -> list[str]:
    """The names of the outermost modules ``fully_shard`` was given (``""`` for ``model`` itself)."""
    roots: list[str] = []
    for name, module in model.named_modules():  # parents before their children
        inside = any(root == "" or name.startswith(f"{root}.") for root in roots)
        if _state(module) is not None and not inside:
            roots.append(name)
    return roots


def explain_mixed_tensors(error: BaseException, model: nn.Module) -> str | None:
    """What to shard, when a step of an FSDP2 model failed with DTensor's "mixed torch.Tensor and DTensor":
    FSDP2 gathers a unit's parameters in that unit's forward, so a step that calls a submodule of the root
    directly (``self.model(...)`` in ``training_step`` with ``fully_shard(self)``) meets the root's own
    parameters still sharded. ``None`` for any other error."""
    if "mixed torch.Tensor and DTensor" not in str(error) or not is_sharded(model):
        return None
    roots = ", ".join(f"`self.{name}`" if name else "`self`" for name in _roots(model))
    return (
        f"The step used parameters FSDP2 had not gathered ({type(error).__name__}: mixed torch.Tensor and "
        f"DTensor). fully_shard's outermost unit ({roots}) gathers its own parameters (embeddings, final "
        "norm, head) only when its forward runs, and the step called a module inside it without that "
        "forward. Apply the last fully_shard to the module the step calls (e.g. fully_shard(self.model) "
        "instead of fully_shard(self) when training_step calls self.model(...)), or call self(...)."
    )
