"""The CPU step streamed into backward (``stream_cpu_step=True``), on the accelerator code
path run on the CPU (``copy_on_cpu=True``: host masters, gradient and weight copies):

- it ends where the unstreamed step ends, bit for bit (parameters and optimizer state),
  at fractions 1 and 0.5 with several buckets, for AdamW and SGD;
- a bucket's CPU update starts before backward has finished (timestamps);
- steps that need every gradient first are refused (check_finite, ``gradients()``), and
  ``device_grads`` other than ``"copy_in_backward"`` at construction;
- under ``Trainer()``: the strategy streams where nothing needs the gradients first and
  speculates where clipping does (tests/test_speculative_step.py), ending where
  ``Trainer()`` ends either way.
"""

import time

import lightning as L
import pytest
import torch
from torch import nn

from lightning_fastopt import FastOptStrategy, FusedAdam, FusedSGD
from lightning_fastopt.offload import OffloadOptimizer
from tests.helpers import ACCELERATOR
from tests.test_precision import _data
from tests.test_strategy import Model


def _net(width=24, depth=4):
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(width, 1))


def _train(stream, make_opt, fraction, steps=12):
    model = _net()
    opt = OffloadOptimizer(make_opt(model.parameters()), {p: n for n, p in model.named_parameters()},
                           offload_fraction=fraction, bucket_size_mb=0.002, copy_on_cpu=True, stream_cpu_step=stream)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(16, 24, generator=g)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    states = [opt.state_of(p) for p in model.parameters()]
    opt.close()
    return model, states, opt


def test_a_step_that_waits_leaves_nothing_running_where_the_worker_ends_its_updates_late():
    """The streamed step that waits for its updates takes the list of those running, then
    waits for each; the worker, held until the list is taken, ends every update after, so
    none is noted as finished by it.  The step still counts each as ended, not left running
    (it counted them left once: sent last, their slots not among those it wrote), and ends
    where the unstreamed step ends."""
    from tests.test_forward_waits import _HeldWorker

    def make(stream):
        model = _net()
        names = {p: n for n, p in model.named_parameters()}
        return model, OffloadOptimizer(FusedAdam(model.parameters(), lr=1e-2), names, bucket_size_mb=0.002,
                                       copy_on_cpu=True, stream_cpu_step=stream)

    x = torch.randn(16, 24, generator=torch.Generator().manual_seed(1))
    model, opt = make(True)
    held = _HeldWorker(opt, model)
    schedule = opt.schedule

    def late_join():  # join()'s own two steps, the worker released between them
        running, schedule.running = schedule.running, {}
        held.release()
        return {b: f.result() for b, f in running.items()}

    schedule.join = late_join
    model(x).square().mean().backward()
    opt.step()
    assert len(held.order) == len(opt.layout.buckets) >= 3 and schedule.updates_left_running == 0
    assert not opt._in_flight
    ref, ref_opt = make(False)
    ref(x).square().mean().backward()
    ref_opt.step()
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a, b)
    del schedule.join
    opt.close()
    ref_opt.close()


@pytest.mark.parametrize("fraction", [1.0, 0.5])
@pytest.mark.parametrize("make_opt", [lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.01),
                                      lambda ps: FusedSGD(ps, lr=0.05, momentum=0.9)], ids=["adamw", "sgd"])
def test_the_streamed_step_ends_where_the_unstreamed_one_ends_bit_for_bit(backend, make_opt, fraction):
    streamed, streamed_states, opt = _train(True, make_opt, fraction)
    assert len(opt.layout.buckets) >= 3  # several buckets, each started on its own
    plain, plain_states, _ = _train(False, make_opt, fraction)
    for a, b in zip(streamed.parameters(), plain.parameters()):
        assert torch.equal(a, b)
    for sa, sb in zip(streamed_states, plain_states):
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def cpu_updates_and_backward_end(after_backward, **kw):
    """Two steps of 8 wide layers (backward is long), each host bucket's CPU update timed;
    ``after_backward(opt)`` takes the step.  Returns the second step's update start times
    (warm caches), when its backward ended, and the optimizer (still open)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(768, 768) for _ in range(8)])
    opt = OffloadOptimizer(FusedAdam(model.parameters(), lr=1e-3), {p: n for n, p in model.named_parameters()},
                           bucket_size_mb=2.5, copy_on_cpu=True, stream_cpu_step=True, **kw)
    started = []
    run = opt.updates.run  # (every update goes through it)

    def timed(inner, plan, *args):
        if inner is not opt.layout.device_inner:
            started.append(time.perf_counter())
        return run(inner, plan, *args)

    opt.updates.run = timed
    x = torch.randn(1024, 768)
    for _ in range(2):
        started.clear()
        opt.zero_grad()
        model(x).square().mean().backward()
        backward_ended = time.perf_counter()
        after_backward(opt)
    return started, backward_ended, opt


def test_a_buckets_cpu_update_starts_before_backward_ends(compiled):
    """The last layer's gradients land first, and its bucket's update starts while the
    earlier layers' backward still runs."""
    started, backward_ended, opt = cpu_updates_and_backward_end(lambda o: o.step())
    assert len(started) == len(opt.layout.buckets) >= 4
    assert min(started) < backward_ended, (min(started) - backward_ended)
    opt.close()


