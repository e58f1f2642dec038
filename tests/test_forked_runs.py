"""The tests' fork server (tests/forked_runs.py): a child runs as ``python SCRIPT ARGS`` would."""

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.forked_runs import ForkServer
from tests.helpers import run_script, subprocess_env

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def server():
    s = ForkServer(subprocess_env(REPO), REPO)
    yield s
    s.close()


def _script(tmp_path, body: str) -> Path:
    path = tmp_path / "child.py"
    path.write_text(textwrap.dedent(body))
    return path


def test_a_child_has_its_own_arguments_environment_directory_and_output(server, tmp_path):
    script = _script(tmp_path, """
        import atexit, os, sys
        atexit.register(lambda: print("exit handler ran"))
        print(sys.argv[1:], os.environ.get("ONLY_HERE"), os.environ.get("HOME_OF_TESTS"), os.getcwd(),
              sys.path[0], __name__)
        print("to stderr", file=sys.stderr)
        sys.exit(int(sys.argv[1]))
    """)
    work = tmp_path / "work"
    work.mkdir()
    pid = server.start([script, "3", "x"], {"ONLY_HERE": "yes", "PYTHONPATH": str(REPO)}, work,
                       tmp_path / "out", tmp_path / "err")
    assert server.wait(pid) == 3
    out = (tmp_path / "out").read_text().splitlines()
    assert out == [f"['3', 'x'] yes None {work} {tmp_path} __main__", "exit handler ran"]
    assert (tmp_path / "err").read_text() == "to stderr\n"


def test_an_exception_exits_1_with_its_traceback_and_a_killed_child_says_its_signal(server, tmp_path):
    script = _script(tmp_path, "raise ValueError('from the child')\n")
    pid = server.start([script], {}, tmp_path, tmp_path / "out", tmp_path / "err")
    assert server.wait(pid) == 1
    assert "ValueError: from the child" in (tmp_path / "err").read_text()
    sleeper = _script(tmp_path, "import time\nprint('up', flush=True)\ntime.sleep(600)\n")
    pid = server.start([sleeper], {}, tmp_path, tmp_path / "out", tmp_path / "err")
    while "up" not in (tmp_path / "out").read_text():  # (started: the sleep runs)
        assert server.poll(pid) is None
        time.sleep(0.01)
    server.kill(pid)
    assert server.wait(pid) == -9


def test_a_module_runs_as_python_dash_m_runs_it(server, tmp_path):
    pid = server.start(["-m", "json.tool", "--help"], {}, tmp_path, tmp_path / "out", tmp_path / "err")
    assert server.wait(pid) == 0 and "json.tool" in (tmp_path / "out").read_text()


def test_run_script_reports_a_failing_rank(tmp_path):
    script = _script(tmp_path, """
        import os, sys
        sys.exit(5 if os.environ["LOCAL_RANK"] == "1" else 0)
    """)
    with pytest.raises(AssertionError, match="rank 1 exited 5"):
        run_script(script, ranks=2)
    assert sys.modules["tests.forked_runs"]._server is not None  # (forked, where the server could start)


def test_what_lightnings_imports_read_of_the_rank_is_the_childs_own_as_in_a_fresh_interpreter(server, tmp_path):
    """The server imported torchmetrics (most of Lightning's import time); its rank, read from
    the environment at import, is set again from the child's."""
    script = _script(tmp_path, """
        import lightning, torchmetrics.utilities.prints as tm
        from lightning.fabric.utilities.rank_zero import rank_zero_only
        print(rank_zero_only.rank, tm.rank_zero_only.rank)
    """)
    env = {**subprocess_env(REPO), "LOCAL_RANK": "1", "RANK": "1"}  # (the server's environment has neither)
    pid = server.start([script], env, tmp_path, tmp_path / "out", tmp_path / "err")
    assert server.wait(pid) == 0, (tmp_path / "err").read_text()
    fresh = subprocess.run([sys.executable, script], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert ((tmp_path / "out").read_text(), fresh.stdout) == ("1 1\n", "1 1\n")
