"""Pieces of a large parameter: one tensor's master and optimizer state in several host
buckets.

With the state on disk (``offload_optimizer_device="nvme"``) host memory holds a window of
at least two buckets' regions (masters and state), and a bucket holds whole tensors: an
embedding of 525M elements (Llama-3 8B's) alone would need a 12.6 GB window.  So there a
parameter whose float32 master is larger than a bucket (``bucket_size_mb``) is split into
pieces of at most a bucket's size, each a :class:`~lightning_fastopt.offload.slots.ParamSlot`
with a ``part`` (a range of the flattened parameter's elements) in a bucket of its own;
the window then holds two buckets whatever the model.  Only where the result is the same
bits as the whole tensor's update (:func:`splits`):

- the inner optimizer updates each element from that element's gradient and state and
  the step's scalars alone (:attr:`~lightning_fastopt.optim.base.FusedOptimizer.steps_pieces`:
  Adam/AdamW, SGD, Lion, Adagrad; not LAMB or LARS, whose trust ratios read norms over the
  whole tensor, nor a user's own ``step``); bfloat16 moments' stochastic rounding draws its
  noise from each element's place in the whole tensor (the update is told where each
  piece starts: ``element_offsets``);
- the parameter is contiguous (its pieces are views of it): a piece's master is a flat copy
  of its range where the master is apart from the weight, and the range of the weight
  itself (a view, updated in place) where the parameter is its own master (a CPU run's
  float32 weights, FSDP's float32 host shards).

Piece boundaries are multiples of :data:`ALIGN` elements, so each element keeps its place
in the kernels' vectors.  What concerns the parameter as a whole goes through its first
piece: its gradient arrives once and is copied piece by piece, its norm (for clipping) is
the whole gradient's, and a checkpoint holds its state whole (:class:`WholeValues`
assembles the pieces'; :func:`piece_of_state` gives each piece its range back).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lightning_fastopt.offload.slots import ParamSlot, one_per_element

__all__ = ["ALIGN", "WholeValues", "piece_elements", "piece_of_state", "piece_ranges", "splits"]

ALIGN = 1024  # elements: every piece starts at a multiple of this


def piece_elements(bucket_bytes: int) -> int:
    """The elements of a piece: as many float32 masters as a bucket holds, a multiple of :data:`ALIGN`."""
    return max(ALIGN, bucket_bytes // 4 // ALIGN * ALIGN)


def splits(param: Tensor, limit: int | None) -> bool:
    """Whether a parameter is split into pieces of ``limit`` elements (None: nothing is)."""
    return limit is not None and param.numel() > limit and param.is_contiguous()


def piece_ranges(numel: int, size: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of each piece of ``numel`` elements, ``size`` each (the last one fewer)."""
    return [(start, min(start + size, numel)) for start in range(0, numel, size)]


def piece_of_state(slot: ParamSlot, state: dict[str, Any]) -> dict[str, Any]:
    """A parameter's state (taken over or loaded) as ``slot`` keeps it: each tensor of the
    parameter's size cut to the slot's range, the rest as it is."""
    if slot.part is None:
        return state
    return {k: slot.of(v) if one_per_element(v, slot.param.numel()) else v for k, v in state.items()}


class WholeValues:
    """Tensors of parameters as they leave the optimizer (a state dict, the state of one
    parameter, masters), whole: a whole slot's value through ``hand_out``, a piece's
    copied into its range of a tensor ``blank(shape, dtype)`` makes (the tier's: in host
    memory, or in a file of its own for a state on disk); ``dtype_of(value)`` the dtype a
    value leaves in (None: its own).  ``by_name``: name -> key -> value."""

    def __init__(self, hand_out: Callable[[Any, torch.dtype | None], Any],
                 blank: Callable[[torch.Size, torch.dtype], Tensor],
                 dtype_of: Callable[[Any], torch.dtype | None] = lambda value: None) -> None:
        self.hand_out = hand_out
        self.blank = blank
        self.dtype_of = dtype_of
        self.by_name: dict[str, dict[str, Any]] = {}

    def add(self, slot: ParamSlot, key: str, value: Any) -> None:
        whole = self.by_name.setdefault(slot.name, {})
        if slot.part is None:
            whole[key] = self.hand_out(value, self.dtype_of(value))
        elif one_per_element(value, slot.numel):
            if key not in whole:
                whole[key] = self.blank(slot.param.shape, self.dtype_of(value) or value.dtype)
            with torch.no_grad():
                slot.of(whole[key]).copy_(value)
        elif slot.leads:  # a scalar every piece keeps alike (a step count): the first piece's
            whole[key] = self.hand_out(value, self.dtype_of(value))

    def under(self, key: str) -> dict[str, Any]:
        """Each parameter's value under ``key``, by name (its master: ``""``)."""
        return {name: values[key] for name, values in self.by_name.items() if key in values}
