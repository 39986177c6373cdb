"""``memkit plan``: the plan that fits a GPU, every configuration simulated, and the plan as Python.

The code printed is what a user pastes: the Trainer with ``AutoFit``, which makes the same plan as the fit
starts, and the plan set by hand (micro-batch, ``accumulate_grad_batches``, precision, strategy and
devices, ``ActivationCheckpointing``, the optimizer): `plan_code`, which an OOM explanation shares. When
nothing fits, the error (the floor, what would fit) follows what the smallest step tried needs by category.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from typing import Any

from torch import nn

from lightning_memkit._breakdown import format_bytes
from lightning_memkit._budget import CUDA_CONTEXT_BYTES, FRAGMENTATION_RESERVE, GPUS, Budget
from lightning_memkit._checkpointing.blocks import find_blocks
from lightning_memkit._diagnosis.plan_code import plan_code
from lightning_memkit._estimating.adapters import adapter_summary
from lightning_memkit._estimating.analytic import STRATEGIES, model_static, shard
from lightning_memkit._estimating.lightning_step import batch_slice
from lightning_memkit._estimating.precision import sixteen_bit_weights
from lightning_memkit._estimating.simulate import estimate_memory
from lightning_memkit._fitting.plan import FitPlan
from lightning_memkit._fitting.refusal import LOWER_PRECISION_HINT
from lightning_memkit._fitting.search import plan_fit, static_floor
from lightning_memkit._optimizers.swap import COMPENSATED, KAHAN, lighter_candidates
from lightning_memkit._step import LEVER_CALLBACKS, LEVERS
from lightning_memkit.cli._args import usage_error
from lightning_memkit.cli._models import (
    analytic_precision,
    analytic_shape,
    check_seq_len,
    example_batch,
    load_model,
    setup_code,
    step_errors,
    step_options,
    weights_note,
)
from lightning_memkit.cli._parsers import REFINE_LIMIT, RELAXED_PRECISIONS, add_plan

__all__ = ["REFINE_LIMIT", "RELAXED_PRECISIONS", "add_plan", "plan_code", "run_plan"]


def run_plan(args: argparse.Namespace) -> int:
    with usage_error(ValueError):
        _check_lever(args)
    model = load_model(args.model, args.loop, args.adapters)
    check_seq_len(model, analytic_shape(model)[0], args.seq_len)
    start = time.perf_counter()
    # The library's ValueErrors (nothing fits, a batch it cannot cut) say what to change; what else the
    # step raises is the user's model failing.
    with step_errors(model, args.model, args.global_batch, args.seq_len), usage_error(ValueError):
        batch = example_batch(model, args.model, args.global_batch, args.seq_len)
        found, relaxed, attempts, choice = _across_strategies(model, batch, args)
    seconds = time.perf_counter() - start
    code = plan_code(found, model, global_batch=args.global_batch, optimizers=args.optimizer)
    if args.adapters is not None:  # the peft and BitsAndBytesConfig lines before the Trainer's
        code = f"{setup_code(model, args.adapters)}\n\n{code}"
    given_up = _given_up(found, model, args, attempts[0]) if relaxed else []
    if args.json:
        data = {
            "model": args.model,
            "weights": weights_note(model, args.model, found.precision),
            "adapters": adapter_summary(model, args.adapters, model.lora_targets) if args.adapters else None,
            **found.as_dict(),
        }
        data |= {"strategy_choice": choice, "code": code, "seconds": seconds}
        print(json.dumps({**data, "gives_up": given_up}, indent=2))
    else:
        print(f"{args.model} on {args.gpu.source}, global batch {args.global_batch} x {args.seq_len}:")
        print(_budget_line(args.gpu, args.margin, args.device))
        print(weights_note(model, args.model, found.precision))
        if args.adapters is not None:
            print(adapter_summary(model, args.adapters, model.lora_targets))
        if choice:
            print(choice)
        print(found)
        if given_up:
            print(f"Nothing fits {_describe(attempts[0])}; this plan gives up:", *given_up, sep="\n  - ")
        print(f"The plan as code (Python):\n{code}")
        print(f"planned in {seconds:.1f} s ({len(found.alternatives)} simulated steps)")
    return 0


STRATEGY_CHOICE = ("ddp", "fsdp2")


def _check_lever(args: argparse.Namespace) -> None:
    """Refuse a lever flag the ranks asked for cannot run, in the command's words (`plan_fit` says the same
    in its keywords), before the model is loaded."""
    if args.gpus > 1 and args.offload:
        raise ValueError(
            f"--offload runs the optimizer on one process, its step after backward, not on {args.gpus} GPUs: "
            "plan it with --gpus 1"
        )
    if args.gpus > 1 and args.fused_step and args.strategy not in (None, "fsdp2"):
        raise ValueError(
            f"--fused-step cannot run under --strategy {args.strategy}: the optimizer step fused into "
            "backward reduces each gradient across ranks after backward. Plan it with --gpus 1 or --strategy "
            "fsdp2 (each shard steps once its reduce-scatter is done), or --release-gradients instead"
        )


def _across_strategies(
    model: nn.Module, batch: Any, args: argparse.Namespace
) -> tuple[FitPlan, bool, list[argparse.Namespace], str]:
    """The plan for ``--strategy``, or, with several GPUs and none named, the better of DDP's and FSDP2's:
    DDP where it fits as asked (each rank keeps the whole model; least communication), else FSDP2 where
    it fits as asked, else the better relaxed plan (`_rank`; DDP on a tie). Returns the plan, whether it
    relaxed the run as asked, the set-ups tried and a line saying which strategy and why (empty when it
    was named). A strategy named that does not fit while FSDP2 would is refused saying so: a refusal never
    says less than the planner would answer."""
    if args.strategy is not None or args.gpus == 1:
        strategy = args.strategy or "ddp"
        try:
            return (*_best_plan(model, batch, args, strategy), "")
        except ValueError as err:
            if strategy == "fsdp2" or args.gpus == 1 or not _no_fit(err):
                raise
            try:
                other, _, _ = _best_plan(model, batch, args, "fsdp2", quiet=True)
            except ValueError:
                raise err from None
            raise ValueError(
                f"{str(err).split('. ')[0]}. FSDP2 over {args.gpus} GPUs fits it: micro-batch "
                f"{other.micro_batch_size} x {other.accumulate_grad_batches}, {other.checkpointing} "
                f"checkpointing, peak {format_bytes(other.estimated_peak)} a rank; give --strategy fsdp2, or "
                "leave --strategy out to plan both"
            ) from err
    answers: dict[str, tuple[FitPlan, bool, list[argparse.Namespace]]] = {}
    errors: dict[str, ValueError] = {}
    for strategy in STRATEGY_CHOICE:
        try:
            answers[strategy] = _best_plan(model, batch, args, strategy, quiet=strategy == "ddp")
        except ValueError as err:  # for lack of memory, or a set-up DDP cannot run (the fused step)
            errors[strategy] = err
            if strategy == "ddp":
                why = _ddp_refused(err)
                print(f"memkit plan: {why}; planning FSDP2 over {args.gpus} GPUs", file=sys.stderr)
            continue
        if strategy == "ddp" and not answers["ddp"][1]:
            break  # DDP as asked: nothing to gain from sharding
    if not answers:
        if not _no_fit(errors["ddp"]):
            raise errors["fsdp2"] if _no_fit(errors["fsdp2"]) else errors["ddp"]
        raise ValueError(
            f"Neither DDP nor FSDP2 over {args.gpus} GPUs fits (--strategy ddp says why DDP does not); "
            f"FSDP2: {errors['fsdp2']}"
        )
    ddp, fsdp2 = answers.get("ddp"), answers.get("fsdp2")
    ranks = f"over {args.gpus} GPUs"
    if ddp is not None and not ddp[1]:
        return (*ddp, f"strategy: ddp {ranks} (it fits as asked; each rank keeps the whole model)")
    if ddp is not None and (
        fsdp2 is None or (fsdp2[1] and _rank(ddp[0], model, args) <= _rank(fsdp2[0], model, args))
    ):
        why = "no FSDP2 plan fits" if fsdp2 is None else "FSDP2 gives up as much or more"
        return (*ddp, f"strategy: ddp {ranks} ({why}; each rank keeps the whole model)")
    assert fsdp2 is not None
    why = "DDP fits only by giving up more" if ddp is not None else _ddp_refused(errors["ddp"])
    return (*fsdp2, f"strategy: fsdp2 {ranks} ({why}: --strategy ddp says why)")


def _ddp_refused(error: ValueError) -> str:
    """Why DDP was not planned, in a few words: no plan fits, or the first clause of why it cannot run."""
    return "no DDP plan fits" if _no_fit(error) else str(error).split(":")[0]


def _no_fit(error: ValueError) -> bool:
    """Whether ``error`` is `plan_fit`'s refusal for lack of memory (not a set-up it cannot run)."""
    return str(error).startswith("No plan fits")


