// paged_problem.h: pages of a block pool as a problem for run_flash (problem.h), read in place
// through each sequence's block table: what paged attention and the cascade's parts run.
#pragma once
#include <cstdint>

#include "attnx/paged.h"
#include "kernels/tables.h"
#include "attention/problem.h"

namespace attnx {
namespace detail {

// Pages of a block pool, read in place through each sequence's block table, as a problem for
// run_flash (no user mask).
struct PagedProblem : FlashProblem {
  const PagedParams& a;
  std::size_t qes, kes;  // bytes per element of q and out, and of the pages

  explicit PagedProblem(const PagedParams& p)
      : FlashProblem(p.B, p.Hq, p.Hkv, p.Dk, p.Dv, p.scale, p.causal, p.var, p.q_dtype),
        a(p),
        qes(dtype_size(p.q_dtype)),
        kes(dtype_size(p.kv_dtype)) {}

  int64_t rows(int64_t b) const { return a.q_start[b + 1] - a.q_start[b]; }
  int64_t lq(int64_t b) const { return rows(b); }
  int64_t lk(int64_t b) const { return a.seq_lens[b]; }
  const char* q_row(int64_t b, int64_t h, int64_t i) const {
    return static_cast<const char*>(a.q) +
           ((a.q_start[b] + i) * a.q_sn + h * a.q_sh) * int64_t(qes);
  }
  void* out_row(int64_t b, int64_t h, int64_t i) const {
    return static_cast<char*>(a.out) + ((a.q_start[b] + i) * a.o_sn + h * a.o_sh) * int64_t(qes);
  }
  float* lse_at(int64_t b, int64_t h, int64_t i) const {
    return a.lse ? a.lse + (a.q_start[b] + i) * a.l_sn + h * a.l_sh : nullptr;
  }
  Prior prior(int64_t b, int64_t h, int64_t i) const {
    if (a.prior_out == nullptr) return {nullptr, 0.f};
    const int64_t t = a.q_start[b] + i;
    return {a.prior_out + t * a.po_sn + h * a.po_sh, a.prior_lse[t * a.pl_sn + h * a.pl_sh]};
  }
  kern::KVSource src(const void* pages, int64_t sblk, int64_t sh, int64_t ss, int64_t b,
                     int64_t kvh, const float* scales, int64_t c_sblk, int64_t c_sh,
                     int64_t c_ss) const {
    kern::KVSource s;
    s.base = static_cast<const char*>(pages) + kvh * sh * int64_t(kes);
    s.dtype = a.kv_dtype;
    s.row_stride = ss * int64_t(kes);
    s.block_table = a.block_tables + b * a.bt_stride;
    s.block_size = a.block_size;
    s.block_stride = sblk * int64_t(kes);
    if (scales != nullptr) {
      s.scale = scales + kvh * c_sh;
      s.scale_row_stride = c_ss;
      s.scale_block_stride = c_sblk;
    }
    return s;
  }
  kern::KVSource k_src(int64_t b, int64_t kvh) const {
    return src(a.k_pages, a.k_sblk, a.k_sh, a.k_ss, b, kvh, a.k_scales, a.ks_sblk, a.ks_sh,
               a.ks_ss);
  }
  kern::KVSource v_src(int64_t b, int64_t kvh) const {
    return src(a.v_pages, a.v_sblk, a.v_sh, a.v_ss, b, kvh, a.v_scales, a.vs_sblk, a.vs_sh,
               a.vs_ss);
  }
};

}  // namespace detail
}  // namespace attnx
