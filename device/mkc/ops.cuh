// mkc device library: the fused operations the generated program calls
// (generated/*/program.cuh), one function per task kind, and the row-local
// epilogue steps a projection's generated code chains after its rows.
//
// Conventions. Consumers are threads 0..255 (warps 0-7) and synchronise on
// named barrier 3 (`consumer_sync`). Activations are [batch, elements]
// row-major; weights row-major [rows, k]. Accumulation is fp32; values that
// cross operations (activations, type T) are kept in fp32 by the generated
// programs (a few KB per token: exact enough to follow an fp32 reference
// through routing decisions), or bf16.
#pragma once

#include <cuda_bf16.h>

#include <climits>
#include <cstdint>

#include "projection.cuh"

namespace mkc {

constexpr int kConsumerThreads = kConsumerWarps * 32;
// Shared memory beside the page ring, for attention, experts and routing
// (src/plan/specialize.rs, SCRATCH_BYTES), then the projection's staged
// activations (ACTIVATION_BYTES).
constexpr int kScratchBytes = 24 << 10;
constexpr int kActivationBytes = 64 << 10;

// Everything a step reads and writes, as the runtime resolved it.
struct Memory {
  void* const* w;         // weight tensors, in weights.h order
  char* arena;            // values crossing operations (the plan's buffers)
  void* const* state;     // per-sequence state (KV caches), [batch, ...] each
  void* const* out;       // graph outputs, [batch, ...] each
  const int32_t* tokens;  // [batch] the tokens of this step
  const int32_t* pos;     // [batch] tokens already in each sequence
  float* staging;         // fp32 projection tiles, one slice per SM
};

// One plan task: its stage, its index in the stage, and what part of the
// operation it computes (src/plan/tile.rs, Task::args).
struct TaskArgs {
  uint16_t stage;
  uint16_t index;
  uint32_t a[4];
};

__device__ __forceinline__ void consumer_sync() { asm volatile("bar.sync 3, %0;" ::"r"(kConsumerThreads) : "memory"); }

__device__ inline unsigned char* scratch_ptr() {
  extern __shared__ __align__(128) unsigned char mkc_smem[];
  return mkc_smem + sizeof(Ring);
}
__device__ inline float* activation_ptr() { return reinterpret_cast<float*>(scratch_ptr() + kScratchBytes); }

__device__ __forceinline__ float bf(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
template <class T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16(v);
}

__device__ __forceinline__ float2 load_pair(const float* p) { return *reinterpret_cast<const float2*>(p); }
__device__ __forceinline__ float2 load_pair(const __nv_bfloat16* p) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(p));
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int off = 16; off > 0; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int off = 16; off > 0; off /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}

// Sum over all consumer threads; every consumer gets the result.
__device__ inline float block_sum(float v) {
  __shared__ float part[kConsumerWarps];
  __shared__ float total;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  v = warp_sum(v);
  if (lane == 0) part[warp] = v;
  consumer_sync();
  if (threadIdx.x == 0) {
    float s = 0.f;
    for (int w = 0; w < kConsumerWarps; ++w) s += part[w];
    total = s;
  }
  consumer_sync();
  const float r = total;
  consumer_sync();
  return r;
}

// Dot product of a bf16 row with a bf16 or fp32 vector over n elements
// (n a multiple of 8; bf16 rows 16-byte aligned), one warp.
__device__ inline float warp_dot(const __nv_bfloat16* w, const __nv_bfloat16* x, uint32_t n) {
  const int lane = threadIdx.x % 32;
  float acc = 0.f;
  for (uint32_t e = lane * 8; e < n; e += 256) {
    const uint4 wv = *reinterpret_cast<const uint4*>(w + e);
    const uint4 xv = *reinterpret_cast<const uint4*>(x + e);
    const __nv_bfloat162* w2 = reinterpret_cast<const __nv_bfloat162*>(&wv);
    const __nv_bfloat162* x2 = reinterpret_cast<const __nv_bfloat162*>(&xv);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 a = __bfloat1622float2(w2[j]), b = __bfloat1622float2(x2[j]);
      acc = fmaf(a.x, b.x, fmaf(a.y, b.y, acc));
    }
  }
  return warp_sum(acc);
}
__device__ inline float warp_dot(const __nv_bfloat16* w, const float* x, uint32_t n) {
  const int lane = threadIdx.x % 32;
  float acc = 0.f;
  for (uint32_t e = lane * 8; e < n; e += 256) {
    const uint4 wv = *reinterpret_cast<const uint4*>(w + e);
    const __nv_bfloat162* w2 = reinterpret_cast<const __nv_bfloat162*>(&wv);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 a = __bfloat1622float2(w2[j]);
      acc = fmaf(a.x, x[e + 2 * j], fmaf(a.y, x[e + 2 * j + 1], acc));
    }
  }
  return warp_sum(acc);
}

// ---------------------------------------------------------------------------
// Embedding: out[b] = table[tokens[b]].
template <int B, class T>
__device__ void embedding(const __nv_bfloat16* table, const int32_t* tokens, uint32_t hidden, T* out) {
  for (uint32_t i = threadIdx.x; i < B * hidden; i += kConsumerThreads) {
    const uint32_t b = i / hidden, e = i % hidden;
    out[i] = from_float<T>(bf(table[size_t(tokens[b]) * hidden + e]));
  }
}

// ---------------------------------------------------------------------------
// Projection rows: `Rows` and the loader's `rows_load` are in projection.cuh.

// Four consecutive activations x[b, e..e+3] as fp32 (e a multiple of 4).
__device__ __forceinline__ float4 load_four(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ float4 load_four(const __nv_bfloat16* p) {
  const uint2 raw = *reinterpret_cast<const uint2*>(p);
  const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.x));
  const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.y));
  return make_float4(lo.x, lo.y, hi.x, hi.y);
}

// The end of a row block: the lanes' partial sums acc[j][b] reduced over the
// warp (shuffles), then over the warps through `part` [warps][kPageRows B] in
// a fixed order (the result does not depend on timing), into st [B, cols]
// at columns j0 + j. One consumer barrier; callers alternate `part` between
// row blocks so the next block's writes cannot overtake this one's reads.
template <int B>
__device__ __forceinline__ void reduce_row_block(float (&acc)[kPageRows][B], float (*part)[kPageRows * B],
                                                 uint32_t nr, uint32_t cols, uint32_t j0, int warp, float* st) {
  const int lane = threadIdx.x % 32;
  float* mine = part[warp];
#pragma unroll
  for (int j = 0; j < kPageRows; ++j) {
#pragma unroll
    for (int b = 0; b < B; ++b) {
      const float v = warp_sum(acc[j][b]);
      if (lane == 0) mine[j * B + b] = v;
    }
  }
  consumer_sync();
  for (uint32_t i = threadIdx.x; i < nr * B; i += kConsumerThreads) {
    float v = 0.f;
#pragma unroll
    for (int w = 0; w < kConsumerWarps; ++w) v += part[w][i];
    const uint32_t j = i / B, b = i % B;
    st[size_t(b) * cols + j0 + j] = v;
  }
}

