// Torch-facing entry points of native._C: argument validation, run-time ISA
// dispatch, threading (at::parallel_for) and the CUDA hand-off.
//
// Every check runs before anything is read through a raw pointer, so a bad
// argument raises a Python exception (TypeError / ValueError / IndexError via
// pybind11) instead of reading or writing out of bounds.
#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>  // pybind11 and the at::Tensor caster, not all of torch/extension.h

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "amx_tiles.h"
#include "gpu_ops.h"
#include "kernels.h"
#include "py_errors.h"

#ifdef CBSERVE_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "cuda_launchers.h"
#endif

namespace py = pybind11;
using namespace cbserve_native;

namespace {

// ------------------------------------------------------- ISA dispatch ---
struct CpuFeatures {
  bool avx2 = false, fma = false, f16c = false;
  bool avx512f = false, avx512bw = false, avx512vl = false, avx512dq = false, avx512bf16 = false;
  bool amx_bf16 = false;  // AMX-TILE + AMX-BF16, and Linux granted this process the tile state
};

CpuFeatures detect() {
  CpuFeatures f;
#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  f.avx2 = __builtin_cpu_supports("avx2");
  f.fma = __builtin_cpu_supports("fma");
  f.f16c = true;  // every AVX2 CPU shipped has F16C; checked below via cpuid
  unsigned eax, ebx, ecx, edx;
  __asm__ volatile("cpuid" : "=a"(eax), "=b"(ebx), "=c"(ecx), "=d"(edx) : "a"(1), "c"(0));
  f.f16c = (ecx >> 29) & 1u;
  f.avx512f = __builtin_cpu_supports("avx512f");
  f.avx512bw = __builtin_cpu_supports("avx512bw");
  f.avx512vl = __builtin_cpu_supports("avx512vl");
  f.avx512dq = __builtin_cpu_supports("avx512dq");
  // CPUID.(EAX=7,ECX=1):EAX[5] = AVX512_BF16 (the OS saves zmm state when
  // avx512f is reported usable by __builtin_cpu_supports).
  __asm__ volatile("cpuid" : "=a"(eax), "=b"(ebx), "=c"(ecx), "=d"(edx) : "a"(7), "c"(1));
  f.avx512bf16 = f.avx512f && ((eax >> 5) & 1u);
  // CPUID.(EAX=7,ECX=0):EDX[22] = AMX-BF16, [24] = AMX-TILE; usable once
  // Linux grants this process the tile state.
  __asm__ volatile("cpuid" : "=a"(eax), "=b"(ebx), "=c"(ecx), "=d"(edx) : "a"(7), "c"(0));
  f.amx_bf16 = f.avx512bf16 && ((edx >> 22) & 1u) && ((edx >> 24) & 1u) && cbserve_amx::request_tile_state();
#endif
  return f;
}

const CpuFeatures& features() {
  static const CpuFeatures f = detect();
  return f;
}

bool isa_supported(const std::string& isa) {
  const auto& f = features();
  if (isa == "generic") return true;
  if (isa == "avx2") return have_avx2_kernels() && f.avx2 && f.fma && f.f16c;
  if (isa == "avx512")
    return have_avx512_kernels() && f.avx512f && f.avx512bw && f.avx512vl && f.avx512dq && f.fma && f.f16c && f.avx2;
  if (isa == "amx") return isa_supported("avx512") && f.amx_bf16;
  return false;
}

std::string best_isa() {
  const char* env = std::getenv("CBSERVE_NATIVE_ISA");
  if (env && *env && isa_supported(env)) return env;
  if (isa_supported("amx")) return "amx";
  if (isa_supported("avx512")) return "avx512";
  if (isa_supported("avx2")) return "avx2";
  return "generic";
}

std::string& current_isa() {
  static std::string isa = best_isa();
  return isa;
}

AttnItemFn item_fn() {
  const std::string& isa = current_isa();
  if (isa == "amx") return attn_item_amx;
  if (isa == "avx512") return attn_item_avx512;
  if (isa == "avx2") return attn_item_avx2;
  return attn_item_generic;
}

void set_isa(const std::string& isa) {
  CB_VALUE(isa == "generic" || isa == "avx2" || isa == "avx512" || isa == "amx", "unknown ISA '", isa,
           "' (expected generic, avx2, avx512 or amx)");
  CB_VALUE(isa_supported(isa), "ISA '", isa, "' is not supported by this CPU/build");
  current_isa() = isa;
}

py::dict cpu_features() {
  const auto& f = features();
  py::dict d;
  d["isa"] = current_isa();
  d["best_isa"] = best_isa();
  d["avx2"] = f.avx2;
  d["fma"] = f.fma;
  d["f16c"] = f.f16c;
  d["avx512f"] = f.avx512f;
  d["avx512bw"] = f.avx512bw;
  d["avx512vl"] = f.avx512vl;
  d["avx512dq"] = f.avx512dq;
  d["avx512_bf16"] = f.avx512bf16;
  d["amx_bf16"] = f.amx_bf16;
  d["supported"] =
      py::make_tuple(isa_supported("generic"), isa_supported("avx2"), isa_supported("avx512"), isa_supported("amx"));
  return d;
}

// ---------------------------------------------------------- validation ---
// CUDA arguments are validated on host copies. A step hands the same metadata
// tensors to every layer, so a host copy is reused while the device tensor is
// the very same one (held here: no other tensor can take its storage) and its
// version counter has not moved (any in-place write bumps it): one
// device->host copy, i.e. one wait for the GPU, per tensor and step instead of
// per layer. Inference tensors have no version counter and are copied every
// call (the executor builds its metadata as normal tensors for this).
enum HostCopySlot { kSlots, kCuSeqlens, kSeqLens, kBlockTables, kNumHostCopySlots };

at::Tensor host_copy(HostCopySlot slot, const at::Tensor& t) {
  if (t.is_cpu()) return t;
  if (t.is_inference()) return t.cpu();
  struct Memo {
    at::Tensor src, host;
    int64_t version = -1;
  };
  // Never destroyed: releasing CUDA tensors during interpreter exit races the
  // CUDA runtime's own teardown.
  static auto* memos = new Memo[kNumHostCopySlots];
  static auto* mu = new std::mutex;
  const std::lock_guard<std::mutex> lock(*mu);
  Memo& m = memos[slot];
  const int64_t version = t._version();
  if (!(m.src.defined() && m.src.is_same(t) && m.version == version)) {
    m.host = t.cpu();
    m.src = t;
    m.version = version;
  }
  return m.host;
}

int32_t dtype_code(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return kF32;
    case at::kBFloat16: return kBF16;
    case at::kHalf: return kF16;
    default: return -1;
  }
}

