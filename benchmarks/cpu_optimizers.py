"""CPU optimizer-step benchmark: lightning_fastopt against torch, measured in one run.

    python benchmarks/cpu_optimizers.py            # the full table (about 3 minutes on 2 cores)
    python benchmarks/cpu_optimizers.py --quick    # tiny sizes, to check the script runs

For each parameter layout (50M float32 parameters in 1 tensor and in 8 tensors, and
2,000 tensors of 5k elements) it reports the median step time, Mparam/s, effective
memory bandwidth (bytes each algorithm must move per parameter, below) and the ratio
against torch measured in the same process.  The physical limit is the machine's
in-place read-modify-write bandwidth, measured first.

Bytes per parameter (float32 unless said): Adam 28 (read p,g,m,v; write p,m,v);
mixed-precision Adam 28 (bf16 g 2, p 8, m 8, v 8, bf16 copy 2; the finite check's extra
read of the grads is not counted), 20 with bfloat16 moments (``adam-mixed-bf16-state``:
m 4, v 4; the offload strategy's ``host_state_dtype="bfloat16"``); SGD with momentum, Adagrad and Lion 20; LAMB 44
(a norm pass over g, a moments pass, an apply pass); LAMB on FSDP2's rows 44 too
(``lamb-rows``: the update's norms first, which the ranks sum, read p,g,m,v; then one pass
given them: read p,g,m,v, write p,m,v; 56 before 2026-11-27, when it ran both passes
after the norms); LARS 28; clipped Adam (``adam-clipped``: the gradients multiplied by
clipping's coefficient first) 28, the multiply read in the update's pass (``grad_factors``;
a pass of its own, as the offload step took it before 2026-11-29 and torch takes it, moves
8 more: read g, write g).

Targets (issue 2): FusedAdam >= 1.0x torch AdamW(fused=True) and >= 5x the torch
default (foreach=False); the fused mixed-precision step >= 2.5x the best torch
composition; LAMB, SGD, Lion, Adagrad >= 1.0x torch's fastest CPU equivalent.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lightning_fastopt import FusedAdagrad, FusedAdam, FusedLAMB, FusedLars, FusedLion, FusedSGD  # noqa: E402
from lightning_fastopt.functional import fused_adam_  # noqa: E402
from lightning_fastopt.ops import cpu_backend  # noqa: E402

BYTES = {"adam": 28, "adam-clipped": 28, "adam-mixed": 28, "adam-mixed-bf16-state": 20, "sgd": 20, "adagrad": 20, "lion": 20, "lamb": 44,
         "lamb-rows": 44, "lars": 28}


def median_time(fn: Callable[[], object], repeat: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def interleaved_medians(steps: list[Callable[[], object]], repeat: int, warmup: int = 2) -> list[float]:
    """Median time of each step function, run round-robin (one step of each per round) so
    that drift in the machine's speed (shared hosts) affects every implementation alike."""
    for _ in range(warmup):
        for fn in steps:
            fn()
    times: list[list[float]] = [[] for _ in steps]
    for _ in range(repeat):
        for fn, ts in zip(steps, times):
            start = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - start)
    return [statistics.median(ts) for ts in times]


def rmw_bandwidth(n: int) -> float:
    """In-place read-modify-write GB/s (8 bytes per element), as an optimizer touches memory."""
    a = torch.rand(n)
    t = median_time(lambda: torch.mul(a, 1.0001, out=a), repeat=7)
    return 8 * n / t / 1e9


def make_params(sizes, with_grads=True, grad_dtype=torch.float32):
    params = [torch.nn.Parameter(torch.randn(n)) for n in sizes]
    if with_grads:
        for p in params:
            p.grad = torch.randn(p.shape, dtype=grad_dtype)
    return params


