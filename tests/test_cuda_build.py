"""The CUDA kernels' build and the CUDA-facing Python layer, checked without a GPU:
the launch packing (host code), the build specification (architectures, flags, cache
key), loading and fallback on a torch without CUDA, `ops build/info`, the device-scalar
contract on the host path (found_inf, capturable), and, where torch has CUDA (a CUDA
build of torch with nvcc, with or without a GPU), that the extension compiles and its
functions take the documented arguments."""

import math
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import lightning_fastopt.functional as F
import lightning_fastopt.ops as ops
from lightning_fastopt import FusedAdam, FusedLAMB, FusedLars, FusedSGD
from lightning_fastopt.optim.base import FusedOptimizer
from lightning_fastopt.ops import cuda as cuda_ops
from lightning_fastopt.ops.builder import ExtensionBuildError, build_dir, build_key
from tests.helpers import compiled_check

REPO = Path(__file__).resolve().parent.parent
CPU_ONLY_TORCH = torch.version.cuda is None


# ---------------------------------------------------------------------------- launch packing
@pytest.fixture(scope="module")
def launch_plan(tmp_path_factory):
    exe = compiled_check(tmp_path_factory, "launch_plan_check.cpp", "-std=c++17", "-O1")

    def plan(depth, size_class, sizes):
        out = subprocess.run([str(exe), str(depth), size_class, *map(str, sizes)], capture_output=True, text=True,
                             check=True)
        lines = out.stdout.splitlines()
        header = lines[0].split()
        limits = dict(chunk=int(header[1]), max_blocks=int(header[3]), max_tensors=int(header[5]))
        launches = []
        for line in lines[1:]:
            f = line.split()
            if f[0] == "launch":
                launches.append(dict(blocks=int(f[1]), tensors=int(f[2]), rows=[]))
            else:
                launches[-1]["rows"].append(tuple(int(x) for x in f[1:]))
        return limits, launches

    return plan


@pytest.mark.parametrize("size_class", ["4k", "32k"])  # the kernel argument's capacity
@pytest.mark.parametrize("depth", [1, 4, 6])
@pytest.mark.parametrize("sizes", [
    [0, 1, 7, 1023, 1_000_003],
    [21_000_001, 200_000_001],  # more chunks than one launch has blocks (with either capacity)
    [int(n) for n in torch.randint(0, 200_000, (300,), generator=torch.Generator().manual_seed(0))],
    [5] * 700 + [65536 * 320, 65536 * 320 + 1, 0, 65537, 65536 * 2560],  # full launches, tails, empties
])
def test_every_chunk_of_every_tensor_is_launched_once(launch_plan, depth, size_class, sizes):
    limits, launches = launch_plan(depth, size_class, sizes)
    chunk = limits["chunk"]
    seen = []
    bases = [sum(math.ceil(n / chunk) for n in sizes[:i]) for i in range(len(sizes))]
    for launch in launches:
        assert 0 < launch["blocks"] <= limits["max_blocks"]
        assert launch["tensors"] <= limits["max_tensors"]
        assert len(launch["rows"]) == launch["blocks"]
        for index, c, base, numel, addr0, addr_last in launch["rows"]:
            assert numel == sizes[index] and base == bases[index]
            assert (addr0, addr_last) == (16 * index, 16 * index + depth - 1)  # the slot's own tensors
            seen.append((index, c))
    want = [(i, c) for i, n in enumerate(sizes) for c in range(math.ceil(n / chunk))]
    assert seen == want  # each once, in order


# ---------------------------------------------------------------------------- build specification
def test_arch_list_parsing(monkeypatch):
    monkeypatch.setenv(cuda_ops.ARCH_ENV, "8.0; 9.0+PTX 9.0a")
    assert cuda_ops.target_archs() == ("8.0", "9.0+PTX", "9.0a")
    assert cuda_ops._gencode("9.0+PTX") == ["-gencode=arch=compute_90,code=sm_90",
                                             "-gencode=arch=compute_90,code=compute_90"]
    assert cuda_ops._gencode("9.0a") == ["-gencode=arch=compute_90a,code=sm_90a"]
    monkeypatch.setenv(cuda_ops.ARCH_ENV, "hopper")
    with pytest.raises(ExtensionBuildError, match=r"TORCH_CUDA_ARCH_LIST='hopper': 'hopper' is not a compute"):
        cuda_ops.target_archs()


