"""A DeepSpeed config (``DeepSpeedStrategy(config=...)``: a dict, or the path of a JSON file)
read into the words of Lightning's ``DeepSpeedStrategy`` arguments, which
:mod:`~lightning_fastopt.from_deepspeed.arguments` maps to ours.

Every key of DeepSpeed's schema is known here as one of: read (its value maps to one of
our arguments, or to the Trainer's ``gradient_clip_val`` / ``accumulate_grad_batches`` /
``precision``), of no effect here (said once in the log: logging, bucket sizes, DeepSpeed's
own I/O), or refused where its value would change the math and we cannot honour it (each
with the reason).  A key DeepSpeed does not have is an error naming it, the file and the
nearest known key; so is a value of the wrong kind.  ``"auto"`` (Hugging Face's configs)
is taken for the values the Trainer decides (the half precision, clipping, accumulation).
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_fastopt.from_deepspeed.sections import AUTO, check_optimizer_section, check_scheduler_section

__all__ = ["DeepSpeedConfig", "read_config"]

# top-level keys DeepSpeed has that change nothing here (what Lightning's loggers, the
# DataLoader or our own I/O do instead), each with the reason said in the log
_NO_EFFECT = {
    "train_batch_size": "the DataLoader's batch size decides",
    "train_micro_batch_size_per_gpu": "the DataLoader's batch size decides",
    "steps_per_print": "Lightning's loggers and progress bar report",
    "dump_state": "DeepSpeed's own debugging",
    "memory_breakdown": "DeepSpeed's own debugging",
    "flops_profiler": "DeepSpeed's profiler",
    "tensorboard": "Lightning's loggers report",
    "wandb": "Lightning's loggers report",
    "csv_monitor": "Lightning's loggers report",
    "comet": "Lightning's loggers report",
    "comms_logger": "DeepSpeed's communication logger",
    "aio": "the disk tier does its own I/O (nvme_window_mb sizes its memory)",
    "zero_allow_untested_optimizer": "every optimizer runs: by our kernels, its own step, or as torch runs it",
    "zero_force_ds_cpu_optimizer": "the offloaded share always runs on our CPU kernels, or its own step",
    "checkpoint": "checkpoints are Lightning's (docs/checkpoints.md)",
    "autotuning": "DeepSpeed's autotuner",
    "timers": "DeepSpeed's timers (wall_clock_breakdown times our step)",
}

# top-level keys that change the math where enabled: refused then, each with the reason
_REFUSED_WHEN_ON = {
    "amp": "NVIDIA apex's mixed precision: use the Trainer's precision='16-mixed' or 'bf16-mixed'",
    "sparse_gradients": "DeepSpeed's sparse all-reduce of embedding gradients",
    "prescale_gradients": "gradients divided before the all-reduce instead of after, as DDP does",
    "activation_checkpointing": "DeepSpeed's activation checkpointing, which a model calls itself: use "
                                "torch.utils.checkpoint",
    "sparse_attention": "DeepSpeed's sparse attention kernels",
    "data_efficiency": "DeepSpeed's data sampling and routing",
    "curriculum_learning": "DeepSpeed's curriculum learning",
    "compression_training": "DeepSpeed's compression",
    "elasticity": "DeepSpeed's elastic batch sizes",
    "pipeline": "DeepSpeed's pipeline parallelism",
    "quantize_training": "DeepSpeed's quantized training",
}

# top-level keys read here (each by its branch of _Reader.top_level)
_READ = ("zero_optimization", "fp16", "bf16", "gradient_clipping", "gradient_accumulation_steps", "wall_clock_breakdown",
         "optimizer", "scheduler", "gradient_predivide_factor", "communication_data_type")

# zero_optimization keys of no effect here, and those refused when on
_ZERO_NO_EFFECT = {
    "contiguous_gradients", "overlap_comm", "reduce_scatter", "reduce_bucket_size", "allgather_partitions",
    "allgather_bucket_size", "round_robin_gradients", "sub_group_size", "elastic_checkpoint",
    "load_from_fp32_weights", "ignore_unused_parameters", "legacy_stage1", "stage3_max_live_parameters",
    "stage3_max_reuse_distance", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
    "stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save",
    "memory_efficient_linear", "use_multi_rank_bucket_allreduce", "model_persistence_threshold",
    "cpu_offload_use_pin_memory", "use_all_reduce_for_fetch_params", "log_trace_cache_warnings",
}
_ZERO_REFUSED_WHEN_ON = {
    "zero_quantized_weights": "weights quantized for the all-gather",
    "zero_quantized_gradients": "gradients quantized for the reduce-scatter",
    "zero_quantized_nontrainable_weights": "frozen weights quantized",
    "zero_hpz_partition_size": "hierarchical partitioning (ZeRO++)",
    "mics_shard_size": "MiCS sharding",
    "cpu_offload_params": "parameters offloaded to the CPU (ZeRO-3's, FastOptFSDPStrategy(offload_parameters=True))",
}
# the sizes among those that mean "off" at or below a value (DeepSpeed's defaults: 1 and -1)
_SIZES_OFF = {"zero_hpz_partition_size": 1, "mics_shard_size": 0}
_OFFLOAD_OPTIMIZER_NO_EFFECT = {"buffer_count", "fast_init", "pipeline", "pipeline_read", "pipeline_write"}
_OFFLOAD_PARAM_KEYS = {"device", "nvme_path", "pin_memory", "buffer_count", "buffer_size", "max_in_cpu"}
_FP16_KEYS = {"enabled", "auto_cast", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
              "consecutive_hysteresis", "min_loss_scale", "fp16_master_weights_and_grads"}
_BF16_KEYS = {"enabled", "immediate_grad_update", "check_grad_overflow", "bf16_master_weights_and_grads",
              "bf16_optimizer_states"}


@dataclass
class DeepSpeedConfig:
    """What a DeepSpeed config says, in the words of ``DeepSpeedStrategy``'s arguments
    (``arguments``: ``stage``, ``offload_optimizer``, ``offload_optimizer_device``,
    ``nvme_path``, ``pin_memory``, the loss-scale knobs, ``wall_clock_breakdown``, and
    ``offload_fraction`` from ``offload_optimizer.ratio``), what it asks of the Trainer
    (``trainer``: ``gradient_clip_val``, ``accumulate_grad_batches``; ``precision``: the
    half precision it enables, ``"16"``, ``"bf16"`` or ``"32"``, None where the Trainer's
    decides), each key's path as it appears (``where``), the keys of no effect
    (``no_effect``: the reason of each), and the ``optimizer`` and ``scheduler`` sections
    (checked: :mod:`~lightning_fastopt.from_deepspeed.sections` makes them at set-up)."""

    source: str
    arguments: dict[str, Any] = field(default_factory=dict)
    trainer: dict[str, Any] = field(default_factory=dict)
    precision: str | None = None
    where: dict[str, str] = field(default_factory=dict)
    no_effect: dict[str, str] = field(default_factory=dict)
    sections: tuple[str, ...] = ()
    optimizer: dict[str, Any] | None = None  # the optimizer and scheduler sections, checked
    scheduler: dict[str, Any] | None = None


def read_config(config: Any) -> DeepSpeedConfig:
    """``config`` (a dict, or a path to a JSON file) read (see the module's documentation)."""
    source, data = _load(config)
    out = DeepSpeedConfig(source)
    reader = _Reader(source, out)
    if not isinstance(data, Mapping):
        raise TypeError(f"the {source} must be a JSON object, got {type(data).__name__}")
    out.sections = tuple(data)
    for key, value in data.items():
        reader.top_level(key, value)
    return out


def _load(config: Any) -> tuple[str, Any]:
    if isinstance(config, Mapping):
        return "DeepSpeed config dict", dict(config)
    if isinstance(config, (str, os.PathLike)):
        path = Path(config)
        if not path.is_file():
            raise FileNotFoundError(f"config={str(config)!r}: no DeepSpeed config file there (give a JSON file's "
                                    "path or a dict)")
        try:
            return f"DeepSpeed config {path}", json.loads(path.read_text())
        except json.JSONDecodeError as error:
            raise ValueError(f"the DeepSpeed config {path} is not valid JSON: {error}") from None
    raise TypeError(f"config must be a dict or the path of a DeepSpeed JSON config, got {type(config).__name__}")


class _Reader:
    """Reads one config into a :class:`DeepSpeedConfig`, each key checked where it stands."""

    def __init__(self, source: str, out: DeepSpeedConfig) -> None:
        self.source, self.out = source, out

    # -------------------------------------------------------------- errors and values
    def _error(self, path: str, why: str) -> ValueError:
        return ValueError(f"{path} in the {self.source}: {why}")

    def _unknown(self, path: str, key: str, known: set[str] | dict) -> ValueError:
        close = difflib.get_close_matches(key, list(known), 1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return self._error(f"{path}{key}", f"not a key DeepSpeed's config has here{hint}")

    def _bool(self, path: str, value: Any) -> bool:
        if not isinstance(value, bool):
            raise self._error(path, f"must be true or false, got {value!r}")
        return value

    def _number(self, path: str, value: Any, integer: bool = False) -> float | int:
        kinds = (int,) if integer else (int, float)
        if isinstance(value, bool) or not isinstance(value, kinds):
            raise self._error(path, f"must be {'an integer' if integer else 'a number'}, got {value!r}")
        return value

    def _put(self, name: str, value: Any, path: str) -> None:
        self.out.arguments[name] = value
        self.out.where[name] = path

    def _say_no_effect(self, path: str, why: str) -> None:
        self.out.no_effect[path] = why

    def _refuse_when_on(self, path: str, value: Any, why: str) -> None:
        if isinstance(value, Mapping):  # off where disabled, or where none of its flags is on (Hugging Face's)
            off = value.get("enabled") is False or not any(v is True for v in value.values())
        else:
            off = value is None or value is False or (not isinstance(value, bool) and value == 0)
        if not off:
            raise self._error(path, f"{why}: not done by lightning_fastopt's strategies, and it changes the math; "
                                    "remove it (docs/from_deepspeed.md)")

    # -------------------------------------------------------------- sections
    def top_level(self, key: str, value: Any) -> None:
        if key == "zero_optimization":
            self.zero(value)
        elif key == "fp16":
            self.half("fp16", value, _FP16_KEYS)
        elif key == "bf16":
            self.half("bf16", value, _BF16_KEYS)
        elif key == "gradient_clipping":
            if value != AUTO:
                clip = self._number(key, value)
                if clip < 0:
                    raise self._error(key, f"must be 0 (no clipping) or more, got {clip!r}")
                self.out.trainer["gradient_clip_val"] = float(clip) if clip else None
                self.out.where["gradient_clip_val"] = key
        elif key == "gradient_accumulation_steps":
            if value != AUTO:
                steps = self._number(key, value, integer=True)
                if steps < 1:
                    raise self._error(key, f"must be 1 or more, got {steps!r}")
                self.out.trainer["accumulate_grad_batches"] = steps
                self.out.where["accumulate_grad_batches"] = key
        elif key == "wall_clock_breakdown":
            self._put("wall_clock_breakdown", self._bool(key, value), key)
        elif key == "optimizer":
            check_optimizer_section(value, self.source)
            self.out.optimizer = dict(value)
        elif key == "scheduler":
            check_scheduler_section(value, self.source)
            self.out.scheduler = dict(value)
        elif key == "gradient_predivide_factor":
            if self._number(key, value) != 1.0:
                raise self._error(key, "gradients divided by a factor before the all-reduce and the rest after: "
                                       "not done here, and it rounds differently; remove it")
        elif key == "communication_data_type":
            if value not in (None, "fp32", "float32"):
                raise self._error(key, f"{value!r} all-reduces gradients in a half type: not done here, and it changes "
                                       "the math; remove it (gradients are reduced in their own dtype, as DDP does)")
        elif key in _NO_EFFECT:
            self._say_no_effect(key, _NO_EFFECT[key])
        elif key in _REFUSED_WHEN_ON:
            self._refuse_when_on(key, value, _REFUSED_WHEN_ON[key])
        else:
            raise self._unknown("", key, {*_READ, *_NO_EFFECT, *_REFUSED_WHEN_ON})

    def zero(self, section: Any) -> None:
        if not isinstance(section, Mapping):
            raise self._error("zero_optimization", f"must be an object, got {section!r}")
        for key, value in section.items():
            path = f"zero_optimization.{key}"
            if key == "stage":
                stage = self._number(path, value, integer=True)
                if stage not in (0, 1, 2, 3):
                    raise self._error(path, f"must be 0, 1, 2 or 3, got {stage!r}")
                self._put("stage", stage, path)
            elif key == "offload_optimizer":
                self.offload_optimizer(value)
            elif key == "offload_param":
                self.offload_param(value)
            elif key == "cpu_offload":  # DeepSpeed's older word for offload_optimizer.device "cpu"
                if self._bool(path, value):
                    self._put("offload_optimizer", True, path)
                    self._put("offload_optimizer_device", "cpu", path)
            elif key in _ZERO_NO_EFFECT:
                self._say_no_effect(path, "DeepSpeed's own buckets and communication")
            elif key in _ZERO_REFUSED_WHEN_ON:
                if not (key in _SIZES_OFF and isinstance(value, int) and value <= _SIZES_OFF[key]):
                    self._refuse_when_on(path, value, _ZERO_REFUSED_WHEN_ON[key])
            else:
                raise self._unknown("zero_optimization.", key, {
                    "stage", "offload_optimizer", "offload_param", "cpu_offload", *_ZERO_NO_EFFECT,
                    *_ZERO_REFUSED_WHEN_ON})

    def offload_optimizer(self, section: Any) -> None:
        base = "zero_optimization.offload_optimizer"
        if not isinstance(section, Mapping):
            raise self._error(base, f"must be an object, got {section!r}")
        device = section.get("device", "cpu")
        if device not in ("cpu", "nvme", "none", None):
            raise self._error(f"{base}.device", f"must be 'cpu', 'nvme' or 'none', got {device!r}")
        offloaded = device not in ("none", None)
        self._put("offload_optimizer", offloaded, f"{base}.device")
        for key, value in section.items():
            path = f"{base}.{key}"
            if key == "device":
                if offloaded:
                    self._put("offload_optimizer_device", device, path)
            elif key == "nvme_path":
                self._put("nvme_path", value, path)
            elif key == "pin_memory":
                self._put("pin_memory", self._bool(path, value), path)
            elif key == "ratio":  # ZeRO-Offload++: the share of the optimizer's state on the CPU
                ratio = self._number(path, value)
                if not 0 <= ratio <= 1:
                    raise self._error(path, f"must be in [0, 1], got {ratio!r}")
                self._put("offload_fraction", float(ratio), path)
            elif key in _OFFLOAD_OPTIMIZER_NO_EFFECT:
                self._say_no_effect(path, "DeepSpeed's own buffers")
            else:
                raise self._unknown(f"{base}.", key, {"device", "nvme_path", "pin_memory", "ratio",
                                                      *_OFFLOAD_OPTIMIZER_NO_EFFECT})

    def offload_param(self, section: Any) -> None:
        base = "zero_optimization.offload_param"
        if not isinstance(section, Mapping):
            raise self._error(base, f"must be an object, got {section!r}")
        for key in section:
            if key not in _OFFLOAD_PARAM_KEYS:
                raise self._unknown(f"{base}.", key, _OFFLOAD_PARAM_KEYS)
        device = section.get("device", "cpu")
        if device in ("none", None):
            return
        if device != "cpu":
            raise self._error(f"{base}.device", f"{device!r}: parameters are offloaded to host memory only "
                                                "(FastOptFSDPStrategy(offload_parameters=True)), not to disk")
        self._put("offload_parameters", True, f"{base}.device")
        if "pin_memory" in section:
            self._put("pin_memory", self._bool(f"{base}.pin_memory", section["pin_memory"]), f"{base}.pin_memory")
        for key in ("buffer_count", "buffer_size", "max_in_cpu", "nvme_path"):
            if key in section:
                self._say_no_effect(f"{base}.{key}", "DeepSpeed's own buffers")

    def half(self, name: str, section: Any, keys: set[str]) -> None:
        if not isinstance(section, Mapping):
            raise self._error(name, f"must be an object, got {section!r}")
        for key in section:
            if key not in keys:
                raise self._unknown(f"{name}.", key, keys)
        enabled = section.get("enabled", False)
        if enabled != AUTO:
            enabled = self._bool(f"{name}.enabled", enabled)
            if enabled:
                half = "16" if name == "fp16" else "bf16"
                if self.out.precision in ("16", "bf16") and self.out.precision != half:
                    raise self._error(f"{name}.enabled", "both fp16 and bf16 are enabled; enable one")
                self.out.precision = half
                self.out.where["precision"] = f"{name}.enabled"
            elif self.out.precision is None:
                self.out.precision = "32"
                self.out.where["precision"] = f"{name}.enabled"
        for key in ("fp16_master_weights_and_grads", "bf16_master_weights_and_grads", "bf16_optimizer_states",
                    "consecutive_hysteresis"):
            if section.get(key):
                raise self._error(f"{name}.{key}", "not done by lightning_fastopt's strategies (masters and state "
                                                   "are float32; the scale halves after `hysteresis` overflows in a "
                                                   "row or not), and it changes the math; remove it")
        for key in ("immediate_grad_update", "check_grad_overflow", "auto_cast"):
            if key in section:
                self._say_no_effect(f"{name}.{key}", "the Trainer's precision plugin decides")
        if name == "fp16":
            for key in ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale"):
                if key in section:
                    value = self._number(f"fp16.{key}", section[key], integer=key != "loss_scale"
                                         and key != "min_loss_scale")
                    self._put(key, value, f"fp16.{key}")
