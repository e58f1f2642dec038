"""The offloaded masters and optimizer state on a disk (``offload_optimizer_device="nvme"``,
issue 53): the offload optimizer with its host buckets' masters and state in a working file
(``lightning_fastopt/offload/state_tiers.py`` over ``runtime/direct_io.py``) ends where the
same optimizer with them in host memory ends, bit for bit, for every optimizer the kernels
step, at fractions 0.4 and 1, on the CPU's path and the accelerator's (``copy_on_cpu=True``),
with half-precision weights, clipping, loss scaling and accumulation; its state dict is the
same and loads both ways; between steps the tensors point at nothing and host memory holds
only the window; a bad directory, window or disk is an error naming what to change; the
file leaves nothing behind."""

import errno
import os
import re

import pytest
import torch

from lightning_fastopt import FusedAdagrad, FusedAdam, FusedLAMB, FusedLars, FusedLion, FusedSGD
from lightning_fastopt.offload import OffloadOptimizer
from lightning_fastopt.runtime import direct_io
from lightning_fastopt.runtime.direct_io import ALIGN, DirectFile, aligned_empty
from tests.helpers import SIZES, on_disk_through_two_buckets, split_groups

GROUPS = [dict(), dict(lr=3e-3, weight_decay=0.0)]
ALGORITHMS = {
    "adamw": lambda g: FusedAdam(g, lr=1e-2, weight_decay=0.05),
    "amsgrad": lambda g: FusedAdam(g, lr=1e-2, weight_decay=0.05, amsgrad=True),
    "adamw-bf16-moments": lambda g: FusedAdam(g, lr=1e-2, weight_decay=0.05, state_dtype=torch.bfloat16),
    "sgd": lambda g: FusedSGD(g, lr=1e-2, momentum=0.9, nesterov=True, weight_decay=1e-3),
    "adagrad": lambda g: FusedAdagrad(g, lr=1e-2, lr_decay=1e-3),
    "lion": lambda g: FusedLion(g, lr=1e-3, weight_decay=0.1),
    "lars": lambda g: FusedLars(g, lr=1e-2, momentum=0.9, weight_decay=1e-4),
    "lamb": lambda g: FusedLAMB(g, lr=1e-2, weight_decay=0.01, max_grad_norm=1.0),
}
SIZES_HERE = SIZES * 2 + (3000,)


def _params(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g).to(dtype).requires_grad_() for n in SIZES_HERE]


def _optimizer(params, make, tmp_path=None, window_mb=None, **kw):
    """The offload optimizer over ``params`` in two groups, its masters and state on disk
    in ``tmp_path`` where given, through a window of two slots (``window_mb``: of this
    size): with three buckets or more, every step reads some of them back from the file."""
    def build(**disk):
        return OffloadOptimizer(make(split_groups(params, GROUPS)), {p: f"p{i}" for i, p in enumerate(params)},
                                bucket_size_mb=0.004, **disk, **kw)
    if tmp_path is None:
        return build()
    if window_mb is None:
        return build(**on_disk_through_two_buckets(tmp_path, build))
    return build(offload_optimizer_device="nvme", nvme_path=str(tmp_path), nvme_window_mb=window_mb)


@pytest.fixture
def reads(monkeypatch):
    """How many regions the disk tiers read back from their files."""
    count = [0]
    read_into = DirectFile.read_into

    def counted(self, buffer, offset):
        count[0] += 1
        return read_into(self, buffer, offset)
    monkeypatch.setattr(DirectFile, "read_into", counted)
    return count


def _train(opt, params, steps, seed=1, start=0):
    """Steps with some parameters without a gradient, two backwards on some steps
    (accumulation), a spike (LAMB's clipping), loss scaling with an overflow (a skipped
    step) and clipping by norm on others."""
    g = torch.Generator().manual_seed(seed)
    for step in range(start, start + steps):
        opt.zero_grad()
        for _ in range(2 if step % 3 == 0 else 1):
            for i, p in enumerate(params):
                if (step + i) % 5 == 0:
                    continue
                grad = torch.randn(p.shape, generator=g).to(p.dtype) * (1e3 if step == 2 and i == 1 else 1)
                p.grad = grad if p.grad is None else p.grad + grad
        if step % 4 == 1:  # fp16-style: scaled gradients, checked for overflow, unscaled in the kernel
            grads = opt.gradients()
            torch._foreach_mul_(grads, 128.0)
            if step == 5 and grads and grads[-1].numel():
                grads[-1][0] = float("inf")
            opt.step(grad_scale=128.0, check_finite=True)
            continue
        if step % 4 == 3:  # clipping by norm, as the precision plugins clip
            total = opt.gradient_norm()
            torch._foreach_mul_(opt.gradients(), torch.clamp(0.5 / (total + 1e-6), max=1.0))
        opt.step()


@pytest.mark.parametrize("copy_on_cpu", [False, True], ids=["cpu-run", "accelerator-path"])
@pytest.mark.parametrize("fraction", [0.4, 1.0])
@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_the_disk_tier_ends_where_host_memory_ends(tmp_path, reads, algorithm, fraction, copy_on_cpu):
    make = ALGORITHMS[algorithm]
    ref_params, params = _params(), _params()
    ref = _optimizer(ref_params, make, offload_fraction=fraction, copy_on_cpu=copy_on_cpu)
    opt = _optimizer(params, make, tmp_path, offload_fraction=fraction, copy_on_cpu=copy_on_cpu)
    assert len(opt.layout.buckets) >= (3 if fraction == 1.0 else 2) and len(opt.layout.tier.window) == 2
    _train(ref, ref_params, 12)
    _train(opt, params, 12)
    assert reads[0] >= (12 if fraction == 1.0 else 0)  # (each step read buckets back from the file)
    assert opt.skipped_steps == ref.skipped_steps == 1
    for a, b in zip(params, ref_params):
        assert torch.equal(a, b)
    _assert_same_state(opt.state_dict(), ref.state_dict())
    opt.close()
    ref.close()


