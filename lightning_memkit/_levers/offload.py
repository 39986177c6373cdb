"""The optimizer in host memory: its state, fp32 master weights and the gradients' accumulation.

ZeRO-Offload's idea on one device. The device keeps only the weights the forward and backward use (in
the run's precision, bf16 with ``"bf16-true"``); everything else of the optimizer lives in host memory:

- each trained parameter ``p`` gets a *master* copy on the host, fp32 where ``p`` is 16-bit (the same
  dtype otherwise), and the user's own optimizer is pointed at the masters: its param groups hold them, so
  its state (AdamW's moments, 8-bit states, step counters) is created and kept on the host;
- a post-accumulate-grad hook copies each gradient to the host as soon as it is complete, adds it to the
  master's gradient (in fp32: gradient accumulation over micro-batches happens there) and frees it on the
  device, so the device never holds more than the gradients of the backward in flight;
- after ``optimizer.step()`` (a step post-hook) the updated masters are copied back into the device's
  weights, rounded to their dtype, and the masters' gradients are freed.

A weight changed in place outside the optimizer (weight clipping, a callback, ``load_state_dict``) is
taken into its master before the next update: its version counter has moved since the master set it.

The optimizer object stays the user's: its learning-rate scheduler, ``param_groups`` and gradient
clipping (which reads the masters' gradients) work as before, and its ``state_dict`` has the same layout
(state by parameter position). The update is computed on fp32 masters, so 16-bit weights lose no small
step (what Kahan summation or stochastic rounding buy elsewhere); with fp32 weights training is the same
as without offloading (bit-identical on the CPU, ``tests/levers/test_offload.py``).

The price is time: every micro-batch sends its gradients to the host, every step sends the weights back,
and the update runs on the host (`transfer_seconds`). Transfers are blocking, through pageable memory;
an update overlapped with the next backward (DeepSpeed's) is not attempted.

Not supported (`OptimizerOffload` refuses them): several processes (DDP reduces the gradients after the
hook has taken them), the fp16 grad scaler, optimizers that need a closure (LBFGS).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle
from torch.utils.weak import WeakIdKeyDictionary

from lightning_memkit._measuring.patches import gradient_consumed

__all__ = ["Offload", "master_dtype", "offload_optimizer", "transfer_seconds"]

#: Host <-> device bytes per second assumed for offline plans (PCIe 4.0 x16, pageable memory).
PCIE_BYTES_PER_S = 12e9
#: Bytes per second the host's optimizer update reads and writes (a few cores, torch's CPU kernels).
HOST_BYTES_PER_S = 8e9


def master_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of a parameter's host master: fp32 for 16-bit weights, the weight's own otherwise."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class Offload:
    """What `offload_optimizer` installed; ``remove()`` (or leaving a ``with`` block) puts the device
    parameters back into the param groups. The state stays on the host, keyed by the device parameters."""

    def __init__(self, optimizers: list[Optimizer], masters: WeakIdKeyDictionary, host: torch.device) -> None:
        self.optimizers = optimizers
        self.masters = masters
        self.host = host
        #: (device parameter, master) of every parameter the optimizers hold, in their order
        self.pairs: list[tuple[Tensor, Tensor]] = []
        self.handles: list[RemovableHandle] = []
        #: id of each master -> its device parameter (made with `pairs`, emptied with it)
        self.by_master: dict[int, Tensor] = {}

    def device_param(self, t: Tensor) -> Tensor:
        """The device parameter whose master ``t`` is (``t`` itself if it is none's)."""
        return self.by_master.get(id(t), t)

    def take_gradients(self) -> None:
        """Move the gradients the device parameters hold to their masters (as the hooks do)."""
        for p, master in self.pairs:
            if p.grad is not None:
                _to_host(p, master)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
        for optimizer in self.optimizers:
            for group in optimizer.param_groups:
                group["params"] = [self.device_param(m) for m in group["params"]]
            for p, master in self.pairs:
                if master in optimizer.state:
                    optimizer.state[p] = optimizer.state.pop(master)
        # Gradients of an accumulation cycle still running (a validation in its middle) go back to the
        # device, where Lightning's loop expects them; after a step there are none.
        for p, master in self.pairs:
            if master.grad is not None:
                p.grad = master.grad.to(p.device, p.dtype)
                master.grad = None
            master._offload_pending = False  # type: ignore[attr-defined]
        self.pairs, self.by_master = [], {}

    def __enter__(self) -> Offload:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def offload_optimizer(
    optimizers: Optimizer | Iterable[Optimizer],
    *,
    masters: WeakIdKeyDictionary | None = None,
    host: str | torch.device = "cpu",
) -> Offload:
    """Keep ``optimizers``' state, fp32 master weights and gradient accumulation in host memory.

    Each optimizer is pointed at host masters of its parameters (its existing state moves to the host),
    each gradient goes to the host as soon as it is complete, and each ``step()`` updates the masters and
    copies them back into the device's weights. ``masters`` (device parameter -> master) keeps the masters
    across installs: pass the same mapping when installing again, or the fp32 masters of 16-bit weights
    are rebuilt from the rounded weights. ``host`` is where the masters live (``"meta"`` in a simulation
    that must not count them).

    Example::

        offloaded = offload_optimizer(optimizer)
        for x, y in loader:
            loss_fn(model(x), y).backward()  # each gradient leaves the device as it completes
            optimizer.step()  # on the host; the device weights are updated after it
            optimizer.zero_grad()
        offloaded.remove()
    """
    optimizers = [optimizers] if isinstance(optimizers, Optimizer) else list(optimizers)
    masters = WeakIdKeyDictionary() if masters is None else masters
    offload = Offload(optimizers, masters, torch.device(host))
    for optimizer in optimizers:
        pairs = [(p, _master(p, masters, offload.host)) for g in optimizer.param_groups for p in g["params"]]
        for group in optimizer.param_groups:
            group["params"] = [masters[p] for p in group["params"]]
        for p, master in pairs:
            state = optimizer.state.pop(p, None)
            if state is not None:
                optimizer.state[master] = {k: _on(v, offload.host) for k, v in state.items()}
        offload.pairs.extend(pairs)
        offload.by_master.update((id(m), p) for p, m in pairs)
        offload.handles.append(
            optimizer.register_step_pre_hook(functools.partial(_follow_weights, pairs=pairs))
        )
        offload.handles.append(optimizer.register_step_post_hook(functools.partial(_copy_back, pairs=pairs)))
    offload.take_gradients()
    offload.handles.extend(
        p.register_post_accumulate_grad_hook(functools.partial(_to_host, master=master))
        for p, master in offload.pairs
        if p.requires_grad
    )
    return offload


def transfer_seconds(param_bytes: int, grad_bytes: int, state_bytes: int) -> tuple[float, float]:
    """Seconds an offloaded step adds, ``(per micro-batch, per global batch)``: each micro-batch's
    gradients to the host and their fp32 sum there; the weights back once, and the host's update
    (masters, gradients and state read and written)."""
    per_micro = grad_bytes / PCIE_BYTES_PER_S + 2 * grad_bytes / HOST_BYTES_PER_S
    per_step = param_bytes / PCIE_BYTES_PER_S + 2 * (state_bytes + 2 * grad_bytes) / HOST_BYTES_PER_S
    return per_micro, per_step


def _master(p: Tensor, masters: WeakIdKeyDictionary, host: torch.device) -> Tensor:
    master = masters.get(p)
    if master is None:
        pinned = p.device.type == "cuda" and host.type == "cpu"
        master = torch.empty(p.shape, dtype=master_dtype(p.dtype), device=host, pin_memory=pinned)
        with torch.no_grad():
            master.copy_(p.detach())  # converted on the host: no device temporary
        master._offload_version = p._version  # type: ignore[attr-defined]
        masters[p] = master
    else:
        _follow(p, master)
    return master


@torch.no_grad()
def _follow(p: Tensor, master: Tensor) -> None:
    """Take into the master what changed the weight since the master last set it (weight clipping, a
    callback, ``load_state_dict``): an in-place change moves the weight's version counter. A 16-bit
    weight that is still its master rounded keeps the master's low bits."""
    if getattr(master, "_offload_version", None) == p._version:
        return
    if master.device.type != "meta":  # a simulation's master has no values to keep
        weight = p.detach().to(master.device)
        if master.dtype == weight.dtype or not torch.equal(master.to(weight.dtype), weight):
            master.copy_(weight)
    master._offload_version = p._version  # type: ignore[attr-defined]


def _follow_weights(
    optimizer: Optimizer, args: Any, kwargs: Any, *, pairs: list[tuple[Tensor, Tensor]]
) -> None:
    for p, master in pairs:
        _follow(p, master)


def _on(value: Any, host: torch.device) -> Any:
    return value.to(host) if isinstance(value, Tensor) and value.device != host else value


@torch.no_grad()
def _to_host(param: Tensor, master: Tensor) -> None:
    gradient_consumed(param)  # a tracker watching the step counts it as a gradient before it goes
    grad = param.grad.to(master.device)  # blocking; on the host already, the same tensor
    grad = grad.to(master.dtype)
    if master.grad is None:
        master.grad = grad
    else:
        master.grad.add_(grad)
    master._offload_pending = True  # type: ignore[attr-defined]  # the next step updates it
    param.grad = None


@torch.no_grad()
def _copy_back(optimizer: Optimizer, args: Any, kwargs: Any, *, pairs: list[tuple[Tensor, Tensor]]) -> None:
    """The updated masters back to the device: those a gradient reached since the last step (the others,
    frozen or reached by none, did not change). Read from a mark `_to_host` leaves, not from the master's
    gradient: a post-hook that ran first may have freed it (`release_gradients`)."""
    for p, master in pairs:
        if master.grad is None and not getattr(master, "_offload_pending", False):
            continue
        p.copy_(master if master.dtype == p.dtype else master.to(p.dtype))  # rounded on the host
        master._offload_version = p._version  # type: ignore[attr-defined]
        master._offload_pending = False  # type: ignore[attr-defined]
        master.grad = None
