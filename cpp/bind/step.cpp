// step.cpp: attnx._core.StepPlan, a cache step's tables and slots checked once, then one call per
// model layer (docs/cache.md).
#include <string>
#include <vector>

#include "args.h"
#include "paged.h"
#include "src/attention/cascade.h"

namespace attnx::bind {
namespace {

// A model's (B, H, S, D) array as the step's (T = B * S, H, D) tokens; run_paged's (T, ...)
// results back as (B, S, ...).
class ModelLayout {
 public:
  ModelLayout(py::ssize_t B, py::ssize_t S) : B_(B), S_(S) {}
  py::object shaped(py::handle x) const {
    auto a = py::reinterpret_borrow<py::array>(x);
    std::vector<py::ssize_t> shape{B_, S_};
    for (py::ssize_t i = 1; i < a.ndim(); ++i) shape.push_back(a.shape(i));
    return py::object(a.reshape(shape));
  }
  py::object result(const py::object& r, bool return_lse) const {
    if (!return_lse) return shaped(r);
    py::tuple rt = r;
    return py::make_tuple(shaped(rt[0]), shaped(rt[1]));
  }

 private:
  py::ssize_t B_, S_;
};

// attnx.Step's per-layer call: the tables and slots of one step, checked once, then one call per
// model layer that reads that layer's pages (num_layers tuples (k_pages, v_pages, k_scales,
// v_scales) of one cache). A decode step calls it once per layer, inside the model's loop, where
// the Python around each call is the cost to avoid: so the plan takes the model's (B, H, S, D)
// arrays as they are, besides the packed (T, H, D) ones.
class StepPlan {
 public:
  StepPlan(py::sequence layers, py::handle block_tables, py::handle seq_lens, py::handle q_lens,
           py::handle slots, bool values_from_keys, py::handle max_left, py::handle min_shared_keys)
      : layers_(layers), values_from_keys_(values_from_keys) {
    if (py::len(layers_) == 0) value_error("layers: expected at least one layer's pages");
    PagedParams p;
    Pool pool;
    pages(0, p, pool);
    num_blocks_ = p.num_blocks;
    block_size_ = p.block_size;
    check_tables(block_tables, seq_lens, q_lens, p, keep_);
    slots_ = check_slots(slots, keep_.tokens(), num_blocks_, block_size_);
    max_left_ = max_left.is_none() ? -1 : int_arg(max_left, "max_left", -1);
    if (!max_left.is_none() && max_left_ < 0) value_error("max_left: expected an int >= 0 or None");
    // the shared-prefix groups, for every layer (none with a sliding window: cascade.h)
    if (!min_shared_keys.is_none() && max_left_ < 0)
      cascade_ = plan_cascade(p, int_arg(min_shared_keys, "min_shared_keys", 0));
  }

  // One layer: writes the new k and v rows into `layer`'s pages and attends. q (T, Hq, Dk) with k,
  // v (T, Hkv, D) returns (T, Hq, Dv); q (B, Hq, S, Dk) with k, v (B, Hkv, S, D), B * S = T (every
  // sequence with S new tokens) returns (B, S, Hq, Dv), the layout a model's o_proj reads.
  py::object attend(py::handle layer, py::handle q, py::handle k, py::handle v, py::handle scale,
                    py::handle softcap, py::handle window, py::handle sinks, py::handle alibi,
                    py::handle threads, bool return_lse, bool shared_prefix) {
    check_values(v);
    PagedParams p;
    Pool pool;
    const int64_t li = layer_index(layer);
    pages(li, p, pool);
    py::tuple t = layers_[li];
    check_scales(t[2], t[3], true, p, pool.k_scales, pool.v_scales);
    use_tables(keep_, p);
    PagedInputs in;
    const bool model_layout =
        py::isinstance<py::array>(q) && py::reinterpret_borrow<py::array>(q).ndim() == 4;
    // (T, H, D) arrays the kernels can address: a model's (B, H, S, D) ones as token views
    const py::object qt = as_tokens(q, "q", model_layout), kt = as_tokens(k, "k", model_layout);
    const py::object vt = v.is_none() ? py::object(py::none()) : as_tokens(v, "v", model_layout);
    in.q = qt;
    in.k_new = kt;
    in.v_new = vt;
    if (shared_prefix) in.cascade = &cascade_;
    in.scale = scale;
    in.softcap = softcap;
    in.window = window;
    in.sinks = sinks;
    in.alibi = alibi;
    in.threads = threads;
    in.return_lse = return_lse;
    in.max_left = max_left_;
    in.slots = &slots_;
    py::object r = run_paged(p, pool, keep_, in);
    if (!model_layout) return r;
    const auto qa = py::reinterpret_borrow<py::array>(q);
    return ModelLayout(qa.shape(0), qa.shape(2)).result(r, return_lse);
  }

