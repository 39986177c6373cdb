"""FSDP2 (torch's ``fully_shard`` under Lightning's ModelParallelStrategy) on 2 CPU ranks with gloo: per rank
and step, the allocator's peak (torch.profiler's memory timeline), MemoryMonitor's peak and the estimate's
FSDP division (`shard(estimate_memory(...), "fsdp", 2)`, as ``memkit estimate --gpus 2 --strategy fsdp``),
with their errors against the allocator.

The ranks are tests/test_fsdp.py's: the allocator and the monitor run in two fits of the same steps. A "—"
is a step torch.profiler could not read back, or one the monitor did not measure (it stops at its second
step under FSDP2: see the test file's xfail reasons).

    python benchmarks/bench_fsdp.py
"""

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_fsdp import MODEL, estimate_per_rank, read, run_ranks

from lightning_memkit._breakdown import format_bytes
from lightning_memkit._report import render_table


def _error(value: int | None, truth: int | None) -> str:
    return "—" if value is None or truth is None else f"{(value - truth) / truth:+.1%}"


def _size(value: int | None) -> str:
    return "—" if value is None else format_bytes(value)


def main() -> None:
    whole, one_rank = estimate_per_rank(MODEL)
    with tempfile.TemporaryDirectory() as tmp:
        run_ranks(Path(tmp), MODEL)
        figures = {r: (read(Path(tmp), "allocator", r), read(Path(tmp), "monitor", r)) for r in (0, 1)}
    rows = []
    for rank, (allocator, monitor) in figures.items():
        truths, measured = allocator["allocator"], monitor["monitor"]
        for step, truth in enumerate(truths):
            m = measured[step] if step < len(measured) else None
            estimate = one_rank if step else None  # the estimate is a step with optimizer state
            rows.append(
                (str(rank), str(step), _size(truth), _size(m), _error(m, truth), _size(estimate),
                 _error(estimate, truth))
            )  # fmt: skip
    print(f"EncoderLM{MODEL}, AdamW, fp32; whole step simulated: {format_bytes(whole)}")
    header = ("rank", "step", "allocator", "monitor", "monitor err", "estimate (fsdp/2)", "estimate err")
    print(render_table(header, rows, left=("rank", "step")))


if __name__ == "__main__":
    main()
