"""A claim that an optimizer updates each parameter alone, checked at set-up (issue 74): the
user's class, with the user's hyper-parameters (each parameter group's) and attributes, is
stepped a few times on small synthetic tensors on the CPU, once over all of them and once
over each alone, from the same values and gradients; where any result differs, its step
combines parameters (a norm over every gradient, a step size estimated over all of them:
Prodigy's), and on the strategy's shares it would give other numbers than torch.  Nothing of
the user's model or optimizer is touched (its attributes are copied); what the class's step
does beyond its tensors (a count kept on the class, a log line) happens at set-up too.  The
cost is a few milliseconds."""

from __future__ import annotations

import copy
from typing import Any

import torch

from lightning_fastopt.optim.base import hyperparameters
from lightning_fastopt.optim.user_step import UserStepOptimizer, shared_methods

__all__ = ["SHAPES", "STEPS", "combines_parameters"]

SHAPES = ((4, 3), (5,), (3, 2))
"""The synthetic tensors' shapes: matrices and a vector, of different sizes."""
STEPS = 4


def combines_parameters(optimizer: torch.optim.Optimizer, ready: tuple[str, ...] = ()) -> str | None:
    """What differed between ``optimizer``'s class stepping the synthetic tensors together and
    each alone, or None where nothing did: after each step, and after each method its users
    call beyond torch's (:func:`~lightning_fastopt.optim.user_step.shared_methods`:
    schedule-free's ``eval()`` and ``train()``, which move the weights).  ``ready``: the
    methods a training loop calls before stepping (schedule-free's ``train()``), called on
    each instance first.  A class that cannot step them (its own requirements on shapes) is
    not judged: None."""
    cls = type(optimizer)
    try:  # the class's own attributes, copied: its objects are not touched
        attributes = copy.deepcopy(UserStepOptimizer(optimizer)._attributes)
    except Exception:  # noqa: BLE001 - attributes that cannot be copied: not judged here
        return None
    seen = []
    for group in optimizer.param_groups:
        settings = hyperparameters(group)
        if settings in seen:
            continue
        seen.append(settings)
        try:
            differed = _differs(cls, attributes, settings, dict(optimizer.defaults), ready)
        except Exception:  # noqa: BLE001 - a step that cannot run on these tensors is not judged here
            continue
        if differed is not None:
            return differed
    return None


def _runner(cls: type, attributes: dict[str, Any], settings: dict[str, Any], defaults: dict[str, Any],
            params: list[torch.Tensor]) -> torch.optim.Optimizer:
    runner = cls.__new__(cls)
    runner.__dict__.update(attributes)
    torch.optim.Optimizer.__init__(runner, [dict(settings, params=params)], defaults)
    return runner


def _differs(cls: type, attributes: dict[str, Any], settings: dict[str, Any],
             defaults: dict[str, Any], ready: tuple[str, ...]) -> str | None:
    generator = torch.Generator().manual_seed(0)
    together = [torch.randn(shape, generator=generator) for shape in SHAPES]
    alone = [t.clone() for t in together]
    # gradients that keep a direction (plus noise), as a loss being descended gives: a step size
    # estimated over all parameters (Prodigy's) grows then, and differs between the two
    base = [torch.randn(shape, generator=generator) for shape in SHAPES]
    grads = [[b + 0.1 * torch.randn(b.shape, generator=generator) for b in base] for _ in range(STEPS)]
    whole = _runner(cls, attributes, settings, defaults, together)
    each = [_runner(cls, attributes, settings, defaults, [t]) for t in alone]
    runners = [whole, *each]
    for name in ready:
        for runner in runners:
            getattr(runner, name)()
    for step, step_grads in enumerate(grads, 1):
        for t, a, g in zip(together, alone, step_grads):
            t.grad, a.grad = g.clone(), g.clone()
        for runner in runners:
            runner.step()
        differed = _compared(together, alone, f"after {step} step(s)")
        if differed is not None:
            return differed
    for name in (*shared_methods(cls), *ready):  # (ready last: schedule-free ends in train mode again)
        for runner in runners:
            getattr(runner, name)()
        differed = _compared(together, alone, f"after {STEPS} steps and {name}()")
        if differed is not None:
            return differed
    return None


def _compared(together: list[torch.Tensor], alone: list[torch.Tensor], when: str) -> str | None:
    for shape, t, a in zip(SHAPES, together, alone):
        if not torch.equal(t, a):
            gap = (t - a).abs().max().item()
            return (f"{when} on synthetic tensors with its settings, a {tuple(shape)} tensor stepped "
                    f"with others differs from it stepped alone (by up to {gap:.3g})")
    return None
