"""The fastopt strategy and precision plugin for the Trainer of ``lightning.pytorch``
(``import lightning as L``): ``L.Trainer(strategy="fastopt_offload")`` once
``lightning_fastopt`` is imported, or these classes by name."""

from __future__ import annotations

from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, SingleDeviceStrategy

from lightning_fastopt.trainer.fsdp_strategy import FSDPTrainerStrategy
from lightning_fastopt.trainer.one_process import HasOneProcessTwin, OneProcessTrainerStrategy
from lightning_fastopt.trainer.package import TrainerPackage
from lightning_fastopt.trainer.precision import TrainerPrecision
from lightning_fastopt.trainer.strategy import TrainerStrategy

__all__ = ["FastOptFSDPStrategy", "FastOptPrecision", "FastOptSingleDeviceStrategy", "FastOptStrategy"]

PACKAGE = TrainerPackage.load("lightning.pytorch")


class FastOptPrecision(TrainerPrecision, Precision):
    __doc__ = TrainerPrecision.__doc__
    package = PACKAGE


class FastOptSingleDeviceStrategy(OneProcessTrainerStrategy, TrainerStrategy, SingleDeviceStrategy):
    """What a :class:`FastOptStrategy` becomes when the Trainer runs one process: a
    single-device strategy, as ``Trainer()``'s (see :mod:`lightning_fastopt.trainer.one_process`)."""

    package = PACKAGE
    precision_type = FastOptPrecision


class FastOptStrategy(TrainerStrategy, DDPStrategy, metaclass=HasOneProcessTwin):
    __doc__ = TrainerStrategy.__doc__
    package = PACKAGE
    precision_type = FastOptPrecision
    one_process_type = FastOptSingleDeviceStrategy


FastOptSingleDeviceStrategy.processes_type = FastOptStrategy


class FastOptFSDPStrategy(FSDPTrainerStrategy, ModelParallelStrategy):
    __doc__ = FSDPTrainerStrategy.__doc__
    package = PACKAGE
    precision_type = FastOptPrecision
