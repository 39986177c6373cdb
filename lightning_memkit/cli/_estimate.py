"""``memkit estimate``: one training step's peak memory by category, analytic and simulated side by side.

The ``analytic`` column is architecture arithmetic (for the GPT presets, models carrying a ``GPTConfig``,
and Hugging Face GPT-2, GPT-NeoX and LLaMA-family models whose ``.config`` maps onto it parameter for
parameter; otherwise a note says why not), the ``simulated`` one the step run on fake tensors
(`lightning_memkit.estimate_memory`), and ``difference`` is simulated minus analytic. Two lines under the
table say which to plan with (the simulated one: the model's own code ran) and why they differ, from the
figures: the categories that differ most and what the analytic model leaves out there (the logits and the
loss's buffers, gradients not yet made at the simulated peak). With ``--gpu`` a line says whether the
simulated step fits the card and, when it does not, the fastest plans that do follow, as code. With
``--html FILE`` the same simulation is also written as one self-contained HTML page
(`_diagnosis.html_report`): the step's timeline by category, the breakdown and top modules at its peak.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from torch import nn

from lightning_memkit._breakdown import CATEGORIES, MemoryBreakdown, format_bytes
from lightning_memkit._diagnosis.html_report import html_report
from lightning_memkit._diagnosis.oom import plans_section, run_candidates
from lightning_memkit._diagnosis.report import render_table
from lightning_memkit._diagnosis.snapshot import simulated_snapshot, write_snapshot
from lightning_memkit._estimating.adapters import adapter_summary
from lightning_memkit._estimating.analytic import (
    STRATEGIES,
    TransformerShape,
    estimate_analytic,
    model_static,
    shard,
)
from lightning_memkit._estimating.fake_tracker import TimelineEvent
from lightning_memkit._estimating.simulate import estimate_memory
from lightning_memkit.cli._args import layout_keywords, layout_words
from lightning_memkit.cli._models import (
    analytic_precision,
    analytic_shape,
    check_seq_len,
    example_batch,
    load_model,
    optimizer_used,
    setup_code,
    step_errors,
    step_options,
    weights_note,
)
from lightning_memkit.cli._parsers import add_estimate

__all__ = ["add_estimate", "run_estimate"]


def run_estimate(args: argparse.Namespace) -> int:
    model = load_model(args.model, args.loop, args.adapters)
    shape, note = analytic_shape(model)
    check_seq_len(model, shape, args.seq_len)
    args.optimizer_used, catalogued = optimizer_used(model, args.optimizer)
    notes: list[str] = [weights_note(model, args.model, args.precision)]
    if args.adapters is not None:  # the analytic model counts a full fine-tune of unquantized weights
        shape, note = None, "analytic: not available for an adapter fine-tune (it trains every weight)"
        notes.insert(0, adapter_summary(model, args.adapters, model.lora_targets))
    notes += [note] if note else []
    analytic = None
    if shape is not None:
        if catalogued is None:
            notes.append(
                f"analytic: {args.optimizer_used} is not in the catalogue; its state is AdamW's there"
            )
        analytic = estimate_analytic(
            shape,
            args.batch_size,
            args.seq_len,
            precision=analytic_precision(model, args.precision),
            optimizer=catalogued or "adamw",
            checkpointing=args.checkpointing,
            attention="sdpa",
        )
    start = time.perf_counter()
    with step_errors(model, args.model, args.batch_size, args.seq_len):
        simulated, at_peak, snapshot = _simulate(model, args)
    seconds = time.perf_counter() - start
    notes.append(f"simulated: one step on fake tensors in {seconds:.1f} s")
    if args.html is not None:
        assert snapshot is not None
        notes.append(_write_html(args, snapshot, simulated))
    if args.snapshot is not None:
        notes.append(
            f"snapshot of the simulated step written to {args.snapshot}: open it with `python -m "
            f"torch.cuda._memory_viz trace_plot {args.snapshot} -o snapshot.html`, or drop it on "
            "https://pytorch.org/memory_viz"
        )
    if args.strategy == "fsdp2":
        analytic = shard(analytic, args.strategy, args.gpus) if analytic is not None else None
        notes.append(
            f"per rank: one rank's step of {args.gpus} under {args.sharding.describe()} simulated, "
            f"{layout_words(args.sharding)} (analytic: the one-device step's parameters, gradients and "
            "state divided)"
        )
    elif args.gpus > 1 or args.strategy != "ddp":
        sharded = STRATEGIES[args.strategy]
        analytic = shard(analytic, args.strategy, args.gpus) if analytic is not None else None
        grads = model_static(model, analytic_precision(model, args.precision)).gradients
        simulated = shard(simulated, args.strategy, args.gpus, gradient_bytes=grads)
        buckets = " and adds its all-reduce buckets (a copy of the gradients)" if args.gpus > 1 else ""
        notes.append(
            f"per rank: {args.strategy} over {args.gpus} GPU(s) divides "
            f"{', '.join(sharded) or 'nothing'} by {args.gpus}{buckets if not sharded else ''}"
        )
    explanation = _explain(args, shape, analytic, simulated, at_peak) if analytic is not None else []
    fit = _fit(model, args, simulated) if args.gpu is not None else []
    code = setup_code(model, args.adapters) if args.adapters is not None else None
    if args.json:
        report = _report(args, analytic, simulated, seconds, [*explanation, *notes])
        if args.gpu is not None:
            report |= {"gpu": args.gpu.source, "fits": simulated.peak <= args.gpu.usable, "fit": fit}
        print(json.dumps(report | ({"adapters": code} if code is not None else {}), indent=2))
    else:
        setup = [f"The adapter set-up as code (Python):\n{code}"] if code is not None else []
        print("\n".join([_table(args, analytic, simulated, [*explanation, *notes]), *fit, *setup]))
    return 0


def _fit(model: nn.Module, args: argparse.Namespace, simulated: MemoryBreakdown) -> list[str]:
    """With ``--gpu``: whether one rank's step fits the card (what it leaves after the CUDA context and
    reserve) and, when it does not, the fastest plans that do for the same global batch (batch size x
    accumulation x GPUs), precision and strategy: the plans an OOM's explanation gives (`plans_section`)."""
    budget = args.gpu
    usable = f"{format_bytes(budget.usable)} usable on {budget.source}"
    if simulated.peak <= budget.usable:
        return [f"Fits: {format_bytes(simulated.peak)} of the {usable}."]
    global_batch = args.batch_size * args.accumulate * args.gpus
    with step_errors(model, args.model, global_batch, args.seq_len):
        batch = example_batch(model, args.model, global_batch, args.seq_len)
    over = format_bytes(simulated.peak - budget.usable)
    return [
        f"Does not fit: {format_bytes(simulated.peak)}, {over} more than the {usable}.",
        *plans_section(
            model,
            batch,
            budget,
            optimizers=run_candidates(model, args.optimizer),
            precision=args.precision,
            strategy=args.strategy,
            world_size=args.gpus,
            device=args.device,
            loss_fn=step_options(model, args.optimizer)["loss_fn"],
            **({"sharding": args.sharding} if args.sharding is not None else {}),
        ),
    ]


