"""The contract of lightning_fastopt.functional: unscaling, the overflow skip, half
precision grads and params, and the half-precision parameter copies."""

import math

import pytest
import torch

from lightning_fastopt import functional as F
from lightning_fastopt.ops import torch_backend
from tests import references as ref
from tests.helpers import SIZES, assert_params_equal

HALF = [torch.float16, torch.bfloat16]


def _adam_state(sizes):
    params = [torch.randn(n) for n in sizes]
    return params, [torch.zeros(n) for n in sizes], [torch.zeros(n) for n in sizes]


def _adam(params, grads, m, v, step=1, **kw):
    args = dict(step=step, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    args.update(kw)
    return F.fused_adam_(params, grads, m, v, **args)


def _every_algorithm():
    """(name, call(params, grads, **contract_kwargs) -> skipped) for each functional."""
    def adam(p, g, **kw):
        return F.fused_adam_(p, g, [torch.zeros_like(x) for x in p], [torch.zeros_like(x) for x in p],
                             [torch.zeros_like(x) for x in p], step=1, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
                             weight_decay=0.01, amsgrad=True, **kw)

    def sgd(p, g, **kw):
        return F.fused_sgd_(p, g, [torch.zeros_like(x) for x in p], step=2, lr=0.1, momentum=0.9,
                            weight_decay=0.01, **kw)

    def adagrad(p, g, **kw):
        return F.fused_adagrad_(p, g, [torch.full_like(x, 0.1) for x in p], step=1, lr=0.1, **kw)

    def lion(p, g, **kw):
        return F.fused_lion_(p, g, [torch.zeros_like(x) for x in p], lr=1e-3, beta1=0.9, beta2=0.99,
                             weight_decay=0.1, **kw)

    def lamb(p, g, **kw):
        return F.fused_lamb_(p, g, [torch.zeros_like(x) for x in p], [torch.zeros_like(x) for x in p], step=1,
                             lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.01, **kw)

    def lars(p, g, **kw):
        return F.fused_lars_(p, g, [torch.zeros_like(x) for x in p], lr=0.1, momentum=0.9, weight_decay=1e-4,
                             **kw)

    return [("adam", adam), ("sgd", sgd), ("adagrad", adagrad), ("lion", lion), ("lamb", lamb), ("lars", lars)]


ALGOS = _every_algorithm()


@pytest.mark.parametrize("name,call", ALGOS, ids=[a[0] for a in ALGOS])
def test_check_finite_skips_everything(backend, name, call):
    for bad in (math.inf, -math.inf, math.nan):
        params = [torch.randn(n) for n in SIZES]
        grads = [torch.randn(n) for n in SIZES]
        grads[3][700] = bad
        before = [p.clone() for p in params]
        assert call(params, grads, check_finite=True) is True
        for p, b in zip(params, before):
            assert torch.equal(p, b)
        grads[3][700] = 0.5
        assert call(params, grads, check_finite=True) is False
        assert not torch.equal(params[3], before[3])


def test_check_finite_leaves_state_untouched(backend):
    params, m, v = _adam_state(SIZES)
    grads = [torch.randn(n) for n in SIZES]
    _adam(params, grads, m, v)
    snapshot = [t.clone() for t in params + m + v]
    grads[2][3] = math.nan
    assert _adam(params, grads, m, v, step=2, check_finite=True)
    for t, s in zip(params + m + v, snapshot):
        assert torch.equal(t, s)


@pytest.mark.parametrize("name,call", ALGOS, ids=[a[0] for a in ALGOS])
@pytest.mark.parametrize("grad_dtype", [torch.float32] + HALF)
def test_grad_scale_equals_unscaled_grads(backend, name, call, grad_dtype):
    """Grads multiplied by the loss scale and grad_scale=S give the unscaled result."""
    scale = 1024.0
    params = [torch.randn(n) for n in SIZES]
    grads = [torch.randn(n).to(grad_dtype) for n in SIZES]
    scaled = [(g.float() * scale).to(grad_dtype) for g in grads]  # exact: power of two
    expected = [p.clone() for p in params]
    call(expected, [g.float() for g in grads])
    call(params, scaled, grad_scale=scale)
    assert_params_equal(params, expected)
    # the grads themselves are not modified
    for s, g in zip(scaled, grads):
        assert torch.equal(s, (g.float() * scale).to(grad_dtype))


def test_grad_scale_tensor(backend):
    params, m, v = _adam_state(SIZES)
    p2, m2, v2 = [p.clone() for p in params], [x.clone() for x in m], [x.clone() for x in v]
    grads = [torch.randn(n) * 64 for n in SIZES]
    _adam(params, grads, m, v, grad_scale=torch.tensor(64.0))
    _adam(p2, grads, m2, v2, grad_scale=64.0)
    for a, b in zip(params, p2):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name,call", ALGOS, ids=[a[0] for a in ALGOS])
@pytest.mark.parametrize("copy_dtype", HALF)
def test_param_copies_are_rounded_updated_params(backend, name, call, copy_dtype):
    params = [torch.randn(n) for n in SIZES]
    grads = [torch.randn(n).to(copy_dtype) for n in SIZES]
    copies = [torch.empty(n, dtype=copy_dtype) for n in SIZES]
    call(params, grads, param_copies=copies)
    for p, c in zip(params, copies):
        assert torch.equal(c, p.to(copy_dtype)), "copy must equal torch's round-to-nearest-even of the param"


def test_bf16_rounding_matches_torch_on_edge_values(backend):
    """Ties, NaN, inf, subnormals and the largest values round exactly as torch does."""
    special = torch.tensor([1.00390625, 1.01171875, -1.00390625, 3.3895314e38, -3.3895314e38, 1e-40, -1e-40,
                            math.inf, -math.inf, 65504.0, 65520.0, 6e-8, 0.0, -0.0] * 3)
    for dtype in HALF:
        params = [special.clone()]
        copies = [torch.empty_like(special, dtype=dtype)]
        # lr 0 and no momentum: the update leaves the params as they are and only copies
        F.fused_sgd_(params, [torch.zeros_like(special)], None, step=1, lr=0.0, param_copies=copies)
        assert torch.equal(copies[0], special.to(dtype)) or torch.allclose(
            copies[0].float(), special.to(dtype).float(), equal_nan=True)
        nan = torch.tensor([math.nan] * 20)
        copies = [torch.empty_like(nan, dtype=dtype)]
        F.fused_sgd_([nan.clone()], [torch.zeros_like(nan)], None, step=1, lr=0.0, param_copies=copies)
        assert copies[0].isnan().all()


@pytest.mark.parametrize("grad_dtype", HALF)
def test_half_grads_with_fp32_master(backend, grad_dtype):
    """fp16/bf16 grads read in the kernel give the result of the float32 upcast grads
    (torch's CPU step, ``torch_sqrt``: its bits)."""
    params, m, v = _adam_state(SIZES)
    mirror = [p.clone() for p in params]
    rm, rv = [x.clone() for x in m], [x.clone() for x in v]
    for step in range(1, 21):
        grads = [torch.randn(n).to(grad_dtype) for n in SIZES]
        _adam(params, grads, m, v, step=step, torch_sqrt=True)
        for p, g, a, b in zip(mirror, grads, rm, rv):
            ref.adam_step(p, g.float(), a, b, step=step, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
                          weight_decay=0.01, adamw=True)
    assert_params_equal(params, mirror)


@pytest.mark.parametrize("dtype", HALF)
def test_half_params_without_master(backend, dtype):
    """fp16/bf16 params are updated in their own dtype with float32 state: each step equals
    the float32 computation (torch's CPU step) rounded to the param dtype."""
    params = [torch.randn(n).to(dtype) for n in SIZES]
    m = [torch.zeros(n) for n in SIZES]
    v = [torch.zeros(n) for n in SIZES]
    for step in range(1, 11):
        grads = [torch.randn(n).to(dtype) for n in SIZES]
        expected = []
        rm, rv = [x.clone() for x in m], [x.clone() for x in v]
        for p, g, a, b in zip(params, grads, rm, rv):
            p32 = p.float()
            ref.adam_step(p32, g.float(), a, b, step=step, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
                          weight_decay=0.01, adamw=True)
            expected.append(p32)
        _adam(params, grads, m, v, step=step, torch_sqrt=True)
        assert all(p.dtype == dtype for p in params)
        assert_params_equal(params, [e.to(dtype) for e in expected])  # one rounding to the half type
        assert_params_equal(m + v, rm + rv)


def test_tensor_lr(backend):
    params, m, v = _adam_state(SIZES)
    p2, m2, v2 = [p.clone() for p in params], [x.clone() for x in m], [x.clone() for x in v]
    grads = [torch.randn(n) for n in SIZES]
    _adam(params, grads, m, v, lr=torch.tensor(3e-3))
    _adam(p2, grads, m2, v2, lr=torch.tensor(3e-3).item())  # the float32 value the tensor holds
    for a, b in zip(params, p2):
        assert torch.equal(a, b)


def test_compiled_and_fallback_agree(compiled):
    """The pure-PyTorch backend computes what the kernels compute (all algorithms): the same
    bits, but for LAMB and LARS (rtol 1e-6), whose norms the two sum in another order."""
    for name, call in ALGOS:
        params = [torch.randn(n) for n in SIZES]
        grads = [torch.randn(n).bfloat16() for n in SIZES]
        copies = [torch.empty(n, dtype=torch.bfloat16) for n in SIZES]
        fb_params = [p.clone() for p in params]
        fb_copies = [c.clone() for c in copies]
        torch.manual_seed(7)
        call(params, grads, grad_scale=2.0, param_copies=copies)
        import lightning_fastopt.ops as ops
        saved = ops.cpu_backend
        ops.cpu_backend = lambda: torch_backend
        try:
            torch.manual_seed(7)
            call(fb_params, grads, grad_scale=2.0, param_copies=fb_copies)
        finally:
            ops.cpu_backend = saved
        if name in ("lamb", "lars"):
            for a, b in zip(params, fb_params):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=lambda m: f"{name}: {m}")
        else:
            assert_params_equal(params, fb_params)


