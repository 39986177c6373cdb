"""advise (issue 16): each finding's bytes are what applying its fix saves, for real.

The advisor prices a fix by simulating the step with it; these tests apply the fix to the real run and
measure the allocator's steady-step peak again: it falls by the finding's bytes (±5 %), on the GPT example
and on a Hugging Face model. Findings the tests cannot make real on a CPU (CUDA fragmentation) are checked
on the statistics they read.
"""

from __future__ import annotations

import csv
import json

import lightning.pytorch as pl
import pytest
import torch
from helpers import cpu_trainer
from models import lm_loss
from torch import nn
from zoo import ChunkedLossModule, ZooModule, zoo_batch

from lightning_memkit import (
    ActivationCheckpointing,
    GradientRelease,
    MemoryMonitor,
    Step,
    advise,
    chunked_cross_entropy,
)
from lightning_memkit.cli import main
from lightning_memkit.demos.gpt import GPTDataModule, GPTLightningModule
from lightning_memkit.testing import AllocatorPeaks

B, T = 8, 64


def _steady_peak(module: pl.LightningModule, data, callbacks=(), steps: int = 2) -> int:
    """The allocator's highest peak from the second training step on (the first has no gradients yet)."""
    peaks = AllocatorPeaks()
    trainer = cpu_trainer(None, [*callbacks, *peaks.around()], max_steps=steps)
    trainer.fit(module, data)
    return max(peaks.peaks[1:])


def _gpt(**kwargs):
    torch.manual_seed(0)
    data = GPTDataModule(batch_size=B, seq_len=T, num_sentences=300)
    x = torch.randint(0, 256, (B, T))
    return GPTLightningModule("tiny", max_steps=3, **kwargs), data, (x, x.roll(-1, 1))


@pytest.fixture(scope="module")
def gpt_advice():
    module, data, batch = _gpt()
    return advise(module, batch, device="cpu"), _steady_peak(module, data)


@pytest.mark.xdist_group("gpt_advice")  # one worker computes the fixture
@pytest.mark.slow
def test_gpt_example_findings_are_what_their_fixes_save(gpt_advice):
    advice, plain = gpt_advice
    assert advice.breakdown.peak == pytest.approx(plain, rel=0.01)  # the advisor's step is the real one
    assert [f.kind for f in advice] == ["activations", "gradients", "logits"]
    assert [f.saved for f in advice] == sorted((f.saved for f in advice), reverse=True)
    fixes = {
        "gradients": ({}, [GradientRelease()]),
        "activations": ({}, [ActivationCheckpointing(checkpointing="full")]),
        "logits": ({"loss_chunks": 8}, []),
    }
    for kind, (module_kwargs, callbacks) in fixes.items():
        module, data, _ = _gpt(**module_kwargs)
        saved = plain - _steady_peak(module, data, callbacks)
        assert saved == pytest.approx(advice[kind].saved, rel=0.05), kind


@pytest.mark.xdist_group("gpt_advice")  # one worker computes the fixture
@pytest.mark.slow
def test_gpt_example_findings_say_what_and_how(gpt_advice):
    advice, _ = gpt_advice
    assert "GradientRelease()" in advice["gradients"].fix
    assert "through the forward" in advice["gradients"].what
    assert "ActivationCheckpointing(checkpointing='full')" in advice["activations"].fix
    assert "4 blocks" in advice["activations"].what and "addmm" in advice["activations"].what
    assert "chunked_cross_entropy(hidden, model.lm_head," in advice["logits"].fix
    assert "(256)" in advice["logits"].what
    text = str(advice)
    assert "reached in the forward" in text and all(f.fix[:20] in text for f in advice)
    assert json.loads(json.dumps(advice.as_dict()))["findings"][0]["kind"] == "activations"


@pytest.mark.xdist_group("gpt_advice")  # one worker computes the fixture
@pytest.mark.slow
def test_memory_monitor_advises_at_the_end_of_fit_and_changes_nothing(gpt_advice, tmp_path):
    """``MemoryMonitor(advise=True)``: the advice on the first batch (the figures `advise` gives for that
    step), printed and logged as ``memory/advice/{kind}`` in MiB; the run is the run without it."""
    runs = {}
    for advising in (False, True):
        module, data, _ = _gpt()
        monitor = MemoryMonitor(plot=False, summary=False, advise=advising)
        trainer = cpu_trainer(tmp_path / str(advising), [monitor], max_steps=3)
        trainer.fit(module, data)
        runs[advising] = [p.detach().clone() for p in module.parameters()], torch.get_rng_state(), monitor
    for a, b in zip(runs[False][0], runs[True][0], strict=True):
        assert torch.equal(a, b)
    assert torch.equal(runs[False][1], runs[True][1])
    advice = runs[True][2].advice
    assert runs[False][2].advice is None and advice is not None
    assert [(f.kind, f.saved) for f in advice] == [(f.kind, f.saved) for f in gpt_advice[0]]
    with open(next((tmp_path / "True").rglob("metrics.csv"))) as f:
        rows = list(csv.DictReader(f))
    logged = [(row["step"], row["memory/advice/gradients"]) for row in rows if row["memory/advice/gradients"]]
    assert [step for step, _ in logged] == ["2"]  # the last step's, as every key (steps count from 0)
    assert float(logged[0][1]) == pytest.approx(advice["gradients"].saved / 2**20)
    assert max(int(row["step"]) for row in rows) == 2


