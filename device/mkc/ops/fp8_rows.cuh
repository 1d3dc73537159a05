// mkc device library: FP8 weight rows through the page ring (Kimi K2 and
// DeepSeek-V3 as released): e4m3 codes as the checkpoint stores them, [n, k]
// row-major, and one fp32 scale per 128 x 128 block, [ceil(n / 128)][ceil(k /
// 128)] (`weight_scale_inv`, the factor that dequantises):
//
//   W[i, e] = e4m3(code[i, e]) * scale[i / 128][e / 128]
//
// Blocks at the edges (n or k not a multiple of 128) are partial; their scale
// covers what is there. The codes stream through the ring as the bf16 rows do,
// twice the columns a page (a page's bytes are the same), and the scales with
// them: the loader copies a page's (those of the 128-row blocks of its first
// and last row, for the 16 blocks of its k chunk) into the page's slot of
// Ring::fp8_scale, so the consumers read them from shared memory once the
// page is there. (Read from global memory before each page's wait instead,
// they came from HBM whenever the weight stream had pushed them out of L2,
// and the consumers waited on them with the page in hand.)
#pragma once

#include <cuda_fp8.h>

#include "rows.cuh"

namespace mkc {

constexpr uint32_t kFp8PageK = uint32_t(kPageBytes) / kPageRows;  // a page row's e4m3 codes: 2048
static_assert(kFp8PageK == 2 * kPageK, "a page holds twice the fp8 columns of bf16 ones");
static_assert(kFp8PageK == kConsumerWarps * 256, "a warp covers 256 columns of a page, eight a lane");
static_assert(kFp8PageK / kFp8Block == uint32_t(kPageScaleBlocks), "a page's k chunk in scale blocks (Ring)");
static_assert(2 * kPageScaleBlocks == 32, "a lane copies one of a page's scales");

// A task's FP8 rows: rows [r0, r1) of (w0, s0) and, for a gate/up pair, the
// same rows of (w1, s1) after them (tile columns [n, 2n)). k a multiple of kFp8Align
// (each row's codes start on a 16-byte boundary, the bulk copies' alignment).
struct Fp8Rows {
  const uint8_t* w0;  // codes [n, k]
  const float* s0;    // scales [ceil(n / 128)][ceil(k / 128)]
  const uint8_t* w1;  // the paired (up) matrix's, or null
  const float* s1;
  uint32_t r0, r1, k;
  __device__ uint32_t cols() const { return (r1 - r0) * (w1 != nullptr ? 2 : 1); }
  __device__ uint32_t blocks_k() const { return (k + kFp8Block - 1) / kFp8Block; }
  // Tile column j's codes, and its 128-row block's scales.
  __device__ const uint8_t* row(uint32_t j) const {
    const uint32_t n = r1 - r0;
    return j < n ? w0 + size_t(r0 + j) * k : w1 + size_t(r0 + j - n) * k;
  }
  __device__ const float* scales(uint32_t j) const {
    const uint32_t n = r1 - r0;
    return j < n ? s0 + size_t((r0 + j) / kFp8Block) * blocks_k() : s1 + size_t((r0 + j - n) / kFp8Block) * blocks_k();
  }
  // Whether tile columns i and j share their 128-row block of scales (of one matrix).
  __device__ bool same_block(uint32_t i, uint32_t j) const {
    const uint32_t n = r1 - r0;
    return (i < n) == (j < n) && (r0 + i - (i < n ? 0 : n)) / kFp8Block == (r0 + j - (j < n ? 0 : n)) / kFp8Block;
  }
};

// One fp32 from global to shared memory (cp.async), and the barrier that
// arrives once this thread's copies so far have landed (without .noinc: the
// barrier's pending count is raised now and lowered then, so its phase
// cannot complete before them).
__device__ __forceinline__ void cp_async_float(float* dst, const float* src) {
  const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(d), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_arrive(uint64_t* barrier) {
  const uint32_t b = static_cast<uint32_t>(__cvta_generic_to_shared(barrier));
  asm volatile("cp.async.mbarrier.arrive.shared::cta.b64 [%0];" ::"r"(b) : "memory");
}

// Loader: the task's rows into the page ring, kPageRows rows of up to
// kFp8PageK codes a page, `group` row blocks at a time (for each k chunk, the
// chunk of each block of the group; group 1: a block's chunks in turn), as
// rows_load_grouped does for bf16 rows; lane j copies the page's row j, and
// lane i the page's scale i (first row's blocks, then last row's). A page's
// rows lie in those two 128-row blocks: the task's rows start on a page row
// (r0 a multiple of kPageRows: the planner's tiles and expert units), so a
// page's rows of w0 lie in one block; where w1's rows follow in the same page
// they start at r0 (one block), and a page of w1's rows alone spans at most
// two.
__device__ inline void fp8_rows_load_grouped(const Fp8Rows& r, uint32_t group, uint32_t& it) {
  const uint32_t lane = threadIdx.x % 32, cols = r.cols();
  if (r.k % kFp8Align != 0) __trap();   // the planner's limit (a row's codes 16-byte aligned)
  if (r.r0 % kPageRows != 0) __trap();  // the planner's tiles (a page in two scale blocks at most)
  for (uint32_t g0 = 0; g0 < cols; g0 += group * kPageRows) {
    const uint32_t g1 = min(cols, g0 + group * kPageRows);
    for (uint32_t k0 = 0; k0 < r.k; k0 += kFp8PageK) {
      const uint32_t nk = min(kFp8PageK, r.k - k0);
      for (uint32_t j0 = g0; j0 < g1; j0 += kPageRows, ++it) {
        const uint32_t nr = min(uint32_t(kPageRows), cols - j0);
        const int slot = it % kPages;
        // Every lane waits for the slot: its scale copy below is then ordered after the consumers'
        // reads of the slot's last scales by its own wait (one lane's wait and __syncwarp order it
        // too, but compute-sanitizer's racecheck reports that as a write-after-read hazard).
        wait_slot_free(it);
        // The scales first: every lane's copy is on the full barrier before lane 0 arrives on it.
        const uint32_t kb = lane % kPageScaleBlocks, last = lane / kPageScaleBlocks;
        if (kb * kFp8Block < nk) {
          cp_async_float(&ring_ptr()->fp8_scale[slot][last][kb], r.scales(last ? j0 + nr - 1 : j0) + k0 / kFp8Block + kb);
        }
        cp_async_arrive(&ring_ptr()->full[slot]);
        __syncwarp();
        if (lane == 0) Barrier::arrive_and_expect_tx(&ring_ptr()->full[slot], nr * nk);
        __syncwarp();
        if (lane < nr) {
          auto* page = reinterpret_cast<uint8_t*>(ring_ptr()->page[slot]);
          cute::SM90_BULK_COPY_G2S::copy(r.row(j0 + lane) + k0, &ring_ptr()->full[slot], page + lane * kFp8PageK,
                                         int32_t(nk));
        }
      }
    }
  }
  __syncwarp();
}

// FP8 rows run on the tensor cores at every batch (fp8_rows_pages_mma; at
// batch 1 too: a CUDA-core consumer, which turned each code into an fp32
// value, streamed 2.37 TB/s in ring_bench against 2.81 on the tensor cores,
// where the codes go to fp16 pairs and straight into the MMA, on the H100 at
// abc7bfc; the routed experts at K2's widths ran no faster than their bf16
// rows with it, half the bytes). Its row
// blocks come kFp8Group<B> at a time, a chunk's activation fragments made once
// for the group's pages (at batch 1 as at 2 to 6: the partial sums of a group
// of kBlockGroup blocks fit scratch).
template <int B>
constexpr uint32_t kFp8Group = kSumGroup<B>;

// The loader of FP8 rows consumed at batch B (fp8_rows_compute<B>): the
// tensor-core consumer's groups of row blocks.
template <int B>
__device__ inline void fp8_rows_load(const Fp8Rows& r, uint32_t& it) {
  fp8_rows_load_grouped(r, kFp8Group<B>, it);
}

// Eight e4m3 codes (8 bytes, the first in the low byte) as four fp16 pairs
// (exact), pair i holding elements 2i and 2i + 1.
__device__ __forceinline__ void e4m3x8_half2(uint2 c, uint32_t (&h)[4]) {
  const uint32_t words[2] = {c.x, c.y};
#pragma unroll
  for (int i = 0; i < 2; ++i) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const __half2_raw raw =
          __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(words[i] >> (16 * j) & 0xffffu), __NV_E4M3);
      h[2 * i + j] = uint32_t(raw.x) | (uint32_t(raw.y) << 16);
    }
  }
}

