//! The program of one decode step as the megakernel runs it: where every
//! value lives, what each task computes, and the device code of each stage.
//!
//! Values that cross fused operations live in the scratch arena, in the
//! region of the stage that writes them (the plan's regions and buffers, so
//! the verifier's reuse proof covers them); graph outputs go to their own
//! buffers, per-sequence state to its own allocations, weights are read
//! through the runtime's pointer table in `weights.h` order.
//!
//! Each stage becomes one device function (its comment names the graph nodes
//! it covers) that calls the library in `device/mkc/ops.cuh` with the stage's
//! constants and pointers. A projection's epilogue is compiled from its
//! nodes: the task's rows sit in an fp32 staging tile, and each row-local op
//! (split, RoPE, residual add, act-and-mul, RMSNorm, short conv, L2 norm,
//! stack) works on the part of its value that the tile holds (a
//! `Span` computed at run time), in graph order; a value read outside the
//! operation is stored as soon as it is final. What the library does not
//! compute is refused with the fused operation's name, never skipped.
//!
//! This file holds the arena layout and the shared helpers; the stage
//! emitters are in `program/projection.rs`, `program/attention.rs` (MLA, KDA,
//! attention residuals) and `program/moe.rs` (router, experts).

use std::collections::HashMap;
use std::fmt::Write;

use crate::checkpoint::requirements;
use crate::diag::{Error, ErrorKind, Result};
use crate::ir::{DType, Graph, NodeId, NodeKind, TensorType, ValueRef};
use crate::ops::Attrs;
use crate::ops::OpKind;
use crate::plan::fuse::{FusedKind, FusedOp};
// The shared memory the stages may use beside the page ring and the staged
// input's, as the planner sized the CTA (device/mkc/ops/common.cuh:
// kScratchBytes, kActivationBytes).
use crate::plan::specialize::{ACTIVATION_BYTES, SCRATCH_BYTES};
use crate::plan::tile::mla_split_shape;
use crate::plan::Plan;
use crate::valid::Validated;

// The stage emitters, by family (each an `impl Gen` block).
mod attention;
mod moe;
mod projection;

/// The type bf16 values take in the arena: fp32. Activations are a few KB
/// per token, so keeping them exact costs nothing measurable and lets the
/// kernel follow an fp32 reference through discontinuous decisions (top-k
/// routing); weights and the KV cache keep their checkpoint/graph dtypes.
const ACTIVATIONS: DType = DType::F32;

/// A block of the arena the program reads or writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ArenaSlot {
    /// The plan's region it belongs to.
    pub region: usize,
    /// The region's buffer.
    pub buffer: usize,
    /// Offset: within the region while generating, in the arena in
    /// [`Program::layout`].
    pub offset: u64,
    /// Size in bytes at the planned batch.
    pub bytes: u64,
    /// The stage that writes it.
    pub writer: usize,
}

