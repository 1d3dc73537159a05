// mkc runtime: the checkpoint reader behind include/mkc/checkpoint.h.

#include "mkc/checkpoint.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "json.hpp"

namespace fs = std::filesystem;

namespace {

constexpr uint64_t kMaxHeader = 256ull << 20;

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
  std::string error;  // non-empty: unreadable
};

double dtype_size(const std::string& d) {
  if (d == "F64" || d == "I64" || d == "U64") return 8;
  if (d == "F32" || d == "I32" || d == "U32") return 4;
  if (d == "F16" || d == "BF16" || d == "I16" || d == "U16") return 2;
  if (d == "F8_E4M3" || d == "F8_E5M2" || d == "F8_E8M0" || d == "U8" || d == "I8" || d == "BOOL") return 1;
  if (d == "F4") return 0.5;
  return -1;
}

std::string dims(const uint64_t* s, size_t n) {
  std::string out = "[";
  for (size_t i = 0; i < n; ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

bool accepts(const std::string& need, const std::string& found) {
  return need == found || (need == "F32" && (found == "BF16" || found == "F16"));
}

void copy_message(const std::string& msg, char* dst, size_t len) {
  if (!dst || len == 0) return;
  const size_t n = std::min(msg.size(), len - 1);
  std::memcpy(dst, msg.data(), n);
  dst[n] = '\0';
}

}  // namespace

struct mkc_checkpoint {
  std::vector<File> files;
  std::map<std::string, TensorInfo> tensors;
  std::vector<std::string> problems;  // found while opening (truncation, unreadable files)
  std::set<size_t> unreadable;
  std::map<std::string, std::string> index;  // key -> file name, from the index
};

namespace {

// Reads one shard's header into ckpt; problems go to ckpt->problems.
void read_shard(mkc_checkpoint& ckpt, size_t fi) {
  File& f = ckpt.files[fi];
  std::ifstream in(f.path, std::ios::binary);
  std::error_code ec;
  const uint64_t size = fs::file_size(f.path, ec);
  if (!in || ec) {
    f.error = "cannot open";
  } else if (size < 8) {
    f.error = "truncated: " + std::to_string(size) + " bytes, shorter than the 8-byte header length";
  } else {
    unsigned char len_bytes[8];
    in.read(reinterpret_cast<char*>(len_bytes), 8);
    uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = (n << 8) | len_bytes[i];
    if (n > kMaxHeader) {
      f.error = "header length " + std::to_string(n) + " is implausible";
    } else if (8 + n > size) {
      f.error = "truncated: the header needs " + std::to_string(8 + n) + " bytes but the file has " + std::to_string(size);
    } else {
      std::string header(n, '\0');
      in.read(header.data(), std::streamsize(n));
      f.data_offset = 8 + n;
      f.data_len = size - 8 - n;
      try {
        const mkc::json::Value h = mkc::json::parse(header);
        if (h.kind != mkc::json::Value::Object) throw mkc::json::ParseError("the header is not an object");
        for (const auto& [key, v] : h.object) {
          if (key == "__metadata__") continue;
          const auto* dt = v.get("dtype");
          const auto* sh = v.get("shape");
          const auto* off = v.get("data_offsets");
          if (!dt || dt->kind != mkc::json::Value::String || !sh || sh->kind != mkc::json::Value::Array || !off ||
              off->kind != mkc::json::Value::Array || off->array.size() != 2 || !off->array[0].is_uint ||
              !off->array[1].is_uint) {
            ckpt.problems.push_back("unreadable file " + f.name + ": bad header entry for tensor " + key);
            continue;
          }
          TensorInfo t;
          t.dtype = dt->string;
          t.file = fi;
          t.begin = off->array[0].uint;
          t.end = off->array[1].uint;
          uint64_t elements = 1;
          bool ok = true;
          for (const auto& d : sh->array) {
            ok = ok && d.is_uint;
            t.shape.push_back(d.uint);
            elements *= d.uint;
          }
          if (!ok) {
            ckpt.problems.push_back("unreadable file " + f.name + ": bad shape for tensor " + key);
            continue;
          }
          const double es = dtype_size(t.dtype);
          if (t.end > f.data_len || t.begin > t.end) {
            ckpt.problems.push_back("truncated tensor " + key + " in " + f.name + ": its data ends at byte " +
                                    std::to_string(t.end) + " of the data section, which holds " +
                                    std::to_string(f.data_len) + " bytes");
          } else if (es > 0 && uint64_t(std::ceil(double(elements) * es)) != t.end - t.begin) {
            ckpt.problems.push_back("truncated tensor " + key + " in " + f.name + ": " +
                                    std::to_string(t.end - t.begin) + " bytes for " + t.dtype + " " +
                                    dims(t.shape.data(), t.shape.size()));
          }
          ckpt.tensors[key] = std::move(t);
        }
      } catch (const std::exception& e) {
        f.error = std::string("the header is not valid JSON: ") + e.what();
      }
    }
  }
  if (!f.error.empty()) {
    ckpt.problems.push_back("unreadable file " + f.name + ": " + f.error);
    ckpt.unreadable.insert(fi);
  }
}

}  // namespace

extern "C" {

int mkc_checkpoint_open(const char* dir, mkc_checkpoint** out, char* err, size_t err_len) {
  *out = nullptr;
  try {
    auto ckpt = std::make_unique<mkc_checkpoint>();
    const fs::path root(dir);
    const fs::path index = root / "model.safetensors.index.json";
    std::vector<std::string> names;
    if (fs::exists(index)) {
      std::ifstream in(index);
      std::stringstream text;
      text << in.rdbuf();
      mkc::json::Value v;
      try {
        v = mkc::json::parse(text.str());
      } catch (const std::exception& e) {
        copy_message(index.string() + " is not valid JSON: " + e.what(), err, err_len);
        return -1;
      }
      const auto* map = v.get("weight_map");
      if (!map || map->kind != mkc::json::Value::Object) {
        copy_message(index.string() + " has no `weight_map` object", err, err_len);
        return -1;
      }
      for (const auto& [key, file] : map->object) {
        if (file.kind != mkc::json::Value::String || file.string.find('/') != std::string::npos ||
            file.string.empty() || file.string[0] == '.') {
          copy_message(index.string() + ": weight_map[" + key + "] is not a file name in the directory", err, err_len);
          return -1;
        }
        ckpt->index[key] = file.string;
        names.push_back(file.string);
      }
      std::sort(names.begin(), names.end());
      names.erase(std::unique(names.begin(), names.end()), names.end());
    } else {
      std::error_code ec;
      for (const auto& e : fs::directory_iterator(root, ec)) {
        if (e.path().extension() == ".safetensors") names.push_back(e.path().filename().string());
      }
      if (ec) {
        copy_message("cannot read checkpoint directory " + root.string() + ": " + ec.message(), err, err_len);
        return -1;
      }
      std::sort(names.begin(), names.end());
      if (names.empty()) {
        copy_message(root.string() + " holds no *.safetensors files and no model.safetensors.index.json", err, err_len);
        return -1;
      }
    }
    for (const auto& n : names) ckpt->files.push_back(File{n, root / n, 0, 0, {}});
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
      bool in_unreadable = false;
      if (idx != ckpt->index.end()) {
        for (size_t f : ckpt->unreadable) in_unreadable |= ckpt->files[f].name == idx->second;
      }
      if (!in_unreadable) problems.push_back(std::string("missing tensor ") + s.key + " (" + s.dtype + " " + need + ")");
      continue;
    }
    const TensorInfo& t = it->second;
    const std::string& file = ckpt->files[t.file].name;
    if (!accepts(s.dtype, t.dtype)) {
      problems.push_back(std::string("wrong dtype for ") + s.key + ": " + t.dtype + " in " + file +
                         ", the plan needs " + s.dtype);
    } else if (t.shape.size() != s.ndim || !std::equal(t.shape.begin(), t.shape.end(), s.shape)) {
      problems.push_back(std::string("wrong shape for ") + s.key + ": " + dims(t.shape.data(), t.shape.size()) +
                         " in " + file + ", the plan needs " + need);
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
  if (t.end > f.data_len || t.begin > t.end) {
    copy_message(std::string("truncated tensor ") + key + " in " + f.name, err, err_len);
    return -1;
  }
  if (bytes > dst_len) {
    copy_message(std::string("tensor ") + key + " holds " + std::to_string(bytes) + " bytes, the buffer " +
                     std::to_string(dst_len),
                 err, err_len);
    return -1;
  }
  std::ifstream in(f.path, std::ios::binary);
  in.seekg(std::streamoff(f.data_offset + t.begin));
  in.read(static_cast<char*>(dst), std::streamsize(bytes));
  if (!in) {
    copy_message(std::string("cannot read tensor ") + key + " from " + f.name, err, err_len);
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
