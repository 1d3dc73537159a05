// mkc device library: the fused operations the generated program calls
// (generated/*/program.cuh), one function per task kind, and the row-local
// epilogue steps a projection's generated code chains after its rows.
//
// Conventions. Consumers are threads 0..255 (warps 0-7) and synchronise on
// named barrier 3 (`consumer_sync`). Activations are [batch, elements]
// row-major; weights row-major [rows, k]. Accumulation is fp32; values that
// cross operations (activations, type T) are kept in fp32 by the generated
// programs (a few KB per token: exact enough to follow an fp32 reference
// through routing decisions), or bf16.
//
// Arguments. A function the generated program calls with more than a few
// values takes them in one struct named after it (attn_res_mix: AttnResMix,
// ep_conv_update: EpConvUpdate), its fields commented, which the generated
// code spells with C++20 designated initializers; what says where a call runs
// stays positional: the page ring's position `it`, the consumer `warp`, the
// staging tile `st` (and an epilogue step's tile width `n` and span `s`).
// Short obvious calls (ep_store, ep_add, rows_load) keep plain arguments.
//
// The library is split by family under ops/; this header includes it all.
#pragma once

#include "ops/common.cuh"
#include "ops/rows.cuh"
#include "ops/fp8_rows.cuh"
#include "ops/epilogue.cuh"
#include "ops/mla.cuh"
#include "ops/kda.cuh"
#include "ops/attn_res.cuh"
#include "ops/moe.cuh"
#include "ops/exchange.cuh"
