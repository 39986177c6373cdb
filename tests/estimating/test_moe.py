"""Mixture-of-experts on the simulated step (issue 26 item 1, in part). Hugging Face's MoE layers run their
experts in one grouped matmul (``aten._grouped_mm``), whose meta kernel takes bf16 only: every
estimator-backed feature crashed on an fp32 MoE ("Expected inputs of BF16 type"). The simulation takes the
output's shape from the bf16 call and keeps the operands' dtype. The zoo's Mixtral (tests/zoo.py) is held
to the allocator by the zoo's tests; this is the other family, with a shared expert beside the routed ones.
"""

from __future__ import annotations

import pytest
import torch
from helpers import steady_step_and_estimate
from zoo import _qwen2_moe

from lightning_memkit import estimate_memory
from lightning_memkit.testing import allocator_peak


def _loss(out, labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), labels.flatten())


@pytest.mark.parametrize("batch_size", [pytest.param(2, marks=pytest.mark.slow), 8])
def test_an_fp32_moe_step_is_estimated_as_the_allocator_counts_it(batch_size):
    torch.manual_seed(0)
    model = _qwen2_moe()
    optimizer = torch.optim.AdamW(model.parameters())
    ids = torch.randint(0, 128, (batch_size, 16), generator=torch.Generator().manual_seed(1))
    truth, estimate = steady_step_and_estimate(model, (ids, ids), optimizer, _loss)
    assert estimate == pytest.approx(truth, rel=1e-3)
    assert next(model.parameters()).dtype == torch.float32  # the simulation cast nothing of the model's


def _eager_moe(batch_size: int = 4) -> tuple[torch.nn.Module, torch.Tensor]:
    """Qwen2-MoE with Hugging Face's eager experts: each expert's tokens gathered with ``nonzero`` of the
    router's choice, a buffer whose size depends on the routing."""
    torch.manual_seed(0)
    ids = torch.randint(0, 128, (batch_size, 16), generator=torch.Generator().manual_seed(1))
    return _qwen2_moe(experts_implementation="eager"), ids


@pytest.mark.parametrize(
    ("batch_size", "checkpointing"),
    [
        (4, "none"),
        pytest.param(16, "none", marks=pytest.mark.slow),
        pytest.param(16, "full", marks=pytest.mark.slow),
    ],
)
def test_experts_chosen_token_by_token_follow_the_batchs_routing(batch_size, checkpointing):
    """The eager experts' ``nonzero`` is sized by the router, whose values come from the weights: the
    simulation takes each call's size from a real forward of the batch (`_estimating.routing`), and a
    checkpointed block's recompute replays it. The optimizer keeps its rate at 0: the weights, and so the
    routing, of the measured step are those the estimate saw."""
    from lightning_memkit import apply_checkpointing

    model, ids = _eager_moe(batch_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)
    with apply_checkpointing(model, checkpointing):
        truth, estimate = steady_step_and_estimate(model, (ids, ids), optimizer, _loss)
    assert estimate == pytest.approx(truth, rel=1e-3)


