"""The attention variants modern models use — sliding window, softcap, sinks, ALiBi — through every
entry point (``attnx.attention``, ``attnx.paged_attention``, ``PagedKVCache`` steps), alone and
combined with each other, with GQA/MQA, masks and padding, held to ``attnx.reference``; and
their bad inputs, which must raise ``ValueError`` naming the argument before anything is written.
"""

from __future__ import annotations

import itertools

import ml_dtypes
import numpy as np
import pytest

import attnx
from attnx import reference as ref

from helpers import make_rng

VARIANTS = ("window", "softcap", "sinks", "alibi")
COMBOS = [c for r in range(1, 5) for c in itertools.combinations(VARIANTS, r)]


def variant_kwargs(rng, names, Hq, *, window=None):
    kw = {}
    if "window" in names:
        if window is None:
            window = [(2, 0), (0, 1), (3, None), (None, 2), (1, 1), (5, 3)][int(rng.integers(6))]
        kw["window"] = window
    if "softcap" in names:
        kw["softcap"] = float(rng.choice([0.5, 2.0, 30.0]))
    if "sinks" in names:
        kw["sinks"] = rng.normal(0.0, 2.0, Hq).astype(np.float32)
    if "alibi" in names:
        kw["alibi_slopes"] = (2.0 ** -np.arange(1, Hq + 1)).astype(np.float32) * rng.uniform(0.5, 2)
    return kw


def close(got, want, scale=1.0, tol=2e-5):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want), err_msg="-inf pattern")
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg="NaN pattern")
    fin = np.isfinite(want)
    err = np.abs(got[fin] - want[fin]).max(initial=0.0)
    assert err <= tol * max(1.0, scale), f"max error {err:.3g}"


# ---------------------------------------------------------------------------------------------
# attnx.attention
# ---------------------------------------------------------------------------------------------


STRUCTURES = ["plain", "gqa_causal", "mqa_boolmask", "padding_causal", "floatmask_padding_bshd"]


@pytest.mark.parametrize("structure", STRUCTURES)
@pytest.mark.parametrize("names", COMBOS, ids=lambda c: "+".join(c))
def test_attention(names, structure):
    rng = make_rng("attention", names, structure)
    B, Sq, Sk, D = 2, 7, 11, 16
    Hq, Hkv = {
        "plain": (4, 4),
        "gqa_causal": (6, 2),
        "mqa_boolmask": (4, 1),
        "padding_causal": (4, 2),
        "floatmask_padding_bshd": (4, 2),
    }[structure]
    layout = "bshd" if "bshd" in structure else "bhsd"

    def shape(H, S, Dh):
        return (B, S, H, Dh) if layout == "bshd" else (B, H, S, Dh)

    q = rng.standard_normal(shape(Hq, Sq, D)).astype(np.float32)
    k = rng.standard_normal(shape(Hkv, Sk, D)).astype(np.float32)
    v = rng.standard_normal(shape(Hkv, Sk, 12)).astype(np.float32)
    kw = dict(causal="causal" in structure, layout=layout)
    if "boolmask" in structure:
        kw["mask"] = rng.random((B, 1, Sq, Sk)) < 0.7
    if "floatmask" in structure:
        m = rng.standard_normal((Hq, Sq, Sk)).astype(np.float32)
        m[rng.random(m.shape) < 0.2] = -np.inf
        kw["mask"] = m
    if "padding" in structure:
        kw["kv_lens"] = np.array([Sk, 6])
        kw["q_lens"] = np.array([5, Sq])
    kw.update(variant_kwargs(rng, names, Hq))
    out, lse = attnx.attention(q, k, v, return_lse=True, **kw)
    want, want_lse = ref.attention(q, k, v, return_lse=True, out_dtype=np.float64, **kw)
    close(out, want)
    close(lse, want_lse, scale=float(np.abs(want_lse[np.isfinite(want_lse)]).max(initial=1)))


@pytest.mark.parametrize("names", COMBOS, ids=lambda c: "+".join(c))
def test_attention_low_precision(names):
    rng = make_rng("attention lowp", names)
    dt = np.dtype(ml_dtypes.bfloat16)
    q = rng.standard_normal((2, 4, 6, 8)).astype(dt)
    k = rng.standard_normal((2, 2, 9, 8)).astype(dt)
    v = rng.standard_normal((2, 2, 9, 8)).astype(dt)
    kw = dict(causal=True, **variant_kwargs(rng, names, 4))
    out = attnx.attention(q, k, v, **kw)
    assert out.dtype == dt
    want = ref.attention(q, k, v, out_dtype=np.float64, **kw)
    close(out.astype(np.float64), want, tol=2 * float(ml_dtypes.finfo(dt).eps))