# ---------------------------------------------------------------- torch compositions
def torch_lamb_foreach(params, state, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-6, wd=0.01, max_grad_norm=1.0):
    """LAMB (apex semantics) written with torch's foreach ops: the fastest torch form."""
    grads = [p.grad for p in params]
    if not state:
        state["m"] = [torch.zeros_like(p) for p in params]
        state["v"] = [torch.zeros_like(p) for p in params]
        state["step"] = 0
    state["step"] += 1
    step = state["step"]
    norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
    clip = torch.clamp(norm / max_grad_norm, min=1.0)
    g = torch._foreach_div(grads, clip)
    torch._foreach_mul_(state["m"], beta1)
    torch._foreach_add_(state["m"], g, alpha=1 - beta1)
    torch._foreach_mul_(state["v"], beta2)
    torch._foreach_addcmul_(state["v"], g, g, 1 - beta2)
    num = torch._foreach_div(state["m"], 1 - beta1 ** step)
    den = torch._foreach_div(state["v"], 1 - beta2 ** step)
    torch._foreach_sqrt_(den)
    torch._foreach_add_(den, eps)
    torch._foreach_div_(num, den)
    data = [p.data for p in params]
    torch._foreach_add_(num, data, alpha=wd)
    pn = torch._foreach_norm(data)
    un = torch._foreach_norm(num)
    ratios = [torch.where((a > 0) & (b > 0), a / b, torch.ones_like(a)) * -lr for a, b in zip(pn, un)]
    torch._foreach_mul_(num, ratios)
    torch._foreach_add_(data, num)


def torch_lion_foreach(params, state, lr=1e-4, beta1=0.9, beta2=0.99, wd=0.01):
    grads = [p.grad for p in params]
    data = [p.data for p in params]
    if not state:
        state["m"] = [torch.zeros_like(p) for p in params]
    torch._foreach_mul_(data, 1 - lr * wd)
    c = torch._foreach_lerp(state["m"], grads, 1 - beta1)
    torch._foreach_sign_(c)
    torch._foreach_add_(data, c, alpha=-lr)
    torch._foreach_lerp_(state["m"], grads, 1 - beta2)


def torch_lars_foreach(params, state, lr=0.1, momentum=0.9, eeta=1e-3, wd=1e-4):
    grads = [p.grad for p in params]
    data = [p.data for p in params]
    if not state:
        state["buf"] = [torch.zeros_like(p) for p in params]
    pn = torch._foreach_norm(data)
    gn = torch._foreach_norm(grads)
    local = [torch.where((a > 0) & (b > 0), eeta * a / (b + wd * a), torch.ones_like(a)) * -lr
             for a, b in zip(pn, gn)]
    torch._foreach_mul_(state["buf"], momentum)
    torch._foreach_add_(state["buf"], grads)
    torch._foreach_add_(state["buf"], data, alpha=wd)
    torch._foreach_add_(data, torch._foreach_mul(state["buf"], local))


# ---------------------------------------------------------------- one algorithm
def implementations(name: str, sizes) -> list[tuple[str, Callable[[], object]]]:
    """[(label, step function)] for an algorithm, ours first; all built up front so that
    their steps can be interleaved."""
    impls: list[tuple[str, Callable[[], object]]] = []

    def optimizer(label, make):
        opt = make(make_params(sizes))
        impls.append((label, opt.step))

    def composition(label, step):
        params = make_params(sizes)
        state: dict = {}
        impls.append((label, lambda: step(params, state)))

    if name == "adam":
        optimizer("lightning_fastopt FusedAdam", lambda p: FusedAdam(p, lr=1e-3, weight_decay=0.01))
        optimizer("torch AdamW(fused=True)", lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True))
        optimizer("torch AdamW(foreach=True)", lambda p: torch.optim.AdamW(p, lr=1e-3, foreach=True))
        optimizer("torch AdamW(foreach=False) [default]", lambda p: torch.optim.AdamW(p, lr=1e-3, foreach=False))
        try:
            from deepspeed.ops.adam import DeepSpeedCPUAdam
        except Exception as err:  # not installed, or its build fails
            print(f"# DeepSpeedCPUAdam not measured: {type(err).__name__}: {str(err)[:120]}", file=sys.stderr)
        else:
            optimizer("DeepSpeedCPUAdam", lambda p: DeepSpeedCPUAdam(p, lr=1e-3, weight_decay=0.01))
    elif name == "adam-clipped":
        impls += clipped_implementations(sizes)
    elif name == "adam-mixed":
        impls += mixed_precision_implementations(sizes)
    elif name == "adam-mixed-bf16-state":  # ours with bfloat16 moments, against the same torch compositions
        impls += mixed_precision_implementations(sizes, state_dtype=torch.bfloat16)
    elif name == "sgd":
        kw = dict(lr=1e-2, momentum=0.9, weight_decay=1e-4)
        optimizer("lightning_fastopt FusedSGD", lambda p: FusedSGD(p, **kw))
        optimizer("torch SGD(fused=True)", lambda p: torch.optim.SGD(p, fused=True, **kw))
        optimizer("torch SGD(foreach=True)", lambda p: torch.optim.SGD(p, foreach=True, **kw))
        optimizer("torch SGD(foreach=False)", lambda p: torch.optim.SGD(p, foreach=False, **kw))
    elif name == "adagrad":
        optimizer("lightning_fastopt FusedAdagrad", lambda p: FusedAdagrad(p, lr=1e-2))
        optimizer("torch Adagrad(fused=True)", lambda p: torch.optim.Adagrad(p, lr=1e-2, fused=True))
        optimizer("torch Adagrad(foreach=True)", lambda p: torch.optim.Adagrad(p, lr=1e-2, foreach=True))
        optimizer("torch Adagrad(foreach=False)", lambda p: torch.optim.Adagrad(p, lr=1e-2, foreach=False))
    elif name == "lion":
        optimizer("lightning_fastopt FusedLion", lambda p: FusedLion(p, lr=1e-4, weight_decay=0.01))
        composition("torch foreach Lion", torch_lion_foreach)
    elif name == "lamb":
        optimizer("lightning_fastopt FusedLAMB", lambda p: FusedLAMB(p, lr=1e-3, weight_decay=0.01))
        composition("torch foreach LAMB", torch_lamb_foreach)
    elif name == "lamb-rows":  # as fastopt_fsdp steps each rank's rows (one rank: the sums are the whole tensors')
        optimizer("lightning_fastopt FusedLAMB on rows (norms given)", lambda p: _given_norms(
            FusedLAMB(p, lr=1e-3, weight_decay=0.01)))
        composition("torch foreach LAMB", torch_lamb_foreach)
    elif name == "lars":
        optimizer("lightning_fastopt FusedLars", lambda p: FusedLars(p, lr=0.1, momentum=0.9, weight_decay=1e-4))
        composition("torch foreach LARS", torch_lars_foreach)
    return impls