def test_the_breakdown_tells_streamed_from_waited_for_cpu_time():
    model = _net()
    opt = OffloadOptimizer(FusedSGD(model.parameters(), lr=0.1), {p: n for n, p in model.named_parameters()},
                           bucket_size_mb=0.002, copy_on_cpu=True, stream_cpu_step=True, wall_clock_breakdown=True)
    opt.zero_grad()
    model(torch.randn(4, 24)).sum().backward()
    opt.step()
    times = opt.last_step_times
    assert times["cpu_step_background"] > 0 and set(times) >= {"cpu_step", "grad_d2h", "param_h2d"}
    opt.close()


def test_steps_that_need_every_gradient_first_are_refused():
    model = _net()
    names = {p: n for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=r"stream_cpu_step=True needs gradients that leave during backward, "
                                         r"device_grads one of \('copy_in_backward', 'copy_when_reduced'\) \(or "
                                         r"'copy_at_step' with a reducer .*\), got 'keep'"):
        OffloadOptimizer(FusedSGD(model.parameters(), lr=0.1), names, copy_on_cpu=True, device_grads="keep",
                         stream_cpu_step=True)
    for device_grads, reduced_by in (("copy_when_reduced", None), ("keep", lambda p: True)):
        with pytest.raises(ValueError, match=f"reduced_by .* goes with device_grads 'copy_when_reduced' .* or "
                                             f"'copy_at_step' .*, got device_grads='{device_grads}'"):
            OffloadOptimizer(FusedSGD(model.parameters(), lr=0.1), names, copy_on_cpu=True, device_grads=device_grads,
                             reduced_by=reduced_by)
    opt = OffloadOptimizer(FusedSGD(model.parameters(), lr=0.1), names, bucket_size_mb=0.002, copy_on_cpu=True,
                           stream_cpu_step=True)
    model(torch.randn(4, 24)).sum().backward()
    with pytest.raises(RuntimeError, match=r"gradients\(\) after the streamed CPU step began"):
        opt.gradients()
    with pytest.raises(RuntimeError, match="may not need every gradient first"):
        opt.step(check_finite=True)
    opt.close()


def test_a_second_backward_is_refused_unless_the_optimizer_is_told_it_accumulates():
    """Two backwards before a step: the first one's updates have started (their weights may
    have reached the second forward), so it is an error, every time (it was a result that
    depended on the worker's progress); told (``accumulating`` for the first), the run
    ends where the unstreamed one ends."""
    def run(stream, told):
        model = _net()
        opt = OffloadOptimizer(FusedAdam(model.parameters(), lr=1e-2), {p: n for n, p in model.named_parameters()},
                               bucket_size_mb=0.002, copy_on_cpu=True, stream_cpu_step=stream)
        g = torch.Generator().manual_seed(1)
        for _ in range(4):
            opt.zero_grad()
            for i in range(2):
                opt.accumulating = told and i == 0
                model(torch.randn(16, 24, generator=g)).square().mean().backward()
            opt.step()
        opt.close()
        return model

    for _ in range(3):
        with pytest.raises(RuntimeError, match=r"second backward before step\(\) .* optimizer.accumulating = True "
                                               r".* speculate=True"):
            run(True, told=False)
    plain = run(False, told=False)
    assert all(torch.equal(a, b) for a, b in zip(run(True, told=True).parameters(), plain.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(run(False, told=True).parameters(), plain.parameters()))


def _fit(strategy, **kw):
    model = Model(lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9), sched=True)
    trainer = L.Trainer(strategy=strategy, accelerator=ACCELERATOR, devices=1, max_epochs=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **kw)
    trainer.fit(model, _data())
    return model


