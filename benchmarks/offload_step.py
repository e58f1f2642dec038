"""Offload benchmark: the optimizer step of OffloadOptimizer at offload_fraction 0, 0.5
and 1 against torch.optim.AdamW(fused=True), measured in one run.

    python benchmarks/offload_step.py             # GPU if there is one (~270M params), else CPU (~50M)
    python benchmarks/offload_step.py --quick     # tiny model, to check the script runs

The model is a stack of square Linear layers (float32 weights) fed a small batch, so the
optimizer step weighs as much as it does in large-model training.  For each
configuration, interleaved round by round, it reports the median of:

- ``step ms``: ``optimizer.step()`` alone, from a synchronized point after backward
  (offloaded: wait for the gradient copies still in flight, CPU update, copies back);
- ``iteration ms``: forward + backward + step + zero_grad (the copies overlap backward);
- ``peak device MiB``: ``torch.cuda.max_memory_allocated`` over one iteration (GPU);
- ``state on device / host``: bytes of master weights and optimizer state on each side
  (from ``lightning_fastopt.estimate_memory``).

On a CPU-only machine every share is updated by the CPU kernels in host memory and
there is no device memory to save: the rows show the overhead of the offload
machinery (buckets, inner optimizers) against the same fused kernels.

Target (issue 3): offload_fraction=1 keeps no optimizer state or master weight on the
GPU (16 bytes/param of fp32 AdamW training down to weights only, 4 bytes/param, plus
transient gradients); fraction 0 steps at least as fast as torch's fused AdamW.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lightning_fastopt import FusedAdam, OffloadOptimizer, estimate_memory  # noqa: E402


def build(width: int, layers: int, device: str) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)]).to(device)


def make_optimizer(kind: str, model: nn.Module, bucket_mb: float):
    if kind == "torch AdamW(fused=True)":
        return torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=True)
    fraction = float(kind.split("=")[1])
    names = {p: n for n, p in model.named_parameters()}
    return OffloadOptimizer(FusedAdam(model.parameters(), lr=1e-4, weight_decay=0.01), names,
                            offload_fraction=fraction, bucket_size_mb=bucket_mb)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def one_iteration(model, opt, x, device, timings):
    sync(device)
    t0 = time.perf_counter()
    model(x).square().mean().backward()
    sync(device)
    t1 = time.perf_counter()
    opt.step()
    sync(device)
    t2 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    sync(device)
    timings["step"].append((t2 - t1) * 1e3)
    timings["iteration"].append((time.perf_counter() - t0) * 1e3)


def overlapped_iteration(model, opt, x, device) -> float:
    """An iteration without the synchronize between backward and step (how training runs)."""
    sync(device)
    t0 = time.perf_counter()
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    sync(device)
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--width", type=int)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--bucket-mb", type=float, default=64.0)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, help="also write the results as JSON here")
    args = ap.parse_args()
    device = args.device
    width = args.width or (256 if args.quick else 8192 if device == "cuda" else 3584)
    repeat = 2 if args.quick else args.repeat
    kinds = ["torch AdamW(fused=True)", "offload_fraction=0", "offload_fraction=0.5", "offload_fraction=1"]

    runs = {}
    for kind in kinds:
        model = build(width, args.layers, device)
        opt = make_optimizer(kind, model, args.bucket_mb)
        x = torch.randn(args.batch, width, device=device)
        runs[kind] = (model, opt, x, {"step": [], "iteration": [], "overlapped": []})
    n_params = sum(p.numel() for p in runs[kinds[0]][0].parameters())
    print(f"device={device} params={n_params / 1e6:.1f}M threads={torch.get_num_threads()} "
          f"torch={torch.__version__}", flush=True)

    peak = {}
    for kind, (model, opt, x, _) in runs.items():  # warm up; peak memory of one iteration
        for _ in range(2):
            one_iteration(model, opt, x, device, {"step": [], "iteration": []})
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            one_iteration(model, opt, x, device, {"step": [], "iteration": []})
            peak[kind] = (torch.cuda.max_memory_allocated(), before)
    for _ in range(repeat):  # round robin: drift of a shared machine hits every row alike
        for model, opt, x, t in runs.values():
            one_iteration(model, opt, x, device, t)
            t["overlapped"].append(overlapped_iteration(model, opt, x, device))

    ref_step = statistics.median(runs[kinds[0]][3]["step"])
    rows = []
    header = ("| configuration | step ms | vs torch fused | iteration ms (overlapped) | peak device MiB "
              "| state+masters on device | on host |")
    print(header)
    print("|---|---:|---:|---:|---:|---:|---:|")
    for kind, (model, _, _, t) in runs.items():
        step = statistics.median(t["step"])
        over = statistics.median(t["overlapped"])
        fraction = 0.0 if kind.startswith("torch") else float(kind.split("=")[1])
        est = estimate_memory(model, offload_fraction=fraction, precision="32-true", optimizer="adamw")
        dev_state = est.gpu["master_weights"] + est.gpu["optimizer_state"]
        host_state = est.cpu["master_weights"] + est.cpu["optimizer_state"]
        if device == "cpu":  # one memory, and float32 weights are their own masters: state only
            dev_state, host_state = 0, est.gpu["optimizer_state"] + est.cpu["optimizer_state"]
        pk = f"{peak[kind][0] / 2**20:,.0f}" if kind in peak else "n/a (CPU)"
        print(f"| {kind} | {step:.2f} | {ref_step / step:.2f}x | {over:.2f} | {pk} | {dev_state / 2**20:,.0f} MiB "
              f"| {host_state / 2**20:,.0f} MiB |", flush=True)
        rows.append(dict(configuration=kind, step_ms=step, speed_vs_torch_fused=ref_step / step,
                         iteration_ms_overlapped=over, iteration_ms_synchronized=statistics.median(t["iteration"]),
                         peak_device_bytes=peak.get(kind, (None,))[0], device_state_bytes=dev_state,
                         host_state_bytes=host_state))
    if args.out:
        args.out.write_text(json.dumps(dict(device=device, params=n_params, rows=rows), indent=2))


if __name__ == "__main__":
    main()
