// paged.cpp: attention that reads K and V straight from the pages of a block pool (no gather),
// and the writes and copies that maintain the pages.
#include "attnx/paged.h"

#include <cmath>
#include <cstring>
#include <limits>

#include "attnx/dispatch.h"
#include "attention/cascade.h"
#include "attention/driver.h"
#include "attention/paged_problem.h"
#include "kernels/simd/convert.h"

namespace attnx {

namespace {

// The binding checks the tables; this re-check keeps the C++ API safe on its own: never read
// outside the pool.
void check_tables(const PagedParams& p) {
  if (p.Hkv <= 0 || p.Hq % p.Hkv != 0) throw InvalidArgument("Hq must be a multiple of Hkv");
  for (int64_t b = 0; b < p.B; ++b) {
    const int64_t len = p.seq_lens[b];
    const int64_t nq = p.q_start[b + 1] - p.q_start[b];
    if (len < 0 || nq < 0 || nq > len || (len + p.block_size - 1) / p.block_size > p.max_blocks)
      throw InvalidArgument("seq_lens / q_lens out of range of the block table");
    for (int64_t j = 0; j < (len + p.block_size - 1) / p.block_size; ++j) {
      const int32_t blk = p.block_tables[b * p.bt_stride + j];
      if (blk < 0 || blk >= p.num_blocks) throw InvalidArgument("block table entry out of range");
    }
  }
}

void attend_checked(const PagedParams& p) {
  if (p.N == 0 || p.Hq == 0) return;
  detail::PagedProblem prob(p);
  detail::run_flash(prob, resolve_threads(p.num_threads));
}

}  // namespace

void paged_attention(const PagedParams& p) {
  check_tables(p);
  attend_checked(p);
}

void paged_step(const PagedStep& step) {
  check_tables(step.attend);
  paged_write(step.k);
  paged_write(step.v);
  if (step.cascade != nullptr && cascade_applies(*step.cascade, step.attend))
    cascade_attend(*step.cascade, step.attend);
  else
    attend_checked(step.attend);
}

namespace {

// The largest code magnitude of a quantised dtype (attnx.quant.quantised_max).
float quantised_max(DType dtype) {
  return dtype == DType::i8 ? 127.f : dtype == DType::e4m3 ? 448.f : 57344.f;
}

float clip(float r, float qmax) { return r < -qmax ? -qmax : r > qmax ? qmax : r; }

uint8_t to_fp8(float r, DType dtype) {
  return dtype == DType::e4m3 ? cvt::f32_to_e4m3(r) : cvt::f32_to_e5m2(r);
}

}  // namespace

float quantise_row(const float* x, int64_t n, DType dtype, void* dst) {
  const float qmax = quantised_max(dtype);
  float m = 0.f;
  bool finite = true;
  for (int64_t i = 0; i < n; ++i) {
    finite = finite && std::isfinite(x[i]);
    m = std::fabs(x[i]) > m ? std::fabs(x[i]) : m;
  }
  const float s = finite ? m / qmax : std::numeric_limits<float>::quiet_NaN();
  const bool use = finite && s > 0.f;
  // (r: a true division, as the definition says, then clipped)
  if (dtype == DType::i8) {
    // Round half to even as std::nearbyint does, without its call (this file is built for the
    // baseline, where nearbyint is a call into libm per element): |r| <= 127, and adding then
    // taking away 1.5 * 2^23 rounds to an integer in the default rounding mode. (A row of zeros
    // or non-finite values has the codes of r = 0: no branch in the loop, which vectorises.)
    int8_t* out = static_cast<int8_t*>(dst);
    if (!use) {
      std::memset(out, 0, std::size_t(n));
    } else {
      for (int64_t i = 0; i < n; ++i) {
        const float r = clip(x[i] / s, qmax);
        out[i] = int8_t(int32_t((r + 0x1.8p23f) - 0x1.8p23f));
      }
    }
  } else {
    for (int64_t i = 0; i < n; ++i)
      static_cast<uint8_t*>(dst)[i] = to_fp8(clip(use ? x[i] / s : 0.f, qmax), dtype);
  }
  return use || !finite ? s : 0.f;
}

void quantise_row_fixed(const float* x, int64_t n, DType dtype, float s, uint8_t* dst) {
  const float qmax = quantised_max(dtype);
  const uint8_t nan = dtype == DType::e4m3 ? 0x7f : 0x7e;
  for (int64_t i = 0; i < n; ++i)
    dst[i] = std::isfinite(x[i]) ? to_fp8(clip(x[i] / s, qmax), dtype) : nan;
}

void paged_write(const PagedWrite& w) {
  if (w.n == 0) return;
  const kern::FlashKernels<float>* table = active_tables()->flash;
  const std::size_t ses = dtype_size(w.src_dtype), pes = dtype_size(w.page_dtype);
  std::vector<float> row(std::size_t(w.D));
  for (int64_t t = 0; t < w.n; ++t) {
    const int64_t blk = w.slots[t] / w.block_size, off = w.slots[t] % w.block_size;
    for (int64_t h = 0; h < w.H; ++h) {
      const char* src = static_cast<const char*>(w.src) + (t * w.s_sn + h * w.s_sh) * int64_t(ses);
      char* dst =
          static_cast<char*>(w.pages) + (blk * w.p_sblk + h * w.p_sh + off * w.p_ss) * int64_t(pes);
      if (w.fixed_scale > 0.f || w.scales != nullptr) {  // quantised pages
        table->load_row(src, w.src_dtype, w.D, row.data());
        if (w.fixed_scale > 0.f)
          quantise_row_fixed(row.data(), w.D, w.page_dtype, w.fixed_scale,
                             reinterpret_cast<uint8_t*>(dst));
        else
          w.scales[blk * w.sc_sblk + h * w.sc_sh + off * w.sc_ss] =
              quantise_row(row.data(), w.D, w.page_dtype, dst);
      } else if (w.src_dtype == w.page_dtype) {
        std::memcpy(dst, src, std::size_t(w.D) * pes);
      } else {
        table->load_row(src, w.src_dtype, w.D, row.data());
        table->store_row(row.data(), w.D, w.page_dtype, dst);
      }
    }
  }
}

}  // namespace attnx
