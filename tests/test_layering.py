"""Packaging and dependency direction (docs/ARCHITECTURE.md):

    frontend --HTTP--> runtime --> kernels --> torch, triton
                          \\-----> radix   --> stdlib only

and inside the runtime, by process (RUNTIME_PACKAGES): server/ (tokenizer process) and
scheduler/ + executor/ + memory/ (scheduler process) meet only in messages / ipc.

except ``frontend/engine.py``: ``Engine()`` runs the runtime in-process, importing it
inside the constructor only (so importing the frontend stays torch-free).
"""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"runtime": "radixlm.runtime", "radix": "radixlm.radix", "kernels": "radixlm.kernels",
           "frontend": "radixlm.frontend"}


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _package_folders() -> dict[str, str]:
    """Every folder with an __init__.py under the four roots -> its import name."""
    found = {}
    for folder, name in FOLDERS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found[init.parent.relative_to(ROOT).as_posix()] = ".".join([name, *rel.parts])
    return found


def test_every_package_folder_is_listed_in_pyproject():
    setuptools = _pyproject()["tool"]["setuptools"]
    packages, package_dir = set(setuptools["packages"]), setuptools["package-dir"]
    for folder, name in _package_folders().items():
        assert name in packages, f"{name} ({folder}) missing from [tool.setuptools] packages"
        assert package_dir.get(name) == folder, f"{name} must map to {folder} in package-dir"


LAZY_RUNTIME = {"frontend/engine.py"}  # may import the runtime inside functions, not at module level


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    if path.relative_to(ROOT).as_posix() in LAZY_RUNTIME:  # module-level statements only
        tree = ast.Module(body=[n for n in tree.body if not isinstance(
            n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)], type_ignores=[])
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            names |= _absolute(path, node)
    return names


def _module_imports(folder: str) -> set[str]:
    out: set[str] = set()
    for path in (ROOT / folder).rglob("*.py"):
        out |= _imports(path)
    return out


def test_radix_imports_only_stdlib_and_itself():
    for name in _module_imports("radix"):  # and radixlm_pkg's stdlib-only guard (checkout root)
        top = name.split(".")[0]
        assert top in sys.stdlib_module_names or name.startswith("radixlm.radix") or top == "radixlm_pkg", name


@pytest.mark.parametrize("folder,forbidden", [
    ("kernels", ("radixlm.runtime", "radixlm.frontend")),
    ("radix", ("radixlm.runtime", "radixlm.kernels", "radixlm.frontend", "torch")),
    ("frontend", ("radixlm.runtime", "radixlm.kernels", "torch")),
])
def test_dependency_direction(folder, forbidden):
    for name in _module_imports(folder):
        assert not name.startswith(forbidden), f"{folder}/ imports {name}"


# radixlm.runtime's packages and what each may import of the others (module level and
# inside functions alike). The launchers (launch_server, engine, cli) compose the two
# processes and may import any of them.
RUNTIME_PACKAGES = {
    "messages": set(),
    "kv_events": set(),
    "ipc": {"messages"},
    "server_args": set(),
    "text": {"messages"},
    "memory": set(),
    "server": {"messages", "ipc", "server_args", "text"},
    "executor": {"messages", "server_args", "memory", "text", "scheduler.decision",
                 "scheduler.request"},
    "scheduler": {"messages", "ipc", "server_args", "memory", "text", "executor", "kv_events"},
    "bench": {"server_args", "executor.model_loader"},
    "launch_server": {"messages", "ipc", "server_args", "server", "scheduler", "executor"},
    "engine": {"messages", "ipc", "server_args", "server", "scheduler", "executor", "launch_server"},
    "deploy": {"kv_events", "server_args", "launch_server"},
    "cli": {"launch_server", "bench", "executor.kv_calibration", "deploy"},
}
TORCH_FREE = [
    "radixlm.radix", "radixlm.frontend", "radixlm.runtime.server_args", "radixlm.runtime.messages",
    "radixlm.runtime.memory.page_allocator", "radixlm.runtime.memory.cost_model",
    "radixlm.runtime.memory.disk_store", "radixlm.runtime.scheduler.hicache",
    "radixlm.runtime.scheduler.peer", "radixlm.runtime.scheduler.planner", "radixlm.runtime.scheduler.decision",
    "radixlm.runtime.scheduler.prefix_cache", "radixlm.runtime.bench.cache_sim",
    "radixlm.runtime.bench.serving", "radixlm.runtime.kv_events",
]


