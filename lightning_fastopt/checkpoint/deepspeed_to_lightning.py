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
from lightning.fabric.utilities.rank_zero import rank_zero_info

from lightning_fastopt.checkpoint.atomic import check_output_file, save_atomically
from lightning_fastopt.checkpoint.deepspeed_reader import DeepSpeedCheckpoint, read_deepspeed_checkpoint
from lightning_fastopt.checkpoint.named_state import CheckpointMismatchError, named_state_dict

__all__ = ["as_lightning_checkpoint", "consolidate_deepspeed", "deepspeed_as_lightning", "matched_to", "our_loss_scale",
           "summary"]


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


def our_loss_scale(ds: DeepSpeedCheckpoint) -> dict[str, Any] | None:
    """DeepSpeed's dynamic fp16 loss scaler's state as our precision plugin's
    (:class:`~lightning_fastopt.core.loss_scaler.DynamicLossScaler`): its scale, the overflows
    its hysteresis has left, the clean steps since its last overflow (counted within a growth
    window), the steps it skipped; None where it did not scale dynamically."""
    scaler = ds.loss_scaler
    if not scaler.get("dynamic") or "cur_scale" not in scaler:
        return None
    clean = int(scaler.get("cur_iter", 0)) - int(scaler.get("last_overflow_iter", -1)) - 1
    window = max(1, int(scaler.get("scale_window", 1000)))
    return {"scale": float(scaler["cur_scale"]), "hysteresis_left": int(scaler.get("cur_hysteresis", 1)),
            "clean_steps": clean % window, "skipped_steps": ds.skipped_steps}


def as_lightning_checkpoint(ds: DeepSpeedCheckpoint, prefix: str = "", precision_key: str | None = None
                            ) -> dict[str, Any]:
    """The Lightning checkpoint (names given ``prefix``, see :func:`matched_to`); the loss
    scale under ``precision_key`` (the run's precision plugin's class name), where DeepSpeed
    scaled dynamically and the run scales the loss too."""
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
    scale = our_loss_scale(ds)
    if scale is not None and precision_key is not None:
        checkpoint[precision_key] = scale
    if "lr_schedulers" not in checkpoint:
        iteration = (ds.scheduler or {}).get("last_batch_iteration")
        # DeepSpeed's scheduler's count carried to the run's (a torch scheduler is one ahead)
        checkpoint["lr_schedulers"] = [] if iteration is None else [{
            "last_epoch": iteration + 1, "_step_count": iteration + 2, "_last_lr": [g["lr"] for g in ds.groups]}]
    return checkpoint


def summary(ds: DeepSpeedCheckpoint, carries_scale: bool = False) -> list[str]:
    """What was read, said in the log: where from, and what does not carry over
    (``carries_scale``: the run scales the loss, and takes DeepSpeed's scale)."""
    where = os.path.join(ds.directory, ds.tag)
    lines = [f"read DeepSpeed's ZeRO stage {ds.stage} checkpoint {where} (written by {ds.world_size} rank(s)): "
             f"{len(ds.masters)} parameters' float32 masters and optimizer state, step "
             f"{int(ds.step) if ds.step is not None else 0}"]
    if "loops" not in ds.client:
        lines.append(f"{where} holds no Lightning loop state (written by DeepSpeed's engine): the loops start from "
                     "the beginning, with its weights and optimizer state")
    scale = our_loss_scale(ds)
    if scale is not None and carries_scale:
        lines.append(f"its fp16 loss scale carried over: {scale['scale']:g}, hysteresis {scale['hysteresis_left']} left")
    elif scale is not None:
        lines.append(f"{where} was trained with dynamic fp16 loss scaling ({scale['scale']:g}): this run scales no loss, "
                     "so none is carried over")
    return lines


def consolidate_deepspeed(path, out, *, overwrite: bool = False, prefix: str = "") -> dict[str, Any]:
    """The DeepSpeed checkpoint in ``path`` written to ``out`` as one Lightning checkpoint
    file (its parameter names as DeepSpeed saved them, Lightning's wrapper's prefix taken
    off, ``prefix`` put before them), atomically; ``out`` is checked before ``path`` is read."""
    check_output_file(out, overwrite)
    checkpoint = as_lightning_checkpoint(read_deepspeed_checkpoint(path), prefix)
    save_atomically(checkpoint, out)
    return checkpoint


def deepspeed_as_lightning(path, model: Any, precision: Any = None, scaler_key: str | None = None) -> dict[str, Any]:
    """The DeepSpeed checkpoint in ``path`` as a Lightning checkpoint of ``model`` (its names
    matched to the model's trainable parameters; its fp16 loss scale for ``precision``, the
    run's plugin, where that scales the loss, under ``scaler_key``: by default the plugin's
    class name, as Lightning keeps a precision plugin's state), what was read said in the log."""
    ds = read_deepspeed_checkpoint(path)
    prefix = matched_to(ds, [n for n, p in model.named_parameters() if p.requires_grad])
    scales = getattr(precision, "scaler", None) is not None
    for line in summary(ds, scales) + ([f"its parameter names are the model's under {prefix!r}"] if prefix else []):
        rank_zero_info(f"lightning_fastopt: {line}")
    return as_lightning_checkpoint(ds, prefix, (scaler_key or type(precision).__qualname__) if scales else None)
