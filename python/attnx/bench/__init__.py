"""The side-by-side benchmark behind ``python -m attnx bench``: this machine's limits, then attnx,
the NumPy reference, torch's SDPA and onnxruntime's GroupQueryAttention on the same work.

What runs: the fixed suite with the project's targets (``_cases.suite``), one shape of your own
(``--case``), or a Hugging Face model's prefill and decode (``--config``). Every case is declared
once in ``_cases`` (shape, work, limit, target); ``_peers`` builds the callables, ``_timing``
says how rows are timed, ``_suite`` runs them and ``_report`` prints the table, JSON and plot.
Only the standard library, NumPy and attnx are imported up front; torch, onnxruntime and
matplotlib are optional and imported when the benchmark runs.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import sys
import time

import attnx

from . import _cases, _peers, _report
from ._machine import CpuShare, GiB, Limits, MiB, machine_info
from ._suite import Bench, finalize, run_all
from ._timing import HOW_TIMED, Progress

__all__ = ["run"]


def _peer_versions(bench):
    return {
        "torch": bench.torch[0].__version__ if bench.torch else None,
        "onnxruntime": bench.ort[0].__version__ if bench.ort else None,
    }


def _who(bench):
    names = ["attnx"] + [
        n for n, mods in (("torch", bench.torch), ("onnxruntime", bench.ort)) if mods
    ]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def _measure(cases, bench, log):
    """Limits, every case, limits again; returns (rows as JSON, limits, elapsed, others' share)."""
    t0 = time.perf_counter()
    share = CpuShare()
    limits = Limits(
        bench.threads,
        secs=0.1 if bench.tiny else 0.2 if bench.quick else 0.4,
        nbytes=(256 * MiB) if bench.tiny else GiB,
        log=log,
        row_bytes=[c.shape.work() for c in cases if c.row_kind == "bytes"],
    )
    limits.probe()
    rows = run_all(cases, bench)
    limits.probe(again=True)
    finalize(rows, limits)
    return [r.to_json() for r in rows], limits.values, time.perf_counter() - t0, share.others()


def _start_log(bench, log):
    log(
        f"attnx {attnx.__version__} bench: {bench.threads} threads, ISA "
        f"{attnx.cpu_features()['isa']}, repeat {bench.repeat}"
        + (", quick" if bench.quick else "")
        + (", TINY shapes (numbers meaningless)" if bench.tiny else "")
    )
    if bench.torch is None:
        log("torch not installed: the torch column is skipped (pip install 'attnx[bench]')")
    if bench.ort is None:
        log("onnxruntime (and onnx) not installed: the onnxruntime column is skipped")


def run(
    *,
    threads=None,
    repeat=None,
    quick=False,
    tiny=False,
    json_path=None,
    plot_path=None,
    cases=None,
    in_loop=False,
    title=None,
    log=None,
    out=None,
):
    """Runs the benchmark (the fixed suite, or ``cases`` from ``_cases.custom`` /
    ``_cases.from_config``), and with ``in_loop`` the in-loop rows (``_cases.in_loop``); prints
    the table; returns the result dict (what --json saves)."""
    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    out = out or sys.stdout
    tiny = tiny or os.environ.get("ATTNX_BENCH_TINY", "") not in ("", "0")
    threads, repeat = _counts(threads, repeat, quick or tiny)
    if plot_path:  # fail before the minutes of measuring, not after
        _report.require_matplotlib()
    bench = Bench(
        threads, repeat, quick, tiny, Progress(0), _peers.load_torch(), _peers.load_onnxruntime()
    )
    if cases is None:
        cases = _cases.suite(tiny=tiny, quick=quick, threads=threads, repeat=repeat)
    if in_loop:
        cases = [*cases, *_cases.in_loop(tiny=tiny)]
    load_before = [round(x, 2) for x in os.getloadavg()]
    _start_log(bench, log)
    prev_torch_threads = bench.torch[0].get_num_threads() if bench.torch else None
    try:
        rows, limits, elapsed, others = _measure(cases, bench, log)
    finally:
        if bench.torch:
            bench.torch[0].set_num_threads(prev_torch_threads)
    log(f"done in {elapsed:.0f} s")
    config = dict(threads=threads, repeat=repeat, quick=quick, tiny=tiny, in_loop=in_loop)
    result = _result(bench, title, config, limits, elapsed, others, rows, load_before)
    _print(result, out)
    _save(result, json_path, plot_path, log)
    return result


def _result(bench, title, config, limits, elapsed, others, rows, load_before):
    """The result dict of a run (what --json saves), stamped now."""
    repeat = config["repeat"]
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "title": title,
        "config": config,
        "machine": machine_info(config["threads"], _peer_versions(bench)),
        "limits": limits,
        "timing": HOW_TIMED.format(rounds=f"{repeat} round" + "s" * (repeat != 1), who=_who(bench)),
        "loadavg_before": load_before,
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "elapsed_s": elapsed,
        "others_cpu_share": others,
        "rows": rows,
    }


def _counts(threads, repeat, short):
    """``(threads, repeat)`` checked, with their defaults (fewer rounds for a short run)."""
    for name, n in (("threads", threads), ("repeat", repeat)):
        if n is not None and not (isinstance(n, int) and not isinstance(n, bool) and n >= 1):
            raise ValueError(f"{name}: expected a positive int or None, got {n!r}")
    threads = threads if threads is not None else attnx.get_num_threads()
    repeat = repeat if repeat is not None else (3 if short else 7)
    return threads, repeat


def _save(result, json_path, plot_path, log):
    """The result as JSON and as a plot, where asked."""
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=1, default=float)
        log(f"wrote {json_path}")
    if plot_path:
        _report.plot(result, plot_path)
        log(f"wrote {plot_path}")


def _print(result, out):
    print(_report.format_header(result), file=out)
    if result["title"]:
        print(result["title"], file=out)
    print(file=out)
    print(_report.format_table(result["rows"]), file=out)
    footer = _report.format_footer(result)
    if footer:
        print(file=out)
        print(footer, file=out)
