"""torch's distributed checkpoints (what the FSDP strategies write, ours and Lightning's),
read into one file.

A directory of shards as Lightning's ``ModelParallelStrategy`` writes it (ours writes the
same): torch's distributed checkpoint (``.metadata`` and each rank's ``*.distcp``) holding
the model's state under ``state_dict`` and the i-th optimizer's under ``optimizer_<i>``
(a Trainer's) or the keys ``fabric.save`` was given (Fabric's), beside ``meta.pt``, the
rest of the checkpoint.  :func:`consolidate_distributed` reads it whole into memory (every
DTensor gathered into a plain tensor) and gives what a full checkpoint of the same
strategy holds (``save_distributed_checkpoint=False``): a Trainer's optimizer states as
the list ``optimizer_states``, each in torch's full layout (keyed by parameter name, in
the optimizer's order, which the FSDP strategies load and torch's
``Optimizer.load_state_dict`` maps by position).  Lightning's own ``consolidate_checkpoint``
expects Fabric's layout only (``KeyError: 'model'`` on a Trainer's).
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch

from lightning_fastopt.checkpoint.atomic import SHARDED_METADATA, check_output_file, save_atomically
from lightning_fastopt.checkpoint.checksums import verify_distributed
from lightning_fastopt.checkpoint.reading import read_checkpoint_file
from lightning_fastopt.checkpoint.safe_loading import check_distributed

_OPTIMIZER_KEY = re.compile(r"optimizer_(\d+)")


def consolidate_distributed(path, out=None, *, overwrite: bool = False,
                            weights_only: bool | None = True) -> dict[str, Any]:
    """The distributed checkpoint at ``path`` as one full checkpoint, written to ``out``
    (atomically) when given: a file there is replaced only with ``overwrite``, a directory
    never (checked before ``path`` is read).  Every pickle in it (``meta.pt`` and the
    non-tensor entries of the shards) is read with ``torch.load(weights_only=...)``
    (:func:`~lightning_fastopt.checkpoint.safe_loading.check_distributed`);
    ``weights_only=False`` only for files you trust."""
    if out is not None:
        check_output_file(out, overwrite)
    verify_distributed(path)
    check_distributed(path, weights_only)
    checkpoint = _read_shards(path)
    meta = os.path.join(os.fspath(path), SHARDED_METADATA)
    checkpoint.update(read_checkpoint_file(meta, lambda f: torch.load(f, map_location="cpu", weights_only=weights_only),
                                           what="checkpoint's metadata file", needs=None))
    optimizers = sorted((int(m.group(1)), k) for k in checkpoint if (m := _OPTIMIZER_KEY.fullmatch(k)))
    if "state_dict" in checkpoint and "loops" in checkpoint:  # a Trainer's: its optimizers by position, as a full one
        checkpoint["optimizer_states"] = [checkpoint.pop(k) for _, k in optimizers]
    if out is not None:
        save_atomically(checkpoint, out)
    return checkpoint


def _read_shards(path) -> dict[str, Any]:
    """The tensors and entries of the distributed checkpoint at ``path``, read whole into
    this process (DTensors as plain tensors), as Lightning's ``_load_distributed_checkpoint``
    reads them (its entries were checked by :func:`check_distributed` first: torch's
    planner reads them without ``weights_only``)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    checkpoint: dict[str, Any] = {}
    _load_state_dict(checkpoint, storage_reader=FileSystemReader(os.fspath(path)), planner=_EmptyStateDictLoadPlanner(),
                     no_dist=True)
    return checkpoint
