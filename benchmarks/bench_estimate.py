"""How long `estimate_memory` takes to simulate a whole training step of a 7B model.

The issue's target: the ``llama-7b`` preset, batch 1 x 2048 tokens, AdamW, ``bf16-mixed``, planned for
CUDA, in at most 30 s on 2 CPU cores. The model is built on the meta device, so nothing is allocated;
the time is FakeTensor dispatch plus the tracker's per-op bookkeeping.

    python benchmarks/bench_estimate.py                      # the target workload
    python benchmarks/bench_estimate.py --preset gpt2 --seq-len 1024 --precision 32-true

Prints the seconds, the number of ops simulated, the breakdown next to the analytic estimate, and exits
with status 1 when over the target.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter

import torch

from lightning_memkit._breakdown import CATEGORIES, format_bytes
from lightning_memkit._estimating.analytic import TransformerShape, estimate_analytic
from lightning_memkit._estimating.simulate import estimate_memory
from lightning_memkit.demos.gpt import GPTLightningModule

TARGET_SECONDS = 30.0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="llama-7b")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--optimizer", default="adamw")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()

    start = time.perf_counter()
    with torch.device("meta"):
        module = GPTLightningModule(args.preset)
    build = time.perf_counter() - start
    x = torch.zeros(args.batch_size, args.seq_len, dtype=torch.long, device="meta")  # (B, T) token ids

    start = time.perf_counter()
    breakdown = estimate_memory(
        module, (x, x), optimizer=args.optimizer, precision=args.precision, device=args.device,
        timeline=True,
    )  # fmt: skip
    timeline = breakdown.timeline
    seconds = time.perf_counter() - start
    analytic = estimate_analytic(
        TransformerShape.from_config(module.config), args.batch_size, args.seq_len,
        precision=args.precision, optimizer=args.optimizer, attention="sdpa",
    )  # fmt: skip

    n_params = sum(p.numel() for p in module.parameters())
    print(
        f"{args.preset} ({n_params:,} parameters), batch {args.batch_size} x {args.seq_len}, "
        f"{args.precision}, {args.optimizer}, planned for {args.device}; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads"
    )
    ops = Counter(event.phase for event in timeline)
    print(f"model built on meta in {build:.2f} s")
    print(f"estimate_memory: {seconds:.1f} s for {len(timeline):,} ops ({dict(ops)})")
    peak_at = max(timeline, key=lambda event: event.live)
    print(f"peak during {peak_at.phase}, at {peak_at.op}\n")
    print(f"{'category':<16}{'simulated':>14}{'analytic':>14}")
    for name in (*CATEGORIES, "peak"):
        simulated, analytic_bytes = getattr(breakdown, name), getattr(analytic, name)
        print(f"{name:<16}{format_bytes(simulated):>14}{format_bytes(analytic_bytes):>14}")
    verdict = "within" if seconds <= TARGET_SECONDS else "OVER"
    print(f"\n{verdict} the {TARGET_SECONDS:.0f} s target ({seconds:.1f} s)")
    return 0 if seconds <= TARGET_SECONDS else 1


if __name__ == "__main__":
    sys.exit(main())
