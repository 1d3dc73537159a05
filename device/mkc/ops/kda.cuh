// mkc device library: KDA decode and its gated output norm (in the KDA stage, or the output projection's prologue).
#pragma once

#include "rows.cuh"

namespace mkc {

// ---------------------------------------------------------------------------
// KDA decode (Kimi Delta Attention), one step for heads [h0, h1) of every
// sequence. Per head h and token b, with d = head_dim, q and k already
// L2-normalised (the projection's epilogue), all fp32:
//   gate  g[i] = -exp(A_log[h]) softplus(f[i] + dt_bias[i])           (Kimi Linear)
//         g[i] = lower_bound sigmoid(exp(A_log[h]) (f[i] + dt_bias[i])) (K3's safe gate)
//   beta  = sigmoid(b_logit[h])
//   S <- S diag(exp(g))        (S [d_v, d_k] per head, column i scaled)
//   u  = beta (v - S k);  S <- S + u k^T;  o = S q / sqrt(d)
// A warp takes rows of S (a value channel each), a lane four key channels,
// so each state row is read and written once. The state is [B][heads][d][d]
// fp32, key channels contiguous.
struct KdaShape {
  uint32_t heads;     // heads of the layer
  uint32_t d;         // head_dim (keys and values)
  bool safe_gate;     // K3's lower-bounded sigmoid gate instead of softplus
  float lower_bound;  // safe gate only
};

// kMaxKdaDim: contract.h.

__device__ __forceinline__ float softplus(float x) { return x > 20.f ? x : log1pf(expf(x)); }

// A verify step's record of KDA's per-position inputs (kda_decode with
// positions), what kda_commit needs to step the state through the positions
// a sequence keeps: per row b (a sequence's position) and head h, the decay
// alpha = exp(g) and the key and value, [B][heads d] fp32, and beta [B][heads].
struct KdaLog {
  float* alpha;
  float* k;
  float* v;
  float* beta;
};

// One task's work: heads [h0, h1) of sequences [s0, s1) of the layer's
// shape, its inputs [B, heads d] (q, k, v, the gate's f, beta's logits [B,
// heads]) and its state.
template <class T>
struct KdaDecode {
  KdaShape shape;
  uint32_t h0, h1;        // the task's heads [h0, h1)
  uint32_t s0, s1;        // of sequences [s0, s1)
  const T* q;             // [B, heads d], L2-normalised
  const T* k;             // [B, heads d], L2-normalised
  const T* v;             // [B, heads d]
  const T* f;             // [B, heads d] the forget gate's input
  const T* b_logit;       // [B, heads] beta before its sigmoid
  const float* a_log;     // [heads]
  const float* dt_bias;   // [heads d]
  float* state;           // [sequences][heads][d][d] fp32
  T* out;                 // [B, heads d]: o, or with gate its gated output norm
  // KDA's gated output norm, applied here where the planner put it (its
  // tasks own whole heads): out = o rsqrt(mean over the head of o^2 + eps)
  // norm_w act(gate), act sigmoid (sigmoid_act 1) or SiLU (0). Null: out = o.
  const T* gate;                 // [B, heads d]
  const __nv_bfloat16* norm_w;   // [d]
  float norm_eps;
  int sigmoid_act;
  KdaLog log;             // a verify step's (positions > 1); unused otherwise
};

constexpr uint32_t kKdaPer = kMaxKdaDim / 128;  // float4 groups of a state row per lane
using KdaLane = float[kKdaPer][4];              // a lane's channels of a row: 4 per group

// The decay exp(g) of one channel from the gate's input x = f + dt_bias.
__device__ __forceinline__ float kda_alpha(const KdaShape& s, float scale, float x) {
  const float g = s.safe_gate ? s.lower_bound / (1.f + expf(-scale * x)) : -scale * softplus(x);
  return expf(g);
}

// One token's step of one state row, the lane's channels of it in sv:
// S_r <- S_r diag(alpha); u = beta (v_r - S_r k); S_r <- S_r + u k.
// Channels past d hold zeros in alpha and k (and so stay zero in sv).
__device__ __forceinline__ void kda_row_step(KdaLane& sv, const KdaLane& alpha, const KdaLane& kk, float beta,
                                             float v_r) {
  float mem = 0.f;
#pragma unroll
  for (uint32_t j = 0; j < kKdaPer; ++j) {
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      sv[j][u] *= alpha[j][u];
      mem = fmaf(sv[j][u], kk[j][u], mem);
    }
  }
  mem = warp_sum(mem);
  const float ur = beta * (v_r - mem);
#pragma unroll
  for (uint32_t j = 0; j < kKdaPer; ++j) {
#pragma unroll
    for (int u = 0; u < 4; ++u) sv[j][u] = fmaf(ur, kk[j][u], sv[j][u]);
  }
}

