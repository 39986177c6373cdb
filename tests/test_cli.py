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


# --- issue 13: the estimate explains its two columns; the plan prints its set-up as code ------------


def _signed(n):
    from lightning_memkit._breakdown import format_bytes

    return f"+{format_bytes(n)}" if n > 0 else format_bytes(n)


BF16 = ["estimate", "--model", "tiny", "--batch-size", "4", "--seq-len", "64", "--precision", "bf16-mixed"]


def test_difference_is_simulated_minus_analytic_and_explained(capsys):
    report = _run_json(capsys, [*BF16, "--device", "cpu", "--json"])
    analytic, simulated, difference = report["analytic"], report["simulated"], report["difference"]
    assert difference == {name: simulated[name] - analytic[name] for name in analytic}
    trust, why = report["notes"][:2]
    assert trust.startswith("Plan with the simulated column: it runs the model's own code")
    assert "its peak falls in the forward, at aten.nll_loss_forward" in trust
    # The categories that differ, largest first, with their numbers; the logits' size from B x T x vocab.
    assert why.startswith(f"simulated - analytic: {_signed(difference['peak'])} (")
    assert (
        f"activations {_signed(difference['activations'])}, temporary {_signed(difference['temporary'])}."
        in why
    )
    assert difference["activations"] > 0 > difference["temporary"]
    assert "logits and the loss's buffers (4 x 64 x 256 = 256.00 KiB per fp32 copy)" in why
    assert "autocast's weight copies as live at once (1.56 MiB)" in why


