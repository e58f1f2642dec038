"""A whole (unsharded) Lightning checkpoint held in memory loaded into an FSDP2 model and its
optimizers, as Lightning's ``ModelParallelStrategy`` loads a full checkpoint file: the
weights through torch's ``set_model_state_dict`` (each rank keeps its shards), the optimizer
states, keyed by parameter name, through ``set_optimizer_state_dict``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from lightning.fabric.strategies.model_parallel import _load_raw_module_state

__all__ = ["load_full_state"]


def load_full_state(module: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer], checkpoint: dict[str, Any],
                    strict: bool = True) -> dict[str, Any]:
    """``checkpoint``'s ``state_dict`` into ``module`` and its ``optimizer_states`` into
    ``optimizers`` (by position; every rank holds the whole checkpoint); the rest returned."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    rest = dict(checkpoint)
    _load_raw_module_state(rest.pop("state_dict"), module, strict=strict)
    states = rest.get("optimizer_states", [])
    if len(states) != len(optimizers):
        raise ValueError(f"the checkpoint has {len(states)} optimizer state(s), this run has {len(optimizers)}")
    options = StateDictOptions(full_state_dict=True, strict=strict)
    for optimizer, state in zip(optimizers, states):
        # by name: our saved groups also list "param_names", which torch's loader takes for state to load
        groups = [{k: v for k, v in g.items() if k != "param_names"} for g in state["param_groups"]]
        set_optimizer_state_dict(module, optimizer, optim_state_dict={**state, "param_groups": groups},
                                 options=options)
    return rest
