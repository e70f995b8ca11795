"""pytgi's import graph read from its source (module level and inside functions alike), for the
layering tests (tests/unit/test_layers.py)."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def modules(root: Path = ROOT) -> dict[str, Path]:
    out = {}
    for p in sorted((root / "pytgi").rglob("*.py")):
        name = ".".join(p.relative_to(root).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = p
    return out


def graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module → the pytgi modules it imports (a `from package import name` of a submodule counts as
    that submodule; of anything else, as the package), with the packages above each."""
    mods = modules(root)
    edges: dict[str, set[str]] = defaultdict(set)
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*parts, base] if base else parts)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for t in targets:
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                # importing a.b.c runs a/__init__ and a/b/__init__ first: those count too, but for
                # the importer's own ancestors (already being initialised when it runs)
                while t.startswith("pytgi") and t != name and not name.startswith(t + "."):
                    if t in mods:
                        edges[name].add(t)
                    t = t.rpartition(".")[0]
    return {m: edges.get(m, set()) for m in mods}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in g:
        if v not in index:
            visit(v)
    return out
