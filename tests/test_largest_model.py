"""benchmarks/largest_model.py reports why a try did not train and how far it got (issue 52):
on the H200 (2026-11-28) a 7.25B try was cut off by the call's time and reported a
Lightning warning, its last line printed, as the error."""

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
