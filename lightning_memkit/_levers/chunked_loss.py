"""A cross-entropy that never holds the whole batch's logits: the chunked-loss lever.

A language model's logits are ``tokens x vocabulary`` wide, and a step keeps several tensors that size at
once (the logits, their float32 copy, the log-softmax that autograd saves, and their gradients): often
the largest temporaries of the step. Computing the head and the loss slice by slice, with each slice's
logits recomputed in backward (activation checkpointing over ``head + cross_entropy``), keeps one slice's
worth alive instead, for one more head matmul per token.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint


def chunked_cross_entropy(
    hidden: Tensor,
    head: Callable[[Tensor], Tensor],
    targets: Tensor,
    *,
    chunks: int = 8,
    ignore_index: int = -100,
) -> Tensor:
    """Mean cross-entropy of ``head(hidden)`` against ``targets``, one slice of the tokens at a time.

    Equals ``F.cross_entropy(head(hidden).flatten(0, -2).float(), targets.flatten(), ignore_index=...)``
    up to the order of the sum, while only one slice's logits (and their float32 copy) exist at a time:
    each slice's are recomputed in backward. ``head`` must be deterministic (no dropout): it runs twice.

    Args:
        hidden: ``(..., d)``, the last hidden states (after the final norm).
        head: the output projection, e.g. ``model.lm_head``.
        targets: ``(...)`` token ids, one per row of ``hidden``.
        chunks: how many slices of the tokens; the logits' memory is divided by about this much.
        ignore_index: a target not counted, as in ``F.cross_entropy``.
    """
    if chunks < 1:
        raise ValueError(f"chunks must be >= 1, got {chunks}")
    rows = hidden.reshape(-1, hidden.size(-1))
    labels = targets.reshape(-1)
    if rows.size(0) != labels.size(0):
        raise ValueError(f"{rows.size(0)} rows of hidden states for {labels.size(0)} targets")
    total = sum(
        checkpoint(_summed_loss, h, t, head, ignore_index, use_reentrant=False, preserve_rng_state=False)
        for h, t in zip(rows.chunk(chunks), labels.chunk(chunks), strict=True)
    )
    assert isinstance(total, Tensor)
    return total / (labels != ignore_index).sum()


def _summed_loss(
    hidden: Tensor, targets: Tensor, head: Callable[[Tensor], Tensor], ignore_index: int
) -> Tensor:
    logits = head(hidden)
    return F.cross_entropy(logits.float(), targets, ignore_index=ignore_index, reduction="sum")