// A KV cache's storage: the activations' dtype, or fp8 e5m2 (an opt-in
// 8-bit cache, CPU only) for any of them.
void check_cache_dtype(const at::Tensor& key_cache, const at::Tensor& value_cache, const at::Tensor& act,
                       const char* act_names) {
  CB_TYPE(value_cache.scalar_type() == key_cache.scalar_type(), "key_cache and value_cache must share one dtype, got ",
          key_cache.scalar_type(), " and ", value_cache.scalar_type());
  const bool fp8 = key_cache.scalar_type() == at::kFloat8_e5m2;
  CB_TYPE(fp8 || key_cache.scalar_type() == act.scalar_type(), "key_cache must have the dtype of ", act_names, " (",
          act.scalar_type(), ") or be float8_e5m2, got ", key_cache.scalar_type());
  CB_TYPE(!fp8 || !key_cache.is_cuda(), "a float8_e5m2 KV cache is supported on the CPU only");
}

int32_t kv_dtype_code(const at::Tensor& cache) {
  return cache.scalar_type() == at::kFloat8_e5m2 ? int32_t(kFP8E5M2) : dtype_code(cache.scalar_type());
}

void check_tensor(const at::Tensor& t, const char* name, int64_t rank) {
  CB_TYPE(t.defined(), name, " must be a tensor");
  CB_VALUE(t.dim() == rank, name, " must have ", rank, " dimensions, got shape ", shape_str(t));
  CB_VALUE(t.is_contiguous(), name, " must be contiguous");
  CB_VALUE(t.layout() == at::kStrided, name, " must be a dense (strided) tensor");
}

