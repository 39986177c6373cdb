"""What MemoryMonitor, AutoFit and ``memkit`` say when a step does not fit: the phase, the need by category,
and plans that really fit (their code is run and the allocator's peak checked), on a pretend small device
(`PretendOOM`) on CPU."""

from __future__ import annotations

import re
import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from helpers import cpu_trainer, run_cli
from lightning.pytorch.loggers import CSVLogger
from models import BlockNet, tiny_lm

import lightning_memkit
from lightning_memkit import (
    CATEGORIES,
    AutoFit,
    FusedOptimizerStep,
    MemoryMonitor,
    estimate_memory,
    format_bytes,
    parse_budget,
)
from lightning_memkit._estimating.lightning_step import batch_slice
from lightning_memkit.callbacks import _oom_report
from lightning_memkit.demos.gpt import GPTDataModule, GPTLightningModule
from lightning_memkit.testing import AllocatorPeaks, PretendOOM

_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
_SIZE = r"([\d.]+ (?:B|KiB|MiB|GiB))"
#: the explanation's header line, its need line, and a plan's line
_HEADER = re.compile(r"^(\w+): out of memory in the (forward|backward|optimizer step) of step (\d+)", re.M)
_NEED = re.compile(rf"The step needs {_SIZE} \((measured|simulated)")
_PLAN = re.compile(
    rf"^  \d\. micro-batch (\d+) x accumulate (\d+), checkpointing (.+?), (\S+), (\S+): peak {_SIZE}", re.M
)


#: `BlockNet` over sequences: a step of a few dozen ops (planned in a second or two) whose activations, at 16
#: sequences of 64 positions, outweigh its parameters, gradients and AdamW state; 64 sequences whatever the
#: batch size
TOWER = dict(n_blocks=2, width=32, batch_size=16, samples=64, seq_len=64, optimizer="adamw")


def _tower(**changes) -> BlockNet:
    return BlockNet(**{**TOWER, **changes})


def _bytes(text: str) -> int:
    number, unit = text.split()
    return round(float(number) * _UNITS[unit])


def _needs(message: str) -> tuple[int, str, dict[str, int]]:
    """The stated need, how it is known, and the table's rows (bytes, to the table's rounding)."""
    need, source = _NEED.search(message).groups()
    rows = dict(re.findall(rf"^    ({'|'.join([*CATEGORIES, 'peak'])})\s+{_SIZE}", message, re.M))
    return _bytes(need), source, {name: _bytes(size) for name, size in rows.items()}


def _plan_code(message: str, number: int = 1) -> str:
    """Plan ``number``'s code: its indented lines, under its own line."""
    lines = message.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"  {number}. "))
    code = []
    for line in lines[start + 1 :]:
        if not line.startswith("       "):
            break
        code.append(line[7:])
    return "\n".join(code)


def _trainer(tmp_path, callbacks, **overrides) -> pl.Trainer:
    return cpu_trainer(tmp_path, callbacks, **{"max_steps": 2, "logger": False, **overrides})


def _fit_until_oom(tmp_path, module, callbacks, datamodule=None, **overrides):
    """Fit until the pretend device runs out; returns the error and the warnings' messages."""
    trainer = _trainer(tmp_path, callbacks, **overrides)
    with warnings.catch_warnings(record=True) as caught, pytest.raises(torch.OutOfMemoryError) as error:
        warnings.simplefilter("always")
        trainer.fit(module, datamodule=datamodule)
    explained = [str(w.message) for w in caught if "out of memory" in str(w.message)]
    return error.value, explained


def _monitor(**kwargs) -> MemoryMonitor:
    return MemoryMonitor(plot=False, summary=False, **kwargs)


def _csv(tmp_path) -> CSVLogger:
    return CSVLogger(tmp_path)


