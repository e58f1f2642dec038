"""End-to-end benchmark: a GPT-style model of about 1B parameters trained with Lightning,
plain (torch AdamW(fused=True)) against ``fastopt_offload`` at offload_fraction 0, 0.25,
0.5, 1 and ``"auto"``, exact, streamed (``stream_cpu_step=True``) and delayed
(``delayed_update=True``), with bf16-mixed or half weights (``precision="bf16-true"``),
DeepSpeed's ``deepspeed_stage_2_offload`` when deepspeed is installed, and ZeRO-3 on one rank:
Lightning's ``ModelParallelStrategy`` (FSDP2) with torch's fused AdamW, the same with FSDP's
``CPUOffloadPolicy``, and ``fastopt_fsdp`` at fraction 1 (see CONFIGS).

    python benchmarks/gpt_offload.py                # ~1B parameters on a GPU (about 10 minutes on an H100)
    python benchmarks/gpt_offload.py --tiny         # a tiny model on any device: checks the script runs

Each configuration trains in its own process (a fresh CUDA context, so peak memory is
its own), forked from one that imported torch and Lightning already (``run_forked``), and
ends as its last timed step does (``child``): bf16-mixed precision, the byte-level GPT of
examples/gpt.py (20 layers of width 2048 by default) on the text shipped in examples/data,
``--steps`` optimizer steps after ``--warmup``.  Reported per configuration:

- ``tokens/s``: tokens per second over the measured steps (wall clock, synchronized at
  both ends), and ``vs plain``: that over plain Lightning's;
- ``peak GiB``: ``torch.cuda.max_memory_allocated`` over the measured steps;
- ``D2H hidden`` / ``H2D hidden``: from a profiler trace of the last two warm-up steps,
  the share of the gradient (device-to-host) and weight (host-to-device) copy time
  during which compute kernels were running: the overlap the side streams achieve;
- after the table, per configuration, the same trace's busy, hidden and exposed time of
  the copies and of the CPU updates (``benchmarks/timeline.py``), and with
  ``--timeline DIR`` a picture of it (PNG, matplotlib).

The headline figures: the GPU memory saved per 25% of offload ((peak at 0 - peak at 1) /
4) and the slowdown at fraction 1 (plain tokens/s over fastopt_offload's); Megatron-style
hybrid offload reports 1.9x to 4.2x slower at full offload.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch
from physical_bound import Terms, bound_ms
from timeline import draw, hidden_exposed, lanes_from_events, profile, table

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "examples"))

# fastopt:F is FastOptStrategy(offload_fraction=F), F a number or "auto" (chosen after 5 probe steps, before
# the timed ones); a ":stream" suffix adds stream_cpu_step=True, a ":delayed" suffix delayed_update=True
# (delayed from the third step on, well before the timed steps), a ":bf16-true" suffix trains with half
# weights (precision="bf16-true") instead of bf16-mixed, a ":module" suffix adds forward_waits="module";
# a final ":clip" (any configuration) trains with gradient_clip_val=1.0 (streamed, the step is speculative);
# a final ":aN" (after any other suffix) accumulates N micro-batches a step (accumulate_grad_batches=N: N times
# the tokens a step, plain's compute N times longer while the update stays the same; issue 66's tokens-per-step
# sweep compares each row with plain at the same N and clipping);
# a ":bind" suffix binds the CPU step's threads to cores apart from the thread that launches the GPU's work
# (bind_cpu_threads=True, issue 66's target 6); a ":tN" suffix gives the CPU step N threads (cpu_threads=N;
# by default the process's cores, less two where it has 8 or more: lightning_fastopt.core.cpu_threads)
CONFIGS = ["plain", "fastopt:0", "fastopt:0.25:stream", "fastopt:0.5", "fastopt:0.5:stream", "fastopt:1",
           "fastopt:1:stream", "fastopt:1:delayed", "fastopt:auto:stream", "fastopt:auto:delayed",
           "fastopt:1:stream:bf16-true", "fastopt:1:delayed:bf16-true", "fastopt:0.5:module",
           "fastopt:1:delayed:bf16-true:module", "plain:clip", "fastopt:1:clip", "fastopt:1:stream:clip",
           "deepspeed_stage_2_offload"]
# ZeRO-3 on one rank (issue 41; FSDP2 through Lightning's ModelParallelStrategy, each block then the root
# sharded with fully_shard, bf16-mixed): "fsdp" is ModelParallelStrategy with torch AdamW(fused=True) on the
# GPU; "fsdp:cpu_offload" adds FSDP's CPUOffloadPolicy (parameters, gradients and optimizer state in host
# memory, torch's fused AdamW stepping on the CPU after backward); "fastopt_fsdp:F[:stream]" is
# FastOptFSDPStrategy(offload_fraction=F[, stream_cpu_step=True]) over the same sharding and optimizer;
# "fastopt_fsdp:1:params" is FastOptFSDPStrategy(offload_parameters=True) under the same CPUOffloadPolicy as
# "fsdp:cpu_offload" (the host shards updated in place by our CPU kernels: issue 52's comparison), and
# "fastopt_fsdp:1:params:stream" each unit's update started in backward as its gradients land on the host
# ("...:module": forward_waits="module", the step ending before the updates of the units the next forward
# reaches first, each unit's forward waiting for its own rows'); a ":bf16-true" suffix on any of them trains
# with half weights (precision="bf16-true": half shards, so half the copies; under ModelParallelStrategy
# torch's AdamW then steps the bfloat16 shards themselves, with fastopt_fsdp the float32 masters beside them),
# a ":prefetch" suffix has each block gather the next one ahead, both ways (FSDP's set_modules_to_forward_prefetch
# and set_modules_to_backward_prefetch: whether FSDP then overlaps its copies with compute on one GPU)
FSDP_CONFIGS = ["fsdp", "fsdp:cpu_offload", "fastopt_fsdp:1:params", "fastopt_fsdp:1:params:stream",
                "fastopt_fsdp:1:params:stream:module", "fastopt_fsdp:1", "fastopt_fsdp:1:stream"]
CONFIGS += FSDP_CONFIGS
CLIP = ":clip"
ACCUMULATE = re.compile(r":a([1-9][0-9]*)$")


def split_accumulation(config: str) -> tuple[str, int]:
    """``config`` without its final ``:aN``, and N (1 without one)."""
    found = ACCUMULATE.search(config)
    return (config[:found.start()], int(found.group(1))) if found else (config, 1)


def reference_of(config: str) -> str:
    """The plain row a row is compared with: plain at the same accumulation, with clipping where it clips."""
    base, n = split_accumulation(config)
    return "plain" + (CLIP if base.endswith(CLIP) else "") + (f":a{n}" if n > 1 else "")
DELAYED_WARMUP = 2


# ---------------------------------------------------------------------------- one configuration (child)
def fastopt_arguments(config: str) -> tuple[dict, bool]:
    """FastOptStrategy's arguments for ``fastopt:F[:stream|:delayed][:bf16-true][:module][:tN]``
    (F a number or ``auto``; ``tN``: ``cpu_threads=N``), and whether the configuration trains
    with half weights."""
    _, fraction, *mode = config.split(":")
    threads = [m for m in mode if re.fullmatch(r"t[1-9][0-9]*", m)]
    unknown = set(mode) - {"stream", "delayed", "bf16-true", "module", "clip", "bind"} - set(threads)  # clip: see child
    if unknown or len(threads) > 1:
        raise ValueError(f"{config!r}: unknown suffix {sorted(unknown) or threads}; expected ':stream' or ':delayed', "
                         "and/or ':bf16-true', ':module', ':bind', one ':tN' (N CPU threads), ':clip'")
    arguments = dict(offload_fraction=fraction if fraction == "auto" else float(fraction),
                     stream_cpu_step="stream" in mode)
    if threads:
        arguments["cpu_threads"] = int(threads[0][1:])
    if "module" in mode:
        arguments["forward_waits"] = "module"
    if "bind" in mode:
        arguments["bind_cpu_threads"] = True
    if "delayed" in mode:
        arguments.update(delayed_update=True, delayed_update_warmup=DELAYED_WARMUP)
    return arguments, "bf16-true" in mode


def fsdp_strategy(config: str):
    """The strategy of ``fsdp[:cpu_offload]`` or ``fastopt_fsdp:F[:stream][:params][:module]`` (one rank),
    each with an optional ``:bf16-true`` (the precision, set by the caller) and ``:prefetch`` (FSDP's
    explicit prefetch, set by the model's ``configure_model``)."""
    name, *mode = config.split(":")
    mode = [m for m in mode if m not in ("bf16-true", "prefetch")]
    if name == "fsdp":
        if set(mode) - {"cpu_offload"}:
            raise ValueError(f"{config!r}: expected 'fsdp' or 'fsdp:cpu_offload'")
        from lightning.pytorch.strategies import ModelParallelStrategy

        class KeepsOffloadedShards(ModelParallelStrategy):
            """ModelParallelStrategy moves the whole model to the GPU after ``configure_model``
            (``model.to(root_device)``), CPUOffloadPolicy's host shards too, and FSDP then refuses
            to run (seen on the H100, 2026-11-26): here every module is sharded by
            ``configure_model``, which already placed what belongs on the GPU."""

            def model_to_device(self) -> None:
                pass

        cls = KeepsOffloadedShards if "cpu_offload" in mode else ModelParallelStrategy
        return cls(data_parallel_size=1, tensor_parallel_size=1)
    from lightning_fastopt import FastOptFSDPStrategy

    fraction, *rest = mode
    if set(rest) - {"stream", "params", "module"}:
        raise ValueError(f"{config!r}: expected 'fastopt_fsdp:F' and ':stream', ':params' (offload_parameters), "
                         "':module' (forward_waits='module')")
    return FastOptFSDPStrategy(offload_fraction=float(fraction), stream_cpu_step="stream" in rest,
                               offload_parameters="params" in rest, data_parallel_size=1, tensor_parallel_size=1,
                               forward_waits="module" if "module" in rest else "step")


def host_weights(config: str) -> bool:
    """Whether ``config`` keeps the weights in host memory (FSDP's ``CPUOffloadPolicy``)."""
    return bool({"cpu_offload", "params"} & set(config.split(":")))


PROFILED_STEPS = 2  # the last warm-up steps, profiled: a delayed update runs into the next step


def _share(split) -> float | None:
    busy, hidden, _ = split
    return hidden / busy if busy else None


class Phases:
    """Where a configuration's process spends its wall time, phase by phase: each mark ends the
    phase named, begun at the previous mark (the first at this module's import, after the
    interpreter and torch started).  On the H100 (2026-11-26) a row took 46-71 s for 2-26 s
    of steps: these say where the rest goes."""

    def __init__(self) -> None:
        self.last = time.perf_counter()
        self.seconds: dict[str, float] = {}

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self.last
        self.last = now


phases = Phases()


def child(config: str, args, deliver) -> None:
    """Train ``config`` and ``deliver`` its row as its last timed step ends, then end the
    process there (``os._exit``): Lightning's teardown (the model and the optimizer's
    state copied back to the host) took up to 13 s a row on the H200 (2026-11-28) and
    measures nothing."""
    import lightning as L
    from gpt import ByteWindows, TinyGPT
    from torch.nn import functional as F

    import lightning_fastopt  # noqa: F401  (registers the strategies)
    from lightning_fastopt import FastOptStrategy

    gpu = torch.cuda.is_available()

    class BenchGPT(TinyGPT):
        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self(x).float().flatten(0, 1), y.flatten())

        def configure_optimizers(self):
            if config.startswith("deepspeed"):
                from deepspeed.ops.adam import DeepSpeedCPUAdam

                return DeepSpeedCPUAdam(self.parameters(), lr=1e-4, weight_decay=0.01)
            return torch.optim.AdamW(self.parameters(), lr=1e-4, weight_decay=0.01, fused=True)

    class ShardedBenchGPT(BenchGPT):
        def configure_model(self):  # under ModelParallelStrategy: each block, then the root
            from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

            mesh = self.device_mesh["data_parallel"]
            pinned = torch.cuda.is_available()  # (pinned host memory needs an accelerator: a --tiny CPU run)
            extra = dict(offload_policy=CPUOffloadPolicy(pin_memory=pinned)) if host_weights(config) else {}
            for block in self.blocks:
                fully_shard(block, mesh=mesh, **extra)
            fully_shard(self, mesh=mesh, **extra)
            if "prefetch" in config.split(":"):  # FSDP's explicit prefetch: the next block ahead, each way
                for before, after in zip(self.blocks, self.blocks[1:]):
                    before.set_modules_to_forward_prefetch([after])
                    after.set_modules_to_backward_prefetch([before])

    class Measure(L.Callback):
        reads_weights_between_steps = False  # it times steps: forward_waits="module" may apply

        def __init__(self):
            self.t0 = self.t1 = None
            self.profile = None
            self.prof = None
            self.forwards = []  # each timed step's first forward: (start, end) marks (events on a GPU)
            self.in_first_forward = False

        def _now(self):
            if not gpu:
                return time.perf_counter() * 1e3
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event

        def first_forward_ms(self) -> float | None:
            """The mean of the timed steps' first forwards (read after the device has synchronized)."""
            spans = [end - start if not gpu else start.elapsed_time(end) for start, end in self.forwards]
            return sum(spans) / len(spans) if spans else None

        def on_before_backward(self, trainer, module, loss):
            if self.in_first_forward:
                self.forwards[-1] = (self.forwards[-1], self._now())
                self.in_first_forward = False

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if batch_idx % accumulate:  # (a step's later micro-batches)
                return
            batch_idx //= accumulate  # the optimizer step this micro-batch starts
            if batch_idx == 0:
                phases.mark("setup")  # fit's set-up: the model to the device, the strategy's buffers
            if batch_idx == max(0, args.warmup - PROFILED_STEPS):  # the last warm-up steps
                self.prof = profile(gpu)
                self.prof.__enter__()
            if batch_idx == args.warmup:
                if gpu:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                self.t0 = time.perf_counter()
            if batch_idx >= args.warmup:  # a timed step: its first forward starts
                self.forwards.append(self._now())
                self.in_first_forward = True

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if (batch_idx + 1) % accumulate:  # (not a step's last micro-batch)
                return
            batch_idx //= accumulate  # the optimizer step this micro-batch ends
            if self.prof is not None and batch_idx == args.warmup - 1:
                if gpu:
                    torch.cuda.synchronize()
                self.prof.__exit__(None, None, None)
                phases.mark("warm-up")  # the warm-up steps, the last ones profiled
                lanes = lanes_from_events(self.prof.events())
                split = hidden_exposed(lanes)
                self.profile = dict(lanes=lanes, steps_profiled=batch_idx + 1 - max(0, args.warmup - PROFILED_STEPS),
                                    d2h_ms=split["D2H"][0], h2d_ms=split["H2D"][0],
                                    d2h_hidden=_share(split["D2H"]), h2d_hidden=_share(split["H2D"]))
                self.prof = None
                phases.mark("profile read")  # the profiler's events turned into lanes
            if batch_idx == args.warmup + args.steps - 1:
                if gpu:
                    torch.cuda.synchronize()
                self.t1 = time.perf_counter()
                phases.mark("timed steps")
                deliver(row_of(trainer, self.t1 - self.t0, self.profile))
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(0)

    phases.mark("imports")
    torch.manual_seed(0)
    sharded = config.startswith(("fsdp", "fastopt_fsdp"))
    unaccumulated, accumulate = split_accumulation(config)
    # built where it trains: initializing 1B parameters on the CPU took 12 s (one thread draws the
    # random numbers), on the GPU it takes milliseconds; the timings do not depend on the values
    with torch.device("cuda" if gpu else "cpu"):
        model = (ShardedBenchGPT if sharded else BenchGPT)(n_layer=args.layers, n_head=args.heads,
                                                           n_embd=args.width, block_size=args.seq)
    phases.mark("model built")
    n_params = sum(p.numel() for p in model.parameters())
    text = torch.tensor(list((REPO / "examples/data/workshop_notes.txt").read_bytes()), dtype=torch.long)
    while len(text) < (args.warmup + args.steps) * accumulate * args.batch * 16 + args.seq + 2:
        text = torch.cat([text, text])
    loader = torch.utils.data.DataLoader(ByteWindows(text, args.seq, 16), batch_size=args.batch, shuffle=True,
                                         drop_last=True)
    clip = unaccumulated.endswith(CLIP)
    base = unaccumulated[:-len(CLIP)] if clip else unaccumulated
    if base == "plain":
        strategy = "auto"
    elif sharded:
        strategy = fsdp_strategy(base)
    elif base.startswith("fastopt"):
        strategy = FastOptStrategy(**fastopt_arguments(base)[0])
    else:
        strategy = base
    measure = Measure()
    half = fastopt_arguments(base)[1] if base.startswith("fastopt:") else "bf16-true" in base.split(":")
    precision = "bf16-true" if half else "bf16-mixed" if gpu else "32-true"  # (half weights on a CPU too)
    trainer = L.Trainer(accelerator="gpu" if gpu else "cpu", devices=1, strategy=strategy,
                        precision=precision, max_steps=args.warmup + args.steps,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[measure], gradient_clip_val=1.0 if clip else None,
                        accumulate_grad_batches=accumulate)

    def row_of(trainer, seconds: float, profiled: dict | None) -> dict:
        """The row, read as the last timed step ends (the speculative counts: each step adds its own at its end)."""
        opt = (getattr(trainer.strategy, "engines", None) or [None])[0]
        copy_bytes = next(trainer.lightning_module.parameters()).element_size()  # what the copies move a parameter
        schedule = getattr(getattr(opt, "local", opt), "schedule", None)  # (an FSDP engine's is its local optimizer's)
        speculated = dict(getattr(schedule, "totals", {}))  # the speculative step's bucket counts
        left_running = getattr(schedule, "updates_left_running", 0)  # bucket updates steps left running (":module")
        # the engine's (the fraction "auto" chose), else the FSDP strategy's (its engines are per rank)
        fraction = getattr(opt, "offload_fraction", getattr(trainer.strategy, "offload_fraction", None))
        return dict(configuration=config, fraction=fraction, params=n_params,
                    tokens_per_s=args.steps * accumulate * args.batch * args.seq / seconds, speculated=speculated,
                    tokens_per_step=accumulate * args.batch * args.seq,
                    left_running=left_running,
                    step_ms=seconds / args.steps * 1e3, copy_bytes_per_param=copy_bytes,
                    # weights in host memory: each block's gathered for forward and again for backward
                    h2d_bytes_per_param=2 * copy_bytes if host_weights(config) else copy_bytes,
                    peak_gib=torch.cuda.max_memory_allocated() / 2**30 if gpu else None,
                    phases_s=phases.seconds, first_forward_ms=measure.first_forward_ms(), **(profiled or {}))

    trainer.fit(model, loader)
    raise RuntimeError(f"{config}: training ended before its last timed step")


