"""Which SIMD instruction set this CPU supports, and the compiler flags for it.

The extension is compiled for one instruction set with explicit flags (never
``-march=native``), and the build cache is keyed on that name, so a binary built on an
AVX-512 host is never loaded on an AVX2-only one that shares the home directory.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from functools import lru_cache

ISA_ENV = "LIGHTNING_FASTOPT_ISA"


@dataclass(frozen=True)
class Isa:
    name: str  # "avx512", "avx2" or "generic"
    cflags: tuple[str, ...]


_ISAS = {
    "avx512": Isa(
        "avx512",
        ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c",
         "-DFASTOPT_ISA_AVX512"),
    ),
    "avx2": Isa("avx2", ("-mavx2", "-mfma", "-mf16c", "-DFASTOPT_ISA_AVX2")),
    "generic": Isa("generic", ()),
}


@lru_cache(maxsize=1)
def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def detect_isa() -> Isa:
    """The best instruction set that both this CPU and our kernels support.

    ``LIGHTNING_FASTOPT_ISA=generic|avx2|avx512`` overrides the choice (a lower one is
    always safe; a higher one than the CPU has is refused).
    """
    forced = os.environ.get(ISA_ENV, "").strip().lower()
    best = _detect()
    if forced:
        if forced not in _ISAS:
            raise ValueError(f"{ISA_ENV}={forced!r}: expected one of {sorted(_ISAS)}")
        order = ["generic", "avx2", "avx512"]
        if order.index(forced) > order.index(best.name):
            raise ValueError(f"{ISA_ENV}={forced!r}: this CPU supports at most {best.name!r}")
        return _ISAS[forced]
    return best


def _detect() -> Isa:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return _ISAS["generic"]
    flags = _cpu_flags()
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma", "f16c"} <= flags:
        return _ISAS["avx512"]
    if {"avx2", "fma", "f16c"} <= flags:
        return _ISAS["avx2"]
    return _ISAS["generic"]


def available_isas() -> list[str]:
    """Every instruction set this CPU can run, lowest first."""
    order = ["generic", "avx2", "avx512"]
    return order[: order.index(_detect().name) + 1]