class _given_norms:
    """An optimizer stepped as ``LocalShardOptimizer`` steps LAMB on FSDP2's rows: the
    update's squared norms taken first (what the ranks sum), then given to the step."""

    def __init__(self, opt) -> None:
        self.opt = opt
        self.params = [p for g in opt.param_groups for p in g["params"]]

    def step(self) -> None:
        context = self.opt.step_context([p.grad for p in self.params], None)
        self.opt.given_norms = self.opt.norm_sums(None, context)
        self.opt.step()


def clipped_implementations(sizes) -> list[tuple[str, Callable[[], object]]]:
    """AdamW on gradients clipped by norm (their multiply by the coefficient, a float32
    tensor as ``clip_grad_norm_`` passes it; the norm itself is taken elsewhere, on the
    device, in an offloaded run): ours reading them multiplied in the update's pass, ours
    and torch's fused step after a multiply in place of its own.  The gradients are
    multiplied again at every step (by a coefficient near 1: they stay in range)."""
    coef = torch.tensor(0.999)

    def ours_fused():
        params = make_params(sizes)
        opt = FusedAdam(params, lr=1e-3, weight_decay=0.01)
        return lambda: (setattr(opt, "grad_factors", (float(coef),)), opt.step())

    def multiplied_first(make):
        params = make_params(sizes)
        opt, grads = make(params), [p.grad for p in params]
        return lambda: (torch._foreach_mul_(grads, coef), opt.step())

    return [("lightning_fastopt FusedAdam, the multiply in its pass (grad_factors)", ours_fused()),
            ("lightning_fastopt FusedAdam after a multiply pass", multiplied_first(
                lambda p: FusedAdam(p, lr=1e-3, weight_decay=0.01))),
            ("torch AdamW(fused=True) after a multiply pass", multiplied_first(
                lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True)))]


