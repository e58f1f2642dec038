"""The torch-fused path that serves CUDA tensors until our CUDA kernels land, run here on
the CPU (torch ships the same kernels for both): FusedAdam and FusedSGD through it end on
the bits of torch's own fused optimizers, with loss-scale unscaling, and calls it cannot
compute exactly as ours go to the other backends.  It serves the rounding of torch's
fused kernel only (``rounding="torch_cuda_fused"``)."""

import pytest
import torch

from lightning_fastopt import FusedAdam, FusedSGD
from lightning_fastopt.ops import torch_fused
from tests.helpers import SIZES, assert_params_equal, run_twins, split_groups

GROUPS = [dict(), dict(lr=3e-3, weight_decay=0.0), dict(lr=5e-4)]


@pytest.fixture
def fused_on_cpu(monkeypatch):
    monkeypatch.setattr(torch_fused, "DEVICE_TYPES", ("cpu", "cuda"))
    calls = []
    for name in ("adam_", "sgd_"):
        real = getattr(torch_fused, name)
        monkeypatch.setattr(torch_fused, name, lambda *a, _real=real, _n=name, **k: (calls.append(_n), _real(*a, **k)))
    return calls


@pytest.mark.parametrize("make,make_ref", [
    (lambda g: FusedAdam(g, lr=1e-2, weight_decay=0.05, amsgrad=True, rounding="torch_cuda_fused"),
     lambda g: torch.optim.AdamW(g, lr=1e-2, weight_decay=0.05, amsgrad=True, fused=True)),
    (lambda g: FusedAdam(g, lr=1e-2, weight_decay=0.05, adamw_mode=False, maximize=True,
                         rounding="torch_cuda_fused"),
     lambda g: torch.optim.Adam(g, lr=1e-2, weight_decay=0.05, maximize=True, fused=True)),
    (lambda g: FusedSGD(g, lr=1e-2, momentum=0.9, dampening=0.1, weight_decay=1e-3, rounding="torch_cuda_fused"),
     lambda g: torch.optim.SGD(g, lr=1e-2, momentum=0.9, dampening=0.1, weight_decay=1e-3, fused=True)),
    (lambda g: FusedSGD(g, lr=1e-2, momentum=0.9, nesterov=True, rounding="torch_cuda_fused"),
     lambda g: torch.optim.SGD(g, lr=1e-2, momentum=0.9, nesterov=True, fused=True)),
], ids=["adamw-amsgrad", "adam-l2-maximize", "sgd-dampening", "sgd-nesterov"])
def test_matches_torch_optim_with_unscaling(fused_on_cpu, make, make_ref):
    """The path runs torch's own fused kernels (here on the CPU), which unscale inside:
    torch's fused optimizer on unscaled gradients, bit for bit."""
    ps = [torch.randn(n, requires_grad=True) for n in SIZES * 3]
    rs = [p.detach().clone().requires_grad_() for p in ps]
    opt, ref = make(split_groups(ps, GROUPS)), make_ref(split_groups(rs, GROUPS))
    for _ in range(20):
        for p, r in zip(ps, rs):
            g = torch.randn_like(p)
            p.grad, r.grad = g * 64.0, g.clone()
        opt.step(grad_scale=64.0)
        ref.step()
    assert_params_equal(ps, rs)
    assert fused_on_cpu  # the torch-fused path ran


@pytest.mark.parametrize("make,make_ref", [
    (lambda g: FusedAdam(g, lr=1e-2, weight_decay=0.05, torch_sqrt=True),  # torch's CPU square root
     lambda g: torch.optim.AdamW(g, lr=1e-2, weight_decay=0.05)),
    (lambda g: FusedSGD(g, lr=1e-2, momentum=0.9, dampening=0.9),
     lambda g: torch.optim.SGD(g, lr=1e-2, momentum=0.9, dampening=0.9)),
], ids=["adamw", "sgd-dampening"])
def test_another_rounding_is_not_taken(fused_on_cpu, make, make_ref):
    """The default rounding (torch's CPU and CUDA foreach steps) rounds otherwise than
    torch's fused kernels (SGD: 1 - dampening in float32 on CUDA): it goes to the other
    backends and ends on the bits of torch's default step."""
    ours, ref, _, _ = run_twins(make, make_ref, SIZES, [dict()], steps=10)
    assert_params_equal(ours, ref)
    assert not fused_on_cpu


def test_overflow_skips_before_the_fused_kernel(fused_on_cpu):
    p = torch.randn(5, requires_grad=True)
    opt = FusedAdam([p], rounding="torch_cuda_fused")
    p.grad = torch.full((5,), float("inf"))
    before = p.detach().clone()
    opt.step(check_finite=True)
    assert opt.last_step_skipped and torch.equal(p.detach(), before)


def test_what_it_does_not_take(monkeypatch):
    f32 = [torch.zeros(3)]
    assert not torch_fused.takes(f32, f32)  # CPU tensors go to our compiled kernels
    monkeypatch.setattr(torch_fused, "DEVICE_TYPES", ("cpu",))
    assert torch_fused.takes(f32, f32)
    assert not torch_fused.takes([torch.zeros(3, dtype=torch.bfloat16)], f32)  # half params
    assert not torch_fused.takes(f32, [torch.zeros(3, dtype=torch.bfloat16)])  # half grads
    assert not torch_fused.takes(f32, f32, copies=[torch.zeros(3, dtype=torch.bfloat16)])
    assert not torch_fused.takes([], [])
