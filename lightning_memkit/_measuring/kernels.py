"""Memory that CPU kernels allocate where no dispatcher sees it, measured once per op and shape.

oneDNN (mkldnn) kernels, which run CPU convolutions, copy their input and weight into blocked layouts
and keep a scratchpad, straight from the CPU allocator: no aten op is called, so neither a
TorchDispatchMode (`_measuring.tracker`) nor fake tensors (`_estimating.simulate`) can see it, yet the
allocator counts it
(a Conv2d step reads 28 % low without it). For these ops the highest total a call allocates is asked of
a helper process (`_measuring.kernel_worker`), which runs the op once on random data of the same shapes,
strides
and dtypes under torch.profiler's memory timeline: a separate process, because the profiler allows one
session per process and that one belongs to the user. The answer depends only on the op, its argument
specs and the settings that select a kernel (threads, oneDNN on or off, fp32 matmul precision,
deterministic algorithms), so it is cached for the life of the process; the worker starts on the first
question (2-4 s: it imports torch and runs its first profile), or in the background when `MemoryMonitor`
sets up a CPU run (`start_helper`), so that the first measured step need not wait for it. A forked
child starts a helper of its own (the parent's pipes are the parent's); a helper that dies is started
again once.

The trackers then count, for such an op, ``live before the op + its highest allocation`` as a candidate
peak, the excess over what they see landing in ``temporary``. If the worker still cannot answer, one
warning says so and nothing is added.
"""

from __future__ import annotations

import atexit
import contextlib
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

from lightning_memkit._measuring.kernel_worker import read_message, write

log = logging.getLogger(__name__)

_aten = torch.ops.aten


def _ops(*names: str, overload: str = "default") -> frozenset:
    """The ``overload`` of each aten op named, those this torch has."""
    return frozenset(
        getattr(getattr(_aten, n), overload) for n in names if hasattr(getattr(_aten, n, None), overload)
    )


#: Ops whose CPU kernels allocate outside the dispatcher, in every dtype and layout: oneDNN convolutions
#: (reorders, scratchpad), the flash attention kernels (per-thread accumulators), oneDNN's LSTM/GRU layers,
#: and the embedding's backward (a sorted copy of the indices) ...
OPAQUE = _ops(
    "convolution",
    "convolution_backward",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention_for_cpu_backward",
    "mkldnn_rnn_layer",
    "mkldnn_rnn_layer_backward",
    "embedding_dense_backward",
)
#: ... and matmuls, which copy an operand BLAS cannot read as it is (a zero-stride gradient from
#: ``loss = out.sum()``, a strided slice), and in 16-bit dtypes compute through fp32 copies; their ``out=``
#: forms too, which the code torch.compile generates calls (``extern_kernels.mm(a, b, out=buf)``): a
#: compiled bf16 LLaMA's step read 3.7 % low without them.
MATMULS = _ops("mm", "addmm", "bmm", "baddbmm", "_addmm_activation") | _ops(
    "mm", "addmm", "bmm", "baddbmm", "_addmm_activation", overload="out"
)
#: Other libraries' custom ops whose CPU kernel is a Python function: the aten ops it calls run below the
#: dispatch mode that sees the custom op, and fake tensors run only the op's fake kernel, which allocates
#: nothing. bitsandbytes' optimizer updates (AdamW8bit, PagedAdamW8bit, Lion8bit and the like, and its
#: 32-bit Lion, AdamW, ...) dequantize the 8-bit state into fp32 working copies and work on fp32 copies of
#: the gradient: an AdamW8bit step read half its peak without them. By schema name, so that the library
#: need not be imported to ask; the helper imports it (the op's namespace) to run the op.
FOREIGN = frozenset({"bitsandbytes::optimizer_update_32bit", "bitsandbytes::optimizer_update_8bit_blockwise"})
_foreign: dict[Any, bool] = {}  # op -> whether it is in FOREIGN: its schema, once per op
_16BIT = (torch.bfloat16, torch.float16)
_TIMEOUT_S = 60.0  # the first answer includes the worker's start (importing torch)
_MAX_CACHED = 16_384  # answers kept (shapes seen); variable shapes beyond it are asked again


def _blas_ready(t: Tensor) -> bool:
    """Whether a matmul can read ``t`` without a copy: its last two dims dense one way or the other."""
    if t.dim() < 2:
        return True
    (m, n), (a, b) = t.shape[-2:], t.stride()[-2:]
    row_major = (b == 1 or n == 1) and (a >= n or m == 1)
    column_major = (a == 1 or m == 1) and (b >= m or n == 1)
    return row_major or column_major


