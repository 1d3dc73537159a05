// How fast the page ring streams weights on its own, one CTA per SM, the
// megakernel's warp layout and shared memory; no dependency counters. Each
// variant reads the same 2 GiB of bf16 rows [n, 7168] (every SM a contiguous
// share of the rows) and prints GB/s:
//   rows:        rows_load (8 rows x 2 KiB bulk copies per page) + rows_pages (the projection consumer, batch 1)
//   rows-idle:   rows_load, consumers only wait for and release each page
//   packed:      one 16 KiB bulk copy per page (contiguous weights), consumers only wait and release
//   pieces-8/rows_load: pieces-8's kernel with mkc::rows_load as its loader
//   rows-12288, rows-33792-global-x, rows-7168-global-x: rows + consumer at K3's dense widths, the
//                input in shared memory, or read from global memory as a spilled input
//   bN-fma-K, bN-mma-K[-global-x][-norm]: batch N at width K on the CUDA cores (rows_pages_fma, a
//                row block at a time) and on the tensor cores (rows_pages_mma, kRowsGroup blocks at
//                a time), the input in shared memory or in global memory, through an RMS prologue
//   pieces-N:    N rows per page, one bulk copy of 8192/N columns from each (the row's last piece
//                shorter), consumers only wait and release: how the copy size sets the rate
// and the MXFP4 variants, 2 GiB of codes and scales of rows [n, 3584] (K3's latent width; GB/s
// counts codes and scales):
//   mx:          mx_rows_load + mx_rows_compute (the routed experts' consumer: tensor cores), batch 1
//   mx-b4:       the same at batch 4
//   mx-fma:      mx_rows_load + mx_rows_pages (the CUDA-core consumer), batch 1
//   mx-b8:       mx_rows_compute at batch 8, every token
//   mx-b8-picked-N: the same, N tokens of the 8 picked (an expert's: the consumer at batch N up to
//                kMaxPicked, the whole batch past it)
//   mx-b3:       mx_rows_compute at batch 3
//   mx-fma-b8:   mx_rows_load + mx_rows_pages at batch 8
//   mx-idle:     mx_rows_load, consumers only wait for and release each page
// and the FP8 variants, 2 GiB of e4m3 codes of rows [n, 7168] (K2's hidden width) and their fp32
// block scales (one per 128 x 128; GB/s counts codes and scales):
//   fp8, fp8-bN: fp8_rows_load + the tensor-core consumer (fp8_rows_pages_mma, kFp8Group blocks at a
//                time), batch 1 and N, the input in shared memory or (batch 8) in global memory
// and the MLA split's variants, a cache of K2's 576-wide rows (2 GiB; GB/s counts the cache rows
// streamed), a KV split an SM, eight heads a task:
//   mla-idle-bN:  mla_split_load (a bulk copy a row, rows padded in the page), consumers only wait and
//                 release: the split's loader alone at batch N
//   mla-bN:       mla_split at batch N (the tensor-core folds), as a split task of the megakernel
// A measurement, not a test: nothing is asserted; the numbers go in docs/PERFORMANCE.md. MKC_RING_MIB
// sets a smaller buffer than 2 GiB (for a profiler, which saves and restores it between replays).
//
//   target/device/ring_bench_sm90a [mla]  (on an H200; mla: the MLA variants alone)
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "check.cuh"
#include "mkc/megakernel.cuh"

constexpr uint32_t kK = 7168;

enum Mode { kRows, kRowsIdle, kPacked };

// Idle consumers: wait for each of n pages, read one element, release it.
__device__ void idle_consume(uint32_t n, uint32_t& it, float* out) {
  mkc::Ring& ring = *mkc::ring_ptr();
  float acc = 0.f;
  for (uint32_t i = 0; i < n; ++i, ++it) {
    const int slot = it % mkc::kPages;
    mkc::wait_page(it);
    acc += __bfloat162float(ring.page[slot][threadIdx.x]);
    mkc::release_page(&ring.empty[slot]);
  }
  if (acc == 12345.f) out[blockIdx.x] = acc;  // keeps the reads
}

