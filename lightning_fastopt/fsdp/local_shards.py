"""LocalShardOptimizer: the offloaded compiled step on the local shards of FSDP2's
parameters (ZeRO stage 3).

torch's ``fully_shard`` turns each parameter into a DTensor sharded on its first
dimension: a rank holds its rows (``_local_tensor``, a view into FSDP's sharded storage,
which it all-gathers before each forward), and after backward ``p.grad`` is a DTensor
holding that rank's rows of the reduce-scattered gradient.  torch's optimizers update
the DTensors elementwise, shard by shard, with no communication; so does this one: it
gives each DTensor parameter a plain parameter that aliases its local rows (same storage:
an update written there is what FSDP gathers next) and runs an
:class:`~lightning_fastopt.offload.OffloadOptimizer` over them, so ``offload_fraction``
of each rank's fp32 masters and optimizer state lives in host memory, stepped by the CPU
kernels, the rest by the device's.  The gradients' local rows reach the aliases in one of
two ways (``device_grads``):

- ``"copy_at_step"``: when the step starts (the offloaded ones are copied to the host
  then); ``p.grad`` keeps every DTensor gradient until ``zero_grad``, as under torch;
- ``"copy_when_reduced"``: as FSDP's reduce-scatter lands each one during backward (its
  post-accumulate-grad hooks on the sharded parameters; on host shards, the end of their
  group's post-backward: :mod:`~lightning_fastopt.fsdp.gradient_landings`), the offloaded
  ones leave for the host at once and their ``p.grad`` is dropped (the device memory saving), so nothing
  outside the optimizer may read those between backward and the step; with
  ``stream_cpu_step`` a host bucket's CPU update starts as its last gradient lands
  (speculated with ``speculate``, as everywhere).  During gradient accumulation
  (``accumulating``) FSDP adds each micro-batch into ``p.grad`` and nothing leaves.

What is not elementwise spans the shards as torch computes it over DTensors: the clipping
norm is torch's ``get_total_norm`` of the DTensor gradients (once some have left for the
host, the same bits from the rows: each row norm made the partial-norm DTensor torch's
``vector_norm`` of the gradient gives, reduced by DTensor over the mesh dimensions the
parameter is sharded on, so tensor parallelism's replicated parameters count once), the
overflow check is agreed over the ranks.  LAMB's and LARS's trust ratios read norms over
each whole parameter (and LAMB's clipping, the norm of every gradient): once the step's
gradients are in place, each rank takes those of its rows (LAMB's update's too, nothing
written), the ranks sum them over the same mesh dimensions, and the updates take the
totals; so their CPU updates run at the step (no ``stream_cpu_step``, no
``delayed_update``).

Where no FSDP shards a tensor-parallel parameter (a tensor-parallel-only mesh), its
gradient comes back as backward left it: whole on every rank for an embedding split by
rows, a partial sum on each for a weight ``SequenceParallel`` replicates.  As torch's
optimizer does, each is redistributed to its parameter's placements (``_local_grad``), and
the clipping norm is torch's norm of it as placed; the parameters replicated on every mesh
dimension take theirs when the step starts, after the clipping has multiplied each rank's
part as it multiplies torch's (a sum first, then clipped, rounds otherwise), so they are
stepped on the device (``stays_on_device``), never offloaded.

The user's ``param_groups`` dicts are shared as everywhere in lightning_fastopt (LR
schedulers work); :meth:`state_of` gives a parameter's state as torch keeps it for a
DTensor parameter (DTensors with the parameter's placements), so torch's distributed
state dicts read it.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor._ops._math_ops import _NormPartial  # the placement of a partial p-norm
from typing_extensions import override

from lightning_fastopt.fsdp.gradient_landings import HostGradientLandings
from lightning_fastopt.functional import grads_all_finite, square_sums
from lightning_fastopt.offload import OffloadOptimizer
from lightning_fastopt.offload.grad_norms import by_device_and_dtype, norms_of, unscaled_norm
from lightning_fastopt.offload.local_wrapper import LocalOffloadWrapper
from lightning_fastopt.optim.base import (COMPUTE, FusedOptimizer, copy_hyperparameters, hyperparameters,
                                          needs_step_context, spans_parameters)
from lightning_fastopt.runtime.distributed import all_reduce_scalar, world_size

__all__ = ["LocalShardOptimizer", "local_alias"]

_DEVICE_GRADS = ("copy_at_step", "copy_when_reduced")


def local_alias(param: Tensor) -> torch.nn.Parameter:
    """A plain parameter over ``param``'s local rows (the same storage), or over ``param``
    itself when it is not a DTensor (a module ``fully_shard`` did not reach)."""
    local = param._local_tensor if isinstance(param, DTensor) else param.detach()
    return torch.nn.Parameter(local, requires_grad=param.requires_grad)


def _local_grad(param: Tensor) -> Tensor | None:
    """This rank's rows of ``param``'s gradient, in its parameter's placements: a gradient
    placed otherwise (:func:`_placed_otherwise`) is redistributed to them first, as
    torch's optimizer redistributes it when it meets the parameter's state."""
    grad = param.grad
    if _placed_otherwise(param):
        grad = grad.redistribute(param.device_mesh, param.placements)
    return grad._local_tensor if isinstance(grad, DTensor) else grad


def _replicated(param: Tensor) -> bool:
    """``param`` is a DTensor replicated on every dimension of its mesh: tensor
    parallelism's replicated weights (``SequenceParallel``'s norms) where no FSDP shards
    them (FSDP shards every parameter it holds, and hands its gradients over in its
    placements).  Their gradients may come back partial sums (``Partial()``)."""
    return isinstance(param, DTensor) and all(p.is_replicate() for p in param.placements)


def _placed_otherwise(param: Tensor) -> bool:
    """``param``'s gradient is a DTensor placed otherwise than ``param``: the weight of an
    embedding tensor parallelism splits by rows (``RowwiseParallel``), without FSDP over
    it, gets its gradient whole (``Replicate()``) on every rank.  FSDP redistributes the
    gradients of the parameters it shards; nothing does for the others."""
    grad = param.grad
    return (isinstance(grad, DTensor) and isinstance(param, DTensor)
            and (grad.placements != param.placements or grad.device_mesh != param.device_mesh))


class LocalShardOptimizer(LocalOffloadWrapper):
    """Args:
        optimizer: the fused optimizer over the model's (DTensor) parameters, the user's groups.
        param_names: a name for each parameter (state dicts are keyed by them).
        process_group: the group the parameters are sharded over (overflow checks agree
            over it; default: the whole world).
        device_grads: ``"copy_at_step"`` (default) or ``"copy_when_reduced"`` (see above).
        host_gradients: where the parameters are FSDP's host shards (``CPUOffloadPolicy``),
            what tells when FSDP has handed over each gradient in host memory
            (``"copy_when_reduced"``;
            :class:`~lightning_fastopt.fsdp.gradient_landings.HostGradientLandings`): no
            post-accumulate-grad hook on those, which would make FSDP's copies block
            backward; each bucket's update waits for its gradients' copies instead.
        **offload_args: for this rank's :class:`~lightning_fastopt.offload.OffloadOptimizer`
            (``offload_fraction``, ``bucket_size_mb``, ``copy_on_cpu``, ``stream_cpu_step``,
            ``speculate``, ...).
    """

    shards_gradients = True  # gradients() holds this rank's rows: overflow flags and norms span the ranks

    def __init__(self, optimizer: FusedOptimizer, param_names: Mapping[Tensor, str] | None = None, *,
                 process_group=None, device_grads: str = "copy_at_step",
                 host_gradients: HostGradientLandings | None = None, **offload_args: Any) -> None:
        super().__init__(optimizer)
        if device_grads not in _DEVICE_GRADS:
            raise ValueError(f"LocalShardOptimizer takes device_grads {_DEVICE_GRADS} (the gradients' rows at the "
                             f"step, or as FSDP's reduce-scatter lands them), got {device_grads!r}")
        self.group = process_group
        self.device_grads = device_grads
        self._host_gradients = host_gradients
        self._landings_heard = 0  # gradients FSDP handed over since the last step
        self._said_none_landed = False
        self._params = list(dict.fromkeys(p for g in self.param_groups for p in g["params"]))
        names = dict(param_names or {})
        self.param_names = {p: names.get(p, f"param{i}") for i, p in enumerate(self._params)}
        early = [k for k in ("stream_cpu_step", "delayed_update") if offload_args.get(k)]
        if spans_parameters(optimizer) and early:
            raise ValueError(f"{type(optimizer).__name__} takes norms over whole parameters or over every gradient "
                             "(LAMB's and LARS's trust ratios, LAMB's clipping), summed over every rank's rows when the "
                             f"step starts: {' and '.join(f'{k}=True' for k in early)} (updating rows before that) "
                             "cannot be used with it")
        self._alias = {p: local_alias(p) for p in self._params}
        # replicated on every mesh dimension (no FSDP over them): gradients taken at the step, stepped on the
        # device (an ordered set of the parameters, and the set of their aliases the local optimizer keeps there)
        self._at_step = dict.fromkeys(p for p in self._params if _replicated(p))
        self._kept = {self._alias[p] for p in self._at_step}
        self._alias_names = {self._alias[p]: n for p, n in self.param_names.items()}  # the local optimizer reads it
        shard = optimizer.sibling([[self._alias[p] for p in g["params"]] for g in self.param_groups])
        for p in self._params:  # state the wrapped optimizer had moves with its parameter, as local rows
            if optimizer.state.get(p):
                shard.state[self._alias[p]] = {k: _local(v) for k, v in optimizer.state[p].items()}
        optimizer.state.clear()
        streaming = device_grads == "copy_when_reduced"
        self.local = OffloadOptimizer(shard, self._alias_names, device_grads=device_grads,
                                      reduced_by=(lambda alias: alias.requires_grad and alias not in self._kept)
                                      if streaming else None, stays_on_device=self._kept.__contains__, **offload_args)
        self._hooks: list[Any] = []
        if streaming:
            self._watch_landings([p for p in self._params if p.requires_grad])
        if optimizer.whole_tensor_norms:
            self.local.before_updates = self._give_whole_tensor_norms
        self._ready = True

    @override
    def _adopt_group(self, group: dict[str, Any]) -> None:
        new = [p for p in dict.fromkeys(group["params"]) if p not in self._alias]
        for i, p in enumerate(new, start=len(self._params)):
            self.param_names.setdefault(p, f"param{i}")
            self._alias[p] = local_alias(p)
            self._alias_names[self._alias[p]] = self.param_names[p]
            if _replicated(p):
                self._at_step[p] = None
                self._kept.add(self._alias[p])
        self._params += new
        if self.device_grads == "copy_when_reduced":
            self._watch_landings([p for p in new if p.requires_grad])
        self.local.add_param_group(dict(hyperparameters(group), params=[self._alias[p] for p in group["params"]]))

    # ------------------------------------------------------------------ what users read
    def owns(self, param: Tensor) -> bool:
        return param in self._alias

    def alias_of(self, param: Tensor) -> torch.nn.Parameter:
        """The plain parameter over ``param``'s local rows that the local optimizer steps."""
        return self._alias[param]

    def state_of(self, param: Tensor) -> dict[str, Any]:
        """``param``'s state as torch keeps it for a DTensor parameter: each tensor of the
        parameter's shape a DTensor with its placements (the rows this rank holds)."""
        state = self.local.state_of(self._alias[param])
        if not isinstance(param, DTensor):
            return state
        rows = param._local_tensor.shape
        return {k: DTensor.from_local(v, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                                      stride=param.stride())
                if isinstance(v, Tensor) and v.shape == rows and v.dim() > 0 else v for k, v in state.items()}

    # ------------------------------------------------------------------ weights the last step left updating
    def modules_wait_for(self, params: set[Tensor]) -> None:
        """``forward_waits="module"`` (the host shards): the FSDP units holding ``params``
        wait for their rows' updates before their forward gathers them
        (:class:`~lightning_fastopt.fsdp.unit_waits.UnitWaits`); the other rows' updates
        are waited for when the step ends."""
        self.local.modules_wait_for({self._alias[p] for p in params if p in self._alias})

    def wait_for_weights(self, params: list[Tensor] | None = None) -> None:
        """Wait for the updates of ``params``' rows the last step left running, or for every
        one (None): before anything but their unit's forward reads them."""
        self.local.wait_for_weights(None if params is None else [self._alias[p] for p in params if p in self._alias])

    @property
    def held_numel(self) -> int:
        """The elements of the rows this rank holds (and steps)."""
        return sum(a.numel() for a in self._alias.values())

    # ------------------------------------------------------------------ gradients and step
    def _watch_landings(self, params: list[Tensor]) -> None:
        """Hear of each gradient of ``params`` FSDP's reduce-scatter lands: from
        :attr:`_host_gradients` for the host shards, else from post-accumulate-grad hooks."""
        if self._host_gradients is not None:
            self._host_gradients.watch(params, self._landed)
        else:
            self._hooks += [p.register_post_accumulate_grad_hook(self._landed) for p in params]

    def _landed(self, param: Tensor, copy_landing: Any = None) -> None:
        """FSDP's reduce-scatter landed ``param``'s gradient (``device_grads="copy_when_reduced"``):
        its rows go to the local optimizer, with the hyperparameters the user's groups hold
        now (an update started during backward uses them; LR schedulers wrote them after the
        last step), and an offloaded one's ``p.grad`` is dropped once its copy to the host
        is on its way.  ``copy_landing``: the event FSDP's copy of a host shard's gradient
        recorded (None: it has landed), which its reader waits for."""
        self._landings_heard += 1
        if self.local.accumulating or param in self._at_step:
            return  # FSDP adds the next micro-batch's into p.grad; or it is taken at the step
        copy_hyperparameters(self.local.optimizer, self.param_groups)
        alias = self._alias[param]
        alias.grad = _local_grad(param)
        self.local.grad_reduced(alias, landing=copy_landing)
        if alias.grad is None and not _placed_otherwise(param):  # taken to the host: the device copy goes too
            param.grad = None  # (one placed otherwise stays: the clipping norm is torch's norm of it)

    def _say_if_none_landed(self) -> None:
        """Once, where the host shards' updates were to start during backward and FSDP handed
        over none of this step's gradients (its groups' ``post_backward`` not called as
        :mod:`~lightning_fastopt.fsdp.gradient_landings` expects: another torch): the
        updates run at the step, with the same results, but not in backward."""
        heard, self._landings_heard = self._landings_heard, 0
        if (self._host_gradients is None or heard or self._said_none_landed
                or not self.local.lands_during_backward or not self.local.schedule.starts_in_backward
                or not any(p.grad is not None for p in self._params)):
            return
        self._said_none_landed = True
        warnings.warn(f"lightning_fastopt: the CPU updates of the parameter shards in host memory were to start "
                      f"during backward (stream_cpu_step=True), but FSDP handed over none of this step's gradients "
                      f"(torch {torch.__version__}'s FSDP did not call its parameter groups' post_backward as "
                      f"lightning_fastopt expects): they run at the step, with the same results", RuntimeWarning,
                      stacklevel=2)

    def _take_gradients(self, at_step: bool = False) -> None:
        """Hand the local rows of every ``p.grad`` (the reduce-scattered gradient) to the
        aliases the local optimizer reads; those of the parameters replicated on every
        mesh dimension only when the step starts (``at_step``): their gradients may be
        partial sums over the ranks, which torch's step adds up only after the clipping
        has multiplied each rank's part, so they are final only then."""
        for p, alias in self._alias.items():
            if alias.grad is None and (at_step or p not in self._at_step):
                alias.grad = _local_grad(p)

    def gradients(self) -> list[Tensor]:
        """The gradients this rank's step reads: its rows of each (in host memory for the
        offloaded share), and this rank's part of each gradient taken at the step (what
        clipping and unscaling multiply, as they multiply the DTensor's under torch).
        Overflow checks and norms over them span the ranks."""
        self._take_gradients()
        return self.local.gradients() + self._gradients_beside_local()

    def _gradients_beside_local(self) -> list[Tensor]:
        """This rank's part of each gradient taken at the step."""
        return [_local(p.grad) for p in self._at_step if p.grad is not None]

    @override
    def gradient_norm(self, grad_scale: float = 1.0) -> Tensor:
        """torch's ``get_total_norm`` of the DTensor gradients (what ``clip_grad_norm_``
        takes under FSDP2), unscaled by ``grad_scale``, as a plain tensor; where some have
        left for the host, or the gradients are loss-scaled (each norm unscaled before the
        ranks combine them), the same bits from the rows (:func:`_total_norm_of_rows`)."""
        self._take_gradients()
        if grad_scale == 1.0 and (self.device_grads == "copy_at_step" or not self.local.copies.needed):
            grads = [p.grad for p in self._params if p.grad is not None]
            norm = torch.nn.utils.get_total_norm(grads, 2.0)
            return norm.full_tensor() if isinstance(norm, DTensor) else norm
        norms = self.local.gradient_norms_by_param(grad_scale)
        return _total_norm_of_rows([(p, _norm_as_placed(p, grad_scale) if p.grad is not None and (
            p in self._at_step or _placed_otherwise(p)) else norms.get(self._alias[p])) for p in self._params])

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.local.zero_grad(set_to_none)  # the aliases' (and the host copies), once no update reads them
        super().zero_grad(set_to_none)  # and the DTensor gradients
        for alias in self._alias.values():
            alias.grad = None

    def _take_step(self, grad_scale, check_finite: bool, step_context: Any) -> bool:
        copy_hyperparameters(self.local.optimizer, self.param_groups)
        self._say_if_none_landed()
        self._take_gradients(at_step=True)
        if check_finite:
            finite = grads_all_finite(self.local.gradients())
            if all_reduce_scalar(0.0 if finite else 1.0, group=self.group) > 0:  # an overflow anywhere skips everywhere
                self.zero_grad()
                return True
        if step_context is COMPUTE and needs_step_context(self.local.optimizer):  # LAMB's global norm, every rank's rows
            step_context = self._step_context_over_shards(grad_scale)
        self.local.step(self.step_closure, grad_scale=grad_scale, step_context=step_context, **self.step_kwargs)
        for alias in self._alias.values():
            alias.grad = None  # the step read them; p.grad keeps the DTensor gradient, as torch does
        return False

    # ------------------------------------------------------------------ norms over whole parameters
    def _step_context_over_shards(self, grad_scale) -> Any:
        """The optimizer's step context (LAMB's global gradient norm) from each gradient's
        sum of squares over every rank's rows, in the parameters' order."""
        grads = self.local.gradients_by_param()
        local = dict(zip(grads, (torch.tensor([s], dtype=torch.float64) for s in square_sums(list(grads.values())))))
        totals = self._over_every_rank(local, 1)
        return self.local.optimizer.step_context_of_square_sums([float(totals[p]) for p in self._params], grad_scale)

    def _give_whole_tensor_norms(self, grad_scale, context) -> None:
        """The local optimizer's ``before_updates``: each parameter's squared norms that
        LAMB's or LARS's update reads, over this rank's rows, summed over every rank's, given
        to the updates (so that the trust ratios are the whole parameter's)."""
        local = self.local.updates.step_norm_sums(grad_scale, context)
        totals = self._over_every_rank(local, 2)
        self.local.updates.give_norms({self._alias[p]: totals[p] for p in self._params if self._alias[p] in local})

    def _over_every_rank(self, local: Mapping[Tensor, Tensor], width: int) -> dict[Tensor, Tensor]:
        """Each parameter's ``width`` sums over this rank's rows (``local``, keyed by alias;
        zeros for one without a gradient here: every rank takes part in the same
        collectives) summed over every rank's rows (:func:`_summed_over_shards`)."""
        zeros = torch.zeros(width, dtype=torch.float64)
        return _summed_over_shards({p: local.get(self._alias[p], zeros) for p in self._params})

    # ------------------------------------------------------------------ state dict
    def state_dict(self) -> dict[str, Any]:
        """This rank's rows of every state tensor, keyed by parameter name."""
        copy_hyperparameters(self.local.optimizer, self.param_groups)
        return self.local.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """A state dict of this class, from this rank (its rows, keyed by name)."""
        self.local.load_state_dict(state_dict)
        for group, saved in zip(self.param_groups, self.local.param_groups):
            group.update(hyperparameters(saved))  # in place: LR schedulers hold these dicts

    def load_param_state(self, state: Mapping[Tensor, Mapping[str, Any]], groups: list[dict[str, Any]]) -> None:
        """Load the state as torch holds it for the DTensor parameters (``optimizer.state``
        keyed by parameter, each tensor a DTensor over this rank's rows) and the groups'
        settings (``groups``, in this optimizer's order)."""
        names = [[self.param_names[p] for p in g["params"]] for g in self.param_groups]
        self.load_state_dict({
            "state": {self.param_names[p]: {k: _local(v) for k, v in s.items()} for p, s in state.items() if s},
            "param_groups": [dict(hyperparameters(g), params=n) for g, n in zip(groups, names)],
        })

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self._host_gradients is not None:
            self._host_gradients.remove()
        self.local.close()

    def _describe(self) -> str:
        rank = dist.get_rank(self.group) if world_size(self.group) > 1 else 0
        total = sum(p.numel() for p in self._params)
        return f"LocalShardOptimizer(rank {rank}, holds {self.held_numel} of {total} elements, {self.local!r})"


