"""LLaMA-7B's model states on one of 8 GPUs under ZeRO: ours (`shard` over DeepSpeed's bf16 copies, AdamW)
beside DeepSpeed's own estimators, term by term at stage 3 and in total for every stage and offload.

    python benchmarks/bench_sharded_formulas.py   # two Markdown tables, for docs/sharded.md
"""

from __future__ import annotations

import math

from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

from lightning_memkit._estimating.analytic import (
    DEEPSPEED_16BIT,
    TransformerShape,
    parameter_shapes,
    shard,
    static_breakdown,
)

GiB = 2**30
N = 8
SHAPES = parameter_shapes(TransformerShape.from_name("llama-7b"))
P, T, LL = sum(math.prod(s) for s in SHAPES), len(SHAPES), max(math.prod(s) for s in SHAPES)


def ours(stage: int, offload: str) -> int:
    static = static_breakdown(SHAPES, precision=DEEPSPEED_16BIT, optimizer="adamw")
    return shard(static, f"deepspeed_stage_{stage}", N, offload=offload).static


def theirs(stage: int, offload: str) -> int:
    if stage == 3:
        return estimate_zero3_model_states_mem_needs(
            P, LL, num_gpus_per_node=N, cpu_offload=offload != "none", cpu_offload_params="param" in offload
        )[1]
    return estimate_zero2_model_states_mem_needs(P, num_gpus_per_node=N, cpu_offload=offload != "none")[1]


def gib(n: int) -> str:
    return f"{n / GiB:.2f}"


def main() -> None:
    print(f"LLaMA-7B: {P:,} parameters in {T} tensors, largest layer {LL:,}; {N} GPUs; GiB a rank\n")
    print("| term (stage 3) | ours | DeepSpeed's estimator | why they differ |")
    print("|---|---|---|---|")
    rows = [
        ("bf16 parameters, a partition", 2 * P // N, 2 * P // N, ""),
        ("bf16 gradients, a partition", 2 * P // N, 0, "freed once converted to fp32"),
        ("fp32 gradients, a partition", 0, 4 * P // N, "the step's fp32 copy"),
        ("fp32 master weights + Adam moments", 12 * P // N, 12 * P // N, ""),
        ("AdamW step counters", -(-4 * T // N), 0, "torch's, one a tensor"),
        ("largest layer gathered (bf16 weights + gradients)", 0, 4 * LL, "in flight"),
    ]
    for term, a, b, why in rows:
        print(f"| {term} | {gib(a)} | {gib(b)} | {why} |")
    assert sum(r[1] for r in rows) == ours(3, "none") and sum(r[2] for r in rows) == theirs(3, "none")
    print(f"| total | {gib(ours(3, 'none'))} | {gib(theirs(3, 'none'))} | |\n")
    print("| stage | offload | ours | DeepSpeed's estimator |")
    print("|---|---|---|---|")
    for stage, offload in [(1, "none"), (2, "none"), (3, "none"), (1, "optimizer"), (2, "optimizer"),
                           (3, "optimizer"), (3, "optimizer+param")]:  # fmt: skip
        print(f"| {stage} | {offload} | {gib(ours(stage, offload))} | {gib(theirs(stage, offload))} |")


if __name__ == "__main__":
    main()
