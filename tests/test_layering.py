"""The import graph of gendist and pallas_kernels, read from the source (function-local
imports included): acyclic, and layered as README's layout says."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("gendist", "pallas_kernels")


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> the modules of ours it imports anywhere in its source."""
    mods = modules()

    def resolve(cur: str, node) -> list[str]:
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            base = node.module or ""
            if node.level:
                parts = cur.split(".")
                parts = parts if mods[cur].name == "__init__.py" else parts[:-1]
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names] + [base]
        found = []
        for n in names:
            while n and n not in mods:
                n = n.rpartition(".")[0]
            if n and n != cur and not cur.startswith(n + "."):  # not its own package
                found.append(n)
        return found

    graph = {m: set() for m in mods}
    for m, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import | ast.ImportFrom):
                graph[m].update(resolve(m, node))
    return graph


def find_cycle(graph) -> list[str] | None:
    state: dict[str, int] = {}  # 1 = on the path, 2 = done
    path: list[str] = []

    def visit(v):
        state[v] = 1
        path.append(v)
        for w in sorted(graph[v]):
            if state.get(w) == 1:
                return path[path.index(w):] + [w]
            if w not in state and (c := visit(w)):
                return c
        state[v] = 2
        path.pop()
        return None

    for v in sorted(graph):
        if v not in state and (c := visit(v)):
            return c
    return None


def test_the_import_graph_is_read_and_nonempty():
    graph = import_graph()
    assert "gendist.training.train" in graph and "gendist.models.transformer" in graph["gendist.training.train"]
    assert "gendist.parallel.pipeline.core" in graph["gendist.parallel.pipeline.sync"]
    assert find_cycle({"a": {"b"}, "b": {"a"}}) is not None  # the cycle finder finds one


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, " -> ".join(cycle)


def _imports_under(graph, src: str, banned: tuple[str, ...]) -> list[tuple[str, str]]:
    return sorted((m, t) for m, ts in graph.items() if m == src or m.startswith(src + ".")
                  for t in ts if any(t == b or t.startswith(b + ".") for b in banned))


def test_layers():
    graph = import_graph()
    # Kernels are a leaf library: they know nothing of gendist.
    assert _imports_under(graph, "pallas_kernels", ("gendist",)) == []
    # The model knows no parallel engine, training loop or decoding machinery.
    assert _imports_under(graph, "gendist.models", (
        "gendist.parallel", "gendist.training.train", "gendist.training.loop", "gendist.inference",
        "gendist.accounting", "gendist.cli")) == []
    # Configs are plain data.
    assert graph["gendist.config"] == set()
    assert graph["gendist.presets"] == {"gendist.config"}
    # The parallel layer builds on the model, not on training or decoding.
    assert _imports_under(graph, "gendist.parallel", (
        "gendist.training.train", "gendist.training.loop", "gendist.inference", "gendist.cli")) == []
    assert _imports_under(graph, "gendist.inference", (
        "gendist.parallel", "gendist.training.train", "gendist.training.loop")) == []
    # Data knows nothing of models, training, decoding or the command line.
    assert _imports_under(graph, "gendist.data", (
        "gendist.models", "gendist.parallel", "gendist.training", "gendist.inference",
        "gendist.output", "gendist.cli")) == []
    # Training and run output do not decode; only the command line's entry imports it.
    assert _imports_under(graph, "gendist.training", ("gendist.inference", "gendist.cli")) == []
    assert _imports_under(graph, "gendist.output", (
        "gendist.training.loop", "gendist.inference", "gendist.cli")) == []
    assert sorted(m for m, ts in graph.items() if not m.startswith("gendist.cli")
                  and any(t.startswith("gendist.cli") for t in ts)) == ["gendist.__main__"]
