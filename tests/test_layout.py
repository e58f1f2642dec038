"""The package's import graph, read from the source: no two modules import each other
(directly or around a cycle), and ``lightning_fastopt.ops`` (building and choosing the
kernels) imports nothing of the package above it.  Function-level imports count too."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "lightning_fastopt"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The package's modules that ``path`` imports (a name imported from a package counts
    as its module when it is one, else as the package)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    modules = set(files)
    graph = {}
    for name, path in files.items():
        deps = _imports(path, modules) - {name}
        # a package's modules may be imported through the package (its __init__ re-exports)
        graph[name] = {d for d in deps if not name.startswith(d + ".")}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for d in sorted(graph.get(n, ())):
            if state.get(d) == 1:
                return stack[stack.index(d):] + [d]
            if d not in state:
                found = visit(d)
                if found:
                    return found
        state[n] = 2
        stack.pop()
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_no_import_cycles():
    assert _cycle(_graph()) is None, " -> ".join(_cycle(_graph()))


def test_ops_is_the_ground_floor():
    graph = _graph()
    for name, deps in graph.items():
        if name == "lightning_fastopt.ops" or name.startswith("lightning_fastopt.ops."):
            above = {d for d in deps if not d.startswith("lightning_fastopt.ops")}
            assert not above, f"{name} imports {sorted(above)}"


FRONT_ENDS = ("lightning_fastopt.trainer", "lightning_fastopt.fabric")


def test_only_the_package_imports_a_front_end():
    """The core and the engines serve every front-end (the Trainer of either Lightning
    package, Fabric): none of them imports one, and no front-end imports another."""
    def front_end(name):
        return next((f for f in FRONT_ENDS if name == f or name.startswith(f + ".")), None)

    for name, deps in _graph().items():
        if name == "lightning_fastopt":
            continue
        crossing = {d for d in deps if front_end(d) not in (None, front_end(name))}
        assert not crossing, f"{name} imports {sorted(crossing)}"


# The layers, ground floor first: a module imports from its own layer or those before it.
# The engines (offload, zero) sit below what the front-ends share (core); the helpers they
# need from torch's runtime (runtime) below them all; the plan of a run's optimizers (plan),
# which the front-ends build their engines from, and DeepSpeed's words read into ours
# (from_deepspeed), between the engines and core.
LAYERS = ("ops", "runtime", "functional", "optim", "checkpoint", "offload", "zero", "fsdp", "plan", "from_deepspeed",
          "core", "trainer", "fabric", "memory", "")


def _layer(name: str) -> int:
    parts = name.split(".")
    return LAYERS.index(parts[1] if len(parts) > 1 else "")


def test_every_import_points_down_the_layers():
    """Issue 40: ``core/grad_hooks`` and ``core/distributed`` were imported by ``offload``
    and ``zero`` below ``core``; they live in ``runtime`` now.  No import runs back up."""
    upward = sorted(f"{name} -> {d}" for name, deps in _graph().items() for d in deps if _layer(d) > _layer(name))
    assert not upward, upward
    assert _layer("lightning_fastopt.offload.optimizer") < _layer("lightning_fastopt.core.engines")
    assert {n.split(".")[1] for n in _graph() if "." in n} <= set(LAYERS)  # every subpackage has its layer


def test_the_package_root_holds_only_public_modules():
    """At the root: the public names (``__init__``) and the public modules; the rest lives
    in the subpackage of what it is part of."""
    assert sorted(p.name for p in PACKAGE.glob("*.py")) == ["__init__.py", "functional.py", "memory.py"]


def test_the_graph_is_read_right():
    """The reader sees the imports that exist (a test that finds nothing proves nothing)."""
    graph = _graph()
    assert "lightning_fastopt.optim.wrapper" in graph["lightning_fastopt.offload.optimizer"]
    assert "lightning_fastopt.checkpoint.sharded" in graph["lightning_fastopt.trainer.engine_checkpoints"]
    assert "lightning_fastopt.core.engines" in graph["lightning_fastopt.fabric.strategy"]
    assert "lightning_fastopt.ops" in graph["lightning_fastopt.functional"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_every_subpackage_ships_in_the_wheel():
    """pyproject.toml lists the packages a wheel holds: every folder of the package is one
    (an editable install hides a missing one; ``lightning_fastopt.fabric`` was)."""
    import tomllib

    listed = set(tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {_module_name(p) for p in PACKAGE.rglob("__init__.py")}
    assert found - listed == set()


def test_the_architecture_pages_run_plan_is_what_the_code_prints():
    """docs/architecture.md's five-minute section shows a run plan's table: its code, run
    here, prints that table today (a change to the plan shows up on the page)."""
    import contextlib
    import io
    import re

    page = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    section = page.split("## A step in five minutes", 1)[1].split("\n## ", 1)[0]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    shown = re.search(r"```text\n(.*?)\n```", section, re.S).group(1)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "docs/architecture.md", "exec"), {"__name__": "architecture_example"})
    assert printed.getvalue().rstrip("\n") == shown


CLASS_LINES, FUNCTION_LINES = 300, 60  # issue 68's bar, docstrings included


def _oversized(source: str) -> list[str]:
    """The classes over CLASS_LINES lines and the functions over FUNCTION_LINES in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            bar = CLASS_LINES if isinstance(node, ast.ClassDef) else FUNCTION_LINES
            lines = node.end_lineno - node.lineno + 1
            if lines > bar:
                found.append(f"{node.name} (line {node.lineno}): {lines} lines")
    return found


def test_the_size_check_sees_one_line_over_the_bar():
    def body(n):
        return "\n".join(f"    x{i} = {i}" for i in range(n))

    at_bar = f"class Ok:\n{body(CLASS_LINES - 1)}\n\ndef ok():\n{body(FUNCTION_LINES - 1)}\n"
    over = f"class Big:\n{body(CLASS_LINES)}\n\ndef big():\n{body(FUNCTION_LINES)}\n"
    assert _oversized(at_bar) == []
    assert _oversized(over) == [f"Big (line 1): {CLASS_LINES + 1} lines",
                                f"big (line {CLASS_LINES + 3}): {FUNCTION_LINES + 1} lines"]


def test_no_class_over_300_lines_and_no_function_over_60():
    found = {str(p.relative_to(PACKAGE.parent)): _oversized(p.read_text()) for p in sorted(PACKAGE.rglob("*.py"))}
    assert {path: names for path, names in found.items() if names} == {}
