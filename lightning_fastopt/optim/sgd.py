"""FusedSGD: SGD with momentum, dampening and Nesterov."""

from __future__ import annotations

from lightning_fastopt.functional import fused_sgd_
from lightning_fastopt.ops.rounding import SGD_ROUNDINGS, check_rounding, check_rounding_device
from lightning_fastopt.optim.base import Bucket, FusedOptimizer, check_lr, check_range


class FusedSGD(FusedOptimizer):
    """torch.optim.SGD semantics (momentum buffer initialised from the first gradient).

    ``wd_after_momentum=True`` (apex's option) adds ``weight_decay * p`` after the momentum
    update instead of before it.  Every torch.optim.SGD keyword is accepted; ``foreach``
    and ``fused`` have no effect and ``differentiable=True`` raises.

    Rounding: every operation rounds as torch.optim.SGD's CPU step (and its CUDA foreach
    step) rounds it; ``rounding="torch_cpu_fused"`` (CPU parameters) as its CPU ``fused=True``
    kernel, which rounds the momentum of each tensor's last ``numel % 8`` elements otherwise;
    ``rounding="torch_cuda_fused"`` as its CUDA ``fused=True`` kernel, which computes
    ``1 - dampening`` in float32 and, with ``maximize`` and no weight decay, rounds the
    momentum of tensors of ``numel % 4 == 0`` otherwise (:mod:`lightning_fastopt.ops.rounding`).
    The fastopt strategies pick the one the user's ``torch.optim.SGD`` would have run.

    State per parameter (float32): ``momentum_buffer`` (only when momentum != 0).
    """

    kernel_piece = "sgd"
    steps_pieces = True
    reads_grad_factors = True

    counts_steps = False

    def __init__(self, params, lr=1e-3, momentum: float = 0.0, dampening: float = 0.0, weight_decay: float = 0.0,
                 nesterov: bool = False, wd_after_momentum: bool = False, *, maximize: bool = False,
                 foreach: bool | None = None, differentiable: bool = False, fused: bool | None = None,
                 rounding: str = "torch_cpu") -> None:
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov,
                        wd_after_momentum=wd_after_momentum, maximize=maximize, foreach=foreach,
                        differentiable=False, fused=fused, rounding=rounding)
        self._validate_group(defaults)
        super().__init__(params, defaults, foreach=foreach, fused=fused, differentiable=differentiable)

    def _validate_group(self, group) -> None:
        check_lr(group["lr"])
        check_range("momentum", group["momentum"], 0.0)
        check_range("dampening", group["dampening"], 0.0, 1.0)
        check_range("weight_decay", group["weight_decay"], 0.0)
        if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise ValueError("nesterov=True requires momentum > 0 and dampening == 0")
        rounding = check_rounding(group.get("rounding", "torch_cpu"), SGD_ROUNDINGS)
        check_rounding_device(rounding, group.get("params", ()))

    def _init_state(self, group, p, state) -> None:
        if group["momentum"] != 0:
            import torch

            state["momentum_buffer"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)

    def _bucket_state_keys(self, group) -> tuple[str, ...]:
        return ("momentum_buffer",) if group["momentum"] != 0 else ()

    def _buckets(self, group):
        if self._switched_on(group, "momentum"):  # momentum may be switched on later: start buffers
            for p in group["params"]:
                st = self.state.get(p)
                if st is not None and st.get("momentum_buffer") is None:
                    st.clear()
        return super()._buckets(group)

    def _update(self, group, b: Bucket, grad_scale, context) -> None:
        fused_sgd_(b.params, b.grads, b.states.get("momentum_buffer"), step=b.step, lr=group["lr"],
                   momentum=group["momentum"], dampening=group["dampening"], weight_decay=group["weight_decay"],
                   nesterov=group["nesterov"], maximize=group["maximize"],
                   wd_after_momentum=group["wd_after_momentum"], grad_scale=grad_scale,
                   param_copies=b.copies, found_inf=b.found_inf, rounding=group.get("rounding", "torch_cpu"),
                   grad_factors=self.grad_factors)
