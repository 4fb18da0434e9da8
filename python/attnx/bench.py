"""The side-by-side benchmark behind ``python -m attnx bench``: this machine's limits, then a fixed
suite of shapes through attnx, the NumPy reference and torch's SDPA, interleaved in one run.

Why interleaved: the machines are shared and noisy, so each repetition times every implementation
once, in a rotating order, and the table reports medians; ratios measured together are what count.
The NumPy reference computes in float64 and is slow: on big rows it runs once on a scaled-down
shape and its time is extrapolated by the amount of work (FLOPs or bytes), which the table marks
with ``~``. Only the standard library, NumPy and attnx are imported up front; torch and matplotlib
are optional and imported when used.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

import numpy as np

import attnx
from attnx import reference

GiB = 1 << 30
MiB = 1 << 20

# --------------------------------------------------------------------------------------------
# machine information
# --------------------------------------------------------------------------------------------


def _read(path):
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def cpu_model():
    """The CPU's model name from /proc/cpuinfo (``platform.processor()`` elsewhere)."""
    text = _read("/proc/cpuinfo") or ""
    for line in text.splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def cpu_topology():
    """Which logical CPUs share a physical core: decides what "2 threads >= 1.8x 1 thread" can mean
    (two SMT siblings share one core's FMA units, so they cannot double FLOP throughput)."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:
        cpus = list(range(os.cpu_count() or 1))
    siblings = {}
    for c in cpus:
        s = _read(f"/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list")
        if s is not None:
            siblings[c] = s
    cores = {s for s in siblings.values()}
    smt = any(("," in s or "-" in s) for s in siblings.values())
    return {
        "logical_cpus": os.cpu_count(),
        "usable_cpus": len(cpus),
        "thread_siblings": siblings,
        "physical_cores": len(cores) if siblings else None,
        "smt_siblings_present": smt if siblings else None,
    }


def _versions():
    v = {
        "attnx": attnx.__version__,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "torch": None,
    }
    try:
        import ml_dtypes

        v["ml_dtypes"] = ml_dtypes.__version__
    except ImportError:
        v["ml_dtypes"] = None
    return v


def build_info():
    """Which build of the core ran: its file's time stamp and, in a git checkout, the commit."""
    info = {"core_file": getattr(attnx._core, "__file__", None), "core_mtime": None, "git": None}
    try:
        info["core_mtime"] = _dt.datetime.fromtimestamp(
            os.path.getmtime(info["core_file"]), _dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    except (OSError, TypeError):
        pass
    src = os.path.dirname(os.path.abspath(attnx.__file__))
    try:
        head = subprocess.run(["git", "-C", src, "describe", "--always", "--dirty"],
                              capture_output=True, text=True, timeout=5)
        if head.returncode == 0:
            info["git"] = head.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def machine_info(threads):
    return {
        "build": build_info(),
        "cpu_model": cpu_model(),
        "platform": platform.platform(),
        "threads": threads,
        "isa": attnx.cpu_features()["isa"],
        "cpu_features": attnx.cpu_features(),
        "topology": cpu_topology(),
        "versions": _versions(),
    }


def _load_torch():
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return None, None
    return torch, F


# --------------------------------------------------------------------------------------------
# timing
# --------------------------------------------------------------------------------------------


def _clock(fn, inner):
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - t0) / inner


def interleaved(fns, repeat, *, sample_s=0.02, limited=None):
    """Times every callable of ``fns`` (name -> fn) ``repeat`` times, alternating them, each
    repetition in a rotated order. A sample repeats a call ``inner`` times so that it lasts at least
    ``sample_s`` (tiny calls); ``limited`` maps names to a smaller number of samples (the slow
    NumPy reference). Returns name -> list of seconds per call.

    Each sample of a name in ``limited`` is preceded by one untimed call of the same function:
    the libraries keep their own thread pools (attnx's own, torch's OpenMP, OpenBLAS under NumPy),
    whose idle threads spin for a while after a call, and the first call after another library's
    would pay for that spinning. A loop that calls one library repeatedly, which is what a user
    runs, never does. Names in ``limited`` (the reference, single-threaded maths on big arrays)
    skip the settle call, and a long warm-up call of theirs counts as their first sample."""
    limited = limited or {}
    names = list(fns)
    inner = {}
    samples = {name: [] for name in names}
    for name in names:  # warm-up call, which also calibrates `inner`
        t = _clock(fns[name], 1)
        inner[name] = 1 if t >= sample_s else min(100000, int(math.ceil(sample_s / max(t, 1e-7))))
        if name in limited and inner[name] == 1:
            samples[name].append(t)
    for r in range(repeat):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            if len(samples[name]) >= limited.get(name, repeat):
                continue
            if name not in limited:
                fns[name]()  # settle: see the docstring
            samples[name].append(_clock(fns[name], inner[name]))
    return samples


