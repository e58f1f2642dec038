"""The physical bound of an offloaded step, measured on the machine that runs it (issue 50).

An offload step cannot be shorter than the longest of these terms:

- the GPU's own step (the plain row of the same run);
- the CPU update of the offloaded share at the rate our kernels reach here: exact AdamW
  moves 28 bytes a parameter (read master, m, v and the gradient, write master, m, v: with
  float32 gradients and weights under bf16-mixed; with bfloat16 ones the half gradient in
  and the half weight out take the place of the float32 gradient, 28 again), timed on all
  of this process's cores (the host's best: on a GPU the strategies leave two of eight or
  more to the thread that launches the GPU's work, ``lightning_fastopt.core.cpu_threads``);
- the copies (gradients down, weights up) at the pinned copy bandwidth of each direction,
  measured with one large pinned buffer (the two directions have copy engines of their own,
  so each is a term);
- with clipping, the CPU update after backward's end: it needs every gradient first (their
  norm), and only the next step's first forward can run beside it (``first_forward_ms``).

Beside the terms, not one of them: the CPU update's rate again while one busy process
shares the cores (``cpu_params_per_s_beside_busy``), as the training's own threads share
them with an update that runs beside forward and backward.  Near the idle rate, the
update's threads share their work well (csrc/cpu/chunk_schedule.h); far below it, a streamed
or delayed row's longer CPU lane comes from there.  And on a GPU, the rate while pinned
copies run both ways (``cpu_params_per_s_beside_copies``): the copies read and write host
memory too, so an update that runs beside them shares the memory's bandwidth with them (on
the H200, 2026-11-28, the streamed row's buckets took 270 ms a step of CPU lane where the
update alone takes 204 ms).

    python benchmarks/physical_bound.py           # the terms of this machine, as JSON

``benchmarks/gpt_offload.py`` runs this in a process of its own before its rows and prints
each row's bound and its ratio to it.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

ADAM_BYTES_PER_PARAM = 28


@dataclass(frozen=True)
class Terms:
    """What this machine does per second: parameters the CPU step updates (exact AdamW, our
    kernels, ``threads`` threads; and with one busy process beside it, where measured),
    bytes a pinned copy moves each way (None without a GPU)."""
    cpu_params_per_s: float
    threads: int
    d2h_bytes_per_s: float | None
    h2d_bytes_per_s: float | None
    cpu_params_per_s_beside_busy: float | None = None
    cpu_params_per_s_beside_copies: float | None = None

    def describe(self) -> str:
        copies = ("pinned copies: D2H {:.1f} GB/s, H2D {:.1f} GB/s".format(self.d2h_bytes_per_s / 1e9,
                                                                        self.h2d_bytes_per_s / 1e9)
                  if self.d2h_bytes_per_s else "pinned copies: n/a (no GPU)")
        beside = (f" ({self.cpu_params_per_s_beside_busy / 1e9:.2f} Gparam/s beside one busy process, "
                  f"{self.cpu_params_per_s_beside_busy / self.cpu_params_per_s:.0%})"
                  if self.cpu_params_per_s_beside_busy else "")
        if self.cpu_params_per_s_beside_copies:
            beside += (f" ({self.cpu_params_per_s_beside_copies / 1e9:.2f} Gparam/s while pinned copies run both "
                       f"ways, {self.cpu_params_per_s_beside_copies / self.cpu_params_per_s:.0%})")
        return (f"CPU update (exact AdamW, our kernels, {self.threads} threads): "
                f"{self.cpu_params_per_s / 1e9:.2f} Gparam/s = "
                f"{self.cpu_params_per_s * ADAM_BYTES_PER_PARAM / 1e9:.0f} GB/s at {ADAM_BYTES_PER_PARAM} B a parameter"
                f"{beside}; {copies}")


def bound_ms(terms: Terms, gpu_step_ms: float | None, offloaded_params: float,
             copy_bytes_per_param: float, h2d_bytes_per_param: float | None = None,
             first_forward_ms: float | None = None) -> tuple[float | None, str]:
    """The bound of a step that offloads ``offloaded_params`` parameters, copying
    ``copy_bytes_per_param`` bytes of each one each way (``h2d_bytes_per_param`` to the
    device where that differs: weights in host memory, gathered for forward and again for
    backward; on a GPU: a run without one copies nothing), and the name of the term that
    sets it; (None, why) without a plain row.

    ``first_forward_ms``: the step clips its gradients (``gradient_clip_val``), and the
    plain step's first forward (of its first micro-batch) takes this long.  The update
    then cannot commit before every gradient is known (their global norm), so it starts
    when backward ends; the next step's first forward may overlap it, module by module,
    but what follows that forward (backward, and any later micro-batches) cannot: one
    more term, the CPU update plus the plain step less that first forward."""
    if gpu_step_ms is None:
        return None, "no plain row"
    update = offloaded_params / terms.cpu_params_per_s * 1e3
    named = {"GPU step": gpu_step_ms, "CPU update": update}
    if first_forward_ms is not None:
        named["update after backward"] = update + gpu_step_ms - first_forward_ms
    up = copy_bytes_per_param if h2d_bytes_per_param is None else h2d_bytes_per_param
    if terms.d2h_bytes_per_s is not None:
        named["D2H copies"] = offloaded_params * copy_bytes_per_param / terms.d2h_bytes_per_s * 1e3
        named["H2D copies"] = offloaded_params * up / terms.h2d_bytes_per_s * 1e3
    term = max(named, key=named.get)
    return named[term], term


def _median_s(fn, repeat: int, warmup: int = 1, sync=lambda: None) -> float:
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def cpu_update_rate(n: int, repeat: int = 5) -> float:
    """Parameters a second of our exact AdamW step (float32 master, moments and gradient,
    one tensor of ``n``) on torch's current thread count."""
    from lightning_fastopt.functional import fused_adam_

    def filled(value):  # fill_ runs on every thread (randn would draw on one)
        return torch.empty(n).fill_(value)

    master, grad, m, v = filled(0.1), filled(0.01), filled(0.0), filled(0.0)
    step = [0]

    def one():
        step[0] += 1
        fused_adam_([master], [grad], [m], [v], step=step[0], lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8,
                    weight_decay=0.01)

    return n / _median_s(one, repeat)


