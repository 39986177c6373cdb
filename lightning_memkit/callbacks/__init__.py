"""Lightning callbacks: thin adapters over the plain functions in the package."""

from lightning_memkit.callbacks.memory_monitor import MemoryMonitor

__all__ = ["MemoryMonitor"]
