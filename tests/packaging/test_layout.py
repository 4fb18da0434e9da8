"""The package's layering rules, read from the source (issue 32): no import cycles between attnx's
modules at import time, production code computing nothing with the float64 reference, and no
module importing another module's underscore names."""

from __future__ import annotations

import ast
import pathlib

import pytest

PKG = pathlib.Path(__file__).resolve().parents[2] / "python" / "attnx"
pytestmark = pytest.mark.skipif(not PKG.is_dir(), reason="reads the source tree (python/attnx)")

# Modules that may import the reference at module level: the package's namespace (attnx.reference
# is public), the smoke test, the bench (its NumPy peer is the reference) and the reference itself.
# (sdpa's infinite scale imports it inside that branch: docs/architecture.md.)
MAY_IMPORT_REFERENCE = ("attnx", "attnx.__main__", "attnx.bench", "attnx.reference")


def _may_import_reference(name):
    return (
        any(name == m or name.startswith(m + ".") for m in MAY_IMPORT_REFERENCE[1:])
        or name == "attnx"
    )


def _modules():
    """{dotted name: parsed module} of every .py file of the package."""
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        parts = path.relative_to(PKG.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = (path, ast.parse(path.read_text(), str(path)))
    return out


def _package(name, path):
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _imports(name, path, tree, *, top_level):
    """(imported module, imported names) for each import of ``tree`` (at module level only with
    ``top_level``), relative imports resolved."""
    nodes = tree.body if top_level else list(ast.walk(tree))
    for node in nodes:
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, []
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = _package(name, path).split(".")
                pkg = pkg[: len(pkg) - node.level + 1]
                base = ".".join(pkg + ([base] if base else []))
            names = [a.name for a in node.names]
            yield base, names
            for n in names:  # `from . import x` imports the module x
                yield f"{base}.{n}", []


def _graph(mods):
    """{module: the attnx modules its import runs first}: ``from pkg import sub`` needs ``sub``,
    ``from pkg import name`` needs ``pkg``'s own body (a parent package's body runs before any
    of its submodules, so that edge is left out)."""
    graph = {}
    for name, (path, tree) in mods.items():
        deps = set()
        for target, names in _imports(name, path, tree, top_level=True):
            if names and all(f"{target}.{n}" in mods for n in names):
                continue  # the submodules themselves are yielded on their own
            while target and target not in mods:
                target = target.rpartition(".")[0]
            if target.startswith("attnx") and target != name and not name.startswith(target + "."):
                deps.add(target)
        graph[name] = deps
    return graph


def test_no_import_cycles():
    graph = _graph(_modules())
    state = {}

    def visit(node, stack):
        state[node] = "open"
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                pytest.fail("import cycle: " + " -> ".join([*stack[stack.index(dep) :], dep]))
            if dep not in state:
                visit(dep, [*stack, dep])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])


def test_production_code_computes_nothing_with_the_reference():
    offenders = []
    for name, (path, tree) in _modules().items():
        if _may_import_reference(name):
            continue
        for target, _ in _imports(name, path, tree, top_level=True):
            if target == "attnx.reference" or target.startswith("attnx.reference."):
                offenders.append(f"{name} imports {target}")
    assert not offenders, offenders


def test_no_module_imports_another_modules_underscore_names():
    offenders = []
    for name, (path, tree) in _modules().items():
        for target, names in _imports(name, path, tree, top_level=False):
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            # _core is the compiled module's name, imported whole
            private = [n for n in private if n != "_core" and f"{target}.{n}" not in _modules()]
            if private and target.startswith("attnx"):
                offenders.append(f"{name}: from {target} import {', '.join(private)}")
    assert not offenders, offenders


CPP = PKG.parents[1] / "cpp"


@pytest.mark.skipif(not CPP.is_dir(), reason="reads the source tree (cpp/)")
def test_the_core_formats_no_numbers_through_iostreams():
    # Built on an Ubuntu 24.04 image (gcc 13, libstdc++ linked statically there), `ostream << x`
    # in an error message segfaulted instead of raising (bench/NOTES.md, "A crash on an Ubuntu
    # 24.04 image"); std::to_string and snprintf need no locale object.
    streams = ("<sstream>", "<iostream>", "<ostream>", "<iomanip>", "<fstream>", "stringstream")
    offenders = [
        f"{p.relative_to(CPP)}: {s}"
        for p in sorted(CPP.rglob("*"))
        if p.suffix in (".h", ".cpp", ".hpp")
        for s in streams
        if s in p.read_text()
    ]
    assert not offenders, offenders