// The page loop of rows_compute: rows of y = x' W^T into st [B, cols], x'
// = x, or x * scale[b] * norm when `norm` is given. A page holds kPageRows
// rows of up to kPageK weights; warp w takes columns [128 w, 128 w + 128) of
// every row of the page, four per lane, so each activation a lane loads
// serves all rows of the page. After a row block's last page the lanes'
// partial sums are reduced over the warp (shuffles), then over the warps
// (shared memory, in a fixed order: the result does not depend on timing).
template <int B, class T>
__device__ void rows_pages(const Rows& r, const T* x, const __nv_bfloat16* norm, const float* scale, uint32_t& it,
                           int warp, float* st) {
  static_assert(kPageK == kConsumerWarps * 128, "a warp covers 128 columns of a page");
  const int lane = threadIdx.x % 32;
  __shared__ float part[2][kConsumerWarps][kPageRows * B];  // per row block parity
  const uint32_t cols = r.cols();
  const uint32_t e = uint32_t(warp) * 128 + uint32_t(lane) * 4;  // this lane's columns within a page
  for (uint32_t j0 = 0, block = 0; j0 < cols; j0 += kPageRows, ++block) {
    const uint32_t nr = min(uint32_t(kPageRows), cols - j0);
    float acc[kPageRows][B] = {};
    for (uint32_t k0 = 0; k0 < r.k; k0 += kPageK, ++it) {
      const uint32_t nk = min(uint32_t(kPageK), r.k - k0);
      const int slot = it % kPages;
      Barrier::wait(&ring_ptr()->full[slot], (it / kPages) & 1);
      if (e < nk) {
        float4 xv[B];
        float4 g = make_float4(1.f, 1.f, 1.f, 1.f);
        if (norm != nullptr) g = load_four(norm + k0 + e);
#pragma unroll
        for (int b = 0; b < B; ++b) {
          xv[b] = load_four(x + size_t(b) * r.k + k0 + e);
          if (norm != nullptr) {
            const float sb = scale[b];
            xv[b] = make_float4(xv[b].x * sb * g.x, xv[b].y * sb * g.y, xv[b].z * sb * g.z, xv[b].w * sb * g.w);
          }
        }
        const __nv_bfloat16* page = ring_ptr()->page[slot];
#pragma unroll
        for (int j = 0; j < kPageRows; ++j) {
          if (uint32_t(j) >= nr) break;
          const float4 w = load_four(page + j * kPageK + e);
#pragma unroll
          for (int b = 0; b < B; ++b) {
            acc[j][b] = fmaf(w.x, xv[b].x, fmaf(w.y, xv[b].y, fmaf(w.z, xv[b].z, fmaf(w.w, xv[b].w, acc[j][b]))));
          }
        }
      }
      release_page(&ring_ptr()->empty[slot]);
    }
    reduce_row_block<B>(acc, part[block & 1], nr, cols, j0, warp, st);
  }
}

// Copies x [B, k] into the shared-memory activation area as fp32, RMS-normed
// there (x * rsqrt(mean(x^2) + eps) * norm, per token) when `norm` is given;
// returns it, complete for every consumer. The caller checks that it fits.
template <int B, class T>
__device__ float* stage_input(const T* x, uint32_t k, const __nv_bfloat16* norm, float eps) {
  __shared__ float scale[B];
  const uint32_t n = uint32_t(B) * k;
  float* xs = activation_ptr();
  for (uint32_t i = threadIdx.x * 4; i < n; i += kConsumerThreads * 4) {
    *reinterpret_cast<float4*>(xs + i) = load_four(x + i);
  }
  if (norm != nullptr) {
    consumer_sync();
    for (int b = 0; b < B; ++b) {
      float ss = 0.f;
      for (uint32_t e = threadIdx.x; e < k; e += kConsumerThreads) ss = fmaf(xs[b * k + e], xs[b * k + e], ss);
      ss = block_sum(ss);
      if (threadIdx.x == 0) scale[b] = rsqrtf(ss / float(k) + eps);
    }
    consumer_sync();
    for (uint32_t i = threadIdx.x; i < n; i += kConsumerThreads) xs[i] = xs[i] * scale[i / k] * bf(norm[i % k]);
  }
  consumer_sync();
  return xs;
}

// Rows of y = x' W^T into the staging tile st [B, cols] (fp32), the weights
// streamed by rows_load through the page ring; x' = x, or RMSNorm(x) * norm
// when `norm` is given (the prologue; the scale per token computed here from
// x). When x [B, k] fits in kActivationBytes it is first copied to shared
// memory as fp32, normed there, so the pages read it from shared memory
// (otherwise from L2, a round trip per page).
template <int B, class T>
__device__ void rows_compute(const Rows& r, const T* x, const __nv_bfloat16* norm, float eps,
                             uint32_t& it, int warp, float* st) {
  __shared__ float scale[B];
  if (size_t(B) * r.k * sizeof(float) <= size_t(kActivationBytes)) {
    rows_pages<B>(r, stage_input<B>(x, r.k, norm, eps), nullptr, nullptr, it, warp, st);
    return;
  }
  if (norm != nullptr) {
    for (int b = 0; b < B; ++b) {
      float ss = 0.f;
      for (uint32_t e = threadIdx.x; e < r.k; e += kConsumerThreads) {
        const float v = to_float(x[size_t(b) * r.k + e]);
        ss = fmaf(v, v, ss);
      }
      ss = block_sum(ss);
      if (threadIdx.x == 0) scale[b] = rsqrtf(ss / float(r.k) + eps);
    }
    consumer_sync();
  }
  rows_pages<B>(r, x, norm, scale, it, warp, st);
}

// ---------------------------------------------------------------------------
// MXFP4 weight rows (K3's routed experts): e2m1 codes, two per byte along a
// row (the low nibble first), and one e8m0 scale byte per 32 elements:
// W[n, k] = e2m1(code) 2^(scale - 127), scale byte 255 read as 0.
struct MxRows {
  const uint8_t* c0;  // codes [rows, k / 2]
  const uint8_t* s0;  // scales [rows, k / 32]
  const uint8_t* c1;  // the paired (up) matrix's, or null
  const uint8_t* s1;
  uint32_t r0, r1, k;
  __device__ uint32_t cols() const { return (r1 - r0) * (c1 != nullptr ? 2 : 1); }
  __device__ const uint8_t* codes(uint32_t j) const {
    const uint32_t n = r1 - r0;
    return j < n ? c0 + size_t(r0 + j) * (k / 2) : c1 + size_t(r0 + j - n) * (k / 2);
  }
  __device__ const uint8_t* scales(uint32_t j) const {
    const uint32_t n = r1 - r0;
    return j < n ? s0 + size_t(r0 + j) * (k / 32) : s1 + size_t(r0 + j - n) * (k / 32);
  }
};

// A page holds the codes of kPageRows rows for kMxK elements (1 KiB a row);
// the consumers read the scales from global memory, a page ahead.
constexpr uint32_t kMxK = 2048;

__device__ __forceinline__ float e2m1(uint32_t c) {
  const uint32_t m = c & 1u, e = (c >> 1) & 3u;
  const float v = e == 0 ? 0.5f * float(m) : __int_as_float(int((e + 126u) << 23)) * (1.f + 0.5f * float(m));
  return (c & 8u) ? -v : v;
}
__device__ __forceinline__ float e8m0(uint32_t byte) { return byte == 255u ? 0.f : ldexpf(1.f, int(byte) - 127); }

// Loader: the codes of a task's rows into the page ring.
__device__ inline void mx_rows_load(const MxRows& r, uint32_t& it) {
  const int lane = threadIdx.x % 32;
  const uint32_t cols = r.cols();
  for (uint32_t j0 = 0; j0 < cols; j0 += kPageRows) {
    const uint32_t nr = min(uint32_t(kPageRows), cols - j0);
    for (uint32_t k0 = 0; k0 < r.k; k0 += kMxK, ++it) {
      const uint32_t bytes = min(kMxK, r.k - k0) / 2;
      const int slot = it % kPages;
      if (lane == 0) {
        Barrier::wait(&ring_ptr()->empty[slot], ((it / kPages) & 1) ^ 1);
        Barrier::arrive_and_expect_tx(&ring_ptr()->full[slot], nr * bytes);
        auto* page = reinterpret_cast<uint8_t*>(ring_ptr()->page[slot]);
        for (uint32_t j = 0; j < nr; ++j) {
          cute::SM90_BULK_COPY_G2S::copy(r.codes(j0 + j) + k0 / 2, &ring_ptr()->full[slot], page + j * (kMxK / 2),
                                         int32_t(bytes));
        }
      }
      __syncwarp();
    }
  }
}