def mixed_precision_implementations(sizes, state_dtype=torch.float32) -> list[tuple[str, Callable[[], object]]]:
    """bf16 grads in, unscale, overflow check, fp32 AdamW update, bf16 param copy out
    (ours with its moments in ``state_dtype``; torch's always float32)."""
    scale = 1024.0
    grads = [torch.randn(n, dtype=torch.bfloat16) for n in sizes]
    masters = [torch.randn(n) for n in sizes]
    m = [torch.zeros(n, dtype=state_dtype) for n in sizes]
    v = [torch.zeros(n, dtype=state_dtype) for n in sizes]
    copies = [torch.empty(n, dtype=torch.bfloat16) for n in sizes]
    state = {"step": 0}

    def ours():
        state["step"] += 1
        fused_adam_(masters, grads, m, v, step=state["step"], lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                    weight_decay=0.01, grad_scale=scale, check_finite=True, param_copies=copies)

    # torch's best form: preallocated float32 grad buffers (no allocation per step), the
    # fused check-and-unscale, fused AdamW, one foreach copy out.
    params = [torch.nn.Parameter(torch.randn(n)) for n in sizes]
    g32 = [torch.empty(n) for n in sizes]
    for p, g in zip(params, g32):
        p.grad = g
    opt = torch.optim.AdamW(params, lr=1e-3, fused=True)
    torch_copies = [torch.empty(n, dtype=torch.bfloat16) for n in sizes]
    found_inf = torch.zeros(())
    inv_scale = torch.full((), 1.0 / scale)
    detached = [p.detach() for p in params]

    def torch_composition():
        torch._foreach_copy_(g32, grads)
        found_inf.zero_()
        torch._amp_foreach_non_finite_check_and_unscale_(g32, found_inf, inv_scale)
        if found_inf.item() == 0:
            opt.step()
        torch._foreach_copy_(torch_copies, detached)

    def torch_composition_as_written():
        # the composition as usually written (and as issue 2 states it): grad.float() allocates
        g = [x.float() for x in grads]
        found_inf.zero_()
        torch._amp_foreach_non_finite_check_and_unscale_(g, found_inf, inv_scale)
        if found_inf.item() == 0:
            for p, x in zip(params, g):
                p.grad = x
            opt.step()
        torch._foreach_copy_(torch_copies, detached)

    label = "lightning_fastopt fused_adam_ (one pass" + (", bfloat16 moments)" if state_dtype != torch.float32 else ")")
    return [(label, ours),
            ("torch: preallocated fp32 grads + check/unscale + AdamW(fused) + copy out", torch_composition),
            ("torch: grad.float() + check/unscale + AdamW(fused) + copy out", torch_composition_as_written)]


LAYOUTS = {
    "50M x 1": [50_000_000],
    "50M x 8": [6_250_000] * 8,
    "2000 x 5k": [5_000] * 2000,
}
QUICK_LAYOUTS = {"1M x 1": [1_000_000], "200 x 5k": [5_000] * 200}
ALGORITHMS = ["adam", "adam-clipped", "adam-mixed", "adam-mixed-bf16-state", "sgd", "adagrad", "lion", "lamb", "lamb-rows", "lars"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, few repeats (checks the script)")
    parser.add_argument("--algorithms", default=",".join(ALGORITHMS))
    parser.add_argument("--repeat", type=int, default=None)
    parser.add_argument("--out", help="also write the markdown table to this file")
    args = parser.parse_args(argv)

    layouts = QUICK_LAYOUTS if args.quick else LAYOUTS
    repeat = args.repeat or (3 if args.quick else 9)
    backend = cpu_backend()
    bw = rmw_bandwidth(2_000_000 if args.quick else 100_000_000)
    lines = [
        f"CPU: {torch.get_num_threads()} threads, backend {getattr(backend, 'isa', '?')}, torch {torch.__version__}",
        f"Measured in-place read-modify-write bandwidth: {bw:.1f} GB/s "
        f"(fp32 Adam limit at 28 B/param: {bw / 28 * 1e3:.0f} Mparam/s)",
        "",
        "| layout | algorithm | implementation | ms/step | Mparam/s | GB/s | ours vs this |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    print("\n".join(lines), flush=True)
    for layout, sizes in layouts.items():
        n = sum(sizes)
        for algo in args.algorithms.split(","):
            impls = implementations(algo, sizes)
            results = list(zip([label for label, _ in impls], interleaved_medians([f for _, f in impls], repeat)))
            del impls
            gc.collect()
            ours = results[0][1]
            for label, t in results:
                ratio = "—" if label == results[0][0] else f"{t / ours:.2f}x"
                row = (f"| {layout} | {algo} | {label} | {t * 1e3:.2f} | {n / t / 1e6:.0f} | "
                       f"{BYTES[algo] * n / t / 1e9:.1f} | {ratio} |")
                lines.append(row)
                print(row, flush=True)
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
