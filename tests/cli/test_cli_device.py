"""``memkit plan --device``: on cuda the card less what CUDA takes first, said in the output; on cpu the
size as given, the step simulated as the CPU runs it, and the code a CPU Trainer."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import run_cli

from lightning_memkit import estimate_memory, format_bytes
from lightning_memkit._budget import CUDA_CONTEXT_BYTES, FRAGMENTATION_RESERVE
from lightning_memkit._fitting.plan import FitPlan
from lightning_memkit.demos.gpt import GPTLightningModule

PLAN = ["plan", "--model", "tiny", "--global-batch", "16", "--seq-len", "128"]


def _plan(*argv: str) -> dict:
    status, out, err = run_cli([*PLAN, *argv, "--json"])
    assert status == 0, err
    return json.loads(out)


@pytest.mark.slow
def test_a_cpu_plan_takes_nothing_off_the_size_and_simulates_the_cpu_step():
    plan = _plan("--device", "cpu", "--memory", "40MB")
    assert plan["device"] == "cpu"
    assert plan["budget"] == {"total": 40_000_000, "usable": 40_000_000, "source": "40MB"}
    assert plan["limit"] == 36_000_000 and plan["estimated_peak"] <= plan["limit"]
    with torch.device("meta"):
        model = GPTLightningModule("tiny")
    m, accumulate = plan["micro_batch_size"], plan["accumulate_grad_batches"]
    tokens = torch.zeros(m, 128, dtype=torch.long, device="meta")
    cpu = estimate_memory(
        model, (tokens, tokens.clone()), device="cpu", checkpointing=plan["checkpointing"],
        accumulating=accumulate > 1,
    )  # fmt: skip
    assert plan["estimated_peak"] == cpu.peak
    assert (
        'Trainer(accelerator="cpu", precision="32-true", callbacks=[AutoFit(budget="40MB")])'
        in (plan["code"])
    )
    assert FitPlan.from_dict(plan).device == "cpu"


def test_the_same_size_on_cuda_loses_the_context_first():
    status, _, err = run_cli([*PLAN, "--memory", "40MB"])
    assert status == 2 and "40MB: 40000000 bytes leave nothing once the CUDA context is taken" in err
    plan = _plan("--gpu", "2GB")
    usable = int((2_000_000_000 - CUDA_CONTEXT_BYTES) * (1 - FRAGMENTATION_RESERVE))
    assert plan["device"] == "cuda" and plan["budget"]["usable"] == usable
    assert "accelerator" not in plan["code"]
    # The budget as a user writes it (issue 46 item 6): "auto", the card the run is on, not its bytes.
    assert "from lightning_memkit import AutoFit\n" in plan["code"]
    assert 'AutoFit(budget="auto")' in plan["code"] and "a 2GB card leaves" in plan["code"]


@pytest.mark.slow
def test_the_table_says_what_is_taken_off():
    status, out, err = run_cli([*PLAN, "--gpu", "2GB"])
    assert status == 0, err
    usable = int((2_000_000_000 - CUDA_CONTEXT_BYTES) * (1 - FRAGMENTATION_RESERVE))
    assert (
        f"budget: 2GB = 1.86 GiB, less the CUDA context (512.00 MiB) and the 5% fragmentation reserve: "
        f"{format_bytes(usable)}; less the 10% margin: {format_bytes(int(usable * 0.9))}"
    ) in out
    status, out, err = run_cli([*PLAN, "--device", "cpu", "--memory", "2GB"])
    assert status == 0, err
    assert "budget: 2GB = 1.86 GiB; less the 10% margin: 1.68 GiB" in out


def test_a_gpu_name_or_offload_on_the_cpu_is_a_usage_error():
    status, _, err = run_cli([*PLAN, "--device", "cpu", "--memory", "A100-40GB"])
    assert status == 2 and "A100-40GB names a GPU; give a size instead: --memory 16GB" in err
    status, _, err = run_cli([*PLAN, "--device", "cpu", "--memory", "1GB", "--offload"])
    assert status == 2 and "--device cpu has no GPU" in err


@pytest.mark.slow
def test_a_decimal_size_that_names_a_card_in_binary_units_is_flagged():
    """``--gpu 24GB`` is 24 x 10^9 bytes, 1.6 GiB less than the 24 GiB of the cards users mean by it."""
    status, out, err = run_cli([*PLAN, "--gpu", "24GB"])
    assert status == 0, err
    assert "note: 24GB is 24 x 10^9 bytes; RTX-3090, RTX-4090 have 24 GiB: --gpu RTX-3090 (or" in out
    status, out, err = run_cli([*PLAN, "--gpu", "24GiB"])
    assert status == 0, err
    assert "note:" not in out