class CpuShare:
    """How much CPU other processes used while a row ran: /proc/stat's busy time of the whole
    machine minus this process's (and its children's) own CPU time. The machines are shared, and
    a row measured while someone else compiled is flagged instead of silently trusted."""

    def __init__(self):
        self.start = self._snap()

    @staticmethod
    def _snap():
        text = _read("/proc/stat")
        if not text:
            return None
        f = [int(x) for x in text.splitlines()[0].split()[1:]]
        idle = f[3] + (f[4] if len(f) > 4 else 0)
        tick = os.sysconf("SC_CLK_TCK")
        t = os.times()
        own = t.user + t.system + t.children_user + t.children_system
        return (sum(f[:8]) - idle) / tick, sum(f[:8]) / tick, own

    def others(self):
        """Fraction of the machine's CPU time (0..1) used by other processes since start."""
        end = self._snap()
        if self.start is None or end is None:
            return None
        busy, total, own = (e - s for e, s in zip(end, self.start))
        if total <= 0:
            return None
        return max(0.0, min(1.0, (busy - own) / total))


def _median(xs):
    return statistics.median(xs) if xs else None


def _spread(xs):
    """Relative half-range of the middle samples: a cheap noise indicator."""
    if not xs or len(xs) < 3:
        return None
    s = sorted(xs)
    lo, hi = s[len(s) // 4], s[(3 * len(s) - 1) // 4]
    return (hi - lo) / 2 / statistics.median(s)


# --------------------------------------------------------------------------------------------
# the suite
# --------------------------------------------------------------------------------------------


@dataclass
class Row:
    key: str
    case: str
    shape: str
    kind: str                       # "flops", "bytes", "latency", "threads", "memory"
    target: str
    work: float = 0.0               # FLOPs or bytes of the attnx shape
    attnx_s: float | None = None
    numpy_s: float | None = None    # at the attnx shape (extrapolated when numpy_estimated)
    numpy_estimated: bool = False
    numpy_shape: str | None = None
    torch_s: float | None = None
    rate: float | None = None       # GFLOP/s or GB/s
    rate_unit: str = ""
    pct_of_limit: float | None = None
    limit_name: str = ""
    vs_numpy: float | None = None
    vs_torch: float | None = None
    met: bool | None = None
    met_text: str = ""
    extra: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)
    samples: dict = field(default_factory=dict)


def _shape_str(**kw):
    return " ".join(f"{k}{v}" for k, v in kw.items())


