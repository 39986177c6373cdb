"""The names the library's arguments accept, in a module that imports no torch.

`lightning_memkit._checkpointing.policies`, `lightning_memkit._estimating.simulate` and
`lightning_memkit._estimating.analytic` take
their names from here, and so does the ``memkit`` command's parser (`lightning_memkit.cli._parsers`),
which answers ``--help`` and usage errors before torch is imported.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any, Literal, get_args

from lightning_memkit._budget import names, valid_name

__all__ = [
    "AUTO",
    "CHECKPOINT_MODES",
    "COSTS",
    "DEVICES",
    "PRECISIONS",
    "CheckpointMode",
    "allowed_modes",
    "renamed",
    "renamed_attribute",
    "renamed_cost",
    "unbudgeted_mode",
]

#: A checkpointing mode by name: what one block (or, given as one string, every block) gets.
CheckpointMode = Literal["none", "selective", "selective_half", "full"]
#: The modes, from the least to the most memory saved.
CHECKPOINT_MODES: tuple[str, ...] = get_args(CheckpointMode)
#: ``checkpointing="auto"``: a planner may give each block any mode.
AUTO = "auto"


def allowed_modes(checkpointing: str | Sequence[str]) -> tuple[str, ...]:
    """The modes a planner may give a block, in `CHECKPOINT_MODES` order, from a ``checkpointing=`` argument:
    ``"auto"`` (every mode), one mode (that one or none: ``"full"`` is ``("none", "full")``), or the modes
    themselves (``("none", "selective")``), as every planner, callback and the ``memkit`` command take it."""
    if checkpointing == AUTO:
        return CHECKPOINT_MODES
    if isinstance(checkpointing, str):
        mode = valid_name("checkpointing", checkpointing, (AUTO, *CHECKPOINT_MODES))
        return tuple(m for m in CHECKPOINT_MODES if m in ("none", mode))
    given = names("checkpointing", checkpointing, CHECKPOINT_MODES)
    return tuple(mode for mode in CHECKPOINT_MODES if mode in given)


def unbudgeted_mode(checkpointing: str | Sequence[str]) -> str:
    """The mode every block gets when there is no budget to plan for: ``"selective"`` for ``"auto"`` (about
    a third of the activations for a few percent of compute), else the strongest mode allowed."""
    return "selective" if checkpointing == AUTO else allowed_modes(checkpointing)[-1]


#: The Lightning precisions a step is simulated in (`lightning_memkit._estimating.simulate.PRECISION_DTYPES`'
#: keys).
PRECISIONS: tuple[str, ...] = ("64-true", "32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true")
#: The devices a step is planned for.
DEVICES: tuple[str, ...] = ("cuda", "cpu")
#: What a planner ranks plans by: step times measured on the device, FLOPs, or whichever the device allows.
COSTS: tuple[str, ...] = ("auto", "measured", "flops")

#: Old names kept for one release: (the old spelling, the new one).
_RENAMED_VALUES = {("cost", "time"): "measured"}


def renamed(owner: str, old: str, new: str, value: Any, also: str = "") -> Any:
    """``value``, given as ``owner``'s ``old`` argument, which is ``new`` now: a deprecation warning (once
    per call site, as Python shows them), and the value to use under the new name. An old value of an
    argument (``cost="time"``) is renamed the same way with ``old == new == "cost"``."""
    if old == new:
        value_now = _RENAMED_VALUES[(old, value)]
        said = f"{owner}({old}={value!r}) is deprecated: it is {new}={value_now!r} now"
    else:
        value_now, said = value, f"{owner}({old}=...) is deprecated: the argument is {new}= now{also}"
    warnings.warn(f"{said}; the old spelling goes in lightning-memkit 0.3.", FutureWarning, stacklevel=3)
    return value_now


def renamed_attribute(owner: str, old: str, new: str) -> None:
    """Warn that ``owner.old`` is read: it is ``owner.new`` now (kept for one release)."""
    warnings.warn(
        f"{owner}.{old} is deprecated: it is {owner}.{new} now; the old name goes in lightning-memkit 0.3.",
        FutureWarning,
        stacklevel=3,
    )


def renamed_cost(owner: str, cost: Any) -> Any:
    """``cost`` with the old ``"time"`` read as ``"measured"`` (and a warning); anything else as given."""
    return renamed(owner, "cost", "cost", cost) if cost == "time" else cost
