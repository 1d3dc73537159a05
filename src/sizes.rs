//! Sizes: the one place where the bytes `check`, `plan` and `codegen` print
//! are defined and computed (docs/SIZES.md is the glossary).
//!
//! Four terms, each in bytes (printed in decimal units, 1 GB = 10^9 B):
//! - *per sequence*: what one sequence owns at the context length (its KV
//!   cache, KDA recurrent state and conv windows);
//! - *per step*: what one decode step reads or writes (moved), at a batch;
//! - *resident*: what one GPU holds in HBM for the whole run;
//! - *moved*: read or written through HBM by one step (a per-step quantity).
//!
//! From the validated graph alone ([`graph_sizes`]): weights resident and
//! weights read per step (with expert parallelism, one GPU's share of the
//! routed experts), state per sequence and resident. From a plan
//! ([`Resident::of_plan`]): the scratch arena and the device tables, which
//! complete what one GPU must hold; [`Resident::smallest_expert_parallel`]
//! says how many GPUs the routed experts must be spread over to fit.
//!
//! It does not model communication buffers for expert dispatch, the CUDA
//! context, or allocator slack: a plan that fits by a few percent may not.

use std::fmt::Write;

use serde::Serialize;

use crate::ir::{DType, Graph, NodeId, NodeKind};
use crate::ops::OpKind;
use crate::plan::Plan;
use crate::report::{bytes, expected_distinct_experts};
use crate::valid::Validated;

/// The largest expert-parallel degree `--expert-parallel` accepts.
pub const MAX_EXPERT_PARALLEL: u32 = 4096;

/// The graph's sizes at a batch, context and expert-parallel degree.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct GraphSizes {
    /// Sequences per step.
    pub batch: u64,
    /// Tokens of context the state is sized for.
    pub context: u64,
    /// GPUs the routed experts are sharded over (1: all on this GPU).
    pub expert_parallel: u64,
    /// Weights one GPU holds, resident: every weight, and of each
    /// routed-expert family `ceil(E / ep)` of its `E` experts; scales included.
    pub weights_resident: u64,
    /// Of them, the routed experts' bytes.
    pub routed_resident: u64,
    /// Weights one step reads (moved, per step): every non-expert weight
    /// once, `batch` embedding rows, and per routed family the expected
    /// distinct experts `E (1 - (1 - k/E)^B)` over `ep` (at most the slots).
    pub weights_read: u64,
    /// State one sequence owns at `context` (per sequence).
    pub state_per_sequence: u64,
}

impl GraphSizes {
    /// State resident: `batch` sequences at `context`.
    pub fn state_resident(&self) -> u64 {
        self.state_per_sequence.saturating_mul(self.batch)
    }
}

/// How a step reads a weight: a routed-expert family (each token reads
/// `top_k` of its members), an embedding table (a row per token), or whole.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightUse {
    /// Read only by `moe` ops, `top_k` members per token (the largest of its readers').
    Experts {
        /// Members each token reads.
        top_k: u64,
    },
    /// Read only by embeddings: one row per token.
    Embedding,
    /// Read whole every step.
    Whole,
}

/// How weight node `id` of `g` is read (see [`WeightUse`]).
pub fn weight_use(g: &Graph, id: NodeId) -> WeightUse {
    let NodeKind::Weight(w) = &g.node(id).kind else { return WeightUse::Whole };
    let users: Vec<_> = g.users(id).into_iter().filter_map(|u| g.op(u).map(|(op, _)| (u, op))).collect();
    let only = |k: OpKind| !users.is_empty() && users.iter().all(|(_, op)| *op == k);
    if w.family.is_some() && only(OpKind::Moe) {
        let top_k = users.iter().map(|(u, _)| g.value_type(g.operands(*u)[1]).elements()).max().unwrap_or(w.count());
        WeightUse::Experts { top_k }
    } else if only(OpKind::Embedding) {
        WeightUse::Embedding
    } else {
        WeightUse::Whole
    }
}

