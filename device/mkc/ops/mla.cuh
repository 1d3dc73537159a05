// mkc device library: Weight-absorbed MLA decode: the split over the KV length (cache rows
// through the page ring, online softmax) and the combine (W_UV through the
// ring).
#pragma once

#include <cute/arch/copy_sm75.hpp>

#include <type_traits>

#include "rows.cuh"

namespace mkc {

// ---------------------------------------------------------------------------
// Weight-absorbed MLA decode. Per token b, head h: q = [q_nope (nope) | q_pe
// (rope)], the cache row p = [c_kv (c) | k_pe (rope)], kv_b_proj rows per head
// [W_UK (nope rows) | W_UV (v_dim rows)] of width c. Score_p = scale (q_nope
// W_UK . c_kv_p + q_pe . k_pe_p); out = W_UV sum_p softmax_p c_kv_p.
// Heads per MLA task the split keeps in registers (the codegen checks).
// kMaxMlaHeads: contract.h.

struct MlaShape {
  uint32_t heads;   // attention heads
  uint32_t hpt;     // heads per split task (a head group)
  uint32_t groups;  // head groups
  uint32_t splits;  // KV splits of the context
  uint32_t ctx;     // the cache's rows per sequence (the context)
  uint32_t c;       // the latent width (kv_lora_rank)
  uint32_t nope;    // the query's and key's no-PE width
  uint32_t rope;    // their RoPE width
  uint32_t v_dim;   // a head's value width
  float scale;      // the scores' scale
  // Rows of the batch a sequence holds (1 to kMaxPositions): a verify step's consecutive positions of
  // one sequence, row b its position b % positions; 1 in plain decoding. The cache holds a sequence
  // each [B / positions][ctx], and pos[b] is row b's own position.
  uint32_t positions;
};

__device__ inline void split_range(const MlaShape& s, uint32_t split, uint32_t& p0, uint32_t& p1) {
  const uint32_t base = s.ctx / s.splits, rem = s.ctx % s.splits;
  p0 = split * base + min(split, rem);
  p1 = p0 + base + (split < rem ? 1 : 0);
}

// The cache rows a split task streams through the page ring for row b: the
// split's positions before the step's first position of b's sequence (the
// rows the step itself writes, b's and its earlier positions', are made in
// shared memory instead).
__device__ inline Rows mla_cache_rows(const MlaShape& s, uint32_t split, const __nv_bfloat16* cache, uint32_t b,
                                      const int32_t* pos) {
  uint32_t p0, p1;
  split_range(s, split, p0, p1);
  const uint32_t first = uint32_t(pos[b]) - b % s.positions;
  const uint32_t end = max(p0, min(p1, first));
  return Rows{cache + size_t(b / s.positions) * s.ctx * (s.c + s.rope), nullptr, p0, end, s.c + s.rope};
}

// Contiguous rows (cache rows, a head's W_UK block) travel packed: a page
// holds as many whole rows as fit, `stride` elements apart (14 of K2's
// 576-element cache rows, 16 of its 512-element W_UK rows).
constexpr uint32_t kMaxPackedRows = 16;
__device__ inline uint32_t packed_rows(uint32_t stride) {
  return min(kMaxPackedRows, uint32_t(kPageBytes) / (2 * stride));
}
// A cache row's place in a page: kCachePad elements (16 bytes) past the
// row's end, so rows a multiple of 128 bytes long (K2's 1,152 bytes, K3's
// 1,024) do not put the eight rows an ldmatrix tile or a quarter-warp's
// 16-byte loads read in the same shared-memory banks (mla_fold_mma).
constexpr uint32_t kCachePad = 8;
__device__ inline uint32_t cache_stride(uint32_t row) { return row + kCachePad; }

// Loader: rows [0, n) of `row` elements from `base`, packed pages of rows
// `stride` apart: one bulk copy a page where they are back to back, else one
// a row (a lane each).
__device__ inline void packed_load(const __nv_bfloat16* base, uint32_t n, uint32_t row, uint32_t stride,
                                   uint32_t& it) {
  const uint32_t per = packed_rows(stride), lane = threadIdx.x % 32;
  static_assert(kMaxPackedRows <= 32, "a lane a row");
  for (uint32_t j0 = 0; j0 < n; j0 += per, ++it) {
    const uint32_t cnt = min(per, n - j0), bytes = cnt * row * 2;
    const int slot = it % kPages;
    if (lane == 0) {
      wait_slot_free(it);
      Barrier::arrive_and_expect_tx(&ring_ptr()->full[slot], bytes);
      if (stride == row) {
        cute::SM90_BULK_COPY_G2S::copy(base + size_t(j0) * row, &ring_ptr()->full[slot], ring_ptr()->page[slot],
                                       int32_t(bytes));
      }
    }
    __syncwarp();
    if (stride != row && lane < cnt) {
      cute::SM90_BULK_COPY_G2S::copy(base + size_t(j0 + lane) * row, &ring_ptr()->full[slot],
                                     ring_ptr()->page[slot] + lane * stride, int32_t(row * 2));
    }
    __syncwarp();
  }
}

// The W_UK block of head h: the first nope rows of its block of kv_b
// [heads (nope + v), c], contiguous.
__device__ inline const __nv_bfloat16* mla_key_block(const MlaShape& s, const __nv_bfloat16* wkvb, uint32_t h) {
  return wkvb + size_t(h) * (s.nope + s.v_dim) * s.c;
}

// Loader side of a split task: the split's cache rows, token by token (the
// queries come absorbed, mla_absorb_heads).
struct MlaSplitLoad {
  MlaShape shape;
  uint32_t head_group;         // the task's heads [head_group hpt, + hpt)
  uint32_t split;              // the task's KV split
  const __nv_bfloat16* cache;  // [B][ctx][c + rope]
  const int32_t* pos;          // [B] each sequence's position
};
template <int B>
__device__ void mla_split_load(MlaSplitLoad a, uint32_t& it) {
  const MlaShape& s = a.shape;
  for (uint32_t b = 0; b < uint32_t(B); ++b) {
    const Rows r = mla_cache_rows(s, a.split, a.cache, b, a.pos);
    packed_load(r.w0 + size_t(r.r0) * r.k, r.r1 - r.r0, r.k, cache_stride(r.k), it);
  }
}

// The fold: pages of cache rows taken kMlaFoldPages at a time (plus, in the
// last fold, the rows the step writes: the current one and, in a verify
// step, the sequence's earlier positions), two consumer barriers per fold. A lane holds
// kMlaLanePairs column pairs of a row (rows of at most 576 elements) and the
// absorbed query of up to kMlaQuad heads at those columns in registers.
constexpr uint32_t kMlaFoldPages = 4;
constexpr uint32_t kMlaFoldRows = kMlaFoldPages * kMaxPackedRows + kMaxPositions;
// kMlaLanePairs: contract.h.
static_assert(kMlaMaxRow == 64 * kMlaLanePairs && kMlaMaxLatent <= kMlaMaxRow, "a lane holds a row's column pairs");
constexpr uint32_t kMlaQuad = 4;
static_assert(kMaxMlaHeads <= kConsumerWarps, "the softmax takes a warp per head");
static_assert(kMlaFoldRows <= 96, "the softmax takes three rows per lane");
static_assert(2 * kMlaFoldPages <= kPages, "the loader fills a fold's pages while the last fold is computed");

// Online-softmax state of a split task's heads (in the activation staging
// area, which a split task does not otherwise use): the fold's scores,
// overwritten by its probabilities, [row][head], and the rescale of the
// running sums, both by fold parity (the next fold's scores may be written
// while a slower warp still reads this fold's probabilities).
struct MlaRunning {
  float prob[2][kMlaFoldRows][kMaxMlaHeads];
  float rescale[2][kMaxMlaHeads];
  float max[kMaxMlaHeads], sum[kMaxMlaHeads];
};
// The new rows a split task makes, after the softmax state in the staging
// area: up to kMaxPositions rows, cache_stride(kMlaMaxRow) elements apart.
constexpr size_t kMlaNewRowsAt = (sizeof(MlaRunning) + 15) / 16 * 16;
static_assert(kMlaNewRowsAt + size_t(kMaxPositions) * (kMlaMaxRow + 8) * 2 <= size_t(kActivationBytes),
              "the MLA softmax state and the step's new rows fit the staging area");

// The rows of one fold: up to kMlaFoldPages ring pages of `per` packed rows
// `stride` elements apart (cache_n rows in all), then, in a split's last
// fold, the rows the step writes (ncur of them at cur, `stride` apart).
struct FoldRows {
  uint32_t first;            // ring position of the fold's first page
  const __nv_bfloat16* cur;  // the step's new rows in this fold (ncur = 0: none)
  uint32_t ncur;
  uint32_t per, cache_n, stride;
  __device__ uint32_t n() const { return cache_n + ncur; }
  __device__ const __nv_bfloat16* page(uint32_t k) const { return ring_ptr()->page[(first + k) % kPages]; }
  __device__ const __nv_bfloat16* at(uint32_t j) const {
    return j >= cache_n ? cur + (j - cache_n) * stride : page(j / per) + (j % per) * stride;
  }
};

// The fold's softmax, per head (a warp each): the fold's maximum, the new
// running maximum, the probabilities (in place of the scores), the running
// sum and its rescale.
__device__ inline void mla_fold_softmax(uint32_t nh, uint32_t n, MlaRunning& run, int parity) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float(*prob)[kMaxMlaHeads] = run.prob[parity];
  if (uint32_t(warp) < nh) {
    const uint32_t h = warp;
    float sc[3];
    float m = run.max[h];
#pragma unroll
    for (int u = 0; u < 3; ++u) {
      const uint32_t j = lane + 32 * u;
      sc[u] = j < n ? prob[j][h] : -INFINITY;
      m = fmaxf(m, sc[u]);
    }
    m = warp_max(m);
    float l = 0.f;
#pragma unroll
    for (int u = 0; u < 3; ++u) {
      const uint32_t j = lane + 32 * u;
      if (j < n) {
        const float e = expf(sc[u] - m);
        prob[j][h] = e;
        l += e;
      }
    }
    l = warp_sum(l);
    if (lane == 0) {
      const float rescale = expf(run.max[h] - m);  // 0 on the first rows (max -inf)
      run.rescale[parity][h] = rescale;
      run.sum[h] = run.sum[h] * rescale + l;
      run.max[h] = m;
    }
  }
}

