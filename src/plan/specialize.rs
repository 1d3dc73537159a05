//! Warp specialization: the CTA layout every SM runs, and per task kind the
//! warps it uses, its shared-memory page ring and its register budget,
//! checked against the target.
//!
//! The layout follows the open megakernels (HazyResearch's, Mirage MPK): one
//! producer warpgroup holding the controller (decodes instructions, waits on
//! counters), the loader (TMA weight tiles into the page ring, running ahead
//! of dependency waits), the storer (publishes results, signals counters) and
//! a prefetcher warp; consumer warpgroups do the math. `setmaxnreg` moves
//! registers from the producer warpgroup to the consumers.

use serde::Serialize;

use super::tile::{TaskKind, Tiling};
use super::Options;
use crate::diag::{Error, ErrorKind, Result};
use crate::target::Target;

// The page ring, scratch and staging sizes are the device's (contract.h):
// pages of PAGE_BYTES, at most PAGES of them (128 KiB in flight per SM covers
// HBM latency: 132 SMs x 128 KiB is about 4 us of the H200's bandwidth);
// SCRATCH_BYTES beside the ring for attention, routing and reductions;
// ACTIVATION_BYTES a projection task copies its input into (fp32, normed by
// its prologue) when it fits, so that every page reads it from shared memory.
// STATIC_SMEM_BYTES is left for the device library's own __shared__ arrays,
// RING_EXTRA_BYTES for the ring's barriers and FP8 pages' block scales.
pub use crate::contract::{
    ACTIVATION_BYTES, PAGES as MAX_PAGES, PAGE_BYTES, RING_EXTRA_BYTES, SCRATCH_BYTES, STATIC_SMEM_BYTES,
};
use crate::contract::{CONSUMER_WARPS, MAX_BATCH, PRODUCER_WARPS};

/// The CTA layout of the persistent kernel.
#[derive(Debug, Clone, Serialize)]
pub struct Layout {
    /// Warps of the producer warpgroup: controller, loader, storer, prefetcher.
    pub producer_warps: u32,
    /// Consumer warpgroups (4 warps each).
    pub consumer_warpgroups: u32,
    /// Threads per CTA.
    pub threads: u32,
    /// Registers per producer thread after `setmaxnreg.dec`.
    pub producer_regs: u32,
    /// Registers per consumer thread after `setmaxnreg.inc`.
    pub consumer_regs: u32,
    /// Shared-memory pages in the ring.
    pub pages: u32,
    /// Shared memory per CTA.
    pub smem_bytes: u64,
}

/// How one task kind uses the layout.
#[derive(Debug, Clone, Serialize)]
pub struct KindPlan {
    /// The task kind.
    pub kind: TaskKind,
    /// Consumer warps doing its math.
    pub compute_warps: u32,
    /// Pages of the ring it keeps in flight.
    pub ring_depth: u32,
    /// What the loader streams into the pages.
    pub streams: &'static str,
}

/// The warp plan.
#[derive(Debug, Clone, Serialize)]
pub struct WarpPlan {
    /// The CTA layout.
    pub layout: Layout,
    /// Per task kind, in kind order.
    pub kinds: Vec<KindPlan>,
}

/// Chooses the layout and checks every task kind against `target`.
pub fn specialize(tiling: &Tiling, target: &Target, opts: Options) -> Result<WarpPlan> {
    let consumer_warpgroups = CONSUMER_WARPS as u32 / 4;
    let producer_warps = PRODUCER_WARPS as u32;
    let threads = (producer_warps + 4 * consumer_warpgroups) * 32;
    let producer_regs = 40;
    let budget = target.regs_per_sm.saturating_sub(producer_warps * 32 * producer_regs);
    let consumer_regs = (budget / (consumer_warpgroups * 128)).min(256) / 8 * 8;
    let pages =
        (target.smem_per_block.saturating_sub(SCRATCH_BYTES + ACTIVATION_BYTES + STATIC_SMEM_BYTES + RING_EXTRA_BYTES)
            / PAGE_BYTES)
            .min(MAX_PAGES) as u32;
    let layout = Layout {
        producer_warps,
        consumer_warpgroups,
        threads,
        producer_regs,
        consumer_regs,
        pages,
        smem_bytes: u64::from(pages) * PAGE_BYTES + RING_EXTRA_BYTES + SCRATCH_BYTES + ACTIVATION_BYTES,
    };
    let fail = |msg: String| Err(Error::new(ErrorKind::Invalid, format!("target {}: {msg}", target.name)));
    if threads > target.max_threads_per_block {
        return fail(format!("the CTA needs {threads} threads, the target allows {}", target.max_threads_per_block));
    }
    if consumer_regs < 128 {
        return fail(format!(
            "consumers get {consumer_regs} registers per thread, fewer than the 128 the kernels need"
        ));
    }
    if pages < 4 {
        return fail(format!(
            "{} bytes of shared memory per block leave {pages} pages of {PAGE_BYTES}; the ring needs at least 4",
            target.smem_per_block
        ));
    }
    // Batches above MAX_BATCH need a wider accumulator than the register budget allows.
    if u64::from(opts.batch) > MAX_BATCH && consumer_regs < 168 {
        return fail(format!("batch {} needs 168 consumer registers, the layout has {consumer_regs}", opts.batch));
    }
    let mut kinds: Vec<TaskKind> = tiling.stages.iter().map(|s| s.kind).collect();
    kinds.sort();
    kinds.dedup();
    let warps = 4 * consumer_warpgroups;
    let kinds = kinds
        .into_iter()
        .map(|kind| {
            let (compute_warps, ring_depth, streams) = match kind {
                TaskKind::ProjectionRows | TaskKind::LmHeadRows => (warps, pages, "weight row tiles"),
                TaskKind::ExpertUp | TaskKind::ExpertDown => {
                    (warps, pages, "the routed expert's weight rows, by the id the router wrote")
                }
                TaskKind::MlaAbsorb => (warps, pages, "W_UK slices"),
                TaskKind::MlaSplit => (warps, pages, "latent-cache rows of the split"),
                TaskKind::MlaCombine => (warps, pages.min(4), "W_UV slices"),
                TaskKind::Kda => (warps, pages.min(8), "the heads' fp32 state"),
                TaskKind::AttnRes => (warps, pages.min(4), "bank rows"),
                TaskKind::Router
                | TaskKind::Argmax
                | TaskKind::Embedding
                | TaskKind::ExpertCombine
                | TaskKind::Elementwise => (4, 2, "activations"),
                TaskKind::ExchangeSend | TaskKind::ExchangeReduce => (4, 2, "the GPUs' partial sums"),
            };
            KindPlan { kind, compute_warps, ring_depth, streams }
        })
        .collect();
    Ok(WarpPlan { layout, kinds })
}
