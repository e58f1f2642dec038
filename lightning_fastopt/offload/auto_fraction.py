"""``offload_fraction="auto"``: the offload fraction chosen from the first steps' measurements.

The run starts with everything offloaded (the least accelerator memory, and every CPU
cost measured whole).  After :data:`PROBE_SKIP` steps (allocations, first kernel loads)
:class:`FractionProbe` measures :data:`PROBE_STEPS` more, each timed on a synchronized
device: the forward and backward of the step (the closure), and the CPU update per
offloaded element (the optimizer's ``wall_clock_breakdown``), and the peak device memory.
:func:`choose_fraction` then picks, among fractions 0, 0.01, ..., 1 (rounded to whole
tensors as :func:`~lightning_fastopt.offload.partition.choose_offloaded` rounds them):

- the largest whose CPU update hides behind the accelerator's work: its offloaded
  elements times the CPU time per element fit in the compute that runs meanwhile, which
  depends on how the step runs:

  - the exact step (default): nothing, the CPU update starts when backward has ended, so
    the fraction is 0 unless memory asks for more;
  - ``stream_cpu_step``: backward, taken as :data:`BACKWARD_SHARE` of the measured
    forward and backward (backward does about twice the forward's arithmetic);
  - ``delayed_update``: the next step's forward and backward (every micro-batch of it);

- with ``gpu_memory_budget_gb``: the smallest whose predicted peak fits the budget (the
  measured peak at fraction 1, plus what each parameter kept on the accelerator adds
  there: its optimizer state as measured, a float32 master for a half-precision weight,
  and its gradient when offloaded gradients are freed during backward);

and takes the larger of the two: hidden and within budget when it can be, else within
budget.  The choice and its reasons are logged; the optimizer is then rebuilt with that
fraction (:meth:`~lightning_fastopt.offload.OffloadOptimizer.with_fraction`: the same
state, so the run computes what it would have computed at any fraction).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import Tensor

from lightning_fastopt.offload.delayed import DelayedStep
from lightning_fastopt.offload.partition import choose_offloaded
from lightning_fastopt.offload.speculative import SpeculativeStep
from lightning_fastopt.offload.state_places import state_places
from lightning_fastopt.offload.streamed import StreamedStep

PROBE_SKIP = 2  # steps not measured
PROBE_STEPS = 3  # steps measured
BACKWARD_SHARE = 2 / 3  # of forward + backward (an estimate: backward does about twice the forward's arithmetic)
GRID = tuple(i / 100 for i in range(101))
HIDE_MODES = ("exact", "streamed", "delayed")


@dataclass
class ProbeResult:
    compute_ms: float  # forward and backward of one step (median)
    cpu_ns_per_element: float  # the CPU update per offloaded element (median)
    peak_bytes: int | None = None  # the accelerator's peak memory at fraction 1 (None on a CPU run)


@dataclass
class FractionProbe:
    """The measurements of the probe steps, one call of :meth:`add` per optimizer step."""

    skip: int = PROBE_SKIP
    steps: int = PROBE_STEPS
    seen: int = 0
    compute_ms: list[float] = field(default_factory=list)
    cpu_ns: list[float] = field(default_factory=list)

    @property
    def measuring(self) -> bool:
        """Whether the step about to run is measured."""
        return self.skip <= self.seen < self.skip + self.steps

    @property
    def done(self) -> bool:
        return self.seen >= self.skip + self.steps

    def add(self, compute_ms: float | None, step_times: dict[str, float] | None, offloaded_numel: int) -> None:
        """One optimizer step: its forward and backward time and the optimizer's phases
        (None for a step that did not run, such as one skipped for an fp16 overflow: it
        is measured again)."""
        if self.measuring:
            if compute_ms is None or not step_times or not offloaded_numel:
                return
            cpu_ms = step_times.get("cpu_step", 0.0) + step_times.get("cpu_step_background", 0.0)
            self.compute_ms.append(compute_ms)
            self.cpu_ns.append(cpu_ms * 1e6 / offloaded_numel)
        self.seen += 1

    def result(self, peak_bytes: int | None = None) -> ProbeResult:
        return ProbeResult(statistics.median(self.compute_ms), statistics.median(self.cpu_ns), peak_bytes)


def choose_fraction(probe: ProbeResult, params: Sequence[Tensor], device_bytes: Callable[[Tensor], int], *,
                    hide: str, accumulate: int = 1, budget_bytes: int | None = None) -> tuple[float, str]:
    """The fraction to run at and why (see the module's documentation).  ``params``: the
    optimizer's parameters in its order; ``device_bytes(p)``: what ``p`` adds to the
    accelerator's memory when it is not offloaded; ``hide``: one of :data:`HIDE_MODES`."""
    if hide not in HIDE_MODES:
        raise ValueError(f"hide must be one of {HIDE_MODES}, got {hide!r}")
    hidden_ms = {"exact": 0.0, "streamed": BACKWARD_SHARE * probe.compute_ms,
                 "delayed": probe.compute_ms * accumulate}[hide]
    extra = [device_bytes(p) for p in params]
    rows = []  # (fraction, offloaded elements, bytes added on the device)
    for f in GRID:
        chosen = choose_offloaded(params, f)
        rows.append((f, sum(p.numel() for p, c in zip(params, chosen) if c),
                     sum(e for e, c in zip(extra, chosen) if not c)))
    hides = [f for f, n, _ in rows if n * probe.cpu_ns_per_element <= hidden_ms * 1e6]
    f_hide = max(hides)
    how = {"exact": "the exact step starts the CPU update after backward: nothing hides it",
           "streamed": f"{hidden_ms:.1f} ms of backward per step hide it (stream_cpu_step; backward taken as "
                       f"{BACKWARD_SHARE:.2f} of the measured {probe.compute_ms:.1f} ms forward and backward)",
           "delayed": f"{hidden_ms:.1f} ms of forward and backward per step hide it (delayed_update)"}[hide]
    why = [f"the CPU update took {probe.cpu_ns_per_element:.3g} ns per element; {how}: {f_hide:g} is the largest "
           "fraction it hides"]
    fraction = f_hide
    if budget_bytes is not None:
        if probe.peak_bytes is None:
            raise ValueError("gpu_memory_budget_gb needs the accelerator's peak memory (a CUDA device)")
        peak = {f: probe.peak_bytes + added for f, _, added in rows}
        fits = [f for f in GRID if peak[f] <= budget_bytes]
        budget = f"budget {budget_bytes / 2**30:.2f} GiB"
        if not fits:
            fraction = 1.0
            why.append(f"even fraction 1 needs {peak[1.0] / 2**30:.2f} GiB at its peak ({budget}): offloading "
                       "everything, the most it can do")
        else:
            fraction = max(f_hide, min(fits))
            note = "" if fraction == f_hide else ", the smallest that fits (the CPU update is not hidden)"
            why.append(f"predicted peak {peak[fraction] / 2**30:.2f} GiB at {fraction:g} ({budget}){note}")
    return fraction, "; ".join(why)


class AutoFraction:
    """What a strategy with ``offload_fraction="auto"`` does around each optimizer step of
    an :class:`~lightning_fastopt.offload.OffloadOptimizer` (one probe per optimizer):
    :meth:`closure` times forward and backward of the measured steps, :meth:`after_step`
    records the step and, once the probe is done, returns the optimizer rebuilt with the
    chosen fraction and the line that says why."""

    def __init__(self, device: torch.device, budget_gb: float | None = None, accumulate: int = 1,
                 agree: Callable[[float], float] = lambda f: f) -> None:
        self.device = device
        self.budget_bytes = None if budget_gb is None else int(budget_gb * 2**30)
        self.accumulate = accumulate
        self.agree = agree  # every rank takes the same fraction (rank 0's)
        self._probes: dict[int, FractionProbe] = {}
        self._timed: dict[int, float] = {}
        self._user_timing: dict[int, bool] = {}

    def _probe(self, optimizer) -> FractionProbe | None:
        probe = self._probes.setdefault(id(optimizer), FractionProbe())
        return None if probe.done else probe

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def closure(self, optimizer, closure: Callable[[], Any]) -> Callable[[], Any]:
        """The step's closure, timed when the step is measured (and the optimizer's phases with it)."""
        probe = self._probe(optimizer)
        if probe is None or not probe.measuring:
            return closure
        if not probe.compute_ms and self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self._user_timing[id(optimizer)] = optimizer.wall_clock_breakdown
        optimizer.wall_clock_breakdown = True

        def timed() -> Any:
            self._synchronize()
            start = time.perf_counter()
            out = closure()
            self._synchronize()
            self._timed[id(optimizer)] = (time.perf_counter() - start) * 1e3
            return out

        timed.__wrapped__ = closure  # the precision plugin reads what the closure was
        return timed

    def after_step(self, optimizer, skipped: bool):
        """Record the step; returns (the optimizer rebuilt with the chosen fraction, why)
        when the probe has just finished, else None."""
        probe = self._probe(optimizer)
        if probe is None:
            return None
        measured = probe.measuring
        compute_ms = self._timed.pop(id(optimizer), None)
        if measured:
            optimizer.wall_clock_breakdown = self._user_timing.pop(id(optimizer), False)
        ran = measured and not skipped and compute_ms is not None
        probe.add(compute_ms if ran else None, optimizer.last_step_times if ran else None, optimizer.offloaded_numel)
        if not probe.done:
            return None
        peak = torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None
        if self.budget_bytes is not None and peak is None:
            raise ValueError(f"gpu_memory_budget_gb needs a CUDA device to measure, this run is on {self.device}")
        params = list(dict.fromkeys(p for g in optimizer.param_groups for p in g["params"]))
        hide = ("delayed" if isinstance(optimizer.schedule, DelayedStep) else
                "streamed" if isinstance(optimizer.schedule, (StreamedStep, SpeculativeStep)) else "exact")
        fraction, why = choose_fraction(probe.result(peak), params, partial(_device_bytes, optimizer), hide=hide,
                                        accumulate=self.accumulate, budget_bytes=self.budget_bytes)
        fraction = self.agree(fraction)
        new = optimizer.with_fraction(fraction)
        self._probes[id(new)] = self._probes.pop(id(optimizer))  # done: the rebuilt optimizer is not probed
        pin = f"offload_fraction={float(fraction)!r} runs at it without probing"
        if hide == "delayed":  # only the offloaded share is delayed: the fraction changes the results
            pin = (f"with delayed_update the fraction is part of the math (only the offloaded share is delayed) "
                   f"and timings differ between machines: to reproduce this run, {pin}")
        said = f"offload_fraction='auto' chose {fraction:g}: {why}. {pin[0].upper()}{pin[1:]}"
        if new.layout.tier.on_disk:  # three places: the device, host memory (host_state_gib) and the disk
            said += f"\nwhere the masters and optimizer state are now:\n{state_places(new)}"
        return new, said


def _device_bytes(optimizer, param: Tensor) -> int:
    """What ``param`` adds to the accelerator when the optimizer keeps it there: its state
    (as measured), a float32 master beside a half-precision weight, and its gradient
    where offloaded gradients leave during backward."""
    state = sum(v.numel() * v.element_size() for v in optimizer.state_of(param).values()
                if isinstance(v, Tensor) and v.dim() > 0)
    master = 4 * param.numel() if param.dtype != torch.float32 else 0
    grad = param.numel() * param.element_size() if optimizer.device_grads == "copy_in_backward" else 0
    return state + master + grad
