"""The ``memkit`` command: a run's training memory before the run, from the shell.

    memkit estimate --model gpt2 --batch-size 8 --seq-len 1024 --precision bf16-mixed --optimizer adamw

prints one training step's peak memory by category in three columns side by side: ``analytic``
(architecture arithmetic), ``simulated`` (the step run on fake tensors, `lightning_memkit.estimate_memory`)
and their ``difference``, with two lines on which to plan with and why they differ. ``--json`` prints the
same as one JSON object; ``--gpus N --strategy S`` shows one rank's share under that strategy.

    memkit plan --model gpt2 --gpu A100-40GB --global-batch 64 --seq-len 1024 --precision bf16-mixed

prints the plan that fits, every configuration simulated, and the plan as Python to paste: the Trainer
with ``AutoFit``, which makes the plan as the fit starts, and the same set by hand.

    memkit advise --model gpt2 --batch-size 8 --seq-len 1024

prints what the step's peak holds that it need not, largest first, each with the bytes its fix saves and
the fix (`lightning_memkit.advise`).

    memkit fit-table --model llama-7b --gpu H100-80GB

prints, for each precision, a micro-batch x sequence length table of one GPU: each cell the simulated peak
with the lightest checkpointing that fits, then the largest micro-batch at each sequence length and the
longest sequence (`lightning_memkit._fitting.table`).

``--model`` is a GPT preset (``tiny``, ``gpt2``, ... ``llama-7b``) or ``package.module:factory``, a
callable taking no arguments, called under the meta device, or ``hf:<directory or org/name>``; the batch is
``(x, y)``, token ids of shape ``(batch_size, seq_len)``, unless the module defines
``example_batch(batch_size, seq_len)``. A plain ``nn.Module`` is stepped as the LightningModule around it
would be under a Trainer (Lightning's order: the previous step's gradients alive through the forward;
``--loop plain`` for a loop of your own), a LightningModule after its ``configure_model``.

Each subcommand has a module beside this one, sharing the argument types, `UsageError` and the model
loading. Its parser is built in ``_parsers``, which imports neither torch nor Lightning: ``--help`` and a
usage error answer in a fraction of a second, and only a command whose arguments parse imports the rest.
Adding a subcommand: write ``add_<name>(subparsers)`` in ``_parsers`` that adds its parser with
``set_defaults(run=deferred("_<name>", "run_<name>"))``, where ``run_<name>(args) -> int`` lives in its
own module, and list it in `SUBCOMMANDS`. Raise `UsageError` for bad input, or run what may fail on it
under ``usage_error``: `main` prints it as one line and returns 2.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any

from lightning_memkit.cli._args import UsageError
from lightning_memkit.cli._parsers import add_advise, add_estimate, add_fit_table, add_plan

__all__ = ["SUBCOMMANDS", "UsageError", "main"]

#: subcommand name -> the function that adds its parser (see the module docstring).
SUBCOMMANDS: dict[str, Callable[[Any], None]] = {
    "estimate": add_estimate,
    "plan": add_plan,
    "advise": add_advise,
    "fit-table": add_fit_table,
}


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage block), so the reason is the whole message."""

    def error(self, message: str) -> Any:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def parser() -> argparse.ArgumentParser:
    """The ``memkit`` argument parser, one subparser per entry of `SUBCOMMANDS`."""
    memkit = _Parser(
        prog="memkit",
        description="Training memory of PyTorch Lightning runs, before the run.",
        epilog="How far can a card be pushed? memkit fit-table --model llama-7b --gpu H100-80GB prints the "
        "largest micro-batch and the longest sequence that fit at each precision, every cell a simulated "
        "step. memkit <command> --help says more.",
    )
    subparsers = memkit.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for add in SUBCOMMANDS.values():
        add(subparsers)
    return memkit


#: Loggers whose import-time warnings the command keeps off its output.
_QUIET = ("torchao", "torch.utils._pytree")


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``memkit`` with ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    # Import-time notices of packages imported on the way (transformers imports torchao where installed,
    # which logs its optional kernels' load failures and torch's pytree deprecations): a command's output is
    # its answer, or one line saying why not.
    for name in _QUIET:
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        args = parser().parse_args(argv)
        return args.run(args)
    except UsageError as e:
        print(f"memkit {args.command}: error: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:  # argparse after --help (0) or an error it has printed (2)
        return e.code if isinstance(e.code, int) else 2
