// runtime.cpp: the runtime's controls and reports: CPU features, the kernel path (ISA), thread
// counts and sharing, and the machine probes (docs/platforms.md, docs/performance.md).
#include <cstdint>
#include <string>

#include "args.h"
#include "attnx/dispatch.h"
#include "attnx/probes.h"

namespace attnx::bind {
namespace {

py::dict cpu_feature_dict() {
  const CpuFeatures f = cpu_features();
  py::dict d;
  d["sse2"] = f.sse2;
  d["avx2"] = f.avx2;
  d["fma"] = f.fma;
  d["f16c"] = f.f16c;
  d["avx512f"] = f.avx512f;
  d["avx512bw"] = f.avx512bw;
  d["avx512vl"] = f.avx512vl;
  d["avx512bf16"] = f.avx512bf16;
  d["avx512_vnni"] = f.avx512_vnni;
  d["avx_vnni"] = f.avx_vnni;
  d["avx512_fp16"] = f.avx512_fp16;
  d["amx_tile"] = f.amx_tile;
  d["amx_bf16"] = f.amx_bf16;
  d["amx_int8"] = f.amx_int8;
  d["amx_fp16"] = f.amx_fp16;
  d["amx_permitted"] = f.amx_permitted;
  // aarch64
  d["neon"] = f.neon;
  d["dotprod"] = f.dotprod;
  d["bf16"] = f.bf16;
  d["i8mm"] = f.i8mm;
  d["sve"] = f.sve;
  return d;
}

void bind_kernel_path(py::module_& m) {
  m.def("cpu_features", &cpu_feature_dict);
  m.def("bf16_dot_gain", &bf16_dot_gain);
  m.attr("BF16_DOT_GAIN_LINE") = kBf16DotGain;
  m.def("set_int8_query", [](int setting) { set_int8_query(setting); }, py::arg("setting"));
  m.def("int8_query_setting", &int8_query_setting);
  m.def("int8_query", &int8_query);
  m.def("active_integer_products", &active_integer_products);
  m.def("set_float32_bf16_products", [](bool on) { set_float32_bf16_products(on); }, py::arg("on"));
  m.def("float32_bf16_products", &float32_bf16_products);
  m.def("active_bf16_products", &active_bf16_products);
  m.def(
      "set_int8_tiles",
      [](const std::string& mode, int min_rows) { set_int8_tiles(mode, min_rows); },
      py::arg("mode"), py::arg("min_rows"));
  m.def("int8_tiles", []() { return py::make_tuple(int8_tiles_mode(), int8_tiles_min_rows()); });
  m.def("active_isa", []() { return std::string(active_isa()); });
  m.def("set_isa", [](const std::string& name) { set_isa(name); }, py::arg("name"));
}

void bind_threads(py::module_& m) {
  m.def(
      "set_num_threads",
      [](int n) {
        if (n < 0)
          value_error("n: expected an int >= 0 (0: the default, OMP_NUM_THREADS or the CPUs)");
        set_num_threads(n);
      },
      py::arg("n"));
  m.def("get_num_threads", &get_num_threads);
  m.def("_max_threads", &max_threads);
  m.def("_pool_threads", &pool_workers_used);
  m.def("share_blas_threads", [](bool on) { return share_blas_threads(on); }, py::arg("on"));
  m.def("share_omp_threads", [](bool on) { return share_omp_threads(on); }, py::arg("on"));
}

void bind_probes(py::module_& m) {
  m.def(
      "probe_fma_gflops",
      [](int nt, double seconds) {
        py::gil_scoped_release nogil;
        return probe_fma_gflops(resolve_threads(nt), seconds);
      },
      py::arg("num_threads"), py::arg("seconds") = 0.3);
  m.def(
      "probe_read_gbps",
      [](int nt, int64_t bytes, double seconds) {
        py::gil_scoped_release nogil;
        return probe_read_gbps(resolve_threads(nt), bytes, seconds);
      },
      py::arg("num_threads"), py::arg("bytes") = int64_t(1) << 30, py::arg("seconds") = 0.5);
}

}  // namespace

void bind_runtime(py::module_& m) {
  bind_kernel_path(m);
  bind_threads(m);
  bind_probes(m);
}

}  // namespace attnx::bind
