// The runtime's plan-file reader (mkc/plan_file.h) on the plan files mkc
// codegen wrote into generated/: a plan of the right model reads, with its
// weight table expanded; a plan of another model, another target, another
// format version, a truncated one and one with any of several flipped bytes
// are each refused with a message naming the file and what differs.
//
// Usage: plan_file_test GENERATED_DIR SCRATCH_DIR
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "expect.h"
#include "mkc/plan_file.h"

namespace {

std::vector<unsigned char> slurp(const std::string& path) {
  std::vector<unsigned char> v;
  FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) return v;
  unsigned char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) v.insert(v.end(), buf, buf + n);
  std::fclose(f);
  return v;
}

void spill(const std::string& path, const std::vector<unsigned char>& v) {
  FILE* f = std::fopen(path.c_str(), "wb");
  if (f != nullptr) {
    std::fwrite(v.data(), 1, v.size(), f);
    std::fclose(f);
  }
}

bool contains(const std::string& s, const char* what) { return s.find(what) != std::string::npos; }

// Reads `path` as `want`; returns the error ("" when it reads).
std::string read_as(const std::string& path, const mkc::PlanIdentity& want, mkc::PlanFile* out = nullptr) {
  mkc::PlanFile p;
  std::string err;
  const bool ok = mkc::read_plan_file(path, want, &p, &err);
  if (ok && out != nullptr) *out = std::move(p);
  return ok ? std::string() : err;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s GENERATED_DIR SCRATCH_DIR\n", argv[0]);
    return 2;
  }
  const std::string gen = argv[1], scratch = argv[2];
  const std::string k2 = gen + "/kimi_k2_tiny_h200/plan.mkcplan";
  const mkc::PlanIdentity k2_id{"kimi_k2_tiny_h200", "h200", 1, 4096};

  // The right plan reads, and holds what the schedule needs.
  mkc::PlanFile p;
  const std::string ok = read_as(k2, k2_id, &p);
  EXPECT(ok.empty(), "%s", ok.c_str());
  EXPECT(p.sms > 0 && p.sm_begin.size() == p.sms + 1u, "sms %u", p.sms);
  EXPECT(!p.instructions.empty() && p.instructions.size() == p.tasks.size(), "%zu instructions, %zu tasks",
         p.instructions.size(), p.tasks.size());
  EXPECT(!p.stages.empty() && p.stage_names.size() == p.stages.size(), "%zu stages", p.stages.size());
  // The weight table: experts expanded from their key pattern, in order.
  bool expert0 = false, expert1 = false, placeholder = false;
  for (size_t i = 0; i < p.weights.size(); ++i) {
    const std::string key = p.weights[i].key;
    expert0 |= key == "model.layers.1.mlp.experts.0.gate_proj.weight";
    expert1 |= key == "model.layers.1.mlp.experts.1.gate_proj.weight";
    placeholder |= contains(key, "{");
    EXPECT(p.weights[i].ndim >= 1 && p.weights[i].ndim <= MKC_MAX_DIMS, "%s: %u dims", key.c_str(),
           p.weights[i].ndim);
  }
  EXPECT(expert0 && expert1 && !placeholder, "the expert keys are expanded (%zu tensors)", p.weights.size());
  EXPECT(p.layouts.size() == p.weights.size(), "a layout per tensor");

  // Another model's plan, another target's, another batch's.
  const std::string k3 = gen + "/kimi_k3_tiny_h200/plan.mkcplan";
  std::string e = read_as(k3, k2_id);
  EXPECT(contains(e, k3.c_str()) && contains(e, "model kimi_k3_tiny_h200") && contains(e, "kimi_k2_tiny_h200"), "%s",
         e.c_str());
  e = read_as(gen + "/kimi_k2_tiny_b200/plan.mkcplan", mkc::PlanIdentity{"kimi_k2_tiny_b200", "h200", 1, 4096});
  EXPECT(contains(e, "target b200") && contains(e, "for h200"), "%s", e.c_str());
  e = read_as(k2, mkc::PlanIdentity{"kimi_k2_tiny_h200", "h200", 4, 4096});
  EXPECT(contains(e, "batch 1") && contains(e, "batch 4"), "%s", e.c_str());

  const std::vector<unsigned char> good = slurp(k2);
  EXPECT(good.size() > mkc::kPlanHeaderBytes, "%zu bytes", good.size());
  const std::string bad = scratch + "/bad.mkcplan";

  // Another format version.
  std::vector<unsigned char> v = good;
  v[8] = 2;
  spill(bad, v);
  e = read_as(bad, k2_id);
  EXPECT(contains(e, bad.c_str()) && contains(e, "plan format 2") && contains(e, "reads format 1"), "%s", e.c_str());

  // Not a plan file at all; truncated.
  spill(bad, std::vector<unsigned char>(good.begin(), good.begin() + 100));
  e = read_as(bad, k2_id);
  EXPECT(contains(e, "not an mkc plan file"), "%s", e.c_str());
  spill(bad, std::vector<unsigned char>(good.begin(), good.end() - 16));
  e = read_as(bad, k2_id);
  EXPECT(contains(e, "truncated"), "%s", e.c_str());
  e = read_as(scratch + "/no_such.mkcplan", k2_id);
  EXPECT(contains(e, "cannot open"), "%s", e.c_str());

  // A flipped byte anywhere past the magic and version: in the header's
  // names, in the section table, in each section, in the last byte.
  const size_t spots[] = {20, 60, 150, mkc::kPlanHeaderBytes + 5, good.size() / 3, good.size() / 2,
                          good.size() * 3 / 4, good.size() - 1};
  for (size_t at : spots) {
    v = good;
    v[at] ^= 0x10;
    spill(bad, v);
    e = read_as(bad, k2_id);
    EXPECT(contains(e, bad.c_str()) && contains(e, "corrupted"), "byte %zu: %s", at, e.c_str());
  }
  return report();
}
