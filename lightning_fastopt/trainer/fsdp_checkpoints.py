"""The checkpoints of the FSDP Trainer strategy: ``ModelParallelStrategy``'s (a directory
of shards torch's distributed checkpoint writes, or one full file), with each optimizer's
state as torch would hold it (the user's class with the engine's state, DTensors over this
rank's rows), written whole or not at all, refused before anything is loaded where torch's
safe loader or the checksums refuse them, and a DeepSpeed directory read as a full
checkpoint.

:class:`FSDPCheckpoints` is the strategy's part for them, as
:class:`~lightning_fastopt.trainer.engine_checkpoints.EngineCheckpoints` is the DDP
strategy's: given the strategy's engines, it answers the strategy's checkpoint hooks, each
of which calls it with what Lightning's own hook would do for what it leaves to Lightning.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from lightning_fastopt.checkpoint.atomic import DISTRIBUTED_CHECKPOINT_FILES, save_staged
from lightning_fastopt.checkpoint.checksums import checksum_staged, verify_distributed_once
from lightning_fastopt.checkpoint.deepspeed_reader import is_deepspeed_checkpoint
from lightning_fastopt.checkpoint.deepspeed_to_lightning import deepspeed_as_lightning
from lightning_fastopt.checkpoint.replacing import refuse_to_replace_a_directory
from lightning_fastopt.checkpoint.safe_loading import SafeLoaderRefusedError, check_before_loading
from lightning_fastopt.fsdp.full_state import load_full_state
from lightning_fastopt.optim.takeover import held_as_torch
from lightning_fastopt.trainer.engine_set import EngineSet

__all__ = ["FSDPCheckpoints"]

# NOTE [fit's weights_only under FSDP]: Lightning 2.6's Trainer restores a strategy that loads
# after its set-up (``restore_checkpoint_after_setup``: FSDP, DeepSpeed) without the
# ``weights_only`` that ``fit`` was given, so ``fit(..., weights_only=False)`` never reaches
# this strategy (nor ``ModelParallelStrategy``): a refusal names the ways that do.
_FIT_DROPS_WEIGHTS_ONLY = ("python -m lightning_fastopt.checkpoint consolidate --no-weights-only, for one file of the "
                           "weights and state (Lightning's Trainer does not pass fit's weights_only to an FSDP "
                           "strategy: to resume, allow them instead)")


class FSDPCheckpoints:
    """Saves and loads an FSDP Trainer strategy's checkpoints (see the module's documentation)."""

    def __init__(self, engines: EngineSet) -> None:
        self.engines = engines

    def module_state_dict(self, engines: Sequence[Any], lightnings: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """Lightning's (``lightnings()``), once a delayed update still pending is in the model:
        torch's layout has no place for it, so a checkpoint is the end of a synchronous step
        for the delayed update (the run that saves goes on from there, as the resumed one)."""
        for engine in engines:
            engine.local.apply_pending_update()
        return lightnings()

    def optimizer_state(self, optimizers: Sequence[Any], optimizer,
                        lightnings: Callable[[Any], dict[str, Any]]) -> dict[str, Any]:
        """Lightning's (torch's distributed state dict, in torch's layout) of the optimizer as
        torch would hold it: the user's class with the engine's state, DTensors over this
        rank's rows."""
        held = self.engines.engine_for(optimizers, optimizer) is not None
        return lightnings(held_as_torch(optimizer) if held else optimizer)

    @staticmethod
    def save(filepath, ranks, distributed: bool, lightnings: Callable[[Any], None]) -> None:
        """Lightning's save (``lightnings(path)``: a directory of shards, or one full file),
        written whole or not at all: into a staging path, moved over ``filepath`` once every
        rank has written (:func:`~lightning_fastopt.checkpoint.atomic.save_staged`); a process
        killed mid-save leaves the previous checkpoint.  Saved into a directory, the files
        there that are not a distributed checkpoint's stay, as under Lightning.  A full
        checkpoint does not replace a directory that is not a checkpoint, as
        ``ModelParallelStrategy`` refuses it."""
        if not distributed:
            refuse_to_replace_a_directory(ranks.broadcast(filepath))
        save_staged(filepath, lightnings, ranks, DISTRIBUTED_CHECKPOINT_FILES, before_move=checksum_staged)

    def load(self, path, weights_only: bool | None, strategy, optimizers: Sequence[Any],
             lightnings: Callable[[list[Any]], dict[str, Any]]) -> dict[str, Any]:
        """``ModelParallelStrategy`` loads the weights and optimizer states (a distributed or
        full checkpoint, ``lightnings(views)`` with the strategy's optimizers seen as
        ``views``): each engine's optimizer state is loaded into the optimizer as torch would
        hold it, then taken over by the engine.  A checkpoint that torch's safe loader refuses
        is refused before anything is loaded
        (:func:`~lightning_fastopt.checkpoint.safe_loading.check_before_loading`), and so is a
        distributed one whose checksums do not match (:mod:`~lightning_fastopt.checkpoint.checksums`).
        A directory DeepSpeed wrote is read whole on every rank and loaded as a full
        checkpoint (:mod:`~lightning_fastopt.checkpoint.deepspeed_to_lightning`)."""
        verify_distributed_once(path, strategy)
        try:
            check_before_loading(path, weights_only)
        except SafeLoaderRefusedError as refused:
            raise refused.with_ways(_FIT_DROPS_WEIGHTS_ONLY) from refused
        taken = list(optimizers)
        views = [held_as_torch(o) if self.engines.engine_for(taken, o) else o for o in taken]
        if is_deepspeed_checkpoint(path):  # every rank reads it whole
            module = strategy.lightning_module
            checkpoint = load_full_state(strategy.model, views, deepspeed_as_lightning(
                path, module, strategy.precision_plugin), module.strict_loading)
        else:
            checkpoint = lightnings(views)
        for opt, view in zip(taken, views):
            engine = self.engines.engine_for(taken, opt)
            if engine is not None:
                engine.load_param_state(view.state, view.param_groups)
        return checkpoint
