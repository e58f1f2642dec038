"""FastOptFabricFSDPStrategy: ZeRO stage 3 for Lightning Fabric, Fabric's
``ModelParallelStrategy`` (torch's FSDP2) with lightning_fastopt's step on each rank's
local shards, registered as ``fastopt_fsdp`` and ``fastopt_fsdp_offload`` in Fabric's
registry.

As under Fabric's ``ModelParallelStrategy``: ``fabric.setup_module(model)`` applies
``parallelize_fn(model, device_mesh)`` (the project's ``fully_shard`` calls), then
``fabric.setup_optimizers(optimizer)`` over the sharded parameters; without a
``parallelize_fn`` the strategy shards the model itself (``auto_wrap_policy``,
:mod:`~lightning_fastopt.fsdp.auto_shard`, the model itself as the root).  Each optimizer
runs in a :class:`~lightning_fastopt.fsdp.LocalShardOptimizer` while it stays the user's
object; ``fabric.clip_gradients`` clips by torch's norm of the DTensor gradients;
``fabric.save``/``fabric.load`` are Fabric's (distributed or full checkpoints), given
the optimizer as torch would hold it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from datetime import timedelta
from typing import Any

import torch
from lightning.fabric.strategies import ModelParallelStrategy
from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch.distributed.constants import default_pg_timeout
from torch.nn import Module
from typing_extensions import override

from lightning_fastopt import ops
from lightning_fastopt.checkpoint.deepspeed_reader import is_deepspeed_checkpoint
from lightning_fastopt.checkpoint.atomic import DISTRIBUTED_CHECKPOINT_FILES, save_staged
from lightning_fastopt.checkpoint.checksums import checksum_staged, verify_distributed_once
from lightning_fastopt.checkpoint.replacing import refuse_to_replace_a_directory
from lightning_fastopt.checkpoint.safe_loading import check_before_loading
from lightning_fastopt.core.cpu_threads import TorchThreads
from lightning_fastopt.core.engines import FSDP_DOES_NOT_TAKE, check_passed_kwargs, fused_for, register_fsdp_names
from lightning_fastopt.core.options import StrategyOptions, offload_arguments
from lightning_fastopt.from_deepspeed.arguments import from_deepspeed, signature_defaults
from lightning_fastopt.from_deepspeed.trainer_settings import check_precision, refuse_the_trainers_settings
from lightning_fastopt.fabric.deepspeed_state import load_deepspeed_directory
from lightning_fastopt.fabric.precision_slot import FabricPrecisionSlot
from lightning_fastopt.fabric.strategy import DELAYED_UPDATE_IS_THE_TRAINERS, SCALER_KEY
from lightning_fastopt.fsdp import LocalShardOptimizer
from lightning_fastopt.fsdp.auto_shard import check_auto_wrap_policy, shard_model
from lightning_fastopt.fsdp.full_state import load_full_state
from lightning_fastopt.fsdp.gradient_landings import HostGradientLandings
from lightning_fastopt.fsdp.host_parameters import (check_host_shards, host_shard_arguments,
                                                    materialize_on_the_host, say_host_shards)
from lightning_fastopt.fsdp.mesh_sizes import resolved_mesh_sizes, say_if_nothing_is_sharded
from lightning_fastopt.plan.fsdp_plan import FSDPRun, plan_fsdp_run
from lightning_fastopt.plan.runner import choose_runner
from lightning_fastopt.optim.takeover import engine_of, for_class_wrappers, give_back, held_as_torch, take_over

__all__ = ["FastOptFabricFSDPStrategy"]

_NOT_TAKEN = {**FSDP_DOES_NOT_TAKE, "delayed_update": f"the delayed update {DELAYED_UPDATE_IS_THE_TRAINERS}",
              "delayed_update_warmup": f"the delayed update {DELAYED_UPDATE_IS_THE_TRAINERS}",
              "gpu_memory_budget_gb": "it is offload_fraction='auto''s, which is for the Trainer (it times the step's "
                                      "closure)",
              "forward_waits": "it is for the Trainer (which knows what reads the weights between steps)"}


class FastOptFabricFSDPStrategy(FabricPrecisionSlot, ModelParallelStrategy):
    """FSDP2 (ZeRO stage 3) with the fused, offloaded optimizer step on each rank's shards.

    Args:
        parallelize_fn: Fabric's ``ModelParallelStrategy``'s (``fn(module, device_mesh)``
            returning the sharded module); None: the strategy shards the model by
            ``auto_wrap_policy`` or ``min_num_params`` (as ``FastOptFSDPStrategy``).
        data_parallel_size, tensor_parallel_size: the device mesh's sizes; both ``"auto"``
            (the default): every process data-parallel, where Fabric's
            ``ModelParallelStrategy`` makes data parallelism across nodes and tensor
            parallelism within each (:mod:`~lightning_fastopt.fsdp.mesh_sizes`); one given:
            the other from it.
        keep_gradients: True (the default, as for ``FastOptFabricStrategy``: Fabric cannot
            tell which code of the loop reads ``p.grad``): gradients stay in ``p.grad``
            until the step; False: the offloaded rows' gradients leave for the host as
            FSDP's reduce-scatter lands them and are freed on the device (read them then
            only through ``fabric.clip_gradients``).
        stream_cpu_step: with ``keep_gradients=False``, start each host bucket's CPU
            update during backward (speculated: Fabric cannot tell whether the loop will
            clip, so the step checks); bit for bit the update at the step.
        offload_parameters: each rank's parameter shards in host memory under torch's
            ``CPUOffloadPolicy``, updated there in place (as the Trainer's): the strategy's
            own sharding applies the policy, a ``parallelize_fn`` passes it to ``fully_shard``;
            a model on the meta device is materialized in host memory after it.
        The others: as the Trainer's ``FastOptFSDPStrategy``.
    """

    def __init__(self, parallelize_fn: Callable[[Module, Any], Module] | None = None, offload_fraction: float = 1.0,
                 overlap: bool = True, pin_memory: bool = True, bucket_size_mb: float = 64.0,
                 cpu_threads: int | None = None, bind_cpu_threads: bool = False,
                 loss_scale: float = 0.0, initial_scale_power: int = 16,
                 loss_scale_window: int = 1000, hysteresis: int = 2, min_loss_scale: float = 1.0,
                 at_min_loss_scale: str = "raise", wall_clock_breakdown: bool = False, copy_on_cpu: bool = False,
                 closure_optimizers: Sequence[str] = (), keep_gradients: bool = True,
                 stream_cpu_step: bool = False, host_state_dtype: str = "float32",
                 auto_wrap_policy: Iterable[type] | None = None,
                 min_num_params: int = 100_000_000, elementwise_optimizers: Sequence[str] = (),
                 offload_parameters: bool = False, offload_optimizer_device: str = "cpu",
                 nvme_path: str | None = None, nvme_window_mb: float | None = None,
                 host_state_gib: float | str | None = None, host_reserve_gib: float | None = None,
                 data_parallel_size: int | str = "auto",
                 tensor_parallel_size: int | str = "auto", save_distributed_checkpoint: bool = True,
                 process_group_backend: str | None = None, timeout: timedelta | None = default_pg_timeout,
                 zero_optimization: bool | None = None, stage: int | None = None,
                 offload_optimizer: bool | None = None, config: dict | str | None = None, **kwargs: Any) -> None:
        deepspeed = from_deepspeed(locals(), signature_defaults(FastOptFabricFSDPStrategy.__init__), kwargs,
                                   strategy=type(self).__name__, stage_three=True)
        refuse_the_trainers_settings(deepspeed, type(self).__name__)
        check_passed_kwargs(kwargs, (), type(self), "Fabric's ModelParallelStrategy's", _NOT_TAKEN)
        if parallelize_fn is not None and not callable(parallelize_fn):
            raise TypeError(f"parallelize_fn must be a function (module, device_mesh) -> module, or None, got "
                            f"{parallelize_fn!r}")
        ops.check_environment()
        self.options = StrategyOptions.fsdp_from_arguments(type(self).__name__, False, deepspeed.arguments)
        if self.options.stream_cpu_step and self.options.keep_gradients:
            raise ValueError("stream_cpu_step=True starts host updates as the gradients leave during backward: it "
                             "needs keep_gradients=False (Fabric's default keeps them in p.grad until the step)")
        self._auto_wrap_classes = check_auto_wrap_policy(auto_wrap_policy, min_num_params)
        self._min_num_params = min_num_params
        self._shards_itself = parallelize_fn is None
        self._user_parallelize = parallelize_fn
        self._threads = TorchThreads()
        self._engines: dict[int, LocalShardOptimizer] = {}  # by id of the user's optimizer
        self._users: list[torch.optim.Optimizer] = []
        self._module: Module | None = None  # the model set up (its parameter names key the state)
        self._deepspeed = deepspeed  # the half precision a DeepSpeed config asks for, checked at set-up
        super().__init__(self._parallelize, data_parallel_size=data_parallel_size,
                         tensor_parallel_size=tensor_parallel_size,
                         save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend, timeout=timeout)
        deepspeed.say()

    @property
    def offload_fraction(self) -> float:
        return self.options.offload_fraction

    @override
    def setup_environment(self) -> None:
        self._data_parallel_size, self._tensor_parallel_size = resolved_mesh_sizes(
            self._data_parallel_size, self._tensor_parallel_size, self.num_nodes * self.num_processes)
        super().setup_environment()
        say_if_nothing_is_sharded(self._data_parallel_size, self.world_size)
        self._threads.set(self.options.cpu_threads, self.num_processes, self.root_device,
                          bind=self.options.bind_cpu_threads, local_rank=self.local_rank)
        check_precision(self._deepspeed, self.precision.precision, "Fabric")

    def _parallelize(self, module: Module, mesh) -> Module:
        """The project's ``parallelize_fn`` (or the strategy's sharding), then, with
        ``offload_parameters``, a model sharded on the meta device materialized in host
        memory (Fabric's ``ModelParallelStrategy`` would on the device, which FSDP refuses)."""
        module = self._user_parallelize(module, mesh) if self._user_parallelize else self._shard(module, mesh)
        if self.options.offload_parameters and isinstance(module, Module):
            materialize_on_the_host(module)
        return module

    def _shard(self, module: Module, mesh) -> Module:
        """The ``parallelize_fn`` of a project that gives none."""
        done = shard_model(module, mesh["data_parallel"], self._auto_wrap_classes, self._min_num_params,
                           forward_runs=True, **host_shard_arguments(self.options.offload_parameters,
                                                                     self.root_device, self.options.pin_memory))
        rank_zero_info(f"lightning_fastopt: {done}")
        return module

    # ------------------------------------------------------------------ optimizers
    @override
    def setup_module(self, module: Module) -> Module:
        module = super().setup_module(module)
        self._module = module
        return module

    @override
    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """``optimizer`` itself, stepped by a :class:`LocalShardOptimizer` over the rows this
        rank holds (made after ``setup_module``, over the sharded parameters)."""
        if id(optimizer) in self._engines:
            return optimizer
        module = self._module
        if module is None and choose_runner(optimizer, shares="rows", closure_optimizers=self.options.closure_optimizers,
                                            named=self.options.elementwise_optimizers).in_engine:
            raise RuntimeError("FastOptFabricFSDPStrategy steps the sharded parameters: set the model up first "
                               "(fabric.setup_module(model)), then create the optimizer over its parameters and "
                               "set it up (fabric.setup_optimizers(optimizer))")
        on_host = module is not None and check_host_shards(module, self.options.offload_parameters)
        keep = self.options.keep_gradients
        plan = plan_fsdp_run([optimizer], self.options, FSDPRun(
            self.world_size, self.root_device, on_host=on_host,
            readers=("the loop's code (keep_gradients=True, Fabric's default)",) if keep else (),
            step_checks=(("clipping or fp16 loss scaling, where the loop applies them", True),),
            keep_hint="keep_gradients=False"))
        planned = plan.optimizers[0]
        if not planned.runner.in_engine:
            plan.say()
            return optimizer
        if on_host:
            say_host_shards()
        plan.say()
        fused = fused_for(optimizer, module, self.precision.precision)
        ops.prepare(self.root_device.type, cpu_work=self.offload_fraction > 0 or on_host, pieces=fused.kernel_pieces())
        arguments = offload_arguments(self.options, params_on_host=on_host,  # fsdp/host_parameters.py
                                      processes_per_host=self.num_processes, step_cores=self._threads.step_cores)
        engine = LocalShardOptimizer(fused, {p: n for n, p in module.named_parameters()},
                                     device_grads=plan.gradients.kind,
                                     host_gradients=HostGradientLandings(module) if on_host else None,
                                     **arguments, **planned.schedule.engine_arguments())
        rank_zero_info(f"lightning_fastopt: {engine!r}")
        self._engines[id(optimizer)] = engine
        self._users.append(optimizer)
        return for_class_wrappers(take_over(optimizer, engine))  # (Fabric's wrapper derives its class)

    # ------------------------------------------------------------------ checkpoints
    def _as_torch_holds_them(self, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` with each optimizer we step replaced by a view of it as torch holds it."""
        return {k: held_as_torch(v) if isinstance(v, torch.optim.Optimizer) and self._steps(v) else v
                for k, v in state.items()}

    def _steps(self, optimizer: torch.optim.Optimizer) -> bool:
        return engine_of(optimizer) in self._engines.values()

    @override
    def save_checkpoint(self, path, state: dict[str, Any], storage_options: Any | None = None,
                        filter: dict | None = None) -> None:
        """Fabric's (a directory of shards, or one full file), the optimizers in torch's layout,
        written whole or not at all (:func:`~lightning_fastopt.checkpoint.atomic.save_staged`).
        A full checkpoint does not replace a directory that is not a checkpoint, as Fabric's
        strategy refuses it; a distributed one keeps the files there that are not a
        distributed checkpoint's, as Fabric's does."""
        if not self._save_distributed_checkpoint:
            refuse_to_replace_a_directory(self.broadcast(path))
        views = self._as_torch_holds_them(state)
        save_staged(path, lambda staging: super(FastOptFabricFSDPStrategy, self).save_checkpoint(
            staging, views, storage_options=storage_options, filter=filter), self, DISTRIBUTED_CHECKPOINT_FILES,
                    before_move=checksum_staged)

    @override
    def load_checkpoint(self, path, state=None, strict: bool = True, weights_only: bool | None = None):
        """Fabric's, loading each optimizer we step as torch would hold it, then into its
        engine; a checkpoint that torch's safe loader refuses is refused before anything is
        loaded (:func:`~lightning_fastopt.checkpoint.safe_loading.check_before_loading`), and
        so is a distributed one whose checksums do not match
        (:mod:`~lightning_fastopt.checkpoint.checksums`).  A directory DeepSpeed wrote is read
        whole on every rank (:mod:`~lightning_fastopt.fabric.deepspeed_state`)."""
        deepspeeds = is_deepspeed_checkpoint(path)  # read whole on every rank
        if not deepspeeds:
            verify_distributed_once(self.broadcast(path), self)
            check_before_loading(self.broadcast(path), weights_only)
        if not isinstance(state, dict):
            return super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
        views = self._as_torch_holds_them(state)
        if deepspeeds:
            remaining = load_deepspeed_directory(path, views, strict, self.precision, SCALER_KEY,
                                                 lambda module, checkpoint, optimizers: load_full_state(
                                                     module, optimizers, checkpoint, strict))
        else:
            remaining = super().load_checkpoint(path, views, strict=strict, weights_only=weights_only)
        for key, value in state.items():
            if views[key] is not value and isinstance(value, torch.optim.Optimizer):
                view = views[key]
                engine_of(value).load_param_state(view.state, view.param_groups)
            elif views[key] is not value:
                state[key] = views[key]  # metadata Fabric loaded into the dict it was given
        return remaining

    # ------------------------------------------------------------------ teardown
    @override
    def teardown(self) -> None:
        for engine in self._engines.values():
            engine.close()
        for optimizer in self._users:
            give_back(optimizer)
        self._threads.restore()
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry) -> None:
        register_fsdp_names(cls, strategy_registry)
