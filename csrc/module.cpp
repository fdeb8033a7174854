// epkit._C: one module, several source files (each registers its part).
#include <pybind11/pybind11.h>

namespace py = pybind11;

void register_shm_transport(py::module_ &m);
void register_reduce_rows(py::module_ &m);
void register_gather_by_address(py::module_ &m);
void register_dispatch_layout(py::module_ &m);
void register_gather_rows(py::module_ &m);
void register_engram_hash(py::module_ &m);
void register_dequant(py::module_ &m);
void register_grouped_gemm_amx(py::module_ &m);

PYBIND11_MODULE(_C, m) {
    m.doc() = "epkit host extension: shm segments, 64-bit signals, timed waits, fused row reductions, row gathers, dispatch layouts, the Engram hash, fused dequantization, AMX grouped GEMM";
    register_shm_transport(m);
    register_reduce_rows(m);
    register_gather_by_address(m);
    register_dispatch_layout(m);
    register_gather_rows(m);
    register_engram_hash(m);
    register_dequant(m);
    register_grouped_gemm_amx(m);
}
