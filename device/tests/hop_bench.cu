// What one dependent stage hop costs: a chain of H stages, each waiting for
// the whole of the one before, run by the megakernel's own machinery on one
// CTA per SM, timed with CUDA events; the figure is (time of H stages - time
// of 1 stage) / (H - 1), so the launch is not counted. Variants:
//   flag-spin     thread 0 of the stage's SM spins on the counter (ld.acquire, no sleep),
//                 then bumps the next (red.release); one task a stage, the stages round
//                 robin over the SMs: the bare cost of a flag passed between SMs
//   flag-backoff  the same with the megakernel's wait (mkc::wait_counter: nanosleep 16-128 ns)
//   roles-1       mkc::megakernel with tasks that do nothing: controller wait, named barrier 1,
//                 the consumers' fence, named barrier 2, the storer's release; one task a stage
//   roles-8       the same with 8 tasks a stage on 8 SMs, each waiting for all 8 of the stage
//                 before (the tiny K2 program's shape: 256 tasks in 32 stages)
//   roles-8-data  roles-8 whose tasks read the previous stage's output (8 x 1 KiB, from L2)
//                 and write 1 KiB of their own
// and the launch itself: an empty cooperative megakernel launched and synchronised (as
// mkc_model_step does), and launched back to back (as mkc_model_time_steps does).
// A measurement, not a test: nothing is asserted; the numbers go in docs/PERFORMANCE.md.
//
//   target/device/hop_bench_sm90a        (on an H200 or H100)
#include <chrono>
#include <cstdio>
#include <vector>

#include "check.cuh"
#include "mkc/megakernel.cuh"

constexpr uint32_t kData = 256;  // floats a task writes (1 KiB)

// Tasks that do nothing, or move a little data: the megakernel's machinery alone.
struct Hops {
  struct Params {
    float* data;          // [stages][tasks][kData]
    uint32_t tasks;       // tasks a stage
    uint32_t with_data;   // 1: read the stage before's outputs, write this task's
  };
  static __device__ mkc::Wait load_wait(uint32_t, const Params&) { return mkc::Wait{0, 0}; }
  static __device__ void load(uint32_t, const Params&, uint32_t&) {}
  static __device__ void run(uint32_t task, const Params& p, uint32_t&, int warp) {
    if (!p.with_data) return;
    const uint32_t stage = task / p.tasks, i = threadIdx.x;  // 256 consumer threads, one float each
    float v = float(task);
    if (stage > 0) {
      const float* prev = p.data + size_t(stage - 1) * p.tasks * kData;
      for (uint32_t t = 0; t < p.tasks; ++t) v += prev[t * kData + i];
    }
    p.data[size_t(task) * kData + i] = v;
    (void)warp;
  }
};

// A chain of `stages` stages of `tasks` tasks, task t of every stage on SM t (stage s's
// tasks on SMs offset by s when `rotate`), each waiting for all of the stage before.
struct Chain {
  std::vector<mkc::Instruction> instructions;
  std::vector<uint32_t> sm_begin;
  std::vector<mkc::Wait> waits;
};

static Chain make_chain(int sms, uint32_t stages, uint32_t tasks, bool rotate) {
  std::vector<std::vector<mkc::Instruction>> lists(sms);
  Chain c;
  for (uint32_t s = 0; s < stages; ++s) {
    for (uint32_t t = 0; t < tasks; ++t) {
      mkc::Instruction ins{mkc::kProjectionRows, 0, uint32_t(c.waits.size()), s, s * tasks + t};
      if (s > 0) {
        c.waits.push_back({s - 1, tasks});
        ins.n_waits = 1;
      }
      lists[(t + (rotate ? s : 0)) % sms].push_back(ins);
    }
  }
  c.sm_begin.push_back(0);
  for (auto& l : lists) {
    c.instructions.insert(c.instructions.end(), l.begin(), l.end());
    c.sm_begin.push_back(uint32_t(c.instructions.size()));
  }
  return c;
}

// The flag variants: stage s on SM s % sms, thread 0 only.
template <bool kBackoff>
__global__ void flag_chain(uint32_t* counters, uint32_t stages, uint32_t step) {
  if (threadIdx.x != 0) return;
  for (uint32_t s = blockIdx.x; s < stages; s += gridDim.x) {
    if (s > 0) {
      if (kBackoff) {
        mkc::wait_counter<false>(counters, mkc::Wait{s - 1, 1}, step, 0, nullptr);
      } else {
        while (static_cast<int32_t>(mkc::load_acquire(counters + s - 1) - step) < 0) {
        }
      }
    }
    mkc::add_release(counters + s, 1);
  }
}

struct Timer {
  cudaEvent_t a, b;
  Timer() {
    CHECK(cudaEventCreate(&a));
    CHECK(cudaEventCreate(&b));
  }
  ~Timer() {
    cudaEventDestroy(a);
    cudaEventDestroy(b);
  }
};

