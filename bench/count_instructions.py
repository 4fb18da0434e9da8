#!/usr/bin/env python3
"""Instructions per score and per key in the generated kernel code, NEON against x86 (issue 35).

By hand, not part of CI; no GPU and no aarch64 CPU needed:
    python bench/count_instructions.py [--jobs 1]
Needs cmake, ninja, g++ and, for NEON, aarch64-linux-gnu-g++ and aarch64-linux-gnu-objdump
(Debian/Ubuntu: apt-get install g++-aarch64-linux-gnu binutils-aarch64-linux-gnu).

ARM speed cannot be measured under emulation; this counts instructions instead (bench/NOTES.md,
"ARM: instructions per score and per key"). For each path (avx2, avx512, neon, and the
dot-product units avx512bf16 and neon_bf16: bf16 pairs for prefill, int8 codes for integer
queries) it
1. configures build/count-x86 and build/count-a64 (the latter as .ci/portable/cross_aarch64.sh
   does) and builds the kernel unit's object (isa_<isa>.cpp) with the project's own flags;
2. compiles, with exactly that unit's compile command, a probe unit: the unit's own text (the same
   -inl.h stages in the same namespace) plus one non-inlined wrapper per stage with fixed template
   arguments, so that each stage's loops sit in a function of their own;
3. disassembles each wrapper (objdump -d --no-show-raw-insn -C), takes the loop with the most FMAs
   (the innermost such: the shortest range from a backward branch's target to that branch),
   counts its instructions on the fall-through path (forward branches inside the loop skip their
   span: the per-8-features prefetch of the QK loop, for one; in the dot-product units the dot
   instructions take the FMAs' place), splits them into arithmetic,
   loads/stores, shuffles/converts and other, and divides by the work of one iteration.
As a check, PV's 6-row loop is also counted in the library's own object (pv_rows<6, Native>).
"""

from __future__ import annotations

import argparse
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OBJ = "CMakeFiles/attnx_core.dir/cpp/src/kernels/isa_{isa}.cpp.o"
PATHS = {  # isa: (build dir, lanes, objdump)
    "avx2": ("build/count-x86", 8, "objdump"),
    "avx512": ("build/count-x86", 16, "objdump"),
    "neon": ("build/count-a64", 4, "aarch64-linux-gnu-objdump"),
    "avx512bf16": ("build/count-x86", 16, "objdump"),
    "neon_bf16": ("build/count-a64", 4, "aarch64-linux-gnu-objdump"),
}
DOT_PATHS = ("avx512bf16", "neon_bf16")
CONFIGURE = {
    "build/count-x86": [],
    "build/count-a64": [
        "-DCMAKE_SYSTEM_NAME=Linux",
        "-DCMAKE_SYSTEM_PROCESSOR=aarch64",
        "-DCMAKE_CXX_COMPILER=aarch64-linux-gnu-g++",
    ],
}

# One wrapper per stage. Decode: a GQA group of 4 query rows against one kv head's keys read in
# place (qk_dot's 4-row block, pv's 4-row block); prefill: 6-row blocks (qk_packed, pv).
PROBES = r"""
namespace ISA {
constexpr int kDecodeKB = W >= 16 ? 4 : 2;  // qk_dot's keys per 4-row block
constexpr int kExpR = W >= 16 ? 4 : 2;      // softmax_rows' rows per online_update
[[gnu::noinline]] void cnt_qk(const Real* q, int64_t ldq, const Real* kt, int64_t Dkp, int64_t nw,
                              Real* s) {
  LinePrefetch pf;
  int64_t call = 0;
  qk_packed_rows<6, false>(q, ldq, kt, Dkp, nw, s, pf, call, nullptr);
}
[[gnu::noinline]] bool cnt_exp(Real* s, int64_t nw, Real* m, Real* l, Real* o, int64_t ldo,
                               int64_t Dvp) {
  return online_update<kExpR>(s, nw, m, l, o, ldo, Dvp);
}
[[gnu::noinline]] void cnt_pv(const Real* p, const Real* const* v, int64_t n, int64_t Dvp, Real* o,
                              int64_t ldo) {
  pv_rows<6, Native>(p, v, n, Dvp, o, ldo, nullptr, 0, 0);
}
#define CNT_DECODE(T)                                                                             \
  [[gnu::noinline]] void cnt_dqk_##T(const Real* q, int64_t ldq, const Real* const* k, int64_t n, \
                                     int64_t Dk, Real* s) {                                       \
    qk_dot_rows<4, kDecodeKB, T>(0, q, ldq, k, n, Dk, s, nullptr, 0, 0);                          \
  }                                                                                               \
  [[gnu::noinline]] void cnt_dpv_##T(const Real* p, const Real* const* v, int64_t n, int64_t Dvp, \
                                     Real* o, int64_t ldo) {                                      \
    pv_rows<4, T>(p, v, n, Dvp, o, ldo, nullptr, 0, 0);                                           \
  }
CNT_DECODE(Native)
CNT_DECODE(F16)
CNT_DECODE(BF16)
}  // namespace ISA
}  // namespace attnx
"""