class Suite:
    """Builds and runs the rows. ``tiny`` shrinks every shape (for the smoke test: the numbers then
    mean nothing); ``quick`` keeps the shapes but takes fewer samples and scales the reference
    down further."""

    def __init__(self, *, threads, repeat, quick, tiny, log):
        self.threads = threads
        self.repeat = repeat
        self.quick = quick
        self.tiny = tiny
        self.log = log
        self.torch, self.F = _load_torch()
        self.sample_s = 0.005 if tiny else 0.01 if quick else 0.02
        self.limits = {}
        self.probe_runs = []
        self.rows = []
        self.outputs = {}

    # ---- helpers ------------------------------------------------------------------------
    def rng(self, salt):
        return np.random.default_rng(1234 + salt)

    def randn(self, rng, shape, dtype=np.float32):
        return rng.standard_normal(shape, dtype=np.float32).astype(dtype, copy=False)

    def tt(self, a):
        """numpy -> torch tensor; half-precision numpy types go through float32."""
        torch = self.torch
        if a.dtype == np.float16:
            return torch.from_numpy(a)
        if a.dtype.name == "bfloat16":
            return torch.from_numpy(a.astype(np.float32)).to(torch.bfloat16)
        return torch.from_numpy(a)

    def run_row(self, row, fns, *, ref=None, ref_work=None, ref_shape=None, ref_samples=1,
                limit_key=None, limit_name="", unit="GFLOP/s"):
        """Times attnx (and torch when there) interleaved with the reference; fills the row.
        ``ref`` is the reference callable on a shape whose work is ``ref_work`` (== row.work when it
        is the full shape)."""
        fns = dict(fns)
        limited = {}
        if ref is not None:
            fns["numpy"] = ref
            limited["numpy"] = ref_samples
        if self.torch is not None and "torch" in fns:
            self.torch.set_num_threads(self.threads)
        s = interleaved(fns, self.repeat, sample_s=self.sample_s, limited=limited)
        row.samples = s
        row.attnx_s = _median(s["attnx"])
        if "torch" in s:
            row.torch_s = _median(s["torch"])
            row.vs_torch = row.torch_s / row.attnx_s
        if "numpy" in s:
            t = _median(s["numpy"])
            if ref_work is not None and ref_work != row.work:
                row.numpy_estimated = True
                row.numpy_shape = ref_shape
                t = t * row.work / ref_work
            row.numpy_s = t
            row.vs_numpy = t / row.attnx_s
        if row.kind in ("flops", "bytes"):
            row.rate = row.work / row.attnx_s / 1e9
            row.rate_unit = unit
            row.extra["limit_key"] = limit_key  # % of it is set once the limits are final
            row.limit_name = limit_name
        sp = _spread(s["attnx"])
        if sp is not None and sp > 0.10:
            row.notes.append(f"noisy: attnx samples spread ±{100 * sp:.0f}%")
        row.extra["attnx_spread"] = sp

    def check_close(self, row, a, b, what, tol):
        """Records the largest difference between two outputs of the same work (a sanity check
        that the rows compare like with like; never a timing assertion)."""
        a = np.asarray(a, dtype=np.float32)
        b = np.asarray(b, dtype=np.float32)
        err = float(np.max(np.abs(a - b))) if a.size else 0.0
        row.extra[f"max_abs_diff_vs_{what}"] = err
        if not err <= tol:
            row.notes.append(f"attnx differs from {what} by {err:.2g}")

    def progress(self, i, n, name):
        self.log(f"[{i}/{n}] {name} ...")

    # ---- probes -------------------------------------------------------------------------
    def probes(self, again=False):
        """The machine's limits. Measured before the suite and once more after it; each limit is
        the larger of the two, so that a probe that ran while someone else used the CPUs does not
        lower the denominator of every row's "% of limit"."""
        secs = 0.1 if self.tiny else 0.2 if self.quick else 0.4
        nbytes = (256 * MiB) if self.tiny else GiB
        self.log("probing FMA peak and read bandwidth" + (" again" if again else "") + " ...")
        core = attnx._core
        lim = {
            "fma_gflops_all": core.probe_fma_gflops(self.threads, secs),
            "fma_gflops_1": core.probe_fma_gflops(1, secs),
            "read_gbps_all": core.probe_read_gbps(self.threads, nbytes, secs + 0.2),
        }
        self.probe_runs.append(lim)
        self.limits = {k: max(r[k] for r in self.probe_runs) for k in lim}
        self.limits.update(threads=self.threads, isa=attnx.cpu_features()["isa"])
        self.log(f"  FMA peak {lim['fma_gflops_all']:.1f} GFLOP/s ({self.threads} threads), "
                 f"{lim['fma_gflops_1']:.1f} (1 thread); read {lim['read_gbps_all']:.1f} GB/s")
        return self.limits

    def finalize(self):
        """% of the final limits, then every row's verdict against the issue's targets."""
        lim = self.limits
        for r in self.rows:
            key = r.extra.get("limit_key")
            if key and r.rate:
                r.pct_of_limit = 100 * r.rate / lim[key]
        by_key = {r.key: r for r in self.rows}
        for r in self.rows:
            if r.key == "prefill":
                self.judge(r, pct=70, torch_x=1.5)
            elif r.key in ("gqa_causal", "encoder"):
                self.judge(r, torch_x=1.5)
            elif r.key == "decode_f32":
                self.judge(r, pct=80, torch_x=4.0, what="BW")
            elif r.key == "decode_long":
                self.judge(r, pct=80, what="BW")
            elif r.key in ("decode_fp16", "decode_bf16") and "decode_f32" in by_key:
                ratio = r.extra["tokens_per_s"] / by_key["decode_f32"].extra["tokens_per_s"]
                r.extra["tokens_per_s_vs_fp32"] = ratio
                r.met = ratio >= 1.7
                r.met_text = f"{'yes' if r.met else 'NO'}: {ratio:.2f}× fp32 tokens/s"
            elif r.key == "threads" and "speedup" in r.extra:
                # the machine's own scaling: FMA peak with all threads over one thread (about 1
                # if the "cores" were SMT siblings of one physical core)
                machine = lim["fma_gflops_all"] / lim["fma_gflops_1"]
                r.extra["machine_fma_scaling"] = machine
                r.pct_of_limit = 100 * r.extra["speedup"] / machine
                r.met = r.extra["speedup"] >= 0.9 * self.threads
                r.met_text = f"{'yes' if r.met else 'NO'}: {r.extra['speedup']:.2f}×"

    # ---- the rows -------------------------------------------------------------------------
    def dense_case(self, key, name, B, Hq, Hkv, S, D, causal, target, salt, ref_S, torch_target):
        rng = self.rng(salt)
        q = self.randn(rng, (B, Hq, S, D))
        k = self.randn(rng, (B, Hkv, S, D))
        v = self.randn(rng, (B, Hkv, S, D))
        flops = 4.0 * B * Hq * S * S * D / (2 if causal else 1)
        row = Row(key, name, _shape_str(B=B, **({"H": Hq} if Hq == Hkv else {"Hq": Hq, "Hkv": Hkv}),
                                        S=S, D=D) + (" causal" if causal else ""),
                  "flops", target, work=flops)
        nt = self.threads
        out = np.empty_like(q)
        fns = {"attnx": lambda: attnx.attention(q, k, v, causal=causal, num_threads=nt, out=out)}
        if self.torch is not None:
            tq, tk, tv = self.tt(q), self.tt(k), self.tt(v)
            kw = {"enable_gqa": True} if Hq != Hkv else {}
            # torch's is_causal is top-left aligned; with Sq == Sk it is the same triangle
            fns["torch"] = lambda: self.F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal, **kw)
        # the reference on S' = ref_S: work scales with S'^2
        rq, rk, rv = q[:, :, :ref_S], k[:, :, :ref_S], v[:, :, :ref_S]
        ref_flops = 4.0 * B * Hq * ref_S * ref_S * D / (2 if causal else 1)
        ref = lambda: reference.attention(rq, rk, rv, causal=causal)  # noqa: E731
        self.run_row(row, fns, ref=ref, ref_work=ref_flops,
                     ref_shape=_shape_str(S=ref_S), limit_key="fma_gflops_all",
                     limit_name="FMA peak")
        if self.torch is not None:
            self.check_close(row, out, fns["torch"]().numpy(), "torch", 1e-3)
        return row

    def encoder_case(self, B, H, S, D, salt, ref_B):
        rng = self.rng(salt)
        kv_lens = rng.integers(S // 2, S, size=B, endpoint=True).astype(np.int32)
        q = self.randn(rng, (B, H, S, D))
        k = self.randn(rng, (B, H, S, D))
        v = self.randn(rng, (B, H, S, D))
        flops = 4.0 * H * S * D * float(kv_lens.sum())  # every query row against its valid keys
        row = Row("encoder", "encoder batch with padding",
                  _shape_str(B=B, H=H, S=S, D=D) + f" kv_lens∈[{S // 2},{S}]", "flops",
                  "≥ 1.5× torch (boolean mask)", work=flops)
        row.extra["kv_lens"] = kv_lens.tolist()
        nt = self.threads
        out = np.empty_like(q)
        fns = {"attnx": lambda: attnx.attention(q, k, v, kv_lens=kv_lens, num_threads=nt, out=out)}
        if self.torch is not None:
            tq, tk, tv = self.tt(q), self.tt(k), self.tt(v)
            keep = np.arange(S)[None, :] < kv_lens[:, None]           # True = may attend
            tmask = self.torch.from_numpy(keep[:, None, None, :].copy())  # (B, 1, 1, S)
            fns["torch"] = lambda: self.F.scaled_dot_product_attention(tq, tk, tv, attn_mask=tmask)
        rq, rk, rv, rl = q[:ref_B], k[:ref_B], v[:ref_B], kv_lens[:ref_B]
        ref_flops = 4.0 * H * S * D * float(rl.sum())
        ref = lambda: reference.attention(rq, rk, rv, kv_lens=rl)  # noqa: E731
        self.run_row(row, fns, ref=ref, ref_work=ref_flops, ref_shape=_shape_str(B=ref_B),
                     ref_samples=1 if self.quick else 2, limit_key="fma_gflops_all",
                     limit_name="FMA peak")
        if self.torch is not None:
            self.check_close(row, out, fns["torch"]().numpy(), "torch", 1e-3)
        return row

    def paged_inputs(self, rng, B, Hq, Hkv, L, D, bs, dtype):
        nper = -(-L // bs)
        nb = B * nper
        k_pages = self.randn(rng, (nb, Hkv, bs, D), dtype)
        v_pages = self.randn(rng, (nb, Hkv, bs, D), dtype)
        # a scrambled block table, as a cache that has allocated and freed for a while would have
        block_tables = rng.permutation(nb).astype(np.int32).reshape(B, nper)
        seq_lens = np.full(B, L, dtype=np.int32)
        q = self.randn(rng, (B, Hq, D))
        return q, k_pages, v_pages, block_tables, seq_lens

    @staticmethod
    def gather(pages, block_tables, L):
        """(num_blocks, H, bs, D) pages -> contiguous (B, H, L, D), the same work for torch."""
        g = pages[block_tables]                       # (B, nper, H, bs, D)
        B, nper, H, bs, D = g.shape
        return np.ascontiguousarray(g.transpose(0, 2, 1, 3, 4).reshape(B, H, nper * bs, D)[:, :, :L])

    def paged_case(self, key, name, B, Hq, Hkv, L, D, bs, dtype, salt, ref_B, ref_L, target):
        rng = self.rng(salt)
        q, kp, vp, bt, sl = self.paged_inputs(rng, B, Hq, Hkv, L, D, bs, dtype)
        isz = np.dtype(dtype).itemsize
        nbytes = 2.0 * B * Hkv * L * D * isz
        dname = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}.get(np.dtype(dtype).name, np.dtype(dtype).name)
        row = Row(key, name, _shape_str(B=B, Hq=Hq, Hkv=Hkv, L=L, D=D) + f" block{bs} {dname} KV",
                  "bytes", target, work=nbytes)
        nt = self.threads
        out = np.empty_like(q)
        fns = {"attnx": lambda: attnx.paged_attention(q, kp, vp, bt, sl, num_threads=nt, out=out)}
        if self.torch is not None:
            kc, vc = self.gather(kp, bt, L), self.gather(vp, bt, L)
            tq = self.tt(q.astype(dtype)[:, :, None, :])        # (B, Hq, 1, D), the KV dtype
            tk, tv = self.tt(kc), self.tt(vc)
            fns["torch"] = lambda: self.F.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True)
        # the reference: the first ref_B sequences, each cut to its first ref_L tokens
        nper_r = -(-ref_L // bs)
        rq, rbt, rsl = q[:ref_B], bt[:ref_B, :nper_r], np.full(ref_B, ref_L, np.int32)
        ref_bytes = 2.0 * ref_B * Hkv * ref_L * D * isz
        ref = lambda: reference.paged_attention(rq, kp, vp, rbt, rsl)  # noqa: E731
        self.run_row(row, fns, ref=ref, ref_work=ref_bytes,
                     ref_shape=_shape_str(B=ref_B, L=ref_L), ref_samples=1 if self.quick else 3,
                     limit_key="read_gbps_all", limit_name="read BW", unit="GB/s")
        row.extra["tokens_per_s"] = B / row.attnx_s
        if self.torch is not None:
            tol = 1e-3 if isz == 4 else 3e-2
            self.check_close(row, out, fns["torch"]().float().numpy()[:, :, 0, :], "torch", tol)
        return row

    def small_case(self):
        rng = self.rng(7)
        q = self.randn(rng, (1, 1, 1, 64))
        k = self.randn(rng, (1, 1, 16, 64))
        v = self.randn(rng, (1, 1, 16, 64))
        row = Row("small", "small call", "B1 H1 Sq1 Sk16 D64", "latency", "≤ 5 µs per call")
        fns = {"attnx": lambda: attnx.attention(q, k, v)}
        if self.torch is not None:
            tq, tk, tv = self.tt(q), self.tt(k), self.tt(v)
            fns["torch"] = lambda: self.F.scaled_dot_product_attention(tq, tk, tv)
        ref = lambda: reference.attention(q, k, v)  # noqa: E731
        self.run_row(row, fns, ref=ref, ref_samples=self.repeat)
        us = row.attnx_s * 1e6
        row.met = us <= 5.0
        row.met_text = f"{'yes' if row.met else 'NO'}: {us:.1f} µs"
        return row

    def threads_case(self, prefill):
        """The prefill shape with 1 thread vs all threads, interleaved."""
        B, H, S, D = prefill
        row = Row("threads", "threads", _shape_str(B=B, H=H, S=S, D=D) + f" 1 vs {self.threads} thr",
                  "threads", f"{self.threads} threads ≥ {0.9 * self.threads:.1f}× 1 thread")
        if self.threads < 2:
            row.notes.append("skipped: needs --threads >= 2")
            return row
        rng = self.rng(1)
        q, k, v = (self.randn(rng, (B, H, S, D)) for _ in range(3))
        nt = self.threads
        out = np.empty_like(q)
        fns = {
            "attnx": lambda: attnx.attention(q, k, v, num_threads=nt, out=out),
            "attnx_1": lambda: attnx.attention(q, k, v, num_threads=1, out=out),
        }
        torch = self.torch
        if torch is not None:
            tq, tk, tv = self.tt(q), self.tt(k), self.tt(v)

            def torch_n():
                torch.set_num_threads(nt)
                return self.F.scaled_dot_product_attention(tq, tk, tv)

            def torch_1():
                torch.set_num_threads(1)
                return self.F.scaled_dot_product_attention(tq, tk, tv)

            fns["torch_n"] = torch_n
            fns["torch_1"] = torch_1
        s = interleaved(fns, self.repeat, sample_s=self.sample_s)
        if torch is not None:
            torch.set_num_threads(nt)
        row.samples = s
        t_n, t_1 = _median(s["attnx"]), _median(s["attnx_1"])
        row.attnx_s = t_n
        row.work = 4.0 * B * H * S * S * D
        row.rate = row.work / t_n / 1e9
        row.rate_unit = "GFLOP/s"
        speedup = t_1 / t_n
        row.limit_name = "FMA-peak scaling"
        row.extra.update({"attnx_1thread_s": t_1, "speedup": speedup})
        if torch is not None:
            ts = _median(s["torch_1"]) / _median(s["torch_n"])
            row.extra["torch_speedup"] = ts
            row.notes.append(f"torch scales {ts:.2f}×")
        row.met = speedup >= 0.9 * self.threads
        row.met_text = f"{'yes' if row.met else 'NO'}: {speedup:.2f}×"
        return row

    def memory_case(self, S, D):
        """Peak RSS growth of one full-attention call, measured in a fresh subprocess."""
        row = Row("memory", "memory", _shape_str(B=1, H=1, S=S, D=D), "memory", "peak O(S·D), not O(S²)")
        code = _MEMORY_CHILD.format(S=S, D=D, threads=self.threads)
        env = dict(os.environ)
        env.pop("PYTHONSTARTUP", None)
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                             timeout=600)
        if res.returncode != 0:
            row.notes.append("subprocess failed: " + res.stderr.strip().splitlines()[-1]
                             if res.stderr.strip() else f"subprocess exit {res.returncode}")
            return row
        m = json.loads(res.stdout.strip().splitlines()[-1])
        growth = m["hwm_after"] - m["rss_before"]
        scores = S * S * 4
        io_bytes = 4 * S * D * 4  # q, k, v, out
        allowed = max(4 * io_bytes, 64 * MiB)
        row.attnx_s = m["seconds"]
        row.work = 4.0 * S * S * D
        row.rate = row.work / row.attnx_s / 1e9
        row.rate_unit = "GFLOP/s"
        row.pct_of_limit = 100 * growth / scores
        row.limit_name = "S² fp32 score matrix"
        row.extra.update({"rss_growth_bytes": growth, "score_matrix_bytes": scores,
                          "inputs_outputs_bytes": io_bytes, "allowed_bytes": allowed, **m})
        row.met = growth <= allowed
        row.met_text = (f"{'yes' if row.met else 'NO'}: +{growth / MiB:.1f} MiB vs "
                        f"{scores / GiB:.2g} GiB")
        row.notes.append("numpy/torch not run (numpy would need the S² matrix)")
        return row

    def judge(self, row, *, pct=None, torch_x=None, what="peak"):
        """Sets met / met_text; a missing torch leaves its part unjudged (and the row unmet)."""
        parts, ok, unknown = [], True, False
        if pct is not None:
            good = row.pct_of_limit is not None and row.pct_of_limit >= pct
            ok &= good
            parts.append(f"{row.pct_of_limit or 0:.0f}% {what}")
        if torch_x is not None:
            if row.vs_torch is None:
                unknown = True
                parts.append("torch n/a")
            else:
                ok &= row.vs_torch >= torch_x
                parts.append(f"{row.vs_torch:.2f}× torch")
        row.met = None if ok and unknown else ok
        word = "NO" if not ok else "?" if unknown else "yes"
        row.met_text = f"{word}: " + ", ".join(parts)

    # ---- everything -------------------------------------------------------------------------
    def run(self):
        t0 = time.perf_counter()
        self.run_share = CpuShare()
        tiny, quick = self.tiny, self.quick
        self.log(f"attnx {attnx.__version__} bench: {self.threads} threads, ISA "
                 f"{attnx.cpu_features()['isa']}, repeat {self.repeat}"
                 + (", quick" if quick else "") + (", TINY shapes (numbers meaningless)" if tiny else ""))
        if self.torch is None:
            self.log("torch not installed: the torch columns are skipped")
        self.probes()
        if tiny:
            prefill = (1, 2, 256, 64)
            gqa = dict(B=1, Hq=8, Hkv=2, S=256, D=128)
            enc = dict(B=2, H=2, S=128, D=64)
            dec = dict(B=2, Hq=8, Hkv=2, L=256, D=128, bs=16)
            long_L, mem_S = 2048, 2048
        else:
            prefill = (1, 8, 2048, 64)
            gqa = dict(B=1, Hq=32, Hkv=8, S=2048, D=128)
            enc = dict(B=4, H=12, S=512, D=64)
            dec = dict(B=8, Hq=32, Hkv=8, L=2048, D=128, bs=16)
            long_L, mem_S = 32768, 32768
        # reference shapes: the full shape where it takes a few seconds, scaled down otherwise
        ref_prefill_S = prefill[2] // (4 if quick and not tiny else 1)
        ref_gqa_S = gqa["S"] // (1 if tiny else 8 if quick else 2)
        ref_enc_B = 1 if quick else enc["B"]
        ref_dec_B = 2 if quick and not tiny else dec["B"]
        ref_long_L = long_L // (8 if quick and not tiny else 1)

        steps = [
            ("prefill", lambda: self.dense_case(
                "prefill", "prefill", prefill[0], prefill[1], prefill[1], prefill[2], prefill[3],
                False, "≥ 70% FMA peak; ≥ 1.5× torch", 1, ref_prefill_S, 1.5)),
            ("causal GQA prefill", lambda: self.dense_case(
                "gqa_causal", "causal GQA prefill", gqa["B"], gqa["Hq"], gqa["Hkv"], gqa["S"],
                gqa["D"], True, "≥ 1.5× torch (enable_gqa)", 2, ref_gqa_S, 1.5)),
            ("encoder batch with padding", lambda: self.encoder_case(
                enc["B"], enc["H"], enc["S"], enc["D"], 3, ref_enc_B)),
            ("paged decode fp32", lambda: self.paged_case(
                "decode_f32", "paged decode", **dec, dtype=np.float32, salt=4, ref_B=ref_dec_B,
                ref_L=dec["L"], target="≥ 80% read BW; ≥ 4× torch")),
        ]
        try:
            from ml_dtypes import bfloat16
        except ImportError:  # attnx depends on ml_dtypes; keep the bench usable anyway
            bfloat16 = None
        for dt, dn in ((np.float16, "fp16"), (bfloat16, "bf16")):
            if dt is None:
                continue
            steps.append((f"paged decode {dn}", lambda dt=dt, dn=dn: self.paged_case(
                f"decode_{dn}", f"paged decode {dn} KV", **dec, dtype=dt, salt=4,
                ref_B=ref_dec_B, ref_L=dec["L"], target="≥ 1.7× fp32 tokens/s")))
        steps += [
            ("long-context decode", lambda: self.paged_case(
                "decode_long", "long-context decode", B=1, Hq=dec["Hq"], Hkv=dec["Hkv"], L=long_L,
                D=dec["D"], bs=dec["bs"], dtype=np.float32, salt=5, ref_B=1, ref_L=ref_long_L,
                target="≥ 80% read BW")),
            ("small call", self.small_case),
            ("threads", lambda: self.threads_case(prefill)),
            ("memory", lambda: self.memory_case(mem_S, 64)),
        ]
        n = len(steps)
        for i, (name, step) in enumerate(steps, 1):
            self.progress(i, n, name)
            ts = time.perf_counter()
            share = CpuShare()
            row = step()
            others = share.others()
            row.extra["others_cpu_share"] = others
            if others is not None and others > 0.10:
                row.notes.append(f"noisy: other processes used {100 * others:.0f}% of the CPUs")
            self.rows.append(row)
            self.log(f"      {_fmt_time(row.attnx_s)}"
                     + (f"  {row.rate:.1f} {row.rate_unit}" if row.rate else "")
                     + (f"  {row.vs_torch:.2f}× torch" if row.vs_torch else "")
                     + f"  ({time.perf_counter() - ts:.1f} s)")
        self.probes(again=True)
        self.finalize()
        self.elapsed = time.perf_counter() - t0
        self.others_cpu_share = self.run_share.others()
        self.log(f"done in {self.elapsed:.0f} s")
        return self.rows

