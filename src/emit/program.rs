//! The program of one decode step as the megakernel runs it: where every
//! value lives, what each task computes, and the device code of each stage.
//!
//! Values that cross fused operations live in the scratch arena, in the
//! region of the stage that writes them (the plan's regions and buffers, so
//! the verifier's reuse proof covers them); graph outputs go to their own
//! buffers, per-sequence state to its own allocations, weights are read
//! through the runtime's pointer table in the plan file's weight-table order.
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
use crate::contract::MAX_RANKS;
use crate::diag::{Error, ErrorKind, Result};
use crate::ir::{DType, Graph, NodeId, NodeKind, TensorType, ValueRef};
use crate::ops::Attrs;
use crate::ops::OpKind;
use crate::plan::arena::{kept, Block};
use crate::plan::fuse::{FusedKind, FusedOp};
use crate::plan::tile::TaskKind;
use crate::plan::Plan;
use crate::valid::Validated;

/// A C++20 designated initializer, `Type{.field = value, ...}`: how the
/// generated code spells the argument structs of the device library's calls
/// (fields in the struct's declaration order, as C++ requires).
/// `init!("EpL2Norm"; group = 128, eps = "1e-6f")` is
/// `EpL2Norm{.group = 128, .eps = 1e-6f}`.
macro_rules! init {
    ($ty:expr; $($field:ident = $value:expr),+ $(,)?) => {
        format!(
            "{}{{{}}}",
            $ty,
            [$(format!(concat!(".", stringify!($field), " = {}"), $value)),+].join(", ")
        )
    };
}

/// A designated initializer of [`init!`] with one more field last:
/// `with_field("T{.a = 1}", "b", "2")` is `T{.a = 1, .b = 2}`.
fn with_field(init: &str, field: &str, value: &str) -> String {
    let open = init.strip_suffix('}').expect("a designated initializer");
    format!("{open}, .{field} = {value}}}")
}

// The stage emitters, by family (each an `impl Gen` block).
mod attention;
mod moe;
mod projection;

pub use crate::plan::arena::ArenaSlot;

/// The generated program of one step.
#[derive(Debug, Clone)]
pub struct Program {
    /// GPUs the program runs on (an expert-parallel program: each holds
    /// `1 / ranks` of every MoE layer's routed experts); 1 on one GPU.
    pub ranks: u32,
    /// Exchanges a step (one after each MoE layer on several GPUs).
    pub exchanges: u32,
    /// An exchanged part's floats, the largest (its inbox slots).
    pub exchange_floats: u64,
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
    /// The stage kinds: the device code, one per distinct kind of stage.
    pub kinds: Vec<Kind>,
    /// Per plan stage: its kind's function, its parameters and its loader wait.
    pub stages: Vec<StageRecord>,
}

/// The device code of one kind of fused operation: what is the same for
/// every operation of the kind is compiled in; what differs (weights, arena
/// addresses, states, bank rows) is a field of its parameter struct, read from
/// the plan file per stage.
#[derive(Debug, Clone)]
pub struct Kind {
    /// Its C++ name (`projection3`, `mla0`, ...).
    pub name: String,
    /// The fused operations' kind, as a name (`projection`, `mla`, ...).
    pub family: &'static str,
    /// The parameter struct's fields: (name, what it holds).
    pub fields: Vec<(String, &'static str)>,
    /// What it computes, and the graph operations it covers.
    pub comment: String,
    /// Constants and functions.
    pub code: String,
    /// Per stage of the operation: the consumers' and the loader's calls.
    pub roles: Vec<Role>,
    /// How many fused operations share it.
    pub uses: usize,
}

/// One stage of a kind: its dispatch.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Role {
    /// The consumers' call (`p` the parameters).
    pub run: String,
    /// The loader's call, if it streams weights.
    pub load: Option<String>,
    /// A verify step's commit of the state the stage read (`keep` the
    /// positions each sequence keeps; device/mkc/megakernel.cuh
    /// commit_kernel), if it keeps state that way.
    pub commit: Option<String>,
}

/// A stage as the plan file lists it.
#[derive(Debug, Clone, Default)]
pub struct StageRecord {
    /// The role's global index (the dispatch's `case`).
    pub role: u32,
    /// The parameter values, in the kind's field order.
    pub params: Vec<u64>,
    /// What the loader waits for before streaming (routed experts: the
    /// router's counter and its bumps per step); (0, 0) for none.
    pub load_wait: (u32, u32),
}