def _total_norm_of_rows(norms: list[tuple[Tensor, Tensor | None]]) -> Tensor:
    """The bits of torch's ``get_total_norm`` over the DTensor gradients of the parameters
    in ``norms``, from the norm of this rank's rows of each (taken by ``_foreach_norm`` on
    the device, before rows left for the host: :meth:`OffloadOptimizer.gradient_norms_by_param`):
    each norm made the DTensor torch's ``vector_norm`` of the gradient gives (a partial
    norm over the mesh dimensions the parameter is sharded on, replicated over the others:
    tensor parallelism replicates some), then stacked and normed as torch does, grouped by
    device and dtype, so that DTensor reduces them over the same ranks in the same order."""
    on_device = {param: norm.to(param.device) for param, norm in norms if norm is not None}  # where DTensor reduces
    ordered = [_as_torch_norm(p, on_device[p]) for group in by_device_and_dtype(on_device).values() for p in group]
    if not ordered:
        return torch.tensor(0.0)
    total = torch.linalg.vector_norm(torch.stack([n.to(ordered[0].device) for n in ordered]), 2.0)
    return total.full_tensor() if isinstance(total, DTensor) else total


def _norm_as_placed(param: Tensor, grad_scale: float) -> Tensor:
    """The norm torch's ``get_total_norm`` takes of ``param``'s gradient placed otherwise
    than ``param`` (kept in ``p.grad`` until the step), unscaled by ``grad_scale``: a
    DTensor, as DTensor computes it for the gradient's placements."""
    return unscaled_norm(norms_of([param.grad])[0], param.dtype, grad_scale)


