"""The roundings (lightning_fastopt.ops.rounding): the step follows the torch
implementation the user's optimizer would have run, on the CPU as on the GPU.

On the CPU: each rounding gives the same bits at every ISA we build and at 1 and 2
threads, they differ from each other (the choice reaches the kernels), the strategy's
mapping picks the rounding from the device and ``fused`` and ``foreach``, torch's CPU
for-loop, foreach and fused=True steps end on torch's bits (tensors with tails included),
the fused kernel's float32 scalars, and bad values are refused.  The CUDA structs run on
the host against these kernels in tests/test_cuda_math.py (each CUDA rounding bit for bit);
the CUDA arithmetic of torch's fused SGD and Adagrad, and of its foreach and for-loop Adam
and Adagrad, as their SASS shows it, is written out here.  On a GPU (``cuda``): torch.equal
with torch.optim.Adam/AdamW/SGD/Adagrad's CUDA foreach, for-loop and fused steps, directly,
through the offload optimizer at fractions 0, 0.5 and 1, and under the Trainer against
Trainer().
"""

import math
from fractions import Fraction
from types import SimpleNamespace

import lightning as L
import numpy as np
import pytest
import torch
from torch import nn

import lightning_fastopt.ops as ops
from lightning_fastopt import FastOptStrategy, FusedAdagrad, FusedAdam, FusedSGD, OffloadOptimizer
from lightning_fastopt.ops.cpu import load_cpu_extension
from lightning_fastopt.ops.isa import detect_isa
from lightning_fastopt.ops.rounding import (ADAGRAD_ROUNDINGS, ROUNDINGS, SGD_ROUNDINGS, float_reciprocal,
                                            fused_cuda_adagrad_clr, fused_cuda_scalars, rounding_of)
from lightning_fastopt.optim.from_torch import _fused_kwargs, to_fused_optimizer
from tests.helpers import BIG, SIZES, assert_modules_equal, assert_params_equal, run_twins

ISAS = sorted({detect_isa().name, "generic"})


def _adam(rounding, adamw=True, amsgrad=False, maximize=False):
    return lambda g: FusedAdam(g, lr=1e-2, weight_decay=0.01, adamw_mode=adamw, amsgrad=amsgrad, maximize=maximize,
                               rounding=rounding)


ADAM_GROUPS = [dict(), dict(lr=0.05, weight_decay=0.1), dict(betas=(0.8, 0.99), eps=1e-6, weight_decay=0.0)]
# dampening 0.9: 1 - dampening rounds otherwise in torch's CUDA fused kernel (sgd_rounding.h)
SGD_GROUPS = [dict(dampening=0.9, maximize=True), dict(lr=0.05, weight_decay=0.1), dict(dampening=0.3)]


def _sgd(rounding):
    return lambda g: FusedSGD(g, lr=1e-2, momentum=0.9, rounding=rounding)


def _train(make, groups=ADAM_GROUPS, sizes=SIZES, steps=20):
    torch.manual_seed(0)
    return run_twins(make, lambda g: torch.optim.SGD(g, lr=0.0), sizes, groups[:len(sizes)], steps=steps)[0]


ALGORITHMS = [(f"adam-{r}-{flags}", _adam(r, *(f == "1" for f in flags)), ADAM_GROUPS) for r in ROUNDINGS
              for flags in ("100", "011", "000")]  # (adamw, amsgrad, maximize)
ALGORITHMS += [(f"sgd-{r}", _sgd(r), SGD_GROUPS) for r in SGD_ROUNDINGS]
ADAGRAD_GROUPS = [dict(), dict(lr=0.05, weight_decay=0.1), dict(eps=1e-6, maximize=True)]


def _adagrad(rounding):
    return lambda g: FusedAdagrad(g, lr=1e-2, lr_decay=0.01, weight_decay=0.01, rounding=rounding)


ALGORITHMS += [(f"adagrad-{r}", _adagrad(r), ADAGRAD_GROUPS) for r in ADAGRAD_ROUNDINGS if r != "torch_cpu"]


@pytest.mark.slow  # builds the portable kernels
@pytest.mark.parametrize("name,make,groups", ALGORITHMS, ids=[n for n, _, _ in ALGORITHMS])
def test_each_rounding_is_the_same_at_every_isa_and_thread_count(monkeypatch, name, make, groups):
    results = []
    for isa in ISAS:
        module = load_cpu_extension(isa, warn=False)
        monkeypatch.setattr(ops, "cpu_backend", lambda module=module: module)
        for threads in (1, 2):
            before = torch.get_num_threads()
            torch.set_num_threads(threads)
            try:
                results.append(_train(make, groups, sizes=SIZES + (BIG,), steps=6))
            finally:
                torch.set_num_threads(before)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


