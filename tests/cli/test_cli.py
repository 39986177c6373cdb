"""``memkit estimate`` and ``memkit plan`` through `main`, in-process: the numbers are the library calls',
the table and the two lines under it show them, and the printed plan is code that runs. One test runs the
installed console script (each process imports torch and Lightning: seconds)."""

import ast
import inspect
import json
import re
import sys

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from helpers import run_cli
from models import tiny_lm
from torch import nn

from lightning_memkit import (
    ActivationCheckpointing,
    AutoFit,
    FusedOptimizerStep,
    estimate_memory,
    format_bytes,
    parse_budget,
    plan_fit,
)
from lightning_memkit._checkpointing.policies import CheckpointPlan
from lightning_memkit._estimating.analytic import TransformerShape, estimate_analytic, shard
from lightning_memkit._fitting.plan import FitPlan
from lightning_memkit.cli._plan import plan_code
from lightning_memkit.demos.gpt import GPTConfig, GPTLightningModule

TINY = ["estimate", "--model", "tiny", "--batch-size", "2", "--seq-len", "32", "--device", "cpu"]
BF16 = ["estimate", "--model", "tiny", "--batch-size", "4", "--seq-len", "64", "--precision", "bf16-mixed"]


_run = run_cli


def _json(argv):
    status, out, err = _run([*argv, "--json"])
    assert status == 0, err
    return json.loads(out)


def _tokens(batch_size, seq_len):
    x = torch.zeros(batch_size, seq_len, dtype=torch.long, device="meta")  # (B, T) token ids
    return x, x.clone()


def _tiny():
    with torch.device("meta"):
        return GPTLightningModule("tiny")


def _signed(n):
    return f"+{format_bytes(n)}" if n > 0 else format_bytes(n)


@pytest.fixture(scope="module")
def bf16():
    """``memkit estimate --json`` of the tiny GPT at 4 x 64 in bf16-mixed, shared by the tests reading it."""
    return _json([*BF16, "--device", "cpu"])


# --- memkit estimate: the numbers ----------------------------------------------------------------------


def test_json_numbers_are_the_library_calls(bf16):
    simulated = estimate_memory(_tiny(), _tokens(4, 64), precision="bf16-mixed", device="cpu")
    shape = TransformerShape.from_config(GPTConfig.from_name("tiny"))
    analytic = estimate_analytic(shape, 4, 64, precision="bf16-mixed", optimizer="adamw", attention="sdpa")
    assert bf16["simulated"] == simulated.as_dict()
    assert bf16["analytic"] == analytic.as_dict()
    assert bf16["difference"] == {
        name: bf16["simulated"][name] - bf16["analytic"][name] for name in bf16["analytic"]
    }
    assert bf16["optimizer"] is None  # the module's own configure_optimizers
    assert bf16["optimizer_used"] == "adamw (configure_optimizers)"
    assert bf16["simulated_seconds"] > 0


def test_accumulate_simulates_the_highest_micro_batch():
    report = _json([*TINY, "--accumulate", "4"])
    accumulating = estimate_memory(_tiny(), _tokens(2, 32), device="cpu", accumulating=True)
    assert report["simulated"] == accumulating.as_dict()
    assert accumulating.peak > estimate_memory(_tiny(), _tokens(2, 32), device="cpu").peak


def test_sharding_applies_to_both_columns_per_rank():
    report = _json([*TINY, "--optimizer", "adamw", "--gpus", "4", "--strategy", "fsdp"])
    simulated = estimate_memory(_tiny(), _tokens(2, 32), optimizer="adamw", device="cpu")
    shape = TransformerShape.from_config(GPTConfig.from_name("tiny"))
    assert report["simulated"] == shard(simulated, "fsdp", 4).as_dict()
    analytic = estimate_analytic(shape, 2, 32, precision="32-true")
    assert report["analytic"] == shard(analytic, "fsdp", 4).as_dict()
    assert any("fsdp over 4 GPU(s)" in note for note in report["notes"])


