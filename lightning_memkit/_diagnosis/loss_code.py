"""The chunked loss, written as code for the model at hand: the fix `advise`'s logits finding gives
(`lightning_memkit.chunked_cross_entropy` over slices of the tokens instead of the whole vocabulary's logits
at once), in the words of a Hugging Face causal LM where the model is one."""

from __future__ import annotations

import sys

from lightning.pytorch import LightningModule
from torch import nn

__all__ = ["LOSS_CHUNKS", "causal_lm", "chunked_loss_code"]

#: Slices of the tokens the chunked loss is priced at.
LOSS_CHUNKS = 8


def chunked_loss_code(model: nn.Module, head: str | None) -> str:
    """The chunked loss as code: for a Hugging Face causal LM (``model`` or one of its modules) the loss it
    computes itself, its labels shifted as it shifts them (position t predicts token t + 1), the head named
    by ``get_output_embeddings()``; for another model ``head`` over the last hidden states and targets."""
    found = causal_lm(model)
    if found is None:
        return (
            f": loss = lightning_memkit.chunked_cross_entropy(hidden, {head}, targets, chunks={LOSS_CHUNKS}) "
            "from the last hidden states"
        )
    path, lm = found
    transformed = {
        name: value
        for name in ("final_logit_softcapping", "logit_scale")  # Gemma 2/3's soft-cap, Cohere's scale
        if (value := getattr(getattr(lm, "config", None), name, None)) not in (None, 1, 1.0)
    }
    if transformed:  # chunked_cross_entropy takes the head's plain logits: another objective
        said = ", ".join(f"{name}={value}" for name, value in transformed.items())
        return (
            f" (not written here for {type(lm).__name__}: its loss transforms the head's logits first "
            f"({said}), which chunked_cross_entropy does not, so it would train another objective)"
        )
    owner = ("self" if isinstance(model, LightningModule) else "model") + (f".{path}" if path else "")
    return (
        f", from the last hidden states, the labels shifted as {type(lm).__name__} shifts them (position t "
        f'predicts token t + 1): inputs = {{k: v for k, v in batch.items() if k != "labels"}}; '
        f"hidden = {owner}.base_model(**inputs).last_hidden_state; "
        f"loss = lightning_memkit.chunked_cross_entropy(hidden[:, :-1], {owner}.get_output_embeddings(), "
        f'batch["labels"][:, 1:], chunks={LOSS_CHUNKS})'
    )


def causal_lm(model: nn.Module) -> tuple[str, nn.Module] | None:
    """The name and module of the first Hugging Face causal language model in ``model`` (its class one
    transformers maps as ``AutoModelForCausalLM``), which computes its loss from shifted labels."""
    if "transformers" not in sys.modules:  # no Hugging Face model without it imported
        return None
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    names = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()
    causal = {n for v in names for n in ((v,) if isinstance(v, str) else v)}
    return next(((name, m) for name, m in model.named_modules() if type(m).__name__ in causal), None)
