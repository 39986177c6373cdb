"""lightning_memkit: make training memory visible, and make runs fit a memory budget.

Public surface (everything else lives in private modules):

- `MemoryBreakdown`: a step's peak memory by category, in bytes.
- `measure`: measure one training step of any model and optimizer.
- `MemoryMonitor`: a Lightning callback that logs every step's breakdown.
- `estimate_memory`: the same breakdown for a step that is simulated on fake tensors, before any memory
  is spent (a 7B model planned on a laptop).
- `parse_bytes`, `parse_budget`: read a memory size (``"24GB"``) or a budget (``"A100-40GB"``, ``0.9``).
- `lightning_memkit.demos.gpt`: the bundled nanoGPT-style example.
"""

from lightning_memkit._breakdown import CATEGORIES, MemoryBreakdown, format_bytes
from lightning_memkit._budget import GPUS, Budget, parse_budget, parse_bytes
from lightning_memkit._measure import MemoryMeasurement, measure, storage_bytes
from lightning_memkit._simulate import TimelineEvent, estimate_memory
from lightning_memkit.callbacks import MemoryMonitor

__version__ = "0.1.0"

__all__ = [
    "CATEGORIES",
    "GPUS",
    "Budget",
    "MemoryBreakdown",
    "MemoryMeasurement",
    "MemoryMonitor",
    "TimelineEvent",
    "__version__",
    "estimate_memory",
    "format_bytes",
    "measure",
    "parse_budget",
    "parse_bytes",
    "storage_bytes",
]
