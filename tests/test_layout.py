"""The layout's contracts: layers that only point down, no import circles at any depth, the
strategies independent of `train/` and `planner/`, a train step that names no strategy
(`[tool.importlinter]` in pyproject.toml); no two modules of one name and no library module over
400 lines.

The contracts are checked by import-linter on the import graph of the package as it installs:
`jaxscale/` and the top-level `models/`, `meshes/` and `benchmarks/` folders installed beneath it
as `jaxscale.models`, `.meshes` and `.benchmarks` (grimp alone would read `jaxscale/` only, and
miss every import of and by them). Imports inside functions count, as grimp counts them.

    python tests/test_layout.py        # the whole import-linter report
"""
from __future__ import annotations

import ast
import sys
from collections import Counter
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[1]
#: source folder -> the package it installs as
PACKAGES = {"jaxscale": "jaxscale", "models": "jaxscale.models", "meshes": "jaxscale.meshes",
            "benchmarks": "jaxscale.benchmarks"}
LIBRARY = ("jaxscale", "models")
MAX_LINES = 400


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the installed package: dotted name -> file."""
    out = {}
    for folder, package in PACKAGES.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = path.relative_to(root / folder).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            out[".".join((package,) + parts)] = path
    return out


def imports(name: str, path: Path, known: set[str]):
    """(imported module, line number, line) for every import of a jaxscale module in `path`,
    at any depth (inside functions too); `from a import b` is module a.b when that exists."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    lines = path.read_text().splitlines()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                       for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                yield target, node.lineno, lines[node.lineno - 1].strip()


def build_graph(root: Path = ROOT) -> grimp.ImportGraph:
    graph = grimp.ImportGraph()
    found = modules(root)
    for name in found:
        graph.add_module(name)
    for name, path in found.items():
        for target, line, text in imports(name, path, set(found)):
            graph.add_import(importer=name, imported=target, line_number=line,
                             line_contents=text)
    return graph


class _Builder:
    """import-linter's graph builder, reading the installed layout (`build_graph`)."""

    def build(self, root_package_names, cache_dir=None, include_external_packages=False,
              exclude_type_checking_imports=False):
        return build_graph()


def lint(config: Path = ROOT / "pyproject.toml") -> bool:
    from importlinter import configuration
    from importlinter.application import use_cases
    from importlinter.application.app_config import settings
    configuration.configure()
    settings.configure(GRAPH_BUILDER=_Builder())
    return use_cases.lint_imports(config_filename=str(config), cache_dir=None, no_logo=True)


def circles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Every set of modules that import one another round in a circle (Tarjan's strongly
    connected components of more than one module): a package's `__init__` counts as a module,
    so a child importing its package while the package imports it is a circle too."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.find_modules_directly_imported_by(v)):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while not comp or comp[-1] != v:
                comp.append(stack.pop())
                on.discard(comp[-1])
            if len(comp) > 1:
                out.append(sorted(comp))
    for v in sorted(graph.modules):
        if v not in index:
            visit(v)
    return out


def test_the_import_contracts_hold(capsys):
    kept = lint()
    report = capsys.readouterr().out
    assert kept, report
    assert "Contracts: 4 kept, 0 broken." in report, report


def test_no_module_is_in_an_import_circle():
    assert circles(build_graph()) == []


def test_a_circle_is_found():
    graph = build_graph()
    graph.add_import(importer="jaxscale.hooks.attention", imported="jaxscale.models.llama")
    assert ["jaxscale.hooks.attention", "jaxscale.models.llama"] in circles(graph)


def test_the_graph_sees_the_installed_folders():
    """An import of `jaxscale.models...` is an edge to the model (the contracts would be blind to
    the models' layer without it), and a function's import is an edge too."""
    graph = build_graph()
    assert "jaxscale.models.llama" in graph.find_modules_directly_imported_by(
        "jaxscale.train.state")
    assert "jaxscale.hooks.experts" in graph.find_modules_directly_imported_by(
        "jaxscale.models.moe")
    lazy = graph.get_import_details(importer="jaxscale.strategies.remat",
                                    imported="jaxscale.models.llama")
    assert lazy and lazy[0]["line_contents"].startswith("from jaxscale.models.llama import")


def test_one_name_one_module():
    """No two modules share a name at two places (`compression.py` beside
    `strategies/compression.py` was two homes of one feature): only a package's face repeats."""
    names = Counter(p.name for folder in PACKAGES for p in (ROOT / folder).rglob("*.py"))
    assert [n for n, k in names.items() if k > 1] == ["__init__.py"]


@pytest.mark.parametrize("folder", LIBRARY)
def test_no_library_module_is_over_the_line_limit(folder):
    long = {str(p.relative_to(ROOT)): n for p in sorted((ROOT / folder).rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


if __name__ == "__main__":
    sys.exit(0 if lint() else 1)
