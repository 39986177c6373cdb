"""The names the library's arguments accept, in a module that imports no torch.

`lightning_memkit._checkpointing.policies`, `lightning_memkit._estimating.simulate` and
`lightning_memkit._estimating.analytic` take
their names from here, and so does the ``memkit`` command's parser (`lightning_memkit.cli._parsers`),
which answers ``--help`` and usage errors before torch is imported.
"""

from __future__ import annotations

from typing import Literal, get_args

__all__ = ["CHECKPOINT_MODES", "DEVICES", "PRECISIONS", "CheckpointMode"]

#: A checkpointing mode by name: what one block (or, given as one string, every block) gets.
CheckpointMode = Literal["none", "selective", "selective_half", "full"]
#: The modes, from the least to the most memory saved.
CHECKPOINT_MODES: tuple[str, ...] = get_args(CheckpointMode)
#: The Lightning precisions a step is simulated in (`lightning_memkit._estimating.simulate.PRECISION_DTYPES`'
#: keys).
PRECISIONS: tuple[str, ...] = ("64-true", "32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true")
#: The devices a step is planned for.
DEVICES: tuple[str, ...] = ("cuda", "cpu")
