"""The names the library's arguments accept, in a module that imports no torch.

`lightning_memkit._checkpointing.policies`, `lightning_memkit._estimating.simulate` and
`lightning_memkit._estimating.analytic` take
their names from here, and so does the ``memkit`` command's parser (`lightning_memkit.cli._parsers`),
which answers ``--help`` and usage errors before torch is imported.
"""

from __future__ import annotations

import warnings
from typing import Any, Literal, get_args

__all__ = ["CHECKPOINT_MODES", "COSTS", "DEVICES", "PRECISIONS", "CheckpointMode", "renamed", "renamed_cost"]

#: A checkpointing mode by name: what one block (or, given as one string, every block) gets.
CheckpointMode = Literal["none", "selective", "selective_half", "full"]
#: The modes, from the least to the most memory saved.
CHECKPOINT_MODES: tuple[str, ...] = get_args(CheckpointMode)
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


def renamed_cost(owner: str, cost: Any) -> Any:
    """``cost`` with the old ``"time"`` read as ``"measured"`` (and a warning); anything else as given."""
    return renamed(owner, "cost", "cost", cost) if cost == "time" else cost
