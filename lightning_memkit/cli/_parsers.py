"""The subcommands' argument parsers, built from light modules only: no torch, Lightning or transformers.

``memkit --help``, ``memkit plan --help`` and a usage error are answered from here in a fraction of a
second; only once the arguments parse does `main` call the subcommand's ``run``, which imports its
module (`lightning_memkit.cli._estimate`, ``_plan``, ``_diagnosis.advise``) and with it torch and Lightning.

The names the arguments accept are the library's own, from its torch-free modules: the GPU table
(`lightning_memkit._budget.GPUS`), the optimizers
(`lightning_memkit._estimating.optimizer_state.OPTIMIZERS`), the
presets and strategies (`lightning_memkit._estimating.analytic`) and the rest
(`lightning_memkit._vocabulary`).
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from typing import Any

from lightning_memkit._budget import GPUS, Budget, parse_budget
from lightning_memkit._estimating import analytic as _analytic
from lightning_memkit._estimating.adapters import QUANTIZATIONS, AdapterSetup, targets_text
from lightning_memkit._estimating.optimizer_state import OPTIMIZERS
from lightning_memkit._vocabulary import CHECKPOINT_MODES, DEVICES, PRECISIONS
from lightning_memkit.cli._args import (
    UsageError,
    check_tokens,
    count,
    gpu_or_memory,
    margin,
    module_names,
    names,
    one_of,
    output_file,
    positive_int,
    positive_ints,
    usage_error,
)

__all__ = [
    "add_adapter_arguments",
    "add_advise",
    "add_estimate",
    "add_fit_table",
    "add_model_argument",
    "add_plan",
    "add_step_arguments",
    "check_adapters",
    "deferred",
]

#: ``--loop``: the order a plain module's step runs in (`lightning_memkit.cli._models.load_model`).
LOOPS = ("lightning", "plain")
#: The GPT presets, and the strategies a step is sharded by, by Lightning's names (and ``"fsdp2"``).
PRESETS = tuple(_analytic.PRESETS)
STRATEGIES = tuple(name for name in _analytic.STRATEGIES if name != _analytic.SHARD_GRAD_OP)
#: What `memkit plan` relaxes, in order, when nothing fits as asked: precisions (unless ``--precision``
#: names them), then the levers that change the step (unless one is named), cheapest first.
RELAXED_PRECISIONS = ("32-true", "bf16-mixed", "bf16-true")
#: ``--refine-limit``'s default: the micro-batches given a block-by-block checkpointing plan; a 7B model's
#: plan, whose steps take seconds each to simulate, answers in under a minute on two cores.
REFINE_LIMIT = 7

_GPU_HELP = f"a GPU name ({', '.join(GPUS)}) or a card size (24GB)"


def deferred(
    module: str, name: str, check: Callable[[argparse.Namespace], None] | None = None
) -> Callable[[argparse.Namespace], int]:
    """A subcommand's ``run``: ``check(args)`` (what the arguments say together, without the model:
    raises `UsageError`), then ``lightning_memkit.cli.<module>.<name>``, imported when first called."""

    def run(args: argparse.Namespace) -> int:
        if check is not None:
            check(args)
        return getattr(importlib.import_module(f"lightning_memkit.cli.{module}"), name)(args)

    run.__name__ = run.__qualname__ = name
    return run


def add_model_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        required=True,
        metavar="PRESET|MODULE:FACTORY|hf:DIR",
        help=f"a GPT preset ({', '.join(PRESETS)}), package.module:factory (no arguments, returns an "
        "nn.Module or LightningModule; called under the meta device) or hf:<directory or org/name>: a "
        "Hugging Face model from its config.json, random weights (an org/name from the local cache only: "
        "nothing is downloaded)",
    )
    p.add_argument(
        "--loop",
        choices=LOOPS,
        default="lightning",
        help="the order a plain nn.Module's (or hf: model's) step runs in: lightning (default), as a "
        "LightningModule around it trains under a Trainer: training_step, zero_grad, backward, step, so the "
        "previous step's gradients are alive through the forward; plain: zero_grad, forward, backward, step "
        "(a loop of your own). A LightningModule always runs Lightning's",
    )


def add_step_arguments(
    p: argparse.ArgumentParser,
    *,
    checkpointing: str = "none, selective (matmul and attention outputs kept, the rest recomputed), "
    "selective_half (every second matmul recomputed too) or full (every repeated block recomputed)",
) -> None:
    """``--model`` and the one training step simulated: ``--batch-size``, ``--seq-len``, ``--precision``,
    ``--optimizer``, ``--checkpointing`` (``checkpointing``: its help) and ``--device``."""
    add_model_argument(p)
    p.add_argument(
        "--batch-size", type=positive_int, required=True, metavar="B", help="micro-batch per device"
    )
    p.add_argument("--seq-len", type=positive_int, required=True, metavar="T", help="tokens per sequence")
    p.add_argument(
        "--precision",
        type=one_of("precision", PRECISIONS),
        default="32-true",
        metavar="P",
        help=f"a Lightning precision: {', '.join(PRECISIONS)} (default: 32-true)",
    )
    p.add_argument(
        "--optimizer",
        type=one_of("optimizer", list(OPTIMIZERS)),
        default=None,
        metavar="O",
        help=f"{', '.join(OPTIMIZERS)} (default: a LightningModule's configure_optimizers, else adamw)",
    )
    p.add_argument(
        "--checkpointing",
        type=one_of("checkpointing", CHECKPOINT_MODES),
        default="none",
        metavar=f"{{{','.join(CHECKPOINT_MODES)}}}",
        help=f"{checkpointing} (default: none)",
    )
    p.add_argument(
        "--device",
        type=one_of("device", DEVICES),
        default="cuda",
        metavar="{cuda,cpu}",
        help="the device to plan for: cuda (512-byte allocator blocks, foreach optimizers) or cpu "
        "(default: cuda; no GPU is needed)",
    )


def add_adapter_arguments(p: argparse.ArgumentParser) -> None:
    """``--lora RANK``, ``--lora-targets`` and ``--quantize``: an adapter fine-tune of the model
    (`lightning_memkit._estimating.adapters`), checked by `check_adapters` before anything is imported."""
    p.add_argument(
        "--lora", type=positive_int, default=None, metavar="RANK",
        help="train LoRA adapters of this rank (peft's LoraConfig(r=RANK)) over the frozen model; the "
        "optimizer steps the adapters only",
    )  # fmt: skip
    p.add_argument(
        "--lora-targets", type=module_names, default=None, metavar="NAME[,NAME...]",
        help="the modules LoRA adapts (peft's target_modules, or all-linear); default: every block linear "
        "of a LLaMA-family model (q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj) or a GPT preset "
        "(c_attn,c_proj,c_fc,c_gate), else peft's default for the family",
    )  # fmt: skip
    p.add_argument(
        "--quantize", type=one_of("quantization", QUANTIZATIONS), default="none",
        metavar="{" + ",".join(QUANTIZATIONS) + "}",
        help="the frozen base's linear layers but the head as transformers' BitsAndBytesConfig loads them: "
        "nf4 or fp4 (4-bit, double quantization, bf16 compute: QLoRA), int8 (LLM.int8()), none (default); "
        "needs --lora",
    )  # fmt: skip
    p.set_defaults(adapters=None)  # the AdapterSetup `check_adapters` makes of them


def check_adapters(args: argparse.Namespace) -> None:
    """``--lora``, ``--lora-targets`` and ``--quantize`` together: a quantized base or targets need
    adapters to train. Sets ``args.adapters``: the `AdapterSetup`, or ``None``."""
    if args.lora is None:
        if args.quantize != "none":
            raise UsageError(
                f"--quantize {args.quantize} freezes the whole base in {args.quantize}, leaving nothing to "
                f"train; give --lora RANK too (QLoRA: --lora 8 --quantize {args.quantize})"
            )
        if args.lora_targets is not None:
            raise UsageError(
                f"--lora-targets {targets_text(args.lora_targets)} says where LoRA adapters go; give their "
                "rank too: --lora 8"
            )
        args.adapters = None
        return
    args.adapters = AdapterSetup(args.lora, args.lora_targets, args.quantize, sharded=args.gpus > 1)


#: What ``memkit advise --strategy`` advises: the one-device step each DDP rank runs, or one FSDP2 rank's.
ADVISED_STRATEGIES = ("ddp", "fsdp2")


def _add_ranks(
    p: argparse.ArgumentParser,
    *,
    sharded: str,
    strategies: tuple[str, ...] = STRATEGIES,
    default: str | None = "ddp",
    layouts: bool = False,
) -> None:
    """``--gpus N`` and ``--strategy S``, spelled alike in every subcommand (``sharded``: the strategy's
    help); with ``layouts``, fsdp2's ``--tensor-parallel T`` and ``--replicate R`` (`check_layout`)."""
    p.add_argument(
        "--gpus", type=positive_int, default=1, metavar="N", help="ranks, one GPU each (default: 1)"
    )
    p.add_argument(
        "--strategy", type=one_of("strategy", strategies), default=default, metavar="S", help=sharded
    )
    if not layouts:
        return
    p.add_argument(
        "--tensor-parallel", type=positive_int, default=1, metavar="T",
        help="with --strategy fsdp2: ranks of one tensor-parallel group, each block's projections split "
        "over them (torchtitan's LLaMA plan), FSDP2 over the other --gpus / T (default: 1)",
    )  # fmt: skip
    p.add_argument(
        "--replicate", type=positive_int, default=1, metavar="R",
        help="with --strategy fsdp2: HSDP, each parameter sharded over --gpus / T / R ranks and "
        "replicated R times (default: 1)",
    )  # fmt: skip


