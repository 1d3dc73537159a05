//! Fusion: groups graph nodes into fused operations by explicit rules.
//!
//! Each rule names what it saves. The rules, applied in this order:
//!
//! 1. `merged-projection`: linears that read the same input, with weights of
//!    one type, become one projection (the input is read once; one
//!    dependency wait instead of N).
//! 2. `argmax-in-lm-head`: greedy argmax is the LM head's final stage (the
//!    logits are reduced where they are produced).
//! 3. `head-gate`: KDA's gated output norm (over KDA's heads) and the MLA
//!    output gate (o times a gate) join the attention operation that makes
//!    o, whose tasks own whole heads (the gate is applied once, not
//!    recomputed at every row block of the output projection).
//! 4. `prologue`: a norm or element-wise op whose every user sits in one
//!    fused operation is recomputed in that operation's prologue (its result
//!    never goes to HBM and one synchronisation disappears).
//! 5. `epilogue`: a row-local op (activation-and-multiply, residual add,
//!    RoPE, split, short conv, L2 norm, gate activation, bank append) joins
//!    the operation producing its operand (the intermediate never goes to
//!    HBM).
//! 6. Anything left stands alone.
//!
//! A merge that would make the fused graph cyclic is skipped. The result
//! keeps, for every fused operation, the graph nodes it covers (their spans
//! point at the graph file) and the rules that put each one there. What it
//! does not do yet: fuse across layers, or split a node between operations.

use std::collections::{BTreeMap, HashMap, VecDeque};

use serde::Serialize;

use crate::diag::{Error, ErrorKind, Result};
use crate::ir::{Graph, NodeId, NodeKind, ValueRef};
use crate::ops::OpKind;
use crate::valid::Validated;

/// The kind of a fused operation, from the anchor op it is built around.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, PartialOrd, Ord)]
#[serde(rename_all = "snake_case")]
pub enum FusedKind {
    /// One or more linears sharing an input, with prologue and epilogue.
    Projection,
    /// Router scores and top-k.
    Router,
    /// Routed experts.
    Moe,
    /// Absorbed MLA decode over the latent cache.
    MlaDecode,
    /// KDA state update.
    KdaDecode,
    /// Attention-residual mix.
    AttnRes,
    /// Token embedding lookup.
    Embedding,
    /// LM head and argmax.
    LmHead,
    /// Row-local ops that found no operation to join.
    Elementwise,
}

impl FusedKind {
    /// The kind of operation `op` anchors, if it anchors one.
    pub fn of_anchor(op: OpKind) -> Option<FusedKind> {
        Some(match op {
            OpKind::Linear => FusedKind::Projection,
            OpKind::Router => FusedKind::Router,
            OpKind::Moe => FusedKind::Moe,
            OpKind::MlaDecode => FusedKind::MlaDecode,
            OpKind::KdaDecode => FusedKind::KdaDecode,
            OpKind::AttnResMix => FusedKind::AttnRes,
            OpKind::Embedding => FusedKind::Embedding,
            OpKind::LmHead => FusedKind::LmHead,
            _ => return None,
        })
    }
}

/// Why a node is in its fused operation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Applied {
    /// The graph node (its index).
    pub node: usize,
    /// The rule.
    pub rule: &'static str,
    /// What it saves.
    pub reason: &'static str,
}

/// One fused operation.
#[derive(Debug, Clone, Serialize)]
pub struct FusedOp {
    /// Its index in [`Fusion::ops`] (a topological order).
    pub id: usize,
    /// A readable name: the anchor's block path and the ops it covers.
    pub name: String,
    /// Its kind.
    pub kind: FusedKind,
    /// The graph nodes it covers, in graph order.
    pub nodes: Vec<usize>,
    /// The rules that joined nodes to the anchor.
    pub applied: Vec<Applied>,
}

