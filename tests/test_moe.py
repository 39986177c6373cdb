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

from lightning_memkit import estimate_memory
from lightning_memkit.testing import allocator_peak


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


def _eager_moe() -> tuple[torch.nn.Module, torch.Tensor]:
    """Qwen2-MoE with Hugging Face's eager experts: each expert's tokens gathered with ``nonzero`` of the
    router's choice, a buffer whose size depends on the routing."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2MoeConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
        shared_expert_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, experts_implementation="eager",
    )  # fmt: skip
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1))
    return Qwen2MoeForCausalLM(cfg), ids


def test_experts_chosen_token_by_token_are_refused_with_the_module_and_what_to_do():
    """The eager experts' ``nonzero`` has a size computed from the weights, which fake tensors do not have:
    the estimate and the planners built on it say so, naming the op and the module, where they once raised
    torch's DynamicOutputShapeException (and AutoFit's search tried every micro-batch first)."""
    from lightning_memkit import plan_fit

    model, ids = _eager_moe()
    expected = (
        r"cannot follow aten\.nonzero\.default in Qwen2MoeExperts\.forward.*"
        r"experts_implementation='grouped_mm'.*measure, MemoryMonitor"
    )
    with pytest.raises(NotImplementedError, match=expected):
        estimate_memory(model, (ids, ids), optimizer="adamw", loss_fn=_loss, device="cpu")
    with pytest.raises(NotImplementedError, match=expected):
        plan_fit(model, (ids, ids), "1GiB", loss_fn=_loss, device="cpu", cost="flops")


@pytest.mark.xfail(
    strict=True,
    reason="measuring changes the step: under any Python dispatch mode the autograd engine adds the "
    "gradients that several experts' selects send to one parameter out of place (+345,912 B here)",
)
def test_eager_experts_measured_as_the_unmeasured_step_allocates():
    """`measure` follows any routing (it counts the measured step to the byte of a counting allocator),
    but the measured step holds one more parameter-sized buffer than the same step unmeasured: issue 26
    item 4's GRU finding, found here. Recorded until the tracker accounts for it."""
    from lightning_memkit import measure

    model, ids = _eager_moe()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)  # the same weights, the same routing

    def step() -> None:
        _loss(model(ids), ids).backward()
        optimizer.step()
        optimizer.zero_grad()

    step()  # the optimizer's state
    truth = allocator_peak(step)
    with measure(model, optimizer) as measured:
        step()
    assert measured.breakdown.peak == pytest.approx(truth, rel=1e-3)