def check_layout(args: argparse.Namespace) -> None:
    """``--tensor-parallel`` and ``--replicate`` as `Sharding` takes them: with ``--strategy fsdp2``,
    dividing the ranks; ``args.sharding`` the layout (``None`` for one device or a divided strategy)."""
    from lightning_memkit._step import Sharding

    args.sharding = None
    flags = (("--tensor-parallel", args.tensor_parallel), ("--replicate", args.replicate))
    given = [f"{flag} {n}" for flag, n in flags if n != 1]
    if args.strategy != "fsdp2":
        if given:
            raise UsageError(f"{' and '.join(given)} is a layout of --strategy fsdp2, not {args.strategy}")
        return
    with usage_error(ValueError):
        args.sharding = Sharding(
            args.gpus, tensor_parallel_size=args.tensor_parallel, replicate_size=args.replicate
        )


def check_advise(args: argparse.Namespace) -> None:
    """The batch's token count, and with ``--strategy fsdp2`` its layout (`check_layout`)."""
    check_tokens(args.batch_size, args.seq_len)
    check_layout(args)


def check_plan(args: argparse.Namespace) -> None:
    """What ``memkit plan``'s arguments say together, before the model is built: the global batch splits
    over the GPUs, ``--gpu`` for ``--device`` (`Budget`: on cuda the card less the CUDA context and
    reserve; on cpu the size as given, a GPU name refused: it says nothing of the host's memory), and no
    GPU lever on a CPU."""
    check_tokens(args.global_batch, args.seq_len)
    check_adapters(args)
    if args.global_batch % args.gpus:
        raise UsageError(
            f"--global-batch {args.global_batch} does not split evenly across --gpus {args.gpus}; give a "
            f"multiple of {args.gpus} ({args.global_batch // args.gpus * args.gpus or args.gpus} or "
            f"{(args.global_batch // args.gpus + 1) * args.gpus})"
        )
    args.gpu = _device_budget(args.gpu, args.device, "--gpu/--memory")
    if args.device == "cpu" and args.offload:
        raise UsageError("--offload moves the optimizer from a GPU to the host; --device cpu has no GPU")