def _module_name(path: Path) -> str:
    """runtime/server/metrics.py -> radixlm.runtime.server.metrics (a package: its __init__)."""
    folder = path.relative_to(ROOT).parts[0]
    rel = path.relative_to(ROOT / folder).with_suffix("").parts
    return ".".join([FOLDERS[folder], *(rel[:-1] if rel[-1] == "__init__" else rel)])


def _absolute(path: Path, node: ast.Import | ast.ImportFrom) -> set[str]:
    """The modules an import statement names, relative ones resolved against the file's
    package, each ``from X import y`` also as ``X.y`` (y may be a submodule)."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names}
    base = node.module or ""
    if node.level:
        package = _module_name(path).split(".")
        if path.name != "__init__.py":
            package = package[:-1]
        package = package[:len(package) - (node.level - 1)]
        base = ".".join(package + ([node.module] if node.module else []))
    return {base} | {f"{base}.{a.name}" for a in node.names}


def _import_nodes(path: Path) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement of a file, inside functions too, except those under
    ``if TYPE_CHECKING:`` (annotations only: they never run)."""
    tree = ast.parse(path.read_text())
    skip = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
            and isinstance(block.test, ast.Name) and block.test.id == "TYPE_CHECKING"
            for stmt in block.body for n in ast.walk(stmt)}
    return [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom) and id(n) not in skip]


def _runtime_unit(path: Path) -> str:
    """runtime/scheduler/planner.py -> "scheduler"; runtime/ipc.py -> "ipc"."""
    rel = path.relative_to(ROOT / "runtime").with_suffix("").parts
    return rel[0]


def _runtime_edges() -> dict[str, set[str]]:
    """package -> the runtime modules it imports (dotted below radixlm.runtime)."""
    edges: dict[str, set[str]] = {}
    for path in (ROOT / "runtime").rglob("*.py"):
        if path.name == "__init__.py" and path.parent == ROOT / "runtime":
            continue
        unit = _runtime_unit(path)
        for node in _import_nodes(path):
            mods = _absolute(path, node)
            edges.setdefault(unit, set()).update(
                m.removeprefix("radixlm.runtime.") for m in mods if m.startswith("radixlm.runtime."))
    return edges


def _allowed(unit: str, target: str) -> bool:
    top = target.split(".")[0]
    if top == unit:
        return True
    rules = RUNTIME_PACKAGES[unit]
    return any(target == r or target.startswith(r + ".") for r in rules)


def test_runtime_package_list_matches_the_tree():
    units = {_runtime_unit(p) for p in (ROOT / "runtime").rglob("*.py") if p.parent != ROOT / "runtime"
             or p.name != "__init__.py"}
    assert units == set(RUNTIME_PACKAGES)


def test_runtime_dependency_directions():
    bad = [(u, t) for u, targets in _runtime_edges().items() for t in sorted(targets) if not _allowed(u, t)]
    assert not bad, f"imports against the layering: {bad}"


def _module_graph() -> dict[str, set[str]]:
    """Every radixlm module -> the radixlm modules it imports, inside functions too (a lazy
    import hides a cycle from the interpreter, not from the reader)."""
    graph: dict[str, set[str]] = {}
    for folder in FOLDERS:
        for path in (ROOT / folder).rglob("*.py"):
            deps = set()
            for node in _import_nodes(path):
                deps |= _absolute(path, node)
            graph[_module_name(path)] = deps
    return {m: {d for d in deps if d in graph and d != m} for m, deps in graph.items()}


