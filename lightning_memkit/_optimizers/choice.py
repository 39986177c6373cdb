"""Which optimizer to train with: the best one of the catalogue whose training step fits the budget.

The catalogue and the rules that carry AdamW's hyperparameters over to each lighter optimizer are in
`_optimizers.swap`. This module estimates a step with a given set of optimizers and decides: the originals
when they fit, else the first candidate whose *whole step* fits the budget, estimated on the user's own
model. `fit_optimizer` is the decision for a plain training loop; the `OptimizerSwap` callback takes it
inside a Trainer (`choose_optimizer`, with the Trainer's own estimate).

How a candidate is judged to fit: the peak of a whole training step with it, estimated by
`estimate_memory` on fake tensors (the user's own forward, backward and ``optimizer.step()``), must be at
most the budget. bitsandbytes registers fake kernels for its optimizer updates (0.50 does), so the 8-bit
steps are simulated like any other; with an older bitsandbytes whose kernels cannot run on fake tensors,
the step is simulated with plain SGD (no state, no temporaries in ``step()``) and the 8-bit state bytes
from `_estimating.analytic` are added: exact where the 8-bit update works in place, as the fused CUDA kernels
do.
Where no step can be simulated (manual optimization, several optimizers, no example batch) the decision
is on the *static* memory: parameters + gradients + the optimizers' state after one simulated
``step()``, so the budget must leave room for the activations.
"""

from __future__ import annotations

import functools
import logging
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_memkit._breakdown import MemoryBreakdown, format_bytes
from lightning_memkit._budget import Budget, parse_budget
from lightning_memkit._estimating.optimizer_state import OPTIMIZERS
from lightning_memkit._estimating.precision import sixteen_bit_weights
from lightning_memkit._estimating.simulate import estimate_memory, estimate_step
from lightning_memkit._levers.fused_step import needs_closure
from lightning_memkit._measuring.storages import allocation_rounding, model_device, rounded
from lightning_memkit._optimizers.schedulers import rebind_scheduler
from lightning_memkit._optimizers.swap import (
    CATALOGUE,
    COMPENSATED,
    DEFAULT_CANDIDATES,
    KAHAN,
    available_candidates,
    identify,
    lr_factor,
    swap_optimizer,
)
from lightning_memkit._step import Lever, Step

__all__ = [
    "Estimator",
    "OptimizerChoice",
    "choose_optimizer",
    "fit_optimizer",
    "simulated_estimator",
    "state_bytes",
    "static_estimator",
]

_log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------------
# Estimating a step with a given set of optimizers
# --------------------------------------------------------------------------------------------------

#: ``estimate(optimizers) -> MemoryBreakdown`` of one training step run with those optimizers.
Estimator = Callable[[Sequence[Optimizer]], MemoryBreakdown]


class _Holder(nn.Module):
    """The parameters of one optimizer as a module, so `estimate_memory` can step them on fake tensors."""

    def __init__(self, params: Iterable[Tensor]) -> None:
        super().__init__()
        self.params = nn.ParameterList(params)

    def forward(self, x: Tensor) -> Tensor:
        return sum((p.sum() for p in self.params), x.sum())


def state_bytes(optimizer: Optimizer, *, device: str | torch.device = "cpu") -> int:
    """Bytes of ``optimizer.state`` after one ``step()`` over its parameters, from a simulated step.

    The optimizer is rebuilt (same class and param groups) over fake twins of its parameters and
    stepped once with zero gradients, so nothing is allocated and ``optimizer`` is not touched. Any
    optimizer torch can rebuild as ``type(opt)(param_groups, **opt.defaults)`` works. ``device="cuda"``
    rounds each tensor to the caching allocator's 512-byte blocks.
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if not params:
        return 0
    holder = _Holder(params)
    x = torch.zeros(1)
    try:
        return estimate_memory(
            holder, (x, x), optimizer=optimizer, loss_fn=_output, device=device
        ).optimizer_state
    except Exception:
        name = identify(optimizer)
        if name is None or not CATALOGUE[name].needs_bitsandbytes:
            raise
    # A bitsandbytes without fake kernels: `_estimating.analytic`'s formulas, exact against bitsandbytes
    # 0.43-0.50.
    return _analytic_state_bytes(name, params)


def _output(output: Tensor, target: Tensor) -> Tensor:
    return output


def _analytic_state_bytes(name: str, params: Sequence[Tensor]) -> int:
    """`_estimating.analytic`'s bytes for ``params``; torch.optim state takes each parameter's element size.
    The
    CUDA allocator's 512-byte rounding of each state tensor is not added (under 0.1 % for real models)."""
    by_size: dict[int, list[tuple[int, ...]]] = {}
    for p in params:
        by_size.setdefault(p.element_size(), []).append(tuple(p.shape))
    return sum(OPTIMIZERS[name](shapes, size) for size, shapes in by_size.items())


