// mkc device runtime: the persistent megakernel loop.
//
// One CTA per SM, launched once per decode step (or once for a whole greedy
// generation: generate_kernel), laid out as the planner's
// warp plan says (src/plan/specialize.rs): two consumer warpgroups (warps 0-7)
// and one producer warpgroup (warp 8 loader, 9 controller, 10 storer, 11 prefetcher):
//   controller: for each instruction of this SM's list, waits on its counters
//               (acquire), then releases the consumers (named barrier 1);
//   loader:     streams every instruction's weights into the page ring,
//               running ahead of the controller; it waits on counters only
//               for weights chosen by activations (routed experts);
//   consumers:  run the instruction's math between the two barriers;
//   storer:     once the consumers are done (named barrier 2, their stores
//               fenced), bumps the instruction's counter (release);
//   prefetcher: a few instructions ahead of the loader, reads each task's
//               plan records into L1 (`Tasks::prefetch`, if the policy has
//               one): they are the plan's, not the step's, and read where
//               they are used they were a chain of memory latencies at the
//               start of every task, on the loader's and the consumers' path.
// With a profile buffer, the controller stamps when each instruction's waits
// are done and the storer when it ends, in %globaltimer nanoseconds (the
// consumers start it at the later of that and the previous end; the runtime
// writes that as its start); consumer thread 0 stamps the task's first page
// wait, that page's arrival and its last page's release, and counts its pages
// (ProfileMark, projection.cuh).
// A debug build bounds every counter wait: on timeout the controller writes
// a HangReport (SM, instruction, counter, expected, seen) to host-mapped
// memory and traps, so the host can print the report instead of hanging.
#pragma once

#include "instruction.cuh"
#include "ops.cuh"
#include "projection.cuh"
#include "speculative.h"

#include <string>

namespace mkc {

constexpr int kLoaderWarp = kConsumerWarps;
constexpr int kControllerWarp = kConsumerWarps + 1;
constexpr int kStorerWarp = kConsumerWarps + 2;
constexpr int kPrefetchWarp = kConsumerWarps + 3;
// How many instructions the prefetching warp runs ahead of the loader.
constexpr uint32_t kPrefetchAhead = 4;
constexpr int kThreads = (kConsumerWarps + 4) * 32;         // 384: the plan's layout
constexpr int kBarrierThreads = (kConsumerWarps + 1) * 32;  // consumers + controller, or consumers + storer
// The page ring, then scratch, then the staged activations.
constexpr size_t kSmemBytes = sizeof(Ring) + kScratchBytes + kActivationBytes;

// Grants `fn` (a kernel of this layout) the dynamic shared memory the layout
// takes (kSmemBytes), after checking its static shared memory against the
// budget the planner leaves for it (kStaticSmemBytes; past it the grant fails
// with "invalid argument", naming nothing). Returns "" when granted, else what
// went wrong, naming `what`. The runtime and the device tests all grant
// through here.
inline std::string grant_shared_memory(const void* fn, const char* what) {
  cudaFuncAttributes at{};
  cudaError_t e = cudaFuncGetAttributes(&at, fn);
  if (e == cudaSuccess && at.sharedSizeBytes > size_t(kStaticSmemBytes)) {
    return std::string(what) + " has " + std::to_string(at.sharedSizeBytes) +
           " bytes of static shared memory, more than the " + std::to_string(kStaticSmemBytes) +
           " the plan leaves beside its " + std::to_string(kSmemBytes) +
           " dynamic bytes (kStaticSmemBytes, device/mkc/contract.h)";
  }
  if (e == cudaSuccess) e = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kSmemBytes));
  if (e != cudaSuccess) return std::string(what) + ": granting shared memory: " + cudaGetErrorString(e);
  return {};
}

// The schedule of one step, as device pointers.
struct Schedule {
  const Instruction* instructions;  // all SMs' lists, back to back
  const uint32_t* sm_begin;         // [sms + 1]: SM s runs instructions[sm_begin[s] .. sm_begin[s+1])
  const Wait* waits;
  uint32_t* counters;
  HangReport* report;               // host-mapped
  uint64_t* profile;                // [instructions, kProfileMarks] ns (%globaltimer, projection.cuh), or null
};

// What the tasks compute is a policy: `Tasks::load(task, params, it)` streams
// a task's weights (loader warp), `Tasks::run(task, params, it, warp)` runs
// it (consumer warps), and, if it has one, `Tasks::prefetch(task, params)`
// fetches a task's plan records (prefetcher warp); the generated program
// (generated/*/program.cuh) is one, the skeleton test's projections another.