@pytest.mark.parametrize("window", [(0, 0), (1, None), (None, 0), (0, None), (100, 100)])
def test_window_shapes(window):
    """The visible band exactly: row i sees i' - left <= j <= i' + right, i' = i + Sk - Sq."""
    Sq, Sk = 4, 7
    q = np.zeros((Sq, 4), np.float32)  # uniform scores: weights = 1/(visible keys)
    k = np.zeros((Sk, 4), np.float32)
    v = np.eye(Sk, dtype=np.float32)
    out = attnx.attention(q, k, v, window=window)
    left, right = window
    for i in range(Sq):
        ip = i + Sk - Sq
        lo = 0 if left is None else max(0, ip - left)
        hi = Sk - 1 if right is None else min(Sk - 1, ip + right)
        want = np.zeros(Sk)
        want[lo : hi + 1] = 1.0 / (hi - lo + 1)
        np.testing.assert_allclose(out[i], want, atol=1e-6)


def test_sinks_only_rows_and_lse():
    """A row that sees no key puts all its weight on the sink: output 0; lse = sink."""
    rng = make_rng("sinks empty")
    q = rng.standard_normal((1, 2, 3, 4)).astype(np.float32)
    k = rng.standard_normal((1, 2, 5, 4)).astype(np.float32)
    mask = np.ones((3, 5), bool)
    mask[1] = False
    sinks = np.array([0.5, -1.0], np.float32)
    out, lse = attnx.attention(q, k, k, mask=mask, sinks=sinks, return_lse=True)
    want, want_lse = ref.attention(
        q, k, k, mask=mask, sinks=sinks, return_lse=True, out_dtype=np.float64
    )
    assert np.all(out[0, :, 1] == 0)
    close(out, want)
    close(lse, want_lse)
    np.testing.assert_allclose(lse[0, :, 1], sinks, atol=1e-6)
    # the weights of a row with a sink sum to less than one
    w = ref.attention_weights(q, k, sinks=sinks)
    assert np.all(w.sum(-1) < 1)


def test_softcap_bounds_the_scores():
    q = np.full((1, 4), 10.0, np.float32)
    k = np.array([[10.0] * 4, [-10.0] * 4], np.float32)
    v = np.eye(2, dtype=np.float32)
    cap = 2.0
    out = attnx.attention(q, k, v, softcap=cap, scale=1.0)
    s = cap * np.tanh(np.array([400.0, -400.0]) / cap)  # = [2, -2]
    want = np.exp(s) / np.exp(s).sum()
    np.testing.assert_allclose(out[0], want, atol=1e-6)


def test_alibi_distance_is_bottom_right():
    q = np.zeros((2, 1, 3, 4), np.float32)
    k = np.zeros((2, 1, 5, 4), np.float32)
    v = np.eye(5, dtype=np.float32)[None, None].repeat(2, 0)
    slopes = np.array([np.log(2.0)], np.float32)
    out = attnx.attention(q, k, v, alibi_slopes=slopes, kv_lens=np.array([5, 4]))
    for b, Lk in enumerate([5, 4]):
        for i in range(3):
            dist = np.abs(i + Lk - 3 - np.arange(Lk))
            w = 2.0**-dist
            np.testing.assert_allclose(out[b, 0, i, :Lk], w / w.sum(), atol=1e-6)


# ---------------------------------------------------------------------------------------------
# attnx.paged_attention
# ---------------------------------------------------------------------------------------------


