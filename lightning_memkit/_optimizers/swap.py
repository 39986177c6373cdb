"""The optimizers a swap can choose from, and how to swap one for another.

`CATALOGUE` lists them in quality order; `swap_optimizer` and `rebind_scheduler` (`_optimizers.schedulers`)
carry AdamW's hyperparameters over to each. Which one to use is decided in `_optimizers.choice`; this
module estimates nothing.
The catalogue's table and the translation rules, with their sources: ``docs/design/optimizers.md``.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import optimi
import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_memkit._budget import valid_name
from lightning_memkit._estimating.lightning_step import is_lightning, lightning_stand_ins, optimizers_from
from lightning_memkit._measuring.storages import model_device

__all__ = [
    "ADAFACTOR_LR_SCALE",
    "CATALOGUE",
    "DEFAULT_CANDIDATES",
    "LR_KEYS",
    "SGD_LR_SCALE",
    "CatalogueEntry",
    "available_candidates",
    "configured_optimizer",
    "constructor",
    "constructor_arguments",
    "identify",
    "is_lr",
    "lighter_candidates",
    "load_bitsandbytes",
    "lr_factor",
    "own_optimizer",
    "scalar",
    "swap_optimizer",
    "valid_candidates",
]

_log = logging.getLogger(__name__)

#: AdamW's lr times this is torch Adafactor's (its weight decay divided by it); see docs/design/optimizers.md.
ADAFACTOR_LR_SCALE = 10.0
#: AdamW's lr times this is SGD's with momentum 0.9 (10x more for plain SGD); see docs/design/optimizers.md.
SGD_LR_SCALE = 30.0
#: Keys of a param group that hold learning rates written by schedulers (every scheduler's
#: ``initial_lr``, OneCycleLR's ``max_lr``/``min_lr``, SWALR's ``swa_lr``); scaled with ``lr``.
LR_KEYS = ("initial_lr", "max_lr", "min_lr", "swa_lr")


# --------------------------------------------------------------------------------------------------
# bitsandbytes, loaded lazily
# --------------------------------------------------------------------------------------------------


#: bitsandbytes' CPU backend warns on import that it cannot fetch a 4-bit matmul kernel from the Hub
#: (``Failed to load CPU gemm_4bit_forward from kernels-community``): noise that reads like an error, about
#: a kernel its 8-bit optimizers never use.
_BNB_IMPORT_NOISE = "bitsandbytes.backends.cpu.ops"


def load_bitsandbytes() -> Any | None:
    """The ``bitsandbytes`` module, or ``None`` when it is missing or fails to load on this platform."""
    noisy = logging.getLogger(_BNB_IMPORT_NOISE)
    level = noisy.level
    noisy.setLevel(logging.ERROR)
    try:
        import bitsandbytes
    except (ImportError, RuntimeError, OSError) as err:
        _log.debug("bitsandbytes could not be loaded: %s", err)
        return None
    finally:
        noisy.setLevel(level)
    return bitsandbytes


def bitsandbytes_installed() -> bool:
    """Whether bitsandbytes is installed, without importing it (about 1 s after torch and Lightning: a
    plan that never builds an 8-bit optimizer need not pay it). Whether it loads is known when it is first
    imported (`load_bitsandbytes`)."""
    if "bitsandbytes" in sys.modules:
        return load_bitsandbytes() is not None
    return importlib.util.find_spec("bitsandbytes") is not None


def _bnb_class(name: str) -> Callable[..., Optimizer]:
    def build(param_groups: list[dict[str, Any]], **defaults: Any) -> Optimizer:
        bnb = load_bitsandbytes()
        if bnb is None:
            raise RuntimeError(
                f"bitsandbytes.optim.{name} needs bitsandbytes, which is not installed or failed to load "
                "here; `pip install bitsandbytes`, or drop the 8-bit and Lion candidates."
            )
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*[Pp]aged optimizers are not supported on CPU.*")
            return getattr(bnb.optim, name)(param_groups, **defaults)

    build.__qualname__ = f"bitsandbytes.optim.{name}"
    return build


# --------------------------------------------------------------------------------------------------
# The catalogue
# --------------------------------------------------------------------------------------------------


def scalar(value: Any) -> Any:
    """A one-element tensor's number (a learning rate given as a tensor); any other value as it is."""
    return value.item() if isinstance(value, Tensor) and value.numel() == 1 else value