def check_estimate(args: argparse.Namespace) -> None:
    """The batch's token count (all ranks' and micro-batches' at once, as ``--gpu``'s plans cut it), and
    ``memkit estimate --gpu`` for ``--device``, as `check_plan` reads it."""
    check_tokens(args.batch_size * (args.accumulate * args.gpus if args.gpu is not None else 1), args.seq_len)
    check_layout(args)
    check_adapters(args)
    if args.gpu is not None:
        args.gpu = _device_budget(args.gpu, args.device, "--gpu")


def _device_budget(text: str, device: str, flag: str) -> Budget:
    """``--gpu`` for ``--device``: on cuda the card less the CUDA context and reserve; on cpu the size as
    given, nothing taken off, and a GPU name refused (it says nothing of the host's memory)."""
    on_cpu = device == "cpu"
    try:
        budget = parse_budget(text, device_size=not on_cpu)
    except ValueError as e:  # a size too small for the CUDA context; on a CPU: --device cpu
        raise UsageError(f"argument {flag}: {e} (planning a CPU run? --device cpu)") from None
    if on_cpu and budget.source in GPUS:
        raise UsageError(
            f"--device cpu plans for the memory a CPU run may use, and {budget.source} names a GPU; give "
            f"a size instead: {flag.split('/')[-1]} 16GB"
        )
    return budget


