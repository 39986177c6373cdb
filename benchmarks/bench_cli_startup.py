"""How long `memkit` takes to answer what needs no model: ``--help``, ``plan --help`` and a usage error,
beside ``python -c "import torch"`` for contrast.

    python benchmarks/bench_cli_startup.py [--runs 5]

Each command runs as a fresh process (the console script beside this Python, else
``python -m lightning_memkit.cli``), the commands interleaved round by round so that a busy machine slows
them alike; the table gives each one's median wall time in seconds and its exit status. Argument parsing
imports neither torch nor Lightning, so the first three should answer in well under a second.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time


def memkit() -> list[str]:
    """The ``memkit`` console script of this environment, or the module that is the same command."""
    script = os.path.join(os.path.dirname(sys.executable), "memkit")
    if os.path.exists(script):
        return [script]
    found = shutil.which("memkit")
    return [found] if found else [sys.executable, "-m", "lightning_memkit.cli"]


def commands() -> dict[str, list[str]]:
    cli = memkit()
    return {
        "memkit --help": [*cli, "--help"],
        "memkit plan --help": [*cli, "plan", "--help"],
        "memkit plan --gpu (usage error)": [*cli, "plan", "--gpu"],
        'python -c "import torch"': [sys.executable, "-c", "import torch"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="runs of each command (default: 5)")
    args = parser.parse_args()
    cmds = commands()
    seconds: dict[str, list[float]] = {name: [] for name in cmds}
    status: dict[str, int] = {}
    for _ in range(args.runs):  # interleaved: round by round, every command once
        for name, argv in cmds.items():
            start = time.perf_counter()
            done = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            seconds[name].append(time.perf_counter() - start)
            status[name] = done.returncode
    width = max(map(len, cmds))
    print(f"{'command':<{width}}  median s  min s  exit")
    for name in cmds:
        runs = seconds[name]
        print(f"{name:<{width}}  {statistics.median(runs):8.2f}  {min(runs):5.2f}  {status[name]:4d}")
    print(f"({args.runs} interleaved runs each, {sys.executable})")


if __name__ == "__main__":
    main()