@pytest.mark.parametrize("rich", [True, False])
def test_table_has_the_difference_column_and_the_explanation(capsys, monkeypatch, rich):
    if not rich:  # the plain-text table, as without rich installed
        monkeypatch.setitem(sys.modules, "rich.console", None)
    report = _run_json(capsys, [*BF16, "--device", "cpu", "--json"])
    assert main([*BF16, "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if "category" in line)
    assert header.index("analytic") < header.index("simulated") < header.index("difference")
    for name, diff in report["difference"].items():
        row = next(line for line in out.splitlines() if re.search(rf"\b{name}\b", line))
        assert row.rstrip(" │").endswith(_signed(diff)), row
    assert "Plan with the simulated column" in out and report["notes"][1] in out


def test_explanation_of_a_peak_before_the_gradients_exist():
    """GPT-2 at 8 x 1024 in bf16-mixed peaks in the loss's backward, before any gradient is made."""
    import argparse

    from lightning_memkit._breakdown import MemoryBreakdown
    from lightning_memkit._simulate import TimelineEvent
    from lightning_memkit.cli import _explain

    MiB = 2**20
    analytic = MemoryBreakdown(475 * MiB, 475 * MiB, 949 * MiB, 2448 * MiB, 236 * MiB)
    simulated = MemoryBreakdown(475 * MiB, 0, 949 * MiB, 4444 * MiB, 3144 * MiB)
    at = TimelineEvent("backward", "aten._log_softmax_backward_data.default", simulated.peak)
    shape = TransformerShape.from_config(GPTConfig.from_name("gpt2"))
    args = argparse.Namespace(batch_size=8, seq_len=1024)
    trust, why = _explain(args, shape, analytic, simulated, at)
    assert "peak falls in the backward, at aten._log_softmax_backward_data." in trust
    assert why.startswith(f"simulated - analytic: {_signed(simulated.peak - analytic.peak)} (1.97x): ")
    assert "temporary +2.84 GiB, activations +1.95 GiB, gradients -475.00 MiB." in why
    assert "(8 x 1024 x 50,257 = 1.53 GiB per fp32 copy)" in why
    assert "counts every gradient as live (none exists at the simulated peak)" in why


def test_no_difference_without_an_analytic_column(capsys):
    argv = ["estimate", "--model", "test_cli:tiny_lm", "--batch-size", "2", "--seq-len", "4", "--json"]
    report = _run_json(capsys, argv)
    assert report["analytic"] is None and report["difference"] is None
    assert not any(note.startswith("Plan with") for note in report["notes"])


def _plan_code(out):
    return out.split("The plan as code (Python):\n", 1)[1].rsplit("\nplanned in ", 1)[0]


def _trainer_calls(code):
    """The keyword arguments of each ``Trainer(...)`` call in ``code``, as Python values or source."""
    import ast

    calls = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Trainer":
            calls.append({k.arg: _value(k.value) for k in node.keywords})
    return calls


def _value(node):
    import ast

    try:
        return ast.literal_eval(node)
    except ValueError:
        return ast.unparse(node)


def test_plan_prints_its_set_up_as_code_that_runs(capsys, monkeypatch, tmp_path):
    argv = ["plan", "--model", "tiny", "--gpu", "T4", "--global-batch", "8", "--seq-len", "32"]
    report = _run_json(capsys, [*argv, "--json"])
    assert main(argv) == 0
    code = _plan_code(capsys.readouterr().out)
    assert code == report["code"]
    autofit, by_hand = _trainer_calls(code)
    assert autofit == {"precision": report["precision"], "callbacks": "[AutoFit(budget='T4')]"}
    assert by_hand == {
        "accumulate_grad_batches": report["accumulate_grad_batches"],
        "precision": report["precision"],
    }
    assert f"\nbatch_size = {report['micro_batch_size']}\n" in code
    assert "here 8;" in code  # AutoFit's batch_size: the global batch per GPU
    monkeypatch.chdir(tmp_path)
    namespace = {}
    exec(compile(code, "<memkit plan>", "exec"), namespace)  # real Trainers, on the CPU
    assert namespace["trainer"].accumulate_grad_batches == report["accumulate_grad_batches"]
    assert namespace["batch_size"] == report["micro_batch_size"]


def test_plan_code_names_sharding_checkpointing_and_the_optimizer_swap():
    import argparse
    import ast

    from lightning_memkit import ActivationCheckpointing, AutoFit, FitPlan, parse_budget
    from lightning_memkit.cli import _plan_code as plan_code

    budget = parse_budget("24GB", device_size=True)
    plan = FitPlan(
        micro_batch_size=2, accumulate_grad_batches=16, checkpointing="full", optimizer="adamw8bit",
        precision="bf16-mixed", estimated_peak=1, budget=budget, margin=0.2, strategy="fsdp", n_gpus=8,
    )  # fmt: skip
    with torch.device("meta"):
        model = GPTLightningModule("tiny")  # configures AdamW
    args = argparse.Namespace(global_batch=256, gpus=8, optimizer=None)
    code = plan_code(args, model, plan)
    autofit, by_hand = _trainer_calls(code)
    sharded = {"precision": "bf16-mixed", "strategy": "fsdp", "devices": 8}
    assert autofit == {**sharded, "callbacks": f"[AutoFit(budget={budget.usable}, margin=0.2)]"}
    assert by_hand == {
        "accumulate_grad_batches": 16,
        **sharded,
        "callbacks": "[ActivationCheckpointing(policy='full')]",
    }
    assert "here 32;" in code and "\nbatch_size = 2\n" in code
    assert '#    return lightning_memkit.swap_optimizer(optimizer, "adamw8bit")' in code
    assert "adamw8bit in place of adamw" in code
    # Run it with a Trainer that records its arguments (8 GPUs are not here); the callbacks are real.
    tree = ast.parse(code)
    tree.body = [
        n for n in tree.body if not (isinstance(n, ast.ImportFrom) and n.module == "lightning.pytorch")
    ]
    namespace = {"Trainer": dict}
    exec(compile(tree, "<memkit plan>", "exec"), namespace)
    assert isinstance(namespace["trainer"]["callbacks"][0], ActivationCheckpointing)
    first = ast.Module(body=tree.body[:2], type_ignores=[])
    exec(compile(first, "<memkit plan>", "exec"), namespace)
    assert isinstance(namespace["trainer"]["callbacks"][0], AutoFit)
    assert namespace["trainer"]["callbacks"][0].budget == budget.usable
