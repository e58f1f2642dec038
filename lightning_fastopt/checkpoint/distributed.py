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
from pathlib import Path
from typing import Any

from lightning_fastopt.checkpoint.atomic import SHARDED_METADATA, save_atomically

_OPTIMIZER_KEY = re.compile(r"optimizer_(\d+)")


def is_distributed(path) -> bool:
    """``path`` is a directory holding a distributed checkpoint written through Lightning."""
    return os.path.isfile(os.path.join(path, ".metadata")) and os.path.isfile(os.path.join(path, SHARDED_METADATA))


def consolidate_distributed(path, out=None) -> dict[str, Any]:
    """The distributed checkpoint at ``path`` as one full checkpoint, written to ``out``
    (atomically) when given."""
    from lightning.fabric.utilities.load import _load_distributed_checkpoint

    checkpoint = _load_distributed_checkpoint(Path(path))
    optimizers = sorted((int(m.group(1)), k) for k in checkpoint if (m := _OPTIMIZER_KEY.fullmatch(k)))
    if "state_dict" in checkpoint and "loops" in checkpoint:  # a Trainer's: its optimizers by position, as a full one
        checkpoint["optimizer_states"] = [checkpoint.pop(k) for _, k in optimizers]
    if out is not None:
        save_atomically(checkpoint, out)
    return checkpoint
