"""lightning-fastopt: fast, memory-lean optimizer steps for PyTorch Lightning.

Importing the package never builds anything: the compiled kernels are built (or loaded
from the cache) on first use, and if that is impossible a warning says why and a
pure-PyTorch path computes the same results.
"""

from lightning_fastopt import functional
from lightning_fastopt.checkpoint import load_guard
from lightning_fastopt.fabric import FastOptFabricPrecision, FastOptFabricStrategy
from lightning_fastopt.loss_scaler import DynamicLossScaler
from lightning_fastopt.memory import MemoryEstimate, estimate_memory
from lightning_fastopt.offload import OffloadOptimizer
from lightning_fastopt.precision import FastOptPrecision
from lightning_fastopt.strategy import FastOptStrategy
from lightning_fastopt.optim import (
    CPUAdam,
    FusedAdagrad,
    FusedAdam,
    FusedLAMB,
    FusedLars,
    FusedLion,
    FusedOptimizer,
    FusedSGD,
)

__version__ = "0.1.0"


def _register_strategies() -> None:
    """Make ``Trainer(strategy="fastopt_offload")`` and ``Fabric(strategy="fastopt_offload")``
    work after ``import lightning_fastopt`` (idempotent)."""
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    FastOptStrategy.register_strategies(StrategyRegistry)
    FastOptFabricStrategy.register_strategies(STRATEGY_REGISTRY)


_register_strategies()
load_guard.install()  # a sharded checkpoint given to Lightning's own loaders: a clear error

__all__ = [
    "CPUAdam", "DynamicLossScaler", "FastOptFabricPrecision", "FastOptFabricStrategy", "FastOptPrecision",
    "FastOptStrategy", "FusedAdagrad", "FusedAdam",
    "FusedLAMB", "FusedLars", "FusedLion", "FusedOptimizer", "FusedSGD", "MemoryEstimate", "OffloadOptimizer",
    "estimate_memory", "functional", "__version__",
]