def _settings() -> tuple:
    """What selects a CPU kernel besides the op and its arguments: the helper runs under the same."""
    return (
        torch.get_num_threads(),
        torch.backends.mkldnn.enabled,
        torch.get_float32_matmul_precision(),
        torch.are_deterministic_algorithms_enabled(),
    )


def hashable(x: Any) -> Any:
    """``x`` with its lists and dicts turned into tuples, to key a cache with."""
    if isinstance(x, (list, tuple)):
        return tuple(hashable(i) for i in x)
    if isinstance(x, dict):
        return tuple(sorted((k, hashable(v)) for k, v in x.items()))
    return x


def _spec(x: Any) -> Any:
    if isinstance(x, Tensor):
        return ("tensor", tuple(x.shape), tuple(x.stride()), x.dtype)
    if isinstance(x, (list, tuple)):
        return type(x)(_spec(i) for i in x)
    if isinstance(x, dict):
        return {k: _spec(v) for k, v in x.items()}
    return x


class _Worker:
    """One helper process, started on demand and again after a fork or a crash (once); if it cannot
    answer after that, one warning, and nothing more is asked for the rest of the process."""

    def __init__(self) -> None:
        self.process: subprocess.Popen | None = None
        self.pid = os.getpid()  # the process the helper belongs to
        self.failed = False
        self.restarted = False
        self.lock = threading.Lock()
        self.cache: dict[Any, Any] = {}
        #: answers to warm-up questions (`start`) not read yet: the pipe answers in order
        self.unread = 0

    def start(self) -> bool:
        """Start the helper now, without waiting for it: it imports torch and runs its first profile
        (together 2-4 s) while the caller goes on, so the first question finds it ready. Returns whether a
        process was started (not when one runs already, or the helper failed before)."""
        if self.pid != os.getpid():
            self._forked()
        with self.lock:
            if self.process is not None or self.failed:
                return False
            try:
                self._spawn()
                assert self.process is not None and self.process.stdin is not None
                write(self.process.stdin, _warm_up())
            except Exception:  # the first real question tries again, and warns if it cannot
                self.stop()
                return False
            self.unread += 1
            return True

    def ready(self) -> None:
        """Wait until a helper `start` began has answered its warm-up question; a helper that cannot is
        stopped, and the first real question starts it again (and warns if that fails too)."""
        if self.pid != os.getpid():
            self._forked()
        with self.lock:
            try:
                while self.unread:
                    self._answer()
                    self.unread -= 1
            except Exception:
                self.stop()

    def ask(self, func: Any, args: tuple, kwargs: dict, question: str = "peak") -> Any:
        if self.pid != os.getpid():
            self._forked()
        spec_args, spec_kwargs = _spec(args), _spec(kwargs)
        settings = _settings()
        key = (question, str(func), hashable(spec_args), hashable(spec_kwargs), settings)
        with self.lock:
            if key in self.cache:
                return self.cache[key]
            if self.failed:
                return None
            request = (question, str(func), spec_args, spec_kwargs, settings)
            try:
                answer = self._request(request)
            except Exception as first:  # a broken helper must never break the step it measures
                self.stop()
                try:
                    if self.restarted:
                        raise first
                    self.restarted = True
                    answer = self._request(request)
                except Exception as e:
                    self.failed = True
                    self.stop()
                    warnings.warn(
                        f"Could not measure what CPU kernels allocate outside the dispatcher ({e}); {func} "
                        "and the like are counted without their internal buffers, so CPU peaks may read low.",
                        stacklevel=4,
                    )
                    return None
            if len(self.cache) >= _MAX_CACHED:
                self.cache.clear()
            self.cache[key] = answer
            return answer

    def _forked(self) -> None:
        """In a forked child: the parent's helper and lock are the parent's; the answers still hold."""
        self.pid = os.getpid()
        self.process = None
        self.unread = 0
        self.lock = threading.Lock()

    def _spawn(self) -> None:
        env = {**os.environ, "PYTHONWARNINGS": "ignore"}
        self.process = subprocess.Popen(  # the file itself: the package's imports are not needed there
            [sys.executable, str(Path(__file__).with_name("kernel_worker.py"))],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
        )  # fmt: skip

    def _request(self, request: tuple) -> Any:
        if self.process is None:
            self._spawn()
        assert self.process is not None and self.process.stdin is not None
        write(self.process.stdin, request)
        while self.unread:  # a warm-up's answer comes first
            self._answer()
            self.unread -= 1
        return self._answer()

    def _answer(self) -> Any:
        assert self.process is not None and self.process.stdout is not None
        ready, _, _ = select.select([self.process.stdout], [], [], _TIMEOUT_S)
        if not ready:
            raise TimeoutError(f"the helper process did not answer in {_TIMEOUT_S:.0f} s")
        try:
            return read_message(self.process.stdout)
        except EOFError:
            raise RuntimeError(f"the helper process exited with code {self.process.wait()}") from None

    def stop(self) -> None:
        process, self.process, self.unread = self.process, None, 0
        if process is None or self.pid != os.getpid():
            return
        if process.poll() is None:
            process.kill()
        process.wait()
        for pipe in (process.stdin, process.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):  # a dead helper's unread request: a broken pipe
                    pipe.close()


