// mkc device library: projection rows through the page ring: bf16 rows (`rows_compute`, the
// consumer of `rows_load`), MXFP4 rows (`mx_rows_load`, `mx_rows_compute`),
// the staged input and its prologues' shared pieces.
#pragma once

#include <cuda_fp16.h>

#include <type_traits>
#include <utility>

#include <cute/arch/mma_sm80.hpp>

#include "../mx_layout.h"
#include "common.cuh"

namespace mkc {

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
__device__ __forceinline__ void store_four(float* p, float4 v) { *reinterpret_cast<float4*>(p) = v; }
__device__ __forceinline__ void store_four(__nv_bfloat16* p, float4 v) {
  const __nv_bfloat162 lo = __floats2bfloat162_rn(v.x, v.y), hi = __floats2bfloat162_rn(v.z, v.w);
  *reinterpret_cast<uint2*>(p) = make_uint2(*reinterpret_cast<const uint32_t*>(&lo), *reinterpret_cast<const uint32_t*>(&hi));
}

// Four elements (16 or 8 bytes) from global to shared memory without
// registers (cp.async), and the fences of its groups.
template <class T>
__device__ __forceinline__ void cp_async_four(T* dst, const T* src) {
  const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  if constexpr (sizeof(T) == 4) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(src) : "memory");
  } else {
    static_assert(sizeof(T) == 2, "fp32 or bf16");
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(d), "l"(src) : "memory");
  }
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// The warps' row-block sums of rows_pages_fma and mx_rows_pages, [2][warps]
// [kPageRows * B] by row block parity. A function's __shared__ array is one
// per template instance, and the static shared memory of them all adds up
// (mx_rows_compute runs the consumers of every batch up to its own): one
// buffer serves every batch up to kMaxBatch, so that the kernel's static
// shared memory stays within kStaticSmemBytes.
__device__ __forceinline__ float* row_block_parts_shared() {
  __shared__ float parts[2 * kConsumerWarps * kPageRows * kMaxBatch];
  return parts;
}
template <int B>
__device__ __forceinline__ auto row_block_parts() {
  using Parts = float(*)[kConsumerWarps][kPageRows * B];
  if constexpr (B <= kMaxBatch) {
    return reinterpret_cast<Parts>(row_block_parts_shared());
  } else {
    __shared__ float parts[2][kConsumerWarps][kPageRows * B];
    return static_cast<Parts>(parts);
  }
}

