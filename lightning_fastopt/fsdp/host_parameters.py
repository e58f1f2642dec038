"""Parameters in host memory under FSDP2 (``offload_parameters=True``, issue 52).

torch's ``CPUOffloadPolicy`` keeps each sharded parameter (float32) and its gradient in
host memory: FSDP copies a unit's weights to the device just before its forward and
backward, and its reduce-scattered gradients back.  Under the FSDP strategies those host
shards are the master weights: :class:`~lightning_fastopt.fsdp.LocalShardOptimizer`'s
aliases are their storage, and the CPU kernels update them and the state beside them in
place, with nothing of the optimizer on the device and no second copy of the weights
(the optimizer's path is the CPU's own, on every machine; FSDP's copies are torch's).

What the strategies do for it here: apply the policy in the one-line form
(:func:`host_shard_arguments`), materialize a model built on the meta device in host
memory (:func:`materialize_on_the_host`; Lightning's ``ModelParallelStrategy``
materializes on the device, which FSDP then refuses), leave FSDP's parameters where
``fully_shard`` put them when moving the rest of the model to the device
(:func:`move_all_but_fsdp_parameters`), and check, before the optimizers are set up, that
the parameters are under the policy all together or not at all (:func:`host_sharded`).
Each host bucket's update may start as FSDP hands its gradients over in host memory
(``stream_cpu_step``: the offload optimizer's ``host_shards``), once FSDP's copy of them
has landed (:mod:`~lightning_fastopt.fsdp.gradient_landings`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["check_host_shards", "host_param_groups", "host_shard_arguments", "host_sharded",
           "materialize_on_the_host", "move_all_but_fsdp_parameters", "say_host_shards"]


def host_shard_arguments(offload_parameters: bool, device: torch.device, pin_memory: bool) -> dict[str, Any]:
    """``fully_shard``'s keyword arguments for the one-line form: torch's
    ``CPUOffloadPolicy`` (pinned host memory where the device is a GPU and ``pin_memory``)
    with ``offload_parameters``, else none."""
    if not offload_parameters:
        return {}
    from torch.distributed.fsdp import CPUOffloadPolicy

    return {"offload_policy": CPUOffloadPolicy(pin_memory=pin_memory and device.type == "cuda")}


def param_groups_of(state: Any) -> list[Any]:
    """The parameter groups (``FSDPParamGroup``) of one FSDP2 state: none where its modules
    hold no parameter themselves; more than one where ``shard_placement_fn`` puts
    parameters on meshes of their own (torch versions that keep a list)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    return [state._fsdp_param_group] if state._fsdp_param_group is not None else []


def _param_groups(model: nn.Module) -> Iterator[tuple[Any, bool]]:
    """FSDP2's parameter groups in ``model`` (``FSDPParamGroup``), each once, and whether it
    keeps its parameters in host memory (``CPUOffloadPolicy``)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

    states = {}  # (a state several modules share, fully_shard([a, b]), once)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            states.setdefault(id(state := module._get_fsdp_state()), state)
    for state in states.values():
        for group in param_groups_of(state):
            yield group, isinstance(group.offload_policy, CPUOffloadPolicy)


def host_param_groups(model: nn.Module) -> list[Any]:
    """FSDP2's parameter groups in ``model`` that keep their parameters in host memory."""
    return [group for group, on_host in _param_groups(model) if on_host]


def fsdp_parameters(model: nn.Module) -> dict[nn.Parameter, bool]:
    """Each parameter ``fully_shard`` manages in ``model``, and whether its group keeps it in
    host memory (``CPUOffloadPolicy``), read from FSDP2's state."""
    return {fsdp_param.sharded_param: on_host for group, on_host in _param_groups(model)
            for fsdp_param in group.fsdp_params}


def host_sharded(model: nn.Module) -> bool:
    """Whether ``fully_shard`` keeps ``model``'s parameters in host memory: True where every
    one it manages is under ``CPUOffloadPolicy``, False where none is; a ValueError where
    only some are (one optimizer steps them all, on the host or on the device)."""
    placed = fsdp_parameters(model)
    on_host = sum(placed.values())
    if 0 < on_host < len(placed):
        raise ValueError(f"{on_host} of the {len(placed)} parameters fully_shard manages are in host memory "
                         "(offload_policy=CPUOffloadPolicy()) and the others are not: shard every module with the "
                         "policy, or none")
    return bool(placed) and on_host == len(placed)


def check_host_shards(model: nn.Module, offload_parameters: bool) -> bool:
    """:func:`host_sharded`, with ``offload_parameters=True`` requiring it (a ``configure_model``
    must pass the policy to ``fully_shard``: the strategy cannot move shards afterwards)."""
    on_host = host_sharded(model)
    if offload_parameters and not on_host:
        raise ValueError("offload_parameters=True keeps the parameter shards in host memory, but fully_shard keeps "
                         "this model's on the device: the LightningModule's configure_model must pass "
                         "offload_policy=CPUOffloadPolicy() to each fully_shard call (the strategy applies it "
                         "itself only to a model without configure_model)")
    return on_host


def say_host_shards() -> None:
    """One line where the host shards are the masters: where the update runs, and that
    nothing is copied for it (on any machine; a CPU run's ``copy_on_cpu`` only lets it stream)."""
    rank_zero_info("lightning_fastopt: FSDP keeps the parameter shards and their gradients in host memory "
                   "(CPUOffloadPolicy): the CPU kernels update the shards in place, the master weights themselves; "
                   "nothing of the optimizer is copied or kept on the device")


def materialize_on_the_host(model: nn.Module) -> None:
    """The modules of ``model`` holding tensors on the meta device, made in host memory and
    initialized by their ``reset_parameters`` (as Lightning materializes a model on the device):
    ``CPUOffloadPolicy`` needs the shards on the host."""
    for module in model.modules():
        tensors = itertools.chain(module.parameters(recurse=False), module.buffers(recurse=False))
        if not any(t.is_meta for t in tensors):
            continue
        reset = getattr(module, "reset_parameters", None)
        if not callable(reset):
            raise TypeError(f"{type(module).__name__} was built on the meta device and has no reset_parameters(): "
                            "offload_parameters=True materializes a model in host memory module by module, which "
                            "needs it to initialize the module's parameters and buffers")
        module.to_empty(device="cpu", recurse=False)
        reset()


def move_all_but_fsdp_parameters(model: nn.Module, device: torch.device) -> None:
    """Buffers, and parameters no ``fully_shard`` manages (plain tensors), moved to
    ``device``; FSDP's parameters (DTensors) stay where it put them (on the device, or in
    host memory under ``CPUOffloadPolicy``).  A parameter held by several modules is moved once."""
    moved: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for key, buffer in module._buffers.items():
            if buffer is not None and buffer.device != device:
                module._buffers[key] = buffer.to(device)
        for key, param in module._parameters.items():
            if param is None or isinstance(param, DTensor) or param.device == device:
                continue
            if id(param) not in moved:
                moved[id(param)] = nn.Parameter(param.detach().to(device), requires_grad=param.requires_grad)
            module._parameters[key] = moved[id(param)]
