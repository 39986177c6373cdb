"""lightning_memkit: make training memory visible, and make runs fit a memory budget.

Public surface (everything else lives in private modules):

- `MemoryBreakdown`: a step's peak memory by category, in bytes.
- `measure`: measure one training step of any model and optimizer.
- `MemoryMonitor`: a Lightning callback that logs every step's breakdown.
- `parse_bytes`: read a memory size such as ``"24GB"`` or ``"6GiB"``.
"""

from lightning_memkit._breakdown import CATEGORIES, MemoryBreakdown, format_bytes
from lightning_memkit._budget import parse_bytes
from lightning_memkit._measure import MemoryMeasurement, measure, storage_bytes
from lightning_memkit.callbacks import MemoryMonitor

__version__ = "0.1.0"

__all__ = [
    "CATEGORIES",
    "MemoryBreakdown",
    "MemoryMeasurement",
    "MemoryMonitor",
    "__version__",
    "format_bytes",
    "measure",
    "parse_bytes",
    "storage_bytes",
]
