"""The ``memkit`` command: a run's training memory before the run, from the shell.

    memkit estimate --model gpt2 --batch-size 8 --seq-len 1024 --precision bf16-mixed --optimizer adamw

prints one training step's peak memory by category in three columns side by side: ``analytic``
(architecture arithmetic, `estimate_analytic`; GPT presets, models carrying a ``GPTConfig``, and Hugging
Face GPT-2, GPT-NeoX and LLaMA-family models whose ``.config`` maps onto it parameter for parameter,
`TransformerShape.from_hf_config`; otherwise a note says why not) and
``simulated`` (the step run on fake tensors, `estimate_memory`), and their ``difference`` (simulated
minus analytic); two lines under the table say which to plan with (the simulated one: the model's own
code ran) and why they differ, from the figures: the categories that differ most and what the analytic
model leaves out there (the logits and the loss's buffers, gradients not yet made at the simulated peak).
``--json`` prints the same as one JSON object; ``--gpus N --strategy S`` shows one rank's share under that
strategy.

    memkit plan --model gpt2 --gpu A100-40GB --global-batch 64 --seq-len 1024 --precision bf16-mixed

prints the plan that fits, every configuration simulated, and the plan as Python to paste: the Trainer
with ``AutoFit``, which makes the plan as the fit starts, and the same set by hand (micro-batch,
``accumulate_grad_batches``, precision, strategy and devices, ``ActivationCheckpointing``, the optimizer).

The model (``--model``) is a preset of the bundled GPT demo (``tiny``, ``gpt2``, ... ``llama-7b``) or
``package.module:factory``, a callable taking no arguments that returns an ``nn.Module`` or a
``LightningModule``. The factory is called under ``torch.device("meta")``, so a model built the usual
way is never allocated; the current directory is importable.

The example batch, for any model: if the module has a method ``example_batch(batch_size, seq_len)``,
what it returns is the batch (build it on the meta device to keep it free). Otherwise the batch is
``(x, y)``, two int64 token-id tensors of shape ``(batch_size, seq_len)``: what a causal language
model's ``training_step`` takes. A ``LightningModule`` runs its own ``training_step`` (and
``configure_optimizers`` unless ``--optimizer`` is given); a plain ``nn.Module`` is stepped as a
language model, ``cross_entropy(model(x), y)`` over its output's last dimension (the first element of
a tuple output), with ``--optimizer`` (default ``adamw``). A Hugging Face ``PreTrainedModel`` is stepped
as it trains itself: ``model(input_ids=x, labels=x)`` and the ``loss`` of its ``ModelOutput`` (a model
without ``labels`` in its ``forward``: cross-entropy over its ``logits``, else its first output). The
header names the optimizer the simulated step uses: ``--optimizer``, what ``configure_optimizers`` builds,
or ``adamw``.

Adding a subcommand: write ``_add_<name>(subparsers)`` that adds its parser with ``set_defaults(run=...)``,
where ``run(args) -> int``, and list it in ``SUBCOMMANDS``. Raise `UsageError` for bad input, or run
what may fail on it under `_usage_error`: `main` prints it as one line and returns 2. Bad input includes
the user's own code (the factory, ``example_batch``, the model's step): its exception becomes that line,
with what was being done and how to fix it; a preset failing is our bug, and keeps its traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import functools
import importlib
import inspect
import json
import logging
import os
import reprlib
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from lightning_memkit._analytic import (
    OPTIMIZERS,
    STRATEGIES,
    TransformerShape,
    count_parameters,
    estimate_analytic,
    model_static,
    shard,
    valid_name,
)
from lightning_memkit._breakdown import CATEGORIES, MemoryBreakdown, format_bytes
from lightning_memkit._simulate import DEVICES, PRECISION_DTYPES, TimelineEvent, estimate_memory

if TYPE_CHECKING:
    from lightning_memkit._autofit import FitPlan

__all__ = ["SUBCOMMANDS", "UsageError", "main"]


class UsageError(Exception):
    """Bad input from the command line; `main` prints it as one line and exits with status 2."""


@contextlib.contextmanager
def _usage_error(*catch: type[Exception], context: str = "", fix: str = "") -> Iterator[None]:
    """Raise what ``catch`` (default: any exception) catches as a one-line `UsageError`.

    Without ``context`` the message's first line is the whole error (the library's own ``ValueError``s
    already say what to change); with it, ``context: Type: first line; fix`` (the user's code failed, and
    the type is half the story). The one place where bad input becomes exit status 2.
    """
    kinds = catch or (Exception,)
    try:
        yield
    except UsageError:
        raise
    except kinds as e:
        first = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
        message = f"{context}: {type(e).__name__}{': ' if first else ''}{first}" if context else first
        raise UsageError(f"{message.rstrip('.')}; {fix}" if fix else message) from e


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage block), so the reason is the whole message."""

    def error(self, message: str) -> Any:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


