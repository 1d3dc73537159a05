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

// The choices of every token at once, all consumer threads, staged in the
// activation area ([B][experts], B experts x 4 bytes at most
// kActivationBytes: the planner's limit); then a warp per token ranks the
// groups (a lane per group, its scores in scratch) and picks the top-k, k
// rounds of a warp arg-max (ties to the lower expert id, as a sequential
// scan), the tokens side by side (one at a time, batch 8's took eight times
// one token's rounds). A pick's weight is its sigmoid, computed again from
// the logit as the choice was. `log` [B, top_k] receives the ids too: the
// arena's routing log, which no other stage reuses, so the host can read
// every router's choice after a step.
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
  const float* bias = a.bias;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  static_assert(kConsumerWarps * kRouterMaxGroups * sizeof(float) <= size_t(kScratchBytes), "group scores fit scratch");
  if (size_t(B) * r.experts * sizeof(float) > size_t(kActivationBytes)) __trap();  // the planner's limit
  float* choice = activation_ptr();  // [B][experts]: s + bias, then what is left to pick
  for (uint32_t i = threadIdx.x; i < B * r.experts; i += kConsumerThreads) {
    choice[i] = sigmoid(a.logits[i]) + (bias != nullptr ? bias[i % r.experts] : 0.f);
  }
  consumer_sync();
  float* group_score = reinterpret_cast<float*>(scratch_ptr()) + warp * kRouterMaxGroups;
  const uint32_t per = r.experts / r.n_group;
  for (uint32_t b = warp; b < uint32_t(B); b += kConsumerWarps) {
    float* ch = choice + size_t(b) * r.experts;
    const float* lg = a.logits + size_t(b) * r.experts;
    if (r.n_group > 1) {
      // Groups kept (n_group <= 64, checked at codegen): a lane per group
      // sums its two best choices; every lane finds the best topk_group.
      for (uint32_t g = lane; g < r.n_group; g += 32) {
        float x = -INFINITY, y = -INFINITY;
        for (uint32_t e = g * per; e < (g + 1) * per; ++e) {
          const float v = ch[e];
          if (v > x) y = x, x = v;
          else if (v > y) y = v;
        }
        group_score[g] = x + (per > 1 ? y : 0.f);
      }
      __syncwarp();
      uint64_t k = 0;
      for (uint32_t t = 0; t < r.topk_group; ++t) {
        int best = -1;
        for (uint32_t g = 0; g < r.n_group; ++g)
          if (!(k >> g & 1) && (best < 0 || group_score[g] > group_score[best])) best = int(g);
        k |= 1ull << best;
      }
      // Experts of dropped groups compete with choice 0.
      for (uint32_t e = lane; e < r.experts; e += 32)
        if (!(k >> (e / per) & 1)) ch[e] = 0.f;
      __syncwarp();
    }
    int32_t* my_ids = a.ids + size_t(b) * r.top_k;
    float* my_w = a.wts + size_t(b) * r.top_k;
    float sum = 0.f;
    for (uint32_t t = 0; t < r.top_k; ++t) {
      float bv = -INFINITY;
      int be = INT_MAX;
      for (uint32_t e = lane; e < r.experts; e += 32) {
        const float v = ch[e];
        if (v > bv || (v == bv && int(e) < be)) bv = v, be = int(e);
      }
      for (int off = 16; off > 0; off /= 2) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, off);
        const int oe = __shfl_xor_sync(0xffffffffu, be, off);
        if (ov > bv || (ov == bv && oe < be)) bv = ov, be = oe;
      }
      // Every lane holds the same winner; a picked expert leaves the race.
      const float w = sigmoid(lg[be]);
      sum += w;
      if (lane == 0) {
        my_ids[t] = be;
        a.log[size_t(b) * r.top_k + t] = be;
        my_w[t] = w;
      }
      __syncwarp();
      if (lane == 0) ch[be] = -INFINITY;
      __syncwarp();
    }
    for (uint32_t t = lane; t < r.top_k; t += 32) {
      const float w = my_w[t];
      my_w[t] = (r.renormalize ? w / (sum + 1e-20f) : w) * r.scale;
    }
  }
  consumer_sync();
}

