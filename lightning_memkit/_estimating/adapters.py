"""An adapter fine-tune set up as users set it up: a base quantized as transformers' ``BitsAndBytesConfig``
does it in ``from_pretrained``, then ``peft``'s LoRA over it, so that a plan for "LLaMA-2-70B with QLoRA on
two 24 GB cards" is made on the model the user would train, built on the meta device (never materialised).

`AdapterSetup` is the one value ``memkit plan``/``estimate``'s ``--lora``, ``--lora-targets`` and
``--quantize`` become; `apply_adapters` builds it on a model, `adapter_code` prints it as the lines a user
pastes. This module imports torch, bitsandbytes, peft and transformers only inside the functions that build:
the CLI reads `QUANTIZATIONS` before anything heavy is imported.

The order is the one users follow: quantize the base first (every ``nn.Linear`` but the output head, as
transformers' ``replace_with_bnb_linear`` with ``get_keys_to_not_convert`` leaves the head), then
``peft.get_peft_model`` over it, which freezes everything but the adapters. The optimizer is then built
over the trainable parameters only (the adapters). peft's ``prepare_model_for_kbit_training`` is left out:
it upcasts every non-quantized weight to fp32 and turns Hugging Face's own checkpointing on, where the plan
decides checkpointing itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: ``--quantize``: the base's linear layers as bitsandbytes keeps them (``none``: as the model builds them).
QUANTIZATIONS = ("nf4", "fp4", "int8", "none")

#: The linear layers of every block, by family, where the default is all of them (the QLoRA paper's recipe,
#: torchtune's QLoRA one): Hugging Face's LLaMA family and the GPT demo's presets.
_BLOCK_LINEARS = {
    "llama": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    "gpt": ("c_attn", "c_proj", "c_fc", "c_gate"),
}


@dataclass(frozen=True)
class AdapterSetup:
    """LoRA adapters of ``rank`` on the modules ``targets`` names (``None``: the family's default,
    `default_targets`) over a base whose linear layers are ``quantize``\\ d (`QUANTIZATIONS`). With
    ``sharded``, a 4-bit base stores its packed weights in bf16 (``bnb_4bit_quant_storage``), as the
    FSDP+QLoRA recipe does so that FSDP shards them with the rest: the same bytes."""

    rank: int
    targets: tuple[str, ...] | str | None = None  # str: "all-linear"
    quantize: str = "none"
    sharded: bool = False

    @property
    def name(self) -> str:
        """``QLoRA (nf4)``, ``LoRA over int8``, ``LoRA``: how the set-up is called."""
        if self.quantize in ("nf4", "fp4"):
            return f"QLoRA ({self.quantize})"
        return "LoRA" if self.quantize == "none" else f"LoRA over {self.quantize}"

    def bnb_config(self) -> dict[str, Any]:
        """``BitsAndBytesConfig``'s keywords for the base (empty: not quantized): 4-bit with double
        quantization and bf16 compute (the QLoRA paper's), 8-bit with its defaults (outlier threshold 6)."""
        import torch

        if self.quantize == "int8":
            return {"load_in_8bit": True}
        if self.quantize == "none":
            return {}
        storage = {"bnb_4bit_quant_storage": torch.bfloat16} if self.sharded else {}
        return {
            "load_in_4bit": True,
            "bnb_4bit_quant_type": self.quantize,
            "bnb_4bit_use_double_quant": True,
            "bnb_4bit_compute_dtype": torch.bfloat16,
            **storage,
        }


def targets_text(targets: tuple[str, ...] | str) -> str:
    """``--lora-targets``' spelling of ``targets``: ``q_proj,v_proj`` or ``all-linear``."""
    return targets if isinstance(targets, str) else ",".join(targets)


def default_targets(model: Any) -> tuple[str, ...] | str:
    """The modules LoRA adapts by default: every block linear of a LLaMA-family or GPT-demo model (the
    QLoRA paper's all-linear recipe); otherwise peft's own default for the Hugging Face family
    (``TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING``), else ``"all-linear"`` (every linear layer
    but the output head)."""
    from torch import nn

    leaves = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    for family in _BLOCK_LINEARS.values():
        present = tuple(t for t in family if t in leaves)
        if {"q_proj", "c_attn"} & set(present) and len(present) >= 3:
            return present
    model_type = getattr(getattr(_hf(model), "config", None), "model_type", None)
    from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as PEFT_DEFAULTS

    return tuple(PEFT_DEFAULTS.get(model_type, ())) or "all-linear"


def _hf(model: Any) -> Any:
    """The Hugging Face ``PreTrainedModel`` ``model`` is or holds, else ``None``."""
    import sys

    if "transformers" not in sys.modules:
        return None
    from transformers import PreTrainedModel

    return next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)