# ---------------------------------------------------------------------------- running one (parent)
def run_subprocess(config: str, args) -> tuple[dict | None, int, str]:
    """``config``'s row (None where it failed), run in a new interpreter (this script with
    ``--child``), its exit code and the tail of what it printed."""
    cmd = [sys.executable, __file__, "--child", config] + [
        f"--{k}={getattr(args, k)}" for k in ("layers", "width", "heads", "seq", "batch", "warmup", "steps")]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    row = json.loads(lines[-1][len("RESULT "):]) if proc.returncode == 0 and lines else None
    return row, proc.returncode, (proc.stderr or proc.stdout)[-2000:]


_FORK_PRELOAD = ["__main__", "lightning", "lightning_fastopt", "gpt"]  # imported once, by the fork server


def run_forked(config: str, args) -> tuple[dict | None, int, str]:
    """As :func:`run_subprocess`, in a process forked from a server that imported torch,
    Lightning and lightning_fastopt once (multiprocessing's ``forkserver``): each row skips
    the interpreter's start and the imports, about 4.5 s a row on the 2-core dev machine of
    5 s (``--tiny``, where 21 rows check the GPU plan), 16-22 s of a GPU row's 38-51 on the
    H200 (2026-11-28).  The server touches no CUDA device (importing torch, Lightning and
    ours calls none of torch.cuda's functions), so each forked row makes a CUDA context of
    its own, and its peak memory is its own; where a forked row fails all the same,
    :func:`main` runs it and the rest as :func:`run_subprocess` does."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(_FORK_PRELOAD)
    receive, send = context.Pipe(duplex=False)
    with tempfile.NamedTemporaryFile("w+", suffix=".log") as log:
        proc = context.Process(target=_forked_child, args=(config, args, log.name, send))
        proc.start()
        send.close()
        try:
            row = receive.recv()
        except EOFError:  # it ended without sending one
            row = None
        proc.join()
        return (row if proc.exitcode == 0 else None), proc.exitcode, Path(log.name).read_text()[-2000:]


def _forked_child(config: str, args, log_path: str, send) -> None:
    """The forked process: what it prints goes to ``log_path``, its row through ``send``;
    its phases count from its start (the server imported what the first phase counts).  An
    error's traceback lands in the log too (multiprocessing prints it to stderr)."""
    fd = os.open(log_path, os.O_WRONLY | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    phases.last = time.perf_counter()
    child(config, args, send.send)


def one_row(config: str, args, run):
    """``config``'s row by ``run`` (None where it failed), its exit code, the tail of what it
    printed, its wall time and the runner for the next rows: where a forked GPU row fails
    (a CUDA context the fork broke?) it runs again in an interpreter of its own, and so do
    the rest (said)."""
    began = time.perf_counter()
    row, code, tail = run(config, args)
    if row is None and run is run_forked and not args.tiny:
        print(f"{config}: FAILED forked (exit {code}), again in an interpreter of its own, and the rest so\n{tail}",
              flush=True)
        run = run_subprocess
        began = time.perf_counter()
        row, code, tail = run(config, args)
    return row, code, tail, time.perf_counter() - began, run


# ---------------------------------------------------------------------------- the table (parent)
def measure_terms(tiny: bool) -> Terms | None:
    """This machine's terms of the bound (physical_bound.py, in a process of its own: this
    one touches no GPU), or None where that failed (said)."""
    sizes = ["--cpu-params", str(2**20), "--copy-mb", "8"] if tiny else []
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("physical_bound.py")), *sizes],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"the bound's terms: FAILED (exit {proc.returncode})\n{(proc.stderr or proc.stdout)[-2000:]}", flush=True)
        return None
    return Terms(**json.loads(proc.stdout.splitlines()[-1]))


