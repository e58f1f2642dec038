"""FusedAdam (Adam/AdamW, amsgrad) and CPUAdam (DeepSpeedCPUAdam's signature)."""

from __future__ import annotations

from typing import Any

import torch

from lightning_fastopt.functional import fused_adam_
from lightning_fastopt.ops.cpu_kernels import adam_pieces
from lightning_fastopt.ops.rounding import check_rounding, check_rounding_device, check_torch_sqrt
from lightning_fastopt.optim.base import Bucket, FusedOptimizer, check_betas, check_lr, check_range


class FusedAdam(FusedOptimizer):
    """Adam and AdamW in one fused pass per step, with torch.optim.Adam's formula.

    Defaults differ from torch's (apex's and DeepSpeed's signature): ``weight_decay=0``
    where torch.optim.AdamW has 0.01, and decoupled decay (``adamw_mode=True``) where
    torch.optim.Adam adds it to the gradient.  Pass both when replacing a torch class.

    ``adamw_mode=True`` (default) applies decoupled weight decay (AdamW), False adds
    ``weight_decay * p`` to the gradient (Adam).  It is stored in ``param_groups`` under
    torch's key ``decoupled_weight_decay`` so that state dicts load into torch.optim.Adam /
    AdamW and back; ``decoupled_weight_decay``, when given, sets it.  ``bias_correction``
    False drops Adam's bias corrections.  ``amsgrad`` keeps ``max_exp_avg_sq``.

    Every torch.optim.Adam keyword is accepted: ``maximize`` works as in torch, a tensor
    ``lr`` is read each step, ``foreach``/``fused`` have no effect (this is always fused);
    ``differentiable=True`` raises.  ``capturable=True`` (CUDA parameters only) keeps the
    step counts on the GPU, where the CUDA kernels read them together with a tensor
    ``lr`` on that device: a step never waits for the GPU and can be captured in a CUDA
    graph, as with torch.optim.Adam(capturable=True).

    State per parameter (float32): ``step``, ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``.
    ``state_dtype=torch.bfloat16`` keeps ``exp_avg`` and ``exp_avg_sq`` in bfloat16 (float32
    CPU parameters, no amsgrad): 4 bytes per parameter instead of 8, stored with stochastic
    rounding (unbiased; the noise is a function of the step and the element, so results
    are reproducible), computed in float32 as before.  This changes the math (the moments
    carry 8 bits of mantissa): opt in knowingly.  :meth:`state_dict` saves them as float32.

    Rounding: every operation rounds as torch.optim.Adam/AdamW's default CPU step rounds
    (the same operations in the same order, the fused multiply-adds of ATen's kernels),
    with the IEEE square root.  torch's CPU square root is MKL's where torch has MKL, which
    is not correctly rounded; ``torch_sqrt=True`` (CPU) takes that one, for torch's bits
    exactly, at about 1.7x the step time (still 4x faster than torch's default step on 2
    cores).  The fastopt strategies set it for a
    ``torch.optim.Adam``/``AdamW`` whose parameters are on the CPU.

    ``rounding`` names the torch implementation whose roundings the step follows, on the
    CPU and on the GPU alike: ``"torch_cpu"`` (default), ``"torch_cuda_foreach"`` (torch's
    default on CUDA), ``"torch_cuda_for_loop"`` (``foreach=False`` on CUDA),
    ``"torch_cuda_fused"`` (``fused=True`` on CUDA) or ``"torch_cpu_fused"`` (``fused=True`` on
    the CPU; CPU parameters only), see :mod:`lightning_fastopt.ops.rounding`.
    The fastopt strategies pick the one the user's torch optimizer would have run, so that
    an offloaded run ends on its bits.
    """

    kernel_piece = "adam"
    steps_pieces = True
    reads_grad_factors = True

    def kernel_pieces(self) -> frozenset[str]:
        return frozenset().union(*(adam_pieces(self._with_own_keys(g).get("rounding", "torch_cpu"))
                                   for g in self.param_groups))

    state_keys = ("exp_avg", "exp_avg_sq")
    supports_capturable = True
    state_dtype = torch.float32  # of exp_avg and exp_avg_sq (siblings built without __init__ get this)

    def __init__(self, params, lr=1e-3, bias_correction: bool = True, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, amsgrad: bool = False, adamw_mode: bool = True, *,
                 maximize: bool = False, foreach: bool | None = None, fused: bool | None = None,
                 capturable: bool = False, differentiable: bool = False,
                 decoupled_weight_decay: bool | None = None, state_dtype: torch.dtype = torch.float32,
                 torch_sqrt: bool = False, rounding: str = "torch_cpu") -> None:
        if decoupled_weight_decay is not None:
            adamw_mode = bool(decoupled_weight_decay)
        self.state_dtype = check_state_dtype(state_dtype, amsgrad)
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=check_betas(betas), eps=eps,
                        weight_decay=weight_decay, amsgrad=amsgrad, decoupled_weight_decay=adamw_mode,
                        maximize=maximize, foreach=foreach, fused=fused, capturable=bool(capturable),
                        differentiable=False, torch_sqrt=bool(torch_sqrt), rounding=rounding)
        self._validate_group(defaults)
        super().__init__(params, defaults, foreach=foreach, fused=fused, capturable=capturable,
                         differentiable=differentiable)

    def _normalize_group(self, group: dict[str, Any]) -> dict[str, Any]:
        if "adamw_mode" in group:
            group["decoupled_weight_decay"] = bool(group.pop("adamw_mode"))
        return group

    def _validate_group(self, group: dict[str, Any]) -> None:
        check_lr(group["lr"])
        check_betas(group["betas"])
        check_range("eps", group["eps"], 0.0)
        check_range("weight_decay", group["weight_decay"], 0.0)
        rounding = check_rounding(group.get("rounding", "torch_cpu"))
        check_rounding_device(rounding, group.get("params", ()))
        check_torch_sqrt(group.get("torch_sqrt", False), rounding)

    def _init_state(self, group, p, state) -> None:
        super()._init_state(group, p, state)
        if self.state_dtype != torch.float32:
            if group["amsgrad"] or p.device.type != "cpu" or p.dtype != torch.float32:
                raise ValueError(f"state_dtype={self.state_dtype} is for float32 CPU parameters without amsgrad, got "
                                 f"a {p.dtype} parameter on {p.device} (amsgrad={group['amsgrad']})")
            for key in self.state_keys:
                state[key] = state[key].to(self.state_dtype)
        if group["amsgrad"]:
            state["max_exp_avg_sq"] = self._zeros(p)

    def state_dict(self) -> dict[str, Any]:
        """torch's form; bfloat16 moments (``state_dtype``) are saved as float32, which every
        Adam loads."""
        sd = super().state_dict()
        if self.state_dtype != torch.float32:
            sd["state"] = {i: {k: v.float() if k in self.state_keys and isinstance(v, torch.Tensor) else v
                               for k, v in st.items()} for i, st in sd["state"].items()}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        if self.state_dtype != torch.float32:  # torch casts the moments to the parameters' dtype
            for st in self.state.values():
                for key in self.state_keys:
                    if key in st:
                        st[key] = st[key].to(self.state_dtype)

    @staticmethod
    def _zeros(p):
        return torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)

    def _bucket_state_keys(self, group) -> tuple[str, ...]:
        return self.state_keys + (("max_exp_avg_sq",) if group["amsgrad"] else ())

    def _buckets(self, group):
        if self._switched_on(group, "amsgrad"):
            # amsgrad may be switched on after the state was created: start the maxima at zero
            for p in group["params"]:
                st = self.state.get(p)
                if st and "max_exp_avg_sq" not in st:
                    st["max_exp_avg_sq"] = self._zeros(p)
        return super()._buckets(group)

    def _update(self, group, b: Bucket, grad_scale, context) -> None:
        beta1, beta2 = group["betas"]
        fused_adam_(b.params, b.grads, b.states["exp_avg"], b.states["exp_avg_sq"], b.states.get("max_exp_avg_sq"),
                    step=b.step, lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                    weight_decay=group["weight_decay"], amsgrad=group["amsgrad"],
                    adamw_mode=group["decoupled_weight_decay"], maximize=group["maximize"],
                    bias_correction=group["bias_correction"], grad_scale=grad_scale,
                    param_copies=b.copies, found_inf=b.found_inf, torch_sqrt=group.get("torch_sqrt", False),
                    rounding=group.get("rounding", "torch_cpu"), index_bases=self._index_bases(b.params),
                    grad_factors=self.grad_factors)


