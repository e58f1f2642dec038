"""The CUDA kernels' per-element math, and the element-wise kernels' launches and chunk
walk, run on the host against the CPU kernels.

csrc/cuda/optimizer_math.cuh holds each algorithm's math as host-and-device code; nvcc
compiles tests/cpp/cuda_math_check.cu, which runs those very structs on the host (no GPU
needed).  Given the same resolved scalars as the compiled CPU kernels, every element-wise
algorithm must produce the same float32 bits: both evaluate the same IEEE operations, with
a fused multiply-add exactly where the other has one.  LAMB and LARS add up their norms
in another order (rtol 1e-6), and steps whose scalars are computed from device-resident
values (step count, learning rate, loss scale) differ from the host's double-precision
arithmetic by float rounding (rtol 1e-6).

tests/cpp/cuda_walk_check.cpp goes further for the element-wise kernels: compiled by the
host compiler with CUDA's headers, it runs the real launch packing, launch items, dtype
dispatch and ElementwiseFunctor (vector path, scalar path, tails, copies) block by block
and thread by thread, and every buffer must come out with the CPU kernels' exact bits,
padding between tensors untouched.  Skipped where no CUDA toolkit is installed.
"""

import math
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_fastopt.ops.rounding import fused_cuda_adagrad_clr
from tests.helpers import compiled_check

REPO = Path(__file__).resolve().parent.parent
N = 10_007