# The dot-product units' probes: bf16 prefill's 6-row blocks (qk_bf16_block: 4 vectors of keys,
# one pair of features per iteration; pv_bf16_block: 4 vectors of features, one pair of keys) and
# integer queries' decode block (qk_int8_block: 4 rows x 4 keys, kI8Bytes features).
DOT_PROBES = r"""
namespace ISA {
[[gnu::noinline]] void cnt_bqk(const Pair* qb, int64_t ldq, const Pair* kp, int64_t d2n,
                               float scale, float* s) {
  qk_bf16_block<6, Bf16P<false>>(qb, ldq, kp, d2n, scale, s, nullptr);
}
[[gnu::noinline]] void cnt_bpv(const Pair* p, const Pair* vp, int64_t n2, int64_t Dvp, int64_t c,
                               float* o, int64_t ldo) {
  pv_bf16_block<6, 4>(p, vp, n2, Dvp, c, o, ldo);
}
[[gnu::noinline]] void cnt_iqk(const int8_t* q8, int64_t ld, int64_t Dk, const Real* const* kr,
                               Real* s) {
  qk_int8_block<4, 4>(q8, ld, Dk, kr, s);
}
}  // namespace ISA
}  // namespace attnx
"""

X86_FMA = re.compile(r"^(vf(n)?m(add|sub)\d+[ps]s|vdpbf16ps|vpdpbusd)$")
X86_ARITH = re.compile(r"^v(mul|add|sub|max|min|div)[ps]s$")
X86_SHUF = re.compile(
    r"^v(perm|shuf|unpck|punpck|cvt|pmov[sz]x|psll|psrl|psra|insert|extract|blend|pblend|movshdup"
    r"|movsldup|movhlps|movlhps|pshuf)"
)
X86_MOVE = re.compile(r"^(v?mov|vbroadcast|vpbroadcast|vmaskmov)")
A64_FMA = re.compile(r"^(fml[as]|bfdot|sdot)$")
A64_ARITH = re.compile(r"^f(mul|add|sub|max|min|div|maxnm|minnm|addp|neg)$")
A64_SHUF = re.compile(
    r"^(fcvt|[su]cvtf|[su]?shll2?|xtn2?|zip|uzp|trn|ext$|dup$|ins$|shl$|[su]shr$|frint)"
)
A64_MEM = re.compile(r"^(ld|st)")
SHOW = False  # --show: print each counted loop
TARGET = re.compile(r"\b([0-9a-f]+) <.*>$")


@dataclass
class Insn:
    addr: int
    mnem: str
    ops: str


def sh(cmd: list[str], cwd: Path = ROOT) -> str:
    r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"count_instructions: {shlex.join(cmd)} failed:\n{r.stdout}{r.stderr}")
    return r.stdout


def configure(build: str) -> None:
    if not (ROOT / build / "build.ninja").exists():
        sh(
            ["cmake", "-S", ".", "-B", build, "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release"]
            + CONFIGURE[build]
        )


def probe_command(cmd: list[str], src: Path, obj: Path) -> list[str]:
    """The unit's compile command for the probe unit: same flags, no dependency file."""
    out: list[str] = []
    args = iter(cmd)
    for a in args:
        if a in ("-MT", "-MF", "-o", "-c"):
            next(args)
            out += {"-o": ["-o", str(obj)], "-c": ["-c", str(src)]}.get(a, [])
        elif a != "-MD":
            out.append(a)
    return out + ["-w"]


