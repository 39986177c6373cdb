"""AutoFit, plan_fit and estimate_memory at their edges: planning leaves no trace, the batch size comes back
after the fit, budgets and manual optimization are refused in AutoFit's terms, LBFGS and empty batches."""

import math

import lightning as L
import pytest
import torch
import torch.nn.functional as F
import torchmetrics
from helpers import cpu_trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_memkit import StepCost, parse_budget, plan_fit
from lightning_memkit._estimating.simulate import estimate_memory
from lightning_memkit._fitting.search import grid
from lightning_memkit.callbacks.auto_fit import AutoFit
from lightning_memkit.testing import cpu_profiler, profile_peak

COST = StepCost(fixed=0.01, per_sample=0.01)


class Net(L.LightningModule):
    """Conv + BatchNorm + Dropout: a step that moves buffers and draws from the RNG; the losses it saw."""

    def __init__(self, batch_size: int = 16, optimizer: str = "adamw", n: int = 64) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.batch_size = batch_size
        self.net = nn.Sequential(
            nn.Conv1d(2, 4, 3), nn.BatchNorm1d(4), nn.Dropout(0.5), nn.Flatten(), nn.Linear(8, 1)
        )
        self.losses: list[torch.Tensor] = []
        self.rows: list[int] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.losses.append(loss.detach().clone())
        self.rows.append(len(x))
        return loss

    def configure_optimizers(self):
        if self.hparams.optimizer == "lbfgs":
            return torch.optim.LBFGS(self.parameters(), lr=0.1, history_size=4, max_iter=3)
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        n = self.hparams.n
        data = TensorDataset(torch.randn(n, 2, 4, generator=g), torch.randn(n, 1, generator=g))
        return DataLoader(data, batch_size=self.batch_size, shuffle=True)  # the sampler draws from the RNG


def _fit(tmp_path, module, callbacks, **overrides):
    trainer = cpu_trainer(tmp_path, callbacks, **{"max_steps": 2, "logger": False, **overrides})
    trainer.fit(module)
    return trainer


def _batch(rows: int):
    return torch.randn(rows, 2, 4), torch.randn(rows, 1)


# --- item 4: planning changes nothing ---------------------------------------------------------------


def test_a_plan_that_changes_nothing_leaves_the_run_bit_identical(tmp_path):
    """The default cost on the CPU times real steps (BatchNorm, dropout) and every candidate runs
    training_step on fake tensors; with a budget the run fits as it is, the run is the one without AutoFit."""
    runs = []
    for callbacks in ([], [AutoFit(budget="100TB")]):
        L.seed_everything(0, verbose=False)
        module = Net()
        _fit(tmp_path, module, callbacks)
        runs.append((module, torch.random.get_rng_state()))
    (plain, rng), (fitted, rng_fitted) = runs
    assert len(plain.losses) == len(fitted.losses) == 2
    assert all(torch.equal(a, b) for a, b in zip(plain.losses, fitted.losses, strict=True))
    for (name, a), (_, b) in zip(plain.state_dict().items(), fitted.state_dict().items(), strict=True):
        assert torch.equal(a, b), name  # parameters and BatchNorm's running stats and num_batches_tracked
    assert fitted.net[1].num_batches_tracked.item() == 2
    assert torch.equal(rng, rng_fitted)


def test_plan_fit_timing_real_steps_leaves_the_module_and_rng_as_they_were():
    """cost="measured" runs training_step and backward for real: 7 times, here."""
    torch.manual_seed(0)
    module, batch = Net(), _batch(16)
    state, rng = {k: v.clone() for k, v in module.state_dict().items()}, torch.random.get_rng_state()
    plan = plan_fit(module, batch, "100TB", device="cpu", cost="measured")
    assert plan.cost.source == "measured"
    assert all(torch.equal(v, module.state_dict()[k]) for k, v in state.items())
    assert module.losses == [] and all(p.grad is None for p in module.parameters())
    assert torch.equal(rng, torch.random.get_rng_state())


