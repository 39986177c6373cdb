"""The largest micro-batch under a byte budget, three ways, on the tiny GPT on the CPU.

    python benchmarks/bench_fit_table.py

The budget is a number of bytes checked against the allocator's truth (`lightning_memkit.testing`'s
`AllocatorPeaks`: torch.profiler's memory timeline of each training step). Three answers:

- truth: the largest micro-batch whose measured steps (a short fit of ``STEPS`` steps at that size, its
  highest step) fit the budget, the next size's over it (bisected over real fits);
- ours: `largest_micro_batch` on simulated steps (fake tensors; nothing allocated, nothing fails);
- Lightning's ``BatchSizeFinder`` in its power and binsearch modes, with an out-of-memory error emulated
  past the budget: a callback raises ``RuntimeError("CUDA out of memory ...")`` (what Lightning's
  ``is_oom_error`` takes for one) after any trial step whose measured peak is over it.

Each answer's own measured peak is printed beside it, with its work (steps run or simulated) and seconds.
Known issue: in a first run (load 5 on two cores) BatchSizeFinder's trials went on to 4,096 samples, the
emulated error never raised; the emulation is not yet verified. The budget is placed between the truth's peaks at ``BETWEEN`` and ``BETWEEN + 1`` samples, a size no power
of two reaches.
"""

import time

import lightning as L
import torch
from lightning.pytorch.callbacks import BatchSizeFinder

from lightning_memkit import largest_micro_batch
from lightning_memkit.demos.gpt import GPTDataModule, GPTLightningModule
from lightning_memkit.testing import AllocatorPeaks

T, STEPS, BETWEEN = 32, 2, 11


class OutOfBudget(L.Callback):
    """A pretend device of ``budget`` bytes: a step whose allocator peak is over it fails as CUDA would."""

    def __init__(self, peaks: AllocatorPeaks, budget: int) -> None:
        self.peaks, self.budget, self.steps = peaks, budget, 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps += 1
        self.peaks._close()  # the step's window, closed here: before the check, not after
        if self.peaks.peaks[-1] > self.budget:
            raise RuntimeError(
                f"CUDA out of memory. (emulated: the step peaked at {self.peaks.peaks[-1]:,} bytes, over the "
                f"budget of {self.budget:,})"
            )


def trainer(callbacks, steps=STEPS) -> L.Trainer:
    return L.Trainer(
        max_steps=steps, limit_val_batches=0, accelerator="cpu", devices=1, logger=False,
        callbacks=callbacks, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False,
    )  # fmt: skip


def measured(m: int) -> int:
    """The highest allocator peak of ``STEPS`` real training steps at micro-batch ``m``."""
    torch.manual_seed(0)
    peaks = AllocatorPeaks()
    trainer(peaks.around()).fit(GPTLightningModule("tiny"), GPTDataModule(batch_size=m, seq_len=T))
    return max(peaks.peaks)


def truth(budget: int, hi: int) -> tuple[int, int]:
    """The largest micro-batch whose measured peak fits (bisection over 1..hi, checked at both ends), and
    the real fits it took."""
    lo, fits = 0, 0  # sizes[lo] fits, hi does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        fits += 1
        lo, hi = (mid, hi) if measured(mid) <= budget else (lo, mid)
    return lo, fits


def finder(mode: str, budget: int) -> tuple[int, int]:
    """BatchSizeFinder's answer under the emulated device, and the trial steps it ran."""
    torch.manual_seed(0)
    peaks = AllocatorPeaks()
    oom = OutOfBudget(peaks, budget)
    data = GPTDataModule(batch_size=1, seq_len=T)
    found = BatchSizeFinder(mode=mode, init_val=1, max_trials=25, steps_per_trial=STEPS)
    trainer([peaks.start, found, oom], steps=1).fit(GPTLightningModule("tiny"), data)
    return found.optimal_batch_size, oom.steps


def main() -> None:
    torch.set_num_threads(1)  # a shared CPU: steadier peaks and times
    below, above = measured(BETWEEN), measured(BETWEEN + 1)
    budget = (below + above) // 2
    print(f"tiny GPT, sequences of {T} tokens, AdamW, 32-true, CPU; budget {budget:,} bytes")
    print(f"(between the measured peaks of {BETWEEN} samples, {below:,}, and {BETWEEN + 1}, {above:,})\n")
    rows = []

    start = time.perf_counter()
    best, fits = truth(budget, 2 * BETWEEN + 2)
    rows.append(
        ("truth (bisected real fits)", best, f"{fits} fits of {STEPS} steps", time.perf_counter() - start)
    )

    start = time.perf_counter()
    model = GPTLightningModule("tiny")
    x = torch.zeros(1, T, dtype=torch.long)
    ours = largest_micro_batch(model, (x, x), budget, margin=0.0, device="cpu")
    work = f"{len(ours.simulated)} simulated steps"
    rows.append(("largest_micro_batch (simulated)", ours.micro_batch_size, work, time.perf_counter() - start))

    for mode in ("power", "binsearch"):
        start = time.perf_counter()
        size, steps = finder(mode, budget)
        rows.append(
            (
                f"BatchSizeFinder({mode!r}), OOM emulated",
                size,
                f"{steps} trial steps",
                time.perf_counter() - start,
            )
        )

    print(f"{'method':42} {'micro-batch':>11} {'measured peak':>15}  {'fits':>4}  {'work':24} {'seconds':>7}")
    for name, size, work, seconds in rows:
        peak = measured(size) if size else 0
        fits = "yes" if peak <= budget else "NO"
        print(f"{name:42} {size:>11} {peak:>15,}  {fits:>4}  {work:24} {seconds:>7.1f}")
    print(f"\nours, as it says: {ours}")


if __name__ == "__main__":
    main()