// The row's output sum over the lane's channels of S_r q, reduced over the warp.
__device__ __forceinline__ float kda_row_out(const KdaLane& sv, const KdaLane& qq) {
  float o = 0.f;
#pragma unroll
  for (uint32_t j = 0; j < kKdaPer; ++j) {
#pragma unroll
    for (int u = 0; u < 4; ++u) o = fmaf(sv[j][u], qq[j][u], o);
  }
  return warp_sum(o);
}

// A state row's lane channels from memory (zeros past d), and back.
__device__ __forceinline__ void kda_row_load(KdaLane& sv, const float* row, uint32_t d) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (uint32_t j = 0; j < kKdaPer; ++j) {
    const uint32_t i = 128 * j + 4 * lane;
    const float4 x = i < d ? *reinterpret_cast<const float4*>(row + i) : make_float4(0.f, 0.f, 0.f, 0.f);
    sv[j][0] = x.x, sv[j][1] = x.y, sv[j][2] = x.z, sv[j][3] = x.w;
  }
}
__device__ __forceinline__ void kda_row_store(const KdaLane& sv, float* row, uint32_t d) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (uint32_t j = 0; j < kKdaPer; ++j) {
    const uint32_t i = 128 * j + 4 * lane;
    if (i < d) *reinterpret_cast<float4*>(row + i) = make_float4(sv[j][0], sv[j][1], sv[j][2], sv[j][3]);
  }
}

// One token's decay, key and query over the lane's channels (zeros past d),
// token row b, head h; the query scaled by 1/sqrt(d).
template <class T>
__device__ __forceinline__ void kda_lane_inputs(const KdaDecode<T>& a, uint32_t b, uint32_t h, KdaLane& alpha,
                                                KdaLane& kk, KdaLane& qq) {
  const KdaShape& s = a.shape;
  const int lane = threadIdx.x % 32;
  const uint32_t d = s.d, p = s.heads * d;
  const float scale = expf(a.a_log[h]), qscale = rsqrtf(float(d));
#pragma unroll
  for (uint32_t j = 0; j < kKdaPer; ++j) {
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const uint32_t i = 128 * j + 4 * lane + u;
      alpha[j][u] = kk[j][u] = qq[j][u] = 0.f;
      if (i >= d) continue;
      const size_t at = size_t(b) * p + size_t(h) * d + i;
      alpha[j][u] = kda_alpha(s, scale, to_float(a.f[at]) + a.dt_bias[size_t(h) * d + i]);
      kk[j][u] = to_float(a.k[at]);
      qq[j][u] = to_float(a.q[at]) * qscale;
    }
  }
}

// The same channels of the query alone.
template <class T>
__device__ __forceinline__ void kda_lane_query(const KdaDecode<T>& a, uint32_t b, uint32_t h, KdaLane& qq) {
  const int lane = threadIdx.x % 32;
  const uint32_t d = a.shape.d, p = a.shape.heads * d;
  const float qscale = rsqrtf(float(d));
#pragma unroll
  for (uint32_t j = 0; j < kKdaPer; ++j) {
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const uint32_t i = 128 * j + 4 * lane + u;
      qq[j][u] = i < d ? to_float(a.q[size_t(b) * p + size_t(h) * d + i]) * qscale : 0.f;
    }
  }
}

