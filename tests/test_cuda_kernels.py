"""The CUDA kernels (csrc/cuda/) on a GPU.  Marked `cuda`: skipped without one.

What is checked, and how tight:
- against torch.optim on the GPU (Adam/AdamW with amsgrad and maximize, SGD, Adagrad),
  50 steps, three parameter groups, sizes 0, 1, 7, 1023 (and 1,000,003 for 20 steps),
  within Adam's float32 tolerance (rtol 1.3e-6 / atol 1e-5; SGD and Adagrad 1e-6): these
  run FusedAdam's default rounding, torch's CPU step's, against torch's CUDA steps (the CUDA
  roundings are held to torch.equal in tests/test_rounding.py);
- against the plain-PyTorch references for LAMB, LARS and Lion (tests/references.py);
- against the compiled CPU kernels, one step at a time from the same state, for every
  algorithm and option and every dtype combination (float32 masters with float32, fp16
  or bf16 gradients and an optional fp16/bf16 copy; fp16/bf16 parameters with their own
  or float32 gradients).  Both sides evaluate the same IEEE operations (FMA contraction
  is off in the CUDA build), so float32 results agree to rtol 1e-6 / atol 1e-7 (LAMB and
  LARS: 1e-5 / 1e-6, their norms are summed in another order); half-precision results
  to one unit in the last place of their type;
- more tensors and more chunks than one launch holds, with 4 KB and 32 KB kernel
  arguments (tensors of 21M and 170M elements span more than 320 and 2,560 blocks, with
  700 small tensors around them);
- found_inf set on the device leaves every parameter, state and copy untouched, and a
  step with device scalars performs no host synchronisation (torch's sync debug mode);
- CUDA-graph capture and replay of FusedAdam(capturable=True), FusedSGD and FusedLion
  equal eager steps;
- the reductions (per-tensor sums of squares, the finite check, unscaling) against torch;
- that CUDA parameters really run these kernels (not torch's fused ones).
"""

import math

import pytest
import torch

import lightning_fastopt.functional as F
import lightning_fastopt.ops as ops
from lightning_fastopt import FusedAdagrad, FusedAdam, FusedLAMB, FusedLars, FusedLion, FusedSGD
from tests import references as ref
from tests.helpers import BIG, SIZES, assert_params_close, run_twins, split_groups

pytestmark = pytest.mark.cuda

ADAM_TOL = dict(rtol=1.3e-6, atol=1e-5)
TIGHT = dict(rtol=1e-6, atol=1e-6)
NORM_TOL = dict(rtol=1e-5, atol=1e-5)
SAME_OPS = dict(rtol=1e-6, atol=1e-7)
SAME_OPS_NORMS = dict(rtol=1e-5, atol=1e-6)
ULP = {torch.float16: dict(rtol=2 ** -10, atol=2 ** -24), torch.bfloat16: dict(rtol=2 ** -7, atol=1e-38)}


# ---------------------------------------------------------------------------- vs torch.optim
@pytest.mark.parametrize("adamw", [True, False])
@pytest.mark.parametrize("amsgrad", [True, False])
@pytest.mark.parametrize("maximize", [True, False])
def test_adam_matches_torch_on_gpu(cuda_ext, adamw, amsgrad, maximize):
    overrides = [dict(), dict(lr=0.05, weight_decay=0.1), dict(betas=(0.8, 0.99), eps=1e-6, weight_decay=0.0)]
    torch_cls = torch.optim.AdamW if adamw else torch.optim.Adam
    a, b, oa, ob = run_twins(
        lambda g: FusedAdam(g, lr=1e-2, weight_decay=0.01, adamw_mode=adamw, amsgrad=amsgrad, maximize=maximize),
        lambda g: torch_cls(g, lr=1e-2, weight_decay=0.01, amsgrad=amsgrad, maximize=maximize, foreach=False),
        SIZES, overrides, device="cuda")
    assert_params_close(a, b, **ADAM_TOL)
    for x, y in zip(a, b):
        if x.numel():
            torch.testing.assert_close(oa.state[x]["exp_avg"], ob.state[y]["exp_avg"], **ADAM_TOL)
            torch.testing.assert_close(oa.state[x]["exp_avg_sq"], ob.state[y]["exp_avg_sq"], **ADAM_TOL)
    assert cuda_ext.calls.get("adam_", 0) >= 50


