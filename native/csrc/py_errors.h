// Argument errors of the torch-facing entry points, raised as Python
// exceptions through pybind11: TypeError (dtypes), ValueError (devices,
// shapes, layouts), IndexError (ids out of range).
#pragma once
#include <torch/csrc/utils/pybind.h>  // pybind11 and the at::Tensor caster, not all of torch/extension.h

#include <cmath>
#include <sstream>
#include <string>

namespace cbserve_native {

template <typename... Args>
std::string cat(const Args&... args) {
  std::ostringstream ss;
  (ss << ... << args);
  return ss.str();
}

inline std::string shape_str(const at::Tensor& t) {
  std::ostringstream ss;
  ss << t.sizes();
  return ss.str();
}

// paged_attention's sliding window and soft cap (0: none), on every device.
inline void check_window_softcap(int64_t sliding_window, double softcap) {
  if (sliding_window < 0)
    throw pybind11::value_error(cat("sliding_window must be >= 0 (0: none), got ", sliding_window));
  if (!(std::isfinite(softcap) && softcap >= 0))
    throw pybind11::value_error(cat("softcap must be finite and >= 0 (0: none), got ", softcap));
}

}  // namespace cbserve_native

#define CB_VALUE(cond, ...)                                                       \
  do {                                                                            \
    if (!(cond)) throw pybind11::value_error(::cbserve_native::cat(__VA_ARGS__)); \
  } while (0)
#define CB_TYPE(cond, ...)                                                       \
  do {                                                                           \
    if (!(cond)) throw pybind11::type_error(::cbserve_native::cat(__VA_ARGS__)); \
  } while (0)
#define CB_INDEX(cond, ...)                                                       \
  do {                                                                            \
    if (!(cond)) throw pybind11::index_error(::cbserve_native::cat(__VA_ARGS__)); \
  } while (0)