// Consumers: rows of y = x W^T into st [B, cols] (x fp32 [B, k], in shared
// memory or global). Warp w takes elements [256 w, 256 w + 256) of each row
// chunk, eight per lane (four code bytes, one scale).
template <int B>
__device__ void mx_rows_pages(const MxRows& r, const float* x, uint32_t& it, int warp, float* st) {
  const int lane = threadIdx.x % 32;
  __shared__ float part[2][kConsumerWarps][kPageRows * B];
  const uint32_t cols = r.cols();
  const uint32_t chunks = (r.k + kMxK - 1) / kMxK;
  const uint32_t blocks = (cols + kPageRows - 1) / kPageRows;
  const uint32_t e = uint32_t(warp) * 256 + uint32_t(lane) * 8;  // this lane's elements within a chunk
  // The scales of page q (row block q / chunks, chunk q % chunks), one per row.
  auto scales = [&](uint32_t q, float (&sc)[kPageRows]) {
    const uint32_t j0 = (q / chunks) * kPageRows, k0 = (q % chunks) * kMxK;
    const uint32_t nr = min(uint32_t(kPageRows), cols - j0), nk = min(kMxK, r.k - k0);
#pragma unroll
    for (int j = 0; j < kPageRows; ++j) sc[j] = (uint32_t(j) < nr && e < nk) ? e8m0(r.scales(j0 + j)[(k0 + e) / 32]) : 0.f;
  };
  float next[kPageRows];
  if (blocks > 0) scales(0, next);
  for (uint32_t blk = 0; blk < blocks; ++blk) {
    const uint32_t j0 = blk * kPageRows, nr = min(uint32_t(kPageRows), cols - j0);
    float acc[kPageRows][B] = {};
    for (uint32_t ch = 0; ch < chunks; ++ch, ++it) {
      const uint32_t q = blk * chunks + ch, k0 = ch * kMxK, nk = min(kMxK, r.k - k0);
      float sc[kPageRows];
#pragma unroll
      for (int j = 0; j < kPageRows; ++j) sc[j] = next[j];
      if (q + 1 < blocks * chunks) scales(q + 1, next);
      const int slot = it % kPages;
      Barrier::wait(&ring_ptr()->full[slot], (it / kPages) & 1);
      if (e < nk) {
        float xv[B][8];
#pragma unroll
        for (int b = 0; b < B; ++b) {
          const float4 a = load_four(x + size_t(b) * r.k + k0 + e), c = load_four(x + size_t(b) * r.k + k0 + e + 4);
          xv[b][0] = a.x, xv[b][1] = a.y, xv[b][2] = a.z, xv[b][3] = a.w;
          xv[b][4] = c.x, xv[b][5] = c.y, xv[b][6] = c.z, xv[b][7] = c.w;
        }
        const auto* page = reinterpret_cast<const uint8_t*>(ring_ptr()->page[slot]);
#pragma unroll
        for (int j = 0; j < kPageRows; ++j) {
          if (uint32_t(j) >= nr) break;
          const uint32_t codes = *reinterpret_cast<const uint32_t*>(page + j * (kMxK / 2) + e / 2);
#pragma unroll
          for (int u = 0; u < 8; ++u) {
            const float wv = e2m1(codes >> (4 * u)) * sc[j];
#pragma unroll
            for (int b = 0; b < B; ++b) acc[j][b] = fmaf(wv, xv[b][u], acc[j][b]);
          }
        }
      }
      release_page(&ring_ptr()->empty[slot]);
    }
    reduce_row_block<B>(acc, part[blk & 1], nr, cols, j0, warp, st);
  }
  (void)lane;
}

// MXFP4 rows of y = x' W^T, x' = x or RMSNorm(x) * norm, the input staged in
// shared memory when it fits (as rows_compute).
template <int B, class T>
__device__ void mx_rows_compute(const MxRows& r, const T* x, const __nv_bfloat16* norm, float eps, uint32_t& it,
                                int warp, float* st) {
  if (size_t(B) * r.k * sizeof(float) > size_t(kActivationBytes)) __trap();  // checked at codegen
  mx_rows_pages<B>(r, stage_input<B>(x, r.k, norm, eps), it, warp, st);
}

// ---------------------------------------------------------------------------
// Epilogue steps on the staging tile st [B, n]. A Span says which part of a
// value the tile holds: tile columns [c0, c0 + len) are its elements
// [e0, e0 + len). A step whose span is empty does nothing.
struct Span {
  uint32_t c0, e0, len;
};

// The span of linear `node`'s output in task t (its rows [a2, a3)).
__device__ inline Span linear_span(const TaskArgs& t, uint32_t node) {
  return t.a[0] == node ? Span{0, t.a[2], t.a[3] - t.a[2]} : Span{0, 0, 0};
}

// The span of elements [off, off + size) of a value, as a value of its own.
__device__ inline Span sub_span(Span s, uint32_t off, uint32_t size) {
  const uint32_t lo = max(s.e0, off), hi = min(s.e0 + s.len, off + size);
  if (s.len == 0 || hi <= lo) return Span{0, 0, 0};
  return Span{s.c0 + lo - s.e0, lo - off, hi - lo};
}

// gate = silu(gate) * up, the up rows at tile columns [n/2, n).
template <int B>
__device__ void ep_silu_and_mul(float* st, uint32_t n, Span g) {
  const uint32_t half = n / 2;
  for (uint32_t i = threadIdx.x; i < B * g.len; i += kConsumerThreads) {
    const uint32_t b = i / g.len, c = g.c0 + i % g.len;
    const float x = st[b * n + c], u = st[b * n + half + c];
    st[b * n + c] = x / (1.f + expf(-x)) * u;
  }
}

// gate = SiTU-GLU of (gate, up), K3's activation, the up rows at tile
// columns [n/2, n): beta tanh(gate/beta) sigmoid(gate) * lin tanh(up/lin),
// the up branch the identity when lin <= 0 (no linear beta configured).
__device__ __forceinline__ float situ_glu(float x, float u, float beta, float lin) {
  const float g = beta * tanhf(x / beta) / (1.f + expf(-x));
  return g * (lin > 0.f ? lin * tanhf(u / lin) : u);
}
template <int B>
__device__ void ep_situ_and_mul(float* st, uint32_t n, Span g, float beta, float lin) {
  const uint32_t half = n / 2;
  for (uint32_t i = threadIdx.x; i < B * g.len; i += kConsumerThreads) {
    const uint32_t b = i / g.len, c = g.c0 + i % g.len;
    st[b * n + c] = situ_glu(st[b * n + c], st[b * n + half + c], beta, lin);
  }
}

// A bank with one more row, the new row being the tile's span s (K3's block
// snapshot): for the span's columns, bank_new [B][rows + 1][hidden] takes
// bank [B][rows][hidden] and then the tile's values.
template <int B, class T>
__device__ void ep_stack(const float* st, uint32_t n, Span s, const T* bank, uint32_t rows, uint32_t hidden,
                         T* bank_new) {
  for (uint32_t i = threadIdx.x; i < B * (rows + 1) * s.len; i += kConsumerThreads) {
    const uint32_t b = i / ((rows + 1) * s.len), j = (i / s.len) % (rows + 1), c = i % s.len, e = s.e0 + c;
    bank_new[(size_t(b) * (rows + 1) + j) * hidden + e] =
        j < rows ? bank[(size_t(b) * rows + j) * hidden + e] : from_float<T>(st[b * n + s.c0 + c]);
  }
}

template <int B, class T>
__device__ void ep_add(float* st, uint32_t n, Span s, const T* other, uint32_t len) {
  for (uint32_t i = threadIdx.x; i < B * s.len; i += kConsumerThreads) {
    const uint32_t b = i / s.len, j = i % s.len;
    st[b * n + s.c0 + j] += to_float(other[size_t(b) * len + s.e0 + j]);
  }
}

// RoPE of the last `rot` values of each head (whole heads in the span), at
// each sequence's position; interleaved pairs (2i, 2i+1), else (i, i + rot/2).
template <int B>
__device__ void ep_rope(float* st, uint32_t n, Span s, uint32_t head_dim, uint32_t rot, bool interleaved,
                        const float* inv_freq, float mscale, const int32_t* pos) {
  if (s.len == 0) return;
  if (s.e0 % head_dim != 0 || s.len % head_dim != 0) __trap();  // the tiler aligns tiles to heads
  const uint32_t heads = s.len / head_dim, half = rot / 2;
  for (uint32_t i = threadIdx.x; i < B * heads * half; i += kConsumerThreads) {
    const uint32_t b = i / (heads * half), h = (i / half) % heads, p = i % half;
    const uint32_t base = b * n + s.c0 + h * head_dim + head_dim - rot;
    const uint32_t ia = interleaved ? base + 2 * p : base + p;
    const uint32_t ib = interleaved ? ia + 1 : ia + half;
    const float angle = float(pos[b]) * inv_freq[p];
    const float c = cosf(angle) * mscale, sn = sinf(angle) * mscale;
    const float xa = st[ia], xb = st[ib];
    st[ia] = xa * c - xb * sn;
    st[ib] = xb * c + xa * sn;
  }
}

