"""How many CPU threads a process of a multi-process run gives the optimizer step."""

from __future__ import annotations

import os


def default_cpu_threads(processes_per_node: int) -> int:
    """The cores this process may run on, shared among the processes of this node."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, processes_per_node))