// Microseconds of one launch of `launch` (the best of 5, after one warm-up).
template <class F>
static double time_us(F launch) {
  Timer t;
  double best = 1e30;
  for (int r = 0; r < 6; ++r) {
    CHECK(cudaEventRecord(t.a));
    launch();
    CHECK(cudaEventRecord(t.b));
    CHECK(cudaEventSynchronize(t.b));
    CHECK(cudaGetLastError());
    float ms = 0.f;
    CHECK(cudaEventElapsedTime(&ms, t.a, t.b));
    if (r > 0) best = std::min(best, double(ms) * 1e3);
  }
  return best;
}

int main() {
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("%s, %d SMs\n", prop.name, sms);
  const uint32_t kStages = 1000;
  uint32_t* counters = nullptr;
  CHECK(cudaMalloc(&counters, sizeof(uint32_t) * kStages));
  float* data = nullptr;
  CHECK(cudaMalloc(&data, sizeof(float) * kStages * 8 * kData));
  uint32_t step = 0;  // counters are never reset: step n waits for n bumps

  std::printf("%-14s %10s %10s %12s\n", "variant", "1 stage", "1000", "us per hop");
  auto report = [](const char* name, double one, double many) {
    std::printf("%-14s %8.2f us %7.1f us %10.3f us\n", name, one, many, (many - one) / double(kStages - 1));
  };

  for (int backoff = 0; backoff < 2; ++backoff) {
    auto run = [&](uint32_t stages) {
      return time_us([&] {
        CHECK(cudaMemset(counters, 0, sizeof(uint32_t) * kStages));
        if (backoff) flag_chain<true><<<sms, 32>>>(counters, stages, 1);
        else flag_chain<false><<<sms, 32>>>(counters, stages, 1);
      });
    };
    report(backoff ? "flag-backoff" : "flag-spin", run(1), run(kStages));
  }

  grant_shared_memory(mkc::megakernel<Hops, false>, "the hop megakernel");
  mkc::HangReport* report_buf = nullptr;
  CHECK(cudaMalloc(&report_buf, sizeof(mkc::HangReport)));
  struct Variant {
    const char* name;
    uint32_t tasks;
    uint32_t with_data;
  };
  for (const Variant v : {Variant{"roles-1", 1, 0}, Variant{"roles-8", 8, 0}, Variant{"roles-8-data", 8, 1}}) {
    double t[2];
    for (int k = 0; k < 2; ++k) {
      const uint32_t stages = k == 0 ? 1 : kStages;
      const Chain c = make_chain(sms, stages, v.tasks, v.tasks == 1);
      mkc::Schedule s{upload(c.instructions), upload(c.sm_begin), upload(c.waits), nullptr, report_buf, nullptr};
      CHECK(cudaMalloc(&s.counters, sizeof(uint32_t) * stages));
      CHECK(cudaMemset(s.counters, 0, sizeof(uint32_t) * stages));
      Hops::Params p{data, v.tasks, v.with_data};
      step = 0;
      t[k] = time_us([&] {
        ++step;
        void* args[] = {&s, &p, &step};
        CHECK(cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(&mkc::megakernel<Hops, false>), dim3(sms),
                                          dim3(mkc::kThreads), args, mkc::kSmemBytes, 0));
      });
      CHECK(cudaFree(const_cast<mkc::Instruction*>(s.instructions)));
      CHECK(cudaFree(const_cast<uint32_t*>(s.sm_begin)));
      CHECK(cudaFree(const_cast<mkc::Wait*>(s.waits)));
      CHECK(cudaFree(s.counters));
    }
    report(v.name, t[0], t[1]);
  }

  // The launch: an empty schedule (no instructions), as mkc_model_step launches it.
  {
    const Chain c = make_chain(sms, 0, 1, false);
    mkc::Schedule s{upload(c.instructions), upload(c.sm_begin), upload(c.waits), counters, report_buf, nullptr};
    Hops::Params p{data, 1, 0};
    auto launch = [&] {
      ++step;
      void* args[] = {&s, &p, &step};
      CHECK(cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(&mkc::megakernel<Hops, false>), dim3(sms),
                                        dim3(mkc::kThreads), args, mkc::kSmemBytes, 0));
    };
    const int n = 200;
    launch();
    CHECK(cudaDeviceSynchronize());
    auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < n; ++i) {
      launch();
      CHECK(cudaDeviceSynchronize());
    }
    const double synced = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / n;
    t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < n; ++i) launch();
    CHECK(cudaDeviceSynchronize());
    const double back = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / n;
    std::printf("empty megakernel launch: %.2f us launched and synchronised, %.2f us back to back\n", synced, back);
  }
  return 0;
}
