"""Which modules `find_blocks` takes as blocks when none are named: a user's composite layers, not a
library's. Repeated ``nn.MultiheadAttention`` attributes are not blocks (taking them made every plan that
checkpoints them raise torch's CheckpointError: see the identity test below), nor are peft's LoRA wrappers
around single layers (a LoRA UNet's blocks are its ResBlocks and AttnBlocks, not 18 wrapped convs), nor a
``ModuleList`` nested in a list, which is never called (Hugging Face PVT's layers)."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from helpers import cpu_trainer
from models import AttributeUNet, ResBlock, UNetModule
from torch import nn

from lightning_memkit import (
    ActivationCheckpointing,
    AutoFit,
    apply_checkpointing,
    estimate_memory,
    find_blocks,
    plan_fit,
)

pytestmark = pytest.mark.usefixtures("one_thread")

UNET_BLOCKS = ["down1", "down2", "down_attn", "mid1", "mid_attn", "mid2", "up1", "up_attn", "up2"]


class _SelfAttention(nn.Module):
    """An embedding, then two ``nn.MultiheadAttention`` held as attributes and called for self-attention."""

    def __init__(self, c: int = 32) -> None:
        super().__init__()
        self.emb = nn.Linear(c, c)
        self.a1 = nn.MultiheadAttention(c, 2, batch_first=True)
        self.a2 = nn.MultiheadAttention(c, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, c) -> (B, T, c)
        x = self.emb(x)
        x = x + self.a1(x, x, x, need_weights=False)[0]
        return x + self.a2(x, x, x, need_weights=False)[0]


def test_torch_layers_held_as_attributes_are_not_blocks():
    """It found a1 and a2 (and plan_fit raised CheckpointError even at a generous budget: next test)."""
    torch.manual_seed(0)
    model = _SelfAttention()
    assert find_blocks(model) == []
    # in a list, torch's layers are still a stack of blocks (nn.Transformer's encoder layers)
    stack = nn.Module()
    stack.layers = nn.ModuleList(nn.TransformerEncoderLayer(16, 2, 32) for _ in range(2))
    assert [n for n, _ in find_blocks(stack)] == ["layers.0", "layers.1"]
    # named, the classes are taken as asked
    assert [n for n, _ in find_blocks(model, nn.MultiheadAttention)] == ["a1", "a2"]


@pytest.mark.slow  # 5 s on 2 cores: the first simulated steps of a process
def test_plan_fit_plans_a_model_with_attention_attributes_again():
    torch.manual_seed(0)
    batch = torch.randn(2, 16, 32)
    plan = plan_fit(_SelfAttention(), (batch, batch), "64MiB", device="cpu", cost="flops", loss_fn=F.mse_loss)
    assert plan.checkpointing == "none" and plan.modes == ("none",)


def test_a_lora_wrapped_layer_is_not_a_block_the_unets_blocks_are():
    """peft's lora.Conv2d has submodules: 18 of them were the heaviest group, and the UNet's 9 blocks lost."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    config = peft.LoraConfig(r=4, target_modules=["conv1", "conv2", "qkv", "proj"])
    unet = peft.get_peft_model(AttributeUNet(), config)
    assert [n for n, _ in find_blocks(unet)] == [f"base_model.model.{n}" for n in UNET_BLOCKS]

    class MLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2, self.fc3 = nn.Linear(32, 64), nn.Linear(64, 64), nn.Linear(64, 10)

    mlp = peft.get_peft_model(MLP(), peft.LoraConfig(r=4, target_modules=["fc1", "fc2", "fc3"]))
    assert find_blocks(mlp) == []  # three lone layers: nothing to checkpoint, and the error says so


def test_a_list_nested_in_a_list_is_not_a_block_its_layers_are():
    """Hugging Face PVT's encoder.block = ModuleList(ModuleList(PvtLayer, ...) per stage): the inner lists
    were the blocks, never called, so checkpointing them saved nothing."""

    class Layer(nn.Sequential):
        pass

    model = nn.Module()

    def stage() -> nn.ModuleList:
        return nn.ModuleList(Layer(nn.LayerNorm(8), nn.Linear(8, 8)) for _ in range(2))

    model.block = nn.ModuleList(stage() for _ in range(3))
    assert [n for n, _ in find_blocks(model)] == [f"block.{i}.{j}" for i in range(3) for j in range(2)]
    # a Sequential in a list is called: it stays a block
    staged = nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(3)))
    assert [n for n, _ in find_blocks(staged)] == ["0", "1", "2"]


