// mkc device library: The router and the routed experts (slots, expert rows in bf16 or MXFP4,
// the weighted combine).
#pragma once

#include "fp8_rows.cuh"
#include "rows.cuh"

namespace mkc {

// ---------------------------------------------------------------------------
// Router, as DeepSeek-V3: s = sigmoid(logits); choice = s + bias; groups
// ranked by the sum of their two best choices, the best `topk_group` kept
// (the others' choices set to 0); top-k of the choices; weights s at the
// chosen experts, renormalised (sum + 1e-20) if asked, times `scale`.
struct RouterShape {
  uint32_t experts;     // routed experts
  uint32_t top_k;       // experts chosen per token
  uint32_t n_group;     // expert groups (1: no group limit)
  uint32_t topk_group;  // groups kept
  bool renormalize;     // the chosen weights divided by their sum
  float scale;          // the weights' scale
};

// All consumer threads take part: scores and choices are staged in shared
// memory (scratch), groups are ranked by one warp, and the top-k is k rounds
// of a warp arg-max (ties to the lower expert id, as a sequential scan).
// `log` [B, top_k] receives the ids too: the arena's routing log, which no
// other stage reuses, so the host can read every router's choice after a step.
struct Router {
  RouterShape shape;
  const float* logits;  // [B, experts]
  const float* bias;    // [experts] the selection's correction bias, or null
  int32_t* ids;         // [B, top_k] the chosen experts
  float* wts;           // [B, top_k] their weights
  int32_t* log;         // [B, top_k] the routing log's rows of this router
};
template <int B>
__device__ void router(Router a) {
  const RouterShape& r = a.shape;
  const float* logits = a.logits;
  const float* bias = a.bias;
  int32_t* ids = a.ids;
  float* wts = a.wts;
  int32_t* log = a.log;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float* score = reinterpret_cast<float*>(scratch_ptr());  // [experts]
  float* choice = score + r.experts;                        // [experts], then what is left to pick
  __shared__ float group_score[kRouterMaxGroups];
  const uint32_t per = r.experts / r.n_group;
  for (int b = 0; b < B; ++b) {
    const float* lg = logits + size_t(b) * r.experts;
    for (uint32_t e = threadIdx.x; e < r.experts; e += kConsumerThreads) {
      const float s = 1.f / (1.f + expf(-lg[e]));
      score[e] = s;
      choice[e] = s + (bias != nullptr ? bias[e] : 0.f);
    }
    consumer_sync();
    if (warp == 0) {
      // Groups kept (n_group <= 64, checked at codegen): a lane per group
      // sums its two best choices; lane 0 keeps the best topk_group groups.
      uint64_t k = ~0ull;
      if (r.n_group > 1) {
        for (uint32_t g = lane; g < r.n_group; g += 32) {
          float a = -INFINITY, c = -INFINITY;
          for (uint32_t e = g * per; e < (g + 1) * per; ++e) {
            const float v = choice[e];
            if (v > a) c = a, a = v;
            else if (v > c) c = v;
          }
          group_score[g] = a + (per > 1 ? c : 0.f);
        }
        __syncwarp();
        k = 0;
        for (uint32_t t = 0; t < r.topk_group; ++t) {
          int best = -1;
          for (uint32_t g = 0; g < r.n_group; ++g)
            if (!(k >> g & 1) && (best < 0 || group_score[g] > group_score[best])) best = int(g);
          k |= 1ull << best;
        }
        // Experts of dropped groups compete with choice 0.
        for (uint32_t e = lane; e < r.experts; e += 32)
          if (!(k >> (e / per) & 1)) choice[e] = 0.f;
        __syncwarp();
      }
      int32_t* my_ids = ids + size_t(b) * r.top_k;
      float* my_w = wts + size_t(b) * r.top_k;
      float sum = 0.f;
      for (uint32_t t = 0; t < r.top_k; ++t) {
        float bv = -INFINITY;
        int be = INT_MAX;
        for (uint32_t e = lane; e < r.experts; e += 32) {
          const float v = choice[e];
          if (v > bv || (v == bv && int(e) < be)) bv = v, be = int(e);
        }
        for (int off = 16; off > 0; off /= 2) {
          const float ov = __shfl_xor_sync(0xffffffffu, bv, off);
          const int oe = __shfl_xor_sync(0xffffffffu, be, off);
          if (ov > bv || (ov == bv && oe < be)) bv = ov, be = oe;
        }
        // Every lane holds the same winner; a picked expert leaves the race.
        const float w = score[be];
        sum += w;
        if (lane == 0) {
          my_ids[t] = be;
          log[size_t(b) * r.top_k + t] = be;
          my_w[t] = w;
        }
        __syncwarp();
        if (lane == 0) choice[be] = -INFINITY;
        __syncwarp();
      }
      if (lane < int(r.top_k)) {
        const float w = my_w[lane];
        my_w[lane] = (r.renormalize ? w / (sum + 1e-20f) : w) * r.scale;
      }
      for (uint32_t t = 32 + lane; t < r.top_k; t += 32) {
        const float w = my_w[t];
        my_w[t] = (r.renormalize ? w / (sum + 1e-20f) : w) * r.scale;
      }
    }
    consumer_sync();
  }
}

// ---------------------------------------------------------------------------
// Routed experts. Slot s holds the s-th smallest distinct expert id among the
// batch's choices (so every task finds the same assignment without talking);
// a slot past the distinct count is empty.
struct MoeShape {
  uint32_t experts;  // routed experts
  uint32_t top_k;    // experts chosen per token
  uint32_t inter;    // an expert's intermediate width
  uint32_t hidden;   // the model's width
  uint32_t slots;    // expert slots per step: min(B top_k, experts)
  uint32_t gate_base, up_base, down_base;  // weight index of expert 0's tensors
  // MXFP4 experts: expert e's codes at base + stride e, its scales right after.
  uint32_t stride = 1;
};

// The slot-th smallest distinct value of ids[0..n), or -1: distinct values
// are visited in increasing order (O(n (slot + 1))).
template <int B>
__device__ int slot_expert(const int32_t* ids, uint32_t n, uint32_t slot) {
  int prev = -1;
  for (uint32_t s = 0; s <= slot; ++s) {
    int next = INT_MAX;
    for (uint32_t j = 0; j < n; ++j)
      if (ids[j] > prev && ids[j] < next) next = ids[j];
    if (next == INT_MAX) return -1;
    prev = next;
  }
  return prev;
}

// The number of distinct values of ids[0..n) below e: e's slot.
__device__ inline uint32_t slot_of(const int32_t* ids, uint32_t n, int32_t e) {
  int prev = -1;
  for (uint32_t s = 0;; ++s) {
    int next = INT_MAX;
    for (uint32_t j = 0; j < n; ++j)
      if (ids[j] > prev && ids[j] < next) next = ids[j];
    if (next >= e) return s;
    prev = next;
  }
}

// The weight rows of an expert task: rows [r0, r1) of the slot's expert's
// w0 (gate, paired with up) or down matrix; no rows for an empty slot.
// Loader and consumers compute the same rows from the router's ids.
struct ExpertRows {
  MoeShape shape;
  uint32_t slot;        // the task's expert slot
  uint32_t r0, r1;      // its rows [r0, r1)
  void* const* w;       // the weight table
  const int32_t* ids;   // [B, top_k] the router's choices
  bool down;            // the down matrix (else gate, paired with up)
};
template <int B>
__device__ inline Rows expert_rows(ExpertRows a) {
  const MoeShape& s = a.shape;
  const uint32_t slot = a.slot, r0 = a.r0, r1 = a.r1;
  void* const* w = a.w;
  const int32_t* ids = a.ids;
  const bool down = a.down;
  const int e = slot_expert<B>(ids, B * s.top_k, slot);
  if (e < 0) return Rows{nullptr, nullptr, 0, 0, down ? s.inter : s.hidden};
  if (down) return Rows{static_cast<const __nv_bfloat16*>(w[s.down_base + e]), nullptr, r0, r1, s.inter};
  return Rows{static_cast<const __nv_bfloat16*>(w[s.gate_base + e]), static_cast<const __nv_bfloat16*>(w[s.up_base + e]),
              r0, r1, s.hidden};
}

// The rows of an expert task whose weights are codes and scales (as
// expert_rows, of the same arguments): each expert's codes then its scales in
// the weight table, experts `stride` (2) apart. R is the row type (MxRows,
// Fp8Rows: codes, scales, the paired matrix's codes and scales, rows, k), S
// its scales' element type.
template <class R, class S, int B>
__device__ inline R expert_coded_rows(ExpertRows a) {
  const MoeShape& s = a.shape;
  const int e = slot_expert<B>(a.ids, B * s.top_k, a.slot);
  auto codes = [&](uint32_t i) { return static_cast<const uint8_t*>(a.w[i]); };
  auto scales = [&](uint32_t i) { return static_cast<const S*>(a.w[i]); };
  if (e < 0) return R{nullptr, nullptr, nullptr, nullptr, 0, 0, a.down ? s.inter : s.hidden};
  if (a.down) {
    const uint32_t i = s.down_base + s.stride * uint32_t(e);
    return R{codes(i), scales(i + 1), nullptr, nullptr, a.r0, a.r1, s.inter};
  }
  const uint32_t g = s.gate_base + s.stride * uint32_t(e), u = s.up_base + s.stride * uint32_t(e);
  return R{codes(g), scales(g + 1), codes(u), scales(u + 1), a.r0, a.r1, s.hidden};
}

// The MXFP4 rows of an expert task: e2m1 codes and e8m0 scale bytes, tiled.
template <int B>
__device__ inline MxRows expert_mx_rows(ExpertRows a) {
  return expert_coded_rows<MxRows, uint8_t, B>(a);
}

// The FP8 rows of an expert task: e4m3 codes and fp32 block scales, as stored.
template <int B>
__device__ inline Fp8Rows expert_fp8_rows(ExpertRows a) {
  return expert_coded_rows<Fp8Rows, float, B>(a);
}

// routed[b, d] = sum_j weight[b, j] out[slot(ids[b, j]), b, d], for column
// tile `tile` of `tiles`.
template <class T>
struct ExpertCombine {
  MoeShape shape;
  uint32_t tile, tiles;  // the task's column tile of `tiles`
  const int32_t* ids;    // [B, top_k] the router's choices
  const float* wts;      // [B, top_k] their weights
  const float* dn;       // out [slots, B, hidden]: the down projections
  T* routed;             // [B, hidden]
};
template <int B, class T>
__device__ void expert_combine(ExpertCombine<T> a) {
  const MoeShape& s = a.shape;
  const uint32_t tile = a.tile, tiles = a.tiles;
  const int32_t* ids = a.ids;
  const float* wts = a.wts;
  const float* dn = a.dn;
  T* routed = a.routed;
  __shared__ uint32_t slot[B * 64];
  if (B * s.top_k > B * 64) __trap();
  for (uint32_t i = threadIdx.x; i < B * s.top_k; i += kConsumerThreads) slot[i] = slot_of(ids, B * s.top_k, ids[i]);
  consumer_sync();
  const uint32_t d0 = tile * s.hidden / tiles, d1 = (tile + 1) * s.hidden / tiles;
  for (uint32_t i = threadIdx.x; i < B * (d1 - d0); i += kConsumerThreads) {
    const uint32_t b = i / (d1 - d0), d = d0 + i % (d1 - d0);
    float acc = 0.f;
    for (uint32_t j = 0; j < s.top_k; ++j)
      acc = fmaf(wts[b * s.top_k + j], dn[(size_t(slot[b * s.top_k + j]) * B + b) * s.hidden + d], acc);
    routed[size_t(b) * s.hidden + d] = from_float<T>(acc);
  }
  consumer_sync();
}

}  // namespace mkc
