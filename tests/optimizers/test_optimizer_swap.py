"""OptimizerSwap and the optimizer catalogue: state bytes, translation rules, the decision, the callback."""

from __future__ import annotations

import copy
import csv
import functools
import logging
import sys
import warnings
from types import SimpleNamespace

import lightning.pytorch as pl
import optimi
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import DataLoader, TensorDataset

from lightning_memkit import (
    CATALOGUE,
    OptimizerSwap,
    Sharding,
    Step,
    estimate_memory,
    fit_optimizer,
    format_bytes,
    storage_bytes,
    swap_optimizer,
)
from lightning_memkit._estimating.optimizer_state import (
    OPTIMIZERS,  # the formulas the simulated bytes must equal
)
from lightning_memkit.demos.gpt import WarmupCosine

bnb = pytest.importorskip("bitsandbytes")

VOCAB, D, SEQ, BATCH, N_BATCHES = 64, 64, 16, 8, 4


def _groups(model: nn.Module, weight_decay: float = 0.1) -> list[dict]:
    params = list(model.parameters())
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay, "name": "decay"},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0, "name": "no_decay"},
    ]


class TinyLM(pl.LightningModule):
    """Deterministic on CPU: no dropout, unshuffled data. Three 4096-element matrices (8-bit state) and
    small vectors (fp32 state in bitsandbytes), AdamW with decay / no-decay groups. The tokens are
    embedded by a matmul of their one-hot vectors: ``nn.Embedding``'s backward would start the helper
    process that measures opaque CPU kernels (seconds per test process; the GPT test covers it)."""

    def __init__(self, optimizer: str = "adamw", scheduler: bool = False, lr: float = 1e-2) -> None:
        super().__init__()
        self.embed = nn.Linear(VOCAB, D, bias=False)  # (D, VOCAB): a 4096-element matrix
        self.fc = nn.Linear(D, D)
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB)
        self.optimizer, self.scheduler, self.lr = optimizer, scheduler, lr
        self.losses: list[float] = []

    def forward(self, x):
        tokens = F.one_hot(x, VOCAB).float()  # (B, T, VOCAB)
        return self.head(self.norm(F.gelu(self.fc(self.embed(tokens)))))  # (B, T, VOCAB)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x).flatten(0, 1), y.flatten())

    def on_train_batch_end(self, outputs, batch, batch_idx):
        # Not in training_step: OptimizerSwap's estimate runs training_step once on fake tensors.
        self.losses.append(outputs["loss"].item())

    def configure_optimizers(self):
        if self.optimizer == "rmsprop":
            optimizer = torch.optim.RMSprop(_groups(self), lr=self.lr)
        else:
            optimizer = torch.optim.AdamW(_groups(self), lr=self.lr, betas=(0.9, 0.95))
        if not self.scheduler:
            return optimizer
        scheduler = LambdaLR(optimizer, WarmupCosine(warmup_steps=2, max_steps=8))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randint(0, VOCAB, (N_BATCHES * BATCH, SEQ + 1), generator=g)
        return DataLoader(TensorDataset(x[:, :-1], x[:, 1:]), batch_size=BATCH)


def _batch():
    x = torch.randint(0, VOCAB, (BATCH, SEQ))
    return x, x


@functools.cache
def _peak(optimizer: str) -> int:
    """TinyLM's estimated step peak with ``optimizer`` (shapes only: one estimate per test process)."""
    return estimate_memory(TinyLM(), _batch(), optimizer=optimizer, device="cpu").peak


def _between(fits: str, over: str) -> int:
    """A budget for TinyLM that ``fits`` fits and ``over`` does not."""
    low, high = _peak(fits), _peak(over)
    assert low < high
    return (low + high) // 2


def _state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [t for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t)]


def _catalogue_name(optimizer: torch.optim.Optimizer) -> str | None:
    """The catalogue's name for ``optimizer``'s kind as `fit_optimizer` reports it (``None``: unknown)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "... is not in the optimizer catalogue"
        return fit_optimizer(nn.Module(), optimizer, "1GiB", step_peak=lambda _: 0).originals[0]


def _decided(optimizer: torch.optim.Optimizer, name: str):
    """`fit_optimizer`'s choice for ``optimizer`` when only ``name`` fits (a given step peak)."""
    return fit_optimizer(
        nn.Module(), optimizer, 1, step_peak=lambda opts: 2 if opts[0] is optimizer else 0, optimizers=(name,)
    )


