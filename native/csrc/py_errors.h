// Argument errors of the torch-facing entry points, raised as Python
// exceptions through pybind11: TypeError (dtypes), ValueError (devices,
// shapes, layouts), IndexError (ids out of range).
#pragma once
#include <torch/extension.h>

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
