// A strict JSON reader for safetensors headers and index files: a
// line-by-line translation of the compiler's (src/checkpoint/json.rs), so the
// runtime and `mkc check` refuse the same files with the same messages
// (tests/fixtures/hostile_checkpoints holds the cases both are run over).
//
// The rules, beyond RFC 8259: the text must be UTF-8; an object may not repeat
// a key; a \u escape of a high surrogate must be followed by one of a low
// surrogate (the pair is one character), and a lone surrogate is refused;
// arrays and objects nest at most kMaxDepth deep (so a hostile file cannot
// exhaust the stack). Numbers keep their text; Value::as_u64 accepts a plain
// non-negative integer that fits in 64 bits and nothing else (no strtoull:
// it reads "-512" as 2^64 - 512). Every error ends "at byte N".
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

namespace mkc::json {

// Deepest nesting of arrays and objects accepted (a header needs 3).
constexpr size_t kMaxDepth = 64;

struct Value {
  enum Kind { Null, Bool, Number, String, Array, Object } kind = Null;
  bool boolean = false;
  std::string text;  // a Number as written, or a String
  std::vector<Value> array;
  std::map<std::string, Value> object;  // ordered by key bytes, as the compiler's

  const Value* get(const std::string& key) const {
    if (kind != Object) return nullptr;
    auto it = object.find(key);
    return it != object.end() ? &it->second : nullptr;
  }

  // The value as a 64-bit unsigned integer in *out; nullptr, or what is wrong
  // with it ("is negative", "is not an integer", "is too large", "is not a number").
  const char* as_u64(uint64_t* out) const {
    if (kind != Number) return "is not a number";
    if (text[0] == '-') return "is negative";
    if (text.find_first_of(".eE") != std::string::npos) return "is not an integer";
    uint64_t v = 0;
    for (const char c : text) {
      if (__builtin_mul_overflow(v, uint64_t{10}, &v) || __builtin_add_overflow(v, uint64_t(c - '0'), &v)) {
        return "is too large";
      }
    }
    *out = v;
    return nullptr;
  }
};

struct ParseError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The offset of the first byte of `s` that does not begin a well-formed UTF-8
// character (overlong forms, surrogates and code points past U+10FFFF are not
// well-formed), or s.size(): Rust's Utf8Error::valid_up_to.
inline size_t utf8_valid_up_to(const std::string& s) {
  size_t i = 0;
  const size_t n = s.size();
  auto at = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  auto cont = [&](size_t k, unsigned lo, unsigned hi) { return k < n && at(k) >= lo && at(k) <= hi; };
  while (i < n) {
    const unsigned c = at(i);
    size_t len = 0;
    if (c < 0x80) {
      len = 1;
    } else if (c >= 0xC2 && c <= 0xDF) {
      len = cont(i + 1, 0x80, 0xBF) ? 2 : 0;
    } else if (c >= 0xE0 && c <= 0xEF) {
      const unsigned lo = c == 0xE0 ? 0xA0 : 0x80, hi = c == 0xED ? 0x9F : 0xBF;
      len = cont(i + 1, lo, hi) && cont(i + 2, 0x80, 0xBF) ? 3 : 0;
    } else if (c >= 0xF0 && c <= 0xF4) {
      const unsigned lo = c == 0xF0 ? 0x90 : 0x80, hi = c == 0xF4 ? 0x8F : 0xBF;
      len = cont(i + 1, lo, hi) && cont(i + 2, 0x80, 0xBF) && cont(i + 3, 0x80, 0xBF) ? 4 : 0;
    }
    if (len == 0) return i;
    i += len;
  }
  return n;
}

class Parser {
 public:
  explicit Parser(const std::string& text) : s_(text) {}

  Value parse() {
    const size_t valid = utf8_valid_up_to(s_);
    if (valid != s_.size()) throw ParseError("not UTF-8 at byte " + std::to_string(valid));
    Value v = value(1);
    ws();
    if (i_ != s_.size()) fail("trailing characters");
    return v;
  }

 private:
  const std::string& s_;
  size_t i_ = 0;

  [[noreturn]] void fail(const std::string& what) const { fail_at(what, i_); }
  [[noreturn]] static void fail_at(const std::string& what, size_t at) {
    throw ParseError(what + " at byte " + std::to_string(at));
  }
  // The byte at i_, or -1 at the end.
  int peek() const { return i_ < s_.size() ? static_cast<unsigned char>(s_[i_]) : -1; }
  bool starts_with(const char* word) const { return s_.compare(i_, std::char_traits<char>::length(word), word) == 0; }

  void ws() {
    while (peek() == ' ' || peek() == '\n' || peek() == '\r' || peek() == '\t') ++i_;
  }

  Value value(size_t depth) {
    ws();
    const int c = peek();
    if (c < 0) fail("unexpected end");
    if ((c == '{' || c == '[') && depth > kMaxDepth) fail("nesting deeper than 64");
    if (c == '{') return object(depth);
    if (c == '[') return array(depth);
    Value v;
    if (c == '"') {
      v.kind = Value::String;
      v.text = string();
    } else if (c == 't') {
      literal("true");
      v.kind = Value::Bool;
      v.boolean = true;
    } else if (c == 'f') {
      literal("false");
      v.kind = Value::Bool;
    } else if (c == 'n') {
      literal("null");
    } else if (c == '-' || (c >= '0' && c <= '9')) {
      v = number();
    } else {
      fail("unexpected character");
    }
    return v;
  }

