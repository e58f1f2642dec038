import os

import pytest
import torch

from lightning_fastopt.ops.cpu import CUDA_ROUNDINGS_ENV

# The suite tests the CPU kernels in every rounding, torch's CUDA ones included, which a
# machine without a GPU would otherwise not build (lightning_fastopt.ops.cpu); processes the
# tests start inherit it.  tests/test_build.py builds the kernels without them too.
os.environ.setdefault(CUDA_ROUNDINGS_ENV, "1")

import lightning_fastopt.ops as ops  # noqa: E402
from lightning_fastopt.ops import torch_backend  # noqa: E402
from lightning_fastopt.ops.cpu import load_cpu_extension  # noqa: E402
from lightning_fastopt.ops.isa import detect_isa  # noqa: E402

# Every correctness test runs on each CPU backend: the compiled kernels for this CPU's
# best instruction set, the portable ("generic") compiled build, and the pure-PyTorch
# fallback.  They must all agree with the references.  The portable build (a second build
# of the kernels) is marked slow: README's test command leaves it to CI.
_BEST = detect_isa().name
_PARAMS = [_BEST] + ([pytest.param("generic", marks=pytest.mark.slow)] if _BEST != "generic" else []) + ["torch"]


def _load(name):
    if name == "torch":
        return torch_backend
    module = load_cpu_extension(name, warn=False)
    if module is None:
        pytest.fail(f"the {name} CPU extension did not build")
    return module


@pytest.fixture(params=_PARAMS)
def backend(request, monkeypatch):
    module = _load(request.param)
    monkeypatch.setattr(ops, "cpu_backend", lambda: module)
    return module


@pytest.fixture
def compiled(monkeypatch):
    """The best compiled backend only (for tests about the kernels themselves)."""
    module = _load(detect_isa().name)
    monkeypatch.setattr(ops, "cpu_backend", lambda: module)
    return module


class _Spy:
    """The CUDA extension, counting the calls of each function."""

    def __init__(self, ext):
        self._ext = ext
        self.calls: dict[str, int] = {}

    def __getattr__(self, name):
        attr = getattr(self._ext, name)
        if not callable(attr) or name == "UnsupportedTensor":
            return attr

        def counted(*args, **kwargs):
            self.calls[name] = self.calls.get(name, 0) + 1
            return attr(*args, **kwargs)

        return counted


@pytest.fixture
def cuda_ext(monkeypatch):
    """The compiled CUDA kernels (the test fails when they do not build), spied on:
    ``cuda_ext.calls`` counts the calls of each kernel function."""
    ext = ops.cuda_backend()
    if ext is None:
        pytest.fail(f"the CUDA extension did not build: {ops.cuda_extension_error()}")
    spy = _Spy(ext)
    monkeypatch.setattr(ops, "cuda_backend", lambda: spy)  # ops.route() finds the kernels through it
    return spy


@pytest.fixture
def no_process_group_left():
    """A test that runs an FSDP strategy in this process (gloo, one rank) leaves no process
    group behind it: the tests after it start none (a one-device run checks that)."""
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (skipped without one)")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