void check_same_device(const std::vector<std::pair<const at::Tensor*, const char*>>& ts) {
  const at::Device dev = ts[0].first->device();
  CB_VALUE(dev.is_cpu() || dev.is_cuda(), ts[0].second, " is on unsupported device ", dev.str());
  for (const auto& [t, name] : ts) {
    CB_VALUE(t->device() == dev, "all tensors must be on the same device: ", ts[0].second, " is on ", dev.str(),
             " but ", name, " is on ", t->device().str());
  }
}

void check_float_dtype(const at::Tensor& t, const char* name) {
  CB_TYPE(dtype_code(t.scalar_type()) >= 0, name, " must be float32, bfloat16 or float16, got ", t.scalar_type());
}

void check_int_dtype(const at::Tensor& t, const char* name, at::ScalarType want) {
  CB_TYPE(t.scalar_type() == want, name, " must be ", want, ", got ", t.scalar_type());
}

// --------------------------------------------------------- reshape_and_cache ---
void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache, at::Tensor& value_cache,
                       const at::Tensor& slot_mapping) {
  check_tensor(key, "key", 3);
  check_tensor(value, "value", 3);
  check_tensor(key_cache, "key_cache", 4);
  check_tensor(value_cache, "value_cache", 4);
  check_tensor(slot_mapping, "slot_mapping", 1);
  check_same_device({{&key, "key"},
                     {&value, "value"},
                     {&key_cache, "key_cache"},
                     {&value_cache, "value_cache"},
                     {&slot_mapping, "slot_mapping"}});
  check_float_dtype(key, "key");
  CB_TYPE(value.scalar_type() == key.scalar_type(), "key and value must share one dtype, got ", key.scalar_type(),
          " and ", value.scalar_type());
  check_cache_dtype(key_cache, value_cache, key, "key and value");
  check_int_dtype(slot_mapping, "slot_mapping", at::kLong);
  CB_VALUE(key_cache.sizes() == value_cache.sizes(), "key_cache and value_cache shapes differ: ", shape_str(key_cache),
           " vs ", shape_str(value_cache));
  CB_VALUE(key.sizes() == value.sizes(), "key and value shapes differ: ", shape_str(key), " vs ", shape_str(value));
  const int64_t T = key.size(0), hkv = key.size(1), D = key.size(2);
  const int64_t num_blocks = key_cache.size(0), bs = key_cache.size(1);
  CB_VALUE(key_cache.size(2) == hkv && key_cache.size(3) == D, "key shape ", shape_str(key),
           " does not match the cache's [num_blocks, block_size, Hkv, D] = ", shape_str(key_cache));
  CB_VALUE(slot_mapping.size(0) == T, "slot_mapping must have T=", T, " entries, got ", slot_mapping.size(0));
  CB_VALUE(key_cache.numel() == 0 || at::get_overlap_status(key_cache, value_cache) == at::MemOverlapStatus::No,
           "key_cache and value_cache must not overlap (different tensors)");
  if (T == 0 || hkv * D == 0) return;
  const int64_t num_slots = num_blocks * bs;

  if (key.is_cuda()) {
#ifdef CBSERVE_WITH_CUDA
    const at::Tensor slots_cpu = host_copy(kSlots, slot_mapping);
    const int64_t* s = slots_cpu.data_ptr<int64_t>();
    for (int64_t t = 0; t < T; ++t)
      CB_INDEX(s[t] < num_slots, "slot_mapping[", t, "] = ", s[t], " is out of range for a cache of ", num_blocks,
               " blocks x ", bs, " slots");
    const c10::cuda::CUDAGuard guard(key.device());
    const int err = cbserve_reshape_and_cache_cuda(
        dtype_code(key.scalar_type()), key.data_ptr(), value.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
        slot_mapping.data_ptr<int64_t>(), T, hkv * D, c10::cuda::getCurrentCUDAStream().stream());
    CB_VALUE(err == 0, "reshape_and_cache CUDA launch failed: ", cbserve_cuda_error_string(err));
    return;
#else
    throw py::value_error("native._C was built without CUDA support; got CUDA tensors");
#endif
  }

  const int64_t* s = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    CB_INDEX(s[t] < num_slots, "slot_mapping[", t, "] = ", s[t], " is out of range for a cache of ", num_blocks,
             " blocks x ", bs, " slots");
  const int64_t row_bytes = hkv * D * key.element_size();
  const char* k = static_cast<const char*>(key.data_ptr());
  const char* v = static_cast<const char*>(value.data_ptr());
  char* kc = static_cast<char*>(key_cache.data_ptr());
  char* vc = static_cast<char*>(value_cache.data_ptr());
  py::gil_scoped_release nogil;
  if (key_cache.scalar_type() == at::kFloat8_e5m2) {  // rows rounded to fp8 on the way in
    const int64_t row = hkv * D;
    const int32_t dt = dtype_code(key.scalar_type());
    const auto conv = current_isa() == "avx512" || current_isa() == "amx" ? to_e5m2_avx512 : to_e5m2_generic;
    at::parallel_for(0, T, std::max<int64_t>(1, 4096 / row), [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        if (s[t] < 0) continue;
        conv(k + t * row_bytes, dt, reinterpret_cast<uint8_t*>(kc) + s[t] * row, row);
        conv(v + t * row_bytes, dt, reinterpret_cast<uint8_t*>(vc) + s[t] * row, row);
      }
    });
    return;
  }
  at::parallel_for(0, T, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, row_bytes)), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      if (s[t] < 0) continue;
      std::memcpy(kc + s[t] * row_bytes, k + t * row_bytes, row_bytes);
      std::memcpy(vc + s[t] * row_bytes, v + t * row_bytes, row_bytes);
    }
  });
}

