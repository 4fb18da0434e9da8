"""The installed package as a user gets it: one version, and types that match the binary.

``attnx.__version__`` is read back from the installed metadata (pyproject.toml's ``version`` is
the one place it is written). ``_core.pyi`` is written by hand from ``cpp/bind/``: these
tests hold it to the compiled module's own signatures, so a binding that gains, loses or renames
an argument fails here until the stub follows.
"""

from __future__ import annotations

import ast
import importlib.metadata
import inspect
import pathlib
import re
import subprocess
import sys

import pytest

import attnx
from attnx import _core

PACKAGE = pathlib.Path(attnx.__file__).resolve().parent
STUB = PACKAGE / "_core.pyi"


def test_version_is_the_installed_metadata():
    assert attnx.__version__ == importlib.metadata.version("attnx")
    assert re.fullmatch(r"\d+\.\d+\.\d+([.-]?\w+)*", attnx.__version__), attnx.__version__


def test_version_is_read_lazily():
    # importlib.metadata is only imported when someone asks for the version
    code = (
        "import sys, attnx; assert 'importlib.metadata' not in sys.modules, 'eager'; "
        "v = attnx.__version__; assert 'importlib.metadata' in sys.modules; print(v)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == attnx.__version__


def test_unknown_attribute_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'no_such_thing'"):
        attnx.no_such_thing  # noqa: B018
    assert not hasattr(attnx, "no_such_thing")


def test_typed_markers_are_installed():
    assert (PACKAGE / "py.typed").is_file()
    assert STUB.is_file()


def _stub_functions():
    """{name: [parameter names]} of the stub's functions (one entry per name: overloads agree)."""
    found: dict[str, list[list[str]]] = {}
    for node in ast.parse(STUB.read_text()).body:
        if isinstance(node, ast.FunctionDef):
            a = node.args
            found.setdefault(node.name, []).append(
                [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs]
            )
    for name, signatures in found.items():
        assert all(s == signatures[0] for s in signatures), f"{name}: overloads disagree"
    return {name: signatures[0] for name, signatures in found.items()}


def _binding_parameters(fn):
    """Parameter names from a pybind11 function's docstring signature ``name(a: T, b: U = x) -> R``."""
    first = fn.__doc__.splitlines()[0]
    inside = first[first.index("(") + 1 : first.rindex(")")]  # (the entry points give no "-> R")
    depth, names, current = 0, [], ""
    for ch in inside + ",":
        if ch in "[(":
            depth += 1
        elif ch in "])":
            depth -= 1
        if ch == "," and depth == 0:
            names.append(current.split(":")[0].split("=")[0].strip())
            current = ""
        else:
            current += ch
    return [n for n in names if n]


def test_stub_lists_every_binding_with_its_keyword_names():
    stub = _stub_functions()
    compiled = {
        name
        for name, obj in vars(_core).items()
        if callable(obj) and not name.startswith("__") and not inspect.isclass(obj)
    }
    assert set(stub) == compiled, "attnx/_core.pyi and cpp/bind/ list different functions"
    for name in sorted(compiled):
        assert stub[name] == _binding_parameters(getattr(_core, name)), name


def test_stub_lists_the_module_attributes():
    tree = ast.parse(STUB.read_text())
    variables = {
        n.target.id
        for n in tree.body
        if isinstance(n, ast.AnnAssign)
        and isinstance(n.target, ast.Name)
        and not n.target.id.startswith("_")
    }
    classes = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
    constants = {
        name
        for name, obj in vars(_core).items()
        if not callable(obj) and not name.startswith("_") and not inspect.ismodule(obj)
    }
    assert variables == constants == {"BF16_DOT_GAIN_LINE"}
    compiled = {
        name
        for name, obj in vars(_core).items()
        if inspect.isclass(obj) and not name.startswith("_")
    }
    assert classes == compiled == {"InvalidArgument", "StepPlan"}
    assert issubclass(_core.InvalidArgument, ValueError)


def test_a_process_that_called_the_bindings_exits_cleanly():
    # The binding's argument names are interned once and kept by global objects. Released by
    # their destructors at exit, after the interpreter has finalised, they crashed Python 3.13
    # (SIGSEGV in the object allocator) in any process that had called paged_attention: this
    # reproduces that on such an interpreter (on 3.11 the release happened to be harmless).
    code = """if True:
        import numpy as np, attnx
        q = np.ones((1, 2, 8), np.float32)
        pages = np.ones((4, 2, 4, 8), np.float32)
        attnx.paged_attention(q, pages, pages, np.array([[0, 1]], np.int32), np.array([8], np.int32),
                              causal=True, scale=0.5, return_lse=True)
        attnx.attention(q, q, q, causal=True, scale=0.5, return_lse=True)
        print("called")
    """
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert (res.returncode, res.stdout.strip()) == (0, "called"), res.stderr
