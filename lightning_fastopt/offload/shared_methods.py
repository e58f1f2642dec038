"""A method of the user's optimizer beyond torch's interface, run on every share (issue 74).

Schedule-free optimizers ask their users to call ``optimizer.train()`` before training and
``optimizer.eval()`` before evaluating: each moves the weights between the point the
gradients are taken at and the average the model is evaluated at (``p.lerp_(z, ...)``),
and flips a flag in the groups.  Under an offload engine the optimizer's class runs on each
share of the masters (:class:`~lightning_fastopt.optim.user_step.UserStepOptimizer`), so
the call must reach each share's instance, with each bucket's masters and state resident
(a disk tier holds a few at a time), and the masters it moved must then reach the model's
weights, as a step's do.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_fastopt.offload.slots import remember_weights

__all__ = ["run_on_shares"]


@torch.no_grad()
def run_on_shares(opt, name: str, args: tuple, kwargs: dict[str, Any]) -> Any:
    """Run ``name`` on every share's instance of ``opt``'s (an
    :class:`~lightning_fastopt.offload.OffloadOptimizer`) class, between steps: the updates
    under way finished, a delayed update applied, masters the model's weights moved away
    from refreshed; then each master it moved copied to its weight.  Returns what the first
    share's call returned."""
    if name not in opt.shared_methods:
        raise AttributeError(f"{name!r} is not a method that {type(opt.optimizer).__name__} runs on every share "
                             f"(those: {', '.join(opt.shared_methods) or 'none'})")
    opt.schedule.wait()
    opt.apply_pending_update()
    opt.refresh_master_weights(only_changed=True)
    results, ran = [], set()
    for members in opt.layout.in_residence(opt.layout.slots):
        inner = opt.layout.inner_of(members[0])
        results.append(inner.run_method(name, args, kwargs))
        ran.add(id(inner))
        for s in members:
            if s.separate_master:
                s.weight().copy_(s.master)
        remember_weights(members)
    for inner in opt.layout.inners():  # shares with no parameters now: their flags alike
        if id(inner) not in ran:
            results.append(inner.run_method(name, args, kwargs))
    return results[0] if results else None
