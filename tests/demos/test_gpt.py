"""The demo GPT: preset sizes, the model, its LightningModule and data, and the example script."""

import importlib.util
import itertools
import math
import runpy
import sys
from dataclasses import asdict
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils.checkpoint import checkpoint

from lightning_memkit import (
    ActivationCheckpointing,
    AutoFit,
    FusedOptimizerStep,
    GradientRelease,
    MemoryMonitor,
    OptimizerOffload,
    OptimizerSwap,
)
from lightning_memkit.demos._data import decode, encode, make_corpus
from lightning_memkit.demos.gpt import (
    GPT,
    PRESETS,
    Block,
    GPTConfig,
    GPTDataModule,
    GPTLightningModule,
    WarmupCosine,
    _rotate,
)

ROOT = Path(__file__).resolve().parents[2]
TRAIN_SCRIPT = ROOT / "examples" / "gpt" / "train.py"

# Hugging Face's counts for GPT-2 (tied head counted once) and Meta's for LLaMA-7B; tiny is ours.
PARAMETER_COUNTS = {
    "tiny": 875_264,
    "gpt2": 124_439_808,
    "gpt2-medium": 354_823_168,
    "gpt2-large": 774_030_080,
    "gpt2-xl": 1_557_611_200,
    "llama-7b": 6_738_415_616,
    "llama-70b": 68_976_648_192,
}

# A small LLaMA-style model: every option the GPT-2 presets leave off.
LLAMA_LIKE = dict(mlp="swiglu", d_ff=160, norm="rmsnorm", pos_embedding="rope", bias=False, tie_weights=False)


def small_config(**overrides) -> GPTConfig:
    return GPTConfig.from_name("tiny", **{"n_layer": 2, "n_embd": 64, "block_size": 32, **overrides})


def test_every_preset_has_a_tested_count():
    assert set(PRESETS) == set(PARAMETER_COUNTS)


def test_grouped_query_attention_is_attention_with_shared_key_value_heads():
    """n_kv_head=2 of 4: each key/value head serves two query heads; the same as full attention whose
    key/value projections repeat the grouped ones, and counted as the analytic shape counts it."""
    from lightning_memkit._estimating.analytic import TransformerShape, count_parameters

    torch.manual_seed(0)
    grouped = GPT(small_config(n_head=4, n_kv_head=2, **LLAMA_LIKE))
    assert sum(p.numel() for p in grouped.parameters()) == count_parameters(
        TransformerShape.from_config(grouped.config)
    )
    full = GPT(small_config(n_head=4, **LLAMA_LIKE))
    C, hs = 64, 16  # width and head size

    def repeated(w: torch.Tensor) -> torch.Tensor:  # (2 * hs, C) -> (4 * hs, C): heads 0, 0, 1, 1
        return w.view(2, 1, hs, C).expand(2, 2, hs, C).reshape(C, C)

    weights = dict(grouped.named_parameters())
    with torch.no_grad():
        for name, p in full.named_parameters():
            if name.endswith("c_attn.weight"):
                q, k, v = weights[name].split([C, 2 * hs, 2 * hs])
                p.copy_(torch.cat([q, repeated(k), repeated(v)]))
            else:
                p.copy_(weights[name])
    x = torch.randint(0, 256, (2, 16))
    torch.testing.assert_close(grouped(x)[0], full(x)[0])


@pytest.mark.parametrize(("name", "expected"), PARAMETER_COUNTS.items())
def test_preset_parameter_count(name, expected):
    with torch.device("meta"):
        model = GPT(GPTConfig.from_name(name))
    assert model.num_parameters() == expected
    assert all(p.is_meta for p in model.parameters())


def test_llama_has_no_position_table_or_biases():
    with torch.device("meta"):
        model = GPT(GPTConfig.from_name("llama-7b"))
    assert model.wpe is None
    assert not any(name.endswith("bias") for name, _ in model.named_parameters())
    assert model.lm_head.weight is not model.wte.weight


