"""The package's import structure: no cycles (imports inside functions count), a config that loads no
model code, and no private name (leading underscore) taken from another specjax module."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "specjax"


def module_files(root: Path = PACKAGE) -> dict[str, Path]:
    """specjax's modules by dotted name (a package by its own name) -> file."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


MODULES = module_files()


def imported_modules(path: Path, importer: str | None = None) -> set[str]:
    """The specjax modules a file imports, at any depth (inside functions too). `from a import b` names
    module a.b when that is a module, else a. importer (the file's dotted name) resolves relative imports."""
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = importer.split(".") if path.name == "__init__.py" else importer.split(".")[:-1]
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets.update(f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names)
    resolved = set()
    for name in targets:
        while name and name not in MODULES:
            name = name.rpartition(".")[0]
        if name:
            resolved.add(name)
    return resolved - {importer}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (as a path that returns to its start) per strongly connected component that has one."""
    cycles, done = [], set()
    for start in sorted(graph):
        path, on_path = [], {}

        def visit(module):  # depth-first; a module met again on the current path closes a cycle
            if module in on_path:
                return path[on_path[module]:] + [module]
            if module in done:
                return None
            on_path[module] = len(path)
            path.append(module)
            for nxt in sorted(graph[module]):
                found = visit(nxt)
                if found:
                    return found
            path.pop()
            del on_path[module]
            done.add(module)
            return None

        found = visit(start)
        if found:
            cycles.append(found)
            done.update(found)
    return cycles


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_cycles(graph) == [["a", "b", "c", "a"]]
    assert import_cycles({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []


def test_the_package_has_no_import_cycles():
    graph = {name: imported_modules(path, name) for name, path in MODULES.items()}
    assert graph["specjax.verify"] >= {"specjax.verify.block"}  # the walk sees imports
    assert "specjax.pallas_kernels.block_verify" in graph["specjax.verify"]  # inside functions too
    cycles = import_cycles(graph)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(cycle) for cycle in cycles)


def test_a_config_imports_no_model_code():
    code = ("import sys; from specjax.config import SpecConfig; SpecConfig(); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('flax', 'safetensors', 'specjax')))")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert eval(out)[:2] == ["specjax", "specjax.config"]
    assert all(name.startswith("specjax.config.") for name in eval(out)[2:]), out


def test_the_verifiers_load_no_model_code():
    """Verifiers are pure math: the tree verifier reads a tree's structure (specjax.trees.structure) without the
    masks and cache moves that run it through a model."""
    code = ("import sys; import specjax.verify.tree; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('flax', 'safetensors', 'specjax')))")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert not [name for name in eval(out) if name.startswith(("flax", "safetensors", "specjax.models"))], out


def private_names_taken(source: str, where: str) -> list[str]:
    """`from specjax.x import _name`, and `module._name` on a specjax module the source imported."""
    tree = ast.parse(source, where)
    found, module_aliases = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "specjax":
            for alias in node.names:
                if f"{node.module}.{alias.name}" in MODULES:
                    module_aliases.add(alias.asname or alias.name)
                elif is_private(alias.name):
                    found.append((node.lineno, f"from {node.module} import {alias.name}"))
        elif isinstance(node, ast.Import):
            module_aliases.update(alias.asname or alias.name for alias in node.names
                                  if alias.name.split(".")[0] == "specjax")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and is_private(node.attr) and ast.unparse(node.value) in module_aliases:
            found.append((node.lineno, ast.unparse(node)))
    return [f"{where}:{line}: {text}" for line, text in sorted(found)]


def is_private(name: str) -> bool:
    return name.startswith("_") and not name.endswith("__")


def test_the_private_name_check_sees_both_forms():
    source = ("from specjax.models import hf\nfrom specjax.config import _x, DTYPES\nhf._in_proj(1)\nhf.__name__\n"
              "import specjax.models.eagle\nspecjax.models.eagle._rules\nfrom tests.helpers import _ok\n")
    assert private_names_taken(source, "probe.py") == ["probe.py:2: from specjax.config import _x",
                                                       "probe.py:3: hf._in_proj",
                                                       "probe.py:6: specjax.models.eagle._rules"]


@pytest.mark.parametrize("folder", ["specjax", "scripts", "benchmarks", "tests"])
def test_no_private_name_crosses_modules(folder):
    if not (REPO / folder).is_dir():
        pytest.skip(f"no {folder}/ in this checkout")
    found = [line for path in sorted((REPO / folder).rglob("*.py"))
             for line in private_names_taken(path.read_text(), str(path.relative_to(REPO)))]
    assert not found, "private names taken from other modules:\n" + "\n".join(found)
