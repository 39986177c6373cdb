"""The process `_measuring.kernels` asks what a CPU kernel allocates: ``python
lightning_memkit/_measuring/kernel_worker.py``.

Reads requests from stdin and answers on stdout, each a length-prefixed pickle. A request is
``(question, op name, argument specs, keyword specs, settings)`` (threads, oneDNN on or off, fp32 matmul
precision, deterministic algorithms: what selects a kernel besides its arguments). To ``"peak"`` the
answer is the highest total of the bytes the op allocated while it ran (outputs included, its inputs
not), in torch.profiler's memory timeline; to ``"outputs"``, the bytes of each tensor output's storage
(``None`` for other outputs); either is ``None`` if the op could not be run on random data. It runs in its
own process because torch.profiler allows one session per process: the user's (or a test's) profiler
stays free.
"""

from __future__ import annotations

import importlib
import os
import pickle
import struct
import sys
from typing import Any, BinaryIO

if __name__ == "__main__" and sys.path and sys.path[0] == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]  # run as a file: the package's modules (cli, testing, ...) must not shadow others

import torch
from torch.profiler import ProfilerActivity, profile
from torch.profiler._memory_profiler import Action, MemoryProfile


def _materialize(x: Any) -> Any:
    """A random tensor for a ``("tensor", shape, stride, dtype)`` spec; other values as they are."""
    if isinstance(x, tuple) and len(x) == 4 and x[0] == "tensor":
        _, shape, stride, dtype = x
        size = 1 + sum((n - 1) * s for n, s in zip(shape, stride, strict=True) if n > 0) if all(shape) else 0
        base = torch.empty(size, dtype=dtype)
        if base.is_floating_point() or base.is_complex():
            base.normal_()
        else:
            base.zero_()  # indices, masks and counts: zeros are valid everywhere
        return base.as_strided(shape, stride)
    if isinstance(x, list):
        return [_materialize(i) for i in x]
    if isinstance(x, tuple):
        return tuple(_materialize(i) for i in x)
    if isinstance(x, dict):
        return {k: _materialize(v) for k, v in x.items()}
    return x


def _op(name: str) -> Any:
    """The op named ``namespace.op.overload``; another library's (bitsandbytes') registers its ops when
    imported, as the module its namespace names."""
    namespace, op, overload = name.split(".")
    try:
        packet = getattr(getattr(torch.ops, namespace), op)
    except AttributeError:
        importlib.import_module(namespace)
        packet = getattr(getattr(torch.ops, namespace), op)
    return getattr(packet, overload)


def _rnn_layer_backward(func: Any, args: list, kwargs: dict) -> tuple[list, dict]:
    """``mkldnn_rnn_layer_backward`` reads the workspace its forward wrote (random bytes crash the
    process): the forward runs on the same inputs for the output, states and workspace it takes."""
    names = [argument.name for argument in func._schema.arguments]
    bound = {**dict(zip(names, args, strict=False)), **kwargs}
    forward = [bound[n] for n in ("input", "weight1", "weight2", "weight3", "weight4", "hx_", "cx_tmp")]
    forward += [bound[n] for n in ("reverse", "batch_sizes", "mode", "hidden_size", "num_layers")]
    forward += [bound[n] for n in ("has_biases", "bidirectional", "batch_first", "train")]
    output, hy, cy, workspace = torch.ops.aten.mkldnn_rnn_layer.default(*forward)
    bound.update(output=output, hy_=hy, cy_=cy, workspace=workspace)
    return [bound[n] for n in names], {}


#: Ops whose arguments random data cannot stand for, and how to make them: ``(op, args, kwargs) -> (args,
#: kwargs)``.
_PREPARE = {"aten.mkldnn_rnn_layer_backward.default": _rnn_layer_backward}


def _arguments(name: str, args: Any, kwargs: Any) -> tuple[Any, list, dict]:
    """The op and random arguments of the specs (made valid where `_PREPARE` says how)."""
    func = _op(name)
    a, kw = _materialize(args), _materialize(kwargs)
    if name in _PREPARE:
        a, kw = _PREPARE[name](func, list(a), dict(kw))
    return func, a, kw


def output_nbytes(name: str, args: Any, kwargs: Any) -> list[int | None] | None:
    try:
        func, a, kw = _arguments(name, args, kwargs)
        out = func(*a, **kw)
    except Exception:
        return None
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return [o.untyped_storage().nbytes() if isinstance(o, torch.Tensor) else None for o in outs]


def internal_peak(name: str, args: Any, kwargs: Any) -> int | None:
    try:
        func, a, kw = _arguments(name, args, kwargs)
        func(*a, **kw)  # warm-up: one-time caches (oneDNN primitives) are not the step's memory
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True) as prof:
            out = func(*a, **kw)
        del out
    except Exception:  # an op that needs particular values: the caller counts nothing extra
        return None
    live = peak = 0
    created = set()
    for _, action, (key, _), nbytes in MemoryProfile(prof.profiler.kineto_results).timeline:
        if key.device.type != "cpu":
            continue
        if action == Action.CREATE:
            created.add(key)
            live += nbytes
        elif action == Action.DESTROY and key in created:
            live -= nbytes
        peak = max(peak, live)
    return peak


def read_message(stream: BinaryIO) -> Any:
    """The next message; `EOFError` when the other side has closed (or died)."""
    header = stream.read(8)
    if len(header) < 8:
        raise EOFError("the other process closed the pipe")
    (size,) = struct.unpack("<Q", header)
    return pickle.loads(stream.read(size))


def write(stream: BinaryIO, obj: Any) -> None:
    data = pickle.dumps(obj)
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


def main() -> None:
    # Anything printed, by torch or by a library's native code (bitsandbytes' loads one), must not corrupt
    # the answers: they go out on a copy of stdout, and stdout itself is stderr from here on.
    stdin, stdout = sys.stdin.buffer, os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    sys.stdout = sys.stderr
    while True:
        try:
            request = read_message(stdin)
        except EOFError:  # the parent is done
            return
        question, name, args, kwargs, (threads, mkldnn, matmul_precision, deterministic) = request
        torch.set_num_threads(threads)
        torch.backends.mkldnn.enabled = mkldnn
        torch.set_float32_matmul_precision(matmul_precision)
        torch.use_deterministic_algorithms(deterministic)
        answer = output_nbytes if question == "outputs" else internal_peak
        write(stdout, answer(name, args, kwargs))


if __name__ == "__main__":
    main()
