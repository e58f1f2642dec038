"""The pure-PyTorch backend: the same low-level functions as the compiled extension.

Used when the extension cannot be built, when ``LIGHTNING_FASTOPT_BACKEND=torch``, for
tensors the CPU kernels do not take (non-contiguous ones), and for CUDA tensors until
the CUDA kernels are built.  Scalars arrive already resolved by lightning_fastopt.functional;
the math mirrors csrc/cpu/*.cpp operation for operation, in float32.
"""

from __future__ import annotations

import torch

from lightning_fastopt.ops.rounding import ROUNDINGS, float_reciprocal, sgd_one_minus_dampening

isa = "torch"


def _f32(tensors):
    return [t if t.dtype == torch.float32 else t.float() for t in tensors]


def _scaled_grads(grads, factor: float):
    """float32 copies of the gradients times factor (the user's grads are not modified)."""
    return torch._foreach_mul(_f32(grads), factor)


def times_factors(grads, grad_factors):
    """The gradients (of one device) multiplied by each of ``grad_factors`` in turn, in their
    dtype, as copies: what ``torch._foreach_mul_`` by each (a float32 tensor, as clipping
    passes its coefficient) would leave in them; the gradients themselves without any."""
    for f in grad_factors:
        grads = torch._foreach_mul(list(grads), torch.tensor(f, dtype=torch.float32, device=grads[0].device))
    return grads


def _check_factors(grad_factors, check_finite) -> None:
    if grad_factors and check_finite:
        raise ValueError("check_finite reads the gradients before grad_factors: pass one or the other")


def _finish(params, work, copies) -> None:
    """Write float32 working copies back to half-precision params, and fill param copies."""
    for p, w in zip(params, work):
        if p is not w:
            p.copy_(w)
    if copies is not None:
        for c, w in zip(copies, work):
            c.copy_(w)


def all_finite(tensors) -> bool:
    tensors = [t for t in tensors if t.numel()]
    if not tensors:
        return True
    return bool(torch.stack([torch.isfinite(t).all() for t in tensors]).all())


def sum_squares(tensors) -> list[float]:
    if not tensors:
        return []
    sums = torch.stack([t.double().square().sum() for t in tensors])
    return sums.tolist()


_BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16,
         torch.float64: torch.int64}
_MIX = (0xBF58476D1CE4E5B9 - 2**64, 0x94D049BB133111EB - 2**64)  # SplitMix64's multipliers, as int64