def test_the_roundings_differ_in_the_last_bits():
    """The choice reaches the kernels: after 20 steps each pair differs somewhere, by
    float32 roundings only (torch_cpu and torch_cpu_fused in the tensors' tails only)."""
    def flat(make, groups=ADAM_GROUPS):
        return torch.cat([p.detach().flatten() for p in _train(make, groups)])

    def pairs(runs):
        names = list(runs)
        return [(runs[a], runs[b]) for i, a in enumerate(names) for b in names[i + 1:]]

    runs = {r: flat(_adam(r, adamw=False)) for r in ROUNDINGS}
    sgd = {r: flat(_sgd(r), SGD_GROUPS) for r in SGD_ROUNDINGS}
    adagrad = {r: flat(_adagrad(r), ADAGRAD_GROUPS) for r in ADAGRAD_ROUNDINGS}
    for a, b in pairs(runs) + pairs(sgd) + pairs(adagrad):
        assert not torch.equal(a, b)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    tails = torch.cat([torch.arange(n) >= n - n % 8 for n in SIZES])
    assert torch.equal(runs["torch_cpu"][~tails], runs["torch_cpu_fused"][~tails])
    assert torch.equal(sgd["torch_cpu"][~tails], sgd["torch_cpu_fused"][~tails])


def _fake_optimizer(device, fused):
    return SimpleNamespace(param_groups=[dict(params=[SimpleNamespace(device=torch.device(device))])],
                           defaults=dict(fused=fused))


def test_the_rounding_of_a_torch_optimizer():
    assert rounding_of(_fake_optimizer("cpu", None)) == "torch_cpu"
    assert rounding_of(_fake_optimizer("cpu", True)) == "torch_cpu_fused"
    assert rounding_of(_fake_optimizer("cuda", None)) == "torch_cuda_foreach"
    assert rounding_of(_fake_optimizer("cuda", False)) == "torch_cuda_foreach"  # fused=False: foreach by default
    assert rounding_of(_fake_optimizer("cuda", True)) == "torch_cuda_fused"
    p = nn.Parameter(torch.zeros(3))
    for fused, rounding, sqrt in [(None, "torch_cpu", True), (True, "torch_cpu_fused", False)]:
        inner = to_fused_optimizer(torch.optim.AdamW([p], fused=fused)).inner_defaults
        assert (inner["rounding"], inner["torch_sqrt"]) == (rounding, sqrt)
        assert to_fused_optimizer(torch.optim.SGD([p], momentum=0.9, fused=fused)).inner_defaults["rounding"] == rounding
        inner = to_fused_optimizer(torch.optim.Adagrad([p], fused=fused)).inner_defaults
        assert (inner["rounding"], inner["torch_sqrt"]) == ("torch_cpu", sqrt)  # its CPU kernels round alike


@pytest.mark.filterwarnings("error")
def test_a_for_loop_step_on_cuda_gets_its_own_rounding():
    """torch's for-loop step on CUDA (foreach=False) rounds otherwise than its foreach step
    there (Adam's bias correction through a reciprocal, Adagrad's addcdiv one fused
    multiply-add): Adam, AdamW and Adagrad map to "torch_cuda_for_loop"; SGD's rounds as its
    foreach step (and its CPU step); on the CPU foreach=False is the default step."""
    def on(device, make, **kw):
        opt = make([nn.Parameter(torch.zeros(3))], **kw)
        opt.param_groups[0]["params"] = [SimpleNamespace(device=torch.device(device))]  # where the choice looks
        return opt

    for make, want in [(torch.optim.Adam, "torch_cuda_for_loop"), (torch.optim.AdamW, "torch_cuda_for_loop"),
                       (torch.optim.Adagrad, "torch_cuda_for_loop"), (torch.optim.SGD, "torch_cpu")]:
        assert _fused_kwargs(on("cuda", make, foreach=False))["rounding"] == want
        assert _fused_kwargs(on("cuda", make, foreach=True))["rounding"] in ("torch_cuda_foreach", "torch_cpu")
        assert _fused_kwargs(on("cpu", make, foreach=False))["rounding"] == "torch_cpu"
    assert not _fused_kwargs(on("cuda", torch.optim.AdamW, foreach=False))["torch_sqrt"]


def test_the_float_reciprocal_is_the_double_reciprocal_rounded_once():
    """What CUDA's division by a host scalar multiplies by, as benchmarks/rounding_probe.py
    measured it on torch 2.11.0+cu130 (2026-11-28): x's double reciprocal rounded to float32,
    for bias corrections of many steps; not float32's reciprocal of x rounded (the rule
    ATen's source reads as, which the GPU did not follow), which differs at some of them."""
    xs = [(1 - 0.999 ** s) ** 0.5 for s in range(1, 3000)] + [(1 - 0.95 ** s) ** 0.5 for s in range(1, 300)]
    ours = [float_reciprocal(x) for x in xs]
    assert ours == [float(np.float32(1 / x)) for x in xs]
    assert ours != [float(np.float32(1) / np.float32(x)) for x in xs]