// The end of a row block: the lanes' partial sums acc[j][b] reduced over the
// warp (a reduce-scatter, warp_sum_scatter: 9 shuffles for 8 rows, not 40,
// and no branch per row), then over the warps through `part` [warps][kPageRows
// B] in a fixed order (the result does not depend on timing), into st [B,
// cols] at columns j0 + j. One consumer barrier; callers alternate `part`
// between row blocks so the next block's writes cannot overtake this one's
// reads.
template <int B>
__device__ __forceinline__ void reduce_row_block(float (&acc)[kPageRows][B], float (*part)[kPageRows * B],
                                                 uint32_t nr, uint32_t cols, uint32_t j0, int warp, float* st) {
  constexpr int N = kPageRows * B;
  constexpr int P = N <= 8 ? 8 : N <= 16 ? 16 : N <= 32 ? 32 : N <= 64 ? 64 : 128;  // N rounded up to a power of two
  static_assert(N <= P && P <= 128, "batch up to 16");
  float v[P];  // a batch that is not a power of two: the sums padded with zeros
#pragma unroll
  for (int i = 0; i < P; ++i) v[i] = i < N ? acc[i / B][i % B] : 0.f;
  const int first = warp_sum_scatter<P>(v);
  if (scatter_owner<P>()) {
#pragma unroll
    for (int i = 0; i < (P >= 32 ? P / 32 : 1); ++i) {
      if (first + i < N) part[warp][first + i] = v[i];
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

// x' = x, or x * scale[b] * norm, at columns e .. e + 3 of every token into
// xv; token b's columns at x + b * ld, norm's at norm (both from the page's
// first column).
template <int B, class T>
__device__ __forceinline__ void rows_load_x(const T* x, size_t ld, const __nv_bfloat16* norm, const float* scale,
                                            uint32_t e, float4 (&xv)[B]) {
  float4 g = make_float4(1.f, 1.f, 1.f, 1.f);
  if (norm != nullptr) g = load_four(norm + e);
#pragma unroll
  for (int b = 0; b < B; ++b) {
    xv[b] = load_four(x + size_t(b) * ld + e);
    if (norm != nullptr) {
      const float sb = scale[b];
      xv[b] = make_float4(xv[b].x * sb * g.x, xv[b].y * sb * g.y, xv[b].z * sb * g.z, xv[b].w * sb * g.w);
    }
  }
}

// The page loop of rows_compute on the CUDA cores (batch 1):
// rows of y = x' W^T into st [B, cols], x' = x, or x * scale[b] * norm when
// `norm` is given. A page holds kPageRows
// rows of up to kPageK weights; warp w takes columns [128 w, 128 w + 128) of
// every row of the page, four per lane, so each activation a lane loads
// serves all rows of the page. With kAhead (x in global memory, the
// activation area unused) each lane copies its four columns of the next
// page's activations into the activation area (cp.async, no registers held)
// before it waits for this page, so their L2 round trip overlaps the page's
// wait and math. After a row block's last page the lanes' partial sums are
// reduced over the warp (shuffles), then over the warps (shared memory, in a
// fixed order: the result does not depend on timing).
template <int B, bool kAhead = false, class T>
__device__ void rows_pages_fma(const Rows& r, const T* x, const __nv_bfloat16* norm, const float* scale, uint32_t& it,
                               int warp, float* st) {
  static_assert(kPageK == kConsumerWarps * 128, "a warp covers 128 columns of a page");
  static_assert(!kAhead || 2 * B * kPageK * sizeof(T) <= size_t(kActivationBytes), "two pages of x fit");
  const int lane = threadIdx.x % 32;
  const auto part = row_block_parts<B>();  // per row block parity
  const uint32_t cols = r.cols();
  const uint32_t e = uint32_t(warp) * 128 + uint32_t(lane) * 4;  // this lane's columns within a page
  T* xb = reinterpret_cast<T*>(activation_ptr());                // kAhead: [2][B][kPageK], by page parity
  auto ahead = [&](uint32_t k0, uint32_t parity) {
    if (k0 + e < r.k) {
#pragma unroll
      for (int b = 0; b < B; ++b) cp_async_four(xb + (parity * B + b) * kPageK + e, x + size_t(b) * r.k + k0 + e);
    }
    cp_async_commit();
  };
  uint32_t q = 0;  // pages of this call
  if (kAhead) ahead(0, 0);
  for (uint32_t j0 = 0, block = 0; j0 < cols; j0 += kPageRows, ++block) {
    const uint32_t nr = min(uint32_t(kPageRows), cols - j0);
    float acc[kPageRows][B] = {};
    for (uint32_t k0 = 0; k0 < r.k; k0 += kPageK, ++it, ++q) {
      const uint32_t nk = min(uint32_t(kPageK), r.k - k0);
      const int slot = it % kPages;
      if (kAhead) {
        const uint32_t k1 = k0 + kPageK < r.k ? k0 + kPageK : 0;  // the next page's columns
        if (k1 != 0 || j0 + kPageRows < cols) {
          ahead(k1, (q + 1) & 1);
        } else {
          cp_async_commit();  // an empty group: the wait below still counts this page's
        }
        cp_async_wait<1>();  // this page's columns are in
      }
      wait_page(it);
      if (e < nk) {
        float4 xv[B];
        if (kAhead) {
          rows_load_x<B>(xb + (q & 1) * B * kPageK, kPageK, norm == nullptr ? nullptr : norm + k0, scale, e, xv);
        } else {
          rows_load_x<B>(x + k0, r.k, norm == nullptr ? nullptr : norm + k0, scale, e, xv);
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

// The warps' partial sums of G row blocks (kBlockGroup, or the bf16 rows'
// kRowsGroup: projection.cuh) are summed together, one consumer barrier per
// group instead of one a block: scratch holds two groups, [2][G][warp][row,
// token], a group
// written while the one before it is summed. sum_block_group adds a group's
// (its last block in_group) over the warps in a fixed order into st [B,
// cols].
template <int B, uint32_t G = kBlockGroup>
__device__ void sum_block_group(const float* part, uint32_t group, uint32_t in_group, uint32_t cols, float* st) {
  constexpr uint32_t kBlockSums = kConsumerWarps * kPageRows * B;
  consumer_sync();
  const float* sums = part + (group & 1) * G * kBlockSums;
  const uint32_t j0 = group * G * kPageRows, n = min((in_group + 1) * kPageRows, cols - j0);
  for (uint32_t i = threadIdx.x; i < n * B; i += kConsumerThreads) {
    const uint32_t j = i / B, b = i % B;
    const float* src = sums + (j / kPageRows) * kBlockSums + (j % kPageRows) * B + b;
    float v = 0.f;
#pragma unroll
    for (int w = 0; w < kConsumerWarps; ++w) v += src[w * kPageRows * B];
    st[size_t(b) * cols + j0 + j] = v;
  }
}

// Two fp32 values as a pair H of 16-bit floats (__nv_bfloat162 or __half2,
// the first in the low half) and what they lack: x = hi + lo to about 16 bits
// (bf16) or 22 bits (fp16, the values brought inside its range first).
__device__ __forceinline__ __nv_bfloat162 pair_rn(float a, float b, __nv_bfloat162) {
  return __floats2bfloat162_rn(a, b);
}
__device__ __forceinline__ __half2 pair_rn(float a, float b, __half2) { return __floats2half2_rn(a, b); }
__device__ __forceinline__ float2 pair_float(__nv_bfloat162 h) { return __bfloat1622float2(h); }
__device__ __forceinline__ float2 pair_float(__half2 h) { return __half22float2(h); }
template <class H>
__device__ __forceinline__ void split_pair(float x0, float x1, uint32_t& hi, uint32_t& lo) {
  const H h = pair_rn(x0, x1, H{});
  const float2 back = pair_float(h);
  const H l = pair_rn(x0 - back.x, x1 - back.y, H{});
  hi = *reinterpret_cast<const uint32_t*>(&h);
  lo = *reinterpret_cast<const uint32_t*>(&l);
}

// The tensor-core consumer's inputs: eight activations of token b from
// column e (a multiple of 8) as fp32, computed where they are read, without
// branches (rows_pages_mma issues a chunk's loads together).
// RowsInput: x [B, k] (shared or global memory), times scale[b] * norm[e]
// with kNorm (rows_compute's RMS prologue).
template <class T, bool kNorm>
struct RowsInput {
  const T* x;
  uint32_t k;
  const __nv_bfloat16* norm;  // kNorm: [k]
  const float* scale;         // kNorm: [B]
  __device__ void operator()(uint32_t b, uint32_t e, float (&v)[8]) const {
    const T* xb = x + size_t(b) * k + e;
    const float4 p = load_four(xb), q = load_four(xb + 4);
    v[0] = p.x, v[1] = p.y, v[2] = p.z, v[3] = p.w, v[4] = q.x, v[5] = q.y, v[6] = q.z, v[7] = q.w;
    if constexpr (kNorm) {
      const float4 m = load_four(norm + e), n = load_four(norm + e + 4);
      const float s = scale[b];
      v[0] *= s * m.x, v[1] *= s * m.y, v[2] *= s * m.z, v[3] *= s * m.w;
      v[4] *= s * n.x, v[5] *= s * n.y, v[6] *= s * n.z, v[7] *= s * n.w;
    }
  }
};

// The end of a group of nb row blocks whose token rows were A of mma.sync
// m16n8k16 (rows_pages_mma, fp8_rows_pages_mma): lane (g, t) holds token g's
// rows 2t and 2t + 1 of block j, the high part in acc[j][0..1] and the low
// part in acc[j][2..3]; their sums times `unscale` wait in scratch (part
// [2][G][warp][row, token]) and are then added over the warps in a fixed
// order into st (sum_block_group).
template <int B, uint32_t G>
__device__ __forceinline__ void end_mma_group(const float (&acc)[G][4], float* part, uint32_t group, uint32_t nb,
                                              uint32_t cols, int warp, float unscale, float* st) {
  constexpr uint32_t kBlockSums = kConsumerWarps * kPageRows * B;
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int j = 0; j < int(G); ++j) {
    if (uint32_t(j) >= nb) break;
    float* mine = part + ((group & 1) * G + j) * kBlockSums + warp * kPageRows * B;
    if (g < B) {
      mine[(2 * t) * B + g] = (acc[j][0] + acc[j][2]) * unscale;
      mine[(2 * t + 1) * B + g] = (acc[j][1] + acc[j][3]) * unscale;
    }
  }
  sum_block_group<B, G>(part, group, nb - 1, cols, st);
}

// The page loop of rows_compute on the tensor cores at batch 2 to 8
// (kRowsMma): mma.sync m16n8k16, bf16 inputs, fp32 sums, the activations as
// A and a page's eight rows as B. A's row b is token b's bf16 high part and
// row 8 + b its low part (rows past the batch are zeros), so the products
// keep the fp32 activation to about 2^-17; the result's rows b and 8 + b are
// added. Warp w takes columns [128 w, 128 w + 128) of every page: lane (g, t)
// reads page row g's columns 32 i + 8 t .. + 7 (i < 4, one 16-byte load) as
// its k-slots (2t, 2t+1, 2t+8, 2t+9) of step 2i (columns + 0 .. 3) and of
// step 2i + 1 (+ 4 .. 7), and token g's activations of the same columns as
// A's. The pages come G = kRowsGroup<B> row blocks at a time, the k chunks outer
// (rows_load<B>): a chunk's A fragments are made once for the group's blocks
// from `in` (RowsInput and the like: eight activations of a token, computed
// where they are read), and the group's sums wait in scratch
// (sum_block_group).
template <int B, class In>
__device__ void rows_pages_mma(const Rows& r, const In& in, uint32_t& it, int warp, float* st) {
  constexpr uint32_t kBlockSums = kConsumerWarps * kPageRows * B;
  constexpr uint32_t G = kRowsGroup<B>;
  static_assert(kRowsMma<B> && B <= 8, "A's eight token rows");
  static_assert(2 * G * kBlockSums * sizeof(float) <= kScratchBytes, "two groups of partial sums fit scratch");
  static_assert(kPageK == kConsumerWarps * 128, "a warp covers 128 columns of a page");
  if (r.k % 8 != 0) __trap();  // whole 16-byte pieces (the loader's bulk copies need them too)
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  float* part = reinterpret_cast<float*>(scratch_ptr());  // [2][G][warp][row, token]
  const uint32_t cols = r.cols(), blocks = (cols + kPageRows - 1) / kPageRows;
  const uint32_t c0 = uint32_t(warp) * 128 + 8 * uint32_t(t);  // + 32 i: this lane's columns of a page
  for (uint32_t b0 = 0, group = 0; b0 < blocks; b0 += G, ++group) {
    const uint32_t nb = min(G, blocks - b0);
    float acc[G][4] = {};
    for (uint32_t k0 = 0; k0 < r.k; k0 += kPageK) {
      const uint32_t nk = min(uint32_t(kPageK), r.k - k0);
      uint32_t hi[4][4], lo[4][4];  // [i][pair]: columns 32 i + 8 t + 2 pair, + 1
      // The four reads of a lane, with no branch between them: they are in flight together (a branch
      // each took an input with a prologue, whose reads come from L2, to four round trips a chunk).
      // Lanes past the batch or the chunk read token 0's column 0 and take zeros.
      float v[4][8];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const bool ok = g < B && c0 + 32 * i < nk;
        in(ok ? uint32_t(g) : 0u, ok ? k0 + c0 + 32 * i : 0u, v[i]);
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const bool ok = g < B && c0 + 32 * i < nk;
#pragma unroll
        for (int pr = 0; pr < 4; ++pr) {
          split_pair<__nv_bfloat162>(ok ? v[i][2 * pr] : 0.f, ok ? v[i][2 * pr + 1] : 0.f, hi[i][pr], lo[i][pr]);
        }
      }
#pragma unroll
      for (int j = 0; j < int(G); ++j) {
        if (uint32_t(j) >= nb) break;
        const int slot = it % kPages;
        wait_page(it);
        if (uint32_t(warp) * 128 < nk) {  // the warp has columns in this chunk
          const __nv_bfloat16* row = ring_ptr()->page[slot] + g * kPageK + c0;
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            // Columns past the chunk hold an earlier page's bytes: zeros, as their activations.
            const uint4 w = c0 + 32 * i < nk ? *reinterpret_cast<const uint4*>(row + 32 * i) : make_uint4(0, 0, 0, 0);
            cute::SM80_16x8x16_F32BF16BF16F32_TN::fma(acc[j][0], acc[j][1], acc[j][2], acc[j][3], hi[i][0], lo[i][0],
                                                      hi[i][1], lo[i][1], w.x, w.y, acc[j][0], acc[j][1], acc[j][2],
                                                      acc[j][3]);
            cute::SM80_16x8x16_F32BF16BF16F32_TN::fma(acc[j][0], acc[j][1], acc[j][2], acc[j][3], hi[i][2], lo[i][2],
                                                      hi[i][3], lo[i][3], w.z, w.w, acc[j][0], acc[j][1], acc[j][2],
                                                      acc[j][3]);
          }
        }
        release_page(&ring_ptr()->empty[slot]);
        ++it;
      }
    }
    end_mma_group<B, G>(acc, part, group, nb, cols, warp, 1.f, st);
  }
}

// The page loop of rows_compute: on the tensor cores where the batch has
// them (rows_pages_mma, which reads x in place: kAhead unused), otherwise on
// the CUDA cores (rows_pages_fma). The task's loader is rows_load<B>.
template <int B, bool kAhead = false, class T>
__device__ void rows_pages(const Rows& r, const T* x, const __nv_bfloat16* norm, const float* scale, uint32_t& it,
                           int warp, float* st) {
  if constexpr (kRowsMma<B>) {
    if (norm != nullptr) {
      rows_pages_mma<B>(r, RowsInput<T, true>{x, r.k, norm, scale}, it, warp, st);
    } else {
      rows_pages_mma<B>(r, RowsInput<T, false>{x, r.k, nullptr, nullptr}, it, warp, st);
    }
  } else {
    rows_pages_fma<B, kAhead>(r, x, norm, scale, it, warp, st);
  }
}

// Where an operation's staged input [B, k] (fp32) goes: the shared-memory
// activation area when it fits, otherwise `spill`, this SM's global staging
// past its output tile, which the pages then read through L1 and L2 (the code
// generator gives a spill to every operation whose input may not fit).
template <int B>
__device__ inline bool input_fits(uint32_t k) {
  return size_t(B) * k * sizeof(float) <= size_t(kActivationBytes);
}
template <int B>
__device__ inline float* input_area(uint32_t k, float* spill) {
  if (input_fits<B>(k)) return activation_ptr();
  if (spill == nullptr) __trap();
  return spill;
}

// The page loop over an input staged by stage_input (or like it) in
// input_area: read in place from shared memory, or, when it was spilled to
// global memory, each page's slice copied a page ahead into the then unused
// activation area (rows_pages' look-ahead) where two pages of it fit there
// (batch 8 at most).
template <int B>
__device__ void rows_pages_staged(const Rows& r, const float* xs, uint32_t& it, int warp, float* st) {
  constexpr bool kAhead = 2 * B * kPageK * sizeof(float) <= size_t(kActivationBytes);
  if constexpr (kAhead) {
    if (!input_fits<B>(r.k)) {
      rows_pages<B, true>(r, xs, nullptr, nullptr, it, warp, st);
      return;
    }
  }
  rows_pages<B>(r, xs, nullptr, nullptr, it, warp, st);
}

// The RMSNorm scale of every token of x [B, k] (k a multiple of 4), rsqrt(mean
// of x^2 + eps), into scale[B] (shared memory), complete for every consumer:
// one pass over x for all the tokens, four elements a load (x may be in L2:
// the loads of a pass are independent), the warps' sums added in order.
template <int B, class T>
__device__ void rms_scales(const T* x, uint32_t k, float eps, float* scale) {
  __shared__ float part[kConsumerWarps][B];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (k % 4 != 0) __trap();  // rows' widths are multiples of 8 (the loader's bulk copies)
  float ss[B] = {};
  for (uint32_t e = threadIdx.x * 4; e < k; e += kConsumerThreads * 4) {
#pragma unroll
    for (int b = 0; b < B; ++b) {
      const float4 v = load_four(x + size_t(b) * k + e);
      ss[b] = fmaf(v.x, v.x, fmaf(v.y, v.y, fmaf(v.z, v.z, fmaf(v.w, v.w, ss[b]))));
    }
  }
#pragma unroll
  for (int b = 0; b < B; ++b) {
    const float v = warp_sum(ss[b]);
    if (lane == 0) part[warp][b] = v;
  }
  consumer_sync();
  if (threadIdx.x < uint32_t(B)) {
    float v = 0.f;
#pragma unroll
    for (int w = 0; w < kConsumerWarps; ++w) v += part[w][threadIdx.x];
    scale[threadIdx.x] = rsqrtf(v / float(k) + eps);
  }
  consumer_sync();
}

// Token b's row of an input [*, k]: rows[b] where a caller picked some of
// the batch's tokens (a routed expert's: mx_rows_compute), else b.
__device__ __forceinline__ size_t token_row(const uint8_t* rows, int b) { return rows != nullptr ? rows[b] : b; }

// Copies x [B, k] (token b's row token_row(rows, b)) into xs (input_area) as
// fp32, RMS-normed there (x * rsqrt(mean(x^2) + eps) * norm, per token) when
// `norm` is given; returns it, complete for every consumer.
template <int B, class T>
__device__ float* stage_input(const T* x, uint32_t k, const __nv_bfloat16* norm, float eps, float* xs,
                              const uint8_t* rows = nullptr) {
  __shared__ float scale[B];
  const uint32_t n = uint32_t(B) * k;
  // The reads issued before the writes: a loop of one load and one store an iteration waits out each
  // load's round trip in turn (the compiler may not move a load of x or norm above a store to xs, which
  // it cannot tell apart), tens of them a task at K2's widths. fp32 inputs staged in shared memory
  // go by cp.async (no registers, every copy in flight at once), bf16 ones kInFlight at a time; an
  // fp32 input spilled to global memory (where cp.async cannot write; batch 8 at K2's widths), or
  // one already in shared memory (MLA's combine: staged where it is), a load and a store at a time,
  // as before (a register array there spilled the kernel's registers).
  constexpr uint32_t kInFlight = 4, kStride = kConsumerThreads * 4;
  if constexpr (std::is_same_v<T, float>) {
    if (__isShared(xs) && __isGlobal(x)) {  // cp.async reads global memory only (MLA's combine stages olat in place)
      for (uint32_t i = threadIdx.x * 4; i < n; i += kStride) {
        cp_async_four(xs + i, x + token_row(rows, int(i / k)) * k + i % k);
      }
      cp_async_commit();
      cp_async_wait<0>();
    } else {
      for (uint32_t i = threadIdx.x * 4; i < n; i += kStride) {
        store_four(xs + i, load_four(x + token_row(rows, int(i / k)) * k + i % k));
      }
    }
  } else {
    for (uint32_t i0 = threadIdx.x * 4; i0 < n; i0 += kInFlight * kStride) {
      float4 v[kInFlight];
#pragma unroll
      for (uint32_t u = 0; u < kInFlight; ++u) {
        const uint32_t i = i0 + u * kStride;
        if (i < n) v[u] = load_four(x + token_row(rows, int(i / k)) * k + i % k);
      }
#pragma unroll
      for (uint32_t u = 0; u < kInFlight; ++u) {
        const uint32_t i = i0 + u * kStride;
        if (i < n) store_four(xs + i, v[u]);
      }
    }
  }
  if (norm != nullptr) {
    consumer_sync();
    rms_scales<B>(static_cast<const float*>(xs), k, eps, scale);
    // Four columns an iteration, the norm's weights asked into L1 first (the loop's loads then wait
    // for L1, not for L2, in turn: a register array of them in flight spilled elsewhere in the kernel).
    for (uint32_t e = threadIdx.x * 4; e < k; e += kStride) prefetch_l1(norm + e);
    for (uint32_t i = threadIdx.x * 4; i < n; i += kStride) {
      const float4 v = load_four(static_cast<const float*>(xs + i)), g = load_four(norm + i % k);
      const float s = scale[i / k];
      store_four(xs + i, make_float4(v.x * s * g.x, v.y * s * g.y, v.z * s * g.z, v.w * s * g.w));
    }
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
template <class T>
struct RowsCompute {
  Rows rows;                  // the task's weight rows (rows_load streams them)
  const T* x;                 // [B, rows.k] the input
  const __nv_bfloat16* norm;  // [rows.k] the RMSNorm prologue's weight, or null: no prologue
  float eps;                  // the prologue's epsilon
};
template <int B, class T>
__device__ void rows_compute(RowsCompute<T> a, uint32_t& it, int warp, float* st) {
  const Rows& r = a.rows;
  __shared__ float scale[B];
  if (input_fits<B>(r.k)) {
    rows_pages<B>(r, stage_input<B>(a.x, r.k, a.norm, a.eps, activation_ptr()), nullptr, nullptr, it, warp, st);
    return;
  }
  if (a.norm != nullptr) rms_scales<B>(a.x, r.k, a.eps, scale);
  // x from L2, each page's slice copied a page ahead where two pages of it fit the activation area
  // (fp32 input up to batch 8, bf16 up to 16); beyond, read in place.
  constexpr bool kAhead = 2 * B * kPageK * sizeof(T) <= size_t(kActivationBytes);
  rows_pages<B, kAhead>(r, a.x, a.norm, scale, it, warp, st);
}

// ---------------------------------------------------------------------------
// MXFP4 weight rows (K3's routed experts): e2m1 codes and one e8m0 scale byte
// per 32 elements, W[n, k] = e2m1(code) 2^(scale - 127) (a scale byte of 255,
// NaN, reads as 0: cleared on upload), in the tiled layout of mx_layout.h (tiles of
// kMxTileRows rows, each tile's 32-element blocks one after the other), which
// the runtime makes from the checkpoint's [rows, k / 2] codes and [rows, k /
// 32] scales.
static_assert(kMxTileRows == uint32_t(kPageRows), "an MXFP4 tile is a page's rows");
struct MxRows {
  const uint8_t* c0;  // codes, tiled
  const uint8_t* s0;  // scales, tiled
  const uint8_t* c1;  // the paired (up) matrix's, or null
  const uint8_t* s1;
  uint32_t r0, r1, k;  // rows [r0, r1) of each matrix; r0 a multiple of 8, and r1 - r0 too for a pair
  __device__ uint32_t cols() const { return (r1 - r0) * (c1 != nullptr ? 2 : 1); }
  // The tile of columns [j0, j0 + 8) (j0 a multiple of 8): its codes, its scales.
  __device__ const uint8_t* tile_codes(uint32_t j0) const {
    const uint32_t n = r1 - r0;
    return j0 < n ? c0 + size_t((r0 + j0) / kMxTileRows) * mx_tile_code_bytes(k)
                  : c1 + size_t((r0 + j0 - n) / kMxTileRows) * mx_tile_code_bytes(k);
  }
  __device__ const uint8_t* tile_scales(uint32_t j0) const {
    const uint32_t n = r1 - r0;
    return j0 < n ? s0 + size_t((r0 + j0) / kMxTileRows) * mx_tile_scale_bytes(k)
                  : s1 + size_t((r0 + j0 - n) / kMxTileRows) * mx_tile_scale_bytes(k);
  }
};

// A page holds one tile's codes for a chunk of up to kMxK elements (a
// block's eight rows in 128 bytes, the blocks in order), copied as they lie
// in the tile, and at kMxScales the tile's scales for the chunk (8 bytes a
// block): 15232 of the page's 16384 bytes. K3's latent width (3584) and
// expert width (3072) are one chunk.
constexpr uint32_t kMxK = 3584;
constexpr uint32_t kMxScales = kPageRows * (kMxK / 2);  // byte offset of the scales in a page
static_assert(kMxScales + kPageRows * (kMxK / 32) <= uint32_t(kPageBytes), "an MXFP4 page holds codes and scales");
static_assert(kMxK % 64 == 0, "a chunk's scales start at a 16-byte boundary of its tile's");

// Eight e2m1 codes (element i in bits 4i..4i+3 of c) as fp32 values times
// 2^-14, without a table: each nibble's sign goes to an fp16's sign bit and its
// three magnitude bits to the exponent's two low bits and the mantissa's top
// bit, which is e2m1 * 2^-14 exactly (e2m1's subnormal 0.5 as well); two
// nibbles (i, i + 4) a 32-bit word, converted to fp32 in pairs.
__device__ __forceinline__ void e2m1x8_scaled(uint32_t c, float (&w)[8]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t q = c << (12 - 4 * i);  // nibbles i and i + 4 in bits 12..15 and 28..31
    const uint32_t h = (q & 0x80008000u) | ((q >> 3) & 0x0E000E00u);
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h));
    w[i] = f.x;
    w[i + 4] = f.y;
  }
}
constexpr float kE2m1Unscale = 16384.f;  // 2^14, what e2m1x8_scaled's values lack
// 2^(byte - 127) by its bit pattern (byte 0: 2^-127, a subnormal). 255 (NaN,
// read as 0) never reaches the device: the upload zeroes such blocks
// (mx_clear_nan_blocks); here it would read as infinity.
__device__ __forceinline__ float e8m0(uint32_t byte) { return __int_as_float(max(int(byte << 23), 0x00400000)); }

// Loader: a task's rows into the page ring, a tile and chunk a page, by lane
// 0 in two bulk copies (the tile's codes of the chunk, its scales rounded up
// to 16 bytes: the tile's padding covers the rounding).
__device__ inline void mx_rows_load(const MxRows& r, uint32_t& it) {
  const uint32_t lane = threadIdx.x % 32, cols = r.cols();
  if (r.r0 % kMxTileRows != 0 || (r.c1 != nullptr && (r.r1 - r.r0) % kMxTileRows != 0)) __trap();  // the planner's tiles
  for (uint32_t j0 = 0; j0 < cols; j0 += kPageRows) {
    const uint8_t* codes = r.tile_codes(j0);
    const uint8_t* scales = r.tile_scales(j0);
    for (uint32_t k0 = 0; k0 < r.k; k0 += kMxK, ++it) {
      const uint32_t blocks = min(kMxK, r.k - k0) / kMxBlock;
      const uint32_t code_bytes = blocks * kMxTileBlockBytes, scale_bytes = (blocks * kMxTileRows + 15) / 16 * 16;
      const int slot = it % kPages;
      if (lane == 0) {
        auto* page = reinterpret_cast<uint8_t*>(ring_ptr()->page[slot]);
        auto* full = &ring_ptr()->full[slot];
        wait_slot_free(it);
        Barrier::arrive_and_expect_tx(full, code_bytes + scale_bytes);
        cute::SM90_BULK_COPY_G2S::copy(codes + k0 / kMxBlock * kMxTileBlockBytes, full, page, int32_t(code_bytes));
        cute::SM90_BULK_COPY_G2S::copy(scales + k0 / kMxBlock * kMxTileRows, full, page + kMxScales,
                                       int32_t(scale_bytes));
      }
    }
  }
  __syncwarp();
}

// Consumers: rows of y = x W^T into st [B, cols] (x fp32 [B, k], in shared
// memory or global). Warp w takes elements [256 w, 256 w + 256) of each 2048
// of a chunk, eight per lane (one code word, one scale a row), for all the
// page's rows at once: the rows' loads issue together and their sums are
// independent chains (a page's rows past the task's last are computed from
// whatever the page holds and never stored). The lanes of a block (four) go
// through the tile's rows starting at row (lane / 4): the warp's 32 words of
// each step then lie in 32 banks. Codes are decoded in registers
// (e2m1x8_scaled); the eight products are summed before the block's scale
// multiplies them once, and the 2^14 the decode leaves out multiplies the row
// block's sums once at the end.
template <int B>
__device__ void mx_rows_pages(const MxRows& r, const float* x, uint32_t& it, int warp, float* st) {
  const int lane = threadIdx.x % 32;
  const auto part = row_block_parts<B>();  // per row block parity
  const uint32_t cols = r.cols();
  const uint32_t chunks = (r.k + kMxK - 1) / kMxK;
  const uint32_t blocks = (cols + kPageRows - 1) / kPageRows;
  const uint32_t e0 = uint32_t(warp) * 256 + uint32_t(lane) * 8;  // this lane's first elements within a chunk
  const int rot = lane / 4;  // step j reads tile row (j + rot) % 8
  for (uint32_t blk = 0; blk < blocks; ++blk) {
    const uint32_t j0 = blk * kPageRows, nr = min(uint32_t(kPageRows), cols - j0);
    float acc[kPageRows][B] = {};  // acc[j]: tile row (j + rot) % 8
    for (uint32_t ch = 0; ch < chunks; ++ch, ++it) {
      const uint32_t k0 = ch * kMxK, nk = min(kMxK, r.k - k0);
      const int slot = it % kPages;
      wait_page(it);
      const auto* page = reinterpret_cast<const uint8_t*>(ring_ptr()->page[slot]);
      for (uint32_t e = e0; e < nk; e += kConsumerThreads * 8) {
        const uint8_t* block = page + e / kMxBlock * kMxTileBlockBytes + (e % kMxBlock) / 2;
        const uint8_t* scales = page + kMxScales + e / kMxBlock * kMxTileRows;
        uint32_t codes[kPageRows];
        float sc[kPageRows];
#pragma unroll
        for (int j = 0; j < kPageRows; ++j) {
          const int row = (j + rot) % kPageRows;
          codes[j] = *reinterpret_cast<const uint32_t*>(block + row * kMxBlockBytes);
          sc[j] = e8m0(scales[row]);
        }
        float xv[B][8];
#pragma unroll
        for (int b = 0; b < B; ++b) {
          const float4 a = load_four(x + size_t(b) * r.k + k0 + e), c = load_four(x + size_t(b) * r.k + k0 + e + 4);
          xv[b][0] = a.x, xv[b][1] = a.y, xv[b][2] = a.z, xv[b][3] = a.w;
          xv[b][4] = c.x, xv[b][5] = c.y, xv[b][6] = c.z, xv[b][7] = c.w;
        }
#pragma unroll
        for (int j = 0; j < kPageRows; ++j) {
          float wv[8];
          e2m1x8_scaled(codes[j], wv);
#pragma unroll
          for (int b = 0; b < B; ++b) {
            float p0 = 0.f, p1 = 0.f;  // two chains of four
#pragma unroll
            for (int u = 0; u < 8; u += 2) {
              p0 = fmaf(wv[u], xv[b][u], p0);
              p1 = fmaf(wv[u + 1], xv[b][u + 1], p1);
            }
            acc[j][b] = fmaf(sc[j], p0 + p1, acc[j][b]);
          }
        }
      }
      release_page(&ring_ptr()->empty[slot]);
    }
    // Back to tile order, times 2^14: rotated by rot in three steps of 1, 2
    // and 4 slots (selects on fixed registers, not a local-memory array).
#pragma unroll
    for (int step = 1; step < kPageRows; step *= 2) {
      const bool move = (rot & step) != 0;
      float prev[kPageRows][B];
#pragma unroll
      for (int j = 0; j < kPageRows; ++j) {
#pragma unroll
        for (int b = 0; b < B; ++b) prev[j][b] = acc[j][b];
      }
#pragma unroll
      for (int j = 0; j < kPageRows; ++j) {
#pragma unroll
        for (int b = 0; b < B; ++b) acc[j][b] = move ? prev[(j - step + kPageRows) % kPageRows][b] : prev[j][b];
      }
    }
#pragma unroll
    for (int j = 0; j < kPageRows; ++j) {
#pragma unroll
      for (int b = 0; b < B; ++b) acc[j][b] *= kE2m1Unscale;
    }
    reduce_row_block<B>(acc, part[blk & 1], nr, cols, j0, warp, st);
  }
}

// ---------------------------------------------------------------------------
// The tensor-core consumers' per-token factors, complete for every consumer:
// rs[b] the RMSNorm scale of token b (1 without `norm`) and scale[b] the
// power of two that brings its largest |x'| under 2^top.
template <int B, class T>
__device__ void token_scales(const T* x, uint32_t k, const __nv_bfloat16* norm, float eps, int top, float* rs,
                             float* scale, const uint8_t* rows = nullptr) {
  for (int b = 0; b < B; ++b) {
    const T* xb = x + token_row(rows, b) * k;
    float ss = 0.f;
    if (norm != nullptr) {
      for (uint32_t e = threadIdx.x; e < k; e += kConsumerThreads) {
        const float v = to_float(xb[e]);
        ss = fmaf(v, v, ss);
      }
      ss = block_sum(ss);
    }
    const float r = norm != nullptr ? rsqrtf(ss / float(k) + eps) : 1.f;
    float m = 0.f;
    for (uint32_t e = threadIdx.x; e < k; e += kConsumerThreads) {
      m = fmaxf(m, fabsf(to_float(xb[e]) * r * (norm != nullptr ? bf(norm[e]) : 1.f)));
    }
    m = block_max(m);
    if (threadIdx.x == 0) {
      rs[b] = r;
      const int e = m > 0.f ? max(-100, min(100, ilogbf(m) + 1)) : 0;  // m < 2^e
      scale[b] = ldexpf(1.f, top - e);
    }
  }
  consumer_sync();
}

// The page loop of the MXFP4 tensor-core consumers. Their MMAs take the
// weights as A, 16 rows: rows g and g + 8 are row g of two of a task's row
// tiles (2i and 2i + 1), one page each a chunk, at the same 32-element block,
// so that every product of the result is wanted (A's rows g + 8 were once the
// same tile's next block, half of each result that block against the other's
// activations, discarded: at batch 8 the consumer streamed half the HBM rate
// on an H100). A warp takes blocks q = warp, warp + 8, ... of a chunk (its 32
// code words of a block, one a lane, are the block's 128 contiguous bytes in
// the page); `block(page0, page1, two, kb, q, acc)` adds block q of the pages
// (block kb of the input) into the lane's acc[2][N] (tile 2i's, 2i + 1's;
// page1 is page0 when the tile runs alone), and `sums(acc, h, mine)`, called by every lane, writes tile h's
// into the warp's partial sums mine [row, token]. A task's last tile, when
// their number is odd, runs alone, as every tile does when a tile takes
// kPages chunks or more (its two pages of a chunk, a tile's chunks apart in
// the ring, would not both fit it). The groups' sums over the warps follow
// (sum_block_group).
template <int B, int N, class Block, class Sums>
__device__ __forceinline__ void mx_tile_pairs(const MxRows& r, uint32_t& it, int warp, float* st, Block block,
                                              Sums sums) {
  constexpr uint32_t kBlockSums = kConsumerWarps * kPageRows * B;  // one row block's partial sums
  constexpr uint32_t G = kSumGroup<B>;
  static_assert(G % 2 == 0, "a pair of tiles' sums in one group");
  static_assert(2 * G * kBlockSums * sizeof(float) <= kScratchBytes, "two groups of partial sums fit scratch");
  float* part = reinterpret_cast<float*>(scratch_ptr());  // [2][G][warp][row, token]
  const uint32_t cols = r.cols();
  const uint32_t chunks = (r.k + kMxK - 1) / kMxK;
  const uint32_t tiles = (cols + kPageRows - 1) / kPageRows;  // a page each a chunk
  for (uint32_t tile = 0; tile < tiles;) {
    const bool two = tile + 1 < tiles && chunks < uint32_t(kPages);
    float acc[2][N] = {};
    for (uint32_t ch = 0; ch < chunks; ++ch) {
      const uint32_t k0 = ch * kMxK, n = min(kMxK, r.k - k0) / kMxBlock;  // the chunk's blocks
      const uint32_t it0 = it + ch, it1 = it + chunks + ch;                // the two tiles' pages of the chunk
      const int s0 = it0 % kPages, s1 = it1 % kPages;
      wait_page(it0);
      if (two) wait_page(it1);
      const auto* page0 = reinterpret_cast<const uint8_t*>(ring_ptr()->page[s0]);
      const auto* page1 = two ? reinterpret_cast<const uint8_t*>(ring_ptr()->page[s1]) : page0;
#pragma unroll 4  // four blocks in flight
      for (uint32_t q = warp; q < n; q += kConsumerWarps) block(page0, page1, two, k0 / kMxBlock + q, q, acc);
      release_page(&ring_ptr()->empty[s0]);
      if (two) release_page(&ring_ptr()->empty[s1]);
    }
    it += two ? 2 * chunks : chunks;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (h == 1 && !two) break;
      const uint32_t t = tile + h, group = t / G, in_group = t % G;
      sums(acc, h, part + ((group & 1) * G + in_group) * kBlockSums + warp * kPageRows * B);
    }
    const uint32_t last = two ? tile + 1 : tile;  // the pair's tiles are in one group (G even, tile even)
    tile = last + 1;
    if (last % G + 1 < G && tile < tiles) continue;
    sum_block_group<B, G>(part, last / G, last % G, cols, st);  // the group's sums over the warps, in a fixed order
  }
}

// Lane (g, t)'s code word of row g of a page's tile in block q (elements 8t
// .. 8t + 7 of the block), and that row's block scale.
__device__ __forceinline__ uint32_t mx_word(const uint8_t* page, uint32_t q) {
  const int lane = threadIdx.x % 32;
  return *reinterpret_cast<const uint32_t*>(page + (lane / 4) * kMxBlockBytes + 4 * (lane % 4) + q * kMxTileBlockBytes);
}
__device__ __forceinline__ float mx_scale(const uint8_t* page, uint32_t q) {
  return e8m0(page[kMxScales + q * kMxTileRows + (threadIdx.x % 32) / 4]);
}

// MXFP4 rows on the tensor cores at batch 1 and 2: mma.sync m16n8k32 with int8
// inputs and exact int32 sums, the weights as A (mx_tile_pairs: A's rows g and
// g + 8 are row g of two tiles, k one block). Twice an e2m1 value is an
// integer (0, 1, 2, 3, 4, 6, 8, 12 and their negatives), looked up by `prmt`
// with the code as the selector, the positive and the negative codes apart
// (A = A+ - A-, two MMAs, the second against the negated activations); the
// activations go in as int8 parts, x' s = q0 + q1 / 128 + q2 / 128^2 + ...
// (s a power of two per token that brings its largest under 128), four parts
// (28 bits: exact for fp32 activations). Lane (g, t)'s code word holds its
// k-slots 4t..4t+3 (elements 8t..8t+3) and 16+4t..16+4t+3 (8t+4..8t+7). B's
// eight columns are n = 4b + j, token b's part j (at batch 1 the last four
// are zeros). Lane (g, t) holds row g of both tiles for columns 2t and 2t + 1,
// token t / 2's parts j = 2 (t % 2) and j + 1, as 128 d_j + d_j+1 (exact in an
// int32 and in an fp32), converts that once and multiplies it by its row's
// block scale; lanes t and t ^ 1 add their parts at the end. The negated parts
// are staged beside the parts, so the second MMA adds to the first.

// prmt's table: 2 e2m1 for the magnitudes 0 to 7, a byte each.
constexpr uint32_t kE2m1x2Lo = 0x03020100u, kE2m1x2Hi = 0x0C080604u;
__device__ __forceinline__ uint32_t e2m1x2_lookup(uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(kE2m1x2Lo), "r"(kE2m1x2Hi), "r"(sel));
  return d;
}

// Eight e2m1 codes (element i in bits 4i..4i+3 of c) as int8 values 2 e2m1,
// apart by sign: pos[0] holds elements 0..3 where positive (0 elsewhere),
// pos[1] elements 4..7; neg the magnitudes of the negative ones. prmt takes
// a selector nibble's low three bits as the byte to copy and its top bit as
// "replicate that byte's sign bit" (0 here): the code's sign bit zeroes the
// elements of the other sign.
__device__ __forceinline__ void e2m1x8_s8(uint32_t c, uint32_t (&pos)[2], uint32_t (&neg)[2]) {
  const uint32_t n = c ^ 0x88888888u;
  pos[0] = e2m1x2_lookup(c);
  pos[1] = e2m1x2_lookup(c >> 16);
  neg[0] = e2m1x2_lookup(n);
  neg[1] = e2m1x2_lookup(n >> 16);
}

// The staged B fragments, for block q of the input (k / 32 blocks) and lane
// (g, t) whose column is a token's part (the first kLanes lanes): the k-slots
// 4t.. and 16+4t.. of column g's part, then their negations, at frags[q *
// kLanes + lane] (the other lanes read zeros, not memory); mx_rows_compute
// checks that they fit the input's area. `unscale[b]` undoes token b's power
// of two and the decode's factor 2.
template <int B>
struct MxFrags {
  static constexpr int kParts = 4;  // int8 parts of an activation
  static constexpr uint32_t kLanes = 4 * B * kParts;
  static_assert(B * kParts <= 8, "a column a token's part");
  // The fragments' bytes for an input k wide (a multiple of 32).
  __host__ __device__ static constexpr size_t bytes(uint32_t k) { return size_t(k / 32) * kLanes * sizeof(uint4); }
  const uint4* frags;
  float unscale[B];
};

template <int B, class T>
__device__ void stage_mx_frags(const T* x, uint32_t k, const __nv_bfloat16* norm, float eps, float* area,
                               MxFrags<B>& out, const uint8_t* rows = nullptr) {
  using F = MxFrags<B>;
  __shared__ float rs[B], scale[B];
  token_scales<B>(x, k, norm, eps, 7, rs, scale, rows);
  auto* frags = reinterpret_cast<uint4*>(area);
  // A thread per (block, token, t): eight elements, their parts to four lanes.
  for (uint32_t i = threadIdx.x; i < k / 32 * B * 4; i += kConsumerThreads) {
    const uint32_t q = i / (B * 4), b = i / 4 % B, t = i % 4, e0 = q * 32 + 8 * t;
    float r[8];
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const uint32_t e = e0 + u;
      r[u] = to_float(x[token_row(rows, b) * k + e]) * rs[b] * (norm != nullptr ? bf(norm[e]) : 1.f) * scale[b];
    }
#pragma unroll
    for (int j = 0; j < F::kParts; ++j) {  // part j, then what it leaves, times 128
      uint32_t p[2] = {0u, 0u}, np[2] = {0u, 0u};
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        const int part = max(-127, min(127, __float2int_rn(r[u])));
        r[u] = (r[u] - float(part)) * 128.f;
        p[u / 4] |= uint32_t(part & 0xFF) << (8 * (u % 4));
        np[u / 4] |= uint32_t(-part & 0xFF) << (8 * (u % 4));
      }
      frags[q * F::kLanes + (4 * b + j) * 4 + t] = make_uint4(p[0], p[1], np[0], np[1]);
    }
  }
  consumer_sync();
  out.frags = frags;
  for (int b = 0; b < B; ++b) out.unscale[b] = 0.5f / scale[b];
}

