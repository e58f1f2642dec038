"""FusedLAMB: layer-wise adaptive moments (You et al. 2019), apex FusedLAMB semantics."""

from __future__ import annotations

import math

from torch import Tensor

from lightning_fastopt.functional import fused_lamb_, lamb_update_norms, norm_of_square_sums, square_sums
from lightning_fastopt.optim.base import Bucket, FusedOptimizer, check_betas, check_lr, check_range


class FusedLAMB(FusedOptimizer):
    """LAMB with apex's FusedLAMB rules, step by step:

    1. ``norm`` = L2 norm of all gradients of all groups (after loss-scale unscaling).
       If ``max_grad_norm > 0`` and ``norm > max_grad_norm``, gradients are divided by
       ``norm / max_grad_norm`` (global clipping, before the moments).
    2. ``adam_w_mode=False``: ``g += weight_decay * p`` (L2).
    3. ``m = beta1*m + beta3*g`` with ``beta3 = 1 - beta1`` if ``grad_averaging`` else 1;
       ``v = beta2*v + (1-beta2)*g*g``.
    4. ``u = m_hat / (sqrt(v_hat) + eps)`` with bias-corrected moments when
       ``bias_correction``; ``adam_w_mode=True``: ``u += weight_decay * p``.
    5. Trust ratio, per parameter tensor: ``||p|| / ||u||`` when ``weight_decay != 0`` or
       ``use_nvlamb``, and 1 when either norm is 0 (or neither condition holds).
    6. ``p -= lr * ratio * u``.

    State per parameter (float32): ``step``, ``exp_avg``, ``exp_avg_sq``.
    """

    kernel_piece = "lamb"

    state_keys = ("exp_avg", "exp_avg_sq")
    whole_tensor_norms = True  # the trust ratio: norms of the whole parameter and update

    def __init__(self, params, lr=1e-3, bias_correction: bool = True, betas=(0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.01, adam_w_mode: bool = True, grad_averaging: bool = True,
                 max_grad_norm: float = 1.0, use_nvlamb: bool = False, *, maximize: bool = False) -> None:
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=check_betas(betas), eps=eps,
                        weight_decay=weight_decay, adam_w_mode=adam_w_mode, grad_averaging=grad_averaging,
                        max_grad_norm=max_grad_norm, use_nvlamb=use_nvlamb, maximize=maximize)
        self._validate_group(defaults)
        super().__init__(params, defaults)

    def _validate_group(self, group) -> None:
        check_lr(group["lr"])
        check_betas(group["betas"])
        check_range("eps", group["eps"], 0.0)
        check_range("weight_decay", group["weight_decay"], 0.0)
        check_range("max_grad_norm", group["max_grad_norm"], 0.0)

    def step_context(self, grads, grad_scale) -> float:
        return self.step_context_of_square_sums(square_sums(grads), grad_scale)

    def step_context_of_square_sums(self, sums, grad_scale) -> float:
        norm = norm_of_square_sums(sums, grad_scale)
        if not math.isfinite(norm):
            raise ValueError(f"FusedLAMB: the global gradient norm is {norm}; use step(check_finite=True) "
                             "(or lightning_fastopt's precision plugin) to skip such steps")
        return norm

    def unclipped_context(self) -> float:
        return 0.0  # a global norm under every max_grad_norm: the gradients are not scaled down

    def same_update(self, speculated, actual) -> bool:
        """The norm enters the update only through the clipping factor, 1 unless it exceeds a
        group's ``max_grad_norm``: two norms that clip in no group give the same bits."""
        if speculated is None or actual is None:
            return speculated is actual
        return not any(g["max_grad_norm"] > 0 and norm > g["max_grad_norm"]
                       for g in self.param_groups for norm in (float(speculated), float(actual)))

    def _update(self, group, b: Bucket, grad_scale, context) -> None:
        beta1, beta2 = group["betas"]
        fused_lamb_(b.params, b.grads, b.states["exp_avg"], b.states["exp_avg_sq"], step=b.step, lr=group["lr"],
                    beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                    bias_correction=group["bias_correction"], adam_w_mode=group["adam_w_mode"],
                    grad_averaging=group["grad_averaging"], max_grad_norm=group["max_grad_norm"],
                    use_nvlamb=group["use_nvlamb"], maximize=group["maximize"], grad_scale=grad_scale,
                    global_grad_norm_value=context, param_copies=b.copies, found_inf=b.found_inf,
                    norms=self._given_norms(b))

    def _bucket_norm_sums(self, group, b: Bucket, grad_scale, context) -> Tensor:
        """(||p||^2, ||u||^2) of each parameter and its update this step."""
        beta1, beta2 = group["betas"]
        return lamb_update_norms(b.params, b.grads, b.states["exp_avg"], b.states["exp_avg_sq"], step=b.step,
                                 beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                                 bias_correction=group["bias_correction"], adam_w_mode=group["adam_w_mode"],
                                 grad_averaging=group["grad_averaging"], max_grad_norm=group["max_grad_norm"],
                                 maximize=group["maximize"], grad_scale=grad_scale, global_grad_norm_value=context)