def row_bound(r: dict, terms: Terms | None, ref: dict | None) -> tuple[float | None, str]:
    """A row's bound (ms) and the term that sets it, from its plain row ``ref``: offloading
    rows only; a clipped row's with the update after backward (plain's first forward)."""
    if terms is None or r.get("fraction") is None:
        return None, ""
    clipped = split_accumulation(r["configuration"])[0].endswith(CLIP)
    return bound_ms(terms, ref and ref["step_ms"], r["fraction"] * r["params"], r["copy_bytes_per_param"],
                    r.get("h2d_bytes_per_param"),
                    first_forward_ms=ref.get("first_forward_ms") if clipped and ref else None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=20)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=7)  # offload_fraction="auto" settles after 5
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--tiny", action="store_true", help="a tiny model, any device (checks the script runs)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help="also write the rows as JSON here")
    ap.add_argument("--timeline", type=Path, help="draw each configuration's profiled steps as a PNG in this "
                                                  "directory (matplotlib), and print where each lane hid")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="start no configuration that would likely end after this many seconds from the start "
                         "(the longest one so far as the estimate); the rest are named as left out")
    args = ap.parse_args()
    if args.tiny:
        args.layers, args.width, args.heads, args.seq, args.batch, args.warmup, args.steps = 2, 64, 4, 32, 2, 2, 3
    if args.child:
        child(args.child, args, lambda row: print("RESULT " + json.dumps(row), flush=True))
        return
    if args.timeline:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            sys.exit("--timeline draws with matplotlib: pip install matplotlib")

    rows = []
    configs = args.configs.split(",")
    started, longest = time.perf_counter(), 0.0
    terms = measure_terms(args.tiny)  # first: a run cut off still has them
    if terms is not None:
        print(f"the bound's terms ({time.perf_counter() - started:.0f} s): {terms.describe()}", flush=True)
    run = run_forked  # every row forked from one process that imported what they need
    for i, config in enumerate(configs):
        elapsed = time.perf_counter() - started
        if args.budget_s is not None and rows and elapsed + longest > args.budget_s:
            print(f"left out (--budget-s {args.budget_s:g}: {elapsed:.0f} s spent, the longest configuration took "
                  f"{longest:.0f} s): {','.join(configs[i:])}", flush=True)
            break
        if config.startswith("deepspeed"):
            try:
                import deepspeed  # noqa: F401
            except ImportError:
                print(f"{config}: skipped (deepspeed is not installed)", flush=True)
                continue
        row, code, tail, wall, run = one_row(config, args, run)
        longest = max(longest, wall)
        if row is None:
            print(f"{config}: FAILED (exit {code}, {wall:.0f} s)\n{tail}", flush=True)
            continue
        row["wall_s"] = wall  # the whole process: start, model, warm-up, timed steps
        rows.append(row)
        # each row as it ends, so that a run cut off keeps what it measured
        peak = "n/a" if row["peak_gib"] is None else f"{row['peak_gib']:.1f} GiB"
        print(f"{config}: done in {wall:.0f} s: {row['step_ms']:.0f} ms a step, {row['tokens_per_s']:,.0f} tokens/s, "
              f"peak {peak}; {_phases(row)}", flush=True)
        if args.out:
            args.out.write_text(json.dumps(dict(device=_device_name(), terms=terms and asdict(terms), rows=rows,
                                                partial=True), indent=2))
    if not rows:
        sys.exit("no configuration ran")

    gpu = torch.cuda.is_available()
    name = _device_name()
    print(f"\n{name}; torch {torch.__version__}; {rows[0]['params'] / 1e6:,.1f}M parameters, "
          f"batch {args.batch} x {args.seq} tokens, {'bf16-mixed' if gpu else '32-true'}\n")
    plain = next((r for r in rows if r["configuration"] == "plain"), None)
    if terms is not None:
        print(f"the bound's terms: plain step {plain['step_ms']:.0f} ms; " if plain else "the bound's terms: ",
              terms.describe(), sep="")
    print("| configuration | tokens/s | vs plain | step ms | bound ms (set by) | x bound | peak GiB "
          "| saved vs plain GiB | D2H hidden | H2D hidden |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")

    def pct(x):
        return "n/a" if x is None else f"{x:.0%}"

    by = {r["configuration"]: r for r in rows}
    for r in rows:  # against plain at the same accumulation and clipping (else plain, marked)
        ref = by.get(reference_of(r["configuration"]), plain)
        mark = " (vs plain)" if ref is plain and reference_of(r["configuration"]) != "plain" and ref is not None else ""
        rel = f"{r['tokens_per_s'] / ref['tokens_per_s']:.2f}x{mark}" if ref else "n/a"
        peak = "n/a" if r["peak_gib"] is None else f"{r['peak_gib']:.1f}"
        saved = (f"{plain['peak_gib'] - r['peak_gib']:.1f}" if plain and r["peak_gib"] is not None else "n/a")
        chosen = f" (chose {r['fraction']:g})" if ":auto" in r["configuration"] and r.get("fraction") is not None else ""
        bound, term = row_bound(r, terms, ref)
        r["bound_ms"], r["bound_term"] = bound, term
        bound_cells = (f"{bound:.0f} ({term}) | {r['step_ms'] / bound:.2f}x" if bound
                       else f"n/a{f' ({term})' if term else ''} | n/a")
        print(f"| {r['configuration']}{chosen} | {r['tokens_per_s']:,.0f} | {rel} | {r['step_ms']:.0f} | {bound_cells} "
              f"| {peak} | {saved} | {pct(r.get('d2h_hidden'))} | {pct(r.get('h2d_hidden'))} |")
    for r in rows:
        counts = r.get("speculated") or {}
        if counts.get("speculated") or counts.get("held_back"):
            speculated = counts.get("speculated", 0)
            print(f"\n{r['configuration']}: {speculated} bucket updates speculated (warm-up included), "
                  f"{counts.get('committed', 0)} committed, {counts.get('redone', 0)} redone "
                  f"({counts.get('redone', 0) / max(speculated, 1):.0%}), {counts.get('dropped', 0)} dropped, "
                  f"{counts.get('held_back', 0)} held back (updated at the step); "
                  f"{counts.get('left_running', 0)} redone or held back left running by a step that ended early")
        elif r.get("left_running"):
            print(f"\n{r['configuration']}: {r['left_running']} bucket updates left running by steps that ended "
                  "early (warm-up included)")
    if gpu and "fastopt:0" in by and "fastopt:1" in by:
        per_quarter = (by["fastopt:0"]["peak_gib"] - by["fastopt:1"]["peak_gib"]) / 4
        print(f"\nGPU memory saved per 25% of offload: {per_quarter:.2f} GiB")
    if plain and "fastopt:1" in by:
        print(f"slowdown at offload_fraction=1: {plain['tokens_per_s'] / by['fastopt:1']['tokens_per_s']:.2f}x "
              "(Megatron-style hybrid offload: 1.9x to 4.2x)")
    swept = tokens_table(rows)
    if swept:
        print(swept)
        if args.timeline:
            args.timeline.mkdir(parents=True, exist_ok=True)
            draw_tokens(rows, args.timeline / "tokens_per_step.png", f"tokens per step, {name}")
            print(f"tokens per step: {args.timeline / 'tokens_per_step.png'}")
    for r in rows:
        lanes = r.get("lanes")
        if not lanes or not any(lanes.values()):
            continue
        print(f"\n{r['configuration']}: {r['steps_profiled']} profiled step(s), {table(lanes)}")
        if args.timeline:
            args.timeline.mkdir(parents=True, exist_ok=True)
            path = args.timeline / f"timeline_{r['configuration'].replace(':', '_')}.png"
            draw(lanes, path, f"{r['configuration']}: {r['steps_profiled']} step(s), {name}")
            print(f"timeline: {path}")
    if args.out:
        args.out.write_text(json.dumps(dict(device=name, terms=terms and asdict(terms), rows=rows), indent=2))