/// The bytes one member of weight `id` takes on the GPU: as stored (scales
/// included), except an FP8 matrix the device reads as bf16 (the MLA's kv_b),
/// which the runtime makes bf16 on upload.
pub fn device_bytes(g: &Graph, id: NodeId) -> u64 {
    let NodeKind::Weight(w) = &g.node(id).kind else { return 0 };
    if w.ty.dtype == DType::Fp8E4m3 && crate::checkpoint::read_as_bf16(g, id) {
        w.ty.elements() * 2
    } else {
        w.ty.bytes()
    }
}

/// The sizes of `v` at `batch` sequences, `context` tokens and `ep` GPUs
/// sharing the routed experts.
pub fn graph_sizes(v: &Validated, batch: u64, context: u64, ep: u64) -> GraphSizes {
    let g = v.graph();
    let ep = ep.max(1);
    let (mut resident, mut routed, mut read, mut state) = (0u64, 0u64, 0f64, 0u64);
    for id in g.nodes() {
        match &g.node(id).kind {
            NodeKind::Weight(w) => {
                let n = w.count();
                let each = device_bytes(g, id);
                let read_by = weight_use(g, id);
                if let WeightUse::Experts { top_k: k } = read_by {
                    let local = n.div_ceil(ep);
                    let here = local.saturating_mul(each);
                    resident = resident.saturating_add(here);
                    routed = routed.saturating_add(here);
                    // The same share the tiler gives the expert tasks (plan::tile).
                    let slots = (batch * k).min(local).max(1);
                    let expected = (expected_distinct_experts(n, k, batch) / ep as f64).min(slots as f64);
                    read += expected * each as f64;
                } else {
                    let all = n.saturating_mul(each);
                    resident = resident.saturating_add(all);
                    if read_by == WeightUse::Embedding {
                        read += (batch * (each / w.ty.shape[0].max(1))) as f64 * n as f64;
                    } else {
                        read += all as f64;
                    }
                }
            }
            NodeKind::State(s) => state = state.saturating_add(s.bytes(context)),
            NodeKind::Op { .. } | NodeKind::Input => {}
        }
    }
    GraphSizes {
        batch,
        context,
        expert_parallel: ep,
        weights_resident: resident,
        routed_resident: routed,
        weights_read: read.round() as u64,
        state_per_sequence: state,
    }
}

/// What one GPU holds in HBM, resident, by part.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Resident {
    /// The graph's part: weights and state.
    pub graph: GraphSizes,
    /// The scratch arena (activations, routing log) and every SM's fp32
    /// staging; 0 where no plan was made (`check`).
    pub activations: u64,
    /// The schedule's device tables (instructions, waits, counters, tasks,
    /// stages); 0 where no plan was made.
    pub tables: u64,
}

impl Resident {
    /// The graph's part only (`check`: no plan, so no activations or tables).
    pub fn of_graph(graph: GraphSizes) -> Self {
        Resident { graph, activations: 0, tables: 0 }
    }

    /// The graph's part with the plan's arena and tables.
    pub fn of_plan(graph: GraphSizes, plan: &Plan, sms: u32) -> Self {
        let staging = plan.arena.staging_floats.saturating_mul(4).saturating_mul(u64::from(sms));
        let s = &plan.schedule;
        let instructions: u64 = s.sms.iter().map(|l| l.len() as u64).sum();
        let waits: u64 = s.sms.iter().flatten().map(|i| i.waits.len() as u64).sum();
        // The element sizes of the plan file's device sections (emit::plan_file).
        let tables = instructions * 16
            + waits * 8
            + s.counters.len() as u64 * 4
            + plan.tiling.tasks.len() as u64 * 20
            + plan.tiling.stages.len() as u64 * 16;
        Resident { graph, activations: plan.arena.bytes.saturating_add(staging), tables }
    }

