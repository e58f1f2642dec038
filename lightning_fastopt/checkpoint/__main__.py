"""``python -m lightning_fastopt.checkpoint consolidate PATH OUT``: a sharded (ZeRO)
checkpoint written as one ordinary Lightning checkpoint file."""

from __future__ import annotations

import argparse
from pathlib import Path

from lightning_fastopt.checkpoint.named_state import CheckpointMismatchError
from lightning_fastopt.checkpoint.reading import BrokenCheckpointError
from lightning_fastopt.checkpoint.sharded import MANIFEST, consolidate, is_sharded


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lightning_fastopt.checkpoint")
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("consolidate", help="write a sharded (ZeRO) checkpoint as one ordinary Lightning checkpoint")
    c.add_argument("path", type=Path)
    c.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    if not is_sharded(args.path):
        parser.error(f"{args.path} is not a sharded lightning_fastopt checkpoint (no {MANIFEST})")
    try:
        ckpt = consolidate(args.path, args.out)
    except (BrokenCheckpointError, CheckpointMismatchError) as err:
        parser.exit(2, f"error: {err}\n")
    print(f"wrote {args.out}: {len(ckpt['optimizer_states'])} optimizer state(s), "
          f"{sum(len(s['state']) for s in ckpt['optimizer_states'])} parameter state(s)")


if __name__ == "__main__":
    main()
