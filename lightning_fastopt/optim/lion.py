"""FusedLion: the Lion optimizer (Chen et al. 2023)."""

from __future__ import annotations

from lightning_fastopt.functional import fused_lion_
from lightning_fastopt.optim.base import Bucket, FusedOptimizer, check_betas, check_lr, check_range


class FusedLion(FusedOptimizer):
    """Lion: ``p -= lr * sign(beta1*m + (1-beta1)*g)``, then ``m = beta2*m + (1-beta2)*g``,
    with decoupled weight decay ``p *= 1 - lr*weight_decay``.

    State per parameter (float32): ``exp_avg``.
    """

    kernel_piece = "lion"
    steps_pieces = True
    reads_grad_factors = True

    state_keys = ("exp_avg",)
    counts_steps = False

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay: float = 0.0, *,
                 maximize: bool = False) -> None:
        defaults = dict(lr=lr, betas=check_betas(betas), weight_decay=weight_decay, maximize=maximize)
        self._validate_group(defaults)
        super().__init__(params, defaults)

    def _validate_group(self, group) -> None:
        check_lr(group["lr"])
        check_betas(group["betas"])
        check_range("weight_decay", group["weight_decay"], 0.0)

    def _update(self, group, b: Bucket, grad_scale, context) -> None:
        beta1, beta2 = group["betas"]
        fused_lion_(b.params, b.grads, b.states["exp_avg"], lr=group["lr"], beta1=beta1, beta2=beta2,
                    weight_decay=group["weight_decay"], maximize=group["maximize"], grad_scale=grad_scale,
                    param_copies=b.copies, found_inf=b.found_inf, grad_factors=self.grad_factors)