def by_family(rows: list[dict]) -> dict[str, list[dict]]:
    """The rows by configuration without its ``:aN`` (one family a configuration, its accumulations)."""
    families: dict[str, list[dict]] = {}
    for r in rows:
        families.setdefault(split_accumulation(r["configuration"])[0], []).append(r)
    return families


def tokens_table(rows: list[dict]) -> str:
    """Issue 66's sweep: for each configuration run at more than one ``:aN``, its throughput
    against plain's at the same tokens per step (and clipping), and its bound's."""
    by = {r["configuration"]: r for r in rows}
    families = by_family(rows)
    lines = []
    for family, members in families.items():
        if family.startswith("plain") or len(members) < 2:
            continue
        lines += [f"\n{family}, by tokens per step:", "| tokens a step | tokens/s | plain's | vs plain | "
                  "bound's tokens/s | x bound | fraction |", "|---:|---:|---:|---:|---:|---:|---:|"]
        for r in sorted(members, key=lambda r: r["tokens_per_step"]):
            ref = by.get(reference_of(r["configuration"]))
            rel = f"{r['tokens_per_s'] / ref['tokens_per_s']:.1%}" if ref else "n/a"
            bound = r.get("bound_ms")
            at_bound = (f"{r['tokens_per_step'] / bound * 1e3:,.0f} | {r['step_ms'] / bound:.2f}x" if bound
                        else "n/a | n/a")
            lines.append(f"| {r['tokens_per_step']:,} | {r['tokens_per_s']:,.0f} | "
                         f"{ref['tokens_per_s'] if ref else float('nan'):,.0f} | {rel} | {at_bound} | "
                         f"{r['fraction'] if r.get('fraction') is not None else 'n/a'} |")
    return "\n".join(lines)


def draw_tokens(rows: list[dict], path: Path, title: str) -> None:
    """Tokens per second against tokens per step, a line per configuration (accumulations
    joined) and, dashed, each offloading one's bound (matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    families = by_family(rows)
    fig, ax = plt.subplots(figsize=(8, 5))
    for family, members in families.items():
        members = sorted(members, key=lambda r: r["tokens_per_step"])
        xs = [r["tokens_per_step"] for r in members]
        ax.plot(xs, [r["tokens_per_s"] for r in members], marker="o", label=family)
        bounded = [(r["tokens_per_step"], r["tokens_per_step"] / r["bound_ms"] * 1e3) for r in members
                   if r.get("bound_ms")]
        if bounded:
            ax.plot(*zip(*bounded), linestyle="--", label=f"{family}: its bound")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens a step")
    ax.set_ylabel("tokens a second")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _phases(row: dict) -> str:
    """The row's wall time by phase: the process's start (interpreter, torch) is what the child
    did not see."""
    phases = row.get("phases_s", {})
    start = row["wall_s"] - sum(phases.values())
    return ", ".join(f"{name} {s:.1f} s" for name, s in [("start", start), *phases.items()])


def _device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"


if __name__ == "__main__":
    main()
