"""attnx.distributed: context-parallel attention over torch.distributed, checked in local
process groups (gloo on 127.0.0.1) against single-process attnx.attention.

The processes are spawned once per suite (importing torch is slow): ``w2`` (2 ranks) and ``w4``
(4 ranks) run every case of tests/integrations/_dist_worker.py, ``hang`` (2 ranks) checks that a rank that
never arrives makes the other raise after the group's timeout. All suites run at once, each
process and the whole bounded in time. The block planner (attnx.distributed.segments) needs no processes
and is tested first, without torch.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import attnx
from attnx.distributed.segments import segment_attention, segment_visibility

import _dist_worker as worker
from helpers import SEED, rand

SUITES = {"w2": 2, "w4": 4, "hang": 2}
GROUP_TIMEOUT_S = {"w2": 60, "w4": 60, "hang": 3}  # init_process_group(timeout=...)
WALL_LIMIT_S = 150  # all suites together, spawning included
CRASHES = {("w2", "a_rank_that_crashes_is_an_error"): 1}  # (suite, case) -> the rank that exits


# ---- the block planner, without processes -------------------------------------------------------


@st.composite
def blocks(draw):
    B, sq, sk = draw(st.integers(1, 3)), draw(st.integers(1, 9)), draw(st.integers(0, 14))
    qa = draw(st.integers(0, sq - 1))
    qb = draw(st.integers(qa, sq))
    ka = draw(st.integers(0, sk))
    kb = draw(st.integers(ka, sk))
    lens = draw(st.one_of(st.none(), st.lists(st.integers(0, sk), min_size=B, max_size=B)))
    return B, sq, sk, (qa, qb), (ka, kb), lens, draw(st.booleans()), draw(st.integers(0, 2**31))


@given(blocks())
def test_a_block_pair_is_masked_as_in_the_whole(case):
    """segment_attention over rows qa..qb and keys ka..kb equals attention over the whole with
    a mask that keeps only that block (causal bottom-right and kv_lens as in the whole)."""
    B, sq, sk, (qa, qb), (ka, kb), lens, causal, seed = case
    rng = np.random.default_rng([SEED, seed])
    q, k, v = rand(rng, (B, 2, sq, 4)), rand(rng, (B, 1, sk, 4)), rand(rng, (B, 1, sk, 3))
    key_lens = np.full(B, sk) if lens is None else np.array(lens)
    i, j = np.arange(sq)[:, None], np.arange(sk)[None, :]
    seen = (j[None] < key_lens[:, None, None]) & (
        (j <= i + key_lens[:, None, None] - sq) | (not causal)
    )
    block = np.zeros((B, sq, sk), bool)
    block[:, qa:qb, ka:kb] = seen[:, qa:qb, ka:kb]
    want, want_lse = attnx.attention(q, k, v, mask=block[:, None], return_lse=True)
    got = segment_attention(
        q[:, :, qa:qb],
        k[:, :, ka:kb],
        v[:, :, ka:kb],
        q_start=qa,
        k_start=ka,
        q_total=sq,
        key_lens=key_lens,
        causal=causal,
        scale=None,
    )
    if got is None:
        assert np.isneginf(want_lse[:, :, qa:qb]).all()
        return
    np.testing.assert_array_equal(np.isneginf(got[1]), np.isneginf(want_lse[:, :, qa:qb]))
    np.testing.assert_allclose(got[0], want[:, :, qa:qb], atol=2e-6, rtol=0)
    fin = np.isfinite(got[1])
    np.testing.assert_allclose(got[1][fin], want_lse[:, :, qa:qb][fin], atol=2e-6, rtol=0)


def test_zigzag_blocks_need_no_mask():
    """Under the zig-zag split every (query chunk, key chunk) pair is full, causal or skipped:
    kv_lens, causal and window express it (no boolean mask), so no O(Sq*Sk) array is built."""
    world, S = 4, 64
    edges = np.linspace(0, S, 2 * world + 1).astype(int)
    for qa, qb in itertools.pairwise(edges):
        for ka, kb in itertools.pairwise(edges):
            K, r = segment_visibility(
                nq=qb - qa,
                nk=kb - ka,
                q_start=qa,
                k_start=ka,
                q_total=S,
                key_lens=np.array([S]),
                causal=True,
            )
            want = (0, 0) if ka > qa else (kb - ka, 0) if ka == qa else (kb - ka, qb - qa - 1)
            assert (int(K[0]), int(r[0])) == want


# ---- process groups ------------------------------------------------------------------------------


def _unavailable():
    """Why the process tests cannot run here, or None."""
    try:
        import torch.distributed as dist
    except ImportError:
        return "torch is not installed (pip install torch): attnx.distributed runs over torch.distributed"
    if not dist.is_available() or not dist.is_gloo_available():
        return "this torch build has no torch.distributed gloo backend"
    return None


def _spawn(suite, tmp):
    world, timeout = SUITES[suite], GROUP_TIMEOUT_S[suite]
    out = tmp / suite
    out.mkdir()
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    script = os.path.join(os.path.dirname(__file__), "_dist_worker.py")
    procs = []
    for rank in range(world):
        log = open(out / f"rank{rank}.log", "w")  # noqa: SIM115 (closed by _reap, after the process)
        procs.append(
            (
                subprocess.Popen(
                    [
                        sys.executable,
                        script,
                        suite,
                        str(world),
                        str(rank),
                        str(out / "init"),
                        str(out),
                        str(timeout),
                    ],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=os.path.dirname(script),
                ),
                log,
            )
        )
    return out, procs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every suite run once, at once: {suite: {"ranks": [{case: record}], "codes": [...],
    "logs": [...]}}."""
    reason = _unavailable()
    if reason:
        pytest.skip(reason)
    tmp = tmp_path_factory.mktemp("dist")
    started = {s: _spawn(s, tmp) for s in SUITES}
    example = _spawn_example(tmp)
    deadline = time.monotonic() + WALL_LIMIT_S
    found = {}
    for suite, (out, procs) in started.items():
        codes = []
        for p, log in procs:
            try:
                codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                codes.append("killed: over the time limit")
            log.close()
        ranks = []
        for r in range(len(procs)):
            path = out / f"rank{r}.json"
            ranks.append(
                {x["case"]: x for x in json.loads(path.read_text())} if path.exists() else {}
            )
        logs = [(out / f"rank{r}.log").read_text()[-3000:] for r in range(len(procs))]
        found[suite] = dict(ranks=ranks, codes=codes, logs=logs)
    proc, log = example
    try:
        code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        code = "killed: over the time limit"
    log.close()
    found["example"] = dict(code=code, output=(tmp / "example.log").read_text())
    return found


