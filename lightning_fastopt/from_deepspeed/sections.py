"""A DeepSpeed config's ``optimizer`` and ``scheduler`` sections, which stand in for
``configure_optimizers`` as they do under ``DeepSpeedStrategy``: checked when the strategy
is built (:func:`check_optimizer_section`, :func:`check_scheduler_section`), made over the
model's parameters at set-up (:func:`make_optimizer`, :func:`make_scheduler`).

The optimizer is torch's, with DeepSpeed's meaning of the section: ``Adam`` is AdamW unless
``adam_w_mode`` is false, ``AdamW`` always; without ``torch_adam`` DeepSpeed's own Adam's
defaults hold (``weight_decay`` 0), with it torch's; any other name is torch's optimizer of
that name with the section's ``params``, as DeepSpeed makes it.  Our strategies then run it
as they run any torch optimizer (our kernels, bit for bit with torch).  DeepSpeed's own
algorithms without a torch equal (its LAMB, 1-bit and 0/1 Adam, Lion, Muon, the mu-P
optimizers) are refused with the reason.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from lightning_fastopt.from_deepspeed.schedules import SCHEDULES

__all__ = ["AUTO", "check_optimizer_section", "check_scheduler_section", "make_optimizer", "make_scheduler"]

AUTO = "auto"  # Hugging Face's configs: a value its Trainer fills in

# DeepSpeed's own algorithms, refused: the reason of each
_NOT_TORCHS = {
    "lamb": "DeepSpeed's LAMB clips its trust ratio to [min_coeff, max_coeff], which no torch or lightning_fastopt "
            "optimizer does; return lightning_fastopt.FusedLAMB (apex's LAMB) from configure_optimizers if it suits",
    "onebitadam": "1-bit Adam compresses the communication, which changes the math",
    "zerooneadam": "0/1 Adam compresses the communication, which changes the math",
    "onebitlamb": "1-bit LAMB compresses the communication, which changes the math",
    "lion": "DeepSpeed's Lion is not read yet: return lightning_fastopt.FusedLion from configure_optimizers",
    "muon": "DeepSpeed's Muon is not read yet: return torch.optim.Muon from configure_optimizers",
    "muadam": "mu-P's optimizers need its parameter shapes: return them from configure_optimizers",
    "muadamw": "mu-P's optimizers need its parameter shapes: return them from configure_optimizers",
    "musgd": "mu-P's optimizers need its parameter shapes: return them from configure_optimizers",
}
# DeepSpeed's own Adam's defaults (FusedAdam, DeepSpeedCPUAdam)
_DEEPSPEED_ADAM = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
_ADAM_KEYS = {"lr", "betas", "eps", "weight_decay", "amsgrad", "bias_correction", "adam_w_mode", "torch_adam",
              "fp32_optimizer_states", "foreach", "fused", "maximize", "capturable", "differentiable"}


def _error(source: str, path: str, why: str) -> ValueError:
    return ValueError(f"{path} in the {source}: {why}")


def check_optimizer_section(section: Any, source: str) -> None:
    """The section's type is one we make and its ``params`` are that optimizer's (an error
    naming the key and the file otherwise), checked without parameters."""
    _optimizer_class_and_arguments(section, source)


def make_optimizer(section: Mapping[str, Any], parameters: Iterable[torch.nn.Parameter],
                   source: str) -> torch.optim.Optimizer:
    """The optimizer the section describes, over ``parameters`` (those that require grad)."""
    cls, arguments = _optimizer_class_and_arguments(section, source)
    return cls([p for p in parameters if p.requires_grad], **arguments)


def _optimizer_class_and_arguments(section: Any, source: str) -> tuple[type, dict[str, Any]]:
    if not isinstance(section, Mapping) or "type" not in section:
        raise _error(source, "optimizer", f"must be an object with a type, got {section!r}")
    for key in section:
        if key not in ("type", "params"):
            raise _error(source, f"optimizer.{key}", "not a key DeepSpeed's optimizer section has (type, params)")
    name, params = section["type"], dict(section.get("params") or {})
    if not isinstance(name, str):
        raise _error(source, "optimizer.type", f"must be a name, got {name!r}")
    for key, value in params.items():
        if value == AUTO:
            raise _error(source, f"optimizer.params.{key}", "'auto' is filled in by Hugging Face's Trainer; give the "
                                                            "value")
    lowered = name.lower()
    if lowered in _NOT_TORCHS:
        raise _error(source, "optimizer.type", f"{name!r}: {_NOT_TORCHS[lowered]}")
    if lowered in ("adam", "adamw"):
        for key in params:
            if key not in _ADAM_KEYS:
                raise _error(source, f"optimizer.params.{key}", f"not an argument of {name}")
        if not params.pop("bias_correction", True):
            raise _error(source, "optimizer.params.bias_correction", "false is not torch's Adam; remove it")
        params.pop("fp32_optimizer_states", None)  # masters and state are float32 here anyway
        adamw = lowered == "adamw" or params.pop("adam_w_mode", True)
        params.pop("adam_w_mode", None)
        torch_defaults = params.pop("torch_adam", False)
        arguments = params if torch_defaults else {**_DEEPSPEED_ADAM, **params}
        if "betas" in arguments:
            arguments["betas"] = tuple(arguments["betas"])
        return (torch.optim.AdamW if adamw else torch.optim.Adam), arguments
    cls = getattr(torch.optim, name, None)
    if cls is None and lowered == "adagrad":
        cls = torch.optim.Adagrad
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise _error(source, "optimizer.type", f"{name!r} is neither DeepSpeed's nor a torch.optim optimizer")
    accepted = set(inspect.signature(cls.__init__).parameters) - {"self", "params"}
    for key in params:
        if key not in accepted:
            raise _error(source, f"optimizer.params.{key}", f"not an argument of torch.optim.{cls.__name__}")
    return cls, params


def check_scheduler_section(section: Any, source: str) -> None:
    """The section's type is one of :data:`~lightning_fastopt.from_deepspeed.schedules.SCHEDULES`
    and its ``params`` that class's (an error naming the key and the file otherwise)."""
    _scheduler_class(section, source)


