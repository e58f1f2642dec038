"""FusedLAMB, FusedLars, FusedLion (and FusedAdam without bias correction) against the
plain-PyTorch references in tests/references.py, element by element, 50 steps, three
parameter groups, sizes 0, 1, 7, 1023 (1,000,003 once), on every CPU backend.

Tolerances: rtol 1e-5, atol 1e-5 for LAMB and LARS (per-tensor norms are accumulated in
a different order than the reference's); Adam without bias correction bit for bit (the
reference is torch's CPU step without the corrections; ``torch_sqrt=True``).  Lion's update
is a sign, so a 1-ulp difference in an interpolation that is exactly at 0 would flip an
element by 2*lr: Lion is checked one step at a time from a shared state (the reference
restarts from our parameters and moments each step): parameters with rtol 1e-6 and
atol 1e-7, except elements whose interpolation is within 4 ulps of zero, which may
differ by at most 2*lr (about one in a million elements); moments with rtol 1e-6 and
atol 1e-6 (lerp can cancel to near zero, where one ulp of the O(1) inputs is a large
relative error).
"""

import pytest
import torch

from lightning_fastopt import FusedAdam, FusedLAMB, FusedLars, FusedLion
from tests import references as ref
from tests.helpers import BIG, SIZES, STEPS, assert_params_close, assert_params_equal, split_groups

NORM_TOL = dict(rtol=1e-5, atol=1e-5)


def _grads(params):
    return [torch.randn_like(p) for p in params]


def _by_group(opt, params):
    """(group, index into params) for every parameter, group by group."""
    for group in opt.param_groups:
        for p in group["params"]:
            yield group, next(k for k, q in enumerate(params) if q is p)


@pytest.mark.parametrize("adam_w_mode,grad_averaging,bias_correction,use_nvlamb,weight_decay,max_grad_norm", [
    (True, True, True, False, 0.01, 1.0),
    (False, True, True, False, 0.01, 1.0),
    (True, False, False, False, 0.1, 0.0),
    (True, True, True, True, 0.0, 1.0),
    (True, True, True, False, 0.0, 100.0),  # no trust ratio, no clipping
])
def test_lamb_matches_reference(backend, adam_w_mode, grad_averaging, bias_correction, use_nvlamb, weight_decay,
                                max_grad_norm):
    kw = dict(adam_w_mode=adam_w_mode, grad_averaging=grad_averaging, bias_correction=bias_correction,
              use_nvlamb=use_nvlamb, weight_decay=weight_decay, max_grad_norm=max_grad_norm)
    overrides = [dict(), dict(lr=0.02), dict(betas=(0.8, 0.99), eps=1e-8)]
    params = [torch.randn(n, requires_grad=True) for n in SIZES]
    mirror = [p.detach().clone() for p in params]
    opt = FusedLAMB(split_groups(params, overrides), lr=1e-2, **kw)
    mgroups = split_groups(mirror, overrides)
    ms = [torch.zeros_like(p) for p in mirror]
    vs = [torch.zeros_like(p) for p in mirror]
    index = {id(p): i for i, p in enumerate(mirror)}
    for step in range(1, STEPS + 1):
        grads = _grads(params)
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        # the reference clips by the norm over all groups, then steps group by group
        import math
        total = math.sqrt(sum(g.double().pow(2).sum().item() for g in grads))
        for group, mg in zip(opt.param_groups, mgroups):
            idx = [index[id(p)] for p in mg["params"]]
            gl = [grads[i] for i in idx]
            scale = 1.0
            mgn = group["max_grad_norm"]
            if mgn > 0 and total > mgn:
                scale = total / mgn
            # reference's own clipping uses the group's grads; give it pre-clipped global grads instead
            gl = [g / scale for g in gl]
            ref.lamb_step(mg["params"], gl, [ms[i] for i in idx], [vs[i] for i in idx], step=step,
                          lr=group["lr"], beta1=group["betas"][0], beta2=group["betas"][1], eps=group["eps"],
                          weight_decay=group["weight_decay"], bias_correction=group["bias_correction"],
                          adam_w_mode=group["adam_w_mode"], grad_averaging=group["grad_averaging"],
                          max_grad_norm=0.0, use_nvlamb=group["use_nvlamb"])
    assert_params_close(params, mirror, **NORM_TOL)
    for p, m, v in zip(params, ms, vs):
        if p.numel():
            torch.testing.assert_close(opt.state[p]["exp_avg"], m, **NORM_TOL)
            torch.testing.assert_close(opt.state[p]["exp_avg_sq"], v, **NORM_TOL)


def test_lamb_clipping_uses_norm_of_all_groups(backend):
    """With max_grad_norm, every group is clipped by the norm over all groups' grads."""
    a, b = torch.randn(100, requires_grad=True), torch.randn(100, requires_grad=True)
    opt = FusedLAMB([{"params": [a]}, {"params": [b]}], lr=0.1, weight_decay=0.0, max_grad_norm=1.0,
                    bias_correction=False, betas=(0.0, 0.0), eps=0.0)
    a.grad, b.grad = torch.full((100,), 3.0), torch.full((100,), 4.0)
    opt.step()
    # beta1 = beta2 = 0, no bias correction, eps 0: u = g / |g| = sign(g), ratio 1: p -= lr
    ga, gb = opt.state[a]["exp_avg"], opt.state[b]["exp_avg"]
    norm = (100 * 9 + 100 * 16) ** 0.5
    torch.testing.assert_close(ga, torch.full((100,), 3.0 / norm), rtol=1e-6, atol=0)
    torch.testing.assert_close(gb, torch.full((100,), 4.0 / norm), rtol=1e-6, atol=0)