// Loader of the pieces-N variants: N rows per page, 8192/N columns from each.
template <int N>
__device__ uint32_t pieces_load(const mkc::Rows& r, uint32_t& it) {
  constexpr uint32_t kCols = 8192 / N;
  mkc::Ring& ring = *mkc::ring_ptr();
  uint32_t pages = 0;
  for (uint32_t j0 = r.r0; j0 < r.r1; j0 += N) {
    for (uint32_t k0 = 0; k0 < kK; k0 += kCols, ++it, ++pages) {
      const uint32_t nk = min(kCols, kK - k0);
      const int slot = it % mkc::kPages;
      if (threadIdx.x % 32 == 0) {
        mkc::wait_slot_free(it);
        mkc::Barrier::arrive_and_expect_tx(&ring.full[slot], N * nk * 2);
        for (int j = 0; j < N; ++j) {
          cute::SM90_BULK_COPY_G2S::copy(r.w0 + size_t(j0 + j) * kK + k0, &ring.full[slot], ring.page[slot] + j * kCols,
                                         int32_t(nk * 2));
        }
      }
      __syncwarp();
    }
  }
  return pages;
}

// Every variant's start: the ring set up, this SM's contiguous share of the rows.
__device__ mkc::Rows sm_share(const __nv_bfloat16* w, uint32_t rows, uint32_t k = kK) {
  if (threadIdx.x == 0) mkc::ring_init(*mkc::ring_ptr());
  __syncthreads();
  const uint32_t per_sm = rows / gridDim.x;
  return mkc::Rows{w, nullptr, blockIdx.x * per_sm, (blockIdx.x + 1) * per_sm, k};
}

template <int N, bool kRowsLoad = false>
__global__ void __launch_bounds__(mkc::kThreads, 1) pieces(const __nv_bfloat16* w, uint32_t rows, float* out) {
  const mkc::Rows r = sm_share(w, rows);
  const int warp = threadIdx.x / 32;
  const uint32_t per_sm = r.r1 - r.r0;
  uint32_t it = 0;
  if (warp == mkc::kConsumerWarps) {
    if (kRowsLoad) {
      mkc::rows_load<1>(r, it);
    } else {
      pieces_load<N>(r, it);
    }
  } else if (warp < mkc::kConsumerWarps) {
    const uint32_t n = (per_sm / N) * ((kK + 8192 / N - 1) / (8192 / N));
    idle_consume(n, it, out);
  }
}

template <int M, uint32_t K = kK>
__global__ void __launch_bounds__(mkc::kThreads, 1) stream(const __nv_bfloat16* w, uint32_t rows, float* out,
                                                          const float* x_global = nullptr) {
  mkc::Ring& ring = *mkc::ring_ptr();
  const mkc::Rows r = sm_share(w, rows, K);
  const int warp = threadIdx.x / 32;
  const uint32_t per_sm = r.r1 - r.r0;
  const uint32_t pages = uint32_t(size_t(per_sm) * K * 2 / mkc::kPageBytes);
  uint32_t it = 0;
  if (warp == mkc::kConsumerWarps) {
    if (M == kPacked) {
      const char* base = reinterpret_cast<const char*>(w) + size_t(r.r0) * K * 2;
      for (; it < pages; ++it) {
        const int slot = it % mkc::kPages;
        if (threadIdx.x % 32 == 0) {
          mkc::wait_slot_free(it);
          mkc::Barrier::arrive_and_expect_tx(&ring.full[slot], mkc::kPageBytes);
          cute::SM90_BULK_COPY_G2S::copy(base + size_t(it) * mkc::kPageBytes, &ring.full[slot], ring.page[slot],
                                         int32_t(mkc::kPageBytes));
        }
        __syncwarp();
      }
    } else {
      mkc::rows_load<1>(r, it);
    }
  } else if (warp < mkc::kConsumerWarps) {
    if (M == kRows) {
      // The input in shared memory, or (x_global) read from global memory as a spilled input.
      const float* xs = x_global;
      if (xs == nullptr) {
        float* a = mkc::activation_ptr();
        for (uint32_t i = threadIdx.x; i < K; i += mkc::kConsumerThreads) a[i] = 1.f;
        mkc::consumer_sync();
        xs = a;
      }
      float* st = reinterpret_cast<float*>(mkc::scratch_ptr());
      // Output tiles of 1024 rows through the scratch, as a projection's staging.
      for (uint32_t j0 = r.r0; j0 < r.r1; j0 += 1024) {
        const mkc::Rows part{w, nullptr, j0, min(j0 + 1024, r.r1), K};
        if (x_global != nullptr) {
          mkc::rows_pages<1, true>(part, xs, nullptr, nullptr, it, warp, st);  // as rows_compute: a page ahead
        } else {
          mkc::rows_pages<1>(part, xs, nullptr, nullptr, it, warp, st);
        }
        mkc::consumer_sync();
        if (threadIdx.x == 0) out[blockIdx.x] += st[0];
      }
    } else {
      const uint32_t n = M == kPacked ? pages : uint32_t((per_sm + mkc::kPageRows - 1) / mkc::kPageRows) * ((K + 1023) / 1024);
      idle_consume(n, it, out);
    }
  }
}

