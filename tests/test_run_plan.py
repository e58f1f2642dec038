"""The plan of a run's optimizers (issue 68, :mod:`lightning_fastopt.plan`): made once at
set-up, a plain value read here without a Trainer (what runs each optimizer and why, its
schedule, where its state lives, the gradients' route, the ZeRO stage that runs), and the
plan a Trainer and Fabric made, readable after the run with the engines built from it.
The schedules' choice is also checked in tests/test_streamed_step.py, the weight waits' in
tests/test_forward_waits.py, each Trainer-level run against Lightning's own strategy."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn

from lightning_fastopt import FastOptFabricStrategy, FastOptStrategy, FusedAdam, FusedLAMB
from lightning_fastopt.core.options import StrategyOptions
from lightning_fastopt.optim.user_step import UserStepOptimizer
from lightning_fastopt.plan import DDPRun, FSDPRun, plan_ddp_run, plan_fsdp_run
from lightning_fastopt.plan.runner import choose_runner
from lightning_fastopt.plan.schedule import choose_schedule
from tests.references import GlobalNorm, WholeTensorNorms

CPU = torch.device("cpu")


def _params():
    return [nn.Parameter(torch.zeros(3))]


class _StandIn(torch.optim.Optimizer):
    """As Lightning's when configure_optimizers returns None."""

    def __init__(self):
        super().__init__(_params(), {})


class _OwnSGD(torch.optim.SGD):
    """A step of its own over torch's SGD (named where it is per parameter)."""

    def step(self, closure=None):
        return super().step(closure)


def test_what_runs_each_optimizer_and_why():
    adamw = choose_runner(torch.optim.AdamW(_params()), shares="parameters")
    assert (adamw.runs, adamw.engine, adamw.in_engine) == ("kernel", FusedAdam, True)
    assert adamw.line() == "running AdamW as FusedAdam with the same hyperparameters"
    ours = choose_runner(FusedLAMB(_params()), shares="parameters")
    assert ours.runs == "kernel" and ours.engine is FusedLAMB and ours.line() is None  # ours: nothing to say

    own = choose_runner(_OwnSGD(_params(), lr=0.1), shares="parameters", named=("_OwnSGD",))
    assert (own.runs, own.engine) == ("own step", UserStepOptimizer) and "its own step (not SGD's)" in own.why
    assert choose_runner(torch.optim.Adam([nn.Parameter(torch.zeros(3, dtype=torch.float64))]),
                         shares="parameters").why == "float64 parameters"

    unknown = choose_runner(GlobalNorm(_params(), lr=0.1), shares="parameters")
    assert unknown.runs == "torch" and not unknown.in_engine
    assert unknown.line().startswith("GlobalNorm runs as torch runs it, on the model's weights, not offloaded: its "
                                     "step is not known to update each parameter")
    assert "per_parameter_optimizers=['GlobalNorm']" in unknown.why
    rows = choose_runner(WholeTensorNorms(_params(), lr=0.1), shares="rows")
    assert rows.runs == "torch" and rows.on == "the DTensor parameters" and "elementwise_optimizers" in rows.why
    assert choose_runner(WholeTensorNorms(_params(), lr=0.1), shares="rows", named=("WholeTensorNorms",)).in_engine

    lbfgs = choose_runner(torch.optim.LBFGS(_params()), shares="parameters", named=("LBFGS",))
    assert lbfgs.runs == "torch" and lbfgs.why == "its step evaluates the closure again after changing them"
    sam = choose_runner(torch.optim.SGD(_params(), lr=0.1), shares="rows", closure_optimizers=("SGD",))
    assert sam.runs == "torch" and sam.why == "named in closure_optimizers" and sam.on == "the model's weights"
    stand_in = choose_runner(_StandIn(), shares="parameters", stand_in=_StandIn)
    assert stand_in.runs == "nothing" and stand_in.line() is None


