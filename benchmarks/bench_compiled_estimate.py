"""The estimate of a torch.compile'd step against the real one (issue 26 item 7), CPU, steady step.

For each model: compiled (inductor), its third real step measured with `measure` (which follows a compiled
step buffer by buffer, to the CPU allocator's count: tests/measuring/test_compiled.py), and `estimate_memory`
of the same step, simulated as inductor runs it (`lightning_memkit/_estimating/compiled.py`: the code inductor
generates, its kernels stubbed). The eager simulation of the same model is printed beside, as the estimate
was before any compiled simulation. Then the zoo's LLaMA at torch.compile activation budgets below the
configured one, which `ActivationCheckpointing(budget=)` plans with (`_checkpointing/compiled.py`), and
three byte budgets below the compiled LLaMA's step planned so, each plan's peak against its real step.

    python benchmarks/bench_compiled_estimate.py            # the table (docs/models.md)
    python benchmarks/bench_compiled_estimate.py llama bert # some rows
    python benchmarks/bench_compiled_estimate.py --fit      # AutoFit's search's rows only
"""

from __future__ import annotations

import logging
import sys
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # helpers, models
from models import CNN
from zoo import ZOO, zoo_batch

from lightning_memkit import estimate_memory, measure, plan_checkpointing, plan_fit

#: name -> (zoo model, batch size, sequence length)
ROWS = {
    "llama": ("compiled_llama", 8, 32),
    "qwen2": ("qwen2", 4, 32),
    "gpt_neox": ("gpt_neox", 4, 32),
    "t5": ("t5", 4, 32),
    "whisper": ("whisper", 4, 32),
    "bert": ("bert", 4, 32),
    "vit": ("vit", 4, 32),
    "gpt2": ("gpt2", 4, 32),
    "cnn": ("cnn", 8, 0),
}
#: (batch size, sequence length, activation budget) of the zoo's LLaMA below the configured budget
BUDGETS = ((8, 32, 0.5), (8, 32, 0.3), (8, 32, 0.1), (1, 256, 0.984), (1, 256, 0.5))
#: byte budgets planned for the zoo's compiled LLaMA (batch 8 x 32), as shares of its compiled step's peak
PLANNED = (0.95, 0.78, 0.7)
#: limits `plan_fit` (AutoFit's search) plans the same step for, global batch 8, as shares of its peak
FITTED = (0.95, 0.8, 0.6)


class _Loss(nn.Module):
    """The model's loss on a batch (dict for Hugging Face's, (images, labels) for the CNN)."""

    def __init__(self, model: nn.Module, kind: str) -> None:
        super().__init__()
        self.model, self.kind = model, kind

    def forward(self, batch: object) -> torch.Tensor:
        if self.kind == "cnn":
            images, labels = batch
            return nn.functional.cross_entropy(self.model(images), labels)
        return self.model(**batch).loss


def _model(name: str, batch_size: int, seq_len: int) -> tuple[nn.Module, object, nn.Module]:
    """(the compiled loss module, its batch, the same model uncompiled)."""
    torch.manual_seed(0)
    if name == "cnn":
        g = torch.Generator().manual_seed(0)
        batch = (
            torch.randn(batch_size, 3, 32, 32, generator=g),
            torch.randint(0, 10, (batch_size,), generator=g),
        )
        eager = _Loss(CNN(), "cnn")
        torch.manual_seed(0)
        compiled = _Loss(CNN(), "cnn")
        compiled.model.compile()
        return compiled, batch, eager
    factory = ZOO[ROWS[name][0]][0]
    batch = zoo_batch(ROWS[name][0], batch_size, seq_len)
    eager = _Loss(factory(), "hf")
    torch.manual_seed(0)
    return _Loss(torch.compile(factory()), "hf"), batch, eager


def _loss(out: torch.Tensor, _: object) -> torch.Tensor:
    return out  # the module returns its loss


def _estimate(model: nn.Module, batch: object, budget: float | None = None) -> int:
    options = {} if budget is None else {"compile_budget": budget}
    return estimate_memory(
        model, (batch, None), optimizer="adamw", loss_fn=_loss, device="cpu", **options
    ).peak


def _real(model: nn.Module, batch: object) -> int:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(3):
        with measure(model, optimizer, batch=batch) as m:
            model(batch).backward()
            optimizer.step()
            optimizer.zero_grad()
    return m.breakdown.peak


def row(name: str) -> str:
    _, batch_size, seq_len = ROWS[name]
    compiled, batch, eager = _model(name, batch_size, seq_len)
    estimate, before = _estimate(compiled, batch), _estimate(eager, batch)
    real = _real(compiled, batch)
    return f"| {name} | {batch_size} | {real:,} | {estimate / real - 1:+.3%} | {before / real - 1:+.3%} |"


def _uncached() -> None:
    """Nothing cached from one activation budget's compile to the next: each budget compiled afresh."""
    torch._functorch.config.enable_autograd_cache = False
    torch._inductor.config.fx_graph_cache = False