// bf16 rows of width K at batch B through either consumer, in the loader order
// each takes; the input (ones) in shared memory where [B, K] fits, else in
// global memory; the output tiles (1024 rows) in global memory (`st`, per SM),
// as a projection's staging (the tensor-core consumer's sums use scratch).
// kNorm: the tensor-core consumer's input through an RMS prologue (a norm
// weight of ones in global memory, per-token scales of 1), as the routed
// gate/up rows' and the LM head's.
template <int B, bool kMma, uint32_t K, bool kNorm = false>
__global__ void __launch_bounds__(mkc::kThreads, 1) stream_batch(const __nv_bfloat16* w, uint32_t rows, float* out,
                                                                const float* ones, float* staging,
                                                                const __nv_bfloat16* norm) {
  const mkc::Rows r = sm_share(w, rows, K);
  const int warp = threadIdx.x / 32;
  uint32_t it = 0;
  if (warp == mkc::kConsumerWarps) {
    mkc::rows_load_grouped(r, kMma ? mkc::kRowsGroup<B> : 1, it);
  } else if (warp < mkc::kConsumerWarps) {
    constexpr bool kFits = size_t(B) * K * sizeof(float) <= size_t(mkc::kActivationBytes);
    const float* xs = ones;
    __shared__ float scale[B];
    if (threadIdx.x < B) scale[threadIdx.x] = 1.f;
    if (kFits) {
      float* a = mkc::activation_ptr();
      for (uint32_t i = threadIdx.x; i < B * K; i += mkc::kConsumerThreads) a[i] = 1.f;
    }
    mkc::consumer_sync();
    if (kFits) xs = mkc::activation_ptr();
    float* st = staging + size_t(blockIdx.x) * 1024 * B;
    for (uint32_t j0 = r.r0; j0 < r.r1; j0 += 1024) {
      const mkc::Rows part{w, nullptr, j0, min(j0 + 1024, r.r1), K};
      if constexpr (kMma) {
        mkc::rows_pages_mma<B>(part, mkc::RowsInput<float, kNorm>{xs, K, norm, scale},
                               it, warp, st);
      } else {
        mkc::rows_pages_fma<B, !kFits>(part, xs, nullptr, nullptr, it, warp, st);
      }
      mkc::consumer_sync();
      if (threadIdx.x == 0) out[blockIdx.x] += st[0];
    }
  }
}
template <int B, bool kMma, uint32_t K, bool kNorm = false>
static void run_batch(const char* name, const __nv_bfloat16* w, size_t bytes, float* out, int sms, const float* ones,
                      float* staging, const __nv_bfloat16* norm = nullptr) {
  const uint32_t rows = uint32_t(bytes / (K * 2)) / (8 * sms) * (8 * sms);
  timed(name, stream_batch<B, kMma, K, kNorm>, double(rows / sms) * sms * K * 2, sms, w, rows, out, ones, staging, norm);
}

