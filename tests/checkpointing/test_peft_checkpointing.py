"""Checkpointing an adapter fine-tune keeps the adapters' gradients (issue 45 item 3).

The classic trap: reentrant checkpointing (``use_reentrant=True``, what ``gradient_checkpointing_enable()``
once defaulted to) over a block whose inputs need no gradient (the embeddings of a frozen base) returns
outputs that need none either, so the adapters inside the block get no gradient at all. The project's
checkpointing is non-reentrant and keeps the RNG, so every mode must give the adapters the very gradients
of the run without it: bit for bit, dropout included (T5's), on LoRA over an fp32 base and QLoRA over a
4-bit one.
"""

from __future__ import annotations

import pytest
import torch
from zoo import ZooModule, zoo_batch

from lightning_memkit import apply_checkpointing
from lightning_memkit._checkpointing.blocks import find_blocks

pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


def _adapter_gradients(name: str, mode: str) -> dict[str, torch.Tensor]:
    """The adapters' gradients of one training step of zoo model ``name`` with ``mode`` on every block."""
    module = ZooModule(name)  # seeded: the same weights every time
    _trained_adapters(module)
    for part in module.modules():  # as checkpointing turns it off: the same computation either way
        if getattr(getattr(part, "config", None), "use_cache", False):
            part.config.use_cache = False
    module.train()
    handle = apply_checkpointing(module.model, mode) if mode != "none" else None
    try:
        torch.manual_seed(1)  # the same dropout masks
        module(zoo_batch(name)).backward()
    finally:
        if handle is not None:
            handle.remove()
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.requires_grad}


def _trained_adapters(module: torch.nn.Module) -> None:
    """LoRA's B as after some training (peft starts it at zero, which leaves A no gradient), seeded."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)


@pytest.mark.parametrize("name", ["qwen2+lora", pytest.param("t5+qlora", marks=pytest.mark.slow)])
def test_checkpointing_keeps_every_adapters_gradient_bit_for_bit(name):
    plain = _adapter_gradients(name, "none")
    assert plain and all(g.abs().sum() > 0 for g in plain.values())  # every adapter is trained
    assert find_blocks(ZooModule(name).model)  # there are blocks to checkpoint
    for mode in ("full", "selective"):
        checkpointed = _adapter_gradients(name, mode)
        assert checkpointed.keys() == plain.keys()
        for key, grad in plain.items():
            assert torch.equal(checkpointed[key], grad), (mode, key)


def test_reentrant_checkpointing_would_drop_them():
    """The trap itself, so that the test above can fail: a block checkpointed reentrantly, its input from
    the frozen embeddings, gives its adapters no gradient."""
    from torch.utils.checkpoint import checkpoint

    module = ZooModule("qwen2+lora")
    _trained_adapters(module)
    layer = module.model.base_model.model.model.layers[0]
    forward = layer.forward

    def reentrant(hidden, **kwargs):
        return checkpoint(lambda h: forward(h, **kwargs), hidden, use_reentrant=True)

    layer.forward = reentrant
    with pytest.warns(UserWarning, match="requires_grad=True"):
        module(zoo_batch("qwen2+lora")).backward()
    inside = [p.grad for n, p in layer.named_parameters() if p.requires_grad]
    assert inside and all(g is None for g in inside)