impl FusedOp {
    /// What an MLA operation's combine reads for the output gate the planner
    /// put there (`head-gate`): the operands of the operation's nodes past the
    /// MLA node that other operations produce, each once, in graph order (none
    /// for another kind of operation). The arena's reads and the stage
    /// dependencies both come from here.
    pub fn mla_gate_reads(&self, g: &Graph) -> Vec<ValueRef> {
        let Some(at) = self.nodes.iter().position(|n| op_kind(g, NodeId::at(*n)) == Some(OpKind::MlaDecode)) else {
            return vec![];
        };
        let mut out: Vec<ValueRef> = vec![];
        for &n in &self.nodes[at + 1..] {
            for v in g.operands(NodeId::at(n)) {
                let produced = matches!(g.node(v.node).kind, NodeKind::Op { .. });
                if produced && !self.nodes.contains(&v.node.index()) && !out.contains(&v) {
                    out.push(v);
                }
            }
        }
        out
    }
}

/// The fusion plan.
#[derive(Debug, Clone, Serialize)]
pub struct Fusion {
    /// Fused operations in a topological order: each as soon as its inputs
    /// are (by depth), then by its first node in the graph.
    pub ops: Vec<FusedOp>,
    /// Producer-to-consumer edges between fused operations (deduplicated, sorted).
    pub edges: Vec<(usize, usize)>,
    /// For each graph node index, its fused operation (ops only).
    #[serde(skip)]
    pub op_of: HashMap<usize, usize>,
}

struct Groups<'a> {
    g: &'a Graph,
    /// Each node's position in a topological order: paths only go forward.
    pos: HashMap<NodeId, usize>,
    group: HashMap<NodeId, usize>,
    members: Vec<Vec<NodeId>>,
    applied: Vec<Vec<Applied>>,
}

fn op_kind(g: &Graph, id: NodeId) -> Option<OpKind> {
    match &g.node(id).kind {
        NodeKind::Op { op, .. } => Some(*op),
        _ => None,
    }
}

impl Groups<'_> {
    fn anchor_kind(&self, grp: usize) -> Option<FusedKind> {
        self.members[grp].iter().filter_map(|n| op_kind(self.g, *n).and_then(FusedKind::of_anchor)).min()
    }

    /// Groups of the op nodes producing `n`'s operands.
    fn producer_groups(&self, n: NodeId) -> Vec<usize> {
        let mut out: Vec<usize> = self.g.operands(n).iter().filter_map(|v| self.group.get(&v.node).copied()).collect();
        out.dedup();
        out
    }

    fn user_groups(&self, n: NodeId) -> Vec<usize> {
        let mut out: Vec<usize> = self.g.users(n).iter().filter_map(|u| self.group.get(u).copied()).collect();
        out.sort_unstable();
        out.dedup();
        out
    }

    /// True if some node of group `from` reaches a node of group `to`. Only
    /// nodes before `to`'s last member can lie on such a path.
    fn reaches(&self, from: usize, to: usize) -> bool {
        let limit = self.members[to].iter().map(|m| self.pos[m]).max().unwrap_or(0);
        let mut seen: HashMap<NodeId, ()> = HashMap::new();
        let mut queue: VecDeque<NodeId> = self.members[from].iter().copied().filter(|m| self.pos[m] < limit).collect();
        while let Some(n) = queue.pop_front() {
            for u in self.g.users(n) {
                if self.pos[&u] > limit || seen.insert(u, ()).is_some() {
                    continue;
                }
                match self.group.get(&u) {
                    Some(gu) if *gu == to => return true,
                    _ => queue.push_back(u),
                }
            }
        }
        false
    }

    /// Would moving node `n` into group `into` create a cycle?
    fn cycle_if_moved(&self, n: NodeId, into: usize) -> bool {
        let own = self.group[&n];
        for p in self.producer_groups(n) {
            if p != into && p != own && self.reaches(into, p) {
                return true;
            }
        }
        for u in self.user_groups(n) {
            if u != into && u != own && self.reaches(u, into) {
                return true;
            }
        }
        false
    }

    fn merge(&mut self, from: usize, into: usize, rule: &'static str, reason: &'static str) {
        if from == into {
            return;
        }
        let moved = std::mem::take(&mut self.members[from]);
        let moved_applied = std::mem::take(&mut self.applied[from]);
        for n in &moved {
            self.group.insert(*n, into);
            self.applied[into].push(Applied { node: n.index(), rule, reason });
        }
        self.applied[into].extend(moved_applied);
        self.members[into].extend(moved);
    }
}

const HEAD_GATE_REASON: &str =
    "gate applied where the attention's tasks make whole heads: once, not at every row block of the output projection";