@pytest.mark.skipif(not CPU_ONLY_TORCH, reason="checks the message of a CPU-only torch")
def test_no_gpu_and_no_arch_list_is_a_clear_error(monkeypatch):
    monkeypatch.delenv(cuda_ops.ARCH_ENV, raising=False)
    with pytest.raises(ExtensionBuildError, match="no CUDA GPU is visible and TORCH_CUDA_ARCH_LIST is not set"):
        cuda_ops.target_archs()


def test_spec_is_keyed_by_cuda_version_and_architecture(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    spec90 = cuda_ops.cuda_extension_spec(("9.0",))
    spec80 = cuda_ops.cuda_extension_spec(("8.0", "9.0+PTX"))
    assert spec90.name == "lightning_fastopt_cuda_sm90" and spec90.variant == "cu130-sm90"
    assert spec80.variant == "cu130-sm80_90ptx"
    assert build_dir(spec90) != build_dir(spec80)
    assert "--fmad=false" in spec90.cuda_cflags and "-gencode=arch=compute_90,code=sm_90" in spec90.cuda_cflags
    assert not any("fast" in f for f in spec90.cuda_cflags)  # IEEE division and square roots
    assert spec90.with_cuda
    for path in spec90.sources + spec90.headers:
        assert Path(path).exists(), path
    names = {Path(p).name for p in spec90.headers}
    assert {"kernel_types.h", "tensor_slots.h", "launch_plan.h", "elementwise.cuh"} <= names
    # every header the CUDA build can include is in its cache key
    on_disk = {p.name for d in ("common", "cuda") for p in (REPO / "csrc" / d).iterdir() if p.suffix in (".h", ".cuh")}
    assert on_disk <= names, on_disk - names
    key = build_key(spec90)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    assert build_key(cuda_ops.cuda_extension_spec(("9.0",))) != key


def test_every_kernel_source_ships_in_the_wheel():
    tomllib = pytest.importorskip("tomllib")

    patterns = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"][
        "lightning_fastopt._csrc"]
    shipped = {p for pattern in patterns for p in (REPO / "csrc").glob(pattern)}
    everything = {p for p in (REPO / "csrc").rglob("*") if p.is_file()}
    assert everything == shipped, sorted(map(str, everything - shipped))


# ---------------------------------------------------------------------------- loading and fallback
@pytest.mark.skipif(not CPU_ONLY_TORCH, reason="a torch without CUDA")
def test_cpu_only_torch_loads_nothing_and_warns_nothing(monkeypatch):
    monkeypatch.setattr(cuda_ops, "_loaded", {})
    monkeypatch.setattr(cuda_ops, "_errors", {})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cuda_ops.load_cuda_extension() is None
        assert ops.cuda_backend() is None
    assert "CPU-only build" in cuda_ops.cuda_extension_error()
    assert ops.backend_for("cuda") is ops.torch_backend
    with pytest.raises(ExtensionBuildError, match="CPU-only build"):
        cuda_ops.cuda_extension_spec(("9.0",))


def test_a_failed_cuda_build_warns_once_and_falls_back(monkeypatch):
    def broken(spec):
        raise ExtensionBuildError("nvcc fatal: the compiler's own words")

    monkeypatch.setattr(cuda_ops, "_loaded", {})
    monkeypatch.setattr(cuda_ops, "_errors", {})
    monkeypatch.setattr(cuda_ops, "cuda_unavailable_reason", lambda: None)
    monkeypatch.setattr(cuda_ops, "cuda_extension_spec", lambda: None)
    monkeypatch.setattr(cuda_ops, "load_extension", broken)
    with pytest.warns(RuntimeWarning, match="compiler's own words"):
        assert cuda_ops.load_cuda_extension() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cuda_ops.load_cuda_extension() is None  # remembered: no second build, no second warning
        assert ops.backend_for("cuda") is ops.torch_backend
    monkeypatch.setenv(ops.BACKEND_ENV, "compiled")
    with pytest.raises(ExtensionBuildError, match="CUDA extension is unavailable: .*own words"):
        ops.cuda_backend()


def test_ops_info_and_build_report_cuda():
    info = subprocess.run([sys.executable, "-m", "lightning_fastopt.ops", "info"], capture_output=True, text=True,
                          cwd=REPO, check=True).stdout
    assert re.search(r"^CUDA extension: ", info, re.M)
    assert "CUDA tensors: " in info
    if CPU_ONLY_TORCH:
        assert "not applicable (torch" in info
        build = subprocess.run([sys.executable, "-m", "lightning_fastopt.ops", "build", "--cuda-only"],
                               capture_output=True, text=True, cwd=REPO)
        assert build.returncode == 1 and "CPU-only build" in build.stderr


