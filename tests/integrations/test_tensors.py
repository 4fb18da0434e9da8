"""Tensors in, the same kind out (issue 17, items 1 and 3): torch tensors and __dlpack__ objects at
every entry point, zero-copy, and the torch.library ops that let torch.compile trace attnx."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import attnx

torch = pytest.importorskip("torch", reason="torch is not installed (pip install '.[torch]')")

from helpers import SEED  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _rand(*shape, dtype=torch.float32, seed=SEED):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def _np_view(t):
    return attnx.integrations.tensors.to_numpy(t, "t")


def test_import_attnx_imports_no_framework():
    code = (
        "import sys, attnx; bad = [m for m in ('torch', 'transformers', 'onnxruntime') if m in sys.modules];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_ops_register_on_first_tensor_not_on_import():
    code = (
        "import sys, attnx, torch\n"
        "assert 'attnx.integrations.torch_ops' not in sys.modules\n"
        "assert not hasattr(torch.ops.attnx, 'attention') if hasattr(torch.ops, 'attnx') else True\n"
        "x = torch.ones(2, 4)\n"
        "attnx.attention(x, x, x)\n"
        "assert 'attnx.integrations.torch_ops' in sys.modules\n"
        "torch.ops.attnx.attention.default, torch.ops.attnx.paged_attention.default\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_cache_step_on_tensors_registers_too():
    """attnx.hf reaches the cache's NumPy core through to_numpy, not a wrapped entry point: the
    first tensor seen there registers the ops and joins torch's thread team all the same."""
    code = (
        "import sys, attnx, torch, numpy as np\n"
        "cache = attnx.PagedKVCache(num_layers=1, num_kv_heads=1, head_dim=4, num_blocks=2, block_size=4)\n"
        "step = cache.begin_step([cache.new_sequence()], [1])\n"
        "x = torch.ones(1, 1, 1, 4)\n"
        "q, k = (attnx.integrations.tensors.to_numpy(t, n) for t, n in ((x, 'q'), (x, 'k')))\n"
        "step.attend_arrays(0, q, k, k)\n"
        "assert 'attnx.integrations.torch_ops' in sys.modules\n"
        "torch.ops.attnx.attention.default\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_views_are_zero_copy(dtype):
    base = _rand(2, 5, 4, 16, dtype=dtype)
    view = base.transpose(1, 2)  # last axis contiguous, others strided: still no copy
    a = _np_view(view)
    assert a.ctypes.data == view.data_ptr()
    assert a.shape == tuple(view.shape)
    assert a.strides == tuple(s * view.element_size() for s in view.stride())
    back = attnx.integrations.tensors.like(a, view)
    assert back.dtype == dtype and back.data_ptr() == view.data_ptr()


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_tensors_match_numpy(dtype):
    q, k, v = (
        _rand(2, 4, 7, 16, dtype=dtype),
        _rand(2, 2, 9, 16, dtype=dtype, seed=SEED + 1),
        _rand(2, 2, 9, 8, dtype=dtype, seed=SEED + 2),
    )
    out, lse = attnx.attention(q, k, v, causal=True, return_lse=True)
    ref, ref_lse = attnx.attention(
        _np_view(q), _np_view(k), _np_view(v), causal=True, return_lse=True
    )
    assert isinstance(out, torch.Tensor) and out.dtype == dtype and out.shape == (2, 4, 7, 8)
    assert isinstance(lse, torch.Tensor) and lse.dtype == torch.float32
    np.testing.assert_array_equal(_np_view(out), ref)
    np.testing.assert_array_equal(lse.numpy(), ref_lse)


@pytest.mark.parametrize("dtype", DTYPES)
def test_out_tensor_written_in_place(dtype):
    q = _rand(1, 6, 2, 16, dtype=dtype)  # bshd
    out = torch.full((1, 6, 2, 16), float("nan"), dtype=dtype)
    ptr = out.data_ptr()
    res = attnx.attention(q, q, q, layout="bshd", out=out)
    assert res is out and out.data_ptr() == ptr
    expect = attnx.attention(_np_view(q), _np_view(q), _np_view(q), layout="bshd")
    np.testing.assert_array_equal(_np_view(out), expect)


def test_numpy_in_numpy_out():
    q = np.ones((3, 4), np.float32)
    assert type(attnx.attention(q, q, q)) is np.ndarray


@pytest.mark.parametrize("dtype", DTYPES)
def test_requires_grad_is_refused_with_advice(dtype):
    x = _rand(2, 3, 8, dtype=dtype).requires_grad_()
    with pytest.raises(ValueError, match="no gradients.*scaled_dot_product_attention"):
        attnx.attention(x, x, x)
    with torch.no_grad():
        assert isinstance(attnx.attention(x, x, x), torch.Tensor)
    with torch.inference_mode():
        assert isinstance(attnx.attention(x, x, x), torch.Tensor)


@pytest.mark.parametrize("dtype", DTYPES)
def test_other_device_is_refused_with_advice(dtype):
    x = torch.empty(2, 3, 8, device="meta", dtype=dtype)
    with pytest.raises(ValueError, match=r"q: attnx runs on the CPU.*\.cpu\(\)"):
        attnx.attention(x, x, x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_negative_view_is_read_as_its_values(dtype):
    # torch._neg_view sets the neg bit: numpy() and a view as int16 refuse it; attnx resolves it
    x = _rand(2, 3, 8, dtype=dtype)
    neg = torch._neg_view(x)
    assert neg.is_neg()
    got = attnx.attention(neg, x, x)
    want = attnx.attention(-x, x, x)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_every_entry_point_returns_tensors():
    x = _rand(2, 5, 32)
    mha = attnx.MultiHeadAttention(32, 4)
    o, w = mha(x, causal=True, return_weights=True)
    assert isinstance(o, torch.Tensor) and isinstance(w, torch.Tensor)
    np.testing.assert_array_equal(o.numpy(), mha(x.numpy(), causal=True))
    q = _rand(2, 4, 6, 8)
    o = attnx.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert isinstance(o, torch.Tensor)
    np.testing.assert_allclose(
        o.numpy(),
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True),
        atol=1e-6,
    )
    cache = attnx.PagedKVCache(
        num_layers=1, num_kv_heads=2, head_dim=8, num_blocks=8, block_size=4, dtype="bfloat16"
    )
    seq = cache.new_sequence()
    step = cache.begin_step([seq], [5])
    o = step.attend(0, _rand(5, 4, 8, dtype=torch.bfloat16), _rand(5, 2, 8), _rand(5, 2, 8))
    assert isinstance(o, torch.Tensor) and o.dtype == torch.bfloat16
    k_pages = attnx.integrations.tensors.like(cache.k_pages(0), o)
    v_pages = attnx.integrations.tensors.like(cache.v_pages(0), o)
    assert k_pages.data_ptr() == cache.k_pages(0).ctypes.data
    o = attnx.paged_attention(
        _rand(1, 4, 8),
        k_pages,
        v_pages,
        torch.tensor([[0, 1]], dtype=torch.int32),
        torch.tensor([5], dtype=torch.int32),
    )
    assert isinstance(o, torch.Tensor) and o.shape == (1, 4, 8)


class _Boxed:
    """A minimal array-API object: __dlpack__ in, its namespace's from_dlpack out."""

    def __init__(self, a):
        self.a = a

    def __dlpack__(self, **kwargs):
        return self.a.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.a.__dlpack_device__()

    def __array_namespace__(self, api_version=None):
        return sys.modules[__name__]._BoxedNamespace


class _BoxedNamespace:
    @staticmethod
    def from_dlpack(x):
        return _Boxed(np.from_dlpack(x))


class _DlpackOnly(_Boxed):
    __array_namespace__ = None


def test_dlpack_objects_in_same_kind_out():
    a = np.random.default_rng(SEED).standard_normal((2, 3, 8)).astype(np.float32)
    out = attnx.attention(_Boxed(a), _Boxed(a), _Boxed(a))
    assert isinstance(out, _Boxed)
    np.testing.assert_array_equal(out.a, attnx.attention(a, a, a))
    assert type(attnx.attention(_DlpackOnly(a), a, a)) is np.ndarray  # no namespace: NumPy


@given(
    b=st.integers(1, 2),
    h=st.sampled_from([1, 2]),
    sq=st.integers(1, 9),
    sk=st.integers(1, 9),
    d=st.sampled_from([1, 8, 17]),
    dtype=st.sampled_from(DTYPES),
    causal=st.booleans(),
    layout=st.sampled_from(["bhsd", "bshd"]),
)
def test_tensor_results_equal_numpy_results(b, h, sq, sk, d, dtype, causal, layout):
    def shape(s):
        return (b, h, s, d) if layout == "bhsd" else (b, s, h, d)

    q, k, v = (
        _rand(*shape(sq), dtype=dtype),
        _rand(*shape(sk), dtype=dtype, seed=1),
        _rand(*shape(sk), dtype=dtype, seed=2),
    )
    got = attnx.attention(q, k, v, causal=causal, layout=layout)
    want = attnx.attention(_np_view(q), _np_view(k), _np_view(v), causal=causal, layout=layout)
    assert isinstance(got, torch.Tensor) and got.dtype == dtype
    np.testing.assert_array_equal(_np_view(got), want)


# ---- torch.library ops and torch.compile ------------------------------------------------------------


@pytest.fixture(autouse=True)
def _ops_registered():
    import attnx.torch_ops  # noqa: F401  (what a user does before compiling, or any tensor call does)


def _model(q, k, v, lens):
    return (
        attnx.attention(q * 2, k, v, causal=True, kv_lens=lens, window=(3, None), softcap=20.0) + 1
    )


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compile_fullgraph_equals_eager(backend):
    torch._dynamo.reset()
    q, k = _rand(2, 4, 8, 16), _rand(2, 2, 8, 16, seed=3)
    lens = torch.tensor([8, 5], dtype=torch.int32)
    compiled = torch.compile(_model, fullgraph=True, backend=backend)
    torch.testing.assert_close(compiled(q, k, k, lens), _model(q, k, k, lens), rtol=0, atol=0)


@pytest.mark.parametrize(
    "kw, error, match",
    [
        (dict(out=torch.zeros(1, 2, 9, 8, dtype=torch.float64)), TypeError, r"^out: .*dtype"),
        (dict(out=torch.zeros(3, 1, 2, 9, 8)), ValueError, r"^out: .*shape"),
        (dict(window=(2.7, 0)), TypeError, r"^window: "),
        (dict(window=(True, 0)), TypeError, r"^window: "),
        (dict(scale=True), TypeError, r"^scale: "),
        (dict(softcap=True), TypeError, r"^softcap: "),
    ],
)
def test_compiled_calls_refuse_what_eager_calls_refuse(kw, error, match):
    """The front end that torch.compile traces takes the eager call's rules for what the op schema
    would coerce (a float or bool window side, a bool scale) and for ``out`` (``copy_`` would cast
    and broadcast into it): each is an error naming the argument, eager and compiled alike."""
    q, k, v = _rand(1, 2, 9, 16), _rand(1, 2, 13, 16, seed=1), _rand(1, 2, 13, 8, seed=2)

    def call(q, k, v):
        return attnx.attention(q, k, v, **kw)

    with pytest.raises(error, match=match):
        call(q, k, v)
    torch._dynamo.reset()
    with pytest.raises(Exception) as raised:  # (Dynamo's Unsupported, caused by the error)
        torch.compile(call, fullgraph=True, backend="eager")(q, k, v)
    chain, e = [], raised.value
    while e is not None:
        chain.append(str(e))
        e = e.__cause__
    assert any(re.search(match[1:], c) for c in chain), chain


def test_ops_check_against_their_fakes():
    q, k = _rand(2, 6, 4, 16), _rand(2, 6, 2, 16, seed=4)
    torch.library.opcheck(
        torch.ops.attnx.attention.default,
        (q, k, k, None, None, None, True, None, "bshd", True, None, None, None, None, None, None),
    )
    kp = _rand(4, 2, 4, 16, seed=5)
    torch.library.opcheck(
        torch.ops.attnx.paged_attention.default,
        (
            _rand(2, 4, 16),
            kp,
            kp,
            torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
            torch.tensor([6, 8], dtype=torch.int32),
            None,
            True,
            None,
            True,
            None,
            None,
            None,
            None,
            None,
            None,
        ),
    )


def test_paged_op_compiles():
    torch._dynamo.reset()

    def decode(q, kp, vp, tables, lens):
        return attnx.paged_attention(q, kp, vp, tables, lens) * 3

    q, kp = _rand(2, 4, 16), _rand(4, 2, 4, 16, seed=6)
    tables, lens = (
        torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
        torch.tensor([6, 8], dtype=torch.int32),
    )
    compiled = torch.compile(decode, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(
        compiled(q, kp, kp, tables, lens), decode(q, kp, kp, tables, lens), rtol=0, atol=0
    )


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("ATTNX_TEST_INDUCTOR") != "1",
    reason="inductor compiles C++ around the op, about a minute on 2 cores: ATTNX_TEST_INDUCTOR=1",
)
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch's own imports under inductor
def test_compile_inductor_equals_eager():
    torch._dynamo.reset()
    q, k = _rand(1, 4, 8, 16), _rand(1, 2, 8, 16, seed=7)
    lens = torch.tensor([8], dtype=torch.int32)
    compiled = torch.compile(_model, fullgraph=True)
    torch.testing.assert_close(compiled(q, k, k, lens), _model(q, k, k, lens))
