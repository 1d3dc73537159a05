//! The arena layout: where each value that crosses fused operations lives,
//! where each stage keeps its scratch, where the routing log is, and how much
//! fp32 staging each SM needs. The code generator renders these addresses; it
//! does not place anything.
//!
//! The scratch arena is one device allocation. [`tile`](super::tile) gave
//! every stage whose results are read elsewhere a region and assigned regions
//! to buffers (a buffer is reused by a later region once its readers are
//! done). This pass fills each region with blocks, in the fused operations'
//! order:
//! - each value read outside its operation (activations in fp32, see
//!   [`kept`]), in the region of the operation's last stage; graph outputs
//!   have buffers of their own and no block;
//! - the scratch a stage keeps for a later stage of its operation: MLA's
//!   absorbed queries and per-split partial results, the LM head's per-tile maxima, the experts'
//!   activations and down-projection rows.
//!
//! Blocks are 16-byte aligned in their region; each buffer is as large as the
//! largest region placed in it, buffers are 256-byte aligned, and the routing
//! log (every router's expert ids of the step, which no stage overwrites)
//! follows them.
//!
//! Staging is per SM, in floats: the largest output tile of a projection or
//! expert stage, and past it (32-float aligned for float4 stores) the whole
//! input of a stage that stages its input as fp32 when that input does not
//! fit the shared-memory staging (`ACTIVATION_BYTES`, contract.h): a
//! projection with a gated input, or an MXFP4 expert stage.
//!
//! Every size is bounded: [`bound`] runs before tiling (each value at the
//! batch at most [`MAX_ARENA_BYTES`], each dimension at most [`MAX_DIM`]),
//! and the layout computes each block, the staging and the arena's end with
//! checked arithmetic against the same bound, so an impossible model is a
//! `mkc::limit` error at its graph line, never a wrapped or runaway size.
//!
//! The pass also records which arena values each stage reads; the verifier
//! ([`verify::arena`](super::verify::arena)) checks the layout and that every
//! such read is ordered after its writer.

use std::collections::{BTreeMap, HashMap};

use serde::Serialize;

use super::fuse::{FusedKind, FusedOp, Fusion};
use super::tile::{TaskArgs, Tiling};
use super::Options;
use crate::contract::ACTIVATION_BYTES;
use crate::diag::{Error, ErrorKind, Result};
use crate::ir::{DType, Graph, NodeId, NodeKind, TensorType, ValueRef, CTX};
use crate::ops::OpKind;

/// The type a value takes in the arena: bf16 activations are kept in fp32.
/// Activations are a few KB per token, so keeping them exact costs nothing
/// measurable and lets the kernel follow an fp32 reference through
/// discontinuous decisions (top-k routing); weights and the KV cache keep
/// their checkpoint and graph dtypes.
pub fn kept(ty: &TensorType) -> TensorType {
    let dtype = if ty.dtype == DType::Bf16 { DType::F32 } else { ty.dtype };
    TensorType::new(dtype, ty.shape.clone())
}

/// What a block holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Block {
    /// A value read outside its operation.
    Value {
        /// The graph node's index.
        node: usize,
        /// Which of its outputs.
        output: u16,
    },
    /// MLA: every token's queries absorbed into the latent space,
    /// `[batch][heads][c]` fp32.
    MlaAbsorbed,
    /// MLA: each split's partial output and softmax statistics,
    /// `[batch][heads][splits][c + 2]` fp32.
    MlaPartials,
    /// The LM head: each tile's (max, index), `[batch][tiles]` float2.
    TileMax,
    /// Routed experts: the activated gate/up rows, `[batch][slots][inter]` fp32.
    ExpertAct,
    /// Routed experts: the down projection's rows, `[batch][slots][hidden]` fp32.
    ExpertDown,
    /// Routed experts sharded over GPUs: this GPU's part of their weighted
    /// sum, `[batch][hidden]` fp32, which the exchange sends and adds.
    ExpertPart,
}

/// A block of the arena.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ArenaSlot {
    /// What it holds.
    pub what: Block,
    /// The tiling's region it belongs to.
    pub region: usize,
    /// The region's buffer.
    pub buffer: usize,
    /// Its offset in the arena, in bytes.
    pub offset: u64,
    /// Its size in bytes at the planned batch.
    pub bytes: u64,
    /// The stage that writes it.
    pub writer: usize,
}