@dataclass(frozen=True)
class CatalogueEntry:
    """One optimizer of the catalogue and the rule that carries AdamW's hyperparameters over to it.

    Attributes:
        name: the catalogue name (also what ``estimate_memory(optimizer=...)`` takes).
        build: ``build(param_groups, **defaults) -> Optimizer``, torch.optim's constructor signature.
        lr_scale: this optimizer's ``lr`` is AdamW's times ``lr_scale``.
        decay_scale: this optimizer's ``weight_decay`` is AdamW's times ``decay_scale``.
        carries: AdamW hyperparameters taken over unchanged (``betas``, ``eps`` within the Adam family).
        fixed: hyperparameters set whatever AdamW had, as ``(key, value)`` pairs.
        state: bytes of ``optimizer.state`` per parameter, in words.
        needs_bitsandbytes: skipped, with one info line, where bitsandbytes does not load.
    """

    name: str
    build: Callable[..., Optimizer]
    lr_scale: float = 1.0
    decay_scale: float = 1.0
    carries: tuple[str, ...] = ()
    fixed: tuple[tuple[str, Any], ...] = ()
    state: str = ""
    needs_bitsandbytes: bool = False

    def translate(self, adamw_group: dict[str, Any]) -> dict[str, Any]:
        """This optimizer's hyperparameters for a param group that AdamW would run with ``adamw_group``."""
        out: dict[str, Any] = {}
        if "lr" in adamw_group:
            out["lr"] = scalar(adamw_group["lr"]) * self.lr_scale
        if "weight_decay" in adamw_group:
            out["weight_decay"] = scalar(adamw_group["weight_decay"]) * self.decay_scale
        out.update({k: adamw_group[k] for k in self.carries if k in adamw_group})
        out.update(self.fixed)
        return out

    def to_adamw(self, group: dict[str, Any]) -> dict[str, Any]:
        """The inverse of `translate`: AdamW's hyperparameters equivalent to this optimizer's ``group``."""
        out = {
            "lr": scalar(group["lr"]) / self.lr_scale,
            "weight_decay": scalar(group.get("weight_decay", 0.0)) / self.decay_scale,
        }
        out.update({k: group[k] for k in self.carries if k in group})
        if "betas" in self.carries and "betas" not in group and "beta1" in group:  # torch-optimi's names
            out["betas"] = (group["beta1"], group["beta2"])
        return out


_ADAM = ("betas", "eps")
_SGD_DECAY = 1 / (10 * SGD_LR_SCALE)  # keeps lr * weight_decay / (1 - momentum) at AdamW's lr * weight_decay

