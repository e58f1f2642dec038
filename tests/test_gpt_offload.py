"""benchmarks/gpt_offload.py's rows: forked from one process that imported torch and
Lightning (on a GPU too, since 2026-11-28: 16-22 s of a row's 38-51 on the H200 were the
interpreter's start and the imports), and where a forked GPU row fails, run again in an
interpreter of its own, as every row was before."""

import sys
from argparse import Namespace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
try:
    import gpt_offload
finally:
    sys.path.pop(0)


def _runners(monkeypatch, forked_row):
    calls = []

    def forked(config, args):
        calls.append(("forked", config))
        return forked_row, 0 if forked_row else 1, "what it printed"

    def subprocess_(config, args):
        calls.append(("subprocess", config))
        return {"configuration": config}, 0, ""

    monkeypatch.setattr(gpt_offload, "run_forked", forked)
    monkeypatch.setattr(gpt_offload, "run_subprocess", subprocess_)
    return calls


def test_a_forked_gpu_row_that_fails_runs_again_in_its_own_interpreter_and_so_do_the_rest(monkeypatch, capsys):
    calls = _runners(monkeypatch, forked_row=None)
    row, code, _, wall, run = gpt_offload.one_row("fastopt:1", Namespace(tiny=False), gpt_offload.run_forked)
    assert row == {"configuration": "fastopt:1"} and code == 0 and wall >= 0
    assert calls == [("forked", "fastopt:1"), ("subprocess", "fastopt:1")]
    assert run is gpt_offload.run_subprocess  # the next rows
    assert "fastopt:1: FAILED forked (exit 1)" in capsys.readouterr().out
    gpt_offload.one_row("plain", Namespace(tiny=False), run)
    assert calls[-1] == ("subprocess", "plain")


def test_a_forked_row_that_runs_stays_forked_and_a_tiny_one_that_fails_is_not_run_again(monkeypatch):
    calls = _runners(monkeypatch, forked_row={"configuration": "plain"})
    row, *_, run = gpt_offload.one_row("plain", Namespace(tiny=False), gpt_offload.run_forked)
    assert row == {"configuration": "plain"} and run is gpt_offload.run_forked and calls == [("forked", "plain")]
    calls = _runners(monkeypatch, forked_row=None)
    row, code, *_ = gpt_offload.one_row("plain", Namespace(tiny=True), gpt_offload.run_forked)
    assert row is None and code == 1 and calls == [("forked", "plain")]  # (said as FAILED by the table's loop)