def random_pool(rng, seq_lens, Hkv, D, Dv, bs, dtype=np.float32):
    seq_lens = np.asarray(seq_lens)
    nblk = -(-seq_lens // bs)
    num_blocks = int(nblk.sum()) + 3
    k_pages = rng.standard_normal((num_blocks, Hkv, bs, D)).astype(dtype)
    v_pages = rng.standard_normal((num_blocks, Hkv, bs, Dv)).astype(dtype)
    ids = rng.permutation(num_blocks)
    tables = np.full((len(seq_lens), max(1, int(nblk.max()))), num_blocks - 1, np.int32)
    start = 0
    for b, n in enumerate(nblk):
        tables[b, :n] = ids[start : start + n]
        start += n
    return k_pages, v_pages, tables


@pytest.mark.parametrize("mode", ["decode", "prefill_chunks"])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (4, 1)], ids=lambda h: f"H{h[0]}kv{h[1]}")
@pytest.mark.parametrize("names", COMBOS, ids=lambda c: "+".join(c))
def test_paged(names, heads, mode):
    rng = make_rng("paged", names, heads, mode)
    Hq, Hkv = heads
    D, Dv, bs = 16, 8, 4
    seq_lens = np.array([1, 9, 23, 4])
    q_lens = np.ones(4, np.int64) if mode == "decode" else np.array([1, 5, 7, 4])
    k_pages, v_pages, tables = random_pool(rng, seq_lens, Hkv, D, Dv, bs)
    q = rng.standard_normal((int(q_lens.sum()), Hq, D)).astype(np.float32)
    kw = variant_kwargs(rng, names, Hq)
    out, lse = attnx.paged_attention(
        q, k_pages, v_pages, tables, seq_lens, q_lens=q_lens, return_lse=True, **kw
    )
    want, want_lse = ref.paged_attention(
        q,
        k_pages,
        v_pages,
        tables,
        seq_lens,
        q_lens=q_lens,
        return_lse=True,
        out_dtype=np.float64,
        **kw,
    )
    close(out, want)
    close(lse, want_lse, scale=float(np.abs(want_lse[np.isfinite(want_lse)]).max(initial=1)))


@pytest.mark.parametrize("window", [(0, None), (3, None), (7, None), (2, 0)])
def test_paged_long_window_split_kv(window):
    """Long contexts are split across threads; the window must cut the right blocks."""
    rng = make_rng("paged long", window)
    seq_lens = np.array([700, 65, 1])
    k_pages, v_pages, tables = random_pool(rng, seq_lens, 2, 32, 32, 16)
    q = rng.standard_normal((3, 8, 32)).astype(np.float32)
    kw = dict(window=window, sinks=rng.standard_normal(8).astype(np.float32), softcap=20.0)
    for threads in (1, 2, 4):
        out = attnx.paged_attention(
            q, k_pages, v_pages, tables, seq_lens, num_threads=threads, **kw
        )
        want = ref.paged_attention(
            q, k_pages, v_pages, tables, seq_lens, out_dtype=np.float64, **kw
        )
        close(out, want)


def test_paged_mla_value_view():
    """Latent attention: one kv head, Dk = 576, values the first 512 key features (a view)."""
    rng = make_rng("mla")
    seq_lens = np.array([3, 40, 17])
    k_pages, _, tables = random_pool(rng, seq_lens, 1, 576, 8, 16)
    v_pages = k_pages[..., :512]
    q = rng.standard_normal((3, 16, 576)).astype(np.float32)
    scale = 1 / np.sqrt(192)
    out = attnx.paged_attention(
        q, k_pages, v_pages, tables, seq_lens, scale=scale, sinks=np.zeros(16, np.float32)
    )
    want = ref.paged_attention(
        q,
        k_pages,
        v_pages,
        tables,
        seq_lens,
        scale=scale,
        sinks=np.zeros(16, np.float32),
        out_dtype=np.float64,
    )
    close(out, want)
    np.testing.assert_array_equal(
        out,
        attnx.paged_attention(
            q,
            k_pages,
            np.ascontiguousarray(v_pages),
            tables,
            seq_lens,
            scale=scale,
            sinks=np.zeros(16, np.float32),
        ),
    )


# ---------------------------------------------------------------------------------------------
# PagedKVCache steps: a hybrid model (windowed and global layers) decoding several sequences
# ---------------------------------------------------------------------------------------------


