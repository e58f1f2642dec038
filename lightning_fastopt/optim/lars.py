"""FusedLars: layer-wise adaptive rate scaling (You et al. 2017)."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_fastopt.functional import fused_lars_, square_sums
from lightning_fastopt.optim.base import Bucket, FusedOptimizer, check_lr, check_range


class FusedLars(FusedOptimizer):
    """LARS.  Per parameter tensor, with norms of the (unscaled) gradient and the weight::

        local_lr = eeta * ||p|| / (||g|| + weight_decay * ||p|| + epsilon)   if ||p|| > 0 and ||g|| > 0
                 = 1                                                          otherwise
        buf = momentum * buf + (g + weight_decay * p)
        p  -= lr * local_lr * buf

    State per parameter (float32): ``momentum_buffer`` (starts at zero).
    """

    kernel_piece = "lars"

    state_keys = ("momentum_buffer",)
    whole_tensor_norms = True  # the local learning rate: norms of the whole parameter and gradient
    counts_steps = False

    def __init__(self, params, lr=1e-3, momentum: float = 0.0, eeta: float = 1e-3, weight_decay: float = 0.0,
                 epsilon: float = 0.0, *, maximize: bool = False) -> None:
        defaults = dict(lr=lr, momentum=momentum, eeta=eeta, weight_decay=weight_decay, epsilon=epsilon,
                        maximize=maximize)
        self._validate_group(defaults)
        super().__init__(params, defaults)

    def _validate_group(self, group) -> None:
        check_lr(group["lr"])
        check_range("momentum", group["momentum"], 0.0)
        check_range("eeta", group["eeta"], 0.0, low_open=True)
        check_range("weight_decay", group["weight_decay"], 0.0)
        check_range("epsilon", group["epsilon"], 0.0)

    def _update(self, group, b: Bucket, grad_scale, context) -> None:
        fused_lars_(b.params, b.grads, b.states["momentum_buffer"], lr=group["lr"], momentum=group["momentum"],
                    eeta=group["eeta"], weight_decay=group["weight_decay"], epsilon=group["epsilon"],
                    maximize=group["maximize"], grad_scale=grad_scale,
                    param_copies=b.copies, found_inf=b.found_inf, norms=self._given_norms(b))

    def _bucket_norm_sums(self, group, b: Bucket, grad_scale, context) -> Tensor:
        """(||g||^2 of the loss-scaled gradient, ||p||^2) of each parameter, as the kernel takes them."""
        return torch.tensor(list(zip(square_sums(b.grads), square_sums(b.params))), dtype=torch.float64).reshape(-1, 2)
