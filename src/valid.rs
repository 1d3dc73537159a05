//! Validation: whole-graph checks whose result every later stage requires.
//!
//! Only [`validate`] builds a [`Validated`], so nothing downstream can see an
//! unchecked graph. It re-runs every op's shape rule against the recorded
//! types, checks the graph is acyclic, that each state is updated by exactly
//! one op, that every weight is read and every op result reaches an output
//! or a state, and computes a topological order for the planner.

use crate::diag::{Error, ErrorKind, Result};
use crate::ir::{Graph, NodeId, NodeKind, TensorType};

/// A graph that passed validation, with what validation learned.
#[derive(Debug, Clone)]
pub struct Validated {
    graph: Graph,
    order: Vec<NodeId>,
}

impl Validated {
    /// The validated graph.
    pub fn graph(&self) -> &Graph {
        &self.graph
    }

    /// Every node in a topological order (producers before consumers).
    pub fn order(&self) -> &[NodeId] {
        &self.order
    }
}

fn invalid(msg: String, graph: &Graph, id: NodeId) -> Error {
    Error::new(ErrorKind::Invalid, msg).at(graph.node(id).span)
}

/// Validates a lowered graph.
pub fn validate(graph: Graph) -> Result<Validated> {
    let order = petgraph::algo::toposort(&graph.g, None)
        .map_err(|c| invalid("the graph has a cycle".into(), &graph, NodeId(c.node_id())))?
        .into_iter()
        .map(NodeId)
        .collect::<Vec<_>>();
    if !graph.nodes().any(|id| matches!(graph.node(id).kind, NodeKind::Input)) {
        return Err(
            Error::new(ErrorKind::Invalid, "the graph has no `input`").help("declare the token: `input token: i32[]`")
        );
    }
    for id in graph.nodes() {
        let node = graph.node(id);
        match &node.kind {
            NodeKind::Op { op, attrs } => {
                let def = op.def();
                let operands = graph.operands(id);
                let types: Vec<Option<&TensorType>> =
                    (0..def.operands.len()).map(|i| operands.get(i).map(|v| graph.value_type(*v))).collect();
                let inferred = (def.infer)(attrs, &types)
                    .map_err(|m| invalid(format!("`{}` no longer type-checks: {m}", def.name), &graph, id))?;
                if inferred != node.outputs {
                    return Err(invalid(format!("`{}` has outputs that disagree with its rule", def.name), &graph, id));
                }
                for (v, od) in operands.iter().zip(def.operands) {
                    let is_state = matches!(graph.node(v.node).kind, NodeKind::State(_));
                    if is_state != od.state {
                        return Err(invalid(
                            format!("operand `{}` of `{}` has the wrong kind", od.name, def.name),
                            &graph,
                            id,
                        ));
                    }
                }
            }
            NodeKind::State(_) => {
                let writers = graph.users(id);
                match writers.as_slice() {
                    [_] => {}
                    [] => {
                        return Err(invalid(format!("state `{}` is never updated", node.name), &graph, id)
                            .label("declared here")
                            .help("pass it to the op that reads and writes it, or remove it"))
                    }
                    [a, b, ..] => {
                        return Err(invalid(
                            format!(
                                "state `{}` is updated by two ops, `{}` and `{}`; one op per step may own a state",
                                node.name,
                                graph.node(*a).name,
                                graph.node(*b).name
                            ),
                            &graph,
                            *b,
                        )
                        .label("second update"))
                    }
                }
            }
            NodeKind::Weight(_) => {
                if graph.users(id).is_empty() {
                    return Err(invalid(format!("weight `{}` is declared but never used", node.name), &graph, id)
                        .label("unused"));
                }
            }
            NodeKind::Input => {}
        }
    }
    check_live(&graph, &order)?;
    Ok(Validated { graph, order })
}

/// Every op must feed an output or update a state, directly or not.
fn check_live(graph: &Graph, order: &[NodeId]) -> Result<()> {
    let bound = graph.nodes().map(|id| id.index() + 1).max().unwrap_or(0);
    let mut live = vec![false; bound];
    for (_, v) in &graph.outputs {
        live[v.node.index()] = true;
    }
    for id in order.iter().rev() {
        let node = graph.node(*id);
        let effect = matches!(&node.kind, NodeKind::Op { op, .. } if op.def().operands.iter().any(|o| o.state));
        if effect || live[id.index()] {
            live[id.index()] = true;
            for v in graph.operands(*id) {
                live[v.node.index()] = true;
            }
        }
    }
    for id in order {
        let node = graph.node(*id);
        if let NodeKind::Op { .. } = &node.kind {
            if !live[id.index()] {
                return Err(invalid(format!("the result of `{}` is never used", node.name), graph, *id)
                    .label("dead computation")
                    .help("use it, output it, or remove it"));
            }
        }
    }
    Ok(())
}