// The page loop of fp8_rows_compute on the tensor cores, batch 1 to 8:
// mma.sync m16n8k16, fp16 inputs, fp32 sums, the activations as A and a
// page's eight rows as B, as the bf16 consumer (rows_pages_mma) lays them:
// A's row b is token b's fp16 high part and row 8 + b its low part, token b
// scaled by the power of two that brings its largest under 2^14 (inside
// fp16's range) and unscaled at the end; e4m3 codes are exact in fp16
// (cvt.rn.f16x2.e4m3x2). Warp w takes columns [256 w, 256 w + 256) of each
// page, two 128-column scale blocks: in block q, lane (g, t) reads page row
// g's codes 128 q + 32 i + 8 t .. + 7 (i < 4, one 8-byte load) as its k-slots
// of steps 2i and 2i + 1, and token g's activations of the same columns as
// A's. A block's eight MMAs sum into fresh registers, which the scales of the
// lane's two rows (2t, 2t + 1) in that block then multiply once. The pages
// come kFp8Group<B> row blocks at a time, the k chunks outer
// (fp8_rows_load<B>): a chunk's A fragments are made once for the group's
// blocks, and the group's sums wait in scratch (sum_block_group). G: the
// loader's group, that of the program's batch where the consumer runs at the
// batch of a routed expert's picked tokens (fp8_rows_compute).
template <int B, uint32_t G = kFp8Group<B>>
__device__ void fp8_rows_pages_mma(const Fp8Rows& r, const float* x, uint32_t& it, int warp, float* st) {
  constexpr uint32_t kBlockSums = kConsumerWarps * kPageRows * B;
  static_assert(B >= 1 && B <= 8, "A's eight token rows");
  static_assert(2 * G * kBlockSums * sizeof(float) <= kScratchBytes, "two groups of partial sums fit scratch");
  __shared__ float rs[B], scale[B];
  token_scales<B>(x, r.k, static_cast<const __nv_bfloat16*>(nullptr), 0.f, 14, rs, scale);
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const float sg = g < B ? scale[g] : 0.f, ug = g < B ? 1.f / scale[g] : 0.f;
  float* part = reinterpret_cast<float*>(scratch_ptr());  // [2][G][warp][row, token]
  const uint32_t cols = r.cols(), blocks = (cols + kPageRows - 1) / kPageRows;
  const uint32_t c0 = uint32_t(warp) * 256 + 8 * uint32_t(t);  // + 128 q + 32 i: this lane's columns of a page
  for (uint32_t b0 = 0, group = 0; b0 < blocks; b0 += G, ++group) {
    const uint32_t nb = min(G, blocks - b0);
    float acc[G][4] = {};
    for (uint32_t k0 = 0; k0 < r.k; k0 += kFp8PageK) {
      const uint32_t nk = min(kFp8PageK, r.k - k0);
      uint32_t hi[2][4][4], lo[2][4][4];  // [q][i][pair]
      // A lane's eight reads with no branch between them, in flight together (the input is in global
      // memory where it does not fit shared memory: a branch each made that eight round trips a chunk).
      // Lanes past the batch or the chunk read token 0's column 0 and take zeros.
      float4 a[2][4][2];
#pragma unroll
      for (int q = 0; q < 2; ++q) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const uint32_t e = c0 + 128 * q + 32 * i;
          const size_t at = g < B && e < nk ? size_t(g) * r.k + k0 + e : 0;
          a[q][i][0] = load_four(x + at), a[q][i][1] = load_four(x + at + 4);
        }
      }
#pragma unroll
      for (int q = 0; q < 2; ++q) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float s = g < B && c0 + 128 * q + 32 * i < nk ? sg : 0.f;
          const float4 p = a[q][i][0], u = a[q][i][1];
          const float v[8] = {p.x * s, p.y * s, p.z * s, p.w * s, u.x * s, u.y * s, u.z * s, u.w * s};
#pragma unroll
          for (int pr = 0; pr < 4; ++pr) split_pair<__half2>(v[2 * pr], v[2 * pr + 1], hi[q][i][pr], lo[q][i][pr]);
        }
      }