// The same channels of a logged decay and key (kda_decode with positions).
__device__ __forceinline__ void kda_lane_logged(const KdaLog& log, size_t at, uint32_t d, KdaLane& alpha,
                                                KdaLane& kk) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (uint32_t j = 0; j < kKdaPer; ++j) {
    const uint32_t i = 128 * j + 4 * lane;
    const float4 x = i < d ? *reinterpret_cast<const float4*>(log.alpha + at + i) : make_float4(0.f, 0.f, 0.f, 0.f);
    const float4 y = i < d ? *reinterpret_cast<const float4*>(log.k + at + i) : make_float4(0.f, 0.f, 0.f, 0.f);
    alpha[j][0] = x.x, alpha[j][1] = x.y, alpha[j][2] = x.z, alpha[j][3] = x.w;
    kk[j][0] = y.x, kk[j][1] = y.y, kk[j][2] = y.z, kk[j][3] = y.w;
  }
}

// One state row's step (row r, head h) by a verify step's logged position,
// token row b.
__device__ __forceinline__ void kda_row_logged_step(KdaLane& sv, const KdaShape& s, const KdaLog& log, uint32_t b,
                                                    uint32_t h, uint32_t r) {
  const size_t at = (size_t(b) * s.heads + h) * s.d;
  KdaLane alpha, kk;
  kda_lane_logged(log, at, s.d, alpha, kk);
  kda_row_step(sv, alpha, kk, log.beta[size_t(b) * s.heads + h], log.v[at + r]);
}

// State rows a warp has in flight (plain decoding, a verify step and its
// commit): their loads issued together, then each stepped. A row's step
// waits on its own load, so one row at a time cost a memory round trip per
// row (K3's 128 rows a head, 16 a warp: 109 us a KDA stage at batch 8 on the
// H100, a third of the bandwidth); four at a time, 94 us (`0a797a6`).
// Eight: K3's 16 rows a warp in two round trips.
constexpr uint32_t kKdaRowsInFlight = 8;
// Each of this warp's state rows r of a head's state sh, kKdaRowsInFlight at
// a time: their loads (and value(r), a number the step reads with the row)
// issued together, then step(sv, r, value) for each in order.
template <class Value, class Step>
__device__ __forceinline__ void kda_rows_each(const float* sh, uint32_t d, Value value, Step step) {
  for (uint32_t r0 = threadIdx.x / 32; r0 < d; r0 += kKdaRowsInFlight * kConsumerWarps) {
    KdaLane sv[kKdaRowsInFlight] = {};
    float v[kKdaRowsInFlight] = {};
#pragma unroll
    for (uint32_t i = 0; i < kKdaRowsInFlight; ++i) {
      const uint32_t r = r0 + i * kConsumerWarps;
      if (r < d) kda_row_load(sv[i], sh + size_t(r) * d, d), v[i] = value(r);
    }
#pragma unroll
    for (uint32_t i = 0; i < kKdaRowsInFlight; ++i) {
      const uint32_t r = r0 + i * kConsumerWarps;
      if (r >= d) break;
      step(sv[i], r, v[i]);
    }
  }
}

// The gated norm's activation of the gate: sigmoid (sigmoid_act 1) or SiLU (0).
__device__ __forceinline__ float gated_norm_act(float g, int sigmoid_act) {
  return sigmoid_act ? sigmoid(g) : g / (1.f + expf(-g));
}

