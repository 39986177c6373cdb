"""MemoryMonitor on compiled steps (issue 26, item 7): torch.compile as Lightning users apply it, in
``configure_model``, measured as exactly as an eager step, and the run left as it is without the monitor.

A compiled graph's generated code allocates its buffers where no dispatch mode sees them (inductor's
``empty_strided_cpu``): before, a compiled tiny LLaMA's step was logged 31 % over the allocator's peak, and
the tracker's own hooks, run from eager code inside a compiled call, were compiled by dynamo (graph breaks,
recompiles). The truths: the allocator's peak (`AllocatorPeaks`: torch.profiler's memory timeline in this
process; the CPU allocator's own count, `counting_allocator`, in a spawned one, where the profiler's timeline
misses the batch only generated kernels read), and each category read from its owners at the step's peak:
the parameters, ``.grad`` tensors and optimizer state, and what autograd saved (`saved_for_backward`).
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from helpers import Losses, cpu_trainer, spawn_ranks
from models import COMPILED_STEPS, CompiledCNN, CompiledDecoder
from torch import nn

from lightning_memkit import MemoryMonitor, measure
from lightning_memkit._measuring.patches import _COMPILED_ALLOCATORS
from lightning_memkit._measuring.storages import (
    gradient_tensors,
    model_tensors,
    optimizer_tensors,
    storage_bytes,
)
from lightning_memkit.testing import (
    AllocatorPeaks,
    allocator_peak,
    build_counting_allocator,
    counting_allocator,
    saved_for_backward,
)

STEPS = COMPILED_STEPS


class Owners(pl.Callback):
    """Every step's memory by owner when its forward ends, read from the tensors themselves: parameters and
    buffers, the last step's ``.grad`` tensors (Lightning frees them after the forward), optimizer state,
    and the further storages autograd saved for backward."""

    def __init__(self) -> None:
        self.steps: list[dict[str, int]] = []

    def on_before_zero_grad(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer) -> None:
        self.steps.append(
            {
                "parameters": storage_bytes(model_tensors(pl_module)),
                "gradients": storage_bytes(gradient_tensors(pl_module)),
                "optimizer_state": storage_bytes(optimizer_tensors(trainer.optimizers)),
            }
        )

    def on_before_backward(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor
    ) -> None:
        params = list(model_tensors(pl_module))
        saved = storage_bytes([*params, *saved_for_backward(loss)]) - storage_bytes(params)
        self.steps[-1]["activations"] = saved


def _fresh_compiler() -> None:
    """Every fit compiles from scratch, with dynamo's counters at zero."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()


def _compiler_counters() -> dict:
    """What torch.compile did: frames compiled (and how), graph breaks, recompiles, graphs."""
    counters = torch._dynamo.utils.counters
    return {key: dict(counters[key]) for key in ("frames", "graph_break", "recompiles", "stats")}


def _within(measured: int, truth: int, tolerance: float) -> bool:
    return abs(measured - truth) <= tolerance * truth


@pytest.mark.slow
def test_compiled_decoder_is_measured_as_the_allocator_records_it(tmp_path):
    """The issue's case: logged 31 % over the allocator (every buffer of the compiled graphs unseen, those
    an extern kernel writes or the graph returns counted from the step's start); now the peak within 0.1 %
    of the profiler's timeline and each category within 1 % of its owners' bytes at the steady peak, where
    the forward ends."""
    _fresh_compiler()
    peaks, owners, monitor = AllocatorPeaks(), Owners(), MemoryMonitor(plot=False, summary=False)
    cpu_trainer(tmp_path, [*peaks.around(monitor), owners], max_steps=STEPS).fit(CompiledDecoder())

    assert _compiler_counters()["frames"] == {"total": 1, "ok": 1}  # compiled whole, once
    assert [step for step, _ in monitor.history] == list(range(STEPS))
    for (step, breakdown), peak in zip(monitor.history, peaks.peaks, strict=True):
        assert _within(breakdown.peak, peak, 0.001), (step, breakdown.peak, peak)
    steady = list(zip(monitor.history, peaks.peaks, owners.steps, strict=True))[1:]
    for (step, breakdown), peak, owned in steady:
        held = sum(owned.values())
        assert _within(held, peak, 0.001), (step, owned, peak)  # the peak is where the forward ends
        for category, truth in owned.items():
            assert _within(getattr(breakdown, category), truth, 0.01), (step, category, breakdown, truth)
        assert abs(breakdown.temporary - (peak - held)) <= 0.001 * peak, (step, breakdown)
    assert monitor.measured_steps == 2  # the first step and the first with optimizer state; the rest twins


