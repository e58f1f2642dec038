"""The largest GPT that trains on one GPU with its weights in host memory (issue 52).

    python benchmarks/largest_model.py --gpu-gib 24                 # float32 Adam moments
    python benchmarks/largest_model.py --gpu-gib 24 --state bfloat16  # host_state_dtype="bfloat16"
    python benchmarks/largest_model.py --tiny                       # a tiny GPT on any machine: the script runs
    python benchmarks/largest_model.py --gpu-gib 0 --nvme-path DIR --state bfloat16   # the whole GPU, the
                                             # state on DIR's disk and what host memory has free (issue 66, 72)

The GPU is capped at ``--gpu-gib`` (``torch.cuda.set_per_process_memory_fraction``), the
host is what the kernel says is available (``MemAvailable``, or ``--host-gib``).  First
``sizes_that_fit`` estimates, for the byte-level GPT of examples/gpt.py at width
``--width`` and each depth of ``--layers``, what ``FastOptFSDPStrategy(offload_parameters=True,
auto_wrap_policy={Block})`` holds on the GPU (FSDP's units in flight, before activations)
and in host memory (the shards, their gradients, AdamW's state: 16 bytes a parameter, 12
with bfloat16 moments), each model built on the meta device, and prints the table.  Then
the deepest model estimated to fit (leaving ``--headroom`` of the host for everything the
estimate does not count) trains ``--steps`` steps in a process of its own (a fresh CUDA
context), built on the meta device and materialized in host memory, bf16-mixed,
``stream_cpu_step=True``, one sequence of ``--tokens`` a step; where it fails (out of
memory), the next shallower one.  Printed and written to ``--out`` (JSON): each try's
parameters, whether it trained, its last steps' time, the GPU's peak allocation and the
process's peak resident host memory.

With ``--nvme-path`` the optimizer state goes to a file on that directory's disk
(``offload_optimizer_device="nvme"``) and host memory keeps what it has free of it
(``host_state_gib="auto"``): a depth fits where the GPU, host memory (the rows, their
gradients and the disk window) and the disk (the state host memory cannot keep) each hold
their share.  ``--gpu-gib 0``: the whole GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "examples"))


def _gpt(layers: int, width: int, tokens: int):
    from gpt import TinyGPT

    return TinyGPT(n_layer=layers, n_head=max(width // 128, 1), n_embd=width, block_size=tokens)


def _whole_gpu_bytes() -> float:
    """The GPU's memory (``--gpu-gib 0``); without one (``--tiny``), 1 GiB."""
    import torch

    return float(torch.cuda.get_device_properties(0).total_memory) if torch.cuda.is_available() else float(2**30)


def available_host_bytes() -> int | None:
    from lightning_fastopt.offload.speculative import available_host_bytes as available

    return available()


def plan(args) -> list[dict]:
    """The estimate of each depth: parameters, GPU and host bytes, whether it fits."""
    from gpt import Block

    from lightning_fastopt import sizes_that_fit

    host = args.host_bytes * (1 - args.headroom)
    disk = {} if args.nvme_path is None else dict(offload_optimizer_device="nvme")
    rows = sizes_that_fit(lambda n: _gpt(n, args.width, args.tokens), args.layers, args.gpu_bytes, host,
                          zero_stage=3, offload_parameters=True, auto_wrap_policy={Block}, precision="bf16-mixed",
                          host_state_dtype=None if args.state == "float32" else args.state, **disk)
    out = []
    for n, e, fits in rows:
        row = dict(layers=n, params=e.total_params, gpu_gib=e.gpu_total / 2**30, host_gib=e.cpu_total / 2**30,
                   fits=fits)
        if args.nvme_path is not None:  # host memory keeps what it has free of the state, the disk the rest
            kept = max(0.0, min(host - e.cpu_total, e.disk))
            row.update(host_gib=(e.cpu_total + kept) / 2**30, disk_gib=(e.disk - kept) / 2**30,
                       fits=fits and e.disk - kept <= args.disk_bytes)
        out.append(row)
    return out