// The page loop of mx_rows_compute on the tensor cores at batch 1 and 2: rows
// of y = x' W^T into st [B, cols] from the fragments `a` staged by
// stage_mx_frags; the layout is described above e2m1x8_s8.
template <int B>
__device__ void mx_rows_pages_mma(const MxRows& r, const MxFrags<B>& a, uint32_t& it, int warp, float* st) {
  static_assert(B <= 2, "the int8 tensor-core consumer takes batch 1 and 2");
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  // The lane's parts j, j + 1 (j = 2 (t % 2)), summed as 128 d_j + d_j+1: 128^-(j+1) each.
  const float unit = t % 2 == 1 ? 1.f / (128.f * 128.f * 128.f) : 1.f / 128.f;
  const bool has_b = uint32_t(lane) < MxFrags<B>::kLanes;  // whether this lane's B column is a token's part
  const int b = t / 2;                                       // the token of this lane's columns
  auto block = [&](const uint8_t* page0, const uint8_t* page1, bool two, uint32_t kb, uint32_t q, float (&acc)[2][1]) {
    uint32_t pos0[2], neg0[2], pos1[2], neg1[2];  // A: row g of the first tile, of the second (zero when alone)
    e2m1x8_s8(mx_word(page0, q), pos0, neg0);
    e2m1x8_s8(two ? mx_word(page1, q) : 0u, pos1, neg1);
    const uint4 f = has_b ? a.frags[kb * MxFrags<B>::kLanes + lane] : make_uint4(0u, 0u, 0u, 0u);
    uint32_t d[4] = {};  // A+ x, then A- (-x) added
    cute::SM80_16x8x32_S32S8S8S32_TN::fma(d[0], d[1], d[2], d[3], pos0[0], pos1[0], pos0[1], pos1[1], f.x, f.y, d[0],
                                          d[1], d[2], d[3]);
    cute::SM80_16x8x32_S32S8S8S32_TN::fma(d[0], d[1], d[2], d[3], neg0[0], neg1[0], neg0[1], neg1[1], f.z, f.w, d[0],
                                          d[1], d[2], d[3]);
    acc[0][0] = fmaf(mx_scale(page0, q), float(int(d[0]) * 128 + int(d[1])), acc[0][0]);
    acc[1][0] = fmaf(mx_scale(page1, q), float(int(d[2]) * 128 + int(d[3])), acc[1][0]);
  };
  auto sums = [&](const float (&acc)[2][1], int h, float* mine) {
    float v = acc[h][0] * unit;
    v += __shfl_xor_sync(0xffffffffu, v, 1);  // the token's other two parts
    if (t % 2 == 0 && b < B) mine[g * B + b] = v * a.unscale[b];
  };
  mx_tile_pairs<B, 1>(r, it, warp, st, block, sums);
}

