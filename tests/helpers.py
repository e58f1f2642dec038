import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent

# The Trainer-level comparisons run on the CPU (CI, through the accelerator code path where a
# test asks for copy_on_cpu=True); FASTOPT_TEST_ACCELERATOR=gpu runs the same comparisons on a
# GPU against Trainer(accelerator="gpu") (benchmarks/gpu_session.sh tests).
ACCELERATOR = os.environ.get("FASTOPT_TEST_ACCELERATOR", "cpu")
if ACCELERATOR not in ("cpu", "gpu"):
    raise ValueError(f"FASTOPT_TEST_ACCELERATOR must be 'cpu' or 'gpu', got {ACCELERATOR!r}")

# Our FusedAdam made to round as torch.optim.AdamW's default step on the tests' accelerator:
# its CPU step (torch's square root) or, on a GPU, its CUDA foreach step (FusedAdam's
# default rounding is torch's CPU step wherever its parameters are).
ADAM_AS_TORCH = dict(torch_sqrt=True) if ACCELERATOR == "cpu" else dict(rounding="torch_cuda_foreach")

SIZES = (0, 1, 7, 1023)  # odd sizes: empty, scalar-like, sub-vector, tail after full vectors
BIG = 1_000_003  # spans many threads' shares and kernel blocks, with a tail
STEPS = 50

# Per-group hyperparameter overrides: three groups with different settings.
def split_groups(params, overrides):
    """Spread params over len(overrides) groups (round robin), each group with its overrides."""
    groups = [dict(params=[], **o) for o in overrides]
    for i, p in enumerate(params):
        groups[i % len(groups)]["params"].append(p)
    return groups


def twin_params(sizes, dtype=torch.float32, device="cpu"):
    base = [torch.randn(n, device=device) for n in sizes]
    a = [b.clone().to(dtype).requires_grad_() for b in base]
    b = [b.clone().to(dtype).requires_grad_() for b in base]
    return a, b


def run_twins(make_a, make_b, sizes, overrides, steps=STEPS, grad_dtype=None, after_step=None, device="cpu"):
    """Train two optimizers on identical params and identical random grads; return both param lists."""
    a, b = twin_params(sizes, device=device)
    opt_a = make_a(split_groups(a, overrides))
    opt_b = make_b(split_groups(b, overrides))
    for step in range(steps):
        for x, y in zip(a, b):
            g = torch.randn_like(x)
            x.grad = g.clone() if grad_dtype is None else g.to(grad_dtype)
            y.grad = g.clone() if grad_dtype is None else g.to(grad_dtype).float()
        opt_a.step()
        opt_b.step()
        if after_step:
            after_step(step, opt_a, opt_b)
    return a, b, opt_a, opt_b


def assert_params_equal(a, b):
    """torch.equal, parameter by parameter, saying how far apart a differing pair is."""
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x, y), f"param {i} (numel {x.numel()}): {(x.double() - y.double()).abs().max().item()} away"


def assert_modules_equal(ours, ref):
    """torch.equal, parameter by parameter, of two modules, saying which parameter and how
    far apart where they differ."""
    ours_params, ref_params = list(ours.named_parameters()), list(ref.parameters())
    assert len(ours_params) == len(ref_params)
    for (name, a), b in zip(ours_params, ref_params):
        assert torch.equal(a, b), f"{name}: {(a.double() - b.double()).abs().max().item()} away"


def assert_params_close(a, b, rtol, atol):
    for i, (x, y) in enumerate(zip(a, b)):
        torch.testing.assert_close(x.detach(), y.detach(), rtol=rtol, atol=atol,
                                   msg=lambda m: f"param {i} (numel {x.numel()}): {m}")


