"""What noticing outside writes to the weights costs per optimizer step.

    python benchmarks/weight_watch.py                       # GPU if there is one (1B bf16), else CPU (250M)
    python benchmarks/weight_watch.py --numel 1e9 --dtype bfloat16 --tensors 400

The offload optimizer fingerprints every parameter that has a separate master twice per
step (after its own write, and before the next step, compared in one synchronization;
see ``lightning_fastopt.offload.weight_watch``).  This times both passes over weights of
the given total size split into ``--tensors`` tensors (a 1B GPT has a few hundred), as
the optimizer runs them (the multi-tensor CUDA kernel on a GPU) and in plain torch
operations (the same fingerprint), and reports them against the time to read the
weights twice at the device's copy bandwidth (``copy GB/s``, measured here with one
large device-to-device copy), the physical floor.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lightning_fastopt.offload.weight_watch import changed_since, fingerprints
from lightning_fastopt.ops import torch_backend


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, device, repeat):
    times = []
    for _ in range(repeat):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    gpu = torch.cuda.is_available()
    ap.add_argument("--numel", type=float, default=1e9 if gpu else 2.5e8)
    ap.add_argument("--tensors", type=int, default=400)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    device = torch.device("cuda" if gpu else "cpu")
    dtype = getattr(torch, args.dtype)
    per = int(args.numel) // args.tensors
    weights = [torch.randn(per, device=device).to(dtype) for _ in range(args.tensors)]
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    prints = fingerprints(weights)
    assert not any(changed_since(weights, prints))
    remember_ms = _time(lambda: fingerprints(weights), device, args.repeat)
    check_ms = _time(lambda: changed_since(weights, prints), device, args.repeat)
    torch_ms = 2 * _time(lambda: torch_backend.fingerprint(weights), device, args.repeat)
    big = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    out = torch.empty_like(big)
    copy_ms = _time(lambda: out.copy_(big), device, args.repeat)
    copy_gbs = 2 * nbytes / copy_ms / 1e6  # read + write
    floor_ms = 2 * nbytes / (copy_gbs * 1e6)  # two reads of the weights per step
    name = torch.cuda.get_device_name(device) if gpu else "CPU"
    step_ms = remember_ms + check_ms
    print("| device | weights | tensors | remember ms | check ms | per step ms | torch ops per step ms | vs torch "
          "| copy GB/s | floor ms | floor / per step |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    print(f"| {name} | {args.numel:.3g} {args.dtype} ({nbytes / 2**30:.2f} GiB) | {args.tensors} | {remember_ms:.2f} "
          f"| {check_ms:.2f} | {step_ms:.2f} | {torch_ms:.2f} | {torch_ms / step_ms:.1f}x | {copy_gbs:.0f} "
          f"| {floor_ms:.2f} | {floor_ms / step_ms:.0%} |")


if __name__ == "__main__":
    main()
