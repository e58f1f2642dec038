"""Lightning's ``DeepSpeedStrategy`` arguments taken by our strategies, so that replacing the
class name is the whole change (docs/from_deepspeed.md has the table):

- the words that mean the same here keep their names: ``offload_optimizer_device``,
  ``nvme_path``, ``pin_memory`` and the fp16 loss-scale knobs (``loss_scale``,
  ``initial_scale_power``, ``loss_scale_window``, ``hysteresis``, ``min_loss_scale``) are our
  own arguments already;
- ``zero_optimization``, ``stage``, ``offload_optimizer`` and ``config`` map to ours
  (:func:`from_deepspeed`); where any of them is given, DeepSpeed's defaults hold for the
  others (``stage`` 2, ``offload_optimizer`` False: ``FastOptStrategy(stage=2)`` shards as
  ``DeepSpeedStrategy(stage=2)`` does and offloads nothing), unless our own ``zero_stage``
  or ``offload_fraction`` says otherwise, which must then agree with them;
- DeepSpeed's tuning knobs (bucket sizes, its I/O's buffers and threads, logging) have no
  effect here: taken, and said once in the log where given a value other than DeepSpeed's
  default (:data:`NO_EFFECT`);
- the rest are refused where given a value that would change what runs, with the reason
  (:data:`REFUSED`).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lightning.fabric.utilities.rank_zero import rank_zero_info

from lightning_fastopt.from_deepspeed.config import DeepSpeedConfig, read_config

__all__ = ["DEEPSPEED_WORDS", "NO_EFFECT", "REFUSED", "FromDeepSpeed", "from_deepspeed", "signature_defaults"]

DEEPSPEED_WORDS = ("zero_optimization", "stage", "offload_optimizer", "config")
"""``DeepSpeedStrategy``'s arguments that map to ours (each strategy's signature lists them)."""

# DeepSpeedStrategy's arguments of no effect here, with DeepSpeed's default (said when given another)
NO_EFFECT = {
    "params_buffer_count": 5, "params_buffer_size": 100_000_000, "max_in_cpu": 1_000_000_000,
    "optimizer_buffer_count": 4, "block_size": 1_048_576, "queue_depth": 8, "single_submit": False,
    "overlap_events": True, "thread_count": 1, "sub_group_size": 1_000_000_000_000, "contiguous_gradients": True,
    "overlap_comm": True, "allgather_partitions": True, "reduce_scatter": True, "allgather_bucket_size": 200_000_000,
    "reduce_bucket_size": 200_000_000, "zero_allow_untested_optimizer": True, "logging_batch_size_per_gpu": "auto",
    "logging_level": 30, "synchronize_checkpoint_boundary": False, "offload_params_device": "cpu",
}

# DeepSpeedStrategy's arguments refused where given other than DeepSpeed's default: (default, why)
REFUSED = {
    "remote_device": (None, "ZeRO-3's initialization on another device; FastOptFSDPStrategy builds the model with "
                            "configure_model (on the meta device) instead"),
    "partition_activations": (False, "DeepSpeed's activation checkpointing, which a model calls itself; use "
                                     "torch.utils.checkpoint"),
    "cpu_checkpointing": (False, "DeepSpeed's activation checkpointing, which a model calls itself; use "
                                 "torch.utils.checkpoint"),
    "contiguous_memory_optimization": (False, "DeepSpeed's activation checkpointing, which a model calls itself; "
                                              "use torch.utils.checkpoint"),
    "load_full_weights": (False, "loading one consolidated file: give ckpt_path the file (a checkpoint of ours or "
                                 "Lightning's); DeepSpeed's own directories are not read yet (issue 69)"),
    "exclude_frozen_parameters": (False, "checkpoints here hold every parameter, as Lightning's own strategies' do"),
}


@dataclass
class FromDeepSpeed:
    """What the DeepSpeed words given to a strategy come to: ``arguments`` (ours, to check as
    the strategy's own), what the run asks of the Trainer (``trainer``: its
    ``gradient_clip_val`` / ``accumulate_grad_batches``; ``precision``: ``"16"``, ``"bf16"``
    or ``"32"`` where a config decides), where each came from (``where``), and the lines
    said once (``no_effect``); ``config``: the config read, with its ``optimizer`` and
    ``scheduler`` sections."""

    arguments: dict[str, Any]
    trainer: dict[str, Any] = field(default_factory=dict)
    precision: str | None = None
    where: dict[str, str] = field(default_factory=dict)
    no_effect: list[str] = field(default_factory=list)
    config: DeepSpeedConfig | None = None  # the config read, where one was given

    @property
    def used(self) -> bool:
        return bool(self.where or self.no_effect or self.trainer or self.precision)

    def lines(self) -> list[str]:
        """What the strategy says once it is built: what DeepSpeed's words became, and what has
        no effect here."""
        said = []
        mapped = [f"{name}={self.arguments[name]!r} ({source})" for name, source in self.where.items()
                  if name in self.arguments]
        mapped += [f"Trainer {name}={value!r} ({self.where[name]})" for name, value in self.trainer.items()]
        if mapped:
            said.append(f"from DeepSpeed's words: {', '.join(mapped)}")
        if self.no_effect:
            said.append(f"no effect here (DeepSpeed's own tuning, logging or I/O): {', '.join(self.no_effect)}")
        return said

    def say(self) -> None:
        """Each of :meth:`lines`, on rank 0."""
        for line in self.lines():
            rank_zero_info(f"lightning_fastopt: {line}")


def from_deepspeed(arguments: Mapping[str, Any], defaults: Mapping[str, Any], extra: dict[str, Any], *,
                   strategy: str, stage_three: bool = False) -> FromDeepSpeed:
    """Our arguments with DeepSpeed's words folded in.  ``arguments``: the strategy's own
    (``locals()`` of its ``__init__``, :data:`DEEPSPEED_WORDS` among them), ``defaults``: their
    defaults (to tell what was given); ``extra``: its ``**kwargs``, from which DeepSpeed's
    other arguments are taken out (the rest go on to Lightning's strategy); ``strategy``: the
    class name, for messages; ``stage_three``: the FSDP strategies' (ZeRO stage 3), which take
    ``stage`` 3 only and have no ``zero_stage``."""
    result = FromDeepSpeed(dict(arguments))
    result.no_effect += _take_deepspeeds_kwargs(extra, strategy, stage_three)
    words, where = _words(arguments, result, strategy)
    if not words and result.config is None:
        return result
    given = {name for name in arguments if name in defaults and _differs(arguments[name], defaults[name])}
    for name, (value, source) in _ours(words, where, strategy, stage_three).items():
        if name not in defaults:
            why = (": parameters in host memory are ZeRO stage 3's, FastOptFSDPStrategy(offload_parameters=True)"
                   if name == "offload_parameters" else "")
            raise ValueError(f"{strategy} does not take {name} ({source}: {value!r}){why}")
        if name in given and _differs(arguments[name], value):
            raise ValueError(f"{strategy}: {name}={arguments[name]!r} and {source} ({value!r}) disagree; give one")
        result.arguments[name] = value
        result.where[name] = source
    return result


def _take_deepspeeds_kwargs(extra: dict[str, Any], strategy: str, stage_three: bool) -> list[str]:
    """DeepSpeedStrategy's arguments taken out of a strategy's ``**kwargs``: those of no effect
    given a value other than DeepSpeed's default (returned, to say), those refused (raised)."""
    no_effect = []
    for name, default in NO_EFFECT.items():
        if name in extra and _differs(value := extra.pop(name), default):
            no_effect.append(f"{name}={value!r}")
    if not stage_three and extra.get("offload_parameters", False) is not False:
        raise ValueError(f"{strategy} does not take offload_parameters={extra['offload_parameters']!r}: parameters in "
                         "host memory are ZeRO stage 3's, FastOptFSDPStrategy(offload_parameters=True)")
    extra.pop("offload_parameters", None)
    for name, (default, why) in REFUSED.items():
        if name in extra and _differs(value := extra.pop(name), default):
            raise ValueError(f"{strategy} does not take {name}={value!r}: {why}")
    return no_effect


def _words(arguments: Mapping[str, Any], result: FromDeepSpeed, strategy: str) -> tuple[dict, dict]:
    """DeepSpeed's words given (the config's and the arguments', which must agree) and where
    each came from; the config's other parts noted in ``result``."""
    words: dict[str, Any] = {}
    where: dict[str, str] = {}
    if arguments.get("config") is not None:
        config = result.config = read_config(arguments["config"])
        words.update(config.arguments)
        where.update({k: f"{v} of the {config.source}" for k, v in config.where.items()})
        result.trainer, result.precision = dict(config.trainer), config.precision
        result.no_effect += [f"{path} ({why})" for path, why in config.no_effect.items()]
        for name in ("gradient_clip_val", "accumulate_grad_batches", "precision"):
            if name in config.where:
                result.where[name] = f"{config.where[name]} of the {config.source}"
    for name in ("zero_optimization", "stage", "offload_optimizer"):
        if arguments.get(name) is not None:
            if name in words and words[name] != arguments[name]:
                raise ValueError(f"{strategy}: {name}={arguments[name]!r} and the config's {where[name]} "
                                 f"({words[name]!r}) disagree; give one")
            words[name], where[name] = arguments[name], name
    return words, where


def _ours(words: Mapping[str, Any], where: Mapping[str, str], strategy: str,
          stage_three: bool) -> dict[str, tuple[Any, str]]:
    """Our arguments that DeepSpeed's words come to (DeepSpeed's defaults where a word is
    not given), each with where it came from."""
    _check_flag(words, "zero_optimization")
    _check_flag(words, "offload_optimizer")
    stage = words.get("stage", 3 if stage_three else 2) if words.get("zero_optimization", True) else 0
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise ValueError(f"{strategy}: stage must be 0, 1, 2 or 3, got {stage!r}")
    if stage_three and stage != 3:
        raise ValueError(f"{strategy} is ZeRO stage 3 (FSDP2): stage={stage} ({where.get('stage', 'stage')}) is "
                         "FastOptStrategy's (zero_stage 0, 1 or 2)")
    if not stage_three and stage == 3:
        raise ValueError(f"{strategy} runs ZeRO stages 0-2: stage 3 ({where.get('stage', 'stage')}) is "
                         "FastOptFSDPStrategy's (FSDP2, the same arguments and config)")
    offloaded = words.get("offload_optimizer", False)
    if words.get("offload_parameters") and not offloaded:
        raise ValueError(f"{strategy}: {where['offload_parameters']} offloads the parameters without the optimizer: "
                         "here the parameter shards in host memory are the master weights the CPU kernels update, "
                         "so the optimizer's state is offloaded with them: offload the optimizer too "
                         "(offload_optimizer device 'cpu')")
    fraction = words.get("offload_fraction", 1.0) if offloaded else 0.0
    ours = {"offload_fraction": (fraction, where.get("offload_fraction", where.get("offload_optimizer",
                                                                                     "offload_optimizer (default)")))}
    if not stage_three:
        ours["zero_stage"] = (stage, where.get("stage", where.get("zero_optimization", "stage (DeepSpeed's default)")))
    for name in ("offload_optimizer_device", "nvme_path", "pin_memory", "loss_scale", "initial_scale_power",
                 "loss_scale_window", "hysteresis", "min_loss_scale", "wall_clock_breakdown", "offload_parameters"):
        if name in words:
            ours[name] = (words[name], where[name])
    return ours


def _check_flag(words: Mapping[str, Any], name: str) -> None:
    if name in words and not isinstance(words[name], bool):
        raise TypeError(f"{name} must be True or False, got {words[name]!r}")


def _differs(value: Any, default: Any) -> bool:
    try:
        return bool(value != default)
    except Exception:  # noqa: BLE001 - a value that cannot be compared is one given
        return True


def signature_defaults(init: Any) -> dict[str, Any]:
    """The defaults of a strategy's ``__init__`` (what its arguments are when not given)."""
    return {n: p.default for n, p in inspect.signature(init).parameters.items()
            if p.default is not inspect.Parameter.empty}