/// A per-stage value the generated code reads from the plan file: the layers
/// of a kind differ in these only.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Param {
    /// A weight's index in the weight table.
    Weight(usize),
    /// A per-sequence state's index.
    State(usize),
    /// An arena offset.
    Arena(u64),
    /// An arena offset in the routing log.
    RouteLog(u64),
    /// A count that differs per layer (attention-residual bank rows).
    Int(u64),
}

/// What a parameter field that holds a weight's index says it holds.
pub const WEIGHT_INDEX: &str = "weight index";

impl Param {
    fn what(self) -> &'static str {
        match self {
            Param::Weight(_) => WEIGHT_INDEX,
            Param::State(_) => "state index",
            Param::Arena(_) => "arena offset",
            Param::RouteLog(_) => "arena offset (routing log)",
            Param::Int(_) => "count",
        }
    }
}

/// Where a value lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Loc {
    /// A graph output buffer.
    Output(usize),
    /// The arena, at this offset.
    Arena(u64),
}

/// Per plan task: its stage, its index in the stage and its four device words.
pub fn task_rows(plan: &Plan) -> Vec<(usize, usize, [u32; 4])> {
    let mut in_stage = vec![0usize; plan.tiling.stages.len()];
    plan.tiling
        .tasks
        .iter()
        .map(|t| {
            in_stage[t.stage] += 1;
            (t.stage, in_stage[t.stage] - 1, t.args.words())
        })
        .collect()
}

impl Program {
    /// A program of tasks only (no kinds, no stage records): the plan file
    /// of `codegen --tables-only`.
    pub fn tables_only(tasks: Vec<(usize, usize, [u32; 4])>) -> Program {
        Program {
            ranks: 1,
            exchanges: 0,
            exchange_floats: 0,
            layout: vec![],
            buffers: vec![],
            arena_bytes: 0,
            route_log: 0,
            routers: vec![],
            route_log_ints: 0,
            router_top_k: 0,
            staging_floats: 0,
            pages: 0,
            states: vec![],
            outputs: vec![],
            next_token_output: 0,
            logits_output: 0,
            vocab: 0,
            tasks,
            kinds: vec![],
            stages: vec![],
        }
    }
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

/// What the planner's limits pass (plan::limits) admits and the emitter does
/// not render: a compiler error, named as one.
fn internal(op: &FusedOp, what: &str) -> Error {
    Error::new(
        ErrorKind::Invalid,
        format!(
            "internal error: fused operation {} ({}) passed the planner's device limits with {what}",
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
            "ep_situ_and_mul<kBatch>(st, n, {span}, {});",
            init!("EpSituAndMul"; beta = float(attrs.float("beta")), lin = float(attrs.float("linear_beta")))
        )),
        a => Err(format!("act_and_mul with act \"{a}\"")),
    }
}

/// A kind family's name in C++ identifiers.
fn family_name(k: FusedKind) -> &'static str {
    match k {
        FusedKind::Projection => "projection",
        FusedKind::Router => "router",
        FusedKind::Moe => "moe",
        FusedKind::MlaDecode => "mla",
        FusedKind::KdaDecode => "kda",
        FusedKind::AttnRes => "attn_res",
        FusedKind::Embedding => "embedding",
        FusedKind::LmHead => "lm_head",
        FusedKind::Elementwise => "elementwise",
    }
}

fn float(x: f64) -> String {
    let s = format!("{:e}", x as f32);
    format!("{s}f")
}

/// Where a value is.
#[derive(Debug, Clone)]
struct Slot {
    loc: Loc,
    ty: TensorType,
    /// Its parameter field's name (the graph node's short name).
    name: String,
}

/// A C++ identifier from a graph node's last name part (`l.0/layer/kda/w_q`: `w_q`).
fn short_name(node: &str) -> String {
    let last = node.rsplit('/').next().unwrap_or(node);
    let id = super::namespace(last);
    id.trim_matches('_').to_string()
}