def _zoo(name: str, *, untrained: str | None = None, unused: bool = False, chunked: bool = False):
    """A zoo model whose optimizer leaves ``untrained`` parameters (by name prefix) out, with an ``unused``
    linear layer run in each step whose output the loss never reaches; ``chunked``: its loss computed by
    `chunked_cross_entropy`."""
    torch.manual_seed(0)
    module = (ChunkedLossModule if chunked else ZooModule)(name, batch_size=4, seq_len=32, n_batches=4)
    if unused:
        module.spare = nn.Linear(32, 512)  # 66 KiB of weights (the CPU profiler sees them once touched)
        step = module.training_step

        def training_step(batch, batch_idx):
            module.spare(torch.zeros(1, 32))  # computed, and thrown away
            return step(batch, batch_idx)

        module.training_step = training_step
    if untrained is not None:
        trained = lambda: [p for n, p in module.named_parameters() if not n.startswith(untrained)]  # noqa: E731
        module.configure_optimizers = lambda: torch.optim.AdamW(trained(), lr=1e-3)
    return module, zoo_batch(name, 4, 32)


@pytest.mark.slow  # planning-heavy: the full run's tier
def test_hugging_face_findings_are_what_their_fixes_save():
    """GPT-NeoX at its default config: the previous step's gradients, the activations, the logits, the
    gradients of the (untied) output head its optimizer leaves out, and a layer the loss never reaches;
    each fixed and measured again. The advisor leaves the model as it was (it froze the head only to price
    freezing it)."""
    module, batch = _zoo("gpt_neox", untrained="model.lm_head")
    before = {n: (p.detach().clone(), p.requires_grad) for n, p in module.named_parameters()}
    rng = torch.get_rng_state()
    advice = advise(module, batch, device="cpu")
    assert torch.equal(torch.get_rng_state(), rng)
    for n, p in module.named_parameters():
        assert torch.equal(p, before[n][0]) and p.requires_grad == before[n][1] and p.grad is None, n
    plain = _steady_peak(module, None)
    assert advice.breakdown.peak == pytest.approx(plain, rel=0.01)
    kinds = {f.kind for f in advice}
    assert kinds == {"gradients", "activations", "logits", "untrained_gradients"}
    assert "model.lm_head.weight" in advice["untrained_gradients"].what

    def saving(callbacks=(), frozen_head=False, **changes):  # a fresh module each (checkpointing stays)
        fixed, _ = _zoo("gpt_neox", **{"untrained": "model.lm_head", **changes})
        fixed.model.lm_head.weight.requires_grad_(not frozen_head)
        return plain - _steady_peak(fixed, None, callbacks)

    assert saving([GradientRelease()]) == pytest.approx(advice["gradients"].saved, rel=0.05)
    checkpointed = saving([ActivationCheckpointing(checkpointing="full")])
    assert checkpointed == pytest.approx(advice["activations"].saved, rel=0.05)
    assert saving(chunked=True) == pytest.approx(advice["logits"].saved, rel=0.05)
    assert saving(frozen_head=True) == pytest.approx(advice["untrained_gradients"].saved, rel=0.05)


@pytest.mark.slow
def test_a_layer_no_batch_reaches_is_its_weights():
    """A layer run in each step whose output the loss never reaches: removing it saves its weights. The
    simulated step also counts gradients and AdamW state for it, as a batch that reached it would leave
    (a task's head, an expert routed elsewhere): `estimate_memory` stays on the safe side."""
    module, batch = _zoo("qwen2", unused=True)
    advice = advise(module, batch, device="cpu")
    finding = advice["unused_parameters"]
    spare = sum(p.numel() * p.element_size() for p in module.spare.parameters())
    assert finding.saved == spare and "spare.weight, spare.bias" in finding.what
    plain = _steady_peak(module, None)
    assert advice.breakdown.peak == pytest.approx(plain + 3 * spare, rel=0.01)
    del module.spare, module.training_step
    assert plain - _steady_peak(module, None) == pytest.approx(finding.saved, rel=0.05)