TORCH_OPTIMIZERS = [
    ("adamw", lambda ps, **kw: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.05, **kw)),
    ("adam-l2-amsgrad-maximize", lambda ps, **kw: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.05, amsgrad=True,
                                                                   maximize=True, **kw)),
    ("sgd-nesterov", lambda ps, **kw: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.1,
                                                      **kw)),
    # 1 - dampening rounds to another float32 than 1 - float32(0.9): torch takes the former
    ("sgd-dampening-maximize", lambda ps, **kw: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.9,
                                                                maximize=True, **kw)),
    ("adagrad", lambda ps, **kw: torch.optim.Adagrad(ps, lr=0.1, lr_decay=0.01, weight_decay=0.1, **kw)),
]


@pytest.mark.parametrize("wrap", [None, 0.5], ids=["stepped-directly", "offload0.5-accelerator-path"])
@pytest.mark.parametrize("flags", [dict(foreach=False), dict(foreach=True), dict(fused=True)],
                         ids=["for-loop", "foreach", "fused"])
@pytest.mark.parametrize("name,make", TORCH_OPTIMIZERS, ids=[n for n, _ in TORCH_OPTIMIZERS])
def test_a_torch_optimizer_on_the_cpu_ends_on_torchs_bits(name, make, flags, wrap):
    """Each of torch's CPU implementations (for-loop, foreach, fused=True) of the user's
    optimizer, run by the kernels it maps to: stepped directly (to_fused_optimizer's
    optimizer shares the user's groups, our keys come from its inner defaults) or half
    offloaded through the accelerator's code path.  Gradients over 1e-9..1e-1; tensors
    with tails (fused=True rounds each tensor's last numel % 8 elements otherwise)."""
    sizes = (9_004, 7, 10_007, 13)
    def train(opt, ps):
        g = torch.Generator().manual_seed(1)
        for _ in range(12):
            for p in ps:
                p.grad = torch.randn(p.numel(), generator=g) * torch.logspace(-9, -1, p.numel())
            opt.step()
        return [p.detach() for p in ps]

    def params():
        g = torch.Generator().manual_seed(0)
        return [nn.Parameter(torch.randn(n, generator=g)) for n in sizes]

    ref_ps, ps = params(), params()
    ref = train(make(ref_ps, **flags), ref_ps)
    opt = _half_offloaded(to_fused_optimizer(make(ps, **flags)), ps, wrap)
    for a, b in zip(train(opt, ps), ref):
        assert torch.equal(a, b)


def _fused_cuda_adagrad_reference(p, g, s, *, clr, weight_decay, eps, maximize):
    """torch's fused CUDA Adagrad for float32 tensors, written with torch's CPU ops in the
    precisions its SASS shows (csrc/common/fused_cuda_adagrad.h): a double multiply-add for
    the decay (``addcmul`` with value 1 is one fused multiply-add, in float64 as in
    float32), a float32 one for the sum, the update in double from the IEEE square root."""
    g = -g if maximize else g
    if weight_decay:
        g = torch.addcmul(g.double(), p.double(), torch.full_like(p, weight_decay, dtype=torch.float64)).float()
    s = torch.addcmul(s, g, g)
    root = s.double().sqrt().float()  # sqrtf: the IEEE root (the float64 one rounds to it)
    p = (p.double() - (clr * g.double()) / (root.double() + eps)).float()
    return p, s


def _half_offloaded(opt, ps, wrap):
    """opt itself, or (wrap: a fraction) opt in an OffloadOptimizer that updates that share
    through the accelerator's code path (copy_on_cpu)."""
    if wrap is None:
        return opt
    wrapped = OffloadOptimizer(opt, {p: f"p{i}" for i, p in enumerate(ps)}, offload_fraction=wrap,
                               copy_on_cpu=True, bucket_size_mb=0.02)
    assert 0 < wrapped.offloaded_numel < sum(p.numel() for p in ps)
    return wrapped


