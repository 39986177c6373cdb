"""``memkit`` answers for the run a Trainer makes: a plain model's step in Lightning's order (the previous
step's gradients alive through the forward), an ``hf:`` model's weights in the dtype its config records,
plans across DDP and FSDP2 when several GPUs are given, and every model-free argument checked before
anything is imported or simulated."""

import argparse
import contextlib
import json
import re
import warnings

import lightning.pytorch as pl
import pytest
import torch
from helpers import cpu_trainer, run_cli
from test_cli_hf import CausalLM

from lightning_memkit import estimate_memory
from lightning_memkit.testing import AllocatorPeaks

transformers = pytest.importorskip("transformers")

#: A LLaMA whose weights outweigh its activations at batch 2 x 32: the gradients Lightning keeps through
#: the forward are a large share of the step's peak.
WIDE_LLAMA = dict(
    hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=512, max_position_embeddings=64,
)  # fmt: skip
B, T = 2, 32


def _json(argv):
    status, out, err = run_cli([*argv, "--json"])
    assert status == 0, err
    return json.loads(out)


def _estimate(model, *extra):
    return [
        "estimate",
        "--model",
        model,
        "--batch-size",
        str(B),
        "--seq-len",
        str(T),
        "--device",
        "cpu",
        *extra,
    ]


def _trainer_peak(config) -> int:
    """The allocator's highest peak of a Trainer's steps 2 and 3 (the first has no gradients yet)."""
    torch.manual_seed(0)
    x = torch.randint(0, WIDE_LLAMA["vocab_size"], (3 * B, T))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x), batch_size=B)
    peaks = AllocatorPeaks()
    trainer = cpu_trainer(None, peaks.around(), max_steps=3)
    trainer.fit(CausalLM(config), loader)
    return max(peaks.peaks[1:])


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory):
    directory = tmp_path_factory.mktemp("hf") / "wide-llama"
    transformers.LlamaConfig(**WIDE_LLAMA).save_pretrained(directory)
    return directory


def test_hf_estimate_is_the_step_of_a_lightning_module(wide_llama):
    """The default step is the one a LightningModule around the model runs (training_step, zero_grad,
    backward, step), simulated by hand; ``--loop plain`` (zero_grad first) is the plain loop's."""
    model = f"hf:{wide_llama}"
    config = transformers.AutoConfig.from_pretrained(wide_llama)
    with torch.device("meta"):
        module = CausalLM(config)
    x = torch.zeros(B, T, dtype=torch.long, device="meta")
    by_hand = estimate_memory(module, (x, x), device="cpu")
    assert _json(_estimate(model))["simulated"] == by_hand.as_dict()
    plain = _json(_estimate(model, "--loop", "plain"))["simulated"]
    # the gradients the Trainer keeps through the forward: the plain loop reads lower
    assert plain["peak"] < by_hand.peak - 0.15 * by_hand.gradients


@pytest.mark.slow
def test_hf_estimate_is_the_trainers_step(wide_llama):
    """Within 0.01 % of the Trainer's allocator peak (the plain loop the CLI ran before: -4.4 %)."""
    model = f"hf:{wide_llama}"
    lightning = _json(_estimate(model))["simulated"]
    plain = _json(_estimate(model, "--loop", "plain"))["simulated"]
    truth = _trainer_peak(transformers.AutoConfig.from_pretrained(wide_llama))
    assert lightning["peak"] == pytest.approx(truth, rel=1e-4)
    assert plain["peak"] < 0.98 * truth


def test_hf_weights_are_in_the_dtype_the_config_records(tmp_path):
    """A config saved as bf16 builds bf16 weights (as from_pretrained and from_config load them), and the
    command says so; bf16-true is the same step."""
    transformers.LlamaConfig(**WIDE_LLAMA, dtype="bfloat16").save_pretrained(tmp_path)
    n = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(
        transformers.LlamaConfig(**WIDE_LLAMA), dtype=torch.float32).parameters())  # fmt: skip
    report = _json(_estimate(f"hf:{tmp_path}"))
    assert report["simulated"]["parameters"] == pytest.approx(2 * n, abs=1024)  # + the rotary table
    weights = next(note for note in report["notes"] if note.startswith("weights: "))
    assert weights == (
        "weights: bfloat16, config.json's dtype (fp32 where it records none), as from_pretrained and "
        "from_config load them; 32-true trains them as they are"
    )
    status, out, _ = run_cli(["advise", "--model", f"hf:{tmp_path}", "--batch-size", "2", "--seq-len", "32"])
    assert status == 0 and "weights: bfloat16, config.json's dtype" in out


