"""A DeepSpeed checkpoint (:mod:`~lightning_fastopt.checkpoint.deepspeed_reader`) as a Lightning
checkpoint: ``state_dict`` (the float32 masters and the module's other entries),
``optimizer_states`` (ours, keyed by parameter name: any of our strategies, and torch's
optimizers by position, load it), and what Lightning's ``DeepSpeedStrategy`` added (loops,
epoch, callbacks, schedulers, hyperparameters).  ``torch.load(weights_only=True)`` reads it
once written, and plain ``Trainer()`` resumes from it.

A directory written by DeepSpeed's engine for a module that the LightningModule holds as an
attribute names its parameters without that attribute: the names are matched to the model's
(one prefix for all), or refused naming the directory where they are another model's."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import lightning

from lightning_fastopt.checkpoint.atomic import check_output_file, save_atomically
from lightning_fastopt.checkpoint.deepspeed_reader import (DeepSpeedCheckpoint, is_deepspeed_checkpoint,
                                                            read_deepspeed_checkpoint)
from lightning_fastopt.checkpoint.named_state import CheckpointMismatchError, named_state_dict

__all__ = ["as_lightning_checkpoint", "consolidate_deepspeed", "matched_to", "refuse_deepspeed_directory", "summary"]


def matched_to(ds: DeepSpeedCheckpoint, model_names: Sequence[str]) -> str:
    """The prefix that turns the checkpoint's parameter names into ``model_names`` (``""``
    where they are the same), or CheckpointMismatchError naming the directory."""
    ours, theirs = set(model_names), set(ds.masters)
    if theirs <= ours and not _trainable_missing(ours - theirs, ds):
        return ""
    prefixes = {m[: len(m) - len(t)] for m in ours for t in theirs if m.endswith("." + t)}
    for prefix in sorted(prefixes, key=len):
        if {prefix + t for t in theirs} == ours:
            return prefix
    extra, missing = sorted(theirs - ours), sorted(ours - theirs)
    raise CheckpointMismatchError(
        f"the DeepSpeed checkpoint {os.path.join(ds.directory, ds.tag)} holds the parameters of another model: "
        f"{len(extra)} of its {len(theirs)} names are not this model's ({', '.join(extra[:3])}"
        f"{', ...' if len(extra) > 3 else ''}), and {len(missing)} of the model's are not in it "
        f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''})")


def _trainable_missing(missing: set[str], ds: DeepSpeedCheckpoint) -> bool:
    return bool(missing - set(ds.module))


def as_lightning_checkpoint(ds: DeepSpeedCheckpoint, prefix: str = "") -> dict[str, Any]:
    """The Lightning checkpoint (names given ``prefix``, see :func:`matched_to`)."""
    names = [[prefix + n for n in g["names"]] for g in ds.groups]
    groups = [{k: v for k, v in g.items() if k != "names"} for g in ds.groups]
    state = {}
    for n, st in ds.state.items():
        state[prefix + n] = {**({"step": ds.step.clone()} if ds.step is not None else {}), **st}
    checkpoint = {k: v for k, v in ds.client.items() if k not in ("state_dict", "optimizer_states")}
    # Lightning's migration of old checkpoints reads the version that wrote it: DeepSpeed's engine wrote none
    checkpoint.setdefault("pytorch-lightning_version", lightning.__version__)
    checkpoint["state_dict"] = {prefix + k: v for k, v in {**ds.module, **ds.masters}.items()}
    checkpoint["optimizer_states"] = [named_state_dict(groups, names, state)]
    if "lr_schedulers" not in checkpoint:
        iteration = (ds.scheduler or {}).get("last_batch_iteration")
        # DeepSpeed's scheduler's count carried to the run's (a torch scheduler is one ahead)
        checkpoint["lr_schedulers"] = [] if iteration is None else [{"last_epoch": iteration + 1,
                                                                     "_step_count": iteration + 2}]
    return checkpoint


def summary(ds: DeepSpeedCheckpoint) -> list[str]:
    """What was read, said in the log: where from, and what does not carry over."""
    where = os.path.join(ds.directory, ds.tag)
    lines = [f"read DeepSpeed's ZeRO stage {ds.stage} checkpoint {where} (written by {ds.world_size} rank(s)): "
             f"{len(ds.masters)} parameters' float32 masters and optimizer state, step "
             f"{int(ds.step) if ds.step is not None else 0}"]
    if "loops" not in ds.client:
        lines.append(f"{where} holds no Lightning loop state (written by DeepSpeed's engine): the loops start from "
                     "the beginning, with its weights and optimizer state")
    if ds.loss_scaler.get("dynamic"):
        lines.append(f"{where} was trained with dynamic fp16 loss scaling: its loss scale is not carried over yet "
                     "(the scale starts at initial_scale_power)")
    return lines


def consolidate_deepspeed(path, out, *, overwrite: bool = False, prefix: str = "") -> dict[str, Any]:
    """The DeepSpeed checkpoint in ``path`` written to ``out`` as one Lightning checkpoint
    file (its parameter names as DeepSpeed saved them, Lightning's wrapper's prefix taken
    off, ``prefix`` put before them), atomically; ``out`` is checked before ``path`` is read."""
    check_output_file(out, overwrite)
    checkpoint = as_lightning_checkpoint(read_deepspeed_checkpoint(path), prefix)
    save_atomically(checkpoint, out)
    return checkpoint


def refuse_deepspeed_directory(path, strategy: str) -> None:
    """A strategy that does not resume DeepSpeed's directories yet says so, and how, where
    ``path`` is one (before anything is read)."""
    if path is not None and os.path.isdir(path) and is_deepspeed_checkpoint(path):
        raise ValueError(f"{path} is a checkpoint directory DeepSpeed wrote: {strategy} does not resume one yet. "
                         f"`python -m lightning_fastopt.checkpoint consolidate {path} model.ckpt` writes it as one "
                         "file, which it resumes (FastOptStrategy resumes the directory itself)")