def _shift_right(z, k: int):
    """Logical right shift of int64 (torch's >> keeps the sign)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def fingerprint(tensors) -> torch.Tensor:
    """Per-tensor int64 fingerprints of the elements' bits, on the tensors' device: the
    sum, wrapping at 2**64, of SplitMix64(bits ^ (index << 32)) over each tensor's
    elements in row-major order (bits zero-extended; index counted modulo 2**32).
    SplitMix64 is a bijection, so changing one element always changes the sum; several
    changes go unseen only when their mixed differences cancel, a 2**-64 coincidence for
    writes that are not built to do it.  The CUDA kernels compute the same values."""
    sums = []
    for t in tensors:
        flat = t.detach().reshape(-1)
        bits = flat.view(_BITS[flat.dtype]).to(torch.int64)
        if flat.element_size() < 8:
            bits &= (1 << (8 * flat.element_size())) - 1
        z = bits ^ (torch.arange(flat.numel(), dtype=torch.int64, device=flat.device) << 32)
        z = (z ^ _shift_right(z, 30)) * _MIX[0]
        z = (z ^ _shift_right(z, 27)) * _MIX[1]
        sums.append((z ^ _shift_right(z, 31)).sum())
    if not sums:
        return torch.empty(0, dtype=torch.int64)
    return torch.stack(sums)


# ---------------------------------------------------------------------- stochastic rounding
_M32 = 0xFFFFFFFF


def _lowbias32(x):
    """A 32-bit integer hash (Chris Wellons' lowbias32), on ints or int64 tensors of uint32 values."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def stochastic_noise(numel: int, step_seed: int, k: int, device=None, first: int = 0) -> torch.Tensor:
    """The 16 bits of noise (int64) added below the bfloat16 mantissa of each element of
    state ``k`` before truncation, as csrc/cpu/vec.h computes them: element i's is the top
    half of ``i * 0x9E3779B1 + seed_k`` with ``seed_k = lowbias32(step_seed + 0x632BE5AB
    * (k + 1))`` (all modulo 2**32): a Weyl sequence over the elements, offset per step.
    ``first``: the index of the first element in its whole tensor (a piece of one)."""
    seed_k = _lowbias32((step_seed + 0x632BE5AB * (k + 1)) & _M32)
    i = (torch.arange(numel, dtype=torch.int64, device=device) + first) & _M32
    return (((i * 0x9E3779B1) + seed_k) & _M32) >> 16


def round_bf16_stochastic(x: torch.Tensor, step_seed: int, k: int, first: int = 0) -> torch.Tensor:
    """float32 ``x`` to bfloat16 with stochastic rounding (unbiased: up with probability
    the fraction of the bfloat16 step above the value below); NaN stays NaN.  ``first``:
    the index of ``x``'s first element in its whole tensor (a piece of one)."""
    flat = x.detach().reshape(-1).float()
    bits = flat.view(torch.int32).to(torch.int64) & _M32
    r = (((bits + stochastic_noise(flat.numel(), step_seed, k, flat.device, first)) & _M32) >> 16)
    r = torch.where(torch.isnan(flat), torch.full_like(r, 0x7FC0), r)
    r = torch.where(r >= 0x8000, r - 0x10000, r)  # as a signed 16-bit pattern
    return r.to(torch.int16).view(torch.bfloat16).reshape(x.shape)


def _lerp_(dst, src, weight: float) -> None:
    torch._foreach_lerp_(dst, src, weight)


def adam_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, copies, lr, beta1, beta2, eps,
          weight_decay, step_size, bias_correction2_sqrt, inv_grad_scale, amsgrad, adamw, maximize,
          check_finite, state_seed: int = 0, decay: float | None = None, torch_sqrt: bool = False,
          rounding: int = 0, *, index_bases: list[int] | None = None, grad_factors=()) -> bool:
    """torch.optim.Adam/AdamW's foreach step, op for op, on the tensors' device (``decay``:
    AdamW's factor ``1 - lr * weight_decay`` as the caller computed it from the exact lr, by
    default from ``lr``), with the IEEE square root or (``torch_sqrt``) torch's: the bits of
    ``rounding`` 0 (torch's CPU step) on the CPU and of 1 (CUDA foreach) and 4 (CUDA for-loop,
    its bias correction through its reciprocal) on CUDA; the other pairs (a fallback:
    the compiled kernels follow every rounding everywhere; 3, torch's CPU fused kernel,
    differs from 0 in each tensor's last numel % 8 elements) come within an ulp per step.
    ``index_bases``: each tensor's first element's index in its whole tensor (pieces of one),
    for the bfloat16 state's stochastic rounding; ``grad_factors``: see :func:`times_factors`."""
    _check_factors(grad_factors, check_finite)
    if decay is None:
        decay = 1 - lr * weight_decay
    if check_finite and not all_finite(grads):
        return True
    if not params:
        return False
    grads = times_factors(grads, grad_factors)
    if any(m.dtype == torch.bfloat16 for m in exp_avgs):  # bfloat16 state: float32 working copies
        if amsgrad or any(p.dtype != torch.float32 for p in params):
            raise TypeError("bfloat16 Adam state needs float32 params (masters) and amsgrad=False")
        stored = (list(exp_avgs), list(exp_avg_sqs))
        exp_avgs, exp_avg_sqs = _f32(exp_avgs), _f32(exp_avg_sqs)
        _adam_f32(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, copies, decay, beta1, beta2, eps,
                  weight_decay, step_size, bias_correction2_sqrt, inv_grad_scale, amsgrad, adamw, maximize, False,
                  rounding)
        bases = index_bases or [0] * len(params)
        for k, (kept, work) in enumerate(zip(stored, (exp_avgs, exp_avg_sqs))):
            for t, w, base in zip(kept, work, bases):
                if t is not w:
                    t.copy_(round_bf16_stochastic(w, state_seed, k, base))
        return False
    _adam_f32(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, copies, decay, beta1, beta2, eps,
              weight_decay, step_size, bias_correction2_sqrt, inv_grad_scale, amsgrad, adamw, maximize, torch_sqrt,
              rounding)
    return False


