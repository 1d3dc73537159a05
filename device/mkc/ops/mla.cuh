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

}  // namespace mkc
