// paged.cpp: attnx._core.paged_attention, attention over a paged KV cache (docs/cache.md), and
// the checks of paged.h that the step plan shares.
#include "paged.h"

#include <limits>
#include <string>
#include <vector>

#include "out.h"
#include "src/attention/cascade.h"

namespace attnx::bind {

void check_pages(const py::array& kp, const py::array& vp, PagedParams& p) {
  check_rank(kp, "k_pages", 4, "(num_blocks, Hkv, block_size, Dk)");
  check_rank(vp, "v_pages", 4, "(num_blocks, Hkv, block_size, Dv)");
  p.kv_dtype = page_dtype_of(kp, "k_pages");
  if (page_dtype_of(vp, "v_pages") != p.kv_dtype)
    type_error("v_pages: expected the dtype of k_pages");
  p.num_blocks = kp.shape(0);
  p.Hkv = kp.shape(1);
  p.block_size = kp.shape(2);
  p.Dk = kp.shape(3);
  p.Dv = vp.shape(3);
  check_shape(
      vp, "v_pages",
      {{"num_blocks", p.num_blocks}, {"Hkv", p.Hkv}, {"block_size", p.block_size}, {"Dv", p.Dv}});
  if (p.block_size <= 0) value_error("k_pages: block_size must be positive");
  if (p.Hkv <= 0) value_error("k_pages: expected at least one kv head, got shape " + shape_str(kp));
  auto ks = elem_strides(kp, "k_pages"), vs = elem_strides(vp, "v_pages");
  p.k_pages = kp.data();
  p.k_sblk = ks[0];
  p.k_sh = ks[1];
  p.k_ss = ks[2];
  p.v_pages = vp.data();
  p.v_sblk = vs[0];
  p.v_sh = vs[1];
  p.v_ss = vs[2];
}

namespace {

// One scale for every row of fp8 pages (attnx.quant.fixed_scale), as a 0-d float32 array.
py::array fixed_scale(py::handle obj, const std::string& n, const PagedParams& p) {
  if (p.kv_dtype == DType::i8)
    type_error(n +
               ": one scale for every row is for float8 pages (int8 codes have no NaN for an input "
               "that is not finite); pass float32 scale pages (num_blocks, Hkv, block_size)");
  py::array_t<float> a(std::vector<py::ssize_t>{});
  a.mutable_at() = positive_float<float>(real_arg(obj, n.c_str()), n.c_str());
  return std::move(a);
}

// The scale pages of quantised pages (and only of them): float32 in native byte order,
// (num_blocks, Hkv, block_size), writable when a step writes into them; or, for fp8 pages, a
// real number: one scale for every row, which a step writes with and does not store.
py::array scale_pages(py::handle obj, const char* name, const PagedParams& p, bool quantised,
                      bool write) {
  const std::string n(name);
  if (obj.is_none() != !quantised)
    type_error(
        n +
        (quantised
             ? ": pages of dtype " + std::string(dtype_name(p.kv_dtype)) +
                   " need their float32 scales"
             : ": only quantised pages (int8, float8_e4m3fn, float8_e5m2) have scales; pass None"));
  if (!quantised) return py::array();
  py::array a0 = py::array::ensure(obj);  // a number, a numpy scalar or a 0-d array: 0-d
  if (a0 && a0.ndim() == 0) {
    const char kind = a0.dtype().kind();
    if (kind != 'f' && kind != 'i' && kind != 'u')
      type_error(n + ": expected one real scale, got " + dtype_str(a0));
    return fixed_scale(a0, n, p);
  }
  PyErr_Clear();
  if (!py::isinstance<py::array>(obj))
    type_error(n + ": expected a numpy float32 array (or, for float8 pages, one real scale), got " +
               type_name(obj));
  py::array a = py::reinterpret_borrow<py::array>(obj);
  if (!is_float32(a.dtype()))
    type_error(n + ": expected float32 in native byte order, got " + dtype_str(a));
  check_shape(a, name,
              {{"num_blocks", p.num_blocks}, {"Hkv", p.Hkv}, {"block_size", p.block_size}});
  if (write && !a.writeable())
    value_error(n + ": array is not writable (a step stores the new rows' scales)");
  return a;
}

}  // namespace

void check_scales(py::handle k_scales, py::handle v_scales, bool write, PagedParams& p,
                  py::array& ks, py::array& vs) {
  const bool q = is_quantised(p.kv_dtype);
  ks = scale_pages(k_scales, "k_scales", p, q, write);
  vs = scale_pages(v_scales, "v_scales", p, q, write);
  if (!q) return;
  // any strides; one scale for every row reads through strides of 0
  auto strides = [](const py::array& a, const char* name) {
    return a.ndim() == 0 ? std::vector<int64_t>(3, 0) : elem_strides(a, name, false);
  };
  auto kst = strides(ks, "k_scales"), vst = strides(vs, "v_scales");
  p.k_scales = static_cast<const float*>(ks.data());
  p.ks_sblk = kst[0];
  p.ks_sh = kst[1];
  p.ks_ss = kst[2];
  p.v_scales = static_cast<const float*>(vs.data());
  p.vs_sblk = vst[0];
  p.vs_sh = vst[1];
  p.vs_ss = vst[2];
}

void use_tables(const PagedArrays& keep, PagedParams& p) {
  p.B = keep.B;
  p.max_blocks = keep.max_blocks;
  p.block_tables = keep.bt.data();
  p.bt_stride = keep.max_blocks;
  p.seq_lens = keep.sl.data();
  p.q_start = keep.q_start.data();
}

namespace {

// The block table as given: an int32 table is read as it is (the usual case: no copy). Any other
// integer type is range-checked in int64 first (a cast to int32 would wrap 2**32 + b to a
// valid-looking b) and copied to int32 by check_row.
struct BlockTable {
  Native<int64_t> wide;  // the table in int64 when it is not int32
  bool int32 = false;
};

BlockTable block_table(py::handle bt_obj, PagedParams& p, PagedArrays& keep) {
  py::array block_tables = py::array::ensure(bt_obj);
  const char kind = block_tables ? block_tables.dtype().kind() : 'O';
  if (kind != 'i' && kind != 'u') type_error("block_tables: expected an integer array");
  check_rank(block_tables, "block_tables", 2, "(B, max_blocks)");
  p.B = block_tables.shape(0);
  p.max_blocks = block_tables.shape(1);
  BlockTable t;
  t.int32 = kind == 'i' && block_tables.itemsize() == 4;
  if (t.int32) {
    keep.bt = Native<int32_t>(block_tables);
  } else {
    t.wide = Native<int64_t>(block_tables);
    keep.bt = py::array_t<int32_t>(std::vector<py::ssize_t>{p.B, p.max_blocks});
  }
  return t;
}

// Row b of the table: every entry sequence b reads (its first nb) is < num_blocks.
void check_row(const BlockTable& t, int64_t b, int64_t nb, const PagedParams& p,
               PagedArrays& keep) {
  for (int64_t j = 0; j < (t.int32 ? nb : p.max_blocks); ++j) {
    const int64_t blk = t.int32 ? int64_t(keep.bt.data()[b * p.max_blocks + j])
                                : t.wide.data()[b * p.max_blocks + j];
    if (j < nb && (blk < 0 || blk >= p.num_blocks))
      value_error("block_tables[" + std::to_string(b) + ", " + std::to_string(j) +
                  "] = " + std::to_string(blk) + " is out of range [0, " +
                  std::to_string(p.num_blocks) + ")");
    if (!t.int32)
      keep.bt.mutable_data()[b * p.max_blocks + j] =
          j < nb ? int32_t(blk) : 0;  // unused entries are never read
  }
}

}  // namespace

// Every entry a sequence reads is checked < num_blocks, and q_start gets the prefix sums of
// q_lens (the query tokens' count, which q must match: run_paged checks it).
void check_tables(py::handle bt_obj, py::handle seq_lens, py::handle q_lens, PagedParams& p,
                  PagedArrays& keep) {
  const BlockTable t = block_table(bt_obj, p, keep);
  constexpr int64_t kMax32 = std::numeric_limits<int32_t>::max();
  keep.sl = int_vector(seq_lens, "seq_lens", p.B, kMax32, "int32");
  const bool has_ql = keep.has_ql = !q_lens.is_none();
  keep.B = p.B;
  keep.max_blocks = p.max_blocks;
  if (has_ql) keep.ql = int_vector(q_lens, "q_lens", p.B, kMax32, "int32");
  keep.q_start.assign(std::size_t(p.B + 1), 0);
  for (int64_t b = 0; b < p.B; ++b) {
    const int64_t nq = has_ql ? keep.ql.data()[b] : 1;
    const int64_t len = keep.sl.data()[b];
    if (nq > len)
      value_error("q_lens[" + std::to_string(b) + "] = " + std::to_string(nq) +
                  " exceeds seq_lens[" + std::to_string(b) + "] = " + std::to_string(len));
    const int64_t nb = (len + p.block_size - 1) / p.block_size;
    if (nb > p.max_blocks)
      value_error("seq_lens[" + std::to_string(b) + "] = " + std::to_string(len) + " needs " +
                  std::to_string(nb) + " blocks but block_tables has " +
                  std::to_string(p.max_blocks) + " columns");
    check_row(t, b, nb, p, keep);
    keep.q_start[std::size_t(b + 1)] = keep.q_start[std::size_t(b)] + nq;
  }
  use_tables(keep, p);
}

Native<int64_t> check_slots(py::handle slots, int64_t tokens, int64_t num_blocks,
                            int64_t block_size) {
  if (slots.is_none()) value_error("slots: expected the new tokens' slots (T,)");
  Native<int64_t> s(py::reinterpret_borrow<py::object>(slots));
  if (s.ndim() != 1 || s.shape(0) != tokens) value_error("slots: expected shape (T,)");
  for (int64_t t = 0; t < tokens; ++t)
    if (s.data()[t] < 0 || s.data()[t] >= num_blocks * block_size)
      value_error("slots: slot out of range");
  return s;
}

namespace {

// The new keys and values of a cache step: checked with everything else before the first write.
struct NewKV {
  py::array k, v;
  PagedWrite wk, wv;
};

// A step's new rows, read while the pages are written: a copy if they share memory with the pages.
py::array new_rows(py::handle obj, const char* name, const Pool& pool) {
  py::array x = native_input(obj, name);
  if (may_share_memory(x, pool.k) || may_share_memory(x, pool.v))
    x = py::array::ensure(x.attr("copy")());
  return x;
}

// One half of a step's write (the keys or the values): its names, its pages and their strides.
struct PageSide {
  const char *rows, *pages, *dim, *axes;  // "k", "k_pages", "Dk", "(T, Hkv, Dk)"
  int64_t D;
  py::array& page_array;
  int64_t sblk, sh, ss;
  py::array& scales;  // read only for quantised pages
  int64_t sc_sblk, sc_sh, sc_ss;
};

// rows (T, Hkv, D), checked, as the write of their side into the pages at the slots.
PagedWrite page_write(py::array& rows, py::handle obj, const PageSide& s,
                      const Native<int64_t>& slots, const PagedParams& p, const Pool& pool) {
  rows = new_rows(obj, s.rows, pool);
  if (!s.page_array.writeable()) value_error(std::string(s.pages) + ": array is not writable");
  check_rank(rows, s.rows, 3, s.axes);
  check_shape(rows, s.rows, {{"T", p.N}, {"Hkv", p.Hkv}, {s.dim, s.D}});
  const DType dt = dtype_of(rows, s.rows);
  auto rs = elem_strides(rows, s.rows);
  PagedWrite w{p.N,        p.Hkv,        s.D,    rows.data(),
               dt,         rs[0],        rs[1],  s.page_array.mutable_data(),
               p.kv_dtype, p.block_size, s.sblk, s.sh,
               s.ss,       slots.data()};
  if (is_quantised(p.kv_dtype) && s.scales.ndim() == 0) {  // one scale for every row
    w.fixed_scale = *static_cast<const float*>(s.scales.data());
  } else if (is_quantised(p.kv_dtype)) {  // check_scales has checked both scale arrays
    w.scales = static_cast<float*>(s.scales.mutable_data());
    w.sc_sblk = s.sc_sblk;
    w.sc_sh = s.sc_sh;
    w.sc_ss = s.sc_ss;
  }
  return w;
}

// v_new may be None when the values are a view of the keys (latent attention: one write).
void prepare_new_kv(NewKV& n, py::handle k_new, py::handle v_new, const Native<int64_t>& slots,
                    const PagedParams& p, Pool& pool) {
  const PageSide k{"k",    "k_pages", "Dk",          "(T, Hkv, Dk)", p.Dk,    pool.k, p.k_sblk,
                   p.k_sh, p.k_ss,    pool.k_scales, p.ks_sblk,      p.ks_sh, p.ks_ss};
  n.wk = page_write(n.k, k_new, k, slots, p, pool);
  if (v_new.is_none()) return;
  const PageSide v{"v",    "v_pages", "Dv",          "(T, Hkv, Dv)", p.Dv,    pool.v, p.v_sblk,
                   p.v_sh, p.v_ss,    pool.v_scales, p.vs_sblk,      p.vs_sh, p.vs_ss};
  n.wv = page_write(n.v, v_new, v, slots, p, pool);
}

// prior_out (N, Hq, Dv) and prior_lse (N, Hq), float32: each row's finished part over keys
// outside the call (the shared prefix), merged in before the row is written. Both or neither.
void check_prior(py::handle out_obj, py::handle lse_obj, PagedParams& p, py::array& po,
                 py::array& pl) {
  if (out_obj.is_none() != lse_obj.is_none())
    value_error("prior_out, prior_lse: pass both or neither");
  if (out_obj.is_none()) return;
  auto f32 = [](py::handle obj, const char* name) {
    py::array x = py::array::ensure(obj);
    if (!x || !is_float32(x.dtype()))
      type_error(std::string(name) + ": expected a float32 numpy array");
    return x;
  };
  po = f32(out_obj, "prior_out");
  pl = f32(lse_obj, "prior_lse");
  check_shape(po, "prior_out", {{"N", p.N}, {"Hq", p.Hq}, {"Dv", p.Dv}});
  check_shape(pl, "prior_lse", {{"N", p.N}, {"Hq", p.Hq}});
  const auto os = elem_strides(po, "prior_out"), ls = elem_strides(pl, "prior_lse", false);
  p.prior_out = static_cast<const float*>(po.data());
  p.po_sn = os[0];
  p.po_sh = os[1];
  p.prior_lse = static_cast<const float*>(pl.data());
  p.pl_sn = ls[0];
  p.pl_sh = ls[1];
}

// The variants of a call, with a sliding-window cache's rule: the window defaults to
// (max_left, None) and may not reach further left.
Variants paged_variants(const PagedInputs& in) {
  Variants var = variants(in.window, in.softcap);
  if (in.max_left >= 0) {
    if (in.window.is_none()) {
      var.window_left = in.max_left;
    } else if (var.window_left < 0 || var.window_left > in.max_left) {
      value_error("window: this cache keeps a sliding window of " +
                  std::to_string(in.max_left + 1) + " tokens, so the left side must be <= " +
                  std::to_string(in.max_left) + ", got " + std::string(py::repr(in.window)));
    }
  }
  return var;
}

// q (N, Hq, Dk), N = the tables' query tokens, Hkv dividing Hq.
py::array check_query(py::handle obj, PagedParams& p, const PagedArrays& keep) {
  const py::array q = native_input(obj, "q");
  check_rank(q, "q", 3, "(N, Hq, Dk)");
  p.q_dtype = dtype_of(q, "q");
  p.N = q.shape(0);
  p.Hq = q.shape(1);
  check_shape(q, "q", {{"N", p.N}, {"Hq", p.Hq}, {"Dk", p.Dk}});
  if (p.Hq % p.Hkv != 0)
    value_error("k_pages: the number of kv heads (" + std::to_string(p.Hkv) +
                ") must divide the number of query heads (" + std::to_string(p.Hq) + ")");
  if (keep.tokens() != p.N)
    value_error("q: expected N = " + std::string(keep.has_ql ? "sum(q_lens)" : "B") + " = " +
                std::to_string(keep.tokens()) + " query tokens, got " + std::to_string(p.N));
  auto qs = elem_strides(q, "q");
  p.q = q.data();
  p.q_sn = qs[0];
  p.q_sh = qs[1];
  return q;
}

// Multiply-adds of a call: sum over sequences of (query tokens x keys), x Hq (Dk + Dv).
double paged_work(const PagedParams& p, const PagedArrays& keep) {
  double work = 0;
  for (int64_t b = 0; b < p.B; ++b)
    work += double(keep.q_start[std::size_t(b + 1)] - keep.q_start[std::size_t(b)]) *
            double(keep.sl.data()[b]);
  return work * double(p.Hq) * double(p.Dk + p.Dv);
}

}  // namespace

py::object run_paged(PagedParams& p, Pool& pool, const PagedArrays& keep, const PagedInputs& in) {
  const py::array q = check_query(in.q, p, keep);
  p.causal = in.causal;
  p.scale = scale_arg(in.scale, p.Dk);
  p.var = paged_variants(in);
  py::array_t<float> sk, al;
  if (!in.sinks.is_none()) {
    sk = head_vector(in.sinks, "sinks", p.Hq);
    p.var.sinks = sk.data();
  }
  if (!in.alibi.is_none()) {
    int64_t reach = 0;  // (a sequence's queries and keys all sit within its seq_len)
    for (int64_t b = 0; b < p.B; ++b) reach = std::max<int64_t>(reach, keep.sl.data()[b]);
    al = alibi_vector(in.alibi, p.Hq, reach);
    p.var.alibi_slopes = al.data();
  }
  py::array po, pl;
  check_prior(in.prior_out, in.prior_lse, p, po, pl);
  NewKV nkv;
  if (!in.k_new.is_none()) prepare_new_kv(nkv, in.k_new, in.v_new, *in.slots, p, pool);
  OutTarget o =
      out_target(in.out, "q", p.q_dtype, q.dtype(), {{"N", p.N}, {"Hq", p.Hq}, {"Dv", p.Dv}},
                 {q, pool.k, pool.v, keep.bt, keep.sl, keep.ql, sk, al, nkv.k, nkv.v, pool.k_scales,
                  pool.v_scales, po, pl},
                 false);
  auto os = elem_strides(o.write, "out");
  p.out = o.write.mutable_data();
  p.o_sn = os[0];
  p.o_sh = os[1];
  py::array_t<float> lse;
  if (in.return_lse) {
    lse = py::array_t<float>(std::vector<py::ssize_t>{p.N, p.Hq});
    p.lse = lse.mutable_data();
    p.l_sn = p.Hq;
    p.l_sh = 1;
  }
  p.num_threads = threads_arg(int_arg(in.threads, "num_threads", 0));
  const PagedStep step{p, nkv.wk, nkv.wv, in.cascade};  // no new keys: both writes are empty
  run_kernel(paged_work(p, keep), [&]() { paged_step(step); });
  if (in.return_lse) return py::make_tuple(o.result(), lse);
  return o.result();
}

namespace {

enum PagedArg {
  pQ,
  pKPages,
  pVPages,
  pBlockTables,
  pSeqLens,
  pQLens,
  pCausal,
  pScale,
  pOut,
  pReturnLse,
  pThreads,
  pWindow,
  pSoftcap,
  pSinks,
  pAlibi,
  pKNew,
  pVNew,
  pSlots,
  pKScales,
  pVScales,
  pPriorOut,
  pPriorLse,
  pMinShared
};
Signature paged_signature{
    "paged_attention",
    {"q",        "k_pages",  "v_pages",      "block_tables", "seq_lens",       "q_lens",
     "causal",   "scale",    "out",          "return_lse",   "num_threads",    "window",
     "softcap",  "sinks",    "alibi_slopes", "k_new",        "v_new",          "slots",
     "k_scales", "v_scales", "prior_out",    "prior_lse",    "min_shared_keys"},
    5,
    {}};

PagedInputs paged_inputs(const Args& a) {
  PagedInputs in;
  in.q = a[pQ];
  in.k_new = a[pKNew];
  in.v_new = a[pVNew];
  in.out = a[pOut];
  in.scale = a[pScale];
  in.window = a[pWindow];
  in.softcap = a[pSoftcap];
  in.sinks = a[pSinks];
  in.alibi = a[pAlibi];
  in.prior_out = a[pPriorOut];
  in.prior_lse = a[pPriorLse];
  in.threads = a[pThreads];
  in.causal = a.flag(pCausal, true);
  in.return_lse = a.flag(pReturnLse, false);
  return in;
}

py::object py_paged_attention(const Args& a) {
  PagedParams p;
  Pool pool;
  pool.k = array_arg(a[pKPages], "k_pages");
  pool.v = array_arg(a[pVPages], "v_pages");
  check_pages(pool.k, pool.v, p);
  check_scales(a[pKScales], a[pVScales], !a[pKNew].is_none(), p, pool.k_scales, pool.v_scales);
  PagedArrays keep;
  check_tables(a[pBlockTables], a[pSeqLens], a[pQLens], p, keep);
  PagedInputs in = paged_inputs(a);
  CascadePlan
      cascade;  // min_shared_keys: sequences sharing leading blocks read them once (cascade.h)
  if (!a[pMinShared].is_none()) {
    cascade = plan_cascade(p, int_arg(a[pMinShared], "min_shared_keys", 0));
    in.cascade = &cascade;
  }
  Native<int64_t> slots;
  if (!in.k_new.is_none()) {
    slots = check_slots(a[pSlots], keep.tokens(), p.num_blocks, p.block_size);
    in.slots = &slots;
  }
  return run_paged(p, pool, keep, in);
}

}  // namespace

void bind_paged(py::module_& m) {
  def_entry_point<py_paged_attention, &paged_signature>(
      m,
      "paged_attention(q, k_pages, v_pages, block_tables, seq_lens, q_lens=None, causal=True, "
      "scale=None, "
      "out=None, return_lse=False, num_threads=0, window=None, softcap=None, sinks=None, "
      "alibi_slopes=None, k_new=None, v_new=None, slots=None, k_scales=None, v_scales=None, "
      "prior_out=None, prior_lse=None, min_shared_keys=None)");
}

}  // namespace attnx::bind