/// A router's rows of the routing log.
#[derive(Debug, Clone, Serialize)]
pub struct RouteRows {
    /// The router's graph node.
    pub node: String,
    /// Its experts per token.
    pub top_k: u64,
    /// Its ids' offset in the arena, in bytes (`[batch][top_k]` int32).
    pub offset: u64,
}

/// The arena of one decode step.
#[derive(Debug, Clone, Serialize)]
pub struct Arena {
    /// Every block, in layout order.
    pub slots: Vec<ArenaSlot>,
    /// Each buffer's (arena offset, bytes).
    pub buffers: Vec<(u64, u64)>,
    /// The routing log's arena offset, after the buffers.
    pub route_log: u64,
    /// The routers, in graph order, with their rows of the log.
    pub routers: Vec<RouteRows>,
    /// The log's size in bytes.
    pub route_log_bytes: u64,
    /// A verify step's logs (`positions` > 1), after the routing log: per
    /// stateful node (graph index) the arena offsets of what it records of
    /// each row for the commit after the step (device/mkc/megakernel.cuh
    /// commit_kernel): a short conv its inputs `[z]` ([batch, channels] of
    /// the state's type), KDA `[alpha, k, v, beta]` ([batch, heads d] fp32
    /// each, beta [batch, heads]). Empty in plain decoding.
    pub logs: BTreeMap<usize, Vec<u64>>,
    /// The arena's size in bytes.
    pub bytes: u64,
    /// fp32 staging per SM, in floats.
    pub staging_floats: u64,
    /// Per stage: where its fp32 input spills in the SM's staging (a float
    /// offset), when it stages its input whole and it does not fit in shared
    /// memory.
    pub spills: Vec<Option<u64>>,
    /// Per stage: the values made by other stages that it reads.
    #[serde(skip)]
    pub reads: Vec<Vec<ValueRef>>,
    /// Per stage: the values it makes (arena blocks and graph outputs).
    #[serde(skip)]
    pub writes: HashMap<ValueRef, usize>,
    #[serde(skip)]
    index: HashMap<(usize, Block), usize>,
}

impl Arena {
    /// The block of value `v`, if it lives in the arena.
    pub fn value(&self, v: ValueRef) -> Option<&ArenaSlot> {
        let writer = *self.writes.get(&v)?;
        self.block(writer, Block::Value { node: v.node.index(), output: v.output })
    }

    /// Stage `stage`'s block `what`.
    pub fn block(&self, stage: usize, what: Block) -> Option<&ArenaSlot> {
        self.index.get(&(stage, what)).map(|i| &self.slots[*i])
    }
}

fn bug(msg: String) -> Error {
    Error::new(ErrorKind::Invalid, format!("internal error: arena layout: {msg}"))
        .help("this is a compiler bug in the planner; the plan was not emitted")
}

/// The largest arena, and the largest staging of all SMs together: 1 TiB,
/// far past any GPU's memory, so a model whose sizes reach it (a hidden size
/// of 2^40) is refused by name instead of emitting an allocation no device
/// has. Every size below it is computed with checked arithmetic.
pub const MAX_ARENA_BYTES: u64 = 1 << 40;

/// `factors` multiplied, or a `mkc::limit` error naming `what`, its size and
/// the bound when the product passes [`MAX_ARENA_BYTES`] (or 64 bits).
pub fn bounded(what: &dyn Fn() -> String, factors: &[u64]) -> Result<u64> {
    let product = factors.iter().try_fold(1u64, |a, f| a.checked_mul(*f));
    match product {
        Some(n) if n <= MAX_ARENA_BYTES => Ok(n),
        _ => {
            let size = product.map_or_else(|| "more than 2^64".to_string(), |n| n.to_string());
            Err(Error::new(
                ErrorKind::Limit,
                format!("{} needs {size} bytes, more than the bound of {MAX_ARENA_BYTES} (1 TiB)", what()),
            )
            .help("check the config's sizes (hidden size, heads, experts, vocabulary) and --batch"))
        }
    }
}

/// The largest dimension of any tensor the planner tiles: task arguments
/// (row, head and tile ranges) are 32-bit in the plan file.
pub const MAX_DIM: u64 = (1 << 31) - 1;

