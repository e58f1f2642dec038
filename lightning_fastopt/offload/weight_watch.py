"""Noticing that something other than the optimizer wrote a model weight.

A parameter with a separate float32 master (offloaded, or half precision) is updated in
the master and copied back; if a callback, ``load_state_dict`` or an in-place write under
``no_grad`` changed the parameter since, the master must be refreshed from it before the
next step, or that step would overwrite the write.  The tensor's version counter and
storage address catch most writes, but not those through ``.data`` (WGAN weight
clipping, EMA resets), which bump a counter of their own.  So each such parameter also
has a fingerprint of its bits, computed on its device after every write of ours and
compared before the next step (:func:`lightning_fastopt.ops.torch_backend.fingerprint`
defines it: one changed element always changes it).  The compiled kernels fingerprint
every parameter of a device in one multi-tensor pass (one launch on a GPU), a single
read of the weights.  Cost per step: one read of the watched weights after the step and
one before the next (``benchmarks/weight_watch.py`` measures both against the device's
copy bandwidth); the offload optimizer compares on its gradient stream, so the answer
travels with the gradients and costs no synchronization of its own.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_fastopt import ops

_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _by_device(tensors: Sequence[Tensor]) -> list[list[int]]:
    """Indices of the tensors, one list per device, in order of first appearance."""
    lists: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        lists.setdefault(t.device, []).append(i)
    return list(lists.values())


def _on_device(tensors: list[Tensor]) -> Tensor:
    """Fingerprints of tensors on one device, as an int64 tensor on that device: the
    compiled kernels take the contiguous float32/float16/bfloat16 ones, torch the rest."""
    kernels = ops.route(tensors[0].device.type).kernels
    if kernels is ops.torch_backend:
        return ops.torch_backend.fingerprint(tensors)
    fast = [t.dtype in _KERNEL_DTYPES and t.is_contiguous() for t in tensors]
    if all(fast):
        return kernels.fingerprint(tensors)
    out = torch.empty(len(tensors), dtype=torch.int64, device=tensors[0].device)
    for wanted, fn in ((True, kernels.fingerprint), (False, ops.torch_backend.fingerprint)):
        indices = [i for i, f in enumerate(fast) if f is wanted]
        if indices:
            out[indices] = fn([tensors[i] for i in indices])
    return out


def fingerprints(tensors: Sequence[Tensor]) -> list[Tensor]:
    """The fingerprint of each tensor (a 0-dim int64 tensor on its device), without
    synchronizing: one multi-tensor launch per device on the CUDA kernels."""
    out: list[Tensor] = [None] * len(tensors)  # type: ignore[list-item]
    for indices in _by_device(tensors):
        for i, value in zip(indices, _on_device([tensors[i].detach() for i in indices])):
            out[i] = value
    return out


def changed_flags(tensors: Sequence[Tensor], earlier: Sequence[Tensor]) -> Tensor:
    """Whether each tensor's fingerprint differs from the one given, as a bool tensor on
    their device (all on one), without synchronizing."""
    return torch.stack(fingerprints(tensors)) != torch.stack(list(earlier))


def changed_since(tensors: Sequence[Tensor], earlier: Sequence[Tensor]) -> list[bool]:
    """Whether each tensor's fingerprint differs from the one given: one synchronization
    per device for all of them."""
    out = [False] * len(tensors)
    for indices in _by_device(tensors):
        differs = changed_flags([tensors[i] for i in indices], [earlier[i] for i in indices])
        for i, value in zip(indices, differs.tolist()):
            out[i] = value
    return out
