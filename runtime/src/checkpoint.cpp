// mkc runtime: the checkpoint reader behind include/mkc/checkpoint.h.
//
// The same rules and messages as the compiler's checker (src/checkpoint; the
// list is in docs/check.md), held to the same cases by
// runtime/tests/checkpoint_corpus_test.cpp over tests/fixtures/hostile_checkpoints:
// files are opened without blocking and only if regular, a header's tensors
// must cover its data section exactly, sizes are computed with checked
// arithmetic, and a tensor in two shards is refused.

#include "mkc/checkpoint.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "json.hpp"

namespace fs = std::filesystem;

namespace {

constexpr uint64_t kMaxHeader = 256ull << 20;  // src/checkpoint/safetensors.rs MAX_HEADER
constexpr uint64_t kMaxIndex = 256ull << 20;   // src/checkpoint/index.rs MAX_INDEX
constexpr const char* kIndex = "model.safetensors.index.json";

struct TensorInfo {
  std::string dtype;
  std::vector<uint64_t> shape;
  uint64_t begin = 0, end = 0;  // within the data section
  size_t file = 0;              // index into files
};

struct File {
  std::string name;
  fs::path path;
  uint64_t data_offset = 0;  // 8 + header length
  uint64_t data_len = 0;
};

// Bits per element of a safetensors dtype; 0 if unknown.
uint64_t dtype_bits(const std::string& d) {
  if (d == "F64" || d == "I64" || d == "U64") return 64;
  if (d == "F32" || d == "I32" || d == "U32") return 32;
  if (d == "F16" || d == "BF16" || d == "I16" || d == "U16") return 16;
  if (d == "F8_E4M3" || d == "F8_E5M2" || d == "F8_E8M0" || d == "U8" || d == "I8" || d == "BOOL") return 8;
  if (d == "F4") return 4;
  return 0;
}

// Bytes of a tensor of `shape` with `bits`-bit elements (F4 packs two to a
// byte, rounding up); false where the element count, multiplied left to
// right, or the byte count passes 2^64 - 1.
bool byte_size(const std::vector<uint64_t>& shape, uint64_t bits, uint64_t* out) {
  uint64_t elements = 1;
  for (const uint64_t d : shape) {
    if (__builtin_mul_overflow(elements, d, &elements)) return false;
  }
  if (bits >= 8) return !__builtin_mul_overflow(elements, bits / 8, out);
  const uint64_t per_byte = 8 / bits;
  *out = elements / per_byte + (elements % per_byte != 0);
  return true;
}

std::string dims(const uint64_t* s, size_t n) {
  std::string out = "[";
  for (size_t i = 0; i < n; ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}
std::string dims(const std::vector<uint64_t>& s) { return dims(s.data(), s.size()); }

bool accepts(const std::string& need, const std::string& found) {
  return need == found || (need == "F32" && (found == "BF16" || found == "F16"));
}

void copy_message(const std::string& msg, char* dst, size_t len) {
  if (!dst || len == 0) return;
  const size_t n = std::min(msg.size(), len - 1);
  std::memcpy(dst, msg.data(), n);
  dst[n] = '\0';
}

// A file descriptor, closed on scope exit.
struct Fd {
  int fd = -1;
  Fd() = default;
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

enum class Opened { kOk, kNotFound, kFailed };

// Opens `path` for reading if it is a regular file, never blocking: a FIFO
// opened with O_NONBLOCK returns at once, and fstat then refuses it (as it
// does a directory, device or socket). Symbolic links to regular files are
// followed. On kFailed, *error says why; kNotFound is a missing file.
Opened open_regular(const fs::path& path, Fd& fd, uint64_t* size, std::string* error) {
  fd.fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd.fd < 0) {
    if (errno == ENOENT) {
      *error = "cannot open: " + std::string(std::strerror(ENOENT));
      return Opened::kNotFound;
    }
    *error = "cannot open: " + std::string(std::strerror(errno));
    return Opened::kFailed;
  }
  struct stat st {};
  if (::fstat(fd.fd, &st) != 0) {
    *error = "cannot stat: " + std::string(std::strerror(errno));
    return Opened::kFailed;
  }
  if (!S_ISREG(st.st_mode)) {
    *error = "not a regular file";
    return Opened::kFailed;
  }
  *size = uint64_t(st.st_size);
  return Opened::kOk;
}

// Reads n bytes at `offset`; "" or what went wrong.
std::string read_exact(int fd, char* buf, size_t n, uint64_t offset) {
  size_t got = 0;
  while (got < n) {
    const ssize_t r = ::pread(fd, buf + got, n - got, off_t(offset + got));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return "cannot read: " + std::string(std::strerror(errno));
    if (r == 0) {
      return "cannot read: the file ended after " + std::to_string(got) + " of " + std::to_string(n) + " bytes";
    }
    got += size_t(r);
  }
  return "";
}

}  // namespace

struct mkc_checkpoint {
  std::vector<File> files;
  std::map<std::string, TensorInfo> tensors;
  std::vector<std::string> problems;  // found while opening, in file order
  std::set<std::string> unreadable;   // names of files that could not be read
  std::map<std::string, std::string> index;  // key -> file name, from the index
};

namespace {

using mkc::json::Value;

// `field` as a 64-bit unsigned integer, or throws what is wrong with it.
uint64_t integer(const Value& v, const std::string& field) {
  uint64_t out = 0;
  if (const char* e = v.as_u64(&out)) {
    throw mkc::json::ParseError(field + " " + e + (v.kind == Value::Number ? ": " + v.text : ""));
  }
  return out;
}

// One tensor's entry: exactly dtype, shape and data_offsets, their byte count
// matching. Throws what is wrong.
TensorInfo entry(const Value& v) {
  using mkc::json::ParseError;
  if (v.kind != Value::Object) throw ParseError("the entry is not an object");
  for (const auto& [k, _] : v.object) {
    if (k != "dtype" && k != "shape" && k != "data_offsets") throw ParseError("unknown field " + k);
  }
  TensorInfo t;
  const Value* dt = v.get("dtype");
  if (!dt) throw ParseError("no dtype");
  if (dt->kind != Value::String) throw ParseError("dtype is not a string");
  t.dtype = dt->text;
  const uint64_t bits = dtype_bits(t.dtype);
  if (bits == 0) throw ParseError("unknown dtype " + t.dtype);
  const Value* sh = v.get("shape");
  if (!sh) throw ParseError("no shape");
  if (sh->kind != Value::Array) throw ParseError("shape is not an array");
  for (size_t i = 0; i < sh->array.size(); ++i) t.shape.push_back(integer(sh->array[i], "shape[" + std::to_string(i) + "]"));
  const Value* off = v.get("data_offsets");
  if (!off) throw ParseError("no data_offsets");
  if (off->kind != Value::Array || off->array.size() != 2) throw ParseError("data_offsets is not a pair");
  t.begin = integer(off->array[0], "data_offsets[0]");
  t.end = integer(off->array[1], "data_offsets[1]");
  if (t.begin > t.end) {
    throw ParseError("data_offsets run backwards: " + std::to_string(t.begin) + " > " + std::to_string(t.end));
  }
  uint64_t bytes = 0;
  if (!byte_size(t.shape, bits, &bytes)) throw ParseError(t.dtype + " " + dims(t.shape) + " is larger than 2^64 bytes");
  if (t.end - t.begin != bytes) {
    throw ParseError("data_offsets hold " + std::to_string(t.end - t.begin) + " bytes, " + t.dtype + " " +
                     dims(t.shape) + " needs " + std::to_string(bytes));
  }
  return t;
}

// The tensors, in order of their offsets, must cover the data section from
// byte 0 without overlap or gap, up to the last tensor's end; bytes after it
// are refused only if the file holds them (a shorter file is truncation).
std::string check_layout(const std::map<std::string, TensorInfo>& tensors, uint64_t data_len) {
  std::vector<std::tuple<uint64_t, uint64_t, const std::string*>> order;
  for (const auto& [k, t] : tensors) order.emplace_back(t.begin, t.end, &k);
  std::sort(order.begin(), order.end(), [](const auto& a, const auto& b) {
    return std::tie(std::get<0>(a), std::get<1>(a), *std::get<2>(a)) <
           std::tie(std::get<0>(b), std::get<1>(b), *std::get<2>(b));
  });
  uint64_t end = 0;
  const std::string* last = nullptr;
  for (const auto& [begin, tensor_end, key] : order) {
    if (begin < end && last) {
      return "tensors " + *last + " and " + *key + " overlap: " + *last + " ends at byte " + std::to_string(end) + ", " +
             *key + " begins at byte " + std::to_string(begin);
    }
    if (begin > end) {
      return "bytes " + std::to_string(end) + ".." + std::to_string(begin) +
             " of the data section belong to no tensor (a gap before " + *key + ")";
    }
    end = tensor_end;
    last = key;
  }
  if (end < data_len) {
    return "bytes " + std::to_string(end) + ".." + std::to_string(data_len) + " of the data section belong to no tensor";
  }
  return "";
}

// Reads and checks the header of shard `f`; "" or what is wrong.
std::string read_header(File& f, size_t fi, std::map<std::string, TensorInfo>* tensors) {
  Fd fd;
  uint64_t size = 0;
  std::string error;
  if (open_regular(f.path, fd, &size, &error) != Opened::kOk) return error;
  if (size < 8) return "truncated: " + std::to_string(size) + " bytes, shorter than the 8-byte header length";
  unsigned char len_bytes[8];
  error = read_exact(fd.fd, reinterpret_cast<char*>(len_bytes), 8, 0);
  if (!error.empty()) return error;
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | len_bytes[i];
  if (n > kMaxHeader) {
    return "header length " + std::to_string(n) + " is implausible (over " + std::to_string(kMaxHeader) + " bytes)";
  }
  if (8 + n > size) {
    return "truncated: the header needs " + std::to_string(8 + n) + " bytes but the file has " + std::to_string(size);
  }
  std::string header(n, '\0');
  error = read_exact(fd.fd, header.data(), n, 8);
  if (!error.empty()) return error;
  f.data_offset = 8 + n;
  f.data_len = size - 8 - n;
  Value h;
  try {
    h = mkc::json::parse(header);
  } catch (const mkc::json::ParseError& e) {
    return std::string("the header is not valid JSON: ") + e.what();
  }
  if (h.kind != Value::Object) return "the header is not a JSON object";
  for (const auto& [key, v] : h.object) {
    if (key == "__metadata__") {
      bool strings = v.kind == Value::Object;
      for (const auto& [_, x] : v.object) strings = strings && x.kind == Value::String;
      if (!strings) return "__metadata__ is not an object of strings";
      continue;
    }
    try {
      TensorInfo t = entry(v);
      t.file = fi;
      tensors->emplace(key, std::move(t));
    } catch (const mkc::json::ParseError& e) {
      return "tensor " + key + ": " + e.what();
    }
  }
  return check_layout(*tensors, f.data_len);
}

// Reads shard fi's header into ckpt: an unreadable file is one problem;
// otherwise each truncated tensor, then each tensor an earlier shard holds too.
void read_shard(mkc_checkpoint& ckpt, size_t fi) {
  File& f = ckpt.files[fi];
  std::map<std::string, TensorInfo> tensors;
  const std::string error = read_header(f, fi, &tensors);
  if (!error.empty()) {
    ckpt.problems.push_back("unreadable file " + f.name + ": " + error);
    ckpt.unreadable.insert(f.name);
    return;
  }
  for (const auto& [key, t] : tensors) {
    if (t.end > f.data_len) {
      ckpt.problems.push_back("truncated tensor " + key + " in " + f.name + ": its data ends at byte " +
                              std::to_string(t.end) + " of the data section, which holds " +
                              std::to_string(f.data_len) + " bytes");
    }
  }
  for (auto& [key, t] : tensors) {
    auto it = ckpt.tensors.find(key);
    if (it != ckpt.tensors.end()) {
      ckpt.problems.push_back("duplicate tensor " + key + ": in " + ckpt.files[it->second.file].name + " and in " +
                              f.name);
    } else {
      ckpt.tensors.emplace(key, std::move(t));
    }
  }
}

// The shard names of `root`, sorted: from the index, or every *.safetensors.
// "" or the error refusing the whole checkpoint.
std::string shard_names(const fs::path& root, mkc_checkpoint& ckpt, std::vector<std::string>* names) {
  const fs::path index = root / kIndex;
  const std::string shown = index.string();
  Fd fd;
  uint64_t size = 0;
  std::string error;
  const Opened opened = open_regular(index, fd, &size, &error);
  if (opened == Opened::kFailed) return shown + ": " + error;
  if (opened == Opened::kNotFound) {
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(root, ec)) {
      if (e.path().extension() == ".safetensors") names->push_back(e.path().filename().string());
    }
    if (ec) return "cannot read checkpoint directory " + root.string() + ": " + ec.message();
    std::sort(names->begin(), names->end());
    if (names->empty()) return root.string() + " holds no *.safetensors files and no " + kIndex;
    return "";
  }
  if (size > kMaxIndex) {
    return shown + ": " + std::to_string(size) + " bytes, over the limit of " + std::to_string(kMaxIndex);
  }
  std::string text(size, '\0');
  error = read_exact(fd.fd, text.data(), size, 0);
  if (!error.empty()) return shown + ": " + error;
  Value v;
  try {
    v = mkc::json::parse(text);
  } catch (const mkc::json::ParseError& e) {
    return shown + " is not valid JSON: " + e.what();
  }
  const Value* map = v.get("weight_map");
  if (!map || map->kind != Value::Object) return shown + " has no `weight_map` object";
  for (const auto& [key, file] : map->object) {
    if (file.kind != Value::String) return shown + ": weight_map[" + key + "] is not a file name";
    const std::string& f = file.text;
    if (f.empty() || f.find_first_of(std::string("/\\\0", 3)) != std::string::npos || f[0] == '.') {
      return shown + ": weight_map[" + key + "] names a file outside the directory: " + f;
    }
    ckpt.index[key] = f;
    names->push_back(f);
  }
  std::sort(names->begin(), names->end());
  names->erase(std::unique(names->begin(), names->end()), names->end());
  return "";
}

}  // namespace