def _best_plan(
    model: nn.Module, batch: Any, args: argparse.Namespace, strategy: str, *, quiet: bool = False
) -> tuple[FitPlan, bool, list[argparse.Namespace]]:
    """The plan under ``strategy``: as asked first; where nothing fits that way, every relaxed set-up, the
    best plan kept (`_rank`). Returns it, whether it relaxed the run, and the set-ups; raises the run as
    asked's `ValueError` where none fits (``quiet``: without the lines on stderr saying what was tried)."""
    args = argparse.Namespace(**{**vars(args), "strategy": strategy})
    loss_fn = step_options(model, None)["loss_fn"]
    attempts = _attempts(args)
    limit = int(args.gpu.usable * (1 - args.margin))
    frozen = _frozen_bytes(model, strategy, args.gpus)

    def plan(attempt: argparse.Namespace) -> FitPlan:
        return plan_fit(
            model,
            batch,
            args.gpu,
            margin=args.margin,
            optimizers=args.optimizer,
            precision=attempt.precision,
            strategy=args.strategy,
            world_size=args.gpus,
            device=args.device,
            loss_fn=loss_fn,
            cost="flops",
            progress=lambda line: print(f"memkit plan: {line}", file=sys.stderr, flush=True),
            lever=attempt.lever,
            refine_limit=args.refine_limit,  # a count, not a clock
            # FSDP2 on a GPU: offload if nothing fits
            cpu_offload=None if args.strategy == "fsdp2" and args.device == "cuda" else False,
            mp_policy=args.strategy == "fsdp2",  # bf16-mixed, as AutoFitStrategy shards it
        )

    # As asked first; where nothing fits that way, every relaxed set-up, the best plan kept: the
    # optimizer first (AdamW offloaded beats SGD fused), then the precision, then the lever.
    plans: list[FitPlan] = []
    tried: list[str] = []
    first_error: ValueError | None = None
    for i, attempt in enumerate(attempts):
        floor = static_floor(
            model, args.optimizer, attempt.precision, strategy=args.strategy, world_size=args.gpus,
            lever=attempt.lever,
        )  # fmt: skip
        floor = (
            None if floor is None else floor + frozen
        )  # a frozen base stays on the device whatever the lever
        if len(attempts) > 1 and floor is not None and floor > limit:  # known without a simulation
            tried.append(f"{_describe(attempt)}: static floor {format_bytes(floor)}")
            continue
        try:
            plans.append(plan(attempt))
        except ValueError as err:
            if i == 0 and not _no_fit(err):
                raise  # as asked, and not for lack of memory: the user's to fix
            first_error = first_error or (err if i == 0 else None)
            why = "no plan fits" if _no_fit(err) else str(err).split(":")[0]
            tried.append(f"{_describe(attempt)}: {why}")
            continue
        if i == 0:
            break
    relaxed = bool(plans) and i > 0
    if not plans:  # the answer for the run as asked, with its floor and what would fit
        if len(attempts) > 1 and not quiet:
            print("memkit plan: also tried, none fits:", *tried, sep="\n  ", file=sys.stderr)
        if first_error is None:
            try:
                plan(attempts[0])
            except ValueError as err:
                first_error = err
        assert first_error is not None, "the run as asked fits on a second try"
        if _no_fit(first_error):
            needs = "" if quiet else _smallest_step(model, batch, args, attempts[0])
            if needs:
                print(needs, file=sys.stderr)
        if any(len(a.precision) > len(attempts[0].precision) for a in attempts):
            # The lower precisions were tried already: no advice to allow them.
            raise ValueError(str(first_error).replace(LOWER_PRECISION_HINT, "")) from first_error
        raise first_error
    return min(plans, key=lambda p: _rank(p, model, args)), relaxed, attempts