// Folds the rows of f into the running attention of the nh heads:
//  1. scores: a warp per row, a lane per kMlaLanePairs column pairs, the
//     query of kMlaQuad heads at a time in registers, the heads' warp sums
//     in one reduce-scatter;
//  2. per head (a warp each): the fold's maximum, the new running maximum,
//     the probabilities (in place), the running sum and its rescale;
//  3. the weighted latent sums: a thread per pair of latent columns,
//     acc[h] rescaled once per fold.
__device__ void mla_fold(const MlaShape& s, uint32_t nh, const FoldRows& f, const float* qlat, const float* qpe,
                         MlaRunning& run, int parity, float (&acc)[kMaxMlaHeads][2]) {
  const uint32_t n = f.n();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const uint32_t pairs = (s.c + s.rope) / 2;
  float(*prob)[kMaxMlaHeads] = run.prob[parity];
  for (uint32_t h0 = 0; h0 < nh; h0 += kMlaQuad) {
    float2 q[kMlaQuad][kMlaLanePairs];
#pragma unroll
    for (uint32_t hq = 0; hq < kMlaQuad; ++hq) {
#pragma unroll
      for (uint32_t i = 0; i < kMlaLanePairs; ++i) {
        const uint32_t p = lane + 32 * i, h = h0 + hq;
        q[hq][i] = h >= nh || p >= pairs ? make_float2(0.f, 0.f)
                   : 2 * p < s.c         ? load_pair(qlat + h * s.c + 2 * p)
                                         : load_pair(qpe + h * s.rope + 2 * p - s.c);
      }
    }
    for (uint32_t j = warp; j < n; j += kConsumerWarps) {
      const __nv_bfloat16* r = f.at(j);
      float dot[kMlaQuad] = {};
#pragma unroll
      for (uint32_t i = 0; i < kMlaLanePairs; ++i) {
        const uint32_t p = lane + 32 * i;
        if (p < pairs) {
          const float2 kv = load_pair(r + 2 * p);
#pragma unroll
          for (uint32_t hq = 0; hq < kMlaQuad; ++hq) dot[hq] = fmaf(q[hq][i].x, kv.x, fmaf(q[hq][i].y, kv.y, dot[hq]));
        }
      }
      const int hq = warp_sum_scatter<kMlaQuad>(dot);  // the four heads' sums in one reduce-scatter
      if (scatter_owner<kMlaQuad>() && h0 + hq < nh) prob[j][h0 + hq] = dot[0] * s.scale;
    }
  }
  consumer_sync();
  mla_fold_softmax(nh, n, run, parity);
  consumer_sync();
  const uint32_t pair = threadIdx.x;  // c <= 2 * kConsumerThreads (checked at codegen)
  if (pair < s.c / 2) {
#pragma unroll
    for (uint32_t h = 0; h < kMaxMlaHeads; ++h) {
      if (h >= nh) break;
      acc[h][0] *= run.rescale[parity][h];
      acc[h][1] *= run.rescale[parity][h];
    }
    for (uint32_t j = 0, k = 0, jj = 0; j < n; ++j) {
      const __nv_bfloat16* r = j >= f.cache_n ? f.cur + (j - f.cache_n) * f.stride : f.page(k) + jj * f.stride;
      if (++jj == f.per) jj = 0, ++k;
      const float2 kv = load_pair(r + 2 * pair);
      const float4 pa = *reinterpret_cast<const float4*>(&prob[j][0]);
      const float p4[4] = {pa.x, pa.y, pa.z, pa.w};
#pragma unroll
      for (uint32_t h = 0; h < 4; ++h) {
        if (h >= nh) break;
        acc[h][0] = fmaf(p4[h], kv.x, acc[h][0]);
        acc[h][1] = fmaf(p4[h], kv.y, acc[h][1]);
      }
      if (nh > 4) {
        const float4 pb = *reinterpret_cast<const float4*>(&prob[j][4]);
        const float p8[4] = {pb.x, pb.y, pb.z, pb.w};
#pragma unroll
        for (uint32_t h = 4; h < kMaxMlaHeads; ++h) {
          if (h >= nh) break;
          acc[h][0] = fmaf(p8[h - 4], kv.x, acc[h][0]);
          acc[h][1] = fmaf(p8[h - 4], kv.y, acc[h][1]);
        }
      }
    }
  }
}

