"""The CPU kernel extension: where its sources are, how it is built, and loading it once.

Failure to build never breaks anything: `load_cpu_extension` returns None after one
warning that quotes the compiler's message, and callers use the pure-PyTorch backend.

Adam in torch's CUDA roundings (csrc/cpu/adam_cuda_roundings.cpp) is about a quarter of the
build's time and serves only the offloaded share of a GPU run, so it is built where a GPU is visible
(``LIGHTNING_FASTOPT_CUDA_ROUNDINGS=1`` or ``0`` decides otherwise).  A build without it
refuses those roundings before touching anything; :func:`lightning_fastopt.functional.fused_adam_`
asks for one on host tensors through :func:`lightning_fastopt.ops.with_adam_cuda_roundings`,
which loads (and on first use builds) the kernels that have them.  The pure-PyTorch path is
no substitute: on host tensors its operations round as the CPU's.
"""

from __future__ import annotations

import os
import threading
import warnings
from pathlib import Path
from types import ModuleType

from lightning_fastopt.ops.builder import ExtensionBuildError, ExtensionSpec, load_extension
from lightning_fastopt.ops.isa import detect_isa

# The longest to compile first (ninja starts them in this order): Adam's roundings are three
# translation units so that they compile side by side.
CPU_SOURCES = ("adam.cpp", "adam_cuda_roundings.cpp", "bindings.cpp", "adam_cpu_fused.cpp", "sgd.cpp",
               "adagrad.cpp", "lamb.cpp", "reduce.cpp", "lion.cpp", "lars.cpp")
CPU_HEADERS = ("adam_math.h", "kernel_api.h", "tensor_walk.h", "torch_sqrt.h", "vec.h")
# csrc/common: the vocabulary the CPU and CUDA kernels and bindings share
COMMON_HEADERS = ("dtype_combinations.h", "fused_cuda_adagrad.h", "kernel_args.h", "kernel_types.h",
                  "optimizer_bindings.h", "sgd_rounding.h", "tensor_slots.h")
CUDA_ROUNDINGS_ENV = "LIGHTNING_FASTOPT_CUDA_ROUNDINGS"
_CUDA_ROUNDINGS_SOURCE = "adam_cuda_roundings.cpp"
_WITH_CUDA_ROUNDINGS = ", with Adam in torch's CUDA roundings"
# -ffp-contract=off: a multiply and an add stay two roundings unless a kernel asks for a
# fused multiply-add (VecF::fmadd), as ATen's kernels do, so that every ISA we build
# rounds alike (the portable build has no FMA instruction to contract into)
_BASE_CFLAGS = ("-O3", "-fopenmp", "-fno-math-errno", "-ffp-contract=off", "-Wno-c++20-extensions")
# one core's compile time for all sources, and for the CUDA roundings' own (the build's
# time estimate), measured with g++ 12 on a 2-core AVX-512 machine
_CORE_SECONDS = 66.0
_CUDA_ROUNDINGS_CORE_SECONDS = 14.0


def source_root() -> Path:
    """`csrc/` of a source checkout, or the copy shipped inside an installed wheel."""
    here = Path(__file__).resolve().parent.parent
    for candidate in (here.parent / "csrc", here / "_csrc"):
        if (candidate / "cpu" / "bindings.cpp").exists():
            return candidate
    raise ExtensionBuildError(f"C++ sources not found next to {here} (looked for csrc/ and _csrc/)")


def cuda_roundings_setting() -> str:
    """``LIGHTNING_FASTOPT_CUDA_ROUNDINGS``: ``"1"``, ``"0"`` or ``"auto"`` (the default); a
    ValueError naming the variable for anything else."""
    setting = os.environ.get(CUDA_ROUNDINGS_ENV, "auto").strip().lower() or "auto"
    if setting not in ("1", "0", "auto"):
        raise ValueError(f"{CUDA_ROUNDINGS_ENV}={setting!r}: expected one of '1', '0', 'auto'")
    return setting


def cuda_roundings_wanted() -> bool:
    """Whether the CPU kernels are built with Adam in torch's CUDA roundings: where a GPU is
    visible, unless :func:`cuda_roundings_setting` says."""
    setting = cuda_roundings_setting()
    if setting != "auto":
        return setting == "1"
    import torch

    return torch.cuda.is_available()


def cpu_extension_spec(isa: str | None = None, cuda_roundings: bool | None = None) -> ExtensionSpec:
    """The CPU kernels for ``isa`` (this CPU's best by default), with Adam in torch's CUDA
    roundings or not (by default :func:`cuda_roundings_wanted`)."""
    chosen = detect_isa() if isa is None else _isa_by_name(isa)
    with_cuda_roundings = cuda_roundings_wanted() if cuda_roundings is None else bool(cuda_roundings)
    cpu_dir = source_root() / "cpu"
    sources = [s for s in CPU_SOURCES if with_cuda_roundings or s != _CUDA_ROUNDINGS_SOURCE]
    suffix = "_cuda_roundings" if with_cuda_roundings else ""
    return ExtensionSpec(
        name=f"lightning_fastopt_cpu_{chosen.name}{suffix}",
        variant=chosen.name + suffix.replace("_", "-"),
        sources=tuple(str(cpu_dir / s) for s in sources),
        headers=(tuple(str(cpu_dir / h) for h in CPU_HEADERS)
                 + tuple(str(source_root() / "common" / h) for h in COMMON_HEADERS)),
        cflags=_BASE_CFLAGS + chosen.cflags + (f"-DFASTOPT_ADAM_CUDA_ROUNDINGS={int(with_cuda_roundings)}",),
        ldflags=("-fopenmp",),
        with_cuda=False,
        title=f"the CPU kernels ({chosen.name}{_WITH_CUDA_ROUNDINGS if with_cuda_roundings else ''})",
        core_seconds=_CORE_SECONDS - (0.0 if with_cuda_roundings else _CUDA_ROUNDINGS_CORE_SECONDS),
    )


def _isa_by_name(name: str):
    from lightning_fastopt.ops.isa import _ISAS

    if name not in _ISAS:
        raise ValueError(f"unknown ISA {name!r}; expected one of {sorted(_ISAS)}")
    return _ISAS[name]


_lock = threading.Lock()
_loaded: dict[str, ModuleType | None] = {}
_errors: dict[str, str] = {}


def load_cpu_extension(isa: str | None = None, warn: bool = True,
                       cuda_roundings: bool | None = None) -> ModuleType | None:
    """The compiled CPU kernels, built on first use; None (after one warning) if unavailable."""
    key = _key(isa, cuda_roundings)
    with _lock:
        if key in _loaded:
            return _loaded[key]
        # a bad LIGHTNING_FASTOPT_ISA or _CUDA_ROUNDINGS is the user's error, not a fallback
        spec = cpu_extension_spec(isa, cuda_roundings)
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


def _key(isa: str | None, cuda_roundings: bool | None) -> str:
    return f"{isa or 'auto'}/{'auto' if cuda_roundings is None else int(cuda_roundings)}"


def cpu_extension_error(isa: str | None = None, cuda_roundings: bool | None = None) -> str | None:
    return _errors.get(_key(isa, cuda_roundings))
