"""Activation checkpointing: wrapping, exact gradients, recompute FLOPs, the cheapest plan, plans that fit,
the callback."""

from __future__ import annotations

import itertools
import json
import types

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from helpers import cpu_trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.strategies import FSDPStrategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from models import EncoderLM, PlainGPT, lm_loss
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, set_checkpoint_early_stop
from torch.utils.flop_counter import FlopCounterMode

from lightning_memkit import (
    CHECKPOINT_MODES,
    CheckpointPlan,
    apply_checkpointing,
    estimate_memory,
    find_blocks,
    measure,
    plan_checkpointing,
)
from lightning_memkit._checkpointing.checkpointers import CHECKPOINTERS
from lightning_memkit._checkpointing.planner import CheckpointPlanner
from lightning_memkit._checkpointing.policies import applied_modes
from lightning_memkit.callbacks.activation_checkpointing import ActivationCheckpointing
from lightning_memkit.demos._data import GPTDataModule
from lightning_memkit.demos.gpt import GPT, Block, GPTConfig, GPTLightningModule

SMALL = dict(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=64)


pytestmark = pytest.mark.usefixtures("one_thread")


def _grads(model: nn.Module, loss_fn, seed: int = 1) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)  # the dropout masks
    model.zero_grad(set_to_none=True)
    loss_fn().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


# --------------------------------------------------------------------------------------------------
# Discovery and wrapping
# --------------------------------------------------------------------------------------------------


def test_find_blocks_takes_repeated_layers():
    gpt = GPT(GPTConfig(**SMALL))
    assert [n for n, _ in find_blocks(gpt)] == [f"blocks.{i}" for i in range(4)]
    encoder = EncoderLM(n_layer=3)
    found = find_blocks(encoder)
    assert [n for n, _ in found] == [f"encoder.layers.{i}" for i in range(3)]
    assert all(isinstance(m, nn.TransformerEncoderLayer) for _, m in found)
    # Named classes: every instance, the outermost where they nest.
    assert [n for n, _ in find_blocks(gpt, {nn.LayerNorm})][:2] == ["blocks.0.ln_1", "blocks.0.ln_2"]
    assert [n for n, _ in find_blocks(gpt, {Block, nn.LayerNorm})][:2] == ["blocks.0", "blocks.1"]
    # A Sequential of lone layers holds nothing worth checkpointing.
    assert find_blocks(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU())) == []


