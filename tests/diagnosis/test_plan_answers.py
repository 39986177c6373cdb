"""Answers that are code, and answers that do not depend on the machine (issue 46, items 6 to 8).

The code a plan prints (`plan_code`: ``memkit plan``, the OOM report) is executed here and must build what
was planned: the optimizer (not a comment) and the budget as a user writes it. ``advise``'s chunked loss
for a Hugging Face causal LM, run as written, must be the model's own loss. A plan must be the same on a
machine 100x slower, and a refusal must name the step lever that would fit.
"""

from __future__ import annotations

import re
import time
from functools import partial

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from models import tiny_lm
from transformers import AutoConfig, AutoModelForCausalLM

import lightning_memkit
from lightning_memkit import AutoFit, FitPlan, advise, format_bytes, parse_budget, plan_fit
from lightning_memkit._diagnosis import oom
from lightning_memkit._diagnosis.loss_code import chunked_loss_code
from lightning_memkit._diagnosis.plan_code import plan_code
from lightning_memkit._fitting import simulations
from lightning_memkit._fitting.plan import StepCost
from lightning_memkit._fitting.search import TIMED_NOTE
from lightning_memkit.demos.gpt import GPTLightningModule

# --- item 6: the plan's code builds the plan ------------------------------------------------------------


def _plan(budget, optimizer: str = "adamw8bit", precision: str = "32-true", **changes) -> FitPlan:
    fields = dict(
        micro_batch_size=4, accumulate_grad_batches=2, checkpointing="none", optimizer=optimizer,
        precision=precision, estimated_peak=10**6, budget=parse_budget(budget),
    )  # fmt: skip
    return FitPlan(**{**fields, **changes})


def _run(code: str) -> dict:
    """``code`` executed with a Trainer that records its arguments (the callbacks are real)."""
    namespace = {"Trainer": dict}
    exec(compile(code.replace("from lightning.pytorch import Trainer\n", ""), "<plan>", "exec"), namespace)
    return namespace


@pytest.mark.parametrize(
    ("optimizer", "precision", "built"),
    [
        ("adamw8bit", "32-true", "bitsandbytes.optim.adamw.AdamW8bit"),
        ("lion", "32-true", "bitsandbytes.optim.lion.Lion"),
        ("adamw_kahan", "bf16-true", "optimi.adamw.AdamW"),
        ("sgd_momentum", "32-true", "torch.optim.sgd.SGD"),
    ],
)
def test_the_plans_code_builds_the_planned_optimizer(optimizer, precision, built):
    """The by-hand set-up's ``configure_optimizers``, run on the module, builds the catalogue's optimizer
    with the module's hyper-parameters translated as `swap_optimizer` translates them (it was a comment,
    and pasting the plan kept AdamW)."""
    module = GPTLightningModule("tiny", learning_rate=2e-3, weight_decay=0.05)
    code = plan_code(_plan("RTX-4090", optimizer, precision), module, global_batch=8, optimizers=None)
    configure = _run(code)["configure_optimizers"]
    made = configure(module)
    assert f"{type(made).__module__}.{type(made).__name__}" == built
    swapped = lightning_memkit.swap_optimizer(torch.optim.AdamW(module.parameters(), lr=2e-3), optimizer)
    assert made.defaults["lr"] == pytest.approx(swapped.defaults["lr"])
    assert {id(p) for p in made.param_groups[0]["params"]} == {id(p) for p in module.parameters()}
    # the module's no-decay group and its schedule are not in the lines: the code says how to keep them
    assert f'optimizer = lightning_memkit.swap_optimizer(optimizer, "{optimizer}")' in code


