"""How long a build will take on this machine, said before it starts.

A spec's ``core_seconds`` is its compile time on one core of the machine it was measured
on (a 2-core AVX-512 one, g++ 12).  Spread over the cores ninja may use, it gave one
figure whatever the machine and its load ("about 31 s, once"), where a new user's idle
2-core machine took 38-46 s and a loaded one 396 s.  So the estimate here takes:

- the load: each compile gets a share of a core when other processes keep the cores busy
  (how busy the cores are now, sampled from ``/proc/stat`` over a fifth of a second; the
  load averages lag by a minute and more: right after other work ended they said three
  times the time);
- this machine's speed, once measured: each finished build records how long it took
  against what the load and ``core_seconds`` predicted (``build_speed.json`` in the cache
  root, per spec name), and later builds of that spec (a new torch, a changed source, the
  cache cleaned) scale by it.
"""

from __future__ import annotations

import json
import os
import time

_SPEEDS = "build_speed.json"
_LINK_SECONDS = 5.0  # the link and torch's start-up around the compiles


def jobs(sources: int) -> int:
    """The compiles ninja runs at once: one per core, at most one per source (``MAX_JOBS``,
    as torch reads it, caps it)."""
    n = min(os.cpu_count() or 1, sources)
    if os.environ.get("MAX_JOBS", "").isdigit():
        n = max(1, min(n, int(os.environ["MAX_JOBS"])))
    return n


def core_share(parallel: int) -> float:
    """The share of a core each of ``parallel`` compiles gets beside the work keeping the
    cores busy now (1 on an idle machine, or where that cannot be read)."""
    busy = busy_cores()
    cores = os.cpu_count() or 1
    return min(1.0, cores / (busy + parallel))


def busy_cores(seconds: float = 0.2) -> float:
    """How many cores' worth of work runs now: the busy share of the CPU time ``/proc/stat``
    counts over ``seconds``, times the cores (0 where there is no ``/proc/stat``)."""
    first = _cpu_times()
    if first is None:
        return 0.0
    time.sleep(seconds)
    second = _cpu_times()
    if second is None:
        return 0.0
    total = sum(second) - sum(first)
    idle = (second[3] + second[4]) - (first[3] + first[4])  # idle and iowait
    return max(0.0, (total - idle) / total) * (os.cpu_count() or 1) if total > 0 else 0.0


def _cpu_times() -> list[int] | None:
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    return [int(v) for v in fields[1:8]] if fields[:1] == ["cpu"] and len(fields) >= 8 else None


def predicted_seconds(core_seconds: float, sources: int) -> float:
    """The build's time at the reference machine's speed under this machine's cores and load."""
    parallel = jobs(sources)
    return core_seconds / (parallel * core_share(parallel)) + _LINK_SECONDS


def estimate(name: str, core_seconds: float, sources: int, root: str) -> str:
    """What the build's first line says of its time: about how long, here, and why where
    the cores are busy or the machine was measured."""
    parallel = jobs(sources)
    share = core_share(parallel)
    speed = _speeds(root).get(name)
    seconds = predicted_seconds(core_seconds, sources) * (speed or 1.0)
    notes = ([f"the cores busy: {parallel} compile(s) at {share:.0%} of a core each"] if share < 1.0 else []) + (
        ["at this machine's measured speed"] if speed else [])
    why = f" ({'; '.join(notes)})" if notes else ""
    return f"about {seconds:.0f} s{why}"


def record(name: str, predicted: float, took: float, root: str) -> None:
    """A finished build of ``name`` took ``took`` seconds where ``predicted`` (at the
    reference speed, under the load when it started) was expected: this machine's speed,
    for the next estimate of that spec.  Nothing is lost where it cannot be written."""
    if predicted <= 0 or took <= 0:
        return
    speeds = _speeds(root)
    speeds[name] = round(took / predicted, 3)
    path = os.path.join(root, _SPEEDS)
    try:
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(speeds, f)
        os.replace(tmp, path)
    except OSError:
        pass


def _speeds(root: str) -> dict[str, float]:
    try:
        with open(os.path.join(root, _SPEEDS)) as f:
            speeds = json.load(f)
    except (OSError, ValueError):
        return {}
    return {k: float(v) for k, v in speeds.items() if isinstance(v, (int, float)) and v > 0} if isinstance(
        speeds, dict) else {}