def child(args) -> None:
    """One depth trained (in its own process): prints one JSON line."""
    import lightning as L
    import torch
    from gpt import Block

    from lightning_fastopt import FastOptFSDPStrategy

    cuda = torch.cuda.is_available() and not args.tiny
    if cuda and args.gpu_gib:  # (0: the whole GPU)
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(args.gpu_gib * 2**30 / total, 1.0))

    began = time.perf_counter()

    def progress(what: str) -> None:  # a try cut off says how far it got (the parent keeps the last line)
        print(f"{PROGRESS}{what} after {time.perf_counter() - began:.1f} s", flush=True)

    class Timed(L.Callback):
        def __init__(self):
            self.times = []

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if cuda:
                torch.cuda.synchronize()
            if batch_idx == 0:
                progress("set up: the first step begins")
            self.started = time.perf_counter()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if cuda:
                torch.cuda.synchronize()
            self.times.append(time.perf_counter() - self.started)
            progress(f"step {batch_idx + 1} took {self.times[-1]:.2f} s; GPU peak "
                     f"{torch.cuda.max_memory_allocated() / 2**30 if cuda else 0:.3g} GiB, host peak "
                     f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30:.3g} GiB")

    class Model(L.LightningModule):  # the GPT with AdamW (examples/gpt.py takes its optimizer from the CLI)
        def __init__(self):
            super().__init__()
            self.gpt = _gpt(args.child, args.width, args.tokens)

        def forward(self, x):
            return self.gpt(x)

        def training_step(self, batch, _):
            x, y = batch
            return torch.nn.functional.cross_entropy(self(x).float().flatten(0, 1), y.flatten())

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4, weight_decay=0.01)

    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (args.steps, args.tokens + 1), generator=g)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data[:, :-1], data[:, 1:]), batch_size=1)
    timed = Timed()
    disk = {} if args.nvme_path is None else dict(offload_optimizer_device="nvme", nvme_path=args.nvme_path,
                                                  host_state_gib="auto")
    strategy = FastOptFSDPStrategy(offload_parameters=True, auto_wrap_policy={Block}, stream_cpu_step=True,
                                   host_state_dtype=args.state, **disk)
    _say_set_up_phases(strategy, progress)
    trainer = L.Trainer(accelerator="cuda" if cuda else "cpu", devices=1, max_steps=args.steps, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        precision="bf16-mixed", strategy=strategy, callbacks=[timed])
    with trainer.init_module(empty_init=True):
        model = Model()
    progress("built on the meta device")
    trainer.fit(model, loader)
    last = timed.times[-2:] if len(timed.times) > 2 else timed.times
    print(json.dumps(dict(layers=args.child, params=sum(p.numel() for p in model.parameters()), trained=True,
                          steps=trainer.global_step, step_s=sum(last) / len(last), wall_s=time.perf_counter() - began,
                          gpu_peak_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
                          host_peak_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30)))


def _say_set_up_phases(strategy, progress) -> None:
    """Progress lines inside the strategy's set-up (a try the time limit cut off there says
    which phase it was in): before and after the sharded model is materialized in host
    memory, and once the optimizer is set up.  The model is materialized on every core
    (:func:`host_init.initialize_on_all_cores`: the strategy's own way, each module's
    ``reset_parameters``, draws on one thread, 0.22 G parameters a second on the dev VM)."""
    from host_init import initialize_on_all_cores

    from lightning_fastopt.trainer import fsdp_strategy

    def materialized(model) -> None:
        progress("sharded on the meta device; materializing it in host memory")
        started = time.perf_counter()
        filled = initialize_on_all_cores(model)
        seconds = time.perf_counter() - started
        progress(f"materialized in host memory: {filled / 1e9:.3g}B elements in {seconds:.1f} s, "
                 f"{filled / max(seconds, 1e-9) / 1e9:.2f}B a second")

    fsdp_strategy.materialize_on_the_host = materialized
    setup_optimizers = strategy.setup_optimizers

    def optimizers_set_up(trainer) -> None:
        setup_optimizers(trainer)
        progress("the optimizer set up")

    strategy.setup_optimizers = optimizers_set_up


def run_child(args, layers: int) -> dict:
    command = [sys.executable, __file__, "--child", str(layers), "--width", str(args.width), "--tokens",
               str(args.tokens), "--steps", str(args.steps), "--state", args.state, "--gpu-gib", str(args.gpu_gib)]
    command += [] if getattr(args, "nvme_path", None) is None else ["--nvme-path", str(args.nvme_path)]
    command += ["--tiny"] if args.tiny else []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=args.timeout_s)
    except subprocess.TimeoutExpired as stopped:  # (subprocess.run killed it)
        return dict(layers=layers, trained=False, error=f"stopped after --timeout-s {args.timeout_s} s",
                    got_to=last_progress(_text(stopped.stdout)))
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode == 0 and lines:
        return json.loads(lines[-1])
    return dict(layers=layers, trained=False, error=failure(done.returncode, done.stderr or done.stdout),
                got_to=last_progress(done.stdout))


PROGRESS = "PROGRESS "  # the child's lines that say how far it got


def _text(output) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