/// Bounds the graph before it is tiled, so no size the tiling derives can
/// wrap: every dimension of every tensor is at most [`MAX_DIM`], and every
/// value an operation produces, kept in the arena for the whole batch, is at
/// most [`MAX_ARENA_BYTES`]. Errors point at the node's graph line.
pub fn bound(g: &Graph, options: Options) -> Result<()> {
    for id in g.nodes() {
        let node = g.node(id);
        if matches!(node.kind, NodeKind::Op { .. }) {
            for ty in &node.outputs {
                let what = || format!("`{}` ({ty}) at batch {}", node.name, options.batch);
                bounded(&what, &[kept(ty).bytes(), u64::from(options.batch)]).map_err(|e| e.at(node.span))?;
            }
        }
    }
    for id in g.nodes() {
        let node = g.node(id);
        // A weight family's leading dimension is its member count; a state's
        // `ctx` is sized at run time.
        let family = matches!(&node.kind, NodeKind::Weight(w) if w.family.is_some());
        for ty in &node.outputs {
            let dims = &ty.shape[usize::from(family).min(ty.shape.len())..];
            if let Some(d) = dims.iter().find(|d| **d > MAX_DIM && **d != CTX) {
                return Err(Error::new(
                    ErrorKind::Limit,
                    format!(
                        "`{}` ({ty}) has a dimension of {d}, more than the planner's bound of {MAX_DIM}",
                        node.name
                    ),
                )
                .at(node.span)
                .label(format!("a dimension of {d}")));
            }
        }
    }
    Ok(())
}

fn align(x: u64, a: u64) -> u64 {
    x.div_ceil(a) * a
}

fn op_kind(g: &Graph, n: NodeId) -> Option<OpKind> {
    g.op(n).map(|(k, _)| k)
}

struct Layout<'a> {
    g: &'a Graph,
    fusion: &'a Fusion,
    tiling: &'a Tiling,
    batch: u64,
    slots: Vec<ArenaSlot>,
    region_bytes: Vec<u64>,
    region_of: Vec<Option<usize>>,
    staging: u64,
    spills: Vec<Option<u64>>,
    reads: Vec<Vec<ValueRef>>,
    writes: HashMap<ValueRef, usize>,
    routers: Vec<RouteRows>,
    route_log_bytes: u64,
}

