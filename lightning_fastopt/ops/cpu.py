"""The CPU kernel extension: where its sources are, how it is built, and loading it once.

Failure to build never breaks anything: `load_cpu_extension` returns None after one
warning that quotes the compiler's message, and callers use the pure-PyTorch backend.

Adam in torch's CUDA roundings (csrc/cpu/adam_cuda_roundings.cpp) is about a quarter of the
build's time and serves only the offloaded share of a GPU run, so it is built where a GPU is visible
(``LIGHTNING_FASTOPT_CUDA_ROUNDINGS=1`` or ``0`` decides otherwise).  A build without it
refuses those roundings before touching anything; a call in one of them on host tensors
loads (and on first use builds) kernels that have them (:class:`~lightning_fastopt.ops.cpu_kernels.CpuKernels`
takes the piece from the call's ``rounding``).  The pure-PyTorch path is no substitute: on
host tensors its operations round as the CPU's.
"""

from __future__ import annotations

import os
import threading
import warnings
from pathlib import Path
from types import ModuleType

from lightning_fastopt.ops.builder import ExtensionBuildError, ExtensionSpec, is_built, load_extension
from lightning_fastopt.ops.isa import detect_isa

# The CPU kernels are built of pieces: the bindings and the reductions always, and one piece
# per algorithm (Adam's rounding of torch's CPU fused kernel and of its CUDA steps pieces of
# their own).  A run builds the pieces its optimizers need (``lightning_fastopt.ops`` loads
# them), `ops build` every piece; each piece's sources, and one core's compile time for each,
# measured with g++ 12 on a 2-core AVX-512 machine (the build's time estimate: ``core_seconds``).
BASE_SOURCES = ("bindings.cpp", "reduce.cpp")
PIECES = {
    "adam": ("adam.cpp",),
    "adam_cuda_roundings": ("adam_cuda_roundings.cpp",),
    "adam_cpu_fused": ("adam_cpu_fused.cpp",),
    "sgd": ("sgd.cpp",),
    "adagrad": ("adagrad.cpp",),
    "lamb": ("lamb.cpp",),
    "lion": ("lion.cpp",),
    "lars": ("lars.cpp",),
}
# the pieces a piece needs beside it (Adam's roundings are Adam's)
_NEEDS = {"adam_cuda_roundings": ("adam",), "adam_cpu_fused": ("adam",)}
# every source, the longest to compile first (ninja starts them in this order)
CPU_SOURCES = ("adam.cpp", "adam_cuda_roundings.cpp", "bindings.cpp", "adam_cpu_fused.cpp", "sgd.cpp",
               "adagrad.cpp", "lamb.cpp", "reduce.cpp", "lion.cpp", "lars.cpp")
CPU_HEADERS = ("adam_math.h", "chunk_schedule.h", "kernel_api.h", "tensor_walk.h", "torch_sqrt.h", "vec.h")
# csrc/common: the vocabulary the CPU and CUDA kernels and bindings share
COMMON_HEADERS = ("dtype_combinations.h", "fused_cuda_adagrad.h", "kernel_args.h", "kernel_types.h",
                  "optimizer_bindings.h", "sgd_rounding.h", "tensor_slots.h")
CUDA_ROUNDINGS_ENV = "LIGHTNING_FASTOPT_CUDA_ROUNDINGS"
_WITH_CUDA_ROUNDINGS = ", with Adam in torch's CUDA roundings"
# -ffp-contract=off: a multiply and an add stay two roundings unless a kernel asks for a
# fused multiply-add (VecF::fmadd), as ATen's kernels do, so that every ISA we build
# rounds alike (the portable build has no FMA instruction to contract into)
_BASE_CFLAGS = ("-O3", "-fopenmp", "-fno-math-errno", "-ffp-contract=off", "-Wno-c++20-extensions")
_BASE_CORE_SECONDS = 8.0  # the bindings (parsing torch's headers: 6.4 s) and the reductions
_BINDING_CORE_SECONDS = 0.8  # each algorithm's bindings
_PIECE_CORE_SECONDS = {"adam": 7.7, "adam_cuda_roundings": 14.0, "adam_cpu_fused": 6.6, "sgd": 4.4, "adagrad": 2.3,
                       "lamb": 1.8, "lion": 1.0, "lars": 1.0}
_ALGORITHMS = ("adam", "sgd", "adagrad", "lion", "lamb", "lars")


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


