// bind/cascade.cpp: _core.plan_cascade, the groups a cache step's shared-prefix path reads once
// (attnx._shared.plan_groups; the step itself plans them in _core.StepPlan, once per step).
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "src/attention/cascade.h"

namespace py = pybind11;

namespace {

using Int32 = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;

// block_tables (B, max_blocks), seq_lens (B,), q_lens (B,): the groups as
// [(rows, first, end)], the sequences rows sharing table entries [first, end).
py::list py_plan_cascade(const Int32& block_tables, const Int32& seq_lens, const Int32& q_lens,
                         int64_t block_size, int64_t min_saved_keys) {
  if (block_tables.ndim() != 2)
    throw py::value_error("block_tables: expected 2 dims (B, max_blocks)");
  const int64_t B = block_tables.shape(0);
  if (seq_lens.ndim() != 1 || seq_lens.shape(0) != B || q_lens.ndim() != 1 || q_lens.shape(0) != B)
    throw py::value_error("seq_lens, q_lens: expected shape (B,) = (" + std::to_string(B) + ",)");
  if (block_size <= 0) throw py::value_error("block_size: expected an int > 0");
  std::vector<int64_t> q_start(std::size_t(B + 1), 0);
  for (int64_t b = 0; b < B; ++b) {
    if (q_lens.data()[b] < 0) throw py::value_error("q_lens: expected counts >= 0");
    q_start[std::size_t(b + 1)] = q_start[std::size_t(b)] + q_lens.data()[b];
  }
  attnx::PagedParams t;
  t.B = B;
  t.block_tables = block_tables.data();
  t.bt_stride = t.max_blocks = block_tables.shape(1);
  t.seq_lens = seq_lens.data();
  t.q_start = q_start.data();
  t.block_size = block_size;
  const attnx::CascadePlan plan = attnx::plan_cascade(t, min_saved_keys);
  py::list groups;
  for (const attnx::CascadeGroup& g : plan.groups)
    groups.append(py::make_tuple(g.rows, g.b0, g.b1));
  return groups;
}

}  // namespace

namespace attnx::bind {
void bind_cascade(py::module_& m) {
  m.def("plan_cascade", &py_plan_cascade, py::arg("block_tables"), py::arg("seq_lens"),
        py::arg("q_lens"), py::arg("block_size"), py::arg("min_saved_keys"));
}
}  // namespace attnx::bind
