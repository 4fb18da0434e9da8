"""Smoke tests of `python -m attnx` and `python -m attnx bench`: they run, print the seed's numbers
and write valid JSON with every row. No timing assertions (the machines are shared and noisy)."""

import json
import os
import subprocess
import sys
from dataclasses import replace
from types import SimpleNamespace

import attnx

from helpers import PATHS

# (chunk_bf16, against the vector path that AMX replaces, only where the amx path runs)
ROWS = ["prefill", "gqa_causal", "prefill_bf16", "gqa_causal_bf16", "causal_bf16"]
ROWS += ["chunk_bf16"] if attnx.cpu_features()["isa"] == "amx" else []
ROWS += [
    "prefill_fp32_bf16",
    "prefill_fp16",
    "encoder",
    "decode_f32",
    "decode_fp16",
    "decode_bf16",
    "decode_int8",
    "decode_fp8",
    "decode_int8fq",
    "fork_mha_unshared",
    "fork_mha",
    "fork_gqa_unshared",
    "fork_gqa",
    "decode_long",
    "decode_long_fp16",
    "decode_long_int8",
    "decode_long_fp8",
    "decode_long_int8fq",
    "small",
    "threads",
    "memory",
    "delta_prefill",
    "delta_decode",
]
ROW_KEYS = {
    "key",
    "case",
    "shape",
    "kind",
    "target",
    "attnx_s",
    "numpy_s",
    "torch_s",
    "rate",
    "rate_unit",
    "pct_of_limit",
    "vs_numpy",
    "vs_torch",
    "met",
    "met_text",
    "samples",
}


def _run(args, tmp_path, env_extra=None, timeout=120):
    env = dict(os.environ)
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, "-m", "attnx", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_info_prints_the_seed_example(tmp_path):
    res = _run([], tmp_path, timeout=60)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "attnx " in out and "instruction set:" in out and "threads:" in out
    # the seed's two-head worked example for "river"
    assert "[0.401, 0.198, 0.401]" in out
    assert "[0.802, 0.599]" in out
    assert "[0.503, 0.248]" in out
    assert "[0.802, 0.599, 0.503, 0.248]" in out


def _has_matplotlib():
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _check_header(result):
    """The JSON's top level: the run's date, config, machine and probed limits."""
    assert {"date", "config", "machine", "limits", "rows", "others_cpu_share"} <= set(result)
    m = result["machine"]
    assert m["cpu_model"] and m["threads"] == 2 and m["isa"] in PATHS
    assert m["versions"]["numpy"] and "torch" in m["versions"]
    lim = result["limits"]
    assert lim["fma_gflops_all"] > 0 and lim["fma_gflops_1"] > 0 and lim["read_gbps_all"] > 0


def _check_sized_reads(lim, rows):
    """Each bandwidth row's % is taken against the read probe of its own size, named in the row."""
    for key in ("decode_f32", "decode_long", "decode_int8"):
        r = rows[key]
        size = _machine.read_probe_size(r["rate"] * r["attnx_s"] * 1e9)
        gbps = lim[_machine.read_key(size)]
        assert gbps > 0 and r["limit_name"] == f"read BW ({size // _machine.MiB} MiB)", key
        assert r["pct_of_limit"] == pytest.approx(100 * r["rate"] / gbps), key


def _check_rows(rows, m):
    """Every row, in order, with every field and a time; the rates and ratios of the main rows."""
    assert list(rows) == ROWS
    for key, r in rows.items():
        assert set(r) >= ROW_KEYS, key
        assert r["attnx_s"] is not None and r["attnx_s"] > 0, key
        assert r["met"] in (True, False, None), key
    for key in ("prefill", "gqa_causal", "encoder", "decode_f32", "decode_long"):
        assert rows[key]["rate"] > 0 and rows[key]["vs_numpy"] > 0
        if m["versions"]["torch"]:
            assert rows[key]["vs_torch"] > 0
    assert rows["memory"]["extra"]["rss_growth_bytes"] >= 0
    assert "tokens_per_s_vs_fp32" in rows["decode_fp16"]["extra"]


