"""LR schedulers and mutable param_groups reach the kernels, as with torch.optim: the same
bits (Adam with torch's CPU square root, ``torch_sqrt=True``)."""

import warnings

import pytest
import torch

from lightning_fastopt import FusedAdam, FusedLAMB, FusedSGD
from tests.helpers import SIZES, assert_params_equal


def _run(opt, sched, params, grads):
    for gs in grads:
        for p, g in zip(params, gs):
            p.grad = g.clone()
        opt.step()
        sched.step()


@pytest.mark.parametrize("make_sched", [
    lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5),
    lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=30),  # also cycles betas
    lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=10),
], ids=["step", "onecycle", "cosine"])
def test_scheduler_matches_torch(backend, make_sched):
    a = [torch.randn(n, requires_grad=True) for n in SIZES]
    b = [p.detach().clone().requires_grad_() for p in a]
    oa = FusedAdam(a, lr=1e-2, weight_decay=0.01, torch_sqrt=True)
    ob = torch.optim.AdamW(b, lr=1e-2, weight_decay=0.01)
    sa, sb = make_sched(oa), make_sched(ob)
    grads = [[torch.randn(n) for n in SIZES] for _ in range(30)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "lr_scheduler.step() before optimizer.step()"
        _run(oa, sa, a, grads)
    _run(ob, sb, b, grads)
    assert sa.get_last_lr() == sb.get_last_lr()
    assert_params_equal(a, b)


def test_mutating_param_groups_takes_effect(backend):
    a = [torch.randn(n, requires_grad=True) for n in SIZES]
    b = [p.detach().clone().requires_grad_() for p in a]
    oa, ob = FusedSGD(a, lr=0.1, momentum=0.9), torch.optim.SGD(b, lr=0.1, momentum=0.9)
    for step in range(12):
        if step == 4:
            for o in (oa, ob):
                o.param_groups[0]["lr"] = 0.01
                o.param_groups[0]["weight_decay"] = 0.1
        if step == 8:
            for o in (oa, ob):
                o.param_groups[0]["nesterov"] = True
                o.param_groups[0]["momentum"] = 0.5
        for p, q in zip(a, b):
            g = torch.randn_like(p)
            p.grad, q.grad = g.clone(), g.clone()
        oa.step()
        ob.step()
    assert_params_equal(a, b)


def test_add_param_group_later(backend):
    p1, p2 = torch.randn(10, requires_grad=True), torch.randn(20, requires_grad=True)
    q1, q2 = p1.detach().clone().requires_grad_(), p2.detach().clone().requires_grad_()
    oa = FusedAdam([p1], lr=1e-2, weight_decay=0.01, torch_sqrt=True)
    ob = torch.optim.AdamW([q1], lr=1e-2, weight_decay=0.01)
    for step in range(10):
        if step == 5:
            oa.add_param_group({"params": [p2], "lr": 3e-2, "adamw_mode": True})
            ob.add_param_group({"params": [q2], "lr": 3e-2})
        for p, q in ((p1, q1), (p2, q2)):
            g = torch.randn_like(p)
            p.grad, q.grad = g.clone(), g.clone()
        oa.step()
        ob.step()
    assert_params_equal([p1, p2], [q1, q2])


def test_zero_grad_set_to_none(backend):
    p = torch.randn(5, requires_grad=True)
    opt = FusedLAMB([p])
    p.grad = torch.randn(5)
    opt.step()
    opt.zero_grad(set_to_none=True)
    assert p.grad is None
    opt.step()  # no grads: nothing to do, no error


def test_step_with_closure(backend):
    w = torch.randn(3, requires_grad=True)
    opt = FusedAdam([w], lr=0.1)

    def closure():
        opt.zero_grad()
        loss = (w ** 2).sum()
        loss.backward()
        return loss

    first = opt.step(closure).item()
    for _ in range(50):
        last = opt.step(closure).item()
    assert last < first