def _assert_same_state(ours, ref):
    assert ours["param_groups"] == ref["param_groups"] and ours["state"].keys() == ref["state"].keys()
    for name, st in ref["state"].items():
        assert ours["state"][name].keys() == st.keys(), name
        for key, value in st.items():
            assert torch.equal(torch.as_tensor(ours["state"][name][key]), torch.as_tensor(value)), (name, key)


def test_half_weights_keep_their_float32_masters_on_disk(tmp_path):
    """bfloat16 weights: the float32 masters (and the state) in the file, the half copies
    that go to the device in host memory; the masters' low bits survive every round trip."""
    ref_params, params = _params(torch.bfloat16), _params(torch.bfloat16)
    make = ALGORITHMS["adamw"]
    ref = _optimizer(ref_params, make, copy_on_cpu=True)
    opt = _optimizer(params, make, tmp_path, copy_on_cpu=True)
    _train(ref, ref_params, 8)
    _train(opt, params, 8)
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params))
    _assert_same_state(opt.state_dict(), ref.state_dict())  # (fp32_master beside each half weight's state)
    assert any("fp32_master" in st for st in opt.state_dict()["state"].values())
    opt.close()
    ref.close()


def test_between_steps_only_the_window_is_in_host_memory(tmp_path):
    """After a step every master and state tensor of the buckets points at nothing: host
    memory holds the window (two slots here), the gradient buffers and the step counts."""
    params = _params()
    opt = _optimizer(params, ALGORITHMS["adamw"], tmp_path, copy_on_cpu=True)
    _train(opt, params, 3)
    tier = opt.layout.tier
    for b in opt.layout.buckets:
        assert all(s.master.numel() == 0 for s in b.slots)
        for s in b.slots:
            state = b.inner.state.get(s.master, {})
            assert state and all(v.numel() <= 1 for v in state.values()), s.name  # (the step count)
    window = sum(slot.buffer.numel() for slot in tier.window)
    assert window <= tier.window_bytes and len(tier.window) == 2
    held = sum(s.numel for s in opt.layout.slots if s.offloaded)
    assert tier.disk_bytes() >= 12 * held  # the masters and two moments of every offloaded parameter
    assert os.listdir(tmp_path) == []  # the working file has no name: a killed run leaves nothing
    opt.close()


def test_a_state_dict_loads_both_ways_and_another_fraction_follows(tmp_path):
    """A host-memory optimizer's state dict into a disk one (and back): both go on to the
    same bits; ``with_fraction`` moves the state, masters included, to a new disk optimizer."""
    make = ALGORITHMS["adamw"]
    first = _params()
    src = _optimizer(first, make, copy_on_cpu=True)
    _train(src, first, 5)
    saved = src.state_dict()
    ref_params, params = [p.detach().clone().requires_grad_() for p in first], \
        [p.detach().clone().requires_grad_() for p in first]
    ref = _optimizer(ref_params, make, copy_on_cpu=True)
    opt = _optimizer(params, make, tmp_path, copy_on_cpu=True)
    ref.load_state_dict(saved)
    opt.load_state_dict(saved)
    _train(ref, ref_params, 3, start=5)
    _train(ref, ref_params, 2, start=8)
    _train(opt, params, 3, start=5)
    opt = opt.with_fraction(0.4)
    _train(opt, params, 2, start=8)
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params))
    back = _optimizer([p.detach().clone().requires_grad_() for p in params], make, copy_on_cpu=True)
    back.load_state_dict(opt.state_dict())
    _assert_same_state(back.state_dict(), ref.state_dict())
    for o in (src, ref, opt, back):
        o.close()


def test_bad_directories_windows_and_schedules_are_refused_by_name(tmp_path):
    params = _params()
    sgd = lambda ps: FusedSGD(ps, lr=0.1)  # noqa: E731
    with pytest.raises(ValueError, match=r"offload_optimizer_device must be one of \('cpu', 'nvme'\)"):
        OffloadOptimizer(sgd(params), offload_optimizer_device="disk")
    with pytest.raises(ValueError, match="offload_optimizer_device='nvme' .* give nvme_path"):
        OffloadOptimizer(sgd(params), offload_optimizer_device="nvme")
    with pytest.raises(ValueError, match="nvme_path is for offload_optimizer_device='nvme'"):
        OffloadOptimizer(sgd(params), nvme_path=str(tmp_path))
    with pytest.raises(ValueError, match="nvme_window_mb must be a positive number"):
        OffloadOptimizer(sgd(params), offload_optimizer_device="nvme", nvme_path=str(tmp_path), nvme_window_mb=0)
    with pytest.raises(ValueError, match="is not an existing directory"):
        OffloadOptimizer(sgd(params), offload_optimizer_device="nvme", nvme_path=str(tmp_path / "missing"))
    small = [torch.zeros(500, requires_grad=True) for _ in range(8)]  # several tensors a bucket
    with pytest.raises(ValueError, match=r"nvme_window_mb=0\.001 holds 0 of the host buckets' regions .* give "
                                         r"nvme_window_mb=[\d.]+ at least, or a smaller bucket_size_mb"):
        OffloadOptimizer(ALGORITHMS["adamw"](small), offload_optimizer_device="nvme", nvme_path=str(tmp_path),
                         nvme_window_mb=0.001, bucket_size_mb=0.01, copy_on_cpu=True)
    big = [torch.zeros(40_000, requires_grad=True), torch.zeros(10, requires_grad=True)]  # one tensor, one bucket
    with pytest.raises(ValueError, match=r"the largest is one tensor, w0 \(40,000 elements\), whose masters and "
                                         r"state a bucket holds whole \(its optimizer steps whole tensors\): give "
                                         r"nvme_window_mb=0\.9\d* at least"):
        OffloadOptimizer(ALGORITHMS["lamb"](big), {big[0]: "w0", big[1]: "w1"}, offload_optimizer_device="nvme",
                         nvme_path=str(tmp_path), nvme_window_mb=0.5, bucket_size_mb=0.01, copy_on_cpu=True)
    from lightning_fastopt import FastOptStrategy

    with pytest.raises(ValueError, match="offload_fraction=0 offloads nothing"):
        FastOptStrategy(offload_optimizer_device="nvme", nvme_path=str(tmp_path), offload_fraction=0.0)