def test_no_import_cycles():
    graph = _module_graph()
    state: dict[str, int] = {}
    cycles = []

    def visit(mod: str, stack: list[str]) -> None:
        state[mod] = 1
        for dep in sorted(graph[mod]):
            if state.get(dep) == 1 and not mod.startswith(dep + ".") and not dep.startswith(mod + "."):
                cycles.append(stack[stack.index(dep):] + [mod, dep] if dep in stack else [mod, dep])
            elif dep not in state:
                visit(dep, stack + [mod])
        state[mod] = 2

    for mod in sorted(graph):
        if mod not in state:
            visit(mod, [])
    assert not cycles, f"import cycles: {cycles}"


@pytest.mark.parametrize("module", TORCH_FREE)
def test_torch_free_imports(module):
    code = f"import sys, {module}; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cli_choices_match_registries():
    import dataclasses

    from radixlm.radix import EVICTION_POLICIES
    from radixlm.runtime import server_args
    from radixlm.runtime.executor.attention import attention_backend_choices
    from radixlm.runtime.memory import host_pool, kv_formats
    from radixlm.runtime.scheduler import hicache, planner, preemption, waiting_order
    from radixlm.runtime.server_args import ServerArgs
    from radixlm.runtime.text import tool_parsers

    fields = {f.name: f for f in dataclasses.fields(ServerArgs)}
    assert tuple(fields["attention_backend"].metadata["choices"]) == tuple(
        attention_backend_choices()
    )
    assert tuple(fields["radix_eviction_policy"].metadata["choices"]) == tuple(EVICTION_POLICIES)
    # the choices server_args spells out so that the tokenizer process imports no registry
    assert fields["kv_cache_dtype"].metadata["choices"] == kv_formats.KV_CACHE_DTYPES
    assert server_args.DEFAULT_KV_SINK_SLOTS == kv_formats.DEFAULT_KV_SINK_SLOTS
    assert fields["preemption_policy"].metadata["choices"] == tuple(preemption.PREEMPTION_POLICIES)
    assert fields["preemption_mode"].metadata["choices"] == planner.PREEMPTION_MODES
    assert fields["schedule_policy"].metadata["choices"] == waiting_order.SCHEDULE_POLICIES
    assert fields["hicache_write_policy"].metadata["choices"] == hicache.WRITE_POLICIES
    assert fields["hicache_io_backend"].metadata["choices"] == host_pool.IO_BACKENDS
    assert fields["tool_call_parser"].metadata["choices"] == ("auto", *tool_parsers.TOOL_CALL_PARSERS)


@pytest.mark.parametrize(("module", "forbidden"), [
    ("radixlm.runtime.server.http_server", ("radixlm.runtime.scheduler", "radixlm.runtime.executor",
                                            "radixlm.runtime.memory")),
    ("radixlm.runtime.server.openai_api", ("radixlm.runtime.scheduler", "radixlm.runtime.executor",
                                           "radixlm.runtime.memory")),
])
def test_the_tokenizer_process_loads_no_scheduler_side_module(module, forbidden):
    """What the HTTP side imports, directly or through the config it shares, holds nothing
    of the scheduler process's packages (direct imports are checked above; this catches
    the transitive ones)."""
    code = (f"import sys, {module}\n"
            f"print(sorted(m for m in sys.modules if m.startswith({forbidden!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout == "[]\n", out.stdout


@pytest.mark.parametrize("folder", sorted(FOLDERS))
def test_a_checkout_root_on_sys_path_shadows_no_top_level_package(folder):
    """``python -c`` run in the checkout puts its root first on sys.path; ``import kernels``
    (Hugging Face's package, which transformers >= 5.25 imports before radixlm is) and the
    other folder names must then resolve as without the checkout: to the installed
    top-level package, or, where none is installed, to an empty namespace package (what a
    plain folder gives; transformers counts that as absent but lets ModuleNotFoundError
    through), never to the radixlm folder."""
    code = (f"import importlib, sys\nbefore = list(sys.path)\ntry:\n    m = importlib.import_module({folder!r})\n"
            "except ModuleNotFoundError:\n    print('none')\nelse:\n"
            "    print(m.__file__ if m.__file__ else ('namespace', [a for a in vars(m) if not a.startswith('__')]))\n"
            "assert sys.path == before, (before, sys.path)\n")  # the checkout root stays: files beside a script
    want = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True, check=True)
    got = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert got.returncode == 0, got.stderr
    expected = "('namespace', [])\n" if want.stdout == "none\n" else want.stdout
    assert got.stdout == expected, f"from the checkout root, import {folder} gave {got.stdout!r}"
    assert str(ROOT / folder) not in got.stdout


