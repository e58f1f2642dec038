"""``grad_factors``: clipping's multiply read in the kernels' one pass over the gradients.

An update given factors reads each gradient multiplied by each of them, rounded to the
gradient's dtype after each, exactly as multiplying the gradients in place first
(``torch._foreach_mul_`` by a float32 tensor, as clipping does) would leave them, and the
gradients stay as they are.  The offload optimizer hands a host bucket's clipping factors
to its update that way where the gradients are its own host copies (forgotten when the
step ends), and multiplies in place where they are ``p.grad`` (readable after the step,
as torch leaves them)."""

import functools
import math

import pytest
import torch
from torch import nn

from lightning_fastopt import FusedAdagrad, FusedAdam, FusedLAMB, FusedLion, FusedSGD
from lightning_fastopt import functional as F
from lightning_fastopt.offload import OffloadOptimizer
from lightning_fastopt.ops.rounding import ROUNDINGS
from tests.helpers import SIZES


def _adam(p, g, st, **kw):
    kw.setdefault("rounding", "torch_cpu")
    return F.fused_adam_(p, g, st[0], st[1], step=3, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
                         **kw)


def _sgd(p, g, st, **kw):
    return F.fused_sgd_(p, g, st[0], step=2, lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True, **kw)


def _adagrad(p, g, st, **kw):
    return F.fused_adagrad_(p, g, st[0], step=2, lr=0.1, weight_decay=0.01, **kw)


def _lion(p, g, st, **kw):
    return F.fused_lion_(p, g, st[0], lr=1e-3, beta1=0.9, beta2=0.99, weight_decay=0.1, **kw)


ALGORITHMS = {"adam": (_adam, 2), "sgd": (_sgd, 1), "adagrad": (_adagrad, 1), "lion": (_lion, 1)}


def _tensors(states: int, grad_dtype: torch.dtype, seed: int = 0):
    """Float32 params, gradients of ``grad_dtype`` (some large: products that round), and
    ``states`` lists of nonzero state, of every size of :data:`SIZES`."""
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(n, generator=g) for n in SIZES]
    grads = [(torch.randn(n, generator=g) * 3).to(grad_dtype) for n in SIZES]
    state = [[torch.rand(n, generator=g) for n in SIZES] for _ in range(states)]
    return params, grads, state


def _clone(tensors):
    return [t.clone() for t in tensors]


def _both(call, states, grad_dtype, factors, **kw):
    """The update with ``grad_factors`` and the same update after multiplying the gradients
    in place by each factor: (params, state, half copies) of each, and whether the
    gradients given factors stayed as they were."""
    params, grads, state = _tensors(states, grad_dtype)
    runs = []
    for fused in (True, False):
        p, g, st = _clone(params), _clone(grads), [_clone(s) for s in state]
        copies = [torch.empty(t.shape, dtype=torch.bfloat16) for t in p]
        if fused:
            call(p, g, st, param_copies=copies, grad_factors=factors, **kw)
            untouched = all(torch.equal(a, b) for a, b in zip(g, grads))
        else:
            for f in factors:
                torch._foreach_mul_(g, torch.tensor(f, dtype=torch.float32))
            call(p, g, st, param_copies=copies, **kw)
        runs.append(p + [t for s in st for t in s] + copies)
    return runs, untouched


@pytest.mark.parametrize("factors", [[0.37], [0.37, 0.7712345], []], ids=["one", "two", "none"])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", ALGORITHMS)
def test_an_update_given_factors_is_the_update_of_the_gradients_multiplied_in_place(backend, name, grad_dtype,
                                                                                      factors):
    call, states = ALGORITHMS[name]
    (ours, ref), untouched = _both(call, states, grad_dtype, factors)
    assert untouched
    assert all(torch.equal(a, b) for a, b in zip(ours, ref))


@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_adams_every_rounding_reads_the_factors_alike(compiled, rounding):
    """Adam's roundings are separate kernels (torch's CUDA ones followed on the CPU too):
    each reads the factors through the same load of the gradient."""
    (ours, ref), untouched = _both(_adam, 2, torch.bfloat16, [0.37, 0.77], rounding=rounding)
    assert untouched
    assert all(torch.equal(a, b) for a, b in zip(ours, ref))


def test_bad_factors_are_refused_before_anything_is_written(backend):
    params, grads, (m, v) = _tensors(2, torch.float32)
    before = _clone(params)
    for bad in (math.inf, math.nan):
        with pytest.raises(ValueError, match="grad_factors must be finite numbers"):
            _adam(params, grads, (m, v), grad_factors=[0.5, bad])
    with pytest.raises(ValueError, match="check_finite reads the gradients before grad_factors"):
        _adam(params, grads, (m, v), grad_factors=[0.5], check_finite=True)
    assert all(torch.equal(a, b) for a, b in zip(params, before))


def test_the_compiled_kernels_refuse_bad_factors_themselves(compiled):
    """The last line of defence: the binding checks what functional checks."""
    params, grads, (m, v) = _tensors(2, torch.float32)
    args = dict(params=params, grads=grads, exp_avgs=m, exp_avg_sqs=v, max_exp_avg_sqs=None, copies=None, lr=1e-3,
                beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step_size=1e-3, bias_correction2_sqrt=1.0,
                inv_grad_scale=1.0, amsgrad=False, adamw=True, maximize=False)
    with pytest.raises(ValueError, match="grad_factors must be finite"):
        compiled.adam_(**args, check_finite=False, grad_factors=[math.inf])
    with pytest.raises(ValueError, match="check_finite reads the gradients before grad_factors"):
        compiled.adam_(**args, check_finite=True, grad_factors=[0.5])


