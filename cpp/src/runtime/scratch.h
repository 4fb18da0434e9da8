// scratch.h: each thread's working memory for run_flash, kept between calls, and the one layout
// that gives both its size and the pointers into it (so the two cannot fall out of step). All of
// it is in the compute type T (float; double for float64 inputs), one set per thread and type.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <vector>

#include "kernels/tables.h"

#ifdef _WIN32
#include <malloc.h>
#endif

namespace attnx {
namespace detail {

// `bytes` (a multiple of `align`, a power of two) aligned to `align`, released by aligned_free:
// std::aligned_alloc, except on Windows, whose C runtime has only _aligned_malloc (and its
// blocks must not reach free()). nullptr when there is no memory.
inline void* aligned_malloc(std::size_t align, std::size_t bytes) {
#ifdef _WIN32
  return _aligned_malloc(bytes, align);
#else
  return std::aligned_alloc(align, bytes);
#endif
}
inline void aligned_free(void* p) {
#ifdef _WIN32
  _aligned_free(p);
#else
  std::free(p);
#endif
}

// 64-byte aligned storage of T that only grows: one per thread, reused across calls.
template <class T>
class AlignedBuf {
 public:
  T* get(std::size_t n) {
    if (n > cap_) {
      aligned_free(ptr_);
      ptr_ = static_cast<T*>(aligned_malloc(64, (n * sizeof(T) + 63) / 64 * 64));
      if (ptr_ == nullptr) {
        cap_ = 0;
        throw std::bad_alloc();
      }
      cap_ = n;
    }
    return ptr_;
  }
  // Frees the storage if it holds more than max_elems.
  void trim(std::size_t max_elems) {
    if (cap_ <= max_elems) return;
    aligned_free(ptr_);
    ptr_ = nullptr;
    cap_ = 0;
  }
  ~AlignedBuf() { aligned_free(ptr_); }

 private:
  T* ptr_ = nullptr;
  std::size_t cap_ = 0;
};

template <class T>
struct ThreadScratch {
  AlignedBuf<T> buf;
  AlignedBuf<T> packed_k;  // the calling thread's: K tiles packed once per call (see plan_packed_k)
  std::vector<int> packed_ready;
  std::vector<const T*> ptrs;
  std::vector<const char*> addrs;
  std::vector<int64_t> ints;
  std::vector<const char*> mask_rows;
  std::vector<T> slopes;
  std::vector<T> qfactors;
  std::vector<int8_t> qcodes;
  std::vector<int32_t> qquads;
};

template <class T>
inline ThreadScratch<T>& thread_scratch() {
  static thread_local ThreadScratch<T> ts;
  return ts;
}

// One slot per item of a unit: the item's query rows and their state while it runs.
template <class T>
struct Slot {
  T* q;                    // (M_max, Dkp) queries, scaled and zero-padded
  T* o;                    // (M_max, Dvp) unnormalised output
  T* m;                    // M_max running maxima
  T* l;                    // M_max running sums
  int64_t* lo;             // 3 x M_max: each row's visible keys [lo, hi) and its position
  const char** mask_rows;  // M_max mask row addresses
  T* slopes;               // M_max ALiBi slopes
  T* qfactor;              // M_max factors of int8 queries' scores (kern::RowSetT::qfactor)
  int8_t* qcodes;          // their codes (kern::RowSetT::qcodes): code_rows(M_max) rows of ldc
  int32_t* qquads;         // the codes as quads by rows (kern::RowSetT::qquads)
  T* qvals;                // (M_max, Dkp) their values, codes times factor (kern::RowSetT::qvals)
  int64_t ldc;
};

// A thread's buffers for one call: the kernels' tile scratch, a row to finish output rows in and
// one to merge split-KV parts into (Dvp values each), and max_group slots (see slot()).
template <class T>
struct ThreadBuffers {
  kern::ScratchT<T> sc;
  T* tmp = nullptr;
  T* merged = nullptr;
  T *q = nullptr, *o = nullptr, *m = nullptr, *l = nullptr, *qvals = nullptr;
  int64_t* ints = nullptr;
  const char** mask_rows = nullptr;
  T* slopes = nullptr;
  T* qfactors = nullptr;
  int8_t* qcodes = nullptr;
  int32_t* qquads = nullptr;
  int64_t M_max = 0, Dkp = 0, Dvp = 0;
  int64_t ldc() const { return kern::code_ld(Dkp); }

