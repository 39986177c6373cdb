"""Training memory from architecture numbers alone, before a model is built or a GPU is touched.

The analytic half of the estimator: from a transformer's shape, a batch, a precision, an optimizer, a
checkpointing mode and a sharding strategy it returns the `MemoryBreakdown` a measured or simulated step
has, so the two can be compared category by category. Everything is integer arithmetic over parameter
shapes; nothing here allocates a tensor. Where each figure comes from:

- ``parameters`` and ``gradients``: the exact tensor shapes of the layout (`parameter_shapes`), checked
  against the released checkpoints: GPT-2 (Radford et al. 2019; 124,439,808 parameters as on Hugging
  Face) and LLaMA-7B (Touvron et al. 2023; 6,738,415,616, a three-matrix SwiGLU MLP).
- ``optimizer_state``: what each optimizer allocates per parameter shape in torch 2.x and bitsandbytes
  0.50 (`lightning_memkit._estimating.optimizer_state`: each ``*_state_bytes`` function gives its formula and
  source), plus an fp32 master copy when the precision keeps one, as ZeRO counts it (Rajbhandari et al.
  2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", §3.1: mixed-precision
  Adam keeps 2 + 2 + K bytes per parameter, K = 12 for the fp32 master weights, momentum and variance).
- ``activations``: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
  Models" (arXiv:2205.05198), §4.1: ``s·b·h·(34 + 5·a·s/h)`` bytes per layer (the paper's s tokens per
  sequence, b sequences, h the hidden width, a heads); under the selective checkpointing policies, what
  those policies keep (`activation_bytes`).
- ``temporary``: autocast's 16-bit copies of the fp32 weights under mixed precision (Micikevicius et al.
  2018, "Mixed Precision Training"; Lightning's ``"16-mixed"`` / ``"bf16-mixed"``).
- Sharding (`shard`): ZeRO stages 1, 2 and 3 partition the optimizer state, then the gradients, then the
  parameters across the data-parallel ranks (Rajbhandari et al. 2020, §5.1-5.3, Figure 1: ``(2 + 2 + K)·Ψ``
  at stage 0, ``2Ψ + 2Ψ + K·Ψ/N_d`` at 1, ``2Ψ + (2 + K)·Ψ/N_d`` at 2, ``(2 + 2 + K)·Ψ/N_d`` at 3;
  FSDP's full shard is stage 3). Under Lightning's ``DeepSpeedStrategy`` the 16-bit precisions are
  DeepSpeed's own (`DEEPSPEED_16BIT`); DeepSpeed's estimators
  (``deepspeed.runtime.zero.stage_1_and_2.estimate_zero2_model_states_mem_needs``,
  ``deepspeed.runtime.zero.stage3.estimate_zero3_model_states_mem_needs``) count the same copies plus
  an fp32 gradient partition and, at stage 3, the largest layer gathered: docs/sharded.md compares them
  term by term.

The categories are summed as if all were live at once: an upper bound that is tight at the start of the
backward pass of a step after the first.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from lightning_memkit._breakdown import MemoryBreakdown
from lightning_memkit._budget import valid_name
from lightning_memkit._estimating.optimizer_state import OPTIMIZERS, Shape
from lightning_memkit._vocabulary import CHECKPOINT_MODES


def _positive(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# --------------------------------------------------------------------------------------------------
# Architecture -> parameter shapes and counts
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TransformerShape:
    """The numbers that size a decoder-only transformer's parameters and activations.

    Example:
        >>> count_parameters(TransformerShape.from_name("gpt2"))
        124439808
    """

    vocab_size: int  # V: rows of the token embedding (and of an untied output head)
    d_model: int  # d: the residual stream width
    n_layer: int  # L: number of transformer blocks
    n_head: int  # h: attention heads; d_model must divide evenly into them
    d_ff: int | None = None  # MLP hidden width; None -> 4 * d_model
    mlp: str = "gelu"  # "gelu": 2 matrices (fc, proj); "swiglu": 3 (gate, up, down)
    tie_weights: bool = True  # output head shares the token embedding's (V, d) matrix
    bias: bool = True  # biases on every Linear and on LayerNorm
    norm: str = "layernorm"  # "layernorm" (weight, + bias when bias=True) | "rmsnorm" (weight only)
    position: str = "learned"  # "learned": a (block_size, d) table | "none": RoPE/ALiBi, no parameters
    block_size: int | None = None  # context length; needed for position="learned"
    fused_qkv: bool = True  # one (3d, d) QKV matrix (GPT-2) vs three (d, d) (LLaMA); only Adafactor cares
    n_kv_head: int | None = None  # key/value heads (grouped-query attention); None -> n_head
    qkv_bias: bool | None = None  # biases on the Q, K, V projections alone (Qwen2); None -> bias

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layer", "n_head"):
            _positive(name, getattr(self, name))
        if self.d_model % self.n_head:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_head={self.n_head}")
        if self.n_kv_head is not None:  # left None, so that replacing n_head or bias carries over
            _positive("n_kv_head", self.n_kv_head)
            if self.n_head % self.n_kv_head:
                raise ValueError(f"n_head={self.n_head} is not divisible by n_kv_head={self.n_kv_head}")
        if self.d_ff is None:
            object.__setattr__(self, "d_ff", 4 * self.d_model)
        _positive("d_ff", self.d_ff)
        valid_name("mlp", self.mlp, ("gelu", "swiglu"))
        valid_name("norm", self.norm, ("layernorm", "rmsnorm"))
        valid_name("position", self.position, ("learned", "none"))
        if self.position == "learned":
            if self.block_size is None:
                raise ValueError("position='learned' needs block_size (rows of the position table)")
            _positive("block_size", self.block_size)

    @classmethod
    def from_name(cls, name: str) -> TransformerShape:
        """A preset (`PRESETS`): ``tiny``, ``gpt2``, ``gpt2-medium``, ``gpt2-large``, ``gpt2-xl``,
        ``llama-7b``; the bundled GPT demo builds the same ones (``GPTConfig.from_name``)."""
        return PRESETS[valid_name("architecture", name, PRESETS)]

    @classmethod
    def from_config(cls, config: Any) -> TransformerShape:
        """Read a nanoGPT-style ``GPTConfig`` (duck-typed; only attributes are read).

        Reads ``vocab_size``, ``block_size``, ``n_layer``, ``n_head``, ``n_embd`` and, when present,
        ``d_ff``, ``mlp``, ``norm``, ``pos_embedding`` (``"learned"`` | ``"rope"`` | ``"none"``), ``bias``,
        ``tie_weights``; absent ones default to nanoGPT's GPT-2 layout.
        """
        pos = getattr(config, "pos_embedding", "learned")
        position = valid_name("pos_embedding", pos, ("learned", "rope", "none"))
        return cls(
            vocab_size=config.vocab_size,
            d_model=config.n_embd,
            n_layer=config.n_layer,
            n_head=config.n_head,
            n_kv_head=getattr(config, "n_kv_head", None),
            d_ff=getattr(config, "d_ff", None),
            mlp=getattr(config, "mlp", "gelu"),
            tie_weights=getattr(config, "tie_weights", True),
            bias=getattr(config, "bias", True),
            norm=getattr(config, "norm", "layernorm"),
            position="learned" if position == "learned" else "none",
            block_size=getattr(config, "block_size", None),
            fused_qkv=getattr(config, "fused_qkv", True),
        )

    @classmethod
    def from_hf_config(cls, config: Any) -> TransformerShape:
        """Read a Hugging Face ``PretrainedConfig`` of a decoder-only family whose layout this model
        describes: ``gpt2``; ``gpt_neox``; the LLaMA family (``llama``, ``mistral``, ``qwen2``: SwiGLU,
        RMSNorm, RoPE, grouped-query attention). Only attributes are read: ``hidden_size`` (``n_embd``),
        ``num_hidden_layers`` (``n_layer``), ``num_attention_heads`` (``n_head``), ``num_key_value_heads``,
        ``intermediate_size`` (``n_inner``), ``vocab_size``, ``tie_word_embeddings``, ``n_positions``,
        ``attention_bias``.

        Raises:
            ValueError: another family (an encoder, an encoder-decoder, a vision model, ...) or a config
                whose numbers do not fit (a ``head_dim`` other than ``hidden_size / num_attention_heads``).
                A family's variants this layout does not cover (extra norms or biases) are not detected
                here: compare `count_parameters` with the model's, as ``memkit estimate`` does.
        """
        family = getattr(config, "model_type", None)
        if family not in _HF_FAMILIES:
            raise ValueError(
                f"the analytic model describes decoder-only transformers of the {', '.join(_HF_FAMILIES)} "
                f"layouts; a {family or type(config).__name__!s} model is not one of them"
            )

        def first(*names: str, default: Any = None) -> Any:
            for name in names:
                value = getattr(config, name, None)
                if value is not None:
                    return value
            return default

        d = first("hidden_size", "n_embd")
        n_head = first("num_attention_heads", "n_head")
        head_dim = getattr(config, "head_dim", None)
        if head_dim is not None and n_head and head_dim * n_head != d:
            raise ValueError(
                f"head_dim={head_dim} x num_attention_heads={n_head} != hidden_size={d}: the analytic model "
                "assumes d_model = n_head x head_dim"
            )
        common = dict(
            vocab_size=first("vocab_size"),
            d_model=d,
            n_layer=first("num_hidden_layers", "n_layer"),
            n_head=n_head,
            tie_weights=bool(first("tie_word_embeddings", default=True)),
        )
        if family == "gpt2":
            return cls(
                **common, d_ff=first("n_inner"), block_size=first("n_positions", "max_position_embeddings")
            )
        if family == "gpt_neox":
            return cls(**common, d_ff=first("intermediate_size"), position="none", n_kv_head=None)
        qkv_bias = True if family == "qwen2" else bool(first("attention_bias", default=False))
        return cls(
            **common, d_ff=first("intermediate_size"), mlp="swiglu", bias=False, norm="rmsnorm",
            position="none", fused_qkv=False, n_kv_head=first("num_key_value_heads", default=n_head),
            qkv_bias=qkv_bias,
        )  # fmt: skip


#: Hugging Face ``model_type`` values `TransformerShape.from_hf_config` reads.
_HF_FAMILIES = ("gpt2", "gpt_neox", "llama", "mistral", "qwen2")


#: The preset architectures, by name: `TransformerShape.from_name` reads them, and the GPT demo's
#: ``GPTConfig.from_name`` builds them (``lightning_memkit.demos.gpt.PRESETS`` is made from this table).
PRESETS: dict[str, TransformerShape] = {
    # The demo's CPU default: 0.87M parameters; a step of 16 x 128 tokens takes about 90 ms on 2 cores.
    # Untied: with a 256-byte vocabulary a separate head costs little and learns bigrams far sooner.
    "tiny": TransformerShape(256, 128, 4, 4, tie_weights=False, block_size=128),
    # OpenAI's GPT-2 (Radford et al. 2019); parameter counts equal Hugging Face's (124,439,808 /
    # 354,823,168 / 774,030,080 / 1,557,611,200): tied head, biases, learned positions, LayerNorm.
    "gpt2": TransformerShape(50257, 768, 12, 12, block_size=1024),
    "gpt2-medium": TransformerShape(50257, 1024, 24, 16, block_size=1024),
    "gpt2-large": TransformerShape(50257, 1280, 36, 20, block_size=1024),
    "gpt2-xl": TransformerShape(50257, 1600, 48, 25, block_size=1024),
    # LLaMA-7B (Touvron et al. 2023): 6,738,415,616 parameters; SwiGLU, RMSNorm, rotary positions (no
    # table; block_size is its 2048-token context), no biases, untied head, separate Q, K, V matrices.
    "llama-7b": TransformerShape(
        32000, 4096, 32, 32, d_ff=11008, mlp="swiglu", tie_weights=False, bias=False,
        norm="rmsnorm", position="none", block_size=2048, fused_qkv=False,
    ),
    # LLaMA-2-70B (Touvron et al. 2023b): 68,976,648,192 parameters; LLaMA-7B's layout with grouped-query
    # attention (8 key/value heads for 64 query heads) and a 4096-token context.
    "llama-70b": TransformerShape(
        32000, 8192, 80, 64, n_kv_head=8, d_ff=28672, mlp="swiglu", tie_weights=False, bias=False,
        norm="rmsnorm", position="none", block_size=4096, fused_qkv=False,
    ),
}  # fmt: skip


def _norm_shapes(shape: TransformerShape) -> list[Shape]:
    d = shape.d_model
    return [(d,), (d,)] if shape.norm == "layernorm" and shape.bias else [(d,)]


def _linear_shapes(d_in: int, d_out: int, bias: bool) -> list[Shape]:
    return [(d_out, d_in), (d_out,)] if bias else [(d_out, d_in)]  # torch layout: weight is (out, in)


def _kv_width(shape: TransformerShape) -> int:
    """Width of the K and V projections: ``d_model`` with one K/V head per query head, less with GQA."""
    return shape.d_model if shape.n_kv_head is None else shape.d_model // shape.n_head * shape.n_kv_head


def _block_shapes(shape: TransformerShape) -> list[Shape]:
    d, d_ff, b = shape.d_model, shape.d_ff, shape.bias
    assert d_ff is not None  # resolved in __post_init__
    kv, qb = _kv_width(shape), b if shape.qkv_bias is None else shape.qkv_bias
    if shape.fused_qkv:
        qkv = _linear_shapes(d, d + 2 * kv, qb)
    else:
        qkv = _linear_shapes(d, d, qb) + 2 * _linear_shapes(d, kv, qb)
    mlp_in = 2 if shape.mlp == "swiglu" else 1  # swiglu: gate and up projections
    return [
        *_norm_shapes(shape),
        *qkv,
        *_linear_shapes(d, d, b),  # attention output projection
        *_norm_shapes(shape),
        *(mlp_in * _linear_shapes(d, d_ff, b)),
        *_linear_shapes(d_ff, d, b),  # MLP down projection
    ]


def parameter_shapes(shape: TransformerShape) -> list[Shape]:
    """Every parameter tensor's shape, in module order, each shared tensor listed once.

    Order: token embedding, position table, ``n_layer`` blocks, final norm, untied output head.
    """
    shapes: list[Shape] = [(shape.vocab_size, shape.d_model)]
    if shape.position == "learned":
        assert shape.block_size is not None
        shapes.append((shape.block_size, shape.d_model))
    shapes += shape.n_layer * _block_shapes(shape)
    shapes += _norm_shapes(shape)
    if not shape.tie_weights:
        shapes.append((shape.vocab_size, shape.d_model))  # lm_head, never with a bias
    return shapes


def count_parameters(shape: TransformerShape) -> int:
    """Exact parameter count (gpt2: 124,439,808; llama-7b: 6,738,415,616)."""
    return sum(math.prod(s) for s in parameter_shapes(shape))


# --------------------------------------------------------------------------------------------------
# Precision schemes
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PrecisionScheme:
    """Bytes per element of each copy a precision scheme keeps.

    Lightning's ``"16-mixed"``/``"bf16-mixed"`` keep fp32 parameters and fp32 gradients; autocast casts
    the weights to 16 bit as the forward uses them. Those copies are the difference between
    ``compute_bytes`` and ``param_bytes``: they live in autocast's cache until the forward ends and in
    autograd's saved tensors until the backward has used them, and are reported as ``temporary``.

    Schemes outside Lightning are built directly: fp16 weights and gradients with an fp32 master copy
    (Micikevicius et al. 2018; DeepSpeed's fp16) is ``PrecisionScheme(2, 2, master_bytes=4)``, with Adam
    the 2 + 2 + 4 + 8 = 16 bytes per parameter of ZeRO's §3.1.
    """

    param_bytes: int  # the stored parameters
    grad_bytes: int  # their gradients
    master_bytes: int = 0  # a separate high-precision copy the optimizer updates (0: none)
    state_bytes: int = 4  # one element of torch.optim state, which follows the parameter dtype
    compute_bytes: int = 2  # activations; weights are cast to this when it differs from param_bytes

    @classmethod
    def from_name(cls, name: str) -> PrecisionScheme:
        """A Lightning precision string (the keys of `PRECISIONS`)."""
        return PRECISIONS[valid_name("precision", name, PRECISIONS)]


PRECISIONS: dict[str, PrecisionScheme] = {
    "64-true": PrecisionScheme(8, 8, 0, state_bytes=8, compute_bytes=8),
    "32-true": PrecisionScheme(4, 4, 0, state_bytes=4, compute_bytes=4),
    "16-mixed": PrecisionScheme(4, 4, 0, state_bytes=4, compute_bytes=2),
    "bf16-mixed": PrecisionScheme(4, 4, 0, state_bytes=4, compute_bytes=2),
    # torch optimizers allocate state with zeros_like(param): bf16 params -> bf16 moments.
    "16-true": PrecisionScheme(2, 2, 0, state_bytes=2, compute_bytes=2),
    "bf16-true": PrecisionScheme(2, 2, 0, state_bytes=2, compute_bytes=2),
}


#: Lightning's 16-bit precisions under ``DeepSpeedStrategy``: Lightning turns ``"16-mixed"``/``"16-true"``
#: into DeepSpeed's ``fp16`` and ``"bf16-mixed"``/``"bf16-true"`` into its ``bf16``, and the engine casts the
#: module's parameters to 16 bit; its ZeRO optimizer keeps fp32 master weights and fp32 Adam moments.
#: 2 + 2 + 4 + 8 = 16 bytes a parameter with Adam, ZeRO's §3.1 count, and no autocast copies (the weights
#: already are 16-bit).
DEEPSPEED_16BIT = PrecisionScheme(2, 2, master_bytes=4, state_bytes=4, compute_bytes=2)


def strategy_precision(precision: str | PrecisionScheme, strategy: str) -> PrecisionScheme:
    """The copies ``precision`` keeps under ``strategy``: `DEEPSPEED_16BIT` for a 16-bit Lightning precision
    under a ``deepspeed_stage_*`` strategy, the precision's own scheme otherwise."""
    if (
        strategy.startswith("deepspeed")
        and isinstance(precision, str)
        and precision.startswith(("16", "bf16"))
    ):
        return DEEPSPEED_16BIT
    return _precision(precision)


def scheme(precision: str) -> str:
    """The `PRECISIONS` name for a Lightning precision string; ``"32-true"`` for one it does not know."""
    return precision if precision in PRECISIONS else "32-true"


def _precision(precision: str | PrecisionScheme) -> PrecisionScheme:
    return precision if isinstance(precision, PrecisionScheme) else PrecisionScheme.from_name(precision)


def optimizer_state_bytes(name: str, shapes: Sequence[Shape], *, state_bytes: int = 4) -> int:
    """Bytes of ``optimizer.state`` after the first step for parameters of these shapes."""
    return OPTIMIZERS[valid_name("optimizer", name, OPTIMIZERS)](shapes, state_bytes)


# --------------------------------------------------------------------------------------------------
# Static memory, sharding
# --------------------------------------------------------------------------------------------------


def model_static(model: Any, precision: str, optimizer: str = "sgd") -> MemoryBreakdown:
    """`static_breakdown` of a model's trainable parameters under a Lightning precision string (`scheme`);
    the default optimizer keeps no state, for the parameters and gradients alone."""
    shapes = [tuple(p.shape) for p in model.parameters() if p.requires_grad]
    return static_breakdown(shapes, precision=scheme(precision), optimizer=optimizer)


def static_breakdown(
    shapes: Sequence[Shape], *, precision: str | PrecisionScheme = "bf16-mixed", optimizer: str = "adamw"
) -> MemoryBreakdown:
    """Parameters, gradients and optimizer state (master weights included) for any list of shapes."""
    scheme = _precision(precision)
    n = sum(math.prod(s) for s in shapes)
    state = optimizer_state_bytes(optimizer, shapes, state_bytes=scheme.state_bytes)
    return MemoryBreakdown(
        parameters=n * scheme.param_bytes,
        gradients=n * scheme.grad_bytes,
        optimizer_state=n * scheme.master_bytes + state,
    )


#: FSDP1's ``FSDPStrategy(sharding_strategy="SHARD_GRAD_OP")``, for which Lightning's StrategyRegistry has no
#: name (its ``"fsdp"`` is FULL_SHARD): the gradients and optimizer state divided, the parameters whole, each
#: in the precision's own copies (not DeepSpeed's). The callbacks read such a Trainer as it, a plan made for
#: it keeps the name (so a resumed run tells it from FULL_SHARD), and its code writes the ``FSDPStrategy``.
SHARD_GRAD_OP = "fsdp_shard_grad_op"

#: strategy -> the categories it partitions across ranks, by Lightning's strategy names: ZeRO stage 1
#: (``"deepspeed_stage_1"``) the optimizer state (P_os), stage 2 the gradients too (P_os+g), stage 3 the
#: parameters too (P_os+g+p) (Rajbhandari et al. 2020, §5.1-5.3); FSDP's full shard (``"fsdp"``) divides
#: what stage 3 does, its SHARD_GRAD_OP (`SHARD_GRAD_OP`) what stage 2 does. What DeepSpeed's estimators add
#: to these shares (an fp32 gradient partition, 4 bytes a parameter over the ranks; at stage 3 the largest
#: layer's 16-bit parameters and gradients, 4 bytes a parameter of it, unsharded) is left out: the test of
#: these formulas, tests/estimating/test_sharded_formulas.py, holds the difference to those functions byte
#: for byte.
STRATEGIES: dict[str, tuple[str, ...]] = {
    "ddp": (),
    "fsdp": ("optimizer_state", "gradients", "parameters"),
    "deepspeed_stage_1": ("optimizer_state",),
    "deepspeed_stage_2": ("optimizer_state", "gradients"),
    "deepspeed_stage_3": ("optimizer_state", "gradients", "parameters"),
    # FSDP2 (fully_shard): its rank's step is simulated (estimate_memory's strategy="fsdp2"); this share,
    # FSDP's, is only the analytic fallback, which leaves out the units it holds unsharded.
    "fsdp2": ("optimizer_state", "gradients", "parameters"),
    SHARD_GRAD_OP: ("optimizer_state", "gradients"),
}


#: DeepSpeed's offload settings -> the categories they keep in host memory instead of the device's.
#: ``"optimizer"`` (``offload_optimizer``; ZeRO-Offload, Ren et al. 2021, §4.1): the optimizer state with
#: its fp32 master weights, and the gradients where they are partitioned (stage 2 and 3), each partition
#: copied to the host as it is reduced; stage 1 keeps every gradient on the device. ``"optimizer+param"``
#: (``offload_param``, stage 3 only; ZeRO-Infinity, Rajbhandari et al. 2021): the parameter shards too.
OFFLOAD: dict[str, tuple[str, ...]] = {
    "none": (),
    "optimizer": ("optimizer_state", "gradients"),
    "optimizer+param": ("optimizer_state", "gradients", "parameters"),
}


def shard(
    breakdown: MemoryBreakdown,
    strategy: str,
    world_size: int,
    *,
    gradient_bytes: int | None = None,
    offload: str = "none",
) -> MemoryBreakdown:
    """One rank's share: the categories ``strategy`` partitions are divided by ``world_size`` (rounded up),
    ZeRO's ``(2 + 2 + K)·Ψ / N_d`` per rank at stage 3 (Rajbhandari et al. 2020, Figure 1).

    ``offload`` (one of `OFFLOAD`, ``deepspeed_stage_*`` strategies only) puts the partitioned categories it
    names in host memory: they count 0 on the device. With Adam, 16-bit weights and ``"optimizer"`` a stage-2
    rank keeps its ``2Ψ`` of 16-bit parameters, as DeepSpeed's ``estimate_zero2_model_states_mem_needs``
    says.

    Activations and temporaries are per rank already (``batch`` is the per-device micro-batch) and are
    never divided. Sharding moves bytes between devices; the sum over ranks stays the same.

    ``"ddp"`` over several ranks divides nothing and adds its reducer's flat all-reduce buckets to
    ``gradients``: one more copy of every gradient, alive for the whole run (a DDP step on CPU/gloo peaks
    higher than the same step unwrapped by exactly its gradient bytes, with ``gradient_as_bucket_view``
    or without). ``gradient_bytes`` is that size where ``breakdown.gradients`` is not all of it (a
    simulated peak taken before every gradient exists); ZeRO's and FSDP's own buffers are not modelled.
    """
    sharded = STRATEGIES[valid_name("strategy", strategy, STRATEGIES)]
    _positive("world_size", world_size)
    moved = OFFLOAD[valid_name("offload", offload, OFFLOAD)]
    if moved and not strategy.startswith("deepspeed"):
        raise ValueError(
            f"offload={offload!r} is DeepSpeed's (a deepspeed_stage_* strategy), not {strategy!r}"
        )
    if "parameters" in moved and "parameters" not in sharded:
        raise ValueError(f"offload={offload!r} moves parameter shards: stage 3 only, not {strategy!r}")
    one_rank = replace(breakdown, **{c: _ceil_div(getattr(breakdown, c), world_size) for c in sharded})
    one_rank = replace(one_rank, **{c: 0 for c in moved if c in sharded})
    if strategy == "ddp" and world_size > 1:
        buckets = breakdown.gradients if gradient_bytes is None else gradient_bytes
        one_rank = replace(one_rank, gradients=one_rank.gradients + buckets)
    return one_rank


# --------------------------------------------------------------------------------------------------
# Activations (Korthikanti et al. 2022, arXiv:2205.05198; the package's checkpointing policies)
# --------------------------------------------------------------------------------------------------

#: How attention runs: ``"eager"`` materializes the (B, h, T, T) scores; ``"sdpa"`` (a fused/flash
#: ``scaled_dot_product_attention`` kernel) never does.
ATTENTION = ("eager", "sdpa")


def _matmul_widths(shape: TransformerShape) -> list[int]:
    """Output features per token of one block's matmuls, in forward order: Q, K, V (one fused matmul or
    three), the attention output projection, the MLP's input projection(s) (SwiGLU: two) and its output."""
    d, kv = shape.d_model, _kv_width(shape)
    assert shape.d_ff is not None  # resolved in __post_init__
    qkv = [d + 2 * kv] if shape.fused_qkv else [d, kv, kv]
    mlp_in = [shape.d_ff] * (2 if shape.mlp == "swiglu" else 1)
    return [*qkv, d, *mlp_in, d]


def activation_bytes(
    shape: TransformerShape,
    batch: int,
    seq_len: int,
    *,
    bytes_per_element: int = 2,
    checkpointing: str = "none",
    attention: str = "eager",
) -> int:
    """Bytes the ``n_layer`` blocks of one micro-batch keep from their forward for the backward.

    ``checkpointing`` is one of ``CHECKPOINT_MODES`` (``lightning_memkit.ActivationCheckpointing``'s
    policies); ``d`` is ``d_model``, ``h`` the heads, ``B x T`` the micro-batch:

    - ``"none"``: Korthikanti et al. 2022 (§4.1, eq. 1) count ``T·B·d·(34 + 5·h·T/d)`` bytes per layer at
      2-byte elements: 34 bytes per token per channel for the tensors of the residual width (attention 11,
      MLP 19, the two norms' inputs 4, dropout masks at 1 byte included) and 5 per entry of the
      (B, h, T, T) attention core (softmax output 2, dropout mask 1, dropout output 2). ``attention=
      "sdpa"`` never stores a T x T matrix: the core term goes (its O(B·h·T) softmax statistics are not
      counted). Grouped-query attention keeps K and V at their width ``d_kv``: of the ``34·d``, the
      ``2·d`` each of K and V become ``2·d_kv``. Other element sizes scale the figure by
      ``bytes_per_element / 2`` (rounded up). The constants are the paper's, for a GELU MLP with
      ``d_ff = 4d``.
    - ``"selective"``: what the op-level policy keeps (matmul and fused-attention outputs saved;
      pointwise ops, norms and the softmax recomputed): the block's input, every matmul's output (Q, K,
      V, attention out, MLP in, MLP out) and, under ``"sdpa"``, the attention kernel's output. For
      GPT-2's layout with sdpa, ``(1 + 3 + 1 + 1 + 4 + 1)·d = 11·d`` elements per token, against the
      ``17·d`` of Korthikanti's selective recomputation (of the attention core alone).
    - ``"selective_half"``: as ``"selective"``, but only the first, third, ... matmul outputs are kept
      (torchtitan's op-level policy): for GPT-2's layout with sdpa the input, Q/K/V, the attention output
      and the MLP's input, ``(1 + 3 + 1 + 4)·d = 9·d`` per token; both output projections are recomputed.
    - ``"full"``: only each block's input, ``B·T·d`` elements per layer; the one block being recomputed
      during backward is transient and not counted.

    Outside the blocks (embedding output, final norm, logits of B·T·V) nothing is counted, and every
    tensor is taken at ``bytes_per_element``: under mixed precision the residual stream, and so a
    checkpointed block's input, is fp32.
    """
    _positive("batch", batch)
    _positive("seq_len", seq_len)
    _positive("bytes_per_element", bytes_per_element)
    valid_name("checkpointing", checkpointing, CHECKPOINT_MODES)
    valid_name("attention", attention, ATTENTION)
    L, d, h, tokens = shape.n_layer, shape.d_model, shape.n_head, batch * seq_len
    if checkpointing == "full":
        return L * tokens * d * bytes_per_element
    if checkpointing in ("selective", "selective_half"):
        saved = _matmul_widths(shape)[:: 1 if checkpointing == "selective" else 2]
        kept = d + sum(saved) + (d if attention == "sdpa" else 0)  # elements per token: input, outputs
        return L * tokens * kept * bytes_per_element
    core = 5 * h * seq_len if attention == "eager" else 0
    per_token = 34 * d - 4 * (d - _kv_width(shape)) + core  # bytes at 2-byte elements
    return _ceil_div(L * tokens * per_token * bytes_per_element, 2)


def _autocast_copy_bytes(shape: TransformerShape, scheme: PrecisionScheme) -> int:
    # Autocast casts the matmul weights (every 2-D block weight and the (V, d) head, tied or not) to
    # compute precision; embedding lookups and norms run on the stored weights.
    if scheme.compute_bytes == scheme.param_bytes:
        return 0
    block = sum(math.prod(s) for s in _block_shapes(shape) if len(s) == 2)
    return (shape.n_layer * block + shape.vocab_size * shape.d_model) * scheme.compute_bytes


def estimate_analytic(
    shape: TransformerShape,
    batch: int,
    seq_len: int,
    *,
    precision: str | PrecisionScheme = "bf16-mixed",
    optimizer: str = "adamw",
    checkpointing: str = "none",
    attention: str = "sdpa",
    strategy: str = "ddp",
    world_size: int = 1,
) -> MemoryBreakdown:
    """One rank's training-step memory for ``shape`` at per-device micro-batch ``batch`` × ``seq_len``.

    ``temporary`` holds autocast's low-precision weight copies under mixed precision (0 otherwise); other
    temporaries (logits, workspaces, the batch itself) are not modelled. See `activation_bytes` for what
    ``activations`` assumes and `shard` for what each strategy divides. Under a ``deepspeed_stage_*``
    strategy a 16-bit precision keeps DeepSpeed's copies (`strategy_precision`).
    """
    scheme = strategy_precision(precision, strategy)
    if shape.position == "learned" and shape.block_size is not None and seq_len > shape.block_size:
        raise ValueError(f"seq_len={seq_len} exceeds the position table's block_size={shape.block_size}")
    static = static_breakdown(parameter_shapes(shape), precision=scheme, optimizer=optimizer)
    acts = activation_bytes(
        shape,
        batch,
        seq_len,
        bytes_per_element=scheme.compute_bytes,
        checkpointing=checkpointing,
        attention=attention,
    )
    total = replace(static, activations=acts, temporary=_autocast_copy_bytes(shape, scheme))
    return shard(total, strategy, world_size)
