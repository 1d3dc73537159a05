//! The fused graph in Graphviz's dot language (`mkc plan --dot`).

use std::fmt::Write;

use super::fuse::kind_name;
use super::Plan;

/// One box per fused operation (its kind, name, node count and tasks), one
/// edge per producer-consumer pair.
pub fn to_dot(plan: &Plan) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "digraph \"{} on {}\" {{", plan.model, plan.target);
    let _ = writeln!(s, "  rankdir=TB;\n  node [shape=box, fontname=\"monospace\", fontsize=10];");
    let mut tasks = vec![0usize; plan.fusion.ops.len()];
    for st in &plan.tiling.stages {
        tasks[st.op] += st.tasks.len();
    }
    for op in &plan.fusion.ops {
        let rules: Vec<&str> = {
            let mut r: Vec<&str> = op.applied.iter().map(|a| a.rule).collect();
            r.sort_unstable();
            r.dedup();
            r
        };
        let _ = writeln!(
            s,
            "  f{} [label=\"{}\\n{}\\n{} nodes, {} tasks\\n{}\"];",
            op.id,
            kind_name(op.kind),
            op.name.replace('"', "'"),
            op.nodes.len(),
            tasks[op.id],
            rules.join(", ")
        );
    }
    for (a, b) in &plan.fusion.edges {
        let _ = writeln!(s, "  f{a} -> f{b};");
    }
    s.push_str("}\n");
    s
}