def last_progress(stdout: str) -> str | None:
    """The last of the child's progress lines, without its prefix (None: it printed none)."""
    lines = [line[len(PROGRESS):] for line in stdout.splitlines() if line.startswith(PROGRESS)]
    return lines[-1] if lines else None


def failure(returncode: int, printed: str) -> str:
    """Why a child failed, in one line: the signal that ended it (the kernel's out-of-memory
    killer sends 9), else the exception its traceback ends with, else its last line (a
    warning printed after the traceback is not the cause)."""
    if returncode < 0:
        return f"killed by signal {-returncode}" + (" (the host's out-of-memory killer sends it)" if returncode == -9
                                                     else "")
    lines = printed.strip().splitlines()
    raised = [line for line in lines if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt)\b", line)]
    return (raised or lines[-1:] or [f"exit {returncode}"])[-1][:300]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gpu-gib", type=float, default=24.0, help="the GPU's cap; 0: the whole GPU")
    parser.add_argument("--nvme-path", default=None, help="the optimizer state on this directory's disk "
                                                          "(offload_optimizer_device='nvme', host_state_gib='auto')")
    parser.add_argument("--host-gib", type=float, default=None, help="default: MemAvailable")
    parser.add_argument("--headroom", type=float, default=0.1, help="share of the host left to what is not estimated")
    parser.add_argument("--state", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--layers", type=lambda s: [int(x) for x in s.split(",")],
                        default=list(range(8, 81, 4)), help="depths to estimate, comma-separated")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--tries", type=int, default=2, help="depths to try, deepest fitting first")
    parser.add_argument("--timeout-s", type=int, default=600)
    parser.add_argument("--out", default=None)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.tiny and args.child is None:
        args.width, args.tokens, args.steps, args.gpu_gib = 64, 16, 3, 1.0
        args.layers = [1, 2, 3, 4, 5, 6]
        args.host_gib = args.host_gib or 2.5 * 2**20 / 2**30  # a few MiB: the deeper ones do not fit
        args.headroom = 0.0
    if args.child is not None:
        return child(args)
    args.host_bytes = args.host_gib * 2**30 if args.host_gib else available_host_bytes()
    if args.host_bytes is None:
        parser.error("this system does not say how much host memory is available: give --host-gib")
    args.gpu_bytes = args.gpu_gib * 2**30 if args.gpu_gib else _whole_gpu_bytes()
    if args.nvme_path is not None:
        Path(args.nvme_path).mkdir(parents=True, exist_ok=True)
        args.disk_bytes = shutil.disk_usage(args.nvme_path).free * (1 - args.headroom)
    rows = plan(args)
    disk = "" if args.nvme_path is None else f", disk {args.disk_bytes / 2**30:.3g} GiB free in {args.nvme_path}"
    gpu = f"capped at {args.gpu_gib:g}" if args.gpu_gib else f"whole, {args.gpu_bytes / 2**30:.3g}"
    print(f"GPU {gpu} GiB, host {args.host_bytes / 2**30:.3g} GiB{disk} ({args.headroom:.0%} left aside), width "
          f"{args.width}, AdamW moments {args.state}")
    on_disk = args.nvme_path is not None
    print("| layers | parameters | GPU GiB (units in flight) | host GiB |" + (" disk GiB |" if on_disk else "")
          + " fits |")
    print("|---:|---:|---:|---:|" + ("---:|" if on_disk else "") + ":---:|")
    for r in rows:
        print(f"| {r['layers']} | {r['params'] / 1e9:.3g}B | {r['gpu_gib']:.3g} | {r['host_gib']:.3g} | "
              + (f"{r['disk_gib']:.3g} | " if on_disk else "") + f"{'yes' if r['fits'] else 'no'} |")
    tries = []

    def save() -> None:  # the plan, then again after each try: a run cut off keeps the ones before
        if args.out:
            Path(args.out).write_text(json.dumps(dict(plan=rows, tries=tries), indent=1))

    save()
    for r in sorted((r for r in rows if r["fits"]), key=lambda r: -r["layers"])[:args.tries]:
        got = run_child(args, r["layers"])
        tries.append(dict(r, **got))
        save()
        if got["trained"]:
            print(f"trained: {got['layers']} layers, {got['params'] / 1e9:.3g}B parameters, {got['step_s']:.3g} s a "
                  f"step, GPU peak {got['gpu_peak_gib'] or 0:.3g} GiB (estimated {r['gpu_gib']:.3g} before "
                  f"activations), host peak {got['host_peak_gib']:.3g} GiB (estimated {r['host_gib']:.3g})")
            break
        print(f"did not train: {r['layers']} layers ({got['error']}; got to: {got['got_to'] or 'nothing printed'})",
              flush=True)


if __name__ == "__main__":
    main()