@pytest.mark.parametrize("kw,said", [
    ({}, "each host bucket's CPU update starts during backward"),
    ({"gradient_clip_val": 0.5}, "is speculated during backward, once its gradients have landed, and checked at the "
                                 "step (gradient clipping)"),
    ({"accumulate_grad_batches": 2}, "each host bucket's CPU update starts during backward"),
], ids=["streamed", "clipping", "accumulation"])
def test_under_the_trainer_it_streams_where_it_may_and_ends_where_trainer_ends(caplog, monkeypatch, kw, said):
    import logging

    monkeypatch.setattr(logging.getLogger("lightning.pytorch"), "propagate", True)
    strategy = FastOptStrategy(offload_fraction=0.5, bucket_size_mb=0.0002, copy_on_cpu=True, stream_cpu_step=True)
    with caplog.at_level(logging.INFO):
        ours = _fit(strategy, **kw)
    assert said in caplog.text
    ref = _fit("auto", **kw)
    for a, b in zip(ours.parameters(), ref.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("zero_stage,route,fraction,said,streams", [
    (2, "copy_in_backward", 1.0, "is speculated during backward, once its gradients have landed", True),
    (0, "copy_at_step", 1.0, "is speculated during backward, once its gradients have been reduced and landed", True),
    (1, "copy_at_step", 1.0, "is speculated during backward, once its gradients have been reduced and landed", True),
    (0, "own-comm-hook", 1.0, "not used: a DDP communication hook of the run's own reduces the gradients", False),
    (0, "find-unused", 1.0, "not used: DDP finds the parameters no rank used only when backward has ended "
                            "(find_unused_parameters=True)", False),
    (2, "keep", 1.0, "not used: user code reads gradients before the step", False),
    (0, "copy_in_backward", 0.0, "not used: nothing is offloaded", False),
], ids=["zero2", "ddp", "zero1", "ddp-own-comm-hook", "ddp-find-unused", "readers", "nothing-offloaded"])
def test_the_plan_says_whether_and_how_the_step_streams(zero_stage, route, fraction, said, streams):
    """The choice the plan makes at set-up (the gradients' route is decided with it), said in
    one line: ZeRO stage 2 streams (each bucket once its reduction has landed), so do DDP
    and ZeRO stage 1 at two processes (DDP's buckets handed over as each all-reduce
    completes, checked with two processes in tests/test_streamed_step_two_ranks.py) unless
    the run has a communication hook of its own."""
    from lightning_fastopt.core.options import StrategyOptions
    from lightning_fastopt.plan import DDPRun, plan_ddp_run

    options = StrategyOptions(zero_stage=zero_stage, offload_fraction=fraction, copy_on_cpu=True,
                              stream_cpu_step=True)
    run = DDPRun(world_size=1 if route == "copy_in_backward" and zero_stage == 0 else 2, device=torch.device("cpu"),
                 readers=("Net.on_after_backward",) if route == "keep" else (),
                 step_checks=(("gradient clipping", True),), own_comm_hook=route == "own-comm-hook",
                 find_unused=route == "find-unused")
    plan = plan_ddp_run([FusedAdam([nn.Parameter(torch.zeros(3))])], options, run)
    assert any(said in line for line in plan.lines()), plan.lines()
    schedule = plan.optimizers[0].schedule
    assert schedule.streams is streams
    assert schedule.engine_arguments() == ({"stream_cpu_step": True, "speculate": True} if streams else {})
    assert plan.gradients.kind == {"own-comm-hook": "copy_at_step", "find-unused": "copy_at_step"}.get(route, route)


def test_ddps_buckets_are_handed_over_to_the_engines_as_each_is_reduced(monkeypatch):
    """Where the plan streams DDP's gradients, the strategy hands each reduced bucket to its
    engines (:meth:`~lightning_fastopt.trainer.engine_set.EngineSet.hand_over`), through one
    :class:`~lightning_fastopt.core.ddp_reductions.DDPReductions` a run."""
    from lightning_fastopt import FastOptPrecision
    from lightning_fastopt.trainer import strategy as trainer_strategy

    class Reductions:  # DDP's, without processes: what the strategy hands the optimizer
        def __init__(self, ddp, on_reduced):
            self.on_reduced = on_reduced

        def reduces(self, param):
            return True

    monkeypatch.setattr(trainer_strategy, "DDPReductions", Reductions)
    strategy = FastOptStrategy(copy_on_cpu=True, stream_cpu_step=True, parallel_devices=[torch.device("cpu")],
                               precision_plugin=FastOptPrecision("32-true"))
    reductions = strategy._reductions()
    assert strategy._reductions() is reductions and reductions.on_reduced == strategy._engines.hand_over
