"""The four checkpointing modes as checkpointer classes, and the op rules of the selective ones.

Each `CheckpointMode` names one small class whose ``context`` is the ``context_fn`` torch's non-reentrant
``checkpoint`` runs under: ``"full"`` keeps only the block's inputs (torch's no-op context); the selective
modes keep the outputs of the ops in `MATMUL_OPS` and `ATTENTION_OPS` and recompute the rest
(``create_selective_checkpoint_contexts``). `_checkpointing.policies` applies them to a model; the cost
model (`_checkpointing.costs`) runs them block by block to measure what each saves.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts, noop_context_fn

from lightning_memkit._vocabulary import CHECKPOINT_MODES

_aten = torch.ops.aten


def _ops(*names: str) -> frozenset:
    """The default overloads of the named aten ops that this build of torch has."""
    found = []
    for name in names:
        packet = getattr(_aten, name, None)
        if packet is not None and hasattr(packet, "default"):
            found.append(packet.default)
    return frozenset(found)


#: Matmul-class ops whose outputs selective checkpointing keeps (``linear`` decomposes into ``addmm``).
#: ``bmm`` is left out on purpose: in eager attention it computes the (T, T) scores, which selective
#: checkpointing exists to drop (the "attention core" of Korthikanti et al.).
MATMUL_OPS = _ops("mm", "addmm", "_scaled_mm", "convolution", "_convolution")
#: Fused attention kernels: their outputs (and log-sum-exp) are small and expensive to recompute.
ATTENTION_OPS = _ops(
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
)


#: What torch raises when selective checkpointing's cached output was changed in place afterwards.
_MUTATED = "cached during selective activation checkpoint has been mutated"
#: The reason a block that does so is given another mode.
MUTATED_NOTE = (
    "{mode} refused: an in-place op in the block (an activation with inplace=True, a +=) changes an "
    "output that mode keeps, and torch's selective checkpointing cannot recompute from it; {instead} instead"
)


def mutates_cached_output(error: BaseException) -> bool:
    """Whether ``error`` is torch's refusal of a selective plan whose kept output the block mutated."""
    return isinstance(error, RuntimeError) and _MUTATED in str(error)


class NoCheckpoint:
    """The block as written."""

    name = "none"
    checkpoints = False

    def context(self) -> Any:
        raise AssertionError("NoCheckpoint runs no checkpoint")


class FullCheckpoint:
    """Keep only the block's inputs; recompute its whole forward in backward."""

    name = "full"
    checkpoints = True

    def context(self) -> Any:
        return noop_context_fn()


class SelectiveCheckpoint:
    """Keep the outputs of matmuls and fused attention; recompute the rest (pointwise, norms, softmax).

    ``save_every=2`` keeps only every second matmul output (the first, third, ...), as torchtitan's
    op-level policy does: the block's output projections are usually the ones recomputed, and the last
    one of a block is never needed in backward at all (non-reentrant checkpointing stops recomputing
    once it has what backward needs).
    """

    checkpoints = True

    def __init__(self, save_every: int = 1) -> None:
        self.save_every = save_every
        self.name = "selective" if save_every == 1 else "selective_half"

    def context(self) -> Any:
        # A fresh count for every checkpointed call, one for its forward and one for its recompute: torch
        # before 2.12 asks the policy again as it recomputes and takes the saved outputs of an op in order,
        # so the recompute must keep the same matmuls as the forward did (one count running on would keep
        # the k-projection's where the forward kept the q-projection's: a wrong shape, or wrong gradients
        # where the two shapes are alike). Later torch remembers each op's answer and asks only forward.
        matmuls = {False: itertools.count(), True: itertools.count()}

        def policy_fn(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            if op in ATTENTION_OPS:
                return CheckpointPolicy.MUST_SAVE
            if op in MATMUL_OPS and next(matmuls[ctx.is_recompute]) % self.save_every == 0:
                return CheckpointPolicy.MUST_SAVE
            return CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(policy_fn)


#: How each mode runs, by name.
CHECKPOINTERS: dict[str, Any] = {
    "none": NoCheckpoint(),
    "selective": SelectiveCheckpoint(save_every=1),
    "selective_half": SelectiveCheckpoint(save_every=2),
    "full": FullCheckpoint(),
}
assert tuple(CHECKPOINTERS) == CHECKPOINT_MODES


def checkpointer(mode: str) -> Any:
    """The checkpointer of ``mode``, a `CheckpointMode` name."""
    if mode not in CHECKPOINTERS:
        raise ValueError(
            f"Unknown checkpointing mode {mode!r}; choose one of {', '.join(map(repr, CHECKPOINTERS))}"
        )
    return CHECKPOINTERS[mode]