class _Wrapped(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner


class _Head(_Wrapped):
    pass


class _Layer(nn.Sequential):
    pass


def test_find_blocks_takes_every_stack_but_not_small_pairs_beside_one():
    """Two stacks of different layer classes are both blocks (an encoder-decoder); a pair of wrapped
    embeddings or heads beside a stack of 8 is not, nor are 2 containers nesting the stack's layers."""

    def layer() -> nn.Module:
        return _Layer(nn.LayerNorm(16), nn.Linear(16, 16))

    two_stacks = nn.Module()
    two_stacks.encoder = nn.ModuleList(nn.TransformerEncoderLayer(16, 2, 32) for _ in range(2))
    two_stacks.decoder = nn.ModuleList(nn.TransformerDecoderLayer(16, 2, 32) for _ in range(3))
    assert [n for n, _ in find_blocks(two_stacks)] == [
        *(f"encoder.{i}" for i in range(2)), *(f"decoder.{i}" for i in range(3))
    ]  # fmt: skip
    with_pairs = nn.Module()
    with_pairs.embeddings = nn.ModuleList(_Wrapped(nn.Embedding(20, 16)) for _ in range(2))
    with_pairs.blocks = nn.ModuleList(layer() for _ in range(8))
    with_pairs.heads = nn.ModuleList(_Head(nn.Linear(16, 20)) for _ in range(2))
    assert [n for n, _ in find_blocks(with_pairs)] == [f"blocks.{i}" for i in range(8)]
    nested = nn.Sequential(*(nn.Sequential(*(layer() for _ in range(3))) for _ in range(2)))
    assert [n for n, _ in find_blocks(nested)] == [f"{i}.{j}" for i in range(2) for j in range(3)]


def test_apply_patches_forward_in_place_never_twice_and_undoes():
    gpt = GPT(GPTConfig(**SMALL))
    keys, params = list(gpt.state_dict()), [id(p) for p in gpt.parameters()]
    first = apply_checkpointing(gpt, "full")
    assert applied_modes(gpt) == {f"blocks.{i}": "full" for i in range(4)}
    second = apply_checkpointing(gpt, {"blocks.0": "selective", "blocks.3": "none"})  # replaces, no nesting
    assert applied_modes(gpt) == {"blocks.0": "selective", "blocks.1": "full", "blocks.2": "full"}
    assert gpt.blocks[0].forward.previous is None  # wraps the class's forward, not the first wrapper
    assert list(gpt.state_dict()) == keys and [id(p) for p in gpt.parameters()] == params
    second.remove()
    assert applied_modes(gpt) == {f"blocks.{i}": "full" for i in range(4)}
    first.remove()
    assert applied_modes(gpt) == {} and all("forward" not in b.__dict__ for b in gpt.blocks)
    with apply_checkpointing(gpt, {Block}):  # a set of layer classes: full, as FSDPStrategy takes it
        assert set(applied_modes(gpt).values()) == {"full"}
    assert applied_modes(gpt) == {}
    apply_checkpointing(gpt, {"blocks.0.mlp": "full", "blocks.1": "selective"})
    apply_checkpointing(gpt, "none")  # removes every wrapper, not only the discovered blocks'
    assert applied_modes(gpt) == {}


def test_does_not_wrap_blocks_checkpointed_by_torch():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = nn.Sequential(*(checkpoint_wrapper(nn.Sequential(nn.Linear(4, 4), nn.ReLU())) for _ in range(2)))
    with pytest.warns(UserWarning, match="already checkpointed"):
        apply_checkpointing(model, "full")
    assert applied_modes(model) == {}


def test_no_grad_forward_is_plain():
    gpt = GPT(GPTConfig(**SMALL)).eval()
    x = torch.randint(0, 256, (2, 16))
    expected = gpt(x)[0]
    with apply_checkpointing(gpt, "full"), torch.no_grad():
        assert torch.equal(gpt(x)[0], expected)


# --------------------------------------------------------------------------------------------------
# Correctness: the gradients of the unwrapped model, bit for bit
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["full", "selective", "selective_half"])
def test_gpt_gradients_bitwise_equal_with_dropout(mode):
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(**{**SMALL, "n_layer": 3, "dropout": 0.1}))  # dropout > 0: SDPA's math path, masks
    x = torch.randint(0, 256, (4, 32))
    expected = _grads(gpt, lambda: gpt(x, x)[1])
    assert not torch.equal(
        expected["blocks.0.attn.c_attn.weight"],
        _grads(gpt, lambda: gpt(x, x)[1], seed=2)["blocks.0.attn.c_attn.weight"],
    )  # the masks matter, so equal gradients mean the RNG state was preserved
    with apply_checkpointing(gpt, mode):
        got = _grads(gpt, lambda: gpt(x, x)[1])
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(expected[name], got[name]), name


@pytest.mark.parametrize("mode", ["selective", "selective_half"])
def test_the_recompute_keeps_the_matmuls_the_forward_kept(mode):
    """Torch before 2.12 asks the policy again as it recomputes and hands back each op's saved outputs in
    order: the recompute's answers must be the forward's, or a LLaMA layer's k-projection gets the
    q-projection's output (seen on CUDA with torch 2.11: a shape error, and wrong gradients where the shapes
    are alike). torch 2.13 asks only in forward, so its bitwise tests above cannot see this."""
    from torch.utils.checkpoint import SelectiveCheckpointContext

    caching, _ = CHECKPOINTERS[mode].context()
    mm, add = torch.ops.aten.mm.default, torch.ops.aten.add.Tensor
    ops = [mm, add, mm, mm, add, mm, mm, mm, mm]  # q, k, v, o, gate, up, down: seven matmuls
    forward = [caching.policy_fn(SelectiveCheckpointContext(is_recompute=False), op) for op in ops]
    recompute = [caching.policy_fn(SelectiveCheckpointContext(is_recompute=True), op) for op in ops]
    assert recompute == forward
    kept = sum(p == CheckpointPolicy.MUST_SAVE for p in forward)
    assert kept == {"selective": 7, "selective_half": 4}[mode]


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_transformer_encoder_gradients_bitwise_equal(mode):
    torch.manual_seed(0)
    model = EncoderLM(n_layer=2)  # torch's nn.TransformerEncoderLayer, dropout 0.1
    x = torch.randint(0, 256, (4, 32))

    def loss():
        return lm_loss(model(x), x.roll(-1, 1))

    expected = _grads(model, loss)
    with apply_checkpointing(model, mode):
        assert set(applied_modes(model)) == {"encoder.layers.0", "encoder.layers.1"}
        got = _grads(model, loss)
    for name in expected:
        assert torch.equal(expected[name], got[name]), name


