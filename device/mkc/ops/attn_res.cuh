// mkc device library: K3's block attention residuals: the mix, bank snapshots, and the MLA
// output gate's prologue.
#pragma once

#include "rows.cuh"

namespace mkc {

// ---------------------------------------------------------------------------
// Block attention residuals (K3): the mix of the bank's rows and the current
// row u, per token b,
//   rows r_0..r_{n-1} = bank[j][b], r_n = u[b]
//   s_j = (sum_d r_j[d] gamma[d] w[d]) rsqrt(mean_d r_j[d]^2 + eps)
//   out[b, d] = sum_j softmax(s)_j r_j[d]            (fp32)
// for token rows [b0, b1) (a task each: a row reads only its own bank rows)
// and output columns [d0, d1) (the scores always cover the whole row). The
// bank is [B][n][hidden] (a value of n rows per token), hidden a multiple of
// 4. A task is a chain of L2 and HBM round trips, so both passes keep as many
// loads in flight as a thread's registers hold: every thread takes
// kMixChunks four-column chunks of kMixRowsInFlight rows at once (the scores)
// and kMixChunks output chunks of the same rows (the mix); the scores'
// partial sums meet in scratch, the scores in shared memory. (A warp per row
// left most warps idle; four rows and one chunk at a time, then a load a row
// for the mix, took 13-15 us a token on the H100, a round trip each.)
// kMaxBankRows: contract.h.
template <class T>
struct AttnResMix {
  const T* bank;               // [B][n][hidden]
  uint32_t rows;               // n, the bank's rows
  const T* row;                // u [B][hidden], the current row
  const __nv_bfloat16* w;      // [hidden] the score's projection
  const __nv_bfloat16* gamma;  // [hidden] the score's RMSNorm weight
  float eps;
  uint32_t hidden;             // a row's width, a multiple of 4
  uint32_t d0, d1;             // output columns [d0, d1), multiples of 4
  uint32_t b0, b1;             // token rows [b0, b1)
  float* out;                  // [B][hidden]
};

constexpr uint32_t kMixRowsInFlight = 8;  // rows a thread reads at once
constexpr uint32_t kMixChunks = 2;        // four-column chunks of each a thread reads at once
template <int B, class T>
__device__ void attn_res_mix(AttnResMix<T> a) {
  const T *bank = a.bank, *u = a.row;
  const __nv_bfloat16 *w = a.w, *gamma = a.gamma;
  const uint32_t n = a.rows, hidden = a.hidden, d0 = a.d0, d1 = a.d1;
  const float eps = a.eps;
  float* out = a.out;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __shared__ float p[B][kMaxBankRows + 1];
  static_assert(kConsumerWarps * B * (kMaxBankRows + 1) * 2 * sizeof(float) <= size_t(kScratchBytes),
                "the mix's partial sums fit in scratch");
  if (n > kMaxBankRows || hidden % 4 != 0 || d0 % 4 != 0 || d1 % 4 != 0 || a.b1 > uint32_t(B) || a.b0 >= a.b1) {
    __trap();
  }
  const uint32_t b0 = a.b0, tokens = a.b1 - a.b0, rows = tokens * (n + 1);
  float* part = reinterpret_cast<float*>(scratch_ptr());  // [warp][row][dot, sum of squares]
  // Row i of the task's rows: token row b0 + i / (n + 1)'s bank row i % (n + 1)
  // (the last: its current row).
  auto row = [&](uint32_t i) {
    const uint32_t b = i / (n + 1), j = i % (n + 1);
    return j < n ? bank + (size_t(b0 + b) * n + j) * hidden : u + size_t(b0 + b) * hidden;
  };
  constexpr uint32_t kStride = kConsumerThreads * 4;  // columns between a thread's chunks
  for (uint32_t i0 = 0; i0 < rows; i0 += kMixRowsInFlight) {
    float dot[kMixRowsInFlight] = {}, ss[kMixRowsInFlight] = {};
    for (uint32_t c0 = threadIdx.x * 4; c0 < hidden; c0 += kStride * kMixChunks) {
      float4 gw[kMixChunks], x[kMixRowsInFlight][kMixChunks];
#pragma unroll
      for (uint32_t c = 0; c < kMixChunks; ++c) {
        const uint32_t d = c0 + c * kStride;
        if (d >= hidden) break;
        const float4 g = load_four(gamma + d), v = load_four(w + d);
        gw[c] = make_float4(g.x * v.x, g.y * v.y, g.z * v.z, g.w * v.w);
#pragma unroll
        for (uint32_t k = 0; k < kMixRowsInFlight; ++k) {
          if (i0 + k < rows) x[k][c] = load_four(row(i0 + k) + d);
        }
      }
#pragma unroll
      for (uint32_t c = 0; c < kMixChunks; ++c) {
        if (c0 + c * kStride >= hidden) break;
#pragma unroll
        for (uint32_t k = 0; k < kMixRowsInFlight; ++k) {
          if (i0 + k >= rows) break;
          const float4 v = x[k][c], g = gw[c];
          dot[k] = fmaf(v.x, g.x, fmaf(v.y, g.y, fmaf(v.z, g.z, fmaf(v.w, g.w, dot[k]))));
          ss[k] = fmaf(v.x, v.x, fmaf(v.y, v.y, fmaf(v.z, v.z, fmaf(v.w, v.w, ss[k]))));
        }
      }
    }
#pragma unroll
    for (uint32_t k = 0; k < kMixRowsInFlight; ++k) {
      const float rd = warp_sum(dot[k]), rs = warp_sum(ss[k]);
      const uint32_t i = i0 + k;
      if (lane == 0 && i < rows) part[(warp * rows + i) * 2] = rd, part[(warp * rows + i) * 2 + 1] = rs;
    }
  }
  consumer_sync();
  if (threadIdx.x < rows) {
    float dot = 0.f, ss = 0.f;
    for (int v = 0; v < kConsumerWarps; ++v) dot += part[(v * rows + threadIdx.x) * 2], ss += part[(v * rows + threadIdx.x) * 2 + 1];
    p[threadIdx.x / (n + 1)][threadIdx.x % (n + 1)] = dot * rsqrtf(ss / float(hidden) + eps);
  }
  consumer_sync();
  if (threadIdx.x < tokens) {
    const int b = threadIdx.x;
    float m = -INFINITY;
    for (uint32_t j = 0; j <= n; ++j) m = fmaxf(m, p[b][j]);
    float l = 0.f;
    for (uint32_t j = 0; j <= n; ++j) l += (p[b][j] = expf(p[b][j] - m));
    for (uint32_t j = 0; j <= n; ++j) p[b][j] /= l;
  }
  consumer_sync();
  // The mix: a thread's kMixChunks chunks of a token's output, its rows
  // kMixRowsInFlight at a time, every load of a group issued before the sums.
  const uint32_t quads = (d1 - d0) / 4;
  const uint32_t per = (quads + kConsumerThreads - 1) / kConsumerThreads;  // a token's chunks a thread
  for (uint32_t t0 = 0; t0 < tokens * per; t0 += kMixChunks) {
    float4 acc[kMixChunks];
    uint32_t tb[kMixChunks], td[kMixChunks];  // a chunk's token row (of the task's) and first column
    bool live[kMixChunks];
#pragma unroll
    for (uint32_t c = 0; c < kMixChunks; ++c) {
      const uint32_t t = t0 + c, q = (t % per) * kConsumerThreads + threadIdx.x;
      live[c] = t < tokens * per && q < quads;
      tb[c] = t / per, td[c] = d0 + q * 4;
      acc[c] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
    for (uint32_t j0 = 0; j0 <= n; j0 += kMixRowsInFlight) {
      float4 x[kMixRowsInFlight][kMixChunks];
#pragma unroll
      for (uint32_t c = 0; c < kMixChunks; ++c) {
#pragma unroll
        for (uint32_t k = 0; k < kMixRowsInFlight; ++k) {
          if (live[c] && j0 + k <= n) x[k][c] = load_four(row(tb[c] * (n + 1) + j0 + k) + td[c]);
        }
      }
#pragma unroll
      for (uint32_t c = 0; c < kMixChunks; ++c) {
#pragma unroll
        for (uint32_t k = 0; k < kMixRowsInFlight; ++k) {
          if (!live[c] || j0 + k > n) break;
          const float pj = p[tb[c]][j0 + k];
          const float4 v = x[k][c];
          acc[c] = make_float4(fmaf(pj, v.x, acc[c].x), fmaf(pj, v.y, acc[c].y), fmaf(pj, v.z, acc[c].z),
                               fmaf(pj, v.w, acc[c].w));
        }
      }
    }
#pragma unroll
    for (uint32_t c = 0; c < kMixChunks; ++c) {
      if (live[c]) *reinterpret_cast<float4*>(out + size_t(b0 + tb[c]) * hidden + td[c]) = acc[c];
    }
  }
  consumer_sync();
}

// A bank with one more row: out [B][rows + 1][hidden] = (bank
// [B][rows][hidden], row [B][hidden]).
template <class T, class U>
struct StackRows {
  const T* bank;    // [B][rows][hidden], or null when rows is 0
  uint32_t rows;    // the bank's rows
  const U* row;     // [B][hidden]
  uint32_t hidden;  // a row's width
  T* out;           // [B][rows + 1][hidden]
};
template <int B, class T, class U>
__device__ void stack_rows(StackRows<T, U> a) {
  const uint32_t n = a.rows, hidden = a.hidden;
  if (hidden % 4 == 0) {  // four columns a thread at a time
    const uint32_t quads = hidden / 4, per = (n + 1) * quads, total = uint32_t(B) * per;
#pragma unroll 4
    for (uint32_t i = threadIdx.x; i < total; i += kConsumerThreads) {
      const uint32_t b = i / per, j = i / quads % (n + 1), d = i % quads * 4;
      const float4 x =
          j < n ? load_four(a.bank + (size_t(b) * n + j) * hidden + d) : load_four(a.row + size_t(b) * hidden + d);
      store_four(a.out + size_t(i) * 4, x);
    }
  } else {
    for (uint32_t i = threadIdx.x; i < B * (n + 1) * hidden; i += kConsumerThreads) {
      const uint32_t b = i / ((n + 1) * hidden), j = (i / hidden) % (n + 1), d = i % hidden;
      a.out[i] = j < n ? a.bank[(size_t(b) * n + j) * hidden + d] : from_float<T>(to_float(a.row[size_t(b) * hidden + d]));
    }
  }
  consumer_sync();
}

// K3's MLA output gate's factor: sigmoid(g) (sigmoid_gate 1) or g itself (0).
__device__ __forceinline__ float output_gate(float g, int sigmoid_gate) {
  return sigmoid_gate ? sigmoid(g) : g;
}

// x * sigmoid(g) (or x * g) as the tensor-core rows consumer reads it,
// computed where it is read.
template <class T, class G>
struct MulInput {
  const T* x;
  const G* g;
  uint32_t k;
  int sigmoid_gate;
  __device__ void operator()(uint32_t b, uint32_t e, float (&v)[8]) const {
    const size_t at = size_t(b) * k + e;
    const float4 xp = load_four(x + at), xq = load_four(x + at + 4);
    const float4 gp = load_four(g + at), gq = load_four(g + at + 4);
    const float xs[8] = {xp.x, xp.y, xp.z, xp.w, xq.x, xq.y, xq.z, xq.w};
    const float gs[8] = {gp.x, gp.y, gp.z, gp.w, gq.x, gq.y, gq.z, gq.w};
#pragma unroll
    for (int u = 0; u < 8; ++u) v[u] = xs[u] * output_gate(gs[u], sigmoid_gate);
  }
};

// Projection rows whose input is an element-wise gated value (K3's MLA
// output gate): x' = x * sigmoid(g) (or x * g). On the tensor cores (batch 2
// to 8) the pages read it where it is (MulInput); otherwise it is staged as
// fp32 in shared memory, or in `spill` when it does not fit (input_area; read
// a page ahead, rows_pages_staged).
template <class T, class G>
struct RowsComputeMul {
  Rows rows;         // the task's weight rows (rows_load streams them)
  const T* x;        // [B, rows.k] the value
  const G* g;        // [B, rows.k] the gate
  int sigmoid_gate;  // x * sigmoid(g) (1) or x * g (0)
  float* spill;      // where the input is staged when it does not fit shared memory (or null)
};
template <int B, class T, class G>
__device__ void rows_compute_mul(RowsComputeMul<T, G> a, uint32_t& it, int warp, float* st) {
  const Rows& r = a.rows;
  if constexpr (kRowsMma<B>) {
    rows_pages_mma<B>(r, MulInput<T, G>{a.x, a.g, r.k, a.sigmoid_gate}, it, warp, st);
    return;
  }
  const uint32_t n = uint32_t(B) * r.k;
  float* xs = input_area<B>(r.k, a.spill);
  for (uint32_t i = threadIdx.x; i < n; i += kConsumerThreads) {
    xs[i] = to_float(a.x[i]) * output_gate(to_float(a.g[i]), a.sigmoid_gate);
  }
  consumer_sync();
  rows_pages_staged<B>(r, xs, it, warp, st);
}

}  // namespace mkc
