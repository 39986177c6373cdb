"""One training step run on fake tensors: `simulate_step`, `estimate_memory`'s step.

It fakes the model and the batch (`_estimating.fake_model`), builds the optimizers over the fakes
(`_estimating.fake_optimizers`), applies the step as configured (precision, checkpointing, compile,
sharding, the lever on the optimizer step) and runs it under the tracker (`_estimating.fake_tracker`),
undoing every change on the way out. A step whose op is sized by the weights' values is simulated again
with the routing a real forward of the batch records (`_estimating.routing`). The design as a whole:
`_estimating.simulate`.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensorMode

from lightning_memkit._budget import valid_name
from lightning_memkit._checkpointing.policies import apply_checkpointing
from lightning_memkit._estimating import repeated
from lightning_memkit._estimating import routing as _routing
from lightning_memkit._estimating import shadow as _shadow
from lightning_memkit._estimating.compiled import compiled_as_inductor
from lightning_memkit._estimating.fake_model import fake_batch, fake_parameters, sharded_copy, twinned
from lightning_memkit._estimating.fake_optimizers import (
    OptimizerLike,
    offloaded,
    optimizers_of,
    use_device_defaults,
)
from lightning_memkit._estimating.fake_tracker import (
    NOT_RECORDED,
    SIM_DEVICE,
    Placeholders,
    _SimTracker,
    track,
)
from lightning_memkit._estimating.isolate import isolated
from lightning_memkit._estimating.lightning_step import TrainingStep, is_lightning, lightning_stand_ins
from lightning_memkit._estimating.precision import converted, forward_fn, step_dtypes
from lightning_memkit._estimating.trace import Tracer
from lightning_memkit._step import Step
from lightning_memkit._vocabulary import DEVICES

__all__ = [
    "simulate_step",
]


def _routes(model: nn.Module, batch: Any, loss_fn: Any, failure: str, precision: str) -> _routing.Routes:
    """The routing of ``batch`` through ``model``'s real weights (`_estimating.routing`): a forward run
    for real on the weights' device, without autograd, leaving no trace (`isolated`), at every call (a
    forward costs far less than the simulation, and the batch's values or the weights may have changed
    since), at the step's ``precision``: under its autocast (on the weights' device), or with a 16-bit copy
    of the weights, and the batch in 16 bits (a router's near-tie goes otherwise there: a run with 16-bit
    weights holds that copy anyway). ``failure``: the first try's refusal, raised again with the
    reason where no real forward can run or the forward fails."""
    params = list(model.parameters())
    device = params[0].device if params else torch.device("cpu")
    if device.type == "meta":
        raise _routing.UnknownShape(
            failure.replace(NOT_RECORDED, "the weights are on the meta device, where no real forward runs")
        )
    lightning = is_lightning(model)
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(isolated(model, "estimate_memory"))
            model.train()  # as a training step runs; `isolated` gives every module its flag back
            if lightning:
                stack.enter_context(lightning_stand_ins(model, device))
            param_dtype, autocast_dtype = step_dtypes(precision, device)
            batch = move_data_to_device(batch, device)
            if param_dtype is not None:  # 16-bit weights: a 16-bit copy of them for this forward, and
                convert = functools.partial(converted, dtype=param_dtype)  # the batch's floats, as Lightning
                stack.enter_context(twinned(model, convert))
                batch = apply_to_collection(batch, Tensor, convert)
            forward = forward_fn(
                model, batch, loss_fn, lightning, param_dtype, autocast_dtype, autocast_device=device.type
            )
            routes = stack.enter_context(_routing.recording(model))
            forward()
    except Exception as error:
        why = f"the real forward of the batch that would show them failed ({type(error).__name__}: {error})"
        raise _routing.UnknownShape(failure.replace(NOT_RECORDED, why)) from error
    return routes


def _restorer(obj: Any) -> Callable[[], None]:
    """Put ``obj``'s attributes back as they are now (containers copied: a fresh tracer's or history's
    are empty); nothing for ``None`` or a flag."""
    if obj is None or isinstance(obj, bool):
        return lambda: None
    saved = {name: copy.copy(value) for name, value in vars(obj).items()}

    def restore() -> None:
        vars(obj).clear()
        vars(obj).update({name: copy.copy(value) for name, value in saved.items()})

    return restore


def simulate_step(
    model: nn.Module,
    batch: Any,
    step: Step,
    *,
    optimizer: OptimizerLike | None = None,
    loss_fn: Callable[[Any, Any], Tensor] | None = None,
    device: str | torch.device = "cuda",
    timeline: bool = False,
    tracer: Tracer | None = None,
    history: bool | repeated.History = False,
    follow_routing: bool = True,
    routes: _routing.Routes | None = None,
) -> _SimTracker:
    """`estimate_memory`'s step, returning its tracker (``tracer``: also what created each storage;
    ``history``: every candidate peak, `_estimating.repeated.History`, or the one given). A step with an op
    sized by values of the weights (a mixture of experts' routing) is simulated again with the sizes a real
    forward of the batch gives (``routes``, `_estimating.routing`), unless ``follow_routing`` is off."""
    if follow_routing and routes is None:
        again = functools.partial(
            simulate_step, model, batch, step, optimizer=optimizer, loss_fn=loss_fn, device=device,
            timeline=timeline, tracer=tracer, history=history,
        )  # fmt: skip
        return _following_routes(again, model, batch, loss_fn, step.precision, tracer, history)
    target = torch.device(device)
    valid_name("device", target.type, DEVICES)
    param_dtype, autocast_dtype = step_dtypes(step.precision, target)
    lightning = is_lightning(model)
    _check_steppable(model, lightning, optimizer, loss_fn)

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with contextlib.ExitStack() as stack:
        stack.enter_context(isolated(model, "estimate_memory"))
        real_params = list(model.parameters())  # references only, to pair them with their twins
        stack.enter_context(fake_parameters(model, mode, param_dtype))
        model.train()  # as a training step runs; `isolated` gives every module its flag back
        stack.enter_context(warnings.catch_warnings())
        warnings.filterwarnings("ignore", message=".*[Pp]aged optimizers are not supported on CPU.*")
        if lightning:
            stack.enter_context(lightning_stand_ins(model, SIM_DEVICE))
        if step.checkpointing is not None and step.checkpointing != "none":
            stack.enter_context(apply_checkpointing(model, step.checkpointing))  # undone on exit
        stack.enter_context(compiled_as_inductor(model, step.compile_budget))
        shadows = _shadow.Shadows()
        faked_batch = fake_batch(batch, mode, param_dtype, shadows)
        stack.enter_context(_shadow.not_tracing(mode))  # transformers: our fakes are not a trace
        stepped = model  # what steps: the model, or its sharded copy
        if step.sharding is not None:
            stepped = sharded_copy(stack, model, mode, step.sharding, tracer)
        # Built outside the fake mode, as the real ones are: bitsandbytes computes its quantization maps
        # from real values when constructed. The parameters they hold are already fake.
        optimizers = optimizers_of(stepped, optimizer, real_params)
        use_device_defaults(optimizers, target)

        forward = forward_fn(
            stepped, faked_batch, loss_fn, lightning, param_dtype, autocast_dtype, SIM_DEVICE.type
        )
        accumulating, first_step = step.accumulating, step.first_step
        training = TrainingStep(
            forward, optimizers, lightning, accumulating, step.release_gradients, step.fused_step
        )
        stack.enter_context(mode)
        if step.offload:
            offloaded(stack, training, optimizers, target, first_step and lightning and not accumulating)
        if not first_step or accumulating:
            with Placeholders():
                training.warm_up(stepped, state=not first_step)
        if routes is not None:
            routes.bind(stepped)
            stack.enter_context(routes.watching())
        tracker = track(training, stepped, target, timeline, shadows, tracer, history, routes)
        if tracer is not None:
            tracer.finish(stepped, training.optimizers, tracker)
    return tracker


def _following_routes(
    again: Callable[..., _SimTracker],
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[[Any, Any], Tensor] | None,
    precision: str,
    tracer: Tracer | None,
    history: bool | repeated.History,
) -> _SimTracker:
    """The step simulated by ``again``: once as its fake weights route it, and where an op's size hangs on
    the weights' values (`_routing.UnknownShape`), again with the routes a real forward of the batch
    records, the ``tracer`` and ``history`` put back as they were given first."""
    fresh = [_restorer(tracer), _restorer(history)]
    try:
        return again(follow_routing=False)
    except _routing.UnknownShape as err:
        recorded = _routes(model, batch, loss_fn, str(err), precision)
    for restore in fresh:  # as they were given: the first try wrote into them
        restore()
    return again(routes=recorded)


def _check_steppable(
    model: nn.Module,
    lightning: bool,
    optimizer: OptimizerLike | None,
    loss_fn: Callable[[Any, Any], Tensor] | None,
) -> None:
    """Refuse a step that cannot be simulated: a LightningModule's manual optimization (it needs a running
    Trainer), or a plain module without the optimizer and loss function that a LightningModule brings."""
    if lightning and not model.automatic_optimization:
        raise NotImplementedError(
            f"{type(model).__name__} uses manual optimization, which needs a running Trainer; estimate a "
            "step of the underlying nn.Module with loss_fn= and optimizer= instead."
        )
    if not lightning and optimizer is None:
        raise TypeError(
            f"A plain {type(model).__name__} needs optimizer= (a name, a factory or an optimizer)."
        )
    if not lightning and loss_fn is None:
        raise TypeError(
            f"A plain {type(model).__name__} needs loss_fn=(output, target) -> loss; a LightningModule "
            "brings its own training_step."
        )
