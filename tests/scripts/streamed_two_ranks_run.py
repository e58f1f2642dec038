"""The CPU step streamed into backward across two gloo processes, under ZeRO stage 2 and
under DDP (its buckets handed over as each all-reduce completes): each configuration
trains twice on the same data, speculated during backward and at the step (synchronous),
through the accelerator code path on the CPU (``copy_on_cpu=True``).

    python tests/scripts/streamed_two_ranks_run.py OUT_DIR

Writes OUT_DIR/rank<r>.pt: for each configuration, both runs' weights, this rank's owned
optimizer state, the loss-scale facts and the speculative schedule's bucket counts; and,
under ``"timing"``, when each CPU update of a step started and when its backward ended
(a backward slowed down between layers, so that reductions land while it runs).
"""

import os
import sys
import time
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lightning_fastopt import FusedAdam, FusedLAMB, FusedSGD  # noqa: E402
from lightning_fastopt.core.ddp_reductions import DDPReductions  # noqa: E402
from lightning_fastopt.offload import OffloadOptimizer  # noqa: E402
from lightning_fastopt.offload.speculative import SpeculativeStep  # noqa: E402
from lightning_fastopt.zero import ZeroOptimizer  # noqa: E402
from tests.helpers import SlowBackward, spawn_two_ranks  # noqa: E402
from tests.test_speculative_step import Driver, _inputs  # noqa: E402
from tests.test_streamed_step import _net  # noqa: E402

STEPS = 14
ADAMW = lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.01)  # noqa: E731
# name: (optimizer, offload fraction, clipping norm, precision, steps whose batch has an inf on rank 1,
#        micro-batches, a per-step scheduler)
CONFIGS = {
    "clip-never": (ADAMW, 1.0, 1e9, "32-true", (), 1, False),
    "clip-always": (ADAMW, 1.0, 1e-4, "32-true", (), 1, False),
    "clip-sometimes": (ADAMW, 1.0, 0.06, "32-true", (), 1, False),
    "clip-sometimes-half": (ADAMW, 0.5, 0.06, "32-true", (), 1, False),
    "sgd-clip-sometimes": (lambda ps: FusedSGD(ps, lr=0.05, momentum=0.9), 0.5, 0.03, "32-true", (), 1, False),
    "fp16": (ADAMW, 0.5, 0.0, "16-mixed", (0, 5, 6, 11), 1, False),
    "fp16-and-clipping": (ADAMW, 1.0, 0.06, "16-mixed", (0, 5, 6, 11), 1, False),
    "accumulation-and-scheduler": (ADAMW, 0.5, 0.06, "32-true", (), 2, True),
    "lamb-global-norm": (lambda ps: FusedLAMB(ps, lr=1e-2, max_grad_norm=0.03), 0.5, 0.0, "32-true", (), 1, False),
}


def _zero(model, make_opt, fraction, speculate, **kw):
    opt = ZeroOptimizer(make_opt(model.parameters()), {p: n for n, p in model.named_parameters()}, stage=2,
                        offload_fraction=fraction, bucket_size_mb=0.002, copy_on_cpu=True,
                        stream_cpu_step=speculate, speculate=speculate, **kw)
    _speculate_every_step(opt.local)
    return opt


def _speculate_every_step(offload) -> None:
    """The mechanism's runs speculate at every step, whatever the last ones did (the
    schedule holds speculation back after misses: tests/test_speculative_step.py)."""
    if isinstance(offload.schedule, SpeculativeStep):
        offload.schedule.misses_allowed = offload.schedule.history


def _train(rank, speculate, make_opt, fraction, clip, precision, overflow_at, micro_batches, sched):
    model = _net()
    opt = _zero(model, make_opt, fraction, speculate)
    driver = Driver(precision, initial_scale_power=20, loss_scale_window=4, hysteresis=1)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.8) if sched else None
    for x in _inputs(STEPS, overflow_at if rank == 1 else (), seed=1 + rank):
        driver.train_step(opt, model, x, clip, micro_batches)
        if scheduler is not None:
            scheduler.step()
    schedule = opt.local.schedule
    out = {"weights": {n: p.detach().clone() for n, p in model.named_parameters()},
           "state": {n: {k: v.clone() for k, v in opt.state_of(p).items()} for n, p in model.named_parameters()},
           "loss_scale": driver.loss_scale, "skipped_steps": driver.skipped_steps,
           "host_buckets": len(opt.local.layout.buckets),
           "totals": dict(schedule.totals) if isinstance(schedule, SpeculativeStep) else {}}
    opt.close()
    return out


class _Slow(nn.Module):
    def forward(self, x):
        return SlowBackward.apply(x)