// ---------------------------------------------------------------------------
// Routed experts. Slot s holds the s-th smallest distinct expert id among the
// batch's choices (so every task finds the same assignment without talking).
// A stage's tasks share the step's distinct experts' rows between them: with
// D distinct experts and N tasks, slot s takes tasks [s N / D, (s + 1) N / D)
// and splits its rows evenly over them in units of `unit` rows, so every task
// streams about D / N of an expert however many experts the step chose (the
// plan's tasks cover the worst case, min(B top_k, experts) slots). On one of
// several GPUs (an expert-parallel program) the GPU holds experts [first,
// first + experts) of the router's: the others' choices take no slot here,
// and their rows are the other GPUs' (the exchange adds the GPUs' sums).
struct MoeShape {
  uint32_t experts;  // routed experts (this GPU's)
  uint32_t top_k;    // experts chosen per token
  uint32_t inter;    // an expert's intermediate width
  uint32_t hidden;   // the model's width
  uint32_t slots;    // expert slots per step: min(B top_k, experts)
  uint32_t gate_base, up_base, down_base;  // weight index of the router's expert 0's tensors
  // MXFP4 experts: expert e's codes at base + stride e, its scales right after.
  uint32_t stride = 1;
  uint32_t first = 0;  // the router's id of this GPU's expert 0
};

// Bit e % 32 set for each expert e of ids[0..n) in this lane's word `word`
// (experts [32 word, 32 word + 32)). The warp reads the ids together, a lane
// each and 128 at a time, all four loads in flight, and passes each id to
// every lane by a shuffle (each lane reading all n ids one after another
// waited out a memory latency every few ids). Every lane of the warp calls it.
__device__ inline uint32_t expert_word(const int32_t* ids, uint32_t n, uint32_t word, uint32_t first,
                                       uint32_t experts) {
  const uint32_t lane = threadIdx.x % 32;
  uint32_t bits = 0;
  for (uint32_t j0 = 0; j0 < n; j0 += 128) {
    int32_t id[4];
#pragma unroll
    for (uint32_t q = 0; q < 4; ++q) {
      const uint32_t j = j0 + 32 * q + lane;
      id[q] = j < n ? ids[j] : -1;
    }
#pragma unroll
    for (uint32_t q = 0; q < 4; ++q) {
      const uint32_t first = j0 + 32 * q, count = first < n ? min(32u, n - first) : 0u;
      for (uint32_t k = 0; k < count; ++k) {
        const uint32_t e = uint32_t(__shfl_sync(~0u, id[q], k)) - first;  // this GPU's expert e (if e < experts)
        if (e < experts && e >> 5 == word) bits |= 1u << (e & 31);
      }
    }
  }
  return bits;
}

// The sum of v over lanes [0, lane].
__device__ __forceinline__ uint32_t warp_inclusive_sum(uint32_t v) {
  const uint32_t lane = threadIdx.x % 32;
#pragma unroll
  for (int o = 1; o < 32; o *= 2) {
    const uint32_t u = __shfl_up_sync(~0u, v, o);
    if (lane >= uint32_t(o)) v += u;
  }
  return v;
}

// The distinct experts of ids[0..n) among [first, first + experts), as a
// bitmap of e - first, a word a lane, 32 words (1,024 experts) a round:
// `visit(bits, before)` gets this lane's word of the round and the number of
// distinct experts in the words before it, and the call returns the distinct
// count. Every lane of the warp calls it.
template <class F>
__device__ inline uint32_t expert_words(const int32_t* ids, uint32_t n, uint32_t experts, F visit,
                                        uint32_t first = 0) {
  const uint32_t lane = threadIdx.x % 32;
  uint32_t before = 0;
  for (uint32_t w0 = 0; 32 * w0 < experts; w0 += 32) {
    const uint32_t bits = expert_word(ids, n, w0 + lane, first, experts);
    const uint32_t c = __popc(bits), incl = warp_inclusive_sum(c);
    visit(w0, bits, before + incl - c);
    before += __shfl_sync(~0u, incl, 31);
  }
  return before;
}