def _frozen_bytes(model: nn.Module, strategy: str, world_size: int) -> int:
    """The bytes of the parameters no optimizer steps (an adapter fine-tune's base, 4-bit packed data as it
    is stored) one GPU holds: divided by ``world_size`` under a strategy that shards parameters. The static
    floor counts trainable parameters only; with this, a base too large for the card is known without a
    simulation of every relaxed set-up (each of a 70B model's takes a minute)."""
    frozen = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    sharded = strategy == "fsdp2" or "parameters" in STRATEGIES.get(strategy, ())
    return frozen // world_size if sharded else frozen


def _budget_line(budget: Budget, margin: float, device: str) -> str:
    """How the step's limit comes from the budget: what was taken off, and why; and, for a size in
    decimal gigabytes that names a card's binary size (``24GB`` for a 24 GiB RTX 4090), the card."""
    given = f"budget: {budget.source} = {format_bytes(budget.total)}"
    limit = f"less the {margin:.0%} margin: {format_bytes(int(budget.usable * (1 - margin)))}"
    if device == "cpu":
        return f"{given}; {limit}"
    line = (
        f"{given}, less the CUDA context ({format_bytes(CUDA_CONTEXT_BYTES)}) and the "
        f"{FRAGMENTATION_RESERVE:.0%} fragmentation reserve: {format_bytes(budget.usable)}; {limit}"
    )
    size = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*GB\s*", budget.source, re.IGNORECASE)
    cards = [name for name, mib in GPUS.items() if size and round(mib / 1024) == float(size[1])]
    if cards:
        line += (
            f"\nnote: {budget.source} is {float(size[1]):g} x 10^9 bytes; {', '.join(cards)} "
            f"{'has' if len(cards) == 1 else 'have'} {float(size[1]):g} GiB: --gpu {cards[0]} (or "
            f"--gpu {float(size[1]):g}GiB) plans for the card"
        )
    return line


