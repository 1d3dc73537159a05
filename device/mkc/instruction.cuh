// mkc device runtime: the instruction format the planner emits, and the
// dependency counters the SMs synchronise through.
//
// Each SM runs its own list of instructions (one fused-operation task each).
// An instruction waits on counters of earlier stages, runs its task, and
// bumps its stage's counter once with release semantics. Counters are never
// reset: in step n (from 1) a wait for `target` bumps per step waits until the
// counter reaches n * target (compared modulo 2^32), so no reset launch is
// needed between steps.
#pragma once

#include <cstdint>

#include "plan_types.h"

namespace mkc {

// What a task does: the planner's TaskKind, in the same order
// (src/plan/tables.rs; a test keeps the two lists in step). The skeleton
// kernel executes projections so far and traps on any other opcode.
enum Opcode : uint16_t {
  kProjectionRows = 0,
  kMlaSplit,
  kMlaCombine,
  kKda,
  kRouter,
  kExpertUp,
  kExpertDown,
  kExpertCombine,
  kAttnRes,
  kEmbedding,
  kLmHeadRows,
  kArgmax,
  kElementwise,
  kMlaAbsorb,
  kExchangeSend,
  kExchangeReduce,
};

// What a debug build reports instead of hanging.
struct HangReport {
  uint32_t valid;
  uint32_t sm;
  uint32_t instruction;
  uint32_t counter;
  uint32_t expected;
  uint32_t seen;
};

// Spins (with backoff) a debug build allows a wait before reporting a hang:
// about a second.
constexpr uint64_t kDebugMaxSpins = 1u << 23;

__device__ __forceinline__ uint32_t load_acquire(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void add_release(uint32_t* p, uint32_t v) {
  asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// The same at system scope: a counter another GPU bumps or reads (an
// expert-parallel program's exchange, ops/exchange.cuh).
__device__ __forceinline__ uint32_t load_acquire_system(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void add_release_system(uint32_t* p, uint32_t v) {
  asm volatile("red.release.sys.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Waits until counters[w.counter] reaches step * w.target. In a debug build,
// gives up after kDebugMaxSpins, fills `report` and returns false.
template <bool kDebug>
__device__ bool wait_counter(const uint32_t* counters, Wait w, uint32_t step, uint32_t instruction,
                             HangReport* report) {
  const uint32_t goal = step * w.target;
  uint32_t backoff = 16;  // ns; short: a stage's latency adds to every step
  uint64_t spins = 0;
  while (true) {
    const uint32_t seen = load_acquire(counters + w.counter);
    if (static_cast<int32_t>(seen - goal) >= 0) return true;
    if (kDebug && ++spins > kDebugMaxSpins) {
      report->sm = blockIdx.x;
      report->instruction = instruction;
      report->counter = w.counter;
      report->expected = goal;
      report->seen = seen;
      __threadfence_system();
      report->valid = 1;
      __threadfence_system();
      return false;
    }
    __nanosleep(backoff);
    if (backoff < 128) backoff *= 2;
  }
}

}  // namespace mkc