# ---------------------------------------------------------------------------- the host side of the contract
def _adam(params, grads, m, v, **kw):
    return F.fused_adam_(params, grads, m, v, step=1, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
                         weight_decay=0.01, **kw)


def test_found_inf_read_on_the_host_skips_everything(compiled):
    params = [torch.randn(n) for n in (1, 7, 1023)]
    grads = [torch.randn_like(p) for p in params]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    snapshot = [t.clone() for t in params + m + v]
    assert _adam(params, grads, m, v, found_inf=torch.ones(1)) is True
    assert all(torch.equal(t, s) for t, s in zip(params + m + v, snapshot))
    for fn, args, kw in [
        (F.fused_sgd_, (params, grads, m), dict(step=1, lr=0.1, momentum=0.9)),
        (F.fused_adagrad_, (params, grads, v), dict(step=1, lr=0.1)),
        (F.fused_lion_, (params, grads, m), dict(lr=0.1, beta1=0.9, beta2=0.99)),
        (F.fused_lamb_, (params, grads, m, v), dict(step=1, lr=0.1, beta1=0.9, beta2=0.999, eps=1e-6,
                                                     weight_decay=0.01)),
        (F.fused_lars_, (params, grads, m), dict(lr=0.1, momentum=0.9)),
    ]:
        assert fn(*args, found_inf=torch.ones(1), **kw) is True, fn.__name__
    assert all(torch.equal(t, s) for t, s in zip(params + m + v, snapshot))
    assert _adam(params, grads, m, v, found_inf=torch.zeros(1)) is False
    ref = [s.clone() for s in snapshot]
    _adam(ref[:3], grads, ref[3:6], ref[6:])
    assert all(torch.equal(a, b) for a, b in zip(params + m + v, ref))


def test_optimizer_step_with_found_inf_counts_a_skipped_step(compiled):
    p = torch.randn(10, requires_grad=True)
    opt = FusedAdam([p], lr=0.1)
    p.grad = torch.randn(10)
    before = p.detach().clone()
    opt.step(found_inf=torch.ones(1))
    assert opt.last_step_skipped and opt.skipped_steps == 1 and torch.equal(p.detach(), before)
    assert not opt.state[p]
    opt.step(found_inf=torch.zeros(()))
    assert not opt.last_step_skipped and float(opt.state[p]["step"]) == 1.0


def test_capturable_needs_cuda_parameters_and_a_capturable_algorithm():
    with pytest.raises(ValueError, match=r"FusedAdam\(capturable=True\) needs CUDA parameters"):
        FusedAdam([torch.randn(3, requires_grad=True)], capturable=True)
    for cls in (FusedLAMB, FusedLars):  # their step needs host-side norms: no such keyword
        with pytest.raises(TypeError, match="capturable"):
            cls([torch.randn(3, requires_grad=True)], capturable=True)

    class NotCapturable(FusedOptimizer):  # a subclass that passes the flag on without support
        def __init__(self, params, capturable=False):
            super().__init__(params, dict(lr=0.1), capturable=capturable)

    with pytest.raises(ValueError, match="NotCapturable does not support capturable=True"):
        NotCapturable([torch.randn(3, requires_grad=True)], capturable=True)
    opt = FusedSGD([torch.randn(3, requires_grad=True)], lr=0.1)
    assert not opt.capturable


def test_unscale_and_sum_of_squares_on_the_cpu(compiled):
    grads = [torch.randn(n) * 8 for n in (0, 1, 7, 1023)]
    want = [g / 8 for g in grads]
    flag = torch.zeros(1)
    F.unscale_grads_(grads, 8.0, flag)
    assert float(flag) == 0.0 and all(torch.equal(g, w) for g, w in zip(grads, want))
    grads[3][5] = math.inf
    F.unscale_grads_(grads, 8.0, flag)
    assert float(flag) == 1.0
    tensors = [torch.randn(n) for n in (0, 1, 7, 100_003)]
    assert math.isclose(F.sum_of_squares(tensors), sum(float(t.double().square().sum()) for t in tensors),
                        rel_tol=1e-6)  # float within a block, double across blocks


# ---------------------------------------------------------------------------- compiled, where torch has CUDA
@pytest.fixture(scope="module")
def built_cuda_ext():
    if CPU_ONLY_TORCH:
        pytest.skip("torch has no CUDA: the CUDA kernels are compiled where it has (see docs/kernels.md)")
    try:
        cuda_ops.target_archs()
    except ExtensionBuildError as err:
        pytest.skip(str(err))
    ext = cuda_ops.load_cuda_extension()
    if ext is None:
        pytest.fail(f"the CUDA extension did not build: {cuda_ops.cuda_extension_error()}")
    return ext


