"""The Trainer's ZeRO stage 3: Lightning's ``ModelParallelStrategy`` (torch's FSDP2,
``fully_shard`` and DTensor parameters) with lightning_fastopt's optimizer step on each
rank's local shards; written once for both Lightning packages (the classes users name,
``FastOptFSDPStrategy``, are in the front-end modules), registered as ``fastopt_fsdp``
(every rank's shard of masters and state on the device) and ``fastopt_fsdp_offload``
(in CPU memory).

Sharding, collectives, the device mesh and checkpoints are Lightning's and torch's: the
project's ``configure_model`` applies ``fully_shard`` as it does under
``ModelParallelStrategy``; a project without one is sharded by the strategy
(``auto_wrap_policy``, :mod:`~lightning_fastopt.fsdp.auto_shard`).  What the strategy adds:

- each optimizer from ``configure_optimizers`` runs inside a
  :class:`~lightning_fastopt.fsdp.LocalShardOptimizer` (fused kernels where they cover
  it, else the optimizer's own step; ``offload_fraction`` of each rank's fp32 masters and
  state in host memory, stepped by the CPU kernels) while the user's object stays the
  one Lightning, LR schedulers and callbacks see (:mod:`~lightning_fastopt.optim.takeover`);
- the precision plugin is ours (clipping by norm over every shard as torch computes it
  on the DTensor gradients);
- checkpoints are ``ModelParallelStrategy``'s (distributed or full), with the optimizer
  state in torch's layout (DTensors keyed as torch's distributed state dicts key them),
  so a checkpoint written under ``ModelParallelStrategy`` with the torch optimizer
  resumes here and back.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import timedelta
from typing import Any

from torch.distributed.constants import default_pg_timeout
from lightning.fabric.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_fastopt import ops
from lightning_fastopt.core.cpu_threads import TorchThreads
from lightning_fastopt.core.engines import FSDP_DOES_NOT_TAKE, check_passed_kwargs, fused_for, register_fsdp_names
from lightning_fastopt.core.options import StrategyOptions, offload_arguments
from lightning_fastopt.from_deepspeed.arguments import from_deepspeed, signature_defaults
from lightning_fastopt.from_deepspeed.trainer_optimizers import set_up_optimizers
from lightning_fastopt.from_deepspeed.trainer_settings import give_the_trainer
from lightning_fastopt.fsdp import LocalShardOptimizer
from lightning_fastopt.fsdp.auto_shard import check_auto_wrap_policy, shard_model
from lightning_fastopt.fsdp.gradient_landings import HostGradientLandings
from lightning_fastopt.fsdp.host_parameters import (check_host_shards, host_shard_arguments,
                                                    materialize_on_the_host, move_all_but_fsdp_parameters,
                                                    say_host_shards)
from lightning_fastopt.fsdp.mesh_sizes import resolved_mesh_sizes, say_if_nothing_is_sharded
from lightning_fastopt.fsdp.unit_waits import UnitWaits
from lightning_fastopt.plan.fsdp_plan import plan_fsdp_run
from lightning_fastopt.plan.run_plan import OptimizerPlan, RunPlan
from lightning_fastopt.optim.takeover import engine_of
from lightning_fastopt.trainer.auto_fraction_steps import AutoFractionSteps
from lightning_fastopt.trainer.engine_hooks import EngineHooks
from lightning_fastopt.trainer.fsdp_checkpoints import FSDPCheckpoints
from lightning_fastopt.trainer.package import TrainerPackage
from lightning_fastopt.trainer.precision_slot import PrecisionAdoption, PrecisionSlot
from lightning_fastopt.trainer.run_facts import fsdp_run
from lightning_fastopt.trainer.step_times import log_step_times

__all__ = ["FSDPTrainerStrategy"]

class FSDPTrainerStrategy(EngineHooks, PrecisionSlot):
    """FSDP2 (ZeRO stage 3) with the fused, offloaded optimizer step on each rank's shards.

    Args:
        offload_fraction: share of each rank's parameter shards (by element count) whose
            fp32 masters and optimizer state live in CPU memory, updated by the CPU
            kernels, in [0, 1]; the rest are updated on the accelerator.  ``"auto"``: as
            for ``FastOptStrategy``, chosen after the first steps from their timings (on
            each rank's shards; every rank takes rank 0's choice).
        gpu_memory_budget_gb: with ``offload_fraction="auto"``, as for ``FastOptStrategy``.
        overlap, pin_memory, bucket_size_mb, cpu_threads, bind_cpu_threads, wall_clock_breakdown,
                copy_on_cpu, closure_optimizers, loss_scale, initial_scale_power,
            loss_scale_window, hysteresis, min_loss_scale, at_min_loss_scale: as for
            ``FastOptStrategy``.
        keep_gradients: as for ``FastOptStrategy``: without it, where no hook or
            callback of the run reads ``p.grad``, the offloaded rows' gradients leave for
            the host as FSDP's reduce-scatter lands them and are freed on the device
            (``LocalShardOptimizer(device_grads="copy_when_reduced")``); else they stay in
            ``p.grad`` until the step.
        stream_cpu_step: start each host bucket's CPU update during backward, once its
            gradients have landed (speculated where the step checks them first: clipping,
            fp16); bit for bit the step at the step.
        forward_waits: ``"step"`` (default: the next forward starts once every CPU update of
            the step has ended) or ``"module"``: with the parameter shards in host memory
            (``offload_parameters``), the step may end before its CPU updates, and each
            FSDP unit's forward waits for the updates of its own rows before FSDP gathers
            them (:mod:`~lightning_fastopt.fsdp.unit_waits`), so that the next forward runs
            beside the updates of the units it reaches later; bit for bit the same.  Used
            where nothing but the units' forward reads the weights between steps (no hook
            that runs there overridden, the model not compiled), else said in one line; with
            the shards on the device FSDP gathers them on streams of its own, which wait for
            the whole step (said, not used).
        host_state_dtype: as for ``FastOptStrategy``: ``"bfloat16"`` keeps the offloaded
            rows' Adam moments in bfloat16 (stochastic rounding; changes the math);
            checkpoints and the optimizer given back after fit hold them as float32.
        offload_optimizer_device, nvme_path, nvme_window_mb, host_state_gib, host_reserve_gib: as for
            ``FastOptStrategy``:
            ``"nvme"`` keeps the offloaded rows' masters (not the host shards of
            ``offload_parameters``, which are the masters) and state in a file per rank in
            ``nvme_path``.
        delayed_update, delayed_update_warmup: as for ``FastOptStrategy`` (each offloaded
            update runs during the next forward and backward, which use weights one update
            old).  A checkpoint holds the model with the pending update applied (torch's
            layout has no place for it): the save ends that step synchronously, in the
            run that saves as in the one resumed from it.
        auto_wrap_policy: for a LightningModule without ``configure_model`` (the strategy
            shards the model itself, :mod:`~lightning_fastopt.fsdp.auto_shard`): the
            module classes whose instances are sharded (a transformer's block class), or
            None: every submodule with at least ``min_num_params`` parameters not sharded
            below it (torch's size-based policy).  A ``configure_model`` that calls
            ``fully_shard`` keeps its own sharding.
        min_num_params: the size-based policy's threshold (default 100 million, torch's).
        elementwise_optimizers: optimizer classes, or their names, whose ``step`` works
            element by element, to step on each rank's rows (offloaded) like torch's
            elementwise optimizers; any other optimizer without our kernels runs as torch
            runs it, on the DTensor parameters (:mod:`~lightning_fastopt.optim.known_steps`).
        offload_parameters: keep each rank's parameter shards (float32) and their gradients in
            host memory, as FSDP's ``CPUOffloadPolicy`` does (the word of Lightning's
            ``DeepSpeedStrategy``): FSDP copies a unit's weights to the device for its
            forward and backward and brings its gradients back; the host shards are the
            master weights, which the CPU kernels update in place with their state (no
            second copy, nothing of the optimizer on the device). The one-line form applies
            the policy; a ``configure_model`` passes ``offload_policy=CPUOffloadPolicy()`` to
            ``fully_shard`` itself (one that does gets the same without this flag).
            ``offload_fraction`` stays 1; ``delayed_update`` is refused
            (:mod:`~lightning_fastopt.fsdp.host_parameters`).
        data_parallel_size, tensor_parallel_size: the device mesh's sizes; both ``"auto"``
            (the default): every process data-parallel, where Lightning's
            ``ModelParallelStrategy`` makes data parallelism across nodes and tensor
            parallelism within each (:mod:`~lightning_fastopt.fsdp.mesh_sizes`); one given:
            the other from it.
        save_distributed_checkpoint, process_group_backend, timeout: Lightning's
            ``ModelParallelStrategy``'s.

    A mixin: each front-end's ``FastOptFSDPStrategy`` puts it before its package's
    ``ModelParallelStrategy`` and names the package (``package``) and its precision
    plugin (``precision_type``).
    """

    strategy_name = "fastopt_fsdp"
    package: TrainerPackage

    def __init__(self, offload_fraction: float | str = 1.0, overlap: bool = True, pin_memory: bool = True,
                 bucket_size_mb: float = 64.0, cpu_threads: int | None = None, bind_cpu_threads: bool = False,
                 loss_scale: float = 0.0,
                 initial_scale_power: int = 16, loss_scale_window: int = 1000, hysteresis: int = 2,
                 min_loss_scale: float = 1.0, at_min_loss_scale: str = "raise", wall_clock_breakdown: bool = False,
                 copy_on_cpu: bool = False, closure_optimizers: Sequence[str] = (), keep_gradients: bool = False,
                 stream_cpu_step: bool = False, delayed_update: bool = False, delayed_update_warmup: int = 40,
                 gpu_memory_budget_gb: float | None = None, host_state_dtype: str = "float32",
                 forward_waits: str = "step", auto_wrap_policy: Iterable[type] | None = None,
                 min_num_params: int = 100_000_000, elementwise_optimizers: Sequence[str] = (),
                 offload_parameters: bool = False, offload_optimizer_device: str = "cpu",
                 nvme_path: str | None = None, nvme_window_mb: float | None = None,
                 host_state_gib: float | str | None = None, host_reserve_gib: float | None = None,
                 data_parallel_size: int | str = "auto",
                 tensor_parallel_size: int | str = "auto",
                 save_distributed_checkpoint: bool = True, process_group_backend: str | None = None,
                 timeout: timedelta | None = default_pg_timeout, zero_optimization: bool | None = None,
                 stage: int | None = None, offload_optimizer: bool | None = None, config: dict | str | None = None,
                 **kwargs: Any) -> None:
        deepspeed = from_deepspeed(locals(), signature_defaults(FSDPTrainerStrategy.__init__), kwargs,
                                   strategy=type(self).__name__, stage_three=True)
        check_passed_kwargs(kwargs, (), type(self), "ModelParallelStrategy's", FSDP_DOES_NOT_TAKE)
        ops.check_environment()
        options = StrategyOptions.fsdp_from_arguments(type(self).__name__, True, deepspeed.arguments)
        self.options = options
        self._auto_wrap_classes = check_auto_wrap_policy(auto_wrap_policy, min_num_params)
        self._min_num_params = min_num_params
        # before Lightning's __init__, which sets the precision plugin (a plugin we cannot step with is kept)
        self._precisions = PrecisionAdoption(self.precision_type, options.scale_knobs)
        self._threads = TorchThreads()
        self._unit_waits: UnitWaits | None = None  # the FSDP units' forward pre-hooks (forward_waits="module")
        self.plan: RunPlan | None = None  # the plan of the run's optimizers, made at set-up
        self._deepspeed = deepspeed  # what DeepSpeed's words ask of the Trainer, given it at connect()
        super().__init__(data_parallel_size=data_parallel_size, tensor_parallel_size=tensor_parallel_size,
                         save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend, timeout=timeout)
        deepspeed.say()
        self._auto_fraction = AutoFractionSteps(self._engines)  # (EngineHooks made self._engines)
        self._checkpoints = FSDPCheckpoints(self._engines)

    @property
    def offload_fraction(self) -> float:
        return self.options.offload_fraction

    @property
    def closure_optimizers(self) -> tuple[str, ...]:
        return self.options.closure_optimizers

    def _shards_itself(self) -> bool:
        """The LightningModule has no ``configure_model``: the strategy shards it."""
        module = self.lightning_module
        base = self.package.LightningModule
        return isinstance(module, base) and type(module).configure_model is base.configure_model

    @override
    def connect(self, model) -> None:
        """As the DDP strategy's: a DeepSpeed config's clipping, accumulation and half precision
        given to the Trainer before Lightning checks the loop's configuration."""
        super().connect(model)
        give_the_trainer(self._deepspeed, model, getattr(self.precision_plugin, "precision", None))

    @override
    def setup_environment(self) -> None:
        self._data_parallel_size, self._tensor_parallel_size = resolved_mesh_sizes(
            self._data_parallel_size, self._tensor_parallel_size, self.num_nodes * self.num_processes)
        super().setup_environment()
        say_if_nothing_is_sharded(self._data_parallel_size, self.world_size)
        self._threads.set(self.options.cpu_threads, self.num_processes, self.root_device,
                          bind=self.options.bind_cpu_threads, local_rank=self.local_rank)

    @override
    def setup(self, trainer) -> None:
        """``ModelParallelStrategy``'s, after sharding a model that has no ``configure_model``
        (which Lightning's set-up otherwise refuses)."""
        if not self._shards_itself():
            self._materialize_host_shards()
            return super().setup(trainer)
        module = self.lightning_module
        name = type(module).__name__
        done = shard_model(module, self.device_mesh["data_parallel"], self._auto_wrap_classes, self._min_num_params,
                           **host_shard_arguments(self.options.offload_parameters, self.root_device,
                                                  self.options.pin_memory))
        rank_zero_info(f"lightning_fastopt: {name} has no configure_model: {done}")
        self._materialize_host_shards()
        module.configure_model = _sharded_by_the_strategy  # Lightning's set-up checks that the hook is overridden
        try:
            super().setup(trainer)
        finally:
            del module.configure_model

    def _materialize_host_shards(self) -> None:
        """With ``offload_parameters``, a model sharded on the meta device is materialized in
        host memory (``ModelParallelStrategy`` would on the device, which FSDP refuses)."""
        if self.options.offload_parameters:
            materialize_on_the_host(self.model)

    @override
    def model_to_device(self) -> None:
        """What FSDP did not place to the device (buffers, modules no ``fully_shard``
        reached): FSDP's parameters stay where ``fully_shard`` put them (host shards under
        ``CPUOffloadPolicy``, which ``ModelParallelStrategy`` would move and FSDP refuse)."""
        move_all_but_fsdp_parameters(self.model, self.root_device)

    # ------------------------------------------------------------------ optimizers
    @override
    def setup_optimizers(self, trainer) -> None:
        self._precisions.refuse_foreign()
        on_host = check_host_shards(self.lightning_module, self.options.offload_parameters)
        set_up_optimizers(self, trainer, self._deepspeed,
                          lambda: super(FSDPTrainerStrategy, self).setup_optimizers(trainer))
        module = self.lightning_module
        if on_host:
            say_host_shards()
        plan = self.plan = plan_fsdp_run(self.optimizers, self.options, fsdp_run(self, trainer, on_host),
                                         self.package.MockOptimizer)
        plan.say()
        names = {p: n for n, p in module.named_parameters()}
        arguments = offload_arguments(self.options, params_on_host=on_host,  # fsdp/host_parameters.py
                                      processes_per_host=self.num_processes, step_cores=self._threads.step_cores)
        if plan.weight_waits.by_module:
            arguments["forward_waits"] = "module"

        def engine(opt, planned: OptimizerPlan) -> LocalShardOptimizer:
            fused = fused_for(opt, module, self.precision_plugin.precision)
            # its kernels load (or build, saying so) now, not after the first training step
            ops.prepare(self.root_device.type, cpu_work=self.offload_fraction > 0 or on_host,
                        pieces=fused.kernel_pieces())
            return LocalShardOptimizer(fused, names, device_grads=plan.gradients.kind,
                                       host_gradients=HostGradientLandings(module) if on_host else None,
                                       **arguments, **planned.schedule.engine_arguments())

        self._engines.take_over(self.optimizers, plan.optimizers, engine)
        self.optimizers = self.optimizers  # Lightning's LightningOptimizer wrappers, made anew (EngineHooks)
        if plan.weight_waits.by_module:
            if self._unit_waits is not None:  # (set up again without a teardown between)
                self._unit_waits.remove()
            self._unit_waits = UnitWaits(module, lambda: self.engines)
            for e in self.engines:
                e.modules_wait_for(self._unit_waits.covered)
                _say_if_its_steps_wait(e)
        self._auto_fraction.start(trainer, self.options.auto_fraction, self.options.gpu_memory_budget_gb,
                                  self.root_device, self.broadcast)

    @override
    def optimizer_step(self, optimizer, closure, model=None, **kwargs: Any) -> Any:
        out = self._auto_fraction.step(
            optimizer, self.optimizers, closure,
            lambda timed: super(FSDPTrainerStrategy, self).optimizer_step(optimizer, timed, model, **kwargs),
            lambda: self.precision_plugin.last_step_skipped)
        if self.options.wall_clock_breakdown:
            log_step_times(self.lightning_module.trainer, self.precision_plugin, engine_of(optimizer))
        return out

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        for engine in self.engines:  # resumed: the delayed update's warm-up was done before the save
            engine.local.count_steps_from(self.lightning_module.trainer.global_step)

    # ------------------------------------------------------------------ checkpoints (FSDPCheckpoints)
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return self._checkpoints.module_state_dict(self.engines, super().lightning_module_state_dict)

    @override
    def optimizer_state(self, optimizer) -> dict[str, Any]:
        return self._checkpoints.optimizer_state(self.optimizers, optimizer, super().optimizer_state)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        self._checkpoints.save(filepath, self, self._save_distributed_checkpoint, lambda staging: super(
            FSDPTrainerStrategy, self).save_checkpoint(checkpoint, staging, storage_options))

    @override
    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        def lightnings(views: list[Any]) -> dict[str, Any]:  # Lightning's load, into the optimizers as torch's
            taken, self._optimizers = self._optimizers, views
            try:
                return super(FSDPTrainerStrategy, self).load_checkpoint(checkpoint_path, weights_only)
            finally:
                self._optimizers = taken

        return self._checkpoints.load(self.broadcast(checkpoint_path), weights_only, self, self._optimizers,
                                      lightnings)

    # ------------------------------------------------------------------ teardown
    @override
    def teardown(self) -> None:
        self._engines.release(self.optimizers)
        self._threads.restore()
        if self._unit_waits is not None:
            self._unit_waits.remove()
            self._unit_waits = None
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry) -> None:
        register_fsdp_names(cls, strategy_registry)


def _say_if_its_steps_wait(engine: LocalShardOptimizer) -> None:
    """With ``forward_waits="module"``: one line where ``engine``'s steps still wait for their
    CPU updates (:func:`~lightning_fastopt.offload.left_running.ends_early`), and why."""
    local = engine.local
    if local.schedule.ends_early:
        return
    why = ("its updates read norms over whole parameters, summed over every rank's rows at the step (LAMB's and "
           "LARS's trust ratios)" if local.before_updates is not None else "its own step runs at the step")
    rank_zero_info(f"lightning_fastopt: the steps of {type(engine.optimizer).__name__} wait for their CPU updates "
                   f"(forward_waits='module' not used for it): {why}")


def _sharded_by_the_strategy() -> None:
    """The LightningModule's ``configure_model`` while Lightning's set-up runs: the strategy sharded it."""