def _toolkit() -> Path | None:
    candidates = [os.environ.get("CUDA_HOME"), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(str(Path(os.path.realpath(nvcc)).parent.parent))
    for c in candidates:
        if c and (Path(c) / "bin" / "nvcc").exists() and (Path(c) / "include" / "cuda_runtime.h").exists():
            return Path(c)
    return None


@pytest.fixture(scope="module")
def host_math(tmp_path_factory):
    toolkit = _toolkit()
    if toolkit is None:
        pytest.skip("no CUDA toolkit (nvcc and headers) here")
    exe = tmp_path_factory.mktemp("cuda_math") / "cuda_math_check"
    subprocess.run([str(toolkit / "bin" / "nvcc"), "-std=c++17", "-O2", f"-I{REPO / 'csrc'}",
                    str(REPO / "tests/cpp/cuda_math_check.cu"), "-o", str(exe)], check=True)

    def run(algo, tmp, p, g, states, **scalars):
        for name, arr in [("p", p), ("g", g)] + [(f"s{k}", s) for k, s in enumerate(states)]:
            arr.numpy().astype(np.float32).tofile(tmp / f"{name}.bin")
        args = [f"{k}={float(v)!r}" for k, v in scalars.items()]
        subprocess.run([str(exe), algo, str(tmp), *args], check=True)
        out_p = torch.from_numpy(np.fromfile(tmp / "p.out", dtype=np.float32))
        out_s = [torch.from_numpy(np.fromfile(tmp / f"s{k}.out", dtype=np.float32)) for k in range(len(states))]
        return out_p, out_s

    return run


def _data(n_states, positive=(), n=N):
    p, g = torch.randn(n), torch.randn(n) * 4
    states = [torch.rand(n) if k in positive else torch.randn(n) * 0.1 for k in range(n_states)]
    return p, g, states


def _same(a, b, exact=True):
    if exact:
        assert torch.equal(a, b), f"max difference {float((a - b).abs().max())}"
    else:
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def _clone(p, g, states):
    return p.clone(), g.clone(), [s.clone() for s in states]


@pytest.mark.parametrize("rounding", [0, 1, 2, 4],
                         ids=["torch_cpu", "torch_cuda_foreach", "torch_cuda_fused", "torch_cuda_for_loop"])
@pytest.mark.parametrize("adamw", [True, False])
@pytest.mark.parametrize("amsgrad", [True, False])
@pytest.mark.parametrize("maximize", [True, False])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_adam_math_is_the_cpu_kernels(compiled, host_math, tmp_path, adamw, amsgrad, maximize, weight_decay,
                                      rounding):
    """In each rounding (the offloaded share of a GPU run takes the one of the GPU share)."""
    p, g, states = _data(3 if amsgrad else 2, positive=(1, 2))
    lr, b1, b2, eps, step, inv = 1e-2, 0.9, 0.999, 1e-8, 3, 0.25
    bc1, bc2 = 1 - b1 ** step, 1 - b2 ** step
    scalars = dict(lr=lr, beta1=b1, beta2=b2, eps=eps, weight_decay=weight_decay, step_size=lr / bc1,
                   bias_correction2_sqrt=bc2 ** 0.5, inv_grad_scale=inv, amsgrad=amsgrad, adamw=adamw,
                   maximize=maximize, bias_correction=1, rounding=rounding)
    hp, hs = host_math("adam", tmp_path, p, g, states, **scalars)
    cp, cg, cs = _clone(p, g, states)
    compiled.adam_([cp], [cg], [cs[0]], [cs[1]], [cs[2]] if amsgrad else None, None, lr, b1, b2, eps, weight_decay,
                   lr / bc1, bc2 ** 0.5, inv, amsgrad, adamw, maximize, False, rounding=rounding)
    _same(hp, cp)
    for a, b in zip(hs, cs):
        _same(a, b)


@pytest.mark.parametrize("step", [1, 7])
def test_adam_device_scalars_give_the_host_result(compiled, host_math, tmp_path, step):
    """Step, lr and loss scale read from "device" memory: the bias corrections computed there
    (from the betas as given: at step 1 float32's 0.999 moves 1 - beta2 by 1.3e-5).  The
    weights start at zero, so what is compared is the update itself."""
    p, g, states = _data(2, positive=(1,))
    p.zero_()
    lr, b1, b2, eps, scale = 1e-2, 0.9, 0.999, 1e-8, 4.0
    hp, hs = host_math("adam", tmp_path, p, g, states, lr=0.0, beta1=b1, beta2=b2, eps=eps, weight_decay=0.1,
                       step_size=0.0, bias_correction2_sqrt=1.0, inv_grad_scale=1.0, adamw=1, bias_correction=1,
                       dev_step=step, dev_lr=lr, dev_grad_scale=scale)
    cp, cg, cs = _clone(p, g, states)
    bc1, bc2 = 1 - b1 ** step, 1 - b2 ** step
    compiled.adam_([cp], [cg], [cs[0]], [cs[1]], None, None, lr, b1, b2, eps, 0.1, lr / bc1, bc2 ** 0.5, 1 / scale,
                   False, True, False, False)
    _same(hp, cp, exact=False)
    _same(hs[1], cs[1], exact=False)


def test_a_set_found_inf_changes_nothing(host_math, tmp_path):
    p, g, states = _data(2, positive=(1,))
    hp, hs = host_math("adam", tmp_path, p, g, states, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, step_size=0.1,
                       bias_correction2_sqrt=0.5, adamw=1, dev_found_inf=1)
    _same(hp, p)
    for a, b in zip(hs, states):
        _same(a, b)


# rounding 2 (torch's CUDA fused kernel): its 1 - dampening, and with maximize and no decay
# its other momentum contraction on a tensor of numel % 4 == 0 (csrc/common/sgd_rounding.h)
@pytest.mark.parametrize("momentum,dampening,nesterov,wd_after,first,maximize,weight_decay,rounding,n", [
    (0.0, 0.0, False, False, False, False, 0.01, 0, N), (0.0, 0.0, False, True, False, True, 0.01, 0, N),
    (0.9, 0.0, True, False, False, False, 0.01, 0, N), (0.9, 0.0, True, False, True, False, 0.01, 0, N),
    (0.9, 0.1, False, True, False, True, 0.01, 0, N), (0.5, 0.5, False, False, True, False, 0.01, 0, N),
    (0.9, 0.9, False, False, False, True, 0.0, 2, N + 1), (0.9, 0.0, True, False, False, True, 0.0, 2, N + 1),
    (0.9, 0.6, False, False, False, True, 0.0, 2, N), (0.9, 0.9, False, False, False, False, 0.01, 2, N + 1)])
def test_sgd_math_is_the_cpu_kernels(compiled, host_math, tmp_path, momentum, dampening, nesterov, wd_after, first,
                                     maximize, weight_decay, rounding, n):
    p, g, states = _data(1 if momentum else 0, n=n)
    scalars = dict(lr=0.05, momentum=momentum, dampening=dampening, weight_decay=weight_decay, inv_grad_scale=0.5,
                   nesterov=nesterov, maximize=maximize, wd_after_momentum=wd_after, first_step=first,
                   rounding=rounding)
    hp, hs = host_math("sgd", tmp_path, p, g, states, **scalars)
    cp, cg, cs = _clone(p, g, states)
    compiled.sgd_([cp], [cg], [cs[0]] if momentum else None, None, 0.05, momentum, dampening, weight_decay, 0.5,
                  nesterov, maximize, wd_after, first, False, rounding)
    _same(hp, cp)
    for a, b in zip(hs, cs):
        _same(a, b)


@pytest.mark.parametrize("rounding", [0, 4], ids=["torch_cpu", "torch_cuda_for_loop"])
@pytest.mark.parametrize("maximize,weight_decay", [(False, 0.0), (True, 0.1)])
def test_adagrad_math_is_the_cpu_kernels(compiled, host_math, tmp_path, maximize, weight_decay, rounding):
    p, g, states = _data(1, positive=(0,))
    clr = 1e-2 / (1 + (5 - 1) * 0.01)
    hp, hs = host_math("adagrad", tmp_path, p, g, states, clr=clr, weight_decay=weight_decay, eps=1e-10,
                       inv_grad_scale=0.5, maximize=maximize, rounding=rounding)
    cp, cg, cs = _clone(p, g, states)
    compiled.adagrad_([cp], [cg], [cs[0]], None, clr, weight_decay, 1e-10, 0.5, maximize, False, False, rounding)
    _same(hp, cp)
    _same(hs[0], cs[0])
    # the same step with the step count and lr on the "device"
    dp, _ = host_math("adagrad", tmp_path, p, g, states, lr=1e-2, lr_decay=0.01, weight_decay=weight_decay,
                      eps=1e-10, inv_grad_scale=0.5, maximize=maximize, dev_step=5, rounding=rounding)
    _same(dp, cp, exact=False)


@pytest.mark.parametrize("maximize,weight_decay,lr_decay", [(False, 0.0, 0.0), (True, 0.1, 0.01)])
def test_adagrad_math_in_torchs_fused_cuda_rounding_is_the_cpu_kernels(compiled, host_math, tmp_path, maximize,
                                                                        weight_decay, lr_decay):
    """rounding 2, torch's fused CUDA kernel (in double): the host structs and the CPU
    kernels, with the step count on the host and on the "device"."""
    p, g, states = _data(1, positive=(0,))
    clr = fused_cuda_adagrad_clr(1e-2, lr_decay, 5)
    hp, hs = host_math("adagrad", tmp_path, p, g, states, clr=clr, weight_decay=weight_decay, eps=1e-10,
                       inv_grad_scale=0.5, maximize=maximize, rounding=2)
    cp, cg, cs = _clone(p, g, states)
    compiled.adagrad_([cp], [cg], [cs[0]], None, clr, weight_decay, 1e-10, 0.5, maximize, False, False, 2)
    _same(hp, cp)
    _same(hs[0], cs[0])
    dp, _ = host_math("adagrad", tmp_path, p, g, states, lr=1e-2, lr_decay=lr_decay, weight_decay=weight_decay,
                      eps=1e-10, inv_grad_scale=0.5, maximize=maximize, dev_step=5, rounding=2)
    _same(dp, cp)  # the device's clr is the host's


@pytest.mark.parametrize("beta1,beta2,maximize", [(0.9, 0.99, False), (0.2, 0.7, True)])  # lerp weights < and >= 0.5
def test_lion_math_is_the_cpu_kernels(compiled, host_math, tmp_path, beta1, beta2, maximize):
    p, g, states = _data(1)
    hp, hs = host_math("lion", tmp_path, p, g, states, lr=1e-3, beta1=beta1, beta2=beta2, weight_decay=0.1,
                       inv_grad_scale=0.5, maximize=maximize)
    cp, cg, cs = _clone(p, g, states)
    compiled.lion_([cp], [cg], [cs[0]], None, 1e-3, beta1, beta2, 0.1, 0.5, maximize, False)
    _same(hp, cp)
    _same(hs[0], cs[0])


@pytest.mark.parametrize("adam_w_mode,use_trust_ratio,maximize", [(True, True, False), (False, True, True),
                                                                  (True, False, False)])
def test_lamb_math_matches_the_cpu_kernels(compiled, host_math, tmp_path, adam_w_mode, use_trust_ratio, maximize):
    p, g, states = _data(2, positive=(1,))
    b1, b2, step, scale, max_norm = 0.9, 0.999, 4, 8.0, 1.0
    bc1, bc2 = 1 - b1 ** step, 1 - b2 ** step
    norm = math.sqrt(float(g.double().square().sum())) / scale
    factor = (1 / scale) / (norm / max_norm if norm > max_norm else 1.0)
    common = dict(lr=1e-2, beta1=b1, beta2=b2, beta3=1 - b1, eps=1e-6, weight_decay=0.01, bias_correction1=bc1,
                  bias_correction2=bc2, adam_w_mode=adam_w_mode, use_trust_ratio=use_trust_ratio, maximize=maximize,
                  bias_correction=1)
    cp, cg, cs = _clone(p, g, states)
    compiled.lamb_([cp], [cg], [cs[0]], [cs[1]], None, 1e-2, b1, b2, 1 - b1, 1e-6, 0.01, bc1, bc2, factor,
                   adam_w_mode, use_trust_ratio, maximize)
    hp, hs = host_math("lamb", tmp_path, p, g, states, grad_factor=factor, **common)
    _same(hp, cp, exact=False)
    _same(hs[0], cs[0])  # the moments do not depend on the norms: the same bits
    _same(hs[1], cs[1])
    # the clipping divisor computed from a "device" sum of squares and loss scale
    dp, _ = host_math("lamb", tmp_path, p, g, states, grad_factor=0.0, max_grad_norm=max_norm, inv_grad_scale=0.0,
                      dev_grad_scale=scale, **common)
    _same(dp, cp, exact=False)


@pytest.mark.parametrize("maximize", [False, True])
def test_lars_math_matches_the_cpu_kernels(compiled, host_math, tmp_path, maximize):
    p, g, states = _data(1)
    scalars = dict(lr=0.1, momentum=0.9, eeta=1e-3, weight_decay=1e-4, epsilon=1e-8, inv_grad_scale=0.5,
                   maximize=maximize)
    hp, hs = host_math("lars", tmp_path, p, g, states, **scalars)
    cp, cg, cs = _clone(p, g, states)
    compiled.lars_([cp], [cg], [cs[0]], None, 0.1, 0.9, 1e-3, 1e-4, 1e-8, 0.5, maximize, False)
    _same(hp, cp, exact=False)
    _same(hs[0], cs[0])  # the momentum buffer does not depend on the norms


# ---------------------------------------------------------------------------- the chunk walk
_HALF = (torch.float16, torch.bfloat16)
DTYPE_COMBOS = ([(torch.float32, g, c) for g in (torch.float32,) + _HALF for c in (None,) + _HALF]
                + [(h, g, None) for h in _HALF for g in (h, torch.float32)])
_CODE = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", None: "none"}
# (numel, elements of padding before it): every size class, and offsets that leave some
# tensors unaligned for vector loads (the scalar path) and others aligned; 40 small
# tensors push a 4 KB kernel argument past its tensor capacity
LAYOUT = [(0, 0), (1, 0), (7, 1), (1023, 0), (4, 3), (65536 * 2 + 5, 2), (200_003, 0), (65536, 1), (3, 0)] + [
    (n, n % 3) for n in range(5, 205, 5)]


@pytest.fixture(scope="module")
def host_walk(tmp_path_factory):
    toolkit = _toolkit()
    if toolkit is None:
        pytest.skip("no CUDA headers here")
    exe = compiled_check(tmp_path_factory, "cuda_walk_check.cpp", "-std=c++20", "-O2", "-w", f"-I{toolkit / 'include'}")

    def run(tmp, layout, buffers, codes, size, **scalars):
        (tmp / "layout.txt").write_text("".join(f"{n} {off}\n" for n, off in layout))
        for name, t in buffers.items():
            _raw(t).tofile(tmp / f"{name}.bin")
        args = [f"{k}={float(v)!r}" for k, v in scalars.items()]
        out = subprocess.run([str(exe), str(tmp), *codes, size, *args], check=True, capture_output=True, text=True)
        launches = int(out.stdout.split()[-1])
        result = {}
        for name, t in buffers.items():
            if name == "g":
                continue  # gradients are read, never written
            raw = np.fromfile(tmp / f"{name}.out", dtype=_raw(t).dtype)
            result[name] = torch.from_numpy(raw).view(t.dtype) if t.dtype != torch.float32 else torch.from_numpy(raw)
        return result, launches

    return run


def _raw(t):
    return t.view(torch.int16).numpy() if t.dtype in _HALF else t.numpy()


def _views(flat, layout):
    out, pos = [], 0
    for n, off in layout:
        pos += off
        out.append(flat[pos:pos + n])
        pos += n
    return out


@pytest.mark.parametrize("size", ["4k", "32k"])
@pytest.mark.parametrize("combo", DTYPE_COMBOS, ids=lambda c: "-".join(_CODE[t] for t in c))
def test_the_element_wise_kernels_update_every_element_once(compiled, host_walk, tmp_path, combo, size):
    """The launches, blocks and threads of the CUDA Adam kernel, run on the host, leave
    exactly the CPU kernels' bits in every tensor, and the padding between tensors untouched."""
    p_dtype, g_dtype, c_dtype = combo
    total = sum(n + off for n, off in LAYOUT)
    flat = dict(p=torch.randn(total).to(p_dtype), g=(torch.randn(total) * 4).to(g_dtype),
                s0=torch.randn(total) * 0.1, s1=torch.rand(total))
    if c_dtype is not None:
        flat["c"] = torch.zeros(total, dtype=c_dtype)
    lr, b1, b2, eps, step, inv = 1e-2, 0.9, 0.999, 1e-8, 3, 0.25
    bc1, bc2 = 1 - b1 ** step, 1 - b2 ** step
    scalars = dict(lr=lr, beta1=b1, beta2=b2, eps=eps, weight_decay=0.1, step_size=lr / bc1,
                   bias_correction2_sqrt=bc2 ** 0.5, inv_grad_scale=inv, adamw=1)
    got, launches = host_walk(tmp_path, LAYOUT, flat, [_CODE[p_dtype], _CODE[g_dtype], _CODE[c_dtype]], size,
                              **scalars)
    want = {k: v.clone() for k, v in flat.items()}
    views = {k: _views(v, LAYOUT) for k, v in want.items()}
    compiled.adam_(views["p"], views["g"], views["s0"], views["s1"], None, views.get("c"), lr, b1, b2, eps, 0.1,
                   lr / bc1, bc2 ** 0.5, inv, False, True, False, False)
    for name in got:
        assert torch.equal(got[name].view(torch.int16) if got[name].dtype in _HALF else got[name],
                           want[name].view(torch.int16) if want[name].dtype in _HALF else want[name]), name
    assert launches == (2 if size == "4k" else 1)  # 49 tensors: two 4 KB lists, one 32 KB list


def test_a_rounding_that_depends_on_the_tensor_reaches_each_tensor_of_a_launch(compiled, host_walk, tmp_path):
    """torch's CUDA fused SGD rounds the momentum of a tensor of numel % 4 == 0 otherwise
    (with maximize and no decay): the launches of LAYOUT's 49 tensors, aligned or not, give
    the CPU kernels' bits tensor by tensor, and not those of the default rounding."""
    total = sum(n + off for n, off in LAYOUT)
    flat = dict(p=torch.randn(total), g=torch.randn(total) * 4, s0=torch.randn(total) * 0.1, s1=torch.zeros(total))
    scalars = dict(lr=0.05, momentum=0.9, dampening=0.0, weight_decay=0.0, inv_grad_scale=1.0, maximize=1)
    got, _ = host_walk(tmp_path, LAYOUT, flat, ["f32", "f32", "none"], "4k", sgd_rounding=2, **scalars)
    for rounding in (2, 0):
        want = {k: v.clone() for k, v in flat.items()}
        views = {k: _views(v, LAYOUT) for k, v in want.items()}
        compiled.sgd_(views["p"], views["g"], views["s0"], None, 0.05, 0.9, 0.0, 0.0, 1.0, False, True, False, False,
                      False, rounding)
        same = all(torch.equal(got[name], want[name]) for name in got)
        assert same == (rounding == 2)


def test_a_tensor_longer_than_one_launch(compiled, host_walk, tmp_path):
    """21M elements: more chunks than the 320 blocks of a 4 KB launch, carried over."""
    layout = [(5, 0), (21_000_001, 1), (9, 0)]
    total = sum(n + off for n, off in layout)
    flat = dict(p=torch.randn(total), g=torch.randn(total), s0=torch.zeros(total), s1=torch.zeros(total))
    scalars = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step_size=1e-2,
                   bias_correction2_sqrt=0.0316, inv_grad_scale=1.0, adamw=1)
    got, launches = host_walk(tmp_path, layout, flat, ["f32", "f32", "none"], "4k", **scalars)
    want = {k: v.clone() for k, v in flat.items()}
    views = {k: _views(v, layout) for k, v in want.items()}
    compiled.adam_(views["p"], views["g"], views["s0"], views["s1"], None, None, 1e-3, 0.9, 0.999, 1e-8, 0.0, 1e-2,
                   0.0316, 1.0, False, True, False, False)
    assert launches == 2
    for name in got:
        assert torch.equal(got[name], want[name]), name
