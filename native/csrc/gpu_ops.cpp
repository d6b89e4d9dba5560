// Torch-facing entry points of the GPU lean forward's kernels
// (cuda_layer_kernels.cu) and of the paged attention without its host-side
// index checks, for steps captured into CUDA graphs.
//
// These check what the tensors' metadata says (device, dtype, rank, shape,
// layout) and nothing that needs their values: reading a device tensor on
// the host waits for the GPU, and cannot happen inside a graph capture. The
// caller vouches for the values (executor/gpu/: the runner has checked every
// block id, position and length of the plan before it builds them).
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>  // pybind11 and the at::Tensor caster, not all of torch/extension.h

#include "gpu_ops.h"
#include "py_errors.h"

#ifdef CBSERVE_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "cuda_launchers.h"
#endif

namespace py = pybind11;

namespace {

int dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return 0;
    case at::kBFloat16: return 1;
    case at::kHalf: return 2;
    default: return -1;
  }
}

// A CUDA tensor of `rank` dimensions, contiguous, on `device` (when given).
void check_cuda(const at::Tensor& t, const char* name, int64_t rank, const at::Tensor* like = nullptr) {
  CB_TYPE(t.defined(), name, " must be a tensor");
  CB_VALUE(t.is_cuda(), name, " must be a CUDA tensor, got one on ", t.device().str());
  CB_VALUE(t.dim() == rank, name, " must have ", rank, " dimensions, got shape ", cbserve_native::shape_str(t));
  CB_VALUE(t.is_contiguous() && t.layout() == at::kStrided, name, " must be a contiguous dense tensor");
  if (like != nullptr) {
    CB_VALUE(t.device() == like->device(), name, " is on ", t.device().str(), ", not ", like->device().str());
  }
}

void check_float(const at::Tensor& t, const char* name, const at::Tensor* like = nullptr) {
  CB_TYPE(dtype_of(t) >= 0, name, " must be float32, bfloat16 or float16, got ", t.scalar_type());
  if (like != nullptr) {
    CB_TYPE(t.scalar_type() == like->scalar_type(), name, " must be ", like->scalar_type(), ", got ", t.scalar_type());
  }
}

void check_int32(const at::Tensor& t, const char* name) {
  CB_TYPE(t.scalar_type() == at::kInt, name, " must be int32, got ", t.scalar_type());
}

#ifdef CBSERVE_WITH_CUDA
void launched(int err, const char* what) {
  CB_VALUE(err == 0, what, " CUDA launch failed: ", cbserve_cuda_error_string(err));
}
#define CB_CUDA_STREAM(t)                         \
  const c10::cuda::CUDAGuard guard((t).device()); \
  void* stream = c10::cuda::getCurrentCUDAStream().stream()
#else
[[noreturn]] void no_cuda() { throw py::value_error("native._C was built without CUDA support"); }
#endif

void add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps, bool add) {
  check_cuda(x, "x", 2);
  check_cuda(residual, "residual", 2, &x);
  check_cuda(weight, "weight", 1, &x);
  check_float(x, "x");
  check_float(residual, "residual", &x);
  check_float(weight, "weight", &x);
  CB_VALUE(residual.sizes() == x.sizes(), "residual shape ", cbserve_native::shape_str(residual), " must equal x's ",
           cbserve_native::shape_str(x));
  CB_VALUE(weight.size(0) == x.size(1), "weight must have ", x.size(1), " entries, got ", weight.size(0));
  CB_VALUE(x.size(1) <= 12288, "hidden size ", x.size(1), " is above 12288");
  CB_VALUE(!x.is_same(residual), "x and residual must be different tensors");
#ifdef CBSERVE_WITH_CUDA
  CB_CUDA_STREAM(x);
  launched(cbserve_add_rms_norm_cuda(dtype_of(x), x.data_ptr(), residual.data_ptr(), weight.data_ptr(), x.size(0),
                                     x.size(1), static_cast<float>(eps), add ? 1 : 0, stream),
           "add_rms_norm");
#else
  no_cuda();
#endif
}

