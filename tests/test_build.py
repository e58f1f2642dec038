"""The JIT build: cache keys, the lock, stale-lock recovery, concurrent builds, missing
tools, real compiler errors, the forced fallback, and no CUDA library in the CPU op."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch

import lightning_fastopt.ops as ops
import lightning_fastopt.ops.cpu as cpu
from lightning_fastopt.ops import builder, torch_backend
from lightning_fastopt.ops.builder import ExtensionBuildError, ExtensionSpec, build_dir, build_key, load_extension
from lightning_fastopt.ops.cpu import cpu_extension_spec, load_cpu_extension
from lightning_fastopt.ops.isa import available_isas, detect_isa
from lightning_fastopt.ops.__main__ import main as ops_main
from lightning_fastopt.ops.locking import BuildLockTimeout, file_lock

REPO = Path(__file__).resolve().parent.parent
TINY = textwrap.dedent("""
    #include <pybind11/pybind11.h>
    int answer() { return 42; }
    PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("answer", &answer); }
""")


def tiny_spec(tmp_path, name="fastopt_tiny", source=TINY, variant="t"):
    src = tmp_path / f"{name}.cpp"
    src.write_text(source)
    return ExtensionSpec(name=name, variant=variant, sources=(str(src),))


@pytest.fixture
def ext_dir(tmp_path, monkeypatch):
    d = tmp_path / "extensions"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(d))
    return d


def test_cache_key_covers_isa_sources_and_flags(tmp_path, ext_dir):
    keys = {isa: build_dir(cpu_extension_spec(isa)) for isa in available_isas()}
    assert len(set(keys.values())) == len(keys)
    for isa, d in keys.items():
        assert f"-{isa}-" in os.path.basename(d)  # the ISA is visible in the directory name
        assert d.startswith(str(ext_dir))  # TORCH_EXTENSIONS_DIR is respected
    spec = tiny_spec(tmp_path)
    key = build_key(spec)
    Path(spec.sources[0]).write_text(TINY + "\n// changed\n")
    assert build_key(spec) != key
    assert build_key(ExtensionSpec(**{**spec.__dict__, "cflags": ("-O1",)})) != build_key(spec)


def test_every_header_the_cpu_build_includes_is_in_its_cache_key():
    names = {Path(p).name for p in cpu_extension_spec().headers}
    on_disk = {p.name for d in ("common", "cpu") for p in (REPO / "csrc" / d).iterdir() if p.suffix == ".h"}
    assert on_disk <= names, on_disk - names


def test_isa_detection_and_override(monkeypatch):
    best = detect_isa().name
    assert best in ("generic", "avx2", "avx512")
    monkeypatch.setenv("LIGHTNING_FASTOPT_ISA", "generic")
    assert detect_isa().name == "generic"
    monkeypatch.setenv("LIGHTNING_FASTOPT_ISA", "avx9")
    with pytest.raises(ValueError, match="LIGHTNING_FASTOPT_ISA='avx9'"):
        detect_isa()
    if best != "avx512":
        monkeypatch.setenv("LIGHTNING_FASTOPT_ISA", "avx512")
        with pytest.raises(ValueError, match="supports at most"):
            detect_isa()


def _hold_lock(path, ready):
    """A process holding the lock at ``path`` until it is killed, once it says so (``ready``
    written).  Waited for as long as it takes (its imports took over 30 s on a loaded
    2-core machine), unless it ends."""
    code = (f"from lightning_fastopt.ops.locking import file_lock\nimport pathlib, signal\n"
            f"with file_lock({str(path)!r}, timeout=600):\n"
            f"    pathlib.Path({str(ready)!r}).write_text('1')\n    while True: signal.pause()\n")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO)
    while not ready.exists():
        assert proc.poll() is None, "the lock holder ended before it held the lock"
        time.sleep(0.05)
    return proc


def test_lock_times_out_with_a_clear_error_then_recovers_after_sigkill(tmp_path):
    lock = tmp_path / "build.lock"
    holder = _hold_lock(lock, tmp_path / "ready")
    try:
        start = time.monotonic()
        with pytest.raises(BuildLockTimeout, match="LIGHTNING_FASTOPT_BUILD_TIMEOUT"):
            with file_lock(str(lock), timeout=0.5):  # the holder never lets go: only giving up ends this
                pass
        assert time.monotonic() - start >= 0.5  # it waited its timeout first (no bound above: a loaded machine)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    # the killed holder's lock is gone with it: no stale lock to clean up
    with file_lock(str(lock), timeout=5):
        pass


def test_a_killed_builds_staging_directory_is_removed_and_never_reused(tmp_path, ext_dir):
    """A build killed mid-way leaves its staging directory (and maybe compilers still
    writing there, and torch's baton file, on which torch would wait forever): the next
    build compiles in a fresh directory, removes the old one, and publishes only the
    library and its record."""
    spec = tiny_spec(tmp_path)
    d = Path(build_dir(spec))
    killed = Path(f"{d}.staging-999999-dead")
    killed.mkdir(parents=True)
    (killed / "lock").write_text("")
    (killed / f"{spec.name}.so").write_bytes(b"half written")
    module = load_extension(spec, timeout=300)
    assert module.answer() == 42
    assert module.__file__ == str(d / f"{spec.name}.so")
    assert not killed.exists()
    assert not list(d.parent.glob(f"{d.name}.staging-*"))
    assert sorted(p.name for p in d.iterdir()) == ["BUILD_OK", f"{spec.name}.so"]
    assert builder.is_built(spec)


def _run(code, ext_dir):
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(ext_dir)}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)


def _load_code(spec):
    return f"""
        from lightning_fastopt.ops.builder import ExtensionSpec, load_extension
        spec = ExtensionSpec(name={spec.name!r}, variant={spec.variant!r}, sources=({spec.sources[0]!r},),
                             title="the tiny kernels", core_seconds=20.0)
        assert load_extension(spec, timeout=300).answer() == 42
    """


def test_concurrent_processes_build_once_and_say_so_before_and_after(tmp_path, ext_dir):
    spec = tiny_spec(tmp_path, name="fastopt_tiny_concurrent")
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(ext_dir)}
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(_load_code(spec))], cwd=REPO, env=env,
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]
    errs = [p.communicate(timeout=600)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], errs
    said = "".join(errs)
    assert said.count("building the tiny kernels for this machine (not in the cache yet, about ") == 1, said
    assert re.search(r"lightning_fastopt: built the tiny kernels in \d+ s: " + re.escape(build_dir(spec)), said)
    # a process that found the build under way says so once, and once when it is done
    waiting = said.count("waiting for the tiny kernels: another process (pid ")
    assert said.count("the tiny kernels built by another process are ready (waited ") == waiting, said
    # and the building one says each source as it is compiled (one here)
    assert said.count(f"lightning_fastopt: the tiny kernels: {spec.name} compiled (1 of 1, ") == 1, said
    assert said.count("lightning_fastopt:") == 3 + 2 * waiting, said


def test_the_time_a_build_says_is_this_machines_under_its_load(tmp_path, monkeypatch):
    """The first line's estimate: the spec's one-core seconds over the compiles ninja runs
    at once, each at the share of a core the work keeping the cores busy leaves it, then
    scaled by the speed the last build of the spec measured here (it said "about 31 s"
    whatever the machine and its load: 38-46 s on a new user's idle 2-core machine, 396 s
    on a loaded one)."""
    from lightning_fastopt.ops import build_time

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.delenv("MAX_JOBS", raising=False)
    monkeypatch.setattr(build_time, "busy_cores", lambda: 0.0)
    assert build_time.estimate("k", 52.0, 9, str(tmp_path)) == "about 31 s"  # 52 / 2 compiles + 5
    monkeypatch.setattr(build_time, "busy_cores", lambda: 2.0)  # two compiles beside two busy cores
    assert build_time.estimate("k", 52.0, 9, str(tmp_path)) == (
        "about 57 s (the cores busy: 2 compile(s) at 50% of a core each)")  # 52 / (2 * 1/2) + 5
    build_time.record("k", build_time.predicted_seconds(52.0, 9), 114.0, str(tmp_path))  # it took twice that
    assert build_time.estimate("k", 52.0, 9, str(tmp_path)) == (
        "about 114 s (the cores busy: 2 compile(s) at 50% of a core each; at this machine's measured speed)")
    assert build_time.estimate("other", 52.0, 9, str(tmp_path)).startswith("about 57 s")  # per spec


def test_how_busy_the_cores_are_is_read_from_the_systems_cpu_time(monkeypatch):
    """Two readings of ``/proc/stat``'s first line (user nice system idle iowait irq softirq):
    300 of 400 ticks busy on 2 cores is 1.5 cores' worth of work."""
    from lightning_fastopt.ops import build_time

    readings = iter([[100, 0, 0, 100, 0, 0, 0], [350, 0, 50, 200, 0, 0, 0]])
    monkeypatch.setattr(build_time, "_cpu_times", lambda: next(readings))
    monkeypatch.setattr(build_time.time, "sleep", lambda seconds: None)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert build_time.busy_cores() == 1.5


def test_a_build_records_the_speed_it_measured(tmp_path, ext_dir):
    spec = tiny_spec(tmp_path, name="fastopt_tiny_timed")
    built = _run(_load_code(spec), ext_dir)
    assert built.returncode == 0, built.stderr
    speeds = json.loads((ext_dir / "lightning_fastopt" / "build_speed.json").read_text())
    assert speeds[spec.name] > 0


def test_a_process_waiting_for_another_ones_build_says_so(tiny_cache, tmp_path, monkeypatch):
    """The lock is held (here by the test) while another process would build: the waiting
    process names who holds it and since when, then says when the build is there (it
    printed nothing for the whole build: issue, sharp edges)."""
    spec, template = tiny_cache
    ext_dir = tmp_path / "extensions"
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(ext_dir)}
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(ext_dir))
    directory = build_dir(spec)
    with file_lock(directory + ".lock", timeout=10):
        lock = Path(directory + ".lock").read_text()
        waiter = subprocess.Popen([sys.executable, "-c", textwrap.dedent(_load_code(spec))], cwd=REPO, env=env,
                                  stderr=subprocess.PIPE, text=True)
        # the waiter imports torch (seconds, more on a loaded machine), then finds the lock held
        # and says so: wait for that line, not for a time (a killer thread bounds the wait)
        killer = threading.Timer(300, waiter.kill)
        killer.start()
        said_before = []
        while not any("waiting for" in line for line in said_before):
            line = waiter.stderr.readline()
            if not line:
                break  # the waiter ended (or was killed): the asserts below say how
            said_before.append(line)
        killer.cancel()
        shutil.copytree(Path(template) / Path(directory).relative_to(ext_dir), directory)  # "the other one's build"
    err = "".join(said_before) + waiter.communicate(timeout=300)[1]
    assert waiter.returncode == 0, err
    lines = [ln for ln in err.splitlines() if ln.startswith("lightning_fastopt:")]
    assert len(lines) == 2, err
    assert lines[0].startswith(f"lightning_fastopt: waiting for the tiny kernels: another process (pid {os.getpid()} "
                               "since ") and lines[0].endswith(f"holds the build lock {directory}.lock"), err
    assert re.fullmatch(r"lightning_fastopt: the tiny kernels built by another process are ready \(waited \d+ s\): "
                        + re.escape(directory), lines[1]), err
    assert lock.split()[0] == str(os.getpid())


