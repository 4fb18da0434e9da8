"""One set of threads per process (issue 17 item 7): NumPy's OpenBLAS on attnx's pool
(``attnx.share_blas_threads``) and attnx on torch's OpenMP team (``attnx.share_torch_threads``).

OpenBLAS's idle threads spin for ~70 ms after each matmul, so an attention call right after one
used to share the cores with them. ``import attnx`` hands OpenBLAS (0.3.28+, through its
threading callback) attnx's pool instead. These tests hold what that must not break: matmul
results stay bit-identical to OpenBLAS's own threads, the work really runs on attnx's workers,
``ATTNX_SHARE_BLAS=0`` and ``share_blas_threads(False)`` give OpenBLAS its threads back, and a
forked child and concurrent Python threads keep working. The same holds for attnx's regions on
torch's team: bit-identical results, attnx's own pool left unused, back to the pool in a forked
child. Each scenario runs in a fresh interpreter (the sharing happens at import) under a timeout,
so a hang fails instead of stalling.
"""

from __future__ import annotations

import os

import pytest

from helpers import cpus_here, run_isolated

TIMEOUT = 120

PRELUDE = r"""
import hashlib, json, os, threading, warnings
import numpy as np
import attnx
from attnx import _core

warnings.simplefilter("ignore", DeprecationWarning)  # fork() with threads: what is tested
rng = np.random.default_rng(17)
A = rng.standard_normal((600, 700))
B = rng.standard_normal((700, 500))
A32, B32 = A.astype(np.float32), B.astype(np.float32)
Q = rng.standard_normal((1, 4, 256, 64)).astype(np.float32)


def digest(*arrays):
    return hashlib.sha256(b"".join(a.tobytes() for a in arrays)).hexdigest()


def matmuls():
    return digest(A @ B, A32 @ B32, np.linalg.solve(A[:500, :500], B[:500]))


def attend():
    return digest(attnx.attention(Q, Q, Q, causal=True, num_threads=2))


def in_child(fn):
    # [fn() in the parent, fn() in an os.fork()ed child] (the child's through a pipe)
    parent = fn()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        os.write(w, json.dumps(fn()).encode())
        os._exit(0)
    os.close(w)
    child = json.loads(os.read(r, 1 << 16))
    os.waitpid(pid, 0)
    return [parent, child]


def in_threads(fn, n=4, times=3):
    # fn() 3 times in each of 4 concurrent Python threads: [results, errors]
    got, errors = [], []
    def job():
        try:
            for _ in range(times):
                got.append(fn())
        except BaseException as e:
            errors.append(repr(e))
    threads = [threading.Thread(target=job) for _ in range(n)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    return [got, errors]
"""


