"""The timeline of profiled training steps: what ran when on the GPU, on the copy engines
and on the CPU, what of each hid behind GPU compute, and a picture of it.

From a ``torch.profiler`` trace (CPU and CUDA activities):

- ``GPU compute``: every CUDA kernel but copies and memsets (forward, backward, the GPU
  share's update); not the ranges user annotations project onto the GPU's timeline
  (Lightning's, ``record_function``'s), which span whole steps (on the H100, 2026-11-26,
  they made every lane read "100% hidden");
- ``D2H``: device-to-host copies (gradients leaving); ``H2D``: host-to-device copies
  (weights coming back);
- ``CPU update``: the offload optimizer's CPU updates (its ``fastopt::cpu_update``
  ranges, on the main thread or the worker: :func:`profile` records every thread, where
  torch's profiler records only the thread that started it by default);
- ``grad scale``: clipping's multiply of a host bucket's gradients, in its update's turn,
  where it is a pass of its own (``fastopt::grad_scale``: an optimizer that runs its own
  step, FSDP's host gradients; our kernels read our host copies multiplied, in the
  update's pass);
- ``worker task``: what the offload optimizer's worker thread runs, each update with what
  comes with it (waiting for its gradients, the copies it issues; ``fastopt::worker_task``):
  where the ``CPU update`` lane has gaps inside this one, the worker was busy otherwise;
  outside it, it had nothing to do;
- ``forward wait``: the forward waiting on the host for an update a step left running
  (``forward_waits="module"``; ``fastopt::forward_wait``);
- ``copy in line``: on the accelerator's code path without an accelerator
  (``copy_on_cpu=True``), the new weights copied in line on the CPU, with the note of each
  weight as the copy left it (``fastopt::copy_in_line``: what the copy engines and the
  device do on a GPU, in the CPU lane's gaps here);
- ``disk read``, ``disk write``: with the masters and state on disk
  (``offload_optimizer_device="nvme"``), the transfers of their file (``fastopt::disk_read``,
  ``fastopt::disk_write``, on the I/O threads).

:func:`hidden_exposed` splits each lane's busy time into the part during which GPU
compute ran (hidden) and the rest (exposed: the GPU waited, or nothing needed it yet);
:func:`draw` saves the picture (matplotlib).
"""

from __future__ import annotations

from collections.abc import Iterable

LANES = ("GPU compute", "D2H", "H2D", "CPU update", "grad scale", "copy in line", "worker task", "forward wait",
         "disk read", "disk write")
CPU_UPDATE = "fastopt::cpu_update"  # the record_function name of a bucket's CPU update
RANGE_LANES = {CPU_UPDATE: "CPU update", "fastopt::grad_scale": "grad scale", "fastopt::worker_task": "worker task",
               "fastopt::forward_wait": "forward wait", "fastopt::copy_in_line": "copy in line",
               "fastopt::disk_read": "disk read",
               "fastopt::disk_write": "disk write"}
# lanes drawn only where they ran (clipping's own pass, a worker thread, the forward's waits, state on disk)
SOMETIMES = ("grad scale", "copy in line", "worker task", "forward wait", "disk read", "disk write")

Intervals = list[tuple[float, float]]


def merge(intervals: Iterable[tuple[float, float]]) -> Intervals:
    """Sorted, non-overlapping intervals covering the same time."""
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(s, e) for s, e in out]


def profile(gpu: bool):
    """A ``torch.profiler.profile`` of the CPU (and CUDA, with ``gpu``) activities of every
    thread, the offload optimizer's worker included (torch >= 2.7's ``profile_all_threads``;
    the starting thread only before)."""
    import torch

    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if gpu else [])
    try:
        config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    except (AttributeError, TypeError):
        return torch.profiler.profile(activities=activities)
    return torch.profiler.profile(activities=activities, experimental_config=config)


def lanes_from_events(events) -> dict[str, Intervals]:
    """The lanes of a profiler trace (``prof.events()``), in milliseconds from its first event."""
    import torch

    raw: dict[str, list[tuple[float, float]]] = {lane: [] for lane in LANES}
    for e in events:
        span = (e.time_range.start / 1e3, e.time_range.end / 1e3)
        if e.device_type == torch.autograd.DeviceType.CUDA:
            if getattr(e, "is_user_annotation", False):
                continue  # a CPU range drawn on the GPU's timeline, not GPU work
            if "DtoH" in e.name or "DeviceToHost" in e.name:
                raw["D2H"].append(span)
            elif "HtoD" in e.name or "HostToDevice" in e.name:
                raw["H2D"].append(span)
            elif "Memcpy" not in e.name and "Memset" not in e.name:
                raw["GPU compute"].append(span)
        elif e.name in RANGE_LANES:
            raw[RANGE_LANES[e.name]].append(span)
    starts = [s for spans in raw.values() for s, _ in spans]
    t0 = min(starts) if starts else 0.0
    return {lane: merge((s - t0, e - t0) for s, e in spans) for lane, spans in raw.items()
            if spans or lane not in SOMETIMES}