/// The generated program of one step.
#[derive(Debug, Clone)]
pub struct Program {
    /// Every arena slot, at its arena offset.
    pub layout: Vec<ArenaSlot>,
    /// Each buffer's (arena offset, size).
    pub buffers: Vec<(u64, u64)>,
    /// The arena's size in bytes.
    pub arena_bytes: u64,
    /// The routing log's arena offset: every router's expert ids of the last
    /// step, `[router][batch][top_k]` int32, in graph order.
    pub route_log: u64,
    /// The routers logged: (graph node, top-k).
    pub routers: Vec<(String, u64)>,
    /// The log's length in ids (batch x top-k, summed over the routers).
    pub route_log_ints: u64,
    /// The routers' common top-k (0: no routers, or routers of different top-k).
    pub router_top_k: u64,
    /// fp32 staging per SM for projection epilogues.
    pub staging_floats: u64,
    /// Ring pages the plan's warp layout was sized for.
    pub pages: u32,
    /// Per-sequence states: (name, bytes per sequence).
    pub states: Vec<(String, u64)>,
    /// Graph outputs: (name, C++ type, bytes per sequence).
    pub outputs: Vec<(String, &'static str, u64)>,
    /// Which output is the next token (i32) and which the logits (f32 [vocab]).
    pub next_token_output: usize,
    /// See `next_token_output`.
    pub logits_output: usize,
    /// Logits per sequence.
    pub vocab: u64,
    /// Per plan task: (stage, index in its stage, args).
    pub tasks: Vec<(usize, usize, [u32; 4])>,
    /// Device code: constants and one function per stage.
    pub code: String,
    /// `case` lines of the loader's dispatch.
    pub load_cases: Vec<String>,
    /// `case` lines of the consumers' dispatch.
    pub run_cases: Vec<String>,
    /// Stages whose weights the loader may stream only after a wait
    /// (routed experts: the router's counter): (stage, counter, bumps per step).
    pub load_waits: Vec<(usize, u32, u32)>,
}

fn unsupported(op: &FusedOp, what: &str) -> Error {
    Error::new(
        ErrorKind::Invalid,
        format!(
            "codegen: fused operation {} ({}) needs {what}, which the device library does not compute yet",
            op.id, op.name
        ),
    )
}

fn ctype(d: DType) -> &'static str {
    match d {
        DType::Bf16 => "__nv_bfloat16",
        DType::F32 => "float",
        DType::I32 => "int32_t",
        DType::F16 => "__half",
        DType::I64 => "int64_t",
        DType::U8 | DType::Mxfp4 | DType::Fp8E4m3 => "uint8_t",
    }
}

/// The epilogue call of an act-and-mul on the gate span `span` (SiLU, or
/// K3's SiTU with its two betas), or what is not supported.
fn act_and_mul_call(attrs: &Attrs, span: &str) -> std::result::Result<String, String> {
    match attrs.str("act") {
        "silu" => Ok(format!("ep_silu_and_mul<kBatch>(st, n, {span});")),
        "situ" => Ok(format!(
            "ep_situ_and_mul<kBatch>(st, n, {span}, {}, {});",
            float(attrs.float("beta")),
            float(attrs.float("linear_beta"))
        )),
        a => Err(format!("act_and_mul with act \"{a}\"")),
    }
}

fn align(x: u64, a: u64) -> u64 {
    x.div_ceil(a) * a
}

fn float(x: f64) -> String {
    let s = format!("{:e}", x as f32);
    format!("{s}f")
}

/// Where a value is, as a C++ pointer expression.
#[derive(Debug, Clone)]
struct Slot {
    ptr: String,
    ty: TensorType,
}

struct Gen<'a> {
    g: &'a Graph,
    plan: &'a Plan,
    source: &'a str,
    batch: u64,
    weight_index: HashMap<String, usize>,
    state_index: HashMap<NodeId, usize>,
    slots: HashMap<ValueRef, Slot>,
    writer: HashMap<ValueRef, usize>,
    layout: Vec<ArenaSlot>,
    region_bytes: Vec<u64>,
    buffer_offset: Vec<u64>,
    staging: u64,
    code: String,
    load_cases: Vec<String>,
    run_cases: Vec<String>,
    load_waits: Vec<(usize, u32, u32)>,
    routers: Vec<(String, u64)>,
    /// Bytes of the routing log so far (the next router's offset in it).
    route_log_bytes: u64,
}

impl Gen<'_> {
    /// The spill argument of an operation that stages its input [batch, k]
    /// whole as fp32 (device `input_area`): `nullptr` when it fits the
    /// shared-memory staging, otherwise this SM's global staging past the
    /// output tile of `tile` floats (128-byte aligned for the float4 stores
    /// that stage it), the staging grown to hold both.
    fn spill(&mut self, tile: u64, k: u64) -> String {
        if self.batch * k * 4 <= ACTIVATION_BYTES {
            return "nullptr".into();
        }
        let at = align(tile, 32);
        self.staging = self.staging.max(at + self.batch * k);
        format!("st + {at}")
    }
}

