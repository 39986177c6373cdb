"""A compiled module's step, simulated as torch.compile runs it: `compiled_as_inductor`.

Eagerly, autograd saves what each op's backward formula asks for. Compiled (inductor, torch.compile's
default backend), AOTAutograd traces the forward and backward as one graph and its min-cut partitioner
decides what crosses from the forward to the backward: it recomputes cheap pointwise ops in the backward
rather than saving their outputs, and honours ``torch._functorch.config.activation_memory_budget``. Inductor
then fuses chains of pointwise ops into one kernel, so their intermediates are never allocated. A tiny
LLaMA's compiled step peaks 8 % below its eager one on the CPU, and simulating it eagerly read 10 % high.

While a simulation runs, each compiled module (``torch.compile(module)``, or ``module.compile()``) is
called as inductor would run it: its forward and backward are traced with inductor's decompositions and
joint-graph passes (on the simulation's fake tensors, with ``torch.compiler.is_compiling()`` true, as code
sees it under dynamo), partitioned by the same partitioner (the module's parameters and buffers as static
inputs, as dynamo marks them; a buffer the forward writes written in place, as dynamo traces it), and
inductor generates the code of each graph (``compile_fx_inner``, under the ``mode`` and ``options`` the
module was compiled with: its post-grad passes, lowering, fusion, layout choices, memory reordering and
buffer reuse), stopped before its kernels are compiled. That code is then run on the simulation's tensors
with every generated kernel stubbed (`_load`): it allocates, reuses
(``buf2 = reinterpret_tensor(mm_13, ...); del mm_13  # reuse``) and frees each buffer as the compiled step
does, through the dispatcher where the tracker sees it, and its fallback ops (matmuls, attention,
convolutions) run as the step's own, their kernels' hidden buffers counted as for an eager op. As dynamo
arranges it, the backward's saved tensors take the strides the forward's code gives them (channels-last
where inductor lays convolutions out so), and a tracing context tells inductor which of them it may write
over.

Measured against the CPU allocator, steady step (`benchmarks/bench_compiled_estimate.py`,
tests/estimating/test_compiled_estimate.py): to the byte on the zoo's LLaMA, Qwen2, GPT-NeoX, T5, Whisper,
BERT and a compiled CNN, ViT +0.02 %, GPT-2 +2.7 % (a graph break: below); the zoo's LLaMA at activation
budgets 0.984 to 0.1, to the byte (`_checkpointing.compiled` plans with them).

The traced graph is the whole module's: where dynamo breaks the graph (code it cannot trace), the real
step is partitioned at the break, which the simulation does not see. A module whose ``compile()`` was
called but whose ``forward`` is torch.nn's (``nn.Sequential``) runs eagerly, as dynamo skips it (a
user-defined forward below it, which dynamo would compile on its own, is simulated eagerly too). A module
compiled with another backend is simulated eagerly; so, with a warning, is one whose forward cannot be
traced whole (a value read to branch on, a data-dependent shape: a mixture of experts' routing) or whose
code inductor cannot generate here, that holds eager checkpoint wrappers (dynamo traces those into the
partitioner, which this tracing cannot), or that is given an object its forward may change (a key-value
cache passed to a block compiled on its own: dynamo replays the change, the simulation cannot), and one
compiled with ``cpp_wrapper`` (its C++ code allocates otherwise than the Python code run here). The code
generated is the CPU's (the simulation's tensors are): on CUDA inductor fuses into Triton kernels whose
buffers can differ.

The tracing runs with no dispatch mode of the simulation's (nor its saved-tensor hooks) and through no
dynamo frame: nothing is compiled, cached or skipped for the real run (inductor's code cache and FX graph
cache are not written). Private torch API (AOTAutograd, its partitioner, inductor's decomposition table,
joint-graph passes, ``compile_fx_inner`` and the layout of its generated code) is used here only.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import sys
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_unflatten

from lightning_memkit._measuring import patches

__all__ = ["compiled_as_inductor", "compiled_modules"]


def _skipped(module: nn.Module) -> bool:
    """Whether dynamo skips ``module``'s ``forward`` (torch.nn's own, e.g. ``nn.Sequential``'s)."""
    from torch._dynamo import trace_rules

    return bool(trace_rules.check(module.forward))


