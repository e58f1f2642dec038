"""``fabric.load(DIR, state)`` of a directory DeepSpeed wrote: its model (the one module in
``state``) and optimizer (at most one) from DeepSpeed's masters and state
(:mod:`~lightning_fastopt.checkpoint.deepspeed_to_lightning`), the other keys of ``state``
from what the saver added, the fp16 loss scale to the run's plugin."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lightning.fabric.wrappers import _unwrap_objects

from lightning_fastopt.checkpoint.deepspeed_to_lightning import deepspeed_as_lightning

__all__ = ["load_deepspeed_directory"]


def load_deepspeed_directory(path, state: dict[str, Any], strict: bool, precision: Any, scaler_key: str,
                             load: Callable[[torch.nn.Module, dict[str, Any], list], dict[str, Any]]) -> dict[str, Any]:
    """Load the directory into ``state``: ``load(module, checkpoint, optimizers)`` loads the
    weights and optimizer states into the strategy's module and optimizers (as its own
    checkpoints load) and returns the rest; the loss scale under ``scaler_key`` goes to
    ``precision``.  What ``state`` asks for and the checkpoint lacks is an error where
    ``strict``; what the checkpoint holds beyond it is returned."""
    objects = _unwrap_objects(state)
    modules = [k for k, v in objects.items() if isinstance(v, torch.nn.Module)]
    optimizers = [k for k, v in objects.items() if isinstance(v, torch.optim.Optimizer)]
    if len(modules) != 1 or len(optimizers) > 1:
        raise ValueError(f"{path} is one DeepSpeed model with one optimizer: give fabric.load one module and at most "
                         f"one optimizer in the state (got {len(modules)} module(s), {len(optimizers)} optimizer(s))")
    module = objects[modules[0]]
    checkpoint = deepspeed_as_lightning(path, module, precision, scaler_key)
    if not optimizers:
        checkpoint["optimizer_states"] = []
    rest = load(module, checkpoint, [objects[k] for k in optimizers])
    rest.pop("optimizer_states", None)
    scale = rest.pop(scaler_key, None)
    if scale is not None:
        precision.load_state_dict(scale)
    for key in set(state) - set(modules) - set(optimizers):
        if key in rest:
            state[key] = rest.pop(key)
        elif strict:
            raise KeyError(f"fabric.load asked for {key!r}, which the DeepSpeed checkpoint {path} does not hold "
                           f"(it holds {sorted(rest)}); strict=False leaves it as it is")
    return rest
