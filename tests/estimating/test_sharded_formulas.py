"""The analytic answers for Lightning's ``DeepSpeedStrategy`` and ``FSDPStrategy``, which refuse a CPU, held
to what can be run here: DeepSpeed's own estimator functions on the same parameter counts, and FSDP2's
simulated step where FSDP1's full shard lays the model out alike. Where the two count different copies the
difference is asserted to the byte, copy by copy (docs/sharded.md, "DeepSpeed and FSDP1")."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_memkit import estimate_memory
from lightning_memkit._estimating.analytic import (
    DEEPSPEED_16BIT,
    SHARD_GRAD_OP,
    TransformerShape,
    count_parameters,
    estimate_analytic,
    model_static,
    parameter_shapes,
    shard,
    static_breakdown,
)

pytest.importorskip("deepspeed")  # the `test` extra installs it; its estimators are plain arithmetic
from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs, model_to_params
from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

LLAMA_7B = TransformerShape.from_name("llama-7b")
TINY_LLAMA = dict(
    vocab_size=131, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64,
)  # fmt: skip


def tiny_llama() -> torch.nn.Module:
    """tests/sharding/test_fsdp.py's LLaMA: its 131-row vocabulary shards unevenly, so FSDP pads."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**TINY_LLAMA))


def deepspeed_gpu(stage: int, total: int, largest: int, world_size: int, offload: str) -> int:
    """DeepSpeed's per-GPU model-states bytes: the stage-3 function at stage 3, the stage-1-and-2 module's
    (named for stage 2; DeepSpeed has none for stage 1) below."""
    if stage == 3:
        _, gpu, _ = estimate_zero3_model_states_mem_needs(
            total, largest, num_gpus_per_node=world_size, cpu_offload=offload != "none",
            cpu_offload_params=offload == "optimizer+param",
        )  # fmt: skip
        return gpu
    _, gpu = estimate_zero2_model_states_mem_needs(
        total, num_gpus_per_node=world_size, cpu_offload=offload != "none"
    )
    return gpu


def ours(shapes: list, stage: int, world_size: int, offload: str) -> int:
    """Our model states on one rank: DeepSpeed's 16-bit copies with AdamW, divided by `shard`."""
    static = static_breakdown(shapes, precision=DEEPSPEED_16BIT, optimizer="adamw")
    return shard(static, f"deepspeed_stage_{stage}", world_size, offload=offload).static