// The fold on the tensor cores (mma.sync m16n8k16, bf16 in, fp32 sums),
// where the widths allow it (mla_mma_fits): the heads are M, as the tokens are
// in rows_pages_mma, rows 0-7 the high bf16 half of each head's fp32 query
// (scores) or probabilities (weighted sums) and rows 8-15 the low half, so one
// MMA a k-step keeps the fp32 value to about 2^-17 and a head's two rows are
// added at the end; the cache rows (exact in bf16) are B, read in the ring's
// pages by ldmatrix (their rows kCachePad elements apart, an odd number of
// 16-byte bank groups: the eight rows of a tile in different banks):
//  1. scores [heads, rows]: N = 8 rows a tile (a warp's), K = the row's
//     c + rope columns, 32 (two steps) an ldmatrix;
//  2. the softmax (mla_fold_softmax);
//  3. weighted sums [heads, c] += P [heads, rows] V [rows, c]: warp w's
//     columns [64 w, 64 w + 64), eight N tiles; K = the fold's rows, 16 a
//     step, V's fragments by ldmatrix.trans (rows past the fold read the last
//     row again, under probabilities of 0). acc[i] is N tile i's fragment:
//     [0], [1] head g's high-half sums at columns 2t, 2t + 1 of the tile, [2],
//     [3] its low-half sums there.
constexpr uint32_t kMlaMmaTiles = kMlaMaxLatent / (8 * kConsumerWarps);
static_assert(kMlaMaxLatent == 64 * kConsumerWarps, "a warp takes 64 latent columns of the weighted sums");
static_assert(kMaxMlaHeads == 8, "the heads fill M's eight high and eight low rows");

