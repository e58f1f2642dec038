"""Dynamic loss scaling for fp16 training, with DeepSpeed's knobs and semantics.

The rule, applied once per optimizer step with whether that step overflowed:

- the scale starts at ``2 ** initial_scale_power`` (or is fixed at ``loss_scale`` when
  that is > 0: static scaling, overflowing steps are still skipped);
- on an overflow the step is skipped; if hysteresis is left (more than 1), it is reduced
  by one and the scale is kept; otherwise the scale is halved, never below
  ``min_loss_scale``;
- after ``loss_scale_window`` consecutive clean steps the scale doubles and the
  hysteresis is refilled to ``hysteresis``.

This is DeepSpeed's ``DynamicLossScaler`` (non-consecutive hysteresis) except that
growth comes after exactly ``loss_scale_window`` clean steps (DeepSpeed waits one more
after an overflow).

An overflow when the scale cannot go lower (at ``min_loss_scale``, hysteresis spent; a
static scale, once ``hysteresis`` steps in a row have overflowed) means the loss or the
gradients are inf/NaN whatever the scale, and every later step would be skipped too.  ``at_min_loss_scale`` says what then happens: ``"raise"`` (the
default, as DeepSpeed) raises :class:`LossScaleAtMinimumError`; ``"warn"`` warns (at the
1st, 2nd, 4th, 8th ... such overflow in a row) and keeps skipping; ``"skip"`` skips quietly.
"""

from __future__ import annotations

import math
import warnings
from typing import Any


def _check_int(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return value


AT_MIN_LOSS_SCALE = ("raise", "warn", "skip")


class LossScaleAtMinimumError(FloatingPointError):
    """fp16 steps keep overflowing at the smallest loss scale allowed."""


class DynamicLossScaler:
    """The loss scale and its update rule (see the module docstring)."""

    def __init__(self, loss_scale: float = 0.0, initial_scale_power: int = 16, loss_scale_window: int = 1000,
                 hysteresis: int = 2, min_loss_scale: float = 1.0, at_min_loss_scale: str = "raise") -> None:
        if not (isinstance(loss_scale, (int, float)) and math.isfinite(loss_scale) and loss_scale >= 0):
            raise ValueError(f"loss_scale must be 0 (dynamic) or a positive finite number, got {loss_scale!r}")
        _check_int("initial_scale_power", initial_scale_power, 0)
        if initial_scale_power > 126:
            raise ValueError(f"initial_scale_power must be in [0, 126], got {initial_scale_power}")
        _check_int("loss_scale_window", loss_scale_window, 1)
        _check_int("hysteresis", hysteresis, 1)
        if not (isinstance(min_loss_scale, (int, float)) and math.isfinite(min_loss_scale) and min_loss_scale > 0):
            raise ValueError(f"min_loss_scale must be a positive finite number, got {min_loss_scale!r}")
        if at_min_loss_scale not in AT_MIN_LOSS_SCALE:
            raise ValueError(f"at_min_loss_scale must be one of {AT_MIN_LOSS_SCALE}, got {at_min_loss_scale!r}")
        self.at_min_loss_scale = at_min_loss_scale
        self.overflows_at_min = 0  # consecutive overflows with the scale at its minimum
        self.dynamic = loss_scale == 0
        initial = float(2 ** initial_scale_power) if self.dynamic else float(loss_scale)
        if self.dynamic and initial < min_loss_scale:
            raise ValueError(f"2**initial_scale_power ({initial}) is below min_loss_scale ({min_loss_scale})")
        self.loss_scale_window = loss_scale_window
        self.hysteresis = hysteresis
        self.min_loss_scale = float(min_loss_scale)
        self.scale = initial
        self.hysteresis_left = hysteresis
        self.clean_steps = 0  # consecutive clean steps since the last overflow or growth
        self.skipped_steps = 0

    def update(self, overflow: bool) -> None:
        """Record one optimizer step: ``overflow`` True means it was skipped."""
        if overflow:
            self.skipped_steps += 1
            self.clean_steps = 0
            if self.hysteresis_left > 1:
                self.hysteresis_left -= 1
            elif self.dynamic and self.scale > self.min_loss_scale:
                self.scale = max(self.scale / 2.0, self.min_loss_scale)
            else:
                self._overflowed_at_min()
            return
        self.overflows_at_min = 0
        if not self.dynamic:
            self.hysteresis_left = self.hysteresis  # a static scale acts on the hysteresis-th overflow in a row
            return
        self.clean_steps += 1
        if self.clean_steps >= self.loss_scale_window:
            self.scale *= 2.0
            self.clean_steps = 0
            self.hysteresis_left = self.hysteresis

    def _overflowed_at_min(self) -> None:
        self.overflows_at_min += 1
        n = self.overflows_at_min
        where = (f"already at min_loss_scale={self.min_loss_scale:g}" if self.dynamic
                 else f"static (loss_scale={self.scale:g}, which never goes lower)")
        message = (f"fp16 loss scaling: the step overflowed (inf/NaN gradients) with the loss scale {where}, "
                   f"{n} time(s) in a row ({self.skipped_steps} steps "
                   "skipped in all): the loss or the gradients are not finite whatever the scale, so every "
                   "later step would be skipped too.")
        if self.at_min_loss_scale == "raise":
            raise LossScaleAtMinimumError(message + " Check the loss for NaN; at_min_loss_scale='warn' or 'skip' "
                                          "(FastOptStrategy / FastOptPrecision) keeps skipping instead.")
        if self.at_min_loss_scale == "warn" and n & (n - 1) == 0:  # the 1st, 2nd, 4th, 8th ...
            warnings.warn(message, RuntimeWarning, stacklevel=3)

    def state_dict(self) -> dict[str, Any]:
        """Plain numbers only (loads with ``torch.load(weights_only=True)``)."""
        return {"scale": self.scale, "hysteresis_left": self.hysteresis_left, "clean_steps": self.clean_steps,
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = {"scale", "hysteresis_left", "clean_steps", "skipped_steps"} - set(state)
        if missing:
            raise ValueError(f"loss scaler state is missing {sorted(missing)}")
        scale = float(state["scale"])
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"loss scaler state has an invalid scale {scale}")
        self.scale = scale
        self.hysteresis_left = int(state["hysteresis_left"])
        self.clean_steps = int(state["clean_steps"])
        self.skipped_steps = int(state["skipped_steps"])

    def __repr__(self) -> str:
        kind = "dynamic" if self.dynamic else "static"
        return (f"DynamicLossScaler({kind}, scale={self.scale:g}, hysteresis_left={self.hysteresis_left}, "
                f"clean_steps={self.clean_steps}, skipped_steps={self.skipped_steps})")