@pytest.mark.parametrize("make,make_ref,tol", [
    (lambda g: FusedAdam(g, lr=1e-3, weight_decay=0.01), lambda g: torch.optim.AdamW(g, lr=1e-3, weight_decay=0.01),
     ADAM_TOL),
    (lambda g: FusedSGD(g, lr=1e-2, momentum=0.9, nesterov=True, weight_decay=1e-4),
     lambda g: torch.optim.SGD(g, lr=1e-2, momentum=0.9, nesterov=True, weight_decay=1e-4), TIGHT),
    (lambda g: FusedAdagrad(g, lr=1e-2), lambda g: torch.optim.Adagrad(g, lr=1e-2), TIGHT),
], ids=["adamw", "sgd", "adagrad"])
def test_big_tensor_matches_torch_on_gpu(cuda_ext, make, make_ref, tol):
    """1,000,003 elements (many chunks, a tail) for 20 steps, as in the CPU tests."""
    a, b, _, _ = run_twins(make, make_ref, (BIG, 5), [dict()], steps=20, device="cuda")
    assert_params_close(a, b, **tol)


@pytest.mark.parametrize("momentum,dampening,nesterov,maximize,weight_decay", [
    (0.0, 0.0, False, False, 0.0), (0.0, 0.0, False, True, 0.01), (0.9, 0.0, True, False, 0.01),
    (0.9, 0.5, False, True, 0.0), (0.5, 0.1, False, False, 0.1)])
def test_sgd_matches_torch_on_gpu(cuda_ext, momentum, dampening, nesterov, maximize, weight_decay):
    kw = dict(lr=1e-2, momentum=momentum, dampening=dampening, nesterov=nesterov, maximize=maximize,
              weight_decay=weight_decay)
    a, b, _, _ = run_twins(lambda g: FusedSGD(g, **kw), lambda g: torch.optim.SGD(g, **kw, foreach=False),
                           SIZES, [dict(), dict(lr=0.05), dict(weight_decay=0.2)], device="cuda")
    assert_params_close(a, b, **TIGHT)
    assert cuda_ext.calls.get("sgd_", 0) >= 50


@pytest.mark.parametrize("lr_decay,weight_decay,init,maximize", [
    (0.0, 0.0, 0.0, False), (0.01, 0.1, 0.1, False), (0.0, 0.01, 0.5, True)])
def test_adagrad_matches_torch_on_gpu(cuda_ext, lr_decay, weight_decay, init, maximize):
    kw = dict(lr=1e-2, lr_decay=lr_decay, weight_decay=weight_decay, initial_accumulator_value=init,
              maximize=maximize, eps=1e-10)
    a, b, _, _ = run_twins(lambda g: FusedAdagrad(g, **kw), lambda g: torch.optim.Adagrad(g, **kw, foreach=False),
                           SIZES, [dict(), dict(lr=0.05), dict(eps=1e-6)], device="cuda")
    assert_params_close(a, b, **TIGHT)
    assert cuda_ext.calls.get("adagrad_", 0) >= 50


# ---------------------------------------------------------------------------- vs the references
@pytest.mark.parametrize("adam_w_mode,grad_averaging,bias_correction,use_nvlamb,weight_decay,max_grad_norm", [
    (True, True, True, False, 0.01, 1.0), (False, True, True, False, 0.01, 1.0),
    (True, False, False, False, 0.1, 0.0), (True, True, True, True, 0.0, 1.0)])
def test_lamb_matches_reference_on_gpu(cuda_ext, adam_w_mode, grad_averaging, bias_correction, use_nvlamb,
                                       weight_decay, max_grad_norm):
    kw = dict(adam_w_mode=adam_w_mode, grad_averaging=grad_averaging, bias_correction=bias_correction,
              use_nvlamb=use_nvlamb, weight_decay=weight_decay, max_grad_norm=max_grad_norm)
    params = [torch.randn(n, device="cuda", requires_grad=True) for n in SIZES + (BIG,)]
    mirror = [p.detach().clone() for p in params]
    opt = FusedLAMB(params, lr=1e-2, **kw)
    ms = [torch.zeros_like(p) for p in mirror]
    vs = [torch.zeros_like(p) for p in mirror]
    for step in range(1, 31):
        grads = [torch.randn_like(p) for p in params]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        ref.lamb_step(mirror, grads, ms, vs, step=step, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-6, **kw)
    assert_params_close(params, mirror, **NORM_TOL)
    assert cuda_ext.calls.get("lamb_", 0) == 30


