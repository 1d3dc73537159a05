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
// The library is split by family under ops/; this header includes it all.
#pragma once

#include "ops/common.cuh"
#include "ops/rows.cuh"
#include "ops/epilogue.cuh"
#include "ops/mla.cuh"
#include "ops/kda.cuh"
#include "ops/attn_res.cuh"
#include "ops/moe.cuh"
