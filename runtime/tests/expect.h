// What the runtime's CPU tests share: EXPECT(cond, printf-args) counts a pass
// or prints the failure with its location and a message; report() prints the
// totals and gives the exit status.
#pragma once

#include <cstdio>

inline int passed = 0, failed = 0;

#define EXPECT(cond, ...)                                           \
  do {                                                              \
    if (cond) {                                                     \
      ++passed;                                                     \
    } else {                                                        \
      ++failed;                                                     \
      std::printf("FAILED %s:%d: %s: ", __FILE__, __LINE__, #cond); \
      std::printf(__VA_ARGS__);                                     \
      std::printf("\n");                                            \
    }                                                               \
  } while (0)

inline int report() {
  std::printf("%d passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}
