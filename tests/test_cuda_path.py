"""CUDA tensors, until the CUDA kernels land, take the pure-PyTorch path: same results as
torch.optim, overflow skips, half-precision copies.  Marked `cuda`: skipped without a GPU,
run on the GPU machine."""

import math

import pytest
import torch

from lightning_fastopt import FusedAdagrad, FusedAdam, FusedLAMB, FusedSGD
from lightning_fastopt import functional as F
from tests.helpers import SIZES, assert_params_close

pytestmark = pytest.mark.cuda


def _twins(make_a, make_b, steps=30):
    a = [torch.randn(n, device="cuda", requires_grad=True) for n in SIZES]
    b = [p.detach().clone().requires_grad_() for p in a]
    oa, ob = make_a(a), make_b(b)
    for _ in range(steps):
        for x, y in zip(a, b):
            g = torch.randn_like(x)
            x.grad, y.grad = g.clone(), g.clone()
        oa.step()
        ob.step()
    return a, b, oa


@pytest.mark.parametrize("make_a,make_b,tol", [
    (lambda p: FusedAdam(p, lr=1e-2, weight_decay=0.01), lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.01),
     dict(rtol=1.3e-6, atol=1e-5)),
    (lambda p: FusedSGD(p, lr=1e-2, momentum=0.9, nesterov=True), lambda p: torch.optim.SGD(
        p, lr=1e-2, momentum=0.9, nesterov=True), dict(rtol=1e-6, atol=1e-6)),
    (lambda p: FusedAdagrad(p, lr=1e-2), lambda p: torch.optim.Adagrad(p, lr=1e-2), dict(rtol=1e-6, atol=1e-6)),
], ids=["adamw", "sgd", "adagrad"])
def test_cuda_matches_torch(make_a, make_b, tol):
    a, b, opt = _twins(make_a, make_b)
    assert all(x.is_cuda for x in a)
    assert all(t.is_cuda for st in opt.state.values() for k, t in st.items() if k != "step")
    assert_params_close(a, b, **tol)


def test_cuda_lamb_runs_and_skips_on_overflow():
    p = torch.randn(1000, device="cuda", requires_grad=True)
    opt = FusedLAMB([p], lr=1e-2)
    p.grad = torch.randn_like(p)
    opt.step()
    before = p.detach().clone()
    p.grad[5] = math.nan
    opt.step(check_finite=True)
    assert opt.last_step_skipped and torch.equal(p.detach(), before)


def test_cuda_functional_half_copies_and_skip():
    params = [torch.randn(n, device="cuda") for n in SIZES]
    grads = [torch.randn(n, device="cuda", dtype=torch.bfloat16) for n in SIZES]
    copies = [torch.empty(n, device="cuda", dtype=torch.bfloat16) for n in SIZES]
    m = [torch.zeros(n, device="cuda") for n in SIZES]
    v = [torch.zeros(n, device="cuda") for n in SIZES]
    kw = dict(step=1, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, param_copies=copies)
    assert F.fused_adam_(params, grads, m, v, grad_scale=2.0, check_finite=True, **kw) is False
    for p, c in zip(params, copies):
        assert torch.equal(c, p.to(torch.bfloat16))
    grads[3][0] = math.inf
    snapshot = [t.clone() for t in params + m + v]
    assert F.fused_adam_(params, grads, m, v, check_finite=True, **kw) is True
    assert all(torch.equal(t, s) for t, s in zip(params + m + v, snapshot))
