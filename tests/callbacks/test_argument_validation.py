"""Every wrong argument fails in ``__init__`` (or at the call) with what was wrong, why and the fix, as
Lightning's own callbacks do (issue 27): no bare ``TypeError`` once training started, no Python internals,
nothing accepted silently."""

from __future__ import annotations

import re
from datetime import timedelta

import numpy as np
import pytest
import torch
from helpers import cpu_trainer
from torch import nn

from lightning_memkit import (
    CHECKPOINT_MODES,
    ActivationCheckpointing,
    AutoFit,
    MemoryBreakdown,
    MemoryMonitor,
    OptimizerSwap,
    format_bytes,
    fuse_optimizer_step,
    measure,
    parse_budget,
    parse_bytes,
    release_gradients,
    swap_optimizer,
)
from lightning_memkit._checkpointing.planner import CheckpointPlanner
from lightning_memkit.cli import main
from lightning_memkit.strategies import AutoFitStrategy

HUGE = "9" * 400 + "GB"  # float() reads it as inf: int(inf) was an OverflowError


# --- AutoFit -------------------------------------------------------------------------------------


def test_autofit_refuses_an_unknown_cost_at_once():
    """It was refused only after a long planning run."""
    with pytest.raises(ValueError, match=r"Unknown cost 'bogus'; valid: auto, measured, flops"):
        AutoFit("1GB", cost="bogus")
    with pytest.raises(ValueError, match=r"Did you mean 'flops'"):
        AutoFit("1GB", cost="flop")


@pytest.mark.parametrize(
    ("value", "error", "shown"),
    [
        ("3", TypeError, r"'3' \(str\)"),  # a bare TypeError once training started
        (2.5, TypeError, r"2\.5 \(float\)"),
        (True, TypeError, r"True \(bool\)"),  # bool is an int to Python, not a number of steps
        (None, TypeError, r"None \(NoneType\)"),
        (-1, ValueError, r"-1$"),  # was accepted
    ],
)
def test_autofit_verify_steps_is_a_whole_number_of_steps(value, error, shown):
    message = rf"^verify_steps must be a whole number of steps, at least 0; got {shown}"
    with pytest.raises(error, match=message):
        AutoFit("1GB", verify_steps=value)


def test_autofit_takes_one_optimizer_name_as_one_candidate():
    """``optimizers="adamw"`` was split into its letters: "Unknown optimizer 'a'", blamed on the step."""
    assert AutoFit("1GB", optimizers="adamw").optimizers == ("adamw",)
    assert AutoFit("1GB", optimizers=["adamw", "sgd"]).optimizers == ("adamw", "sgd")
    with pytest.raises(ValueError, match=r"Unknown optimizer 'adamv'.*Did you mean 'adamw'") as err:
        AutoFit("1GB", optimizers="adamv")
    assert "training step" not in str(err.value)
    with pytest.raises(ValueError, match=r"Unknown optimizer 'lionn'"):
        AutoFit("1GB", optimizers=["adamw", "lionn"])
    with pytest.raises(ValueError, match=r"optimizers is empty: name at least one of adamw"):
        AutoFit("1GB", optimizers=[])
    with pytest.raises(TypeError, match=r"optimizers must be a name or a list of names of adamw.*got 3 "):
        AutoFit("1GB", optimizers=3)
    with pytest.raises(TypeError, match=r"optimizers must be a name or a list of names of .*got b'adamw'"):
        AutoFit("1GB", optimizers=b"adamw")  # not its bytes, "Unknown optimizer 97"


@pytest.mark.parametrize(
    ("value", "error", "shown"),
    [
        ("0.1", TypeError, r"'0\.1' \(str\)"),
        (True, TypeError, "True"),
        (1.0, ValueError, "1.0"),
        (-0.1, ValueError, "-0.1"),
    ],
)
def test_autofit_margin_is_a_share_of_the_budget(value, error, shown):
    """``margin="0.1"`` said "'<=' not supported between instances of 'float' and 'str'"."""
    with pytest.raises(error, match=rf"margin must be a share of the budget kept free in \[0, 1\).* {shown}"):
        AutoFit("1GB", margin=value)
    with pytest.raises(ValueError, match="margin must be a share"):
        AutoFit("1GB", margin=float("nan"))


