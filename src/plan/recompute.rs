//! Recomputation: a norm read by several fused operations is computed again
//! in each of them instead of once and stored.
//!
//! The residual stream's post-attention RMSNorm of a MoE layer is read by the
//! router/shared-expert projection and by the routed experts. Left alone it
//! would join the attention output projection as an epilogue, and an RMSNorm
//! epilogue needs the whole row in one task: the largest projection of the
//! layer would run on one SM. Recomputed, it is each consumer's prologue (a
//! sum of squares over `hidden` values per token, read through L2), and the
//! projection splits over every SM.
//!
//! The pass copies each RMSNorm whose users are linears and routed-expert
//! ops, one copy per consumer class: the linear users of one weight type
//! share a copy (so the merged-projection rule, which merges linears of one
//! weight type, still sees one input), each `moe` user gets its own. The copies keep the original's name with `#recompute{k}` and its
//! span, and the graph is validated again.

use crate::diag::Result;
use crate::ir::{Graph, Node, NodeId, NodeKind};
use crate::ops::OpKind;
use crate::valid::{validate, Validated};

fn op(g: &Graph, id: NodeId) -> Option<OpKind> {
    match &g.node(id).kind {
        NodeKind::Op { op, .. } => Some(*op),
        _ => None,
    }
}

/// The graph with shared norms duplicated per consumer class; `v` itself
/// when there are none.
pub fn recompute_shared_norms(v: &Validated) -> Result<Validated> {
    let mut g: Graph = v.graph().clone();
    let mut changed = false;
    let outputs: Vec<NodeId> = g.outputs.iter().map(|(_, o)| o.node).collect();
    for &id in v.order() {
        if op(&g, id) != Some(OpKind::RmsNorm) || outputs.contains(&id) {
            continue;
        }
        let users = g.users(id);
        let linear = |u: &NodeId| op(&g, *u) == Some(OpKind::Linear);
        let moe = |u: &NodeId| op(&g, *u) == Some(OpKind::Moe);
        if users.len() < 2 || !users.iter().all(|u| linear(u) || moe(u)) {
            continue;
        }
        // Consumer classes: the linears of one weight type together (the
        // merged-projection rule's groups), each moe alone. The first class
        // keeps the original node.
        let mut classes: Vec<Vec<NodeId>> = vec![];
        let weight_type = |u: &NodeId| g.value_type(g.operands(*u)[1]).dtype;
        for u in users.iter().copied().filter(linear) {
            match classes.iter_mut().find(|c| weight_type(&c[0]) == weight_type(&u)) {
                Some(c) => c.push(u),
                None => classes.push(vec![u]),
            }
        }
        classes.extend(users.iter().copied().filter(moe).map(|u| vec![u]));
        if classes.len() < 2 {
            continue;
        }
        let operands = g.operands(id);
        for (k, class) in classes.iter().enumerate().skip(1) {
            let orig: Node = g.node(id).clone();
            let copy = g.add(Node { name: format!("{}#recompute{k}", orig.name), ..orig });
            for (slot, o) in operands.iter().enumerate() {
                g.connect(*o, copy, slot as u16);
            }
            for u in class {
                let edges: Vec<_> =
                    g.g.edges_connecting(id.0, u.0).map(|e| (petgraph::visit::EdgeRef::id(&e), *e.weight())).collect();
                for (e, w) in edges {
                    g.g.remove_edge(e);
                    g.g.add_edge(copy.0, u.0, w);
                }
            }
        }
        changed = true;
    }
    if !changed {
        return Ok(v.clone());
    }
    validate(g)
}