// ------------------------------------------------------------ paged_attention ---
constexpr int64_t kTargetRows = 192;  // query rows (tokens x group heads) per work item
// Whole-row decode items (all KV heads) once there are this many sequences per
// thread. One is enough for items of up to kDecodeMaxRows rows: even unevenly
// spread, whole rows beat per-head items, whose strided reads cost more than
// the imbalance. Wider ones (up to kDecodeRowsCap rows, e.g. 20 / 4 or 32 / 8
// heads) take four: with fewer, one sequence more on a thread costs more than
// the contiguous reads save (docs/native.md).
constexpr int64_t kWholeRowSeqsPerThread = 1;
constexpr int64_t kWideWholeRowSeqsPerThread = 4;

void paged_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& block_tables, const at::Tensor& cu_seqlens_q,
                     const at::Tensor& seq_lens, double scale, int64_t sliding_window, double softcap) {
  check_tensor(out, "out", 3);
  check_tensor(query, "query", 3);
  check_tensor(key_cache, "key_cache", 4);
  check_tensor(value_cache, "value_cache", 4);
  check_tensor(block_tables, "block_tables", 2);
  check_tensor(cu_seqlens_q, "cu_seqlens_q", 1);
  check_tensor(seq_lens, "seq_lens", 1);
  check_same_device({{&query, "query"},
                     {&out, "out"},
                     {&key_cache, "key_cache"},
                     {&value_cache, "value_cache"},
                     {&block_tables, "block_tables"},
                     {&cu_seqlens_q, "cu_seqlens_q"},
                     {&seq_lens, "seq_lens"}});
  check_float_dtype(query, "query");
  CB_TYPE(out.scalar_type() == query.scalar_type(), "query and out must share one dtype, got ", query.scalar_type(),
          " and ", out.scalar_type());
  check_cache_dtype(key_cache, value_cache, query, "query");
  check_int_dtype(block_tables, "block_tables", at::kInt);
  check_int_dtype(cu_seqlens_q, "cu_seqlens_q", at::kInt);
  check_int_dtype(seq_lens, "seq_lens", at::kInt);
  CB_VALUE(out.sizes() == query.sizes(), "out shape ", shape_str(out), " must equal query shape ", shape_str(query));
  CB_VALUE(key_cache.sizes() == value_cache.sizes(), "key_cache and value_cache shapes differ: ", shape_str(key_cache),
           " vs ", shape_str(value_cache));
  const int64_t T = query.size(0), hq = query.size(1), D = query.size(2);
  const int64_t num_blocks = key_cache.size(0), bs = key_cache.size(1), hkv = key_cache.size(2);
  CB_VALUE(key_cache.size(3) == D, "head_dim mismatch: query has D=", D, ", key_cache has D=", key_cache.size(3));
  CB_VALUE(D > 0, "head_dim must be positive");
  CB_VALUE(bs > 0, "block_size must be positive");
  CB_VALUE(hkv > 0 && hq > 0, "head counts must be positive (Hq=", hq, ", Hkv=", hkv, ")");
  CB_VALUE(hq % hkv == 0, "Hq=", hq, " must be a multiple of Hkv=", hkv, " (GQA)");
  const int64_t B = seq_lens.size(0);
  CB_VALUE(cu_seqlens_q.size(0) == B + 1, "cu_seqlens_q must have B+1=", B + 1, " entries (B = len(seq_lens)), got ",
           cu_seqlens_q.size(0));
  CB_VALUE(block_tables.size(0) == B, "block_tables must have B=", B, " rows, got ", block_tables.size(0));
  CB_VALUE(std::isfinite(scale), "scale must be finite, got ", scale);
  check_window_softcap(sliding_window, softcap);
  for (const auto& [t, name] : {std::pair<const at::Tensor*, const char*>{&query, "query"},
                                {&key_cache, "key_cache"},
                                {&value_cache, "value_cache"}}) {
    CB_VALUE(out.numel() == 0 || t->numel() == 0 || at::get_overlap_status(out, *t) == at::MemOverlapStatus::No,
             "out must not overlap ", name);
  }
  const int64_t max_blocks = block_tables.size(1);

  // Index checks run on host copies (CUDA: see host_copy).
  const bool cuda = query.is_cuda();
  const at::Tensor cu_h = host_copy(kCuSeqlens, cu_seqlens_q);
  const at::Tensor sl_h = host_copy(kSeqLens, seq_lens);
  const at::Tensor bt_h = host_copy(kBlockTables, block_tables);
  const int32_t* cu = cu_h.data_ptr<int32_t>();
  const int32_t* sl = sl_h.data_ptr<int32_t>();
  const int32_t* bt = bt_h.data_ptr<int32_t>();
  CB_VALUE(cu[0] == 0, "cu_seqlens_q[0] must be 0, got ", cu[0]);
  int64_t max_q_len = 0;
  for (int64_t b = 0; b < B; ++b) {
    CB_VALUE(cu[b + 1] >= cu[b], "cu_seqlens_q must be non-decreasing: cu_seqlens_q[", b + 1, "] = ", cu[b + 1],
             " < cu_seqlens_q[", b, "] = ", cu[b]);
    const int64_t q_len = cu[b + 1] - cu[b];
    max_q_len = std::max(max_q_len, q_len);
    CB_VALUE(sl[b] >= q_len, "seq_lens[", b, "] = ", sl[b], " is smaller than the sequence's query length ", q_len);
    if (q_len == 0) continue;
    const int64_t nblk = (int64_t(sl[b]) + bs - 1) / bs;
    CB_INDEX(nblk <= max_blocks, "sequence ", b, " needs ", nblk, " blocks for seq_lens=", sl[b],
             " but block_tables has only ", max_blocks, " columns");
    for (int64_t j = 0; j < nblk; ++j) {
      const int32_t id = bt[b * max_blocks + j];
      CB_INDEX(id >= 0 && id < num_blocks, "block_tables[", b, ", ", j, "] = ", id, " is out of range [0, ", num_blocks,
               ")");
    }
  }
  CB_VALUE(cu[B] == T, "cu_seqlens_q[-1] = ", cu[B], " must equal the number of query tokens T=", T);
  if (T == 0) return;
  const int64_t G = hq / hkv;

  if (cuda) {
#ifdef CBSERVE_WITH_CUDA
    CB_VALUE(D <= CBSERVE_CUDA_MAX_HEAD_DIM, "CUDA paged_attention supports head_dim <= ", CBSERVE_CUDA_MAX_HEAD_DIM,
             ", got ", D);
    const c10::cuda::CUDAGuard guard(query.device());
    const int64_t ws_floats = cbserve_paged_attention_workspace_floats(T, hq, D, max_blocks, bs, max_q_len);
    const at::Tensor ws = ws_floats ? at::empty({ws_floats}, query.options().dtype(at::kFloat)) : at::Tensor();
    const int err = cbserve_paged_attention_cuda(
        dtype_code(query.scalar_type()), out.data_ptr(), query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
        block_tables.data_ptr<int32_t>(), cu_seqlens_q.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(), B, max_blocks,
        hq, hkv, D, bs, max_q_len, static_cast<float>(scale), sliding_window, static_cast<float>(softcap),
        ws_floats ? ws.data_ptr<float>() : nullptr, T, c10::cuda::getCurrentCUDAStream().stream());
    CB_VALUE(err == 0, "paged_attention CUDA launch failed: ", cbserve_cuda_error_string(err));
    return;
#else
    throw py::value_error("native._C was built without CUDA support; got CUDA tensors");
#endif
  }

  // Work items: (sequence, KV head, query chunk); all G query heads of a KV
  // head are processed together so each K/V block is read once per group.
  // Decode items take all KV heads of a sequence at once when there are
  // enough sequences to keep every thread busy (contiguous cache reads).
  const int64_t qc = std::max<int64_t>(1, kTargetRows / G);
  const int64_t threads = at::get_num_threads();
  const bool whole_rows = B >= kWholeRowSeqsPerThread * threads;
  const bool wide_whole_rows = B >= kWideWholeRowSeqsPerThread * threads;
  std::vector<AttnItem> items;
  std::vector<double> cost;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t q_len = cu[b + 1] - cu[b];
    for (int64_t i0 = 0; i0 < q_len; i0 += qc) {
      const int64_t i1 = std::min(q_len, i0 + qc);
      const int64_t rows = (i1 - i0) * hq;
      const int64_t nh =
          (whole_rows && rows <= kDecodeMaxRows) || (wide_whole_rows && rows <= kDecodeRowsCap) ? hkv : 1;
      for (int64_t h = 0; h < hkv; h += nh) {
        items.push_back({int32_t(b), int32_t(h), int32_t(i0), int32_t(i1), int32_t(nh)});
        // KV tokens visited (from the first row's window start, as the
        // kernels read them) x rows (plus a per-item constant), per KV head.
        const int64_t lo = window_start(sl[b] - q_len + i0, sliding_window);
        cost.push_back(double(sl[b] - q_len + i1 - lo) * double((i1 - i0) * G + 8) * double(nh));
      }
    }
  }
  // Longest first, then handed out dynamically: balances causal prefill chunks.
  std::vector<int64_t> order(items.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = int64_t(i);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return cost[a] > cost[b]; });

  AttnParams p;
  p.out = out.data_ptr();
  p.query = query.data_ptr();
  p.key_cache = key_cache.data_ptr();
  p.value_cache = value_cache.data_ptr();
  p.block_tables = bt;
  p.cu_seqlens = cu;
  p.seq_lens = sl;
  p.num_seqs = B;
  p.max_blocks = max_blocks;
  p.hq = hq;
  p.hkv = hkv;
  p.head_dim = D;
  p.block_size = bs;
  p.scale = static_cast<float>(scale);
  p.window = sliding_window;
  p.softcap = static_cast<float>(softcap);
  p.dtype = dtype_code(query.scalar_type());
  p.kv_dtype = kv_dtype_code(key_cache);
  int scale_exp;
  p.bf16_decode_dots = current_isa() == "avx512" && features().avx512bf16 && p.dtype == kBF16 && p.kv_dtype == kBF16 &&
                       std::frexp(p.scale, &scale_exp) == 0.5f;

  const AttnItemFn fn = item_fn();
  // Scratch for the largest item present: a decode item of any size needs
  // the decode path's fixed ~30 KB per thread (head_dim 64), a tiled one
  // (a prefill chunk) up to ~260 KB by its rows.
  int64_t max_rows = 1;  // of the tiled items
  for (const AttnItem& it : items)
    if (!is_decode_item(it, G)) max_rows = std::max<int64_t>(max_rows, item_rows(it, G));
  const int64_t scratch_floats = attn_scratch_floats(max_rows, D, bs);
  const int64_t n_items = int64_t(items.size());
  const int64_t n_workers = std::min<int64_t>(at::get_num_threads(), n_items);
  std::atomic<int64_t> next{0};
  py::gil_scoped_release nogil;
  at::parallel_for(0, n_workers, 1, [&](int64_t wb, int64_t we) {
    // Kept per thread across calls: allocating (and zeroing) it per call cost
    // as much as a whole batch-1 decode item.
    thread_local std::vector<float> scratch;
    if (scratch.size() < size_t(scratch_floats) + 16) scratch.resize(size_t(scratch_floats) + 16);
    float* sp = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(scratch.data()) + 63) & ~uintptr_t(63));
    for (int64_t w = wb; w < we; ++w) {
      // A decode item claims the thread's next item before it runs, so it can
      // prefetch that item's first KV blocks; only while enough items remain
      // that no other thread is left without one (few big prefill items must
      // still spread over the threads).
      bool prefetched = false;
      for (int64_t k = next.fetch_add(1, std::memory_order_relaxed); k < n_items;) {
        const AttnItem& it = items[order[k]];
        const bool ahead = is_decode_item(it, G) && k + n_workers < n_items;
        const int64_t k2 = ahead ? next.fetch_add(1, std::memory_order_relaxed) : n_items;
        prefetched = fn(p, it, k2 < n_items ? &items[order[k2]] : nullptr, prefetched, sp);
        k = ahead ? k2 : next.fetch_add(1, std::memory_order_relaxed);
      }
    }
  });
}

bool has_cuda() {
#ifdef CBSERVE_WITH_CUDA
  return true;
#else
  return false;
#endif
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "cbserve native paged-KV-cache kernels (CPU, and CUDA when built with it)";
  m.def("reshape_and_cache", &reshape_and_cache, py::arg("key"), py::arg("value"), py::arg("key_cache"),
        py::arg("value_cache"), py::arg("slot_mapping"));
  m.def("paged_attention", &paged_attention, py::arg("out"), py::arg("query"), py::arg("key_cache"),
        py::arg("value_cache"), py::arg("block_tables"), py::arg("cu_seqlens_q"), py::arg("seq_lens"), py::arg("scale"),
        py::arg("sliding_window") = 0, py::arg("softcap") = 0.0);
  m.def("has_cuda", &has_cuda);
  m.def("cpu_features", &cpu_features);
  m.def("set_isa", &set_isa, py::arg("isa"));
  cbserve_native::register_gpu_ops(m);
}
