"""A checkpoint's plan is installed only in the run it was made for; otherwise AutoFit plans for the run
at hand, with the checkpoint's optimizer, or refuses with what to do (`_fitting.resume`).

One device, `models.MLPModule` made wide (its optimizer state, not its activations, sets the peak: AdamW's
1.70 MB, SGD with momentum's 1.23 MB at most), plans counted in FLOPs: each fit takes about a second. A
plan made for several ranks is a checkpoint's plan rewritten as those ranks would have saved it.
AutoFitStrategy's resumes, on gloo ranks, are in test_autofit_strategy.
"""

import copy
import os

import lightning as L
import pytest
import torch
from helpers import COLLECTIVE_TIMEOUT, cpu_trainer, needs_distributed, spawn_ranks
from lightning.pytorch.strategies import SingleDeviceStrategy
from models import BlockNet, MLPModule

from lightning_memkit import AutoFit

STEPS = 2  # a fit's optimizer steps; a resumed fit runs as many again


class _Seen(L.Callback):
    """The training batches' sizes, and the optimizer's state as the resumed fit starts training."""

    def __init__(self) -> None:
        self.sizes: list[int] = []
        self.state: dict | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        self.state = copy.deepcopy(trainer.optimizers[0].state_dict()["state"])

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.sizes.append(len(batch[0]))


class _LateRestore(SingleDeviceStrategy):
    """One device restoring the checkpoint after building the optimizers, as FSDP and DeepSpeed do."""

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True


def _fit(tmp_path, callback, *, ckpt_path=None, strategy="auto", save=None):
    seen = _Seen()
    trainer = cpu_trainer(
        tmp_path,
        [callback, seen],
        max_steps=2 * STEPS if ckpt_path else STEPS,
        strategy=strategy,
        logger=False,
    )
    trainer.fit(MLPModule(hidden=4096, batch_size=8), ckpt_path=ckpt_path)
    if save is not None:
        trainer.save_checkpoint(save)
    return trainer, seen


def _saved(tmp_path, optimizers=None, **plan):
    """A checkpoint of `STEPS` steps planned at 100 TB (with ``optimizers``), its plan's fields set to
    ``plan``."""
    path = tmp_path / "saved.ckpt"
    _fit(tmp_path, AutoFit("100TB", cost="flops", optimizers=optimizers), save=path)
    checkpoint = torch.load(path, weights_only=False)
    checkpoint["callbacks"]["AutoFit"]["plan"].update(plan)
    torch.save(checkpoint, path)
    return path, checkpoint


def test_a_plan_made_for_four_ranks_is_not_installed_on_one(tmp_path):
    """Saved by 4 FSDP ranks (micro-batch 4 x 2 each), resumed on one device: this run's own plan (the
    user's 8 x 1) trains, and a warning names the world size and the strategy, both values."""
    path, _ = _saved(tmp_path, world_size=4, strategy="fsdp", micro_batch_size=4, accumulate_grad_batches=2)
    callback = AutoFit("100TB", cost="flops")
    said = r"made for another run \(world size 4 -> 1; strategy fsdp -> one device\)"
    with pytest.warns(UserWarning, match=said):
        trainer, seen = _fit(tmp_path, callback, ckpt_path=path)
    assert callback.plan.world_size == 1 and "GPUs" not in callback.plan.summary()
    assert seen.sizes == [8] * STEPS and trainer.global_step == 2 * STEPS
    assert {float(s["step"]) for s in seen.state.values()} == {float(STEPS)}  # AdamW's state went on


def test_a_plan_made_for_this_run_is_installed(tmp_path):
    """The same world size, budget and precision: the checkpoint's plan (rewritten to 4 x 2) goes on."""
    path, _ = _saved(tmp_path, micro_batch_size=4, accumulate_grad_batches=2)
    callback = AutoFit("100TB", cost="flops")
    _, seen = _fit(tmp_path, callback, ckpt_path=path)
    assert (callback.plan.micro_batch_size, callback.plan.accumulate_grad_batches) == (4, 2)
    assert seen.sizes == [4] * 2 * STEPS


def test_a_new_budget_plans_again_with_the_checkpoints_optimizer(tmp_path):
    """Saved with SGD (momentum) at 100 TB, resumed at 50 TB, where AutoFit alone would choose the module's
    AdamW: planned for 50 TB with SGD, whose momentum buffers the checkpoint holds and the fit continues."""
    path, checkpoint = _saved(tmp_path, optimizers=["sgd_momentum"])
    callback = AutoFit("50TB", cost="flops")
    with pytest.warns(UserWarning, match=r"budget 90.95 TiB \(100TB\) -> 45.47 TiB \(50TB\).*planning again"):
        trainer, seen = _fit(tmp_path, callback, ckpt_path=path)
    assert callback.plan.budget.source == "50TB" and callback.plan.optimizer == "sgd_momentum"
    plan = callback.plan
    assert (plan.micro_batch_size, plan.accumulate_grad_batches) == (8, 1) and seen.sizes == [8] * STEPS
    assert type(trainer.optimizers[0]).__name__ == "SGD"
    saved = checkpoint["optimizer_states"][0]["state"]
    assert seen.state.keys() == saved.keys() and all(
        torch.equal(seen.state[k]["momentum_buffer"], saved[k]["momentum_buffer"]) for k in saved
    )


