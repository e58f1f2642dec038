"""How the CPU kernels share their work among threads (csrc/cpu/chunk_schedule.h and
tensor_walk.h): chunks cut independently of the thread count, each thread on its own
share first, then taking from the others', so that a thread the system runs less does not
hold up the update; and sums that do not depend on how many threads there were."""

import subprocess

import pytest
import torch

from lightning_fastopt import functional as F
from tests.helpers import compiled_check


@pytest.fixture(scope="module")
def schedule_check(tmp_path_factory):
    exe = compiled_check(tmp_path_factory, "chunk_schedule_check.cpp", "-std=c++17", "-O1", "-pthread")

    def run(*args):
        return subprocess.run([str(exe), *map(str, args)], capture_output=True, text=True)

    return run


@pytest.mark.parametrize("chunks,threads", [(1, 1), (2, 2), (5, 2), (7, 3), (1000, 4), (3, 7), (4096, 16)])
def test_every_chunk_runs_once_and_each_thread_begins_at_the_front_of_its_share(schedule_check, chunks, threads):
    out = schedule_check("once", chunks, threads)
    assert (out.returncode, out.stdout.strip()) == (0, "ok"), out.stdout + out.stderr


@pytest.mark.parametrize("chunks,threads", [(2, 2), (1000, 2), (1000, 4), (33, 16)])
def test_a_held_thread_does_not_hold_up_the_others(schedule_check, chunks, threads):
    """The first chunk to run waits until every other chunk has run (the event, not a
    time): the other threads take the rest of its thread's share, which runs nothing
    else.  A schedule that splits the work beforehand never gets there (it says "stalled"
    after the 300 s it waits)."""
    out = schedule_check("stall", chunks, threads)
    assert (out.returncode, out.stdout.strip()) == (0, "ok"), out.stdout + out.stderr


def _at_threads(threads, fn):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


# pieces of a tensor start where chunks (32K elements) and the sums' blocks (4096) do not
SIZES = (100_003, 7, 3 * 65_536 + 5, 0, 40_000, 1_000_000)


def test_sums_of_squares_are_the_same_bits_at_any_thread_count():
    """Each chunk's pieces are summed apart and the chunks added in their order: before,
    each thread summed its own share, and the bits followed the thread count."""
    torch.manual_seed(0)
    tensors = [torch.randn(n) for n in SIZES]
    one, two = (_at_threads(t, lambda: F.square_sums(tensors)) for t in (1, 2))
    assert one == two
    for t, s in zip(tensors, one):  # and they are the sums
        assert s == pytest.approx(float(t.double().square().sum()), rel=1e-6)


def test_lamb_and_lars_step_the_same_bits_at_any_thread_count():
    """Their trust ratios read each tensor's norms, summed over the threads' pieces."""
    torch.manual_seed(1)
    start = [torch.randn(n) for n in SIZES]
    grads = [torch.randn(n) for n in SIZES]

    def lamb():
        p = [x.clone() for x in start]
        m, v = [torch.zeros_like(x) for x in p], [torch.zeros_like(x) for x in p]
        for step in (1, 2, 3):
            F.fused_lamb_(p, grads, m, v, step=step, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.01)
        return p + m + v

    def lars():
        p = [x.clone() for x in start]
        buf = [torch.zeros_like(x) for x in p]
        for _ in range(3):
            F.fused_lars_(p, grads, buf, lr=0.1, momentum=0.9, weight_decay=1e-4)
        return p + buf

    for run in (lamb, lars):
        one, two = (_at_threads(t, run) for t in (1, 2))
        assert all(torch.equal(a, b) for a, b in zip(one, two)), run.__name__