// Lane's expert e's slot (the number of distinct experts of ids[0..n) below
// it; 0 for e < 0), e counted from `first` as in expert_words. Every lane of
// the warp calls it.
__device__ inline uint32_t expert_slot_of(const int32_t* ids, uint32_t n, uint32_t experts, int e,
                                          uint32_t first = 0) {
  uint32_t slot = 0;
  expert_words(ids, n, experts, [&](uint32_t w0, uint32_t bits, uint32_t before) {
    const uint32_t q = uint32_t(e) / 32 - w0;  // e's word in this round
    const bool here = e >= 0 && uint32_t(e) / 32 >= w0 && q < 32;
    const uint32_t src = here ? q : 0;
    const uint32_t b = __shfl_sync(~0u, before, src), w = __shfl_sync(~0u, bits, src);
    if (here) slot = b + __popc(w & ((1u << (e % 32)) - 1));
  }, first);
  return slot;
}

// A task's share of the step's expert rows: rows [r0, r1) of the expert in
// slot `slot` (expert -1, no rows, past the step's distinct experts), the
// expert counted from MoeShape::first.
struct ExpertPart {
  int expert;
  uint32_t slot;
  uint32_t r0, r1;
};

// The arguments of an expert task: the task is part `part` of `parts` of its
// stage, its rows whole units of `unit` rows of w0 (gate, paired with up) or
// the down matrix.
struct ExpertRows {
  MoeShape shape;
  uint32_t part, parts;  // the task's part of the stage's
  uint32_t unit;         // rows are split in units of this many
  void* const* w;        // the weight table
  const int32_t* ids;    // [B, top_k] the router's choices
  bool down;             // the down matrix (else gate, paired with up)
};

// The part of a task, found from the router's ids alike by the loader and
// the consumers (the same on every lane; every lane of the warp calls it).
template <int B>
__device__ inline ExpertPart expert_part(const ExpertRows& a) {
  const MoeShape& s = a.shape;
  const uint32_t n = B * s.top_k;
  const uint32_t distinct = expert_words(a.ids, n, s.experts, [](uint32_t, uint32_t, uint32_t) {}, s.first);
  if (distinct == 0 || a.part >= a.parts) return ExpertPart{-1, 0, 0, 0};
  if (a.parts < distinct) __trap();  // the plan gives a stage at least as many parts as slots
  // Slot s holds parts [s N / D, (s + 1) N / D): the part's slot is the
  // largest s with s N <= (part + 1) D - 1.
  const uint32_t slot = uint32_t((uint64_t(a.part + 1) * distinct - 1) / a.parts);
  const uint32_t first = uint32_t(uint64_t(slot) * a.parts / distinct);
  const uint32_t count = uint32_t(uint64_t(slot + 1) * a.parts / distinct) - first;
  const uint32_t rows = a.down ? s.hidden : s.inter, units = (rows + a.unit - 1) / a.unit;
  const uint32_t k = a.part - first;
  const uint32_t r0 = min(k * units / count * a.unit, rows), r1 = min((k + 1) * units / count * a.unit, rows);
  int expert = -1;
  expert_words(a.ids, n, s.experts, [&](uint32_t w0, uint32_t bits, uint32_t before) {
    const uint32_t c = __popc(bits);
    const uint32_t owner = __ballot_sync(~0u, slot >= before && slot < before + c);
    if (owner == 0) return;
    const uint32_t lane = __ffs(owner) - 1;
    uint32_t w = __shfl_sync(~0u, bits, lane);
    for (uint32_t j = __shfl_sync(~0u, slot - before, lane); j > 0; --j) w &= w - 1;  // drop the j lowest
    expert = int(32 * (w0 + lane) + __ffs(w) - 1);
  }, s.first);
  return ExpertPart{r0 < r1 ? expert : -1, slot, r0, r1};
}

// The tokens that chose the part's expert, bit b for token b (none for a part
// without rows): the rows its MXFP4 consumer computes (mx_rows_compute's
// `tokens`). Every lane of the warp calls it.
template <int B>
__device__ inline uint32_t expert_tokens(const ExpertRows& a, const ExpertPart& q) {
  static_assert(B < 32, "a token a bit");
  if (q.expert < 0) return 0u;
  const uint32_t k = a.shape.top_k;
  uint32_t bits = 0;
  for (uint32_t i = threadIdx.x % 32; i < B * k; i += 32)
    if (uint32_t(a.ids[i]) - a.shape.first == uint32_t(q.expert)) bits |= 1u << (i / k);
  return __reduce_or_sync(~0u, bits);
}

