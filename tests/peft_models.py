"""Adapter fine-tunes as users set them up, for the tests and `benchmarks/bench_peft.py`: a tiny random
LLaMA (Hugging Face's, nothing downloaded) whose every ``nn.Linear`` but the head is a bitsandbytes 4-bit or
8-bit layer (quantized as bitsandbytes documents: the fp32 weight loaded into ``Params4bit``/``Int8Params``,
quantized when moved to the CPU) or left in fp32, under ``peft``'s LoRA (r=8 on q/v/up/down), AdamW on the
adapters, batches of 4 x 64 tokens. Built on the meta device too, where bitsandbytes quantizes nothing:
what ``estimate_memory`` plans for a model too large to build."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import nn

#: setup -> how the base's linear layers are quantized (``None``: left in fp32). The 4-bit ones take
#: ``Linear4bit``'s own keywords (its defaults: fp4, double quantization, uint8 storage, no compute dtype);
#: ``dtype`` converts an unquantized base.
SETUPS: dict[str, dict | None] = {
    "lora-fp32": None,
    "lora-bf16": {"dtype": torch.bfloat16},  # the base (and so the adapters, peft's default) in bf16
    "qlora-nf4": {"quant_type": "nf4", "compress_statistics": False},
    "qlora-nf4-double": {"quant_type": "nf4", "compress_statistics": True},
    # the QLoRA paper's recipe: nf4, double quantization, bf16 compute (and storage, as FSDP+QLoRA keeps it)
    "qlora-nf4-double-bf16": {
        "quant_type": "nf4",
        "compress_statistics": True,
        "quant_storage": torch.bfloat16,
        "compute_dtype": torch.bfloat16,
    },
    "qlora-fp4": {"quant_type": "fp4", "compress_statistics": False},
    "qlora-fp4-double-bf16-storage": {
        "quant_type": "fp4",
        "compress_statistics": True,
        "quant_storage": torch.bfloat16,
    },
    "lora-int8": {"int8": True},
}
TARGETS = ["q_proj", "v_proj", "up_proj", "down_proj"]
BATCH, SEQ_LEN, VOCAB = 4, 64, 256


def llama(device: str = "cpu") -> nn.Module:
    """The tiny LLaMA, seeded; on ``device`` (``"meta"``: no memory)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "llama", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config)


def quantized(linear: nn.Linear, options: dict) -> nn.Module:
    """``linear`` as a bitsandbytes layer: its weight loaded and quantized (on the CPU), or on the meta
    device left for bitsandbytes to quantize when moved (never, in a simulation)."""
    import bitsandbytes as bnb

    options = dict(options)
    meta = linear.weight.device.type == "meta"
    sizes = (linear.in_features, linear.out_features)
    bias = linear.bias is not None
    if options.pop("int8", False):
        layer = bnb.nn.Linear8bitLt(
            *sizes, bias=bias, has_fp16_weights=False, device="meta" if meta else None
        )
        if not meta:
            layer.weight = bnb.nn.Int8Params(linear.weight.data, requires_grad=False, has_fp16_weights=False)
    else:
        compute_dtype = options.pop("compute_dtype", torch.float32)
        layer = bnb.nn.Linear4bit(
            *sizes, bias=bias, compute_dtype=compute_dtype, device="meta" if meta else None, **options
        )
        if not meta:
            layer.weight = bnb.nn.Params4bit(linear.weight.data, requires_grad=False, module=layer, **options)
    if bias and not meta:
        layer.bias = linear.bias
    return layer if meta else layer.to("cpu")  # quantized here


def adapter_model(setup: str, device: str = "cpu") -> nn.Module:
    """``setup``'s model (`SETUPS`): the LLaMA, its base quantized, LoRA adapters over it."""
    import peft

    model = llama(device)
    options = SETUPS[setup]
    if options is not None and "dtype" in options:
        model.to(options["dtype"])
    elif options is not None:
        for module in list(model.modules()):
            for name, child in list(module.named_children()):
                if type(child) is nn.Linear and name != "lm_head":
                    setattr(module, name, quantized(child, options))
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS)
    with torch.device(device):
        return peft.get_peft_model(model, config)


def token_batch(batch_size: int = BATCH, seed: int = 0) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (batch_size, SEQ_LEN), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids}


class AdapterModule(pl.LightningModule):
    """``setup``'s adapter model in a LightningModule: the model's own loss, AdamW on the trainable
    parameters, ``n_batches`` batches of ``batch_size`` x 64 tokens."""

    def __init__(self, setup: str, device: str = "cpu", batch_size: int = BATCH, n_batches: int = 4) -> None:
        super().__init__()
        self.model = adapter_model(setup, device)
        self.batch_size, self.n_batches = batch_size, n_batches

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3)

    def train_dataloader(self):
        rows = token_batch(self.batch_size * self.n_batches)["input_ids"]
        return torch.utils.data.DataLoader(
            [{"input_ids": r, "labels": r} for r in rows], batch_size=self.batch_size
        )