def test_an_optimizer_that_reads_no_factors_refuses_them():
    """LAMB's trust ratio reads the gradients' norms in passes of their own: a wrapper
    multiplies its gradients instead (FusedOptimizer.reads_grad_factors)."""
    p = nn.Parameter(torch.randn(4))
    p.grad = torch.randn(4)
    assert all(c.reads_grad_factors for c in (FusedAdam, FusedSGD, FusedAdagrad, FusedLion))
    opt = FusedLAMB([p], lr=1e-3)
    assert not opt.reads_grad_factors
    opt.grad_factors = (0.5,)
    with pytest.raises(ValueError, match="FusedLAMB does not read grad_factors"):
        opt.step()


def _clipped_step(copy_on_cpu: bool, fraction: float, fused: bool, monkeypatch, make=FusedAdam):
    """Two offloaded AdamW steps on four small layers, each clipped by 0.37 after backward;
    ``fused`` False: the update multiplies the gradients in place first, as an optimizer that
    reads no factors has them.  Returns the weights, the optimizer state, the gradients as
    ``p.grad`` holds them after the last step, and the factors each host update was given."""
    given = []
    with monkeypatch.context() as m:
        if not fused:
            m.setattr(make, "reads_grad_factors", False)
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(4)])
        opt = OffloadOptimizer(make(model.parameters(), lr=1e-2, weight_decay=0.01),
                               {p: n for n, p in model.named_parameters()}, offload_fraction=fraction,
                               bucket_size_mb=0.005, copy_on_cpu=copy_on_cpu)
        for b in opt.layout.buckets:
            real = b.inner._take_step
            b.inner._take_step = lambda *a, _real=real, _inner=b.inner: (given.append(_inner.grad_factors),
                                                                        _real(*a))[1]
        for step in range(2):
            opt.zero_grad()
            model(torch.randn(8, 32, generator=torch.Generator().manual_seed(step))).square().mean().backward()
            opt.scale_gradients(torch.tensor(0.37))
            opt.step()
        state = [t.clone() for st in opt.state_dict()["state"].values() for t in st.values()
                 if isinstance(t, torch.Tensor)]
        weights = [p.detach().clone() for p in model.parameters()]
        grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
        opt.close()
    return weights, state, grads, given


@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_an_offloaded_clipped_step_reads_its_own_host_gradients_multiplied(fraction, monkeypatch):
    """The accelerator's code path: each host bucket's update is given the clipping factor
    (no pass of its own over the gradients), and ends where multiplying them first ends."""
    ours, state, _, given = _clipped_step(True, fraction, True, monkeypatch)
    ref, ref_state, _, ref_given = _clipped_step(True, fraction, False, monkeypatch)
    assert given and all(g == (pytest.approx(0.37),) for g in given) and not any(ref_given)
    assert all(torch.equal(a, b) for a, b in zip(ours, ref))
    assert len(state) == len(ref_state) and all(torch.equal(a, b) for a, b in zip(state, ref_state))


def test_where_the_gradients_are_p_grad_they_are_multiplied_in_place_as_torch_leaves_them(monkeypatch):
    """A model on the CPU without the accelerator's copies: the step reads ``p.grad``, which
    the user may read after the step, so it is multiplied in place (clipped, as torch
    leaves it), and no update is given factors."""
    torchs_adamw = functools.partial(FusedAdam, torch_sqrt=True)  # torch's CPU square root: its bits
    _, _, grads, given = _clipped_step(False, 1.0, True, monkeypatch, make=torchs_adamw)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(4)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    for step in range(2):
        opt.zero_grad()
        model(torch.randn(8, 32, generator=torch.Generator().manual_seed(step))).square().mean().backward()
        torch._foreach_mul_([p.grad for p in model.parameters()], torch.tensor(0.37))
        opt.step()
    assert not any(given)
    assert all(torch.equal(a, p.grad) for a, p in zip(grads, model.parameters()))


@pytest.mark.cuda
@pytest.mark.parametrize("name", ALGORITHMS)
def test_on_cuda_tensors_the_factors_multiply_copies_of_the_gradients(cuda_ext, name):
    """The CUDA kernels read no factors: the functions hand them gradients multiplied as
    copies, the same bits as multiplying in place first, the gradients left as they were."""
    call, states = ALGORITHMS[name]
    params, grads, state = _tensors(states, torch.bfloat16)
    cuda = lambda ts: [t.cuda() for t in ts]  # noqa: E731
    runs = []
    for fused in (True, False):
        p, g, st = cuda(params), cuda(grads), [cuda(s) for s in state]
        if fused:
            call(p, g, st, grad_factors=[0.37, 0.77])
            assert all(torch.equal(a.cpu(), b) for a, b in zip(g, grads))
        else:
            for f in (0.37, 0.77):
                torch._foreach_mul_(g, torch.tensor(f, dtype=torch.float32, device="cuda"))
            call(p, g, st)
        runs.append([t.cpu() for t in p + [x for s in st for x in s]])
    assert cuda_ext.calls.get(f"{name}_", 0) == 2
    assert all(torch.equal(a, b) for a, b in zip(*runs))