def _warm_up() -> tuple:
    """A question whose answer no one needs: it makes the helper import torch and run its first profile."""
    square = ("tensor", (2, 2), (2, 1), torch.float32)
    return ("peak", "aten.mm.default", (square, square), {}, _settings())


_WORKER = _Worker()
atexit.register(_WORKER.stop)


def start_helper() -> bool:
    """Start the helper process in the background (see `_Worker.start`); ``True`` if this started it."""
    return _WORKER.start()


def helper_ready() -> None:
    """Wait for the helper `start_helper` started to be ready to answer (see `_Worker.ready`)."""
    _WORKER.ready()


def _is_foreign(func: Any) -> bool:
    known = _foreign.get(func)
    if known is None:
        schema = getattr(func, "_schema", None)
        known = _foreign[func] = schema is not None and schema.name in FOREIGN
    return known


def _coarse(x: Any) -> Any:
    """``x`` with its numbers reduced to what can change a `FOREIGN` op's memory, the branches it takes
    (zero or not, the sign, a step of 1 or later): a learning rate that changes every step, or the step
    count, would otherwise be a new question for the helper at every step."""
    if isinstance(x, bool) or not isinstance(x, (int, float, list, tuple, dict)):
        return x
    if isinstance(x, (list, tuple)):
        return type(x)(_coarse(i) for i in x)
    if isinstance(x, dict):
        return {k: _coarse(v) for k, v in x.items()}
    if x == 0 or x != x:  # zero, or NaN
        return x
    sign = 1 if x > 0 else -1
    return sign * min(abs(x), 2) if isinstance(x, int) else sign * 0.5


def hides_memory(func: Any, args: tuple) -> bool:
    """Whether ``func``'s CPU kernel allocates outside the dispatcher on arguments like ``args``, and the
    helper can measure it. Not on a sparse operand: the helper rebuilds arguments from shapes and strides,
    which a sparse tensor does not have (what its kernel allocates inside is not counted)."""
    if func in OPAQUE:
        return not _any_sparse(args)
    if func not in MATMULS:
        return _is_foreign(func) and not _any_sparse(args)
    tensors = [a for a in args if isinstance(a, Tensor)]
    return not _any_sparse(tensors) and any(t.dtype in _16BIT or not _blas_ready(t) for t in tensors)


def _any_sparse(x: Any) -> bool:
    if isinstance(x, Tensor):
        return x.layout != torch.strided
    if isinstance(x, (list, tuple)):
        return any(_any_sparse(i) for i in x)
    return False


def kernel_peak(func: Any, args: tuple, kwargs: dict) -> int | None:
    """The highest total the CPU kernel of ``func`` allocates on arguments like these (outputs included,
    inputs not), or ``None`` if it could not be measured."""
    if _is_foreign(func):
        args, kwargs = _coarse(args), _coarse(kwargs)
    return _WORKER.ask(func, args, kwargs)


#: Ops whose meta kernels give an output a placeholder size, by output index: oneDNN's LSTM/GRU layer
#: returns its workspace (what its backward reads; kept from forward to backward) empty on fake tensors,
#: where the real kernel's holds the gates of every time step.
PLACEHOLDER_OUTPUTS = {op: (3,) for op in _ops("mkldnn_rnn_layer")}


def real_outputs(func: Any, args: tuple, kwargs: dict, out: Any) -> Any:
    """``out`` of a simulated `PLACEHOLDER_OUTPUTS` op with those outputs at the size the CPU kernel
    gives them (asked of the helper; as they were if it cannot answer): new fake byte tensors, of which
    only the size matters (the backward's meta kernel does not read them)."""
    sizes = _WORKER.ask(func, args, kwargs, question="outputs")
    if sizes is None:
        return out
    out = list(out)
    for i in PLACEHOLDER_OUTPUTS[func]:
        if sizes[i] is not None and sizes[i] > out[i].untyped_storage().nbytes():
            out[i] = out[i].new_empty(sizes[i], dtype=torch.uint8)
    return tuple(out)
