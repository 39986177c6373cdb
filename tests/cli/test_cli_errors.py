"""``memkit``: every mistake in the input is one line on stderr, ``memkit <command>: error: ...``, with exit
status 2 and no traceback: what was wrong, why, and how to fix it. The user's own code (the factory, its
``example_batch``, the model's step) failing is such a mistake too."""

import re
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

from lightning_memkit.cli import main

#: A user's module of factories, each wrong in one way.
USER_MODELS = """
import lightning.pytorch as pl
import torch
from torch import nn

def good():
    return nn.Sequential(nn.Embedding(64, 8), nn.Linear(8, 64))

def raises():
    raise RuntimeError("config file missing\\nsecond line")

def needs(n_layer, d_model=4):
    return nn.Linear(d_model, d_model)

class Net(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.linear = nn.Linear(width, width)

def returns_int():
    return 3

def returns_none():
    pass

def no_parameters():
    return nn.ReLU()

def lazy():
    return nn.Sequential(nn.Embedding(64, 8), nn.LazyLinear(64))

def frozen():
    return good().requires_grad_(False)

class Manual(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.net = good()

def features():
    return nn.Linear(4, 4)

def image():
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))

class BadBatch(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def example_batch(self, batch_size):
        return torch.zeros(batch_size, 4)
"""


@pytest.fixture
def user_models(tmp_path, monkeypatch):
    """The module ``user_models`` (see USER_MODELS), and ``broken``, which raises when imported."""
    (tmp_path / "user_models.py").write_text(textwrap.dedent(USER_MODELS))
    (tmp_path / "broken.py").write_text('raise ValueError("boom at import")\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for name in ("user_models", "broken"):
        sys.modules.pop(name, None)


def _fails(capfd, argv, message):
    """``main(argv)`` exits with 2 and one line on stderr (nothing else: no traceback, no torch log)."""
    assert main(argv) == 2
    err = capfd.readouterr().err
    assert err.startswith(f"memkit {argv[0]}: error: ") and err.count("\n") == 1, err
    assert re.search(message, err), err


def _estimate(model, *extra):
    return ["estimate", "--model", model, "--batch-size", "2", "--seq-len", "8", "--device", "cpu", *extra]


@pytest.mark.parametrize(
    ("model", "message"),
    [
        (":good", r"--model ':good' has no package.module before the ':'; give package.module:factory"),
        ("user_models:", r"--model 'user_models:' has no factory after the ':'"),
        ("user_models.good", r"unknown preset .* \(a factory is named with a colon: user_models:good\)"),
        (
            "no_such_module:build",
            r"importing 'no_such_module' failed: ModuleNotFoundError: No module named 'no_such_module'; "
            r"the current directory is on the path; try python -c 'import no_such_module'",
        ),
        ("broken:build", r"importing 'broken' failed: ValueError: boom at import"),
        ("user_models:missing", r"AttributeError: module 'user_models' has no attribute 'missing'$"),
        ("user_models:raise", r"has no attribute 'raise'; did you mean raises\?"),
    ],
)
def test_the_factory_is_not_found(capfd, user_models, model, message):
    _fails(capfd, _estimate(model), message)


@pytest.mark.parametrize(
    ("model", "message"),
    [
        (
            "user_models:raises",
            r"--model user_models:raises: calling raises\(\) failed: RuntimeError: config file missing; "
            r"it is called with no arguments under torch.device\('meta'\)",
        ),
        (
            "user_models:needs",
            r"needs\(\) needs arguments \(n_layer\) but is called with none; write a factory without "
            r"arguments, e.g. def build\(\): return needs\(n_layer=...\), and give --model module:build",
        ),
        ("user_models:Net", r"Net\(\) needs arguments \(width\)"),
        ("user_models:returns_int", r"returns_int\(\) returned 3 \(int\), not an nn.Module or Lightning"),
        ("user_models:returns_none", r"returned None \(does it return the model\?\)"),
    ],
)
def test_the_factory_fails(capfd, user_models, model, message):
    _fails(capfd, _estimate(model), message)


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ("user_models:no_parameters", r"\(ReLU\) has no parameters, so there is nothing to train"),
        ("user_models:lazy", r"has lazy modules \(LazyLinear\), whose parameters have no shape"),
        ("user_models:frozen", r"no trainable parameters: all 3 have requires_grad=False; unfreeze"),
        ("user_models:Manual", r"\(Manual\) uses manual optimization, whose steps only a running Trainer"),
    ],
)
def test_a_model_memkit_cannot_step(capfd, user_models, model, message):
    _fails(capfd, _estimate(model), message)