@pytest.fixture
def trainer_kwargs(trainer_kwargs):
    """conftest's Trainer settings, for one epoch and without a logger."""
    kwargs = {**trainer_kwargs, "max_epochs": 1, "logger": False}
    del kwargs["max_steps"]  # the tests set their own
    return kwargs


# --------------------------------------------------------------------------------------------------
# The catalogue
# --------------------------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:Paged optimizers are not supported on CPU")
@pytest.mark.parametrize("name", list(CATALOGUE))
def test_state_bytes_match_a_real_step(name):
    """Simulated state bytes = the formulas = real optimizer.state after one step, for every entry."""
    torch.manual_seed(0)
    model = TinyLM()
    optimizer = swap_optimizer(torch.optim.AdamW(_groups(model), lr=1e-3), name)
    simulated = fit_optimizer(model, optimizer, "1GiB", device="cpu").state_bytes  # static: no batch
    x, y = _batch()
    F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    optimizer.step()
    real = storage_bytes(_state_tensors(optimizer))
    shapes = [tuple(p.shape) for p in model.parameters()]
    assert simulated == real == OPTIMIZERS[name](shapes, 4)
    if name in ("adamw8bit", "lion8bit"):  # 8-bit state for the matrices, fp32 for the vectors
        dtypes = {tuple(p.shape): optimizer.state[p]["state1"].dtype for p in model.parameters()}
        assert dtypes[(D, D)] == torch.uint8 and dtypes[(D,)] == torch.float32


def test_catalogue_names_of_optimizers():
    p = [nn.Parameter(torch.zeros(4))]
    name = _catalogue_name
    assert name(torch.optim.AdamW(p)) == name(torch.optim.Adam(p)) == "adamw"
    assert name(torch.optim.SGD(p, lr=0.1)) == "sgd"
    assert name(torch.optim.SGD(p, lr=0.1, momentum=0.9)) == "sgd_momentum"
    assert name(torch.optim.Adafactor(p)) == "adafactor"
    assert name(bnb.optim.AdamW8bit(p)) == "adamw8bit"
    assert name(bnb.optim.Lion8bit(p)) == "lion8bit"
    assert name(torch.optim.RMSprop(p)) is None
    assert name(torch.optim.AdamW(p, maximize=True)) is None
    assert name(optimi.AdamW(p, lr=0.1)) == "adamw_kahan" and name(optimi.SGD(p, lr=0.1)) == "sgd_kahan"
    assert name(optimi.AdamW(p, lr=0.1, kahan_sum=False)) is None
    assert name(optimi.SGD(p, lr=0.1, momentum=0.9)) is None


def test_translation_per_group():
    model = TinyLM()
    adamw = torch.optim.AdamW(_groups(model, weight_decay=0.1), lr=3e-3, betas=(0.9, 0.95))
    lion = swap_optimizer(adamw, "lion")
    decay, no_decay = lion.param_groups
    assert type(lion) is bnb.optim.Lion
    assert decay["lr"] == pytest.approx(3e-4) and decay["weight_decay"] == pytest.approx(1.0)
    assert no_decay["weight_decay"] == 0.0  # the no-decay group stays at zero
    assert decay["betas"] == (0.9, 0.99) and decay["name"] == "decay"  # group keys kept
    assert [g["params"] for g in lion.param_groups] == [g["params"] for g in adamw.param_groups]

    eight = swap_optimizer(adamw, "adamw8bit")  # same hyperparameters, betas and eps carried
    assert [(g["lr"], g["weight_decay"], g["betas"]) for g in eight.param_groups] == [
        (3e-3, 0.1, (0.9, 0.95)),
        (3e-3, 0.0, (0.9, 0.95)),
    ]
    sgd = swap_optimizer(adamw, "sgd_momentum")
    assert sgd.param_groups[0]["momentum"] == 0.9
    # decay per step kept: lr * wd / (1 - momentum) equals AdamW's lr * wd
    g = sgd.param_groups[0]
    assert g["lr"] * g["weight_decay"] / (1 - 0.9) == pytest.approx(3e-3 * 0.1)

    back = swap_optimizer(lion, "adamw8bit")  # from Lion, through AdamW's terms
    assert back.param_groups[0]["lr"] == pytest.approx(3e-3)
    assert back.param_groups[0]["weight_decay"] == pytest.approx(0.1)
    assert _decided(lion, "adamw8bit").lr_factors == (pytest.approx(10.0),)

    with pytest.raises(ValueError, match="RMSprop is not in the optimizer catalogue"):
        swap_optimizer(torch.optim.RMSprop(model.parameters()), "lion")
    with pytest.raises(ValueError, match="Did you mean 'lion'"):
        swap_optimizer(adamw, "loin")


