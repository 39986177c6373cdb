"""A zoo of models this project did not write, as users bring them: tiny random configs, default settings.

Hugging Face families (BERT, T5, a LLaMA-family decoder with grouped-query attention, GPT-NeoX, GPT-2,
ViT, Whisper: an encoder and a decoder of two layer classes; Mixtral: mixture-of-experts, its experts in
one grouped matmul) are built from their config classes with random weights (nothing is downloaded) and
keep every default a user would not change: ``use_cache=True``, dropout, the SDPA attention path. The CNN
is a small ResNet with BatchNorm, written here (torchvision/timm would pull another torch build).

`FAMILIES` are the families issue 26 found broken, kept out of `MODELS` (the quick tier sweeps those): timm's
EfficientNet (in-place activations after BatchNorm), torch's LSTM and GRU (oneDNN's workspace), Qwen2-MoE
with Hugging Face's eager experts (a ``nonzero`` of the routing, which the estimate refuses) and a LLaMA
compiled in ``configure_model``. ``benchmarks/bench_zoo.py`` prints their rows; EfficientNet's needs timm,
which the test extras do not install.

`ADAPTED` are issue 45's adapter fine-tunes (LoRA and QLoRA) over a decoder, an encoder-decoder and a
mixture of experts, kept out of `MODELS` too; ``benchmarks/bench_zoo.py`` prints them when named.

``ZooModule(name)`` is a LightningModule over one of them; ``zoo_batch(name)`` a batch of its shape.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import lightning.pytorch as pl
import torch
from models import Tagger, lm_loss
from torch import nn
from torch.utils.data import DataLoader, Dataset

VOCAB = 128
SEQ = 32
BATCH = 4
MEL_BINS = 16  # Whisper's log-mel channels; its encoder takes 2 x max_source_positions frames


def _bert() -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=64,
    )  # fmt: skip
    return BertForMaskedLM(cfg)


def _t5() -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
        decoder_start_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return T5ForConditionalGeneration(cfg)


def _grouped_query_decoder(family: str) -> Callable[[], nn.Module]:
    """A LLaMA-family decoder with grouped-query attention (``Qwen2``, ``Mixtral``: its MLP a mixture of
    experts), the same tiny sizes for each."""

    def build() -> nn.Module:
        import transformers

        cfg = getattr(transformers, f"{family}Config")(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        )  # fmt: skip
        return getattr(transformers, f"{family}ForCausalLM")(cfg)

    return build


_qwen2 = _grouped_query_decoder("Qwen2")  # module-level: `memkit --model zoo:_qwen2` names it
_mixtral = _grouped_query_decoder("Mixtral")
_llama = _grouped_query_decoder("Llama")


def _qwen2_moe(**config) -> nn.Module:
    """Qwen2-MoE: routed experts (one grouped matmul by default) beside a shared expert; ``config``: its
    config's further fields (``experts_implementation="eager"``: each expert's tokens gathered one by one)."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    cfg = Qwen2MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
        shared_expert_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, **config,
    )  # fmt: skip
    return Qwen2MoeForCausalLM(cfg)


def _neox() -> nn.Module:
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    cfg = GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=64,
    )  # fmt: skip
    return GPTNeoXForCausalLM(cfg)


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64))


def _vit() -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    cfg = ViTConfig(
        image_size=32, patch_size=8, num_channels=3, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=2, intermediate_size=64, num_labels=10,
    )  # fmt: skip
    return ViTForImageClassification(cfg)


def _whisper() -> nn.Module:
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    cfg = WhisperConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=MEL_BINS,
        max_source_positions=SEQ, max_target_positions=64, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, decoder_start_token_id=1,
    )  # fmt: skip
    return WhisperForConditionalGeneration(cfg)


def _efficientnet() -> nn.Module:
    """timm's EfficientNet-B0 at its defaults, random weights: BatchNorm followed by an in-place SiLU."""
    import timm

    return timm.create_model("efficientnet_b0", pretrained=False, num_classes=10)


class BasicBlock(nn.Module):
    """A ResNet basic block: conv-BN-ReLU-conv-BN plus the identity (or a strided 1x1 projection)."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.skip = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.skip = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C, H, W)
        h = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(h)) + self.skip(x))


class ResNet(nn.Module):
    """A 4-block ResNet for 3x32x32 images, 10 classes."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.blocks = nn.Sequential(
            BasicBlock(width, width), BasicBlock(width, width),
            BasicBlock(width, 2 * width, stride=2), BasicBlock(2 * width, 2 * width),
        )  # fmt: skip
        self.head = nn.Linear(2 * width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


#: name -> (factory, kind): "mlm" / "seq2seq" / "causal" take token batches, "image" / "cnn" image
#: batches, "speech" log-mel features and token labels; "sequence" token ids and a label per token (a model
#: of logits, stepped with `lm_loss`); "compiled" is "causal" compiled in ``configure_model``.
MODELS: dict[str, tuple[Callable[[], nn.Module], str]] = {
    "bert": (_bert, "mlm"),
    "t5": (_t5, "seq2seq"),
    "qwen2": (_qwen2, "causal"),
    "gpt_neox": (_neox, "causal"),
    "gpt2": (_gpt2, "causal"),
    "vit": (_vit, "image"),
    "whisper": (_whisper, "speech"),
    "mixtral": (_mixtral, "causal"),
    "resnet": (ResNet, "cnn"),
}
FAMILIES: dict[str, tuple[Callable[[], nn.Module], str]] = {
    "efficientnet": (_efficientnet, "cnn"),  # needs timm
    "lstm": (partial(Tagger, nn.LSTM, VOCAB), "sequence"),
    "gru": (partial(Tagger, nn.GRU, VOCAB), "sequence"),
    "qwen2_moe_eager": (partial(_qwen2_moe, experts_implementation="eager"), "causal"),
    "compiled_llama": (_llama, "compiled"),
}


def _adapted(base: str, targets: list[str], quantize: bool) -> Callable[[], nn.Module]:
    """Zoo model ``base`` under peft's LoRA (r=8 on ``targets``), its other weights frozen; with ``quantize``,
    QLoRA: every ``nn.Linear`` of the base but the head a bitsandbytes ``Linear4bit`` first (nf4, double
    quantization, as tests/peft_models.py builds them)."""

    def build() -> nn.Module:
        import peft

        model = MODELS[base][0]()
        if quantize:  # every Linear but those transformers' quantizer leaves: the head, T5's `wo`
            from peft_models import quantized

            options = {"quant_type": "nf4", "compress_statistics": True}
            kept = {"lm_head", *(getattr(model, "_keep_in_fp32_modules", None) or ())}
            for module in list(model.modules()):
                for name, child in list(module.named_children()):
                    if type(child) is nn.Linear and name not in kept:
                        setattr(module, name, quantized(child, options))
        return peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, target_modules=targets))

    return build