def _run_compiled(module: pl.LightningModule, tmp_path: Path, callbacks: list) -> dict:
    torch.manual_seed(0)
    _fresh_compiler()
    losses = Losses()
    cpu_trainer(tmp_path, [*callbacks, losses], max_steps=STEPS).fit(module)
    return {
        "losses": losses.losses,
        "state": {k: v.clone() for k, v in module.state_dict().items()},
        "rng": torch.get_rng_state(),
        "compiler": _compiler_counters(),
    }


@pytest.fixture
def one_thread():
    """One intra-op thread: with two, the compiled embedding's backward adds its rows in a varying order
    (two runs without any callback end with different weights)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
@pytest.mark.parametrize(
    "model", [partial(CompiledDecoder, attention_dropout=0.1), CompiledCNN], ids=["decoder", "cnn"]
)
def test_a_compiled_run_is_bit_identical_under_the_monitor(model, tmp_path, one_thread):
    """Observe-only under torch.compile: every loss, parameter, buffer (BatchNorm's statistics) and the RNG
    (attention dropout draws its seeds from it) as without the monitor, and torch.compile's own counters:
    the same frames, graph breaks, recompiles and graphs."""
    reference = _run_compiled(model(), tmp_path / "reference", [])
    monitor = MemoryMonitor(plot=False, summary=False)
    run = _run_compiled(model(), tmp_path / "monitored", [monitor])

    assert monitor.measured_steps == 2
    assert len(run["losses"]) == len(reference["losses"]) == STEPS
    for a, b in zip(run["losses"], reference["losses"], strict=True):
        assert torch.equal(a, b)
    for name, value in reference["state"].items():
        assert torch.equal(run["state"][name], value), name
    assert torch.equal(run["rng"], reference["rng"])
    assert run["compiler"] == reference["compiler"]
    assert reference["compiler"]["frames"].get("ok", 0) >= 1 and not reference["compiler"]["graph_break"]


def _cnn_rank(rank: int, out: Path) -> None:
    """The compiled CNN's fit under the CPU allocator's own count (installed before anything is built)."""
    counting_allocator()
    torch.set_num_threads(1)
    peaks, owners, monitor = (
        AllocatorPeaks(all_threads=True),
        Owners(),
        MemoryMonitor(plot=False, summary=False),
    )
    module = CompiledCNN()
    cpu_trainer(out, [*peaks.around(monitor), owners], max_steps=STEPS).fit(module)
    record = {
        "peaks": peaks.peaks,
        "history": [breakdown.as_dict() for _, breakdown in monitor.history],
        "owners": owners.steps,
        "frames": dict(torch._dynamo.utils.counters["frames"]),
    }
    (out / "record.json").write_text(json.dumps(record))


@pytest.mark.slow
def test_compiled_cnn_is_measured_as_the_allocator_counts_it(tmp_path):
    """A compiled CNN (convolutions as extern kernels, BatchNorm's statistics updated in the graph), against
    the CPU allocator's own count: the peak within 0.1 %, the parameters and optimizer state to the byte.
    Only a generated kernel reads the images (it copies them to channels-last): the monitor counts the batch
    from the step's start, as the allocator holds it (torch.profiler's timeline misses it: 4.5 % lower)."""
    build_counting_allocator()
    spawn_ranks(_cnn_rank, (tmp_path,), world=1, what="compiled CNN")
    record = json.loads((tmp_path / "record.json").read_text())

    assert record["frames"] == {"total": 1, "ok": 1}
    for step, (breakdown, peak, owned) in enumerate(
        zip(record["history"], record["peaks"], record["owners"], strict=True)
    ):
        assert _within(breakdown["peak"], peak, 0.001), (step, breakdown, peak)
        assert breakdown["parameters"] == owned["parameters"]
        if step > 0:  # the first step's state is born in its optimizer step
            assert breakdown["optimizer_state"] == owned["optimizer_state"]


class MLP(nn.Module):
    """(B, 64) -> (B, 64) through a GELU of 256 features, with its own ``forward`` to compile."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(64, 256), nn.Linear(256, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(nn.functional.gelu(self.up(x)))


def _step(net: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor):
    def step() -> None:
        net(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    return step


@pytest.mark.slow
def test_a_compiled_step_is_followed_buffer_by_buffer():
    """`measure` alone, on a compiled MLP's steady step: its peak is the allocator's, in AdamW's step where
    every gradient is live (it was 1.1 % over, at another moment: no gradients, 10 times the activations),
    and the generated code gets inductor's own allocators back afterwards."""
    from torch._inductor.codecache import PyCodeCache

    torch.manual_seed(0)
    net, x = MLP(), torch.randn(32, 64)
    net.compile()
    optimizer = torch.optim.AdamW(net.parameters())
    step = _step(net, optimizer, x)
    step()  # compiles, and makes the optimizer's state
    with measure(net, optimizer, batch=x) as measured:
        step()
    truth = allocator_peak(step)
    assert _within(measured.peak, truth, 0.001), (measured.breakdown, truth)
    assert measured.breakdown.gradients == storage_bytes(net.parameters())

    guards = torch._C._dynamo.guards
    for name in _COMPILED_ALLOCATORS:
        assert not hasattr(getattr(guards, f"_{name}"), "__wrapped__"), name
        for module in PyCodeCache.modules:
            assert not hasattr(vars(module).get(name), "__wrapped__"), (module.__name__, name)


def test_the_trackers_hooks_are_never_compiled():
    """``nn.Sequential.compile()`` compiles no frame of its own, but dynamo watches every frame its eager
    code calls: the tracker's saved-tensor hooks and weak-reference callbacks were compiled as frames (15
    frames, 6 graph breaks on this MLP; a tiny CNN's hit the recompile limit) and the step measured 26 %
    over."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    net.compile()
    optimizer = torch.optim.AdamW(net.parameters())
    x = torch.randn(32, 64)
    step = _step(net, optimizer, x)
    step()
    _fresh_compiler()
    with measure(net, optimizer, batch=x) as measured:
        step()
    assert _compiler_counters() == {"frames": {}, "graph_break": {}, "recompiles": {}, "stats": {}}
    assert _within(measured.peak, allocator_peak(step), 0.001)


class _TinyLM(nn.Module):
    """A tiny Hugging Face LLaMA (hidden size 32), compiled, returning its loss on the token ids."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        config = LlamaConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128,
        )  # fmt: skip
        self.model = torch.compile(LlamaForCausalLM(config))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, labels=ids).loss


@pytest.mark.slow  # compiles or plans: 15-50 s on 2 cores
def test_a_compiled_bf16_step_counts_what_its_matmuls_hide():
    """The code torch.compile generates calls its matmuls with ``out=`` (``extern_kernels.mm(a, b,
    out=buf)``), whose CPU kernels in bf16 can compute through fp32 copies no dispatcher sees, as the plain
    ``mm`` does: they were not counted, and this step read 1.9 % low, measured and estimated alike (found
    by benchmarks/validate_cuda.py's dry run: 3.7 % there). Against the allocator, the token ids added:
    only generated kernels read them, and the profiler misses them (the module docstring)."""
    from lightning_memkit import estimate_memory
    from lightning_memkit.testing import allocator_peak

    model = _TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(0))

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    step()
    truth = allocator_peak(step) + ids.untyped_storage().nbytes()
    with measure(model, optimizer, batch=ids) as measured:
        step()
    assert measured.breakdown.peak == pytest.approx(truth, rel=1e-3)
    estimate = estimate_memory(
        model, (ids, None), optimizer=optimizer, loss_fn=lambda loss, _: loss, device="cpu",
        precision="bf16-mixed",
    )  # fmt: skip
    assert estimate.peak == pytest.approx(truth, rel=1e-3)
