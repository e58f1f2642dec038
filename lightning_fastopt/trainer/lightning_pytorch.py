"""The fastopt strategy and precision plugin for the Trainer of ``lightning.pytorch``
(``import lightning as L``): ``L.Trainer(strategy="fastopt_offload")`` once
``lightning_fastopt`` is imported, or these classes by name."""

from __future__ import annotations

from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy

from lightning_fastopt.trainer.package import TrainerPackage
from lightning_fastopt.trainer.precision import TrainerPrecision
from lightning_fastopt.trainer.strategy import TrainerStrategy

__all__ = ["FastOptPrecision", "FastOptStrategy"]

PACKAGE = TrainerPackage.load("lightning.pytorch")


class FastOptPrecision(TrainerPrecision, Precision):
    __doc__ = TrainerPrecision.__doc__
    package = PACKAGE


class FastOptStrategy(TrainerStrategy, DDPStrategy):
    __doc__ = TrainerStrategy.__doc__
    package = PACKAGE
    precision_type = FastOptPrecision