def test_the_fallback_rounds_sgds_dampening_as_each_rounding(compiled, monkeypatch):
    """1 - dampening as torch's CPU step rounds it, or (torch_cuda_fused) as its CUDA fused
    kernel does, in float32: the kernels' bits on the pure-PyTorch backend too, and the two
    roundings differ (dampening 0.9; no maximize, so no other difference)."""
    import lightning_fastopt.ops as ops

    def run(rounding):
        torch.manual_seed(3)
        params = [torch.randn(n) for n in SIZES]
        buffers = [torch.randn(n) for n in SIZES]
        grads = [torch.randn(n) for n in SIZES]
        F.fused_sgd_(params, grads, buffers, step=2, lr=0.1, momentum=0.9, dampening=0.9, rounding=rounding)
        return params + buffers

    compiled_runs = {r: run(r) for r in ("torch_cpu", "torch_cuda_fused")}
    monkeypatch.setattr(ops, "cpu_backend", lambda: torch_backend)
    for rounding, want in compiled_runs.items():
        assert_params_equal(run(rounding), want)
    assert not all(torch.equal(a, b) for a, b in zip(*compiled_runs.values()))


def test_non_contiguous_tensors_use_the_fallback(compiled):
    base = torch.randn(8, 6)
    p = base.t()  # not contiguous
    mirror = p.clone()
    m, v = torch.zeros(8, 6).t(), torch.zeros(8, 6).t()
    g = torch.randn(6, 8)
    _adam([p], [g], [m], [v], torch_sqrt=True)
    ref.adam_step(mirror, g, torch.zeros(6, 8), torch.zeros(6, 8), step=1, lr=1e-2, beta1=0.9, beta2=0.999,
                  eps=1e-8, weight_decay=0.01, adamw=True)
    assert torch.equal(p, mirror)
    assert torch.equal(base.t(), p)  # updated in place, through the view


