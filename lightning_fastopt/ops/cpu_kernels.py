"""The compiled CPU kernels as one backend, built of the pieces a run needs.

A new user's first run used to wait for every CPU kernel to compile (38-46 s on an idle
2-core machine) where an AdamW run calls Adam's alone.  :class:`CpuKernels` is the CPU
backend :func:`lightning_fastopt.ops.cpu_backend` returns: the first call of a kernel (or
:meth:`CpuKernels.need`, which a strategy calls at set-up with its optimizers' pieces)
loads a build that holds its piece (:mod:`lightning_fastopt.ops.cpu`):

- the full build, where the cache has it (``python -m lightning_fastopt.ops build``, or an
  earlier run's);
- else, for the first pieces a process needs, a build of just those (bindings, reductions
  and, say, Adam: about half of the full build's time);
- and where a later call needs a piece that build lacks (a second optimizer of another
  algorithm, torch's ``fused=True`` rounding, a GPU run's CUDA roundings), the full build.

Each build is a module of its own; the kernels keep no state between calls (it is all in
the tensors), so moving to a larger build changes nothing but what can be called.  Where
a build fails, calls go to the pure-PyTorch backend after one warning (or raise, with
``LIGHTNING_FASTOPT_BACKEND=compiled``), as before.
"""

from __future__ import annotations

import threading
from types import ModuleType

from lightning_fastopt.ops import cpu as cpu_build
from lightning_fastopt.ops import torch_backend
from lightning_fastopt.ops.builder import ExtensionBuildError
from lightning_fastopt.ops.rounding import ROUNDINGS

# the piece each kernel function is in (the others: the bindings' own, in every build)
PIECE_OF = {"adam_": "adam", "sgd_": "sgd", "adagrad_": "adagrad", "lion_": "lion", "lamb_": "lamb",
            "lamb_norms_": "lamb", "lars_": "lars"}
# Adam's roundings that are pieces of their own (by the code the kernels take)
_ADAM_ROUNDING_PIECES = {ROUNDINGS.index("torch_cpu_fused"): "adam_cpu_fused",
                         ROUNDINGS.index("torch_cuda_foreach"): "adam_cuda_roundings",
                         ROUNDINGS.index("torch_cuda_fused"): "adam_cuda_roundings",
                         ROUNDINGS.index("torch_cuda_for_loop"): "adam_cuda_roundings"}


def adam_pieces(rounding: int | str) -> frozenset[str]:
    """The pieces Adam in ``rounding`` (a name of :data:`ROUNDINGS` or its code) runs on."""
    code = ROUNDINGS.index(rounding) if isinstance(rounding, str) else int(rounding)
    return frozenset({"adam", _ADAM_ROUNDING_PIECES.get(code, "adam")})


class CpuKernels:
    """The CPU backend: each attribute is the loaded build's, loading (building) one that
    holds the attribute's piece first (module docstring).  ``compiled``: raise where the
    build fails, instead of falling back to the pure-PyTorch backend."""

    adam_cuda_roundings = True  # Adam in torch's CUDA roundings runs: a call asking loads their piece

    def __init__(self, warn: bool = True, compiled: bool = False) -> None:
        self._warn = warn
        self._compiled = compiled
        self._lock = threading.Lock()
        self._module: ModuleType | None = None
        self._failed = False

    # ------------------------------------------------------------------ loading
    def need(self, pieces) -> ModuleType:
        """The backend that runs ``pieces``: a build that holds them, loaded now (built if
        need be), or the pure-PyTorch backend where that failed."""
        wanted = cpu_build.with_needs(pieces)
        with self._lock:
            if self._module is not None and wanted <= frozenset(self._module.pieces):
                return self._module
            if self._failed:
                return torch_backend
            every = cpu_build.every_piece()
            if self._module is None and not (wanted <= every and cpu_build.full_build_cached()):
                self._module = self._load(wanted)  # the first need, no full build cached: just these pieces
            else:  # the full build (with what it leaves out where no GPU is visible, where asked for)
                self._module = self._load(every | wanted)
            if self._module is None:
                self._failed = True
                return torch_backend
            return self._module

    def full(self) -> ModuleType:
        """The build of every piece (``ops info``), or the pure-PyTorch backend where it failed."""
        return self.need(cpu_build.every_piece())

    def _load(self, pieces) -> ModuleType | None:
        module = cpu_build.load_cpu_extension(warn=self._warn, pieces=pieces)
        if module is None and self._compiled:
            from lightning_fastopt.ops import BACKEND_ENV

            raise ExtensionBuildError(f"{BACKEND_ENV}=compiled but the CPU extension is unavailable: "
                                      f"{cpu_build.cpu_extension_error(pieces=pieces)}")
        return module

    @property
    def loaded(self) -> ModuleType | None:
        """The build loaded so far (None: none yet, or it failed)."""
        return self._module

    # ------------------------------------------------------------------ the backend's names
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        if name == "adam_":
            return self._adam
        if name in PIECE_OF:
            return getattr(self.need({PIECE_OF[name]}), name)
        # the bindings' own (all_finite, sum_squares, fingerprint, UnsupportedTensor, isa, ...): the
        # build loaded, else the one of every piece
        module = self._module if self._module is not None else self.full()
        return getattr(module, name)

    def _adam(self, *args, **kwargs):
        """``adam_`` of a build with the piece of the rounding asked for (a keyword: the
        callers pass every argument so)."""
        return self.need(adam_pieces(kwargs.get("rounding", 0))).adam_(*args, **kwargs)
