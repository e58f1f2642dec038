"""What the checkpoints' checksums cost (``lightning_fastopt/checkpoint/checksums.py``):
a checkpoint's save and load with and without them, measured in one run.

    python benchmarks/checkpoint_checksums.py --dir /tmp            # 50M parameters: 200 MB of weights
    python benchmarks/checkpoint_checksums.py --dir /tmp --params 2e6 --repeats 2   # a quick check

The checkpoint is what a Trainer saves for AdamW: the weights and two moments (12 bytes a
parameter in eight tensors), written as our checkpoint writer writes it, ``save_atomically``
(a temporary file, flushed to the disk, renamed), with the checksums (hashed while the disk
takes torch's bytes, then appended to the file), and the same without them (``torch.save``
alone inside it).  The hashing alone is timed too, and the flush it runs beside.  Then the load our writer does (mapped,
``torch.load(mmap=True)``) and the check (every tensor hashed again), with the file in the
page cache.  Each figure is the median of ``--repeats`` runs, the two kinds saved in pairs (each first
in every other pair), and the
median of the differences within each pair (on a shared machine the disk's writeback makes
single saves vary by tens of percent); the target (issue 67): the checksums at most 3% of a
save's time.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lightning_fastopt.checkpoint import atomic  # noqa: E402
from lightning_fastopt.checkpoint.checksums import digests, verify_file  # noqa: E402


def _checkpoint(params: int, tensors: int = 8) -> dict:
    g = torch.Generator().manual_seed(0)
    sizes = [params // tensors] * tensors
    weights = {f"layer{i}.weight": torch.randn(n, generator=g) for i, n in enumerate(sizes)}
    state = {name: {"step": torch.tensor(10.0), "exp_avg": torch.randn(n, generator=g),
                    "exp_avg_sq": torch.rand(n, generator=g)} for name, n in zip(weights, sizes)}
    return {"state_dict": weights, "optimizer_states": [{"state": state, "param_groups": [{"lr": 1e-3}]}],
            "global_step": 10, "epoch": 0}


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", required=True, help="where the checkpoint files are written (a real disk)")
    parser.add_argument("--params", type=float, default=50e6)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    checkpoint = _checkpoint(int(args.params))
    nbytes = sum(t.numel() * t.element_size() for t in _all_tensors(checkpoint))
    path = Path(args.dir) / "checksums-bench.ckpt"
    saves = {"plain": [], "checksums": []}
    with_checksums = atomic.save_checksummed
    without = lambda obj, f: torch.save(obj, f)  # noqa: E731  (the same save, without them)
    for i in range(args.repeats):
        for kind in ("plain", "checksums") if i % 2 == 0 else ("checksums", "plain"):  # each first in turn
            atomic.save_checksummed = without if kind == "plain" else with_checksums
            saves[kind].append(_timed(lambda: atomic.save_atomically(checkpoint, path)))
    atomic.save_checksummed = with_checksums
    hashing = statistics.median(_timed(lambda: digests(checkpoint)) for _ in range(args.repeats))
    flushes = []  # what the hashing runs beside: the flush of torch's bytes to the disk
    for _ in range(args.repeats):
        with open(path, "w+b") as f:
            torch.save(checkpoint, f)
            f.flush()
            flushes.append(_timed(lambda: os.fsync(f.fileno())))
    flush = statistics.median(flushes)
    atomic.save_atomically(checkpoint, path)  # the file the loads read: with its checksums
    loads, checks = [], []
    for _ in range(args.repeats):
        loaded = {}
        loads.append(_timed(lambda: loaded.update(torch.load(path, weights_only=True, mmap=True))))
        checks.append(_timed(lambda: verify_file(loaded, path, str(path))))
    os.unlink(path)
    plain, summed = statistics.median(saves["plain"]), statistics.median(saves["checksums"])
    differences = [b - a for a, b in zip(saves["plain"], saves["checksums"])]
    paired = statistics.median(differences)
    low, _, high = statistics.quantiles(differences, n=4) if len(differences) > 1 else (paired, 0, paired)
    print(f"machine: {platform.node()} ({os.cpu_count()} cores), torch {torch.__version__}, torch threads "
          f"{torch.get_num_threads()}; checkpoint {nbytes / 2**20:.0f} MiB in {len(_all_tensors(checkpoint))} "
          f"tensors, written to {args.dir}, {args.repeats} runs each")
    print(f"save without checksums   {plain * 1e3:9.1f} ms ({nbytes / plain / 2**30:.2f} GiB/s)")
    print(f"save with checksums      {summed * 1e3:9.1f} ms ({(summed / plain - 1) * 100:+.1f}%)")
    print(f"  each run's difference  {paired * 1e3:+9.1f} ms ({paired / plain * 100:+.1f}% of the save; the median "
          f"of the {len(differences)} pairs, saved one after the other, each first in turn; quartiles "
          f"{low * 1e3:+.1f} and "
          f"{high * 1e3:+.1f} ms)")
    print(f"the hashing alone        {hashing * 1e3:9.1f} ms ({hashing / plain * 100:.1f}% of a save; "
          f"{nbytes / hashing / 2**30:.1f} GiB/s), run beside the flush of torch's bytes to the disk "
          f"({flush * 1e3:.1f} ms{', shorter than the hashing' if flush <= hashing else ''})")
    print(f"load (mapped)            {statistics.median(loads) * 1e3:9.1f} ms")
    print(f"check at load            {statistics.median(checks) * 1e3:9.1f} ms (the file in the page cache)")


def _all_tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _all_tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _all_tensors(v)]
    return []


if __name__ == "__main__":
    main()
