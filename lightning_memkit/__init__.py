"""lightning_memkit: make training memory visible, and make runs fit a memory budget.

Public surface (everything else lives in private modules):

- `MemoryBreakdown`: a step's peak memory by category, in bytes; `measure`: measure one training step
  of any model and optimizer; `estimate_memory`: the same breakdown for a step simulated on fake tensors,
  before any memory is spent. `Step` (with `Sharding`): how a step runs, as one value the estimating,
  advising and fitting functions take as ``step=``.
- Callbacks: `MemoryMonitor` (log every step's breakdown), `ActivationCheckpointing` (the cheapest
  checkpointing plan that fits a budget), `OptimizerSwap` (the best optimizer that fits), `AutoFit`
  (micro-batch, accumulation, checkpointing and optimizer for a GPU size), `GradientRelease` (free the
  gradients once the optimizer has stepped: the next forward runs without them), `FusedOptimizerStep`
  (step each parameter inside backward: no step holds all the gradients), `OptimizerOffload` (the
  optimizer's state, fp32 master weights and gradient accumulation in host memory).
- The plain functions behind them: `plan_checkpointing` / `apply_checkpointing`, `fit_optimizer` /
  `swap_optimizer`, `plan_fit`, `release_gradients`, `fuse_optimizer_step`, `offload_optimizer`;
  `largest_micro_batch`: the largest micro-batch a budget holds, any whole number (`BatchLimit`).
- `advise`: the memory a step holds at its peak that it need not, each finding with the bytes its fix
  saves and the fix (`Advice`, `Finding`); `chunked_cross_entropy`: a loss that never holds the whole
  batch's logits.
- `parse_bytes`, `parse_budget`: read a memory size (``"24GB"``) or a budget (``"A100-40GB"``, ``0.9``).
- `lightning_memkit.demos.gpt`: the bundled nanoGPT-style example.

The names are imported on first use (PEP 562): ``import lightning_memkit`` alone imports neither torch nor
Lightning, so the ``memkit`` command answers ``--help`` at once; ``from lightning_memkit import X`` and
``lightning_memkit.X`` import X's module then.
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what type checkers and docs read; at run time `__getattr__` imports each on first use
    from lightning_memkit._breakdown import CATEGORIES, MemoryBreakdown, format_bytes
    from lightning_memkit._budget import GPUS, Budget, parse_budget, parse_bytes
    from lightning_memkit._checkpointing.blocks import find_blocks
    from lightning_memkit._checkpointing.planner import plan_checkpointing
    from lightning_memkit._checkpointing.policies import (
        CHECKPOINT_MODES,
        BlockPlan,
        CheckpointMode,
        CheckpointPlan,
        apply_checkpointing,
    )
    from lightning_memkit._diagnosis.advise import Advice, Finding, advise
    from lightning_memkit._diagnosis.snapshot import memory_snapshot
    from lightning_memkit._estimating.fake_tracker import TimelineEvent
    from lightning_memkit._estimating.simulate import estimate_memory
    from lightning_memkit._fitting.layouts import Layouts
    from lightning_memkit._fitting.limits import BatchLimit, largest_micro_batch
    from lightning_memkit._fitting.plan import Alternative, FitPlan, StepCost
    from lightning_memkit._fitting.search import plan_fit
    from lightning_memkit._levers.chunked_loss import chunked_cross_entropy
    from lightning_memkit._levers.fused_step import FusedStep, fuse_optimizer_step
    from lightning_memkit._levers.gradient_release import release_gradients
    from lightning_memkit._levers.offload import Offload, offload_optimizer
    from lightning_memkit._measuring.measurement import MemoryMeasurement, measure
    from lightning_memkit._measuring.storages import storage_bytes
    from lightning_memkit._optimizers.choice import OptimizerChoice, fit_optimizer
    from lightning_memkit._optimizers.swap import CATALOGUE, swap_optimizer
    from lightning_memkit._sharding.layout import ConfigureModel
    from lightning_memkit._step import Sharding, Step
    from lightning_memkit.callbacks import (
        ActivationCheckpointing,
        AutoFit,
        FusedOptimizerStep,
        GradientRelease,
        MemoryMonitor,
        OptimizerOffload,
        OptimizerSwap,
    )
    from lightning_memkit.strategies import AutoFitStrategy

__version__ = "0.1.0"

__all__ = [
    "CATALOGUE",
    "CATEGORIES",
    "CHECKPOINT_MODES",
    "GPUS",
    "ActivationCheckpointing",
    "Advice",
    "Alternative",
    "AutoFit",
    "AutoFitStrategy",
    "BatchLimit",
    "BlockPlan",
    "Budget",
    "CheckpointMode",
    "CheckpointPlan",
    "ConfigureModel",
    "Finding",
    "FitPlan",
    "FusedOptimizerStep",
    "FusedStep",
    "GradientRelease",
    "Layouts",
    "MemoryBreakdown",
    "MemoryMeasurement",
    "MemoryMonitor",
    "Offload",
    "OptimizerChoice",
    "OptimizerOffload",
    "OptimizerSwap",
    "Sharding",
    "Step",
    "StepCost",
    "TimelineEvent",
    "__version__",
    "advise",
    "apply_checkpointing",
    "chunked_cross_entropy",
    "estimate_memory",
    "find_blocks",
    "fit_optimizer",
    "format_bytes",
    "fuse_optimizer_step",
    "largest_micro_batch",
    "measure",
    "memory_snapshot",
    "offload_optimizer",
    "parse_budget",
    "parse_bytes",
    "plan_checkpointing",
    "plan_fit",
    "release_gradients",
    "storage_bytes",
    "swap_optimizer",
]

#: Each public name -> the module it is imported from on first use.
_EXPORTS: dict[str, str] = {
    "Advice": "lightning_memkit._diagnosis.advise",
    "Finding": "lightning_memkit._diagnosis.advise",
    "advise": "lightning_memkit._diagnosis.advise",
    "memory_snapshot": "lightning_memkit._diagnosis.snapshot",
    "plan_fit": "lightning_memkit._fitting.search",
    "largest_micro_batch": "lightning_memkit._fitting.limits",
    "BatchLimit": "lightning_memkit._fitting.limits",
    "find_blocks": "lightning_memkit._checkpointing.blocks",
    "CATEGORIES": "lightning_memkit._breakdown",
    "MemoryBreakdown": "lightning_memkit._breakdown",
    "format_bytes": "lightning_memkit._breakdown",
    "Budget": "lightning_memkit._budget",
    "GPUS": "lightning_memkit._budget",
    "parse_budget": "lightning_memkit._budget",
    "parse_bytes": "lightning_memkit._budget",
    "plan_checkpointing": "lightning_memkit._checkpointing.planner",
    "BlockPlan": "lightning_memkit._checkpointing.policies",
    "CHECKPOINT_MODES": "lightning_memkit._checkpointing.policies",
    "CheckpointMode": "lightning_memkit._checkpointing.policies",
    "CheckpointPlan": "lightning_memkit._checkpointing.policies",
    "apply_checkpointing": "lightning_memkit._checkpointing.policies",
    "chunked_cross_entropy": "lightning_memkit._levers.chunked_loss",
    "Alternative": "lightning_memkit._fitting.plan",
    "FitPlan": "lightning_memkit._fitting.plan",
    "StepCost": "lightning_memkit._fitting.plan",
    "Layouts": "lightning_memkit._fitting.layouts",
    "FusedStep": "lightning_memkit._levers.fused_step",
    "fuse_optimizer_step": "lightning_memkit._levers.fused_step",
    "release_gradients": "lightning_memkit._levers.gradient_release",
    "MemoryMeasurement": "lightning_memkit._measuring.measurement",
    "measure": "lightning_memkit._measuring.measurement",
    "storage_bytes": "lightning_memkit._measuring.storages",
    "Offload": "lightning_memkit._levers.offload",
    "offload_optimizer": "lightning_memkit._levers.offload",
    "OptimizerChoice": "lightning_memkit._optimizers.choice",
    "fit_optimizer": "lightning_memkit._optimizers.choice",
    "CATALOGUE": "lightning_memkit._optimizers.swap",
    "swap_optimizer": "lightning_memkit._optimizers.swap",
    "ConfigureModel": "lightning_memkit._sharding.layout",
    "Sharding": "lightning_memkit._step",
    "Step": "lightning_memkit._step",
    "TimelineEvent": "lightning_memkit._estimating.fake_tracker",
    "estimate_memory": "lightning_memkit._estimating.simulate",
    "ActivationCheckpointing": "lightning_memkit.callbacks",
    "AutoFit": "lightning_memkit.callbacks",
    "FusedOptimizerStep": "lightning_memkit.callbacks",
    "GradientRelease": "lightning_memkit.callbacks",
    "MemoryMonitor": "lightning_memkit.callbacks",
    "OptimizerOffload": "lightning_memkit.callbacks",
    "OptimizerSwap": "lightning_memkit.callbacks",
    "AutoFitStrategy": "lightning_memkit.strategies",
}


# Lightning's StrategyRegistry learns "autofit" (`Trainer(strategy="autofit")`, LightningCLI's
# ``--trainer.strategy autofit``) once this package and ``lightning.pytorch.strategies`` are both imported,
# in either order, without importing Lightning here: where Lightning comes later, a finder on
# ``sys.meta_path`` registers it as soon as that module has run. The registry builds the strategy through
# `_autofit_strategy`, which imports it then; by name its budget is ``"auto"``, the CUDA device each rank
# runs on (`AutoFitStrategy` refuses a run without one, saying how to give a size).
_STRATEGIES = "lightning.pytorch.strategies"


def _autofit_strategy(**init_args: Any) -> Any:
    from lightning_memkit.strategies.auto_fit import AutoFitStrategy

    return AutoFitStrategy(**init_args)


def _register_strategy(registry: Any) -> None:
    if "autofit" not in registry:
        registry.register(
            "autofit",
            _autofit_strategy,
            description="FSDP2 sharded, checkpointed and sized to fit the CUDA device (lightning_memkit)",
        )


class _RegisterOnImport:
    """A `sys.meta_path` finder that lets ``lightning.pytorch.strategies`` load as it would, then registers
    the strategy in its ``StrategyRegistry``; it removes itself on that import."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != _STRATEGIES:
            return None
        sys.meta_path.remove(self)
        spec = next(
            (s for f in sys.meta_path if (s := f.find_spec(name, path, target)) is not None), None
        )  # fmt: skip
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            run = spec.loader.exec_module

            def exec_module(module: Any) -> None:
                run(module)
                _register_strategy(module.StrategyRegistry)

            spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if _STRATEGIES in sys.modules:
    _register_strategy(sys.modules[_STRATEGIES].StrategyRegistry)
elif not any(isinstance(finder, _RegisterOnImport) for finder in sys.meta_path):
    sys.meta_path.insert(0, _RegisterOnImport())


def __getattr__(name: str) -> Any:
    """A public name, imported from its module on first use and kept (PEP 562); else a submodule."""
    module = _EXPORTS.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value
        return value
    if not name.startswith("__"):  # a submodule (lightning_memkit.callbacks, ._simulate), as before
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
