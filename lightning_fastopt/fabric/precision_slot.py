"""The precision plugin of a Fabric strategy of lightning_fastopt, and clipping through it.

Fabric sets the plugin it built from the ``precision`` flag on the strategy; the fastopt
strategies keep :class:`~lightning_fastopt.fabric.precision.FastOptFabricPrecision` made
from it with the strategy's loss-scale knobs (``options.scale_knobs``), and
``fabric.clip_gradients`` clips what the optimizer's step reads, unscaled first where they
are in ``p.grad`` (fp16, as Fabric's own strategies), else as if unscaled.
"""

from __future__ import annotations

import torch
from torch.nn import Module
from typing_extensions import override

from lightning_fastopt.fabric.precision import FastOptFabricPrecision, to_fabric_precision


class FabricPrecisionSlot:
    """A mixin before Fabric's strategy class; the strategy has ``options``
    (:class:`~lightning_fastopt.core.options.StrategyOptions`)."""

    @property
    @override
    def precision(self) -> FastOptFabricPrecision:
        if self._precision is None:
            self._precision = FastOptFabricPrecision("32-true")
        return self._precision

    @precision.setter
    @override
    def precision(self, precision) -> None:
        self._precision = None if precision is None else to_fabric_precision(precision, **self.options.scale_knobs)

    @override
    def clip_gradients_norm(self, module: Module, optimizer, max_norm: float | int, norm_type: float | int = 2.0,
                            error_if_nonfinite: bool = True) -> torch.Tensor:
        """Clip what the step reads by its L2 norm (fp16: as if unscaled); returns the norm."""
        if norm_type != 2.0:
            raise ValueError(f"the fastopt strategies clip by the L2 norm (norm_type=2), got norm_type={norm_type!r}")
        self.precision.unscale_gradients(optimizer)  # as Fabric's own strategies before they clip
        total = self.precision.clip_scaled_gradients(optimizer, max_norm)
        if total is None:
            return torch.tensor(0.0)
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(f"the total norm of the gradients is {total.item()}: clip_gradients(..., "
                               "error_if_nonfinite=False) clips anyway")
        return total

    @override
    def clip_gradients_value(self, module: Module, optimizer, clip_val: float | int) -> None:
        self.precision.unscale_gradients(optimizer)
        self.precision.clip_scaled_gradients(optimizer, clip_val, by_value=True)