  void literal(const char* word) {
    if (!starts_with(word)) fail("unexpected character");
    i_ += std::char_traits<char>::length(word);
  }

  Value object(size_t depth) {
    ++i_;
    Value v;
    v.kind = Value::Object;
    ws();
    if (peek() == '}') {
      ++i_;
      return v;
    }
    while (true) {
      ws();
      if (peek() != '"') fail("expected a string key");
      const size_t at = i_;
      std::string key = string();
      if (v.object.count(key) != 0) fail_at("duplicate key \"" + key + "\"", at);
      ws();
      if (peek() != ':') fail("expected ':'");
      ++i_;
      Value item = value(depth + 1);
      v.object.emplace(std::move(key), std::move(item));
      ws();
      if (peek() == ',') {
        ++i_;
      } else if (peek() == '}') {
        ++i_;
        return v;
      } else {
        fail("expected ',' or '}'");
      }
    }
  }

  Value array(size_t depth) {
    ++i_;
    Value v;
    v.kind = Value::Array;
    ws();
    if (peek() == ']') {
      ++i_;
      return v;
    }
    while (true) {
      v.array.push_back(value(depth + 1));
      ws();
      if (peek() == ',') {
        ++i_;
      } else if (peek() == ']') {
        ++i_;
        return v;
      } else {
        fail("expected ',' or ']'");
      }
    }
  }

  size_t digits() {
    const size_t start = i_;
    while (peek() >= '0' && peek() <= '9') ++i_;
    return i_ - start;
  }

  Value number() {
    const size_t start = i_;
    if (peek() == '-') ++i_;
    if (peek() == '0') {
      ++i_;
    } else if (digits() == 0) {
      fail("bad number");
    }
    if (peek() == '.') {
      ++i_;
      if (digits() == 0) fail("bad number");
    }
    if (peek() == 'e' || peek() == 'E') {
      ++i_;
      if (peek() == '+' || peek() == '-') ++i_;
      if (digits() == 0) fail("bad number");
    }
    Value v;
    v.kind = Value::Number;
    v.text = s_.substr(start, i_ - start);
    return v;
  }

  uint32_t hex4() {
    uint32_t v = 0;
    for (int k = 0; k < 4; ++k) {
      const int c = peek();
      uint32_t d = 0;
      if (c >= '0' && c <= '9') {
        d = uint32_t(c - '0');
      } else if (c >= 'a' && c <= 'f') {
        d = uint32_t(c - 'a' + 10);
      } else if (c >= 'A' && c <= 'F') {
        d = uint32_t(c - 'A' + 10);
      } else {
        fail("bad \\u escape");
      }
      v = v * 16 + d;
      ++i_;
    }
    return v;
  }

  std::string string() {
    ++i_;
    std::string out;
    while (true) {
      const int c = peek();
      if (c < 0) fail("unterminated string");
      ++i_;
      if (c == '"') return out;
      if (c == '\\') {
        escape(out);
      } else if (c < 0x20) {
        --i_;
        fail("control character in a string");
      } else {
        out.push_back(char(c));
      }
    }
  }

  void escape(std::string& out) {
    const int e = peek();
    if (e < 0) fail("unterminated string");
    ++i_;
    switch (e) {
      case '"': out.push_back('"'); return;
      case '\\': out.push_back('\\'); return;
      case '/': out.push_back('/'); return;
      case 'b': out.push_back('\b'); return;
      case 'f': out.push_back('\f'); return;
      case 'n': out.push_back('\n'); return;
      case 'r': out.push_back('\r'); return;
      case 't': out.push_back('\t'); return;
      case 'u': break;
      default: --i_; fail("bad escape");
    }
    const size_t at = i_ - 2;
    uint32_t cp = hex4();
    if (cp >= 0xDC00 && cp < 0xE000) fail_at("lone surrogate", at);
    if (cp >= 0xD800 && cp < 0xDC00) {
      if (!starts_with("\\u")) fail_at("lone surrogate", at);
      i_ += 2;
      const uint32_t low = hex4();
      if (low < 0xDC00 || low >= 0xE000) fail_at("lone surrogate", at);
      cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
    }
    if (cp < 0x80) {
      out.push_back(char(cp));
    } else if (cp < 0x800) {
      out.push_back(char(0xC0 | (cp >> 6)));
      out.push_back(char(0x80 | (cp & 0x3F)));
    } else if (cp < 0x10000) {
      out.push_back(char(0xE0 | (cp >> 12)));
      out.push_back(char(0x80 | ((cp >> 6) & 0x3F)));
      out.push_back(char(0x80 | (cp & 0x3F)));
    } else {
      out.push_back(char(0xF0 | (cp >> 18)));
      out.push_back(char(0x80 | ((cp >> 12) & 0x3F)));
      out.push_back(char(0x80 | ((cp >> 6) & 0x3F)));
      out.push_back(char(0x80 | (cp & 0x3F)));
    }
  }
};

inline Value parse(const std::string& text) { return Parser(text).parse(); }

}  // namespace mkc::json
