"""Lightning strategies: `AutoFitStrategy`, FSDP2 planned to fit a budget, registered as ``"autofit"``."""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_memkit.strategies.auto_fit import AutoFitStrategy

if AutoFitStrategy.strategy_name not in StrategyRegistry:
    AutoFitStrategy.register_strategies(StrategyRegistry)

__all__ = ["AutoFitStrategy"]