// RMSNorm of a whole value (the tiler keeps it in one task).
template <int B>
__device__ void ep_rms_norm(float* st, uint32_t n, Span s, uint32_t full, const __nv_bfloat16* w, float eps) {
  if (s.len == 0) return;
  if (s.e0 != 0 || s.len != full) __trap();
  for (int b = 0; b < B; ++b) {
    float ss = 0.f;
    for (uint32_t j = threadIdx.x; j < s.len; j += kConsumerThreads) ss = fmaf(st[b * n + s.c0 + j], st[b * n + s.c0 + j], ss);
    const float r = rsqrtf(block_sum(ss) / float(full) + eps);
    for (uint32_t j = threadIdx.x; j < s.len; j += kConsumerThreads) st[b * n + s.c0 + j] *= r * bf(w[j]);
  }
}

// Short causal convolution with state (KDA's q/k/v), on the tile's span s of
// a value with `channels` channels: per channel c and token b,
//   y = act(sum_{j < W-1} w[c, j] state[b, j, c] + w[c, W-1] z),  z = the tile value,
// fp32 weights [channels, 1, W]; then the state shifts by one row, the new z
// (rounded to the state's type) last. State per sequence [W-1, channels],
// sequences `state_stride` elements apart. act: SiLU (1) or none (0).
template <int B, class S>
__device__ void ep_conv_update(float* st, uint32_t n, Span s, const float* w, uint32_t width, S* state,
                               size_t state_stride, uint32_t channels, int silu) {
  for (uint32_t i = threadIdx.x; i < B * s.len; i += kConsumerThreads) {
    const uint32_t b = i / s.len, j = i % s.len, c = s.e0 + j;
    S* sb = state + size_t(b) * state_stride;
    const float z = st[b * n + s.c0 + j];
    float y = w[size_t(c) * width + width - 1] * z;
    for (uint32_t t = 0; t + 1 < width; ++t) y = fmaf(w[size_t(c) * width + t], to_float(sb[size_t(t) * channels + c]), y);
    for (uint32_t t = 0; t + 2 < width; ++t) sb[size_t(t) * channels + c] = sb[size_t(t + 1) * channels + c];
    if (width > 1) sb[size_t(width - 2) * channels + c] = from_float<S>(z);
    st[b * n + s.c0 + j] = silu ? y / (1.f + expf(-y)) : y;
  }
}

// L2 normalisation in groups of `group` channels (KDA's q and k):
// x / sqrt(sum x^2 + eps) per group; the span covers whole groups (the
// planner aligns the tile to them).
template <int B>
__device__ void ep_l2_norm(float* st, uint32_t n, Span s, uint32_t group, float eps) {
  if (s.len == 0) return;
  if (s.e0 % group != 0 || s.len % group != 0) __trap();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const uint32_t groups = s.len / group;
  for (uint32_t gi = warp; gi < B * groups; gi += kConsumerWarps) {
    float* x = st + (gi / groups) * n + s.c0 + (gi % groups) * group;
    float ss = 0.f;
    for (uint32_t j = lane; j < group; j += 32) ss = fmaf(x[j], x[j], ss);
    const float r = rsqrtf(warp_sum(ss) + eps);
    for (uint32_t j = lane; j < group; j += 32) x[j] *= r;
  }
}

// Sigmoid on the span.
template <int B>
__device__ void ep_sigmoid(float* st, uint32_t n, Span s) {
  for (uint32_t i = threadIdx.x; i < B * s.len; i += kConsumerThreads) {
    float& x = st[(i / s.len) * n + s.c0 + i % s.len];
    x = 1.f / (1.f + expf(-x));
  }
}

template <int B, class T>
__device__ void ep_store(const float* st, uint32_t n, Span s, T* dst, uint32_t len) {
  for (uint32_t i = threadIdx.x; i < B * s.len; i += kConsumerThreads) {
    const uint32_t b = i / s.len, j = i % s.len;
    dst[size_t(b) * len + s.e0 + j] = from_float<T>(st[b * n + s.c0 + j]);
  }
}

// Per token, the tile's largest value and its index (the lowest on ties).
template <int B>
__device__ void ep_tile_max(const float* st, uint32_t n, Span s, float2* out, uint32_t tile, uint32_t tiles) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int b = warp; b < B; b += kConsumerWarps) {
    float best = -INFINITY;
    uint32_t at = 0xffffffffu;
    for (uint32_t j = lane; j < s.len; j += 32) {
      const float v = st[b * n + s.c0 + j];
      if (v > best) best = v, at = s.e0 + j;
    }
    for (int off = 16; off > 0; off /= 2) {
      const float ob = __shfl_xor_sync(0xffffffffu, best, off);
      const uint32_t oa = __shfl_xor_sync(0xffffffffu, at, off);
      if (ob > best || (ob == best && oa < at)) best = ob, at = oa;
    }
    if (lane == 0) out[b * tiles + tile] = make_float2(best, __uint_as_float(at));
  }
}

template <int B>
__device__ void argmax_tiles(const float2* tm, uint32_t tiles, int32_t* next) {
  if (threadIdx.x >= B) return;
  const int b = threadIdx.x;
  float best = -INFINITY;
  uint32_t at = 0;
  for (uint32_t t = 0; t < tiles; ++t) {
    const float2 v = tm[b * tiles + t];
    const uint32_t idx = __float_as_uint(v.y);
    if (v.x > best || (v.x == best && idx < at)) best = v.x, at = idx;
  }
  next[b] = int32_t(at);
}

// ---------------------------------------------------------------------------
// Weight-absorbed MLA decode. Per token b, head h: q = [q_nope (nope) | q_pe
// (rope)], the cache row p = [c_kv (c) | k_pe (rope)], kv_b_proj rows per head
// [W_UK (nope rows) | W_UV (v_dim rows)] of width c. Score_p = scale (q_nope
// W_UK . c_kv_p + q_pe . k_pe_p); out = W_UV sum_p softmax_p c_kv_p.
// Heads per MLA task the split keeps in registers (the codegen checks).
constexpr uint32_t kMaxMlaHeads = 8;

struct MlaShape {
  uint32_t heads, hpt, groups, splits;
  uint32_t ctx, c, nope, rope, v_dim;
  float scale;
};

__device__ inline void split_range(const MlaShape& s, uint32_t split, uint32_t& p0, uint32_t& p1) {
  const uint32_t base = s.ctx / s.splits, rem = s.ctx % s.splits;
  p0 = split * base + min(split, rem);
  p1 = p0 + base + (split < rem ? 1 : 0);
}

// The cache rows a split task streams through the page ring for token b:
// the split's positions before the current one (the current row is written
// by the step itself and taken from shared memory instead).
__device__ inline Rows mla_cache_rows(const MlaShape& s, uint32_t split, const __nv_bfloat16* cache, int b,
                                      uint32_t p_now) {
  uint32_t p0, p1;
  split_range(s, split, p0, p1);
  const uint32_t end = max(p0, min(p1, p_now));
  return Rows{cache + size_t(b) * s.ctx * (s.c + s.rope), nullptr, p0, end, s.c + s.rope};
}

// Cache rows are contiguous: a page holds as many whole rows as fit (14 of
// K2's 576-element rows), packed, one bulk copy per page.
constexpr uint32_t kMaxPackedRows = 16;
__device__ inline uint32_t packed_rows(uint32_t row) { return min(kMaxPackedRows, uint32_t(kPageBytes) / (2 * row)); }

// Loader side of a split task: its cache rows, token by token, packed pages.
template <int B>
__device__ void mla_split_load(const MlaShape& s, uint32_t split, const __nv_bfloat16* cache, const int32_t* pos,
                               uint32_t& it) {
  const int lane = threadIdx.x % 32;
  const uint32_t per = packed_rows(s.c + s.rope);
  for (int b = 0; b < B; ++b) {
    const Rows r = mla_cache_rows(s, split, cache, b, uint32_t(pos[b]));
    for (uint32_t j0 = r.r0; j0 < r.r1; j0 += per, ++it) {
      const uint32_t bytes = min(per, r.r1 - j0) * r.k * 2;
      const int slot = it % kPages;
      if (lane == 0) {
        Barrier::wait(&ring_ptr()->empty[slot], ((it / kPages) & 1) ^ 1);
        Barrier::arrive_and_expect_tx(&ring_ptr()->full[slot], bytes);
        cute::SM90_BULK_COPY_G2S::copy(r.row(j0 - r.r0), &ring_ptr()->full[slot], ring_ptr()->page[slot], int32_t(bytes));
      }
      __syncwarp();
    }
  }
}