def test_lamb_device_norm_equals_host_norm(cuda_ext):
    """Without a host-side norm the clipping divisor is computed on the device: same result."""
    sizes = SIZES + (BIG, 5000)
    base = [torch.randn(n, device="cuda") for n in sizes]
    runs = []
    for host_norm in (True, False):
        params = [b.clone() for b in base]
        ms = [torch.zeros_like(p) for p in params]
        vs = [torch.zeros_like(p) for p in params]
        gen = torch.Generator(device="cuda").manual_seed(3)
        for step in range(1, 11):
            scaled = [torch.randn(p.shape, device="cuda", generator=gen) * 12 for p in params]
            norm = F.global_grad_norm(scaled, 4.0) if host_norm else None
            F.fused_lamb_(params, scaled, ms, vs, step=step, lr=1e-2, beta1=0.9, beta2=0.999,
                          eps=1e-6, weight_decay=0.01, grad_scale=4.0, max_grad_norm=1.0,
                          global_grad_norm_value=norm)
        runs.append(params)
    assert_params_close(runs[0], runs[1], **SAME_OPS_NORMS)
    assert cuda_ext.calls.get("sum_squares_device", 0) == 10


def test_lars_matches_reference_on_gpu(cuda_ext):
    kw = dict(lr=0.1, momentum=0.9, eeta=1e-3, weight_decay=1e-4, epsilon=1e-8)
    params = [torch.randn(n, device="cuda", requires_grad=True) for n in SIZES + (BIG,)]
    mirror = [p.detach().clone() for p in params]
    bufs = [torch.zeros_like(p) for p in mirror]
    opt = FusedLars(params, **kw)
    for _ in range(30):
        grads = [torch.randn_like(p) for p in params]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        for p, g, b in zip(mirror, grads, bufs):
            ref.lars_step(p, g, b, **kw)
    assert_params_close(params, mirror, **NORM_TOL)


def test_lion_matches_reference_on_gpu(cuda_ext):
    """One step at a time from a shared state (a sign flips by 2*lr where the
    interpolation is within 4 ulps of zero: those elements are allowed that)."""
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.99, weight_decay=0.1)
    params = [torch.randn(n, device="cuda", requires_grad=True) for n in SIZES + (BIG,)]
    opt = FusedLion(params, lr=kw["lr"], betas=(kw["beta1"], kw["beta2"]), weight_decay=kw["weight_decay"])
    for _ in range(20):
        mirror = [p.detach().clone() for p in params]
        ms = [opt.state[p]["exp_avg"].clone() if opt.state[p] else torch.zeros_like(p) for p in params]
        grads = [torch.randn_like(p) for p in params]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        for p, q, g, m in zip(params, mirror, grads, ms):
            ambiguous = ref.lion_step(q, g, m, **kw)
            diff = (p.detach() - q).abs()
            assert bool((diff[~ambiguous] <= 1e-6 * q.abs()[~ambiguous] + 1e-7).all())
            assert bool((diff[ambiguous] <= 2 * kw["lr"] + 1e-6).all())
            torch.testing.assert_close(opt.state[p]["exp_avg"], m, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------- vs the CPU kernels
_HALF = (torch.float16, torch.bfloat16)
DTYPE_COMBOS = (
    [(torch.float32, g, c) for g in (torch.float32,) + _HALF for c in (None,) + _HALF]
    + [(h, g, None) for h in _HALF for g in (h, torch.float32)]
)

# name -> (function, number of float32 states, counts steps, keyword arguments)
ALGORITHMS = {
    "adamw": (F.fused_adam_, 2, True, dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)),
    "adam_l2_amsgrad_maximize": (F.fused_adam_, 3, True, dict(lr=1e-2, beta1=0.8, beta2=0.99, eps=1e-6,
                                                              weight_decay=0.1, amsgrad=True, adamw_mode=False,
                                                              maximize=True)),
    "adam_no_bias_correction": (F.fused_adam_, 2, True, dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                                                             weight_decay=0.0, bias_correction=False)),
    "sgd": (F.fused_sgd_, 0, True, dict(lr=1e-2, weight_decay=0.01, maximize=True)),
    "sgd_nesterov": (F.fused_sgd_, 1, True, dict(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.01)),
    "sgd_dampening_wd_after": (F.fused_sgd_, 1, True, dict(lr=1e-2, momentum=0.9, dampening=0.1, weight_decay=0.1,
                                                           wd_after_momentum=True)),
    "adagrad": (F.fused_adagrad_, 1, True, dict(lr=1e-2, lr_decay=0.01, weight_decay=0.1, eps=1e-10)),
    "lion": (F.fused_lion_, 1, False, dict(lr=1e-3, beta1=0.9, beta2=0.99, weight_decay=0.1, maximize=True)),
    "lamb": (F.fused_lamb_, 2, True, dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.01,
                                          max_grad_norm=1.0)),
    "lamb_l2_no_bias_correction": (F.fused_lamb_, 2, True, dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-6,
                                                                weight_decay=0.01, adam_w_mode=False,
                                                                bias_correction=False, grad_averaging=False,
                                                                max_grad_norm=0.0, use_nvlamb=True)),
    "lars": (F.fused_lars_, 1, False, dict(lr=0.1, momentum=0.9, eeta=1e-3, weight_decay=1e-4, epsilon=1e-8)),
}


