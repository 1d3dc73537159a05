// mkc runtime: reads and checks a plan file (plan.mkcplan, written by
// `mkc codegen`; layout in src/emit/plan_file.rs and docs/CODEGEN.md).
//
// The file holds everything about a compiled model that grows with its layers,
// experts or tasks: the per-SM schedule, the tasks, each stage's kind role and
// parameters, the weight table as key patterns, the per-sequence states. The
// reader refuses, naming the file and what differs: a file that is not a plan
// file, another format version, a size or checksum that does not match (a
// truncated or corrupted file), a plan of another model, target, batch or
// context, and any record that points outside its table. Header-only, plain
// C++ (no CUDA): the CPU tests use it as the runtime does.
#pragma once

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "mkc/checkpoint.h"
#include "mkc/mx_layout.h"
#include "mkc/plan_types.h"

namespace mkc {

constexpr uint32_t kPlanFormat = 1;
constexpr size_t kPlanHeaderBytes = 256;
constexpr size_t kPlanChecksumAt = 168;

// What a plan file must be for this library.
struct PlanIdentity {
  const char* model;
  const char* target;
  uint32_t batch;
  uint64_t context;
};

// A plan file, read and checked.
struct PlanFile {
  std::string path;
  std::string mkc_version, model, target;
  uint32_t batch = 0, sms = 0;
  uint64_t context = 0;
  std::vector<Instruction> instructions;
  std::vector<uint32_t> sm_begin;  // [sms + 1]
  std::vector<Wait> waits;
  std::vector<uint32_t> counters;  // bumps per step
  std::vector<TaskArgs> tasks;
  std::vector<StageRecord> stages;
  std::vector<uint64_t> params;
  // The weight table expanded: one spec per checkpoint tensor, in the
  // generated code's order (its keys point into `keys`).
  std::vector<std::string> keys, dtypes;
  std::vector<mkc_tensor_spec> weights;
  std::vector<WeightLayout> layouts;
  std::vector<uint64_t> states;  // bytes per sequence
  std::vector<std::string> stage_names;
};

namespace plan_detail {

inline uint64_t fnv1a(const unsigned char* p, size_t n, uint64_t h = 0xcbf29ce484222325ull) {
  for (size_t i = 0; i < n; ++i) {
    h ^= p[i];
    h *= 0x100000001b3ull;
  }
  return h;
}

template <class T>
T get(const std::vector<unsigned char>& f, size_t at) {
  T v;
  std::memcpy(&v, f.data() + at, sizeof v);
  return v;
}

inline std::string fixed(const std::vector<unsigned char>& f, size_t at, size_t n) {
  const char* p = reinterpret_cast<const char*>(f.data() + at);
  return std::string(p, strnlen(p, n));
}

struct Section {
  uint32_t elem = 0;
  uint64_t count = 0, offset = 0;
  bool present = false;
};

}  // namespace plan_detail

// Reads `path` into `out`, checked against `want`. Returns false with a
// message naming the file and what is wrong in `err`.
inline bool read_plan_file(const std::string& path, const PlanIdentity& want, PlanFile* out, std::string* err) {
  using namespace plan_detail;
  auto fail = [&](const std::string& what) {
    *err = "plan file " + path + ": " + what;
    return false;
  };
  std::vector<unsigned char> f;
  {
    FILE* fp = std::fopen(path.c_str(), "rb");
    if (fp == nullptr) return fail(std::string("cannot open it: ") + std::strerror(errno));
    unsigned char buf[1 << 16];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof buf, fp)) > 0) f.insert(f.end(), buf, buf + n);
    const bool bad = std::ferror(fp) != 0;
    std::fclose(fp);
    if (bad) return fail("cannot read it");
  }
  if (f.size() < kPlanHeaderBytes || std::memcmp(f.data(), "MKCPLAN\0", 8) != 0) {
    return fail("not an mkc plan file (" + std::to_string(f.size()) + " bytes; it must start with MKCPLAN)");
  }
  const uint32_t format = get<uint32_t>(f, 8);
  if (format != kPlanFormat) {
    return fail("plan format " + std::to_string(format) + "; this runtime reads format " +
                std::to_string(kPlanFormat) + " (regenerate it with this mkc: mkc codegen)");
  }
  const uint64_t size = get<uint64_t>(f, 160);
  if (size != f.size()) {
    return fail("the header says " + std::to_string(size) + " bytes, the file has " + std::to_string(f.size()) +
                " (truncated or padded)");
  }
  const uint64_t stored = get<uint64_t>(f, kPlanChecksumAt);
  uint64_t sum = fnv1a(f.data(), kPlanChecksumAt);
  const unsigned char zeros[8] = {};
  sum = fnv1a(zeros, 8, sum);
  sum = fnv1a(f.data() + kPlanChecksumAt + 8, f.size() - kPlanChecksumAt - 8, sum);
  if (sum != stored) {
    char msg[160];
    std::snprintf(msg, sizeof msg, "corrupted: its checksum is %016llx, the header says %016llx",
                  static_cast<unsigned long long>(sum), static_cast<unsigned long long>(stored));
    return fail(msg);
  }
  PlanFile p;
  p.path = path;
  p.mkc_version = fixed(f, 16, 32);
  p.model = fixed(f, 48, 64);
  p.target = fixed(f, 112, 32);
  p.batch = get<uint32_t>(f, 144);
  p.sms = get<uint32_t>(f, 148);
  p.context = get<uint64_t>(f, 152);
  if (p.model != want.model) {
    return fail("the plan of model " + p.model + ", not of this library's model " + want.model);
  }
  if (p.target != want.target) {
    return fail("planned for target " + p.target + ", this library for " + want.target);
  }
  if (p.batch != want.batch || p.context != want.context) {
    return fail("planned for batch " + std::to_string(p.batch) + " and context " + std::to_string(p.context) +
                ", this library for batch " + std::to_string(want.batch) + " and context " +
                std::to_string(want.context));
  }

  // The section table.
  const uint32_t n_sections = get<uint32_t>(f, 12);
  if (n_sections > 64 || kPlanHeaderBytes + 24ull * n_sections > f.size()) {
    return fail(std::to_string(n_sections) + " sections do not fit the file");
  }
  Section sec[13];
  const uint32_t elem_bytes[13] = {0, 16, 4, 8, 4, 20, 16, 8, 16, 88, 8, 4, 1};
  for (uint32_t i = 0; i < n_sections; ++i) {
    const size_t at = kPlanHeaderBytes + 24 * i;
    const uint32_t id = get<uint32_t>(f, at);
    if (id == 0 || id > 12) continue;  // a section this runtime does not read
    Section s{get<uint32_t>(f, at + 4), get<uint64_t>(f, at + 8), get<uint64_t>(f, at + 16), true};
    if (s.elem != elem_bytes[id]) {
      return fail("section " + std::to_string(id) + " has " + std::to_string(s.elem) + "-byte records, not " +
                  std::to_string(elem_bytes[id]));
    }
    if (s.offset > f.size() || s.count > (f.size() - s.offset) / s.elem) {
      return fail("section " + std::to_string(id) + " runs past the end of the file");
    }
    sec[id] = s;
  }
  for (uint32_t id = 1; id <= 12; ++id) {
    if (!sec[id].present) return fail("section " + std::to_string(id) + " is missing");
  }
  auto load = [&](uint32_t id, auto& v) {
    using T = typename std::decay_t<decltype(v)>::value_type;
    v.resize(sec[id].count);
    if (!v.empty()) std::memcpy(v.data(), f.data() + sec[id].offset, sizeof(T) * v.size());
  };
  load(1, p.instructions);
  load(2, p.sm_begin);
  load(3, p.waits);
  load(4, p.counters);
  load(5, p.tasks);
  load(6, p.stages);
  load(7, p.params);
  load(10, p.states);
  const char* strings = reinterpret_cast<const char*>(f.data() + sec[12].offset);
  const uint64_t strings_n = sec[12].count;
  std::string bad_string;
  auto str = [&](uint32_t off, const char* what) -> std::string {
    if (off >= strings_n || std::memchr(strings + off, 0, strings_n - off) == nullptr) {
      bad_string = what;
      return std::string();
    }
    return std::string(strings + off);
  };

  // The schedule points inside its tables.
  if (p.sm_begin.size() != size_t(p.sms) + 1) return fail("sm_begin does not hold sms + 1 entries");
  for (uint32_t s = 0; s < p.sms; ++s) {
    if (p.sm_begin[s] > p.sm_begin[s + 1]) return fail("sm_begin is not increasing at SM " + std::to_string(s));
  }
  if (p.sm_begin[0] != 0 || p.sm_begin[p.sms] != p.instructions.size()) {
    return fail("sm_begin does not cover the instructions");
  }
  for (size_t i = 0; i < p.instructions.size(); ++i) {
    const Instruction& in = p.instructions[i];
    if (uint64_t(in.first_wait) + in.n_waits > p.waits.size() || in.signal >= p.counters.size() ||
        in.task >= p.tasks.size()) {
      return fail("instruction " + std::to_string(i) + " points outside the waits, counters or tasks");
    }
  }
  for (size_t i = 0; i < p.waits.size(); ++i) {
    if (p.waits[i].counter >= p.counters.size()) return fail("wait " + std::to_string(i) + " names no counter");
  }
  for (size_t i = 0; i < p.tasks.size(); ++i) {
    if (p.tasks[i].stage >= p.stages.size()) return fail("task " + std::to_string(i) + " names no stage");
  }
  for (size_t i = 0; i < p.stages.size(); ++i) {
    const StageRecord& s = p.stages[i];
    if (s.params > p.params.size() || (s.load_wait.target != 0 && s.load_wait.counter >= p.counters.size())) {
      return fail("stage " + std::to_string(i) + " points outside the parameters or counters");
    }
  }

  // The weight table: groups of tensors named by key patterns.
  const unsigned char* groups = f.data() + sec[8].offset;
  const unsigned char* tensors = f.data() + sec[9].offset;
  for (uint64_t g = 0; g < sec[8].count; ++g) {
    uint32_t var, count, first, n;
    std::memcpy(&var, groups + 16 * g, 4);
    std::memcpy(&count, groups + 16 * g + 4, 4);
    std::memcpy(&first, groups + 16 * g + 8, 4);
    std::memcpy(&n, groups + 16 * g + 12, 4);
    if (uint64_t(first) + n > sec[9].count) return fail("weight group " + std::to_string(g) + " names no tensors");
    const std::string placeholder = var == UINT32_MAX ? std::string() : "{" + str(var, "a placeholder") + "}";
    for (uint32_t i = 0; i < count; ++i) {
      for (uint32_t t = first; t < first + n; ++t) {
        const unsigned char* r = tensors + 88 * size_t(t);
        uint32_t key, dtype, node, layout, ndim;
        std::memcpy(&key, r, 4);
        std::memcpy(&dtype, r + 4, 4);
        std::memcpy(&node, r + 8, 4);
        std::memcpy(&layout, r + 12, 4);
        std::memcpy(&ndim, r + 16, 4);
        std::string k = str(key, "a key");
        if (var != UINT32_MAX) {
          const std::string index = std::to_string(i);
          for (size_t at = k.find(placeholder); at != std::string::npos; at = k.find(placeholder, at + index.size())) {
            k.replace(at, placeholder.size(), index);
          }
        }
        (void)str(node, "a node name");
        if (ndim > MKC_MAX_DIMS || layout > 3) return fail("tensor record " + std::to_string(t) + " is malformed");
        mkc_tensor_spec spec{};
        spec.ndim = ndim;
        std::memcpy(spec.shape, r + 24, 8 * MKC_MAX_DIMS);
        p.keys.push_back(std::move(k));
        p.dtypes.push_back(str(dtype, "a dtype"));
        p.weights.push_back(spec);
        p.layouts.push_back(static_cast<WeightLayout>(layout));
      }
    }
  }
  for (size_t i = 0; i < p.weights.size(); ++i) {
    p.weights[i].key = p.keys[i].c_str();
    p.weights[i].dtype = p.dtypes[i].c_str();
  }
  const unsigned char* names = f.data() + sec[11].offset;
  for (uint64_t s = 0; s < sec[11].count; ++s) {
    uint32_t off;
    std::memcpy(&off, names + 4 * s, 4);
    p.stage_names.push_back(str(off, "a stage name"));
  }
  if (!bad_string.empty()) return fail(bad_string + " points outside the strings");
  *out = std::move(p);
  return true;
}

}  // namespace mkc