def test_the_plans_code_writes_the_budget_as_the_user_would():
    """A GPU by name, a card given by its size as "auto" (the card the run is on), a limit as given; never
    ``parse_budget(..., device_size=True)`` nor the usable bytes."""
    module = GPTLightningModule("tiny")
    for budget, written in [
        (parse_budget("RTX-4090"), "RTX-4090"),
        (parse_budget("24GB", device_size=True), "auto"),
        (parse_budget("24GiB", device_size=True), "RTX-3090"),  # a card of that size
        (parse_budget("40MB"), "40MB"),
    ]:
        code = plan_code(_plan(budget, "adamw"), module, global_batch=8, optimizers=None)
        assert "parse_budget" not in code and f"{budget.usable:_}" not in code
        autofit = _run(code.split("# 2. Or by hand")[0])["trainer"]["callbacks"][0]
        assert isinstance(autofit, AutoFit) and autofit.budget == written
        if written == "auto":
            assert 'budget="auto" reads the card the run is on: a 24GB card leaves 20.76 GiB' in code


def test_a_per_block_plan_gives_activation_checkpointing_a_size():
    """ActivationCheckpointing(budget=) for a per-block plan reads as a size, within 0.1 % under the
    step's limit (it was ``budget=20_060_975_369``)."""
    plan = _plan(parse_budget("24GB", device_size=True), "adamw", checkpointing="2 none, 2 full")
    code = plan_code(plan, GPTLightningModule("tiny"), global_batch=8, optimizers=None)
    assert f"{plan.limit:_}" not in code
    (checkpointing,) = _run(code)["trainer"]["callbacks"]  # the by-hand Trainer, the last
    assert plan.limit * 0.999 < checkpointing.budget <= plan.limit


# --- item 6: advise's chunked loss is the Hugging Face model's own ---------------------------------------


class _CausalLM(pl.LightningModule):
    def __init__(self, vocab_size: int = 1024, hidden_size: int = 32):
        super().__init__()
        config = AutoConfig.for_model(
            "llama", vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
            num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, use_cache=False,
        )  # fmt: skip
        self.model = AutoModelForCausalLM.from_config(config)

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _batch():
    torch.manual_seed(0)
    tokens = torch.randint(0, 1024, (2, 32))
    batch = {"input_ids": tokens, "labels": tokens.clone()}
    batch["labels"][0, :5] = -100  # ignored positions too
    return batch


def _advised_loss(module: _CausalLM, fix: str, batch: dict) -> torch.Tensor:
    """The loss the fix's code computes, run as written in ``training_step`` (``self``, ``batch``)."""
    code = re.search(r"(inputs = .*?chunks=\d+\))", fix).group(1)
    namespace = {"self": module, "batch": batch, "lightning_memkit": lightning_memkit}
    exec(code, namespace)
    return namespace["loss"]


def test_the_chunked_loss_fix_is_the_models_own_loss():
    """The logits finding's fix for a Hugging Face causal LM (`chunked_loss_code`), executed as written,
    computes the loss the model computes: labels shifted as the model shifts them, the head from
    ``get_output_embeddings()``. Followed literally it trained another objective (the unshifted labels)."""
    module, batch = _CausalLM(), _batch()
    fix = chunked_loss_code(module, "model.lm_head")
    assert "self.model.get_output_embeddings()" in fix and "LlamaForCausalLM shifts them" in fix
    loss = _advised_loss(module, fix, batch)
    torch.testing.assert_close(loss, module.model(**batch).loss)
    loss.backward()  # and it trains: every parameter the model's loss reaches gets a gradient
    assert all(p.grad is not None for p in module.parameters())