def _call(name, params, grads, states, copies, step, **extra):
    fn, n_states, counts, kw = ALGORITHMS[name]
    args = list(states) if n_states else [None]
    if fn is F.fused_adam_ and n_states == 2:
        args.append(None)
    if counts:
        extra["step"] = step
    return fn(params, grads, *args, param_copies=copies, **kw, **extra)


def _lion_ties(state_cpu, grads_cpu, kw, scale):
    """Elements whose Lion interpolation is within 4 ulps of zero (either sign is right)."""
    out = []
    for m, g in zip(state_cpu, grads_cpu):
        g = -g.float() / scale if kw.get("maximize") else g.float() / scale
        c = m.lerp(g, 1 - kw["beta1"])
        out.append(c.abs() <= 4 * torch.finfo(torch.float32).eps * (m.abs() + g.abs()))
    return out


@pytest.mark.parametrize("combo", DTYPE_COMBOS, ids=lambda c: "-".join(str(t).split(".")[-1] for t in c))
@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_same_results_as_the_cpu_kernels(cuda_ext, compiled, name, combo):
    p_dtype, g_dtype, c_dtype = combo
    _, n_states, _, kw = ALGORITHMS[name]
    sizes = SIZES + (BIG, 4099)
    scale = 8.0
    params = [torch.randn(n, device="cuda").to(p_dtype) for n in sizes]
    # non-negative, as second moments and Adagrad's sums must be
    states = [[torch.rand(n, device="cuda") for n in sizes] for _ in range(n_states)]
    gen = torch.Generator(device="cuda").manual_seed(5)
    for step in range(1, 6):
        grads = [(torch.randn(n, device="cuda", generator=gen) * scale).to(g_dtype) for n in sizes]
        copies = None if c_dtype is None else [torch.empty(n, device="cuda", dtype=c_dtype) for n in sizes]
        cpu = [t.cpu() for t in params], [[t.cpu() for t in s] for s in states], [g.cpu() for g in grads]
        cpu_copies = None if copies is None else [c.cpu() for c in copies]
        ties = _lion_ties(cpu[1][0], cpu[2], kw, scale) if name == "lion" else None
        _call(name, params, grads, states, copies, step, grad_scale=scale)
        _call(name, cpu[0], cpu[2], cpu[1], cpu_copies, step, grad_scale=scale)
        tol = SAME_OPS_NORMS if name.startswith(("lamb", "lars")) else SAME_OPS
        for i, (p, q) in enumerate(zip(params, cpu[0])):
            got, want = p.cpu().float(), q.float()
            if ties is not None:  # an ambiguous sign moves the element by 2*lr either way
                got, want = got[~ties[i]], want[~ties[i]]
            torch.testing.assert_close(got, want, **(ULP[p_dtype] if p_dtype in ULP else tol),
                                       msg=lambda m: f"{name} step {step} param {i}: {m}")
        if name != "lion":
            for s_gpu, s_cpu in zip(states, cpu[1]):
                for t, u in zip(s_gpu, s_cpu):
                    torch.testing.assert_close(t.cpu(), u, **(tol if p_dtype == torch.float32 else NORM_TOL))
        if copies is not None:
            for c, d in zip(copies, cpu_copies):
                torch.testing.assert_close(c.cpu().float(), d.float(), **ULP[c_dtype])
        for s in range(len(states)):  # continue from identical states, so errors never pile up
            for t, u in zip(states[s], cpu[1][s]):
                t.copy_(u)
        for p, q in zip(params, cpu[0]):
            p.copy_(q)
    assert sum(cuda_ext.calls.values()) >= 5