def _add_html(p: argparse.ArgumentParser, *, findings: str = "") -> None:
    """``--html FILE``: the simulated step's peak as one self-contained HTML page."""
    p.add_argument(
        "--html",
        type=output_file,
        default=None,
        metavar="FILE",
        help="also write one self-contained HTML page (inline SVG, nothing fetched) of the simulated step: "
        "its timeline by category with the phases and the peak marked, the breakdown and the top modules "
        f"at the peak{findings}",
    )


def add_estimate(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "estimate",
        help="one training step's peak memory by category: analytic, simulated and their difference",
        description=(
            "Print one training step's peak memory by category, analytic and simulated side by side, with "
            "their difference and why they differ (plan with the simulated one). "
            "The batch is (x, y): int64 token ids of shape (batch-size, seq-len), unless the module "
            "defines example_batch(batch_size, seq_len)."
        ),
        epilog=(
            "A LightningModule runs its own training_step (and configure_optimizers unless --optimizer is "
            "given); a plain nn.Module is stepped as a language model, cross_entropy(model(x), y) over its "
            "output's last dimension; a Hugging Face model as model(input_ids=x, labels=x).loss. Nothing is "
            "allocated: the model is built on the meta device and the step runs on fake tensors."
        ),
    )
    add_step_arguments(p)
    p.add_argument(
        "--accumulate",
        type=positive_int,
        default=1,
        metavar="K",
        help="micro-batches per optimizer step (default: 1); above 1 the simulated column is the highest "
        "micro-batch, whose backward adds to gradients already there",
    )
    _add_ranks(
        p,
        sharded=f"{', '.join(STRATEGIES)} (default: ddp): what it shards is divided by --gpus, except fsdp2: "
        "one rank's FSDP2 step simulated (fully_shard on each block, then the model)",
        layouts=True,
    )
    p.add_argument(
        "--gpu",
        type=gpu_or_memory,
        default=None,
        metavar="GPU|SIZE",
        help=f"{_GPU_HELP} the step should fit (with --device cpu, the memory it may use: a size, nothing "
        "taken off): when it does not, the fastest plans that do (micro-batch, accumulation, "
        "checkpointing, optimizer), as code",
    )
    p.add_argument(
        "--snapshot",
        type=output_file,
        default=None,
        metavar="FILE",
        help="also write the simulated step as a PyTorch memory snapshot (torch.cuda.memory._dump_snapshot's "
        "pickle; one rank's step with --strategy fsdp2, else the one-device step) to open in torch's memory "
        "viewer: python -m torch.cuda._memory_viz trace_plot FILE -o FILE.html, or pytorch.org/memory_viz",
    )
    _add_html(p)
    add_adapter_arguments(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.set_defaults(run=deferred("_estimate", "run_estimate", check=check_estimate))


def _add_card(p: argparse.ArgumentParser) -> None:
    """``--gpu``/``--memory`` (required) and ``--device``, as `check_plan` reads them together."""
    p.add_argument(
        "--gpu", "--memory", dest="gpu", type=gpu_or_memory, required=True, metavar="GPU|SIZE",
        help=f"{_GPU_HELP}; with --device cpu, the memory the step may use (a size: 16GB)",
    )  # fmt: skip
    p.add_argument(
        "--device", type=one_of("device", DEVICES), default="cuda", metavar="{cuda,cpu}",
        help="the device to plan for (default: cuda): on cuda the CUDA context (512 MiB) and a 5%% "
        "fragmentation reserve are taken off the card first, and the step is simulated in the caching "
        "allocator's 512-byte blocks; on cpu nothing is taken off the size given",
    )  # fmt: skip


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
    _add_card(p)
    p.add_argument("--global-batch", type=positive_int, required=True, metavar="G", help="samples per step")
    p.add_argument("--seq-len", type=positive_int, required=True, metavar="T", help="tokens per sequence")
    _add_ranks(
        p, default=None,
        sharded=f"{', '.join(STRATEGIES)}: the step divided, except fsdp2: one rank's FSDP2 step simulated "
        "(default: ddp on one GPU; on several, ddp and fsdp2 both planned, and the plan says which)",
    )  # fmt: skip
    p.add_argument("--margin", type=margin, default=0.1, help="share of the budget kept free (default: 0.1)")
    p.add_argument(
        "--precision", type=names("precision", PRECISIONS), default=None,
        metavar="P[,P...]",
        help="allowed precisions, in order of preference (default: 32-true; where nothing fits, "
        f"{', '.join(RELAXED_PRECISIONS)})",
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
    lever.add_argument(
        "--offload", action="store_true",
        help="plan with OptimizerOffload: the optimizer's state, fp32 masters and gradients in host memory "
        "(1 GPU)",
    )  # fmt: skip
    p.add_argument(
        "--refine-limit", type=count, default=REFINE_LIMIT, metavar="N",
        help="the micro-batches given a block-by-block checkpointing plan, the largest first; the rest are "
        f"planned with full checkpointing: a count, so the plan is the same on a busy machine (default: "
        f"{REFINE_LIMIT})",
    )  # fmt: skip
    add_adapter_arguments(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    p.set_defaults(run=deferred("_plan", "run_plan", check=check_plan))


def add_advise(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "advise",
        help="the memory one training step holds at its peak that it need not, with the bytes each fix saves",
        description=(
            "Simulate one training step, name what its peak holds that it need not (the previous step's "
            "gradients, logits, activations a checkpointing plan would drop, gradients no optimizer uses, "
            "parameters the loss never reaches), and price each fix by simulating the step with it."
        ),
    )
    add_step_arguments(p, checkpointing="the checkpointing the run already uses")
    _add_ranks(
        p,
        strategies=ADVISED_STRATEGIES,
        sharded="ddp (default): the one-device step each rank runs; fsdp2: one rank's FSDP2 step "
        "(fully_shard on each block, then the model), simulated in this process",
        layouts=True,
    )
    _add_html(p, findings=", and the findings with their fixes")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.set_defaults(run=deferred("_advise", "run_advise", check=check_advise))


#: ``memkit fit-table``'s default grid: micro-batches, sequence lengths (those past the model's block size
#: left out), precisions and checkpointing modes, lightest first.
FIT_BATCHES, FIT_SEQ_LENS = (1, 2, 4, 8, 16, 32), (512, 1024, 2048, 4096)
FIT_PRECISIONS, FIT_MODES = ("32-true", "bf16-mixed", "bf16-true"), ("none", "full")
#: ``--max-simulations``' default: a 7B model's steps take about a second each on two cores.
FIT_SIMULATIONS = 120


def add_fit_table(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "fit-table",
        help="what fits a GPU: micro-batch x sequence length x precision, each cell a simulated step",
        description=(
            "Print, for each precision, a micro-batch x sequence length table for one GPU: each cell the "
            "simulated peak of one training step with the lightest checkpointing that fits (none, then "
            "full; --checkpointing none,selective,full tries selective between), or over; under it the "
            "largest micro-batch that fits at each sequence length (any whole number, not a power of two) "
            "and the longest sequence at micro-batch 1, both with the strongest checkpointing. Nothing is "
            "allocated; no GPU is needed."
        ),
        epilog=(
            "Cells are skipped, not guessed: a precision whose parameters, gradients and optimizer state "
            "alone are over the limit is not simulated, and a mode over the limit at a cell is not tried "
            "at larger ones (a step's peak grows with its batch and sequence). At 16-bit weights (bf16-true, "
            "16-true) AdamW and SGD are stepped as their Kahan-summed twins, as memkit plan plans them. "
            "--max-simulations bounds the work by a count, never a clock."
        ),
    )
    add_model_argument(p)
    _add_card(p)
    p.add_argument(
        "--batch-sizes", type=positive_ints, default=FIT_BATCHES, metavar="B[,B...]",
        help=f"the micro-batches, the rows (default: {','.join(map(str, FIT_BATCHES))})",
    )  # fmt: skip
    p.add_argument(
        "--seq-lens", type=positive_ints, default=None, metavar="T[,T...]",
        help=f"the sequence lengths, the columns (default: {','.join(map(str, FIT_SEQ_LENS))}, up to the "
        "model's block size)",
    )  # fmt: skip
    p.add_argument(
        "--precision", type=names("precision", PRECISIONS), default=FIT_PRECISIONS, metavar="P[,P...]",
        help=f"the precisions, one table each (default: {','.join(FIT_PRECISIONS)})",
    )  # fmt: skip
    p.add_argument(
        "--checkpointing", type=names("checkpointing", CHECKPOINT_MODES), default=FIT_MODES,
        metavar="MODE[,MODE...]",
        help=f"the checkpointing modes a cell tries, lightest first (default: {','.join(FIT_MODES)})",
    )  # fmt: skip
    p.add_argument(
        "--optimizer", type=one_of("optimizer", list(OPTIMIZERS)), default=None, metavar="O",
        help="the optimizer stepped (default: a LightningModule's configure_optimizers, else adamw; at "
        "16-bit weights its Kahan-summed twin where it has one)",
    )  # fmt: skip
    p.add_argument("--margin", type=margin, default=0.1, help="share of the budget kept free (default: 0.1)")
    p.add_argument(
        "--max-batch", type=positive_int, default=4096, metavar="N",
        help="the largest micro-batch the search for the largest tries (default: 4096)",
    )  # fmt: skip
    p.add_argument(
        "--max-simulations", type=positive_int, default=FIT_SIMULATIONS, metavar="N",
        help=f"at most this many simulated steps; cells past it say so (default: {FIT_SIMULATIONS})",
    )  # fmt: skip
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    p.set_defaults(run=deferred("_fit_table", "run_fit_table", check=check_fit_table))


def check_fit_table(args: argparse.Namespace) -> None:
    """The largest cell's token count, and ``--gpu`` for ``--device`` as `check_plan` reads it."""
    check_tokens(max(args.batch_sizes), max(args.seq_lens or FIT_SEQ_LENS))
    args.gpu = _device_budget(args.gpu, args.device, "--gpu/--memory")