// MXFP4 rows on the tensor cores at batch 3 to 8: mma.sync m16n8k16, fp16
// inputs, fp32 accumulation, the weights as A (mx_tile_pairs: A's rows g and
// g + 8 are row g of two tiles, a block two MMAs); B's eight columns are the
// block's activations, a column a token's fp16 part (two parts, n = 2b + l:
// batch 3 and 4, the products keep about 22 bits of the fp32 activation; one
// part, n = b: batch 5 to 8, below). Lane (g, t) holds row g of both tiles
// for columns 2t and 2t + 1 (d0 d1 and d2 d3), each times its row's block
// scale. Within a block, lane t's k-slots (2t, 2t+1, 2t+8, 2t+9) of the first
// MMA are elements (8t, 8t+4, 8t+1, 8t+5) and of the second (8t+2, 8t+6,
// 8t+3, 8t+7): the order e2m1x8_half2's fp16 pairs come in, so A is one code
// word a row a block.

// Eight e2m1 codes as four fp16 pairs times 2^-14 (e2m1x8_scaled's bits):
// pair i holds elements i and i + 4.
__device__ __forceinline__ void e2m1x8_half2(uint32_t c, uint32_t (&h)[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t q = c << (12 - 4 * i);
    h[i] = (q & 0x80008000u) | ((q >> 3) & 0x0E000E00u);
  }
}