def _tiny_lm():
    """A plain two-layer language model (no repeated blocks: no checkpointing to price), and its batch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(100, 32), nn.Linear(32, 100))
    x = torch.randint(0, 100, (4, 16))
    return model, (x, x.roll(-1, 1))


def test_state_kept_for_frozen_parameters():
    model, batch = _tiny_lm()
    optimizer = torch.optim.AdamW(model.parameters())
    lm_loss(model(batch[0]), batch[1]).backward()
    optimizer.step()
    model[0].weight.requires_grad_(False)  # frozen after training began
    model.zero_grad(set_to_none=True)
    advice = advise(model, batch, optimizer=optimizer, loss_fn=lm_loss, device="cpu")
    finding = advice["stale_optimizer_state"]
    assert finding.saved == 2 * model[0].weight.numel() * 4 + 4  # exp_avg, exp_avg_sq and the step counter
    assert "0.weight" in finding.what and "optimizer.state.pop" in finding.fix
    optimizer.state.pop(model[0].weight)
    assert "stale_optimizer_state" not in advise(
        model, batch, optimizer=optimizer, loss_fn=lm_loss, device="cpu"
    )


def test_fragmentation_is_read_from_the_allocator_statistics():
    model, batch = _tiny_lm()
    stats = {"reserved_bytes.all.peak": 10 << 30, "allocated_bytes.all.peak": 7 << 30, "num_alloc_retries": 3}
    kwargs = dict(optimizer="sgd", loss_fn=lm_loss, device="cpu")
    finding = advise(model, batch, memory_stats=stats, **kwargs)["fragmentation"]
    assert finding.saved == 3 << 30 and "3 time(s)" in finding.what
    assert "expandable_segments:True" in finding.fix
    tidy = {**stats, "reserved_bytes.all.peak": (7 << 30) + (1 << 20), "num_alloc_retries": 0}
    assert "fragmentation" not in advise(model, batch, memory_stats=tidy, **kwargs)


def test_the_step_as_one_value_advises_as_its_keywords():
    model, batch = _tiny_lm()
    kwargs = dict(optimizer="adamw", loss_fn=lm_loss, device="cpu")
    given = advise(model, batch, precision="bf16-mixed", accumulating=True, **kwargs)
    stepped = advise(model, batch, step=Step(precision="bf16-mixed", accumulating=True), **kwargs)
    assert stepped.as_dict() == given.as_dict()
    with pytest.raises(TypeError, match="give step= or precision, not both"):
        advise(model, batch, step=Step(), precision="bf16-mixed", **kwargs)


def test_chunked_cross_entropy_is_the_cross_entropy():
    torch.manual_seed(0)
    head = nn.Linear(16, 50, bias=False)
    hidden = torch.randn(3, 7, 16, requires_grad=True)
    targets = torch.randint(0, 50, (3, 7))
    targets[0, :3] = -100
    full = nn.functional.cross_entropy(head(hidden).flatten(0, 1), targets.flatten())
    full.backward()
    expected = hidden.grad.clone(), head.weight.grad.clone()
    hidden.grad = head.weight.grad = None
    chunked = chunked_cross_entropy(hidden, head, targets, chunks=4)
    chunked.backward()
    torch.testing.assert_close(chunked, full)
    torch.testing.assert_close(hidden.grad, expected[0])
    torch.testing.assert_close(head.weight.grad, expected[1])


def test_memkit_advise_prints_the_findings(capsys):
    assert main(["advise", "--model", "tiny", "--batch-size", "4", "--seq-len", "64", "--json"]) == 0
    advice = json.loads(capsys.readouterr().out)
    fixes = {f["kind"]: f["fix"] for f in advice["findings"]}
    assert "GradientRelease()" in fixes["gradients"]
    assert "ActivationCheckpointing(checkpointing='full')" in fixes["activations"]
    assert advice["breakdown"]["peak"] > sum(f["saved"] for f in advice["findings"]) > 0


@pytest.mark.slow  # three advised steps, one of them sharded
def test_memkit_advise_one_rank_of_fsdp2(capsys):
    """``--gpus N --strategy fsdp2``: one rank's sharded step advised, said so, and below the one-device
    step."""
    argv = ["advise", "--model", "tiny", "--batch-size", "4", "--seq-len", "64", "--device", "cpu"]
    assert main([*argv, "--gpus", "4", "--strategy", "fsdp2", "--json"]) == 0
    advice = json.loads(capsys.readouterr().out)
    assert advice["scope"] == "one rank of 4 under FSDP2"
    assert main([*argv, "--json"]) == 0
    whole = json.loads(capsys.readouterr().out)
    assert whole["scope"] == "" and advice["breakdown"]["peak"] < whole["breakdown"]["peak"]
    assert main([*argv, "--gpus", "4", "--strategy", "fsdp2"]) == 0
    assert "one rank of 4 under FSDP2" in capsys.readouterr().out
