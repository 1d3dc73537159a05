//! The op graph in Graphviz's dot language (`mkc graph --dot`).

use std::fmt::Write;

use crate::ir::NodeKind;
use crate::valid::Validated;

fn escape(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"")
}

/// Writes the validated graph as a dot digraph: ops as boxes, weights as
/// notes, states as cylinders, inputs as ellipses; edges carry the value's type.
pub fn to_dot(v: &Validated) -> String {
    let g = v.graph();
    let mut s = String::new();
    let _ = writeln!(s, "digraph \"{}\" {{", escape(&g.model));
    let _ = writeln!(s, "  rankdir=TB;\n  node [fontname=\"monospace\", fontsize=10];");
    for id in v.order() {
        let node = g.node(*id);
        let (shape, label) = match &node.kind {
            NodeKind::Input => ("ellipse", format!("{}\\n{}", node.name, node.outputs[0])),
            NodeKind::Weight(w) => {
                let fam = w.family.as_ref().map(|(_, n)| format!(" x{n}")).unwrap_or_default();
                ("note", format!("{}\\n{}{fam}", escape(&w.key), w.ty))
            }
            NodeKind::State(_) => ("cylinder", format!("{}\\n{}", node.name, node.outputs[0])),
            NodeKind::Op { op, attrs } => {
                let a = attrs.render();
                ("box", format!("{}\\n{}{}{}", op.name(), node.name, if a.is_empty() { "" } else { "\\n" }, escape(&a)))
            }
        };
        let _ = writeln!(s, "  n{} [shape={shape}, label=\"{}\"];", id.index(), escape_label(&label));
    }
    for id in v.order() {
        for (slot, val) in g.operands(*id).iter().enumerate() {
            let _ =
                writeln!(s, "  n{} -> n{} [label=\"{}:{}\"];", val.node.index(), id.index(), slot, g.value_type(*val));
        }
    }
    for (name, val) in &g.outputs {
        let _ = writeln!(s, "  out_{} [shape=doublecircle, label=\"{}\"];", escape_id(name), escape(name));
        let _ = writeln!(s, "  n{} -> out_{};", val.node.index(), escape_id(name));
    }
    s.push_str("}\n");
    s
}

fn escape_label(s: &str) -> String {
    s.replace('"', "\\\"")
}

fn escape_id(s: &str) -> String {
    s.chars().map(|c| if c.is_ascii_alphanumeric() { c } else { '_' }).collect()
}