@pytest.mark.slow
def test_fsdp2_simulates_one_ranks_sharded_step():
    """``--strategy fsdp2``: the simulated column is one rank's FSDP2 step (estimate_memory's), above the
    one-device step divided, which leaves out the unsharded units."""
    report = _json([*TINY, "--optimizer", "adamw", "--gpus", "4", "--strategy", "fsdp2"])
    simulated = estimate_memory(
        _tiny(), _tokens(2, 32), optimizer="adamw", device="cpu", strategy="fsdp2", world_size=4
    )
    assert report["simulated"] == simulated.as_dict()
    divided = shard(estimate_memory(_tiny(), _tokens(2, 32), optimizer="adamw", device="cpu"), "fsdp", 4)
    assert simulated.parameters > divided.parameters
    assert any("one rank's step of 4 under FSDP2 simulated" in note for note in report["notes"])


def test_selective_half_checkpointing_in_both_columns():
    report = _json([*TINY, "--checkpointing", "selective_half"])
    simulated = estimate_memory(_tiny(), _tokens(2, 32), device="cpu", checkpointing="selective_half")
    shape = TransformerShape.from_config(GPTConfig.from_name("tiny"))
    analytic = estimate_analytic(shape, 2, 32, precision="32-true", checkpointing="selective_half")
    assert report["simulated"] == simulated.as_dict() and report["analytic"] == analytic.as_dict()
    assert report["checkpointing"] == "selective_half"


# --- memkit estimate: the table and the explanation -------------------------------------------------


def test_difference_is_explained(bf16):
    difference = bf16["difference"]
    trust, why = bf16["notes"][:2]
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
def test_table_has_the_three_columns_and_the_explanation(bf16, monkeypatch, rich):
    if not rich:  # the plain-text table, as without rich installed
        monkeypatch.setitem(sys.modules, "rich.console", None)
    status, out, _ = _run([*BF16, "--device", "cpu"])
    assert status == 0
    lines = out.splitlines()
    assert lines[0] == (
        "Peak memory of one training step: tiny, batch 4 x 64, bf16-mixed, adamw (configure_optimizers), cpu"
    )
    header = next(line for line in lines if "category" in line)
    assert header.index("analytic") < header.index("simulated") < header.index("difference")
    for name, diff in bf16["difference"].items():
        row = next(line for line in lines if re.search(rf"\b{name}\b", line))
        analytic, simulated = format_bytes(bf16["analytic"][name]), format_bytes(bf16["simulated"][name])
        assert simulated in row[row.index(analytic) + len(analytic) :], row
        assert row.rstrip(" │").endswith(_signed(diff)), row
    assert ("┃" in header) is rich
    assert "Plan with the simulated column" in out and bf16["notes"][1] in out


def wide_vocab():
    """A GPT whose logits dwarf it: its bf16-mixed step peaks in the loss's backward, before any gradient."""
    return GPTLightningModule(GPTConfig(vocab_size=8192, block_size=64, n_layer=1, n_head=2, n_embd=32))


def test_explanation_of_a_peak_before_the_gradients_exist():
    argv = ["estimate", "--model", "test_cli:wide_vocab", "--batch-size", "8", "--seq-len", "64"]
    report = _json([*argv, "--precision", "bf16-mixed", "--device", "cpu"])
    difference, simulated = report["difference"], report["simulated"]
    trust, why = report["notes"][:2]
    assert "peak falls in the backward, at aten._log_softmax_backward_data." in trust
    ratio = simulated["peak"] / report["analytic"]["peak"]
    assert why.startswith(f"simulated - analytic: {_signed(difference['peak'])} ({ratio:.2f}x): ")
    assert simulated["gradients"] == 0 and difference["gradients"] < 0
    parts = [f"{c} {_signed(difference[c])}" for c in ("temporary", "activations", "gradients")]
    assert f": {', '.join(parts)}." in why  # the largest difference first
    assert "(8 x 64 x 8,192 = 16.00 MiB per fp32 copy)" in why
    assert "counts every gradient as live (none exists at the simulated peak)" in why


# --- memkit estimate: the user's models --------------------------------------------------------------


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


def test_a_users_lightning_module_with_its_own_example_batch():
    argv = ["estimate", "--model", "test_cli:Regressor", "--batch-size", "4", "--seq-len", "10"]
    report = _json([*argv, "--device", "cpu"])
    direct = estimate_memory(Regressor(), Regressor().example_batch(4, 10), device="cpu")
    assert report["simulated"] == direct.as_dict()
    assert report["simulated"]["optimizer_state"] == 4 * (16 * 64 + 64 + 64 + 1)  # SGD momentum
    assert report["optimizer_used"] == "sgd_momentum (configure_optimizers)"
    assert report["analytic"] is None and report["difference"] is None  # no GPTConfig to compute it from
    assert not any(note.startswith("Plan with") for note in report["notes"])