def test_a_budget_the_checkpoints_optimizer_cannot_meet_is_refused_with_the_fix(tmp_path):
    """Saved with AdamW (1.70 MB), resumed at 1.6 MB (a limit of 1.44 MB after the margin): no plan with
    AdamW fits, and a lighter optimizer would start from no state: refused, naming both ways on."""
    path, _ = _saved(tmp_path)
    with pytest.raises(RuntimeError) as refused:
        _fit(tmp_path, AutoFit("1.6MB", cost="flops", optimizers=["adamw", "sgd_momentum"]), ckpt_path=path)
    message = str(refused.value)
    assert "the checkpoint holds the state of adamw" in message
    assert "no plan with adamw fits here (No plan fits" in message
    assert "Resume where the checkpoint's plan fits (budget 90.95 TiB (100TB))" in message
    assert "MLPModule.load_from_checkpoint(path)" in message


def test_a_strategy_that_restores_after_setup_keeps_this_fits_plan_with_the_same_optimizer(tmp_path):
    """Restored after the optimizers are built (FSDP, DeepSpeed): a plan for another budget with the same
    optimizer (AdamW) goes on as this fit planned it, its state loaded; another optimizer is refused, with
    the ``optimizers=`` that plans with the checkpoint's."""
    path, _ = _saved(tmp_path)
    callback = AutoFit("50TB", cost="flops")
    with pytest.warns(UserWarning, match="this fit's plan, made for this run, goes on with adamw"):
        trainer, seen = _fit(tmp_path, callback, ckpt_path=path, strategy=_LateRestore("cpu"))
    assert callback.plan.budget.source == "50TB" and trainer.global_step == 2 * STEPS
    assert {float(s["step"]) for s in seen.state.values()} == {float(STEPS)}

    path, _ = _saved(tmp_path / "sgd", optimizers=["sgd_momentum"])
    with pytest.raises(RuntimeError, match=r"Give AutoFit\(\.\.\., optimizers=\['sgd_momentum'\]\)"):
        _fit(tmp_path, AutoFit("50TB", cost="flops"), ckpt_path=path, strategy=_LateRestore("cpu"))


def test_a_plan_saved_before_its_run_was_recorded_still_resumes(tmp_path):
    """A checkpoint whose plan predates the fields that say what it was made for (world size, strategy,
    device, step lever, modes, FSDP2's options): read with their defaults, so the CPU run differs from the
    CUDA device assumed, plans again, says so, and its AdamW state goes on."""
    path, checkpoint = _saved(tmp_path)
    plan = checkpoint["callbacks"]["AutoFit"]["plan"]
    for key in ("world_size", "strategy", "device", "lever", "modes", "mp_policy", "cpu_offload"):
        del plan[key]
    torch.save(checkpoint, path)
    callback = AutoFit("100TB", cost="flops")
    with pytest.warns(UserWarning, match=r"made for another run \(device cuda -> cpu; "):
        trainer, seen = _fit(tmp_path, callback, ckpt_path=path)
    assert callback.plan.device == "cpu" and trainer.global_step == 2 * STEPS
    assert {float(s["step"]) for s in seen.state.values()} == {float(STEPS)}


class _Compiled(BlockNet):
    """Repeated blocks compiled in ``configure_model``, as Lightning documents compiling: the eager plan's
    checkpointing modes are the blocks', the compiled plan's torch.compile's activation budget."""

    def configure_model(self) -> None:
        for block in self.blocks:
            block.compile()


@pytest.mark.slow  # torch.compile on the CPU
def test_a_model_compiled_in_configure_model_resumes_with_its_compiled_plan(tmp_path):
    """setup plans the eager step, and the checkpoint's plan is the compiled step's (made at on_fit_start):
    the same run resumed installs it (the compiled step is what on_fit_start would plan), rather than
    keeping the eager plan setup made, which the resume would then train the compiled model with."""
    path, plans = tmp_path / "compiled.ckpt", []
    for ckpt_path in (None, path):
        callback = AutoFit("100TB", cost="flops")
        trainer = cpu_trainer(tmp_path, [callback], max_steps=2 * STEPS if ckpt_path else STEPS, logger=False)
        trainer.fit(_Compiled(batch_size=16), ckpt_path=ckpt_path)
        trainer.save_checkpoint(path)
        plans.append(callback.plan)
    assert "compile budget" in plans[0].modes and plans[1] == plans[0]
    assert trainer.global_step == 2 * STEPS