/// The attention node whose output `n` gates, where `n` is a head gate the
/// attention stage applies itself: KDA's gated RMSNorm over groups of KDA's
/// head size, or an element-wise multiply of the MLA output by a gate; the
/// gate the attention output's only user (the stage writes the gated value
/// instead of its own).
fn head_gate_producer(g: &Graph, n: NodeId) -> Option<NodeId> {
    let ops = g.operands(n);
    let producer = match g.op(n)?.0 {
        OpKind::GatedRmsNorm => {
            let (OpKind::KdaDecode, attrs) = g.op(ops[0].node)? else { return None };
            let group = g.value_type(*ops.get(2)?).elements();
            (group == attrs.int("head_dim") as u64).then_some(ops[0].node)
        }
        OpKind::Mul => {
            let mla = ops.iter().find(|v| op_kind(g, v.node) == Some(OpKind::MlaDecode))?;
            let gate = ops.iter().find(|v| *v != mla)?;
            (g.value_type(*gate) == g.value_type(*mla)).then_some(mla.node)
        }
        _ => None,
    }?;
    (g.users(producer).as_slice() == [n]).then_some(producer)
}

fn is_row_local(op: OpKind) -> bool {
    matches!(
        op,
        OpKind::Add
            | OpKind::Mul
            | OpKind::Silu
            | OpKind::Sigmoid
            | OpKind::Softplus
            | OpKind::Situ
            | OpKind::ActAndMul
            | OpKind::Split
            | OpKind::Rope
            | OpKind::ConvUpdate
            | OpKind::L2Norm
            | OpKind::RmsNorm
            | OpKind::GatedRmsNorm
            | OpKind::Stack
    )
}

fn epilogue_reason(op: OpKind) -> &'static str {
    match op {
        OpKind::ActAndMul => {
            "activation-and-multiply in the up projection's epilogue: the 2x-wide gate/up result is never written"
        }
        OpKind::Add => "residual add in the producer's epilogue: the sum is written once instead of read back",
        OpKind::Rope | OpKind::Split => {
            "RoPE and split in the projection's epilogue: q and k_pe are written rotated, once"
        }
        OpKind::ConvUpdate | OpKind::L2Norm => {
            "short conv and L2 norm in the KDA projection's epilogue: per-channel work on rows in registers"
        }
        OpKind::Stack => "bank append in the producer's epilogue: the snapshot is written as the value is",
        _ => "element-wise op in the producer's epilogue: no extra pass over the activation",
    }
}

