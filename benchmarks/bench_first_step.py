"""What MemoryMonitor's first measured step costs in a fresh process, and where the time goes.

Each run is a fresh interpreter (imports, torch's first-step warm-ups and the CPU kernel helper all
paid again) training the README's tiny Hugging Face LLaMA (batch 16 x 64 tokens) for 8 steps in a
Trainer, in three ways, interleaved over ``--rounds``:

- ``plain``: no monitor;
- ``helper on demand``: MemoryMonitor with the kernel helper started by the first question a kernel
  asks inside the first measured step (as it was before it was started at setup);
- ``helper at setup``: MemoryMonitor as it is, the helper started in the background at ``setup``.

Printed per way (medians over rounds): the first step (batch 0's start to batch 1's), the steady step
(median of steps 2-7), the time the first step spent waiting for the helper's answers, the time
``on_train_start`` waited for the helper to be ready (before the first step), and the fit's wall time
(``trainer.fit`` from call to return).

    python benchmarks/bench_first_step.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

WAYS = ("plain", "helper on demand", "helper at setup")


def child(way: str) -> dict:
    """One fit in this (fresh) process; its figures as a dict."""
    import warnings

    warnings.filterwarnings("ignore")
    import logging

    logging.disable(logging.WARNING)
    started = time.perf_counter()
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.loggers import CSVLogger
    from transformers import AutoConfig, AutoModelForCausalLM

    from lightning_memkit import MemoryMonitor
    from lightning_memkit._measuring import kernels

    imports = time.perf_counter() - started
    waited = [0.0]
    request = kernels._WORKER._request

    def timed(*args):  # the time a step spends waiting for the helper's answers
        t = time.perf_counter()
        try:
            return request(*args)
        finally:
            waited[0] += time.perf_counter() - t

    kernels._WORKER._request = timed
    from lightning_memkit.callbacks import memory_monitor

    ready, before_fit = memory_monitor.helper_ready, [0.0]

    def timed_ready():  # what on_train_start waits for the helper, before the first step
        t = time.perf_counter()
        ready()
        before_fit[0] += time.perf_counter() - t

    memory_monitor.helper_ready = timed_ready
    if way == "helper on demand":
        kernels._WORKER.start = lambda: False  # the helper starts at the first question, as before

    class LM(pl.LightningModule):
        def __init__(self):
            super().__init__()
            config = AutoConfig.for_model(
                "llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, use_cache=False,
            )  # fmt: skip
            self.model = AutoModelForCausalLM.from_config(config)

        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch, labels=batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    class Timer(pl.Callback):
        def __init__(self):
            self.starts, self.waits = [], []

        def on_train_batch_start(self, *args):
            self.starts.append(time.perf_counter())
            self.waits.append(waited[0])

        def on_train_end(self, *args):
            self.starts.append(time.perf_counter())
            self.waits.append(waited[0])

    torch.manual_seed(0)
    data = torch.utils.data.DataLoader(torch.randint(0, 256, (8 * 16, 64)), batch_size=16)
    timer = Timer()
    callbacks = [timer] if way == "plain" else [timer, MemoryMonitor(plot=False, summary=False)]
    with __import__("tempfile").TemporaryDirectory() as root:
        trainer = pl.Trainer(
            default_root_dir=root, max_steps=8, accelerator="cpu", logger=CSVLogger(root),
            callbacks=callbacks, enable_progress_bar=False, enable_model_summary=False,
            enable_checkpointing=False,
        )  # fmt: skip
        fit = time.perf_counter()
        trainer.fit(LM(), data)
        fit = time.perf_counter() - fit
    steps = [b - a for a, b in zip(timer.starts, timer.starts[1:], strict=False)]
    return {
        "imports": imports,
        "first": steps[0],
        "steady": statistics.median(steps[2:]),
        "helper_wait": timer.waits[1] - timer.waits[0],
        "before_first": before_fit[0],
        "fit": fit,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", choices=WAYS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child)))
        return
    runs: dict[str, list[dict]] = {way: [] for way in WAYS}
    for _ in range(args.rounds):
        for way in WAYS:
            out = subprocess.run(
                [sys.executable, __file__, "--child", way], capture_output=True, text=True, check=True
            ).stdout
            runs[way].append(json.loads(out.strip().splitlines()[-1]))
    print(f"MemoryMonitor's first step in a fresh process (tiny HF LLaMA, 16 x 64), median of {args.rounds}")
    print(
        f"{'way':<18}{'first step s':>13}{'steady s':>10}{'helper wait s':>15}{'waited before s':>17}"
        f"{'fit s':>8}{'imports s':>11}"
    )
    for way, rows in runs.items():
        median = {key: statistics.median(row[key] for row in rows) for key in rows[0]}
        print(
            f"{way:<18}{median['first']:>13.2f}{median['steady']:>10.3f}{median['helper_wait']:>15.2f}"
            f"{median['before_first']:>17.2f}{median['fit']:>8.2f}{median['imports']:>11.2f}"
        )


if __name__ == "__main__":
    main()
