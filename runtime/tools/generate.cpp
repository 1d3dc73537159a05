// mkc generate: greedy decoding with a compiled model (the C ABI of
// mkc/model.h). The prompt is fed through the decode path one token per
// step (mkc_model_step); the generated tokens then come from one launch
// (mkc_model_generate), or step by step with --debug (the debug kernel).
// Every sequence of the batch gets the same prompt.
//
//   <model>_generate CHECKPOINT_DIR [--prompt 1,2,3] [--tokens 32] [--stop ID] [--debug]
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "mkc/model.h"

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s CHECKPOINT_DIR [--prompt 1,2,3] [--tokens N] [--stop ID] [--debug]\n", argv[0]);
    return 2;
  }
  std::vector<int32_t> prompt{0};
  int tokens = 32, debug = 0;
  int32_t stop = -1;
  for (int i = 2; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--prompt" && i + 1 < argc) {
      prompt.clear();
      for (const char* p = argv[++i]; *p;) {
        char* end = nullptr;
        prompt.push_back(int32_t(std::strtol(p, &end, 10)));
        if (end == p) {
          std::fprintf(stderr, "error: --prompt takes comma-separated token ids, found \"%s\"\n", argv[i]);
          return 2;
        }
        p = *end == ',' ? end + 1 : end;
      }
    } else if (a == "--tokens" && i + 1 < argc) {
      tokens = std::atoi(argv[++i]);
      if (tokens < 1) {
        std::fprintf(stderr, "error: --tokens takes a count of at least 1, found \"%s\"\n", argv[i]);
        return 2;
      }
    } else if (a == "--stop" && i + 1 < argc) {
      stop = int32_t(std::atoi(argv[++i]));
    } else if (a == "--debug") {
      debug = 1;
    } else {
      std::fprintf(stderr, "error: unknown argument %s\n", a.c_str());
      return 2;
    }
  }
  if (prompt.empty()) {
    std::fprintf(stderr, "error: --prompt needs at least one token id\n");
    return 2;
  }
  char err[8192];
  mkc_model* m = nullptr;
  if (mkc_model_open(argv[1], &m, err, sizeof err) != 0) {
    std::fprintf(stderr, "error: %s\n", err);
    return 1;
  }
  mkc_model_info info;
  mkc_model_get_info(m, &info);
  std::vector<int32_t> in(info.batch), next(info.batch);
  std::vector<std::vector<int32_t>> out(info.batch);
  int status = 0;
  const auto t0 = std::chrono::steady_clock::now();
  int steps = 0;
  // The prompt but its last token, step by step; then the generation.
  for (size_t t = 0; t + 1 < prompt.size() && status == 0; ++t, ++steps) {
    for (uint32_t b = 0; b < info.batch; ++b) in[b] = prompt[t];
    if (mkc_model_step(m, in.data(), next.data(), nullptr, debug, err, sizeof err) != 0) {
      std::fprintf(stderr, "error: step %zu: %s\n", t, err);
      status = 1;
    }
  }
  for (uint32_t b = 0; b < info.batch; ++b) in[b] = prompt.back();
  if (status == 0 && debug == 0) {
    std::vector<int32_t> gen(size_t(tokens) * info.batch), length(info.batch);
    uint32_t n = 0;
    if (mkc_model_generate(m, in.data(), uint32_t(tokens), stop, gen.data(), length.data(), &n, err, sizeof err) != 0) {
      std::fprintf(stderr, "error: generate: %s\n", err);
      status = 1;
    }
    for (uint32_t t = 0; t < n; ++t) {
      for (uint32_t b = 0; b < info.batch; ++b) {
        if (length[b] == 0 || t < uint32_t(length[b])) out[b].push_back(gen[size_t(t) * info.batch + b]);
      }
    }
    steps += int(n);
  } else if (status == 0) {
    std::vector<bool> stopped(info.batch, false);
    for (int t = 0; t < tokens; ++t, ++steps) {
      if (mkc_model_step(m, in.data(), next.data(), nullptr, debug, err, sizeof err) != 0) {
        std::fprintf(stderr, "error: step %d: %s\n", steps, err);
        status = 1;
        break;
      }
      bool all = true;
      for (uint32_t b = 0; b < info.batch; ++b) {
        if (!stopped[b]) out[b].push_back(next[b]);
        stopped[b] = stopped[b] || next[b] == stop;
        all = all && stopped[b];
        in[b] = next[b];
      }
      if (all) break;
    }
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (uint32_t b = 0; b < info.batch; ++b) {
    std::printf("sequence %u:", b);
    for (int32_t x : out[b]) std::printf(" %d", x);
    std::printf("\n");
  }
  std::printf("%s: %d steps in %.3f s (with the prompt's steps, not a benchmark)\n", info.name, steps, s);
  mkc_model_close(m);
  return status;
}
