"""Checkpoints of fastopt_offload in real processes: a run killed with SIGKILL and resumed
from its last epoch-boundary checkpoint ends bit for bit where an uninterrupted run ends
(fp16 loss scaling, an LR scheduler, shuffled data); a checkpoint resumes with another
offload fraction (bit for bit: the update is element-wise); plain torch AdamW checkpoints
resume under fastopt_offload and the other way round; a checkpoint of another model is a
clear error; checkpoints load with weights_only=True and are written atomically."""

import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_fastopt.core.checkpoint_io import AtomicCheckpointIO
from tests.helpers import run_script

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "tests" / "scripts" / "resume_run.py"
EPOCH_2 = "epoch=1-step=16.ckpt"  # the end of the second of four epochs of 8 steps


def _run(out, *args, expect_kill=False):
    proc = run_script(SCRIPT, out, *args, check=False)
    if expect_kill:
        assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
        return None
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out / "final.pt", weights_only=True)


def _assert_same(a, b):
    assert a["step"] == b["step"] == 32
    for k in a["weights"]:
        assert torch.equal(a["weights"][k], b["weights"][k]), k


@pytest.fixture(scope="module")
def fp16_run(tmp_path_factory):
    """An uninterrupted fastopt_offload run in fp16, a checkpoint at the end of each epoch."""
    out = tmp_path_factory.mktemp("uninterrupted")
    return out, _run(out, "--fp16")


@pytest.mark.cuda
@pytest.mark.parametrize("fraction", ["0", "0.5", "1"])
def test_sigkill_and_resume_on_gpu_is_bit_exact(tmp_path, fraction):
    """On the GPU: the device share runs the CUDA kernels, the host share the CPU kernels,
    copies go through side streams; killing and resuming still changes nothing."""
    args = ("--fp16", "--accelerator", "gpu", "--fraction", fraction)
    ref = _run(tmp_path / "ref", *args)
    _run(tmp_path / "killed", *args, "--kill-at-step", "20", expect_kill=True)
    last = tmp_path / "killed" / "ckpt" / "last.ckpt"
    resumed = _run(tmp_path / "killed", *args, "--resume", str(last))
    _assert_same(resumed, ref)
    assert resumed["loss_scale"] == ref["loss_scale"]


def test_sigkill_and_resume_is_bit_exact(fp16_run, tmp_path):
    ref_dir, ref = fp16_run
    _run(tmp_path, "--fp16", "--kill-at-step", "20", expect_kill=True)
    last = tmp_path / "ckpt" / "last.ckpt"
    assert torch.load(last, weights_only=True)["global_step"] == 16  # the epoch-2 checkpoint survived the kill
    assert not list((tmp_path / "ckpt").glob(".*.tmp"))
    resumed = _run(tmp_path, "--fp16", "--resume", str(last))
    _assert_same(resumed, ref)
    assert resumed["loss_scale"] == ref["loss_scale"]


@pytest.mark.parametrize("split", [(), ("--host-state-gib", "0.000003")], ids=["all-on-disk", "split"])
def test_with_the_state_on_disk_a_killed_run_resumes_bit_exact_and_leaves_no_file(fp16_run, tmp_path, split):
    """``offload_optimizer_device="nvme"``: killed (SIGKILL) mid-run, resumed from the last
    checkpoint (which holds the state read from the working file), it ends where the run
    with the state in host memory ends; the killed run's working file is gone (it never had
    a name).  So with part of the state in host memory (``host_state_gib``, issue 72)."""
    _, ref = fp16_run
    disk = tmp_path / "nvme"
    disk.mkdir()
    _run(tmp_path, "--fp16", "--nvme", str(disk), *split, "--kill-at-step", "20", expect_kill=True)
    assert os.listdir(disk) == []
    resumed = _run(tmp_path, "--fp16", "--nvme", str(disk), *split, "--resume", str(tmp_path / "ckpt" / "last.ckpt"))
    _assert_same(resumed, ref)
    assert resumed["loss_scale"] == ref["loss_scale"]


def test_resume_with_another_offload_fraction(fp16_run, tmp_path):
    ref_dir, ref = fp16_run
    resumed = _run(tmp_path, "--fp16", "--fraction", "0.5", "--resume", str(ref_dir / "ckpt" / EPOCH_2))
    _assert_same(resumed, ref)
    none_offloaded = _run(tmp_path, "--fp16", "--fraction", "0", "--resume", str(ref_dir / "ckpt" / EPOCH_2))
    _assert_same(none_offloaded, ref)


def test_checkpoint_is_plain_and_torch_compatible(fp16_run):
    ref_dir, _ = fp16_run
    ckpt = torch.load(ref_dir / "ckpt" / EPOCH_2, weights_only=True)
    sd = ckpt["optimizer_states"][0]
    assert set(sd["state"]) == set(ckpt["state_dict"])  # keyed by parameter name
    assert ckpt["FastOptPrecision"]["scale"] > 0
    from tests.scripts.resume_run import Model

    model = Model()
    opt = torch.optim.AdamW(model.parameters())
    opt.load_state_dict(sd)  # torch.optim takes it as it is
    assert torch.equal(opt.state[model.net[0].weight]["exp_avg"], sd["state"]["net.0.weight"]["exp_avg"])