def _as_torch_norm(param: Tensor, norm: Tensor) -> Tensor:
    """``norm``, the 2-norm of this rank's rows of ``param``'s gradient, as the DTensor
    torch's ``vector_norm`` of that (DTensor) gradient gives: a partial norm over each mesh
    dimension the gradient is sharded on, replicated (or partial) as it is over the others.
    A DTensor norm is already torch's (:func:`_norm_as_placed`)."""
    if not isinstance(param, DTensor) or isinstance(norm, DTensor):
        return norm
    placements = [p if p.is_replicate() or p.is_partial() else _NormPartial(2.0) for p in param.placements]
    return DTensor.from_local(norm, param.device_mesh, placements, run_check=False)


def _summed_over_shards(sums: dict[Tensor, Tensor]) -> dict[Tensor, Tensor]:
    """Each parameter's sums over this rank's rows (float64 CPU tensors of one shape),
    summed over the ranks that hold its other rows: over the mesh dimensions its DTensor
    is sharded on (those tensor parallelism replicates hold the same rows, counted once);
    one collective for the parameters of each mesh and placement pattern.  Every rank
    calls it with the same parameters, in the same order."""
    groups: dict[Any, list[Tensor]] = {}
    for p in sums:
        key = (p.device_mesh, tuple(pl.is_shard() for pl in p.placements)) if isinstance(p, DTensor) else None
        groups.setdefault(key, []).append(p)
    out: dict[Tensor, Tensor] = {}
    for key, params in groups.items():
        stacked = torch.stack([sums[p] for p in params])
        if key is not None and any(key[1]):
            mesh, sharded = key
            placements = [Partial() if s else Replicate() for s in sharded]
            stacked = DTensor.from_local(stacked.to(mesh.device_type), mesh, placements,
                                         run_check=False).full_tensor().to("cpu", torch.float64)
        out.update(zip(params, stacked))
    return out


def _local(value: Any) -> Any:
    return value._local_tensor if isinstance(value, DTensor) else value
