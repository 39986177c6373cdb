"""One rank of LLaMA-2-70B (the ``llama-70b`` preset) under FSDP2 on 8, 16, 32 and 64 GPUs, as
`estimate_memory(strategy="fsdp2")` simulates it (fake tensors, a fake process group, this one process),
beside DeepSpeed's ZeRO-3 model-states formula (``estimate_zero3_model_states_mem_needs``: 18 bytes a
parameter divided over the ranks, plus the largest layer's 4 bytes a parameter, here a decoder layer).

The step: AdamW, bf16-mixed, one sequence of 4096 tokens a rank, every decoder layer fully checkpointed.
Sharding moves bytes, it does not remove them: the formula divides the model states and stops there;
the simulated rank also holds the root's unsharded embedding and head, a layer's unsharded weights and
gradients in flight, autocast's copies and the activations, none of which shrinks with more ranks.

    python benchmarks/bench_70b_sharded.py
"""

import math
import time

import torch

from lightning_memkit import estimate_memory
from lightning_memkit._breakdown import GiB
from lightning_memkit._estimating.analytic import PRESETS, _block_shapes, count_parameters
from lightning_memkit.demos.gpt import GPTLightningModule

SEQ = 4096


def zero3_model_states(world: int) -> float:
    """DeepSpeed's ZeRO-3 per-GPU model states (no offload), in GiB."""
    shape = PRESETS["llama-70b"]
    layer = sum(math.prod(s) for s in _block_shapes(shape))  # one decoder layer: 855,654,400 parameters
    return (4 * layer + 18 * count_parameters(shape) / world) / GiB


def main() -> None:
    with torch.device("meta"):
        model = GPTLightningModule("llama-70b")
    x = torch.zeros(1, SEQ, dtype=torch.long, device="meta")
    print(f"LLaMA-2-70B, AdamW, bf16-mixed, 1 x {SEQ} tokens a rank, full checkpointing; per rank (GiB)")
    print(
        "| GPUs | simulated peak | parameters | gradients | optimizer state | activations | temporary "
        "| ZeRO-3 model states (formula) | simulated in |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for world in (8, 16, 32, 64):
        start = time.perf_counter()
        b = estimate_memory(
            model, (x, x), precision="bf16-mixed", checkpointing="full", strategy="fsdp2", world_size=world
        )
        seconds = time.perf_counter() - start
        cells = [b.peak, b.parameters, b.gradients, b.optimizer_state, b.activations, b.temporary]
        print(f"| {world} | " + " | ".join(f"{c / GiB:,.1f}" for c in cells)
              + f" | {zero3_model_states(world):,.1f} | {seconds:.0f} s |")  # fmt: skip


if __name__ == "__main__":
    main()