def head_names(model: Any) -> list[str]:
    """The modules left unquantized, as transformers leaves them: a Hugging Face model's output
    embeddings, tied weights and last module (``get_keys_to_not_convert``); any other model's ``lm_head``
    and its last linear layer."""
    from torch import nn

    hf = _hf(model)
    if hf is model:
        from transformers.quantizers.base import get_keys_to_not_convert

        return get_keys_to_not_convert(model)
    linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    return sorted({*(n for n in linears if n.rsplit(".", 1)[-1] == "lm_head"), *linears[-1:]})


def quantize_base(model: Any, setup: AdapterSetup) -> list[str]:
    """Every ``nn.Linear`` of ``model`` but its head (`head_names`) replaced by bitsandbytes' layer as
    transformers' ``replace_with_bnb_linear`` builds it from ``setup.bnb_config()``, frozen, on the meta
    device, each 4-bit weight then quantized there (`_quantized_on_meta`; bitsandbytes would quantize it as
    it moves to the GPU). Returns the modules left unquantized."""
    from transformers import BitsAndBytesConfig
    from transformers.integrations.bitsandbytes import replace_with_bnb_linear

    keep = head_names(model)
    replace_with_bnb_linear(model, modules_to_not_convert=keep, quantization_config=BitsAndBytesConfig(
        **setup.bnb_config()
    ))  # fmt: skip
    for module in model.modules():
        if type(module).__name__ == "Linear4bit" and module.weight.device.type == "meta":
            module.weight = _quantized_on_meta(module)
            module.quant_state = module.weight.quant_state  # as bitsandbytes' quantization sets it
    return keep


def _quantized_on_meta(layer: Any) -> Any:
    """``layer``'s 4-bit weight quantized on the meta device by bitsandbytes' own ``quantize_4bit`` (its
    fake kernels size the packed data, the absmax and the nested state), as moving it to a GPU would: so
    that FSDP2's sharding, which the simulation applies before the step, shards the 4-bit weight and its
    state as it would shard the real one. Only the double quantization's 256-value code table is built
    from Python floats, for real, once (bitsandbytes caches it)."""
    import bitsandbytes as bnb

    weight = layer.weight
    if weight.compress_statistics:
        bnb.functional.name2qmap.setdefault("dynamic", bnb.functional.create_dynamic_map())
    data, state = bnb.functional.quantize_4bit(
        weight.data.to(layer.compute_dtype or weight.dtype),
        blocksize=weight.blocksize,
        compress_statistics=weight.compress_statistics,
        quant_type=weight.quant_type,
        quant_storage=weight.quant_storage,
    )
    return bnb.nn.Params4bit(
        data, requires_grad=False, quant_state=state, blocksize=weight.blocksize,
        compress_statistics=weight.compress_statistics, quant_type=weight.quant_type,
        quant_storage=weight.quant_storage, module=layer, bnb_quantized=True,
    )  # fmt: skip


def lora_config(setup: AdapterSetup, targets: tuple[str, ...] | str) -> Any:
    import peft

    modules = targets if isinstance(targets, str) else list(targets)
    return peft.LoraConfig(r=setup.rank, target_modules=modules)


def apply_adapters(model: Any, setup: AdapterSetup) -> tuple[Any, tuple[str, ...] | str]:
    """``model`` quantized (`quantize_base`) and given LoRA adapters, on the meta device: a plain module
    comes back as ``peft.get_peft_model``'s ``PeftModel``; a LightningModule keeps its class, its ``.model``
    (the GPT demo's) wrapped so, or, without one, the adapters injected in place
    (``peft.inject_adapter_in_model``). Returns the model and the targets used. Raises ``ValueError`` when
    a target is not in the model, naming the linear layers there are."""
    import peft
    import torch
    from lightning.pytorch import LightningModule

    inner = model.model if isinstance(model, LightningModule) and hasattr(model, "model") else model
    targets = setup.targets or default_targets(inner)
    if setup.quantize != "none":
        quantize_base(inner, setup)
    config = lora_config(setup, targets)
    try:
        with torch.device("meta"):
            if inner is not model:
                model.model = peft.get_peft_model(inner, config)
            elif isinstance(model, LightningModule):
                peft.inject_adapter_in_model(config, model)
                for name, p in model.named_parameters():
                    p.requires_grad_("lora_" in name)
            else:
                model = peft.get_peft_model(model, config)
    except ValueError as e:
        if "not found in the base model" not in str(e):
            raise
        raise ValueError(
            f"--lora-targets {targets_text(targets)}: not in the model ({e}); its linear layers are named "
            f"{', '.join(linear_names(inner))}"
        ) from None
    return model, targets


