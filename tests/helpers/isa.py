"""The instruction sets under test: the kernel paths this CPU can run, the one the dispatcher
should pick by default, and how many threads a call may ask for here."""

from __future__ import annotations

import os

import pytest

import attnx

# Every path a build may offer for use (ATTNX_ISA's names but the test-only amx-emulated and
# avx2vnni-evex).
PATHS = (
    "scalar",
    "avx2",
    "avx2vnni",
    "avx512",
    "avx512vnni",
    "avx512bf16",
    "amx",
    "neon",
    "neon-bf16",
)
# The CPU flags each x86 path needs: avx2 (with FMA and F16C), avx512 (AVX-512F/BW/VL on top of
# those), avx512vnni (VNNI on top of avx512's), and avx512bf16 (AVX512_BF16 on top of those).
AVX2_FLAGS = ("avx2", "fma", "f16c")
AVX512_FLAGS = (*AVX2_FLAGS, "avx512f", "avx512bw", "avx512vl")
AVX512VNNI_FLAGS = (*AVX512_FLAGS, "avx512_vnni")
AVX512BF16_FLAGS = (*AVX512VNNI_FLAGS, "avx512bf16")
# aarch64: neon-bf16 (BFDOT for bf16 prefill, SDOT for integer queries) needs BF16 and DotProd.
NEON_BF16_FLAGS = ("neon", "bf16", "dotprod")


def _has(f, flags):
    return all(f.get(k) for k in flags)


def _forced_isa():
    """``ATTNX_ISA`` as the run sets it ("" where it does not)."""
    return os.environ.get("ATTNX_ISA", "").strip()


def supported_isas():
    """The kernel paths this CPU can run, from its flags (not from the dispatcher's opinion).

    The VNNI-only paths (avx2vnni, avx512vnni: their widening twin but for integer products)
    join only where they are the default (``best_isa``); elsewhere tests/kernels/test_vnni_path.py
    holds them to the twin bit for bit. With ``ATTNX_ISA`` set, only that path (``auto``: the one
    it selected): a run forced to a path tests that path alone.
    """
    forced = _forced_isa()
    if forced:
        return [attnx.cpu_features()["isa"] if forced == "auto" else forced]
    f = attnx.cpu_features()
    isas = ["scalar"]
    if f.get("neon"):  # aarch64: Advanced SIMD, the baseline there
        isas.append("neon")
        if has_neon_bf16(f):
            isas.append("neon-bf16")
    if _has(f, AVX2_FLAGS):
        isas.append("avx2")
        if best_isa() in ("avx2vnni", "avx512vnni"):
            isas.append(best_isa())
        if has_avx512(f):
            isas.append("avx512")
            if has_avx512bf16(f):
                isas.append("avx512bf16")
                if has_amx(f):
                    isas.append("amx")
    return isas


def has_avx512(f=None):
    """Whether the CPU can run the avx512 path (AVX-512F/BW/VL, with AVX2's set)."""
    f = attnx.cpu_features() if f is None else f
    return _has(f, AVX512_FLAGS)


def has_avx512bf16(f=None):
    """Whether the CPU can run the avx512bf16 path (AVX512_BF16, with AVX-512F/BW/VL/VNNI)."""
    f = attnx.cpu_features() if f is None else f
    return _has(f, AVX512BF16_FLAGS)


def has_neon_bf16(f=None):
    """Whether the CPU can run the neon-bf16 path (an aarch64 build on a CPU with BF16 and
    DotProd)."""
    f = attnx.cpu_features() if f is None else f
    return _has(f, NEON_BF16_FLAGS)


def has_bf16_products(f=None):
    """Whether the CPU has a path with bf16 products (avx512bf16, or neon-bf16 on aarch64)."""
    return has_avx512bf16(f) or has_neon_bf16(f)


def has_amx(f=None):
    """Whether the CPU can run the amx path (AMX-BF16 granted by the OS, and AVX512_BF16)."""
    f = attnx.cpu_features() if f is None else f
    return has_avx512bf16(f) and bool(f.get("amx_bf16")) and bool(f.get("amx_permitted"))


