"""The memory advisor: where a step's peak goes that it need not, in bytes, each with its fix.

`advise` simulates the step as configured (the same fake-tensor step as `estimate_memory`, with a `Tracer`
recording what created each storage), reads what is live at the peak, and prices each fix by simulating
the step again with the fix applied. A finding's ``saved`` is therefore the drop of the whole step's
peak, not the size of the waste: a fix that removes bytes from a moment other than the peak saves less
than it removes, and says so.

Findings (each only where it saves something):

- ``gradients``: the previous step's gradients alive through the forward (Lightning's order: the next
  step's ``zero_grad`` comes after ``training_step``), or every gradient alive at the optimizer step.
  Fix: `GradientRelease` or `FusedOptimizerStep`.
- ``untrained_gradients``: parameters that get a gradient no optimizer steps. Fix: ``requires_grad_(False)``.
- ``unused_parameters``: trainable parameters this batch's loss does not reach (no gradient). Fix: remove
  them, if no batch reaches them.
- ``stale_optimizer_state``: optimizer state kept for parameters that no longer train.
- ``optimizer_state``: where part of the model is frozen (LoRA, QLoRA), AdamW's fp32 moments of the
  parameters that train (the adapters; the frozen base has none). Fix: bitsandbytes' 8-bit AdamW, or its
  paged variant, each priced by simulating the step with it.
- ``logits``: the logits, their float32 copies and their gradients at the peak. Fix: a chunked loss
  (`chunked_cross_entropy`).
- ``activations``: what is saved for backward at the peak, by block and by op, with the checkpointing plan
  that removes it and its recompute cost.
- ``fragmentation`` (CUDA): memory the caching allocator reserved beyond the peak allocated, and retries.
  Fix: ``expandable_segments``.
"""

from __future__ import annotations

import contextlib
import inspect
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_memkit._breakdown import MemoryBreakdown, format_bytes
from lightning_memkit._checkpointing.blocks import find_blocks
from lightning_memkit._checkpointing.planner import CheckpointPlanner
from lightning_memkit._checkpointing.policies import CheckpointPlan
from lightning_memkit._diagnosis.loss_code import LOSS_CHUNKS, chunked_loss_code
from lightning_memkit._diagnosis.report import render_table
from lightning_memkit._estimating.fake_optimizers import OptimizerLike
from lightning_memkit._estimating.fake_step import simulate_step
from lightning_memkit._estimating.optimizer_state import BNB_MIN_8BIT_SIZE
from lightning_memkit._estimating.simulate import estimate_step
from lightning_memkit._estimating.trace import Tracer
from lightning_memkit._measuring.storages import state_tensors, storage_bytes
from lightning_memkit._optimizers.swap import bitsandbytes_installed, identify, own_optimizer
from lightning_memkit._step import Lever, Step

__all__ = ["Advice", "Finding", "advise"]

#: A caching allocator holding this share of its reserve beyond the peak is called fragmented.
FRAGMENTED = 0.05


@dataclass(frozen=True)
class Finding:
    """One way the step holds memory it need not.

    Attributes:
        kind: what sort of waste (see the module docstring): ``"gradients"``, ``"logits"``, ...
        what: what holds the memory, with its size.
        saved: bytes the step's peak drops by with the fix (simulated with the fix applied), except
            ``fragmentation``'s: the reserved bytes beyond the allocated peak.
        fix: the code or setting that applies it, and what it costs.
    """

    kind: str
    what: str
    saved: int
    fix: str


