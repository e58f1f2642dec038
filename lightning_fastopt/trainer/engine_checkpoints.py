"""The checkpoints of the DDP Trainer strategy (and its one-process twin): Lightning's
single file, written atomically (:class:`~lightning_fastopt.core.checkpoint_io.AtomicCheckpointIO`,
or the user's plugin given through ``plugins=``), with each optimizer's state taken from
the engine that steps it; with ZeRO, a directory where every rank writes its shard
(:mod:`~lightning_fastopt.checkpoint.sharded`), merged when read back and re-sharded for
the run that loads it.

:class:`EngineCheckpoints` is the strategy's part for them: given the strategy's engines
(:class:`~lightning_fastopt.trainer.engine_set.EngineSet`) and its ZeRO stage, it answers
the strategy's checkpoint hooks, each of which calls it with what Lightning's own hook
would do (``one_file``, ``as_torch``) for the cases it leaves to Lightning.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

from lightning.fabric.utilities.rank_zero import rank_zero_warn

from lightning_fastopt.checkpoint.deepspeed_reader import is_deepspeed_checkpoint
from lightning_fastopt.checkpoint.deepspeed_to_lightning import deepspeed_as_lightning
from lightning_fastopt.checkpoint.reading import read_checkpoint_file
from lightning_fastopt.checkpoint.sharded import Ranks, load_sharded, save_sharded
from lightning_fastopt.core.checkpoint_io import AtomicCheckpointIO
from lightning_fastopt.trainer.engine_set import EngineSet


class EngineCheckpoints:
    """Saves and loads a DDP Trainer strategy's checkpoints (see the module's documentation)."""

    def __init__(self, engines: EngineSet, zero_stage: int) -> None:
        self.engines = engines
        self.zero_stage = zero_stage

    @staticmethod
    def writer(current: Any, wrapping: type) -> Any:
        """The checkpoint plugin a strategy holds once asked for it, as Lightning's strategies
        fill theirs when first asked (so that a user's plugin given through ``plugins=`` is
        taken, not refused as set twice): ``current``, the user's, or
        :class:`AtomicCheckpointIO`; a ``wrapping`` plugin given without a writer of its own
        (``AsyncCheckpointIO()``) wraps an ``AtomicCheckpointIO``."""
        if current is None:
            return AtomicCheckpointIO()
        if isinstance(current, wrapping):
            current.checkpoint_io = AtomicCheckpointIO()  # taken only where it wraps none yet
        return current

    def save(self, checkpoint: dict[str, Any], filepath, ranks: Ranks,
             one_file: Callable[[dict[str, Any], Any], None]) -> None:
        """ZeRO: every rank writes its optimizer shard into a directory (see
        :mod:`lightning_fastopt.checkpoint.sharded`); otherwise ``one_file(checkpoint,
        filepath)``, Lightning's (one file, through the strategy's plugin)."""
        partitions = self.engines.partitions()
        if not partitions:
            return one_file(checkpoint, filepath)
        save_sharded(checkpoint, filepath, ranks, zero_stage=self.zero_stage, partitions=partitions)

    def optimizer_state(self, optimizers: Sequence[Any], optimizer,
                        as_torch: Callable[[Any], dict[str, Any]]) -> dict[str, Any]:
        """The state dict of the engine that steps (or stepped, in the last fit) the user's
        optimizer: a checkpoint written after fit holds the same as one written during it
        (with ZeRO, each rank's shard, saved as shards); ``as_torch(optimizer)`` where no
        engine does."""
        engine = self.engines.engine_for(optimizers, optimizer)
        return engine.state_dict() if engine is not None else as_torch(optimizer)

    @staticmethod
    def load(checkpoint_path, weights_only: bool | None,
             one_file: Callable[[Any, bool | None], dict[str, Any]], model: Any = None,
             precision: Any = None) -> dict[str, Any]:
        """Sharded (ZeRO) directories are merged, to be re-sharded for this world size; a
        directory DeepSpeed wrote is read as a Lightning checkpoint of ``model`` with the
        ``precision`` plugin (:mod:`~lightning_fastopt.checkpoint.deepspeed_to_lightning`); ``one_file(path,
        weights_only)`` reads a file, and a damaged file or directory is one message naming it
        (BrokenCheckpointError)."""
        if model is not None and is_deepspeed_checkpoint(checkpoint_path):
            return deepspeed_as_lightning(checkpoint_path, model, precision)
        if _is_local_dir(checkpoint_path):
            return load_sharded(checkpoint_path, weights_only)
        return read_checkpoint_file(checkpoint_path, lambda path: one_file(path, weights_only),
                                    verify=False)  # (the strategy's plugin, ours, checks the checksums it wrote)

    @staticmethod
    def load_optimizer_states(checkpoint: dict[str, Any], optimizers: Sequence[Any]) -> None:
        """Each optimizer loads its saved state where its parameters live (Lightning's
        strategy would move offloaded state to the accelerator)."""
        saved = checkpoint["optimizer_states"]
        if not saved and optimizers:  # hand-built, or from a run without an optimizer: Lightning loads nothing
            rank_zero_warn(f"lightning_fastopt: the checkpoint holds no optimizer state; the {len(optimizers)} "
                           "optimizer(s) of this run start afresh (as Lightning's own strategies do)")
            return
        if len(saved) != len(optimizers):
            raise ValueError(f"the checkpoint has {len(saved)} optimizer state(s), this run has "
                             f"{len(optimizers)} optimizer(s)")
        for opt, state in zip(optimizers, saved):
            opt.load_state_dict(state)


def _is_local_dir(path) -> bool:
    """A directory on this machine (a sharded checkpoint, or something that should be one)."""
    try:
        return os.path.isdir(path)
    except TypeError:
        return False