def test_unknown_preset_lists_valid_names():
    with pytest.raises(ValueError, match=r"Unknown GPT preset 'gpt3'; valid names: tiny, gpt2, gpt2-medium"):
        GPTConfig.from_name("gpt3")


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"mlp": "relu"}, "Unknown mlp 'relu'; choose one of 'gelu', 'swiglu'"),
        ({"norm": "batchnorm"}, "Unknown norm 'batchnorm'"),
        ({"pos_embedding": "alibi"}, "Unknown pos_embedding 'alibi'"),
        ({"n_embd": 130, "n_head": 4}, "n_embd=130 is not divisible by n_head=4"),
        ({"n_embd": 12, "n_head": 4, "pos_embedding": "rope"}, "RoPE needs an even head size, got .* = 3"),
    ],
)
def test_config_validation(overrides, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig(**overrides)


@pytest.mark.parametrize("overrides", [{}, LLAMA_LIKE, {"dropout": 0.1}, {"pos_embedding": "none"}])
def test_forward_shapes_and_initial_loss(overrides):
    torch.manual_seed(0)
    model = GPT(small_config(**overrides))
    idx, targets = torch.randint(0, 256, (2, 3, 32))
    logits, loss = model(idx, targets)
    assert logits.shape == (3, 32, 256)
    # At initialization the prediction is close to uniform over the 256 bytes.
    assert loss.item() == pytest.approx(math.log(256), abs=0.1)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    assert model(idx)[1] is None


def test_sequence_longer_than_block_size():
    model = GPT(small_config(block_size=16))
    with pytest.raises(ValueError, match="sequence of length 17: block_size is only 16"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_blocks_are_identical_and_checkpointable():
    model = GPT(small_config(n_layer=3, **LLAMA_LIKE))
    assert isinstance(model.blocks, torch.nn.ModuleList)
    assert len(model.blocks) == 3 and all(type(b) is Block for b in model.blocks)
    block = model.blocks[0]
    x = torch.randn(2, 8, 64, requires_grad=True)
    expected = block(x)
    expected.sum().backward()
    grad, x.grad = x.grad, None
    recomputed = checkpoint(block, x, use_reentrant=False)
    recomputed.sum().backward()
    torch.testing.assert_close(recomputed, expected)
    torch.testing.assert_close(x.grad, grad)


def test_tied_weights_share_storage():
    tied, untied = GPT(small_config(tie_weights=True)), GPT(small_config(tie_weights=False))
    assert tied.lm_head.weight.data_ptr() == tied.wte.weight.data_ptr()
    assert untied.lm_head.weight.data_ptr() != untied.wte.weight.data_ptr()
    assert untied.num_parameters() - tied.num_parameters() == 256 * 64


def test_rope_rotates_without_changing_norms():
    q = torch.randn(2, 4, 10, 16)  # (B, nh, T, hs)
    rotated = _rotate(q)
    torch.testing.assert_close(rotated.norm(dim=-1), q.norm(dim=-1))
    torch.testing.assert_close(rotated[:, :, 0], q[:, :, 0])  # position 0 is not rotated


def test_generate_tokens_and_text():
    torch.manual_seed(0)
    model = GPT(small_config(block_size=8))
    out = model.generate(torch.zeros(2, 3, dtype=torch.long), max_new_tokens=12, top_k=5)
    assert out.shape == (2, 15)  # longer than block_size: the context is cropped
    module = GPTLightningModule(small_config())
    module.train()
    text = module.generate("Hi", max_new_tokens=5)
    assert isinstance(text, str) and text.startswith("Hi")
    assert module.training
    with pytest.raises(ValueError, match="at least one character"):
        module.generate("")


def test_byte_tokenizer_round_trip():
    assert decode(encode("naïve café\n")) == "naïve café\n"
    assert decode([72, 105, 300]) == "Hi\ufffd"  # ids outside the byte range, from a larger vocabulary


def test_corpus_is_deterministic_english():
    corpus = make_corpus(200, seed=1)
    assert corpus == make_corpus(200, seed=1) != make_corpus(200, seed=2)
    assert corpus.isascii() and "\n\n" in corpus and corpus.count(".") >= 200


def test_datamodule_batches_and_split():
    data = GPTDataModule(batch_size=4, seq_len=32, num_sentences=500)
    data.setup("fit")
    x, y = next(iter(data.train_dataloader()))
    assert x.shape == y.shape == (4, 32) and x.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one
    n_train, n_val = len(data.train_set.tokens), len(data.val_set.tokens)
    assert n_val / (n_train + n_val) == pytest.approx(0.1, abs=0.01)
    # The batch size is read when the dataloader is made, as Lightning's BatchSizeFinder expects.
    data.batch_size = 3
    assert next(iter(data.train_dataloader()))[0].shape == (3, 32)


def test_optimizer_groups_and_schedule():
    module = GPTLightningModule("tiny", learning_rate=1e-3, weight_decay=0.1, warmup_steps=10, max_steps=100)
    config = module.configure_optimizers()
    optimizer, scheduler = config["optimizer"], config["lr_scheduler"]["scheduler"]
    assert isinstance(optimizer, torch.optim.AdamW)
    assert config["lr_scheduler"]["interval"] == "step"
    decay, no_decay = optimizer.param_groups
    assert (decay["name"], decay["weight_decay"]) == ("decay", 0.1)
    assert (no_decay["name"], no_decay["weight_decay"]) == ("no_decay", 0.0)
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() == 1 for p in no_decay["params"])
    gpt = module.model
    assert any(p is gpt.ln_f.weight for p in no_decay["params"])
    assert any(p is gpt.blocks[0].attn.c_attn.bias for p in no_decay["params"])
    assert any(p is gpt.wte.weight for p in decay["params"])
    n_grouped = sum(p.numel() for group in optimizer.param_groups for p in group["params"])
    assert n_grouped == gpt.num_parameters()  # every parameter once; the tied head is not added twice

    lrs = []
    for _ in range(120):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs[0] == pytest.approx(1e-4)  # warmup starts at lr / warmup_steps
    assert lrs[9] == pytest.approx(1e-3) and lrs[10] == pytest.approx(1e-3)
    assert lrs[55] == pytest.approx(0.55e-3)  # half way through the cosine: (1 + 0.1) / 2
    assert lrs[100] == pytest.approx(1e-4) and lrs[119] == pytest.approx(1e-4)  # min_lr_ratio=0.1
    assert all(a >= b for a, b in itertools.pairwise(lrs[10:101]))


def test_warmup_cosine_is_saved_with_the_scheduler():
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupCosine(5, 50, 0.2))
    state = scheduler.state_dict()
    assert state["lr_lambdas"][0] == {"warmup_steps": 5, "max_steps": 50, "min_ratio": 0.2}


