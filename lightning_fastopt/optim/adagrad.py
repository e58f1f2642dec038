"""FusedAdagrad: torch.optim.Adagrad semantics."""

from __future__ import annotations

import torch

from lightning_fastopt.functional import fused_adagrad_
from lightning_fastopt.ops.rounding import ADAGRAD_ROUNDINGS, check_rounding, check_torch_sqrt
from lightning_fastopt.optim.base import Bucket, FusedOptimizer, check_lr, check_range


class FusedAdagrad(FusedOptimizer):
    """Adagrad with torch.optim.Adagrad's formula; state created at construction, as torch does.

    Every torch.optim.Adagrad keyword is accepted; ``foreach``/``fused`` have no effect and
    ``differentiable=True`` raises.  State per parameter: ``step``, ``sum`` (float32).

    Rounding: every operation rounds as torch.optim.Adagrad's default CPU step rounds, with
    the IEEE square root; ``torch_sqrt=True`` (CPU) takes torch's CPU square root (MKL's,
    not correctly rounded), for torch's bits exactly, as :class:`FusedAdam`'s does.  The
    fastopt strategies set it for a ``torch.optim.Adagrad`` whose parameters are on the CPU.
    ``rounding="torch_cuda_fused"`` follows torch's fused CUDA kernel instead, which computes
    in double between float loads and stores (:mod:`lightning_fastopt.ops.rounding`); the
    strategies pick it for a CUDA ``torch.optim.Adagrad(fused=True)``, and
    ``"torch_cuda_for_loop"`` (torch's CUDA step with ``foreach=False``, its ``addcdiv`` one
    fused multiply-add) for one with ``foreach=False``.
    """

    kernel_piece = "adagrad"
    steps_pieces = True
    reads_grad_factors = True

    state_keys = ("sum",)

    def __init__(self, params, lr=1e-2, lr_decay: float = 0.0, weight_decay: float = 0.0,
                 initial_accumulator_value: float = 0.0, eps: float = 1e-10, *, foreach: bool | None = None,
                 maximize: bool = False, differentiable: bool = False, fused: bool | None = None,
                 torch_sqrt: bool = False, rounding: str = "torch_cpu") -> None:
        defaults = dict(lr=lr, lr_decay=lr_decay, weight_decay=weight_decay,
                        initial_accumulator_value=initial_accumulator_value, eps=eps, foreach=foreach,
                        maximize=maximize, differentiable=False, fused=fused, torch_sqrt=bool(torch_sqrt),
                        rounding=rounding)
        self._validate_group(defaults)
        super().__init__(params, defaults, foreach=foreach, fused=fused, differentiable=differentiable)
        for group in self.param_groups:
            shared_step = torch.zeros((), dtype=torch.float32)
            for p in group["params"]:
                st = self.state[p]
                if not st:
                    self._init_state(group, p, st)
                    st["step"] = shared_step

    def _validate_group(self, group) -> None:
        check_lr(group["lr"])
        check_range("lr_decay", group["lr_decay"], 0.0)
        check_range("weight_decay", group["weight_decay"], 0.0)
        check_range("initial_accumulator_value", group["initial_accumulator_value"], 0.0)
        check_range("eps", group["eps"], 0.0)
        rounding = check_rounding(group.get("rounding", "torch_cpu"), ADAGRAD_ROUNDINGS)
        check_torch_sqrt(group.get("torch_sqrt", False), rounding)

    def _init_state(self, group, p, state) -> None:
        state["sum"] = torch.full_like(p, group["initial_accumulator_value"], dtype=torch.float32,
                                       memory_format=torch.contiguous_format)

    def _update(self, group, b: Bucket, grad_scale, context) -> None:
        fused_adagrad_(b.params, b.grads, b.states["sum"], step=b.step, lr=group["lr"], lr_decay=group["lr_decay"],
                       weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"],
                       grad_scale=grad_scale, param_copies=b.copies, found_inf=b.found_inf,
                       torch_sqrt=group.get("torch_sqrt", False), rounding=group.get("rounding", "torch_cpu"),
                       grad_factors=self.grad_factors)
