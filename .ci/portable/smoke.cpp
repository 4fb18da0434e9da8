// smoke.cpp: the C++ core on the platforms CI cross-compiles for, as a C++ client sees it (run by
// .ci/portable/cross_aarch64.sh under qemu, cross_zig.sh's Windows build under Wine). Dense
// attention in float32 and float64 over GQA, causal, Dk != Dv, padding and several threads, and a
// paged int8 decode (rows quantised by paged_write, pages in shuffled blocks), against a naive
// float64 softmax written here, on each path the build and CPU accept (aarch64: neon-bf16 where
// the CPU has it, neon and scalar); the ISA choice (the best accepted, a clear error for the
// others) and the probes.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "attnx/attention.h"
#include "attnx/dispatch.h"
#include "attnx/paged.h"
#include "attnx/probes.h"

namespace {

int failures = 0;
void check(bool ok, const std::string& what) {
  std::printf("%s %s\n", ok ? "ok  " : "FAIL", what.c_str());
  if (!ok) ++failures;
}

struct Case {
  int64_t B, Hq, Hkv, Sq, Sk, Dk, Dv;
  bool causal;
  int32_t kv_len;  // 0: all of Sk
  int threads;
};

template <class T>
double max_abs_diff(const std::vector<T>& got, const std::vector<double>& want) {
  double err = 0;
  for (size_t i = 0; i < got.size(); ++i) err = std::max(err, std::fabs(double(got[i]) - want[i]));
  return err;
}

// out[b][h][i] = softmax_j(q.k_j * scale) v_j over the keys row i sees (bottom-right causal)
std::vector<double> reference(const Case& c, const std::vector<double>& q,
                              const std::vector<double>& k, const std::vector<double>& v,
                              double scale) {
  std::vector<double> out(c.B * c.Hq * c.Sq * c.Dv, 0.0);
  const int64_t group = c.Hq / c.Hkv;
  for (int64_t b = 0; b < c.B; ++b)
    for (int64_t h = 0; h < c.Hq; ++h)
      for (int64_t i = 0; i < c.Sq; ++i) {
        const int64_t len = c.kv_len > 0 ? c.kv_len : c.Sk;
        int64_t hi = len;
        if (c.causal) hi = std::min<int64_t>(len, i + len - c.Sq + 1);
        if (hi <= 0) continue;  // a row that sees nothing is zero
        const double* qi = &q[((b * c.Hq + h) * c.Sq + i) * c.Dk];
        std::vector<double> s(hi);
        double m = -INFINITY;
        for (int64_t j = 0; j < hi; ++j) {
          const double* kj = &k[((b * c.Hkv + h / group) * c.Sk + j) * c.Dk];
          double d = 0;
          for (int64_t t = 0; t < c.Dk; ++t) d += qi[t] * kj[t];
          s[j] = d * scale;
          m = std::max(m, s[j]);
        }
        double l = 0;
        for (int64_t j = 0; j < hi; ++j) l += (s[j] = std::exp(s[j] - m));
        double* o = &out[((b * c.Hq + h) * c.Sq + i) * c.Dv];
        for (int64_t j = 0; j < hi; ++j) {
          const double* vj = &v[((b * c.Hkv + h / group) * c.Sk + j) * c.Dv];
          for (int64_t t = 0; t < c.Dv; ++t) o[t] += s[j] / l * vj[t];
        }
      }
  return out;
}

template <class T>
double max_error(const Case& c, std::mt19937& rng) {
  std::normal_distribution<double> nd;
  auto fill = [&](int64_t n, std::vector<T>& t, std::vector<double>& d) {
    t.resize(n);
    d.resize(n);
    for (int64_t i = 0; i < n; ++i) d[i] = double(t[i] = T(nd(rng)));
  };
  std::vector<T> q, k, v;
  std::vector<double> qd, kd, vd;
  fill(c.B * c.Hq * c.Sq * c.Dk, q, qd);
  fill(c.B * c.Hkv * c.Sk * c.Dk, k, kd);
  fill(c.B * c.Hkv * c.Sk * c.Dv, v, vd);
  std::vector<T> out(c.B * c.Hq * c.Sq * c.Dv, T(-1));
  std::vector<int32_t> lens(c.B, c.kv_len);
  attnx::BasicAttentionParams<T> p;
  p.B = c.B, p.Hq = c.Hq, p.Hkv = c.Hkv, p.Sq = c.Sq, p.Sk = c.Sk, p.Dk = c.Dk, p.Dv = c.Dv;
  p.q = {q.data(), c.Hq * c.Sq * c.Dk, c.Sq * c.Dk, c.Dk};
  p.k = {k.data(), c.Hkv * c.Sk * c.Dk, c.Sk * c.Dk, c.Dk};
  p.v = {v.data(), c.Hkv * c.Sk * c.Dv, c.Sk * c.Dv, c.Dv};
  p.out = out.data();
  p.o_sb = c.Hq * c.Sq * c.Dv, p.o_sh = c.Sq * c.Dv, p.o_ss = c.Dv;
  p.causal = c.causal;
  if (c.kv_len > 0) p.kv_lens = lens.data();
  p.scale = T(1.0 / std::sqrt(double(c.Dk)));
  p.num_threads = c.threads;
  attnx::attention(p);
  const std::vector<double> ref = reference(c, qd, kd, vd, double(p.scale));
  return max_abs_diff(out, ref);
}

// The integer query's twin (attnx::int8_query(); attnx.quant.quantize_query): each row of D
// values times `scale`, in float32, quantised as the keys are (s = max|x| / 127, codes rounded half
// to even), read back as code * s.
std::vector<double> quantised_query(const std::vector<float>& q, int64_t D, float scale) {
  std::vector<double> out(q.size());
  for (std::size_t r = 0; r < q.size(); r += std::size_t(D)) {
    float m = 0.f;
    for (int64_t d = 0; d < D; ++d) m = std::max(m, std::fabs(q[r + d] * scale));
    const float s = m / 127.f;
    for (int64_t d = 0; d < D; ++d) {
      const float code = s > 0.f ? std::nearbyint(q[r + d] * scale / s) : 0.f;
      out[r + d] = double(std::min(127.f, std::max(-127.f, code))) * double(s);
    }
  }
  return out;
}

// B sequences of L tokens in int8 pages of shuffled blocks, one decode query each (GQA 4):
// attention over the dequantised rows (code * scale, read back from the pages), and with integer
// queries (the default where the path has integer dot products) over the query read back too.
double paged_int8_error(std::mt19937& rng) {
  const int64_t B = 3, Hq = 8, Hkv = 2, D = 64, L = 77, bs = 16, per = (L + bs - 1) / bs,
                nb = B * per;
  std::normal_distribution<float> nd;
  std::vector<float> k(B * L * Hkv * D), v(k.size()), q(B * Hq * D);
  for (float& x : k) x = nd(rng);
  for (float& x : v) x = nd(rng);
  for (float& x : q) x = nd(rng);
  std::vector<int32_t> table(nb);
  for (int64_t i = 0; i < nb; ++i) table[i] = int32_t((i * 7 + 3) % nb);  // 7 is prime to nb = 15
  std::vector<int64_t> slots(B * L);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < L; ++t) slots[b * L + t] = table[b * per + t / bs] * bs + t % bs;
  std::vector<int8_t> kp(nb * Hkv * bs * D), vp(kp.size());
  std::vector<float> ks(nb * Hkv * bs), vs(ks.size());
  auto write = [&](const std::vector<float>& src, std::vector<int8_t>& pages,
                   std::vector<float>& sc) {
    attnx::PagedWrite w;
    w.n = B * L, w.H = Hkv, w.D = D, w.src = src.data(), w.s_sn = Hkv * D, w.s_sh = D;
    w.pages = pages.data(), w.page_dtype = attnx::DType::i8;
    w.block_size = bs, w.p_sblk = Hkv * bs * D, w.p_sh = bs * D, w.p_ss = D;
    w.slots = slots.data(), w.scales = sc.data(), w.sc_sblk = Hkv * bs, w.sc_sh = bs, w.sc_ss = 1;
    attnx::paged_write(w);
  };
  write(k, kp, ks);
  write(v, vp, vs);
  std::vector<int32_t> lens(B, int32_t(L));
  std::vector<int64_t> q_start(B + 1);
  for (int64_t b = 0; b <= B; ++b) q_start[b] = b;
  std::vector<float> out(B * Hq * D, -1.f);
  attnx::PagedParams p;
  p.B = B, p.N = B, p.Hq = Hq, p.Hkv = Hkv, p.Dk = D, p.Dv = D, p.kv_dtype = attnx::DType::i8;
  p.q = q.data(), p.q_sn = Hq * D, p.q_sh = D;
  p.k_pages = kp.data(), p.v_pages = vp.data(), p.num_blocks = nb, p.block_size = bs;
  p.k_sblk = p.v_sblk = Hkv * bs * D, p.k_sh = p.v_sh = bs * D, p.k_ss = p.v_ss = D;
  p.k_scales = ks.data(), p.v_scales = vs.data();
  p.ks_sblk = p.vs_sblk = Hkv * bs, p.ks_sh = p.vs_sh = bs, p.ks_ss = p.vs_ss = 1;
  p.block_tables = table.data(), p.bt_stride = per, p.max_blocks = per;
  p.seq_lens = lens.data(), p.q_start = q_start.data();
  p.scale = float(1.0 / std::sqrt(double(D)));
  p.out = out.data(), p.o_sn = Hq * D, p.o_sh = D;
  p.num_threads = 2;
  attnx::paged_attention(p);
  // the same problem, dense, over the dequantised rows
  const Case c{B, Hq, Hkv, 1, L, D, D, false, 0, 1};
  std::vector<double> qd(q.begin(), q.end()), kd(B * Hkv * L * D), vd(kd.size());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < L; ++t)
      for (int64_t h = 0; h < Hkv; ++h) {
        const int64_t blk = table[b * per + t / bs], off = t % bs;
        const int64_t row = (blk * Hkv + h) * bs + off;
        for (int64_t d = 0; d < D; ++d) {
          kd[((b * Hkv + h) * L + t) * D + d] = double(float(kp[row * D + d]) * ks[row]);
          vd[((b * Hkv + h) * L + t) * D + d] = double(float(vp[row * D + d]) * vs[row]);
        }
      }
  const bool q8 = attnx::int8_query();
  if (q8) qd = quantised_query(q, D, p.scale);
  const std::vector<double> ref = reference(c, qd, kd, vd, q8 ? 1.0 : double(p.scale));
  return max_abs_diff(out, ref);
}

}  // namespace

