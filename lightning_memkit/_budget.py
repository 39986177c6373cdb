"""A memory budget given the ways users say it: ``8_000_000_000``, ``"24GB"``, ``"6 GiB"``, ``0.9`` of the
current device, ``"A100-40GB"`` or ``"auto"``."""

from __future__ import annotations

import difflib
import math
import numbers
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["GPUS", "Budget", "BudgetSetting", "parse_budget", "parse_bytes", "reads_device"]

# --- the checks every constructor shares ---------------------------------------------------------


def valid_name(kind: str, value: Any, valid: Iterable[str]) -> str:
    """``value`` if it is one of ``valid``, else the error naming them all (and the closest, if any)."""
    valid = list(valid)
    if value in valid:
        return value
    hint = difflib.get_close_matches(str(value), valid, n=1)
    did_you_mean = f" Did you mean {hint[0]!r}?" if hint else ""
    raise ValueError(f"Unknown {kind} {value!r}; valid: {', '.join(valid)}.{did_you_mean}")


def _given(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def whole_number(name: str, value: Any, *, of: str, at_least: int = 0) -> int:
    """``value`` as an int if it is a whole number of at least ``at_least``, else the error that says so:
    ``ValueError: verify_steps must be a whole number of steps, at least 0; got -1`` (a ``TypeError`` for
    what is no integer: ``"3"``, ``2.5``, and ``True``, a bool, though Python counts it as 1)."""
    what = f"{name} must be a whole number of {of}, at least {at_least}"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{what}; got {_given(value)}")
    if value < at_least:
        raise ValueError(f"{what}; got {value!r}")
    return int(value)


def flag(name: str, value: Any) -> bool:
    """``value`` if it is a bool: ``plot="no"`` would be true."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False; got {_given(value)}")
    return value


def share(name: str, value: Any, *, of: str) -> float:
    """``value`` as a float if it is a share of ``of`` in [0, 1) (``0.1``: a tenth), else the error."""
    what = f"{name} must be a share of {of} in [0, 1), such as 0.1"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what}; got {_given(value)}")
    if not 0.0 <= value < 1.0:  # nan too
        raise ValueError(f"{what}; got {value!r}")
    return float(value)


def names(name: str, value: Any, valid: Iterable[str], *, none: bool = False) -> tuple[Any, ...]:
    """``value``, one name or an iterable of names, as a tuple of names from ``valid`` (``none``: ``None``
    among them too); a single string is one name, not its letters."""
    valid = tuple(valid)
    if isinstance(value, str):
        value = (value,)
    elif not isinstance(value, Iterable) or isinstance(value, (bytes, bytearray)):  # bytes: no letters
        raise TypeError(
            f"{name} must be a name or a list of names of {', '.join(valid)}; got {_given(value)}"
        )
    out = tuple(v if none and v is None else valid_name(name.rstrip("s"), v, valid) for v in value)
    if not out:
        raise ValueError(f"{name} is empty: name at least one of {', '.join(valid)}")
    return out


_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
#: The largest size read: budgets are scaled by floats (a share kept free, the fragmentation reserve).
_LARGEST = 2.0**1000
_PATTERN = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$")


def parse_bytes(value: int | str) -> int:
    """Bytes from an int or a string with a decimal (GB) or binary (GiB) unit, any case.

    >>> parse_bytes("24GB"), parse_bytes("1.5 GiB"), parse_bytes(1024)
    (24000000000, 1610612736, 1024)
    """
    if isinstance(value, bool):
        raise TypeError(f"A memory size must be bytes or a string like '24GiB', got {value!r}")
    if isinstance(value, numbers.Integral):  # int, and NumPy's integers
        number, unit = int(value), ""
    elif isinstance(value, str):
        match = _PATTERN.match(value.lower())
        if match is None or match.group(2) not in _UNITS:
            raise ValueError(
                f"Cannot read {value!r} as a memory size: use bytes or a number with one of the units "
                f"{', '.join(u for u in _UNITS if u)} (e.g. '24GB', '6GiB')."
            )
        number, unit = float(match.group(1)), match.group(2)
    else:
        raise TypeError(f"A memory size must be bytes or a string like '24GiB', got {type(value).__name__}")
    size = number * _UNITS[unit]
    if size > _LARGEST or not math.isfinite(size):  # a float's inf; an int too large for a float
        shown = repr(value) if len(repr(value)) <= 40 else f"{repr(value)[:20]}... ({len(str(value))} chars)"
        raise ValueError(
            f"Cannot read {shown} as a memory size: it is too large to count in bytes (more than "
            f"{_LARGEST:.3g}); give the size of a device or a limit, e.g. '24GB'."
        )
    if isinstance(value, str) and not unit and not number.is_integer():
        raise ValueError(
            f"Cannot read {value!r} as a memory size: without a unit it is bytes, a whole number. "
            f"Add the unit ('{value}GB', '{value}GiB'); a fraction of the device ({number}) is a "
            "float, not a string, where a budget takes one (AutoFit, OptimizerSwap, parse_budget)."
        )
    nbytes = int(size)
    if nbytes <= 0:
        raise ValueError(f"A memory size must be positive, got {value!r}")
    return nbytes


# --- budgets for a device ------------------------------------------------------------------------

#: Memory a CUDA process spends outside the caching allocator: the context, cuBLAS/cuDNN handles and
#: kernels loaded on first use. 300-600 MiB on current drivers; we keep the larger end.
CUDA_CONTEXT_BYTES = 512 * 2**20
#: Share of what is left kept free for the caching allocator's fragmentation (blocks split and cached
#: for other sizes). Lightning's BatchSizeFinder keeps none and lands runs that OOM later; 5 % is what
#: the plans in this package leave on top of their own margin.
FRAGMENTATION_RESERVE = 0.05

#: Nominal device memory in MiB, as nvidia-smi / rocm-smi report it.
GPUS: dict[str, int] = {
    "A100-40GB": 40_960,
    "A100-80GB": 81_920,
    "H100-80GB": 81_559,
    "H100-94GB": 95_830,
    "H200": 143_771,
    "L4": 23_034,
    "L40S": 46_068,
    "A10G": 23_028,
    "A6000": 49_140,
    "T4": 15_360,
    "V100-16GB": 16_384,
    "V100-32GB": 32_768,
    "RTX-3090": 24_576,
    "RTX-4090": 24_564,
    "MI250X": 65_536,
    "MI300X": 196_608,
}


def _canonical(name: str) -> str:
    return name.upper().replace(" ", "-").replace("_", "-")


@dataclass(frozen=True)
class Budget:
    """A memory budget: the device (or limit) it came from and what the allocator may use of it.

    Attributes:
        total: bytes of the device, or the limit as given.
        usable: bytes a training step's peak may reach: for a device, ``total`` less the CUDA context
            (`CUDA_CONTEXT_BYTES`) and the fragmentation reserve (`FRAGMENTATION_RESERVE`); for a plain
            size, ``total`` itself.
        source: how it was given, for messages (``"A100-40GB"``, ``"24GB"``, ``"cuda:0 x 0.9"``).
    """

    total: int
    usable: int
    source: str

    @classmethod
    def for_device(cls, total: int, source: str) -> Budget:
        usable = int((total - CUDA_CONTEXT_BYTES) * (1 - FRAGMENTATION_RESERVE))
        if usable <= 0:
            raise ValueError(f"{source}: {total} bytes leave nothing once the CUDA context is taken")
        return cls(total=total, usable=usable, source=source)


class BudgetSetting:
    """A callback's ``budget=`` as given, read once: a size, a GPU name or a `Budget` at construction (a bad
    one fails there, before any run), ``"auto"`` and a fraction of the device by `resolve` in ``setup``, once
    the run is on its device (they read from card to card differently). ``None``: no budget."""

    def __init__(self, given: int | float | str | Budget | None) -> None:
        self.given = given
        #: whether the budget is read from the run's CUDA device (``"auto"``, a fraction)
        self.from_device = given is not None and reads_device(given)
        #: the budget (``None`` without one, or until `resolve` for one read from the device)
        self.budget: Budget | None = None if given is None or self.from_device else parse_budget(given)

    def resolve(self) -> Budget | None:
        """The budget, one read from the device read now (call it in ``setup``)."""
        if self.from_device:
            self.budget = parse_budget(self.given)  # type: ignore[arg-type]
        return self.budget

    @property
    def usable(self) -> int | None:
        """Bytes the step's peak may reach (``None`` without a budget, or until `resolve`)."""
        return None if self.budget is None else self.budget.usable

    @property
    def key(self) -> Any:
        """What a saved state keys the budget by: as given where it is read from the device (its bytes
        differ from card to card), else its bytes."""
        return self.given if self.from_device else self.usable