def _backward_steps(steps=6, checks=False, **kw):
    """Six wide layers in six buckets stepped after real backwards (the hooks send the
    gradients); ``checks``: the step checks them first as fp16 and clipping do (a loss
    scale with an overflow at step 2, clipping that fires at steps 3 and 4 only)."""
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])
    opt = OffloadOptimizer(FusedAdam(model.parameters(), lr=1e-2, weight_decay=0.01),
                           {p: n for n, p in model.named_parameters()}, bucket_size_mb=0.02, copy_on_cpu=True, **kw)
    if kw.get("speculate"):
        opt.schedule.misses_allowed = opt.schedule.history  # speculate at every step (every path runs)
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        x = torch.randn(16, 64, generator=g)
        if checks and step == 2:
            x[0, 0] = float("inf")
        opt.expected_grad_scale = 4.0 if checks else None
        opt.zero_grad()
        (model(x).square().mean() * (4.0 if checks else 1.0)).backward()
        if checks:
            grads = opt.gradients()
            if step in (3, 4):
                torch._foreach_mul_(grads, 0.5)
            opt.step(grad_scale=4.0, check_finite=True)
        else:
            opt.step()
    return model, opt


def test_the_update_streamed_into_backward_reads_each_bucket_from_disk_as_it_lands(tmp_path, reads):
    """``stream_cpu_step=True``: each bucket's update on the worker thread during backward,
    its masters and state read from the file (the next bucket's read started meanwhile);
    the run ends where the step at the step ends, with the state in host memory."""
    streamed, opt = _backward_steps(stream_cpu_step=True, offload_optimizer_device="nvme", nvme_path=str(tmp_path),
                                    nvme_window_mb=0.12)
    assert len(opt.layout.buckets) == 6 and len(opt.layout.tier.window) == 2
    assert opt.schedule.started == 6 * 6 and reads[0] >= 6 * 5  # (most buckets read back each step)
    plain, _ = _backward_steps()
    assert all(torch.equal(a, b) for a, b in zip(streamed.parameters(), plain.parameters()))
    opt.close()