def test_lamb_big_tensor(backend):
    p = torch.randn(BIG, requires_grad=True)
    mirror = [p.detach().clone()]
    m, v = [torch.zeros(BIG)], [torch.zeros(BIG)]
    opt = FusedLAMB([p], lr=1e-2, weight_decay=0.01)
    for step in range(1, 11):
        g = torch.randn(BIG)
        p.grad = g.clone()
        opt.step()
        ref.lamb_step(mirror, [g], m, v, step=step, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.01)
    assert_params_close([p], mirror, **NORM_TOL)


@pytest.mark.parametrize("momentum,weight_decay,epsilon,maximize", [
    (0.0, 0.0, 0.0, False), (0.9, 1e-4, 0.0, False), (0.9, 0.01, 1e-8, True)])
def test_lars_matches_reference(backend, momentum, weight_decay, epsilon, maximize):
    overrides = [dict(), dict(lr=0.5, eeta=0.01), dict(weight_decay=0.0)]
    params = [torch.randn(n, requires_grad=True) for n in SIZES] + [torch.zeros(5, requires_grad=True)]
    mirror = [p.detach().clone() for p in params]
    opt = FusedLars(split_groups(params, overrides), lr=0.1, momentum=momentum, weight_decay=weight_decay,
                    epsilon=epsilon, maximize=maximize)
    bufs = [torch.zeros_like(p) for p in mirror]
    for _ in range(STEPS):
        grads = _grads(params)
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        for group, i in _by_group(opt, params):
            ref.lars_step(mirror[i], grads[i], bufs[i], lr=group["lr"], momentum=group["momentum"],
                          eeta=group["eeta"], weight_decay=group["weight_decay"], epsilon=group["epsilon"],
                          maximize=group["maximize"])
    assert_params_close(params, mirror, **NORM_TOL)


def test_lars_big_tensor(backend):
    p = torch.randn(BIG, requires_grad=True)
    mirror, buf = p.detach().clone(), torch.zeros(BIG)
    opt = FusedLars([p], lr=0.1, momentum=0.9, weight_decay=1e-4)
    for _ in range(10):
        g = torch.randn(BIG)
        p.grad = g.clone()
        opt.step()
        ref.lars_step(mirror, g, buf, lr=0.1, momentum=0.9, eeta=1e-3, weight_decay=1e-4, epsilon=0.0)
    assert_params_close([p], [mirror], **NORM_TOL)


@pytest.mark.parametrize("betas,weight_decay,maximize", [((0.9, 0.99), 0.0, False), ((0.95, 0.98), 0.1, True),
                                                         ((0.3, 0.6), 0.01, False)])
@pytest.mark.parametrize("sizes", [SIZES, (BIG,)], ids=["small", "big"])
def test_lion_matches_reference_each_step(backend, betas, weight_decay, maximize, sizes):
    overrides = [dict(), dict(lr=3e-4), dict(weight_decay=0.5)]
    params = [torch.randn(n, requires_grad=True) for n in sizes]
    opt = FusedLion(split_groups(params, overrides), lr=1e-4, betas=betas, weight_decay=weight_decay,
                    maximize=maximize)
    steps = STEPS if sizes == SIZES else 5
    for step in range(steps):
        grads = _grads(params)
        before = [p.detach().clone() for p in params]
        moments = [opt.state[p]["exp_avg"].clone() if step else torch.zeros_like(p) for p in params]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        for group, i in _by_group(opt, params):
            p = params[i]
            ambiguous = ref.lion_step(before[i], grads[i], moments[i], lr=group["lr"], beta1=group["betas"][0],
                                      beta2=group["betas"][1], weight_decay=group["weight_decay"],
                                      maximize=group["maximize"])
            ours = p.detach()
            torch.testing.assert_close(ours[~ambiguous], before[i][~ambiguous], rtol=1e-6, atol=1e-7)
            assert ((ours - before[i])[ambiguous].abs() <= 2 * group["lr"] * (1 + 1e-5)).all()
            assert ambiguous.sum() <= max(1, p.numel() // 100_000)
            torch.testing.assert_close(opt.state[p]["exp_avg"], moments[i], rtol=1e-6, atol=1e-6)


def test_adam_without_bias_correction(backend):
    params = [torch.randn(n, requires_grad=True) for n in SIZES]
    mirror = [p.detach().clone() for p in params]
    ms = [torch.zeros_like(p) for p in mirror]
    vs = [torch.zeros_like(p) for p in mirror]
    opt = FusedAdam(params, lr=1e-3, bias_correction=False, weight_decay=0.01, torch_sqrt=True)
    for step in range(1, STEPS + 1):
        grads = _grads(params)
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        for p, g, m, v in zip(mirror, grads, ms, vs):
            ref.adam_step(p, g, m, v, step=step, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
                          adamw=True, bias_correction=False)
    assert_params_equal(params, mirror)  # the reference is torch's CPU step without the corrections
