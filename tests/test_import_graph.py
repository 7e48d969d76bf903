"""No import circles inside lockstep: every ``import`` statement of every module (at module level, inside a function,
under ``if TYPE_CHECKING``) is an edge, and the graph must have no cycle. A lazy import that closes a circle still
ties two modules into one (``config.py`` and ``engine/model_runner.py`` were, over ``resolve_device``), so this
is stricter than what Python itself would fail on. Parsed with ``ast``: nothing is imported, it takes ~1 s.

A negative control runs the same check over a small package with a circle closed by a lazy import."""

import ast
from pathlib import Path

import lockstep

PACKAGE = Path(lockstep.__file__).parent


def module_names(root: Path) -> dict[str, Path]:
    """``{dotted name: file}`` for every module of the package at ``root`` (a package is its ``__init__``)."""
    names = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` imports anywhere in its file. ``from a import b`` imports the module
    ``a.b`` when there is one, else ``a``."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, one level up per extra dot
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            for a in node.names:
                if f"{base}.{a.name}" in modules:
                    out.add(f"{base}.{a.name}")
                elif base in modules:
                    out.add(base)
    out.discard(name)
    return out


def find_cycle(root: Path) -> list[str] | None:
    """One import cycle of the package at ``root`` as ``[a, b, ..., a]``, or None when there is none."""
    modules = module_names(root)
    graph = {name: sorted(imports_of(name, path, modules)) for name, path in sorted(modules.items())}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in graph[node]:
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in graph:
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_lockstep_has_no_import_cycle():
    cycle = find_cycle(PACKAGE)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_check_sees_a_cycle_closed_by_a_lazy_import(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from pkg.sub.low import X\n")
    (pkg / "sub" / "low.py").write_text("X = 1\n")
    (pkg / "config.py").write_text("def device():\n    from pkg.runner import resolve\n    return resolve()\n")
    (pkg / "runner.py").write_text("from . import config\nfrom .sub import low\n\n\ndef resolve():\n    return 0\n")
    assert find_cycle(pkg) == ["pkg.config", "pkg.runner", "pkg.config"]
    (pkg / "config.py").write_text("from pkg.sub import low\n")  # the lazy import gone: no cycle
    assert find_cycle(pkg) is None
