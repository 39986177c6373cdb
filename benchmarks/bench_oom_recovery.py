"""AutoFit's recovery from an out-of-memory error, on the tiny GPT on CPU (a pretend small device).

    python benchmarks/bench_oom_recovery.py

`PretendOOM` makes the second micro-batch of the first step fail in the middle of its backward whenever it
holds more than 4 samples, after the layers above block 1 have added their gradients to the first micro-
batch's. AutoFit re-plans one notch at a time until the step fits, and runs the same batch again in slices.

Prints: the largest difference between the first step's gradients and those of the same run without an
OOM (relative to the largest gradient); the recovering step's time against an ordinary step; and the
median step time after recovery (dataloader batches cut into slices) against a run configured with the
leaner plan from the start (interleaved runs, medians).
"""

import statistics
import time

import lightning as L
import torch

from lightning_memkit import AutoFit
from lightning_memkit.demos.gpt import GPTDataModule, GPTLightningModule
from lightning_memkit.testing import PretendOOM

G, T, STEPS, ROUNDS = 16, 64, 12, 3
BUDGET = 40_000_000  # bytes: the plan is micro-batch 8 x 2, no checkpointing


class Timed(GPTLightningModule):
    """The tiny GPT, noting each optimizer step's gradients (the first) and when each step ends."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        super().__init__("tiny", max_steps=STEPS)
        self.grads: dict[str, torch.Tensor] | None = None
        self.ends: list[float] = [time.perf_counter()]

    def on_train_start(self):
        self.ends = [time.perf_counter()]

    def on_before_optimizer_step(self, optimizer):
        if self.grads is None:
            self.grads = {n: p.grad.clone() for n, p in self.named_parameters()}

    def optimizer_step(self, *args, **kwargs):
        super().optimizer_step(*args, **kwargs)
        self.ends.append(time.perf_counter())

    def step_times(self) -> list[float]:
        return [b - a for a, b in zip(self.ends, self.ends[1:], strict=False)]


def fit(module, callbacks=(), micro_batch=G // 2, accumulate=2):
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(
        max_steps=STEPS, limit_val_batches=0, accelerator="cpu", devices=1, logger=False,
        callbacks=list(callbacks), accumulate_grad_batches=accumulate, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False,
    )  # fmt: skip
    trainer.fit(module, GPTDataModule(batch_size=micro_batch, seq_len=T, num_sentences=2000))
    return module


def main():
    torch.set_num_threads(1)  # a shared, loaded CPU: one thread keeps timings steady
    first, recovering, recovered, leaner = [], [], [], []
    for _ in range(ROUNDS):
        reference = Timed()
        callback = AutoFit(budget=BUDGET, cost="flops")
        fit(reference, [callback])
        planned = callback.plan
        first.append(reference.step_times()[0])

        module = Timed()
        pretend = PretendOOM(module, 4, where="backward", layer=module.model.blocks[1], batch_idx=1)
        callback = AutoFit(budget=BUDGET, cost="flops")
        fit(module, [callback])
        plan = callback.plan
        times = module.step_times()
        recovering.append(times[0])
        recovered.append(statistics.median(times[1:]))

        direct = Timed()
        plan.apply(direct)
        fit(direct, micro_batch=plan.micro_batch_size, accumulate=plan.accumulate_grad_batches)
        leaner.append(statistics.median(direct.step_times()[1:]))

    print(f"plan without OOM: {planned.summary()}")
    print(f"after {pretend.raised} OOMs: {plan.summary()}")
    scale = max(g.abs().max().item() for g in reference.grads.values())
    diff = max((module.grads[n] - g).abs().max().item() for n, g in reference.grads.items())
    print(f"first step's gradients vs the run without OOM: max |diff| / max |grad| = {diff / scale:.2e}")
    ms = statistics.median
    print(
        f"first step: {ms(recovering) * 1e3:.1f} ms with {pretend.raised} OOMs and the retry, "
        f"{ms(first) * 1e3:.1f} ms without (medians of {ROUNDS} rounds)"
    )
    print(
        f"after recovery: {ms(recovered) * 1e3:.1f} ms per step (batches of {G // 2} cut into "
        f"{plan.micro_batch_size}s) vs {ms(leaner) * 1e3:.1f} ms planned leaner from the start: "
        f"throughput ratio {ms(leaner) / ms(recovered):.3f}"
    )


if __name__ == "__main__":
    main()