// With a.gate: the gated output norm of head h for sequence sq's P rows,
// from their outputs o_rows [P][d] (shared memory, each warp's rows written
// before), a warp a row: out = o r norm_w act(gate), in the order of
// gated_rms_norm_inplace.
template <int P, class T>
__device__ void kda_gated_out(const KdaDecode<T>& a, const float* o_rows, uint32_t sq, uint32_t h) {
  const uint32_t d = a.shape.d, p = a.shape.heads * d;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  consumer_sync();
  for (uint32_t t = warp; t < uint32_t(P); t += kConsumerWarps) {
    const float* o = o_rows + t * d;
    float ss = 0.f;
    for (uint32_t j = lane; j < d; j += 32) ss = fmaf(o[j], o[j], ss);
    const float r = rsqrtf(warp_sum(ss) / float(d) + a.norm_eps);
    const size_t at = size_t(sq * P + t) * p + size_t(h) * d;
    for (uint32_t j = lane; j < d; j += 32) {
      const float gv = to_float(a.gate[at + j]);
      a.out[at + j] = from_float<T>(o[j] * r * bf(a.norm_w[j]) * gated_norm_act(gv, a.sigmoid_act));
    }
  }
  consumer_sync();  // o_rows free for the next head
}

// Plain decoding (P = 1): one token a sequence, the state stepped in place.
// A verify step (P > 1, rows b = sequence P + position): each sequence's
// positions in order, each row of S carried in registers through them, each
// position's output from the state after it; the state itself is left as it
// was and the positions' inputs are logged (a.log), for kda_commit to step it
// through the positions the sequence keeps once the step's choices are known.
template <int B, int P = 1, class T>
__device__ void kda_decode(KdaDecode<T> a) {
  static_assert(P >= 1 && B % P == 0, "whole sequences of positions");
  static_assert(P * kMaxKdaDim * sizeof(float) <= kActivationBytes, "a head's outputs of a sequence fit");
  const KdaShape& s = a.shape;
  const uint32_t d = s.d, p = s.heads * d;
  const bool gated = a.gate != nullptr;
  float* o_rows = activation_ptr();  // [P][d] with the gated norm: the head's outputs before it
  if (a.s1 > uint32_t(B / P) || a.s0 >= a.s1) __trap();
  for (uint32_t sq = a.s0; sq < a.s1; ++sq) {
    for (uint32_t h = a.h0; h < a.h1; ++h) {
      float* sh = a.state + (size_t(sq) * s.heads + h) * d * d;
      if constexpr (P == 1) {
        const float beta = sigmoid(to_float(a.b_logit[size_t(sq) * s.heads + h]));
        KdaLane alpha, kk, qq;
        kda_lane_inputs(a, sq, h, alpha, kk, qq);
        const size_t row0 = size_t(sq) * p + size_t(h) * d;  // the sequence's head h in v and out
        kda_rows_each(
            sh, d, [&](uint32_t r) { return to_float(a.v[row0 + r]); },
            [&](KdaLane& sv, uint32_t r, float v_r) {
              kda_row_step(sv, alpha, kk, beta, v_r);
              kda_row_store(sv, sh + size_t(r) * d, d);
              const float o = kda_row_out(sv, qq);
              if (threadIdx.x % 32 == 0) {
                if (gated) {
                  o_rows[r] = o;
                } else {
                  a.out[row0 + r] = from_float<T>(o);
                }
              }
            });
      } else {
        // The log first: each position's decay, key, value and beta.
        for (uint32_t e = threadIdx.x; e < P * d; e += kConsumerThreads) {
          const uint32_t b = sq * P + e / d, i = e % d;
          const size_t at = size_t(b) * p + size_t(h) * d + i;
          a.log.alpha[at] = kda_alpha(s, expf(a.a_log[h]), to_float(a.f[at]) + a.dt_bias[size_t(h) * d + i]);
          a.log.k[at] = to_float(a.k[at]);
          a.log.v[at] = to_float(a.v[at]);
          if (i == 0) a.log.beta[size_t(b) * s.heads + h] = sigmoid(to_float(a.b_logit[size_t(b) * s.heads + h]));
        }
        __threadfence_block();
        consumer_sync();
        kda_rows_each(
            sh, d, [](uint32_t) { return 0.f; },
            [&](KdaLane& sv, uint32_t r, float) {
              for (int t = 0; t < P; ++t) {
                const uint32_t b = sq * P + t;
                kda_row_logged_step(sv, s, a.log, b, h, r);
                KdaLane qq;
                kda_lane_query(a, b, h, qq);
                const float o = kda_row_out(sv, qq);
                if (threadIdx.x % 32 == 0) {
                  if (gated) {
                    o_rows[t * d + r] = o;
                  } else {
                    a.out[size_t(b) * p + size_t(h) * d + r] = from_float<T>(o);
                  }
                }
              }
            });
      }
      if (gated) kda_gated_out<P>(a, o_rows, sq, h);
    }
  }
}

