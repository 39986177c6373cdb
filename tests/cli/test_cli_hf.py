"""``memkit --model hf:<directory or org/name>``: a Hugging Face architecture from its ``config.json``, random
weights on the meta device, in-process. The numbers are those of the same model built by hand; an ``org/name``
is read from the local cache only, and a miss is one line that says nothing is downloaded and what to do."""

import json
import logging
import re
import socket
import sys

import lightning.pytorch as pl
import pytest
import torch
from helpers import run_cli

from lightning_memkit import Sharding, estimate_memory

transformers = pytest.importorskip("transformers")

#: A LLaMA-family decoder with grouped-query attention, and GPT-2 (learned positions: a 64-token table).
LLAMA = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=256, max_position_embeddings=128,
)  # fmt: skip
GPT2 = dict(vocab_size=256, n_embd=32, n_layer=1, n_head=4, n_positions=64)


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    """Directories holding a saved ``config.json`` each: ``llama`` (saved as bf16: so are its weights),
    ``gpt2``, and ``distilbert``, a family without a causal-LM head."""
    root = tmp_path_factory.mktemp("hf")
    saved = {
        "llama": transformers.LlamaConfig(**LLAMA, dtype="bfloat16"),
        "gpt2": transformers.GPT2Config(**GPT2),
        "distilbert": transformers.DistilBertConfig(
            vocab_size=256, dim=32, n_layers=1, n_heads=4, hidden_dim=64, max_position_embeddings=64
        ),
    }
    for name, config in saved.items():
        config.save_pretrained(root / name)
    return root


def _json(argv):
    status, out, err = run_cli([*argv, "--json"])
    assert status == 0, err
    return json.loads(out)


def _fails(argv, message):
    """``memkit`` exits with 2 and one line on stderr matching ``message``."""
    status, _, err = run_cli(argv)
    assert status == 2
    assert err.startswith(f"memkit {argv[0]}: error: ") and err.count("\n") == 1, err
    assert re.search(message, err), err
    return err


def _estimate(model, batch_size=2, seq_len=16):
    return ["estimate", "--model", model, "--batch-size", str(batch_size), "--seq-len", str(seq_len)]


class CausalLM(pl.LightningModule):
    """The model built as a user would (``from_config``: the config's dtype), in a LightningModule, trained
    as it trains itself: ``model(input_ids=x, labels=x).loss``, AdamW."""

    def __init__(self, config):
        super().__init__()
        self.model = transformers.AutoModelForCausalLM.from_config(config)

    def training_step(self, batch, batch_idx):
        x, _ = batch
        return self.model(input_ids=x, labels=x).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters())


def _by_hand(config, batch_size, seq_len):
    with torch.device("meta"):
        model = CausalLM(config)
    x = torch.zeros(batch_size, seq_len, dtype=torch.long, device="meta")
    return model, estimate_memory(model, (x, x), device="cpu")


def test_estimate_of_a_config_directory_is_the_model_built_by_hand(configs):
    report = _json([*_estimate(f"hf:{configs / 'llama'}", 2, 32), "--device", "cpu"])
    config = transformers.AutoConfig.from_pretrained(configs / "llama")
    model, direct = _by_hand(config, 2, 32)
    assert report["simulated"] == direct.as_dict()
    n = sum(p.numel() for p in model.parameters())
    # bf16 parameters, as the config says (as from_config builds them), and the analytic column read from
    # the config, GQA included, parameter for parameter.
    assert report["analytic"]["parameters"] == 2 * n == report["analytic"]["gradients"]
    assert report["simulated"]["parameters"] >= 2 * n
    assert any("from LlamaForCausalLM's config" in note and "2 K/V heads" in note for note in report["notes"])


def test_gpt2_reads_its_position_table_from_the_config(configs):
    model = f"hf:{configs / 'gpt2'}"
    report = _json([*_estimate(model, 2, 64), "--device", "cpu"])
    _, direct = _by_hand(transformers.AutoConfig.from_pretrained(configs / "gpt2"), 2, 64)
    assert report["simulated"] == direct.as_dict()
    assert any("from GPT2LMHeadModel's config" in note for note in report["notes"])
    _fails(_estimate(model, 2, 65), r"--seq-len 65 exceeds the model's block_size of 64$")


