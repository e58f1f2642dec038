"""README keeps exactly two set-up commands, CI runs the test one, the main job runs,
and the benchmark scripts run; README and docs/ agree with the code and link to pages
and headings that exist."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_fastopt import FastOptStrategy
from tests.helpers import run_script, subprocess_env

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
    assert "examples/train_gpt.py fit --config examples/configs/gpt_offload.yaml" in main_job
    assert "pytest" in tests
    for command in commands:  # a fresh virtual environment, entered, before the install
        assert command.startswith("python3 -m venv .venv && . .venv/bin/activate && python3 -m pip install ")
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert tests in ci


def test_main_job_runs_and_reports_the_loss(tmp_path):
    """The main job's command, shortened (one epoch, one layer); the commands before it make
    and enter the virtual environment, which this test runs in already."""
    cmd = _setup_commands()[0].rsplit("&&", 1)[1].split()
    assert cmd[0] == "python3"
    out = subprocess.run([sys.executable, *cmd[1:], "--trainer.max_epochs", "1", "--model.n_layer", "1",
                          "--trainer.default_root_dir", str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                         timeout=600, env=subprocess_env(REPO))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "epoch 0: mean train loss" in out.stdout
    assert "Traceback" not in out.stderr


def test_benchmark_scripts_run(tmp_path):
    """Tiny sizes: the numbers are not checked here, the benchmarks report them.  The
    scripts run one after another, forked from the tests' fork server (each mostly imports:
    35 s two at a time as fresh interpreters on 2 cores), their outputs checked one by one."""
    scripts = {
        "cpu": ["benchmarks/cpu_optimizers.py", "--quick", "--repeat", "1", "--algorithms",
                "adam,adam-clipped,adam-mixed,lamb,lamb-rows"],
        "offload": ["benchmarks/offload_step.py", "--quick"],
        "zero": ["benchmarks/zero.py", "--quick"],
        "watch": ["benchmarks/weight_watch.py", "--numel", "1e5", "--tensors", "10", "--repeat", "1"],
        "gpt": ["benchmarks/gpt_offload.py", "--tiny", "--configs", "fastopt:1:delayed:module", "--timeline",
                str(tmp_path)],
        "checksums": ["benchmarks/checkpoint_checksums.py", "--dir", str(tmp_path), "--params", "2e5", "--repeats", "2"],
    }
    out = {name: run_script(*script).stdout for name, script in scripts.items()}
    assert "read-modify-write bandwidth" in out["cpu"]
    assert "| lamb | lightning_fastopt FusedLAMB |" in out["cpu"]
    assert "| lamb-rows | lightning_fastopt FusedLAMB on rows (norms given) |" in out["cpu"]
    assert "| adam-clipped | lightning_fastopt FusedAdam, the multiply in its pass (grad_factors) |" in out["cpu"]
    assert "| adam-clipped | torch AdamW(fused=True) after a multiply pass |" in out["cpu"]
    assert "| offload_fraction=0.5 |" in out["offload"] and "| torch AdamW(fused=True) | " in out["offload"]
    assert "| 2 | 1 |" in out["zero"] and "ideal sharded state" in out["zero"]
    assert "| CPU | 1e+05 bfloat16" in out["watch"] and "floor / per step" in out["watch"]
    assert "| fastopt:1:delayed:module |" in out["gpt"] and "| CPU update |" in out["gpt"]
    assert (tmp_path / "timeline_fastopt_1_delayed_module.png").is_file()
    assert "save with checksums" in out["checksums"] and "check at load" in out["checksums"]


def test_the_gpt_benchmark_reads_its_configurations():
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        from gpt_offload import CONFIGS, fastopt_arguments, fsdp_strategy
    finally:
        sys.path.pop(0)
    assert fastopt_arguments("fastopt:0.5") == (dict(offload_fraction=0.5, stream_cpu_step=False), False)
    assert fastopt_arguments("fastopt:1:stream:bind") == (dict(offload_fraction=1.0, stream_cpu_step=True,
                                                               bind_cpu_threads=True), False)
    assert fastopt_arguments("fastopt:1:stream:bf16-true") == (dict(offload_fraction=1.0, stream_cpu_step=True), True)
    with pytest.raises(ValueError, match=r"unknown suffix \['fast'\]"):
        fastopt_arguments("fastopt:1:fast")
    assert fastopt_arguments("fastopt:1:delayed") == (dict(offload_fraction=1.0, stream_cpu_step=False,
                                                           delayed_update=True, delayed_update_warmup=2), False)
    assert fastopt_arguments("fastopt:auto:stream")[0] == dict(offload_fraction="auto", stream_cpu_step=True)
    assert fastopt_arguments("fastopt:0.5:module")[0] == dict(offload_fraction=0.5, stream_cpu_step=False,
                                                             forward_waits="module")
    assert fastopt_arguments("fastopt:1:stream:clip")[0] == dict(offload_fraction=1.0, stream_cpu_step=True)
    assert {"plain:clip", "fastopt:1:clip", "fastopt:1:stream:clip"} <= set(CONFIGS)
    assert fastopt_arguments("fastopt:1:stream:t14")[0] == dict(offload_fraction=1.0, stream_cpu_step=True,
                                                               cpu_threads=14)
    with pytest.raises(ValueError, match=r"unknown suffix \['t14', 't8'\]"):
        fastopt_arguments("fastopt:1:t14:t8")
    assert fsdp_strategy("fastopt_fsdp:1:params").options.offload_parameters
    assert not fsdp_strategy("fastopt_fsdp:1:stream").options.offload_parameters
    for config in CONFIGS:  # every default configuration is a valid strategy
        if config.startswith("fastopt:"):
            FastOptStrategy(**fastopt_arguments(config)[0])
        elif config.startswith(("fsdp", "fastopt_fsdp")):
            fsdp_strategy(config)


def test_the_docs_list_every_default_that_differs_from_torch():
    """The table of defaults that differ from the replaced torch optimizer
    (docs/optimizers.md) is complete and right (computed from the signatures)."""
    import inspect

    import torch

    from lightning_fastopt import FusedAdagrad, FusedAdam, FusedSGD

    text = (REPO / "docs" / "optimizers.md").read_text()
    rows = set(re.findall(r"^\| `(\w+)` \| `torch\.optim\.(\w+)` \| `(\w+)`", text, re.M))
    found = set()
    for ours, theirs in ((FusedAdam, torch.optim.AdamW), (FusedAdam, torch.optim.Adam), (FusedSGD, torch.optim.SGD),
                         (FusedAdagrad, torch.optim.Adagrad)):
        mine, torch_params = inspect.signature(ours).parameters, inspect.signature(theirs).parameters
        for name, p in torch_params.items():
            if name in mine and name != "params" and mine[name].default != p.default:
                # FusedAdam's decoupled_weight_decay defers to adamw_mode (True): the row names adamw_mode
                found.add((ours.__name__, theirs.__name__, "adamw_mode" if name == "decoupled_weight_decay" else name))
    assert found == rows
    assert inspect.signature(FusedAdam).parameters["adamw_mode"].default is True


def _markdown_pages():
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but ``-`` and ``_`` dropped,
    spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _headings(path: Path) -> set:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {_anchor(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}


def test_every_link_of_readme_and_docs_reaches_a_file_and_heading():
    checked = 0
    for page in _markdown_pages():
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if target.startswith(("http://", "https://")):
                continue
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            assert dest.exists(), f"{page.name}: {target} does not exist"
            if anchor:
                assert anchor in _headings(dest), f"{page.name}: no heading #{anchor} in {dest.name}"
            checked += 1
    assert checked >= 20  # README's links to each page, and the pages' links to each other


def test_readme_is_the_short_page_and_links_every_docs_page():
    """README is what a new user reads in five minutes: the set-up, the use, the options,
    what changes the math, and a link to every page of docs/ (the rest lives there)."""
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 200 and len(text.split()) < 1500  # (issue 68: the rest in docs/)
    assert re.findall(r"^## (.+)$", text, re.M) == ["Set-up", "Use it", "Options",
                                                     "What stays as it is, and what changes", "Read more"]
    for page in sorted((REPO / "docs").glob("*.md")):
        assert f"(docs/{page.name})" in text, f"README does not link docs/{page.name}"


def test_the_readme_option_table_names_every_argument_of_the_strategy():
    import inspect

    from lightning_fastopt import FastOptFabricStrategy

    text = (REPO / "README.md").read_text()
    table = text.split("## Options", 1)[1].split("\n## ", 1)[0]
    named = set()
    for first_cell in re.findall(r"^\| (`[^|]+`) \|", table, re.M):
        named |= set(re.findall(r"`(\w+)`", first_cell))
    for strategy in (FastOptStrategy, FastOptFabricStrategy):
        arguments = {name for name, p in inspect.signature(strategy).parameters.items()
                     if p.kind is not inspect.Parameter.VAR_KEYWORD}
        assert named == arguments, (strategy.__name__, named ^ arguments)