// Online-softmax state of a split task's heads, in shared memory.
struct MlaRunning {
  float score[2][kMaxMlaHeads][kMaxPackedRows];  // by page parity
  float prob[2][kMaxMlaHeads][kMaxPackedRows];
  float rescale[2][kMaxMlaHeads];
  float max[kMaxMlaHeads], sum[kMaxMlaHeads];
};

// Folds n (<= kMaxPackedRows) cache rows into the running attention of the
// nh heads: scores (a warp per row, 16-byte chunks of the row for every head),
// then the new maximum, probabilities and rescale per head (a thread per
// head), then the weighted latent sums (a thread per pair of latent columns,
// acc[h] rescaled once per page). Two consumer barriers; the shared arrays
// alternate by `parity` so the next page may start before every thread has
// read this one's probabilities.
__device__ inline void mla_fold_rows(const MlaShape& s, uint32_t nh, const __nv_bfloat16* rows, uint32_t stride,
                                     uint32_t n, const float* qlat, const float* qpe, MlaRunning& run, int parity,
                                     float (&acc)[kMaxMlaHeads][2]) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const uint32_t row = s.c + s.rope;
  for (uint32_t jr = warp; jr < n; jr += kConsumerWarps) {
    const __nv_bfloat16* r = rows + size_t(jr) * stride;
    float dot[kMaxMlaHeads] = {};
    for (uint32_t j = lane * 8; j < row; j += 256) {
      const uint4 raw = *reinterpret_cast<const uint4*>(r + j);
      const __nv_bfloat162* r2 = reinterpret_cast<const __nv_bfloat162*>(&raw);
      float kv[8];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const float2 f = __bfloat1622float2(r2[u]);
        kv[2 * u] = f.x, kv[2 * u + 1] = f.y;
      }
#pragma unroll
      for (uint32_t h = 0; h < kMaxMlaHeads; ++h) {
        if (h >= nh) break;
        const float* qv = j < s.c ? qlat + h * s.c + j : qpe + h * s.rope + (j - s.c);
#pragma unroll
        for (int u = 0; u < 8; ++u) dot[h] = fmaf(qv[u], kv[u], dot[h]);
      }
    }
#pragma unroll
    for (uint32_t h = 0; h < kMaxMlaHeads; ++h) {
      if (h >= nh) break;
      const float v = warp_sum(dot[h]);
      if (lane == 0) run.score[parity][h][jr] = v * s.scale;
    }
  }
  consumer_sync();
  if (threadIdx.x < nh) {
    const uint32_t h = threadIdx.x;
    float m = run.max[h];
    for (uint32_t j = 0; j < n; ++j) m = fmaxf(m, run.score[parity][h][j]);
    const float rescale = expf(run.max[h] - m);  // 0 on the first rows (max -inf)
    float l = run.sum[h] * rescale;
    for (uint32_t j = 0; j < n; ++j) {
      const float e = expf(run.score[parity][h][j] - m);
      run.prob[parity][h][j] = e;
      l += e;
    }
    run.max[h] = m;
    run.sum[h] = l;
    run.rescale[parity][h] = rescale;
  }
  consumer_sync();
  const uint32_t pair = threadIdx.x;  // c <= 2 * kConsumerThreads (checked at codegen)
  if (pair < s.c / 2) {
#pragma unroll
    for (uint32_t h = 0; h < kMaxMlaHeads; ++h) {
      if (h >= nh) break;
      acc[h][0] *= run.rescale[parity][h];
      acc[h][1] *= run.rescale[parity][h];
    }
    for (uint32_t j = 0; j < n; ++j) {
      const float2 kv = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(rows + size_t(j) * stride + 2 * pair));
#pragma unroll
      for (uint32_t h = 0; h < kMaxMlaHeads; ++h) {
        if (h >= nh) break;
        const float p = run.prob[parity][h][j];
        acc[h][0] = fmaf(p, kv.x, acc[h][0]);
        acc[h][1] = fmaf(p, kv.y, acc[h][1]);
      }
    }
  }
}

// One (head group, KV split) task: partials [B, heads, splits, 2 + c] of
// (max, sum of exp, sum of exp * c_kv), by online softmax over the split's
// cache rows, which the loader streams through the page ring
// (mla_split_load), then the current row. The split holding the current
// position appends the new row to the cache (head group 0 writes it; the
// others use their own copy in shared memory).
template <int B, class T>
__device__ void mla_split(const MlaShape& s, uint32_t hg, uint32_t split, const T* q, const T* ckv_raw,
                          const __nv_bfloat16* norm, float eps, const T* kpe, const __nv_bfloat16* wkvb,
                          __nv_bfloat16* cache, const int32_t* pos, float* partials, uint32_t& it) {
  const uint32_t h0 = hg * s.hpt, nh = min(s.hpt, s.heads - h0);
  const uint32_t qk = s.nope + s.rope, row = s.c + s.rope;
  uint32_t p0, p1;
  split_range(s, split, p0, p1);
  float* qlat = reinterpret_cast<float*>(scratch_ptr());  // [hpt, c]
  float* qpe = qlat + s.hpt * s.c;                         // [hpt, rope]
  float* qn = qpe + s.hpt * s.rope;                        // [hpt, nope]
  __nv_bfloat16* cur = reinterpret_cast<__nv_bfloat16*>(qn + s.hpt * s.nope);  // [c + rope], 16-byte aligned
  __shared__ MlaRunning run;
  int parity = 0;
  for (int b = 0; b < B; ++b) {
    const uint32_t p_now = uint32_t(pos[b]);
    const bool has_now = p0 <= p_now && p_now < p1;
    if (has_now) {
      float ss = 0.f;
      for (uint32_t j = threadIdx.x; j < s.c; j += kConsumerThreads) {
        const float v = to_float(ckv_raw[size_t(b) * s.c + j]);
        ss = fmaf(v, v, ss);
      }
      const float r = norm != nullptr ? rsqrtf(block_sum(ss) / float(s.c) + eps) : 1.f;
      __nv_bfloat16* dst = cache + (size_t(b) * s.ctx + p_now) * row;
      for (uint32_t j = threadIdx.x; j < row; j += kConsumerThreads) {
        float v;
        if (j < s.c) {
          v = to_float(ckv_raw[size_t(b) * s.c + j]);
          if (norm != nullptr) v = v * r * bf(norm[j]);
        } else {
          v = to_float(kpe[size_t(b) * s.rope + j - s.c]);
        }
        const __nv_bfloat16 stored = __float2bfloat16(v);
        cur[j] = stored;
        if (hg == 0) dst[j] = stored;
      }
    }
    // q absorbed into the latent space: qlat[h] = q_nope[h] W_UK[h], W_UK[h]
    // the first nope rows of head h's block of kv_b [heads (nope + v), c].
    // A thread takes eight latent columns of a head and reads W_UK in
    // 16-byte chunks, eight rows in flight.
    for (uint32_t i = threadIdx.x; i < nh * s.nope; i += kConsumerThreads) {
      const uint32_t h = i / s.nope, n = i % s.nope;
      qn[i] = to_float(q[size_t(b) * s.heads * qk + size_t(h0 + h) * qk + n]);
    }
    for (uint32_t i = threadIdx.x; i < nh * s.rope; i += kConsumerThreads) {
      const uint32_t h = i / s.rope, r = i % s.rope;
      qpe[i] = to_float(q[size_t(b) * s.heads * qk + size_t(h0 + h) * qk + s.nope + r]);
    }
    if (threadIdx.x < kMaxMlaHeads) run.max[threadIdx.x] = -INFINITY, run.sum[threadIdx.x] = 0.f;
    consumer_sync();
    for (uint32_t u = threadIdx.x; u < nh * (s.c / 8); u += kConsumerThreads) {
      const uint32_t h = u / (s.c / 8), c8 = (u % (s.c / 8)) * 8;
      const __nv_bfloat16* w = wkvb + size_t(h0 + h) * (s.nope + s.v_dim) * s.c + c8;
      const float* qh = qn + h * s.nope;
      float a[8] = {};
#pragma unroll 8
      for (uint32_t n = 0; n < s.nope; ++n) {
        const uint4 raw = *reinterpret_cast<const uint4*>(w + size_t(n) * s.c);
        const __nv_bfloat162* w2 = reinterpret_cast<const __nv_bfloat162*>(&raw);
        const float qv = qh[n];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float2 f = __bfloat1622float2(w2[j]);
          a[2 * j] = fmaf(qv, f.x, a[2 * j]);
          a[2 * j + 1] = fmaf(qv, f.y, a[2 * j + 1]);
        }
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) qlat[h * s.c + c8 + j] = a[j];
    }
    consumer_sync();
    float acc[kMaxMlaHeads][2] = {};
    const Rows cr = mla_cache_rows(s, split, cache, b, p_now);
    const uint32_t per = packed_rows(row);
    for (uint32_t j0 = cr.r0; j0 < cr.r1; j0 += per, ++it, parity ^= 1) {
      const int slot = it % kPages;
      Barrier::wait(&ring_ptr()->full[slot], (it / kPages) & 1);
      mla_fold_rows(s, nh, ring_ptr()->page[slot], row, min(per, cr.r1 - j0), qlat, qpe, run, parity, acc);
      release_page(&ring_ptr()->empty[slot]);
    }
    if (has_now) {
      mla_fold_rows(s, nh, cur, row, 1, qlat, qpe, run, parity, acc);
      parity ^= 1;
    }
    const uint32_t pair = threadIdx.x;
    if (pair < s.c / 2) {
      const uint32_t cc = 2 * pair;
#pragma unroll
      for (uint32_t h = 0; h < kMaxMlaHeads; ++h) {
        if (h >= nh) break;
        float* part = partials + ((size_t(b) * s.heads + h0 + h) * s.splits + split) * (2 + s.c);
        part[2 + cc] = acc[h][0];
        part[3 + cc] = acc[h][1];
        if (cc == 0) {
          part[0] = run.max[h];
          part[1] = run.sum[h];
        }
      }
    }
    consumer_sync();
  }
}

