"""Checkpointing a compiled model: planned only where it changes nothing (`plan_compiled`).

Inside a compiled model, what is kept from the forward to the backward is decided by AOTAutograd's min-cut
partitioner, not by eager autograd: it already recomputes cheap pointwise ops instead of saving them, and
``torch._functorch.config.activation_memory_budget`` (1.0 by default) lets it trade more, across the whole
graph. Measured earlier on Hugging Face BERT and GPT-2 (issue 26), that budget kept 0.717 / 0.732 of the
activations at +11 % / +0.1 % time where eager block checkpointing kept 0.744 / 0.769 at +16 % / +1.6 %:
the lever a compiled model should be planned with.

The simulation of a compiled step (`_estimating.compiled`) follows it exactly at the configured budget
(within 0.15 % of the CPU allocator on seven of the zoo's families), but not below it. There the partitioner
moves recomputation into the backward, and inductor's scheduler allocates the recomputed buffers earlier
than any order of the backward graph does (it fuses kernels that read the same tensors: every layer's
attention mask is materialized together). The zoo's LLaMA, against the allocator: batch 8, 32 tokens,
budgets 0.5 / 0.3 / 0.1: -2.8 / -5.0 / -4.2 %; batch 1, 256 tokens, budgets 0.984 / 0.5: -8.9 / -21.8 %
(and still -3.4 / -17.0 % with every op of the backward counted unfused). A plan resting on those bytes
could exceed its budget, so none is made: `plan_compiled` keeps the configured budget where the compiled
step fits, and otherwise refuses the budget, saying by how much the step is over and what fits instead.
Eager checkpoint wrappers inside a compiled module are traced by dynamo into the same partitioner, which
the simulation cannot follow either.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_memkit._breakdown import format_bytes
from lightning_memkit._checkpointing.policies import CheckpointPlan, applied_modes, apply_plan
from lightning_memkit._estimating.simulate import estimate_step
from lightning_memkit._step import Step

__all__ = ["plan_compiled"]


def plan_compiled(model: nn.Module, batch: Any, limit: int, step: Step, **run: Any) -> CheckpointPlan:
    """A compiled model's checkpointing plan for ``limit`` bytes: no block checkpointed, torch.compile's
    activation budget as configured, where its simulated step fits; a `ValueError` saying why not
    otherwise. ``run``: `estimate_memory`'s ``optimizer``, ``loss_fn`` and ``device``."""
    bare = {name: "none" for name in applied_modes(model)}  # the eager checkpointing left on it goes
    with apply_plan(model, bare, announce=False):
        breakdown = estimate_step(model, batch, step, **run)
    if breakdown.peak > limit:
        b = breakdown
        raise ValueError(
            f"The budget of {format_bytes(limit)} ({limit:,} bytes) is below the compiled model's step: "
            f"{format_bytes(b.peak)} ({b.peak:,} bytes; parameters {format_bytes(b.parameters)}, gradients "
            f"{format_bytes(b.gradients)}, optimizer state {format_bytes(b.optimizer_state)}, activations "
            f"{format_bytes(b.activations)}, temporary {format_bytes(b.temporary)}). In a compiled model "
            "what the backward keeps is torch.compile's partitioner's choice: a lower "
            "torch._functorch.config.activation_memory_budget keeps less, but its step cannot be simulated "
            "to the byte (inductor's backward schedule reads up to 22 % higher), so no plan is made on it. "
            "To fit: AutoFit (a smaller micro-batch with accumulation, a lighter optimizer), a lower "
            "precision; or set activation_memory_budget yourself and measure the step with MemoryMonitor; or "
            "plan checkpointing for the model before compiling it."
        )
    return CheckpointPlan(
        blocks=(), budget=limit, peak=breakdown.peak, peak_none=breakdown.peak, breakdown=breakdown
    )
