"""Smoke tests of `python -m attnx` and `python -m attnx bench`: they run, print the seed's numbers
and write valid JSON with every row. No timing assertions (the machines are shared and noisy)."""

import json
import os
import subprocess
import sys

ROWS = ["prefill", "gqa_causal", "encoder", "decode_f32", "decode_fp16", "decode_bf16",
        "decode_long", "small", "threads", "memory"]
ROW_KEYS = {"key", "case", "shape", "kind", "target", "attnx_s", "numpy_s", "torch_s", "rate",
            "rate_unit", "pct_of_limit", "vs_numpy", "vs_torch", "met", "met_text", "samples"}


def _run(args, tmp_path, env_extra=None, timeout=120):
    env = dict(os.environ)
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "attnx", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=timeout)


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


def test_bench_quick_writes_valid_json(tmp_path):
    # ATTNX_BENCH_TINY shrinks every shape so this runs in seconds; the numbers mean nothing.
    plot = ["--plot", "bench.png"] if _has_matplotlib() else []
    res = _run(["bench", "--quick", "--json", "tmp.json", "--threads", "2", *plot], tmp_path,
               {"ATTNX_BENCH_TINY": "1"})
    assert res.returncode == 0, res.stderr
    assert "[1/" in res.stderr  # progress goes to stderr
    result = json.loads((tmp_path / "tmp.json").read_text())
    assert {"date", "config", "machine", "limits", "rows", "others_cpu_share"} <= set(result)
    m = result["machine"]
    assert m["cpu_model"] and m["threads"] == 2 and m["isa"] in ("scalar", "avx2", "avx512")
    assert m["versions"]["numpy"] and "torch" in m["versions"]
    lim = result["limits"]
    assert lim["fma_gflops_all"] > 0 and lim["fma_gflops_1"] > 0 and lim["read_gbps_all"] > 0
    rows = {r["key"]: r for r in result["rows"]}
    assert list(rows) == ROWS
    for key, r in rows.items():
        assert ROW_KEYS <= set(r), key
        assert r["attnx_s"] is not None and r["attnx_s"] > 0, key
        assert r["met"] in (True, False, None), key
    for key in ("prefill", "gqa_causal", "encoder", "decode_f32", "decode_long"):
        assert rows[key]["rate"] > 0 and rows[key]["vs_numpy"] > 0
        if m["versions"]["torch"]:
            assert rows[key]["vs_torch"] > 0
    assert rows["memory"]["extra"]["rss_growth_bytes"] >= 0
    assert "tokens_per_s_vs_fp32" in rows["decode_fp16"]["extra"]
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
    res = _run(["bench", "--quick", "--plot", "x.png"], tmp_path,
               {"ATTNX_BENCH_TINY": "1", "PYTHONPATH": path}, timeout=60)
    assert res.returncode != 0
    assert "--plot needs matplotlib" in res.stderr
    assert "[1/" not in res.stderr  # it failed before measuring anything
