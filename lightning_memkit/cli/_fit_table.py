"""``memkit fit-table``: what fits a GPU, micro-batch x sequence length x precision, each cell simulated.

One table per precision: rows the micro-batches, columns the sequence lengths, each cell the simulated
peak with the lightest checkpointing that fits (`lightning_memkit._fitting.table.fit_table`), or ``over``;
under it the largest micro-batch at each sequence length and the longest sequence at micro-batch 1, with
the strongest checkpointing. The sequence lengths default to those within the model's block size.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from torch import nn

from lightning_memkit._breakdown import format_bytes
from lightning_memkit._diagnosis.report import render_table
from lightning_memkit._fitting.table import SEQ_STEP, FitTable, fit_table, seq_candidate
from lightning_memkit.cli._args import UsageError, usage_error
from lightning_memkit.cli._models import (
    analytic_shape,
    block_size,
    example_batch,
    load_model,
    optimizer_used,
    step_errors,
    step_options,
    weights_note,
)
from lightning_memkit.cli._parsers import FIT_SEQ_LENS, add_fit_table

__all__ = ["add_fit_table", "run_fit_table"]

#: What the cells say, under the tables.
LEGEND = (
    "Each cell: the simulated peak of one training step at that micro-batch (rows) and sequence length "
    "(columns), with the lightest checkpointing that fits; over: no mode fits (the peak with the strongest "
    "mode, or without a peak where a smaller cell is already over); largest micro-batch: any whole number, "
    "with {mode} checkpointing (at least N: every size up to --max-batch fits); not searched: "
    "--max-simulations ran out first."
)


def run_fit_table(args: argparse.Namespace) -> int:
    model = load_model(args.model, args.loop)
    block = _block_size(model)
    seq_lens = _seq_lens(args.seq_lens, block, model)
    args.optimizer_used, catalogued = optimizer_used(model, args.optimizer)
    options = step_options(model, args.optimizer)
    # A LightningModule's own optimizer by its catalogue name where it has one: its static floor is
    # counted, and at 16-bit weights its Kahan twin stepped, as memkit plan plans it
    options["optimizer"] = options["optimizer"] or catalogued
    start = time.perf_counter()
    at = [max(args.batch_sizes), max(seq_lens)]  # the cell whose batch was built last: the failing one

    def make(b: int, t: int) -> Any:
        at[:] = b, t
        return example_batch(model, args.model, b, t)

    # step_errors quiets torch's log of a failing meta kernel; the error is worded for the failing cell
    with step_errors(model, args.model, *at):
        try:
            table = fit_table(
                model,
                make,
                args.gpu,
                batch_sizes=args.batch_sizes,
                seq_lens=seq_lens,
                precisions=args.precision,
                modes=args.checkpointing,
                optimizer=options["optimizer"],
                loss_fn=options["loss_fn"],
                device=args.device,
                margin=args.margin,
                max_batch=args.max_batch,
                max_seq_len=block,
                max_simulations=args.max_simulations,
            )
        except Exception:
            with step_errors(model, args.model, *at) if ":" in args.model else usage_error(ValueError):
                raise
    seconds = time.perf_counter() - start
    if args.json:
        print(json.dumps(_report(args, table, seconds), indent=2))
        return 0
    print(
        f"What fits {args.gpu.source} ({format_bytes(table.limit)}: {format_bytes(args.gpu.usable)} usable "
        f"less the {args.margin:.0%} margin): {args.model}, {args.optimizer_used}, {args.device}"
    )
    print(weights_note(model, args.model, args.precision[0]))
    for precision in table.precisions:
        print(_precision_table(table, precision, block))
    print(LEGEND.format(mode=table.modes[-1]))
    bound = f"; stopped at --max-simulations {args.max_simulations}" if table.truncated else ""
    print(f"{table.simulations} steps simulated in {seconds:.1f} s{bound}")
    return 0


def _block_size(model: nn.Module) -> int | None:
    """The longest sequence the model takes (`block_size`), or a Hugging Face config's
    ``max_position_embeddings``; ``None`` where nothing says."""
    block = block_size(model, analytic_shape(model)[0])
    if block is not None:
        return block
    config = next((m.config for m in model.modules() if hasattr(m, "config")), None)
    return getattr(config, "max_position_embeddings", None)


def _seq_lens(given: tuple[int, ...] | None, block: int | None, model: nn.Module) -> tuple[int, ...]:
    """``--seq-lens``, each checked against the block size; by default `FIT_SEQ_LENS` within it (or the
    block size itself where it is shorter than them all)."""
    if given is not None:
        if block is not None and max(given) > block:
            raise UsageError(f"--seq-lens {max(given)} exceeds the model's block_size of {block}")
        return given
    if block is None:
        return FIT_SEQ_LENS
    return tuple(t for t in FIT_SEQ_LENS if t <= block) or (block,)


def _precision_table(table: FitTable, precision: str, block: int | None) -> str:
    """One precision's grid, its largest micro-batches under it and its longest sequence."""
    optimizer = table.optimizers[precision] or "configure_optimizers"
    floor = table.floors[precision]
    title = f"{precision}, {optimizer}: static floor {format_bytes(floor)}"
    if floor > table.limit:
        return f"{title}: over the limit, nothing fits (parameters, gradients and optimizer state alone)"
    header = ("micro-batch", *(f"T={t:,}" for t in table.seq_lens))
    rows = [
        (str(b), *(_cell_text(table, precision, b, t) for t in table.seq_lens)) for b in table.batch_sizes
    ]
    rows.append(("largest", *(_largest_text(table, precision, t) for t in table.seq_lens)))
    rendered = render_table(header, rows, left=("micro-batch",), bold=lambda row: row[0] == "largest")
    return f"{title}\n{rendered}\n{_longest_text(table, precision, block)}"


