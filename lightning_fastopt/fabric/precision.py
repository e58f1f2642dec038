"""FastOptFabricPrecision: the fastopt precision plugin for Lightning Fabric.

The same flags, autocast, half weights and fp16 loss scaling as the Trainer's
:class:`~lightning_fastopt.FastOptPrecision` (both are
:class:`~lightning_fastopt.core.precision.PrecisionCore`): ``fabric.backward(loss)``
scales the loss, ``optimizer.step()`` skips the step when a gradient overflowed (on any
rank) and otherwise steps with the scale taken out inside our kernels, and
``fabric.clip_gradients`` unscales the gradients in ``p.grad`` in place first, as Fabric's
own plugin does (where they are all there, in float32), else clips the still-scaled
gradients as if unscaled.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from lightning.fabric.plugins.precision.utils import _convert_fp_tensor
from lightning_utilities import apply_to_collection
from torch import Tensor
from typing_extensions import override

from lightning_fastopt.core.precision import SUPPORTED_PRECISIONS, PrecisionCore


class FastOptFabricPrecision(PrecisionCore, Precision):
    """Fabric's precision plugin of the fastopt strategies; the arguments are those of
    :class:`~lightning_fastopt.FastOptPrecision`.  ``Fabric(precision=...)``
    gives one to a fastopt strategy; pass ``plugins=[FastOptFabricPrecision("16-mixed")]``
    for fp16 on the CPU (where Fabric turns ``"16-mixed"`` into bf16).

    Fabric asks for ``fabric.backward(loss)`` (and refuses ``loss.backward()``) exactly when
    the plugin overrides one of its backward methods, and ignores what ``pre_backward``
    returns.  So this class keeps Fabric's own: ``loss.backward()`` works at ``32-true``
    and ``bf16-true``, as with Fabric's plugins.  The flags of Fabric's mixed-precision
    plugin, which has a backward of its own (``16-mixed``, ``bf16-mixed``), and
    ``16-true``, whose loss is scaled here, make an instance of the subclass whose
    ``backward`` scales the loss (fp16) and which Fabric requires ``fabric.backward`` for.
    """

    def __new__(cls, precision: str = "16-mixed", *args: Any, **kwargs: Any) -> FastOptFabricPrecision:
        if cls is FastOptFabricPrecision and precision in OWN_BACKWARD:
            cls = _OwnBackwardFabricPrecision
        return super().__new__(cls)

    def __getnewargs_ex__(self) -> tuple[tuple[str], dict[str, Any]]:
        return (self.precision,), {}  # a copy or an unpickled one is made as this one was

    pre_backward = Precision.pre_backward
    backward = Precision.backward

    @override
    def convert_input(self, data: Any) -> Any:
        """Floating inputs in the dtype Fabric's own plugin gives forward: the weights' under
        ``-true`` precisions, the autocast dtype under mixed precision."""
        dtype = _INPUT_DTYPES.get(self.precision)
        if dtype is None:
            return data
        return apply_to_collection(data, function=_convert_fp_tensor, dtype=Tensor, dst_type=dtype)

    @override
    def convert_output(self, data: Any) -> Any:
        """Floating outputs in the default dtype (float32), as Fabric's own plugins give them
        back (a loss computed from them is then float32, as there)."""
        if self.precision == "32-true":
            return data
        return apply_to_collection(data, function=_convert_fp_tensor, dtype=Tensor, dst_type=torch.get_default_dtype())

    @override
    def optimizer_step(self, optimizer, **kwargs: Any) -> Any:
        try:
            if self._check_overflow(optimizer):
                self._skip_step(optimizer)
                return None
            return self._step(optimizer, **kwargs)
        finally:
            self._unscaled = False

    @override
    def unscale_gradients(self, optimizer) -> None:
        """As Fabric's own plugin before it clips: the gradients in ``p.grad`` unscaled in
        place (:meth:`_unscale_in_place`; ``fabric.clip_gradients`` calls it), so the loop
        reads them unscaled afterwards; where some left for the host during backward
        (``keep_gradients=False``) or they are half, they stay scaled and clipping and the
        kernels take the scale out."""
        self._unscale_in_place(optimizer)


# the dtype Fabric's own plugin of each flag gives floating inputs
_INPUT_DTYPES = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16, "16-true": torch.float16,
                 "bf16-true": torch.bfloat16, "64-true": torch.float64}

# the flags whose plugin has a backward of its own (Fabric then requires fabric.backward)
OWN_BACKWARD = ("16-mixed", "bf16-mixed", "16-true")


class _OwnBackwardFabricPrecision(FastOptFabricPrecision):
    """``fabric.backward(loss)`` backpropagates the loss, times the loss scale with fp16."""

    @override
    def backward(self, tensor, model, *args: Any, **kwargs: Any) -> None:
        if self.scaler is not None:
            tensor = tensor * self.scaler.scale
            self._unscaled = False  # scaled gradients come (an unscale before them was for a step not taken)
        super().backward(tensor, model, *args, **kwargs)


def to_fabric_precision(plugin: Precision, **scale_knobs: Any) -> FastOptFabricPrecision:
    """The FastOptFabricPrecision for the plugin Fabric built from the ``precision`` flag;
    a TypeError naming the supported precisions for anything else."""
    if isinstance(plugin, FastOptFabricPrecision):
        return plugin
    if isinstance(plugin, (MixedPrecision, HalfPrecision, DoublePrecision)) or type(plugin) is Precision:
        device = getattr(plugin, "device", None)
        return FastOptFabricPrecision(getattr(plugin, "precision", "32-true"), device=device, **scale_knobs)
    raise TypeError(f"the fastopt strategies support precision in {SUPPORTED_PRECISIONS} "
                    f"(or plugins=[FastOptFabricPrecision(...)]), got {type(plugin).__name__}"
                    f"({getattr(plugin, 'precision', '?')!r})")
