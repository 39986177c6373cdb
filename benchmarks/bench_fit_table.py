"""The largest micro-batch under a byte budget, three ways, on the tiny GPT on the CPU.

    python benchmarks/bench_fit_table.py

Every training step's peak is `counting_allocator`'s (installed when the process starts, before any model
is built): the highest bytes live in the step, what was live when it began and is not its own (the data
set, Lightning's checkpoint of the module) taken off, as `AllocatorPeaks(all_threads=True)` counts it. The
step is measured from the LightningModule's own hooks (`GPTOnABudget`), not from a Callback: Lightning's
``BatchSizeFinder`` runs its trials with ``trainer.callbacks = []`` (``__scale_batch_reset_params``), so
a callback never sees a trial step, but the module's ``on_train_batch_start`` / ``on_train_batch_end``
run in every one. Three answers under one budget:

- truth: the largest micro-batch whose real steps (a fit of ``STEPS`` steps at that size, its highest
  step) fit the budget, the next size's over it (bisected over real fits);
- ours: `largest_micro_batch` on simulated steps (fake tensors; nothing allocated, nothing fails);
- Lightning's ``BatchSizeFinder`` in its power and binsearch modes (binsearch with ``margin=0``, as
  ours, and with its default ``margin=0.05``, which takes 5 % off its answer), on a pretend device of the
  budget's size: a step whose measured peak is over it raises ``RuntimeError("CUDA out of memory. ...")``
  at its end, one argument holding "CUDA" and "out of memory", which Lightning's ``is_oom_error`` takes
  for an out-of-memory error. The benchmark fails if no such error was raised.

The budget lies between the measured peaks at ``BETWEEN`` and ``BETWEEN + 1`` samples, a size no power
of two reaches. Each answer's own measured peak is printed beside it, with its work (real steps run, or
steps simulated) and its seconds.
"""

import tempfile
import time

import lightning as L
import torch
from lightning.pytorch.callbacks import BatchSizeFinder

from lightning_memkit import largest_micro_batch
from lightning_memkit.demos.gpt import GPTDataModule, GPTLightningModule
from lightning_memkit.testing import AllocatorPeaks, counting_allocator

T, STEPS, BETWEEN = 32, 2, 11
SENTENCES = 2_000  # about 120 kB of text: thousands of samples, more than any size tried


class GPTOnABudget(GPTLightningModule):
    """The tiny GPT measuring each training step from its own hooks, as if on a device of ``budget``
    bytes (``None``: no limit): a step that peaks over it raises the error CUDA would. ``steps`` holds
    every step's ``(micro-batch, peak)``; ``ooms`` counts the errors raised."""

    peaks: AllocatorPeaks
    budget: int | None = None

    def on_train_batch_start(self, batch, batch_idx):
        self.peaks.start.on_train_batch_start(self.trainer, self, batch, batch_idx)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.peaks.stop.on_train_batch_end()
        peak = self.peaks.peaks[-1]
        self.steps.append((len(batch[0]), peak))
        if self.budget is not None and peak > self.budget:
            self.ooms += 1
            raise RuntimeError(
                f"CUDA out of memory. (emulated: a step of {len(batch[0])} samples peaked at {peak:,} bytes, "
                f"over the pretend device's {self.budget:,})"
            )


def gpt(budget: int | None = None) -> GPTOnABudget:
    """A fresh, seeded `GPTOnABudget` (its measuring set after construction: ``save_hyperparameters``
    keeps only the GPT's own arguments, and the checkpoint BatchSizeFinder saves stays picklable)."""
    torch.manual_seed(0)
    model = GPTOnABudget("tiny", max_steps=STEPS)
    model.peaks, model.budget, model.steps, model.ooms = AllocatorPeaks(all_threads=True), budget, [], 0
    return model


def fit(model: GPTOnABudget, batch_size: int, callbacks=(), steps: int = STEPS) -> None:
    with tempfile.TemporaryDirectory() as root:  # BatchSizeFinder saves and restores a checkpoint there
        L.Trainer(
            default_root_dir=root, max_steps=steps, limit_val_batches=0, accelerator="cpu", devices=1,
            logger=False, callbacks=list(callbacks), enable_progress_bar=False, enable_model_summary=False,
            enable_checkpointing=False,
        ).fit(model, GPTDataModule(batch_size=batch_size, seq_len=T, num_sentences=SENTENCES))  # fmt: skip


