"""The optimizers of a simulated step, built over the fake parameters.

An optimizer arrives as a catalogue name, a factory, a LightningModule's ``configure_optimizers`` or an
optimizer over the real parameters (`OptimizerLike`); `optimizers_of` builds the same over the fakes,
`use_device_defaults` picks the kernels torch.optim would pick on the target device, and `offloaded`
keeps them in host memory as `offload_optimizer` does.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import optimi
import torch
from torch import Tensor, nn

from lightning_memkit._budget import valid_name
from lightning_memkit._estimating.lightning_step import TrainingStep, optimizers_from
from lightning_memkit._estimating.optimizer_state import OPTIMIZERS
from lightning_memkit._levers.offload import offload_optimizer
from lightning_memkit._optimizers.swap import load_bitsandbytes

__all__ = [
    "OptimizerLike",
    "offloaded",
    "optimizers_of",
    "use_device_defaults",
]


def _named_optimizer(name: str) -> Callable[[Iterable[Tensor]], torch.optim.Optimizer]:
    """The optimizer class an `OPTIMIZERS` name stands for, with its defaults (SGD: lr=1e-3)."""
    name = valid_name("optimizer", name, OPTIMIZERS)
    if name == "adamw":
        return torch.optim.AdamW
    if name == "adafactor":
        return torch.optim.Adafactor
    if name == "sgd":
        return functools.partial(torch.optim.SGD, lr=1e-3)
    if name == "sgd_momentum":
        return functools.partial(torch.optim.SGD, lr=1e-3, momentum=0.9)
    if name == "adamw_kahan":
        return functools.partial(optimi.AdamW, lr=1e-3, kahan_sum=True)
    if name == "sgd_kahan":
        return functools.partial(optimi.SGD, lr=1e-3, kahan_sum=True)
    bnb = load_bitsandbytes()
    if bnb is None:
        raise ValueError(
            f"optimizer {name!r} needs bitsandbytes, which is not installed or fails to load here"
        )

    return {
        "adamw8bit": bnb.optim.AdamW8bit,
        "paged_adamw8bit": bnb.optim.PagedAdamW8bit,
        "lion": bnb.optim.Lion,
        "lion8bit": bnb.optim.Lion8bit,
    }[name]


OptimizerLike = str | torch.optim.Optimizer | Callable[[Iterable[Tensor]], torch.optim.Optimizer]


def _rebuild(
    optimizer: torch.optim.Optimizer, real: Sequence[Tensor], fake: Sequence[Tensor]
) -> torch.optim.Optimizer:
    """The same optimizer class and hyperparameters over the ``fake`` twins of the ``real`` parameters.

    ``optimizer`` was built over the user's real parameters; it is read, never stepped.
    """
    fake_of = {id(r): f for r, f in zip(real, fake, strict=True)}
    groups = []
    for group in optimizer.param_groups:
        missing = [p for p in group["params"] if id(p) not in fake_of]
        if missing:
            raise ValueError(
                f"The optimizer holds {len(missing)} tensor(s) that are not parameters of the model; "
                "pass an optimizer built over model.parameters(), or a factory such as "
                "functools.partial(torch.optim.AdamW, lr=1e-3)."
            )
        # torch-optimi keeps its run state in the group ("setup", a "step" tensor): the twin starts afresh.
        kept = {k: v for k, v in group.items() if k not in _GROUP_RUN_STATE}
        groups.append({**kept, "params": [fake_of[id(p)] for p in group["params"]]})
    try:
        return type(optimizer)(groups, **optimizer.defaults)
    except TypeError:  # a constructor whose keywords are not its defaults' keys: the groups carry them,
        # and only the keywords it takes are passed (torch-optimi's lr is required; its beta1 is not one)
        accepted = inspect.signature(type(optimizer)).parameters
        return type(optimizer)(groups, **{k: v for k, v in optimizer.defaults.items() if k in accepted})


#: Keys of a param group that are an optimizer's running state, not its hyperparameters (torch-optimi's).
_GROUP_RUN_STATE = ("setup", "step")


def use_device_defaults(optimizers: Sequence[torch.optim.Optimizer], device: torch.device) -> None:
    """Pick the kernels torch.optim would pick for real tensors on ``device`` (fakes confuse its check).

    On CUDA torch defaults to the foreach kernels, whose ``step()`` allocates temporaries as large as
    all parameters at once; on CPU to the per-tensor loop.
    """
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            if (
                group.get("foreach", False) is None
                and not group.get("fused")
                and not group.get("differentiable")
            ):
                group["foreach"] = device.type == "cuda"


def optimizers_of(
    stepped: nn.Module, optimizer: OptimizerLike | None, real_params: list[nn.Parameter]
) -> list[torch.optim.Optimizer]:
    """The optimizers over ``stepped``'s (fake) parameters: its ``configure_optimizers``' (``None``), a
    catalogue name's, a given optimizer's rebuilt over them (``real_params``: the parameters it holds, in
    ``stepped``'s order), or a factory's."""
    if optimizer is None:
        return optimizers_from(stepped.configure_optimizers())
    if isinstance(optimizer, str):
        return [_named_optimizer(optimizer)(p for p in stepped.parameters() if p.requires_grad)]
    if isinstance(optimizer, torch.optim.Optimizer):
        return [_rebuild(optimizer, real_params, list(stepped.parameters()))]
    return [optimizer(p for p in stepped.parameters() if p.requires_grad)]


def offloaded(
    stack: contextlib.ExitStack,
    training: TrainingStep,
    optimizers: list[torch.optim.Optimizer],
    target: torch.device,
    at_backward: bool,
) -> None:
    """``training``'s ``optimizers`` kept in host memory, as `offload_optimizer` keeps them: the host's
    memory is not the device's, so their fakes are on the meta device, uncounted (on the CPU, the CPU's).
    ``at_backward``: they move at the first backward, as OptimizerOffload does on a LightningModule's first
    step; otherwise at once."""
    host = "cpu" if target.type == "cpu" else "meta"
    install = functools.partial(_entered, stack, offload_optimizer, optimizers, host=host)
    if at_backward:
        training.offload_at_backward = install
    else:
        training.offload = install()


def _entered(stack: contextlib.ExitStack, make: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``make(*args, **kwargs)`` entered on ``stack``: undone when the stack closes."""
    return stack.enter_context(make(*args, **kwargs))
