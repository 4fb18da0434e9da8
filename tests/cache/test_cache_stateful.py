"""A hypothesis state machine drives PagedKVCache against a plain-Python model of the pool.

The model keeps, per sequence, its length, its block list (in model block ids, with model
reference counts) and, per layer, the K and V rows written to it in the storage dtype (``None``
for a slot that was reserved but not written in that layer). Rules: new sequences, batched steps
(random token counts including 0, random subsets and orders of the live sequences, attending one
or both of the 2 layers, sometimes after a rejected malformed attend), forks (also of forks),
truncation (also to 0), frees (also while iterating ``cache.sequences``), ids that were freed
(KeyError), steps made stale by a truncate, free or second begin_step (StaleStepError, nothing
written) and steps that exhaust the pool, including in the middle of a batch (CacheFullError,
nothing changed). The model predicts which steps fit, copy-on-write included.

After every rule: no block leaked (free + distinct held == num_blocks), the cache's refcounts
(``cache._refs``) equal the number of sequences holding each block, the cache's block tables have
the model's sharing pattern, every sequence's pages read back exactly the model's rows, and every
attention output of a step equals ``attnx.reference.attention`` on the model's rows.

Integer arguments (ids, counts, lengths, layers) are given as Python ints or, where a rule draws a
``form``, as NumPy integers of every width and sign, 0-d arrays or integer arrays of counts: they
must act exactly as the Python ints (issue 18).

The pool is small (24 blocks of 4 slots) so that exhaustion is frequent. Runtime: ``ci`` runs 50
examples of 30 steps; ``ATTNX_HYPOTHESIS_PROFILE=soak`` runs 1000 of 60.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import tempfile

import numpy as np
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import attnx
import attnx.ops.cascade
from attnx import reference
from attnx.cache.blocks import block_digest

from helpers import PATHS, bits, cache_state

NUM_BLOCKS, BLOCK_SIZE, LAYERS, HKV, HQ, DK = 24, 4, 2, 2, 4, 8
MAX_SEQS = 6
SOAK = os.environ.get("ATTNX_HYPOTHESIS_PROFILE", "ci") == "soak"
INT_DTYPES = [
    np.dtype(t)
    for t in (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64)
]
# how a rule passes its integers to the cache: Python ints, 0-d arrays, NumPy scalars of one dtype,
# or ("[]") NumPy scalars of one dtype with the counts as one array of it
FORMS = st.sampled_from(
    ["int", "int", "0-d"] + [d.name for d in INT_DTYPES] + [d.name + "[]" for d in INT_DTYPES]
)


def as_form(form, value):
    """The int ``value`` (>= 0) in ``form``; a dtype too narrow for it gives way to int64."""
    if form == "int":
        return value
    if form == "0-d":
        return np.array(value)
    dtype = np.dtype(form.rstrip("[]"))
    return dtype.type(value) if value <= np.iinfo(dtype).max else np.int64(value)


def counts_as_form(form, counts):
    """A step's counts in ``form``."""
    if form.endswith("[]") and max(counts, default=0) <= np.iinfo(form[:-2]).max:
        return np.array(counts, form[:-2])
    return [as_form(form, n) for n in counts]


def _isas():
    current = attnx._core.active_isa()
    found = []
    for name in PATHS:
        try:
            attnx._core.set_isa(name)
        except ValueError:
            continue
        found.append(name)
    attnx._core.set_isa(current)
    return found


ISAS = _isas()


class MSeq:
    """The model of one sequence."""

    def __init__(self, blocks, k, v):
        self.blocks = blocks  # model block ids
        self.k = k  # per layer: list of rows (Hkv, Dk) in storage dtype, or None if unwritten
        self.v = v

    @property
    def length(self):
        return len(self.k[0])

    def copy(self):
        return MSeq(list(self.blocks), [list(r) for r in self.k], [list(r) for r in self.v])


class CacheMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.cache = None
        self.previous_isa = attnx._core.active_isa()

    # ---- model helpers ---------------------------------------------------------------------
    def _plan(self, ids, counts):
        """Blocks a step needs, simulating copy-on-write in step order (as the cache does)."""
        bs = self.cache.block_size
        refs = {}
        need = 0
        for s, n in zip(ids, counts):
            m = self.model[s]
            if n and m.length % bs:
                last = m.blocks[-1]
                left = refs.get(last, self.mrefs[last])
                if left > 1:
                    need += 1
                    refs[last] = left - 1
            need += -(-(m.length + n) // bs) - len(m.blocks)
        return need

    def _fresh(self):
        self.next_block += 1
        self.mrefs[self.next_block] = 1
        self.mfree -= 1
        return self.next_block

    def _release(self, blocks):
        for b in blocks:
            self.mrefs[b] -= 1
            if self.mrefs[b] == 0:
                del self.mrefs[b]
                self.mfree += 1

    def _reserve(self, ids, counts):
        """Applies a step's reservation to the model (slots unknown until attended)."""
        bs = self.cache.block_size
        for s, n in zip(ids, counts):
            m = self.model[s]
            if n and m.length % bs and self.mrefs[m.blocks[-1]] > 1:
                self.mrefs[m.blocks[-1]] -= 1
                m.blocks[-1] = self._fresh()
            for _ in range(-(-(m.length + n) // bs) - len(m.blocks)):
                m.blocks.append(self._fresh())
            for layer in range(LAYERS):
                m.k[layer].extend([None] * n)
                m.v[layer].extend([None] * n)

    def _truncate_model(self, s, length):
        m = self.model[s]
        keep = -(-length // self.cache.block_size)
        self._release(m.blocks[keep:])
        del m.blocks[keep:]
        for layer in range(LAYERS):
            del m.k[layer][length:]
            del m.v[layer][length:]

    def _free_model(self, s):
        self._release(self.model.pop(s).blocks)
        self.dead.append(s)

    def _snapshot(self):
        c = self.cache
        return (
            c._free_ids(),
            c._refs.copy(),
            c._next_id,
            {s: (c.length(s), c.block_table(s).tolist(), c._seqs[s].version) for s in c.sequences},
            bits(c._k).copy(),
            bits(c._v).copy(),
            c.stats(),
        )

    def _assert_unchanged(self, snap):
        now = self._snapshot()
        assert now[0] == snap[0] and now[2] == snap[2] and now[3] == snap[3] and now[6] == snap[6]
        np.testing.assert_array_equal(now[1], snap[1])
        assert np.array_equal(now[4], snap[4]) and np.array_equal(now[5], snap[5]), "pages changed"

    def _live(self, data, max_size=4):
        """A random non-empty subset of the live sequences, in random order ([] if none)."""
        live = sorted(self.model)
        if not live:
            return []
        return data.draw(
            st.lists(st.sampled_from(live), unique=True, min_size=1, max_size=max_size),
            label="seqs",
        )

    def _qkv(self, rng, T):
        c = self.cache
        return (
            rng.standard_normal((T, HQ, DK)).astype(np.float32),
            rng.standard_normal((T, HKV, DK)).astype(np.float32),
            rng.standard_normal((T, HKV, c.value_dim)).astype(np.float32),
        )

    def _check_step_outputs(self, layer, ids, counts, q, o):
        assert o.shape == (q.shape[0], HQ, self.cache.value_dim) and o.dtype == np.float32
        at = 0
        for s, n in zip(ids, counts):
            rows_k, rows_v = self.model[s].k[layer], self.model[s].v[layer]
            if n and all(r is not None for r in rows_k):
                K = np.stack(rows_k).astype(np.float32)
                V = np.stack(rows_v).astype(np.float32)
                want = reference.attention(q[at : at + n], K, V, causal=True, layout="bshd")
                np.testing.assert_allclose(
                    o[at : at + n], want, rtol=3e-5, atol=3e-5, err_msg=f"seq {s}, layer {layer}"
                )
            at += n

    # ---- rules -----------------------------------------------------------------------------
    @initialize(
        dtype=st.sampled_from(["float32", "float16", "bfloat16"]),
        value_dim=st.sampled_from([DK, 4]),
        isa=st.sampled_from(ISAS),
        start=st.integers(1, 4),
    )
    def setup(self, dtype, value_dim, isa, start):
        attnx._core.set_isa(isa)
        self.cache = attnx.PagedKVCache(
            num_layers=LAYERS,
            num_kv_heads=HKV,
            head_dim=DK,
            num_blocks=NUM_BLOCKS,
            block_size=BLOCK_SIZE,
            dtype=dtype,
            value_dim=value_dim,
        )
        self.model = {}
        self.mrefs = {}
        self.mfree = NUM_BLOCKS
        self.next_block = 0
        self.dead = []
        for _ in range(start):
            self.new_sequence()

    def teardown(self):
        attnx._core.set_isa(self.previous_isa)

    @precondition(lambda self: len(self.model) < MAX_SEQS)
    @rule()
    def new_sequence(self):
        s = self.cache.new_sequence()
        assert s not in self.model and s not in self.dead
        self.model[s] = MSeq([], [[] for _ in range(LAYERS)], [[] for _ in range(LAYERS)])
        assert self.cache.length(s) == 0

    @rule(
        data=st.data(),
        seed=st.integers(0, 2**32 - 1),
        layers=st.sampled_from([(0, 1), (1, 0), (0, 1), (1, 0), (0, 1), (0,), (1,)]),
        bad_first=st.sampled_from([False, False, False, True]),
        empty=st.sampled_from([False] * 9 + [True]),
        form=FORMS,
    )
    def step(self, data, seed, layers, bad_first, empty, form):
        ids = [] if empty else self._live(data)
        counts = [data.draw(st.integers(0, 12), label=f"count {s}") for s in ids]
        self._step(ids, counts, seed, layers, bad_first, form)

    @precondition(lambda self: self.model)
    @rule(
        data=st.data(),
        seed=st.integers(0, 2**32 - 1),
        n=st.integers(4, 18),
        layers=st.sampled_from([(0, 1), (1, 0)]),
        form=FORMS,
    )
    def prefill(self, data, seed, n, layers, form):
        """A long chunk for one sequence (it fills the pool quickly)."""
        s = data.draw(st.sampled_from(sorted(self.model)), label="seq")
        self._step([s], [n], seed, layers, False, form)

    @precondition(lambda self: self.model)
    @rule(seed=st.integers(0, 2**32 - 1), layers=st.sampled_from([(0, 1), (1, 0)]))
    def decode_all(self, seed, layers):
        """One token for every live sequence (the common case; it fills the pool over time)."""
        ids = sorted(self.model)
        self._step(ids, [1] * len(ids), seed, layers, False)

    def _step(self, ids, counts, seed, layers, bad_first, form="int"):
        rng = np.random.default_rng(seed)
        need = self._plan(ids, counts)
        as_ids, as_counts = [as_form(form, s) for s in ids], counts_as_form(form, counts)
        if need > self.mfree:
            snap = self._snapshot()
            try:
                self.cache.begin_step(as_ids, as_counts)
            except attnx.CacheFullError:
                self._assert_unchanged(snap)
                return
            raise AssertionError(
                f"begin_step({ids}, {counts}) should need {need} > {self.mfree} blocks"
            )
        starts = [self.model[s].length for s in ids]
        step = self.cache.begin_step(as_ids, as_counts)
        self._reserve(ids, counts)
        np.testing.assert_array_equal(step.q_lens, counts)
        np.testing.assert_array_equal(step.seq_lens, [self.model[s].length for s in ids])
        np.testing.assert_array_equal(
            step.positions,
            np.concatenate(
                [np.arange(a, a + n) for a, n in zip(starts, counts)] + [np.zeros(0, np.int64)]
            ),
        )
        T = sum(counts)
        for layer in layers:
            q, k, v = self._qkv(rng, T)
            if bad_first:  # a malformed attend is rejected before anything is written
                snap = self._snapshot()
                try:
                    step.attend(as_form(form, layer), q, k, v[:, :, :-1])
                except ValueError:
                    pass
                else:
                    raise AssertionError("a v of the wrong width was accepted")
                self._assert_unchanged(snap)
            o = step.attend(as_form(form, layer), q, k, v)
            at = 0
            for s, n in zip(ids, counts):
                m = self.model[s]
                base = m.length - n
                for i in range(n):
                    m.k[layer][base + i] = k[at + i].astype(self.cache.dtype)
                    m.v[layer][base + i] = v[at + i].astype(self.cache.dtype)
                at += n
            self._check_step_outputs(layer, ids, counts, q, o)

    @rule(data=st.data(), form=FORMS)
    def exhaust(self, data, form):
        """A batch that does not fit, often only because of its last sequence."""
        ids = self._live(data)
        if not ids:
            return
        counts = [data.draw(st.integers(0, 6), label=f"count {s}") for s in ids]
        need = self._plan(ids, counts)
        if need <= self.mfree:
            counts[-1] += (self.mfree - need + 1) * self.cache.block_size
        assert self._plan(ids, counts) > self.mfree
        snap = self._snapshot()
        try:
            self.cache.begin_step([as_form(form, s) for s in ids], counts_as_form(form, counts))
        except attnx.CacheFullError:
            pass
        else:
            raise AssertionError("the pool should be full")
        self._assert_unchanged(snap)

    @precondition(lambda self: len(self.model) < MAX_SEQS and self.model)
    @rule(data=st.data(), form=FORMS)
    def fork(self, data, form):
        self._fork(data.draw(st.sampled_from(sorted(self.model)), label="parent"), form)

    def _fork(self, parent, form="int"):
        child = self.cache.fork(as_form(form, parent))
        assert type(child) is int and child not in self.model and child not in self.dead
        m = self.model[parent].copy()
        for b in m.blocks:
            self.mrefs[b] += 1
        self.model[child] = m
        np.testing.assert_array_equal(self.cache.block_table(child), self.cache.block_table(parent))
        return child

    @precondition(lambda self: len(self.model) < MAX_SEQS and self.model)
    @rule(
        data=st.data(),
        seed=st.integers(0, 2**32 - 1),
        child_first=st.booleans(),
        layers=st.sampled_from([(0, 1), (1, 0)]),
    )
    def fork_and_diverge(self, data, seed, child_first, layers):
        """Fork, then parent and child write in one step (copy-on-write of a shared last block),
        sometimes sized to take exactly every free block."""
        bs = self.cache.block_size
        partial = sorted(s for s, m in self.model.items() if m.length % bs)
        parent = data.draw(st.sampled_from(partial or sorted(self.model)), label="parent")
        child = self._fork(parent)
        ids = [child, parent] if child_first else [parent, child]
        counts = [data.draw(st.integers(0, 6), label=f"count {s}") for s in ids]
        if data.draw(st.booleans(), label="exact fit"):
            counts = self._fit_exactly(ids, [max(1, counts[0]), counts[1]])
        if counts is not None and self._plan(ids, counts) <= self.mfree:
            self._step(ids, counts, seed, layers, False)

    def _fit_exactly(self, ids, counts):
        """``counts`` with the last one (>= 1) chosen so the step needs exactly every free block,
        or None if no count does."""
        for last in range(1, (self.mfree + 2) * self.cache.block_size + 1):
            trial = counts[:-1] + [last]
            need = self._plan(ids, trial)
            if need == self.mfree:
                return trial
            if need > self.mfree:
                return None
        return None

    @precondition(lambda self: self.model)
    @rule(data=st.data(), seed=st.integers(0, 2**32 - 1))
    def fill_exactly(self, data, seed):
        """A batch that takes exactly every free block: it must fit (the boundary of CacheFullError)."""
        ids = self._live(data)
        counts = self._fit_exactly(
            ids, [data.draw(st.integers(0, 4), label=f"count {s}") for s in ids]
        )
        if counts is not None:
            self._step(ids, counts, seed, (0, 1), False)
            assert self.cache.num_free_blocks == 0

    @precondition(lambda self: self.model)
    @rule(data=st.data(), form=FORMS)
    def truncate(self, data, form):
        s = data.draw(st.sampled_from(sorted(self.model)), label="seq")
        length = data.draw(st.integers(0, self.model[s].length), label="length")
        self.cache.truncate(as_form(form, s), as_form(form, length))
        self._truncate_model(s, length)
        assert self.cache.length(s) == length

    @precondition(lambda self: self.model)
    @rule(data=st.data(), form=FORMS)
    def free(self, data, form):
        s = data.draw(st.sampled_from(sorted(self.model)), label="seq")
        self.cache.free(as_form(form, s))
        self._free_model(s)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def free_while_iterating(self, data):
        doomed = set(
            data.draw(st.lists(st.sampled_from(sorted(self.model)), unique=True), label="doomed")
        )
        for s in self.cache.sequences:
            if s in doomed:
                self.cache.free(s)
                self._free_model(s)

    @precondition(lambda self: self.dead)
    @rule(data=st.data())
    def reuse_freed_id(self, data):
        s = data.draw(st.sampled_from(self.dead), label="dead id")
        live = sorted(self.model)
        snap = self._snapshot()
        for op in (
            lambda: self.cache.fork(s),
            lambda: self.cache.truncate(s, 0),
            lambda: self.cache.free(s),
            lambda: self.cache.length(s),
            lambda: self.cache.block_table(s),
            lambda: self.cache.begin_step(live + [s], [1] * (len(live) + 1)),
        ):
            try:
                op()
            except KeyError:
                pass
            else:
                raise AssertionError(f"freed id {s} was accepted")
        self._assert_unchanged(snap)

    @precondition(lambda self: self.model)
    @rule(
        data=st.data(),
        seed=st.integers(0, 2**32 - 1),
        how=st.sampled_from(["truncate", "free", "begin_again"]),
    )
    def stale_step(self, data, seed, how):
        ids = self._live(data) or [sorted(self.model)[0]]
        counts = [data.draw(st.integers(0, 3), label=f"count {s}") for s in ids]
        if self._plan(ids, counts) > self.mfree:
            return
        step = self.cache.begin_step(ids, counts)
        self._reserve(ids, counts)
        victim = data.draw(st.sampled_from(ids), label="victim")
        if how == "truncate":
            length = data.draw(st.integers(0, self.model[victim].length), label="length")
            self.cache.truncate(victim, length)
            self._truncate_model(victim, length)
        elif how == "free":
            self.cache.free(victim)
            self._free_model(victim)
        else:
            self.cache.begin_step([victim], [0])
        snap = self._snapshot()
        q, k, v = self._qkv(np.random.default_rng(seed), sum(counts))
        for layer in range(LAYERS):
            try:
                step.attend(layer, q, k, v)
            except attnx.StaleStepError:
                pass
            else:
                raise AssertionError("a stale step was attended")
        self._assert_unchanged(snap)

    # ---- invariants ------------------------------------------------------------------------
    @invariant()
    def pool_consistent(self):
        if self.cache is None:
            return
        c = self.cache
        assert sorted(c.sequences) == sorted(self.model)
        held = {}
        mapping = {}
        for s, m in self.model.items():
            bt = c.block_table(s).tolist()
            assert c.length(s) == m.length and type(c.length(s)) is int
            assert len(bt) == len(m.blocks) == -(-m.length // c.block_size)
            for mb, cb in zip(m.blocks, bt):
                assert mapping.setdefault(mb, cb) == cb, "sharing differs from the model"
                held[cb] = held.get(cb, 0) + 1
        assert len(set(mapping.values())) == len(mapping), "two model blocks share a cache block"
        free = c._free_ids()
        assert len(set(free)) == len(free) and not set(free) & set(held)
        assert len(free) + len(held) == c.num_blocks, "a block leaked"
        assert c.num_free_blocks == len(free) == self.mfree
        refs = np.zeros(c.num_blocks, np.int64)
        for b, n in held.items():
            refs[b] = n
        np.testing.assert_array_equal(c._refs, refs)
        for mb, cb in mapping.items():
            assert self.mrefs[mb] == refs[cb]
        st_ = c.stats()
        assert st_["used_blocks"] == len(held) and st_["logical_tokens"] == sum(
            m.length for m in self.model.values()
        )

    @invariant()
    def pages_read_back(self):
        if self.cache is None:
            return
        c = self.cache
        bs = c.block_size
        for s, m in self.model.items():
            if not m.length:
                continue
            bt = c.block_table(s)
            t = np.arange(m.length)
            blk, off = bt[t // bs], t % bs
            for layer in range(LAYERS):
                kp = c.k_pages(layer)[blk, :, off]
                vp = c.v_pages(layer)[blk, :, off]
                known = [i for i, r in enumerate(m.k[layer]) if r is not None]
                if known:
                    assert np.array_equal(
                        bits(kp[known]), bits(np.stack([m.k[layer][i] for i in known]))
                    ), f"k of seq {s} layer {layer}"
                    assert np.array_equal(
                        bits(vp[known]), bits(np.stack([m.v[layer][i] for i in known]))
                    ), f"v of seq {s} layer {layer}"


SETTINGS = settings(
    max_examples=1000 if SOAK else 50,
    stateful_step_count=60 if SOAK else 30,
    deadline=None,
    database=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.filter_too_much,
        HealthCheck.data_too_large,
    ],
)


def test_cache_state_machine():
    run_state_machine_as_test(CacheMachine, settings=SETTINGS)


# ---- prefix caching, evictions and sessions ----------------------------------------------------
# A second machine: every key and value is a function of the token ids up to it (and the extra
# key), as in a model, so a block a prompt hits must hold bit for bit what a fresh prefill of
# that prompt writes. Prompts come from a few shared stems, so hits, duplicates and evictions are
# frequent in a pool of 16 blocks of 4 slots. The test keeps, for every digest it has seen, the
# tokens from the start of the sequence, and checks every registered block against them.
# Steps also end early (issue 31): some layers attend, then the step is abandoned (the model
# raised, or the next step supersedes it), refused, or its sequence is freed or truncated. The
# model keeps each sequence's written prefix (tokens every layer has written); only that is read
# back, saved, or may be registered, and a hit must read what a recomputation writes.
P_BLOCKS, P_SEQS = 12, 5
HAVE_SAFETENSORS = importlib.util.find_spec("safetensors") is not None  # (the sessions extra)
STEMS = [tuple(range(1, 14)), (1, 2, 3, 4, 50, 60, 70, 80, 90, 100), (7,) * 12]


@functools.cache
def _content(extra, prefix, dtype):
    """The K and V rows (storage dtype) of the last token of ``prefix``: (LAYERS, 2, HKV, DK)."""
    seed = int.from_bytes(
        hashlib.blake2b(repr((extra, prefix)).encode(), digest_size=8).digest(), "little"
    )
    return (
        np.random.default_rng(seed)
        .standard_normal((LAYERS, 2, HKV, DK))
        .astype(np.float32)
        .astype(dtype)
    )


class PrefixCacheMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.cache = None
        self.tokens = {}  # seq -> its token ids (computed ones: len == cache.length)
        self.extra = {}
        self.written = {}  # seq -> its first tokens that every layer has written
        self.prefix_of = {}  # digest -> (extra, tokens from the start) of every block registered
        self.tmp = tempfile.TemporaryDirectory()

    def teardown(self):
        self.tmp.cleanup()

    @initialize(dtype=st.sampled_from(["float32", "float16", "bfloat16"]))
    def setup(self, dtype):
        self.cache = attnx.PagedKVCache(
            LAYERS,
            HKV,
            DK,
            num_blocks=P_BLOCKS,
            block_size=BLOCK_SIZE,
            dtype=dtype,
            prefix_caching=True,
        )

    def _rows(self, seq, start, end):
        """The model's K and V of ``seq``'s tokens [start, end): (LAYERS, 2, n, HKV, DK)."""
        t, e = tuple(self.tokens[seq]), self.extra[seq]
        if start == end:
            return np.zeros((LAYERS, 2, 0, HKV, DK), self.cache.dtype)
        return np.stack(
            [_content(e, t[: i + 1], self.cache.dtype) for i in range(start, end)], axis=2
        )

    def _snapshot(self):
        return cache_state(self.cache)

    def _assert_unchanged(self, snap):
        now = self._snapshot()
        assert now[:6] == snap[:6]
        assert now[6:] == snap[6:], "pages changed"

    @precondition(lambda self: len(self.tokens) < P_SEQS)
    @rule(
        stem=st.sampled_from(STEMS),
        cut=st.sampled_from([0, 5, 8, 9, 12, 13]),
        tail=st.lists(st.integers(0, 3), max_size=3),
        extra=st.sampled_from([None, None, "adapter"]),
        compute=st.booleans(),
    )
    def new_prompt(self, stem, cut, tail, extra, compute):
        prompt = list(stem[:cut]) + tail or [0]
        s = self.cache.new_sequence(tokens=np.array(prompt, np.uint16), extra_key=extra)
        hit = self.cache.length(s)
        assert hit % BLOCK_SIZE == 0 and hit <= len(prompt) - 1
        self.tokens[s], self.extra[s], self.written[s] = prompt[:hit], extra, hit
        if hit:  # a hit reads what a fresh prefill of the prompt writes
            event("prefix hit")
            self._check_seq(s)
        if compute:
            self._step([s], [len(prompt) - hit], [None], seed=len(prompt), pending=prompt)

    def _begin(self, ids, counts, new_tokens, pending=None):
        """begin_step, in the cache and the model: (step, its K/V rows, starts), or None when the
        pool is full (nothing changed)."""
        snap = self._snapshot()
        try:
            step = self.cache.begin_step(ids, counts, tokens=new_tokens)
        except attnx.CacheFullError:
            self._assert_unchanged(snap)
            return None
        starts = [len(self.tokens[s]) for s in ids]
        for s, t in zip(ids, new_tokens):
            self.tokens[s] = self.tokens[s] + list(
                pending[len(self.tokens[s]) :] if t is None else t
            )
            assert len(self.tokens[s]) == self.cache.length(s)
        if step._shared_groups():
            event("shared-prefix split")
        if self.cache.stats()["evictions"] > snap[4]["evictions"]:
            event("eviction")
        rows = [
            self._rows(s, self.cache.length(s) - n, self.cache.length(s))
            for s, n in zip(ids, counts)
        ]
        kv = (
            np.concatenate(rows, axis=2)
            if sum(counts)
            else np.zeros((LAYERS, 2, 0, HKV, DK), self.cache.dtype)
        )
        return step, kv, starts

    def _step(self, ids, counts, new_tokens, seed, pending=None):
        begun = self._begin(ids, counts, new_tokens, pending)
        if begun is None:
            return
        step, kv, starts = begun
        rng = np.random.default_rng(seed)
        T = sum(counts)
        gap = {s for s, start in zip(ids, starts) if self.written[s] != start}
        for layer in range(LAYERS):
            q = rng.standard_normal((T, HQ, DK)).astype(np.float32)
            o = step.attend(layer, q, kv[layer, 0], kv[layer, 1])
            at = 0
            for s, n in zip(ids, counts):
                if n and s not in gap:  # (behind a gap the model's rows are not the cache's)
                    full = self._rows(s, 0, self.cache.length(s))[layer].astype(np.float32)
                    want = reference.attention(
                        q[at : at + n], full[0], full[1], causal=True, layout="bshd"
                    )
                    np.testing.assert_allclose(o[at : at + n], want, rtol=3e-5, atol=3e-5)
                at += n
        for s, start, n in zip(ids, starts, counts):  # every layer wrote: written, unless a gap
            if s not in gap:
                self.written[s] = start + n
        if gap:
            event("step behind a gap")

    @precondition(lambda self: self.tokens)
    @rule(
        data=st.data(),
        seed=st.integers(0, 2**16),
        ending=st.sampled_from(["abandoned", "refused", "freed", "truncated"]),
    )
    def step_ends_early(self, data, seed, ending):
        """A step attended in some layers only (any order, maybe none), then: abandoned (the
        model raised between layers; the next step of a sequence supersedes it), a refused
        attend, or one of its sequences freed or truncated (its next attend is stale)."""
        ids = data.draw(
            st.lists(st.sampled_from(sorted(self.tokens)), unique=True, min_size=1, max_size=3)
        )
        counts = [data.draw(st.integers(1, 6)) for _ in ids]
        new = [data.draw(st.lists(st.integers(0, 3), min_size=n, max_size=n)) for n in counts]
        layers = data.draw(
            st.lists(st.sampled_from(range(LAYERS)), unique=True, max_size=LAYERS - 1)
        )
        begun = self._begin(ids, counts, new)
        if begun is None:
            return
        step, kv, _ = begun
        q = np.random.default_rng(seed).standard_normal((sum(counts), HQ, DK)).astype(np.float32)
        for layer in layers:
            step.attend(layer, q, kv[layer, 0], kv[layer, 1])
        left = next(layer for layer in range(LAYERS) if layer not in layers)
        if ending == "refused":
            with pytest.raises(ValueError):
                step.attend(left, q, kv[left, 0][..., : DK // 2], kv[left, 1])
        elif ending in ("freed", "truncated"):
            victim = data.draw(st.sampled_from(ids))
            if ending == "freed":
                self._free(victim)
            else:
                self._truncate(victim, data.draw(st.integers(0, len(self.tokens[victim]))))
            with pytest.raises(attnx.StaleStepError):
                step.attend(left, q, kv[left, 0], kv[left, 1])
        event(f"step ended early: {ending}")

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), seed=st.integers(0, 2**16))
    def step(self, data, seed):
        ids = data.draw(
            st.lists(st.sampled_from(sorted(self.tokens)), unique=True, min_size=1, max_size=4)
        )
        counts = [data.draw(st.integers(0, 6)) for _ in ids]
        new = [data.draw(st.lists(st.integers(0, 3), min_size=n, max_size=n)) for n in counts]
        self._step(ids, counts, new, seed)

    @precondition(lambda self: self.tokens)
    @rule(seed=st.integers(0, 2**16))
    def decode_all(self, seed):
        """One token for every sequence: forks and hits share their leading blocks."""
        ids = sorted(self.tokens)
        self._step(ids, [1] * len(ids), [[seed % 4]] * len(ids), seed)

    @precondition(lambda self: self.tokens and len(self.tokens) < P_SEQS)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.tokens)))
        child = self.cache.fork(parent)
        self.tokens[child], self.extra[child] = list(self.tokens[parent]), self.extra[parent]
        self.written[child] = self.written[parent]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def truncate(self, data):
        s = data.draw(st.sampled_from(sorted(self.tokens)))
        self._truncate(s, data.draw(st.integers(0, len(self.tokens[s]))))

    def _truncate(self, s, n):
        self.cache.truncate(s, n)
        del self.tokens[s][n:]
        self.written[s] = min(self.written[s], n)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        self._free(data.draw(st.sampled_from(sorted(self.tokens))))

    def _free(self, s):
        self.cache.free(s)
        del self.tokens[s], self.extra[s], self.written[s]

    @precondition(lambda self: HAVE_SAFETENSORS and self.tokens and len(self.tokens) < P_SEQS)
    @rule(data=st.data(), also_free=st.booleans())
    def save_and_load(self, data, also_free):
        s = data.draw(st.sampled_from(sorted(self.tokens)))
        path = os.path.join(self.tmp.name, "session.safetensors")
        if self.written[s] < len(self.tokens[s]):  # a step of it ended early: refused, no file
            with pytest.raises(ValueError, match="not written in every layer"):
                self.cache.save(s, path + ".refused", meta={"model": "test"})
            assert not os.path.exists(path + ".refused")
            return
        self.cache.save(s, path, meta={"model": "test"})
        tokens, extra = self.tokens[s], self.extra[s]
        if also_free:
            self._free(s)
        snap = self._snapshot()
        try:
            t = self.cache.load(path, expect={"model": "test"})
        except attnx.CacheFullError:
            self._assert_unchanged(snap)
            return
        event("session loaded")
        self.tokens[t], self.extra[t] = (
            list(tokens),
            extra,
        )  # (the file keeps the extra key's chain)
        self.written[t] = len(tokens)
        self._check_seq(t)

    def _check_seq(self, s):
        """``s``'s written tokens read back the model's rows (past them: unwritten, unchecked)."""
        c, n = self.cache, self.written[s]
        assert c._seqs[s].written == n
        if not n:
            return
        bt = c.block_table(s)
        t = np.arange(n)
        want = self._rows(s, 0, n)
        for layer in range(LAYERS):
            kp = c.k_pages(layer)[bt[t // BLOCK_SIZE], :, t % BLOCK_SIZE]
            vp = c.v_pages(layer)[bt[t // BLOCK_SIZE], :, t % BLOCK_SIZE]
            assert np.array_equal(bits(kp), bits(want[layer, 0])), f"k of seq {s} layer {layer}"
            assert np.array_equal(bits(vp), bits(want[layer, 1])), f"v of seq {s} layer {layer}"

    @invariant()
    def sequences_read_back(self):
        if self.cache is not None:
            for s in self.tokens:
                self._check_seq(s)

    @invariant()
    def registry_consistent(self):
        if self.cache is None:
            return
        c, a = self.cache, self.cache._alloc
        held = np.zeros(c.num_blocks, np.int64)
        for s in self.tokens:
            assert c.length(s) == len(self.tokens[s])
            for b in c.block_table(s):
                held[b] += 1
            rec = c._seqs[s]
            if rec.tokens is not None:
                for i, d in enumerate(rec.digests):
                    self.prefix_of[d] = (
                        self.extra[s],
                        tuple(self.tokens[s][: (i + 1) * BLOCK_SIZE]),
                    )
        np.testing.assert_array_equal(c._refs, held)  # refcount == holders
        free, evictable, cached = c._free_ids(), a.evictable_ids(), a.cached()
        assert len(set(free)) == len(free) == c.num_free_blocks and not set(free) & set(
            np.flatnonzero(held)
        )
        assert len(free) + np.count_nonzero(held) == c.num_blocks, "a block leaked"
        # evictable == registered and unreferenced: a referenced block is never evictable
        assert sorted(evictable) == sorted(b for b in cached if held[b] == 0)
        assert c.stats()["cached_blocks"] == len(cached) and c.stats()["evictable_blocks"] == len(
            evictable
        )
        for b, entry in cached.items():
            assert a._by_digest[entry.digest] == b
            assert block_digest(entry.parent, np.frombuffer(entry.tokens, "<i8")) == entry.digest
            extra, prefix = self.prefix_of[entry.digest]
            assert np.frombuffer(entry.tokens, "<i8").tolist() == list(prefix[-BLOCK_SIZE:])
            rows = np.stack(
                [
                    _content(extra, prefix[: i + 1], c.dtype)
                    for i in range(len(prefix) - BLOCK_SIZE, len(prefix))
                ],
                axis=2,
            )
            for layer in range(LAYERS):
                assert np.array_equal(
                    bits(c.k_pages(layer)[b]), bits(rows[layer, 0].swapaxes(0, 1))
                ), f"cached block {b}"
                assert np.array_equal(
                    bits(c.v_pages(layer)[b]), bits(rows[layer, 1].swapaxes(0, 1))
                ), f"cached block {b}"


def test_prefix_cache_state_machine(monkeypatch):
    monkeypatch.setattr(
        attnx.ops.cascade, "MIN_SAVED_KEYS", 0
    )  # every shared run goes through the split path
    run_state_machine_as_test(PrefixCacheMachine, settings=SETTINGS)