def test_the_ddp_plan_of_a_run_of_several_optimizers():
    options = StrategyOptions(offload_fraction=0.5, zero_stage=2, stream_cpu_step=True, copy_on_cpu=True)
    run = DDPRun(world_size=2, device=CPU, step_checks=(("fp16 loss scaling", False), ("gradient clipping", True)))
    plan = plan_ddp_run([torch.optim.AdamW(_params()), GlobalNorm(_params(), lr=0.1), _StandIn()], options, run,
                        stand_in=_StandIn)
    assert plan.in_engine == [True, False, False] and plan.torch_steps == ["GlobalNorm"]
    # an optimizer that runs as torch reads every gradient: stage 2 reduces them as stage 1 does, through DDP
    assert plan.zero_stage == 1 and plan.gradients.kind == "copy_at_step"
    adamw, global_norm, stand_in = plan.optimizers
    assert adamw.schedule.kind == "speculated" and global_norm.schedule is None and stand_in.schedule is None
    assert adamw.state == "0.5 of the parameters in host memory, the rest on the device, each rank's shard (ZeRO stage 1)"
    lines = plan.lines()
    assert lines[0] == "running AdamW as FusedAdam with the same hyperparameters"
    assert lines[1].startswith("GlobalNorm runs as torch runs it")
    assert lines[2] == ("ZeRO stage 2 reduces gradients as stage 1 does (all-reduced by DDP): GlobalNorm runs as torch "
                        "runs it, reading every parameter's gradient")
    assert lines[3].startswith("gradients of offloaded parameters are copied to the host")
    assert "speculated during backward, once its gradients have been reduced and landed, and checked at the step " \
           "(gradient clipping)" in lines[4]
    assert len(lines) == 5
    table = str(plan).splitlines()
    assert table[0].split() == ["optimizer", "runs", "schedule", "state"]
    assert table[1].startswith("AdamW") and "kernel (FusedAdam)" in table[1] and "speculated" in table[1]
    assert table[3].startswith("_StandIn") and " nothing " in table[3]
    assert table[-1] == "ZeRO stage 1; gradients: copy_at_step; forward waits for every weight"


def test_readers_keep_the_gradients_and_stage_2_reduces_as_stage_1():
    plan = plan_ddp_run([torch.optim.SGD(_params(), lr=0.1)], StrategyOptions(zero_stage=2),
                        DDPRun(world_size=2, device=CPU, readers=("Net.on_after_backward",)))
    assert plan.zero_stage == 1 and plan.gradients.kind == "keep"
    assert plan.gradients.line == ("gradients stay in p.grad until the optimizer step (ZeRO stage 2 reduces them as "
                                   "stage 1 does), as in torch: Net.on_after_backward can read them")
    alone = plan_ddp_run([torch.optim.SGD(_params(), lr=0.1)], StrategyOptions(zero_stage=2),
                         DDPRun(world_size=2, device=CPU))
    assert alone.zero_stage == 2 and alone.gradients.kind == "copy_in_backward"


def test_where_nothing_can_reduce_an_optimizer_run_as_torch_the_plan_refuses():
    """Fabric's ZeRO stage 2 without kept gradients has no DDP to reduce the gradients of an
    optimizer that runs as torch: refused when it is set up, naming the way out."""
    run = DDPRun(world_size=2, device=CPU, ddp_reduces_torch_steps=False)
    with pytest.raises(ValueError, match=r"GlobalNorm runs as torch runs it, on the model's weights \(its step is not "
                                         r"known.*nothing reduces its gradients; use zero_stage 0 or 1, or "
                                         r"keep_gradients=True"):
        plan_ddp_run([GlobalNorm(_params(), lr=0.1)], StrategyOptions(zero_stage=2), run)
    one = plan_ddp_run([GlobalNorm(_params(), lr=0.1)], StrategyOptions(zero_stage=2),
                       DDPRun(world_size=1, device=CPU, ddp_reduces_torch_steps=False))
    assert one.torch_steps == ["GlobalNorm"]  # one process: nothing to reduce


@pytest.mark.parametrize("asked,offloaded,kind,line", [
    (dict(stream_cpu_step=False), True, "synchronous", None),
    (dict(stream_cpu_step=True), True, "streamed", "each host bucket's CPU update starts during backward, once its "
                                                   "gradients have landed (stream_cpu_step=True)"),
    (dict(stream_cpu_step=True, checks=[("gradient clipping", True)]), True, "speculated", None),
    (dict(stream_cpu_step=True, refusals=[("a reason", True), ("not this", False)]), True, "synchronous",
     "stream_cpu_step=True not used: a reason"),
    (dict(stream_cpu_step=False, delayed_update=True, delayed_update_warmup=3), True, "delayed",
     "after 3 synchronous step(s), each CPU update runs during the next forward and backward, which use weights one "
     "update old (delayed_update=True)"),
    (dict(stream_cpu_step=False, delayed_update=True, delayed_update_warmup=3), False, "synchronous",
     "delayed_update=True delays nothing: nothing is offloaded"),
], ids=["synchronous", "streamed", "speculated", "refused", "delayed", "delays-nothing"])
def test_the_schedule_and_its_arguments(asked, offloaded, kind, line):
    schedule = choose_schedule(landed="landed", offloaded=offloaded, **asked)
    assert schedule.kind == kind
    if line is not None:
        assert schedule.line == line
    expected = {"synchronous": {}, "streamed": {"stream_cpu_step": True},
                "speculated": {"stream_cpu_step": True, "speculate": True},
                "delayed": {"delayed_update": True, "delayed_update_warmup": 3}}[kind]
    assert schedule.engine_arguments() == expected


