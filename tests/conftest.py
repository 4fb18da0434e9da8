"""Fixtures and hooks of the test suite: the ``isa``, ``bf16_isa``, ``amx_isa`` and ``rng`` fixtures, hypothesis profiles and
the report header. The library the tests share (checks, tolerances, data) is tests/helpers/.

Environment:
  ATTNX_TEST_SEED           seed of every random test (default 0); printed in the header
  ATTNX_ISA                 scalar | avx2 | avx2vnni | avx512 | avx512vnni | avx512bf16 | amx | neon |
                            neon-bf16 | auto: run the kernel tests on that path only
  ATTNX_HYPOTHESIS_PROFILE  "ci" (default) or "soak" (many more examples)
"""

from __future__ import annotations

import os
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

import attnx

from helpers import AMX_PATHS, BF16_PRODUCT_ISAS, ISAS, SEED, bf16_product_skip, runs_here

settings.register_profile(
    "ci",
    deadline=None,
    max_examples=40,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
settings.register_profile(
    "soak",
    deadline=None,
    max_examples=2000,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
HYPOTHESIS_PROFILE = os.environ.get("ATTNX_HYPOTHESIS_PROFILE", "ci")
settings.load_profile(HYPOTHESIS_PROFILE)


def _on_path(name):
    """Makes kernel path ``name`` the active one for a test, restoring the previous after."""
    previous = attnx.cpu_features()["isa"]
    attnx._core.set_isa(name)
    assert attnx.cpu_features()["isa"] == name
    try:
        yield name
    finally:
        attnx._core.set_isa(previous)


@pytest.fixture(params=ISAS, ids=ISAS)
def isa(request):
    """Runs the test on one kernel path, restoring the active one afterwards."""
    yield from _on_path(request.param)


@pytest.fixture(params=BF16_PRODUCT_ISAS)
def bf16_isa(request):
    """Runs the test on each path with bf16 products (avx512bf16's and neon-bf16's dot
    products, amx's tiles; skips those the CPU lacks), restoring the active path afterwards."""
    reason = bf16_product_skip(request.param)
    if reason:
        pytest.skip(reason)
    yield from _on_path(request.param)


@pytest.fixture(params=AMX_PATHS)
def amx_isa(request):
    """Runs the test on the amx path and on its tile loops over emulated tiles (amx-emulated: any
    CPU with AVX512_BF16), skipping those this run does not test (helpers.runs_here)."""
    reason = bf16_product_skip(request.param)
    if reason or not runs_here(request.param):
        pytest.skip(reason or f"this run does not test {request.param}")
    yield from _on_path(request.param)


@pytest.fixture
def rng(request):
    """A generator seeded by ATTNX_TEST_SEED and the test's id: reproducible, and different
    tests (and parameters) draw different data. The id names the file without its folder
    (``tests/test_x.py::test_y[param]``): a test keeps its data when its file moves."""
    test = request.node.nodeid.split("::", 1)[1]
    name = f"tests/{request.node.path.name}::{test}"
    return np.random.default_rng([SEED, zlib.crc32(name.encode())])


def pytest_report_header(config):
    return [
        f"attnx: ATTNX_TEST_SEED={SEED}, ISAs under test={ISAS} "
        f"(active {attnx.cpu_features()['isa']}), threads={attnx.get_num_threads()}, "
        f"hypothesis profile={HYPOTHESIS_PROFILE}"
    ]
