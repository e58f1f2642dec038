"""The CPU kernel extension: where its sources are, how it is built, and loading it once.

Failure to build never breaks anything: `load_cpu_extension` returns None after one
warning that quotes the compiler's message, and callers use the pure-PyTorch backend.
"""

from __future__ import annotations

import threading
import warnings
from pathlib import Path
from types import ModuleType

from lightning_fastopt.ops.builder import ExtensionBuildError, ExtensionSpec, load_extension
from lightning_fastopt.ops.isa import detect_isa

CPU_SOURCES = ("adam.cpp", "adagrad.cpp", "lamb.cpp", "lars.cpp", "lion.cpp", "reduce.cpp", "sgd.cpp", "bindings.cpp")
CPU_HEADERS = ("kernel_api.h", "tensor_walk.h", "torch_sqrt.h", "vec.h")
# csrc/common: the vocabulary the CPU and CUDA kernels and bindings share
COMMON_HEADERS = ("dtype_combinations.h", "fused_cuda_adagrad.h", "kernel_args.h", "kernel_types.h",
                  "optimizer_bindings.h", "sgd_rounding.h", "tensor_slots.h")
# -ffp-contract=off: a multiply and an add stay two roundings unless a kernel asks for a
# fused multiply-add (VecF::fmadd), as ATen's kernels do, so that every ISA we build
# rounds alike (the portable build has no FMA instruction to contract into)
_BASE_CFLAGS = ("-O3", "-fopenmp", "-fno-math-errno", "-ffp-contract=off", "-Wno-c++20-extensions")
# one core's compile time for all sources (the build's time estimate): 38 s on 2 cores
# (AVX2, g++ 13) and 14 s on 16 (AVX-512) were measured
_CORE_SECONDS = 70.0


def source_root() -> Path:
    """`csrc/` of a source checkout, or the copy shipped inside an installed wheel."""
    here = Path(__file__).resolve().parent.parent
    for candidate in (here.parent / "csrc", here / "_csrc"):
        if (candidate / "cpu" / "bindings.cpp").exists():
            return candidate
    raise ExtensionBuildError(f"C++ sources not found next to {here} (looked for csrc/ and _csrc/)")


def cpu_extension_spec(isa: str | None = None) -> ExtensionSpec:
    chosen = detect_isa() if isa is None else _isa_by_name(isa)
    cpu_dir = source_root() / "cpu"
    return ExtensionSpec(
        name=f"lightning_fastopt_cpu_{chosen.name}",
        variant=chosen.name,
        sources=tuple(str(cpu_dir / s) for s in CPU_SOURCES),
        headers=(tuple(str(cpu_dir / h) for h in CPU_HEADERS)
                 + tuple(str(source_root() / "common" / h) for h in COMMON_HEADERS)),
        cflags=_BASE_CFLAGS + chosen.cflags,
        ldflags=("-fopenmp",),
        with_cuda=False,
        title=f"the CPU kernels ({chosen.name})",
        core_seconds=_CORE_SECONDS,
    )


def _isa_by_name(name: str):
    from lightning_fastopt.ops.isa import _ISAS

    if name not in _ISAS:
        raise ValueError(f"unknown ISA {name!r}; expected one of {sorted(_ISAS)}")
    return _ISAS[name]


_lock = threading.Lock()
_loaded: dict[str, ModuleType | None] = {}
_errors: dict[str, str] = {}


def load_cpu_extension(isa: str | None = None, warn: bool = True) -> ModuleType | None:
    """The compiled CPU kernels, built on first use; None (after one warning) if unavailable."""
    key = isa or "auto"
    with _lock:
        if key in _loaded:
            return _loaded[key]
        spec = cpu_extension_spec(isa)  # a bad LIGHTNING_FASTOPT_ISA is the user's error, not a fallback
        try:
            module = load_extension(spec)
        except (ExtensionBuildError, OSError, ImportError, TimeoutError, ValueError) as err:
            module = None
            _errors[key] = f"{type(err).__name__}: {err}"
            if warn:
                warnings.warn(
                    "lightning_fastopt: the compiled CPU optimizers are unavailable, using the "
                    f"(correct, slower) pure-PyTorch path instead. Reason:\n{err}",
                    RuntimeWarning,
                    stacklevel=3,
                )
        _loaded[key] = module
        return module


def cpu_extension_error(isa: str | None = None) -> str | None:
    return _errors.get(isa or "auto")