# The paths that compute bf16 prefill with bf16 products (and round P to bf16 before P V).
# amx-emulated is amx's tile loop over emulated tiles (int8_tiles-inl.h EmuTiles): not a path
# for use, so not in ISAS, but the bf16 product tests run it wherever AVX512_BF16 is.
BF16_PRODUCT_ISAS = ("avx512bf16", "amx", "amx-emulated", "neon-bf16")
# The paths that compute integer queries' Q K^T with integer dot products (VNNI, AMX-INT8, SDOT):
# where integer queries are the default.
INTEGER_PRODUCT_ISAS = (
    "avx2vnni",
    "avx2vnni-evex",
    "avx512vnni",
    "avx512bf16",
    "amx",
    "amx-emulated",
    "neon-bf16",
)
# The amx path and its tile loops over emulated tiles. Their bf16 items of 2 to 16 query rows
# (decode's GQA groups, short chunks) take AMX tiles (amx_decode-inl.h), rounding P to bf16 as
# their prefill does.
AMX_PATHS = ("amx", "amx-emulated")
# Each one's float32-widening twin: every other call (dtypes, one-row decode; on the other paths
# decode of up to 8 rows) gives its results bit for bit, and so do integer queries, whose integer
# dot products give the FMAs' exact sums. (With avx2vnni and avx512vnni: the paths that have
# integer products only; avx2vnni-evex is avx2vnni's kernels over AVX512-VNNI's form of the
# instruction, for tests on CPUs without AVX-VNNI.)
WIDENING_TWIN = {
    "avx2vnni": "avx2",
    "avx2vnni-evex": "avx2",
    "avx512vnni": "avx512",
    "avx512bf16": "avx512",
    "amx": "avx512",
    "amx-emulated": "avx512",
    "neon-bf16": "neon",
}


def widening_path():
    """The float32-widening path the bf16 product paths of this architecture are twins of."""
    return "neon" if attnx.cpu_features()["neon"] else "avx512"


def bf16_product_skip(name):
    """Why this CPU cannot run the bf16 product path `name` (None where it can)."""
    if name == "neon-bf16":
        return None if has_neon_bf16() else "CPU lacks ARM BF16 and DotProd (or not aarch64)"
    if not has_avx512bf16():
        return "CPU lacks AVX512_BF16"
    if name == "amx" and not has_amx():
        return "CPU lacks AMX-BF16, or the OS did not grant the tile state"
    return None


# dispatch.cpp's kBf16DotGain: the avx512bf16 path is the default only where vdpbf16ps gives
# more multiply-adds per second than float32 FMAs by this factor.
BF16_DOT_GAIN = 1.25


def runs_here(name):
    """Whether this run tests path ``name``: one of ISAS, or another path this CPU can run (the
    test-only amx-emulated and avx2vnni-evex, or a VNNI-only path that is not the default) where
    no ATTNX_ISA narrows the run to one path."""
    if name in ISAS:
        return True
    if _forced_isa():
        return False
    previous = attnx.cpu_features()["isa"]
    try:
        attnx._core.set_isa(name)
    except ValueError:
        return False
    attnx._core.set_isa(previous)
    return True


def best_isa():
    """The fastest path this CPU has, whatever ATTNX_ISA says: AMX where granted, else the bf16
    dot products where they measure faster than float32 FMAs, else the widest vectors (with
    VNNI where the CPU has it)."""
    f = attnx.cpu_features()
    if f.get("neon"):
        return "neon-bf16" if has_neon_bf16(f) else "neon"
    if f["avx2"] and f["fma"] and f["f16c"]:
        if has_amx(f):
            return "amx"
        if has_avx512bf16(f) and attnx._core.bf16_dot_gain() > BF16_DOT_GAIN:
            return "avx512bf16"
        if _has(f, AVX512VNNI_FLAGS):
            return "avx512vnni"
        if has_avx512(f):
            return "avx512"
        return "avx2vnni" if f["avx_vnni"] else "avx2"
    return "scalar"


ISAS = supported_isas()
BF16_ISAS = [i for i in BF16_PRODUCT_ISAS if runs_here(i)]


def assert_set_isa_refused(name, match):
    """``set_isa(name)`` raises ValueError (its message matching ``match``) and leaves the path
    as it was."""
    before = attnx.cpu_features()["isa"]
    with pytest.raises(ValueError, match=match):
        attnx._core.set_isa(name)
    assert attnx.cpu_features()["isa"] == before


def cpus_here():
    """The CPUs this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def threads_here(n):
    """``n`` threads, or attnx's cap where this process may run on too few CPUs for them (4 per
    CPU: a test that asks for 5 or 6 threads would get a warning on one CPU instead of a team)."""
    return min(n, attnx._core._max_threads())