// MXFP4 rows [n, kMxK]: this SM's contiguous share through mx_rows_load and
// either the consumer (B tokens of ones) or idle consumers.
// kMode: 0 the consumer (`tokens`: the tokens computed, an expert's picked ones), 1 the CUDA-core
// consumer, 2 idle.
template <int B, int kMode>
__global__ void __launch_bounds__(mkc::kThreads, 1) mx_stream(const uint8_t* codes, const uint8_t* scales, uint32_t rows,
                                                             const float* ones, float* out, uint32_t tokens) {
  if (threadIdx.x == 0) mkc::ring_init(*mkc::ring_ptr());
  __syncthreads();
  const uint32_t per_sm = rows / gridDim.x, r0 = blockIdx.x * per_sm;
  const mkc::MxRows r{codes, scales, nullptr, nullptr, r0, r0 + per_sm, mkc::kMxK};
  const int warp = threadIdx.x / 32;
  uint32_t it = 0;
  if (warp == mkc::kConsumerWarps) {
    mkc::mx_rows_load(r, it);
  } else if (warp < mkc::kConsumerWarps) {
    if (kMode == 2) {
      idle_consume((per_sm + mkc::kPageRows - 1) / mkc::kPageRows, it, out);
      return;
    }
    // The CUDA-core consumer's input in shared memory, or in global memory (`ones`) where [B, kMxK]
    // does not fit (batch 8), as an expert task's.
    const float* xs = ones;
    if (B * mkc::kMxK * sizeof(float) <= size_t(mkc::kActivationBytes)) {
      float* a = mkc::activation_ptr();
      for (uint32_t i = threadIdx.x; i < B * mkc::kMxK; i += mkc::kConsumerThreads) a[i] = 1.f;
      mkc::consumer_sync();
      xs = a;
    }
    float* st = reinterpret_cast<float*>(mkc::scratch_ptr());
    // Output tiles of 512 rows through the scratch, as an expert task's staging.
    for (uint32_t j0 = r.r0; j0 < r.r1; j0 += 512) {
      const mkc::MxRows part{codes, scales, nullptr, nullptr, j0, min(j0 + 512, r.r1), mkc::kMxK};
      if (kMode == 0) {
        mkc::mx_rows_compute<B>(mkc::MxRowsCompute{.rows = part, .x = ones, .norm = nullptr, .eps = 0.f, .spill = nullptr,
                                                   .tokens = tokens},
                                it, warp, st);
      } else {
        mkc::mx_rows_pages<B>(part, xs, it, warp, st);
      }
      mkc::consumer_sync();
      if (threadIdx.x == 0) out[blockIdx.x] += st[0];
    }
  }
}

// FP8 rows [n, kK] (e4m3 codes, fp32 scales [ceil(n / 128)][kK / 128]) at batch B: this SM's share
// through the loader in the order the consumer takes (kFp8Group blocks), the input (ones) in shared
// memory where [B, kK] fits, else in global memory, the output tiles (1024 rows) in global memory
// (`staging`, per SM).
template <int B>
__global__ void __launch_bounds__(mkc::kThreads, 1) fp8_stream(const uint8_t* codes, const float* scales, uint32_t rows,
                                                              float* out, const float* ones, float* staging) {
  if (threadIdx.x == 0) mkc::ring_init(*mkc::ring_ptr());
  __syncthreads();
  const uint32_t per_sm = rows / gridDim.x, r0 = blockIdx.x * per_sm;
  const mkc::Fp8Rows r{codes, scales, nullptr, nullptr, r0, r0 + per_sm, kK};
  const int warp = threadIdx.x / 32;
  uint32_t it = 0;
  if (warp == mkc::kConsumerWarps) {
    mkc::fp8_rows_load<B>(r, it);
  } else if (warp < mkc::kConsumerWarps) {
    constexpr bool kFits = size_t(B) * kK * sizeof(float) <= size_t(mkc::kActivationBytes);
    const float* xs = ones;
    if (kFits) {
      float* a = mkc::activation_ptr();
      for (uint32_t i = threadIdx.x; i < B * kK; i += mkc::kConsumerThreads) a[i] = 1.f;
      mkc::consumer_sync();
      xs = a;
    }
    float* st = staging + size_t(blockIdx.x) * 1024 * B;
    for (uint32_t j0 = r.r0; j0 < r.r1; j0 += 1024) {
      const mkc::Fp8Rows part{codes, scales, nullptr, nullptr, j0, min(j0 + 1024, r.r1), kK};
      mkc::fp8_rows_pages_mma<B>(part, xs, it, warp, st);
      mkc::consumer_sync();
      if (threadIdx.x == 0) out[blockIdx.x] += st[0];
    }
  }
}

