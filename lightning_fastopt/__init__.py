"""lightning-fastopt: fast, memory-lean optimizer steps for PyTorch Lightning.

Importing the package never builds anything: the compiled kernels are built (or loaded
from the cache) on first use, and if that is impossible a warning says why and a
pure-PyTorch path computes the same results.

Three front-ends over one core (:mod:`lightning_fastopt.core`): the Trainer of
``lightning.pytorch`` (:class:`FastOptStrategy`, :class:`FastOptPrecision`, and ZeRO
stage 3 on FSDP2, :class:`FastOptFSDPStrategy`), the Trainer
of the standalone ``pytorch_lightning`` (the same names in
:mod:`lightning_fastopt.trainer.pytorch_lightning`), and Fabric
(:class:`FastOptFabricStrategy`, :class:`FastOptFabricPrecision`).  Importing the package
registers the strategy names (``"fastopt_offload"``, ...) with each of them.
"""

import importlib.util

from lightning_fastopt.core.lightning_logging import lightnings_logging_kept

with lightnings_logging_kept():  # importing lightning.pytorch here does not move a project's messages
    from lightning_fastopt import functional
    from lightning_fastopt.checkpoint import load_guard
    from lightning_fastopt.core.loss_scaler import DynamicLossScaler, LossScaleAtMinimumError
    from lightning_fastopt.fabric import FastOptFabricFSDPStrategy, FastOptFabricPrecision, FastOptFabricStrategy
    from lightning_fastopt.memory import MemoryEstimate, estimate_memory, sizes_that_fit
    from lightning_fastopt.offload import OffloadOptimizer
    from lightning_fastopt.optim import (
        CPUAdam, FusedAdagrad, FusedAdam, FusedLAMB, FusedLars, FusedLion, FusedOptimizer, FusedSGD,
    )
    from lightning_fastopt.trainer import FastOptFSDPStrategy, FastOptPrecision, FastOptStrategy

__version__ = "0.1.0"


def _register_strategies() -> None:
    """Make ``Trainer(strategy="fastopt_offload")`` and ``Fabric(strategy="fastopt_offload")``
    work after ``import lightning_fastopt``, and ``pytorch_lightning.Trainer(...)`` where
    that package is installed (idempotent)."""
    from lightning.fabric.strategies import STRATEGY_REGISTRY

    FastOptStrategy.register_strategies(FastOptStrategy.package.StrategyRegistry)
    FastOptFSDPStrategy.register_strategies(FastOptFSDPStrategy.package.StrategyRegistry)
    FastOptFabricStrategy.register_strategies(STRATEGY_REGISTRY)
    FastOptFabricFSDPStrategy.register_strategies(STRATEGY_REGISTRY)
    if importlib.util.find_spec("pytorch_lightning") is not None:
        with lightnings_logging_kept():  # Lightning's messages stay where they went
            from lightning_fastopt.trainer import pytorch_lightning

        pytorch_lightning.FastOptStrategy.register_strategies(pytorch_lightning.PACKAGE.StrategyRegistry)
        pytorch_lightning.FastOptFSDPStrategy.register_strategies(pytorch_lightning.PACKAGE.StrategyRegistry)


_register_strategies()
load_guard.install()  # a sharded checkpoint given to Lightning's own loaders: a clear error

__all__ = [
    "CPUAdam", "DynamicLossScaler", "FastOptFSDPStrategy", "FastOptFabricFSDPStrategy", "FastOptFabricPrecision",
    "FastOptFabricStrategy",
    "FastOptPrecision",
    "FastOptStrategy", "FusedAdagrad", "FusedAdam",
    "FusedLAMB", "FusedLars", "FusedLion", "FusedOptimizer", "FusedSGD", "LossScaleAtMinimumError", "MemoryEstimate",
    "OffloadOptimizer",
    "estimate_memory", "functional", "sizes_that_fit", "__version__",
]
