"""The CPU step with the offloaded masters and state on a disk (``offload_optimizer_device="nvme"``),
against the disk's own bandwidth and the same step in host memory, measured in one run.

    python benchmarks/disk_tier.py --dir /path/on/nvme            # 100M parameters (1.2 GB on disk)
    python benchmarks/disk_tier.py --dir /tmp --params 2e6 --quick  # a small run, to check the script
    python benchmarks/disk_tier.py --dir /path/on/nvme --tensors 1  # one tensor (an embedding), in pieces
    python benchmarks/disk_tier.py --dir /path/on/nvme --host-shares 0.25,0.5,0.75,auto  # the state split

First the disk: sequential direct-I/O reads, writes, and both at once (one half of the
threads reading while the others write, as the step does), in the step's own transfers
(:class:`~lightning_fastopt.runtime.direct_io.DirectFile`, 8 MiB per call, 4 in flight),
over a file of the state's size.  Then AdamW over ``--params`` float32 parameters on the
accelerator's path (``copy_on_cpu=True``: float32 masters apart, 12 bytes a parameter on
disk with the two moments), ``bucket_size_mb`` and ``nvme_window_mb`` as given: the median
step with the state in host memory, then on disk; the bytes the disk tier moves a step
(every bucket's region read and written back: 24 bytes a parameter once the window is
smaller than the state) and their rate as a share of the disk's rate reading and writing
at once.  The target (issue 53): at least 80% of it.  ``--tensors``: how many tensors the
parameters are (8 by default; 1: one tensor far larger than the window, stepped in pieces of
a bucket each, ``lightning_fastopt/offload/pieces.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import sys
import tempfile
import time
from concurrent.futures import wait
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from timeline import lanes_from_events, merge, profile  # noqa: E402

from lightning_fastopt import FusedAdam  # noqa: E402
from lightning_fastopt.offload import OffloadOptimizer  # noqa: E402
from lightning_fastopt.runtime.direct_io import DirectFile, aligned_empty  # noqa: E402


def disk_rates(directory: str, nbytes: int, block: int) -> dict[str, float]:
    """Bytes per second reading, writing, and both at once, over ``nbytes`` in ``block``-byte transfers."""
    nbytes = max(block, nbytes // block * block)
    f = DirectFile(directory, 2 * nbytes, what="benchmark")
    buffers = [aligned_empty(block) for _ in range(4)]
    for b in buffers:
        b.random_(0, 256)
    offsets = list(range(0, nbytes - block + 1, block))

    def run(kinds):
        started = time.perf_counter()
        pending = []
        for i, off in enumerate(offsets):
            kind = kinds[i % len(kinds)]
            buf = buffers[i % len(buffers)]
            pending.append(f.write_from(buf, off) if kind == "w" else f.read_into(buf, nbytes + off))
            if len(pending) >= 4:
                pending.pop(0).result()
        wait(pending)
        for p in pending:
            p.result()
        return len(offsets) * block / (time.perf_counter() - started)

    for off in offsets:  # the read half holds data (reserved blocks never written read as zeros, without I/O)
        f.write_from(buffers[0], nbytes + off).result()
    rates = {"write": run("w"), "read": run("r"), "read+write": run("rw")}
    f.close()
    return rates


def step_times(params: int, directory: str | None, bucket_mb: float, window_mb: float, steps: int,
               count: int = 8, host_state_gib: float | str | None = None,
               host_reserve_gib: float | None = None, dtype: torch.dtype = torch.float32,
               seen: dict | None = None) -> tuple[float, int]:
    """The median AdamW step (seconds) over ``count`` tensors of ``dtype`` (bfloat16: half
    weights and gradients beside float32 masters, as ``bf16-true`` runs) and the bytes the disk
    tier's file holds (``host_state_gib``: that much of the state kept in host memory, the rest
    on disk).  ``seen``: filled with what the last step's profile shows of the disk
    (:func:`disk_seen`)."""
    torch.manual_seed(0)
    tensors = [torch.randn(n).to(dtype).requires_grad_() for n in _split(params, count)]
    disk = dict(offload_optimizer_device="nvme", nvme_path=directory, nvme_window_mb=window_mb) if directory else {}
    if host_state_gib is not None:
        disk["host_state_gib"] = host_state_gib
        if host_state_gib == "auto":
            disk["host_reserve_gib"] = host_reserve_gib
    opt = OffloadOptimizer(FusedAdam(tensors, lr=1e-3, weight_decay=0.01), copy_on_cpu=True,
                           bucket_size_mb=bucket_mb, **disk)
    grads = [torch.randn_like(t) for t in tensors]
    times = []
    for i in range(steps):
        for t, g in zip(tensors, grads):
            t.grad = g  # (the step takes them to its host buffers and drops p.grad, as after backward)
        profiled = seen is not None and i == steps - 1  # the last step, with the profiler on
        with profile(gpu=False) if profiled else contextlib.nullcontext() as prof:
            started = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - started)
        if profiled:
            seen.update(disk_seen(lanes_from_events(prof.events()), times[-1]))
    held = opt.layout.tier.disk_bytes()
    opt.close()
    del opt, tensors, grads
    gc.collect()  # (the optimizer's buffers freed now: host_state_gib='auto' in the next run measures what is free)
    return statistics.median(times[1:]), held


def disk_seen(lanes: dict, step_s: float) -> dict[str, float]:
    """The disk lanes of a profiled step: how long some transfer was in flight (``busy_s``) and
    that share of the step: near 1, the schedule kept the disk busy, and a step above its bound
    comes from the disk's rate while busy, not from the disk waiting."""
    spans = merge([*lanes.get("disk read", []), *lanes.get("disk write", [])])
    busy = sum(e - s for s, e in spans) / 1e3
    return dict(busy_s=busy, busy_share=busy / step_s if step_s else 0.0)