def static_estimator(
    model: nn.Module, *, device: str | torch.device | None = None, gradients: bool = True
) -> Estimator:
    """Parameters + gradients + the optimizers' state (`state_bytes`): the step without activations;
    without the gradients for a step that never holds them all (`fuse_optimizer_step`)."""
    device = torch.device(device or model_device(model).type)
    rounding = allocation_rounding(device)

    def storages(tensors: Iterable[Tensor]) -> int:
        # One entry per storage (tied weights once); meta tensors have none, so they count by identity.
        sizes = {}
        for t in tensors:
            if t.device.type == "meta":
                sizes[id(t)] = t.numel() * t.element_size()
            else:
                sizes[id(t.untyped_storage())] = t.untyped_storage().nbytes()
        return sum(rounded(n, rounding) for n in sizes.values())

    params = storages([*model.parameters(), *model.buffers()])
    grads = storages(p for p in model.parameters() if p.requires_grad) if gradients else 0

    def estimate(optimizers: Sequence[Optimizer]) -> MemoryBreakdown:
        state = sum(state_bytes(o, device=device) for o in optimizers)
        return MemoryBreakdown(parameters=params, gradients=grads, optimizer_state=state)

    return estimate


def simulated_estimator(
    model: nn.Module,
    batch: Any,
    step: Step,
    *,
    loss_fn: Callable[[Any, Any], Tensor] | None = None,
    device: str | torch.device | None = None,
) -> Estimator:
    """The whole ``step`` on fake tensors (`estimate_memory`), with one optimizer."""
    device = torch.device(device or model_device(model).type)
    run = functools.partial(estimate_step, model, batch, step, loss_fn=loss_fn, device=device)

    def estimate(optimizers: Sequence[Optimizer]) -> MemoryBreakdown:
        if len(optimizers) != 1:
            raise NotImplementedError(f"The simulated step takes one optimizer, got {len(optimizers)}")
        (optimizer,) = optimizers
        try:
            return run(optimizer=optimizer)
        except Exception:
            name = identify(optimizer)
            if name is None or not CATALOGUE[name].needs_bitsandbytes:
                raise
        # bitsandbytes without fake kernels: the rest of the step with plain SGD (no state, no
        # temporaries in step()), plus the 8-bit state, which lives through the whole step.
        rest = run(optimizer=functools.partial(torch.optim.SGD, lr=1e-3))
        params = [p for g in optimizer.param_groups for p in g["params"]]
        return replace(rest, optimizer_state=_analytic_state_bytes(name, params))

    return estimate


