"""One rank of LLaMA-2-70B under FSDP2, tensor parallelism and HSDP, as `estimate_memory(strategy="fsdp2")`
simulates it (fake tensors, a fake process group, this one process).

The step: AdamW, bf16-mixed, sequences of 4096 tokens. Two tables:

- FSDP2 over 8, 16, 32 and 64 GPUs (the ``llama-70b`` preset of the demo GPT, one sequence a rank, every
  decoder layer fully checkpointed), beside DeepSpeed's ZeRO-3 model-states formula
  (``estimate_zero3_model_states_mem_needs``: 18 bytes a parameter divided over the ranks, plus the largest
  layer's 4 bytes a parameter, here a decoder layer). Sharding moves bytes, it does not remove them: the
  formula divides the model states and stops there; the simulated rank also holds the root's unsharded
  embedding and head, a layer's unsharded weights and gradients in flight, autocast's copies and the
  activations, none of which shrinks with more ranks.
- 64 GPUs laid out three ways, beside torchtitan's published LLaMA-2-70B runs on 64 A100-80GB under
  FSDP2 (its docs/performance.md): FSDP2 over all 64 (the demo GPT and a Hugging Face ``LlamaForCausalLM``
  of the same shapes), tensor parallel 8 x FSDP2 8 and HSDP 8 x 8 (the Hugging Face model: the demo GPT
  computes query, key and value in one matmul and views a fixed head count, so it cannot be split by
  heads). torchtitan's "selective op" checkpointing is ``selective_half`` (every second matmul recomputed).

Each simulation is timed from cold DTensor caches, as a process's first estimate is: DTensor computes
each op's output shape once per signature and caches it, and the simulation sees that first computation
(docs/sharded.md, "Tensor parallel and HSDP"). The tensor-parallel cells give the same estimate again,
with the caches warm.

    python benchmarks/bench_70b_sharded.py
"""

import math
import time

import lightning.pytorch as pl
import torch

from lightning_memkit import Sharding, estimate_memory
from lightning_memkit._breakdown import GiB, MemoryBreakdown
from lightning_memkit._budget import parse_budget
from lightning_memkit._estimating.analytic import PRESETS, _block_shapes, count_parameters
from lightning_memkit.demos.gpt import GPTLightningModule

SEQ = 4096
#: torchtitan's LLaMA-2-70B runs on 64 A100-80GB, FSDP2 (docs/performance.md): local batch, checkpointing
#: (torchtitan's "selective op" is our ``selective_half``), what happened.
TORCHTITAN = ((2, "full", "ran"), (2, "selective_half", "out of memory"), (1, "selective_half", "ran"))
#: The 64-GPU layouts: estimate_memory's keywords.
LAYOUTS = {
    "FSDP2 64": {},
    "TP 8 x FSDP2 8": {"tensor_parallel_size": 8},
    "HSDP 8 x 8": {"replicate_size": 8},
}
A100 = parse_budget("A100-80GB")  # the card less the CUDA context and a 5 % fragmentation reserve


class HFLlama70B(pl.LightningModule):
    """LLaMA-2-70B as Hugging Face builds it (its published config; nothing downloaded), on the device the
    caller chooses (meta here), trained as a causal LM with AdamW."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=32000, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
            num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=SEQ, rms_norm_eps=1e-5,
            use_cache=False,
        )  # fmt: skip
        self.model = LlamaForCausalLM(config)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch  # (B, T) token ids; the model shifts the labels itself
        return self.model(input_ids=x, labels=y).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1.5e-4)


def zero3_model_states(world: int) -> float:
    """DeepSpeed's ZeRO-3 per-GPU model states (no offload), in GiB."""
    shape = PRESETS["llama-70b"]
    layer = sum(math.prod(s) for s in _block_shapes(shape))  # one decoder layer: 855,654,400 parameters
    return (4 * layer + 18 * count_parameters(shape) / world) / GiB