def _simulate(
    model: nn.Module, args: argparse.Namespace
) -> tuple[MemoryBreakdown, TimelineEvent | None, dict | None]:
    """The simulated step's breakdown, the op at which its peak falls (the first of the highest) and, with
    ``--snapshot`` or ``--html``, the step as a PyTorch memory snapshot from the same simulation (written to
    ``--snapshot``'s file)."""
    batch = example_batch(model, args.model, args.batch_size, args.seq_len)
    kwargs: dict[str, Any] = dict(
        **step_options(model, args.optimizer),
        precision=args.precision,
        checkpointing=None if args.checkpointing == "none" else args.checkpointing,
        device=args.device,
        accumulating=args.accumulate > 1,
        **layout_keywords(args),  # the others divide the one-device step
    )
    snapshot = None
    if args.snapshot is None and args.html is None:
        breakdown = estimate_memory(model, batch, **kwargs, timeline=True)
        timeline = breakdown.timeline or []
    else:
        snapshot, tracker = simulated_snapshot(model, batch, timeline=True, **kwargs)
        if args.snapshot is not None:
            write_snapshot(snapshot, args.snapshot)
        breakdown, timeline = tracker.breakdown(), tracker.timeline or []
    return breakdown, max(timeline, key=lambda event: event.live, default=None), snapshot


def _write_html(args: argparse.Namespace, snapshot: dict, simulated: MemoryBreakdown) -> str:
    """Write ``--html``'s page of the simulated step (before any division over ranks: the step simulated)
    and return the note saying where."""
    title = (
        f"{args.model}: one training step, batch {args.batch_size} x {args.seq_len}, {args.precision}, "
        f"{args.optimizer_used}, {args.device}"
    )
    notes = ["memkit estimate: the simulated column's step, on fake tensors (nothing allocated)."]
    if args.strategy == "fsdp2":
        title += f", one rank of {args.gpus} under {args.sharding.describe()}"
    elif args.gpus > 1 or args.strategy != "ddp":
        notes.append(
            f"The one-device step, as simulated: the table divides it per rank ({args.strategy} over "
            f"{args.gpus} GPU(s))."
        )
    page = html_report(
        snapshot,
        simulated,
        title=title,
        notes=notes,
        no_findings=f"Run memkit advise --model {args.model} with the same arguments for what the peak "
        "holds that it need not, with the bytes each fix saves and the fix.",
    )
    with open(args.html, "w", encoding="utf-8") as f:
        f.write(page)
    return f"HTML report of the simulated step written to {args.html} (self-contained: open it in a browser)"


def _difference(analytic: MemoryBreakdown, simulated: MemoryBreakdown) -> dict[str, int]:
    """Simulated minus analytic, in bytes, per category and for the peak."""
    a, s = analytic.as_dict(), simulated.as_dict()
    return {name: s[name] - a[name] for name in (*CATEGORIES, "peak")}