def _check_fork_rows(rows):
    """Shared-prefix rows: the ratio to the unshared row and its bound. Sharing cuts bytes, never
    FLOPs, so the bound is >= 1 by construction, and exactly 1 where the probed limits put the
    step on the FLOP bound (GQA on a fast memory system; every row under the sanitizers, whose
    FMA probe is instrumented): which one a run sees depends on the machine."""
    for key in ("fork_mha", "fork_gqa"):
        assert rows[key]["extra"]["bound_vs_unshared"] >= 1.0, key
        assert "× unshared (bound" in rows[key]["met_text"], key


def _check_bf16_rows(rows, m):
    """bf16 and fp16 prefill rows (issues 13 and 33): targets against fp32 that follow the path,
    their fp32 base timed in the same rounds; chunk_bf16 against the vector path AMX replaces."""
    for key in ("prefill_bf16", "gqa_causal_bf16", "causal_bf16"):
        # the target follows the path: 4x our fp32 with AMX tiles, else never slower than the
        # same inputs widened to fp32 (issue 33's rule)
        fp32 = f"≥ 4× fp32 {'GQA ' if 'gqa' in key else ''}prefill"
        target = fp32 if m["isa"] == "amx" else "≥ 1× widening to fp32"
        assert rows[key]["rate"] > 0 and target in rows[key]["target"], rows[key]["target"]
        assert m["isa"] in ("amx", "avx512bf16") or any(
            "AVX512_BF16" in n or "fp32-widening" in n or "not active" in n
            for n in rows[key]["notes"]
        ), key
        # its fp32 base timed in the same rounds, sample by sample
        assert len(rows[key]["samples"]["attnx fp32"]) == len(rows[key]["samples"]["attnx"]), key
        assert rows[key]["extra"]["base_interleaved_s"] > 0, key
    # float32 on bf16 products: its float32 base (the prefill row's call) timed in the same
    # rounds, the peers (torch's float32 SDPA) checked at bf16's tolerance
    fp32_bf16 = rows["prefill_fp32_bf16"]
    assert "bf16 products" in fp32_bf16["shape"] and "fp32 prefill" in fp32_bf16["target"]
    assert ("≥ 3× fp32" in fp32_bf16["target"]) == (m["isa"] == "amx")
    assert fp32_bf16["extra"]["base_interleaved_s"] > 0
    assert not any("differs from attnx" in n for n in fp32_bf16["notes"]), fp32_bf16["notes"]
    # fp16 prefill: never slower than widening to fp32 on any path, that base timed in the same
    # rounds
    fp16 = rows["prefill_fp16"]
    assert "≥ 1× widening to fp32" in fp16["target"] and fp16["rate"] > 0, fp16["target"]
    assert len(fp16["samples"]["attnx fp32"]) == len(fp16["samples"]["attnx"])
    assert fp16["extra"]["base_interleaved_s"] > 0
    if "chunk_bf16" in rows:  # against the vector path, timed in the same rounds
        assert "vector path" in rows["chunk_bf16"]["target"], rows["chunk_bf16"]["target"]
        assert rows["chunk_bf16"]["extra"]["path_interleaved_s"] > 0


def _check_quantised_rows(rows):
    """int8 and fp8 decode rows (issue 13; int8 with the default query, integer where the path has
    integer products: issue 33), and int8 with the float query: tokens/s against fp16 and fp32."""
    default = "integer query" if attnx.int8_query() else "float query"
    for key in ("decode", "decode_long"):
        for kind in ("int8", "fp8", "int8fq"):
            row = rows[f"{key}_{kind}"]
            assert {"tokens_per_s_vs_fp16", "tokens_per_s_vs_fp32"} <= set(row["extra"]), row
            assert "fp16 tokens/s" in row["target"] and row["vs_numpy"] > 0, row
        assert rows[f"{key}_int8"]["case"].endswith(f"int8 KV, {default}")
        assert rows[f"{key}_int8fq"]["case"].endswith("int8 KV, float query")


