"""The offloaded step on FSDP2's local shards across two gloo processes, against torch's
optimizer stepping the same DTensor parameters.

    python tests/scripts/fsdp_local_shards_run.py OUT_DIR

A model sharded by ``fully_shard`` (each Linear, then the root) whose rows do not divide
evenly (33 rows: 17 and 16; one row: rank 1 holds none) trains on each rank's own batches
twice from the same initial weights: with the torch optimizer (clipping by
``torch.nn.utils.clip_grad_norm_`` on the DTensor gradients), and with the same optimizer
taken over by a :class:`~lightning_fastopt.fsdp.LocalShardOptimizer` (through the
accelerator code path on the CPU, ``copy_on_cpu=True``; clipping as the fastopt precision
plugin clips; every step checks the gradients for overflow, as under fp16 loss scaling:
in ``adamw-overflow`` rank 1 alone finds an inf, and the step is skipped on both ranks,
as torch's run skips it).  Writes OUT_DIR/rank<r>.pt: for each configuration, both runs' full weights
and full optimizer state (gathered DTensors), the clipping norms, and what the engine says
of itself; for each of ``WHOLE_NORMS`` (LAMB, LARS), ours and the unsharded model's weights.
"""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lightning_fastopt import FusedLAMB, FusedLars  # noqa: E402
from lightning_fastopt.functional import by_device  # noqa: E402
from lightning_fastopt.fsdp import LocalShardOptimizer  # noqa: E402
from lightning_fastopt.optim.from_torch import to_fused_optimizer  # noqa: E402
from lightning_fastopt.optim.takeover import take_over  # noqa: E402
from tests.helpers import spawn_two_ranks  # noqa: E402

STEPS = 6
# name: (torch optimizer, offload fraction, clipping norm, micro-batches per step, LocalShardOptimizer's options)
OVERFLOW_AT = 2  # "adamw-overflow": rank 1 finds an inf in its rows of a gradient at this step
ADAMW = lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.01)  # noqa: E731
STREAMED = {"device_grads": "copy_when_reduced"}
SPECULATED = {"device_grads": "copy_when_reduced", "stream_cpu_step": True, "speculate": True}
CONFIGS = {
    "adamw-overflow": (lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.01), 0.5, 0.0, 1, {}),
    "adamw-0": (ADAMW, 0.0, 0.0, 1, {}),
    "adamw-half": (ADAMW, 0.5, 0.0, 1, {}),
    "adamw-1": (ADAMW, 1.0, 0.0, 1, {}),
    "adamw-clip-accumulate": (ADAMW, 0.5, 0.8, 2, {}),
    "sgd-momentum": (lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True), 1.0, 0.0, 1, {}),
    "adagrad": (lambda ps: torch.optim.Adagrad(ps, lr=0.05), 0.5, 0.0, 1, {}),
    "radam-own-step": (lambda ps: torch.optim.RAdam(ps, lr=1e-2), 0.5, 0.8, 1, {}),
    "streamed-clip-accumulate": (ADAMW, 0.5, 0.8, 2, STREAMED),
    "streamed-1-clip": (ADAMW, 1.0, 0.8, 1, STREAMED),
    "speculated-clip-accumulate": (ADAMW, 1.0, 0.8, 2, SPECULATED),
    "speculated-sgd-clip": (lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9), 0.5, 0.8, 1, SPECULATED),
}


# LAMB and LARS (norms over whole parameters, no torch reference): name: (our optimizer,
# offload fraction, clipping norm, micro-batches per step, whether each rank's rows take their
# own norms), against the same optimizer on the unsharded model stepped with the ranks' mean
# gradient (FSDP's)
WHOLE_NORMS = {
    "lamb-half": (lambda ps: FusedLAMB(ps, lr=1e-2, weight_decay=0.01), 0.5, 0.0, 1, False),
    "lamb-1-clip-accumulate": (lambda ps: FusedLAMB(ps, lr=1e-2, weight_decay=0.01, max_grad_norm=0.5), 1.0, 0.8, 2,
                               False),
    "lars-0": (lambda ps: FusedLars(ps, lr=0.5, momentum=0.9, weight_decay=1e-4), 0.0, 0.0, 1, False),
    "lars-1": (lambda ps: FusedLars(ps, lr=0.5, momentum=0.9, weight_decay=1e-4), 1.0, 0.8, 1, False),
    "lamb-half-own-rows": (lambda ps: FusedLAMB(ps, lr=1e-2, weight_decay=0.01), 0.5, 0.0, 1, True),
    "lars-1-own-rows": (lambda ps: FusedLars(ps, lr=0.5, momentum=0.9, weight_decay=1e-4), 1.0, 0.8, 1, True),
}


def _net(mesh, shard=True):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 33), nn.Tanh(), nn.Linear(33, 16), nn.Tanh(), nn.Linear(16, 1))
    if not shard:
        return model
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _batches(rank, micro_batches):
    g = torch.Generator().manual_seed(100 + rank)
    return [[(torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)) for _ in range(micro_batches)]
            for _ in range(STEPS)]


