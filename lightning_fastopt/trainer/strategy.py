"""The Trainer's strategy: Lightning's DDP strategy with lightning_fastopt's fused
optimizers, CPU offload of the optimizer, and its precision plugin; written once for both
Lightning packages (:class:`TrainerStrategy`; the classes users name, ``FastOptStrategy``,
are in :mod:`~lightning_fastopt.trainer.lightning_pytorch` and
:mod:`~lightning_fastopt.trainer.pytorch_lightning`).

``import lightning_fastopt`` registers the names of :data:`STRATEGY_NAMES` (``fastopt``:
fused kernels, no offload; ``fastopt_offload``: every master weight and all optimizer
state in CPU memory; ``fastopt_zero1``/``fastopt_zero2``/``fastopt_zero2_offload``: ZeRO);
``Trainer(strategy="fastopt_offload", precision="16-mixed")`` then needs no other change
to a Lightning project.  What the strategy adds to ``DDPStrategy`` (so devices,
launchers, cluster environments and torchrun work as in Lightning):

- the precision flag becomes the front-end's ``FastOptPrecision``
  with the strategy's loss-scale knobs (``"32-true"``, ``"16-mixed"``, ``"bf16-mixed"``;
  anything else is a TypeError naming those);
- the optimizer from ``configure_optimizers`` (or the CLI) is mapped to the fused
  equivalent (:func:`~lightning_fastopt.optim.from_torch.to_fused_optimizer`), sharing
  the very same ``param_groups`` dicts, so LR schedulers keep working;
- that optimizer runs inside an :class:`~lightning_fastopt.offload.OffloadOptimizer`
  (``offload_fraction`` of the master weights and optimizer state in pinned CPU memory,
  copies overlapping compute), or a :class:`~lightning_fastopt.zero.ZeroOptimizer` with
  ``zero_stage``; the rest of the strategy speaks to both through the contract of
  :class:`~lightning_fastopt.optim.wrapper.OptimizerWrapper`;
- optimizer state is checkpointed keyed by parameter name (torch-compatible, the same
  for every offload fraction; ZeRO writes a directory of shards,
  :func:`~lightning_fastopt.checkpoint.sharded.save_sharded`), checkpoints are written
  atomically;
- gradients stay in ``p.grad`` until the step, as in torch, when user code can read them
  (:func:`~lightning_fastopt.trainer.grad_readers.gradient_readers`); otherwise the offloaded
  ones are copied to the host during backward and freed on the device (one log line
  says which and why);
- with one process it is a single-device strategy, as ``Trainer()``'s: no process group,
  no DistributedDataParallel wrapper, the user's sampler kept, the RNG not reseeded
  (its twin class, :mod:`~lightning_fastopt.trainer.one_process`).

The work is done in those modules; the hooks here call them.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_fastopt import ops
from lightning_fastopt.core.cpu_threads import TorchThreads
from lightning_fastopt.core.ddp_reductions import DDPReductions
from lightning_fastopt.core.engines import check_ddp_kwargs, fused_for, register_names, wrap_fused_optimizer
from lightning_fastopt.core.options import StrategyOptions, offload_arguments
from lightning_fastopt.from_deepspeed.arguments import from_deepspeed, signature_defaults
from lightning_fastopt.from_deepspeed.trainer_optimizers import set_up_optimizers
from lightning_fastopt.from_deepspeed.trainer_settings import give_the_trainer
from lightning_fastopt.offload.forward_waits import ForwardWaits
from lightning_fastopt.optim.takeover import engine_of
from lightning_fastopt.optim.wrapper import OptimizerWrapper
from lightning_fastopt.plan.ddp_plan import plan_ddp_run
from lightning_fastopt.plan.gradients import zero_stage_that_runs
from lightning_fastopt.plan.run_plan import OptimizerPlan, RunPlan
from lightning_fastopt.trainer.auto_fraction_steps import AutoFractionSteps
from lightning_fastopt.trainer.engine_checkpoints import EngineCheckpoints
from lightning_fastopt.trainer.engine_hooks import EngineHooks
from lightning_fastopt.trainer.grad_readers import gradient_readers
from lightning_fastopt.trainer.one_process import take_twin_class, without_twin
from lightning_fastopt.trainer.package import TrainerPackage, refuse_in_the_other_package
from lightning_fastopt.trainer.precision import TrainerPrecision
from lightning_fastopt.trainer.precision_slot import PrecisionAdoption, PrecisionSlot
from lightning_fastopt.trainer.run_facts import ddp_run
from lightning_fastopt.trainer.step_times import log_step_times

__all__ = ["TrainerStrategy"]


class TrainerStrategy(EngineHooks, PrecisionSlot):
    """DDP with fused optimizer steps, CPU offload of the optimizer and DeepSpeed-style
    fp16 loss scaling.  Each argument is described at length in docs/strategy.md.

    Args:
        offload_fraction: share of the parameters (by element count) whose fp32 masters
            and optimizer state live in host memory, updated by the CPU kernels, in [0, 1].
            ``"auto"``: chosen after the first steps from their timings, the largest
            fraction whose CPU update hides behind the accelerator's work (or more, to fit
            ``gpu_memory_budget_gb``); one log line says which and why.
        gpu_memory_budget_gb: with ``"auto"``, the accelerator memory the run may use at
            its peak (CUDA); None: no budget.
        overlap: copy gradients down and weights back on side streams (CUDA).
        pin_memory: page-locked host buffers (CUDA).
        bucket_size_mb: offloaded parameters are handled in buckets of about this many
            MiB (fp32); the CPU starts on a bucket once its gradients have landed.
        cpu_threads: threads of the CPU step (and of torch on this process); default: on an
            accelerator, this process's cores divided by the processes per node, else torch's.
        bind_cpu_threads: the CPU step's threads on the first ``cpu_threads`` cores, the
            thread that launches the accelerator's work on the rest (one log line says
            which); with ``stream_cpu_step`` or ``delayed_update``; the bits do not change.
        loss_scale: 0 for dynamic loss scaling (fp16), or a fixed scale.
        initial_scale_power: dynamic scaling starts at ``2 ** initial_scale_power``.
        loss_scale_window: clean steps before the scale doubles.
        hysteresis: overflows tolerated before the scale halves.
        min_loss_scale: the scale never goes below this.
        at_min_loss_scale: an fp16 step that overflows at the minimum scale: ``"raise"``
            (default, as DeepSpeed), ``"warn"`` or ``"skip"``.
        wall_clock_breakdown: log each step's phases (grad copy, GPU step, CPU step, weight
            copy, in ms) and the loss scale to the loggers; it synchronizes the device.
        zero_stage: 0 (all state on every rank), 1 (masters and state sharded across the
            data-parallel ranks, each shard offloaded by ``offload_fraction``) or 2 (the
            gradients too, reduced to their owner during backward, without a DDP wrapper);
            stage 2 reduces as stage 1 where user code reads gradients.
        copy_on_cpu: on a CPU run, separate host masters and copies, as on an accelerator
            (that code path without one; for tests).
        keep_gradients: keep gradients in ``p.grad`` until the next ``zero_grad`` even where
            no overridden hook is seen to read them (costs the device memory the early
            copy saves).
        stream_cpu_step: start each host bucket's CPU update during backward, once its
            gradients have landed (bit for bit); where the step checks every gradient first
            (fp16, clipping, LAMB) the update is speculative and kept apart until then
            (the offloaded state twice in host memory).  One log line says which schedule
            runs, or why none.
        delayed_update: after ``delayed_update_warmup`` synchronous steps, the CPU update
            runs during the next forward and backward, which use weights one update old
            (ZeRO-Offload's delayed parameter update; changes the math).  Not with ZeRO or
            ``stream_cpu_step``.
        delayed_update_warmup: synchronous optimizer steps before the update is delayed.
        host_state_dtype: ``"float32"`` (default) or ``"bfloat16"`` (stochastic rounding;
            changes the math): the offloaded Adam moments' dtype in host memory;
            checkpoints hold float32 either way.  Adam/AdamW, not with ZeRO.
        forward_waits: ``"step"`` (default: the next forward starts once every new weight
            is back) or ``"module"``: each module's forward waits only for its own weights
            (same results; used where nothing else reads weights between steps, else one
            log line says why not).  Not with ZeRO.
        closure_optimizers: optimizer classes, or names, whose ``step`` evaluates the
            closure again after changing the weights (SAM): run as torch runs them, not
            offloaded, as LBFGS is.
        per_parameter_optimizers: optimizer classes, or names, with a ``step`` of their own
            that updates each parameter from its own gradient and state alone: stepped on
            the strategy's shares; any other class with its own step runs as torch runs it.
        offload_optimizer_device: ``"cpu"`` (default) or ``"nvme"``: the offloaded masters
            and state in a working file in ``nvme_path``, read and written bucket by bucket
            through ``nvme_window_mb`` of host memory; the same results, bit for bit.
        nvme_path: the directory of that file, for ``"nvme"``.
        nvme_window_mb: the most host memory the disk tier's window may take, for
            ``"nvme"``; None: what two buckets need, 512 MiB at most.
        host_state_gib: with ``"nvme"``, up to this many GiB of the offloaded state kept in
            host memory (whole buckets), the rest on disk; ``"auto"``: what the host has
            free at set-up, less the reserve; None (default): all on disk.  Bit for bit;
            checkpoints do not depend on it.
        host_reserve_gib: with ``host_state_gib="auto"``, GiB left free (None: a tenth of
            the machine's memory).
        zero_optimization, stage, offload_optimizer, config: Lightning's ``DeepSpeedStrategy``
            arguments with its meaning (``config``: a dict or a JSON file's path); then
            DeepSpeed's defaults hold and ``zero_stage``/``offload_fraction`` must agree or be
            left out.  Its other arguments come through ``**kwargs``: of no effect (said
            once) or refused with the reason (docs/from_deepspeed.md).
        **kwargs: passed to Lightning's ``DDPStrategy``.

    A mixin: each front-end's ``FastOptStrategy`` puts it before its package's
    ``DDPStrategy``, and its one-process twin before ``SingleDeviceStrategy``; both name the
    package (``package``) and its precision plugin (``precision_type``).
    """
    strategy_name = "fastopt_offload"
    package: TrainerPackage
    precision_type: type[TrainerPrecision]

    def __init__(self, offload_fraction: float | str = 1.0, overlap: bool = True, pin_memory: bool = True,
                 bucket_size_mb: float = 64.0, cpu_threads: int | None = None, bind_cpu_threads: bool = False,
                 loss_scale: float = 0.0,
                 initial_scale_power: int = 16, loss_scale_window: int = 1000, hysteresis: int = 2,
                 min_loss_scale: float = 1.0, at_min_loss_scale: str = "raise", wall_clock_breakdown: bool = False,
                 zero_stage: int = 0,
                 copy_on_cpu: bool = False, keep_gradients: bool = False, stream_cpu_step: bool = False,
                 delayed_update: bool = False, delayed_update_warmup: int = 40,
                 gpu_memory_budget_gb: float | None = None, host_state_dtype: str = "float32",
                 forward_waits: str = "step", closure_optimizers: Sequence[str] = (),
                 per_parameter_optimizers: Sequence[str] = (), offload_optimizer_device: str = "cpu",
                 nvme_path: str | None = None, nvme_window_mb: float | None = None,
                 host_state_gib: float | str | None = None, host_reserve_gib: float | None = None,
                 zero_optimization: bool | None = None, stage: int | None = None,
                 offload_optimizer: bool | None = None, config: dict | str | None = None, **kwargs: Any) -> None:
        deepspeed = from_deepspeed(locals(), signature_defaults(TrainerStrategy.__init__), kwargs,
                                   strategy=type(self).__name__)
        check_ddp_kwargs(kwargs, self.package.DDPStrategy, type(self))
        ops.check_environment()
        options = StrategyOptions.from_arguments(deepspeed.arguments)
        # the checked values as attributes (self.offload_fraction, ...): the hooks below read them
        for name, value in vars(options).items():
            if name != "scale_knobs":
                setattr(self, name, value)
        self.plan: RunPlan | None = None  # the plan of the run's optimizers, made at set-up
        self._forward_waits: ForwardWaits | None = None  # the modules' forward pre-hooks (forward_waits="module")
        self._stepping = False  # in optimizer_step (a backward outside it, automatic optimization: accumulating)
        self._ddp_reductions: DDPReductions | None = None  # DDP's buckets handed over as reduced (stream_cpu_step)
        # before Lightning's __init__, which sets the precision plugin (a plugin we cannot step with is kept)
        self._precisions = PrecisionAdoption(self.precision_type, options.scale_knobs)
        self._threads = TorchThreads()
        self._deepspeed = deepspeed  # what DeepSpeed's words ask of the Trainer, given it at connect()
        super().__init__(**kwargs)  # (EngineHooks makes self._engines: the engines, once set up)
        deepspeed.say()
        self._checkpoints = EngineCheckpoints(self._engines, self.zero_stage)
        self._auto_fraction = AutoFractionSteps(self._engines)

    def __ne__(self, other: object) -> bool:
        """Lightning's Trainer compares its ``strategy`` argument with names (``!= "auto"``)
        before it checks its class: given to the other Lightning package's Trainer, this
        says which class that package takes before Lightning calls the name invalid."""
        if isinstance(other, str):
            refuse_in_the_other_package("FastOptStrategy", self.package, sys._getframe(1).f_globals.get("__name__", ""))
        return super().__ne__(other)

    # ------------------------------------------------------------------ environment
    @override
    def connect(self, model) -> None:
        """Lightning attaches the model (the Trainer known through it) before it checks the
        loop's configuration: a DeepSpeed config's clipping, accumulation and half precision
        are given to the Trainer here (:mod:`~lightning_fastopt.from_deepspeed.trainer_settings`)."""
        super().connect(model)
        give_the_trainer(self._deepspeed, model, getattr(self.precision_plugin, "precision", None))

    @override
    def set_world_ranks(self) -> None:
        """Lightning calls this first once it knows how many processes run (the Trainer is
        being built, then DDP's set-up): with one, the strategy takes the class of its
        single-device twin (:mod:`~lightning_fastopt.trainer.one_process`), whose ranks are
        all 0; else DDP's ranks, from the cluster environment."""
        if not take_twin_class(self, self.num_nodes * self.num_processes):
            super().set_world_ranks()

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self._threads.set(self.cpu_threads, self.num_processes, self.root_device,
                          bind=self.bind_cpu_threads, local_rank=self.local_rank)
        note = without_twin(self)
        if note:
            rank_zero_info(note)
        self.plan = None  # made again for every run (the model, callbacks or optimizers may differ)

    @override
    def configure_ddp(self) -> None:
        if isinstance(self.model, DistributedDataParallel):
            return  # wrapped already (ZeRO stage 2 with an optimizer that runs as torch: setup_optimizers)
        if self.plan is not None:
            stage = self.plan.zero_stage
        else:  # Lightning's set-up, before the optimizers are known: what user code reads decides
            module = self.lightning_module
            stage = zero_stage_that_runs(self.zero_stage, gradient_readers(
                module, module.trainer.callbacks, self.package, self.keep_gradients), ())
        if self.world_size > 1 and stage < 2:
            super().configure_ddp()
        elif self.world_size > 1:  # ZeRO stage 2 reduces the gradients itself: start from rank 0's weights
            self.package.sync_module_states(self.model)
        # one process (a subclass's, see one_process): nothing to all-reduce

    # ------------------------------------------------------------------ optimizers
    @override
    def setup_optimizers(self, trainer) -> None:
        self._precisions.refuse_foreign()
        set_up_optimizers(self, trainer, self._deepspeed, lambda: super(TrainerStrategy, self).setup_optimizers(trainer))
        plan = self.plan = plan_ddp_run(self.optimizers, self, ddp_run(self, trainer), self.package.MockOptimizer)
        plan.say()
        if self.world_size > 1 and plan.zero_stage < 2 and not isinstance(self.model, DistributedDataParallel):
            self.configure_ddp()  # ZeRO stage 2 as stage 1: Lightning's set-up called it before the optimizers
        names = {p: n for n, p in self.lightning_module.named_parameters()}

        def make_engine(opt, planned: OptimizerPlan) -> OptimizerWrapper:
            fused = fused_for(opt, self.lightning_module, self.precision_plugin.precision)
            # its kernels load (or build, saying so) now, not after the first training step
            ops.prepare(self.root_device.type, cpu_work=self.offload_fraction > 0, pieces=fused.kernel_pieces())
            extra = planned.schedule.engine_arguments()
            if planned.schedule.streams and plan.gradients.kind == "copy_at_step":
                extra["reduced_by"] = self._reductions().reduces  # DDP's buckets, handed over as each is reduced
            if plan.weight_waits.by_module:
                extra["forward_waits"] = "module"
            return wrap_fused_optimizer(fused, names, zero_stage=plan.zero_stage, device_grads=plan.gradients.kind,
                                        **offload_arguments(self, processes_per_host=self.num_processes,
                                                          step_cores=self._threads.step_cores), **extra)

        self._engines.take_over(self.optimizers, plan.optimizers, make_engine)
        self.optimizers = self.optimizers  # Lightning's LightningOptimizer wrappers, made anew (EngineHooks)
        if plan.weight_waits.by_module:
            self._forward_waits = ForwardWaits(self.lightning_module, self._engines.offload_optimizers)
            for o in self._engines.offload_optimizers():
                o.modules_wait_for(self._forward_waits.covered)
        self._auto_fraction.start(trainer, self.auto_fraction, self.gpu_memory_budget_gb, self.root_device,
                                  self.broadcast)

    def _reductions(self) -> DDPReductions:
        """DDP's buckets, each handed over to the engines once its all-reduce has completed
        (made once a run)."""
        if self._ddp_reductions is None:
            self._ddp_reductions = DDPReductions(self.model, self._engines.hand_over)
        return self._ddp_reductions

    @override
    def optimizer_step(self, optimizer, closure, model=None, **kwargs: Any) -> Any:
        raw = engine_of(optimizer)
        self._stepping = True
        try:
            out = self._auto_fraction.step(
                optimizer, self.optimizers, closure,
                lambda timed: super(TrainerStrategy, self).optimizer_step(optimizer, timed, model, **kwargs),
                lambda: self.precision_plugin.last_step_skipped)
        finally:
            self._stepping = False
        if self.wall_clock_breakdown:
            log_step_times(self.lightning_module.trainer, self.precision_plugin, raw)
        return out

    # ------------------------------------------------------------------ checkpoints (EngineCheckpoints)
    @property
    @override
    def checkpoint_io(self) -> Any:
        """As Lightning's strategies fill theirs, when first asked: the user's plugin, or
        ours (:meth:`~lightning_fastopt.trainer.engine_checkpoints.EngineCheckpoints.writer`)."""
        self._checkpoint_io = EngineCheckpoints.writer(self._checkpoint_io, self.package.WrappingCheckpointIO)
        return self._checkpoint_io

    @checkpoint_io.setter
    @override
    def checkpoint_io(self, io: Any) -> None:
        self._checkpoint_io = io

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        self._checkpoints.save(checkpoint, filepath, self, lambda c, path: super(TrainerStrategy, self).save_checkpoint(
            c, path, storage_options))

    @override
    def optimizer_state(self, optimizer) -> dict[str, Any]:
        return self._checkpoints.optimizer_state(self.optimizers, optimizer,
                                                 super(TrainerStrategy, self).optimizer_state)

    @override
    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        return self._checkpoints.load(checkpoint_path, weights_only, super(TrainerStrategy, self).load_checkpoint,
                                      self.lightning_module, self.precision_plugin)

    @override
    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        self._checkpoints.load_optimizer_states(checkpoint, self.optimizers)

    # ------------------------------------------------------------------ teardown
    @override
    def teardown(self) -> None:
        self._engines.release(self.optimizers)
        self._threads.restore()
        if self._forward_waits is not None:
            self._forward_waits.remove()
            self._forward_waits = None
        if self._ddp_reductions is not None:
            self._ddp_reductions.close()
            self._ddp_reductions = None
        super().teardown()

    # ------------------------------------------------------------------ registry
    @classmethod
    @override
    def register_strategies(cls, strategy_registry) -> None:
        register_names(cls, strategy_registry)
