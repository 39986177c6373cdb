"""FSDP2 (torch's ``fully_shard`` under Lightning's ModelParallelStrategy) on 2 and 4 gloo CPU ranks: per
configuration, the worst error over every rank and step of MemoryMonitor against the allocator (the CPU
allocator's own count in every thread, `lightning_memkit.testing.counting_allocator`); each configuration's
step simulated in this process (``estimate_memory(strategy="fsdp2", world_size=N)`` with its keywords,
``memkit estimate --gpus N --strategy fsdp2``), and for the default layout the analytic fallback that
divides the one-device step (`shard(..., "fsdp", N)`), against rank 0's steady step; and what FSDP2
holds at rank 0's peak.

The ranks and configurations are tests/test_fsdp.py's (a Hugging Face LLaMA, uneven shards, AdamW).

    python benchmarks/bench_sharded.py
"""

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_fsdp import BATCH, BF16_POLICY, SCENARIOS, SEQ, STEPS, ShardedLlama, per_step_truth, read, run_ranks
from zoo import zoo_batch

from lightning_memkit import estimate_memory
from lightning_memkit._breakdown import format_bytes
from lightning_memkit._estimating.analytic import shard

#: Each configuration as `estimate_memory(strategy="fsdp2")` simulates it: its keywords.
SIMULATED = {
    "default": {},
    "no_reshard": {"reshard_after_forward": False},
    "full_checkpointing": {"checkpointing": "full"},
    "selective_checkpointing": {"checkpointing": "selective"},
    "bf16_policy": {"mp_policy": BF16_POLICY},
    "accumulation": {"accumulating": True},
    "gradient_release": {"release_gradients": True},
    "fused_step": {"fused_step": True},
}


def main() -> None:
    rows = []
    for world in (2, 4):
        module = ShardedLlama(world)
        whole = estimate_memory(module, zoo_batch("qwen2", BATCH, SEQ), optimizer="adamw", device="cpu")
        grads = 4 * sum(p.numel() for p in module.parameters())
        divided = shard(whole, "fsdp", world, gradient_bytes=grads).peak
        batch = zoo_batch("qwen2", BATCH, SEQ)
        simulated = {
            name: estimate_memory(
                module, batch, device="cpu", strategy="fsdp2", world_size=world, **options
            ).peak
            for name, options in SIMULATED.items()
        }
        with tempfile.TemporaryDirectory() as tmp:
            run_ranks(Path(tmp), world)
            for name, config in SCENARIOS.items():
                records = [read(Path(tmp), name, rank) for rank in range(world)]
                accumulate = config.get("accumulate_grad_batches", 1)
                errors = [
                    m["peak"] / t - 1
                    for r in records
                    for m, t in zip(r["monitor"], per_step_truth(r, accumulate), strict=True)
                ]
                steady = per_step_truth(records[0], accumulate)[-1]
                split = records[0]["sharded"][-1]
                default = name == "default"
                rows.append(
                    (str(world), name, format_bytes(steady), f"{max(errors, key=abs):+.3%}",
                     f"{simulated[name] / steady - 1:+.2%}" if name in simulated else "—",
                     f"{divided / steady - 1:+.1%}" if default else "—",
                     format_bytes(split["sharded_parameters"]), format_bytes(split["unsharded_parameters"]),
                     format_bytes(split["sharded_gradients"] + split["unsharded_gradients"]),
                     format_bytes(split["communication"]))
                )  # fmt: skip
    print(f"LLaMA (tiny, vocabulary 131), AdamW, fp32 weights, {BATCH} x {SEQ} tokens a rank, {STEPS} steps")
    header = (
        "ranks", "configuration", "rank 0 steady", "monitor, worst err", "simulated fsdp2 err",
        "divided by N err", "sharded params", "unsharded params", "FSDP2 gradients", "communication",
    )  # fmt: skip
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
