"""The arguments the fastopt strategies take, checked once for both the Trainer's
(:class:`~lightning_fastopt.FastOptStrategy`) and Fabric's
(:class:`~lightning_fastopt.fabric.FastOptFabricStrategy`): a bad value is an error
naming the argument and what it accepts, when the strategy is built."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_fastopt.core.cpu_threads import check_threads
from lightning_fastopt.core.loss_scaler import DynamicLossScaler
from lightning_fastopt.offload.delayed import check_delayed_update
from lightning_fastopt.offload.forward_waits import check_forward_waits
from lightning_fastopt.offload.split_tier import check_host_state
from lightning_fastopt.offload.state_tiers import check_offload_device, check_window_holds_two_buckets
from lightning_fastopt.optim.adam import check_state_dtype
from lightning_fastopt.optim.closure import check_closure_optimizers, check_optimizer_names
from lightning_fastopt.optim.base import check_range
from lightning_fastopt.runtime.direct_io import check_directory


@dataclass
class StrategyOptions:
    """Checked arguments (see :class:`~lightning_fastopt.FastOptStrategy` for
    their meaning).  ``offload_fraction`` is 1 when ``auto_fraction`` (where the probe starts)."""

    offload_fraction: float = 1.0
    auto_fraction: bool = False
    gpu_memory_budget_gb: float | None = None
    overlap: bool = True
    pin_memory: bool = True
    bucket_size_mb: float = 64.0
    cpu_threads: int | None = None
    bind_cpu_threads: bool = False  # the CPU step's threads on cores apart from the launching thread's
    wall_clock_breakdown: bool = False
    zero_stage: int = 0
    copy_on_cpu: bool = False
    keep_gradients: bool = False
    stream_cpu_step: bool = False
    delayed_update: bool = False
    delayed_update_warmup: int = 40
    host_state_dtype: torch.dtype = torch.float32
    forward_waits: str = "step"
    closure_optimizers: tuple[str, ...] = ()
    per_parameter_optimizers: tuple[str, ...] = ()  # the DDP strategies': stepped on shares of whole parameters
    elementwise_optimizers: tuple[str, ...] = ()  # the FSDP strategies': stepped on each rank's rows
    offload_parameters: bool = False  # the FSDP strategies': the parameter shards in host memory (CPUOffloadPolicy)
    offload_optimizer_device: str = "cpu"  # where the offloaded masters and state live: host memory, or "nvme"
    nvme_path: str | None = None
    nvme_window_mb: float | None = None  # None: sized to the state, 512 MiB at most
    host_state_gib: float | str | None = None  # with "nvme": GiB of it kept in host memory, or "auto"
    host_reserve_gib: float | None = None  # with host_state_gib="auto": GiB left free (None: a tenth)
    scale_knobs: dict[str, Any] = field(default_factory=dict)  # DynamicLossScaler's arguments

    @classmethod
    def check(cls, *, offload_fraction: Any, overlap: Any, pin_memory: Any, bucket_size_mb: Any, cpu_threads: Any,
              loss_scale: Any, initial_scale_power: Any, loss_scale_window: Any, hysteresis: Any,
              min_loss_scale: Any, at_min_loss_scale: Any, wall_clock_breakdown: Any, zero_stage: Any,
              copy_on_cpu: Any, keep_gradients: Any, stream_cpu_step: Any, delayed_update: Any,
              delayed_update_warmup: Any, gpu_memory_budget_gb: Any, host_state_dtype: Any,
              forward_waits: Any, closure_optimizers: Any, per_parameter_optimizers: Any = (),
              offload_optimizer_device: Any = "cpu", nvme_path: Any = None,
              nvme_window_mb: Any = None, host_state_gib: Any = None, host_reserve_gib: Any = None,
              bind_cpu_threads: Any = False) -> StrategyOptions:
        auto = check_fraction(offload_fraction, gpu_memory_budget_gb, zero_stage)
        check_disk_tier(offload_optimizer_device, nvme_path, nvme_window_mb, offload_fraction=offload_fraction)
        check_host_state(host_state_gib, host_reserve_gib, offload_optimizer_device)
        check_range("bucket_size_mb", bucket_size_mb, 0.0, low_open=True)
        if offload_optimizer_device == "nvme" and nvme_window_mb is not None:
            check_window_holds_two_buckets(nvme_window_mb, bucket_size_mb)
        for name, flag in (("overlap", overlap), ("pin_memory", pin_memory),
                           ("wall_clock_breakdown", wall_clock_breakdown), ("copy_on_cpu", copy_on_cpu),
                           ("keep_gradients", keep_gradients), ("stream_cpu_step", stream_cpu_step)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be True or False, got {flag!r}")
        check_threads(cpu_threads, bind_cpu_threads, worker=stream_cpu_step or delayed_update)
        if isinstance(zero_stage, bool) or zero_stage not in (0, 1, 2):
            raise ValueError(f"zero_stage must be 0, 1 or 2, got {zero_stage!r}")
        check_delayed_update(delayed_update, delayed_update_warmup, stream_cpu_step)
        if delayed_update and zero_stage:
            raise ValueError(f"delayed_update=True runs with zero_stage=0 only, got zero_stage={zero_stage}")
        state_dtype = check_state_dtype(host_state_dtype)
        if state_dtype != torch.float32 and zero_stage:
            raise ValueError(f"host_state_dtype={host_state_dtype!r} runs with zero_stage=0 only, got "
                             f"zero_stage={zero_stage}")
        check_forward_waits(forward_waits)
        if forward_waits != "step" and zero_stage:
            raise ValueError(f"forward_waits={forward_waits!r} runs with zero_stage=0 only (ZeRO sends each rank's "
                             f"new weights to the others), got zero_stage={zero_stage}")
        knobs = dict(loss_scale=loss_scale, initial_scale_power=initial_scale_power,
                     loss_scale_window=loss_scale_window, hysteresis=hysteresis, min_loss_scale=min_loss_scale,
                     at_min_loss_scale=at_min_loss_scale)
        DynamicLossScaler(**knobs)  # bad knobs fail here, with the argument's name
        return cls(offload_fraction=1.0 if auto else float(offload_fraction), auto_fraction=auto,
                   gpu_memory_budget_gb=gpu_memory_budget_gb, overlap=overlap, pin_memory=pin_memory,
                   bucket_size_mb=float(bucket_size_mb), cpu_threads=cpu_threads, bind_cpu_threads=bind_cpu_threads,
                   wall_clock_breakdown=wall_clock_breakdown, zero_stage=int(zero_stage), copy_on_cpu=copy_on_cpu,
                   keep_gradients=keep_gradients, stream_cpu_step=stream_cpu_step, delayed_update=delayed_update,
                   delayed_update_warmup=delayed_update_warmup, host_state_dtype=state_dtype,
                   forward_waits=forward_waits, closure_optimizers=check_closure_optimizers(closure_optimizers),
                   per_parameter_optimizers=check_optimizer_names(per_parameter_optimizers,
                                                                  "per_parameter_optimizers"),
                   offload_optimizer_device=offload_optimizer_device,
                   nvme_path=None if nvme_path is None else str(nvme_path),
                   nvme_window_mb=None if nvme_window_mb is None else float(nvme_window_mb),
                   host_state_gib=host_state_gib if host_state_gib in (None, "auto") else float(host_state_gib),
                   host_reserve_gib=None if host_reserve_gib is None else float(host_reserve_gib),
                   scale_knobs=knobs)

    @classmethod
    def from_arguments(cls, arguments: Mapping[str, Any]) -> StrategyOptions:
        """:meth:`check` on the entries of ``arguments`` it takes (a strategy's ``locals()``,
        whose signature lists every argument for the CLI)."""
        names = [n for n in inspect.signature(cls.check).parameters if n != "cls"]
        return cls.check(**{n: arguments[n] for n in names})


    @classmethod
    def fsdp_from_arguments(cls, strategy: str, times_closure: bool, arguments: Mapping[str, Any]) -> StrategyOptions:
        """:meth:`for_fsdp` on the entries of ``arguments`` it takes (an FSDP strategy's
        ``locals()``: each takes its own subset, the others as off)."""
        names = set(inspect.signature(cls.check).parameters) - {"cls", "zero_stage"}
        names |= {"elementwise_optimizers", "offload_parameters"}
        return cls.for_fsdp(strategy, times_closure, **{n: v for n, v in arguments.items() if n in names})

    @classmethod
    def for_fsdp(cls, strategy: str, times_closure: bool, **arguments: Any) -> StrategyOptions:
        """:meth:`check` of the arguments the FSDP strategies take (``strategy``: the class
        name, for the message refusing ``offload_fraction="auto"`` where the strategy has no
        closure to time, ``times_closure`` False: Fabric's); the others as off."""
        if arguments.get("offload_fraction") == "auto" and not times_closure:
            raise ValueError(f"offload_fraction='auto' is for the Trainer (it times the step's closure); with "
                             f"{strategy} give a number in [0.0, 1.0]")
        elementwise = check_optimizer_names(arguments.pop("elementwise_optimizers", ()), "elementwise_optimizers")
        offload_parameters = arguments.pop("offload_parameters", False)
        arguments = {"keep_gradients": False, "stream_cpu_step": False, "gpu_memory_budget_gb": None,
                     "delayed_update": False, "delayed_update_warmup": 40, "host_state_dtype": "float32",
                     "forward_waits": "step", **arguments}
        check_offload_parameters(offload_parameters, arguments)
        options = cls.check(**arguments, zero_stage=0)
        options.elementwise_optimizers = elementwise
        options.offload_parameters = offload_parameters
        return options


def check_offload_parameters(offload_parameters: Any, arguments: Mapping[str, Any]) -> None:
    """``offload_parameters`` (the FSDP strategies') checked with the other arguments: the
    host shards are the master weights, updated in place by the CPU kernels, so every rank's
    whole shard and its state are on the host (``offload_fraction`` 1) and no update can
    wait for the next step beside them (``delayed_update`` keeps masters apart from the
    weights the forward reads)."""
    if not isinstance(offload_parameters, bool):
        raise TypeError(f"offload_parameters must be True or False, got {offload_parameters!r}")
    if not offload_parameters:
        return
    fraction = arguments.get("offload_fraction", 1.0)
    if fraction == "auto" or isinstance(fraction, bool) or fraction != 1.0:
        raise ValueError(f"offload_parameters=True keeps each rank's parameter shards in host memory, where the CPU "
                         f"kernels update them in place with their state: offload_fraction must be 1.0, got "
                         f"{fraction!r}")
    if arguments.get("delayed_update"):
        raise ValueError("offload_parameters=True updates the host shards the next forward reads in place: "
                         "delayed_update=True (an update running during the next forward, on masters apart from "
                         "the weights) cannot be used with it")


def offload_arguments(options: Any, params_on_host: bool = False, processes_per_host: int = 1,
                      step_cores: tuple[int, ...] | None = None) -> dict[str, Any]:
    """The arguments of the offload (or ZeRO) optimizer that come from the options (without
    ``device_grads`` and the schedule's, which the run's plan decides).  ``options``: a
    :class:`StrategyOptions`, or the Trainer's strategy, which keeps the same values as
    attributes (read at set-up, as Lightning strategies' attributes are).
    ``params_on_host``: the parameters are host tensors already (FSDP's ``CPUOffloadPolicy``
    shards), their own masters updated in place on every machine: nothing to copy
    (the offload optimizer's ``host_shards``); ``processes_per_host``: the processes that
    share this host's memory (``host_state_gib="auto"`` takes a share each); ``step_cores``:
    the cores ``bind_cpu_threads`` gave the CPU step (:class:`~lightning_fastopt.core.cpu_threads.TorchThreads`)."""
    args = dict(offload_fraction=options.offload_fraction, bucket_size_mb=options.bucket_size_mb,
                overlap=options.overlap, pin_memory=options.pin_memory,
                wall_clock_breakdown=options.wall_clock_breakdown,
                copy_on_cpu=(options.copy_on_cpu or options.delayed_update) and not params_on_host)
    if params_on_host:
        args["host_shards"] = True
    if options.host_state_dtype != torch.float32:
        args["host_state_dtype"] = options.host_state_dtype
    if options.offload_optimizer_device != "cpu":
        args.update(offload_optimizer_device=options.offload_optimizer_device, nvme_path=options.nvme_path,
                    nvme_window_mb=options.nvme_window_mb)
    if options.host_state_gib is not None:
        args.update(host_state_gib=options.host_state_gib, host_reserve_gib=options.host_reserve_gib,
                    processes_per_host=processes_per_host)
    if step_cores is not None:
        args["step_cores"] = step_cores
    return args


def check_disk_tier(device: Any, nvme_path: Any, nvme_window_mb: Any, *, offload_fraction: Any) -> None:
    """``offload_optimizer_device``, ``nvme_path`` and ``nvme_window_mb`` checked with the
    arguments they go with (the directory too: it exists and this process can write there;
    the space the file needs is checked when the optimizer is set up)."""
    check_offload_device(device, nvme_path, nvme_window_mb)
    if device != "nvme":
        return
    check_directory(nvme_path)
    if not isinstance(offload_fraction, str) and offload_fraction == 0:
        raise ValueError("offload_optimizer_device='nvme' keeps the offloaded share's masters and optimizer state "
                         "on disk: offload_fraction=0 offloads nothing")


def check_fraction(offload_fraction: Any, budget_gb: Any, zero_stage: Any) -> bool:
    """Refuse a bad ``offload_fraction`` or ``gpu_memory_budget_gb``; True for ``"auto"``."""
    auto = offload_fraction == "auto"
    if isinstance(offload_fraction, str) and not auto:
        raise TypeError(f"offload_fraction must be a number in [0.0, 1.0] or 'auto', got {offload_fraction!r}")
    if not auto:
        check_range("offload_fraction", offload_fraction, 0.0, 1.0)
    elif zero_stage:
        raise ValueError(f"offload_fraction='auto' runs with zero_stage=0 only, got zero_stage={zero_stage!r}")
    if budget_gb is not None:
        if not auto:
            raise ValueError("gpu_memory_budget_gb is for offload_fraction='auto' (it chooses the fraction that "
                             f"fits), got offload_fraction={offload_fraction!r}")
        if isinstance(budget_gb, bool) or not isinstance(budget_gb, (int, float)) or not budget_gb > 0:
            raise ValueError(f"gpu_memory_budget_gb must be a positive number of GiB or None, got {budget_gb!r}")
    return auto