def explained(stage: int, offload: str, P: int, T: int, LL: int, N: int) -> int:
    """DeepSpeed's figure less ours, as the sum of the copies one counts and the other does not.

    P parameters in T tensors, LL in the largest layer, N ranks. DeepSpeed's stage-2 function itemizes its
    ``18`` as 16-bit gradients 2 + fp32 gradients 4 + fp32 parameters 4 + Adam 8, beside ``2·P`` of 16-bit
    parameters; ours is ZeRO's 2 + 2 + 4 + 8 plus torch AdamW's fp32 ``step`` for each tensor."""
    steps = -(-4 * T // N) if offload == "none" else 0  # ours: AdamW's step counters, one a tensor, sharded
    fp32_grads = 4 * P // N if offload == "none" else 0  # theirs: the partition the step converts to fp32
    if stage == 1:  # theirs is stage 2's: the 16-bit gradients partitioned (on the host when offloaded);
        # ours whole on the device (stage 1 partitions only the optimizer state)
        return fp32_grads - steps - (2 * P - (2 * P // N if offload == "none" else 0))
    if stage == 2:
        return fp32_grads - steps
    gathered = 4 * LL  # theirs: the largest layer's 16-bit parameters and gradients, unsharded
    # At stage 3 the 18 holds the 16-bit parameter partition: the fp32 gradient partition replaces the
    # 16-bit one (stage3.py, _prepare_fp32_grad_for_sub_group frees it), 2 + 4 + 4 + 8 = 18.
    freed = 2 * P // N if offload == "none" else 0
    return gathered + fp32_grads - freed - steps


CASES = [(stage, "none") for stage in (1, 2, 3)] + [(stage, "optimizer") for stage in (1, 2, 3)]
CASES += [(3, "optimizer+param")]


@pytest.mark.parametrize(("stage", "offload"), CASES)
@pytest.mark.parametrize("model", ["llama-7b", "tiny-llama"])
def test_deepspeed_model_states_against_deepspeeds_estimators(model, stage, offload):
    if model == "llama-7b":
        shapes, N = parameter_shapes(LLAMA_7B), 8
        P, LL = count_parameters(LLAMA_7B), max(math.prod(s) for s in shapes)  # no biases: a tensor a layer
    else:
        module, N = tiny_llama(), 2
        shapes = [tuple(p.shape) for p in module.parameters()]
        P, LL = model_to_params(module)  # DeepSpeed's own reading of the module
        assert (count_parameters(TransformerShape.from_hf_config(module.config)), 131 * 32) == (P, LL)
    assert ((6_738_415_616, 32_000 * 4096) if model == "llama-7b" else (26_976, 4192)) == (P, LL)
    assert all(k * P % N == 0 for k in (2, 4, 18)), "the figures below are whole bytes at this N"
    theirs = deepspeed_gpu(stage, P, LL, N, offload)
    assert theirs - ours(shapes, stage, N, offload) == explained(stage, offload, P, len(shapes), LL, N)


def test_where_the_counts_agree_they_are_equal():
    """Stage 2 with the optimizer on the host: both keep the 2·P bytes of 16-bit parameters, nothing else."""
    P = count_parameters(LLAMA_7B)
    assert (
        ours(parameter_shapes(LLAMA_7B), 2, 8, "optimizer") == deepspeed_gpu(2, P, 0, 8, "optimizer") == 2 * P
    )


def test_the_7b_figures_on_8_gpus():
    """LLaMA-7B, 8 GPUs, stage 3: ours 16 bytes a parameter over the ranks (and AdamW's 291 step counters),
    DeepSpeed's 18 plus the 32,000 x 4,096 embedding (or head) gathered at 4 bytes a parameter."""
    P, shapes = count_parameters(LLAMA_7B), parameter_shapes(LLAMA_7B)
    assert (P, len(shapes)) == (6_738_415_616, 291)
    static = shard(static_breakdown(shapes, precision=DEEPSPEED_16BIT), "deepspeed_stage_3", 8)
    assert (static.parameters, static.gradients) == (2 * P // 8, 2 * P // 8) == (1_684_603_904, 1_684_603_904)
    assert static.optimizer_state == 12 * P // 8 + 146 == 10_107_623_570  # 4 x 291 / 8, rounded up
    assert static.static == 13_476_831_378  # 12.55 GiB
    theirs = deepspeed_gpu(3, P, 32_000 * 4096, 8, "none")
    assert theirs == 18 * P // 8 + 4 * 32_000 * 4096 == 15_685_723_136  # 14.61 GiB
    assert theirs - static.static == 2 * P // 8 + 4 * 32_000 * 4096 - 146 == 2_208_891_758  # 2.06 GiB


def test_the_7b_stage_3_answer_per_rank_term_by_term():
    """LLaMA-7B, batch 1 x 2048, bf16-mixed, stage 3 on 8 GPUs: DeepSpeed's bf16 copies divided by 8, the
    activations whole (each rank runs its own micro-batch), and no autocast copies (DeepSpeed's weights are
    bf16). ``memkit estimate`` divides the one-device step instead (33.36 GiB analytic, 40.02 simulated:
    fp32 weights and autocast's copies), which is not DeepSpeed's."""
    P = count_parameters(LLAMA_7B)
    one_rank = estimate_analytic(
        LLAMA_7B, 1, 2048, precision="bf16-mixed", strategy="deepspeed_stage_3", world_size=8
    )
    alone = estimate_analytic(LLAMA_7B, 1, 2048, precision="bf16-mixed", attention="sdpa")
    assert one_rank.parameters == one_rank.gradients == 2 * P // 8
    assert one_rank.optimizer_state == 12 * P // 8 + 146
    assert one_rank.activations == alone.activations == 9_126_805_504  # 8.50 GiB, Korthikanti's, sdpa
    assert one_rank.temporary == 0  # was autocast's bf16 copy of every matmul weight: 12.31 GiB a rank
    assert alone.temporary == 13_214_154_752
    assert one_rank.peak == 13_476_831_378 + 9_126_805_504 == 22_603_636_882  # 21.05 GiB


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed", "16-true", "bf16-true"])
def test_deepspeed_keeps_16_bit_weights_and_fp32_masters_at_every_16_bit_precision(precision):
    """Lightning hands DeepSpeed ``fp16``/``bf16`` for these four; its engine casts the weights to 16 bit and
    its ZeRO optimizer keeps fp32 masters and moments (read as fp32 weights with autocast copies before)."""
    shape = TransformerShape.from_name("gpt2")
    got = estimate_analytic(shape, 1, 1024, precision=precision, strategy="deepspeed_stage_2", world_size=4)
    P = count_parameters(shape)
    assert (got.parameters, got.gradients, got.temporary) == (2 * P, 2 * P // 4, 0)
    assert got.optimizer_state == -(-(12 * P + 4 * len(parameter_shapes(shape))) // 4)
    fsdp = estimate_analytic(shape, 1, 1024, precision=precision, strategy=SHARD_GRAD_OP, world_size=4)
    assert fsdp.parameters == P * (4 if "mixed" in precision else 2)  # FSDP's SHARD_GRAD_OP: the scheme's own


def test_offload_is_deepspeeds_and_parameters_move_at_stage_3_only():
    static = static_breakdown([(8, 8)], precision=DEEPSPEED_16BIT)
    with pytest.raises(ValueError, match="offload='optimizer' is DeepSpeed's"):
        shard(static, "fsdp", 2, offload="optimizer")
    with pytest.raises(ValueError, match="stage 3 only"):
        shard(static, "deepspeed_stage_2", 2, offload="optimizer+param")


def test_fsdp_full_shard_against_the_simulated_fsdp2_rank():
    """FSDP1's FULL_SHARD divides each unit's flat parameter as FSDP2 divides each parameter along dim 0,
    padding the last rank's; the analytic share (``"fsdp"``) is the one-device states over N. FSDP2's
    simulated rank 0, at its peak (the loss's backward, before any gradient of the step), holds more
    parameter bytes by exactly: its padded shards' extra rows, the root unit (embedding, final norm, head)
    gathered with its padding, and the rotary buffers (2 x 4 fp32), which the analytic share leaves out."""
    module = tiny_llama()
    ids = torch.randint(0, 131, (4, 32), generator=torch.Generator().manual_seed(0))
    loss = lambda out, y: torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), y.flatten())  # noqa: E731
    for N in (2, 4):
        peak = estimate_memory(
            module, (ids, ids), device="cpu", strategy="fsdp2", world_size=N, precision="32-true",
            optimizer="adamw", loss_fn=loss, timeline=True,
        )  # fmt: skip
        analytic = shard(model_static(module, "32-true", "adamw"), "fsdp", N)
        params = list(module.parameters())
        rank0 = sum(
            math.ceil(p.shape[0] / N) * p[0].numel() * 4 for p in params
        )  # its shards, padding included
        root = (module.model.embed_tokens.weight, module.model.norm.weight, module.lm_head.weight)
        gathered = sum(math.ceil(p.shape[0] / N) * N * p[0].numel() * 4 for p in root)
        buffers = sum(b.numel() * b.element_size() for b in module.buffers())
        assert (rank0 - analytic.parameters, gathered, buffers) == ({2: 128, 4: 64}[N], 33_920, 32)
        assert peak.parameters - analytic.parameters == (rank0 - analytic.parameters) + gathered + buffers
        at_peak = max(peak.timeline, key=lambda event: event.live)
        assert (at_peak.phase, at_peak.op) == ("backward", "aten._log_softmax_backward_data.default")
        assert peak.gradients == 0 and analytic.gradients == -(-4 * 26_976 // N)
        # AdamW's moments on the padded shards; every rank steps every tensor, so the 21 step counters whole.
        assert peak.optimizer_state == 2 * rank0 + 4 * len(params)
        assert analytic.optimizer_state == -(-(8 * 26_976 + 4 * len(params)) // N)
