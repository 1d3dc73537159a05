//! Tiling: each fused operation becomes one or more stages of tasks sized for
//! the target, with the bytes and FLOPs of each task.
//!
//! - projections (and the LM head): output-row tiles, aligned to the heads or
//!   groups their epilogue works on, sized so the operation spreads over the
//!   SMs; gate/up pairs stay in one task so the activation-and-multiply can
//!   run in its epilogue. The LM head adds an argmax stage.
//! - MLA: (head group, KV split) tasks over the latent cache, then a combine
//!   stage per head group that merges the splits by log-sum-exp and applies
//!   the value up-projection.
//! - KDA: one task per head (or group of heads), each reading and writing its
//!   fp32 state once.
//! - MoE: (expert slot, row tile) tasks for the gate/up and down projections
//!   whose expert id is only known at run time, then a combine stage. The
//!   slots cover the worst case, `min(E, B k)` distinct experts; a slot's
//!   bytes are the expected share, `E (1 - (1-k/E)^B)` distinct experts under
//!   uniform routing (k at batch 1).
//! - router, embedding, attention-residual mix, lone element-wise ops: one task.
//!
//! Bytes are split into weights (HBM, streamable ahead of dependencies),
//! activations (read and written, mostly L2) and state. Each stage's outputs
//! live in a region of the scratch arena; [`Tiling::regions`] lists them with
//! the stage that writes and the stages that read each one, and regions reuse
//! buffers once their readers are done (the scheduler orders the reuse).

use std::collections::BTreeMap;

use serde::Serialize;

use super::fuse::{FusedKind, Fusion};
use super::Options;
use crate::contract::{MAX_MLA_HEADS, MLA_MAX_LATENT, MLA_MMA_COLUMNS};
use crate::diag::Result;
use crate::ir::{DType, Graph, NodeId, NodeKind, TensorType};
use crate::ops::OpKind;
use crate::target::Target;
use crate::valid::Validated;

/// What a task does; each kind has one warp layout (see `specialize`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, PartialOrd, Ord)]
#[serde(rename_all = "snake_case")]
pub enum TaskKind {
    /// Output rows of a projection (GEMV/GEMM over streamed weight tiles).
    ProjectionRows,
    /// MLA over one KV split for a group of heads.
    MlaSplit,
    /// MLA split merge and value up-projection.
    MlaCombine,
    /// KDA state update for some heads.
    Kda,
    /// Router top-k.
    Router,
    /// One expert slot's gate/up rows.
    ExpertUp,
    /// One expert slot's down rows.
    ExpertDown,
    /// Weighted sum of the expert slots.
    ExpertCombine,
    /// Attention-residual mix.
    AttnRes,
    /// Embedding row copy.
    Embedding,
    /// LM head rows with a per-tile max.
    LmHeadRows,
    /// Final argmax over the tiles.
    Argmax,
    /// Element-wise ops.
    Elementwise,
    /// MLA's queries absorbed into the latent space for some heads (W_UK
    /// streamed once a step for every KV split).
    MlaAbsorb,
    /// A tile of this GPU's partial sums written to every other GPU of an
    /// expert-parallel plan (each GPU's counter of the exchange bumped after).
    ExchangeSend,
    /// A tile of the sum of every GPU's partial sums, once the other GPUs'
    /// tiles have arrived.
    ExchangeReduce,
}

/// One unit of work, run by one SM.
#[derive(Debug, Clone, Serialize)]
pub struct Task {
    /// Global index.
    pub id: usize,
    /// The stage it belongs to.
    pub stage: usize,
    /// Which part of the stage (row range, head group, split...).
    pub label: String,
    /// Weight bytes streamed from HBM.
    pub weight_bytes: u64,
    /// Activation bytes read and written.
    pub act_bytes: u64,
    /// State bytes read and written.
    pub state_bytes: u64,
    /// Floating-point operations.
    pub flops: u64,
    /// MXFP4 weight elements its consumers decode in registers (the routed
    /// experts' rows when they are stored as MXFP4, the expected share like
    /// the bytes; 0 otherwise): costed per element by the schedule, in place
    /// of the FLOPs.
    pub decoded: u64,
    /// Which part of its operation the task computes.
    #[serde(skip)]
    pub args: TaskArgs,
}

