"""Moving an LR scheduler to the optimizer a swap built (`rebind_scheduler`), its schedule's shape kept.

`swap_optimizer` (`_optimizers.swap`) scales every learning rate of the new optimizer's param groups by one
factor (`lr_factor`); a scheduler holds learning rates of its own (``base_lrs``, floors such as
``eta_min``), which are scaled here by the same factor, for each of torch's schedulers, so that every later
``lr`` is the old schedule's times that factor.
"""

from __future__ import annotations

import functools
import math
import warnings
import weakref
from typing import Any

import torch
from torch.optim import Optimizer

from lightning_memkit._optimizers.swap import LR_KEYS, is_lr, scalar

__all__ = ["rebind_scheduler"]

#: Per-group lists on a scheduler that hold learning rates (LambdaLR, CyclicLR, ReduceLROnPlateau, ...).
_SCHEDULER_LR_LISTS = ("base_lrs", "_last_lr", "min_lrs", "max_lrs")


def _torch_scheduler(name: str, module: Any = torch.optim.lr_scheduler) -> type | None:
    return getattr(module, name, None)


#: Every scheduler torch ships (of those this torch has), each with its attributes that hold an absolute
#: learning rate as one number for all groups, which `rebind_scheduler` scales besides the per-group lists
#: (`_SCHEDULER_LR_LISTS`) and the group keys (`LR_KEYS`). The chainable ones compute the next lr from the
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
            f"({', '.join(_SCHEDULER_LR_LISTS)}, the param groups' {', '.join(LR_KEYS)}) were scaled by "
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
            setattr(scheduler, attr, [scalar(v) * lr_factor for v in values])
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
        for key in ("lr", *LR_KEYS):
            if not is_lr(key, a.get(key)) and key != "lr":
                continue
            want = scalar(a[key]) * factor
            got = scalar(b.get(key))
            if not isinstance(got, (int, float)) or not math.isclose(got, want, rel_tol=1e-6):
                shown = "missing" if got is None else f"{got:.4g}"
                raise ValueError(
                    f"rebind_scheduler: param group {i}'s {key} is {shown} in the new optimizer, not the "
                    f"old {key} times lr_factor ({scalar(a[key]):.4g} x {factor:g} = {want:.4g}). {what} "
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
