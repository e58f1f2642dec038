"""The checkpoints of the DDP Trainer strategy (and its one-process twin): Lightning's
single file, written atomically (:class:`~lightning_fastopt.core.checkpoint_io.AtomicCheckpointIO`,
or the user's plugin given through ``plugins=``), with each optimizer's state taken from
the engine that steps it; with ZeRO, a directory where every rank writes its shard
(:mod:`~lightning_fastopt.checkpoint.sharded`), merged when read back and re-sharded for
the run that loads it.
"""

from __future__ import annotations

import os
from typing import Any

from lightning.fabric.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_fastopt.checkpoint.reading import read_checkpoint_file
from lightning_fastopt.checkpoint.sharded import load_sharded, save_sharded
from lightning_fastopt.core.checkpoint_io import AtomicCheckpointIO
from lightning_fastopt.trainer.package import TrainerPackage


class EngineCheckpoints:
    """A mixin before Lightning's strategy class, after
    :class:`~lightning_fastopt.trainer.engine_table.EngineTable` (whose ``_engine_at`` and
    ``_engine_for`` it reads); the subclass sets ``zero_stage``."""

    package: TrainerPackage
    zero_stage: int

    @property
    @override
    def checkpoint_io(self) -> Any:
        """As Lightning's strategies fill theirs, when first asked (so that a user's plugin
        given through ``plugins=`` is taken, not refused as set twice): the user's, or
        :class:`AtomicCheckpointIO`; a wrapping plugin given without a writer of its own
        (``AsyncCheckpointIO()``) wraps an ``AtomicCheckpointIO``."""
        if self._checkpoint_io is None:
            self._checkpoint_io = AtomicCheckpointIO()
        elif isinstance(self._checkpoint_io, self.package.WrappingCheckpointIO):
            self._checkpoint_io.checkpoint_io = AtomicCheckpointIO()  # taken only where it wraps none yet
        return self._checkpoint_io

    @checkpoint_io.setter
    @override
    def checkpoint_io(self, io: Any) -> None:
        self._checkpoint_io = io

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        """ZeRO: every rank writes its optimizer shard into a directory (see
        :mod:`lightning_fastopt.checkpoint.sharded`); otherwise one file, written atomically."""
        partitions = [p for p in (e.partition() for e in self._engine_at.values()) if p is not None]
        if not partitions:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        save_sharded(checkpoint, filepath, self, zero_stage=self.zero_stage, partitions=partitions)

    @override
    def optimizer_state(self, optimizer) -> dict[str, Any]:
        """The state dict of the engine that steps (or stepped, in the last fit) the user's
        optimizer: a checkpoint written after fit holds the same as one written during it
        (with ZeRO, each rank's shard, saved as shards)."""
        engine = self._engine_for(optimizer)
        return engine.state_dict() if engine is not None else super().optimizer_state(optimizer)

    @override
    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        """Sharded (ZeRO) directories are merged, to be re-sharded for this world size; a
        damaged file or directory is one message naming it (BrokenCheckpointError)."""
        if _is_local_dir(checkpoint_path):
            return load_sharded(checkpoint_path, weights_only)
        return read_checkpoint_file(checkpoint_path, lambda path: super(EngineCheckpoints, self).load_checkpoint(
            path, weights_only))

    @override
    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        """Each optimizer loads its saved state where its parameters live (the base class
        would move offloaded state to the accelerator)."""
        saved = checkpoint["optimizer_states"]
        if not saved and self.optimizers:  # hand-built, or from a run without an optimizer: Lightning loads nothing
            rank_zero_warn(f"lightning_fastopt: the checkpoint holds no optimizer state; the {len(self.optimizers)} "
                           "optimizer(s) of this run start afresh (as Lightning's own strategies do)")
            return
        if len(saved) != len(self.optimizers):
            raise ValueError(f"the checkpoint has {len(saved)} optimizer state(s), this run has "
                             f"{len(self.optimizers)} optimizer(s)")
        for opt, state in zip(self.optimizers, saved):
            opt.load_state_dict(state)


def _is_local_dir(path) -> bool:
    """A directory on this machine (a sharded checkpoint, or something that should be one)."""
    try:
        return os.path.isdir(path)
    except TypeError:
        return False