def test_a_plain_module_factory_is_stepped_as_a_language_model():
    report = _json(["estimate", "--model", "models:tiny_lm", "--batch-size", "3", "--seq-len", "7"])
    x = torch.zeros(3, 7, dtype=torch.long)
    loss = lambda out, y: F.cross_entropy(out.flatten(0, -2), y.flatten())  # noqa: E731
    direct = estimate_memory(tiny_lm(), (x, x), optimizer="adamw", loss_fn=loss)
    assert report["simulated"] == direct.as_dict()
    assert report["optimizer_used"] == "adamw"


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
        (
            ["--optimizer", "adam"],
            r"Unknown optimizer 'adam'; valid: adamw, .*sgd_kahan\. Did you mean 'adamw'",
        ),
        (["--strategy", "zero4"], r"Unknown strategy 'zero4'; valid: ddp, "),
        (
            ["--checkpointing", "half"],
            r"Unknown checkpointing 'half'; valid: none, selective, selective_half",
        ),
    ],
)
def test_errors_are_one_line_with_status_2(args, message):
    base = {"--model": "tiny", "--batch-size": "2", "--seq-len": "8"}
    base.update(dict(zip(args[::2], args[1::2], strict=True)))
    status, _, err = _run(["estimate", *[item for pair in base.items() for item in pair]])
    assert status == 2
    assert err.startswith("memkit estimate: error: ") and err.count("\n") == 1, err
    assert re.search(message, err), err


# --- plain Hugging Face models (tests/zoo.py: tiny random configs) -------------------------------


