"""What FSDP holds on the accelerator of the units it is working on, for ``estimate_memory``.

FSDP2 gathers a unit's weights (each rank's rows all-gathered into the whole parameters,
in the parameters' dtype) just before the unit's forward, and again before its backward,
and frees them after (``reshard_after_forward``); a root unit keeps them from its forward
to its backward (FSDP does not reshard a root after forward).  The gather of the next unit
runs while one computes: in forward the next one's, in backward the previous one's (FSDP's
prefetch), so two non-root units are gathered at once.  A unit's gradients are whole until
its reduce-scatter hands each rank its rows: one unit's at a time.  So, on every rank,
about: the roots' weights, the two largest other units' weights, the largest unit's
gradients; with the rows in host memory (``offload_parameters``) the same, FSDP copying a
unit's rows to the device just before it gathers them.  Not counted: activations, the
reduce-scatter's and all-gather's own buffers (a rank's rows, a fraction of a unit), the
allocator's slack.

The units are those the strategies' one-line form makes
(:func:`~lightning_fastopt.fsdp.auto_shard.plan_units`: ``auto_wrap_policy`` classes, or
``min_num_params``).
"""

from __future__ import annotations

from torch import nn

from lightning_fastopt.fsdp.auto_shard import plan_units

__all__ = ["units_in_flight"]


def units_in_flight(model: nn.Module, classes: tuple[type, ...], min_num_params: int,
                    forward_runs: bool) -> tuple[int, int]:
    """Bytes of (weights, gradients) FSDP holds whole at once on each rank's accelerator for
    ``model`` sharded by the one-line form's policy (see the module's documentation)."""
    done: set[int] = set()
    roots, others, largest = 0, [], 0
    for unit in plan_units(model, classes, min_num_params, forward_runs=forward_runs):
        own = [p for m in unit.modules for p in m.parameters() if id(p) not in done]
        own = list({id(p): p for p in own}.values())  # a parameter two of its modules share, once
        done.update(id(p) for p in own)
        weights = sum(p.numel() * p.element_size() for p in own)
        largest = max(largest, sum(p.numel() * p.element_size() for p in own if p.requires_grad))
        if unit.root:
            roots += weights
        else:
            others.append(weights)
    return roots + sum(sorted(others, reverse=True)[:2]), largest