// The W_UV rows of head h: the last v_dim rows of its block of kv_b
// [heads (nope + v), c].
__device__ inline Rows mla_value_rows(const MlaShape& s, const __nv_bfloat16* wkvb, uint32_t h) {
  const uint32_t r0 = h * (s.nope + s.v_dim) + s.nope;
  return Rows{wkvb, nullptr, r0, r0 + s.v_dim, s.c};
}

// Loader side of a combine task: W_UV of each head of the group, in order.
__device__ inline void mla_combine_load(const MlaShape& s, uint32_t hg, const __nv_bfloat16* wkvb, uint32_t& it) {
  const uint32_t h0 = hg * s.hpt, nh = min(s.hpt, s.heads - h0);
  for (uint32_t h = h0; h < h0 + nh; ++h) rows_load(mla_value_rows(s, wkvb, h), it);
}

// One head group, a head at a time: merges the splits by log-sum-exp into
// the latent output olat [B, c] (scratch), then applies W_UV, its rows
// streamed through the page ring (rows_compute; staging [B, v_dim] in scratch
// after olat).
template <int B, class T>
__device__ void mla_combine(const MlaShape& s, uint32_t hg, const float* partials, const __nv_bfloat16* wkvb, T* out,
                            uint32_t& it, int warp) {
  const uint32_t h0 = hg * s.hpt, nh = min(s.hpt, s.heads - h0);
  float* olat = reinterpret_cast<float*>(scratch_ptr());  // [B, c]
  float* st = olat + B * s.c;                             // [B, v_dim]
  for (uint32_t h = h0; h < h0 + nh; ++h) {
    for (uint32_t i = threadIdx.x; i < B * s.c; i += kConsumerThreads) {
      const uint32_t b = i / s.c, cc = i % s.c;
      const float* part = partials + (size_t(b) * s.heads + h) * s.splits * (2 + s.c);
      float m = -INFINITY;
      for (uint32_t k = 0; k < s.splits; ++k) m = fmaxf(m, part[k * (2 + s.c)]);
      float l = 0.f, acc = 0.f;
      for (uint32_t k = 0; k < s.splits; ++k) {
        const float* pk = part + k * (2 + s.c);
        if (pk[1] == 0.f) continue;
        const float w = expf(pk[0] - m);
        l = fmaf(pk[1], w, l);
        acc = fmaf(pk[2 + cc], w, acc);
      }
      olat[i] = acc / l;
    }
    consumer_sync();
    rows_compute<B>(mla_value_rows(s, wkvb, h), olat, nullptr, 0.f, it, warp, st);
    consumer_sync();
    for (uint32_t i = threadIdx.x; i < B * s.v_dim; i += kConsumerThreads) {
      const uint32_t b = i / s.v_dim, j = i % s.v_dim;
      out[size_t(b) * s.heads * s.v_dim + h * s.v_dim + j] = from_float<T>(st[i]);
    }
    consumer_sync();
  }
}

// ---------------------------------------------------------------------------
// KDA decode (Kimi Delta Attention), one step for heads [h0, h1) of every
// sequence. Per head h and token b, with d = head_dim, q and k already
// L2-normalised (the projection's epilogue), all fp32:
//   gate  g[i] = -exp(A_log[h]) softplus(f[i] + dt_bias[i])           (Kimi Linear)
//         g[i] = lower_bound sigmoid(exp(A_log[h]) (f[i] + dt_bias[i])) (K3's safe gate)
//   beta  = sigmoid(b_logit[h])
//   S <- S diag(exp(g))        (S [d_v, d_k] per head, column i scaled)
//   u  = beta (v - S k);  S <- S + u k^T;  o = S q / sqrt(d)
// A warp takes rows of S (a value channel each), a lane four key channels,
// so each state row is read and written once. The state is [B][heads][d][d]
// fp32, key channels contiguous.
struct KdaShape {
  uint32_t heads, d;
  bool safe_gate;     // K3's lower-bounded sigmoid gate instead of softplus
  float lower_bound;  // safe gate only
};

constexpr uint32_t kMaxKdaDim = 256;

__device__ __forceinline__ float softplus(float x) { return x > 20.f ? x : log1pf(expf(x)); }

template <int B, class T>
__device__ void kda_decode(const KdaShape& s, uint32_t h0, uint32_t h1, const T* q, const T* k, const T* v,
                           const T* f, const T* b_logit, const float* a_log, const float* dt_bias, float* state,
                           T* out) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const uint32_t d = s.d, p = s.heads * d;
  constexpr uint32_t kPer = kMaxKdaDim / 128;  // float4 groups per lane
  const float qscale = rsqrtf(float(d));
  for (int b = 0; b < B; ++b) {
    for (uint32_t h = h0; h < h1; ++h) {
      const float scale = expf(a_log[h]);
      const float beta = 1.f / (1.f + expf(-to_float(b_logit[size_t(b) * s.heads + h])));
      float alpha[kPer][4], kk[kPer][4], qq[kPer][4];
#pragma unroll
      for (uint32_t j = 0; j < kPer; ++j) {
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const uint32_t i = 128 * j + 4 * lane + u;
          alpha[j][u] = kk[j][u] = qq[j][u] = 0.f;
          if (i >= d) continue;
          const size_t at = size_t(b) * p + size_t(h) * d + i;
          const float x = to_float(f[at]) + dt_bias[size_t(h) * d + i];
          const float g = s.safe_gate ? s.lower_bound / (1.f + expf(-scale * x)) : -scale * softplus(x);
          alpha[j][u] = expf(g);
          kk[j][u] = to_float(k[at]);
          qq[j][u] = to_float(q[at]) * qscale;
        }
      }
      float* sh = state + (size_t(b) * s.heads + h) * d * d;
      for (uint32_t r = warp; r < d; r += kConsumerWarps) {
        float* row = sh + size_t(r) * d;
        float sv[kPer][4];
        float mem = 0.f;
#pragma unroll
        for (uint32_t j = 0; j < kPer; ++j) {
          const uint32_t i = 128 * j + 4 * lane;
          if (i < d) {
            const float4 x = *reinterpret_cast<const float4*>(row + i);
            sv[j][0] = x.x * alpha[j][0], sv[j][1] = x.y * alpha[j][1];
            sv[j][2] = x.z * alpha[j][2], sv[j][3] = x.w * alpha[j][3];
          } else {
            sv[j][0] = sv[j][1] = sv[j][2] = sv[j][3] = 0.f;
          }
#pragma unroll
          for (int u = 0; u < 4; ++u) mem = fmaf(sv[j][u], kk[j][u], mem);
        }
        mem = warp_sum(mem);
        const float ur = beta * (to_float(v[size_t(b) * p + size_t(h) * d + r]) - mem);
        float o = 0.f;
#pragma unroll
        for (uint32_t j = 0; j < kPer; ++j) {
          const uint32_t i = 128 * j + 4 * lane;
#pragma unroll
          for (int u = 0; u < 4; ++u) {
            sv[j][u] = fmaf(ur, kk[j][u], sv[j][u]);
            o = fmaf(sv[j][u], qq[j][u], o);
          }
          if (i < d) *reinterpret_cast<float4*>(row + i) = make_float4(sv[j][0], sv[j][1], sv[j][2], sv[j][3]);
        }
        o = warp_sum(o);
        if (lane == 0) out[size_t(b) * p + size_t(h) * d + r] = from_float<T>(o);
      }
    }
  }
}