def _adam_f32(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, copies, decay, beta1, beta2, eps,
              weight_decay, step_size, bias_correction2_sqrt, inv_grad_scale, amsgrad, adamw, maximize,
              torch_sqrt, rounding) -> None:
    work = _f32(params)
    g = _scaled_grads(grads, -inv_grad_scale if maximize else inv_grad_scale)
    if weight_decay != 0:
        if adamw:
            torch._foreach_mul_(work, decay)
        else:
            torch._foreach_add_(g, work, alpha=weight_decay)
    _lerp_(exp_avgs, g, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, g, g, 1 - beta2)
    second = exp_avg_sqs
    if amsgrad:
        torch._foreach_maximum_(max_exp_avg_sqs, exp_avg_sqs)
        second = max_exp_avg_sqs
    # torch's CPU square root (MKL's where torch has it), or the IEEE one (correctly rounded
    # from the double root: a float's square root rounds once either way)
    denom = torch._foreach_sqrt(second) if torch_sqrt else [t.double().sqrt_().float() for t in second]
    if ROUNDINGS[rounding] == "torch_cuda_for_loop":  # CUDA's division by a host scalar
        torch._foreach_mul_(denom, float_reciprocal(bias_correction2_sqrt))
    else:  # one scalar a tensor, as torch's foreach step passes them: ATen's CUDA foreach division
        # by a single scalar multiplies by its reciprocal (ForeachBinaryOpScalar.cu), by a list it
        # divides (the CPU divides either way); the one-scalar form missed torch's CUDA foreach
        # bits by an ulp (H200, 2026-11-28, test_rounding.py's pytorch_fallback cases)
        torch._foreach_div_(denom, [bias_correction2_sqrt] * len(denom))
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(work, exp_avgs, denom, value=-step_size)
    _finish(params, work, copies)


def sgd_(params, grads, momentum_buffers, copies, lr, momentum, dampening, weight_decay, inv_grad_scale,
         nesterov, maximize, wd_after_momentum, first_step, check_finite, rounding: int = 0, *,
         grad_factors=()) -> bool:
    """torch.optim.SGD's foreach step, op for op: the bits of ``rounding`` 0 (torch's CPU
    step, and its CUDA foreach step); with 2 (torch's CUDA fused kernel) its factor
    ``1 - dampening`` (in float32), and with 3 (torch's CPU fused kernel) each tensor's last
    numel % 8 elements, or with 2, maximize and no decay tensors of numel % 4 == 0, come
    within an ulp per step (a fallback: the compiled kernels follow these too)."""
    _check_factors(grad_factors, check_finite)
    if check_finite and not all_finite(grads):
        return True
    if not params:
        return False
    work = _f32(params)
    g = _scaled_grads(times_factors(grads, grad_factors), -inv_grad_scale if maximize else inv_grad_scale)
    if weight_decay != 0 and not wd_after_momentum:
        torch._foreach_add_(g, work, alpha=weight_decay)
    if momentum != 0:
        if first_step:
            torch._foreach_copy_(momentum_buffers, g)
        else:
            torch._foreach_mul_(momentum_buffers, momentum)
            torch._foreach_add_(momentum_buffers, g, alpha=sgd_one_minus_dampening(dampening, ROUNDINGS[rounding]))
        if nesterov:
            torch._foreach_add_(g, momentum_buffers, alpha=momentum)
        else:
            g = [b.clone() for b in momentum_buffers] if weight_decay != 0 and wd_after_momentum else momentum_buffers
    if weight_decay != 0 and wd_after_momentum:
        torch._foreach_add_(g, work, alpha=weight_decay)
    torch._foreach_add_(work, g, alpha=-lr)
    _finish(params, work, copies)
    return False