class _TrainsItself(nn.Module):
    """How memkit steps a Hugging Face model, as documented: ``model(input_ids=x, labels=x)``; the loss
    is then its output's ``.loss`` (a model without ``labels``: cross-entropy over its first output)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        if "labels" in inspect.signature(self.model.forward).parameters:
            return self.model(input_ids=x, labels=x)
        return self.model(input_ids=x)


def _own_loss(output, y):
    if output.get("loss") is not None:
        return output.loss
    hidden = output[0]  # (B, T, n_embd)
    return F.cross_entropy(hidden.flatten(0, -2), y.flatten())


class _InALightningModule(pl.LightningModule):
    """The LightningModule a user writes around it: the step memkit simulates by default, in Lightning's
    order (training_step, zero_grad, backward, step)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def training_step(self, batch, batch_idx):
        x, y = batch
        return _own_loss(self.model(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters())


def _hf_direct(factory, batch_size, seq_len):
    with torch.device("meta"):
        model = _TrainsItself(factory())
    lightning = _InALightningModule(model)
    return model, estimate_memory(lightning, _tokens(batch_size, seq_len))


def _hf_plain_loop(factory, batch_size, seq_len):
    """``--loop plain``'s step: zero_grad, forward, backward, step."""
    with torch.device("meta"):
        model = _TrainsItself(factory())
    return estimate_memory(model, _tokens(batch_size, seq_len), optimizer="adamw", loss_fn=_own_loss)


def gpt2_base():
    """GPT-2 without its head: no ``labels`` argument, so the loss is over its hidden states."""
    from transformers import GPT2Config, GPT2Model

    return GPT2Model(GPT2Config(vocab_size=128, n_embd=32, n_layer=1, n_head=4, n_positions=16))


@pytest.mark.parametrize("name", ["gpt2", "qwen2"])
def test_a_hugging_face_model_factory(name):
    import zoo

    argv = ["estimate", "--model", f"zoo:_{name}", "--batch-size", "2", "--seq-len", "16"]  # --device cuda
    report = _json(argv)
    model, direct = _hf_direct(zoo.MODELS[name][0], 2, 16)
    assert report["simulated"] == direct.as_dict()
    assert report["optimizer_used"] == "adamw"
    n = sum(p.numel() for p in model.parameters())
    # The analytic column reads the Hugging Face config (GQA for Qwen2) and counts the parameters exactly.
    assert report["analytic"]["parameters"] == 4 * n == report["analytic"]["gradients"]
    assert report["analytic"]["optimizer_state"] == 8 * n + 4 * len(list(model.parameters()))  # AdamW
    assert any(f"from {type(model.model).__name__}'s config" in note for note in report["notes"])
    assert (report["precision"], report["device"]) == ("32-true", "cuda")  # the defaults


def test_a_hugging_face_model_without_labels_is_stepped_on_its_first_output():
    argv = ["estimate", "--model", "test_cli:gpt2_base", "--batch-size", "2", "--seq-len", "8"]
    _, direct = _hf_direct(gpt2_base, 2, 8)
    assert _json(argv)["simulated"] == direct.as_dict()
    assert _json([*argv, "--loop", "plain"])["simulated"] == _hf_plain_loop(gpt2_base, 2, 8).as_dict()


def test_analytic_column_says_why_it_does_not_apply():
    argv = ["estimate", "--model", "zoo:_bert", "--batch-size", "2", "--seq-len", "16", "--device", "cpu"]
    report = _json(argv)
    assert report["analytic"] is None and report["simulated"]["peak"] > 0
    assert any("not available for BertForMaskedLM" in n and "decoder-only" in n for n in report["notes"])
    status, _, err = _run(["estimate", "--model", "zoo:_gpt2", "--batch-size", "2", "--seq-len", "65"])
    assert status == 2 and "--seq-len 65 exceeds the model's block_size of 64" in err


# --- memkit plan --------------------------------------------------------------------------------------


def _plan_code(out):
    return out.split("The plan as code (Python):\n", 1)[1].rsplit("\nplanned in ", 1)[0]


def _trainer_calls(code):
    """The keyword arguments of each ``Trainer(...)`` call in ``code``, as Python values or source."""
    calls = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Trainer":
            calls.append({k.arg: _value(k.value) for k in node.keywords})
    return calls


def _value(node):
    try:
        return ast.literal_eval(node)
    except ValueError:
        return ast.unparse(node)


def test_plan_prints_its_set_up_as_code_that_runs(monkeypatch, tmp_path):
    report = _json(["plan", "--model", "tiny", "--gpu", "T4", "--global-batch", "8", "--seq-len", "32"])
    code = report["code"]
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


@pytest.mark.slow
def test_plan_code_names_sharding_checkpointing_and_the_optimizer_swap():
    """A card too small for the micro-batch of 16 without checkpointing, 8 ranks, one optimizer allowed."""
    argv = ["plan", "--model", "tiny", "--gpu", "648MB", "--gpus", "8", "--strategy", "fsdp"]
    argv += ["--global-batch", "128", "--seq-len", "64", "--precision", "bf16-mixed"]
    report = _json([*argv, "--optimizer", "adamw8bit", "--margin", "0.2"])
    assert report["micro_batch_size"] == 16 and report["checkpointing"] != "none"
    code = report["code"]
    autofit, by_hand = _trainer_calls(code)
    sharded = {"precision": "bf16-mixed", "strategy": "fsdp", "devices": 8}
    # the card less the CUDA context and reserve, written as the user gave it (not its usable bytes)
    callback = "[AutoFit(budget='auto', margin=0.2, optimizers=['adamw8bit'])]"
    assert autofit == {**sharded, "callbacks": callback}
    # One policy for every block: a per-block split ("2 selective, 2 full") is written as its strongest
    # mode, since ActivationCheckpointing cannot plan a budget under FSDP.
    modes = [part.split(" ")[-1] for part in report["checkpointing"].split(", ")]
    strongest = max(modes, key=("none", "selective", "selective_half", "full").index)
    assert by_hand == {
        "accumulate_grad_batches": 1,
        **sharded,
        "callbacks": f"[ActivationCheckpointing(checkpointing='{strongest}')]",
    }
    if len(modes) > 1:
        assert f"under fsdp every block gets {strongest}: it fits too" in code
    assert "here 16;" in code and "\nbatch_size = 16\n" in code and "a 648MB card leaves" in code
    assert "    return bitsandbytes.optim.AdamW8bit(" in code
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
    assert namespace["trainer"]["callbacks"][0].budget == "auto"  # the card the run is on


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "deepspeed_stage_3"])
def test_plan_code_writes_a_per_block_plan_each_strategy_can_run(strategy):
    """A per-block plan ("2 none, 2 full") is ActivationCheckpointing(budget=the step's limit) under DDP,
    which plans the split itself; a sharded strategy cannot plan that budget (FSDP refuses it, ZeRO-3's
    simulated step is unsharded), so there every block gets the plan's strongest mode, which fits too."""
    blocks = [{"name": f"model.blocks.{i}", "mode": "none" if i < 2 else "full"} for i in range(4)]
    plan = FitPlan(
        micro_batch_size=4, accumulate_grad_batches=2, checkpointing="2 none, 2 full", optimizer="adamw",
        precision="bf16-mixed", estimated_peak=10**9, budget=parse_budget("A100-40GB"), strategy=strategy,
        world_size=2, checkpoint_plan=CheckpointPlan.from_dict({"blocks": blocks}),
    )  # fmt: skip
    code = plan_code(plan, GPTLightningModule("tiny"), global_batch=16, optimizers=None)
    _, by_hand = _trainer_calls(code)
    if strategy == "ddp":
        assert by_hand["callbacks"] == f"[ActivationCheckpointing(budget='{plan.limit // 10**6}MB')]"
    else:
        assert by_hand["callbacks"] == "[ActivationCheckpointing(checkpointing='full')]"
        assert f"under {strategy} every block gets full: it fits too" in code