// Whether a row of c latent and rope RoPE columns takes the tensor-core fold:
// whole column blocks on either side of c (scores), c within the warps'
// columns (the planner's rule too, src/plan/tile.rs).
__host__ __device__ constexpr bool mla_mma_fits(uint32_t c, uint32_t rope) {
  return c % kMlaMmaColumns == 0 && rope % kMlaMmaColumns == 0 && c <= kMlaMaxLatent;
}
static_assert(kMlaMmaColumns == 32, "a lane's eight columns of each 32 (mla_fold_mma)");

__device__ void mla_fold_mma(const MlaShape& s, uint32_t nh, const FoldRows& f, const float* qlat, const float* qpe,
                             MlaRunning& run, int parity, float (&acc)[kMlaMmaTiles][4]) {
  const uint32_t n = f.n();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const uint32_t g = uint32_t(lane) / 4, t = uint32_t(lane) % 4;
  const uint32_t width = s.c + s.rope;
  float(*prob)[kMaxMlaHeads] = run.prob[parity];
  // 1. Scores: head g's query as A (zeros past the task's heads), the tile's
  // rows as B by ldmatrix, 32 columns (two k-steps) a load.
  for (uint32_t tile = warp; 8 * tile < n; tile += kConsumerWarps) {
    // This lane's ldmatrix row: the tile's row lane % 8, columns + 8 (lane / 8).
    const __nv_bfloat16* r = f.at(min(8 * tile + uint32_t(lane) % 8, n - 1)) + 8 * (uint32_t(lane) / 8);
    float d[4] = {};
    for (uint32_t k0 = 0; k0 < width; k0 += 32) {
      // Head g's query at this lane's k-slots of the two steps: columns
      // k0 + 2t, + 1, + 8, + 9 and the same + 16.
      float x[8] = {};
      if (g < nh) {
        const float* q = (k0 < s.c ? qlat + g * s.c + k0 : qpe + g * s.rope + (k0 - s.c)) + 2 * t;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float2 v = *reinterpret_cast<const float2*>(q + 8 * e);
          x[2 * e] = v.x, x[2 * e + 1] = v.y;
        }
      }
      uint32_t hi[4], lo[4];
#pragma unroll
      for (int pr = 0; pr < 4; ++pr) split_pair<__nv_bfloat162>(x[2 * pr], x[2 * pr + 1], hi[pr], lo[pr]);
      uint32_t w[4];  // b0, b1 of the step at k0, then of the step at k0 + 16
      cute::SM75_U32x4_LDSM_N::copy(*reinterpret_cast<const cute::uint128_t*>(r + k0), w[0], w[1], w[2], w[3]);
      cute::SM80_16x8x16_F32BF16BF16F32_TN::fma(d[0], d[1], d[2], d[3], hi[0], lo[0], hi[1], lo[1], w[0], w[1], d[0],
                                                d[1], d[2], d[3]);
      cute::SM80_16x8x16_F32BF16BF16F32_TN::fma(d[0], d[1], d[2], d[3], hi[2], lo[2], hi[3], lo[3], w[2], w[3], d[0],
                                                d[1], d[2], d[3]);
    }
    const uint32_t j = 8 * tile + 2 * t;  // d: head g's scores of rows j, j + 1 (high halves, then low)
    if (g < nh && j < n) prob[j][g] = (d[0] + d[2]) * s.scale;
    if (g < nh && j + 1 < n) prob[j + 1][g] = (d[1] + d[3]) * s.scale;
  }
  consumer_sync();
  mla_fold_softmax(nh, n, run, parity);
  consumer_sync();
  // 3. Weighted sums: the probabilities as A.
  const float rescale = g < nh ? run.rescale[parity][g] : 0.f;
