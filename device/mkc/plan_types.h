// mkc: the records of the plan file (src/emit/plan_file.rs) as the device and
// the host read them. Plain C++ (no CUDA), so that the runtime's CPU tests
// read plan files with the same types.
#pragma once

#include <cstdint>

namespace mkc {

// A wait for `target` bumps per step of counter `counter`.
struct Wait {
  uint32_t counter;
  uint32_t target;
};

// One entry of an SM's instruction list.
struct Instruction {
  uint16_t opcode;      // Opcode
  uint16_t n_waits;     // waits[first_wait .. first_wait + n_waits)
  uint32_t first_wait;
  uint32_t signal;      // the counter this instruction bumps when done
  uint32_t task;        // index into the tasks
};

// One plan task: its stage, its index in the stage, and what part of the
// operation it computes (src/plan/tile.rs, Task::args).
struct TaskArgs {
  uint16_t stage;
  uint16_t index;
  uint32_t a[4];
};

// One plan stage: which role of the generated program's kinds runs it, where
// its parameters start in the parameter table, and what the loader waits for
// before streaming its weights ({0, 0}: nothing).
struct StageRecord {
  uint32_t role;
  uint32_t params;
  Wait load_wait;
};

static_assert(sizeof(Wait) == 8, "the plan file's wait record");
static_assert(sizeof(Instruction) == 16, "the plan file's instruction record");
static_assert(sizeof(TaskArgs) == 20, "the plan file's task record");
static_assert(sizeof(StageRecord) == 16, "the plan file's stage record");

}  // namespace mkc