/// Which part of its operation a task computes, as the generated code reads
/// it ([`TaskArgs::words`]: the plan file's four words, `t.a[0..4]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TaskArgs {
    /// The whole operation.
    Whole,
    /// Rows of one of the operation's linears, with the rows of its paired up
    /// linear if it has one.
    Rows {
        /// The linear, by position among the operation's linears (so that
        /// every layer's tasks read alike).
        linear: u32,
        /// The paired up linear (act-and-mul), by position.
        up: Option<u32>,
        /// First row.
        r0: u32,
        /// One past the last row.
        r1: u32,
    },
    /// MLA's split: a head group over one KV split.
    KvSplit {
        /// The head group.
        group: u32,
        /// The KV split.
        split: u32,
    },
    /// A range of heads (KDA, MLA's combine).
    Heads {
        /// First head.
        h0: u32,
        /// One past the last head.
        h1: u32,
    },
    /// A range of heads of a range of sequences (KDA: its state is per
    /// sequence and head).
    SequenceHeads {
        /// First head.
        h0: u32,
        /// One past the last head.
        h1: u32,
        /// First sequence.
        s0: u32,
        /// One past the last sequence.
        s1: u32,
    },
    /// A part of the stage's expert rows: the step's distinct experts'
    /// rows shared over the stage's tasks at run time.
    ExpertRows {
        /// The part.
        part: u32,
        /// Parts in all (at least the slots).
        parts: u32,
        /// Rows are split in units of this many.
        unit: u32,
        /// The most rows a part can get.
        rows: u32,
    },
    /// A range of token rows (the attention-residual mix).
    Tokens {
        /// First token row.
        b0: u32,
        /// One past the last.
        b1: u32,
    },
    /// One column tile (the experts' combine).
    Tile {
        /// The tile.
        tile: u32,
        /// Tiles in all.
        tiles: u32,
    },
}

impl TaskArgs {
    /// The four words the device reads (`TaskArgs::a` of
    /// `device/mkc/plan_types.h`): rows `[linear, up or u32::MAX, r0, r1]`,
    /// a KV split `[group, split]`, heads `[h0, h1]`, heads of sequences
    /// `[h0, h1, s0, s1]`, expert rows `[part, parts, unit]`, token rows
    /// `[b0, b1]`, a tile `[tile, tiles]`, unused words 0.
    pub fn words(self) -> [u32; 4] {
        match self {
            TaskArgs::Whole => [0; 4],
            TaskArgs::Rows { linear, up, r0, r1 } => [linear, up.unwrap_or(u32::MAX), r0, r1],
            TaskArgs::KvSplit { group, split } => [group, split, 0, 0],
            TaskArgs::Heads { h0, h1 } => [h0, h1, 0, 0],
            TaskArgs::SequenceHeads { h0, h1, s0, s1 } => [h0, h1, s0, s1],
            TaskArgs::ExpertRows { part, parts, unit, .. } => [part, parts, unit, 0],
            TaskArgs::Tokens { b0, b1 } => [b0, b1, 0, 0],
            TaskArgs::Tile { tile, tiles } => [tile, tiles, 0, 0],
        }
    }
}

/// A set of tasks of one kind that may run in parallel.
#[derive(Debug, Clone, Serialize)]
pub struct Stage {
    /// Global index.
    pub id: usize,
    /// The fused operation.
    pub op: usize,
    /// What its tasks do.
    pub kind: TaskKind,
    /// Its tasks' ids.
    pub tasks: Vec<usize>,
    /// Stages whose results it reads.
    pub reads: Vec<usize>,
    /// MLA's split over the KV length `(head groups, heads per group, KV
    /// splits)`, for both MLA stages; what the generated code compiles in.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mla_split: Option<(u64, u64, u64)>,
    /// MLA's split folds on the tensor cores (rows of whole `MLA_MMA_COLUMNS`
    /// blocks; `mla_fold_mma`), else on the CUDA cores.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub mla_tensor_cores: bool,
    /// The exchange between GPUs an `ExchangeSend` or `ExchangeReduce` stage
    /// takes part in.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub exchange: Option<Exchange>,
}

/// An all-reduce between the GPUs of an expert-parallel plan
/// (`--expert-parallel G`), after each MoE operation's combine: every GPU
/// runs the same plan on the same tokens with its share of the experts, and
/// the sum of the GPUs' partial outputs is the operation's output on every
/// GPU. In one exchange each send task writes its tile of this GPU's partial
/// sums into every other GPU's inbox (the half of the exchange's parity) and
/// bumps that GPU's counter of the exchange (a remote counter, `Counter::
/// remote`); each reduce task waits for the other GPUs' bumps, all of them,
/// and adds the GPUs' tiles in rank order (the same sum on every GPU).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Exchange {
    /// GPUs taking part, each running this plan.
    pub ranks: u32,
    /// The exchange's send stage (whose tasks bump the other GPUs' counter).
    pub send: usize,
    /// Bytes a send task writes to each other GPU.
    pub tile_bytes: u64,
}

/// A buffer of the scratch arena holding one stage's results for one step.
#[derive(Debug, Clone, Serialize)]
pub struct Region {
    /// Global index.
    pub id: usize,
    /// The stage that writes it.
    pub writer: usize,
    /// The stages that read it.
    pub readers: Vec<usize>,
    /// Its size at the planned batch.
    pub bytes: u64,
    /// The arena buffer it occupies; buffers are reused by later regions.
    pub buffer: usize,
}