void rotary_cache(at::Tensor& q_out, const at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos,
                  const at::Tensor& sin, at::Tensor& key_cache, at::Tensor& value_cache, const at::Tensor& slots) {
  check_cuda(q_out, "q_out", 3);
  check_cuda(qkv, "qkv", 2, &q_out);
  check_cuda(positions, "positions", 1, &q_out);
  check_cuda(cos, "cos", 2, &q_out);
  check_cuda(sin, "sin", 2, &q_out);
  check_cuda(key_cache, "key_cache", 4, &q_out);
  check_cuda(value_cache, "value_cache", 4, &q_out);
  check_cuda(slots, "slots", 1, &q_out);
  check_float(q_out, "q_out");
  for (const auto& [t, name] : {std::pair<const at::Tensor*, const char*>{&qkv, "qkv"},
                                {&cos, "cos"},
                                {&sin, "sin"},
                                {&key_cache, "key_cache"},
                                {&value_cache, "value_cache"}}) {
    check_float(*t, name, &q_out);
  }
  check_int32(positions, "positions");
  check_int32(slots, "slots");
  const int64_t T = q_out.size(0), hq = q_out.size(1), D = q_out.size(2), hkv = key_cache.size(2);
  CB_VALUE(key_cache.sizes() == value_cache.sizes(), "key_cache and value_cache shapes differ");
  CB_VALUE(key_cache.size(3) == D, "key_cache head_dim ", key_cache.size(3), " != q_out's ", D);
  CB_VALUE(D % 2 == 0, "head_dim must be even, got ", D);
  CB_VALUE(qkv.size(0) == T && qkv.size(1) == (hq + 2 * hkv) * D, "qkv must be [", T, ", ", (hq + 2 * hkv) * D,
           "], got ", cbserve_native::shape_str(qkv));
  CB_VALUE(positions.size(0) == T && slots.size(0) == T, "positions and slots must have ", T, " entries");
  CB_VALUE(cos.sizes() == sin.sizes() && cos.size(1) == D, "cos and sin must be [positions, ", D, "]");
#ifdef CBSERVE_WITH_CUDA
  CB_CUDA_STREAM(q_out);
  launched(cbserve_rotary_cache_cuda(dtype_of(q_out), q_out.data_ptr(), qkv.data_ptr(), positions.data_ptr<int32_t>(),
                                     cos.data_ptr(), sin.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
                                     slots.data_ptr<int32_t>(), T, hq, hkv, D, stream),
           "rotary_cache");
#else
  no_cuda();
#endif
}

void silu_and_mul(at::Tensor& out, const at::Tensor& gate_up) {
  check_cuda(out, "out", 2);
  check_cuda(gate_up, "gate_up", 2, &out);
  check_float(out, "out");
  check_float(gate_up, "gate_up", &out);
  CB_VALUE(gate_up.size(0) == out.size(0) && gate_up.size(1) == 2 * out.size(1), "gate_up must be [", out.size(0), ", ",
           2 * out.size(1), "], got ", cbserve_native::shape_str(gate_up));
#ifdef CBSERVE_WITH_CUDA
  CB_CUDA_STREAM(out);
  launched(
      cbserve_silu_and_mul_cuda(dtype_of(out), out.data_ptr(), gate_up.data_ptr(), out.size(0), out.size(1), stream),
      "silu_and_mul");
#else
  no_cuda();
#endif
}