@dataclass(frozen=True)
class Advice:
    """What `advise` found: the step's breakdown and the findings, largest saving first."""

    breakdown: MemoryBreakdown
    #: the phase the peak is reached in: ``"forward"``, ``"zero_grad"``, ``"backward"`` or ``"optimizer"``
    peak_phase: str
    findings: tuple[Finding, ...] = field(default=())
    #: whose step: ``""`` (one device), or ``"one rank of N under FSDP2"`` (`Sharding.describe`)
    scope: str = ""

    def __iter__(self) -> Iterator[Finding]:
        return iter(self.findings)

    def __len__(self) -> int:
        return len(self.findings)

    def __getitem__(self, kind: str) -> Finding:
        """The finding of that kind: ``advice["gradients"]``."""
        for finding in self.findings:
            if finding.kind == kind:
                return finding
        raise KeyError(f"no {kind!r} finding; found: {', '.join(f.kind for f in self.findings) or 'none'}")

    def __contains__(self, kind: object) -> bool:
        return any(f.kind == kind for f in self.findings)

    def __str__(self) -> str:
        head = (
            f"Step peak {format_bytes(self.breakdown.peak)}{f' ({self.scope})' if self.scope else ''}, "
            f"reached in the {self.peak_phase} "
            f"({self.breakdown.in_words()})."
        )
        if not self.findings:
            return f"{head}\nNo waste found: every byte at the peak is needed by the step as configured."
        rows = []
        for i, f in enumerate(self.findings, 1):
            share = 100 * f.saved / max(self.breakdown.peak, 1)
            rows.append((str(i), format_bytes(f.saved), f"{share:.1f}%", f"{f.what}\nfix: {f.fix}"))
        table = render_table(("#", "saves", "of peak", "finding"), rows, left=("finding",), width=120)
        return f"{head}\n{table}"

    def as_dict(self) -> dict[str, Any]:
        """Plain types, for JSON: the breakdown (bytes), the peak's phase and the findings."""
        return {
            "breakdown": self.breakdown.as_dict(),
            "peak_phase": self.peak_phase,
            "scope": self.scope,
            "findings": [
                {"kind": f.kind, "what": f.what, "saved": f.saved, "fix": f.fix} for f in self.findings
            ],
        }


def advise(
    model: nn.Module,
    batch: Any,
    *,
    optimizer: OptimizerLike | None = None,
    loss_fn: Any = None,
    precision: str = "32-true",
    checkpointing: str | CheckpointPlan | None = None,
    device: str | torch.device = "cuda",
    accumulating: bool = False,
    lever: Lever | None = None,
    strategy: str | None = None,
    world_size: int = 1,
    memory_stats: Mapping[str, Any] | None = None,
    step: Step | None = None,
) -> Advice:
    """Name the memory a training step holds at its peak that it need not, with the bytes each fix saves.

    The step is simulated on fake tensors, as `estimate_memory` runs it (the same arguments, the same side
    effects: none), then again once per fix to price it: nothing is allocated and no GPU is needed.

    Args:
        model: the step as `estimate_memory` takes it, with ``batch``, ``optimizer``, ``loss_fn``,
            ``precision``, ``checkpointing``, ``device``, ``accumulating``, ``lever``, ``strategy``
            and ``world_size`` (``strategy="fsdp2"``: one rank's
            sharded step, each fix priced on it). An optimizer instance is also read for state it keeps for
            parameters that no longer train.
        memory_stats: ``torch.cuda.memory_stats()`` of a run, for the ``fragmentation`` finding (default:
            the current CUDA device's when ``device`` is CUDA and one is present).
        step: the step as one value (`Step`: any layout `estimate_memory` simulates, tensor parallelism
            and HSDP among them), instead of ``precision`` to ``world_size``; a step keyword set beside
            it is a `TypeError` naming it, as in `estimate_memory`.

    Returns:
        An `Advice`: ``print(advice)`` shows a table; ``advice.findings`` are largest saving first.
    """
    kwargs: dict[str, Any] = dict(
        optimizer=optimizer,
        loss_fn=loss_fn,
        precision=precision,
        checkpointing=checkpointing,
        device=device,
        accumulating=accumulating,
        lever=lever,
        strategy=strategy,
        world_size=world_size,
        step=step,
    )
    return advise_traced(model, batch, Tracer(model), memory_stats=memory_stats, **kwargs)[0]