def test_autofit_checkpointing_and_batch_arg_name():
    # One mode is that one or none, as ActivationCheckpointing and plan_checkpointing read it (not letters).
    assert AutoFit("1GB", checkpointing="full").checkpointing == ("none", "full")
    assert AutoFit("1GB", checkpointing=("full",)).checkpointing == ("full",)
    assert AutoFit("1GB", checkpointing="auto").checkpointing == CHECKPOINT_MODES
    with pytest.raises(ValueError, match=r"Unknown checkpointing 'fulll'.*Did you mean 'full'"):
        AutoFit("1GB", checkpointing=["none", "fulll"])
    with pytest.raises(ValueError, match=r"checkpointing is empty"):
        AutoFit("1GB", checkpointing=())
    with pytest.raises(TypeError, match=r"batch_arg_name must name the attribute .* got 32"):
        AutoFit("1GB", batch_arg_name=32)
    with pytest.raises(ValueError, match=r"batch_arg_name must name the attribute"):
        AutoFit("1GB", batch_arg_name="")


def test_autofit_valid_arguments_are_kept_as_given():
    fit = AutoFit("1GB", margin=0.2, optimizers=None, cost="flops", verify_steps=np.int64(0))
    assert (fit.margin, fit.optimizers, fit.cost, fit.verify_steps) == (0.2, None, "flops", 0)
    assert fit.checkpointing == ("none", "selective", "selective_half", "full")
    assert AutoFit("1GB").verify_steps == 3 and AutoFit("1GB", margin=0).margin == 0.0


def test_autofit_strategy_checks_its_arguments_and_forwards_the_rest():
    with pytest.raises(ValueError, match=r"Unknown cost 'bogus'"):
        AutoFitStrategy("1GB", cost="bogus")
    with pytest.raises(TypeError, match=r"margin must be a share"):
        AutoFitStrategy("1GB", margin="0.1")
    with pytest.raises(TypeError, match=r"save_distributed_checkpoint must be True or False; got 'no'"):
        AutoFitStrategy("1GB", save_distributed_checkpoint="no")
    with pytest.raises(TypeError, match=r"process_group_backend must name a torch.distributed backend"):
        AutoFitStrategy("1GB", process_group_backend=1)
    with pytest.raises(TypeError, match=r"timeout must be a datetime.timedelta .* got 30 \(int\)"):
        AutoFitStrategy("1GB", timeout=30)
    strategy = AutoFitStrategy("1GB", optimizers="adamw", timeout=timedelta(minutes=5))
    assert strategy.autofit.optimizers == ("adamw",)


# --- MemoryMonitor -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "error"),
    [("5", TypeError), (2.5, TypeError), (True, TypeError), (0, ValueError), (-3, ValueError)],
)
def test_monitor_log_every_n_steps_is_a_whole_number_of_steps(value, error):
    """``"5"`` said "'<' not supported"; 2.5 was accepted."""
    with pytest.raises(error, match=r"^log_every_n_steps must be a whole number of steps, at least 1; got "):
        MemoryMonitor(log_every_n_steps=value)
    assert MemoryMonitor(log_every_n_steps=None).log_every_n_steps is None
    assert MemoryMonitor(log_every_n_steps=5).log_every_n_steps == 5


@pytest.mark.parametrize("name", ["plot", "summary", "advise"])
@pytest.mark.parametrize("value", ["no", "yes", 1, None])
def test_monitor_switches_are_bools(name, value):
    """``plot="no"`` plotted: a non-empty string is true."""
    with pytest.raises(TypeError, match=rf"^{name} must be True or False; got {re.escape(repr(value))}"):
        MemoryMonitor(**{name: value})
    monitor = MemoryMonitor(**{name: False})
    assert getattr(monitor, name) is False