def _overlap(a: Intervals, b: Intervals) -> float:
    total = 0.0
    for s, e in a:
        for bs, be in b:
            total += max(0.0, min(e, be) - max(s, bs))
    return total


def hidden_exposed(lanes: dict[str, Intervals]) -> dict[str, tuple[float, float, float]]:
    """Per lane but GPU compute: (busy ms, hidden ms: while GPU compute ran, exposed ms)."""
    compute = merge(lanes.get("GPU compute", []))
    out = {}
    for lane, spans in lanes.items():
        if lane == "GPU compute":
            continue
        spans = merge(spans)
        busy = sum(e - s for s, e in spans)
        hidden = _overlap(spans, compute)
        out[lane] = (busy, hidden, busy - hidden)
    return out


# what the CPU does for the offloaded share between its first update and its last: the updates, clipping's own
# pass, the weights copied in line (the accelerator's path without one)
CPU_WORK = ("CPU update", "grad scale", "copy in line")


def cpu_lane_coverage(lanes: dict[str, Intervals]) -> float | None:
    """The share of the span from the first CPU update's start to the last's end that the
    timeline explains, in a trace of one step: the CPU working for the offloaded share
    (:data:`CPU_WORK`), or, where updates run on the worker thread (streamed into backward),
    the worker with nothing queued (outside its ``worker task`` lane: no bucket's gradients
    had landed yet, backward was still making them).  What is left is time between buckets
    that nothing but the engine's own bookkeeping can have taken.  None without an update.
    Issue 66: the CPU lane busy from the first update to the last, with no gap the timeline
    cannot explain."""
    updates = lanes.get("CPU update", [])
    if not updates:
        return None
    start, end = updates[0][0], max(e for _, e in updates)
    if end <= start:
        return None
    explained = [(s, e) for lane in CPU_WORK for s, e in lanes.get(lane, [])]
    tasks = merge(lanes.get("worker task", []))
    if tasks:  # the worker's idle time between tasks: nothing to update yet
        cursor = start
        for s, e in tasks:
            if s > cursor:
                explained.append((cursor, s))
            cursor = max(cursor, e)
        explained.append((cursor, end))
    clipped = merge((max(s, start), min(e, end)) for s, e in explained if e > start and s < end)
    return sum(e - s for s, e in clipped) / (end - start)


def table(lanes: dict[str, Intervals]) -> str:
    """A markdown table of :func:`hidden_exposed`, with the span of the trace."""
    span = max((e for spans in lanes.values() for _, e in spans), default=0.0)
    rows = [f"profiled span {span:.1f} ms", "", "| lane | busy ms | hidden ms | exposed ms |", "|---|---:|---:|---:|"]
    for lane, (busy, hidden, exposed) in hidden_exposed(lanes).items():
        rows.append(f"| {lane} | {busy:.1f} | {hidden:.1f} | {exposed:.1f} |")
    return "\n".join(rows)


def draw(lanes: dict[str, Intervals], path, title: str) -> None:
    """Save the lanes as a PNG, one row each, time in ms along the bottom."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [lane for lane in LANES if lane in lanes] + [lane for lane in lanes if lane not in LANES]
    colors = {"GPU compute": "tab:green", "D2H": "tab:orange", "H2D": "tab:purple", "CPU update": "tab:blue",
              "grad scale": "tab:cyan", "worker task": "tab:gray", "forward wait": "tab:olive",
              "disk read": "tab:brown", "disk write": "tab:red"}
    fig, ax = plt.subplots(figsize=(12, 0.6 * len(names) + 1.2))
    for row, lane in enumerate(reversed(names)):
        spans = lanes[lane]
        ax.broken_barh([(s, e - s) for s, e in spans], (row - 0.4, 0.8), color=colors.get(lane, "tab:gray"))
    ax.set_yticks(range(len(names)), list(reversed(names)))
    ax.set_xlabel("ms")
    ax.set_title(title)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