impl Layout<'_> {
    /// Places `bytes` in the region `stage` writes.
    fn reserve(&mut self, stage: usize, what: Block, bytes: u64) -> Result<()> {
        let Some(r) = self.region_of[stage] else {
            return Err(bug(format!("stage {stage} writes {what:?} but has no region")));
        };
        let region = &self.tiling.regions[r];
        let at = self.region_bytes[r];
        let end = at.checked_add(bytes).ok_or_else(|| bug(format!("region {r} overflows")))?;
        let end = bounded(&|| format!("the arena region of {}", self.stage_name(stage)), &[align(end, 16)])
            .map_err(|e| e.at(self.stage_span(stage)))?;
        self.region_bytes[r] = end;
        self.slots.push(ArenaSlot { what, region: r, buffer: region.buffer, offset: at, bytes, writer: stage });
        Ok(())
    }

    /// The fused operation `stage` belongs to, by name.
    fn stage_name(&self, stage: usize) -> String {
        let op = &self.fusion.ops[self.tiling.stages[stage].op];
        format!("stage {stage} ({})", op.name)
    }

    /// The graph line of `stage`'s fused operation (its first node).
    fn stage_span(&self, stage: usize) -> crate::diag::Span {
        let op = &self.fusion.ops[self.tiling.stages[stage].op];
        self.g.node(NodeId::at(op.nodes[0])).span
    }

    /// `factors` multiplied for `stage`, bounded by [`MAX_ARENA_BYTES`].
    fn size(&self, stage: usize, what: &str, factors: &[u64]) -> Result<u64> {
        bounded(&|| format!("{what} of {}", self.stage_name(stage)), factors).map_err(|e| e.at(self.stage_span(stage)))
    }

    /// Raises the per-SM staging to `floats`, bounded by [`MAX_ARENA_BYTES`]
    /// for all SMs together (4 bytes a float; the SM count is at most 1024).
    fn stage_floats(&mut self, stage: usize, floats: u64) -> Result<()> {
        self.size(stage, "the fp32 staging of all SMs", &[floats, 4, 1024])?;
        self.staging = self.staging.max(floats);
        Ok(())
    }

    /// Stages `k` input floats past an output tile of `tile` floats when they
    /// do not fit the shared-memory staging.
    fn spill(&mut self, stage: usize, tile: u64, k: u64) -> Result<()> {
        let floats = self.size(stage, "the staged input", &[self.batch, k])?;
        if floats * 4 <= ACTIVATION_BYTES {
            return Ok(());
        }
        let at = align(tile, 32);
        self.stage_floats(stage, at + floats)?;
        self.spills[stage] = Some(at);
        Ok(())
    }

    /// Gives every value of `op` read outside it a block in `stage`'s region
    /// (graph outputs have their own buffers), in node order.
    fn place_outputs(&mut self, op: &FusedOp, stage: usize) -> Result<()> {
        let g = self.g;
        for &n in &op.nodes {
            let id = NodeId::at(n);
            for (o, ty) in g.node(id).outputs.iter().enumerate() {
                let v = ValueRef { node: id, output: o as u16 };
                self.writes.insert(v, stage);
                let outside = g.readers(v).any(|u| !op.nodes.contains(&u.index()));
                if outside && !g.outputs.iter().any(|(_, ov)| *ov == v) {
                    let bytes = self.size(stage, &format!("`{}`", g.node(id).name), &[kept(ty).bytes(), self.batch])?;
                    self.reserve(stage, Block::Value { node: n, output: o as u16 }, bytes)?;
                }
            }
        }
        Ok(())
    }

    /// The values from outside `op` its nodes read (activations, not
    /// weights, states or the token input), in node and operand order.
    fn outside_reads(&self, op: &FusedOp) -> Vec<ValueRef> {
        let mut out = vec![];
        for &n in &op.nodes {
            for v in self.g.operands(NodeId::at(n)) {
                let produced = matches!(self.g.node(v.node).kind, NodeKind::Op { .. });
                if produced && !op.nodes.contains(&v.node.index()) && !out.contains(&v) {
                    out.push(v);
                }
            }
        }
        out
    }

    /// The largest output tile of a stage of row tasks, in floats at the batch.
    fn tile_floats(&self, stage: usize) -> Result<u64> {
        let rows = self.tiling.stages[stage].tasks.iter().map(|t| match self.tiling.tasks[*t].args {
            TaskArgs::Rows { up, r0, r1, .. } => u64::from(r1.saturating_sub(r0)) * if up.is_some() { 2 } else { 1 },
            TaskArgs::ExpertRows { rows, .. } => u64::from(rows),
            _ => 0,
        });
        self.size(stage, "the output tile", &[rows.max().unwrap_or(0), self.batch])
    }

    fn op(&mut self, op: &FusedOp) -> Result<()> {
        let g = self.g;
        let stages: Vec<usize> = self.tiling.stages.iter().filter(|s| s.op == op.id).map(|s| s.id).collect();
        let (Some(&first), Some(&last)) = (stages.first(), stages.last()) else {
            return Err(bug(format!("fused operation {} has no stage", op.id)));
        };
        let anchor = NodeId::at(op.nodes[0]);
        self.place_outputs(op, last)?;
        let reads = self.outside_reads(op);
        match op.kind {
            FusedKind::Projection | FusedKind::LmHead => {
                let rows = self.tile_floats(first)?;
                self.stage_floats(first, rows)?;
                // The shared input: gated (a gated norm or a multiply inside the
                // operation) or read by FP8 rows is staged whole.
                let linear = op
                    .nodes
                    .iter()
                    .map(|n| NodeId::at(*n))
                    .find(|n| matches!(op_kind(g, *n), Some(OpKind::Linear | OpKind::LmHead)));
                if let Some(l) = linear {
                    let x = g.operands(l)[0];
                    let gated = op.nodes.contains(&x.node.index())
                        && matches!(op_kind(g, x.node), Some(OpKind::GatedRmsNorm | OpKind::Mul));
                    let fp8 = g.value_type(g.operands(l)[1]).dtype == DType::Fp8E4m3;
                    if gated || fp8 {
                        self.spill(first, rows, g.value_type(x).elements())?;
                    }
                }
                if op.nodes.iter().any(|n| op_kind(g, NodeId::at(*n)) == Some(OpKind::Argmax)) {
                    let tiles = self.tiling.stages[first].tasks.len() as u64;
                    let bytes = self.size(first, "the tile maxima", &[self.batch, tiles, 8])?;
                    self.reserve(first, Block::TileMax, bytes)?;
                }
                self.reads[first] = reads;
            }
            FusedKind::MlaDecode => {
                let n = op
                    .nodes
                    .iter()
                    .map(|n| NodeId::at(*n))
                    .find(|n| op_kind(g, *n) == Some(OpKind::MlaDecode))
                    .ok_or_else(|| bug(format!("fused operation {} has no MLA node", op.id)))?;
                let NodeKind::Op { attrs, .. } = &g.node(n).kind else { unreachable!("an op") };
                let heads = attrs.int("heads") as u64;
                let c = g.value_type(g.operands(n)[1]).elements();
                let [absorb, split, combine] = stages[..] else {
                    return Err(bug(format!("fused operation {} is not three MLA stages", op.id)));
                };
                let Some((_, _, splits)) = self.tiling.stages[split].mla_split else {
                    return Err(bug(format!("fused operation {} has an MLA split the tiling did not shape", op.id)));
                };
                let bytes = self.size(absorb, "the MLA absorbed queries", &[self.batch, heads, c, 4])?;
                self.reserve(absorb, Block::MlaAbsorbed, bytes)?;
                let bytes =
                    self.size(split, "the MLA partials", &[self.batch, heads, splits, c.saturating_add(2), 4])?;
                self.reserve(split, Block::MlaPartials, bytes)?;
                // The combine reads the output gate where the planner put it
                // there (`head-gate`).
                self.reads[absorb] = reads.clone();
                self.reads[split] = reads;
                self.reads[combine] = op.mla_gate_reads(g);
            }
            FusedKind::Moe => {
                let n = op
                    .nodes
                    .iter()
                    .map(|n| NodeId::at(*n))
                    .find(|n| op_kind(g, *n) == Some(OpKind::Moe))
                    .ok_or_else(|| bug(format!("fused operation {} has no MoE node", op.id)))?;
                let ops = g.operands(n);
                // Sharded over GPUs (`--expert-parallel`), the combine writes
                // this GPU's part, which the exchange's two stages read.
                let (up, down, combine, exchange) = match stages[..] {
                    [up, down, combine] => (up, down, combine, None),
                    [up, down, combine, send, reduce] => (up, down, combine, Some((send, reduce))),
                    _ => return Err(bug(format!("fused operation {} is not three or five expert stages", op.id))),
                };
                let w = g.value_type(ops[3]);
                let (e, i, d) = (w.shape[0], w.shape[1], w.shape[2]);
                let k = g.value_type(ops[1]).elements();
                let slots = self.batch.saturating_mul(k).min(e);
                let act = self.size(up, "the experts' activations", &[self.batch, slots, i, 4])?;
                self.reserve(up, Block::ExpertAct, act)?;
                let rows = self.size(down, "the experts' down rows", &[self.batch, slots, d, 4])?;
                self.reserve(down, Block::ExpertDown, rows)?;
                for (stage, input, width) in [(up, d, 2), (down, i, 1)] {
                    let tile = self.tile_floats(stage)? * width;
                    self.stage_floats(stage, tile)?;
                    if matches!(w.dtype, DType::Mxfp4 | DType::Fp8E4m3) {
                        self.spill(stage, tile, input)?;
                    }
                }
                // The gate/up stage reads the input (and its norm's input) and
                // the ids; the down stage the ids; the combine the ids and weights.
                let (ids, wts) = (ops[1], ops[2]);
                self.reads[up] = reads.iter().copied().filter(|v| *v != wts).collect();
                self.reads[down] = vec![ids];
                self.reads[combine] = vec![ids, wts];
                if exchange.is_some() {
                    let part = self.size(combine, "this GPU's part of the experts' sum", &[self.batch, d, 4])?;
                    self.reserve(combine, Block::ExpertPart, part)?;
                }
            }
            FusedKind::Router => {
                let NodeKind::Op { attrs, .. } = &g.node(anchor).kind else { unreachable!("an op") };
                let top_k = attrs.int("top_k") as u64;
                self.routers.push(RouteRows { node: g.node(anchor).name.clone(), top_k, offset: self.route_log_bytes });
                let bytes = self.size(first, "the routing log", &[self.batch, top_k, 4])?;
                self.route_log_bytes = self.size(first, "the routing log", &[self.route_log_bytes + bytes])?;
                self.reads[first] = reads;
            }
            FusedKind::KdaDecode | FusedKind::AttnRes | FusedKind::Embedding | FusedKind::Elementwise => {
                self.reads[first] = reads;
            }
        }
        Ok(())
    }
}