/// The tiling of every fused operation.
#[derive(Debug, Clone, Serialize)]
pub struct Tiling {
    /// All stages, in the fused operations' order.
    pub stages: Vec<Stage>,
    /// All tasks.
    pub tasks: Vec<Task>,
    /// One region per stage that produces something read elsewhere.
    pub regions: Vec<Region>,
    /// Sizes of the arena's buffers.
    pub buffers: Vec<u64>,
}

impl Tiling {
    /// Total bytes the tasks move from HBM (weights and state; activations are
    /// counted once per region).
    pub fn hbm_bytes(&self) -> u64 {
        let w: u64 = self.tasks.iter().map(|t| t.weight_bytes + t.state_bytes).sum();
        w + self.regions.iter().map(|r| r.bytes).sum::<u64>()
    }
}

/// A task before it is numbered: label, weight, activation and state bytes,
/// FLOPs and arguments.
type Part = (String, u64, u64, u64, u64, TaskArgs);

/// How MLA decode splits: `(head groups, heads per group, KV splits)`. A
/// split task takes up to [`MAX_MLA_HEADS`] heads (the tensor-core fold's
/// eight rows of M; each head group streams the cache once), the KV length
/// split so that the tasks fill the SMs, at least 256 rows a split.
pub fn mla_split_shape(heads: u64, context: u64, sms: u32) -> (u64, u64, u64) {
    let groups = heads.div_ceil(MAX_MLA_HEADS).max(1);
    let hpt = heads.div_ceil(groups);
    let groups = heads.div_ceil(hpt);
    let ctx = context.max(1);
    let splits = (u64::from(sms) / groups).clamp(1, ctx.div_ceil(256).max(1));
    (groups, hpt, splits)
}

struct Builder<'a> {
    g: &'a Graph,
    target: &'a Target,
    opts: Options,
    stages: Vec<Stage>,
    tasks: Vec<Task>,
    out_bytes: Vec<u64>,
}

fn node(_: &Graph, i: usize) -> NodeId {
    NodeId::at(i)
}