    /// Everything, in bytes.
    pub fn total(&self) -> u64 {
        self.graph
            .weights_resident
            .saturating_add(self.graph.state_resident())
            .saturating_add(self.activations)
            .saturating_add(self.tables)
    }

    /// Whether it fits `hbm_bytes`.
    pub fn fits(&self, hbm_bytes: u64) -> bool {
        self.total() <= hbm_bytes
    }

    /// The smallest expert-parallel degree (1..=[`MAX_EXPERT_PARALLEL`]) at
    /// which one GPU's share fits `hbm_bytes`, keeping this batch, context,
    /// activations and tables (which a larger degree does not grow); `None`
    /// if none does (the non-expert weights and state alone are too large).
    pub fn smallest_expert_parallel(&self, v: &Validated, hbm_bytes: u64) -> Option<u32> {
        let g = &self.graph;
        let at = |ep: u32| Resident { graph: graph_sizes(v, g.batch, g.context, u64::from(ep)), ..*self };
        if !at(MAX_EXPERT_PARALLEL).fits(hbm_bytes) {
            return None;
        }
        // Resident bytes fall as the degree grows: bisect.
        let (mut lo, mut hi) = (1u32, MAX_EXPERT_PARALLEL);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if at(mid).fits(hbm_bytes) {
                hi = mid;
            } else {
                lo = mid + 1;
            }
        }
        Some(lo)
    }

    /// One line saying whether it fits a GPU of `hbm_bytes` (`gpu` names it),
    /// and if not, the smallest expert-parallel degree that does.
    pub fn verdict(&self, v: &Validated, gpu: &str, hbm_bytes: u64) -> String {
        let g = &self.graph;
        let whose = if g.expert_parallel > 1 {
            format!("one GPU's share at expert-parallel {}", g.expert_parallel)
        } else {
            "the model".to_string()
        };
        let at = format!("batch {}, context {}", g.batch, g.context);
        if self.fits(hbm_bytes) {
            return format!(
                "capacity: {whose} fits one {gpu}: {} resident of {} HBM ({at})",
                bytes(self.total()),
                bytes(hbm_bytes)
            );
        }
        let advice = match self.expert_parallel_that_fits(v, hbm_bytes) {
            Some(n) => format!("; the smallest expert-parallel degree that fits is {n} (--expert-parallel {n})"),
            None => {
                "; no expert-parallel degree fits (the weights outside the routed experts and the state are too large)"
                    .to_string()
            }
        };
        format!(
            "capacity: {whose} does not fit one {gpu}: {} resident > {} HBM ({at}){advice}",
            bytes(self.total()),
            bytes(hbm_bytes)
        )
    }

    /// The smallest expert-parallel degree at which one GPU holds its share,
    /// if sharding the routed experts can make it fit at all.
    pub fn expert_parallel_that_fits(&self, v: &Validated, hbm_bytes: u64) -> Option<u32> {
        self.smallest_expert_parallel(v, hbm_bytes).filter(|_| self.graph.routed_resident > 0)
    }

    /// The parts, one a line, each with its term.
    pub fn render(&self) -> String {
        let g = &self.graph;
        let mut s = String::new();
        let share = if g.expert_parallel > 1 {
            format!(", routed experts 1/{} of them", g.expert_parallel)
        } else {
            String::new()
        };
        let _ = writeln!(s, "  weights, resident: {}{share}", bytes(g.weights_resident));
        let _ = writeln!(
            s,
            "  state, resident: {} ({} per sequence x batch {})",
            bytes(g.state_resident()),
            bytes(g.state_per_sequence),
            g.batch
        );
        if self.activations > 0 || self.tables > 0 {
            let _ = writeln!(s, "  activations (scratch arena and staging), resident: {}", bytes(self.activations));
            let _ = writeln!(s, "  tables (schedule on the device), resident: {}", bytes(self.tables));
        }
        s
    }
}
