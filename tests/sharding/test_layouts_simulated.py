"""Tensor parallelism and HSDP simulated in this one process, on fake tensors over a fake process group:
the layouts `Sharding` names, the user's own ``parallelize_fn``, and what is refused. The real ranks these
simulations are held to run in tests/sharding/test_parallel_layouts.py (4 gloo ranks)."""

import pytest
import torch
from helpers import cpu_trainer
from torch import nn

from lightning_memkit import estimate_memory, plan_fit
from lightning_memkit._sharding.layout import describe_layout, layout_mismatch, tp_plan
from lightning_memkit._step import Sharding, Step

BATCH, SEQ = 4, 32


def llama(kv_heads: int = 2) -> nn.Module:
    """A Hugging Face LLaMA from a random tiny config (defaults kept but the sizes), under a loss head."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=131, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=kv_heads, max_position_embeddings=64,
    )  # fmt: skip
    return CausalLM(LlamaForCausalLM(config))


class CausalLM(nn.Module):
    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=ids, labels=ids).loss


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 131, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    return ids, ids


def peak(model: nn.Module, **layout) -> int:
    """One rank's simulated peak of ``model`` under the `Sharding` ``layout``'s fields make."""
    return estimate_memory(
        model, batch(), optimizer="adamw", loss_fn=lambda loss, _: loss, device="cpu",
        sharding=Sharding(**layout),
    ).peak  # fmt: skip


def user_hsdp(model: nn.Module, mesh) -> None:
    """HSDP as a user writes it: its own (replicate, shard) mesh, ``fully_shard`` on each layer and the
    model over it. ``init_device_mesh`` asks for CUDA: the simulation answers with a fake CPU mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    hsdp = init_device_mesh("cuda", (2, 2), mesh_dim_names=("replicate", "shard"))
    for layer in model.lm.model.layers:
        fully_shard(layer, mesh=hsdp)
    fully_shard(model.lm, mesh=hsdp)