@pytest.mark.parametrize("wrap", [None, 0.5], ids=["stepped-directly", "offload0.5-accelerator-path"])
@pytest.mark.parametrize("weight_decay,lr_decay,maximize", [(0.0, 0.0, False), (0.1, 0.01, True)])
def test_adagrad_in_torchs_fused_cuda_rounding_is_its_double_arithmetic(weight_decay, lr_decay, maximize, wrap):
    """The CPU kernels' rounding="torch_cuda_fused" Adagrad (the offloaded share of a GPU run
    with torch.optim.Adagrad(fused=True)) against that arithmetic written with torch's ops,
    20 steps, directly and half offloaded; the CUDA structs give the same bits
    (tests/test_cuda_math.py), and the cuda tests below compare with torch's kernel itself."""
    torch.manual_seed(0)
    sizes = (7, 1023, 10_007)
    ps = [nn.Parameter(torch.randn(n)) for n in sizes]
    ref = [p.detach().clone() for p in ps]
    sums = [torch.full((n,), 0.1) for n in sizes]
    inner = FusedAdagrad(ps, lr=1e-2, lr_decay=lr_decay, weight_decay=weight_decay, initial_accumulator_value=0.1,
                         maximize=maximize, rounding="torch_cuda_fused")
    opt = _half_offloaded(inner, ps, wrap)
    for step in range(1, 21):
        grads = [torch.randn(n) * torch.logspace(-6, 0, n) for n in sizes]
        for p, g in zip(ps, grads):
            p.grad = g
        opt.step()
        clr = fused_cuda_adagrad_clr(1e-2, lr_decay, step)
        for i, g in enumerate(grads):
            ref[i], sums[i] = _fused_cuda_adagrad_reference(ref[i], g, sums[i], clr=clr, weight_decay=weight_decay,
                                                            eps=1e-10, maximize=maximize)
    assert_params_equal([p.detach() for p in ps], ref)
    assert_params_equal([opt.state_of(p)["sum"] if wrap else opt.state[p]["sum"] for p in ps], sums)
    default = FusedAdagrad([nn.Parameter(ref[2].clone())], lr=1e-2, lr_decay=lr_decay, weight_decay=weight_decay)
    assert default.param_groups[0]["rounding"] == "torch_cpu"


def _f32(x: Fraction) -> np.float32:
    """The rational x rounded once to float32 (to nearest, ties to even; normal numbers)."""
    if x == 0:
        return np.float32(0)
    sign, x = (-1 if x < 0 else 1), abs(x)
    e = x.numerator.bit_length() - x.denominator.bit_length()
    if Fraction(2) ** e > x:
        e -= 1  # 2**e <= x < 2**(e + 1)
    assert e >= -126
    scale = Fraction(2) ** (23 - e)
    return np.float32(sign * float(Fraction(round(x * scale)) / scale))  # round(): ties to even


def _fma32(a, b, c) -> np.float32:
    """fmaf(a, b, c): a * b + c computed exactly, rounded once."""
    return _f32(Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c)))


def _fused_cuda_sgd_reference(p, g, buf, *, lr, momentum, dampening, weight_decay, nesterov, maximize, first):
    """torch's fused CUDA SGD on one float32 tensor as its SASS computes it, element by
    element (numpy arrays, updated in place): float32 scalars, ``1 - dampening`` subtracted
    in float32, fused multiply-adds where nvcc contracted, and the momentum update's other
    contraction in its vectorised path with maximize and no decay (csrc/common/sgd_rounding.h)."""
    f = np.float32
    damp, m, wd = f(1) - f(dampening), f(momentum), f(weight_decay)
    damped_grad_first = maximize and wd == 0 and p.size % 4 == 0
    for i in range(p.size):
        gi = -g[i] if maximize else g[i]
        if wd != 0:
            gi = _fma32(p[i], wd, gi)
        if momentum:
            if first:
                buf[i] = gi
            elif damped_grad_first:
                buf[i] = _fma32(buf[i], m, gi * damp)
            else:
                buf[i] = _fma32(gi, damp, buf[i] * m)
            gi = _fma32(buf[i], m, gi) if nesterov else buf[i]
        p[i] = _fma32(gi, -f(lr), p[i])


def _written_out_case(sizes, steps):
    """The start and the gradients (over 1e-4..1 in each tensor) of a run checked against
    arithmetic written out element by element, and the run itself: ``run(make, wrap)``
    trains parameters from the start with the optimizer ``make(params)``, directly or
    half offloaded (:func:`_half_offloaded`), and returns them."""
    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(n, generator=gen) for n in sizes]
    grads = [[torch.randn(n, generator=gen) * torch.logspace(-4, 0, n) for n in sizes] for _ in range(steps)]

    def run(make, wrap=None):
        ps = [nn.Parameter(t.clone()) for t in start]
        opt = _half_offloaded(make(ps), ps, wrap)
        for step_grads in grads:
            for p, g in zip(ps, step_grads):
                p.grad = g.clone()
            opt.step()
        return [p.detach() for p in ps]

    return start, grads, run