@pytest.fixture(scope="module")
def tiny_cache(tmp_path_factory):
    """A kernel cache holding one finished build of the tiny extension (each test copies it)."""
    root = tmp_path_factory.mktemp("tiny_cache")
    spec = tiny_spec(root, name="fastopt_tiny_cached")
    built = _run(_load_code(spec), root / "extensions")
    assert built.returncode == 0, built.stderr
    return spec, root / "extensions"


def _copy_of(tiny_cache, ext_dir):
    spec, template = tiny_cache
    shutil.copytree(template, ext_dir)
    return spec


def _damage(spec, kind):
    library = Path(build_dir(spec)) / f"{spec.name}.so"
    data = library.read_bytes()
    if kind == "truncated":
        library.write_bytes(data[: len(data) // 2])
    elif kind == "empty":
        library.write_bytes(b"")
    elif kind == "same size, other bytes":
        library.write_bytes(data[:4096] + bytes(len(data) - 4096))
    else:
        (library.parent / "BUILD_OK").write_text("{not json")


@pytest.mark.parametrize("kind,said", [
    ("truncated", r"fastopt_tiny_cached\.so is \d+ bytes where the build wrote \d+"),
    ("empty", r"fastopt_tiny_cached\.so is 0 bytes where the build wrote \d+"),
    ("same size, other bytes", r"fastopt_tiny_cached\.so differs from what the build wrote \(SHA-256\)"),
    ("record unreadable", r"its record .*BUILD_OK is unreadable"),
])
def test_each_kind_of_damage_to_a_cached_build_is_found_and_named(tiny_cache, ext_dir, kind, said):
    spec = _copy_of(tiny_cache, ext_dir)
    assert builder.damage(spec) is None
    _damage(spec, kind)
    assert re.fullmatch(".*" + said, builder.damage(spec))
    assert not builder.is_built(spec)


def test_a_damaged_cached_build_is_rebuilt_once_with_one_line(tiny_cache, ext_dir):
    """A truncated library used to crash every later process with a bus error (an empty
    one gave the slow path forever): now it is rebuilt, once, and said why."""
    spec = _copy_of(tiny_cache, ext_dir)
    _damage(spec, "truncated")
    again = _run(_load_code(spec), ext_dir)
    assert again.returncode == 0, again.stderr
    lines = [line for line in again.stderr.splitlines() if line.startswith("lightning_fastopt:")]
    assert len(lines) == 4, lines  # why, building, the source compiled, built
    assert "rebuilding the tiny kernels: the cached build is damaged:" in lines[0]
    assert "bytes where the build wrote" in lines[0] and "building the tiny kernels" in lines[1]
    assert builder.is_built(spec)
    quiet = _run(_load_code(spec), ext_dir)
    assert quiet.returncode == 0 and "lightning_fastopt:" not in quiet.stderr, quiet.stderr


def test_ops_clean_removes_every_build_but_one_being_built(tmp_path, tiny_cache, ext_dir, capsys):
    spec = _copy_of(tiny_cache, ext_dir)
    d = Path(build_dir(spec))
    assert builder.is_built(spec)
    orphan = Path(f"{d}.staging-999999-dead")
    orphan.mkdir()
    (orphan / "x.o").write_bytes(b"0" * 1000)
    busy = d.parent / "fastopt_other-t-0123456789abcdef"
    busy.mkdir()
    holder = _hold_lock(Path(f"{busy}.lock"), tmp_path / "ready")
    try:
        assert ops_main(["clean"]) == 0
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    out = capsys.readouterr().out
    assert not d.exists() and not orphan.exists() and busy.exists()
    assert f"removed {d}" in out and f"removed {orphan}" in out
    assert f"kept {busy} (a build holds its lock)" in out
    assert re.search(r"freed \d+\.\d MB in 2 build\(s\)", out), out


def test_the_same_extension_built_twice_in_one_process_lands_under_its_own_name(tmp_path, monkeypatch):
    """A second build of one name in a process (the cache cleaned, or another cache) is where
    the first one was: torch would have named it NAME_v1 in its new staging directory."""
    spec = tiny_spec(tmp_path, name="fastopt_twice")
    for cache in ("first", "second"):
        monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / cache))
        module = load_extension(spec, timeout=300)
        assert module.__name__ == "fastopt_twice" and module.__file__.startswith(str(tmp_path / cache))
        assert builder.is_built(spec)