// After a verify step: each sequence's state stepped through the positions it
// keeps (keep[sequence], 0 to P: its accepted drafts and the token before
// them, or fewer at a generation's end), from the step's log, as plain
// decoding would have stepped it one token at a time. The task's heads [h0,
// h1), as kda_decode's.
template <int B, int P, class T>
__device__ void kda_commit(const KdaDecode<T>& a, const uint32_t* keep) {
  const KdaShape& s = a.shape;
  const uint32_t d = s.d;
  for (uint32_t sq = a.s0; sq < a.s1; ++sq) {
    for (uint32_t h = a.h0; h < a.h1; ++h) {
      float* sh = a.state + (size_t(sq) * s.heads + h) * d * d;
      if (keep[sq] == 0) continue;  // the state as it was
      kda_rows_each(
          sh, d, [](uint32_t) { return 0.f; },
          [&](KdaLane& sv, uint32_t r, float) {
            for (uint32_t t = 0; t < keep[sq]; ++t) kda_row_logged_step(sv, s, a.log, sq * P + t, h, r);
            kda_row_store(sv, sh + size_t(r) * d, d);
          });
    }
  }
}

// Gated RMSNorm per head (KDA's output norm), as a projection's prologue:
// x'[c] = x[c] rsqrt(mean over the head's d channels of x^2 + eps) w[c % d]
// act(gate[c]), act sigmoid (1) or SiLU (0); in place on x [B, heads d] in
// shared memory, a warp per (token, head).
template <int B, class T>
__device__ void gated_rms_norm_inplace(float* x, const T* gate, uint32_t heads, uint32_t d,
                                       const __nv_bfloat16* w, float eps, int sigmoid_act) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (uint32_t gi = warp; gi < B * heads; gi += kConsumerWarps) {
    float* xh = x + size_t(gi) * d;
    const T* gh = gate + size_t(gi) * d;
    float ss = 0.f;
    for (uint32_t j = lane; j < d; j += 32) ss = fmaf(xh[j], xh[j], ss);
    const float r = rsqrtf(warp_sum(ss) / float(d) + eps);
    for (uint32_t j = lane; j < d; j += 32) {
      const float gv = to_float(gh[j]);
      xh[j] = xh[j] * r * bf(w[j]) * gated_norm_act(gv, sigmoid_act);
    }
  }
}

// The RMS scales of KDA's gated output norm, r[b, h] = rsqrt(mean over head
// h's d channels of x[b]^2 + eps), into r [B, heads], complete for every
// consumer: a warp takes eight (token, head) rows at a time, four channels a
// lane a load (x may be in L2: the eight rows' loads are independent); d a
// multiple of 4.
template <int B, class T>
__device__ void gated_rms_scales(const T* x, uint32_t heads, uint32_t d, float eps, float* r) {
  constexpr uint32_t kRows = 8;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const uint32_t n = uint32_t(B) * heads;
  for (uint32_t r0 = uint32_t(warp) * kRows; r0 < n; r0 += kConsumerWarps * kRows) {
    float ss[kRows] = {};
    for (uint32_t j = uint32_t(lane) * 4; j < d; j += 128) {
#pragma unroll
      for (uint32_t u = 0; u < kRows; ++u) {
        if (r0 + u < n) {
          const float4 v = load_four(x + size_t(r0 + u) * d + j);
          ss[u] = fmaf(v.x, v.x, fmaf(v.y, v.y, fmaf(v.z, v.z, fmaf(v.w, v.w, ss[u]))));
        }
      }
    }
#pragma unroll
    for (uint32_t u = 0; u < kRows; ++u) {
      const float v = warp_sum(ss[u]);
      if (lane == 0 && r0 + u < n) r[r0 + u] = rsqrtf(v / float(d) + eps);
    }
  }
  consumer_sync();
}