class TopKMoE(torch.nn.Module):
    """Top-1 routing over four experts, each expert's tokens gathered with ``nonzero`` and run through a
    wide MLP: the buffers it holds at once are sized by how many tokens the busiest expert gets."""

    def __init__(self, width: int = 16, hidden: int = 512, experts: int = 4) -> None:
        super().__init__()
        self.router = torch.nn.Linear(width, experts)
        self.up = torch.nn.ModuleList(torch.nn.Linear(width, hidden) for _ in range(experts))
        self.down = torch.nn.ModuleList(torch.nn.Linear(hidden, width) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        chosen = self.router(x).argmax(-1)
        out = torch.zeros_like(x)
        for expert, (up, down) in enumerate(zip(self.up, self.down, strict=True)):
            rows = (chosen == expert).nonzero().squeeze(-1)
            out = out.index_add(0, rows, down(torch.relu(up(x[rows]))))
        return out


def _routed_to_the_last_expert(model: TopKMoE) -> TopKMoE:
    with torch.no_grad():
        model.router.weight.zero_()
        model.router.bias.copy_(torch.tensor([0.0, 0.0, 0.0, 1.0]))
    return model


@pytest.mark.parametrize("routing", ["spread", "one expert"])
def test_an_estimate_follows_the_routing_its_memory_depends_on(routing):
    """One batch, two routers: tokens spread over the experts, or all sent to the last one, whose wide
    buffers then hold every token at once. The allocator's peaks differ by a third; each estimate is its
    own step's."""
    torch.manual_seed(0)
    x = torch.randn(256, 16, generator=torch.Generator().manual_seed(1))
    peaks = {}
    for name in ("spread", "one expert"):
        torch.manual_seed(0)
        model = TopKMoE() if name == "spread" else _routed_to_the_last_expert(TopKMoE())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        peaks[name] = steady_step_and_estimate(model, (x, x), optimizer, torch.nn.functional.mse_loss)
    assert peaks["one expert"][0] > 1.3 * peaks["spread"][0]  # the routing moves the peak
    truth, estimate = peaks[routing]
    assert estimate == pytest.approx(truth, rel=1e-3)


class _Branchy(torch.nn.Module):
    """``moe`` always, and ``extra`` only when a value read off the weights says so: the real forward
    runs it, the simulation (whose value is a placeholder, 1) does not."""

    def __init__(self) -> None:
        super().__init__()
        self.moe, self.extra, self.gate = TopKMoE(), TopKMoE(), torch.nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.moe(x)
        return x + self.extra(x) if self.gate(x).mean().item() != 1.0 else x


class _Shared(torch.nn.Module):
    """One MoE applied twice, each time a checkpointed region (``shared``), or two MoEs."""

    def __init__(self, shared: bool) -> None:
        super().__init__()
        self.moes = torch.nn.ModuleList([TopKMoE()] if shared else [TopKMoE(), TopKMoE()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(2):
            moe = self.moes[i % len(self.moes)]
            x = x + torch.utils.checkpoint.checkpoint(moe, x, use_reentrant=False)
        return x


def test_a_step_whose_calls_do_not_line_up_with_the_real_forward_is_refused():
    """Where the simulated step's calls cannot be matched to the real forward's, the estimate refuses
    rather than read another routing: a routed module the simulation skips (a branch on a value it only
    has a placeholder for), and a module run twice whose checkpointed recompute repeats one of its calls,
    not known which. Two distinct modules, each recomputed, are followed."""
    torch.manual_seed(0)
    x = torch.randn(256, 16, generator=torch.Generator().manual_seed(1))
    mse = torch.nn.functional.mse_loss
    with pytest.raises(NotImplementedError, match=r"nonzero.* in extra 0 time\(s\).*called it 4 time"):
        estimate_memory(_Branchy(), (x, x), optimizer="adamw", loss_fn=mse, device="cpu")
    with pytest.raises(
        NotImplementedError, match=r"recomputes .*nonzero.* in moes\.0, a module .* ran 2 times"
    ):
        estimate_memory(_Shared(shared=True), (x, x), optimizer="adamw", loss_fn=mse, device="cpu")
    model = _Shared(shared=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    truth, estimate = steady_step_and_estimate(model, (x, x), optimizer, mse)
    assert estimate == pytest.approx(truth, rel=1e-3)


def test_weights_on_the_meta_device_cannot_show_their_routing():
    """No real forward runs on the meta device: the estimate and the planners built on it refuse, naming
    the op, the module, why and what to do, where they once raised torch's DynamicOutputShapeException
    (and AutoFit's search tried every micro-batch first)."""
    from lightning_memkit import plan_fit

    with torch.device("meta"):
        model = TopKMoE()
    x = torch.randn(8, 16)
    expected = (
        r"cannot follow aten\.nonzero\.default in TopKMoE\.forward.*the weights are on the meta device.*"
        r"experts_implementation='grouped_mm'.*measure, MemoryMonitor"
    )
    mse = torch.nn.functional.mse_loss
    with pytest.raises(NotImplementedError, match=expected):
        estimate_memory(model, (x, x), optimizer="adamw", loss_fn=mse, device="cpu")
    with pytest.raises(NotImplementedError, match=expected):
        plan_fit(model, (x, x), "1GiB", loss_fn=mse, device="cpu", cost="flops")


def test_a_forward_that_fails_for_real_is_refused_with_its_error():
    """The real forward that would show the routing runs without autograd: one that fails there leaves
    the estimate refused, its error named, not raised bare from inside the estimate."""

    class NeedsAutograd(TopKMoE):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if not torch.is_grad_enabled():
                raise RuntimeError("this layer needs autograd")
            return super().forward(x)

    torch.manual_seed(0)
    x = torch.randn(8, 16)
    expected = r"nonzero.*the real forward of the batch that would show them failed \(RuntimeError: this"
    mse = torch.nn.functional.mse_loss
    with pytest.raises(NotImplementedError, match=expected):
        estimate_memory(NeedsAutograd(), (x, x), optimizer="adamw", loss_fn=mse, device="cpu")


class _NearTie(torch.nn.Module):
    """Top-1 over a wide expert and a narrow one; the router prefers the narrow one by less than bf16 can
    tell (a bias of 1.001 against 1.0, which bf16 rounds to 1.0): with 16-bit weights or under bf16
    autocast the tie goes to the wide expert, and every token with it."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.router = torch.nn.Linear(width, 2)
        self.experts = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(width, h), torch.nn.ReLU(), torch.nn.Linear(h, width))
            for h in (2048, 32)
        )
        with torch.no_grad():
            self.router.weight.zero_()
            self.router.bias.copy_(torch.tensor([1.0, 1.001]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.router.weight.dtype)  # as Hugging Face's models read their weights' dtype
        chosen = self.router(x).argmax(-1)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            rows = (chosen == i).nonzero().squeeze(-1)
            out = out.index_add(0, rows, expert(x[rows]).to(out.dtype))
        return out


@pytest.mark.parametrize("precision", ["bf16-true", "bf16-mixed"])
def test_the_routing_is_recorded_at_the_steps_precision(precision):
    """The routing is recorded with the weights (``bf16-true``) or the autocast (``bf16-mixed``) the step
    runs with, on the fp32 model a plan sees at ``setup``. Recorded in fp32, the 16-bit step was read
    with fp32's routing, every token on the narrow expert: 299,976 B for a step of 3,375,430 B. The 16-bit
    weights are a copy the forward sees as the model's (it reads their dtype); the model is left as it
    was, in fp32."""
    import copy

    torch.manual_seed(0)
    model, x = _NearTie(), torch.randn(256, 16, generator=torch.Generator().manual_seed(1))
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    mse = torch.nn.functional.mse_loss
    real = copy.deepcopy(model).to(torch.bfloat16) if precision == "bf16-true" else copy.deepcopy(model)
    inputs = x.to(torch.bfloat16) if precision == "bf16-true" else x
    optimizer = torch.optim.SGD(real.parameters(), lr=0.0)

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
            loss = mse(real(inputs), inputs)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    step()
    truth = allocator_peak(step)
    fp32 = estimate_memory(model, (x, x), optimizer="sgd", loss_fn=mse, device="cpu").peak
    assert truth > 4 * fp32  # the 16-bit step routes to the wide expert
    estimate = estimate_memory(model, (x, x), optimizer="sgd", loss_fn=mse, device="cpu", precision=precision)
    assert estimate.peak == pytest.approx(truth, rel=1e-3)
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p, weights[name]), name


@pytest.mark.parametrize("precision", ["bf16-true", pytest.param("bf16-mixed", marks=pytest.mark.slow)])
def test_the_zoos_eager_moe_at_16_bit_precision_is_estimated_as_the_allocator_counts_it(precision):
    """The zoo's Qwen2-MoE with its eager experts (default config), its routing recorded at the step's
    precision: the estimate of the fp32 model against the 16-bit step's allocator. The optimizer keeps its
    rate at 0, so the weights the estimate routes with are the measured step's."""
    import copy

    model, ids = _eager_moe(4)
    real = copy.deepcopy(model).to(torch.bfloat16) if precision == "bf16-true" else copy.deepcopy(model)
    optimizer = torch.optim.AdamW(real.parameters(), lr=0.0)

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
            loss = _loss(real(ids), ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    step()
    truth = allocator_peak(step)
    estimate = estimate_memory(
        model, (ids, ids), optimizer="adamw", loss_fn=_loss, device="cpu", precision=precision
    )
    assert estimate.peak == pytest.approx(truth, rel=1e-3)


def test_recording_the_routing_leaves_the_model_and_the_rng_as_they_were():
    """The real forward that shows the routing is the user's code run once more: it leaves the weights,
    their gradients, the RNG streams and the modules' modes as they were."""
    torch.manual_seed(0)
    model, x = TopKMoE().eval(), torch.randn(64, 16)
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    rng = torch.get_rng_state()
    estimate_memory(model, (x, x), optimizer="adamw", loss_fn=torch.nn.functional.mse_loss, device="cpu")
    assert torch.equal(torch.get_rng_state(), rng)
    assert not model.training
    for name, p in model.named_parameters():
        assert torch.equal(p, weights[name]) and p.grad is None, name


def test_a_plan_says_what_routing_it_assumed():
    """A plan on experts sized by the routing holds for the batch's routing under the weights as they are:
    the plan says so, and its micro-batch's step, routed as planned, fits the budget less its margin."""
    from lightning_memkit import plan_fit

    torch.manual_seed(0)
    model, x = _routed_to_the_last_expert(TopKMoE()), torch.randn(256, 16)
    mse = torch.nn.functional.mse_loss
    whole = estimate_memory(model, (x, x), optimizer="adamw", loss_fn=mse, device="cpu").peak
    plan = plan_fit(
        model, (x, x), int(whole * 0.8), optimizers=["adamw"], checkpointing=["none"], loss_fn=mse,
        device="cpu", cost="flops",
    )  # fmt: skip
    assert "routing: the planned batch's, under the weights as they were" in plan.note
    assert plan.micro_batch_size < 256
    micro = x[: plan.micro_batch_size]
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)
    truth, estimate = steady_step_and_estimate(model, (micro, micro), optimizer, mse)
    assert truth <= plan.budget.usable * (1 - plan.margin)
    assert estimate == pytest.approx(truth, rel=1e-3)


@pytest.mark.slow  # compiles or plans: 15-50 s on 2 cores
def test_a_checkpointing_plan_says_what_routing_it_assumed():
    """`plan_checkpointing` on the eager experts: the planner's profile of each block (run again inside the
    forward, in every mode) replays the routing its own call will, and the plan (and so
    ActivationCheckpointing's) carries the note, printed and kept through ``as_dict``; a model that routes
    nothing gets none."""
    from lightning_memkit import plan_checkpointing
    from lightning_memkit._checkpointing.policies import CheckpointPlan

    model, ids = _eager_moe()
    run = {"optimizer": "adamw", "loss_fn": _loss, "device": "cpu"}
    budget = estimate_memory(model, (ids, ids), **run).peak
    plan = plan_checkpointing(model, (ids, ids), budget, **run)  # its blocks profiled on the routing
    assert plan.peak == budget and set(plan.modes.values()) == {"none"}
    assert plan.note.startswith("routing: the planned batch's") and plan.note in str(plan)
    assert CheckpointPlan.from_dict(plan.as_dict()).note == plan.note
    torch.manual_seed(0)
    plain = _qwen2_moe()  # the grouped experts: the same memory whatever the routing
    assert plan_checkpointing(plain, (ids, ids), 2 * budget, **run).note == ""


class _Gather(torch.nn.Module):
    """A wide activation whose rows with a positive first feature are gathered (``h[rows]``), run on and
    added back: ``index``'s backward scatters their gradient into zeros of the activation's size."""

    def __init__(self, width: int = 16, hidden: int = 4096) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(width, hidden), torch.nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        rows = (x[:, 0] > 0).nonzero().squeeze(-1)
        return torch.zeros_like(x).index_add(0, rows, self.down(torch.relu(h[rows])))


def test_a_gathers_backward_is_counted_as_the_unwatched_step_makes_it():
    """Unwatched, ``index``'s backward scatters into its zeros in place; under any dispatch mode autograd
    takes the out-of-place variant, and the watched step held one more activation-sized buffer (+25 % here,
    measured and simulated alike). The tracker counts it as the unwatched step makes it. The estimate
    reads 0.2 % high: the CPU kernel's own buffer, asked of the kernel helper for the out-of-place call."""
    from lightning_memkit import measure

    torch.manual_seed(0)
    model, x = _Gather(), torch.randn(512, 16, generator=torch.Generator().manual_seed(1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    truth, estimate = steady_step_and_estimate(model, (x, x), optimizer, torch.nn.functional.mse_loss)
    with measure(model, optimizer) as measured:
        torch.nn.functional.mse_loss(model(x), x).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert measured.breakdown.peak == pytest.approx(truth, rel=1e-3)
    assert estimate == pytest.approx(truth, rel=3e-3)


def test_eager_experts_measured_as_the_unmeasured_step_allocates():
    """`measure` follows any routing. Under any Python dispatch mode the autograd engine adds the
    gradients that several experts' selects send to one parameter out of place, so the measured step
    holds one more parameter-sized buffer than the same step unmeasured (it read +345,912 B here); the
    tracker counts such a sum as the plain step makes it, in place (tests/measuring/test_packed.py)."""
    from lightning_memkit import measure

    model, ids = _eager_moe()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)  # the same weights, the same routing

    def step() -> None:
        _loss(model(ids), ids).backward()
        optimizer.step()
        optimizer.zero_grad()

    step()  # the optimizer's state
    truth = allocator_peak(step)
    with measure(model, optimizer) as measured:
        step()
    assert measured.breakdown.peak == pytest.approx(truth, rel=1e-3)


def _monitored_fit(tmp_path, batch_size: int):
    """A 4-step fit of the eager experts under MemoryMonitor: the monitor and the allocator's peaks."""
    from lightning_memkit import MemoryMonitor

    monitor = MemoryMonitor(plot=False, summary=False)
    with pytest.warns(UserWarning, match=r"sizes tensors by the values.*aten\.nonzero"):
        peaks = _fit_peaks(tmp_path, batch_size, monitor)
    return monitor, peaks


def _fit_peaks(tmp_path, batch_size: int, *callbacks) -> list[int]:
    """The allocator's peak of each step of a 4-step fit of the eager experts with ``callbacks``."""
    from helpers import cpu_trainer
    from zoo import ZooModule

    from lightning_memkit.testing import AllocatorPeaks

    peaks = AllocatorPeaks()
    cpu_trainer(tmp_path, peaks.around(*callbacks)).fit(ZooModule("qwen2_moe_eager", batch_size=batch_size))
    return peaks.peaks


@pytest.mark.slow  # a Trainer fit: the full run's tier
def test_routing_that_changes_between_steps_is_measured_every_step(tmp_path):
    """Under MemoryMonitor the eager experts' steps of one shape route their tokens differently as the
    weights learn and the batches change: no step takes an earlier one's figures (the monitor measures
    each, and says why once), and every logged step is the allocator's."""
    monitor, peaks = _monitored_fit(tmp_path, batch_size=8)
    assert monitor.measured_steps == len(monitor.history) == len(peaks) == 4
    for (_, measured), truth in zip(monitor.history, peaks, strict=True):
        assert measured.peak == pytest.approx(truth, rel=1e-3)


@pytest.mark.slow  # two Trainer fits: the full run's tier
def test_the_monitor_logs_the_plain_steps_though_its_own_step_peaks_higher(tmp_path):
    """What the monitor logs is what the step allocates unwatched: each step of the same fit without it,
    to the allocator. The watched step itself peaks higher here (the first, at batch 16): under any Python
    dispatch mode autograd sums two gradients of one tensor out of place, where the plain engine sums in
    place into the one it holds the only reference to (`_measuring.ops.engine_sum`), and these sums set this
    step's peak. So the truth for the monitor is the plain fit's, not the watched step's (docs/monitor.md)."""
    monitor, watched = _monitored_fit(tmp_path / "monitored", batch_size=16)
    plain = _fit_peaks(tmp_path / "plain", batch_size=16)
    assert [measured.peak for _, measured in monitor.history] == pytest.approx(plain, rel=1e-3)
    # torch's side of it: should it sum in place under a mode too, this fails and the docs' note goes
    assert watched[0] > 1.03 * plain[0]
