//! Checking a Hugging Face checkpoint directory against a validated graph.
//!
//! The directory holds `model.safetensors`, or shards listed by
//! `model.safetensors.index.json` (or, lacking an index, any `*.safetensors`).
//! Every tensor the graph needs is looked up by its key; each missing tensor,
//! wrong dtype, wrong shape, truncated tensor or unreadable file is one
//! [`Problem`] naming the tensor (or file). Tensors the graph does not use are
//! counted, not reported: real checkpoints carry extra layers (e.g. MTP).

mod safetensors;

pub use safetensors::{dtype_size, read_header, Header, TensorInfo};

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::path::{Path, PathBuf};

use crate::diag::{Error, ErrorKind, Result};
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
}

impl GpuLayout {
    /// The runtime's name for it (`mkc::WeightLayout`).
    pub fn cpp_name(self) -> &'static str {
        match self {
            GpuLayout::AsStored => "kAsStored",
            GpuLayout::MxCodes => "kMxCodes",
            GpuLayout::MxScales => "kMxScales",
        }
    }
}

/// Something wrong with the checkpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Problem {
    /// A needed tensor is not in the checkpoint.
    Missing {
        /// What was needed.
        need: Requirement,
    },
    /// A tensor has the wrong shape.
    Shape {
        /// What was needed.
        need: Requirement,
        /// What the checkpoint has.
        found: Vec<u64>,
        /// The file it is in.
        file: String,
    },
    /// A tensor has the wrong dtype.
    DType {
        /// What was needed.
        need: Requirement,
        /// What the checkpoint has.
        found: String,
        /// The file it is in.
        file: String,
    },
    /// A tensor's bytes run past the end of its file, or disagree with its shape.
    Truncated {
        /// The tensor's key.
        key: String,
        /// The file.
        file: String,
        /// What is wrong.
        detail: String,
    },
    /// A shard or the index cannot be read.
    File {
        /// The file.
        file: String,
        /// What is wrong.
        detail: String,
    },
}

fn dims(s: &[u64]) -> String {
    format!("[{}]", s.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(", "))
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Problem::Missing { need } => {
                write!(f, "missing tensor {} ({} {}, read by {})", need.key, need.dtype, dims(&need.shape), need.node)
            }
            Problem::Shape { need, found, file } => write!(
                f,
                "wrong shape for {}: {} in {file}, the graph needs {} (read by {})",
                need.key,
                dims(found),
                dims(&need.shape),
                need.node
            ),
            Problem::DType { need, found, file } => write!(
                f,
                "wrong dtype for {}: {found} in {file}, the graph needs {} (read by {})",
                need.key, need.dtype, need.node
            ),
            Problem::Truncated { key, file, detail } => write!(f, "truncated tensor {key} in {file}: {detail}"),
            Problem::File { file, detail } => write!(f, "unreadable file {file}: {detail}"),
        }
    }
}