def _attempts(args: argparse.Namespace) -> list[argparse.Namespace]:
    """The set-ups to plan, in order: as asked first, then with what the user left open relaxed."""
    asked = next((lever for lever in LEVERS if getattr(args, lever)), None)  # the flags exclude each other
    first = argparse.Namespace(precision=args.precision or ["32-true"], lever=asked)
    precisions = [args.precision] if args.precision else [list(RELAXED_PRECISIONS)]
    # one process only (FSDP2 steps each shard inside backward once its reduce-scatter is done)
    single = ("offload",) if args.strategy == "fsdp2" else ("fused_step", "offload")
    open_levers = [
        lever
        for lever in LEVERS
        if (args.gpus == 1 or lever not in single) and (args.device == "cuda" or lever != "offload")
    ]
    levers = [asked] if asked else [None, *open_levers]
    relaxed = [
        argparse.Namespace(precision=precision, lever=lever) for lever in levers for precision in precisions
    ]
    return [first, *(a for a in relaxed if vars(a) != vars(first))]


def _rank(plan: FitPlan, model: nn.Module, args: argparse.Namespace) -> tuple[int, int, int]:
    """``plan``'s place among the relaxed ones: its optimizer's in the candidates (a Kahan twin in its
    original's), its precision's (in the order given, else `RELAXED_PRECISIONS`), its lever's (none, then
    the cheapest in time)."""
    candidates = list(args.optimizer or lighter_candidates(model))
    precisions = list(args.precision or RELAXED_PRECISIONS)
    original = {twin: base for base, twin in COMPENSATED.items() if twin != base}
    optimizer = original.get(plan.optimizer or "", plan.optimizer)
    levers = [None, *LEVERS]
    return (
        candidates.index(optimizer) if optimizer in candidates else len(candidates),
        precisions.index(plan.precision) if plan.precision in precisions else len(precisions),
        levers.index(plan.lever),
    )