@pytest.mark.parametrize("wrap", [None, 0.5], ids=["stepped-directly", "offload0.5-accelerator-path"])
@pytest.mark.parametrize("maximize,weight_decay,nesterov,dampening", [
    (True, 0.0, False, 0.9), (True, 0.0, True, 0.0), (False, 0.1, False, 0.6), (True, 0.1, False, 0.9)],
    ids=["maximize", "maximize-nesterov", "decay", "maximize-decay"])
def test_sgd_in_torchs_fused_cuda_rounding_is_its_float_arithmetic(maximize, weight_decay, nesterov, dampening, wrap):
    """The CPU kernels' rounding="torch_cuda_fused" SGD (the offloaded share of a GPU run with
    torch.optim.SGD(fused=True)) against that arithmetic written out with exact fused
    multiply-adds, 12 steps, on tensors of numel % 4 == 0 and not, directly and half
    offloaded.  The default rounding ends elsewhere in each case (the test can tell them
    apart); the cuda tests below compare with torch's kernel itself."""
    sizes = (4, 7, 12, 13, 64, 101)
    kw = dict(lr=0.05, momentum=0.9, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov,
              maximize=maximize)
    start, grads, run = _written_out_case(sizes, steps=12)
    ref = [t.numpy().copy() for t in start]
    bufs = [np.zeros(n, dtype=np.float32) for n in sizes]
    for step, step_grads in enumerate(grads):
        for p, g, buf in zip(ref, step_grads, bufs):
            _fused_cuda_sgd_reference(p, g.numpy(), buf, first=step == 0, **kw)
    ref = [torch.from_numpy(p) for p in ref]
    assert_params_equal(run(lambda ps: FusedSGD(ps, rounding="torch_cuda_fused", **kw), wrap), ref)
    assert not all(torch.equal(a, b) for a, b in zip(run(lambda ps: FusedSGD(ps, rounding="torch_cpu", **kw)), ref))


def _cuda_adam_reference(p, g, m, v, *, step, lr, betas, eps, weight_decay, adamw, maximize, for_loop):
    """torch's CUDA foreach Adam/AdamW step, or (for_loop) its for-loop step, on one float32
    tensor (numpy arrays, updated in place) as ATen's CUDA kernels compute each op, element
    by element with exact fused multiply-adds: the lerp, addcmul and addcdiv contracted, the
    bias correction divided (foreach) or multiplied by its reciprocal (for-loop: the double
    one rounded once, as measured on a GPU)."""
    f = np.float32
    b1, b2 = betas
    bc2s, neg_step = f((1 - b2 ** step) ** 0.5), -f(lr / (1 - b1 ** step))
    w1, w2, inv = f(1 - b1), f(1 - b2), f(float_reciprocal((1 - b2 ** step) ** 0.5))
    for i in range(p.size):
        gi = -g[i] if maximize else g[i]
        if weight_decay and adamw:
            p[i] = p[i] * f(1 - lr * weight_decay)
        elif weight_decay:
            gi = _fma32(p[i], f(weight_decay), gi)
        diff = gi - m[i]
        m[i] = _fma32(w1, diff, m[i]) if w1 < 0.5 else _fma32(-diff, f(1) - w1, gi)  # lerp
        v[i] = _fma32(w2, gi * gi, v[i] * f(b2))
        d = (np.sqrt(v[i]) * inv if for_loop else np.sqrt(v[i]) / bc2s) + f(eps)
        p[i] = _fma32(neg_step, m[i] / d, p[i])


def _cuda_adagrad_reference(p, g, s, *, clr, weight_decay, eps, maximize, for_loop):
    """torch's CUDA foreach Adagrad step (multiply, divide, add: the CPU step's rounding), or
    (for_loop) its for-loop step, whose addcdiv is one fused multiply-add."""
    f = np.float32
    for i in range(p.size):
        gi = -g[i] if maximize else g[i]
        if weight_decay:
            gi = _fma32(p[i], f(weight_decay), gi)
        s[i] = _fma32(gi, gi, s[i])
        std = np.sqrt(s[i]) + f(eps)
        p[i] = _fma32(-f(clr), gi / std, p[i]) if for_loop else p[i] + (-f(clr) * gi) / std


CUDA_STEPS = [
    ("adamw", dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.05, adamw=True, maximize=False)),
    ("adam-l2-maximize", dict(lr=1e-2, betas=(0.6, 0.95), eps=1e-6, weight_decay=0.1, adamw=False, maximize=True)),
    ("adagrad", dict(lr=0.05, lr_decay=0.0, weight_decay=0.0, eps=1e-10, maximize=False)),
    ("adagrad-decay-maximize", dict(lr=0.05, lr_decay=0.01, weight_decay=0.1, eps=1e-10, maximize=True)),
]