def linear_names(model: Any) -> list[str]:
    """The distinct last names of ``model``'s linear layers (bitsandbytes' included), in order."""
    from torch import nn

    names: dict[str, None] = {}
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear) and name:
            names.setdefault(name.rsplit(".", 1)[-1], None)
    return list(names)


def adapter_summary(model: Any, setup: AdapterSetup, targets: tuple[str, ...] | str) -> str:
    """One line: what trains (the adapters, in parameters and bytes) and how the frozen base is kept."""
    from lightning_memkit._breakdown import format_bytes

    trainable = [p for p in model.parameters() if p.requires_grad]
    n, size = sum(p.numel() for p in trainable), sum(p.numel() * p.element_size() for p in trainable)
    where = targets_text(targets)
    base = {"none": "as built", "int8": "int8 (bitsandbytes Linear8bitLt, outlier threshold 6)"}.get(
        setup.quantize,
        f"{setup.quantize}, double quantization, bf16 compute (bitsandbytes Linear4bit"
        f"{', bf16 storage' if setup.sharded else ''})",
    )
    return (
        f"adapters: {setup.name}, r={setup.rank} on {where}: {n:,} trainable parameters "
        f"({format_bytes(size)}), the optimizer over these only; the base frozen, its linear layers but "
        f"the head {base}"
    )


def adapter_code(setup: AdapterSetup, targets: tuple[str, ...] | str, *, hf: bool, lightning: bool) -> str:
    """The set-up as Python a user pastes, before the Trainer's lines: a Hugging Face model loaded with its
    ``BitsAndBytesConfig`` and wrapped by ``peft.get_peft_model``; any other model's LoRA as peft adds it
    (a quantized base of another kind: bitsandbytes' layers by transformers' ``replace_with_bnb_linear``)."""
    config = setup.bnb_config()
    names = (["AutoModelForCausalLM"] if hf else []) + (["BitsAndBytesConfig"] if config else [])
    lines = [
        "import peft",
        *(["import torch"] if "bnb_4bit_compute_dtype" in config else []),
        *([f"from transformers import {', '.join(names)}"] if names else []),
        "",
    ]
    if config:
        arguments = [f"    {k}={_python(v)}," for k, v in config.items()]
        lines += ["quantization = BitsAndBytesConfig(", *arguments, ")"]
    target = list(targets) if isinstance(targets, tuple) else targets
    lines.append(f"lora = peft.LoraConfig(r={setup.rank}, target_modules={target!r})")
    if hf:
        load = ", quantization_config=quantization" if config else ""
        lines += [
            f'model = AutoModelForCausalLM.from_pretrained("<your checkpoint>"{load})',
            "model = peft.get_peft_model(model, lora)  # only the adapters train",
        ]
    else:
        if config:
            lines += [
                "# the linear layers but the head as bitsandbytes layers, as from_pretrained makes them (on",
                "# the meta device: load the weights after; bitsandbytes quantizes them on the GPU)",
                "from transformers.integrations.bitsandbytes import replace_with_bnb_linear",
                "model = replace_with_bnb_linear(",
                "    model, modules_to_not_convert=['lm_head'], quantization_config=quantization",
                ")",
            ]
        model = "self.model" if lightning else "model"
        lines.append(f"{model} = peft.get_peft_model({model}, lora)  # only the adapters train")
    lines.append("# configure_optimizers: the optimizer over the adapters, p.requires_grad")
    return "\n".join(lines)


def _python(value: Any) -> str:
    import torch

    return f"torch.{str(value).removeprefix('torch.')}" if isinstance(value, torch.dtype) else repr(value)