def _full(value):
    return value.full_tensor() if isinstance(value, DTensor) else value


def _train(rank, mesh, ours, make_opt, fraction, clip, micro_batches, options):
    model = _net(mesh)
    opt = make_opt(model.parameters())
    engine = None
    if ours:
        names = {p: n for n, p in model.named_parameters()}
        engine = LocalShardOptimizer(to_fused_optimizer(opt), names, offload_fraction=fraction, copy_on_cpu=True,
                                     bucket_size_mb=0.0005, **options)
        take_over(opt, engine)
    norms, overflow = [], make_opt is CONFIGS["adamw-overflow"][0]
    freed = []  # the offloaded gradients' p.grad dropped by the end of backward (streamed)
    for step, batches in enumerate(_batches(rank, micro_batches)):
        for i, (x, y) in enumerate(batches):
            if engine is not None:  # as the strategies say it: the micro-batches that do not step
                engine.accumulating = i < micro_batches - 1
            (nn.functional.mse_loss(model(x), y) / micro_batches).backward()
        if overflow and step == OVERFLOW_AT:  # skipped on every rank; torch's run skips it too
            if ours:
                if rank == 1:
                    p = next(p for p in model.parameters() if p.grad._local_tensor.numel())
                    p.grad._local_tensor.view(-1)[0] = float("inf")
                engine.step(check_finite=True)
                assert engine.last_step_skipped
            opt.zero_grad()
            continue
        if ours:
            freed.append(sum(p.grad is None for p in model.parameters()))
        if clip and ours:  # as the fastopt precision plugin clips (core.precision.clip_scaled_gradients)
            total = engine.gradient_norm()
            coef = torch.clamp(clip / (total + 1e-6), max=1.0)
            if coef != 1.0:
                for same in by_device(engine.gradients()):
                    torch._foreach_mul_(same, coef.to(same[0].device))
            norms.append(total)
        elif clip:
            norms.append(_full(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        if ours:
            engine.step(check_finite=True)
        else:
            opt.step()
        opt.zero_grad()
    names = {p: n for n, p in model.named_parameters()}
    if ours:
        state = {names[p]: {k: _full(v) for k, v in engine.state_of(p).items()} for p in names}
    else:
        state = {names[p]: {k: _full(v) for k, v in s.items()} for p, s in opt.state.items()}
    return {"weights": {n: _full(p.detach()) for n, p in model.named_parameters()}, "state": state, "norms": norms,
            "engine": repr(engine) if engine is not None else None,
            "held": engine.held_numel if engine is not None else None,
            "skipped": engine.skipped_steps if engine is not None else None, "freed": freed,
            "totals": dict(engine.local.schedule.totals) if engine is not None and hasattr(engine.local.schedule,
                                                                                       "totals") else {}}


def _train_whole_norms(rank, mesh, make_opt, fraction, clip, micro_batches, own_rows):
    """LAMB or LARS on this rank's rows (``LocalShardOptimizer``; ``own_rows``: each rank's
    rows taking their own norms, as if nothing summed them) and on the unsharded model,
    whose gradient is the mean of the two ranks' (each rank computes both)."""
    model, whole = _net(mesh), _net(mesh, shard=False)
    names = {p: n for n, p in model.named_parameters()}
    engine = LocalShardOptimizer(make_opt(model.parameters()), names, offload_fraction=fraction, copy_on_cpu=True,
                                 bucket_size_mb=0.0005)
    if own_rows:
        engine.local.before_updates = None
    reference = make_opt(whole.parameters())
    batches = [_batches(r, micro_batches) for r in (0, 1)]
    for step in range(STEPS):
        for i, (x, y) in enumerate(batches[rank][step]):
            engine.accumulating = i < micro_batches - 1
            (nn.functional.mse_loss(model(x), y) / micro_batches).backward()
        for r in (0, 1):
            for x, y in batches[r][step]:
                (nn.functional.mse_loss(whole(x), y) / micro_batches).backward()
        for p in whole.parameters():
            p.grad.mul_(0.5)
        if clip:
            total = engine.gradient_norm()
            coef = torch.clamp(clip / (total + 1e-6), max=1.0)
            if coef != 1.0:
                for same in by_device(engine.gradients()):
                    torch._foreach_mul_(same, coef.to(same[0].device))
            torch.nn.utils.clip_grad_norm_(whole.parameters(), clip)
        engine.step()
        reference.step()
        engine.zero_grad()
        reference.zero_grad()
    return {"weights": {n: _full(p.detach()) for n, p in model.named_parameters()},
            "reference": {n: p.detach().clone() for n, p in whole.named_parameters()}}


def _worker(rank, port, out_dir):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    initial = {n: _full(p.detach()) for n, p in _net(mesh).named_parameters()}
    results = {"initial": initial}
    results.update({name: {"torch": _train(rank, mesh, False, *config), "ours": _train(rank, mesh, True, *config)}
               for name, config in CONFIGS.items()})
    results.update({name: _train_whole_norms(rank, mesh, *config) for name, config in WHOLE_NORMS.items()})
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    spawn_two_ranks(_worker, sys.argv[1])
