"""``memkit plan``: the plan that fits a GPU, every configuration simulated, and the plan as Python.

The code printed is what a user pastes: the Trainer with ``AutoFit``, which makes the same plan as the fit
starts, and the plan set by hand (micro-batch, ``accumulate_grad_batches``, precision, strategy and
devices, ``ActivationCheckpointing``, the optimizer).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Mapping
from typing import Any

from lightning.pytorch import LightningModule
from torch import nn

from lightning_memkit._analytic import STRATEGIES
from lightning_memkit._autofit import plan_fit
from lightning_memkit._budget import GPUS
from lightning_memkit._checkpointing import CHECKPOINT_MODES
from lightning_memkit._fitplan import FitPlan
from lightning_memkit._optimizer_state import OPTIMIZERS
from lightning_memkit._optimizers import COMPENSATED, DEFAULT_CANDIDATES, KAHAN, own_optimizer
from lightning_memkit._simulate import PRECISION_DTYPES
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
        plan = plan_fit(
            model,
            example_batch(model, args.model, args.global_batch, args.seq_len),
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


def plan_code(
    plan: FitPlan,
    model: nn.Module,
    *,
    global_batch: int,
    optimizers: tuple[str, ...] | None,
    lever: str | None = None,
) -> str:
    """The plan as Python a user pastes: the Trainer with ``AutoFit``, which makes this plan as the fit
    starts, then the same set by hand: the micro-batch (the DataLoader's batch size), the Trainer's
    arguments, checkpointing as a callback (its policy, or the step's limit when the blocks' modes differ:
    ActivationCheckpointing then plans the split), and an optimizer swap as a comment (it goes in
    ``configure_optimizers``). ``optimizers`` are the candidates ``--optimizer`` gave, if any; ``lever`` the
    callback that changes the step the plan was made for (``"FusedOptimizerStep"``), in both Trainers."""
    budget, named = plan.budget, plan.budget.source in GPUS
    # AutoFit reads a size as the step's limit, not as a card's: a card size is given as what it leaves.
    autofit = {"budget": json.dumps(budget.source) if named else f"{budget.usable:_}"}
    if plan.margin != 0.1:
        autofit["margin"] = repr(plan.margin)
    if plan.optimizer in KAHAN:  # AutoFit plans them only when named (it keeps the Trainer's optimizer)
        kahan = dict.fromkeys(COMPENSATED.get(o) for o in (optimizers or DEFAULT_CANDIDATES))
        autofit["optimizers"] = json.dumps([o for o in kahan if o is not None])
    elif optimizers is not None:
        autofit["optimizers"] = json.dumps(list(optimizers))
    trainer = {"precision": json.dumps(plan.precision)}
    if plan.n_gpus > 1:
        trainer |= {"strategy": json.dumps(plan.strategy), "devices": str(plan.n_gpus)}
    by_hand = {"accumulate_grad_batches": str(plan.accumulate_grad_batches), **trainer}
    per_block = plan.checkpointing not in CHECKPOINT_MODES  # the blocks' modes differ ("2 selective, 2 full")
    # ActivationCheckpointing plans a budget on the unsharded step (and refuses to under FSDP): with a
    # sharded strategy a per-block plan is written as its strongest mode on every block, which fits too.
    sharded = plan.n_gpus > 1 and plan.strategy != "ddp"
    strongest = max(
        plan.checkpoint_plan.policies.values() if plan.checkpoint_plan else [plan.checkpointing],
        key=CHECKPOINT_MODES.index,
    )
    levers = [f"{lever}()"] if lever else []
    if per_block and not sharded:  # no one policy names it: ActivationCheckpointing plans the split
        levers.append(f"ActivationCheckpointing(budget={plan.limit:_})")
    elif plan.checkpointing != "none":
        levers.append(f"ActivationCheckpointing(policy={json.dumps(strongest)})")
    if levers:
        by_hand["callbacks"] = f"[{', '.join(levers)}]"
    imports = sorted({"AutoFit", *(c.split("(")[0] for c in levers)})
    with_autofit = [f"AutoFit({_arguments(autofit)})", *([f"{lever}()"] if lever else [])]
    card = f"#    The budget is what a {budget.source} card leaves after the CUDA context and reserve."
    per_gpu = global_batch // plan.n_gpus
    lines = [
        "from lightning.pytorch import Trainer",
        f"from lightning_memkit import {', '.join(imports)}",
        "",
        "# 1. AutoFit makes this plan as fit starts, reading batch_size (module or DataModule) as the",
        f"#    global batch per GPU, here {per_gpu}; it sets micro-batch and accumulation itself.",
        *([] if named else [card]),
        _call("trainer = Trainer", {**trainer, "callbacks": f"[{', '.join(with_autofit)}]"}),
        "",
        "# 2. Or by hand: batch_size is the micro-batch, the DataLoader's batch size.",
        f"batch_size = {plan.micro_batch_size}",
        _call("trainer = Trainer", by_hand),
    ]
    if per_block and sharded:
        lines.append(
            f"#    The plan checkpoints block by block ({plan.checkpointing}); under {plan.strategy} "
            f"every block gets {strongest}: it fits too, for more recompute."
        )
    elif per_block:
        lines.append(
            f"#    Checkpointing block by block ({plan.checkpointing}), planned for the step's limit."
        )
    own = own_optimizer(model) if isinstance(model, LightningModule) else None
    if plan.optimizer is not None and plan.optimizer != own:
        name = json.dumps(plan.optimizer)
        if isinstance(model, LightningModule):
            instead = own or "the configured one"
            lines += [
                f"#    Optimizer {plan.optimizer} in place of {instead}: in configure_optimizers,",
                f"#    return lightning_memkit.swap_optimizer(optimizer, {name})",
            ]
        else:
            lines.append(f"#    Optimizer: {plan.optimizer}, lightning_memkit.CATALOGUE[{name}].")
    return "\n".join(lines)


def _arguments(kwargs: Mapping[str, str]) -> str:
    return ", ".join(f"{k}={v}" for k, v in kwargs.items())


def _call(head: str, kwargs: Mapping[str, str]) -> str:
    """``head(k=v, ...)`` on one line, or one argument a line when that is over 100 characters."""
    one_line = f"{head}({_arguments(kwargs)})"
    if len(one_line) <= 100:
        return one_line
    return "\n".join([f"{head}(", *(f"    {k}={v}," for k, v in kwargs.items()), ")"])