# --------------------------------------------------------------------------------------------------
# Recompute, counted with FlopCounterMode
# --------------------------------------------------------------------------------------------------


def _step_flops(gpt: GPT, x: torch.Tensor) -> int:
    with FlopCounterMode(display=False) as counter:
        gpt(x, x)[1].backward()
    return counter.get_total_flops()


def test_full_checkpointing_of_k_blocks_adds_k_block_forwards(planned):
    model, (x, y), _ = planned
    gpt = model.gpt
    with FlopCounterMode(display=False) as counter:
        gpt.blocks[0](torch.randn(*x.shape, SMALL["n_embd"]))
    block_forward = counter.get_total_flops()
    base = _step_flops(gpt, x)
    for k in (1, 2, 4):
        plan = {f"blocks.{i}": "full" for i in range(k)}
        with apply_checkpointing(gpt, plan), set_checkpoint_early_stop(False):
            assert _step_flops(gpt, x) - base == k * block_forward
    # With early stop (the default) recomputing ends once backward has what it needs: the block's last
    # matmul (the MLP's output projection) is not run again. The planner counts exactly that.
    plan = plan_checkpointing(
        model, (x, y), checkpointing="full", cost="flops", optimizer="sgd", loss_fn=lm_loss
    )
    full = [b.recompute_flops for b in plan.blocks]
    with apply_checkpointing(gpt, "full"):
        assert _step_flops(gpt, x) - base == sum(full)
    tokens, d = x.numel(), SMALL["n_embd"]
    assert full[0] == block_forward - 2 * tokens * (4 * d) * d
    # Selective checkpointing keeps every matmul output: no matmul FLOPs are recomputed.
    with apply_checkpointing(gpt, "selective"):
        assert _step_flops(gpt, x) == base