# --------------------------------------------------------------------------------------------------
# The decision
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OptimizerChoice:
    """What `fit_optimizer` (and `OptimizerSwap`) decided, with the numbers. Bytes throughout.

    Attributes:
        name: the catalogue name of the optimizer(s) now in use; ``None`` when the originals were kept
            and are not in the catalogue.
        originals: the catalogue name of each original optimizer (``None``: not in the catalogue).
        optimizers: the optimizers to train with, one per original, in order; one that was not swapped
            is the original object itself.
        replaced: the original optimizers, in the same order.
        budget: the budget the step had to fit.
        breakdown: the estimated step with ``optimizers`` (``None`` when nothing was estimated: an
            unknown optimizer left alone).
        tried: ``(name, estimated peak)`` of every setup estimated, in order, the originals first
            (named ``"original"``).
        method: ``"simulated"`` (the whole step on fake tensors), ``"static"`` (parameters + gradients +
            optimizer state) or ``"given"`` (the caller's ``step_peak``).
        lr_factors: each optimizer's learning rates over its original's (1.0 where not swapped): what
            `rebind` scales a scheduler's learning rates by.
    """

    name: str | None
    originals: tuple[str | None, ...]
    optimizers: tuple[Optimizer, ...]
    replaced: tuple[Optimizer, ...]
    budget: int
    breakdown: MemoryBreakdown | None
    tried: tuple[tuple[str, int], ...] = ()
    method: str = "simulated"
    lr_factors: tuple[float, ...] = field(default=())

    @property
    def changed(self) -> bool:
        """Whether any optimizer was replaced."""
        return any(new is not old for new, old in zip(self.optimizers, self.replaced, strict=True))

    @property
    def optimizer(self) -> Optimizer:
        """The optimizer to train with, when there is one."""
        if len(self.optimizers) != 1:
            raise ValueError(f"There are {len(self.optimizers)} optimizers; read `optimizers`.")
        return self.optimizers[0]

    @property
    def peak(self) -> int | None:
        """The estimated step peak with ``optimizers``, in bytes."""
        return None if self.breakdown is None else self.breakdown.peak

    @property
    def state_bytes(self) -> int | None:
        """Bytes of the optimizers' state in the estimated step."""
        return None if self.breakdown is None else self.breakdown.optimizer_state

    @property
    def hparams(self) -> list[list[dict[str, Any]]]:
        """Each optimizer's param groups without their parameters: the translated hyperparameters."""
        return [
            [{k: v for k, v in g.items() if k != "params"} for g in o.param_groups] for o in self.optimizers
        ]

    def rebind(self, scheduler: Any) -> None:
        """Point a scheduler of a replaced optimizer at its replacement, keeping the schedule's shape."""
        for old, new, factor in zip(self.replaced, self.optimizers, self.lr_factors, strict=True):
            if scheduler.optimizer is old and new is not old:
                rebind_scheduler(scheduler, new, factor)
                return

    def summary(self) -> str:
        """One paragraph with the decision and its numbers, as `OptimizerSwap` prints it."""
        what = "parameters + gradients + optimizer state" if self.method == "static" else "step peak"
        budget = format_bytes(self.budget)
        tried = ", ".join(f"{name} {format_bytes(peak)}" for name, peak in self.tried)
        if self.breakdown is None:
            return f"kept {_describe(self.replaced)}: not in the catalogue (allow_unknown=False)."
        if not self.changed:
            state = format_bytes(self.breakdown.optimizer_state)
            return (
                f"kept {_describe(self.replaced)}: estimated {what} {format_bytes(self.breakdown.peak)} "
                f"(optimizer state {state}) fits the budget of {budget}."
            )
        old = self.tried[0][1] if self.tried else 0
        hp = "; ".join(_hparams_text(o) for o in self.optimizers if o not in self.replaced)
        return (
            f"{_describe(self.replaced)} -> {self.name}: estimated {what} {format_bytes(old)} is over the "
            f"budget of {budget}; {self.name} needs {format_bytes(self.breakdown.peak)} (optimizer state "
            f"{format_bytes(self.breakdown.optimizer_state)}). Tried: {tried}. Hyperparameters: {hp}."
        )


def _describe(optimizers: Sequence[Optimizer]) -> str:
    return " + ".join(type(o).__name__ for o in optimizers)


def _hparams_text(optimizer: Optimizer) -> str:
    keys = ("lr", "weight_decay", "betas", "momentum")
    groups = [", ".join(f"{k}={_fmt(g[k])}" for k in keys if k in g) for g in optimizer.param_groups]
    return f"{type(optimizer).__name__}: " + " | ".join(f"[{g}]" for g in groups)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, tuple):
        return "(" + ", ".join(_fmt(v) for v in value) + ")"
    return str(value)


def compensated_candidates(
    candidates: Sequence[str], optimizers: Sequence[Optimizer], precision: str
) -> tuple[str, ...]:
    """``candidates`` for optimizers that keep a compensated update (torch-optimi's Kahan summation) on
    16-bit weights: each as its Kahan twin (`COMPENSATED`), the others left out, so that a swap never
    trades the compensation for an update that rounds the small steps away. Otherwise unchanged."""
    if not sixteen_bit_weights(precision) or not any(identify(o) in KAHAN for o in optimizers):
        return tuple(candidates)
    return tuple(dict.fromkeys(COMPENSATED[c] for c in candidates if c in COMPENSATED))