// With one part (kParts 1: batch 5 to 8, whose two-part fragments outgrow
// shared memory at K3's widths and would be read from L2 at every page) a
// column is a token, the fp16 rounding of its scaled activation (11 bits:
// 2-3e-4 of the largest output in device/tests/mx_mma_layout.py, finer than
// bf16 activations): half the fragments a token.
//
// The staged B fragments, for block q of the input (k / 32 blocks) and lane
// (g, t) whose column is a token's part (the first kLanes lanes): four words
// (the two MMAs' b0b1 and b2b3) at frags[q * kLanes + lane] (the other lanes
// read zeros, not memory); mx_rows_compute checks that they fit the input's
// area. Token b's
// values are scaled by the power of two that brings its largest to [2^13,
// 2^14) (inside fp16's range); `unscale[b]` undoes it and the decode's 2^-14.
template <int B, int kParts = 2>
struct MxHalfFrags {
  static_assert(kParts == 1 || kParts == 2, "an activation in one or two fp16 parts");
  static_assert(B * kParts <= 8, "a column a token's part");
  static constexpr uint32_t kLanes = 4 * B * kParts;
  // The fragments' bytes for an input k wide (a multiple of 32).
  __host__ __device__ static constexpr size_t bytes(uint32_t k) { return size_t(k / 32) * kLanes * sizeof(uint4); }
  const uint4* frags;
  float unscale[B];
};