class BuiltInConfigureModel(pl.LightningModule):
    """A language model whose layers exist only once ``configure_model`` has run, as Lightning documents
    building large models."""

    def __init__(self):
        super().__init__()
        self.net = None

    def configure_model(self):
        if self.net is None:  # idempotent, as Lightning asks
            self.net = torch.nn.Sequential(torch.nn.Embedding(64, 32), torch.nn.Linear(32, 64))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x).flatten(0, 1), y.flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters())


def test_the_cli_runs_configure_model_as_the_trainer_does():
    """Before the step, as ``Trainer.fit`` does: the layers it builds are simulated (it was refused with "has
    no parameters" before), and nothing warns that it did not run."""
    with torch.device("meta"):
        by_hand = BuiltInConfigureModel()
        by_hand.configure_model()
    x = torch.zeros(B, T, dtype=torch.long, device="meta")
    with warnings_as_errors():
        expected = estimate_memory(by_hand, (x, x), device="cpu")
        report = _json(["estimate", "--model", "test_cli_plans:BuiltInConfigureModel", "--batch-size", str(B),
                        "--seq-len", str(T), "--device", "cpu"])  # fmt: skip
    assert report["simulated"] == expected.as_dict()


class CompiledInConfigureModel(BuiltInConfigureModel):
    """The way Lightning documents compiling: in configure_model."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Embedding(64, 32), torch.nn.Linear(32, 64))

    def configure_model(self):
        if not isinstance(self.net, torch._dynamo.eval_frame.OptimizedModule):
            self.net = torch.compile(self.net)


def test_estimate_memory_says_configure_model_did_not_run():
    """Called on a module whose configure_model a Trainer has yet to run, and which would change the module
    (compile it: tried on a copy, on the meta device), estimate_memory says so; not where the hook has run,
    or changes nothing (it warned whenever the hook was overridden and nothing was compiled)."""
    x = torch.zeros(B, T, dtype=torch.long, device="meta")
    with torch.device("meta"):
        compiled, built = CompiledInConfigureModel(), BuiltInConfigureModel()
    with pytest.warns(
        UserWarning, match=r"CompiledInConfigureModel.configure_model\(\) first, as the Trainer"
    ):
        estimate_memory(compiled, (x, x), device="cpu")
    assert not isinstance(compiled.net, torch._dynamo.eval_frame.OptimizedModule)  # tried on a copy only
    compiled.configure_model()
    built.configure_model()
    with warnings_as_errors():  # the hook has run (compiled), or changes nothing now (idempotent)
        estimate_memory(compiled, (x, x), device="cpu")
        estimate_memory(built, (x, x), device="cpu")


@contextlib.contextmanager
def warnings_as_errors():
    """The configure_model warning as an error: the test fails where it shows."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*configure_model.*")
        yield


def _fsdp2(gpus: int) -> dict:
    argv = ["estimate", "--model", "tiny", "--batch-size", "1", "--seq-len", "32", "--strategy", "fsdp2"]
    return _json([*argv, "--gpus", str(gpus)])


def test_fsdp2_estimate_time_does_not_grow_with_the_ranks():
    """One rank's step costs the same at 4,096 ranks as at 8 (it took 16x as long at 2,048: every other
    rank's chunk of every parameter was made), and is the step torch's own chunking gives."""
    small, large = _fsdp2(8), _fsdp2(4096)
    assert large["simulated_seconds"] < 3 * small["simulated_seconds"] + 1.0, (small, large)


@pytest.mark.slow
def test_fsdp2_rank_zero_chunks_are_torchs(monkeypatch):
    from lightning_memkit._sharding import fake_pg

    for gpus in (300,):  # uneven shards, padded; more ranks than most parameters have rows
        ours = _fsdp2(gpus)["simulated"]
        with monkeypatch.context() as m:
            m.setattr(fake_pg, "_rank_zero_chunks", contextlib.nullcontext)
            assert _fsdp2(gpus)["simulated"] == ours, gpus


