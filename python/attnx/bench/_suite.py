"""Runs declared cases (see _cases) and fills one ``Row`` per case: times, rates, ratios to the
peers, and the checks that they did the same work."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field, replace

import numpy as np

import attnx

from . import _peers
from ._cases import (
    Case,
    Delta,
    Dense,
    OverPath,
    OverRow,
    RateOver,
    TokensOver,
    isa_note,
    judge,
    shared_bound,
    target_text,
    tokens_bound,
)
from ._machine import CpuShare, MiB
from ._timing import Progress, alone, clock, interleaved, median, spread

PEERS = ("torch", "onnxruntime")
TOLERANCE = {
    "fp32": 2e-3,
    "fp16": 5e-2,
    "bf16": 5e-2,
    "int8": 2e-3,
    "fp8": 2e-3,
}  # max |attnx - peer|, outputs of O(1)


@dataclass
class Row:
    spec: Case
    attnx_s: float | None = None
    numpy_s: float | None = None  # at the full shape (extrapolated when numpy_estimated)
    numpy_estimated: bool = False
    numpy_shape: str | None = None
    peer_s: dict = field(default_factory=dict)  # peer -> median seconds
    vs: dict = field(default_factory=dict)  # peer -> its time / attnx's
    vs_numpy: float | None = None
    rate: float | None = None  # GFLOP/s or GB/s
    pct_of_limit: float | None = None
    limit_name: str = ""
    met: bool | None = None
    met_text: str = ""
    extra: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)
    samples: dict = field(default_factory=dict)

    @property
    def key(self):
        return self.spec.key

    @property
    def kind(self):
        return self.spec.row_kind

    @property
    def rate_unit(self):
        return {"flops": "GFLOP/s", "bytes": "GB/s"}.get(self.spec.shape.kind, "")

    def to_json(self):
        d = {
            k: getattr(self, k)
            for k in (
                "key",
                "kind",
                "attnx_s",
                "numpy_s",
                "numpy_estimated",
                "numpy_shape",
                "vs_numpy",
                "rate",
                "rate_unit",
                "pct_of_limit",
                "limit_name",
                "met",
                "met_text",
                "extra",
                "notes",
                "samples",
            )
        }
        shape = self.spec.shape.describe()
        if self.kind == "threads":
            shape += f" 1 vs {self.extra['threads']} thr"
        d.update(
            case=self.spec.name,
            shape=shape,
            target=target_text(self),
            torch_s=self.peer_s.get("torch"),
            vs_torch=self.vs.get("torch"),
            onnxruntime_s=self.peer_s.get("onnxruntime"),
            vs_onnxruntime=self.vs.get("onnxruntime"),
            work=self.spec.shape.work(),
            declaration={
                "shape": {"type": type(self.spec.shape).__name__, **self.spec.shape.__dict__},
                "goals": [{"goal": type(g).__name__, **g.__dict__} for g in self.spec.goals],
            },
        )
        return d


@dataclass
class Bench:
    """What every case runs with: threads, repetitions, the peers found, the progress line."""

    threads: int
    repeat: int
    quick: bool
    tiny: bool
    progress: Progress
    torch: tuple | None = None
    ort: tuple | None = None

    @property
    def sample_s(self):
        return 0.005 if self.tiny else 0.01 if self.quick else 0.02


def _dense(case: Case) -> Dense:
    """The shape of a row that only dense shapes make sense for (threads, memory, in-loop)."""
    if not isinstance(case.shape, Dense):
        raise TypeError(f"case {case.key}: expected a Dense shape, got {case.shape!r}")
    return case.shape


def _inputs(shape, seed):
    if isinstance(shape, Delta):
        return _peers.delta_inputs(shape, seed)
    return (
        _peers.paged_inputs(shape, seed)
        if not isinstance(shape, Dense)
        else _peers.dense_inputs(shape, seed)
    )


def _impls(case, data, bench):
    """attnx and every peer that can run the case, by name; and why the others cannot."""
    shape, nt = case.shape, bench.threads
    if isinstance(shape, Delta):
        impls = {"attnx": _peers.attnx_delta(shape, data, nt)}
    elif isinstance(shape, Dense):
        impls = {"attnx": _peers.attnx_dense(shape, data, nt, plain=case.kind == "latency")}
    else:
        impls = {"attnx": _peers.attnx_paged(shape, data, nt)}
    skipped = {}
    peers = {
        "torch": (bench.torch, _peers.torch_skip_reason, _peers.torch_impl),
        "onnxruntime": (bench.ort, _peers.ort_skip_reason, _peers.ort_impl),
    }
    for name, (mods, skip_reason, impl) in peers.items():
        if mods is None:
            continue
        why = skip_reason(shape)
        if not why:
            try:
                impls[name] = impl(mods, shape, data, nt)
            except Exception as e:  # noqa: BLE001 (a peer library may raise anything on set-up)
                why = f"could not run here: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
        if why:
            skipped[name] = why
    return impls, skipped


def _check_peers(row, impls):
    """Each peer's output against attnx's before it is timed: a peer that computes something else
    is not timed (its difference is noted and kept in the JSON)."""
    mine = impls["attnx"].result()
    shape = row.spec.shape
    tol = TOLERANCE["bf16" if getattr(shape, "precision", "") == "bf16" else shape.dtype]
    for name in [n for n in impls if n != "attnx"]:
        err = float(np.max(np.abs(mine - impls[name].result()))) if mine.size else 0.0
        row.extra[f"max_abs_diff_vs_{name}"] = err
        if not err <= tol:
            row.notes.append(f"{name} differs from attnx by {err:.2g}: not timed")
            del impls[name]


def _time_reference(row, case, data, bench):
    cut = case.shape.cut(**case.ref)
    bench.progress.phase("NumPy reference" + (f" on {cut.describe()}" if cut != case.shape else ""))
    t = median(
        alone(
            _peers.reference_call(case.shape, data, cut), case.ref_samples, sample_s=bench.sample_s
        )
    )
    if cut != case.shape:
        row.numpy_estimated, row.numpy_shape = True, cut.describe()
        t *= case.shape.work() / cut.work()
    row.numpy_s = t


BASE = "attnx fp32"  # the samples of a RateOver row's base call, timed with the row's own


def _interleaved_base(case, bench, data):
    """A RateOver row's base (its call, or None): attnx on the same dense shape in fp32 on float32
    products, or on the row's own inputs (``data``) widened to fp32 where the goal says so."""
    if not isinstance(case.shape, Dense) or (
        case.shape.dtype == "fp32" and case.shape.precision == "float32"
    ):
        return None
    goal = next((g for g in case.goals if isinstance(g, RateOver)), None)
    if goal is None:
        return None
    if goal.widen:
        return _peers.attnx_widened(case.shape, data, bench.threads).fn
    shape = replace(case.shape, dtype="fp32", precision="float32")
    return _peers.attnx_dense(shape, _inputs(shape, case.seed), bench.threads).fn