fn op_of(g: &Graph, i: usize) -> Option<OpKind> {
    g.op(NodeId::at(i)).map(|(k, _)| k)
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

fn lcm(a: u64, b: u64) -> u64 {
    a / gcd(a, b) * b
}

/// Expert rows are shared between a stage's tasks in units of this many
/// rows (a multiple of the MXFP4 tile, `MX_TILE_ROWS`).
pub const EXPERT_UNIT_ROWS: u64 = 16;

fn round_up(x: u64, m: u64) -> u64 {
    x.div_ceil(m) * m
}

impl Builder<'_> {
    fn b(&self) -> u64 {
        u64::from(self.opts.batch)
    }

    fn add_stage(&mut self, op: usize, kind: TaskKind, reads: Vec<usize>, parts: Vec<Part>) -> usize {
        let id = self.stages.len();
        let mut ids = vec![];
        for (label, weight_bytes, act_bytes, state_bytes, flops, args) in parts {
            let tid = self.tasks.len();
            self.tasks.push(Task {
                id: tid,
                stage: id,
                label,
                weight_bytes,
                act_bytes,
                state_bytes,
                flops,
                decoded: 0,
                args,
            });
            ids.push(tid);
        }
        self.stages.push(Stage {
            id,
            op,
            kind,
            tasks: ids,
            reads,
            mla_split: None,
            mla_tensor_cores: false,
            exchange: None,
        });
        self.out_bytes.push(0);
        id
    }

    /// Bytes (per token) of the values `nodes` produce for nodes outside them.
    fn external_outputs(&self, nodes: &[usize]) -> u64 {
        let inside = |n: &NodeId| nodes.contains(&n.index());
        let mut bytes = 0;
        for n in nodes {
            let id = node(self.g, *n);
            let used_outside =
                self.g.users(id).iter().any(|u| !inside(u)) || self.g.outputs.iter().any(|(_, v)| v.node == id);
            if used_outside {
                bytes += self.g.node(id).outputs.iter().map(TensorType::bytes).sum::<u64>();
            }
        }
        bytes
    }

    /// Bytes (per token) of the activations `nodes` read from outside them.
    fn external_inputs(&self, nodes: &[usize]) -> u64 {
        let mut seen = vec![];
        let mut bytes = 0;
        for n in nodes {
            for v in self.g.operands(node(self.g, *n)) {
                let producer = self.g.node(v.node);
                let activation = matches!(producer.kind, NodeKind::Op { .. } | NodeKind::Input);
                if activation && !nodes.contains(&v.node.index()) && !seen.contains(&v) {
                    seen.push(v);
                    bytes += self.g.value_type(v).bytes();
                }
            }
        }
        bytes
    }

    fn weight_of(&self, n: usize, slot: usize) -> TensorType {
        let v = self.g.operands(node(self.g, n))[slot];
        self.g.value_type(v).clone()
    }

    /// Row alignment the epilogue of linear `n` needs.
    fn align_for(&self, n: usize, nodes: &[usize]) -> u64 {
        let mut align = 16u64;
        let mut frontier = vec![node(self.g, n)];
        while let Some(cur) = frontier.pop() {
            for u in self.g.users(cur) {
                if !nodes.contains(&u.index()) {
                    continue;
                }
                let NodeKind::Op { op, attrs } = &self.g.node(u).kind else { continue };
                match op {
                    OpKind::Rope => align = lcm(align, attrs.int("head_dim") as u64),
                    OpKind::L2Norm => align = lcm(align, attrs.int("group") as u64),
                    OpKind::RmsNorm | OpKind::GatedRmsNorm => {
                        let w = self.g.operands(u).last().map(|v| self.g.value_type(*v).elements()).unwrap_or(1);
                        align = lcm(align, w);
                    }
                    _ => {}
                }
                if matches!(
                    op,
                    OpKind::ConvUpdate | OpKind::Split | OpKind::Silu | OpKind::Sigmoid | OpKind::Add | OpKind::Mul
                ) {
                    frontier.push(u);
                }
            }
        }
        align
    }

    fn projection(&mut self, op: usize, nodes: &[usize], reads: Vec<usize>, kind: TaskKind) -> usize {
        let g = self.g;
        let linears: Vec<usize> =
            nodes.iter().copied().filter(|n| matches!(op_of(g, *n), Some(OpKind::Linear | OpKind::LmHead))).collect();
        // Couple the gate and up linears of an in-group act_and_mul.
        let mut coupled: BTreeMap<usize, usize> = BTreeMap::new();
        for n in nodes {
            if op_of(g, *n) == Some(OpKind::ActAndMul) {
                let ops = g.operands(node(g, *n));
                let (a, b) = (ops[0].node.index(), ops[1].node.index());
                if linears.contains(&a) && linears.contains(&b) {
                    coupled.insert(b, a);
                }
            }
        }
        // Segments: (label, rows, bytes per row, k, align).
        let mut segments = vec![];
        for l in &linears {
            if coupled.contains_key(l) {
                continue;
            }
            let w = self.weight_of(*l, 1);
            let rows = w.shape[0];
            let k = *w.shape.last().unwrap_or(&1);
            let mut row_bytes = w.bytes() / rows.max(1);
            let mut label = g.node(node(g, *l)).name.rsplit('/').next().unwrap_or("").to_string();
            if let Some((up, _)) = coupled.iter().find(|(_, gate)| **gate == *l) {
                let wu = self.weight_of(*up, 1);
                row_bytes += wu.bytes() / rows.max(1);
                label = format!("{label}+{}", g.node(node(g, *up)).name.rsplit('/').next().unwrap_or(""));
            }
            let align = self.align_for(*l, nodes).min(rows.max(1));
            // Linears by their position in the operation (the generated code's
            // row-source switch), so that every layer's tasks read alike.
            let ordinal = |n: usize| linears.iter().position(|x| *x == n).expect("a linear of the op") as u32;
            let up = coupled.iter().find(|(_, gate)| **gate == *l).map(|(up, _)| ordinal(*up));
            segments.push((label, rows, row_bytes, k, align, coupled.values().any(|gte| gte == l), ordinal(*l), up));
        }
        let total: u64 = segments.iter().map(|s| s.1 * s.2).sum();
        let per_task = (total / u64::from(self.target.sms)).max(32 << 10);
        let in_bytes = self.external_inputs(nodes) * self.b();
        let out_total = self.external_outputs(nodes) * self.b();
        let b = self.b();
        let mut parts = vec![];
        for (label, rows, row_bytes, k, align, pair, lin, up) in &segments {
            let tile =
                round_up(per_task.div_ceil((*row_bytes).max(1)), *align).min(round_up(*rows, *align)).max(*align);
            let mut r0 = 0;
            while r0 < *rows {
                let r1 = (r0 + tile).min(*rows);
                let n = r1 - r0;
                let mult = if *pair { 2 } else { 1 };
                // In 128 bits: a share of the outputs, never more than `out_total`.
                let all_rows = segments.iter().map(|s| u128::from(s.1)).sum::<u128>().max(1);
                let out = (u128::from(out_total) * u128::from(n) / all_rows) as u64;
                parts.push((
                    format!("{label}[{r0}..{r1}]"),
                    n * row_bytes,
                    in_bytes + out,
                    0,
                    2 * n * k * b * mult,
                    TaskArgs::Rows { linear: *lin, up: *up, r0: r0 as u32, r1: r1 as u32 },
                ));
                r0 = r1;
            }
        }
        self.add_stage(op, kind, reads, parts)
    }

    fn single(
        &mut self,
        op: usize,
        nodes: &[usize],
        reads: Vec<usize>,
        kind: TaskKind,
        state: u64,
        flops: u64,
    ) -> usize {
        let act = (self.external_inputs(nodes) + self.external_outputs(nodes)) * self.b();
        let weights: u64 = self.weights_of(nodes);
        self.add_stage(op, kind, reads, vec![("all".into(), weights, act, state, flops, TaskArgs::Whole)])
    }

    /// Bytes of the non-expert weights the nodes read.
    fn weights_of(&self, nodes: &[usize]) -> u64 {
        let mut seen = vec![];
        let mut total = 0;
        for n in nodes {
            for v in self.g.operands(node(self.g, *n)) {
                if let NodeKind::Weight(w) = &self.g.node(v.node).kind {
                    if w.family.is_none() && !seen.contains(&v.node) {
                        seen.push(v.node);
                        total += w.ty.bytes();
                    }
                }
            }
        }
        total
    }

    /// MLA decode as three stages: the queries absorbed (a head per task, or
    /// a few where the heads outnumber the SMs: W_UK once a step), the
    /// attention over (head group, KV split) tasks, and the combine with W_UV,
    /// which also waits for `gate_reads`: the stages whose values it reads for
    /// the output gate the planner put there (`head-gate`).
    fn mla(&mut self, op: usize, nodes: &[usize], reads: Vec<usize>, gate_reads: Vec<usize>) -> (usize, usize, usize) {
        let g = self.g;
        let n = nodes.iter().copied().find(|n| op_of(g, *n) == Some(OpKind::MlaDecode)).expect("mla anchor");
        let NodeKind::Op { attrs, .. } = &g.node(node(g, n)).kind else { unreachable!("an op") };
        let heads = attrs.int("heads") as u64;
        let (nope, rope, v_dim) = (attrs.int("nope") as u64, attrs.int("rope") as u64, attrs.int("v_dim") as u64);
        let c = self.weight_of(n, 3).shape[1];
        let (groups, hpt, splits) = mla_split_shape(heads, self.opts.context, self.target.sms);
        let ctx = self.opts.context.max(1);
        let b = self.b();
        let cache_row = (c + rope) * 2;
        // W_UK and W_UV stream as bf16 rows (FP8 ones are made bf16 on upload).
        let w = self.weight_of(n, 3);
        let per_row = w.shape[1] * 2;
        let in_bytes = self.external_inputs(nodes) * b;
        // Heads per absorption and combine task: one, fewer tasks than SMs; `cost`
        // gives the (weight, activation, FLOP) counts of n heads.
        let per = heads.div_ceil(u64::from(self.target.sms).min(heads).max(1));
        let head_parts = |cost: &dyn Fn(u64) -> (u64, u64, u64)| -> Vec<Part> {
            (0..heads)
                .step_by(per as usize)
                .map(|h0| {
                    let h1 = (h0 + per).min(heads);
                    let (w, act, flops) = cost(h1 - h0);
                    (format!("heads[{h0}..{h1}]"), w, act, 0, flops, TaskArgs::Heads { h0: h0 as u32, h1: h1 as u32 })
                })
                .collect()
        };
        let parts =
            head_parts(&|n| (n * nope * per_row, n * (nope + rope) * 4 * b + n * c * 4 * b, 2 * n * nope * c * b));
        let absorb = self.add_stage(op, TaskKind::MlaAbsorb, reads.clone(), parts);
        self.out_bytes[absorb] = b * heads * c * 4;
        let mut parts = vec![];
        for hg in 0..groups {
            for s in 0..splits {
                let chunk = ctx / splits + u64::from(s < ctx % splits);
                let flops = 2 * hpt * chunk * (c + rope) * 2 * b;
                let act = in_bytes / groups + hpt * c * 4 * b + hpt * (c + 2) * 4 * b;
                parts.push((
                    format!("heads[{}..{}] kv split {s}/{splits}", hg * hpt, ((hg + 1) * hpt).min(heads)),
                    0,
                    act,
                    chunk * cache_row * b / groups,
                    flops,
                    TaskArgs::KvSplit { group: hg as u32, split: s as u32 },
                ));
            }
        }
        let split = self.add_stage(op, TaskKind::MlaSplit, [vec![absorb], reads].concat(), parts);
        // The device's rule (mla_mma_fits, device/mkc/ops/mla.cuh).
        self.stages[split].mla_tensor_cores =
            c.is_multiple_of(MLA_MMA_COLUMNS) && rope.is_multiple_of(MLA_MMA_COLUMNS) && c <= MLA_MAX_LATENT;
        let out = self.external_outputs(nodes) * b;
        // The combine: its heads' W_UV blocks and their splits' partials.
        let parts = head_parts(&|n| {
            (n * v_dim * per_row, splits * n * (c + 2) * 4 * b + out * n / heads, 2 * n * v_dim * c * b)
        });
        let combine = self.add_stage(op, TaskKind::MlaCombine, [vec![split], gate_reads].concat(), parts);
        for s in [absorb, split, combine] {
            self.stages[s].mla_split = Some((groups, hpt, splits));
        }
        self.out_bytes[split] = groups * splits * hpt * (c + 2) * 4 * b;
        (absorb, split, combine)
    }

    fn kda(&mut self, op: usize, nodes: &[usize], reads: Vec<usize>) -> usize {
        let g = self.g;
        let n = nodes.iter().copied().find(|n| op_of(g, *n) == Some(OpKind::KdaDecode)).expect("kda anchor");
        let NodeKind::Op { attrs, .. } = &g.node(node(g, n)).kind else { unreachable!("an op") };
        let heads = attrs.int("heads") as u64;
        let d = attrs.int("head_dim") as u64;
        let sms = u64::from(self.target.sms);
        let tasks = heads.min(sms);
        let hpt = heads.div_ceil(tasks);
        let tasks = heads.div_ceil(hpt);
        // The state is per (sequence, head): the sequences split too, into
        // runs of `spt`, the longest that gives the busiest SM the fewest
        // (sequence, head) states (K3's 96 heads at batch 8: 2 sequences a
        // task, 6 states on the busiest of 132 SMs, not 8 on 96 of them).
        let seqs = u64::from(self.opts.sequences());
        let busiest = |spt: u64| (tasks * seqs.div_ceil(spt)).div_ceil(sms) * spt;
        let spt = (1..=seqs).rev().min_by_key(|spt| busiest(*spt)).unwrap_or(1);
        let b = self.b();
        let per_seq = b / seqs.max(1); // a sequence's rows (its positions)
        let mut parts = vec![];
        for s0 in (0..seqs).step_by(spt as usize) {
            let s1 = (s0 + spt).min(seqs);
            let rows = (s1 - s0) * per_seq;
            let act = (self.external_inputs(nodes) + self.external_outputs(nodes)) * rows / tasks;
            let w = self.weights_of(nodes) / tasks;
            for t in 0..tasks {
                let (h0, h1) = (t * hpt, (t * hpt + hpt).min(heads));
                let h = h1 - h0;
                let args = TaskArgs::SequenceHeads { h0: h0 as u32, h1: h1 as u32, s0: s0 as u32, s1: s1 as u32 };
                let label = format!("heads[{h0}..{h1}] of sequences [{s0}..{s1})");
                parts.push((label, w, act, 2 * h * d * d * 4 * (s1 - s0), 8 * h * d * d * rows, args));
            }
        }
        self.add_stage(op, TaskKind::Kda, reads, parts)
    }

    /// The attention-residual mix: a task a token row. Each row's scores and
    /// mix read only its own bank rows, so the rows spread over SMs (one task
    /// for the batch was 51 us at batch 8 on the H100, one SM's read rate).
    fn attn_res(&mut self, op: usize, nodes: &[usize], reads: Vec<usize>) -> usize {
        let act = self.external_inputs(nodes) + self.external_outputs(nodes);
        let w = self.weights_of(nodes);
        let parts = (0..self.b())
            .map(|b| {
                let args = TaskArgs::Tokens { b0: b as u32, b1: b as u32 + 1 };
                (format!("token {b}"), w, act, 0, 4 * self.external_inputs(nodes), args)
            })
            .collect();
        self.add_stage(op, TaskKind::AttnRes, reads, parts)
    }

    /// The expert stages: gate/up, down and combine, and with the experts
    /// sharded over GPUs, the exchange's send and reduce stages.
    fn moe(&mut self, op: usize, nodes: &[usize], reads: Vec<usize>) -> Vec<usize> {
        let g = self.g;
        let n = nodes.iter().copied().find(|n| op_of(g, *n) == Some(OpKind::Moe)).expect("moe anchor");
        let wg = self.weight_of(n, 3);
        let wd = self.weight_of(n, 5);
        let (e, i, d) = (wg.shape[0], wg.shape[1], wg.shape[2]);
        let k = self.g.value_type(self.g.operands(node(g, n))[1]).elements();
        let b = self.b();
        // The arena's slots cover the worst case, every (token, choice) a
        // different expert; the tasks' bytes are the expected share under
        // uniform routing, where `E (1 - (1 - k/E)^B)` experts are distinct
        // (exactly k at batch 1). Sharded over `ep` GPUs, this GPU holds
        // `E / ep` experts and expects that fraction of the distinct ones.
        let ep = u64::from(self.opts.expert_parallel.max(1));
        let local = e.div_ceil(ep);
        let slots = (b * k).min(local).max(1);
        let expected = (crate::report::expected_distinct_experts(e, k, b) / ep as f64).min(slots as f64);
        let sms = u64::from(self.target.sms);
        let up_row = 2 * wg.bytes() / (e * i);
        let down_row = wd.bytes() / (e * d);
        // At most one task per SM in each expert stage (when the slots allow):
        // a task's fixed cost is several microseconds on the H200 (the
        // per-stage profile in docs/PERFORMANCE.md), so two half-size tasks
        // on one SM take longer than one whole one, and a stage waits for
        // its slowest SM.
        //
        // The tasks share the distinct experts' rows at run time (slot s
        // takes tasks [s N / D, (s + 1) N / D) of N with D distinct experts;
        // expert_part, device/mkc/ops/moe.cuh): N is one task an SM, at least
        // one a slot, at most one a unit of rows a slot. A task's rows are at
        // most its slot's units over the fewest tasks a slot gets, N / slots;
        // on average the expected distinct experts' rows over N.
        let x_bytes = self.external_inputs(nodes) * b;
        // (The device's parts cover as many slots as the step can choose,
        // `min(B k, E)`, whatever share of the experts the estimate assumes.)
        let chosen = (b * k).min(e).max(1);
        // One stage's parts over an expert's `rows` rows of `row_bytes` each:
        // the expected share of the bytes, the activations `act(parts, most
        // rows a part gets)`, `row_flops` a row for each token that chose the
        // expert; and the mean rows a part streams.
        let expert_parts = |rows: u64, row_bytes: u64, act: &dyn Fn(u64, u64) -> u64, row_flops: u64| {
            let units = rows.div_ceil(EXPERT_UNIT_ROWS);
            let n = sms.max(chosen).min(chosen * units);
            // At batch 1 the step's distinct experts are exactly the `chosen`: a
            // multiple of them gives every slot the same parts (the parts past
            // it would only split some slots finer, the largest part the same).
            let n = if b == 1 { n / chosen * chosen } else { n };
            let most = (units.div_ceil(n / chosen) * EXPERT_UNIT_ROWS).min(rows);
            let mean = expected * rows as f64 / n as f64;
            let parts: Vec<_> = (0..n)
                .map(|j| {
                    let args = TaskArgs::ExpertRows {
                        part: j as u32,
                        parts: n as u32,
                        unit: EXPERT_UNIT_ROWS as u32,
                        rows: most as u32,
                    };
                    let flops = (mean * (row_flops * b * k) as f64 / expected).round() as u64;
                    (format!("part {j} of {n}"), (mean * row_bytes as f64).round() as u64, act(n, most), 0, flops, args)
                })
                .collect();
            (parts, mean)
        };
        let (parts, mean_up) = expert_parts(i, up_row, &|n, most| x_bytes / n + most * 2 * b, 4 * d);
        // Every stage reads the router's ids (and the combine its weights).
        let up = self.add_stage(op, TaskKind::ExpertUp, reads.clone(), parts);
        self.out_bytes[up] = slots * i * 2 * b;
        if wg.dtype == DType::Mxfp4 {
            for &t in &self.stages[up].tasks {
                self.tasks[t].decoded = (2.0 * mean_up * d as f64).round() as u64;
            }
        }
        let (parts, mean_down) = expert_parts(d, down_row, &|_, most| i * 2 * b + most * 4 * b, 2 * i);
        let down = self.add_stage(op, TaskKind::ExpertDown, [vec![up], reads.clone()].concat(), parts);
        self.out_bytes[down] = slots * d * 4 * b;
        if wd.dtype == DType::Mxfp4 {
            for &t in &self.stages[down].tasks {
                self.tasks[t].decoded = (mean_down * i as f64).round() as u64;
            }
        }
        let tiles = d.div_ceil(1024).min(8);
        let out = self.external_outputs(nodes) * b;
        let parts = (0..tiles)
            .map(|t| {
                let args = TaskArgs::Tile { tile: t as u32, tiles: tiles as u32 };
                (format!("cols {t}/{tiles}"), 0, (k * d * 4 * b + out) / tiles, 0, 2 * k * d * b / tiles, args)
            })
            .collect();
        let combine = self.add_stage(op, TaskKind::ExpertCombine, [vec![down], reads].concat(), parts);
        if ep == 1 {
            return vec![up, down, combine];
        }
        // Sharded over GPUs, the combine's sums are this GPU's part; one
        // exchange (`Exchange`) adds the GPUs' parts in tiles of the combine's.
        self.out_bytes[combine] = d * 4 * b;
        let tile = |t: u64| (t * d / tiles, (t + 1) * d / tiles);
        let parts = |reduce: bool| {
            (0..tiles)
                .map(|t| {
                    let (c0, c1) = tile(t);
                    let bytes = (c1 - c0) * 4 * b;
                    // A send reads its tile; a reduce reads every GPU's and writes the sum.
                    let act = if reduce { (ep + 1) * bytes } else { bytes };
                    let args = TaskArgs::Tile { tile: t as u32, tiles: tiles as u32 };
                    (format!("cols {t}/{tiles}"), 0, act, 0, if reduce { ep * (c1 - c0) * b } else { 0 }, args)
                })
                .collect::<Vec<Part>>()
        };
        let send = self.add_stage(op, TaskKind::ExchangeSend, vec![combine], parts(false));
        let reduce = self.add_stage(op, TaskKind::ExchangeReduce, vec![combine], parts(true));
        let tile_bytes = tile(0).1 * 4 * b;
        for s in [send, reduce] {
            self.stages[s].exchange = Some(Exchange { ranks: ep as u32, send, tile_bytes });
        }
        vec![up, down, combine, send, reduce]
    }
}