def compile_probe(isa: str, jobs: int) -> tuple[Path, Path, str]:
    """Builds the unit's object; compiles the probe unit with the same command. Returns both
    objects and the compiler's version line."""
    build, _, _ = PATHS[isa]
    configure(build)
    obj = OBJ.format(isa=isa)
    sh(["ninja", "-C", build, f"-j{jobs}", obj])
    cmd = shlex.split(sh(["ninja", "-C", build, "-t", "commands", obj]).strip().splitlines()[-1])
    unit = ROOT / f"cpp/src/kernels/isa_{isa}.cpp"
    text = unit.read_text()
    probe_src = ROOT / build / f"count_{isa}.cpp"
    probes = DOT_PROBES if isa in DOT_PATHS else PROBES
    probe_src.write_text(text[: text.index("namespace kern {")] + probes.replace("ISA", isa))
    probe_obj = ROOT / build / f"count_{isa}.o"
    subprocess.run(probe_command(cmd, probe_src, probe_obj), cwd=ROOT / build, check=True)
    version = sh([cmd[0], "--version"]).splitlines()[0]
    return ROOT / build / obj, probe_obj, version


def disassemble(objdump: str, obj: Path) -> dict[str, list[Insn]]:
    funcs: dict[str, list[Insn]] = {}
    cur: list[Insn] | None = None
    for line in sh([objdump, "-d", "--no-show-raw-insn", "-C", str(obj)]).splitlines():
        m = re.match(r"^[0-9a-f]+ <(.*)>:$", line)
        if m:
            cur = funcs.setdefault(m.group(1), [])
            continue
        m = re.match(r"^\s+([0-9a-f]+):\s+(\S+)\s*(.*)$", line)
        if m and cur is not None:
            ops = re.split(r"\s+(//|#)\s", m.group(3))[0].strip()  # objdump's comments
            cur.append(Insn(int(m.group(1), 16), m.group(2), ops))
    return funcs


def branch_target(i: Insn, a64: bool) -> int | None:
    is_branch = (
        (i.mnem.startswith("b") or i.mnem in ("cbz", "cbnz", "tbz", "tbnz"))
        if a64
        else (i.mnem.startswith("j"))
    )
    if not is_branch or i.mnem in ("bl", "blr", "br", "bic", "bif", "bit", "bsl"):
        return None
    m = TARGET.search(i.ops)
    return int(m.group(1), 16) if m else None


def classify(i: Insn, a64: bool) -> str:
    if a64:
        if A64_FMA.match(i.mnem) or A64_ARITH.match(i.mnem):
            return "arith"
        if A64_MEM.match(i.mnem):
            return "mem"
        if A64_SHUF.match(i.mnem):
            return "shuf"
        return "other"
    if X86_FMA.match(i.mnem) or X86_ARITH.match(i.mnem):
        return "arith"
    if X86_SHUF.match(i.mnem):
        return "shuf"
    if X86_MOVE.match(i.mnem) and "(" in i.ops:
        return "mem"
    return "other"


def is_fma(i: Insn, a64: bool) -> bool:
    return bool((A64_FMA if a64 else X86_FMA).match(i.mnem))


def loops(insns: list[Insn], a64: bool) -> list[list[Insn]]:
    """Each backward branch's range: from its target to the branch."""
    out = []
    for i in insns:
        t = branch_target(i, a64)
        if t is not None and insns[0].addr <= t <= i.addr:  # (not a relocated call's 0)
            out.append([x for x in insns if t <= x.addr <= i.addr])
    return out


def fall_through(body: list[Insn], a64: bool) -> list[Insn]:
    """The loop's instructions less the spans its forward branches skip."""
    skipped: set[int] = set()
    for x in body[:-1]:
        t = branch_target(x, a64)
        if t is not None and x.addr < t <= body[-1].addr:
            skipped |= {y.addr for y in body if x.addr < y.addr < t}
    return [x for x in body if x.addr not in skipped]


def folded_load(x: Insn, a64: bool) -> bool:
    """An x86 instruction other than a move that reads memory (an FMA's operand, say)."""
    return (
        not a64
        and classify(x, a64) != "mem"
        and "(" in x.ops.split(" <")[0]  # (a branch's symbol has parentheses too)
        and not x.mnem.startswith(("lea", "prefetch", "nop"))
    )


def hot_loop(insns: list[Insn], a64: bool) -> dict[str, int] | None:
    """The loop densest in FMAs (an outer loop holds an inner one's FMAs and more besides),
    counted on its fall-through path."""
    found = loops(insns, a64)
    if not found:
        return None
    body = max(found, key=lambda b: sum(is_fma(x, a64) for x in b) / len(b))
    hot = fall_through(body, a64)
    if SHOW:
        print("\n".join(f"  {x.addr:6x}: {x.mnem} {x.ops[:60]}" for x in hot) + "\n")
    counts = {"range": len(body), "total": len(hot), "fma": sum(is_fma(x, a64) for x in hot)}
    for c in ("arith", "mem", "shuf", "other"):
        counts[c] = sum(classify(x, a64) == c for x in hot)
    counts["folded"] = sum(folded_load(x, a64) for x in hot)
    return counts


