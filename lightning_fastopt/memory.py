"""estimate_memory: how many bytes fastopt_offload keeps on the accelerator and on the CPU.

The figures are exact for what the strategy allocates per parameter (weights,
gradients, float32 masters, optimizer state, host buffers), for the same split of
parameters the strategy makes, on one rank (with ZeRO, the rank's shard); activations,
the CUDA context, allocator slack and communication buffers (DDP's gradient buckets,
ZeRO's reduction and broadcast buckets of ``bucket_size_mb``) are not included.  FSDP's
gathered weights and unsharded gradients of the units in flight are, approximately, where
the sharding policy is given (``gathered``); :func:`sizes_that_fit` says which model sizes
fit a GPU and a host.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_fastopt.core.precision import SUPPORTED_PRECISIONS
from lightning_fastopt.fsdp.auto_shard import check_auto_wrap_policy
from lightning_fastopt.fsdp.tensor_parallel_pieces import chunk_length, tensor_parallel_pieces
from lightning_fastopt.fsdp.units_in_flight import units_in_flight
from lightning_fastopt.offload.partition import choose_offloaded
from lightning_fastopt.offload.state_tiers import DEFAULT_WINDOW_MB, check_device_and_window
from lightning_fastopt.optim.adam import check_state_dtype
from lightning_fastopt.zero.partition import assign_owners

# float32 state tensors per parameter element, per optimizer
_STATE_TENSORS = {"adam": 2, "adamw": 2, "lamb": 2, "sgd": 1, "lars": 1, "lion": 1, "adagrad": 1}
_FIELDS = ("params", "grads", "master_weights", "optimizer_state", "speculation", "gathered")
_DISK_FIELDS = ("master_weights", "optimizer_state", "speculation")


@dataclass
class MemoryEstimate:
    """Bytes on each side; ``gpu`` and ``cpu`` map each of ``params``, ``grads``,
    ``master_weights``, ``optimizer_state``, ``speculation``, ``gathered`` (FSDP's units in
    flight) to a byte count."""

    gpu: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_FIELDS, 0))
    cpu: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_FIELDS, 0))
    offloaded_params: int = 0
    total_params: int = 0
    owned_params: int = 0  # whose masters and state this rank keeps (all of them without ZeRO)
    rank: int = 0
    world_size: int = 1
    zero_stage: int = 0
    # offload_optimizer_device="nvme": the masters and state in the rank's file (a speculated
    # update's copy beside them under "speculation"), and the host memory of its window (in cpu_total)
    on_disk: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_DISK_FIELDS, 0))
    disk_window: int = 0

    @property
    def disk(self) -> int:
        return sum(self.on_disk.values())

    @property
    def gpu_total(self) -> int:
        return sum(self.gpu.values())

    @property
    def cpu_total(self) -> int:
        return sum(self.cpu.values()) + self.disk_window

    def fits(self, gpu_memory: float, host_memory: float) -> bool:
        """Whether these figures fit an accelerator of ``gpu_memory`` bytes and a host of
        ``host_memory`` bytes (for this rank: a host with several ranks needs each one's),
        before activations, the CUDA context and the allocator's slack, which the figures
        do not count: leave room for them."""
        return self.gpu_total <= gpu_memory and self.cpu_total <= host_memory

    def __str__(self) -> str:
        disk = bool(self.disk)
        rows = [f"{'':16s}{'GPU':>12s}{'CPU':>12s}" + (f"{'disk':>12s}" if disk else "")]
        for k in _FIELDS:
            rows.append(f"{k:16s}{_gib(self.gpu[k]):>12s}{_gib(self.cpu[k]):>12s}"
                        + (f"{_gib(self.on_disk.get(k, 0)):>12s}" if disk else ""))
        if disk:
            rows.append(f"{'disk window':16s}{'':>12s}{_gib(self.disk_window):>12s}{'':>12s}")
        rows.append(f"{'total':16s}{_gib(self.gpu_total):>12s}{_gib(self.cpu_total):>12s}"
                    + (f"{_gib(self.disk):>12s}" if disk else ""))
        if disk:
            rows.append("(disk: the float32 masters and optimizer state in nvme_path's file)")
        rows.append(f"({self.offloaded_params:,} of {self.total_params:,} parameters offloaded)")
        if self.zero_stage and self.world_size > 1:
            what = "rows of every parameter" if self.zero_stage == 3 else "parameters"
            rows.append(f"(ZeRO stage {self.zero_stage}, rank {self.rank} of {self.world_size}: "
                        f"a shard of {self.owned_params:,} {what})")
        return "\n".join(rows)


def estimate_memory(model: torch.nn.Module, offload_fraction: float = 1.0, precision: str = "16-mixed",
                    optimizer: str = "adam", amsgrad: bool = False, speculate: bool = False, zero_stage: int = 0,
                    world_size: int = 1, rank: int | None = None, tensor_parallel_size: int = 1,
                    tensor_parallel_plan: Mapping[str, Any] | None = None,
                    offload_parameters: bool = False, offload_optimizer_device: str = "cpu",
                    nvme_window_mb: float | None = None, auto_wrap_policy: Any = None,
                    min_num_params: int | None = None, host_state_dtype: Any = None,
                    host_state_gib: float | None = None) -> MemoryEstimate:
    """Bytes on the accelerator ("gpu"), in host memory ("cpu") and on disk for the trainable
    parameters of ``model``, on one rank, as the strategies place them (activations not
    counted).  What each argument changes is told at length in docs/strategy.md ("How much
    memory") and docs/fsdp.md; ``tests/test_memory.py`` checks the figures against what runs
    allocate.

    Args:
        offload_fraction: the share of the parameters whose masters and state are offloaded.
        precision: the Trainer's flag (checked; ``*-mixed`` keeps float32 weights).
        optimizer: ``"adam"``, ``"adamw"``, ``"lamb"`` (two state tensors an element, three with
            ``amsgrad``), ``"sgd"``, ``"lars"``, ``"lion"`` or ``"adagrad"`` (one).
        amsgrad: Adam's third state tensor.
        speculate: ``stream_cpu_step`` where the step checks the gradients first: the offloaded
            masters and state once more (``speculation``).
        zero_stage, world_size, rank: ZeRO 1 or 2 (a rank's owned masters and state), or 3
            (``fastopt_fsdp``: a rank's rows of every parameter); ``rank`` None: the rank that
            needs the most accelerator memory, then the most host memory.
        tensor_parallel_size, tensor_parallel_plan: with ``zero_stage=3``, the mesh's
            tensor-parallel size and the plan ``configure_model`` gives ``parallelize_module``.
        offload_parameters: with ``zero_stage=3``, the rows, gradients and state in host memory.
        offload_optimizer_device, nvme_window_mb: ``"nvme"``: the offloaded masters and state in
            the rank's file (``disk``), the window in host memory (``disk_window``).
        auto_wrap_policy, min_num_params: with ``zero_stage=3``, the units the one-line form
            makes, and the weights FSDP gathers for those in flight (``gathered``).
        host_state_dtype: ``"bfloat16"``: the offloaded Adam moments at 2 bytes an element.
        host_state_gib: with ``"nvme"``, that many GiB of the state in host memory, the rest on
            disk (a number: ``"auto"`` is measured when the run starts).
    """
    if host_state_gib is not None:
        if offload_optimizer_device != "nvme":
            raise ValueError(f"host_state_gib splits the state on disk: it needs offload_optimizer_device='nvme', got "
                             f"{offload_optimizer_device!r}")
        if isinstance(host_state_gib, bool) or not isinstance(host_state_gib, (int, float)) or host_state_gib < 0:
            raise ValueError(f"host_state_gib must be a number of GiB, 0 or more (the estimate cannot measure "
                             f"'auto': that is what the machine has free when the run starts), got {host_state_gib!r}")
    est = _estimate(model, offload_fraction, precision, optimizer, amsgrad, speculate, zero_stage, world_size, rank,
                    tensor_parallel_size, tensor_parallel_plan, offload_parameters, offload_optimizer_device,
                    nvme_window_mb, auto_wrap_policy, min_num_params, host_state_dtype)
    return est if host_state_gib is None else _keep_in_host(est, host_state_gib)


def _estimate(model, offload_fraction, precision, optimizer, amsgrad, speculate, zero_stage, world_size, rank,
              tensor_parallel_size, tensor_parallel_plan, offload_parameters, offload_optimizer_device, nvme_window_mb,
              auto_wrap_policy, min_num_params, host_state_dtype) -> MemoryEstimate:
    """:func:`estimate_memory` but ``host_state_gib``."""
    if precision not in SUPPORTED_PRECISIONS:
        raise ValueError(f"precision must be one of {SUPPORTED_PRECISIONS}, got {precision!r}")
    key = optimizer.lower()
    if key not in _STATE_TENSORS:
        raise ValueError(f"optimizer must be one of {sorted(_STATE_TENSORS)}, got {optimizer!r}")
    state_tensors = _STATE_TENSORS[key] + (1 if amsgrad and key in ("adam", "adamw") else 0)
    host_state = _host_state_bytes(host_state_dtype, key, amsgrad)
    params = [p for p in model.parameters() if p.requires_grad]
    owners = _owners(params, zero_stage, world_size, rank)
    tp = _check_tensor_parallel(tensor_parallel_size, tensor_parallel_plan, zero_stage, world_size)
    _check_offload_parameters(offload_parameters, zero_stage, offload_fraction)
    check_device_and_window(offload_optimizer_device, nvme_window_mb)
    units = _check_units(auto_wrap_policy, min_num_params, zero_stage)
    on_disk = offload_optimizer_device == "nvme"
    window_mb = DEFAULT_WINDOW_MB if nvme_window_mb is None else nvme_window_mb  # the most the window takes
    if zero_stage == 3:  # each rank its rows of every parameter (of its tensor-parallel piece of each)
        ranks = range(world_size) if rank is None else [rank]
        pieces = {t: _tensor_parallel_pieces(model, params, tensor_parallel_plan, tp, t)
                  for t in {r % tp for r in ranks}}  # each tensor-parallel rank's once
        each = [_rank_estimate(_local_rows(pieces[r % tp], r // tp, world_size // tp),
                               [True] * len(params), offload_fraction, state_tensors, speculate, 3, world_size, r,
                               sum(p.numel() for p in params), on_host=offload_parameters,
                               window=window_mb if on_disk else None, host_state=host_state)
                for r in ranks]
        chosen = max(each, key=lambda e: (e.gpu_total, e.cpu_total, -e.rank))
        if units is not None:
            weights, grads = units_in_flight(model, units[0], units[1], forward_runs=not _is_lightning_module(model))
            chosen.gpu["gathered"] = weights + grads
        return chosen

    def estimate(r: int, owned: list[bool]) -> MemoryEstimate:
        return _rank_estimate(params, owned, offload_fraction, state_tensors, speculate, zero_stage, world_size, r,
                              window=window_mb if on_disk else None, host_state=host_state)

    if owners is None:  # one process holds everything, on every rank
        return estimate(rank or 0, [True] * len(params))
    ranks = range(world_size) if rank is None else [rank]
    each = [estimate(r, [o == r for o in owners]) for r in ranks]
    return max(each, key=lambda e: (e.gpu_total, e.cpu_total, -e.rank))


def _rank_estimate(params: list[torch.Tensor], owned: list[bool], offload_fraction: float, state_tensors: int,
                   speculate: bool, zero_stage: int, world_size: int, rank: int,
                   total: int | None = None, on_host: bool = False, window: float | None = None,
                   host_state: int | None = None) -> MemoryEstimate:
    """One rank's figures, owning the parameters ``owned`` marks (see :func:`estimate_memory`;
    at stage 3 ``params`` are the rank's rows, ``total`` the model's elements; ``on_host``:
    the rows themselves in host memory, their own masters; ``window``: ``nvme_window_mb``,
    the offloaded masters and state on disk; ``host_state``: bytes an element of an
    offloaded state tensor, where not the master's): each parameter's place decided, then
    what each tier holds of it (:func:`_on_device`, :func:`_in_host`, :func:`_on_disk`) summed."""
    mine = [p for p, o in zip(params, owned) if o]
    chosen = iter(choose_offloaded(mine, offload_fraction))
    est = MemoryEstimate(total_params=sum(p.numel() for p in params) if total is None else total,
                         owned_params=sum(p.numel() for p in mine), rank=rank, world_size=world_size,
                         zero_stage=zero_stage)
    run = _Run(state_tensors, speculate, zero_stage, sharded=zero_stage > 0 and world_size > 1,
               disk=window is not None)
    for p, own in zip(params, owned):
        place = HOST_ROWS if on_host else ANOTHER_RANKS if not own else OFFLOADED if next(chosen) else ON_DEVICE
        facts = _Param(p.numel(), p.element_size(), 8 if p.dtype == torch.float64 else 4, host_state)
        est.offloaded_params += facts.n if place in (HOST_ROWS, OFFLOADED) else 0
        for tier, held in ((est.gpu, _on_device(place, facts, run)), (est.cpu, _in_host(place, facts, run)),
                           (est.on_disk, _on_disk(place, facts, run))):
            for k, v in held.items():
                tier[k] += v
    if window is not None and est.disk:  # what the state needs (every bucket's region at most), within the limit
        est.disk_window = min(round(window * 2**20), est.disk // (2 if speculate else 1))
    return est


# where a parameter's masters and state are, as :func:`_rank_estimate` decides it
HOST_ROWS = "host rows"  # FSDP's rows in host memory (offload_parameters), their own masters
ANOTHER_RANKS = "another rank's"  # ZeRO: another rank keeps its masters and state
OFFLOADED = "offloaded"  # this rank's, in host memory (or on disk)
ON_DEVICE = "on the device"  # this rank's, updated where it lives


@dataclass(frozen=True)
class _Run:
    state_tensors: int
    speculate: bool
    zero_stage: int
    sharded: bool  # ZeRO across several ranks
    disk: bool  # offload_optimizer_device="nvme"


@dataclass(frozen=True)
class _Param:
    n: int  # elements
    size: int  # bytes an element of the weight
    master: int  # bytes an element of the master (and of the state: 8 for float64 weights, else 4)
    host_state: int | None  # bytes an element of an offloaded state tensor, where not the master's

    @property
    def half(self) -> bool:
        return self.size < 4

    @property
    def state(self) -> int:
        """Bytes of one offloaded state tensor."""
        return (self.host_state or self.master) * self.n


def _on_device(place: str, p: _Param, run: _Run) -> dict[str, int]:
    """What the accelerator holds of a parameter: its weight, a gradient where it stays (the
    device's share; ZeRO stage 1 keeps every one until the step, DDP's; stages 1 and 3 copy
    an offloaded one at the step, so it stays until ``zero_grad``), the device share's
    master (a half weight's) and state."""
    if place == HOST_ROWS:
        return {}
    grads = {ANOTHER_RANKS: run.zero_stage == 1, OFFLOADED: run.sharded and run.zero_stage in (1, 3),
             ON_DEVICE: True}[place]
    held = {"params": p.n * p.size, "grads": p.n * p.size if grads else 0}
    if place == ON_DEVICE:
        held.update(master_weights=p.master * p.n if p.half else 0, optimizer_state=p.master * p.n * run.state_tensors)
    return held


def _in_host(place: str, p: _Param, run: _Run) -> dict[str, int]:
    """What host memory holds of a parameter: FSDP's host rows with their gradients, an
    offloaded one's gradient buffer and half copy, and, where the state is not on disk, the
    masters and state, with what a speculated update keeps aside; on disk, the speculation
    of what stays in host memory (a host row's weight, written in place)."""
    if place == HOST_ROWS:
        held = {"params": p.n * p.size, "grads": p.n * p.size}
        if run.disk:
            held["speculation"] = (p.n * p.size if p.half else p.master * p.n) if run.speculate else 0
            return held
        held.update(master_weights=p.master * p.n if p.half else 0, optimizer_state=p.state * run.state_tensors,
                    speculation=(p.master * p.n + p.state * run.state_tensors + (p.n * p.size if p.half else 0))
                    if run.speculate else 0)
        return held
    if place != OFFLOADED:
        return {}
    held = {"grads": p.n * p.size, "master_weights": p.n * p.size if p.half else 0}  # the half copy sent back
    if not run.disk:
        held["master_weights"] += p.master * p.n
        held.update(optimizer_state=p.state * run.state_tensors,
                    speculation=(p.master * p.n + p.state * run.state_tensors) if run.speculate else 0)
    return held


def _on_disk(place: str, p: _Param, run: _Run) -> dict[str, int]:
    """What the disk's file holds of a parameter (``offload_optimizer_device="nvme"``): an
    offloaded one's master (a host row's only where it is half) and state, twice over with
    ``speculate`` (a speculated update is written beside the last)."""
    if not run.disk or place not in (HOST_ROWS, OFFLOADED):
        return {}
    masters = p.master * p.n if place == OFFLOADED or p.half else 0
    state = p.state * run.state_tensors
    return {"master_weights": masters, "optimizer_state": state,
            "speculation": masters + state if run.speculate else 0}


def _keep_in_host(est: MemoryEstimate, host_state_gib: float) -> MemoryEstimate:
    """``host_state_gib`` GiB of the masters and state on disk kept in host memory instead
    (whole buckets, each with its masters and state: the same share of each), with the
    speculated copy of what is kept (in host memory as a snapshot)."""
    kept = est.on_disk["master_weights"] + est.on_disk["optimizer_state"]
    share = min(1.0, host_state_gib * 2**30 / kept) if kept else 0.0
    for k in ("master_weights", "optimizer_state", "speculation"):
        moved = round(est.on_disk[k] * share)
        est.on_disk[k] -= moved
        est.cpu[k] += moved
    est.disk_window = min(est.disk_window, est.disk - est.on_disk["speculation"])  # what the disk's share needs
    return est


def _check_offload_parameters(offload_parameters: Any, zero_stage: int, offload_fraction: float) -> None:
    if not isinstance(offload_parameters, bool):
        raise TypeError(f"offload_parameters must be True or False, got {offload_parameters!r}")
    if offload_parameters and (zero_stage != 3 or offload_fraction != 1.0):
        raise ValueError(f"offload_parameters=True is FSDP's (zero_stage=3) with every row in host memory "
                         f"(offload_fraction=1.0), got zero_stage={zero_stage!r}, offload_fraction={offload_fraction!r}")


def _host_state_bytes(dtype: Any, optimizer: str, amsgrad: bool) -> int | None:
    """Bytes an element of an offloaded state tensor with ``host_state_dtype`` (None: the master's)."""
    if dtype is None:
        return None
    if optimizer not in ("adam", "adamw"):
        raise ValueError(f"host_state_dtype is for adam and adamw (the Adam moments in host memory), got "
                         f"optimizer={optimizer!r}")
    return torch.empty((), dtype=check_state_dtype(dtype, amsgrad)).element_size()


def _check_units(policy: Any, min_num_params: Any, zero_stage: int) -> tuple[tuple[type, ...], int] | None:
    """The one-line form's policy (classes, threshold) to plan FSDP's units with, or None."""
    if policy is None and min_num_params is None:
        return None
    if zero_stage != 3:
        raise ValueError(f"auto_wrap_policy and min_num_params plan FSDP's units (zero_stage=3), got "
                         f"zero_stage={zero_stage!r}")
    threshold = 100_000_000 if min_num_params is None else min_num_params
    return check_auto_wrap_policy(policy, threshold), threshold


def _is_lightning_module(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a LightningModule (of either Lightning package)."""
    return any(c.__name__ == "LightningModule" and c.__module__.startswith(("lightning.pytorch", "pytorch_lightning"))
               for c in type(model).__mro__)


def sizes_that_fit(build: Callable[[Any], torch.nn.Module], sizes: Iterable[Any], gpu_memory: float,
                   host_memory: float, **estimate_args: Any) -> list[tuple[Any, MemoryEstimate, bool]]:
    """Which model sizes fit an accelerator of ``gpu_memory`` bytes and a host of
    ``host_memory`` bytes: for each of ``sizes``, the model ``build(size)`` makes (on the
    meta device: nothing is allocated), its :func:`estimate_memory` with ``estimate_args``
    and whether it :meth:`~MemoryEstimate.fits` (before activations).  For example, the
    GPTs of 24 to 48 layers on a 24 GiB GPU and a 128 GiB host, weights in host memory::

        sizes_that_fit(lambda n: GPT(layers=n), range(24, 49, 4), 24 * 2**30, 128 * 2**30,
                       zero_stage=3, offload_parameters=True, auto_wrap_policy={Block},
                       precision="bf16-mixed")
    """
    out = []
    for size in sizes:
        with torch.device("meta"):
            model = build(size)
        est = estimate_memory(model, **estimate_args)
        out.append((size, est, est.fits(gpu_memory, host_memory)))
    return out


def _owners(params: list[torch.Tensor], zero_stage: int, world_size: int, rank: int | None) -> list[int] | None:
    """The owning rank of each of ``params`` (ZeRO's partition), or None without sharding;
    checks the arguments."""
    if isinstance(zero_stage, bool) or zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3 (fastopt_fsdp), got {zero_stage!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size):
        raise ValueError(f"rank must be an int in [0, {world_size}) (world_size={world_size}), got {rank!r}")
    if zero_stage in (0, 3) or world_size == 1:
        return None
    return assign_owners([p.numel() for p in params], world_size)


def _check_tensor_parallel(size: Any, plan: Any, zero_stage: int, world_size: int) -> int:
    """``tensor_parallel_size`` checked with the plan and the other arguments; returns it."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1 or world_size % size:
        raise ValueError(f"tensor_parallel_size must be an int >= 1 that divides world_size ({world_size}), "
                         f"got {size!r}")
    if size > 1 and (zero_stage != 3 or plan is None):
        raise ValueError(f"tensor_parallel_size={size} is for zero_stage=3 (fastopt_fsdp) with the "
                         "tensor_parallel_plan configure_model gives parallelize_module")
    if plan is not None and size == 1:
        raise ValueError("tensor_parallel_plan needs tensor_parallel_size > 1 (the processes that split each "
                         "parameter)")
    return size


def _tensor_parallel_pieces(model: torch.nn.Module, params: list[torch.Tensor], plan: Mapping[str, Any] | None,
                            size: int, rank: int) -> list[torch.Tensor]:
    """Each of ``params``' piece on tensor-parallel rank ``rank`` (itself without a plan)."""
    if plan is None:
        return params
    pieces = tensor_parallel_pieces(model, plan, size, rank)
    return [pieces[p] for p in params]


def _local_rows(params: list[torch.Tensor], rank: int, world_size: int) -> list[torch.Tensor]:
    """``rank``'s rows of each parameter as ``fully_shard`` chunks the first dimension
    (``torch.chunk``: chunks of ``ceil(rows / world_size)``, the last ones shorter or
    empty), as tensors on the meta device."""
    local = []
    for p in params:
        shape = tuple(p.shape) or (1,)
        local.append(torch.empty((chunk_length(shape[0], world_size, rank), *shape[1:]), dtype=p.dtype, device="meta"))
    return local


def _gib(n: int) -> str:
    return f"{n / 2**30:.3f} GiB" if n >= 2**27 else f"{n / 2**20:.2f} MiB"