# --------------------------------------------------------------------------------------------------
# The cheapest plan, against every plan
# --------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_plan_is_the_cheapest_of_all_sixteen_that_fit():
    """A 2-block GPT, ``checkpointing="auto"``: every budget between (and at) the simulated peaks of its 16
    plans gets a plan that fits and costs the least recompute among the plans that fit; among the 4 plans
    of two modes too (``modes=``, as `plan_fit(checkpointing=("selective_half", "full"))` asks)."""
    torch.manual_seed(0)
    model = PlainGPT(**{**SMALL, "n_layer": 2})
    batch = torch.randint(0, 256, (8, 64)), torch.randint(0, 256, (8, 64))  # the shapes of `planned`
    planner = CheckpointPlanner(model, batch, cost="flops", optimizer="sgd", loss_fn=lm_loss, device="cpu")
    peaks = {c: planner.simulate(c).peak for c in itertools.product(CHECKPOINT_MODES, repeat=2)}
    levels = sorted(set(peaks.values()))
    assert len(levels) > 4  # the policies reach different peaks: the search has choices to make
    for budget in sorted({*levels, *((a + b) // 2 for a, b in itertools.pairwise(levels))}):
        plan = planner.plan(budget)
        cheapest = min(planner.overhead(c) for c, peak in peaks.items() if peak <= budget)
        assert plan.peak <= budget and plan.overhead == cheapest, (budget, str(plan))
        assert plan.peak == peaks[tuple(plan.modes.values())]
        # Modes without "none" (every block checkpointed): still block by block, among those modes.
        within = {c: peak for c, peak in peaks.items() if set(c) <= {"selective_half", "full"}}
        if budget < min(within.values()):
            continue
        plan = planner.plan(budget, modes=("selective_half", "full"))
        assert set(plan.modes.values()) <= {"selective_half", "full"}
        cheapest = min(planner.overhead(c) for c, peak in within.items() if peak <= budget)
        assert plan.peak <= budget and plan.overhead == cheapest, (budget, str(plan))


# --------------------------------------------------------------------------------------------------
# Plans fit: measured peaks of real steps
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def planned():
    """A 4-block GPT, a batch, and a planner over it (the profile and simulations are shared)."""
    torch.manual_seed(0)
    model = PlainGPT(**SMALL)
    x, y = torch.randint(0, 256, (8, 64)), torch.randint(0, 256, (8, 64))
    planner = CheckpointPlanner(model, (x, y), cost="flops", optimizer="sgd", loss_fn=lm_loss, device="cpu")
    return model, (x, y), planner


def _measured_peak(model: nn.Module, batch, plan) -> int:
    """The peak of a real steady-state step (SGD, as simulated) with ``plan`` applied, by `measure`."""
    x, y = batch
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, foreach=False)

    def step():
        lm_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()

    with apply_checkpointing(model, plan):
        step()
        with measure(model, optimizer) as m:
            step()
    return m.peak


@pytest.mark.slow
def test_plans_fit_their_budget_and_tighter_budgets_never_peak_higher(planned):
    model, batch, planner = planned
    none = planner.simulate(planner.uniform("none")).peak
    full = planner.simulate(planner.uniform("full")).peak
    assert _measured_peak(model, batch, "full") == full  # the simulation is exact
    measured = []
    for fraction in (1.0, 0.75, 0.5, 0.25, 0.0):
        budget = int(full + fraction * (none - full))
        plan = planner.plan(budget)
        peak = _measured_peak(model, batch, plan)
        assert peak <= budget, (fraction, str(plan))
        measured.append(peak)
        if fraction == 0.5:
            assert plan.overhead <= planner.overhead(planner.uniform("full")) / 2, str(plan)
    assert measured == sorted(measured, reverse=True), measured


def test_budget_below_full_checkpointing_names_the_floor(planned):
    _, _, planner = planned
    floor = planner.simulate(planner.uniform("full")).peak
    with pytest.raises(ValueError, match=rf"({floor:,} bytes).*micro-batch.*optimizer") as info:
        planner.plan(floor - 1)
    assert "below what activation checkpointing can reach" in str(info.value)


def test_no_repeated_blocks_names_the_layer_classes_option():
    mlp = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    batch = (torch.randn(4, 8), torch.randn(4, 8))
    with pytest.raises(ValueError, match=r"blocks=\{MyBlock\}"):
        plan_checkpointing(mlp, batch, "1MiB", optimizer="sgd", loss_fn=F.mse_loss, device="cpu")
    with pytest.raises(ValueError, match=r"blocks=\{MyBlock\}"):
        apply_checkpointing(mlp, "full")


def test_plan_round_trips_as_plain_data(planned):
    plan = planned[2].plan(None)
    assert set(plan.modes.values()) == {"selective"}
    data = json.loads(json.dumps(plan.as_dict()))
    assert CheckpointPlan.from_dict(data) == plan
    assert "selective" in str(plan) and "step peak" in str(plan)


# --------------------------------------------------------------------------------------------------
# The callback
# --------------------------------------------------------------------------------------------------


class _SpyGPT(GPTLightningModule):
    """Records which blocks were checkpointed when the optimizer was built."""

    def configure_optimizers(self):
        self.modes_at_optimizer = applied_modes(self)
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def _trainer(tmp_path, callbacks, **kwargs) -> pl.Trainer:
    return cpu_trainer(
        tmp_path, callbacks, **{"max_steps": 2, "logger": False, "limit_val_batches": None, **kwargs}
    )


def test_callback_plans_for_a_budget_in_setup(tmp_path, lightning_log):
    torch.manual_seed(0)
    model = _SpyGPT(GPTConfig(**SMALL))
    data = GPTDataModule(batch_size=8, seq_len=64, num_sentences=500)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    none = estimate_memory(model, batch, device="cpu").peak
    with apply_checkpointing(model, "full"):
        full = estimate_memory(model, batch, device="cpu").peak
    callback = ActivationCheckpointing(budget=(none + full) // 2)
    _trainer(tmp_path, [callback]).fit(model, data)
    plan = callback.plan
    assert plan is not None and plan.peak <= plan.budget
    # The default cost: the recomputed ops benchmarked one by one (here on the CPU).
    assert plan.cost == "measured" and all(b.recompute_time is not None for b in plan.blocks)
    chosen = {name: p for name, p in plan.modes.items() if p != "none"}
    assert chosen and model.modes_at_optimizer == chosen == applied_modes(model)
    assert "Activation checkpointing plan" in lightning_log.text
    restored = ActivationCheckpointing(budget=(none + full) // 2)
    restored.load_state_dict(callback.state_dict())
    assert restored.plan == plan


@pytest.mark.filterwarnings("ignore:.*callbacks used to create the checkpoint:UserWarning")
@pytest.mark.filterwarnings("ignore:.*dataloader is not resumable:UserWarning")
def test_callback_resume_reapplies_the_saved_plan(tmp_path, monkeypatch):
    import lightning_memkit.callbacks.activation_checkpointing as module

    saved = CheckpointPlan.uniform(["model.blocks.0", "model.blocks.1"], "full")
    fresh = CheckpointPlan.uniform(["model.blocks.2", "model.blocks.3"], "selective")
    monkeypatch.setattr(module, "plan_checkpointing", lambda *args, **kwargs: saved)
    monkeypatch.setattr(module, "_example_batch", lambda trainer: None)
    checkpoints = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    _trainer(tmp_path, [ActivationCheckpointing(budget="1GiB"), checkpoints], enable_checkpointing=True).fit(
        _SpyGPT(GPTConfig(**SMALL)), GPTDataModule(batch_size=4, seq_len=64, num_sentences=500)
    )

    monkeypatch.setattr(module, "plan_checkpointing", lambda *args, **kwargs: fresh)
    model, callback = _SpyGPT(GPTConfig(**SMALL)), ActivationCheckpointing(budget="1GiB")
    trainer = _trainer(tmp_path, [callback], max_steps=4)
    data = GPTDataModule(batch_size=4, seq_len=64, num_sentences=500)
    # weights_only=False: the demo module's hyperparameters hold a GPTConfig, which torch.load refuses.
    trainer.fit(model, data, ckpt_path=checkpoints.last_model_path, weights_only=False)
    assert callback.plan == saved
    assert applied_modes(model) == saved.modes
    # The optimizer was built after the switch.
    assert model.modes_at_optimizer == saved.modes


def test_the_state_key_is_the_one_saved_checkpoints_hold():
    """Checkpoints saved since the first builds key this callback's state ``policy=``: another spelling
    would drop their saved plan on resume, with only Lightning's warning about unknown callbacks."""
    key = ActivationCheckpointing(budget=8_000_000_000, blocks={Block}).state_key
    saved = "ActivationCheckpointing{'budget': 8000000000, 'policy': 'auto', 'layer_classes': ['Block']}"
    assert key == saved


def test_callback_without_blocks_names_the_layer_classes_option(tmp_path):
    with pytest.raises(ValueError, match=r"blocks=\{MyBlock\}"):
        _trainer(tmp_path, [ActivationCheckpointing(checkpointing="full")]).fit(BoringModel())


def _fit_of(strategy):
    """What ``setup`` reads of a Trainer: its strategy and (none beside it) callbacks."""
    return types.SimpleNamespace(callbacks=[], strategy=strategy)


def test_callback_hands_full_checkpointing_to_fsdp():
    model = GPTLightningModule(GPTConfig(**SMALL))
    strategy = FSDPStrategy()
    callback = ActivationCheckpointing(checkpointing="full")
    callback.setup(_fit_of(strategy), model, "fit")
    wrap_policy = strategy._activation_checkpointing_kwargs["auto_wrap_policy"]
    assert wrap_policy._module_classes == {Block}  # as FSDPStrategy(activation_checkpointing_policy={Block})
    assert applied_modes(model) == {}  # FSDP wraps; nothing patched in place
    assert set(callback.plan.modes.values()) == {"full"}

    selective = ActivationCheckpointing(checkpointing="selective")
    selective.setup(_fit_of(FSDPStrategy()), model, "fit")  # no FSDP form: in place
    assert set(applied_modes(model).values()) == {"selective"}

    with pytest.raises(MisconfigurationException, match="cannot plan under FSDPStrategy"):
        ActivationCheckpointing(budget="1GiB").setup(_fit_of(FSDPStrategy()), model, "fit")
    configured = FSDPStrategy(activation_checkpointing_policy={Block})
    with pytest.raises(MisconfigurationException, match="keep one of them"):
        ActivationCheckpointing(checkpointing="full").setup(_fit_of(configured), model, "fit")
