// mkc device library: KDA decode and its gated output norm (the output projection's prologue).
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

// One task's work: heads [h0, h1) of the layer's shape, its inputs [B,
// heads d] (q, k, v, the gate's f, beta's logits [B, heads]) and its state.
template <class T>
struct KdaDecode {
  KdaShape shape;
  uint32_t h0, h1;        // the task's heads [h0, h1)
  const T* q;             // [B, heads d], L2-normalised
  const T* k;             // [B, heads d], L2-normalised
  const T* v;             // [B, heads d]
  const T* f;             // [B, heads d] the forget gate's input
  const T* b_logit;       // [B, heads] beta before its sigmoid
  const float* a_log;     // [heads]
  const float* dt_bias;   // [heads d]
  float* state;           // [B][heads][d][d] fp32
  T* out;                 // [B, heads d]
};

template <int B, class T>
__device__ void kda_decode(KdaDecode<T> a) {
  const KdaShape& s = a.shape;
  const T *q = a.q, *k = a.k, *v = a.v, *f = a.f, *b_logit = a.b_logit;
  const float *a_log = a.a_log, *dt_bias = a.dt_bias;
  float* state = a.state;
  T* out = a.out;
  const uint32_t h0 = a.h0, h1 = a.h1;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const uint32_t d = s.d, p = s.heads * d;
  constexpr uint32_t kPer = kMaxKdaDim / 128;  // float4 groups per lane
  const float qscale = rsqrtf(float(d));
  for (int b = 0; b < B; ++b) {
    for (uint32_t h = h0; h < h1; ++h) {
      const float scale = expf(a_log[h]);
      const float beta = sigmoid(to_float(b_logit[size_t(b) * s.heads + h]));
      float alpha[kPer][4], kk[kPer][4], qq[kPer][4];
#pragma unroll
      for (uint32_t j = 0; j < kPer; ++j) {
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const uint32_t i = 128 * j + 4 * lane + u;
          alpha[j][u] = kk[j][u] = qq[j][u] = 0.f;
          if (i >= d) continue;
          const size_t at = size_t(b) * p + size_t(h) * d + i;
          const float x = to_float(f[at]) + dt_bias[size_t(h) * d + i];
          const float g = s.safe_gate ? s.lower_bound / (1.f + expf(-scale * x)) : -scale * softplus(x);
          alpha[j][u] = expf(g);
          kk[j][u] = to_float(k[at]);
          qq[j][u] = to_float(q[at]) * qscale;
        }
      }
      float* sh = state + (size_t(b) * s.heads + h) * d * d;
      for (uint32_t r = warp; r < d; r += kConsumerWarps) {
        float* row = sh + size_t(r) * d;
        float sv[kPer][4];
        float mem = 0.f;
#pragma unroll
        for (uint32_t j = 0; j < kPer; ++j) {
          const uint32_t i = 128 * j + 4 * lane;
          if (i < d) {
            const float4 x = *reinterpret_cast<const float4*>(row + i);
            sv[j][0] = x.x * alpha[j][0], sv[j][1] = x.y * alpha[j][1];
            sv[j][2] = x.z * alpha[j][2], sv[j][3] = x.w * alpha[j][3];
          } else {
            sv[j][0] = sv[j][1] = sv[j][2] = sv[j][3] = 0.f;
          }
#pragma unroll
          for (int u = 0; u < 4; ++u) mem = fmaf(sv[j][u], kk[j][u], mem);
        }
        mem = warp_sum(mem);
        const float ur = beta * (to_float(v[size_t(b) * p + size_t(h) * d + r]) - mem);
        float o = 0.f;
#pragma unroll
        for (uint32_t j = 0; j < kPer; ++j) {
          const uint32_t i = 128 * j + 4 * lane;
#pragma unroll
          for (int u = 0; u < 4; ++u) {
            sv[j][u] = fmaf(ur, kk[j][u], sv[j][u]);
            o = fmaf(sv[j][u], qq[j][u], o);
          }
          if (i < d) *reinterpret_cast<float4*>(row + i) = make_float4(sv[j][0], sv[j][1], sv[j][2], sv[j][3]);
        }
        o = warp_sum(o);
        if (lane == 0) out[size_t(b) * p + size_t(h) * d + r] = from_float<T>(o);
      }
    }
  }
}

// The gated norm's activation of the gate: sigmoid (sigmoid_act 1) or SiLU (0).
__device__ __forceinline__ float gated_norm_act(float g, int sigmoid_act) {
  return sigmoid_act ? sigmoid(g) : g / (1.f + expf(-g));
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
