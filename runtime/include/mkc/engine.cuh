// mkc runtime: loads a checkpoint for a generated program, owns the device
// memory of one model (weights, arena, KV caches and state, outputs), and
// runs decode steps with the megakernel. Generic over the generated model
// (generated/<model>_<target>/program.cuh); `model.cu` there instantiates it
// behind the C ABI of mkc/model.h.
//
// Every CUDA call is checked; every failure becomes a message naming what
// failed (the tensor, the call), returned through the C ABI, never an abort.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "mkc/checkpoint.h"
#include "mkc/fp8_layout.h"
#include "mkc/megakernel.cuh"
#include "mkc/plan_file.h"
#include "mkc/speculative.h"

namespace mkc {

struct Failure {
  std::string message;
};

inline void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw Failure{std::string(what) + ": " + cudaGetErrorString(e)};
}
#define MKC_CUDA(call) ::mkc::check_cuda((call), #call)

inline size_t dtype_bytes(const char* d) {
  const std::string s = d;
  if (s == "F32" || s == "I32") return 4;
  if (s == "BF16" || s == "F16") return 2;
  if (s == "I64") return 8;
  return 1;
}

inline float half_bits_to_float(uint16_t h, bool bf16) {
  if (bf16) {
    uint32_t u = uint32_t(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  const uint32_t sign = (h >> 15) & 1, exp = (h >> 10) & 31, man = h & 1023;
  float f;
  if (exp == 0) {
    f = std::ldexp(float(man), -24);
  } else if (exp == 31) {
    f = man ? NAN : INFINITY;
  } else {
    f = std::ldexp(float(man | 1024), int(exp) - 25);
  }
  return sign ? -f : f;
}

// P: the generated program's constants (see model.cu.j2): kModel, kTarget,
// kBatch, kPositions, kContext, kArenaBytes, ...; what grows with the model
// (schedule, tasks, stage parameters, weight table, states) is in its plan
// file.
template <class P>
class Engine {
 public:
  // A step's kBatch rows are kSequences sequences of kPositions rows each: a
  // speculative verify step's consecutive positions of one sequence (its last
  // accepted token, then drafts); one row a sequence in plain decoding. The
  // state (positions, KV caches) is the sequences'.
  static constexpr int kPositions = int(P::kPositions);
  static constexpr int kSequences = P::kBatch / kPositions;
  static_assert(kPositions >= 1 && P::kBatch % kPositions == 0, "whole sequences of positions");

  // The plan file is read and checked first, then the checkpoint against
  // its weight table, before any CUDA call: a wrong plan or checkpoint is
  // reported by name on any machine.
  Engine(const char* dir, const std::string& plan_path) {
    if (P::kRanks > 1) {
      throw Failure{std::string(P::kModel) + " is one GPU's program of " + std::to_string(P::kRanks) +
                    " (expert-parallel: each GPU holds 1/" + std::to_string(P::kRanks) +
                    " of the routed experts and exchanges its part of each MoE layer's output); this runtime "
                    "launches one GPU, not several yet"};
    }
    std::string why;
    if (!read_plan_file(plan_path, PlanIdentity{P::kModel, P::kTarget, uint32_t(P::kBatch), P::kContext}, &plan_, &why)) {
      throw Failure{why};
    }
    for (size_t s = 0; s < plan_.stages.size(); ++s) {
      if (plan_.stages[s].role >= P::kRoles) {
        throw Failure{"plan file " + plan_path + ": stage " + std::to_string(s) + " names role " +
                      std::to_string(plan_.stages[s].role) + "; this library has " + std::to_string(P::kRoles)};
      }
    }
    char err[4096];
    mkc_checkpoint* ck = nullptr;
    if (mkc_checkpoint_open(dir, &ck, err, sizeof err) != 0) throw Failure{err};
    std::vector<char> report(1 << 16);
    const int problems =
        mkc_checkpoint_check(ck, plan_.weights.data(), plan_.weights.size(), report.data(), report.size());
    if (problems != 0) {
      mkc_checkpoint_close(ck);
      throw Failure{std::string(dir) + " does not match the plan (" + std::to_string(problems) + " problems):\n" +
                    report.data()};
    }
    try {
      int device = 0, sms = 0;
      MKC_CUDA(cudaGetDevice(&device));
      MKC_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
      if (uint32_t(sms) < plan_.sms) {
        throw Failure{"this program was planned for " + std::to_string(plan_.sms) + " SMs; the GPU has " +
                      std::to_string(sms)};
      }
      upload(ck);
      mkc_checkpoint_close(ck);
      ck = nullptr;
      allocate();
    } catch (...) {
      if (ck != nullptr) mkc_checkpoint_close(ck);
      release();  // a failed open leaves nothing allocated
      throw;
    }
  }

  ~Engine() { release(); }

  // Forgets every sequence: positions back to 0 and every state zeroed (the
  // KDA conv windows and recurrent states start each sequence from zero; the
  // KV caches are zeroed too, though rows past a position are never read).
  void reset() {
    for (size_t s = 0; s < states_.size(); ++s) MKC_CUDA(cudaMemset(states_[s], 0, plan_.states[s] * kSequences));
    std::fill(pos_.begin(), pos_.end(), 0);
  }

  // One decode step for all kBatch sequences: tokens in, next tokens (and
  // logits, if asked) out.
  void step(const int32_t* tokens, int32_t* next, float* logits, bool debug) {
    if (kPositions > 1) {
      throw Failure{"this program is a verify step of " + std::to_string(kPositions) +
                    " positions a sequence: run it with mkc_model_verify"};
    }
    check_tokens(tokens);
    for (int b = 0; b < kSequences; ++b) {
      if (uint64_t(pos_[b]) >= P::kContext) {
        throw Failure{"sequence " + std::to_string(b) + " is full: the plan's context is " +
                      std::to_string(P::kContext) + " tokens"};
      }
    }
    launch(tokens, debug);
    MKC_CUDA(cudaMemcpy(next, outputs_[P::kNextTokenOutput], sizeof(int32_t) * P::kBatch, cudaMemcpyDeviceToHost));
    if (logits != nullptr) {
      MKC_CUDA(cudaMemcpy(logits, outputs_[P::kLogitsOutput], sizeof(float) * P::kBatch * P::kVocab,
                          cudaMemcpyDeviceToHost));
    }
    for (auto& p : pos_) ++p;
  }

  // A speculative verify step (kPositions > 1): tokens[sequence][position],
  // each sequence's last accepted token then kPositions - 1 drafts, at the
  // sequence's next positions. The greedy choice after each position decides
  // (accepted_drafts, mkc/speculative.h): accepted[sequence] drafts stand and
  // next[sequence] is the choice after the last of them; the sequence
  // advances by accepted + 1 positions, and the cache rows past them are
  // overwritten by later steps, never read. argmax[batch] (each row's greedy
  // choice) and logits[batch, vocab] if not NULL.
  void verify(const int32_t* tokens, int32_t* accepted, int32_t* next, int32_t* argmax, float* logits) {
    check_tokens(tokens);
    for (int s = 0; s < kSequences; ++s) {
      if (uint64_t(pos_[s]) + kPositions > P::kContext) {
        throw Failure{"verify: sequence " + std::to_string(s) + " holds " + std::to_string(pos_[s]) + " tokens; " +
                      std::to_string(kPositions) + " positions more exceed the plan's context of " +
                      std::to_string(P::kContext)};
      }
    }
    launch(tokens, false);
    std::vector<int32_t> kept(kSequences, 0);  // one position a sequence: no drafts
    if constexpr (kPositions > 1) commit(nullptr, kept.data());
    std::vector<int32_t> choice(P::kBatch);
    MKC_CUDA(cudaMemcpy(choice.data(), outputs_[P::kNextTokenOutput], sizeof(int32_t) * P::kBatch,
                        cudaMemcpyDeviceToHost));
    if (logits != nullptr) {
      MKC_CUDA(cudaMemcpy(logits, outputs_[P::kLogitsOutput], sizeof(float) * P::kBatch * P::kVocab,
                          cudaMemcpyDeviceToHost));
    }
    for (int s = 0; s < kSequences; ++s) {
      const uint32_t a = accepted_drafts(tokens + s * kPositions, choice.data() + s * kPositions, kPositions);
      if (int32_t(a) != kept[s]) {
        throw Failure{"verify: sequence " + std::to_string(s) + ": the device kept " + std::to_string(kept[s]) +
                      " drafts of the step, the step's choices accept " + std::to_string(a)};
      }
      accepted[s] = int32_t(a);
      next[s] = choice[s * kPositions + a];
      pos_[s] += int32_t(a) + 1;
    }
    if (argmax != nullptr) std::memcpy(argmax, choice.data(), sizeof(int32_t) * P::kBatch);
  }

  int32_t position(int b) const { return pos_[b]; }

  // One step with per-instruction timestamps, written to `path` as Chrome
  // trace JSON (chrome://tracing, Perfetto): a row per SM, an event per
  // instruction named by its stage, from when it runs (its waits done and the
  // SM's previous instruction ended) to its end; args.ready is when its waits
  // were done, and where its consumers waited for weight pages (ProfileMark,
  // projection.cuh) args.pages counts them and args.staged, args.first_page,
  // args.streamed and args.epilogue split its time: its start to its first
  // page wait (input staging, prologue), that wait, to its last page's
  // release, and from there to its end (microseconds). A verify program's
  // step runs at the current positions, which it does not advance (its
  // commit is not run).
  void profile_step(const int32_t* tokens, int32_t* next, const char* path) {
    const size_t n_ins = plan_.instructions.size(), marks = kProfileMarks;
    uint64_t* d = device_alloc<uint64_t>(sizeof(uint64_t) * marks * n_ins);
    MKC_CUDA(cudaMemset(d, 0, sizeof(uint64_t) * marks * n_ins));
    schedule_.profile = d;
    try {
      if constexpr (kPositions > 1) {  // a verify step at the current positions (not advanced)
        launch(tokens, false);
        MKC_CUDA(cudaMemcpy(next, outputs_[P::kNextTokenOutput], sizeof(int32_t) * P::kBatch,
                            cudaMemcpyDeviceToHost));
      } else {
        step(tokens, next, nullptr, false);
      }
    } catch (...) {
      schedule_.profile = nullptr;
      throw;
    }
    schedule_.profile = nullptr;
    std::vector<uint64_t> t(marks * n_ins);
    MKC_CUDA(cudaMemcpy(t.data(), d, sizeof(uint64_t) * t.size(), cudaMemcpyDeviceToHost));
    auto mark = [&](size_t i, ProfileMark m) { return t[marks * i + m]; };
    uint64_t t0 = UINT64_MAX;
    for (size_t i = 0; i < n_ins; ++i) t0 = std::min(t0, mark(i, kMarkReady));
    FILE* f = std::fopen(path, "w");
    if (f == nullptr) throw Failure{std::string("cannot write the trace ") + path};
    std::fprintf(f, "{\"traceEvents\": [\n");
    bool first = true;
    auto us = [](uint64_t from, uint64_t to) { return to > from ? double(to - from) / 1e3 : 0.0; };
    for (uint32_t sm = 0; sm < plan_.sms; ++sm) {
      uint64_t prev_end = 0;
      for (uint32_t i = plan_.sm_begin[sm]; i < plan_.sm_begin[sm + 1]; ++i) {
        const uint32_t task = plan_.instructions[i].task;
        const uint64_t ready = mark(i, kMarkReady), end = mark(i, kMarkEnd);
        // Runs from the later of its waits done and the previous instruction's end.
        const uint64_t begin = std::max(ready, prev_end);
        prev_end = end;
        std::fprintf(f, "%s{\"name\": \"%s\", \"ph\": \"X\", \"ts\": %.3f, \"dur\": %.3f, \"pid\": 0, \"tid\": %u, "
                     "\"args\": {\"task\": %u, \"instruction\": %u, \"ready\": %.3f",
                     first ? "" : ",\n", plan_.stage_names[plan_.tasks[task].stage].c_str(), us(t0, begin),
                     us(begin, end), sm, task, i, us(t0, ready));
        if (const uint64_t pages = mark(i, kMarkPages); pages > 0) {
          const uint64_t wait = mark(i, kMarkFirstWait), page = mark(i, kMarkFirstPage),
                         last = mark(i, kMarkLastRelease);
          std::fprintf(f, ", \"pages\": %llu, \"staged\": %.3f, \"first_page\": %.3f, \"streamed\": %.3f, "
                       "\"epilogue\": %.3f",
                       static_cast<unsigned long long>(pages), us(begin, wait), us(wait, page), us(page, last),
                       us(last, end));
        }
        std::fprintf(f, "}}");
        first = false;
      }
    }
    std::fprintf(f, "\n], \"displayTimeUnit\": \"ns\"}\n");
    const bool ok = std::fclose(f) == 0;
    if (!ok) throw Failure{std::string("cannot write the trace ") + path};
  }

  // Greedy generation with speculation (a verify program) in one launch
  // (device/mkc/megakernel.cuh, speculate_kernel): history[sequence][len] is
  // each sequence's tokens so far, the last not yet decoded (its state holds
  // the ones before it); each step verifies every sequence's last token and
  // its drafts, prompt lookup over the sequence's history and what it has
  // generated (ngram_draft: n-grams of 1 to 3 tokens, up to kPositions - 1
  // drafts, the token 0 where none recurs). Writes out[sequence][n], the same
  // tokens as n mkc_model_step calls, and returns the verify steps taken. A
  // sequence that has its n tokens keeps stepping with the others without
  // advancing, so every sequence ends n positions on, as n single steps
  // leave it.
  uint32_t generate_speculative(const int32_t* history, uint32_t len, uint32_t n, int32_t* out) {
    if (kPositions == 1) {
      throw Failure{"generate_speculative: this program takes one position a sequence (mkc codegen --positions "
                    "for a verify step)"};
    }
    if (n == 0 || len == 0) throw Failure{"generate_speculative: n and the history's length must be at least 1"};
    for (int s = 0; s < kSequences; ++s) {
      check_tokens(history + size_t(s) * len, len, "generate_speculative's history entry");
      if (uint64_t(pos_[s]) + n + kPositions > P::kContext) {
        throw Failure{"generate_speculative: sequence " + std::to_string(s) + " holds " + std::to_string(pos_[s]) +
                      " tokens; " + std::to_string(n) + " more (and " + std::to_string(kPositions) +
                      " positions of a verify step) exceed the plan's context of " + std::to_string(P::kContext)};
      }
    }
    if constexpr (kPositions > 1) {
      // Grown to the longest generation asked for, as generate's output: the histories [sequences][cap],
      // then length, done and keep [sequences] each; the output [sequences][n].
      const uint32_t cap = len + n;
      int32_t* d_history = grown(spec_buf_, spec_buf_ints_, (size_t(cap) + 3) * kSequences);
      uint32_t* d_counts = reinterpret_cast<uint32_t*>(d_history + size_t(cap) * kSequences);
      int32_t* d_out = grown(gen_out_, gen_out_ints_, size_t(n) * kSequences);
      // The first step's rows: each sequence's last token and its drafts, at its next positions.
      std::vector<int32_t> rows(P::kBatch);
      for (int s = 0; s < kSequences; ++s) {
        const int32_t* h = history + size_t(s) * len;
        int32_t* row = rows.data() + s * kPositions;
        row[0] = h[len - 1];
        const uint32_t got = ngram_draft(h, len, 1, 3, kPositions - 1, row + 1);
        std::fill(row + 1 + got, row + kPositions, 0);
      }
      std::vector<uint32_t> counts(3 * kSequences, 0);
      for (int s = 0; s < kSequences; ++s) counts[s] = len;
      for (int s = 0; s < kSequences; ++s) {
        MKC_CUDA(cudaMemcpy(d_history + size_t(s) * cap, history + size_t(s) * len, sizeof(int32_t) * len,
                            cudaMemcpyHostToDevice));
      }
      MKC_CUDA(cudaMemcpy(d_counts, counts.data(), sizeof(uint32_t) * counts.size(), cudaMemcpyHostToDevice));
      MKC_CUDA(cudaMemcpy(d_tokens_, rows.data(), sizeof(int32_t) * P::kBatch, cudaMemcpyHostToDevice));
      upload_positions();
      MKC_CUDA(cudaMemset(gen_ctl_, 0, sizeof(GenerateControl)));
      Speculate g{d_tokens_, d_pos_, static_cast<const int32_t*>(outputs_[P::kNextTokenOutput]), d_history,
                  d_counts, d_counts + kSequences, d_counts + 2 * kSequences, d_out, gen_ctl_, cap, n};
      uint32_t step0 = step_ + 1;
      void* args[] = {&schedule_, &memory_, &step0, &g};
      MKC_CUDA(cudaLaunchCooperativeKernel(speculate_fn(), dim3(plan_.sms), dim3(kThreads), args, kSmemBytes, 0));
      const cudaError_t e = cudaDeviceSynchronize();
      if (e != cudaSuccess) {
        throw Failure{std::string("the speculative generation megakernel failed: ") + cudaGetErrorString(e)};
      }
      GenerateControl ctl{};
      MKC_CUDA(cudaMemcpy(&ctl, gen_ctl_, sizeof ctl, cudaMemcpyDeviceToHost));
      MKC_CUDA(cudaMemcpy(counts.data(), d_counts, sizeof(uint32_t) * counts.size(), cudaMemcpyDeviceToHost));
      for (int s = 0; s < kSequences; ++s) {
        if (ctl.done != 1 || ctl.steps == 0 || ctl.steps > n || counts[kSequences + s] != n) {
          throw Failure{"the speculative generation megakernel reported " + std::to_string(ctl.steps) +
                        " steps (done " + std::to_string(ctl.done) + ") and " +
                        std::to_string(counts[kSequences + s]) + " of " + std::to_string(n) + " tokens for sequence " +
                        std::to_string(s)};
        }
      }
      MKC_CUDA(cudaMemcpy(out, d_out, sizeof(int32_t) * size_t(n) * kSequences, cudaMemcpyDeviceToHost));
      step_ += ctl.steps;
      for (auto& p : pos_) p += int32_t(n);
      return ctl.steps;
    }
    return 0;
  }

  // Greedy generation in one launch (device/mkc/megakernel.cuh,
  // generate_kernel): tokens[batch] are the first step's tokens; each step's
  // next tokens are the following step's, positions advance on the device.
  // Stops after `n` steps or once every sequence has produced `stop` (-1:
  // never); sequences that stopped earlier go on decoding with the others
  // (their state holds every token fed; `length` says where each stopped).
  // Writes out[steps][batch] and length[batch] (the step, from 1, at which
  // the sequence produced `stop`, or 0) and returns the steps run.
  uint32_t generate(const int32_t* tokens, uint32_t n, int32_t stop, int32_t* out, int32_t* length) {
    if (kPositions > 1) {
      throw Failure{"generate: this program is a verify step of " + std::to_string(kPositions) +
                    " positions a sequence: generate with mkc_model_generate_speculative (drafts by prompt lookup, "
                    "in one launch) or mkc_model_verify (drafts of your own, a step at a time)"};
    }
    if (n == 0) throw Failure{"generate: n must be at least 1"};
    if (stop < -1 || (stop >= 0 && uint64_t(stop) >= P::kVocab)) {
      throw Failure{"generate: the stop token " + std::to_string(stop) + " is outside the vocabulary (" +
                    std::to_string(P::kVocab) + "; -1 for none)"};
    }
    check_tokens(tokens);
    for (int b = 0; b < P::kBatch; ++b) {
      if (uint64_t(pos_[b]) + n > P::kContext) {
        throw Failure{"generate: sequence " + std::to_string(b) + " holds " + std::to_string(pos_[b]) + " tokens; " +
                      std::to_string(n) + " more exceed the plan's context of " + std::to_string(P::kContext)};
      }
    }
    grown(gen_out_, gen_out_ints_, size_t(n) * P::kBatch);  // grows to the longest generation asked for
    MKC_CUDA(cudaMemcpy(d_tokens_, tokens, sizeof(int32_t) * P::kBatch, cudaMemcpyHostToDevice));
    MKC_CUDA(cudaMemcpy(d_pos_, pos_.data(), sizeof(int32_t) * P::kBatch, cudaMemcpyHostToDevice));
    MKC_CUDA(cudaMemset(gen_length_, 0, sizeof(int32_t) * P::kBatch));
    MKC_CUDA(cudaMemset(gen_ctl_, 0, sizeof(GenerateControl)));
    Generate g{d_tokens_, d_pos_, static_cast<const int32_t*>(outputs_[P::kNextTokenOutput]), gen_out_, gen_length_,
               gen_ctl_, uint32_t(P::kBatch), n, stop};
    uint32_t step0 = step_ + 1;
    void* args[] = {&schedule_, &memory_, &step0, &g};
    MKC_CUDA(cudaLaunchCooperativeKernel(generate_fn(), dim3(plan_.sms), dim3(kThreads), args, kSmemBytes, 0));
    const cudaError_t e = cudaDeviceSynchronize();
    if (e != cudaSuccess) throw Failure{std::string("the generation megakernel failed: ") + cudaGetErrorString(e)};
    GenerateControl ctl{};
    MKC_CUDA(cudaMemcpy(&ctl, gen_ctl_, sizeof ctl, cudaMemcpyDeviceToHost));
    if (ctl.steps == 0 || ctl.steps > n || ctl.done != 1) {
      throw Failure{"the generation megakernel reported " + std::to_string(ctl.steps) + " steps of " +
                    std::to_string(n) + " (done " + std::to_string(ctl.done) + ")"};
    }
    MKC_CUDA(cudaMemcpy(out, gen_out_, sizeof(int32_t) * size_t(ctl.steps) * P::kBatch, cudaMemcpyDeviceToHost));
    MKC_CUDA(cudaMemcpy(length, gen_length_, sizeof(int32_t) * P::kBatch, cudaMemcpyDeviceToHost));
    step_ += ctl.steps;
    for (auto& p : pos_) p += int32_t(ctl.steps);
    return ctl.steps;
  }

  // Benchmark: `n` steps back to back at the current positions (each step
  // rewrites the same cache row; positions do not advance), timed with CUDA
  // events after `warmup` untimed steps; a verify program's steps each with
  // their commit. Returns milliseconds per step.
  float time_steps(const int32_t* tokens, int warmup, int n) {
    MKC_CUDA(cudaMemcpy(d_tokens_, tokens, sizeof(int32_t) * P::kBatch, cudaMemcpyHostToDevice));
    upload_positions();
    cudaEvent_t start, stop;
    MKC_CUDA(cudaEventCreate(&start));
    MKC_CUDA(cudaEventCreate(&stop));
    for (int i = 0; i < warmup + n; ++i) {
      if (i == warmup) MKC_CUDA(cudaEventRecord(start));
      ++step_;
      void* args[] = {&schedule_, &memory_, &step_};
      MKC_CUDA(cudaLaunchCooperativeKernel(kernel<false>(), dim3(plan_.sms), dim3(kThreads), args, kSmemBytes, 0));
      if constexpr (kPositions > 1) {  // a verify step: its commit too
        commit_kernel<typename P::Step, kPositions, kSequences><<<plan_.sms, kConsumerThreads>>>(
            schedule_, memory_, static_cast<const int32_t*>(outputs_[P::kNextTokenOutput]), nullptr, d_accepted_);
      }
    }
    MKC_CUDA(cudaEventRecord(stop));
    MKC_CUDA(cudaEventSynchronize(stop));
    MKC_CUDA(cudaGetLastError());
    float ms = 0.f;
    MKC_CUDA(cudaEventElapsedTime(&ms, start, stop));
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    return ms / float(n);
  }

  // The routing log of the last step (program.cuh: kRouteLog).
  void routing(int32_t* out, size_t n) const {
    if (n != P::kRouteLogInts) {
      throw Failure{"the routing buffer has " + std::to_string(n) + " ids; this model's routers log " +
                    std::to_string(P::kRouteLogInts)};
    }
    MKC_CUDA(cudaMemcpy(out, memory_.arena + P::kRouteLog, n * sizeof(int32_t), cudaMemcpyDeviceToHost));
  }

  // The per-sequence state (KV caches and recurrent state) with the
  // positions, as bytes: what a restart needs.
  size_t state_size() const {
    size_t need = sizeof(int32_t) * kSequences;
    for (uint64_t bytes : plan_.states) need += bytes * kSequences;
    return need;
  }

  void save(char* out, size_t len) const {
    if (len != state_size()) {
      throw Failure{"the state buffer has " + std::to_string(len) + " bytes; this model's state has " +
                    std::to_string(state_size())};
    }
    std::memcpy(out, pos_.data(), sizeof(int32_t) * kSequences);
    size_t at = sizeof(int32_t) * kSequences;
    for (size_t s = 0; s < states_.size(); ++s) {
      const size_t n = plan_.states[s] * kSequences;
      MKC_CUDA(cudaMemcpy(out + at, states_[s], n, cudaMemcpyDeviceToHost));
      at += n;
    }
  }

  void restore(const char* data, size_t len) {
    const size_t need = state_size();
    if (len != need) {
      throw Failure{"saved state has " + std::to_string(len) + " bytes; this model's state has " + std::to_string(need)};
    }
    std::memcpy(pos_.data(), data, sizeof(int32_t) * kSequences);
    size_t at = sizeof(int32_t) * kSequences;
    for (size_t s = 0; s < states_.size(); ++s) {
      const size_t n = plan_.states[s] * kSequences;
      MKC_CUDA(cudaMemcpy(states_[s], data + at, n, cudaMemcpyHostToDevice));
      at += n;
    }
  }

 private:
  // Each row's position into the step's positions: its sequence's next position, plus the row's place in
  // the sequence's verify positions.
  void upload_positions() {
    int32_t rows[P::kBatch];
    for (int b = 0; b < P::kBatch; ++b) rows[b] = pos_[b / kPositions] + b % kPositions;
    MKC_CUDA(cudaMemcpy(d_pos_, rows, sizeof(int32_t) * P::kBatch, cudaMemcpyHostToDevice));
  }

  // One launch of the step kernel over the current positions (not advanced here).
  void launch(const int32_t* tokens, bool debug) {
    MKC_CUDA(cudaMemcpy(d_tokens_, tokens, sizeof(int32_t) * P::kBatch, cudaMemcpyHostToDevice));
    upload_positions();
    ++step_;
    void* args[] = {&schedule_, &memory_, &step_};
    const void* fn = debug ? kernel<true>() : kernel<false>();
    MKC_CUDA(cudaLaunchCooperativeKernel(fn, dim3(plan_.sms), dim3(kThreads), args, kSmemBytes, 0));
    const cudaError_t e = cudaDeviceSynchronize();
    if (e != cudaSuccess) {
      std::string msg = std::string("the megakernel failed: ") + cudaGetErrorString(e);
      if (report_->valid) {
        msg += "; hang report: SM " + std::to_string(report_->sm) + ", instruction " +
               std::to_string(report_->instruction) + ", counter " + std::to_string(report_->counter) +
               ", expected " + std::to_string(report_->expected) + ", seen " + std::to_string(report_->seen);
      }
      throw Failure{msg};
    }
  }

  // After a verify step: the state it read and left as it was (KDA's
  // recurrent state, the conv windows) stepped through the positions each
  // sequence keeps (commit_kernel, megakernel.cuh), at most limit[sequence]
  // if given (host memory); the drafts it accepted, by the device's
  // reckoning, into accepted[sequences].
  void commit(const uint32_t* limit, int32_t* accepted) requires(kPositions > 1) {
    const auto* choice = static_cast<const int32_t*>(outputs_[P::kNextTokenOutput]);
    if (limit != nullptr) MKC_CUDA(cudaMemcpy(d_limit_, limit, sizeof(uint32_t) * kSequences, cudaMemcpyHostToDevice));
    commit_kernel<typename P::Step, kPositions, kSequences><<<plan_.sms, kConsumerThreads>>>(
        schedule_, memory_, choice, limit != nullptr ? d_limit_ : nullptr, d_accepted_);
    MKC_CUDA(cudaGetLastError());
    const cudaError_t e = cudaDeviceSynchronize();
    if (e != cudaSuccess) throw Failure{std::string("the verify step's commit failed: ") + cudaGetErrorString(e)};
    MKC_CUDA(cudaMemcpy(accepted, d_accepted_, sizeof(int32_t) * kSequences, cudaMemcpyDeviceToHost));
  }

  void release() {
    for (void* p : owned_) cudaFree(p);
    owned_.clear();
    if (report_ != nullptr) cudaFreeHost(report_);
    report_ = nullptr;
  }

  // The dynamic shared memory (ring, scratch, activations) granted to `fn`
  // (grant_shared_memory: its static shared memory checked against the
  // planner's budget first).
  static void allow_shared_memory(const void* fn, const char* what) {
    if (std::string e = grant_shared_memory(fn, what); !e.empty()) throw Failure{e};
  }
  template <bool kDebug>
  static const void* kernel() {
    return reinterpret_cast<const void*>(&megakernel<typename P::Step, kDebug>);
  }

  // Every sequence's token inside the vocabulary (step and generate).
  // Every token of tokens[0..n) inside the vocabulary; a failure names the
  // token and its place (`place` i: a step's sequence, a history's entry).
  static void check_tokens(const int32_t* tokens, size_t n = P::kBatch, const char* place = "sequence") {
    for (size_t i = 0; i < n; ++i) {
      if (tokens[i] < 0 || uint64_t(tokens[i]) >= P::kVocab) {
        throw Failure{"token " + std::to_string(tokens[i]) + " of " + place + " " + std::to_string(i) +
                      " is outside the vocabulary (" + std::to_string(P::kVocab) + ")"};
      }
    }
  }

  static const void* generate_fn() { return reinterpret_cast<const void*>(&generate_kernel<typename P::Step>); }
  static const void* speculate_fn() requires(kPositions > 1) {
    return reinterpret_cast<const void*>(&speculate_kernel<typename P::Step, kPositions, kSequences>);
  }

  template <class T>
  T* device_alloc(size_t bytes) {
    void* p = nullptr;
    MKC_CUDA(cudaMalloc(&p, bytes == 0 ? 16 : bytes));
    owned_.push_back(p);
    return static_cast<T*>(p);
  }

  // `buf` (of device_alloc) holding at least `need` elements: replaced by a
  // larger one when it holds fewer (its contents not kept), never shrunk.
  template <class T>
  T* grown(T*& buf, size_t& count, size_t need) {
    if (count < need) {
      if (buf != nullptr) {
        owned_.erase(std::find(owned_.begin(), owned_.end(), static_cast<void*>(buf)));
        MKC_CUDA(cudaFree(buf));
        buf = nullptr;
        count = 0;
      }
      buf = device_alloc<T>(sizeof(T) * need);
      count = need;
    }
    return buf;
  }

  void upload(mkc_checkpoint* ck) {
    std::vector<char> host, wide, scales;  // scales: the next tensor's bytes, read with its MXFP4 codes
    std::vector<uint8_t> tiled;
    char err[1024];
    const size_t n_weights = plan_.weights.size();
    weights_.resize(n_weights);
    for (size_t i = 0; i < n_weights; ++i) {
      const mkc_tensor_spec& s = plan_.weights[i];
      uint64_t n = 1;
      for (uint32_t d = 0; d < s.ndim; ++d) n *= s.shape[d];
      const char* stored = mkc_checkpoint_dtype(ck, s.key);
      const size_t bytes = n * dtype_bytes(stored);
      const WeightLayout layout = plan_.layouts[i];
      if (layout == WeightLayout::kMxScales && scales.size() == bytes) {
        host.swap(scales);  // read already, with its codes
      } else {
        host.resize(bytes);
        if (mkc_checkpoint_read(ck, s.key, host.data(), host.size(), err, sizeof err) < 0) throw Failure{err};
      }
      scales.clear();
      const char* src = host.data();
      size_t up = bytes;
      if (std::strcmp(s.dtype, stored) != 0) {  // an f32 tensor stored as bf16 or f16: widened exactly
        wide.resize(n * 4);
        const bool is_bf16 = std::strcmp(stored, "BF16") == 0;
        for (uint64_t e = 0; e < n; ++e) {
          uint16_t h;
          std::memcpy(&h, host.data() + 2 * e, 2);
          const float f = half_bits_to_float(h, is_bf16);
          std::memcpy(wide.data() + 4 * e, &f, 4);
        }
        src = wide.data();
        up = n * 4;
      }
      if (layout == WeightLayout::kFp8Bf16) {  // FP8 codes read by the device as bf16 (mkc/fp8_layout.h)
        const uint64_t k = s.ndim == 0 ? 0 : s.shape[s.ndim - 1], rows = k == 0 ? 0 : n / k;
        if (std::strcmp(stored, "F8_E4M3") != 0 || i + 1 >= n_weights) {
          throw Failure{std::string("FP8 weights ") + s.key + ": stored as " + stored +
                        (i + 1 >= n_weights ? "; the weights table lists no scales after them" : "; F8_E4M3 expected")};
        }
        const char* scale_key = plan_.weights[i + 1].key;
        std::vector<float> block_scales(fp8_scale_count(rows, k));
        const int64_t got = mkc_checkpoint_read(ck, scale_key, block_scales.data(), block_scales.size() * 4, err, sizeof err);
        if (got < 0) throw Failure{err};
        if (uint64_t(got) != block_scales.size() * 4) {
          throw Failure{std::string("FP8 scales ") + scale_key + ": " + std::to_string(got) + " bytes, where the codes " +
                        s.key + " [" + std::to_string(rows) + ", " + std::to_string(k) + "] need " +
                        std::to_string(block_scales.size() * 4)};
        }
        wide.resize(n * 2);
        fp8_dequant_bf16(reinterpret_cast<const uint8_t*>(host.data()), block_scales.data(), rows, k,
                         reinterpret_cast<uint16_t*>(wide.data()));
        src = wide.data();
        up = n * 2;
      } else if (layout != WeightLayout::kAsStored) {  // MXFP4 codes or scales, tiled (mkc/mx_layout.h)
        const uint64_t width = s.shape[s.ndim - 1], rows = width == 0 ? 0 : n / width;
        const bool codes = layout == WeightLayout::kMxCodes;
        const uint64_t k = width * (codes ? 2 : kMxBlock);
        if (k % kMxBlock != 0 || std::strcmp(stored, "U8") != 0) {
          throw Failure{std::string("MXFP4 ") + (codes ? "codes " : "scales ") + s.key + ": stored as " + stored +
                        " [.., " + std::to_string(width) + "]; the tiled layout needs U8 rows of k / " +
                        (codes ? "2" : "32") + " bytes with k a multiple of 32"};
        }
        // e8m0's NaN (255) reads as 0: such blocks' codes zeroed and scale bytes set to 0. The
        // weights table lists an MXFP4 matrix's scales right after its codes.
        auto* bytes = reinterpret_cast<uint8_t*>(host.data());
        if (codes) {
          if (i + 1 >= n_weights || plan_.layouts[i + 1] != WeightLayout::kMxScales) {
            throw Failure{std::string("MXFP4 codes ") + s.key + ": the weights table lists no scales after them"};
          }
          const char* scale_key = plan_.weights[i + 1].key;
          scales.resize(rows * (k / kMxBlock));
          const int64_t got = mkc_checkpoint_read(ck, scale_key, scales.data(), scales.size(), err, sizeof err);
          if (got < 0) throw Failure{err};
          if (uint64_t(got) != scales.size()) {
            throw Failure{std::string("MXFP4 scales ") + scale_key + ": " + std::to_string(got) + " bytes, where the codes " +
                          s.key + " [" + std::to_string(rows) + ", " + std::to_string(width) + "] need " +
                          std::to_string(scales.size())};
          }
          mx_clear_nan_blocks(reinterpret_cast<const uint8_t*>(scales.data()), rows, k, bytes, nullptr);
        } else {
          mx_clear_nan_blocks(bytes, rows, k, nullptr, bytes);
        }
        tiled.resize(codes ? mx_code_bytes(rows, k) : mx_scale_bytes(rows, k));
        if (codes) mx_tile_codes(reinterpret_cast<const uint8_t*>(src), rows, k, tiled.data());
        else mx_tile_scales(reinterpret_cast<const uint8_t*>(src), rows, k, tiled.data());
        src = reinterpret_cast<const char*>(tiled.data());
        up = tiled.size();
      }
      weights_[i] = device_alloc<char>(up);
      try {
        MKC_CUDA(cudaMemcpy(weights_[i], src, up, cudaMemcpyHostToDevice));
      } catch (Failure& f) {
        f.message = std::string("uploading ") + s.key + ": " + f.message;
        throw;
      }
    }
  }

  void allocate() {
    void** w = device_alloc<void*>(sizeof(void*) * weights_.size());
    MKC_CUDA(cudaMemcpy(w, weights_.data(), sizeof(void*) * weights_.size(), cudaMemcpyHostToDevice));
    char* arena = device_alloc<char>(P::kArenaBytes);
    MKC_CUDA(cudaMemset(arena, 0, P::kArenaBytes));
    for (uint64_t bytes : plan_.states) {  // a state a sequence
      states_.push_back(device_alloc<char>(bytes * kSequences));
      MKC_CUDA(cudaMemset(states_.back(), 0, bytes * kSequences));
    }
    void** st = device_alloc<void*>(sizeof(void*) * (states_.size() + 1));
    if (!states_.empty()) {
      MKC_CUDA(cudaMemcpy(st, states_.data(), sizeof(void*) * states_.size(), cudaMemcpyHostToDevice));
    }
    for (uint32_t o = 0; o < P::kOutputs; ++o) outputs_.push_back(device_alloc<char>(P::output_bytes[o] * P::kBatch));
    void** out = device_alloc<void*>(sizeof(void*) * P::kOutputs);
    MKC_CUDA(cudaMemcpy(out, outputs_.data(), sizeof(void*) * P::kOutputs, cudaMemcpyHostToDevice));
    // [2][batch] each: a step reads the first half; a generation alternates (generate_kernel).
    d_tokens_ = device_alloc<int32_t>(sizeof(int32_t) * 2 * P::kBatch);
    d_pos_ = device_alloc<int32_t>(sizeof(int32_t) * 2 * P::kBatch);
    gen_length_ = device_alloc<int32_t>(sizeof(int32_t) * P::kBatch);
    d_accepted_ = device_alloc<int32_t>(sizeof(int32_t) * kSequences);
    d_limit_ = device_alloc<uint32_t>(sizeof(uint32_t) * kSequences);
    gen_ctl_ = device_alloc<GenerateControl>(sizeof(GenerateControl));
    float* staging = device_alloc<float>(sizeof(float) * P::kStagingFloats * plan_.sms);
    const TaskArgs* tasks = device_copy(plan_.tasks.data(), plan_.tasks.size());
    const StageRecord* stages = device_copy(plan_.stages.data(), plan_.stages.size());
    // One zero past the end: a kind without parameters reads a (dummy) field there.
    std::vector<uint64_t> params = plan_.params;
    params.push_back(0);
    const uint64_t* param_table = device_copy(params.data(), params.size());
    memory_ = Memory{w, arena, st, out, d_tokens_, d_pos_, staging, tasks, stages, param_table};

    schedule_.instructions = device_copy(plan_.instructions.data(), plan_.instructions.size());
    schedule_.sm_begin = device_copy(plan_.sm_begin.data(), plan_.sm_begin.size());
    schedule_.waits = device_copy(plan_.waits.data(), plan_.waits.size());
    schedule_.counters = device_alloc<uint32_t>(sizeof(uint32_t) * plan_.counters.size());
    MKC_CUDA(cudaMemset(schedule_.counters, 0, sizeof(uint32_t) * plan_.counters.size()));
    MKC_CUDA(cudaHostAlloc(&report_, sizeof(HangReport), cudaHostAllocMapped));
    std::memset(report_, 0, sizeof(HangReport));
    MKC_CUDA(cudaHostGetDevicePointer(&schedule_.report, report_, 0));
    pos_.assign(kSequences, 0);
    allow_shared_memory(kernel<false>(), "the step kernel");
    allow_shared_memory(kernel<true>(), "the traced step kernel");
    allow_shared_memory(generate_fn(), "the generation kernel");
    if constexpr (kPositions > 1) allow_shared_memory(speculate_fn(), "the speculative generation kernel");
  }

  template <class T>
  const T* device_copy(const T* src, size_t n) {
    T* d = device_alloc<T>(sizeof(T) * n);
    MKC_CUDA(cudaMemcpy(d, src, sizeof(T) * n, cudaMemcpyHostToDevice));
    return d;
  }

  PlanFile plan_;
  std::vector<void*> owned_;
  std::vector<void*> weights_;
  std::vector<void*> states_;
  std::vector<void*> outputs_;
  int32_t* d_tokens_ = nullptr;
  int32_t* d_pos_ = nullptr;
  int32_t* gen_out_ = nullptr;  // a generation's output: [steps][batch] (generate), [sequences][n] (speculative)
  size_t gen_out_ints_ = 0;
  int32_t* spec_buf_ = nullptr;  // generate_speculative's histories and counts
  size_t spec_buf_ints_ = 0;
  int32_t* gen_length_ = nullptr;
  GenerateControl* gen_ctl_ = nullptr;
  int32_t* d_accepted_ = nullptr;  // [sequences]: a verify step's accepted drafts (commit)
  uint32_t* d_limit_ = nullptr;    // [sequences]: the positions a commit may keep at most
  Memory memory_{};
  Schedule schedule_{};
  HangReport* report_ = nullptr;
  std::vector<int32_t> pos_;
  uint32_t step_ = 0;
};

}  // namespace mkc