// The MLA split over K2's widths: a KV split of the cache an SM (blockIdx.x), one head group of
// kMaxMlaHeads heads, B sequences of `ctx` rows; every sequence at position ctx - 1 (the last split
// appends the new row). kIdle: the loader alone, the consumers only wait and release.
constexpr uint32_t kMlaC = 512, kMlaRope = 64, kMlaRow = kMlaC + kMlaRope;
__host__ __device__ inline mkc::MlaShape mla_bench_shape(uint32_t ctx, uint32_t splits) {
  return mkc::MlaShape{.heads = mkc::kMaxMlaHeads, .hpt = mkc::kMaxMlaHeads, .groups = 1, .splits = splits,
                       .ctx = ctx, .c = kMlaC, .nope = 128, .rope = kMlaRope, .v_dim = 128, .scale = 0.07f,
                       .positions = 1};
}
struct MlaBench {
  uint32_t ctx;
  const __nv_bfloat16* q;   // [B, heads (nope + rope)]
  const float* absorbed;    // [B, heads, c]
  const __nv_bfloat16* ckv; // [B, c]
  const __nv_bfloat16* kpe; // [B, rope]
  __nv_bfloat16* cache;     // [B][ctx][c + rope]
  const int32_t* pos;       // [B]
  float* partials;          // [B, heads, splits, 2 + c]
};
template <int B, bool kIdle>
__global__ void __launch_bounds__(mkc::kThreads, 1) mla_stream(MlaBench a, float* out) {
  if (threadIdx.x == 0) mkc::ring_init(*mkc::ring_ptr());
  __syncthreads();
  const mkc::MlaShape s = mla_bench_shape(a.ctx, gridDim.x);
  const int warp = threadIdx.x / 32;
  uint32_t it = 0;
  if (warp == mkc::kConsumerWarps) {
    mkc::mla_split_load<B>(mkc::MlaSplitLoad{s, 0, blockIdx.x, a.cache, a.pos}, it);
  } else if (warp < mkc::kConsumerWarps) {
    if constexpr (kIdle) {
      uint32_t n = 0;
      for (uint32_t b = 0; b < uint32_t(B); ++b) {
        const mkc::Rows r = mkc::mla_cache_rows(s, blockIdx.x, a.cache, b, a.pos);
        const uint32_t per = mkc::packed_rows(mkc::cache_stride(r.k));
        n += (r.r1 - r.r0 + per - 1) / per;
      }
      idle_consume(n, it, out);
    } else {
      mkc::mla_split<B, true>(mkc::MlaSplit<__nv_bfloat16>{.shape = s, .head_group = 0, .split = blockIdx.x,
                                                          .q = a.q, .absorbed = a.absorbed, .ckv_raw = a.ckv,
                                                          .norm = nullptr, .eps = 0.f, .kpe = a.kpe,
                                                          .cache = a.cache, .pos = a.pos, .partials = a.partials},
                              it);
    }
  }
}
template <int B, bool kIdle>
static void run_mla(const char* name, __nv_bfloat16* cache, size_t bytes, float* out, int sms);

template <class K, class... Args>
static void timed(const char* name, K kernel, double bytes, int sms, Args... args) {
  grant_shared_memory(kernel, name);
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  kernel<<<sms, mkc::kThreads, mkc::kSmemBytes>>>(args...);  // warm-up
  CHECK(cudaGetLastError());
  CHECK(cudaEventRecord(a));
  const int reps = 5;
  for (int i = 0; i < reps; ++i) kernel<<<sms, mkc::kThreads, mkc::kSmemBytes>>>(args...);
  CHECK(cudaEventRecord(b));
  CHECK(cudaEventSynchronize(b));
  CHECK(cudaGetLastError());
  float ms = 0.f;
  CHECK(cudaEventElapsedTime(&ms, a, b));
  std::printf("%-10s %8.3f ms  %7.1f GB/s  (%.1f GB/s per SM)\n", name, ms / reps, bytes / (ms / reps) / 1e6,
              bytes / (ms / reps) / 1e6 / sms);
  CHECK(cudaEventDestroy(a));
  CHECK(cudaEventDestroy(b));
}

// A `stream` variant over the rows of width kK, its input in shared memory.
template <class K>
static void run(const char* name, K kernel, const __nv_bfloat16* w, uint32_t rows, float* out, int sms) {
  timed(name, kernel, double(rows / sms) * sms * kK * 2, sms, w, rows, out, static_cast<const float*>(nullptr));
}
// A `pieces` loader over the same rows.
template <class K>
static void run_pieces(const char* name, K kernel, const __nv_bfloat16* w, uint32_t rows, float* out, int sms) {
  timed(name, kernel, double(rows / sms) * sms * kK * 2, sms, w, rows, out);
}