# --- every model-free argument checked before torch is imported (issue 46 item 9) ---------------------

ESTIMATE = ["estimate", "--model", "tiny", "--batch-size", "2", "--seq-len", "32"]
PLAN = ["plan", "--model", "tiny", "--global-batch", "8", "--seq-len", "32"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([*ESTIMATE, "--snapshot", "/nonexistent/x"], "cannot write /nonexistent/x: its folder /nonexistent "
         "does not exist; create it (mkdir -p /nonexistent) or give another path"),
        ([*ESTIMATE, "--html", "/nonexistent/x.html"], "its folder /nonexistent does not exist"),
        # a hostile pass: /proc's permission bits say writable, and the run wrote its report into nothing
        ([*ESTIMATE, "--html", "/proc/x.html"], "cannot write /proc/x.html: No such file or directory"),
        (["advise", *ESTIMATE[1:], "--html", "/"], "/ is a directory; give a file name in it"),
        ([*PLAN, "--gpu", "A100-40GB", "--refine-limit", "-1"], "must be a whole number, 0 or more, got"),
        ([*PLAN, "--gpu", "4090"], "'4090' reads as 4090 bytes; did you mean RTX-4090? Give a GPU name"),
        ([*ESTIMATE, "--gpu", "4090"], "did you mean RTX-4090?"),
        ([*PLAN, "--gpu", "A100-40GB", "--gpus", "3"], "--global-batch 8 does not split evenly across --gpus "
         "3; give a multiple of 3 (6 or 9)"),
        ([*PLAN, "--device", "cpu", "--memory", "A100-40GB"], "A100-40GB names a GPU; give a size instead"),
        ([*ESTIMATE, "--device", "cpu", "--gpu", "A100-40GB"], "A100-40GB names a GPU; give a size instead: "
         "--gpu 16GB"),
        (["advise", *ESTIMATE[1:], "--gpus", "2", "--strategy", "deepspeed_stage_3"], "Unknown strategy "
         "'deepspeed_stage_3'; valid: ddp, fsdp2"),
        (["estimate", "--model", "tiny", "--batch-size", "2000000", "--seq-len", "1000000"], "a batch of "
         "2000000 x 1000000 is 2,000,000,000,000 tokens, more than the 1,099,511,627,776 the simulation "
         "counts"),
    ],
    ids=lambda v: " ".join(v[-2:]) if isinstance(v, list) else "",
)  # fmt: skip
def test_a_bad_argument_is_refused_before_anything_is_imported(argv, message):
    """A usage error in a fraction of a second: torch, Lightning and transformers unimported, nothing
    simulated (``--snapshot /nonexistent/x`` was a traceback after the whole run)."""
    from test_cli_lazy import _memkit

    status, heavy, _, err = _memkit(*argv)
    assert (status, heavy) == (2, []), err
    assert err.startswith(f"memkit {argv[0]}: error: ") and err.count("\n") == 1, err
    assert message in err, err


def test_advise_spells_the_ranks_as_estimate_and_plan_do(capsys, tmp_path):
    """``--gpus N --strategy fsdp2``."""
    from lightning_memkit.cli import _advise

    seen = []
    with pytest.MonkeyPatch.context() as m:  # what run_advise is asked: the step's arguments, no simulation
        m.setattr(_advise, "run_advise", lambda args: seen.append((args.gpus, args.strategy)) or 0)
        assert run_cli(["advise", *ESTIMATE[1:], "--gpus", "4", "--strategy", "fsdp2"])[0] == 0
        assert run_cli(["advise", *ESTIMATE[1:], "--gpus", "4"])[0] == 0
    assert seen == [(4, "fsdp2"), (4, "ddp")]


def test_a_cpu_estimate_takes_nothing_off_its_memory():
    """``estimate --device cpu --gpu 1GB``: 1 GB of host memory, no CUDA context or reserve taken off."""
    status, out, err = run_cli([*ESTIMATE, "--device", "cpu", "--gpu", "1GB"])
    assert status == 0, err
    assert re.search(r"^Fits: [\d.]+ MiB of the 953.67 MiB usable on 1GB\.$", out, re.MULTILINE), out


