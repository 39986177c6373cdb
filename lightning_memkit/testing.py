"""The allocator's own record of a step's peak: the truth our measurements are checked against.

Used by the tests and `benchmarks/`, never by the callbacks: torch.profiler allows one session at a
time, and a monitor built on it would break users' own profiling.

* CUDA: ``torch.cuda.max_memory_allocated`` with the peak reset when the step begins.
* CPU: the allocations in torch.profiler's memory timeline (``profile_memory=True``). It replays every
  allocation and free the CPU allocator reported; tensors allocated before the profile began count
  from its start once the step touches or frees them.
* CPU, every thread (``AllocatorPeaks(all_threads=True)``, `counting_allocator`): the profiler reports only
  what the threads it profiles allocate and free, and a collective's worker thread (gloo's, under DDP and
  FSDP) frees blocks the step allocated: the profile then keeps them live to its end (a rank's "peak"
  grew step after step). A small C++ wrapper around the CPU allocator, compiled on first use, counts every
  allocation and free in every thread, as the CUDA caching allocator does for ``max_memory_allocated``.

The categories are checked against the tensors' owners: parameters, ``.grad`` and optimizer state are read
from the module and optimizers, what autograd keeps for the backward from the graph (`saved_for_backward`).
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.profiler import ProfilerActivity, profile
from torch.profiler._memory_profiler import Action, MemoryProfile
from torch.utils._pytree import tree_leaves

__all__ = [
    "AllocatorPeaks",
    "PretendOOM",
    "allocator_peak",
    "build_counting_allocator",
    "counting_allocator",
    "cpu_profiler",
    "profile_peak",
    "reducer_bucket_bytes",
    "saved_for_backward",
]


def cpu_profiler() -> profile:
    """A profiler configured to record the CPU allocator (start/stop it yourself, or use ``with``)."""
    return profile(
        activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=False
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
    gc.collect()  # see AllocatorPeaks._open
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device)
    with cpu_profiler() as prof:
        step()
    return profile_peak(prof, device)


def counting_allocator() -> Any:
    """The CPU allocator's count of live bytes in every thread, installed in this process on first call
    (the extension ``lightning_memkit/csrc/counting_allocator.cpp``, compiled once into torch's extension
    cache: about half a minute). Its functions: ``live_bytes()``, ``peak_bytes()``, ``reset_peak()``.

    Only what is allocated after the first call is counted, and the wrapper stays for the process's life:
    call it when a process starts (a test's rank), before the model is built.
    """
    counter = build_counting_allocator()
    counter.install()
    return counter


def build_counting_allocator() -> Any:
    """`counting_allocator`'s extension, compiled if it is not yet and loaded, without installing it: a
    parent process compiles it once before starting the ranks that install it."""
    from torch.utils.cpp_extension import load

    source = Path(__file__).with_name("csrc") / "counting_allocator.cpp"
    build = extension_directory(source)
    return load(
        "lightning_memkit_counting_allocator", [str(source)], extra_cflags=["-O2"],
        build_directory=None if build is None else str(build),
    )  # fmt: skip


def extension_directory(source: Path) -> Path | None:
    """Where `build_counting_allocator` compiles ``source``: a folder of this checkout's own under torch's
    extension cache (``~/.cache/torch_extensions``, ``$XDG_CACHE_HOME`` if set), named by the source's
    path, so that two checkouts on one machine neither rebuild each other's extension nor wait on one
    lock; ``None`` (torch's own folder) where ``TORCH_EXTENSIONS_DIR`` chooses one."""
    import hashlib
    import os

    import torch

    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return None
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "torch_extensions"
    checkout = hashlib.sha256(str(source.resolve()).encode()).hexdigest()[:12]
    folder = cache / f"lightning_memkit-{torch.__version__}-{checkout}"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def saved_for_backward(output: Tensor) -> list[Tensor]:
    """The tensors autograd keeps for ``output``'s backward, read from its graph, not seen being saved: the
    ``_saved_*`` tensors of torch's own nodes and the ``saved_tensors`` of a custom Function's (such as
    torch.compile's ``CompiledFunctionBackward``). Read them before the backward, which frees them."""
    saved: list[Tensor] = []
    seen: set[int] = set()
    stack = [output.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if hasattr(node, "saved_tensors"):
            saved += [t for t in node.saved_tensors if t is not None]
        for name in dir(node):
            if name.startswith("_saved_"):
                saved += [t for t in tree_leaves(getattr(node, name)) if isinstance(t, Tensor)]
        stack += [next_node for next_node, _ in node.next_functions]
    return saved


class AllocatorPeaks:
    """The allocator's peak of every training batch of a ``Trainer.fit``, step by step.

    Two callbacks bracket the hooks to compare: ``start`` opens the window in ``on_train_batch_start``
    and ``stop`` closes it in ``on_train_batch_end``; ``around(*callbacks)`` puts them on either side.
    Every batch is profiled, from the first: the CPU allocator reports a free's size only for blocks
    allocated while profiling, so a window opened late would miss the previous step's gradients that
    ``zero_grad`` frees. With ``all_threads`` (CPU), the peak is `counting_allocator`'s instead, which
    sees the collectives' worker threads too (install it before the model is built). It counts what was
    live when the step began as the profile does: the step's own tensors (the module's parameters,
    buffers and gradients, the optimizers' state, the batch, and under DDP its reducer's gradient buckets);
    the rest of the process's memory (the data set, what the loggers keep) is not the step's and is taken
    off. Under DDP, prefer ``all_threads``: torch.profiler's memory timeline of a DDP step now and then
    rejects its own trace ("duplicate outputs", about one profile of two steps in eleven) or keeps a bucket
    that gloo's thread freed alive to the end; the count is the same every time.
    """

    def __init__(self, device: str | torch.device = "cpu", *, all_threads: bool = False) -> None:
        self.device = torch.device(device)
        self.peaks: list[int] = []
        self._prof: profile | None = None
        self._counter = counting_allocator() if all_threads and self.device.type == "cpu" else None
        self._not_the_steps = 0  # with the counter: bytes live at the step's start that are not the step's
        self.start, self.stop = _Open(self), _Close(self)

    def around(self, *callbacks: object) -> list:
        return [self.start, *callbacks, self.stop]

    def _open(self, step_tensors: Callable[[], Iterable[Tensor]] = tuple, step_bytes: int = 0) -> None:
        # Garbage of earlier work (a reference cycle holding tensors) collected inside the window would
        # count as live from its start: the profile knows a freed block allocated before it began only by
        # its free. When the collector runs depends on every thread's allocations (pytest-xdist's own).
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self._counter is not None:
            from lightning_memkit._measuring.storages import storage_bytes

            self._counter.reset_peak()
            live = self._counter.live_bytes()
            self._not_the_steps = live - storage_bytes(step_tensors(), self.device) - step_bytes
        else:
            self._prof = cpu_profiler()
            self._prof.start()

    def _close(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peaks.append(torch.cuda.max_memory_allocated(self.device))
        elif self._counter is not None:
            self.peaks.append(self._counter.peak_bytes() - self._not_the_steps)
        else:
            assert self._prof is not None
            self._prof.stop()
            self.peaks.append(profile_peak(self._prof, self.device))
            self._prof = None


class _Open(pl.Callback):  # module level, so that ddp_spawn can pickle it
    def __init__(self, peaks: AllocatorPeaks) -> None:
        self.peaks = peaks

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        from lightning_memkit._measuring.storages import gradient_tensors, model_tensors, optimizer_tensors

        def step_tensors() -> Iterable[Tensor]:
            yield from model_tensors(pl_module)
            yield from gradient_tensors(pl_module)
            yield from optimizer_tensors(trainer.optimizers)
            yield from (t for t in tree_leaves(batch) if isinstance(t, Tensor))

        buckets = reducer_bucket_bytes(trainer.strategy.model) if self.peaks._counter is not None else 0
        self.peaks._open(step_tensors, buckets)


class _Close(pl.Callback):
    def __init__(self, peaks: AllocatorPeaks) -> None:
        self.peaks = peaks

    def on_train_batch_end(self, *args: object) -> None:
        self.peaks._close()


class PretendOOM:
    """Makes a LightningModule behave as if on a small device, to test out-of-memory handling on any machine.

    A real (not fake) ``training_step`` on batch ``batch_idx`` with more than ``rows`` samples raises
    `torch.OutOfMemoryError`: in the forward, or with ``where="backward"`` when the gradient reaches
    ``layer``'s output, after the layers above it have accumulated theirs. ``raised`` counts the errors.
    It takes the module's ``training_step`` (an instance attribute); ``remove()`` gives it back.

    Not under FSDP2: the explanation simulates the module's unsharded twin, whose ``training_step`` this
    wrapper would send back to the sharded module. Raise from a subclass's ``training_step`` there, on
    real tensors only (``tests/sharding/test_fsdp.py``'s ``OutOfMemory``).
    """

    def __init__(
        self,
        module: pl.LightningModule,
        rows: int,
        *,
        where: str = "forward",
        layer: nn.Module | None = None,
        batch_idx: int = 0,
    ) -> None:
        if where not in ("forward", "backward") or (where == "backward") != (layer is not None):
            raise ValueError("where='forward', or where='backward' with the layer= to raise at")
        self.module, self.rows, self.where, self.layer, self.batch_idx = module, rows, where, layer, batch_idx
        self.raised = 0
        self._step = module.training_step
        module.__dict__["training_step"] = self.training_step

    def training_step(self, batch: Any, batch_idx: int, *args: Any, **kwargs: Any) -> Any:
        x = next(t for t in tree_leaves(batch) if isinstance(t, Tensor))
        if type(x) is not Tensor or batch_idx != self.batch_idx or len(x) <= self.rows:
            return self._step(batch, batch_idx, *args, **kwargs)
        if self.layer is None:
            self._raise()
        hook = self.layer.register_forward_hook(self._raise_in_backward)
        try:
            return self._step(batch, batch_idx, *args, **kwargs)
        finally:
            hook.remove()

    def _raise_in_backward(self, layer: nn.Module, args: object, out: Tensor) -> None:
        out.register_hook(self._raise)

    def _raise(self, *_: object) -> None:
        self.raised += 1
        raise torch.OutOfMemoryError(f"out of memory (pretend: more than {self.rows} samples)")

    def remove(self) -> None:
        self.module.__dict__.pop("training_step", None)


def reducer_bucket_bytes(model: object) -> int:
    """Bytes of a `DistributedDataParallel` ``model``'s gradient buckets, as torch's reducer lays them out
    now (its own zero-filled copies of them, made and freed here: call it before a count begins); 0 for
    another model."""
    from lightning_memkit._measuring.storages import storage_bytes

    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return 0
    buckets = model.reducer._get_zeros_like_grad_buckets()
    return storage_bytes([bucket.buffer() for bucket in buckets])
