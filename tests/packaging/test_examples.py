"""The teaching examples run end to end: examples/walkthrough.py (the seed, section by section,
with heatmaps) and examples/kv_bytes.py (KV bytes per token for MHA/GQA/MLA, MLA decode)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def run(script, *args):
    res = subprocess.run(
        [sys.executable, "-W", "error", str(EXAMPLES / script), *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res.stdout


def load(script):
    spec = importlib.util.spec_from_file_location(script.removesuffix(".py"), EXAMPLES / script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_walkthrough_writes_heatmaps(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "pictures"
    text = run("walkthrough.py", "--out", str(out))
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert len(pngs) >= 8, pngs
    for name in (
        "02_cross_attention_de_en.png",
        "06_causal_mask.png",
        "07_two_heads.png",
        "08_cost_memory.png",
        "10_hybrid_linear_vs_softmax.png",
    ):
        assert name in pngs
    for p in out.glob("*.png"):
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000
    # the seed's numbers, printed
    for needle in (
        "[0.05 0.10 0.18 0.67]",
        "[0.401 0.198 0.401]",
        "[0.802 0.599]",
        "[0.503 0.248]",
        "[0.802 0.599 0.503 0.248]",
        "   1 0 0\n   1 1 0\n   1 1 1",
        "[0.04 0.42 0.28 0.06 0.08 0.12]",
        "PagedKVCache",
        "state bytes per sequence",
        "32768 |                                    1536 |",
    ):
        assert needle in text, needle


def test_walkthrough_without_matplotlib_still_prints(tmp_path, monkeypatch):
    """No matplotlib: the numbers are printed, no pictures, a clear note."""
    wt = load("walkthrough.py")
    from attnx import viz

    def missing():
        raise ImportError("attnx.viz needs matplotlib: pip install attnx[viz]")

    monkeypatch.setattr(viz, "_matplotlib", missing)
    saved = wt.main(["--out", str(tmp_path), "--sizes", "64,128"])
    assert saved == [] and not list(tmp_path.glob("*.png"))


def test_viz_heatmap_and_errors(tmp_path):
    pytest.importorskip("matplotlib")
    from attnx import viz

    w = np.array([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
    ax = viz.heatmap(w, ["a", "b"], ["x", "y", "z"], title="t")
    assert [t.get_text() for t in ax.get_xticklabels()] == ["x", "y", "z"]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["a", "b"]
    assert ax.get_title() == "t" and len(ax.texts) == 6
    ax.figure.savefig(tmp_path / "m.png")
    assert (tmp_path / "m.png").stat().st_size > 1000
    ax2 = viz.heatmap(w, ["a", "b"], ["x", "y", "z"], annotate=False)
    assert len(ax2.texts) == 0
    # drawing into a given Axes returns it
    from matplotlib.figure import Figure

    given = Figure().add_subplot()
    assert viz.heatmap(w, "ab", "xyz", ax=given) is given
    with pytest.raises(ValueError, match="query_tokens"):
        viz.heatmap(w, ["a"], ["x", "y", "z"])
    with pytest.raises(ValueError, match="key_tokens"):
        viz.heatmap(w, ["a", "b"], ["x"])
    with pytest.raises(ValueError, match="weights"):
        viz.heatmap(w[None], ["a", "b"], ["x", "y", "z"])


def test_viz_is_lazy():
    """``import attnx`` does not import attnx.viz nor matplotlib; the error names the extra."""
    code = (
        "import sys, attnx; assert 'attnx.viz' not in sys.modules; "
        "assert 'matplotlib' not in sys.modules; import attnx.viz; "
        "assert 'matplotlib' not in sys.modules; "
        "sys.modules['matplotlib'] = None; "  # pretend it is not installed
        "import numpy as np\n"
        "try:\n    attnx.viz.heatmap(np.eye(2), 'ab', 'ab')\n"
        "except ImportError as e:\n    assert 'attnx[viz]' in str(e); print('ok')\n"
    )
    res = subprocess.run(
        [sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stdout + res.stderr


def test_kv_bytes():
    text = run("kv_bytes.py")
    # bf16, DeepSeek-V2-like: MHA 2*128*128*2, GQA 2*8*128*2, MLA (512+64)*2 bytes
    for needle in (
        "65,536",
        "4,096",
        "1,152",
        "MHA / MLA = 56.9x",
        "identical: True",
        "value_from_key=True",
    ):
        assert needle in text, needle


def test_kv_bytes_figures_match_the_cache():
    kv = load("kv_bytes.py")
    for name, hkv, dk, dv, separate in kv.kv_configs():
        b = kv.bytes_per_token_per_layer(hkv, dk, dv, separate, 4)
        assert kv.cache_bytes_per_token(hkv, dk, dv, separate, "float32") == b, name
    assert kv.bytes_per_token_per_layer(1, 576, 512, False, 4) == 576 * 4
