"""The clipping norm of an accelerator run whose offloaded gradients left the device:
each per-tensor norm taken where torch takes it.

``torch.nn.utils.clip_grad_norm_`` (Lightning's clipping by norm) computes the norm of
each gradient with ``torch._foreach_norm`` on the gradient's device, grouped by dtype,
then the norm of those norms, stacked in the parameters' order, on the first gradient's
device.  A CUDA reduction sums in another order than a CPU one, so the norms of the
offloaded gradients taken from their host copies differ from torch's in the last bits,
and with them the clipping coefficient and every clipped gradient (seen on an H100,
2026-11-26: SGD and Adam with L2 decay, clipped by norm at fraction 0.5, an ulp or two
from ``Trainer()``).  So each offloaded gradient's norm is taken on the device as it
leaves (one ``_foreach_norm`` per bucket and dtype: a tensor's norm does not depend on
the list it is in), and the total is computed as torch computes it, on the device.

A gradient added to its host copy by a second backward before the step has no device
norm (the sum exists on the host only): its norm is taken from the host copy there.  So
has one written in place since its norm was taken (clipped twice in one step, clamped by
value before the norm, or edited by user code where ``p.grad`` stays): each norm holds
the version counters of the tensors it was taken for (``key_of``), and a norm asked for
once they moved is taken again where the gradient is now (an offloaded one's from its
host copy: on a GPU that rounding is the CPU's, not torch's CUDA reduction's, which only
a norm taken before the gradient left could give).

With fp16 loss scaling the norms are of the scaled gradients, and a float16 gradient's
norm (``16-true``) overflows float16 once it passes 65504: a norm an fp16 run's clipping
reads as inf, clipping every gradient to zero (a one-rank ``fastopt_fsdp`` run, whose
norms are squared before they are summed, did so from its fourth step where
``fastopt`` did not, 2026-11-26).  So a float16 gradient's norm is taken in float32,
and every norm is unscaled (``grad_scale``, a power of two: exact) before the total,
which is then torch's norm of the unscaled gradients.
"""

from __future__ import annotations

from collections import defaultdict
from typing import TypeVar

import torch
from torch import Tensor

from lightning_fastopt.offload.slots import HostBucket, ParamSlot

K = TypeVar("K")


class DeviceGradNorms:
    """The per-tensor norms of one offload optimizer's gradients, taken on the device."""

    def __init__(self) -> None:
        self._leaving: dict[HostBucket, list[tuple[ParamSlot, Tensor]]] = defaultdict(list)
        self._norms: dict[ParamSlot, Tensor] = {}
        self._keys: dict[ParamSlot, tuple[int, ...]] = {}  # the version counters each norm was taken at

    def leaving(self, slot: ParamSlot, grad: Tensor) -> None:
        """``grad``, the slot's gradient on the device, is about to be copied to the host
        (kept here until its bucket's norms are taken)."""
        self._leaving[slot.bucket].append((slot, grad))

    def sent(self, slot: ParamSlot, key: tuple[int, ...]) -> None:
        """Every copy of the slot's gradient (and of whatever shares the host copies'
        version counters) is issued; ``key``: those counters now, which a norm taken on the
        device as it left (:meth:`leaving`) is of."""
        self._keys[slot] = key

    def added_on_host(self, slot: ParamSlot) -> None:
        """A second backward's gradient was added to the host copy: no device norm of the sum."""
        self._norms.pop(slot, None)
        pending = self._leaving.get(slot.bucket)
        if pending:
            self._leaving[slot.bucket] = [(s, g) for s, g in pending if s is not slot]

    def bucket_sent(self, bucket: HostBucket) -> None:
        """Every gradient of ``bucket`` is on its way: their norms, on the device, now."""
        self._take(dict(self._leaving.pop(bucket, [])))

    def clear(self) -> None:
        self._leaving.clear()
        self._norms.clear()
        self._keys.clear()

    def of(self, slots: list[ParamSlot], grad_of, key_of, grad_scale: float = 1.0) -> dict[ParamSlot, Tensor]:
        """Each slot's gradient norm, unscaled by ``grad_scale``, in the gradient's dtype
        (``grad_of``: where its whole gradient is now, read only where no norm holds;
        ``key_of``: the version counters of the tensors the step reads for it now): the
        one taken on the device where it still holds (nothing wrote the gradient since),
        else ``_foreach_norm`` where the gradient is (the device share's gradients,
        host-only sums, gradients written since)."""
        keys = {s: key_of(s) for s in slots}
        self._take({s: grad_of(s) for s in slots if s not in self._norms or self._keys.get(s) != keys[s]})
        self._keys.update(keys)
        return {s: unscaled_norm(self._norms[s], s.param.dtype, grad_scale) for s in slots}

    def _take(self, grads: dict[ParamSlot, Tensor]) -> None:
        """The norms of ``grads`` where they are (``_foreach_norm`` takes its fast path on
        lists of one device and dtype)."""
        for slots in by_device_and_dtype(grads).values():
            self._norms.update(zip(slots, norms_of([grads[s] for s in slots])))

    def total(self, param_groups, slot_of: dict[Tensor, ParamSlot], has_grad, grad_of, key_of,
              grad_scale: float = 1.0) -> Tensor:
        """The norm ``torch.nn.utils.get_total_norm`` takes of the parameters' gradients
        (every listing of a parameter that ``has_grad``, in the groups' order; :meth:`of` for
        each), grouped by dtype as torch groups them, the norm of the norms on the first one's device."""
        listed = [slot_of[p] for g in param_groups for p in g["params"]]
        listed = [s for s in listed if has_grad(s)]
        if not listed:
            return torch.tensor(0.0)
        norms = self.of(listed, grad_of, key_of, grad_scale)
        groups: dict[torch.dtype, list[Tensor]] = defaultdict(list)
        for s in listed:  # get_total_norm's grouping: by the gradients' dtype (the parameters'), as they appear
            groups[s.param.dtype].append(norms[s])
        device = listed[0].param.device
        return torch.linalg.vector_norm(torch.stack([n.to(device) for g in groups.values() for n in g]), 2.0)


def norms_of(grads: list[Tensor]) -> list[Tensor]:
    """``_foreach_norm`` of gradients of one dtype; float16 ones' in float32 (loss-scaled,
    their norm may pass float16's range)."""
    if grads[0].dtype == torch.float16:
        return torch._foreach_norm(grads, 2.0, dtype=torch.float32)
    return torch._foreach_norm(grads, 2.0)


def unscaled_norm(norm: Tensor, dtype: torch.dtype, grad_scale: float) -> Tensor:
    return (norm / grad_scale if grad_scale != 1.0 else norm).to(dtype)


def by_device_and_dtype(tensors: dict[K, Tensor]) -> dict[tuple[torch.device, torch.dtype], list[K]]:
    """The keys of ``tensors`` by their tensor's device and dtype, in order (as
    ``get_total_norm`` groups gradients)."""
    groups: dict[tuple[torch.device, torch.dtype], list[K]] = {}
    for key, t in tensors.items():
        groups.setdefault((t.device, t.dtype), []).append(key)
    return groups