def test_a_module_called_with_one_tensor_twice_loses_its_identity_under_hooks():
    """Why torch's layers held as attributes are left out: under any saved-tensor hooks (the measurement's,
    the simulation's, ``save_on_cpu``), non-reentrant checkpointing recomputes from inputs that autograd
    unpacks as new tensors, so ``a is b`` no longer holds in the recompute and ``nn.MultiheadAttention(x, x,
    x)`` takes another path: torch raises. Without hooks the same step trains."""

    class Same(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return self.lin(a) * 2 if a is b else self.lin(torch.cat([a, b]))[: a.shape[0]]

    def step(model: nn.Module, x: torch.Tensor) -> None:
        h = model[0](x)
        F.mse_loss(model[1](h, h), x).backward()

    torch.manual_seed(0)
    model, x = nn.ModuleList([nn.Linear(8, 8), Same()]), torch.randn(4, 8)
    apply_checkpointing(model, {"1": "full"})
    step(model, x)
    hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
    with pytest.raises(torch.utils.checkpoint.CheckpointError, match="Recomputed values"), hooks:
        step(model, x)


def test_the_unet_module_keeps_its_blocks():
    torch.manual_seed(0)
    assert [n for n, _ in find_blocks(UNetModule())] == [f"unet.{n}" for n in UNET_BLOCKS]


@pytest.mark.parametrize(
    ("blocks", "error", "match"),
    [
        (42, TypeError, r"blocks= takes layer classes: .*; got 42 \(int\)"),
        ("ResBlock", TypeError, "got the name 'ResBlock': pass the class itself"),
        ({ResBlock: "full"}, TypeError, "got a dict .*: its modes go in checkpointing="),
        ({nn.Module}, ValueError, "nn.Module is every module of the model"),
        (set(), TypeError, r"got set\(\)"),
    ],
)
def test_blocks_that_are_not_layer_classes_are_refused_saying_what_blocks_takes(blocks, error, match):
    for make in (lambda: AutoFit("1GiB", blocks=blocks), lambda: ActivationCheckpointing(blocks=blocks)):
        with pytest.raises(error, match=match):
            make()


@pytest.mark.parametrize("beside", [False, True], ids=["AutoFit", "ActivationCheckpointing"])
def test_blocks_the_model_lacks_are_refused_naming_the_users_own_argument(tmp_path, beside):
    """It said "Name one of those: plan_fit(..., blocks={ResBlock})" to a user who never called plan_fit."""
    named = ActivationCheckpointing(checkpointing="full", blocks={nn.LSTM}) if beside else None
    autofit = AutoFit("1GiB", cost="flops", blocks=None if beside else {nn.LSTM})
    who = "ActivationCheckpointing" if beside else "AutoFit"
    trainer = cpu_trainer(tmp_path, [autofit, *([named] if named else [])], max_steps=1, logger=False)
    with pytest.raises(
        ValueError, match=rf"No module of type LSTM .* Name one of those: {who}\(blocks=\{{ResBlock\}}\)"
    ):
        trainer.fit(UNetModule(samples=8))


class _Wrapped(pl.Callback):
    def on_train_batch_start(self, trainer, pl_module, *args) -> None:
        self.names = sorted(n for n, m in pl_module.named_modules() if "forward" in m.__dict__)


@pytest.mark.slow  # 10 s on 2 cores: two fits, a checkpoint, three plans
def test_resuming_with_other_blocks_than_the_checkpoints_plan_keeps_this_runs_and_says_so(tmp_path):
    """The saved plan (all 9 blocks checkpointed) was installed over AutoFit(blocks={ResBlock}) silently."""
    module = UNetModule(samples=8)
    full, none = (
        estimate_memory(module, module.batch(8), device="cpu", checkpointing=c).peak for c in ("full", "none")
    )
    plan = dict(budget=(full + none) // 2, margin=0.0, cost="flops", checkpointing=("none", "full"))
    first = AutoFit(**plan)
    trainer = cpu_trainer(tmp_path, [first], max_steps=1, logger=False)
    trainer.fit(_unet())
    path = tmp_path / "first.ckpt"
    trainer.save_checkpoint(path)
    assert [b.name for b in first.plan.checkpoint_plan.blocks] == [f"unet.{n}" for n in UNET_BLOCKS]
    wrapped = _Wrapped()
    trainer = cpu_trainer(tmp_path, [AutoFit(**plan, blocks={ResBlock}), wrapped], max_steps=2, logger=False)
    changed = r"made for another run \(checkpointed blocks 9 \(unet.down1, .*\) -> 6 \(unet.down1, "
    with pytest.warns(UserWarning, match=changed):
        trainer.fit(_unet(), ckpt_path=path)
    assert not [name for name in wrapped.names if "attn" in name]  # the AttnBlocks stay as they are


def _unet() -> UNetModule:
    torch.manual_seed(0)
    return UNetModule(samples=8)


def test_a_budget_without_blocks_is_refused_naming_activation_checkpointings_argument(tmp_path):
    """With a budget the planner refused, naming plan_checkpointing(..., blocks={MyBlock})."""
    trainer = cpu_trainer(
        tmp_path, [ActivationCheckpointing("1GiB", cost="flops")], max_steps=1, logger=False
    )
    module = UNetModule(samples=8)
    module.unet = _SelfAttention(4)  # no blocks: two torch attention layers
    with pytest.raises(
        ValueError, match=r"Found no repeated blocks .* ActivationCheckpointing\(blocks=\{MyBlock\}\)"
    ):
        trainer.fit(module)
