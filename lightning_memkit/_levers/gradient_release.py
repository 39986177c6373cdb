"""Gradients freed as soon as the optimizer has used them.

Lightning's automatic optimization runs ``training_step``, then ``zero_grad``, then ``backward``, then
``optimizer.step``: the gradients of step *n* stay allocated through the forward of step *n + 1*, until
its ``zero_grad``. Where a step peaks in its forward (the usual case: every activation is live at the
loss), that peak carries one copy of the gradients that nothing reads. Freeing them right after
``optimizer.step()`` removes those bytes from the peak and changes nothing else: ``zero_grad`` would
have dropped them before the next backward anyway (``set_to_none=True``, Lightning's default), and a
backward into no gradient creates it with the same values.

An optimizer that does not step (gradient accumulation's earlier micro-batches, a step skipped by the
AMP grad scaler for inf/NaN) calls no hook, so gradients still accumulate.
"""

from __future__ import annotations

from typing import Any

from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

__all__ = ["release_gradients"]


def release_gradients(optimizer: Optimizer) -> RemovableHandle:
    """Free the gradients of ``optimizer``'s parameters after each of its steps; ``.remove()`` undoes it.

    A step post-hook (`torch.optim.Optimizer.register_step_post_hook`) calls the optimizer's own
    ``zero_grad(set_to_none=True)``, which Lightning would call one step later.
    Works for any optimizer built on ``torch.optim.Optimizer`` (bitsandbytes' and torchao's included).
    Code that reads ``p.grad`` after the step (say, in ``on_train_batch_end``) then finds ``None``: read
    it in ``on_before_optimizer_step`` instead, where gradient norms are logged and clipped.

    Example::

        handle = release_gradients(optimizer)
        for x, y in loader:
            loss_fn(model(x), y).backward()  # no gradients from the last step live through this forward
            optimizer.step()  # frees them
        handle.remove()
    """
    if not isinstance(optimizer, Optimizer):
        raise TypeError(
            f"release_gradients takes a torch.optim.Optimizer (the one whose steps free the gradients); got "
            f"{type(optimizer).__name__}"
        )
    return optimizer.register_step_post_hook(_free_gradients)


def _free_gradients(optimizer: Optimizer, args: Any, kwargs: Any) -> None:
    optimizer.zero_grad(set_to_none=True)