// The paths this build and CPU accept (set_isa refuses the others), the best first: the order
// in which dispatch.cpp prefers them (avx512bf16 only where its bf16 dot products measure faster
// than FMAs, else avx512vnni: main's check).
std::vector<std::string> own_isas() {
  std::vector<std::string> found;
  for (const char* name : {"amx", "avx512bf16", "avx512vnni", "avx512", "avx2vnni", "avx2",
                           "neon-bf16", "neon", "scalar"}) {
    try {
      attnx::set_isa(name);
      found.push_back(name);
    } catch (const attnx::InvalidArgument& e) {
      std::printf("     %s\n", e.what());
    }
  }
  return found;
}

int main() {
  const std::string isa = attnx::active_isa();
  const std::vector<std::string> isas = own_isas();
  const std::string best = isas[0] == "avx512bf16" && attnx::bf16_dot_gain() <= attnx::kBf16DotGain
                               ? "avx512vnni"
                               : isas[0];
  check(isa == best, "the default ISA is the best one accepted, " + best + " (" + isa + ")");
#if defined(__aarch64__)
  // (neon-bf16 where the CPU has BF16 and DotProd: qemu's default -cpu max has them)
  check(isas.size() >= 2 && isas[isas.size() - 2] == "neon" &&
            (isas.size() == 2 || (isas.size() == 3 && isas[0] == "neon-bf16")),
        "aarch64: neon (and neon-bf16 where the CPU has it) and scalar, no x86 path");
#endif
  attnx::set_isa("auto");
  check(std::string(attnx::active_isa()) == isas[0], "set_isa(\"auto\") picks " + isas[0]);

  std::mt19937 rng(20261202);
  const Case cases[] = {
      {1, 4, 4, 70, 70, 64, 64, false, 0, 1},    // prefill, MHA
      {2, 8, 2, 33, 97, 40, 24, true, 0, 2},     // GQA, causal, Dk != Dv, odd sizes, 2 threads
      {2, 6, 3, 1, 200, 64, 64, false, 150, 2},  // decode with padding
      {1, 2, 1, 129, 129, 128, 128, true, 0, 3},
  };
  for (const std::string& name_isa : isas) {
    attnx::set_isa(name_isa);
    for (const Case& c : cases) {
      char name[160];
      std::snprintf(name, sizeof name,
                    "%s: B%lld Hq%lld Hkv%lld Sq%lld Sk%lld Dk%lld Dv%lld%s%s, %d threads",
                    name_isa.c_str(), (long long)c.B, (long long)c.Hq, (long long)c.Hkv,
                    (long long)c.Sq, (long long)c.Sk, (long long)c.Dk, (long long)c.Dv,
                    c.causal ? " causal" : "", c.kv_len ? " kv_lens" : "", c.threads);
      const double e32 = max_error<float>(c, rng), e64 = max_error<double>(c, rng);
      char msg[320];
      std::snprintf(msg, sizeof msg, "%s: float32 max error %.2e, float64 %.2e", name, e32, e64);
      check(e32 < 2e-5 && e64 < 1e-12, msg);
    }
    const double pe = paged_int8_error(rng);
    char pmsg[200];
    std::snprintf(pmsg, sizeof pmsg,
                  "%s: paged decode over int8 pages, B3 Hq8 Hkv2 L77 D64 block 16: max error %.2e",
                  name_isa.c_str(), pe);
    check(pe < 2e-5, pmsg);
    const double fma = attnx::probe_fma_gflops(1, 0.05);
    check(fma > 0 && std::isfinite(fma),
          name_isa + ": FMA probe runs (" + std::to_string(fma) + " GFLOP/s under emulation)");
  }
  std::printf("%s\n", failures ? "portable smoke: FAILED" : "portable smoke: all passed");
  return failures ? 1 : 0;
}