def advise_traced(
    model: nn.Module,
    batch: Any,
    tracer: Tracer,
    *,
    history: Any = False,
    memory_stats: Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> tuple[Advice, Any]:
    """`advise` on the step simulated with ``tracer`` and ``history`` (`simulate_step`'s), returning the
    advice and that step's tracker: a caller that also records the step (`_diagnosis.snapshot`) simulates
    it once. ``kwargs`` are `advise`'s, with its defaults."""
    bound = inspect.signature(advise).bind(model, batch, memory_stats=memory_stats, **kwargs)
    bound.apply_defaults()
    kwargs = {k: v for k, v in bound.arguments.items() if k not in ("model", "batch", "memory_stats")}
    step, run = Step.split(kwargs)  # run: optimizer, loss_fn, device
    optimizer, device = run["optimizer"], run["device"]
    tracker = simulate_step(model, batch, step, tracer=tracer, history=history, **run)
    breakdown = tracker.breakdown()
    peak = breakdown.peak

    def peak_with(**changes: Any) -> int:
        """The peak of the same step with ``changes`` to it (a `Step`'s fields)."""
        return estimate_step(model, batch, step.but(**changes), **run).peak

    def step_with(optimizer: str) -> MemoryBreakdown:
        """The same step with the optimizer ``optimizer`` (a catalogue name) over the trainable parameters."""
        return estimate_step(model, batch, step, **{**run, "optimizer": optimizer})

    findings = [
        *_gradients(breakdown, tracer.peak_phase, step, peak_with),
        *_untrained(model, tracer, peak, peak_with),
        *_unused(tracer),
        *_stale_state(model, optimizer),
        *_optimizer_state(model, optimizer, breakdown, step, step_with),
        *_logits(model, tracker.peak_live, tracer, peak),
        *_activations(model, batch, tracker.peak_live, breakdown, step, run),
        *_fragmentation(memory_stats, torch.device(device)),
    ]
    findings = [f for f in findings if f.saved > 0]
    findings.sort(key=lambda f: -f.saved)
    scope = (
        ""
        if step.sharding is None
        else f"one rank of {step.sharding.world_size} under {step.sharding.describe()}"
    )
    return Advice(breakdown, tracer.peak_phase, tuple(findings), scope), tracker


# --------------------------------------------------------------------------------------------------
# The findings
# --------------------------------------------------------------------------------------------------


def _gradients(breakdown: MemoryBreakdown, phase: str, step: Step, peak_with: Any) -> list[Finding]:
    """The gradients alive where they need not be: through the next forward, or all at the step."""
    if step.accumulating or step.fused_step or step.offload or not breakdown.gradients:
        return []
    peak = breakdown.peak
    released = 0 if step.release_gradients else peak - peak_with(lever="release_gradients")
    try:
        fused = peak - peak_with(lever="fused_step")
    except (ValueError, NotImplementedError, TypeError):  # an optimizer the fused step refuses (LBFGS)
        fused = 0
    held = format_bytes(breakdown.gradients)
    release_fix = (
        "Trainer(callbacks=[GradientRelease()]) frees them once the optimizer has stepped "
        "(lightning_memkit.release_gradients(optimizer) in a plain loop); training is bit-identical"
    )
    fused_fix = (
        "Trainer(callbacks=[FusedOptimizerStep()]) steps each parameter as soon as its gradient is ready, "
        "so no moment holds them all (not with gradient clipping, accumulation, the fp16 scaler, DDP or "
        "tensor parallelism; under FSDP2 each shard steps after its reduce-scatter); training is "
        "bit-identical"
    )
    if released >= fused and released > 0:
        return [
            Finding(
                "gradients",
                f"the previous step's gradients ({held}) are alive through the forward (the step peaks in "
                f"the {phase}): Lightning zeroes them in the next step, after training_step",
                released,
                release_fix,
            )
        ]
    if fused > 0:
        other = f"; GradientRelease() saves {format_bytes(released)} without those limits" if released else ""
        return [
            Finding(
                "gradients",
                f"gradients ({held} at the peak, in the {phase}) are alive at once; stepping each parameter "
                "as its gradient is ready frees them as backward goes",
                fused,
                fused_fix + other,
            )
        ]
    return []


def _untrained(model: nn.Module, tracer: Tracer, peak: int, peak_with: Any) -> list[Finding]:
    """Parameters whose gradient no optimizer uses: priced by simulating them frozen."""
    if not tracer.untrained:
        return []
    names = [name for name, _ in tracer.untrained]
    with _frozen(model, names):
        saved = peak - peak_with()
    grads = sum(nbytes for _, nbytes in tracer.untrained)
    return [
        Finding(
            "untrained_gradients",
            f"{len(names)} parameter tensor(s) get gradients ({format_bytes(grads)}) that no optimizer "
            f"steps: {_names(names)}",
            saved,
            "freeze them before fit: for each, model.get_parameter(name).requires_grad_(False) (or give "
            "them to the optimizer if they should train)",
        )
    ]


@contextlib.contextmanager
def _frozen(model: nn.Module, names: list[str]) -> Iterator[None]:
    params = [model.get_parameter(name) for name in names]
    try:
        for p in params:
            p.requires_grad_(False)
        yield
    finally:
        for p in params:
            p.requires_grad_(True)


def _unused(tracer: Tracer) -> list[Finding]:
    """Trainable parameters the step's loss does not reach. ``saved`` is their weights' bytes: what removing
    them saves if no batch reaches them. The step as simulated (and `estimate_memory`) also counts
    gradients and optimizer state for them, as another batch that reached them would leave (a task's head,
    an expert routed elsewhere), which a parameter no batch reaches never gets."""
    if not tracer.unused:
        return []
    names = [name for name, _ in tracer.unused]
    nbytes = sum(n for _, n in tracer.unused)
    return [
        Finding(
            "unused_parameters",
            f"{len(names)} trainable parameter tensor(s) ({format_bytes(nbytes)}) get no gradient from this "
            f"batch's loss: {_names(names)}",
            nbytes,
            "if no batch reaches them, remove the modules that hold them (DDP also needs "
            "find_unused_parameters=True while they are there); a head for another task or an expert that "
            "other batches reach is not waste",
        )
    ]


def _stale_state(model: nn.Module, optimizer: Any) -> list[Finding]:
    """State an optimizer instance keeps for parameters that no longer train (frozen after it began)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        return []
    frozen = {id(p): name for name, p in model.named_parameters() if not p.requires_grad}
    kept = [p for p in optimizer.state if id(p) in frozen and optimizer.state[p]]
    if not kept:
        return []
    nbytes = storage_bytes(t for p in kept for t in state_tensors(optimizer.state[p]))
    names = [frozen[id(p)] for p in kept]
    return [
        Finding(
            "stale_optimizer_state",
            f"the optimizer keeps state ({format_bytes(nbytes)}) for {len(kept)} parameter tensor(s) that no "
            f"longer train: {_names(names)}",
            nbytes,
            "drop it when freezing: optimizer.state.pop(param) for each (or rebuild the optimizer over the "
            "trainable parameters)",
        )
    ]


def _optimizer_state(
    model: nn.Module, optimizer: Any, breakdown: MemoryBreakdown, step: Step, step_with: Any
) -> list[Finding]:
    """AdamW's state where part of the model is frozen (an adapter fine-tune: LoRA, QLoRA), and what
    bitsandbytes' 8-bit AdamW and its paged variant save, each simulated. Only there: the frozen base has
    no state, so the state is the adapters', and an 8-bit optimizer changes nothing else about the run; a
    full fine-tune's optimizer is `OptimizerSwap`'s to plan against a budget. Not for one rank under FSDP2
    (not simulated on sharded parameters) nor with the state offloaded to the host already."""
    if step.offload or step.sharding is not None or not breakdown.optimizer_state:
        return []
    params = list(model.parameters())
    trained = [p for p in params if p.requires_grad]
    if not trained or len(trained) == len(params) or _optimizer_kind(model, optimizer) != "adamw":
        return []
    if not bitsandbytes_installed():
        return []
    large = sum(1 for p in trained if p.numel() >= BNB_MIN_8BIT_SIZE)
    if not large:  # bitsandbytes keeps fp32 moments for them all: it saves torch's step counters only
        return []
    eight_bit, paged = step_with("adamw8bit"), step_with("paged_adamw8bit")
    saved = breakdown.peak - eight_bit.peak
    if saved <= 0:
        return []
    n = sum(p.numel() for p in trained)
    frozen = sum(p.numel() for p in params if not p.requires_grad)
    what = (
        f"AdamW's state of the {len(trained)} trainable parameter tensor(s) ({n:,} elements: the adapters; "
        f"the {frozen:,} frozen elements have no gradient and no state) is "
        f"{format_bytes(breakdown.optimizer_state)} at the peak, two fp32 moments per element; "
        f"{large} of the tensors have {BNB_MIN_8BIT_SIZE} elements or more, which bitsandbytes' 8-bit AdamW "
        "quantizes (the others keep fp32 moments)"
    )
    paged_saved = breakdown.peak - paged.peak
    fix = (
        "in configure_optimizers, return bitsandbytes.optim.AdamW8bit((p for p in self.parameters() if "
        "p.requires_grad), lr=...) with AdamW's lr, betas, eps and weight_decay: each moment block-wise "
        "quantized to uint8 with an fp32 scale per 256 elements, about 2 B per element instead of 8 (the "
        "update is close to AdamW's, not bit-identical); bitsandbytes.optim.PagedAdamW8bit keeps the same "
        f"state ({format_bytes(paged.optimizer_state)}) and saves {format_bytes(paged_saved)} as simulated: "
        "on CUDA its state is managed memory that the driver moves to host RAM only when the GPU runs out, "
        "so a step that would run out of memory slows down on page transfers instead, but a peak that fits "
        "is no lower; on a CPU it pages nothing. OptimizerSwap(budget=...) swaps the 8-bit one in only "
        "where a budget needs it"
    )
    return [Finding("optimizer_state", what, saved, fix)]


def _optimizer_kind(model: nn.Module, optimizer: Any) -> str | None:
    """The catalogue name of the optimizer the step runs (``optimizer``, else ``configure_optimizers``'s),
    or ``None`` when it is a factory or unknown."""
    if isinstance(optimizer, str):
        return optimizer
    if isinstance(optimizer, torch.optim.Optimizer):
        return identify(optimizer)
    return own_optimizer(model) if optimizer is None else None


def _logits(model: nn.Module, peak_live: list[Any], tracer: Tracer, peak: int) -> list[Finding]:
    held = [rec for rec in peak_live if rec.origin is not None and rec.origin.logits]
    if not held:
        return []
    nbytes = sum(rec.nbytes for rec in held)
    fp32 = sum(rec.nbytes for rec in held if rec.origin.dtype == torch.float32)
    saved = peak - tracer.peak_without_logits(LOSS_CHUNKS)
    return [
        Finding(
            "logits",
            f"{len(held)} tensors as wide as the vocabulary ({tracer.vocabulary}) are live at the peak: "
            f"the logits, their copies and gradients, {format_bytes(nbytes)} ({format_bytes(fp32)} in "
            "float32)",
            saved,
            f"compute the loss over {LOSS_CHUNKS} slices of the tokens, each slice's logits recomputed in "
            f"backward{chunked_loss_code(model, tracer.head)} (one more head matmul per token); or a smaller "
            "micro-batch",
        )
    ]


def _activations(
    model: nn.Module,
    batch: Any,
    peak_live: list[Any],
    breakdown: MemoryBreakdown,
    step: Step,
    run: Mapping[str, Any],
) -> list[Finding]:
    """What is saved for backward at the peak, by block and op, and the checkpointing that removes it."""
    if step.checkpointing == "full":
        return []
    saved_for_backward = [
        rec for rec in peak_live if rec.category is None and rec.grad_at is None and rec.saved_at is not None
    ]
    total = sum(rec.nbytes for rec in saved_for_backward)
    blocks = [name for name, _ in find_blocks(model)]
    if not total or not blocks:
        return []
    planner = CheckpointPlanner(model, batch, cost="flops", step=step.but(checkpointing=None), **run)
    if step.checkpointing in (None, "none"):
        planner.remember(planner.uniform("none"), breakdown)  # the step advised: no need to simulate it again
    full, selective = (planner.plan_for(planner.uniform(mode)) for mode in ("full", "selective"))
    assert full.peak is not None and selective.peak is not None
    saved = breakdown.peak - full.peak
    what = _saved_activations(saved_for_backward, total, blocks, step.precision)
    fix = (
        "Trainer(callbacks=[ActivationCheckpointing(checkpointing='full')]) recomputes every block's forward "
        f"in backward (+{100 * (full.overhead or 0):.1f}% of the blocks' compute)"
    )
    if 0 < breakdown.peak - selective.peak < saved:
        fix += (
            f"; checkpointing='selective' saves {format_bytes(breakdown.peak - selective.peak)} for "
            f"+{100 * (selective.overhead or 0):.1f}%; ActivationCheckpointing(budget=...) plans the "
            "cheapest mix for a budget"
        )
    if any(type(p).__name__ == "Params4bit" for p in model.parameters()):
        fix += (
            "; these percentages leave out the 4-bit base's matmuls (bitsandbytes' gemm_4bit has no FLOP "
            "formula), so the recompute cost reads low"
        )
    if any(not p.requires_grad for p in model.parameters()):  # an adapter run: the trap it must avoid
        fix += (
            "; its checkpoint is torch's non-reentrant one, so every adapter keeps its gradient (reentrant "
            "checkpointing, use_reentrant=True, gives none to the adapters of a block whose input needs no "
            "gradient, the first block over a frozen embedding)"
        )
    return [Finding("activations", what, saved, fix)]


def _saved_activations(saved_for_backward: list[Any], total: int, blocks: list[str], precision: str) -> str:
    """The ``total`` bytes saved for backward, by place and op, and what another dtype or kernel drops."""
    by_op: Counter[str] = Counter()
    in_blocks = scores = 0
    for rec in saved_for_backward:
        origin = rec.origin
        where = origin.where if origin is not None else ""
        block = next((b for b in blocks if where == b or where.startswith(b + ".")), None)
        in_blocks += rec.nbytes if block else 0
        by_op[origin.op if origin is not None else "input"] += rec.nbytes
        if origin is not None and "softmax" in origin.op and len(origin.shape) >= 2:
            scores += rec.nbytes if origin.shape[-1] == origin.shape[-2] else 0
    ops = ", ".join(f"{op} {100 * n / total:.0f}%" for op, n in by_op.most_common(4))
    what = (
        f"activations saved for backward: {format_bytes(total)} at the peak, "
        f"{format_bytes(in_blocks)} in {len(blocks)} blocks ({blocks[0]}, ...); by op: {ops}"
    )
    fp32 = sum(rec.nbytes for rec in saved_for_backward if rec.origin and rec.origin.dtype == torch.float32)
    if precision.endswith("-mixed") and fp32:
        what += f"; {format_bytes(fp32)} of them in float32 under {precision}"
    if scores:
        what += (
            f"; {format_bytes(scores)} are materialised attention scores (T x T softmax: eager attention, "
            "or scaled_dot_product_attention's math fallback here; its flash and memory-efficient kernels "
            "do not keep them)"
        )
    return what


def _fragmentation(stats: Mapping[str, Any] | None, device: torch.device) -> list[Finding]:
    """The caching allocator's reserve beyond the peak allocated (CUDA), and its retries."""
    if stats is None and device.type == "cuda" and torch.cuda.is_available():
        stats = torch.cuda.memory_stats(device if device.index is not None else None)
    if not stats:
        return []
    reserved = int(stats.get("reserved_bytes.all.peak", 0))
    allocated = int(stats.get("allocated_bytes.all.peak", 0))
    retries = int(stats.get("num_alloc_retries", 0))
    spare = reserved - allocated
    if spare <= 0 or (retries == 0 and spare < FRAGMENTED * reserved):
        return []
    return [
        Finding(
            "fragmentation",
            f"the caching allocator reserved {format_bytes(reserved)} for a peak of "
            f"{format_bytes(allocated)} allocated: {format_bytes(spare)} in blocks too fragmented to reuse"
            + (f", and it freed its cache {retries} time(s) to retry an allocation" if retries else ""),
            spare,
            "start the process with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (segments grow "
            "instead of being split)",
        )
    ]


def _names(names: list[str], shown: int = 3) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more