def test_the_cuda_extension_compiles_and_takes_the_documented_arguments(built_cuda_ext):
    ext = built_cuda_ext
    assert ext.isa == "cuda"
    cpu = [torch.randn(4)]
    state = [torch.zeros(4)]
    calls = [
        lambda: ext.adam_(cpu, cpu, state, state, None, None, 0.1, 0.9, 0.999, 1e-8, 0.0, 0.1, 1.0, 1.0, False,
                          True, False, False, bias_correction=True, grad_scale=None, found_inf=None,
                          lr_tensor=None, step_tensor=None),
        lambda: ext.sgd_(cpu, cpu, state, None, 0.1, 0.9, 0.0, 0.0, 1.0, False, False, False, True, False,
                         rounding=0, grad_scale=None, found_inf=None, lr_tensor=None),
        lambda: ext.adagrad_(cpu, cpu, state, None, 0.1, 0.0, 1e-10, 1.0, False, False, lr=0.1, lr_decay=0.0,
                             grad_scale=None, found_inf=None, lr_tensor=None, step_tensor=None),
        lambda: ext.lion_(cpu, cpu, state, None, 0.1, 0.9, 0.99, 0.0, 1.0, False, False, grad_scale=None,
                          found_inf=None, lr_tensor=None),
        lambda: ext.lamb_(cpu, cpu, state, state, None, 0.1, 0.9, 0.999, 0.1, 1e-6, 0.01, 0.1, 0.001, 1.0, True,
                          True, False, bias_correction=True, grad_sum_squares=None, max_grad_norm=1.0,
                          inv_grad_scale=1.0, grad_scale=None, found_inf=None, lr_tensor=None, step_tensor=None),
        lambda: ext.lars_(cpu, cpu, state, None, 0.1, 0.9, 1e-3, 0.0, 0.0, 1.0, False, False, grad_scale=None,
                          found_inf=None, lr_tensor=None),
        lambda: ext.all_finite(cpu),
        lambda: ext.sum_squares(cpu),
        lambda: ext.sum_squares_device(cpu),
        lambda: ext.fingerprint(cpu),
        lambda: ext.check_finite_(cpu, torch.zeros(1)),
        lambda: ext.unscale_(cpu, 1.0, None, torch.zeros(1)),
    ]
    for call in calls:  # every argument binds; CPU tensors are refused before anything is touched
        with pytest.raises(ext.UnsupportedTensor, match="is not a dense, contiguous CUDA tensor"):
            call()
    # torch's CPU fused kernel's rounding is for CPU tensors
    with pytest.raises(ValueError, match=r"rounding 3 \(its CPU fused kernel\) is for CPU tensors"):
        ext.adam_(cpu, cpu, state, state, None, None, 0.1, 0.9, 0.999, 1e-8, 0.0, 0.1, 1.0, 1.0, False, True, False,
                  False, rounding=3)
    with pytest.raises(ValueError, match=r"rounding 3 \(its CPU fused kernel\) is for CPU tensors"):
        ext.sgd_(cpu, cpu, state, None, 0.1, 0.9, 0.0, 0.0, 1.0, False, False, False, True, False, rounding=3)
    assert ext.adam_([], [], [], [], None, None, 0.1, 0.9, 0.999, 1e-8, 0.0, 0.1, 1.0, 1.0, False, True, False,
                     False) is False
    assert ext.sum_squares([]) == []
    assert ext.all_finite([]) is True


def test_a_call_the_cuda_kernels_refuse_is_redone_on_the_host(monkeypatch, compiled):
    """The kernels check every tensor in C++ before touching any; a refusal (say, a
    non-contiguous gradient) redoes the whole call on the host backends."""
    class Refusing:
        class UnsupportedTensor(ValueError):
            pass

        calls = 0

        def adam_(self, *args, **kwargs):
            Refusing.calls += 1
            raise self.UnsupportedTensor("grads[1] is not a dense, contiguous CUDA tensor")

    ext = Refusing()
    monkeypatch.setattr(ops, "route", lambda device_type: ops.Route(ext, ops.cpu_backend(), cuda=True))
    params = [torch.randn(n) for n in (1, 7, 1023)]
    grads = [torch.randn_like(p) for p in params]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    ref = [t.clone() for t in params + m + v]
    assert _adam(params, grads, m, v, grad_scale=2.0) is False
    assert Refusing.calls == 1
    monkeypatch.undo()
    _adam(ref[:3], grads, ref[3:6], ref[6:], grad_scale=2.0)
    assert all(torch.equal(a, b) for a, b in zip(params + m + v, ref))
