"""The analytic estimator: published parameter counts, worked examples of the memory arithmetic (with the
slips of commonly quoted figures), optimizer state against real optimizer steps, activations under each
checkpointing mode against the simulated step, and properties of activations and sharding."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import replace
from types import SimpleNamespace

import optimi
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_memkit import estimate_memory
from lightning_memkit._breakdown import MemoryBreakdown
from lightning_memkit._checkpointing.policies import CHECKPOINT_MODES
from lightning_memkit._estimating.analytic import (
    SHARD_GRAD_OP,
    STRATEGIES,
    PrecisionScheme,
    TransformerShape,
    activation_bytes,
    count_parameters,
    estimate_analytic,
    optimizer_state_bytes,
    parameter_shapes,
    shard,
    static_breakdown,
)
from lightning_memkit._estimating.optimizer_state import (
    BNB_BLOCK_SIZE,
    BNB_MIN_8BIT_SIZE,
    OPTIMIZERS,
    adamw8bit_state_bytes,
    adamw_state_bytes,
)
from lightning_memkit.demos.gpt import PRESETS, GPTConfig, GPTLightningModule

LLAMA_7B = TransformerShape.from_name("llama-7b")


# --- parameter counts -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("gpt2", 124_439_808),
        ("gpt2-medium", 354_823_168),
        ("gpt2-large", 774_030_080),
        ("gpt2-xl", 1_557_611_200),
        ("llama-7b", 6_738_415_616),
        ("llama-70b", 68_976_648_192),  # LLaMA-2-70B: grouped-query attention, 8 key/value heads
    ],
)
def test_count_parameters_matches_published_checkpoints(name, expected):
    assert count_parameters(TransformerShape.from_name(name)) == expected


def test_the_gpt_demo_builds_the_same_presets():
    """One table: the demo's ``GPTConfig`` presets are the analytic presets (the demo fuses Q, K and V)."""
    assert list(PRESETS) == ["tiny", "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "llama-7b", "llama-70b"]
    for name in PRESETS:
        shape = TransformerShape.from_name(name)
        assert TransformerShape.from_config(GPTConfig.from_name(name)) == replace(shape, fused_qkv=True)
    assert count_parameters(TransformerShape.from_name("tiny")) == 875_264


def test_from_config_reads_a_nanogpt_config():
    nanogpt = SimpleNamespace(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768, bias=True)
    assert count_parameters(TransformerShape.from_config(nanogpt)) == 124_439_808

    llama = SimpleNamespace(
        vocab_size=32000, block_size=4096, n_layer=32, n_head=32, n_embd=4096, d_ff=11008, mlp="swiglu",
        norm="rmsnorm", pos_embedding="rope", bias=False, tie_weights=False,
    )  # fmt: skip
    assert count_parameters(TransformerShape.from_config(llama)) == 6_738_415_616


def test_variants_change_the_count_by_exactly_their_tensors():
    base = TransformerShape(vocab_size=100, d_model=16, n_layer=3, n_head=4, block_size=8)
    V, d, L, d_ff = 100, 16, 3, 64
    n = count_parameters(base)
    assert count_parameters(TransformerShape(**{**vars(base), "tie_weights": False})) == n + V * d
    assert count_parameters(TransformerShape(**{**vars(base), "position": "none"})) == n - 8 * d
    # biases: 3d (qkv) + d (proj) + d_ff + d (mlp) per block; LayerNorm biases: 2 per block + final.
    no_bias = TransformerShape(**{**vars(base), "bias": False})
    assert count_parameters(no_bias) == n - L * (3 * d + d + d_ff + d) - (2 * L + 1) * d
    rms = TransformerShape(**{**vars(base), "bias": False, "norm": "rmsnorm"})
    assert count_parameters(rms) == count_parameters(no_bias)  # both weight-only norms
    swiglu = TransformerShape(**{**vars(base), "mlp": "swiglu"})
    assert count_parameters(swiglu) == n + L * (d * d_ff + d_ff)  # one more (d_ff, d) matrix + bias
    split = TransformerShape(**{**vars(base), "fused_qkv": False})
    assert count_parameters(split) == n  # same numbers, two more (d, d) weights and biases per block
    assert len(parameter_shapes(split)) == len(parameter_shapes(base)) + 4 * L


def test_the_two_matrix_approximation_misses_llamas_third_mlp_matrix():
    """``V·d + L·(4d² + 2·d·d_ff) + d`` (Kaplan et al. 2020's ``2·d·L·(2·d_attn + d_ff)`` plus the
    embedding and a final norm) gives 131M + 32 × 157M + d = 5.16 B for LLaMA-7B's numbers, not 6.7 B
    (and 32 × 157M is 5,033M, not the 5,024M sometimes written). LLaMA-7B has 6.738 B parameters because
    its MLP has three matrices (SwiGLU), which the formula leaves out."""
    V, d, L, d_ff = 32000, 4096, 32, 11008
    two_matrix = V * d + L * (4 * d * d + 2 * d * d_ff) + d
    assert two_matrix == 32000 * 4096 + 32 * 157_286_400 + 4096 == 5_164_240_896
    assert count_parameters(LLAMA_7B) == 6_738_415_616


# --- worked examples ----------------------------------------------------------------------------------


def test_one_attention_matrix_is_1_07e9_bytes():
    """2·B·h·T² at B=4, h=32, T=2048 is 1.07 GB per matrix (not the 2.1 GB sometimes quoted); so two
    matrices in each of 32 layers are 68.7 GB, not 134 GB."""
    B, h, T = 4, 32, 2048
    one_matrix = 2 * B * h * T**2
    assert one_matrix == 1_073_741_824
    assert 2 * 32 * one_matrix == 68_719_476_736
    # The estimator's attention-core term (5 bytes per T×T entry) is 2.5 such matrices per layer.
    one_layer = TransformerShape(vocab_size=32000, d_model=4096, n_layer=1, n_head=32, position="none")
    core = activation_bytes(one_layer, B, T) - activation_bytes(one_layer, B, T, attention="sdpa")
    assert 2 * core == 5 * one_matrix


def test_llama_7b_activations_at_4_x_2048_are_122e9_bytes():
    """Korthikanti et al. 2022, eq. 1, without checkpointing and with the attention matrices stored."""
    expected = 32 * 4 * 2048 * (34 * 4096 + 5 * 32 * 2048)
    assert activation_bytes(LLAMA_7B, 4, 2048, attention="eager") == expected == 122_406_567_936


def test_fp16_weights_with_fp32_gradients_and_adam_are_14_bytes_per_param():
    """fp16 parameters 2 + fp32 gradients 4 + fp32 Adam moments 8 = 14 B/param: 98 GB for 7 B."""
    fp16_fp32_grads = PrecisionScheme(param_bytes=2, grad_bytes=4, state_bytes=4, compute_bytes=2)
    static = static_breakdown([(7_000_000_000,)], precision=fp16_fp32_grads, optimizer="adamw")
    assert (static.parameters, static.gradients) == (14e9, 28e9)
    assert static.optimizer_state == 56e9 + 4  # + torch's 4-byte step tensor for the one parameter
    assert static.static - 4 == 98e9


def test_mixed_precision_adam_with_a_master_copy_is_16_bytes_per_param():
    """ZeRO's accounting (Rajbhandari et al. 2020, §3.1): 2 (fp16 weights) + 2 (fp16 grads) + 4 (fp32
    master) + 8 (Adam's fp32 moments) = 16 bytes per parameter."""
    scheme = PrecisionScheme(param_bytes=2, grad_bytes=2, master_bytes=4, state_bytes=4, compute_bytes=2)
    assert scheme.param_bytes + scheme.grad_bytes + scheme.master_bytes + 2 * scheme.state_bytes == 16
    static = static_breakdown([(10**6,)], precision=scheme)
    assert static.static == 16 * 10**6 + 4


def test_lightning_mixed_precision_keeps_fp32_weights_and_counts_autocast_copies():
    shape = TransformerShape.from_name("gpt2")
    n = count_parameters(shape)
    mixed = estimate_analytic(shape, 1, 64, precision="bf16-mixed")
    assert (mixed.parameters, mixed.gradients) == (4 * n, 4 * n)
    # 2-byte copies of every matmul weight: 12·d² per block plus the tied (V, d) head.
    assert mixed.temporary == 2 * (12 * 768**2 * 12 + 50257 * 768)
    assert estimate_analytic(shape, 1, 64, precision="32-true").temporary == 0
    true16 = estimate_analytic(shape, 1, 64, precision="bf16-true")
    assert true16.temporary == 0 and true16.optimizer_state == adamw_state_bytes(parameter_shapes(shape), 2)


def test_fp32_activations_are_twice_the_2_byte_figure():
    shape = TransformerShape.from_name("gpt2")
    for checkpointing in CHECKPOINT_MODES:
        half = activation_bytes(shape, 2, 128, checkpointing=checkpointing)
        assert activation_bytes(shape, 2, 128, bytes_per_element=4, checkpointing=checkpointing) == 2 * half
    assert activation_bytes(shape, 2, 128, checkpointing="full") == 12 * 2 * 128 * 768 * 2


@pytest.mark.parametrize(
    ("checkpointing", "per_token"),
    [("selective", 11 * 768), ("selective_half", 9 * 768), ("full", 768)],
)
def test_checkpointing_keeps_what_its_policy_saves(checkpointing, per_token):
    """GPT-2 with sdpa, per layer and token: the block's input, then selective: Q/K/V (3d), the attention
    output (d), its projection (d), the MLP's input (4d) and output (d); selective_half: all but the two
    output projections; full: the input alone. Eager attention has no kernel output to keep."""
    shape = TransformerShape.from_name("gpt2")
    sdpa = activation_bytes(shape, 2, 128, checkpointing=checkpointing, attention="sdpa")
    assert sdpa == 12 * 2 * 128 * per_token * 2
    if checkpointing != "full":
        eager = activation_bytes(shape, 2, 128, checkpointing=checkpointing)
        assert sdpa - eager == 12 * 2 * 128 * 768 * 2


def _simulated_activations(checkpointing, n_layer, **config):
    with torch.device("meta"):
        module = GPTLightningModule(GPTConfig.from_name("tiny", n_layer=n_layer, **config))
    x = torch.zeros(4, 64, dtype=torch.long, device="meta")  # (B, T) token ids
    return estimate_memory(module, (x, x), checkpointing=checkpointing, device="cpu").activations


@pytest.mark.parametrize("checkpointing", ["selective", "selective_half"])
@pytest.mark.parametrize(
    "config",
    [{}, dict(mlp="swiglu", d_ff=96, n_head=8, bias=False, norm="rmsnorm", pos_embedding="rope")],
    ids=["gelu", "swiglu"],
)
def test_selective_policies_match_the_simulated_step(checkpointing, config):
    """What two more layers add to the simulated step's activations (the tiny GPT at 2 and at 4 layers,
    fp32, sdpa), against the analytic count. Within 2 %: per layer the simulation also keeps the attention
    kernel's fp32 log-sum-exp (h values per token) and the RNG state a checkpointed block saves (5,056
    bytes on CPU), which the analytic count leaves out (16 + 19.75 of 4,644 bytes per token here)."""
    simulated = _simulated_activations(checkpointing, 4, **config) - _simulated_activations(
        checkpointing, 2, **config
    )
    shape = TransformerShape.from_config(GPTConfig.from_name("tiny", **config))
    analytic = [
        activation_bytes(
            replace(shape, n_layer=n_layer), 4, 64, bytes_per_element=4, checkpointing=checkpointing,
            attention="sdpa",
        )
        for n_layer in (4, 2)
    ]  # fmt: skip
    assert simulated == pytest.approx(analytic[0] - analytic[1], rel=0.02)


def test_8bit_adamw_is_about_2_bytes_per_param():
    n = 4096 * 4096
    per_param = (adamw8bit_state_bytes([(4096, 4096)]) - 2 * 256 * 4) / n  # less the two qmaps
    assert per_param == 2 + 2 * 4 / BNB_BLOCK_SIZE


# --- optimizer state against real optimizer steps ----------------------------------------------------

# Shapes chosen to hit every branch: above and below min_8bit_size, numel not a multiple of 256,
# 1-D above min_8bit_size, and a 3-D tensor (Adafactor factors its last two dims).
SHAPES = [(100, 96), (100,), (10, 100), (10,), (5000,), (2, 30, 40)]


def _state_nbytes(optimizer: torch.optim.Optimizer) -> int:
    seen, total = set(), 0
    for state in optimizer.state.values():
        for value in state.values():
            if torch.is_tensor(value):
                storage = value.untyped_storage()
                if storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    total += storage.nbytes()
    return total


def _one_step(make, dtype=torch.float32) -> int:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, dtype=dtype)) for s in SHAPES]
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer = make(params)
    optimizer.step()
    return _state_nbytes(optimizer)