#: Every optimizer the swap knows, in quality order (best first).
CATALOGUE: dict[str, CatalogueEntry] = {
    e.name: e
    for e in (
        CatalogueEntry(
            "adamw", torch.optim.AdamW, carries=_ADAM, state="8 B/param: fp32 exp_avg and exp_avg_sq",
        ),
        CatalogueEntry(
            "adamw8bit", _bnb_class("AdamW8bit"), carries=_ADAM, needs_bitsandbytes=True,
            state="≈2 B/param: two uint8 states + an fp32 scale per 256; fp32 (8 B) under 4096 elements",
        ),
        CatalogueEntry(
            "paged_adamw8bit", _bnb_class("PagedAdamW8bit"), carries=_ADAM, needs_bitsandbytes=True,
            state="as adamw8bit, in CUDA managed memory that pages out to the host under pressure",
        ),
        CatalogueEntry(
            "lion", _bnb_class("Lion"), lr_scale=1 / 10, decay_scale=10.0, fixed=(("betas", (0.9, 0.99)),),
            needs_bitsandbytes=True, state="4 B/param: one fp32 momentum",
        ),
        CatalogueEntry(
            "lion8bit", _bnb_class("Lion8bit"), lr_scale=1 / 10, decay_scale=10.0,
            fixed=(("betas", (0.9, 0.99)),), needs_bitsandbytes=True,
            state="≈1 B/param: one uint8 momentum + an fp32 scale per 256; fp32 (4 B) under 4096 elements",
        ),
        CatalogueEntry(
            "adafactor", torch.optim.Adafactor, lr_scale=ADAFACTOR_LR_SCALE,
            decay_scale=1 / ADAFACTOR_LR_SCALE, fixed=(("beta2_decay", -0.8),),
            state="(m + n) x 4 B per m x n matrix (factored second moment); 4 B/param for vectors",
        ),
        CatalogueEntry(
            "sgd_momentum", torch.optim.SGD, lr_scale=SGD_LR_SCALE, decay_scale=_SGD_DECAY,
            fixed=(("momentum", 0.9),), state="4 B/param: one momentum buffer",
        ),
        CatalogueEntry(
            "sgd", torch.optim.SGD, lr_scale=10 * SGD_LR_SCALE, decay_scale=_SGD_DECAY,
            fixed=(("momentum", 0.0),), state="0 B",
        ),
        CatalogueEntry(
            "adamw_kahan", optimi.AdamW, carries=_ADAM, fixed=(("kahan_sum", True),),
            state="8 B/param for fp32 weights; 6 B/param for bf16: bf16 moments + a bf16 Kahan buffer",
        ),
        CatalogueEntry(
            "sgd_kahan", optimi.SGD, lr_scale=10 * SGD_LR_SCALE, decay_scale=_SGD_DECAY,
            fixed=(("momentum", 0.0), ("kahan_sum", True)), state="0 B for fp32 weights; 2 B/param for bf16",
        ),
    )
}  # fmt: skip

#: The compensated update (`CATALOGUE`'s Kahan entries) that replaces an optimizer where the weights are
#: 16-bit (bf16-true, 16-true) and an uncompensated update would lose the small steps.
COMPENSATED = {
    "adamw": "adamw_kahan",
    "sgd": "sgd_kahan",
    "adamw_kahan": "adamw_kahan",
    "sgd_kahan": "sgd_kahan",
}
#: The Kahan-summed entries themselves.
KAHAN = frozenset(COMPENSATED.values())

#: What `OptimizerSwap` and `fit_optimizer` try by default, in order. ``paged_adamw8bit`` is left out:
#: it holds as many bytes as ``adamw8bit``, so it never fits where that does not; name it to use it.
DEFAULT_CANDIDATES = ("adamw", "adamw8bit", "lion", "lion8bit", "adafactor", "sgd_momentum", "sgd")

#: An optimizer the catalogue does not know, used with ``allow_unknown=True``: its ``lr`` and
#: ``weight_decay`` are read as AdamW's.
_UNKNOWN = CatalogueEntry("unknown", build=lambda *a, **k: None)  # type: ignore[arg-type, return-value]

_BNB_NAMES = {
    "AdamW8bit": "adamw8bit",
    "PagedAdamW8bit": "paged_adamw8bit",
    "Lion": "lion",
    "Lion8bit": "lion8bit",
}


def identify(optimizer: Optimizer) -> str | None:
    """The catalogue name of ``optimizer``'s kind, or ``None`` when the catalogue does not know it.

    Exact types only (a subclass may change the update): torch's AdamW and Adam are ``"adamw"``, SGD is
    ``"sgd_momentum"`` or ``"sgd"`` by its momentum, Adafactor ``"adafactor"``, and bitsandbytes'
    AdamW8bit, PagedAdamW8bit, Lion, Lion8bit their own names; torch-optimi's AdamW and SGD (without
    momentum) ``"adamw_kahan"`` and ``"sgd_kahan"`` unless Kahan summation is off. ``maximize=True`` is
    not known.
    """
    if any(group.get("maximize", False) for group in optimizer.param_groups):
        return None
    cls = type(optimizer)
    if cls in (torch.optim.AdamW, torch.optim.Adam):
        return "adamw"
    if cls is torch.optim.Adafactor:
        return "adafactor"
    if cls is torch.optim.SGD:
        return "sgd_momentum" if any(g.get("momentum", 0) for g in optimizer.param_groups) else "sgd"
    if cls.__module__.startswith("bitsandbytes."):
        return _BNB_NAMES.get(cls.__name__)
    # Kahan on, and the decay scaled by the learning rate as torch's (decouple_lr=True decays without it)
    kahan = [g.get("kahan_sum") is not False and not g.get("decouple_lr") for g in optimizer.param_groups]
    if cls in (optimi.AdamW, optimi.SGD) and all(kahan):
        if cls is optimi.AdamW:
            return "adamw_kahan"
        return None if any(g.get("momentum", 0) for g in optimizer.param_groups) else "sgd_kahan"
    return None


