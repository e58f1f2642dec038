"""The fastopt strategy and precision plugin for the Trainer of the standalone
``pytorch_lightning`` package (``import pytorch_lightning as pl``):
``pl.Trainer(strategy="fastopt_offload")`` once ``lightning_fastopt`` is imported (with
``pytorch_lightning`` installed), or these classes by name.  The code is the same as for
``lightning.pytorch``; only the package's classes differ."""

from __future__ import annotations

from pytorch_lightning.plugins.precision import Precision
from pytorch_lightning.strategies import DDPStrategy

from lightning_fastopt.trainer.package import TrainerPackage
from lightning_fastopt.trainer.precision import TrainerPrecision
from lightning_fastopt.trainer.strategy import TrainerStrategy

__all__ = ["FastOptPrecision", "FastOptStrategy"]

PACKAGE = TrainerPackage.load("pytorch_lightning")


class FastOptPrecision(TrainerPrecision, Precision):
    __doc__ = TrainerPrecision.__doc__
    package = PACKAGE


class FastOptStrategy(TrainerStrategy, DDPStrategy):
    __doc__ = TrainerStrategy.__doc__
    package = PACKAGE
    precision_type = FastOptPrecision
