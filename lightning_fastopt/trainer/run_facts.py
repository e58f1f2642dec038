"""What a Trainer strategy's plan reads of the run (:mod:`lightning_fastopt.plan`), gathered
at set-up from the LightningModule, the callbacks, the precision plugin and the strategy's
own DDP arguments."""

from __future__ import annotations

from typing import Any

from lightning_fastopt.plan.ddp_plan import DDPRun
from lightning_fastopt.plan.fsdp_plan import FSDPRun
from lightning_fastopt.trainer.grad_readers import forward_waits_refusals, gradient_readers

__all__ = ["ddp_run", "fsdp_run", "step_checks"]


def step_checks(precision_plugin: Any, trainer: Any) -> tuple[tuple[str, bool], ...]:
    """What the step checks in every gradient before using them, each with whether this run
    does."""
    return (("fp16 loss scaling", precision_plugin.scaler is not None),
            ("gradient clipping", bool(trainer.gradient_clip_val)))


def _weight_readers(strategy: Any, trainer: Any, forward_waits: str) -> tuple[str, ...]:
    if forward_waits == "step":
        return ()  # nothing asked: nothing to look for
    return tuple(forward_waits_refusals(strategy.lightning_module, trainer.callbacks, strategy.package))


def ddp_run(strategy: Any, trainer: Any) -> DDPRun:
    """The run under a Trainer's DDP strategy (``strategy``: it keeps its options as attributes)."""
    module = strategy.lightning_module
    own_hook = any(getattr(strategy, a, None) is not None for a in ("_ddp_comm_hook", "_ddp_comm_wrapper"))
    return DDPRun(world_size=strategy.world_size, device=strategy.root_device,
                  readers=tuple(gradient_readers(module, trainer.callbacks, strategy.package, strategy.keep_gradients)),
                  weight_readers=_weight_readers(strategy, trainer, strategy.forward_waits),
                  step_checks=step_checks(strategy.precision_plugin, trainer), own_comm_hook=own_hook,
                  find_unused=bool(getattr(strategy, "_ddp_kwargs", {}).get("find_unused_parameters", False)),
                  keep_hint="no hook or callback reads p.grad; FastOptStrategy(keep_gradients=True) keeps them for "
                            "code that reads them elsewhere")


def fsdp_run(strategy: Any, trainer: Any, on_host: bool) -> FSDPRun:
    """The run under the Trainer's FSDP strategy (``strategy.options``: its options;
    ``on_host``: FSDP's parameter shards in host memory)."""
    options = strategy.options
    return FSDPRun(world_size=strategy.world_size, device=strategy.root_device, on_host=on_host,
                   readers=tuple(gradient_readers(strategy.lightning_module, trainer.callbacks, strategy.package,
                                                  options.keep_gradients)),
                   weight_readers=_weight_readers(strategy, trainer, options.forward_waits),
                   step_checks=step_checks(strategy.precision_plugin, trainer),
                   keep_hint="no hook or callback reads p.grad; FastOptFSDPStrategy(keep_gradients=True) keeps them "
                             "for code that reads them elsewhere")
