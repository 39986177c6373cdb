"""AutoFit's plans against the rule it used before it read the checkpointing planner's costs.

    python benchmarks/bench_autofit.py

The tiny GPT on CPU, a global batch of 16 x 64 tokens, AdamW, three byte budgets from loose to tight. For
each budget:

- "planner": ``plan_fit`` as it is: per-block checkpointing plans from `CheckpointPlanner`, ranked by the
  recompute cost the planner measures;
- "uniform": the earlier rule, reproduced exactly: one checkpointing mode for every block, ``none``,
  ``selective`` or ``full``, ranked with fixed recompute fractions (0, 0.1, 1/3) — the fastest by that
  model among the (micro-batch, mode) cells whose simulated peak fits (`grid`, the exhaustive search the
  earlier pruned search agreed with).

Both plans run for real: their measured peaks (`measure`) against the budget, and their times, medians of
``ROUNDS`` interleaved rounds of one global batch each. ``ratio`` is uniform time / planner time: above 1
the planner's plan is faster; the target is >= 0.95 (at least as good, within the noise of a shared CPU).
"""

import statistics
import time

import torch

from lightning_memkit import apply_checkpointing, measure, plan_fit
from lightning_memkit._fitting.search import grid
from lightning_memkit.demos.gpt import GPTLightningModule

G, T, MARGIN = 16, 64, 0.1
BUDGETS = (40_000_000, 32_000_000, 26_000_000)
ROUNDS = 7
#: The recompute fractions AutoFit assumed for a uniform mode before it read the planner's measurements.
UNIFORM_RECOMPUTE = {"none": 0.0, "selective": 0.1, "full": 1 / 3}


def global_step(module, optimizer, batch, m):
    """One optimizer step over the global batch in micro-batches of m; returns seconds."""
    start = time.perf_counter()
    for i in range(G // m):
        x, y = (t[i * m : (i + 1) * m] for t in batch)
        (module.model(x, y)[1] * m / G).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def real_peak(module, batch, m, checkpointing):
    """The measured peak of one global batch with ``checkpointing`` applied (after a warm-up batch)."""
    with apply_checkpointing(module, checkpointing):
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)
        global_step(module, optimizer, batch, m)  # warm-up, creates the optimizer state
        with measure(module, optimizer, device="cpu") as result:
            global_step(module, optimizer, batch, m)
    return result.breakdown.peak


def timed(module, batch, m, checkpointing):
    with apply_checkpointing(module, checkpointing):
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)
        global_step(module, optimizer, batch, m)
        return global_step(module, optimizer, batch, m)


def main():
    # One thread: on a shared, loaded CPU two threads spin against other jobs and timings swing 5x.
    torch.set_num_threads(1)
    torch.manual_seed(0)
    module = GPTLightningModule("tiny")
    x = torch.randint(0, 256, (G, T))
    batch = (x, x.roll(-1, 1))
    peaks = grid(module, batch, optimizer="adamw", checkpointing=tuple(UNIFORM_RECOMPUTE), device="cpu")
    print(f"default run (m={G}, no checkpointing) simulated peak {peaks[(G, 'none')]:,} B")
    header = f"{'budget':>12} {'rule':8} {'plan':48} {'real peak':>12} {'fits':>5} {'median':>9}"
    rows, ratios = [header], []
    for budget in BUDGETS:
        start = time.perf_counter()
        plan = plan_fit(module, batch, budget, margin=MARGIN, device="cpu")
        seconds = time.perf_counter() - start
        limit = plan.limit
        _, m_old, level_old = min(
            (plan.cost.time(m, G // m, UNIFORM_RECOMPUTE[level]), m, level)
            for (m, level), peak in peaks.items()
            if peak <= limit
        )
        contenders = {
            "planner": (
                plan.micro_batch_size,
                plan.checkpoint_plan or plan.checkpointing,
                plan.checkpointing,
            ),
            "uniform": (m_old, level_old, level_old),
        }
        times = {rule: [] for rule in contenders}
        for _ in range(ROUNDS):
            for rule, (m, checkpointing, _) in contenders.items():
                times[rule].append(timed(module, batch, m, checkpointing))
        medians = {rule: statistics.median(v) for rule, v in times.items()}
        for rule, (m, checkpointing, label) in contenders.items():
            real = real_peak(module, batch, m, checkpointing)
            rows.append(
                f"{budget:>12,} {rule:8} {f'm={m} x {G // m}, {label}':48} {real:>12,} "
                f"{'yes' if real <= budget else 'NO':>5} {medians[rule] * 1e3:7.1f} ms"
            )
        ratios.append(medians["uniform"] / medians["planner"])
        rows.append(f"{'':12} planned in {seconds:.1f} s; ratio uniform / planner time {ratios[-1]:.3f}")
    print("\n".join(rows))
    print(f"worst ratio over the budgets: {min(ratios):.3f} (target >= 0.95)")


if __name__ == "__main__":
    main()
