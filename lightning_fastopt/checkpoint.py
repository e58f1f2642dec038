"""Optimizer state as a plain, portable, torch-compatible dictionary keyed by parameter name.

Saved form (what ``OffloadOptimizer.state_dict()`` returns and Lightning writes)::

    {"state": {"layer.weight": {"step": tensor(10.), "exp_avg": ..., ...}, ...},
     "param_groups": [{"lr": ..., ..., "params": ["layer.weight", ...],
                       "param_names": ["layer.weight", ...]}, ...]}

Only tensors, numbers, strings and containers: it loads with ``torch.load(weights_only=True)``.
``torch.optim`` optimizers load it as they load their own (they match parameters by
position within each group), and a state dict written by ``torch.optim`` (integer keys)
loads here by the same rule.  Whatever the offload fraction or the device of each
parameter, the dictionary is the same, so a checkpoint resumes with any other fraction.

Sharded checkpoints (ZeRO): a directory ::

    checkpoint.pt                 everything but the optimizer states (rank 0)
    optimizer_shard_00000.pt      rank 0's list of optimizer shards (one per optimizer)
    optimizer_shard_00001.pt      ...
    manifest.json                 format version, world size, ZeRO stage, the shard files,
                                  and which rank owned each parameter

written into a temporary directory and moved into place when every file is complete, so
a re-save never mixes shards of an older run and a crash leaves the previous checkpoint.
:func:`load_sharded` merges the shards into one name-keyed state per optimizer (to be
re-sharded at any world size); :func:`consolidate` (``python -m
lightning_fastopt.checkpoint consolidate PATH OUT``) writes that as one ordinary
Lightning checkpoint file.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_fastopt.optim.base import hyperparameters


class CheckpointMismatchError(ValueError):
    """The optimizer state in a checkpoint does not belong to this model."""


def named_state_dict(groups: Sequence[dict[str, Any]], names: Sequence[Sequence[str]],
                     state: Mapping[str, dict[str, Any]]) -> dict[str, Any]:
    """The saved form from the live groups, the parameter names of each group and the
    state of each named parameter (parameters without state are left out, as torch does)."""
    saved_groups = []
    for group, group_names in zip(groups, names):
        saved_groups.append({**hyperparameters(group), "params": list(group_names),
                             "param_names": list(group_names)})
    saved_state = {}
    for group_names in names:
        for name in group_names:
            st = state.get(name)
            if st:
                # each parameter gets its own step tensor, as torch.optim keeps them
                saved_state[name] = {k: v.detach().clone() if k == "step" and isinstance(v, Tensor) else v
                                     for k, v in st.items()}
    return {"state": saved_state, "param_groups": saved_groups}


def read_named_state(saved: Mapping[str, Any], names: Sequence[Sequence[str]],
                     shapes: Mapping[str, torch.Size]) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """Check a saved optimizer state against this model and key it by parameter name.

    Returns (state by name, hyperparameters of each group).  Parameters are matched by
    name when the checkpoint has names (ours, or torch's ``param_names``) and by position
    within each group otherwise (a plain torch.optim state dict).  Raises
    :class:`CheckpointMismatchError` when groups, names or shapes differ.
    """
    if not isinstance(saved, Mapping) or "state" not in saved or "param_groups" not in saved:
        raise CheckpointMismatchError("not an optimizer state dict (expected the keys 'state' and 'param_groups')")
    saved_groups = saved["param_groups"]
    if len(saved_groups) != len(names):
        raise CheckpointMismatchError(
            f"the checkpoint's optimizer has {len(saved_groups)} parameter group(s), this one has {len(names)}: "
            "the checkpoint was written for a different model or optimizer configuration")
    key_to_name: dict[Any, str] = {}
    for gi, (sg, group_names) in enumerate(zip(saved_groups, names)):
        keys = list(sg["params"])
        saved_names = sg.get("param_names") or (keys if all(isinstance(k, str) for k in keys) else None)
        if saved_names is not None:
            missing = [n for n in group_names if n not in set(saved_names)]
            unexpected = [n for n in saved_names if n not in set(group_names)]
            if missing or unexpected:
                raise CheckpointMismatchError(
                    f"parameter group {gi}: the checkpoint's optimizer state is for other parameters "
                    f"(missing here: {_few(missing)}; not in this model: {_few(unexpected)})")
            key_to_name.update(zip(keys, saved_names))
        else:
            if len(keys) != len(group_names):
                raise CheckpointMismatchError(
                    f"parameter group {gi}: the checkpoint has {len(keys)} parameters, this model {len(group_names)}")
            key_to_name.update(zip(keys, group_names))
    by_name: dict[str, dict[str, Any]] = {}
    for key, st in saved["state"].items():
        if key not in key_to_name:
            raise CheckpointMismatchError(f"the checkpoint has optimizer state for {key!r}, which no group lists")
        name = key_to_name[key]
        for k, v in st.items():
            if isinstance(v, Tensor) and v.dim() > 0 and v.shape != shapes[name]:
                raise CheckpointMismatchError(
                    f"optimizer state {k!r} of parameter {name!r} has shape {tuple(v.shape)} in the checkpoint, "
                    f"the parameter has shape {tuple(shapes[name])}: the checkpoint is from a different model")
        by_name[name] = dict(st)
    return by_name, [hyperparameters(sg) for sg in saved_groups]


def _few(items: list[str], n: int = 3) -> str:
    if not items:
        return "none"
    shown = ", ".join(repr(i) for i in items[:n])
    return shown + (f" and {len(items) - n} more" if len(items) > n else "")


# ---------------------------------------------------------------------- sharded checkpoints
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
MAIN_FILE = "checkpoint.pt"


def shard_file(rank: int) -> str:
    return f"optimizer_shard_{rank:05d}.pt"


def is_sharded(path) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, MANIFEST))


def staging_path(path) -> str:
    """A fresh directory name beside ``path`` to write a sharded checkpoint into."""
    path = os.path.abspath(os.fspath(path))
    return os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex[:12]}")


def save_synced(obj: Any, path) -> None:
    """``torch.save`` into ``path``, flushed to the disk before returning."""
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def write_shard(staging: str, rank: int, optimizer_states: list[dict[str, Any]]) -> None:
    save_synced(optimizer_states, os.path.join(staging, shard_file(rank)))


def write_main(staging: str, checkpoint: dict[str, Any]) -> None:
    save_synced({k: v for k, v in checkpoint.items() if k != "optimizer_states"}, os.path.join(staging, MAIN_FILE))


def finish_sharded(staging: str, path, *, world_size: int, zero_stage: int,
                   partitions: list[dict[str, int]]) -> None:
    """Write the manifest (last: a directory without one is not a checkpoint) and move the
    staging directory to ``path``, replacing what was there."""
    manifest = dict(format_version=FORMAT_VERSION, world_size=world_size, zero_stage=zero_stage,
                    shards=[shard_file(r) for r in range(world_size)], main=MAIN_FILE, partitions=partitions)
    missing = [f for f in manifest["shards"] + [MAIN_FILE] if not os.path.isfile(os.path.join(staging, f))]
    if missing:
        raise RuntimeError(f"sharded checkpoint incomplete, missing {missing} in {staging}")
    with open(os.path.join(staging, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    path = os.path.abspath(os.fspath(path))
    old = None
    if os.path.lexists(path):
        old = f"{path}.old-{uuid.uuid4().hex[:12]}"
        os.replace(path, old)
    os.replace(staging, path)
    if old is not None:
        shutil.rmtree(old) if os.path.isdir(old) else os.unlink(old)


def merge_shards(shards: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One name-keyed optimizer state from the shards of every rank (in rank order: ranks
    own consecutive parameters, so the names come out in model order)."""
    groups = []
    for gi, group in enumerate(shards[0]["param_groups"]):
        names = [n for shard in shards for n in shard["param_groups"][gi]["params"]]
        groups.append({**hyperparameters(group), "params": names, "param_names": list(names)})
    state: dict[str, Any] = {}
    for shard in shards:
        state.update(shard["state"])
    return {"state": state, "param_groups": groups}


def load_sharded(path, weights_only: bool | None = True) -> dict[str, Any]:
    """A sharded checkpoint as one Lightning checkpoint dictionary, with each optimizer's
    shards merged into a whole name-keyed state."""
    with open(os.path.join(path, MANIFEST)) as f:
        manifest = json.load(f)
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointMismatchError(f"{path}: sharded checkpoint format {manifest.get('format_version')!r}, "
                                      f"this version of lightning_fastopt reads {FORMAT_VERSION}")
    load = dict(map_location="cpu", weights_only=True if weights_only is None else weights_only)
    checkpoint = torch.load(os.path.join(path, manifest["main"]), **load)
    per_rank = [torch.load(os.path.join(path, name), **load) for name in manifest["shards"]]  # only those listed
    n_opt = len(per_rank[0])
    checkpoint["optimizer_states"] = [merge_shards([shards[i] for shards in per_rank]) for i in range(n_opt)]
    return checkpoint


def consolidate(path, out=None) -> dict[str, Any]:
    """The sharded checkpoint at ``path`` as one ordinary Lightning checkpoint (a plain
    torch optimizer state inside), written to ``out`` (atomically) when given."""
    checkpoint = load_sharded(path)
    if out is not None:
        from lightning_fastopt.checkpoint_io import AtomicCheckpointIO

        AtomicCheckpointIO().save_checkpoint(checkpoint, out)
    return checkpoint


def _main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lightning_fastopt.checkpoint")
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("consolidate", help="write a sharded (ZeRO) checkpoint as one ordinary Lightning checkpoint")
    c.add_argument("path", type=Path)
    c.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    if not is_sharded(args.path):
        parser.error(f"{args.path} is not a sharded lightning_fastopt checkpoint (no {MANIFEST})")
    ckpt = consolidate(args.path, args.out)
    print(f"wrote {args.out}: {len(ckpt['optimizer_states'])} optimizer state(s), "
          f"{sum(len(s['state']) for s in ckpt['optimizer_states'])} parameter state(s)")


if __name__ == "__main__":
    _main()