def _largest_text(table: FitTable, precision: str, t: int) -> str:
    found = table.largest.get((precision, t))
    if found is None:
        return "not searched"
    m, peak = found
    if not m:
        return "none"
    at_least = "at least " if (precision, t) in table.at_max_batch else ""
    return f"{at_least}{m} ({format_bytes(peak)})"


def _longest_text(table: FitTable, precision: str, block: int | None) -> str:
    found = table.longest.get(precision)
    if found is None:
        return "longest sequence at micro-batch 1: not searched (--max-simulations reached)"
    tokens, peak = found
    if not tokens:
        return f"not even {seq_candidate(1, table.max_seq_len):,} tokens fit at micro-batch 1"
    at_block = block is not None and tokens == table.max_seq_len
    capped = " (the model's block size: the most it takes)" if at_block else ""
    return (
        f"longest sequence at micro-batch 1 (in steps of {SEQ_STEP}): {tokens:,} tokens{capped}, peak "
        f"{format_bytes(peak)}, {table.modes[-1]} checkpointing"
    )


def _cell_text(table: FitTable, precision: str, b: int, t: int) -> str:
    cell = table.cell(precision, b, t)
    if cell.fits:
        assert cell.peak is not None
        return f"{format_bytes(cell.peak)} {cell.checkpointing}"
    if cell.peak is not None:
        return f"over ({format_bytes(cell.peak)})"
    return "over" if cell.known_over else "not simulated"


def _report(args: argparse.Namespace, table: FitTable, seconds: float) -> dict[str, Any]:
    """The ``--json`` object: byte counts are integers; ``cells`` one per precision x sequence x batch,
    ``checkpointing`` the lightest mode that fits (null: none), ``peak`` null where not simulated,
    ``state`` "fits", "over" or "not simulated"; a largest/longest ``searched`` false (its size null) where
    --max-simulations stopped it, ``at_max_batch`` true where every size up to --max-batch fits."""
    return {
        "model": args.model,
        "gpu": args.gpu.source,
        "device": args.device,
        "limit": table.limit,
        "optimizers": table.optimizers,
        "floors": table.floors,
        "modes": list(table.modes),
        "cells": [
            {
                "precision": c.precision,
                "batch_size": c.batch_size,
                "seq_len": c.seq_len,
                "checkpointing": c.checkpointing,
                "peak": c.peak,
                "fits": c.fits,
                "state": c.state,
            }
            for c in table.cells
        ],
        "largest": [
            {
                "precision": p,
                "seq_len": t,
                "micro_batch_size": found and found[0],
                "peak": found and found[1],
                "searched": found is not None,
                "at_max_batch": (p, t) in table.at_max_batch,
            }
            for (p, t), found in table.largest.items()
        ],
        "longest": [
            {
                "precision": p,
                "seq_len": found and found[0],
                "peak": found and found[1],
                "searched": found is not None,
            }
            for p, found in table.longest.items()
        ],
        "simulations": table.simulations,
        "truncated": table.truncated,
        "seconds": seconds,
    }
