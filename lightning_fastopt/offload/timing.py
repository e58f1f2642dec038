"""Per-step wall-clock breakdown of the offload optimizer (``wall_clock_breakdown``).

Timing a phase waits for the device before and after it, so the numbers are honest but
the overlap they measure is removed while timing is on: use it to diagnose, not to train.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

# cpu_step: the CPU updates the step waited for; cpu_step_background: the CPU time of those
# that ran on the worker thread (during backward with stream_cpu_step, during the next
# forward and backward with delayed_update), timed on the host without synchronizing
PHASES = ("grad_d2h", "gpu_step", "cpu_step", "param_h2d", "cpu_step_background")


class StepTimer:
    def __init__(self, enabled: bool, synchronize: Callable[[], None]) -> None:
        self.enabled = enabled
        self._synchronize = synchronize
        self.last: dict[str, float] = {}  # milliseconds per phase of the last step
        self._current: dict[str, float] = {}

    def start_step(self) -> None:
        self._current = dict.fromkeys(PHASES, 0.0)

    def now(self) -> float:
        """The host's clock in seconds while timing is on, else 0.0: an untimed run reads no
        clock (user code may mock ``time.perf_counter``, as Lightning's throughput tests do)."""
        return time.perf_counter() if self.enabled else 0.0

    def add(self, name: str, ms: float) -> None:
        """Time measured elsewhere (the streamed updates, before the step started)."""
        if self.enabled:
            self._current[name] = self._current.get(name, 0.0) + ms

    def end_step(self) -> None:
        if self.enabled:
            self.last = self._current

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        self._synchronize()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._synchronize()
            self._current[name] = self._current.get(name, 0.0) + (time.perf_counter() - t0) * 1e3