def test_no_chunked_loss_is_written_for_a_model_that_soft_caps_its_logits():
    """A hostile pass: Gemma 2 soft-caps its logits (final_logit_softcapping) before its loss; the fix,
    written as for LLaMA, computed another loss (123.16 against the model's 28.39 once the logits grew)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=16)  # fmt: skip
    assert config.final_logit_softcapping is not None  # Gemma 2's default
    fix = chunked_loss_code(Gemma2ForCausalLM(config), "lm_head")
    assert "chunked_cross_entropy(" not in fix
    assert f"final_logit_softcapping={config.final_logit_softcapping}" in fix and "another objective" in fix


@pytest.mark.slow  # three simulated steps of a Hugging Face model: about 5 s on 2 busy cores
def test_advise_gives_the_chunked_loss_that_is_the_models_own():
    module, batch = _CausalLM(), _batch()
    fix = advise(module, batch, device="cpu")["logits"].fix
    torch.testing.assert_close(_advised_loss(module, fix, batch), module.model(**batch).loss)


# --- item 7: a plan does not depend on how busy the machine is -------------------------------------------


def _slow_clock(monkeypatch, factor: float = 100.0) -> None:
    """Every clock the search could read runs ``factor`` times slower: a machine that busy."""
    for name in ("perf_counter", "monotonic"):
        real = getattr(time, name)
        start = real()
        monkeypatch.setattr(time, name, lambda real=real, start=start: start + factor * (real() - start))


def _gpt_plan(**kwargs) -> FitPlan:
    torch.manual_seed(0)
    x = torch.randint(0, 256, (8, 32))
    cost = StepCost(fixed=0.01, per_sample=0.01)  # a fixed cost model: the search alone is under test
    module = GPTLightningModule("tiny")
    return plan_fit(module, (x, x.roll(-1, 1)), 20_000_000, device="cpu", cost=cost, **kwargs)


@pytest.mark.slow  # three plans of the tiny GPT, each with its checkpointing planners: about 20 s
def test_the_same_plan_on_a_machine_100x_slower(monkeypatch):
    """The search bounds its work by counts: a plan made while every clock runs 100x slower is the plan
    made at full speed, by default and with the CLI's ``refine_limit=7``. Before,
    past 30 s of that clock no micro-batch got its block-by-block plan, and where a simulation took over
    2 s the planner refined once."""
    fast = _gpt_plan()
    assert fast.checkpoint_plan is not None  # a block-by-block plan: the planners ran
    _slow_clock(monkeypatch)
    for slow in (_gpt_plan(refine_limit=7), _gpt_plan()):
        assert slow.as_dict() == fast.as_dict() and slow.note == fast.note


def test_refine_limit_is_checked():
    """A bad ``refine_limit`` is refused before any simulation."""
    x = torch.zeros(4, 16, dtype=torch.long)
    args = (GPTLightningModule("tiny"), (x, x), 16_940_824)
    with pytest.raises(ValueError, match="refine_limit must be a whole number of micro-batches, at least 0"):
        plan_fit(*args, refine_limit=-1)


@pytest.mark.slow  # a plan of the tiny GPT: 3 s on idle cores, 11 s on busy ones
def test_refine_limit_counts_micro_batches():
    """``refine_limit=0``: no micro-batch gets a block-by-block plan (micro-batch 4 fits only fully
    checkpointed), and the note says so in those words."""
    x = torch.zeros(4, 16, dtype=torch.long)
    quick = plan_fit(
        GPTLightningModule("tiny"), (x, x), 16_940_824, device="cpu", cost="flops", refine_limit=0
    )
    assert quick.checkpoint_plan is None and quick.checkpointing == "full"
    assert quick.estimated_peak <= quick.limit
    assert "not searched at every micro-batch (past refine_limit=0 micro-batches)" in quick.note


def test_a_plan_ranked_by_timed_steps_says_so():
    """``cost="measured"`` times real steps, whose times move with the machine's load: the note says so
    (and the summary, which shows the note); a plan ranked by FLOPs does not."""
    x = torch.zeros(4, 16, dtype=torch.long)
    args = (tiny_lm(), (x, x), 10**9)
    kwargs = dict(device="cpu", loss_fn=lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten()))
    timed = plan_fit(*args, cost="measured", **kwargs)
    assert TIMED_NOTE in timed.note and "whose times move with its load" in timed.summary()
    assert TIMED_NOTE not in plan_fit(*args, cost="flops", **kwargs).note


def test_an_oom_reports_plans_are_the_same_on_a_machine_100x_slower(monkeypatch):
    """An explanation's plans are bounded by a count (`PLAN_REFINE_LIMIT`), not by 60 s of a clock: with
    every clock 100x slower (and every simulation reported), the same plans. Before, past the time it
    gave no plan ("No plan within 60 s of simulation")."""
    x = torch.zeros(8, 32, dtype=torch.long)
    section = partial(
        oom.plans_section, tiny_lm(), (x, x), parse_budget(3 * 10**6), loss_fn=lambda out, y: out.sum(),
        device="cpu",
    )  # fmt: skip
    fast = section()
    assert fast[0].startswith("Plans that fit in")
    monkeypatch.setattr(simulations, "PROGRESS_AFTER_S", 0.0)
    _slow_clock(monkeypatch, factor=10_000.0)
    assert section() == fast


# --- item 8: a refusal names the step lever that fits ----------------------------------------------------


def test_a_refusal_names_the_fused_step_where_it_fits():
    """An embedding and a 32,000-word head at 6 B/param + 4 MiB with SGD: weights and gradients alone are
    8 B/param, so nothing fits as asked; the refusal names FusedOptimizerStep with the peak of its leanest
    plan (one micro-batch of 2), under the limit, and plan_fit(lever='fused_step') plans exactly that peak."""
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Embedding(32_000, 64), torch.nn.Linear(64, 32_000))
    limit = 6 * sum(p.numel() for p in model.parameters()) + 4 * 2**20
    x = torch.zeros(2, 16, dtype=torch.long)
    run = dict(
        margin=0.0, optimizers=["sgd"], cost="flops", device="cpu", checkpointing="none",
        loss_fn=lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten()),
    )  # fmt: skip
    with pytest.raises(ValueError, match="No plan fits") as refused:
        plan_fit(model, (x, x), limit, **run)
    fused = plan_fit(model, (x, x), limit, lever="fused_step", **run)
    assert (fused.micro_batch_size, fused.lever) == (
        2,
        "fused_step",
    ) and fused.estimated_peak <= limit
    named = (
        "What would fit: FusedOptimizerStep() (plan_fit's lever='fused_step'): its leanest plan, "
        f"micro-batch 2, none checkpointing, sgd, 32-true, peaks at {format_bytes(fused.estimated_peak)}; or "
    )
    assert named in str(refused.value)


@pytest.mark.slow  # a Hugging Face model's first CPU kernels are measured in a worker: about 15 s
def test_a_refusal_names_the_step_lever_that_fits_and_the_planner_agrees():
    """A bf16-true tiny LLaMA (8.3 M parameters, mostly its embedding and head) at 3 B/param + 4 MiB,
    planned as AutoFit plans with SGD (the Trainer's precision kept, ``compensate=False``): every plan
    holds 4 B/param of weights and gradients and is refused (SGD at micro-batch 1: 3 B/param + 12.9 MiB);
    the refusal names FusedOptimizerStep, which holds no whole gradient, with its leanest plan's peak (SGD
    at micro-batch 2: 3 B/param + 3.95 MiB), and plan_fit(lever='fused_step') plans it. It named a larger
    card (or host memory) instead."""
    with torch.device("meta"):
        module = _CausalLM(vocab_size=32_000, hidden_size=128)
    n = sum(p.numel() for p in module.parameters())
    tokens = torch.zeros(2, 16, dtype=torch.long)
    batch, limit = {"input_ids": tokens, "labels": tokens}, 3 * n + 4 * 2**20
    run = dict(
        margin=0.0, optimizers=["sgd"], precision="bf16-true", compensate=False, cost="flops", device="cpu"
    )
    with pytest.raises(ValueError, match="No plan fits") as refused:
        plan_fit(module, batch, limit, **run)
    named = re.search(
        r"What would fit: FusedOptimizerStep\(\) \(plan_fit's lever='fused_step'\): its leanest plan, "
        r"micro-batch 2, none checkpointing, sgd, bf16-true, peaks at ([\d.]+) MiB; or ",
        str(refused.value),
    )
    assert named is not None, str(refused.value)
    assert float(named.group(1)) * 2**20 <= limit
    fused = plan_fit(module, batch, limit, lever="fused_step", **run)  # the planner agrees
    assert fused.lever == "fused_step" and fused.estimated_peak <= limit
    with pytest.raises(ValueError) as nothing:  # no lever fits half of it: none is named
        plan_fit(module, batch, limit // 2, **run)
    assert "plan_fit's" not in str(nothing.value)
