"""OffloadOptimizer: one optimizer step split between the accelerator and the CPU.

A fraction of the parameters (``offload_fraction`` of all elements, see
:func:`~lightning_fastopt.offload.partition.choose_offloaded`) keep their float32 master
weights and optimizer state in (pinned) host memory and are updated by the CPU kernels;
the rest are updated where they live by the same optimizer class.  On an accelerator:

1. during backward, a post-accumulate-grad hook on each offloaded parameter copies its
   gradient into a pinned host buffer on a side stream and frees the device gradient;
   the last copy of a bucket (about ``bucket_size_mb`` of parameters) records an event
   (``device_grads="copy_in_backward"``; see below for the other modes);
2. ``step()`` launches the device share's update on the compute stream (asynchronous),
   then for each bucket in the order its gradients were produced: waits for that
   bucket's copies, runs the CPU kernel (reading fp16/bf16/fp32 gradients, unscaling,
   updating the master and state, writing the model-dtype copy in the same pass) and
   starts that bucket's host-to-device copy on another side stream while the CPU moves
   on to the next bucket;
3. the compute stream waits (on the device, not the host) for the last copy before the
   next forward; with ``forward_waits="module"``, for each bucket's copy only before the
   forward of a module that owns its parameters
   (:mod:`~lightning_fastopt.offload.forward_waits`).

On a CPU-only run the same code runs with nothing to copy: an offloaded float32
parameter is its own master.

That is the synchronous schedule; when the host buckets' updates run (at the step,
streamed into backward, speculated and checked at the step, or delayed by one step) is
the business of the schedule classes (:mod:`~lightning_fastopt.offload.schedule`); this
class keeps the buffers, the copies and the state.

Where the gradients of offloaded parameters live, and when they leave (``device_grads``),
is the gradient intake's business (:mod:`~lightning_fastopt.offload.grad_intake`).

Every parameter given to the optimizer is handled as torch does: one that does not
require gradients, or has no gradient at a step, is not stepped; a frozen one that
becomes trainable (``requires_grad_(True)``) is stepped from then on,
:meth:`add_param_group` works at any time, and one listed several times in a group is
updated once per listing, as by torch (see ``FusedOptimizer._repeat_buckets``).

One source of truth: the model's parameters.  A master copy is refreshed from its
parameter whenever the parameter was written by anything but this optimizer
(``load_state_dict``, a checkpoint restore, a callback, a write through ``.data``),
detected from the tensor's version counter and a fingerprint of its bits
(:mod:`~lightning_fastopt.offload.weight_watch`): for an offloaded parameter on the
gradient stream as its bucket's gradients leave (the answer lands with them, so the
step never waits for the rest of backward; in the ``"copy_in_backward"`` mode no user
code runs between backward and the step), for the others when the step starts.
:meth:`refresh_master_weights` forces it.

The optimizer wraps a :class:`~lightning_fastopt.optim.base.FusedOptimizer` and shares
its ``param_groups`` dicts (and so the user's, when that one was mapped from a
torch.optim optimizer): LR schedulers bound to either keep working.  What the precision
plugin and the strategy may use of it is the contract of
:class:`~lightning_fastopt.optim.wrapper.OptimizerWrapper`.  Its state dict is
keyed by parameter name (:mod:`lightning_fastopt.checkpoint.named_state`), identical for every
offload fraction and loadable by torch.optim.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch import Tensor
from typing_extensions import override

from lightning_fastopt.functional import grads_all_finite
from lightning_fastopt.offload.copies import CopyStreams
from lightning_fastopt.offload.delayed import DelayedStep, DelayedUpdates, check_delayed_update
from lightning_fastopt.offload.engine_state import EngineState, saved_dtype
from lightning_fastopt.offload.grad_intake import GradIntake, check_device_grads
from lightning_fastopt.offload.share_layout import ShareLayout
from lightning_fastopt.offload.share_updates import ShareUpdates
from lightning_fastopt.offload.forward_waits import WeightsInFlight, check_forward_waits
from lightning_fastopt.offload.schedule import CpuStepSchedule
from lightning_fastopt.offload.pieces import WholeValues
from lightning_fastopt.offload.slots import (HostBucket, ParamSlot, remember_weights, written_by_others,
                                             written_in_bucket)
from lightning_fastopt.offload.shared_methods import run_on_shares
from lightning_fastopt.offload.speculative import SpeculativeStep
from lightning_fastopt.offload.split_tier import check_host_state, make_storage
from lightning_fastopt.offload.state_tiers import check_offload_device
from lightning_fastopt.offload.streamed import StreamedStep
from lightning_fastopt.offload.synchronous import SynchronousStep
from lightning_fastopt.offload.timing import StepTimer
from lightning_fastopt.optim.base import COMPUTE, FusedOptimizer, check_range, needs_step_context
from lightning_fastopt.optim.adam import FusedAdam, check_state_dtype
from lightning_fastopt.optim.user_step import UserStepOptimizer
from lightning_fastopt.optim.wrapper import OptimizerWrapper



class OffloadOptimizer(OptimizerWrapper):
    """Args:
        optimizer: the fused optimizer whose parameters and hyperparameters to run.  Its
            state moves into this optimizer; it is not stepped itself afterwards.
        param_names: a name for each parameter (the module's ``named_parameters``); the
            state dict is keyed by them.  Unnamed parameters are called ``param<i>``.
        offload_fraction: share of parameter elements updated on the CPU, in [0, 1].
        bucket_size_mb: host buffers are allocated, and gradients awaited, in buckets of
            about this many MiB of float32 parameters.
        overlap: copy on side streams, overlapping compute (CUDA); False copies in line.
        pin_memory: allocate the host buffers in page-locked memory (CUDA).
        device_grads: where gradients of offloaded parameters go and when, one of
            :data:`~lightning_fastopt.offload.grad_intake.DEVICE_GRADS`: ``"copy_in_backward"``
            (default), ``"copy_at_step"`` (when something reduces the gradients after the
            hooks fire: DDP across processes), ``"copy_when_reduced"`` (handed over by
            :meth:`grad_reduced` during backward, for the parameters ``reduced_by``
            names), or ``"keep"`` (``p.grad`` stays readable and editable, as in torch).
        wall_clock_breakdown: time each phase of every step into :attr:`last_step_times`
            (synchronizes the device; for diagnosis).
        copy_on_cpu: on a CPU run, keep separate host masters and gradient buffers and
            copy as on an accelerator (the accelerator code path, without one; for tests).
        stream_cpu_step: start each bucket's CPU update (and its copy back) on a worker
            thread as soon as its gradients have landed, while backward goes on, instead
            of when :meth:`step` is called; the result is the same, bit for bit
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
            forward of a module that owns them, once :meth:`modules_wait_for` has named
            the parameters such modules own; see
            :mod:`~lightning_fastopt.offload.forward_waits` for the contract).
        reduced_by: whether a reducer hands a parameter's gradient over during each
            backward (:meth:`grad_reduced`): with ``device_grads="copy_when_reduced"``
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
    """

    def __init__(self, optimizer: FusedOptimizer, param_names: Mapping[Tensor, str] | None = None, *,
                 offload_fraction: float = 1.0, bucket_size_mb: float = 64.0, overlap: bool = True,
                 pin_memory: bool = True, device_grads: str = "copy_in_backward",
                 wall_clock_breakdown: bool = False, copy_on_cpu: bool = False,
                 stream_cpu_step: bool = False, speculate: bool = False, delayed_update: bool = False,
                 delayed_update_warmup: int = 40, host_state_dtype: torch.dtype | str | None = None,
                 forward_waits: str = "step", reduced_by: Callable[[Tensor], bool] | None = None,
                 stays_on_device: Callable[[Tensor], bool] | None = None, host_shards: bool = False,
                 offload_optimizer_device: str = "cpu", nvme_path: str | None = None,
                 nvme_window_mb: float | None = None, host_state_gib: float | str | None = None,
                 host_reserve_gib: float | None = None, processes_per_host: int = 1) -> None:
        super().__init__(optimizer)
        check_offload_device(offload_optimizer_device, nvme_path, nvme_window_mb)
        check_host_state(host_state_gib, host_reserve_gib, offload_optimizer_device)
        _check_arguments(offload_fraction, bucket_size_mb, device_grads, stream_cpu_step, speculate, delayed_update,
                         delayed_update_warmup, forward_waits, reduced_by)
        # every argument but the fraction, for with_fraction()
        self._settings = dict(bucket_size_mb=bucket_size_mb, overlap=overlap, pin_memory=pin_memory,
                              device_grads=device_grads, wall_clock_breakdown=wall_clock_breakdown,
                              copy_on_cpu=copy_on_cpu, stream_cpu_step=stream_cpu_step, speculate=speculate,
                              delayed_update=delayed_update, delayed_update_warmup=delayed_update_warmup,
                              host_state_dtype=host_state_dtype, forward_waits=forward_waits, reduced_by=reduced_by,
                              stays_on_device=stays_on_device, host_shards=host_shards,
                              offload_optimizer_device=offload_optimizer_device, nvme_path=nvme_path,
                              nvme_window_mb=nvme_window_mb, host_state_gib=host_state_gib,
                              host_reserve_gib=host_reserve_gib, processes_per_host=processes_per_host)
        self.stays_on_device = stays_on_device
        self._host_state_dtype = _host_state_dtype(optimizer, host_state_dtype)
        self.offload_fraction = float(offload_fraction)
        self.device_grads = device_grads
        self.schedule: CpuStepSchedule = (
            DelayedStep(self, delayed_update_warmup) if delayed_update else SpeculativeStep(self) if speculate
            else StreamedStep(self) if stream_cpu_step else SynchronousStep(self))
        self.updates = ShareUpdates(self)  # how each share's update runs (plan, run, copy back, worker)
        self.accumulating = False  # set while Lightning accumulates gradients: hooks copy nothing
        params = [p for g in self.param_groups for p in g["params"]]
        devices = {p.device for p in params}
        if len(devices) > 1:
            raise ValueError(f"OffloadOptimizer needs every parameter on one device, got {sorted(map(str, devices))}")
        self.device = params[0].device if params else torch.device("cpu")
        self.copies = CopyStreams(self.device, overlap, copy_on_cpu)
        _check_host_shards(host_shards, self.device, copy_on_cpu)
        self.host_shards = host_shards
        self.forward_waits = forward_waits
        self._in_flight = WeightsInFlight(self.copies, by_module=forward_waits == "module")
        if delayed_update and not self.copies.needed:
            raise ValueError("delayed_update=True needs host masters apart from the model's weights: an accelerator, "
                             "or copy_on_cpu=True on a CPU run")
        self._timer = StepTimer(wall_clock_breakdown, self.copies.synchronize)
        self._param_names = param_names if param_names is not None else {}
        pin = pin_memory and self.copies.is_cuda
        self.layout = ShareLayout(self, optimizer, self._param_names, int(bucket_size_mb * 2**20), pin,
                                  self._host_state_dtype,
                                  make_storage(offload_optimizer_device, nvme_path, nvme_window_mb, pin, self.copies,
                                               self._timer.now, host_state_gib, host_reserve_gib, processes_per_host,
                                               params))
        self._intake = GradIntake(self, device_grads, reduced_by)
        self._compute_done = self.copies.new_event()
        self._said_refreshed = False
        # called as before_updates(grad_scale, context) once the step's gradients are in place,
        # before any update (a wrapper's hook: LocalShardOptimizer gives whole-tensor norms there)
        self.before_updates: Callable[[Any, Any], None] | None = None
        self.layout.add(params)
        self.layout.take_state(optimizer)
        if isinstance(self.schedule, SpeculativeStep) and not self.layout.tier.reserve_snapshots(self._buckets):
            self.schedule = SynchronousStep(self)
        self._ready = True

    # ------------------------------------------------------------------ construction
    # the layout's slots and shares, under the names the schedules and parts read
    @property
    def _slots(self) -> list[ParamSlot]:
        return self.layout.slots

    @property
    def _slot_of(self) -> dict[Tensor, ParamSlot]:
        return self.layout.slot_of

    @property
    def _buckets(self) -> list[HostBucket]:
        return self.layout.buckets

    @property
    def _device_slots(self) -> list[ParamSlot]:
        return self.layout.device_slots

    @property
    def _device_inner(self) -> FusedOptimizer:
        return self.layout.device_inner

    @override
    def _adopt_group(self, group: dict[str, Any]) -> None:
        self.schedule.wait()  # the worker reads the inner optimizers' groups
        self._in_flight.wait_all()  # the new masters are copied from the weights
        self.layout.adopt_group(group)

    def _inner_of(self, slot: ParamSlot) -> FusedOptimizer:
        return self.layout.inner_of(slot)

    def _set_state(self, slot: ParamSlot, state: dict[str, Any]) -> None:
        self.layout.set_state(slot, state)

    # ------------------------------------------------------------------ what users read
    @property
    def offloaded_numel(self) -> int:
        return sum(s.numel for s in self._slots if s.offloaded)

    @property
    def last_step_times(self) -> dict[str, float]:
        """Milliseconds per phase of the last step (``wall_clock_breakdown=True``)."""
        return dict(self._timer.last)

    @property
    def wall_clock_breakdown(self) -> bool:
        """Whether steps are timed phase by phase (settable: ``offload_fraction="auto"``
        times its probe steps)."""
        return self._timer.enabled

    @wall_clock_breakdown.setter
    def wall_clock_breakdown(self, enabled: bool) -> None:
        self._timer.enabled = bool(enabled)

    def owns(self, param: Tensor) -> bool:
        return param in self._slot_of

    def leading_share(self) -> FusedOptimizer | None:
        """The inner optimizer updated first at ``step()`` when the user's own ``step`` runs:
        the device share's, else the first host bucket's where buckets are updated at the step."""
        if not isinstance(self.optimizer, UserStepOptimizer):
            return None
        if self._device_slots:
            return self._device_inner
        return self._buckets[0].inner if self._buckets and self.schedule.host_updates_at_step else None

    @property
    def lands_during_backward(self) -> bool:
        """Whether the host buckets' gradients land in host memory during backward, each
        bucket's update free to start then: copied there by the gradient intake (an
        accelerator, or ``copy_on_cpu``), or handed over there by a reducer (``host_shards``)."""
        return self.copies.needed or self.host_shards

    # ------------------------------------------------------------------ weights on their way
    def modules_wait_for(self, params: set[Tensor]) -> None:
        """``forward_waits="module"``: the modules that own ``params`` wait for their
        weights before their forward (:class:`~lightning_fastopt.offload.forward_waits.ForwardWaits`);
        a bucket with any other parameter is waited for when the step ends."""
        self._in_flight.covered = set(params)

    def wait_for_weights(self, params: list[Tensor] | None = None) -> None:
        """Make the compute stream wait (on the device) for the new weights of ``params``
        still on their way from the last step, or for every one (None): before anything
        but their modules' forward reads them."""
        if not self._in_flight:
            return
        if params is None:
            self._in_flight.wait_all()
        else:
            pieces = self.layout.pieces_of
            self._in_flight.wait_for({s.bucket for p in params if p in pieces for s in pieces[p]})

    def state_of(self, param: Tensor) -> dict[str, Any]:
        """The optimizer state of a model parameter (empty before its first step).  The
        state lives in inner optimizers, not in ``self.state``: Lightning moves whatever
        ``self.state`` holds to the accelerator, which would undo the offload.  With the
        state on disk, a copy as a checkpoint keeps it, in files of its own
        (:meth:`DiskTier.hand_out <lightning_fastopt.offload.state_tiers.DiskTier.hand_out>`)."""
        self.schedule.wait()
        slot = self._slot_of[param]
        tier = self.layout.tier
        if slot.bucket is None or not tier.on_disk:
            return self._inner_of(slot).state.get(slot.master, {})
        whole = WholeValues(tier.hand_out, tier.blank, saved_dtype)  # (a split parameter's pieces put together)
        for members in self.layout.in_residence(self.layout.pieces_of[param], writes=False):
            for s in members:  # (the tensors point at nothing after)
                for k, v in self._inner_of(s).state.get(s.master, {}).items():
                    whole.add(s, k, v)
        return whole.by_name.get(slot.name, {})

    # ------------------------------------------------------------------ gradients
    def grad_reduced(self, param: Tensor, grad: Tensor | None = None, landing: Any = None) -> None:
        """A reducer (``reduced_by``) hands over ``param``'s final gradient: ``grad``, or
        ``param.grad`` (the reduction landed there), taken as a backward hook takes one.
        ``landing`` (``host_shards``): an event the gradient's copy into host memory recorded,
        still on its way (FSDP's), which whatever reads it waits for first."""
        self._intake.reduced(param, grad, landing)

    def gradients(self) -> list[Tensor]:
        """Every gradient the next step will use, where the step will read it (offloaded
        ones in host memory, once landed; with ``device_grads="keep"`` every one in
        ``p.grad``, copied when the step starts): for overflow checks and gradient
        clipping, which may scale them in place."""
        return [g for _, g in self._intake.read()]

    @override
    def gradient_norm(self, grad_scale: float = 1.0) -> Tensor:
        return self._intake.gradient_norm(grad_scale)

    def gradient_norms_by_param(self, grad_scale: float = 1.0) -> dict[Tensor, Tensor]:
        """The L2 norm of each gradient the next step reads, unscaled by ``grad_scale``, as
        torch's ``_foreach_norm`` takes it on the gradient's device (an offloaded one: before
        it left the device; :mod:`~lightning_fastopt.offload.grad_norms`)."""
        return self._intake.gradient_norms_by_param(grad_scale)

    def scale_gradients(self, coef: Tensor) -> None:
        """Multiply every gradient the next step reads by ``coef``: those on the device now,
        a host bucket's in its update, on the thread that runs it (:meth:`GradIntake.scale
        <lightning_fastopt.offload.grad_intake.GradIntake.scale>`), the same bits."""
        self._intake.scale(coef)

    def gradients_by_param(self) -> dict[Tensor, Tensor]:
        """:meth:`gradients`, each under its parameter (a parameter split into pieces with the
        state on disk: its pieces' put together, a copy)."""
        return self._intake.by_param()

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.host_shards:  # an update the last step left running reads FSDP's gradients where they are
            self.schedule.wait()
        super().zero_grad(set_to_none)
        self._intake.renew()

    def step_skipped(self) -> None:
        """Updates begun during backward are undone now (speculated ones: their masters,
        state and in-place weights put back), not at ``zero_grad``: Lightning runs the next
        forward before it, and FSDP's host shards updated in place are the weights it reads."""
        self.schedule.skipped()

    # ------------------------------------------------------------------ the delayed update
    def apply_pending_update(self) -> int:
        """Send the weights of the delayed update still pending to the model now, so that
        the model holds the masters (the next step then starts from them, as after a
        synchronous step); :meth:`close` does it when training ends.  A weight something
        else wrote since the last step keeps the write.  Returns how many weights it sent."""
        return self.schedule.apply_pending()

    def count_steps_from(self, steps: int) -> None:
        """A run resumed at step ``steps`` from a checkpoint that holds no delayed update
        (torch's layout, written with the update applied): the delayed update's warm-up
        counts from there, as the saving run's did."""
        delayed = self._delayed
        if delayed is not None:
            delayed.steps = max(delayed.steps, steps)

    @property
    def _delayed(self) -> DelayedUpdates | None:
        """The delayed updates' record (``delayed_update=True``), else None."""
        return self.schedule.updates if isinstance(self.schedule, DelayedStep) else None

    def state_beside_parameters(self) -> dict[Any, Any]:
        """(:class:`~lightning_fastopt.offload.engine_state.EngineState`)"""
        return EngineState(self).beside_parameters()

    def run_method(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """The user's method ``name`` on every share (:mod:`~lightning_fastopt.offload.shared_methods`)."""
        return run_on_shares(self, name, args, kwargs)

    # ------------------------------------------------------------------ masters
    def refresh_master_weights(self, only_changed: bool = False) -> int:
        """Copy the model's parameters into the separate float32 masters; returns how many."""
        self._in_flight.wait_all()
        slots = written_by_others(self._slots) if only_changed else [s for s in self._slots if s.separate_master]
        return self._refresh(slots)

    def _refresh(self, slots: list[ParamSlot]) -> int:
        for members in self.layout.in_residence(slots):
            for s in members:
                s.master.copy_(s.weight())
        remember_weights(slots)
        return len(slots)

    def _refresh_written(self, slots: list[ParamSlot]) -> None:
        """Refresh the masters of parameters written by others (found before a step)."""
        if self._refresh(slots) and not self._said_refreshed:
            self._said_refreshed = True
            rank_zero_info(f"lightning_fastopt: {len(slots)} master weight(s) refreshed from the model, whose "
                           "weights were changed outside the optimizer (said once; it is checked before every step)")

    # ------------------------------------------------------------------ step
    def _take_step(self, grad_scale, check_finite: bool, step_context: Any) -> bool:
        timer = self._timer
        timer.start_step()
        self._in_flight.wait_all()  # weights of the last step that no forward waited for
        # the device share's check; each host bucket's is made before its update (written_in_bucket:
        # travelled with its gradients, GradIntake._sent, or made then where the weights are on the host)
        self._refresh_written(written_by_others(self._device_slots))
        needs_all = check_finite or (step_context is COMPUTE and needs_step_context(self.optimizer))
        self.schedule.check_step(needs_all, grad_scale, step_context)
        with timer.phase("grad_d2h"):
            self._intake.send_pending()
        self.copies.mark_compute_done(self._compute_done)
        sent, sent_buckets = self.schedule.before_step()
        if needs_all:
            with timer.phase("grad_d2h"):
                grads = self.gradients()
            if check_finite and not grads_all_finite(grads):
                self.schedule.skipped()
                self._end_step(sent, sent_buckets)
                return True
            context = self.optimizer.step_context(grads, grad_scale) if step_context is COMPUTE else step_context
        else:
            context = None if step_context is COMPUTE else step_context
        if self.before_updates is not None:
            self.before_updates(grad_scale, context)
        with timer.phase("gpu_step"):
            written = self.updates.step_inner(self._device_inner, self._device_slots, grad_scale, context)
        host_written, host_sent = self.schedule.host_step(grad_scale, context)
        if self.before_updates is not None:
            self.give_norms(None)
        self._end_step(written + host_written + sent, sent_buckets + host_sent)
        return False

    # ------------------------------------------------------------------ norms over whole tensors
    def norm_sums(self, grad_scale, context) -> dict[Tensor, Tensor]:
        """For an optimizer with ``whole_tensor_norms`` (LAMB, LARS): each parameter's
        squared norms that its update in the step now under way reads, over what this
        optimizer holds of it (every share's; nothing written:
        :meth:`~lightning_fastopt.optim.base.FusedOptimizer.norm_sums`).  For a
        :attr:`before_updates` hook, where the gradients are in place."""
        out = self.updates.norm_sums(self._device_inner, self._device_slots, grad_scale, context)
        for i, bucket in enumerate(self._buckets):
            self.copies.wait_on_host(bucket.grads_ready)
            self._refresh_written(written_in_bucket(bucket))  # (as its update would first)
            self.layout.tier.prefetch(self._buckets[i:])
            with self.layout.tier.resident(bucket, writes=False):
                out.update(self.updates.norm_sums(bucket.inner, bucket.slots, grad_scale, context))
        return out

    def give_norms(self, norms: Mapping[Tensor, Tensor] | None) -> None:
        """Each parameter's squared norms over its whole tensor (the pieces' :meth:`norm_sums`
        summed), for this step's updates; None: each takes its own again."""
        given = None if norms is None else {s.master: norms[s.param] for s in self._slots if s.param in norms}
        for inner in self._inners():
            inner.given_norms = given

    def _end_step(self, written: list[ParamSlot], sent: list[HostBucket]) -> None:
        """The next forward waits for the weights sent to the device (``sent``: their
        buckets, in the order sent; on the device, not the host: when the step ends, or
        in forward with ``forward_waits="module"``); ``written``: the parameters this step wrote."""
        self._in_flight.arrive_later(sent)
        # a sent bucket's were noted as its update left them (behind their copies: ShareUpdates.send_weights);
        # the others' fingerprints still hold: nothing wrote them since the check
        sent_buckets = set(sent)
        remember_weights([s for s in written if s.separate_master and s.bucket not in sent_buckets])
        self._intake.renew()
        self._timer.add("cpu_step_background", self.updates.take_background_ms())  # the worker's, all joined now
        for name, value in [*self.schedule.breakdown().items(), *self.layout.tier.breakdown().items()]:
            self._timer.add(name, value)
        self._timer.end_step()
        self.layout.tier.end_step()

    def _inners(self) -> list[FusedOptimizer]:
        return self.layout.inners()

    # ------------------------------------------------------------------ state dict
    def state_dict(self) -> dict[str, Any]:
        """Keyed by parameter name (:class:`~lightning_fastopt.offload.engine_state.EngineState`)."""
        return EngineState(self).saved()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """A state dict of this class (any offload fraction) or of the torch.optim equivalent
        (:class:`~lightning_fastopt.offload.engine_state.EngineState`)."""
        EngineState(self).load(state_dict)

    # ------------------------------------------------------------------ another fraction
    def with_fraction(self, offload_fraction: float) -> OffloadOptimizer:
        """The same optimizer with another offload fraction, between steps: a new one over
        the same parameters and groups (LR schedulers keep theirs) with every other
        setting, this one's state, float32 masters, skipped-step count and pending
        delayed update moved over; the result is what this one would have computed.
        This one is closed."""
        check_range("offload_fraction", offload_fraction, 0.0, 1.0)
        new = type(self)(self.optimizer, self._param_names, offload_fraction=offload_fraction, **self._settings)
        new.before_updates = self.before_updates  # a wrapper's hook goes with it (LAMB's norms on FSDP's rows)
        return EngineState(self).moved_to(new)

    # ------------------------------------------------------------------ teardown
    def close(self, apply_pending: bool = True) -> None:
        """Remove the backward hooks and wait for copies in flight (the host buffers go
        with the optimizer); ``apply_pending``: send a delayed update still pending to the
        model (training has ended)."""
        self._intake.remove()
        self.schedule.end()
        self._in_flight.wait_all()
        if apply_pending:
            self.apply_pending_update()
        else:
            self.schedule.wait()
        self.updates.shutdown()
        self.copies.synchronize()
        self.layout.tier.close()

    def _describe(self) -> str:
        total = sum(s.numel for s in self._slots)
        share = self.offloaded_numel / total if total else 0.0
        # whole tensors from the end: a large last tensor can take far more than was asked
        why = ", whole tensors from the end" if share > self.offload_fraction + 0.05 else ""
        return (f"OffloadOptimizer({type(self.optimizer).__name__}, offload_fraction={self.offload_fraction}, "
                f"offloaded={self.offloaded_numel} of {total} elements ({share:.0%}{why}), "
                f"{len(self._buckets)} host bucket(s), CPU step {self.schedule.name}, device={self.device})")


def _check_arguments(offload_fraction, bucket_size_mb, device_grads, stream_cpu_step, speculate, delayed_update,
                     delayed_update_warmup, forward_waits, reduced_by) -> None:
    """Refuse, by name, an argument of :class:`OffloadOptimizer` or a combination that cannot work."""
    check_range("offload_fraction", offload_fraction, 0.0, 1.0)
    check_range("bucket_size_mb", bucket_size_mb, 0.0, low_open=True)
    check_device_grads(device_grads, stream_cpu_step, reduced_by)
    check_delayed_update(delayed_update, delayed_update_warmup, stream_cpu_step)
    if not isinstance(speculate, bool) or (speculate and not stream_cpu_step):
        raise ValueError(f"speculate=True checks the updates stream_cpu_step=True starts during backward: it "
                         f"needs stream_cpu_step=True, got speculate={speculate!r}, "
                         f"stream_cpu_step={stream_cpu_step!r}")
    check_forward_waits(forward_waits)


def _check_host_shards(host_shards: Any, device: torch.device, copy_on_cpu: bool) -> None:
    if not isinstance(host_shards, bool):
        raise TypeError(f"host_shards must be True or False, got {host_shards!r}")
    if host_shards and (device.type != "cpu" or copy_on_cpu):
        raise ValueError(f"host_shards=True: the parameters are FSDP's shards in host memory, their own masters "
                         f"updated in place; got parameters on {device} and copy_on_cpu={copy_on_cpu} (masters kept "
                         "apart and copied)")


def _host_state_dtype(optimizer: FusedOptimizer, asked: Any) -> torch.dtype | None:
    """The dtype of the host buckets' Adam moments: ``asked``, or the wrapped optimizer's own
    (None: float32 state, the optimizers' default)."""
    if asked is None:
        own = getattr(optimizer, "state_dtype", torch.float32)
        return None if own == torch.float32 else own
    amsgrad = any(g.get("amsgrad", False) for g in optimizer.param_groups)
    dtype = check_state_dtype(asked, amsgrad)
    if dtype != torch.float32 and not isinstance(optimizer, FusedAdam):
        raise ValueError(f"host_state_dtype={asked!r} keeps Adam's moments in bfloat16: it is for Adam/AdamW "
                         f"(FusedAdam), got {type(optimizer).__name__}")
    return None if dtype == torch.float32 else dtype