def test_plan_at_bf16_true_prints_the_kahan_optimizer_for_both_set_ups():
    """bf16-true is planned with the Kahan-summed AdamW; AutoFit keeps the Trainer's optimizer unless told,
    so the printed AutoFit names the Kahan candidates (found by a hostile review: it trained plain AdamW)."""
    argv = ["plan", "--model", "tiny", "--gpu", "1GB", "--global-batch", "8", "--seq-len", "64"]
    report = _json([*argv, "--precision", "bf16-true"])
    assert (report["optimizer"], report["precision"]) == ("adamw_kahan", "bf16-true")
    autofit, _ = _trainer_calls(report["code"])
    budget = "'auto'"  # the card the run is on (issue 46 item 6)
    assert autofit["callbacks"] == f"[AutoFit(budget={budget}, optimizers=['adamw_kahan', 'sgd_kahan'])]"
    assert "    return optimi.AdamW(" in report["code"]  # built in configure_optimizers, not a comment


@pytest.mark.slow
def test_plan_for_the_fused_step_keeps_one_micro_batch_and_prints_the_callback():
    """``--fused-step``: the step inside backward cannot accumulate, so the micro-batch is the global batch,
    and both Trainers in the code carry FusedOptimizerStep; on several GPUs under DDP it is refused, saying
    why, and planned with FSDP2 where no strategy is named."""
    argv = ["plan", "--model", "tiny", "--gpu", "1GB", "--global-batch", "64", "--seq-len", "128"]
    report = _json([*argv, "--fused-step"])
    assert (report["micro_batch_size"], report["accumulate_grad_batches"]) == (64, 1)
    autofit, by_hand = _trainer_calls(report["code"])
    assert autofit["callbacks"].endswith(", FusedOptimizerStep()]")
    assert by_hand["callbacks"] == "[FusedOptimizerStep()]"
    assert "from lightning_memkit import AutoFit, FusedOptimizerStep\n" in report["code"]
    namespace = {"Trainer": dict}
    exec(report["code"].replace("from lightning.pytorch import Trainer\n", ""), namespace)
    assert isinstance(namespace["trainer"]["callbacks"][0], FusedOptimizerStep)
    status, _, err = _run([*argv, "--fused-step", "--gpus", "2", "--strategy", "ddp"])
    assert status == 2 and "--fused-step cannot run under --strategy ddp" in err  # in the command's words
    assert "--gpus 1 or --strategy fsdp2" in err and "or --release-gradients instead" in err
    assert "=" not in err.splitlines()[-1]  # no keyword of plan_fit's
    status, _, err = _run([*argv, "--offload", "--gpus", "2"])
    assert status == 2 and "--offload runs the optimizer on one process" in err and "--gpus 1" in err
    sharded = _json([*argv, "--fused-step", "--gpus", "2"])  # no strategy named: FSDP2, which can
    assert sharded["strategy"] == "fsdp2" and sharded["strategy_choice"] == (
        "strategy: fsdp2 over 2 GPUs (The optimizer step fused into backward cannot run under ddp: "
        "--strategy ddp says why)"
    )
    small = [*argv[:4], "600MB", *argv[5:], "--fused-step", "--optimizer", "sgd"]
    status, _, err = _run(small)  # nothing fits: the floor has no gradients, and no FSDP is suggested
    assert status == 2 and "(parameters + optimizer state: the fused step holds no gradients)" in err
    assert "fsdp" not in err.lower()
    status, _, err = _run([*argv, "--fused-step", "--release-gradients"])
    assert status == 2 and "not allowed with argument" in err