@pytest.mark.parametrize("folder", sorted(FOLDERS))
def test_the_checkout_root_shadows_nothing_where_radixlm_is_not_installed(folder):
    """A peer server (vLLM, SGLang) started from the checkout root runs in an environment
    without radixlm: ``import kernels`` there must not fail inside radixlm's guard.
    ``python -S`` leaves site-packages (and radixlm's editable install) off sys.path."""
    code = f"import {folder} as m; print(m.__file__, [a for a in vars(m) if not a.startswith('__')])"
    got = subprocess.run([sys.executable, "-S", "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert got.returncode == 0, got.stderr
    assert got.stdout == "None []\n", got.stdout


def _architecture() -> str:
    return (ROOT / "docs" / "ARCHITECTURE.md").read_text()


def test_architecture_lists_every_runtime_package():
    """docs/ARCHITECTURE.md's package list names each package of RUNTIME_PACKAGES (one
    line each) and each sub-package folder of runtime/."""
    doc = _architecture()
    lines = [ln for ln in doc.splitlines() if ln.startswith("- `")]
    named = " ".join(lines)
    for unit in RUNTIME_PACKAGES:
        folder = ROOT / "runtime" / unit
        token = f"`{unit}/`" if folder.is_dir() else f"`{unit}.py`"
        assert token in named, f"docs/ARCHITECTURE.md's package list lacks {token}"
    for folder in sorted(p for p in (ROOT / "runtime").iterdir() if (p / "__init__.py").exists()):
        assert folder.name in RUNTIME_PACKAGES, f"runtime/{folder.name}/ is not in RUNTIME_PACKAGES"


def test_architecture_names_only_modules_that_exist():
    """Every module path the lifecycle and package pages cite (`server/http_common.py`,
    `radix/tree.py`, ...) exists, below runtime/ or the repository root."""
    import re

    cited = set(re.findall(r"`([a-z_]+(?:/[a-z_]+)*\.py)`", _architecture()))
    assert len(cited) > 20, cited
    missing = [p for p in sorted(cited) if not (ROOT / "runtime" / p).exists() and not (ROOT / p).exists()]
    assert not missing, f"docs/ARCHITECTURE.md cites modules that do not exist: {missing}"


def test_architecture_import_table_matches_runtime_packages():
    """docs/ARCHITECTURE.md's "may import" table says what RUNTIME_PACKAGES enforces."""
    import re

    rows = {}
    for line in _architecture().splitlines():
        m = re.match(r"\| `([a-z_]+)` \| (.*) \|$", line)
        if m and m.group(1) in RUNTIME_PACKAGES:
            rows[m.group(1)] = set(re.findall(r"`([a-z_.]+)`", m.group(2)))
    assert set(rows) == set(RUNTIME_PACKAGES), set(RUNTIME_PACKAGES) ^ set(rows)
    rows["engine"] |= RUNTIME_PACKAGES["launch_server"] if "launch_server" in rows["engine"] else set()
    for unit, allowed in RUNTIME_PACKAGES.items():
        assert rows[unit] == allowed, f"docs/ARCHITECTURE.md: {unit} may import {rows[unit]}, the test allows {allowed}"