#pragma unroll
  for (uint32_t i = 0; i < kMlaMmaTiles; ++i) {
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[i][e] *= rescale;
  }
  const uint32_t c0 = 64 * uint32_t(warp);
  if (c0 >= s.c) return;
  for (uint32_t j0 = 0; j0 < n; j0 += 16) {
    float p[4] = {};  // head g's probabilities of rows j0 + 2t, + 1, + 8, + 9
#pragma unroll
    for (uint32_t e = 0; e < 4; ++e) {
      const uint32_t j = j0 + 2 * t + (e & 1) + 8 * (e >> 1);
      if (g < nh && j < n) p[e] = prob[j][g];
    }
    uint32_t hi[2], lo[2];
    split_pair<__nv_bfloat162>(p[0], p[1], hi[0], lo[0]);
    split_pair<__nv_bfloat162>(p[2], p[3], hi[1], lo[1]);
    // This lane's ldmatrix row: row j0 + (lane % 8) + 8 ((lane / 8) % 2), columns + 8 (lane / 16).
    const __nv_bfloat16* r = f.at(min(j0 + uint32_t(lane) % 8 + 8 * ((uint32_t(lane) / 8) % 2), n - 1));
#pragma unroll
    for (uint32_t i = 0; i < kMlaMmaTiles; i += 2) {
      const uint32_t col = c0 + 8 * i;
      if (col >= s.c) break;
      uint32_t b[4];  // b0, b1 of N tile i, then of tile i + 1
      cute::SM75_U16x8_LDSM_T::copy(*reinterpret_cast<const cute::uint128_t*>(r + col + 8 * (uint32_t(lane) / 16)),
                                    b[0], b[1], b[2], b[3]);
      cute::SM80_16x8x16_F32BF16BF16F32_TN::fma(acc[i][0], acc[i][1], acc[i][2], acc[i][3], hi[0], lo[0], hi[1], lo[1],
                                                b[0], b[1], acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
      cute::SM80_16x8x16_F32BF16BF16F32_TN::fma(acc[i + 1][0], acc[i + 1][1], acc[i + 1][2], acc[i + 1][3], hi[0],
                                                lo[0], hi[1], lo[1], b[2], b[3], acc[i + 1][0], acc[i + 1][1],
                                                acc[i + 1][2], acc[i + 1][3]);
    }
  }
}

// One (head group, KV split) task: partials [B, heads, splits, 2 + c] of
// (max, sum of exp, sum of exp * c_kv), by online softmax over the split's
// cache rows, then the current row. The queries come absorbed into the latent
// space (`absorbed`, mla_absorb_heads' stage); token by token, the task's
// heads' absorbed queries are copied into scratch and the cache rows come
// through the ring, kMlaFoldPages pages per fold (mla_split_load). The split
// holding the current position appends the new row to the cache (head group
// 0 writes it; the others use their own copy in shared memory). kMma: the
// folds on the tensor cores (mla_fold_mma; widths as mla_mma_fits), otherwise
// on the CUDA cores.
template <class T>
struct MlaSplit {
  MlaShape shape;
  uint32_t head_group;        // the task's heads [head_group hpt, + hpt)
  uint32_t split;             // the task's KV split
  const T* q;                 // [B, heads (nope + rope)]: the RoPE parts are read here
  const float* absorbed;      // [B, heads, c] q_nope W_UK per head (mla_absorb_heads)
  const T* ckv_raw;           // [B, c] the new latent row, before its norm
  const __nv_bfloat16* norm;  // [c] the latent's RMSNorm weight, or null: none
  float eps;                  // the norm's epsilon
  const T* kpe;               // [B, rope] the new row's RoPE'd key
  __nv_bfloat16* cache;       // [B][ctx][c + rope]
  const int32_t* pos;         // [B] each sequence's position
  float* partials;            // [B, heads, splits, 2 + c]
};

