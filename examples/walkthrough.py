"""The seed's walkthrough of attention, section by section, computed with attnx.

Every number the seed shows is recomputed here (and checked), every shape is printed, and the
attention maps are saved as PNG heatmaps in ``--out DIR`` (needs matplotlib: ``pip install
attnx[viz]``; without it the numbers are still printed)::

    python examples/walkthrough.py --out walkthrough_out

Sections (the seed's numbering):
  01  how a model represents a word: token id -> embedding lookup -> contextual row
  02  the fixed-vector bottleneck versus attention over all encoder states (.05/.10/.18/.67)
  03  queries, keys and values
  04  the equation, with shapes and numbers
  05  self-attention, one matrix operation at a time
  06  self-attention, cross-attention, causal and padding masks
  07  multi-head attention: the two-head river/bank/flooded example
  08  what it costs: n² scores versus tiling; the KV cache (attnx.PagedKVCache); variants
  09  the mechanism in one view
  10  hybrid models: gated delta-rule (linear) layers beside full attention, a fixed-size state
      per sequence instead of a growing cache, and the attention map a linear layer implies

The model weights here are random or hand-made (selector matrices, designed queries): the
point is the arithmetic, which is exactly what a trained model runs. A bright heatmap cell only
says that one query gave one key a larger coefficient in that layer and head.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import time
import tracemalloc

import numpy as np

import attnx
from attnx import reference as ref

F32 = np.float32


def section(title):
    print()
    print("=" * 78)
    print(title)
    print("=" * 78)


def fmt(a, digits=3):
    return np.array2string(
        np.asarray(a, dtype=np.float64),
        precision=digits,
        suppress_small=True,
        floatmode="fixed",
        max_line_width=100,
    )


class Pictures:
    """Saves heatmaps into the output folder, or notes that matplotlib is missing."""

    def __init__(self, out_dir):
        self.out_dir = out_dir
        self.saved = []
        try:
            from attnx import viz

            viz._matplotlib()
            self.viz = viz
        except ImportError as exc:
            print(f"[no pictures: {exc}]")
            self.viz = None

    def heatmap(self, name, weights, query_tokens, key_tokens, title):
        if self.viz is None:
            return
        ax = self.viz.heatmap(weights, query_tokens, key_tokens, title=title)
        path = os.path.join(self.out_dir, name)
        ax.figure.savefig(path, dpi=110)
        self.saved.append(path)
        print(f"  [saved {path}]")

    def heads(self, name, maps, tokens, titles):
        """Several maps side by side in one figure."""
        if self.viz is None:
            return
        from matplotlib.figure import Figure

        fig = Figure(figsize=(4.2 * len(maps), 3.6), layout="constrained")
        axes = fig.subplots(1, len(maps))
        for ax, w, t in zip(np.atleast_1d(axes), maps, titles):
            self.viz.heatmap(w, tokens, tokens, ax=ax, title=t)
        path = os.path.join(self.out_dir, name)
        fig.savefig(path, dpi=110)
        self.saved.append(path)
        print(f"  [saved {path}]")

    def curve(self, name, ns, series, ylabel, title):
        if self.viz is None:
            return
        from matplotlib.figure import Figure

        fig = Figure(figsize=(5.5, 3.8), layout="constrained")
        ax = fig.add_subplot()
        for label, ys in series.items():
            ax.loglog(ns, ys, "o-", label=label)
        ax.set_xticks(ns, labels=[str(n) for n in ns])
        ax.tick_params(axis="x", which="minor", bottom=False, labelbottom=False)
        ax.set_xlabel("sequence length n")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        path = os.path.join(self.out_dir, name)
        fig.savefig(path, dpi=110)
        self.saved.append(path)
        print(f"  [saved {path}]")


def queries_for(keys, weights, scale):
    """A query q whose attention over ``keys`` gives exactly ``weights``: softmax is invariant to
    a constant shift, so we need scale * keys @ q = log(weights) + c; least squares solves it
    (exactly, when the keys are linearly independent)."""
    target = np.log(np.asarray(weights, dtype=np.float64))
    target = target - target.mean(axis=-1, keepdims=True)
    return (np.linalg.pinv(keys.astype(np.float64)) @ target.T).T / scale


# --------------------------------------------------------------------------------------------
def s01_embeddings(rng, pics):
    section("01  How a model represents a word: token id -> embedding row -> contextual row")
    vocab_size, d = 5000, 4
    table = (0.5 * rng.standard_normal((vocab_size, d))).astype(F32)  # learned, one row per token
    vocab = {
        "the": 11,
        "road": 2210,
        "curves": 3102,
        "along": 87,
        "river": 1533,
        "bank": 4821,
        "she": 301,
        "paid": 1777,
        "cash": 2604,
        "into": 95,
        "her": 310,
    }
    table[vocab["bank"]] = [0.12, -0.44, 0.71, 0.09]
    print(
        f'text "bank" -> token id {vocab["bank"]} (an index, not a quantity) -> E[4821] =',
        fmt(table[vocab["bank"]], 2),
        f"shape 1 x {d}",
    )

    s1 = ["the", "road", "curves", "along", "river", "bank"]
    s2 = ["she", "paid", "cash", "into", "her", "bank"]
    X1 = table[[vocab[t] for t in s1]]
    X2 = table[[vocab[t] for t in s2]]
    print("same starting lookup in both sentences:", np.array_equal(X1[-1], X2[-1]))

    # The seed's attention row for "bank": A_bank = [0.04, 0.42, 0.28, 0.06, 0.08, 0.12].
    # A query whose scores are log(A) reproduces it through the kernel (softmax(log A) = A).
    A_bank = np.array([0.04, 0.42, 0.28, 0.06, 0.08, 0.12])
    tokens = ["the", "road", "curves", "near", "the", "bank"]
    keys = np.eye(6, dtype=F32)  # one independent key per position
    q = queries_for(keys, A_bank[None], scale=1.0).astype(F32)
    V = (0.5 * rng.standard_normal((6, d))).astype(F32)
    update = attnx.attention(q, keys, V, scale=1.0)
    A = ref.attention_weights(q, keys, scale=1.0)
    print("attention weights for bank, A_bank =", fmt(A[0], 2), "shape 1 x", A.shape[1])
    print("largest weights:", [tokens[j] for j in np.argsort(-A[0])[:2]], "(road, curves)")
    assert np.allclose(A[0], A_bank, atol=1e-6)
    print("update A_bank V =", fmt(update[0]), "= attnx.attention(q, K, V)")
    assert np.allclose(update[0], A_bank @ V, atol=1e-5)
    pics.heatmap("01_bank_row.png", A, ["bank"], tokens, "Attention row for 'bank' (seed values)")

    # After one attention layer (+ residual) the same starting row differs by context.
    layer = attnx.MultiHeadAttention(d_model=d, num_heads=1, seed=1)
    Y1 = X1 + layer(X1)
    Y2 = X2 + layer(X2)
    print("after attention + residual, 'bank' in", " ".join(s1), "->", fmt(Y1[-1]))
    print("after attention + residual, 'bank' in", " ".join(s2), "    ->", fmt(Y2[-1]))
    print("contextual rows differ:", not np.allclose(Y1[-1], Y2[-1]))


# --------------------------------------------------------------------------------------------
def s02_bottleneck(rng, pics):
    section("02  Before attention: one fixed-width state c = h4; with attention: every h_j")
    src = ["The", "student", "solved", "the problem"]
    tgt = ["Der", "Schüler", "löste", "die", "Aufgabe"]
    d = 8
    emb = rng.standard_normal((len(src), d)).astype(F32)
    Wx = (rng.standard_normal((d, d)) / math.sqrt(d)).astype(F32)
    Wh = (rng.standard_normal((d, d)) / math.sqrt(d)).astype(F32)
    h = np.zeros(d, F32)
    H = []
    for x in emb:  # an RNN encoder, h_t = tanh(x_t Wx + h_{t-1} Wh)
        h = np.tanh(x @ Wx + h @ Wh)
        H.append(h)
    H = np.array(H, F32)  # (4, d): one state per source token, each of the same width
    print(f"encoder states h1..h4: shape {H.shape} (a longer sentence gives more rows, not wider)")
    c = H[-1]
    print("without attention every decoder step reads the same c = h4:", fmt(c, 2))

    # With attention: decoder step i forms c_i = sum_j alpha_ij h_j. The decoder queries below
    # are chosen so that the weights are the seed's (.05/.10/.18/.67 for "Aufgabe"); a trained
    # decoder learns its own.
    alpha = np.array(
        [
            [0.70, 0.12, 0.08, 0.10],  # Der       -> The
            [0.08, 0.80, 0.07, 0.05],  # Schüler   -> student
            [0.05, 0.12, 0.75, 0.08],  # löste     -> solved
            [0.25, 0.05, 0.10, 0.60],  # die       -> the problem
            [0.05, 0.10, 0.18, 0.67],  # Aufgabe   -> the problem (the seed's row)
        ]
    )
    scale = 1.0 / math.sqrt(d)
    Q = queries_for(H, alpha, scale).astype(F32)  # (5, d) decoder queries
    C = attnx.attention(Q, H, H)  # cross-attention: queries from the decoder, keys/values h_j
    A = ref.attention_weights(Q, H)
    print("alpha for 'Aufgabe' =", fmt(A[-1], 2), " (seed: .05 .10 .18 .67)")
    assert np.allclose(A[-1], [0.05, 0.10, 0.18, 0.67], atol=1e-4)
    manual = 0.05 * H[0] + 0.10 * H[1] + 0.18 * H[2] + 0.67 * H[3]
    print("c_Aufgabe = .05 h1 + .10 h2 + .18 h3 + .67 h4 =", fmt(manual, 2))
    print("attnx.attention gives                        ", fmt(C[-1], 2))
    assert np.allclose(C[-1], manual, atol=1e-4)
    spread = np.linalg.norm(C - C.mean(0), axis=1)
    print(
        "each decoder step now gets its own context (distance from the mean context):",
        fmt(spread, 2),
    )
    pics.heatmap(
        "02_cross_attention_de_en.png", A, tgt, src, "Decoder attention over encoder states"
    )


# --------------------------------------------------------------------------------------------
def s03_qkv(rng):
    section("03  Queries, keys and values: three learned views of the same rows")
    n, d_model, d_k, d_v = 5, 8, 4, 6
    X = rng.standard_normal((n, d_model)).astype(F32)
    W_Q = rng.standard_normal((d_model, d_k)).astype(F32)
    W_K = rng.standard_normal((d_model, d_k)).astype(F32)
    W_V = rng.standard_normal((d_model, d_v)).astype(F32)
    Q, K, V = X @ W_Q, X @ W_K, X @ W_V
    print(f"X {X.shape} -> Q = X W_Q {Q.shape}  (what each position asks for)")
    print(f"            K = X W_K {K.shape}  (what each position can match)")
    print(f"            V = X W_V {V.shape}  (the content that gets mixed)")
    out = attnx.attention(Q, K, V)
    print(f"compare query with every key -> normalise -> mix values: out {out.shape}")
    return Q, K, V


# --------------------------------------------------------------------------------------------
def s04_equation(Q, K, V):
    section("04  Attention(Q,K,V) = softmax(Q Kᵀ / sqrt(d_k) + M) V, with shapes")
    nq, dk = Q.shape
    nk = K.shape[0]
    scores = Q.astype(np.float64) @ K.T
    print(f"1 scores = Q Kᵀ        ({nq} x {dk}) · ({dk} x {nk}) = {scores.shape}")
    scaled = scores / math.sqrt(dk)
    print(f"2 scaled = scores/√{dk}  shape stays {scaled.shape}")
    M = np.zeros((nq, nk))
    print(f"3 masked = scaled + M  M {M.shape}: 0 keeps a score, -inf blocks it (here M = 0)")
    e = np.exp(scaled + M - (scaled + M).max(1, keepdims=True))
    weights = e / e.sum(1, keepdims=True)
    print(
        f"4 weights = softmax    row-wise, shape {weights.shape}, row sums", fmt(weights.sum(1), 3)
    )
    out = weights @ V
    print(f"  out = weights V      ({nq} x {nk}) · ({nk} x {V.shape[1]}) = {out.shape}")
    print("weights =\n" + fmt(weights))
    fast = attnx.attention(Q, K, V)
    err = np.abs(fast - out).max()
    print(f"attnx.attention (tiled, never forms the {nq}x{nk} matrix): max |diff| = {err:.1e}")
    assert err < 1e-4 * max(1.0, np.abs(out).max())
    print(
        "why √d_k: the spread of a dot product grows with the width; scaling keeps softmax"
        " away from one-hot rows:"
    )
    r = np.random.default_rng(7)
    for width in (4, 64, 1024):
        q, k = r.standard_normal(width), r.standard_normal((8, width))
        s = k @ q
        for lab, val in (("unscaled", s), ("scaled", s / math.sqrt(width))):
            p = np.exp(val - val.max())
            p /= p.sum()
            print(
                f"  d_k={width:5d} {lab:9s} score std {val.std():6.2f}  largest weight {p.max():.2f}"
            )


# --------------------------------------------------------------------------------------------
def s05_stages(rng, pics):
    section("05  Self-attention, one matrix operation at a time (nine stages)")
    tokens = ["the", "river", "bank", "was", "flooded"]
    n, d_model = len(tokens), 8
    X = rng.standard_normal((n, d_model)).astype(F32)
    layer = attnx.MultiHeadAttention(d_model, num_heads=1, head_dim=4, seed=3)
    Q = X @ layer.W_Q
    print(f"1 project queries   Q = X W_Q       {X.shape} · {layer.W_Q.shape} = {Q.shape}")
    K = X @ layer.W_K
    print(f"2 project keys      K = X W_K       {K.shape}")
    V = X @ layer.W_V
    print(f"3 project values    V = X W_V       {V.shape}")
    S = Q.astype(np.float64) @ K.T
    print(f"4 scores            Q Kᵀ            {S.shape}")
    S = S / math.sqrt(Q.shape[1])
    print(f"5 scale             / √{Q.shape[1]}           {S.shape}")
    print("6 mask              + M (none: bidirectional encoder)")
    A = np.exp(S - S.max(1, keepdims=True))
    A /= A.sum(1, keepdims=True)
    print(f"7 softmax rows      A               {A.shape}")
    Z = A @ V
    print(f"8 weighted values   Z = A V         {Z.shape}")
    Y = Z @ layer.W_O
    print(f"9 output projection Y = Z W_O       {Y.shape} (back to d_model)")
    y, w = layer(X, return_weights=True)
    err = np.abs(y - Y).max()
    print(f"attnx.MultiHeadAttention does all nine: max |diff| = {err:.1e}")
    assert err < 1e-4
    pics.heatmap(
        "05_self_attention.png", w[0], tokens, tokens, "Self-attention (random weights, one head)"
    )


# --------------------------------------------------------------------------------------------
def s06_masks(rng, pics):
    section("06  Self-attention, cross-attention and masks reuse the same calculation")
    d_model = 8
    layer = attnx.MultiHeadAttention(d_model, num_heads=2, seed=4)
    src = ["the", "river", "bank", "flooded"]
    tgt = ["das", "Flussufer", "war", "überflutet", "."]
    X = rng.standard_normal((len(src), d_model)).astype(F32)
    Y = rng.standard_normal((len(tgt), d_model)).astype(F32)
    _, ws = layer(X, return_weights=True)
    print(f"self-attention : Q = X W_Q, K = X W_K, V = X W_V       maps {ws.shape}")
    out, wc = layer(Y, context=X, return_weights=True)
    print(
        f"cross-attention: Q = Y W_Q, K = X W_K, V = X W_V       out {out.shape}, maps "
        f"{wc.shape} (target rows x source columns)"
    )
    pics.heatmap("06_cross_attention.png", wc[0], tgt, src, "Cross-attention, head 1")

    # Causal mask: position i reads positions <= i.
    X3 = rng.standard_normal((3, d_model)).astype(F32)
    _, wcaus = layer(X3, causal=True, return_weights=True)
    pattern = (wcaus[0] > 0).astype(int)
    print("causal mask (1 = may read):")
    for row in pattern:
        print("   " + " ".join(str(v) for v in row))
    assert pattern.tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    print("row sums", fmt(wcaus[0].sum(1), 3), "- blocked scores became -inf before softmax")

    toks = ["the", "animal", "didn't", "cross", "because", "it", "was", "tired"]
    Xs = rng.standard_normal((len(toks), d_model)).astype(F32)
    _, wit = layer(Xs, causal=True, return_weights=True)
    i = toks.index("it")
    print(f"Q = it: row {fmt(wit[0, i, : i + 1], 3)}  row sum {wit[0, i].sum():.3f}")
    pics.heatmap("06_causal_mask.png", wit[0], toks, toks, "Causal self-attention, head 1")

    # Padding mask: a batch of two sentences of lengths 5 and 3, padded to 5.
    lens = np.array([5, 3])
    Xb = rng.standard_normal((2, 5, d_model)).astype(F32)
    Xb[1, 3:] = 0.0  # padding rows
    yb, wb = layer(Xb, kv_lens=lens, q_lens=lens, return_weights=True)
    print(
        f"padding mask: batch {Xb.shape}, lengths {lens.tolist()}; weights on padded keys:",
        float(wb[1, :, :, 3:].sum()),
        "; padded output rows:",
        float(np.abs(yb[1, 3:]).sum()),
    )
    alone = layer(Xb[1, :3])
    print(
        "the short sentence gives the same rows alone as in the padded batch:",
        bool(np.allclose(alone, yb[1, :3], atol=1e-5)),
    )
    sent = ["the", "bank", "flooded", "<pad>", "<pad>"]
    pics.heatmap("06_padding_mask.png", wb[1, 0], sent, sent, "Padding mask (length 3 of 5)")


# --------------------------------------------------------------------------------------------
def s07_two_heads(pics):
    section("07  Two heads, one four-dimensional input: river / bank / flooded")
    tokens = ["river", "bank", "flooded"]
    X = np.array([[1, 0, 1, 0], [0, 1, 0, 1], [1, 1, 0, 0]], F32)
    print("X (3 tokens x 4 features):\n" + fmt(X, 0))
    # Selector projections: head 1 reads features 0-1, head 2 features 2-3 (W = I, split in
    # column blocks of head_dim = 2); W_O = I so the layer returns Concat(head_1, head_2).
    layer = attnx.MultiHeadAttention(d_model=4, num_heads=2, head_dim=2)
    layer.W_Q = layer.W_K = layer.W_V = layer.W_O = np.eye(4)
    y, w = layer(X, return_weights=True)
    print("scale 1/√2 =", f"{1 / math.sqrt(2):.4f}")
    print("head 1 weights A¹ for river:", fmt(w[0, 0], 3), " (seed: 0.401 0.198 0.401)")
    heads = attnx.attention(
        X.reshape(3, 2, 2), X.reshape(3, 2, 2), X.reshape(3, 2, 2), layout="bshd"
    )  # (3 tokens, 2 heads, 2)
    print("head 1 output for river:", fmt(heads[0, 0], 3), " (seed: 0.802 0.599)")
    print("head 2 output for river:", fmt(heads[0, 1], 3), " (seed: 0.503 0.248)")
    print("concatenate            :", fmt(y[0], 3), " (seed: 0.802 0.599 0.503 0.248)")
    assert np.allclose(w[0, 0], [0.401, 0.198, 0.401], atol=5e-4)
    assert np.allclose(y[0], [0.802, 0.599, 0.503, 0.248], atol=5e-4)
    print(
        "shapes: X 3x4 -> each head Q,K,V 3x2 -> each map A 3x3 -> each head output 3x2 ->"
        f" concat {y.shape[0]}x{y.shape[1]}"
    )
    pics.heads(
        "07_two_heads.png", [w[0], w[1]], tokens, ["Head 1 (features 1-2)", "Head 2 (features 3-4)"]
    )


# --------------------------------------------------------------------------------------------
def _measure(fn, repeats=3):
    """(best wall time of ``repeats`` runs, peak traced bytes of one run)."""
    gc.collect()
    tracemalloc.start()
    fn()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best, peak


def s08_cost(rng, pics, sizes):
    section("08  What it costs: n² pairwise scores versus FlashAttention-style tiling")
    d = 64
    print(
        f"one head, d_k = {d}, causal; best time; peak memory traced by tracemalloc (NumPy "
        f"allocations, including the output)"
    )
    print(f"{'n':>6} {'pairs n²':>10} {'scores f32':>11} {'reference':>21} {'attnx':>21}")
    rows = {"reference (float64, full n×n)": [], "attnx (tiled)": []}
    mems = {"reference (float64, full n×n)": [], "attnx (tiled)": []}
    for n in sizes:
        q, k, v = (rng.standard_normal((n, d)).astype(F32) for _ in range(3))
        attnx.attention(q, k, v, causal=True)  # warm up threads
        t_ref, m_ref = _measure(lambda: ref.attention(q, k, v, causal=True), repeats=1)
        t_fast, m_fast = _measure(lambda: attnx.attention(q, k, v, causal=True))
        rows["reference (float64, full n×n)"].append(t_ref)
        rows["attnx (tiled)"].append(t_fast)
        mems["reference (float64, full n×n)"].append(m_ref / 2**20)
        mems["attnx (tiled)"].append(m_fast / 2**20)
        print(
            f"{n:6d} {n * n:10d} {n * n * 4 / 2**20:9.1f}MB "
            f"{t_ref * 1e3:8.1f} ms {m_ref / 2**20:7.1f} MB "
            f"{t_fast * 1e3:8.2f} ms {m_fast / 2**20:7.2f} MB"
        )
    print(
        "doubling n quadruples the pairs; the reference's memory follows n², attnx's only the "
        "n x d output (the tiles live in cache-sized buffers)"
    )
    pics.curve("08_cost_time.png", sizes, rows, "seconds", "Causal attention time")
    pics.curve(
        "08_cost_memory.png",
        sizes,
        mems,
        "peak MiB (tracemalloc)",
        "Memory: materialised scores vs tiles",
    )


def s08_kv_cache(rng):
    section("08  The autoregressive KV cache (attnx.PagedKVCache)")
    d_model, H, Hkv, L = 32, 4, 2, 2
    layers = [attnx.MultiHeadAttention(d_model, H, num_kv_heads=Hkv, seed=10 + i) for i in range(L)]
    D = layers[0].head_dim
    prompt, new = 11, 6
    xs = rng.standard_normal((prompt + new, d_model)).astype(F32)

    def full(x):  # no cache: recompute every K, V of the whole prefix, causal
        for lyr in layers:
            x = x + lyr(x, causal=True)
        return x

    cache = attnx.PagedKVCache(
        num_layers=L, num_kv_heads=Hkv, head_dim=D, num_blocks=8, block_size=4
    )
    seq = cache.new_sequence()

    def cached(x):  # only the new rows: their K, V are stored, older ones read from the pages
        step = cache.begin_step([seq], [x.shape[0]])
        for li, lyr in enumerate(layers):
            q = (x @ lyr.W_Q).reshape(-1, H, D)
            k = (x @ lyr.W_K).reshape(-1, Hkv, D)
            v = (x @ lyr.W_V).reshape(-1, Hkv, D)
            z = step.attend(li, q, k, v)
            x = x + z.reshape(-1, H * D) @ lyr.W_O
        return x

    out = [cached(xs[:prompt])]  # prefill the prompt in one step
    for t in range(prompt, prompt + new):  # then one token per step
        out.append(cached(xs[t : t + 1]))
    out = np.concatenate(out)
    err = np.abs(out - full(xs)).max()
    print(
        f"prefill {prompt} tokens, then decode {new} one at a time over {L} layers: max |diff| "
        f"vs recomputing everything = {err:.1e}"
    )
    assert err < 1e-4
    st = cache.stats()
    print(
        f"cache: {st['used_blocks']} blocks of {st['block_size']} slots for "
        f"{st['tokens_stored']} tokens (utilisation {st['utilisation']:.2f}), "
        f"{st['bytes_per_token']} bytes per token = layers x kv heads x (d_k + d_v) x 4 = "
        f"{L} x {Hkv} x {2 * D} x 4"
    )
    print(
        "the cache grows with layers, kv heads, tokens and head width; GQA (here 2 kv heads "
        "for 4 query heads) halves it; see examples/kv_bytes.py for MHA/GQA/MLA"
    )


def s08_variants(rng, pics):
    section("08  Variants keep the roles: hybrid windowed + global layers")
    n, d = 10, 8
    q, k, v = (rng.standard_normal((2, n, d)).astype(F32) for _ in range(3))
    out = attnx.attention(q, k, v, causal=True, window=(2, None))
    w = ref.attention_weights(q, k, causal=True, window=(2, None))
    err = np.abs(out - ref.attention(q, k, v, causal=True, window=(2, None))).max()
    print(
        f"sliding window (left=2): each token reads itself and 2 before it; kernel vs "
        f"reference max |diff| {err:.1e}"
    )
    print("visible keys per row:", (w[0] > 0).sum(1).tolist())
    toks = [f"t{i}" for i in range(n)]
    wg = ref.attention_weights(q, k, causal=True)
    pics.heads(
        "08_hybrid_window_global.png",
        [w[0], wg[0]],
        toks,
        ["Windowed layer (left=2)", "Global causal layer"],
    )


# --------------------------------------------------------------------------------------------
def s09_summary():
    section("09  The mechanism in one view")
    Q = np.array([[1.0, 0.0]], F32)
    K = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], F32)
    V = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], F32)
    print(
        f"Q {Q.shape} · Kᵀ {K.T.shape} = scores {(Q @ K.T).shape}; weights · V {V.shape} = "
        f"{attnx.attention(Q, K, V).shape}"
    )
    print(
        "score keys -> normalise -> weighted sum of value rows:",
        fmt(attnx.attention(Q, K, V)[0], 3),
        "(the river row of head 1)",
    )


# --------------------------------------------------------------------------------------------
class DeltaLayer:
    """A gated delta-rule layer (Gated DeltaNet / Qwen3-Next's linear attention), random weights:
    q, k (Hk heads of K), v (Hv heads of V), a log-decay g = -softplus(x W_g - 3) <= 0 and a write
    strength beta = sigmoid(x W_b) per value head; o is mixed back to the model width by W_o."""

    def __init__(self, rng, d_model, Hk, Hv, K, V):
        w = lambda n: (rng.standard_normal((d_model, n)) / math.sqrt(d_model)).astype(F32)  # noqa: E731
        self.Hk, self.Hv, self.K, self.V = Hk, Hv, K, V
        self.W_q, self.W_k, self.W_v, self.W_g, self.W_b = (
            w(Hk * K),
            w(Hk * K),
            w(Hv * V),
            w(Hv),
            w(Hv),
        )
        self.W_o = (rng.standard_normal((Hv * V, d_model)) / math.sqrt(Hv * V)).astype(F32)

    def inputs(self, x):
        """q, k (T, Hk, K), v (T, Hv, V), g, beta (T, Hv) for the rows x (T, d_model)."""
        T = x.shape[0]
        g = -np.logaddexp(0, x @ self.W_g - 3.0).astype(F32)  # mild decays: e^g about 0.95
        beta = (1 / (1 + np.exp(-(x @ self.W_b)))).astype(F32)
        return (
            (x @ self.W_q).reshape(T, self.Hk, self.K),
            (x @ self.W_k).reshape(T, self.Hk, self.K),
            (x @ self.W_v).reshape(T, self.Hv, self.V),
            g,
            beta,
        )

    def map(self, x):
        """The (Hv, T, T) matrices A with o = A v: the recurrence is linear in the values (S starts
        at 0, and u_t = beta_t (v_t - Sᵀ k_t) is linear in S and v_t), so running it on one-hot
        values, v_t = e_t (a width of T), makes o_t[s] the weight of v_s in o_t: row t of A."""
        q, k, _, g, beta = self.inputs(x)
        onehot = np.broadcast_to(
            np.eye(x.shape[0], dtype=F32)[:, None, :], (x.shape[0], self.Hv, x.shape[0])
        )
        a = attnx.gated_delta_rule(
            q[None], k[None], onehot[None], g[None], beta[None], qk_l2norm=True
        )
        return a[0].transpose(1, 0, 2)


def _hybrid_stack(rng, d_model):
    """Three linear layers, then one full-attention layer (the 3:1 pattern of Qwen3-Next and
    Kimi Linear)."""
    linear = [DeltaLayer(rng, d_model, Hk=1, Hv=2, K=8, V=8) for _ in range(3)]
    full = attnx.MultiHeadAttention(d_model, 2, num_kv_heads=1, seed=40)
    return linear, full


def _hybrid_run(linear, full, cache, seqs, rows, counts):
    """One cache step for several sequences (their new rows packed in order): each linear layer
    advances the sequences' states, the full layer appends to and reads their paged KV."""
    step = cache.begin_step(seqs, counts)
    x = rows
    for li, lyr in enumerate(linear):
        o = step.linear(li, *lyr.inputs(x), qk_l2norm=True)
        x = x + o.reshape(x.shape[0], -1) @ lyr.W_o
    H, Hkv, D = full.num_heads, full.num_kv_heads, full.head_dim
    z = step.attend(
        0,
        (x @ full.W_Q).reshape(-1, H, D),
        (x @ full.W_K).reshape(-1, Hkv, D),
        (x @ full.W_V).reshape(-1, Hkv, D),
    )
    return x + z.reshape(x.shape[0], -1) @ full.W_O


def _hybrid_whole(linear, full, x):
    """The stack without a cache: every layer over the whole sentence at once."""
    for lyr in linear:
        q, k, v, g, beta = (a[None] for a in lyr.inputs(x))
        x = (
            x
            + attnx.gated_delta_rule(q, k, v, g, beta, qk_l2norm=True)[0].reshape(x.shape[0], -1)
            @ lyr.W_o
        )
    return x + full(x, causal=True)


def _hybrid_decode(linear, full, X1, X2, prompt):
    """Both sentences through one cache (a prefill of ``prompt`` tokens, then one token per
    step, together), printing what the cache holds per sequence as they grow; returns each
    sentence's outputs."""
    cache = attnx.PagedKVCache(
        num_layers=1,
        num_kv_heads=full.num_kv_heads,
        head_dim=full.head_dim,
        num_blocks=16,
        block_size=2,
        linear_layers=3,
        state_shape=(linear[0].Hv, linear[0].K, linear[0].V),
    )
    a, b = cache.new_sequence(), cache.new_sequence()
    per_token = cache.stats()["bytes_per_token"]
    print(
        f"{'tokens':>6} | linear layers: state bytes per sequence | full layer: KV bytes per sequence"
    )

    def show(n):
        print(f"{n:>6} | {cache.bytes_per_state:>39} | {per_token * n:>10}")

    outs = [
        _hybrid_run(
            linear,
            full,
            cache,
            [a, b],
            np.concatenate([X1[:prompt], X2[:prompt]]),
            [prompt, prompt],
        )
    ]
    show(prompt)
    for t in range(prompt, len(X1)):  # both sentences decode one token per step, together
        outs.append(_hybrid_run(linear, full, cache, [a, b], np.stack([X1[t], X2[t]]), [1, 1]))
        show(t + 1)
    show(32768)
    print("(the last row is what a 32k-token conversation would hold)")
    y1 = np.concatenate([outs[0][:prompt]] + [o[0:1] for o in outs[1:]])
    y2 = np.concatenate([outs[0][prompt:]] + [o[1:2] for o in outs[1:]])
    return y1, y2


def _hybrid_maps(linear, full, X1, s1, pics):
    """The attention map a linear layer implies, beside a softmax map."""
    A = linear[0].map(X1)
    q, k, v, g, beta = linear[0].inputs(X1)
    o = attnx.gated_delta_rule(q[None], k[None], v[None], g[None], beta[None], qk_l2norm=True)[0]
    assert np.allclose(np.einsum("hts,shv->thv", A, v), o, atol=1e-5)
    print(
        "\nlinear layer 1, head 1: o = A v with A from the recurrence on one-hot values, row 'bank':",
        fmt(A[0, -1], 2),
    )
    print(
        "causal (A[t, s] = 0 for s > t); unlike softmax, rows need not sum to 1 and weights can be "
        "negative (the delta rule subtracts what the state already predicts); older tokens fade "
        "by the product of their gates"
    )
    _, w = full(X1, causal=True, return_weights=True)
    pics.heads(
        "10_hybrid_linear_vs_softmax.png",
        [A[0], w[0]],
        s1,
        ["Delta-rule layer: A in o = A v (< 0 dark)", "Full attention: softmax"],
    )


HYBRID_SENTENCES = (
    ["the", "road", "curves", "along", "river", "bank"],
    ["she", "paid", "cash", "into", "her", "bank"],
)


def s10_hybrid(rng, pics):
    section("10  Hybrid models: gated delta-rule layers beside full attention")
    d_model = 16
    s1, s2 = HYBRID_SENTENCES
    words = list(dict.fromkeys(s1 + s2))  # each word once, in order of appearance
    table = {w: (0.5 * rng.standard_normal(d_model)).astype(F32) for w in words}
    X1, X2 = (np.stack([table[w] for w in s]) for s in (s1, s2))
    linear, full = _hybrid_stack(rng, d_model)
    print(
        "per linear layer and value head: S (K x V) <- exp(g_t) S;  u = beta_t (v_t - Sᵀ k_t);"
        "  S <- S + k_t uᵀ;  o_t = Sᵀ (scale q_t)"
    )
    prompt = 3
    y1, y2 = _hybrid_decode(linear, full, X1, X2, prompt)
    err = max(
        np.abs(y1 - _hybrid_whole(linear, full, X1)).max(),
        np.abs(y2 - _hybrid_whole(linear, full, X2)).max(),
    )
    print(
        f"prefill {prompt} tokens, then decode one at a time through the cache: max |diff| vs "
        f"the whole sentence at once = {err:.1e}"
    )
    assert err < 1e-4
    print(
        "a linear layer's state is 3 layers x Hv x K x V x 4 bytes whatever the length; the full "
        "layer's KV grows by layers x kv heads x (d_k + d_v) x 4 bytes per token. fork copies the "
        "states; truncate refuses to roll them back (only a fork kept as a checkpoint can)"
    )
    _hybrid_maps(linear, full, X1, s1, pics)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="walkthrough_out", help="folder for the PNG heatmaps")
    p.add_argument(
        "--sizes",
        default="256,512,1024,2048",
        help="sequence lengths for the n² cost section (comma separated)",
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    rng = np.random.default_rng(args.seed)
    pics = Pictures(args.out)
    t0 = time.perf_counter()
    s01_embeddings(rng, pics)
    s02_bottleneck(rng, pics)
    Q, K, V = s03_qkv(rng)
    s04_equation(Q, K, V)
    s05_stages(rng, pics)
    s06_masks(rng, pics)
    s07_two_heads(pics)
    s08_cost(rng, pics, [int(s) for s in args.sizes.split(",") if s])
    s08_kv_cache(rng)
    s08_variants(rng, pics)
    s09_summary()
    s10_hybrid(rng, pics)
    print(f"\ndone in {time.perf_counter() - t0:.1f} s; {len(pics.saved)} pictures in {args.out}/")
    return pics.saved


if __name__ == "__main__":
    main()