def _split(total: int, parts: int) -> list[int]:
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None, help="a directory on the disk to measure (default: a temporary one)")
    parser.add_argument("--params", type=float, default=100e6)
    parser.add_argument("--bucket-mb", type=float, default=64.0)
    parser.add_argument("--window-mb", type=float, default=512.0)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="small buckets and window, three steps")
    parser.add_argument("--tensors", type=int, default=8, help="how many tensors the parameters are")
    parser.add_argument("--host-shares", default="",
                        help="also the state split: shares of it in host memory (host_state_gib), comma-separated, "
                             "'auto' among them, each beside its bound, e.g. 0.25,0.5,0.75,auto")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="the parameters' and gradients' dtype (bfloat16: float32 masters apart, as bf16-true)")
    parser.add_argument("--in-memory-share", type=float, default=1.0,
                        help="measure the step in host memory on this share of the parameters and scale it (a "
                             "state larger than host memory)")
    parser.add_argument("--host-reserve-gib", type=float, default=None,
                        help="with 'auto' among --host-shares: host_reserve_gib (a larger reserve leaves less "
                             "for the state: a split on a machine whose memory would hold all of it)")
    args = parser.parse_args()
    params = int(args.params)
    bucket, window, steps = (0.5, 8.0, 3) if args.quick else (args.bucket_mb, args.window_mb, args.steps)
    directory = args.dir or tempfile.mkdtemp()
    state = 12 * params
    print(f"disk: {directory}; AdamW over {params / 1e6:.0f}M {args.dtype} parameters in {args.tensors} tensor(s), "
          f"{state / 1e9:.2f} GB of masters "
          f"and moments; bucket_size_mb={bucket:g}, nvme_window_mb={window:g}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    rates = disk_rates(directory, min(state, 4 * 2**30), 8 * 2**20)
    measured = ", ".join(f"{k} {v / 1e9:.2f} GB/s" for k, v in rates.items())
    print(f"disk, direct I/O, 8 MiB transfers, 4 in flight: {measured}")
    dtype = getattr(torch, args.dtype)
    measured = args.in_memory_share
    in_memory, _ = step_times(max(1, round(params * measured)), None, bucket, window, steps, args.tensors, dtype=dtype)
    in_memory /= measured  # (the update is linear in the parameters)
    seen = {}
    on_disk, held = step_times(params, directory, bucket, window, steps, args.tensors, dtype=dtype, seen=seen)
    moved = 2 * held  # every region read and written back
    rate = moved / on_disk
    scaled = f" (measured on {measured:g} of the parameters, scaled)" if measured != 1 else ""
    print(f"step in host memory: {in_memory * 1e3:.0f} ms{scaled}; on disk: {on_disk * 1e3:.0f} ms "
          f"({on_disk / in_memory:.2f}x); the disk tier moved {moved / 1e9:.2f} GB a step: {rate / 1e9:.2f} GB/s, "
          f"{rate / rates['read+write']:.0%} of the disk's rate reading and writing at once (target >= 80%); "
          f"{_busy(seen, moved)}")
    for share in [s for s in args.host_shares.split(",") if s]:
        asked = "auto" if share == "auto" else float(share) * held / 2**30
        seen = {}
        split, on_disk_now = step_times(params, directory, bucket, window, steps, args.tensors, asked,
                                        args.host_reserve_gib, dtype, seen=seen)
        kept = 1.0 - on_disk_now / held if held else 1.0
        # the bound: the host share's update at the speed measured in host memory and the disk share's
        # regions read and written at the disk's rate (the faster of the disk's own measured above and
        # what the tier reached all on disk), overlapped; the first read and the last write of a bucket
        # cannot overlap an update
        disk_rate = max(rates["read+write"], rate)
        host_part = kept * in_memory
        disk_part = 2 * on_disk_now / disk_rate
        edges = 2 * min(held, bucket * 2**20 * 3) / disk_rate if on_disk_now else 0.0
        bound = max(host_part, disk_part) + edges
        print(f"host_state_gib={share if share == 'auto' else f'{asked:.3g}'} ({kept:.0%} of the state in host "
              f"memory): step {split * 1e3:.0f} ms, {on_disk / split:.2f}x faster than all on disk; bound "
              f"{bound * 1e3:.0f} ms (host update {host_part * 1e3:.0f}, disk {disk_part * 1e3:.0f}, edges "
              f"{edges * 1e3:.0f}): {split / bound:.2f}x the bound (target <= 1.15x); {_busy(seen, 2 * on_disk_now)}")


def _busy(seen: dict, moved: int) -> str:
    """The profiled step's disk: its busy share, and the rate while busy."""
    if not seen.get("busy_s"):
        return "the disk: nothing in flight"
    return (f"the last step's profile: a transfer in flight {seen['busy_share']:.0%} of the step, "
            f"{moved / seen['busy_s'] / 1e9:.2f} GB/s while one was")


if __name__ == "__main__":
    main()
