"""Activation checkpointing on models users bring (tests/zoo.py): Hugging Face models with their defaults
(``use_cache=True``, dropout) and a ResNet with BatchNorm. Checkpointing must run, give the gradients of the
uncheckpointed run, and leave the module's state (BatchNorm's running statistics) exactly as without it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import lightning.pytorch as pl
import pytest
import torch
from zoo import MODELS, ZooModule, zoo_batch

from lightning_memkit import advise, apply_checkpointing, estimate_memory, find_blocks, plan_checkpointing
from lightning_memkit._checkpointing.planner import CheckpointPlanner
from lightning_memkit._checkpointing.policies import applied_modes
from lightning_memkit.callbacks.activation_checkpointing import ActivationCheckpointing
from lightning_memkit.testing import allocator_peak

STEPS = 3
NAMES = list(MODELS)
CACHE_LINE = "use_cache=False"


pytestmark = pytest.mark.usefixtures("one_thread")


def _module(name: str) -> ZooModule:
    module = ZooModule(name)  # seeded: the same weights every time
    module.train()
    return module


def _train(module: ZooModule, measure: int | None = None) -> dict:
    """``STEPS`` AdamW steps, dropout seeded per step; the losses, every step's gradients, the final state,
    and the allocator's peak of step ``measure`` (AdamW's state exists from the second step on)."""
    opt = module.configure_optimizers()
    losses, grads, peak = [], [], None
    for i in range(STEPS):
        batch = zoo_batch(module.hparams.name, seed=i)

        def step(i: int = i, batch: dict = batch) -> None:
            torch.manual_seed(100 + i)  # the dropout masks
            loss = module(batch)
            loss.backward()
            losses.append(loss.detach())
            grads.append({n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None})
            opt.step()
            opt.zero_grad()

        if i == measure:
            peak = allocator_peak(step)
        else:
            step()
    state = {k: v.detach().clone() for k, v in module.state_dict().items()}
    return {"losses": losses, "grads": grads, "state": state, "peak": peak}


def _cache_flags(module: torch.nn.Module) -> dict[str, bool]:
    return {
        name: m.config.use_cache
        for name, m in module.named_modules()
        if hasattr(getattr(m, "config", None), "use_cache")
    }


@contextlib.contextmanager
def _cache_off(module: torch.nn.Module) -> Iterator[None]:
    """Hugging Face's key/value cache off while inside, as checkpointing runs the model."""
    configs = {
        id(m.config): m.config for m in module.modules() if hasattr(getattr(m, "config", None), "use_cache")
    }
    before = {key: config.use_cache for key, config in configs.items()}
    for config in configs.values():
        config.use_cache = False
    try:
        yield
    finally:
        for key, config in configs.items():
            config.use_cache = before[key]


_REFERENCE: dict[tuple[str, bool], dict] = {}


def _reference(name: str, cache: bool = True) -> dict:
    """The uncheckpointed run; ``cache=False``: with Hugging Face's key/value cache off, as checkpointing
    runs the model (the same ops, so the same numbers to the bit)."""
    if (name, cache) not in _REFERENCE:
        module = _module(name)
        with contextlib.nullcontext() if cache else _cache_off(module):
            _REFERENCE[name, cache] = _train(module)
    return _REFERENCE[name, cache]


_STATS = ("running_mean", "running_var", "num_batches_tracked")


def _assert_same_state(got: dict, expected: dict, rtol: float = 1e-6, atol: float = 1e-8) -> None:
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        tol = dict(rtol=0, atol=0) if key.endswith(_STATS) else dict(rtol=rtol, atol=atol)
        torch.testing.assert_close(got[key], value, **tol, msg=lambda m, k=key: f"{k}: {m}")


