"""The plan of a run under the DDP strategies (``fastopt``, ``fastopt_offload``,
``fastopt_zero*``; the Trainer's and Fabric's): shares are whole parameters, gradients are
all-reduced by DDP or reduced to their owner by ZeRO stage 2."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lightning_fastopt.optim.base import needs_step_context
from lightning_fastopt.plan.gradients import ddp_gradient_route, zero_stage_that_runs
from lightning_fastopt.plan.run_plan import OptimizerPlan, RunPlan, state_home
from lightning_fastopt.plan.runner import choose_runner
from lightning_fastopt.plan.schedule import choose_schedule, in_place_refusals
from lightning_fastopt.plan.weight_waits import choose_weight_waits

__all__ = ["DDPRun", "plan_ddp_run"]


@dataclass(frozen=True)
class DDPRun:
    """What the plan reads of the run, gathered by the strategy at set-up.

    ``readers``: the user code that reads ``p.grad`` before the step (named); ``weight_readers``:
    the reasons no forward may wait for its own weights alone; ``step_checks``: what the step
    checks in every gradient first, each with whether this run does; ``own_comm_hook`` and
    ``find_unused``: DDP's; ``keep_hint``: how to keep gradients for code the detection cannot
    see; ``ddp_reduces_torch_steps``: whether the strategy wraps the model in DDP for an
    optimizer that runs as torch under ZeRO stage 2 (the Trainer's does; else refused)."""

    world_size: int
    device: torch.device
    readers: tuple[str, ...] = ()
    weight_readers: tuple[str, ...] = ()
    step_checks: tuple[tuple[str, bool], ...] = ()
    own_comm_hook: bool = False
    find_unused: bool = False
    keep_hint: str = ""
    ddp_reduces_torch_steps: bool = True


def plan_ddp_run(optimizers: Sequence[Any], options: Any, run: DDPRun, stand_in: type | None = None) -> RunPlan:
    """The plan of ``optimizers`` under ``options`` (a
    :class:`~lightning_fastopt.core.options.StrategyOptions`, or the Trainer's strategy,
    which keeps the same values); ``stand_in``: Lightning's optimizer for none."""
    runners = [choose_runner(o, shares="parameters", closure_optimizers=options.closure_optimizers,
                             named=options.per_parameter_optimizers, stand_in=stand_in) for o in optimizers]
    torch_steps = [r for r in runners if r.runs == "torch"]
    stage = zero_stage_that_runs(options.zero_stage, run.readers, [r.name for r in torch_steps])
    notes = []
    if torch_steps and options.zero_stage == 2 and run.world_size > 1 and not run.readers:
        if not run.ddp_reduces_torch_steps:
            first = torch_steps[0]
            raise ValueError(f"{first.name} runs as torch runs it, on the model's weights ({first.why}): with "
                             "zero_stage=2 and keep_gradients=False nothing reduces its gradients; use zero_stage 0 "
                             "or 1, or keep_gradients=True")
        notes.append(f"ZeRO stage 2 reduces gradients as stage 1 does (all-reduced by DDP): "
                     f"{', '.join(r.name for r in torch_steps)} runs as torch runs it, reading every parameter's "
                     "gradient")
    ddp = run.world_size > 1 and stage < 2
    gradients = ddp_gradient_route(run.readers, zero_stage=options.zero_stage, offload_fraction=options.offload_fraction,
                                   ddp=ddp, keep_hint=run.keep_hint)
    offloaded = options.offload_fraction != 0
    cpu_in_place = run.device.type == "cpu" and not options.copy_on_cpu
    waits = choose_weight_waits(options.forward_waits, [
        *run.weight_readers,
        *(reason for reason, applies in (
            ("nothing is offloaded", not offloaded and not options.auto_fraction),
            ("a CPU run updates in place, with nothing to copy", cpu_in_place and not options.delayed_update),
        ) if applies)], "each module's forward waits only for its own new weights")
    refusals = [
        ("user code reads gradients before the step", gradients.kind == "keep"),
        ("a DDP communication hook of the run's own reduces the gradients", ddp and run.own_comm_hook),
        ("DDP finds the parameters no rank used only when backward has ended (find_unused_parameters=True)",
         ddp and run.find_unused),
        *in_place_refusals(options.offload_fraction, run.device, options.copy_on_cpu),
    ]
    state = state_home(offload_fraction=options.offload_fraction, auto_fraction=options.auto_fraction,
                       device=options.offload_optimizer_device, host_state_gib=options.host_state_gib,
                       zero_stage=stage, world_size=run.world_size)
    plans = []
    for runner in runners:
        if not runner.in_engine:
            plans.append(OptimizerPlan(runner))
            continue
        checks = [*run.step_checks, (f"{runner.engine.__name__}'s global norm", needs_step_context(runner.engine))]
        schedule = choose_schedule(stream_cpu_step=options.stream_cpu_step,
                                   landed="been reduced and landed" if ddp else "landed", checks=checks,
                                   refusals=refusals, delayed_update=options.delayed_update,
                                   delayed_update_warmup=options.delayed_update_warmup, offloaded=offloaded)
        plans.append(OptimizerPlan(runner, schedule, state))
    return RunPlan(tuple(plans), stage, gradients, waits, tuple(notes))
