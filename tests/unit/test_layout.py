"""The package's shape rules: no import circles between sibling modules, and no file over 450
lines without a stated reason at its top (its module docstring says why, naming "450 lines")."""

from __future__ import annotations

import ast
import os

PKG = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                   "megatron_rl")


def _modules() -> dict[str, str]:
    out = {}
    for root, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(root, f)
                rel = os.path.relpath(path, os.path.dirname(PKG))[:-3].replace(os.sep, ".")
                out[rel.removesuffix(".__init__")] = path
    return out


def _imports(path: str, mods: dict[str, str]) -> set[str]:
    """megatron_rl modules a file imports, anywhere in it (lazy imports included)."""
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        found.update(n for n in names if n in mods)
    return found


def test_no_module_imports_a_module_that_imports_it_back():
    mods = _modules()
    graph = {m: _imports(p, mods) - {m} for m, p in mods.items()}
    circles = sorted({tuple(sorted((a, b))) for a, deps in graph.items() for b in deps
                      if a in graph.get(b, set())
                      and not (b.startswith(a + ".") or a.startswith(b + "."))})
    assert not circles, f"import circles: {circles}"


def test_long_files_state_their_reason():
    long = []
    for mod, path in _modules().items():
        n = sum(1 for _ in open(path))
        doc = ast.get_docstring(ast.parse(open(path).read())) or ""
        if n > 450 and "450 lines" not in doc:
            long.append(f"{mod} ({n} lines)")
    assert not long, f"files over 450 lines without a stated reason at the top: {long}"