PATH = "attnx vector path"  # the samples of an OverPath row's call on the other kernel path


def _interleaved_path(case, fn):
    """An OverPath row's base: the row's own attnx call on the goal's kernel path (or None where
    this CPU runs neither that path nor another one the goal is about)."""
    from .. import _core, cpu_features

    goal = next((g for g in case.goals if isinstance(g, OverPath)), None)
    if goal is None or cpu_features()["isa"] == goal.isa:
        return None

    def on_path():
        mine = _core.active_isa()
        _core.set_isa(goal.isa)
        try:
            fn()
        finally:
            _core.set_isa(mine)

    return on_path


def run_case(case: Case, bench: Bench) -> Row:
    """The reference alone, then attnx and the peers interleaved (see _timing)."""
    row = Row(case)
    data = _inputs(case.shape, case.seed)
    impls, row.extra["peers_skipped"] = _impls(case, data, bench)
    bench.progress.phase("checking the peers' outputs")
    _check_peers(row, impls)
    if case.ref is not None:
        _time_reference(row, case, data, bench)
    fns = {name: impl.fn for name, impl in impls.items()}
    base = _interleaved_base(case, bench, data)
    if base is not None:
        fns[BASE] = base
    path = _interleaved_path(case, fns["attnx"])
    if path is not None:
        fns[PATH] = path
    s = interleaved(
        fns,
        bench.repeat,
        sample_s=bench.sample_s,
        on_round=lambda r, n: bench.progress.phase(f"{' / '.join(fns)} round {r}/{n}"),
    )
    row.samples = s
    row.attnx_s = median(s["attnx"])
    if base is not None:
        row.extra["base_interleaved_s"] = median(s[BASE])
    if path is not None:
        row.extra["path_interleaved_s"] = median(s[PATH])
    for name in PEERS:
        if name in s:
            row.peer_s[name] = median(s[name])
            row.vs[name] = row.peer_s[name] / row.attnx_s
    if row.numpy_s is not None:
        row.vs_numpy = row.numpy_s / row.attnx_s
    if case.shape.kind == row.kind:  # a throughput row
        row.rate = case.shape.work() / row.attnx_s / 1e9
    if row.kind == "bytes":
        row.extra["tokens_per_s"] = case.shape.B / row.attnx_s
    sp = spread(s["attnx"])
    row.extra["attnx_spread"] = sp
    if sp is not None and sp > 0.10:
        row.notes.append(f"noisy: attnx samples spread ±{100 * sp:.0f}%")
    return row


