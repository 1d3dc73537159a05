// mkc device library: The row-local epilogue steps a projection's generated code chains after
// its rows, on the fp32 staging tile.
#pragma once

#include "common.cuh"

namespace mkc {

// ---------------------------------------------------------------------------
// Epilogue steps on the staging tile st [B, n]. A Span says which part of a
// value the tile holds: tile columns [c0, c0 + len) are its elements
// [e0, e0 + len). A step whose span is empty does nothing. Each step takes
// (st, n, s) and, where it needs more than a pointer and a length, one
// struct named after it (ep_rope: EpRope).
struct Span {
  uint32_t c0;   // first tile column
  uint32_t e0;   // the value's element at that column
  uint32_t len;  // elements the tile holds
};

// The span of linear `node`'s output in task t (its rows [a2, a3)).
__device__ inline Span linear_span(const TaskArgs& t, uint32_t node) {
  return t.a[0] == node ? Span{0, t.a[2], t.a[3] - t.a[2]} : Span{0, 0, 0};
}

// The span of elements [off, off + size) of a value, as a value of its own.
__device__ inline Span sub_span(Span s, uint32_t off, uint32_t size) {
  const uint32_t lo = max(s.e0, off), hi = min(s.e0 + s.len, off + size);
  if (s.len == 0 || hi <= lo) return Span{0, 0, 0};
  return Span{s.c0 + lo - s.e0, lo - off, hi - lo};
}

// gate = silu(gate) * up, the up rows at tile columns [n/2, n).
template <int B>
__device__ void ep_silu_and_mul(float* st, uint32_t n, Span g) {
  const uint32_t half = n / 2;
  for (uint32_t i = threadIdx.x; i < B * g.len; i += kConsumerThreads) {
    const uint32_t b = i / g.len, c = g.c0 + i % g.len;
    const float x = st[b * n + c], u = st[b * n + half + c];
    st[b * n + c] = x / (1.f + expf(-x)) * u;
  }
}

// gate = SiTU-GLU of (gate, up), K3's activation, the up rows at tile
// columns [n/2, n): beta tanh(gate/beta) sigmoid(gate) * lin tanh(up/lin),
// the up branch the identity when lin <= 0 (no linear beta configured).
__device__ __forceinline__ float situ_glu(float x, float u, float beta, float lin) {
  const float g = beta * tanhf(x / beta) / (1.f + expf(-x));
  return g * (lin > 0.f ? lin * tanhf(u / lin) : u);
}
struct EpSituAndMul {
  float beta;  // the gate's beta
  float lin;   // the up branch's linear beta (<= 0: identity)
};
template <int B>
__device__ void ep_situ_and_mul(float* st, uint32_t n, Span g, EpSituAndMul a) {
  const uint32_t half = n / 2;
  for (uint32_t i = threadIdx.x; i < B * g.len; i += kConsumerThreads) {
    const uint32_t b = i / g.len, c = g.c0 + i % g.len;
    st[b * n + c] = situ_glu(st[b * n + c], st[b * n + half + c], a.beta, a.lin);
  }
}

// A bank with one more row, the new row being the tile's span s (K3's block
// snapshot): for the span's columns, bank_new [B][rows + 1][hidden] takes
// bank [B][rows][hidden] and then the tile's values.
template <class T>
struct EpStack {
  const T* bank;     // [B][rows][hidden]
  uint32_t rows;     // the bank's rows
  uint32_t hidden;   // a row's width
  T* bank_new;       // [B][rows + 1][hidden]
};
template <int B, class T>
__device__ void ep_stack(const float* st, uint32_t n, Span s, EpStack<T> a) {
  for (uint32_t i = threadIdx.x; i < B * (a.rows + 1) * s.len; i += kConsumerThreads) {
    const uint32_t b = i / ((a.rows + 1) * s.len), j = (i / s.len) % (a.rows + 1), c = i % s.len, e = s.e0 + c;
    a.bank_new[(size_t(b) * (a.rows + 1) + j) * a.hidden + e] =
        j < a.rows ? a.bank[(size_t(b) * a.rows + j) * a.hidden + e] : from_float<T>(st[b * n + s.c0 + c]);
  }
}

template <int B, class T>
__device__ void ep_add(float* st, uint32_t n, Span s, const T* other, uint32_t len) {
  for (uint32_t i = threadIdx.x; i < B * s.len; i += kConsumerThreads) {
    const uint32_t b = i / s.len, j = i % s.len;
    st[b * n + s.c0 + j] += to_float(other[size_t(b) * len + s.e0 + j]);
  }
}

// RoPE of the last `rot` values of each head (whole heads in the span), at
// each sequence's position; interleaved pairs (2i, 2i+1), else (i, i + rot/2).
struct EpRope {
  uint32_t head_dim;      // a head's width
  uint32_t rot;           // its last `rot` values rotate
  bool interleaved;       // pairs (2i, 2i+1); else (i, i + rot/2)
  const float* inv_freq;  // [rot / 2]
  float mscale;           // cos/sin scale (YaRN)
  const int32_t* pos;     // [B] each sequence's position
};
template <int B>
__device__ void ep_rope(float* st, uint32_t n, Span s, EpRope a) {
  if (s.len == 0) return;
  if (s.e0 % a.head_dim != 0 || s.len % a.head_dim != 0) __trap();  // the tiler aligns tiles to heads
  const uint32_t heads = s.len / a.head_dim, half = a.rot / 2;
  for (uint32_t i = threadIdx.x; i < B * heads * half; i += kConsumerThreads) {
    const uint32_t b = i / (heads * half), h = (i / half) % heads, p = i % half;
    const uint32_t base = b * n + s.c0 + h * a.head_dim + a.head_dim - a.rot;
    const uint32_t ia = a.interleaved ? base + 2 * p : base + p;
    const uint32_t ib = a.interleaved ? ia + 1 : ia + half;
    const float angle = float(a.pos[b]) * a.inv_freq[p];
    const float c = cosf(angle) * a.mscale, sn = sinf(angle) * a.mscale;
    const float xa = st[ia], xb = st[ib];
    st[ia] = xa * c - xb * sn;
    st[ib] = xb * c + xa * sn;
  }
}

// RMSNorm of a whole value (the tiler keeps it in one task).
struct EpRmsNorm {
  uint32_t full;             // the value's length (the span must be all of it)
  const __nv_bfloat16* w;    // [full] the norm's weight
  float eps;
};
template <int B>
__device__ void ep_rms_norm(float* st, uint32_t n, Span s, EpRmsNorm a) {
  if (s.len == 0) return;
  if (s.e0 != 0 || s.len != a.full) __trap();
  for (int b = 0; b < B; ++b) {
    float ss = 0.f;
    for (uint32_t j = threadIdx.x; j < s.len; j += kConsumerThreads) ss = fmaf(st[b * n + s.c0 + j], st[b * n + s.c0 + j], ss);
    const float r = rsqrtf(block_sum(ss) / float(a.full) + a.eps);
    for (uint32_t j = threadIdx.x; j < s.len; j += kConsumerThreads) st[b * n + s.c0 + j] *= r * bf(a.w[j]);
  }
}

// Short causal convolution with state (KDA's q/k/v), on the tile's span s of
// a value with `channels` channels: per channel c and token b,
//   y = act(sum_{j < W-1} w[c, j] state[b, j, c] + w[c, W-1] z),  z = the tile value,
// fp32 weights [channels, 1, W]; then the state shifts by one row, the new z
// (rounded to the state's type) last. State per sequence [W-1, channels],
// sequences `state_stride` elements apart. act: SiLU (1) or none (0).
// A verify step (P > 1 rows a sequence, b = sequence P + position) takes a
// sequence's positions in order, each position's window the state's rows
// and then the positions before it; it leaves the state as it was and logs
// each position's z (rounded as the state keeps it) for conv_commit.
template <class S>
struct EpConvUpdate {
  const float* w;       // [channels, 1, width] fp32
  uint32_t width;       // the convolution's width W
  S* state;             // [sequences][W - 1][channels]
  size_t state_stride;  // elements from one sequence's state to the next
  uint32_t channels;
  int silu;             // SiLU (1) or none (0)
  S* log;               // a verify step's: [B][channels], each row's z; unused otherwise
};

// Entry i of a sequence's history in a verify step: the state's W - 1 rows,
// then the step's positions (logged).
template <int P, class S>
__device__ __forceinline__ float conv_history(const EpConvUpdate<S>& a, uint32_t sq, uint32_t i, uint32_t c) {
  return i + 1 < a.width ? to_float(a.state[size_t(sq) * a.state_stride + size_t(i) * a.channels + c])
                         : to_float(a.log[(size_t(sq) * P + i - (a.width - 1)) * a.channels + c]);
}

template <int B, int P = 1, class S>
__device__ void ep_conv_update(float* st, uint32_t n, Span s, EpConvUpdate<S> a) {
  static_assert(P >= 1 && B % P == 0, "whole sequences of positions");
  if constexpr (P == 1) {
    for (uint32_t i = threadIdx.x; i < B * s.len; i += kConsumerThreads) {
      const uint32_t b = i / s.len, j = i % s.len, c = s.e0 + j;
      S* sb = a.state + size_t(b) * a.state_stride;
      const float z = st[b * n + s.c0 + j];
      float y = a.w[size_t(c) * a.width + a.width - 1] * z;
      for (uint32_t t = 0; t + 1 < a.width; ++t) y = fmaf(a.w[size_t(c) * a.width + t], to_float(sb[size_t(t) * a.channels + c]), y);
      for (uint32_t t = 0; t + 2 < a.width; ++t) sb[size_t(t) * a.channels + c] = sb[size_t(t + 1) * a.channels + c];
      if (a.width > 1) sb[size_t(a.width - 2) * a.channels + c] = from_float<S>(z);
      st[b * n + s.c0 + j] = a.silu ? y / (1.f + expf(-y)) : y;
    }
  } else {
    // A thread a (sequence, channel), through the sequence's positions in order.
    for (uint32_t i = threadIdx.x; i < (B / P) * s.len; i += kConsumerThreads) {
      const uint32_t sq = i / s.len, j = i % s.len, c = s.e0 + j;
      for (uint32_t t = 0; t < P; ++t) {
        const uint32_t b = sq * P + t;
        const float z = st[b * n + s.c0 + j];
        a.log[size_t(b) * a.channels + c] = from_float<S>(z);
        float y = a.w[size_t(c) * a.width + a.width - 1] * z;
        for (uint32_t u = 0; u + 1 < a.width; ++u) y = fmaf(a.w[size_t(c) * a.width + u], conv_history<P>(a, sq, t + u, c), y);
        st[b * n + s.c0 + j] = a.silu ? y / (1.f + expf(-y)) : y;
      }
    }
  }
}

// After a verify step: each sequence's window moved on by the positions it
// keeps (keep[sequence], 0 to P), from the step's log: the last W - 1 entries
// of its history up to them, as plain decoding would have left it. The
// tile's span s, as ep_conv_update's.
template <int B, int P, class S>
__device__ void conv_commit(Span s, const EpConvUpdate<S>& a, const uint32_t* keep) {
  for (uint32_t i = threadIdx.x; i < (B / P) * s.len; i += kConsumerThreads) {
    const uint32_t sq = i / s.len, c = s.e0 + i % s.len;
    if (keep[sq] == 0) continue;
    // Row u takes history entry keep + u > u: rows below u are written, the entries read are not yet.
    for (uint32_t u = 0; u + 1 < a.width; ++u) {
      a.state[size_t(sq) * a.state_stride + size_t(u) * a.channels + c] = from_float<S>(conv_history<P>(a, sq, keep[sq] + u, c));
    }
  }
}

// L2 normalisation in groups of `group` channels (KDA's q and k):
// x / sqrt(sum x^2 + eps) per group; the span covers whole groups (the
// planner aligns the tile to them).
struct EpL2Norm {
  uint32_t group;  // channels normalised together (a head)
  float eps;
};
template <int B>
__device__ void ep_l2_norm(float* st, uint32_t n, Span s, EpL2Norm a) {
  if (s.len == 0) return;
  if (s.e0 % a.group != 0 || s.len % a.group != 0) __trap();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const uint32_t groups = s.len / a.group;
  for (uint32_t gi = warp; gi < B * groups; gi += kConsumerWarps) {
    float* x = st + (gi / groups) * n + s.c0 + (gi % groups) * a.group;
    float ss = 0.f;
    for (uint32_t j = lane; j < a.group; j += 32) ss = fmaf(x[j], x[j], ss);
    const float r = rsqrtf(warp_sum(ss) + a.eps);
    for (uint32_t j = lane; j < a.group; j += 32) x[j] *= r;
  }
}

template <int B, class T>
__device__ void ep_store(const float* st, uint32_t n, Span s, T* dst, uint32_t len) {
  for (uint32_t i = threadIdx.x; i < B * s.len; i += kConsumerThreads) {
    const uint32_t b = i / s.len, j = i % s.len;
    dst[size_t(b) * len + s.e0 + j] = from_float<T>(st[b * n + s.c0 + j]);
  }
}

// Per token, the tile's largest value and its index (the lowest on ties).
struct EpTileMax {
  float2* out;     // [B][tiles] (value, index as bits), for argmax_tiles
  uint32_t tile;   // this task's tile
  uint32_t tiles;  // the row tiles of the logits
};
template <int B>
__device__ void ep_tile_max(const float* st, uint32_t n, Span s, EpTileMax a) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int b = warp; b < B; b += kConsumerWarps) {
    float best = -INFINITY;
    uint32_t at = 0xffffffffu;
    for (uint32_t j = lane; j < s.len; j += 32) {
      const float v = st[b * n + s.c0 + j];
      if (v > best) best = v, at = s.e0 + j;
    }
    for (int off = 16; off > 0; off /= 2) {
      const float ob = __shfl_xor_sync(0xffffffffu, best, off);
      const uint32_t oa = __shfl_xor_sync(0xffffffffu, at, off);
      if (ob > best || (ob == best && oa < at)) best = ob, at = oa;
    }
    if (lane == 0) a.out[b * a.tiles + a.tile] = make_float2(best, __uint_as_float(at));
  }
}

// Per token, the largest of the tiles' maxima (ep_tile_max): the next token.
struct ArgmaxTiles {
  const float2* tile_max;  // [B][tiles], from ep_tile_max
  uint32_t tiles;
  int32_t* next;           // [B]
};
template <int B>
__device__ void argmax_tiles(ArgmaxTiles a) {
  if (threadIdx.x >= B) return;
  const int b = threadIdx.x;
  float best = -INFINITY;
  uint32_t at = 0;
  for (uint32_t t = 0; t < a.tiles; ++t) {
    const float2 v = a.tile_max[b * a.tiles + t];
    const uint32_t idx = __float_as_uint(v.y);
    if (v.x > best || (v.x == best && idx < at)) best = v.x, at = idx;
  }
  a.next[b] = int32_t(at);
}

}  // namespace mkc