/// The outcome of a check.
#[derive(Debug, Clone)]
pub struct Report {
    /// The files read.
    pub files: Vec<String>,
    /// Tensors in the checkpoint.
    pub tensors: u64,
    /// Tensors the graph needs.
    pub required: u64,
    /// Tensors present but not used by the graph.
    pub unused: u64,
    /// Everything wrong, one per tensor or file.
    pub problems: Vec<Problem>,
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

/// True if a tensor stored as `found` can be loaded where `need` is declared:
/// the same dtype, or an f32 declaration stored as bf16 or f16, which the
/// runtime widens exactly on upload (small fp32 parameters such as `A_log`,
/// `dt_bias` or a router bias are often saved in the checkpoint's dtype).
pub fn accepts(need: &str, found: &str) -> bool {
    need == found || (need == "F32" && matches!(found, "BF16" | "F16"))
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

fn io(msg: String) -> Error {
    Error::new(ErrorKind::Io, msg)
}

/// The shard files of a checkpoint directory and, with an index, which file
/// each tensor should be in.
/// Shard files, and the index's tensor-to-file map if there is one.
type Shards = (Vec<PathBuf>, Option<BTreeMap<String, String>>);

fn shards(dir: &Path) -> Result<Shards> {
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        let text = crate::files::read_input(&index, crate::files::Input::Index)?;
        let v: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| Error::new(ErrorKind::Checkpoint, format!("{} is not valid JSON: {e}", index.display())))?;
        let Some(map) = v.get("weight_map").and_then(|m| m.as_object()) else {
            return Err(Error::new(ErrorKind::Checkpoint, format!("{} has no `weight_map` object", index.display())));
        };
        let mut weight_map = BTreeMap::new();
        for (k, f) in map {
            let Some(f) = f.as_str() else {
                return Err(Error::new(
                    ErrorKind::Checkpoint,
                    format!("{}: weight_map[{k}] is not a file name", index.display()),
                ));
            };
            if f.contains('/') || f.contains('\\') || f.starts_with('.') {
                return Err(Error::new(
                    ErrorKind::Checkpoint,
                    format!("{}: weight_map[{k}] names a file outside the directory: {f}", index.display()),
                ));
            }
            weight_map.insert(k.clone(), f.to_string());
        }
        let mut files: Vec<PathBuf> = weight_map.values().map(|f| dir.join(f)).collect();
        files.sort();
        files.dedup();
        return Ok((files, Some(weight_map)));
    }
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| io(format!("cannot read checkpoint directory {}: {e}", dir.display())))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(Error::new(
            ErrorKind::Checkpoint,
            format!("{} holds no *.safetensors files and no model.safetensors.index.json", dir.display()),
        ));
    }
    Ok((files, None))
}

/// Checks the checkpoint in `dir` against `graph`.
pub fn check(dir: &Path, graph: &Validated) -> Result<Report> {
    let reqs = requirements(graph);
    let (files, index) = shards(dir)?;
    let mut problems = Vec::new();
    let mut found: HashMap<String, (TensorInfo, String)> = HashMap::new();
    let mut names = Vec::new();
    for path in &files {
        let file = path.file_name().map_or_else(|| path.display().to_string(), |f| f.to_string_lossy().into_owned());
        names.push(file.clone());
        let header = match read_header(path) {
            Ok(h) => h,
            Err(detail) => {
                problems.push(Problem::File { file, detail });
                continue;
            }
        };
        for (key, info) in header.tensors {
            let (start, end) = info.offsets;
            let elements = info.shape.iter().fold(1u64, |a, d| a.saturating_mul(*d));
            let expect = dtype_size(&info.dtype).map(|s| (elements as f64 * s).ceil() as u64);
            if end > header.data_len || start > end {
                problems.push(Problem::Truncated {
                    key: key.clone(),
                    file: file.clone(),
                    detail: format!(
                        "its data ends at byte {end} of the data section, which holds {} bytes",
                        header.data_len
                    ),
                });
            } else if expect.is_some_and(|e| e != end - start) {
                problems.push(Problem::Truncated {
                    key: key.clone(),
                    file: file.clone(),
                    detail: format!(
                        "{} bytes for {} {} (needs {})",
                        end - start,
                        info.dtype,
                        dims(&info.shape),
                        expect.unwrap_or(0)
                    ),
                });
            }
            found.insert(key, (info, file.clone()));
        }
    }
    let shard_unreadable = |key: &str| -> bool {
        index
            .as_ref()
            .and_then(|m| m.get(key))
            .is_some_and(|f| problems.iter().any(|p| matches!(p, Problem::File { file, .. } if file == f)))
    };
    let mut extra = Vec::new();
    for need in &reqs {
        match found.get(&need.key) {
            None => {
                if !shard_unreadable(&need.key) {
                    extra.push(Problem::Missing { need: need.clone() });
                }
            }
            Some((info, file)) => {
                if !accepts(need.dtype, &info.dtype) {
                    extra.push(Problem::DType { need: need.clone(), found: info.dtype.clone(), file: file.clone() });
                } else if info.shape != need.shape {
                    extra.push(Problem::Shape { need: need.clone(), found: info.shape.clone(), file: file.clone() });
                }
            }
        }
    }
    problems.extend(extra);
    let needed: std::collections::HashSet<&str> = reqs.iter().map(|r| r.key.as_str()).collect();
    let unused = found.keys().filter(|k| !needed.contains(k.as_str())).count() as u64;
    Ok(Report { files: names, tensors: found.len() as u64, required: reqs.len() as u64, unused, problems })
}
