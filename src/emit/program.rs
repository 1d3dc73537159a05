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
//! (split, RoPE, residual add, act-and-mul, RMSNorm) works on the part of its
//! value that the tile holds (a [`Span`] computed at run time), in graph
//! order; a value read outside the operation is stored as soon as it is
//! final. What the library does not compute yet is refused with the fused
//! operation's name, never skipped.

use std::collections::HashMap;
use std::fmt::Write;

use crate::checkpoint::requirements;
use crate::diag::{Error, ErrorKind, Result};
use crate::ir::{DType, Graph, NodeId, NodeKind, TensorType, ValueRef};
use crate::ops::Attrs;
use crate::ops::OpKind;
use crate::plan::fuse::{FusedKind, FusedOp};
use crate::plan::tile::mla_split_shape;
use crate::plan::Plan;
use crate::valid::Validated;

/// The type bf16 values take in the arena: fp32. Activations are a few KB
/// per token, so keeping them exact costs nothing measurable and lets the
/// kernel follow an fp32 reference through discontinuous decisions (top-k
/// routing); weights and the KV cache keep their checkpoint/graph dtypes.
const ACTIVATIONS: DType = DType::F32;

/// Shared memory the stages may use beside the page ring (device/mkc/ops.cuh).
const SCRATCH_BYTES: u64 = 24 << 10;
/// Shared memory for a projection's staged input (device/mkc/ops.cuh, kActivationBytes).
const ACTIVATION_BYTES: u64 = 64 << 10;

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
    /// fp32 staging per SM for projection epilogues.
    pub staging_floats: u64,
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

    fn projection(&mut self, op: &FusedOp) -> Result<()> {
        let g = self.g;
        let stages = self.stages_of(op);
        let rows_stage = stages[0];
        let last = *stages.last().expect("a stage");
        self.place_outputs(op, last)?;
        let inside = |n: NodeId| op.nodes.contains(&n.index());
        let linears: Vec<NodeId> = op
            .nodes
            .iter()
            .map(|n| nid(*n))
            .filter(|n| matches!(self.op_of(*n), Some((OpKind::Linear | OpKind::LmHead, _))))
            .collect();
        // The shared input and its prologue.
        let x = g.operands(linears[0])[0];
        for l in &linears {
            if g.operands(*l)[0] != x {
                return Err(unsupported(op, "linears with different inputs in one projection"));
            }
        }
        // The prologue: none, an RMSNorm, KDA's gated output norm, or an
        // element-wise gate (x * sigmoid(g), K3's MLA output gate).
        let gated = op.nodes.contains(&x.node.index()) && matches!(self.op_of(x.node), Some((OpKind::GatedRmsNorm, _)));
        let mul = op.nodes.contains(&x.node.index()) && matches!(self.op_of(x.node), Some((OpKind::Mul, _)));
        let mut mul_gate: Option<(String, u32)> = None;
        let mut extra_reads = vec![];
        let (x_in, x_ptr, norm, eps, gate) = if mul {
            let mops = g.operands(x.node);
            let inside = |v: &ValueRef| op.nodes.contains(&v.node.index());
            // One operand is the value, the other the gate (or its sigmoid, inside).
            let (val, gv) = if inside(&mops[1]) || !inside(&mops[0]) { (mops[0], mops[1]) } else { (mops[1], mops[0]) };
            if inside(&val) {
                return Err(unsupported(op, "a gated input computed inside the operation"));
            }
            let (graw, sig) = if inside(&gv) {
                match self.op_of(gv.node) {
                    Some((OpKind::Sigmoid, _)) if !inside(&g.operands(gv.node)[0]) => (g.operands(gv.node)[0], 1),
                    _ => return Err(unsupported(op, "a gate prologue other than a sigmoid of a value")),
                }
            } else {
                (gv, 0)
            };
            extra_reads.push(graw);
            mul_gate = Some((self.value(graw, op)?, sig));
            (val, self.value(val, op)?, "nullptr".to_string(), 1e-6, None)
        } else if gated {
            let (_, attrs) = self.op_of(x.node).expect("an op");
            let gops = g.operands(x.node);
            if gops.iter().take(2).any(|v| op.nodes.contains(&v.node.index())) {
                return Err(unsupported(op, "a prologue of more than one op"));
            }
            let d = g.value_type(gops[2]).elements();
            let act = match attrs.str("act") {
                "sigmoid" => 1,
                "silu" => 0,
                a => return Err(unsupported(op, &format!("a gated norm with act \"{a}\""))),
            };
            let gate = (gops[1], self.value(gops[1], op)?, d, act);
            (gops[0], self.value(gops[0], op)?, self.weight(gops[2].node, 0)?, attrs.float("eps"), Some(gate))
        } else {
            let (x_in, x_ptr, norm, eps) = self.with_norm_prologue(op, x)?;
            (x_in, x_ptr, norm, eps, None)
        };
        let k = g.value_type(x_in).elements();
        let mut reads = vec![x_in];
        reads.extend(extra_reads);
        if mul_gate.is_some() && self.batch * k * 4 > ACTIVATION_BYTES {
            return Err(unsupported(
                op,
                &format!(
                    "a gated input of {k} channels at batch {} (the staged input holds {ACTIVATION_BYTES} bytes)",
                    self.batch
                ),
            ));
        }
        if let Some((gv, _, d, _)) = &gate {
            reads.push(*gv);
            if d == &0 || !k.is_multiple_of(*d) || self.batch * k * 4 > ACTIVATION_BYTES {
                return Err(unsupported(
                    op,
                    &format!(
                        "a gated-norm prologue over {k} channels in groups of {d} at batch {} (the staged \
                         input holds {ACTIVATION_BYTES} bytes)",
                        self.batch
                    ),
                ));
            }
        }
        if !matches!(g.value_type(x).dtype, DType::Bf16 | DType::F32) || !k.is_multiple_of(8) {
            return Err(unsupported(op, "a bf16 or f32 input whose length is a multiple of 8"));
        }
        for l in &linears {
            let w = g.value_type(g.operands(*l)[1]);
            if w.dtype != DType::Bf16 {
                return Err(unsupported(op, &format!("{} weights ({})", w.dtype.name(), g.node(*l).name)));
            }
        }
        // Row sources of each task, by its linear node.
        let mut rows = String::new();
        let _ = writeln!(rows, "  Rows r{{nullptr, nullptr, t.a[2], t.a[3], {k}}};\n  switch (t.a[0]) {{");
        for l in &linears {
            let w = self.weight(g.operands(*l)[1].node, 0)?;
            let up = op
                .nodes
                .iter()
                .map(|n| nid(*n))
                .find(|n| matches!(self.op_of(*n), Some((OpKind::ActAndMul, _))) && g.operands(*n)[0].node == *l);
            let w1 = match up.map(|a| g.operands(a)[1].node) {
                Some(u) if linears.contains(&u) => self.weight(g.operands(u)[1].node, 0)?,
                _ => "nullptr".into(),
            };
            let _ = writeln!(rows, "    case {}: r.w0 = {w}; r.w1 = {w1}; break;", l.index());
        }
        let _ = writeln!(rows, "    default: __trap();\n  }}");
        let tasks: Vec<usize> = self.plan.tiling.stages[rows_stage].tasks.clone();
        let max_cols = tasks
            .iter()
            .map(|t| {
                let a = self.plan.tiling.tasks[*t].args;
                u64::from(a[3] - a[2]) * if a[1] == u32::MAX { 1 } else { 2 }
            })
            .max()
            .unwrap_or(0);
        self.staging = self.staging.max(max_cols * self.batch);

        // The epilogue, in graph order: each value's span in the tile.
        let mut body = String::new();
        let mut span: HashMap<ValueRef, String> = HashMap::new();
        let mut in_op_users: HashMap<ValueRef, usize> = HashMap::new();
        for &n in &op.nodes {
            for v in g.operands(nid(n)) {
                if inside(v.node) {
                    *in_op_users.entry(v).or_default() += 1;
                }
            }
        }
        let mut spans = 0;
        let mut new_span = |body: &mut String, expr: String| {
            spans += 1;
            let name = format!("s{spans}");
            let _ = writeln!(body, "  const Span {name} = {expr};");
            name
        };
        let mut lm_tiles = None;
        for &ni in &op.nodes {
            let n = nid(ni);
            let (kind, attrs) = self.op_of(n).expect("an op");
            let ops = g.operands(n);
            let out = ValueRef { node: n, output: 0 };
            let comment = format!("  // {} {}", kind.name(), self.where_(n));
            let _ = writeln!(body, "{comment}");
            match kind {
                OpKind::RmsNorm | OpKind::GatedRmsNorm | OpKind::Mul if n == x.node => continue,
                OpKind::Sigmoid if mul_gate.is_some() && g.operands(x.node).iter().any(|v| v.node == n) => continue,
                OpKind::Linear | OpKind::LmHead => {
                    let s = new_span(&mut body, format!("linear_span(t, {})", n.index()));
                    span.insert(out, s);
                }
                OpKind::ActAndMul => {
                    let gate = span
                        .get(&ops[0])
                        .cloned()
                        .ok_or_else(|| unsupported(op, "act_and_mul of values it does not compute"))?;
                    let call = act_and_mul_call(attrs, &gate).map_err(|a| unsupported(op, &a))?;
                    let _ = writeln!(body, "  {call}\n  consumer_sync();");
                    span.insert(out, gate);
                }
                OpKind::Split => {
                    let src = span
                        .get(&ops[0])
                        .cloned()
                        .ok_or_else(|| unsupported(op, "a split of a value it does not compute"))?;
                    let mut off = 0i64;
                    for (o, size) in attrs.int_list("sizes").iter().enumerate() {
                        let s = new_span(&mut body, format!("sub_span({src}, {off}, {size})"));
                        span.insert(ValueRef { node: n, output: o as u16 }, s);
                        off += size;
                    }
                }
                OpKind::Rope => {
                    let src = span
                        .get(&ops[0])
                        .cloned()
                        .ok_or_else(|| unsupported(op, "RoPE of a value it does not compute"))?;
                    let (inv, mscale) = rope_table(attrs);
                    let table = format!("rope_{}", n.index());
                    let list: Vec<String> = inv.iter().map(|f| float(*f)).collect();
                    let _ = writeln!(
                        self.code,
                        "__device__ const float {table}[{}] = {{{}}};",
                        list.len(),
                        list.join(", ")
                    );
                    let style = match attrs.str("style") {
                        "interleaved" => "true",
                        "neox" => "false",
                        s => return Err(unsupported(op, &format!("RoPE style \"{s}\""))),
                    };
                    let _ = writeln!(
                        body,
                        "  ep_rope<kBatch>(st, n, {src}, {}, {}, {style}, {table}, {}, m.pos);\n  consumer_sync();",
                        attrs.int("head_dim"),
                        attrs.int("rot"),
                        float(mscale)
                    );
                    span.insert(out, src);
                }
                OpKind::Add => {
                    let (mine, other) = match (span.get(&ops[0]), span.get(&ops[1])) {
                        (Some(s), None) => (s.clone(), ops[1]),
                        (None, Some(s)) => (s.clone(), ops[0]),
                        _ => return Err(unsupported(op, "an add of two values it computes")),
                    };
                    let ptr = self.value(other, op)?;
                    reads.push(other);
                    let len = g.value_type(other).elements();
                    let _ = writeln!(body, "  ep_add<kBatch>(st, n, {mine}, {ptr}, {len});\n  consumer_sync();");
                    span.insert(out, mine);
                }
                OpKind::RmsNorm => {
                    let src = span
                        .get(&ops[0])
                        .cloned()
                        .ok_or_else(|| unsupported(op, "RMSNorm of a value it does not compute"))?;
                    let w = self.weight(ops[1].node, 0)?;
                    let len = g.value_type(ops[0]).elements();
                    if g.value_type(ops[1]).elements() != len {
                        return Err(unsupported(op, "a grouped RMSNorm epilogue"));
                    }
                    let _ = writeln!(
                        body,
                        "  ep_rms_norm<kBatch>(st, n, {src}, {len}, {w}, {});\n  consumer_sync();",
                        float(attrs.float("eps"))
                    );
                    span.insert(out, src);
                }
                OpKind::Stack => {
                    // The bank with this row appended: the row is a span of the tile.
                    if ops.len() != 2 {
                        return Err(unsupported(op, "a stack epilogue that starts a bank"));
                    }
                    let src = span
                        .get(&ops[1])
                        .cloned()
                        .ok_or_else(|| unsupported(op, "a stack of a row it does not compute"))?;
                    if op.nodes.contains(&ops[0].node.index()) {
                        return Err(unsupported(op, "a stack of a bank computed inside the operation"));
                    }
                    let hidden = g.value_type(ops[1]).elements();
                    let rows = g.value_type(ops[0]).elements() / hidden.max(1);
                    let bank = self.value(ops[0], op)?;
                    reads.push(ops[0]);
                    let dst = self.value(out, op)?;
                    let _ = writeln!(body, "  ep_stack<kBatch>(st, n, {src}, {bank}, {rows}, {hidden}, {dst});");
                    // The stacked bank is stored here, not through a span.
                    continue;
                }
                OpKind::ConvUpdate => {
                    let src = span
                        .get(&ops[0])
                        .cloned()
                        .ok_or_else(|| unsupported(op, "a short conv of a value it does not compute"))?;
                    let wt = g.value_type(ops[1]);
                    let channels = g.value_type(ops[0]).elements();
                    let width = wt.shape.last().copied().unwrap_or(0);
                    if wt.dtype != DType::F32 || wt.elements() != channels * width || width < 1 {
                        return Err(unsupported(op, "a short conv whose weight is not f32 [channels, 1, width]"));
                    }
                    let NodeKind::State(_) = &g.node(ops[2].node).kind else {
                        return Err(unsupported(op, "a short conv whose state is not state"));
                    };
                    let st_type = g.value_type(ops[2]);
                    let c_type = match st_type.dtype {
                        DType::Bf16 => "__nv_bfloat16",
                        DType::F32 => "float",
                        d => return Err(unsupported(op, &format!("a {} conv state", d.name()))),
                    };
                    if st_type.elements() != (width - 1) * channels {
                        return Err(unsupported(op, "a conv state that is not [width - 1, channels]"));
                    }
                    let silu = match attrs.str("act") {
                        "silu" => 1,
                        "none" => 0,
                        a => return Err(unsupported(op, &format!("a short conv with act \"{a}\""))),
                    };
                    let w = self.weight(ops[1].node, 0)?;
                    let state = format!("static_cast<{c_type}*>(m.state[{}])", self.state_index[&ops[2].node]);
                    let _ = writeln!(
                        body,
                        "  ep_conv_update<kBatch>(st, n, {src}, {w}, {width}, {state}, {}, {channels}, {silu});\n  consumer_sync();",
                        st_type.elements()
                    );
                    span.insert(out, src);
                }
                OpKind::L2Norm => {
                    let src = span
                        .get(&ops[0])
                        .cloned()
                        .ok_or_else(|| unsupported(op, "an L2 norm of a value it does not compute"))?;
                    let _ = writeln!(
                        body,
                        "  ep_l2_norm<kBatch>(st, n, {src}, {}, {});\n  consumer_sync();",
                        attrs.int("group"),
                        float(attrs.float("eps"))
                    );
                    span.insert(out, src);
                }
                OpKind::Sigmoid => {
                    let src = span
                        .get(&ops[0])
                        .cloned()
                        .ok_or_else(|| unsupported(op, "a sigmoid of a value it does not compute"))?;
                    let _ = writeln!(body, "  ep_sigmoid<kBatch>(st, n, {src});\n  consumer_sync();");
                    span.insert(out, src);
                }
                OpKind::Argmax => {
                    let src = span
                        .get(&ops[0])
                        .cloned()
                        .ok_or_else(|| unsupported(op, "argmax of a value it does not compute"))?;
                    let tiles = tasks.len();
                    let at = self.reserve(rows_stage, self.batch * tiles as u64 * 8)?;
                    let ptr = format!("reinterpret_cast<float2*>({at})");
                    let _ = writeln!(body, "  ep_tile_max<kBatch>(st, n, {src}, {ptr}, t.index, {tiles});");
                    lm_tiles = Some((ptr, tiles, out));
                    continue;
                }
                other => return Err(unsupported(op, &format!("a {} epilogue", other.name()))),
            }
            // Values read elsewhere are stored once final.
            for (o, _) in g.node(n).outputs.iter().enumerate() {
                let v = ValueRef { node: n, output: o as u16 };
                if let (Some(slot), Some(s)) = (self.slots.get(&v), span.get(&v)) {
                    let len = slot.ty.elements();
                    let _ = writeln!(body, "  ep_store<kBatch>(st, n, {s}, {}, {len});", slot.ptr);
                }
            }
            if in_op_users.get(&out).copied().unwrap_or(0) > 1 {
                return Err(unsupported(op, &format!("{} read twice inside the operation", g.node(n).name)));
            }
        }
        self.check_reads(rows_stage, &reads)?;
        self.header(rows_stage, op, "output rows");
        let _ = writeln!(
            self.code,
            "__device__ inline Rows stage_{rows_stage}_rows(const TaskArgs& t, const Memory& m) {{\n{rows}  return r;\n}}"
        );
        let compute = match (&gate, &mul_gate) {
            (None, Some((gptr, sig))) => format!("rows_compute_mul<kBatch>(r, {x_ptr}, {gptr}, {sig}, it, warp, st);"),
            (None, None) => format!("rows_compute<kBatch>(r, {x_ptr}, {norm}, {}, it, warp, st);", float(eps)),
            (Some((_, gptr, d, act)), _) => format!(
                "rows_compute_gated<kBatch>(r, {x_ptr}, {gptr}, {}, {d}, {norm}, {}, {act}, it, warp, st);",
                k / d,
                float(eps)
            ),
        };
        let _ = writeln!(
            self.code,
            "__device__ inline void stage_{rows_stage}(const TaskArgs& t, const Memory& m, uint32_t& it, int warp) {{\n  \
             const Rows r = stage_{rows_stage}_rows(t, m);\n  float* st = staging(m);\n  const uint32_t n = r.cols();\n  \
             {compute}\n  consumer_sync();\n{body}}}"
        );
        self.load_cases.push(format!("case {rows_stage}: rows_load(stage_{rows_stage}_rows(t, m), it); break;"));
        self.run_cases.push(format!("case {rows_stage}: stage_{rows_stage}(t, m, it, warp); break;"));
        if let Some((ptr, tiles, out)) = lm_tiles {
            let stage = stages[1];
            let dst = self.value(out, op)?;
            self.header(stage, op, "argmax over the row tiles");
            let _ = writeln!(
                self.code,
                "__device__ inline void stage_{stage}(const TaskArgs&, const Memory& m) {{\n  argmax_tiles<kBatch>({ptr}, {tiles}, {dst});\n}}"
            );
            self.run_cases.push(format!("case {stage}: stage_{stage}(t, m); break;"));
        }
        Ok(())
    }

    fn mla(&mut self, op: &FusedOp) -> Result<()> {
        let g = self.g;
        let stages = self.stages_of(op);
        let (split, combine) = (stages[0], stages[1]);
        self.place_outputs(op, combine)?;
        let n = op
            .nodes
            .iter()
            .map(|n| nid(*n))
            .find(|n| matches!(self.op_of(*n), Some((OpKind::MlaDecode, _))))
            .expect("anchor");
        let (_, attrs) = self.op_of(n).expect("an op");
        let ops = g.operands(n);
        let heads = attrs.int("heads") as u64;
        let (nope, rope, v_dim) = (attrs.int("nope"), attrs.int("rope"), attrs.int("v_dim"));
        let c = g.value_type(ops[1]).elements();
        let q = self.value(ops[0], op)?;
        let (raw, ckv, norm, eps) = self.with_norm_prologue(op, ops[1])?;
        let kpe = self.value(ops[2], op)?;
        let wkvb = self.weight(ops[3].node, 0)?;
        let NodeKind::State(_) = &g.node(ops[4].node).kind else {
            return Err(unsupported(op, "a cache that is state"));
        };
        let cache = format!("static_cast<__nv_bfloat16*>(m.state[{}])", self.state_index[&ops[4].node]);
        let out = self.value(ValueRef { node: n, output: 0 }, op)?;
        let ctx = self.plan.options.context;
        let sms = self.plan.schedule.sms.len() as u32;
        let (groups, hpt, splits) = mla_split_shape(heads, ctx, sms);
        // qlat, q_pe, q_nope (fp32), the new row (bf16).
        let scratch = 4 * hpt * (c + rope as u64 + nope as u64) + 2 * (c + rope as u64);
        let combine_scratch = 4 * self.batch * (c + v_dim as u64);
        if scratch > SCRATCH_BYTES
            || combine_scratch > SCRATCH_BYTES
            || !c.is_multiple_of(8)
            || c > 512
            || rope % 8 != 0
            || nope % 4 != 0
            || hpt > 8
        {
            return Err(unsupported(op, &format!("MLA scratch of {scratch} and {combine_scratch} bytes (at most {SCRATCH_BYTES}) a latent width (at most 512) and RoPE width that are multiples of 8, a no-PE width that is a multiple of 4, at most 8 heads per task")));
        }
        self.check_reads(split, &[ops[0], raw, ops[2]])?;
        let partial_bytes = self.batch * heads * splits * (c + 2) * 4;
        let at = self.reserve(split, partial_bytes)?;
        let partials = format!("reinterpret_cast<float*>({at})");
        let _ = writeln!(
            self.code,
            "\n__device__ constexpr MlaShape mla_{}{{{heads}, {hpt}, {groups}, {splits}, {ctx}, {c}, {nope}, {rope}, {v_dim}, {}}};",
            n.index(),
            float(attrs.float("scale"))
        );
        self.header(split, op, "attention over one KV split (cache rows through the page ring, online softmax)");
        let _ = writeln!(
            self.code,
            "__device__ inline void stage_{split}_load(const TaskArgs& t, const Memory& m, uint32_t& it) {{\n  \
             mla_split_load<kBatch>(mla_{i}, t.a[1], {cache}, m.pos, it);\n}}\n\
             __device__ inline void stage_{split}(const TaskArgs& t, const Memory& m, uint32_t& it, int) {{\n  \
             mla_split<kBatch>(mla_{i}, t.a[0], t.a[1], {q}, {ckv}, {norm}, {}, {kpe}, {wkvb}, {cache}, m.pos, {partials}, it);\n}}",
            float(eps),
            i = n.index()
        );
        self.header(combine, op, "split merge and value up-projection (W_UV through the page ring)");
        let _ = writeln!(
            self.code,
            "__device__ inline void stage_{combine}_load(const TaskArgs& t, const Memory& m, uint32_t& it) {{\n  \
             mla_combine_load(mla_{i}, t.a[0], {wkvb}, it);\n}}\n\
             __device__ inline void stage_{combine}(const TaskArgs& t, const Memory& m, uint32_t& it, int warp) {{\n  \
             mla_combine<kBatch>(mla_{i}, t.a[0], {partials}, {wkvb}, {out}, it, warp);\n}}",
            i = n.index()
        );
        self.load_cases.push(format!("case {split}: stage_{split}_load(t, m, it); break;"));
        self.run_cases.push(format!("case {split}: stage_{split}(t, m, it, warp); break;"));
        self.load_cases.push(format!("case {combine}: stage_{combine}_load(t, m, it); break;"));
        self.run_cases.push(format!("case {combine}: stage_{combine}(t, m, it, warp); break;"));
        Ok(())
    }

    /// KDA decode: a task per range of heads (`t.a[0]..t.a[1]`); the beta
    /// sigmoid (its prologue) is applied inside.
    fn kda(&mut self, op: &FusedOp) -> Result<()> {
        let g = self.g;
        let stage = self.last_stage(op);
        self.place_outputs(op, stage)?;
        let n = op
            .nodes
            .iter()
            .map(|n| nid(*n))
            .find(|n| matches!(self.op_of(*n), Some((OpKind::KdaDecode, _))))
            .expect("anchor");
        let (_, attrs) = self.op_of(n).expect("an op");
        let ops = g.operands(n);
        let (heads, d) = (attrs.int("heads") as u64, attrs.int("head_dim") as u64);
        if d % 4 != 0 || d > 256 {
            return Err(unsupported(op, &format!("KDA head size {d} (a multiple of 4, at most 256)")));
        }
        // beta: the sigmoid of a value computed elsewhere (the prologue).
        let beta = match self.op_of(ops[4].node) {
            Some((OpKind::Sigmoid, _)) if op.nodes.contains(&ops[4].node.index()) => g.operands(ops[4].node)[0],
            _ => return Err(unsupported(op, "KDA whose beta is not the sigmoid of a projection")),
        };
        let mut ptrs = vec![];
        for v in [ops[0], ops[1], ops[2], ops[3], beta] {
            if op.nodes.contains(&v.node.index()) {
                return Err(unsupported(
                    op,
                    &format!("KDA input {} computed inside the operation", g.node(v.node).name),
                ));
            }
            ptrs.push(self.value(v, op)?);
        }
        for (i, what) in [(5usize, "A_log"), (6, "dt_bias")] {
            if g.value_type(ops[i]).dtype != DType::F32 {
                return Err(unsupported(op, &format!("KDA {what} that is not f32")));
            }
        }
        let a_log = self.weight(ops[5].node, 0)?;
        let dt_bias = self.weight(ops[6].node, 0)?;
        let st = g.value_type(ops[7]);
        if st.dtype != DType::F32 || st.elements() != heads * d * d {
            return Err(unsupported(op, "a KDA state that is not f32 [heads, d, d]"));
        }
        let state = format!("static_cast<float*>(m.state[{}])", self.state_index[&ops[7].node]);
        let (safe, lower) = match attrs.str("gate") {
            "softplus" => ("false", 0.0),
            "safe" => ("true", attrs.float("lower_bound")),
            other => return Err(unsupported(op, &format!("KDA gate \"{other}\""))),
        };
        let out = self.value(ValueRef { node: n, output: 0 }, op)?;
        self.check_reads(stage, &[ops[0], ops[1], ops[2], ops[3], beta])?;
        self.header(stage, op, "state update of a range of heads");
        let _ = writeln!(
            self.code,
            "__device__ inline void stage_{stage}(const TaskArgs& t, const Memory& m) {{\n  \
             kda_decode<kBatch>(KdaShape{{{heads}, {d}, {safe}, {}}}, t.a[0], t.a[1], {}, {}, {}, {}, {}, {a_log}, \
             {dt_bias}, {state}, {out});\n}}",
            float(lower),
            ptrs[0],
            ptrs[1],
            ptrs[2],
            ptrs[3],
            ptrs[4]
        );
        self.run_cases.push(format!("case {stage}: stage_{stage}(t, m); break;"));
        Ok(())
    }

    /// The attention-residual mix (K3): one task, the whole row.
    fn attn_res(&mut self, op: &FusedOp) -> Result<()> {
        let g = self.g;
        let stage = self.last_stage(op);
        self.place_outputs(op, stage)?;
        if op.nodes.len() != 1 {
            return Err(unsupported(op, "an attention-residual mix fused with other operations"));
        }
        let n = nid(op.nodes[0]);
        let Some((OpKind::AttnResMix, attrs)) = self.op_of(n) else {
            return Err(unsupported(op, "an attention-residual operation that is not the mix"));
        };
        let ops = g.operands(n);
        let hidden = g.value_type(ops[0]).elements();
        let bt = g.value_type(ops[1]);
        let rows = bt.elements() / hidden.max(1);
        if rows > 31 {
            return Err(unsupported(op, &format!("an attention-residual bank of {rows} rows (at most 31)")));
        }
        let u = self.value(ops[0], op)?;
        let bank = self.value(ops[1], op)?;
        let (w, gamma) = (self.weight(ops[2].node, 0)?, self.weight(ops[3].node, 0)?);
        let out = self.value(ValueRef { node: n, output: 0 }, op)?;
        self.check_reads(stage, &[ops[0], ops[1]])?;
        self.header(stage, op, "the mix of the bank and the current row");
        let _ = writeln!(
            self.code,
            "__device__ inline void stage_{stage}(const TaskArgs&, const Memory& m) {{\n  \
             attn_res_mix<kBatch>({bank}, {rows}, {u}, {w}, {gamma}, {}, {hidden}, 0, {hidden}, {out});\n}}",
            float(attrs.float("eps"))
        );
        self.run_cases.push(format!("case {stage}: stage_{stage}(t, m); break;"));
        Ok(())
    }

    fn router(&mut self, op: &FusedOp) -> Result<()> {
        let g = self.g;
        let stage = self.last_stage(op);
        self.place_outputs(op, stage)?;
        let n = nid(op.nodes[0]);
        let (_, attrs) = self.op_of(n).expect("an op");
        if attrs.str("scoring") != "sigmoid" {
            return Err(unsupported(op, &format!("router scoring \"{}\"", attrs.str("scoring"))));
        }
        let ops = g.operands(n);
        let e = g.value_type(ops[0]).elements();
        let n_group = attrs.int("n_group");
        if !(1..=64).contains(&n_group) || !e.is_multiple_of(n_group as u64) || e * 8 > SCRATCH_BYTES {
            return Err(unsupported(
                op,
                &format!(
                    "a router over {e} experts in {n_group} groups (the device router takes up to 64 equal groups \
                     and {} experts)",
                    SCRATCH_BYTES / 8
                ),
            ));
        }
        let logits = self.value(ops[0], op)?;
        let bias = if ops.len() > 1 { self.weight(ops[1].node, 0)? } else { "nullptr".into() };
        let ids = self.value(ValueRef { node: n, output: 0 }, op)?;
        let wts = self.value(ValueRef { node: n, output: 1 }, op)?;
        self.check_reads(stage, &[ops[0]])?;
        self.header(stage, op, "scores and top-k");
        let _ = writeln!(
            self.code,
            "__device__ inline void stage_{stage}(const TaskArgs&, const Memory& m) {{\n  \
             router<kBatch>(RouterShape{{{e}, {}, {}, {}, {}, {}}}, {logits}, {bias}, {ids}, {wts});\n}}",
            attrs.int("top_k"),
            attrs.int("n_group"),
            attrs.int("topk_group"),
            attrs.bool("renormalize"),
            float(attrs.float("scale"))
        );
        self.run_cases.push(format!("case {stage}: stage_{stage}(t, m); break;"));
        Ok(())
    }

    fn moe(&mut self, op: &FusedOp) -> Result<()> {
        let g = self.g;
        let stages = self.stages_of(op);
        let (up, down, combine) = (stages[0], stages[1], stages[2]);
        self.place_outputs(op, combine)?;
        let n = op
            .nodes
            .iter()
            .map(|n| nid(*n))
            .find(|n| matches!(self.op_of(*n), Some((OpKind::Moe, _))))
            .expect("anchor");
        let (_, attrs) = self.op_of(n).expect("an op");
        let act_call = act_and_mul_call(attrs, "s").map_err(|a| unsupported(op, &format!("experts with {a}")))?;
        let ops = g.operands(n);
        let wg = g.value_type(ops[3]).clone();
        let mx = match wg.dtype {
            DType::Bf16 => false,
            DType::Mxfp4 => true,
            other => return Err(unsupported(op, &format!("{} expert weights", other.name()))),
        };
        let (e, i, d) = (wg.shape[0], wg.shape[1], wg.shape[2]);
        let k = g.value_type(ops[1]).elements();
        let slots = (self.batch * k).min(e);
        // The input, or the input of its RMSNorm prologue.
        let (x_in, x, norm, eps) = self.with_norm_prologue(op, ops[0])?;
        let ids = self.value(ops[1], op)?;
        let wts = self.value(ops[2], op)?;
        let (bg, bu, bd) =
            (self.family_base(ops[3].node), self.family_base(ops[4].node), self.family_base(ops[5].node));
        // MXFP4: each expert's codes then its scales, experts `stride` apart.
        let stride = if mx { 2 } else { 1 };
        if mx {
            for w in [ops[3].node, ops[4].node, ops[5].node] {
                let NodeKind::Weight(wt) = &g.node(w).kind else { unreachable!("a weight") };
                let base = self.weight_index[&wt.key_at(0)];
                for e in 0..wt.family.as_ref().map_or(1, |f| f.1) {
                    let code = self.weight_index[&wt.key_at(e)];
                    let scale = wt.scale_key_at(e).and_then(|k| self.weight_index.get(&k).copied());
                    if code != base + 2 * e as usize || scale != Some(code + 1) {
                        return Err(unsupported(op, "MXFP4 experts whose codes and scales are not listed in pairs"));
                    }
                }
            }
            if self.batch * d * 4 > ACTIVATION_BYTES || self.batch * i * 4 > ACTIVATION_BYTES {
                return Err(unsupported(
                    op,
                    &format!(
                        "MXFP4 experts at batch {} with widths {d} and {i} (the staged input holds {ACTIVATION_BYTES} bytes)",
                        self.batch
                    ),
                ));
            }
            if !d.is_multiple_of(32) || !i.is_multiple_of(32) {
                return Err(unsupported(op, "MXFP4 experts whose widths are not multiples of 32"));
            }
        }
        let out = self.value(ValueRef { node: n, output: 0 }, op)?;
        self.check_reads(up, &[x_in, ops[1]])?;
        self.check_reads(down, &[ops[1]])?;
        self.check_reads(combine, &[ops[1], ops[2]])?;
        if !d.is_multiple_of(8) || !i.is_multiple_of(8) || self.batch * k > 512 {
            return Err(unsupported(op, "expert widths that are multiples of 8 and at most 512 choices per step"));
        }
        let act_at = self.reserve(up, self.batch * slots * i * 4)?;
        let down_at = self.reserve(down, self.batch * slots * d * 4)?;
        let _ = writeln!(
            self.code,
            "\n__device__ constexpr MoeShape moe_{}{{{e}, {k}, {i}, {d}, {slots}, {bg}, {bu}, {bd}, {stride}}};",
            n.index()
        );
        // The row type, its loader and its consumer.
        let (rows_t, rows_fn, load_fn, compute_fn) = if mx {
            ("MxRows", "expert_mx_rows", "mx_rows_load", "mx_rows_compute")
        } else {
            ("Rows", "expert_rows", "rows_load", "rows_compute")
        };
        let act = format!("reinterpret_cast<float*>({act_at})");
        let dn = format!("reinterpret_cast<float*>({down_at})");
        let i_ = n.index();
        // Expert rows stream through the page ring like a projection's; the
        // loader finds the slot's expert in the router's ids.
        for (stage, is_down) in [(up, false), (down, true)] {
            for t in &self.plan.tiling.stages[stage].tasks {
                let a = self.plan.tiling.tasks[*t].args;
                let cols = u64::from(a[2] - a[1]) * if is_down { 1 } else { 2 };
                self.staging = self.staging.max(cols * self.batch);
            }
        }
        self.header(up, op, "one expert slot's gate/up rows");
        let _ = writeln!(
            self.code,
            "__device__ inline {rows_t} stage_{up}_rows(const TaskArgs& t, const Memory& m) {{\n  \
             return {rows_fn}<kBatch>(moe_{i_}, t.a[0], t.a[1], t.a[2], m.w, {ids}, false);\n}}\n\
             __device__ inline void stage_{up}(const TaskArgs& t, const Memory& m, uint32_t& it, int warp) {{\n  \
             const {rows_t} r = stage_{up}_rows(t, m);\n  float* st = staging(m);\n  const uint32_t n = r.cols();\n  \
             {compute_fn}<kBatch>(r, {x}, {norm}, {}, it, warp, st);\n  consumer_sync();\n  \
             const Span s = Span{{0, r.r0, r.r1 - r.r0}};\n  {act_call}\n  consumer_sync();\n  \
             ep_store<kBatch>(st, n, s, {act} + size_t(t.a[0]) * kBatch * {i}, {i});\n}}",
            float(eps)
        );
        self.header(down, op, "one expert slot's down rows");
        let _ = writeln!(
            self.code,
            "__device__ inline {rows_t} stage_{down}_rows(const TaskArgs& t, const Memory& m) {{\n  \
             return {rows_fn}<kBatch>(moe_{i_}, t.a[0], t.a[1], t.a[2], m.w, {ids}, true);\n}}\n\
             __device__ inline void stage_{down}(const TaskArgs& t, const Memory& m, uint32_t& it, int warp) {{\n  \
             const {rows_t} r = stage_{down}_rows(t, m);\n  float* st = staging(m);\n  const uint32_t n = r.cols();\n  \
             {compute_fn}<kBatch>(r, {act} + size_t(t.a[0]) * kBatch * {i}, nullptr, 1e-6f, it, warp, st);\n  \
             consumer_sync();\n  \
             ep_store<kBatch>(st, n, Span{{0, r.r0, r.r1 - r.r0}}, {dn} + size_t(t.a[0]) * kBatch * {d}, {d});\n}}"
        );
        // The loader runs ahead of the controller, so it cannot rely on the
        // instruction's (minimal) waits: it waits for the router's whole
        // stage before reading the ids.
        let router = self.writer.get(&ops[1]).copied().ok_or_else(|| unsupported(op, "ids from a router stage"))?;
        let counter =
            self.plan.schedule.counters.iter().find(|c| c.stage == router).expect("every stage has a counter");
        self.load_waits.push((up, counter.id as u32, counter.expected));
        self.load_waits.push((down, counter.id as u32, counter.expected));
        for s in [up, down] {
            self.load_cases.push(format!("case {s}: {load_fn}(stage_{s}_rows(t, m), it); break;"));
        }
        self.header(combine, op, "weighted sum of the slots");
        let _ = writeln!(
            self.code,
            "__device__ inline void stage_{combine}(const TaskArgs& t, const Memory& m) {{\n  \
             expert_combine<kBatch>(moe_{i_}, t.a[0], t.a[1], {ids}, {wts}, {dn}, {out});\n}}"
        );
        for s in [up, down] {
            self.run_cases.push(format!("case {s}: stage_{s}(t, m, it, warp); break;"));
        }
        self.run_cases.push(format!("case {combine}: stage_{combine}(t, m); break;"));
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
        staging_floats: align(gen.staging.max(1), 32),
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
