"""`rebind_scheduler` keeps every torch LR scheduler's shape across an optimizer swap: each later ``lr`` is
the unswapped schedule's times the swap's ``lr_factor``, for recursive (chainable) schedules too, whose
absolute quantities (``eta_min``, ``min_lrs``, ``eps``, CyclicLR's bounds, OneCycleLR's group keys) must be
scaled with the learning rates."""

from __future__ import annotations

import itertools
import math
import warnings
from collections.abc import Callable

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim import lr_scheduler as S
from torch.optim.swa_utils import SWALR

from lightning_memkit import OptimizerSwap, estimate_memory, fit_optimizer, swap_optimizer
from lightning_memkit._optimizers.schedulers import rebind_scheduler
from lightning_memkit._optimizers.swap import lr_factor

LR = 3e-3
STEPS = 16
#: Per-step metrics for ReduceLROnPlateau: a plateau, an improvement, then a long plateau.
METRICS = [1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.5] + [0.5] * STEPS

Factory = Callable[[torch.optim.Optimizer], object]


def _optimizer() -> torch.optim.AdamW:
    """AdamW with two param groups of different learning rates (the second has no decay)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    return torch.optim.AdamW(
        [{"params": [model.weight], "weight_decay": 0.1}, {"params": [model.bias], "lr": LR / 3}],
        lr=LR,
        weight_decay=0.0,
    )


def _sequential_cosine(o):
    warmup = S.LinearLR(o, start_factor=0.1, total_iters=3)
    return S.SequentialLR(o, [warmup, S.CosineAnnealingLR(o, T_max=10, eta_min=1e-3)], milestones=[3])


def _chained(o):
    return S.ChainedScheduler([S.ConstantLR(o, factor=0.5, total_iters=3), S.CosineAnnealingLR(o, 8, 1e-3)])


#: One schedule per scheduler torch ships (several for those with absolute quantities), by name.
SCHEDULES: dict[str, Factory] = {
    "LambdaLR": lambda o: S.LambdaLR(o, lambda e: 0.9**e),
    "MultiplicativeLR": lambda o: S.MultiplicativeLR(o, lambda e: 0.95),
    "StepLR": lambda o: S.StepLR(o, step_size=3, gamma=0.5),
    "MultiStepLR": lambda o: S.MultiStepLR(o, milestones=[2, 5, 9], gamma=0.3),
    "ConstantLR": lambda o: S.ConstantLR(o, factor=0.5, total_iters=4),
    "LinearLR": lambda o: S.LinearLR(o, start_factor=0.2, end_factor=1.0, total_iters=6),
    "ExponentialLR": lambda o: S.ExponentialLR(o, gamma=0.9),
    "PolynomialLR": lambda o: S.PolynomialLR(o, total_iters=10, power=2.0),
    # past T_max too: the recursive form's rising branch
    "CosineAnnealingLR": lambda o: S.CosineAnnealingLR(o, T_max=8, eta_min=1e-3),
    "CosineAnnealingWarmRestarts": lambda o: S.CosineAnnealingWarmRestarts(o, T_0=4, T_mult=2, eta_min=5e-4),
    "SequentialLR": _sequential_cosine,
    "ChainedScheduler": _chained,
    "ReduceLROnPlateau": lambda o: S.ReduceLROnPlateau(o, factor=0.5, patience=1, min_lr=[1e-3, 2e-4]),
    # eps=3e-4 stops the reductions once they are smaller than that: an absolute lr difference
    "ReduceLROnPlateau-eps": lambda o: S.ReduceLROnPlateau(o, factor=0.5, patience=0, eps=3e-4),
    "CyclicLR": lambda o: S.CyclicLR(o, base_lr=[1e-4, 5e-5], max_lr=[3e-3, 1e-3], step_size_up=3),
    "CyclicLR-exp_range": lambda o: S.CyclicLR(
        o, base_lr=1e-4, max_lr=3e-3, step_size_up=2, step_size_down=3, mode="exp_range", gamma=0.9
    ),
    "OneCycleLR": lambda o: S.OneCycleLR(o, max_lr=[3e-3, 1e-3], total_steps=STEPS + 1),
    "OneCycleLR-three_phase": lambda o: S.OneCycleLR(
        o, max_lr=3e-3, total_steps=STEPS + 1, three_phase=True, anneal_strategy="linear"
    ),
    "SWALR": lambda o: SWALR(o, swa_lr=5e-4, anneal_epochs=5),
}


def _trajectory(schedule: Factory, swap_at: int | None, target: str = "sgd_momentum") -> list[list[float]]:
    """Each group's lr before each of `STEPS` steps (and after the last); swapped to ``target`` before
    step ``swap_at`` (``None``: never)."""
    optimizer = _optimizer()
    scheduler = schedule(optimizer)
    lrs = []
    for step in range(STEPS):
        if step == swap_at:
            new = swap_optimizer(optimizer, target)
            rebind_scheduler(scheduler, new, lr_factor("adamw", target))
            optimizer = new
        lrs.append([g["lr"] for g in optimizer.param_groups])
        optimizer.step()  # no gradients: nothing moves, but the scheduler sees a step
        if isinstance(scheduler, S.ReduceLROnPlateau):
            scheduler.step(METRICS[step])
        else:
            scheduler.step()
    lrs.append([g["lr"] for g in optimizer.param_groups])
    return lrs


def _scaled(lrs: list[list[float]], factor: float) -> list[list[float]]:
    return [[lr * factor for lr in step] for step in lrs]


def _torch_schedulers() -> set[type]:
    shipped = {
        cls
        for cls in vars(S).values()
        if isinstance(cls, type)
        and issubclass(cls, S.LRScheduler)
        and cls not in (S.LRScheduler, S._LRScheduler)
    }
    return shipped | {SWALR}


def test_the_cases_cover_every_scheduler_torch_ships():
    covered = {type(SCHEDULES[name](_optimizer())) for name in SCHEDULES}
    assert _torch_schedulers() - covered == set()


@pytest.mark.parametrize("swap_at", [0, 2, 5])
@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_every_later_lr_is_the_unswapped_one_times_the_factor(name, swap_at):
    schedule = SCHEDULES[name]
    factor = lr_factor("adamw", "sgd_momentum")  # 30: a factor far from 1, so an unscaled floor shows
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning either: these are translated exactly
        reference, swapped = _trajectory(schedule, None), _trajectory(schedule, swap_at)
    assert len({tuple(step) for step in reference}) > 1, "the schedule must move"
    assert swapped[:swap_at] == reference[:swap_at]
    expected = _scaled(reference[swap_at:], factor)
    for step, (got, want) in enumerate(zip(swapped[swap_at:], expected, strict=True), start=swap_at):
        assert got == pytest.approx(want, rel=1e-6, abs=0), f"{name}, step {step}"


@pytest.mark.parametrize("name", ["CosineAnnealingLR", "CosineAnnealingWarmRestarts", "SequentialLR"])
def test_a_factor_below_one_decays_to_the_scaled_floor(name):
    """AdamW -> Lion (lr / 10) as the issue reported it: the cosine climbed towards the unscaled eta_min."""
    pytest.importorskip("bitsandbytes")
    factor = lr_factor("adamw", "lion")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # bitsandbytes' import noise
        reference, swapped = _trajectory(SCHEDULES[name], None), _trajectory(SCHEDULES[name], 0, "lion")
    assert swapped == [pytest.approx(step, rel=1e-6, abs=0) for step in _scaled(reference, factor)]


def test_the_choice_rebinds_with_its_factor():
    """`OptimizerChoice.rebind` (fit_optimizer's path) scales the cosine's floor as well."""
    optimizer = _optimizer()
    scheduler = S.CosineAnnealingLR(optimizer, T_max=8, eta_min=1e-3)
    only_sgd_fits = lambda opts: 2 if opts[0] is optimizer else 0  # noqa: E731
    choice = fit_optimizer(nn.Module(), optimizer, 1, step_peak=only_sgd_fits, optimizers=("sgd_momentum",))
    assert choice.changed and choice.lr_factors == (pytest.approx(30.0),)
    choice.rebind(scheduler)
    assert scheduler.optimizer is choice.optimizer
    assert scheduler.eta_min == pytest.approx(30 * 1e-3)
    for _ in range(8):
        choice.optimizer.step()
        scheduler.step()
    assert [g["lr"] for g in choice.optimizer.param_groups] == pytest.approx([30 * 1e-3] * 2)


def test_an_optimizer_whose_lrs_are_not_the_factor_times_the_old_ones_is_refused():
    optimizer = _optimizer()
    scheduler = S.CosineAnnealingLR(optimizer, T_max=8, eta_min=1e-3)
    other = torch.optim.SGD([g["params"][0] for g in optimizer.param_groups], lr=0.1)  # one group
    with pytest.raises(ValueError, match="param groups"):
        rebind_scheduler(scheduler, other, 30.0)
    new = swap_optimizer(optimizer, "sgd_momentum")
    new.param_groups[1]["lr"] *= 2  # the groups no longer share one factor: eta_min (one float) cannot
    with pytest.raises(ValueError, match="not the old lr times lr_factor"):
        rebind_scheduler(scheduler, new, 30.0)
    assert scheduler.optimizer is optimizer and scheduler.eta_min == 1e-3  # refused: nothing changed


def test_a_scheduler_torch_does_not_ship_is_rebound_with_a_warning():
    class Floor(S.LRScheduler):
        def __init__(self, optimizer, floor):
            self.floor = floor
            super().__init__(optimizer)

        def get_lr(self):
            return [max(self.floor, g["lr"] * 0.5) for g in self.optimizer.param_groups]

    optimizer = _optimizer()
    scheduler = Floor(optimizer, 1e-4)
    new = swap_optimizer(optimizer, "sgd_momentum")
    with pytest.warns(UserWarning, match="Floor is not one of torch's schedulers"):
        rebind_scheduler(scheduler, new, 30.0)
    assert scheduler.optimizer is new and scheduler.base_lrs == pytest.approx([30 * LR, 30 * LR / 3])
    # a LambdaLR subclass that only adds a method computes as LambdaLR does: no warning
    optimizer = _optimizer()
    plain = type("Plain", (S.LambdaLR,), {"describe": lambda self: "plain"})(optimizer, lambda e: 1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rebind_scheduler(plain, swap_optimizer(optimizer, "sgd_momentum"), 30.0)
    assert math.isclose(plain.base_lrs[0], 30 * LR)


@pytest.mark.parametrize("name", ["CyclicLR", "OneCycleLR"])
def test_the_momentum_cycle_moves_to_the_new_momentum(name):
    """AdamW's beta1 cycle becomes SGD's momentum cycle; an optimizer without momentum drops it (warned),
    its hyperparameters untouched, instead of failing at the next step on a missing ``betas``."""
    optimizer = _optimizer()
    scheduler = SCHEDULES[name](optimizer)
    reference = []
    for _ in range(6):
        optimizer.step()
        scheduler.step()
        reference.append(optimizer.param_groups[0]["betas"][0])

    optimizer = _optimizer()
    scheduler = SCHEDULES[name](optimizer)
    new = swap_optimizer(optimizer, "sgd_momentum")
    rebind_scheduler(scheduler, new, lr_factor("adamw", "sgd_momentum"))
    momenta = []
    for _ in range(6):
        new.step()
        scheduler.step()
        momenta.append(new.param_groups[0]["momentum"])
    assert momenta == pytest.approx(reference) and len(set(momenta)) > 2

    for target in ("sgd", "adafactor", "adamw_kahan"):  # no momentum, none at all, optimi's beta1
        optimizer = _optimizer()
        scheduler = SCHEDULES[name](optimizer)
        new = swap_optimizer(optimizer, target)
        with pytest.warns(UserWarning, match="momentum cycle is dropped"):
            rebind_scheduler(scheduler, new, lr_factor("adamw", target))
        momenta = ("betas", "beta1", "momentum")
        before = [{k: g[k] for k in momenta if k in g} for g in new.param_groups]
        for _ in range(3):
            new.step()
            scheduler.step()
        assert [{k: g[k] for k in momenta if k in g} for g in new.param_groups] == before, target


# --------------------------------------------------------------------------------------------------
# OptimizerSwap in a Trainer
# --------------------------------------------------------------------------------------------------

VOCAB, BATCH, N_BATCHES, ETA_MIN = 32, 4, 8, 1e-3


class CosineLM(pl.LightningModule):
    """AdamW (lr 3e-3, two groups) with a CosineAnnealingLR to eta_min=1e-3 over the 8 steps, per step."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(VOCAB, 64, bias=False)
        self.head = nn.Linear(64, VOCAB)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.head(F.gelu(self.embed(F.one_hot(x, VOCAB).float()))), y)

    def configure_optimizers(self):
        decay = [p for p in self.parameters() if p.dim() >= 2]
        rest = [p for p in self.parameters() if p.dim() < 2]
        optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest}], lr=LR)
        scheduler = S.CosineAnnealingLR(optimizer, T_max=N_BATCHES, eta_min=ETA_MIN)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self):
        x = torch.randint(0, VOCAB, (N_BATCHES * BATCH,), generator=torch.Generator().manual_seed(0))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.flip(0)), batch_size=BATCH)