def test_global_grad_norm_and_finite(backend):
    grads = [torch.randn(n) for n in SIZES] + [torch.randn(5).half(), torch.randn(9).bfloat16()]
    expected = math.sqrt(sum(g.double().pow(2).sum().item() for g in grads))
    assert F.global_grad_norm(grads) == pytest.approx(expected, rel=1e-6)
    assert F.global_grad_norm(grads, grad_scale=4.0) == pytest.approx(expected / 4, rel=1e-6)
    assert F.grads_all_finite(grads)
    grads[-1][3] = math.inf
    assert not F.grads_all_finite(grads)


def test_square_sums_are_per_tensor_and_do_not_depend_on_the_other_tensors(backend):
    """Each tensor's sum of squares (what a sharded step gathers from the ranks to add in the
    parameters' order): the same bits whichever tensors are reduced with it, and the global
    norm is their sum in order."""
    grads = [torch.randn(n) for n in SIZES] + [torch.randn(5).half(), torch.randn(9).bfloat16()]
    sums = F.square_sums(grads)
    assert sums == [F.square_sums([g])[0] for g in grads] == F.square_sums(grads[:2]) + F.square_sums(grads[2:])
    assert sums == pytest.approx([g.double().pow(2).sum().item() for g in grads], rel=1e-6)
    assert F.global_grad_norm(grads, grad_scale=2.0) == math.sqrt(sum(sums)) / 2.0