__device__ __forceinline__ void named_barrier(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// The instruction the loader is at, the prefetcher's pace (a hint: a stale
// value only moves a prefetch earlier or later).
__device__ __forceinline__ volatile uint32_t& loader_at() {
  __shared__ uint32_t at;
  return at;
}

// One step of this SM's instruction list [begin, end), each warp in its
// role; `it` is the ring position, continuous across steps of one launch.
template <class Tasks, bool kDebug>
__device__ __forceinline__ void run_step(const Schedule& p, const typename Tasks::Params& params, uint32_t step,
                                         uint32_t begin, uint32_t end, int warp, uint32_t& it) {
  if (warp == kLoaderWarp) {
    for (uint32_t i = begin; i < end; ++i) {
      if (threadIdx.x % 32 == 0) loader_at() = i;
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
        if (p.profile != nullptr) p.profile[kProfileMarks * i + kMarkReady] = global_ns();
      }
      __syncwarp();
      named_barrier(1, kBarrierThreads);  // consumers may start
    }
  } else if (warp == kStorerWarp) {
    for (uint32_t i = begin; i < end; ++i) {
      named_barrier(2, kBarrierThreads);  // consumers are done, their stores fenced
      if (threadIdx.x % 32 == 0) {
        if (p.profile != nullptr) p.profile[kProfileMarks * i + kMarkEnd] = global_ns();
        add_release(p.counters + p.instructions[i].signal, 1);
      }
      __syncwarp();
    }
  } else if (warp < kConsumerWarps) {
    for (uint32_t i = begin; i < end; ++i) {
      const uint32_t task = p.instructions[i].task;  // read while the controller waits
      if (threadIdx.x == 0) {
        task_marks() = TaskMarks{p.profile != nullptr ? p.profile + kProfileMarks * i : nullptr, 0, step};
      }
      named_barrier(1, kBarrierThreads);
      Tasks::run(task, params, it, warp);
      if (threadIdx.x == 0 && task_marks().at != nullptr) task_marks().at[kMarkPages] = task_marks().pages;
      __threadfence();
      named_barrier(2, kBarrierThreads);
    }
  } else if (warp == kPrefetchWarp) {
    if constexpr (requires { Tasks::prefetch(begin, params); }) {
      for (uint32_t i = begin; i < end; ++i) {
        while (int32_t(i - loader_at()) >= int32_t(kPrefetchAhead)) __nanosleep(64);
        Tasks::prefetch(p.instructions[i].task, params);
      }
    }
  }
}

// One decode step (`step` counts from 1 over the engine's life: the counters'
// waits are multiples of it).
template <class Tasks, bool kDebug>
__global__ void __launch_bounds__(kThreads, 1) megakernel(Schedule p, typename Tasks::Params params, uint32_t step) {
  Ring& ring = *ring_ptr();
  if (threadIdx.x == 0) ring_init(ring);
  __syncthreads();
  uint32_t it = 0;
  run_step<Tasks, kDebug>(p, params, step, p.sm_begin[blockIdx.x], p.sm_begin[blockIdx.x + 1], threadIdx.x / 32, it);
}

// ---------------------------------------------------------------------------
// After a verify step (a program of kPositions > 1 rows a sequence): the
// state the step read but left as it was (KDA's recurrent state, the conv
// windows) stepped through the positions each sequence keeps, from the
// step's logs (`Tasks::commit(task, params, keep)`, every instruction's
// task, each on the SM that ran it). Each CTA first takes what each sequence
// keeps from the step's own choices (accepted_drafts, speculative.h: the
// accepted drafts and the token before them), at most limit[sequence] if
// `limit` is given (a generation's last tokens; 0: none kept); CTA 0 writes
// the accepted drafts to `accepted` [sequences]. Launched after the step,
// with kConsumerThreads threads.
template <class Tasks, int kPositions, int kSequences>
__global__ void __launch_bounds__(kConsumerThreads, 1) commit_kernel(Schedule p, typename Tasks::Params params,
                                                                      const int32_t* choice, const uint32_t* limit,
                                                                      int32_t* accepted) {
  __shared__ uint32_t keep[kSequences];
  for (int sq = threadIdx.x; sq < kSequences; sq += blockDim.x) {
    const uint32_t a = accepted_drafts(params.tokens + sq * kPositions, choice + sq * kPositions, kPositions);
    keep[sq] = limit != nullptr && limit[sq] < a + 1 ? limit[sq] : a + 1;
    if (blockIdx.x == 0) accepted[sq] = int32_t(a);
  }
  __syncthreads();
  for (uint32_t i = p.sm_begin[blockIdx.x]; i < p.sm_begin[blockIdx.x + 1]; ++i) {
    Tasks::commit(p.instructions[i].task, params, keep);
  }
}

