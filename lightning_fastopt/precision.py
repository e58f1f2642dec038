"""FastOptPrecision: Lightning precision plugin with DeepSpeed-style fp16 loss scaling.

Usable on its own, ``Trainer(plugins=[FastOptPrecision("16-mixed")])`` (on the CPU, where
Lightning turns ``precision="16-mixed"`` into bf16, this is the way to get fp16), and by
the fastopt strategies.

One optimizer step, in fp16:
1. forward under fp16 autocast, the loss multiplied by the current scale, backward;
2. the gradients are checked for inf/NaN; on overflow, clipping and the whole step are
   skipped (no parameter or optimizer state changes), ``skipped_steps`` grows, and the
   scale follows the rule of :class:`~lightning_fastopt.loss_scaler.DynamicLossScaler`;
3. otherwise Lightning's hooks and gradient clipping run on the (still scaled) gradients,
   with the scale taken out of the arithmetic so that the clipping thresholds mean what
   they mean in fp32, and the optimizer steps: our fused optimizers unscale inside the
   kernel, any other optimizer gets its gradients unscaled in place first.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins.precision.utils import _convert_fp_tensor, _DtypeContextManager
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning_utilities import apply_to_collection
from lightning.pytorch.utilities.enums import GradClipAlgorithmType
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from typing_extensions import override

from lightning_fastopt.distributed import all_reduce_scalar
from lightning_fastopt.functional import by_device, grads_all_finite, sum_of_squares, unscale_grads_
from lightning_fastopt.loss_scaler import DynamicLossScaler
from lightning_fastopt.optim.wrapper import OptimizerWrapper, unscales_in_step, unwrapped


SUPPORTED_PRECISIONS = ("16-mixed", "bf16-mixed", "32-true", "bf16-true", "16-true")
_PrecisionFlag = Literal["16-mixed", "bf16-mixed", "32-true", "bf16-true", "16-true"]
_TRUE_DTYPES = {"bf16-true": torch.bfloat16, "16-true": torch.float16}


def _grads(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    """The gradients the optimizer's next step reads (an offload optimizer keeps some in
    host memory: it says where)."""
    optimizer = unwrapped(optimizer)  # manual optimization's clip_gradients passes LightningOptimizer
    if isinstance(optimizer, OptimizerWrapper):
        return optimizer.gradients()
    return [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]


class FastOptPrecision(Precision):
    """Precision plugin: ``"16-mixed"`` (fp16 autocast, dynamic loss scaling with DeepSpeed's
    knobs), ``"bf16-mixed"`` (bf16 autocast), ``"32-true"``, or the half weights of
    ``"bf16-true"`` and ``"16-true"`` (fp16, with the same loss scaling): the model holds
    bf16/fp16 weights and gradients (2 bytes per parameter on the device), and the fastopt
    optimizers keep float32 master weights and write the half copy in the same pass, as
    apex O2 and DeepSpeed do.

    Args:
        precision: one of ``"16-mixed"``, ``"bf16-mixed"``, ``"32-true"``, ``"bf16-true"``,
            ``"16-true"``.
        loss_scale: 0 for dynamic scaling, or a fixed scale (fp16 only).
        initial_scale_power: dynamic scaling starts at ``2 ** initial_scale_power``.
        loss_scale_window: clean steps before the scale doubles.
        hysteresis: overflows tolerated before the scale halves.
        min_loss_scale: the scale never goes below this.
        at_min_loss_scale: when a step overflows with the scale at its minimum: ``"raise"``
            (default), ``"warn"`` or ``"skip"`` (see :mod:`~lightning_fastopt.loss_scaler`).
        device: autocast device type; by default the device of the model's parameters.

    After construction ``loss_scale`` is the current scale (1.0 unless fp16) and
    ``skipped_steps`` the number of optimizer steps skipped for overflow.
    """

    def __init__(self, precision: _PrecisionFlag = "16-mixed", loss_scale: float = 0.0,
                 initial_scale_power: int = 16, loss_scale_window: int = 1000, hysteresis: int = 2,
                 min_loss_scale: float = 1.0, device: str | None = None, at_min_loss_scale: str = "raise") -> None:
        if precision not in SUPPORTED_PRECISIONS:
            raise ValueError(f"FastOptPrecision supports precision in {SUPPORTED_PRECISIONS}, got {precision!r}")
        self.precision = precision
        self.scaler = (DynamicLossScaler(loss_scale, initial_scale_power, loss_scale_window, hysteresis,
                                         min_loss_scale, at_min_loss_scale)
                       if precision in ("16-mixed", "16-true") else None)
        self._true_dtype = _TRUE_DTYPES.get(precision)  # the weights' dtype in a "-true" precision
        self.device = device
        self._overflow = False

    # ------------------------------------------------------------------ what users read
    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    @property
    def skipped_steps(self) -> int:
        return self.scaler.skipped_steps if self.scaler is not None else 0

    @property
    def last_step_skipped(self) -> bool:
        """True when the last optimizer step was skipped for overflowing gradients."""
        return self._overflow

    # ------------------------------------------------------------------ autocast
    @override
    def connect(self, model, optimizers, lr_schedulers):
        if self.device is None:
            param = next(iter(model.parameters()), None)
            self.device = param.device.type if param is not None else "cpu"
        return super().connect(model, optimizers, lr_schedulers)

    @override
    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return module.to(dtype=self._true_dtype) if self._true_dtype is not None else module

    @override
    def tensor_init_context(self) -> contextlib.AbstractContextManager:
        return _DtypeContextManager(self._true_dtype) if self._true_dtype is not None else contextlib.nullcontext()

    @override
    def module_init_context(self) -> contextlib.AbstractContextManager:
        return self.tensor_init_context()

    @override
    def convert_input(self, data: Any) -> Any:
        if self._true_dtype is None:
            return data
        return apply_to_collection(data, function=_convert_fp_tensor, dtype=Tensor, dst_type=self._true_dtype)

    @override
    def forward_context(self) -> contextlib.AbstractContextManager:
        if self._true_dtype is not None:  # tensors created in forward take the weights' dtype
            return _DtypeContextManager(self._true_dtype)
        if self.precision == "32-true":
            return contextlib.nullcontext()
        dtype = torch.float16 if self.precision == "16-mixed" else torch.bfloat16
        device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
        return torch.autocast(device, dtype=dtype, cache_enabled=False)

    # ------------------------------------------------------------------ scaling and stepping
    @override
    def pre_backward(self, tensor: Tensor, module) -> Tensor:
        if self.scaler is not None:
            tensor = tensor * self.scaler.scale
        return super().pre_backward(tensor, module)

    @override
    def optimizer_step(self, optimizer, model, closure: Callable[[], Any], **kwargs: Any) -> Any:
        closure_result = closure()
        if closure_result is None and model.automatic_optimization:
            return closure_result  # training_step returned None: Lightning skipped backward
        # an overflow on any rank skips the step on every rank (without a scaler nothing
        # reads the gradients here: an offload step streamed into backward may be under way)
        self._overflow = self.scaler is not None and bool(
            all_reduce_scalar(float(not grads_all_finite(_grads(optimizer))), dist.ReduceOp.MAX))
        self._after_closure(model, optimizer)  # hooks, then clipping (skipped on overflow)
        if self._overflow:
            self.scaler.update(overflow=True)
            optimizer._opt_called = True  # LR schedulers check this; the skipped step still counts
            rank_zero_info(f"lightning_fastopt: gradient overflow, step skipped; loss scale now {self.scaler.scale:g}")
            return closure_result
        scale = self.scaler.scale if self.scaler is not None else None
        if unscales_in_step(optimizer):
            optimizer.step(grad_scale=scale, **kwargs)
        else:
            if scale is not None:
                unscale_grads_(_grads(optimizer), scale)  # again: hooks may replace .grad
            optimizer.step(**kwargs)
        if self.scaler is not None:
            self.scaler.update(overflow=False)
        return closure_result

    @override
    def _clip_gradients(self, model, optimizer, clip_val=None, gradient_clip_algorithm=None) -> None:
        if self._overflow:
            return  # the step is skipped anyway; inf/NaN gradients have no meaningful norm
        super()._clip_gradients(model, optimizer, clip_val, gradient_clip_algorithm)

    @override
    def clip_gradients(self, optimizer, clip_val: float | int = 0.0,
                       gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM) -> None:
        """Clip the (possibly still scaled) gradients as if they were unscaled."""
        if clip_val <= 0:
            return
        grads = _grads(optimizer)
        if not grads:
            return
        scale = self.loss_scale
        if gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
            bound = float(clip_val) * scale
            for g in grads:
                g.clamp_(-bound, bound)
            return
        # the multi-tensor L2 kernels, on every device (an offload optimizer has gradients on two)
        squares = sum_of_squares(grads)
        optimizer = unwrapped(optimizer)
        if isinstance(optimizer, OptimizerWrapper) and optimizer.shards_gradients:  # ZeRO: each rank's own shard
            squares = all_reduce_scalar(squares)
        total = math.sqrt(squares) / scale
        coef = float(clip_val) / (total + 1e-6)  # torch.nn.utils.clip_grad_norm_'s rule
        if coef < 1.0 and math.isfinite(coef):
            for same in by_device(grads):
                torch._foreach_mul_(same, coef)

    # ------------------------------------------------------------------ checkpoints
    @override
    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler is not None else {}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None and state_dict:
            self.scaler.load_state_dict(state_dict)

    def __repr__(self) -> str:
        return f"FastOptPrecision({self.precision!r}, loss_scale={self.loss_scale:g})"


def to_fastopt_precision(plugin: Precision, **scale_knobs: Any) -> FastOptPrecision:
    """The FastOptPrecision for the plugin Lightning built from the ``precision`` flag
    (``scale_knobs``: the loss-scaling arguments of :class:`FastOptPrecision`); a
    TypeError naming the supported precisions for anything else."""
    if isinstance(plugin, FastOptPrecision):
        return plugin
    if isinstance(plugin, MixedPrecision):
        device = getattr(plugin, "device", None)
        return FastOptPrecision(plugin.precision, device=device, **scale_knobs)
    if isinstance(plugin, HalfPrecision):
        return FastOptPrecision(plugin.precision, **scale_knobs)
    if type(plugin) is Precision:
        return FastOptPrecision("32-true")
    raise TypeError(f"the fastopt strategies support precision in {SUPPORTED_PRECISIONS} "
                    f"(or plugins=[FastOptPrecision(...)]), got {type(plugin).__name__}"
                    f"({getattr(plugin, 'precision', '?')!r})")
