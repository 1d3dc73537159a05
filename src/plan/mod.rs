//! The planner: from a validated op graph to a verified per-SM schedule.
//!
//! One explicit pipeline of passes with plain data between them:
//!
//! ```text
//! Validated --recompute--> Validated --fuse--> Fusion --tile--> Tiling --limits--> Tiling --arena--> Arena
//!           --specialize--> WarpPlan --schedule--> Schedule --verify--> Plan
//! ```
//!
//! - [`recompute`] copies norms read by several operations so each
//!   recomputes its own (a prologue instead of a whole-row epilogue);
//! - [`fuse`] groups graph nodes into fused operations by named rules, each
//!   with the reason it pays;
//! - [`tile`] splits each fused operation into stages of tasks sized for the
//!   target, with the bytes and FLOPs of each task;
//! - [`limits`] refuses, at the operation's graph span, what the device
//!   library cannot run (its sizes and attribute choices, contract.h);
//! - [`arena`] lays out the scratch arena: each value crossing operations,
//!   each stage's scratch, the routing log and the SMs' staging;
//! - [`specialize`] gives each task kind its warp roles, page ring and
//!   register budget and checks them against the target;
//! - [`schedule`] places tasks on SMs in static instruction lists from a cost
//!   model and computes the dependency counters and their exact counts;
//! - [`verify`] proves from the schedule alone that every read follows its
//!   write and no buffer is overwritten while it may still be read, and
//!   checks the arena layout against the tiling.
//!
//! Only [`plan`] builds a [`Plan`], and it never returns an unverified one.

pub mod arena;
pub mod dot;
pub mod estimate;
pub mod fuse;
pub mod html;
pub mod limits;
pub mod multi;
pub mod recompute;
pub mod schedule;
pub mod specialize;
pub mod tables;
pub mod tile;
pub mod verify;

use serde::Serialize;

use crate::diag::Result;
use crate::target::Target;
use crate::valid::Validated;

/// What the plan is made for.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Options {
    /// Sequences decoded together.
    pub batch: u32,
    /// Context length the attention work is sized for.
    pub context: u64,
    /// GPUs the routed experts are sharded over (expert parallelism): this
    /// plan is one GPU's, holding `experts / expert_parallel` of each MoE
    /// layer's experts and every other weight. 1: all experts here.
    #[serde(skip_serializing_if = "is_one")]
    pub expert_parallel: u32,
    /// Rows of the batch each sequence holds: a speculative verify step's
    /// consecutive positions of one sequence (the last accepted token and the
    /// drafts after it), `batch / positions` sequences. 1: plain decoding.
    #[serde(skip_serializing_if = "is_one")]
    pub positions: u32,
}

impl Options {
    /// Sequences of the batch: `batch / positions`.
    pub fn sequences(&self) -> u32 {
        self.batch / self.positions.max(1)
    }
}

fn is_one(n: &u32) -> bool {
    *n == 1
}

impl Default for Options {
    fn default() -> Self {
        Options { batch: 1, context: 4096, expert_parallel: 1, positions: 1 }
    }
}

/// A verified plan for one decode step on one target.
#[derive(Debug, Clone, Serialize)]
pub struct Plan {
    /// The model's name.
    pub model: String,
    /// The target's name.
    pub target: String,
    /// The target's architecture (`sm_90a`, ...), as nvcc names it.
    #[serde(skip)]
    pub arch: String,
    /// What it was planned for.
    pub options: Options,
    /// The fused operations.
    pub fusion: fuse::Fusion,
    /// Their tasks.
    pub tiling: tile::Tiling,
    /// Where every arena value, scratch block and staging area lives.
    #[serde(skip)]
    pub arena: arena::Arena,
    /// Warp roles per task kind.
    pub warps: specialize::WarpPlan,
    /// The per-SM instruction lists and counters.
    pub schedule: schedule::Schedule,
    /// What the verifier checked.
    pub verified: verify::Proof,
    /// The graph as planned (after [`recompute`]): node indices in the plan
    /// refer to it; the original's nodes keep their indices.
    #[serde(skip)]
    pub graph: Validated,
}

/// Plans `graph` for `target`: fuse, tile, specialize, schedule, verify.
pub fn plan(graph: &Validated, target: &Target, options: Options) -> Result<Plan> {
    let planned = recompute::recompute_shared_norms(graph)?;
    let graph = &planned;
    arena::bound(graph.graph(), options)?;
    let fusion = fuse::fuse(graph)?;
    limits::before_tiling(graph.graph(), &fusion, target, options)?;
    let tiling = tile::tile(graph, &fusion, target, options)?;
    limits::check(graph.graph(), &fusion, &tiling, options)?;
    let arena = arena::layout(graph.graph(), &fusion, &tiling, options)?;
    let warps = specialize::specialize(&tiling, target, options)?;
    let schedule = schedule::schedule(&tiling, target, options)?;
    let verified = verify::verify(&fusion, &tiling, &schedule)?;
    verify::arena(graph.graph(), &tiling, &arena)?;
    Ok(Plan {
        model: graph.graph().model.clone(),
        target: target.name.clone(),
        arch: target.arch.clone(),
        options,
        fusion,
        tiling,
        arena,
        warps,
        schedule,
        verified,
        graph: planned.clone(),
    })
}
