// mkc generate: greedy decoding with a compiled model (the C ABI of
// mkc/model.h). The prompt is fed through the decode path one token per
// step; every sequence of the batch gets the same prompt.
//
//   <model>_generate CHECKPOINT_DIR [--prompt 1,2,3] [--tokens 32] [--debug]
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "mkc/model.h"

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s CHECKPOINT_DIR [--prompt 1,2,3] [--tokens N] [--debug]\n", argv[0]);
    return 2;
  }
  std::vector<int32_t> prompt{0};
  int tokens = 32, debug = 0;
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
    } else if (a == "--debug") {
      debug = 1;
    } else {
      std::fprintf(stderr, "error: unknown argument %s\n", a.c_str());
      return 2;
    }
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
  for (size_t t = 0; t + 1 < prompt.size() + size_t(tokens); ++t, ++steps) {
    for (uint32_t b = 0; b < info.batch; ++b) in[b] = t < prompt.size() ? prompt[t] : next[b];
    if (mkc_model_step(m, in.data(), next.data(), nullptr, debug, err, sizeof err) != 0) {
      std::fprintf(stderr, "error: step %zu: %s\n", t, err);
      status = 1;
      break;
    }
    if (t + 1 >= prompt.size()) {
      for (uint32_t b = 0; b < info.batch; ++b) out[b].push_back(next[b]);
    }
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (uint32_t b = 0; b < info.batch; ++b) {
    std::printf("sequence %u:", b);
    for (int32_t x : out[b]) std::printf(" %d", x);
    std::printf("\n");
  }
  std::printf("%s: %d steps in %.3f s (host loop with a copy per step, not a benchmark)\n", info.name, steps, s);
  mkc_model_close(m);
  return status;
}
