"""fork(): a child of a process that made multi-threaded attnx calls runs its own multi-threaded
calls, bit for bit like the parent's (issue 18, defect 1: with GNU libgomp the child's first
multi-threaded call waited forever for threads that do not exist after fork).

Every scenario runs in a fresh interpreter under a timeout, so a hang fails its test instead of
the suite: the issue's ``multiprocessing`` "fork" pool, ``os.fork`` itself, a child that forks
again, a fork from a thread that never called attnx, and a fork while another thread is inside a
multi-threaded call. Each child reports a digest of its results (compared with the parent's) and
how many of its pool's workers ran (``_core._pool_threads()``): the child really uses threads.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import run_isolated

TIMEOUT = 120  # seconds per scenario; each takes about one on a quiet machine

PRELUDE = r"""
import hashlib, json, os, sys, threading, warnings
import numpy as np
import attnx
from attnx import _core

# Python 3.12+ warns that fork() with threads running may deadlock: that is what is tested here.
warnings.simplefilter("ignore", DeprecationWarning)

rng = np.random.default_rng(18)
Q = rng.standard_normal((1, 4, 512, 64)).astype(np.float32)
KP = rng.standard_normal((64, 2, 16, 64)).astype(np.float32)
TABLES = rng.permutation(64).astype(np.int32).reshape(4, 16)
LENS = np.array([256, 200, 31, 255])
QD = rng.standard_normal((4, 8, 64)).astype(np.float32)


def work():
    # (digest of a 2-thread dense and paged call, workers of this thread's pool that ran)
    o = attnx.attention(Q, Q, Q, causal=True, num_threads=2)
    p = attnx.paged_attention(QD, KP, KP, TABLES, LENS, num_threads=2)
    return hashlib.sha256(o.tobytes() + p.tobytes()).hexdigest(), _core._pool_threads()


def in_child(fn):
    # fn() in an os.fork()ed child; returns its JSON result (through a pipe)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        code = 0
        try:
            res = fn()
        except BaseException as e:
            res, code = repr(e), 1
        os.write(w, json.dumps(res).encode())
        os._exit(code)
    os.close(w)
    chunks = []
    while True:
        c = os.read(r, 65536)
        if not c:
            break
        chunks.append(c)
    os.close(r)
    _, status = os.waitpid(pid, 0)
    out = json.loads(b"".join(chunks))
    assert os.waitstatus_to_exitcode(status) == 0, out
    return out


PARENT = work()  # the parent's pool has its worker from here on
"""


def run_scenario(body):
    """Runs PRELUDE + body in a fresh interpreter under TIMEOUT; returns the JSON it prints last."""
    return run_isolated(PRELUDE + body, timeout=TIMEOUT)


def assert_like_parent(res, n_children):
    parent, children = res["parent"], res["children"]
    assert parent[1] == 1, "the parent's 2-thread calls ran on its worker"
    assert len(children) == n_children
    for digest, workers in children:
        assert digest == parent[0], "a child's result differs from the parent's"
        assert workers == 1, "a child ran its 2-thread calls on one thread"


def test_multiprocessing_fork_pool_after_a_threaded_call():
    """The issue's repro: a 'fork' Pool(2).map after a 2-thread call in the parent."""
    res = run_scenario(r"""
import multiprocessing as mp

def task(_):
    return work()

with mp.get_context("fork").Pool(2) as pool:
    children = pool.map(task, range(4))
print(json.dumps({"parent": PARENT, "children": children}))
""")
    assert_like_parent(res, 4)


def test_os_fork_child_runs_threaded_and_matches_the_parent():
    res = run_scenario(r"""
def child():
    first = work()
    again = work()  # the child's own pool, made by its first call, is reused
    threads = int([l for l in open("/proc/self/status") if l.startswith("Threads:")][0].split()[1])
    return first, again, threads

first, again, threads = in_child(child)
print(json.dumps({"parent": PARENT, "children": [first, again], "threads": threads,
                  "after": work()}))
""")
    assert_like_parent(res, 2)
    assert res["threads"] == 2, "the child: its main thread and one worker"
    assert res["after"] == res["parent"], "the parent's pool still works after the fork"