def free_port() -> int:
    """A TCP port on this machine free now (for a process group's rendezvous)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_script(*args, timeout: int = 600, ranks: int | None = None, check: bool = True):
    """``python ARGS`` (a script of tests/scripts and its arguments, or ``-m MODULE ...``)
    from the repository root in a child process's environment (:func:`subprocess_env`);
    the test fails, with the end of its stderr, unless it exits 0 (``check=False``: a run
    expected to fail or be killed; the returned process then holds rank 0's exit code).

    ``ranks``: None, the script alone is started (a Lightning run of several processes
    starts the others itself: Lightning's launcher); a number, the script is one process
    of a Lightning run of that many on this machine, and all of them start at once, each
    with the variables Lightning's launcher gives the processes it starts
    (``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``, ``NODE_RANK``, ``LOCAL_RANK``), as
    torchrun or a cluster's scheduler starts them: Lightning then starts none.  Started by
    Lightning, rank 1 waits for rank 0 to import and build its Trainer, which took half of
    a two-process run's 8 s on 2 cores.  Rank 0's process is returned (its output holds
    the run's log lines).  Each is forked from a process that imported torch already
    (:mod:`tests.forked_runs`; ``FASTOPT_TESTS_FORK=0``: a fresh interpreter)."""
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    command = [sys.executable, *map(str, args)]
    launched = {} if ranks is None else dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                                             WORLD_SIZE=str(ranks), NODE_RANK="0")
    with tempfile.TemporaryDirectory() as logs:
        outputs = [(Path(logs, f"{r}.out"), Path(logs, f"{r}.err")) for r in range(ranks or 1)]
        procs = []
        for rank, (out, err) in enumerate(outputs):
            env = {**subprocess_env(repo), **launched, **({} if ranks is None else {"LOCAL_RANK": str(rank)})}
            procs.append(_start(command, repo, env, out, err))
        deadline = time.monotonic() + timeout
        try:  # until all have exited, or one failed (the others would wait for it at their next collective)
            while any(p.poll() is None for p in procs) and not any(p.poll() for p in procs):
                if time.monotonic() > deadline:
                    raise subprocess.TimeoutExpired(command, timeout)
                time.sleep(0.05)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        texts = [(out.read_text(), err.read_text()) for out, err in outputs]
    for rank, (proc, (_, err)) in enumerate(zip(procs, texts)):
        said = (f"rank {rank} exited {proc.returncode}: " if ranks else "") + err[-3000:]
        assert proc.returncode == 0 or not check, said
    return subprocess.CompletedProcess(command, procs[0].returncode, *texts[0])


class _ForkedChild:
    """A child of the fork server (:mod:`tests.forked_runs`), as much of ``Popen`` as
    :func:`run_script` uses."""

    def __init__(self, server, pid: int) -> None:
        self.server, self.pid, self.returncode = server, pid, None

    def poll(self):
        if self.returncode is None:
            self.returncode = self.server.poll(self.pid)
        return self.returncode

    def kill(self) -> None:
        self.server.kill(self.pid)

    def wait(self):
        self.returncode = self.server.wait(self.pid)
        return self.returncode


def _start(command, repo, env, out, err):
    """``command`` (``[python, ARGS...]``) with ``env`` in ``repo``, its output in the files
    ``out`` and ``err``: forked from the session's fork server (:mod:`tests.forked_runs`),
    or a fresh interpreter where that is off."""
    import subprocess

    from tests.forked_runs import fork_server

    server = fork_server(subprocess_env(repo), repo)
    if server is not None:
        return _ForkedChild(server, server.start(command[1:], env, repo, out, err))
    with open(out, "w") as o, open(err, "w") as e:
        return subprocess.Popen(command, cwd=repo, stdout=o, stderr=e, text=True, env=env)


def spawn_two_ranks(worker, *args) -> None:
    """``worker(rank, port, *args)`` in two processes (torch.multiprocessing), ``port`` a
    free one for their process group's rendezvous on this machine."""
    torch.multiprocessing.spawn(worker, args=(free_port(), *args), nprocs=2)


def subprocess_env(repo):
    """The environment for a child training process: this one without the distributed
    variables that in-process Lightning runs leave behind (with their port still held)."""
    import os

    dist_vars = {"MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK",
                 "LOCAL_WORLD_SIZE"}
    env = {k: v for k, v in os.environ.items() if k not in dist_vars and not k.startswith("PL_")}
    env["PYTHONPATH"] = str(repo)
    return env


class SlowBackward(torch.autograd.Function):
    """The identity, whose backward sleeps ``SlowBackward.seconds``: reductions sent before
    it complete while backward runs (tests of what happens during backward)."""

    seconds = 0.03

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        time.sleep(SlowBackward.seconds)
        return g


def end_process_group():
    """Destroy the default process group, if any, before a child process exits: gloo's
    worker threads still alive while the interpreter finalizes can abort the process
    ("terminate called without an active exception", seen once in a Fabric ZeRO resume);
    Lightning destroys it at exit for NCCL only."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def finish_process():
    """End a child training process once its results are written: wait for every rank to
    have written its own, destroy the process group, then leave at once, without the
    interpreter's finalization, where gloo's worker threads still alive abort the process
    now and then ("terminate called without an active exception", after the results were
    saved; gloo's threads at finalization, pytorch/pytorch#190489): 4 of about 140 FSDP test
    runs on 2026-11-26, each a run of ours (resumes, a Fabric loop), none in 46 runs of
    the same resume by hand, ours and the reference's; once before, in a Fabric ZeRO resume.
    Our code starts no C++ thread; what aborted was not found."""
    import os
    import sys

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    end_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def allocated_bytes(opt):
    """Bytes of every master, host buffer and state tensor an OffloadOptimizer holds, and
    the most the cache-line padding of its host views may add (< 64 bytes per view)."""
    seen, total = set(), 0
    tensors = [t for b in opt.layout.buckets for t in b.buffers]
    tensors += [s.master for s in opt.layout.slots if s.separate_master and s.bucket is None]
    tensors += [v for inner in opt.layout.inners() for st in inner.state.values() for k, v in st.items() if k != "step"]
    for t in tensors:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total, 3 * 64 * sum(len(b.slots) for b in opt.layout.buckets)


def memory_model(dtype=torch.float32, layers=None, rows=()):
    """The small model of the memory estimate's tests (tests/test_memory.py); with
    ``layers``, that many Linear(32, 32) instead (ZeRO: several tensors per rank), and with
    ``rows`` Linear(32, r) after them (FSDP: rows that do not divide evenly)."""
    torch.manual_seed(0)
    if layers:
        sizes = [32] * layers + list(rows)
        return torch.nn.Sequential(*[torch.nn.Linear(32 if i == 0 else sizes[i - 1], n)
                                     for i, n in enumerate(sizes)]).to(dtype)
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10)).to(dtype)


def said_lines(monkeypatch, *modules) -> list[str]:
    """The messages our code passes to ``rank_zero_info`` in ``modules`` from now on, each
    once: what the code said, not what a logging set-up happens to capture (pytest 9's
    caplog captures Lightning's records twice)."""
    said: list[str] = []
    for module in modules:
        monkeypatch.setattr(module, "rank_zero_info", lambda message, *a, **k: said.append(str(message)))
    return said


def counting_checkpoint_io():
    """A checkpoint plugin of the user's (Lightning's and Fabric's TorchCheckpointIO are one
    class) that counts its saves in ``saves``."""
    from lightning.fabric.plugins.io import TorchCheckpointIO

    class CountingCheckpointIO(TorchCheckpointIO):
        saves = 0

        def save_checkpoint(self, *args, **kwargs):
            self.saves += 1
            return super().save_checkpoint(*args, **kwargs)

    return CountingCheckpointIO()


def assert_bfloat16_moments_followed(ours, exact, steps=6, lr=1e-2):
    """Runs' results (per rank: ``weight/...`` and ``state/...`` tensors) with bfloat16 host
    moments against the float32 moments' run: no exact reference exists (stochastic rounding
    of the moments), so each weight within 2% of a step of the float32 run's after ``steps``
    steps of ``lr``, not all equal (the moments were rounded), the state given back float32."""
    import torch

    for a, b in zip(ours, exact):
        weights = [k for k in b if k.startswith("weight/")]
        for k in weights:
            torch.testing.assert_close(a[k], b[k], rtol=0, atol=0.02 * steps * lr)
        assert not all(torch.equal(a[k], b[k]) for k in weights)
        assert {a[k].dtype for k in a if k.startswith("state/") and not k.endswith("/step")} == {torch.float32}


def on_disk_through_two_buckets(directory, build) -> dict:
    """An offload optimizer's arguments for its masters and state on disk in ``directory``
    through a window of two slots (2.5 of its largest bucket's regions: with three buckets
    or more, every step reads some back); ``build(**arguments)`` makes the optimizer, once
    here to size its regions."""
    disk = dict(offload_optimizer_device="nvme", nvme_path=str(directory), nvme_window_mb=64)
    sizing = build(**disk)
    disk["nvme_window_mb"] = 2.5 * max(r.size for r in sizing.layout.tier.regions.values()) / 2**20
    sizing.close()
    return disk


def run_counts(out, name: str, ranks) -> list[tuple[int, ...] | None]:
    """Each rank's numbers a run script wrote to ``OUT.<name>.rank<r>`` (None where it wrote none)."""
    from pathlib import Path

    files = [Path(f"{out}.{name}.rank{r}") for r in ranks]
    return [tuple(map(int, f.read_text().split())) if f.exists() else None for f in files]


def mapped_files() -> list[tuple[int, int, str]]:
    """Each file mapping of this process: (start, end, the file as ``/proc/self/maps`` names
    it, `` (deleted)`` after an unlinked one's name); empty where there is no such file (not Linux)."""
    try:
        with open("/proc/self/maps") as maps:
            fields = [line.split(maxsplit=5) for line in maps]
    except OSError:
        return []
    return [(int(f[0].split("-")[0], 16), int(f[0].split("-")[1], 16), f[5].strip())
            for f in fields if len(f) == 6 and f[5].startswith("/")]


def mapped_file_of(tensor) -> str | None:
    """The file whose mapping holds ``tensor``'s memory, or None where it is the process's own."""
    address = tensor.data_ptr()
    return next((name for start, end, name in mapped_files() if start <= address < end), None)


def compiled_check(tmp_path_factory, source: str, *flags: str) -> Path:
    """tests/cpp/``source`` compiled on the host by the C++ compiler (with ``csrc`` on the
    include path and ``flags``), the executable's path; the test skips without a compiler."""
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    exe = tmp_path_factory.mktemp(Path(source).stem) / Path(source).stem
    subprocess.run([cxx, *flags, f"-I{REPO / 'csrc'}", str(REPO / "tests/cpp" / source), "-o", str(exe)], check=True)
    return exe