def test_rebind_scheduler_keeps_the_schedule_shape():
    def lrs(swap_at: int | None) -> list[float]:
        model = TinyLM()
        optimizer = torch.optim.AdamW(_groups(model), lr=3e-3)
        scheduler = LambdaLR(optimizer, WarmupCosine(warmup_steps=3, max_steps=10))
        out = []
        for step in range(10):
            if step == swap_at:
                choice = _decided(optimizer, "lion")
                choice.rebind(scheduler)
                optimizer = choice.optimizer
            out.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
        return out

    reference, swapped = lrs(None), lrs(0)
    assert swapped == pytest.approx([lr / 10 for lr in reference])
    midway = lrs(5)  # swapped in the middle of the schedule: the same curve, scaled from there on
    assert midway == pytest.approx(reference[:5] + [lr / 10 for lr in reference[5:]])


# --------------------------------------------------------------------------------------------------
# The decision, without a Trainer
# --------------------------------------------------------------------------------------------------


def test_fit_optimizer_keeps_what_fits_and_picks_the_first_that_does():
    model = TinyLM()
    optimizer = torch.optim.AdamW(_groups(model), lr=3e-3)
    kept = fit_optimizer(model, optimizer, "1GiB", batch=_batch(), device="cpu")
    assert not kept.changed and kept.optimizer is optimizer and kept.name == "adamw"

    scheduler = LambdaLR(optimizer, WarmupCosine(warmup_steps=2, max_steps=8))
    budget = _between("adamw8bit", "adamw")
    choice = fit_optimizer(model, optimizer, budget, batch=_batch(), device="cpu")
    assert choice.changed and choice.name == "adamw8bit" and type(choice.optimizer) is bnb.optim.AdamW8bit
    assert optimizer.param_groups[0]["params"][0] in choice.optimizer.param_groups[0]["params"]
    choice.rebind(scheduler)
    assert scheduler.optimizer is choice.optimizer and scheduler.base_lrs == [3e-3, 3e-3]
    assert choice.peak <= budget < choice.tried[0][1]
    assert [name for name, _ in choice.tried] == ["original", "adamw8bit"]
    # Accumulating, the highest micro-batch holds the earlier ones' gradients: a higher estimate.
    accumulating = fit_optimizer(model, optimizer, "1GiB", batch=_batch(), device="cpu", accumulating=True)
    assert accumulating.peak > kept.peak
    decay, no_decay = choice.hparams[0]
    assert decay["lr"] == 1.5e-3 and decay["initial_lr"] == 3e-3  # warmup's first step: half the peak
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert "AdamW -> adamw8bit" in choice.summary()


def test_fit_optimizer_takes_the_step_as_one_value():
    model = TinyLM()
    optimizer = torch.optim.AdamW(_groups(model), lr=3e-3)
    keywords = dict(precision="bf16-mixed", accumulating=True, lever="release_gradients")
    given = fit_optimizer(model, optimizer, "1GiB", batch=_batch(), device="cpu", **keywords)
    step = Step.of(**keywords)
    stepped = fit_optimizer(model, optimizer, "1GiB", batch=_batch(), device="cpu", step=step)
    assert (stepped.breakdown, stepped.tried) == (given.breakdown, given.tried)
    static = fit_optimizer(model, optimizer, "1GiB", device="cpu", lever="fused_step").breakdown  # no batch
    assert (
        fit_optimizer(model, optimizer, "1GiB", device="cpu", step=Step(lever="fused_step")).breakdown
        == static
    )
    assert static.gradients == 0
    with pytest.raises(TypeError, match="give step= or precision, not both"):
        fit_optimizer(model, optimizer, "1GiB", step=step, precision="16-mixed")
    with pytest.raises(ValueError, match=r"fit_optimizer plans one device; step= is sharded \(FSDP2 over 2"):
        fit_optimizer(model, optimizer, "1GiB", step=Step(sharding=Sharding(world_size=2)))


