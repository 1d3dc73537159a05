// CPU test of the GPU layout of MXFP4 weights (device/mkc/mx_layout.h): every
// byte of the tiled codes and scales of a few shapes, against the layout's
// definition written out element by element.
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include "expect.h"
#include "mkc/mx_layout.h"

namespace {

void check_shape(std::mt19937& rng, uint64_t rows, uint64_t k) {
  std::uniform_int_distribution<int> byte(0, 255);
  std::vector<uint8_t> codes(rows * k / 2), scales(rows * k / 32);
  for (auto& v : codes) v = uint8_t(byte(rng));
  for (auto& v : scales) v = uint8_t(byte(rng));
  const uint64_t tiles = (rows + 7) / 8, blocks = k / 32;
  EXPECT(mkc::mx_code_bytes(rows, k) == tiles * 8 * (k / 2), "code bytes of [%llu, %llu]", (unsigned long long)rows, (unsigned long long)k);
  EXPECT(mkc::mx_scale_bytes(rows, k) == tiles * ((blocks * 8 + 15) / 16 * 16), "scale bytes of [%llu, %llu]", (unsigned long long)rows, (unsigned long long)k);
  std::vector<uint8_t> tc(mkc::mx_code_bytes(rows, k), 0xAB), ts(mkc::mx_scale_bytes(rows, k), 0xAB);
  mkc::mx_tile_codes(codes.data(), rows, k, tc.data());
  mkc::mx_tile_scales(scales.data(), rows, k, ts.data());
  // Codes: tile t, block c, row g, byte i at ((t * blocks + c) * 8 + g) * 16 + i; element e of
  // row r is the nibble (e % 2) of byte e / 2 within its block's 16.
  uint64_t bad = 0;
  for (uint64_t t = 0; t < tiles; ++t)
    for (uint64_t c = 0; c < blocks; ++c)
      for (uint64_t g = 0; g < 8; ++g)
        for (uint64_t i = 0; i < 16; ++i) {
          const uint64_t r = t * 8 + g;
          const uint8_t want = r < rows ? codes[r * (k / 2) + c * 16 + i] : 0;
          bad += tc[((t * blocks + c) * 8 + g) * 16 + i] != want;
        }
  // Scales: tile t's block c, row g at t * stride + c * 8 + g; the padding zero.
  const uint64_t stride = (blocks * 8 + 15) / 16 * 16;
  for (uint64_t t = 0; t < tiles; ++t)
    for (uint64_t j = 0; j < stride; ++j) {
      const uint64_t c = j / 8, r = t * 8 + j % 8;
      const uint8_t want = c < blocks && r < rows ? scales[r * blocks + c] : 0;
      bad += ts[t * stride + j] != want;
    }
  EXPECT(bad == 0, "rows %llu, k %llu: %llu wrong bytes", (unsigned long long)rows, (unsigned long long)k,
         (unsigned long long)bad);
}

}  // namespace

int main() {
  std::mt19937 rng(7);
  check_shape(rng, 16, 64);     // whole tiles, an even number of blocks
  check_shape(rng, 13, 96);     // a partial tile, three blocks (scales padded)
  check_shape(rng, 8, 32);      // one block
  check_shape(rng, 40, 3584);   // K3's latent width
  // e8m0's NaN blocks (255, read as 0): codes zeroed, scale bytes set to 0, the rest untouched.
  std::vector<uint8_t> scales(13 * 3, 200), codes(13 * 96 / 2, 0x77), out(scales);
  scales[7 * 3 + 2] = 255;
  scales[9 * 3] = 255;
  EXPECT(mkc::mx_clear_nan_blocks(scales.data(), 13, 96, codes.data(), out.data()) == 2, "two NaN blocks in [13, 96]");
  uint64_t zero_codes = 0, zero_scales = 0;
  for (auto c : codes) zero_codes += c == 0;
  for (auto v : out) zero_scales += v == 0;
  EXPECT(zero_codes == 32 && codes[(7 * 3 + 2) * 16] == 0 && codes[9 * 3 * 16 + 15] == 0 && codes[(9 * 3 + 1) * 16] == 0x77,
         "the two blocks' 16 code bytes zeroed, no others");
  EXPECT(zero_scales == 2 && out[7 * 3 + 2] == 0 && out[9 * 3] == 0, "their scale bytes 0, no others");
  return report();
}