struct Gen<'a> {
    g: &'a Graph,
    plan: &'a Plan,
    source: &'a str,
    batch: u64,
    weight_index: HashMap<String, usize>,
    state_index: HashMap<NodeId, usize>,
    slots: HashMap<ValueRef, Slot>,
    /// The operation being emitted: its code (`@K@` for the kind's name),
    /// its parameter fields, its comment and its stages' roles.
    code: String,
    params: Vec<(String, Param)>,
    roles: Vec<(usize, Role)>,
    /// The kinds so far, by their code.
    kinds: Vec<Kind>,
    kind_of: HashMap<String, usize>,
    /// Per stage: (kind, role in the kind, parameter values).
    stage_kind: Vec<Option<(usize, usize, Vec<Param>)>>,
    /// An expert-parallel program's largest exchanged part, in floats.
    exchange_floats: u64,
}

impl Gen<'_> {
    /// The spill argument of a stage that stages its input whole as fp32
    /// (device `input_area`): `nullptr` when it fits the shared-memory
    /// staging, otherwise where the arena pass put it in this SM's global
    /// staging (past the output tile).
    fn spill(&self, stage: usize) -> String {
        match self.plan.arena.spills[stage] {
            Some(at) => format!("st + {at}"),
            None => "nullptr".into(),
        }
    }
}

fn nid(i: usize) -> NodeId {
    NodeId::at(i)
}

impl<'a> Gen<'a> {
    fn op_of(&self, n: NodeId) -> Option<(OpKind, &'a Attrs)> {
        let g: &'a Graph = self.g;
        g.op(n)
    }

    /// A node's last name part and source position (the same in every layer).
    fn where_short(&self, n: NodeId) -> String {
        let node = self.g.node(n);
        let short = node.name.rsplit('/').next().unwrap_or(&node.name);
        if self.source.is_empty() {
            return short.to_string();
        }
        let (l, c) = node.span.line_col(self.source);
        format!("{short} ({l}:{c})")
    }

    fn where_(&self, n: NodeId) -> String {
        let node = self.g.node(n);
        if self.source.is_empty() {
            return node.name.clone();
        }
        let (l, c) = node.span.line_col(self.source);
        format!("{} ({l}:{c})", node.name)
    }

    /// A parameter field of the operation being emitted, as C++ (`p.name`):
    /// the same value under the same name shares a field.
    fn param(&mut self, hint: &str, value: Param) -> String {
        let base = if hint.is_empty() { "v".to_string() } else { hint.to_string() };
        let mut name = base.clone();
        let mut n = 1;
        loop {
            match self.params.iter().find(|(f, _)| *f == name) {
                Some((_, v)) if *v == value => return format!("p.{name}"),
                None => break,
                Some(_) => {
                    n += 1;
                    name = format!("{base}_{n}");
                }
            }
        }
        self.params.push((name.clone(), value));
        format!("p.{name}")
    }

    /// The pointer to a weight (member `i` of a family).
    fn weight(&mut self, n: NodeId, i: u64) -> Result<String> {
        let ty = match &self.g.node(n).kind {
            NodeKind::Weight(w) => ctype(w.ty.dtype),
            _ => "void",
        };
        self.weight_typed(n, i, ty)
    }

    /// The pointer to a weight the runtime lays out as `ty` on the GPU
    /// (an FP8 matrix the device reads as bf16).
    fn weight_as(&mut self, n: NodeId, ty: &str) -> Result<String> {
        self.weight_typed(n, 0, ty)
    }

    fn weight_typed(&mut self, n: NodeId, i: u64, ty: &str) -> Result<String> {
        let NodeKind::Weight(w) = &self.g.node(n).kind else {
            return Err(Error::new(ErrorKind::Invalid, format!("codegen: {} is not a weight", self.g.node(n).name)));
        };
        let idx = self.weight_index[&w.key_at(i)];
        let field = self.param(&short_name(&self.g.node(n).name), Param::Weight(idx));
        Ok(format!("static_cast<const {ty}*>(m.w[{field}])"))
    }

    /// The pointer to an FP8 weight's block scales (`[ceil(rows / 128)][ceil(k / 128)]` fp32).
    fn weight_scales(&mut self, n: NodeId) -> Result<String> {
        let NodeKind::Weight(w) = &self.g.node(n).kind else {
            return Err(Error::new(ErrorKind::Invalid, format!("codegen: {} is not a weight", self.g.node(n).name)));
        };
        let Some(idx) = w.scale_key_at(0).and_then(|k| self.weight_index.get(&k).copied()) else {
            return Err(Error::new(
                ErrorKind::Invalid,
                format!("codegen: {} has no block scales", self.g.node(n).name),
            ));
        };
        let field = self.param(&format!("{}_scales", short_name(&self.g.node(n).name)), Param::Weight(idx));
        Ok(format!("static_cast<const float*>(m.w[{field}])"))
    }