def threads_case(case: Case, bench: Bench) -> Row:
    """The prefill shape with 1 thread vs all threads, interleaved (torch's too, when there)."""
    row = Row(case)
    nt = bench.threads
    row.extra["threads"] = nt
    if nt < 2:
        row.notes.append("skipped: needs --threads >= 2")
        return row
    q, k, v, _ = _peers.dense_inputs(_dense(case), case.seed)
    out = np.empty_like(q)
    fns = {
        "attnx": lambda: attnx.attention(q, k, v, num_threads=nt, out=out),
        "attnx_1": lambda: attnx.attention(q, k, v, num_threads=1, out=out),
    }
    if bench.torch is not None:
        torch = bench.torch[0]
        sdpa = _peers.torch_dense(bench.torch, case.shape, q, k, v, None, nt)
        fns["torch_n"] = lambda: (torch.set_num_threads(nt), sdpa())
        fns["torch_1"] = lambda: (torch.set_num_threads(1), sdpa())
    s = interleaved(fns, bench.repeat, sample_s=bench.sample_s)
    if bench.torch is not None:
        bench.torch[0].set_num_threads(nt)
        ts = median(s["torch_1"]) / median(s["torch_n"])
        row.extra["torch_speedup"] = ts
        row.notes.append(f"torch scales {ts:.2f}×")
    row.samples = s
    row.attnx_s = median(s["attnx"])
    row.rate = case.shape.work() / row.attnx_s / 1e9
    row.extra.update(
        attnx_1thread_s=median(s["attnx_1"]), speedup=median(s["attnx_1"]) / row.attnx_s
    )
    row.limit_name = "FMA-peak scaling"
    return row


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


