"""What an :class:`~lightning_fastopt.offload.optimizer.OffloadOptimizer` is asked to do:
one value, checked when it is made, that the engine and its parts read and that
``with_fraction`` copies with another fraction."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_fastopt.offload.delayed import check_delayed_update
from lightning_fastopt.offload.forward_waits import check_forward_waits
from lightning_fastopt.offload.grad_intake import check_device_grads
from lightning_fastopt.offload.split_tier import check_host_state, make_storage
from lightning_fastopt.offload.state_tiers import check_offload_device
from lightning_fastopt.optim.adam import FusedAdam, check_state_dtype
from lightning_fastopt.optim.base import FusedOptimizer, check_range

__all__ = ["OffloadSettings"]


@dataclass(frozen=True)
class OffloadSettings:
    """Args:
        offload_fraction: share of parameter elements updated on the CPU, in [0, 1].
        bucket_size_mb: host buffers are allocated, and gradients awaited, in buckets of
            about this many MiB of float32 parameters.
        overlap: copy on side streams, overlapping compute (CUDA); False copies in line.
        pin_memory: allocate the host buffers in page-locked memory (CUDA).
        device_grads: where gradients of offloaded parameters go and when, one of
            :data:`~lightning_fastopt.offload.grad_intake.DEVICE_GRADS`: ``"copy_in_backward"``
            (default), ``"copy_at_step"`` (when something reduces the gradients after the
            hooks fire: DDP across processes), ``"copy_when_reduced"`` (handed over by
            ``grad_reduced`` during backward, for the parameters ``reduced_by`` names), or
            ``"keep"`` (``p.grad`` stays readable and editable, as in torch).
        wall_clock_breakdown: time each phase of every step into ``last_step_times``
            (synchronizes the device; for diagnosis).
        copy_on_cpu: on a CPU run, keep separate host masters and gradient buffers and
            copy as on an accelerator (the accelerator code path, without one; for tests).
        stream_cpu_step: start each bucket's CPU update (and its copy back) on a worker
            thread as soon as its gradients have landed, while backward goes on, instead
            of when ``step`` is called; the result is the same, bit for bit
            (:mod:`~lightning_fastopt.offload.streamed`).  Only for steps that need no
            gradient before they start (no ``check_finite``, loss scale, step context or
            ``gradients()`` in between) unless ``speculate``; needs gradients that leave
            during backward (``device_grads`` in
            :data:`~lightning_fastopt.offload.grad_intake.STREAMING_GRADS`).
        speculate: with ``stream_cpu_step``, keep each bucket's masters and state aside
            while its update runs during backward, so that the step may still check and
            clip the gradients, take a loss scale (``expected_grad_scale`` is the one
            speculated with) or compute a step context: it commits the update where that
            changed nothing and redoes it otherwise, bit for bit the synchronous step
            (:mod:`~lightning_fastopt.offload.speculative`).  Costs the offloaded masters'
            and state's size again in host memory.
        delayed_update: after ``delayed_update_warmup`` synchronous steps, run each step's
            CPU update on a worker thread while the next forward and backward compute, the
            weights they use one update old (ZeRO-Offload's delayed parameter update; the
            semantics, checkpoints included, are in :mod:`~lightning_fastopt.offload.delayed`).
            Needs separate host masters: an accelerator, or ``copy_on_cpu=True``.
        delayed_update_warmup: steps taken synchronously before the update is delayed.
        host_state_dtype: the dtype of the offloaded share's Adam moments
            (``torch.bfloat16``: stochastic rounding, 4 bytes per parameter fewer to read
            and write in the CPU step, see :class:`~lightning_fastopt.optim.adam.FusedAdam`'s
            ``state_dtype``); None: the wrapped optimizer's own.  The state dict holds
            them as float32 either way.
        forward_waits: ``"step"`` (the compute stream waits for every new weight when
            the step ends) or ``"module"`` (for a bucket's weights just before the
            forward of a module that owns them, once ``modules_wait_for`` has named
            the parameters such modules own; see
            :mod:`~lightning_fastopt.offload.forward_waits` for the contract).
        reduced_by: whether a reducer hands a parameter's gradient over during each
            backward (``grad_reduced``): with ``device_grads="copy_when_reduced"``
            (ZeRO stage 2's reducer, every one), or ``"copy_at_step"`` (DDP's buckets whose
            all-reduce completed during backward; the step copies the others from ``p.grad``).
        stays_on_device: the parameters never offloaded, whatever the fraction (their
            gradients are final only when the step starts: a wrapper hands them over
            then, with no copy to wait for); the fraction counts every element.
        host_shards: the parameters are FSDP's shards in host memory (``CPUOffloadPolicy``):
            compute never reads them, only the copies FSDP gathers from them before each
            forward and backward, and their gradients land in host memory too.  They are
            their own masters, updated in place (nothing copied), and a host bucket's
            update may run as soon as a reducer has handed over its gradients
            (``reduced_by``): ``stream_cpu_step`` streams (and ``speculate`` speculates)
            the in-place updates into backward.  Needs every parameter on the CPU and no
            ``copy_on_cpu``.
        offload_optimizer_device: where the offloaded share's float32 masters (where kept
            apart from the weights) and optimizer state live between updates: ``"cpu"``
            (host memory) or ``"nvme"`` (a working file in ``nvme_path``, read and written
            bucket by bucket through a window of ``nvme_window_mb`` of host memory;
            :mod:`~lightning_fastopt.offload.state_tiers`).  The result is the same, bit
            for bit, on every schedule; with ``speculate``, a speculated update is written
            beside the bucket's last state in the file until the step keeps one.
        nvme_path: the directory of that file (``"nvme"`` only): a fast disk's.
        nvme_window_mb: the most host memory for the buckets on their way to and from
            the disk (two buckets' masters and state at least); None: 512 MiB at most.
            The window takes what the state needs within it.
        host_state_gib: with ``"nvme"``, up to this many GiB of whole buckets (masters with
            their state) kept in host memory, the rest on disk; ``"auto"``: what the host
            has available at set-up, less the window and ``host_reserve_gib`` (None: a
            tenth of the machine), shared by ``processes_per_host``
            (:mod:`~lightning_fastopt.offload.split_tier`).  None: all on disk.
        processes_per_host: the processes of the run on this machine (``"auto"`` shares
            the host's memory among them).
        step_cores: the cores the worker thread of the streamed, speculated and delayed
            updates binds itself to (and so the threads of its updates): the strategies'
            ``bind_cpu_threads``; None: wherever the system runs it.
    """

    offload_fraction: float = 1.0
    bucket_size_mb: float = 64.0
    overlap: bool = True
    pin_memory: bool = True
    device_grads: str = "copy_in_backward"
    wall_clock_breakdown: bool = False
    copy_on_cpu: bool = False
    stream_cpu_step: bool = False
    speculate: bool = False
    delayed_update: bool = False
    delayed_update_warmup: int = 40
    host_state_dtype: torch.dtype | str | None = None
    forward_waits: str = "step"
    reduced_by: Callable[[Tensor], bool] | None = None
    stays_on_device: Callable[[Tensor], bool] | None = None
    host_shards: bool = False
    offload_optimizer_device: str = "cpu"
    nvme_path: str | None = None
    nvme_window_mb: float | None = None
    host_state_gib: float | str | None = None
    host_reserve_gib: float | None = None
    processes_per_host: int = 1
    step_cores: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        """Refuse, by name, an argument or a combination that cannot work."""
        check_offload_device(self.offload_optimizer_device, self.nvme_path, self.nvme_window_mb)
        check_host_state(self.host_state_gib, self.host_reserve_gib, self.offload_optimizer_device)
        check_range("offload_fraction", self.offload_fraction, 0.0, 1.0)
        check_range("bucket_size_mb", self.bucket_size_mb, 0.0, low_open=True)
        check_device_grads(self.device_grads, self.stream_cpu_step, self.reduced_by)
        check_delayed_update(self.delayed_update, self.delayed_update_warmup, self.stream_cpu_step)
        if not isinstance(self.speculate, bool) or (self.speculate and not self.stream_cpu_step):
            raise ValueError(f"speculate=True checks the updates stream_cpu_step=True starts during backward: it "
                             f"needs stream_cpu_step=True, got speculate={self.speculate!r}, "
                             f"stream_cpu_step={self.stream_cpu_step!r}")
        check_forward_waits(self.forward_waits)
        if self.step_cores is not None and (not self.step_cores or not all(
                isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in self.step_cores)):
            raise ValueError(f"step_cores must be None or core numbers (integers, 0 or more), got {self.step_cores!r}")
        if not isinstance(self.host_shards, bool):
            raise TypeError(f"host_shards must be True or False, got {self.host_shards!r}")
        object.__setattr__(self, "offload_fraction", float(self.offload_fraction))

    @classmethod
    def of(cls, engine: str, options: dict[str, Any]) -> OffloadSettings:
        """Made from keyword arguments given to ``engine`` (a class's name, for the error
        that names an argument it does not take)."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"{engine} got unexpected keyword argument(s) {', '.join(map(repr, unknown))}: it takes "
                            f"those of OffloadSettings ({', '.join(sorted(known))})")
        return cls(**options)

    def with_fraction(self, offload_fraction: float) -> OffloadSettings:
        return dataclasses.replace(self, offload_fraction=offload_fraction)

    @property
    def bucket_bytes(self) -> int:
        return int(self.bucket_size_mb * 2**20)

    def storage(self, pin: bool, copies, clock, params):
        """The storage tier asked for (:func:`~lightning_fastopt.offload.split_tier.make_storage`)."""
        return make_storage(self.offload_optimizer_device, self.nvme_path, self.nvme_window_mb, pin, copies, clock,
                            self.host_state_gib, self.host_reserve_gib, self.processes_per_host, params)

    def check_device(self, device: torch.device) -> None:
        """Refuse what the parameters' ``device`` rules out: host shards off the CPU or copied,
        a delayed update without separate masters to delay it on."""
        if self.host_shards and (device.type != "cpu" or self.copy_on_cpu):
            raise ValueError(f"host_shards=True: the parameters are FSDP's shards in host memory, their own masters "
                             f"updated in place; got parameters on {device} and copy_on_cpu={self.copy_on_cpu} "
                             "(masters kept apart and copied)")
        if self.delayed_update and device.type == "cpu" and not self.copy_on_cpu:
            raise ValueError("delayed_update=True needs host masters apart from the model's weights: an accelerator, "
                             "or copy_on_cpu=True on a CPU run")

    def state_dtype_for(self, optimizer: FusedOptimizer) -> torch.dtype | None:
        """The dtype of the host buckets' Adam moments: ``host_state_dtype``, or ``optimizer``'s
        own (None: float32 state, the optimizers' default)."""
        if self.host_state_dtype is None:
            own = getattr(optimizer, "state_dtype", torch.float32)
            return None if own == torch.float32 else own
        amsgrad = any(g.get("amsgrad", False) for g in optimizer.param_groups)
        dtype = check_state_dtype(self.host_state_dtype, amsgrad)
        if dtype != torch.float32 and not isinstance(optimizer, FusedAdam):
            raise ValueError(f"host_state_dtype={self.host_state_dtype!r} keeps Adam's moments in bfloat16: it is for "
                             f"Adam/AdamW (FusedAdam), got {type(optimizer).__name__}")
        return None if dtype == torch.float32 else dtype