def test_plan_prints_the_plan_its_alternatives_and_the_code(monkeypatch):
    import lightning_memkit._fitting.simulations as simulations

    monkeypatch.setattr(simulations, "PROGRESS_AFTER_S", 0.0)  # as if planning were slow
    argv = ["plan", "--model", "zoo:_gpt2", "--gpu", "T4", "--global-batch", "4", "--seq-len", "16"]
    status, out, err = _run(argv)
    assert status == 0, err
    assert "memkit plan: simulating micro-batch" in err  # progress goes to stderr
    assert out.startswith("zoo:_gpt2 on T4, global batch 4 x 16:\n")
    table, code = out.split("The plan as code (Python):\n")
    chosen = next(line for line in table.splitlines() if line.rstrip(" │").endswith("chosen"))
    assert re.search(r"\b4\b.*\b1\b.*none.*adamw.*32-true", chosen), table  # micro-batch 4, accumulate 1
    assert "\nbatch_size = 4\n" in code and "accumulate_grad_batches=1" in code
    assert re.search(r"\nplanned in [\d.]+ s \(\d+ simulated steps\)\n$", code), code
    # the terse column is explained under the table (issue 49): m, the micro-batch per GPU
    header = next(line for line in table.splitlines() if "accumulate" in line and "fits" in line)
    assert re.match(r"\W+m\W", header), header
    legend = table.rstrip("\n").splitlines()[-1]
    assert legend.startswith("m: the micro-batch, the DataLoader's batch_size on each GPU; "), table


@pytest.mark.slow  # planning-heavy: every candidate is a sharded simulation
def test_plan_for_fsdp2_simulates_the_sharded_step_and_prints_its_set_up():
    """``--strategy fsdp2``: every candidate is one rank's FSDP2 step simulated (estimate_memory's), and the
    code is AutoFitStrategy (which makes the plan and shards), then ModelParallelStrategy with the
    fully_shard layout set by hand."""
    plan = plan_fit(
        _tiny(), _tokens(32, 32), 10 * 2**20, optimizers=["adamw"], strategy="fsdp2", world_size=4,
        device="cpu", cost="flops",
    )  # fmt: skip
    batch = _tokens(32 // 4, 32)
    micro = [t[: plan.micro_batch_size] for t in batch]
    simulated = estimate_memory(
        _tiny(), micro, optimizer="adamw", device="cpu", strategy="fsdp2", world_size=4,
        checkpointing=plan.checkpoint_plan or plan.checkpointing,
        accumulating=plan.accumulate_grad_batches > 1,
    )  # fmt: skip
    assert plan.estimated_peak == simulated.peak <= plan.limit
    code = plan_code(plan, _tiny(), global_batch=32, optimizers=["adamw"])
    planned, by_hand = _trainer_calls(code)
    assert planned["strategy"] == "AutoFitStrategy(budget=10485760, optimizers=['adamw'])"
    assert planned["devices"] == by_hand["devices"] == 4 and "callbacks" not in planned
    assert by_hand["strategy"] == "ModelParallelStrategy(data_parallel_size=4, tensor_parallel_size=1)"
    reshard = "" if plan.reshard_after_forward else ", reshard_after_forward=False"
    assert f"fully_shard(self.model, mesh=mesh{reshard})" in code
    assert "AutoFit(" not in code


@pytest.mark.slow  # planning-heavy: every candidate is a sharded simulation
def test_a_plan_without_resharding_shows_its_own_peak_in_the_table():
    """Room to spare: FSDP2 keeps the unsharded parameters from forward to backward, a higher peak than
    the configuration's default-resharding simulation; the chosen row of the table has that peak too."""
    plan = plan_fit(
        _tiny(), _tokens(32, 32), 64 * 2**20, optimizers=["adamw"], strategy="fsdp2", world_size=4,
        device="cpu", cost="flops", checkpointing=("none",),
    )  # fmt: skip
    assert plan.reshard_after_forward is False
    key = (plan.micro_batch_size, plan.checkpointing, plan.optimizer, plan.precision)
    rows = [
        a for a in plan.alternatives if (a.micro_batch_size, a.checkpointing, a.optimizer, a.precision) == key
    ]
    assert [row.peak for row in rows] == [plan.estimated_peak]
