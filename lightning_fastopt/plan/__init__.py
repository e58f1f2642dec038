"""The plan of a run's optimizers, made once at set-up (see :mod:`~lightning_fastopt.plan.run_plan`)."""

from lightning_fastopt.plan.ddp_plan import DDPRun, plan_ddp_run
from lightning_fastopt.plan.fsdp_plan import FSDPRun, plan_fsdp_run
from lightning_fastopt.plan.run_plan import OptimizerPlan, RunPlan

__all__ = ["DDPRun", "FSDPRun", "OptimizerPlan", "RunPlan", "plan_ddp_run", "plan_fsdp_run"]
