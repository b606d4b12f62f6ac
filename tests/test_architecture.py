"""The stages import only downwards: a package imports the ones before it in LAYERS (or itself),
never one after it, and no two modules import each other (directly or round a longer loop).
Imports inside functions count too: a lazy import is still an arrow."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "logprob_parity"
# From the most basic up; docs/architecture.md lists the same order. The package's own __init__ (the
# Python API) and __main__ sit on top of everything.
LAYERS = (
    ("errors", "paths", "env"),
    ("inputs",),
    ("engines",),
    ("results",),
    ("analysis",),
    ("present",),
    ("cli", "dashboard"),
    ("__init__", "__main__"),
)
RANK = {name: i for i, names in enumerate(LAYERS) for name in names}


def _imports() -> dict[str, set[str]]:
    """module (logprob_parity.x.y) -> the package's modules it imports, anywhere in its body. A name
    imported from a package counts when it is a module (`from logprob_parity.engines import fullvocab`);
    `from logprob_parity import __version__` is no arrow to the API."""
    out: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        mod = ".".join(("logprob_parity", *path.relative_to(PACKAGE).with_suffix("").parts)).removesuffix(".__init__")
        found = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "logprob_parity":
                if node.module != "logprob_parity":
                    found.add(node.module)
                found.update(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.startswith("logprob_parity."))
        out[mod] = found
    modules = set(out)
    return {m: {x for x in deps if x in modules and x != m} for m, deps in out.items()}


def _stage(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_import_points_down_the_stages():
    wrong = [f"{m} imports {d}" for m, deps in _imports().items() for d in sorted(deps) if RANK[_stage(d)] > RANK[_stage(m)]]
    assert not wrong, "\n".join(wrong)


def test_no_two_modules_import_each_other():
    graph = _imports()
    seen: dict[str, int] = {}  # 1: on the path, 2: done
    loops: list[str] = []

    def visit(m: str, path: list[str]) -> None:
        seen[m] = 1
        for d in sorted(graph[m]):
            if seen.get(d) == 1:
                loops.append(" -> ".join(path[path.index(d) :] + [d]))
            elif d not in seen:
                visit(d, path + [d])
        seen[m] = 2

    for m in sorted(graph):
        if m not in seen:
            visit(m, [m])
    assert not loops, "\n".join(loops)