template <int B, int kParts, class T>
__device__ void stage_mx_half_frags(const T* x, uint32_t k, const __nv_bfloat16* norm, float eps, float* area,
                                    MxHalfFrags<B, kParts>& out, const uint8_t* rows = nullptr) {
  constexpr uint32_t kLanes = MxHalfFrags<B, kParts>::kLanes;
  __shared__ float rs[B], scale[B];
  token_scales<B>(x, k, norm, eps, 14, rs, scale, rows);
  uint4* frags = reinterpret_cast<uint4*>(area);
  for (uint32_t i = threadIdx.x; i < k / 32 * kLanes; i += kConsumerThreads) {
    const uint32_t q = i / kLanes, lane = i % kLanes, g = lane / 4, t = lane % 4;
    // Column g: token b's part l.
    const uint32_t b = kParts == 2 ? g / 2 : g, l = kParts == 2 ? g % 2 : 0, e0 = q * 32 + 8 * t;
    float v[8];
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const uint32_t e = e0 + u;
      v[u] = to_float(x[token_row(rows, b) * k + e]) * rs[b] * (norm != nullptr ? bf(norm[e]) : 1.f) * scale[b];
      const float hi = __half2float(__float2half_rn(v[u]));
      v[u] = l == 0 ? hi : v[u] - hi;
    }
    auto pack = [](float lo, float hi) {
      const __half2 h2 = __floats2half2_rn(lo, hi);
      return *reinterpret_cast<const uint32_t*>(&h2);
    };
    frags[i] = make_uint4(pack(v[0], v[4]), pack(v[1], v[5]), pack(v[2], v[6]), pack(v[3], v[7]));
  }
  consumer_sync();
  out.frags = frags;
  for (int b = 0; b < B; ++b) out.unscale[b] = kE2m1Unscale / scale[b];
}