// Gated RMSNorm per head (KDA's output norm), as a projection's prologue:
// x'[c] = x[c] rsqrt(mean over the head's d channels of x^2 + eps) w[c % d]
// act(gate[c]), act sigmoid (1) or SiLU (0); in place on x [B, heads d] in
// shared memory, a warp per (token, head).
template <int B, class T>
__device__ void gated_rms_norm_inplace(float* x, const T* gate, uint32_t heads, uint32_t d,
                                       const __nv_bfloat16* w, float eps, int sigmoid_act) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (uint32_t gi = warp; gi < B * heads; gi += kConsumerWarps) {
    float* xh = x + size_t(gi) * d;
    const T* gh = gate + size_t(gi) * d;
    float ss = 0.f;
    for (uint32_t j = lane; j < d; j += 32) ss = fmaf(xh[j], xh[j], ss);
    const float r = rsqrtf(warp_sum(ss) / float(d) + eps);
    for (uint32_t j = lane; j < d; j += 32) {
      const float gv = to_float(gh[j]);
      const float a = sigmoid_act ? 1.f / (1.f + expf(-gv)) : gv / (1.f + expf(-gv));
      xh[j] = xh[j] * r * bf(w[j]) * a;
    }
  }
}

// Projection rows whose input is KDA's gated output norm (a prologue):
// x [B, heads d] is staged in shared memory (it must fit in
// kActivationBytes; the code generator checks), normed and gated there, then
// the pages read it from shared memory.
template <int B, class T>
__device__ void rows_compute_gated(const Rows& r, const T* x, const T* gate, uint32_t heads, uint32_t d,
                                   const __nv_bfloat16* w, float eps, int sigmoid_act, uint32_t& it, int warp,
                                   float* st) {
  if (size_t(B) * r.k * sizeof(float) > size_t(kActivationBytes) || heads * d != r.k) __trap();
  float* xs = stage_input<B>(x, r.k, static_cast<const __nv_bfloat16*>(nullptr), 0.f);
  gated_rms_norm_inplace<B>(xs, gate, heads, d, w, eps, sigmoid_act);
  consumer_sync();
  rows_pages<B>(r, static_cast<const float*>(xs), nullptr, nullptr, it, warp, st);
}

// ---------------------------------------------------------------------------
// Block attention residuals (K3): the mix of the bank's rows and the current
// row u, per token b,
//   rows r_0..r_{n-1} = bank[j][b], r_n = u[b]
//   s_j = (sum_d r_j[d] gamma[d] w[d]) rsqrt(mean_d r_j[d]^2 + eps)
//   out[b, d] = sum_j softmax(s)_j r_j[d]            (fp32)
// for output columns [d0, d1) (the scores always cover the whole row). The
// bank is [B][n][hidden] (a value of n rows per token); scores go to shared
// memory (a warp per row).
constexpr uint32_t kMaxBankRows = 31;

template <int B, class T>
__device__ void attn_res_mix(const T* bank, uint32_t n, const T* u, const __nv_bfloat16* w, const __nv_bfloat16* gamma,
                             float eps, uint32_t hidden, uint32_t d0, uint32_t d1, float* out) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __shared__ float p[B][kMaxBankRows + 1];
  if (n > kMaxBankRows) __trap();
  auto row = [&](uint32_t j, int b) { return j < n ? bank + (size_t(b) * n + j) * hidden : u + size_t(b) * hidden; };
  for (uint32_t i = warp; i < B * (n + 1); i += kConsumerWarps) {
    const int b = int(i / (n + 1));
    const uint32_t j = i % (n + 1);
    const T* r = row(j, b);
    float dot = 0.f, ss = 0.f;
    for (uint32_t d = lane; d < hidden; d += 32) {
      const float x = to_float(r[d]);
      dot = fmaf(x, bf(gamma[d]) * bf(w[d]), dot);
      ss = fmaf(x, x, ss);
    }
    dot = warp_sum(dot);
    ss = warp_sum(ss);
    if (lane == 0) p[b][j] = dot * rsqrtf(ss / float(hidden) + eps);
  }
  consumer_sync();
  if (threadIdx.x < B) {
    const int b = threadIdx.x;
    float m = -INFINITY;
    for (uint32_t j = 0; j <= n; ++j) m = fmaxf(m, p[b][j]);
    float l = 0.f;
    for (uint32_t j = 0; j <= n; ++j) l += (p[b][j] = expf(p[b][j] - m));
    for (uint32_t j = 0; j <= n; ++j) p[b][j] /= l;
  }
  consumer_sync();
  for (uint32_t i = threadIdx.x; i < B * (d1 - d0); i += kConsumerThreads) {
    const int b = int(i / (d1 - d0));
    const uint32_t d = d0 + i % (d1 - d0);
    float acc = 0.f;
    for (uint32_t j = 0; j <= n; ++j) acc = fmaf(p[b][j], to_float(row(j, b)[d]), acc);
    out[size_t(b) * hidden + d] = acc;
  }
  consumer_sync();
}

// A bank with one more row: out [B][n + 1][hidden] = (bank [B][n][hidden],
// row [B][hidden]); bank may be null when n is 0.
template <int B, class T, class U>
__device__ void stack_rows(const T* bank, uint32_t n, const U* row, uint32_t hidden, T* out) {
  for (uint32_t i = threadIdx.x; i < B * (n + 1) * hidden; i += kConsumerThreads) {
    const uint32_t b = i / ((n + 1) * hidden), j = (i / hidden) % (n + 1), d = i % hidden;
    out[i] = j < n ? bank[(size_t(b) * n + j) * hidden + d] : from_float<T>(to_float(row[size_t(b) * hidden + d]));
  }
  consumer_sync();
}

// Projection rows whose input is an element-wise gated value (K3's MLA
// output gate): x' = x * sigmoid(g) (or x * g), staged in shared memory (it
// must fit in kActivationBytes; the code generator checks).
template <int B, class T, class G>
__device__ void rows_compute_mul(const Rows& r, const T* x, const G* g, int sigmoid_gate, uint32_t& it, int warp,
                                 float* st) {
  const uint32_t n = uint32_t(B) * r.k;
  if (size_t(n) * sizeof(float) > size_t(kActivationBytes)) __trap();
  float* xs = activation_ptr();
  for (uint32_t i = threadIdx.x; i < n; i += kConsumerThreads) {
    const float gv = to_float(g[i]);
    xs[i] = to_float(x[i]) * (sigmoid_gate ? 1.f / (1.f + expf(-gv)) : gv);
  }
  consumer_sync();
  rows_pages<B>(r, static_cast<const float*>(xs), nullptr, nullptr, it, warp, st);
}

// ---------------------------------------------------------------------------
// Router, as DeepSeek-V3: s = sigmoid(logits); choice = s + bias; groups
// ranked by the sum of their two best choices, the best `topk_group` kept
// (the others' choices set to 0); top-k of the choices; weights s at the
// chosen experts, renormalised (sum + 1e-20) if asked, times `scale`.
struct RouterShape {
  uint32_t experts, top_k, n_group, topk_group;
  bool renormalize;
  float scale;
};

