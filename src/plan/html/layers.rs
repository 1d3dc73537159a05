//! Layers of the fused graph, found by name, and their folding.
//!
//! Fused operations whose names start with a loop index (`l.7/...`) belong to
//! that layer. Two layers are of one kind when their operations, with the
//! layer prefix removed, have the same names and kinds in the same order. The
//! page's top level is a sequence of blocks: an operation outside any layer, a
//! layer, or a repeat (a unit of layer kinds that recurs back to back, such as
//! three KDA layers and one MLA layer), so 93 layers read as a handful of
//! boxes. It does not look for layers in graphs without such names: each
//! operation is then its own block.

use serde::Serialize;

use crate::plan::fuse::{kind_name, Fusion};

/// One layer: its name and kind, and its operations in order.
#[derive(Serialize)]
pub struct Layer {
    /// The prefix, `l.7`.
    pub name: String,
    /// Index into the layer kinds.
    pub kind: usize,
    /// Its fused operations.
    pub ops: Vec<usize>,
}

/// Layers with the same operations.
#[derive(Serialize)]
pub struct LayerKind {
    /// A letter: `A`, `B`, ...
    pub label: String,
    /// The sub-blocks that tell it from the other kinds (`kda + latent_moe`).
    pub what: String,
    /// Its layers.
    pub layers: Vec<usize>,
}

/// A top-level item of the folded graph.
#[derive(Serialize, Debug, Clone, Copy, PartialEq)]
#[serde(rename_all = "snake_case")]
pub enum Block {
    /// An operation outside any layer.
    Op(usize),
    /// One layer.
    Layer(usize),
    /// `times` back-to-back copies of the layers `first .. first + unit`.
    Repeat {
        /// The first layer.
        first: usize,
        /// Layers in one copy.
        unit: usize,
        /// Copies.
        times: usize,
    },
}

/// The layers, their kinds and the folded top level.
pub struct Layers {
    /// The layer of each operation, if any.
    pub of_op: Vec<Option<usize>>,
    /// Layers in order of their first operation.
    pub layers: Vec<Layer>,
    /// The kinds, in order of first appearance.
    pub kinds: Vec<LayerKind>,
    /// The top level.
    pub blocks: Vec<Block>,
}

/// The longest unit a repeat is looked for with.
const MAX_UNIT: usize = 8;

/// `l.7/layer/kda/proj(f)` -> (`l.7`, `layer/kda/proj(f)`).
fn split_layer(name: &str) -> Option<(&str, &str)> {
    let (head, rest) = name.split_once('/')?;
    let (stem, index) = head.rsplit_once('.')?;
    let named = !stem.is_empty() && stem.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
    (named && !index.is_empty() && index.chars().all(|c| c.is_ascii_digit())).then_some((head, rest))
}

