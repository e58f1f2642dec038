"""How a fused optimizer's step gathers a parameter group into kernel calls (buckets).

A bucket is the parameters of one group that one kernel call updates: one device, one
step count (the optimizers that count steps share one step tensor per bucket; the others
tell a first step from a later one), and one kind of half copy written in the same pass
(``copies_to``), or none.  :func:`kernel_buckets` takes the parameters that have a
gradient (``p.grad``, or the optimizer's ``grad_source``), creates missing state, and
returns the buckets; step counts are not advanced here.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


@dataclass
class Bucket:
    """Parameters of one group that are updated by one kernel call."""

    params: list[Tensor]
    grads: list[Tensor]
    states: dict[str, list[Tensor]]
    step_tensor: Tensor | None = None  # the shared step count (optimizers that count steps)
    first: bool = False  # no state before this step (optimizers that do not count steps)
    step: int | Tensor = 1  # the step number after this update (a device tensor when capturable)
    copies: list[Tensor] | None = None  # tensors that receive the updated params (model-dtype copies)
    found_inf: Tensor | None = None  # a device flag: when set the kernels skip the update


@dataclass
class _Gathered:
    """One pass over a group: the parameters with a gradient, their gradients and state
    tensors, whose state was created now (``fresh``), the step tensor they share, and
    whether one bucket holds them all (``uniform``)."""

    params: list[Tensor]
    grads: list[Tensor]
    lists: dict[str, list[Tensor]]
    fresh: list[dict[str, Any]]
    shared: Tensor | None
    device: torch.device | None
    uniform: bool


def kernel_buckets(opt, group: dict[str, Any]) -> list[Bucket]:
    """The parameters of ``group`` that have gradients, in buckets of ``opt`` (a
    :class:`~lightning_fastopt.optim.base.FusedOptimizer`), creating missing state.

    Fast path (the common case): one device, every parameter either new or sharing the
    group's step tensor, and no parameter with state but without a gradient (its count
    must not move); one pass, one bucket.  Otherwise parameters are split by device and
    step count, and the parameters of a bucket are given a new shared tensor."""
    keys = opt._bucket_state_keys(group)
    got = _gather(opt, group, keys)
    if not got.params:
        return []
    if opt.counts_steps:
        shared = got.shared
        if got.uniform and (shared is None or not got.fresh or float(shared) == 0.0):
            if shared is None:  # every parameter is new
                shared = opt._new_step_tensor(0.0, got.device)
            for st in got.fresh:
                st["step"] = shared
            return [Bucket(got.params, got.grads, got.lists, step_tensor=shared, copies=_copies(opt, got.params))]
        for st in got.fresh:
            st["step"] = opt._new_step_tensor(0.0, got.device)
        return split_buckets(opt, got.params, got.grads, keys)
    if got.uniform and (not got.fresh or len(got.fresh) == len(got.params)):
        return [Bucket(got.params, got.grads, got.lists, first=bool(got.fresh), copies=_copies(opt, got.params))]
    return split_buckets(opt, got.params, got.grads, keys, {id(st) for st in got.fresh})


def _gather(opt, group: dict[str, Any], keys: tuple[str, ...]) -> _Gathered:
    state_of, counts, source = opt.state, opt.counts_steps, opt.grad_source
    got = _Gathered([], [], {k: [] for k in keys}, [], None, None, True)
    copy_kinds = set()
    for p in _once_each(group["params"]):
        g = p.grad if source is None else source.get(p)
        if g is None:
            if counts and got.uniform and state_of.get(p):
                got.uniform = False  # it may share the step tensor that the others advance
            continue
        if g.layout is not torch.strided:
            raise ValueError(f"{type(opt).__name__} does not support sparse gradients: "
                             f"{_describe(opt.param_groups, p)} got one")
        st = state_of[p]
        if not st:
            opt._init_state(group, p, st)
            got.fresh.append(st)
        elif counts:
            step_t = st["step"]
            if got.shared is None and isinstance(step_t, Tensor):
                got.shared = step_t
            elif step_t is not got.shared:
                got.uniform = False
        if got.device is None:
            got.device = p.device
        elif p.device != got.device:
            got.uniform = False
        copy_kinds.add(_copy_kind(opt, p))
        if len(copy_kinds) > 1:
            got.uniform = False  # one kernel call writes one kind of copy, or none
        got.params.append(p)
        got.grads.append(g)
        for k in keys:
            got.lists[k].append(st[k])
    return got


def split_buckets(opt, params, grads, keys, fresh_ids=frozenset()) -> list[Bucket]:
    """The general case: buckets by device and step count (or first-step-ness; ``fresh_ids``:
    the ids of the state dicts created by this step)."""
    buckets: dict[tuple, Bucket] = {}
    for p, g in zip(params, grads):
        st = opt.state[p]
        if opt.counts_steps:
            step_t = st["step"]
            value = float(step_t)
            key = (p.device, value, _copy_kind(opt, p))
        else:
            key = (p.device, id(st) in fresh_ids, _copy_kind(opt, p))
        b = buckets.get(key)
        if b is None:
            b = buckets[key] = Bucket([], [], {k: [] for k in keys}, first=not opt.counts_steps and key[1])
            if opt.counts_steps:
                # a new tensor: the old one may be shared with parameters not stepped now
                b.step_tensor = opt._new_step_tensor(value, p.device)
        if opt.counts_steps:
            st["step"] = b.step_tensor  # parameters at the same count share one tensor
        b.params.append(p)
        b.grads.append(g)
        for k in keys:
            b.states[k].append(st[k])
    out = list(buckets.values())
    for b in out:
        b.copies = _copies(opt, b.params)
    return out


def repeat_buckets(opt, group: dict[str, Any], done: list[Bucket]) -> Iterator[Bucket]:
    """The further kernel calls of ``opt``'s parameters listed more than once in a group,
    after the step's first pass (``done``: its buckets).  torch warns about such a list,
    and its per-parameter loop (the default on the CPU) updates the parameter once per
    listing with the same gradient, one update after the other.  So here: a parameter listed n times gets n - 1 more
    updates, each advancing its own step count (it no longer shares one with the rest
    of its group).  For optimizers that count no steps the repeats start as the first
    update did (torch's SGD initialises the momentum buffer from the gradient at every
    listing of the first step).  torch's foreach implementation (its default for CUDA
    tensors) does something else again; this follows the loop."""
    params = group["params"]
    if len(set(params)) == len(params):
        return
    times: dict[Tensor, int] = {}
    for p in params:
        times[p] = times.get(p, 0) + 1
    stepped = {p: (g, b.first) for b in done for p, g in zip(b.params, b.grads)}
    keys = opt._bucket_state_keys(group)
    for round_ in range(1, max(times.values())):
        again = [p for p, n in times.items() if n > round_ and p in stepped]
        first = {id(opt.state[p]) for p in again if stepped[p][1]}
        yield from split_buckets(opt, again, [stepped[p][0] for p in again], keys, first)


def _copy_kind(opt, param: Tensor) -> torch.dtype | None:
    """The dtype of the copy a step writes for ``param`` (``copies_to``), or None."""
    copy = (opt.copies_to or {}).get(param)
    return None if copy is None else copy.dtype


def _copies(opt, params: list[Tensor]) -> list[Tensor] | None:
    targets = opt.copies_to
    if not targets:
        return None
    copies = [targets.get(p) for p in params]
    if all(c is None for c in copies):
        return None
    if any(c is None for c in copies):
        raise ValueError("copies_to must name a copy for every parameter of a bucket, or none")
    return copies


def _describe(groups: list[dict[str, Any]], p: Tensor) -> str:
    """A parameter in words for an error: its name when the groups carry torch's
    ``param_names``, else its position, and its shape."""
    for gi, group in enumerate(groups):
        for i, q in enumerate(group["params"]):
            if q is p:
                names = group.get("param_names")
                where = repr(names[i]) if names else f"parameter {i} of group {gi}"
                return f"{where} (shape {tuple(p.shape)})"
    return f"a parameter of shape {tuple(p.shape)}"


def _once_each(params: list[Tensor]) -> list[Tensor]:
    """The parameters of a group in order, each once (torch accepts duplicates, with a warning)."""
    return params if len(set(params)) == len(params) else list(dict.fromkeys(params))