void paged_attention_graphed(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                             const at::Tensor& value_cache, const at::Tensor& block_tables,
                             const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens, double scale,
                             int64_t max_q_len, int64_t sliding_window, double softcap) {
  check_cuda(out, "out", 3);
  check_cuda(query, "query", 3, &out);
  check_cuda(key_cache, "key_cache", 4, &out);
  check_cuda(value_cache, "value_cache", 4, &out);
  check_cuda(block_tables, "block_tables", 2, &out);
  check_cuda(cu_seqlens_q, "cu_seqlens_q", 1, &out);
  check_cuda(seq_lens, "seq_lens", 1, &out);
  check_float(out, "out");
  check_float(query, "query", &out);
  check_float(key_cache, "key_cache", &out);
  check_float(value_cache, "value_cache", &out);
  for (const auto& [t, name] : {std::pair<const at::Tensor*, const char*>{&block_tables, "block_tables"},
                                {&cu_seqlens_q, "cu_seqlens_q"},
                                {&seq_lens, "seq_lens"}}) {
    check_int32(*t, name);
  }
  CB_VALUE(out.sizes() == query.sizes(), "out and query shapes differ");
  CB_VALUE(key_cache.sizes() == value_cache.sizes(), "key_cache and value_cache shapes differ");
  const int64_t B = seq_lens.size(0), hq = query.size(1), D = query.size(2), hkv = key_cache.size(2);
  CB_VALUE(key_cache.size(3) == D, "key_cache head_dim ", key_cache.size(3), " != query's ", D);
  CB_VALUE(hkv > 0 && hq % hkv == 0, "Hq=", hq, " must be a multiple of Hkv=", hkv);
  CB_VALUE(cu_seqlens_q.size(0) == B + 1 && block_tables.size(0) == B, "cu_seqlens_q must have ", B + 1,
           " entries and block_tables ", B, " rows");
  CB_VALUE(max_q_len >= 0 && max_q_len <= query.size(0), "max_q_len ", max_q_len, " outside [0, ", query.size(0), "]");
  CB_VALUE(std::isfinite(scale), "scale must be finite");
  cbserve_native::check_window_softcap(sliding_window, softcap);
#ifdef CBSERVE_WITH_CUDA
  CB_VALUE(D <= CBSERVE_CUDA_MAX_HEAD_DIM, "CUDA paged_attention supports head_dim <= ", CBSERVE_CUDA_MAX_HEAD_DIM);
  CB_CUDA_STREAM(out);
  const int64_t T = query.size(0), max_blocks = block_tables.size(1), bs = key_cache.size(1);
  // From the caching allocator: inside a graph capture, the graph's own pool.
  const int64_t ws_floats = cbserve_paged_attention_workspace_floats(T, hq, D, max_blocks, bs, max_q_len);
  const at::Tensor ws = ws_floats ? at::empty({ws_floats}, out.options().dtype(at::kFloat)) : at::Tensor();
  launched(cbserve_paged_attention_cuda(
               dtype_of(out), out.data_ptr(), query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
               block_tables.data_ptr<int32_t>(), cu_seqlens_q.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(), B,
               max_blocks, hq, hkv, D, bs, max_q_len, static_cast<float>(scale), sliding_window,
               static_cast<float>(softcap), ws_floats ? ws.data_ptr<float>() : nullptr, T, stream),
           "paged_attention_graphed");
#else
  no_cuda();
#endif
}

void sample_tokens(at::Tensor& out, const at::Tensor& logits, const at::Tensor& params) {
  check_cuda(out, "out", 1);
  check_cuda(logits, "logits", 2, &out);
  check_cuda(params, "params", 2, &out);
  check_float(logits, "logits");
  CB_TYPE(out.scalar_type() == at::kLong, "out must be int64, got ", out.scalar_type());
  CB_TYPE(params.scalar_type() == at::kFloat, "params must be float32, got ", params.scalar_type());
  const int64_t N = logits.size(0), V = logits.size(1);
  CB_VALUE(out.size(0) == N, "out must have ", N, " entries, got ", out.size(0));
  CB_VALUE(params.size(0) == 5 && params.size(1) == N, "params must be [5, ", N, "], got ",
           cbserve_native::shape_str(params));
  CB_VALUE(V > 0, "logits must have at least one column");
#ifdef CBSERVE_WITH_CUDA
  CB_CUDA_STREAM(out);
  launched(cbserve_sample_cuda(dtype_of(logits), logits.data_ptr(), V, N, V, params.data_ptr<float>(),
                               out.data_ptr<int64_t>(), stream),
           "sample_tokens");
#else
  no_cuda();
#endif
}

void set_cuda_decode_kernel(bool on) {
#ifdef CBSERVE_WITH_CUDA
  cbserve_cuda_set_decode_kernel(on ? 1 : 0);
#else
  (void)on;
  no_cuda();
#endif
}

}  // namespace

void cbserve_native::register_gpu_ops(py::module_& m) {
  m.def("add_rms_norm_", &add_rms_norm, py::arg("x"), py::arg("residual"), py::arg("weight"), py::arg("eps"),
        py::arg("add"));
  m.def("rotary_cache", &rotary_cache, py::arg("q_out"), py::arg("qkv"), py::arg("positions"), py::arg("cos"),
        py::arg("sin"), py::arg("key_cache"), py::arg("value_cache"), py::arg("slots"));
  m.def("silu_and_mul", &silu_and_mul, py::arg("out"), py::arg("gate_up"));
  m.def("paged_attention_graphed", &paged_attention_graphed, py::arg("out"), py::arg("query"), py::arg("key_cache"),
        py::arg("value_cache"), py::arg("block_tables"), py::arg("cu_seqlens_q"), py::arg("seq_lens"), py::arg("scale"),
        py::arg("max_q_len"), py::arg("sliding_window") = 0, py::arg("softcap") = 0.0);
  m.def("sample_tokens", &sample_tokens, py::arg("out"), py::arg("logits"), py::arg("params"));
  m.def("set_cuda_decode_kernel", &set_cuda_decode_kernel, py::arg("on"));
}