// KDA's gated output norm as the tensor-core rows consumer reads it, computed
// where it is read: x[b, c] r[b, c / d] w[c % d] act(gate[b, c]) (act sigmoid
// or SiLU, as gated_rms_norm_inplace), d a multiple of 8.
template <class T>
struct GatedInput {
  const T* x;
  const T* gate;
  const float* r;  // [B, heads]: gated_rms_scales
  const __nv_bfloat16* w;
  uint32_t k, heads, d;
  int sigmoid_act;
  __device__ void operator()(uint32_t b, uint32_t e, float (&v)[8]) const {
    const size_t at = size_t(b) * k + e;
    const float rs = r[b * heads + e / d];
    const uint32_t c = e % d;
    const float4 xp = load_four(x + at), xq = load_four(x + at + 4);
    const float4 gp = load_four(gate + at), gq = load_four(gate + at + 4);
    const float4 wp = load_four(w + c), wq = load_four(w + c + 4);
    const float xs[8] = {xp.x, xp.y, xp.z, xp.w, xq.x, xq.y, xq.z, xq.w};
    const float gs[8] = {gp.x, gp.y, gp.z, gp.w, gq.x, gq.y, gq.z, gq.w};
    const float ws[8] = {wp.x, wp.y, wp.z, wp.w, wq.x, wq.y, wq.z, wq.w};
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      v[u] = xs[u] * rs * ws[u] * gated_norm_act(gs[u], sigmoid_act);
    }
  }
};

// Projection rows whose input is KDA's gated output norm (a prologue). On the
// tensor cores (batch 2 to 8, d a multiple of 8) the per-head scales are
// computed first (into the activation area) and the pages read the normed,
// gated input where it is (GatedInput); otherwise x [B, heads d] is staged as
// fp32 in shared memory, or in `spill` when it does not fit (input_area),
// normed and gated there, then the pages read it (rows_pages_staged: from
// `spill` a page ahead).
template <class T>
struct RowsComputeGated {
  Rows rows;               // the task's weight rows (rows_load streams them)
  const T* x;              // [B, heads d] the input
  const T* gate;           // [B, heads d]
  uint32_t heads;          // norm groups (heads d = rows.k)
  uint32_t d;              // channels per head
  const __nv_bfloat16* w;  // [d] the norm's weight
  float eps;
  int sigmoid_act;         // the gate's activation: sigmoid (1) or SiLU (0)
  float* spill;            // where the input is staged when it does not fit shared memory (or null)
};
template <int B, class T>
__device__ void rows_compute_gated(RowsComputeGated<T> a, uint32_t& it, int warp, float* st) {
  const Rows& r = a.rows;
  if (a.heads * a.d != r.k) __trap();
  if constexpr (kRowsMma<B>) {
    if (a.d % 8 == 0 && size_t(B) * a.heads * sizeof(float) <= size_t(kActivationBytes)) {
      float* rs = activation_ptr();  // [B, heads]
      gated_rms_scales<B>(a.x, a.heads, a.d, a.eps, rs);
      rows_pages_mma<B>(r, GatedInput<T>{a.x, a.gate, rs, a.w, r.k, a.heads, a.d, a.sigmoid_act}, it, warp, st);
      return;
    }
  }
  float* xs = stage_input<B>(a.x, r.k, static_cast<const __nv_bfloat16*>(nullptr), 0.f, input_area<B>(r.k, a.spill));
  gated_rms_norm_inplace<B>(xs, a.gate, a.heads, a.d, a.w, a.eps, a.sigmoid_act);
  consumer_sync();
  rows_pages_staged<B>(r, xs, it, warp, st);
}

}  // namespace mkc