// W_UK of nh heads through the ring, each page's rows multiplied by every
// token's no-PE query: a thread per pair of latent columns, qn [B][nh][nope]
// read from shared memory, head h's sums of token b into qlat + (b ld + h) c.
template <int B>
__device__ void mla_absorb(const MlaShape& s, uint32_t nh, const float* qn, float* qlat, uint32_t ld, uint32_t& it) {
  const uint32_t pair = threadIdx.x, per_k = packed_rows(s.c);
  for (uint32_t h = 0; h < nh; ++h) {
    float acc[B][2] = {};
    for (uint32_t n0 = 0; n0 < s.nope; n0 += per_k, ++it) {
      const int slot = it % kPages;
      wait_page(it);
      if (pair < s.c / 2) {
        const __nv_bfloat16* page = ring_ptr()->page[slot];
        const uint32_t cnt = min(per_k, s.nope - n0);
        for (uint32_t j = 0; j < cnt; ++j) {
          const float2 w = load_pair(page + j * s.c + 2 * pair);
#pragma unroll
          for (int b = 0; b < B; ++b) {
            const float qv = qn[(b * nh + h) * s.nope + n0 + j];
            acc[b][0] = fmaf(qv, w.x, acc[b][0]);
            acc[b][1] = fmaf(qv, w.y, acc[b][1]);
          }
        }
      }
      release_page(&ring_ptr()->empty[slot]);
    }
    if (pair < s.c / 2) {
#pragma unroll
      for (int b = 0; b < B; ++b) {
        float* out = qlat + (size_t(b) * ld + h) * s.c + 2 * pair;
        out[0] = acc[b][0];
        out[1] = acc[b][1];
      }
    }
  }
  consumer_sync();  // every thread's sums are out
}

// Loader side of an absorption task: the W_UK block of each of its heads
// [h0, h1), in order.
struct MlaAbsorbLoad {
  MlaShape shape;
  uint32_t h0, h1;            // the task's heads
  const __nv_bfloat16* wkvb;  // kv_b_proj [heads (nope + v_dim), c]
};
template <int B>
__device__ inline void mla_absorb_load(MlaAbsorbLoad a, uint32_t& it) {
  for (uint32_t h = a.h0; h < a.h1; ++h) packed_load(mla_key_block(a.shape, a.wkvb, h), a.shape.nope, a.shape.c, a.shape.c, it);
}

// One absorption task: heads [h0, h1) of every token into the latent space,
// absorbed[b, h] = q_nope[b, h] W_UK[h] (W_UK streamed through the ring once a
// step; the split tasks of every KV split then read the result), the no-PE
// queries staged in the activation area ([B][nh][nope], within it: the
// planner's limit).
template <class T>
struct MlaAbsorb {
  MlaShape shape;
  uint32_t h0, h1;  // the task's heads
  const T* q;       // [B, heads (nope + rope)]
  float* absorbed;  // [B, heads, c]
};
template <int B, class T>
__device__ void mla_absorb_heads(MlaAbsorb<T> a, uint32_t& it) {
  const MlaShape& s = a.shape;
  const uint32_t h0 = a.h0, nh = a.h1 - a.h0, qk = s.nope + s.rope;
  if (size_t(B) * nh * s.nope * sizeof(float) > size_t(kActivationBytes) || s.c > 2 * kConsumerThreads) {
    __trap();  // the planner's limits: the no-PE queries fit the activation area, a thread per pair of columns
  }
  float* qn = activation_ptr();
  for (uint32_t i = threadIdx.x; i < B * nh * s.nope; i += kConsumerThreads) {
    const uint32_t b = i / (nh * s.nope), h = i / s.nope % nh, n = i % s.nope;
    qn[i] = to_float(a.q[size_t(b) * s.heads * qk + size_t(h0 + h) * qk + n]);
  }
  consumer_sync();
  mla_absorb<B>(s, nh, qn, a.absorbed + size_t(h0) * s.c, s.heads, it);
}

