"""How many CPU threads a process of a run gives the optimizer step, set and given back."""

from __future__ import annotations

import os
from typing import Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info


# Cores of a process's share that the CPU step leaves, on an accelerator, to the thread that
# launches the accelerator's work and to the copies, where the share has at least SPARED_FROM:
# on H200 hosts of 16 cores (two leases of 2026-11-28, plain's step 110 and 111 ms in both),
# the streamed full-offload step of a 1B GPT took 465 ms with the update on all 16 cores and
# 372 ms on 14 (with all 16, the GPU's own work stretched from 110 to about 300 ms a step)
LEFT_TO_THE_ACCELERATOR = 2
SPARED_FROM = 8  # a share of fewer cores keeps them all for the update


def default_cpu_threads(processes_per_node: int, accelerator: bool = False, cores: int | None = None) -> int:
    """The cores this process may run on (``cores``: by default its affinity), shared among
    the processes of this node; on an accelerator, less :data:`LEFT_TO_THE_ACCELERATOR` where
    the share has at least :data:`SPARED_FROM`."""
    if cores is None:
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:  # not on Linux
            cores = os.cpu_count() or 1
    share = max(1, cores // max(1, processes_per_node))
    if accelerator and share >= SPARED_FROM:
        return share - LEFT_TO_THE_ACCELERATOR
    return share


def check_threads(cpu_threads: Any, bind_cpu_threads: Any, worker: bool) -> None:
    """``cpu_threads`` and ``bind_cpu_threads`` refused by name where they cannot be;
    ``worker``: whether some update runs on the worker thread (``stream_cpu_step``,
    ``delayed_update``), which is what binding keeps apart."""
    if cpu_threads is not None and (isinstance(cpu_threads, bool) or not isinstance(cpu_threads, int)
                                    or cpu_threads < 1):
        raise ValueError(f"cpu_threads must be a positive integer or None (cores per local rank), "
                         f"got {cpu_threads!r}")
    if not isinstance(bind_cpu_threads, bool):
        raise TypeError(f"bind_cpu_threads must be True or False, got {bind_cpu_threads!r}")
    if bind_cpu_threads and not hasattr(os, "sched_setaffinity"):
        raise ValueError("bind_cpu_threads=True binds threads to cores through the system's sched_setaffinity "
                         "(Linux), which this system does not have: leave it False")
    if bind_cpu_threads and not worker:
        raise ValueError("bind_cpu_threads=True puts the worker thread that runs the updates of stream_cpu_step or "
                         "delayed_update on cores apart from the thread that launches the accelerator's work: give "
                         "one of them, or leave it False")


def split_cores(cores: list[int], processes_per_node: int, local_rank: int,
                threads: int) -> tuple[list[int], list[int]]:
    """This process's share of ``cores`` (the node's, sorted; contiguous shares by local
    rank) cut in two: the first ``threads`` for the CPU step, the rest (at least one) for
    the thread that launches the accelerator's work and the copies."""
    share = max(1, len(cores) // max(1, processes_per_node))
    mine = cores[local_rank * share:(local_rank + 1) * share] or cores[-share:]
    step = mine[:max(1, min(threads, len(mine) - 1))]
    return step, [c for c in mine if c not in step] or mine[-1:]


class TorchThreads:
    """torch's intra-op thread count for a run (the CPU step's threads), set at set-up and
    given back at teardown; :meth:`set` says it in one log line.

    The count is torch's for the whole process, so it is the model's too where the model
    computes on the CPU, and there the bits of a reduction (a LayerNorm's gradient, a sum)
    can depend on it.  So, unless asked for a number, a run whose model computes on the
    CPU keeps the count Lightning's own strategy leaves (its launcher sets one in some
    processes, torch's default holds in the others): the run ends on that strategy's
    bits.  On an accelerator, where the model's bits do not depend on it, the CPU step
    gets this process's share of the node's cores, less two where the share has eight or
    more (:func:`default_cpu_threads`).

    ``bind=True`` (``bind_cpu_threads``): the cores themselves are shared out
    (:func:`split_cores`): the thread that launches the accelerator's work (this one, the
    process's main thread) runs on the share's last cores only, and :attr:`step_cores`, the
    others, are given to the engines, whose worker thread binds itself (and so the threads
    of its updates) to them (:mod:`~lightning_fastopt.offload.share_updates`).  The bits do
    not depend on where threads run."""

    def __init__(self) -> None:
        self._before: int | None = None
        self._mask: set[int] | None = None  # the main thread's cores before binding
        self.step_cores: tuple[int, ...] | None = None

    def set(self, threads: int | None, processes_per_node: int, device: torch.device, bind: bool = False,
            local_rank: int = 0) -> None:
        if bind:
            self._bind(threads, processes_per_node, device, local_rank)
            return
        if threads is None and device.type == "cpu":
            rank_zero_info(f"lightning_fastopt: {torch.get_num_threads()} CPU thread(s) per process for the optimizer "
                           "step: torch's, as Lightning left them for the model, which computes on the CPU "
                           "(cpu_threads=N sets them)")
            return
        threads = threads or default_cpu_threads(processes_per_node, accelerator=True)
        self._before = torch.get_num_threads()
        torch.set_num_threads(threads)
        rank_zero_info(f"lightning_fastopt: {threads} CPU thread(s) per process for the optimizer step")

    def _bind(self, threads: int | None, processes_per_node: int, device: torch.device, local_rank: int) -> None:
        cores = sorted(os.sched_getaffinity(0))
        if len(cores) < 2 * max(1, processes_per_node):
            rank_zero_info(f"lightning_fastopt: bind_cpu_threads=True not used: {len(cores)} core(s) for "
                           f"{processes_per_node} process(es), none to keep apart for the launching thread")
            self.set(threads, processes_per_node, device)
            return
        threads = threads or default_cpu_threads(processes_per_node, accelerator=True, cores=len(cores))
        step, launcher = split_cores(cores, processes_per_node, local_rank, threads)
        self._before, self._mask = torch.get_num_threads(), set(cores)
        torch.set_num_threads(len(step))
        os.sched_setaffinity(0, launcher)
        self.step_cores = tuple(step)
        rank_zero_info(f"lightning_fastopt: {len(step)} CPU thread(s) per process for the optimizer step, bound to "
                       f"cores {_ranges(step)} (local rank {local_rank}); the thread that launches the "
                       f"{device.type} work on cores {_ranges(launcher)}")

    def restore(self) -> None:
        if self._mask is not None:
            os.sched_setaffinity(0, self._mask)
            self._mask, self.step_cores = None, None
        if self._before is not None:
            torch.set_num_threads(self._before)
            self._before = None


def _ranges(cores: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``0-2,5``."""
    out, start = [], None
    for i, c in enumerate(cores):
        if start is None:
            start = c
        if i + 1 == len(cores) or cores[i + 1] != c + 1:
            out.append(f"{start}-{c}" if c != start else f"{c}")
            start = None
    return ",".join(out)
