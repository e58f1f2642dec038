"""FusedAdam, FusedSGD and FusedAdagrad against torch.optim, element by element.

50 steps, three parameter groups with different hyperparameters, sizes 0, 1, 7, 1023
(and 1,000,003 once per optimizer), on every CPU backend.  Adam/AdamW: bit for bit
(``torch.equal``) with torch's default CPU step (``torch_sqrt=True``: torch's square
root), at 1 and 2 threads; by default (the IEEE square root) every backend gives the same
bits.  Adagrad the same way (``torch_sqrt=True``).  SGD bit for bit on every backend.
"""

import itertools

import pytest
import torch

from lightning_fastopt import FusedAdagrad, FusedAdam, FusedSGD
from tests.helpers import BIG, SIZES, assert_params_equal, run_twins


@pytest.mark.parametrize("adamw,amsgrad,maximize", list(itertools.product([True, False], repeat=3)))
def test_adam_matches_torch(backend, adamw, amsgrad, maximize):
    overrides = [dict(), dict(lr=0.05, weight_decay=0.1), dict(betas=(0.8, 0.99), eps=1e-6, weight_decay=0.0)]
    torch_cls = torch.optim.AdamW if adamw else torch.optim.Adam
    a, b, oa, ob = run_twins(
        lambda g: FusedAdam(g, lr=1e-2, weight_decay=0.01, adamw_mode=adamw, amsgrad=amsgrad, maximize=maximize,
                            torch_sqrt=True),
        lambda g: torch_cls(g, lr=1e-2, weight_decay=0.01, amsgrad=amsgrad, maximize=maximize),
        SIZES, overrides)
    assert_params_equal(a, b)
    for x, y in zip(a, b):
        if x.numel():
            sa, sb = oa.state[x], ob.state[y]
            assert torch.equal(sa["exp_avg"], sb["exp_avg"]) and torch.equal(sa["exp_avg_sq"], sb["exp_avg_sq"])
            if amsgrad:
                assert torch.equal(sa["max_exp_avg_sq"], sb["max_exp_avg_sq"])
            assert float(sa["step"]) == float(sb["step"]) == 50


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("adamw,amsgrad", [(True, False), (False, True)])
def test_adam_big_tensor(backend, threads, adamw, amsgrad):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch_cls = torch.optim.AdamW if adamw else torch.optim.Adam
        a, b, _, _ = run_twins(lambda g: FusedAdam(g, lr=1e-3, weight_decay=0.01, adamw_mode=adamw, amsgrad=amsgrad,
                                                   torch_sqrt=True),
                               lambda g: torch_cls(g, lr=1e-3, weight_decay=0.01, amsgrad=amsgrad), (BIG, 5),
                               [dict()], steps=20)
    finally:
        torch.set_num_threads(before)
    assert_params_equal(a, b)


@pytest.mark.parametrize("adamw,amsgrad", [(True, False), (False, True)])
def test_adam_with_the_ieee_square_root_is_the_same_on_every_backend(backend, monkeypatch, adamw, amsgrad):
    """FusedAdam's default: the kernels of every ISA and the pure-PyTorch backend, which
    applies torch's operations with the IEEE square root, agree bit for bit."""
    import lightning_fastopt.ops as ops
    from lightning_fastopt.ops import torch_backend

    def run(module):
        monkeypatch.setattr(ops, "cpu_backend", lambda: module)  # the backend fixture restores it
        torch.manual_seed(0)
        return run_twins(lambda g: FusedAdam(g, lr=1e-2, weight_decay=0.01, adamw_mode=adamw, amsgrad=amsgrad),
                         lambda g: torch.optim.SGD(g, lr=0.0), SIZES, [dict(), dict(lr=0.05)])[0]

    assert_params_equal(run(backend), run(torch_backend))


@pytest.mark.parametrize("momentum,dampening,nesterov,maximize,weight_decay", [
    (0.0, 0.0, False, False, 0.0),
    (0.0, 0.0, False, True, 0.01),
    (0.9, 0.0, False, False, 0.01),
    (0.9, 0.0, True, False, 0.01),
    (0.9, 0.5, False, True, 0.0),
    (0.5, 0.1, False, False, 0.1),
])
def test_sgd_matches_torch(backend, momentum, dampening, nesterov, maximize, weight_decay):
    kw = dict(lr=1e-2, momentum=momentum, dampening=dampening, nesterov=nesterov, maximize=maximize,
              weight_decay=weight_decay)
    overrides = [dict(), dict(lr=0.05), dict(weight_decay=0.2)]
    a, b, oa, ob = run_twins(lambda g: FusedSGD(g, **kw), lambda g: torch.optim.SGD(g, **kw), SIZES, overrides)
    assert_params_equal(a, b)
    if momentum:
        for x, y in zip(a, b):
            assert torch.equal(oa.state[x]["momentum_buffer"], ob.state[y]["momentum_buffer"])


def test_sgd_big_tensor(backend):
    kw = dict(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=1e-4)
    a, b, _, _ = run_twins(lambda g: FusedSGD(g, **kw), lambda g: torch.optim.SGD(g, **kw), (BIG,), [dict()], steps=20)
    assert_params_equal(a, b)


