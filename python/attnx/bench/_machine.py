"""What ran the benchmark: the CPU, its topology, the library versions and build, the machine's
limits (FMA peak, read bandwidth) and how busy other processes kept it."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import subprocess

import numpy as np

import attnx

GiB = 1 << 30
MiB = 1 << 20
# the limit each kind of work is measured against: (key of the probed value, name in the table)
LIMITS = {"flops": ("fma_gflops_all", "FMA peak"), "bytes": ("read_gbps_all", "read BW")}


def _read(path):
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def cpu_model():
    """The CPU's model name from /proc/cpuinfo (``platform.processor()`` elsewhere)."""
    text = _read("/proc/cpuinfo") or ""
    for line in text.splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def cpu_topology():
    """Which logical CPUs share a physical core: decides what "2 threads >= 1.8x 1 thread" can mean
    (two SMT siblings share one core's FMA units, so they cannot double FLOP throughput)."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:
        cpus = list(range(os.cpu_count() or 1))
    siblings = {}
    for c in cpus:
        s = _read(f"/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list")
        if s is not None:
            siblings[c] = s
    cores = set(siblings.values())
    smt = any(("," in s or "-" in s) for s in siblings.values())
    return {
        "logical_cpus": os.cpu_count(),
        "usable_cpus": len(cpus),
        "thread_siblings": siblings,
        "physical_cores": len(cores) if siblings else None,
        "smt_siblings_present": smt if siblings else None,
    }


def _version_of(module):
    try:
        return __import__(module).__version__
    except ImportError:
        return None


def versions(peers):
    """Library versions; ``peers`` maps a peer's name to its version (None: not installed)."""
    return {
        "attnx": attnx.__version__,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "ml_dtypes": _version_of("ml_dtypes"),
        **peers,
    }


def build_info():
    """Which build of the core ran: its file's time stamp and, in a git checkout, the commit."""
    info = {"core_file": getattr(attnx._core, "__file__", None), "core_mtime": None, "git": None}
    try:
        info["core_mtime"] = _dt.datetime.fromtimestamp(
            os.path.getmtime(info["core_file"]), _dt.timezone.utc
        ).strftime("%Y-%m-%d %H:%M UTC")
    except (OSError, TypeError):
        pass
    src = os.path.dirname(os.path.abspath(attnx.__file__))
    try:
        head = subprocess.run(
            ["git", "-C", src, "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            timeout=5,
        )
        if head.returncode == 0:
            info["git"] = head.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def machine_info(threads, peers):
    return {
        "build": build_info(),
        "cpu_model": cpu_model(),
        "platform": platform.platform(),
        "threads": threads,
        "isa": attnx.cpu_features()["isa"],
        "cpu_features": attnx.cpu_features(),
        "topology": cpu_topology(),
        "versions": versions(peers),
    }


def read_probe_size(nbytes):
    """The buffer the read probe takes for a row that reads ``nbytes``: the row's own bytes,
    rounded up to whole huge pages (2 MiB). A row's pages sit in whichever level of the memory
    they fit (a decode row smaller than the last-level cache stays there between calls), so its
    "% read BW" is taken against a probe of the same size, not against DRAM's."""
    return max(2 * MiB, -(-int(nbytes) // (2 * MiB)) * (2 * MiB))


_READ_PREFIX, _READ_SUFFIX = "read_gbps_", "MiB"


def read_key(nbytes):
    """The limits' key of the read probe for a row of ``nbytes``."""
    return f"{_READ_PREFIX}{read_probe_size(nbytes) // MiB}{_READ_SUFFIX}"


def sized_reads(values):
    """The read probes run at rows' sizes, as (MiB, GB/s), smallest first."""
    n0, n1 = len(_READ_PREFIX), len(_READ_SUFFIX)
    return sorted(
        (int(k[n0:-n1]), v)
        for k, v in values.items()
        if k.startswith(_READ_PREFIX) and k.endswith(_READ_SUFFIX)
    )


def read_gbps(values, nbytes=None):
    """The read bandwidth a row of ``nbytes`` is measured against, and its name: the probe of its
    size where one ran, else the large (DRAM) probe's."""
    key = None if nbytes is None else read_key(nbytes)
    if key in values:
        return values[key], f"{read_probe_size(nbytes) // MiB} MiB"
    return values["read_gbps_all"], None


class Limits:
    """The machine's limits. Measured before the suite and once more after it; each limit is the
    larger of the two, so that a probe that ran while someone else used the CPUs does not lower
    the denominator of every row's "% of limit". ``row_bytes``: the bytes each bandwidth-bound
    row reads; the read probe also runs at each of those sizes (``read_probe_size``) below
    ``nbytes``, the large probe's (a larger row is taken against that one: it reads DRAM too)."""

    def __init__(self, threads, *, secs, nbytes, log, row_bytes=()):
        self.threads, self.secs, self.nbytes, self.log = threads, secs, nbytes, log
        self.sizes = sorted({s for s in map(read_probe_size, row_bytes) if s < nbytes})
        self.runs = []
        self.values = {}

    def probe(self, again=False):
        self.log("probing FMA peak and read bandwidth" + (" again" if again else "") + " ...")
        core = attnx._core
        run = {
            "fma_gflops_all": core.probe_fma_gflops(self.threads, self.secs),
            "fma_gflops_1": core.probe_fma_gflops(1, self.secs),
            "read_gbps_all": core.probe_read_gbps(self.threads, self.nbytes, self.secs + 0.2),
        }
        for size in self.sizes:
            run[read_key(size)] = core.probe_read_gbps(self.threads, size, self.secs)
        self.runs.append(run)
        self.values = {k: max(r[k] for r in self.runs) for k in run}
        self.values.update(threads=self.threads, isa=attnx.cpu_features()["isa"])
        self.log(
            f"  FMA peak {run['fma_gflops_all']:.1f} GFLOP/s ({self.threads} threads), "
            f"{run['fma_gflops_1']:.1f} (1 thread); read {run['read_gbps_all']:.1f} GB/s"
            + "".join(f", {mib} MiB {v:.1f}" for mib, v in sized_reads(run))
        )

    def pct(self, kind, rate, nbytes=None):
        """``rate`` (GFLOP/s or GB/s) as % of this kind's limit, and the limit's name. A bytes
        row of ``nbytes`` is taken against the read probe of its size (``read_gbps``)."""
        key, name = LIMITS[kind]
        if kind != "bytes":
            return 100 * rate / self.values[key], name
        gbps, size = read_gbps(self.values, nbytes)
        return 100 * rate / gbps, name + (f" ({size})" if size else "")


class CpuShare:
    """How much CPU other processes used while a row ran: /proc/stat's busy time of the whole
    machine minus this process's (and its children's) own CPU time. The machines are shared, and
    a row measured while someone else compiled is flagged instead of silently trusted."""

    def __init__(self):
        self.start = self._snap()

    @staticmethod
    def _snap():
        text = _read("/proc/stat")
        if not text:
            return None
        f = [int(x) for x in text.splitlines()[0].split()[1:]]
        idle = f[3] + (f[4] if len(f) > 4 else 0)
        tick = os.sysconf("SC_CLK_TCK")
        t = os.times()
        own = t.user + t.system + t.children_user + t.children_system
        return (sum(f[:8]) - idle) / tick, sum(f[:8]) / tick, own

    def others(self):
        """Fraction of the machine's CPU time (0..1) used by other processes since start."""
        end = self._snap()
        if self.start is None or end is None:
            return None
        busy, total, own = (e - s for e, s in zip(end, self.start))
        if total <= 0:
            return None
        return max(0.0, min(1.0, (busy - own) / total))