// The page loop of mx_rows_compute on the tensor cores at batch 3 to 8: rows
// of y = x' W^T into st [B, cols] from the fragments `a` staged by
// stage_mx_half_frags; the layout is described above e2m1x8_half2.
template <int B, int kParts>
__device__ void mx_rows_pages_hmma(const MxRows& r, const MxHalfFrags<B, kParts>& a, uint32_t& it, int warp,
                                   float* st) {
  constexpr int kKept = 3 - kParts;  // tokens of a lane's two columns: 1 (two parts, summed) or 2
  static_assert(B >= 3 && B <= 8, "the fp16 tensor-core consumer takes batch 3 to 8");
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int b0 = kParts == 2 ? t : 2 * t;               // the token of this lane's first column
  constexpr uint32_t kLanes = MxHalfFrags<B, kParts>::kLanes;
  const bool has_b = uint32_t(lane) < kLanes;  // whether this lane's B column is a token's part
  auto block = [&](const uint8_t* page0, const uint8_t* page1, bool two, uint32_t kb, uint32_t q,
                   float (&acc)[2][kKept]) {
    uint32_t lo[4], hi[4];  // A: row g of the first tile, of the second (zero when alone)
    e2m1x8_half2(mx_word(page0, q), lo);
    e2m1x8_half2(two ? mx_word(page1, q) : 0u, hi);
    const float sc0 = mx_scale(page0, q), sc1 = mx_scale(page1, q);
    const uint4 f = has_b ? a.frags[kb * kLanes + lane] : make_uint4(0u, 0u, 0u, 0u);
    float d0 = 0.f, d1 = 0.f, d2 = 0.f, d3 = 0.f;
    cute::SM80_16x8x16_F32F16F16F32_TN::fma(d0, d1, d2, d3, lo[0], hi[0], lo[1], hi[1], f.x, f.y, d0, d1, d2, d3);
    cute::SM80_16x8x16_F32F16F16F32_TN::fma(d0, d1, d2, d3, lo[2], hi[2], lo[3], hi[3], f.z, f.w, d0, d1, d2, d3);
    if constexpr (kParts == 2) {  // columns 2t, 2t + 1: token t's two parts
      acc[0][0] = fmaf(sc0, d0 + d1, acc[0][0]);
      acc[1][0] = fmaf(sc1, d2 + d3, acc[1][0]);
    } else {  // tokens 2t and 2t + 1
      acc[0][0] = fmaf(sc0, d0, acc[0][0]);
      acc[0][1] = fmaf(sc0, d1, acc[0][1]);
      acc[1][0] = fmaf(sc1, d2, acc[1][0]);
      acc[1][1] = fmaf(sc1, d3, acc[1][1]);
    }
  };
  auto sums = [&](const float (&acc)[2][kKept], int h, float* mine) {
#pragma unroll
    for (int i = 0; i < kKept; ++i)
      if (b0 + i < B) mine[g * B + b0 + i] = acc[h][i] * a.unscale[b0 + i];
  };
  mx_tile_pairs<B, kKept>(r, it, warp, st, block, sums);
}

