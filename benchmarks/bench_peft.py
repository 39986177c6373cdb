"""Adapter fine-tunes against the allocator: LoRA over an fp32 base, QLoRA over bitsandbytes' 4-bit base
(nf4 and fp4, with and without double quantization, uint8 and bf16 storage) and LoRA over its 8-bit base
(tests/peft_models.py: a tiny random LLaMA, LoRA r=8 on q/v/up/down, AdamW on the adapters, 4 x 64 tokens),
and LoRA over torchao's int8 and int4 weight-only bases where torchao is installed
(tests/estimating/test_peft_torchao.py: the same LLaMA quantized by ``quantize_``).

For each set-up, on the CPU, with the CPU allocator's own count as the truth (`counting_allocator`,
installed before any model is built):

- allocator: the highest of 3 Trainer steps (bytes);
- monitor: the largest error of `MemoryMonitor` over those steps;
- estimate: `estimate_memory` of the model with its real quantized weights, against the steady steps;
- meta: `estimate_memory` of the same model built on the meta device (quantized from the shapes);
  an estimate that fails shows the first words of its error;
- trainable / frozen: the monitor's split of the parameters (bytes).

    python benchmarks/bench_peft.py               # every set-up; prints a Markdown table (docs/peft.md's)
    python benchmarks/bench_peft.py qlora-nf4 lora-int8@bf16-true    # some, at a precision
    python benchmarks/bench_peft.py lora-torchao-int8 lora-torchao-int4 lora-torchao-int8@bf16-true
"""

from __future__ import annotations

import logging
import sys
import tempfile
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "estimating"))  # its test modules
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # helpers, models
from helpers import cpu_trainer
from peft_models import SETUPS, AdapterModule, token_batch

from lightning_memkit import MemoryMonitor, estimate_memory
from lightning_memkit.testing import AllocatorPeaks, counting_allocator

STEPS = 3


#: Lightning's 16-bit precisions over a quantized base, after every set-up at 32-true.
PRECISIONS = ["qlora-nf4-double-bf16@bf16-mixed", "lora-int8@bf16-true"]


def _estimate(module: AdapterModule, precision: str) -> int | str:
    """`estimate_memory`'s peak, or the first words of its error."""
    try:
        return estimate_memory(module, token_batch(), device="cpu", precision=precision).peak
    except Exception as error:
        return f"{type(error).__name__}: {str(error)[:60]}"


def _error(value: int | str, truth: int) -> str:
    return value if isinstance(value, str) else f"{100 * (value - truth) / truth:+.3f} %"


def _torchao_setups() -> list[str]:
    """The torchao set-ups (tests/estimating/test_peft_torchao.py), at 32-true and the int8 one at bf16-true;
    none without torchao."""
    try:
        import torchao  # noqa: F401
    except ImportError:
        return []
    from test_peft_torchao import TORCHAO_SETUPS

    return [*TORCHAO_SETUPS, "lora-torchao-int8@bf16-true"]


def _module(setup: str, device: str = "cpu") -> AdapterModule:
    if setup.startswith("lora-torchao-"):
        from test_peft_torchao import TorchaoModule

        return TorchaoModule(setup, device=device)
    return AdapterModule(setup, device=device)


def row(name: str) -> str:
    """``name``: a set-up, at ``@precision`` (default 32-true)."""
    setup, _, precision = name.partition("@")
    precision = precision or "32-true"
    module = _module(setup)
    estimate = _estimate(module, precision)
    meta = _estimate(_module(setup, device="meta"), precision)
    peaks, monitor = AllocatorPeaks(all_threads=True), MemoryMonitor(plot=False, summary=False)
    with tempfile.TemporaryDirectory() as root:
        cpu_trainer(root, peaks.around(monitor), max_steps=STEPS, precision=precision).fit(module)
    monitor_error = max(
        ((b.peak - truth) / truth for (_, b), truth in zip(monitor.history, peaks.peaks, strict=True)),
        key=abs,
    )
    steady = max(peaks.peaks[1:])
    _, last = monitor.history[-1]
    trainable = sum(p.untyped_storage().nbytes() for p in module.parameters() if p.requires_grad)
    return (
        f"| {setup} | {precision} | {max(peaks.peaks):,} | {100 * monitor_error:+.3f} % | "
        f"{_error(estimate, steady)} | {_error(meta, steady)} | "
        f"{trainable:,} | {last.parameters - trainable:,} |"
    )


def main(names: list[str]) -> None:
    counting_allocator()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    columns = ["set-up", "precision", "allocator (B)", "monitor", "estimate", "estimate, meta"]
    print("| " + " | ".join([*columns, "trainable (B)", "frozen (B)"]) + " |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for name in names or [*SETUPS, *PRECISIONS, *_torchao_setups()]:
        print(row(name), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