def valid_candidates(candidates: Iterable[str]) -> tuple[str, ...]:
    """``candidates`` as a tuple of catalogue names (one name alone is one candidate); an unknown name
    raises ``ValueError`` with the closest one."""
    if isinstance(candidates, str):
        candidates = (candidates,)
    out = tuple(valid_name("optimizer candidate", name, CATALOGUE) for name in candidates)
    if not out:
        raise ValueError(f"candidates must name at least one of {', '.join(CATALOGUE)}")
    return out


def available_candidates(candidates: Iterable[str], info: Callable[[str], Any] = _log.info) -> list[str]:
    """The ``candidates`` that can be built here: those that need bitsandbytes are dropped, with one
    ``info`` line, where it does not load."""
    names = list(valid_candidates(candidates))
    needs = [n for n in names if CATALOGUE[n].needs_bitsandbytes]
    if needs and load_bitsandbytes() is None:
        info(f"bitsandbytes is not available here: skipping the candidates {', '.join(needs)}.")
        names = [n for n in names if not CATALOGUE[n].needs_bitsandbytes]
    return names


# --------------------------------------------------------------------------------------------------
# Building the new optimizer
# --------------------------------------------------------------------------------------------------


def _entry(name: str | None) -> CatalogueEntry:
    return _UNKNOWN if name is None else CATALOGUE[name]


def lr_factor(source: str | None, target: str) -> float:
    """How much ``target``'s learning rate is larger than ``source``'s under the translation rules."""
    return CATALOGUE[target].lr_scale / _entry(source).lr_scale


def swap_optimizer(optimizer: Optimizer, name: str, *, allow_unknown: bool = False) -> Optimizer:
    """A new ``name`` optimizer over ``optimizer``'s param groups, hyperparameters translated per group.

    Each group keeps its parameters and its own keys (a group's ``"name"``, a scheduler's
    ``"initial_lr"``, learning rates scaled by the rule). The old optimizer's ``lr`` and
    ``weight_decay`` are read in AdamW's terms and translated (``betas`` and ``eps`` carried within the
    Adam family; other options such as ``fused`` are not):

    =================================  ======  ============  ==========================
    to                                 lr      weight_decay  also
    =================================  ======  ============  ==========================
    adamw, adamw8bit, paged_adamw8bit  x 1     x 1           ``betas``, ``eps`` carried
    lion, lion8bit                     / 10    x 10          ``betas=(0.9, 0.99)``
    adafactor                          x 10    / 10          ``beta2_decay=-0.8``
    sgd_momentum                       x 30    / 300         ``momentum=0.9``
    sgd                                x 300   / 300
    =================================  ======  ============  ==========================

    Each keeps AdamW's decay per step (``lr * weight_decay``); the papers and measurements behind the
    factors are in docs/design/optimizers.md. An optimizer the catalogue
    (`CATALOGUE`) does not know raises unless ``allow_unknown=True``, which reads its ``lr`` and
    ``weight_decay`` as AdamW's. The new optimizer has no state yet; ``optimizer`` is left as it was.

    Example::

        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
        optimizer = swap_optimizer(optimizer, "lion")  # lr=3e-4, weight_decay=1.0, betas=(0.9, 0.99)
    """
    if not isinstance(optimizer, Optimizer):
        raise TypeError(
            f"swap_optimizer takes the torch.optim.Optimizer to replace (its param groups are carried over) "
            f"and the catalogue name to swap to; got {type(optimizer).__name__} for the optimizer"
        )
    target = CATALOGUE[valid_name("optimizer", name, CATALOGUE)]
    source_name = identify(optimizer)
    if source_name is None and not allow_unknown:
        raise ValueError(
            f"{type(optimizer).__name__} is not in the optimizer catalogue ({', '.join(CATALOGUE)}); pass "
            "allow_unknown=True to read its lr and weight_decay as AdamW's."
        )
    source = _entry(source_name)
    factor = target.lr_scale / source.lr_scale
    hyper = set(optimizer.defaults)
    groups = []
    for group in optimizer.param_groups:
        # a scheduler's learning rates are kept even where they share a hyperparameter's name (optimi's
        # max_lr, None unless set): OneCycleLR writes its bounds there
        kept = {k: v for k, v in group.items() if k != "params" and (k not in hyper or is_lr(k, v))}
        for key in LR_KEYS:
            if is_lr(key, kept.get(key)):
                kept[key] = scalar(kept[key]) * factor
        groups.append({**kept, **target.translate(source.to_adamw(group)), "params": list(group["params"])})
    defaults = target.translate(source.to_adamw(optimizer.defaults))
    return target.build(groups, **defaults)