class _Lrs(pl.Callback):
    def __init__(self) -> None:
        self.types, self.lrs = [], []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.types.append(type(optimizer).__name__)
        self.lrs.append([g["lr"] for g in optimizer.param_groups])


def test_optimizer_swap_keeps_a_cosine_decaying_to_the_scaled_eta_min(trainer_kwargs):
    """The issue's case: AdamW -> Lion (lr / 10) under CosineAnnealingLR(eta_min > 0). The lr used to climb
    from 3.0e-4 towards the unscaled eta_min (1e-3); now it decays to eta_min / 10, the AdamW curve / 10."""
    pytest.importorskip("bitsandbytes")
    batch = (torch.zeros(BATCH, dtype=torch.long),) * 2
    lion, adamw = (
        estimate_memory(CosineLM(), batch, optimizer=o, device="cpu").peak for o in ("lion", "adamw")
    )
    assert lion < adamw

    def run(callbacks):
        record = _Lrs()
        kwargs = {**trainer_kwargs, "max_steps": N_BATCHES, "max_epochs": 1, "logger": False}
        pl.Trainer(callbacks=[*callbacks, record], **kwargs).fit(CosineLM())
        return record

    reference = run([])
    swapped = run([OptimizerSwap(budget=(lion + adamw) // 2, optimizers=("lion",))])
    assert swapped.types == ["Lion"] * N_BATCHES and reference.types == ["AdamW"] * N_BATCHES
    factor = lr_factor("adamw", "lion")
    assert swapped.lrs == [
        pytest.approx([lr * factor for lr in step], rel=1e-6, abs=0) for step in reference.lrs
    ]
    first = [step[0] for step in swapped.lrs]
    assert first[0] == pytest.approx(LR * factor)
    assert all(b < a for a, b in itertools.pairwise(first)), first  # decays, never climbs
    last = ETA_MIN + (LR - ETA_MIN) * (1 + math.cos(math.pi * (N_BATCHES - 1) / N_BATCHES)) / 2
    assert first[-1] == pytest.approx(last * factor)  # 1.08e-4 (unscaled eta_min: 9.7e-4)
