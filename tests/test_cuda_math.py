"""The CUDA kernels' per-element math, run on the host, against the CPU kernels.

csrc/cuda/optimizer_math.cuh holds each algorithm's math as host-and-device code; nvcc
compiles tests/cpp/cuda_math_check.cu, which runs those very structs on the host (no GPU
needed).  Given the same resolved scalars as the compiled CPU kernels, every element-wise
algorithm must produce the same float32 bits: both evaluate the same IEEE operations, with
a fused multiply-add exactly where the other has one.  LAMB and LARS add up their norms
in another order (rtol 1e-6), and steps whose scalars are computed from device-resident
values (step count, learning rate, loss scale) differ from the host's double-precision
arithmetic by float rounding (rtol 1e-6).  Skipped where no CUDA toolkit (nvcc and its
headers) is installed.
"""

import math
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

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


def _data(n_states, positive=()):
    p, g = torch.randn(N), torch.randn(N) * 4
    states = [torch.rand(N) if k in positive else torch.randn(N) * 0.1 for k in range(n_states)]
    return p, g, states


def _same(a, b, exact=True):
    if exact:
        assert torch.equal(a, b), f"max difference {float((a - b).abs().max())}"
    else:
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def _clone(p, g, states):
    return p.clone(), g.clone(), [s.clone() for s in states]


@pytest.mark.parametrize("adamw", [True, False])
@pytest.mark.parametrize("amsgrad", [True, False])
@pytest.mark.parametrize("maximize", [True, False])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_adam_math_is_the_cpu_kernels(compiled, host_math, tmp_path, adamw, amsgrad, maximize, weight_decay):
    p, g, states = _data(3 if amsgrad else 2, positive=(1, 2))
    lr, b1, b2, eps, step, inv = 1e-2, 0.9, 0.999, 1e-8, 3, 0.25
    bc1, bc2 = 1 - b1 ** step, 1 - b2 ** step
    scalars = dict(lr=lr, beta1=b1, beta2=b2, eps=eps, weight_decay=weight_decay, step_size=lr / bc1,
                   bias_correction2_sqrt=bc2 ** 0.5, inv_grad_scale=inv, amsgrad=amsgrad, adamw=adamw,
                   maximize=maximize, bias_correction=1)
    hp, hs = host_math("adam", tmp_path, p, g, states, **scalars)
    cp, cg, cs = _clone(p, g, states)
    compiled.adam_([cp], [cg], [cs[0]], [cs[1]], [cs[2]] if amsgrad else None, None, lr, b1, b2, eps, weight_decay,
                   lr / bc1, bc2 ** 0.5, inv, amsgrad, adamw, maximize, False)
    _same(hp, cp)
    for a, b in zip(hs, cs):
        _same(a, b)


def test_adam_device_scalars_give_the_host_result(compiled, host_math, tmp_path):
    """Step, lr and loss scale read from "device" memory: the bias corrections computed there."""
    p, g, states = _data(2, positive=(1,))
    lr, b1, b2, eps, step, scale = 1e-2, 0.9, 0.999, 1e-8, 7, 4.0
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


@pytest.mark.parametrize("momentum,dampening,nesterov,wd_after,first,maximize", [
    (0.0, 0.0, False, False, False, False), (0.0, 0.0, False, True, False, True), (0.9, 0.0, True, False, False, False),
    (0.9, 0.0, True, False, True, False), (0.9, 0.1, False, True, False, True), (0.5, 0.5, False, False, True, False)])
def test_sgd_math_is_the_cpu_kernels(compiled, host_math, tmp_path, momentum, dampening, nesterov, wd_after, first,
                                     maximize):
    p, g, states = _data(1 if momentum else 0)
    scalars = dict(lr=0.05, momentum=momentum, dampening=dampening, weight_decay=0.01, inv_grad_scale=0.5,
                   nesterov=nesterov, maximize=maximize, wd_after_momentum=wd_after, first_step=first)
    hp, hs = host_math("sgd", tmp_path, p, g, states, **scalars)
    cp, cg, cs = _clone(p, g, states)
    compiled.sgd_([cp], [cg], [cs[0]] if momentum else None, None, 0.05, momentum, dampening, 0.01, 0.5, nesterov,
                  maximize, wd_after, first, False)
    _same(hp, cp)
    for a, b in zip(hs, cs):
        _same(a, b)


@pytest.mark.parametrize("maximize,weight_decay", [(False, 0.0), (True, 0.1)])
def test_adagrad_math_is_the_cpu_kernels(compiled, host_math, tmp_path, maximize, weight_decay):
    p, g, states = _data(1, positive=(0,))
    clr = 1e-2 / (1 + (5 - 1) * 0.01)
    hp, hs = host_math("adagrad", tmp_path, p, g, states, clr=clr, weight_decay=weight_decay, eps=1e-10,
                       inv_grad_scale=0.5, maximize=maximize)
    cp, cg, cs = _clone(p, g, states)
    compiled.adagrad_([cp], [cg], [cs[0]], None, clr, weight_decay, 1e-10, 0.5, maximize, False)
    _same(hp, cp)
    _same(hs[0], cs[0])
    # the same step with the step count and lr on the "device"
    dp, _ = host_math("adagrad", tmp_path, p, g, states, lr=1e-2, lr_decay=0.01, weight_decay=weight_decay,
                      eps=1e-10, inv_grad_scale=0.5, maximize=maximize, dev_step=5)
    _same(dp, cp, exact=False)


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