// ---------------------------------------------------------------------------
// Greedy generation in one launch (mkc_model_generate): step after step, each
// step's next tokens fed back as the following step's tokens and the
// positions advanced on the device, until `n` steps or until every sequence
// has produced `stop`.
//
// Tokens and positions are double-buffered by step parity: step s reads half
// s % 2 and nothing in it touches the other half. Between steps every CTA
// arrives at a grid barrier (the launch is cooperative: all CTAs are
// resident); the last to arrive, which sees every instruction of step s done,
// writes step s + 1's half (the argmax output as tokens, positions + 1),
// records the tokens, decides whether to stop, and releases the others.

struct GenerateControl {
  uint32_t arrived;   // CTAs arrived at step boundaries, over the launch
  uint32_t released;  // steps completed and released
  uint32_t steps;     // steps run
  uint32_t done;      // 1: no step follows
};

struct Generate {
  int32_t* tokens;       // [2][batch]: half 0 the first step's tokens (from the host)
  int32_t* pos;          // [2][batch]: half 0 the first step's positions
  const int32_t* next;   // [batch]: the argmax output a step writes
  int32_t* out;          // [n][batch]: each step's next tokens
  int32_t* length;       // [batch], zeroed: the step (from 1) at which the sequence produced `stop`
  GenerateControl* ctl;  // zeroed before the launch
  uint32_t batch;
  uint32_t n;            // at most this many steps
  int32_t stop;          // the token that ends a sequence; -1: none
};

__device__ __forceinline__ void store_release(uint32_t* p, uint32_t v) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// A grid barrier of thread 0 (the launch is cooperative): `arrivals`
// arrivals of every CTA so far; the last to arrive returns true without
// waiting (the caller releases the others with store_release(released,
// arrivals)); the others wait for that release.
__device__ __forceinline__ bool grid_arrive(GenerateControl* ctl, uint32_t arrivals) {
  __threadfence();
  if (atomicAdd(&ctl->arrived, 1u) + 1 == arrivals * gridDim.x) {
    __threadfence();  // every CTA's work before the barrier is visible
    return true;
  }
  uint32_t backoff = 16;
  while (static_cast<int32_t>(load_acquire(&ctl->released) - arrivals) < 0) {
    __nanosleep(backoff);
    if (backoff < 128) backoff *= 2;
  }
  return false;
}

template <class Tasks>
__global__ void __launch_bounds__(kThreads, 1) generate_kernel(Schedule p, typename Tasks::Params params,
                                                               uint32_t step0, Generate g) {
  Ring& ring = *ring_ptr();
  __shared__ uint32_t done;
  if (threadIdx.x == 0) ring_init(ring);
  __syncthreads();
  const uint32_t begin = p.sm_begin[blockIdx.x], end = p.sm_begin[blockIdx.x + 1];
  uint32_t it = 0;
  for (uint32_t s = 0;; ++s) {
    typename Tasks::Params sp = params;
    sp.tokens = g.tokens + (s & 1) * g.batch;
    sp.pos = g.pos + (s & 1) * g.batch;
    run_step<Tasks, false>(p, sp, step0 + s, begin, end, threadIdx.x / 32, it);
    __syncthreads();  // this CTA's instructions of step s are done (the storer's releases issued)
    if (threadIdx.x == 0) {
      if (grid_arrive(g.ctl, s + 1)) {  // the last to arrive: every CTA's step s is visible
        const int32_t* cur = g.pos + (s & 1) * g.batch;
        int32_t* tokens = g.tokens + ((s + 1) & 1) * g.batch;
        int32_t* pos = g.pos + ((s + 1) & 1) * g.batch;
        bool all_stopped = true;
        for (uint32_t b = 0; b < g.batch; ++b) {
          const int32_t t = g.next[b];
          g.out[size_t(s) * g.batch + b] = t;
          tokens[b] = t;
          pos[b] = cur[b] + 1;
          if (g.length[b] == 0 && t == g.stop) g.length[b] = int32_t(s + 1);
          all_stopped = all_stopped && g.length[b] != 0;
        }
        g.ctl->steps = s + 1;
        g.ctl->done = (all_stopped || s + 1 == g.n) ? 1u : 0u;
        __threadfence();
        store_release(&g.ctl->released, s + 1);
      }
      done = *reinterpret_cast<volatile uint32_t*>(&g.ctl->done);
    }
    __syncthreads();
    if (done) break;
  }
}

