"""A fitted plan as the code a user pastes: the Trainer with ``AutoFit`` that makes it as the fit starts,
and the same set by hand (callbacks, optimizer, precision, an FSDP2 layout in ``configure_model``).

`explain_oom` and ``memkit estimate`` print it under each plan that fits; ``memkit plan`` prints it whole
(`plan_code`).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping, Sequence

from lightning.pytorch import LightningModule
from torch import nn

from lightning_memkit._breakdown import format_bytes
from lightning_memkit._budget import GPUS, Budget, parse_budget
from lightning_memkit._checkpointing.blocks import find_blocks
from lightning_memkit._checkpointing.policies import CHECKPOINT_MODES
from lightning_memkit._estimating.analytic import SHARD_GRAD_OP
from lightning_memkit._fitting.plan import FitPlan
from lightning_memkit._optimizers.swap import (
    COMPENSATED,
    DEFAULT_CANDIDATES,
    KAHAN,
    configured_optimizer,
    constructor,
    constructor_arguments,
    identify,
)
from lightning_memkit._sharding import layout as _layout

__all__ = [
    "autofit_code",
    "by_hand_code",
    "by_the_strategy",
    "fsdp2_layout",
    "lever_callbacks",
    "optimizer_code",
    "plan_code",
    "size_text",
]


def plan_code(
    plan: FitPlan,
    model: nn.Module,
    *,
    global_batch: int,
    optimizers: Sequence[str | None] | None,
) -> str:
    """The plan as Python a user pastes: the Trainer with ``AutoFit``, which makes this plan as the fit
    starts (`autofit_code`), then the same set by hand (`by_hand_code`). ``optimizers`` are the candidates
    planned, if given (``--optimizer``). The callback that changes the step the plan was made for
    (`FitPlan.lever_callback`, ``"FusedOptimizerStep"``) is in both Trainers."""
    named = plan.budget.source in GPUS
    fsdp2 = by_the_strategy(plan)
    planner = "AutoFitStrategy" if fsdp2 else "AutoFit"
    strategy = "ModelParallelStrategy" if fsdp2 else "FSDPStrategy" if plan.strategy == SHARD_GRAD_OP else ""
    imports = sorted({planner, *(c.split("(")[0] for c in lever_callbacks(plan))})
    card = f"#    The budget is what a {plan.budget.source} card leaves after the CUDA context and reserve."
    if _budget_argument(plan.budget) == '"auto"':  # a card by its size, as it reads on the run's device
        card = (
            f'#    budget="auto" reads the card the run is on: a {plan.budget.source} card leaves '
            f"{format_bytes(plan.budget.usable)} after the CUDA context and reserve."
        )
    named = named or plan.budget.usable == plan.budget.total  # a plain limit: nothing was taken off
    per_gpu = global_batch // plan.data_parallel_size  # a tensor-parallel group shares its batch
    return "\n".join(
        [
            "from lightning.pytorch import Trainer",
            *([f"from lightning.pytorch.strategies import {strategy}"] if strategy else []),
            f"from lightning_memkit import {', '.join(imports)}",
            "",
            *_autofit_section(plan, optimizers, per_gpu, [] if named else [card]),
            *([fsdp2_layout(plan, model)] if fsdp2 else []),
            *by_hand_code(plan, model),
        ]
    )


def _autofit_section(
    plan: FitPlan, optimizers: Sequence[str | None] | None, per_gpu: int, card: list[str]
) -> list[str]:
    fsdp2 = by_the_strategy(plan)
    first = (
        ["# 1. AutoFitStrategy makes this plan as fit starts (rank 0, broadcast), shards the model as",
         "#    planned and reads batch_size (module or DataModule) as the"]
        if fsdp2
        else ["# 1. AutoFit makes this plan as fit starts, reading batch_size (module or DataModule) as the"]
    )  # fmt: skip
    return [
        *first,
        f"#    global batch per GPU, here {per_gpu}; it sets micro-batch and accumulation itself.",
        *card,
        autofit_code(plan, optimizers=optimizers),
        "",
        "# 2. Or by hand: batch_size is the micro-batch, the DataLoader's batch size.",
    ]


def autofit_code(plan: FitPlan, *, optimizers: Sequence[str | None] | None) -> str:
    """``trainer = Trainer(...)`` with the ``AutoFit`` that makes ``plan``: its budget (a GPU by name; a
    size as the step's limit, which is what AutoFit reads it as), margin and optimizer candidates."""
    autofit = {"budget": _budget_argument(plan.budget)}
    if plan.margin != 0.1:
        autofit["margin"] = repr(plan.margin)
    if plan.optimizer in KAHAN:  # AutoFit plans them only when named (it keeps the Trainer's optimizer)
        kahan = dict.fromkeys(COMPENSATED.get(o) for o in (optimizers or DEFAULT_CANDIDATES))
        autofit["optimizers"] = json.dumps([o for o in kahan if o is not None])
    elif optimizers is not None:
        autofit["optimizers"] = json.dumps(list(optimizers))
    levers = [f"{plan.lever_callback}()"] if plan.lever else []
    if by_the_strategy(plan):  # the strategy plans: no AutoFit callback
        if plan.tensor_parallel_size > 1 or plan.replicate_size > 1:  # the layout it planned, given
            autofit |= _layout_arguments(plan)
        arguments = {**_trainer_arguments(plan), "strategy": f"AutoFitStrategy({_arguments(autofit)})"}
        return _call(
            "trainer = Trainer", arguments | ({"callbacks": f"[{', '.join(levers)}]"} if levers else {})
        )
    callbacks = [f"AutoFit({_arguments(autofit)})", *levers]
    return _call("trainer = Trainer", {**_trainer_arguments(plan), "callbacks": f"[{', '.join(callbacks)}]"})


def by_hand_code(plan: FitPlan, model: nn.Module) -> list[str]:
    """``plan`` set by hand, as lines: the micro-batch (the DataLoader's batch size), the Trainer's
    arguments, checkpointing as a callback (its mode, or the step's limit when the blocks' modes differ:
    ActivationCheckpointing then plans the split) and the plan's optimizer, built in
    ``configure_optimizers`` (`optimizer_code`)."""
    by_hand = {"accumulate_grad_batches": str(plan.accumulate_grad_batches), **_trainer_arguments(plan)}
    levers = lever_callbacks(plan)
    if levers:
        by_hand["callbacks"] = f"[{', '.join(levers)}]"
    lines = [f"batch_size = {plan.micro_batch_size}", _call("trainer = Trainer", by_hand)]
    if plan.compile_budget is not None:  # set before the model is compiled, for the whole process
        lines[1:1] = [
            f"torch._functorch.config.activation_memory_budget = {plan.compile_budget:g}",
            "#    torch.compile's partitioner then keeps that share of the activations (before compiling).",
        ]
    elif plan.checkpointing not in CHECKPOINT_MODES and _sharded(plan):
        lines.append(
            f"#    The plan checkpoints block by block ({plan.checkpointing}); under {plan.strategy} "
            f"every block gets {_strongest(plan)}: it fits too, for more recompute."
        )
    elif plan.checkpointing not in CHECKPOINT_MODES:
        lines.append(
            f"#    Checkpointing block by block ({plan.checkpointing}), planned for the step's limit."
        )
    return lines + optimizer_code(plan, model)


def optimizer_code(plan: FitPlan, model: nn.Module) -> list[str]:
    """``configure_optimizers`` building ``plan``'s optimizer where the module builds another: the
    catalogue's class (`constructor`: ``bitsandbytes.optim.AdamW8bit``) over ``self.parameters()``, with the
    module's hyper-parameters translated as `swap_optimizer` translates them; a plain ``nn.Module`` (the
    CLI's presets) is planned as trained with AdamW, so only another optimizer is written, from AdamW's
    defaults. What the lines leave out (param groups, a scheduler) is said under them."""
    configured, more = configured_optimizer(model)
    own = None if configured is None else identify(configured)
    lightning = isinstance(model, LightningModule)
    if plan.optimizer is None or plan.optimizer == (own if lightning else "adamw"):
        return []
    path = constructor(plan.optimizer)
    kwargs = constructor_arguments(plan.optimizer, configured if own is not None else None)
    arguments = ["self.parameters()", *(f"{k}={v!r}" for k, v in kwargs.items())]
    call = f"    return {path}({', '.join(arguments)})"
    if len(call) > 100:
        call = "\n".join([f"    return {path}(", *(f"        {a}," for a in arguments), "    )"])
    was = own or ("the configured one" if lightning else "AdamW")
    where = f"{own}'s lr and decay kept" if own is not None else "AdamW's default lr: give yours"
    lines = [
        f"# The plan's optimizer in your LightningModule: {plan.optimizer} in place of {was} ({where}):",
        "def configure_optimizers(self):",
        f"    import {path.split('.')[0]}",
        call,
    ]
    groups = len(configured.param_groups) if configured is not None else 1
    if groups > 1 or more:
        yours = " and ".join([f"{groups} param groups"] * (groups > 1) + ["learning-rate scheduler"] * more)
        lines += [
            f"#    To keep your {yours}, build the optimizer as before, then",
            f"#    optimizer = lightning_memkit.swap_optimizer(optimizer, {json.dumps(plan.optimizer)}).",
        ]
    return lines


def lever_callbacks(plan: FitPlan) -> list[str]:
    """The callbacks that set ``plan``'s step by hand: its lever, then checkpointing. ActivationCheckpointing
    plans a budget on the unsharded step (and refuses to under FSDP): with a sharded strategy a per-block
    plan is written as its strongest mode on every block, which fits too."""
    levers = [f"{plan.lever_callback}()"] if plan.lever else []
    if plan.compile_budget is not None:  # torch's configuration, not a callback (`by_hand_code`)
        return levers
    if plan.checkpointing not in CHECKPOINT_MODES and not _sharded(plan):  # no one mode names it
        levers.append(f"ActivationCheckpointing(budget={json.dumps(size_text(plan.limit))})")
    elif plan.checkpointing != "none":
        levers.append(f"ActivationCheckpointing(checkpointing={json.dumps(_strongest(plan))})")
    return levers


def _budget_argument(budget: Budget) -> str:
    """``budget`` as a user writes it, in a form AutoFit reads as the same budget: a GPU by name; a card
    read from the device (``"auto"``, a fraction) as that; a card given by its size (``--gpu 24GB``) by
    name where a GPU has that size, else ``"auto"``, which reads the card the run is on; a size that is the
    step's limit as given (``"40MB"``), and bytes as given (``40_000_000``). A budget made of figures (an
    OOM report's "this step's need") as a size (`size_text`)."""
    source = budget.source
    if source in GPUS or source.startswith("cuda:"):  # a name; "cuda:0" ("auto"), "cuda:0 x 0.9"
        return json.dumps(source) if source in GPUS else source.partition(" x ")[2] or '"auto"'
    if source == f"{budget.usable} bytes":
        return f"{budget.usable:_}"
    with contextlib.suppress(TypeError, ValueError):
        if parse_budget(source) == budget:
            return json.dumps(source)
        if parse_budget(source, device_size=True) == budget:  # a card by its size
            same = [name for name, mib in GPUS.items() if mib * 2**20 == budget.total]
            return json.dumps(same[0] if same else "auto")
    return json.dumps(size_text(budget.usable))


def size_text(nbytes: int) -> str:
    """``nbytes`` as a size string `parse_bytes` reads back: exact in the largest unit that divides it
    (``"9MiB"``, ``"36MB"``), else in MB (kB below 100 MB) rounded down, less than 0.1 % under it."""
    for unit, size in (("GiB", 2**30), ("GB", 10**9), ("MiB", 2**20), ("MB", 10**6), ("KiB", 2**10)):
        if nbytes >= size and nbytes % size == 0:
            return f"{nbytes // size}{unit}"
    unit, size = ("MB", 10**6) if nbytes >= 10**8 else ("kB", 10**3) if nbytes >= 10**5 else ("B", 1)
    return f"{nbytes // size}{unit}"


def _strongest(plan: FitPlan) -> str:
    """The strongest checkpointing mode ``plan`` gives a block (a per-block label, "2 selective, 2 full",
    is read when the plan has no `CheckpointPlan`)."""
    if plan.checkpoint_plan is not None:
        modes = list(plan.checkpoint_plan.modes.values())
    else:
        modes = [part.split()[-1] for part in plan.checkpointing.split(", ")]
    return max(modes, key=CHECKPOINT_MODES.index)


def _sharded(plan: FitPlan) -> bool:
    return plan.world_size > 1 and plan.strategy != "ddp"


def by_the_strategy(plan: FitPlan) -> bool:
    """Whether ``plan`` is `AutoFitStrategy`'s to make (FSDP2 over several ranks), not AutoFit's."""
    return plan.world_size > 1 and plan.strategy == "fsdp2"


def _trainer_arguments(plan: FitPlan) -> dict[str, str]:
    trainer = {"precision": json.dumps(plan.precision)}
    if plan.device == "cpu":
        trainer = {"accelerator": '"cpu"', **trainer}
    if by_the_strategy(plan):
        dp, tp = plan.data_parallel_size, plan.tensor_parallel_size
        strategy = f"ModelParallelStrategy(data_parallel_size={dp}, tensor_parallel_size={tp})"
        trainer |= {"strategy": strategy, "devices": str(plan.world_size)}
    elif plan.strategy == SHARD_GRAD_OP:  # FSDPStrategy's, which Lightning's registry does not name
        strategy = 'FSDPStrategy(sharding_strategy="SHARD_GRAD_OP")'
        trainer |= {"strategy": strategy, "devices": str(plan.world_size)}
    elif plan.world_size > 1:
        trainer |= {"strategy": json.dumps(plan.strategy), "devices": str(plan.world_size)}
    return trainer


def _layout_arguments(plan: FitPlan) -> dict[str, str]:
    """`AutoFitStrategy`'s arguments for ``plan``'s layout: its tensor-parallel degree, and the data-parallel
    ranks as a number or HSDP's ``(replicate, shard)``."""
    dp, replicas = plan.data_parallel_size, plan.replicate_size
    data = f"({replicas}, {dp // replicas})" if replicas > 1 else str(dp)
    return {"tensor_parallel_size": str(plan.tensor_parallel_size), "data_parallel_size": data}


def fsdp2_layout(plan: FitPlan, model: nn.Module | None = None) -> str:
    """The layout ``plan`` simulated, as a comment for the LightningModule (`plan_code`, by hand:
    AutoFitStrategy applies it itself): tensor parallel first where it has it (torchtitan's plan, by
    ``model``'s projection names), then FSDP2 on each repeated block and the model, over the data-parallel
    ranks or HSDP's (replicate, shard) mesh."""
    option = "" if plan.reshard_after_forward in (None, True) else ", reshard_after_forward=False"
    names = ["fully_shard"]
    if plan.cpu_offload:
        option += ", offload_policy=CPUOffloadPolicy()"
        names.append("CPUOffloadPolicy")
    policy = []
    if plan.mp_policy:
        option += ", mp_policy=policy"
        names.append("MixedPrecisionPolicy")
        policy.append("policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)")
    lines = []
    tp, replicas = plan.tensor_parallel_size, plan.replicate_size
    imports = [f"from torch.distributed.fsdp import {', '.join(sorted(names))}"]
    mesh, tp_mesh = 'self.device_mesh["data_parallel"]', 'self.device_mesh["tensor_parallel"]'
    if replicas > 1:  # HSDP: its own mesh, the tensor-parallel ranks innermost as Lightning's
        imports.append("from torch.distributed.device_mesh import init_device_mesh")
        shape = (replicas, plan.data_parallel_size // replicas, *((tp,) if tp > 1 else ()))
        dims = ("replicate", "shard", *(("tensor_parallel",) if tp > 1 else ()))
        device = "cpu" if plan.device == "cpu" else "cuda"
        names_ = ", ".join(f'"{dim}"' for dim in dims)
        mesh = f'init_device_mesh("{device}", {shape}, mesh_dim_names=({names_}))'
        if tp > 1:
            lines.append(f"hsdp = {mesh}")
            mesh, tp_mesh = 'hsdp["replicate", "shard"]', 'hsdp["tensor_parallel"]'
    lines += [f"mesh = {mesh}", *policy]
    if tp > 1:
        parallel = "ColwiseParallel, RowwiseParallel, parallelize_module"
        imports.append(f"from torch.distributed.tensor.parallel import {parallel}")
        lines += [
            "plan = {  # torchtitan's LLaMA plan: split by output features, then by input features",
            *(f'    "{name}": {style}(),' for name, style in _tp_styles(model)),
            "}",
            "for layer in self.model.layers:  # your blocks, e.g. a Hugging Face model's model.model.layers",
            f"    parallelize_module(layer, {tp_mesh}, plan)",
        ]
    lines += [
        "for layer in self.model.layers:  # your blocks, e.g. a Hugging Face model's model.model.layers",
        f"    fully_shard(layer, mesh=mesh{option})",
        f"fully_shard(self.model, mesh=mesh{option})  # the module training_step calls",
    ]
    what = "FSDP2" if tp == replicas == 1 else plan.layout
    order = "each repeated block, then the model"
    if tp > 1:
        order = f"\n# tensor parallel in each repeated block, then FSDP2 on {order}"
    body = "\n".join(f"#         {line}" for line in [*imports, *lines])
    return f"""\
# {what} as the plan simulated it, in your LightningModule ({order}):
#     def configure_model(self):
{body}"""


def _tp_styles(model: nn.Module | None) -> list[tuple[str, str]]:
    """Each projection torchtitan's plan splits in a block of ``model`` (`tp_plan`), by its name in the
    block, with its style's class name; Hugging Face LLaMA's names where no block has them."""
    blocks = [name for name, _ in find_blocks(model)] if model is not None else []
    styles: dict[str, str] = {}
    for name, style in (_layout.tp_plan(model, blocks) if blocks else {}).items():
        block = next(b for b in blocks if name.startswith(f"{b}."))
        styles.setdefault(name[len(block) + 1 :], type(style).__name__)
    if styles:
        return list(styles.items())
    colwise = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"]
    return [(n, "ColwiseParallel") for n in colwise] + [
        ("self_attn.o_proj", "RowwiseParallel"),
        ("mlp.down_proj", "RowwiseParallel"),
    ]


def _arguments(kwargs: Mapping[str, str]) -> str:
    return ", ".join(f"{k}={v}" for k, v in kwargs.items())


def _call(head: str, kwargs: Mapping[str, str]) -> str:
    """``head(k=v, ...)`` on one line, or one argument a line when that is over 100 characters."""
    one_line = f"{head}({_arguments(kwargs)})"
    if len(one_line) <= 100:
        return one_line
    return "\n".join([f"{head}(", *(f"    {k}={v}," for k, v in kwargs.items()), ")"])
