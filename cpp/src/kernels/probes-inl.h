// probes-inl.h: the machine probes' bodies (runtime/probes.cpp): the peak FMA rate and the read
// bandwidth, in this instruction set's vectors.
// Written once against the vector vocabulary `simd` (simd/vec_*.h) and compiled once per
// instruction set: the including unit (isa_<isa>.cpp, f64.cpp) opens `namespace attnx::<isa>`,
// defines `simd` and includes the stages in order (load, softmax, qk, pv, tile, probes), after
// <cmath>, <cstring>, <limits>, <type_traits>, tables.h and attention/state.h: no header may be
// included from inside the namespace. Everything here stays in an anonymous namespace (internal
// linkage), so no symbol compiled with wide instructions can leak to another ISA (tables.h).

namespace {

// ---- machine probes ---------------------------------------------------------------------------
// 10 independent accumulators hide the FMA latency (4 cycles x 2 ports needs >= 8 in flight).
[[maybe_unused]] static Real fma_probe(int64_t iters) {
  V a[10];
  for (int i = 0; i < 10; ++i) a[i] = set1(Real(i) * 1e-3f);
  const V x = set1(0.999999f), y = set1(1e-7f);
  for (int64_t it = 0; it < iters; ++it)
    for (int i = 0; i < 10; ++i) a[i] = fmadd(a[i], x, y);
  V s = zero();
  for (int i = 0; i < 10; ++i) s = add(s, a[i]);
  return reduce_add(s);
}

[[maybe_unused]] static Real read_probe(const Real* p, int64_t n) {
  V s0 = zero(), s1 = zero(), s2 = zero(), s3 = zero();
  int64_t i = 0;
  for (; i + 4 * W <= n; i += 4 * W) {
    s0 = add(s0, load(p + i));
    s1 = add(s1, load(p + i + W));
    s2 = add(s2, load(p + i + 2 * W));
    s3 = add(s3, load(p + i + 3 * W));
  }
  Real r = reduce_add(add(add(s0, s1), add(s2, s3)));
  for (; i < n; ++i) r += p[i];
  return r;
}

}  // namespace