/// Tiles every fused operation of `fusion` for `target`.
pub fn tile(v: &Validated, fusion: &Fusion, target: &Target, opts: Options) -> Result<Tiling> {
    let g = v.graph();
    let mut bld = Builder { g, target, opts, stages: vec![], tasks: vec![], out_bytes: vec![] };
    // The last stage of each fused operation: what its consumers wait for.
    let mut last_stage = vec![0usize; fusion.ops.len()];
    let mut producers: Vec<Vec<usize>> = vec![vec![]; fusion.ops.len()];
    for (a, b) in &fusion.edges {
        producers[*b].push(*a);
    }
    for op in &fusion.ops {
        let reads: Vec<usize> = producers[op.id].iter().map(|p| last_stage[*p]).collect();
        let nodes = &op.nodes;
        let last = match op.kind {
            FusedKind::Projection => bld.projection(op.id, nodes, reads, TaskKind::ProjectionRows),
            FusedKind::LmHead => {
                let rows = bld.projection(op.id, nodes, reads, TaskKind::LmHeadRows);
                let tiles = bld.stages[rows].tasks.len() as u64;
                bld.out_bytes[rows] = tiles * 8 * bld.b();
                bld.single(op.id, &[], vec![rows], TaskKind::Argmax, 0, tiles * bld.b())
            }
            FusedKind::MlaDecode => {
                // The output gate's operands (FusedOp::mla_gate_reads), by their producers' last stages.
                let mut gate_reads: Vec<usize> = op
                    .mla_gate_reads(g)
                    .iter()
                    .filter_map(|v| fusion.op_of.get(&v.node.index()))
                    .map(|p| last_stage[*p])
                    .collect();
                gate_reads.sort_unstable();
                gate_reads.dedup();
                bld.mla(op.id, nodes, reads, gate_reads).2
            }
            FusedKind::KdaDecode => bld.kda(op.id, nodes, reads),
            FusedKind::Moe => *bld.moe(op.id, nodes, reads).last().expect("expert stages"),
            FusedKind::Router => {
                let e = nodes.iter().map(|n| g.value_type(g.operands(node(g, *n))[0]).elements()).max().unwrap_or(1);
                bld.single(op.id, nodes, reads, TaskKind::Router, 0, 8 * e * bld.b())
            }
            FusedKind::AttnRes => bld.attn_res(op.id, nodes, reads),
            FusedKind::Embedding => bld.single(op.id, nodes, reads, TaskKind::Embedding, 0, 0),
            FusedKind::Elementwise => {
                let flops = 4 * bld.external_outputs(nodes) * bld.b();
                bld.single(op.id, nodes, reads, TaskKind::Elementwise, 0, flops)
            }
        };
        // Embedding rows come from HBM: one row per token.
        if op.kind == FusedKind::Embedding {
            let t = bld.stages[last].tasks[0];
            bld.tasks[t].weight_bytes = bld.external_outputs(nodes) * bld.b();
        }
        bld.out_bytes[last] = bld.external_outputs(nodes) * bld.b();
        last_stage[op.id] = last;
    }
    let regions = regions(&bld.stages, &bld.out_bytes);
    let buffers = allocate(&regions);
    let mut regions = regions;
    for (r, buf) in regions.iter_mut().zip(&buffers.1) {
        r.buffer = *buf;
    }
    Ok(Tiling { stages: bld.stages, tasks: bld.tasks, regions, buffers: buffers.0 })
}

