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
// 4. Every warp takes a share of every row's columns, four at a time, so all
// of the SM's loads are in flight together (a warp per row left most warps
// idle and each lane's loads in a long chain); the partial sums meet in
// scratch, the scores in shared memory.
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

constexpr uint32_t kMixRowsInFlight = 4;  // rows whose scores a thread sums at once
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
  // Token row b0 + b's bank row j (j = n: its current row).
  auto row = [&](uint32_t j, uint32_t b) {
    return j < n ? bank + (size_t(b0 + b) * n + j) * hidden : u + size_t(b0 + b) * hidden;
  };
  // The rows kMixRowsInFlight at a time: their loads in flight together, not
  // a reduction's round trip a row (batch 8's 24 rows, 51 us a mix on the H100).
  for (uint32_t i0 = 0; i0 < rows; i0 += kMixRowsInFlight) {
    float dot[kMixRowsInFlight] = {}, ss[kMixRowsInFlight] = {};
    for (uint32_t d = threadIdx.x * 4; d < hidden; d += kConsumerThreads * 4) {
      const float4 g = load_four(gamma + d), v = load_four(w + d);
#pragma unroll
      for (uint32_t k = 0; k < kMixRowsInFlight; ++k) {
        const uint32_t i = i0 + k;
        if (i >= rows) break;
        const float4 x = load_four(row(i % (n + 1), i / (n + 1)) + d);
        dot[k] = fmaf(x.x, g.x * v.x, fmaf(x.y, g.y * v.y, fmaf(x.z, g.z * v.z, fmaf(x.w, g.w * v.w, dot[k]))));
        ss[k] = fmaf(x.x, x.x, fmaf(x.y, x.y, fmaf(x.z, x.z, fmaf(x.w, x.w, ss[k]))));
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
  const uint32_t quads = (d1 - d0) / 4;
  for (uint32_t i = threadIdx.x; i < tokens * quads; i += kConsumerThreads) {
    const uint32_t b = i / quads;
    const uint32_t d = d0 + (i % quads) * 4;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (uint32_t j = 0; j <= n; ++j) {
      const float4 x = load_four(row(j, b) + d);
      const float pj = p[b][j];
      acc = make_float4(fmaf(pj, x.x, acc.x), fmaf(pj, x.y, acc.y), fmaf(pj, x.z, acc.z), fmaf(pj, x.w, acc.w));
    }
    *reinterpret_cast<float4*>(out + size_t(b0 + b) * hidden + d) = acc;
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