def _current_device_bytes() -> tuple[int, str]:
    import torch

    if not torch.cuda.is_available():
        raise ValueError(
            "A budget of 'auto' or a fraction needs a CUDA device, and none is visible. Give a size "
            "('24GB') or a GPU name instead (one of: " + ", ".join(GPUS) + ")."
        )
    index = torch.cuda.current_device()
    return torch.cuda.get_device_properties(index).total_memory, f"cuda:{index}"


def reads_device(value: object) -> bool:
    """Whether ``value`` is a budget read from the current CUDA device (a fraction, ``"auto"``): callbacks
    resolve such budgets in ``setup``, once the run is on its device, and read the others at once.

    Raises:
        ValueError: for a float outside (0, 1], which is no fraction (nor a size).
    """
    if isinstance(value, float):
        if not 0.0 < value <= 1.0:  # nan too
            size = f"'{value}GB' or '{value}GiB'" if math.isfinite(value) and value > 0 else "'24GB'"
            raise ValueError(
                f"A float budget is a fraction of the current CUDA device, in (0, 1]; got {value}. For a "
                f"size, give bytes or a string with a unit ({size})."
            )
        return True
    return isinstance(value, str) and value.strip().lower() == "auto"


def parse_budget(value: int | float | str | Budget, *, device_size: bool = False) -> Budget:
    """Read a memory budget given in any of the ways users say it.

    - bytes (``24_000_000_000``) or a size string (``"24GB"``, ``"24GiB"``, ``"24 gib"``): the limit for
      the step's peak as is — or, with ``device_size=True``, the size of a card, from which the CUDA
      context and the fragmentation reserve are taken;
    - a fraction of the current CUDA device (``0.9``);
    - a GPU name from `GPUS` (``"A100-40GB"``, ``"H100-80GB"``, ``"RTX 4090"``, any case);
    - ``"auto"``: the current CUDA device.

    Devices (names, fractions, ``"auto"``) always have the context and reserve taken off.
    """
    if isinstance(value, Budget):
        return value
    if reads_device(value) and isinstance(value, float):  # a fraction, checked
        total, name = _current_device_bytes()
        return Budget.for_device(int(total * value), f"{name} x {value}")
    if isinstance(value, str):
        key = _canonical(value.strip())
        if key == "AUTO":
            total, name = _current_device_bytes()
            return Budget.for_device(total, name)
        gpus = {_canonical(name): name for name in GPUS}
        if key in gpus or key.replace("RTX", "RTX-") in gpus:
            name = gpus.get(key) or gpus[key.replace("RTX", "RTX-")]
            return Budget.for_device(GPUS[name] * 2**20, name)
        if not _PATTERN.match(value.lower()):
            close = difflib.get_close_matches(key, list(gpus), n=3, cutoff=0.5)
            hint = f" Did you mean {', '.join(gpus[c] for c in close)}?" if close else ""
            raise ValueError(
                f"Unknown GPU or size {value!r}.{hint} Known GPUs: {', '.join(GPUS)}; or give a size such "
                "as '24GB' / '24GiB', a fraction of the current device (0.9), or 'auto'."
            )
    nbytes = parse_bytes(value)  # type: ignore[arg-type]
    source = value if isinstance(value, str) else f"{nbytes} bytes"
    return Budget.for_device(nbytes, source) if device_size else Budget(nbytes, nbytes, source)