extern "C" {

int mkc_checkpoint_open(const char* dir, mkc_checkpoint** out, char* err, size_t err_len) {
  *out = nullptr;
  try {
    auto ckpt = std::make_unique<mkc_checkpoint>();
    const fs::path root(dir);
    std::vector<std::string> names;
    const std::string error = shard_names(root, *ckpt, &names);
    if (!error.empty()) {
      copy_message(error, err, err_len);
      return -1;
    }
    for (const auto& n : names) ckpt->files.push_back(File{n, root / n, 0, 0});
    for (size_t i = 0; i < ckpt->files.size(); ++i) read_shard(*ckpt, i);
    *out = ckpt.release();
    return 0;
  } catch (const std::exception& e) {
    copy_message(std::string("cannot open checkpoint: ") + e.what(), err, err_len);
    return -1;
  }
}

int mkc_checkpoint_check(const mkc_checkpoint* ckpt, const mkc_tensor_spec* specs, size_t n, char* report,
                         size_t report_len) {
  std::vector<std::string> problems = ckpt->problems;
  for (size_t i = 0; i < n; ++i) {
    const mkc_tensor_spec& s = specs[i];
    const std::string need = dims(s.shape, s.ndim);
    auto it = ckpt->tensors.find(s.key);
    if (it == ckpt->tensors.end()) {
      // A tensor of an unreadable shard is covered by that file's line.
      auto idx = ckpt->index.find(s.key);
      if (idx == ckpt->index.end() || ckpt->unreadable.count(idx->second) == 0) {
        problems.push_back(std::string("missing tensor ") + s.key + " (" + s.dtype + " " + need + ")");
      }
      continue;
    }
    const TensorInfo& t = it->second;
    const std::string& file = ckpt->files[t.file].name;
    if (!accepts(s.dtype, t.dtype)) {
      problems.push_back(std::string("wrong dtype for ") + s.key + ": " + t.dtype + " in " + file +
                         ", the plan needs " + s.dtype);
    } else if (t.shape.size() != s.ndim || !std::equal(t.shape.begin(), t.shape.end(), s.shape)) {
      problems.push_back(std::string("wrong shape for ") + s.key + ": " + dims(t.shape) + " in " + file +
                         ", the plan needs " + need);
    }
  }
  std::string text;
  for (const auto& p : problems) text += p + "\n";
  copy_message(text, report, report_len);
  return int(problems.size());
}

size_t mkc_checkpoint_tensor_count(const mkc_checkpoint* ckpt) { return ckpt->tensors.size(); }

int64_t mkc_checkpoint_read(const mkc_checkpoint* ckpt, const char* key, void* dst, size_t dst_len, char* err,
                            size_t err_len) {
  auto it = ckpt->tensors.find(key);
  if (it == ckpt->tensors.end()) {
    copy_message(std::string("missing tensor ") + key, err, err_len);
    return -1;
  }
  const TensorInfo& t = it->second;
  const File& f = ckpt->files[t.file];
  const uint64_t bytes = t.end - t.begin;
  if (t.end > f.data_len) {
    copy_message(std::string("truncated tensor ") + key + " in " + f.name, err, err_len);
    return -1;
  }
  if (bytes > dst_len) {
    copy_message(std::string("tensor ") + key + " holds " + std::to_string(bytes) + " bytes, the buffer " +
                     std::to_string(dst_len),
                 err, err_len);
    return -1;
  }
  // Opened again as at open time: the file may have been replaced since.
  Fd fd;
  uint64_t size = 0;
  std::string error;
  if (open_regular(f.path, fd, &size, &error) == Opened::kOk) {
    error = read_exact(fd.fd, static_cast<char*>(dst), bytes, f.data_offset + t.begin);
  }
  if (!error.empty()) {
    copy_message(std::string("cannot read tensor ") + key + " from " + f.name + ": " + error, err, err_len);
    return -1;
  }
  return int64_t(bytes);
}

const char* mkc_checkpoint_dtype(const mkc_checkpoint* ckpt, const char* key) {
  const auto it = ckpt->tensors.find(key);
  return it == ckpt->tensors.end() ? nullptr : it->second.dtype.c_str();
}

void mkc_checkpoint_close(mkc_checkpoint* ckpt) { delete ckpt; }

}  // extern "C"