// ---------------------------------------------------------------------------
// Greedy generation with speculation in one launch (a verify program of
// kPositions rows a sequence: mkc_model_generate_speculative). Each step
// verifies every sequence's last token and its drafts. At the first grid
// barrier after it, the last CTA to arrive takes each sequence's tokens
// (accepted_drafts: the drafts that stand and the choice after them, at most
// what the sequence still needs), appends them to its history and output,
// and writes the next step's rows into the other half of the tokens and
// positions: the history's last token and its prompt-lookup drafts
// (ngram_draft: n-grams of 1 to 3 tokens, the token 0 where none recurs).
// Every CTA then commits its tasks' state through the tokens taken
// (Tasks::commit, as commit_kernel), and a second grid barrier ends the step.
// A sequence that has its n tokens steps along without advancing, until
// every sequence has them.
struct Speculate {
  int32_t* tokens;        // [2][batch]: half 0 the first step's rows (from the host)
  int32_t* pos;           // [2][batch]: their positions
  const int32_t* choice;  // [batch]: the argmax output a step writes
  int32_t* history;       // [sequences][cap]: each sequence's tokens, the last not yet decoded
  uint32_t* length;       // [sequences]: the history's length
  uint32_t* done;         // [sequences], zeroed: tokens generated
  uint32_t* keep;         // [sequences]: the positions a step's commit keeps
  int32_t* out;           // [sequences][n]: the generated tokens
  GenerateControl* ctl;   // zeroed before the launch
  uint32_t cap;           // the history's room per sequence: its length + n at least
  uint32_t n;             // tokens per sequence
};

template <class Tasks, int kPositions, int kSequences>
__global__ void __launch_bounds__(kThreads, 1)
    speculate_kernel(Schedule p, typename Tasks::Params params, uint32_t step0, Speculate g) {
  constexpr int kRows = kPositions * kSequences;
  Ring& ring = *ring_ptr();
  __shared__ uint32_t last, done;
  if (threadIdx.x == 0) ring_init(ring);
  __syncthreads();
  const uint32_t begin = p.sm_begin[blockIdx.x], end = p.sm_begin[blockIdx.x + 1];
  uint32_t it = 0;
  for (uint32_t s = 0;; ++s) {
    typename Tasks::Params sp = params;
    const int32_t* rows = g.tokens + (s & 1) * kRows;
    const int32_t* pos = g.pos + (s & 1) * kRows;
    sp.tokens = rows;
    sp.pos = pos;
    run_step<Tasks, false>(p, sp, step0 + s, begin, end, threadIdx.x / 32, it);
    __syncthreads();  // this CTA's instructions of step s are done (the storer's releases issued)
    if (threadIdx.x == 0) last = grid_arrive(g.ctl, 2 * s + 1) ? 1u : 0u;
    __syncthreads();
    if (last) {  // the step's choices are final: take the tokens, draft the next rows
      __threadfence();
      int32_t* next_rows = g.tokens + ((s + 1) & 1) * kRows;
      int32_t* next_pos = g.pos + ((s + 1) & 1) * kRows;
      for (int sq = threadIdx.x; sq < kSequences; sq += blockDim.x) {
        const int32_t* row = rows + sq * kPositions;
        const uint32_t a = accepted_drafts(row, g.choice + sq * kPositions, kPositions);
        const uint32_t left = g.n - g.done[sq], take = left < a + 1 ? left : a + 1;
        int32_t* history = g.history + size_t(sq) * g.cap;
        for (uint32_t i = 0; i < take; ++i) {
          const int32_t t = i < a ? row[i + 1] : g.choice[sq * kPositions + a];
          g.out[size_t(sq) * g.n + g.done[sq] + i] = t;
          history[g.length[sq] + i] = t;
        }
        g.done[sq] += take;
        g.length[sq] += take;
        g.keep[sq] = take;
        int32_t* next = next_rows + sq * kPositions;
        next[0] = history[g.length[sq] - 1];
        const uint32_t drafted = ngram_draft(history, g.length[sq], 1, 3, kPositions - 1, next + 1);
        for (uint32_t i = 1 + drafted; i < uint32_t(kPositions); ++i) next[i] = 0;
        for (int t = 0; t < kPositions; ++t) next_pos[sq * kPositions + t] = pos[sq * kPositions] + int32_t(take) + t;
      }
      __syncthreads();
      if (threadIdx.x == 0) {
        bool all = true;
        for (int sq = 0; sq < kSequences; ++sq) all = all && g.done[sq] == g.n;
        g.ctl->steps = s + 1;
        g.ctl->done = all ? 1u : 0u;
        __threadfence();
        store_release(&g.ctl->released, 2 * s + 1);
      }
    }
    __syncthreads();
    // The state through the tokens each sequence took, this CTA's tasks (the consumer warps' work).
    if (threadIdx.x < kConsumerThreads) {
      for (uint32_t i = begin; i < end; ++i) Tasks::commit(p.instructions[i].task, params, g.keep);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      if (grid_arrive(g.ctl, 2 * s + 2)) store_release(&g.ctl->released, 2 * s + 2);
      done = *reinterpret_cast<volatile uint32_t*>(&g.ctl->done);
    }
    __syncthreads();
    if (done) break;
  }
}

}  // namespace mkc
