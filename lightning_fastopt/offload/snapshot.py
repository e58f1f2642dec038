"""What a host bucket's update changes, kept so that the update can be undone: the float32
masters and the optimizer state (step counts included) of its parameters, and the
half-precision weights it writes in place (FSDP's half host shards,
:func:`~lightning_fastopt.offload.slots.written_in_place`), copied into buffers of their
own before a speculative update writes them.

The buffers are allocated once, at the first snapshot, and reused every step: they cost
the masters' and the state's size again in host memory (``estimate_memory(...,
speculate=True)`` counts them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_fastopt.offload.slots import ParamSlot, written_in_place
from lightning_fastopt.optim.base import FusedOptimizer


WEIGHT = "<weight>"  # the key of a weight written in place among a slot's copies (no state key)


class BucketSnapshot:
    """The masters and state of one bucket's slots as they were before an update."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[int, str], Tensor] = {}  # (slot index, state key or "") -> a copy
        self._saved: list[tuple[ParamSlot, dict[str, Any] | None]] = []
        self._beside: Any = None  # what the inner optimizer keeps beside its parameters' state

    def take(self, inner: FusedOptimizer, slots: Sequence[ParamSlot]) -> None:
        """Copy the slots' masters and their state in ``inner`` (None where a slot has none yet)."""
        self._saved = []
        self._beside = kept_beside(inner)
        for s in slots:
            self._copy(s.index, "", s.master)
            if written_in_place(s):
                self._copy(s.index, WEIGHT, s.weight())
            state = inner.state.get(s.master)
            kept = None if state is None else {k: self._copy(s.index, k, v) if isinstance(v, Tensor) else v
                                               for k, v in state.items()}
            self._saved.append((s, kept))

    def restore(self, inner: FusedOptimizer) -> None:
        """Put the masters and state back as :meth:`take` found them (in the same tensors:
        the inner optimizer's buckets keep pointing at them); state the update created
        is removed."""
        with torch.no_grad():
            for s, kept in self._saved:
                s.master.copy_(self._buffers[(s.index, "")])
                if written_in_place(s):
                    s.weight().copy_(self._buffers[(s.index, WEIGHT)])
                put_state_back(inner, s.master, kept, None if kept is None else set(kept))
        put_beside_back(inner, self._beside)
        self._saved = []

    def commit(self) -> None:
        """The update holds: nothing to undo (the next :meth:`take` replaces the copies)."""
        self._saved = []

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._buffers.values())

    def _copy(self, index: int, key: str, value: Tensor) -> Tensor:
        buffer = self._buffers.get((index, key))
        if buffer is None or buffer.shape != value.shape or buffer.dtype != value.dtype:
            buffer = self._buffers[(index, key)] = torch.empty_like(value, device="cpu")
        with torch.no_grad():
            buffer.copy_(value)
        return buffer


def kept_beside(inner: FusedOptimizer) -> Any:
    """A copy of what ``inner`` keeps beside its parameters' state (a user's class: keys of
    its groups, state under other keys; :mod:`~lightning_fastopt.optim.beside_parameters`),
    None for the kernels' optimizers, which keep nothing there."""
    beside = getattr(inner, "beside_parameters", None)
    return None if beside is None else beside()


def put_beside_back(inner: FusedOptimizer, kept: Any) -> None:
    """What :func:`kept_beside` copied, put back."""
    if kept is not None:
        inner.put_beside_parameters(kept)


def put_state_back(inner: FusedOptimizer, master: Tensor, kept: dict[str, Any] | None, keys: set[str] | None) -> None:
    """A slot's state in ``inner`` as a snapshot kept it: none where it had none
    (``kept`` None), else only the keys it had (``keys``; state an update created is
    removed) and ``kept``'s values put back, in the same tensors where the shapes match (the
    inner optimizer's buckets keep pointing at them).  Called under ``torch.no_grad()``."""
    if kept is None:
        inner.state.pop(master, None)
        return
    state = inner.state[master]
    for k in [k for k in state if k not in keys]:
        del state[k]
    for k, v in kept.items():
        if isinstance(v, Tensor) and isinstance(state.get(k), Tensor) and state[k].shape == v.shape:
            state[k].copy_(v)
        else:
            state[k] = v.clone() if isinstance(v, Tensor) else v