def test_bitsandbytes_without_fake_kernels_falls_back_to_sgd_plus_state(monkeypatch):
    """An older bitsandbytes cannot step fake tensors: the step with SGD plus the 8-bit state bytes
    gives the same estimate as the full simulation (the 8-bit update works in place)."""
    model = TinyLM()
    optimizer = swap_optimizer(torch.optim.AdamW(_groups(model), lr=3e-3), "adamw8bit")
    full = fit_optimizer(model, optimizer, "1GiB", batch=_batch(), device="cpu").breakdown
    static = fit_optimizer(model, optimizer, "1GiB", device="cpu").breakdown

    def no_bnb_kernels(*args, optimizer=None, **kwargs):
        if type(optimizer).__module__.startswith("bitsandbytes"):
            raise NotImplementedError("no fake kernel for bitsandbytes::optimizer_update_8bit_blockwise")
        return estimate_memory(*args, optimizer=optimizer, **kwargs)

    monkeypatch.setattr(
        "lightning_memkit._optimizers.choice.estimate_memory", no_bnb_kernels
    )  # the decision's simulator
    assert fit_optimizer(model, optimizer, "1GiB", batch=_batch(), device="cpu").breakdown == full
    assert fit_optimizer(model, optimizer, "1GiB", device="cpu").breakdown == static
    assert static.optimizer_state == full.optimizer_state


