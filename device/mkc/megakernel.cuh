// mkc device runtime: the persistent megakernel loop.
//
// One CTA per SM, launched once per decode step, laid out as the planner's
// warp plan says (src/plan/specialize.rs): two consumer warpgroups (warps 0-7)
// and one producer warpgroup (warp 8 loader, 9 controller, 10 storer, 11 spare):
//   controller: for each instruction of this SM's list, waits on its counters
//               (acquire), then releases the consumers (named barrier 1);
//   loader:     streams every instruction's weights into the page ring,
//               running ahead of the controller; it waits on counters only
//               for weights chosen by activations (routed experts);
//   consumers:  run the instruction's math between the two barriers;
//   storer:     once the consumers are done (named barrier 2, their stores
//               fenced), bumps the instruction's counter (release).
// With a profile buffer, the controller stamps when each instruction's waits
// are done and the storer when it ends, in %globaltimer nanoseconds (the
// consumers start it at the later of that and the previous end; the runtime
// writes that as its start).
// A debug build bounds every counter wait: on timeout the controller writes
// a HangReport (SM, instruction, counter, expected, seen) to host-mapped
// memory and traps, so the host can print the report instead of hanging.
#pragma once

#include "instruction.cuh"
#include "ops.cuh"
#include "projection.cuh"

namespace mkc {

constexpr int kLoaderWarp = kConsumerWarps;
constexpr int kControllerWarp = kConsumerWarps + 1;
constexpr int kStorerWarp = kConsumerWarps + 2;
constexpr int kThreads = (kConsumerWarps + 4) * 32;         // 384: the plan's layout
constexpr int kBarrierThreads = (kConsumerWarps + 1) * 32;  // consumers + controller, or consumers + storer
// The page ring, then scratch, then the staged activations.
constexpr size_t kSmemBytes = sizeof(Ring) + kScratchBytes + kActivationBytes;

// The schedule of one step, as device pointers.
struct Schedule {
  const Instruction* instructions;  // all SMs' lists, back to back
  const uint32_t* sm_begin;         // [sms + 1]: SM s runs instructions[sm_begin[s] .. sm_begin[s+1])
  const Wait* waits;
  uint32_t* counters;
  HangReport* report;               // host-mapped
  uint64_t* profile;                // [instructions, 2] start/end ns (%globaltimer), or null
};

__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// What the tasks compute is a policy: `Tasks::load(task, params, it)` streams
// a task's weights (loader warp), `Tasks::run(task, params, it, warp)` runs
// it (consumer warps); the generated program (generated/*/program.cuh) is
// one, the skeleton test's projections another.

__device__ __forceinline__ void named_barrier(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

template <class Tasks, bool kDebug>
__global__ void __launch_bounds__(kThreads, 1) megakernel(Schedule p, typename Tasks::Params params, uint32_t step) {
  Ring& ring = *ring_ptr();
  const int warp = threadIdx.x / 32;
  if (threadIdx.x == 0) ring_init(ring);
  __syncthreads();
  const uint32_t begin = p.sm_begin[blockIdx.x];
  const uint32_t end = p.sm_begin[blockIdx.x + 1];
  uint32_t it = 0;  // ring position, continuous across instructions

  if (warp == kLoaderWarp) {
    for (uint32_t i = begin; i < end; ++i) {
      const Instruction ins = p.instructions[i];
      // Routed-expert weights depend on the router's output: the loader
      // waits for the router's stage before streaming them (not for the
      // instruction's own waits, which assume the SM's earlier waits done).
      const Wait lw = Tasks::load_wait(ins.task, params);
      if (lw.target != 0) {
        if (threadIdx.x % 32 == 0 && !wait_counter<kDebug>(p.counters, lw, step, i, p.report)) __trap();
        __syncwarp();
      }
      Tasks::load(ins.task, params, it);
    }
  } else if (warp == kControllerWarp) {
    for (uint32_t i = begin; i < end; ++i) {
      const Instruction ins = p.instructions[i];
      if (threadIdx.x % 32 == 0) {
        bool ok = true;
        for (uint32_t w = 0; w < ins.n_waits && ok; ++w) {
          ok = wait_counter<kDebug>(p.counters, p.waits[ins.first_wait + w], step, i, p.report);
        }
        if (!ok) __trap();  // the HangReport is in host memory
        if (p.profile != nullptr) p.profile[2 * i] = global_ns();
      }
      __syncwarp();
      named_barrier(1, kBarrierThreads);  // consumers may start
    }
  } else if (warp == kStorerWarp) {
    for (uint32_t i = begin; i < end; ++i) {
      named_barrier(2, kBarrierThreads);  // consumers are done, their stores fenced
      if (threadIdx.x % 32 == 0) {
        if (p.profile != nullptr) p.profile[2 * i + 1] = global_ns();
        add_release(p.counters + p.instructions[i].signal, 1);
      }
      __syncwarp();
    }
  } else if (warp < kConsumerWarps) {
    for (uint32_t i = begin; i < end; ++i) {
      named_barrier(1, kBarrierThreads);
      Tasks::run(p.instructions[i].task, params, it, warp);
      __threadfence();
      named_barrier(2, kBarrierThreads);
    }
  }
}

}  // namespace mkc
