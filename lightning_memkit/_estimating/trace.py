"""What created each storage of a simulated step: the record the advisor (`advise`) reads.

`estimate_memory` only needs how many bytes of each category are live at the peak. To name the waste, the
advisor also needs *what* is live there: the op and the module that created each storage, the phase it
ran in, its dtype and shape, and which storages are the size of the logits. A `Tracer` handed to the
simulation (`_estimating.fake_step.simulate_step`) records that; it costs a few attribute writes per op and is
never on
the path of `estimate_memory` or `MemoryMonitor`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves

from lightning_memkit._measuring.listening import TrackerListener
from lightning_memkit._measuring.storages import Storage, rounded

if TYPE_CHECKING:
    from lightning_memkit._measuring.tracker import Tracker


class Origin(NamedTuple):
    """Where a storage of the step was created."""

    op: str  # the aten op, without namespace and overload: "mm", "_softmax"
    where: str  # the module running it ("h.0.attn"; "" outside every module), or in backward the
    # autograd node ("LogSoftmaxBackward0")
    phase: str  # "forward" | "zero_grad" | "backward" | "optimizer"
    dtype: torch.dtype
    shape: tuple[int, ...]
    logits: bool  # as wide as the vocabulary: the logits, their copies and their gradients


class Tracer(TrackerListener):
    """Follows, on a `_estimating.fake_tracker._SimTracker` it listens to, what creates each storage and how
    many bytes of logits are live.

    Args:
        model: the simulated model (module names, and its output head: `output_head`).
    """

    def __init__(self, model: nn.Module) -> None:
        self.names = {id(m): name for name, m in model.named_modules()}
        #: the output head's name and width (`output_head`); ``None``: no storage counts as logits
        self.head, self.vocabulary = output_head(model)
        self.op = ""
        self._from_logits = False
        self._modules: list[str] = []
        #: ids of the autograd nodes of the head's own backward (its input's and weight's gradients)
        self._head_nodes: set[int] = set()
        self._head_inputs: set[int] = set()
        #: bytes of logits-sized storages live now
        self.logits_live = 0
        #: (live bytes, of which logits-sized) after every op, and at every CPU kernel's hidden high point
        self.series: list[tuple[int, int]] = []
        #: the phase running when the peak was reached
        self.peak_phase = "forward"
        #: (name, gradient bytes) of parameters that got a gradient no optimizer steps
        self.untrained: list[tuple[str, int]] = []
        #: (name, bytes) of trainable parameters that got no gradient at all
        self.unused: list[tuple[str, int]] = []
        self._reached: set[int] = set()

    def follow(self, model: nn.Module) -> None:
        """Name the modules of ``model``, a copy of the one given (FSDP2's sharded copy: the same names)."""
        self.names = {id(m): name for name, m in model.named_modules()}

    # --- what the tracker tells (`TrackerListener`) ----------------------------------------------

    def op_started(self, tracker: Tracker, func: Any, args: tuple, kwargs: dict) -> None:
        self.before_op(func, args, kwargs, tracker.live)

    def registered(self, tracker: Tracker, rec: Storage, t: Tensor | None, *, preexisting: bool) -> None:
        if t is not None and not preexisting:  # made in the step, by an op
            self.created(rec, t, tracker.phase)  # type: ignore[attr-defined]

    def freed(self, tracker: Tracker, rec: Storage) -> None:
        if rec.origin is not None and rec.origin.logits:
            self.logits_live -= rec.nbytes

    def gradient(self, tracker: Tracker, param: Tensor) -> None:
        self.reached(param)

    def op_finished(self, tracker: Tracker, func: Any) -> None:
        self.after_op(tracker)

    # --- called by the simulation and the above ------------------------------------------------

    def started(self, tracker: Any, model: nn.Module, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        """The step is about to run: ``tracker`` holds what is live at its start (for `_diagnosis.snapshot`,
        which names those storages)."""

    def before_op(
        self, func: Any, args: tuple, kwargs: dict, live: Mapping[int, tuple[Any, Storage]]
    ) -> None:
        self.op = func.__name__.split(".")[0]
        self._from_logits = any(
            (entry := live.get(id(t.untyped_storage()))) is not None
            and entry[1].origin is not None
            and entry[1].origin.logits
            for t in tree_leaves((args, kwargs))
            if isinstance(t, Tensor)
        )

    def created(self, rec: Storage, t: Tensor, phase: str) -> None:
        node = torch._C._current_autograd_node() if phase == "backward" else None
        where = node.name() if node is not None else (self._modules[-1] if self._modules else "")
        shape = tuple(t.shape)
        # Logits: the head's output, and what is computed from logits as wide as they are (their copies,
        # log-softmax, and in backward their gradients); not an MLP's activations of the same width.
        logits = (
            self.vocabulary is not None
            and len(shape) >= 2
            and shape[-1] == self.vocabulary
            and (self._from_logits or (self.head is not None and where == self.head))
            and (node is None or id(node) not in self._head_nodes)  # the head's input gradient, not logits
        )
        rec.origin = Origin(self.op, where, phase, t.dtype, shape, logits)
        if logits:
            self.logits_live += rec.nbytes

    def reached(self, param: Tensor) -> None:
        """A gradient reached ``param`` (its post-accumulate-grad hook ran)."""
        self._reached.add(id(param))

    def after_op(self, tracker: Any) -> None:
        self.series.append((tracker.current, self.logits_live))
        if tracker.peak_clock == tracker.clock:
            self.peak_phase = tracker.phase
            if tracker.peak > tracker.current:  # a CPU kernel's own buffers (`_measuring.kernels`)
                self.series.append((tracker.peak, self.logits_live))

    # --- around the step -------------------------------------------------------------------------

    @contextlib.contextmanager
    def watching_modules(self) -> Iterator[None]:
        """Keep the name of the module running (global hooks, only while the simulated step runs)."""

        def enter(module: nn.Module, args: Any) -> None:
            name = self.names.get(id(module), type(module).__name__)
            self._modules.append(name)
            if name == self.head:
                self._head_inputs = {id(t.grad_fn) for t in tree_leaves(args) if isinstance(t, Tensor)}

        def leave(module: nn.Module, args: Any, output: Any) -> None:
            if self._modules:
                self._modules.pop()
            if self.names.get(id(module)) == self.head and isinstance(output, Tensor):
                self._head_nodes |= _nodes_between(output.grad_fn, self._head_inputs)

        with module_hooks(enter, leave):
            yield

    def finish(self, model: nn.Module, optimizers: Iterable[torch.optim.Optimizer], tracker: Any) -> None:
        """Name the trainable parameters no optimizer steps, and those no gradient reached (``tracker``:
        the `_estimating.fake_tracker._SimTracker` that ran the step)."""
        stepped = {id(p) for o in optimizers for group in o.param_groups for p in group["params"]}
        params = dict(model.named_parameters())  # a shared parameter once
        if not stepped & {id(p) for p in params.values()}:
            stepped = {id(p) for p in params.values()}  # optimizers over other tensors: nothing to say
        for name, p in params.items():
            if not p.requires_grad:
                continue
            nbytes = rounded(p.untyped_storage().nbytes(), tracker.rounding)
            if id(p) not in self._reached:
                self.unused.append((name, nbytes))
            elif id(p) not in stepped:
                self.untrained.append((name, nbytes))

    def peak_without_logits(self, chunks: int) -> int:
        """The step's peak if only ``1 / chunks`` of the logits-sized bytes were live at any time."""
        return max((live - held + -(-held // chunks) for live, held in self.series), default=0)


def _nodes_between(node: Any, stop: set[int]) -> set[int]:
    """Ids of the autograd nodes from ``node`` back to (not into) the ``stop`` nodes and the leaves: the
    backward of one module's forward."""
    found: set[int] = set()
    todo = [node]
    while todo:
        node = todo.pop()
        if node is None or id(node) in found or id(node) in stop or not hasattr(node, "next_functions"):
            continue
        if type(node).__name__ == "AccumulateGrad":
            continue
        found.add(id(node))
        todo.extend(next_node for next_node, _ in node.next_functions)
    return found


def output_head(model: nn.Module) -> tuple[str | None, int | None]:
    """The name and width (the vocabulary) of a language model's output head: what Hugging Face's
    ``get_output_embeddings()`` gives, a linear layer sharing its weight with an embedding (tied), or one
    named ``lm_head``; ``(None, None)`` without one."""
    names = {id(m): name for name, m in model.named_modules()}
    for module in model.modules():
        getter = getattr(module, "get_output_embeddings", None)
        if callable(getter):
            with contextlib.suppress(Exception):
                head = getter()
                if isinstance(head, nn.Linear) and id(head) in names:
                    return names[id(head)], head.out_features
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and (
            id(module.weight) in embeddings or name.rsplit(".", 1)[-1] == "lm_head"
        ):
            return name, module.out_features
    return None, None


@contextlib.contextmanager
def module_hooks(enter: Any, leave: Any) -> Iterator[None]:
    """``enter`` and ``leave`` as every module's forward pre-hook and forward hook (``leave`` even when the
    forward raises) while the block runs."""
    pre = nn.modules.module.register_module_forward_pre_hook(enter)
    post = nn.modules.module.register_module_forward_hook(leave, always_call=True)
    try:
        yield
    finally:
        pre.remove()
        post.remove()
