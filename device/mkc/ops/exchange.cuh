// mkc device library: several GPUs (an expert-parallel program): the exchange that adds the
// GPUs' parts of each MoE layer's output.
#pragma once

#include "common.cuh"

namespace mkc {

// ---------------------------------------------------------------------------
// An expert-parallel program runs on `ranks` GPUs of one NVLink domain, the
// same plan on the same tokens on each, every GPU holding its share of each
// MoE layer's routed experts. After a layer's combine, every GPU holds its
// part of the experts' weighted sum; the exchange (the planner's
// tile::Exchange) adds the parts:
//   send:   a task's column tile of this GPU's part written into every other
//           GPU's inbox, at this GPU's place in the exchange's half, then
//           that GPU's remote counter of the exchange bumped (release, system
//           scope);
//   reduce: once the controller has seen every other GPU's bumps (the
//           schedule's wait on the remote counter; the task acquires them
//           again at system scope), the tile's sum over the GPUs in rank order
//           (this GPU's part from its own arena): the same sum on every GPU.
// The inbox has two halves: exchange x of step s uses half (s n + x) % 2 of
// n a step, so a send writes the half the exchange before the last used,
// whose reduces on the other GPUs are done (the verifier's proof, verify.rs).
// The peers' addresses are the runtime's (peer-mapped memory:
// cudaDeviceEnablePeerAccess in one process, NVSHMEM's nvshmem_ptr across
// processes).
struct Peers {
  uint32_t rank;                  // this GPU
  uint32_t ranks;                 // the GPUs, at most kMaxRanks
  float* inbox[kMaxRanks];        // GPU r's inbox: [2 halves][ranks][floats a part]
  uint32_t* counters[kMaxRanks];  // GPU r's schedule counters
};

// One exchange of a step (compiled in: its place among the step's and the
// inbox's part size), a task's column tile of a [B][width] fp32 part.
struct Exchange {
  const Peers* peers;
  uint32_t index, per_step;  // exchange `index` of `per_step` a step
  uint32_t floats;           // an inbox part's floats (at least B width)
  uint32_t width;            // the part's columns
  uint32_t tile, tiles;      // the task's column tile of `tiles`
  uint32_t counter;          // the exchange's remote counter
};

// Half (step n + x) % 2 of an inbox: GPU `rank`'s part there.
__device__ inline size_t exchange_at(const Exchange& x, uint32_t step, uint32_t rank) {
  const uint32_t half = (step * x.per_step + x.index) & 1u;
  return (size_t(half) * x.peers->ranks + rank) * x.floats;
}

// Send: this GPU's part [B][width] (its column tile) into every other GPU's
// inbox, then that GPU's remote counter bumped once.
template <int B>
__device__ void exchange_send(Exchange x, const float* part) {
  const Peers& p = *x.peers;
  const uint32_t c0 = x.tile * x.width / x.tiles, c1 = (x.tile + 1) * x.width / x.tiles, n = c1 - c0;
  const size_t at = exchange_at(x, current_step(), p.rank);
  for (uint32_t q = 0; q < p.ranks; ++q) {
    if (q == p.rank) continue;
    float* dst = p.inbox[q] + at;
    for (uint32_t i = threadIdx.x; i < B * n; i += kConsumerThreads) {
      const size_t e = size_t(i / n) * x.width + c0 + i % n;
      dst[e] = part[e];
    }
  }
  __threadfence_system();  // this thread's writes before the bumps (cumulative through the barrier)
  consumer_sync();
  if (threadIdx.x == 0) {
    for (uint32_t q = 0; q < p.ranks; ++q)
      if (q != p.rank) add_release_system(p.counters[q] + x.counter, 1);
  }
}

// Reduce: the tile's sum over the GPUs in rank order into out [B][width],
// after every other GPU's sends of the exchange (`expected` bumps a step).
template <int B, class T>
__device__ void exchange_reduce(Exchange x, const float* part, uint32_t expected, T* out) {
  const Peers& p = *x.peers;
  const uint32_t step = current_step();
  if (threadIdx.x == 0) {
    const uint32_t* c = p.counters[p.rank] + x.counter;
    while (static_cast<int32_t>(load_acquire_system(c) - step * expected) < 0) __nanosleep(32);
  }
  consumer_sync();
  const uint32_t c0 = x.tile * x.width / x.tiles, c1 = (x.tile + 1) * x.width / x.tiles, n = c1 - c0;
  const float* inbox = p.inbox[p.rank];
  for (uint32_t i = threadIdx.x; i < B * n; i += kConsumerThreads) {
    const size_t e = size_t(i / n) * x.width + c0 + i % n;
    float sum = 0.f;
    for (uint32_t q = 0; q < p.ranks; ++q) sum += q == p.rank ? part[e] : inbox[exchange_at(x, step, q) + e];
    out[e] = from_float<T>(sum);
  }
  consumer_sync();
}

}  // namespace mkc