def _ddp_rank(rank: int, out) -> None:
    """One of 2 DDP ranks on gloo: `STEPS` steps planned at 100 TB (AdamW), saved by rank 0."""
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")  # Lightning then launches no processes itself
    torch.set_num_threads(1)
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{out / 'store'}", rank=rank, world_size=2, timeout=COLLECTIVE_TIMEOUT
    )  # fmt: skip
    trainer = cpu_trainer(
        out, [AutoFit("100TB", cost="flops")], max_steps=STEPS, devices=2, strategy="ddp", logger=False
    )
    trainer.fit(MLPModule(hidden=4096, batch_size=8))
    trainer.save_checkpoint(out / "ddp.ckpt")
    torch.distributed.destroy_process_group()


@needs_distributed
@pytest.mark.slow  # two processes
def test_a_plan_saved_by_two_ddp_ranks_is_not_installed_on_one_device(tmp_path):
    """Saved by 2 DDP ranks, resumed on one device: the plan is made for one device, a warning names the
    world size and the strategy, and the checkpoint's AdamW state goes on."""
    spawn_ranks(_ddp_rank, (tmp_path,), 2, "DDP")
    saved = torch.load(tmp_path / "ddp.ckpt", weights_only=False)["callbacks"]["AutoFit"]["plan"]
    assert (saved["world_size"], saved["strategy"]) == (2, "ddp")
    callback = AutoFit("100TB", cost="flops")
    said = r"made for another run \(world size 2 -> 1; strategy ddp -> one device\)"
    with pytest.warns(UserWarning, match=said):
        trainer, seen = _fit(tmp_path, callback, ckpt_path=tmp_path / "ddp.ckpt")
    assert callback.plan.world_size == 1 and trainer.global_step == 2 * STEPS
    assert {float(s["step"]) for s in seen.state.values()} == {float(STEPS)}


class _Tokens(L.LightningModule):
    """Embedding, MLP and head over token batches: activations set its peak, so the micro-batch moves it."""

    def __init__(self, batch_size=8):
        super().__init__()
        self.batch_size = batch_size
        self.net = torch.nn.Sequential(
            torch.nn.Embedding(64, 64), torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64),
            torch.nn.Linear(64, 64),
        )  # fmt: skip

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x).flatten(0, 1), y.flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def train_dataloader(self):
        x = torch.randint(0, 64, (64, 16), generator=torch.Generator().manual_seed(0))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x), batch_size=self.batch_size)


def test_a_resumed_plan_made_again_is_the_plan_a_fresh_fit_makes(tmp_path):
    """A hostile pass: resumed at a tight budget, the plan made again simulated the step through setup's
    plan still on the module (its StepGuard cut the simulated batch), so 8 x 1 read 613 KiB where the step
    peaks at 659 KiB, over the budget. Now setup's plan is set aside first: the plan a fresh fit makes."""

    def fit(budget, optimizers=("sgd_momentum",), **kwargs):
        callback = AutoFit(budget, cost="flops", optimizers=list(optimizers))
        trainer = L.Trainer(
            default_root_dir=tmp_path, accelerator="cpu", devices=1, callbacks=[callback], logger=False,
            enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, **kwargs,
        )  # fmt: skip
        return callback, trainer

    saved = tmp_path / "sgd.ckpt"
    _callback, trainer = fit("64MB", max_steps=2)
    trainer.fit(_Tokens())
    trainer.save_checkpoint(saved)
    fresh, trainer = fit("700KB", max_steps=2)
    trainer.fit(_Tokens())
    resumed, trainer = fit("700KB", ("sgd", "sgd_momentum"), max_steps=4)  # setup plans plain SGD
    with pytest.warns(UserWarning, match="planning again"):
        trainer.fit(_Tokens(), ckpt_path=saved)
    assert fresh.plan.accumulate_grad_batches > 1  # the budget splits the batch: the guard is at work
    mine = (resumed.plan.micro_batch_size, resumed.plan.accumulate_grad_batches, resumed.plan.estimated_peak)
    assert mine == (
        fresh.plan.micro_batch_size,
        fresh.plan.accumulate_grad_batches,
        fresh.plan.estimated_peak,
    )


def test_the_optimizers_asked_for_are_said_to_be_set_aside_when_the_saved_plan_is_installed(tmp_path):
    """A hostile pass: an AdamW checkpoint resumed with AutoFit(optimizers=["sgd"]) at its own budget trained
    AdamW on, with only an info line."""
    path, _ = _saved(tmp_path)
    callback = AutoFit("100TB", cost="flops", optimizers=["sgd"])
    with pytest.warns(UserWarning, match=r"AutoFit\(optimizers=\['sgd'\]\) set aside: .* trains with adamw"):
        _fit(tmp_path, callback, ckpt_path=path)
    assert callback.plan.optimizer == "adamw"
