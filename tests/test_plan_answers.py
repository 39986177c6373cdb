"""Answers that are code, and answers that do not depend on the machine (issue 46, items 6 to 8).

The code a plan prints (`plan_code`: ``memkit plan``, the OOM report) is executed here and must build what
was planned: the optimizer (not a comment) and the budget as a user writes it. ``advise``'s chunked loss
for a Hugging Face causal LM, run as written, must be the model's own loss. A plan must be the same on a
machine 100x slower, and a refusal must name the step lever that would fit.
"""

from __future__ import annotations

import re

import lightning.pytorch as pl
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import lightning_memkit
from lightning_memkit import AutoFit, FitPlan, advise, parse_budget
from lightning_memkit._diagnosis.advise import _chunked_loss
from lightning_memkit._diagnosis.oom import plan_code
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
    def __init__(self):
        super().__init__()
        config = AutoConfig.for_model(
            "llama", vocab_size=1024, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, use_cache=False,
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
    """The logits finding's fix for a Hugging Face causal LM (`_chunked_loss`), executed as written,
    computes the loss the model computes: labels shifted as the model shifts them, the head from
    ``get_output_embeddings()``. Followed literally it trained another objective (the unshifted labels)."""
    module, batch = _CausalLM(), _batch()
    fix = _chunked_loss(module, "model.lm_head")
    assert "self.model.get_output_embeddings()" in fix and "LlamaForCausalLM shifts them" in fix
    loss = _advised_loss(module, fix, batch)
    torch.testing.assert_close(loss, module.model(**batch).loss)
    loss.backward()  # and it trains: every parameter the model's loss reaches gets a gradient
    assert all(p.grad is not None for p in module.parameters())


@pytest.mark.slow  # three simulated steps of a Hugging Face model: about 5 s on 2 busy cores
def test_advise_gives_the_chunked_loss_that_is_the_models_own():
    module, batch = _CausalLM(), _batch()
    fix = advise(module, batch, device="cpu")["logits"].fix
    torch.testing.assert_close(_advised_loss(module, fix, batch), module.model(**batch).loss)
