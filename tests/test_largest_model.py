"""benchmarks/largest_model.py reports why a try did not train and how far it got (issue 52):
on the H200 (2026-11-28) a 7.25B try was cut off by the call's time and reported a
Lightning warning, its last line printed, as the error."""

import json
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
try:
    import largest_model
finally:
    sys.path.pop(0)

from tests.helpers import subprocess_env  # noqa: E402

SCRIPT = REPO / "benchmarks" / "largest_model.py"

TRACEBACK_THEN_WARNING = """Traceback (most recent call last):
  File "largest_model.py", line 120, in child
torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.
/site-packages/lightning/pytorch/trainer/connectors/data_connector.py:434: The 'train_dataloader' does not have many workers
"""


def test_the_exception_is_the_error_not_a_warning_printed_after_it():
    assert largest_model.failure(1, TRACEBACK_THEN_WARNING).startswith("torch.OutOfMemoryError: CUDA out of memory")
    assert largest_model.failure(1, "only a line\n") == "only a line"
    assert largest_model.failure(3, "") == "exit 3"


def test_a_signal_is_named():
    assert largest_model.failure(-9, TRACEBACK_THEN_WARNING) == (
        "killed by signal 9 (the host's out-of-memory killer sends it)")
    assert largest_model.failure(-15, "") == "killed by signal 15"


def test_the_last_progress_line_says_how_far_a_try_got():
    printed = "noise\nPROGRESS built on the meta device after 2.0 s\nmore noise\nPROGRESS step 1 took 3.10 s after 9.0 s\n"
    assert largest_model.last_progress(printed) == "step 1 took 3.10 s after 9.0 s"
    assert largest_model.last_progress("nothing of ours\n") is None


def test_a_try_stopped_by_its_time_limit_says_so_and_how_far_it_got(monkeypatch):
    def stopped(command, **kwargs):
        raise subprocess.TimeoutExpired(command, kwargs["timeout"],
                                        output=b"PROGRESS set up (the model in host memory) after 80.0 s\n")

    monkeypatch.setattr(largest_model.subprocess, "run", stopped)
    args = Namespace(width=64, tokens=16, steps=3, state="float32", gpu_gib=1.0, tiny=True, timeout_s=7)
    got = largest_model.run_child(args, 4)
    assert got == dict(layers=4, trained=False, error="stopped after --timeout-s 7 s",
                       got_to="set up (the model in host memory) after 80.0 s")


def test_a_tiny_try_says_each_phase_of_its_set_up_in_order():
    """The child's progress lines name the strategy's set-up phases (the H200's 7.25B try
    was cut off before its first step, 2026-11-28, and nothing said where), then each step."""
    done = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--child", "2", "--width", "64", "--tokens", "16",
                           "--steps", "2", "--gpu-gib", "1"], capture_output=True, text=True, cwd=REPO,
                          env=subprocess_env(REPO), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    said = [line.split(" after ")[0] for line in done.stdout.splitlines() if line.startswith(largest_model.PROGRESS)]
    phases = ["built on the meta device", "sharded on the meta device; materializing it in host memory",
              "materialized in host memory", "the optimizer set up", "set up: the first step begins"]
    assert [line[len(largest_model.PROGRESS):] for line in said[:5]] == phases
    assert [line.split(" took ")[0] for line in said[5:]] == ["PROGRESS step 1", "PROGRESS step 2"]
    assert json.loads(done.stdout.splitlines()[-1])["trained"] is True
