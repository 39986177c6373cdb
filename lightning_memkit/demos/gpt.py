"""A clean GPT to train, measure and fit: the model every lightning_memkit example and benchmark uses.

Like ``lightning.pytorch.demos`` it ships with the package, so nothing is downloaded. The model follows
nanoGPT's model.py: pre-LayerNorm blocks, causal self-attention through ``scaled_dot_product_attention``,
a GELU or SwiGLU MLP, optional weight tying. Presets run from ``tiny`` (the CPU default) to ``gpt2-xl`` and
``llama-7b``; they build on the meta device, so the estimator and auto-fit can size them without memory.

Two details the rest of the package relies on: the blocks are an ``nn.ModuleList`` named ``blocks`` of
identical ``Block`` modules whose ``forward`` takes and returns one tensor (activation checkpointing wraps
them), and the LightningModule uses AdamW with weight-decay groups and a warmup-cosine schedule, which the
optimizer swap has to carry over.
"""

import math
from dataclasses import asdict, dataclass

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.optim.lr_scheduler import LambdaLR

from lightning_memkit._estimating import analytic as _analytic
from lightning_memkit._levers.chunked_loss import chunked_cross_entropy
from lightning_memkit._optimizers.swap import swap_optimizer
from lightning_memkit.demos._data import GPTDataModule, decode, encode

__all__ = ["GPT", "Block", "GPTConfig", "GPTDataModule", "GPTLightningModule", "WarmupCosine"]