def test_a_family_without_a_causal_lm_head_is_built_with_automodel(configs):
    report = _json([*_estimate(f"hf:{configs / 'distilbert'}"), "--device", "cpu"])
    assert report["analytic"] is None and report["simulated"]["peak"] > 0
    assert any("not available for DistilBertModel" in note for note in report["notes"])


def test_plan_of_a_config_directory(configs):
    model = f"hf:{configs / 'llama'}"
    argv = [
        "plan",
        "--model",
        model,
        "--gpu",
        "16MB",
        "--device",
        "cpu",
        "--global-batch",
        "4",
        "--seq-len",
        "32",
    ]
    report = _json(argv)
    chosen = [row for row in report["alternatives"] if row["time"] == 1.0]
    assert len(chosen) == 1 and chosen[0]["fits"]
    assert chosen[0]["micro_batch_size"] == report["micro_batch_size"]
    assert report["micro_batch_size"] * report["accumulate_grad_batches"] == 4
    assert report["estimated_peak"] == chosen[0]["peak"] <= report["limit"]
    assert report["model"] == model and 'AutoFit(budget="16MB")' in report["code"]


def test_an_id_in_the_local_cache(configs, tmp_path, monkeypatch):
    """An ``org/name`` from the hub cache ``HF_HUB_CACHE`` names (laid out as the hub writes it)."""
    snapshot = tmp_path / "models--tiny-org--tiny-gpt2" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text((configs / "gpt2" / "config.json").read_text())
    (tmp_path / "models--tiny-org--tiny-gpt2" / "refs").mkdir()
    (tmp_path / "models--tiny-org--tiny-gpt2" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    report = _json([*_estimate("hf:tiny-org/tiny-gpt2"), "--device", "cpu"])
    assert any("from GPT2LMHeadModel's config" in note for note in report["notes"])


def test_an_id_not_cached_is_one_line_and_no_request(tmp_path, monkeypatch):
    """Not in the cache: nothing is fetched, even with the hub online; the line says so, names the presets of
    the same shape and writes the factory that does fetch the config."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    requests = []

    def refuse(*args, **kwargs):
        requests.append(args)
        raise OSError("memkit must make no request")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    spec = "hf:meta-llama/Llama-2-7b-hf"
    err = _fails(
        _estimate(spec),
        re.escape(
            f"--model {spec}: 'meta-llama/Llama-2-7b-hf' is not a directory, nor in the local Hugging Face "
            f"cache ({tmp_path / 'hub'}), and nothing is downloaded; give hf:<directory> holding its "
            "config.json"
        ),
    )
    assert requests == []
    assert "llama-7b is LLaMA-2-7B's at a 2,048-token context" in err
    factory = (
        "[# mymodels.py | from transformers import AutoConfig, AutoModelForCausalLM | def build(): return "
        'AutoModelForCausalLM.from_config(AutoConfig.from_pretrained("meta-llama/Llama-2-7b-hf"))] and give '
        "--model mymodels:build"
    )
    assert err.rstrip().endswith(factory), err


def test_transformers_not_installed(monkeypatch, configs):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers fails
    _fails(
        _estimate(f"hf:{configs / 'gpt2'}"),
        r"transformers is not installed \(pip install transformers\), and nothing is downloaded; .* "
        r"write the factory \[# mymodels.py \| from transformers import",
    )


@pytest.mark.parametrize(
    ("target", "message"),
    [
        (
            "{empty}",
            r"--model hf:.*empty has no config.json, which hf: builds the model from; give the directory",
        ),
        (
            "{empty}/nope/model",
            r"nope/model does not exist; give the directory holding the model's config.json",
        ),
        ("", r"--model 'hf:' names no model; give hf:<directory holding config.json> or hf:<org/name>"),
    ],
)
def test_a_directory_without_a_config(tmp_path, target, message):
    (tmp_path / "empty").mkdir()
    _fails(_estimate("hf:" + target.format(empty=tmp_path / "empty")), message)


def test_a_config_transformers_cannot_read(tmp_path):
    (tmp_path / "config.json").write_text('{"hidden_size": 8}')
    _fails(
        _estimate(f"hf:{tmp_path}"),
        r"reading .*config.json failed: ValueError: Unrecognized model in .*; hf: builds the model families",
    )


def test_a_hub_id_without_the_prefix_is_pointed_to_it():
    _fails(
        _estimate("meta-llama/Llama-2-7b-hf"),
        r"unknown preset 'meta-llama/Llama-2-7b-hf' for --model; .* \(a Hugging Face model is named with "
        r"hf:, read from its config.json: hf:meta-llama/Llama-2-7b-hf\)$",
    )


@pytest.mark.slow
def test_estimate_simulates_tensor_parallelism_and_hsdp_as_the_library_does(configs):
    """``--tensor-parallel`` and ``--replicate`` are `estimate_memory`'s layouts: the same rank's step as the
    library simulates on the same model; what cannot run is one line."""
    from lightning_memkit import estimate_memory
    from lightning_memkit.cli._models import example_batch, load_model, step_options

    model = f"hf:{configs / 'llama'}"
    argv = [
        *_estimate(model, batch_size=2, seq_len=16),
        "--device",
        "cpu",
        "--strategy",
        "fsdp2",
        "--gpus",
        "4",
    ]
    built = load_model(model, "lightning")
    batch = example_batch(built, model, 2, 16)
    for flags, layout in [
        (["--tensor-parallel", "2"], {"tensor_parallel_size": 2}),
        (["--replicate", "2"], {"replicate_size": 2}),
    ]:
        report = _json([*argv, *flags])
        expected = estimate_memory(
            built, batch, **step_options(built, None), precision="32-true", device="cpu",
            sharding=Sharding(4, **layout),
        ).peak  # fmt: skip
        assert report["simulated"]["peak"] == expected
    _fails(
        [*argv, "--tensor-parallel", "4"], r"tensor_parallel_size=4 does not divide .*num_key_value_heads=2"
    )
    _fails([*argv, "--tensor-parallel", "3"], "tensor_parallel_size=3 does not divide world_size=4")
    # advise prices its fixes on the same rank's step
    advice = _json(["advise", *argv[1:], "--tensor-parallel", "2"])
    assert advice["scope"] == "one rank of 4 under TP 2 x FSDP2 2"
    assert advice["breakdown"]["peak"] == _json([*argv, "--tensor-parallel", "2"])["simulated"]["peak"]
    _fails([*argv[:-4], "--replicate", "2"], "--replicate 2 is a layout of --strategy fsdp2, not ddp")


#: The line that says the key/value cache was turned off (`_checkpointing.policies._announce_cache_off`).
CACHE_LINE = "Turned off Hugging Face's key/value cache"


def _cache_lines(caplog, argv):
    """How often ``memkit`` with ``argv`` logs `CACHE_LINE` (each run loads a fresh config, which the line
    has not named yet)."""
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        status, _, err = run_cli(argv)
    assert status == 0, err
    return sum(CACHE_LINE in record.getMessage() for record in caplog.records)


def test_the_cache_line_only_with_checkpointing(configs, caplog):
    """Issue 49: the line heads ``memkit estimate`` when checkpointing is asked for, where it applies, and
    not otherwise."""
    model = f"hf:{configs / 'llama'}"
    argv = [*_estimate(model, 2, 16), "--device", "cpu"]
    assert _cache_lines(caplog, argv) == 0
    assert _cache_lines(caplog, [*argv, "--checkpointing", "full"]) == 1


@pytest.mark.slow
def test_the_cache_line_not_for_the_plans_of_a_step_that_does_not_fit(configs, caplog):
    """``memkit estimate --gpu`` of a step over the card searches plans with full checkpointing, which the
    run did not ask for: no line (issue 49's case); nor from ``memkit plan``'s candidates."""
    model = f"hf:{configs / 'llama'}"
    argv = [*_estimate(model, 8, 32), "--gpu", "579MiB"]
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        status, out, err = run_cli(argv)
    assert status == 0, err
    assert "Does not fit" in out and "full checkpointing" in out
    assert not any(CACHE_LINE in record.getMessage() for record in caplog.records)
    plan = ["plan", "--model", model, "--gpu", "16MB", "--device", "cpu", "--global-batch", "4"]
    assert _cache_lines(caplog, [*plan, "--seq-len", "32"]) == 0