def every_piece(cuda_roundings: bool | None = None) -> frozenset[str]:
    """What a full build holds: every piece, Adam in torch's CUDA roundings where
    :func:`cuda_roundings_wanted` (or ``cuda_roundings``) says."""
    with_cuda_roundings = cuda_roundings_wanted() if cuda_roundings is None else bool(cuda_roundings)
    return frozenset(p for p in PIECES if with_cuda_roundings or p != "adam_cuda_roundings")


def with_needs(pieces) -> frozenset[str]:
    """``pieces`` and the pieces they need; a ValueError naming an unknown one."""
    unknown = sorted(set(pieces) - set(PIECES))
    if unknown:
        raise ValueError(f"unknown CPU kernel piece(s) {unknown}; expected some of {sorted(PIECES)}")
    return frozenset(pieces) | {n for p in pieces for n in _NEEDS.get(p, ())}


def cpu_extension_spec(isa: str | None = None, cuda_roundings: bool | None = None,
                       pieces=None) -> ExtensionSpec:
    """The CPU kernels for ``isa`` (this CPU's best by default): ``pieces`` of them, by default
    :func:`every_piece` (with Adam in torch's CUDA roundings or not: ``cuda_roundings``)."""
    chosen = detect_isa() if isa is None else _isa_by_name(isa)
    full = every_piece(cuda_roundings)
    chosen_pieces = full if pieces is None else with_needs(pieces)
    cpu_dir = source_root() / "cpu"
    sources = BASE_SOURCES + tuple(s for piece, files in PIECES.items() if piece in chosen_pieces for s in files)
    sources = tuple(sorted(sources, key=CPU_SOURCES.index))
    if chosen_pieces >= every_piece(False):  # every piece: the names builds have always had
        suffix = "_cuda_roundings" if "adam_cuda_roundings" in chosen_pieces else ""
        title_pieces = _WITH_CUDA_ROUNDINGS if suffix else ""
    else:
        suffix = "__" + "_".join(p for p in PIECES if p in chosen_pieces)
        title_pieces = ": " + ", ".join(p for p in PIECES if p in chosen_pieces)
    defines = tuple(f"-DFASTOPT_WITH_{a.upper()}={int(a in chosen_pieces)}" for a in _ALGORITHMS) + (
        f"-DFASTOPT_ADAM_CUDA_ROUNDINGS={int('adam_cuda_roundings' in chosen_pieces)}",
        f"-DFASTOPT_ADAM_CPU_FUSED={int('adam_cpu_fused' in chosen_pieces)}")
    algorithms = sum(a in chosen_pieces for a in _ALGORITHMS)
    return ExtensionSpec(
        name=f"lightning_fastopt_cpu_{chosen.name}{suffix}",
        variant=chosen.name + suffix.replace("_", "-"),
        sources=tuple(str(cpu_dir / s) for s in sources),
        headers=(tuple(str(cpu_dir / h) for h in CPU_HEADERS)
                 + tuple(str(source_root() / "common" / h) for h in COMMON_HEADERS)),
        cflags=_BASE_CFLAGS + chosen.cflags + defines,
        ldflags=("-fopenmp",),
        with_cuda=False,
        title=f"the CPU kernels ({chosen.name}{title_pieces})",
        core_seconds=(_BASE_CORE_SECONDS + algorithms * _BINDING_CORE_SECONDS
                      + sum(_PIECE_CORE_SECONDS[p] for p in chosen_pieces)),
        speed_key=f"lightning_fastopt_cpu_{chosen.name}",
        pieces=chosen_pieces,
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
                       cuda_roundings: bool | None = None, pieces=None) -> ModuleType | None:
    """The compiled CPU kernels (``pieces`` of them: :func:`cpu_extension_spec`), built on
    first use; None (after one warning) if unavailable."""
    key = _key(isa, cuda_roundings, pieces)
    with _lock:
        if key in _loaded:
            return _loaded[key]
        # a bad LIGHTNING_FASTOPT_ISA or _CUDA_ROUNDINGS is the user's error, not a fallback
        spec = cpu_extension_spec(isa, cuda_roundings, pieces)
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


def full_build_cached(isa: str | None = None) -> bool:
    """Whether the cache holds a finished build of :func:`every_piece`."""
    return is_built(cpu_extension_spec(isa))


def _key(isa: str | None, cuda_roundings: bool | None, pieces=None) -> str:
    """A build's key among those loaded: its ISA as asked and the pieces it holds."""
    held = cpu_extension_spec(isa, cuda_roundings, pieces).pieces
    return f"{isa or 'auto'}/{','.join(sorted(held))}"


def cpu_extension_error(isa: str | None = None, cuda_roundings: bool | None = None, pieces=None) -> str | None:
    return _errors.get(_key(isa, cuda_roundings, pieces))