def test_sgd_wd_after_momentum(backend):
    """apex's option: decay is added after the momentum update, checked against that rule
    written with torch's CPU ops as torch's SGD writes its own (``add`` with ``alpha``)."""
    lr, mom, wd = 0.05, 0.9, 0.1
    a, _ = [torch.randn(n).requires_grad_() for n in SIZES], None
    ref = [p.detach().clone() for p in a]
    bufs = [None] * len(a)
    opt = FusedSGD(a, lr=lr, momentum=mom, weight_decay=wd, wd_after_momentum=True)
    for _ in range(20):
        for i, p in enumerate(a):
            g = torch.randn_like(p)
            p.grad = g
            bufs[i] = g.clone() if bufs[i] is None else bufs[i].mul_(mom).add_(g)
            ref[i].add_(bufs[i].add(ref[i], alpha=wd), alpha=-lr)
        opt.step()
    assert_params_equal(a, ref)


@pytest.mark.parametrize("lr_decay,weight_decay,init,maximize", [
    (0.0, 0.0, 0.0, False), (0.01, 0.1, 0.1, False), (0.0, 0.01, 0.5, True)])
def test_adagrad_matches_torch(backend, lr_decay, weight_decay, init, maximize):
    kw = dict(lr=1e-2, lr_decay=lr_decay, weight_decay=weight_decay, initial_accumulator_value=init,
              maximize=maximize, eps=1e-10)
    overrides = [dict(), dict(lr=0.05), dict(eps=1e-6)]
    a, b, oa, ob = run_twins(lambda g: FusedAdagrad(g, **kw, torch_sqrt=True), lambda g: torch.optim.Adagrad(g, **kw),
                             SIZES, overrides)
    assert_params_equal(a, b)
    for x, y in zip(a, b):
        assert torch.equal(oa.state[x]["sum"], ob.state[y]["sum"])


