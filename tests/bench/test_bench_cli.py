"""``python -m attnx bench`` with bad options or a bad ``--config`` (issue 31, defect 5): each is a
one-line error naming the option or field, exit status 2, before anything is measured (no
traceback, no timing, and ``--json`` to a path that cannot be written fails before the run, not
after it). Dtype names: the bench takes the cache's names beside its short ones."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import attnx
from attnx import __main__ as cli
from attnx import bench


@pytest.fixture
def no_timing(monkeypatch):
    """bench.run replaced: what it was given, and an error if the CLI reached it."""
    calls = []
    monkeypatch.setattr(bench, "run", lambda **kw: calls.append(kw))
    return calls


def refused(argv, capsys, calls):
    """main(argv) exits 2 with one line on stderr and never calls bench.run; returns the line."""
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("python -m attnx bench: error: "), err
    assert "Traceback" not in err
    assert calls == []
    return err


CONFIG = {"num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 128}


@pytest.mark.parametrize(
    "field, value",
    [
        ("num_attention_heads", 0),
        ("num_attention_heads", None),
        ("num_attention_heads", -4),
        ("num_attention_heads", 4.0),
        ("num_attention_heads", "4"),
        ("num_attention_heads", True),
        ("num_key_value_heads", 0),
        ("num_key_value_heads", -2),
        ("num_key_value_heads", 3),
        ("head_dim", -64),
        ("head_dim", 0),
        ("head_dim", 12.5),
        ("hidden_size", 0),
        ("hidden_size", None),
        ("sliding_window", -5),
        ("sliding_window", 0),
        ("sliding_window", "4096"),
        ("use_sliding_window", "yes"),
    ],
)
def test_bad_config_fields_are_one_line_errors_naming_them(
    tmp_path, capsys, no_timing, field, value
):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**CONFIG, field: value}))
    err = refused(["--config", str(path)], capsys, no_timing)
    assert field in err


@pytest.mark.parametrize("text", ["[1, 2]", '{"text_config": null}', "{}", "{" * 100000, "nope"])
def test_configs_that_are_not_model_configs(tmp_path, capsys, no_timing, text):
    path = tmp_path / "config.json"
    path.write_text(text)
    assert "--config" in refused(["--config", str(path)], capsys, no_timing)


def test_null_and_absent_optional_fields_take_their_defaults(tmp_path, no_timing):
    path = tmp_path / "config.json"
    path.write_text(
        json.dumps(
            {
                "text_config": {
                    "num_attention_heads": 8,
                    "num_key_value_heads": None,
                    "hidden_size": 512,
                    "head_dim": None,
                    "sliding_window": None,
                    "model_type": "m",
                }
            }
        )
    )
    cli.main(["bench", "--config", str(path), "--seq", "64", "--context", "32"])
    (run,) = no_timing
    assert run["title"] == "model m: heads 8:8, head dim 64, sliding window none"
    path.write_text(
        json.dumps(
            {
                "num_attention_heads": 8,
                "hidden_size": 512,
                "head_dim": 128,
                "use_sliding_window": False,
                "sliding_window": 4096,
            }
        )
    )
    cli.main(["bench", "--config", str(path), "--seq", "64", "--context", "32"])
    assert no_timing[1]["title"] == "model model: heads 8:8, head dim 128, sliding window none"


@pytest.mark.parametrize(
    "argv, name",
    [
        (["--threads", "0"], "--threads"),
        (["--threads", "-3"], "--threads"),
        (["--threads", "abc"], "--threads"),
        (["--repeat", "0"], "--repeat"),
        (["--case", "prefill", "--batch", "0"], "--batch"),
        (["--case", "prefill", "--head-dim", "-64"], "--head-dim"),
        (["--case", "paged-decode", "--block-size", "0"], "--block-size"),
        (["--case", "prefill", "--window", "-5"], "--window"),
        (["--case", "prefill", "--seq", "0"], "--seq"),
        (["--case", "decode", "--context", "x"], "--context"),
        (["--case", "prefill", "--heads", "6:4"], "--heads"),
        (["--case", "prefill", "--heads", "0"], "--heads"),
        (["--case", "prefill", "--kv-dtype", "float64"], "--kv-dtype"),
        (["--case", "paged-decode", "--kv-dtype", "float8_e5m2"], "--kv-dtype"),
        (["--case", "prefill", "--kv-dtype", "int8"], "--kv-dtype"),
        (["--case", "nope"], "--case"),
    ],
)
def test_bad_options_are_one_line_errors_naming_them(capsys, no_timing, argv, name):
    assert name in refused(argv, capsys, no_timing)


@pytest.mark.parametrize("where", ["missing_dir", "a_directory"])
@pytest.mark.parametrize("flag", ["--json", "--plot"])
def test_unwritable_output_paths_fail_before_the_run(tmp_path, capsys, no_timing, where, flag):
    path = tmp_path / "no" / "such" / "x.json" if where == "missing_dir" else tmp_path
    assert flag in refused([flag, str(path)], capsys, no_timing)


def test_a_writable_json_path_is_left_as_it_was(tmp_path, no_timing):
    fresh, kept = tmp_path / "new.json", tmp_path / "old.json"
    kept.write_text("old")
    cli.main(["bench", "--json", str(fresh)])
    cli.main(["bench", "--json", str(kept)])
    assert not fresh.exists() and kept.read_text() == "old"
    assert [r["json_path"] for r in no_timing] == [str(fresh), str(kept)]


@pytest.mark.parametrize(
    "name, label",
    [
        ("fp16", "fp16"),
        ("float16", "fp16"),
        ("bfloat16", "bf16"),
        ("bf16", "bf16"),
        ("float32", "fp32"),
        ("int8", "int8"),
        ("float8_e4m3fn", "fp8"),
        ("fp8", "fp8"),
    ],
)
def test_kv_dtype_takes_the_caches_names_and_the_short_ones(no_timing, name, label):
    cli.main(["bench", "--case", "paged-decode", "--kv-dtype", name, "--context", "64"])
    (run,) = no_timing
    assert [c.shape.dtype for c in run["cases"]] == [label]


def test_a_bad_attnx_num_threads_is_a_one_line_error_before_the_run(monkeypatch, capsys, no_timing):
    monkeypatch.setenv("ATTNX_NUM_THREADS", "lots")
    assert "ATTNX_NUM_THREADS" in refused([], capsys, no_timing)
    cli.main(["bench", "--threads", "2"])  # an explicit count does not read it
    assert no_timing[0]["threads"] == 2


def test_info_with_a_bad_attnx_num_threads_is_one_line(monkeypatch, capsys):
    monkeypatch.setenv("ATTNX_NUM_THREADS", "0")
    assert cli.main([]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "ATTNX_NUM_THREADS" in err


def test_bench_run_refuses_zero_threads_and_repeats():
    with pytest.raises(ValueError, match="^threads"):
        bench.run(threads=0, cases=[])
    with pytest.raises(ValueError, match="^repeat"):
        bench.run(repeat=0, cases=[])


def test_the_real_command_line_prints_one_line_and_times_nothing(tmp_path):
    (tmp_path / "c.json").write_text(json.dumps({**CONFIG, "num_attention_heads": 0}))
    env = dict(os.environ, ATTNX_BENCH_TINY="1")
    for argv in (["--config", "c.json"], ["--json", str(tmp_path / "none" / "x.json")]):
        res = subprocess.run(
            [sys.executable, "-m", "attnx", "bench", *argv],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert res.returncode == 2 and res.stdout == ""
        assert res.stderr.count("\n") == 1 and "Traceback" not in res.stderr, res.stderr
        assert "probing" not in res.stderr and "[1/" not in res.stderr


# ---- dtype names: one table for the cache, the layers and the bench --------------------------
@pytest.mark.parametrize(
    "short, full",
    [("fp32", "float32"), ("fp16", "float16"), ("bf16", "bfloat16"), ("fp8", "float8_e4m3fn")],
)
def test_cache_takes_the_short_names_too(short, full):
    a = attnx.PagedKVCache(1, 1, 8, num_blocks=2, dtype=short)
    b = attnx.PagedKVCache(1, 1, 8, num_blocks=2, dtype=full)
    assert a.dtype == b.dtype


def test_dtype_names_refused_name_the_argument():
    with pytest.raises(TypeError, match=r"^dtype: expected 'float32'.*'float8_e5m2' \(or 'fp32'"):
        attnx.PagedKVCache(1, 1, 8, num_blocks=2, dtype="fp64")
    with pytest.raises(TypeError, match=r"^dtype: expected"):
        attnx.PagedKVCache(1, 1, 8, num_blocks=2, dtype=object())