def test_the_delayed_update_reads_and_writes_the_file_during_the_next_forward(tmp_path):
    """``delayed_update=True`` (after 2 synchronous steps): each update runs on the worker
    during the next step's forward and backward, its bucket resident there, its weights
    read back from the file when the next step sends them; the run, the state dict (the
    pending masters with it) and the pending update applied at the end, also by a fresh
    optimizer that loaded that state dict: all as with the state in host memory."""
    disk = dict(offload_optimizer_device="nvme", nvme_path=str(tmp_path), nvme_window_mb=0.12)
    delayed = dict(delayed_update=True, delayed_update_warmup=2)
    ours, opt = _backward_steps(**delayed, **disk)
    ref_model, ref = _backward_steps(**delayed)
    assert opt.schedule.name == ref.schedule.name == "delayed by one step" and opt.schedule.delayed.pending
    assert all(torch.equal(a, b) for a, b in zip(ours.parameters(), ref_model.parameters()))
    saved, ref_saved = opt.state_dict(), ref.state_dict()
    _assert_same_state(saved, ref_saved)
    assert all(torch.equal(saved["delayed_update"]["weights"][k], v)
               for k, v in ref_saved["delayed_update"]["weights"].items())
    import copy

    fresh_model = copy.deepcopy(ours)  # the weights as saved, the pending update not in them
    fresh = OffloadOptimizer(FusedAdam(fresh_model.parameters(), lr=1e-2, weight_decay=0.01),
                             {p: n for n, p in fresh_model.named_parameters()}, bucket_size_mb=0.02, copy_on_cpu=True,
                             **delayed, **dict(disk, nvme_path=str(tmp_path)))
    fresh.load_state_dict(saved)  # the pending masters written to its file, pending again
    assert opt.apply_pending_update() == ref.apply_pending_update() == fresh.apply_pending_update() > 0
    assert all(torch.equal(a, b) for a, b in zip(ours.parameters(), ref_model.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(fresh_model.parameters(), ref_model.parameters()))
    for o in (opt, ref, fresh):
        o.close()


def test_a_speculated_update_is_written_beside_the_last_state_until_the_step_keeps_one(tmp_path):
    """``speculate=True`` with the state on disk: each speculated update is written to the
    bucket's spare region, its last state staying in the file; the step commits it
    (steps 0, 1, 5), discards it for an overflow (step 2: the step is skipped) or redoes
    it from the last state where clipping changed the gradients (steps 3, 4).  The run ends
    where the step at the step ends with the state in host memory, and no snapshot of the
    masters or state is held in host memory."""
    speculated, opt = _backward_steps(checks=True, stream_cpu_step=True, speculate=True,
                                      offload_optimizer_device="nvme", nvme_path=str(tmp_path), nvme_window_mb=0.12)
    plain, ref = _backward_steps(checks=True)
    assert opt.skipped_steps == ref.skipped_steps == 1
    totals = opt.schedule.totals
    assert totals["speculated"] == 6 * 6 and totals["committed"] == 3 * 6 and totals["redone"] == 2 * 6
    assert totals["dropped"] == 6
    assert all(torch.equal(a, b) for a, b in zip(speculated.parameters(), plain.parameters()))
    tier = opt.layout.tier
    assert len(tier.spares) == len(opt.layout.buckets) and all(snap.nbytes == 0 for snap in opt.schedule.snapshots.values())
    _assert_same_state(opt.state_dict(), ref.state_dict())
    opt.close()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_a_directory_this_process_cannot_write_is_refused(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(ValueError, match="is not writable by this process"):
        OffloadOptimizer(FusedSGD(_params(), lr=0.1), offload_optimizer_device="nvme", nvme_path=str(locked))


def test_a_disk_too_small_is_said_at_set_up_and_a_full_one_during_a_step(tmp_path, monkeypatch):
    """The space the file needs is checked when the optimizer is built; a write that fails
    (the disk filled) is an error naming the path, at the end of that step at the latest."""
    with monkeypatch.context() as m:
        m.setattr(direct_io.shutil, "disk_usage", lambda path: type("U", (), {"free": 4096})())
        with pytest.raises(ValueError, match=r"nvme_path=.* has 4 KiB free; the optimizer state needs [\d.]+ KiB"):
            OffloadOptimizer(ALGORITHMS["adamw"](_params()), offload_optimizer_device="nvme",
                             nvme_path=str(tmp_path), copy_on_cpu=True, bucket_size_mb=0.01)
    params = _params()
    opt = _optimizer(params, ALGORITHMS["adamw"], tmp_path, copy_on_cpu=True)
    _train(opt, params, 1)

    def full(fd, buffers, offset):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(direct_io.os, "pwritev", full)
    with pytest.raises(OSError, match=r"writing the optimizer state's working file in nvme_path=.* failed \(the disk "
                                      r"is full: it needed [\d.]+ KiB, [\d.]+ [KMGT]?i?B free\)"):
        _train(opt, params, 1, start=1)
    monkeypatch.undo()
    opt.close()


def test_direct_io_moves_aligned_buffers_and_falls_back_where_the_file_system_has_none(tmp_path, monkeypatch):
    f = DirectFile(tmp_path, 3 * ALIGN + 1)
    assert f.size == 4 * ALIGN and f.direct
    data = aligned_empty(2 * ALIGN)
    data.copy_(torch.randint(0, 256, (2 * ALIGN,), dtype=torch.uint8))
    f.write_from(data, ALIGN).result()
    back = aligned_empty(2 * ALIGN)
    f.read_into(back, ALIGN).result()
    assert torch.equal(back, data) and back.data_ptr() % ALIGN == 0
    with pytest.raises(ValueError, match="direct I/O moves aligned uint8 buffers at aligned offsets"):
        f.write_from(data, 1)
    with pytest.raises(ValueError, match="reading bytes"):
        f.read_into(back, 3 * ALIGN)
    f.close()
    real_open = os.open

    def no_direct(path, flags, *args):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)
    monkeypatch.setattr(direct_io.os, "open", no_direct)
    buffered = DirectFile(tmp_path, ALIGN)
    assert not buffered.direct
    buffered.write_from(data[:ALIGN], 0).result()
    buffered.read_into(back[:ALIGN], 0).result()
    assert torch.equal(back[:ALIGN], data[:ALIGN])
    buffered.close()
    assert os.listdir(tmp_path) == []


FINALIZED_WHERE_THREADING_HOLDS_ITS_LOCKS = """
import sys, threading
from lightning_fastopt.runtime.direct_io import ALIGN, DirectFile, aligned_empty
f = DirectFile(sys.argv[1], ALIGN)
f.write_from(aligned_empty(ALIGN), 0).result()  # (the pool has a thread)
with threading._shutdown_locks_lock:  # as a thread starting holds it while the collector may run
    del f  # the finalizer
print("closed")
"""


def test_a_file_collected_inside_threadings_bookkeeping_closes_without_joining(tmp_path):
    """A finalizer runs wherever the collector does: once inside a thread's start, which
    holds threading's shutdown locks, where joining the pool's threads deadlocked (the
    suite hung there).  In a process of its own, which would hang."""
    import subprocess
    import sys

    from tests.helpers import subprocess_env

    done = subprocess.run([sys.executable, "-c", FINALIZED_WHERE_THREADING_HOLDS_ITS_LOCKS, str(tmp_path)],
                          capture_output=True, text=True, timeout=120,
                          env=subprocess_env(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert done.returncode == 0 and done.stdout.strip() == "closed", done.stderr[-2000:]
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------------------- under the Trainer
@pytest.mark.parametrize("host_state_gib", [None, 1e-6], ids=["all-on-disk", "split"])
@pytest.mark.parametrize("zero_stage", [0, 2])
def test_under_the_trainer_the_run_ends_where_plain_lightning_ends_and_resumes(tmp_path, zero_stage, host_state_gib):
    """``FastOptStrategy(offload_optimizer_device="nvme")`` on the accelerator's path (and
    with ZeRO, whose rank's share goes to disk the same way): two groups, a step-interval
    scheduler, accumulation and clipping, as plain Lightning with torch's AdamW ends; a
    checkpoint saved halfway (the state read from the file) resumes to the same end."""
    import lightning as L

    from lightning_fastopt import FastOptStrategy
    from tests.test_precision import _data
    from tests.test_strategy import Model, _fit

    make = lambda g: torch.optim.AdamW(g, lr=1e-2, weight_decay=0.01)  # noqa: E731
    disk = tmp_path / "nvme"
    disk.mkdir()

    def ours():
        return FastOptStrategy(offload_optimizer_device="nvme", nvme_path=str(disk), nvme_window_mb=0.008,
                               bucket_size_mb=0.0001, copy_on_cpu=True, zero_stage=zero_stage,
                               host_state_gib=host_state_gib)  # (split: issue 72, offload/split_tier.py)
    kw = dict(accumulate_grad_batches=2, gradient_clip_val=0.1)
    model, ref = Model(make), Model(make)
    trainer = _fit(ours(), model, **kw)
    _fit("auto", ref, **kw)
    engine = trainer.strategy.engines[0]
    engine = getattr(engine, "local", engine)  # ZeRO's rank's offload optimizer
    assert engine.layout.tier.on_disk and len(engine.layout.buckets) >= 3
    if host_state_gib is not None:
        assert 0 < len(engine.layout.tier.in_host) < len(engine.layout.buckets)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
    first = Model(make)
    half = _fit(ours(), first, max_epochs=1, enable_checkpointing=True, default_root_dir=tmp_path, **kw)
    resumed = Model(make)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, strategy=ours(), **kw)
    trainer.fit(resumed, _data(), ckpt_path=half.checkpoint_callback.best_model_path)
    assert all(torch.equal(a, b) for a, b in zip(resumed.parameters(), ref.parameters()))
    assert os.listdir(disk) == []


def test_in_a_fabric_loop_with_fp16_scaling_an_overflow_and_a_save_in_the_middle(tmp_path):
    """Fabric's strategy with the state on disk: fp16 loss scaling (an injected inf skips a
    step), clipping, accumulation; the run equals the one with the state in host memory,
    and a run saved halfway and loaded again ends on the same bits."""
    import lightning as L

    from lightning_fastopt.fabric import FastOptFabricPrecision, FastOptFabricStrategy
    from tests.fabric_loop import train

    disk = tmp_path / "nvme"
    disk.mkdir()

    def fabric(on_disk: bool):
        tier = dict(offload_optimizer_device="nvme", nvme_path=str(disk), nvme_window_mb=0.008) if on_disk else {}
        f = L.Fabric(accelerator="cpu", devices=1, strategy=FastOptFabricStrategy(
            copy_on_cpu=True, bucket_size_mb=0.0001, **tier),
            plugins=[FastOptFabricPrecision("16-mixed", initial_scale_power=8, hysteresis=1)])
        f.launch()
        return f

    in_memory = [p.detach().clone() for p in train(fabric(False), inject_at={2}).parameters()]
    on_disk = fabric(True)
    ours = train(on_disk, inject_at={2})
    assert on_disk.strategy.precision.skipped_steps == 1
    assert on_disk.strategy._wrappers[0].layout.tier.on_disk
    assert all(torch.equal(a, b) for a, b in zip(ours.parameters(), in_memory))
    path = tmp_path / "mid.ckpt"
    train(fabric(True), inject_at={2}, save_at=5, path=path)
    resumed = train(fabric(True), inject_at={2}, start=5, path=path)
    assert all(torch.equal(a, b) for a, b in zip(resumed.parameters(), in_memory))


@pytest.mark.parametrize("tensors", ["8", "1"])
def test_the_benchmark_measures_the_disk_and_the_step_on_it(tmp_path, tensors):
    """``benchmarks/disk_tier.py --quick`` runs: the disk's rates, both steps and the share
    of the disk's rate the step reached, printed; with one tensor too, whose masters and
    moments (4.8 MB) two of which the 8 MiB window could not hold whole: in pieces."""
    from tests.helpers import run_script

    proc = run_script("benchmarks/disk_tier.py", "--quick", "--params", "4e5", "--dir", tmp_path,
                      "--tensors", tensors, *(("--host-shares", "0.5,auto") if tensors == "8" else ()))
    out = proc.stdout
    assert "disk, direct I/O, 8 MiB transfers, 4 in flight: write" in out and "read+write" in out
    assert "step in host memory:" in out and "of the disk's rate reading and writing at once (target >= 80%)" in out
    # each step on disk profiled: how much of it some transfer was in flight, and the disk's rate meanwhile
    busy = re.findall(r"a transfer in flight (\d+)% of the step, ([\d.]+) GB/s while one was", out)
    assert len(busy) == (2 if tensors == "8" else 1) and all(int(p) > 0 and float(r) > 0 for p, r in busy), out
    if tensors == "8":  # the state split (issue 72): each share beside its bound
        assert "% of the state in host memory): step" in out and "x the bound (target <= 1.15x)" in out
        auto = next(line for line in out.splitlines() if line.startswith("host_state_gib=auto"))
        assert "(100% of the state in host memory)" in auto  # (a small state: all of it fits)
        assert auto.endswith("the disk: nothing in flight"), auto
    assert os.listdir(tmp_path) == []


def test_the_memory_estimate_gives_the_disk_and_the_window(tmp_path):
    """``estimate_memory(..., offload_optimizer_device="nvme")``: the masters and AdamW's
    moments leave host memory for the disk, which holds them (the file's size less each
    tensor's alignment to 64 bytes and each bucket's to 4 KiB), host memory the window
    (what the state needs, never more than ``nvme_window_mb``); the gradient buffers stay."""
    from torch import nn

    from lightning_fastopt import estimate_memory
    from lightning_fastopt.runtime.direct_io import ALIGN

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.Tanh(), nn.Linear(96, 48))
    in_memory = estimate_memory(model, offload_fraction=1.0, optimizer="adamw")
    est = estimate_memory(model, offload_fraction=1.0, optimizer="adamw", offload_optimizer_device="nvme",
                          nvme_window_mb=0.2)
    n = sum(p.numel() for p in model.parameters())
    assert est.disk == 12 * n == in_memory.cpu["master_weights"] + in_memory.cpu["optimizer_state"]
    assert est.cpu["master_weights"] == est.cpu["optimizer_state"] == 0 and est.cpu["grads"] == 4 * n
    assert est.disk_window == est.disk and est.cpu_total == 4 * n + est.disk_window  # what the state needs: all
    smaller = estimate_memory(model, offload_fraction=1.0, optimizer="adamw", offload_optimizer_device="nvme",
                              nvme_window_mb=0.05)
    assert smaller.disk_window == round(0.05 * 2**20)  # the most it may take
    opt = OffloadOptimizer(FusedAdam(model.parameters(), lr=1e-3), copy_on_cpu=True, bucket_size_mb=0.01,
                           offload_optimizer_device="nvme", nvme_path=str(tmp_path), nvme_window_mb=0.2)
    tier = opt.layout.tier
    padding = len(opt.layout.buckets) * ALIGN + 3 * len(opt.layout.slots) * 64
    assert est.disk <= tier.disk_bytes() <= est.disk + padding
    largest = max(r.size for r in tier.regions.values())  # each slot holds the largest bucket's region
    assert sum(slot.buffer.numel() for slot in tier.window) == len(tier.window) * largest <= round(0.2 * 2**20)
    speculating = estimate_memory(model, offload_fraction=1.0, optimizer="adamw", offload_optimizer_device="nvme",
                                  nvme_window_mb=0.2, speculate=True)
    assert speculating.disk == 2 * est.disk and speculating.cpu_total == est.cpu_total  # the file twice over
    opt.close()


@pytest.mark.parametrize("clip", [None, 0.1], ids=["streamed", "clipped"])
def test_under_the_trainer_the_update_streams_from_disk(tmp_path, clip):
    """``stream_cpu_step=True`` with the state on disk: streamed where the step checks
    nothing, speculated where it clips; both end where plain Lightning ends."""
    from lightning_fastopt import FastOptStrategy
    from tests.test_strategy import Model, _fit

    make = lambda g: torch.optim.AdamW(g, lr=1e-2, weight_decay=0.01)  # noqa: E731
    model, ref = Model(make), Model(make)
    strategy = FastOptStrategy(offload_optimizer_device="nvme", nvme_path=str(tmp_path), nvme_window_mb=0.008,
                               bucket_size_mb=0.0001, copy_on_cpu=True, stream_cpu_step=True)
    trainer = _fit(strategy, model, gradient_clip_val=clip)
    _fit("auto", ref, gradient_clip_val=clip)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
    engine = trainer.strategy.engines[0]
    if clip is None:
        assert engine.schedule.started > 0
    else:
        assert engine.schedule.totals["speculated"] > 0 and engine.layout.tier.spares


def test_state_the_plan_did_not_foresee_moves_the_bucket_to_a_larger_region(tmp_path, reads):
    """A state dict of AMSGrad loaded into plain AdamW brings a third moment per parameter
    (``max_exp_avg_sq``), which AdamW's regions have no place for: each bucket moves to a
    new region at the file's end, and the run goes on as the same optimizer in host memory
    that loaded the same state."""
    first = _params()
    src = _optimizer(first, ALGORITHMS["amsgrad"], copy_on_cpu=True)
    _train(src, first, 3)
    saved = src.state_dict()
    ref_params = [p.detach().clone().requires_grad_() for p in first]
    params = [p.detach().clone().requires_grad_() for p in first]
    ref = _optimizer(ref_params, ALGORITHMS["adamw"], copy_on_cpu=True)
    opt = _optimizer(params, ALGORITHMS["adamw"], tmp_path, copy_on_cpu=True,
                     window_mb=0.3)  # room for a region a third larger
    before, slot = opt.layout.tier.disk_bytes(), opt.layout.tier.window[0].buffer.numel()
    ref.load_state_dict(saved)
    opt.load_state_dict(saved)
    assert opt.layout.tier.disk_bytes() > before  # the new regions
    assert all(s.buffer.numel() > slot for s in opt.layout.tier.window)  # the slots grew with them, in the window
    _train(ref, ref_params, 4, start=3)
    _train(opt, params, 4, start=3)
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params))
    _assert_same_state(opt.state_dict(), ref.state_dict())
    assert any("max_exp_avg_sq" in st for st in opt.state_dict()["state"].values())
    for o in (src, ref, opt):
        o.close()