def test_list_length_mismatch_is_a_clear_error(backend):
    params, m, v = _adam_state(SIZES)
    with pytest.raises(ValueError, match="exp_avgs has 3 tensors but params has 4"):
        _adam(params, [torch.randn(n) for n in SIZES], m[:3], v)


def test_every_backend_takes_the_same_argument_names(compiled):
    """functional calls the backends by keyword: the compiled CPU kernels and the
    pure-PyTorch backend name every argument alike, in the same order (the CUDA module
    shares the CPU module's signatures, csrc/common/optimizer_bindings.h; what follows
    ``*`` there are the CUDA module's device scalars, and the per-tensor ``norms`` LAMB and
    LARS may be given, which the pure-PyTorch backend takes as keyword-only too)."""
    import inspect
    import re

    import lightning_fastopt.ops as ops

    for name in list(ops.KERNELS) + ["all_finite", "sum_squares", "lamb_norms_"]:
        doc = getattr(compiled, name).__doc__.splitlines()[0]
        listed, _, keywords = re.match(rf"{name}\((.*)\) ->", doc).group(1).partition(", *,")
        compiled_names = [a.split(":")[0].strip() for a in listed.split(", ")]
        compiled_keywords = {a.split(":")[0].strip() for a in keywords.split(", ") if a.strip()}
        params = inspect.signature(getattr(torch_backend, name)).parameters.values()
        assert [p.name for p in params if p.kind != p.KEYWORD_ONLY] == compiled_names, name
        assert {p.name for p in params if p.kind == p.KEYWORD_ONLY} <= compiled_keywords, name


def _lamb_args(step=3):
    return dict(step=step, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.01, max_grad_norm=1.0, grad_scale=4.0)


def _pieces(tensors, at):
    """Each tensor's rows split in two at ``at`` of them (FSDP2's rows on two ranks), as views."""
    return [t[:at] for t in tensors], [t[at:] for t in tensors]


