"""What an optimizer's own code keeps beside its parameters' state, across the shares that
run it (issue 74).

A class the kernels do not cover runs on each share of the masters as an instance of its
own (:class:`~lightning_fastopt.optim.user_step.UserStepOptimizer`).  Torch's classes keep
everything in ``state[param]``; others keep more:

- **in their parameter groups**: schedule-free's ``k``, ``weight_sum``, ``lr_max`` and
  ``train_mode``, pytorch-optimizer's ``group["step"]``.  The user's settings (where LR
  schedulers write) are copied into every share before it steps; a key the class's own code
  has written (its step, or a method such as ``train()``) is the share's own from then on,
  not copied over, and what the code writes is written back to the user's groups, where
  torch's run would have it (logging, checkpoints).  :class:`GroupKeys`, one per user
  optimizer, shared by its shares.
- **under keys that are not parameters**: pytorch-optimizer's MADGRAD counts its steps in
  ``self.state["k"]``.  Each share counts alike; :func:`own_state` reads them, saved in the
  state dict's ``"state"`` under the same key, as torch saves it.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from lightning_fastopt.optim.base import hyperparameters

__all__ = ["GroupKeys", "own_state", "put_own_state"]


class GroupKeys:
    """The group keys the class's own code writes, learnt as it writes them, and the user's
    groups they are written back to; a lock makes a share's copy and another's write-back
    (on the update worker) one after the other."""

    def __init__(self, user_groups: list[dict[str, Any]]) -> None:
        self.user_groups = user_groups  # the user's very dicts (the list may grow: add_param_group)
        self.written: set[str] = set()
        self._lock = threading.Lock()

    def settings_into(self, share_groups: list[dict[str, Any]], groups: list[dict[str, Any]]) -> None:
        """``groups``' settings into the share's groups, but for the keys the class writes."""
        with self._lock:
            for mine, theirs in zip(share_groups, groups):
                mine.update({k: v for k, v in hyperparameters(theirs).items() if k not in self.written})

    def before(self, share_groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The share's groups' values, to tell afterwards which the class's code wrote."""
        return [hyperparameters(g) for g in share_groups]

    def note(self, share_groups: list[dict[str, Any]], before: list[dict[str, Any]]) -> None:
        """The keys the class's code changed in the share's groups since ``before``: its own
        from now on, and written back to the user's groups."""
        with self._lock:
            for i, (group, was) in enumerate(zip(share_groups, before)):
                for k, v in hyperparameters(group).items():
                    if k in was and _same(was[k], v):
                        continue
                    self.written.add(k)
                    if i < len(self.user_groups):
                        self.user_groups[i][k] = v

    def put_back(self, share_groups: list[dict[str, Any]], before: list[dict[str, Any]]) -> None:
        """The share's groups as they were (a speculated update undone), and the user's too."""
        with self._lock:
            for i, (group, was) in enumerate(zip(share_groups, before)):
                for k in [k for k in hyperparameters(group) if k not in was]:
                    del group[k]
                group.update(was)
                if i < len(self.user_groups):
                    user = self.user_groups[i]
                    for k in self.written:
                        if k in was:
                            user[k] = was[k]
                        else:
                            user.pop(k, None)

    def saved(self, groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Each group's keys that the class writes, as the user's groups hold them (for a
        state dict: the shares' groups beside the user's may hold older values)."""
        with self._lock:
            return [{k: g[k] for k in self.written if k in g} for g in self.user_groups[:len(groups)]]


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return isinstance(a, Tensor) and isinstance(b, Tensor) and a.shape == b.shape and torch.equal(a, b)
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - values that cannot be compared: taken as written
        return False


def own_state(state: Mapping[Any, Any]) -> dict[Any, Any]:
    """The entries of an optimizer's ``state`` not keyed by a parameter (MADGRAD's ``"k"``)."""
    return {k: v for k, v in state.items() if not isinstance(k, Tensor)}


def put_own_state(state: dict[Any, Any], saved: Mapping[Any, Any]) -> None:
    """``saved``'s entries into ``state``, each tensor a copy of its own (each share counts
    its steps in its own, in place)."""
    for k in [k for k in state if not isinstance(k, Tensor)]:
        del state[k]
    for k, v in saved.items():
        state[k] = v.detach().clone() if isinstance(v, Tensor) else v
