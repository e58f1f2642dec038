"""A sharded checkpoint given to Lightning's own loaders: a clear error saying what to do.

``LightningModule.load_from_checkpoint(path)`` and the strategies of Lightning itself
(``Trainer(ckpt_path=path)`` under ``Trainer()`` or ``ddp``) read one file with
``torch.load``; on the directory a ZeRO strategy writes (:mod:`.sharded`) that fails with
a bare ``IsADirectoryError``.  :func:`install` (run when ``lightning_fastopt`` is
imported) wraps the loading function those two modules use so that such a directory
raises :class:`ShardedCheckpointError` naming the three ways out: resume with a fastopt
strategy, read the model's weights from the main file, or consolidate.  Anything that
is not a sharded directory goes to Lightning's function unchanged.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

from lightning_fastopt.checkpoint.sharded import MAIN_FILE, is_sharded

# the modules of Lightning that read a checkpoint file through their own ``pl_load`` binding
# (in both packages: ``lightning`` and the standalone ``pytorch_lightning``/``lightning_fabric``)
_LOADERS = ("lightning.pytorch.core.saving", "lightning.fabric.plugins.io.torch_io",
            "pytorch_lightning.core.saving", "lightning_fabric.plugins.io.torch_io")


class ShardedCheckpointError(IsADirectoryError):
    """A sharded (ZeRO) checkpoint directory where one checkpoint file is expected."""


def refuse_sharded(path: Any) -> None:
    """Raise :class:`ShardedCheckpointError` when ``path`` is a sharded checkpoint directory."""
    if isinstance(path, (str, os.PathLike)) and is_sharded(path):
        main = os.path.join(os.fspath(path), MAIN_FILE)
        raise ShardedCheckpointError(
            f"{os.fspath(path)} is a sharded lightning_fastopt checkpoint (a directory of per-rank optimizer "
            "shards written by a ZeRO strategy), not one checkpoint file. To resume training from it, use a "
            f"fastopt strategy (any number of devices); for the model's weights alone, load {main}; for one "
            f"ordinary checkpoint file: python -m lightning_fastopt.checkpoint consolidate {os.fspath(path)} OUT.ckpt")


def _guarded(load):
    def pl_load(path_or_url, *args, **kwargs):
        refuse_sharded(path_or_url)
        return load(path_or_url, *args, **kwargs)

    pl_load.__wrapped__ = load
    pl_load.refuses_sharded = True
    return pl_load


def install() -> None:
    """Wrap the ``pl_load`` of each of Lightning's loading modules (idempotent; a module or
    name that a Lightning version lacks, or a package that is not imported, is left alone)."""
    for name in _LOADERS:
        if name.partition(".")[0] not in sys.modules:
            continue  # not imported by the project nor by lightning_fastopt: nothing can call it
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        load = getattr(module, "pl_load", None)
        if callable(load) and not getattr(load, "refuses_sharded", False):
            module.pl_load = _guarded(load)
