"""Lightning callbacks: thin adapters over the plain functions in the package."""

from lightning_memkit.callbacks.activation_checkpointing import ActivationCheckpointing
from lightning_memkit.callbacks.auto_fit import AutoFit
from lightning_memkit.callbacks.fused_step import FusedOptimizerStep
from lightning_memkit.callbacks.gradient_release import GradientRelease
from lightning_memkit.callbacks.memory_monitor import MemoryMonitor
from lightning_memkit.callbacks.offload import OptimizerOffload
from lightning_memkit.callbacks.optimizer_swap import OptimizerSwap

__all__ = [
    "ActivationCheckpointing",
    "AutoFit",
    "FusedOptimizerStep",
    "GradientRelease",
    "MemoryMonitor",
    "OptimizerOffload",
    "OptimizerSwap",
]