def test_bitsandbytes_missing_skips_the_8bit_candidates(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # `import bitsandbytes` fails
    model = TinyLM()
    optimizer = torch.optim.AdamW(_groups(model), lr=3e-3)
    budget = _between("adafactor", "adamw")
    with caplog.at_level(logging.INFO):
        choice = fit_optimizer(model, optimizer, budget, batch=_batch(), device="cpu")
    assert choice.name == "adafactor"
    assert [name for name, _ in choice.tried] == ["original", "adafactor"]
    lines = [r.getMessage() for r in caplog.records if "bitsandbytes" in r.getMessage()]
    assert lines == ["bitsandbytes is not available here: skipping the candidates adamw8bit, lion, lion8bit."]


def test_unknown_optimizer_left_alone_unless_allowed():
    model = TinyLM()
    rmsprop = torch.optim.RMSprop(_groups(model), lr=1e-3)
    with pytest.warns(UserWarning, match="RMSprop is not in the optimizer catalogue"):
        choice = fit_optimizer(model, rmsprop, 1, batch=_batch(), device="cpu")
    assert choice.optimizer is rmsprop and not choice.changed

    budget = _between("adamw8bit", "lion")  # RMSprop keeps 4 B/param, as Lion
    choice = fit_optimizer(model, rmsprop, budget, batch=_batch(), device="cpu", allow_unknown=True)
    assert choice.name == "adamw8bit"
    assert choice.optimizer.param_groups[0]["lr"] == 1e-3  # read as AdamW's lr


def test_infeasible_budget_names_the_numbers_and_the_way_out():
    model = TinyLM()
    optimizer = torch.optim.AdamW(_groups(model), lr=3e-3)
    floor = 2 * sum(p.numel() * 4 for p in model.parameters())
    with pytest.raises(
        ValueError, match=r"No optimizer fits .* the leanest, sgd, needs .*static floor"
    ) as err:
        fit_optimizer(model, optimizer, floor + 1000, batch=_batch(), device="cpu")
    message = str(err.value)
    for hint in ("activation checkpointing", "smaller micro-batch", "ZeRO"):
        assert hint in message
    with pytest.raises(ValueError, match="parameters and gradients alone"):
        fit_optimizer(model, optimizer, floor - 1000, device="cpu")  # static: nothing but sharding helps


def test_static_decision_and_step_peak():
    model = TinyLM()
    optimizer = torch.optim.AdamW(_groups(model), lr=3e-3)
    n = sum(p.numel() for p in model.parameters())
    floor = 2 * 4 * n
    # Without a batch: parameters + gradients + the state of a simulated step.
    choice = fit_optimizer(model, optimizer, floor + 4 * n, device="cpu")  # fits Lion's 4 B/param
    assert choice.method == "static" and choice.name == "adamw8bit"
    assert choice.breakdown.parameters == choice.breakdown.gradients == 4 * n

    calls = []

    def step_peak(optimizers):
        calls.append(type(optimizers[0]).__name__)
        return 10 if type(optimizers[0]) is torch.optim.Adafactor else 1000

    choice = fit_optimizer(model, optimizer, 100, step_peak=step_peak)
    assert choice.name == "adafactor" and choice.method == "given"
    assert calls == ["AdamW", "AdamW8bit", "Lion", "Lion8bit", "Adafactor"]


# --------------------------------------------------------------------------------------------------
# The callback
# --------------------------------------------------------------------------------------------------


class _Record(pl.Callback):
    """Records the optimizer and learning rate each step actually used."""

    def __init__(self):
        self.types, self.lrs = [], []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.types.append(type(optimizer).__name__)
        self.lrs.append([g["lr"] for g in optimizer.param_groups])


def test_callback_leaves_an_optimizer_that_fits_untouched(trainer_kwargs):
    model = TinyLM()
    seen = {}

    class Keep(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            seen["before"] = trainer.optimizers[0]

    swap = OptimizerSwap(budget="1GiB")
    trainer = pl.Trainer(callbacks=[Keep(), swap], max_steps=2, **trainer_kwargs)
    trainer.fit(model)
    assert trainer.optimizers[0] is seen["before"]
    assert not swap.choice.changed and swap.state_dict()["swapped"] is False


def test_callback_swaps_keeps_groups_and_logs(trainer_kwargs, tmp_path, lightning_log):
    model = TinyLM()
    budget = _between("adamw8bit", "adamw")
    record = _Record()
    swap = OptimizerSwap(budget=budget)
    trainer_kwargs["logger"] = CSVLogger(tmp_path)
    trainer = pl.Trainer(callbacks=[swap, record], **{**trainer_kwargs, "max_steps": 3})
    trainer.fit(model)
    optimizer = trainer.optimizers[0]
    assert type(optimizer) is bnb.optim.AdamW8bit and record.types == ["AdamW8bit"] * 3
    assert [g["name"] for g in optimizer.param_groups] == ["decay", "no_decay"]
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]
    assert optimizer.state  # it trained

    printed = next(line for line in lightning_log.messages if "OptimizerSwap: AdamW ->" in line)
    assert f"budget of {format_bytes(budget)}" in printed and format_bytes(swap.choice.peak) in printed
    assert "Tried: original" in printed and "lr=0.01" in printed

    with open(trainer.logger.experiment.metrics_file_path) as f:
        rows = [r for r in csv.DictReader(f) if r.get("optimizer_swap/peak")]
    assert float(rows[0]["optimizer_swap/swapped"]) == 1.0
    assert float(rows[0]["optimizer_swap/peak"]) == pytest.approx(swap.choice.peak / 2**20)
    assert float(rows[0]["optimizer_swap/budget"]) == pytest.approx(budget / 2**20)
    assert swap.state_dict() == {
        "optimizer": "adamw8bit",
        "swapped": True,
        "originals": ["adamw"],
        "allow_unknown": False,
        "budget": budget,
        "peak": swap.choice.peak,
        "optimizer_state": swap.choice.state_bytes,
    }


def test_callback_rebinds_the_warmup_cosine(trainer_kwargs):
    """A warmup-cosine LambdaLR as the GPT example configures it (decay / no-decay groups, stepped every
    step) keeps its shape: every step's lr is the unswapped one / 10 (Lion)."""

    def run(callbacks):
        record = _Record()
        trainer = pl.Trainer(callbacks=[*callbacks, record], **{**trainer_kwargs, "max_epochs": 2})
        trainer.fit(TinyLM(scheduler=True))
        return record

    reference = run([])
    swapped = run([OptimizerSwap(budget=_between("lion", "adamw"), optimizers=("lion",))])
    assert swapped.types == ["Lion"] * 2 * N_BATCHES
    assert len(set(map(tuple, reference.lrs))) > 3  # the schedule moves: warmup, then cosine
    for ref, new in zip(reference.lrs, swapped.lrs, strict=True):
        assert new == pytest.approx([lr / 10 for lr in ref])


def test_stop_and_resume_reaches_the_same_loss(trainer_kwargs, tmp_path):
    """Two epochs straight through vs one, a checkpoint, and a resumed second: same optimizer, same
    8-bit state, same losses."""
    budget = _between("adamw8bit", "adamw")

    torch.manual_seed(0)
    straight = TinyLM(scheduler=True)
    pl.Trainer(callbacks=[OptimizerSwap(budget)], **{**trainer_kwargs, "max_epochs": 2}).fit(straight)

    torch.manual_seed(0)
    first = TinyLM(scheduler=True)
    trainer = pl.Trainer(callbacks=[OptimizerSwap(budget)], **trainer_kwargs)
    trainer.fit(first)
    ckpt = tmp_path / "half.ckpt"
    trainer.save_checkpoint(ckpt)
    saved_state1 = trainer.optimizers[0].state_dict()

    loaded = {}

    class Inspect(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            optimizer = trainer.optimizers[0]
            loaded["type"] = type(optimizer)
            loaded["state"] = copy.deepcopy(optimizer.state_dict())  # the steps update it in place
            loaded["lr_scheduler_bound"] = trainer.lr_scheduler_configs[0].scheduler.optimizer is optimizer

    torch.manual_seed(1)  # the resumed weights must come from the checkpoint, not the seed
    resumed = TinyLM(scheduler=True)
    # A budget that AdamW fits now: the stored choice holds, the checkpoint has 8-bit state.
    trainer = pl.Trainer(callbacks=[OptimizerSwap("1GiB"), Inspect()], **{**trainer_kwargs, "max_epochs": 2})
    trainer.fit(resumed, ckpt_path=ckpt)

    assert loaded["type"] is bnb.optim.AdamW8bit and loaded["lr_scheduler_bound"]
    # the 8-bit moments and their scales were loaded
    torch.testing.assert_close(loaded["state"]["state"], saved_state1["state"], rtol=0, atol=0)
    assert first.losses == straight.losses[:N_BATCHES]
    assert resumed.losses == straight.losses[N_BATCHES:]
    assert type(trainer.optimizers[0]) is bnb.optim.AdamW8bit


def test_callback_unknown_optimizer_warns_and_allow_unknown_swaps(trainer_kwargs):
    budget = _between("adamw8bit", "lion")  # RMSprop keeps 4 B/param, as Lion
    model = TinyLM(optimizer="rmsprop")
    trainer = pl.Trainer(callbacks=[OptimizerSwap(budget)], max_steps=1, **trainer_kwargs)
    with pytest.warns(UserWarning, match="RMSprop is not in the optimizer catalogue"):
        trainer.fit(model)
    assert type(trainer.optimizers[0]) is torch.optim.RMSprop

    model = TinyLM(optimizer="rmsprop")
    trainer = pl.Trainer(callbacks=[OptimizerSwap(budget, allow_unknown=True)], max_steps=1, **trainer_kwargs)
    trainer.fit(model)
    assert type(trainer.optimizers[0]) is bnb.optim.AdamW8bit


class TwoNets(pl.LightningModule):
    """Manual optimization with one optimizer per net, as a GAN does; ``second`` picks the other's kind."""

    def __init__(self, second: str = "adamw") -> None:
        super().__init__()
        self.automatic_optimization = False
        self.a = nn.Linear(D, D)
        self.b = nn.Linear(D, D)
        self.second = second
        self.used: list[tuple[str, ...]] = []
        self.seen: list[torch.optim.Optimizer] = []  # what self.optimizers() wraps, at the last step

    def training_step(self, batch, batch_idx):
        optimizers = self.optimizers()
        optimizers = optimizers if isinstance(optimizers, list) else [optimizers]
        self.used.append(tuple(type(o.optimizer).__name__ for o in optimizers))
        self.seen = [o.optimizer for o in optimizers]
        x = batch[0]
        losses = [self.a(x).pow(2).mean(), self.b(x).pow(2).mean()]
        if len(optimizers) == 1:
            losses = [sum(losses)]
        for loss, opt in zip(losses, optimizers, strict=True):
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()

    def configure_optimizers(self):
        first = torch.optim.AdamW(self.a.parameters(), lr=1e-3)
        if self.second == "none":
            return torch.optim.AdamW(self.parameters(), lr=1e-3)
        second = torch.optim.RMSprop(self.b.parameters(), lr=1e-3) if self.second == "rmsprop" else (
            torch.optim.AdamW(self.b.parameters(), lr=1e-3)
        )  # fmt: skip
        return [first, second]

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(8, D)), batch_size=4)