class _RecordLosses(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(outputs["loss"].item())


@pytest.mark.slow  # 40 training steps
def test_loss_falls_within_a_short_run(tmp_path):
    L.seed_everything(0)
    model = GPTLightningModule("tiny")
    data = GPTDataModule(batch_size=16, seq_len=64, num_sentences=4000)
    record = _RecordLosses()
    trainer = L.Trainer(
        default_root_dir=tmp_path,
        max_steps=40,
        val_check_interval=40,
        limit_val_batches=4,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[record],
    )
    trainer.fit(model, datamodule=data)
    # From uniform over 256 bytes (ln 256 = 5.55) to well below the 3.0 of predicting byte frequencies
    # alone; this run reaches about 2.3.
    assert record.losses[0] > 5.4
    assert sum(record.losses[-5:]) / 5 < 2.7, record.losses
    assert trainer.callback_metrics["val_loss"] < 2.7
    text = model.generate("The ", max_new_tokens=40, top_k=5)
    assert text.startswith("The ") and len(text) == 44 and text.isascii()


def test_train_script_end_to_end(tmp_path, monkeypatch, capsys):
    """``python examples/gpt/train.py ...`` as run from a shell, in this process: a fresh interpreter would
    only add importing torch (test_newcomer.py starts one, for what only a fresh interpreter shows)."""
    monkeypatch.chdir(tmp_path)
    args = ["--max-steps", "3", "--batch-size", "4", "--seq-len", "32", "--default-root-dir", "logs"]
    monkeypatch.setattr(sys, "argv", [str(TRAIN_SCRIPT), *args])
    runpy.run_path(str(TRAIN_SCRIPT), run_name="__main__")
    assert "--- sample ---" in capsys.readouterr().out
    log_dir = tmp_path / "logs" / "gpt" / "version_0"
    assert list(log_dir.glob("events.out.tfevents.*"))
    assert (log_dir / "memory.png").is_file()


@pytest.fixture(scope="module")
def train():
    """examples/gpt/train.py as a module."""
    spec = importlib.util.spec_from_file_location("gpt_train", TRAIN_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_progress_bar_counts_the_runs_steps(train):
    """Issue 29: a 100-step run's bar read "100/1441" (the whole epoch) with the epoch's ETA."""
    data = GPTDataModule(batch_size=8, seq_len=32)
    data.setup("fit")
    batches = len(data.train_dataloader())
    assert batches > 100
    assert train.epochs_for(data, 100) == {"max_epochs": 1, "limit_train_batches": 100}
    assert train.epochs_for(data, batches + 1) == {"max_epochs": 2, "limit_train_batches": batches}


SHORT_RUN = ["--max-steps", "2", "--batch-size", "8", "--seq-len", "32", "--val-every-n-steps", "2"]


@pytest.mark.slow  # AutoFit simulates a handful of configurations
def test_train_script_autofit(tmp_path, monkeypatch, train):
    """``--autofit``: the default run (about 27 MB) does not fit 20 MB; the plan's real steps do."""
    monkeypatch.chdir(tmp_path)
    trainer = train.main([*SHORT_RUN, "--autofit", "20MB"])
    autofit = next(c for c in trainer.callbacks if isinstance(c, AutoFit))
    monitor = next(c for c in trainer.callbacks if isinstance(c, MemoryMonitor))
    plan = autofit.plan
    assert (plan.micro_batch_size, plan.checkpointing) != (8, "none")
    assert plan.micro_batch_size * plan.accumulate_grad_batches == 8
    assert trainer.datamodule.batch_size == 8  # the global batch, back after the fit
    assert monitor.history and all(b.peak <= 20_000_000 for _, b in monitor.history)
    assert monitor.budget == 20_000_000  # the plot draws the budget the run was fitted to (issue 13, item 7)


@pytest.mark.slow
def test_train_script_single_levers(tmp_path, monkeypatch, train):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):
        train.parse_args(["--autofit", "20MB", "--optimizer-budget", "20MB"])
    trainer = train.main(
        [*SHORT_RUN, "--checkpointing-budget", "22MB", "--optimizer-budget", "22MB", "--release-gradients"]
    )
    checkpointing = next(c for c in trainer.callbacks if isinstance(c, ActivationCheckpointing))
    swap = next(c for c in trainer.callbacks if isinstance(c, OptimizerSwap))
    monitor = next(c for c in trainer.callbacks if isinstance(c, MemoryMonitor))
    assert checkpointing.plan is not None and swap.choice is not None
    assert monitor.history and all(b.peak <= 22_000_000 for _, b in monitor.history)  # default: ~27 MB
    assert any(isinstance(c, GradientRelease) for c in trainer.callbacks)
    # OptimizerSwap's estimate of the step with the checkpointing applied (and the gradients released) is
    # the step the Trainer ran.
    assert swap.choice.tried[-1][1] == pytest.approx(monitor.history[-1][1].peak, rel=0.01)


def test_train_script_step_lever_flags(train):
    """Each step lever is one flag, and only one at a time."""
    levers = (GradientRelease, FusedOptimizerStep, OptimizerOffload)
    for flag, lever in zip(("--release-gradients", "--fused-step", "--offload"), levers, strict=True):
        chosen = train.callbacks(train.parse_args([flag]))
        assert [type(c) for c in chosen if isinstance(c, levers)] == [lever]
    with pytest.raises(SystemExit):
        train.parse_args(["--offload", "--fused-step"])


def test_train_script_lightning_cli(tmp_path, monkeypatch, capsys, train):
    monkeypatch.chdir(tmp_path)
    cli = train.cli_main(
        [
            "fit",
            "--config",
            str(ROOT / "examples" / "gpt" / "config.yaml"),
            "--trainer.max_steps=2",
            "--trainer.enable_progress_bar=false",
            "--data.batch_size=4",
            "--data.seq_len=32",
        ]
    )
    assert cli.trainer.global_step == 2
    assert cli.datamodule.batch_size == 4 and cli.model.config == GPTConfig.from_name("tiny")
    assert "--- sample ---" in capsys.readouterr().out
    assert list((tmp_path / "lightning_logs" / "gpt" / "version_0").glob("events.out.tfevents.*"))


def test_checkpoint_loads_with_weights_only(tmp_path):
    module = GPTLightningModule(GPTConfig.from_name("tiny", n_layer=1), max_steps=5)
    assert module.hparams.config == asdict(module.config)  # a plain dict, not a GPTConfig
    trainer = L.Trainer(default_root_dir=tmp_path, logger=False, enable_progress_bar=False)
    trainer.strategy.connect(module)
    trainer.save_checkpoint(tmp_path / "gpt.ckpt")
    torch.load(tmp_path / "gpt.ckpt", weights_only=True)
    loaded = GPTLightningModule.load_from_checkpoint(tmp_path / "gpt.ckpt", weights_only=True)
    assert loaded.config == module.config and loaded.hparams.max_steps == 5
    torch.testing.assert_close(loaded.model.wte.weight, module.model.wte.weight)