def test_an_image_model_on_the_token_batch(capfd, user_models):
    """The default batch is token ids; a model that takes images is told how to give its own."""
    _fails(
        capfd,
        _estimate("user_models:image"),
        r"--model user_models:image: the simulated training step failed: RuntimeError: .+; the batch was "
        r"\(x, y\), int64 token ids of shape \(2, 8\), stepped as cross_entropy\(model\(x\), y\); a model "
        r"that takes other inputs \(images, features\) defines example_batch\(batch_size, seq_len\)",
    )
    plan = ["plan", "--model", "user_models:image", "--gpu", "T4", "--global-batch", "4", "--seq-len", "8"]
    _fails(capfd, plan, r"the simulated training step failed: .* token ids of shape \(4, 8\)")


@pytest.mark.slow  # a shell per command: the full tier's (in-process, the same messages are tested above)
def test_the_shell_sees_one_line(tmp_path, user_models):
    """The installed ``memkit`` script, from the shell: a meta kernel failing makes torch log its traceback
    before raising, which in-process capture does not see; the command silences it. The user's module is
    found in the working directory, as under ``python -m``."""
    script = Path(sysconfig.get_path("scripts")) / "memkit"
    command = [str(script)] if script.exists() else [shutil.which("memkit") or ""]
    assert command[0], "the memkit console script is not installed: pip install -e ."
    done = subprocess.run(
        [*command, *_estimate("user_models:features")],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "step failed: RuntimeError: a and b must have same reduction dim" in done.stderr, done.stderr


def test_an_example_batch_that_fails(capfd, user_models):
    _fails(
        capfd,
        _estimate("user_models:BadBatch"),
        r"its example_batch\(2, 8\) failed: TypeError: .*takes 2 positional arguments but 3 were given; it "
        r"is called as example_batch\(batch_size, seq_len\)",
    )


def test_a_batch_too_large_to_count(capfd):
    argv = ["estimate", "--model", "tiny", "--batch-size", "99999999999999999999999", "--seq-len", "8"]
    _fails(capfd, argv, r"is 799,999,999,999,999,999,999,992 tokens, more than the 1,099,511,627,776")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--gpu", "12XB"], r"argument --gpu/--memory: Cannot read '12XB' as a memory size: use bytes"),
        (["--gpu", "A100"], r"argument --gpu/--memory: Unknown GPU or size 'A100'. Did you mean .*A100-80GB"),
        (["--gpu", "0.5"], r"argument --gpu/--memory: '0.5' is neither a GPU name nor a card size"),
        (
            ["--gpu", "1KB"],
            r"argument --gpu/--memory: 1KB: 1000 bytes leave nothing once the CUDA context is taken "
            r"\(planning a CPU run\? --device cpu\)",
        ),
        (["--gpu", "0GB"], r"argument --gpu/--memory: A memory size must be positive, got '0GB'"),
        (["--margin", "1.5"], r"argument --margin: must be a share of the budget in \[0, 1\), got '1.5'"),
        (["--margin", "half"], r"argument --margin: must be a share of the budget in \[0, 1\), got 'half'"),
        (["--precision", "bf16-mixed,fp16"], r"argument --precision: Unknown precision 'fp16'; valid: "),
        (["--optimizer", "adamw,"], r"argument --optimizer: Unknown optimizer ''; valid: adamw, "),
        (["--global-batch", "0"], r"argument --global-batch: must be a positive integer, got '0'"),
        (["--gpus", "3"], r"--global-batch 4 does not split evenly across --gpus 3"),
        (["--seq-len", "4096"], r"--seq-len 4096 exceeds the model's block_size of 128"),
    ],
)
def test_plan_arguments(capfd, args, message):
    base = {"--model": "tiny", "--gpu": "T4", "--global-batch": "4", "--seq-len": "8"}
    base.update(dict(zip(args[::2], args[1::2], strict=True)))
    _fails(capfd, ["plan", *[item for pair in base.items() for item in pair]], message)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--checkpointing", "some"],
            r"argument --checkpointing: Unknown checkpointing 'some'; valid: none, selective, "
            r"selective_half, full",
        ),
        (["--device", "tpu"], r"argument --device: Unknown device 'tpu'; valid: cuda, cpu"),
        (["--accumulate", "0"], r"argument --accumulate: must be a positive integer, got '0'"),
        (["--batch-size", "two"], r"argument --batch-size: must be a positive integer, got 'two'"),
    ],
)
def test_estimate_arguments(capfd, args, message):
    _fails(capfd, [*_estimate("tiny"), *args], message)


def test_a_good_factory_still_runs(capfd, user_models):
    assert main(_estimate("user_models:good", "--json")) == 0
    assert '"simulated"' in capfd.readouterr().out
