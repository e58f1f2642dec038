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
updated once per listing, as by torch (see :func:`~lightning_fastopt.optim.bucketing.repeat_buckets`).

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
from torch import Tensor
from typing_extensions import override

from lightning_fastopt.functional import grads_all_finite
from lightning_fastopt.offload.copies import CopyStreams
from lightning_fastopt.offload.delayed import DelayedStep
from lightning_fastopt.offload.engine_state import EngineState
from lightning_fastopt.offload.grad_intake import GradIntake
from lightning_fastopt.offload.share_layout import ShareLayout
from lightning_fastopt.offload.share_updates import ShareUpdates
from lightning_fastopt.offload.forward_waits import WeightsInFlight
from lightning_fastopt.offload.schedule import CpuStepSchedule
from lightning_fastopt.offload.master_refresh import MasterRefresh
from lightning_fastopt.offload.slots import HostBucket, ParamSlot, remember_weights, written_by_others
from lightning_fastopt.offload.shared_methods import run_on_shares
from lightning_fastopt.offload.speculative import SpeculativeStep
from lightning_fastopt.offload.settings import OffloadSettings
from lightning_fastopt.offload.streamed import StreamedStep
from lightning_fastopt.offload.synchronous import SynchronousStep
from lightning_fastopt.offload.timing import StepTimer
from lightning_fastopt.optim.base import COMPUTE, FusedOptimizer, needs_step_context
from lightning_fastopt.optim.user_step import UserStepOptimizer
from lightning_fastopt.optim.wrapper import OptimizerWrapper