    /// The parameter holding the index of family member 0 (members are consecutive).
    fn family_base(&mut self, n: NodeId) -> String {
        let NodeKind::Weight(w) = &self.g.node(n).kind else { unreachable!("a weight") };
        let idx = self.weight_index[&w.key_at(0)];
        self.param(&short_name(&self.g.node(n).name), Param::Weight(idx))
    }

    /// The pointer to a state, as `T*`.
    fn state(&mut self, n: NodeId, ty: &str) -> String {
        let field = self.param(&short_name(&self.g.node(n).name), Param::State(self.state_index[&n]));
        format!("static_cast<{ty}*>(m.state[{field}])")
    }

    /// An arena address as C++ (`m.arena + p.name`).
    fn arena(&mut self, hint: &str, loc: Loc) -> String {
        match loc {
            Loc::Output(k) => format!("m.out[{k}]"),
            Loc::Arena(offset) => {
                let field = self.param(hint, Param::Arena(offset));
                format!("m.arena + {field}")
            }
        }
    }

    /// A slot's pointer, typed.
    fn slot_ptr(&mut self, slot: &Slot) -> String {
        let ty = ctype(slot.ty.dtype);
        match slot.loc {
            Loc::Output(k) => format!("static_cast<{ty}*>(m.out[{k}])"),
            loc => format!("reinterpret_cast<{ty}*>({})", self.arena(&slot.name, loc)),
        }
    }

    /// The pointer to an activation value.
    fn value(&mut self, v: ValueRef, op: &FusedOp) -> Result<String> {
        let node = self.g.node(v.node);
        match &node.kind {
            NodeKind::Input => Ok("m.tokens".into()),
            NodeKind::Weight(_) => self.weight(v.node, 0),
            _ => match self.slots.get(&v).cloned() {
                // A value from another operation is named by its place among
                // this one's inputs (`in`, `in_2`, ...): its producer's name
                // differs from layer to layer, this operation's code does not.
                Some(slot) if !op.nodes.contains(&v.node.index()) => {
                    // The verifier proved the reads the arena pass listed.
                    if !self.stages_of(op).iter().any(|s| self.plan.arena.reads[*s].contains(&v)) {
                        return Err(internal(op, &format!("a read of {} the arena pass did not list", node.name)));
                    }
                    Ok(self.slot_ptr(&Slot { name: "in".into(), ..slot }))
                }
                Some(slot) => Ok(self.slot_ptr(&slot)),
                None => Err(unsupported(op, &format!("{}'s value in the arena", node.name))),
            },
        }
    }

    /// Where the arena pass put stage `stage`'s scratch block `what`.
    fn block(&self, op: &FusedOp, stage: usize, what: Block) -> Result<Loc> {
        match self.plan.arena.block(stage, what) {
            Some(slot) => Ok(Loc::Arena(slot.offset)),
            None => Err(internal(op, &format!("no arena block {what:?} for stage {stage}"))),
        }
    }

    /// Names where each value of `op` lives: its graph output buffer, or
    /// its arena block when it is read outside the operation.
    fn place_outputs(&mut self, op: &FusedOp) {
        for &n in &op.nodes {
            let id = nid(n);
            let node = self.g.node(id);
            for (o, ty) in node.outputs.iter().enumerate() {
                let v = ValueRef { node: id, output: o as u16 };
                let name = short_name(&node.name);
                if let Some(k) = self.g.outputs.iter().position(|(_, ov)| *ov == v) {
                    self.slots.insert(v, Slot { loc: Loc::Output(k), ty: ty.clone(), name });
                } else if let Some(slot) = self.plan.arena.value(v) {
                    let name = if o == 0 { name } else { format!("{name}_{o}") };
                    self.slots.insert(v, Slot { loc: Loc::Arena(slot.offset), ty: kept(ty), name });
                }
            }
        }
    }

