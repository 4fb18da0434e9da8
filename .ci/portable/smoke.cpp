// smoke.cpp: the C++ core on a CPU without attnx's x86 kernels (built and run by
// .ci/portable/cross_aarch64.sh under qemu). Dense attention in float32 and float64 over GQA,
// causal, Dk != Dv, padding and several threads, against a naive float64 softmax written here;
// the ISA choice (scalar, and a clear error for the x86 paths) and the probes.
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "attnx/attention.h"
#include "attnx/dispatch.h"
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

// out[b][h][i] = softmax_j(q.k_j * scale) v_j over the keys row i sees (bottom-right causal)
std::vector<double> reference(const Case& c, const std::vector<double>& q, const std::vector<double>& k,
                              const std::vector<double>& v, double scale) {
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
  double err = 0;
  for (size_t i = 0; i < out.size(); ++i) err = std::max(err, std::fabs(double(out[i]) - ref[i]));
  return err;
}

}  // namespace

int main() {
  const std::string isa = attnx::active_isa();
  check(isa == "scalar", "active ISA is scalar (" + isa + ")");
  for (const char* wide : {"avx2", "avx512", "avx512bf16"}) {
    bool threw = false;
    try {
      attnx::set_isa(wide);
    } catch (const attnx::InvalidArgument& e) {
      threw = true;
      std::printf("     %s\n", e.what());
    }
    check(threw, std::string("set_isa(\"") + wide + "\") is refused");
  }
  attnx::set_isa("auto");
  check(std::string(attnx::active_isa()) == "scalar", "set_isa(\"auto\") picks scalar");

  std::mt19937 rng(20261202);
  const Case cases[] = {
      {1, 4, 4, 70, 70, 64, 64, false, 0, 1},    // prefill, MHA
      {2, 8, 2, 33, 97, 40, 24, true, 0, 2},     // GQA, causal, Dk != Dv, odd sizes, 2 threads
      {2, 6, 3, 1, 200, 64, 64, false, 150, 2},  // decode with padding
      {1, 2, 1, 129, 129, 128, 128, true, 0, 3},
  };
  for (const Case& c : cases) {
    char name[160];
    std::snprintf(name, sizeof name, "B%lld Hq%lld Hkv%lld Sq%lld Sk%lld Dk%lld Dv%lld%s%s, %d threads",
                  (long long)c.B, (long long)c.Hq, (long long)c.Hkv, (long long)c.Sq, (long long)c.Sk,
                  (long long)c.Dk, (long long)c.Dv, c.causal ? " causal" : "", c.kv_len ? " kv_lens" : "",
                  c.threads);
    const double e32 = max_error<float>(c, rng), e64 = max_error<double>(c, rng);
    char msg[320];
    std::snprintf(msg, sizeof msg, "%s: float32 max error %.2e, float64 %.2e", name, e32, e64);
    check(e32 < 2e-5 && e64 < 1e-12, msg);
  }
  const double fma = attnx::probe_fma_gflops(1, 0.05);
  check(fma > 0 && std::isfinite(fma), "FMA probe runs (" + std::to_string(fma) + " GFLOP/s under emulation)");
  std::printf("%s\n", failures ? "portable smoke: FAILED" : "portable smoke: all passed");
  return failures ? 1 : 0;
}