fn regions(stages: &[Stage], out_bytes: &[u64]) -> Vec<Region> {
    let mut readers: Vec<Vec<usize>> = vec![vec![]; stages.len()];
    for s in stages {
        for r in &s.reads {
            readers[*r].push(s.id);
        }
    }
    let mut out = vec![];
    for s in stages {
        if readers[s.id].is_empty() && out_bytes[s.id] == 0 {
            continue;
        }
        out.push(Region {
            id: out.len(),
            writer: s.id,
            readers: readers[s.id].clone(),
            bytes: out_bytes[s.id],
            buffer: 0,
        });
    }
    out
}

/// Assigns regions to arena buffers. A buffer is reused only when every reader
/// of its previous region comes at least two stages before the new writer, so
/// reuse rarely adds an ordering the data flow does not already imply.
fn allocate(regions: &[Region]) -> (Vec<u64>, Vec<usize>) {
    let mut buffers: Vec<u64> = vec![];
    let mut busy_until: Vec<usize> = vec![];
    let mut assignment = vec![];
    for r in regions {
        let last = r.readers.iter().copied().max().unwrap_or(usize::MAX);
        let free = (0..buffers.len())
            .filter(|b| busy_until[*b] != usize::MAX && busy_until[*b] + 2 <= r.writer && buffers[*b] >= r.bytes)
            .min_by_key(|b| buffers[*b]);
        let b = match free {
            Some(b) => b,
            None => {
                buffers.push(r.bytes);
                busy_until.push(0);
                buffers.len() - 1
            }
        };
        busy_until[b] = last;
        assignment.push(b);
    }
    (buffers, assignment)
}