fn nid(i: usize) -> NodeId {
    NodeId(petgraph::stable_graph::NodeIndex::new(i))
}

impl<'a> Gen<'a> {
    fn op_of(&self, n: NodeId) -> Option<(OpKind, &'a Attrs)> {
        let g: &'a Graph = self.g;
        match &g.node(n).kind {
            NodeKind::Op { op, attrs } => Some((*op, attrs)),
            _ => None,
        }
    }

    fn where_(&self, n: NodeId) -> String {
        let node = self.g.node(n);
        if self.source.is_empty() {
            return node.name.clone();
        }
        let (l, c) = node.span.line_col(self.source);
        format!("{} ({l}:{c})", node.name)
    }

    /// The pointer to a weight (member `i` of a family).
    fn weight(&self, n: NodeId, i: u64) -> Result<String> {
        let NodeKind::Weight(w) = &self.g.node(n).kind else {
            return Err(Error::new(ErrorKind::Invalid, format!("codegen: {} is not a weight", self.g.node(n).name)));
        };
        let idx = self.weight_index[&w.key_at(i)];
        Ok(format!("static_cast<const {}*>(m.w[{idx}])", ctype(w.ty.dtype)))
    }

    /// The index of family member 0 (members are consecutive).
    fn family_base(&self, n: NodeId) -> usize {
        let NodeKind::Weight(w) = &self.g.node(n).kind else { unreachable!("a weight") };
        self.weight_index[&w.key_at(0)]
    }

    /// The pointer to an activation value.
    fn value(&self, v: ValueRef, op: &FusedOp) -> Result<String> {
        let node = self.g.node(v.node);
        match &node.kind {
            NodeKind::Input => Ok("m.tokens".into()),
            NodeKind::Weight(_) => self.weight(v.node, 0),
            _ => self
                .slots
                .get(&v)
                .map(|s| s.ptr.clone())
                .ok_or_else(|| unsupported(op, &format!("{}'s value in the arena", node.name))),
        }
    }

    /// Reserves `bytes` in the region `stage` writes; returns the address as
    /// C++ (`m.arena + kBuffer<b> + offset`: buffer offsets are known once
    /// every region is sized, and the header defines them).
    fn reserve(&mut self, stage: usize, bytes: u64) -> Result<String> {
        let Some(r) = self.plan.tiling.regions.iter().find(|r| r.writer == stage) else {
            return Err(Error::new(
                ErrorKind::Invalid,
                format!("codegen: stage {stage} writes values but has no region"),
            ));
        };
        let at = self.region_bytes[r.id];
        self.region_bytes[r.id] = align(at + bytes, 16);
        self.layout.push(ArenaSlot { region: r.id, buffer: r.buffer, offset: at, bytes, writer: stage });
        Ok(format!("m.arena + kBuffer{} + {at}", r.buffer))
    }

    /// Gives every value of `op` read elsewhere a slot in `stage`'s region
    /// (or an output buffer).
    fn place_outputs(&mut self, op: &FusedOp, stage: usize) -> Result<()> {
        let inside = |n: NodeId| op.nodes.contains(&n.index());
        for &n in &op.nodes {
            let id = nid(n);
            let node = self.g.node(id);
            for (o, ty) in node.outputs.iter().enumerate() {
                let v = ValueRef { node: id, output: o as u16 };
                let outside =
                    self.g.g.edges_directed(id.0, petgraph::Direction::Outgoing).any(|e| {
                        e.weight().output == o as u16 && !inside(NodeId(petgraph::visit::EdgeRef::target(&e)))
                    });
                self.writer.insert(v, stage);
                if let Some(k) = self.g.outputs.iter().position(|(_, ov)| *ov == v) {
                    let ptr = format!("static_cast<{}*>(m.out[{k}])", ctype(ty.dtype));
                    self.slots.insert(v, Slot { ptr, ty: ty.clone() });
                } else if outside {
                    // Activations cross operations in fp32 (see ACTIVATIONS).
                    let dtype = if ty.dtype == DType::Bf16 { ACTIVATIONS } else { ty.dtype };
                    let kept = TensorType::new(dtype, ty.shape.clone());
                    let at = self.reserve(stage, kept.bytes() * self.batch)?;
                    let ptr = format!("reinterpret_cast<{}*>({at})", ctype(dtype));
                    self.slots.insert(v, Slot { ptr, ty: kept });
                }
            }
        }
        Ok(())
    }

