"""The Lightning package a Trainer front-end serves: ``lightning.pytorch`` or the standalone
``pytorch_lightning``.

The two packages hold the same code under two names, so their classes are distinct: a
``pytorch_lightning`` Trainer accepts only ``pytorch_lightning`` strategies, and a
``pytorch_lightning`` LightningModule is no ``lightning.pytorch.LightningModule``.  The
Trainer's strategy and precision plugin are written once
(:class:`~lightning_fastopt.trainer.strategy.TrainerStrategy`,
:class:`~lightning_fastopt.trainer.precision.TrainerPrecision`) and read every class of
Lightning they compare against or build through a :class:`TrainerPackage`; each front-end
(:mod:`~lightning_fastopt.trainer.lightning_pytorch`,
:mod:`~lightning_fastopt.trainer.pytorch_lightning`) binds one.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

# Lightning's callbacks that override hooks run between steps without reading weights
# (see lightning_fastopt.trainer.grad_readers.weight_readers)
_QUIET_CALLBACKS = ("ProgressBar", "ModelCheckpoint", "LearningRateMonitor", "Timer", "EarlyStopping",
                    "ThroughputMonitor", "DeviceStatsMonitor", "GradientAccumulationScheduler", "SpikeDetection",
                    "BatchSizeFinder")


@dataclass(frozen=True)
class TrainerPackage:
    """The names of one Lightning package that the Trainer front-end uses."""

    name: str  # "lightning.pytorch" or "pytorch_lightning"
    LightningModule: type
    Callback: type
    quiet_callbacks: tuple[type, ...]
    MockOptimizer: type  # Lightning's stand-in when configure_optimizers returns None
    Closure: type  # automatic optimization's closure: its None means training_step returned None
    MisconfigurationException: type
    WrappingCheckpointIO: type  # a checkpoint plugin around another (AsyncCheckpointIO)
    Precision: type
    MixedPrecision: type
    HalfPrecision: type
    DoublePrecision: type
    DDPStrategy: type
    StrategyRegistry: object
    sync_module_states: Callable  # rank 0's parameters and buffers broadcast to every rank
    LRSchedulerConfig: type  # what the Trainer steps a scheduler by (interval, frequency, ...)

    @classmethod
    def load(cls, name: str) -> TrainerPackage:
        """The names of the package ``name`` (importing it)."""
        def module(sub: str):
            return importlib.import_module(f"{name}.{sub}")

        callbacks, precision, strategies = module("callbacks"), module("plugins.precision"), module("strategies")
        return cls(
            name=name,
            LightningModule=importlib.import_module(name).LightningModule,
            Callback=callbacks.Callback,
            quiet_callbacks=tuple(getattr(callbacks, c) for c in _QUIET_CALLBACKS),
            MockOptimizer=module("core.optimizer")._MockOptimizer,
            Closure=module("loops.optimization.automatic").Closure,
            MisconfigurationException=module("utilities.exceptions").MisconfigurationException,
            WrappingCheckpointIO=module("plugins.io.wrapper")._WrappingCheckpointIO,
            Precision=precision.Precision,
            MixedPrecision=precision.MixedPrecision,
            HalfPrecision=precision.HalfPrecision,
            DoublePrecision=precision.DoublePrecision,
            DDPStrategy=strategies.DDPStrategy,
            StrategyRegistry=strategies.StrategyRegistry,
            sync_module_states=module("overrides.distributed")._sync_module_states,
            LRSchedulerConfig=module("utilities.types").LRSchedulerConfig,
        )


# each package's front-end module, for the message that names the class to use instead
FRONT_ENDS = {"lightning.pytorch": "lightning_fastopt",
              "pytorch_lightning": "lightning_fastopt.trainer.pytorch_lightning"}


def refuse_in_the_other_package(cls: str, package: TrainerPackage, caller: str) -> None:
    """Raise a ValueError naming the class to use when code of the other Lightning package
    (``caller``: its module's name) reads an object of our class ``cls`` that serves
    ``package``: its Trainer would refuse the object with "invalid strategy name", which
    does not say that the class exists for it too."""
    other = next((p for p in FRONT_ENDS if p != package.name and (caller == p or caller.startswith(p + "."))), None)
    if other is not None:
        raise ValueError(f"{FRONT_ENDS[package.name]}.{cls} serves {package.name} Trainers; this one is "
                         f"{other}'s: use {FRONT_ENDS[other]}.{cls} (or the strategy's registered name, which "
                         "both packages know)")