def make_scheduler(section: Mapping[str, Any], optimizer: torch.optim.Optimizer, total_steps: int,
                   source: str) -> Any:
    """The schedule the section describes over ``optimizer``; ``"auto"`` (Hugging Face's) is
    taken for ``total_num_steps`` (``total_steps``: the Trainer's estimate of the steps) and
    ``warmup_max_lr`` (the optimizer's rate)."""
    cls = _scheduler_class(section, source)
    params = dict(section.get("params") or {})
    if params.get("total_num_steps") == AUTO:
        params["total_num_steps"] = int(total_steps)
    if params.get("warmup_max_lr") == AUTO:
        params["warmup_max_lr"] = [g["lr"] for g in optimizer.param_groups]
    params.pop("last_batch_iteration", None)  # -1 checked: the schedule starts from the beginning
    try:
        return cls(optimizer, **params)
    except ValueError as error:
        raise _error(source, "scheduler.params", str(error)) from None


def _scheduler_class(section: Any, source: str) -> type:
    if not isinstance(section, Mapping) or "type" not in section:
        raise _error(source, "scheduler", f"must be an object with a type, got {section!r}")
    for key in section:
        if key not in ("type", "params"):
            raise _error(source, f"scheduler.{key}", "not a key DeepSpeed's scheduler section has (type, params)")
    name = section["type"]
    if name not in SCHEDULES:
        raise _error(source, "scheduler.type", f"{name!r}: not one of DeepSpeed's schedules ({', '.join(SCHEDULES)})")
    cls = SCHEDULES[name]
    accepted = set(inspect.signature(cls.__init__).parameters) - {"self", "optimizer", "last_epoch"}
    params = dict(section.get("params") or {})
    for key, value in params.items():
        if key == "last_batch_iteration":
            if value != -1:
                raise _error(source, "scheduler.params.last_batch_iteration", "only -1 (from the beginning): a "
                                                                              "resumed run restores the schedule")
        elif key not in accepted:
            raise _error(source, f"scheduler.params.{key}", f"not an argument of DeepSpeed's {name}")
        elif value == AUTO and key not in ("total_num_steps", "warmup_max_lr"):
            raise _error(source, f"scheduler.params.{key}", "'auto' is filled in by Hugging Face's Trainer; give the "
                                                            "value")
    for needed in ("total_num_steps", "cycle_min_lr", "cycle_max_lr"):
        if needed in accepted and needed not in params:
            raise _error(source, f"scheduler.params.{needed}", f"{name} needs it")
    return cls