def test_cross_resume_with_plain_torch_adamw(tmp_path):
    """A plain Lightning + torch AdamW checkpoint resumes under fastopt_offload, and a
    fastopt_offload one under plain Lightning; both end where the uninterrupted run of
    the checkpoint's writer ends, bit for bit."""
    torch_run = _run(tmp_path / "torch", "--strategy", "plain")
    ours_from_torch = _run(tmp_path / "a", "--resume", str(tmp_path / "torch" / "ckpt" / EPOCH_2))
    _assert_same(ours_from_torch, torch_run)
    ours = _run(tmp_path / "ours", "--fraction", "0.5")
    torch_from_ours = _run(tmp_path / "b", "--strategy", "plain", "--resume", str(tmp_path / "ours" / "ckpt" / EPOCH_2))
    _assert_same(torch_from_ours, ours)


def test_checkpoint_of_another_model_is_a_clear_error(fp16_run, tmp_path):
    ref_dir, _ = fp16_run
    ckpt = str(ref_dir / "ckpt" / EPOCH_2)
    proc = run_script(SCRIPT, tmp_path, "--width", "12", "--resume", ckpt, check=False)
    assert proc.returncode != 0 and "size mismatch for net.0.weight" in proc.stderr
    # same shapes under other names (and lenient weight loading): the optimizer state refuses
    proc = run_script(SCRIPT, tmp_path, "--prefix", "body", "--resume", ckpt, check=False)
    assert proc.returncode != 0
    assert "CheckpointMismatchError" in proc.stderr and "missing here: 'body.0.weight'" in proc.stderr


def test_atomic_write_leaves_the_old_checkpoint_whole(tmp_path, monkeypatch):
    io = AtomicCheckpointIO()
    path = tmp_path / "last.ckpt"
    io.save_checkpoint({"step": 1, "w": torch.ones(3)}, path)

    def dies_mid_write(obj, f, *a, **k):
        f.write(b"PK\x03\x04 half a checkpoint")
        raise KeyboardInterrupt  # the process is interrupted while writing

    monkeypatch.setattr(torch, "save", dies_mid_write)
    with pytest.raises(KeyboardInterrupt):
        io.save_checkpoint({"step": 2, "w": torch.zeros(3)}, path)
    monkeypatch.undo()
    assert torch.load(path, weights_only=True)["step"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]  # no temporary file left behind


def test_a_full_disk_is_said_as_such_naming_the_checkpoint(tmp_path, monkeypatch):
    """torch.save's writer replaces the system's ENOSPC with ``unexpected pos ...`` (issue:
    sharp edges): the error is the OSError, naming the checkpoint, as under plain
    Lightning; the old checkpoint stays whole and nothing is left behind."""
    import builtins
    import errno

    from lightning_fastopt.checkpoint import atomic

    path = tmp_path / "last.ckpt"
    atomic.save_atomically({"step": 1}, path)

    class FillsUp:  # a file on a disk with 100 kB free
        def __init__(self, f):
            self.f, self.written = f, 0

        def write(self, b):
            if self.written + len(b) > 100_000:
                raise OSError(errno.ENOSPC, "No space left on device")
            self.written += len(b)
            return self.f.write(b)

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    monkeypatch.setattr(atomic, "open", lambda p, mode: FillsUp(builtins.open(p, mode)), raising=False)
    with pytest.raises(OSError) as raised:
        atomic.save_atomically({"step": 2, "w": torch.zeros(2_000_000)}, path)
    monkeypatch.undo()
    assert raised.value.errno == errno.ENOSPC and raised.value.filename == str(path)
    assert "No space left on device" in str(raised.value)
    assert torch.load(path, weights_only=True)["step"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_checkpoint_files_honour_the_umask(tmp_path, umask, mode):
    """As Lightning's own writer (open()): 0666 less the umask (mkstemp's 0600 was not)."""
    old = os.umask(umask)
    try:
        AtomicCheckpointIO().save_checkpoint({"step": 1}, tmp_path / "last.ckpt")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "last.ckpt").st_mode) == mode


def test_leftovers_of_a_killed_save_are_removed_by_the_next_one(tmp_path):
    """Temporary files and staging directories of saves whose process is gone (on this
    machine) go; those of a live process, or of another machine, stay."""
    from lightning_fastopt.checkpoint.atomic import _host, temp_path

    path = tmp_path / "last.ckpt"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale_file = tmp_path / f".last.ckpt.{_host()}.{dead.pid}.0123abcd.tmp"
    stale_file.write_bytes(b"x" * 1000)
    stale_dir = tmp_path / f".last.ckpt.{_host()}.{dead.pid}.4567abcd.tmp"
    stale_dir.mkdir()
    (stale_dir / "optimizer_shard_00000.pt").write_bytes(b"x")
    live = Path(temp_path(path))  # this process's: a save in flight
    live.write_bytes(b"y")
    elsewhere = tmp_path / f".last.ckpt.otherhost.{dead.pid}.89abcdef.tmp"
    elsewhere.write_bytes(b"z")
    unrelated = tmp_path / f".other.ckpt.{_host()}.{dead.pid}.0123abcd.tmp"
    unrelated.write_bytes(b"w")
    AtomicCheckpointIO().save_checkpoint({"step": 1}, path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["last.ckpt", live.name, elsewhere.name, unrelated.name])
