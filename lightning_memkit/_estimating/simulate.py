"""Estimate a training step's memory exactly by running it on fake tensors: nothing is allocated.

This is the simulated half of the estimator. `estimate_memory` runs one real training step of the
user's model — forward, backward, ``optimizer.step()``, ``zero_grad()``, with the user's own code — but
every parameter, buffer, batch tensor and intermediate is a ``FakeTensor``: it has a shape, a dtype and a
storage size, and no data. The same storage tracker `measure` uses (`_measuring.tracker.Tracker`) watches the
step, so the result is the breakdown `measure` would report for the real step, and a 70B model can be
planned on a laptop. Compared with `_estimating.analytic`, nothing is assumed about the architecture:
whatever the code allocates is counted. How the step runs (precision, checkpointing, accumulation, the
lever on the optimizer step, FSDP2's sharding) arrives as one `Step`: `estimate_memory` takes it as
``step=`` or makes it from its keywords (`Step.split`).

How the pieces are faked, in order:

1. The model's parameters and buffers are swapped, in place and only for the duration of the call, for
   fake tensors of the same shape (tied weights stay tied); the user's own tensors are put back untouched
   and never read. Parameters on the meta device work the same way, so a model built under
   ``torch.device("meta")`` is planned without ever being materialized.
2. The optimizer is built over the fake parameters (the LightningModule's ``configure_optimizers``, an
   optimizer name, a factory, or a copy of a given optimizer's hyperparameters) and, unless
   ``first_step=True``, stepped once untracked so its state exists, as in every step after the first.
3. The step runs under the tracker. Precision follows Lightning's plugins: ``*-mixed`` runs the forward
   under ``torch.autocast(cache_enabled=False)`` (the low-precision weight copies are real allocations
   and are counted), ``*-true`` converts the parameters and floating-point inputs and sets the default
   dtype during the forward.

The simulation always runs on fake *CPU* tensors: fake CUDA tensors abort the process on a CPU-only
build of torch. For ``device="cuda"`` the CUDA-specific behaviour that moves the peak is modelled on
top: the caching allocator's 512-byte rounding, foreach optimizer kernels (torch's default on CUDA and
the reason for a parameter-sized temporary in ``step()``), and torch.optim's ``step`` counters living on
the CPU (except on a first step, where they are born inside the step: 512 B per parameter tensor, counted
as optimizer state), and cuBLAS's two workspaces (`cublas_workspace_bytes`: 64 MiB on an H100 or H200,
held from the first matmul on and seen by no op). Not modelled: cuBLASLt's 1 MiB workspace (a bf16 linear
layer with a bias), autocast's CUDA-only op lists (CUDA runs e.g. ``softmax`` and ``sum`` in fp32 under
autocast, CPU does not), GradScaler's few scalars, and CUDA's choice among attention kernels (the CPU
flash kernel saves the same ``out``/``logsumexp`` tensors as CUDA's flash and cuDNN kernels; CUDA's math
fallback would save the T×T matrix). ``benchmarks/validate_cuda.py`` measures what is left against the
device's allocator (docs/gpu-check.md).

A module compiled with torch.compile (inductor) runs, during the simulation, as inductor runs it: its
forward and backward traced and partitioned as compile does, their graphs run op by op with inductor's
fused kernels and buffer reuse (`_estimating.compiled`).

The batch is real, though, and so the step takes the branches the real batch takes: a Python value read
from a tensor (``.item()``, ``bool(mask.all())``) that depends only on the batch and on constants (the
attention mask, positions built with ``torch.arange``) is computed for real on small "shadow" copies, and
so is the shape of a boolean-mask selection; transformers' ``is_tracing`` is told that the simulation's
fake tensors are no trace (see `_estimating.shadow`). Any other value read, one that depends on the
weights (a NaN check on the loss), is a placeholder: ``1`` for numbers, ``False`` for booleans.
Data-dependent shapes of values that are not known (``nonzero`` of an activation: a mixture-of-experts
layer that picks its experts' tokens one expert at a time) are taken from one real forward of the batch,
run without autograd on the real weights (`_estimating.routing`), and the step is simulated again with
them; weights on the meta device show none, and the step raises `NotImplementedError`, naming the op and
the module and what to do instead.

This module is the entry: `estimate_memory` (its ``step=``, or its keywords made one `Step`),
`estimate_step` and `counted_step`, and the shortcut for deep stacks of identical blocks
(`_estimating.repeated`). The step itself is `_estimating.fake_step.simulate_step`; it fakes the model
and the batch with `_estimating.fake_model`, builds the optimizers with `_estimating.fake_optimizers`,
counts with `_estimating.fake_tracker` (`TimelineEvent`, `cublas_workspace_bytes`) and takes its dtypes
from `_estimating.precision` (`PRECISION_DTYPES`).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

from lightning_memkit._breakdown import MemoryBreakdown
from lightning_memkit._checkpointing.policies import CheckpointPlan
from lightning_memkit._estimating import repeated
from lightning_memkit._estimating.compiled import compiled_modules
from lightning_memkit._estimating.fake_optimizers import OptimizerLike
from lightning_memkit._estimating.fake_step import simulate_step
from lightning_memkit._estimating.fake_tracker import _SimTracker
from lightning_memkit._estimating.lightning_step import is_lightning, lightning_stand_ins, without_parameters
from lightning_memkit._sharding import layout as _layout
from lightning_memkit._step import Lever, Sharding, Step

__all__ = [
    "counted_step",
    "estimate_memory",
    "estimate_step",
]


def estimate_memory(
    model: nn.Module,
    batch: Any,
    *,
    optimizer: OptimizerLike | None = None,
    loss_fn: Callable[[Any, Any], Tensor] | None = None,
    precision: str = "32-true",
    checkpointing: str | CheckpointPlan | None = None,
    device: str | torch.device = "cuda",
    first_step: bool = False,
    accumulating: bool = False,
    lever: Lever | None = None,
    strategy: str | None = None,
    world_size: int = 1,
    sharding: Sharding | None = None,
    compile_budget: float | None = None,
    step: Step | None = None,
    timeline: bool = False,
) -> MemoryBreakdown:
    """The peak memory of one training step of ``model`` on ``batch``, by category, without running it.

    The step runs on fake tensors (see the module docstring), so nothing proportional to the model or the
    batch is allocated.

    Side effects. The user's step code runs once more (``training_step``, or ``forward`` and ``loss_fn``),
    on fake tensors, and what it can leave behind is put back: the parameters and
    buffers are fake twins during the step, so the real ones (BatchNorm's statistics among them) are never
    written; the real gradients are set aside, not copied, and given back; the train/eval flag of every
    submodule; torchmetrics states (values and ``update`` counts); the contents of the public ``list``,
    ``dict``, ``set`` and ``deque`` attributes of every submodule (``self.outputs.append(loss)``); the RNG
    streams (torch's CPU and CUDA generators, Python's ``random``, NumPy's global state); and torch.compile,
    which neither compiles nor skips a frame for the simulation. Not restored: any other attribute the step
    rebinds (``self.calls += 1``), attributes whose name starts with ``_``, objects outside the module
    (globals, files, loggers). ``self.log``/``self.log_dict`` do nothing during the step.

    How the step runs is given either as one `Step` (``step=``) or by the keywords ``precision`` to
    ``compile_budget`` (the short forms, `Step.of`'s); a step keyword set beside ``step=`` is a
    `TypeError` naming it.

    Args:
        model: a ``LightningModule`` — its ``training_step(batch, 0)`` and ``configure_optimizers()`` run
            as written, in the order of Lightning's automatic optimization (training_step, zero_grad,
            backward, step) — or a plain ``nn.Module``, stepped as ``loss_fn(model(input), target)`` with
            ``input, target = batch``, then backward, step, zero_grad. Its parameters may be real or on
            the meta device.
        batch: what ``training_step`` receives, or ``(input, target)`` for a plain module. Its values are
            read (on copies, never changed) where the step branches on them, e.g. on the attention mask;
            its tensors may be on the meta device, and the step then takes placeholder branches.
        optimizer: overrides ``configure_optimizers``: an optimizer name (``"adamw"``, ``"sgd"``,
            ``"sgd_momentum"``, ``"adafactor"``, or bitsandbytes' ``"adamw8bit"``, ``"paged_adamw8bit"``,
            ``"lion"``, ``"lion8bit"``, each with its defaults), a factory ``params -> Optimizer``, or an
            optimizer built over ``model.parameters()`` (its class and hyperparameters are copied).
            Required for a plain module. An optimizer whose ``step`` needs a closure (``torch.optim.LBFGS``)
            is stepped as ``step(closure)``, the closure running the forward and backward (in Lightning's
            order: training_step, zero_grad, backward); the optimizer calls it as often as its logic
            decides on the placeholder values: LBFGS without line search twice (its first evaluation and
            one after its first update, with its direction and history alive: the step's peak), with
            ``line_search_fn="strong_wolfe"`` up to ``max_eval`` times, along the search's longest path
            (high: +16 % on a small MLP, and that many simulated passes). LBFGS's curvature history is
            counted at its steady-state size, ``history_size`` pairs of flattened-parameter vectors; with
            ``first_step=True``, the pairs the first step's later inner iterations add are not counted.
        loss_fn: ``(output, target) -> loss`` for a plain module; not used for a LightningModule.
        precision: a Lightning precision string: ``"32-true"``, ``"16-mixed"``, ``"bf16-mixed"``,
            ``"16-true"``, ``"bf16-true"``, ``"64-true"``.
        checkpointing: ``None`` (or ``"none"``): the model as written. A mode (``"full"``,
            ``"selective"``, ``"selective_half"``) for every block `find_blocks` finds, or a
            `CheckpointPlan` / ``{module name: mode}`` mapping: applied with `apply_checkpointing` for
            the simulation only, and undone after it.
        device: the device type to plan for, ``"cuda"`` (the default: 512-byte allocator blocks, foreach
            optimizer kernels) or ``"cpu"``.
        first_step: estimate the first step, before the optimizer has state, instead of the steady state.
        accumulating: estimate the last micro-batch of a gradient accumulation cycle
            (``accumulate_grad_batches > 1``), the cycle's highest: its backward adds to gradients that
            are already there (no ``zero_grad`` before it), then the optimizer steps.
        lever: what changes the optimizer step (`Lever`), or ``None``. ``"release_gradients"``: the
            gradients are freed as soon as the optimizers have stepped (`release_gradients`,
            `GradientRelease`): a LightningModule's forward then runs without the previous step's
            gradients, which Lightning's order (training_step, zero_grad, backward) otherwise keeps
            through it. A plain module's step (zero_grad after the step) is the same. With
            ``strategy="fsdp2"``: each rank's sharded gradients. ``"fused_step"``: each parameter is
            stepped inside backward as soon as its gradient is complete, and the gradient freed
            (`fuse_optimizer_step`, `FusedOptimizerStep`): no step holds all the gradients. Not with
            ``accumulating`` (it steps at every backward), nor with an optimizer that needs a closure.
            With ``strategy="fsdp2"``: each shard steps once its reduce-scatter is done. ``"offload"``:
            the optimizers keep their state, fp32 master weights and the gradients' accumulation in host
            memory (`offload_optimizer`, `OptimizerOffload`): each gradient leaves the device as it
            completes. On ``device="cuda"`` the host's bytes are not counted; on ``"cpu"`` they are the
            same memory, and are. Not with ``strategy`` (FSDP2's own is ``CPUOffloadPolicy``).
        strategy: ``"fsdp2"``: one rank's step under FSDP2, ``fully_shard`` on each block `find_blocks`
            finds and then on the whole model (the layout Lightning documents), over ``world_size`` ranks:
            the real FSDP2 step runs on a copy of the model, on fake tensors over torch's fake process
            group (in this process; it must have no process group of its own), so the root's and the
            running layer's unsharded parameters, a layer's unsharded gradient before its reduce-scatter
            and the padding of uneven shards are all counted. ``batch`` is one rank's micro-batch. The
            CPU's FSDP2 step is simulated: on CUDA, prefetching on a second stream can keep one more
            layer's parameters unsharded than counted here. ``None`` (default): one device.
        world_size: the number of ranks the model is sharded over, with ``strategy``.
        sharding: one rank of FSDP2's layout as a `Sharding`, instead of ``strategy`` and ``world_size``
            (which may only repeat it): its ``world_size``; ``reshard_after_forward`` and ``mp_policy``, as
            ``fully_shard`` takes them (``MixedPrecisionPolicy(param_dtype=torch.bfloat16,
            reduce_dtype=torch.float32)``: all-gathered and computed in bf16, gradients reduce-scattered in
            fp32); ``tensor_parallel_size``, the ranks of one tensor-parallel group (Lightning's
            ``ModelParallelStrategy``'s word: ``world_size // tensor_parallel_size`` ranks each take their own
            ``batch``; without ``parallelize_fn`` each block's projections are split as torchtitan splits
            LLaMA's, query, key, value, gate and up by column, output and down by row, `_sharding.layout.
            tp_plan`, then FSDP2 shards over the data-parallel ranks); ``replicate_size``, HSDP's replicas
            (``fully_shard`` over a (replicate, shard) mesh); ``parallelize_fn``, ``fn(model, device_mesh)``
            that applies the layout (Fabric's word), run on the simulated copy of ``model`` with a fake mesh
            named ``("data_parallel", "tensor_parallel")`` as Lightning hands ``self.device_mesh`` to
            ``configure_model`` (a mesh it builds with ``init_device_mesh`` is a fake one of the same world;
            ``ConfigureModel()`` runs a LightningModule's own ``configure_model``).
        compile_budget: for a model with compiled modules (``torch.compile(module)`` or
            ``module.compile()``, inductor's backend): torch.compile's ``activation_memory_budget`` to
            simulate, the share of the activations its partitioner may keep (0 to 1); ``None``: as
            configured (``torch._functorch.config``). Each such module's step is simulated as inductor runs
            it (`_estimating.compiled`: the code inductor generates for it, run with its kernels stubbed),
            at any budget.
        step: how the step runs, as one value (`Step`, its layout a `Sharding`), instead of the keywords
            ``precision`` to ``compile_budget``.
        timeline: also record the step op by op, as the result's ``timeline`` (a list of
            `TimelineEvent`); the whole step is then simulated, even a deep stack of identical blocks.

    Returns:
        The `MemoryBreakdown` at the step's peak, in bytes, with ``parameters``, ``gradients``,
        ``optimizer_state``, ``activations`` and ``temporary`` as `measure` defines them (one rank's with
        a `Sharding`), and with ``timeline=True`` its ``timeline``.

    Example::

        with torch.device("meta"):
            model = GPTLightningModule("llama-7b")
        x = torch.zeros(1, 2048, dtype=torch.long, device="meta")
        print(estimate_memory(model, (x, x), precision="bf16-mixed"))
        print(estimate_memory(model, (x, x), step=Step(precision="bf16-mixed", checkpointing="full")))
    """
    if (empty := without_parameters(model)) is not None:
        raise ValueError(f"estimate_memory: {empty}")
    step, run = Step.split(
        dict(
            optimizer=optimizer,
            loss_fn=loss_fn,
            device=device,
            step=step,
            precision=precision,
            checkpointing=checkpointing,
            accumulating=accumulating,
            first_step=first_step,
            lever=lever,
            strategy=strategy,
            world_size=world_size,
            sharding=sharding,
            compile_budget=compile_budget,
        )
    )
    # configure_model runs on the simulated copy
    runs_it = step.sharding is not None and isinstance(step.sharding.parallelize_fn, _layout.ConfigureModel)
    if not runs_it and _configure_model_pending(model):
        name = type(model).__name__
        warnings.warn(
            f"estimate_memory: {name} overrides configure_model, which a Trainer runs before the first step, "
            "and no Trainer is attached: the step simulated is the module as it is now (a model that "
            f"configure_model compiles is simulated eagerly). Call {name}.configure_model() first, as the "
            "Trainer will, or estimate from a callback once fit has started.",
            stacklevel=2,
        )
    return estimate_step(model, batch, step, **run, timeline=timeline)


def _configure_model_pending(model: nn.Module) -> bool:
    """Whether ``model`` is a LightningModule whose ``configure_model`` a Trainer has yet to run and would
    change: the hook overridden, no Trainer attached, nothing compiled yet, and the hook, run on a copy of
    the module (its parameters and buffers on the meta device: nothing copied), builds, replaces or
    compiles a module there. Where the copy or the hook fails, it cannot be known: pending."""
    from lightning.pytorch.utilities.model_helpers import is_overridden

    if not (is_lightning(model) and model._trainer is None and is_overridden("configure_model", model)):
        return False
    if compiled_modules(model):
        return False

    def layout(module: nn.Module) -> list:
        modules = [(name, type(m)) for name, m in module.named_modules()]
        return [*modules, *((name, p.shape) for name, p in module.named_parameters())]

    memo: dict[int, Any] = {id(b): b.detach().to("meta") for b in model.buffers()}
    memo |= {id(p): nn.Parameter(p.detach().to("meta"), p.requires_grad) for p in model.parameters()}
    try:
        twin = copy.deepcopy(model, memo)
        before = layout(twin)
        meta = torch.device("meta")
        with meta, lightning_stand_ins(twin, meta), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            twin.configure_model()
    except Exception:
        return True
    return layout(twin) != before or bool(compiled_modules(twin))


def estimate_step(
    model: nn.Module,
    batch: Any,
    step: Step,
    *,
    optimizer: OptimizerLike | None = None,
    loss_fn: Callable[[Any, Any], Tensor] | None = None,
    device: str | torch.device = "cuda",
    timeline: bool = False,
) -> MemoryBreakdown:
    """`estimate_memory` of a `Step` (the planners' and callbacks' form: one value for how the step runs)."""
    simulate = functools.partial(
        simulate_step, model, batch, step, optimizer=optimizer, loss_fn=loss_fn, device=device
    )
    shortcut = None if timeline else _shortcut(model, step, optimizer, simulate)
    if shortcut is not None:
        return shortcut.breakdown
    tracker = simulate(timeline=timeline)
    breakdown = tracker.breakdown()
    if timeline:
        assert tracker.timeline is not None
        return dataclasses.replace(breakdown, timeline=tracker.timeline)
    return breakdown


def _shortcut(
    model: nn.Module, step: Step, optimizer: Any, simulate: Callable[..., _SimTracker], *, count: bool = False
) -> repeated.Shortcut | None:
    """A deep stack of identical blocks: its step from three shallow ones (``simulate``'s), exactly, or
    ``None`` (`_estimating.repeated`). Not for an optimizer built over the whole model's parameters, nor
    for a per-block checkpointing plan (the blocks would not run alike)."""
    if isinstance(optimizer, torch.optim.Optimizer) or not (
        step.checkpointing is None or isinstance(step.checkpointing, str)
    ):
        return None
    if compiled_modules(model):  # a compiled module's graph is traced whole: no shallow copies of it
        return None
    # A routed step runs each block by its own routing: its shallow steps do not predict it.
    shallow = functools.partial(simulate, history=True, follow_routing=False)
    return repeated.shortcut(model, shallow, count=count)


def counted_step(model: nn.Module, batch: Any, step: Step, **kwargs: Any) -> tuple[MemoryBreakdown, int, int]:
    """`estimate_step`'s breakdown (same arguments but ``timeline``), with the step's FLOPs and
    its forward and backward ops: for deep stacks of identical blocks from three shallow steps too."""
    simulate = functools.partial(simulate_step, model, batch, step, **kwargs, timeline=True)
    shortcut = _shortcut(model, step, kwargs.get("optimizer"), simulate, count=True)
    if shortcut is not None:
        assert shortcut.flops is not None and shortcut.ops is not None
        return shortcut.breakdown, shortcut.flops, shortcut.ops
    with FlopCounterMode(display=False) as counter:
        tracker = simulate()
    assert tracker.timeline is not None
    ops = sum(event.phase in ("forward", "backward") for event in tracker.timeline)
    return tracker.breakdown(), counter.get_total_flops(), ops