@pytest.mark.slow
def test_a_forward_oom_names_the_phase_the_need_and_plans_that_really_fit(tmp_path):
    """Step 1 needs more than the budget: the message says so, by category, simulated for its batch (step 0,
    without optimizer state, had another signature), and plan 1's code, run for real, peaks under the
    budget on the allocator."""
    torch.manual_seed(0)
    module = _tower()
    need = estimate_memory(module, next(iter(module.train_dataloader())), device="cpu")  # a later step's
    budget = int(0.8 * need.peak)
    pretend = PretendOOM(module, rows=15, batch_idx=1)  # batches of 16 are too much for the pretend device
    error, explained = _fit_until_oom(tmp_path, module, [_monitor(budget=budget)], logger=_csv(tmp_path))
    assert pretend.raised == 1 and str(error) == "out of memory (pretend: more than 15 samples)"
    (message,) = explained
    assert _HEADER.search(message).groups() == ("MemoryMonitor", "forward", "1")
    stated, source, rows = _needs(message)
    assert source == "simulated" and stated == pytest.approx(need.peak, abs=0.005 * 2**20)
    assert rows["peak"] == pytest.approx(stated, abs=0.005 * 2**20)
    assert sum(rows[c] for c in CATEGORIES) == pytest.approx(stated, abs=0.01 * 2**20)  # to the rounding
    assert (
        f"{format_bytes(need.peak - budget)} more than the {format_bytes(budget)} ({budget} bytes)" in message
    )
    plans = _PLAN.findall(message)
    assert 1 <= len(plans) <= 3
    limit = int(0.9 * budget)
    for m, accumulate, _, optimizer, precision, peak in plans:  # the global batch, optimizer, precision kept
        assert (int(m) * int(accumulate), optimizer, precision) == (16, "adamw", "32-true")
        assert _bytes(peak) <= limit
    assert f"AutoFit(budget={budget:_})" in message

    # Plan 1, as printed, run for real.
    namespace = {name: getattr(lightning_memkit, name) for name in lightning_memkit.__all__}
    namespace["Trainer"] = dict  # the code's Trainer arguments
    exec(_plan_code(message), namespace)
    arguments = namespace["trainer"]
    probe = AllocatorPeaks()
    kwargs = {k: v for k, v in arguments.items() if k != "callbacks"}
    trainer = _trainer(tmp_path, probe.around(*arguments.get("callbacks", [])), **kwargs)
    torch.manual_seed(0)
    trainer.fit(_tower(batch_size=namespace["batch_size"]))
    assert trainer.global_step == 2 and len(probe.peaks) == 2 * arguments["accumulate_grad_batches"]
    assert max(probe.peaks) <= budget, f"plan 1 peaked at {max(probe.peaks)}, over the budget of {budget}"


def test_a_backward_oom_after_measured_steps_gives_the_measured_need(tmp_path):
    """The GPT example, no budget on the CPU: the need is the breakdown measured on the step's twin and
    nothing is planned (the device's size is unknown)."""
    torch.manual_seed(0)
    module = GPTLightningModule(
        dict(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=32), max_steps=4
    )
    PretendOOM(module, rows=4, where="backward", layer=module.model.blocks[1], batch_idx=2)
    monitor = _monitor()
    data = GPTDataModule(batch_size=8, seq_len=16, num_sentences=100)
    _, (message,) = _fit_until_oom(
        tmp_path, module, [monitor], data, max_steps=4, logger=_csv(tmp_path), limit_val_batches=0
    )
    assert _HEADER.search(message).groups() == ("MemoryMonitor", "backward", "2")
    stated, source, rows = _needs(message)
    twin = monitor.history[-1][1]  # step 1's, measured: step 2 starts with the same gradients and state
    assert source == "measured" and monitor.measured_steps == 2
    assert {c: rows[c] for c in CATEGORIES} == pytest.approx(
        {c: getattr(twin, c) for c in CATEGORIES}, abs=0.01 * 2**20
    )
    assert stated == pytest.approx(twin.peak, abs=0.01 * 2**20)
    assert "no plan is made" in message and not _PLAN.search(message)


def test_an_oom_in_the_optimizer_step_is_named_so(tmp_path):
    class StepsOut(BlockNet):
        def on_before_optimizer_step(self, optimizer):  # after the callbacks' hook
            raise torch.OutOfMemoryError("out of memory in the update")

    _, (message,) = _fit_until_oom(tmp_path, StepsOut(**TOWER), [_monitor()], logger=_csv(tmp_path))
    assert _HEADER.search(message).groups() == ("MemoryMonitor", "optimizer step", "0")