@dataclass
class GPTConfig:
    """The architecture. Defaults are GPT-2's design at the ``tiny`` size; ``from_name`` gives the presets."""

    vocab_size: int = 256  # tokens in the vocabulary; 256 fits the demo's byte-level tokenizer
    block_size: int = 128  # longest sequence the model accepts; rows of the learned position table
    n_layer: int = 4  # transformer blocks
    n_head: int = 4  # attention heads per block; must divide n_embd
    n_kv_head: int | None = None  # key/value heads (grouped-query attention, LLaMA-2-70B); None: n_head
    n_embd: int = 128  # width of the residual stream
    d_ff: int | None = None  # hidden width of the MLP; None means 4 * n_embd
    mlp: str = "gelu"  # "gelu" (GPT-2, two matrices) or "swiglu" (LLaMA, three matrices)
    norm: str = "layernorm"  # "layernorm" or "rmsnorm" (weight only, as LLaMA)
    pos_embedding: str = "learned"  # "learned" table (GPT-2), "rope" (rotary, no parameters) or "none"
    bias: bool = True  # biases in Linear layers and LayerNorms (GPT-2); False for LLaMA
    tie_weights: bool = True  # the output head shares the token embedding's weight (GPT-2); False for LLaMA
    dropout: float = 0.0  # on attention probabilities, embeddings and residual branches; 0.0 for pretraining

    def __post_init__(self) -> None:
        for field, value, choices in [
            ("mlp", self.mlp, ("gelu", "swiglu")),
            ("norm", self.norm, ("layernorm", "rmsnorm")),
            ("pos_embedding", self.pos_embedding, ("learned", "rope", "none")),
        ]:
            if value not in choices:
                raise ValueError(f"Unknown {field} {value!r}; choose one of {', '.join(map(repr, choices))}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        if self.n_kv_head is not None and (self.n_kv_head < 1 or self.n_head % self.n_kv_head):
            raise ValueError(f"n_head={self.n_head} is not a multiple of n_kv_head={self.n_kv_head}")
        if self.pos_embedding == "rope" and (self.n_embd // self.n_head) % 2:
            raise ValueError(
                f"RoPE needs an even head size, got n_embd / n_head = {self.n_embd // self.n_head}"
            )

    @classmethod
    def from_name(cls, name: str, **overrides) -> "GPTConfig":
        """A preset from ``PRESETS``, fields overridden by keyword: ``from_name("gpt2", dropout=0.1)``."""
        if name not in PRESETS:
            raise ValueError(f"Unknown GPT preset {name!r}; valid names: {', '.join(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})


def _config_fields(shape: _analytic.TransformerShape) -> dict:
    """``GPTConfig`` fields for a preset architecture. The demo always fuses Q, K and V into one matrix
    (the parameter count is the same) and gives a layout without a position table rotary positions."""
    return dict(
        vocab_size=shape.vocab_size,
        block_size=shape.block_size,
        n_layer=shape.n_layer,
        n_head=shape.n_head,
        n_kv_head=shape.n_kv_head,
        n_embd=shape.d_model,
        d_ff=None if shape.d_ff == 4 * shape.d_model else shape.d_ff,
        mlp=shape.mlp,
        norm=shape.norm,
        pos_embedding="learned" if shape.position == "learned" else "rope",
        bias=shape.bias,
        tie_weights=shape.tie_weights,
    )


#: Preset name -> ``GPTConfig`` fields: ``tiny`` (the CPU default, 0.87M parameters), ``gpt2`` ...
#: ``gpt2-xl`` and ``llama-7b`` at their published parameter counts. One table with the analytic
#: estimator's architectures, made from it.
PRESETS: dict[str, dict] = {name: _config_fields(shape) for name, shape in _analytic.PRESETS.items()}


def _norm(config: GPTConfig) -> nn.Module:
    if config.norm == "rmsnorm":
        return nn.RMSNorm(config.n_embd, eps=1e-5)
    return nn.LayerNorm(config.n_embd, bias=config.bias)


def _rotate(x: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding, half-split layout (GPT-NeoX, Hugging Face LLaMA). x: (B, nh, T, hs).

    The angles are computed on every call rather than kept in a buffer: it costs T * hs / 2 values, and a
    model built on the meta device and materialized later has no stale buffer to re-initialize."""
    T, hs = x.shape[-2:]
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, hs, 2, device=x.device, dtype=torch.float32) / hs)
    angles = torch.outer(torch.arange(T, device=x.device, dtype=torch.float32), inv_freq)  # (T, hs/2)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)  # (B, nh, T, hs/2) each
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.n_kv_head = config.n_kv_head or config.n_head  # fewer: grouped-query attention
        kv_width = config.n_embd // config.n_head * self.n_kv_head
        # query, key and value projections for all heads in one matrix
        self.c_attn = nn.Linear(config.n_embd, config.n_embd + 2 * kv_width, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.dropout = config.dropout
        self.rope = config.pos_embedding == "rope"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()  # batch, sequence length, embedding width (n_embd)
        hs, kv = C // self.n_head, self.n_kv_head
        q, k, v = self.c_attn(x).split([C, kv * hs, kv * hs], dim=2)
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, kv, hs).transpose(1, 2)  # (B, n_kv, T, hs)
        v = v.view(B, T, kv, hs).transpose(1, 2)  # (B, n_kv, T, hs)
        if self.rope:
            q, k = _rotate(q), _rotate(k)
        dropout_p = self.dropout if self.training else 0.0
        grouped = {"enable_gqa": True} if kv != self.n_head else {}  # each K/V head serves nh / n_kv queries
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, **grouped)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble all head outputs side by side
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """GPT-2's GELU MLP, or LLaMA's SwiGLU, which adds a gate matrix: silu(x W_gate) * (x W_fc)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        d_ff = config.d_ff or 4 * config.n_embd
        self.c_fc = nn.Linear(config.n_embd, d_ff, bias=config.bias)
        self.c_gate = nn.Linear(config.n_embd, d_ff, bias=config.bias) if config.mlp == "swiglu" else None
        self.c_proj = nn.Linear(d_ff, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.c_fc(x)  # (B, T, d_ff)
        h = F.silu(self.c_gate(x)) * h if self.c_gate is not None else F.gelu(h, approximate="tanh")
        return self.dropout(self.c_proj(h))


class Block(nn.Module):
    """A pre-norm transformer block. ``forward`` maps one (B, T, C) tensor to another, so
    ``torch.utils.checkpoint`` can wrap it as it is."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = _norm(config)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = _norm(config)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = (
            nn.Embedding(config.block_size, config.n_embd) if config.pos_embedding == "learned" else None
        )
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = _norm(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_weights:
            self.lm_head.weight = self.wte.weight  # one tensor, counted and updated once
        self.apply(self._init_weights)
        # GPT-2's scaled init of the projections into the residual stream: std 0.02 / sqrt(2 * n_layer)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_parameters(self) -> int:
        """Number of parameters; a tied embedding and head count once."""
        return sum(p.numel() for p in self.parameters())  # parameters() yields shared tensors once

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None, loss_chunks: int = 1
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Logits (B, T, vocab_size) for token ids idx (B, T), and the mean cross-entropy if targets given.

        With ``loss_chunks > 1`` and targets, the loss is `chunked_cross_entropy` over that many slices of the
        tokens and no logits are returned (``None``): they never exist for the whole batch at once."""
        t = idx.size(1)
        if t > self.config.block_size:
            raise ValueError(
                f"Cannot forward a sequence of length {t}: block_size is only {self.config.block_size}. "
                f"Use sequences of at most {self.config.block_size} tokens, or a larger block_size."
            )
        x = self.wte(idx)  # (B, T, C)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(t, device=idx.device))  # (T, C) broadcast over the batch
        x = self.drop(x)
        for block in self.blocks:
            x = block(x)
        if targets is not None and loss_chunks > 1:
            return None, chunked_cross_entropy(self.ln_f(x), self.lm_head, targets, chunks=loss_chunks)
        logits = self.lm_head(self.ln_f(x))  # (B, T, vocab_size)
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.view(-1))
        return logits, loss

    @torch.no_grad()
    def generate(
        self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None
    ) -> torch.Tensor:
        """Extend token ids idx (B, T) by max_new_tokens sampled tokens; returns (B, T + max_new_tokens)."""
        for _ in range(max_new_tokens):
            idx_cond = idx[:, -self.config.block_size :]  # the model sees at most block_size tokens
            logits, _ = self(idx_cond)
            logits = logits[:, -1, :].float() / temperature  # (B, vocab_size)
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float("inf")
            next_id = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)  # (B, 1)
            idx = torch.cat((idx, next_id), dim=1)
        return idx


class WarmupCosine:
    """Learning-rate multiplier for ``LambdaLR``: linear warmup to 1 over ``warmup_steps``, then a cosine
    decay to ``min_ratio`` at ``max_steps``, flat after. An object, not a lambda, so that
    ``LambdaLR.state_dict`` saves it."""

    def __init__(self, warmup_steps: int, max_steps: int, min_ratio: float = 0.1) -> None:
        self.warmup_steps = warmup_steps
        self.max_steps = max_steps
        self.min_ratio = min_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.max_steps - self.warmup_steps))
        return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class GPTLightningModule(L.LightningModule):
    """The GPT trained as a language model on byte tokens.

    Args:
        config: a ``GPTConfig``, its fields as a dict, or a preset name (``GPTConfig.from_name``).
        learning_rate: peak learning rate, reached after the warmup. The default suits ``tiny``; GPT-2
            sizes train with about 6e-4.
        weight_decay: AdamW's decoupled weight decay for the weight matrices and embeddings (as nanoGPT);
            biases and norm weights get none.
        betas: AdamW's betas.
        warmup_steps: optimizer steps of linear warmup.
        max_steps: optimizer steps of the cosine decay; ``None`` takes ``trainer.estimated_stepping_batches``.
        min_lr_ratio: the final learning rate as a fraction of the peak.
        optimizer: a catalogue name (`lightning_memkit.CATALOGUE`): AdamW's hyperparameters carried over
            by `swap_optimizer`; ``"adamw_kahan"`` is the compensated update for ``precision="bf16-true"``.
        loss_chunks: compute the training loss over this many slices of the tokens
            (`lightning_memkit.chunked_cross_entropy`): the whole batch's logits never exist at once.

    Logs ``train_loss`` (each step) and ``val_loss`` (each validation epoch), in nats per byte.
    """

    def __init__(
        self,
        config: GPTConfig | str | dict = "tiny",
        learning_rate: float = 3e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 10,
        max_steps: int | None = None,
        min_lr_ratio: float = 0.1,
        optimizer: str = "adamw",
        loss_chunks: int = 1,
    ) -> None:
        super().__init__()
        if isinstance(config, str):
            self.config = GPTConfig.from_name(config)
        else:
            self.config = config if isinstance(config, GPTConfig) else GPTConfig(**config)
            # Saved as a plain dict, so that a checkpoint loads with torch.load(weights_only=True).
            config = asdict(self.config)
        self.save_hyperparameters()  # reads the arguments as they are now, config included
        self.model = GPT(self.config)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)[0]

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch  # (B, T) token ids, y shifted by one
        _, loss = self.model(x, y, loss_chunks=self.hparams.loss_chunks)
        self.log("train_loss", loss, prog_bar=True, batch_size=x.size(0))
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        _, loss = self.model(x, y)
        self.log("val_loss", loss, prog_bar=True, batch_size=x.size(0))

    def configure_optimizers(self) -> dict:
        hp = self.hparams
        # Matrices and embeddings (2-D and up) decay; biases and norm weights (1-D) do not.
        params = [p for p in self.parameters() if p.requires_grad]  # a tied weight appears once
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": hp.weight_decay, "name": "decay"},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0, "name": "no_decay"},
        ]
        optimizer = torch.optim.AdamW(groups, lr=hp.learning_rate, betas=tuple(hp.betas))
        if hp.optimizer != "adamw":
            optimizer = swap_optimizer(optimizer, hp.optimizer)
        max_steps = hp.max_steps or self.trainer.estimated_stepping_batches
        if not math.isfinite(max_steps):
            raise ValueError(
                "The cosine schedule needs a length: set max_steps here or Trainer(max_steps=...)"
            )
        scheduler = LambdaLR(optimizer, WarmupCosine(hp.warmup_steps, int(max_steps), hp.min_lr_ratio))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    @torch.no_grad()
    def generate(
        self,
        prompt: str = "\n",
        max_new_tokens: int = 200,
        temperature: float = 0.8,
        top_k: int | None = None,
    ) -> str:
        """Sample ``max_new_tokens`` bytes after ``prompt``; returns the prompt and the continuation."""
        if not prompt:
            raise ValueError("generate() needs a prompt of at least one character, e.g. '\\n'")
        was_training = self.training
        self.eval()
        try:
            idx = torch.tensor([encode(prompt)], dtype=torch.long, device=self.device)  # (1, T)
            out = self.model.generate(idx, max_new_tokens, temperature=temperature, top_k=top_k)
        finally:
            self.train(was_training)
        return decode(out[0].tolist())