def compiled_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` that torch.compile runs with inductor: a ``torch.compile(module)`` wrapper
    (its ``_orig_mod`` is the module it runs) or a module whose own ``compile()`` was called. Outermost
    only: a compiled module inside a compiled module is traced with it."""
    found: list[nn.Module] = []
    if "torch._dynamo" not in sys.modules:  # nothing was compiled (and dynamo's import is not cheap)
        return found
    skip: set[int] = set()
    for module in model.modules():
        if id(module) in skip:
            continue
        if _inductor(module):
            found.append(module)
            skip.update(id(m) for m in module.modules())
    return found


def _context(module: nn.Module) -> Any:
    """The dynamo context ``module`` is compiled with, or ``None``."""
    from torch._dynamo.eval_frame import OptimizedModule

    if isinstance(module, OptimizedModule):
        return module.dynamo_ctx
    compiled = getattr(module, "_compiled_call_impl", None)
    if compiled is None:
        return None
    return inspect.getclosurevars(compiled).nonlocals.get("self")


def _inductor(module: nn.Module) -> bool:
    context = _context(module)
    if context is None:
        return False
    if not hasattr(module, "_orig_mod") and _skipped(module):
        # ``module.compile()`` compiles ``_call_impl``, whose frame dynamo skips, and torch.nn's own
        # ``forward`` (``nn.Sequential``'s) is skipped too: such a module runs eagerly (a user-defined
        # forward below it would be compiled on its own; not simulated so: see the module docstring)
        return False
    return _backend(module) is not None


def _backend(module: nn.Module) -> Any:
    """The inductor backend ``module`` is compiled with (its ``mode`` and ``options`` in ``.config``), or
    ``None``."""
    from torch._dynamo.eval_frame import innermost_backend

    backend = innermost_backend(getattr(_context(module), "callback", None))
    return backend if type(backend).__name__ == "_TorchCompileInductorWrapper" else None


@contextlib.contextmanager
def compiled_as_inductor(model: nn.Module, budget: float | None = None) -> Iterator[list[nn.Module]]:
    """While inside, each of `compiled_modules` of ``model`` is called as inductor runs it (see the module
    docstring), with ``activation_memory_budget`` = ``budget`` where given (torch's own otherwise). Yields
    the modules so called."""
    modules = compiled_modules(model)
    restore: list[Callable[[], None]] = []
    try:
        for module in modules:
            restore.append(_install(module, _Partitioned(module, budget)))
        yield modules
    finally:
        for undo in reversed(restore):
            undo()


def _install(module: nn.Module, runner: _Partitioned) -> Callable[[], None]:
    from torch._dynamo.eval_frame import OptimizedModule

    name = "forward" if isinstance(module, OptimizedModule) else "_compiled_call_impl"
    before = module.__dict__[name]
    module.__dict__[name] = runner
    return lambda: module.__dict__.__setitem__(name, before)


class _Partitioned:
    """``module``'s call (hooks and forward), traced and partitioned once per structure of arguments."""

    def __init__(self, module: nn.Module, budget: float | None) -> None:
        from torch._dynamo.eval_frame import OptimizedModule

        self.module = module._orig_mod if isinstance(module, OptimizedModule) else module
        self.budget = budget
        #: inductor's config as ``torch.compile(mode=..., options=...)`` set it for this module
        self.options = dict(_backend(module).config)
        self.traced: dict[Any, Callable[..., Any] | None] = {}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        leaves, spec = tree_flatten((args, kwargs))
        tensors = [i for i, leaf in enumerate(leaves) if isinstance(leaf, Tensor)]
        key = (spec, tuple(_key(leaf) for leaf in leaves))
        if key not in self.traced:
            objects = [
                type(leaf).__name__ for leaf in leaves if not isinstance(leaf, Tensor) and not _plain(leaf)
            ]
            if objects:  # the call may change them (a key-value cache it appends to): dynamo replays that
                self.traced[key] = None
                _eagerly(self.module, f"it is given a {objects[0]}, which its forward may change")
            else:
                self.traced[key] = self._trace(leaves, spec, tensors)
        run = self.traced[key]
        if run is None:
            return self._eager(*args, **kwargs)
        return run(self._state(), [leaves[i] for i in tensors])

    def _eager(self, *args: Any, **kwargs: Any) -> Any:
        with self._uncompiled():
            return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def _uncompiled(self) -> Iterator[None]:
        """``module.compile()``'s compiled call set aside while inside: the module runs its own."""
        compiled = self.module.__dict__.pop("_compiled_call_impl", None)
        try:
            yield
        finally:
            if compiled is not None:
                self.module.__dict__["_compiled_call_impl"] = compiled

    def _named_state(self) -> list[tuple[str, Tensor]]:
        """The module's parameters and buffers, by name, ties kept: the traced graph's first inputs."""
        named = list(self.module.named_parameters(remove_duplicate=False))
        return named + list(self.module.named_buffers(remove_duplicate=False))

    def _state(self) -> list[Tensor]:
        return [t for _, t in self._named_state()]

    def _trace(self, leaves: list, spec: Any, tensors: list[int]) -> Callable[..., Any] | None:
        from torch._functorch.aot_autograd import aot_function

        names = [name for name, _ in self._named_state()]
        outputs = _Outputs()

        def flat(state: list[Tensor], inputs: list[Tensor]) -> list[Tensor]:
            filled = list(leaves)
            for i, t in zip(tensors, inputs, strict=True):
                filled[i] = t
            args, kwargs = tree_unflatten(filled, spec)
            out = torch.func.functional_call(
                self.module, dict(zip(names, state, strict=True)), args, kwargs, tie_weights=False
            )
            return outputs.split(out)

        strides: dict[str, tuple] = {}
        fn = aot_function(
            flat,
            fw_compiler=functools.partial(_generated, forward=True, strides=strides, options=self.options),
            bw_compiler=functools.partial(_generated, forward=False, strides=strides, options=self.options),
            partition_fn=functools.partial(_partition, parameters=len(names)),
            decompositions=_decompositions(),
            keep_inference_input_mutations=True,  # as dynamo traces: a buffer written in place, not copied
        )

        def run(state: list[Tensor], inputs: list[Tensor]) -> Any:
            return outputs.join(fn(state, inputs))

        try:
            # the inputs cut from the step's graph: the trial's backward must stop at them (an input made
            # by an earlier call of this module would otherwise be backpropagated through, its saved
            # tensors freed before the step's own backward)
            state = self._state()
            inputs = [leaves[i].detach().requires_grad_(leaves[i].requires_grad) for i in tensors]
            with _alone(), _compiling(), _functorch_config(self.budget), self._uncompiled(), _tracing(state):
                # traces and partitions, and runs both graphs once (the results dropped), so that what
                # cannot run is known before the step does
                outs = [t for t in fn(state, inputs) if t.requires_grad]
                wrt = [t for t in (*state, *inputs) if t.requires_grad]
                if outs and wrt:  # no .grad is written
                    torch.autograd.grad(outs, wrt, [torch.ones_like(t) for t in outs], allow_unused=True)
        except Exception as err:
            _eagerly(
                self.module,
                f"it could not be traced whole as torch.compile would ({type(err).__name__}: {err})",
            )
            return None
        return run


def _eagerly(module: nn.Module, why: str) -> None:
    warnings.warn(
        f"The estimate simulates {type(module).__name__}'s compiled step eagerly: {why}. The compiled step "
        "may keep less between its forward and backward; measure it with MemoryMonitor.",
        stacklevel=3,
    )


_TENSOR: Any = object()  # an output leaf that is a tensor of the graph's


class _Outputs:
    """A traced call's outputs as the graph's list of tensors, and back. Tensors inside other objects (a
    key-value cache) are outputs too, as dynamo makes them: each needs a gradient in the backward (zeros,
    made there) where it requires one."""

    def __init__(self) -> None:
        self.tree: Any = None
        self.leaves: list[Any] = []  # each: a tensor's place (_TENSOR), a plain value, or an object to copy
        self.inner: list[list[Tensor]] = []  # the traced tensors inside each object leaf

    def split(self, out: Any) -> list[Tensor]:
        leaves, self.tree = tree_flatten(out)
        tensors: list[Tensor] = []
        self.leaves, self.inner = [], []
        for leaf in leaves:
            if isinstance(leaf, Tensor):
                self.leaves.append(_TENSOR)
                tensors.append(leaf)
            elif _plain(leaf):
                self.leaves.append(leaf)
            else:
                inner = _tensors_in(leaf)
                self.leaves.append(leaf)
                self.inner.append(inner)
                tensors += inner
        return tensors

    def join(self, tensors: list[Tensor]) -> Any:
        it, objects = iter(tensors), iter(self.inner)
        leaves = []
        for leaf in self.leaves:
            if leaf is _TENSOR:
                leaves.append(next(it))
            elif _plain(leaf):
                leaves.append(leaf)
            else:
                memo = {id(traced): next(it) for traced in next(objects)}
                try:
                    leaves.append(copy.deepcopy(leaf, memo))
                except Exception:
                    leaves.append(None)
        return tree_unflatten(leaves, self.tree)


def _tensors_in(obj: Any, depth: int = 4) -> list[Tensor]:
    """The tensors held in ``obj``'s attributes, lists, tuples and dicts, ``depth`` levels down."""
    found: dict[int, Tensor] = {}

    def walk(value: Any, depth: int) -> None:
        if isinstance(value, Tensor):
            found.setdefault(id(value), value)
        elif depth == 0 or isinstance(value, (nn.Module, str, bytes, type)):
            return
        elif isinstance(value, dict):
            for v in value.values():
                walk(v, depth - 1)
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v, depth - 1)
        elif hasattr(value, "__dict__"):
            walk(vars(value), depth)

    walk(obj, depth)
    return list(found.values())


def _plain(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


def _key(leaf: Any) -> Any:
    if isinstance(leaf, Tensor):
        return (tuple(leaf.shape), leaf.dtype, leaf.requires_grad)
    return leaf if _plain(leaf) else id(leaf)


def _decompositions() -> dict:
    from torch._inductor.decomposition import select_decomp_table

    return select_decomp_table()


def _partition(graph: torch.fx.GraphModule, joint_inputs: Any, *, parameters: int, **kwargs: Any) -> Any:
    """Inductor's partition (``torch._inductor.compile_fx.partition_fn``, which needs dynamo's compile
    context): its joint-graph passes, then the min-cut partitioner, told that the first ``parameters``
    inputs live beyond the step, as dynamo tells it of the module's parameters and buffers (they are no
    activations its ``activation_memory_budget`` shares out)."""
    kwargs["static_lifetime_input_indices"] = list(range(parameters))
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._guards import detect_fake_mode
    from torch._inductor.fx_passes.joint_graph import joint_graph_passes
    from torch._inductor.virtualized import V

    with V.set_fake_mode(detect_fake_mode(joint_inputs)):  # as compile_fx sets it
        joint_graph_passes(graph)
    return min_cut_rematerialization_partition(graph, joint_inputs, compiler="inductor", **kwargs)


@contextlib.contextmanager
def _functorch_config(budget: float | None) -> Iterator[None]:
    from torch._functorch import config

    options: dict[str, Any] = {"force_non_lazy_backward_lowering": True}
    if budget is not None:
        options["activation_memory_budget"] = budget
    with config.patch(options):
        yield


def _tracing(tensors: list[Tensor]) -> contextlib.AbstractContextManager:
    """A tracing context, as dynamo gives AOTAutograd and inductor: AOTAutograd records in it which of the
    backward's saved tensors no output aliases, and inductor then writes buffers over them as they die
    (``buf2 = reinterpret_tensor(mm_13, ...); del mm_13  # reuse``)."""
    from torch._guards import TracingContext, detect_fake_mode, tracing

    return tracing(TracingContext(detect_fake_mode(tensors)))


@contextlib.contextmanager
def _compiling() -> Iterator[None]:
    """``torch.compiler.is_compiling()`` true, as the module's code sees it while dynamo traces it."""
    before = torch.compiler.is_compiling
    torch.compiler.is_compiling = lambda: True
    try:
        yield
    finally:
        torch.compiler.is_compiling = before


def _same(t: Any) -> Any:
    return t


@contextlib.contextmanager
def _alone() -> Iterator[None]:
    """No dispatch mode and no saved-tensor hooks of the simulation's while inside: tracing is not the
    step (a FLOP counter or the tracker would count it). The inputs' fake mode is AOTAutograd's to enter."""
    torch._C._autograd._push_saved_tensors_default_hooks(_same, _same)
    try:
        with _disable_current_modes():
            yield
    finally:
        torch._C._autograd._pop_saved_tensors_default_hooks()


def _generated(
    graph: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    forward: bool,
    strides: dict[str, tuple],
    options: dict[str, Any],
) -> Callable[[list], Any]:
    """A "compiler" that has inductor generate ``graph``'s code (`_wrapper_code`) and returns its ``call``,
    its kernels stubbed (`_load`): run on the simulation's fake tensors, it allocates, reuses and frees
    every buffer as the compiled step does, and its fallback ops run through the tracker as the step's own.
    ``strides``: the forward's output strides by name, which the backward's saved tensors take (as
    AOTAutograd restrides them from what inductor reports: channels-last convolutions save channels-last);
    ``options``: inductor's config for the module (`_Partitioned.options`)."""
    placeholders = list(graph.graph.find_nodes(op="placeholder"))
    if not forward:
        example_inputs = _restrided(placeholders, example_inputs, strides)
    source, output_strides = _wrapper_code(graph, example_inputs, forward=forward, options=options)
    if forward:
        outputs = tree_flatten(graph.graph.find_nodes(op="output")[0].args)[0]
        strides.clear()
        strides.update(
            (node.name, stride)
            for node, stride in zip(outputs, output_strides, strict=True)
            if isinstance(node, torch.fx.Node) and stride is not None
        )
    call = _load(source)

    def run(args: list) -> Any:
        # inputs read only by generated kernels (stubbed: no op shows them) are live all the same; with a
        # tracker, the last input is held until the call returns, as it has been so far
        held = args[-1] if patches.compiled_inputs(args) and args else None
        # boxed: ``call`` clears ``args`` and frees each input after its last read, as compiled
        with _faking(args):
            out = list(call(args))
        del held
        return out

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


def _faking(inputs: Sequence[Any]) -> contextlib.AbstractContextManager:
    """The inputs' fake mode, entered where none is (the trial run in `_Partitioned._trace`, outside the
    simulation): the code's buffers must be fake tensors too, never memory."""
    from torch._guards import detect_fake_mode

    if torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None:
        return contextlib.nullcontext()
    mode = detect_fake_mode(inputs)
    if mode is None:
        raise RuntimeError("inductor's code is run on fake tensors only")
    return mode


def _restrided(placeholders: list[torch.fx.Node], inputs: Sequence[Any], strides: dict[str, tuple]) -> list:
    from torch._guards import detect_fake_mode

    mode = detect_fake_mode(inputs)
    restrided = list(inputs)
    for i, (node, t) in enumerate(zip(placeholders, inputs, strict=True)):
        stride = strides.get(node.name)
        if stride is not None and isinstance(t, Tensor) and tuple(t.stride()) != stride:
            with mode:
                restrided[i] = torch.empty_strided(t.shape, stride, dtype=t.dtype, device=t.device)
    return restrided


class _Generated(Exception):
    """Inductor's code for a graph, caught before its kernels are compiled."""


def _wrapper_code(
    graph: torch.fx.GraphModule, example_inputs: Sequence[Any], *, forward: bool, options: dict[str, Any]
) -> tuple[str, list[tuple | None]]:
    """The Python code inductor generates for ``graph`` (``compile_fx_inner``: its post-grad passes,
    lowering, scheduler, fusion, memory reordering and buffer reuse) under the module's ``options``, and
    the strides of its outputs. Its kernels are not compiled: the compile is stopped as it would load the
    code, and nothing is cached. With ``cpp_wrapper`` the step runs C++ code, not this: refused."""
    from unittest import mock

    from torch._guards import detect_fake_mode
    from torch._inductor import config
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.graph import GraphLowering
    from torch._inductor.virtualized import V

    caller, found = threading.get_ident(), []
    load = GraphLowering._compile_to_module_lines

    def capture(lowering: GraphLowering, code: Any) -> Any:
        if threading.get_ident() != caller:  # another thread's compile: not ours to stop
            return load(lowering, code)
        found.append((code.value, [_static_stride(out) for out in lowering.graph_outputs]))
        raise _Generated

    copied = copy.deepcopy(graph)  # the passes rewrite it
    copied.graph.find_nodes(op="output")[0].meta["user_visible_output_idxs"] = []
    ours = {"fx_graph_cache": False, "fx_graph_remote_cache": False, "compile_threads": 1}
    try:
        with (
            mock.patch.object(GraphLowering, "_compile_to_module_lines", capture),
            config.patch({**options, **ours}),
            V.set_fake_mode(detect_fake_mode(example_inputs)),
        ):
            if config.cpp_wrapper:
                raise NotImplementedError(
                    "its code is C++ (cpp_wrapper), which allocates otherwise than the Python code simulated"
                )
            compile_fx_inner(copied, list(example_inputs), is_backward=not forward)
    except Exception:  # inductor wraps what its passes raise (ours included)
        if found:
            return found[0]
        raise
    raise RuntimeError("inductor generated no code to load")


def _static_stride(node: Any) -> tuple[int, ...] | None:
    try:
        return tuple(int(s) for s in node.get_layout().stride)
    except Exception:  # no tensor (None, a symbolic shape)
        return None


class _Stubbed:
    """Inductor's ``AsyncCompile`` for generated code that is only run for its allocations: each kernel is
    a function that does nothing (it writes into buffers the code allocated beforehand)."""

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name == "wait":
            return lambda scope: None
        return lambda *args, **kwargs: _nothing


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


def _load(source: str) -> Callable[[list], Any]:
    """``call`` of inductor's generated ``source``, its kernels stubbed (`_Stubbed`), its buffers allocated
    through the dispatcher (``torch.empty_strided``: fake tensors, seen by the tracker) rather than by the
    C++ fast paths the code binds."""
    line = "async_compile = AsyncCompile()"
    if line not in source:
        raise RuntimeError(f"inductor's generated code has no {line!r} line to stub")
    scope: dict[str, Any] = {"__name__": "lightning_memkit_inductor_code"}
    scope["_stubbed"] = _Stubbed()
    exec(compile(source.replace(line, "async_compile = _stubbed"), "<inductor code>", "exec"), scope)
    for device in ("cpu", "cuda", "xpu", "mtia"):
        scope[f"empty_strided_{device}"] = functools.partial(_empty_strided, device=device)
    scope["empty_strided_cpu_pinned"] = scope["empty_strided_cpu"]
    scope["reinterpret_tensor"] = _reinterpret
    scope["assert_size_stride"] = scope["assert_alignment"] = _nothing
    return scope["call"]


def _empty_strided(size: Sequence[int], stride: Sequence[int], dtype: torch.dtype, *, device: str) -> Tensor:
    return torch.empty_strided(size, stride, dtype=dtype, device=device)


def _reinterpret(t: Tensor, size: Sequence[int], stride: Sequence[int], offset: int) -> Tensor:
    return t.as_strided(size, stride, t.storage_offset() + offset)