def adagrad_(params, grads, state_sums, copies, clr, weight_decay, eps, inv_grad_scale, maximize,
             check_finite, torch_sqrt: bool = False, rounding: int = 0, *, grad_factors=()) -> bool:
    """torch.optim.Adagrad's default CPU step, op for op, with the IEEE square root or
    (``torch_sqrt``) torch's: the bits of ``rounding`` 0 (its CPU step and CUDA foreach step)
    on either device, and of 4 (its CUDA for-loop step, ``addcdiv`` one fused multiply-add)
    on CUDA; 4 on the CPU, and 2 (torch's fused CUDA kernel, in double), within an ulp per
    step (a fallback)."""
    _check_factors(grad_factors, check_finite)
    if check_finite and not all_finite(grads):
        return True
    if not params:
        return False
    work = _f32(params)
    g = _scaled_grads(times_factors(grads, grad_factors), -inv_grad_scale if maximize else inv_grad_scale)
    if weight_decay != 0:
        torch._foreach_add_(g, work, alpha=weight_decay)
    torch._foreach_addcmul_(state_sums, g, g, 1.0)
    # torch's CPU square root, or the IEEE one (the float64 root of a float32 rounds to it)
    std = torch._foreach_sqrt(state_sums) if torch_sqrt else [s.double().sqrt_().float() for s in state_sums]
    torch._foreach_add_(std, eps)
    if ROUNDINGS[rounding] == "torch_cuda_for_loop":
        torch._foreach_addcdiv_(work, g, std, value=-clr)
    else:  # as torch's CPU addcdiv on either device: (-clr * g) / std, then the sum
        step = torch._foreach_mul(g, -clr)
        torch._foreach_div_(step, std)
        torch._foreach_add_(work, step)
    _finish(params, work, copies)
    return False


def lion_(params, grads, exp_avgs, copies, lr, beta1, beta2, weight_decay, inv_grad_scale, maximize,
          check_finite, *, grad_factors=()) -> bool:
    _check_factors(grad_factors, check_finite)
    if check_finite and not all_finite(grads):
        return True
    if not params:
        return False
    work = _f32(params)
    g = _scaled_grads(times_factors(grads, grad_factors), -inv_grad_scale if maximize else inv_grad_scale)
    if weight_decay != 0:
        torch._foreach_mul_(work, 1 - lr * weight_decay)
    c = [m.clone() for m in exp_avgs]
    _lerp_(c, g, 1 - beta1)
    torch._foreach_add_(work, torch._foreach_sign(c), alpha=-lr)
    _lerp_(exp_avgs, g, 1 - beta2)
    _finish(params, work, copies)
    return False


def _lamb_update(work, exp_avgs, exp_avg_sqs, bias_correction1, bias_correction2, eps, weight_decay,
                 adam_w_mode):
    num = torch._foreach_mul(exp_avgs, 1.0 / bias_correction1)
    den = torch._foreach_mul(exp_avg_sqs, 1.0 / bias_correction2)
    torch._foreach_sqrt_(den)
    torch._foreach_add_(den, eps)
    torch._foreach_div_(num, den)
    if adam_w_mode and weight_decay != 0:
        torch._foreach_add_(num, work, alpha=weight_decay)
    return num


