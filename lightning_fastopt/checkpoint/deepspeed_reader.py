"""A checkpoint directory DeepSpeed wrote (``engine.save_checkpoint``, or Lightning's
``DeepSpeedStrategy``, whose files also hold Lightning's own state), read into whole tensors
by parameter name: the float32 master weights, the optimizer's state (Adam's moments) and
step count, put together from DeepSpeed's flat partitions of every rank, at ZeRO stages 1, 2
and 3, whatever the number of ranks that wrote it.

The layouts (DeepSpeed 0.19):

- stages 1 and 2: ``mp_rank_00_model_states.pt`` (the module's weights, ``param_shapes``:
  each optimizer group's parameter names and shapes, and the client's state) and one
  ``zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` per rank: its partition of each group's
  flat float32 masters (``single_partition_of_fp32_groups``), the optimizer's state over that
  partition (``base_optimizer_state``), and where each parameter's piece lies in it
  (``param_slice_mappings``); with bf16 training the optimizer files' names start with
  ``bf16_`` and the module's weights are bfloat16, the masters float32 as ever;
- stage 3: one ``zero_pp_rank_<r>_mp_rank_00_model_states.pt`` and one optimizer file per
  rank, each rank holding ``ceil(numel / ranks)`` elements of every parameter in turn
  (``fp32_flat_groups``, the optimizer's state in the same layout; frozen parameters in
  pieces in the model states, ``frozen_param_fragments``).

A directory with a ``latest`` file names its tag there; a tag's directory itself is taken as
it is.  Nothing is run from the files (:mod:`~lightning_fastopt.checkpoint.deepspeed_files`).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lightning_fastopt.checkpoint.deepspeed_files import DeepSpeedObject, read_deepspeed_file
from lightning_fastopt.checkpoint.errors import BrokenCheckpointError
from lightning_fastopt.optim.base import hyperparameters

__all__ = ["DeepSpeedCheckpoint", "LIGHTNINGS_PREFIX", "is_deepspeed_checkpoint", "read_deepspeed_checkpoint"]

LIGHTNINGS_PREFIX = "_forward_module."
"""Lightning's ``DeepSpeedStrategy`` hands DeepSpeed its module wrapped: names start with this."""

_MODEL_STAGE_12 = "mp_rank_00_model_states.pt"
_MODEL_STAGE_3 = "zero_pp_rank_0_mp_rank_00_model_states.pt"
_OPTIM = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")  # bf16_: bf16 training's
_DEEPSPEEDS_KEYS = {"module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
                    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
                    "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size",
                    "checkpoint_parallel_dimensions", "ds_config", "ds_version"}


@dataclass
class DeepSpeedCheckpoint:
    """What a DeepSpeed checkpoint holds, by parameter name (Lightning's wrapper's prefix
    taken off): ``masters`` (float32, whole), ``state`` (each parameter's optimizer state,
    whole: ``exp_avg``, ``exp_avg_sq``, ...), ``groups`` (each optimizer group's
    hyperparameters and its parameters' names, in DeepSpeed's order), ``step`` (the
    optimizer's step count), ``module`` (the other entries of the module's state: buffers,
    frozen parameters), ``loss_scaler`` (its attributes), ``client`` (what the saver added:
    Lightning's loops, epoch, callbacks, schedulers...), ``scheduler`` (DeepSpeed's own
    scheduler's state, where its engine had one), and where it came from."""

    directory: str
    tag: str
    stage: int
    world_size: int
    masters: dict[str, torch.Tensor] = field(default_factory=dict)
    state: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    groups: list[dict[str, Any]] = field(default_factory=list)
    step: torch.Tensor | None = None
    module: dict[str, torch.Tensor] = field(default_factory=dict)
    loss_scaler: dict[str, Any] = field(default_factory=dict)
    client: dict[str, Any] = field(default_factory=dict)
    global_steps: int = 0
    skipped_steps: int = 0
    scheduler: dict[str, Any] | None = None  # DeepSpeed's own scheduler's state (engine.save_checkpoint's)


