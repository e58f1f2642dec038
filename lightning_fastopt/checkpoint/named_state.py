"""Optimizer state as a plain, portable, torch-compatible dictionary keyed by parameter name.

Saved form (what ``OffloadOptimizer.state_dict()`` returns and Lightning writes)::

    {"state": {"layer.weight": {"step": tensor(10.), "exp_avg": ..., ...}, ...},
     "param_groups": [{"lr": ..., ..., "params": ["layer.weight", ...],
                       "param_names": ["layer.weight", ...]}, ...]}

Only tensors, numbers, strings and containers: it loads with ``torch.load(weights_only=True)``.
``torch.optim`` optimizers load it as they load their own (they match parameters by
position within each group), and a state dict written by ``torch.optim`` (integer keys)
loads here by the same rule.  Whatever the offload fraction or the device of each
parameter, the dictionary is the same, so a checkpoint resumes with any other fraction.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_fastopt.optim.base import hyperparameters


class CheckpointMismatchError(ValueError):
    """The optimizer state in a checkpoint does not belong to this model."""


# Hyperparameters that tell the update rules apart (a group of one optimizer has them, one
# of another lacks them).  Not: what every rule has (lr, weight_decay, maximize), torch's
# implementation switches, and switches that only extend a rule and default to it
# (FusedAdam's bias_correction, FusedSGD's wd_after_momentum), so torch's Adam, AdamW and
# FusedAdam, or torch's SGD and FusedSGD, resume from each other's checkpoints.
_RULE_KEYS = frozenset({"betas", "eps", "amsgrad", "momentum", "dampening", "nesterov", "lr_decay",
                        "initial_accumulator_value", "adam_w_mode", "grad_averaging", "max_grad_norm", "use_nvlamb",
                        "eeta", "epsilon"})


def named_state_dict(groups: Sequence[dict[str, Any]], names: Sequence[Sequence[str]],
                     state: Mapping[str, dict[str, Any]]) -> dict[str, Any]:
    """The saved form from the live groups, the parameter names of each group and the
    state of each named parameter (parameters without state are left out, as torch does)."""
    saved_groups = []
    for group, group_names in zip(groups, names):
        saved_groups.append({**hyperparameters(group), "params": list(group_names),
                             "param_names": list(group_names)})
    saved_state = {}
    for group_names in names:
        for name in group_names:
            st = state.get(name)
            if st:
                # each parameter gets its own step tensor, as torch.optim keeps them
                saved_state[name] = {k: v.detach().clone() if k == "step" and isinstance(v, Tensor) else v
                                     for k, v in st.items()}
    return {"state": saved_state, "param_groups": saved_groups}


def read_named_state(saved: Mapping[str, Any], names: Sequence[Sequence[str]],
                     shapes: Mapping[str, torch.Size], groups: Sequence[Mapping[str, Any]] = (),
                     moments_shaped: bool = True) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """Check a saved optimizer state against this model and key it by parameter name.

    Returns (state by name, hyperparameters of each group).  Parameters are matched by
    name when the checkpoint has names (ours, or torch's ``param_names``) and by position
    within each group otherwise (a plain torch.optim state dict).  Raises
    :class:`CheckpointMismatchError` when groups, names or shapes differ, or when the
    saved groups are those of another update rule than ``groups`` (the live ones).
    ``moments_shaped``: every state tensor but a scalar is shaped as its parameter (torch's
    and our kernels' optimizers), so one shaped otherwise is another model's; False for a
    class whose own step keeps state of other shapes (Adafactor's factored moments,
    bitsandbytes' quantization blocks), whose shapes are its own business.
    """
    if not isinstance(saved, Mapping) or "state" not in saved or "param_groups" not in saved:
        raise CheckpointMismatchError("not an optimizer state dict (expected the keys 'state' and 'param_groups')")
    saved_groups = saved["param_groups"]
    if len(saved_groups) != len(names):
        raise CheckpointMismatchError(
            f"the checkpoint's optimizer has {len(saved_groups)} parameter group(s), this one has {len(names)}: "
            "the checkpoint was written for a different model or optimizer configuration")
    for gi, (sg, group) in enumerate(zip(saved_groups, groups)):
        theirs, ours = _RULE_KEYS & set(sg), _RULE_KEYS & set(group)
        if theirs != ours:
            raise CheckpointMismatchError(
                f"parameter group {gi}: the checkpoint's optimizer state was written by another optimizer (its "
                f"groups have {_few(sorted(theirs - ours), 6)}; this optimizer's have {_few(sorted(ours - theirs), 6)}): "
                "resume with the optimizer that wrote it, or load the weights alone")
    key_to_name: dict[Any, str] = {}
    for gi, (sg, group_names) in enumerate(zip(saved_groups, names)):
        keys = list(sg["params"])
        saved_names = sg.get("param_names") or (keys if all(isinstance(k, str) for k in keys) else None)
        if saved_names is not None:
            missing = [n for n in group_names if n not in set(saved_names)]
            unexpected = [n for n in saved_names if n not in set(group_names)]
            if missing or unexpected:
                raise CheckpointMismatchError(
                    f"parameter group {gi}: the checkpoint's optimizer state is for other parameters "
                    f"(missing here: {_few(missing)}; not in this model: {_few(unexpected)})")
            key_to_name.update(zip(keys, saved_names))
        else:
            if len(keys) != len(group_names):
                raise CheckpointMismatchError(
                    f"parameter group {gi}: the checkpoint has {len(keys)} parameters, this model {len(group_names)}")
            key_to_name.update(zip(keys, group_names))
    by_name: dict[str, dict[str, Any]] = {}
    for key, st in saved["state"].items():
        if key not in key_to_name:
            raise CheckpointMismatchError(f"the checkpoint has optimizer state for {key!r}, which no group lists")
        name = key_to_name[key]
        for k, v in st.items():
            if moments_shaped and isinstance(v, Tensor) and v.dim() > 0 and v.shape != shapes[name]:
                raise CheckpointMismatchError(
                    f"optimizer state {k!r} of parameter {name!r} has shape {tuple(v.shape)} in the checkpoint, "
                    f"the parameter has shape {tuple(shapes[name])}: the checkpoint is from a different model")
        by_name[name] = dict(st)
    return by_name, [hyperparameters(sg) for sg in saved_groups]


def _few(items: list[str], n: int = 3) -> str:
    if not items:
        return "none"
    shown = ", ".join(repr(i) for i in items[:n])
    return shown + (f" and {len(items) - n} more" if len(items) > n else "")