def budget_row(batch_size: int, seq_len: int, budget: float) -> str:
    _uncached()
    compiled, batch, _ = _model("llama", batch_size, seq_len)
    estimate = _estimate(compiled, batch, budget)
    real = _real_at(compiled, batch, budget)
    return f"| {batch_size} x {seq_len} | {budget:g} | {real:,} | {estimate / real - 1:+.3%} |"


def _planned_llama() -> tuple[nn.Module, object, int]:
    """The zoo's LLaMA compiled (batch 8 x 32) for a plan, with its compiled step's estimated peak."""
    _uncached()
    compiled, batch, _ = _model("llama", 8, 32)
    return compiled, batch, _estimate(compiled, batch)


def _real_at(compiled: nn.Module, batch: object, budget: float | None) -> int:
    """The real step at torch.compile's activation budget ``budget`` (``None``: as configured, 1.0),
    compiled afresh."""
    torch._dynamo.reset()
    with torch._functorch.config.patch(activation_memory_budget=1.0 if budget is None else budget):
        return _real(compiled, batch)


def plan_row(share: float) -> str:
    """`plan_checkpointing` for a byte budget below the compiled step: the activation budget it sets, the
    step it plans, and the real step run with that activation budget."""
    compiled, batch, full = _planned_llama()
    budget = int(full * share)
    try:
        plan = plan_checkpointing(
            compiled, (batch, None), budget, optimizer="adamw", loss_fn=_loss, device="cpu"
        )
    except ValueError as refused:  # below every activation budget's step
        return f"| {share:g} x {full:,} = {budget:,} | refused: {str(refused)[:60]}... | | | |"
    real = _real_at(compiled, batch, plan.compile_budget)
    return (
        f"| {share:g} x {full:,} = {budget:,} | {plan.compile_budget} | {plan.peak:,} | {real:,} | "
        f"{plan.peak / real - 1:+.3%} |"
    )


def fit_row(share: float) -> str:
    """`plan_fit` (AutoFit's search, FLOPs cost) for a limit below the compiled step at global batch 8: the
    micro-batch and activation budget it plans, and, where it does not accumulate, the real step run so."""
    compiled, batch, full = _planned_llama()
    limit = int(full * share)
    plan = plan_fit(
        compiled, (batch, None), budget=int(limit / 0.9), optimizers=("adamw",), loss_fn=_loss,
        device="cpu", cost="flops",
    )  # fmt: skip
    m, accumulate = plan.micro_batch_size, plan.accumulate_grad_batches
    head = f"| {share:g} x {full:,} = {plan.limit:,} | {m} x {accumulate} | {plan.checkpointing} | "
    head += f"{plan.estimated_peak:,} | "
    if plan.accumulate_grad_batches > 1:
        return head + "(accumulates: not run) | |"
    real = _real_at(compiled, batch, plan.checkpoint_plan.compile_budget if plan.checkpoint_plan else None)
    return head + f"{real:,} | {plan.estimated_peak / real - 1:+.3%} |"


#: the tables printed after the models' (all of them): each one's header, its rows' function and arguments
TABLES = {
    "budgets": (
        "| LLaMA batch x tokens | activation budget | real peak (B) | estimate |\n|---|---:|---:|---:|",
        budget_row, BUDGETS,
    ),
    "planned": (
        "| byte budget (B) | activation budget planned | planned peak (B) | real peak (B) | plan |\n"
        "|---|---:|---:|---:|---:|",
        plan_row, [(share,) for share in PLANNED],
    ),
    "fit": (
        "| limit (B) | micro-batch x accumulate | checkpointing | planned (B) | real peak (B) | plan |\n"
        "|---|---:|---|---:|---:|---:|",
        fit_row, [(share,) for share in FITTED],
    ),
}  # fmt: skip


def table(header: str, make: Callable[..., str], rows: Iterable[tuple]) -> list[str]:
    """The table's lines, each row printed to stderr as it is made (a run takes minutes)."""
    lines = [header]
    for args in rows:
        lines.append(make(*args))
        print(lines[-1], file=sys.stderr, flush=True)
    return lines


def main(names: list[str]) -> None:
    header = "| model | batch | real peak (B) | estimate | eager simulation |\n|---|---:|---:|---:|---:|"
    lines = table(header, row, [(name,) for name in names])
    if names == list(ROWS):
        for name in TABLES:
            lines += ["", *table(*TABLES[name])]
    print("\n".join(lines))


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning_memkit").setLevel(logging.ERROR)
    if sys.argv[1:] == ["--fit"]:
        sys.exit(print("\n".join(table(*TABLES["fit"]))))
    unknown = [name for name in sys.argv[1:] if name not in ROWS]
    if unknown:
        sys.exit(f"Unknown model {', '.join(unknown)}; choose from {', '.join(ROWS)}")
    main(sys.argv[1:] or list(ROWS))