LAYER_VARIANTS = [
    dict(window=(3, 0)),  # Mistral/Gemma-style local layer
    dict(softcap=5.0, sinks=np.array([0.3, -0.5, 1.0, 0.0], np.float32)),  # global + sinks
    dict(
        window=(5, None), alibi_slopes=np.array([0.5, 0.25, 0.125, 0.0625], np.float32), softcap=3.0
    ),
]


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("Hkv", [4, 2, 1])
def test_cache_steps(Hkv, kv_dtype):
    rng = make_rng("cache", Hkv, kv_dtype)
    Hq, D, L = 4, 8, len(LAYER_VARIANTS)
    cache = attnx.PagedKVCache(
        num_layers=L, num_kv_heads=Hkv, head_dim=D, num_blocks=64, block_size=4, dtype=kv_dtype
    )
    store = np.dtype(ml_dtypes.bfloat16) if kv_dtype == "bfloat16" else np.dtype(np.float32)
    seqs = [cache.new_sequence() for _ in range(3)]
    hist = {s: [([], []) for _ in range(L)] for s in seqs}  # per layer: K rows, V rows

    def run_step(ids, counts):
        step = cache.begin_step(ids, counts)
        T = int(sum(counts))
        for layer, var in enumerate(LAYER_VARIANTS):
            q = rng.standard_normal((T, Hq, D)).astype(np.float32)
            k = rng.standard_normal((T, Hkv, D)).astype(np.float32)
            v = rng.standard_normal((T, Hkv, D)).astype(np.float32)
            out = step.attend(layer, q, k, v, **var)
            start = 0
            for s, n in zip(ids, counts):
                K, V = hist[s][layer]
                K.extend(k[start : start + n].astype(store).astype(np.float32))
                V.extend(v[start : start + n].astype(store).astype(np.float32))
                if n:
                    want = ref.attention(
                        q[start : start + n],
                        np.array(K),
                        np.array(V),
                        causal=True,
                        layout="bshd",
                        out_dtype=np.float64,
                        **var,
                    )
                    close(out[start : start + n], want)
                start += n

    run_step(seqs, [5, 9, 1])  # prefill
    for _ in range(3):  # decode
        run_step(seqs, [1, 1, 1])
    run_step(seqs, [6, 0, 2])  # a chunk of more prompt for one, nothing for another
    child = cache.fork(seqs[1])  # parallel sampling: the child shares the parent's blocks
    hist[child] = [(list(K), list(V)) for K, V in hist[seqs[1]]]
    for _ in range(2):
        run_step([seqs[1], child], [1, 1])


# ---------------------------------------------------------------------------------------------
# bad inputs: ValueError naming the argument, nothing written
# ---------------------------------------------------------------------------------------------


BAD = [
    ("window", dict(window=(-1, None))),
    ("window", dict(window=(None, -2))),
    ("window", dict(window=(2, 3, 4))),
    ("softcap", dict(softcap=0.0)),
    ("softcap", dict(softcap=-1.0)),
    ("softcap", dict(softcap=float("nan"))),
    ("sinks", dict(sinks=np.zeros(3, np.float32))),
    ("sinks", dict(sinks=np.zeros((1, 4), np.float32))),
    ("alibi_slopes", dict(alibi_slopes=np.zeros(5, np.float32))),
    ("alibi_slopes", dict(alibi_slopes=np.zeros(2, np.float32))),
]
BAD_IDS = [f"{name}-{i}" for i, (name, _) in enumerate(BAD)]


@pytest.mark.parametrize("fn", [attnx.attention, ref.attention], ids=["attnx", "reference"])
@pytest.mark.parametrize("bad", BAD, ids=BAD_IDS)
def test_bad_attention(fn, bad):
    name, kw = bad
    q = np.ones((1, 4, 3, 8), np.float32)
    k = np.ones((1, 2, 5, 8), np.float32)
    with pytest.raises(ValueError, match=name):
        fn(q, k, k, **kw)


@pytest.mark.parametrize(
    "fn", [attnx.paged_attention, ref.paged_attention], ids=["attnx", "reference"]
)
@pytest.mark.parametrize("bad", BAD, ids=BAD_IDS)
def test_bad_paged(fn, bad):
    name, kw = bad
    kp = np.ones((4, 2, 4, 8), np.float32)
    q = np.ones((2, 4, 8), np.float32)
    with pytest.raises(ValueError, match=name):
        fn(q, kp, kp, np.array([[0, 1], [2, 3]]), np.array([5, 8]), **kw)


def test_bad_paged_leaves_out_untouched():
    kp = np.ones((4, 2, 4, 8), np.float32)
    q = np.ones((2, 4, 8), np.float32)
    out = np.full((2, 4, 8), 7.0, np.float32)
    with pytest.raises(ValueError, match="sinks"):
        attnx.paged_attention(
            q,
            kp,
            kp,
            np.array([[0, 1], [2, 3]]),
            np.array([5, 8]),
            out=out,
            sinks=np.zeros(3, np.float32),
        )
    assert np.all(out == 7.0)


@pytest.mark.parametrize("bad", BAD, ids=BAD_IDS)
def test_bad_cache_step_writes_nothing(bad):
    name, kw = bad
    cache = attnx.PagedKVCache(num_layers=1, num_kv_heads=2, head_dim=8, num_blocks=4, block_size=4)
    s = cache.new_sequence()
    step = cache.begin_step([s], [3])
    q = np.ones((3, 4, 8), np.float32)
    kv = np.full((3, 2, 8), 5.0, np.float32)
    with pytest.raises(ValueError, match=name):
        step.attend(0, q, kv, kv, **kw)
    assert not cache.k_pages(0).any() and not cache.v_pages(0).any()
    out = step.attend(0, q, kv, kv)  # the step is still usable
    np.testing.assert_allclose(out, 5.0)