class Recording(L.LightningModule):
    """A training_step with the usual side effects: a list of outputs and a torchmetrics update."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)
        self.metric = torchmetrics.MeanMetric()
        self.outputs: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.layer(x), y)
        self.metric.update(loss.detach())
        self.outputs.append(loss.detach())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_estimate_memory_leaves_lists_and_metrics_as_they_were():
    module = Recording()
    batch = torch.randn(8, 4), torch.randn(8, 1)
    module.training_step(batch, 0)  # one real step: state to keep
    outputs, count, mean = list(module.outputs), module.metric._update_count, module.metric.compute()
    estimate_memory(module, batch, device="cpu")
    assert module.outputs == outputs and all(type(o) is torch.Tensor for o in module.outputs)
    assert module.metric._update_count == count == 1
    assert torch.equal(module.metric.compute(), mean)


# --- item 9: the batch size after the fit -------------------------------------------------------------


def test_the_batch_size_comes_back_and_a_second_fit_plans_the_global_batch(tmp_path):
    """A budget between the peaks at micro-batch 4 and 8: the plan is 4 x 4. During the fit the dataloader
    yields 4; after it the module, its hparams and the Trainer hold the user's 16 and 1 again, the checkpoint
    stores 16, and the same AutoFit plans 4 x 4 again on a second fit."""
    peaks = grid(Net(), _batch(16), optimizer="adamw", checkpointing=("none",), device="cpu")
    budget = (peaks[(4, "none")] + peaks[(8, "none")]) // 2
    callback = AutoFit(budget=budget, margin=0.0, cost="flops")
    for run in range(2):
        module = Net(batch_size=16)
        trainer = _fit(tmp_path / str(run), module, [callback], enable_checkpointing=True)
        plan = callback.plan
        assert (plan.micro_batch_size, plan.accumulate_grad_batches) == (4, 4)
        assert module.batch_size == module.hparams.batch_size == 16
        assert trainer.accumulate_grad_batches == 1
        assert set(module.rows) == {4} and trainer.global_step == 2
        (ckpt,) = (tmp_path / str(run)).rglob("*.ckpt")
        assert torch.load(ckpt, weights_only=False)["hyper_parameters"]["batch_size"] == 16


# --- item 15: budgets and manual optimization ---------------------------------------------------------


@pytest.mark.parametrize("budget", [1.5, math.nan, 0.0, -0.5])
def test_a_float_budget_outside_0_1_is_refused_at_once(budget):
    """Refused in __init__, not at setup with "reads the CUDA device, but the run is on cpu"."""
    size = "'1.5GB'" if budget == 1.5 else "'24GB'"
    message = rf"A float budget is a fraction of the current CUDA device, in \(0, 1\]; got .*{size}"
    with pytest.raises(ValueError, match=message):
        AutoFit(budget=budget)


def test_numpy_integer_budgets_are_bytes():
    """A size computed with NumPy (``np.int64``) is bytes, as an int is: every ``budget=`` reads it with
    `parse_budget` (it raised TypeError)."""
    numpy = pytest.importorskip("numpy")
    assert parse_budget(numpy.int64(24_000_000)) == parse_budget(24_000_000)


def test_manual_optimization_is_refused_in_autofits_terms(tmp_path):
    module = Net()
    module.automatic_optimization = False
    with pytest.raises(NotImplementedError, match="AutoFit plans Lightning's automatic optimization") as info:
        _fit(tmp_path, module, [AutoFit(budget="100TB", cost="flops")])
    assert "optimizer=" not in str(info.value)  # estimate_memory's keyword, not AutoFit's
    with pytest.raises(NotImplementedError, match=r"underlying nn.Module .*loss_fn= \(and optimizers="):
        plan_fit(module, _batch(4), "100TB", device="cpu", cost=COST)


# --- item 12: LBFGS ---------------------------------------------------------------------------------


def test_estimate_memory_steps_lbfgs_with_a_closure_and_counts_its_history():
    """A plain module: the steady-state step (history full) against the allocator over the whole run."""

    def make():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 1))
        return model, torch.optim.LBFGS(model.parameters(), lr=0.5, history_size=4, max_iter=5)

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 64, generator=g), torch.randn(32, 1, generator=g)
    with cpu_profiler() as prof:  # from the model's birth: every free of the history is seen
        model, optimizer = make()

        def closure():
            optimizer.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            return loss

        for _ in range(4):
            optimizer.step(closure)
    assert len(optimizer.state[optimizer._params[0]]["old_dirs"]) == 4  # full
    truth = profile_peak(prof)
    model, optimizer = make()
    estimate = estimate_memory(model, (x, y), optimizer=optimizer, loss_fn=F.mse_loss, device="cpu")
    assert abs(estimate.peak - truth) <= 0.03 * truth, (estimate.peak, truth)
    n_params = sum(p.numel() for p in model.parameters())
    assert estimate.optimizer_state >= (2 * 3 + 2) * 4 * n_params  # 3 stored pairs, direction, last gradient


def test_lbfgs_in_a_lightning_module_estimate_and_autofit(tmp_path):
    """The closure runs Lightning's training_step twice in the simulated step (LBFGS's first evaluation,
    and one after its first update); AutoFit plans and trains with it."""
    module = Net(optimizer="lbfgs")
    estimate_memory(module, _batch(16), device="cpu")
    assert len(module.losses) == 0  # fake losses are not left in the list
    calls = []
    module.__dict__["training_step"] = lambda batch, i: calls.append(1) or Net.training_step(module, batch, i)
    estimate_memory(module, _batch(16), device="cpu")
    assert len(calls) == 2
    del module.__dict__["training_step"]

    callback = AutoFit(budget="100TB", cost="flops")
    trainer = _fit(tmp_path, module, [callback])
    assert trainer.global_step == 2 and callback.plan.optimizer is None  # as configured
    assert len(module.losses) >= 2  # LBFGS evaluated the real closure


# --- item 13: empty batches ---------------------------------------------------------------------------


def test_an_empty_batch_is_refused_and_a_batch_of_one_is_planned(tmp_path):
    with pytest.raises(ValueError, match="The example batch is empty: its tensors have 0 samples"):
        plan_fit(Net(), _batch(0), "100TB", device="cpu", cost=COST)
    plan = plan_fit(Net(), _batch(1), "100TB", device="cpu", cost="measured")  # was a ZeroDivisionError
    assert plan.micro_batch_size == 1 and plan.cost.per_sample > 0

    class Empty(Net):
        def train_dataloader(self):
            return DataLoader(TensorDataset(*_batch(8)), batch_size=4, collate_fn=lambda rows: _batch(0))

    with pytest.raises(ValueError, match="first batch of 0 samples"):
        _fit(tmp_path, Empty(), [AutoFit(budget="100TB", cost="flops")])