/// The parts of each verify-step log ([`Arena::logs`]) in bytes, per
/// stateful node of `fusion` in graph order.
fn step_logs(g: &Graph, fusion: &Fusion, batch: u64) -> Result<Vec<(usize, Vec<u64>)>> {
    let mut logs = vec![];
    let what = || "a verify step's log".to_string();
    for op in &fusion.ops {
        for &n in &op.nodes {
            let id = NodeId::at(n);
            match g.op(id) {
                Some((OpKind::ConvUpdate, _)) => {
                    let state = g.value_type(g.operands(id)[2]);
                    let channels = g.value_type(ValueRef { node: id, output: 0 }).elements();
                    logs.push((n, vec![bounded(&what, &[batch, channels, state.dtype.bytes(1, 1)])?]));
                }
                Some((OpKind::KdaDecode, _)) => {
                    let p = g.value_type(ValueRef { node: id, output: 0 }).elements();
                    let heads = g.value_type(g.operands(id)[4]).elements();
                    let part = bounded(&what, &[batch, p, 4])?;
                    logs.push((n, vec![part, part, part, bounded(&what, &[batch, heads, 4])?]));
                }
                _ => {}
            }
        }
    }
    Ok(logs)
}

/// Lays out the arena of `tiling` at the planned batch.
pub fn layout(g: &Graph, fusion: &Fusion, tiling: &Tiling, options: Options) -> Result<Arena> {
    let mut region_of = vec![None; tiling.stages.len()];
    for r in &tiling.regions {
        region_of[r.writer] = Some(r.id);
    }
    let mut l = Layout {
        g,
        fusion,
        tiling,
        batch: u64::from(options.batch),
        slots: vec![],
        region_bytes: vec![0; tiling.regions.len()],
        region_of,
        staging: 0,
        spills: vec![None; tiling.stages.len()],
        reads: vec![vec![]; tiling.stages.len()],
        writes: HashMap::new(),
        routers: vec![],
        route_log_bytes: 0,
    };
    for op in &fusion.ops {
        l.op(op)?;
    }
    // Buffers: each as large as the largest region placed in it.
    let mut sizes = vec![0u64; tiling.buffers.len()];
    for r in &tiling.regions {
        sizes[r.buffer] = sizes[r.buffer].max(l.region_bytes[r.id]);
    }
    let mut buffers = vec![];
    let mut at = 0u64;
    // Each term is at most MAX_ARENA_BYTES, so no sum below wraps.
    let arena = || "the arena".to_string();
    for s in sizes {
        buffers.push((at, s));
        at = bounded(&arena, &[align(at + s, 256)])?;
    }
    let route_log = at;
    let routers = l.routers.into_iter().map(|r| RouteRows { offset: route_log + r.offset, ..r }).collect();
    at = bounded(&arena, &[align(at + l.route_log_bytes, 256)])?;
    let mut logs = BTreeMap::new();
    if options.positions > 1 {
        for (node, parts) in step_logs(g, fusion, u64::from(options.batch))? {
            let mut offsets = vec![];
            for bytes in parts {
                offsets.push(at);
                at = bounded(&arena, &[align(at + bytes, 256)])?;
            }
            logs.insert(node, offsets);
        }
    }
    let slots: Vec<ArenaSlot> =
        l.slots.into_iter().map(|s| ArenaSlot { offset: buffers[s.buffer].0 + s.offset, ..s }).collect();
    let index = slots.iter().enumerate().map(|(i, s)| ((s.writer, s.what), i)).collect();
    Ok(Arena {
        slots,
        buffers,
        route_log,
        routers,
        route_log_bytes: l.route_log_bytes,
        logs,
        bytes: at.max(256),
        staging_floats: align(l.staging.max(1), 32),
        spills: l.spills,
        reads: l.reads,
        writes: l.writes,
        index,
    })
}
