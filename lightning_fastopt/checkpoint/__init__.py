"""Checkpoints: portable optimizer state, sharded directories, files written atomically.

- :mod:`~lightning_fastopt.checkpoint.named_state`: the optimizer state as a plain
  torch-compatible dictionary keyed by parameter name (offload and ZeRO optimizers).
- :mod:`~lightning_fastopt.checkpoint.sharded`: the directory of per-rank shards that
  ZeRO writes, merging it at load, consolidating it into one file (and its command line,
  ``python -m lightning_fastopt.checkpoint consolidate PATH OUT``).
- :mod:`~lightning_fastopt.checkpoint.distributed`: torch's distributed checkpoints (FSDP)
  consolidated into one file by the same command line.
- :mod:`~lightning_fastopt.checkpoint.atomic`: the fsynced, atomic file writes both use.
- :mod:`~lightning_fastopt.checkpoint.reading`: reading files, with one message naming a
  damaged one; :mod:`~lightning_fastopt.checkpoint.checksums`: every tensor's checksum,
  written with it and checked when read; :mod:`~lightning_fastopt.checkpoint.safe_loading`:
  what torch's safe loader refuses, told apart from damage.
- :mod:`~lightning_fastopt.checkpoint.replacing`: what a save may replace at its path.

The Lightning plugin that writes single files atomically is
:class:`lightning_fastopt.core.checkpoint_io.AtomicCheckpointIO`.
"""

from lightning_fastopt.checkpoint.atomic import save_atomically, save_synced
from lightning_fastopt.checkpoint.checksums import ChecksumMismatchError
from lightning_fastopt.checkpoint.named_state import CheckpointMismatchError, named_state_dict, read_named_state
from lightning_fastopt.checkpoint.reading import BrokenCheckpointError, read_checkpoint_file
from lightning_fastopt.checkpoint.safe_loading import CheckpointClassNotFoundError, SafeLoaderRefusedError
from lightning_fastopt.checkpoint.sharded import (FORMAT_VERSION, MAIN_FILE, MANIFEST, consolidate,
                                                  is_sharded, load_sharded, merge_shards, read_manifest, save_sharded,
                                                  shard_file, staging_path, write_main, write_manifest,
                                                  write_shard)

__all__ = [
    "FORMAT_VERSION", "MAIN_FILE", "MANIFEST", "BrokenCheckpointError", "CheckpointClassNotFoundError",
    "CheckpointMismatchError", "ChecksumMismatchError", "SafeLoaderRefusedError", "consolidate",
    "is_sharded", "load_sharded", "merge_shards", "named_state_dict", "read_checkpoint_file",
    "read_named_state", "read_manifest", "save_atomically",
    "save_sharded", "save_synced", "shard_file", "staging_path", "write_main", "write_manifest", "write_shard",
]