  Slot<T> slot(int64_t g) const {
    return {q + g * M_max * Dkp,
            o + g * M_max * Dvp,
            m + g * M_max,
            l + g * M_max,
            ints + g * 3 * M_max,
            mask_rows + g * M_max,
            slopes + g * M_max,
            qfactors + g * M_max,
            qcodes + g * kern::code_rows(M_max) * ldc(),
            qquads + g * kern::quads_size(Dkp),
            qvals + g * M_max * Dkp,
            ldc()};
  }
};

// The per-thread scratch (in T) of a call with `group` slots of M rows, Dk and Dv padded to Dkp
// and Dvp: every buffer starts on a 64-byte line (kern::ScratchT promises the kernels that).
template <class T>
class ScratchLayout {
 public:
  ScratchLayout(int64_t group, int64_t M, int64_t Dkp, int64_t Dvp)
      : group_(group), M_(M), Dkp_(Dkp), Dvp_(Dvp) {
    const int64_t sizes[kParts] = {
        group * M * Dkp,     // kQ
        group * M * Dvp,     // kO
        group * M,           // kM
        group * M,           // kL
        Dkp * kern::kTileK,  // kKt
        kern::kTileK * Dkp,  // kKf
        kern::kTileK * Dvp,  // kVf
        M * kern::kTileK,    // kS
        M * kern::kTileK,    // kBias
        std::max(Dkp, Dvp),  // kZero
        Dvp,                 // kTmp
        Dvp,                 // kMerged
        M * Dkp / 2,         // kQb
        group * M * Dkp,     // kQv
    };
    int64_t at = 0;
    for (int i = 0; i < kParts; ++i) {
      offset_[i] = at;
      at += (sizes[i] + kLine - 1) / kLine * kLine;
    }
    elems_ = at;
  }

  std::size_t elems() const { return std::size_t(elems_); }

  // Sizes this thread's scratch for the layout and returns the pointers into it (throws
  // std::bad_alloc, before anything is written, if it cannot).
  ThreadBuffers<T> carve(ThreadScratch<T>& ts) const {
    T* base = ts.buf.get(elems());
    ts.ptrs.resize(2 * kern::kTileK);
    ts.addrs.resize(4 * kern::kTileK);
    ts.ints.resize(std::size_t(group_ * 3 * M_));
    ts.mask_rows.resize(std::size_t(group_ * M_));
    ts.slopes.resize(std::size_t(group_ * M_));
    ts.qfactors.resize(std::size_t(group_ * M_));
    ts.qcodes.resize(std::size_t(group_ * kern::code_rows(M_) * kern::code_ld(Dkp_)));
    ts.qquads.resize(std::size_t(group_ * kern::quads_size(Dkp_)));
    ThreadBuffers<T> tb;
    auto at = [&](Part part) { return base + offset_[part]; };
    tb.sc = kern::ScratchT<T>{at(kKt),
                              at(kKf),
                              at(kVf),
                              at(kS),
                              at(kBias),
                              at(kZero),
                              at(kQb),
                              ts.ptrs.data(),
                              ts.ptrs.data() + kern::kTileK,
                              ts.addrs.data(),
                              ts.addrs.data() + 2 * kern::kTileK};
    std::memset(at(kZero), 0, sizeof(T) * std::size_t(std::max(Dkp_, Dvp_)));
    tb.tmp = at(kTmp);
    tb.merged = at(kMerged);
    tb.q = at(kQ);
    tb.qvals = at(kQv);
    tb.o = at(kO);
    tb.m = at(kM);
    tb.l = at(kL);
    tb.ints = ts.ints.data();
    tb.mask_rows = ts.mask_rows.data();
    tb.slopes = ts.slopes.data();
    tb.qfactors = ts.qfactors.data();
    tb.qcodes = ts.qcodes.data();
    tb.qquads = ts.qquads.data();
    tb.M_max = M_;
    tb.Dkp = Dkp_;
    tb.Dvp = Dvp_;
    return tb;
  }

 private:
  enum Part { kQ, kO, kM, kL, kKt, kKf, kVf, kS, kBias, kZero, kTmp, kMerged, kQb, kQv, kParts };
  static constexpr int64_t kLine = 64 / sizeof(T);
  int64_t group_, M_, Dkp_, Dvp_;
  int64_t offset_[kParts] = {};
  int64_t elems_ = 0;
};

}  // namespace detail
}  // namespace attnx