@pytest.mark.parametrize("algorithm", ["lamb", "lars"])
def test_pieces_given_the_whole_tensors_norms_step_as_the_whole_tensors_do(backend, algorithm):
    """Where a tensor is split into pieces (FSDP2's rows), each piece's norm sums
    (``lamb_update_norms``, or the gradients' and weights' ``square_sums`` for LARS) added
    up, given as ``norms``, make each piece's update the whole tensor's: the trust ratios
    are the whole tensor's (without them, each piece's own: updates more than 1% apart).
    No exact reference: the pieces' sums are added in another order than one pass over the
    tensor (the compiled kernels add float32 partial sums of blocks: the totals agree to
    1e-6, the float32 trust ratios to an ulp or so), so within 1e-6 of the update (and two
    ulps of the weights).  Unsharded, the sums given are the
    kernel's own: the same bits, weights and state (the compiled LAMB, given them, advances
    the moments and updates in one pass instead of two)."""
    g = torch.Generator().manual_seed(3)
    shapes = [(7, 5), (9,), (12, 3)]
    params = [torch.randn(s, generator=g) for s in shapes]
    grads = [torch.randn(s, generator=g) * 4 for s in shapes]
    states = [[torch.rand(s, generator=g) * (0.1 if k else 1) for s in shapes] for k in range(2)]

    def run(ps, gs, sts, norms=None, with_state=False):
        ps, sts = [p.clone() for p in ps], [[t.clone() for t in st] for st in sts]
        if algorithm == "lamb":
            F.fused_lamb_(ps, gs, sts[0], sts[1], lr=0.01, global_grad_norm_value=3.0, norms=norms, **_lamb_args())
        else:
            F.fused_lars_(ps, gs, sts[0], lr=0.1, momentum=0.9, weight_decay=1e-4, grad_scale=4.0, norms=norms)
        return ps + [t for st in sts for t in st] if with_state else ps

    def sums(ps, gs, sts):
        if algorithm == "lamb":
            return F.lamb_update_norms(ps, gs, sts[0], sts[1], global_grad_norm_value=3.0, **_lamb_args())
        return torch.tensor(list(zip(F.square_sums(gs), F.square_sums(ps))), dtype=torch.float64)

    whole = run(params, grads, states)
    assert_params_equal(run(params, grads, states, sums(params, grads, states), with_state=True),
                        run(params, grads, states, with_state=True))
    split = [_pieces(t, 3) for t in (params, grads, *states)]  # piece k of params, grads, each state
    pieces = [[s[k] for s in split] for k in (0, 1)]
    piece_sums = [sums(ps, gs, sts) for ps, gs, *sts in pieces]
    total = piece_sums[0] + piece_sums[1]
    assert torch.allclose(total, sums(params, grads, states), rtol=1e-6)  # (float32 partial sums in the kernels)
    stepped = [run(ps, gs, sts, total) for ps, gs, *sts in pieces]
    own = [run(ps, gs, sts) for ps, gs, *sts in pieces]
    for i, w in enumerate(whole):
        update = w - params[i]
        torch.testing.assert_close(torch.cat([stepped[0][i], stepped[1][i]]) - params[i], update, rtol=0,
                                   atol=1e-6 * update.abs().max().item() + 5e-7)  # + two ulps of the weights
        off = (torch.cat([own[0][i], own[1][i]]) - params[i] - update).norm() / update.norm()
        assert off > 0.01, off  # each piece's own norms: another update


def test_lamb_update_norms_write_nothing(backend):
    params, grads = [torch.randn(6, 4)], [torch.randn(6, 4)]
    m, v = [torch.rand(6, 4)], [torch.rand(6, 4)]
    before = [t.clone() for t in (*params, *m, *v)]
    sums = F.lamb_update_norms(params, grads, m, v, **_lamb_args())
    assert sums.shape == (1, 2) and sums.dtype == torch.float64 and (sums > 0).all()
    assert all(torch.equal(a, b) for a, b in zip(before, (*params, *m, *v)))
