"""``wall_clock_breakdown=True`` under the Trainer: each step's phases, as the engine timed
them, given to the run's loggers (both Trainer strategies, DDP's and FSDP's)."""

from __future__ import annotations

from typing import Any

from lightning_fastopt.optim.wrapper import OptimizerWrapper

__all__ = ["log_step_times"]


def log_step_times(trainer, precision_plugin, engine: Any) -> None:
    """Log ``fastopt/loss_scale``, each phase of ``engine``'s last step in milliseconds
    (``fastopt/<phase>_ms``; none for a step the precision plugin skipped) and the
    speculative step's bucket counts (``fastopt/buckets_<count>``) at the trainer's step.
    Nothing for an optimizer no engine of ours steps."""
    if not isinstance(engine, OptimizerWrapper):
        return
    metrics = {"fastopt/loss_scale": float(precision_plugin.loss_scale)}
    skipped = precision_plugin.last_step_skipped
    for k, v in engine.last_step_times.items():
        if k.startswith("buckets_"):
            metrics[f"fastopt/{k}"] = v
        elif not skipped:
            metrics[f"fastopt/{k}_ms"] = v
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=trainer.global_step)
