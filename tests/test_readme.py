"""README keeps exactly two set-up commands, CI runs the test one, and the main job's
script runs (tiny sizes: the numbers are not checked here, the benchmark reports them)."""

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _setup_commands():
    text = (REPO / "README.md").read_text()
    section = text.split("## Set-up", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [line for line in block.splitlines() if line.strip() and not line.startswith("#")]


def test_readme_has_two_setup_commands_and_ci_runs_the_test_one():
    commands = _setup_commands()
    assert len(commands) == 2, commands
    main_job, tests = commands
    assert "benchmarks/cpu_optimizers.py" in main_job
    assert "pytest" in tests
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert tests in ci


def test_main_job_script_runs():
    out = subprocess.run([sys.executable, "benchmarks/cpu_optimizers.py", "--quick", "--repeat", "1",
                          "--algorithms", "adam,adam-mixed,lamb"], cwd=REPO, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr
    assert "read-modify-write bandwidth" in out.stdout
    assert "| lamb | lightning_fastopt FusedLAMB |" in out.stdout
