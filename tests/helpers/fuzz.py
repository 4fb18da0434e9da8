"""The atheris harness, fuzz/fuzz_entrypoints.py, loaded as a module: its one-input function for
the harness's own tests, and the integer forms it draws, which the hypothesis fuzz draws too."""

from __future__ import annotations

import functools
import importlib.util
import pathlib

HARNESS = pathlib.Path(__file__).resolve().parents[2] / "fuzz" / "fuzz_entrypoints.py"


@functools.cache
def fuzz_harness():
    """fuzz/fuzz_entrypoints.py as a module, loaded once."""
    spec = importlib.util.spec_from_file_location("fuzz_entrypoints", HARNESS)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