def run(body, share=True, share_torch=True):
    env = dict(
        os.environ,
        OPENBLAS_NUM_THREADS="2",
        ATTNX_SHARE_BLAS="1" if share else "0",
        ATTNX_SHARE_TORCH="1" if share_torch else "0",
    )
    return run_isolated(PRELUDE + body, env=env, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def own_threads():
    """Digests and pool use with OpenBLAS on its own threads (ATTNX_SHARE_BLAS=0)."""
    res = run(
        "print(json.dumps([attnx.share_blas_threads(False), matmuls(), _core._pool_threads()]))",
        share=False,
    )
    return {"shared": res[0], "matmuls": res[1], "workers": res[2]}


@pytest.fixture(scope="module")
def shared():
    res = run(
        "n = attnx.share_blas_threads(); print(json.dumps([n, matmuls(), _core._pool_threads()]))"
    )
    if res[0] == 0:
        pytest.skip("NumPy's BLAS takes no threading callback (OpenBLAS < 0.3.28, or not OpenBLAS)")
    return {"shared": res[0], "matmuls": res[1], "workers": res[2]}


def test_matmuls_on_attnx_pool_give_the_same_bits(own_threads, shared):
    assert own_threads["workers"] == 0, "with ATTNX_SHARE_BLAS=0 attnx's pool stays unused"
    assert shared["matmuls"] == own_threads["matmuls"], "the same partition gives the same bits"


@pytest.mark.skipif(cpus_here() < 2, reason="OpenBLAS runs one thread on one CPU")
def test_matmuls_run_on_attnx_workers(shared):
    assert shared["workers"] == 1, "a 2-thread matmul ran on attnx's worker"


def test_giving_the_threads_back(shared, own_threads):
    res = run(
        "a = attnx.share_blas_threads(False); m = matmuls(); b = attnx.share_blas_threads(True); "
        "print(json.dumps([a, m, _core._pool_threads(), b]))"
    )
    assert res[0] == 0 and res[3] == shared["shared"]
    assert res[1] == own_threads["matmuls"]
    assert res[2] == 0, "after share_blas_threads(False) OpenBLAS used its own threads"


def test_a_forked_child_runs_matmuls_and_attention(shared, own_threads):
    parent, child = run(
        "print(json.dumps(in_child(lambda: [matmuls(), attend(), _core._pool_threads()])))"
    )
    assert parent[0] == own_threads["matmuls"]
    assert child[:2] == parent[:2], "the child's matmul and attention match the parent's"
    assert child[2] == 1, "the child's matmul ran on its own fresh worker"


def test_concurrent_python_threads(shared, own_threads):
    want, (got, errors) = run(
        "print(json.dumps([[matmuls(), attend()], in_threads(lambda: [matmuls(), attend()])]))"
    )
    assert not errors
    assert len(got) == 12 and all(g == want for g in got)
    assert want[0] == own_threads["matmuls"]


# ---- attnx on torch's OpenMP team ------------------------------------------------------------

TORCH = r"""
import torch
torch.set_num_threads(2)
T = torch.from_numpy(Q)
def attend_t():
    return digest(attnx.attention(T, T, T, causal=True, num_threads=2).numpy())
attend_t()  # the first tensor: attnx.torch_ops is imported, which turns the sharing on
"""


@pytest.fixture(scope="module")
def torch_team():
    pytest.importorskip("torch")
    on = run(
        TORCH
        + "print(json.dumps([attnx.share_torch_threads(), attend_t(), attend(), _core._pool_threads()]))"
    )
    off = run(
        TORCH + "print(json.dumps([attend_t(), attend(), _core._pool_threads()]))",
        share_torch=False,
    )
    return on, off


def test_attnx_runs_on_torchs_team_bit_for_bit(torch_team):
    (found, tensors, arrays, workers), (tensors_own, arrays_own, workers_own) = torch_team
    assert found, "torch's OpenMP runtime was found among the loaded libraries"
    assert workers == 0, "2-thread calls ran on torch's team, attnx's own pool stayed unused"
    assert workers_own == 1, "with ATTNX_SHARE_TORCH=0 they run on attnx's pool"
    assert tensors == tensors_own == arrays == arrays_own


def test_import_attnx_alone_shares_nothing_with_torch():
    pytest.importorskip("torch")
    res = run("import torch; print(json.dumps([attend(), _core._pool_threads()]))")
    assert res[1] == 1, "no tensor seen: attnx's own pool"


def test_a_forked_child_of_a_torch_sharing_process(torch_team):
    parent, child = run(
        TORCH + "print(json.dumps(in_child(lambda: [attend(), attend_t(), _core._pool_threads()])))"
    )
    assert child[0] == child[1] == parent[0] == parent[1]
    assert parent[2] == 0, "the parent ran on torch's team"
    assert child[2] == 1, (
        "the child ran its 2-thread calls on a fresh attnx pool, not the dead team"
    )


def test_concurrent_python_threads_on_torchs_team(torch_team):
    want, (got, errors) = run(
        TORCH + "print(json.dumps([attend(), in_threads(lambda: [attend(), attend_t()])]))"
    )
    assert not errors and len(got) == 12 and all(g == [want, want] for g in got)
