"""Noticing that something other than the optimizer wrote a model weight.

A parameter with a separate float32 master (offloaded, or half precision) is updated in
the master and copied back; if a callback, ``load_state_dict`` or an in-place write under
``no_grad`` changed the parameter since, the master must be refreshed from it before the
next step, or that step would overwrite the write.  The tensor's version counter and
storage address catch most writes, but not those through ``.data`` (WGAN weight
clipping, EMA resets), which bump a counter of their own.  So each such parameter also
has a fingerprint, computed on its device after every write of ours and compared before
each step: exact integer sums of its bit patterns over the rows and over the columns of
a ``(n // 1021, 1021)`` view, and the tail as it is.  Any change of one element changes a
sum; a write escapes only if its changes cancel exactly in every row and every column it
touches.  Cost: two reductions over the weights after the step and two before the next
(``benchmarks/weight_watch.py`` measures it), and one device synchronization per step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

_COLUMNS = 1021  # a prime: rows and columns of the view rarely line up with a weight's own layout
_BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16,
         torch.float64: torch.int64}


def fingerprint(t: Tensor) -> Tensor:
    """int64 row sums, column sums and tail of the bit patterns of ``t`` (on its device)."""
    bits = t.detach().reshape(-1).view(_BITS[t.dtype])
    whole = bits.numel() - bits.numel() % _COLUMNS
    rows = bits[:whole].view(-1, _COLUMNS)
    if rows.device.type == "cpu":  # the CPU's reductions that widen as they read are slow (3-6x, measured)
        rows = rows.to(torch.int64)
    return torch.cat([rows.sum(0, dtype=torch.int64), rows.sum(1, dtype=torch.int64),
                      bits[whole:].to(torch.int64)])


def changed_since(tensors: Sequence[Tensor], fingerprints: Sequence[Tensor]) -> list[bool]:
    """Whether each tensor's fingerprint differs from the one given: one synchronization
    per device for all of them."""
    if not tensors:
        return []
    flags = [(fingerprint(t) != f).any() for t, f in zip(tensors, fingerprints)]
    by_device: dict[torch.device, list[int]] = {}
    for i, f in enumerate(flags):
        by_device.setdefault(f.device, []).append(i)
    out = [False] * len(flags)
    for indices in by_device.values():
        for i, value in zip(indices, torch.stack([flags[i] for i in indices]).tolist()):
            out[i] = value
    return out
