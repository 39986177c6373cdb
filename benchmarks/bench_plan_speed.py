"""How long `memkit plan` takes on deep models, with `_estimating.repeated`'s shortcut (three shallow steps
stand for the whole one) and without it (every block simulated), and that both give the same plan.

    python benchmarks/bench_plan_speed.py [--skip-70b] [--shell N]

One row per command: seconds from the command's start to its answer with and without the shortcut (in
this process: the CLI's imports, about 5 s from a shell, are not in them), their ratio, and whether the two
chose the same plan with the same figures. Then the 7B command as a user times it, from a shell (``memkit``
in a fresh process, its imports included; the issue's bar is 15 s on 2 cores): the median and range of
``--shell`` runs (default 3), and a fixed piece of pure Python's time, to compare runs on shared cores.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import shutil
import statistics
import subprocess
import sys
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
    parser.add_argument(
        "--shell", type=int, default=3, metavar="N", help="runs of the 7B command from a shell"
    )
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
    if args.shell:
        seven_b = COMMANDS["llama-7b, 1 x 24GB"]
        seconds = sorted(_from_shell(seven_b) for _ in range(args.shell))
        print(
            f"\nmemkit plan {seven_b} from a shell (imports included), {args.shell} runs: "
            f"median {statistics.median(seconds):.1f} s (from {seconds[0]:.1f} to {seconds[-1]:.1f} s)"
        )
    # Shared cores run at different speeds from one hour to the next: a fixed piece of pure Python tells
    # how fast this machine was during the run, to compare two runs by.
    print(f"this machine's speed: 10^7 Python additions in {_reference_loop():.2f} s")


def _reference_loop() -> float:
    start, total = time.perf_counter(), 0
    for i in range(10**7):
        total += i
    return time.perf_counter() - start


def _from_shell(arguments: str) -> float:
    """Seconds of ``memkit plan <arguments>`` in a fresh process, as a user runs it."""
    command = [shutil.which("memkit") or sys.executable, "plan", *arguments.split()]
    if command[0] == sys.executable:  # not on PATH: the module, as ``python -m``
        command[1:1] = ["-m", "lightning_memkit.cli"]
    start = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True)
    return time.perf_counter() - start


def _chosen(answer: str) -> str:
    """The plan chosen, with its figures, without what the search left out for lack of time ("past 30 s"),
    which depends on how fast the simulations were."""
    line = next(line for line in answer.splitlines() if "estimated peak" in line)
    return "; ".join(part for part in line.split("; ") if "(past " not in part)


if __name__ == "__main__":
    main()