 private:
  void check_values(py::handle v) const {
    if (values_from_keys_ && !v.is_none())
      value_error("v: this cache reads values from the keys (value_from_key=True): pass v=None");
    if (!values_from_keys_ && v.is_none())
      value_error("v: expected the new values (T, num_kv_heads, value_dim)");
  }

  int64_t layer_index(py::handle layer) const {
    const int64_t nl = int64_t(py::len(layers_));
    int64_t li = -1;
    if (!PyBool_Check(layer.ptr()) && PyIndex_Check(layer.ptr())) li = int_arg(layer, "layer", -1);
    if (li < 0 || li >= nl)
      value_error("layer: expected an int in [0, " + std::to_string(nl) + "), got " +
                  std::string(py::repr(layer)));
    return li;
  }

  // Layer li's pages into p (checked: the tables were checked against layer 0's pool size).
  void pages(int64_t li, PagedParams& p, Pool& pool) {
    py::object item = layers_[li];
    if (!py::isinstance<py::tuple>(item) || py::len(item) != 4)
      type_error("layers: expected (k_pages, v_pages, k_scales, v_scales) per layer");
    py::tuple t = item;
    pool.k = array_arg(t[0], "k_pages");
    pool.v = array_arg(t[1], "v_pages");
    check_pages(pool.k, pool.v, p);
    if (num_blocks_ >= 0 && (p.num_blocks != num_blocks_ || p.block_size != block_size_))
      value_error("k_pages: layer " + std::to_string(li) +
                  " holds a pool of another size than layer 0");
  }

  py::object as_tokens(py::handle obj, const char* name, bool model_layout) const {
    return model_layout ? tokens(obj, name) : kernel_input(obj, name);
  }

  // Whether every sequence b of the step has S new tokens, row b of a (B, H, S, D) array.
  bool uniform(py::ssize_t B, py::ssize_t S) const {
    bool ok = B == keep_.B;
    for (int64_t b = 0; ok && b < keep_.B; ++b)
      ok = keep_.q_start[std::size_t(b + 1)] - keep_.q_start[std::size_t(b)] == S;
    return ok;
  }

  // A model's (B, H, S, D) array as the step's (T = B * S, H, D) tokens: a view when its strides
  // allow (S = 1, B = 1, or the (B, S, H, D) memory a projection writes), else a packed copy.
  py::object tokens(py::handle obj, const char* name) const {
    py::array a = kernel_input(obj, name);
    check_rank(a, name, 4, "(B, H, S, D) like q");
    const py::ssize_t B = a.shape(0), H = a.shape(1), S = a.shape(2), D = a.shape(3);
    if (!uniform(B, S))
      value_error(
          std::string(name) + ": a (B, H, S, D) array needs B = " + std::to_string(keep_.B) +
          " sequences with S new tokens each (this step has " + std::to_string(keep_.tokens()) +
          " tokens in all: pass them packed, (T, H, D)), got shape " + shape_str(a));
    const py::ssize_t sb = a.strides(0), sh = a.strides(1), ss = a.strides(2), sd = a.strides(3);
    py::ssize_t sn = 0;
    if (S == 1)
      sn = sb;
    else if (B == 1 || sb == S * ss)
      sn = ss;
    else {  // not one token axis: pack (B, S, H, D) in order
      py::array packed = py::array::ensure(
          py::module_::import("numpy").attr("ascontiguousarray")(a.attr("transpose")(0, 2, 1, 3)));
      return packed.reshape({B * S, H, D});
    }
    return py::array(a.dtype(), {B * S, H, D}, {sn, sh, sd}, a.data(), a);
  }

  py::sequence layers_;
  bool values_from_keys_;
  int64_t num_blocks_ = -1, block_size_ = -1, max_left_ = -1;
  PagedArrays keep_;
  Native<int64_t> slots_;
  CascadePlan cascade_;  // empty: no groups
};

}  // namespace

void bind_step(py::module_& m) {
  py::class_<StepPlan>(m, "StepPlan")
      .def(py::init<py::sequence, py::handle, py::handle, py::handle, py::handle, bool, py::handle,
                    py::handle>(),
           py::arg("layers"), py::arg("block_tables"), py::arg("seq_lens"), py::arg("q_lens"),
           py::arg("slots"), py::arg("values_from_keys"), py::arg("max_left"),
           py::arg("min_shared_keys") = py::none())
      .def("attend", &StepPlan::attend);
}

}  // namespace attnx::bind