def _assert_same_run(run: dict, name: str, checkpointed: bool) -> None:
    """Checkpointing changes no number: losses, every step's gradients, parameters and buffers are those of
    the uncheckpointed run with the cache as checkpointing sets it; and turning the cache off changes the
    losses of the model's default run by float rounding only."""
    ref = _reference(name, cache=not checkpointed)
    torch.testing.assert_close(run["losses"], ref["losses"], rtol=1e-6, atol=1e-8)
    for got, expected in zip(run["grads"], ref["grads"], strict=True):
        _assert_same_state(got, expected)
    _assert_same_state(run["state"], ref["state"])
    torch.testing.assert_close(run["losses"], _reference(name)["losses"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
@pytest.mark.parametrize("name", NAMES)
def test_zoo_mode_trains_as_without(name, mode):
    """Every zoo model under each uniform mode: it runs, and losses, gradients, parameters and buffers
    (BatchNorm's running statistics and batch count exactly) are those of the uncheckpointed run."""
    module = _module(name)
    handle = apply_checkpointing(module, mode)
    assert set(applied_modes(module).values()) == (set() if mode == "none" else {mode})
    if mode != "none":
        assert not any(_cache_flags(module).values())  # Hugging Face's cache is off while checkpointing
    run = _train(module)
    handle.remove()
    _assert_same_run(run, name, checkpointed=mode != "none")


@pytest.mark.slow  # the zoo sweep and planning-heavy checks: the full run's tier
@pytest.mark.parametrize("name", NAMES)
def test_zoo_budget_plan_fits_and_trains_as_without(name):
    """A budget halfway between the simulated peaks with full checkpointing and without: the planner
    (profiling every block, simulating its plans) runs on every zoo model, the plan checkpoints something,
    training gives the uncheckpointed run's numbers, and the allocator's real peak is within the budget."""
    module = _module(name)
    caching = _cache_flags(module)
    planner = CheckpointPlanner(module, zoo_batch(name), checkpointing="full", cost="flops", device="cpu")
    peak_none = planner.simulate(planner.uniform("none")).peak
    peak_full = planner.simulate(planner.uniform("full")).peak
    assert peak_full < peak_none
    budget = (peak_none + peak_full) // 2
    plan = planner.plan(budget)
    assert plan.peak <= budget
    assert any(b.mode != "none" for b in plan.blocks)
    assert _cache_flags(module) == caching  # planning changed nothing
    handle = apply_checkpointing(module, plan)
    run = _train(module, measure=1)
    handle.remove()
    _assert_same_run(run, name, checkpointed=True)
    assert run["peak"] <= budget, f"real peak {run['peak']:,} > budget {budget:,} (plan {plan.modes})"


@pytest.mark.slow  # plans, trains and advises: the full run's tier (20 s)
def test_every_stack_of_repeated_blocks_is_checkpointed():
    """Whisper's encoder and decoder layers are two classes: both stacks are blocks (only the heavier
    class was, and the encoder was never checkpointed). A budget below what checkpointing the decoder alone
    reaches is planned with encoder blocks, met on the allocator, and trains as without; ``advise`` names
    the encoder's blocks."""
    module, batch = _module("whisper"), zoo_batch("whisper")
    names = [n for n, _ in find_blocks(module)]
    assert names == [f"model.model.{stack}.layers.{i}" for stack in ("encoder", "decoder") for i in range(2)]
    peak = lambda plan: estimate_memory(module, batch, checkpointing=plan, device="cpu").peak  # noqa: E731
    decoder_only = peak({n: "full" for n in names if ".decoder." in n})
    every_block = peak("full")
    assert every_block < decoder_only < peak("none")
    budget = (every_block + decoder_only) // 2  # out of reach when only the decoder is checkpointed
    plan = plan_checkpointing(module, batch, budget, checkpointing="full", cost="flops", device="cpu")
    assert plan.peak <= budget
    assert any(".encoder." in b.name and b.mode != "none" for b in plan.blocks)
    handle = apply_checkpointing(module, plan)
    run = _train(module, measure=1)
    handle.remove()
    _assert_same_run(run, "whisper", checkpointed=True)
    assert run["peak"] <= budget, f"real peak {run['peak']:,} > budget {budget:,} (plan {plan.modes})"
    advice = advise(module, batch, device="cpu")
    assert any("in 4 blocks (model.model.encoder.layers.0, ...)" in f.what for f in advice.findings)


def _fit(module: ZooModule, trainer_kwargs: dict, callbacks: list) -> dict:
    pl.seed_everything(0)  # the dropout masks
    trainer_kwargs = {**trainer_kwargs, "max_steps": STEPS, "logger": False, "callbacks": callbacks}
    pl.Trainer(**trainer_kwargs).fit(module)
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def test_zoo_t5_full_in_trainer(trainer_kwargs):
    """T5 with ``ActivationCheckpointing(checkpointing="full")`` in a Trainer: the decoder's cross-attention
    cache, filled on the first forward, made the recompute save other tensors. Now it trains as without."""
    module = ZooModule("t5", n_batches=STEPS)
    with _cache_off(module):
        expected = _fit(module, trainer_kwargs, [])
    callback = ActivationCheckpointing(checkpointing="full")
    got = _fit(ZooModule("t5", n_batches=STEPS), trainer_kwargs, [callback])
    assert {b.mode for b in callback.plan.blocks} == {"full"}
    _assert_same_state(got, expected)


def test_zoo_resnet_budget_in_trainer(trainer_kwargs):
    """``ActivationCheckpointing(budget=...)`` on the ResNet: the planner picks the blocks, and BatchNorm's
    running statistics and batch counts come out exactly as without checkpointing."""
    module, batch = _module("resnet"), zoo_batch("resnet")
    peaks = [estimate_memory(module, batch, checkpointing=p, device="cpu").peak for p in ("none", "full")]
    budget = sum(peaks) // 2
    expected = _fit(ZooModule("resnet", n_batches=STEPS), trainer_kwargs, [])
    callback = ActivationCheckpointing(budget, checkpointing="full", cost="flops")
    got = _fit(ZooModule("resnet", n_batches=STEPS), trainer_kwargs, [callback])
    assert any(b.mode != "none" for b in callback.plan.blocks)
    assert got["model.blocks.0.bn1.num_batches_tracked"].item() == STEPS
    _assert_same_state(got, expected)


def test_use_cache_turned_off_said_once_and_restored(caplog):
    """T5: the top model's and the decoder stack's configs (the encoder's is off already) are turned off
    while checkpointed, in one log line; ``remove()`` puts every one back."""
    module = _module("t5")
    before = _cache_flags(module)
    assert before["model.decoder"] is True and before["model.encoder"] is False
    with caplog.at_level(logging.INFO, logger="lightning_memkit._checkpointing.policies"):
        handle = apply_checkpointing(module, "full")
        again = apply_checkpointing(module, "selective")  # another plan on top: nothing more to turn off
    lines = [r.getMessage() for r in caplog.records if CACHE_LINE in r.getMessage()]
    assert len(lines) == 1, lines
    assert "Hugging Face" in lines[0] and "T5Config" in lines[0]
    assert not any(_cache_flags(module).values())
    assert not again._configs
    again.remove()
    handle.remove()
    assert _cache_flags(module) == before
    assert applied_modes(module) == {}


def test_the_cache_line_is_said_once_per_config_however_often_planned(caplog):
    """Planning checkpoints the model many times over (each simulated plan): the line is said once."""
    module, batch = _module("qwen2"), zoo_batch("qwen2")
    with caplog.at_level(logging.INFO, logger="lightning_memkit._checkpointing.policies"):
        for mode in ("full", "selective", "full"):
            estimate_memory(module, batch, checkpointing=mode, device="cpu")
        apply_checkpointing(module, "full").remove()
    lines = [r.getMessage() for r in caplog.records if CACHE_LINE in r.getMessage()]
    assert len(lines) == 1, lines
    assert module.model.config.use_cache is True


def test_nothing_checkpointed_leaves_use_cache(caplog):
    """A plan that checkpoints nothing (a budget above the peak without checkpointing, or "none") leaves
    ``use_cache`` as it was, and so does planning."""
    module = _module("qwen2")
    batch = zoo_batch("qwen2")
    with caplog.at_level(logging.INFO, logger="lightning_memkit._checkpointing.policies"):
        plan = plan_checkpointing(module, batch, "1GiB", checkpointing="full", cost="flops", device="cpu")
        assert module.model.config.use_cache is True
        assert all(b.mode == "none" for b in plan.blocks)
        with apply_checkpointing(module, plan):
            assert module.model.config.use_cache is True
            module(batch).backward()
        with apply_checkpointing(module, "none"):
            assert module.model.config.use_cache is True
    assert not [r for r in caplog.records if CACHE_LINE in r.getMessage()]


def test_removing_all_checkpointing_gives_the_cache_back():
    """``apply_checkpointing(model, "none")`` (what ActivationCheckpointing's docstring says to call after
    fit) turns the cache back on: generation after training, and ``save_pretrained``'s config, see it."""
    module = _module("gpt2")
    apply_checkpointing(module, "full")  # the handle is dropped, as a callback user has none
    assert module.model.config.use_cache is False
    apply_checkpointing(module, "none")
    assert applied_modes(module) == {} and module.model.config.use_cache is True
    module.model.config.use_cache = False  # the user's own choice is kept
    apply_checkpointing(module, "full")
    apply_checkpointing(module, "none")
    assert module.model.config.use_cache is False
