// mkc device library: FP8 weights (Kimi K2 and DeepSeek-V3 as released) on
// the host: e4m3 decoding, and the bf16 copy the runtime makes on upload of a
// matrix the device reads as bf16 (WeightLayout::kFp8Bf16: the MLA's kv_b,
// whose W_UK and W_UV the split and the combine read as bf16 rows).
//
// A checkpoint stores an FP8 matrix [rows, k] as e4m3 codes [rows, k] and one
// fp32 scale per 128 x 128 block, [ceil(rows / 128)][ceil(k / 128)]
// (`weight_scale_inv`): W[i, e] = e4m3(code[i, e]) * scale[i / 128][e / 128].
// FP8 rows the device reads as such (fp8_rows.cuh) are uploaded as stored.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace mkc {

constexpr uint64_t kFp8ScaleBlock = 128;  // a scale's rows and columns

// e4m3 (OCP FP8 E4M3: 1 sign, 4 exponent bits of bias 7, 3 mantissa bits; no
// infinities; S.1111.111 is NaN) as a float, from its definition.
inline float e4m3_to_float(uint8_t c) {
  const int exp = (c >> 3) & 15, man = c & 7;
  if (exp == 15 && man == 7) return std::nanf("");
  const float mag = exp == 0 ? std::ldexp(float(man) / 8.f, -6) : std::ldexp(1.f + float(man) / 8.f, exp - 7);
  return (c & 0x80) ? -mag : mag;
}

// x as bf16 bits, rounded to the nearest (ties to even); NaN stays NaN.
inline uint16_t float_to_bf16_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if (std::isnan(x)) return uint16_t((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

// The scales' count of a [rows, k] matrix.
constexpr uint64_t fp8_scale_count(uint64_t rows, uint64_t k) {
  return ((rows + kFp8ScaleBlock - 1) / kFp8ScaleBlock) * ((k + kFp8ScaleBlock - 1) / kFp8ScaleBlock);
}

// codes [rows, k] and scales [ceil(rows / 128)][ceil(k / 128)] into out
// [rows, k] bf16 bits: bf16(e4m3(code) * scale), the product exact in fp32
// and rounded once.
inline void fp8_dequant_bf16(const uint8_t* codes, const float* scales, uint64_t rows, uint64_t k, uint16_t* out) {
  const uint64_t kb = (k + kFp8ScaleBlock - 1) / kFp8ScaleBlock;
  for (uint64_t i = 0; i < rows; ++i) {
    const float* s = scales + (i / kFp8ScaleBlock) * kb;
    for (uint64_t e = 0; e < k; ++e) {
      out[i * k + e] = float_to_bf16_bits(e4m3_to_float(codes[i * k + e]) * s[e / kFp8ScaleBlock]);
    }
  }
}

}  // namespace mkc
