"""``memkit advise``: where a step's peak holds memory it need not, each finding with its bytes and fix.

The step is simulated as ``memkit estimate`` simulates it (`lightning_memkit.advise`), then once more per
fix to price it; nothing is allocated and no GPU is needed. With ``--html FILE`` the advised step is also
recorded as a memory snapshot (`_diagnosis.snapshot`) and written as one self-contained HTML page
(`_diagnosis.html_report`): its timeline, the breakdown and top modules at the peak, and the findings.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from lightning_memkit._diagnosis.advise import Advice, advise
from lightning_memkit._diagnosis.html_report import html_report
from lightning_memkit._diagnosis.snapshot import advised_snapshot
from lightning_memkit._step import Step
from lightning_memkit.cli._args import layout_keywords
from lightning_memkit.cli._models import (
    analytic_shape,
    check_seq_len,
    example_batch,
    load_model,
    step_errors,
    step_options,
    weights_note,
)
from lightning_memkit.cli._parsers import add_advise

__all__ = ["add_advise", "run_advise"]


def run_advise(args: argparse.Namespace) -> int:
    model = load_model(args.model, args.loop)
    check_seq_len(model, analytic_shape(model)[0], args.seq_len)
    step = Step.of(
        precision=args.precision,
        checkpointing=None if args.checkpointing == "none" else args.checkpointing,
        **layout_keywords(args),  # DDP's ranks each run the one-device step
    )
    kwargs: dict[str, Any] = dict(**step_options(model, args.optimizer), device=args.device, step=step)
    start = time.perf_counter()
    with step_errors(model, args.model, args.batch_size, args.seq_len):
        batch = example_batch(model, args.model, args.batch_size, args.seq_len)
        if args.html is None:
            advice = advise(model, batch, **kwargs)
        else:  # the advised step itself recorded, for the page
            advice, snapshot = advised_snapshot(model, batch, **kwargs)
    seconds = time.perf_counter() - start
    step = f"micro-batch {args.batch_size} x {args.seq_len}, {args.precision}, {args.device}"
    if args.strategy == "fsdp2":
        step += f", one rank of {args.gpus} under {args.sharding.describe()}"
    elif args.gpus > 1:
        step += f", the step each of {args.gpus} DDP ranks runs (its all-reduce buckets aside)"
    if args.html is not None:
        _write_html(args, snapshot, advice, step)
    if args.json:
        html = {"html": args.html} if args.html is not None else {}
        weights = {"weights": weights_note(model, args.model, args.precision)}
        print(
            json.dumps(
                {"model": args.model, **weights, **advice.as_dict(), "seconds": seconds, **html}, indent=2
            )
        )
    else:
        print(f"{args.model}, {step}:")
        print(weights_note(model, args.model, args.precision))
        print(advice)
        print(f"advised in {seconds:.1f} s (simulated steps; nothing allocated)")
        if args.html is not None:
            print(f"HTML report of the step and its findings written to {args.html} (self-contained)")
    return 0


def _write_html(args: argparse.Namespace, snapshot: dict, advice: Advice, step: str) -> None:
    """Write ``--html``'s page: the step's snapshot (its peak must be the advice's) and the findings."""
    page = html_report(
        snapshot,
        advice.breakdown,
        advice.findings,
        title=f"{args.model}: one training step, {step}",
        notes=[
            f"memkit advise: the step peaks in the {advice.peak_phase}; each finding priced by simulating "
            "the step with its fix (nothing allocated)."
        ],
    )
    with open(args.html, "w", encoding="utf-8") as f:
        f.write(page)
