"""The house's floors, read from the imports (ast, no import executed): an import points down, never up, never
sideways into a circle. `core/` is the ground floor; see DESIGN.md "Repository layout".

A wrong-way import or an import circle (module-level or function-local: a local import is still a dependency)
fails here with the file and line, so the tree cannot re-tangle one commit at a time."""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "specbuild"
SOURCE_DIRS = ("core", "engines", "loadtests", "pipeline", "cli", "model_repository")

# floor -> the floors it may import (besides itself and the root package, which holds only the version and
# torch's OpenMP wait policy, set before torch loads)
ALLOWED = {
    "core": set(),
    "engines.embedded": {"core"},
    # the TensorRT-LLM stand-ins run the embedded decoder in place of the C++ engine (rehearsals only)
    "engines.trtllm": {"core", "engines.embedded"},
    "loadtests": {"core"},
    # the Python-backend models Triton runs: the engine's client side, the rehearsal stand-ins
    "model_repository": {"core", "engines.embedded", "engines.trtllm"},
    "pipeline": {"core", "engines.embedded", "engines.trtllm", "loadtests", "model_repository"},
    "cli": {"core", "engines.embedded", "engines.trtllm", "loadtests", "model_repository", "pipeline"},
}
TORCH_FREE = ("core", "loadtests")


def module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = [PACKAGE, *rel.parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def floor(module: str) -> str:
    parts = module.split(".")
    if len(parts) < 2:
        return "root"
    if parts[1] == "engines":
        return f"engines.{parts[2]}" if len(parts) > 2 else "engines"
    return parts[1]


def imports(path: Path, root: Path) -> list[tuple[str, int, bool]]:
    """(imported module, line, at module level) for every import of `path`, relative ones resolved."""
    me = module_name(path, root)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    tree = ast.parse(path.read_text(), filename=str(path))
    top = {id(n) for n in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno, id(node) in top) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            # `from pkg import name` may import the submodule pkg.name
            found += [(mod, node.lineno, id(node) in top)]
            found += [(f"{mod}.{a.name}", node.lineno, id(node) in top) for a in node.names]
    return found


def graph(root: Path) -> tuple[dict[str, list[tuple[str, int]]], dict[str, Path]]:
    files = {}
    for d in SOURCE_DIRS:
        for p in sorted((root / d).rglob("*.py")):
            files[module_name(p, root)] = p
    edges: dict[str, list[tuple[str, int]]] = {}
    for mod, p in files.items():
        out = []
        for target, line, _ in imports(p, root):
            if target == PACKAGE or not target.startswith(PACKAGE + "."):
                continue
            while target not in files and "." in target:   # `from a.b import name`: the module a.b
                target = target.rpartition(".")[0]
            if target in files and target != mod:
                out.append((target, line))
        edges[mod] = out
    return edges, files


def wrong_way(root: Path) -> list[str]:
    edges, files = graph(root)
    bad = []
    for mod, out in edges.items():
        f = floor(mod)
        for target, line in out:
            g = floor(target)
            if g != f and g != "root" and g not in ALLOWED.get(f, set()):
                bad.append(f"{files[mod].relative_to(root)}:{line}: {f} imports {target} ({g})")
    return bad


def circles(root: Path) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan), each an import circle."""
    edges, _ = graph(root)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w, _ in edges.get(v, []):
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
                found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_every_import_points_down():
    assert wrong_way(ROOT) == []


def test_no_import_circle():
    assert circles(ROOT) == []


@pytest.mark.parametrize("floor_name", TORCH_FREE)
def test_torch_free_floors_import_no_torch_at_module_level(floor_name):
    bad = []
    for p in sorted((ROOT / floor_name).rglob("*.py")):
        for target, line, top in imports(p, ROOT):
            if top and target.split(".")[0] == "torch":
                bad.append(f"{p.relative_to(ROOT)}:{line}")
    assert bad == []


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for d in SOURCE_DIRS:
        (tmp_path / d).mkdir(parents=True, exist_ok=True)
    for rel, text in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text))
    return tmp_path


def test_the_check_catches_a_wrong_way_import(tmp_path):
    root = _tree(tmp_path, {"core/__init__.py": "", "core/errors.py": "from specbuild.pipeline import serve\n",
                            "pipeline/__init__.py": "", "pipeline/serve.py": "",
                            "loadtests/__init__.py": "", "loadtests/x.py": "def f():\n    from specbuild.pipeline import serve\n"})
    bad = wrong_way(root)
    assert any(b.startswith("core/errors.py:1: core imports specbuild.pipeline") for b in bad), bad
    assert any(b.startswith("loadtests/x.py:2: loadtests imports specbuild.pipeline") for b in bad), bad


def test_the_check_catches_a_circle(tmp_path):
    root = _tree(tmp_path, {"engines/__init__.py": "", "engines/embedded/__init__.py": "",
                            "engines/embedded/a.py": "from specbuild.engines.embedded import b\n",
                            "engines/embedded/b.py": "def f():\n    from .a import x\n"})
    assert circles(root) == [["specbuild.engines.embedded.a", "specbuild.engines.embedded.b"]]
