"""`memory_snapshot`: a simulated step in torch's memory snapshot format, whose picture is the estimate.

The snapshot is read back here as torch's viewer reads it (MemoryViz.js's ``process_alloc_data``, replayed
in Python: blocks live from the trace's start, then each alloc and free) and must give `estimate_memory`'s
peak byte for byte, with the same bytes per category at that peak; torch's own tools must open it.
"""

from __future__ import annotations

import base64
import itertools
import json
import pickle
import pickletools
import re
import subprocess
import sys

import pytest
import torch
from helpers import cpu_trainer, run_cli, tiny_gpt
from zoo import ZooModule, zoo_batch

from lightning_memkit import estimate_memory, memory_snapshot
from lightning_memkit._breakdown import CATEGORIES
from lightning_memkit._diagnosis.snapshot import write_snapshot
from lightning_memkit._estimating.fake_tracker import cublas_workspace_bytes
from lightning_memkit.testing import AllocatorPeaks

#: The pickle opcodes MemoryViz.js's own unpickler reads (the web viewer throws on any other).
VIEWER_OPCODES = {
    "PROTO", "FRAME", "STOP", "MARK", "EMPTY_DICT", "EMPTY_LIST", "EMPTY_TUPLE", "DICT", "LIST", "TUPLE",
    "TUPLE1", "TUPLE2", "TUPLE3", "SETITEM", "SETITEMS", "APPEND", "APPENDS", "MEMOIZE", "BINPUT",
    "LONG_BINPUT", "BINGET", "LONG_BINGET", "BININT", "BININT1", "BININT2", "LONG1", "BINFLOAT",
    "SHORT_BINUNICODE", "BINUNICODE", "NEWTRUE", "NEWFALSE", "NONE",
}  # fmt: skip


def _frame(frames: list[dict], kind: str) -> str | None:
    return next((f["name"] for f in frames if f["filename"] == kind), None)


def _blocks(snapshot: dict):
    """(address, block) of every block of every segment, the address counted as the viewer does: the
    segment's address plus the sizes of the blocks before it."""
    for seg in snapshot["segments"]:
        addr = seg["address"]
        for b in seg["blocks"]:
            yield addr, b
            addr += b["size"]


def _replay(snapshot: dict):
    """Walk the trace as the viewer does: the blocks live from its start (freed with no alloc event, or live
    at the end without one), then every event. Yields the live dict {addr: (size, frames)} after each alloc
    (and once at the start); checks every free matches a live allocation."""
    trace = snapshot["device_traces"][0]
    allocated, start = set(), {}
    for e in trace:
        if e["action"] == "alloc":
            allocated.add(e["addr"])
        elif e["action"] == "free_completed":
            if e["addr"] in allocated:
                allocated.discard(e["addr"])
            else:
                start.setdefault(e["addr"], (e["size"], e["frames"]))
    for addr, b in _blocks(snapshot):
        if b["state"] == "active_allocated" and addr not in allocated:
            start[addr] = (b["requested_size"], b["frames"])
    live = dict(start)
    yield live
    for e in trace:
        if e["action"] == "alloc":
            assert e["addr"] not in live, "an address allocated twice"
            live[e["addr"]] = (e["size"], e["frames"])
            yield live
        elif e["action"] == "free_completed":
            size, _ = live.pop(e["addr"])
            assert size == e["size"]


def _peak(snapshot: dict) -> tuple[int, dict[str, int]]:
    """The highest total of allocated bytes, and the bytes by category (the frames') at its first moment."""
    best, at_best = -1, {}
    for live in _replay(snapshot):
        total = sum(size for size, _ in live.values())
        if total > best:
            best, at_best = total, dict(live)
    sums = dict.fromkeys(CATEGORIES, 0)
    for size, frames in at_best.values():
        sums[_frame(frames, "category")] += size
    return best, sums