@pytest.mark.parametrize("kernel_args", ["4k", "default"])
def test_more_tensors_and_chunks_than_one_launch(cuda_ext, compiled, monkeypatch, kernel_args):
    """Tensors of more chunks than one launch has blocks (320 with 4 KB kernel arguments,
    2,560 with 32 KB, this GPU's default when its driver allows) among 700 small ones, in
    both orders: the launcher splits and carries tensors across launches correctly."""
    if kernel_args == "4k":
        monkeypatch.setenv("LIGHTNING_FASTOPT_CUDA_KERNEL_ARGS", "4k")
    sizes = [int(s) for s in torch.randint(1, 3000, (700,))]
    for layout in ([21_000_001] + sizes, sizes + [170_000_001] + sizes[:7]):
        params = [torch.randn(n, device="cuda") for n in layout]
        grads = [torch.randn(n, device="cuda") for n in layout]
        m = [torch.zeros(n, device="cuda") for n in layout]
        v = [torch.zeros(n, device="cuda") for n in layout]
        copies = [torch.empty(n, device="cuda", dtype=torch.bfloat16) for n in layout]
        host = [[t.cpu() for t in lst] for lst in (params, grads, m, v)]
        host_copies = [c.cpu() for c in copies]
        kw = dict(step=1, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
        F.fused_adam_(params, grads, m, v, param_copies=copies, **kw)
        F.fused_adam_(host[0], host[1], host[2], host[3], param_copies=host_copies, **kw)
        assert_params_close([p.cpu() for p in params], host[0], **SAME_OPS)
        for c, d in zip(copies, host_copies):
            assert torch.equal(c.cpu(), d)
        squares = F.sum_of_squares(params)
        want = sum(float(p.double().square().sum()) for p in host[0])
        assert math.isclose(squares, want, rel_tol=1e-6)


# ---------------------------------------------------------------------------- device scalars
def _adam_lists(sizes, dtype=torch.float32):
    params = [torch.randn(n, device="cuda") for n in sizes]
    return (params, [torch.randn(n, device="cuda", dtype=dtype) for n in sizes],
            [torch.zeros(n, device="cuda") for n in sizes], [torch.zeros(n, device="cuda") for n in sizes])


def test_found_inf_on_the_device_leaves_everything_untouched(cuda_ext):
    params, grads, m, v = _adam_lists(SIZES + (BIG,))
    copies = [torch.zeros(p.numel(), device="cuda", dtype=torch.float16) for p in params]
    snapshot = [t.clone() for t in params + m + v + copies]
    flag = torch.ones(1, device="cuda")
    for name in sorted(ALGORITHMS):
        n_states = ALGORITHMS[name][1]
        states = [m, v, [torch.zeros_like(p) for p in params]][:n_states]
        _call(name, params, grads, states, copies, 1, found_inf=flag)
    torch.cuda.synchronize()
    assert all(torch.equal(t, s) for t, s in zip(params + m + v + copies, snapshot))
    flag.zero_()
    F.fused_adam_(params, grads, m, v, step=1, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                  found_inf=flag, param_copies=copies)
    assert not torch.equal(params[-1], snapshot[len(params) - 1])


def test_device_grad_scale_equals_host_grad_scale(cuda_ext):
    runs = []
    for as_tensor in (False, True):
        torch.manual_seed(7)
        params, grads, m, v = _adam_lists(SIZES + (BIG,), torch.float16)
        scale = torch.full((1,), 1024.0, device="cuda") if as_tensor else 1024.0
        F.fused_adam_(params, grads, m, v, step=1, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
                      grad_scale=scale)
        runs.append(params)
    assert_params_close(runs[0], runs[1], rtol=0, atol=0)


def test_a_step_with_device_scalars_never_synchronises(cuda_ext):
    params = [torch.randn(n, device="cuda", requires_grad=True) for n in SIZES + (BIG,)]
    opt = FusedAdam(params, lr=torch.tensor(1e-2, device="cuda"), weight_decay=0.01, capturable=True)
    for p in params:
        p.grad = torch.randn_like(p)
    scale, flag = torch.full((1,), 2.0, device="cuda"), torch.zeros(1, device="cuda")
    opt.step(grad_scale=scale, found_inf=flag)  # creates the state (that may synchronise)
    torch.cuda.set_sync_debug_mode("error")
    try:
        opt.step(grad_scale=scale, found_inf=flag)
        flag.fill_(1.0)
        opt.step(grad_scale=scale, found_inf=flag)  # skipped on the device: the step count stays
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert float(opt.state[params[-1]]["step"]) == 2.0


# ---------------------------------------------------------------------------- CUDA graphs
@pytest.mark.parametrize("make", [
    lambda ps, capturable: FusedAdam(ps, lr=torch.tensor(1e-2, device="cuda") if capturable else 1e-2,
                                     weight_decay=0.01, amsgrad=True, capturable=capturable),
    lambda ps, capturable: FusedSGD(ps, lr=1e-2, momentum=0.9, nesterov=True),
    lambda ps, capturable: FusedLion(ps, lr=1e-3, weight_decay=0.1),
], ids=["adam", "sgd", "lion"])
def test_captured_step_replays_like_eager_steps(cuda_ext, make):
    sizes = SIZES + (BIG, 333)
    base = [torch.randn(n, device="cuda") for n in sizes]
    eager = [b.clone().requires_grad_() for b in base]
    static = [b.clone().requires_grad_() for b in base]
    eager_opt, graph_opt = make(eager, False), make(static, True)
    grads = [[torch.randn(n, device="cuda") for n in sizes] for _ in range(12)]
    for p in static:
        p.grad = torch.zeros_like(p)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up steps (state creation) outside the graph
        for step in range(3):
            for p, g in zip(static, grads[step]):
                p.grad.copy_(g)
            graph_opt.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_opt.step()
    for step in range(3, 12):
        for p, g in zip(static, grads[step]):
            p.grad.copy_(g)
        graph.replay()
    for step in range(12):
        for p, g in zip(eager, grads[step]):
            p.grad = g.clone()
        eager_opt.step()
    torch.cuda.synchronize()
    assert_params_close(static, eager, **SAME_OPS)


# ---------------------------------------------------------------------------- reductions
def test_reductions_match_torch(cuda_ext):
    tensors = [torch.randn(n, device="cuda", dtype=d) for n in SIZES + (BIG,)
               for d in (torch.float32, torch.float16, torch.bfloat16)]
    per, total = cuda_ext.sum_squares_device(tensors)
    want = torch.stack([t.double().square().sum() for t in tensors])
    # float within a chunk of 65,536 elements, double across chunks
    torch.testing.assert_close(per, want, rtol=1e-5, atol=0)
    torch.testing.assert_close(total, want.sum(), rtol=1e-5, atol=0)
    assert F.grads_all_finite(tensors)
    tensors[-2][3] = math.inf  # the fp16 tensor of 1,000,003 elements
    assert not F.grads_all_finite(tensors)
    flag = torch.zeros(1, device="cuda")
    cuda_ext.check_finite_(tensors, flag)
    assert float(flag) == 1.0


def test_unscale_sets_found_inf_and_divides(cuda_ext):
    grads = [torch.randn(n, device="cuda", dtype=d) * 64 for n in SIZES + (BIG,)
             for d in (torch.float32, torch.float16, torch.bfloat16)]
    want = [(g.float() / 64).to(g.dtype) for g in grads]
    flag = torch.zeros(1, device="cuda")
    F.unscale_grads_(grads, 64.0, flag)
    assert float(flag) == 0.0
    for g, w in zip(grads, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    grads[-1][0] = math.nan  # the bf16 tensor of 1,000,003 elements
    F.unscale_grads_(grads, 64.0, flag)
    assert float(flag) == 1.0
    assert cuda_ext.calls.get("unscale_", 0) == 2


# ---------------------------------------------------------------------------- routing
@pytest.mark.parametrize("make", [lambda ps: FusedAdam(ps, lr=0.1), lambda ps: FusedLAMB(ps, lr=0.1)],
                         ids=["adam", "lamb"])
def test_check_finite_on_gpu_skips_and_counts(cuda_ext, make):
    params = [torch.randn(n, device="cuda", requires_grad=True) for n in SIZES]
    opt = make(params)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step(check_finite=True)
    before = [p.detach().clone() for p in params]
    states = [t.clone() for p in params for t in opt.state[p].values()]
    params[3].grad[17] = math.nan
    opt.step(check_finite=True)
    assert opt.last_step_skipped and opt.skipped_steps == 1
    assert all(torch.equal(p.detach(), b) for p, b in zip(params, before))
    assert all(torch.equal(t, u) for t, u in zip((t for p in params for t in opt.state[p].values()), states))


def test_optimizers_on_cuda_parameters_run_these_kernels(cuda_ext):
    params = [torch.randn(100, device="cuda", requires_grad=True) for _ in range(3)]
    for make, name in [(lambda: FusedAdam(params), "adam_"), (lambda: FusedSGD(params, lr=0.1, momentum=0.9), "sgd_"),
                       (lambda: FusedAdagrad(params), "adagrad_"), (lambda: FusedLion(params), "lion_"),
                       (lambda: FusedLAMB(params), "lamb_"), (lambda: FusedLars(params), "lars_")]:
        opt = make()
        for p in params:
            p.grad = torch.randn_like(p)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            opt.step()
            torch.cuda.synchronize()
        kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        assert cuda_ext.calls.get(name, 0) == 1, name
        assert any("fastopt::cuda::multi_tensor_kernel" in k for k in kernels), kernels
        assert not any("at::native" in k and "multi_tensor" in k for k in kernels), kernels


def test_non_contiguous_tensors_are_stepped_on_the_host_path(cuda_ext):
    """A transposed gradient: the kernels refuse it before touching anything and the call
    is redone by the pure-PyTorch path, with the same result as torch."""
    a = [torch.randn(64, 32, device="cuda", requires_grad=True), torch.randn(100, device="cuda", requires_grad=True)]
    b = [p.detach().clone().requires_grad_() for p in a]
    opt, ref_opt = FusedAdam(a, lr=1e-2, weight_decay=0.01), torch.optim.AdamW(b, lr=1e-2, weight_decay=0.01)
    for _ in range(5):
        g0 = torch.randn(32, 64, device="cuda").t()  # not contiguous
        g1 = torch.randn(100, device="cuda")
        a[0].grad, a[1].grad, b[0].grad, b[1].grad = g0, g1, g0.clone(), g1.clone()
        opt.step()
        ref_opt.step()
    assert_params_close(a, b, **ADAM_TOL)
    assert cuda_ext.calls.get("adam_", 0) == 5  # tried each time, refused each time


def test_without_the_extension_cuda_takes_torchs_path(monkeypatch):
    """The fallback still computes the same thing (LIGHTNING_FASTOPT_BACKEND=torch)."""
    monkeypatch.setenv(ops.BACKEND_ENV, "torch")
    a, b, _, _ = run_twins(lambda g: FusedAdam(g, lr=1e-2, weight_decay=0.01),
                           lambda g: torch.optim.AdamW(g, lr=1e-2, weight_decay=0.01), SIZES,
                           [dict(), dict(lr=0.05)], steps=20, device="cuda")
    assert_params_close(a, b, **ADAM_TOL)


def test_split_groups_on_gpu_keep_their_hyperparameters(cuda_ext):
    params = [torch.randn(n, device="cuda", requires_grad=True) for n in (5, 6, 7)]
    mirror = [p.detach().clone().requires_grad_() for p in params]
    overrides = [dict(lr=0.1), dict(lr=0.01, weight_decay=0.5), dict(lr=0.001)]
    opt = FusedAdam(split_groups(params, overrides))
    ref_opt = torch.optim.AdamW(split_groups(mirror, overrides), weight_decay=0.01, foreach=False)
    ref_opt.param_groups[0]["weight_decay"] = ref_opt.param_groups[2]["weight_decay"] = 0.0
    for _ in range(10):
        for p, q in zip(params, mirror):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        opt.step()
        ref_opt.step()
    assert_params_close(params, mirror, **ADAM_TOL)