def is_lr(key: str, value: Any) -> bool:
    """Whether a param group's ``key`` holds a scheduler's learning rate (`LR_KEYS`) as a number."""
    return key in LR_KEYS and isinstance(scalar(value), (int, float)) and not isinstance(value, bool)


def configured_optimizer(model: nn.Module) -> tuple[Optimizer | None, bool]:
    """The one optimizer ``configure_optimizers`` builds (``None``: not a LightningModule, several, none,
    or it fails outside a Trainer), and whether it returns more than the optimizer (a scheduler)."""
    if not is_lightning(model):
        return None, False
    try:
        with lightning_stand_ins(model, model_device(model)), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            config = model.configure_optimizers()
            optimizers = optimizers_from(config)
    except Exception:
        return None, False
    return (optimizers[0] if len(optimizers) == 1 else None), not isinstance(config, Optimizer)


def own_optimizer(model: nn.Module) -> str | None:
    """The catalogue name of the optimizer ``configure_optimizers`` builds; ``None`` if unknown or absent."""
    optimizer, _ = configured_optimizer(model)
    return None if optimizer is None else identify(optimizer)


def constructor(name: str) -> str:
    """The public path of the class the catalogue builds for ``name``: ``"bitsandbytes.optim.AdamW8bit"``,
    ``"torch.optim.AdamW"``, ``"optimi.AdamW"``."""
    build = CATALOGUE[name].build
    if not isinstance(build, type):
        return build.__qualname__  # `_bnb_class`'s
    parts = build.__module__.split(".")
    for i in range(1, len(parts) + 1):  # the shortest path that exports it: torch.optim.adamw.AdamW's
        package = ".".join(parts[:i])
        if getattr(sys.modules.get(package), build.__name__, None) is build:
            return f"{package}.{build.__name__}"
    return f"{build.__module__}.{build.__name__}"


def constructor_arguments(name: str, optimizer: Optimizer | None) -> dict[str, Any]:
    """The keyword arguments ``name``'s constructor gets in place of ``optimizer``: its defaults translated
    as `swap_optimizer` translates them; torch AdamW's own defaults where ``optimizer`` is ``None`` or not
    in the catalogue."""
    source = _entry(identify(optimizer) if optimizer is not None else "adamw")
    if optimizer is None or source is _UNKNOWN:
        optimizer, source = torch.optim.AdamW([torch.zeros(1, requires_grad=True)]), CATALOGUE["adamw"]
    return CATALOGUE[name].translate(source.to_adamw(optimizer.defaults))


def lighter_candidates(
    model: nn.Module, candidates: Sequence[str] = DEFAULT_CANDIDATES
) -> tuple[str | None, ...]:
    """The optimizers `plan_fit` may give ``model``, in quality order: its own (`own_optimizer`), then the
    ``candidates`` after it (all of them if it is not among them) that load here; ``(None,)`` for a
    LightningModule whose optimizer the catalogue does not know (kept as configured)."""
    own = own_optimizer(model)
    if own is None:
        return (None,) if is_lightning(model) else tuple(candidates)
    order = list(candidates)
    after = order[order.index(own) + 1 :] if own in order else order
    names = [own] + [n for n in after if n != own]
    if not bitsandbytes_installed():  # one that fails to load is skipped where it would be simulated
        names = [n for n in names if not CATALOGUE[n].needs_bitsandbytes]
    return tuple(names)