def test_a_cpu_plan_names_no_gpu():
    """Nothing fits a CPU run's memory: the refusal says how much host memory would, never a GPU (it
    proposed "one T4 (15 GiB)")."""
    from lightning_memkit._budget import GPUS

    argv = [*PLAN, "--device", "cpu", "--memory", "2MB", "--precision", "32-true", "--optimizer", "adamw"]
    status, _, err = run_cli(argv)
    assert status == 2
    assert re.search(r"What would fit: [\d.]+ MiB of host memory at micro-batch 1; or allow a lower", err), (
        err
    )
    assert not any(name in err for name in GPUS) and "GPU" not in err, err


# --- several GPUs and no strategy named: DDP and FSDP2 both planned (issue 46 item 8) ----------------

#: tiny's AdamW step at 32-true holds 13.36 MiB of parameters, gradients and state: no DDP rank fits
#: 9 MB, four FSDP2 ranks do.
SHARDED = [
    *PLAN, "--device", "cpu", "--memory", "9MB", "--gpus", "4", "--precision", "32-true",
    "--optimizer", "adamw",
]  # fmt: skip


@pytest.fixture(scope="module")
def fsdp2_plan():
    return _json([*SHARDED, "--strategy", "fsdp2"])


@pytest.mark.slow  # three plans on fake ranks: 10 s each on two busy cores
def test_several_gpus_plan_fsdp2_where_ddp_does_not_fit(fsdp2_plan):
    """The plan is the one ``--strategy fsdp2`` gives, and says why it is FSDP2 (DDP was planned alone,
    and refused: "no single GPU or up to 64 FSDP ranks fits it")."""
    status, out, err = run_cli([*SHARDED, "--json"])
    assert status == 0, err
    assert "memkit plan: no DDP plan fits; planning FSDP2 over 4 GPUs" in err
    chosen = json.loads(out)
    why = "strategy: fsdp2 over 4 GPUs (no DDP plan fits: --strategy ddp says why)"
    assert chosen["strategy_choice"] == why
    for key in ("strategy", "micro_batch_size", "accumulate_grad_batches", "checkpointing", "estimated_peak"):
        assert chosen[key] == fsdp2_plan[key], key


@pytest.mark.slow
def test_a_ddp_refusal_names_the_fsdp2_plan(fsdp2_plan):
    """``--strategy ddp`` that nothing fits, where FSDP2 would: the refusal says so, with FSDP2's plan."""
    status, _, err = run_cli([*SHARDED, "--strategy", "ddp"])
    assert status == 2
    line = err.strip().splitlines()[-1]
    m, k = fsdp2_plan["micro_batch_size"], fsdp2_plan["accumulate_grad_batches"]
    assert line.startswith(
        "memkit plan: error: No plan fits 7.72 MiB (9MB, usable 8.58 MiB less the 10% margin) over 4 GPUs "
        f"(ddp). FSDP2 over 4 GPUs fits it: micro-batch {m} x {k}, "
    ), line
    assert line.endswith("a rank; give --strategy fsdp2, or leave --strategy out to plan both"), line
    assert "FSDP ranks" not in line


def test_several_gpus_keep_ddp_where_it_fits():
    chosen = _json([*PLAN, "--device", "cpu", "--memory", "1GB", "--gpus", "4", "--precision", "32-true"])
    assert chosen["strategy"] == "ddp"
    assert chosen["strategy_choice"] == (
        "strategy: ddp over 4 GPUs (it fits as asked; each rank keeps the whole model)"
    )


@pytest.mark.slow  # two plans of a 70B model: minutes on two cores
def test_llama_70b_on_64_h100s_is_planned_with_fsdp2():
    """The issue's case: DDP alone answered "no single GPU or up to 64 FSDP ranks fits it"."""
    argv = ["plan", "--model", "llama-70b", "--gpu", "H100-80GB", "--gpus", "64", "--global-batch", "256",
            "--seq-len", "4096"]  # fmt: skip
    chosen = _json(argv)
    assert chosen["strategy"] == "fsdp2" and chosen["strategy_choice"].startswith("strategy: fsdp2 over 64")
    assert chosen["estimated_peak"] <= chosen["limit"]


