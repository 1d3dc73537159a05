//! The summary `mkc check` prints: op counts, parameters, the weight bytes a
//! decode step reads, and per-sequence state.
//!
//! Definitions (docs/check.md says more):
//! - *total parameters*: every element of every weight, experts included
//!   (quantized values count one each; scales are not parameters);
//! - *active parameters*: the parameters one token multiplies with: all
//!   weights except the embedding table (a lookup reads one row) and, of each
//!   routed-expert family, `top_k` experts of `E`;
//! - sizes (weights resident, weights read per step, state per sequence) are
//!   [`crate::sizes`]'s, the same numbers `plan` prints; docs/SIZES.md.

use std::collections::BTreeMap;
use std::fmt::Write;

use serde::Serialize;

use crate::ir::NodeKind;
use crate::sizes::WeightUse;
use crate::valid::Validated;

/// What `mkc check` reports.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    /// The model's name.
    pub model: String,
    /// Op nodes by op name.
    pub ops: BTreeMap<&'static str, u64>,
    /// Weight declarations after dedup (a family counts once).
    pub weights: u64,
    /// Checkpoint tensors the graph reads (families expanded, scales included).
    pub checkpoint_tensors: u64,
    /// All parameters. The sums of this summary are exact 128-bit integers
    /// (a graph's tensors within the lowering limits cannot reach 2^128), so
    /// no count is ever a saturated or wrapped 64-bit value.
    pub total_params: u128,
    /// Parameters one token uses.
    pub active_params: u128,
    /// Bytes of all weights as the GPU holds them, scales included (resident on one GPU).
    pub weight_bytes: u128,
    /// (batch, weight bytes read per decode step: moved).
    pub bytes_per_step: Vec<(u64, u64)>,
    /// The context length the state is sized for.
    pub context: u64,
    /// Per-sequence state by local name: (name, count, bytes in all).
    pub state: Vec<(String, u64, u128)>,
}

/// Counts and sizes for `graph`, with state sized at `context` tokens and
/// bytes per step at each batch in `batches`.
pub fn summarize(v: &Validated, context: u64, batches: &[u64]) -> Summary {
    let g = v.graph();
    let mut ops = BTreeMap::new();
    let (mut total, mut active, mut weight_bytes) = (0u128, 0u128, 0u128);
    let (mut weights, mut tensors) = (0u64, 0u64);
    let mut state: BTreeMap<String, (u64, u128)> = BTreeMap::new();
    for id in g.nodes() {
        let node = g.node(id);
        match &node.kind {
            NodeKind::Op { op, .. } => *ops.entry(op.name()).or_insert(0) += 1,
            NodeKind::Weight(w) => {
                weights += 1;
                let n = w.count();
                tensors += n * if w.scale_key.is_some() { 2 } else { 1 };
                let elems = u128::from(w.ty.elements());
                total += u128::from(n) * elems;
                weight_bytes += u128::from(n) * u128::from(crate::sizes::device_bytes(g, id));
                match crate::sizes::weight_use(g, id) {
                    WeightUse::Experts { top_k } => active += u128::from(top_k.min(n)) * elems,
                    WeightUse::Whole => active += u128::from(n) * elems,
                    WeightUse::Embedding => {}
                }
            }
            NodeKind::State(s) => {
                let local = node.name.rsplit('/').next().unwrap_or(&node.name).to_string();
                let e = state.entry(local).or_insert((0, 0));
                e.0 += 1;
                e.1 += u128::from(s.bytes(context));
            }
            NodeKind::Input => {}
        }
    }
    Summary {
        model: g.model.clone(),
        ops,
        weights,
        checkpoint_tensors: tensors,
        total_params: total,
        active_params: active,
        weight_bytes,
        bytes_per_step: batches
            .iter()
            .map(|b| (*b, crate::sizes::graph_sizes(v, *b, context, 1).weights_read))
            .collect(),
        context,
        state: state.into_iter().map(|(k, (n, b))| (k, n, b)).collect(),
    }
}

/// Expected number of distinct experts of `e` that `batch` tokens choosing
/// `k` each touch under uniform routing: `E (1 - (1 - k/E)^B)`, exactly `k`
/// at batch 1.
pub fn expected_distinct_experts(e: u64, k: u64, batch: u64) -> f64 {
    let p = k.min(e) as f64 / e.max(1) as f64;
    e as f64 * (1.0 - (1.0 - p).powf(batch as f64))
}

/// `1234567` as `1,234,567`.
pub fn grouped(n: impl Into<u128>) -> String {
    let s = n.into().to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// A count with an SI suffix: `2.78T`, `104.1B`, `48.0M`.
pub fn si(n: impl Into<u128>) -> String {
    let n = n.into();
    let x = n as f64;
    for (scale, suffix) in [(1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")] {
        if x >= scale {
            let digits = if x >= 100.0 * scale { 1 } else { 2 };
            return format!("{:.*}{suffix}", digits, x / scale);
        }
    }
    n.to_string()
}

/// Bytes in decimal units: `137.0 GB`.
pub fn bytes(n: impl Into<u128>) -> String {
    let n = n.into();
    let x = n as f64;
    for (scale, suffix) in [(1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "KB")] {
        if x >= scale {
            return format!("{:.2} {suffix}", x / scale);
        }
    }
    format!("{n} B")
}

impl Summary {
    /// The report as `mkc check` prints it.
    pub fn render(&self) -> String {
        let mut s = String::new();
        let n_ops: u64 = self.ops.values().sum();
        let _ = writeln!(s, "model {}: valid", self.model);
        let _ = writeln!(s, "ops: {}", grouped(n_ops));
        for (k, v) in &self.ops {
            let _ = writeln!(s, "  {k:<16} {v:>8}");
        }
        let _ = writeln!(
            s,
            "weights: {} declarations, {} checkpoint tensors, {} resident",
            grouped(self.weights),
            grouped(self.checkpoint_tensors),
            bytes(self.weight_bytes)
        );
        let _ = writeln!(s, "parameters: total {} ({})", grouped(self.total_params), si(self.total_params));
        let _ = writeln!(s, "parameters: active {} ({})", grouped(self.active_params), si(self.active_params));
        for (b, x) in &self.bytes_per_step {
            let _ = writeln!(s, "weights read per step at batch {b} (moved): {} ({})", grouped(*x), bytes(*x));
        }
        let total: u128 = self.state.iter().map(|x| x.2).sum();
        let _ = writeln!(s, "state per sequence at context {}: {} ({})", self.context, grouped(total), bytes(total));
        for (name, n, b) in &self.state {
            let _ = writeln!(s, "  {name:<16} x{n:<4} {}", bytes(*b));
        }
        s
    }
}
