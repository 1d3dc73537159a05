//! The tensors a validated graph reads from a checkpoint: each weight's key,
//! safetensors dtype and shape (with its scale tensor for FP8 and MXFP4), and
//! how the runtime lays it out on the GPU.

use crate::ir::{DType, NodeKind};
use crate::valid::Validated;

/// One tensor the graph needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Requirement {
    /// The checkpoint key.
    pub key: String,
    /// The safetensors dtype it must have.
    pub dtype: &'static str,
    /// Its shape.
    pub shape: Vec<u64>,
    /// The graph node that reads it, for messages.
    pub node: String,
    /// How the runtime lays it out on the GPU.
    pub layout: GpuLayout,
}

/// How the runtime lays a checkpoint tensor out on the GPU
/// (`device/mkc/mx_layout.h`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GpuLayout {
    /// Bytes as stored (widened to f32 where the plan asks).
    AsStored,
    /// MXFP4 codes `[rows, k / 2]` in tiles of 8 rows, a tile's 32-element
    /// blocks one after the other. Always followed by its scales in
    /// [`requirements`]: the runtime reads them with the codes to zero the
    /// blocks whose scale is e8m0's NaN (read as 0).
    MxCodes,
    /// MXFP4 scales `[rows, k / 32]` in the same tiles.
    MxScales,
    /// FP8 e4m3 codes `[rows, k]` the device reads as bf16 (the MLA's
    /// kv_b): dequantised on upload with their block scales, which follow
    /// them in [`requirements`] (`device/mkc/fp8_layout.h`).
    Fp8Bf16,
}

impl GpuLayout {
    /// The runtime's name for it (`mkc::WeightLayout`).
    pub fn cpp_name(self) -> &'static str {
        match self {
            GpuLayout::AsStored => "kAsStored",
            GpuLayout::MxCodes => "kMxCodes",
            GpuLayout::MxScales => "kMxScales",
            GpuLayout::Fp8Bf16 => "kFp8Bf16",
        }
    }
}

fn storage_dtype(d: DType) -> &'static str {
    match d {
        DType::Bf16 => "BF16",
        DType::F16 => "F16",
        DType::F32 => "F32",
        DType::I32 => "I32",
        DType::I64 => "I64",
        DType::U8 | DType::Mxfp4 => "U8",
        DType::Fp8E4m3 => "F8_E4M3",
    }
}

/// A set of checkpoint tensors named by one key pattern: `count` members
/// (a weight's experts, or one member for a plain weight), each of which is
/// its `tensors` in order with `{var}` in their keys replaced by the member's
/// index. The plan file lists these; [`requirements`] expands them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WeightGroup {
    /// The placeholder (`expert`), or `None` for a plain weight.
    pub var: Option<String>,
    /// Members.
    pub count: u64,
    /// Each member's tensors, keys still holding `{var}`.
    pub tensors: Vec<Requirement>,
}

impl WeightGroup {
    /// Member `i`'s tensors.
    pub fn member(&self, i: u64) -> impl Iterator<Item = Requirement> + '_ {
        self.tensors.iter().map(move |t| {
            let key = match &self.var {
                Some(var) => t.key.replace(&format!("{{{var}}}"), &i.to_string()),
                None => t.key.clone(),
            };
            Requirement { key, ..t.clone() }
        })
    }
}

/// Whether the device reads weight `w` as bf16 whatever its stored type:
/// the MLA's up-projection (kv_b), whose split and combine stream W_UK and
/// W_UV as bf16 rows.
pub fn read_as_bf16(g: &crate::ir::Graph, w: crate::ir::NodeId) -> bool {
    let v = crate::ir::ValueRef { node: w, output: 0 };
    g.readers(v).any(|r| matches!(g.op(r), Some((crate::ops::OpKind::MlaDecode, _))))
}

/// The tensors `graph` reads, as key patterns, in declaration order.
pub fn weight_groups(graph: &Validated) -> Vec<WeightGroup> {
    let g = graph.graph();
    let mut out = Vec::new();
    for id in g.nodes() {
        let node = g.node(id);
        let NodeKind::Weight(w) = &node.kind else { continue };
        let shape = &w.ty.shape;
        let (rows, k) = (shape[..shape.len() - 1].to_vec(), *shape.last().expect("weights have dims"));
        let (data_shape, scale_shape): (Vec<u64>, Option<Vec<u64>>) = match w.ty.dtype {
            DType::Mxfp4 => {
                let mut d = rows.clone();
                d.push(k / 2);
                let mut s = rows;
                s.push(k / 32);
                (d, Some(s))
            }
            DType::Fp8E4m3 => {
                let mut s: Vec<u64> = rows.iter().map(|r| r.div_ceil(128)).collect();
                s.push(k.div_ceil(128));
                (shape.clone(), Some(s))
            }
            _ => (shape.clone(), None),
        };
        let scale_dtype = if w.ty.dtype == DType::Fp8E4m3 { "F32" } else { "U8" };
        let (data_layout, scale_layout) = match w.ty.dtype {
            DType::Mxfp4 => (GpuLayout::MxCodes, GpuLayout::MxScales),
            DType::Fp8E4m3 if read_as_bf16(g, id) => (GpuLayout::Fp8Bf16, GpuLayout::AsStored),
            _ => (GpuLayout::AsStored, GpuLayout::AsStored),
        };
        let mut tensors = vec![Requirement {
            key: w.key.clone(),
            dtype: storage_dtype(w.ty.dtype),
            shape: data_shape,
            node: node.name.clone(),
            layout: data_layout,
        }];
        if let (Some(key), Some(s)) = (&w.scale_key, scale_shape) {
            tensors.push(Requirement {
                key: key.clone(),
                dtype: scale_dtype,
                shape: s,
                node: node.name.clone(),
                layout: scale_layout,
            });
        }
        out.push(WeightGroup { var: w.family.as_ref().map(|f| f.0.clone()), count: w.count(), tensors });
    }
    out
}

/// The tensors `graph` reads from a checkpoint, in declaration order.
pub fn requirements(graph: &Validated) -> Vec<Requirement> {
    weight_groups(graph).iter().flat_map(|g| (0..g.count).flat_map(move |i| g.member(i))).collect()
}
