"""ZeRO benchmark: per-rank optimizer memory, gradient memory and iteration time for stages
0, 1 and 2 at 2 ranks, measured in one run (2 gloo processes on the CPU).

    python benchmarks/zero.py            # ~20M float32 parameters
    python benchmarks/zero.py --quick    # tiny model, to check the script runs

Each rank runs forward and backward on its own batch of 8, then what the strategy does:
stage 0: average the gradients (an all-reduce in buckets, as DDP) and update every
parameter (FusedAdam in an OffloadOptimizer, offload_fraction 0); stage 1: the same
all-reduce, each rank updates what it owns (ZeroOptimizer) and owners broadcast it;
stage 2: backward hooks reduce each bucket of gradients to its owner while backward goes
on, the others free theirs, then update and broadcast.  Reported per rank: optimizer
state kept (Adam: 8 bytes/param; float32 weights are their own masters), gradient bytes
held when the update starts, and the median iteration time (forward to broadcast).

Target (issue 4): stages 1 and 2 keep 1/N of the optimizer state per rank (here 1/2),
within one tensor of the ideal split; stage 2 also 1/N of the gradients.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lightning_fastopt import FusedAdam, OffloadOptimizer  # noqa: E402
from lightning_fastopt.zero import ZeroOptimizer  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _all_reduce_grads(params, bucket_elems: int) -> None:
    """Average the gradients over the ranks, in buckets (what DDP does during backward)."""
    world = dist.get_world_size()
    for p in params:
        flat = p.grad.reshape(-1)
        for start in range(0, flat.numel(), bucket_elems):
            chunk = flat[start:start + bucket_elems]
            dist.all_reduce(chunk)
        flat.div_(world)


def _worker(rank: int, world: int, port: int, args, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    results = {}
    for stage in (0, 1, 2):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.layers)])
        params = list(model.parameters())
        names = {p: n for n, p in model.named_parameters()}
        fused = FusedAdam(params, lr=1e-4, weight_decay=0.01)
        opt = (OffloadOptimizer(fused, names, offload_fraction=0.0) if stage == 0
               else ZeroOptimizer(fused, names, stage=stage, bucket_size_mb=args.bucket_mb))
        x = torch.randn(8, args.width, generator=torch.Generator().manual_seed(rank))
        times, grad_bytes = [], 0
        for i in range(args.repeat + 2):
            opt.zero_grad()
            dist.barrier()
            t0 = time.perf_counter()
            model(x).square().mean().backward()
            if stage < 2:
                _all_reduce_grads(params, int(args.bucket_mb * 2**20 / 4))
            else:
                opt.gradients()  # wait for the reductions to the owners
            grad_bytes = sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
            opt.step()
            dist.barrier()
            if i >= 2:
                times.append((time.perf_counter() - t0) * 1e3)
        state = sum(t.numel() * t.element_size() for p in params
                    for k, t in opt.state_of(p).items() if k != "step")
        results[stage] = dict(step_ms=statistics.median(times), state_bytes=state, grad_bytes=grad_bytes,
                              params=sum(p.numel() for p in params))
        opt.close()
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--width", type=int)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    args.width = args.width or (128 if args.quick else 1600)
    if args.quick:
        args.repeat = 2
    world = 2
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "results.json")
        mp.spawn(_worker, args=(world, _free_port(), args, out), nprocs=world, join=True)
        ranks = json.loads(Path(out).read_text())
    n = ranks[0]["0"]["params"]
    print(f"2 ranks (gloo, CPU), {n / 1e6:.1f}M float32 parameters, FusedAdam, torch {torch.__version__}")
    print("| stage | rank | optimizer state MiB | of stage 0 | gradients MiB at the update | iteration ms |")
    print("|---|---:|---:|---:|---:|---:|")
    for stage in ("0", "1", "2"):
        for r, res in enumerate(ranks):
            s = res[stage]
            base = res["0"]["state_bytes"]
            print(f"| {stage} | {r} | {s['state_bytes'] / 2**20:,.1f} | {s['state_bytes'] / base:.2f} "
                  f"| {s['grad_bytes'] / 2**20:,.1f} | {s['step_ms']:.1f} |")
    print(f"ideal sharded state: {8 * n / world / 2**20:,.1f} MiB per rank; "
          f"ideal sharded gradients: {4 * n / world / 2**20:,.1f} MiB")


if __name__ == "__main__":
    main()