@pytest.mark.parametrize(
    ("name", "make"),
    [
        ("adamw", lambda p: torch.optim.AdamW(p)),
        ("sgd_momentum", lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)),
        ("sgd", lambda p: torch.optim.SGD(p, lr=0.1)),
        ("adafactor", lambda p: torch.optim.Adafactor(p)),
    ],
)
def test_torch_optimizer_state_matches_a_real_step(name, make):
    assert _one_step(make) == optimizer_state_bytes(name, SHAPES)


def test_torch_state_follows_bf16_params():
    real = _one_step(lambda p: torch.optim.AdamW(p), dtype=torch.bfloat16)
    assert real == optimizer_state_bytes("adamw", SHAPES, state_bytes=2)


@pytest.mark.parametrize(
    ("name", "make"),
    [("adamw_kahan", lambda p: optimi.AdamW(p, lr=1e-3)), ("sgd_kahan", lambda p: optimi.SGD(p, lr=1e-3))],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_optimi_state_matches_a_real_step(name, make, dtype):
    """torch-optimi's Kahan buffer exists for 16-bit weights only; its moments take the weights' dtype."""
    real = _one_step(make, dtype=dtype)
    assert real == optimizer_state_bytes(name, SHAPES, state_bytes=dtype.itemsize)
    assert (real > 0) == (name == "adamw_kahan" or dtype == torch.bfloat16)


@pytest.mark.parametrize("name", ["adamw8bit", "paged_adamw8bit", "lion", "lion8bit"])
def test_bitsandbytes_state_matches_a_real_step(name):
    bnb = pytest.importorskip("bitsandbytes")
    make = {
        "adamw8bit": bnb.optim.AdamW8bit,
        "paged_adamw8bit": bnb.optim.PagedAdamW8bit,
        "lion": bnb.optim.Lion,
        "lion8bit": bnb.optim.Lion8bit,
    }[name]
    with pytest.warns(UserWarning, match="Paged") if name.startswith("paged") else nullcontext():
        real = _one_step(make)
    assert real == optimizer_state_bytes(name, SHAPES)
    assert BNB_MIN_8BIT_SIZE == 4096 and BNB_BLOCK_SIZE == 256


# --- errors ------------------------------------------------------------------------------------------


def test_non_positive_sizes_name_the_value():
    with pytest.raises(ValueError, match="n_layer must be a positive integer, got 0"):
        TransformerShape(vocab_size=10, d_model=8, n_layer=0, n_head=2, position="none")
    with pytest.raises(ValueError, match="d_model=10 is not divisible by n_head=3"):
        TransformerShape(vocab_size=10, d_model=10, n_layer=1, n_head=3, position="none")
    with pytest.raises(ValueError, match="batch must be a positive integer, got -1"):
        activation_bytes(LLAMA_7B, -1, 128)
    with pytest.raises(ValueError, match="world_size must be a positive integer, got 0"):
        shard(MemoryBreakdown(), "deepspeed_stage_1", 0)
    with pytest.raises(ValueError, match="needs block_size"):
        TransformerShape(vocab_size=10, d_model=8, n_layer=1, n_head=2)
    with pytest.raises(ValueError, match="seq_len=2048 exceeds"):
        estimate_analytic(TransformerShape.from_name("gpt2"), 1, 2048)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: PrecisionScheme.from_name("bf16"), r"Unknown precision 'bf16'.*Did you mean 'bf16-true'"),
        (lambda: optimizer_state_bytes("adam", [(4,)]), r"Unknown optimizer 'adam'.*Did you mean 'adamw'"),
        (
            lambda: shard(MemoryBreakdown(), "deepspeed_stage3", 2),
            r"Unknown strategy 'deepspeed_stage3'.*Did you mean 'deepspeed_stage_3'",
        ),
        (
            lambda: activation_bytes(LLAMA_7B, 1, 8, checkpointing="ful"),
            r"valid: none, selective, selective_half, full\. Did you mean 'full'",
        ),
        (lambda: TransformerShape.from_name("gpt3"), r"Unknown architecture 'gpt3'"),
    ],
)
def test_unknown_names_list_the_valid_ones(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# --- properties --------------------------------------------------------------------------------------

shapes = st.builds(
    lambda heads, head_dim, n_layer, vocab: TransformerShape(
        vocab_size=vocab, d_model=heads * head_dim, n_layer=n_layer, n_head=heads, position="none"
    ),
    st.integers(1, 16),
    st.integers(1, 128),
    st.integers(1, 48),
    st.integers(1, 100_000),
)
sizes = st.integers(1, 8192)
modes = st.sampled_from([(mode, attention) for mode in CHECKPOINT_MODES for attention in ("eager", "sdpa")])


@settings(max_examples=60, deadline=None)
@given(shapes, sizes, sizes, st.integers(1, 64), modes, st.sampled_from([1, 2, 4]))
def test_activations_are_monotone_in_batch_and_seq_len(shape, batch, seq_len, extra, mode, bpe):
    checkpointing, attention = mode
    kw = dict(bytes_per_element=bpe, checkpointing=checkpointing, attention=attention)
    base = activation_bytes(shape, batch, seq_len, **kw)
    assert activation_bytes(shape, batch + extra, seq_len, **kw) >= base
    assert activation_bytes(shape, batch, seq_len + extra, **kw) >= base


@settings(max_examples=60, deadline=None)
@given(shapes, sizes, sizes)
def test_checkpointing_modes_keep_less_in_order(shape, batch, seq_len):
    def acts(checkpointing, attention="eager"):
        return activation_bytes(shape, batch, seq_len, checkpointing=checkpointing, attention=attention)

    for attention in ("eager", "sdpa"):
        kept = [acts(mode, attention) for mode in CHECKPOINT_MODES]  # none ... full
        assert kept == sorted(kept, reverse=True)
    assert acts("none", "sdpa") <= acts("none", "eager")


categories = st.integers(0, 10**15)


@settings(max_examples=100, deadline=None)
@given(categories, categories, categories, categories, categories, st.sampled_from(sorted(STRATEGIES)))
def test_sharding_divides_exactly_its_categories(p, g, o, a, t, strategy):
    full = MemoryBreakdown(parameters=p, gradients=g, optimizer_state=o, activations=a, temporary=t)
    assert shard(full, strategy, 1) == full
    for n in (2, 3, 8):
        one_rank = shard(full, strategy, n)
        for category in ("parameters", "gradients", "optimizer_state", "activations", "temporary"):
            value, share = getattr(full, category), getattr(one_rank, category)
            if category in STRATEGIES[strategy]:
                assert n * (share - 1) < value <= n * share  # share == ceil(value / n)
            elif strategy == "ddp" and category == "gradients":
                assert share == 2 * value  # the gradients and DDP's all-reduce buckets
            else:
                assert share == value


def test_zero_stages_nest():
    one, two, three = (set(STRATEGIES[f"deepspeed_stage_{k}"]) for k in (1, 2, 3))
    assert one == {"optimizer_state"} < two == one | {"gradients"} < three == two | {"parameters"}
    assert set(STRATEGIES["fsdp"]) == three and set(STRATEGIES[SHARD_GRAD_OP]) == two
    assert STRATEGIES["ddp"] == ()


@settings(max_examples=30, deadline=None)
@given(shapes, st.integers(1, 64), st.integers(1, 512), st.sampled_from(sorted(OPTIMIZERS)))
def test_estimate_is_monotone_and_sharding_keeps_activations(shape, batch, seq_len, optimizer):
    small = estimate_analytic(shape, batch, seq_len, optimizer=optimizer)
    assert estimate_analytic(shape, batch + 1, seq_len, optimizer=optimizer).peak >= small.peak
    assert estimate_analytic(shape, batch, seq_len + 1, optimizer=optimizer).peak >= small.peak
    sharded = estimate_analytic(shape, batch, seq_len, optimizer=optimizer, strategy="fsdp", world_size=4)
    assert sharded.activations == small.activations and sharded.temporary == small.temporary
    assert sharded.parameters == -(-small.parameters // 4)
