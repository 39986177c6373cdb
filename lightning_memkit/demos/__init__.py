"""Demo models and data to try lightning_memkit on, as ``lightning.pytorch.demos`` does for Lightning."""

from lightning_memkit.demos.gpt import GPT, GPTConfig, GPTDataModule, GPTLightningModule

__all__ = ["GPT", "GPTConfig", "GPTDataModule", "GPTLightningModule"]
