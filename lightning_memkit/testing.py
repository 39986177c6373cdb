"""The allocator's own record of a step's peak: the truth our measurements are checked against.

Used by the tests and `benchmarks/`, never by the callbacks: torch.profiler allows one session at a
time, and a monitor built on it would break users' own profiling.

* CUDA: ``torch.cuda.max_memory_allocated`` with the peak reset when the step begins.
* CPU: the allocations in torch.profiler's memory timeline (``profile_memory=True``). It replays every
  allocation and free the CPU allocator reported; tensors allocated before the profile began count
  from its start once the step touches or frees them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile
from torch.profiler._memory_profiler import Action, MemoryProfile

__all__ = ["allocator_peak", "cpu_profiler", "profile_peak"]


def cpu_profiler() -> profile:
    """A profiler configured to record the CPU allocator (start/stop it yourself, or use ``with``)."""
    return profile(
        activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True
    )


def profile_peak(prof: profile, device: str | torch.device = "cpu") -> int:
    """Highest live bytes on ``device`` in a finished profile's memory timeline."""
    device = torch.device(device)
    timeline = MemoryProfile(prof.profiler.kineto_results).timeline
    live = peak = 0
    for _, action, (key, _), nbytes in timeline:  # sorted by time; creations before frees at a tie
        if key.device != device:
            continue
        if action in (Action.PREEXISTING, Action.CREATE):
            live += nbytes
        elif action == Action.DESTROY:
            live -= nbytes
        peak = max(peak, live)
    return peak


def allocator_peak(step: Callable[[], object], device: str | torch.device = "cpu") -> int:
    """Run ``step()`` once and return the allocator's peak for it, in bytes."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device)
    with cpu_profiler() as prof:
        step()
    return profile_peak(prof, device)