def beside_busy_process(measure_rate):
    """``measure_rate()`` while another process keeps one core busy (started, and seen
    running, before; stopped after)."""
    busy = subprocess.Popen([sys.executable, "-c", "import sys; print(flush=True)\nwhile True: pass"],
                            stdout=subprocess.PIPE)
    try:
        busy.stdout.readline()  # it runs
        return measure_rate()
    finally:
        busy.kill()
        busy.wait()


def beside_copies(measure_rate, copy_round):
    """``measure_rate()`` while a thread runs ``copy_round()`` (one round of copies, waited
    for) again and again: started, and seen through one round, before; stopped after.  The
    rate, and how many rounds ran while it was measured."""
    import threading

    stop, started, rounds, failed = threading.Event(), threading.Event(), [0], []

    def copying():
        try:
            while not stop.is_set():
                copy_round()
                rounds[0] += 1
                started.set()
        except BaseException as error:  # said by the caller
            failed.append(error)
        finally:
            started.set()

    thread = threading.Thread(target=copying, name="pinned copies", daemon=True)
    thread.start()
    try:
        started.wait()
        if failed:
            raise failed[0]
        before = rounds[0]
        rate = measure_rate()
        ran = rounds[0] - before
        if failed:  # (during the measurement: the rate was not taken beside the copies)
            raise failed[0]
        return rate, ran
    finally:
        stop.set()
        thread.join()


def copies_both_ways(nbytes: int):
    """One round: ``nbytes`` from a pinned host buffer to the GPU and as many back, each on a
    stream of its own (the two copy engines), waited for."""
    up_host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    down_host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    up_device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    down_device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    up, down = torch.cuda.Stream(), torch.cuda.Stream()

    def one_round():
        with torch.cuda.stream(up):
            up_device.copy_(up_host, non_blocking=True)
        with torch.cuda.stream(down):
            down_host.copy_(down_device, non_blocking=True)
        up.synchronize()
        down.synchronize()
    return one_round


def pinned_copy_rates(nbytes: int, repeat: int = 5) -> tuple[float, float]:
    """Bytes a second of one pinned host buffer copied to the GPU and back (each direction alone)."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    sync = torch.cuda.synchronize
    d2h = _median_s(lambda: host.copy_(device, non_blocking=True), repeat, sync=sync)
    h2d = _median_s(lambda: device.copy_(host, non_blocking=True), repeat, sync=sync)
    return nbytes / d2h, nbytes / h2d


def measure(cpu_params: int, copy_bytes: int) -> Terms:
    """This machine's terms, the CPU step on every core of this process."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from lightning_fastopt.core.cpu_threads import default_cpu_threads

    threads = default_cpu_threads(1)
    torch.set_num_threads(threads)
    rate = cpu_update_rate(cpu_params)
    beside = beside_busy_process(lambda: cpu_update_rate(cpu_params))
    d2h = h2d = copying = None
    if torch.cuda.is_available():
        d2h, h2d = pinned_copy_rates(copy_bytes)
        copying, _ = beside_copies(lambda: cpu_update_rate(cpu_params), copies_both_ways(copy_bytes))
    return Terms(cpu_params_per_s=rate, threads=threads, d2h_bytes_per_s=d2h, h2d_bytes_per_s=h2d,
                 cpu_params_per_s_beside_busy=beside, cpu_params_per_s_beside_copies=copying)


def main(argv=None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu-params", type=int, default=256 * 2**20, help="parameters the CPU step is timed on")
    ap.add_argument("--copy-mb", type=int, default=1024, help="MiB each pinned copy moves")
    args = ap.parse_args(argv)
    print(json.dumps(asdict(measure(args.cpu_params, args.copy_mb * 2**20))), flush=True)


if __name__ == "__main__":
    main()
