"""MemoryMonitor on compiled steps: the logged peak against the allocator's, step by step, and what
torch.compile did with and without the monitor.

A tiny random LLaMA (``torch.compile`` in ``configure_model``) and a small CNN (``module.compile()``) train
for a few steps on the CPU with MemoryMonitor; each step's allocator peak is taken alongside, twice: the
CPU allocator's own count in every thread (`counting_allocator`, installed before anything is built) and
torch.profiler's memory timeline (`AllocatorPeaks`, the tests' truth in-process; it misses tensors allocated
before the step that only generated kernels read). Steps 0 and 1 are measured, later ones reuse their twin.
Then the same fit without the monitor: dynamo's counters (frames, graph breaks, recompiles) must match.

    python benchmarks/bench_compiled.py [--batch-size 16] [--seq-len 256] [--steps 4]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

from lightning_memkit.testing import AllocatorPeaks, counting_allocator

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "measuring"))  # its test modules
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # helpers, models

MiB = 2**20


def _fit(module, callbacks: list, steps: int) -> dict:
    from helpers import cpu_trainer

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with tempfile.TemporaryDirectory() as root:
        cpu_trainer(root, callbacks, max_steps=steps).fit(module)
    counters = torch._dynamo.utils.counters
    return {key: dict(counters[key]) for key in ("frames", "graph_break", "recompiles")}


def compare(name: str, build, steps: int) -> None:
    from lightning_memkit import MemoryMonitor

    counted, profiled = AllocatorPeaks(all_threads=True), AllocatorPeaks()
    monitor = MemoryMonitor(plot=False, summary=False)
    callbacks = [counted.start, profiled.start, monitor, profiled.stop, counted.stop]
    watched = _fit(build(), callbacks, steps)
    print(f"\n{name}: {monitor.measured_steps} of {steps} steps measured")
    columns = {"step": 4, "monitor MiB": 12, "allocator MiB": 14, "diff": 9, "profiler MiB": 13, "diff ": 9}
    print(" ".join(f"{title.strip():>{width}}" for title, width in columns.items()))
    for (step, breakdown), count, profile in zip(monitor.history, counted.peaks, profiled.peaks, strict=True):
        print(
            f"{step:>4} {breakdown.peak / MiB:>12.3f} {count / MiB:>14.3f} "
            f"{100 * (breakdown.peak - count) / count:>+8.3f}% {profile / MiB:>13.3f} "
            f"{100 * (breakdown.peak - profile) / profile:>+8.3f}%"
        )
    print(f"last step by category: {monitor.history[-1][1]}")
    alone = _fit(build(), [], steps)
    print(f"torch.compile with the monitor: {watched}")
    print(f"torch.compile without it:       {alone}  -> {'same' if watched == alone else 'DIFFERENT'}")


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    counting_allocator()  # before anything is allocated: it counts only what comes after
    import test_compiled

    decoder = lambda: test_compiled.CompiledDecoder(args.batch_size, args.seq_len)  # noqa: E731
    compare(f"LLaMA (tiny config), batch {args.batch_size} x {args.seq_len}", decoder, args.steps)
    compare("CNN, batch 8 x 3 x 32 x 32", test_compiled.CompiledCNN, args.steps)


if __name__ == "__main__":
    main()
