"""The names the library's arguments accept, in a module that imports no torch.

`lightning_memkit._checkpointing.policies`, `lightning_memkit._estimating.precision`,
`lightning_memkit._estimating.fake_step` and `lightning_memkit._estimating.analytic` take
their names from here, and so does the ``memkit`` command's parser (`lightning_memkit.cli._parsers`),
which answers ``--help`` and usage errors before torch is imported.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, get_args

from lightning_memkit._budget import names, valid_name

__all__ = [
    "AUTO",
    "CHECKPOINT_MODES",
    "COSTS",
    "DEVICES",
    "PRECISIONS",
    "CheckpointMode",
    "allowed_modes",
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


#: The Lightning precisions a step is simulated in (`lightning_memkit._estimating.precision.PRECISION_DTYPES`'
#: keys).
PRECISIONS: tuple[str, ...] = ("64-true", "32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true")
#: The devices a step is planned for.
DEVICES: tuple[str, ...] = ("cuda", "cpu")
#: What a planner ranks plans by: step times measured on the device, FLOPs, or whichever the device allows.
COSTS: tuple[str, ...] = ("auto", "measured", "flops")
