"""Refusals and explanations that name the real cause (issue 46 item 9): an out-of-memory error explained by
the rank it struck; a module with no parameters, or with layers `configure_model` builds, told so in a
sentence; AutoFitStrategy's root unit one the step calls.

Quick: one device, a rank but the first emulated where that is what is tested (`_RankOne`).
"""

import re
import warnings

import lightning as L
import pytest
import torch
from helpers import cpu_trainer
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning_utilities.core.rank_zero import rank_zero_only
from models import BuiltLater, MLPModule

from lightning_memkit import AutoFit, MemoryMonitor, estimate_memory
from lightning_memkit.testing import PretendOOM


class _RankOne(SingleDeviceStrategy):
    """One device that reads as global rank 1 of 2: what a rank but the first sees of its own run."""

    global_rank = property(lambda self: 1, lambda self, value: None)  # Lightning sets it to 0
    world_size = property(lambda self: 2, lambda self, value: None)


def test_an_oom_on_rank_one_is_explained_by_rank_one(tmp_path, monkeypatch):
    """Rank 1 runs out of memory (rank 0 may never see an error, only wait in its next collective): rank 1
    explains its own step, naming itself; it said nothing, as only global rank 0 explained."""
    monkeypatch.setattr(rank_zero_only, "rank", 1)  # rank_zero_warn is silent here, as on rank 1
    module = MLPModule(batch_size=8)
    PretendOOM(module, rows=4)
    trainer = cpu_trainer(
        tmp_path, [MemoryMonitor(plot=False, summary=False)], max_steps=1,
        logger=CSVLogger(tmp_path), strategy=_RankOne("cpu"),
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as caught, pytest.raises(torch.OutOfMemoryError):
        warnings.simplefilter("always")
        trainer.fit(module)
    (said,) = [str(w.message) for w in caught if "out of memory" in str(w.message)]
    assert said.startswith("[rank 1] MemoryMonitor: out of memory in the forward of step 0 (batch 0, 8")
    assert "The step needs" in said


class _Bare(BuiltLater):
    """No layers, and no configure_model to build them."""

    configure_model = L.LightningModule.configure_model


#: what planning and estimating say: each module's sentence, and whether it says where to build the layers
_SAID = {
    _Bare: ("_Bare has no parameters: its step trains nothing, so there is nothing to estimate", False),
    BuiltLater: (
        "BuiltLater has no parameters yet: its configure_model builds them, which a Trainer runs",
        True,
    ),
}


@pytest.mark.parametrize("kind", [_Bare, BuiltLater])
def test_a_module_without_parameters_gets_a_sentence(tmp_path, kind):
    """AutoFit (and AutoFitStrategy, which plans through it) and estimate_memory say why, where planning
    said "The training step fails on every micro-batch of [1, 2, 4]: optimizer got an empty parameter
    list"; layers configure_model builds are to be built in __init__."""
    said, built_later = _SAID[kind]
    trainer = cpu_trainer(tmp_path, [AutoFit("1GB", cost="flops")], max_steps=1, logger=False)
    with pytest.raises(ValueError, match=re.escape(said)) as refused:
        trainer.fit(kind(build_later=True))
    assert ("Build the layers in __init__" in str(refused.value)) is built_later
    module = kind(build_later=True)
    with pytest.raises(ValueError, match=f"estimate_memory: {re.escape(said)}"):
        estimate_memory(module, next(iter(module.train_dataloader())))
