// mkc device runtime: the projection fused operation (output-row tiles of
// y = x W^T for a batch of up to 8 tokens), split into its two warp roles.
//
// The loader warp streams the task's weight rows into a ring of shared-memory
// pages with bulk copies completed on mbarriers; it never waits on dependency
// counters, so it runs ahead into the next instructions' weights while the
// consumers still work. Eight consumer warps take one row of each page each,
// multiply it with the activations (read through L2) and accumulate in fp32.
#pragma once

#include <cuda_bf16.h>

#include <cute/arch/copy_sm90_tma.hpp>
#include <cutlass/arch/barrier.h>

#include "contract.h"

namespace mkc {

// One projection task: rows [row0, row0 + rows) of W [n_out, k] (row-major,
// bf16), for `batch` tokens of x [batch, k], written to y [batch, n_out].
// Optional fusions, as the planner's rules place them:
//   prologue (norm_weight != nullptr): x is RMS-normalised per token first,
//     x' = bf16(x * rsqrt(mean(x^2) + eps) * norm_weight), recomputed by every
//     task from x instead of reading a normed copy;
//   epilogue (residual != nullptr): y = bf16(bf16(x' W^T) + residual).
struct ProjectionTask {
  const __nv_bfloat16* w;
  const __nv_bfloat16* x;
  __nv_bfloat16* y;
  uint32_t row0;
  uint32_t rows;
  uint32_t k;
  uint32_t n_out;
  uint32_t batch;
  const __nv_bfloat16* norm_weight = nullptr;
  float eps = 1e-6f;
  const __nv_bfloat16* residual = nullptr;  // [batch, n_out]
};

// kMaxBatch, kConsumerWarps, the page ring's kPageRows, kPageK, kPageBytes and
// kPages: contract.h (the planner reads the same definitions).
static_assert(kPageBytes == kPageRows * kPageK * 2, "a page holds kPageRows rows of kPageK bf16 weights");
static_assert(kPageRows <= 32, "rows_load copies a page's rows with one lane each");
// Who releases a page: every consumer thread after its own reads (each read
// then ordered before the loader's next copy by that thread's own arrive,
// which compute-sanitizer's racecheck follows: 0 hazards), or, with
// MKC_RELEASE_PER_WARP, one lane per warp after a __syncwarp (fewer arrives;
// racecheck does not follow __syncwarp and reports the page reads).
#ifndef MKC_RELEASE_PER_WARP
constexpr int kEmptyArrivals = kConsumerWarps * 32;
#else
constexpr int kEmptyArrivals = kConsumerWarps;
#endif

__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// A profiled step's marks of one instruction, [instruction, kProfileMarks] in
// %globaltimer nanoseconds (megakernel.cuh's Schedule::profile): the
// controller's and the storer's, and those consumer thread 0 takes at the
// task's pages (wait_page, release_page), where its input is staged and its
// pages stream.
enum ProfileMark : uint32_t {
  kMarkReady,        // the instruction's waits done (controller)
  kMarkFirstWait,    // its first page waited for: staging and prologue done (consumer thread 0)
  kMarkFirstPage,    // that page in hand
  kMarkLastRelease,  // its last page released: the epilogue follows
  kMarkEnd,          // its consumers done, stores fenced (storer)
  kMarkPages,        // how many pages consumer thread 0 waited for
  kProfileMarks
};
// Where consumer thread 0 writes the marks of the task it runs (null in an
// unprofiled step: ring_init clears it), and the pages it has waited for in
// the task so far (only thread 0 reads or writes these two); and the step the
// task is of (from 1 over the engine's life), which every consumer thread may
// read once the task has started (thread 0 writes it before the barrier that
// starts it).
struct TaskMarks {
  uint64_t* at;
  uint32_t pages;
  uint32_t step;
};
__device__ __forceinline__ TaskMarks& task_marks() {
  __shared__ TaskMarks marks;
  return marks;
}
__device__ __forceinline__ uint32_t current_step() { return task_marks().step; }

// Releases page `slot` after this thread's (warp's) reads of it: the reads
// (generic proxy) are ordered before the loader's next bulk copy (async
// proxy) into the page.
__device__ __forceinline__ void release_page(uint64_t* empty) {
  if (threadIdx.x == 0 && task_marks().at != nullptr) task_marks().at[kMarkLastRelease] = global_ns();
#ifndef MKC_RELEASE_PER_WARP
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  cutlass::arch::ClusterTransactionBarrier::arrive(empty);
#else
  __syncwarp();
  if (threadIdx.x % 32 == 0) {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    cutlass::arch::ClusterTransactionBarrier::arrive(empty);
  }
#endif
}

// An FP8 page's k chunk in scale blocks (fp8_rows.cuh: a page row holds
// twice the bf16 columns, as e4m3 codes).
constexpr int kPageScaleBlocks = kPageBytes / kPageRows / int(kFp8Block);

// The ring: pages and their full/empty barriers, shared by both roles, and
// each FP8 page's block scales (fp8_rows_load): those of the 128-row blocks of
// its first and its last row, for the blocks of its k chunk.
struct Ring {
  alignas(128) __nv_bfloat16 page[kPages][kPageRows * kPageK];
  alignas(8) uint64_t full[kPages];
  alignas(8) uint64_t empty[kPages];
  alignas(16) float fp8_scale[kPages][2][kPageScaleBlocks];
};
static_assert(sizeof(Ring) <= size_t(kPages) * kPageBytes + kRingExtraBytes, "the ring within the plan's bytes");

using Barrier = cutlass::arch::ClusterTransactionBarrier;

// The ring lives at the start of the kernel's dynamic shared memory.
__device__ inline Ring* ring_ptr() {
  extern __shared__ __align__(128) unsigned char mkc_smem[];
  return reinterpret_cast<Ring*>(mkc_smem);
}

// Waits until page `it` of the ring is in its slot (the slot's full barrier,
// at the phase of `it`'s pass round the ring); in a profiled step consumer
// thread 0 marks its task's first such wait, and counts them.
__device__ __forceinline__ void wait_page(uint32_t it) {
  TaskMarks& m = task_marks();
  const bool mark = threadIdx.x == 0 && m.at != nullptr;
  if (mark && m.pages == 0) m.at[kMarkFirstWait] = global_ns();
  Barrier::wait(&ring_ptr()->full[it % kPages], (it / kPages) & 1);
  if (mark) {
    if (m.pages == 0) m.at[kMarkFirstPage] = global_ns();
    ++m.pages;
  }
}

// Waits until the consumers have released the slot page `it` will fill (the
// slot's empty barrier, at the phase before `it`'s pass round the ring): the
// loader's side of wait_page.
__device__ __forceinline__ void wait_slot_free(uint32_t it) {
  Barrier::wait(&ring_ptr()->empty[it % kPages], ((it / kPages) & 1) ^ 1);
}

__device__ inline void ring_init(Ring& ring) {
  task_marks() = TaskMarks{nullptr, 0};
  for (int i = 0; i < kPages; ++i) {
    Barrier::init(&ring.full[i], 1);
    Barrier::init(&ring.empty[i], kEmptyArrivals);
  }
  cutlass::arch::fence_barrier_init();
}

// Projection rows: a task's weight rows, rows [r0, r1) of w0 and, for a
// gate/up pair, the same rows of w1 after them (tile columns [n, 2n)).
struct Rows {
  const __nv_bfloat16* w0;
  const __nv_bfloat16* w1;
  uint32_t r0, r1, k;
  __device__ uint32_t cols() const { return (r1 - r0) * (w1 != nullptr ? 2 : 1); }
  __device__ const __nv_bfloat16* row(uint32_t j) const {
    const uint32_t n = r1 - r0;
    return j < n ? w0 + size_t(r0 + j) * k : w1 + size_t(r0 + j - n) * k;
  }
};

// bf16 rows at batch 2 to 8 run on the tensor cores (rows_pages_mma, in
// ops/rows.cuh), which take a task's row blocks kRowsGroup at a time, the k
// chunks outer: the activations of a chunk serve the group's blocks. The
// group is kBlockGroup blocks, half that at batch 7 and 8 (two groups' partial
// sums must fit scratch). Batch 1 takes a row block at a time (the CUDA-core
// consumer). The loader and the consumer of a task agree on the order through
// kRowsGroup.
constexpr uint32_t kBlockGroup = 8;
// Row blocks whose partial sums are added over the warps together, two such
// groups in scratch ([2][group][warp][row, token]): kBlockGroup, or half of it
// where that does not fit (batch 7 and 8).
template <int B>
constexpr uint32_t kSumGroup =
    2 * kBlockGroup * kConsumerWarps * kPageRows * B * sizeof(float) <= size_t(kScratchBytes) ? kBlockGroup
                                                                                              : kBlockGroup / 2;
static_assert(2 * kSumGroup<8> * kConsumerWarps * kPageRows * 8 * sizeof(float) <= size_t(kScratchBytes),
              "batch 8's groups fit scratch");
template <int B>
constexpr bool kRowsMma = B >= 2 && B <= 8;
template <int B>
constexpr uint32_t kRowsGroup = kRowsMma<B> ? kSumGroup<B> : 1;

// Loader: streams the task's rows into the page ring (kPageRows rows of up to
// kPageK weights per page), `group` row blocks at a time: for each k chunk,
// the chunk of each block of the group (group 1: a block's chunks in turn).
// Lane 0 waits for the slot and arms its barrier; then lane j copies row j of
// the page, the page's copies issued side by side (one lane issuing them all
// in turn streamed at two thirds of the rate: device/tests/ring_bench.cu).
__device__ inline void rows_load_grouped(const Rows& r, uint32_t group, uint32_t& it) {
  const uint32_t lane = threadIdx.x % 32;
  const uint32_t cols = r.cols();
  for (uint32_t g0 = 0; g0 < cols; g0 += group * kPageRows) {
    const uint32_t g1 = min(cols, g0 + group * kPageRows);
    for (uint32_t k0 = 0; k0 < r.k; k0 += kPageK) {
      const uint32_t nk = min(uint32_t(kPageK), r.k - k0);
      for (uint32_t j0 = g0; j0 < g1; j0 += kPageRows, ++it) {
        const uint32_t nr = min(uint32_t(kPageRows), cols - j0);
        const int slot = it % kPages;
        if (lane == 0) {
          wait_slot_free(it);
          Barrier::arrive_and_expect_tx(&ring_ptr()->full[slot], nr * nk * 2);
        }
        __syncwarp();
        if (lane < nr) {
          cute::SM90_BULK_COPY_G2S::copy(r.row(j0 + lane) + k0, &ring_ptr()->full[slot],
                                         &ring_ptr()->page[slot][lane * kPageK], int32_t(nk * 2));
        }
      }
    }
  }
  __syncwarp();
}

// The loader of rows consumed at batch B (rows_compute<B> and the page loops
// under it).
template <int B>
__device__ inline void rows_load(const Rows& r, uint32_t& it) {
  rows_load_grouped(r, kRowsGroup<B>, it);
}

// Loader side of a ProjectionTask: its rows through the same loader; `it`
// is the ring position shared across instructions.
__device__ inline void projection_load(const ProjectionTask& t, uint32_t& it) {
  rows_load_grouped(Rows{t.w, nullptr, t.row0, t.row0 + t.rows, t.k}, 1, it);  // projection_compute's order
}

// The RMS prologue's per-token scale, computed by the consumer warps together.
__device__ inline void rms_scales(const ProjectionTask& t, int warp, float* scale /* [kMaxBatch] in smem */) {
  __shared__ float partial[kConsumerWarps][kMaxBatch];
  const int lane = threadIdx.x % 32;
  for (uint32_t b = 0; b < t.batch; ++b) {
    float ss = 0.f;
    for (uint32_t e = warp * 32 + lane; e < t.k; e += kConsumerWarps * 32) {
      const float v = __bfloat162float(t.x[size_t(b) * t.k + e]);
      ss = fmaf(v, v, ss);
    }
    for (int off = 16; off > 0; off /= 2) ss += __shfl_xor_sync(0xffffffffu, ss, off);
    if (lane == 0) partial[warp][b] = ss;
  }
  asm volatile("bar.sync 3, %0;" ::"r"(kConsumerWarps * 32) : "memory");
  if (warp == 0 && lane < int(t.batch)) {
    float ss = 0.f;
    for (int w = 0; w < kConsumerWarps; ++w) ss += partial[w][lane];
    scale[lane] = rsqrtf(ss / float(t.k) + t.eps);
  }
  asm volatile("bar.sync 3, %0;" ::"r"(kConsumerWarps * 32) : "memory");
}

// x[b, e] as the projection reads it: normed by the prologue if there is one.
__device__ __forceinline__ float2 input_pair(const ProjectionTask& t, const float* scale, uint32_t b, uint32_t e) {
  const float2 x = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&t.x[size_t(b) * t.k + e]));
  if (t.norm_weight == nullptr) return x;
  const float2 g = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&t.norm_weight[e]));
  // Rounded to bf16, as an unfused RMSNorm would store it.
  return make_float2(__bfloat162float(__float2bfloat16(x.x * scale[b] * g.x)),
                     __bfloat162float(__float2bfloat16(x.y * scale[b] * g.y)));
}

