"""The plan of a run under the FSDP strategies (``fastopt_fsdp*``, ZeRO stage 3 on FSDP2; the
Trainer's and Fabric's): shares are each rank's rows of every parameter, gradients are
reduce-scattered by FSDP."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lightning_fastopt.plan.gradients import fsdp_gradient_route
from lightning_fastopt.plan.run_plan import OptimizerPlan, RunPlan, state_home
from lightning_fastopt.plan.runner import choose_runner
from lightning_fastopt.plan.schedule import choose_schedule, in_place_refusals, rows_refusals
from lightning_fastopt.plan.weight_waits import choose_weight_waits

__all__ = ["FSDPRun", "plan_fsdp_run"]

_ON_THE_DEVICE = ("FSDP keeps the parameter shards on the device and gathers them on streams of its own, which wait "
                  "for the whole step at the root's forward (offload_parameters=True keeps them in host memory)")


@dataclass(frozen=True)
class FSDPRun:
    """What the plan reads of the run, gathered by the strategy at set-up: ``on_host`` (the
    parameter shards in host memory, ``CPUOffloadPolicy``'s) and the rest as
    :class:`~lightning_fastopt.plan.ddp_plan.DDPRun`'s."""

    world_size: int
    device: torch.device
    on_host: bool = False
    readers: tuple[str, ...] = ()
    weight_readers: tuple[str, ...] = ()
    step_checks: tuple[tuple[str, bool], ...] = ()
    keep_hint: str = ""


def plan_fsdp_run(optimizers: Sequence[Any], options: Any, run: FSDPRun, stand_in: type | None = None) -> RunPlan:
    """The plan of ``optimizers`` under ``options`` (a
    :class:`~lightning_fastopt.core.options.StrategyOptions`); ``stand_in``: Lightning's
    optimizer for none."""
    runners = [choose_runner(o, shares="rows", closure_optimizers=options.closure_optimizers,
                             named=options.elementwise_optimizers, stand_in=stand_in) for o in optimizers]
    copies = options.offload_fraction != 0 and (run.device.type != "cpu" or options.copy_on_cpu)
    gradients = fsdp_gradient_route(run.readers, on_host=run.on_host, copies=copies, keep_hint=run.keep_hint)
    waits = choose_weight_waits(options.forward_waits, [*run.weight_readers, *([] if run.on_host else [_ON_THE_DEVICE])],
                                "each FSDP unit's forward waits only for its own rows' CPU updates, which a step may "
                                "leave running")
    if options.offload_parameters:
        state = "in host memory: the parameter shards themselves, each rank's"
    else:
        state = state_home(offload_fraction=options.offload_fraction, auto_fraction=options.auto_fraction,
                           device=options.offload_optimizer_device, host_state_gib=options.host_state_gib,
                           zero_stage=3, world_size=run.world_size,
                           pieces="rows")
    plans = []
    for runner in runners:
        if not runner.in_engine:
            plans.append(OptimizerPlan(runner))
            continue
        refusals = [("user code reads gradients before the step", gradients.kind != "copy_when_reduced"),
                    *in_place_refusals(options.offload_fraction, run.device, options.copy_on_cpu),
                    *rows_refusals(runner.engine)]
        schedule = choose_schedule(stream_cpu_step=options.stream_cpu_step, landed="been reduce-scattered",
                                   checks=run.step_checks, refusals=refusals, delayed_update=options.delayed_update,
                                   delayed_update_warmup=options.delayed_update_warmup,
                                   offloaded=options.offload_fraction != 0)
        plans.append(OptimizerPlan(runner, schedule, state))
    return RunPlan(tuple(plans), 3, gradients, waits)
