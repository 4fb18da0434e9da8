// paged.h: the checks of a paged call that paged_attention and the step plan share: the pages,
// their scales, the block tables, the slots, and run_paged, which checks the rest and runs a step.
#pragma once
#include <cstdint>
#include <vector>

#include "args.h"
#include "attnx/paged.h"

namespace attnx::bind {

// block_tables as int32 with seq_lens and q_lens, checked against a pool (check_tables).
struct PagedArrays {
  py::array_t<int32_t> bt, sl, ql;  // ql: empty when q_lens is None
  std::vector<int64_t> q_start;
  bool has_ql = false;
  int64_t B = 0, max_blocks = 0;
  int64_t tokens() const { return q_start.back(); }  // sum(q_lens), or B
};

// k_pages (num_blocks, Hkv, block_size, Dk) and v_pages (num_blocks, Hkv, block_size, Dv) into p.
void check_pages(const py::array& kp, const py::array& vp, PagedParams& p);
// The float32 scales of quantised pages (and only of them), writable where a step writes.
void check_scales(py::handle k_scales, py::handle v_scales, bool write, PagedParams& p,
                  py::array& ks, py::array& vs);
// block_tables (B, max_blocks), seq_lens (B,) and q_lens (B,) or None, against p's pool.
void check_tables(py::handle bt_obj, py::handle seq_lens, py::handle q_lens, PagedParams& p,
                  PagedArrays& keep);
// Points p at tables checked by check_tables (against pages of p's num_blocks and block_size).
void use_tables(const PagedArrays& keep, PagedParams& p);
// slots (T,): where each of the T new tokens goes, block * block_size + offset, in the pool.
Native<int64_t> check_slots(py::handle slots, int64_t tokens, int64_t num_blocks,
                            int64_t block_size);

// A paged call's per-call inputs (everything but the pages and the tables): what
// paged_attention takes from its arguments and StepPlan::attend from its own.
struct PagedInputs {
  py::handle q, k_new, v_new, out = Py_None, scale = Py_None, window = Py_None, softcap = Py_None,
                              sinks = Py_None, alibi = Py_None, prior_out = Py_None,
                              prior_lse = Py_None;
  bool causal = true, return_lse = false;
  py::handle threads = Py_None;
  int64_t max_left = -1;  // >= 0: the pages keep only the last max_left + 1 keys (a sliding window)
  const Native<int64_t>* slots = nullptr;  // checked; required with k_new
  const CascadePlan* cascade = nullptr;    // the step's shared-prefix groups (cascade.h), or none
};

// The pages and their scales, as the caller checked them.
struct Pool {
  py::array k, v, k_scales, v_scales;
};

// Checks q and everything after the pages and tables (p holds both), writes the new rows, runs
// the kernel. Nothing is written before every argument has been checked.
py::object run_paged(PagedParams& p, Pool& pool, const PagedArrays& keep, const PagedInputs& in);

}  // namespace attnx::bind
