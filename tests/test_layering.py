"""Packaging and dependency direction (ARCHITECTURE.md):

    frontend --HTTP--> runtime --> kernels --> torch, triton
                          \\-----> radix   --> stdlib only

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
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _module_imports(folder: str) -> set[str]:
    out: set[str] = set()
    for path in (ROOT / folder).rglob("*.py"):
        out |= _imports(path)
    return out


def test_radix_imports_only_stdlib_and_itself():
    for name in _module_imports("radix"):  # and radixlm's own stdlib-only __init__ (the checkout guard)
        top = name.split(".")[0]
        assert top in sys.stdlib_module_names or name.startswith("radixlm.radix") or name == "radixlm", name


@pytest.mark.parametrize("folder,forbidden", [
    ("kernels", ("radixlm.runtime", "radixlm.frontend")),
    ("radix", ("radixlm.runtime", "radixlm.kernels", "radixlm.frontend", "torch")),
    ("frontend", ("radixlm.runtime", "radixlm.kernels", "torch")),
])
def test_dependency_direction(folder, forbidden):
    for name in _module_imports(folder):
        assert not name.startswith(forbidden), f"{folder}/ imports {name}"


@pytest.mark.parametrize(
    "module", ["radixlm.radix", "radixlm.frontend", "radixlm.runtime.cache_sim"]
)
def test_torch_free_imports(module):
    code = f"import sys, {module}; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cli_choices_match_registries():
    import dataclasses

    from radixlm.radix import EVICTION_POLICIES
    from radixlm.runtime.attention import attention_backend_choices
    from radixlm.runtime.server_args import ServerArgs

    fields = {f.name: f for f in dataclasses.fields(ServerArgs)}
    assert tuple(fields["attention_backend"].metadata["choices"]) == tuple(
        attention_backend_choices()
    )
    assert tuple(fields["radix_eviction_policy"].metadata["choices"]) == tuple(EVICTION_POLICIES)


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
