"""FastOptFabricStrategy: the fastopt strategies for Lightning Fabric.

``import lightning_fastopt`` registers the Trainer's names in Fabric's registry too
(``Fabric(strategy="fastopt_offload")``).  The work is shared with the Trainer's
:class:`~lightning_fastopt.FastOptStrategy`: the same arguments, checked by
:class:`~lightning_fastopt.core.options.StrategyOptions`; the same optimizers
(:func:`~lightning_fastopt.core.engines.fused_for`, then
:func:`~lightning_fastopt.core.engines.wrap_fused_optimizer`: offload or ZeRO); the same
precision core; the same name-keyed, atomically written checkpoints.  What differs is how
Fabric drives a step:

- ``fabric.setup(model, optimizer)`` (or ``setup_module`` and ``setup_optimizers``, in either
  order: an optimizer set up first is taken over when its model is set up): the
  model is wrapped in DistributedDataParallel only with several processes (ZeRO stage 2:
  never; it reduces the gradients itself), and the optimizer stays the user's object,
  stepped by the offload (or ZeRO) optimizer behind it (as for the Trainer,
  :mod:`lightning_fastopt.optim.takeover`); an LR scheduler made on it keeps working;
- gradients stay in ``p.grad`` until the step (``keep_gradients=True``, the default here):
  Fabric cannot tell which code of the loop reads them.  ``keep_gradients=False`` copies
  the offloaded ones to the host during backward and frees them on the device (the memory
  saving; ZeRO stage 2 only then frees other ranks' gradients, it reduces as stage 1
  does otherwise); then read them only through ``fabric.clip_gradients``;
- with one process the strategy is, as far as Fabric can tell, a single-device strategy
  (an instance of Fabric's ``SingleDeviceStrategy`` too, through a class made at run time
  that derives from both and changes nothing else): ``fabric.launch()`` is optional, as
  with Fabric's own, and the environment (CPU threads, device) is set up at the first
  ``setup`` when nobody launched; ``fabric.no_backward_sync`` is then Fabric's no-op
  (accumulation is exact either way: gradients reach the host at each micro-batch);
- with several processes ``fabric.no_backward_sync(model, enabled=...)`` marks the
  micro-batches that accumulate (nothing is copied or reduced yet);
- ``fabric.clip_gradients`` clips what the step reads, as if unscaled (fp16);
- ``fabric.save`` / ``fabric.load`` keep the fp16 loss scaler's state in the checkpoint
  (key ``"fastopt_loss_scaler"``, taken out again when loading); with ZeRO at several
  processes ``fabric.save`` writes a sharded directory (each rank its own shard of the
  optimizer state; pass the optimizer itself in the state), which ``fabric.load`` merges
  and re-shards for any number of processes.

Not yet with Fabric (refused by name): ``offload_fraction="auto"`` (it times Lightning's
closure), ``stream_cpu_step`` and ``forward_waits="module"`` (the strategy cannot see
what the loop reads between backward and the step, or between steps), and
``delayed_update`` (the strategy does not see the loop end, where the last update must
reach the model).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from lightning.fabric.strategies import DDPStrategy, SingleDeviceStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_fastopt import ops
from lightning_fastopt.checkpoint.deepspeed_reader import is_deepspeed_checkpoint
from lightning_fastopt.checkpoint.sharded import SHARDS_KEY, save_sharded
from lightning_fastopt.core.checkpoint_io import AtomicCheckpointIO
from lightning_fastopt.core.cpu_threads import TorchThreads
from lightning_fastopt.fabric.deepspeed_state import load_deepspeed_directory
from lightning_fastopt.fabric.precision_slot import FabricPrecisionSlot
from lightning_fastopt.from_deepspeed.arguments import from_deepspeed, signature_defaults
from lightning_fastopt.from_deepspeed.trainer_settings import check_precision, refuse_the_trainers_settings
from lightning_fastopt.optim.takeover import engine_of, for_class_wrappers, give_back, take_over
from lightning_fastopt.optim.wrapper import OptimizerWrapper, unwrapped
from lightning_fastopt.core.engines import check_ddp_kwargs, fused_for, register_names, wrap_fused_optimizer
from lightning_fastopt.core.options import StrategyOptions, offload_arguments
from lightning_fastopt.plan.ddp_plan import DDPRun, plan_ddp_run
from lightning_fastopt.plan.gradients import zero_stage_that_runs

SCALER_KEY = "fastopt_loss_scaler"  # the fp16 loss scaler's state in a Fabric checkpoint
DELAYED_UPDATE_IS_THE_TRAINERS = (
    "is for the Trainer, which gives the model the last update when training ends (a Fabric loop's end is not seen "
    "by the strategy, so the weights would stay one update behind)")


class FastOptFabricStrategy(FabricPrecisionSlot, DDPStrategy):
    """The arguments are :class:`~lightning_fastopt.FastOptStrategy`'s, with
    ``keep_gradients=True`` by default (see the module's documentation); ``**kwargs`` go
    to Fabric's ``DDPStrategy``."""

    def __init__(self, offload_fraction: float = 1.0, overlap: bool = True, pin_memory: bool = True,
                 bucket_size_mb: float = 64.0, cpu_threads: int | None = None, bind_cpu_threads: bool = False,
                 loss_scale: float = 0.0,
                 initial_scale_power: int = 16, loss_scale_window: int = 1000, hysteresis: int = 2,
                 min_loss_scale: float = 1.0, at_min_loss_scale: str = "raise", wall_clock_breakdown: bool = False,
                 zero_stage: int = 0, copy_on_cpu: bool = False, keep_gradients: bool = True,
                 stream_cpu_step: bool = False, delayed_update: bool = False, delayed_update_warmup: int = 40,
                 gpu_memory_budget_gb: float | None = None, host_state_dtype: str = "float32",
                 forward_waits: str = "step", closure_optimizers: Sequence[str] = (),
                 per_parameter_optimizers: Sequence[str] = (), offload_optimizer_device: str = "cpu",
                 nvme_path: str | None = None, nvme_window_mb: float | None = None,
                 host_state_gib: float | str | None = None, host_reserve_gib: float | None = None,
                 zero_optimization: bool | None = None, stage: int | None = None,
                 offload_optimizer: bool | None = None, config: dict | str | None = None, **kwargs: Any) -> None:
        deepspeed = from_deepspeed(locals(), signature_defaults(FastOptFabricStrategy.__init__), kwargs,
                                   strategy=type(self).__name__)
        refuse_the_trainers_settings(deepspeed, type(self).__name__)
        check_ddp_kwargs(kwargs, DDPStrategy, FastOptFabricStrategy)
        ops.check_environment()
        options = StrategyOptions.from_arguments(deepspeed.arguments)
        if options.auto_fraction:
            raise ValueError("offload_fraction='auto' is for the Trainer (it times the step's closure); with Fabric "
                             "give a number")
        if options.stream_cpu_step:
            raise ValueError("stream_cpu_step=True is for the Trainer (which knows what reads the gradients before "
                             "the step); with Fabric leave it False")
        if options.forward_waits != "step":
            raise ValueError(f"forward_waits={options.forward_waits!r} is for the Trainer (which knows what reads "
                             "the weights between steps); with Fabric leave it 'step'")
        if options.delayed_update:
            raise ValueError(f"delayed_update=True {DELAYED_UPDATE_IS_THE_TRAINERS}; with Fabric leave it False")
        self.options = options
        self._module: Module | None = None  # the user's module (names of parameters)
        self._wrappers: list[OptimizerWrapper] = []  # the engines of the optimizers set up, closed at teardown
        self._users: list[torch.optim.Optimizer] = []  # those optimizers (the user's), given back at teardown
        self._pending: list[torch.optim.Optimizer] = []  # set up before the model that holds their parameters
        self._threads = TorchThreads()
        self._environment_ready = False
        self._deepspeed = deepspeed  # the half precision a DeepSpeed config asks for, checked at set-up
        super().__init__(**kwargs)
        self._backward_sync_control = _FastOptBackwardSync(self)
        deepspeed.say()

    # ------------------------------------------------------------------ checkpoint_io
    @property
    @override
    def checkpoint_io(self) -> Any:
        """Filled when first asked, as Fabric's strategies fill theirs (so that a user's plugin
        given through ``plugins=`` is taken): the user's, or :class:`AtomicCheckpointIO`."""
        if self._checkpoint_io is None:
            self._checkpoint_io = AtomicCheckpointIO()
        return self._checkpoint_io

    @checkpoint_io.setter
    @override
    def checkpoint_io(self, io: Any) -> None:
        self._checkpoint_io = io

    # ------------------------------------------------------------------ environment
    @property
    def _one_process(self) -> bool:
        return self.num_nodes * self.num_processes == 1

    @override
    def _configure_launcher(self) -> None:
        """Fabric's connector calls this once the devices are known: with one process the
        strategy becomes a single-device one to Fabric (see the module's documentation)."""
        super()._configure_launcher()
        if self._one_process:
            self._launcher = None
            self.__class__ = _single_device_class(type(self))

    def _ensure_environment(self) -> None:
        """The environment, when nobody launched (one process: ``fabric.launch()`` is optional)."""
        if not self._environment_ready:
            self.setup_environment()

    @override
    def setup_environment(self) -> None:
        self._environment_ready = True
        self._threads.set(self.options.cpu_threads, self.num_processes, self.root_device,
                          bind=self.options.bind_cpu_threads, local_rank=self.local_rank)
        if self._one_process:  # as Fabric's single-device strategy: no process group
            self.accelerator.setup_device(self.root_device)
            self._set_world_ranks()
        else:
            super().setup_environment()
        if self.precision.device is None:
            self.precision.device = self.root_device.type
        check_precision(self._deepspeed, self.precision.precision, "Fabric")

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any] | None:
        """None with one process: Fabric keeps the loader's own sampler, as with its
        single-device strategy (a DistributedSampler over one replica would shuffle in
        another order)."""
        return None if self._one_process else super().distributed_sampler_kwargs

    @override
    def setup_module(self, module: Module) -> Module:
        """DistributedDataParallel with several processes (not for ZeRO stage 2, which
        reduces gradients itself after one broadcast of rank 0's weights); none with one.
        Optimizers set up before it whose parameters it holds are taken over now."""
        self._ensure_environment()
        self._module = module
        if self._one_process:
            wrapped = module
        elif zero_stage_that_runs(self.options.zero_stage, self._run().readers, ()) == 2:
            from lightning.pytorch.overrides.distributed import _sync_module_states

            _sync_module_states(module)
            wrapped = module
        else:
            wrapped = super().setup_module(module)
        for optimizer in [o for o in self._pending if self._holds(o)]:
            self._pending.remove(optimizer)
            self._take_over(optimizer)
            methods = engine_of(optimizer).shared_methods
            if methods:  # Fabric wrapped it already: its wrapper would find the class's own methods
                raise RuntimeError(
                    f"{type(optimizer).__name__}'s {' and '.join(f'{m}()' for m in methods)} must run on every share "
                    "of the parameters the strategy steps, which Fabric's wrapper of an optimizer set up before its "
                    "model cannot reach: set the model up first (fabric.setup(model, optimizer), or "
                    "fabric.setup_module(model) before fabric.setup_optimizers(optimizer))")
        return wrapped

    @override
    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """``optimizer`` itself, stepped by an offload (or ZeRO) optimizer over the optimizer
        that runs it (:mod:`lightning_fastopt.optim.takeover`).  Set up before the model
        that holds its parameters (Fabric allows either order), it is taken over when that
        model is set up: the state is keyed by the model's parameter names."""
        if engine_of(optimizer) in self._wrappers or optimizer in self._pending:
            return optimizer  # set up again (Fabric allows it): the engine already stepping it goes on
        if not self._holds(optimizer):
            self._pending.append(optimizer)
            return optimizer
        return self._take_over(optimizer)

    def _holds(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether the model set up last holds every parameter of ``optimizer``."""
        if self._module is None:
            return False
        params = {id(p) for p in self._module.parameters()}
        return all(id(p) in params for g in optimizer.param_groups for p in g["params"])

    def _take_over(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        plan = plan_ddp_run([optimizer], self.options, self._run())
        plan.say()
        planned = plan.optimizers[0]
        if not planned.runner.in_engine:
            return optimizer
        fused = fused_for(optimizer, self._module, self.precision.precision)
        ops.prepare(self.root_device.type, cpu_work=self.options.offload_fraction > 0, pieces=fused.kernel_pieces())
        names = {p: n for n, p in self._module.named_parameters()}
        wrapper = wrap_fused_optimizer(fused, names, zero_stage=plan.zero_stage, device_grads=plan.gradients.kind,
                                       **offload_arguments(self.options, processes_per_host=self.num_processes,
                                                         step_cores=self._threads.step_cores),
                                       **planned.schedule.engine_arguments())
        rank_zero_info(f"lightning_fastopt: {wrapper!r}")
        self._wrappers.append(wrapper)
        self._users.append(optimizer)
        return for_class_wrappers(take_over(optimizer, wrapper))  # (Fabric's wrapper derives its class)

    @override
    def optimizer_step(self, optimizer, **kwargs: Any) -> Any:
        if unwrapped(optimizer) in self._pending:
            raise RuntimeError(f"the {type(unwrapped(optimizer)).__name__} given to fabric.setup_optimizers has no "
                               "model set up that holds its parameters: set that model up too "
                               "(fabric.setup_module(model), or fabric.setup(model, optimizer)) before stepping; "
                               "the strategy keys the optimizer's state by the model's parameter names")
        return super().optimizer_step(optimizer, **kwargs)

    def _run(self) -> DDPRun:
        """What the plan reads of the run: Fabric's loop is the user's own code, which may read
        ``p.grad`` anywhere, so gradients stay there unless ``keep_gradients=False``."""
        return DDPRun(self.world_size, self.root_device, readers=_LOOP_READS if self.options.keep_gradients else (),
                      keep_hint="FastOptFabricStrategy(keep_gradients=True), the default, keeps them for the loop's "
                                "code", ddp_reduces_torch_steps=False)

    # ------------------------------------------------------------------ checkpoints
    @override
    def save_checkpoint(self, path, state: dict[str, Any], storage_options: Any | None = None,
                        filter: dict | None = None) -> None:
        """One file from rank 0, as Fabric's DDP saves; with ZeRO at several processes, where
        each rank holds only its shard of the optimizer state, a sharded directory written by
        every rank (:mod:`lightning_fastopt.checkpoint.sharded`, as the Trainer's strategy
        writes; ``fabric.load`` merges it and re-shards for any number of processes)."""
        if self.precision.scaler is not None:
            state = {**state, SCALER_KEY: self.precision.state_dict()}
        engines = {key: engine_of(o) for key, o in state.items() if isinstance(o, torch.optim.Optimizer)}
        zero = {key: e for key, e in engines.items() if e in self._wrappers and e.partition() is not None}
        if self.world_size == 1 or not zero:  # nothing sharded to save
            return super().save_checkpoint(path, state, storage_options=storage_options, filter=filter)
        self._save_sharded(path, state, zero, storage_options, filter or {})

    def _save_sharded(self, path, state: dict[str, Any], keys: dict[str, OptimizerWrapper], storage_options: Any,
                      filter: dict) -> None:
        """``keys``: the entries of ``state`` that are ZeRO optimizers."""
        if storage_options is not None:
            raise TypeError(f"fabric.save of a sharded (ZeRO) checkpoint takes no storage_options, got "
                            f"{storage_options!r}")
        if "optimizer_states" in state:
            raise ValueError("fabric.save with ZeRO at several processes keeps the shards under 'optimizer_states': "
                             "use another key (and pass each optimizer itself: its state is spread over the ranks)")
        if set(filter) & set(keys):
            raise ValueError(f"fabric.save(filter=...) of a ZeRO optimizer's entry {sorted(set(filter) & set(keys))} "
                             "is not supported (its state is spread over the ranks)")
        main = {key: {SHARDS_KEY: list(keys).index(key)} if key in keys else obj for key, obj in state.items()}
        main = self._convert_stateful_objects_in_state(main, filter=filter)
        save_sharded({**main, "optimizer_states": [o.state_dict() for o in keys.values()]}, path, self,
                     zero_stage=self.options.zero_stage, partitions=[o.partition() for o in keys.values()])

    @override
    def load_checkpoint(self, path, state=None, strict: bool = True, weights_only: bool | None = None) -> dict[str, Any]:
        if isinstance(state, dict) and is_deepspeed_checkpoint(path):
            return load_deepspeed_directory(path, state, strict, self.precision, SCALER_KEY,
                                            lambda module, checkpoint, optimizers: _load_whole(
                                                module, optimizers, checkpoint, strict))
        remainder = super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
        scaler = remainder.pop(SCALER_KEY, None) if isinstance(remainder, dict) and state else None
        if scaler is not None:
            self.precision.load_state_dict(scaler)
        return remainder

    # ------------------------------------------------------------------ teardown
    @override
    def teardown(self) -> None:
        for o in self._wrappers:
            o.close()
        for o in self._users:
            give_back(o)
        self._pending.clear()
        self._threads.restore()
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry) -> None:
        register_names(cls, strategy_registry)


class _FastOptBackwardSync(_BackwardSyncControl):
    """``fabric.no_backward_sync``: the offload optimizers copy nothing while gradients
    accumulate, and DistributedDataParallel (when the model has it) does not reduce."""

    def __init__(self, strategy: FastOptFabricStrategy) -> None:
        self.strategy = strategy

    @override
    def no_backward_sync(self, module: Module, enabled: bool) -> contextlib.AbstractContextManager:
        return self._blocked(module) if enabled else contextlib.nullcontext()

    @contextlib.contextmanager
    def _blocked(self, module: Module) -> Iterator[None]:
        wrappers = self.strategy._wrappers
        for o in wrappers:
            o.accumulating = True
        try:
            with module.no_sync() if isinstance(module, DistributedDataParallel) else contextlib.nullcontext():
                yield
        finally:
            for o in wrappers:
                o.accumulating = False


def _load_whole(module: Module, optimizers: list, checkpoint: dict[str, Any], strict: bool) -> dict[str, Any]:
    """A whole checkpoint in memory into the module and optimizers (ours load named state),
    as :func:`~lightning_fastopt.fsdp.full_state.load_full_state` does into FSDP's shards."""
    rest = dict(checkpoint)
    module.load_state_dict(rest.pop("state_dict"), strict=strict)
    for optimizer, saved in zip(optimizers, rest.get("optimizer_states", [])):
        optimizer.load_state_dict(saved)
    return rest


_LOOP_READS = ("the loop's code (keep_gradients=True, Fabric's default)",)

_SINGLE_DEVICE: dict[type, type] = {}


def _single_device_class(cls: type) -> type:
    """``cls`` with Fabric's ``SingleDeviceStrategy`` among its bases (after it: every
    member of that class is overridden by DDP's), named as ``cls``; one per class."""
    if issubclass(cls, SingleDeviceStrategy):
        return cls
    if cls not in _SINGLE_DEVICE:
        _SINGLE_DEVICE[cls] = type(cls.__name__, (cls, SingleDeviceStrategy),
                                   {"__module__": cls.__module__, "__qualname__": cls.__qualname__,
                                    "__doc__": cls.__doc__})
    return _SINGLE_DEVICE[cls]
