// module.cpp: attnx._core, the pybind11 module. Each file of cpp/bind/ binds one operation (its
// argument checks, the GIL, its errors); args.h holds the vocabulary they share. No maths here.
#include <pybind11/pybind11.h>

namespace attnx::bind {
void register_errors(pybind11::module_& m);  // args.cpp
void bind_dense(pybind11::module_& m);       // dense.cpp: attention
void bind_paged(pybind11::module_& m);       // paged.cpp: paged_attention
void bind_step(pybind11::module_& m);        // step.cpp: StepPlan
void bind_delta(pybind11::module_& m);       // delta.cpp: gated_delta_rule
void bind_cascade(
    pybind11::module_& m);  // cascade.cpp: plan_cascade (the step's shared-prefix groups)
void bind_runtime(pybind11::module_& m);  // runtime.cpp: cpu features, ISA, threads, probes
}  // namespace attnx::bind

PYBIND11_MODULE(_core, m) {
  m.doc() = "attnx C++ core (see the attnx package for the documented API)";
  attnx::bind::register_errors(m);
  attnx::bind::bind_dense(m);
  attnx::bind::bind_paged(m);
  attnx::bind::bind_step(m);
  attnx::bind::bind_cascade(m);
  attnx::bind::bind_delta(m);
  attnx::bind::bind_runtime(m);
}
