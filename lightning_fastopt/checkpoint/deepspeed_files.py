"""DeepSpeed's checkpoint files read without running code from them and without DeepSpeed
installed: torch's safe loader (``weights_only=True``) with stand-ins for the few classes of
DeepSpeed's that its files pickle (the loss scaler, a partition's fragment address, the ZeRO
stage), which keep the values and run nothing."""

from __future__ import annotations

import os
from typing import Any

import torch

from lightning_fastopt.checkpoint.errors import BrokenCheckpointError
from lightning_fastopt.checkpoint.reading import read_checkpoint_file

__all__ = ["DeepSpeedObject", "FragmentAddress", "read_deepspeed_file"]


class DeepSpeedObject:
    """A DeepSpeed object's attributes as pickled (its loss scalers): ``vars(obj)``."""

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


class FragmentAddress(DeepSpeedObject):
    """``deepspeed.utils.tensor_fragment.fragment_address``: where a parameter's piece lies in
    a rank's flat partition (``start``, ``numel``)."""

    start: int
    numel: int


def _zero_stage(value: int) -> int:
    """``deepspeed.runtime.zero.config.ZeroStageEnum``, an int enum: its value."""
    return int(value)


_STAND_INS = [
    (DeepSpeedObject, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (DeepSpeedObject, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (FragmentAddress, "deepspeed.utils.tensor_fragment.fragment_address"),
    (_zero_stage, "deepspeed.runtime.zero.config.ZeroStageEnum"),
]


def read_deepspeed_file(path: str | os.PathLike, what: str) -> dict[str, Any]:
    """One of DeepSpeed's ``.pt`` files (``what`` it is, for messages), read safely: a file that
    cannot be read is a ``BrokenCheckpointError`` naming it."""
    def load(p: str) -> Any:
        with torch.serialization.safe_globals(_STAND_INS):
            return torch.load(p, map_location="cpu", weights_only=True)

    loaded = read_checkpoint_file(path, load, what=what, needs=None, verify=False)
    if not isinstance(loaded, dict):
        raise BrokenCheckpointError(f"cannot read the {what} {os.fspath(path)}: it holds a {type(loaded).__name__}, "
                                    "not DeepSpeed's dictionary")
    return loaded