#: Issue 45's adapter fine-tunes on three families: a decoder, an encoder-decoder and a mixture of experts
#: (its experts one fused parameter, which bitsandbytes leaves unquantized), each LoRA over its fp32 base
#: and QLoRA over its 4-bit one. Named "<base>+lora" and "<base>+qlora".
_ADAPTER_TARGETS = {
    "qwen2": ["q_proj", "v_proj", "up_proj", "down_proj"],
    "t5": ["q", "v", "wi", "wo"],
    "mixtral": ["q_proj", "v_proj"],
}
ADAPTED: dict[str, tuple[Callable[[], nn.Module], str]] = {
    f"{base}+{kind}": (_adapted(base, targets, kind == "qlora"), MODELS[base][1])
    for base, targets in _ADAPTER_TARGETS.items()
    for kind in ("lora", "qlora")
}
ZOO = MODELS | FAMILIES | ADAPTED


def zoo_batch(name: str, batch_size: int = BATCH, seq_len: int = SEQ, seed: int = 0) -> dict:
    """One batch for model ``name``, as its collator would give it (a dict of tensors)."""
    g = torch.Generator().manual_seed(seed)
    kind = ZOO[name][1]
    if kind in ("image", "cnn"):
        pixels = torch.randn(batch_size, 3, 32, 32, generator=g)
        labels = torch.randint(0, 10, (batch_size,), generator=g)
        return {"pixel_values": pixels, "labels": labels}
    if kind == "speech":  # the encoder's frames are fixed by the config (2 x max_source_positions)
        features = torch.randn(batch_size, MEL_BINS, 2 * SEQ, generator=g)
        return {
            "input_features": features,
            "labels": torch.randint(3, VOCAB, (batch_size, seq_len // 2), generator=g),
        }
    ids = torch.randint(1, VOCAB, (batch_size, seq_len), generator=g)
    if kind == "sequence":
        return {"input_ids": ids, "labels": torch.randint(0, VOCAB, (batch_size, seq_len), generator=g)}
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    if kind == "mlm":
        masked = torch.rand(batch_size, seq_len, generator=g) < 0.15
        batch["labels"] = torch.where(masked, ids, torch.full_like(ids, -100))
    if kind == "seq2seq":
        batch["labels"] = torch.randint(1, VOCAB, (batch_size, seq_len // 2), generator=g)
    return batch


class _Batches(Dataset):
    def __init__(self, name: str, n: int, batch_size: int, seq_len: int) -> None:
        self.batches = [zoo_batch(name, batch_size, seq_len, seed=i) for i in range(n)]

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i: int) -> dict:
        return self.batches[i]


class ZooModule(pl.LightningModule):
    """A LightningModule over zoo model ``name``: its own loss (Hugging Face's ``labels=``), AdamW; a
    "compiled" model is compiled in ``configure_model``, as Lightning's docs show."""

    def __init__(self, name: str, batch_size: int = BATCH, seq_len: int = SEQ, n_batches: int = 4) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        factory, self.kind = ZOO[name]
        self.model = factory()

    def configure_model(self) -> None:
        if self.kind == "compiled" and not hasattr(self.model, "_orig_mod"):  # once, as Lightning asks
            self.model = torch.compile(self.model)

    def forward(self, batch: dict) -> torch.Tensor:
        if self.kind == "cnn":
            return nn.functional.cross_entropy(self.model(batch["pixel_values"]), batch["labels"])
        if self.kind == "sequence":
            return lm_loss(self.model(batch["input_ids"]), batch["labels"])
        return self.model(**batch).loss

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        return self(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        h = self.hparams
        data = _Batches(h.name, h.n_batches, h.batch_size, h.seq_len)
        return DataLoader(data, batch_size=None)  # each item is already a batch


class ChunkedLossModule(ZooModule):
    """A zoo causal LM whose step computes the loss itself, `chunked_cross_entropy` over the base model's
    last hidden states and the output head: the Hugging Face model is unchanged, its logits never built."""

    def forward(self, batch: dict) -> torch.Tensor:
        from lightning_memkit import chunked_cross_entropy

        ids, labels = batch["input_ids"], batch["labels"]
        hidden = self.model.base_model(input_ids=ids, attention_mask=batch["attention_mask"])[0]
        head = self.model.get_output_embeddings()
        return chunked_cross_entropy(hidden[:, :-1], head, labels[:, 1:], chunks=8)