template <int B, bool kMma = false, class T>
__device__ void mla_split(MlaSplit<T> a, uint32_t& it) {
  if (kMma && !mla_mma_fits(a.shape.c, a.shape.rope)) __trap();  // the widths the tensor-core fold takes
  const MlaShape& s = a.shape;
  const uint32_t hg = a.head_group, split = a.split;
  const T *q = a.q, *ckv_raw = a.ckv_raw, *kpe = a.kpe;
  const __nv_bfloat16* norm = a.norm;
  const float eps = a.eps;
  __nv_bfloat16* cache = a.cache;
  const int32_t* pos = a.pos;
  float* partials = a.partials;
  const uint32_t h0 = hg * s.hpt, nh = min(s.hpt, s.heads - h0);
  const uint32_t qk = s.nope + s.rope, row = s.c + s.rope;
  uint32_t p0, p1;
  split_range(s, split, p0, p1);
  float* qlat = reinterpret_cast<float*>(scratch_ptr());  // [hpt, c]
  float* qpe = qlat + s.hpt * s.c;                         // [hpt, rope]
  MlaRunning& run = *reinterpret_cast<MlaRunning*>(activation_ptr());
  const uint32_t stride = cache_stride(row);
  // The step's new rows in this split, made here for the folds ([positions][stride]).
  __nv_bfloat16* fresh = reinterpret_cast<__nv_bfloat16*>(reinterpret_cast<char*>(activation_ptr()) + kMlaNewRowsAt);
  const uint32_t pair = threadIdx.x;  // a thread per pair of latent columns (the weighted sums)
  int parity = 0;
  for (uint32_t b = 0; b < uint32_t(B); ++b) {
    // Row b's absorbed queries of the task's heads into scratch: the folds read them at every
    // k-step (from the arena each read would wait out an L2 round trip). The previous row's
    // folds are done (the barrier closing its loop).
    const float* src = a.absorbed + (size_t(b) * s.heads + h0) * s.c;
    for (uint32_t i = threadIdx.x; i < nh * s.c; i += kConsumerThreads) qlat[i] = src[i];
    // Row b attends to its sequence's positions up to its own: the cache's rows before the step's
    // first position (streamed), then the step's rows up to b's (made here from the step's latents:
    // in a verify step, the earlier positions' rows are this step's too). The split holding a row's
    // position appends it to the cache (head group 0 writes it; the others only read their copy).
    const uint32_t p_now = uint32_t(pos[b]), first = p_now - b % s.positions;
    const uint32_t n0 = max(p0, first), n1 = min(p1, p_now + 1), ncur = n1 > n0 ? n1 - n0 : 0;
    for (uint32_t i = 0; i < ncur; ++i) {
      const uint32_t rb = b - (p_now - (n0 + i));  // the batch row of position n0 + i
      float ss = 0.f;
      for (uint32_t j = threadIdx.x; j < s.c; j += kConsumerThreads) {
        const float v = to_float(ckv_raw[size_t(rb) * s.c + j]);
        ss = fmaf(v, v, ss);
      }
      const float r = norm != nullptr ? rsqrtf(block_sum(ss) / float(s.c) + eps) : 1.f;
      __nv_bfloat16* dst = rb == b && hg == 0 ? cache + (size_t(b / s.positions) * s.ctx + p_now) * row : nullptr;
      for (uint32_t j = threadIdx.x; j < row; j += kConsumerThreads) {
        float v;
        if (j < s.c) {
          v = to_float(ckv_raw[size_t(rb) * s.c + j]);
          if (norm != nullptr) v = v * r * bf(norm[j]);
        } else {
          v = to_float(kpe[size_t(rb) * s.rope + j - s.c]);
        }
        const __nv_bfloat16 stored = __float2bfloat16(v);
        fresh[i * stride + j] = stored;
        if (dst != nullptr) dst[j] = stored;
      }
    }
    for (uint32_t i = threadIdx.x; i < nh * s.rope; i += kConsumerThreads) {
      const uint32_t h = i / s.rope, r = i % s.rope;
      qpe[i] = to_float(q[size_t(b) * s.heads * qk + size_t(h0 + h) * qk + s.nope + r]);
    }
    if (threadIdx.x < kMaxMlaHeads) run.max[threadIdx.x] = -INFINITY, run.sum[threadIdx.x] = 0.f;
    consumer_sync();
    // The cache rows, kMlaFoldPages pages per fold; the new rows join the last fold.
    // The weighted sums' accumulators: a pair of latent columns of every head
    // (mla_fold), or the tensor-core fold's tiles (mla_fold_mma).
    using Acc = std::conditional_t<kMma, float[kMlaMmaTiles][4], float[kMaxMlaHeads][2]>;
    Acc acc = {};
    const Rows cr = mla_cache_rows(s, split, cache, b, pos);
    const uint32_t per = packed_rows(stride), rows = cr.r1 - cr.r0;
    const uint32_t pages = (rows + per - 1) / per;
    // With no cache rows before them in this split, one fold of the new rows alone.
    for (uint32_t pg = 0, alone = ncur > 0; alone || pg < pages; alone = 0) {
      const uint32_t np = min(kMlaFoldPages, pages - pg);
      FoldRows f{it, nullptr, 0, per, min(np * per, rows - pg * per), stride};
      for (uint32_t k = 0; k < np; ++k) wait_page(it + k);
      if (pg + np == pages) f.cur = fresh, f.ncur = ncur;
      if constexpr (kMma) {
        mla_fold_mma(s, nh, f, qlat, qpe, run, parity, acc);
      } else {
        mla_fold(s, nh, f, qlat, qpe, run, parity, acc);
      }
      for (uint32_t k = 0; k < np; ++k) release_page(&ring_ptr()->empty[(it + k) % kPages]);
      it += np;
      pg += np;
      parity ^= 1;
    }
    auto part_of = [&](uint32_t h) { return partials + ((size_t(b) * s.heads + h0 + h) * s.splits + split) * (2 + s.c); };
    if constexpr (kMma) {
      // Lane (g, t) of warp w holds head g's sums at columns 64 w + 8 i + 2t, + 1: high halves plus low.
      const uint32_t g = (threadIdx.x % 32) / 4, t = threadIdx.x % 4, c0 = 64 * (threadIdx.x / 32);
      if (g < nh) {
        float* part = part_of(g);
#pragma unroll
        for (uint32_t i = 0; i < kMlaMmaTiles; ++i) {
          const uint32_t col = c0 + 8 * i + 2 * t;
          if (col < s.c) part[2 + col] = acc[i][0] + acc[i][2], part[3 + col] = acc[i][1] + acc[i][3];
        }
      }
      if (threadIdx.x < nh) part_of(threadIdx.x)[0] = run.max[threadIdx.x], part_of(threadIdx.x)[1] = run.sum[threadIdx.x];
    } else if (pair < s.c / 2) {
      const uint32_t cc = 2 * pair;
#pragma unroll
      for (uint32_t h = 0; h < kMaxMlaHeads; ++h) {
        if (h >= nh) break;
        float* part = part_of(h);
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

// Loader side of a combine task: W_UV of each of its heads [h0, h1), in order.
struct MlaCombineLoad {
  MlaShape shape;
  uint32_t h0, h1;            // the task's heads [h0, h1)
  const __nv_bfloat16* wkvb;  // kv_b_proj [heads (nope + v_dim), c]
};
template <int B>
__device__ inline void mla_combine_load(MlaCombineLoad a, uint32_t& it) {
  for (uint32_t h = a.h0; h < a.h1; ++h) rows_load<B>(mla_value_rows(a.shape, a.wkvb, h), it);
}

// Heads [h0, h1), one at a time: merges the splits by log-sum-exp into the
// latent output olat [B, c], then applies W_UV, its rows streamed through the
// page ring (rows_compute, which stages olat where it already is; its result
// [B, v_dim] after olat), both in the activation area (the tensor-core rows
// consumer keeps its partial sums in scratch).
template <class T>
struct MlaCombine {
  MlaShape shape;
  uint32_t h0, h1;            // the task's heads [h0, h1)
  const float* partials;      // [B, heads, splits, 2 + c], from mla_split
  const __nv_bfloat16* wkvb;  // kv_b_proj [heads (nope + v_dim), c]
  T* out;                     // [B, heads v_dim]: o, or with gate o times the gate
  // K3's output gate, applied here where the planner put it (a task owns
  // whole heads): out = o gate, or o sigmoid(gate) with gate_sigmoid. Null: out = o.
  const T* gate;              // [B, heads v_dim]
  int gate_sigmoid;
};
template <int B, class T>
__device__ void mla_combine(MlaCombine<T> a, uint32_t& it, int warp) {
  const MlaShape& s = a.shape;
  const uint32_t h0 = a.h0, h1 = a.h1;
  const float* partials = a.partials;
  const __nv_bfloat16* wkvb = a.wkvb;
  T* out = a.out;
  float* olat = activation_ptr();  // [B, c]
  float* st = olat + B * s.c;      // [B, v_dim]
  if (size_t(B) * (s.c + s.v_dim) * sizeof(float) > size_t(kActivationBytes)) __trap();  // the code generator's check
  for (uint32_t h = h0; h < h1; ++h) {
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
    rows_compute<B>(RowsCompute<float>{.rows = mla_value_rows(s, wkvb, h), .x = olat, .norm = nullptr, .eps = 0.f}, it,
                    warp, st);
    consumer_sync();
    for (uint32_t i = threadIdx.x; i < B * s.v_dim; i += kConsumerThreads) {
      const uint32_t b = i / s.v_dim, j = i % s.v_dim;
      const size_t at = size_t(b) * s.heads * s.v_dim + h * s.v_dim + j;
      float o = st[i];
      if (a.gate != nullptr) {
        const float gv = to_float(a.gate[at]);
        o *= a.gate_sigmoid ? sigmoid(gv) : gv;
      }
      out[at] = from_float<T>(o);
    }
    consumer_sync();
  }
}

}  // namespace mkc