def _viewer_peak(snapshot: dict) -> int:
    """The top of the viewer's "Active Memory Timeline": MemoryViz.js's ``annotate_snapshot`` (a
    free_requested followed by the free_completed of the same address becomes one ``free``) and
    ``process_alloc_data`` (its ``max_size``), replayed for device 0."""
    events: list[dict] = []
    for e in snapshot["device_traces"][0]:
        prev = events[-1] if events else None
        if (
            e["action"] == "free_completed"
            and prev
            and (prev["action"], prev["addr"]) == ("free_requested", e["addr"])
        ):
            events[-1] = {**prev, "action": "free"}
            continue
        events.append(e)
    elements, initially, actions, addr_to_alloc = [], [], [], {}
    for e in events:
        if e["action"] == "alloc":
            elements.append(e["size"])
            addr_to_alloc[e["addr"]] = len(elements) - 1
            actions.append(len(elements) - 1)
        elif e["action"] in ("free", "free_completed"):
            if e["addr"] in addr_to_alloc:
                actions.append(addr_to_alloc.pop(e["addr"]))
            else:
                elements.append(e["size"])
                initially.append(len(elements) - 1)
                actions.append(len(elements) - 1)
    for seg in snapshot["segments"]:
        assert seg["device"] == 0
    for addr, b in _blocks(snapshot):
        if b["state"] == "active_allocated" and addr not in addr_to_alloc:
            elements.append(b["requested_size"])
            initially.append(len(elements) - 1)
    current = set(initially)
    total = sum(elements[i] for i in initially)
    max_size = 0
    for i in actions:
        if i in current:
            current.discard(i)
            total -= elements[i]
        else:
            current.add(i)
            total += elements[i]
        max_size = max(max_size, total)
    return max_size


def _check_exact(snapshot: dict, estimate) -> None:
    peak, by_category = _peak(snapshot)
    assert peak == estimate.peak
    assert _viewer_peak(snapshot) == estimate.peak
    assert by_category == {c: getattr(estimate, c) for c in CATEGORIES}


@pytest.fixture(scope="module")
def gpt2():
    """The zoo's tiny GPT-2 (a model this project did not write), its batch, and per device its estimate
    and snapshot."""
    model, batch = ZooModule("gpt2"), zoo_batch("gpt2")
    steps = {}
    for device in ("cpu", "cuda"):
        steps[device] = (
            estimate_memory(model, batch, device=device),
            memory_snapshot(model, batch, device=device),
        )
    return model, batch, steps


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_peak_and_categories_are_the_estimates(gpt2, device):
    _, _, steps = gpt2
    estimate, snapshot = steps[device]
    _check_exact(snapshot, estimate)


def test_cuda_counts_cublas_workspaces_and_rounds_to_blocks(gpt2):
    _, _, steps = gpt2
    _, snapshot = steps["cuda"]
    workspaces = [
        (b["requested_size"], b["frames"])
        for _, b in _blocks(snapshot)
        if "cuBLAS" in (_frame(b["frames"], "tensor") or "")
    ]
    assert [size for size, _ in workspaces] == [cublas_workspace_bytes()]
    assert _frame(workspaces[0][1], "category") == "temporary"
    assert _frame(workspaces[0][1], "phase") == "before the step"
    sizes = [e["size"] for e in snapshot["device_traces"][0]]
    assert all(size % 512 == 0 for size in sizes)
    cpu_sizes = [e["size"] for e in steps["cpu"][1]["device_traces"][0]]
    assert any(size % 512 for size in cpu_sizes)  # the CPU allocator does not round


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(device="cpu"),  # CPU flash attention's own buffers, as the CPU kernels' high points
        dict(device="cpu", precision="bf16-mixed"),
        dict(device="cuda", checkpointing="selective"),
        dict(device="cuda", first_step=True),
        dict(device="cuda", lever="fused_step"),
        dict(device="cpu", checkpointing="full", accumulating=True),
        pytest.param(dict(device="cpu", strategy="fsdp2", world_size=2), marks=pytest.mark.slow),
    ],
    ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()),
)
def test_the_gpt_example_is_exact(kwargs, one_thread):
    model, _, batch = tiny_gpt()
    _check_exact(memory_snapshot(model, batch, **kwargs), estimate_memory(model, batch, **kwargs))