def choose_optimizer(
    optimizers: Sequence[Optimizer],
    budget: int | Budget,
    estimate: Estimator,
    *,
    candidates: Sequence[str] = DEFAULT_CANDIDATES,
    allow_unknown: bool = False,
    method: str = "simulated",
    info: Callable[[str], Any] = _log.info,
    warn: Callable[[str], Any] | None = None,
) -> OptimizerChoice:
    """The decision behind `fit_optimizer` and `OptimizerSwap`, over any ``estimate``.

    The originals are estimated first and kept when they fit. Otherwise each candidate in order
    replaces every swappable original (known to the catalogue, or any with ``allow_unknown``) and the
    first whose estimate fits is returned. None fitting raises ``ValueError`` with the numbers.
    ``budget`` may be a `Budget`, so that the messages say it as it was given (``"60MB (57.22 MiB)"``).

    An optimizer whose ``step()`` needs a closure (``torch.optim.LBFGS``) is never swapped: its step
    cannot be simulated without one, and a first-order optimizer in its place is another algorithm, not a
    lighter one. With ``allow_unknown=True`` it raises ``ValueError`` before anything is estimated.
    """
    warn = warn or _warn
    limit = budget.usable if isinstance(budget, Budget) else budget
    optimizers = tuple(optimizers)
    originals = tuple(identify(o) for o in optimizers)
    swappable = tuple(name is not None or allow_unknown for name in originals)
    closures = [type(o).__name__ for o in optimizers if needs_closure(o)]  # never in the catalogue
    if closures and allow_unknown:
        raise ValueError(_closure_message(closures))
    unknown = [type(o).__name__ for o, name in zip(optimizers, originals, strict=True) if name is None]
    if unknown and not allow_unknown:
        warn(_unknown_message(unknown, closures))
    unchanged = functools.partial(
        OptimizerChoice, originals=originals, optimizers=optimizers, replaced=optimizers, budget=limit,
        method=method, lr_factors=(1.0,) * len(optimizers),
    )  # fmt: skip
    if not any(swappable):
        return unchanged(name=_common_name(originals), breakdown=None)

    baseline = estimate(optimizers)
    tried = [("original", baseline.peak)]
    if baseline.peak <= limit:
        return unchanged(name=_common_name(originals), breakdown=baseline, tried=tuple(tried))

    available = available_candidates(candidates, info)
    best: tuple[str, MemoryBreakdown] = ("original", baseline)
    for name in available:
        if all(not s or o == name for o, s in zip(originals, swappable, strict=True)):
            continue  # already this optimizer
        new = _swapped(optimizers, swappable, name)
        b = estimate(new)
        tried.append((name, b.peak))
        if b.peak < best[1].peak:
            best = (name, b)
        if b.peak <= limit:
            return OptimizerChoice(
                name=name, originals=originals, optimizers=new, replaced=optimizers, budget=limit,
                breakdown=b, tried=tuple(tried), method=method,
                lr_factors=_lr_factors(originals, swappable, name),
            )  # fmt: skip
    given = budget if isinstance(budget, Budget) else Budget(limit, limit, f"{limit} bytes")
    raise ValueError(_infeasible(given, best, tried, method, available))


def _common_name(originals: Sequence[str | None]) -> str | None:
    """The catalogue name of the optimizers when they are all one (``None``: several, or unknown)."""
    return originals[0] if len(set(originals)) == 1 else None


def _swapped(optimizers: Sequence[Optimizer], swappable: Sequence[bool], name: str) -> tuple[Optimizer, ...]:
    """Each swappable optimizer as a fresh ``name`` over the same param groups; the others as they are."""
    return tuple(
        swap_optimizer(o, name, allow_unknown=True) if s else o
        for o, s in zip(optimizers, swappable, strict=True)
    )


def _lr_factors(originals: Sequence[str | None], swappable: Sequence[bool], name: str) -> tuple[float, ...]:
    """Each optimizer's learning-rate factor for a swap to ``name`` (`lr_factor`); 1 where it stays."""
    return tuple(lr_factor(src, name) if s else 1.0 for src, s in zip(originals, swappable, strict=True))


def _unknown_message(unknown: Sequence[str], closures: Sequence[str]) -> str:
    """The warning for optimizers the catalogue does not know, left as they are: how to swap them anyway,
    or, for one whose step needs a closure, why it cannot be."""
    swappable_later = [n for n in unknown if n not in closures]
    return (
        f"{', '.join(unknown)} is not in the optimizer catalogue ({', '.join(CATALOGUE)}), so it is "
        "left as it is"
        + (
            f"; pass allow_unknown=True to swap {', '.join(swappable_later)} anyway (its lr and "
            "weight_decay are then read as AdamW's)."
            if swappable_later
            else " (its step() needs a closure: it cannot be swapped)."
        )
    )