def check_state_dtype(state_dtype: Any, amsgrad: bool = False) -> torch.dtype:
    """``state_dtype`` as a torch dtype (``torch.float32``/``torch.bfloat16`` or their names);
    anything else, or bfloat16 with amsgrad, is a ValueError naming it."""
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, torch.float32: torch.float32,
              torch.bfloat16: torch.bfloat16}
    try:
        dtype = dtypes[state_dtype]
    except (KeyError, TypeError):
        raise ValueError(f"state_dtype must be torch.float32 or torch.bfloat16 (or 'float32'/'bfloat16'), "
                         f"got {state_dtype!r}") from None
    if dtype != torch.float32 and amsgrad:
        raise ValueError("state_dtype=torch.bfloat16 is for amsgrad=False")
    return dtype


class CPUAdam(FusedAdam):
    """FusedAdam with DeepSpeed's ``DeepSpeedCPUAdam`` signature: switch by changing one import.

    ``fp32_optimizer_states=False`` (half-precision state) is not supported: state is
    always float32 here, and asking for anything else raises.
    """

    def __init__(self, model_params, lr=1e-3, bias_correction: bool = True, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, amsgrad: bool = False, adamw_mode: bool = True,
                 fp32_optimizer_states: bool = True) -> None:
        if not fp32_optimizer_states:
            raise ValueError("CPUAdam keeps optimizer state in float32; fp32_optimizer_states=False is not supported")
        super().__init__(model_params, lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                         weight_decay=weight_decay, amsgrad=amsgrad, adamw_mode=adamw_mode)