def user_tp(model: nn.Module, mesh) -> None:
    """Tensor parallelism as a user writes it (torchtitan's plan for LLaMA's layers), then FSDP2 over the
    data-parallel dimension of Lightning's mesh."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {
        **{f"self_attn.{p}": ColwiseParallel() for p in ("q_proj", "k_proj", "v_proj")},
        **{f"mlp.{p}": ColwiseParallel() for p in ("gate_proj", "up_proj")},
        "self_attn.o_proj": RowwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }
    for layer in model.lm.model.layers:
        parallelize_module(layer, mesh["tensor_parallel"], plan)
    for layer in model.lm.model.layers:
        fully_shard(layer, mesh=mesh["data_parallel"])
    fully_shard(model.lm, mesh=mesh["data_parallel"])


def test_hsdp_is_simulated_as_its_shard_group_not_as_fsdp2_over_every_rank():
    """HSDP 2 x 2 shards each parameter over 2 ranks: the default layout (``replicate_size=2``) and the
    user's own function (its own mesh) simulate the same step, the shard group's; FSDP2 over all 4 ranks
    is another (the issue's reading: -16 % on each rank)."""
    model = llama()
    hsdp = peak(model, world_size=4, replicate_size=2)
    assert peak(model, world_size=4, parallelize_fn=user_hsdp) == hsdp
    assert peak(model, world_size=4) < hsdp


def test_tensor_parallelism_is_simulated_by_the_plan_or_the_users_function_alike():
    model = llama()
    tp = peak(model, world_size=4, tensor_parallel_size=2)
    assert peak(model, world_size=4, tensor_parallel_size=2, parallelize_fn=user_tp) == tp
    assert tp != peak(model, world_size=4)  # another layout, another step
    assert set(tp_plan(model, [f"lm.model.layers.{i}" for i in range(2)])) == {
        f"lm.model.layers.{i}.{p}"
        for i in range(2)
        for p in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                  "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    }  # fmt: skip


def q_proj_split(model: nn.Module, mesh) -> None:
    """Tensor parallelism over one projection of each layer; every other parameter stays whole."""
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    for layer in model.lm.model.layers:
        parallelize_module(layer, mesh["tensor_parallel"], {"self_attn.q_proj": ColwiseParallel()})


@pytest.mark.usefixtures("one_rank_group")
def test_parameters_a_layout_leaves_whole_cost_what_they_hold(tmp_path):
    """At one rank, splitting q_proj changes no byte of the step: the simulation says the unsplit model's
    peak and the real one-rank step's allocator agrees (to the bytes the plain step's estimate is off).
    The copy a layout is applied to held its whole parameters as fakes of another fake mode, faked again at
    every op they met, and the copies autograd saved were counted: +82,320 B here, +2.3 % at TP 4."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_memkit.testing import allocator_peak

    def one_rank_peak(model: nn.Module) -> int:
        return estimate_memory(
            model, batch(), optimizer="adamw", loss_fn=lambda loss, _: loss, device="cpu",
            sharding=Sharding(parallelize_fn=q_proj_split),
        ).peak  # fmt: skip

    whole = estimate_memory(llama(), batch(), optimizer="adamw", loss_fn=lambda loss, _: loss, device="cpu")
    assert one_rank_peak(llama()) == whole.peak

    if not dist.is_initialized():  # a one-rank Trainer earlier in this process may have left its own
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    assert dist.get_world_size() == 1
    model = llama()
    q_proj_split(model, init_device_mesh("cpu", (1, 1), mesh_dim_names=("data_parallel", "tensor_parallel")))
    optimizer, (ids, _) = torch.optim.AdamW(model.parameters()), batch()

    def step() -> None:
        model(ids).backward()
        optimizer.step()
        optimizer.zero_grad()

    real = [allocator_peak(step) for _ in range(2)][-1]
    assert abs(whole.peak - real) <= 64, (whole.peak, real)


def test_the_simulation_leaves_the_model_and_the_process_as_they_were():
    import torch.distributed as dist
    import torch.distributed.device_mesh as device_mesh

    model = llama()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    own, initialized = device_mesh.init_device_mesh, dist.is_initialized()
    peak(model, world_size=4, parallelize_fn=user_hsdp)
    assert device_mesh.init_device_mesh is own and dist.is_initialized() == initialized
    assert user_hsdp.__globals__.get("init_device_mesh", own) is own
    assert all(torch.equal(before[name], p) for name, p in model.named_parameters())
    assert not any(type(p).__name__ == "DTensor" for p in model.parameters())


def test_layouts_that_cannot_run_are_refused_with_the_reason():
    model = llama()
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 does not divide .*num_key_value_heads=2"):
        peak(model, world_size=4, tensor_parallel_size=4)
    with pytest.raises(ValueError, match="left no parameter of CausalLM sharded"):
        peak(model, world_size=4, parallelize_fn=lambda module, mesh: None)
    with pytest.raises(ValueError, match=r"device mesh of 4 ranks .* simulated for 8"):
        peak(model, world_size=8, parallelize_fn=user_hsdp)
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide world_size=4"):
        Sharding(4, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="replicate_size=3 does not divide the 4 data-parallel ranks"):
        Sharding(4, replicate_size=3)
    with pytest.raises(ValueError, match="no projections the built-in plan knows"):
        mlp = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
        estimate_memory(
            mlp, (torch.zeros(4, 8), torch.zeros(4, 1)), optimizer="sgd", loss_fn=nn.functional.mse_loss,
            device="cpu", sharding=Sharding(2, tensor_parallel_size=2),
        )  # fmt: skip
    with pytest.raises(TypeError, match="unexpected keyword argument 'tensor_parallel_size'"):
        Step.of(tensor_parallel_size=2)


@pytest.mark.slow
def test_a_plan_under_tensor_parallelism_splits_the_batch_over_the_data_parallel_ranks_only():
    """TP 2 x FSDP2 2: two data-parallel ranks take a batch each; a bitsandbytes optimizer is never planned
    (its kernels do not step DTensors)."""
    model = llama()
    ids = torch.randint(0, 131, (8, SEQ))
    layout = Sharding(4, tensor_parallel_size=2)
    plan = plan_fit(
        model, (ids, ids), "100MB", loss_fn=lambda loss, _: loss, device="cpu", strategy="fsdp2",
        world_size=4, sharding=layout, optimizers=["adamw8bit", "adamw"],
    )  # fmt: skip
    assert plan.micro_batch_size * plan.accumulate_grad_batches == 8 // 2
    assert plan.optimizer == "adamw" and isinstance(plan.reshard_after_forward, bool)
    # the user's layout function calls fully_shard with its own resharding: the plan does not choose one
    theirs = Sharding(4, tensor_parallel_size=2, parallelize_fn=user_tp)
    plan = plan_fit(
        model, (ids, ids), "100MB", loss_fn=lambda loss, _: loss, device="cpu", strategy="fsdp2",
        world_size=4, sharding=theirs, optimizers=["adamw"],
    )  # fmt: skip
    assert plan.reshard_after_forward is None
    with pytest.raises(ValueError, match="layout of strategy='fsdp2' over world_size ranks"):
        plan_fit(
            model,
            (ids, ids),
            "100MB",
            loss_fn=lambda loss, _: loss,
            device="cpu",
            world_size=2,
            sharding=layout,
        )


def test_a_run_whose_layout_is_not_the_planned_one_is_told_both():
    planned = (((("data_parallel",), (4,), ("Shard(dim=0)",)), 12),)
    run = (((("replicate", "shard"), (2, 2), ("Replicate()", "Shard(dim=0)")), 12),)
    message = layout_mismatch(planned, run, "AutoFit", Sharding(4))
    assert message is not None
    assert "AutoFit planned each rank's step of 4 under FSDP2" in message
    assert "12 parameters (Shard(dim=0)) over data_parallel=4" in message
    assert "12 parameters (Replicate(), Shard(dim=0)) over replicate=2 x shard=2" in message
    unnamed = (((None, (4,), ("Shard(dim=0)",)), 12),)
    assert layout_mismatch(unnamed, planned, "AutoFit", Sharding(4)) is None  # names aside, the same
    assert describe_layout(()) == "nothing sharded"


def test_a_lightning_modules_configure_model_is_the_layout_it_is_simulated_with():
    """``parallelize_fn=ConfigureModel()``: the module's own configure_model run on the simulated copy with
    the fake mesh as ``self.device_mesh``, as ModelParallelStrategy runs it; no warning that configure_model
    is pending (it runs), and the module itself is left unsharded."""
    import warnings

    import lightning.pytorch as pl

    from lightning_memkit import ConfigureModel

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = llama()

        def configure_model(self) -> None:
            user_tp(self.net, self.device_mesh)

        def training_step(self, batch, batch_idx):
            return self.net(batch[0])

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters())

    module = Module()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        own = estimate_memory(
            module, batch(), device="cpu",
            sharding=Sharding(4, tensor_parallel_size=2, parallelize_fn=ConfigureModel()),
        ).peak  # fmt: skip
    assert own == peak(llama(), world_size=4, tensor_parallel_size=2, parallelize_fn=user_tp)
    assert not any(type(p).__name__ == "DTensor" for p in module.parameters())


class Shifty(__import__("lightning.pytorch", fromlist=["LightningModule"]).LightningModule):
    """A module whose configure_model shards one way where it is simulated (on the fake process group:
    FSDP2) and another in the run (tensor parallelism's placements): a plan would not be the run's."""

    def __init__(self) -> None:
        super().__init__()
        self.net = llama()
        self.batch_size = 2
        self.calls: list[str] = []  # a list: shared by the simulated copies and the module

    def configure_model(self) -> None:
        import torch.distributed as dist
        from torch.distributed.fsdp import fully_shard

        backend = dist.get_backend(self.device_mesh["data_parallel"].get_group())
        self.calls.append(backend)
        if backend != "fake":  # the run's own call
            user_tp(self.net, self.device_mesh)
            return
        for layer in self.net.lm.model.layers:
            fully_shard(layer, mesh=self.device_mesh["data_parallel"])
        fully_shard(self.net.lm, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch, batch_idx):
        return self.net(batch[0])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters())

    def train_dataloader(self):
        ids = torch.randint(0, 131, (8, SEQ), generator=torch.Generator().manual_seed(0))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=self.batch_size)


@pytest.fixture
def one_rank_group():
    """A one-rank Trainer under ModelParallelStrategy initializes torch.distributed's default group and
    leaves it: destroyed after the test, so that no later test in this process finds one."""
    import torch.distributed as dist

    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.usefixtures("one_rank_group")
def test_a_run_that_shards_otherwise_than_planned_is_refused_before_its_first_step(tmp_path):
    """AutoFit under ModelParallelStrategy (one gloo rank) simulates the layout configure_model applies; a
    run whose configure_model then applies another is stopped at on_fit_start, naming both layouts."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lightning_memkit import AutoFit

    module = Shifty()
    strategy = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1)
    trainer = cpu_trainer(tmp_path, [AutoFit("1GB")], max_steps=1, logger=False, strategy=strategy)
    before = [p.detach().clone() for p in module.parameters()]
    with pytest.raises(
        RuntimeError, match=r"AutoFit planned each rank's step of 1 under FSDP2: .*S\(0\), S\(1\)"
    ):
        trainer.fit(module)
    assert module.calls == ["gloo"]  # the simulated calls (on "fake") left nothing behind: only the run's
    assert trainer.global_step == 0
    assert all(torch.equal(a, b.full_tensor()) for a, b in zip(before, module.parameters(), strict=True))


class Laid(Shifty):
    """Shifty's module with a configure_model that applies ``layout`` wherever it runs."""

    def __init__(self, layout) -> None:
        super().__init__()
        self.layout = layout

    def configure_model(self) -> None:
        self.layout(self)


def _one_rank_fit(tmp_path, module, callbacks) -> "pl.Trainer":  # noqa: F821
    from lightning.pytorch.strategies import ModelParallelStrategy

    strategy = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1)
    trainer = cpu_trainer(tmp_path, callbacks, max_steps=1, strategy=strategy)
    trainer.fit(module)
    return trainer


@pytest.mark.usefixtures("one_rank_group")
def test_a_configure_model_that_shards_nothing_is_planned_whole(tmp_path):
    """Under a plain ModelParallelStrategy a configure_model that shards nothing trains the module whole on
    each rank (Lightning accepts it): AutoFit plans that step, not one it sharded itself, and the run goes
    on."""
    from lightning_memkit import AutoFit

    autofit = AutoFit("1GB")
    trainer = _one_rank_fit(tmp_path, Laid(lambda module: None), [autofit])
    assert trainer.global_step == 1
    unsharded = estimate_memory(
        llama(), batch(), optimizer="adamw", loss_fn=lambda loss, _: loss, device="cpu"
    )
    assert autofit.plan.estimated_peak >= unsharded.parameters + unsharded.optimizer_state


@pytest.mark.slow
@pytest.mark.usefixtures("one_rank_group")
def test_the_monitors_advice_under_tensor_parallelism_lays_its_twin_out_again(tmp_path):
    """MemoryMonitor(advise=True) after a tensor-parallel configure_model: the advice simulates the module's
    unsharded twin laid out by configure_model again (distribute_module's mark left off the twin)."""
    from lightning_memkit import MemoryMonitor

    monitor = MemoryMonitor(plot=False, summary=False, advise=True)
    _one_rank_fit(tmp_path, Laid(lambda module: user_tp(module.net, module.device_mesh)), [monitor])
    assert monitor.advice is not None and monitor.advice.scope == "one rank of 1 under FSDP2"