@pytest.mark.parametrize(
    ("ddp", "fsdp2", "chosen", "why"),
    [
        ("as asked", "as asked", "ddp", "it fits as asked"),
        ("relaxed", "as asked", "fsdp2", "DDP fits only by giving up more"),
        (None, "relaxed", "fsdp2", "no DDP plan fits"),
        ("relaxed", "relaxed", "ddp", "FSDP2 gives up as much or more"),
        ("relaxed", None, "ddp", "no FSDP2 plan fits"),
    ],
)
def test_which_strategy(monkeypatch, ddp, fsdp2, chosen, why):
    """DDP where it fits as asked (FSDP2 then not planned); else FSDP2 as asked; between two relaxed plans
    the one giving up less, DDP on a tie."""
    from lightning_memkit.cli import _plan

    planned = []

    def best_plan(model, batch, args, strategy, quiet=False):
        planned.append(strategy)
        outcome = {"ddp": ddp, "fsdp2": fsdp2}[strategy]
        if outcome is None:
            raise ValueError("No plan fits 1 B")
        return argparse.Namespace(strategy=strategy), outcome == "relaxed", []

    monkeypatch.setattr(_plan, "_best_plan", best_plan)
    monkeypatch.setattr(_plan, "_rank", lambda plan, model, args: (0, 0, 0))
    args = argparse.Namespace(strategy=None, gpus=8)
    plan, _, _, line = _plan._across_strategies(None, None, args)
    assert plan.strategy == chosen and line.startswith(f"strategy: {chosen} over 8 GPUs ({why}")
    assert planned == (["ddp"] if ddp == "as asked" else ["ddp", "fsdp2"])


def test_loop_plain_is_for_a_plain_module():
    status, _, err = run_cli([*ESTIMATE, "--loop", "plain"])
    assert status == 2 and err == (
        "memkit estimate: error: --loop plain steps a plain nn.Module; --model tiny is a LightningModule "
        "(GPTLightningModule), whose training_step runs in Lightning's order: leave --loop out\n"
    )


def test_neither_strategy_fits(monkeypatch):
    """Both refused for lack of memory: FSDP2's refusal, the sharded one, said to be the last word; a set-up
    DDP cannot run (the fused step) is DDP's refusal when FSDP2 cannot run it either."""
    from lightning_memkit.cli import _plan

    refusals = {"ddp": "No plan fits 1 B (ddp)", "fsdp2": "No plan fits 1 B (fsdp2)"}

    def best_plan(model, batch, args, strategy, quiet=False):
        raise ValueError(refusals[strategy])

    monkeypatch.setattr(_plan, "_best_plan", best_plan)
    args = argparse.Namespace(strategy=None, gpus=8)
    with pytest.raises(ValueError, match=re.escape(
        "Neither DDP nor FSDP2 over 8 GPUs fits (--strategy ddp says why DDP does not); FSDP2: No plan fits "
        "1 B (fsdp2)"
    )):  # fmt: skip
        _plan._across_strategies(None, None, args)
    refusals = {"ddp": "The optimizer step fused into backward cannot run under ddp", "fsdp2": "other"}
    with pytest.raises(ValueError, match=r"^The optimizer step fused into backward cannot run under ddp$"):
        _plan._across_strategies(None, None, args)


def test_a_config_transformers_cannot_read_is_one_line(tmp_path):
    """A hostile pass: config.json with "torch_dtype": "auto" (what from_pretrained takes, saved into the
    file) ended in transformers' raw AttributeError traceback."""
    import json

    from transformers import AutoConfig

    sizes = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    config = AutoConfig.for_model("llama", vocab_size=64, num_key_value_heads=1, **sizes)
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**saved, "torch_dtype": "auto", "dtype": "auto"}))
    status, _, err = run_cli(["estimate", "--model", f"hf:{tmp_path}", "--batch-size", "2", "--seq-len", "8"])
    assert status == 2 and "Traceback" not in err
    assert (
        f"reading {tmp_path / 'config.json'} failed: AttributeError" in err
        and len(err.strip().splitlines()) == 1
    )
