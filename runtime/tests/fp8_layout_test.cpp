// CPU test of FP8 weights on the host (device/mkc/fp8_layout.h): e4m3 codes
// against values written out from the format's table, bf16 rounding at its
// ties, and the bf16 copy of a matrix with partial 128 x 128 blocks against
// the definition element by element.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "expect.h"
#include "mkc/fp8_layout.h"

namespace {

float bf16_value(uint16_t b) {
  const uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

void codes() {
  // (code, value): zero, the smallest subnormal, the largest subnormal, the smallest normal, one,
  // the largest finite value (448), and their negatives.
  const struct {
    uint8_t c;
    float v;
  } table[] = {{0x00, 0.f},          {0x01, 0.001953125f}, {0x07, 0.013671875f}, {0x08, 0.015625f},
               {0x38, 1.f},          {0x3c, 1.5f},         {0x40, 2.f},          {0x7e, 448.f},
               {0x80, -0.f},         {0xb8, -1.f},         {0xfe, -448.f},       {0x77, 240.f}};
  for (const auto& t : table) {
    const float got = mkc::e4m3_to_float(t.c);
    EXPECT(got == t.v && std::signbit(got) == std::signbit(t.v), "e4m3 0x%02x: %g, expected %g", t.c, got, t.v);
  }
  EXPECT(std::isnan(mkc::e4m3_to_float(0x7f)) && std::isnan(mkc::e4m3_to_float(0xff)), "e4m3 NaN codes");
  // Every other code is finite, and the positive codes increase.
  for (int c = 1; c < 0x7f; ++c) {
    EXPECT(mkc::e4m3_to_float(uint8_t(c)) > mkc::e4m3_to_float(uint8_t(c - 1)), "e4m3 0x%02x increases", c);
    EXPECT(mkc::e4m3_to_float(uint8_t(c | 0x80)) == -mkc::e4m3_to_float(uint8_t(c)), "e4m3 0x%02x sign", c);
  }
}

void rounding() {
  EXPECT(mkc::float_to_bf16_bits(1.f) == 0x3f80, "1");
  // 1 + 2^-8 lies halfway between 1 and 1 + 2^-7: to even (1); 1 + 3 * 2^-8 to even (1 + 2^-6).
  EXPECT(mkc::float_to_bf16_bits(1.f + std::ldexp(1.f, -8)) == 0x3f80, "tie to even, down");
  EXPECT(mkc::float_to_bf16_bits(1.f + 3 * std::ldexp(1.f, -8)) == 0x3f82, "tie to even, up");
  EXPECT(mkc::float_to_bf16_bits(1.f + std::ldexp(1.f, -8) + std::ldexp(1.f, -20)) == 0x3f81, "above the tie");
  EXPECT(mkc::float_to_bf16_bits(-2.5f) == 0xc020, "-2.5");
  EXPECT(std::isnan(bf16_value(mkc::float_to_bf16_bits(std::nanf("")))), "NaN stays NaN");
}

void dequant(std::mt19937& rng, uint64_t rows, uint64_t k) {
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> scale(0.001f, 0.01f);
  std::vector<uint8_t> c(rows * k);
  for (auto& v : c) {
    do v = uint8_t(byte(rng));
    while ((v & 0x7f) == 0x7f);
  }
  const uint64_t kb = (k + 127) / 128;
  std::vector<float> s(mkc::fp8_scale_count(rows, k));
  EXPECT(s.size() == ((rows + 127) / 128) * kb, "scale count of [%llu, %llu]", (unsigned long long)rows,
         (unsigned long long)k);
  for (auto& v : s) v = scale(rng);
  std::vector<uint16_t> out(rows * k, 0xffff);
  mkc::fp8_dequant_bf16(c.data(), s.data(), rows, k, out.data());
  uint64_t bad = 0;
  for (uint64_t i = 0; i < rows; ++i) {
    for (uint64_t e = 0; e < k; ++e) {
      const double w = double(mkc::e4m3_to_float(c[i * k + e])) * s[(i / 128) * kb + e / 128];
      const double got = bf16_value(out[i * k + e]);
      // bf16 keeps 8 significant bits: within half an ulp, at most 2^-8 relative.
      if (!(std::abs(got - w) <= std::ldexp(std::abs(w), -8))) ++bad;
    }
  }
  EXPECT(bad == 0, "[%llu, %llu]: %llu elements off", (unsigned long long)rows, (unsigned long long)k,
         (unsigned long long)bad);
}

}  // namespace

int main() {
  std::mt19937 rng(7);
  codes();
  rounding();
  dequant(rng, 128, 128);  // one block
  dequant(rng, 130, 260);  // partial blocks at both edges
  dequant(rng, 3, 512);    // rows of one partial block
  return report();
}