/// Fuses the validated graph.
pub fn fuse(v: &Validated) -> Result<Fusion> {
    let g = v.graph();
    let pos = v.order().iter().enumerate().map(|(i, n)| (*n, i)).collect();
    let mut gs = Groups { g, pos, group: HashMap::new(), members: vec![], applied: vec![] };
    for id in v.order() {
        if op_kind(g, *id).is_some() {
            gs.group.insert(*id, gs.members.len());
            gs.members.push(vec![*id]);
            gs.applied.push(vec![]);
        }
    }

    // 1. Linears sharing an input and a weight type (a task's rows stream
    // through one loader and consumer: bf16 and FP8 rows do not mix).
    let mut by_input: BTreeMap<(usize, u16, &str), usize> = BTreeMap::new();
    for id in v.order() {
        if op_kind(g, *id) == Some(OpKind::Linear) {
            let x = g.operands(*id)[0];
            let key = (x.node.index(), x.output, g.value_type(g.operands(*id)[1]).dtype.name());
            let grp = gs.group[id];
            match by_input.get(&key) {
                Some(first) => {
                    let first = *first;
                    if !gs.cycle_if_moved(*id, first) {
                        gs.merge(
                            grp,
                            first,
                            "merged-projection",
                            "linears on one input: the input is read once and one wait replaces several",
                        );
                    }
                }
                None => {
                    by_input.insert(key, grp);
                }
            }
        }
    }

    // 2. Argmax into the LM head.
    for id in v.order() {
        if op_kind(g, *id) == Some(OpKind::Argmax) {
            let x = g.operands(*id)[0];
            if op_kind(g, x.node) == Some(OpKind::LmHead) {
                let (from, into) = (gs.group[id], gs.group[&x.node]);
                gs.merge(
                    from,
                    into,
                    "argmax-in-lm-head",
                    "greedy argmax reduces the logits tiles where they are produced",
                );
            }
        }
    }

    // 3. Head gates into the attention that makes their input: KDA's gated
    // output norm (its groups KDA's heads) and the MLA output gate (o times
    // a gate, element-wise). Those stages' tasks own whole heads, so the gate
    // is applied once where o is made; as the output projection's prologue it
    // was recomputed at every row-block group of every task (three loads and a
    // sigmoid an element: the KDA output projection took 2.9 times its bytes'
    // time at batch 8 on the H100, the MLA one 2.7).
    let outputs: Vec<NodeId> = g.outputs.iter().map(|(_, v)| v.node).collect();
    for id in v.order() {
        let Some(producer) = head_gate_producer(g, *id) else { continue };
        if outputs.contains(id) || gs.members[gs.group[id]].len() != 1 {
            continue;
        }
        let into = gs.group[&producer];
        if !gs.cycle_if_moved(*id, into) {
            let from = gs.group[id];
            gs.merge(from, into, "head-gate", HEAD_GATE_REASON);
        }
    }

    // 4. Prologue: walk consumers first so chains (sigmoid -> mul -> o_proj) fold in.
    for id in v.order().iter().rev() {
        let Some(op) = op_kind(g, *id) else { continue };
        let prologue_kind = matches!(
            op,
            OpKind::RmsNorm
                | OpKind::GatedRmsNorm
                | OpKind::Mul
                | OpKind::Sigmoid
                | OpKind::Silu
                | OpKind::Situ
                | OpKind::Softplus
        );
        if !prologue_kind || outputs.contains(id) || gs.members[gs.group[id]].len() != 1 {
            continue;
        }
        let users = gs.user_groups(*id);
        let [target] = users.as_slice() else { continue };
        let accepts = matches!(
            gs.anchor_kind(*target),
            Some(
                FusedKind::Projection
                    | FusedKind::LmHead
                    | FusedKind::MlaDecode
                    | FusedKind::KdaDecode
                    | FusedKind::Moe
                    | FusedKind::AttnRes
            )
        );
        if accepts && !gs.cycle_if_moved(*id, *target) {
            let from = gs.group[id];
            gs.merge(from, *target, "prologue", "recomputed in the consumer's prologue: the result never goes to HBM and one synchronisation disappears");
        }
    }

    // 5. Epilogue.
    for id in v.order() {
        let Some(op) = op_kind(g, *id) else { continue };
        if !is_row_local(op) || gs.anchor_kind(gs.group[id]).is_some() {
            continue;
        }
        let candidates: Vec<usize> = gs
            .producer_groups(*id)
            .into_iter()
            .filter(|p| matches!(gs.anchor_kind(*p), Some(k) if k != FusedKind::Router))
            .collect();
        // Prefer the latest producer: joining it cannot order the others after it.
        let mut chosen = None;
        for p in candidates.iter().rev() {
            if !gs.cycle_if_moved(*id, *p) {
                chosen = Some(*p);
                break;
            }
        }
        if let Some(p) = chosen {
            let from = gs.group[id];
            gs.merge(from, p, "epilogue", epilogue_reason(op));
        }
    }

    build(g, gs)
}

