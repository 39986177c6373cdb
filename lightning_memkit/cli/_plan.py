"""``memkit plan``: the plan that fits a GPU, every configuration simulated, and the plan as Python.

The code printed is what a user pastes: the Trainer with ``AutoFit``, which makes the same plan as the fit
starts, and the plan set by hand (micro-batch, ``accumulate_grad_batches``, precision, strategy and
devices, ``ActivationCheckpointing``, the optimizer): `plan_code`, which an OOM explanation shares. When
nothing fits, the error (the floor, what would fit) follows what the smallest step tried needs by category.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from lightning.pytorch import LightningModule
from torch import nn

from lightning_memkit._analytic import STRATEGIES, model_static, shard
from lightning_memkit._autofit import plan_fit
from lightning_memkit._blocks import find_blocks
from lightning_memkit._lightning import batch_slice
from lightning_memkit._oom import plan_code
from lightning_memkit._optimizer_state import OPTIMIZERS
from lightning_memkit._optimizers import COMPENSATED, lighter_candidates
from lightning_memkit._simulate import PRECISION_DTYPES, estimate_memory, sixteen_bit_weights
from lightning_memkit.cli._args import UsageError, gpu, margin, names, one_of, positive_int, usage_error
from lightning_memkit.cli._models import (
    add_model_argument,
    analytic_shape,
    check_seq_len,
    example_batch,
    lm_loss,
    load_model,
    step_errors,
)

__all__ = ["add_plan", "plan_code", "run_plan"]


def add_plan(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "plan",
        help="micro-batch, accumulation, checkpointing and optimizer that fit a GPU, and the what-if table",
        description=(
            "Search micro-batch x gradient accumulation x checkpointing x optimizer (x precision) on "
            "simulated steps and print the fastest plan whose peak fits the GPU, with every configuration "
            "simulated. Nothing is allocated; no GPU is needed."
        ),
    )
    add_model_argument(p)
    p.add_argument(
        "--gpu",
        type=gpu,
        required=True,
        metavar="GPU|SIZE",
        help="a GPU name (A100-40GB) or a card size (24GB)",
    )
    p.add_argument("--global-batch", type=positive_int, required=True, metavar="G", help="samples per step")
    p.add_argument("--seq-len", type=positive_int, required=True, metavar="T", help="tokens per sequence")
    p.add_argument("--gpus", type=positive_int, default=1, metavar="N", help="ranks (default: 1)")
    p.add_argument(
        "--strategy", type=one_of("strategy", list(STRATEGIES)), default="ddp", metavar="S",
        help=f"{', '.join(STRATEGIES)} (default: ddp)",
    )  # fmt: skip
    p.add_argument("--margin", type=margin, default=0.1, help="share of the budget kept free (default: 0.1)")
    p.add_argument(
        "--precision", type=names("precision", list(PRECISION_DTYPES)), default="32-true",
        metavar="P[,P...]",
        help="allowed precisions, in order of preference (default: 32-true)",
    )  # fmt: skip
    p.add_argument(
        "--optimizer", type=names("optimizer", list(OPTIMIZERS)), default=None, metavar="O[,O...]",
        help="candidate optimizers in quality order (default: the model's own, then the lighter ones)",
    )  # fmt: skip
    lever = p.add_mutually_exclusive_group()
    lever.add_argument(
        "--release-gradients", action="store_true",
        help="plan with GradientRelease: no previous step's gradients in the forward",
    )  # fmt: skip
    lever.add_argument(
        "--fused-step", action="store_true",
        help="plan with FusedOptimizerStep: each parameter stepped inside backward (no accumulation, 1 GPU)",
    )  # fmt: skip
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    p.set_defaults(run=run_plan)


def run_plan(args: argparse.Namespace) -> int:
    model = load_model(args.model)
    check_seq_len(model, analytic_shape(model)[0], args.seq_len)
    if args.global_batch % args.gpus:
        raise UsageError(
            f"--global-batch {args.global_batch} does not split evenly across --gpus {args.gpus}"
        )
    lightning = isinstance(model, LightningModule)
    start = time.perf_counter()
    # The library's ValueErrors (nothing fits, a batch it cannot cut) say what to change; what else the
    # step raises is the user's model failing.
    with step_errors(model, args.model, args.global_batch, args.seq_len), usage_error(ValueError):
        batch = example_batch(model, args.model, args.global_batch, args.seq_len)
        try:
            plan = plan_fit(
                model,
                batch,
                args.gpu,
                margin=args.margin,
                optimizers=args.optimizer,
                precision=args.precision,
                strategy=args.strategy,
                n_gpus=args.gpus,
                device="cuda",
                loss_fn=None if lightning else lm_loss,
                cost="flops",
                progress=lambda line: print(f"memkit plan: {line}", file=sys.stderr, flush=True),
                release_gradients=args.release_gradients,
                fused_step=args.fused_step,
            )
        except ValueError as err:
            needs = _smallest_step(model, batch, args) if str(err).startswith("No plan fits") else ""
            if needs:
                print(needs, file=sys.stderr)
            raise
    seconds = time.perf_counter() - start
    lever = "GradientRelease" if args.release_gradients else "FusedOptimizerStep" if args.fused_step else None
    code = plan_code(plan, model, global_batch=args.global_batch, optimizers=args.optimizer, lever=lever)
    if args.json:
        print(json.dumps({"model": args.model, **plan.as_dict(), "code": code, "seconds": seconds}, indent=2))
    else:
        print(f"{args.model} on {args.gpu.source}, global batch {args.global_batch} x {args.seq_len}:")
        print(plan)
        print(f"The plan as code (Python):\n{code}")
        print(f"planned in {seconds:.1f} s ({len(plan.alternatives)} simulated steps)")
    return 0


def _smallest_step(model: nn.Module, batch: Any, args: argparse.Namespace) -> str:
    """What the smallest step `plan_fit` tried needs per GPU, by category, when nothing fits: micro-batch
    1 (with the fused step, all of a GPU's batch), the strongest checkpointing, the first optimizer and
    precision allowed; its peak is the error's figure "with <optimizer> at micro-batch 1". One more
    simulation; nothing is said when it fails (a model whose step refuses one sample)."""
    per_gpu = args.global_batch // args.gpus
    m = per_gpu if args.fused_step else 1
    level = "full" if find_blocks(model) else "none"
    prec = args.precision[0]
    optimizer = args.optimizer[0] if args.optimizer else lighter_candidates(model)[0]
    if optimizer is not None and sixteen_bit_weights(prec):
        optimizer = COMPENSATED.get(optimizer, optimizer)  # as plan_fit plans 16-bit weights
    lightning = isinstance(model, LightningModule)
    try:
        need = estimate_memory(
            model,
            batch_slice(batch, m),
            optimizer=optimizer if optimizer is not None or lightning else "adamw",
            loss_fn=None if lightning else lm_loss,
            precision=prec,
            checkpointing=level,
            device="cuda",
            accumulating=m < per_gpu,
            release_gradients=args.release_gradients,
            fused_step=args.fused_step,
        )
    except Exception:
        return ""
    if args.gpus > 1:
        need = shard(need, args.strategy, args.gpus, gradient_bytes=model_static(model, prec).gradients)
    return (
        f"memkit plan: the smallest step tried (micro-batch {m}, "
        f"{'no' if level == 'none' else level} checkpointing, {optimizer or 'the configured optimizer'}, "
        f"{prec}) needs, per GPU:\n{need}"
    )