def find(funcs: dict[str, list[Insn]], *parts: str) -> list[Insn]:
    for name, insns in funcs.items():
        if all(p in name for p in parts):
            return insns
    raise SystemExit(f"count_instructions: no function with {parts}")


@dataclass
class Row:
    stage: str
    isa: str
    c: dict[str, int]
    work: float  # units of work per iteration
    unit: str


def stage_loop(f: dict[str, list[Insn]], isa: str, name: str, a64: bool) -> dict[str, int]:
    """The hot loop of the probe wrapper `name` (or of the stage function it calls)."""
    insns = find(f, f"{isa}::{name}(")
    c = hot_loop(insns, a64)
    if c is None or c["fma"] == 0:  # the wrapper calls the stage's function: count that
        for i in insns:
            m = re.search(r"<(.*?)(\+0x[0-9a-f]+)?>$", i.ops)
            if m and m.group(1) in f and (c is None or c["fma"] == 0):
                c = hot_loop(f[m.group(1)], a64)
    if SHOW:
        print(f"{isa} {name}: {c}")
    if c is None or c["fma"] == 0:
        raise SystemExit(f"count_instructions: {isa} {name}: no FMA loop isolated")
    return c


def dot_rows(f: dict[str, list[Insn]], isa: str, W: int) -> list[Row]:
    """The dot-product units' rows: a bf16 dot instruction is W lanes x 2 products, an int8 one
    W lanes x 4."""
    a64 = isa.startswith("neon")
    c = stage_loop(f, isa, "cnt_bqk", a64)
    rows = [
        Row("QK prefill bf16 (6 rows, packed pairs)", isa, c, c["fma"] * W * 2, "score x feature")
    ]
    c = stage_loop(f, isa, "cnt_bpv", a64)
    rows.append(
        Row("PV prefill bf16 (6 rows, pairs)", isa, c, c["fma"] * W * 2, "row x key x feature")
    )
    c = stage_loop(f, isa, "cnt_iqk", a64)  # 4 rows x 4 keys, 4 W features per (row, key)
    rows.append(Row("decode QK int8 query", isa, c, c["fma"] / 4 * 4 * W / 128, "key (D=128)"))
    return rows


def count_path(isa: str, jobs: int) -> tuple[list[Row], str, dict[str, int] | None]:
    _, W, objdump = PATHS[isa]
    a64 = isa.startswith("neon")
    lib_obj, probe_obj, version = compile_probe(isa, jobs)
    f = disassemble(objdump, probe_obj)
    if isa in DOT_PATHS:
        return dot_rows(f, isa, W), version, None
    rows = []

    def loop(name: str) -> dict[str, int]:
        return stage_loop(f, isa, name, a64)

    c = loop("cnt_qk")  # 6 rows x 2 vectors of keys, one feature per 12 FMAs
    rows.append(
        Row("QK prefill (6 rows, packed K)", isa, c, c["fma"] / 12 * 12 * W, "score x feature")
    )
    c = loop("cnt_exp")  # R rows x one vector of scores (online_update's j loop, not unrolled)
    R = 4 if W >= 16 else 2
    if c["fma"] != 6 * R:  # the degree-6 polynomial's FMAs, once per row
        raise SystemExit(f"count_instructions: {isa} exp loop: {c['fma']} FMAs, not {6 * R}")
    rows.append(Row("exp (online update)", isa, c, R * W, "exp"))
    c = loop("cnt_pv")  # 6 rows x NB=2 vectors of features per key
    rows.append(Row("PV prefill (6 rows)", isa, c, c["fma"] * W, "row x key x feature"))
    kb = 4 if W >= 16 else 2
    nb = 4 if W >= 16 else 2
    for t in ("Native", "F16", "BF16"):
        cq = loop(f"cnt_dqk_{t}")  # 4 rows x kb keys x W features per 4*kb FMAs
        cp = loop(f"cnt_dpv_{t}")  # 4 rows x nb vectors of features per key
        rows.append(
            Row(f"decode QK {t}", isa, cq, cq["fma"] / (4 * kb) * kb * W / 128, "key (D=128)")
        )
        rows.append(
            Row(f"decode PV {t}", isa, cp, cp["fma"] / (4 * nb) * nb * W / 128, "key (D=128)")
        )
    lib = disassemble(objdump, lib_obj)
    check = None
    for name, insns in lib.items():
        if "pv_rows<6," in name and "Native>" in name:
            check = hot_loop(insns, a64)
    return rows, version, check