@pytest.mark.parametrize("wrap", [None, 0.5], ids=["stepped-directly", "offload0.5-accelerator-path"])
@pytest.mark.parametrize("for_loop", [False, True], ids=["foreach", "for-loop"])
@pytest.mark.parametrize("name,kw", CUDA_STEPS, ids=[n for n, _ in CUDA_STEPS])
def test_cuda_foreach_and_for_loop_roundings_are_their_float_arithmetic(name, kw, for_loop, wrap):
    """The CPU kernels' rounding="torch_cuda_foreach"/"torch_cuda_for_loop" Adam and
    "torch_cpu"/"torch_cuda_for_loop" Adagrad (what the offloaded share of a GPU run with the
    user's torch optimizer, foreach=None or False, takes) against that arithmetic written out
    with exact fused multiply-adds, 8 steps, directly and half offloaded.  The two roundings
    end apart (the test tells them apart); the cuda tests below compare with torch itself."""
    sizes = (4, 7, 13, 64, 101)
    start, grads, run = _written_out_case(sizes, steps=8)
    adam = name.startswith("adam")

    def optimizer(rounding):
        if adam:
            return lambda ps: FusedAdam(ps, lr=kw["lr"], betas=kw["betas"], eps=kw["eps"],
                                        weight_decay=kw["weight_decay"], adamw_mode=kw["adamw"],
                                        maximize=kw["maximize"], rounding=rounding)
        return lambda ps: FusedAdagrad(ps, rounding=rounding, **kw)

    ref = [t.numpy().copy() for t in start]
    states = [[np.zeros(n, dtype=np.float32) for n in sizes] for _ in range(2 if adam else 1)]
    for step, step_grads in enumerate(grads, start=1):
        for i, g in enumerate(step_grads):
            if adam:
                _cuda_adam_reference(ref[i], g.numpy(), states[0][i], states[1][i], step=step, for_loop=for_loop, **kw)
            else:
                clr = kw["lr"] / (1 + (step - 1) * kw["lr_decay"])
                _cuda_adagrad_reference(ref[i], g.numpy(), states[0][i], clr=clr, weight_decay=kw["weight_decay"],
                                        eps=kw["eps"], maximize=kw["maximize"], for_loop=for_loop)
    ref = [torch.from_numpy(p) for p in ref]
    rounding = "torch_cuda_for_loop" if for_loop else ("torch_cuda_foreach" if adam else "torch_cpu")
    other = "torch_cuda_foreach" if for_loop and adam else ("torch_cpu" if for_loop else "torch_cuda_for_loop")
    assert_params_equal(run(optimizer(rounding), wrap), ref)
    assert not all(torch.equal(a, b) for a, b in zip(run(optimizer(other)), ref))


def test_the_fused_cuda_adagrads_learning_rate():
    """``lr / (1 + (step - 1) * lr_decay)`` with ``step - 1`` in float32 and one rounding for
    the multiply-add: at most an ulp from the plain formula, and not always the same."""
    lr = 3e-3
    plain = [lr / (1 + (s - 1) * 0.013) for s in range(1, 2000)]
    fused = [fused_cuda_adagrad_clr(lr, 0.013, s) for s in range(1, 2000)]
    assert fused[0] == lr and fused != plain
    assert all(abs(a - b) <= 2 * math.ulp(a) for a, b in zip(fused, plain))


def test_the_fused_kernels_scalars_are_float32_arithmetic():
    """At step 1 powf(beta, 1) is beta: the scalars are float32 operations on float32
    values, each rounded once (a double computation gives other bits here)."""
    f32 = np.float32
    lr, beta1, beta2 = 3e-4, 0.9, 0.95
    step_size, bc2s = fused_cuda_scalars(lr, beta1, beta2, 1)
    assert step_size == float(f32(lr) / (f32(1) - f32(beta1)))
    assert bc2s == float(np.sqrt(f32(1) - f32(beta2)))
    assert step_size != lr / (1 - beta1)
    later = fused_cuda_scalars(lr, beta1, beta2, 5000)  # another block of the cached powers
    assert later[0] == pytest.approx(lr / (1 - beta1 ** 5000), rel=1e-6)
    assert fused_cuda_scalars(lr, beta1, beta2, 7, bias_correction=False) == (float(f32(lr)), 1.0)


