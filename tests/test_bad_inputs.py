"""Bad inputs get an error that says what, why and the fix (issue 12, item 13, in part)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_memkit import ActivationCheckpointing, MemoryMonitor, measure, parse_bytes, plan_fit


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


def test_checkpointing_policy_none_says_what_to_choose():
    with pytest.raises(TypeError, match=r"policy=None: choose one of 'auto'.*leave ActivationCheckpointing"):
        ActivationCheckpointing(policy=None)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n_gpus": 0}, "n_gpus must be a whole number of GPUs, at least 1; got 0"),
        ({"precision": []}, "is empty"),
    ],
)
def test_plan_fit_arguments(kwargs, message):
    batch = (torch.zeros(4, 2), torch.zeros(4, 2))
    with pytest.raises(ValueError, match=message):
        plan_fit(nn.Linear(2, 2), batch, "1GB", loss_fn=nn.functional.mse_loss, **kwargs)
