"""``python -m lightning_fastopt.checkpoint consolidate PATH OUT``: a sharded (ZeRO) or
distributed (FSDP: ours, or Lightning's ``ModelParallelStrategy``'s) checkpoint, or one
DeepSpeed wrote (its engine's, or Lightning's ``DeepSpeedStrategy``'s), written as one
ordinary Lightning checkpoint file.

OUT is a file: an existing one is replaced only with ``--overwrite`` (atomically), a
directory never; both checked before PATH is read.  PATH is read with torch's safe loader;
``--no-weights-only`` loads a file you trust that holds your own classes."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from lightning_fastopt.checkpoint.atomic import SHARDED_METADATA, check_output_file, is_distributed
from lightning_fastopt.checkpoint.deepspeed_reader import is_deepspeed_checkpoint
from lightning_fastopt.checkpoint.deepspeed_to_lightning import consolidate_deepspeed
from lightning_fastopt.checkpoint.distributed import consolidate_distributed
from lightning_fastopt.checkpoint.named_state import CheckpointMismatchError
from lightning_fastopt.checkpoint.reading import BrokenCheckpointError
from lightning_fastopt.checkpoint.safe_loading import CheckpointClassNotFoundError, SafeLoaderRefusedError
from lightning_fastopt.checkpoint.sharded import MANIFEST, consolidate, is_sharded


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lightning_fastopt.checkpoint")
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("consolidate", help="write a sharded (ZeRO) or distributed (FSDP) checkpoint as one ordinary "
                                           "Lightning checkpoint")
    c.add_argument("path", type=Path, help="the checkpoint directory")
    c.add_argument("out", type=Path, help="the file to write (not an existing directory)")
    c.add_argument("--overwrite", action="store_true",
                   help="replace OUT if it is a file (atomically: the old file stays until the new one is whole)")
    c.add_argument("--no-weights-only", dest="weights_only", action="store_false",
                   help="load objects that torch's safe loader (weights_only=True) refuses, such as your own "
                        "classes in hyperparameters: only for files you trust, as loading runs whatever their "
                        "pickles call (for library use, torch.serialization.add_safe_globals allows named classes "
                        "instead)")
    c.add_argument("--prefix", default="",
                   help="for a directory DeepSpeed's engine wrote: put PREFIX before every name (the attribute of "
                        "your LightningModule that holds the module DeepSpeed saved, as 'net.')")
    args = parser.parse_args(argv)
    try:
        check_output_file(args.out, args.overwrite)
    except OSError as err:
        parser.exit(2, f"error: {err}\n")
    if os.path.isfile(args.path):
        parser.error(f"{args.path} is one file already: torch.load reads it, and the strategies resume from it")
    if args.prefix and not is_deepspeed_checkpoint(args.path):
        parser.error("--prefix is for a directory DeepSpeed wrote")
    if is_deepspeed_checkpoint(args.path):
        try:
            ckpt = consolidate_deepspeed(args.path, args.out, overwrite=args.overwrite, prefix=args.prefix)
        except (BrokenCheckpointError, CheckpointMismatchError, OSError, ValueError) as err:
            parser.exit(2, f"error: {err}\n")
        _said(args.out, ckpt)
        return
    if not (is_sharded(args.path) or is_distributed(args.path)):
        parser.error(f"{args.path} is neither a sharded lightning_fastopt checkpoint (no {MANIFEST}) nor a "
                     f"distributed one written through Lightning (no .metadata and {SHARDED_METADATA})")
    try:
        ckpt = (consolidate if is_sharded(args.path) else consolidate_distributed)(
            args.path, args.out, overwrite=args.overwrite, weights_only=args.weights_only)
    except (BrokenCheckpointError, CheckpointMismatchError, SafeLoaderRefusedError, CheckpointClassNotFoundError,
            OSError) as err:
        parser.exit(2, f"error: {err}\n")
    _said(args.out, ckpt)


def _said(out: Path, ckpt: dict) -> None:
    states = optimizer_states(ckpt)
    where = "" if "optimizer_states" in ckpt else f" (under {', '.join(repr(k) for k in states)})"
    print(f"wrote {out}: {len(states)} optimizer state(s){where}, "
          f"{sum(len(s['state']) for s in states.values())} parameter state(s)")


def optimizer_states(checkpoint: dict) -> dict:
    """The optimizer states of a consolidated checkpoint by where they are: a Trainer's
    under ``optimizer_states`` (by position), a Fabric one's under the keys ``fabric.save``
    was given."""
    if "optimizer_states" in checkpoint:
        return {f"optimizer_states[{i}]": s for i, s in enumerate(checkpoint["optimizer_states"])}
    return {k: v for k, v in checkpoint.items() if isinstance(v, dict) and {"state", "param_groups"} <= set(v)}


if __name__ == "__main__":
    main()
