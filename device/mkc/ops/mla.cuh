// mkc device library: Weight-absorbed MLA decode: the split over the KV length (cache rows
// through the page ring, online softmax) and the combine (W_UV through the
// ring).
#pragma once

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

// Contiguous rows (cache rows, a head's W_UK block) travel packed: a page
// holds as many whole rows as fit (14 of K2's 576-element cache rows, 16 of
// its 512-element W_UK rows), one bulk copy per page.
constexpr uint32_t kMaxPackedRows = 16;
__device__ inline uint32_t packed_rows(uint32_t row) { return min(kMaxPackedRows, uint32_t(kPageBytes) / (2 * row)); }

// Loader: rows [0, n) of `row` elements from `base`, packed pages.
__device__ inline void packed_load(const __nv_bfloat16* base, uint32_t n, uint32_t row, uint32_t& it) {
  const uint32_t per = packed_rows(row);
  for (uint32_t j0 = 0; j0 < n; j0 += per, ++it) {
    const uint32_t bytes = min(per, n - j0) * row * 2;
    const int slot = it % kPages;
    if (threadIdx.x % 32 == 0) {
      Barrier::wait(&ring_ptr()->empty[slot], ((it / kPages) & 1) ^ 1);
      Barrier::arrive_and_expect_tx(&ring_ptr()->full[slot], bytes);
      cute::SM90_BULK_COPY_G2S::copy(base + size_t(j0) * row, &ring_ptr()->full[slot], ring_ptr()->page[slot],
                                     int32_t(bytes));
    }
    __syncwarp();
  }
}

// The W_UK block of head h: the first nope rows of its block of kv_b
// [heads (nope + v), c], contiguous.
__device__ inline const __nv_bfloat16* mla_key_block(const MlaShape& s, const __nv_bfloat16* wkvb, uint32_t h) {
  return wkvb + size_t(h) * (s.nope + s.v_dim) * s.c;
}

// Loader side of a split task: the W_UK block of each head of the group
// once (the queries' absorption, every token's at once; L2-resident, every
// split of the group reads it), then the split's cache rows token by token.
struct MlaSplitLoad {
  MlaShape shape;
  uint32_t head_group;         // the task's heads [head_group hpt, + hpt)
  uint32_t split;              // the task's KV split
  const __nv_bfloat16* wkvb;   // kv_b_proj [heads (nope + v_dim), c]
  const __nv_bfloat16* cache;  // [B][ctx][c + rope]
  const int32_t* pos;          // [B] each sequence's position
};
template <int B>
__device__ void mla_split_load(MlaSplitLoad a, uint32_t& it) {
  const MlaShape& s = a.shape;
  const uint32_t h0 = a.head_group * s.hpt, nh = min(s.hpt, s.heads - h0);
  for (uint32_t h = h0; h < h0 + nh; ++h) packed_load(mla_key_block(s, a.wkvb, h), s.nope, s.c, it);
  for (int b = 0; b < B; ++b) {
    const Rows r = mla_cache_rows(s, a.split, a.cache, b, uint32_t(a.pos[b]));
    packed_load(r.w0 + size_t(r.r0) * r.k, r.r1 - r.r0, r.k, it);
  }
}

// The fold: pages of cache rows taken kMlaFoldPages at a time (plus, in the
// last fold, the current row), two consumer barriers per fold. A lane holds
// kMlaLanePairs column pairs of a row (rows of at most 576 elements) and the
// absorbed query of up to kMlaQuad heads at those columns in registers.
constexpr uint32_t kMlaFoldPages = 4;
constexpr uint32_t kMlaFoldRows = kMlaFoldPages * kMaxPackedRows + 1;
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
static_assert(sizeof(MlaRunning) <= size_t(kActivationBytes) / 2,
              "the MLA softmax state fits half the staging area (the other half: the queries' no-PE parts)");

// The rows of one fold: up to kMlaFoldPages ring pages of `per` packed rows
// (cache_n rows in all), then, in a split's last fold, the current row.
struct FoldRows {
  uint32_t first;            // ring position of the fold's first page
  const __nv_bfloat16* cur;  // nullptr: no current row in this fold
  uint32_t per, cache_n, row;
  __device__ uint32_t n() const { return cache_n + (cur != nullptr ? 1 : 0); }
  __device__ const __nv_bfloat16* page(uint32_t k) const { return ring_ptr()->page[(first + k) % kPages]; }
  __device__ const __nv_bfloat16* at(uint32_t j) const {
    return j == cache_n ? cur : page(j / per) + (j % per) * row;
  }
};

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
      const __nv_bfloat16* r = j == f.cache_n ? f.cur : f.page(k) + jj * f.row;
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

// One (head group, KV split) task: partials [B, heads, splits, 2 + c] of
// (max, sum of exp, sum of exp * c_kv), by online softmax over the split's
// cache rows, then the current row. First every token's query is absorbed into
// the latent space (qlat[b, h] = q_nope[b, h] W_UK[h], W_UK streamed through
// the page ring once, a thread per pair of latent columns): at batch 1 into
// scratch, at larger batches into `absorbed` (the SM's staging; the no-PE
// queries staged in the upper half of the activation area meanwhile). Then,
// token by token, the cache rows through the ring, kMlaFoldPages pages per
// fold (mla_split_load streams both). The split holding the current position
// appends the new row to the cache (head group 0 writes it; the others use
// their own copy in shared memory).
template <class T>
struct MlaSplit {
  MlaShape shape;
  uint32_t head_group;         // the task's heads [head_group hpt, + hpt)
  uint32_t split;              // the task's KV split
  const T* q;                  // [B, heads (nope + rope)]
  const T* ckv_raw;            // [B, c] the new latent row, before its norm
  const __nv_bfloat16* norm;   // [c] the latent's RMSNorm weight, or null: none
  float eps;                   // the norm's epsilon
  const T* kpe;                // [B, rope] the new row's RoPE'd key
  const __nv_bfloat16* wkvb;   // kv_b_proj [heads (nope + v_dim), c]
  __nv_bfloat16* cache;        // [B][ctx][c + rope]
  const int32_t* pos;          // [B] each sequence's position
  float* partials;             // [B, heads, splits, 2 + c]
  float* absorbed;             // [B, hpt, c] the absorbed queries at batch > 1 (the SM's staging), else null
};