/// Finds the layers of `fusion` and folds them.
pub fn layers(fusion: &Fusion) -> Layers {
    let mut of_op = vec![None; fusion.ops.len()];
    let mut layers: Vec<Layer> = vec![];
    let mut signatures: Vec<Vec<(String, &'static str)>> = vec![];
    let mut by_name = std::collections::HashMap::new();
    for op in &fusion.ops {
        if let Some((head, rest)) = split_layer(&op.name) {
            let l = *by_name.entry(head.to_string()).or_insert_with(|| {
                layers.push(Layer { name: head.to_string(), kind: 0, ops: vec![] });
                signatures.push(vec![]);
                layers.len() - 1
            });
            layers[l].ops.push(op.id);
            signatures[l].push((rest.to_string(), kind_name(op.kind)));
            of_op[op.id] = Some(l);
        }
    }
    let mut kinds: Vec<LayerKind> = vec![];
    let mut kind_signatures: Vec<&Vec<(String, &'static str)>> = vec![];
    for (l, sig) in signatures.iter().enumerate() {
        let k = match kind_signatures.iter().position(|s| *s == sig) {
            Some(k) => k,
            None => {
                kind_signatures.push(sig);
                kinds.push(LayerKind { label: letter(kinds.len()), what: String::new(), layers: vec![] });
                kinds.len() - 1
            }
        };
        layers[l].kind = k;
        kinds[k].layers.push(l);
    }
    // What tells the kinds apart: the sub-block names not in every kind.
    let parts = |sig: &Vec<(String, &'static str)>| -> Vec<String> {
        let mut v: Vec<String> = vec![];
        for (name, _) in sig {
            if let Some((path, _)) = name.rsplit_once('/') {
                let part = path.rsplit('/').next().unwrap_or(path).to_string();
                if !v.contains(&part) {
                    v.push(part);
                }
            }
        }
        v
    };
    let all: Vec<Vec<String>> = kind_signatures.iter().map(|s| parts(s)).collect();
    for (k, p) in all.iter().enumerate() {
        let distinct: Vec<&str> =
            p.iter().filter(|x| all.len() == 1 || !all.iter().all(|q| q.contains(x))).map(String::as_str).collect();
        let shown = if distinct.is_empty() { p.iter().map(String::as_str).collect() } else { distinct };
        kinds[k].what = shown.join(" + ");
    }
    let blocks = fold(&of_op, &layers);
    Layers { of_op, layers, kinds, blocks }
}

fn letter(i: usize) -> String {
    let a = (b'A' + (i % 26) as u8) as char;
    if i < 26 {
        a.to_string()
    } else {
        format!("{a}{}", i / 26)
    }
}

/// The top level: operations outside layers in place, layers folded into
/// the longest back-to-back repeats of a unit of up to [`MAX_UNIT`] layers.
fn fold(of_op: &[Option<usize>], layers: &[Layer]) -> Vec<Block> {
    let mut items = vec![];
    for (op, layer) in of_op.iter().enumerate() {
        match *layer {
            None => items.push(Block::Op(op)),
            Some(l) if layers[l].ops[0] == op => items.push(Block::Layer(l)),
            Some(_) => {}
        }
    }
    let kind_at = |i: usize| match items.get(i) {
        Some(Block::Layer(l)) => Some(layers[*l].kind),
        _ => None,
    };
    let mut blocks = vec![];
    let mut i = 0;
    while i < items.len() {
        let Block::Layer(first) = items[i] else {
            blocks.push(items[i]);
            i += 1;
            continue;
        };
        // (covered, unit, times), the longest cover first, then the shortest unit.
        let mut best = (1, 1, 1);
        for unit in 1..=MAX_UNIT {
            if (0..unit).any(|j| kind_at(i + j).is_none()) {
                break;
            }
            let mut times = 1;
            while (0..unit)
                .all(|j| kind_at(i + times * unit + j).is_some() && kind_at(i + times * unit + j) == kind_at(i + j))
            {
                times += 1;
            }
            if times >= 2 && unit * times > best.0 {
                best = (unit * times, unit, times);
            }
        }
        let (covered, unit, times) = best;
        blocks.push(if times >= 2 { Block::Repeat { first, unit, times } } else { Block::Layer(first) });
        i += covered;
    }
    blocks
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layer_prefixes_are_a_name_and_an_index() {
        assert_eq!(split_layer("l.7/layer/kda/proj(f)"), Some(("l.7", "layer/kda/proj(f)")));
        assert_eq!(split_layer("embed(c)"), None);
        assert_eq!(split_layer("l.x/a"), None);
        assert_eq!(split_layer(".3/a"), None);
    }

    #[test]
    fn repeats_fold_the_longest_cover() {
        let kinds = [0, 1, 1, 2, 1, 1, 2, 1, 1, 2, 2];
        let layers: Vec<Layer> = kinds
            .iter()
            .enumerate()
            .map(|(i, k)| Layer { name: format!("l.{i}"), kind: *k, ops: vec![i + 1] })
            .collect();
        let mut of_op = vec![None];
        of_op.extend((0..kinds.len()).map(Some));
        of_op.push(None);
        let blocks = fold(&of_op, &layers);
        assert_eq!(
            blocks,
            vec![
                Block::Op(0),
                Block::Layer(0),
                Block::Repeat { first: 1, unit: 3, times: 3 },
                Block::Layer(10),
                Block::Op(12)
            ]
        );
    }
}