@pytest.mark.parametrize("threads", [1, 2])
def test_adagrad_big_tensor(backend, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b, _, _ = run_twins(lambda g: FusedAdagrad(g, lr=1e-2, weight_decay=0.01, torch_sqrt=True),
                               lambda g: torch.optim.Adagrad(g, lr=1e-2, weight_decay=0.01), (BIG, 5), [dict()],
                               steps=20)
    finally:
        torch.set_num_threads(before)
    assert_params_equal(a, b)


def test_adagrad_with_the_ieee_square_root_is_the_same_on_every_backend(backend, monkeypatch):
    """FusedAdagrad's default: the kernels of every ISA and the pure-PyTorch backend agree
    bit for bit."""
    import lightning_fastopt.ops as ops
    from lightning_fastopt.ops import torch_backend

    def run(module):
        monkeypatch.setattr(ops, "cpu_backend", lambda: module)  # the backend fixture restores it
        torch.manual_seed(0)
        return run_twins(lambda g: FusedAdagrad(g, lr=1e-2, weight_decay=0.01, lr_decay=0.01),
                         lambda g: torch.optim.SGD(g, lr=0.0), SIZES, [dict(), dict(lr=0.05)])[0]

    assert_params_equal(run(backend), run(torch_backend))


def test_params_without_grad_are_untouched(backend):
    p1, p2 = torch.randn(10, requires_grad=True), torch.randn(10, requires_grad=True)
    before = p2.detach().clone()
    opt = FusedAdam([p1, p2], weight_decay=0.01, torch_sqrt=True)
    p1.grad = torch.randn(10)
    opt.step()
    assert torch.equal(p2.detach(), before)
    assert len(opt.state[p2]) == 0
    # p2 joins later, one step behind p1: both must still follow torch.
    ref1, ref2 = p1.detach().clone().requires_grad_(), p2.detach().clone().requires_grad_()
    ropt = torch.optim.AdamW([ref1, ref2], weight_decay=0.01)
    ropt.state[ref1] = {k: v.clone() for k, v in opt.state[p1].items()}
    for _ in range(5):
        g1, g2 = torch.randn(10), torch.randn(10)
        p1.grad, p2.grad, ref1.grad, ref2.grad = g1, g2, g1.clone(), g2.clone()
        opt.step()
        ropt.step()
    assert_params_equal([p1, p2], [ref1, ref2])
    assert float(opt.state[p1]["step"]) == 6 and float(opt.state[p2]["step"]) == 5


def _step_with_gaps(opt, ref, ps, rs, every, steps=12):
    """Step both optimizers on the same random gradients; parameter i has none at the
    steps where (step + i) % every == 0."""
    for step in range(steps):
        for i, (p, r) in enumerate(zip(ps, rs)):
            if (step + i) % every == 0:
                p.grad = r.grad = None
                continue
            g = torch.randn_like(p)
            p.grad, r.grad = g, g.clone()
        opt.step()
        ref.step()


@pytest.mark.parametrize("make,make_ref", [
    (lambda g: FusedAdam(g, lr=1e-2, weight_decay=0.01, torch_sqrt=True),
     lambda g: torch.optim.AdamW(g, lr=1e-2, weight_decay=0.01)),
    (lambda g: FusedSGD(g, lr=1e-2, momentum=0.9), lambda g: torch.optim.SGD(g, lr=1e-2, momentum=0.9)),
    (lambda g: FusedAdagrad(g, lr=1e-2, torch_sqrt=True), lambda g: torch.optim.Adagrad(g, lr=1e-2)),
], ids=["adamw", "sgd", "adagrad"])
def test_gradients_missing_on_some_steps(backend, make, make_ref):
    """A parameter without a gradient on a step keeps its step count, as in torch: the
    others' shared count must not carry it along."""
    ps = [torch.randn(n, requires_grad=True) for n in (7, 1023, 1)]
    rs = [p.detach().clone().requires_grad_() for p in ps]
    opt, ref = make(ps), make_ref(rs)
    _step_with_gaps(opt, ref, ps, rs, every=4)
    assert_params_equal(ps, rs)
    for p, r in zip(ps, rs):
        if "step" in ref.state[r]:
            assert float(opt.state[p]["step"]) == float(ref.state[r]["step"])


def _wrap_offload(fraction, copy_on_cpu):
    from lightning_fastopt import OffloadOptimizer

    return lambda opt, names: OffloadOptimizer(opt, names, offload_fraction=fraction, copy_on_cpu=copy_on_cpu)


def _wrap_zero(opt, names):
    from lightning_fastopt.zero import ZeroOptimizer

    return ZeroOptimizer(opt, names, stage=1, offload_fraction=0.5, copy_on_cpu=True)


LISTED_TWICE = [
    ("adamw-amsgrad", lambda g: FusedAdam(g, lr=1e-2, weight_decay=0.01, amsgrad=True, torch_sqrt=True),
     lambda g: torch.optim.AdamW(g, lr=1e-2, weight_decay=0.01, amsgrad=True, foreach=False)),
    ("adam", lambda g: FusedAdam(g, lr=1e-2, weight_decay=0.01, adamw_mode=False, torch_sqrt=True),
     lambda g: torch.optim.Adam(g, lr=1e-2, weight_decay=0.01, foreach=False)),
    ("sgd-nesterov", lambda g: FusedSGD(g, lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.1),
     lambda g: torch.optim.SGD(g, lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.1, foreach=False)),
    ("sgd-dampening", lambda g: FusedSGD(g, lr=1e-2, momentum=0.5, dampening=0.3),
     lambda g: torch.optim.SGD(g, lr=1e-2, momentum=0.5, dampening=0.3, foreach=False)),
    ("sgd-plain", lambda g: FusedSGD(g, lr=1e-2), lambda g: torch.optim.SGD(g, lr=1e-2, foreach=False)),
    ("adagrad", lambda g: FusedAdagrad(g, lr=1e-2, lr_decay=0.01, torch_sqrt=True),
     lambda g: torch.optim.Adagrad(g, lr=1e-2, lr_decay=0.01, foreach=False)),
]


@pytest.mark.filterwarnings("ignore:optimizer contains a parameter group with duplicate parameters")
@pytest.mark.parametrize("wrap", [None, _wrap_offload(0.5, False), _wrap_offload(0.5, True),
                                  _wrap_offload(1.0, True), _wrap_zero],
                         ids=["fused", "offload-cpu-run", "offload-accelerator-path", "offload-all", "zero1"])
@pytest.mark.parametrize("name,make,make_ref", LISTED_TWICE, ids=[c[0] for c in LISTED_TWICE])
def test_a_parameter_listed_twice_is_updated_once_per_listing_as_by_torch(backend, wrap, name, make, make_ref):
    """torch warns about a parameter listed twice in a group, and its per-parameter loop
    (the CPU default, asked for explicitly here) updates it once per listing; SGD restarts
    the momentum buffer from the gradient at each listing of the first step.  Sizes 7, 1023,
    1, 5; one parameter listed twice and one three times, some steps without a gradient."""
    ps = [torch.randn(n, requires_grad=True) for n in (7, 1023, 1, 5)]
    rs = [p.detach().clone().requires_grad_() for p in ps]

    def groups(t):
        return [dict(params=[t[0], t[1], t[0], t[2]]), dict(params=[t[3], t[3], t[3]], lr=0.03)]

    opt, ref = make(groups(ps)), make_ref(groups(rs))
    if wrap is not None:
        opt = wrap(opt, {p: f"p{i}" for i, p in enumerate(ps)})
    _step_with_gaps(opt, ref, ps, rs, every=5)
    assert_params_equal(ps, rs)
    state_of = opt.state_of if wrap is not None else opt.state.__getitem__
    for p, r in zip(ps, rs):
        if "step" in ref.state[r]:
            assert float(state_of(p)["step"]) == float(ref.state[r]["step"])
        if "momentum_buffer" in ref.state[r]:
            assert torch.equal(state_of(p)["momentum_buffer"], ref.state[r]["momentum_buffer"])