// W_UK of the task's nh heads [h0, h0 + nh) through the ring, each page's rows
// multiplied by every token's no-PE query: a thread per pair of latent
// columns, qn [B][nh][nope] read from shared memory, the sums into qlat
// [B][nh][c] (scratch at batch 1, the SM's staging otherwise).
template <int B>
__device__ void mla_absorb(const MlaShape& s, uint32_t nh, const float* qn, float* qlat, uint32_t& it) {
  const uint32_t pair = threadIdx.x, per_k = packed_rows(s.c);
  for (uint32_t h = 0; h < nh; ++h) {
    float acc[B][2] = {};
    for (uint32_t n0 = 0; n0 < s.nope; n0 += per_k, ++it) {
      const int slot = it % kPages;
      Barrier::wait(&ring_ptr()->full[slot], (it / kPages) & 1);
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
        float* out = qlat + (size_t(b) * nh + h) * s.c + 2 * pair;
        out[0] = acc[b][0];
        out[1] = acc[b][1];
      }
    }
  }
  consumer_sync();  // every thread's sums are in (shared or global memory) for the folds
}

template <int B, class T>
__device__ void mla_split(MlaSplit<T> a, uint32_t& it) {
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
  float* qn = qpe + s.hpt * s.rope;                        // [hpt, nope]
  __nv_bfloat16* cur = reinterpret_cast<__nv_bfloat16*>(qn + s.hpt * s.nope);  // [c + rope], 16-byte aligned
  MlaRunning& run = *reinterpret_cast<MlaRunning*>(activation_ptr());
  const uint32_t pair = threadIdx.x;  // a thread per pair of latent columns (absorption, weighted sums)
  // Every token's no-PE query ([B][nh][nope]: scratch's qn at batch 1, the
  // upper half of the activation area otherwise), then the absorption.
  if (B > 1 && (a.absorbed == nullptr || size_t(B) * nh * s.nope * sizeof(float) > size_t(kActivationBytes) / 2)) {
    __trap();  // the planner gives batch > 1 an absorbed-query staging and keeps the queries in half the area
  }
  float* qn_all = B == 1 ? qn : activation_ptr() + kActivationBytes / sizeof(float) / 2;
  for (uint32_t i = threadIdx.x; i < B * nh * s.nope; i += kConsumerThreads) {
    const uint32_t b = i / (nh * s.nope), h = i / s.nope % nh, n = i % s.nope;
    qn_all[i] = to_float(q[size_t(b) * s.heads * qk + size_t(h0 + h) * qk + n]);
  }
  consumer_sync();
  mla_absorb<B>(s, nh, qn_all, B == 1 ? qlat : a.absorbed, it);
  int parity = 0;
  for (int b = 0; b < B; ++b) {
    const float* qlat_b = B == 1 ? qlat : a.absorbed + size_t(b) * nh * s.c;
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
    for (uint32_t i = threadIdx.x; i < nh * s.rope; i += kConsumerThreads) {
      const uint32_t h = i / s.rope, r = i % s.rope;
      qpe[i] = to_float(q[size_t(b) * s.heads * qk + size_t(h0 + h) * qk + s.nope + r]);
    }
    if (threadIdx.x < kMaxMlaHeads) run.max[threadIdx.x] = -INFINITY, run.sum[threadIdx.x] = 0.f;
    consumer_sync();
    // The cache rows, kMlaFoldPages pages per fold; the current row joins the last fold.
    float acc[kMaxMlaHeads][2] = {};
    const Rows cr = mla_cache_rows(s, split, cache, b, p_now);
    const uint32_t per = packed_rows(row), rows = cr.r1 - cr.r0;
    const uint32_t pages = (rows + per - 1) / per;
    // With no cache rows before it in this split, one fold of the current row alone.
    for (uint32_t pg = 0, alone = has_now; alone || pg < pages; alone = 0) {
      const uint32_t np = min(kMlaFoldPages, pages - pg);
      FoldRows f{it, nullptr, per, min(np * per, rows - pg * per), row};
      for (uint32_t k = 0; k < np; ++k) Barrier::wait(&ring_ptr()->full[(it + k) % kPages], ((it + k) / kPages) & 1);
      if (pg + np == pages && has_now) f.cur = cur;
      mla_fold(s, nh, f, qlat_b, qpe, run, parity, acc);
      for (uint32_t k = 0; k < np; ++k) release_page(&ring_ptr()->empty[(it + k) % kPages]);
      it += np;
      pg += np;
      parity ^= 1;
    }
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
  T* out;                     // [B, heads v_dim]
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
      out[size_t(b) * s.heads * s.v_dim + h * s.v_dim + j] = from_float<T>(st[i]);
    }
    consumer_sync();
  }
}

}  // namespace mkc