# Runs in a fresh interpreter so that the parent's allocations do not hide the call's peak.
_MEMORY_CHILD = r"""
import json, time, numpy as np, attnx
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    return None
S, D = {S}, {D}
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((1, 1, S, D), dtype=np.float32) for _ in range(3))
out = np.empty_like(q)
out[...] = 0
rss_before = status("VmRSS:")
hwm_before = status("VmHWM:")
t0 = time.perf_counter()
attnx.attention(q, k, v, out=out, num_threads={threads})
dt = time.perf_counter() - t0
print(json.dumps(dict(rss_before=rss_before, hwm_before=hwm_before, hwm_after=status("VmHWM:"),
                      seconds=dt, finite=bool(np.isfinite(out).all()))))
"""


# --------------------------------------------------------------------------------------------
# output
# --------------------------------------------------------------------------------------------


def _fmt_time(s):
    if s is None:
        return "—"
    if s < 1e-3:
        return f"{s * 1e6:.2f} µs"
    if s < 1:
        return f"{s * 1e3:.2f} ms"
    return f"{s:.2f} s"


def _fmt_x(x, est=False):
    if x is None:
        return "—"
    return ("~" if est else "") + (f"{x:.0f}×" if x >= 100 else f"{x:.2f}×" if x < 10 else f"{x:.1f}×")