def test_a_child_that_forks_again():
    res = run_scenario(r"""
def grandchild():
    return work()

def child():
    return [work(), in_child(grandchild), work()]

print(json.dumps({"parent": PARENT, "children": in_child(child) + [in_child(grandchild)]}))
""")
    assert_like_parent(res, 4)


def test_a_child_that_forks_before_its_own_first_call():
    res = run_scenario(r"""
def child():
    return in_child(work)  # the child's pool is stale too: never made in this generation

print(json.dumps({"parent": PARENT, "children": [in_child(child)]}))
""")
    assert_like_parent(res, 1)


def test_fork_from_a_thread_that_never_called_attnx():
    """(libgomp passed this one too: its teams are per thread as well.) The forking thread has no
    pool; the child's first call makes one."""
    res = run_scenario(r"""
box = []
t = threading.Thread(target=lambda: box.append(in_child(work)))
t.start()
t.join()
print(json.dumps({"parent": PARENT, "children": box}))
""")
    assert_like_parent(res, 1)


def test_fork_while_another_thread_is_inside_a_call():
    """A thread keeps making 2-thread calls (its workers mid-region, its barriers waiting) while
    the main thread forks: each child has only the forking thread and makes its own workers."""
    res = run_scenario(r"""
stop = threading.Event()
calls = [0]
BIG = rng.standard_normal((2, 8, 1024, 64)).astype(np.float32)

def busy():
    while not stop.is_set():
        attnx.attention(BIG, BIG, BIG, num_threads=2)
        calls[0] += 1

t = threading.Thread(target=busy)
t.start()
while calls[0] == 0:
    threading.Event().wait(0.001)
children = []
for _ in range(6):
    children.append(in_child(work))
stop.set()
t.join()
print(json.dumps({"parent": PARENT, "children": children}))
""")
    assert_like_parent(res, 6)


# The fuzz class "forked children" (issue 18): drawn shapes, thread counts and entry points, each
# call made in a fresh fork()ed child after the parent made its own threaded calls, must equal the
# parent's same call bit for bit.
@settings(
    max_examples=6, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["dense", "paged"]),
            st.integers(1, 3),
            st.integers(1, 300),
            st.sampled_from([1, 16, 64, 97]),
            st.integers(1, 4),
        ),
        min_size=1,
        max_size=4,
    ),
    st.integers(1, 3),
)
def test_forked_children_fuzz(cases, parent_threads):
    res = run_scenario(
        f"CASES = {cases!r}\nPARENT_THREADS = {parent_threads}\n"
        + r"""
def call(kind, batch, length, dim, threads):
    g = np.random.default_rng([kind == "dense", batch, length, dim])
    if kind == "dense":
        q = g.standard_normal((batch, 2, length, dim)).astype(np.float32)
        return attnx.attention(q, q[:, :1], q[:, :1], causal=True, num_threads=threads)
    bs = 16
    nb = batch * (-(-length // bs))
    pages = g.standard_normal((nb, 1, bs, dim)).astype(np.float32)
    tables = g.permutation(nb).astype(np.int32).reshape(batch, -1)
    q = g.standard_normal((batch, 2, dim)).astype(np.float32)
    return attnx.paged_attention(q, pages, pages, tables, np.full(batch, length), num_threads=threads)

def digests():
    return [hashlib.sha256(call(*c).tobytes()).hexdigest() for c in CASES]

attnx.attention(Q, Q, Q, causal=True, num_threads=PARENT_THREADS)  # the parent's pool, before the fork
parent = digests()
print(json.dumps({"parent": parent, "child": in_child(digests), "grandchild":
                  in_child(lambda: in_child(digests))}))
"""
    )
    assert res["child"] == res["parent"] and res["grandchild"] == res["parent"]
