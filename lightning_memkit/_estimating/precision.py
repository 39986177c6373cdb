"""The Lightning precisions as a simulated step runs them: the weights' dtype and autocast's.

`PRECISION_DTYPES` maps each precision string to the dtype the parameters are converted to and the one
autocast computes in, as Lightning's precision plugins do; `forward_fn` is the step's forward to the loss
inside that plugin's context. Both the simulated step (`_estimating.fake_step`) and the real forward that
records a step's routing (`_estimating.routing`) run through it, so the two see the same precision.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from lightning_memkit._estimating.lightning_step import loss_of
from lightning_memkit._vocabulary import PRECISIONS

__all__ = [
    "PRECISION_DTYPES",
    "converted",
    "forward_fn",
    "sixteen_bit_weights",
    "step_dtypes",
]


#: Lightning precision string -> (dtype the parameters are converted to, dtype autocast computes in).
#: ``None`` means "leave as it is" / "no autocast".
PRECISION_DTYPES: dict[str, tuple[torch.dtype | None, torch.dtype | None]] = {
    "64-true": (torch.float64, None),
    "32-true": (None, None),
    "16-mixed": (None, torch.float16),
    "bf16-mixed": (None, torch.bfloat16),
    "16-true": (torch.float16, None),
    "bf16-true": (torch.bfloat16, None),
}
assert tuple(PRECISION_DTYPES) == PRECISIONS


def sixteen_bit_weights(precision: str) -> bool:
    """Whether ``precision`` converts the weights to 16 bits (``"bf16-true"``, ``"16-true"``), where an
    update below the weight's resolution rounds away."""
    return PRECISION_DTYPES.get(precision, (None, None))[0] in (torch.bfloat16, torch.float16)


def step_dtypes(precision: str, device: torch.device) -> tuple[torch.dtype | None, torch.dtype | None]:
    """The weights' and autocast's dtypes of ``precision`` on ``device`` (`PRECISION_DTYPES`), fp16 AMP
    becoming bf16 on the CPU, as Lightning does: fp16 autocast is not supported there."""
    param_dtype, autocast_dtype = PRECISION_DTYPES[precision]
    if autocast_dtype == torch.float16 and device.type == "cpu":
        autocast_dtype = torch.bfloat16
    return param_dtype, autocast_dtype


def converted(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t`` in ``dtype`` if it is floating point (Lightning's 16-bit precisions' ``convert_input``, and
    what ``module.to(dtype)`` makes of a parameter or buffer), detached."""
    return t.detach().to(dtype) if t.is_floating_point() else t


def forward_fn(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[[Any, Any], Tensor] | None,
    lightning: bool,
    param_dtype: torch.dtype | None,
    autocast_dtype: torch.dtype | None,
    autocast_device: str,
) -> Callable[[], Tensor]:
    """The forward pass to the loss, inside the precision plugin's context (its autocast for the ops on
    ``autocast_device``: the simulation's, or a real forward's weights')."""

    def context() -> contextlib.AbstractContextManager:
        if autocast_dtype is not None:
            return torch.autocast(autocast_device, dtype=autocast_dtype, cache_enabled=False)
        if param_dtype is not None:
            return _default_dtype(param_dtype)
        return contextlib.nullcontext()

    def forward() -> Tensor:
        with context():
            if lightning:
                return loss_of(model.training_step(batch, 0))
            assert loss_fn is not None
            inputs, target = batch
            return loss_fn(model(inputs), target)

    return forward


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
