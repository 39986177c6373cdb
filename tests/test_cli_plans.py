"""``memkit`` answers for the run a Trainer makes: a plain model's step in Lightning's order (the previous
step's gradients alive through the forward), an ``hf:`` model's weights in the dtype its config records,
plans across DDP and FSDP2 when several GPUs are given, and every model-free argument checked before
anything is imported or simulated."""

import contextlib
import json
import time
import warnings

import lightning.pytorch as pl
import pytest
import torch
from helpers import run_cli
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
    return ["estimate", "--model", model, "--batch-size", str(B), "--seq-len", str(T), "--device", "cpu", *extra]


def _trainer_peak(config) -> int:
    """The allocator's highest peak of a Trainer's steps 2 and 3 (the first has no gradients yet)."""
    torch.manual_seed(0)
    x = torch.randint(0, WIDE_LLAMA["vocab_size"], (3 * B, T))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x), batch_size=B)
    peaks = AllocatorPeaks()
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=3, logger=False, callbacks=peaks.around(),
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
    )  # fmt: skip
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
        "weights: bfloat16 (config.json's dtype (fp32 where it records none), as from_pretrained and "
        "from_config load them); 32-true trains them as they are"
    )
    status, out, _ = run_cli(["advise", "--model", f"hf:{tmp_path}", "--batch-size", "2", "--seq-len", "32"])
    assert status == 0 and "weights: bfloat16 (config.json's dtype" in out


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
    with pytest.warns(UserWarning, match="overrides configure_model, which a Trainer runs"):
        expected = estimate_memory(by_hand, (x, x), device="cpu")  # it cannot know the hook ran
    with warnings_as_errors():
        report = _json(["estimate", "--model", "test_cli_plans:BuiltInConfigureModel", "--batch-size", str(B),
                        "--seq-len", str(T), "--device", "cpu"])  # fmt: skip
    assert report["simulated"] == expected.as_dict()


def test_estimate_memory_says_configure_model_did_not_run():
    """Called on a module whose configure_model a Trainer has yet to run, estimate_memory says so."""
    with torch.device("meta"):
        module = BuiltInConfigureModel()
        module.net = torch.nn.Sequential(torch.nn.Embedding(64, 32), torch.nn.Linear(32, 64))
    x = torch.zeros(B, T, dtype=torch.long, device="meta")
    with pytest.warns(UserWarning, match=r"BuiltInConfigureModel.configure_model\(\) first, as the Trainer will"):
        estimate_memory(module, (x, x), device="cpu")
    plain = torch.nn.Sequential(torch.nn.Embedding(64, 32, device="meta"), torch.nn.Linear(32, 64, device="meta"))
    with warnings_as_errors():  # a module without the hook: nothing to say
        estimate_memory(plain, (x, x), optimizer="adamw", loss_fn=lambda out, y: out.sum(), device="cpu")


@contextlib.contextmanager
def warnings_as_errors():
    """The configure_model warning as an error: the test fails where it shows."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*configure_model.*")
        yield


def _fsdp2(gpus: int) -> dict:
    return _json(["estimate", "--model", "tiny", "--batch-size", "1", "--seq-len", "32", "--strategy", "fsdp2",
                  "--gpus", str(gpus)])  # fmt: skip


def test_fsdp2_estimate_time_does_not_grow_with_the_ranks():
    """One rank's step costs the same at 4,096 ranks as at 8 (it took 16x as long at 2,048: every other
    rank's chunk of every parameter was made), and is the step torch's own chunking gives."""
    small, large = _fsdp2(8), _fsdp2(4096)
    assert large["simulated_seconds"] < 3 * small["simulated_seconds"] + 1.0, (small, large)


@pytest.mark.slow
def test_fsdp2_rank_zero_chunks_are_torchs(monkeypatch):
    from lightning_memkit._sharding import fsdp2

    for gpus in (300,):  # uneven shards, padded; more ranks than most parameters have rows
        ours = _fsdp2(gpus)["simulated"]
        with monkeypatch.context() as m:
            m.setattr(fsdp2, "_rank_zero_chunks", contextlib.nullcontext)
            assert _fsdp2(gpus)["simulated"] == ours, gpus