def test_bench_quick_writes_valid_json(tmp_path):
    # ATTNX_BENCH_TINY shrinks every shape so this runs in seconds; the numbers mean nothing.
    plot = ["--plot", "bench.png"] if _has_matplotlib() else []
    res = _run(
        ["bench", "--quick", "--json", "tmp.json", "--threads", "2", *plot],
        tmp_path,
        {"ATTNX_BENCH_TINY": "1"},
    )
    assert res.returncode == 0, res.stderr
    assert "[1/" in res.stderr  # progress goes to stderr
    result = json.loads((tmp_path / "tmp.json").read_text())
    _check_header(result)
    m = result["machine"]
    rows = {r["key"]: r for r in result["rows"]}
    _check_rows(rows, m)
    _check_fork_rows(rows)
    _check_bf16_rows(rows, m)
    _check_quantised_rows(rows)
    _check_sized_reads(result["limits"], rows)
    # the table is printed
    assert "| case | shape |" in res.stdout and "targets missed:" in res.stdout
    if plot:
        assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_plot_without_matplotlib_is_a_clear_error(tmp_path):
    # hide matplotlib behind a package that fails to import; the bench must refuse up front
    fake = tmp_path / "fake" / "matplotlib"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('hidden by the test')\n")
    path = os.pathsep.join(filter(None, [str(tmp_path / "fake"), os.environ.get("PYTHONPATH")]))
    res = _run(
        ["bench", "--quick", "--plot", "x.png"],
        tmp_path,
        {"ATTNX_BENCH_TINY": "1", "PYTHONPATH": path},
        timeout=60,
    )
    assert res.returncode != 0
    assert "--plot needs matplotlib" in res.stderr
    assert "[1/" not in res.stderr  # it failed before measuring anything


# ---- your own shape, a model's config, the declarations, the onnxruntime peer -----------------

import importlib.util  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from attnx import reference  # noqa: E402
from attnx.bench import _cases, _machine, _peers, _suite  # noqa: E402
from attnx.bench._timing import Progress  # noqa: E402

HAS_ORT = all(importlib.util.find_spec(m) is not None for m in ("onnxruntime", "onnx"))
FAST = ["--quick", "--repeat", "1", "--threads", "2"]


def _rows(tmp_path, args, name):
    res = _run(["bench", *FAST, "--json", name, *args], tmp_path, {"ATTNX_BENCH_TINY": "1"})
    assert res.returncode == 0, res.stderr
    return res, json.loads((tmp_path / name).read_text())["rows"]


QUERY_KIND = "integer query" if attnx.int8_query() else "float query"  # (int8 pages' default)


@pytest.mark.parametrize(
    "case, lens, expect",
    [
        (
            "prefill",
            ["--seq", "48,80"],
            ["B1 Hq4 Hkv2 S48 D32 causal", "B1 Hq4 Hkv2 S80 D32 causal"],
        ),
        ("decode", ["--context", "70"], ["B1 Hq4 Hkv2 Sq1 Sk70 D32"]),
        (
            "paged-decode",
            ["--context", "70", "--kv-dtype", "fp16"],
            ["B1 Hq4 Hkv2 L70 D32 block16 fp16 KV"],
        ),
        (
            "paged-decode",
            ["--context", "70", "--kv-dtype", "int8"],
            [f"B1 Hq4 Hkv2 L70 D32 block16 int8 KV, {QUERY_KIND}"],
        ),
    ],
)
def test_bench_case_times_one_shape(tmp_path, case, lens, expect):
    res, rows = _rows(
        tmp_path, ["--case", case, "--heads", "4:2", "--head-dim", "32", *lens], "c.json"
    )
    assert [r["shape"] for r in rows] == expect
    for r in rows:
        assert r["attnx_s"] > 0 and r["rate"] > 0 and r["vs_numpy"] > 0
        assert r["target"] == "—" and r["met"] is None  # no targets for a user's shape
        if r["onnxruntime_s"] is not None:
            assert r["extra"]["max_abs_diff_vs_onnxruntime"] < 5e-2
    assert "| case | shape |" in res.stdout and "timing: " in res.stdout
    assert "[1/" in res.stderr