def test_a_failure_to_explain_is_one_line_and_the_oom_propagates(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("the explainer broke")

    monkeypatch.setattr(_oom_report, "step_need", broken)
    module = _tower()
    pretend = PretendOOM(module, rows=8)
    error, (message,) = _fit_until_oom(tmp_path, module, [_monitor(budget=10**6)], logger=_csv(tmp_path))
    assert isinstance(error, torch.OutOfMemoryError) and pretend.raised == 1
    assert error.__context__ is None  # nothing was raised while handling it
    assert (
        message.count("\n") == 0 and "explaining it failed (RuntimeError('the explainer broke'))" in message
    )


def test_autofit_asks_the_monitor_to_explain_once_while_its_plan_is_applied(tmp_path):
    """AutoFit's plan fits by the estimate, yet the pretend device runs out in step 1: the monitor explains
    once, asked by AutoFit (first in the list) before it gives the user's settings back, so the need is the
    planned step's and the plans keep the global batch (16, not the micro-batch). The need fits by these
    figures, so the plans are for it: leaner than the plan that ran out."""
    module = _tower(n_blocks=1)  # no repeated blocks: micro-batch and optimizer are the levers
    whole = estimate_memory(module, next(iter(module.train_dataloader())), device="cpu")
    autofit = AutoFit(budget=int(0.97 * whole.peak / 0.9), cost="flops", verify_steps=0)  # 16 does not fit
    pretend = PretendOOM(module, rows=1, batch_idx=3)
    _, explained = _fit_until_oom(tmp_path, module, [autofit, _monitor()], logger=_csv(tmp_path))
    (message,) = explained
    plan = autofit.plan
    assert pretend.raised == 1 and plan.micro_batch_size < 16 and plan.accumulate_grad_batches > 1
    header = _HEADER.search(message).groups()
    assert header == ("MemoryMonitor", "forward", str(3 // plan.accumulate_grad_batches))
    assert f"(batch 3, {plan.micro_batch_size} samples)" in message
    stated, source, _ = _needs(message)
    # batch 3 adds to gradients already there (not a cycle's first): the micro-batch AutoFit planned for
    assert source == "simulated" and stated == pytest.approx(plan.estimated_peak, abs=0.005 * 2**20)
    assert "by these figures it fits" in message
    plans = _PLAN.findall(message)
    assert plans
    for m, accumulate, _, _, _, peak in plans:  # the same global batch, under the need
        assert int(m) * int(accumulate) == 16 and _bytes(peak) <= 0.9 * stated
    assert module.hparams.batch_size == 16  # AutoFit gave the user's batch size back after the explanation
    assert "AutoFit did not re-plan and retry: verify_steps=0 turns the recovery off." in message
    assert "Or give AutoFit these arguments, which make plan 1" in message  # not "add": it is there


def test_autofit_beside_the_fused_step_says_why_it_did_not_retry(tmp_path):
    """Beside FusedOptimizerStep, AutoFit cannot retry a step (the backward steps the parameters); the
    explanation said nothing of it and told the user to add the AutoFit the run had."""
    module = _tower(n_blocks=1)
    PretendOOM(module, rows=4)
    autofit = AutoFit(budget="1000GB", cost="flops")
    _, (message,) = _fit_until_oom(tmp_path, module, [autofit, FusedOptimizerStep()], logger=_csv(tmp_path))
    assert "AutoFit did not re-plan and retry: FusedOptimizerStep steps each parameter inside" in message
    assert "Or add AutoFit" not in message


_run = run_cli


def test_estimate_on_a_gpu_it_does_not_fit_prints_plans_that_do():
    argv = ["estimate", "--model", "models:tiny_lm", "--batch-size", "16", "--seq-len", "256"]
    status, out, err = _run([*argv, "--gpu", "1GiB"])
    assert status == 0, err
    assert re.search(r"^Fits: [\d.]+ MiB of the [\d.]+ MiB usable on 1GiB\.$", out, re.M)
    assert "Plans that fit" not in out
    status, out, err = _run([*argv, "--gpu", "588MiB"])  # ~8 MiB once the CUDA context and cuBLAS take theirs
    assert status == 0, err
    budget = parse_budget("588MiB", device_size=True)
    assert f"more than the {budget.usable / 2**20:.2f} MiB usable on 588MiB." in out
    plans = _PLAN.findall(out)
    assert plans and {p[2] for p in plans} == {"none"}  # nothing to checkpoint: the micro-batch is the lever
    with torch.device("meta"):
        model = tiny_lm()
    x = torch.zeros(16, 256, dtype=torch.long, device="meta")
    for m, accumulate, _, optimizer, _, peak in plans:
        simulated = estimate_memory(
            model, batch_slice((x, x), int(m)), optimizer=optimizer, accumulating=int(accumulate) > 1,
            loss_fn=lambda out, y: F.cross_entropy(out.flatten(0, -2), y.flatten()),
        )  # fmt: skip
        assert int(m) * int(accumulate) == 16
        assert _bytes(peak) == pytest.approx(simulated.peak, abs=0.01 * 2**20)
        assert simulated.peak <= 0.9 * budget.usable
    status, out, err = _run([*argv, "--gpu", "512.1MiB"])  # 0.1 MiB: not even the parameters fit
    assert status == 0, err
    assert re.search(r"^  No plan fits .* Static floor .* What would fit: ", out, re.M)


def test_plan_that_nothing_fits_says_what_the_smallest_step_needs():
    argv = ["plan", "--model", "models:tiny_lm", "--global-batch", "4", "--seq-len", "64"]
    status, _, err = _run([*argv, "--gpu", "512.1MiB"])  # 0.1 MiB once the CUDA context is taken
    assert status == 2
    table, error = err.split("memkit plan: error: ")
    assert error.startswith("No plan fits")
    assert "the smallest step tried (micro-batch 1, no checkpointing, adamw, 32-true) needs" in table
    rows = dict(re.findall(rf"^({'|'.join([*CATEGORIES, 'peak'])})\s+{_SIZE}", table, re.M))
    assert set(rows) == {*CATEGORIES, "peak"}
    assert f"with adamw at micro-batch 1: {rows['peak']}" in error  # the error's figure, by category
