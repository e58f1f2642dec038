"""How many CPU threads a process of a run gives the optimizer step, set and given back."""

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
    given back at teardown; :meth:`set` says it in one log line.

    The count is torch's for the whole process, so it is the model's too where the model
    computes on the CPU, and there the bits of a reduction (a LayerNorm's gradient, a sum)
    can depend on it.  So, unless asked for a number, a run whose model computes on the
    CPU keeps the count Lightning's own strategy leaves (its launcher sets one in some
    processes, torch's default holds in the others): the run ends on that strategy's
    bits.  On an accelerator, where the model's bits do not depend on it, the CPU step
    gets this process's share of the node's cores."""

    def __init__(self) -> None:
        self._before: int | None = None

    def set(self, threads: int | None, processes_per_node: int, device: torch.device) -> None:
        if threads is None and device.type == "cpu":
            rank_zero_info(f"lightning_fastopt: {torch.get_num_threads()} CPU thread(s) per process for the optimizer "
                           "step: torch's, as Lightning left them for the model, which computes on the CPU "
                           "(cpu_threads=N sets them)")
            return
        threads = threads or default_cpu_threads(processes_per_node)
        self._before = torch.get_num_threads()
        torch.set_num_threads(threads)
        rank_zero_info(f"lightning_fastopt: {threads} CPU thread(s) per process for the optimizer step")

    def restore(self) -> None:
        if self._before is not None:
            torch.set_num_threads(self._before)
            self._before = None
