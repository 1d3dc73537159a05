// CPU tests of the runtime's checkpoint reader against real checkpoints
// written by transformers 5.17 (tests/fixtures/checkpoints) and broken copies.
// Usage: checkpoint_test FIXTURES_DIR

#include <cstdio>
#include <cstring>
#include <unistd.h>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "expect.h"
#include "mkc/checkpoint.h"

namespace fs = std::filesystem;


struct Specs {
  std::vector<std::string> keys, dtypes;
  std::vector<mkc_tensor_spec> specs;
};

// tensors.txt: `name DTYPE [a,b,...]` per line, as the fixture script wrote it.
static Specs load_specs(const fs::path& file) {
  Specs s;
  std::ifstream in(file);
  std::string line;
  std::vector<std::vector<uint64_t>> shapes;
  while (std::getline(in, line)) {
    std::istringstream ls(line);
    std::string key, dtype, shape;
    ls >> key >> dtype >> shape;
    std::vector<uint64_t> dims;
    std::string num;
    for (char c : shape) {
      if (isdigit(static_cast<unsigned char>(c))) {
        num += c;
      } else if (!num.empty()) {
        dims.push_back(std::stoull(num));
        num.clear();
      }
    }
    s.keys.push_back(key);
    s.dtypes.push_back(dtype);
    shapes.push_back(dims);
  }
  for (size_t i = 0; i < s.keys.size(); ++i) {
    mkc_tensor_spec t{};
    t.key = s.keys[i].c_str();
    t.dtype = s.dtypes[i].c_str();
    t.ndim = uint32_t(shapes[i].size());
    for (size_t d = 0; d < shapes[i].size(); ++d) t.shape[d] = shapes[i][d];
    s.specs.push_back(t);
  }
  return s;
}

static std::string check(mkc_checkpoint* c, const std::vector<mkc_tensor_spec>& specs, int* problems) {
  static char report[1 << 16];
  *problems = mkc_checkpoint_check(c, specs.data(), specs.size(), report, sizeof report);
  return report;
}

