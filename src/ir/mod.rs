//! The op graph: a `petgraph::StableDiGraph` of inputs, weights, states and
//! ops, with typed ids and the span each node came from.
//!
//! Edges run from the node that produces a value to the op that reads it and
//! record which output and which operand slot they connect. Node ids stay
//! valid across rewrites (the graph is stable), so side tables keyed by
//! [`NodeId`] survive fusion.

mod types;

pub use types::{DType, TensorType, CTX, MAX_CONTEXT};

use petgraph::stable_graph::{NodeIndex, StableDiGraph};
use petgraph::visit::EdgeRef;
use serde::Serialize;

use crate::diag::Span;
use crate::ops::{Attrs, OpKind};

/// A node of the op graph.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId(pub NodeIndex);

impl NodeId {
    /// The node's index, for tables and printing.
    pub fn index(self) -> usize {
        self.0.index()
    }

    /// The node of index `i` (the plan names nodes by index).
    pub fn at(i: usize) -> NodeId {
        NodeId(petgraph::stable_graph::NodeIndex::new(i))
    }
}

/// One output of one node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ValueRef {
    /// The producing node.
    pub node: NodeId,
    /// Which of its outputs.
    pub output: u16,
}

/// A dimension of a per-sequence state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum StateDim {
    /// A fixed size.
    Fixed(u64),
    /// The maximum context length, chosen when the runtime allocates.
    Ctx,
}

/// A weight read from the checkpoint.
#[derive(Debug, Clone, PartialEq)]
pub struct Weight {
    /// The checkpoint key; for an expert family it still holds `{index}`.
    pub key: String,
    /// For an expert family: the placeholder name and the number of experts.
    pub family: Option<(String, u64)>,
    /// The key of the block scales (block-scaled dtypes only).
    pub scale_key: Option<String>,
    /// One tensor's type (one expert's, for a family).
    pub ty: TensorType,
}

impl Weight {
    /// Number of tensors in the family (1 for a plain weight).
    pub fn count(&self) -> u64 {
        self.family.as_ref().map_or(1, |f| f.1)
    }

    /// The key of tensor `i` of the family.
    pub fn key_at(&self, i: u64) -> String {
        expand(&self.key, self.family.as_ref(), i)
    }

    /// The scale key of tensor `i` of the family.
    pub fn scale_key_at(&self, i: u64) -> Option<String> {
        self.scale_key.as_ref().map(|k| expand(k, self.family.as_ref(), i))
    }
}

fn expand(key: &str, family: Option<&(String, u64)>, i: u64) -> String {
    match family {
        Some((var, _)) => key.replace(&format!("{{{var}}}"), &i.to_string()),
        None => key.to_string(),
    }
}

/// A per-sequence state buffer.
#[derive(Debug, Clone, PartialEq)]
pub struct State {
    /// Element type.
    pub dtype: DType,
    /// Dimensions.
    pub dims: Vec<StateDim>,
}

impl State {
    /// Bytes per sequence at context `ctx`.
    pub fn bytes(&self, ctx: u64) -> u64 {
        let shape: Vec<u64> = self
            .dims
            .iter()
            .map(|d| match d {
                StateDim::Fixed(n) => *n,
                StateDim::Ctx => ctx,
            })
            .collect();
        TensorType::new(self.dtype, shape).bytes()
    }
}

/// What a node is.
#[derive(Debug, Clone, PartialEq)]
pub enum NodeKind {
    /// A per-token input of the step (the token id).
    Input,
    /// A checkpoint tensor (or family of per-expert tensors).
    Weight(Weight),
    /// A per-sequence state, read and written in place by the ops given it.
    State(State),
    /// An operation.
    Op {
        /// Which op.
        op: OpKind,
        /// Its compile-time attributes, checked against the op's schema.
        attrs: Attrs,
    },
}

/// A node with its outputs' types and provenance.
#[derive(Debug, Clone, PartialEq)]
pub struct Node {
    /// What the node is.
    pub kind: NodeKind,
    /// Types of its outputs (weights and states: their one value).
    pub outputs: Vec<TensorType>,
    /// A readable, unique name: the block path and the local name.
    pub name: String,
    /// Where in the graph file it was declared or called.
    pub span: Span,
}

/// An edge: output `output` of the source feeds operand `slot` of the target.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Edge {
    /// Output index on the producer.
    pub output: u16,
    /// Operand index on the consumer.
    pub slot: u16,
}

/// The op graph of one decode step.
#[derive(Debug, Clone, Default)]
pub struct Graph {
    /// The model's name.
    pub model: String,
    /// Nodes and edges.
    pub g: StableDiGraph<Node, Edge>,
    /// Named results of the step.
    pub outputs: Vec<(String, ValueRef)>,
    /// The `graph { ... }` the step came from.
    pub span: Span,
}

impl Graph {
    /// Adds a node.
    pub fn add(&mut self, node: Node) -> NodeId {
        NodeId(self.g.add_node(node))
    }

    /// Connects `value` to operand `slot` of `to`.
    pub fn connect(&mut self, value: ValueRef, to: NodeId, slot: u16) {
        self.g.add_edge(value.node.0, to.0, Edge { output: value.output, slot });
    }

    /// The node with id `id`.
    pub fn node(&self, id: NodeId) -> &Node {
        &self.g[id.0]
    }

    /// All node ids, in insertion order.
    pub fn nodes(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.g.node_indices().map(NodeId)
    }

    /// The op of node `id` and its attributes, if it is an op.
    pub fn op(&self, id: NodeId) -> Option<(OpKind, &Attrs)> {
        match &self.node(id).kind {
            NodeKind::Op { op, attrs } => Some((*op, attrs)),
            _ => None,
        }
    }

    /// The type of a value.
    pub fn value_type(&self, v: ValueRef) -> &TensorType {
        &self.node(v.node).outputs[v.output as usize]
    }

    /// The operands of `id`, in slot order.
    pub fn operands(&self, id: NodeId) -> Vec<ValueRef> {
        let mut edges: Vec<(u16, ValueRef)> = self
            .g
            .edges_directed(id.0, petgraph::Direction::Incoming)
            .map(|e| (e.weight().slot, ValueRef { node: NodeId(e.source()), output: e.weight().output }))
            .collect();
        edges.sort_by_key(|(slot, _)| *slot);
        edges.into_iter().map(|(_, v)| v).collect()
    }

    /// The nodes that read value `v` (once per operand slot).
    pub fn readers(&self, v: ValueRef) -> impl Iterator<Item = NodeId> + '_ {
        self.g
            .edges_directed(v.node.0, petgraph::Direction::Outgoing)
            .filter(move |e| e.weight().output == v.output)
            .map(|e| NodeId(e.target()))
    }

    /// The nodes that read any output of `id`.
    pub fn users(&self, id: NodeId) -> Vec<NodeId> {
        let mut users: Vec<NodeId> =
            self.g.neighbors_directed(id.0, petgraph::Direction::Outgoing).map(NodeId).collect();
        users.sort();
        users.dedup();
        users
    }
}