class _SavedLater(torch.nn.Module):
    """A forward whose peak holds a tensor autograd saves only after another op: temporary at the peak
    (saved by the op that consumes it, it would count as saved there: autograd saves inputs before the
    kernel runs)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        big = x * 2
        small = big[: x.shape[0] // 4] * 3  # the peak: x, big and small
        del big
        shift = x.mean()  # an op in between
        return small * self.w + shift  # saves small for w's gradient


def test_categories_are_the_ones_at_the_peak():
    model, x = _SavedLater(), torch.randn(1024, 256)
    kwargs = dict(optimizer="sgd", loss_fn=lambda out, _: out.sum(), device="cpu")
    estimate = estimate_memory(model, (x, x), **kwargs)
    snapshot = memory_snapshot(model, (x, x), **kwargs)
    _check_exact(snapshot, estimate)
    small = next(e["frames"] for e in snapshot["device_traces"][0] if e["size"] == 256 * 256 * 4)
    assert _frame(small, "op") == "mul -> float32[256, 256]"
    assert _frame(small, "category") == "temporary"  # an activation only after the peak
    assert estimate.activations == 0


def test_cpu_kernels_own_buffers_are_allocations():
    model, _, batch = tiny_gpt()
    trace = memory_snapshot(model, batch, device="cpu")["device_traces"][0]
    kernels = [e for e in trace if e["action"] == "alloc" and "own buffers" in e["frames"][0]["name"]]
    assert kernels
    assert all(_frame(e["frames"], "category") == "temporary" for e in kernels)
    assert {_frame(e["frames"], "module") for e in kernels} >= {"model.blocks.0.attn"}


def test_torch_viewer_takes_it(gpt2, tmp_path):
    _, _, steps = gpt2
    _, snapshot = steps["cuda"]
    html = torch.cuda._memory_viz.trace_plot(snapshot)
    assert "MemoryViz.js" in html and "Active Memory Timeline" in html
    embedded = json.loads(re.search(r"const local_files = (\[.*\])", html).group(1))[0]["base64"]
    assert pickle.loads(base64.b64decode(embedded)) == snapshot
    assert "Allocator State History" in torch.cuda._memory_viz.segment_plot(snapshot)
    assert "total_allocated" in torch.cuda._memory_viz.segsum(snapshot)  # its accounting asserts hold
    assert "TOTAL MEM" in torch.cuda._memory_viz.trace(snapshot)
    # The web viewer unpickles in JavaScript: protocol 2 to 4, and only the opcodes it knows.
    path = tmp_path / "step.pickle"
    write_snapshot(snapshot, path)
    ops = {op.name for op, _, _ in pickletools.genops(path.read_bytes())}
    assert ops <= VIEWER_OPCODES, ops - VIEWER_OPCODES
    assert pickle.loads(path.read_bytes()) == snapshot


@pytest.mark.slow
def test_torch_memory_viz_command_opens_it(gpt2, tmp_path):
    """``python -m torch.cuda._memory_viz``, in a fresh interpreter of a CPU-only torch as well."""
    _, _, steps = gpt2
    path = tmp_path / "step.pickle"
    write_snapshot(steps["cuda"][1], path)
    for command in (["trace_plot", str(path), "-o", str(tmp_path / "out.html")], ["stats", str(path)]):
        done = subprocess.run(
            [sys.executable, "-m", "torch.cuda._memory_viz", *command], capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
    assert "MemoryViz.js" in (tmp_path / "out.html").read_text()


def test_addresses_are_consistent(gpt2):
    _, _, steps = gpt2
    for _, snapshot in steps.values():
        (seg,) = snapshot["segments"]
        assert sum(b["size"] for b in seg["blocks"]) == seg["total_size"]
        assert seg["allocated_size"] == sum(
            b["requested_size"] for b in seg["blocks"] if b["state"] == "active_allocated"
        )
        end = seg["address"] + seg["total_size"]
        for live in _replay(snapshot):
            ranges = sorted((addr, addr + size) for addr, (size, _) in live.items())
            assert all(a_end <= b_start for (_, a_end), (b_start, _) in itertools.pairwise(ranges))
            assert not ranges or (ranges[0][0] >= seg["address"] and ranges[-1][1] <= end)
        assert all(e["time_us"] >= 0 for e in snapshot["device_traces"][0])
        times = [e["time_us"] for e in snapshot["device_traces"][0]]
        assert times == sorted(times)


def test_frames_name_modules_phases_and_tensors(gpt2):
    _, _, steps = gpt2
    _, snapshot = steps["cpu"]
    allocs = [e["frames"] for e in snapshot["device_traces"][0] if e["action"] == "alloc"]
    where = {(_frame(f, "phase"), _frame(f, "module")) for f in allocs}
    for phase in ("forward", "backward"):  # in backward: the module whose forward made the node
        assert (phase, "model.transformer.h.0.attn") in where
        assert (phase, "model.transformer.h.1.mlp.c_fc") in where
    assert {"forward", "backward", "optimizer"} <= {phase for phase, _ in where}
    grads = {_frame(f, "tensor") for f in allocs if _frame(f, "category") == "gradients"}
    assert "model.transformer.h.0.attn.c_attn.weight.grad float32[32, 96]" in grads
    assert any("(in MmBackward0)" in _frame(f, "op") for f in allocs if _frame(f, "op"))

    start = [b["frames"] for _, b in _blocks(snapshot) if b["state"] == "active_allocated"]
    start = [f for f in start if _frame(f, "phase") == "before the step"]
    named = {_frame(f, "tensor"): _frame(f, "category") for f in start}
    assert named["model.transformer.h.0.attn.c_attn.weight float32[32, 96]"] == "parameters"
    assert named["exp_avg of model.transformer.h.0.attn.c_attn.weight float32[32, 96]"] == "optimizer_state"
    # Lightning's order: the previous step's gradients live through the forward, freed at zero_grad
    freed = [e["frames"] for e in snapshot["device_traces"][0] if e["action"] == "free_completed"]
    old_grads = {_frame(f, "tensor") for f in freed if _frame(f, "phase") == "before the step"}
    assert "model.transformer.h.0.attn.c_attn.weight.grad float32[32, 96]" in old_grads


def test_it_observes_only():
    model, _, batch = tiny_gpt()
    model.eval()  # the step runs in train mode: each module's flag must come back
    before = {k: v.clone() for k, v in model.state_dict().items()}

    def flags():
        return [(m.training, [p.requires_grad for p in m.parameters(recurse=False)]) for m in model.modules()]

    before_flags = flags()
    memory_snapshot(model, batch, device="cpu")
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) and before[k].dtype == after[k].dtype for k in before)
    assert all(p.grad is None for p in model.parameters())
    assert flags() == before_flags


def test_writes_the_pickle_and_refuses_an_unknown_keyword(tmp_path):
    model, _, batch = tiny_gpt()
    path = tmp_path / "snap.pickle"
    snapshot = memory_snapshot(model, batch, path=path, device="cuda", optimizer="sgd")
    assert pickle.loads(path.read_bytes()) == snapshot
    assert path.read_bytes()[:2] == b"\x80\x04"  # protocol 4, whatever Python's default
    unknown = r"memory_snapshot\(\) got an unexpected keyword argument 'return_timeline'"  # not simulate_step
    with pytest.raises(TypeError, match=unknown):
        memory_snapshot(model, batch, return_timeline=True)
    with pytest.raises(TypeError, match=r"reshard_after_forward: .* sharding=Sharding\("):
        memory_snapshot(model, batch, strategy="fsdp2", world_size=2, reshard_after_forward=False)


def test_cli_writes_the_snapshot(tmp_path):
    path = tmp_path / "step.pickle"
    argv = [
        "estimate",
        "--model",
        "tiny",
        "--batch-size",
        "2",
        "--seq-len",
        "64",
        "--precision",
        "bf16-mixed",
    ]
    status, out, _ = run_cli([*argv, "--json", "--snapshot", str(path)])
    assert status == 0
    report = json.loads(out)
    peak, by_category = _peak(pickle.loads(path.read_bytes()))
    assert peak == report["simulated"]["peak"]
    assert by_category == {c: report["simulated"][c] for c in CATEGORIES}
    assert any(f"torch.cuda._memory_viz trace_plot {path}" in note for note in report["notes"])
    status, plain, _ = run_cli([*argv, "--json"])  # without the flag: the same figures, no snapshot note
    assert status == 0
    assert json.loads(plain)["simulated"] == report["simulated"]
    assert not any("_memory_viz" in note for note in json.loads(plain)["notes"])


@pytest.mark.slow
def test_a_7b_step_opens(tmp_path):
    """A 7B LLaMA step on the meta device, simulated in full on the CPU: the same figures as
    `estimate_memory`, which reads this deep model from three shallow steps (`_estimating.repeated`)."""
    from lightning_memkit.demos.gpt import GPTLightningModule

    with torch.device("meta"):
        model = GPTLightningModule("llama-7b")
    x = torch.zeros(1, 256, dtype=torch.long, device="meta")
    path = tmp_path / "llama-7b.pickle"
    snapshot = memory_snapshot(model, (x, x), path=path, precision="bf16-mixed", device="cuda")
    _check_exact(snapshot, estimate_memory(model, (x, x), precision="bf16-mixed", device="cuda"))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.cuda._memory_viz",
            "trace_plot",
            str(path),
            "-o",
            str(tmp_path / "o.html"),
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    modules = {_frame(e["frames"], "module") for e in snapshot["device_traces"][0]}
    assert "model.blocks.31.attn" in modules


def _steady_step_peak(module, tmp_path) -> int:
    """The allocator's peak of ``module``'s second Trainer step on the CPU (torch.profiler's memory
    timeline, `AllocatorPeaks`), as tests/estimating/test_zoo.py measures it: the steady step, which the
    snapshot simulates (the optimizer's state made, the previous step's gradients alive through the
    forward)."""
    peaks = AllocatorPeaks()
    cpu_trainer(tmp_path, peaks.around(), max_steps=2).fit(module)
    assert len(peaks.peaks) == 2
    return peaks.peaks[1]


@pytest.mark.slow  # two simulations and a profiled fit: 5-10 s each
@pytest.mark.parametrize("name", ["resnet", "gpt2"])
def test_the_snapshots_peak_is_the_allocators(name, tmp_path, one_thread):
    """The snapshot's highest running total is the estimate's peak, and that is the allocator's peak of
    the real steady step within test_zoo's tolerance (1 %): on the zoo's ResNet, whose oneDNN convolutions
    allocate reorders and scratchpads no dispatcher sees (`_measuring.kernels`; 28 % of a Conv2d step), and
    on its GPT-2 (CPU flash attention's per-thread buffers). All on one thread (those buffers count the
    threads), the snapshot made here rather than the ``gpt2`` fixture's, whose threads depend on the order
    the tests run in."""
    module, batch = ZooModule(name), zoo_batch(name)
    estimate = estimate_memory(module, batch, device="cpu")
    _check_exact(memory_snapshot(module, batch, device="cpu"), estimate)
    truth = _steady_step_peak(module, tmp_path)
    assert estimate.peak == pytest.approx(truth, rel=0.01)
