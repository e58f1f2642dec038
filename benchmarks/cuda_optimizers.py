"""GPU optimizer-step benchmark: lightning_fastopt's CUDA kernels against torch's fastest
implementations, measured in one process run.

    python benchmarks/cuda_optimizers.py                  # the tables (needs a GPU; ~5 min on an H100)
    python benchmarks/cuda_optimizers.py --sizes 100M     # one model size
    python benchmarks/cuda_optimizers.py --smoke          # tiny sizes on any device: checks the script runs

Parameters are laid out like a GPT's (per layer: qkv, proj, two MLP matrices, their
biases and two LayerNorms: 12 tensors of width 1024), so 100M parameters are about 100
tensors and 1B about 1,000.  Every row times ``optimizer.step()`` alone with CUDA events:
the median of ``--repeat`` steps after 5 warm-up steps, implementations one after another
on the same gradients.  Columns:

- ``ms``: the median step time; ``vs torch``: the torch row's time over this row's;
- ``GB/s``: the bytes the update must move (Adam fp32: read p, g, m, v and write p, m,
  v = 28 bytes per parameter) over the time, and ``of copy``: that as a share of the
  device-to-device copy bandwidth measured at the start (bytes read + written by
  ``dst.copy_(src)`` of 1 GiB).

Targets (issue 5): FusedAdam >= 1.0x torch.optim.AdamW(fused=True) at 100M-1B parameters
and >= 80% of the copy bandwidth; FusedLAMB >= 2x a torch foreach composition of LAMB;
FusedSGD, FusedLion and FusedAdagrad at least as fast as torch's fastest.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from lightning_fastopt import FusedAdagrad, FusedAdam, FusedLAMB, FusedLion, FusedSGD  # noqa: E402

WIDTH = 1024
LR, WD = 1e-4, 0.01


def gpt_shapes(n_params: int, width: int = WIDTH) -> list[tuple[int, ...]]:
    """Tensor shapes of a GPT-like stack with about n_params parameters."""
    layer = [(3 * width, width), (3 * width,), (width, width), (width,), (4 * width, width), (4 * width,),
             (width, 4 * width), (width,), (width,), (width,), (width,), (width,)]
    per_layer = sum(math.prod(s) for s in layer)
    return layer * max(1, round(n_params / per_layer))


class Timer:
    """Median CUDA-event (or wall-clock on the CPU) time of a callable, in ms."""

    def __init__(self, device: str, warmup: int, repeat: int) -> None:
        self.device, self.warmup, self.repeat = device, warmup, repeat

    def __call__(self, fn: Callable[[], None]) -> float:
        for _ in range(self.warmup):
            fn()
        times = []
        for _ in range(self.repeat):
            if self.device == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                import time

                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)


def copy_bandwidth(device: str, timer: Timer, nbytes: int) -> float:
    """Bytes read + written per second by one large device-to-device copy."""
    src = torch.empty(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3)


def make_params(shapes, device, dtype=torch.float32, grad_dtype=None, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    params = [torch.randn(s, device=device, generator=g).to(dtype).requires_grad_() for s in shapes]
    for p in params:
        p.grad = (torch.randn(p.shape, device=device, generator=g) * 1e-2).to(grad_dtype or dtype)
    return params


# ---------------------------------------------------------------------------- torch compositions
def foreach_lamb(params, lr=LR, betas=(0.9, 0.999), eps=1e-6, weight_decay=WD, max_grad_norm=1.0):
    """LAMB (apex FusedLAMB's rule) written with torch._foreach ops, as a user without our
    kernels would: global-norm clipping, moments, update, per-tensor trust ratios."""
    ms = [torch.zeros_like(p) for p in params]
    vs = [torch.zeros_like(p) for p in params]
    state = {"step": 0}

    @torch.no_grad()
    def step():
        state["step"] += 1
        b1, b2 = betas
        grads = [p.grad for p in params]
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
        clip = torch.clamp(norm / max_grad_norm, min=1.0)
        g = torch._foreach_div(grads, clip)
        torch._foreach_lerp_(ms, g, 1 - b1)
        torch._foreach_mul_(vs, b2)
        torch._foreach_addcmul_(vs, g, g, 1 - b2)
        bc1, bc2 = 1 - b1 ** state["step"], 1 - b2 ** state["step"]
        den = torch._foreach_mul(vs, 1 / bc2)
        torch._foreach_sqrt_(den)
        torch._foreach_add_(den, eps)
        u = torch._foreach_mul(ms, 1 / bc1)
        torch._foreach_div_(u, den)
        torch._foreach_add_(u, params, alpha=weight_decay)
        pn = torch.stack(torch._foreach_norm(params))
        un = torch.stack(torch._foreach_norm(u))
        ratio = torch.where((pn > 0) & (un > 0), pn / un, torch.ones_like(pn)) * -lr
        torch._foreach_mul_(u, list(ratio.unbind()))
        torch._foreach_add_(params, u)

    return step


def foreach_lion(params, lr=LR, betas=(0.9, 0.99), weight_decay=WD):
    """Lion written with torch._foreach ops (torch has no Lion)."""
    ms = [torch.zeros_like(p) for p in params]

    @torch.no_grad()
    def step():
        grads = [p.grad for p in params]
        c = torch._foreach_lerp(ms, grads, 1 - betas[0])
        torch._foreach_mul_(params, 1 - lr * weight_decay)
        torch._foreach_add_(params, torch._foreach_sign(c), alpha=-lr)
        torch._foreach_lerp_(ms, grads, 1 - betas[1])

    return step


def torch_adamw_with_bf16_copies(params_fp32, copies):
    """What a user does for bf16 weights with fp32 masters: fused AdamW on the masters, then
    copy them into the bf16 weights (the bf16 gradients are converted first)."""
    opt = torch.optim.AdamW(params_fp32, lr=LR, weight_decay=WD, fused=True)
    half_grads = [c.grad for c in copies]

    @torch.no_grad()
    def step():
        for p, g in zip(params_fp32, half_grads):
            p.grad = g.float()
        opt.step()
        torch._foreach_copy_(copies, params_fp32)

    return step


# ---------------------------------------------------------------------------- the tables
def bench_group(title, shapes, device, timer, copy_bw, rows, bytes_per_param, candidates, reference):
    """Time each candidate (name -> maker returning a step callable) on fresh parameters."""
    n = sum(math.prod(s) for s in shapes)
    results = {}
    for name, make in candidates.items():
        try:
            step = make(shapes)
            results[name] = timer(step)
        except (RuntimeError, ValueError, TypeError) as err:  # e.g. an option this torch lacks
            print(f"  {name}: skipped ({type(err).__name__}: {str(err).splitlines()[0]})", flush=True)
            continue
        finally:
            step = None
        if device == "cuda":
            torch.cuda.empty_cache()
    ref = results.get(reference) or min((t for k, t in results.items() if not k.startswith("lightning_fastopt")),
                                        default=math.nan)
    print(f"\n### {title}: {n / 1e6:.0f}M parameters in {len(shapes)} tensors\n", flush=True)
    print("| implementation | ms | vs torch | GB/s | of copy |")
    print("|---|---:|---:|---:|---:|")
    for name, ms in results.items():
        gbs = bytes_per_param * n / (ms * 1e-3) / 1e9
        share = gbs * 1e9 / copy_bw
        print(f"| {name} | {ms:.2f} | {ref / ms:.2f}x | {gbs:,.0f} | {share:.0%} |", flush=True)
        rows.append(dict(table=title, params=n, tensors=len(shapes), implementation=name, ms=ms,
                         speedup_vs_torch=ref / ms, gb_per_s=gbs, share_of_copy_bandwidth=share))


def stepper(opt):
    return lambda: opt.step()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="100M,300M,1000M", help="comma-separated parameter counts (M = million)")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, any device (checks the script runs)")
    ap.add_argument("--out", type=Path, help="also write the rows as JSON here")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.smoke:
        sys.exit("needs a CUDA GPU (use --smoke to check the script on the CPU)")
    sizes = [2_000_000] if args.smoke else [int(float(s.rstrip("M")) * 1e6) for s in args.sizes.split(",")]
    timer = Timer(device, warmup=2 if args.smoke else 5, repeat=3 if args.smoke else args.repeat)
    copy_bw = copy_bandwidth(device, timer, 2**24 if args.smoke else 2**30)
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    print(f"device: {name}; torch {torch.__version__} (CUDA {torch.version.cuda}); "
          f"device-to-device copy: {copy_bw / 1e9:,.0f} GB/s (read + write)", flush=True)
    from lightning_fastopt.ops import cuda_backend

    if device == "cuda" and cuda_backend() is None:
        sys.exit("the lightning_fastopt CUDA kernels did not build: see `python -m lightning_fastopt.ops info`")

    rows: list[dict] = []
    ours = "lightning_fastopt"
    for n in sizes:
        shapes = gpt_shapes(n)
        bench_group("Adam (fp32 params, grads and state)", shapes, device, timer, copy_bw, rows, 28, {
            f"{ours} FusedAdam": lambda s: stepper(FusedAdam(make_params(s, device), lr=LR, weight_decay=WD)),
            "torch AdamW(fused=True)": lambda s: stepper(torch.optim.AdamW(make_params(s, device), lr=LR,
                                                                           weight_decay=WD, fused=True)),
            "torch AdamW(foreach=True)": lambda s: stepper(torch.optim.AdamW(make_params(s, device), lr=LR,
                                                                             weight_decay=WD, foreach=True)),
        }, reference="torch AdamW(fused=True)")

        def ours_bf16(s):
            copies = make_params(s, device, torch.bfloat16)
            masters = [c.detach().float() for c in copies]
            opt = FusedAdam(masters, lr=LR, weight_decay=WD)
            opt.grad_source = {m: c.grad for m, c in zip(masters, copies)}
            opt.copies_to = {m: c.data for m, c in zip(masters, copies)}
            return stepper(opt)

        def torch_bf16(s):
            copies = make_params(s, device, torch.bfloat16)
            return torch_adamw_with_bf16_copies([c.detach().float() for c in copies], copies)

        bench_group("AdamW, bf16 weights and grads with fp32 masters", shapes, device, timer, copy_bw, rows, 28, {
            f"{ours} FusedAdam (bf16 copy in the same pass)": ours_bf16,
            "torch AdamW(fused=True) + copy to bf16": torch_bf16,
        }, reference="torch AdamW(fused=True) + copy to bf16")
        bench_group("LAMB (fp32)", shapes, device, timer, copy_bw, rows, 40, {
            f"{ours} FusedLAMB": lambda s: stepper(FusedLAMB(make_params(s, device), lr=LR, weight_decay=WD)),
            "torch foreach LAMB": lambda s: foreach_lamb(make_params(s, device)),
        }, reference="torch foreach LAMB")
        bench_group("SGD, momentum 0.9 (fp32)", shapes, device, timer, copy_bw, rows, 20, {
            f"{ours} FusedSGD": lambda s: stepper(FusedSGD(make_params(s, device), lr=LR, momentum=0.9)),
            "torch SGD(fused=True)": lambda s: stepper(torch.optim.SGD(make_params(s, device), lr=LR, momentum=0.9,
                                                                       fused=True)),
            "torch SGD(foreach=True)": lambda s: stepper(torch.optim.SGD(make_params(s, device), lr=LR, momentum=0.9,
                                                                         foreach=True)),
        }, reference=None)
        bench_group("Lion (fp32)", shapes, device, timer, copy_bw, rows, 20, {
            f"{ours} FusedLion": lambda s: stepper(FusedLion(make_params(s, device), lr=LR, weight_decay=WD)),
            "torch foreach Lion": lambda s: foreach_lion(make_params(s, device)),
        }, reference=None)
        bench_group("Adagrad (fp32)", shapes, device, timer, copy_bw, rows, 20, {
            f"{ours} FusedAdagrad": lambda s: stepper(FusedAdagrad(make_params(s, device), lr=LR)),
            "torch Adagrad(fused=True)": lambda s: stepper(torch.optim.Adagrad(make_params(s, device), lr=LR,
                                                                               fused=True)),
            "torch Adagrad(foreach=True)": lambda s: stepper(torch.optim.Adagrad(make_params(s, device), lr=LR,
                                                                                 foreach=True)),
        }, reference=None)
    if args.out:
        args.out.write_text(json.dumps(dict(device=name, torch=torch.__version__, copy_bandwidth=copy_bw,
                                            rows=rows), indent=2))


if __name__ == "__main__":
    main()
