"""The prepared GPU command (benchmarks/gpu_session.sh, issue 37) planned on the CPU: ``first``
and ``rest`` run with ``--tiny`` (a tiny GPT; the test selections collected, not run), and
every part they name exists, runs and lands in the two files a part returns (a log and an
archive), as a lent GPU session will need them."""

import json
import re
import subprocess
import tarfile
from pathlib import Path

import pytest

from tests.helpers import subprocess_env

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow  # two runs of the tiny GPT table and about 20 collections: 3 minutes on 2 cores


def _session(tmp_path, part):
    out = tmp_path / part
    env = {**subprocess_env(REPO), "OUT": str(out)}
    done = subprocess.run(["bash", "benchmarks/gpu_session.sh", part, "--tiny"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == [f"{part}.log", f"{part}.tar.gz"]  # the device returns 8 at most
    with tarfile.open(out / f"{part}.tar.gz") as archive:
        files = {Path(m.name).name: archive.extractfile(m).read().decode(errors="replace")
                 for m in archive.getmembers() if m.isfile() and not m.name.endswith(".png")}
    return (out / f"{part}.log").read_text(), files


def _selections_collected(text):
    """Each test selection's collection line: none may be empty or fail."""
    counts = re.findall(r"^=== (.+)\n(.+)$", text, re.M)
    assert counts, text
    for selection, said in counts:
        assert re.match(r"(\d+/)?\d+ tests? collected", said) and not said.startswith("0"), (selection, said)
    assert "LEFT OUT" not in text
    return [selection for selection, _ in counts]


def _configs_done(files, name, shell_variable):
    wanted = re.search(rf'^{shell_variable}="([^"]+)"', (REPO / "benchmarks" / "gpu_session.sh").read_text(),
                       re.M).group(1).split(",")
    table = json.loads(files[f"{name}.json"])
    rows = table["rows"]
    assert [r["configuration"] for r in rows] == wanted
    # the bound's terms measured first, and each offloading row's bound (no copies without a GPU)
    assert table["terms"]["cpu_params_per_s"] > 0 and table["terms"]["d2h_bytes_per_s"] is None
    by = {r["configuration"]: r for r in rows}
    for r in rows:
        assert r["first_forward_ms"] > 0, r  # each row's timed first forwards (a clipped row's bound reads plain's)
        if r["fraction"] is not None:
            clipped = ":clip" in r["configuration"]
            terms = ("GPU step", "CPU update") + (("update after backward",) if clipped else ())
            assert r["bound_ms"] > 0 and r["bound_term"] in terms, r
            accumulated = re.search(r":a\d+$", r["configuration"])
            plain = by.get("plain:clip" + (accumulated.group(0) if accumulated else ""))
            if clipped and plain:  # the update after backward: above plain's step less its first forward
                assert r["bound_ms"] > plain["step_ms"] - plain["first_forward_ms"], (r, plain)
    assert "| x bound |" in files[f"{name}.md"]
    assert all(r["wall_s"] > 0 and r["step_ms"] > 0 for r in rows)
    for r in rows:  # where each row's wall time went, for planning the next GPU session
        assert list(r["phases_s"]) == ["imports", "model built", "setup", "warm-up", "profile read",
                                       "timed steps"], r["phases_s"]  # (then the process ends: no teardown)
        assert 0 < sum(r["phases_s"].values()) < r["wall_s"]
    assert re.search(r"done in \d+ s: .*; start [\d.]+ s, imports", files[f"{name}.md"])
    return wanted


def test_first_measures_targets_1_2_and_4_then_collects_the_exactness_tests(tmp_path):
    """Issue 66's first call: the exact full offload beside plain, clipped, at 1 to 8 micro-batches
    a step (its sweep's table and picture), the largest GPT at 24 GiB (one try), then the tests."""
    log, files = _session(tmp_path, "first")
    assert "cpu[" in files["first_build.txt"] and "build: " in files["first_build.txt"]
    configs = _configs_done(files, "gpt_first", "FIRST_ROWS")
    assert {"plain", "fastopt:1:stream:module:clip", "fastopt:1:stream:module:clip:a8",
            "fastopt:auto:stream:clip"} <= set(configs)
    rows = {r["configuration"]: r for r in json.loads(files["gpt_first.json"])["rows"]}
    assert rows["plain:clip:a8"]["tokens_per_step"] == 8 * rows["plain:clip"]["tokens_per_step"]
    sweep = re.search(r"fastopt:1:stream:module:clip, by tokens per step:\n(.+?)\n\n", files["gpt_first.md"], re.S)
    assert sweep and len(sweep.group(1).splitlines()) == 2 + 4, files["gpt_first.md"]  # 1, 2, 4 and 8 micro-batches
    got = json.loads(files["largest_float32.json"])
    assert got["tries"] and got["tries"][0]["trained"], got
    selections = _selections_collected(files["first_tests.txt"])
    assert any("offload1-" in s and "offload0-" in s for s in selections)
    # the log says when each step started: how the 8 minutes were spent
    steps = re.findall(r"\[gpu_session first, (\d+) s\] (\w[^\n]*)", log)
    assert [name for _, name in steps][:5] == [
        "build", "the rounding of each ATen operation of torch's CUDA Adam steps (a few seconds)",
        "GPT rows: the exact full offload beside plain, clipped, at 8K to 64K tokens a step",
        "the largest GPT at 24 GiB of GPU, AdamW moments float32 (one try)",
        "bit-exactness tests and Trainer-level comparisons"]
    assert "| `v.sqrt() / bc2s` |" in files["rounding_probe.md"]  # the probe's table
    assert steps[-1][1] == "done"


def test_rest_holds_what_first_leaves_out(tmp_path):
    _, files = _session(tmp_path, "rest")
    _selections_collected(files["rest_tests.txt"] + files["rest_trainer_on_gpu.txt"])
    others = _configs_done(files, "gpt_others", "OTHERS")
    headline = _configs_done(files, "gpt_headline", "HEADLINE")
    first = re.search(r'^FIRST_ROWS="([^"]+)"', (REPO / "benchmarks" / "gpu_session.sh").read_text(),
                      re.M).group(1).split(",")
    # plain again in each table: the bound's GPU step, on rest's machine
    assert set(others) & set(headline) == set(first) & set(headline) == {"plain"}
    rows = {r["configuration"]: r for r in json.loads(files["gpt_headline.json"])["rows"]}
    # its steps ended before their CPU updates (nothing in the GPT reads weights between steps), on a CPU too
    assert rows["fastopt_fsdp:1:params:stream:module:bf16-true"]["left_running"] > 0
    assert "of the disk's rate reading and writing at once" in files["disk_tier.md"]  # the disk row (issue 53)


def test_largest_estimates_the_depths_and_trains_the_deepest_that_fits(tmp_path):
    """The largest-model part (issue 52): the estimate's table for each depth, then the
    deepest estimated to fit trained with its weights in host memory, float32 and bfloat16
    moments (a tiny GPT whose host is capped at a few MiB here)."""
    _, files = _session(tmp_path, "largest")
    for state in ("float32", "bfloat16"):
        got = json.loads(files[f"largest_{state}.json"])
        fits = [r["layers"] for r in got["plan"] if r["fits"]]
        assert fits and len(fits) < len(got["plan"])  # the host cap leaves the deeper ones out
        assert got["tries"][0]["layers"] == max(fits) and got["tries"][0]["trained"], got["tries"]
        assert f"trained: {max(fits)} layers" in files[f"largest_{state}.md"]
    # then the whole GPU with the state on disk (the host cap leaves depths that only the disk lets fit)
    disk = json.loads(files["largest_disk.json"])
    assert all("disk_gib" in r for r in disk["plan"]) and disk["tries"][0]["trained"], disk
    assert "| disk GiB |" in files["largest_disk.md"]