def test_the_breakdown_says_what_the_disk_moved_and_what_the_step_waited_for(tmp_path):
    """``wall_clock_breakdown=True``: each step's MiB read and written back, and the
    milliseconds it waited for buckets to be brought in."""
    params = _params()
    opt = _optimizer(params, ALGORITHMS["adamw"], tmp_path, copy_on_cpu=True, wall_clock_breakdown=True)
    _train(opt, params, 2)
    times = opt.last_step_times
    region_mb = sum(r.size for r in opt.layout.tier.regions.values()) / 2**20
    assert times["disk_written_mb"] == pytest.approx(region_mb)  # every bucket written back once
    assert 0 < times["disk_read_mb"] <= region_mb and times["disk_wait"] >= 0.0
    opt.close()


# ---------------------------------------------------------------------------- the state taken out whole
def _anonymous_bytes() -> int:
    """The process's memory that no file backs (``RssAnon``)."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("RssAnon:"))


def _held_in(directory) -> list[str]:
    """The files of ``directory`` this process maps."""
    from tests.helpers import mapped_files

    return [name for _, _, name in mapped_files() if name.startswith(str(directory))]


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads /proc/self/maps and status (Linux)")
@pytest.mark.parametrize("moments", ["float32", "bfloat16"])
def test_a_state_dict_of_the_state_on_disk_is_held_in_files_not_in_host_memory(tmp_path, moments):
    """The state may be larger than host memory: the state dict (and ``state_of``) hold
    copies in files of their own in nvme_path, mapped into memory (the page cache's), so
    taking the state out and saving it grows the process's own memory by less than half of
    what copies in host memory would; the copies equal the state in host memory's
    (bfloat16 moments as float32, as torch keeps them), save and load, and their files go
    with them."""
    import gc

    from lightning_fastopt.runtime.mapped_copies import SMALL
    from tests.helpers import mapped_file_of

    g = torch.Generator().manual_seed(0)
    shapes = [(1024, 1024)] * 4 + [(300,)]
    first = [torch.randn(s, generator=g) for s in shapes]
    make = (ALGORITHMS["adamw"] if moments == "float32" else ALGORITHMS["adamw-bf16-moments"])

    def run(**disk):
        params = [t.clone().requires_grad_() for t in first]
        opt = OffloadOptimizer(make(split_groups(params, GROUPS)), {p: f"p{i}" for i, p in enumerate(params)},
                               bucket_size_mb=4, copy_on_cpu=True, **disk)
        _train(opt, params, 2)
        return opt, params
    ref, _ = run()
    window_mb = 26 if moments == "float32" else 18  # two slots of a bucket's region
    opt, params = run(offload_optimizer_device="nvme", nvme_path=str(tmp_path), nvme_window_mb=window_mb)
    state_bytes = opt.layout.tier.disk_bytes()
    assert state_bytes > 1.5 * window_mb * 2**20  # masters and moments: more than the window holds
    gc.collect()
    before = _anonymous_bytes()
    saved = opt.state_dict()
    torch.save(saved, tmp_path.parent / "state.pt")
    grown = _anonymous_bytes() - before
    big = [v for st in saved["state"].values() for v in st.values()
           if isinstance(v, torch.Tensor) and v.numel() * v.element_size() >= SMALL]
    assert len(big) == 4 * 2  # each large parameter's two moments
    copied = sum(v.numel() * v.element_size() for v in big)  # 32 MiB: what copies in host memory would add
    assert grown < copied / 2, (grown, copied)  # (the allocator's own slack aside)
    for v in big:
        assert v.dtype == torch.float32
        held = mapped_file_of(v)
        assert held is not None and held.startswith(str(tmp_path)) and held.endswith("(deleted)"), held
    _assert_same_state(saved, ref.state_dict())
    _assert_same_state(torch.load(tmp_path.parent / "state.pt"), ref.state_dict())
    st = opt.state_of(params[0])
    assert st["exp_avg"].dtype == torch.float32 and mapped_file_of(st["exp_avg"]).startswith(str(tmp_path))
    assert torch.equal(st["exp_avg_sq"], ref.state_of(ref.layout.slots[0].param)["exp_avg_sq"].float())
    assert os.listdir(tmp_path) == []  # (each copy's file has no name)
    assert _held_in(tmp_path)
    del saved, big, st, v
    gc.collect()
    assert _held_in(tmp_path) == []  # the last tensor gone, its file went
    opt.close()
    ref.close()


def test_a_copy_the_disk_cannot_hold_is_an_error_naming_the_path(tmp_path, monkeypatch):
    from lightning_fastopt.runtime import mapped_copies

    params = [torch.randn(512, 1024, requires_grad=True)]
    opt = OffloadOptimizer(FusedAdam(params, lr=1e-2), {params[0]: "w"}, copy_on_cpu=True,
                           offload_optimizer_device="nvme", nvme_path=str(tmp_path), nvme_window_mb=16)
    _train(opt, params, 2)

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(mapped_copies.os, "posix_fallocate", full)
    with pytest.raises(OSError, match=r"a copy of the optimizer state \(2 MiB\) in nvme_path=.* failed \(the disk is "
                                      r"full: it needed 2 MiB, [\d.]+ [KMGT]?i?B free\)"):
        opt.state_dict()
    monkeypatch.undo()
    assert set(opt.state_dict()["state"]["w"]) == {"step", "exp_avg", "exp_avg_sq"}  # nothing of the state lost
    opt.close()


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads /proc/self/maps (Linux)")
def test_after_fit_the_state_given_back_and_a_checkpoint_read_stay_in_files(tmp_path):
    """After fit the Trainer gives the user's optimizer the state on disk back as plain
    Lightning's AdamW holds it, mapped from the working file itself (nothing writes it once
    training ended: no copy, no more disk), which torch's AdamW then steps in place; a
    checkpoint saved after fit holds that state; a checkpoint the strategy reads is mapped
    from its file, not read whole into host memory."""
    import gc

    import lightning as L
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_fastopt import FastOptStrategy
    from lightning_fastopt.runtime.mapped_copies import SMALL
    from tests.helpers import mapped_file_of

    class Wide(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(64, 4096), nn.Tanh(), nn.Linear(4096, 1))  # 1 MiB weights

        def training_step(self, batch, _):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.01)

    g = torch.Generator().manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(32, 64, generator=g), torch.randn(32, 1, generator=g)), batch_size=8)
    disk = tmp_path / "nvme"
    disk.mkdir()

    def fit(strategy):
        model = Wide()
        trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, strategy=strategy)
        trainer.fit(model, data)
        return trainer, model
    trainer, model = fit(FastOptStrategy(offload_optimizer_device="nvme", nvme_path=str(disk), nvme_window_mb=8,
                                         bucket_size_mb=1, copy_on_cpu=True))
    ref_trainer, ref = fit("auto")
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
    opt, ref_opt = trainer.optimizers[0], ref_trainer.optimizers[0]
    assert type(opt) is torch.optim.AdamW
    for p, q in zip(model.parameters(), ref.parameters()):
        for key, value in ref_opt.state[q].items():
            assert torch.equal(opt.state[p][key], value), key
            if value.numel() * value.element_size() >= SMALL:
                held = mapped_file_of(opt.state[p][key])
                assert held.startswith(str(disk)) and held.endswith(".state (deleted)"), held  # the working file
    assert set(_held_in(disk)) == {mapped_file_of(opt.state[model.net[0].weight]["exp_avg"])}  # no copy
    trainer.save_checkpoint(tmp_path / "after.ckpt")
    read = trainer.strategy.checkpoint_io.load_checkpoint(tmp_path / "after.ckpt")
    weight = read["state_dict"]["net.0.weight"]
    assert torch.equal(weight, model.net[0].weight) and mapped_file_of(weight) == str(tmp_path / "after.ckpt")
    saved = read["optimizer_states"][0]
    first = saved["param_groups"][0]["params"][0]  # (net.0.weight's key: its name or position)
    assert torch.equal(saved["state"][first]["exp_avg"], ref_opt.state[ref.net[0].weight]["exp_avg"])
    for p, q in zip(model.parameters(), ref.parameters()):  # torch's own step on what was given back
        p.grad = q.grad = torch.full_like(p, 0.01)
    opt.step()
    ref_opt.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))
    assert torch.equal(opt.state[model.net[0].weight]["exp_avg"], ref_opt.state[ref.net[0].weight]["exp_avg"])
    del read, weight, saved, opt, trainer
    gc.collect()


# ---------------------------------------------------------------------------- the window, and messages (issue 67)
def test_the_window_takes_what_the_state_needs_and_one_line_says_where_it_is(tmp_path, caplog):
    """``nvme_window_mb`` left None: slots of the largest bucket's region (two here, or one
    per bucket where there are fewer), not 512 MiB for a state of a few KiB; the set-up says
    where the state is, the file's size and the window."""
    import logging

    params = _params()
    with caplog.at_level(logging.INFO):
        opt = OffloadOptimizer(ALGORITHMS["adamw"](params), copy_on_cpu=True, bucket_size_mb=0.004,
                               offload_optimizer_device="nvme", nvme_path=str(tmp_path))
    tier = opt.layout.tier
    largest = max(r.size for r in tier.regions.values())
    assert tier.window_bytes == 512 * 2**20 and len(tier.regions) >= 3
    assert sum(s.buffer.numel() for s in tier.window) == len(tier.window) * largest < 2**20
    said = [r.getMessage() for r in caplog.records if "on disk: a working file" in r.getMessage()]
    assert len(said) == 1 and f"nvme_path={str(tmp_path)!r}" in said[0], said
    assert f"window of {len(tier.window)} slot(s) of" in said[0] and "nvme_window_mb=None: what the state needs, " \
        "512 MiB at most" in said[0] and "KiB in nvme_path" in said[0]
    _train(opt, params, 2)
    opt.close()