def test_compiler_error_is_quoted(tmp_path, ext_dir):
    spec = tiny_spec(tmp_path, name="fastopt_broken", source="int main( { this is not C++ }\n")
    with pytest.raises(ExtensionBuildError, match="error"):
        load_extension(spec, timeout=300)
    assert not builder.is_built(spec)


@pytest.fixture
def broken_cpu_build(tmp_path, ext_dir, monkeypatch):
    """The CPU extension replaced by one that cannot compile, nothing loaded yet."""
    broken = tiny_spec(tmp_path, name="fastopt_broken_cpu", source="#error deliberately broken kernel\n")
    monkeypatch.setattr(cpu, "cpu_extension_spec", lambda isa=None, cuda_roundings=None, pieces=None: broken)
    monkeypatch.setattr(cpu, "_loaded", {})
    monkeypatch.setattr(cpu, "_errors", {})
    monkeypatch.setattr(ops, "_cpu_kernels", {})
    monkeypatch.delenv(ops.BACKEND_ENV, raising=False)


def test_failed_build_warns_once_and_falls_back(broken_cpu_build, monkeypatch):
    """The build fails at the first kernel called (or at set-up, where a strategy asks for its
    pieces): one warning, then every call on the pure-PyTorch backend."""
    backend = ops.cpu_backend()
    with pytest.warns(RuntimeWarning, match="deliberately broken kernel"):
        assert backend.sgd_ is torch_backend.sgd_
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # only one warning
        assert backend.need({"adam"}) is torch_backend and backend.all_finite is torch_backend.all_finite
        p, g = torch.ones(3), torch.ones(3)
        backend.adam_([p], [g], [torch.zeros(3)], [torch.zeros(3)], None, None, lr=0.1, beta1=0.9, beta2=0.999,
                      eps=1e-8, weight_decay=0.0, step_size=0.1, bias_correction2_sqrt=1.0, inv_grad_scale=1.0,
                      amsgrad=False, adamw=True, maximize=False, check_finite=False)
        assert torch.all(p < 1)  # the pure-PyTorch step ran
    monkeypatch.setenv(ops.BACKEND_ENV, "compiled")
    with pytest.raises(ExtensionBuildError, match="deliberately broken kernel"):
        ops.cpu_backend().need({"adam"})