    /// An operation's input `v` with its optional RMSNorm prologue: the
    /// value actually read, its pointer, the norm weight's pointer (or
    /// `nullptr`) and epsilon. Any other prologue is refused.
    fn with_norm_prologue(&mut self, op: &FusedOp, v: ValueRef) -> Result<(ValueRef, String, String, f64)> {
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

    /// The comment of a stage's functions: what it computes (the kind's
    /// comment lists the graph nodes once).
    fn header(&mut self, stage: usize, _op: &FusedOp, what: &str) {
        let kind = serde_json::to_value(self.plan.tiling.stages[stage].kind)
            .ok()
            .and_then(|v| v.as_str().map(str::to_string))
            .unwrap_or_default();
        let _ = writeln!(self.code, "\n// {kind}: {what}");
    }

    /// The name of `stage`'s functions in its kind: `@K@`, or `@K@_<task
    /// kind>` for operations of several stages.
    fn fname(&self, op: &FusedOp, stage: usize) -> String {
        if self.stages_of(op).len() == 1 {
            return "@K@".into();
        }
        let kind = serde_json::to_value(self.plan.tiling.stages[stage].kind)
            .ok()
            .and_then(|v| v.as_str().map(str::to_string))
            .unwrap_or_default();
        format!("@K@_{kind}")
    }

    /// Records a stage's dispatch: the consumers' call and the loader's.
    fn role(&mut self, stage: usize, run: String, load: Option<String>) {
        self.role_commit(stage, run, load, None);
    }

    /// A stage's dispatch with a verify step's commit.
    fn role_commit(&mut self, stage: usize, run: String, load: Option<String>, commit: Option<String>) {
        self.roles.push((stage, Role { run, load, commit }));
    }

    /// Closes the operation: its code becomes a new kind, or the existing
    /// kind of the same code; each of its stages records its kind, role and
    /// parameter values.
    fn finish(&mut self, op: &FusedOp) -> Result<()> {
        let code = std::mem::take(&mut self.code);
        let params = std::mem::take(&mut self.params);
        let roles = std::mem::take(&mut self.roles);
        let fields: Vec<(String, &'static str)> = params.iter().map(|(n, p)| (n.clone(), p.what())).collect();
        let mut key = code.clone();
        for (f, w) in &fields {
            let _ = write!(key, "\n{f}:{w}");
        }
        for (_, r) in &roles {
            let _ = write!(key, "\n{}|{:?}|{:?}", r.run, r.load, r.commit);
        }
        let kind = match self.kind_of.get(&key) {
            Some(k) => {
                self.kinds[*k].uses += 1;
                *k
            }
            None => {
                let family = family_name(op.kind);
                let n = self.kinds.iter().filter(|k| k.family == family).count();
                let mut comment = String::new();
                for &nd in &op.nodes {
                    let (o, _) = self.op_of(nid(nd)).expect("fused ops hold ops");
                    let _ = writeln!(comment, "//   {} {}", o.name(), self.where_(nid(nd)));
                }
                self.kinds.push(Kind {
                    name: format!("{family}{n}"),
                    family,
                    fields,
                    comment,
                    code,
                    roles: roles.iter().map(|(_, r)| r.clone()).collect(),
                    uses: 1,
                });
                self.kind_of.insert(key, self.kinds.len() - 1);
                self.kinds.len() - 1
            }
        };
        for (j, (stage, _)) in roles.iter().enumerate() {
            self.stage_kind[*stage] = Some((kind, j, params.iter().map(|(_, p)| *p).collect()));
        }
        Ok(())
    }

    fn fused(&mut self, op: &FusedOp) -> Result<()> {
        // What the device cannot compute points at the operation's anchor in
        // the graph file (the op it is built around).
        let anchor = op.anchor(self.g);
        let span = self.g.node(anchor).span;
        self.emit_op(op).map_err(|e| e.or_at(span).label(format!("fused operation {}", op.id)))?;
        self.finish(op)
    }

    fn emit_op(&mut self, op: &FusedOp) -> Result<()> {
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
        self.place_outputs(op);
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
                    let args = init!("StackRows";
                        bank = "static_cast<const float*>(nullptr)",
                        rows = 0,
                        row = out,
                        hidden = hidden,
                        out = bank,
                    );
                    let _ = write!(extra, "\n  consumer_sync();\n  stack_rows<kBatch>({args});");
                }
                _ => return Err(unsupported(op, &format!("an embedding epilogue {}", self.g.node(e).name))),
            }
        }
        self.header(stage, op, "token rows");
        let f = self.fname(op, stage);
        let args = init!("Embedding"; table = table, tokens = "m.tokens", hidden = hidden, out = out);
        let _ = writeln!(
            self.code,
            "__device__ inline void {f}(const Memory& m, const @K@_params& p) {{\n  embedding<kBatch>({args});{extra}\n}}"
        );
        self.role(stage, format!("{f}(m, p);"), None);
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

/// Whether an expert-parallel plan of `ranks` GPUs makes a program: at most
/// [`MAX_RANKS`] GPUs (the device's peer tables), each holding the same
/// number of every MoE layer's experts.
fn expert_parallel_fits(plan: &Plan, ranks: u32) -> Result<()> {
    if u64::from(ranks) > MAX_RANKS {
        return Err(Error::new(
            ErrorKind::Invalid,
            format!("codegen: an expert-parallel program runs on at most {MAX_RANKS} GPUs (kMaxRanks), not {ranks}"),
        ));
    }
    let g = plan.graph.graph();
    for op in plan.fusion.ops.iter().filter(|o| o.kind == FusedKind::Moe) {
        let n = op.anchor(g);
        let experts = g.value_type(g.operands(n)[3]).shape[0];
        if !experts.is_multiple_of(u64::from(ranks)) {
            return Err(Error::new(
                ErrorKind::Invalid,
                format!(
                    "codegen: {} has {experts} routed experts, which {ranks} GPUs cannot hold in equal shares \
                     (--expert-parallel must divide the expert count)",
                    g.node(n).name
                ),
            ));
        }
    }
    Ok(())
}

/// Builds the program of `plan`. `source` is the graph file's text (for the
/// comments' line:column; may be empty).
pub fn program(v: &Validated, plan: &Plan, source: &str) -> Result<Program> {
    // What the library does not compute is refused before anything is rendered.
    crate::plan::limits::computable(plan)?;
    let g = v.graph();
    let ranks = plan.options.expert_parallel.max(1);
    if ranks > 1 {
        expert_parallel_fits(plan, ranks)?;
    }
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
        code: String::new(),
        params: vec![],
        roles: vec![],
        kinds: vec![],
        kind_of: HashMap::new(),
        stage_kind: vec![None; plan.tiling.stages.len()],
        exchange_floats: 0,
    };
    for op in &plan.fusion.ops {
        gen.fused(op)?;
    }
    let arena = &plan.arena;
    let routers: Vec<(String, u64)> = arena.routers.iter().map(|r| (r.node.clone(), r.top_k)).collect();
    let top_k = routers.first().map_or(0, |(_, k)| *k);
    let router_top_k = if routers.iter().all(|(_, k)| *k == top_k) { top_k } else { 0 };
    let tasks = task_rows(plan);
    // Each stage's record: its kind's role and its parameters, now that the
    // buffers are laid out.
    let mut role_base = vec![0u32; gen.kinds.len()];
    let mut next = 0u32;
    for (k, kind) in gen.kinds.iter().enumerate() {
        role_base[k] = next;
        next += kind.roles.len() as u32;
    }
    let mut stages = vec![];
    for (s, rec) in gen.stage_kind.iter().enumerate() {
        let Some((kind, role, params)) = rec else {
            return Err(Error::new(ErrorKind::Invalid, format!("internal error: stage {s} has no code")));
        };
        let params = params
            .iter()
            .map(|p| match *p {
                Param::Weight(i) | Param::State(i) => i as u64,
                Param::Arena(offset) | Param::RouteLog(offset) => offset,
                Param::Int(v) => v,
            })
            .collect();
        let load_wait = plan.schedule.load_waits[s].map_or((0, 0), |(c, n)| (c as u32, n));
        stages.push(StageRecord { role: role_base[*kind] + *role as u32, params, load_wait });
    }
    let exchanges = plan.tiling.stages.iter().filter(|s| s.kind == TaskKind::ExchangeSend).count() as u32;
    Ok(Program {
        ranks,
        exchanges,
        exchange_floats: gen.exchange_floats,
        layout: arena.slots.clone(),
        buffers: arena.buffers.clone(),
        arena_bytes: arena.bytes,
        route_log: arena.route_log,
        routers,
        route_log_ints: arena.route_log_bytes / 4,
        router_top_k,
        staging_floats: arena.staging_floats,
        pages: plan.warps.layout.pages,
        states,
        outputs,
        next_token_output,
        logits_output,
        vocab,
        tasks,
        kinds: gen.kinds,
        stages,
    })
}
