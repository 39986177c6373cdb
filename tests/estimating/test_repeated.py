"""The simulated step of a deep stack of identical blocks, from three shallow ones (`_estimating.repeated`):
the same
breakdown as simulating every block, byte for byte, or no shortcut at all."""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
from torch import nn
from zoo import MODELS, ZooModule, zoo_batch

from lightning_memkit import apply_checkpointing
from lightning_memkit._checkpointing.blocks import find_blocks
from lightning_memkit._estimating import repeated
from lightning_memkit._estimating.fake_step import simulate_step
from lightning_memkit._estimating.fake_tracker import cublas_workspace_bytes
from lightning_memkit._estimating.simulate import counted_step, estimate_memory
from lightning_memkit._step import Step
from lightning_memkit.demos.gpt import GPTLightningModule

DEPTH = 6  # deeper than the shallow steps (at most 4 blocks) by two, so the extrapolation is not a lookup


@pytest.fixture(autouse=True)
def _shallow_enough(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(repeated, "MIN_DEPTH", DEPTH - 1)


def _layers_key(config) -> str:
    return "n_layer" if hasattr(config, "n_layer") else "num_hidden_layers"


class DeepZoo(ZooModule):
    """A zoo model with ``DEPTH`` blocks, otherwise its default config."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        config = self.model.config
        setattr(config, _layers_key(config), DEPTH)
        if getattr(config, "layer_types", None):  # one per block (Qwen2's): all of the default kind
            config.layer_types = [config.layer_types[0]] * DEPTH
        torch.manual_seed(0)
        self.model = type(self.model)(config)


def _both(model, batch, **kwargs):
    """The shortcut's breakdown and the whole simulation's."""
    step, run = Step.split(kwargs)
    shortcut = repeated.shortcut(
        model, functools.partial(simulate_step, model, batch, step, history=True, **run)
    )
    whole = simulate_step(model, batch, step, **run).breakdown()
    return shortcut, whole


FAMILIES = ["bert", "qwen2", "gpt_neox", "gpt2", "vit", "mixtral"]
CONFIGS = {
    "steady": {},
    "first_step": {"first_step": True},
    "full_checkpointing": {"checkpointing": "full"},
    "selective_checkpointing": {"checkpointing": "selective"},
    "accumulating_bf16_mixed": {"accumulating": True, "precision": "bf16-mixed"},
}


#: The quick tier runs a diagonal of the grid, every family and every configuration once; the rest is slow.
ZOO_GRID = [
    pytest.param(name, config, marks=() if i == j else pytest.mark.slow, id=f"{name}-{config}")
    for i, name in enumerate(FAMILIES)
    for j, config in enumerate(CONFIGS)
]


@pytest.mark.parametrize(("name", "config"), ZOO_GRID)
@pytest.mark.slow
def test_the_shortcut_is_the_whole_simulation_byte_for_byte_on_the_zoo(name: str, config: str) -> None:
    module = DeepZoo(name)
    shortcut, whole = _both(module, zoo_batch(name), device="cpu", **CONFIGS[config])
    assert shortcut is not None, "the zoo's blocks are copies of one another: the shortcut applies"
    assert shortcut.breakdown == whole


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_the_shortcut_holds_for_one_fsdp2_rank(world_size: int) -> None:
    module = DeepZoo("qwen2")
    kwargs = {"strategy": "fsdp2", "world_size": world_size, "device": "cpu"}
    shortcut, whole = _both(module, zoo_batch("qwen2"), **kwargs)
    assert shortcut is not None and shortcut.breakdown == whole


@pytest.mark.slow
def test_a_peak_that_moves_with_depth_is_followed() -> None:
    """At a few blocks the peak is at the loss (the logits); at 16 it is in the optimizer's foreach step
    (a temporary as large as every parameter): no straight line through the shallow peaks finds it."""
    module = GPTLightningModule({"n_layer": 16, "n_embd": 128, "n_head": 4, "vocab_size": 4096})
    x = torch.randint(0, 4096, (2, 64))
    kwargs = {"precision": "bf16-true", "checkpointing": "full", "device": "cuda", "optimizer": "adamw"}
    container, _ = repeated.repeated_blocks(module)
    step, run = Step.split(kwargs)
    with repeated.truncated(container, 2):
        shallow = simulate_step(module, (x, x), step, **run).breakdown()
    shortcut, whole = _both(module, (x, x), **kwargs)
    assert shortcut is not None and shortcut.breakdown == whole
    assert shallow.activations > 100 * whole.activations  # shallow: the peak at the loss, with activations
    # deep: the foreach step's parameter-sized temporary, beside cuBLAS's workspaces
    assert whole.temporary - cublas_workspace_bytes() == whole.parameters


def test_counted_step_extrapolates_flops_and_ops_exactly() -> None:
    module = DeepZoo("gpt2")
    batch = zoo_batch("gpt2")
    fast = counted_step(module, batch, Step(), device="cpu")
    repeated.MIN_DEPTH = 10**6  # restored by the fixture's monkeypatch
    assert counted_step(module, batch, Step(), device="cpu") == fast


def test_estimate_memory_takes_the_shortcut_and_leaves_the_model_whole() -> None:
    module = DeepZoo("qwen2")
    before = [name for name, _ in module.named_parameters()]
    calls = []
    original = repeated.truncated

    def spy(container, depth, run=None):
        calls.append(depth)
        return original(container, depth, run)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(repeated, "truncated", spy)
        fast = estimate_memory(module, zoo_batch("qwen2"), device="cpu")
    assert calls == [1, 2, 3]
    assert [name for name, _ in module.named_parameters()] == before
    assert len(module.model.model.layers) == DEPTH
    assert fast == simulate_step(module, zoo_batch("qwen2"), Step(), device="cpu").breakdown()


@pytest.mark.parametrize("applied", [True, False], ids=["applied", "by_argument"])
@pytest.mark.slow
def test_checkpointed_steps_from_one_block_up_or_from_two(applied: bool) -> None:
    """Checkpointing applied to the model (as the planners do) cuts it to 1, 2 and 3 blocks; asked of
    `estimate_memory`, which finds the blocks by their repetition, a 1-block model has none to find, and the
    steps at 2, 3 and 4 blocks stand for it. Both are the whole simulation's figures."""
    module = DeepZoo("gpt2")
    batch = zoo_batch("gpt2")
    calls = []
    original = repeated.truncated

    def spy(container, depth, run=None):
        calls.append(depth)
        return original(container, depth, run)

    kwargs = {"device": "cpu"} if applied else {"device": "cpu", "checkpointing": "full"}
    with apply_checkpointing(module, "full") if applied else contextlib.nullcontext():
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(repeated, "truncated", spy)
            fast = estimate_memory(module, batch, **kwargs)
        step, run = Step.split(kwargs)
        whole = simulate_step(module, batch, step, **run).breakdown()
    assert calls == ([1, 2, 3] if applied else [1, 2, 3, 4])
    assert fast == whole


class Growing(nn.Module):
    """Copies of one block, but each keeps for backward everything the blocks before it made: what a block
    holds grows with its place, and the step with the square of the depth."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(DEPTH))
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kept, h = x, x
        for block in self.blocks:
            h = block(h)
            kept = torch.cat([kept, h], dim=1) * self.scale  # saves the whole of `kept` for backward
        return kept.sum()


def test_a_step_the_rule_does_not_predict_is_not_extrapolated() -> None:
    model = Growing()
    batch = (torch.randn(4, 8), None)
    kwargs = {"loss_fn": lambda out, _: out, "optimizer": "sgd", "device": "cpu"}
    shortcut, whole = _both(model, batch, **kwargs)
    assert repeated.repeated_blocks(model) is not None  # it looks like copies of one block
    assert shortcut is None  # but the 4-block step is not the one the rule predicts
    assert estimate_memory(model, batch, **kwargs) == whole


def test_blocks_that_differ_are_simulated_whole() -> None:
    module = DeepZoo("qwen2")
    assert repeated.repeated_blocks(module) is not None
    module.model.model.layers[DEPTH - 1].self_attn.scaling = 0.5  # one block unlike the others
    assert repeated.repeated_blocks(module) is None


def test_a_per_block_checkpointing_plan_without_a_long_run_is_simulated_whole() -> None:
    from lightning_memkit import apply_checkpointing

    module = DeepZoo("gpt2")
    names = [f"model.transformer.h.{i}" for i in range(DEPTH)]
    with apply_checkpointing(module, {name: "full" if i < 2 else "none" for i, name in enumerate(names)}):
        assert repeated.repeated_blocks(module) is None
        assert repeated.repeated_run(module) is None  # 4 alike of 6: shorter than MIN_DEPTH
    with apply_checkpointing(module, "full"):
        assert repeated.repeated_blocks(module) is not None


@pytest.mark.parametrize("other", [0, DEPTH - 1], ids=["first", "last"])
@pytest.mark.parametrize("name", ["gpt2", pytest.param("qwen2", marks=pytest.mark.slow)])
@pytest.mark.slow
def test_a_plan_with_a_few_blocks_apart_takes_the_shortcut_byte_for_byte(name: str, other: int) -> None:
    """The checkpointing planner's plans give a few blocks at one end another mode: the run of the rest is
    extrapolated, the blocks apart simulated in every shallow step, and the step is the whole simulation's
    to the byte."""
    from lightning_memkit import apply_checkpointing

    module = DeepZoo(name)
    names = [n for n, _ in find_blocks(module)]
    plan = {n: "selective" if i == other else "full" for i, n in enumerate(names)}
    with apply_checkpointing(module, plan):
        run = repeated.repeated_run(module)
        assert run is not None and (run.start, run.length) == (int(other == 0), DEPTH - 1)
        assert repeated.repeated_blocks(module) is None  # not every block: the planner profiles them all
        shortcut, whole = _both(module, zoo_batch(name), device="cpu")
    assert shortcut is not None and shortcut.breakdown == whole


def test_models_without_one_stack_of_copies_are_simulated_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(repeated, "MIN_DEPTH", 2)  # the zoo's ResNet has 4 blocks
    for name in ("t5", "whisper", "resnet"):  # two stacks (encoder, decoder); blocks of different widths
        assert repeated.repeated_blocks(ZooModule(name)) is None
    assert set(FAMILIES) | {"t5", "whisper", "resnet"} == set(MODELS)


def test_the_checkpointing_planner_profiles_two_copies_for_all_of_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from lightning_memkit._checkpointing.planner import CheckpointPlanner

    module = DeepZoo("gpt2")
    kwargs = {"cost": "flops", "device": "cpu", "checkpointing": ("none", "selective", "full")}
    fast = CheckpointPlanner(module, zoo_batch("gpt2"), **kwargs)
    monkeypatch.setattr(repeated, "MIN_DEPTH", 10**6)
    whole = CheckpointPlanner(module, zoo_batch("gpt2"), **kwargs)
    assert len(fast.blocks) == DEPTH
    assert fast.blocks == whole.blocks and fast.baseline == whole.baseline


class _Block(nn.Module):
    def __init__(self, wide: bool) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(32, 128), nn.Linear(128, 32)

    def widen(self) -> bool:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc1(x))
        if self.widen():  # a wider intermediate in the blocks past the fourth
            h = h.repeat(1, 1, 8).view(*h.shape[:-1], 8, -1).mean(-2)
        return x + self.fc2(h)


class _TupleBlock(_Block):  # ModernBERT-style ``local_attention = (w, w)``
    def __init__(self, wide: bool) -> None:
        super().__init__(wide)
        self.window = (-1, -1) if wide else (8, 8)

    def widen(self) -> bool:
        return self.window == (-1, -1)


class _PrivateBlock(_Block):
    def __init__(self, wide: bool) -> None:
        super().__init__(wide)
        self._wide = wide

    def widen(self) -> bool:
        return self._wide


class _Settings:
    def __init__(self, wide: bool) -> None:
        self.wide = wide


class _ConfigBlock(_Block):  # a per-layer config object
    def __init__(self, wide: bool) -> None:
        super().__init__(wide)
        self.settings = _Settings(wide)

    def widen(self) -> bool:
        return self.settings.wide


class _Stack(nn.Module):
    def __init__(self, block: type[_Block], *, wide_from: int = 4, checkpoint_first: int = 0) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(block(wide=i >= wide_from) for i in range(16))
        self.checkpoint_first = checkpoint_first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            if i < self.checkpoint_first:
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return x


@pytest.mark.parametrize("block", [_TupleBlock, _PrivateBlock, _ConfigBlock])
def test_blocks_that_differ_past_the_fourth_in_any_setting_are_simulated_whole(block: type[_Block]) -> None:
    """A setting the shallow steps never see differ: a tuple, an underscore attribute, an object's field."""
    assert repeated.repeated_blocks(_Stack(block)) is None
    assert repeated.repeated_blocks(_Stack(block, wide_from=16)) is not None  # all alike: it applies


@pytest.mark.xfail(strict=True, reason="known limit: what the parent's loop does by position is not seen")
def test_a_parent_that_checkpoints_only_some_blocks_is_not_seen() -> None:
    """The parent checkpoints the first 4 blocks by hand (Megatron's "recompute the first N layers"): the
    2-, 3- and 4-block steps are all checkpointed throughout, the deep step is not past the fourth, and no
    setting of the blocks says so. Recorded here until the shortcut probes deeper."""
    model = _Stack(_PrivateBlock, wide_from=16, checkpoint_first=4)
    batch = (torch.randn(8, 256, 32), None)
    kwargs = {"loss_fn": lambda out, _: out.square().mean(), "optimizer": "adamw", "device": "cuda"}
    shortcut, whole = _both(model, batch, **kwargs)
    assert shortcut is None or shortcut.breakdown == whole
