// The runtime's checkpoint reader over the hostile corpus
// (tests/fixtures/hostile_checkpoints, written by its make.py): every case must
// come out exactly as expected.json says, message for message. The compiler's
// reader is held to the same file by tests/checkpoint_corpus.rs, so the two
// agree on every case. Also: a FIFO as a shard or as the index is refused at
// once (run under `timeout` by scripts/test_runtime.sh, so a reader that
// blocks fails rather than hangs), a dangling link as a shard is a missing
// file, and an index over the size limit is refused unread (made in a scratch
// directory: none of these can be committed).
// Usage: checkpoint_corpus_test CORPUS_DIR SCRATCH_DIR

#include <sys/stat.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "../src/json.hpp"
#include "expect.h"
#include "mkc/checkpoint.h"

namespace fs = std::filesystem;
using mkc::json::Value;

static std::string replace_all(std::string s, const std::string& from, const std::string& to) {
  for (size_t at = s.find(from); at != std::string::npos; at = s.find(from, at + to.size())) s.replace(at, from.size(), to);
  return s;
}

// What the reader makes of `dir`, checked against `want` (an expected.json case).
static void check_case(const std::string& name, const fs::path& dir, const Value& want) {
  char err[4096];
  mkc_checkpoint* c = nullptr;
  const int rc = mkc_checkpoint_open(dir.c_str(), &c, err, sizeof err);
  const std::string outcome = want.get("outcome")->text;
  if (rc != 0) {
    const std::string got = replace_all(err, dir.string(), "$DIR");
    EXPECT(outcome == "error" && got == want.get("error")->text, "%s: expected %s, got the error \"%s\"", name.c_str(),
           outcome.c_str(), got.c_str());
    return;
  }
  static char report[1 << 16];
  const int n = mkc_checkpoint_check(c, nullptr, 0, report, sizeof report);
  if (outcome == "ok") {
    const Value& keys = *want.get("tensors");
    EXPECT(n == 0, "%s: expected ok, got %d problem(s):\n%s", name.c_str(), n, report);
    EXPECT(mkc_checkpoint_tensor_count(c) == keys.array.size(), "%s: %zu tensors, expected %zu", name.c_str(),
           mkc_checkpoint_tensor_count(c), keys.array.size());
    for (const Value& k : keys.array) {
      EXPECT(mkc_checkpoint_dtype(c, k.text.c_str()) != nullptr, "%s: no tensor \"%s\"", name.c_str(), k.text.c_str());
    }
  } else if (outcome == "problems") {
    std::string lines;
    for (const Value& p : want.get("problems")->array) lines += p.text + "\n";
    EXPECT(lines == report, "%s: expected\n%sgot (%d)\n%s", name.c_str(), lines.c_str(), n, report);
  } else {
    EXPECT(false, "%s: expected the error \"%s\", but it opened with %d problem(s):\n%s", name.c_str(),
           want.get("error")->text.c_str(), n, report);
  }
  mkc_checkpoint_close(c);
}

static std::string open_error(const fs::path& dir, std::string* report) {
  char err[4096] = "";
  mkc_checkpoint* c = nullptr;
  if (mkc_checkpoint_open(dir.c_str(), &c, err, sizeof err) != 0) return replace_all(err, dir.string(), "$DIR");
  static char text[1 << 16];
  mkc_checkpoint_check(c, nullptr, 0, text, sizeof text);
  *report = text;
  mkc_checkpoint_close(c);
  return "";
}

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s CORPUS_DIR SCRATCH_DIR\n", argv[0]);
    return 2;
  }
  const fs::path corpus(argv[1]), scratch(argv[2]);
  std::ifstream in(corpus / "expected.json", std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  const Value expected = mkc::json::parse(text.str());
  const Value& cases = *expected.get("cases");
  EXPECT(cases.object.size() >= 60, "%zu cases", cases.object.size());
  size_t listed = 0;
  for (const auto& e : fs::directory_iterator(corpus / "cases")) {
    ++listed;
    EXPECT(cases.get(e.path().filename().string()) != nullptr, "%s is not in expected.json", e.path().c_str());
  }
  EXPECT(listed == cases.object.size(), "%zu directories, %zu cases", listed, cases.object.size());
  for (const auto& [name, want] : cases.object) check_case(name, corpus / "cases" / name, want);

  // A FIFO as a shard, then as the index: refused at once, never read.
  fs::remove_all(scratch);
  fs::create_directories(scratch);
  fs::copy_file(corpus / "cases/ok_two_tensors/model.safetensors", scratch / "a.safetensors");
  EXPECT(mkfifo((scratch / "b.safetensors").c_str(), 0600) == 0, "mkfifo");
  std::string problems;
  std::string error = open_error(scratch, &problems);
  EXPECT(error.empty() && problems == "unreadable file b.safetensors: not a regular file\n", "%s%s", error.c_str(),
         problems.c_str());
  EXPECT(mkfifo((scratch / "model.safetensors.index.json").c_str(), 0600) == 0, "mkfifo");
  error = open_error(scratch, &problems);
  EXPECT(error == "$DIR/model.safetensors.index.json: not a regular file", "%s", error.c_str());

  // A dangling link as a shard is a missing file.
  fs::remove_all(scratch);
  fs::create_directories(scratch);
  fs::create_symlink("nowhere", scratch / "model.safetensors");
  error = open_error(scratch, &problems);
  EXPECT(error.empty() && problems == "unreadable file model.safetensors: cannot open: No such file or directory\n",
         "%s%s", error.c_str(), problems.c_str());

  // An index over the limit (sparse: no disk is used) is refused unread.
  fs::remove_all(scratch);
  fs::create_directories(scratch);
  std::ofstream(scratch / "model.safetensors.index.json").close();
  fs::resize_file(scratch / "model.safetensors.index.json", (256ull << 20) + 1);
  error = open_error(scratch, &problems);
  EXPECT(error == "$DIR/model.safetensors.index.json: 268435457 bytes, over the limit of 268435456", "%s",
         error.c_str());
  fs::remove_all(scratch);
  return report();
}