def _closure_message(names: Sequence[str]) -> str:
    return (
        f"{', '.join(names)} cannot be swapped for a lighter optimizer: its step() needs a closure that "
        "re-evaluates the loss several times per step (a line search), so the step cannot be estimated "
        "without running it, and a first-order optimizer (AdamW, Lion, SGD) in its place is another "
        "algorithm, not a lighter one (LBFGS's lr=1 is a step length, not a learning rate). Set "
        "allow_unknown=False to train with it unchanged, or configure the first-order optimizer you want in "
        "configure_optimizers and let the swap lighten that one."
    )


def _warn(message: str) -> None:
    warnings.warn(message, UserWarning, stacklevel=4)


def _budget_text(budget: Budget) -> str:
    """The budget as the user gave it, and in the binary units every other figure uses: ``"60MB"`` is
    ``"60MB (57.22 MiB)"``, ``"H200"`` is ``"H200 (132.91 GiB usable of 140.40 GiB)"``."""
    usable = format_bytes(budget.usable)
    if budget.total != budget.usable:  # a device: the CUDA context and a reserve were taken off
        return f"{budget.source} ({usable} usable of {format_bytes(budget.total)})"
    if budget.source.strip().lower().endswith(("kb", "mb", "gb", "tb")):  # decimal units, 10**3 each
        return f"{budget.source.strip()} ({usable})"
    return usable


def _infeasible(
    budget: Budget,
    best: tuple[str, MemoryBreakdown],
    tried: list[tuple[str, int]],
    method: str,
    candidates: Sequence[str],
) -> str:
    name, b = best
    floor = b.parameters + b.gradients
    what = "parameters + gradients + optimizer state" if method == "static" else "step peak"
    tried_text = ", ".join(f"{n} {format_bytes(p)}" for n, p in tried)
    rest = f", activations {format_bytes(b.activations)}, temporary {format_bytes(b.temporary)}"
    head = (
        f"No optimizer fits the memory budget of {_budget_text(budget)}: the leanest, {name}, needs "
        f"{format_bytes(b.peak)} (static floor: parameters {format_bytes(b.parameters)} + gradients "
        f"{format_bytes(b.gradients)} = {format_bytes(floor)}; optimizer state "
        f"{format_bytes(b.optimizer_state)}{'' if method == 'static' else rest}). Tried (estimated "
        f"{what}, each over the budget): {tried_text}. "
    )
    if floor >= budget.usable:
        return head + (
            "The parameters and gradients alone exceed the budget, so no optimizer can fit: raise the "
            f"budget above {format_bytes(floor)}, shard them over more GPUs (ZeRO-3 / FSDP), or train in "
            "lower precision (bf16-true)."
        )
    also = "" if "sgd" in candidates else "; or add 'sgd' (no optimizer state) to the candidates"
    if method == "static":  # no activations in the estimate: only the optimizer state can shrink
        return head + (
            f"To fit, raise the budget to at least {format_bytes(b.peak)}{also}; or shard the optimizer "
            "state over more GPUs (ZeRO / FSDP), or train in lower precision (bf16-true)."
        )
    return head + (
        f"To fit, raise the budget to at least {format_bytes(b.peak)}{also}; or shrink the rest of the "
        "step: activation checkpointing (the ActivationCheckpointing callback), a smaller micro-batch (with "
        "gradient accumulation to keep the batch size), lower precision, or more GPUs with ZeRO / FSDP "
        "sharding of parameters, gradients and optimizer state."
    )


