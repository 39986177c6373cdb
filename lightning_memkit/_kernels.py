"""Memory that CPU kernels allocate where no dispatcher sees it, measured once per op and shape.

oneDNN (mkldnn) kernels, which run CPU convolutions, copy their input and weight into blocked layouts
and keep a scratchpad, straight from the CPU allocator: no aten op is called, so neither a
TorchDispatchMode (`_measure`) nor fake tensors (`_simulate`) can see it, yet the allocator counts it
(a Conv2d step reads 28 % low without it). For these ops the highest total a call allocates is asked of
a helper process (`_kernel_worker`), which runs the op once on random data of the same shapes, strides
and dtypes under torch.profiler's memory timeline: a separate process, because the profiler allows one
session per process and that one belongs to the user. The answer depends only on the op and its
argument specs (and the thread count), so it is cached for the life of the process; the worker starts
on the first question (about two seconds) and only for runs that use these ops on the CPU.

The trackers then count, for such an op, ``live before the op + its highest allocation`` as a candidate
peak, the excess over what they see landing in ``temporary``. If the worker cannot start or answer, one
warning says so and nothing is added.
"""

from __future__ import annotations

import atexit
import logging
import os
import select
import subprocess
import sys
import threading
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_memkit._checkpointing import _hashable
from lightning_memkit._kernel_worker import _read, write

log = logging.getLogger(__name__)

_aten = torch.ops.aten


def _ops(*names: str) -> frozenset:
    return frozenset(getattr(_aten, n).default for n in names if hasattr(getattr(_aten, n, None), "default"))


#: Ops whose CPU kernels allocate outside the dispatcher: oneDNN convolutions (reorders, scratchpad) and
#: the flash attention kernels (per-thread accumulators), in every dtype ...
OPAQUE = _ops(
    "convolution",
    "convolution_backward",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention_for_cpu_backward",
)
#: ... and matmuls in 16-bit dtypes, which oneDNN computes through fp32 copies of their operands.
OPAQUE_16BIT = _ops("mm", "addmm", "bmm", "baddbmm", "_addmm_activation")
_16BIT = (torch.bfloat16, torch.float16)
_TIMEOUT_S = 60.0  # the first answer includes the worker's start (importing torch)


def _spec(x: Any) -> Any:
    if isinstance(x, Tensor):
        return ("tensor", tuple(x.shape), tuple(x.stride()), x.dtype)
    if isinstance(x, (list, tuple)):
        return type(x)(_spec(i) for i in x)
    if isinstance(x, dict):
        return {k: _spec(v) for k, v in x.items()}
    if isinstance(x, torch.device):
        return x
    return x


class _Worker:
    """One helper process, started on demand; every failure leaves it off for the rest of the process."""

    def __init__(self) -> None:
        self.process: subprocess.Popen | None = None
        self.failed = False
        self.lock = threading.Lock()
        self.cache: dict[Any, int | None] = {}

    def ask(self, func: Any, args: tuple, kwargs: dict) -> int | None:
        spec_args, spec_kwargs = _spec(args), _spec(kwargs)
        threads = torch.get_num_threads()
        key = (str(func), _hashable(spec_args), _hashable(spec_kwargs), threads)
        with self.lock:
            if key in self.cache:
                return self.cache[key]
            if self.failed:
                return None
            try:
                answer = self._request((str(func), spec_args, spec_kwargs, threads))
            except Exception as e:  # a broken helper must never break the step it measures
                self.failed = True
                self.stop()
                warnings.warn(
                    f"Could not measure what CPU kernels allocate outside the dispatcher ({e}); {func} and "
                    "the like are counted without their internal buffers, so CPU peaks may read low.",
                    stacklevel=4,
                )
                return None
            self.cache[key] = answer
            return answer

    def _request(self, request: tuple) -> int | None:
        if self.process is None:
            env = {**os.environ, "PYTHONWARNINGS": "ignore"}
            self.process = subprocess.Popen(  # the file itself: the package's imports are not needed there
                [sys.executable, str(Path(__file__).with_name("_kernel_worker.py"))],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
            )  # fmt: skip
            atexit.register(self.stop)
        assert self.process.stdin is not None and self.process.stdout is not None
        write(self.process.stdin, request)
        ready, _, _ = select.select([self.process.stdout], [], [], _TIMEOUT_S)
        if not ready:
            raise TimeoutError(f"the helper process did not answer in {_TIMEOUT_S:.0f} s")
        answer = _read(self.process.stdout)
        if answer is None and self.process.poll() is not None:
            raise RuntimeError(f"the helper process exited with code {self.process.returncode}")
        return answer

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            process.kill()
            process.wait()


_WORKER = _Worker()


def hides_memory(func: Any, args: tuple) -> bool:
    """Whether ``func``'s CPU kernel allocates outside the dispatcher on arguments like ``args``."""
    return func in OPAQUE or (
        func in OPAQUE_16BIT and any(isinstance(a, Tensor) and a.dtype in _16BIT for a in args)
    )


def kernel_peak(func: Any, args: tuple, kwargs: dict) -> int | None:
    """The highest total the CPU kernel of ``func`` allocates on arguments like these (outputs included,
    inputs not), or ``None`` if it could not be measured."""
    return _WORKER.ask(func, args, kwargs)