def memory_case(case: Case, bench: Bench) -> Row:
    """Peak RSS growth of one full-attention call, measured in a fresh subprocess."""
    row = Row(case)
    dense = _dense(case)
    S, D = dense.Sk, dense.D
    env = dict(os.environ)
    env.pop("PYTHONSTARTUP", None)
    res = subprocess.run(
        [sys.executable, "-c", _MEMORY_CHILD.format(S=S, D=D, threads=bench.threads)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    if res.returncode != 0:
        err = res.stderr.strip()
        row.notes.append(
            "subprocess failed: " + err.splitlines()[-1]
            if err
            else f"subprocess exit {res.returncode}"
        )
        return row
    m = json.loads(res.stdout.strip().splitlines()[-1])
    growth = m["hwm_after"] - m["rss_before"]
    scores = S * S * 4
    io_bytes = 4 * S * D * 4  # q, k, v, out
    row.attnx_s = m["seconds"]
    row.rate = case.shape.work() / row.attnx_s / 1e9
    row.pct_of_limit = 100 * growth / scores
    row.limit_name = "S² fp32 score matrix"
    row.extra.update(
        {
            "rss_growth_bytes": growth,
            "score_matrix_bytes": scores,
            "inputs_outputs_bytes": io_bytes,
            "allowed_bytes": max(4 * io_bytes, 64 * MiB),
            **m,
        }
    )
    row.notes.append("numpy/torch not run (numpy would need the S² matrix)")
    return row


def _matmul(lib, bench):
    """A 1024×1024 float32 matmul of ``lib`` (what a model runs between attention calls)."""
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((1024, 1024), dtype=np.float32) for _ in range(2))
    if lib == "numpy":
        return lambda: a @ b
    torch = bench.torch[0]
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    return lambda: torch.mm(ta, tb)


def in_loop_case(case: Case, bench: Bench) -> Row:
    """attnx right after a matmul vs alone, alternating call by call; no settle call on purpose:
    the other library's spinning threads are what this row measures."""
    row = Row(case)
    if case.before == "torch" and bench.torch is None:
        row.notes.append("skipped: torch not installed")
        return row
    q, k, v, _ = _peers.dense_inputs(_dense(case), case.seed)
    out = np.empty_like(q)
    if case.before == "torch" and bench.torch is not None:
        # as in a torch model's loop: tensors in (attnx then runs on torch's team)
        q, k, v, out = (bench.torch[0].from_numpy(x) for x in (q, k, v, out))
    call = lambda: attnx.attention(q, k, v, num_threads=bench.threads, out=out)  # noqa: E731
    matmul = _matmul(case.before, bench)
    call(), matmul()  # warm up both
    alone_s, after_s = [], []
    for _ in range(max(bench.repeat, 3)):
        call()
        alone_s.append(clock(call, 1))
        matmul()
        after_s.append(clock(call, 1))
    row.samples = {"attnx_alone": alone_s, "attnx_after_matmul": after_s}
    row.attnx_s = median(after_s)
    row.rate = case.shape.work() / row.attnx_s / 1e9
    row.extra.update(alone_s=median(alone_s), slowdown=row.attnx_s / median(alone_s))
    return row


RUNNERS = {"threads": threads_case, "memory": memory_case, "in_loop": in_loop_case}


def run_all(cases, bench):
    """Every case in order, with the progress line and the CPU share other processes took."""
    rows = []
    bench.progress.total = len(cases)
    for case in cases:
        bench.progress.start(case.name)
        share = CpuShare()
        row = RUNNERS.get(case.kind, run_case)(case, bench)
        others = share.others()
        row.extra["others_cpu_share"] = others
        if others is not None and others > 0.10:
            row.notes.append(f"noisy: other processes used {100 * others:.0f}% of the CPUs")
        note = isa_note(case.isa) if case.isa else None
        if note:
            row.notes.append(note)
        rows.append(row)
        bench.progress.done(_summary(row))
    return rows


def _summary(row):
    from ._report import fmt_time

    parts = [fmt_time(row.attnx_s)]
    if row.rate:
        parts.append(f"{row.rate:.1f} {row.rate_unit}")
    parts += [f"{x:.2f}× {name}" for name, x in row.vs.items()]
    return "  ".join(parts)


def finalize(rows, limits):
    """% of the final limits, then every row's met? from its declared goals."""
    for r in rows:
        if r.rate and r.kind not in ("threads", "memory"):
            shape = r.spec.shape
            r.pct_of_limit, r.limit_name = limits.pct(shape.kind, r.rate, shape.work())
        if r.kind == "threads" and "speedup" in r.extra:
            # the machine's own scaling: FMA peak with all threads over one thread (about 1 if
            # the "cores" were SMT siblings of one physical core)
            machine = limits.values["fma_gflops_all"] / limits.values["fma_gflops_1"]
            r.extra["machine_fma_scaling"] = machine
            r.pct_of_limit = 100 * r.extra["speedup"] / machine
    by_key = {r.key: r for r in rows}
    for r in rows:
        for goal in r.spec.goals:  # the bounds of rows judged against another need the limits
            if isinstance(goal, OverRow) and goal.base in by_key:
                r.extra["bound_vs_unshared"] = shared_bound(
                    r.spec.shape, by_key[goal.base].spec.shape, limits.values
                )
            if isinstance(goal, TokensOver) and goal.bounded and goal.base in by_key:
                r.extra[f"bound_vs_{goal.label}"] = tokens_bound(
                    r.spec.shape, by_key[goal.base], limits.values
                )
    for r in rows:
        judge(r, by_key)