// Consumer side: warp `warp` (0..7) computes row r0 + warp of each row block.
__device__ inline void projection_compute(const ProjectionTask& t, uint32_t& it, int warp) {
  const int lane = threadIdx.x % 32;
  __shared__ float scale[kMaxBatch];
  if (t.norm_weight != nullptr) rms_scales(t, warp, scale);
  for (uint32_t r0 = 0; r0 < t.rows; r0 += kPageRows) {
    float acc[kMaxBatch] = {};
    for (uint32_t k0 = 0; k0 < t.k; k0 += kPageK, ++it) {
      const uint32_t nk = min(uint32_t(kPageK), t.k - k0);
      const int slot = it % kPages;
      wait_page(it);
      if (r0 + warp < t.rows) {
        const __nv_bfloat162* wrow = reinterpret_cast<const __nv_bfloat162*>(&ring_ptr()->page[slot][warp * kPageK]);
        for (uint32_t e = 2 * lane; e < nk; e += 64) {
          const float2 w2 = __bfloat1622float2(wrow[e / 2]);
          for (uint32_t b = 0; b < t.batch; ++b) {
            const float2 x2 = input_pair(t, scale, b, k0 + e);
            acc[b] = fmaf(w2.x, x2.x, fmaf(w2.y, x2.y, acc[b]));
          }
        }
      }
      release_page(&ring_ptr()->empty[slot]);
    }
    if (r0 + warp < t.rows) {
      for (uint32_t b = 0; b < t.batch; ++b) {
        float v = acc[b];
        for (int off = 16; off > 0; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off);
        if (lane == 0) {
          const size_t at = size_t(b) * t.n_out + t.row0 + r0 + warp;
          __nv_bfloat16 out = __float2bfloat16(v);
          if (t.residual != nullptr) out = __float2bfloat16(__bfloat162float(out) + __bfloat162float(t.residual[at]));
          t.y[at] = out;
        }
      }
    }
  }
}

}  // namespace mkc
