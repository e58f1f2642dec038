"""How many CPU threads a process of a multi-process run gives the optimizer step, set and given back."""

from __future__ import annotations

import os

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info


def default_cpu_threads(processes_per_node: int) -> int:
    """The cores this process may run on, shared among the processes of this node."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, processes_per_node))


class TorchThreads:
    """torch's intra-op thread count for a run (the CPU step's threads), set at set-up and
    given back at teardown; :meth:`set` says it in one log line."""

    def __init__(self) -> None:
        self._before: int | None = None

    def set(self, threads: int | None, processes_per_node: int) -> None:
        threads = threads or default_cpu_threads(processes_per_node)
        self._before = torch.get_num_threads()
        torch.set_num_threads(threads)
        rank_zero_info(f"lightning_fastopt: {threads} CPU thread(s) per process for the optimizer step")

    def restore(self) -> None:
        if self._before is not None:
            torch.set_num_threads(self._before)
            self._before = None
