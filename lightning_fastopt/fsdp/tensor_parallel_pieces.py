"""Each parameter's piece on one tensor-parallel rank, from the plan a project gives torch's
``parallelize_module``, without a process group (for ``estimate_memory``).

torch's styles place a module's parameters as follows: ``ColwiseParallel`` splits a
Linear's weight and bias on their first dimension and an Embedding's weight on its second;
``RowwiseParallel`` splits a Linear's weight on its second dimension (the bias replicated)
and an Embedding's weight on its first; ``SequenceParallel`` replicates what it holds, and
the styles that prepare inputs or outputs hold none.  A split follows ``torch.chunk``
(pieces of ``ceil(size / ranks)``, the last ones shorter or empty), as DTensor's ``Shard``
does.  Plan keys are module paths, ``*`` matching any one name (as ``parallelize_module``
matches them).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["chunk_length", "tensor_parallel_pieces"]

# (style, module type) -> {parameter name: the dimension split}; a name not listed is replicated
_SPLITS = {
    ("ColwiseParallel", nn.Linear): {"weight": 0, "bias": 0},
    ("ColwiseParallel", nn.Embedding): {"weight": 1},
    ("RowwiseParallel", nn.Linear): {"weight": 1},
    ("RowwiseParallel", nn.Embedding): {"weight": 0},
}
_HOLD_NOTHING_SPLIT = ("SequenceParallel", "PrepareModuleInput", "PrepareModuleOutput", "PrepareModuleInputOutput")


def tensor_parallel_pieces(model: nn.Module, plan: Mapping[str, Any], size: int, rank: int) -> dict[nn.Parameter,
                                                                                                   torch.Tensor]:
    """Each parameter of ``model``'s piece on tensor-parallel rank ``rank`` of ``size``
    under ``plan`` (module path -> a ``ParallelStyle`` of torch, as ``parallelize_module``
    takes it), as a tensor on the meta device; a parameter no style splits is whole."""
    splits: dict[nn.Parameter, int] = {}
    for path, module in model.named_modules():
        style = _style_of(path, plan)
        if style is None:
            continue
        name = type(style).__name__.removeprefix("Float8")  # torchao's float8 styles place parameters alike
        if name in _HOLD_NOTHING_SPLIT:
            continue
        by_param = next((s for (n, cls), s in _SPLITS.items() if n == name and isinstance(module, cls)), None)
        if by_param is None:
            raise ValueError(f"tensor_parallel_plan[{path!r}]: {type(style).__name__} on {type(module).__name__} is "
                             "not one estimate_memory knows (ColwiseParallel and RowwiseParallel on Linear and "
                             "Embedding, SequenceParallel, PrepareModuleInput/Output)")
        for pname, dim in by_param.items():
            param = getattr(module, pname, None)
            if isinstance(param, nn.Parameter):
                splits[param] = dim
    return {p: _piece(p, splits.get(p), size, rank) for p in model.parameters()}


def _style_of(path: str, plan: Mapping[str, Any]):
    atoms = path.split(".") if path else []
    for pattern, style in plan.items():
        want = pattern.split(".") if pattern else []
        if len(want) == len(atoms) and all(fnmatch.fnmatchcase(a, w) for a, w in zip(atoms, want)):
            return style
    return None


def chunk_length(length: int, pieces: int, index: int) -> int:
    """The length of piece ``index`` of ``pieces`` when ``torch.chunk`` splits ``length``
    (pieces of ``ceil(length / pieces)``, the last ones shorter or empty): DTensor's
    ``Shard`` and ``fully_shard``'s rows."""
    chunk = -(-length // pieces)
    return max(0, min(length, (index + 1) * chunk) - index * chunk)


def _piece(param: torch.Tensor, dim: int | None, size: int, rank: int) -> torch.Tensor:
    shape = list(param.shape)
    if dim is not None:
        shape[dim] = chunk_length(shape[dim], size, rank)
    return torch.empty(shape, dtype=param.dtype, device="meta")