// MXFP4 rows of y = x' W^T, x' = x or RMSNorm(x) * norm: on the tensor cores
// at batch 1 and 2 (int8, the input staged as four parts), 3 and 4 (fp16, two
// parts) when the fragments fit the input's area, and 5 to 8 (fp16, one part)
// when they fit shared memory; otherwise on the CUDA cores (staged as fp32),
// in shared memory, or in `spill` when it does not fit (input_area).
//
// `tokens` picks the batch's tokens whose rows are computed (a routed
// expert's: those that chose it): up to kMaxPicked of them, the consumer runs
// at the batch of the picked tokens, their rows gathered as it stages the
// input, so an expert chosen by one token of eight costs one token's work (and
// gets the int8 parts' precision), and its sums are moved to their tokens'
// rows of st after; the other rows of st are zero.
template <class T>
struct MxRowsCompute {
  MxRows rows;                // the task's weight rows (mx_rows_load streams them)
  const T* x;                 // [B, rows.k] the input
  const __nv_bfloat16* norm;  // [rows.k] the RMSNorm prologue's weight, or null: no prologue
  float eps;                  // the prologue's epsilon
  float* spill;               // where the input is staged when it does not fit shared memory (or null)
  uint32_t tokens = ~0u;      // bit b: token b's row is computed (the others are zero)
};
template <int B, class T>
__device__ void mx_rows_compute_picked(const MxRowsCompute<T>& a, const uint8_t* rows, uint32_t& it, int warp,
                                       float* st) {
  const MxRows& r = a.rows;
  // The tensor cores' fragments take 64 bytes a 32-element block a column (a
  // token's part: four at batch 1 and 2, two at 3 and 4, one from 5): twice
  // the fp32 input's size at batch 1 and 2, its size at 3 and 4, half of it
  // from 5 (in the activation area). At K3's widths (k <= 3584) they fit the
  // input's area at batch 1 to 6 and 8; at 7 where the input fits shared
  // memory.
  const size_t area = input_fits<B>(r.k) ? size_t(kActivationBytes) : size_t(B) * r.k * sizeof(float);
  if constexpr (B <= 2) {
    if (MxFrags<B>::bytes(r.k) <= area) {
      MxFrags<B> frags;
      stage_mx_frags<B>(a.x, r.k, a.norm, a.eps, input_area<B>(r.k, a.spill), frags, rows);
      mx_rows_pages_mma<B>(r, frags, it, warp, st);
      return;
    }
  } else if constexpr (B <= 4) {
    if (MxHalfFrags<B>::bytes(r.k) <= area) {
      MxHalfFrags<B> frags;
      stage_mx_half_frags<B>(a.x, r.k, a.norm, a.eps, input_area<B>(r.k, a.spill), frags, rows);
      mx_rows_pages_hmma<B>(r, frags, it, warp, st);
      return;
    }
  } else if constexpr (B <= 8) {
    // One fp16 part a token, in shared memory (the activation area) where it fits.
    if (MxHalfFrags<B, 1>::bytes(r.k) <= size_t(kActivationBytes)) {
      MxHalfFrags<B, 1> frags;
      stage_mx_half_frags<B>(a.x, r.k, a.norm, a.eps, activation_ptr(), frags, rows);
      mx_rows_pages_hmma<B>(r, frags, it, warp, st);
      return;
    }
  }
  mx_rows_pages<B>(r, stage_input<B>(a.x, r.k, a.norm, a.eps, input_area<B>(r.k, a.spill), rows), it, warp, st);
}

// The picked tokens' rows of st [B, cols], computed into its first n rows, moved
// to their tokens' rows (the last first: a token's row is at or past its
// place among the picked), the rest zeroed; a thread a column. n = 0: the rows
// are in place, the others are zeroed.
//
// The consumer runs at the picked tokens' batch up to kMaxPicked of them, at
// the whole batch above. On an H100 (2026-12-07, `0a7787e`, two row tiles an
// MMA) in isolation (device/tests/ring_bench.cu) the consumer at batch 8
// streams 1.81 TB/s, one picked token 2.75, two 2.52; three and four take the
// whole batch's path. Before the two-tile consumers, a consumer for every
// picked count made K3 per-layer dims' expert stages at batch 8 16% slower
// inside the megakernel than the whole batch (each consumer adds code and
// stack; three and four picked then streamed 1.68 and 1.64 alone, against
// 1.50 for the whole batch), and with two no slower. Real K3's 896 experts
// take one or two tokens each at batch 8.
constexpr int kMaxPicked = 2;
template <int B>
__device__ void spread_picked_rows(uint32_t tokens, const uint8_t* rows, uint32_t n, uint32_t cols, float* st) {
  consumer_sync();
  for (uint32_t c = threadIdx.x; c < cols; c += kConsumerThreads) {
    for (int j = int(n) - 1; j >= 0; --j) st[size_t(rows[j]) * cols + c] = st[size_t(j) * cols + c];
#pragma unroll
    for (int b = 0; b < B; ++b)
      if (!(tokens >> b & 1)) st[size_t(b) * cols + c] = 0.f;
  }
}

// A routed expert's consumer at the batch of the tokens that chose it:
// `run.template operator()<N>(rows)` computes the rows of the N tokens rows[0..N)
// (null: the whole batch, N = B) into the first N rows of st [B, cols], which
// are then moved to their tokens' rows and the others zeroed
// (spread_picked_rows). Up to kMaxPicked tokens (and fewer than B) take their
// own batch; more, the whole batch's consumer, the others' rows zeroed after.
// All tokens, or none (a task without rows, which streams no page): the whole
// batch's, as computed.
template <int B, class F>
__device__ void run_picked(uint32_t tokens, uint32_t cols, float* st, F run) {
  static_assert(B < 32, "a token a bit of `tokens`");
  constexpr uint32_t kAll = (1u << B) - 1;
  tokens &= kAll;
  if (tokens == kAll || tokens == 0) {
    run.template operator()<B>(nullptr);
    return;
  }
  const uint32_t n = __popc(tokens);
  constexpr int kPicked = B - 1 < kMaxPicked ? B - 1 : kMaxPicked;
  if (n > uint32_t(kPicked)) {
    run.template operator()<B>(nullptr);
    spread_picked_rows<B>(tokens, nullptr, 0, cols, st);
    return;
  }
  __shared__ uint8_t rows[B];
  if (threadIdx.x < uint32_t(B) && (tokens >> threadIdx.x & 1))
    rows[__popc(tokens & ((1u << threadIdx.x) - 1))] = uint8_t(threadIdx.x);
  consumer_sync();
  // The consumer at the picked tokens' batch: n <= kPicked here.
  [&]<int... N>(std::integer_sequence<int, N...>) {
    ((n == uint32_t(N + 1) ? run.template operator()<N + 1>(static_cast<const uint8_t*>(rows)) : void()), ...);
  }(std::make_integer_sequence<int, kPicked>{});
  spread_picked_rows<B>(tokens, rows, n, cols, st);
}

template <int B, class T>
__device__ void mx_rows_compute(MxRowsCompute<T> a, uint32_t& it, int warp, float* st) {
  run_picked<B>(a.tokens, a.rows.cols(), st, [&]<int N>(const uint8_t* rows) {
    mx_rows_compute_picked<N>(a, rows, it, warp, st);
  });
}

}  // namespace mkc