def cold_dtensor_caches() -> None:
    """DTensor's caches of each op's sharding and output shape emptied, as in a fresh process."""
    from torch.distributed.tensor import DTensor

    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()
    propagator._propagate_tensor_meta_cached.cache_clear()


def simulate(
    model: pl.LightningModule, batch: int, *, checkpointing: str, world_size: int, **layout
) -> tuple[MemoryBreakdown, float]:
    """One rank's step (``batch`` sequences a rank) under `Sharding` ``layout`` over ``world_size`` ranks,
    and the seconds it took to simulate."""
    x = torch.zeros(batch, SEQ, dtype=torch.long, device="meta")
    start = time.perf_counter()
    sharding = Sharding(world_size, **layout)
    b = estimate_memory(model, (x, x), precision="bf16-mixed", checkpointing=checkpointing, sharding=sharding)
    return b, time.perf_counter() - start


def per_world(gpt: pl.LightningModule) -> None:
    print(
        f"LLaMA-2-70B (demo GPT), AdamW, bf16-mixed, 1 x {SEQ} tokens a rank, full checkpointing; GiB a rank"
    )
    print(
        "| GPUs | simulated peak | parameters | gradients | optimizer state | activations | temporary "
        "| ZeRO-3 model states (formula) | simulated in |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for world in (8, 16, 32, 64):
        b, seconds = simulate(gpt, 1, checkpointing="full", world_size=world)
        cells = [b.peak, b.parameters, b.gradients, b.optimizer_state, b.activations, b.temporary]
        print(f"| {world} | " + " | ".join(f"{c / GiB:,.1f}" for c in cells)
              + f" | {zero3_model_states(world):,.1f} | {seconds:.0f} s |")  # fmt: skip


def cell(b: MemoryBreakdown, seconds: float, again: tuple[MemoryBreakdown, float] | None = None) -> str:
    fits = "fits" if b.peak <= A100.usable else "over"
    timed = f"{seconds:.0f} s"
    if again is not None:  # the same estimate, DTensor's caches warm
        same = "same bytes" if again[0].peak == b.peak else f"{again[0].peak - b.peak:+,} B"
        timed += f" ({again[1]:.0f} s again, {same})"
    return f"{b.peak / GiB:.1f} ({fits}), {timed}"


def layouts(gpt: pl.LightningModule, llama: pl.LightningModule) -> None:
    print(
        f"\nLLaMA-2-70B on 64 GPUs, AdamW, bf16-mixed, {SEQ} tokens a sequence; one rank's simulated peak "
        f"(GiB; fits: within A100-80GB's {A100.usable / GiB:.1f} GiB) and the time to simulate it"
    )
    header = ["local batch, checkpointing", "torchtitan, 64 A100-80GB, FSDP2", "FSDP2 64 (demo GPT)",
              *(f"{name} (HF LLaMA)" for name in LAYOUTS)]  # fmt: skip
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for batch, checkpointing, outcome in ((1, "full", "—"), *TORCHTITAN):
        row = [f"{batch}, {checkpointing}", outcome]
        cold_dtensor_caches()
        row.append(cell(*simulate(gpt, batch, checkpointing=checkpointing, world_size=64)))
        for keywords in LAYOUTS.values():
            cold_dtensor_caches()
            b, seconds = simulate(llama, batch, checkpointing=checkpointing, world_size=64, **keywords)
            again = None
            if "tensor_parallel_size" in keywords:
                again = simulate(llama, batch, checkpointing=checkpointing, world_size=64, **keywords)
            row.append(cell(b, seconds, again))
        print("| " + " | ".join(row) + " |", flush=True)


def main() -> None:
    with torch.device("meta"):
        gpt, llama = GPTLightningModule("llama-70b"), HFLlama70B()
    per_world(gpt)
    layouts(gpt, llama)


if __name__ == "__main__":
    main()