def _signed(n: int) -> str:
    return f"+{format_bytes(n)}" if n > 0 else format_bytes(n)


def _explain(
    args: argparse.Namespace,
    shape: TransformerShape,
    analytic: MemoryBreakdown,
    simulated: MemoryBreakdown,
    at_peak: TimelineEvent | None,
) -> list[str]:
    """Two lines under the table: which column to plan with, and why they differ, from the figures.

    The second names the categories that differ by at least 1 % of the larger peak (at most three, the
    largest first), each with what the analytic model leaves out or assumes there: the logits and the
    loss's buffers (B x T x vocab elements, several fp32 copies at a language model's peak), every
    gradient counted as live (the simulated peak may fall before the backward has made them: Lightning
    zeroes them after the forward), all of autocast's weight copies counted at once.
    """
    op = at_peak.op.removesuffix(".default") if at_peak is not None else ""
    where = f"; its peak falls in the {at_peak.phase}, at {op}" if at_peak is not None else ""
    trust = (
        f"Plan with the simulated column: it runs the model's own code{where}. The analytic one is "
        "architecture arithmetic, for what-ifs or without the model's code."
    )
    diff = _difference(analytic, simulated)
    floor = 0.01 * max(analytic.peak, simulated.peak)
    differing = sorted((c for c in CATEGORIES if abs(diff[c]) >= floor), key=lambda c: -abs(diff[c]))[:3]
    ratio = f" ({simulated.peak / analytic.peak:.2f}x)" if analytic.peak else ""
    total = f"simulated - analytic: {_signed(diff['peak'])}{ratio}"
    if not differing:
        return [trust, f"{total}; no category differs by 1 %."]
    higher = {c for c in differing if diff[c] > 0}
    lower = {c for c in differing if diff[c] < 0}
    why = []
    if higher & {"activations", "temporary"}:
        logits = args.batch_size * args.seq_len * shape.vocab_size  # (B, T, V) elements
        why.append(
            f"leaves out the logits and the loss's buffers ({args.batch_size} x {args.seq_len} x "
            f"{shape.vocab_size:,} = {format_bytes(4 * logits)} per fp32 copy)"
        )
    if "gradients" in lower:
        made = "none exists" if simulated.gradients == 0 else f"{format_bytes(simulated.gradients)} exist"
        why.append(f"counts every gradient as live ({made} at the simulated peak)")
    if "temporary" in lower and analytic.temporary:
        copies = format_bytes(analytic.temporary)
        why.append(f"counts all of autocast's weight copies as live at once ({copies})")
    parts = ", ".join(f"{c} {_signed(diff[c])}" for c in differing)
    because = f" Analytic {', '.join(why[:-1])}{' and ' if len(why) > 1 else ''}{why[-1]}." if why else ""
    return [trust, f"{total}: {parts}.{because}"]


def _report(
    args: argparse.Namespace,
    analytic: MemoryBreakdown | None,
    simulated: MemoryBreakdown,
    seconds: float,
    notes: list[str],
) -> dict[str, Any]:
    """The ``--json`` object. Byte counts are integers; ``difference`` is simulated minus analytic per
    category (negative where analytic is higher); ``analytic``/``difference`` are null when there is no
    analytic column. ``notes`` starts with `_explain`'s two lines when there is. With ``--gpu``,
    `run_estimate` adds ``gpu`` (its name or size), ``fits`` (the simulated peak within what the card
    leaves) and ``fit`` (the lines printed under the table: `_fit`'s)."""
    return {
        "model": args.model,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "precision": args.precision,
        "optimizer": args.optimizer,
        "optimizer_used": args.optimizer_used,
        "checkpointing": args.checkpointing,
        "device": args.device,
        "gpus": args.gpus,
        "strategy": args.strategy,
        "tensor_parallel": args.tensor_parallel,
        "replicate": args.replicate,
        "analytic": analytic.as_dict() if analytic is not None else None,
        "simulated": simulated.as_dict(),
        "difference": _difference(analytic, simulated) if analytic is not None else None,
        "simulated_seconds": seconds,
        "notes": notes,
    }


def _table(
    args: argparse.Namespace, analytic: MemoryBreakdown | None, simulated: MemoryBreakdown, notes: list[str]
) -> str:
    """A header line, then categories as rows and the two estimates and their difference as columns."""
    title = (
        f"Peak memory of one training step: {args.model}, batch {args.batch_size} x {args.seq_len}, "
        f"{args.precision}, {args.optimizer_used}, {args.device}"
    )
    diff = _difference(analytic, simulated) if analytic is not None else None
    rows = [
        (
            name,
            format_bytes(getattr(analytic, name)) if analytic is not None else "—",
            format_bytes(getattr(simulated, name)),
            _signed(diff[name]) if diff is not None else "—",
        )
        for name in (*CATEGORIES, "peak")
    ]
    table = render_table(
        ("category", "analytic", "simulated", "difference"),
        rows,
        left=("category",),
        bold=lambda row: row[0] == "peak",
    )
    return "\n".join([title, table, *notes])
