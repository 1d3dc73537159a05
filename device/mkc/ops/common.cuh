// mkc device library, shared pieces: the consumers' conventions, the
// memory view a step reads and writes, reductions, conversions, the
// embedding.
//
// Conventions: see ops.cuh.
#pragma once

#include <cuda_bf16.h>

#include <climits>
#include <type_traits>
#include <cstdint>

#include "../instruction.cuh"
#include "../projection.cuh"

namespace mkc {

constexpr int kConsumerThreads = kConsumerWarps * 32;
// The shared memory beside the page ring (kScratchBytes: attention, experts,
// routing) and the projections' staged activations (kActivationBytes):
// contract.h.

struct Peers;  // ops/exchange.cuh

// Everything a step reads and writes, as the runtime resolved it.
struct Memory {
  void* const* w;            // weight tensors, in the plan file's weight-table order
  char* arena;               // values crossing operations (the plan's buffers)
  void* const* state;        // per-sequence state (KV caches), [batch, ...] each
  void* const* out;          // graph outputs, [batch, ...] each
  const int32_t* tokens;     // [batch] the tokens of this step
  const int32_t* pos;        // [batch] tokens already in each sequence
  float* staging;            // fp32 projection tiles, one slice per SM
  const TaskArgs* tasks;     // every plan task
  const StageRecord* stages; // every plan stage
  const uint64_t* params;    // the stages' parameters
  // Several GPUs (an expert-parallel program): this GPU's place and its
  // peers' inboxes and counters (ops/exchange.cuh); null on one GPU.
  const Peers* peers = nullptr;
};

// A stage's parameters as its kind's struct P (all uint64_t fields), by value.
template <class P>
__device__ __forceinline__ P stage_params(const Memory& m, const TaskArgs& t) {
  static_assert(sizeof(P) % sizeof(uint64_t) == 0, "parameter structs hold uint64_t fields");
  return *reinterpret_cast<const P*>(m.params + m.stages[t.stage].params);
}

// Fetches the line of `p` into L1 without waiting for it.
__device__ __forceinline__ void prefetch_l1(const void* p) { asm volatile("prefetch.global.L1 [%0];" ::"l"(p)); }

__device__ __forceinline__ void consumer_sync() { asm volatile("bar.sync 3, %0;" ::"r"(kConsumerThreads) : "memory"); }

__device__ inline unsigned char* scratch_ptr() {
  extern __shared__ __align__(128) unsigned char mkc_smem[];
  return mkc_smem + sizeof(Ring);
}
__device__ inline float* activation_ptr() { return reinterpret_cast<float*>(scratch_ptr() + kScratchBytes); }

__device__ __forceinline__ float bf(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float sigmoid(float x) { return 1.f / (1.f + expf(-x)); }
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
// One round of warp_sum_scatter: H values held, the half this lane keeps
// (by lane bit m) summed with the partner's copy of it.
template <int H, int N>
__device__ __forceinline__ void scatter_round(float (&v)[N], int m, int& first) {
  constexpr int h = H / 2;
  const bool up = (threadIdx.x & m) != 0;
#pragma unroll
  for (int i = 0; i < h; ++i) {
    const float send = up ? v[i] : v[i + h];
    const float keep = up ? v[i + h] : v[i];
    v[i] = keep + __shfl_xor_sync(0xffffffffu, send, m);
  }
  if (up) first += h;
}
template <int N>
__device__ __forceinline__ int warp_sum_scatter(float (&v)[N]) {
  static_assert(N > 0 && (N & (N - 1)) == 0, "a power of two");
  int first = 0;
  if constexpr (N >= 2) scatter_round<N>(v, 16, first);
  if constexpr (N >= 4) scatter_round<N / 2>(v, 8, first);
  if constexpr (N >= 8) scatter_round<N / 4>(v, 4, first);
  if constexpr (N >= 16) scatter_round<N / 8>(v, 2, first);
  if constexpr (N >= 32) scatter_round<N / 16>(v, 1, first);
  for (int m = 16 / N; m > 0; m /= 2) v[0] += __shfl_xor_sync(0xffffffffu, v[0], m);
  return first;
}
// Whether this lane is the one that stores its group after warp_sum_scatter<N>.
template <int N>
__device__ __forceinline__ bool scatter_owner() {
  if constexpr (N >= 32) {
    return true;
  } else {
    return (threadIdx.x % 32) % (32 / N) == 0;
  }
}

__device__ __forceinline__ float warp_max(float v) {
  for (int off = 16; off > 0; off /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}

// A reduction with `op` over all consumer threads (the warp's lanes, then
// the warps' values in order); every consumer gets the result.
template <class Op>
__device__ inline float block_reduce(float v, Op op) {
  __shared__ float part[kConsumerWarps];
  __shared__ float total;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int off = 16; off > 0; off /= 2) v = op(v, __shfl_xor_sync(0xffffffffu, v, off));
  if (lane == 0) part[warp] = v;
  consumer_sync();
  if (threadIdx.x == 0) {
    float r = part[0];
    for (int w = 1; w < kConsumerWarps; ++w) r = op(r, part[w]);
    total = r;
  }
  consumer_sync();
  const float r = total;
  consumer_sync();
  return r;
}

// Sum over all consumer threads; every consumer gets the result.
__device__ inline float block_sum(float v) {
  return block_reduce(v, [](float a, float b) { return a + b; });
}

// Maximum over all consumer threads; every consumer gets the result.
__device__ inline float block_max(float v) {
  return block_reduce(v, [](float a, float b) { return fmaxf(a, b); });
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
template <class T>
struct Embedding {
  const __nv_bfloat16* table;  // [vocab, hidden]
  const int32_t* tokens;       // [B]
  uint32_t hidden;             // a row's width
  T* out;                      // [B, hidden]
};
// Eight columns a thread at a time (one 16-byte load of the row, four loads
// of each thread in flight before their stores) where rows are whole 16-byte
// pieces; an element at a time otherwise. One task (one SM) copies the whole
// batch's rows: an element a thread at a time, batch 4 of K3's took 72 us on
// the H100.
template <int B, class T>
__device__ void embedding(Embedding<T> a) {
  if (a.hidden % 8 != 0) {
    for (uint32_t i = threadIdx.x; i < B * a.hidden; i += kConsumerThreads) {
      const uint32_t b = i / a.hidden, e = i % a.hidden;
      a.out[i] = from_float<T>(bf(a.table[size_t(a.tokens[b]) * a.hidden + e]));
    }
    return;
  }
  constexpr uint32_t U = 4;
  const uint32_t chunks = a.hidden / 8, total = uint32_t(B) * chunks;
  for (uint32_t i0 = threadIdx.x; i0 < total; i0 += U * kConsumerThreads) {
    uint4 v[U];
#pragma unroll
    for (uint32_t u = 0; u < U; ++u) {
      const uint32_t i = i0 + u * kConsumerThreads;
      if (i < total) {
        const uint32_t b = i / chunks, c = i % chunks;
        v[u] = *reinterpret_cast<const uint4*>(a.table + size_t(a.tokens[b]) * a.hidden + 8 * c);
      }
    }
#pragma unroll
    for (uint32_t u = 0; u < U; ++u) {
      const uint32_t i = i0 + u * kConsumerThreads;
      if (i >= total) break;
      T* out = a.out + size_t(i) * 8;  // token b's columns 8 c .. + 7: [B, hidden] row-major
      if constexpr (std::is_same_v<T, __nv_bfloat16>) {
        *reinterpret_cast<uint4*>(out) = v[u];
      } else {
        const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v[u]);
        float f[8];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const float2 x = __bfloat1622float2(h[q]);
          f[2 * q] = x.x, f[2 * q + 1] = x.y;
        }
#pragma unroll
        for (int q = 0; q < 8; ++q) out[q] = from_float<T>(f[q]);
      }
    }
  }
}

}  // namespace mkc