def test_the_fsdp_plan():
    options = StrategyOptions(offload_fraction=1.0, stream_cpu_step=True, copy_on_cpu=True)
    run = FSDPRun(world_size=2, device=CPU, step_checks=(("gradient clipping", False),), keep_hint="a hint")
    plan = plan_fsdp_run([torch.optim.AdamW(_params()), FusedLAMB(_params()), WholeTensorNorms(_params(), lr=0.1)],
                         options, run)
    adamw, lamb, norms = plan.optimizers
    assert plan.zero_stage == 3 and plan.gradients.kind == "copy_when_reduced" and "(a hint)" in plan.gradients.line
    assert adamw.schedule.kind == "streamed" and "been reduce-scattered" in adamw.schedule.line
    assert lamb.schedule.kind == "synchronous" and "FusedLAMB reads norms over whole parameters" in lamb.schedule.line
    assert norms.runner.runs == "torch" and norms.schedule is None
    assert adamw.state == "in host memory, each rank's shard (ZeRO stage 3)"
    readers = plan_fsdp_run([torch.optim.AdamW(_params())], options, FSDPRun(2, CPU, readers=("Net.hook",)))
    assert readers.gradients.kind == "copy_at_step"
    assert readers.optimizers[0].schedule.line == "stream_cpu_step=True not used: user code reads gradients before " \
                                                  "the step"
    delayed = plan_fsdp_run([torch.optim.AdamW(_params())], StrategyOptions(delayed_update=True,
                                                                            delayed_update_warmup=3), run)
    assert delayed.optimizers[0].schedule.engine_arguments() == {"delayed_update": True, "delayed_update_warmup": 3}
    on_host = plan_fsdp_run([torch.optim.AdamW(_params())], StrategyOptions(offload_parameters=True),
                            FSDPRun(2, CPU, on_host=True))
    assert on_host.gradients == type(on_host.gradients)("copy_when_reduced")  # nothing copied, nothing said
    assert on_host.optimizers[0].state.startswith("in host memory: the parameter shards themselves")


class _TwoOptimizers(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 1)
        self.automatic_optimization = False

    def training_step(self, batch, _):
        for opt in self.optimizers():
            opt.zero_grad()
        loss = self.b(self.a(batch[0])).pow(2).mean()
        self.manual_backward(loss)
        for opt in self.optimizers():
            opt.step()

    def configure_optimizers(self):
        return [torch.optim.AdamW(self.a.parameters(), lr=0.1), GlobalNorm(self.b.parameters(), lr=0.1)]


def test_the_trainers_plan_is_readable_after_the_run_and_its_engines_follow_it():
    strategy = FastOptStrategy(offload_fraction=1.0, copy_on_cpu=True)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=4)
    L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False).fit(_TwoOptimizers(), data)
    plan = strategy.plan
    assert plan.in_engine == [True, False] and plan.torch_steps == ["GlobalNorm"]
    assert plan.gradients.kind == "keep"  # manual optimization reads them
    assert plan.gradients.line.endswith("manual optimization can read them")
    assert [e.device_grads for e in strategy.engines] == ["keep"] and len(strategy.engines) == 1
    assert plan.optimizers[0].state == "in host memory"


def test_fabrics_plan_is_made_for_each_optimizer_it_sets_up(monkeypatch):
    from lightning_fastopt.plan import run_plan
    from tests.helpers import said_lines

    said = said_lines(monkeypatch, run_plan)
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=FastOptFabricStrategy(offload_fraction=0.5))
    model = nn.Linear(4, 2)
    model, adamw = fabric.setup(model, torch.optim.AdamW(model.parameters()))
    assert fabric.strategy._wrappers[0].device_grads == "keep"
    assert said == ["lightning_fastopt: running AdamW as FusedAdam with the same hyperparameters",
                    "lightning_fastopt: gradients stay in p.grad until the optimizer step, as in torch: the loop's "
                    "code (keep_gradients=True, Fabric's default) can read them"], said
