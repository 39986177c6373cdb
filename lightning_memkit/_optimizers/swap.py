"""The optimizers a swap can choose from, and how to swap one for another.

`CATALOGUE` lists them in quality order; `swap_optimizer` and `rebind_scheduler` carry AdamW's
hyperparameters over to each. Which one to use is decided in `_optimizers.choice`; this module estimates
nothing.
The catalogue's table and the translation rules, with their sources: ``docs/design/optimizers.md``.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import math
import sys
import warnings
import weakref
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
    "SGD_LR_SCALE",
    "CatalogueEntry",
    "available_candidates",
    "configured_optimizer",
    "constructor",
    "constructor_arguments",
    "identify",
    "lighter_candidates",
    "load_bitsandbytes",
    "lr_factor",
    "own_optimizer",
    "rebind_scheduler",
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
_LR_KEYS = ("initial_lr", "max_lr", "min_lr", "swa_lr")
#: Per-group lists on a scheduler that hold learning rates (LambdaLR, CyclicLR, ReduceLROnPlateau, ...).
_SCHEDULER_LR_LISTS = ("base_lrs", "_last_lr", "min_lrs", "max_lrs")


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


def _scalar(value: Any) -> Any:
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
            out["lr"] = _scalar(adamw_group["lr"]) * self.lr_scale
        if "weight_decay" in adamw_group:
            out["weight_decay"] = _scalar(adamw_group["weight_decay"]) * self.decay_scale
        out.update({k: adamw_group[k] for k in self.carries if k in adamw_group})
        out.update(self.fixed)
        return out

    def to_adamw(self, group: dict[str, Any]) -> dict[str, Any]:
        """The inverse of `translate`: AdamW's hyperparameters equivalent to this optimizer's ``group``."""
        out = {
            "lr": _scalar(group["lr"]) / self.lr_scale,
            "weight_decay": _scalar(group.get("weight_decay", 0.0)) / self.decay_scale,
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
# Building the new optimizer, rebinding schedulers
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
        kept = {k: v for k, v in group.items() if k != "params" and (k not in hyper or _is_lr(k, v))}
        for key in _LR_KEYS:
            if _is_lr(key, kept.get(key)):
                kept[key] = _scalar(kept[key]) * factor
        groups.append({**kept, **target.translate(source.to_adamw(group)), "params": list(group["params"])})
    defaults = target.translate(source.to_adamw(optimizer.defaults))
    return target.build(groups, **defaults)


def _is_lr(key: str, value: Any) -> bool:
    """Whether a param group's ``key`` holds a scheduler's learning rate (`_LR_KEYS`) as a number."""
    return key in _LR_KEYS and isinstance(_scalar(value), (int, float)) and not isinstance(value, bool)


def _torch_scheduler(name: str, module: Any = torch.optim.lr_scheduler) -> type | None:
    return getattr(module, name, None)


#: Every scheduler torch ships (of those this torch has), each with its attributes that hold an absolute
#: learning rate as one number for all groups, which `rebind_scheduler` scales besides the per-group lists
#: (`_SCHEDULER_LR_LISTS`) and the group keys (`_LR_KEYS`). The chainable ones compute the next lr from the
#: group's current one (``group["lr"] * factor``, or ``eta_min + ratio * (group["lr"] - eta_min)`` for the
#: cosines): every term is then a learning rate times a number, so scaling every learning rate it holds
#: scales every later one. ReduceLROnPlateau's ``eps`` is the smallest lr reduction it applies, a difference
#: of learning rates; its ``default_min_lr`` the floor for groups added later.
_TRANSLATED: dict[type, tuple[str, ...]] = {
    cls: scalars
    for cls, scalars in (
        (_torch_scheduler("LambdaLR"), ()),
        (_torch_scheduler("MultiplicativeLR"), ()),
        (_torch_scheduler("StepLR"), ()),
        (_torch_scheduler("MultiStepLR"), ()),
        (_torch_scheduler("ConstantLR"), ()),
        (_torch_scheduler("LinearLR"), ()),
        (_torch_scheduler("ExponentialLR"), ()),
        (_torch_scheduler("PolynomialLR"), ()),
        (_torch_scheduler("SequentialLR"), ()),  # its children are rebound
        (_torch_scheduler("ChainedScheduler"), ()),
        (_torch_scheduler("CosineAnnealingLR"), ("eta_min",)),
        (_torch_scheduler("CosineAnnealingWarmRestarts"), ("eta_min",)),
        (_torch_scheduler("ReduceLROnPlateau"), ("default_min_lr", "eps")),
        (_torch_scheduler("CyclicLR"), ()),  # base_lrs, max_lrs
        (_torch_scheduler("OneCycleLR"), ()),  # initial_lr, max_lr, min_lr in the groups
        (_torch_scheduler("SWALR", torch.optim.swa_utils), ()),  # swa_lr in the groups
    )
    if cls is not None
}
#: Methods through which a scheduler computes learning rates: a subclass that overrides one computes its own.
_LR_METHODS = ("get_lr", "_get_closed_form_lr", "step", "_update_lr", "_initial_step", "_reduce_lr")


def _translated_as(scheduler: Any) -> type | None:
    """The scheduler of `_TRANSLATED` whose computation ``scheduler``'s is: its class, or the nearest one
    it derives from without overriding how learning rates are computed; ``None`` for any other."""
    for cls in type(scheduler).__mro__:
        if cls in _TRANSLATED:
            return cls
        if cls.__module__.startswith("torch.") or any(m in vars(cls) for m in _LR_METHODS):
            return None
    return None


def rebind_scheduler(scheduler: Any, optimizer: Optimizer, lr_factor: float = 1.0) -> None:
    """Point ``scheduler`` at ``optimizer`` (built by `swap_optimizer`), keeping its schedule's shape.

    ``lr_factor`` is the ratio of the new optimizer's learning rates to the old one's (`lr_factor`). The
    schedule's own state (``last_epoch``, lambdas, counters) is kept; every learning rate it holds is
    multiplied by ``lr_factor``: the per-group lists (``base_lrs``, ``min_lrs``, CyclicLR's ``max_lrs``),
    the absolute floors (the cosines' ``eta_min``, ReduceLROnPlateau's ``eps``), and the group keys
    (``initial_lr``, OneCycleLR's bounds, scaled by `swap_optimizer`), so every later ``lr`` is the old
    schedule's times ``lr_factor``, for each of torch's schedulers (`_TRANSLATED`), chainable ones
    included. ``SequentialLR``/``ChainedScheduler`` are rebound with their children. CyclicLR's and
    OneCycleLR's momentum cycle moves to the new optimizer's ``betas`` or ``momentum``; one without either
    (Adafactor, SGD without momentum) has no momentum to cycle, and the cycle is dropped with a warning.

    Raises ``ValueError``, changing nothing, where ``optimizer``'s param groups are not the old ones with
    every learning rate times ``lr_factor``: then no one factor keeps the shape (``eta_min`` is one number
    for all groups). A scheduler torch does not ship (or a subclass that computes its own learning rates)
    is rebound with a warning: only the learning rates above are scaled, others it may hold are not.
    """
    old = scheduler.optimizer
    _check_scaled(scheduler, old, optimizer, lr_factor)
    kind = _translated_as(scheduler)
    if kind is None:
        warnings.warn(
            f"rebind_scheduler: {type(scheduler).__name__} is not one of torch's schedulers (or overrides "
            f"how one computes its learning rates), so only the learning rates it keeps where torch's do "
            f"({', '.join(_SCHEDULER_LR_LISTS)}, the param groups' {', '.join(_LR_KEYS)}) were scaled by "
            f"{lr_factor:g}; a learning rate it holds elsewhere (a floor, a peak) was not, and the schedule "
            f"may change shape from here on. Multiply such a value by {lr_factor:g} after the swap, or "
            "schedule with one of torch.optim.lr_scheduler's.",
            UserWarning,
            stacklevel=2,
        )
    scheduler.optimizer = optimizer
    for attr in _SCHEDULER_LR_LISTS:
        values = scheduler.__dict__.get(attr)
        if isinstance(values, list) and len(values) == len(optimizer.param_groups):
            setattr(scheduler, attr, [_scalar(v) * lr_factor for v in values])
    for attr in _TRANSLATED.get(kind, ()) if kind is not None else ():
        value = scheduler.__dict__.get(attr)
        if value is not None:
            setattr(scheduler, attr, value * lr_factor)
    if scheduler.__dict__.get("cycle_momentum"):
        _rebind_momentum_cycle(scheduler, optimizer)
    for child in scheduler.__dict__.get("_schedulers", ()):
        if child.optimizer is old:
            rebind_scheduler(child, optimizer, lr_factor)
    _track_step_calls(optimizer, old)


def _check_scaled(scheduler: Any, old: Optimizer, new: Optimizer, factor: float) -> None:
    """Raise unless ``new``'s param groups are ``old``'s with every learning rate times ``factor``."""
    what = type(scheduler).__name__
    fix = (
        "Build the new optimizer with swap_optimizer(old, name) and pass lr_factor(identify(old), name), "
        "the factor it scaled the learning rates by."
    )
    if len(new.param_groups) != len(old.param_groups):
        raise ValueError(
            f"rebind_scheduler: {what}'s optimizer has {len(old.param_groups)} param groups and the new one "
            f"{len(new.param_groups)}: a scheduler keeps one learning rate per group, so it moves only to "
            f"an optimizer over the same groups. {fix}"
        )
    for i, (a, b) in enumerate(zip(old.param_groups, new.param_groups, strict=True)):
        for key in ("lr", *_LR_KEYS):
            if not _is_lr(key, a.get(key)) and key != "lr":
                continue
            want = _scalar(a[key]) * factor
            got = _scalar(b.get(key))
            if not isinstance(got, (int, float)) or not math.isclose(got, want, rel_tol=1e-6):
                shown = "missing" if got is None else f"{got:.4g}"
                raise ValueError(
                    f"rebind_scheduler: param group {i}'s {key} is {shown} in the new optimizer, not the "
                    f"old {key} times lr_factor ({_scalar(a[key]):.4g} x {factor:g} = {want:.4g}). {what} "
                    "is rebound by scaling every learning rate it holds by the one lr_factor (its base_lrs, "
                    "and floors such as eta_min, one number for all groups), so its schedule keeps its shape "
                    f"only where every group's learning rates are the old ones times that factor. {fix}"
                )


def _rebind_momentum_cycle(scheduler: Any, optimizer: Optimizer) -> None:
    """Point CyclicLR's or OneCycleLR's momentum cycle at ``optimizer``'s ``betas[0]`` or ``momentum``, as
    torch picks them; drop it where there is neither (cycling SGD's momentum up from 0 would make it momentum
    SGD, with a buffer; torch-optimi's AdamW names its beta ``beta1``, which torch's schedulers never
    write)."""
    groups = optimizer.param_groups
    if "betas" in optimizer.defaults and all("betas" in g for g in groups):  # not optimi's beta1
        scheduler.use_beta1 = True
    elif "momentum" in optimizer.defaults and all(g.get("momentum", 0) for g in groups):
        scheduler.use_beta1 = False
    else:
        scheduler.cycle_momentum = False
        warnings.warn(
            f"rebind_scheduler: {type(scheduler).__name__} cycles the momentum (beta1) as well as the "
            f"learning rate, and {type(optimizer).__name__} has none to cycle (no betas, no momentum): the "
            "momentum cycle is dropped, the learning-rate schedule kept. Pass cycle_momentum=False to the "
            "scheduler to silence this, or keep to candidates with betas or momentum (adamw8bit, lion, "
            "sgd_momentum).",
            UserWarning,
            stacklevel=3,
        )


def _track_step_calls(optimizer: Optimizer, old: Optimizer) -> None:
    """Wrap ``optimizer.step`` as torch's LRScheduler does on construction, so that scheduler's check
    "was ``optimizer.step()`` called before ``scheduler.step()``?" keeps working after the swap."""
    if getattr(old, "_opt_called", False):
        optimizer._opt_called = True  # type: ignore[attr-defined]
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        return
    opt_ref = weakref.ref(optimizer)
    func = optimizer.step.__func__  # type: ignore[attr-defined]

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        opt = opt_ref()
        opt._opt_called = True  # type: ignore[union-attr]
        return func.__get__(opt, opt.__class__)(*args, **kwargs)

    wrapper._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = wrapper  # type: ignore[method-assign]


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
