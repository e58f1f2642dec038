"""The plan of a run's optimizers, made once at set-up from what the strategy's options ask
and what the run is (:mod:`~lightning_fastopt.plan.ddp_plan`,
:mod:`~lightning_fastopt.plan.fsdp_plan`): for each optimizer what runs it
(:mod:`~lightning_fastopt.plan.runner`), which schedule its host share takes
(:mod:`~lightning_fastopt.plan.schedule`) and where its masters and state live; for the
run where the gradients go (:mod:`~lightning_fastopt.plan.gradients`), the ZeRO stage that
runs and what each forward waits for (:mod:`~lightning_fastopt.plan.weight_waits`).

A plain value: the strategy says its lines (:meth:`RunPlan.lines`) and builds the engines
from it; ``str(plan)`` is its table.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lightning.fabric.utilities.rank_zero import rank_zero_info

from lightning_fastopt.plan.gradients import GradientRoute
from lightning_fastopt.plan.runner import Runner
from lightning_fastopt.plan.schedule import Schedule
from lightning_fastopt.plan.weight_waits import WeightWaits

__all__ = ["OptimizerPlan", "RunPlan", "state_home"]


@dataclass(frozen=True)
class OptimizerPlan:
    """One optimizer's: what runs it, its host share's schedule (None where no engine steps
    it) and where its masters and state live."""

    runner: Runner
    schedule: Schedule | None = None
    state: str = "the model's weights"


@dataclass(frozen=True)
class RunPlan:
    """The run's: each optimizer's plan (in the strategy's order), the ZeRO stage that runs,
    where the gradients go, what each forward waits for, and notes said at set-up."""

    optimizers: tuple[OptimizerPlan, ...]
    zero_stage: int = 0
    gradients: GradientRoute = GradientRoute("keep")
    weight_waits: WeightWaits = WeightWaits()
    notes: tuple[str, ...] = field(default=())

    @property
    def in_engine(self) -> list[bool]:
        """For each optimizer, whether an engine steps it."""
        return [o.runner.in_engine for o in self.optimizers]

    @property
    def torch_steps(self) -> list[str]:
        """The names of the optimizers that run as torch runs them."""
        return [o.runner.name for o in self.optimizers if o.runner.runs == "torch"]

    def lines(self) -> list[str]:
        """What the set-up says, each line once: what runs each optimizer, the notes, the
        gradients' route, the forward's waits, each schedule."""
        said = [o.runner.line() for o in self.optimizers] + list(self.notes)
        said += [self.gradients.line, self.weight_waits.line]
        said += [o.schedule.line for o in self.optimizers if o.schedule is not None]
        return list(dict.fromkeys(line for line in said if line))

    def say(self) -> None:
        """Each of :meth:`lines`, on rank 0."""
        for line in self.lines():
            rank_zero_info(f"lightning_fastopt: {line}")

    def __str__(self) -> str:
        rows = [("optimizer", "runs", "schedule", "state")]
        rows += [(o.runner.name, o.runner.describe(), o.schedule.kind if o.schedule else "-", o.state)
                 for o in self.optimizers]
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        table = ["  ".join(cell.ljust(w) for cell, w in zip(r[:3], widths)) + "  " + r[3] for r in rows]
        run = (f"ZeRO stage {self.zero_stage}; gradients: {self.gradients.kind}; forward waits for "
               f"{'its own weights' if self.weight_waits.by_module else 'every weight'}")
        return "\n".join([*table, run])


def state_home(*, offload_fraction: float, auto_fraction: bool, device: str, zero_stage: int, world_size: int,
               pieces: str = "parameters", host_state_gib: float | str | None = None) -> str:
    """Where an optimizer's masters and state live, in words: on the device, in host
    memory or on disk (``device``: the strategy's ``offload_optimizer_device``; on disk but
    ``host_state_gib`` of it), each rank's shard under ZeRO (``pieces``: what a share holds,
    ``"parameters"`` or FSDP's ``"rows"``)."""
    tier = "on disk" if device == "nvme" else "in host memory"
    if device == "nvme" and host_state_gib is not None:
        kept = "what the host has available (host_state_gib='auto')" if host_state_gib == "auto" \
            else f"{float(host_state_gib):g} GiB"
        tier = f"on disk but {kept} of it in host memory"
    if auto_fraction:
        where = f"a share measured at the first steps {tier}, the rest on the device"
    elif offload_fraction == 0:
        where = "on the device"
    elif offload_fraction == 1:
        where = tier
    else:
        where = f"{offload_fraction:g} of the {pieces} {tier}, the rest on the device"
    if zero_stage and world_size > 1:
        where += f", each rank's shard (ZeRO stage {zero_stage})"
    return where