def is_deepspeed_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a directory DeepSpeed wrote (with its ``latest`` file, or a tag's)."""
    path = Path(path)
    if not path.is_dir():
        return False
    if (path / _MODEL_STAGE_12).is_file() or (path / _MODEL_STAGE_3).is_file():
        return True
    latest = path / "latest"
    return latest.is_file() and (path / latest.read_text().strip()).is_dir()


def read_deepspeed_checkpoint(path: str | os.PathLike, tag: str | None = None) -> DeepSpeedCheckpoint:
    """The checkpoint in ``path`` (a directory with a ``latest`` file, or a tag's directory;
    ``tag``: which tag, instead of ``latest``'s)."""
    directory = _tag_directory(Path(path), tag)
    if (directory / _MODEL_STAGE_3).is_file():
        return _stage_3(directory)
    if (directory / _MODEL_STAGE_12).is_file():
        return _stage_1_or_2(directory)
    raise BrokenCheckpointError(f"{directory} holds no DeepSpeed model states ({_MODEL_STAGE_12} or "
                                f"{_MODEL_STAGE_3})")


def _tag_directory(path: Path, tag: str | None) -> Path:
    if not path.is_dir():
        raise FileNotFoundError(f"no DeepSpeed checkpoint directory at {path}")
    if tag is not None:
        if not (path / tag).is_dir():
            raise FileNotFoundError(f"the DeepSpeed checkpoint {path} has no tag {tag!r} (no directory {path / tag})")
        return path / tag
    if (path / _MODEL_STAGE_12).is_file() or (path / _MODEL_STAGE_3).is_file():
        return path  # a tag's directory
    latest = path / "latest"
    if not latest.is_file():
        raise BrokenCheckpointError(f"{path} is no DeepSpeed checkpoint: it has no 'latest' file naming its tag, and "
                                    "no model states of its own")
    name = latest.read_text().strip()
    if not name or not (path / name).is_dir():
        raise BrokenCheckpointError(f"the 'latest' file of {path} names the tag {name!r}, which has no directory there")
    return path / name


def _optimizer_files(directory: Path, stage: str) -> list[Path]:
    """Each rank's optimizer file, in rank order (an error where a rank's is missing)."""
    found = {int(m.group(1)): directory / f.name for f in sorted(directory.iterdir()) if (m := _OPTIM.match(f.name))}
    if not found:
        raise BrokenCheckpointError(f"the DeepSpeed checkpoint {directory} ({stage}) has no optimizer files "
                                    "(zero_pp_rank_<r>_mp_rank_00_optim_states.pt)")
    missing = [r for r in range(max(found) + 1) if r not in found]
    if missing:
        raise BrokenCheckpointError(f"the DeepSpeed checkpoint {directory} lacks the optimizer files of rank(s) "
                                    f"{missing} (it has {len(found)} of {max(found) + 1})")
    return [found[r] for r in sorted(found)]


def _model_states(path: Path) -> dict[str, Any]:
    states = read_deepspeed_file(path, "DeepSpeed model states")
    for key in ("module", "param_shapes"):
        if key not in states:
            raise BrokenCheckpointError(f"the DeepSpeed model states {path} hold no {key!r}")
    if states.get("mp_world_size", 1) != 1:
        raise ValueError(f"{path} was written with tensor (model) parallelism of {states['mp_world_size']}: not read "
                         "here (one model-parallel rank only)")
    return states


def _require(optim: dict[str, Any], keys: tuple[str, ...], path: Path, stage: str) -> None:
    for key in keys:
        if key not in optim:
            raise BrokenCheckpointError(f"the DeepSpeed optimizer states {path} hold no {key!r} (not ZeRO stage "
                                        f"{stage}'s)")


def _check_partitions(counts: Any, world: int, path: Path) -> None:
    counts = counts if isinstance(counts, list) else [counts]
    if any(int(c) != world for c in counts):
        raise BrokenCheckpointError(f"the DeepSpeed checkpoint {path.parent} has {world} optimizer file(s) but its "
                                    f"metadata ({path.name}) says the state is partitioned {counts} ways")


def _unprefixed(name: str) -> str:
    return name[len(LIGHTNINGS_PREFIX):] if name.startswith(LIGHTNINGS_PREFIX) else name


def _fill_common(out: DeepSpeedCheckpoint, model: dict[str, Any], optim: dict[str, Any]) -> None:
    """The client's state, the loss scaler, the module's other entries and the step count."""
    out.client = {k: v for k, v in model.items() if k not in _DEEPSPEEDS_KEYS}
    out.global_steps = int(model.get("global_steps", 0))
    out.skipped_steps = int(model.get("skipped_steps", 0))
    out.scheduler = model.get("lr_scheduler")
    scaler = optim.get("loss_scaler")
    out.loss_scaler = dict(vars(scaler)) if isinstance(scaler, DeepSpeedObject) else {}
    out.loss_scaler["dynamic"] = bool(optim.get("dynamic_loss_scale", out.loss_scaler.get("dynamic", False)))
    trainable = set(out.masters)
    out.module = {_unprefixed(k): v for k, v in model["module"].items() if _unprefixed(k) not in trainable}


def _stage_1_or_2(directory: Path) -> DeepSpeedCheckpoint:
    model = _model_states(directory / _MODEL_STAGE_12)
    files = _optimizer_files(directory, "stage 1 or 2")
    ranks = [read_deepspeed_file(f, "DeepSpeed optimizer states")["optimizer_state_dict"] for f in files]
    first = ranks[0]
    _require(first, ("single_partition_of_fp32_groups", "base_optimizer_state", "partition_count"), files[0],
             "1 or 2")
    if "param_slice_mappings" not in first:
        raise ValueError(f"the DeepSpeed optimizer states {files[0]} have no param_slice_mappings (written by a "
                         "DeepSpeed before 0.10): not read here")
    _check_partitions(first["partition_count"], len(files), files[0])
    out = DeepSpeedCheckpoint(str(directory.parent), directory.name, int(first.get("zero_stage", 2)), len(files))
    shapes = model["param_shapes"]
    for g, group_shapes in enumerate(shapes):
        masters = [r["single_partition_of_fp32_groups"][g] for r in ranks]
        states = [r["base_optimizer_state"]["state"].get(g, {}) for r in ranks]
        slices = [r["param_slice_mappings"][g] for r in ranks]
        names = []
        for name, shape in group_shapes.items():
            pieces = [(r, slices[r][name]) for r in range(len(ranks)) if name in slices[r]]
            whole = _joined([masters[r] for r, _ in pieces], [a for _, a in pieces], shape, name, directory)
            key = _unprefixed(name)
            names.append(key)
            out.masters[key] = whole
            out.state[key] = {k: _joined([states[r][k] for r, _ in pieces], [a for _, a in pieces], shape, name,
                                         directory)
                              for k, v in states[0].items() if torch.is_tensor(v) and v.dim() == 1}
        out.groups.append(_hyperparameters(first["base_optimizer_state"]["param_groups"][g], names))
        step = states[0].get("step")
        out.step = step if step is not None else out.step
    _fill_common(out, model, first)
    return out


def _joined(flats: list[torch.Tensor], addresses: list[Any], shape: Any, name: str, directory: Path) -> torch.Tensor:
    parts = [flat.narrow(0, int(a.start), int(a.numel)) for flat, a in zip(flats, addresses)]
    whole = torch.cat(parts) if parts else torch.empty(0)
    numel = math.prod(shape)
    if whole.numel() != numel:
        raise BrokenCheckpointError(f"the DeepSpeed checkpoint {directory} holds {whole.numel()} elements of {name} "
                                    f"across its ranks, not {numel} (shape {tuple(shape)})")
    return whole.clone().view(tuple(shape))


def _stage_3(directory: Path) -> DeepSpeedCheckpoint:
    files = _optimizer_files(directory, "stage 3")
    world = len(files)
    models = [directory / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(world)]
    if not all(m.is_file() for m in models):
        raise BrokenCheckpointError(f"the DeepSpeed checkpoint {directory} has {world} optimizer files but not one "
                                    "model states file per rank")
    model = _model_states(models[0])
    ranks = [read_deepspeed_file(f, "DeepSpeed optimizer states")["optimizer_state_dict"] for f in files]
    first = ranks[0]
    _require(first, ("fp32_flat_groups", "optimizer_state_dict", "partition_count"), files[0], "3")
    _check_partitions(first["partition_count"], world, files[0])
    out = DeepSpeedCheckpoint(str(directory.parent), directory.name, 3, world)
    for g, group_shapes in enumerate(model["param_shapes"]):
        flats = [r["fp32_flat_groups"][g] for r in ranks]
        states = [r["optimizer_state_dict"]["state"].get(g, {}) for r in ranks]
        moments = [k for k, v in states[0].items() if torch.is_tensor(v) and v.dim() == 1]
        offset, names = 0, []
        for name, shape in group_shapes.items():
            numel = math.prod(shape)
            each = math.ceil(numel / world)  # every rank's piece, the last ones padded

            def whole(tensors: list[torch.Tensor], name=name, shape=shape, numel=numel, each=each) -> torch.Tensor:
                if any(t.numel() < offset + each for t in tensors):
                    raise BrokenCheckpointError(f"the DeepSpeed checkpoint {directory} ends inside {name}'s pieces")
                return torch.cat([t.narrow(0, offset, each) for t in tensors]).narrow(0, 0, numel).clone().view(
                    tuple(shape))

            key = _unprefixed(name)
            names.append(key)
            out.masters[key] = whole(flats)
            out.state[key] = {k: whole([s[k] for s in states]) for k in moments}
            offset += each
        if any(f.numel() != offset for f in flats):
            raise BrokenCheckpointError(f"the DeepSpeed checkpoint {directory}: group {g}'s partitions hold "
                                        f"{flats[0].numel()} elements, its parameters {offset} a rank")
        out.groups.append(_hyperparameters(first["optimizer_state_dict"]["param_groups"][g], names))
        step = states[0].get("step")
        out.step = step if step is not None else out.step
    _fill_common(out, model, first)
    out.module.update(_frozen_stage_3(model, models[1:], directory))
    return out


def _frozen_stage_3(model: dict[str, Any], others: list[Path], directory: Path) -> dict[str, torch.Tensor]:
    """Stage 3's frozen parameters, each rank holding a piece of each (``frozen_param_fragments``):
    rank 0's in ``model`` (its model states, read already), the other ranks' in ``others``."""
    shapes = model.get("frozen_param_shapes") or {}
    if not shapes:
        return {}
    pieces = [model.get("frozen_param_fragments", {})]
    pieces += [read_deepspeed_file(m, "DeepSpeed model states").get("frozen_param_fragments", {}) for m in others]
    frozen = {}
    for name, shape in shapes.items():
        if any(name not in p for p in pieces):
            raise BrokenCheckpointError(f"the DeepSpeed checkpoint {directory} lacks a rank's piece of the frozen "
                                        f"parameter {name}")
        numel = math.prod(shape)
        whole = torch.cat([p[name].reshape(-1) for p in pieces])
        if whole.numel() < numel:
            raise BrokenCheckpointError(f"the DeepSpeed checkpoint {directory} holds {whole.numel()} elements of the "
                                        f"frozen parameter {name}, not {numel}")
        frozen[_unprefixed(name)] = whole.narrow(0, 0, numel).clone().view(tuple(shape))
    return frozen


def _hyperparameters(group: dict[str, Any], names: list[str]) -> dict[str, Any]:
    return {**hyperparameters(group), "names": names}
