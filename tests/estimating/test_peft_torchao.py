"""LoRA over a torchao quantized base against the CPU allocator's own count (issue 45 item 1's torchao base):
the tiny LLaMA of tests/peft_models.py, every linear layer but the head quantized by torchao's ``quantize_``,
LoRA r=8 on q/v/up/down, AdamW on the adapters, 4 x 64 tokens. The monitor on every Trainer step,
`estimate_memory` on the model with its real quantized weights and on its twin built (and quantized by
torchao) on the meta device.

torchao's weights are traceable wrapper subclasses (``Int8Tensor``, ``IntxUnpackedToInt8Tensor``) whose memory
is their inner tensors (int8 ``qdata``, ``scale``, ``zero_point``). Set-ups, as torchao documents them:

- ``lora-torchao-int8``: ``Int8WeightOnlyConfig()`` (int8 weights, one fp32 scale a row);
- ``lora-torchao-int4``: ``IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32))``, 4-bit
  values kept one a byte with a scale and zero point per group of 32: the int4 weight-only layout that runs
  on the CPU. ``Int4WeightOnlyConfig`` does not with torchao 0.18: its default (plain) and preshuffled
  packings need the ``mslk`` kernels, its tile-packed one CUDA, its plain-int32 one XPU or NPU.

The truth is `counting_allocator`'s, installed in this process before any model is built."""

from __future__ import annotations

import csv

import pytest
import torch
from helpers import cpu_trainer
from peft_models import TARGETS, AdapterModule, llama, token_batch
from torch import nn

from lightning_memkit import MemoryMonitor, estimate_memory
from lightning_memkit._measuring.storages import model_tensors, storage_bytes
from lightning_memkit.testing import AllocatorPeaks, counting_allocator

peft = pytest.importorskip("peft")
pytest.importorskip("torchao")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")

STEPS = 3


def _config(setup: str):
    """torchao's quantization config of ``setup`` (imported here: torchao is optional)."""
    from torchao.quantization import Int8WeightOnlyConfig, IntxWeightOnlyConfig
    from torchao.quantization.granularity import PerGroup

    if setup == "lora-torchao-int8":
        return Int8WeightOnlyConfig()
    if setup == "lora-torchao-int4":
        return IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32))
    raise KeyError(setup)


#: The torchao set-ups (`_config`).
TORCHAO_SETUPS = ("lora-torchao-int8", "lora-torchao-int4")


def torchao_model(setup: str, device: str = "cpu") -> nn.Module:
    """The tiny LLaMA on ``device``, every ``nn.Linear`` but the head quantized by torchao's ``quantize_``
    (``"meta"``: torchao quantizes the meta weights, from their shapes), LoRA adapters over it."""
    from torchao.quantization import quantize_

    model = llama(device)
    quantize_(
        model, _config(setup), filter_fn=lambda m, fqn: isinstance(m, nn.Linear) and "lm_head" not in fqn
    )
    with torch.device(device):
        return peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS))


class TorchaoModule(AdapterModule):
    """`AdapterModule` over ``setup``'s torchao base (`torchao_model`)."""

    def __init__(self, setup: str, device: str = "cpu", batch_size: int = 4, n_batches: int = 4) -> None:
        super(AdapterModule, self).__init__()
        self.model = torchao_model(setup, device)
        self.batch_size, self.n_batches = batch_size, n_batches


@pytest.fixture(scope="module", autouse=True)
def counted():
    """The CPU allocator's count of every allocation, from before the first model of this file is built."""
    counting_allocator()


def _split(module: nn.Module) -> tuple[int, int]:
    trainable = storage_bytes(p for p in module.parameters() if p.requires_grad)
    return trainable, storage_bytes(model_tensors(module)) - trainable


@pytest.mark.parametrize(
    ("setup", "precision"),
    [
        pytest.param("lora-torchao-int8", "32-true"),
        pytest.param("lora-torchao-int4", "32-true", marks=pytest.mark.slow),
        pytest.param("lora-torchao-int8", "bf16-true", marks=pytest.mark.slow),
    ],
)
def test_monitor_and_estimate_match_the_allocator(setup, precision, tmp_path, one_thread):
    """The monitor within 0.1 % of the allocator on every step, its parameters the module's tensors (a
    quantized weight by its inner tensors: int8 data, scales, zero points), split into the adapters and the
    frozen base; `estimate_memory` within 1 % of the steady steps, with the same parameters, and its
    meta-device twin to the byte."""
    module = TorchaoModule(setup)
    weight = module.model.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight
    assert type(weight).__module__.startswith("torchao.")  # quantized, as this test means
    estimate = estimate_memory(module, token_batch(), device="cpu", precision=precision)
    meta = TorchaoModule(setup, device="meta")
    from_meta = estimate_memory(meta, token_batch(), device="cpu", precision=precision)
    peaks, monitor = AllocatorPeaks(all_threads=True), MemoryMonitor(plot=False, summary=False)
    trainer = cpu_trainer(
        tmp_path, peaks.around(monitor), max_steps=STEPS, log_every_n_steps=1, precision=precision
    )
    trainer.fit(module)

    assert len(monitor.history) == len(peaks.peaks) == STEPS
    trainable, frozen = _split(module)
    inner = [getattr(weight, n) for n in weight.__tensor_flatten__()[0] if getattr(weight, n) is not None]
    assert storage_bytes([weight]) == storage_bytes(inner) < 4 * weight.numel()  # its int8 data and scales
    measured = [breakdown for _, breakdown in monitor.history]
    errors = [(m.peak - truth) / truth for m, truth in zip(measured, peaks.peaks, strict=True)]
    assert max(map(abs, errors)) < 1e-3, errors  # every step
    assert {m.parameters for m in measured} == {trainable + frozen}
    assert max(m.gradients for m in measured) <= trainable < measured[-1].optimizer_state / 2  # AdamW's
    with open(next(tmp_path.rglob("metrics.csv"))) as f:
        last = [row for row in csv.DictReader(f) if row.get("memory/peak")][-1]
    split = (float(last["memory/trainable_parameters"]), float(last["memory/frozen_parameters"]))
    assert split == pytest.approx((trainable / 2**20, frozen / 2**20))

    assert estimate.peak == pytest.approx(max(peaks.peaks[1:]), rel=0.01)
    assert estimate.parameters == trainable + frozen
    assert from_meta == estimate


def test_a_torchao_weight_that_cannot_be_faked_is_refused(monkeypatch):
    """A torchao subclass that cannot be rebuilt over fake tensors is refused with its reason, not simulated
    as a plain fp32 weight of its shape (what the estimate did before: -1.34 % on the int8 base)."""
    from torchao.quantization import Int8Tensor, Int8WeightOnlyConfig, quantize_

    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 1))
    quantize_(model, Int8WeightOnlyConfig(), filter_fn=lambda m, fqn: fqn == "0")

    def unbuildable(cls, *args):
        raise RuntimeError("no fake kernel")

    monkeypatch.setattr(Int8Tensor, "__tensor_unflatten__", classmethod(unbuildable))
    x = torch.randn(4, 64)
    with pytest.raises(NotImplementedError, match=r"cannot simulate torchao's Int8Tensor.*no fake kernel"):
        estimate_memory(model, x, loss_fn=lambda out, _: out.sum(), optimizer="adamw", device="cpu")
