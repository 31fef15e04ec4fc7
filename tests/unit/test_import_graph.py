"""The runtime's module graph: one package per role, shared modules below them, no import cycles.

Built from the source with ``ast`` (every import statement, including ones inside functions and
``TYPE_CHECKING`` blocks), so a lazy import cannot hide a cycle.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "runtime" / "persia"

# PERSIA's public import paths, kept as thin re-exports of the role packages.
FACADES = {
    "persia.ctx",
    "persia.data",
    "persia.distributed",
    "persia.embedding",
    "persia.embedding.data",
    "persia.embedding.optim",
}
ROLES = ("persia.data_loader", "persia.nn_worker", "persia.embedding_worker", "persia.embedding_ps")
# Shared modules every role builds on: they must not reach up into a role.
BASE = ("persia.bus", "persia.rpc", "persia.wire", "persia.hashing", "persia.errors", "persia.config",
        "persia.metrics", "persia.env", "persia.utils", "persia.logger", "persia.context")


def module_name(path: Path) -> str:
    parts = ("persia",) + path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in ROOT.rglob("*.py")}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The persia modules ``name`` imports (``from pkg import sub`` counts as importing ``pkg.sub``)."""
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_pkg else 0)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:  # `import persia.x.y` of a non-module attribute: its module
                t = t.rpartition(".")[0]
            if t and t.startswith("persia") and t != name:
                out.add(t)
    return out


def extension_modules() -> set[str]:
    """C extensions (``_kernels.c``): leaves of the graph, built or not."""
    return {module_name(p.with_name(p.name.split(".")[0] + ".py")) for p in ROOT.rglob("*.c")}


@functools.lru_cache(maxsize=1)
def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods) | extension_modules()
    return {name: imports_of(name, path, known) for name, path in mods.items()}


def find_cycle(g: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a path ``[a, b, ..., a]``, or None when the graph is acyclic."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(g.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(g):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def _under(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_cycle_finder_finds_a_cycle_and_accepts_a_dag():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_graph_sees_lazy_imports():
    g = graph()
    # persia.nn_worker.optim imports the embedding context inside a method
    assert "persia.nn_worker.embedding_ctx" in g["persia.nn_worker.optim"]
    assert "persia.nn_worker.embedding_ctx" in g["persia.ctx"]


def test_runtime_has_no_import_cycle():
    cycle = find_cycle(graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_role_and_shared_code_never_import_the_public_facades():
    bad = {(n, t) for n, ts in graph().items() if n not in FACADES for t in ts if t in FACADES}
    assert not bad, f"import the role package instead of PERSIA's re-export module: {sorted(bad)}"


def test_shared_modules_do_not_import_role_packages():
    bad = {(n, t) for n, ts in graph().items() if _under(n, BASE) for t in ts if _under(t, ROLES)}
    assert not bad, f"shared modules reaching into a role: {sorted(bad)}"


def test_every_role_has_its_package():
    mods = modules()
    for role in ROLES:
        assert role in mods, f"{role} is not a package"
