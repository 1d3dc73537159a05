// mkc device library: the layout MXFP4 weights take on the GPU, and the host
// functions that put a checkpoint's tensors in it (the runtime calls them on
// upload; device/tests build their inputs with them).
//
// A checkpoint stores an MXFP4 matrix [rows, k] as codes [rows, k / 2] (two
// e2m1 codes a byte, the low nibble first) and scales [rows, k / 32] (one
// e8m0 byte per 32 elements). On the GPU the rows go in tiles of
// kMxTileRows (the page ring's rows) and each tile's 32-element blocks one
// after the other:
//
//   codes  [ceil(rows / 8)][k / 32][8 rows][16 bytes]
//   scales [ceil(rows / 8)][k / 32][8 rows], each tile's scales padded to 16 bytes
//
// so a tile's codes for a range of blocks are one contiguous run (one bulk
// copy into a page), the eight rows' 16 bytes of a block are 128 contiguous
// bytes (a warp reading one 4-byte word of each row touches 32 banks once; and
// the K-major canonical layout of 8 x 16-byte core matrices that Blackwell's
// tcgen05 MMA reads), and a tile's scales are one copy. Rows past the matrix's
// last (a partial tile) are zero codes with zero scale bytes (2^-127 x 0 = 0).
// A scale byte of 255 (e8m0's NaN) reads as 0, as SGLang's dequantisation has
// it: on upload the block's codes are zeroed and the byte set to 0
// (mx_clear_nan_blocks), so the device decodes scales without a test for it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "contract.h"

#ifdef __CUDACC__
#define MKC_HOST_DEVICE __host__ __device__
#else
#define MKC_HOST_DEVICE
#endif

namespace mkc {

// How the runtime lays a checkpoint tensor out on the GPU (the code
// generator's plan file says, per tensor).
enum class WeightLayout : uint8_t {
  kAsStored,  // the stored bytes (an f32 tensor stored as bf16 or f16 widened)
  kMxCodes,   // MXFP4 codes [rows, k / 2], tiled as below
  kMxScales,  // MXFP4 scales [rows, k / 32], tiled as below
  kFp8Bf16,   // FP8 e4m3 codes [rows, k] dequantised to bf16 with their block scales (fp8_layout.h),
              // which the weight table lists right after them
};

// kMxTileRows and kMxBlock (elements per scale): contract.h.
constexpr uint32_t kMxBlockBytes = 16;    // a block's codes in one row
constexpr uint32_t kMxTileBlockBytes = kMxTileRows * kMxBlockBytes;  // a block's codes in one tile: 128

// The bytes one tile takes: its codes, and its scales padded to 16 bytes.
MKC_HOST_DEVICE constexpr uint64_t mx_tile_code_bytes(uint64_t k) { return k / kMxBlock * kMxTileBlockBytes; }
MKC_HOST_DEVICE constexpr uint64_t mx_tile_scale_bytes(uint64_t k) { return (k / kMxBlock * kMxTileRows + 15) / 16 * 16; }
MKC_HOST_DEVICE constexpr uint64_t mx_tiles(uint64_t rows) { return (rows + kMxTileRows - 1) / kMxTileRows; }

// The GPU sizes of a [rows, k] matrix's codes and scales.
MKC_HOST_DEVICE constexpr uint64_t mx_code_bytes(uint64_t rows, uint64_t k) { return mx_tiles(rows) * mx_tile_code_bytes(k); }
MKC_HOST_DEVICE constexpr uint64_t mx_scale_bytes(uint64_t rows, uint64_t k) { return mx_tiles(rows) * mx_tile_scale_bytes(k); }

// codes [rows, k / 2] (the checkpoint's) into out (mx_code_bytes(rows, k)
// bytes); k a multiple of 32.
inline void mx_tile_codes(const uint8_t* codes, uint64_t rows, uint64_t k, uint8_t* out) {
  const uint64_t blocks = k / kMxBlock, row_bytes = k / 2;
  std::memset(out, 0, size_t(mx_code_bytes(rows, k)));
  for (uint64_t r = 0; r < rows; ++r) {
    uint8_t* tile = out + (r / kMxTileRows) * mx_tile_code_bytes(k) + (r % kMxTileRows) * kMxBlockBytes;
    for (uint64_t c = 0; c < blocks; ++c) {
      std::memcpy(tile + c * kMxTileBlockBytes, codes + r * row_bytes + c * kMxBlockBytes, kMxBlockBytes);
    }
  }
}

// scales [rows, k / 32] (the checkpoint's) into out (mx_scale_bytes(rows, k)
// bytes); k a multiple of 32.
inline void mx_tile_scales(const uint8_t* scales, uint64_t rows, uint64_t k, uint8_t* out) {
  const uint64_t blocks = k / kMxBlock;
  std::memset(out, 0, size_t(mx_scale_bytes(rows, k)));
  for (uint64_t r = 0; r < rows; ++r) {
    uint8_t* tile = out + (r / kMxTileRows) * mx_tile_scale_bytes(k) + r % kMxTileRows;
    for (uint64_t c = 0; c < blocks; ++c) tile[c * kMxTileRows] = scales[r * blocks + c];
  }
}

// Blocks whose scale byte is 255 (e8m0's NaN, read as 0) of a [rows, k]
// matrix in the checkpoint's layout: their 16 code bytes zeroed (`codes`, or
// null) and their scale bytes set to 0 (`scales_out`, or null; may be
// `scales`), so every such weight is 0 x 2^-127 = 0. Returns the count.
inline uint64_t mx_clear_nan_blocks(const uint8_t* scales, uint64_t rows, uint64_t k, uint8_t* codes,
                                    uint8_t* scales_out) {
  const uint64_t n = rows * (k / kMxBlock);
  uint64_t found = 0;
  for (uint64_t i = 0; i < n; ++i) {
    if (scales[i] != 255) continue;
    ++found;
    if (codes != nullptr) std::memset(codes + i * kMxBlockBytes, 0, kMxBlockBytes);
    if (scales_out != nullptr) scales_out[i] = 0;
  }
  return found;
}

}  // namespace mkc