def test_bench_config_times_a_models_prefill_and_decode(tmp_path):
    cfg = {
        "_name_or_path": "org/tiny-model",
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_size": 128,
        "sliding_window": 40,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    res, rows = _rows(
        tmp_path, ["--config", "config.json", "--seq", "64", "--context", "50,90"], "m.json"
    )
    assert [r["case"] for r in rows] == [
        "tiny-model prefill S=64",
        "tiny-model paged-decode L=50",
        "tiny-model paged-decode L=90",
    ]
    assert all(
        r["declaration"]["shape"]["window"] == 40 and r["declaration"]["shape"]["D"] == 32
        for r in rows
    )
    assert "model tiny-model: heads 4:2, head dim 32, sliding window 40" in res.stdout
    _, rows = _rows(
        tmp_path,
        ["--config", "config.json", "--seq", "64", "--context", "50", "--kv-dtype", "fp8"],
        "q.json",
    )
    assert ["fp8 KV" in r["shape"] for r in rows] == [False, True]  # the prefill row runs in fp32


@pytest.mark.parametrize(
    "args, message",
    [
        (["--case", "prefill", "--heads", "6:4"], "--heads"),
        (["--case", "decode", "--context", "0"], "--context"),
        (["--case", "prefill", "--batch", "0"], "--batch"),
        (["--config", "missing.json"], "--config"),
        (["--case", "decode", "--config", "x.json"], "--case and --config"),
        (["--case", "prefill", "--kv-dtype", "int8"], "--kv-dtype int8"),
    ],
)
def test_bench_own_shape_errors_name_the_flag_before_measuring(tmp_path, args, message):
    res = _run(["bench", *args], tmp_path, {"ATTNX_BENCH_TINY": "1"}, timeout=60)
    assert res.returncode == 2 and message in res.stderr
    assert "[1/" not in res.stderr


def test_read_config_head_dim_and_kv_heads_defaults(tmp_path):
    from attnx.__main__ import _model

    p = tmp_path / "c.json"
    p.write_text(
        json.dumps(
            {
                "text_config": {
                    "num_attention_heads": 8,
                    "hidden_size": 512,
                    "head_dim": 128,
                    "use_sliding_window": False,
                    "sliding_window": 4096,
                    "model_type": "m",
                }
            }
        )
    )
    assert _model(p) == {"name": "m", "heads": (8, 8), "head_dim": 128, "window": None}


def _judged(case, **measured):
    row = _suite.Row(case)
    for k, v in measured.items():
        setattr(row, k, v)
    if row.rate is None and case.shape.kind == case.row_kind:
        row.rate = 1.0
    _cases.judge(row, {case.key: row})
    return row


def test_met_column_comes_from_the_declared_goals():
    case = _cases.Case(
        "p",
        "prefill",
        _cases.Dense(1, 8, 8, 2048, 2048, 64),
        (_cases.PctOfLimit(70), _cases.FasterThan("torch", 1.5)),
    )
    assert _cases.target_text(_suite.Row(case)) == "≥ 70% FMA peak; ≥ 1.5× torch"
    assert (
        _judged(case, pct_of_limit=72.0, vs={"torch": 1.6}).met_text == "yes: 72% peak, 1.60× torch"
    )
    missed = _judged(case, pct_of_limit=72.0, vs={"torch": 1.2})
    assert missed.met is False and missed.met_text == "NO: 72% peak, 1.20× torch"
    unknown = _judged(case, pct_of_limit=72.0)  # no torch installed: cannot say
    assert unknown.met is None and unknown.met_text == "?: 72% peak, torch n/a"
    latency = _cases.Case(
        "s",
        "small",
        _cases.Dense(1, 1, 1, 1, 16, 64),
        (_cases.AtMostLatency(5e-6),),
        kind="latency",
    )
    assert _judged(latency, attnx_s=3e-6).met_text == "yes: 3.0 µs"
    assert _judged(_cases.Case("x", "x", _cases.Paged(1, 4, 2, 64, 32))).met_text == "—"


def test_suite_declares_each_target_once():
    cases = _cases.suite(tiny=True, quick=True, threads=2, repeat=3)
    assert [c.key for c in cases] == ROWS
    for c in cases:
        assert c.goals, c.key
        assert _cases.target_text(_suite.Row(c))


def test_work_counts_only_visible_keys():
    full = _cases.Dense(2, 4, 2, 8, 8, 16)
    assert full.work() == 4.0 * 2 * 4 * 8 * 8 * 16
    assert _cases.Dense(1, 1, 1, 4, 4, 1, causal=True).keys_seen() == 10
    assert _cases.Dense(1, 1, 1, 4, 4, 1, causal=True, window=2).keys_seen() == 7
    assert (
        _cases.Paged(3, 8, 2, 100, 64, dtype="fp16", window=30).work() == 2.0 * 2 * 64 * 2 * 3 * 30
    )


def test_a_peer_that_disagrees_is_not_timed():
    case = _cases.Case("d", "d", _cases.Dense(1, 2, 2, 8, 8, 16, causal=True))
    data = _peers.dense_inputs(case.shape, 0)
    impls = {
        "attnx": _peers.attnx_dense(case.shape, data, 1),
        "torch": _peers.Impl(lambda: None, lambda: np.zeros((1, 2, 8, 16), np.float32)),
    }
    row = _suite.Row(case)
    _suite._check_peers(row, impls)
    assert list(impls) == ["attnx"] and "torch differs from attnx" in row.notes[0]


@pytest.mark.skipif(
    not HAS_ORT, reason="onnxruntime and onnx not installed (pip install 'attnx[bench]')"
)
@pytest.mark.parametrize(
    "shape",
    [
        _cases.Dense(2, 8, 2, 40, 40, 32, causal=True),
        _cases.Dense(1, 4, 2, 40, 40, 32, causal=True, window=9),
        _cases.Dense(2, 4, 1, 1, 70, 32, causal=True, dtype="fp16"),
        _cases.Paged(2, 8, 2, 75, 64, block=16),
        _cases.Paged(2, 4, 2, 75, 32, block=8, window=20, dtype="fp16"),
    ],
)
def test_onnxruntime_gqa_peer_matches_attnx(shape):
    ort = _peers.load_onnxruntime()
    data = (
        _peers.paged_inputs(shape, 3)
        if isinstance(shape, _cases.Paged)
        else _peers.dense_inputs(shape, 3)
    )
    mine = (
        _peers.attnx_paged(shape, data, 1)
        if isinstance(shape, _cases.Paged)
        else _peers.attnx_dense(shape, data, 1)
    ).result()
    theirs = _peers.ort_impl(ort, shape, data, 1).result()
    assert theirs.shape == mine.shape
    np.testing.assert_allclose(theirs, mine, atol=_suite.TOLERANCE[shape.dtype] / 2)


def test_a_peer_that_cannot_set_up_is_skipped_with_its_reason(monkeypatch):
    # seen: onnx 1.23 wrote IR 14 that onnxruntime 1.30 refused, and the whole bench stopped
    def refuse(*args):
        raise RuntimeError("Unsupported model IR version: 14, max supported IR version: 13\nmore")

    monkeypatch.setattr(_peers, "ort_impl", refuse)
    case = _cases.Case("d", "d", _cases.Dense(1, 2, 2, 8, 8, 16, causal=True))
    bench = SimpleNamespace(threads=1, torch=None, ort=("stand-in",))
    impls, skipped = _suite._impls(case, _peers.dense_inputs(case.shape, 0), bench)
    assert list(impls) == ["attnx"]
    assert skipped == {
        "onnxruntime": "could not run here: RuntimeError: Unsupported model IR version: 14, "
        "max supported IR version: 13"
    }


@pytest.mark.skipif(
    not HAS_ORT, reason="onnxruntime and onnx not installed (pip install 'attnx[bench]')"
)
def test_onnxruntime_model_declares_the_oldest_ir_its_opsets_allow(monkeypatch):
    import onnx

    mods = _peers.load_onnxruntime()
    made = []
    monkeypatch.setattr(
        mods[0],
        "InferenceSession",
        lambda model, *a, **k: made.append(onnx.load_from_string(model)),
    )
    _peers._gqa_session(mods, _cases.Dense(1, 2, 2, 8, 8, 16, causal=True), False, 1)
    assert made[0].ir_version == 8  # opset 17's; onnx 1.23 would write 14


def test_onnxruntime_skips_what_gqa_cannot_run():
    assert "bf16" in _peers.ort_skip_reason(_cases.Paged(1, 2, 2, 8, 8, dtype="bf16"))
    assert _peers.ort_skip_reason(_cases.Dense(1, 2, 2, 8, 8, 8)) is not None  # not causal
    assert _peers.ort_skip_reason(_cases.Dense(1, 2, 2, 8, 8, 8, causal=True)) is None


class _Stream:
    def __init__(self, tty):
        self.tty, self.text = tty, ""

    def isatty(self):
        return self.tty

    def write(self, s):
        self.text += s

    def flush(self):
        pass


@pytest.mark.parametrize("tty", [True, False])
def test_progress_line_in_place_on_a_terminal_plain_lines_otherwise(tty):
    s = _Stream(tty)
    p = Progress(2, s)
    p.start("prefill")
    p.phase("round 1/3")
    p.done("1 ms")
    if tty:
        assert s.text.count("\r\x1b[K") == 3 and "round 1/3" in s.text and s.text.endswith("1 ms\n")
    else:
        assert s.text == "[1/2] prefill ...\n[1/2] prefill: 1 ms\n"


def test_rate_over_judges_the_base_timed_in_the_same_rounds():
    """bf16 over fp32 prefill: the ratio of the two calls timed alternately in one row, not of
    two rows timed minutes apart (those only where the row has no interleaved base)."""
    goal = _cases.RateOver("prefill", 1.6, "fp32 prefill")
    case = _cases.Case(
        "b", "prefill bf16", _cases.Dense(1, 8, 8, 2048, 2048, 64, dtype="bf16"), (goal,)
    )
    base = _suite.Row(_cases.Case("prefill", "prefill", _cases.Dense(1, 8, 8, 2048, 2048, 64)))
    base.rate = 100.0
    row = _suite.Row(case)
    row.attnx_s, row.rate = 0.03, 190.0
    assert goal.value(row, {"prefill": base}) == pytest.approx(1.9)  # the other row: fallback
    row.extra["base_interleaved_s"] = 0.05
    assert goal.value(row, {"prefill": base}) == pytest.approx(0.05 / 0.03)
    bench = _suite.Bench(1, 3, True, True, Progress(1, _Stream(False)))
    assert _suite._interleaved_base(case, bench, None) is not None
    assert _suite._interleaved_base(base.spec, bench, None) is None  # an fp32 row has no base


def test_widening_base_attends_the_rows_own_inputs_in_fp32():
    """Issue 33's rule (a 16-bit dtype's path never slower than widening to fp32): the base is
    the row's own inputs widened, attended in fp32 and rounded back, into buffers made once; it
    gives the row's result to the dtype's rounding, and its inputs are left as they were."""
    shape = _cases.Dense(1, 2, 2, 40, 40, 16, causal=True, dtype="bf16")
    goal = _cases.widening("prefill")
    case = _cases.Case("b", "prefill bf16", shape, (goal,))
    assert goal.text(_suite.Row(case)) == "≥ 1× widening to fp32"
    data = _suite._inputs(shape, 1)
    before = [a.copy() for a in data[:3]]
    bench = _suite.Bench(1, 3, True, True, Progress(1, _Stream(False)))
    fn = _suite._interleaved_base(case, bench, data)
    widened = _peers.attnx_widened(shape, data, 1)
    mine = _peers.attnx_dense(shape, data, 1)
    fn()
    np.testing.assert_allclose(widened.result(), mine.result(), atol=2e-2)
    for a, b in zip(data[:3], before):
        assert a.dtype == b.dtype and np.array_equal(a.view(np.uint16), b.view(np.uint16))
    assert widened.result().dtype == np.float32


def test_in_loop_row_times_attnx_after_a_matmul_against_alone():
    from dataclasses import replace

    case = replace(_cases.in_loop(tiny=True)[0], shape=_cases.Dense(1, 2, 2, 32, 32, 16))
    bench = _suite.Bench(1, 3, True, True, Progress(1, _Stream(False)))
    row = _suite.in_loop_case(case, bench)
    assert len(row.samples["attnx_after_matmul"]) == 3 and row.extra["slowdown"] > 0
    _cases.judge(row, {})
    assert row.met_text.endswith("× alone") and _cases.target_text(row) == "≤ 1.1× its time alone"


def test_bench_without_peers_still_runs_and_says_so(tmp_path):
    # torch and onnxruntime hidden behind packages that fail to import
    for name in ("torch", "onnxruntime"):
        fake = tmp_path / "fake" / name
        fake.mkdir(parents=True)
        (fake / "__init__.py").write_text("raise ImportError('hidden by the test')\n")
    path = os.pathsep.join(filter(None, [str(tmp_path / "fake"), os.environ.get("PYTHONPATH")]))
    res = _run(
        [
            "bench",
            *FAST,
            "--case",
            "decode",
            "--heads",
            "2",
            "--context",
            "40",
            "--head-dim",
            "16",
            "--json",
            "n.json",
        ],
        tmp_path,
        {"ATTNX_BENCH_TINY": "1", "PYTHONPATH": path},
    )
    assert res.returncode == 0, res.stderr
    assert (
        "torch not installed" in res.stderr and "onnxruntime (and onnx) not installed" in res.stderr
    )
    row = json.loads((tmp_path / "n.json").read_text())["rows"][0]
    assert row["vs_torch"] is None and row["vs_onnxruntime"] is None and row["vs_numpy"] > 0


def test_peers_that_would_need_an_s2_matrix_are_skipped_with_a_reason():
    big = _cases.Dense(1, 32, 8, 131072, 131072, 128, causal=True, window=4096)
    assert "GiB of attention probabilities" in _peers.ort_skip_reason(big)
    assert "boolean mask" in _peers.torch_skip_reason(big)
    assert _peers.torch_skip_reason(_cases.Dense(1, 32, 8, 2048, 2048, 128, causal=True)) is None


def test_quantised_rows_show_their_roofline_bound_over_the_measured_base_row():
    int8 = _cases.Paged(8, 32, 8, 2048, 128, dtype="int8")
    fp16 = replace(int8, dtype="fp16")
    base = SimpleNamespace(attnx_s=2e-3, spec=SimpleNamespace(shape=fp16))
    limits = {"read_gbps_all": 10.0, "fma_gflops_all": 1e9}  # bandwidth bound: the bytes' ratio
    floor = int8.work() / 10e9
    assert _cases.tokens_bound(int8, base, limits) == pytest.approx(2e-3 / floor)
    limits = {"read_gbps_all": 1e9, "fma_gflops_all": 200.0}  # FLOP bound: fewer bytes gain nothing
    assert _cases.tokens_bound(int8, base, limits) == pytest.approx(2e-3 / (int8.flops() / 200e9))
    assert _cases.tokens_bound(int8, SimpleNamespace(attnx_s=None, spec=base.spec), limits) is None
    goal = _cases.TokensOver("decode_fp16", 1.8, "fp16", bounded=True)
    row = SimpleNamespace(extra={"bound_vs_fp16": 1.04})
    assert goal.show(1.02, row) == "1.02× fp16 tokens/s (bound 1.0×)"
    assert (
        _cases.TokensOver("decode_f32", 3.5).show(2.5, SimpleNamespace(extra={}))
        == "2.50× fp32 tokens/s"
    )


def test_bandwidth_rows_are_taken_against_a_read_probe_of_their_own_size():
    MiB = _machine.MiB
    assert _machine.read_probe_size(1) == 2 * MiB
    assert _machine.read_probe_size(64 * MiB) == 64 * MiB
    assert _machine.read_probe_size(64 * MiB + 1) == 66 * MiB
    assert _machine.read_key(63 * MiB) == "read_gbps_64MiB"
    values = {"read_gbps_all": 30.0, "read_gbps_64MiB": 60.0, "fma_gflops_all": 1e9, "threads": 2}
    assert _machine.read_gbps(values, 63 * MiB) == (60.0, "64 MiB")
    assert _machine.read_gbps(values, 3 * MiB) == (30.0, None)  # no probe of that size: DRAM's
    assert _machine.read_gbps(values) == (30.0, None)
    assert _machine.sized_reads(values) == [(64, 60.0)]
    limits = _machine.Limits(2, secs=0.01, nbytes=8 * MiB, log=lambda s: None)
    limits.values = values
    assert limits.pct("bytes", 30.0, 63 * MiB) == (50.0, "read BW (64 MiB)")
    assert limits.pct("bytes", 30.0, 3 * MiB) == (100.0, "read BW")
    assert limits.pct("flops", 5e8, 63 * MiB) == (50.0, "FMA peak")
    # a step's roofline floor takes the bandwidth at its size
    step = _cases.Paged(1, 8, 8, 4096, 128, dtype="fp16")  # 16 MiB of K and V
    values["read_gbps_16MiB"] = 120.0
    assert _cases.least_seconds(step, values) == pytest.approx(step.work() / 120e9)
    # the probes run at each row's size, both times
    probed = _machine.Limits(
        2, secs=0.01, nbytes=8 * MiB, log=lambda s: None, row_bytes=[MiB, 3 * MiB]
    )
    probed.probe()
    assert {"read_gbps_2MiB", "read_gbps_4MiB"} <= set(probed.values)
    big = _machine.Limits(2, secs=0.01, nbytes=4 * MiB, log=lambda s: None, row_bytes=[5 * MiB])
    assert big.sizes == []  # no probe as large as the DRAM one: such a row is taken against it
    assert all(v > 0 for _, v in _machine.sized_reads(probed.values))


def test_shared_prefix_rows_count_the_bytes_read_once_and_their_bound():
    copies = _cases.Paged(16, 8, 8, 4097, 128, dtype="fp16")
    forks = replace(copies, shared=4096)
    assert forks.keys_seen() == 16 * 4097 - 15 * 4096 and forks.flops() == copies.flops()
    limits = {"read_gbps_all": 10.0, "fma_gflops_all": 1e9}  # bandwidth bound: sharing gains ~16x
    assert _cases.shared_bound(forks, copies, limits) == pytest.approx(copies.work() / forks.work())
    limits["fma_gflops_all"] = 1.0  # FLOP bound: sharing cannot help
    assert _cases.shared_bound(forks, copies, limits) == pytest.approx(1.0)
    data = _peers.paged_inputs(_cases.Paged(3, 2, 1, 40, 8, block=4, shared=32), 0)
    bt = data[3]
    assert (bt[:, :8] == bt[0, :8]).all() and len(set(bt[:, 8:].ravel()) | set(bt[0, :8])) == 14


def test_bf16_ratio_script_runs():
    """bench/ratio.py (bf16, and fp32 on bf16 products, against fp32 prefill, interleaved) runs
    and prints each row's rate and ratio."""
    script = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "bench", "ratio.py")
    res = subprocess.run(
        [sys.executable, script, "--seconds", "0.05"], capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr
    for row in ("fp32 ", "fp32 bf16 products ", "bf16 "):
        assert f"\n  {row}" in res.stdout and "GFLOP/s), x fp32: best" in res.stdout, res.stdout


def test_one_shot_script_runs_its_steps_and_logs_each(tmp_path):
    # bench/one_shot.sh (a borrowed machine's unattended run): its machine step, under its own
    # limit, with a line in steps.log; an unknown step is not run
    root = os.path.join(os.path.dirname(__file__), "..", "..")
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), STEPS="machine nosuchstep", PYTHON=sys.executable)
    r = subprocess.run(
        ["bash", os.path.join(root, "bench", "one_shot.sh")],
        capture_output=True,
        text=True,
        env=env,
        cwd=root,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    steps = (out / "steps.log").read_text()
    assert "machine: rc 0" in steps and "nosuchstep" not in steps
    assert "nproc:" in (out / "machine.log").read_text()


def test_int8_rows_run_their_query():
    """An int8 row with ``int8_query`` True or False calls attnx with that query (its result is the
    reference's twin of it) and leaves the setting as it was; None runs the default."""
    shape = _cases.Paged(2, 8, 2, 100, 64, dtype="int8")
    data = _peers.paged_inputs(shape, 0)
    q, kp, vp, bt, sl, scales = data
    twin = reference.paged_attention(q, kp, vp, bt, sl, int8_query=True, **scales)
    plain = reference.paged_attention(q, kp, vp, bt, sl, **scales)
    assert np.max(np.abs(twin - plain)) > 1e-5
    before = attnx.set_int8_query(None)
    try:
        for iq, want in ((True, twin), (False, plain), (None, (plain, twin)[attnx.int8_query()])):
            got = _peers.attnx_paged(replace(shape, int8_query=iq), data, 1).result()
            assert attnx._core.int8_query_setting() == -1
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=str(iq))
    finally:
        attnx.set_int8_query(before)


def test_settle_calls_for_as_long_as_a_sample_and_at_least_once():
    """Each interleaved sample follows untimed calls for sample_s, not one call: after another
    library's calls, a call of a few milliseconds read 15-70% slow (bench/NOTES.md)."""
    import time

    from attnx.bench import _timing

    calls = []
    _timing.settle(lambda: calls.append(1), 0.0)
    assert len(calls) == 1
    t0 = time.perf_counter()
    _timing.settle(lambda: calls.append(1), 0.02)
    assert time.perf_counter() - t0 >= 0.02 and len(calls) > 2
    settled = []
    real = _timing.settle
    try:
        _timing.settle = lambda fn, s: (settled.append(s), real(fn, s))
        samples = _timing.interleaved({"a": lambda: None, "b": lambda: None}, 2, sample_s=0.01)
    finally:
        _timing.settle = real
    assert [len(s) for s in samples.values()] == [2, 2] and settled == [0.01] * 4
