"""Bad inputs get an error that says what, why and the fix (issue 12, item 13, in part)."""

from __future__ import annotations

import pytest
import torch
from helpers import cpu_trainer
from lightning.pytorch.demos.boring_classes import BoringModel
from torch import nn

from lightning_memkit import (
    ActivationCheckpointing,
    MemoryMonitor,
    measure,
    parse_budget,
    parse_bytes,
    plan_fit,
)


def test_measure_takes_an_optimizer_not_its_name():
    with pytest.raises(TypeError, match=r"not its name .'adamw'.*estimate_memory takes optimizer names"):
        measure(nn.Linear(2, 2), "adamw")
    with pytest.raises(TypeError, match=r"torch\.optim\.Optimizer instances, got int"):
        measure(nn.Linear(2, 2), [3])


@pytest.mark.parametrize("text", ["1.5", "0.9"])
def test_a_fraction_without_a_unit_is_not_a_byte_count(text):
    """'1.5' read as 1 byte, and '0.9' said 'must be positive'."""
    with pytest.raises(ValueError, match=rf"without a unit it is bytes.*'{text}GB'.*is a float"):
        parse_bytes(text)
    assert parse_bytes("1536") == 1536 and parse_bytes("1.5KiB") == 1536


def test_monitor_remeasure_every_n_steps_must_be_an_int():
    with pytest.raises(TypeError, match=r"must be an int .0: never re-measure alike steps., got None"):
        MemoryMonitor(remeasure_every_n_steps=None)


def test_checkpointing_none_says_what_to_choose():
    with pytest.raises(
        TypeError, match=r"checkpointing=None: choose 'auto' or one of .*leave ActivationCheckpointing"
    ):
        ActivationCheckpointing(checkpointing=None)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"world_size": 0}, "world_size must be a whole number of ranks, at least 1; got 0"),
        ({"precision": []}, "is empty"),
    ],
)
def test_plan_fit_arguments(kwargs, message):
    batch = (torch.zeros(4, 2), torch.zeros(4, 2))
    with pytest.raises(ValueError, match=message):
        plan_fit(nn.Linear(2, 2), batch, "1GB", loss_fn=nn.functional.mse_loss, **kwargs)


@pytest.mark.parametrize("name", ["zero1", "zero2", "zero3"])
def test_deepspeeds_stages_go_by_lightnings_names_only(name):
    """Issue 48: ``"zero1"`` to ``"zero3"`` were other names for ``"deepspeed_stage_1"`` to ``"3"`` (and
    ``"zero2"`` FSDP's SHARD_GRAD_OP inside too); refused now as any unknown strategy is, naming the valid."""
    valid = "ddp, fsdp, deepspeed_stage_1, deepspeed_stage_2, deepspeed_stage_3, fsdp2, fsdp_shard_grad_op"
    batch = (torch.zeros(4, 2), torch.zeros(4, 2))
    with pytest.raises(ValueError, match=rf"^Unknown strategy '{name}'; valid: {valid}\.$"):
        plan_fit(nn.Linear(2, 2), batch, "1GB", loss_fn=nn.functional.mse_loss, strategy=name, world_size=2)


def test_every_budget_reads_gpu_names_sizes_and_fractions_alike():
    """Issue 12, item 11: MemoryMonitor refused 'H200' although the README lists GPU names for budgets."""
    assert MemoryMonitor(budget="H200").budget == parse_budget("H200").usable
    assert MemoryMonitor(budget="a100 40gb").budget == parse_budget("A100-40GB").usable
    assert MemoryMonitor(budget="24GB").budget == 24 * 10**9
    with pytest.raises(ValueError, match=r"Unknown GPU or size 'H2000'. Did you mean H200"):
        MemoryMonitor(budget="H2000")


@pytest.mark.parametrize("fraction", [1.5, float("nan"), 0.0])
def test_a_float_budget_is_a_fraction_of_the_device(fraction):
    """Issue 12, item 15: AutoFit(budget=1.5) said it 'reads the CUDA device, but the run is on cpu'."""
    with pytest.raises(
        ValueError, match=r"A float budget is a fraction of the current CUDA device, in \(0, 1\]"
    ):
        MemoryMonitor(budget=fraction)


def test_a_fraction_of_the_device_is_read_in_setup(tmp_path):
    monitor = MemoryMonitor(budget=0.9)  # no device is read before the run is on one
    trainer = cpu_trainer(tmp_path, [monitor], max_steps=1)
    with pytest.raises(ValueError, match=r"'auto' or a fraction needs a CUDA device, and none is visible"):
        trainer.fit(BoringModel())