def _timing():
    """A step's CPU update start times and its backward's end, at the third step."""
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(64, 64), _Slow())])
    opt = _zero(model, ADAMW, 1.0, True)
    driver = Driver("32-true")
    started, run = [], opt.local.updates.run  # (every update goes through it)

    def timed(inner, plan, *args):
        if inner is not opt.local.layout.device_inner:
            started.append(time.perf_counter())
        return run(inner, plan, *args)

    opt.local.updates.run = timed
    for _ in range(3):
        started.clear()
        driver.announce_grad_scale(opt)
        opt.zero_grad()
        model(torch.randn(32, 64)).square().mean().backward()
        ended = time.perf_counter()
        driver.clip_scaled_gradients(opt, 1e9)
        driver._step(opt)
    out = {"started": list(started), "backward_ended": ended, "totals": dict(Counter(opt.local.schedule.totals)),
           "host_buckets": len(opt.local.layout.buckets)}
    opt.close()
    return out


def _ddp(rank, speculate, fraction, clip, precision, overflow_at, bucket_views, zero1=False):
    """DDP (buckets of one layer each) and the offload optimizer (or ZeRO stage 1's) fed
    DDP's buckets as each all-reduce completes, or DDP as it is with the step at the step;
    a backward slowed between layers, so that reductions complete while it runs."""
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(512, 512), _Slow())])
    ddp = DistributedDataParallel(model, bucket_cap_mb=1, gradient_as_bucket_view=bucket_views)
    kw = dict(offload_fraction=fraction, bucket_size_mb=1.0, copy_on_cpu=True, device_grads="copy_at_step",
              **({"stream_cpu_step": True, "speculate": True, "reduced_by": lambda p: True} if speculate else {}))
    names = {p: n for n, p in model.named_parameters()}
    opt = (ZeroOptimizer(ADAMW(model.parameters()), names, stage=1, **kw) if zero1
           else OffloadOptimizer(ADAMW(model.parameters()), names, **kw))
    offload = opt.local if zero1 else opt
    _speculate_every_step(offload)
    handed_over = []
    if speculate:
        def hand_over(grads):
            handed_over.extend(time.perf_counter() for _ in grads)
            for p, g in grads:
                opt.grad_reduced(p, g)
        reductions = DDPReductions(ddp, hand_over)
    driver = Driver(precision, initial_scale_power=20, loss_scale_window=4, hysteresis=1)
    g = torch.Generator().manual_seed(1 + rank)
    early = 0
    for t in range(6):
        x = torch.randn(16, 512, generator=g) * (4.0 if t % 3 == 0 else 0.25)
        if rank == 1 and t in overflow_at:
            x[0, 0] = float("inf")
        driver.announce_grad_scale(opt)
        opt.zero_grad()
        handed_over.clear()
        driver.pre_backward(ddp(x).square().mean(), ddp).backward()
        ended = time.perf_counter()
        early += sum(h < ended for h in handed_over)
        if driver._check_overflow(opt):
            driver._skip_step(opt)
            continue
        driver.clip_scaled_gradients(opt, clip)
        driver._step(opt)
    out = {"weights": {n: p.detach().clone() for n, p in model.named_parameters()},
           "state": {n: {k: v.clone() for k, v in opt.state_of(p).items()} for n, p in model.named_parameters()},
           "loss_scale": driver.loss_scale, "skipped_steps": driver.skipped_steps, "handed_over_in_backward": early,
           "host_buckets": len(offload.layout.buckets),
           "totals": dict(offload.schedule.totals) if isinstance(offload.schedule, SpeculativeStep) else {}}
    opt.close()
    if speculate:
        reductions.close()
    return out


# name: (offload fraction, clipping norm, precision, steps with an inf on rank 1, gradient_as_bucket_view[, ZeRO-1])
DDP_CONFIGS = {
    "ddp-clip-sometimes": (0.5, 2.0, "32-true", (), False),
    "ddp-fp16-and-clipping": (1.0, 2.0, "16-mixed", (0, 4), False),
    "ddp-gradients-as-bucket-views": (1.0, 2.0, "32-true", (), True),
    "zero1-fp16-and-clipping": (1.0, 2.0, "16-mixed", (0, 4), False, True),
}


def _worker(rank, port, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    results = {name: {"speculated": _train(rank, True, *config), "synchronous": _train(rank, False, *config)}
               for name, config in CONFIGS.items()}
    results["timing"] = _timing()
    results.update({name: {"speculated": _ddp(rank, True, *config), "synchronous": _ddp(rank, False, *config)}
                    for name, config in DDP_CONFIGS.items()})
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    spawn_two_ranks(_worker, sys.argv[1])