EXAMPLE_ARGS = [
    "--context",
    "300",
    "--steps",
    "3",
    "--chunk",
    "128",
    "--block-size",
    "8",
    "--timeout",
    "60",
]


def _spawn_example(tmp):
    """examples/context_parallel.py under torchrun with 2 local processes."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    log = open(tmp / "example.log", "w")  # noqa: SIM115 (closed once torchrun exits)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        os.path.join(root, "examples", "context_parallel.py"),
        *EXAMPLE_ARGS,
    ]
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=root), log


CASES = [(s, n) for s in SUITES for n in worker.names(s)]


@pytest.mark.parametrize("suite,name", CASES, ids=[f"{s}-{n}" for s, n in CASES])
def test_distributed_case(runs, suite, name):
    """Every rank of the suite ran the case and its checks passed (see tests/integrations/_dist_worker.py)."""
    run = runs[suite]
    for rank, records in enumerate(run["ranks"]):
        rec = records.get(name)
        if rec is None:
            if CRASHES.get((suite, name)) == rank:
                continue
            pytest.fail(
                f"rank {rank} of {suite} did not finish {name} (exit {run['codes'][rank]}):\n"
                f"{run['logs'][rank]}"
            )
        assert rec["ok"], f"rank {rank} of {suite}, {name}:\n{rec['error']}"


@pytest.mark.parametrize("suite", list(SUITES))
def test_every_process_exits_in_time(runs, suite):
    """No process hangs: each exits on its own within the limit, 0 but for the planned crash."""
    want = [0] * SUITES[suite]
    for (s, _), rank in CRASHES.items():
        if s == suite:
            want[rank] = 3
    assert runs[suite]["codes"] == want, runs[suite]["logs"]


def test_zigzag_shard_round_trip():
    pytest.importorskip("torch", reason="attnx.distributed needs torch")
    import torch

    import attnx.distributed as ad

    for world, S in ((1, 5), (2, 9), (4, 37), (4, 3)):
        x = np.arange(2 * S * 3).reshape(2, S, 3)
        shards = [ad.zigzag_shard(x, r, world, layout="bhsd") for r in range(world)]
        np.testing.assert_array_equal(ad.zigzag_unshard(shards), x)
        for r, s in enumerate(shards):
            np.testing.assert_array_equal(s[0, :, 0] // 3, ad.zigzag_positions(S, r, world))
        t = torch.arange(S * 2 * 3).reshape(S, 2, 3)
        parts = [ad.zigzag_shard(t, r, world, layout="bshd") for r in range(world)]
        assert torch.equal(ad.zigzag_unshard(parts, layout="bshd"), t)
    with pytest.raises(ValueError, match="shards\\[0\\]"):
        ad.zigzag_unshard([np.zeros((2, 4)), np.zeros((3, 4))])


def test_without_torch_the_planner_imports_and_the_rest_names_torch():
    """``pip install attnx`` alone (no torch): the block planner is NumPy and imports; anything
    that communicates raises an ImportError that says to install torch (torch hidden in a
    subprocess, as if it were not installed)."""
    code = (
        "import sys; sys.modules['torch'] = None; "
        "from attnx.distributed.segments import segment_visibility; "
        "import attnx.distributed as ad\n"
        "try:\n    from attnx.distributed import attention\n"
        "except ImportError as e:\n    print('refused:', e)\n"
        "try:\n    ad.nothing\n"
        "except AttributeError:\n    print('no such name')\n"
        "assert 'torch' not in {m.split('.')[0] for m in sys.modules if sys.modules[m]}"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert (
        "refused: attnx.distributed needs PyTorch" in res.stdout
        and "pip install torch" in res.stdout
    )
    assert "no such name" in res.stdout


def test_without_a_process_group_the_error_says_what_to_do():
    pytest.importorskip("torch", reason="attnx.distributed needs torch")
    import torch.distributed as dist

    import attnx.distributed as ad

    if dist.is_initialized():
        pytest.skip("a process group exists in this process")
    q = np.zeros((1, 1, 1, 4), np.float32)
    with pytest.raises(RuntimeError, match="init_process_group"):
        ad.attention(q, q, q)


def test_context_parallel_example_runs_under_torchrun(runs):
    """The example decodes over 2 ranks, prints its per-rank table and matches one process."""
    res = runs["example"]
    assert res["code"] == 0, res["output"][-3000:]
    text = res["output"]
    assert "rank    tokens    KV MiB   step ms" in text, text[-3000:]
    diff = float(text.split("largest difference from the distributed result ")[1].split()[0])
    assert diff < 1e-5, text[-3000:]
