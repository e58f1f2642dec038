"""Whether the next forward waits for every new weight (``forward_waits="step"``) or each
module's forward only for its own (``"module"``), and why not where it was asked."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["WeightWaits", "choose_weight_waits"]


@dataclass(frozen=True)
class WeightWaits:
    """``by_module``: each module's (FSDP unit's) forward waits for its own weights alone;
    ``line``: what the set-up says of it."""

    by_module: bool = False
    line: str | None = None


def choose_weight_waits(asked: str, why_not: Sequence[str], what: str) -> WeightWaits:
    """``asked``: the strategy's ``forward_waits``; ``why_not``: the reasons that forbid
    ``"module"``; ``what`` it does where it runs."""
    if asked == "step":
        return WeightWaits()
    if why_not:
        return WeightWaits(False, f"forward_waits='module' not used: {'; '.join(why_not)}")
    return WeightWaits(True, f"{what} (forward_waits='module')")
