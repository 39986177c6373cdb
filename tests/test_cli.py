"""``memkit estimate``: the numbers are those of the library calls, and every bad input fails in one line."""

import json
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_memkit._analytic import TransformerShape, estimate_analytic, shard
from lightning_memkit._simulate import estimate_memory
from lightning_memkit.cli import main
from lightning_memkit.demos.gpt import GPTConfig, GPTLightningModule

TINY = ["estimate", "--model", "tiny", "--batch-size", "2", "--seq-len", "32", "--device", "cpu"]


def _run_json(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def _tiny_tokens():
    x = torch.zeros(2, 32, dtype=torch.long, device="meta")
    return x, x


def test_json_numbers_are_the_library_calls(capsys):
    report = _run_json(capsys, [*TINY, "--precision", "bf16-mixed", "--json"])
    with torch.device("meta"):
        module = GPTLightningModule("tiny")
    simulated = estimate_memory(module, _tiny_tokens(), precision="bf16-mixed", device="cpu")
    shape = TransformerShape.from_config(GPTConfig.from_name("tiny"))
    analytic = estimate_analytic(shape, 2, 32, precision="bf16-mixed", optimizer="adamw", attention="sdpa")
    assert report["simulated"] == simulated.as_dict()
    assert report["analytic"] == analytic.as_dict()
    assert report["optimizer"] is None  # the module's own configure_optimizers
    assert report["simulated_seconds"] > 0


def test_accumulate_simulates_the_highest_micro_batch(capsys):
    report = _run_json(capsys, [*TINY, "--accumulate", "4", "--json"])
    with torch.device("meta"):
        module = GPTLightningModule("tiny")
    accumulating = estimate_memory(module, _tiny_tokens(), device="cpu", accumulating=True)
    assert report["simulated"] == accumulating.as_dict()
    assert accumulating.peak > estimate_memory(module, _tiny_tokens(), device="cpu").peak


def test_sharding_applies_to_both_columns_per_rank(capsys):
    report = _run_json(capsys, [*TINY, "--optimizer", "adamw", "--gpus", "4", "--strategy", "fsdp", "--json"])
    with torch.device("meta"):
        module = GPTLightningModule("tiny")
    simulated = estimate_memory(module, _tiny_tokens(), optimizer="adamw", device="cpu")
    shape = TransformerShape.from_config(GPTConfig.from_name("tiny"))
    assert report["simulated"] == shard(simulated, "fsdp", 4).as_dict()
    assert (
        report["analytic"] == shard(estimate_analytic(shape, 2, 32, precision="32-true"), "fsdp", 4).as_dict()
    )
    assert any("fsdp over 4 GPU(s)" in note for note in report["notes"])


def test_table_shows_both_columns(capsys):
    assert main(TINY) == 0
    out = capsys.readouterr().out
    assert "analytic" in out and "simulated" in out
    for category in ("parameters", "gradients", "optimizer_state", "activations", "temporary", "peak"):
        assert category in out


class Regressor(pl.LightningModule):
    """A user's module that builds its own example batch (the CLI's documented convention)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))

    def example_batch(self, batch_size, seq_len):
        return torch.zeros(batch_size, seq_len, 16, device="meta"), torch.zeros(batch_size, seq_len, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def tiny_lm():
    """A plain nn.Module factory: stepped as a language model on (B, T) token ids."""
    return nn.Sequential(nn.Embedding(256, 32), nn.Linear(32, 256))


def test_a_users_lightning_module_with_its_own_example_batch(capsys):
    argv = ["estimate", "--model", "test_cli:Regressor", "--batch-size", "4", "--seq-len", "10"]
    report = _run_json(capsys, [*argv, "--device", "cpu", "--json"])
    direct = estimate_memory(Regressor(), Regressor().example_batch(4, 10), device="cpu")
    assert report["simulated"] == direct.as_dict()
    assert report["simulated"]["optimizer_state"] == 4 * (16 * 64 + 64 + 64 + 1)  # SGD momentum
    assert report["analytic"] is None  # no GPTConfig to compute it from


def test_a_plain_module_factory_is_stepped_as_a_language_model(capsys):
    argv = ["estimate", "--model", "test_cli:tiny_lm", "--batch-size", "3", "--seq-len", "7", "--json"]
    report = _run_json(capsys, argv)
    x = torch.zeros(3, 7, dtype=torch.long)
    loss = lambda out, y: F.cross_entropy(out.flatten(0, -2), y.flatten())  # noqa: E731
    assert (
        report["simulated"] == estimate_memory(tiny_lm(), (x, x), optimizer="adamw", loss_fn=loss).as_dict()
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "gpt3"], r"unknown preset 'gpt3' for --model; valid: tiny, gpt2, .*llama-7b"),
        (["--model", "no_such_pkg.models:build"], r"ModuleNotFoundError: No module named 'no_such_pkg'"),
        (["--model", "lightning_memkit:build"], r"AttributeError: module 'lightning_memkit' has no attr"),
        (["--model", "lightning_memkit:__version__"], r"is a str, not a callable"),
        (["--batch-size", "0"], r"argument --batch-size: must be a positive integer, got '0'"),
        (["--seq-len", "-3"], r"argument --seq-len: must be a positive integer, got '-3'"),
        (["--gpus", "0"], r"argument --gpus: must be a positive integer"),
        (["--seq-len", "4096"], r"--seq-len 4096 exceeds the model's block_size of 128"),
        (["--precision", "fp16"], r"Unknown precision 'fp16'; valid: 64-true, 32-true, 16-mixed, bf16-mixed"),
        (["--optimizer", "adam"], r"Unknown optimizer 'adam'; valid: adamw, .*sgd\. Did you mean 'adamw'"),
        (["--strategy", "zero4"], r"Unknown strategy 'zero4'; valid: ddp, "),
    ],
)
def test_errors_are_one_line_with_status_2(capsys, args, message):
    base = {"--model": "tiny", "--batch-size": "2", "--seq-len": "8"}
    base.update(dict(zip(args[::2], args[1::2], strict=True)))
    assert main(["estimate", *[item for pair in base.items() for item in pair]]) == 2
    err = capsys.readouterr().err
    assert err.startswith("memkit estimate: error: ") and err.count("\n") == 1, err
    assert re.search(message, err), err


def test_the_console_script_runs():
    script = Path(sysconfig.get_path("scripts")) / "memkit"
    command = [str(script)] if script.exists() else [shutil.which("memkit") or ""]
    if not command[0]:
        command = [sys.executable, "-m", "lightning_memkit.cli"]
    done = subprocess.run(
        [*command, *TINY, "--json"], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["simulated"]["peak"] > 0


# --- plain Hugging Face models (tests/zoo.py: tiny random configs) -------------------------------


def _hf_direct(factory, batch_size, seq_len):
    """What ``memkit estimate`` must report for a Hugging Face model: its own loss on labels = input ids."""
    from lightning_memkit.cli import _HFLanguageModel, _lm_loss

    with torch.device("meta"):
        model = _HFLanguageModel(factory())
    x = torch.zeros(batch_size, seq_len, dtype=torch.long, device="meta")
    return model, estimate_memory(model, (x, x.clone()), optimizer="adamw", loss_fn=_lm_loss)


@pytest.mark.parametrize("name", ["gpt2", "qwen2"])
def test_a_hugging_face_model_factory(capsys, name):
    import zoo

    argv = ["estimate", "--model", f"zoo:_{name}", "--batch-size", "2", "--seq-len", "16"]  # --device cuda
    report = _run_json(capsys, [*argv, "--json"])
    model, direct = _hf_direct(zoo.MODELS[name][0], 2, 16)
    assert report["simulated"] == direct.as_dict()
    assert report["optimizer_used"] == "adamw"
    n = sum(p.numel() for p in model.parameters())
    # The analytic column reads the Hugging Face config (GQA for Qwen2) and counts the parameters exactly.
    assert report["analytic"]["parameters"] == 4 * n == report["analytic"]["gradients"]
    assert report["analytic"]["optimizer_state"] == 8 * n + 4 * len(list(model.parameters()))  # AdamW
    assert any(f"from {type(model.model).__name__}'s config" in note for note in report["notes"])
    assert main(argv) == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert header.endswith(", 32-true, adamw, cuda"), header


def test_hugging_face_loss_is_the_models_own():
    """With labels the model computes its loss; without (a base model) the loss is over its first output."""
    import zoo
    from transformers import GPT2Config, GPT2Model

    from lightning_memkit.cli import _HFLanguageModel, _lm_loss

    torch.manual_seed(0)
    lm = _HFLanguageModel(zoo._gpt2())
    x = torch.randint(0, zoo.VOCAB, (2, 8))
    out = lm(x)
    assert lm.takes_labels and _lm_loss(out, x) is out.loss
    base = _HFLanguageModel(
        GPT2Model(GPT2Config(vocab_size=zoo.VOCAB, n_embd=32, n_layer=1, n_head=4, n_positions=16))
    )
    assert not base.takes_labels
    assert _lm_loss(base(x), x % 32).shape == ()  # cross-entropy over last_hidden_state's last dimension


def test_analytic_column_says_why_it_does_not_apply(capsys):
    argv = ["estimate", "--model", "zoo:_bert", "--batch-size", "2", "--seq-len", "16", "--device", "cpu"]
    report = _run_json(capsys, [*argv, "--json"])
    assert report["analytic"] is None and report["simulated"]["peak"] > 0
    assert any("not available for BertForMaskedLM" in n and "decoder-only" in n for n in report["notes"])
    assert main(["estimate", "--model", "zoo:_gpt2", "--batch-size", "2", "--seq-len", "65"]) == 2
    assert "--seq-len 65 exceeds the model's block_size of 64" in capsys.readouterr().err


def test_header_names_the_optimizer_used(capsys):
    for model, optimizer in (("test_cli:tiny_lm", "adamw"), ("test_cli:Regressor", "sgd_momentum")):
        assert (
            main(["estimate", "--model", model, "--batch-size", "2", "--seq-len", "4", "--device", "cpu"])
            == 0
        )
        header = capsys.readouterr().out.splitlines()[0]
        assert f", 32-true, {optimizer}" in header, header


def test_plan_a_hugging_face_model_factory(capsys):
    argv = ["plan", "--model", "zoo:_gpt2", "--gpu", "T4", "--global-batch", "4", "--seq-len", "16", "--json"]
    report = _run_json(capsys, argv)
    assert (report["micro_batch_size"], report["accumulate_grad_batches"]) == (4, 1)
    assert report["optimizer"] == "adamw" and report["estimated_peak"] <= report["limit"]
