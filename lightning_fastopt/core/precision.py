"""What the fastopt precision plugins share, for Lightning's Trainer
(:class:`~lightning_fastopt.FastOptPrecision`) and for Fabric
(:class:`~lightning_fastopt.fabric.FastOptFabricPrecision`): the precision flags, the
dtype of "-true" weights, autocast, the fp16 loss scaler, the overflow check that skips a
step, the step itself (our optimizers unscale inside the kernels, any other gets its
gradients unscaled first) and clipping of still-scaled gradients as if unscaled.

A mixin: each plugin puts it before its framework's ``Precision`` class, whose hooks the
framework calls.
"""

from __future__ import annotations

import contextlib
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins.precision.utils import _convert_fp_tensor, _DtypeContextManager
from lightning.fabric.utilities.rank_zero import rank_zero_info
from lightning_utilities import apply_to_collection
from torch import Tensor

from lightning_fastopt.runtime.distributed import all_reduce_scalar
from lightning_fastopt.functional import grads_all_finite, scale_grads_, unscale_grads_
from lightning_fastopt.core.loss_scaler import DynamicLossScaler
from lightning_fastopt.optim.closure import evaluates_closure_again
from lightning_fastopt.optim.takeover import engine_of
from lightning_fastopt.optim.wrapper import OptimizerWrapper, unscales_in_step, unwrapped

SUPPORTED_PRECISIONS = ("16-mixed", "bf16-mixed", "32-true", "bf16-true", "16-true", "64-true")
LOSS_SCALED = ("16-mixed", "16-true")  # the flags whose backward scales the loss (fp16)
PrecisionFlag = Literal["16-mixed", "bf16-mixed", "32-true", "bf16-true", "16-true", "64-true"]
# the weights' dtype in a "-true" precision ("64-true": as Lightning's DoublePrecision; the
# optimizer's own step runs on them, see lightning_fastopt.optim.user_step)
_TRUE_DTYPES = {"bf16-true": torch.bfloat16, "16-true": torch.float16, "64-true": torch.float64}