# --------------------------------------------------------------------------------------------------
# Argument types
# --------------------------------------------------------------------------------------------------


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def _gpu(text: str) -> Any:
    """``--gpu``: a `Budget` from a GPU name or a card size; ``0.5`` (a size without its unit) is refused."""
    from lightning_memkit._budget import parse_budget

    try:
        value = float(text)
    except ValueError:
        value = None
    if value is not None and not value.is_integer():
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither a GPU name nor a card size; give a name (A100-40GB) or a size with its "
            "unit (24GB, 24GiB)"
        )
    try:
        return parse_budget(text, device_size=True)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _one_of(kind: str, valid: Sequence[str]) -> Callable[[str], str]:
    def parse(text: str) -> str:
        try:
            return valid_name(kind, text, valid)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parse.__name__ = kind  # argparse names the type in some messages
    return parse


# --------------------------------------------------------------------------------------------------
# memkit estimate
# --------------------------------------------------------------------------------------------------


def _add_estimate(subparsers: Any) -> None:
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
    p.add_argument(
        "--model",
        required=True,
        metavar="PRESET|MODULE:FACTORY",
        help="a GPT preset (tiny, gpt2, gpt2-medium, gpt2-large, gpt2-xl, llama-7b) or "
        "package.module:factory (no arguments, returns an nn.Module or LightningModule; called under the "
        "meta device)",
    )
    p.add_argument(
        "--batch-size", type=_positive_int, required=True, metavar="B", help="micro-batch per device"
    )
    p.add_argument("--seq-len", type=_positive_int, required=True, metavar="T", help="tokens per sequence")
    p.add_argument(
        "--precision",
        type=_one_of("precision", list(PRECISION_DTYPES)),
        default="32-true",
        metavar="P",
        help=f"a Lightning precision: {', '.join(PRECISION_DTYPES)} (default: 32-true)",
    )
    p.add_argument(
        "--optimizer",
        type=_one_of("optimizer", list(OPTIMIZERS)),
        default=None,
        metavar="O",
        help=f"{', '.join(OPTIMIZERS)} (default: a LightningModule's configure_optimizers, else adamw)",
    )
    p.add_argument(
        "--checkpointing",
        type=_one_of("checkpointing", ("none", "selective", "full")),
        default="none",
        metavar="{none,selective,full}",
        help="none, selective (matmul and attention outputs kept, the rest recomputed) or full "
        "(every repeated block recomputed)",
    )
    p.add_argument(
        "--accumulate",
        type=_positive_int,
        default=1,
        metavar="K",
        help="micro-batches per optimizer step (default: 1); above 1 the simulated column is the highest "
        "micro-batch, whose backward adds to gradients already there",
    )
    p.add_argument(
        "--gpus", type=_positive_int, default=1, metavar="N", help="ranks to shard over (default: 1)"
    )
    p.add_argument(
        "--strategy",
        type=_one_of("strategy", list(STRATEGIES)),
        default="ddp",
        metavar="S",
        help=f"{', '.join(STRATEGIES)} (default: ddp); what it shards is divided by --gpus",
    )
    p.add_argument(
        "--device",
        type=_one_of("device", DEVICES),
        default="cuda",
        metavar="{cuda,cpu}",
        help="the device to plan for: cuda (512-byte allocator blocks, foreach optimizers) or cpu "
        "(default: cuda; no GPU is needed)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.set_defaults(run=_run_estimate)


def _load_model(spec: str) -> nn.Module:
    """A preset's GPTLightningModule, or what ``package.module:factory`` returns, built on meta."""
    from lightning_memkit.demos.gpt import PRESETS, GPTLightningModule

    if ":" not in spec:
        if spec not in PRESETS:
            module_name, _, attr = spec.rpartition(".")
            dotted = f" (a factory is named with a colon: {module_name}:{attr})" if module_name else ""
            raise UsageError(
                f"unknown preset {spec!r} for --model; valid: {', '.join(PRESETS)}, or package.module:factory"
                + dotted
            )
        with torch.device("meta"):
            return GPTLightningModule(spec)
    factory = _factory(spec)
    name = f"{spec.partition(':')[2]}()"
    called = "it is called with no arguments under torch.device('meta'); call it in Python for the traceback"
    with _usage_error(context=f"--model {spec}: calling {name} failed", fix=called), torch.device("meta"):
        model = factory()
    if not isinstance(model, nn.Module):
        got = f"{reprlib.repr(model)} ({type(model).__name__})"
        got = "None (does it return the model?)" if model is None else got
        raise UsageError(f"--model {spec}: {name} returned {got}, not an nn.Module or LightningModule")
    _check_trainable(model, spec)
    if _is_hf(model):
        return _HFLanguageModel(model)
    return model


def _factory(spec: str) -> Callable[[], Any]:
    """The callable ``package.module:factory`` names, checked to be callable with no arguments."""
    module_name, _, attr = spec.partition(":")
    for part, where, what in ((module_name, "before", "package.module"), (attr, "after", "factory")):
        if not part.strip():
            raise UsageError(
                f"--model {spec!r} has no {what} {where} the ':'; give package.module:factory, e.g. "
                "mypkg.models:build"
            )
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` does: the user's own package is found
    with _usage_error(
        context=f"cannot load --model {spec}: importing {module_name!r} failed",
        fix=f"the current directory is on the path; try python -c 'import {module_name}'",
    ):
        module = importlib.import_module(module_name)
    first = attr.split(".")[0]
    close = [] if hasattr(module, first) else difflib.get_close_matches(first, dir(module), n=3)
    with _usage_error(
        AttributeError,
        context=f"cannot load --model {spec}",
        fix=f"did you mean {' or '.join(close)}?" if close else "",
    ):
        factory = functools.reduce(getattr, attr.split("."), module)
    if not callable(factory):
        raise UsageError(f"--model {spec} is a {type(factory).__name__}, not a callable returning a model")
    try:
        parameters = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: let the call say
        parameters = []
    required = [
        p.name for p in parameters if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    if required:
        raise UsageError(
            f"--model {spec}: {attr}() needs arguments ({', '.join(required)}) but is called with none; "
            f"write a factory without arguments, e.g. def build(): return {attr}({required[0]}=...), "
            "and give --model module:build"
        )
    return factory


def _check_trainable(model: nn.Module, spec: str) -> None:
    """A model memkit can step has parameters, of a known shape, some of which train, and an optimization
    it runs without a Trainer (Lightning's automatic one)."""
    params = list(model.parameters())
    name = type(model).__name__
    if not params:
        built_later = " (layers built in configure_model are not seen: build them in __init__)"
        raise UsageError(
            f"--model {spec} ({name}) has no parameters, so there is nothing to train; return the model "
            "that holds them" + (built_later if hasattr(model, "configure_model") else "")
        )
    lazy = [m for m in model.modules() if isinstance(m, nn.modules.lazy.LazyModuleMixin)]
    if lazy:
        raise UsageError(
            f"--model {spec} ({name}) has lazy modules ({type(lazy[0]).__name__}), whose parameters have no "
            "shape until a first forward; give their sizes (nn.Linear(in_features, ...) for nn.LazyLinear)"
        )
    if not any(p.requires_grad for p in params):
        raise UsageError(
            f"--model {spec} ({name}) has no trainable parameters: all {len(params)} have "
            "requires_grad=False; unfreeze those the run trains"
        )
    if not getattr(model, "automatic_optimization", True):
        raise UsageError(
            f"--model {spec} ({name}) uses manual optimization, whose steps only a running Trainer drives; "
            "give a factory of the nn.Module it trains (stepped as a language model, or by example_batch)"
        )


def _is_hf(model: nn.Module) -> bool:
    """Whether ``model`` is a Hugging Face ``PreTrainedModel`` (transformers is not imported for it)."""
    if "transformers" not in sys.modules:
        return False
    from transformers import PreTrainedModel

    return isinstance(model, PreTrainedModel)


class _HFLanguageModel(nn.Module):
    """A Hugging Face model stepped on token ids as it trains itself: ``model(input_ids=x, labels=x)``
    (the collator's ``labels`` are the input ids; a causal LM shifts them itself) and its own ``.loss``;
    a model whose ``forward`` takes no ``labels`` gets ``input_ids`` alone and the loss from its logits
    (`_lm_loss`). Its parameters, blocks and ``config`` are the wrapped model's."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.config = model.config
        self.takes_labels = "labels" in inspect.signature(model.forward).parameters

    def forward(self, input_ids: torch.Tensor) -> Any:
        if self.takes_labels:
            return self.model(input_ids=input_ids, labels=input_ids)
        return self.model(input_ids=input_ids)


def _gpt_config(model: nn.Module) -> Any:
    """The model's ``GPTConfig`` if it has one (the analytic column needs the architecture's numbers)."""
    from lightning_memkit.demos.gpt import GPTConfig

    config = getattr(model, "config", None)
    return config if isinstance(config, GPTConfig) else None


def _hf_model(model: nn.Module) -> nn.Module | None:
    """The Hugging Face ``PreTrainedModel`` ``model`` is or holds (a LightningModule around one)."""
    if "transformers" not in sys.modules:
        return None
    return next((m for m in model.modules() if _is_hf(m)), None)


def _analytic_shape(model: nn.Module) -> tuple[TransformerShape | None, str | None]:
    """The architecture's numbers for the analytic column, or ``None`` and the note that says why not.

    From a ``GPTConfig`` (the presets, nanoGPT-style models), or from a Hugging Face model's ``.config``
    (`TransformerShape.from_hf_config`) when the numbers it maps to give exactly the model's parameter
    count: a variant with extra norms, biases or heads is not described by the analytic model.
    """
    config = _gpt_config(model)
    if config is not None:
        return TransformerShape.from_config(config), None
    hf = _hf_model(model)
    if hf is None:
        return None, (
            "analytic: not available: it needs the architecture's numbers, from a preset, a model with a "
            "GPTConfig (.config) or a Hugging Face model (.config)"
        )
    name = type(hf).__name__
    try:
        shape = TransformerShape.from_hf_config(hf.config)
    except ValueError as e:
        return None, f"analytic: not available for {name}: {e}"
    n_model = sum(p.numel() for p in model.parameters())
    n_shape = count_parameters(shape)
    if n_model != n_shape:
        return None, (
            f"analytic: not available for {name}: its config maps to {n_shape:,} parameters, the model has "
            f"{n_model:,} (a layout the analytic model does not describe: other norms, biases or heads)"
        )
    kv = f", {shape.n_kv_head} K/V heads" if shape.n_kv_head not in (None, shape.n_head) else ""
    return shape, (
        f"analytic: from {name}'s config: d_model {shape.d_model}, {shape.n_layer} layers, {shape.n_head} "
        f"heads{kv}, d_ff {shape.d_ff}, {shape.mlp}, {shape.norm}; activations per Korthikanti et al."
    )


def _check_seq_len(model: nn.Module, shape: TransformerShape | None, seq_len: int) -> None:
    config = _gpt_config(model)
    block = config.block_size if config is not None else None
    if shape is not None and shape.position == "learned":
        block = shape.block_size
    if block is not None and seq_len > block:
        raise UsageError(f"--seq-len {seq_len} exceeds the model's block_size of {block}")


def _optimizer_used(model: nn.Module, args: argparse.Namespace) -> tuple[str, str | None]:
    """(what the header names, its catalogue name or ``None``) of the optimizer the simulation steps."""
    from lightning.pytorch import LightningModule

    if args.optimizer is not None:
        return args.optimizer, args.optimizer
    if not isinstance(model, LightningModule):
        return "adamw", "adamw"
    from lightning_memkit._lightning import lightning_stand_ins, optimizers_from
    from lightning_memkit._optim import identify

    try:
        with lightning_stand_ins(model, torch.device("cpu")), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            optimizers = optimizers_from(model.configure_optimizers())
    except Exception:
        return "configure_optimizers", None
    if not optimizers:
        return "configure_optimizers (no optimizer)", None
    names = [identify(o) or type(o).__name__ for o in optimizers]
    return f"{' + '.join(names)} (configure_optimizers)", names[0] if len(names) == 1 else None


#: Most tokens in one batch: B x T x the vocabulary x 8 bytes must stay an int64 byte count.
_MAX_TOKENS = 2**40


def _example_batch(model: nn.Module, spec: str, batch_size: int, seq_len: int) -> Any:
    if batch_size * seq_len > _MAX_TOKENS:
        raise UsageError(
            f"a batch of {batch_size} x {seq_len} is {batch_size * seq_len:,} tokens, more than the "
            f"{_MAX_TOKENS:,} the simulation counts; check --seq-len and the batch size"
        )
    if callable(getattr(model, "example_batch", None)):
        with _usage_error(
            context=f"--model {spec}: its example_batch({batch_size}, {seq_len}) failed",
            fix="it is called as example_batch(batch_size, seq_len) and returns the batch its step takes",
        ):
            return model.example_batch(batch_size, seq_len)
    x = torch.zeros(batch_size, seq_len, dtype=torch.long, device="meta")  # (B, T) token ids
    return x, x.clone()


@contextlib.contextmanager
def _step_errors(model: nn.Module, spec: str, batch_size: int, seq_len: int) -> Iterator[None]:
    """Where the user's model's simulated step runs: its failure is a one-line error that says which
    batch it was given and how to give another. A preset failing is our bug: it keeps its traceback."""
    from lightning.pytorch import LightningModule

    if ":" not in spec:
        yield
        return
    if callable(getattr(model, "example_batch", None)):
        batch = f"the batch was its example_batch({batch_size}, {seq_len})"
    else:
        how = (
            "its training_step"
            if isinstance(model, LightningModule)
            else "model(input_ids=x, labels=x)"
            if isinstance(model, _HFLanguageModel)
            else "cross_entropy(model(x), y)"
        )
        batch = (
            f"the batch was (x, y), int64 token ids of shape ({batch_size}, {seq_len}), stepped as {how}; "
            "a model that takes other inputs (images, features) defines example_batch(batch_size, seq_len) "
            "returning its batch"
        )
    # torch logs a failing meta kernel's traceback before raising: the one line says what went wrong.
    log = logging.getLogger("torch._subclasses.fake_tensor")
    disabled, log.disabled = log.disabled, True
    try:
        with _usage_error(context=f"--model {spec}: the simulated training step failed", fix=batch):
            yield
    finally:
        log.disabled = disabled


def _lm_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    """The model's own loss when its output has one (a Hugging Face ``ModelOutput`` given ``labels``),
    else cross-entropy over the logits (``.logits``, a mapping's first tensor, a tuple's first element)."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    logits = getattr(output, "logits", None)
    if not isinstance(logits, torch.Tensor):
        if isinstance(output, Mapping):
            logits = next(v for v in output.values() if isinstance(v, torch.Tensor))
        else:
            logits = output[0] if isinstance(output, (tuple, list)) else output  # (B, T, V)
    return F.cross_entropy(logits.flatten(0, -2), target.flatten())


def _simulate(model: nn.Module, args: argparse.Namespace) -> tuple[MemoryBreakdown, TimelineEvent | None]:
    """The simulated step's breakdown and the op at which its peak falls (the first of the highest)."""
    from lightning.pytorch import LightningModule

    lightning = isinstance(model, LightningModule)
    breakdown, timeline = estimate_memory(
        model,
        _example_batch(model, args.model, args.batch_size, args.seq_len),
        optimizer=args.optimizer if lightning else args.optimizer or "adamw",
        loss_fn=None if lightning else _lm_loss,
        precision=args.precision,
        checkpointing=None if args.checkpointing == "none" else args.checkpointing,
        device=args.device,
        accumulating=args.accumulate > 1,
        return_timeline=True,
    )
    return breakdown, max(timeline, key=lambda event: event.live, default=None)


def _run_estimate(args: argparse.Namespace) -> int:
    model = _load_model(args.model)
    shape, note = _analytic_shape(model)
    _check_seq_len(model, shape, args.seq_len)
    args.optimizer_used, catalogued = _optimizer_used(model, args)
    notes: list[str] = [note] if note else []
    analytic = simulated = None
    seconds = None
    if shape is not None:
        if catalogued is None:
            notes.append(
                f"analytic: {args.optimizer_used} is not in the catalogue; its state is AdamW's there"
            )
        analytic = estimate_analytic(
            shape,
            args.batch_size,
            args.seq_len,
            precision=args.precision,
            optimizer=catalogued or "adamw",
            checkpointing=args.checkpointing,
            attention="sdpa",
        )
    start = time.perf_counter()
    with _step_errors(model, args.model, args.batch_size, args.seq_len):
        simulated, at_peak = _simulate(model, args)
    seconds = time.perf_counter() - start
    notes.append(f"simulated: one step on fake tensors in {seconds:.1f} s")
    if args.gpus > 1 or args.strategy != "ddp":
        sharded = STRATEGIES[args.strategy]
        analytic = shard(analytic, args.strategy, args.gpus) if analytic is not None else None
        if simulated is not None:
            grads = model_static(model, args.precision).gradients
            simulated = shard(simulated, args.strategy, args.gpus, gradient_bytes=grads)
        buckets = " and adds its all-reduce buckets (a copy of the gradients)" if args.gpus > 1 else ""
        notes.append(
            f"per rank: {args.strategy} over {args.gpus} GPU(s) divides "
            f"{', '.join(sharded) or 'nothing'} by {args.gpus}{buckets if not sharded else ''}"
        )
    explanation = _explain(args, shape, analytic, simulated, at_peak) if analytic is not None else []
    if args.json:
        print(json.dumps(_report(args, analytic, simulated, seconds, [*explanation, *notes]), indent=2))
    else:
        print(_table(args, analytic, simulated, [*explanation, *notes]))
    return 0


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
    simulated: MemoryBreakdown | None,
    seconds: float | None,
    notes: list[str],
) -> dict[str, Any]:
    """The ``--json`` object. Byte counts are integers; ``difference`` is simulated minus analytic per
    category (negative where analytic is higher); ``analytic``/``difference`` are null when there is no
    analytic column. ``notes`` starts with `_explain`'s two lines when there is."""
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
        "analytic": analytic.as_dict() if analytic is not None else None,
        "simulated": simulated.as_dict() if simulated is not None else None,
        "difference": (
            _difference(analytic, simulated) if analytic is not None and simulated is not None else None
        ),
        "simulated_seconds": seconds,
        "notes": notes,
    }


def _table(
    args: argparse.Namespace,
    analytic: MemoryBreakdown | None,
    simulated: MemoryBreakdown | None,
    notes: list[str],
) -> str:
    """Categories as rows; the two estimates and their difference (simulated - analytic) as columns (rich
    when installed, plain text otherwise)."""
    title = (
        f"Peak memory of one training step: {args.model}, batch {args.batch_size} x {args.seq_len}, "
        f"{args.precision}, {args.optimizer_used}, {args.device}"
    )
    diff = _difference(analytic, simulated) if analytic is not None and simulated is not None else None
    rows = [
        (
            name,
            *(format_bytes(getattr(b, name)) if b is not None else "—" for b in (analytic, simulated)),
            _signed(diff[name]) if diff is not None else "—",
        )
        for name in (*CATEGORIES, "peak")
    ]
    columns = ("analytic", "simulated", "difference")
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        lines = [title, f"{'category':<16}" + "".join(f"{c:>14}" for c in columns)]
        lines += [f"{name:<16}" + "".join(f"{v:>14}" for v in values) for name, *values in rows]
        return "\n".join([*lines, *notes])
    table = Table()
    table.add_column("category")
    for column in columns:
        table.add_column(column, justify="right")
    for name, *values in rows:
        table.add_row(name, *values, style="bold" if name == "peak" else None)
    console = Console(width=110, record=True, force_terminal=False)
    with console.capture() as capture:
        console.print(table)
    return "\n".join([title, capture.get().rstrip("\n"), *notes])


# --------------------------------------------------------------------------------------------------
# memkit plan
# --------------------------------------------------------------------------------------------------


def _add_plan(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "plan",
        help="micro-batch, accumulation, checkpointing and optimizer that fit a GPU, and the what-if table",
        description=(
            "Search micro-batch x gradient accumulation x checkpointing x optimizer (x precision) on "
            "simulated steps and print the fastest plan whose peak fits the GPU, with every configuration "
            "simulated. Nothing is allocated; no GPU is needed."
        ),
    )
    p.add_argument("--model", required=True, metavar="PRESET|MODULE:FACTORY", help="as for memkit estimate")
    p.add_argument(
        "--gpu", type=_gpu, required=True, metavar="GPU|SIZE",
        help="a GPU name (A100-40GB) or a card size (24GB)",
    )  # fmt: skip
    p.add_argument("--global-batch", type=_positive_int, required=True, metavar="G", help="samples per step")
    p.add_argument("--seq-len", type=_positive_int, required=True, metavar="T", help="tokens per sequence")
    p.add_argument("--gpus", type=_positive_int, default=1, metavar="N", help="ranks (default: 1)")
    p.add_argument(
        "--strategy", type=_one_of("strategy", list(STRATEGIES)), default="ddp", metavar="S",
        help=f"{', '.join(STRATEGIES)} (default: ddp)",
    )  # fmt: skip
    p.add_argument("--margin", type=_margin, default=0.1, help="share of the budget kept free (default: 0.1)")
    p.add_argument(
        "--precision", type=_names("precision", list(PRECISION_DTYPES)), default="32-true",
        metavar="P[,P...]",
        help="allowed precisions, in order of preference (default: 32-true)",
    )  # fmt: skip
    p.add_argument(
        "--optimizer", type=_names("optimizer", list(OPTIMIZERS)), default=None, metavar="O[,O...]",
        help="candidate optimizers in quality order (default: the model's own, then the lighter ones)",
    )  # fmt: skip
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    p.set_defaults(run=_run_plan)


def _names(kind: str, valid: Sequence[str]) -> Callable[[str], tuple[str, ...]]:
    """A comma-separated list of ``valid`` names, each checked as `_one_of` checks one."""
    one = _one_of(kind, valid)

    def parse(text: str) -> tuple[str, ...]:
        return tuple(one(name.strip()) for name in text.split(","))

    parse.__name__ = kind
    return parse


def _margin(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be a share of the budget in [0, 1), got {text!r}")
    return value


def _run_plan(args: argparse.Namespace) -> int:
    from lightning.pytorch import LightningModule

    from lightning_memkit._autofit import plan_fit

    model = _load_model(args.model)
    _check_seq_len(model, _analytic_shape(model)[0], args.seq_len)
    if args.global_batch % args.gpus:
        raise UsageError(
            f"--global-batch {args.global_batch} does not split evenly across --gpus {args.gpus}"
        )
    lightning = isinstance(model, LightningModule)
    start = time.perf_counter()
    # The library's ValueErrors (nothing fits, a batch it cannot cut) say what to change; what else the
    # step raises is the user's model failing.
    with _step_errors(model, args.model, args.global_batch, args.seq_len), _usage_error(ValueError):
        plan = plan_fit(
            model,
            _example_batch(model, args.model, args.global_batch, args.seq_len),
            args.gpu,
            margin=args.margin,
            optimizers=args.optimizer,
            precision=args.precision,
            strategy=args.strategy,
            n_gpus=args.gpus,
            device="cuda",
            loss_fn=None if lightning else _lm_loss,
            cost="flops",
            progress=lambda line: print(f"memkit plan: {line}", file=sys.stderr, flush=True),
        )
    seconds = time.perf_counter() - start
    code = _plan_code(args, model, plan)
    if args.json:
        print(json.dumps({"model": args.model, **plan.as_dict(), "code": code, "seconds": seconds}, indent=2))
    else:
        print(f"{args.model} on {args.gpu.source}, global batch {args.global_batch} x {args.seq_len}:")
        print(plan)
        print(f"The plan as code (Python):\n{code}")
        print(f"planned in {seconds:.1f} s ({len(plan.alternatives)} simulated steps)")
    return 0


def _plan_code(args: argparse.Namespace, model: nn.Module, plan: FitPlan) -> str:
    """The plan as Python a user pastes: the Trainer with ``AutoFit``, which makes this plan as the fit
    starts, then the same set by hand: the micro-batch (the DataLoader's batch size), the Trainer's
    arguments, checkpointing as a callback, and an optimizer swap as a comment (it goes in
    ``configure_optimizers``)."""
    from lightning.pytorch import LightningModule

    from lightning_memkit._autofit import own_optimizer
    from lightning_memkit._budget import GPUS

    budget, named = plan.budget, plan.budget.source in GPUS
    # AutoFit reads a size as the step's limit, not as a card's: a card size is given as what it leaves.
    autofit = {"budget": json.dumps(budget.source) if named else f"{budget.usable:_}"}
    if plan.margin != 0.1:
        autofit["margin"] = repr(plan.margin)
    if args.optimizer is not None:
        autofit["optimizers"] = json.dumps(list(args.optimizer))
    trainer = {"precision": json.dumps(plan.precision)}
    if plan.n_gpus > 1:
        trainer |= {"strategy": json.dumps(plan.strategy), "devices": str(plan.n_gpus)}
    by_hand = {"accumulate_grad_batches": str(plan.accumulate_grad_batches), **trainer}
    if plan.checkpointing != "none":
        by_hand["callbacks"] = f"[ActivationCheckpointing(policy={json.dumps(plan.checkpointing)})]"
    imports = ["ActivationCheckpointing", "AutoFit"] if "callbacks" in by_hand else ["AutoFit"]
    card = f"#    The budget is what a {budget.source} card leaves after the CUDA context and reserve."
    per_gpu = args.global_batch // args.gpus
    lines = [
        "from lightning.pytorch import Trainer",
        f"from lightning_memkit import {', '.join(imports)}",
        "",
        "# 1. AutoFit makes this plan as fit starts, reading batch_size (module or DataModule) as the",
        f"#    global batch per GPU, here {per_gpu}; it sets micro-batch and accumulation itself.",
        *([] if named else [card]),
        _call("trainer = Trainer", {**trainer, "callbacks": f"[AutoFit({_arguments(autofit)})]"}),
        "",
        "# 2. Or by hand: batch_size is the micro-batch, the DataLoader's batch size.",
        f"batch_size = {plan.micro_batch_size}",
        _call("trainer = Trainer", by_hand),
    ]
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


# --------------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------------

#: subcommand name -> the function that adds its parser (see the module docstring).
SUBCOMMANDS: dict[str, Callable[[Any], None]] = {"estimate": _add_estimate, "plan": _add_plan}


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="memkit", description="Training memory of PyTorch Lightning runs, before the run.")
    subparsers = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for add in SUBCOMMANDS.values():
        add(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``memkit`` with ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
        return args.run(args)
    except UsageError as e:
        print(f"memkit {args.command}: error: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:  # argparse after --help (0) or an error it has printed (2)
        return e.code if isinstance(e.code, int) else 2


if __name__ == "__main__":
    sys.exit(main())
