"""How rows are timed, and the progress line.

attnx and its peers (torch, onnxruntime) are timed interleaved: each repetition times every one of
them once, in a rotating order, and the table reports medians, so the ratios come from the same
moments of a shared, noisy machine. Each of those samples follows untimed calls of the same
function for as long as a sample lasts (one call at least): every library keeps its own thread
pool (attnx's own, torch's OpenMP, onnxruntime's), whose idle threads spin for a while after a
call, and the first calls after another library's pay for that; a user calling one library in a
loop never does. One settle call was not enough for calls of a few milliseconds: vLLM's op and
attnx's decode read 15-70% slow after each other (bench/NOTES.md).

The NumPy reference is timed on its own, before those rounds, and followed by a pause: OpenBLAS's
threads spin for about 0.1 s after each call, longer than a settle call lasts, and attnx rows
timed right after reference calls read 45% of the FMA peak instead of 68%."""

from __future__ import annotations

import math
import statistics
import sys
import time

# after the reference, long enough for OpenBLAS's spinning threads to go to sleep (its default
# timeout is 2^28 cycles, about 0.1 s)
QUIESCE_S = 0.5

HOW_TIMED = (
    "timing: {who} interleaved ({rounds}, rotating order, "
    "untimed calls for as long as a sample before each sample), medians; the NumPy reference "
    "(float64) timed "
    f"alone before them, then a {QUIESCE_S} s pause so its BLAS threads are idle"
)


def clock(fn, inner):
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - t0) / inner


def _inner(t, sample_s):
    """Calls per sample so that a sample of a tiny call lasts at least ``sample_s``."""
    return 1 if t >= sample_s else min(100000, math.ceil(sample_s / max(t, 1e-7)))


def settle(fn, seconds):
    """Untimed calls of ``fn`` for at least ``seconds``, one call at least (the module's
    docstring says why)."""
    t_end = time.perf_counter() + seconds
    fn()
    while time.perf_counter() < t_end:
        fn()


def interleaved(fns, repeat, *, sample_s=0.02, on_round=None):
    """Times every callable of ``fns`` (name -> fn) ``repeat`` times, alternating them, each
    repetition in a rotated order, each sample after untimed calls for ``sample_s`` (``settle``).
    Returns name -> list of seconds per call."""
    names = list(fns)
    inner = {name: _inner(clock(fns[name], 1), sample_s) for name in names}  # warm-up, calibrate
    samples = {name: [] for name in names}
    for r in range(repeat):
        if on_round is not None:
            on_round(r + 1, repeat)
        for name in names[r % len(names) :] + names[: r % len(names)]:
            settle(fns[name], sample_s)
            samples[name].append(clock(fns[name], inner[name]))
    return samples


def alone(fn, samples, *, sample_s=0.02):
    """Times ``fn`` on its own (the slow reference): a long warm-up call counts as the first
    sample; then a pause so that its library's threads stop spinning before anything else runs."""
    t = clock(fn, 1)
    inner = _inner(t, sample_s)
    out = [t] if inner == 1 else []
    while len(out) < samples:
        out.append(clock(fn, inner))
    time.sleep(QUIESCE_S)
    return out


def median(xs):
    return statistics.median(xs) if xs else None


def spread(xs):
    """Relative half-range of the middle samples: a cheap noise indicator."""
    if not xs or len(xs) < 3:
        return None
    s = sorted(xs)
    lo, hi = s[len(s) // 4], s[(3 * len(s) - 1) // 4]
    return (hi - lo) / 2 / statistics.median(s)


class Progress:
    """The progress line on stderr: rewritten in place on a terminal, plain lines otherwise (a log
    file or a pipe gets one line when a row starts and one when it ends)."""

    def __init__(self, total, stream=None):
        self.total = total
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.i, self.name, self.t0 = 0, "", time.perf_counter()

    def _write(self, text, final):
        if self.tty:
            self.stream.write("\r\x1b[K" + text + ("\n" if final else ""))
        elif final or not text.endswith("…"):
            self.stream.write(text + "\n")
        self.stream.flush()

    def start(self, name):
        self.i, self.name = self.i + 1, name
        self._write(f"[{self.i}/{self.total}] {name} ...", False)

    def phase(self, what):
        """A step inside the row: shown on a terminal only."""
        if self.tty:
            self._write(
                f"[{self.i}/{self.total}] {self.name}: {what} "
                f"({time.perf_counter() - self.t0:.0f} s) …",
                False,
            )

    def done(self, summary):
        self._write(f"[{self.i}/{self.total}] {self.name}: {summary}", True)