static mkc_checkpoint* open_dir(const fs::path& dir) {
  char err[512];
  mkc_checkpoint* c = nullptr;
  if (mkc_checkpoint_open(dir.c_str(), &c, err, sizeof err) != 0) std::printf("open %s: %s\n", dir.c_str(), err);
  return c;
}

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s FIXTURES_DIR\n", argv[0]);
    return 2;
  }
  const fs::path fixtures(argv[1]);
  const fs::path single = fixtures / "deepseek_v3_tiny", sharded = fixtures / "deepseek_v3_tiny_sharded",
                 kimi = fixtures / "kimi_linear_tiny";

  // Real checkpoints match their own tensor lists.
  for (const auto& dir : {single, sharded, kimi}) {
    mkc_checkpoint* c = open_dir(dir);
    EXPECT(c != nullptr, "%s", dir.c_str());
    if (!c) continue;
    Specs s = load_specs(dir / "tensors.txt");
    int n = 0;
    const std::string report = check(c, s.specs, &n);
    EXPECT(n == 0, "%s: %s", dir.c_str(), report.c_str());
    EXPECT(mkc_checkpoint_tensor_count(c) == s.specs.size(), "%zu tensors", mkc_checkpoint_tensor_count(c));
    // The stored dtype, as the runtime's upload reads it to widen bf16 to f32.
    for (const auto& spec : s.specs) {
      const char* stored = mkc_checkpoint_dtype(c, spec.key);
      EXPECT(stored != nullptr && (std::strcmp(stored, spec.dtype) == 0 ||
                                   (std::strcmp(spec.dtype, "F32") == 0 && std::strcmp(stored, "BF16") == 0)),
             "%s: stored %s, spec %s", spec.key, stored ? stored : "(none)", spec.dtype);
    }
    EXPECT(mkc_checkpoint_dtype(c, "no.such.tensor") == nullptr, "a missing tensor has no dtype");
    mkc_checkpoint_close(c);
  }

  // The same tensor read from the single file and from the shards is the same bytes.
  {
    mkc_checkpoint* a = open_dir(single);
    mkc_checkpoint* b = open_dir(sharded);
    std::vector<char> x(1 << 20), y(1 << 20);
    char err[256];
    const int64_t nx = mkc_checkpoint_read(a, "model.layers.2.mlp.experts.5.down_proj.weight", x.data(), x.size(), err, sizeof err);
    const int64_t ny = mkc_checkpoint_read(b, "model.layers.2.mlp.experts.5.down_proj.weight", y.data(), y.size(), err, sizeof err);
    EXPECT(nx == 64 * 32 * 2 && nx == ny, "%lld vs %lld", (long long)nx, (long long)ny);
    EXPECT(std::memcmp(x.data(), y.data(), size_t(nx > 0 ? nx : 0)) == 0, "bytes differ");
    bool nonzero = false;
    for (int64_t i = 0; i < nx; ++i) nonzero |= x[size_t(i)] != 0;
    EXPECT(nonzero, "read only zeros");
    EXPECT(mkc_checkpoint_read(a, "lm_head.weight", x.data(), 100, err, sizeof err) == -1 &&
               std::strstr(err, "lm_head.weight"), "short buffer: %s", err);
    EXPECT(mkc_checkpoint_read(a, "no.such.tensor", x.data(), x.size(), err, sizeof err) == -1 &&
               std::strstr(err, "missing tensor no.such.tensor"), "%s", err);
    mkc_checkpoint_close(a);
    mkc_checkpoint_close(b);
  }

  // A plan asking for other shapes and dtypes, and a tensor that is not there.
  {
    mkc_checkpoint* c = open_dir(kimi);
    Specs s = load_specs(kimi / "tensors.txt");
    std::vector<mkc_tensor_spec> specs = s.specs;
    for (auto& t : specs) {
      if (std::string(t.key) == "model.layers.0.self_attn.A_log") t.dtype = "F32";  // widened on upload: fine
      if (std::string(t.key) == "model.layers.1.self_attn.o_proj.weight") t.shape[0] = 65;
      if (std::string(t.key) == "model.embed_tokens.weight") t.dtype = "F16";
    }
    mkc_tensor_spec extra{};
    extra.key = "model.layers.9.mlp.gate.weight";
    extra.dtype = "BF16";
    extra.ndim = 2;
    extra.shape[0] = 8;
    extra.shape[1] = 64;
    specs.push_back(extra);
    int n = 0;
    const std::string report = check(c, specs, &n);
    EXPECT(n == 3, "%d problems:\n%s", n, report.c_str());
    EXPECT(report.find("wrong shape for model.layers.1.self_attn.o_proj.weight: [64, 32] in model.safetensors, the plan needs [65, 32]") != std::string::npos, "%s", report.c_str());
    EXPECT(report.find("wrong dtype for model.embed_tokens.weight: BF16 in model.safetensors, the plan needs F16") != std::string::npos, "%s", report.c_str());
    EXPECT(report.find("missing tensor model.layers.9.mlp.gate.weight (BF16 [8, 64])") != std::string::npos, "%s", report.c_str());
    mkc_checkpoint_close(c);
  }

  // A truncated copy: every tensor cut off is named; nothing crashes.
  const fs::path tmp = fs::temp_directory_path() / ("mkc_ckpt_test_" + std::to_string(getpid()));
  fs::remove_all(tmp);
  fs::create_directories(tmp / "cut");
  fs::copy(single, tmp / "cut", fs::copy_options::recursive);
  fs::resize_file(tmp / "cut" / "model.safetensors", fs::file_size(tmp / "cut" / "model.safetensors") / 2);
  {
    mkc_checkpoint* c = open_dir(tmp / "cut");
    Specs s = load_specs(single / "tensors.txt");
    int n = 0;
    const std::string report = check(c, s.specs, &n);
    EXPECT(n > 10 && report.find("truncated tensor ") != std::string::npos && report.find(" in model.safetensors: ") != std::string::npos,
           "%d problems:\n%s", n, report.c_str());
    mkc_checkpoint_close(c);
  }

  // A sharded copy with one shard gone: one line for the file, not one per tensor.
  fs::create_directories(tmp / "shards");
  fs::copy(sharded, tmp / "shards", fs::copy_options::recursive);
  fs::remove(tmp / "shards" / "model-00003-of-00006.safetensors");
  {
    mkc_checkpoint* c = open_dir(tmp / "shards");
    Specs s = load_specs(sharded / "tensors.txt");
    int n = 0;
    const std::string report = check(c, s.specs, &n);
    EXPECT(n == 1 && report.rfind("unreadable file model-00003-of-00006.safetensors: cannot open", 0) == 0, "%d:\n%s", n, report.c_str());
    mkc_checkpoint_close(c);
  }

  // Bad directories are errors with a message, not crashes.
  {
    fs::create_directories(tmp / "empty");
    char err[512];
    mkc_checkpoint* c = nullptr;
    EXPECT(mkc_checkpoint_open((tmp / "empty").c_str(), &c, err, sizeof err) == -1 && std::strstr(err, "no *.safetensors"), "%s", err);
    fs::create_directories(tmp / "badindex");
    std::ofstream(tmp / "badindex" / "model.safetensors.index.json") << "{\"weight_map\": 3}";
    EXPECT(mkc_checkpoint_open((tmp / "badindex").c_str(), &c, err, sizeof err) == -1 && std::strstr(err, "weight_map"), "%s", err);
    std::ofstream(tmp / "badindex" / "model.safetensors.index.json") << "{\"weight_map\": {\"a\": \"../x\"}}";
    EXPECT(mkc_checkpoint_open((tmp / "badindex").c_str(), &c, err, sizeof err) == -1 && std::strstr(err, "weight_map[a]"), "%s", err);
    fs::create_directories(tmp / "garbage");
    const std::string garbage = std::string("\x11\0\0\0\0\0\0\0", 8) + "{not json at all}";
    std::ofstream(tmp / "garbage" / "model.safetensors", std::ios::binary).write(garbage.data(), std::streamsize(garbage.size()));
    EXPECT(mkc_checkpoint_open((tmp / "garbage").c_str(), &c, err, sizeof err) == 0, "%s", err);
    int n = 0;
    const std::string report = check(c, {}, &n);
    EXPECT(n == 1 && report.find("unreadable file model.safetensors: the header is not valid JSON") == 0, "%s", report.c_str());
    mkc_checkpoint_close(c);
  }
  fs::remove_all(tmp);
  return report();
}