# --- ActivationCheckpointing, OptimizerSwap --------------------------------------------------------


@pytest.mark.parametrize("checkpointing", [1, 2.5, object(), nn.Linear, {nn.Linear}])
def test_checkpointing_of_the_wrong_type(checkpointing):
    """``policy=1`` said "'int' object is not iterable"; layer classes are ``blocks=``, and say so."""
    with pytest.raises(
        TypeError, match=r"checkpointing must be 'auto', one of .*layer classes such as \{MyBlock\}"
    ):
        ActivationCheckpointing(checkpointing=checkpointing)
    assert ActivationCheckpointing(blocks={nn.Linear}).layer_classes == (nn.Linear,)


def test_optimizer_swap_arguments():
    with pytest.raises(TypeError, match=r"optimizers must be an optimizer name or a list of them .*got 3"):
        OptimizerSwap("1GB", optimizers=3)
    with pytest.raises(TypeError, match=r"allow_unknown must be True or False; got 'yes'"):
        OptimizerSwap("1GB", allow_unknown="yes")
    assert OptimizerSwap("1GB", optimizers="lion").optimizers == ("lion",)


# --- the functions -------------------------------------------------------------------------------


def test_functions_that_take_an_optimizer_name_what_they_expect():
    """A module instead of its optimizer gave "'Linear' object has no attribute 'param_groups'"."""
    model = nn.Linear(2, 2)
    with pytest.raises(TypeError, match=r"swap_optimizer takes the torch.optim.Optimizer to .*got Linear"):
        swap_optimizer(model, "sgd")
    with pytest.raises(TypeError, match=r"release_gradients takes a torch.optim.Optimizer .*got Linear"):
        release_gradients(model)
    with pytest.raises(TypeError, match=r"measure\(\) takes the torch.optim.Optimizer the step .*got Linear"):
        measure(model, model)
    with pytest.raises(TypeError, match=r"measure\(\) takes the nn.Module whose step it measures; got int"):
        measure(3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    release_gradients(optimizer).remove()
    assert isinstance(swap_optimizer(optimizer, "sgd"), torch.optim.SGD)


def test_fuse_optimizer_step_needs_optimizers():
    """``fuse_optimizer_step([])`` was accepted without a word."""
    with pytest.raises(ValueError, match=r"fuse_optimizer_step takes .* got none: there is nothing to fuse"):
        fuse_optimizer_step([])
    with pytest.raises(TypeError, match=r"fuse_optimizer_step takes .*; got a list with Linear"):
        fuse_optimizer_step([nn.Linear(2, 2)])
    with pytest.raises(TypeError, match=r"fuse_optimizer_step takes .*; got str"):
        fuse_optimizer_step("adamw")


def test_breakdown_and_format_bytes_take_bytes():
    with pytest.raises(ValueError, match=r"MemoryBreakdown.parameters must be a number of bytes, at least 0"):
        MemoryBreakdown(parameters=-1)
    with pytest.raises(TypeError, match=r"format_bytes takes a number of bytes, an int or a float; got '5'"):
        format_bytes("5")
    with pytest.raises(TypeError, match=r"format_bytes takes a number of bytes"):
        format_bytes(True)
    assert format_bytes(1536) == format_bytes(np.int64(1536)) == "1.50 KiB"
    assert format_bytes(torch.tensor(1536)) == "1.50 KiB"  # messages format tensors' sizes too
    assert format_bytes(-2048.0) == "-2.00 KiB"  # a difference of two sizes is fine


# --- sizes too large for a float -----------------------------------------------------------------


@pytest.mark.parametrize(
    "read",
    [parse_bytes, parse_budget, lambda v: parse_budget(v, device_size=True)],
    ids=["parse_bytes", "parse_budget", "device_size"],
)
@pytest.mark.parametrize("value", [HUGE, "9" * 400, 10**400], ids=["with-unit", "bytes-string", "int"])
def test_a_size_too_large_for_a_float_is_a_value_error(read, value):
    with pytest.raises(ValueError, match=r"as a memory size: it is too large to count in bytes"):
        read(value)


@pytest.mark.parametrize(
    "make",
    [
        lambda: AutoFit(HUGE),
        lambda: MemoryMonitor(budget=HUGE),
        lambda: OptimizerSwap(HUGE),
        lambda: ActivationCheckpointing(budget=HUGE),
    ],
    ids=["AutoFit", "MemoryMonitor", "OptimizerSwap", "ActivationCheckpointing"],
)
def test_every_budget_refuses_a_size_too_large(make):
    with pytest.raises(ValueError, match=r"Cannot read .9999.*\.\.\. \(402 chars\) as a memory size: it is"):
        make()


@pytest.mark.parametrize("gpu", [HUGE, "9" * 400], ids=["with-unit", "bytes"])
@pytest.mark.parametrize("command", ["plan", "estimate"])
def test_cli_gpu_too_large_is_one_line(capfd, gpu, command):
    """``memkit plan --gpu <that>`` printed a whole traceback (an OverflowError)."""
    size = ["--global-batch", "4"] if command == "plan" else ["--batch-size", "2", "--device", "cpu"]
    assert main([command, "--model", "tiny", "--gpu", gpu, "--seq-len", "8", *size]) == 2
    err = capfd.readouterr().err
    flag = "--gpu/--memory" if command == "plan" else "--gpu"
    assert err.startswith(f"memkit {command}: error: argument {flag}: Cannot read "), err
    assert err.count("\n") == 1, err
    assert "too large to count in bytes" in err


# --- the old spellings, kept for one release ------------------------------------------------------


def test_an_unknown_cost_is_refused():
    """A cost neither planner knows is refused, naming the two it knows."""
    with pytest.raises(ValueError, match=r"Unknown cost 'seconds'; choose 'measured' or 'flops'"):
        ActivationCheckpointing(cost="seconds")


def test_the_checkpointing_modes_are_checked_once_and_at_once():
    """From a review of the new ``checkpointing=``: a budget's modes without ``"none"`` fail at
    construction, not inside the fit; a generator is read once."""
    model = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.ReLU()) for _ in range(2)])
    batch = (torch.randn(2, 4), torch.randn(2, 4))
    kwargs = {"optimizer": "sgd", "loss_fn": nn.functional.mse_loss, "device": "cpu", "cost": "flops"}
    with pytest.raises(ValueError, match=r"checkpointing must include 'none'.*give \('none', 'selective'"):
        ActivationCheckpointing("1GiB", checkpointing=("selective", "full"))
    assert ActivationCheckpointing(checkpointing=("selective", "full")).modes == ("selective", "full")
    assert ActivationCheckpointing(checkpointing=(m for m in ("none", "full"))).modes == ("none", "full")
    with pytest.raises(TypeError, match=r"step= must be a Step; got \{'precision'"):
        CheckpointPlanner(model, batch, step={"precision": "bf16-mixed"}, **kwargs)


def test_the_trainers_step_takes_the_callers_changes_before_its_checks():
    """A fused step beside an accumulation that starts later: the first step does not accumulate, and
    asking for it so is no error (the check ran before the change did)."""
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    from lightning_memkit import FusedOptimizerStep
    from lightning_memkit.callbacks._trainer import trainer_step

    trainer = cpu_trainer(None, [FusedOptimizerStep(), GradientAccumulationScheduler({0: 1, 2: 4})])
    step = trainer_step(trainer, accumulating=False)
    assert step.fused_step and not step.accumulating
    with pytest.raises(ValueError, match="cannot accumulate gradients"):
        trainer_step(trainer)  # the fit's own reading: it accumulates from epoch 2