// bf16 rows of width k in the same buffer (`bytes`), the input in shared memory or in global memory.
template <uint32_t K>
static void run_width(const char* name, const __nv_bfloat16* w, size_t bytes, float* out, int sms, const float* x_global) {
  const uint32_t rows = uint32_t(bytes / (K * 2)) / (8 * sms) * (8 * sms);
  timed(name, stream<kRows, K>, double(rows / sms) * sms * K * 2, sms, w, rows, out, x_global);
}

// The cache's rows of B sequences in `bytes`, a split an SM; the queries, the new rows and the
// partials allocated here (small).
template <int B, bool kIdle>
static void run_mla(const char* name, __nv_bfloat16* cache, size_t bytes, float* out, int sms) {
  const uint32_t ctx = uint32_t(bytes / (size_t(B) * kMlaRow * 2)) / sms * sms;
  const uint32_t heads = mkc::kMaxMlaHeads;
  MlaBench a{};
  a.ctx = ctx;
  std::vector<__nv_bfloat16> q(size_t(B) * heads * (128 + kMlaRope), __float2bfloat16(0.01f));
  std::vector<float> absorbed(size_t(B) * heads * kMlaC, 0.01f);
  std::vector<__nv_bfloat16> ckv(size_t(B) * kMlaC, __float2bfloat16(0.5f)), kpe(size_t(B) * kMlaRope, __float2bfloat16(0.5f));
  std::vector<int32_t> pos(B, int32_t(ctx - 1));
  __nv_bfloat16 *dq, *dckv, *dkpe;
  float *dabs, *dpart;
  int32_t* dpos;
  CHECK(cudaMalloc(&dq, q.size() * 2));
  CHECK(cudaMalloc(&dckv, ckv.size() * 2));
  CHECK(cudaMalloc(&dkpe, kpe.size() * 2));
  CHECK(cudaMalloc(&dabs, absorbed.size() * 4));
  CHECK(cudaMalloc(&dpos, pos.size() * 4));
  CHECK(cudaMalloc(&dpart, size_t(B) * heads * sms * (2 + kMlaC) * 4));
  CHECK(cudaMemcpy(dq, q.data(), q.size() * 2, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(dckv, ckv.data(), ckv.size() * 2, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(dkpe, kpe.data(), kpe.size() * 2, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(dabs, absorbed.data(), absorbed.size() * 4, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(dpos, pos.data(), pos.size() * 4, cudaMemcpyHostToDevice));
  a.q = dq, a.absorbed = dabs, a.ckv = dckv, a.kpe = dkpe, a.cache = cache, a.pos = dpos, a.partials = dpart;
  timed(name, mla_stream<B, kIdle>, double(B) * (ctx - 1) * kMlaRow * 2, sms, a, out);
  for (void* p : {(void*)dq, (void*)dckv, (void*)dkpe, (void*)dabs, (void*)dpos, (void*)dpart}) CHECK(cudaFree(p));
}

int main(int argc, char** argv) {
  const bool mla_only = argc > 1 && std::string(argv[1]) == "mla";
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  // 2 GiB of rows, a multiple of 8 rows per SM.
  // MKC_RING_MIB: a smaller buffer (a profiler's replays save and restore it), 2 GiB unless set.
  const char* mib = std::getenv("MKC_RING_MIB");
  const size_t buffer = mib != nullptr ? size_t(std::atoi(mib)) << 20 : size_t(2) << 30;
  const uint32_t rows = uint32_t(buffer / (kK * 2)) / (8 * sms) * (8 * sms);
  __nv_bfloat16* w = nullptr;
  CHECK(cudaMalloc(&w, size_t(rows) * kK * 2));
  // Not zeros: as bf16 0x3C3C (0.011), as MXFP4 codes 0xC and 0x3, scales 2^-67.
  CHECK(cudaMemset(w, 0x3C, size_t(rows) * kK * 2));
  float* out = nullptr;
  CHECK(cudaMalloc(&out, sms * sizeof(float)));
  // Activations of ones for the MXFP4 consumers that stage their own input, [8, kMxK].
  std::vector<float> host_ones(8 * 7168, 1.f);  // also the spilled inputs of the bf16 widths
  float* ones = nullptr;
  CHECK(cudaMalloc(&ones, host_ones.size() * sizeof(float)));
  CHECK(cudaMemcpy(ones, host_ones.data(), host_ones.size() * sizeof(float), cudaMemcpyHostToDevice));
  CHECK(cudaMemset(out, 0, sms * sizeof(float)));
  std::vector<__nv_bfloat16> host_norm(7168, __float2bfloat16(1.f));  // an RMS prologue's weight
  __nv_bfloat16* norm = nullptr;
  CHECK(cudaMalloc(&norm, host_norm.size() * sizeof(__nv_bfloat16)));
  CHECK(cudaMemcpy(norm, host_norm.data(), host_norm.size() * sizeof(__nv_bfloat16), cudaMemcpyHostToDevice));
  float* staging = nullptr;  // the batch variants' output tiles, [sms][1024 rows][8 tokens]
  CHECK(cudaMalloc(&staging, size_t(sms) * 1024 * 8 * sizeof(float)));
  // The FP8 variants' block scales, [ceil(n / 128)][kK / 128] for the n = 2 rows of codes each bf16 row's bytes hold.
  float* fp8_scales = nullptr;
  const std::vector<float> host_scales((size_t(rows) * 2 / 128 + 1) * (kK / 128), 0.01f);
  CHECK(cudaMalloc(&fp8_scales, host_scales.size() * sizeof(float)));
  CHECK(cudaMemcpy(fp8_scales, host_scales.data(), host_scales.size() * sizeof(float), cudaMemcpyHostToDevice));
  std::printf("%d SMs, %u rows of %u bf16, %d pages of %d KiB\n", sms, rows, kK, mkc::kPages, mkc::kPageBytes / 1024);
  for (int round = 0; round < 2; ++round) {  // twice: the first round may run before the clocks settle
  std::printf("round %d\n", round);
  // The MLA split: the cache as 2 GiB of 576-wide rows (bf16 0x3C3C).
  const size_t cache_bytes = size_t(rows) * kK * 2;
  run_mla<1, true>("mla-idle-b1", w, cache_bytes, out, sms);
  run_mla<1, false>("mla-b1", w, cache_bytes, out, sms);
  run_mla<8, true>("mla-idle-b8", w, cache_bytes, out, sms);
  run_mla<8, false>("mla-b8", w, cache_bytes, out, sms);
  if (mla_only) continue;
  run("rows", stream<kRows>, w, rows, out, sms);
  run("rows-idle", stream<kRowsIdle>, w, rows, out, sms);
  run("packed", stream<kPacked>, w, rows, out, sms);
  run_pieces("pieces-8", pieces<8>, w, rows, out, sms);
  run_pieces("pieces-4", pieces<4>, w, rows, out, sms);
  run_pieces("pieces-2", pieces<2>, w, rows, out, sms);
  run_pieces("pieces-1", pieces<1>, w, rows, out, sms);
  run_pieces("pieces-8/rows_load", pieces<8, true>, w, rows, out, sms);
  // The widths of K3's dense rows: KDA/MLA o_proj (12288), the dense layer's down rows (33792,
  // its input spilled to global memory as in the megakernel), and 7168 with a spilled input.
  run_width<12288>("rows-12288", w, size_t(rows) * kK * 2, out, sms, nullptr);
  run_width<33792>("rows-33792-global-x", w, size_t(rows) * kK * 2, out, sms, ones);
  run_width<7168>("rows-7168-global-x", w, size_t(rows) * kK * 2, out, sms, ones);
  // Batch 2 and 4 on either consumer: K3's latent width (the input in shared memory) and its
  // hidden width (batch 4: the input in global memory).
  const size_t bytes = size_t(rows) * kK * 2;
  run_batch<4, false, 3584>("b4-fma-3584", w, bytes, out, sms, ones, staging);
  run_batch<4, true, 3584>("b4-mma-3584", w, bytes, out, sms, ones, staging);
  run_batch<4, false, 7168>("b4-fma-7168-global-x", w, bytes, out, sms, ones, staging);
  run_batch<4, true, 7168>("b4-mma-7168-global-x", w, bytes, out, sms, ones, staging);
  run_batch<2, false, 7168>("b2-fma-7168", w, bytes, out, sms, ones, staging);
  run_batch<2, true, 7168>("b2-mma-7168", w, bytes, out, sms, ones, staging);
  run_batch<6, true, 7168>("b6-mma-7168-global-x", w, bytes, out, sms, ones, staging);
  // Batch 8 (two row blocks' sums a group fewer: kSumGroup), and batch 6 and 8 through an RMS
  // prologue, as the routed gate/up rows and the LM head read K2's hidden width.
  run_batch<8, true, 7168>("b8-mma-7168-global-x", w, bytes, out, sms, ones, staging);
  run_batch<6, true, 7168, true>("b6-mma-7168-global-x-norm", w, bytes, out, sms, ones, staging, norm);
  run_batch<8, true, 7168, true>("b8-mma-7168-global-x-norm", w, bytes, out, sms, ones, staging, norm);
  // MXFP4: the same bytes as codes and scales (k / 2 + k / 32 bytes a row).
  const uint32_t mx_row = mkc::kMxK / 2 + mkc::kMxK / 32;
  const uint32_t mx_rows = uint32_t(size_t(rows) * kK * 2 / mx_row) / (8 * sms) * (8 * sms);
  const auto* codes = reinterpret_cast<const uint8_t*>(w);
  const uint8_t* scales = codes + size_t(mx_rows) * (mkc::kMxK / 2);
  const double mx_bytes = double(mx_rows) * mx_row;
  timed("mx", mx_stream<1, 0>, mx_bytes, sms, codes, scales, mx_rows, ones, out, ~0u);
  timed("mx-b2", mx_stream<2, 0>, mx_bytes, sms, codes, scales, mx_rows, ones, out, ~0u);
  timed("mx-b4", mx_stream<4, 0>, mx_bytes, sms, codes, scales, mx_rows, ones, out, ~0u);
  timed("mx-b8", mx_stream<8, 0>, mx_bytes, sms, codes, scales, mx_rows, ones, out, ~0u);
  // An expert's picked tokens of batch 8: the consumer at their batch (mx_rows_compute's `tokens`).
  timed("mx-b8-picked-1", mx_stream<8, 0>, mx_bytes, sms, codes, scales, mx_rows, ones, out, 0x40);
  timed("mx-b8-picked-2", mx_stream<8, 0>, mx_bytes, sms, codes, scales, mx_rows, ones, out, 0x11);
  timed("mx-b8-picked-3", mx_stream<8, 0>, mx_bytes, sms, codes, scales, mx_rows, ones, out, 0x25);
  timed("mx-b8-picked-4", mx_stream<8, 0>, mx_bytes, sms, codes, scales, mx_rows, ones, out, 0x55);
  timed("mx-b3", mx_stream<3, 0>, mx_bytes, sms, codes, scales, mx_rows, ones, out, ~0u);
  timed("mx-fma", mx_stream<1, 1>, mx_bytes, sms, codes, scales, mx_rows, ones, out, ~0u);
  timed("mx-fma-b8", mx_stream<8, 1>, mx_bytes, sms, codes, scales, mx_rows, ones, out, ~0u);
  timed("mx-idle", mx_stream<1, 2>, mx_bytes, sms, codes, scales, mx_rows, ones, out, ~0u);
  // FP8: the same 2 GiB as e4m3 codes (0x3C: 1.5), the scales apart.
  const uint32_t fp8_rows = uint32_t(size_t(rows) * kK * 2 / kK) / (1024 * sms) * (1024 * sms);
  const double fp8_bytes = double(fp8_rows) * kK + double(fp8_rows / 128) * (kK / 128) * sizeof(float);
  timed("fp8", fp8_stream<1>, fp8_bytes, sms, codes, fp8_scales, fp8_rows, out, ones, staging);
  timed("fp8-b4", fp8_stream<4>, fp8_bytes, sms, codes, fp8_scales, fp8_rows, out, ones, staging);
  timed("fp8-b8", fp8_stream<8>, fp8_bytes, sms, codes, fp8_scales, fp8_rows, out, ones, staging);
  }
  CHECK(cudaFree(w));
  CHECK(cudaFree(out));
  CHECK(cudaFree(ones));
  CHECK(cudaFree(staging));
  CHECK(cudaFree(norm));
  CHECK(cudaFree(fp8_scales));
  return 0;
}
