// Software prefetch of decode K/V rows, issued a little at a time from inside
// the compute loops of the decode kernels (attn_body.h and the ISA group
// kernels). Issued as one burst, hundreds of prefetches wait for line fill
// buffers and stall the core, so the KV stream and the arithmetic take turns;
// spread over the loops, the next chunk's rows stream in while this chunk's
// scores, softmax and P.V run.
//
// A kernel that visits the tokens in several passes of query rows steps the
// item's prefetcher in its first pass only and hands the others an idle one
// (NoPrefetch, whose step() compiles to nothing): each step costs a few
// scalar instructions inside the tightest loops, and the per-step quota
// assumes one step per token and loop.
//
// Internal linkage on purpose: each ISA translation unit gets its own copy.
#pragma once

#include <cstdint>

namespace {

struct KvPrefetch {
  const char* kc = nullptr;       // key cache base
  const char* vc = nullptr;       // value cache base (same layout)
  const int64_t* offs = nullptr;  // element offsets of the rows to fetch
  int64_t n = 0;                  // rows left to fetch: [t, n)
  int64_t es = 2;                 // element size in bytes
  int64_t rowb = 0;               // bytes per row (all heads of the item)
  int64_t per = 1;                // cache lines (of K and of V each) per step()
  int64_t t = 0, b = 0;           // next row, byte within it

  void reset(const int64_t* o, int64_t rows, int64_t lines_per_step) {
    offs = o;
    n = rows;
    per = lines_per_step < 1 ? 1 : lines_per_step;
    t = 0;
    b = 0;
  }
  // Called once per token a kernel visits.
  inline void step() {
    for (int64_t i = 0; i < per && t < n; ++i) {
      const int64_t o = offs[t] * es + b;
      // Into L2 (prefetcht1): faster than L1 prefetches on a model-sized
      // decode step whose KV comes from DRAM.
      __builtin_prefetch(kc + o, 0, 2);
      __builtin_prefetch(vc + o, 0, 2);
      b += 64;
      if (b >= rowb) b = 0, ++t;
    }
  }
  // Whatever the loops did not get to.
  void finish() {
    per = 1;
    while (t < n) step();
  }
};

struct NoPrefetch {
  inline void step() {}
};

}  // namespace
