"""Where an offload optimizer's masters and state are, as one table: the device's share,
the host buckets kept in host memory and those on disk (issue 72: with
``offload_fraction="auto"`` and ``host_state_gib="auto"`` the fraction and the split are
chosen one after the other, the accelerator first, then host memory, then the disk; this is
the plan they make together)."""

from __future__ import annotations

from types import SimpleNamespace

from lightning_fastopt.offload.file_regions import planned_bytes
from lightning_fastopt.runtime.byte_sizes import readable_bytes

__all__ = ["state_places"]


def state_places(opt) -> str:
    """The table of ``opt``'s (an :class:`~lightning_fastopt.offload.OffloadOptimizer`)
    masters and state: for the device, host memory and the disk, the tensors (or pieces),
    their elements and the bytes of their masters (where apart) and state once it exists."""
    tier = opt.layout.tier
    in_host = getattr(tier, "in_host", None)
    on_disk = getattr(tier, "disk", tier if tier.on_disk else None)
    places = {"device": [SimpleNamespace(inner=opt.layout.device_inner, slots=opt.layout.device_slots)],
              "host memory": [], "disk": []}
    for bucket in opt.layout.buckets:
        kept = bucket in in_host if in_host is not None else on_disk is None
        places["host memory" if kept else "disk"].append(bucket)
    rows = [f"{'':14s}{'tensors':>9s}{'elements':>15s}{'bytes':>12s}"]
    for place, shares in places.items():
        slots = [s for share in shares for s in share.slots]
        nbytes = sum(planned_bytes(share) for share in shares)
        rows.append(f"{place:14s}{len(slots):>9,}{sum(s.numel for s in slots):>15,}{readable_bytes(nbytes):>12s}")
    return "\n".join(rows)