_measured: dict[int, int] = {}


def measured(m: int) -> int:
    """The highest step peak of a real fit of ``STEPS`` steps at micro-batch ``m`` (each size fitted once)."""
    if m not in _measured:
        model = gpt()
        fit(model, m)
        _measured[m] = max(peak for _, peak in model.steps)
    return _measured[m]


def truth(budget: int, hi: int) -> tuple[int, int]:
    """The largest micro-batch whose measured peak fits (bisection over 1..hi, ``hi`` over), and the real
    fits it took."""
    if measured(hi) <= budget:
        raise ValueError(f"micro-batch {hi} fits {budget:,} bytes: bisect over a larger range")
    lo, fits = 0, 1  # lo fits (0 trivially), hi does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        fits += 1
        lo, hi = (mid, hi) if measured(mid) <= budget else (lo, mid)
    return lo, fits


def finder(mode: str, budget: int, margin: float = 0.0) -> tuple[int, int, int]:
    """BatchSizeFinder's answer on the pretend device, the trial steps it ran and the errors raised; each
    trial step's peak after the first (the first step runs before any gradient or AdamW state exists; a
    fresh fit's highest step is a later one) is kept to check against the fresh fits' (`trials`)."""
    model = gpt(budget)
    found = BatchSizeFinder(mode=mode, init_val=1, max_trials=25, steps_per_trial=STEPS, margin=margin)
    fit(model, 1, [found], steps=1)  # the trials, then one step at the size found
    if model.ooms == 0:
        raise RuntimeError(f"BatchSizeFinder({mode!r}) never met the emulated out-of-memory error")
    trials.extend(model.steps[1:-1])
    return found.optimal_batch_size, len(model.steps) - 1, model.ooms


trials: list[tuple[int, int]] = []  # every trial step's (micro-batch, peak), both modes


def timed(work, *args):
    """``work(*args)`` and its seconds."""
    start = time.perf_counter()
    return work(*args), time.perf_counter() - start


def main() -> None:
    counting_allocator()  # before any model is built: it counts only what is allocated after
    torch.set_num_threads(1)  # a shared CPU: steadier times
    below, above = measured(BETWEEN), measured(BETWEEN + 1)
    budget = (below + above) // 2
    print(f"tiny GPT, sequences of {T} tokens, AdamW, 32-true, CPU; budget {budget:,} bytes")
    print(f"(between the measured peaks of {BETWEEN} samples, {below:,}, and {BETWEEN + 1}, {above:,})\n")

    _measured.clear()  # the truth's own fits, counted and timed
    (best, fits), seconds = timed(lambda: truth(budget, 2 * BETWEEN + 2))
    rows = [("truth (bisected real fits)", best, f"{fits * STEPS} steps ({fits} fits)", seconds)]
    x = torch.randint(0, 256, (1, T))
    ours, seconds = timed(lambda: largest_micro_batch(gpt(), (x, x), budget, margin=0.0, device="cpu"))
    rows.append(("largest_micro_batch", ours.micro_batch_size, f"{len(ours.simulated)} simulated", seconds))
    for mode, margin in (("power", 0.0), ("binsearch", 0.0), ("binsearch", 0.05)):
        (size, steps, ooms), seconds = timed(finder, mode, budget, margin)
        name = f"BatchSizeFinder({mode!r}{f', margin={margin}' if margin else ''})"
        rows.append((name, size, f"{steps} steps ({ooms} OOM)", seconds))

    print(f"| {'method':42} | {'answer':>6} | {'measured peak':>13} | {'fits':4} | {'work':19} | {'s':>5} |")
    print(f"|{'-' * 44}|{'-' * 7}:|{'-' * 14}:|{'-' * 6}|{'-' * 21}|{'-' * 6}:|")
    for name, size, work, seconds in rows:
        peak = measured(size) if size else 0
        fits = "yes" if peak <= budget else "NO"
        print(f"| {name:42} | {size:>6} | {peak:>13,} | {fits:4} | {work:19} | {seconds:>5.1f} |")
    print(f"\nours, as it says: {ours}")
    print(f"its simulated peak {ours.peak:,} B, measured {measured(ours.micro_batch_size):,} B")
    off = max(abs(peak - measured(m)) for m, peak in trials)
    print(f"BatchSizeFinder's trial steps after its first ({len(trials)}): within {off:,} B of fresh fits")


if __name__ == "__main__":
    main()