// All consumer threads take part: scores and choices are staged in shared
// memory (scratch), groups are ranked by one warp, and the top-k is k rounds
// of a warp arg-max (ties to the lower expert id, as a sequential scan).
template <int B>
__device__ void router(const RouterShape& r, const float* logits, const float* bias, int32_t* ids, float* wts) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float* score = reinterpret_cast<float*>(scratch_ptr());  // [experts]
  float* choice = score + r.experts;                        // [experts], then what is left to pick
  __shared__ float group_score[64];
  const uint32_t per = r.experts / r.n_group;
  for (int b = 0; b < B; ++b) {
    const float* lg = logits + size_t(b) * r.experts;
    for (uint32_t e = threadIdx.x; e < r.experts; e += kConsumerThreads) {
      const float s = 1.f / (1.f + expf(-lg[e]));
      score[e] = s;
      choice[e] = s + (bias != nullptr ? bias[e] : 0.f);
    }
    consumer_sync();
    if (warp == 0) {
      // Groups kept (n_group <= 64, checked at codegen): a lane per group
      // sums its two best choices; lane 0 keeps the best topk_group groups.
      uint64_t k = ~0ull;
      if (r.n_group > 1) {
        for (uint32_t g = lane; g < r.n_group; g += 32) {
          float a = -INFINITY, c = -INFINITY;
          for (uint32_t e = g * per; e < (g + 1) * per; ++e) {
            const float v = choice[e];
            if (v > a) c = a, a = v;
            else if (v > c) c = v;
          }
          group_score[g] = a + (per > 1 ? c : 0.f);
        }
        __syncwarp();
        k = 0;
        for (uint32_t t = 0; t < r.topk_group; ++t) {
          int best = -1;
          for (uint32_t g = 0; g < r.n_group; ++g)
            if (!(k >> g & 1) && (best < 0 || group_score[g] > group_score[best])) best = int(g);
          k |= 1ull << best;
        }
        // Experts of dropped groups compete with choice 0.
        for (uint32_t e = lane; e < r.experts; e += 32)
          if (!(k >> (e / per) & 1)) choice[e] = 0.f;
        __syncwarp();
      }
      int32_t* my_ids = ids + size_t(b) * r.top_k;
      float* my_w = wts + size_t(b) * r.top_k;
      float sum = 0.f;
      for (uint32_t t = 0; t < r.top_k; ++t) {
        float bv = -INFINITY;
        int be = INT_MAX;
        for (uint32_t e = lane; e < r.experts; e += 32) {
          const float v = choice[e];
          if (v > bv || (v == bv && int(e) < be)) bv = v, be = int(e);
        }
        for (int off = 16; off > 0; off /= 2) {
          const float ov = __shfl_xor_sync(0xffffffffu, bv, off);
          const int oe = __shfl_xor_sync(0xffffffffu, be, off);
          if (ov > bv || (ov == bv && oe < be)) bv = ov, be = oe;
        }
        // Every lane holds the same winner; a picked expert leaves the race.
        const float w = score[be];
        sum += w;
        if (lane == 0) {
          my_ids[t] = be;
          my_w[t] = w;
        }
        __syncwarp();
        if (lane == 0) choice[be] = -INFINITY;
        __syncwarp();
      }
      if (lane < int(r.top_k)) {
        const float w = my_w[lane];
        my_w[lane] = (r.renormalize ? w / (sum + 1e-20f) : w) * r.scale;
      }
      for (uint32_t t = 32 + lane; t < r.top_k; t += 32) {
        const float w = my_w[t];
        my_w[t] = (r.renormalize ? w / (sum + 1e-20f) : w) * r.scale;
      }
    }
    consumer_sync();
  }
}

// ---------------------------------------------------------------------------
// Routed experts. Slot s holds the s-th smallest distinct expert id among the
// batch's choices (so every task finds the same assignment without talking);
// a slot past the distinct count is empty.
struct MoeShape {
  uint32_t experts, top_k, inter, hidden, slots;
  uint32_t gate_base, up_base, down_base;  // weight index of expert 0's tensors
  // MXFP4 experts: expert e's codes at base + stride e, its scales right after.
  uint32_t stride = 1;
};

// The slot-th smallest distinct value of ids[0..n), or -1: distinct values
// are visited in increasing order (O(n (slot + 1))).
template <int B>
__device__ int slot_expert(const int32_t* ids, uint32_t n, uint32_t slot) {
  int prev = -1;
  for (uint32_t s = 0; s <= slot; ++s) {
    int next = INT_MAX;
    for (uint32_t j = 0; j < n; ++j)
      if (ids[j] > prev && ids[j] < next) next = ids[j];
    if (next == INT_MAX) return -1;
    prev = next;
  }
  return prev;
}

// The number of distinct values of ids[0..n) below e: e's slot.
__device__ inline uint32_t slot_of(const int32_t* ids, uint32_t n, int32_t e) {
  int prev = -1;
  for (uint32_t s = 0;; ++s) {
    int next = INT_MAX;
    for (uint32_t j = 0; j < n; ++j)
      if (ids[j] > prev && ids[j] < next) next = ids[j];
    if (next >= e) return s;
    prev = next;
  }
}

// The weight rows of an expert task: rows [r0, r1) of the slot's expert's
// w0 (gate, paired with up) or down matrix; no rows for an empty slot.
// Loader and consumers compute the same rows from the router's ids.
template <int B>
__device__ inline Rows expert_rows(const MoeShape& s, uint32_t slot, uint32_t r0, uint32_t r1, void* const* w,
                                   const int32_t* ids, bool down) {
  const int e = slot_expert<B>(ids, B * s.top_k, slot);
  if (e < 0) return Rows{nullptr, nullptr, 0, 0, down ? s.inter : s.hidden};
  if (down) return Rows{static_cast<const __nv_bfloat16*>(w[s.down_base + e]), nullptr, r0, r1, s.inter};
  return Rows{static_cast<const __nv_bfloat16*>(w[s.gate_base + e]), static_cast<const __nv_bfloat16*>(w[s.up_base + e]),
              r0, r1, s.hidden};
}

// The MXFP4 rows of an expert task (as expert_rows).
template <int B>
__device__ inline MxRows expert_mx_rows(const MoeShape& s, uint32_t slot, uint32_t r0, uint32_t r1, void* const* w,
                                       const int32_t* ids, bool down) {
  const int e = slot_expert<B>(ids, B * s.top_k, slot);
  auto u8 = [&](uint32_t i) { return static_cast<const uint8_t*>(w[i]); };
  if (e < 0) return MxRows{nullptr, nullptr, nullptr, nullptr, 0, 0, down ? s.inter : s.hidden};
  if (down) {
    const uint32_t i = s.down_base + s.stride * uint32_t(e);
    return MxRows{u8(i), u8(i + 1), nullptr, nullptr, r0, r1, s.inter};
  }
  const uint32_t g = s.gate_base + s.stride * uint32_t(e), u = s.up_base + s.stride * uint32_t(e);
  return MxRows{u8(g), u8(g + 1), u8(u), u8(u + 1), r0, r1, s.hidden};
}

// routed[b, d] = sum_j weight[b, j] out[slot(ids[b, j]), b, d], for column
// tile `tile` of `tiles`.
template <int B, class T>
__device__ void expert_combine(const MoeShape& s, uint32_t tile, uint32_t tiles, const int32_t* ids, const float* wts,
                               const float* dn, T* routed) {
  __shared__ uint32_t slot[B * 64];
  if (B * s.top_k > B * 64) __trap();
  for (uint32_t i = threadIdx.x; i < B * s.top_k; i += kConsumerThreads) slot[i] = slot_of(ids, B * s.top_k, ids[i]);
  consumer_sync();
  const uint32_t d0 = tile * s.hidden / tiles, d1 = (tile + 1) * s.hidden / tiles;
  for (uint32_t i = threadIdx.x; i < B * (d1 - d0); i += kConsumerThreads) {
    const uint32_t b = i / (d1 - d0), d = d0 + i % (d1 - d0);
    float acc = 0.f;
    for (uint32_t j = 0; j < s.top_k; ++j)
      acc = fmaf(wts[b * s.top_k + j], dn[(size_t(slot[b * s.top_k + j]) * B + b) * s.hidden + d], acc);
    routed[size_t(b) * s.hidden + d] = from_float<T>(acc);
  }
  consumer_sync();
}

}  // namespace mkc
