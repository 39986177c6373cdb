"""How long `memkit plan` takes on deep models, with `_estimating.repeated`'s shortcut (three shallow steps
stand for
the whole one) and without it (every block simulated), and that both give the same plan.

    python benchmarks/bench_plan_speed.py [--skip-70b]

One row per command: seconds from the command's start to its answer with and without the shortcut (in
this process: the CLI's imports, about 6 s from a shell, are not in them), their ratio, and whether the two
chose the same plan with the same figures.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import time

from lightning_memkit._estimating import repeated
from lightning_memkit.cli import main as memkit

COMMANDS = {
    "llama-7b, 1 x 24GB": "--model llama-7b --gpu 24GB --global-batch 64 --seq-len 2048",
    "llama-70b, 64 x H100-80GB (fsdp2)": (
        "--model llama-70b --gpu H100-80GB --gpus 64 --strategy fsdp2 --global-batch 256 --seq-len 4096"
    ),
}


def plan(arguments: str, shortcut: bool) -> tuple[float, str]:
    saved = repeated.MIN_DEPTH
    repeated.MIN_DEPTH = saved if shortcut else 10**9
    out = io.StringIO()
    try:
        start = time.perf_counter()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            memkit(["plan", *arguments.split()])
        seconds = time.perf_counter() - start
    finally:
        repeated.MIN_DEPTH = saved
    # the answer, without the lines that report the planning time
    return seconds, "\n".join(line for line in out.getvalue().splitlines() if "planned in" not in line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-70b", action="store_true")
    args = parser.parse_args()
    print("| memkit plan | shortcut | every block simulated | ratio | same answer | answer |")
    print("|---|---|---|---|---|---|")
    for name, arguments in COMMANDS.items():
        if args.skip_70b and "70b" in name:
            continue
        fast_s, fast = plan(arguments, shortcut=True)
        slow_s, slow = plan(arguments, shortcut=False)
        answer = _chosen(fast)
        same = answer == _chosen(slow)
        print(f"| {name} | {fast_s:.1f} s | {slow_s:.1f} s | {slow_s / fast_s:.1f}x | {same} | {answer} |")


def _chosen(answer: str) -> str:
    """The plan chosen, with its figures, without what the search left out for lack of time ("past 30 s"),
    which depends on how fast the simulations were."""
    line = next(line for line in answer.splitlines() if "estimated peak" in line)
    return "; ".join(part for part in line.split("; ") if "(past " not in part)


if __name__ == "__main__":
    main()
