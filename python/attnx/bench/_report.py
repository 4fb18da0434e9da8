"""What a run shows: the header, the table (target and met? come from each case's declaration),
the JSON and the plot."""

from __future__ import annotations

import numpy as np

from ._machine import sized_reads

PEER_COLUMNS = (("torch", "× torch"), ("onnxruntime", "× onnxruntime"))


def fmt_time(s):
    if s is None:
        return "—"
    if s < 1e-3:
        return f"{s * 1e6:.2f} µs"
    if s < 1:
        return f"{s * 1e3:.2f} ms"
    return f"{s:.2f} s"


def fmt_x(x, est=False):
    if x is None:
        return "—"
    return ("~" if est else "") + (
        f"{x:.0f}×" if x >= 100 else f"{x:.2f}×" if x < 10 else f"{x:.1f}×"
    )


def _pct(r):
    x = r["pct_of_limit"]
    if x is None:
        return "—"
    return (f"{x:.1f}%" if x >= 1 or x == 0 else f"{x:.2g}%") + f" {r['limit_name']}"


def format_table(rows):
    """Markdown table of JSON rows (``Row.to_json``)."""
    head = [
        "case",
        "shape",
        "attnx median",
        "rate",
        "% of limit",
        "× NumPy",
        *(h for _, h in PEER_COLUMNS),
        "target",
        "met?",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        met = r["met_text"] or ("—" if r["met"] is None else "yes" if r["met"] else "NO")
        if r["notes"] and r["kind"] != "memory":
            met += " (" + "; ".join(r["notes"]) + ")"
        rate = f"{r['rate']:.1f} {r['rate_unit']}" if r["rate"] else "—"
        cells = [
            r["case"],
            r["shape"],
            fmt_time(r["attnx_s"]),
            rate,
            _pct(r),
            fmt_x(r["vs_numpy"], r["numpy_estimated"]),
            *(fmt_x(r[f"vs_{p}"]) for p, _ in PEER_COLUMNS),
            r["target"],
            met,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_header(result):
    m, lim = result["machine"], result["limits"]
    topo, v = m["topology"], m["versions"]
    smt = topo.get("smt_siblings_present")
    peers = "; ".join(f"{p} {v.get(p) or 'not installed'}" for p, _ in PEER_COLUMNS)
    share = result["others_cpu_share"]
    return "\n".join(
        [
            f"attnx {v['attnx']} — {result['date']}",
            f"CPU: {m['cpu_model']}; {topo['usable_cpus']} CPUs usable, "
            f"{topo.get('physical_cores')} physical cores"
            + (" (SMT siblings)" if smt else " (no SMT siblings)" if smt is False else ""),
            f"threads: {m['threads']}; ISA: {m['isa']}; numpy {v['numpy']}; {peers}; "
            f"source {m['build']['git'] or '?'}, core built {m['build']['core_mtime'] or '?'}",
            f"limits: FMA peak {lim['fma_gflops_all']:.1f} GFLOP/s ({lim['threads']} thr), "
            f"{lim['fma_gflops_1']:.1f} GFLOP/s (1 thr); read bandwidth {lim['read_gbps_all']:.1f} GB/s"
            + "".join(f"; {mib} MiB {v:.1f}" for mib, v in sized_reads(lim)),
            result["timing"],
            f"load average before/after: {result['loadavg_before']} / {result['loadavg_after']}; "
            "other processes' CPU share during the run: "
            + (f"{100 * share:.0f}%" if share is not None else "n/a"),
        ]
    )


def format_footer(result):
    rows = result["rows"]
    judged = [r for r in rows if r["target"] != "—"]
    lines = []
    if judged:
        missed = [r["case"] for r in judged if r["met"] is False]
        lines.append("targets missed: " + (", ".join(missed) if missed else "none"))
    skipped = {}
    for r in rows:
        for why in r["extra"].get("peers_skipped", {}).values():
            skipped.setdefault(why, []).append(r["case"])
    lines += [f"—: {why} ({', '.join(cases)})" for why, cases in skipped.items()]
    share = result["others_cpu_share"]
    if share is not None and share > 0.05:
        lines.append(
            f"note: other processes used {100 * share:.0f}% of the CPUs during the run: "
            "absolute numbers are noisy; the ratios were measured interleaved."
        )
    return "\n".join(lines)


def require_matplotlib():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit(
            "--plot needs matplotlib: pip install 'attnx[bench]' (or matplotlib)"
        ) from None
    return plt


def _why_no_pct(r):
    """The text drawn where a row has no "% of limit" bar."""
    if r["kind"] == "latency":
        return f"latency row, not a rate: {fmt_time(r['attnx_s'])} ({r['target']})"
    if r["kind"] == "memory" and r["met_text"]:
        return "memory row, not a rate: " + r["met_text"].split(": ", 1)[-1]
    return "not measured" + (f" ({r['notes'][0]})" if r["notes"] else "")


def _peer_panel(ax, rows, y):
    """Speed-up over each peer that ran, grouped per row, on a log axis."""
    width = 0.8 / len(PEER_COLUMNS)
    colors = {"torch": "tab:blue", "onnxruntime": "tab:purple"}
    for j, (peer, _) in enumerate(PEER_COLUMNS):
        label = peer
        for i, r in enumerate(rows):
            x = r[f"vs_{peer}"]
            if not x:
                continue
            yy = y[i] - 0.4 + width * (j + 0.5)
            ax.barh(yy, x, height=width, color=colors[peer], label=label)
            ax.text(x, yy, " " + fmt_x(x), va="center", fontsize=7)
            label = None
    why = {
        "threads": "  attnx 1 vs N threads: see the right panel",
        "memory": "  memory row: attnx only",
        "in_loop": "  in-loop row: attnx after a matmul",
    }
    for i, r in enumerate(rows):
        if not any(r[f"vs_{p}"] for p, _ in PEER_COLUMNS):
            ax.text(
                1.0,
                y[i],
                why.get(r["kind"], "  no peer ran this row"),
                va="center",
                fontsize=7,
                color="gray",
            )
    ax.set_xscale("log")
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_xlabel("attnx speed-up over each peer (×, log scale; > 1: attnx faster)")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="lower right", fontsize=8)


def _limit_panel(ax, rows, y):
    """% of the measured limit for the rate rows; the others say in words why they have no bar."""
    for i, r in enumerate(rows):
        x = r["pct_of_limit"]
        if x is None or r["kind"] in ("latency", "memory"):
            ax.text(1, y[i], _why_no_pct(r), va="center", fontsize=7, color="gray")
            continue
        ax.barh(
            y[i], x, color="tab:green" if r["met"] else "gray" if r["met"] is None else "tab:red"
        )
        ax.text(x, y[i], f" {x:.0f}% {r['limit_name']}", va="center", fontsize=8)
    ax.set_xlim(0, max([110] + [r["pct_of_limit"] or 0 for r in rows if r["kind"] != "memory"]))
    ax.set_xlabel("% of the measured limit (green: target met, red: missed, gray: no target)")


def plot(result, path):
    """Two panels: attnx's speed-up over each peer, and % of the machine's measured limit."""
    plt = require_matplotlib()
    rows = result["rows"]
    fig, axes = plt.subplots(1, 2, figsize=(14, 0.5 * len(rows) + 1.8), sharey=True)
    y = np.arange(len(rows))
    _peer_panel(axes[0], rows, y)
    _limit_panel(axes[1], rows, y)
    axes[0].set_yticks(y, [r["case"] for r in rows])
    axes[0].set_ylim(len(rows) - 0.4, -0.6)  # first row on top, room for the last row's text
    m = result["machine"]
    fig.suptitle(
        f"attnx {m['versions']['attnx']} — {m['cpu_model']}, {m['threads']} threads, {m['isa']}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