SUMMARY = [  # (stage, rows of the detail table, scale to the unit named)
    ("QK prefill, per score (6-row block, D=128)", ["QK prefill (6 rows, packed K)"], 128),
    ("exp, per exp (online update)", ["exp (online update)"], 1),
    ("PV prefill, per (row, key) (6-row block, Dv=128)", ["PV prefill (6 rows)"], 128),
    (
        "decode fp32, per key (QK + PV, 4 query rows, D=128)",
        ["decode QK Native", "decode PV Native"],
        1,
    ),
    ("decode fp16, per key (QK + PV, 4 query rows, D=128)", ["decode QK F16", "decode PV F16"], 1),
    (
        "decode bf16, per key (QK + PV, 4 query rows, D=128)",
        ["decode QK BF16", "decode PV BF16"],
        1,
    ),
    (
        "QK prefill bf16 products, per score (D=128)",
        ["QK prefill bf16 (6 rows, packed pairs)"],
        128,
    ),
    ("PV prefill bf16 products, per (row, key) (Dv=128)", ["PV prefill bf16 (6 rows, pairs)"], 128),
    ("decode QK, int8 query over int8 keys, per key (4 rows, D=128)", ["decode QK int8 query"], 1),
]


def summary(results: list[Row], isas: list[str]) -> None:
    """Instructions (FMAs) per unit of work, per path; NEON against AVX2."""
    print(
        "| per unit of work | "
        + " | ".join(isas)
        + (" | neon / avx2 |" if {"neon", "avx2"} <= set(isas) else " |")
    )
    print("|---" * (len(isas) + 1 + ({"neon", "avx2"} <= set(isas))) + "|")
    for name, stages, scale in SUMMARY:
        tot = {}
        for isa in isas:
            rs = [r for r in results if r.isa == isa and r.stage in stages]
            tot[isa] = (
                sum(r.c["total"] / r.work for r in rs) * scale,
                sum(r.c["fma"] / r.work for r in rs) * scale,
            )
        if not any(tot[i][0] for i in isas):
            continue
        cells = [f"{tot[i][0]:.3g} ({tot[i][1]:.3g})" if tot[i][0] else "-" for i in isas]
        if {"neon", "avx2"} <= set(isas) and tot["avx2"][0] and tot["neon"][0]:
            cells.append(f"{tot['neon'][0] / tot['avx2'][0]:.2f}x")
        elif {"neon", "avx2"} <= set(isas):
            cells.append("-")
        print(f"| {name} | " + " | ".join(cells) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=1, help="ninja -j for the unit objects")
    ap.add_argument("--isa", nargs="*", default=list(PATHS), choices=list(PATHS))
    ap.add_argument("--show", action="store_true", help="print each loop counted")
    args = ap.parse_args()
    global SHOW
    SHOW = args.show
    results = []
    for isa in args.isa:
        for tool in (
            "cmake",
            "ninja",
            PATHS[isa][2],
            "aarch64-linux-gnu-g++" if isa.startswith("neon") else "g++",
        ):
            if shutil.which(tool) is None:
                raise SystemExit(f"count_instructions: {tool} not found (see this file's top)")
        rows, version, check = count_path(isa, args.jobs)
        print(f"{isa}: {version}")
        if check:
            print(
                f"  check: pv_rows<6, Native> in the library's object: {check['total']} "
                f"instructions, {check['fma']} FMAs per iteration"
            )
        results += rows
    print()
    print(
        "| stage | path | instr/iter (range) | FMA | arith | ld/st | shuf/cvt | other | folded "
        "loads | work/iter | instr per | FMA per |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in sorted(results, key=lambda r: (r.stage, r.isa)):
        c = r.c
        print(
            f"| {r.stage} | {r.isa} | {c['total']} ({c['range']}) | {c['fma']} | {c['arith']} | "
            f"{c['mem']} | {c['shuf']} | {c['other']} | {c['folded']} | {r.work:g} {r.unit} | "
            f"{c['total'] / r.work:.3g} | {c['fma'] / r.work:.3g} |"
        )
    print()
    summary(results, args.isa)


if __name__ == "__main__":
    sys.exit(main())