def format_table(rows):
    head = ["case", "shape", "attnx median", "rate", "% of limit", "× NumPy", "× torch", "target",
            "met?"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        rate = f"{r.rate:.1f} {r.rate_unit}" if r.rate else "—"
        pct = "—"
        if r.pct_of_limit is not None:
            x = r.pct_of_limit
            pct = (f"{x:.1f}%" if x >= 1 or x == 0 else f"{x:.2g}%") + f" {r.limit_name}"
        met = r.met_text or ("—" if r.met is None else "yes" if r.met else "NO")
        if r.notes and r.kind != "memory":
            met += " (" + "; ".join(r.notes) + ")"
        cells = [r.case, r.shape, _fmt_time(r.attnx_s), rate, pct,
                 _fmt_x(r.vs_numpy, r.numpy_estimated), _fmt_x(r.vs_torch), r.target, met]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_header(result):
    m, lim = result["machine"], result["limits"]
    topo = m["topology"]
    smt = topo.get("smt_siblings_present")
    return "\n".join([
        f"attnx {m['versions']['attnx']} — {result['date']}",
        f"CPU: {m['cpu_model']}; {topo['usable_cpus']} CPUs usable, "
        f"{topo.get('physical_cores')} physical cores"
        + (" (SMT siblings)" if smt else " (no SMT siblings)" if smt is False else ""),
        f"threads: {m['threads']}; ISA: {m['isa']}; numpy {m['versions']['numpy']}; "
        f"torch {m['versions']['torch'] or 'not installed'}; source {m['build']['git'] or '?'}, "
        f"core built {m['build']['core_mtime'] or '?'}",
        f"limits: FMA peak {lim['fma_gflops_all']:.1f} GFLOP/s ({lim['threads']} thr), "
        f"{lim['fma_gflops_1']:.1f} GFLOP/s (1 thr); read bandwidth {lim['read_gbps_all']:.1f} GB/s",
        f"load average before/after: {result['loadavg_before']} / {result['loadavg_after']}; "
        f"other processes' CPU share during the run: "
        + (f"{100 * result['others_cpu_share']:.0f}%" if result["others_cpu_share"] is not None else "n/a"),
    ])


def plot(result, path):
    """Two bar charts: speed-up over torch and % of the measured limit, per row."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'attnx[bench]' (or matplotlib)") from None
    rows = result["rows"]
    names = [r["case"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(13, 0.45 * len(rows) + 1.8), sharey=True)
    y = np.arange(len(rows))
    vt = [r["vs_torch"] or 0 for r in rows]
    axes[0].barh(y, vt, color=["tab:green" if x >= 1.5 else "tab:orange" if x >= 1 else "tab:red"
                               for x in vt])
    if any(vt):
        axes[0].set_xscale("log")
    axes[0].axvline(1.0, color="k", lw=0.8)
    axes[0].axvline(1.5, color="gray", ls="--", lw=0.8, label="1.5× target")
    for i, x in enumerate(vt):
        if x:
            axes[0].text(x, i, f" {x:.2f}×", va="center", fontsize=8)
    axes[0].set_xlabel("speed-up over torch SDPA (×, log scale; none: no torch run)")
    axes[0].legend(loc="lower right", fontsize=8)
    pct = [r["pct_of_limit"] or 0 for r in rows]
    axes[1].barh(y, pct, color=["tab:green" if r["met"] else "tab:red" for r in rows])
    for i, (x, r) in enumerate(zip(pct, rows)):
        axes[1].text(x, i, f" {x:.0f}% {r['limit_name']}", va="center", fontsize=8)
    axes[1].set_xlabel("% of the measured limit (green: row's target met)")
    axes[0].set_yticks(y, names)
    axes[0].invert_yaxis()
    m = result["machine"]
    fig.suptitle(f"attnx {m['versions']['attnx']} — {m['cpu_model']}, {m['threads']} threads, {m['isa']}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(*, threads=None, repeat=None, quick=False, tiny=False, json_path=None, plot_path=None,
        log=None, out=None):
    """Runs the benchmark, prints the table; returns the result dict (what --json saves)."""
    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    out = out or sys.stdout
    tiny = tiny or os.environ.get("ATTNX_BENCH_TINY", "") not in ("", "0")
    threads = int(threads) if threads else attnx.get_num_threads()
    if threads < 1:
        raise SystemExit("--threads: expected a positive number")
    repeat = int(repeat) if repeat else (3 if quick or tiny else 7)
    if plot_path:  # fail before the minutes of measuring, not after
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise SystemExit("--plot needs matplotlib: pip install 'attnx[bench]' (or matplotlib)") from None
    load_before = [round(x, 2) for x in os.getloadavg()]
    suite = Suite(threads=threads, repeat=repeat, quick=quick, tiny=tiny, log=log)
    prev_torch_threads = suite.torch.get_num_threads() if suite.torch is not None else None
    try:
        rows = suite.run()
    finally:
        if suite.torch is not None:
            suite.torch.set_num_threads(prev_torch_threads)
    info = machine_info(threads)
    if suite.torch is not None:
        info["versions"]["torch"] = suite.torch.__version__
    result = {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "config": {"threads": threads, "repeat": repeat, "quick": quick, "tiny": tiny},
        "machine": info,
        "limits": suite.limits,
        "loadavg_before": load_before,
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "elapsed_s": suite.elapsed,
        "others_cpu_share": suite.others_cpu_share,
        "rows": [asdict(r) for r in rows],
    }
    print(format_header(result), file=out)
    print(file=out)
    print(format_table(rows), file=out)
    missed = [r.case for r in rows if r.met is False]
    print(file=out)
    print("targets missed: " + (", ".join(missed) if missed else "none"), file=out)
    share = result["others_cpu_share"]
    if share is not None and share > 0.05:
        print(f"note: other processes used {100 * share:.0f}% of the CPUs during the run: absolute "
              "numbers are noisy; the ratios were measured interleaved.", file=out)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=1, default=float)
        log(f"wrote {json_path}")
    if plot_path:
        plot(result, plot_path)
        log(f"wrote {plot_path}")
    return result