def test_backend_env(monkeypatch):
    monkeypatch.setenv(ops.BACKEND_ENV, "torch")
    assert ops.cpu_backend() is torch_backend
    monkeypatch.setenv(ops.BACKEND_ENV, "bogus")
    with pytest.raises(ValueError, match="expected one of"):
        ops.cpu_backend()


def test_missing_compiler_keeps_import_working_and_falls_back(tmp_path):
    """A subprocess with no usable compiler: import works, one warning says what is
    missing, and the optimizer gives torch's result through the pure-PyTorch path."""
    code = textwrap.dedent("""
        import warnings, torch
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import lightning_fastopt
            p = torch.nn.Parameter(torch.randn(100)); q = torch.nn.Parameter(p.detach().clone())
            a = lightning_fastopt.FusedAdam([p], lr=0.1, weight_decay=0.01, torch_sqrt=True)
            b = torch.optim.AdamW([q], lr=0.1)
            for _ in range(5):
                g = torch.randn(100); p.grad = g.clone(); q.grad = g.clone(); a.step(); b.step()
        msgs = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        assert len(msgs) == 1, msgs
        assert "C++ compiler '/nonexistent/c++'" in msgs[0], msgs[0]
        assert torch.equal(p, q)
        print("fallback ok")
    """)
    env = {**os.environ, "CXX": "/nonexistent/c++", "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "fallback ok" in out.stdout


def test_cpu_extension_links_no_cuda_library():
    module = load_cpu_extension(detect_isa().name, warn=False)
    assert module is not None
    readelf = shutil.which("readelf")
    if readelf is None:
        pytest.skip("readelf (binutils) is not installed")
    needed = subprocess.run([readelf, "-d", module.__file__], capture_output=True, text=True, check=True).stdout
    libs = [line.split("[")[1].rstrip("]") for line in needed.splitlines() if "(NEEDED)" in line]
    assert libs, needed
    assert not [lib for lib in libs if "cuda" in lib.lower() or "nvrtc" in lib.lower() or "curand" in lib.lower()]


def test_ops_cli_info_and_build():
    env = {k: v for k, v in os.environ.items() if k != ops.BACKEND_ENV}
    info = subprocess.run([sys.executable, "-m", "lightning_fastopt.ops", "info"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert info.returncode == 0, info.stderr
    assert f"CPU instruction set: {detect_isa().name}" in info.stdout
    assert "cache root:" in info.stdout and "FusedLAMB" in info.stdout
    assert f"compiled ({detect_isa().name})" in info.stdout
    build = subprocess.run([sys.executable, "-m", "lightning_fastopt.ops", "build"], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr
    assert f"cpu[{detect_isa().name}]: ready" in build.stdout


def test_thread_count_is_honoured_and_results_do_not_depend_on_it(compiled):
    from lightning_fastopt.functional import fused_lamb_

    results = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        torch.manual_seed(0)
        p, g = [torch.randn(300_001)], [torch.randn(300_001)]
        fused_lamb_(p, g, [torch.zeros(300_001)], [torch.zeros(300_001)], step=1, lr=1e-2, beta1=0.9,
                    beta2=0.999, eps=1e-6, weight_decay=0.01)
        results.append(p[0])
    torch.set_num_threads(os.cpu_count() or 1)
    torch.testing.assert_close(results[0], results[1], rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------------------- the environment
_BAD_SETTINGS = [
    ({ops.BACKEND_ENV: "nonsense"}, "LIGHTNING_FASTOPT_BACKEND='nonsense': expected one of ('auto', 'torch', 'compiled')"),
    ({"LIGHTNING_FASTOPT_ISA": "avx9"}, "LIGHTNING_FASTOPT_ISA='avx9': expected one of"),
    ({"LIGHTNING_FASTOPT_CUDA_ROUNDINGS": "yes"}, "LIGHTNING_FASTOPT_CUDA_ROUNDINGS='yes': expected one of"),
]
if detect_isa().name != "avx512":
    _BAD_SETTINGS.append(({"LIGHTNING_FASTOPT_ISA": "avx512"}, "this CPU supports at most"))


@pytest.mark.parametrize("setting,message", _BAD_SETTINGS, ids=lambda v: str(v)[:40])
def test_a_bad_setting_is_refused_when_the_strategy_or_optimizer_is_built(monkeypatch, setting, message):
    """It used to surface at the first optimizer step (after a training step), or to warn
    and run the slow path."""
    from lightning_fastopt import FastOptStrategy, FusedAdam

    for name, value in setting.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=re.escape(message)):
        FastOptStrategy()
    with pytest.raises(ValueError, match=re.escape(message)):
        FusedAdam([torch.nn.Parameter(torch.zeros(3))])


@pytest.mark.parametrize("setting,message", _BAD_SETTINGS, ids=lambda v: str(v)[:40])
def test_the_command_line_tools_say_a_bad_setting_in_one_line(monkeypatch, capsys, setting, message):
    """`info` and `build` check the settings in main(), before either runs."""
    for name, value in setting.items():
        monkeypatch.setenv(name, value)
    for command in ("info", "build"):
        assert ops_main([command]) == 2
        said = capsys.readouterr()
        assert said.out == "" and said.err.splitlines() == [f"error: {said.err.strip()[7:]}"]
        assert message in said.err


def test_the_command_line_prints_no_traceback_for_a_bad_setting():
    env = {**os.environ, ops.BACKEND_ENV: "nonsense"}
    out = subprocess.run([sys.executable, "-m", "lightning_fastopt.ops", "build"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and out.stderr.startswith("error: LIGHTNING_FASTOPT_BACKEND='nonsense'")
    assert "Traceback" not in out.stderr


def _unwritable_cache():
    root = "/sys/fastopt_test_cache"  # sysfs refuses new directories, to root too
    try:
        os.makedirs(root)
    except OSError:
        return root
    shutil.rmtree(root, ignore_errors=True)
    pytest.skip("no directory here refuses writes")


def test_a_cache_that_cannot_be_written_is_named_with_the_ways_out(tmp_path, monkeypatch):
    root = _unwritable_cache()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", root)
    with pytest.raises(ExtensionBuildError, match=r"the kernel cache /sys/fastopt_test_cache/lightning_fastopt "
                                                  r"cannot be written .*TORCH_EXTENSIONS_DIR.*"
                                                  r"LIGHTNING_FASTOPT_BACKEND=torch"):
        load_extension(tiny_spec(tmp_path), timeout=10)
    out = subprocess.run([sys.executable, "-m", "lightning_fastopt.ops", "build"], cwd=REPO,
                         env={**os.environ, "TORCH_EXTENSIONS_DIR": root}, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1 and "cannot be written" in out.stderr and "Traceback" not in out.stderr


def test_the_strategy_loads_the_kernels_at_set_up_not_after_a_training_step(broken_cpu_build):
    """A failing build (here: a deliberately broken one) is said before training starts."""
    import lightning as L

    from tests.test_precision import _data
    from tests.test_strategy import Model

    seen_at_first_step = []

    class Probe(Model):
        def training_step(self, batch, i):
            if not seen_at_first_step:
                seen_at_first_step.append([str(w.message) for w in caught])
            return super().training_step(batch, i)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        L.Trainer(strategy="fastopt_offload", accelerator="cpu", devices=1, max_steps=1, logger=False,
                  enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False).fit(Probe(lambda ps: torch.optim.AdamW(ps), sched=False), _data())
    assert any("deliberately broken kernel" in m for m in seen_at_first_step[0]), seen_at_first_step


# ------------------------------------------------------------ Adam's CUDA roundings, built where needed
def test_the_cuda_roundings_are_built_where_a_gpu_is_visible_or_where_asked(monkeypatch):
    monkeypatch.delenv(cpu.CUDA_ROUNDINGS_ENV, raising=False)
    for visible in (False, True):
        monkeypatch.setattr(torch.cuda, "is_available", lambda visible=visible: visible)
        assert cpu.cuda_roundings_wanted() is visible
        spec = cpu_extension_spec()
        assert ("adam_cuda_roundings.cpp" in {Path(s).name for s in spec.sources}) is visible
        assert f"-DFASTOPT_ADAM_CUDA_ROUNDINGS={int(visible)}" in spec.cflags
    for setting, wanted in (("1", True), ("0", False), ("auto", True)):
        monkeypatch.setenv(cpu.CUDA_ROUNDINGS_ENV, setting)
        assert cpu.cuda_roundings_wanted() is wanted
    lean, full = cpu_extension_spec(cuda_roundings=False), cpu_extension_spec(cuda_roundings=True)
    assert lean.name != full.name and build_dir(lean) != build_dir(full)  # both may be loaded in one process
    assert "CUDA roundings" in full.title and "CUDA roundings" not in lean.title


@pytest.mark.slow  # builds the kernels a machine without a GPU builds (about 25 s on 2 cores)
def test_kernels_built_without_the_cuda_roundings_refuse_them_and_the_step_loads_the_ones_that_have_them(monkeypatch):
    """Adam in torch's CUDA roundings is a third of the CPU kernels' build time: left out where
    no GPU is visible, a call in one of them on host tensors loads the kernels that have them
    (the pure-PyTorch path would round as the CPU's ops, not as the CUDA ones)."""
    from lightning_fastopt.functional import fused_adam_

    lean = load_cpu_extension(detect_isa().name, warn=False, cuda_roundings=False)
    full = load_cpu_extension(detect_isa().name, warn=False, cuda_roundings=True)
    assert lean is not None and full is not None
    assert not lean.adam_cuda_roundings and full.adam_cuda_roundings
    assert "adam_cuda_roundings" in full.pieces and "adam_cuda_roundings" not in lean.pieces
    monkeypatch.setattr(cpu, "cuda_roundings_wanted", lambda: False)  # what a machine without a GPU loads
    kernels = ops.CpuKernels(warn=False)
    kernels._module = lean  # what such a machine has loaded
    monkeypatch.setattr(ops, "cpu_backend", lambda: kernels)
    torch.manual_seed(0)
    start = [torch.randn(1000 + 37 * i) for i in range(3)]
    grads = [torch.randn_like(p) for p in start]

    def step(rounding, module=None):
        params = [p.clone() for p in start]
        state = [torch.zeros_like(p) for p in start], [torch.zeros_like(p) for p in start]
        with monkeypatch.context() as m:
            if module is not None:
                m.setattr(ops, "cpu_backend", lambda: module)
            for n in range(1, 4):
                fused_adam_(params, grads, *state, step=n, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
                            weight_decay=0.01, rounding=rounding)
        return params

    for a, b in zip(step("torch_cpu"), step("torch_cpu", full)):  # the CPU roundings: the same kernels
        assert torch.equal(a, b)
    assert kernels.loaded is lean
    for rounding in ("torch_cuda_foreach", "torch_cuda_fused", "torch_cuda_for_loop"):
        ours, compiled, pure = step(rounding), step(rounding, full), step(rounding, torch_backend)
        assert all(torch.equal(a, b) for a, b in zip(ours, compiled))
        assert not all(torch.equal(a, c) for a, c in zip(ours, pure))  # why the pure-PyTorch path would not do
    assert kernels.loaded.adam_cuda_roundings and kernels.loaded.__file__ == full.__file__
    params = [p.clone() for p in start]
    with pytest.raises(ValueError, match="no Adam in torch's CUDA roundings"):
        lean.adam_(params=params, grads=grads, exp_avgs=[torch.zeros_like(p) for p in start],
                   exp_avg_sqs=[torch.zeros_like(p) for p in start], max_exp_avg_sqs=None, copies=None, lr=1e-2,
                   beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step_size=1e-2, bias_correction2_sqrt=1.0,
                   inv_grad_scale=1.0, amsgrad=False, adamw=True, maximize=False, check_finite=False,
                   state_seed=1, decay=1.0, torch_sqrt=False, rounding=1)
    assert all(torch.equal(p, q) for p, q in zip(params, start))  # refused before anything was written


def test_on_an_accelerator_the_cpu_kernels_build_beside_its_own(monkeypatch):
    """ops.prepare at a GPU run's set-up: the CPU kernels' build runs while the CUDA kernels'
    does (one after the other, a GPU run's first set-up waited for both). Each stand-in
    build waits to see the other under way."""
    cpu_started, accelerator_started = threading.Event(), threading.Event()
    seen = {}

    def cpu_need(pieces):
        cpu_started.set()
        seen["accelerator's under way"] = accelerator_started.wait(timeout=60)
        seen["pieces"] = pieces

    def accelerator_route(device_type):
        accelerator_started.set()
        seen["cpu's under way"] = cpu_started.wait(timeout=60)

    backend = ops.cpu_backend()
    if not isinstance(backend, ops.CpuKernels):
        pytest.skip("the pure-PyTorch backend is chosen: nothing is built")
    monkeypatch.setattr(backend, "need", cpu_need)
    monkeypatch.setattr(ops, "route", accelerator_route)
    ops.prepare("cuda", cpu_work=True, pieces=frozenset({"adam"}))
    assert seen == {"accelerator's under way": True, "cpu's under way": True, "pieces": frozenset({"adam"})}


def test_a_cpu_build_that_fails_at_set_up_is_said_there(monkeypatch):
    """With LIGHTNING_FASTOPT_BACKEND=compiled a build that fails raises: from the thread it
    ran on too, at set-up."""
    backend = ops.cpu_backend()
    if not isinstance(backend, ops.CpuKernels):
        pytest.skip("the pure-PyTorch backend is chosen: nothing is built")

    def failed(pieces):
        raise ExtensionBuildError("the compiler said no")

    monkeypatch.setattr(backend, "need", failed)
    monkeypatch.setattr(ops, "route", lambda device_type: None)
    with pytest.raises(ExtensionBuildError, match="the compiler said no"):
        ops.prepare("cuda", cpu_work=True, pieces=frozenset({"adam"}))
    with pytest.raises(ExtensionBuildError, match="the compiler said no"):
        ops.prepare("cpu", cpu_work=False, pieces=frozenset({"adam"}))