def optimizer_gradients(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    """The gradients the optimizer's next step reads (an offload optimizer keeps some in
    host memory: it says where)."""
    optimizer = engine_of(optimizer)  # manual optimization's clip_gradients passes LightningOptimizer
    if isinstance(optimizer, OptimizerWrapper):
        return optimizer.gradients()
    return [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]


def needs_closure(optimizer: torch.optim.Optimizer, named: tuple[str, ...] = ()) -> bool:
    """Whether the optimizer's step evaluates the closure itself, again after changing the
    weights (LBFGS, or a class in ``named``, the strategy's ``closure_optimizers``): it gets
    the closure, and runs as torch runs it."""
    return evaluates_closure_again(unwrapped(optimizer), named)


class PrecisionCore:
    """The shared part of the fastopt precision plugins (see the module's documentation)."""

    def __init__(self, precision: PrecisionFlag = "16-mixed", loss_scale: float = 0.0,
                 initial_scale_power: int = 16, loss_scale_window: int = 1000, hysteresis: int = 2,
                 min_loss_scale: float = 1.0, device: str | None = None, at_min_loss_scale: str = "raise") -> None:
        if precision not in SUPPORTED_PRECISIONS:
            raise ValueError(f"{type(self).__name__} supports precision in {SUPPORTED_PRECISIONS}, got {precision!r}")
        self.precision = precision
        self.scaler = (DynamicLossScaler(loss_scale, initial_scale_power, loss_scale_window, hysteresis,
                                         min_loss_scale, at_min_loss_scale)
                       if precision in LOSS_SCALED else None)
        self._true_dtype = _TRUE_DTYPES.get(precision)  # the weights' dtype in a "-true" precision
        self.device = device
        self._overflow = False
        self._unscaled = False  # this step's gradients in p.grad were unscaled in place (_unscale_in_place)

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

    # ------------------------------------------------------------------ dtypes and autocast
    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """As Lightning's own plugins: ``module.double()`` for ``64-true`` (complex tensors
        stay complex), ``module.to(dtype)`` for the half precisions."""
        if self._true_dtype is torch.float64:
            return module.double()
        return module.to(dtype=self._true_dtype) if self._true_dtype is not None else module

    def tensor_init_context(self) -> contextlib.AbstractContextManager:
        return _DtypeContextManager(self._true_dtype) if self._true_dtype is not None else contextlib.nullcontext()

    def module_init_context(self) -> contextlib.AbstractContextManager:
        return self.tensor_init_context()

    def convert_input(self, data: Any) -> Any:
        if self._true_dtype is None:
            return data
        return apply_to_collection(data, function=_convert_fp_tensor, dtype=Tensor, dst_type=self._true_dtype)

    def forward_context(self) -> contextlib.AbstractContextManager:
        if self._true_dtype is not None:  # tensors created in forward take the weights' dtype
            return _DtypeContextManager(self._true_dtype)
        if self.precision == "32-true":
            return contextlib.nullcontext()
        dtype = torch.float16 if self.precision == "16-mixed" else torch.bfloat16
        device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
        return torch.autocast(device, dtype=dtype, cache_enabled=False)

    # ------------------------------------------------------------------ scaling and stepping
    def pre_backward(self, tensor: Tensor, module) -> Tensor:
        if self.scaler is not None:
            tensor = tensor * self.scaler.scale
        return super().pre_backward(tensor, module)

    def _check_overflow(self, optimizer) -> bool:
        """Whether the step must be skipped: an inf/NaN gradient on any rank (without a
        scaler nothing reads the gradients here: an offload step streamed into backward
        may be under way)."""
        self._overflow = self.scaler is not None and bool(
            all_reduce_scalar(float(not grads_all_finite(optimizer_gradients(optimizer))), dist.ReduceOp.MAX))
        return self._overflow

    def announce_grad_scale(self, optimizer) -> None:
        """Tell an optimizer wrapper the ``grad_scale`` its next step will take (the loss
        scale changes only when a step ends): before backward, and after each step."""
        engine = engine_of(optimizer)
        if isinstance(engine, OptimizerWrapper):
            engine.expected_grad_scale = self.scaler.scale if self.scaler is not None else None

    def _skip_step(self, optimizer) -> None:
        engine = engine_of(optimizer)
        if isinstance(engine, OptimizerWrapper):
            engine.step_skipped()
        self.scaler.update(overflow=True)
        self.announce_grad_scale(optimizer)
        optimizer._opt_called = True  # LR schedulers check this; the skipped step still counts
        rank_zero_info(f"lightning_fastopt: gradient overflow, step skipped; loss scale now {self.scaler.scale:g}")

    def _unscale_in_place(self, optimizer) -> bool:
        """Unscale the gradients in ``p.grad`` in place (fp16), as Lightning's and Fabric's own
        plugins unscale them before user code between backward and the step reads them;
        the step and clipping then take scale 1 (:attr:`_unscaled`, until the step ends or
        the next backward).  Only float32 gradients that are all the step reads (kept in
        ``p.grad``: none left for the host yet); half ones stay scaled (unscaled in their own
        dtype they would lose the bits the kernels keep by unscaling in float32).  Returns
        whether they are unscaled."""
        if self.scaler is None or self._unscaled:
            return self._unscaled
        visible = [p.grad for group in unwrapped(optimizer).param_groups for p in group["params"]
                   if p.grad is not None]
        if not visible or any(type(g) is not Tensor or g.dtype != torch.float32 for g in visible):
            return False  # half gradients, or DTensors (FSDP's strategies refuse 16-mixed, as Lightning's do)
        kept = {id(g) for g in visible}
        if not all(id(g) in kept for g in optimizer_gradients(optimizer)):
            return False  # some left for the host during backward: nothing outside the step reads those
        unscale_grads_(visible, self.scaler.scale)
        self._unscaled = True
        return True

    def _step(self, optimizer, **kwargs: Any) -> Any:
        """The optimizer step on gradients that are finite (checked) and still scaled, or
        unscaled in place already (:attr:`_unscaled`)."""
        scale = self.scaler.scale if self.scaler is not None and not self._unscaled else None
        if unscales_in_step(engine_of(optimizer)):
            out = optimizer.step(grad_scale=scale, **kwargs)
        else:
            if scale is not None:
                unscale_grads_(optimizer_gradients(optimizer), scale)  # again: hooks may replace .grad
            out = optimizer.step(**kwargs)
        if self.scaler is not None:
            self.scaler.update(overflow=False)
            self.announce_grad_scale(optimizer)
        return out

    def clip_scaled_gradients(self, optimizer, clip_val: float, by_value: bool = False) -> Tensor | None:
        """Clip the (possibly still scaled) gradients as if they were unscaled; by norm
        returns the unscaled total norm (before clipping).

        By norm, as ``torch.nn.utils.clip_grad_norm_`` (which Lightning calls) computes it:
        the total norm by torch's own ``get_total_norm`` over the gradients in the order of
        the optimizer's parameters, the coefficient ``max_norm / (total + 1e-6)`` clamped to
        1 as a float32 tensor, one multiplication of each gradient.  Unscaled, on the CPU,
        the same bits as Lightning's own clipping; on a GPU the offloaded gradients' norms
        are taken on the device before they leave for the host (``offload/grad_norms.py``).
        With ZeRO each rank holds its shard of the gradients: the ranks share the per-tensor
        norms, and the total is the same bits (``ZeroOptimizer.gradient_norm``).  With fp16
        loss scaling each gradient's norm is unscaled before the total (float16 ones taken
        in float32: scaled, they pass float16's range)."""
        if clip_val <= 0:
            return None
        grads = optimizer_gradients(optimizer)
        if not grads:
            return None
        scale = 1.0 if self._unscaled else self.loss_scale
        if by_value:
            bound = float(clip_val) * scale
            for g in grads:  # a host gradient within bounds is left unwritten: an update speculated on it holds
                if g.device.type != "cpu" or _exceeds(g, bound):
                    g.clamp_(-bound, bound)
            return None
        engine = engine_of(optimizer)
        if isinstance(engine, OptimizerWrapper):  # where its gradients are (with ZeRO: every rank's shard)
            total = engine.gradient_norm(scale)
        else:
            total = torch.nn.utils.get_total_norm(grads, 2.0)
            if scale != 1.0:
                total = total / scale
        coef = torch.clamp(float(clip_val) / (total + 1e-6), max=1.0)
        if coef == 1.0:  # a multiplication by exactly 1 changes no bit: skipped (a NaN norm spreads, as in torch)
            return total
        if isinstance(engine, OptimizerWrapper):  # (an offload optimizer multiplies host gradients in their update)
            engine.scale_gradients(coef)
        else:
            scale_grads_(grads, coef)
        return total

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None and state_dict:
            self.scaler.load_state_dict(state_dict)

    def __repr__(self) -> str:
        public = next(c for c in type(self).__mro__ if not c.__name__.startswith("_"))  # not a private subclass
        return f"{public.__name__}({self.precision!r}, loss_scale={self.loss_scale:g})"


def _exceeds(grad: Tensor, bound: float) -> bool:
    """Whether some element of ``grad`` lies outside [-bound, bound] (NaN does not: clamping leaves it)."""
    if grad.numel() == 0:
        return False
    low, high = torch.aminmax(grad)
    return bool(low < -bound) or bool(high > bound)
