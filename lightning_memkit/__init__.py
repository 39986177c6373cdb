"""lightning_memkit: make training memory visible, and make runs fit a memory budget.

Public surface (everything else lives in private modules):

- `MemoryBreakdown`: a step's peak memory by category, in bytes; `measure`: measure one training step
  of any model and optimizer; `estimate_memory`: the same breakdown for a step simulated on fake tensors,
  before any memory is spent.
- Callbacks: `MemoryMonitor` (log every step's breakdown), `ActivationCheckpointing` (the cheapest
  checkpointing plan that fits a budget), `OptimizerSwap` (the best optimizer that fits), `AutoFit`
  (micro-batch, accumulation, checkpointing and optimizer for a GPU size), `GradientRelease` (free the
  gradients once the optimizer has stepped: the next forward runs without them), `FusedOptimizerStep`
  (step each parameter inside backward: no step holds all the gradients), `OptimizerOffload` (the
  optimizer's state, fp32 master weights and gradient accumulation in host memory).
- The plain functions behind them: `plan_checkpointing` / `apply_checkpointing`, `fit_optimizer` /
  `swap_optimizer`, `plan_fit`, `release_gradients`, `fuse_optimizer_step`, `offload_optimizer`.
- `advise`: the memory a step holds at its peak that it need not, each finding with the bytes its fix
  saves and the fix (`Advice`, `Finding`); `chunked_cross_entropy`: a loss that never holds the whole
  batch's logits.
- `parse_bytes`, `parse_budget`: read a memory size (``"24GB"``) or a budget (``"A100-40GB"``, ``0.9``).
- `lightning_memkit.demos.gpt`: the bundled nanoGPT-style example.
"""

from lightning_memkit._advise import Advice, Finding, advise
from lightning_memkit._autofit import plan_fit
from lightning_memkit._blocks import find_blocks
from lightning_memkit._breakdown import CATEGORIES, MemoryBreakdown, format_bytes
from lightning_memkit._budget import GPUS, Budget, parse_budget, parse_bytes
from lightning_memkit._checkpoint_planner import plan_checkpointing
from lightning_memkit._checkpointing import (
    CHECKPOINT_MODES,
    BlockPlan,
    CheckpointMode,
    CheckpointPlan,
    apply_checkpointing,
)
from lightning_memkit._chunked_loss import chunked_cross_entropy
from lightning_memkit._fitplan import Alternative, FitPlan, StepCost
from lightning_memkit._fused_step import FusedStep, fuse_optimizer_step
from lightning_memkit._gradient_release import release_gradients
from lightning_memkit._measure import MemoryMeasurement, measure, storage_bytes
from lightning_memkit._offload import Offload, offload_optimizer
from lightning_memkit._optim import OptimizerChoice, fit_optimizer
from lightning_memkit._optimizers import CATALOGUE, swap_optimizer
from lightning_memkit._simulate import TimelineEvent, estimate_memory
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
    "BlockPlan",
    "Budget",
    "CheckpointMode",
    "CheckpointPlan",
    "Finding",
    "FitPlan",
    "FusedOptimizerStep",
    "FusedStep",
    "GradientRelease",
    "MemoryBreakdown",
    "MemoryMeasurement",
    "MemoryMonitor",
    "Offload",
    "OptimizerChoice",
    "OptimizerOffload",
    "OptimizerSwap",
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
    "measure",
    "offload_optimizer",
    "parse_budget",
    "parse_bytes",
    "plan_checkpointing",
    "plan_fit",
    "release_gradients",
    "storage_bytes",
    "swap_optimizer",
]