def fit_optimizer(
    model: nn.Module,
    optimizer: Optimizer | Sequence[Optimizer],
    budget: int | float | str | Budget,
    *,
    batch: Any = None,
    loss_fn: Callable[[Any, Any], Tensor] | None = None,
    step_peak: Callable[[Sequence[Optimizer]], int | MemoryBreakdown] | None = None,
    optimizers: Sequence[str] = DEFAULT_CANDIDATES,
    allow_unknown: bool = False,
    precision: str = "32-true",
    device: str | torch.device | None = None,
    accumulating: bool = False,
    lever: Lever | None = None,
    step: Step | None = None,
) -> OptimizerChoice:
    """Keep ``optimizer`` if the training step fits ``budget``, else the first lighter one that does.

    For training loops without a Trainer. The optimizers are not modified: train with
    ``choice.optimizer`` (or ``choice.optimizers``) and point schedulers at it with
    ``choice.rebind(scheduler)``, before the first step.

    Args:
        model: the model ``optimizer`` trains (a plain ``nn.Module`` or a ``LightningModule``).
        optimizer: the configured optimizer, or several (each that is known is swapped to the same
            candidate, deciding on their sum).
        budget: what one training step may use at its peak: bytes, a size (``"24GiB"``), a GPU name
            (``"A100-40GB"``), a fraction of the current CUDA device or ``"auto"`` (`parse_budget`).
        batch: an example batch. With it the whole step is simulated on fake tensors
            (`estimate_memory`): a ``LightningModule``'s own ``training_step``, or
            ``loss_fn(model(input), target)`` with ``input, target = batch``. Without it (or with several
            optimizers) only the static memory is judged: parameters + gradients + optimizer state.
        loss_fn: ``(output, target) -> loss`` for a plain module with ``batch``.
        step_peak: instead of the estimators, ``step_peak(optimizers)`` returns the step's peak (bytes
            or a `MemoryBreakdown`) with those (fresh, not yet stepped) optimizers.
        optimizers: catalogue names to try in order (see `CATALOGUE`).
        allow_unknown: also swap an optimizer the catalogue does not know, reading its ``lr`` and
            ``weight_decay`` as AdamW's. Otherwise it is left alone with a warning.
        precision: the Lightning precision string the step runs in (simulated step only).
        device: ``"cuda"`` or ``"cpu"``: the allocator to plan for (default: the model's device).
        accumulating: the loop accumulates gradients over micro-batches of ``batch`` (its highest
            micro-batch is simulated; `estimate_memory`).
        lever: what changes the loop's optimizer step (`Lever`), or ``None``. ``"release_gradients"``: the
            loop frees the gradients after each optimizer step (`release_gradients`): a LightningModule's
            forward then runs without the previous step's gradients. ``"fused_step"``: the loop steps
            each parameter inside backward (`fuse_optimizer_step`): no gradient is whole at once (the
            static estimate leaves them out). ``"offload"``: the loop keeps the optimizer in host memory
            (`offload_optimizer`): its state and the gradients are not the device's (the static estimate
            still counts the state: safe side).
        step: the step as one value (`Step`: its precision, accumulation and lever; with ``batch``, its
            checkpointing too), instead of ``precision`` to ``lever``; giving both is a `TypeError`.
            One device: a step with a `Sharding` is a `ValueError`.

    Returns:
        An `OptimizerChoice`: the name chosen, the optimizers, the estimated breakdown and every estimate
        tried.

    Raises:
        ValueError: no candidate fits, with the numbers and what else could make the step fit; or
            ``step`` is sharded.

    Example::

        choice = fit_optimizer(model, optimizer, "6GiB", batch=(x, y), loss_fn=F.cross_entropy)
        optimizer = choice.optimizer
        choice.rebind(scheduler)
        print(choice.summary())
    """
    step, _ = Step.split(
        dict(
            step=step,
            precision=precision,
            accumulating=accumulating,
            lever=lever,
        )
    )
    if step.sharding is not None:
        raise ValueError(
            f"fit_optimizer plans one device; step= is sharded ({step.sharding.describe()} over "
            f"{step.sharding.world_size} ranks): plan a sharded run with plan_fit, or pass "
            "step.but(sharding=None) to fit one device's step"
        )
    budget = parse_budget(budget)
    given = [optimizer] if isinstance(optimizer, Optimizer) else list(optimizer)
    if step_peak is not None:
        estimate, method = _given(step_peak), "given"
    elif batch is not None and len(given) == 1 and not _manual(model):
        estimate = simulated_estimator(model, batch, step, loss_fn=loss_fn, device=device)
        method = "simulated"
    else:
        gradients = not (step.fused_step or step.offload)
        estimate, method = static_estimator(model, device=device, gradients=gradients), "static"
    names = compensated_candidates(optimizers, given, step.precision)
    return choose_optimizer(
        given, budget, estimate, candidates=names, allow_unknown=allow_unknown, method=method
    )


def _manual(model: nn.Module) -> bool:
    return getattr(model, "automatic_optimization", True) is False


def _given(step_peak: Callable[[Sequence[Optimizer]], int | MemoryBreakdown]) -> Estimator:
    def estimate(optimizers: Sequence[Optimizer]) -> MemoryBreakdown:
        value = step_peak(optimizers)
        if isinstance(value, MemoryBreakdown):
            return value
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise TypeError(f"step_peak must return bytes as an int or a MemoryBreakdown, got {value!r}")
        return MemoryBreakdown(temporary=value)

    return estimate
