"""Every benchmark case declared once: its shape, the work it does (FLOPs or bytes, from the
shape), the limit that work is measured against, and its target. The table's target and met?
columns, the JSON and the plot are all made from these declarations.

The fixed suite (``suite``), one user-chosen shape (``custom``) and a Hugging Face model's
prefill and decode (``from_config``) are built from the same two shapes, ``Dense`` and ``Paged``."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace

import numpy as np

import attnx

from ._machine import LIMITS, GiB, MiB, read_gbps

DTYPES = {"fp32": 4, "fp16": 2, "bf16": 2, "int8": 1, "fp8": 1}
# quantised KV (paged rows only): 1-byte codes plus one float32 scale per (token, kv head) row
QUANTISED = {"int8": "int8", "fp8": "float8_e4m3fn"}
SCALE_BYTES = 4


def kv_row_bytes(dtype, D):
    """Bytes of one (token, kv head) row of K or V in pages of ``dtype``, its scale included."""
    return D * DTYPES[dtype] + (SCALE_BYTES if dtype in QUANTISED else 0)


def np_dtype(name):
    if name in QUANTISED:
        from .. import reference

        return reference.quantised_dtype(QUANTISED[name])
    if name == "bf16":
        from ml_dtypes import bfloat16

        return np.dtype(bfloat16)
    return np.dtype({"fp32": np.float32, "fp16": np.float16}[name])


def visible_range(Sq, Sk, causal, window, kv_len=None):
    """First and last key each query row sees, as arrays over the rows (``hi < lo``: none).
    Causal masks are aligned bottom-right (row i is position i + Sk - Sq); ``window`` is the
    number of keys a row sees, itself included (Hugging Face's ``sliding_window``)."""
    pos = np.arange(Sq, dtype=np.int64) + (Sk - Sq)
    hi = np.minimum(pos, Sk - 1) if causal else np.full(Sq, Sk - 1, np.int64)
    lo = np.maximum(pos - (window - 1), 0) if window else np.zeros(Sq, np.int64)
    if kv_len is not None:
        hi = np.minimum(hi, kv_len - 1)
    return lo, hi


def _visible_keys(Sq, Sk, causal, window, kv_len=None):
    lo, hi = visible_range(Sq, Sk, causal, window, kv_len)
    return float(np.maximum(hi - lo + 1, 0).sum())


def _heads(Hq, Hkv):
    return {"H": Hq} if Hq == Hkv else {"Hq": Hq, "Hkv": Hkv}


def _dims(**kw):
    return " ".join(f"{k}{v}" for k, v in kw.items())


@dataclass(frozen=True)
class Dense:
    """``attnx.attention`` on contiguous (B, H, S, D) arrays. One query row (Sq == 1) is a decode
    step and is counted in bytes of K and V read; otherwise in FLOPs. ``precision``: what
    ``attnx.set_float32_precision`` is set to for attnx's call."""

    B: int
    Hq: int
    Hkv: int
    Sq: int
    Sk: int
    D: int
    causal: bool = False
    window: int | None = None
    kv_lens: tuple | None = None
    dtype: str = "fp32"
    precision: str = "float32"

    @property
    def kind(self):
        return "bytes" if self.Sq == 1 else "flops"

    def keys_seen(self):
        """Σ over batches and query rows of the keys each row sees."""
        lens = self.kv_lens or (None,) * self.B
        return sum(_visible_keys(self.Sq, self.Sk, self.causal, self.window, n) for n in lens)

    def work(self):
        if self.kind == "bytes":  # K and V rows each KV head reads once for all its query heads
            return 2.0 * self.Hkv * self.D * DTYPES[self.dtype] * self.keys_seen()
        return 4.0 * self.Hq * self.D * self.keys_seen()

    def cut(self, B=None, S=None):
        """The same shape on the first B batches and S positions (the reference's smaller run)."""
        B = min(B or self.B, self.B)
        S = min(S or self.Sk, self.Sk)
        return replace(
            self,
            B=B,
            Sk=S,
            Sq=1 if self.Sq == 1 else S,
            kv_lens=None if self.kv_lens is None else tuple(min(n, S) for n in self.kv_lens[:B]),
        )

    def describe(self):
        seq = {"S": self.Sk} if self.Sq == self.Sk else {"Sq": self.Sq, "Sk": self.Sk}
        text = _dims(B=self.B, **_heads(self.Hq, self.Hkv), **seq, D=self.D)
        if self.causal and self.Sq > 1:
            text += " causal"
        if self.window:
            text += f" window{self.window}"
        if self.kv_lens:
            text += f" kv_lens∈[{min(self.kv_lens)},{max(self.kv_lens)}]"
        if self.precision != "float32":
            text += f" on {self.precision} products"
        return text + ("" if self.dtype == "fp32" else f" {self.dtype}")


@dataclass(frozen=True)
class Paged:
    """``attnx.paged_attention``: one decode token per sequence against L cached tokens in pages
    of ``block`` tokens, scrambled through the block table. Counted in bytes of K and V read.
    With ``shared``, the sequences are forks of one prompt: their first ``shared`` tokens (whole
    blocks) are the same blocks, which need reading once (the bytes counted). ``int8_query``:
    int8 pages read with ``attnx.set_int8_query(int8_query)`` (None: the default)."""

    B: int
    Hq: int
    Hkv: int
    L: int
    D: int
    block: int = 16
    dtype: str = "fp32"
    window: int | None = None
    shared: int = 0
    int8_query: bool | None = None
    kind = "bytes"
    causal = True  # the new token is the last position: it sees every cached one

    def keys_seen(self):
        return self.B * min(self.L, self.window or self.L) - (self.B - 1) * min(self.shared, self.L)

    def flops(self):
        """Multiply-adds of the scores and the weighted sum, 2 each: the same shared or not."""
        return 4.0 * self.Hq * self.D * self.B * min(self.L, self.window or self.L)

    def work(self):
        return 2.0 * self.Hkv * kv_row_bytes(self.dtype, self.D) * self.keys_seen()

    def cut(self, B=None, S=None):
        L = min(S or self.L, self.L)
        return replace(self, B=min(B or self.B, self.B), L=L, shared=min(self.shared, L - 1))

    def describe(self):
        return (
            _dims(B=self.B, Hq=self.Hq, Hkv=self.Hkv, L=self.L, D=self.D)
            + f" block{self.block} {self.dtype} KV"
            + (f" window{self.window}" if self.window else "")
            + (f", {self.B} forks sharing {self.shared}" if self.shared else "")
            + (f", {self.query_kind()}" if self.dtype == "int8" else "")
        )

    def integer_query(self):
        """Whether attnx reads this shape's int8 pages with integer queries."""
        return attnx.int8_query() if self.int8_query is None else self.int8_query

    def query_kind(self):
        return "integer query" if self.integer_query() else "float query"


@dataclass(frozen=True)
class Chunk(Paged):
    """A chunked prefill through ``attnx.paged_attention``: ``new`` query tokens per sequence,
    the last ``new`` of its L positions (causal), against its L tokens in pages. Counted in FLOPs
    (every query sees the L - new earlier tokens and the new ones up to itself)."""

    new: int = 512
    kind = "flops"

    def flops(self):
        seen = self.new * (self.L - self.new) + self.new * (self.new + 1) / 2
        return 4.0 * self.Hq * self.D * self.B * seen

    def work(self):
        return self.flops()

    def cut(self, B=None, S=None):
        return replace(self, B=min(B or self.B, self.B))

    def describe(self):
        return (
            _dims(B=self.B, Hq=self.Hq, Hkv=self.Hkv, L=self.L, D=self.D)
            + f", {self.new} new tokens, block{self.block} {self.dtype} KV"
        )


@dataclass(frozen=True)
class Delta:
    """``attnx.gated_delta_rule`` (qk_l2norm, gates per head or per channel) over B sequences of T
    tokens. Prefill (T > 1) is counted in the recurrence's FLOPs: per token and value head Sᵀk,
    k uᵀ and Sᵀq, 2·K·V each, which is also exactly what the chunked form's products with the
    state cost (not counted: its 2·C·(K+V) more per token in the chunk's own matrices, a twelfth
    at K = V = 128 with C = 16 tokens per chunk, nor the recurrence's decay of S). Decode
    (T == 1) is counted in bytes of the float32 state read and written once."""

    B: int
    T: int
    Hk: int
    Hv: int
    K: int
    V: int
    gate: str = "head"  # or "channel" (Kimi Delta Attention)
    dtype: str = "fp32"
    causal = True

    @property
    def kind(self):
        return "bytes" if self.T == 1 else "flops"

    def work(self):
        if self.kind == "bytes":
            return 2.0 * 4 * self.B * self.Hv * self.K * self.V
        return 6.0 * self.B * self.T * self.Hv * self.K * self.V

    def cut(self, B=None, S=None):
        return replace(self, B=min(B or self.B, self.B), T=min(S or self.T, self.T))

    def describe(self):
        heads = {"H": self.Hv} if self.Hk == self.Hv else {"Hk": self.Hk, "Hv": self.Hv}
        return (
            _dims(B=self.B, T=self.T, **heads, K=self.K, V=self.V)
            + f" gate/{self.gate}"
            + ("" if self.dtype == "fp32" else f" {self.dtype}")
        )


# ---- targets ---------------------------------------------------------------------------------
# A goal names what it measures, the bound, and how it reads in the table. `value` gets the row
# (see _suite.Row) and the rows measured so far by key; None means it could not be measured.


@dataclass(frozen=True)
class PctOfLimit:
    pct: float

    def text(self, row):
        return f"≥ {self.pct:g}% {LIMITS[row.spec.shape.kind][1]}"

    def value(self, row, rows):
        return row.pct_of_limit

    def ok(self, v):
        return v >= self.pct

    def show(self, v, row):
        return f"{v:.0f}% {'peak' if row.kind == 'flops' else 'BW'}"


@dataclass(frozen=True)
class FasterThan:
    peer: str
    x: float
    how: str = ""  # how the peer runs the same work, e.g. "(enable_gqa)"

    def text(self, row):
        return f"≥ {self.x:g}× {self.peer}" + (f" {self.how}" if self.how else "")

    def value(self, row, rows):
        return row.vs.get(self.peer)

    def ok(self, v):
        return v >= self.x

    def show(self, v, row):
        return f"{v:.2f}× {self.peer}" if v is not None else f"{self.peer} n/a"


@dataclass(frozen=True)
class TokensOver:
    base: str  # key of the row whose tokens/s this one is compared with
    x: float
    label: str = "fp32"  # the base row's KV dtype, as the table names it
    bounded: bool = False  # show the machine's bound on the ratio (``tokens_bound``)

    def text(self, row):
        return f"≥ {self.x:g}× {self.label} tokens/s"

    def value(self, row, rows):
        base = rows.get(self.base)
        if base is None or not base.attnx_s or not row.attnx_s:
            return None
        ratio = (row.spec.shape.B / row.attnx_s) / (base.spec.shape.B / base.attnx_s)
        row.extra[f"tokens_per_s_vs_{self.label}"] = ratio
        return ratio

    def ok(self, v):
        return v >= self.x

    def show(self, v, row):
        if v is None:
            return f"{self.label} row n/a"
        bound = row.extra.get(f"bound_vs_{self.label}")
        return f"{v:.2f}× {self.label} tokens/s" + (f" (bound {bound:.1f}×)" if bound else "")


@dataclass(frozen=True)
class RateOver:
    """This row's rate over another row's in the same run (bf16 prefill over the fp32 prefill of
    the same shape: GFLOP/s counts the same FLOPs whatever the dtype). The suite also times the
    base's call interleaved with this row's, sample by sample: rows minutes apart swing with the
    host by more than the target's margin. That ratio is the one judged; the base row's own is
    the fallback. The base call is the same shape on float32 inputs, or with ``widen`` this row's
    own inputs widened to float32 in the call (issue 33's rule: a dtype's path against widening)."""

    base: str
    x: float
    label: str
    widen: bool = False  # the interleaved base widens this row's own inputs (attnx_widened)

    def text(self, row):
        return f"≥ {self.x:g}× {self.label}" + ("" if self.widen else f" {row.rate_unit}")

    def value(self, row, rows):
        if row.attnx_s and row.extra.get("base_interleaved_s"):
            return row.extra["base_interleaved_s"] / row.attnx_s
        base = rows.get(self.base)
        if base is None or not base.rate or not row.rate:
            return None
        return row.rate / base.rate

    def ok(self, v):
        return v >= self.x

    def show(self, v, row):
        return f"{v:.2f}× {self.label}" if v is not None else f"{self.label} row n/a"


@dataclass(frozen=True)
class OverPath:
    """This row's attnx call over the same call on another kernel path (``isa``: the vector path
    that a matrix engine replaces), timed interleaved with it sample by sample. None where that
    path or the row's own is not this CPU's (nothing to compare)."""

    isa: str
    x: float
    label: str

    def text(self, row):
        return f"≥ {self.x:g}× {self.label}"

    def value(self, row, rows):
        base = row.extra.get("path_interleaved_s")
        return base / row.attnx_s if base and row.attnx_s else None

    def ok(self, v):
        return v >= self.x

    def show(self, v, row):
        return f"{v:.2f}× {self.label}"


@dataclass(frozen=True)
class AtMostLatency:
    seconds: float

    def text(self, row):
        return f"≤ {self.seconds * 1e6:g} µs per call"

    def value(self, row, rows):
        return row.attnx_s

    def ok(self, v):
        return v <= self.seconds

    def show(self, v, row):
        return f"{v * 1e6:.1f} µs"


@dataclass(frozen=True)
class ThreadScaling:
    frac: float  # of the thread count

    def text(self, row):
        n = row.extra.get("threads", 0)
        return f"{n} threads ≥ {self.frac * n:.1f}× 1 thread"

    def value(self, row, rows):
        return row.extra.get("speedup")

    def ok(self, v):
        return None  # judged in `judge`, which knows the thread count

    def show(self, v, row):
        return f"{v:.2f}×"


@dataclass(frozen=True)
class PeakMemory:
    """Peak RSS growth of one call within max(4× its inputs and outputs, 64 MiB): O(S·D)."""

    def text(self, row):
        return "peak O(S·D), not O(S²)"

    def value(self, row, rows):
        return row.extra.get("rss_growth_bytes")

    def ok(self, v):
        return None  # judged in `judge`, which knows the allowance

    def show(self, v, row):
        return f"+{v / MiB:.1f} MiB vs {row.extra['score_matrix_bytes'] / GiB:.2g} GiB"


@dataclass(frozen=True)
class InLoop:
    """attnx right after another library's matmul (as in a model's loop) vs the same call alone."""

    x: float

    def text(self, row):
        return f"≤ {self.x:g}× its time alone"

    def value(self, row, rows):
        return row.extra.get("slowdown")

    def ok(self, v):
        return v <= self.x

    def show(self, v, row):
        return f"{v:.2f}× alone"


@dataclass(frozen=True)
class OverRow:
    """This row's speed over another row's (the same work without sharing), with the bound the
    machine's limits allow (see ``shared_bound``). ``x`` None: reported, not judged."""

    base: str
    x: float | None = None

    def text(self, row):
        return f"≥ {self.x:g}× unshared" if self.x else "report × unshared and its bound"

    def value(self, row, rows):
        base = rows.get(self.base)
        if base is None or not base.attnx_s or not row.attnx_s:
            return None
        return base.attnx_s / row.attnx_s

    def ok(self, v):
        return True if self.x is None else v >= self.x

    def show(self, v, row):
        bound = row.extra.get("bound_vs_unshared")
        text = f"{v:.2f}× unshared" if v is not None else "unshared row n/a"
        return text + (f" (bound {bound:.1f}×)" if bound else "")


def least_seconds(shape, limits):
    """The roofline floor of a paged step on this machine: the longer of its bytes over the read
    bandwidth at their size and its FLOPs (float32 multiply-adds) over the FMA peak."""
    bw, peak = read_gbps(limits, shape.work())[0] * 1e9, limits["fma_gflops_all"] * 1e9
    return max(shape.work() / bw, shape.flops() / peak)


def shared_bound(shape, unshared, limits):
    """The most a shared-prefix step can gain over the unshared one on this machine: sharing cuts
    only the bytes, never the FLOPs (GQA decode is the nearer to the FLOP bound)."""
    return least_seconds(unshared, limits) / least_seconds(shape, limits)


def tokens_bound(shape, base_row, limits):
    """The most a row of ``shape`` can gain in tokens/s over ``base_row`` as measured in this run,
    were it at its roofline floor. Quantised KV halves the bytes again but never the FLOPs: with
    a GQA group of 4 a decode step does 8 FLOPs per element read, so where the FMA peak over the
    read bandwidth is near that, fp16 is already at the ridge and int8's floor is its FLOPs."""
    if not base_row.attnx_s:
        return None
    return base_row.attnx_s / least_seconds(shape, limits) * shape.B / base_row.spec.shape.B


def _goal_met(goal, v, row):
    if isinstance(goal, ThreadScaling):
        return v >= goal.frac * row.extra["threads"]
    if isinstance(goal, PeakMemory):
        return v <= row.extra["allowed_bytes"]
    return goal.ok(v)


def judge(row, rows):
    """The met? column from the row's declared goals: yes / NO / ? (a peer to compare with is
    missing) followed by what was measured. A row without goals gets "—"."""
    goals = row.spec.goals
    if not goals:
        row.met, row.met_text = None, "—"
        return
    parts, ok, unknown = [], True, False
    for goal in goals:
        v = goal.value(row, rows)
        parts.append(
            goal.show(v, row)
            if v is not None or isinstance(goal, (FasterThan, TokensOver, RateOver))
            else "n/a"
        )
        if v is None:
            unknown = True
        else:
            ok &= bool(_goal_met(goal, v, row))
    row.met = None if ok and unknown else ok
    row.met_text = ("NO" if not ok else "?" if unknown else "yes") + ": " + ", ".join(parts)


def target_text(row):
    return "; ".join(g.text(row) for g in row.spec.goals) or "—"


# ---- cases -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One row of the table. ``ref`` cuts the shape for the NumPy reference (``Dense.cut``
    arguments; None: no reference), which runs ``ref_samples`` times; its time is scaled by the
    ratio of the work. ``kind`` is the shape's (flops / bytes) unless this row measures something
    else (latency, threads, memory)."""

    key: str
    name: str
    shape: Dense | Paged | Delta
    goals: tuple = ()
    ref: dict | None = field(default_factory=dict)
    ref_samples: int = 1
    seed: int = 0
    kind: str = ""
    before: str = ""  # in-loop rows: the library whose matmul runs right before each attnx call
    isa: str = ""  # the kernel paths ("a|b") the row is about: the bench notes when another runs it

    @property
    def row_kind(self):
        return self.kind or self.shape.kind


def _padding_lens(B, S, seed):
    """kv_lens of an encoder batch padded to S: uniform in [S/2, S]."""
    rng = np.random.default_rng(1234 + seed)
    return tuple(int(n) for n in rng.integers(S // 2, S, size=B, endpoint=True))


def suite(*, tiny, quick, threads, repeat):
    """The fixed suite and the issue's targets. ``tiny`` shrinks every shape (smoke tests: the
    numbers then mean nothing); ``quick`` scales the reference down further."""
    big = not tiny
    S_pre, S_gqa, S_enc, L_dec, L_long = (
        (2048, 2048, 512, 2048, 32768) if big else (256, 256, 128, 256, 2048)
    )
    H_pre, B_enc, H_enc = (8, 4, 12) if big else (2, 2, 2)
    Hq, Hkv, B_dec = (32, 8, 8) if big else (8, 2, 2)
    q_big = quick and big
    decode = Paged(B_dec, Hq, Hkv, L_dec, 128)
    cases = _prefill(S_pre, H_pre, S_gqa, Hq, Hkv, tiny=tiny, quick=quick)
    cases += bf16_prefill(S_pre, H_pre, S_gqa, Hq, Hkv, tiny=tiny, quick=quick)
    cases += [fp16_prefill(S_pre, H_pre, tiny=tiny, quick=quick)]
    cases += [_encoder(B_enc, H_enc, S_enc, quick)]
    cases += _decode(decode, {"B": 2 if q_big else B_dec}, quick)
    cases += forks(big=big, quick=quick)
    cases += _long_decode(
        Paged(1, Hq, Hkv, L_long, 128), {"S": L_long // (8 if q_big else 1)}, quick
    )
    cases += _call_costs(S_pre, H_pre, big=big, repeat=repeat)
    return cases + delta_cases(tiny=tiny, quick=quick)


def _prefill(S_pre, H_pre, S_gqa, Hq, Hkv, *, tiny, quick):
    """The float32 prefill rows: multi-head and causal GQA."""
    q_big = quick and not tiny
    return [
        Case(
            "prefill",
            "prefill",
            Dense(1, H_pre, H_pre, S_pre, S_pre, 64),
            (PctOfLimit(70), FasterThan("torch", 1.5)),
            {"S": S_pre // (4 if q_big else 1)},
            seed=1,
        ),
        Case(
            "gqa_causal",
            "causal GQA prefill",
            Dense(1, Hq, Hkv, S_gqa, S_gqa, 128, causal=True),
            (FasterThan("torch", 1.5, "(enable_gqa)"),),
            {"S": S_gqa // (1 if tiny else 8 if quick else 2)},
            seed=2,
        ),
    ]


def _encoder(B_enc, H_enc, S_enc, quick):
    """The encoder row: a batch padded to one length, keys masked by kv_lens."""
    return Case(
        "encoder",
        "encoder batch with padding",
        Dense(B_enc, H_enc, H_enc, S_enc, S_enc, 64, kv_lens=_padding_lens(B_enc, S_enc, 3)),
        (FasterThan("torch", 1.5, "(boolean mask)"),),
        {"B": 1 if quick else B_enc},
        ref_samples=1 if quick else 2,
        seed=3,
    )


def _call_costs(S_pre, H_pre, *, big, repeat):
    """The rows about a call's costs: a small call's latency, thread scaling, peak memory."""
    return [
        Case(
            "small",
            "small call",
            Dense(1, 1, 1, 1, 16, 64),
            (AtMostLatency(5e-6),),
            ref_samples=repeat,
            seed=7,
            kind="latency",
        ),
        Case(
            "threads",
            "threads",
            Dense(1, H_pre, H_pre, S_pre, S_pre, 64),
            (ThreadScaling(0.9),),
            None,
            seed=1,
            kind="threads",
        ),
        Case(
            "memory",
            "memory",
            Dense(1, 1, 1, 32768 if big else 2048, 32768 if big else 2048, 64),
            (PeakMemory(),),
            None,
            kind="memory",
        ),
    ]


def _decode(decode, ref, quick):
    """The paged decode rows: float32, fp16 and bf16 KV, and the quantised ones."""
    cases = [
        Case(
            "decode_f32",
            "paged decode",
            decode,
            (PctOfLimit(80), FasterThan("torch", 4.0)),
            ref,
            ref_samples=1 if quick else 3,
            seed=4,
        )
    ]
    for dt in ("fp16", "bf16"):
        cases.append(
            Case(
                f"decode_{dt}",
                f"paged decode {dt} KV",
                replace(decode, dtype=dt),
                (TokensOver("decode_f32", 1.7),),
                ref,
                ref_samples=1 if quick else 3,
                seed=4,
            )
        )
    return cases + _quantised_decode(
        "decode", "decode_f32", "decode_fp16", "paged decode", decode, ref, quick, 4
    )


def _long_decode(long, long_ref, quick):
    """The long-context decode rows: float32, fp16 KV and the quantised ones."""
    cases = [
        Case(
            "decode_long",
            "long-context decode",
            long,
            (PctOfLimit(80),),
            long_ref,
            ref_samples=1 if quick else 3,
            seed=5,
        ),
        Case(
            "decode_long_fp16",
            "long-context decode fp16 KV",
            replace(long, dtype="fp16"),
            (TokensOver("decode_long", 1.7),),
            long_ref,
            ref_samples=1 if quick else 3,
            seed=5,
        ),
    ]
    return cases + _quantised_decode(
        "decode_long",
        "decode_long",
        "decode_long_fp16",
        "long-context decode",
        long,
        long_ref,
        quick,
        5,
    )


def bf16_prefill(S_pre, H_pre, S_gqa, Hq, Hkv, *, tiny, quick):
    """bf16 prefill (issues 13 and 33): three shapes in bf16 against torch's bf16 SDPA and the
    same shape in fp32 in the same rounds, and a chunked prefill over bf16 pages against the
    vector path. The targets follow the path the CPU runs: with AMX tiles, >= 4x our fp32 and
    >= 1.5x torch (which uses them too); elsewhere the dispatch rule, bf16 never slower than
    widening to fp32 (>= 1.0x), and >= 1.0x torch."""
    from .. import cpu_features

    amx = cpu_features()["isa"] == "amx"
    over_torch = 1.5 if amx else 1.0

    def over_fp32(base, label):  # 4x our float32 on tiles, else the rule against widening
        return RateOver(base, 4.0, label) if amx else widening(base)

    S_long = 4096 if not tiny else 256
    cut = 1 if tiny else 8 if quick else 2
    cases = [
        Case(
            "prefill_bf16",
            "prefill bf16",
            Dense(1, H_pre, H_pre, S_pre, S_pre, 64, dtype="bf16"),
            (
                over_fp32("prefill", "fp32 prefill"),
                FasterThan("torch", over_torch, "(bf16)"),
            ),
            {"S": S_pre // (8 if quick and not tiny else 2)},
            seed=1,
            isa=BF16_PRODUCTS,
        ),
        Case(
            "gqa_causal_bf16",
            "causal GQA prefill bf16",
            Dense(1, Hq, Hkv, S_gqa, S_gqa, 128, causal=True, dtype="bf16"),
            (
                over_fp32("gqa_causal", "fp32 GQA prefill"),
                FasterThan("torch", over_torch, "(bf16, enable_gqa)"),
            ),
            {"S": S_gqa // cut},
            seed=2,
            isa=BF16_PRODUCTS,
        ),
        Case(
            "causal_bf16",
            "causal prefill bf16",
            Dense(1, 16, 16, S_long, S_long, 128, causal=True, dtype="bf16"),
            (
                over_fp32("causal_bf16", "fp32 prefill"),
                FasterThan("torch", over_torch, "(bf16)"),
            ),
            {"S": S_long // (4 * cut)},
            seed=8,
            isa=BF16_PRODUCTS,
        ),
    ]
    if amx:  # the chunked prefill's own target is against the vector path AMX replaces
        cases.append(_chunk_bf16(Hq, Hkv, tiny))
    return cases + [_fp32_on_bf16(S_pre, H_pre, 3.0 if amx else 1.0, quick and not tiny)]


def _fp32_on_bf16(S_pre, H_pre, over_fp32, q_big):
    """float32 prefill under ``attnx.set_float32_precision("bf16")`` (issue 33, item 4): the
    prefill row's shape, against it in the same rounds."""
    return Case(
        "prefill_fp32_bf16",
        "prefill fp32, bf16 products",
        Dense(1, H_pre, H_pre, S_pre, S_pre, 64, precision="bf16"),
        (RateOver("prefill", over_fp32, "fp32 prefill"),),
        {"S": S_pre // (8 if q_big else 2)},
        seed=1,
        isa=BF16_PRODUCTS,
    )


def _chunk_bf16(Hq, Hkv, tiny):
    """The chunked prefill over bf16 pages, against the vector path (an AMX row)."""
    L = 4096 if not tiny else 512
    return Case(
        "chunk_bf16",
        "chunked prefill bf16 KV",
        Chunk(1, Hq, Hkv, L, 128, dtype="bf16", new=512 if not tiny else 64),
        (OverPath("avx512", 3.0, "the vector path"),),
        None,
        seed=9,
        isa=BF16_PRODUCTS,
    )


def fp16_prefill(S_pre, H_pre, *, tiny, quick):
    """fp16 prefill (issue 33's rule for every dtype: never slower than widening to fp32): the
    prefill row's shape in fp16, against it in fp32 in the same rounds. No path multiplies in
    fp16 (none of the CPUs here has AMX-FP16), so fp16 q, k and v widen inside the float32
    kernels on every path; the row checks that this costs nothing."""
    return Case(
        "prefill_fp16",
        "prefill fp16",
        Dense(1, H_pre, H_pre, S_pre, S_pre, 64, dtype="fp16"),
        (widening("prefill"),),
        {"S": S_pre // (8 if quick and not tiny else 2)},
        seed=1,
    )


def widening(base):
    """Issue 33's rule for a 16-bit dtype: its row against its own inputs widened to float32
    (``base``: the float32 row of the same shape, the fallback where nothing was interleaved)."""
    return RateOver(base, 1.0, "widening to fp32", widen=True)


# The paths that compute bf16 prefill with bf16 products: the bf16 rows are about them.
BF16_PRODUCTS = "amx|avx512bf16|neon-bf16"


def isa_note(isa):
    """Why none of the kernel paths ``isa`` ("a|b") is the one running (None when one is)."""
    from .. import _core, cpu_features

    f = cpu_features()
    if f["isa"] in isa.split("|"):
        return None
    if isa == BF16_PRODUCTS and not f.get("amx_permitted"):
        if not (f.get("avx512bf16") and f.get("avx512bw") and f.get("avx512vl")):
            return "CPU lacks AVX512_BF16, AMX and ARM BF16: bf16 runs on the fp32-widening kernels"
        gain = _core.bf16_dot_gain()
        if f["isa"] in ("avx512", "avx512vnni") and gain <= _core.BF16_DOT_GAIN_LINE:
            return (
                f"bf16 runs on the fp32-widening kernels: this CPU's bf16 dot products give "
                f"{gain:.2f}x the multiply-adds/s of fp32 FMAs (no AMX)"
            )
    return f"{isa} not active (ATTNX_ISA forced {f['isa']})"


def delta_cases(*, tiny, quick):
    """Gated delta rule (issue 16): chunked prefill against a torch loop over t running the same
    recurrence, and one decode token per sequence from its state."""
    T, (Hk, Hv), KV = (4096, (4, 8), 128) if not tiny else (256, (1, 2), 32)
    return [
        Case(
            "delta_prefill",
            "gated delta rule prefill",
            Delta(1, T, Hk, Hv, KV, KV),
            (PctOfLimit(40), FasterThan("torch", 10, "(loop over t)")),
            {"S": T // (32 if quick else 8)},
            seed=12,
        ),
        Case(
            "delta_decode",
            "gated delta rule decode",
            Delta(8 if not tiny else 2, 1, 2 * Hk, 2 * Hv, KV, KV),
            (FasterThan("torch", 2, "(the same step)"),),
            {"B": 2},
            ref_samples=1 if quick else 3,
            seed=13,
        ),
    ]


def forks(*, big, quick):
    """Issue 14's rows: B samples forked from one prompt, one decode step each, against the same
    step over B unshared copies of the prompt (MHA, then GQA)."""
    B, P = (16, 4096) if big else (4, 256)
    cases = []
    for name, (hq, hkv), goal in (("mha", (8, 8), 4.0), ("gqa", (32, 8), None)):
        copies = Paged(B, hq, hkv, P + 1, 128, dtype="fp16")
        ref = {"B": 1 if quick else 2}
        cases += [
            Case(
                f"fork_{name}_unshared",
                f"{B} unshared copies ({name.upper()})",
                copies,
                (PctOfLimit(80),),
                ref,
                seed=8,
            ),
            Case(
                f"fork_{name}",
                f"{B} forks, shared prefix ({name.upper()})",
                replace(copies, shared=P),
                (OverRow(f"fork_{name}_unshared", goal),),
                ref,
                seed=8,
            ),
        ]
    return cases


def _quantised_decode(key, f32_key, f16_key, name, shape, ref, quick, seed):
    """int8 and fp8 (e4m3) KV rows of a decode shape (issue 13; int8 with the default query,
    integer where the path has integer products: issue 33, item 3), and int8 with the float query
    (``attnx.set_int8_query(False)``): tokens/s against the fp16 and fp32 KV rows of the same
    shape, in the same run; bytes read count the scales."""
    kinds = [(dt, replace(shape, dtype=dt)) for dt in QUANTISED]
    kinds.append(("int8fq", replace(shape, dtype="int8", int8_query=False)))
    return [
        Case(
            f"{key}_{kind}",
            f"{name} {sh.dtype} KV" + (f", {sh.query_kind()}" if sh.dtype == "int8" else ""),
            sh,
            (
                TokensOver(f16_key, 1.8, "fp16", bounded=True),
                TokensOver(f32_key, 3.5, bounded=True),
            ),
            ref,
            ref_samples=1 if quick else 3,
            seed=seed,
        )
        for kind, sh in kinds
    ]


def in_loop(*, tiny):
    """Opt-in rows (--in-loop): the prefill shape timed right after a 1024×1024 matmul of NumPy
    (OpenBLAS) or torch, as a model's loop calls attention, against the same call alone. The torch
    row passes tensors, as a torch model does, so attnx runs on torch's team from then on: these
    rows come last in the suite."""
    S, H = (2048, 8) if not tiny else (256, 2)
    shape = Dense(1, H, H, S, S, 64)
    return [
        Case(
            f"in_loop_{lib}",
            f"in-loop: prefill after a {name} matmul",
            shape,
            (InLoop(1.1),),
            None,
            seed=1,
            kind="in_loop",
            before=lib,
        )
        for lib, name in (("numpy", "NumPy"), ("torch", "torch"))
    ]


# ---- your own model --------------------------------------------------------------------------

# the NumPy reference runs on at most this much work (FLOPs / bytes) and is extrapolated beyond
REF_BUDGET = {"flops": 4e9, "bytes": 4e8}


def auto_ref(shape, quick):
    """A cut of ``shape`` small enough for the reference: fewer batches first, then positions."""
    budget = REF_BUDGET[shape.kind] / (4 if quick else 1)
    B = shape.B
    while B > 1 and shape.cut(B=B).work() > budget:
        B //= 2
    S = shape.Sk if isinstance(shape, Dense) else shape.L
    while S > 16 and shape.cut(B=B, S=S).work() > budget:
        S //= 2
    return {"B": B, "S": S}


def parse_heads(text):
    """``"32:8"`` -> (32, 8); ``"12"`` -> (12, 12)."""
    try:
        parts = [int(x) for x in str(text).split(":")]
    except ValueError:
        parts = []
    if len(parts) not in (1, 2) or min(parts) < 1 or parts[0] % parts[-1]:
        raise ValueError(
            f"--heads: expected HQ:HKV with HQ a multiple of HKV (or one H), got {text!r}"
        )
    return parts[0], parts[-1]


CASES = ("prefill", "decode", "paged-decode")


def custom(
    case,
    *,
    batch,
    heads,
    seqs,
    contexts,
    head_dim,
    kv_dtype,
    block,
    window,
    causal,
    quick,
    label="",
):
    """Rows for one user-chosen shape: ``case`` at every length of ``seqs`` (prefill: S) or
    ``contexts`` (decode, paged-decode: L). No targets: the table shows rates and ratios."""
    Hq, Hkv = heads
    if kv_dtype in QUANTISED and case != "paged-decode":
        raise ValueError(
            f"--kv-dtype {kv_dtype}: quantised keys and values live in a paged cache; "
            f"use --case paged-decode (got --case {case})"
        )
    lens = seqs if case == "prefill" else contexts
    rows = []
    for n in lens:
        if case == "prefill":
            shape = Dense(
                batch, Hq, Hkv, n, n, head_dim, causal=causal, window=window, dtype=kv_dtype
            )
        elif case == "decode":
            shape = Dense(
                batch, Hq, Hkv, 1, n, head_dim, causal=True, window=window, dtype=kv_dtype
            )
        else:
            shape = Paged(batch, Hq, Hkv, n, head_dim, block=block, dtype=kv_dtype, window=window)
        name = (f"{label} " if label else "") + f"{case} {'S' if case == 'prefill' else 'L'}={n}"
        rows.append(
            Case(
                f"{case}_{n}".replace("-", "_"),
                name,
                shape,
                (),
                auto_ref(shape, quick),
                ref_samples=1 if quick else 2,
                seed=11,
            )
        )
    return rows


def load_config(path):
    """The settings of a Hugging Face ``config.json`` that hold the language model (multimodal
    configs keep it under ``text_config``), as a dict; its fields are checked by the CLI
    (``attnx.__main__._model``)."""
    try:
        with open(path) as f:
            cfg = json.load(f)
    except (OSError, ValueError, RecursionError) as e:
        raise ValueError(f"--config: cannot read {path}: {e}") from None
    cfg = cfg.get("text_config", cfg) if isinstance(cfg, dict) else cfg
    if not isinstance(cfg, dict):
        raise ValueError(f"--config: {path} holds no JSON object (not a model config?)")
    return cfg


def from_config(m, *, batch, seqs, contexts, kv_dtype, block, quick):
    """A model's causal prefill at every --seq and paged decode at every --context; ``m``: its
    name, heads (Hq, Hkv), head_dim and window, checked (``attnx.__main__._model``)."""
    common = dict(
        batch=batch,
        heads=m["heads"],
        seqs=seqs,
        contexts=contexts,
        head_dim=m["head_dim"],
        block=block,
        window=m["window"],
        causal=True,
        quick=quick,
        label=m["name"],
    )
    prefill_dtype = "fp32" if kv_dtype in QUANTISED else kv_dtype  # quantised KV: pages only
    return custom("prefill", kv_dtype=prefill_dtype, **common) + custom(
        "paged-decode", kv_dtype=kv_dtype, **common
    )