fn build(g: &Graph, gs: Groups) -> Result<Fusion> {
    let live: Vec<usize> = (0..gs.members.len()).filter(|i| !gs.members[*i].is_empty()).collect();
    let index: HashMap<usize, usize> = live.iter().enumerate().map(|(i, grp)| (*grp, i)).collect();
    let mut edges: Vec<(usize, usize)> = vec![];
    for (n, grp) in &gs.group {
        for v in g.operands(*n) {
            if let Some(p) = gs.group.get(&v.node) {
                if p != grp {
                    edges.push((index[p], index[grp]));
                }
            }
        }
    }
    edges.sort_unstable();
    edges.dedup();
    // A topological order of the fused operations (Kahn, smallest first for determinism).
    let n = live.len();
    let mut indeg = vec![0usize; n];
    let mut succ = vec![vec![]; n];
    for (a, b) in &edges {
        indeg[*b] += 1;
        succ[*a].push(*b);
    }
    let mut ready: std::collections::BTreeSet<(usize, usize)> = std::collections::BTreeSet::new();
    let first_node = |i: usize| gs.members[live[i]].iter().map(|m| m.index()).min().unwrap_or(0);
    for (i, d) in indeg.iter().enumerate() {
        if *d == 0 {
            ready.insert((first_node(i), i));
        }
    }
    let mut order = vec![];
    while let Some((k, i)) = ready.iter().next().copied() {
        ready.remove(&(k, i));
        order.push(i);
        for s in &succ[i] {
            indeg[*s] -= 1;
            if indeg[*s] == 0 {
                ready.insert((first_node(*s), *s));
            }
        }
    }
    if order.len() != n {
        return Err(Error::new(ErrorKind::Invalid, "internal error: fusion produced a cyclic plan"));
    }
    // Each operation as soon as its inputs are: by depth (the longest chain of
    // producers before it), then as above. An operation off the longest path
    // (FP8 K2's shared expert, which cannot merge with its bf16 router's
    // projection) then fills the SMs its neighbours leave idle (the router)
    // instead of following the routed experts onto the layer's tail.
    let mut depth = vec![0usize; n];
    for i in &order {
        for s in &succ[*i] {
            depth[*s] = depth[*s].max(depth[*i] + 1);
        }
    }
    order.sort_by_key(|i| (depth[*i], first_node(*i)));
    let position: HashMap<usize, usize> = order.iter().enumerate().map(|(pos, i)| (*i, pos)).collect();
    let mut ops = vec![];
    let mut op_of = HashMap::new();
    for (pos, i) in order.iter().enumerate() {
        let grp = live[*i];
        let mut nodes: Vec<usize> = gs.members[grp].iter().map(|m| m.index()).collect();
        nodes.sort_unstable();
        for nd in &nodes {
            op_of.insert(*nd, pos);
        }
        let kind = gs.anchor_kind(grp).unwrap_or(FusedKind::Elementwise);
        let mut applied = gs.applied[grp].clone();
        applied.sort_by_key(|a| a.node);
        ops.push(FusedOp { id: pos, name: name_of(g, &gs.members[grp], kind), kind, nodes, applied });
    }
    let mut edges: Vec<(usize, usize)> = edges.into_iter().map(|(a, b)| (position[&a], position[&b])).collect();
    edges.sort_unstable();
    Ok(Fusion { ops, edges, op_of })
}

fn name_of(g: &Graph, members: &[NodeId], kind: FusedKind) -> String {
    let mut anchors: Vec<&NodeId> = members
        .iter()
        .filter(|m| op_kind(g, **m).and_then(FusedKind::of_anchor) == Some(kind) || kind == FusedKind::Elementwise)
        .collect();
    anchors.sort();
    let first = &g.node(*anchors[0]).name;
    let (prefix, _) = first.rsplit_once('/').unwrap_or(("", first));
    // A linear without a name of its own is named after its weight.
    let local = |id: NodeId| -> &str {
        let own = g.node(id).name.rsplit('/').next().unwrap_or("");
        let unnamed = own.split('#').next() == Some("linear");
        match (unnamed, g.operands(id).get(1)) {
            (true, Some(w)) => g.node(w.node).name.rsplit('/').next().unwrap_or(own),
            _ => own,
        }
    };
    let locals: Vec<&str> = anchors.iter().map(|a| local(**a)).take(6).collect();
    let more = if anchors.len() > 6 { format!("+{}", anchors.len() - 6) } else { String::new() };
    if prefix.is_empty() {
        format!("{}({}{more})", kind_name(kind), locals.join(","))
    } else {
        format!("{prefix}/{}({}{more})", kind_name(kind), locals.join(","))
    }
}

/// The kind's name as printed.
pub fn kind_name(kind: FusedKind) -> &'static str {
    match kind {
        FusedKind::Projection => "proj",
        FusedKind::Router => "router",
        FusedKind::Moe => "moe",
        FusedKind::MlaDecode => "mla",
        FusedKind::KdaDecode => "kda",
        FusedKind::AttnRes => "attn_res",
        FusedKind::Embedding => "embed",
        FusedKind::LmHead => "lm_head",
        FusedKind::Elementwise => "eltwise",
    }
}
