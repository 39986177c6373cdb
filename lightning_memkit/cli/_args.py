"""What every subcommand shares: the one-line `UsageError` and the argument types that check their input."""

from __future__ import annotations

import argparse
import contextlib
import math
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from lightning_memkit._budget import GPUS, parse_budget, valid_name

if TYPE_CHECKING:
    from lightning_memkit._step import Sharding


class UsageError(Exception):
    """Bad input from the command line; `main` prints it as one line and exits with status 2."""


#: Most tokens in one batch: B x T x the vocabulary x 8 bytes must stay an int64 byte count.
MAX_TOKENS = 2**40


def check_tokens(batch_size: int, seq_len: int) -> None:
    """A batch of ``batch_size`` x ``seq_len`` tokens the simulation can count (`MAX_TOKENS`)."""
    if batch_size * seq_len > MAX_TOKENS:
        raise UsageError(
            f"a batch of {batch_size} x {seq_len} is {batch_size * seq_len:,} tokens, more than the "
            f"{MAX_TOKENS:,} the simulation counts; check --seq-len and the batch size"
        )


@contextlib.contextmanager
def usage_error(*catch: type[Exception], context: str = "", fix: str = "") -> Iterator[None]:
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


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def gpu_or_memory(text: str) -> str:
    """``--gpu``: a GPU name or a card size, kept as written: what is taken off it depends on
    ``--device`` (`lightning_memkit.cli._parsers.check_plan`); ``0.5`` (a size without its unit) and
    ``4090`` (a card's number) are refused here."""
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is not None and math.isfinite(value) and not value.is_integer():  # inf: too large, said below
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither a GPU name nor a card size; give a name (A100-40GB) or a size with its "
            "unit (24GB, 24GiB)"
        )
    if text.strip().isdigit() and int(text) < 2**20:  # a card's number (4090), not a byte count
        cards = [name for name in GPUS if text.strip() in name.replace("-", "")]
        guess = f"; did you mean {' or '.join(cards)}?" if cards else ", too small for a budget;"
        raise argparse.ArgumentTypeError(
            f"{text!r} reads as {int(text)} bytes{guess} Give a GPU name or a size with its unit (24GB, "
            "24GiB)"
        )
    try:
        parse_budget(text, device_size=False)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def output_file(text: str) -> str:
    """``--snapshot`` / ``--html``: a file the command can write once its simulation is done, checked now,
    so that a bad path fails in a fraction of a second instead of after the whole run."""
    path = Path(text).expanduser()
    folder = path.parent
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory; give a file name in it")
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(
            f"cannot write {text}: its folder {folder} does not exist; create it (mkdir -p {folder}) or give "
            "another path"
        )
    if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise argparse.ArgumentTypeError(f"cannot write {text}: permission denied; give a path you can write")
    existed = path.exists()
    try:  # what the permission bits do not tell (a read-only or special file system, such as /proc)
        with open(path, "a"):
            pass
    except OSError as e:
        why = f"cannot write {text}: {e.strerror}; give a path you can write"
        raise argparse.ArgumentTypeError(why) from e
    if not existed:  # nothing left behind by a run that fails later
        path.unlink()
    return text


def count(text: str) -> int:
    """A whole number, 0 or more."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a whole number, 0 or more, got {text!r}")
    return value


def one_of(kind: str, valid: Sequence[str]) -> Callable[[str], str]:
    """One of the ``valid`` names, or the library's ``Unknown <kind>`` error with a close match."""

    def parse(text: str) -> str:
        try:
            return valid_name(kind, text, valid)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parse.__name__ = kind  # argparse names the type in some messages
    return parse


def names(kind: str, valid: Sequence[str]) -> Callable[[str], tuple[str, ...]]:
    """A comma-separated list of ``valid`` names, each checked as `one_of` checks one."""
    one = one_of(kind, valid)

    def parse(text: str) -> tuple[str, ...]:
        return tuple(one(name.strip()) for name in text.split(","))

    parse.__name__ = kind
    return parse


def positive_ints(text: str) -> tuple[int, ...]:
    """Positive integers separated by commas (``1,2,4,8``), each checked as `positive_int` checks one."""
    try:
        return tuple(positive_int(part.strip()) for part in text.split(","))
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"must be positive integers separated by commas (1,2,4,8), got {text!r}"
        ) from None


def module_names(text: str) -> tuple[str, ...] | str:
    """``--lora-targets``: module names separated by commas (``q_proj,v_proj``), or ``all-linear``."""
    if text.strip() == "all-linear":
        return "all-linear"
    parts = tuple(part.strip() for part in text.split(","))
    bad = [part for part in parts if not part.replace("_", "").replace(".", "").isalnum()]
    if bad:
        raise argparse.ArgumentTypeError(
            f"{bad[0]!r} is not a module name; give the adapted modules' names separated by commas, e.g. "
            "q_proj,v_proj (or all-linear)"
        )
    return parts


def _number(text: str) -> float:
    """``text`` as a float; NaN, which every range check refuses, where it is none."""
    try:
        return float(text)
    except ValueError:
        return float("nan")


def margin(text: str) -> float:
    value = _number(text)
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be a share of the budget in [0, 1), got {text!r}")
    return value


def layout_keywords(args: argparse.Namespace) -> dict[str, object]:
    """`estimate_memory`'s keywords for ``--strategy fsdp2``'s layout (`check_layout`'s ``args.sharding``);
    none for one device or a strategy that divides the one-device step."""
    layout = args.sharding
    if layout is None:
        return {}
    return {"sharding": layout}


def layout_words(layout: Sharding) -> str:
    """What the simulated layout does, in words: each block's projections split (tensor parallelism), then
    ``fully_shard`` on each block and the model (over HSDP's shard group)."""
    split = (
        "each block's projections split over the tensor-parallel group, "
        if layout.tensor_parallel_size > 1
        else ""
    )
    over = " over each replica's shard group" if layout.replicate_size > 1 else ""
    return f"{split}fully_shard on each block and then the model{over}"
