"""benchmarks/physical_bound.py: an offload step's bound is the longest of the GPU's own
step, the CPU update of the offloaded share and each direction's copies (issue 50)."""

import os
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
try:
    from physical_bound import Terms, beside_busy_process, beside_copies, bound_ms, cpu_update_rate
finally:
    sys.path.pop(0)

# 1 Gparam/s on the CPU; 50 GB/s down, 25 GB/s up
GPU_HOST = Terms(cpu_params_per_s=1e9, threads=16, d2h_bytes_per_s=50e9, h2d_bytes_per_s=25e9)


def test_the_longest_term_sets_the_bound():
    # 1B offloaded float32 parameters: CPU 1000 ms, D2H 80 ms, H2D 160 ms, against a 100 ms step
    assert bound_ms(GPU_HOST, 100.0, 1e9, 4) == (pytest.approx(1000.0), "CPU update")
    # 50M: CPU 50 ms, copies 4 and 8 ms: the GPU's own step
    assert bound_ms(GPU_HOST, 100.0, 5e7, 4) == (100.0, "GPU step")
    # copies slower than the CPU: 1 GB/s up makes 1B half weights 2000 ms
    slow_up = Terms(cpu_params_per_s=1e9, threads=16, d2h_bytes_per_s=50e9, h2d_bytes_per_s=1e9)
    assert bound_ms(slow_up, 100.0, 1e9, 2) == (pytest.approx(2000.0), "H2D copies")
    # weights in host memory: gathered for forward and again for backward, twice the bytes up
    assert bound_ms(slow_up, 100.0, 1e9, 2, h2d_bytes_per_param=4) == (pytest.approx(4000.0), "H2D copies")
    # nothing offloaded: the GPU's step
    assert bound_ms(GPU_HOST, 100.0, 0, 4) == (100.0, "GPU step")


def test_a_clipped_step_adds_the_update_after_backward():
    """Clipping: the update starts when backward ends; only the next first forward overlaps it."""
    # 100 ms plain step, 30 of it the first forward; 50M parameters: a 50 ms update
    assert bound_ms(GPU_HOST, 100.0, 5e7, 4, first_forward_ms=30.0) == (pytest.approx(120.0), "update after backward")
    # unclipped, the same step is the GPU's
    assert bound_ms(GPU_HOST, 100.0, 5e7, 4) == (100.0, "GPU step")
    # the CPU update alone longer still (1B: 1000 ms) sets the clipped bound at the update plus backward
    assert bound_ms(GPU_HOST, 100.0, 1e9, 4, first_forward_ms=30.0) == (pytest.approx(1070.0), "update after backward")


def test_without_a_gpu_nothing_is_copied_and_without_a_plain_row_there_is_no_bound():
    cpu_only = Terms(cpu_params_per_s=1e9, threads=2, d2h_bytes_per_s=None, h2d_bytes_per_s=None)
    assert bound_ms(cpu_only, 3.0, 1e7, 4) == (pytest.approx(10.0), "CPU update")
    assert bound_ms(GPU_HOST, None, 1e9, 4) == (None, "no plain row")


def test_the_terms_say_what_they_measured():
    said = GPU_HOST.describe()
    assert "1.00 Gparam/s = 28 GB/s at 28 B a parameter" in said and "16 threads" in said
    assert "D2H 50.0 GB/s, H2D 25.0 GB/s" in said
    assert "n/a (no GPU)" in Terms(1e9, 2, None, None).describe()
    beside = Terms(2e9, 16, None, None, cpu_params_per_s_beside_busy=1.5e9).describe()
    assert "2.00 Gparam/s" in beside and "(1.50 Gparam/s beside one busy process, 75%)" in beside


def test_the_rate_beside_the_copies_is_said_beside_the_idle_one():
    said = Terms(2e9, 16, 50e9, 50e9, cpu_params_per_s_beside_copies=1.6e9).describe()
    assert "(1.60 Gparam/s while pinned copies run both ways, 80%)" in said


def test_the_rate_beside_the_copies_is_measured_while_they_run():
    """The copies (here a stand-in round that counts itself) run before, during and not
    after the measurement: the rate is taken with them under way."""
    rounds, at_start = [], []

    def rate():
        at_start.append(len(rounds))
        while len(rounds) < at_start[0] + 2:  # rounds go on while it measures
            time.sleep(0)
        return 3.0

    measured, ran = beside_copies(rate, lambda: rounds.append(1))
    assert measured == 3.0 and at_start[0] >= 1 and ran >= 2
    after = len(rounds)
    time.sleep(0)
    assert len(rounds) == after  # stopped (joined before it returned)


def test_copies_that_fail_are_said_not_waited_for():
    def broken():
        raise RuntimeError("no copy engine")

    with pytest.raises(RuntimeError, match="no copy engine"):
        beside_copies(lambda: 1.0, broken)


def _running_children() -> list[int]:
    """This process's children that are running or runnable (Linux's /proc)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after the command's name: state, ppid, ...
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and fields[0] == "R":
            out.append(int(pid))
    return out


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads Linux's /proc")
def test_the_rate_beside_a_busy_process_is_measured_while_one_runs():
    seen = []

    def rate():
        seen.append(_running_children())
        return 1.0

    assert beside_busy_process(rate) == 1.0
    assert len(seen[0]) == 1
    assert seen[0][0] not in _running_children()  # stopped after


def test_the_cpu_rate_is_of_our_adamw_step(monkeypatch):
    """The rate times lightning_fastopt's fused AdamW over the parameters asked for."""
    import lightning_fastopt.functional as functional

    seen = []
    real = functional.fused_adam_

    def spy(params, *args, **kwargs):
        seen.append((params[0].numel(), kwargs["step"]))
        return real(params, *args, **kwargs)

    monkeypatch.setattr(functional, "fused_adam_", spy)
    assert cpu_update_rate(4096, repeat=3) > 0
    assert seen == [(4096, 1), (4096, 2), (4096, 3), (4096, 4)]  # one warm-up, three timed
