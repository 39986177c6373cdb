"""Mixture-of-experts on the simulated step (issue 26 item 1, in part). Hugging Face's MoE layers run their
experts in one grouped matmul (``aten._grouped_mm``), whose meta kernel takes bf16 only: every
estimator-backed feature crashed on an fp32 MoE ("Expected inputs of BF16 type"). The simulation takes the
output's shape from the bf16 call and keeps the operands' dtype. The zoo's Mixtral (tests/zoo.py) is held
to the allocator by the zoo's tests; this is the other family, with a shared expert beside the routed ones.
"""

from __future__ import annotations

import pytest
import torch
from helpers import steady_step_and_estimate


def _qwen2_moe() -> torch.nn.Module:
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    cfg = Qwen2MoeConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
        shared_expert_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    return Qwen2MoeForCausalLM(cfg)


def _loss(out, labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), labels.flatten())


@pytest.mark.parametrize("batch_size", [pytest.param(2, marks=pytest.mark.slow), 8])
def test_an_fp32_moe_step_is_estimated_as_the_allocator_counts_it(batch_size):
    torch.manual_seed(0)
    model = _qwen2_moe()
    optimizer = torch.optim.AdamW(model.parameters())
    ids = torch.randint(0, 128, (batch_size, 16), generator=torch.Generator().manual_seed(1))
    truth, estimate = steady_step_and_estimate(model, (ids, ids), optimizer, _loss)
    assert estimate == pytest.approx(truth, rel=1e-3)
    assert next(model.parameters()).dtype == torch.float32  # the simulation cast nothing of the model's