def _describe(attempt: argparse.Namespace) -> str:
    how = f"with {LEVER_CALLBACKS[attempt.lever]}" if attempt.lever else "without a step lever"
    return f"at {'/'.join(attempt.precision)} {how}"


def _given_up(
    plan: FitPlan, model: nn.Module, args: argparse.Namespace, asked: argparse.Namespace
) -> list[str]:
    """What ``plan`` gives up against the run as asked: precision, optimizer, time (empty: nothing)."""
    lines = []
    if plan.precision not in asked.precision:
        how = (
            "the update runs on fp32 master weights in host memory, so no small step is lost"
            if plan.lever == "offload" and sixteen_bit_weights(plan.precision)
            else "Kahan-summed, so no small step is lost"
            if plan.optimizer in KAHAN
            else "the weights stay fp32"
        )
        lines.append(f"precision: {plan.precision} instead of {asked.precision[0]} ({how})")
    wanted = args.optimizer[0] if args.optimizer else lighter_candidates(model)[0]
    if plan.optimizer != wanted and COMPENSATED.get(wanted or "") != plan.optimizer:
        lines.append(f"optimizer: {plan.optimizer} instead of {wanted}")
    if plan.lever == "offload" and asked.lever != "offload":
        lines.append(
            f"time: about {plan.offload_seconds:.2g} s per global batch of transfers to and from the host "
            "and the host's update (PCIe 4.0 x16, a few cores), and "
            f"{format_bytes(plan.host_bytes)} of host memory"
        )
    elif plan.lever == "fused_step" and asked.lever != "fused_step":
        lines.append("gradient accumulation and clipping (the step runs inside backward); no time")
    return lines


def _smallest_step(model: nn.Module, batch: Any, args: argparse.Namespace, asked: argparse.Namespace) -> str:
    """What the smallest step `plan_fit` tried needs per GPU, by category, when nothing fits: micro-batch
    1 (with the fused step, all of a GPU's batch), the strongest checkpointing, the first optimizer and
    precision allowed; its peak is the error's figure "with <optimizer> at micro-batch 1". One more
    simulation; nothing is said when it fails (a model whose step refuses one sample)."""
    per_gpu = args.global_batch // args.gpus
    m = per_gpu if asked.lever == "fused_step" else 1
    level = "full" if find_blocks(model) else "none"
    prec = asked.precision[0]
    optimizer = args.optimizer[0] if args.optimizer else lighter_candidates(model)[0]
    if optimizer is not None and sixteen_bit_weights(prec):
        optimizer = COMPENSATED.get(optimizer, optimizer)  # as plan_fit plans 16-bit weights
    try:
        need = estimate_memory(
            model,
            batch_slice(batch, m),
            **step_options(model, optimizer),
            precision=prec,
            checkpointing=level,
            device=args.device,
            accumulating=m < per_gpu,
            lever=asked.lever,
        )
    except Exception:
        return ""
    if args.gpus > 1:
        need = shard(
            need,
            args.strategy,
            args.gpus,
            gradient_bytes=model_static(model, analytic_precision(model, prec)).gradients,
        )
    per_rank = ", per GPU" if args.device == "cuda" else ", per rank" if args.gpus > 1 else ""
    return (
        f"memkit plan: the smallest step tried (micro-batch {m}, "
        f"{'no' if level == 'none' else level} checkpointing, {optimizer or 'the configured optimizer'}, "
        f"{prec}) needs{per_rank}:\n{need}"
    )
