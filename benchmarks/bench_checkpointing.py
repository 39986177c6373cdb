"""Activation checkpointing figures on the GPT example: memory saved against step time paid.

The model: 8 blocks, n_embd=256, 4 heads; a batch of 8 x 256 tokens; AdamW (torch's for-loop kernels, as
on CPU); fp32. For every configuration one real training step (forward, backward, ``step``,
``zero_grad``) is measured with `measure` after a warm-up step, and its time is the median over
interleaved rounds (every configuration once per round, so a change in the machine's load hits all alike).

Configurations:

- none, and every block under one mode: full, selective, selective_half;
- "full k/8": the first k blocks fully checkpointed (the usual hand-made plan);
- our plans for budgets between the no-checkpointing and the full-checkpointing peaks (fraction f: the
  budget is ``peak_full + f * (peak_none - peak_full)``), f = 0.5 being the issue's halfway budget.

Printed: the peak, ``activations`` (everything but parameters, gradients and optimizer state at the peak:
saved tensors, the checkpoint caches, recomputed tensors, temporaries), the bytes kept from forward to
backward, and the step time's overhead over no checkpointing; then the targets as checks.

    python benchmarks/bench_checkpointing.py [--rounds 5] [--threads N] [--clock wall|cpu] [--layers 8]

On a shared CPU, ``--threads 1 --clock cpu`` gives stable figures: a two-thread op waits whole scheduler
slices whenever its second thread is descheduled, which no number of rounds averages away.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from lightning_memkit import apply_checkpointing, measure
from lightning_memkit._breakdown import MiB
from lightning_memkit._checkpointing.planner import CheckpointPlanner
from lightning_memkit.demos.gpt import GPT, GPTConfig


class LM(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.gpt = GPT(config)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.gpt(idx)[0]  # (B, T, vocab)


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


class Bench:
    """One model, batch and optimizer; measures and times steps under a given plan."""

    def __init__(self, model: LM, x: torch.Tensor, y: torch.Tensor) -> None:
        self.model, self.x, self.y = model, x, y
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)

    def step(self) -> None:
        lm_loss(self.model(self.x), self.y).backward()
        self.optimizer.step()
        self.optimizer.zero_grad()

    def memory(self, plan) -> dict[str, float]:
        with apply_checkpointing(self.model, plan):
            self.step()  # the optimizer state exists from here on: a steady-state step
            with measure(self.model, self.optimizer) as step:
                self.step()
            with measure(self.model, self.optimizer) as forward:  # what is kept from forward to backward
                loss = lm_loss(self.model(self.x), self.y)
            del loss
        b, f = step.breakdown, forward.breakdown
        return {
            "peak": b.peak / MiB,
            "activations": (b.peak - b.static) / MiB,
            "kept": (f.peak - f.static) / MiB,
        }

    def seconds(self, plan, clock=time.perf_counter) -> float:
        with apply_checkpointing(self.model, plan):
            start = clock()
            self.step()
            return clock() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds (median taken)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--cost", default="measured", choices=["measured", "flops"])
    parser.add_argument(
        "--clock",
        default="wall",
        choices=["wall", "cpu"],
        help="cpu: this thread's CPU time, immune to a shared machine's scheduling (use with --threads 1)",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    n = args.layers
    config = GPTConfig(vocab_size=256, block_size=256, n_layer=n, n_head=4, n_embd=256)
    model = LM(config)
    x, y = torch.randint(0, 256, (8, 256)), torch.randint(0, 256, (8, 256))
    bench = Bench(model, x, y)
    threads = torch.get_num_threads()
    print(f"GPT n_layer={n} n_embd=256, batch 8 x 256, AdamW, fp32, {threads} threads, {args.clock} clock")

    start = time.perf_counter()
    planner = CheckpointPlanner(
        model, (x, y), optimizer="adamw", loss_fn=lm_loss, device="cpu", cost=args.cost
    )
    print(f"profile: {time.perf_counter() - start:.1f} s")
    blocks = planner.names
    none, full = (
        planner.simulate(planner.uniform("none")).peak,
        planner.simulate(planner.uniform("full")).peak,
    )

    configs: dict[str, object] = {"none": "none"}
    for mode in ("selective", "selective_half", "full"):
        configs[f"all {mode}"] = mode
    for k in range(2, n, 2):
        configs[f"full {k}/{n}"] = {name: "full" for name in blocks[:k]}
    plans = {}
    for fraction in (0.9, 0.75, 0.5, 0.25, 0.1, 0.0):
        budget = int(full + fraction * (none - full))
        start = time.perf_counter()
        plans[fraction] = plan = planner.plan(budget)
        counts = {p: list(plan.modes.values()).count(p) for p in ("selective", "selective_half", "full")}
        summary = ", ".join(f"{c} {p}" for p, c in counts.items() if c) or "none"
        seconds = time.perf_counter() - start
        print(f"plan f={fraction}: budget {budget / MiB:.1f} MiB -> {summary} (planned in {seconds:.1f} s)")
        configs[f"plan f={fraction}"] = plan
    print(plans[0.5])

    memory = {name: bench.memory(plan) for name, plan in configs.items()}
    times: dict[str, list[float]] = {name: [] for name in configs}
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    for _ in range(args.rounds):
        for name, plan in configs.items():
            times[name].append(bench.seconds(plan, clock))
    median = {name: statistics.median(t) for name, t in times.items()}
    base = median["none"]

    print()
    header = ("configuration", "peak MiB", "activations", "kept fwd->bwd", "step s", "time")
    print(f"{header[0]:<22} {header[1]:>9} {header[2]:>12} {header[3]:>14} {header[4]:>8} {header[5]:>8}")
    for name in configs:
        m = memory[name]
        overhead = 100 * (median[name] / base - 1)
        print(
            f"{name:<22} {m['peak']:>9.1f} {m['activations']:>12.1f} {m['kept']:>14.1f} "
            f"{median[name]:>8.3f} {overhead:>+7.1f}%"
        )

    print("\nmemory/time curve (activation memory saved vs step time added, relative to none):")
    act0 = memory["none"]["activations"]
    for name in configs:
        if name == "none":
            continue
        saved = 100 * (1 - memory[name]["activations"] / act0)
        print(f"  {name:<22} saved {saved:5.1f}%  time {100 * (median[name] / base - 1):+6.1f}%")

    print("\ntargets:")
    ratio = memory["none"]["kept"] / memory["all full"]["kept"]
    dynamic = memory["none"]["activations"] / memory["all full"]["activations"]
    print(
        f"  full checkpointing cuts kept activations {ratio:.1f}x, all dynamic memory {dynamic:.1f}x (>= 5x)"
    )
    half = plans[0.5]
    within = memory["plan f=0.5"]["peak"] * MiB <= half.budget
    print(
        f"  halfway plan: measured peak {memory['plan f=0.5']['peak']:.1f} MiB <= budget "
        f"{half.budget / MiB:.1f} MiB: {within}"
    )
    t_half, t_full = median["plan f=0.5"] / base - 1, median["all full"] / base - 1
    estimated_full = planner.overhead(planner.uniform("full"))
    print(
        f"  halfway plan overhead {100 * t_half:+.1f}% vs full {100 * t_full:+.1f}% "
        f"(<= half of full's: {t_half <= t_full / 2}); planner's estimates, of the blocks' time: "
        f"{100 * half.overhead:.1f}% vs {100 * estimated_full:.1f}%"
    )
    peaks = [memory[f"plan f={f}"]["peak"] for f in plans]
    print(
        f"  measured peaks for tightening budgets {[round(p, 1) for p in peaks]}: monotone "
        f"{all(a >= b for a, b in itertools.pairwise(peaks))}"
    )
    sim_vs_real = max(abs(p.peak / MiB - memory[f"plan f={f}"]["peak"]) for f, p in plans.items())
    print(f"  simulated vs measured plan peaks: largest difference {sim_vs_real:.3f} MiB")


if __name__ == "__main__":
    main()