    /// Checks that `stage` waits for the writers of the arena values it
    /// reads: the plan's orderings and buffer reuse are proved for the
    /// stages' declared reads, so a read outside them would be a race.
    fn check_reads(&self, stage: usize, values: &[ValueRef]) -> Result<()> {
        for v in values {
            if let Some(w) = self.writer.get(v) {
                if !self.plan.tiling.stages[stage].reads.contains(w) {
                    return Err(Error::new(
                        ErrorKind::Invalid,
                        format!(
                            "internal error: stage {stage} reads {} (written by stage {w}) without depending on it",
                            self.g.node(v.node).name
                        ),
                    ));
                }
            }
        }
        Ok(())
    }

    /// An operation's input `v` with its optional RMSNorm prologue: the
    /// value actually read, its pointer, the norm weight's pointer (or
    /// `nullptr`) and epsilon. Any other prologue is refused.
    fn with_norm_prologue(&self, op: &FusedOp, v: ValueRef) -> Result<(ValueRef, String, String, f64)> {
        if !op.nodes.contains(&v.node.index()) {
            return Ok((v, self.value(v, op)?, "nullptr".into(), 1e-6));
        }
        let Some((OpKind::RmsNorm, attrs)) = self.op_of(v.node) else {
            return Err(unsupported(op, &format!("a {} prologue", self.g.node(v.node).name)));
        };
        let nops = self.g.operands(v.node);
        if op.nodes.contains(&nops[0].node.index()) {
            return Err(unsupported(op, "a prologue of more than one op"));
        }
        Ok((nops[0], self.value(nops[0], op)?, self.weight(nops[1].node, 0)?, attrs.float("eps")))
    }

    fn last_stage(&self, op: &FusedOp) -> usize {
        self.plan.tiling.stages.iter().filter(|s| s.op == op.id).map(|s| s.id).max().expect("every op has a stage")
    }

    fn stages_of(&self, op: &FusedOp) -> Vec<usize> {
        self.plan.tiling.stages.iter().filter(|s| s.op == op.id).map(|s| s.id).collect()
    }

    fn header(&mut self, stage: usize, op: &FusedOp, what: &str) {
        let _ = writeln!(self.code, "\n// Stage {stage}: {what} of fused operation {}, {}", op.id, op.name);
        for &n in &op.nodes {
            let (o, _) = self.op_of(nid(n)).expect("fused ops hold ops");
            let _ = writeln!(self.code, "//   {} {}", o.name(), self.where_(nid(n)));
        }
    }

    fn fused(&mut self, op: &FusedOp) -> Result<()> {
        match op.kind {
            FusedKind::Embedding => self.embedding(op),
            FusedKind::Projection | FusedKind::LmHead => self.projection(op),
            FusedKind::MlaDecode => self.mla(op),
            FusedKind::Router => self.router(op),
            FusedKind::Moe => self.moe(op),
            FusedKind::KdaDecode => self.kda(op),
            FusedKind::AttnRes => self.attn_res(op),
            FusedKind::Elementwise => Err(unsupported(op, "a stand-alone element-wise operation")),
        }
    }