def _lamb_moments(work, grads, exp_avgs, exp_avg_sqs, beta1, beta2, beta3, weight_decay, grad_factor, adam_w_mode,
                  maximize) -> None:
    """Advance LAMB's moments in place (``exp_avgs``, ``exp_avg_sqs``: lists of tensors)."""
    g = _scaled_grads(grads, -grad_factor if maximize else grad_factor)
    if not adam_w_mode and weight_decay != 0:
        torch._foreach_add_(g, work, alpha=weight_decay)
    torch._foreach_mul_(exp_avgs, beta1)
    torch._foreach_add_(exp_avgs, g, alpha=beta3)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, g, g, 1 - beta2)


def lamb_norms_(params, grads, exp_avgs, exp_avg_sqs, beta1, beta2, beta3, eps, weight_decay, bias_correction1,
                bias_correction2, grad_factor, adam_w_mode, maximize) -> torch.Tensor:
    """Per tensor (||p||^2, ||u||^2) of the update :func:`lamb_` would make, nothing written
    (float64, shape [n, 2]); one tensor at a time (the temporaries: a few of the largest,
    not a copy of the whole state)."""
    sums = []
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs):
        work = _f32([p])
        m, v = [m.clone()], [v.clone()]
        _lamb_moments(work, [g], m, v, beta1, beta2, beta3, weight_decay, grad_factor, adam_w_mode, maximize)
        update = _lamb_update(work, m, v, bias_correction1, bias_correction2, eps, weight_decay, adam_w_mode)
        sums.append((sum_squares(work)[0], sum_squares(update)[0]))
    return torch.tensor(sums, dtype=torch.float64).reshape(-1, 2)


def lamb_(params, grads, exp_avgs, exp_avg_sqs, copies, lr, beta1, beta2, beta3, eps, weight_decay,
          bias_correction1, bias_correction2, grad_factor, adam_w_mode, use_trust_ratio, maximize, *,
          norms=None) -> None:
    if not params:
        return
    work = _f32(params)
    _lamb_moments(work, grads, exp_avgs, exp_avg_sqs, beta1, beta2, beta3, weight_decay, grad_factor, adam_w_mode,
                  maximize)
    update = _lamb_update(work, exp_avgs, exp_avg_sqs, bias_correction1, bias_correction2, eps, weight_decay,
                          adam_w_mode)
    if norms is None:
        p_norms, u_norms = sum_squares(work), sum_squares(update)
    else:  # over the whole tensors (these are pieces of them)
        p_norms, u_norms = norms[:, 0].tolist(), norms[:, 1].tolist()
    for w, u, ps, us in zip(work, update, p_norms, u_norms):
        ratio = (ps ** 0.5) / (us ** 0.5) if use_trust_ratio and ps > 0 and us > 0 else 1.0
        w.add_(u, alpha=-lr * ratio)
    _finish(params, work, copies)


def lars_(params, grads, momentum_buffers, copies, lr, momentum, eeta, weight_decay, epsilon, inv_grad_scale,
          maximize, check_finite, *, norms=None) -> bool:
    if check_finite and not all_finite(grads):
        return True
    if not params:
        return False
    work = _f32(params)
    g_sq, p_sq = (sum_squares(grads), sum_squares(work)) if norms is None else (norms[:, 0].tolist(),
                                                                               norms[:, 1].tolist())
    g_norms = [s ** 0.5 * inv_grad_scale for s in g_sq]
    p_norms = [s ** 0.5 for s in p_sq]
    g = _scaled_grads(grads, -inv_grad_scale if maximize else inv_grad_scale)
    torch._foreach_add_(g, work, alpha=weight_decay)
    torch._foreach_mul_(momentum_buffers, momentum)
    torch._foreach_add_(momentum_buffers, g)
    for w, buf, pn, gn in zip(work, momentum_buffers, p_norms, g_norms):
        local = eeta * pn / (gn + weight_decay * pn + epsilon) if pn > 0 and gn > 0 else 1.0
        w.add_(buf, alpha=-lr * local)
    _finish(params, work, copies)
    return False
