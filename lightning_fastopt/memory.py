"""estimate_memory: how many bytes fastopt_offload keeps on the accelerator and on the CPU.

The figures are exact for what the strategy allocates per parameter (weights,
gradients, float32 masters, optimizer state, host buffers), for the same split of
parameters the strategy makes; activations, the CUDA context and allocator slack are
not included (they depend on the batch, not on the optimizer).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lightning_fastopt.offload.partition import choose_offloaded
from lightning_fastopt.core.precision import SUPPORTED_PRECISIONS

# float32 state tensors per parameter element, per optimizer
_STATE_TENSORS = {"adam": 2, "adamw": 2, "lamb": 2, "sgd": 1, "lars": 1, "lion": 1, "adagrad": 1}
_FIELDS = ("params", "grads", "master_weights", "optimizer_state", "speculation")


@dataclass
class MemoryEstimate:
    """Bytes on each side; ``gpu`` and ``cpu`` map each of ``params``, ``grads``,
    ``master_weights``, ``optimizer_state``, ``speculation`` to a byte count."""

    gpu: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_FIELDS, 0))
    cpu: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_FIELDS, 0))
    offloaded_params: int = 0
    total_params: int = 0

    @property
    def gpu_total(self) -> int:
        return sum(self.gpu.values())

    @property
    def cpu_total(self) -> int:
        return sum(self.cpu.values())

    def __str__(self) -> str:
        rows = [f"{'':16s}{'GPU':>12s}{'CPU':>12s}"]
        for k in _FIELDS:
            rows.append(f"{k:16s}{_gib(self.gpu[k]):>12s}{_gib(self.cpu[k]):>12s}")
        rows.append(f"{'total':16s}{_gib(self.gpu_total):>12s}{_gib(self.cpu_total):>12s}")
        rows.append(f"({self.offloaded_params:,} of {self.total_params:,} parameters offloaded)")
        return "\n".join(rows)


def estimate_memory(model: torch.nn.Module, offload_fraction: float = 1.0, precision: str = "16-mixed",
                    optimizer: str = "adam", amsgrad: bool = False, speculate: bool = False) -> MemoryEstimate:
    """Bytes on the accelerator ("gpu") and in host memory ("cpu") for the trainable
    parameters of ``model`` under ``fastopt_offload`` with this ``offload_fraction``.

    - weights stay on the accelerator in the model's dtype (Lightning's ``*-mixed``
      precisions keep float32 weights and cast inside autocast, so ``precision`` changes
      no byte here; it is checked against the supported flags);
    - accelerator-side parameters keep their gradients there; a float32 parameter is its
      own master, a half-precision one gets a float32 master beside it;
    - offloaded parameters: a float32 master, the optimizer state and a gradient buffer
      in host memory (plus a buffer for the model-dtype copy of a half-precision weight);
      their device gradients are freed as soon as they are copied out, so they are not
      counted on the accelerator;
    - optimizer state: float32 (float64 for float64 parameters, ``"64-true"``), 2 tensors
      per element for adam/adamw/lamb (3 with ``amsgrad``), 1 for sgd (with
      momentum)/lars/lion/adagrad;
    - ``speculate=True`` (``stream_cpu_step`` where the step checks the gradients first):
      the offloaded masters and state once more in host memory (``speculation``), kept
      aside while an update is speculated (:mod:`~lightning_fastopt.offload.speculative`).
    """
    if precision not in SUPPORTED_PRECISIONS:
        raise ValueError(f"precision must be one of {SUPPORTED_PRECISIONS}, got {precision!r}")
    key = optimizer.lower()
    if key not in _STATE_TENSORS:
        raise ValueError(f"optimizer must be one of {sorted(_STATE_TENSORS)}, got {optimizer!r}")
    state_tensors = _STATE_TENSORS[key] + (1 if amsgrad and key in ("adam", "adamw") else 0)
    params = [p for p in model.parameters() if p.requires_grad]
    chosen = choose_offloaded(params, offload_fraction)
    est = MemoryEstimate(total_params=sum(p.numel() for p in params))
    for p, offloaded in zip(params, chosen):
        n, size = p.numel(), p.element_size()
        m = 8 if p.dtype == torch.float64 else 4  # the master's (and the state's) bytes per element
        half = size < 4
        est.gpu["params"] += n * size
        if offloaded:
            est.offloaded_params += n
            est.cpu["grads"] += n * size
            est.cpu["master_weights"] += m * n + (n * size if half else 0)
            est.cpu["optimizer_state"] += m * n * state_tensors
            est.cpu["speculation"] += m * n * (1 + state_tensors) if speculate else 0
        else:
            est.gpu["grads"] += n * size
            est.gpu["master_weights"] += m * n if half else 0
            est.gpu["optimizer_state"] += m * n * state_tensors
    return est


def _gib(n: int) -> str:
    return f"{n / 2**30:.3f} GiB" if n >= 2**27 else f"{n / 2**20:.2f} MiB"