#pragma unroll
      for (int j = 0; j < int(G); ++j) {
        if (uint32_t(j) >= nb) break;
        const uint32_t j0 = (b0 + j) * kPageRows;  // the block's first tile column
        const int slot = it % kPages;
        wait_page(it);
        // The scales of the lane's two rows in the warp's two blocks, from the page's slot: the first
        // row's block's, or the last row's.
        const uint32_t ra = j0 + 2 * t, rb = ra + 1;
        const float* const page_scales = ring_ptr()->fp8_scale[slot][0] + 2 * warp;
        const float* const ska = page_scales + (r.same_block(ra, j0) ? 0 : kPageScaleBlocks);
        const float* const skb = page_scales + (r.same_block(rb, j0) ? 0 : kPageScaleBlocks);
        float sa[2], sb[2];
#pragma unroll
        for (int q = 0; q < 2; ++q) {
          const bool block_in = uint32_t(warp) * 256 + 128 * q < nk;
          sa[q] = block_in && ra < cols ? ska[q] : 0.f;
          sb[q] = block_in && rb < cols ? skb[q] : 0.f;
        }
        const auto* row = reinterpret_cast<const uint8_t*>(ring_ptr()->page[slot]) + g * kFp8PageK + c0;
        const bool row_in = j0 + g < cols;  // rows past the task's hold an earlier page's bytes
#pragma unroll
        for (int q = 0; q < 2; ++q) {
          if (uint32_t(warp) * 256 + 128 * q >= nk) break;  // the scale block lies past the chunk
          float d0 = 0.f, d1 = 0.f, d2 = 0.f, d3 = 0.f;
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            // Columns past the chunk hold an earlier page's bytes: zeros, as their activations.
            const bool in = row_in && c0 + 128 * q + 32 * i < nk;
            uint32_t w[4];
            e4m3x8_half2(in ? *reinterpret_cast<const uint2*>(row + 128 * q + 32 * i) : make_uint2(0u, 0u), w);
            cute::SM80_16x8x16_F32F16F16F32_TN::fma(d0, d1, d2, d3, hi[q][i][0], lo[q][i][0], hi[q][i][1], lo[q][i][1],
                                                    w[0], w[1], d0, d1, d2, d3);
            cute::SM80_16x8x16_F32F16F16F32_TN::fma(d0, d1, d2, d3, hi[q][i][2], lo[q][i][2], hi[q][i][3], lo[q][i][3],
                                                    w[2], w[3], d0, d1, d2, d3);
          }
          acc[j][0] = fmaf(sa[q], d0, acc[j][0]);
          acc[j][1] = fmaf(sb[q], d1, acc[j][1]);
          acc[j][2] = fmaf(sa[q], d2, acc[j][2]);
          acc[j][3] = fmaf(sb[q], d3, acc[j][3]);
        }
        release_page(&ring_ptr()->empty[slot]);
        ++it;
      }
    }
    end_mma_group<B, G>(acc, part, group, nb, cols, warp, ug, st);  // unscaled, over the warps
  }
}

