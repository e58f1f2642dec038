"""Forward waits per FSDP unit: the next forward starts before the host shards' updates end.

With the parameter shards in host memory (``offload_parameters``, torch's
``CPUOffloadPolicy``) the CPU kernels update them in place, and FSDP reads a unit's rows
(copies them to the device, on a GPU) when it gathers them, just before the unit's
forward: the host shards are what the next forward reads.  With ``forward_waits="module"``
a step may end before its CPU updates (:mod:`~lightning_fastopt.offload.left_running`);
each unit's forward then waits on the host for the updates of its own rows and of the
units FSDP gathers ahead of it (``set_modules_to_forward_prefetch``), in a forward
pre-hook that runs before FSDP's own.  The updates the first units need run first
(their gradients landed last), and the first units compute while the later units' rows
are still being updated.

Everything else that reads the shards waits for every update: the optimizer's own reads
(the next step, ``zero_grad``, state dicts), the strategy before checkpoints and
evaluation, and the step itself for rows no unit gathers (a parameter no ``fully_shard``
manages).  What it cannot see is code gathering a unit by hand (``unshard()``) or reading
a shard between a step and the next forward; the strategy waits at the step where a hook
that runs there is overridden (:func:`~lightning_fastopt.trainer.grad_readers.weight_readers`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from torch import Tensor, nn

from lightning_fastopt.fsdp.host_parameters import param_groups_of

__all__ = ["UnitWaits"]


class UnitWaits:
    """A forward pre-hook on every module of ``model`` that ``fully_shard`` made a unit,
    ahead of FSDP's: it asks the engines ``engines()`` returns (their current ones) to wait
    for the rows of that unit's parameters and of the units it gathers ahead.
    ``covered``: the parameters of every unit (the sharded ones)."""

    def __init__(self, model: nn.Module, engines: Callable[[], Iterable[Any]]) -> None:
        from torch.distributed.fsdp import FSDPModule

        self.covered: set[Tensor] = set()
        self._handles = []
        for module in model.modules():
            if not isinstance(module, FSDPModule):
                continue
            state = module._get_fsdp_state()
            self.covered.update(_sharded_params(state))
            self._handles.append(module.register_forward_pre_hook(_Wait(state, engines), prepend=True))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


class _Wait:
    """The pre-hook of a unit's module (FSDP's state ``state``): the rows FSDP is about to
    gather, read when it runs (a prefetch set after set-up counts too)."""

    def __init__(self, state: Any, engines: Callable[[], Iterable[Any]]) -> None:
        self.state, self.engines = state, engines

    def __call__(self, module: nn.Module, args: Any) -> None:
        params = _sharded_params(self.state)
        for ahead in getattr(self.state, "_states_to_forward_prefetch", ()):
            params += _sharded_params(ahead)
        if params:
            for engine in self.engines():
                engine.wait_for_weights(params)


def _sharded_params(state: Any) -> list[Tensor]:
    """The sharded parameters (DTensors) of an FSDP2 state's groups."""
    return [fsdp_param.sharded_param for group in param_groups_of(state) for fsdp_param in group.fsdp_params]