class OffloadOptimizer(OptimizerWrapper):
    """Args:
        optimizer: the fused optimizer whose parameters and hyperparameters to run.  Its
            state moves into this optimizer; it is not stepped itself afterwards.
        param_names: a name for each parameter (the module's ``named_parameters``); the
            state dict is keyed by them.  Unnamed parameters are called ``param<i>``.
        settings: what to do (:class:`~lightning_fastopt.offload.settings.OffloadSettings`,
            each argument documented there), or its arguments as keywords
            (``offload_fraction=0.5, stream_cpu_step=True, ...``).
    """

    def __init__(self, optimizer: FusedOptimizer, param_names: Mapping[Tensor, str] | None = None,
                 settings: OffloadSettings | None = None, **options: Any) -> None:
        super().__init__(optimizer)
        if settings is not None and options:
            raise TypeError(f"OffloadOptimizer takes settings or their keyword arguments, not both: got settings and "
                            f"{', '.join(sorted(options))}")
        self.settings = settings = settings if settings is not None else OffloadSettings.of("OffloadOptimizer",
                                                                                             options)
        self._host_state_dtype = settings.state_dtype_for(optimizer)
        # the wrapper's contract (OptimizerWrapper): read by the strategies and the auto fraction
        self.offload_fraction, self.device_grads = settings.offload_fraction, settings.device_grads
        self.schedule: CpuStepSchedule = (
            DelayedStep(self, settings.delayed_update_warmup) if settings.delayed_update
            else SpeculativeStep(self) if settings.speculate
            else StreamedStep(self) if settings.stream_cpu_step else SynchronousStep(self))
        self.updates = ShareUpdates(self)  # how each share's update runs (plan, run, copy back, worker)
        self.accumulating = False  # set while Lightning accumulates gradients: hooks copy nothing
        params = [p for g in self.param_groups for p in g["params"]]
        devices = {p.device for p in params}
        if len(devices) > 1:
            raise ValueError(f"OffloadOptimizer needs every parameter on one device, got {sorted(map(str, devices))}")
        self.device = params[0].device if params else torch.device("cpu")
        settings.check_device(self.device)
        self.copies = CopyStreams(self.device, settings.overlap, settings.copy_on_cpu)
        self._in_flight = WeightsInFlight(self.copies, by_module=settings.forward_waits == "module")
        self._timer = StepTimer(settings.wall_clock_breakdown, self.copies.synchronize)
        self._param_names = param_names if param_names is not None else {}
        pin = settings.pin_memory and self.copies.is_cuda
        self.layout = ShareLayout(self, optimizer, self._param_names, settings.bucket_bytes, pin,
                                  self._host_state_dtype, settings.storage(pin, self.copies, self._timer.now, params))
        self._intake = GradIntake(self, settings.device_grads, settings.reduced_by)
        self.masters = MasterRefresh(self.layout, self._in_flight)
        self._compute_done = self.copies.new_event()
        # called as before_updates(grad_scale, context) once the step's gradients are in place,
        # before any update (a wrapper's hook: LocalShardOptimizer gives whole-tensor norms there)
        self.before_updates: Callable[[Any, Any], None] | None = None
        self.layout.add(params)
        self.layout.take_state(optimizer)
        if isinstance(self.schedule, SpeculativeStep) and not self.layout.tier.reserve_snapshots(self.layout.buckets):
            self.schedule = SynchronousStep(self)
        self._ready = True

    # ------------------------------------------------------------------ construction
    @override
    def _adopt_group(self, group: dict[str, Any]) -> None:
        self.schedule.wait()  # the worker reads the inner optimizers' groups
        self._in_flight.wait_all()  # the new masters are copied from the weights
        self.layout.adopt_group(group)

    # ------------------------------------------------------------------ what users read
    @property
    def offloaded_numel(self) -> int:
        return sum(s.numel for s in self.layout.slots if s.offloaded)

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
        return param in self.layout.slot_of

    def leading_share(self) -> FusedOptimizer | None:
        """The inner optimizer updated first at ``step()`` when the user's own ``step`` runs:
        the device share's, else the first host bucket's where buckets are updated at the step."""
        if not isinstance(self.optimizer, UserStepOptimizer):
            return None
        if self.layout.device_slots:
            return self.layout.device_inner
        return self.layout.buckets[0].inner if self.layout.buckets and self.schedule.host_updates_at_step else None

    @property
    def lands_during_backward(self) -> bool:
        """Whether the host buckets' gradients land in host memory during backward, each
        bucket's update free to start then: copied there by the gradient intake (an
        accelerator, or ``copy_on_cpu``), or handed over there by a reducer (``host_shards``)."""
        return self.copies.needed or self.settings.host_shards

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
        ``self.state`` holds to the accelerator, which would undo the offload
        (:meth:`EngineState.state_of <lightning_fastopt.offload.engine_state.EngineState.state_of>`)."""
        return EngineState(self).state_of(param)

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
        if self.settings.host_shards:  # an update the last step left running reads FSDP's gradients where they are
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
        delayed = self.schedule.delayed
        if delayed is not None:
            delayed.steps = max(delayed.steps, steps)

    def state_beside_parameters(self) -> dict[Any, Any]:
        """(:class:`~lightning_fastopt.offload.engine_state.EngineState`)"""
        return EngineState(self).beside_parameters()

    def run_method(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """The user's method ``name`` on every share (:mod:`~lightning_fastopt.offload.shared_methods`)."""
        return run_on_shares(self, name, args, kwargs)

    # ------------------------------------------------------------------ masters
    def refresh_master_weights(self, only_changed: bool = False) -> int:
        """Copy the model's parameters into the separate float32 masters (``only_changed``:
        those something else wrote); returns how many."""
        return self.masters.every(only_changed)

    # ------------------------------------------------------------------ step
    def _take_step(self, grad_scale, check_finite: bool, step_context: Any) -> bool:
        timer = self._timer
        timer.start_step()
        self._in_flight.wait_all()  # weights of the last step that no forward waited for
        # the device share's check; each host bucket's is made before its update (written_in_bucket:
        # travelled with its gradients, GradIntake._sent, or made then where the weights are on the host)
        self.masters.written(written_by_others(self.layout.device_slots))
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
            written = self.updates.step_inner(self.layout.device_inner, self.layout.device_slots, grad_scale, context)
        host_written, host_sent = self.schedule.host_step(grad_scale, context)
        if self.before_updates is not None:
            self.updates.give_norms(None)
        self._end_step(written + host_written + sent, sent_buckets + host_sent)
        return False

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
        new = type(self)(self.optimizer, self._param_names, self.settings.with_fraction(offload_fraction))
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
        total = sum(s.numel for s in self.layout.slots)
        share = self.offloaded_numel / total if total else 0.0
        # whole tensors from the end: a large last tensor can take far more than was asked
        why = ", whole tensors from the end" if share > self.offload_fraction + 0.05 else ""
        return (f"OffloadOptimizer({type(self.optimizer).__name__}, offload_fraction={self.offload_fraction}, "
                f"offloaded={self.offloaded_numel} of {total} elements ({share:.0%}{why}), "
                f"{len(self.layout.buckets)} host bucket(s), CPU step {self.schedule.name}, device={self.device})")