    fn embedding(&mut self, op: &FusedOp) -> Result<()> {
        let stage = self.last_stage(op);
        self.place_outputs(op, stage)?;
        let n = nid(op.nodes[0]);
        let ops = self.g.operands(n);
        let table = self.weight(ops[1].node, 0)?;
        let hidden = self.g.value_type(ops[1]).shape[1];
        let out = self.value(ValueRef { node: n, output: 0 }, op)?;
        // A stack epilogue (K3: the embedding is the bank's first snapshot).
        let mut extra = String::new();
        for &e in &op.nodes[1..] {
            let e = nid(e);
            match self.op_of(e) {
                Some((OpKind::Stack, _)) => {
                    let sops = self.g.operands(e);
                    if sops.len() != 1 || sops[0].node != n {
                        return Err(unsupported(op, "an embedding epilogue that stacks more than its row"));
                    }
                    let bank = self.value(ValueRef { node: e, output: 0 }, op)?;
                    let _ = write!(
                        extra,
                        "\n  consumer_sync();\n  stack_rows<kBatch>(static_cast<const float*>(nullptr), 0, {out}, {hidden}, {bank});"
                    );
                }
                _ => return Err(unsupported(op, &format!("an embedding epilogue {}", self.g.node(e).name))),
            }
        }
        self.header(stage, op, "token rows");
        let _ = writeln!(
            self.code,
            "__device__ inline void stage_{stage}(const TaskArgs&, const Memory& m) {{\n  embedding<kBatch>({table}, m.tokens, {hidden}, {out});{extra}\n}}"
        );
        self.run_cases.push(format!("case {stage}: stage_{stage}(t, m); break;"));
        Ok(())
    }
}

/// RoPE's inverse frequencies and cos/sin scale, as transformers computes
/// them (default, or DeepSeek-V3's YaRN when `yarn_factor > 1`).
pub fn rope_table(attrs: &Attrs) -> (Vec<f64>, f64) {
    let rot = attrs.int("rot") as usize;
    let theta = attrs.float("theta");
    let dim = rot as f64;
    let pos_freqs: Vec<f64> = (0..rot / 2).map(|i| theta.powf((2 * i) as f64 / dim)).collect();
    let factor = attrs.float("yarn_factor");
    if factor <= 1.0 {
        return (pos_freqs.iter().map(|p| 1.0 / p).collect(), 1.0);
    }
    let orig = attrs.int("yarn_original_max") as f64;
    let (fast, slow) = (attrs.float("yarn_beta_fast"), attrs.float("yarn_beta_slow"));
    let corr = |rotations: f64| dim * (orig / (rotations * 2.0 * std::f64::consts::PI)).ln() / (2.0 * theta.ln());
    let low = corr(fast).floor().max(0.0);
    let mut high = corr(slow).ceil().min(dim - 1.0);
    if low == high {
        high += 0.001;
    }
    let inv: Vec<f64> = pos_freqs
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
            let extrapolation = 1.0 - ramp;
            (1.0 / (factor * p)) * (1.0 - extrapolation) + (1.0 / p) * extrapolation
        })
        .collect();
    let ms = |m: f64| if m <= 0.0 { 1.0 } else { 0.1 * m * factor.ln() + 1.0 };
    let (m, m_all) = (attrs.float("yarn_mscale"), attrs.float("yarn_mscale_all_dim"));
    let mscale = if m_all > 0.0 { ms(m) / ms(m_all) } else { ms(1.0) };
    (inv, mscale)
}

