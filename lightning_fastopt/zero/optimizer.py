"""ZeroOptimizer: ZeRO stages 1 and 2, optimizer state and master weights (and, at stage 2,
gradients) sharded across ranks.

Every data-parallel rank holds the whole model and (after DDP's all-reduce) the whole
averaged gradient, but only the ranks that own a parameter
(:func:`~lightning_fastopt.zero.partition.assign_owners`) keep its fp32 master and
optimizer state and update it, in an :class:`~lightning_fastopt.offload.OffloadOptimizer`
over the owned parameters (so a rank's shard can itself be offloaded to the CPU).  After
the update each owner broadcasts its parameters to the others, in buckets of about
``bucket_size_mb``.  Per rank, Adam's 12 bytes of state and masters per parameter become
12/N.

Stage 2 (``stage=2``, no DDP wrapper) also shards the gradients: a
:class:`~lightning_fastopt.zero.grad_reducer.GradReducer` sums each bucket of gradients
into its owner during backward and the other ranks free theirs, so a rank keeps the
gradients of its own shard (plus the bucket being filled).  As each reduction lands on
its owner, the owner's offload optimizer is told (``device_grads="copy_when_reduced"``):
offloaded gradients leave for the host during backward, and with ``stream_cpu_step``
their buckets' CPU updates start there (speculated with ``speculate``: the overflow flag,
the clipping norm and LAMB's global norm, shared over the ranks, are checked at the step).

The user's ``param_groups`` dicts are shared as everywhere in lightning_fastopt (LR
schedulers work); the state dict of a rank holds its shard, keyed by parameter name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch import Tensor
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from typing_extensions import override

from lightning_fastopt.checkpoint.named_state import read_named_state
from lightning_fastopt.offload.engine_state import split_beside_parameters
from lightning_fastopt.offload import OffloadOptimizer
from lightning_fastopt.offload.grad_norms import by_device_and_dtype
from lightning_fastopt.offload.local_wrapper import LocalOffloadWrapper
from lightning_fastopt.runtime.distributed import all_reduce_scalar, all_reduce_sum, global_rank, world_size
from lightning_fastopt.functional import grads_all_finite, square_sums
from lightning_fastopt.optim.base import (COMPUTE, FusedOptimizer, copy_hyperparameters, hyperparameters,
                                          needs_step_context)
from lightning_fastopt.optim.user_step import UserStepOptimizer
from lightning_fastopt.zero.grad_reducer import GradReducer
from lightning_fastopt.zero.partition import assign_owners, owner_buckets


_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]  # a gradient norm's, coded by position


class ZeroOptimizer(LocalOffloadWrapper):
    """Args:
        optimizer: the fused optimizer with every parameter (the user's groups).
        param_names: a name for each parameter (state dicts are keyed by them).
        stage: 1 (gradients all-reduced by DDP beforehand) or 2 (gradients reduced to their
            owner here, from backward hooks; the module must not be wrapped in DDP).
        process_group: the data-parallel group (default: the whole world).
        offload_fraction, bucket_size_mb, overlap, pin_memory, device_grads,
        wall_clock_breakdown, copy_on_cpu, stream_cpu_step, speculate, reduced_by,
        offload_optimizer_device, nvme_path, nvme_window_mb, host_state_gib, host_reserve_gib,
        processes_per_host, step_cores: for this rank's
        :class:`~lightning_fastopt.offload.OffloadOptimizer`.  At stage 2 across ranks,
        ``device_grads="copy_in_backward"`` copies the owned gradients as their
        reductions land (``"copy_when_reduced"``), ``"copy_at_step"`` when the step starts,
        and ``"keep"`` is refused: the other ranks' gradients are freed during backward
        (stage 1 keeps every gradient, as DDP does).  None (the default):
        ``"copy_at_step"`` at stage 1, ``"copy_in_backward"`` at stage 2.  At stage 1
        ``reduced_by`` says which gradients DDP's reductions hand over during backward
        (:meth:`grad_reduced`, from :class:`~lightning_fastopt.core.ddp_reductions.DDPReductions`),
        which ``stream_cpu_step`` needs there with several processes.
    """

    shards_gradients = True  # gradients() holds this rank's shard: norms and overflow flags are reduced over ranks

    def __init__(self, optimizer: FusedOptimizer, param_names: Mapping[Tensor, str] | None = None, *,
                 stage: int = 1, process_group=None, offload_fraction: float = 0.0, bucket_size_mb: float = 64.0,
                 overlap: bool = True, pin_memory: bool = True, device_grads: str | None = None,
                 wall_clock_breakdown: bool = False, copy_on_cpu: bool = False, stream_cpu_step: bool = False,
                 speculate: bool = False, reduced_by: Callable[[Tensor], bool] | None = None,
                 offload_optimizer_device: str = "cpu", nvme_path: str | None = None,
                 nvme_window_mb: float | None = None, host_state_gib: float | str | None = None,
                 host_reserve_gib: float | None = None, processes_per_host: int = 1,
                 step_cores: tuple[int, ...] | None = None) -> None:
        super().__init__(optimizer)
        if isinstance(stage, bool) or stage not in (1, 2):
            raise ValueError(f"stage must be 1 or 2, got {stage!r}")
        if device_grads is None:
            device_grads = "copy_at_step" if stage == 1 else "copy_in_backward"
        if stage == 2 and device_grads == "keep":
            raise ValueError("device_grads='keep' needs stage=1: stage 2 frees the gradients other ranks own "
                             "during backward")
        self.stage = stage
        self.group = process_group
        self.world_size = world_size(process_group)
        if stage == 1 and self.world_size > 1 and device_grads == "copy_in_backward":
            raise ValueError("device_grads='copy_in_backward' at stage 1 would copy each gradient before DDP has "
                             "reduced it: give 'copy_at_step' (the default) or 'keep'; stage=2 reduces during "
                             "backward itself (and may stream the CPU step into it)")
        self.rank = dist.get_rank(process_group) if self.world_size > 1 else 0
        if self.world_size == 1:
            rank_zero_info(f"lightning_fastopt: ZeRO stage {stage} has nothing to shard with one process: this rank "
                           "keeps every master and all optimizer state (as without ZeRO)")
        # each parameter once (torch warns about one listed twice in a group; the owner's
        # offload optimizer steps it once per listing)
        self._params = list(dict.fromkeys(p for g in self.param_groups for p in g["params"]))
        self.param_names = dict(param_names or {})
        for i, p in enumerate(self._params):
            self.param_names.setdefault(p, f"param{i}")
        self.owners = assign_owners([p.numel() for p in self._params], self.world_size)
        owned = {p for p, o in zip(self._params, self.owners) if o == self.rank}
        shard = optimizer.sibling([[p for p in g["params"] if p in owned] for g in self.param_groups])
        for p in owned:  # state the wrapped optimizer had moves with its parameter
            if optimizer.state.get(p):
                shard.state[p] = optimizer.state[p]
        optimizer.state.clear()
        self._bucket_bytes = int(bucket_size_mb * 2**20)
        self.reducer = (GradReducer(self._params, self.owners, self.rank, self.world_size, self._bucket_bytes,
                                    process_group, on_reduced=self._reduced)
                        if stage == 2 and self.world_size > 1 else None)  # one rank: nothing to reduce
        local_grads = device_grads
        if self.reducer is not None:
            local_grads = "copy_when_reduced" if device_grads == "copy_in_backward" else "copy_at_step"
            reduced_by = self.reducer.hooked
        self.local = OffloadOptimizer(shard, self.param_names, offload_fraction=offload_fraction,
                                      bucket_size_mb=bucket_size_mb, overlap=overlap, pin_memory=pin_memory,
                                      device_grads=local_grads, wall_clock_breakdown=wall_clock_breakdown,
                                      copy_on_cpu=copy_on_cpu, stream_cpu_step=stream_cpu_step, speculate=speculate,
                                      reduced_by=reduced_by, offload_optimizer_device=offload_optimizer_device,
                                      nvme_path=nvme_path, nvme_window_mb=nvme_window_mb,
                                      host_state_gib=host_state_gib, host_reserve_gib=host_reserve_gib,
                                      processes_per_host=processes_per_host, step_cores=step_cores)
        self._broadcast_buckets = owner_buckets(self._params, self.owners, self._bucket_bytes)
        self._ready = True

    @override
    def _adopt_group(self, group: dict[str, Any]) -> None:
        """The new parameters get owners by the same rule (the same on every rank); this
        rank's share joins its offload optimizer as a new group."""
        new = list(dict.fromkeys(group["params"]))
        for i, p in enumerate(new, start=len(self._params)):
            self.param_names.setdefault(p, f"param{i}")  # the offload optimizer reads this mapping
        owners = assign_owners([p.numel() for p in new], self.world_size)
        self._params += new
        self.owners += owners
        owner_of = dict(zip(new, owners))
        if self.reducer is not None:  # first: the local optimizer counts the gradients its hooks will hand over
            self.reducer.add_params(new, owners)
        self.local.add_param_group(dict(hyperparameters(group),
                                        params=[p for p in group["params"] if owner_of[p] == self.rank]))
        self._broadcast_buckets = owner_buckets(self._params, self.owners, self._bucket_bytes)

    def grad_reduced(self, param: Tensor, grad: Tensor | None = None) -> None:
        """Stage 1: DDP's averaged gradient of ``param`` (handed over as its bucket's
        all-reduce completed); this rank's offload optimizer takes those it owns."""
        if self.local.owns(param):
            self._reduced([param], [grad])

    def _reduced(self, params: list[Tensor], grads: list[Tensor | None] | None = None) -> None:
        """A reduction landed on this rank, the owner, during backward or at the step: its
        offload optimizer takes the gradients, with the hyperparameters the user's groups
        hold now (an update it starts during backward uses them; the step checks they held)."""
        copy_hyperparameters(self.local.optimizer, self.param_groups)
        for p, g in zip(params, grads or [None] * len(params)):
            self.local.grad_reduced(p, g)

    @LocalOffloadWrapper.accumulating.setter
    def accumulating(self, value: bool) -> None:
        """Set while Lightning accumulates gradients: nothing is communicated or copied."""
        LocalOffloadWrapper.accumulating.fset(self, value)
        if self.reducer is not None:
            self.reducer.accumulating = value

    # ------------------------------------------------------------------ what users read
    @property
    def owned_numel(self) -> int:
        return sum(p.numel() for p, o in zip(self._params, self.owners) if o == self.rank)

    def owns(self, param: Tensor) -> bool:
        return self.local.owns(param)

    def state_of(self, param: Tensor) -> dict[str, Any]:
        """The optimizer state of a parameter this rank owns (empty for the others)."""
        return self.local.state_of(param) if self.local.owns(param) else {}

    def partition(self) -> dict[str, int]:
        """The owning rank of each parameter, by name."""
        return {self.param_names[p]: o for p, o in zip(self._params, self.owners)}

    # ------------------------------------------------------------------ gradients and step
    def gradients(self) -> list[Tensor]:
        """The gradients this rank's step reads: those of the parameters it owns.  Overflow
        checks and norms over them are combined across ranks (``shards_gradients``)."""
        if self.reducer is not None:
            self.reducer.finish()  # once per backward
        return self.local.gradients()

    @override
    def gradient_norm(self, grad_scale: float = 1.0) -> Tensor:
        """The norm ``get_total_norm`` takes of the unsharded gradients, in the same bits:
        each owner takes the norms of its own gradients as ``get_total_norm`` does (torch's
        ``_foreach_norm`` on the device, an offloaded gradient's before it left:
        :meth:`OffloadOptimizer.gradient_norms_by_param`), and the norms of every rank,
        stacked in the parameters' order, are normed on the parameters' device, as there
        (each unscaled by ``grad_scale`` first)."""
        grads = self._owned_gradients()
        by_param = self.local.gradient_norms_by_param(grad_scale)
        values: dict[Tensor, tuple[float, float]] = {}
        for (_, dtype), params in by_device_and_dtype(grads).items():
            norms = torch.stack([by_param[p].to("cpu") for p in params]).to(torch.float64)
            code = float(_DTYPES.index(dtype))  # _foreach_norm keeps the tensors' dtype
            values.update((p, (n, code)) for p, n in zip(params, norms.tolist()))
        norms = [torch.tensor(n, dtype=_DTYPES[int(code)]) for n, code in self._gathered(values, 2)]
        if not norms:
            return torch.tensor(0.0)
        return torch.linalg.vector_norm(torch.stack(norms).to(self._params[0].device), 2.0)

    def _owned_gradients(self) -> dict[Tensor, Tensor]:
        """The gradients this rank's step reads, by parameter (stage 2: once reduced)."""
        if self.reducer is not None:
            self.reducer.finish()  # once per backward
        return self.local.gradients_by_param()

    def _gathered(self, values: dict[Tensor, tuple[float, ...]], width: int) -> list[tuple[float, ...]]:
        """Each rank's ``values`` (``width`` numbers for some of the parameters it owns),
        every rank's in the parameters' order: a table with one column per parameter, each
        column nonzero on its owner only, summed over the ranks (exactly)."""
        column = {p: i for i, p in enumerate(self._params)}
        table = torch.zeros(width + 1, len(self._params), dtype=torch.float64)
        if values:
            at = torch.tensor([column[p] for p in values])
            table[0, at] = 1.0
            table[1:, at] = torch.tensor(list(values.values()), dtype=torch.float64).T
        table = all_reduce_sum(table, group=self.group)
        present = table[0] > 0
        return [tuple(col) for col in table[1:, present].T.tolist()]

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        if self.reducer is not None:
            self.reducer.reset()  # first: the local optimizer counts the gradients its hooks will hand over
        self.local.zero_grad(set_to_none)

    def _take_step(self, grad_scale, check_finite: bool, step_context: Any) -> bool:
        copy_hyperparameters(self.local.optimizer, self.param_groups)
        if self.reducer is not None:
            self.reducer.finish()  # the reductions still in flight land
        if check_finite:
            finite = grads_all_finite(self.gradients())
            if all_reduce_scalar(0.0 if finite else 1.0, group=self.group) > 0:  # an overflow anywhere skips everywhere
                self.local.zero_grad()
                return True
        context = None if step_context is COMPUTE else step_context
        if step_context is COMPUTE and needs_step_context(self.optimizer):
            # a global norm: from every rank's per-gradient sums of squares, in the parameters' order
            owned = self._owned_gradients()
            sums = dict(zip(owned, ((v,) for v in square_sums(list(owned.values())))))
            context = self.optimizer.step_context_of_square_sums([v for (v,) in self._gathered(sums, 1)], grad_scale)
        self.local.step(self.step_closure, grad_scale=grad_scale, step_context=context, **self.step_kwargs)
        self._broadcast_params()
        return False

    def _weights_changed(self) -> None:
        self._broadcast_params()

    def _broadcast_params(self) -> None:
        if self.world_size == 1:
            return
        for owner, params in self._broadcast_buckets:
            src = global_rank(self.group, owner)
            if owner == self.rank:
                flat = _flatten_dense_tensors([p.detach() for p in params])
            else:
                flat = torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
            dist.broadcast(flat, src=src, group=self.group)
            if owner != self.rank:
                for p, value in zip(params, _unflatten_dense_tensors(flat, params)):
                    p.data.copy_(value)

    # ------------------------------------------------------------------ state dict
    def _names(self) -> list[list[str]]:
        return [[self.param_names[p] for p in g["params"]] for g in self.param_groups]

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard: the owned parameters' state, keyed by name, with every group's
        settings as they are now (an LR scheduler may have stepped since the last step;
        ``param_groups[i]["params"]`` lists the owned names only)."""
        copy_hyperparameters(self.local.optimizer, self.param_groups)
        return self.local.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a whole optimizer state (ours keyed by name, or torch's by position, from any
        world size once merged): this rank keeps the part it owns."""
        own_step = isinstance(self.optimizer, UserStepOptimizer)  # (state beside its parameters, of its shapes)
        state_dict, beside = split_beside_parameters(state_dict) if own_step else (state_dict, {})
        by_name, saved_groups = read_named_state(state_dict, self._names(),
                                                 {self.param_names[p]: p.shape for p in self._params},
                                                 self.param_groups, moments_shaped=not own_step)
        owned_names = [[self.param_names[p] for p in g["params"]] for g in self.local.param_groups]
        self.local.load_state_dict({
            "state": {**{n: by_name[n] for names in owned_names for n in names if n in by_name}, **beside},
            "param_groups": [dict(hp, params=names) for hp, names in zip(saved_groups, owned_names)],
        })
        for group, hp in zip(self.param_groups, saved_groups):
            group.update(hp)  # in place: LR schedulers hold these dicts

    def close(self) -> None:
        self.local.close()
        if self.reducer is not None:
            self.reducer.close()

    def _describe(self) -> str:
        return (f"ZeroOptimizer(stage {self.stage}, rank {self.rank}/{self.world_size}, owns {self.owned_numel} of "
                f"{sum(p.numel() for p in self._params)} elements, {self.local!r})")