def test_bad_roundings_are_refused():
    p = [nn.Parameter(torch.zeros(3))]
    with pytest.raises(ValueError, match="rounding must be one of 'torch_cpu', 'torch_cuda_foreach', "
                                         "'torch_cuda_fused', 'torch_cpu_fused', 'torch_cuda_for_loop', got 'cuda'"):
        FusedAdam(p, rounding="cuda")
    with pytest.raises(ValueError, match="rounding must be one of 'torch_cpu', 'torch_cuda_fused', "
                                         "'torch_cuda_for_loop', got 'torch_cuda_foreach'"):
        FusedAdagrad(p, rounding="torch_cuda_foreach")  # its foreach step rounds as its CPU step: one name
    with pytest.raises(ValueError, match="torch_sqrt=True is torch's CPU square root"):
        FusedAdam(p, torch_sqrt=True, rounding="torch_cuda_fused")
    with pytest.raises(ValueError, match="rounding must be one of 'torch_cpu', 'torch_cuda_fused', "
                                         "'torch_cpu_fused', got 'torch_cuda_foreach'"):
        FusedSGD(p, rounding="torch_cuda_foreach")
    elsewhere = [nn.Parameter(torch.zeros(3, device="meta"))]  # a CUDA parameter, as far as the check goes
    for cls in (FusedAdam, FusedSGD):
        with pytest.raises(ValueError, match="rounding='torch_cpu_fused' is torch's CPU kernel, for CPU tensors, "
                                             "got a tensor on meta"):
            cls(elsewhere, rounding="torch_cpu_fused")
    module = load_cpu_extension(detect_isa().name, warn=False)
    t = torch.zeros(4)
    with pytest.raises(ValueError, match=r"rounding must be one of 0 \(torch's CPU step\), 1 .*, 3 \(its CPU fused "
                                         r"kernel\), 4 \(its CUDA for-loop step\), got 5"):
        module.adam_([t], [t.clone()], [t.clone()], [t.clone()], None, None, 1e-3, 0.9, 0.999, 1e-8, 0.0, 1e-3,
                     1.0, 1.0, False, True, False, False, rounding=5)
    with pytest.raises(ValueError, match=r"rounding must be one of 0 \(torch's CPU step\), 2 \(its CUDA fused "
                                         r"kernel\), 3 \(its CPU fused kernel\), got 4"):
        module.sgd_([t], [t.clone()], [t.clone()], None, 0.1, 0.9, 0.0, 0.0, 1.0, False, False, False, False, False,
                    rounding=4)  # its CUDA for-loop step rounds as its CPU step: code 0


# ---------------------------------------------------------------------------- on a GPU

def _cuda_model(device="cuda"):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 7), nn.Linear(7, 300)).to(device)


def _trained_or_skipped(make, model, name):
    """``model`` trained by the user's torch optimizer, or the test skipped where this torch
    has no such step on CUDA (fused Adagrad is CPU-only in torch 2.11: it refuses at the
    first step, not when built; later torch steps it on CUDA too)."""
    try:
        _cuda_train(model, make(model.parameters()))
    except RuntimeError as e:
        if "fused=True" not in str(e):
            raise
        pytest.skip(f"torch {torch.__version__} has no CUDA step for {name}: {e}")


def _cuda_train(model, opt, steps=30):
    device = next(model.parameters()).device
    g = torch.Generator(device=device).manual_seed(1)
    for _ in range(steps):
        opt.zero_grad()
        x = torch.randn(4, 256, device=device, generator=g)
        (model(x).square().mean() * 1e3).backward()  # gradients over many magnitudes
        opt.step()
    if device.type == "cuda":
        torch.cuda.synchronize()


ON_CUDA = [
    ("adamw-foreach", lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.05)),
    ("adamw-fused", lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.05, fused=True)),
    ("adam-l2-amsgrad-foreach", lambda ps: torch.optim.Adam(ps, lr=1e-3, weight_decay=0.05, amsgrad=True)),
    ("adam-l2-amsgrad-fused", lambda ps: torch.optim.Adam(ps, lr=1e-3, weight_decay=0.05, amsgrad=True,
                                                          fused=True)),
    ("adam-maximize-foreach", lambda ps: torch.optim.Adam(ps, lr=1e-3, betas=(0.8, 0.95), maximize=True)),
    # foreach=False: its for-loop step, the bias correction through a reciprocal
    ("adamw-for-loop", lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.05, foreach=False)),
    ("adam-l2-amsgrad-maximize-for-loop", lambda ps: torch.optim.Adam(ps, lr=1e-3, weight_decay=0.05, amsgrad=True,
                                                                      maximize=True, foreach=False)),
    ("adam-maximize-fused", lambda ps: torch.optim.Adam(ps, lr=1e-3, betas=(0.8, 0.95), maximize=True,
                                                        fused=True)),
    # SGD's and Adagrad's foreach steps round as their CPU steps (docs/correctness.md)
    ("sgd-nesterov-foreach", lambda ps: torch.optim.SGD(ps, lr=1e-4, momentum=0.9, nesterov=True,
                                                        weight_decay=0.01)),
    ("sgd-dampening-maximize-foreach", lambda ps: torch.optim.SGD(ps, lr=1e-5, momentum=0.9, dampening=0.9,
                                                                  maximize=True)),
    ("sgd-dampening-decay-for-loop", lambda ps: torch.optim.SGD(ps, lr=1e-4, momentum=0.9, dampening=0.9,
                                                                weight_decay=0.01, foreach=False)),
    # its fused kernel: 1 - dampening in float32, and with maximize and no decay the momentum
    # contracted otherwise in tensors of numel % 4 == 0 (csrc/common/sgd_rounding.h)
    ("sgd-dampening-maximize-fused", lambda ps: torch.optim.SGD(ps, lr=1e-5, momentum=0.9, dampening=0.9,
                                                                maximize=True, fused=True)),
    ("sgd-nesterov-fused", lambda ps: torch.optim.SGD(ps, lr=1e-4, momentum=0.9, nesterov=True, weight_decay=0.01,
                                                      fused=True)),
    ("adagrad-foreach", lambda ps: torch.optim.Adagrad(ps, lr=0.05, lr_decay=0.01, weight_decay=0.01)),
    ("adagrad-fused", lambda ps: torch.optim.Adagrad(ps, lr=0.05, lr_decay=0.01, weight_decay=0.01, fused=True)),
    # its for-loop step's addcdiv is one fused multiply-add
    ("adagrad-for-loop", lambda ps: torch.optim.Adagrad(ps, lr=0.05, lr_decay=0.01, weight_decay=0.01, maximize=True,
                                                        foreach=False)),
]


