"""``memkit advise``: where a step's peak holds memory it need not, each finding with its bytes and fix.

The step is simulated as ``memkit estimate`` simulates it (`lightning_memkit.advise`), then once more per
fix to price it; nothing is allocated and no GPU is needed.
"""

from __future__ import annotations

import argparse
import json
import time

from lightning.pytorch import LightningModule

from lightning_memkit._diagnosis.advise import advise
from lightning_memkit.cli._models import (
    analytic_shape,
    check_seq_len,
    example_batch,
    lm_loss,
    load_model,
    step_errors,
)
from lightning_memkit.cli._parsers import add_advise

__all__ = ["add_advise", "run_advise"]


def run_advise(args: argparse.Namespace) -> int:
    model = load_model(args.model)
    check_seq_len(model, analytic_shape(model)[0], args.seq_len)
    lightning = isinstance(model, LightningModule)
    start = time.perf_counter()
    with step_errors(model, args.model, args.batch_size, args.seq_len):
        advice = advise(
            model,
            example_batch(model, args.model, args.batch_size, args.seq_len),
            optimizer=args.optimizer if lightning else args.optimizer or "adamw",
            loss_fn=None if lightning else lm_loss,
            precision=args.precision,
            checkpointing=None if args.checkpointing == "none" else args.checkpointing,
            device=args.device,
            strategy=None if args.fsdp2 is None else "fsdp2",
            world_size=args.fsdp2 or 1,
        )
    seconds = time.perf_counter() - start
    if args.json:
        print(json.dumps({"model": args.model, **advice.as_dict(), "seconds": seconds}, indent=2))
    else:
        step = f"micro-batch {args.batch_size} x {args.seq_len}, {args.precision}, {args.device}"
        if args.fsdp2 is not None:
            step += f", one rank of {args.fsdp2} under FSDP2"
        print(f"{args.model}, {step}:")
        print(advice)
        print(f"advised in {seconds:.1f} s (simulated steps; nothing allocated)")
    return 0
