// CPU tests of a generated model's runtime (the C ABI of mkc/model.h),
// linked against the library built from generated/kimi_k2_tiny_h200 and run
// on the transformers-written fixture of the same config. On a machine
// without a GPU the checkpoint checks still run (they come before any CUDA
// call); the open then fails on CUDA, with a message saying so.
// Usage: model_test FIXTURE_DIR SCRATCH_DIR
#include <cctype>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "expect.h"
#include "mkc/model.h"

namespace fs = std::filesystem;


static std::string lower(std::string s) {
  for (char& c : s) c = char(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

// A copy of the fixture whose safetensors header is edited: the entry of
// `key` renamed (removing it would leave its bytes a gap in the data section,
// which makes the whole file unreadable), or its shape text replaced by `shape`.
static fs::path edited(const fs::path& fixture, const fs::path& dir, const std::string& key, const char* shape) {
  fs::create_directories(dir);
  fs::copy_file(fixture / "config.json", dir / "config.json", fs::copy_options::overwrite_existing);
  std::ifstream in(fixture / "model.safetensors", std::ios::binary);
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  uint64_t old_n = 0;
  std::memcpy(&old_n, bytes.data(), 8);
  std::string header(bytes.data() + 8, old_n);
  const size_t at = header.find("\"" + key + "\":{");
  if (at == std::string::npos) return {};
  if (shape == nullptr) {
    header.replace(at, key.size() + 2, "\"" + key + ".renamed\"");
  } else {
    const size_t s0 = header.find("\"shape\":[", at), s1 = header.find(']', s0);
    header.replace(s0, s1 + 1 - s0, std::string("\"shape\":") + shape);
  }
  while (header.size() % 8 != 0) header += ' ';
  const uint64_t n = header.size();
  std::ofstream out(dir / "model.safetensors", std::ios::binary);
  out.write(reinterpret_cast<const char*>(&n), 8);
  out.write(header.data(), std::streamsize(n));
  out.write(bytes.data() + 8 + old_n, std::streamsize(bytes.size() - 8 - old_n));
  return dir;
}

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s FIXTURE_DIR SCRATCH_DIR\n", argv[0]);
    return 2;
  }
  const fs::path fixture = argv[1], scratch = argv[2];
  char err[1 << 16];
  mkc_model* m = nullptr;

  // No such directory: refused, naming it.
  EXPECT(mkc_model_open((scratch / "nowhere").c_str(), &m, err, sizeof err) == -1 && m == nullptr &&
             std::strstr(err, "nowhere") != nullptr,
         "%s", err);

  // A tensor missing, a tensor mis-shaped: refused by name, before any CUDA call.
  const std::string key = "model.layers.0.self_attn.o_proj.weight";
  const fs::path missing = edited(fixture, scratch / "missing", key, nullptr);
  EXPECT(!missing.empty(), "the fixture has %s", key.c_str());
  EXPECT(mkc_model_open(missing.c_str(), &m, err, sizeof err) == -1 && m == nullptr &&
             std::strstr(err, ("missing tensor " + key).c_str()) != nullptr,
         "%s", err);
  const fs::path shaped = edited(fixture, scratch / "shape", key, "[64,56]");
  EXPECT(mkc_model_open(shaped.c_str(), &m, err, sizeof err) == -1 && m == nullptr &&
             std::strstr(err, key.c_str()) != nullptr && std::strstr(err, "[64, 56]") != nullptr,
         "%s", err);

  // The fixture itself passes the checks: it opens on a GPU machine, and
  // elsewhere fails on CUDA, saying so.
  const int rc = mkc_model_open(fixture.c_str(), &m, err, sizeof err);
  if (rc == 0) {
    mkc_model_info info;
    mkc_model_get_info(m, &info);
    EXPECT(info.batch == 1 && info.vocab == 512 && info.context == 4096, "%u %llu %llu", info.batch,
           (unsigned long long)info.vocab, (unsigned long long)info.context);
    // The routing log: a buffer of the wrong size is refused, saying how many ids there are.
    std::vector<int32_t> ids(size_t(info.routers) * info.batch * info.router_top_k + 1);
    EXPECT(info.routers > 0 && info.router_top_k > 0, "%u routers, top-%u", info.routers, info.router_top_k);
    EXPECT(mkc_model_routing(m, ids.data(), ids.size(), err, sizeof err) == -1 && std::strstr(err, "routers log"),
           "%s", err);
    EXPECT(mkc_model_routing(m, ids.data(), ids.size() - 1, err, sizeof err) == 0, "%s", err);
    mkc_model_close(m);
  } else {
    EXPECT(lower(err).find("cuda") != std::string::npos && std::strstr(err, "tensor") == nullptr, "%s", err);
  }
  return report();
}
