"""The GPU plan's test selections collected, not run (``gpu_session.sh ... --tiny``): for
each argument, a selection of pytest arguments as a shell would split them, print
``=== SELECTION`` and pytest's collection summary (``N/M tests collected``).  All in one
interpreter: a separate ``pytest --collect-only`` per selection spent about 4 s starting
torch and Lightning (2026-11-26, on the 2-core dev machine), a minute per plan.

    python benchmarks/collect_selections.py "tests/test_rounding.py -m cuda -k kernels-" ...
"""

from __future__ import annotations

import contextlib
import io
import shlex
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # the tests import tests.helpers, as under `python -m pytest` from the root


def summary(selection: str) -> str:
    """pytest's last line for ``--collect-only`` of ``selection``."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        pytest.main(["-q", "-p", "no:cacheprovider", "--collect-only", *shlex.split(selection)])
    lines = [line for line in printed.getvalue().splitlines() if line.strip()]
    return lines[-1] if lines else "pytest printed nothing"


def main(selections: list[str]) -> None:
    for selection in selections:
        print(f"=== {selection}\n{summary(selection)}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