def _static(n_params: int, state_per_param: float) -> int:
    return int(2 * 4 * n_params + state_per_param * n_params)


def test_manual_optimization_swaps_what_self_optimizers_returns(trainer_kwargs, lightning_log):
    model = TwoNets(second="none")
    n = sum(p.numel() for p in model.parameters())
    trainer = pl.Trainer(callbacks=[OptimizerSwap(_static(n, 5))], max_steps=2, **trainer_kwargs)
    trainer.fit(model)
    assert model.used == [("AdamW8bit",), ("AdamW8bit",)]
    assert model.seen == trainer.optimizers  # the very optimizers installed
    assert any("manual optimization cannot be simulated" in line for line in lightning_log.messages)


def test_two_optimizers_swap_together_on_their_sum(trainer_kwargs):
    model = TwoNets()
    n = sum(p.numel() for p in model.parameters())
    # Two AdamW: 8 B/param over the budget's 5; both as AdamW8bit (about 2.6 B/param) fit.
    swap = OptimizerSwap(_static(n, 5))
    trainer = pl.Trainer(callbacks=[swap], max_steps=1, **trainer_kwargs)
    trainer.fit(model)
    assert model.used == [("AdamW8bit", "AdamW8bit")]
    assert swap.choice.originals == ("adamw", "adamw") and swap.choice.method == "static"

    model = TwoNets(second="rmsprop")  # the unknown one is left alone and still counted
    trainer = pl.Trainer(callbacks=[OptimizerSwap(_static(n, 5))], max_steps=1, **trainer_kwargs)
    with pytest.warns(UserWarning, match="RMSprop is not in the optimizer catalogue"):
        trainer.fit(model)
    assert model.used == [("AdamW8bit", "RMSprop")]