@pytest.mark.cuda
@pytest.mark.parametrize("name,make", ON_CUDA, ids=[n for n, _ in ON_CUDA])
@pytest.mark.parametrize("fraction", [None, 0.0, 0.5, 1.0], ids=["kernels", "offload0", "offload0.5", "offload1"])
def test_torch_optimizer_on_cuda_bit_for_bit(fraction, name, make, device="cuda"):
    """The user's torch optimizer on CUDA parameters, run by our kernels (directly, or
    through the offload optimizer: at 0.5 and 1 the CPU kernels update the offloaded
    share in the GPU's rounding), ends on the bits torch's own CUDA step ends on."""
    ref_model, model = _cuda_model(device), _cuda_model(device)
    _trained_or_skipped(make, ref_model, name)
    opt = to_fused_optimizer(make(model.parameters()))
    if fraction is not None:
        opt = OffloadOptimizer(opt, {p: n for n, p in model.named_parameters()}, offload_fraction=fraction,
                               bucket_size_mb=0.5)
    _cuda_train(model, opt)
    assert_modules_equal(model, ref_model)
    if fraction is not None:
        opt.close()


@pytest.mark.cuda
@pytest.mark.parametrize("name,make", ON_CUDA, ids=[n for n, _ in ON_CUDA])
def test_torch_optimizer_on_cuda_bit_for_bit_on_the_pytorch_fallback(monkeypatch, name, make):
    """Without our CUDA kernels (the pure-PyTorch backend, torch's fused kernels for the
    fused rounding) the same bits: Adam's for-loop reciprocal and Adagrad's two addcdiv
    forms are followed by torch's own ops there."""
    monkeypatch.setenv(ops.BACKEND_ENV, "torch")
    assert ops.backend_for("cuda") is ops.torch_backend
    ref_model, model = _cuda_model(), _cuda_model()
    _trained_or_skipped(make, ref_model, name)
    _cuda_train(model, to_fused_optimizer(make(model.parameters())))
    assert_modules_equal(model, ref_model)


class _GPUModel(L.LightningModule):
    def __init__(self, flags):
        super().__init__()
        self.flags = flags
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64))

    def training_step(self, batch, batch_idx):
        return self.net(batch[0]).square().mean()

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.1, **self.flags)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)]


@pytest.mark.cuda
@pytest.mark.parametrize("flags", [dict(), dict(foreach=False), dict(fused=True)], ids=["foreach", "for-loop", "fused"])
@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_trainer_on_gpu_with_torch_adamw_matches_plain_lightning(fraction, flags):
    """fastopt_offload at each fraction with the user's torch.optim.AdamW (CUDA's default
    foreach step, its for-loop step or fused=True), clipping by value and accumulation:
    Trainer()'s bits."""
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 64, generator=g))
    kw = dict(accelerator="gpu", devices=1, max_epochs=2, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False, accumulate_grad_batches=2,
              gradient_clip_val=0.05, gradient_clip_algorithm="value")
    ours, ref = _GPUModel(flags), _GPUModel(flags)
    L.Trainer(strategy=FastOptStrategy(offload_fraction=fraction, bucket_size_mb=0.05), **kw).fit(
        ours, torch.utils.data.DataLoader(data, batch_size=4))
    L.Trainer(**kw).fit(ref, torch.utils.data.DataLoader(data, batch_size=4))
    assert_modules_equal(ours, ref)
