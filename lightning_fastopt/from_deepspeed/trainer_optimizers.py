"""A DeepSpeed config's ``optimizer`` and ``scheduler`` sections under the Trainer, as under
``DeepSpeedStrategy``: an ``optimizer`` section stands in for ``configure_optimizers`` (which
is not called then); a ``scheduler`` section schedules the optimizer, stepped after every
optimizer step (as DeepSpeed's engine steps it), unless ``configure_optimizers`` returned a
scheduler of its own, which DeepSpeed prefers (said in the log)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning.fabric.utilities.rank_zero import rank_zero_info

from lightning_fastopt.from_deepspeed.arguments import FromDeepSpeed
from lightning_fastopt.from_deepspeed.sections import make_optimizer, make_scheduler

__all__ = ["makes_the_optimizer", "optimizers_from_config", "set_up_optimizers"]


def makes_the_optimizer(settings: FromDeepSpeed) -> bool:
    """Whether the config's ``optimizer`` section stands in for ``configure_optimizers``."""
    return settings.config is not None and settings.config.optimizer is not None


def optimizers_from_config(settings: FromDeepSpeed, module: Any, trainer: Any, optimizers: list,
                           scheduler_configs: list, scheduler_config: Callable[..., Any]) -> tuple[list, list, list[str]]:
    """The run's optimizers and scheduler configurations (``optimizers``, ``scheduler_configs``:
    those ``configure_optimizers`` gave, where it was called), with the config's sections
    made over ``module``'s parameters; ``scheduler_config``: the Lightning package's
    ``LRSchedulerConfig``.  Also the lines to say."""
    config = settings.config
    if config is None or (config.optimizer is None and config.scheduler is None):
        return optimizers, scheduler_configs, []
    lines = []
    if config.optimizer is not None:
        optimizer = make_optimizer(config.optimizer, module.parameters(), config.source)
        optimizers, scheduler_configs = [optimizer], []
        lines.append(f"the optimizer section of the {config.source} stands in for configure_optimizers (not called, "
                     f"as under DeepSpeedStrategy): {type(optimizer).__name__} with "
                     f"{_hyperparameters(optimizer)}")
    if config.scheduler is not None:
        if scheduler_configs:
            lines.append(f"the scheduler section of the {config.source} is not used: configure_optimizers returns a "
                         "scheduler, which DeepSpeed prefers")
        elif len(optimizers) != 1:
            raise ValueError(f"the scheduler section of the {config.source} schedules one optimizer; "
                             f"configure_optimizers returns {len(optimizers)}")
        else:
            scheduler = make_scheduler(config.scheduler, optimizers[0], trainer.estimated_stepping_batches,
                                       config.source)
            scheduler_configs = [scheduler_config(scheduler, interval="step", name=None)]
            lines.append(f"the scheduler section of the {config.source}: DeepSpeed's {config.scheduler['type']}, "
                         "stepped after every optimizer step")
    return optimizers, scheduler_configs, lines


def set_up_optimizers(strategy: Any, trainer: Any, settings: FromDeepSpeed, lightnings: Callable[[], None]) -> None:
    """A Trainer strategy's ``setup_optimizers``: Lightning's (``lightnings``, which calls
    ``configure_optimizers``), or a DeepSpeed config's sections standing in for it, said in
    the log; the strategy's ``optimizers`` and ``lr_scheduler_configs`` set."""
    if not makes_the_optimizer(settings):
        lightnings()
    strategy.optimizers, strategy.lr_scheduler_configs, lines = optimizers_from_config(
        settings, strategy.lightning_module, trainer, strategy.optimizers, strategy.lr_scheduler_configs,
        strategy.package.LRSchedulerConfig)
    for line in lines:
        rank_zero_info(f"lightning_fastopt: {line}")


def _hyperparameters(optimizer: Any) -> str:
    group = optimizer.param_groups[0]
    return ", ".join(f"{k}={group[k]!r}" for k in ("lr", "betas", "eps", "weight_decay", "momentum") if k in group)
