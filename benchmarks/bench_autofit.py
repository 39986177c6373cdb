"""AutoFit's plan against an exhaustive grid, on the tiny GPT on CPU (a budget in bytes).

    python benchmarks/bench_autofit.py

Plans a global batch of 16 x 64 tokens for a byte budget the default run (micro-batch 16, no checkpointing,
AdamW) exceeds; measures every (micro-batch, checkpointing) cell's real peak (`measure`) against its
simulated one and the budget, and times it (median of 3 global batches); then times the plan against the
fastest feasible cells side by side, interleaved for several rounds, and prints plan throughput / best
feasible throughput from those medians (target >= 0.95). The optimizer is not part of the timed grid: the
plan never trades optimizer quality for speed, so the best feasible plan uses the same optimizer.
"""

import statistics
import time

import torch

from lightning_memkit import measure
from lightning_memkit._autofit import grid, plan_fit
from lightning_memkit._checkpointing import apply_checkpointing
from lightning_memkit.demos.gpt import GPTLightningModule

G, T, BUDGET, MARGIN = 16, 64, 40_000_000, 0.1
ROUNDS = 7  # interleaved rounds of the second pass
CONTENDERS = 3  # the first pass's fastest feasible cells, timed against the plan


def global_step(module, optimizer, batch, m):
    """One optimizer step over the global batch in micro-batches of m; returns seconds."""
    start = time.perf_counter()
    for i in range(G // m):
        x, y = (t[i * m : (i + 1) * m] for t in batch)
        (module.model(x, y)[1] * m / G).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def run(module, batch, m, level, measured=True, repeats=3):
    """(real peak or None, median seconds of ``repeats`` global batches) of one cell."""
    peak = None
    with apply_checkpointing(module, level) if level != "none" else _null():
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)
        global_step(module, optimizer, batch, m)  # warm-up, creates the optimizer state
        if measured:
            with measure(module, optimizer, device="cpu") as result:
                global_step(module, optimizer, batch, m)
            peak = result.breakdown.peak
        seconds = statistics.median(global_step(module, optimizer, batch, m) for _ in range(repeats))
    return peak, seconds


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def main():
    # One thread: on a shared, loaded CPU two threads spin against other jobs and timings swing 5x.
    torch.set_num_threads(1)
    torch.manual_seed(0)
    module = GPTLightningModule("tiny")
    x = torch.randint(0, 256, (G, T))
    batch = (x, x.roll(-1, 1))
    start = time.perf_counter()
    plan = plan_fit(module, batch, BUDGET, margin=MARGIN, device="cpu")
    print(f"planned in {time.perf_counter() - start:.1f} s; cost model {plan.cost}")
    print(plan)
    assert plan.optimizer == "adamw"
    peaks = grid(module, batch, optimizer="adamw", device="cpu")
    print(f"default run (m={G}, none) simulated peak {peaks[(G, 'none')]:,} B > budget {BUDGET:,} B")
    results = {}
    for (m, level), simulated in peaks.items():
        real, seconds = run(module, batch, m, level)
        results[(m, level)] = (simulated, real, seconds)
        fits = real <= BUDGET * (1 - MARGIN)
        print(
            f"m={m:2d} {level:9s} simulated {simulated:>11,} real {real:>11,} {seconds * 1e3:8.1f} ms"
            f"{'  feasible' if fits else ''}"
        )
    feasible = {k: v for k, v in results.items() if v[1] <= BUDGET * (1 - MARGIN)}
    chosen_key = (plan.micro_batch_size, plan.checkpointing)
    chosen = results[chosen_key]
    print(
        f"plan m={plan.micro_batch_size} {plan.checkpointing}: real peak {chosen[1]:,} B <= budget "
        f"{BUDGET:,} B: {chosen[1] <= BUDGET} (OOMs: {int(chosen[1] > BUDGET)})"
    )
    contenders = sorted(feasible, key=lambda k: feasible[k][2])[:CONTENDERS]
    contenders = [chosen_key, *(k for k in contenders if k != chosen_key)]
    times = {k: [] for k in contenders}
    for _ in range(ROUNDS):
        for key in contenders:
            times[key].append(run(module, batch, *key, measured=False)[1])
    medians = {k: statistics.median(v) for k, v in times.items()}
    for (m, level), seconds in medians.items():
        print(f"interleaved, {ROUNDS} rounds: m={m:2d} {level:9s} median {seconds * 1e3:6.1f} ms")
    best_key = min(medians, key=medians.get)
    print(f"best feasible: m={best_key[0]} {best_key[1]} {medians[best_key] * 1e3:.1f} ms")
    ratio = medians[best_key] / medians[chosen_key]
    print(f"throughput ratio plan / best feasible: {ratio:.3f} (target >= 0.95)")


if __name__ == "__main__":
    main()