// FP8 rows of y = x' W^T, x' = x or RMSNorm(x) * norm, the input staged as
// fp32 in shared memory, or in `spill` when it does not fit (input_area); on
// the tensor cores. The task's loader is fp8_rows_load<B>.
//
// `tokens` picks the batch's tokens whose rows are computed (a routed
// expert's: those that chose it), as mx_rows_compute's (run_picked): up to
// kMaxPicked of them run at their own batch, their rows gathered as the input
// is staged, so at batch 8 an expert chosen by one or two tokens stages them
// in shared memory (K2's 7168-wide input: 57 KB for two) instead of reading
// all eight from the global staging at every page; the other rows of st are
// zero.
template <class T>
struct Fp8RowsCompute {
  Fp8Rows rows;               // the task's weight rows (fp8_rows_load streams them)
  const T* x;                 // [B, rows.k] the input
  const __nv_bfloat16* norm;  // [rows.k] the RMSNorm prologue's weight, or null: no prologue
  float eps;                  // the prologue's epsilon
  float* spill;               // where the input is staged when it does not fit shared memory (or null)
  uint32_t tokens = ~0u;      // bit b: token b's row is computed (the others are zero)
};
template <int B, class T>
__device__ void fp8_rows_compute(Fp8RowsCompute<T> a, uint32_t& it, int warp, float* st) {
  const Fp8Rows& r = a.rows;
  run_picked<B>(a.tokens, r.cols(), st, [&]<int N>(const uint8_t* rows) {
    const float* xs = stage_input<N>(a.x, r.k, a.norm, a.eps, input_area<N>(r.k, a.spill), rows);
    fp8_rows_pages_mma<N, kFp8Group<B>>(r, xs, it, warp, st);  // the pages in the loader's order
  });
}

}  // namespace mkc