def test_a_window_the_host_cannot_hold_or_without_the_disk_or_under_two_buckets_is_refused_when_built(tmp_path):
    from torch import nn

    from lightning_fastopt import FastOptFSDPStrategy, FastOptStrategy, estimate_memory

    disk = dict(offload_optimizer_device="nvme", nvme_path=str(tmp_path))
    for build in (FastOptStrategy, FastOptFSDPStrategy,
                  lambda **kw: OffloadOptimizer(FusedSGD(_params(), lr=0.1), **kw)):
        with pytest.raises(ValueError, match=r"nvme_window_mb=1000000000000\.0 \(931 PiB\) is more than this "
                                             r"machine's memory \([\d.]+ [GT]iB\)"):
            build(**disk, nvme_window_mb=1e12)
        with pytest.raises(ValueError, match="nvme_window_mb is for offload_optimizer_device='nvme'"):
            build(nvme_window_mb=64)
    with pytest.raises(ValueError, match="nvme_window_mb is for offload_optimizer_device='nvme'"):
        estimate_memory(nn.Linear(2, 2), nvme_window_mb=64)
    for build in (FastOptStrategy, FastOptFSDPStrategy):  # the two-bucket minimum, known once the buckets' size is
        with pytest.raises(ValueError, match=r"nvme_window_mb=100 cannot hold two host buckets of bucket_size_mb=64"
                                             r"\.0 .* give 128 at least \(about 384 with Adam's two moments\)"):
            build(**disk, nvme_window_mb=100)
    FastOptStrategy(**disk, nvme_window_mb=128)  # a window the host holds, of two buckets, is taken


def test_nvme_path_removed_during_a_run_is_said_at_the_next_save(tmp_path):
    """The working file has no name, so the run goes on; the next copy of the state made
    there (a checkpoint's) says that the directory is gone, not a raw error on a file in it."""
    disk = tmp_path / "disk"
    disk.mkdir()
    params = [torch.randn(512, 1024, requires_grad=True)]  # a state large enough to be copied to the disk
    opt = OffloadOptimizer(FusedAdam(params, lr=1e-2), {params[0]: "w"}, copy_on_cpu=True,
                           offload_optimizer_device="nvme", nvme_path=str(disk))
    params[0].grad = torch.ones_like(params[0])
    opt.step()
    disk.rmdir()
    with pytest.raises(FileNotFoundError, match=r"nvme_path='.*/disk' is gone \(removed while the run used it\?\)"):
        opt.state_dict()
    disk.mkdir()
    assert set(opt.state_dict()["state"]["w"]) == {"step", "exp_avg", "exp_avg_sq"}  # nothing of the state lost
    opt.close()