/// Builds the program of `plan`. `source` is the graph file's text (for the
/// comments' line:column; may be empty).
pub fn program(v: &Validated, plan: &Plan, source: &str) -> Result<Program> {
    if plan.options.expert_parallel > 1 {
        return Err(Error::new(
            ErrorKind::Invalid,
            "codegen: plans sharding the experts over several GPUs are estimates only (no dispatch yet)".to_string(),
        ));
    }
    let g = v.graph();
    let mut weight_index = HashMap::new();
    for (i, r) in requirements(v).into_iter().enumerate() {
        weight_index.entry(r.key).or_insert(i);
    }
    let mut state_index = HashMap::new();
    let mut states = vec![];
    for id in g.nodes() {
        if let NodeKind::State(s) = &g.node(id).kind {
            if s.dtype != DType::Bf16 && s.dtype != DType::F32 {
                return Err(Error::new(
                    ErrorKind::Invalid,
                    format!("codegen: state {} must be bf16 or f32", g.node(id).name),
                ));
            }
            state_index.insert(id, states.len());
            states.push((g.node(id).name.clone(), s.bytes(plan.options.context)));
        }
    }
    let outputs: Vec<(String, &'static str, u64)> = g
        .outputs
        .iter()
        .map(|(name, v)| {
            let ty = g.value_type(*v);
            (name.clone(), ctype(ty.dtype), ty.bytes())
        })
        .collect();
    let output_of = |want: &dyn Fn(&TensorType) -> bool| g.outputs.iter().position(|(_, v)| want(g.value_type(*v)));
    let next_token = output_of(&|t| t.dtype == DType::I32 && t.elements() == 1);
    let logits = output_of(&|t| t.dtype == DType::F32 && t.shape.len() == 1);
    let (Some(next_token_output), Some(logits_output)) = (next_token, logits) else {
        return Err(Error::new(
            ErrorKind::Invalid,
            "codegen: the graph must output the next token (i32) and the logits (f32 [vocab])".to_string(),
        ));
    };
    let vocab = g.value_type(g.outputs[logits_output].1).elements();
    let mut gen = Gen {
        g,
        plan,
        source,
        batch: u64::from(plan.options.batch),
        weight_index,
        state_index,
        slots: HashMap::new(),
        writer: HashMap::new(),
        layout: vec![],
        region_bytes: vec![0; plan.tiling.regions.len()],
        buffer_offset: vec![],
        staging: 0,
        code: String::new(),
        load_cases: vec![],
        run_cases: vec![],
        load_waits: vec![],
        routers: vec![],
        route_log_bytes: 0,
    };
    for op in &plan.fusion.ops {
        gen.fused(op)?;
    }
    // Buffers: each as large as the largest region placed in it.
    let mut sizes = vec![0u64; plan.tiling.buffers.len()];
    for r in &plan.tiling.regions {
        sizes[r.buffer] = sizes[r.buffer].max(gen.region_bytes[r.id]);
    }
    let mut at = 0;
    for s in &sizes {
        gen.buffer_offset.push(at);
        at = align(at + s, 256);
    }
    // The routing log, after the buffers: no stage reuses it.
    let route_log = at;
    at = align(at + gen.route_log_bytes, 256);
    let top_k = gen.routers.first().map_or(0, |(_, k)| *k);
    let router_top_k = if gen.routers.iter().all(|(_, k)| *k == top_k) { top_k } else { 0 };
    let mut in_stage = vec![0usize; plan.tiling.stages.len()];
    let tasks = plan
        .tiling
        .tasks
        .iter()
        .map(|t| {
            in_stage[t.stage] += 1;
            (t.stage, in_stage[t.stage] - 1, t.args)
        })
        .collect();
    let layout =
        gen.layout.iter().map(|s| ArenaSlot { offset: gen.buffer_offset[s.buffer] + s.offset, ..*s }).collect();
    let buffers = gen.buffer_offset.iter().copied().zip(sizes.iter().copied()).collect();
    Ok(Program {
        layout,
        buffers,
        arena_bytes: at.max(256),
        route_log,
        routers: gen.routers,
        route_log_ints: gen.route_log_bytes / 4,
        router_top_k,
        staging_floats: align(gen.staging.max(1), 32),
        pages: plan.warps.layout.pages,
        states,
        outputs,
        next_token_output,
        logits_output,
        vocab,
        tasks,
        code: gen.code,
        load_cases: gen.load_cases,
        run_cases: gen.run_cases,
        load_waits: gen.load_waits,
    })
}
