"""Which rounding each ATen operation of torch's CUDA Adam steps takes, op by op.

For a GPU session: torch's for-loop (``foreach=False``) Adam/AdamW step on CUDA ended 1-2
ulp from our ``rounding="torch_cuda_for_loop"`` on an H100 with torch 2.11 (2026-11-26),
while the foreach one matched.  This runs each operation of both steps on CUDA tensors,
one at a time from the same inputs, and counts how often its result equals each candidate
rounding computed on the host (a fused multiply-add emulated in float64: exact but for
double rounding, about once in 2^29), so one call says which operation the model has wrong:

    python3 benchmarks/rounding_probe.py            # a table per step; a few seconds

The candidate that matches (nearly) every element is the operation's rounding.  Runs on
the CPU too (then it describes torch's CPU operations).
"""

from __future__ import annotations

import argparse

import torch

F32, F64 = torch.float32, torch.float64


def f32(x: torch.Tensor) -> torch.Tensor:
    return x.to(F32)


def fma(a, b, c) -> torch.Tensor:
    """float32 fused multiply-add, emulated: the float64 product is exact."""
    return f32(_64(a) * _64(b) + _64(c))


def _64(x):
    return x.to(F64) if isinstance(x, torch.Tensor) else torch.tensor(float(x), dtype=F64)


def _reciprocals_differ(x: float) -> bool:
    """Whether 1 / x rounds otherwise in float32 from float32 x than from the double."""
    as_float = torch.tensor(x, dtype=F32)
    return f32(1.0 / _64(as_float)).item() != f32(torch.tensor(1.0 / x, dtype=F64)).item()


def _share(result: torch.Tensor, candidate: torch.Tensor) -> float:
    return (result.cpu() == candidate.cpu()).double().mean().item()


def probe(device: str, n: int, seed: int) -> list[tuple[str, str, float]]:
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=g) * 0.3
    grad = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 3)  # many magnitudes
    m = torch.randn(n, generator=g) * 0.1
    v = torch.rand(n, generator=g) * 0.01
    lr, wd, beta1, beta2, eps = 1e-3, 0.05, 0.9, 0.999, 1e-8
    step = next(s for s in range(1, 1000) if _reciprocals_differ((1 - beta2 ** s) ** 0.5))  # tells them apart
    bc2s = (1 - beta2 ** step) ** 0.5
    step_size = lr / (1 - beta1 ** step)
    on = lambda t: t.clone().to(device)  # noqa: E731
    rows = []

    def row(op, result, candidates):
        for name, c in candidates.items():
            rows.append((op, name, _share(result, c)))

    # AdamW's decay: param.mul_(1 - lr * wd)
    decay = 1 - lr * wd
    row("p.mul_(1 - lr*wd)", on(p).mul_(decay), {"p * float(decay)": f32(_64(p) * _64(f32(torch.tensor(decay))))})
    # exp_avg.lerp_(grad, 1 - beta1) (weight < 0.5: self + w * (end - self))
    w = f32(torch.tensor(1 - beta1))
    row("m.lerp_(g, 1-beta1)", on(m).lerp_(on(grad), 1 - beta1),
        {"fma(w, g - m, m)": fma(w, f32(_64(grad) - _64(m)), m),
         "m + float(w * (g - m))": f32(_64(m) + _64(f32(_64(w) * _64(f32(_64(grad) - _64(m))))))})
    # exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2), for-loop; _foreach_addcmul_, foreach
    vb = f32(_64(v) * _64(f32(torch.tensor(beta2))))
    w2 = f32(torch.tensor(1 - beta2))
    gg = f32(_64(grad) * _64(grad))
    candidates = {"fma(w2, g*g, v*b2)": fma(w2, gg, vb), "fma(w2*g, g, v*b2)": fma(f32(_64(w2) * _64(grad)), grad, vb),
                  "v*b2 + float(w2 * g*g)": f32(_64(vb) + _64(f32(_64(w2) * _64(gg))))}
    row("v.mul_(b2).addcmul_(g, g, value=1-b2)", on(v).mul_(beta2).addcmul_(on(grad), on(grad), value=1 - beta2),
        candidates)
    vs, gs = [on(v)], [on(grad)]
    torch._foreach_mul_(vs, beta2)
    torch._foreach_addcmul_(vs, gs, gs, 1 - beta2)
    row("_foreach_mul_, _foreach_addcmul_", vs[0], candidates)
    # the bias correction: sqrt(v) / bias_correction2_sqrt (a host scalar), + eps
    root = on(v).sqrt().cpu()  # the device's square root: the division is what is probed
    row("v.sqrt()", root, {"IEEE sqrt": f32(_64(v).sqrt())})
    div_candidates = {"sqrt / float(bc2s)": f32(_64(root) / _64(f32(torch.tensor(bc2s)))),
                      "sqrt * (1.0f / float(bc2s))": f32(_64(root) * _64(f32(1.0 / _64(f32(torch.tensor(bc2s)))))),
                      "sqrt * float(1.0 / bc2s)": f32(_64(root) * _64(f32(torch.tensor(1.0 / bc2s, dtype=F64))))}
    row("v.sqrt() / bc2s", on(v).sqrt() / bc2s, div_candidates)
    roots = torch._foreach_sqrt([on(v)])
    torch._foreach_div_(roots, [bc2s])
    row("_foreach_sqrt, _foreach_div_([bc2s])", roots[0], div_candidates)
    # param.addcdiv_(exp_avg, denom, value=-step_size)
    denom = f32(_64(root) + eps)
    q = f32(_64(m) / _64(denom))
    ss = f32(torch.tensor(-step_size))
    add_candidates = {"fma(-ss, m/d, p)": fma(ss, q, p),
                      "p + float(-ss * (m/d))": f32(_64(p) + _64(f32(_64(ss) * _64(q)))),
                      "p + float((-ss * m) / d)": f32(_64(p) + _64(f32(_64(f32(_64(ss) * _64(m))) / _64(denom))))}
    row("p.addcdiv_(m, d, value=-ss)", on(p).addcdiv_(on(m), on(denom), value=-step_size), add_candidates)
    ps = [on(p)]
    torch._foreach_addcdiv_(ps, [on(m)], [on(denom)], [-step_size])
    row("_foreach_addcdiv_(.., [-ss])", ps[0], add_candidates)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=1 << 20)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"device: {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}; torch {torch.__version__}; "
          f"{args.n:,} elements; the bias correction at the first step where its two float32 reciprocals differ")
    print("\n| operation | candidate rounding | elements equal |\n|---|---|---:|")
    for op, name, share in probe(device, args.n, args.seed):
        print(f"| `{op}` | {name} | {share:.6%} |")


if __name__ == "__main__":
    main()