def test_strategies_that_own_the_optimizer_are_skipped():
    swap = OptimizerSwap("1GiB")
    strategy = SimpleNamespace(restore_checkpoint_after_setup=True, lightning_restore_optimizer=False)
    trainer = SimpleNamespace(strategy=strategy)
    with pytest.warns(UserWarning, match="OptimizerSwap does nothing with SimpleNamespace"):
        swap.setup(trainer, None, "fit")
    swap.on_train_batch_start(trainer, None, None, 0)  # disabled: touches nothing
    assert swap.choice is None


def test_arguments_are_validated():
    with pytest.raises(ValueError, match="Unknown optimizer candidate 'adam8bit'"):
        OptimizerSwap("1GiB", optimizers=("adam8bit",))
    with pytest.raises(ValueError, match="Unknown GPU or size 'lots'"):
        OptimizerSwap("lots")
    assert OptimizerSwap("A100-40GB").budget < 40 * 2**30  # the CUDA context and a reserve taken off
    assert OptimizerSwap(0.9).budget is None  # read from the device at setup
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs a CUDA device"):
            OptimizerSwap("auto").setup(SimpleNamespace(), None, "fit")
    assert OptimizerSwap("1GiB").load_state_dict({}) is None  # old or empty checkpoints load


def test_under_fsdp2_it_defers_to_the_strategy_plugin():
    """ModelParallelStrategy loads the optimizer state after on_fit_start, where a swap could not be
    resumed: OptimizerSwap does nothing there and names AutoFitStrategy, with the budget it was given;
    beside AutoFitStrategy it says the strategy chooses."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lightning_memkit import AutoFitStrategy

    cases = {
        ModelParallelStrategy(): "defers to ModelParallelStrategy, .*strategy=AutoFitStrategy.budget='1GiB'.",
        AutoFitStrategy(budget="1GiB"): "defers to AutoFitStrategy, which chooses the optimizer",
    }
    for strategy, message in cases.items():
        swap = OptimizerSwap("1GiB")
        with pytest.warns(UserWarning, match=message):
            swap.setup(SimpleNamespace(strategy=strategy), None, "fit")
        swap.on_fit_start(SimpleNamespace(strategy=strategy), None)  # disabled: touches nothing
        assert swap.choice is None
