"""Sharded checkpoints (ZeRO): every rank writes its own optimizer shard.  A directory::

    checkpoint.pt                 everything but the optimizer states (rank 0)
    optimizer_shard_00000.pt      rank 0's list of optimizer shards (one per optimizer)
    optimizer_shard_00001.pt      ...
    manifest.json                 format version, world size, ZeRO stage, the shard files,
                                  and which rank owned each parameter

written into a temporary directory and moved into place when every file is complete, so
a re-save never mixes shards of an older run and a crash leaves the previous checkpoint
(:func:`save_sharded`, the whole sequence with its barriers).  :func:`load_sharded`
merges the shards into one name-keyed state per optimizer
(:mod:`lightning_fastopt.checkpoint.named_state`), to be re-sharded at any world size;
:func:`consolidate` (``python -m lightning_fastopt.checkpoint consolidate PATH OUT``)
writes that as one ordinary Lightning checkpoint file.

A Fabric checkpoint (``fabric.save`` with ZeRO at several processes) keeps the user's
keys: in ``checkpoint.pt`` a ZeRO optimizer's entry is a marker ``{SHARDS_KEY: i}`` (its
shards are the i-th of each shard file), and :func:`load_sharded` puts the merged state
in the marker's place.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch

from lightning_fastopt.checkpoint.atomic import (CheckpointFiles, check_output_file, save_atomically, save_staged,
                                                 save_synced, temp_path, write_synced)
from lightning_fastopt.checkpoint.named_state import CheckpointMismatchError
from lightning_fastopt.checkpoint.reading import BrokenCheckpointError, check_holds, read_checkpoint_file
from lightning_fastopt.optim.base import hyperparameters


FORMAT_VERSION = 1
MANIFEST = "manifest.json"
MAIN_FILE = "checkpoint.pt"
SHARDS_KEY = "fastopt_optimizer_shards"  # a Fabric checkpoint's marker of a sharded optimizer entry


def shard_file(rank: int) -> str:
    return f"optimizer_shard_{rank:05d}.pt"


# what a sharded checkpoint consists of: a new one supersedes these, and leaves anything else in its directory
SHARDED_FILES = CheckpointFiles(rf"{re.escape(MAIN_FILE)}|optimizer_shard_\d+\.pt|{re.escape(MANIFEST)}")


def is_sharded(path) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, MANIFEST))


def staging_path(path) -> str:
    """A fresh directory name beside ``path`` to write a sharded checkpoint into."""
    return temp_path(path)


class Ranks(Protocol):
    """What :func:`save_sharded` needs of the processes saving together (a Lightning
    strategy has all of it)."""

    global_rank: int
    world_size: int
    is_global_zero: bool

    def broadcast(self, obj: Any, src: int = 0) -> Any: ...

    def barrier(self, name: str | None = None) -> None: ...

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool: ...


def save_sharded(checkpoint: dict[str, Any], path, ranks: Ranks, *, zero_stage: int,
                 partitions: list[dict[str, int]]) -> None:
    """Every rank's part of saving a sharded checkpoint (call it on every rank at once), as
    :func:`~lightning_fastopt.checkpoint.atomic.save_staged` saves: into a staging
    directory beside ``path`` each rank writes its own optimizer shards
    (``checkpoint["optimizer_states"]``) and rank 0 the rest of the checkpoint; once all
    are written rank 0 writes the manifest and moves the directory to ``path`` (other
    files there stay).  A write that fails on any rank leaves what ``path`` held, and each
    rank raises (a full disk: an ``OSError`` naming ``path``).  ``partitions``: the owning
    rank of each parameter, by name, per optimizer."""
    def write(staging: str) -> None:
        os.makedirs(staging, exist_ok=True)  # by every rank: the first one makes it
        write_shard(staging, ranks.global_rank, checkpoint.get("optimizer_states", []))
        if ranks.is_global_zero:
            write_main(staging, checkpoint)

    save_staged(path, write, ranks, SHARDED_FILES, before_move=lambda staging: write_manifest(
        staging, world_size=ranks.world_size, zero_stage=zero_stage, partitions=partitions))


def write_shard(staging: str, rank: int, optimizer_states: list[dict[str, Any]]) -> None:
    """This rank's optimizer states (one file, its tensors' checksums in it)."""
    save_synced(optimizer_states, os.path.join(staging, shard_file(rank)))


def write_main(staging: str, checkpoint: dict[str, Any]) -> None:
    """Everything but the optimizer states (one file, its tensors' checksums in it)."""
    save_synced({k: v for k, v in checkpoint.items() if k != "optimizer_states"}, os.path.join(staging, MAIN_FILE))


def write_manifest(staging: str, *, world_size: int, zero_stage: int, partitions: list[dict[str, int]]) -> None:
    """Write the manifest of a staging directory whose shards are all written (last: a
    directory without one is not a checkpoint); a RuntimeError where one is missing."""
    manifest = dict(format_version=FORMAT_VERSION, world_size=world_size, zero_stage=zero_stage,
                    shards=[shard_file(r) for r in range(world_size)], main=MAIN_FILE, partitions=partitions)
    missing = [f for f in manifest["shards"] + [MAIN_FILE] if not os.path.isfile(os.path.join(staging, f))]
    if missing:
        raise RuntimeError(f"sharded checkpoint incomplete, missing {missing} in {staging}")
    write_synced(os.path.join(staging, MANIFEST), lambda f: f.write(json.dumps(manifest, indent=1).encode()))


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


def read_manifest(path) -> dict[str, Any]:
    """The manifest of a sharded checkpoint directory, checked: BrokenCheckpointError names
    the directory or the manifest and what is wrong."""
    path = os.fspath(path)
    where = os.path.join(path, MANIFEST)
    if not os.path.isfile(where):
        raise BrokenCheckpointError(f"{path} is a directory without {MANIFEST}: not a lightning_fastopt sharded "
                                    "checkpoint (or one whose save did not finish)")
    try:
        with open(where) as f:
            manifest = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise BrokenCheckpointError(f"cannot read {where}: {err}") from err
    if not isinstance(manifest, dict):
        raise BrokenCheckpointError(f"{where} holds a {type(manifest).__name__}, not a manifest")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointMismatchError(f"{path}: sharded checkpoint format {manifest.get('format_version')!r}, "
                                      f"this version of lightning_fastopt reads {FORMAT_VERSION}")
    shards = manifest.get("shards")
    if not isinstance(manifest.get("main"), str) or not isinstance(shards, list) or not shards \
            or not all(isinstance(name, str) for name in shards):
        raise BrokenCheckpointError(f"{where} is malformed: it needs 'main' (a file name) and 'shards' (a list of "
                                    "file names)")
    return manifest


def load_sharded(path, weights_only: bool | None = True) -> dict[str, Any]:
    """A sharded checkpoint as one Lightning checkpoint dictionary, with each optimizer's
    shards merged into a whole name-keyed state."""
    manifest = read_manifest(path)
    load = dict(map_location="cpu", weights_only=True if weights_only is None else weights_only)
    main = os.path.join(path, manifest["main"])
    checkpoint = read_checkpoint_file(main, lambda f: torch.load(f, **load), needs=None)
    marked = {k: v[SHARDS_KEY] for k, v in checkpoint.items() if isinstance(v, dict) and set(v) == {SHARDS_KEY}} \
        if isinstance(checkpoint, dict) else {}
    if not marked:  # a Lightning checkpoint's main file (a Fabric one marks its optimizers' entries)
        check_holds(checkpoint, main)
    per_rank = [read_checkpoint_file(os.path.join(path, name), lambda f: torch.load(f, **load),
                                     what="optimizer shard", needs=None)
                for name in manifest["shards"]]  # only those listed
    n_opt = len(per_rank[0])
    states = [merge_shards([shards[i] for shards in per_rank]) for i in range(n_opt)]
    if marked:  # a Fabric checkpoint: each optimizer's state back under its own key
        checkpoint.update({k: states[i] for k, i in marked.items()})
    else:
        checkpoint["optimizer_states"] = states
    return checkpoint


def consolidate(path, out=None, *, overwrite: bool = False, weights_only: bool | None = True) -> dict[str, Any]:
    """The sharded checkpoint at ``path`` as one ordinary Lightning checkpoint (a plain
    torch optimizer state inside), written to ``out`` (atomically) when given: a file there
    is replaced only with ``overwrite``, a directory never (checked before ``path`` is
    read).  ``weights_only=False`` loads what torch's safe loader refuses: only for files
    you trust."""
    if out is not None:
        check_output_file(out, overwrite)
    checkpoint = load_sharded(path, weights_only)
    if out is not None:
        save_atomically(checkpoint, out)
    return checkpoint
