// Registration of the GPU lean forward's ops (gpu_ops.cpp) in native._C.
#pragma once
#include <pybind11/pybind11.h>

namespace cbserve_native {
void register_gpu_ops(pybind11::module_& m);
}
