// mkc: the contract between the planner and the device library. Every
// constant both sides use is defined here, once: the device code includes
// this file, and the compiler's build (build.rs) reads it and defines the same
// names as Rust constants (src/contract.rs: kScratchBytes becomes
// SCRATCH_BYTES), which the planner and the emitter check every operation
// against. Plain C++, one `constexpr int|uint32_t kName = VALUE;` a line, VALUE an
// integer, a name defined above, or one `*` or `<<` of two of them.
#pragma once

#include <cstdint>

namespace mkc {

// The CTA: consumer warps do the math (two warpgroups); the producer
// warpgroup holds the loader, the controller, the storer and the prefetcher.
constexpr int kConsumerWarps = 8;
constexpr int kProducerWarps = 4;

// The weight ring: pages of kPageRows rows of kPageK bf16 weights (16 KiB).
constexpr int kPageRows = kConsumerWarps;
constexpr int kPageK = 1024;
constexpr int kPageBytes = 16384;
// Pages in the ring: 128 KiB in flight per SM covers HBM latency.
constexpr int kPages = 8;
// Shared memory beside the ring for attention, experts and routing, then the
// projections' staged activations.
constexpr int kScratchBytes = 24 << 10;
constexpr int kActivationBytes = 64 << 10;
// Beside its pages the ring holds its barriers and each page's FP8 block
// scales (projection.cuh's Ring): at most this much.
constexpr int kRingExtraBytes = 1280;
// The kernel's static shared memory (the device library's __shared__ arrays)
// is at most this much beside the dynamic ring, scratch and activations: the
// planner leaves it out of the target's shared memory, the runtime checks it.
constexpr int kStaticSmemBytes = 9 << 10;

// Sequences per step the projections' accumulators hold without the wider
// register budget.
constexpr int kMaxBatch = 8;

// MXFP4 weights on the GPU (mx_layout.h): tiles of kMxTileRows rows, a scale
// per kMxBlock elements.
constexpr uint32_t kMxTileRows = 8;
constexpr uint32_t kMxBlock = 32;

// FP8 weights (fp8_rows.cuh): e4m3 rows as stored, whose widths are
// multiples of kFp8Align (each row's codes a whole number of 16-byte runs).
constexpr uint32_t kFp8Align = 16;
// Their scales: one fp32 per kFp8Block x kFp8Block block.
constexpr uint32_t kFp8Block = 128;

// MLA decode: heads per task (a warp each in the softmax); a split's lane
// holds kMlaLanePairs column pairs of a cache row, so rows (latent + RoPE) of
// at most 64 x kMlaLanePairs elements; latent widths up to kMlaMaxLatent.
constexpr uint32_t kMaxMlaHeads = 8;
constexpr uint32_t kMlaLanePairs = 9;
constexpr uint32_t kMlaMaxRow = 64 * kMlaLanePairs;
constexpr uint32_t kMlaMaxLatent = 512;
// The split's folds run on the tensor cores where the latent and RoPE widths
// are whole blocks of kMlaMmaColumns (mla_fold_mma: a lane's eight columns of
// each 32 are its k-slots of two MMA steps).
constexpr uint32_t kMlaMmaColumns = 32;

// Speculative decoding: a verify step carries up to kMaxPositions consecutive
// positions of each sequence (the last accepted token and the drafts after
// it) as that many rows of the batch.
constexpr uint32_t kMaxPositions = 8;

// KDA decode: head sizes up to kMaxKdaDim.
constexpr uint32_t kMaxKdaDim = 256;

// The router: expert groups ranked a lane each, up to kRouterMaxGroups.
constexpr uint32_t kRouterMaxGroups = 64;

// Routed experts: batch x top-k choices per step, up to kMoeMaxChoices.
constexpr uint32_t kMoeMaxChoices = 512;

// Several GPUs (an expert-parallel program, ops/exchange.cuh): up to
// kMaxRanks GPUs of one NVLink domain (a GB300 NVL72's).
constexpr uint32_t kMaxRanks = 72;

// The attention-residual mix: banks of up to kMaxBankRows rows (plus the
// current one, a lane each).
constexpr uint32_t kMaxBankRows = 31;

}  // namespace mkc