// The bf16 rows of an expert task's part (as expert_part found it).
template <int B>
__device__ inline Rows expert_rows(const ExpertRows& a, const ExpertPart& q) {
  const MoeShape& s = a.shape;
  if (q.expert < 0) return Rows{nullptr, nullptr, 0, 0, a.down ? s.inter : s.hidden};
  const uint32_t e = s.first + uint32_t(q.expert);  // the weight table lists every GPU's experts
  if (a.down) return Rows{static_cast<const __nv_bfloat16*>(a.w[s.down_base + e]), nullptr, q.r0, q.r1, s.inter};
  return Rows{static_cast<const __nv_bfloat16*>(a.w[s.gate_base + e]),
              static_cast<const __nv_bfloat16*>(a.w[s.up_base + e]), q.r0, q.r1, s.hidden};
}

// The rows of an expert task whose weights are codes and scales (as
// expert_rows, of the same arguments): each expert's codes then its scales in
// the weight table, experts `stride` (2) apart. R is the row type (MxRows,
// Fp8Rows: codes, scales, the paired matrix's codes and scales, rows, k), S
// its scales' element type.
template <class R, class S, int B>
__device__ inline R expert_coded_rows(const ExpertRows& a, const ExpertPart& q) {
  const MoeShape& s = a.shape;
  auto codes = [&](uint32_t i) { return static_cast<const uint8_t*>(a.w[i]); };
  auto scales = [&](uint32_t i) { return static_cast<const S*>(a.w[i]); };
  if (q.expert < 0) return R{nullptr, nullptr, nullptr, nullptr, 0, 0, a.down ? s.inter : s.hidden};
  const uint32_t e = s.first + uint32_t(q.expert);  // the weight table lists every GPU's experts
  if (a.down) {
    const uint32_t i = s.down_base + s.stride * e;
    return R{codes(i), scales(i + 1), nullptr, nullptr, q.r0, q.r1, s.inter};
  }
  const uint32_t g = s.gate_base + s.stride * e, u = s.up_base + s.stride * e;
  return R{codes(g), scales(g + 1), codes(u), scales(u + 1), q.r0, q.r1, s.hidden};
}

// The MXFP4 rows of an expert task: e2m1 codes and e8m0 scale bytes, tiled.
template <int B>
__device__ inline MxRows expert_mx_rows(const ExpertRows& a, const ExpertPart& q) {
  return expert_coded_rows<MxRows, uint8_t, B>(a, q);
}

// The FP8 rows of an expert task: e4m3 codes and fp32 block scales, as stored.
template <int B>
__device__ inline Fp8Rows expert_fp8_rows(const ExpertRows& a, const ExpertPart& q) {
  return expert_coded_rows<Fp8Rows, float, B>(a, q);
}

// routed[b, d] = sum_j weight[b, j] out[slot(ids[b, j]), b, d], for column
// tile `tile` of `tiles`, over the choices of this GPU's experts (all of
// them on one GPU).
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
  const uint32_t n = B * s.top_k;
  if (n > B * 64) __trap();
  constexpr uint32_t kElsewhere = ~0u;  // a choice of another GPU's expert
  for (uint32_t i0 = threadIdx.x / 32 * 32; i0 < n; i0 += kConsumerThreads) {  // a warp's 32 choices a round
    const uint32_t i = i0 + threadIdx.x % 32;
    const uint32_t e = i < n ? uint32_t(ids[i]) - s.first : kElsewhere;  // this GPU's expert e, if e < experts
    const uint32_t at = expert_slot_of(ids, n, s.experts, e < s.experts ? int(e) : -1, s.first);
    if (i < n) slot[i] = e < s.experts ? at : kElsewhere;
  }
  consumer_sync();
  const uint32_t d0 = tile * s.hidden / tiles, d1 = (tile + 1) * s.hidden / tiles;
  for (uint32_t i = threadIdx.x; i < B * (d1 - d0); i += kConsumerThreads) {
    const uint32_t b = i / (d1 - d0), d = d0 + i % (d1 - d0);
    float acc = 0.f;
    for (uint32_t j = 0; j < s.top_k; ++j) {
      const uint32_t at = slot[b * s.top_k + j];
      if (at != kElsewhere) acc = fmaf(wts[b * s.top_k + j], dn[(size_t(at) * B + b) * s.hidden + d], acc);
    }
    routed[size_t(b) * s.hidden + d] = from_float<T>(acc);
  }
  consumer_sync();
}

}  // namespace mkc
