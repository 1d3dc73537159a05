//! Checking a Hugging Face checkpoint directory against a validated graph.
//!
//! The directory holds `model.safetensors`, or shards listed by
//! `model.safetensors.index.json` (or, lacking an index, any `*.safetensors`).
//! [`Checkpoint::open`] reads every shard's header ([`safetensors`]) and
//! records what is wrong with the files; [`check`] then looks every tensor
//! the graph needs up by its key. Each missing tensor, wrong dtype, wrong
//! shape, truncated tensor, tensor in two shards or unreadable file is one
//! [`Problem`] naming the tensor (or file). Tensors the graph does not use
//! are counted, not reported: real checkpoints carry extra layers (e.g. MTP).
//!
//! The runtime's reader (runtime/src/checkpoint.cpp) follows the same rules
//! with the same messages; docs/check.md lists them, and
//! tests/fixtures/hostile_checkpoints holds the cases both are run over.

mod index;
pub mod json;
mod open;
mod problem;
mod requirement;
mod safetensors;

pub use index::{INDEX, MAX_INDEX};
pub use problem::Problem;
pub use requirement::{read_as_bf16, requirements, weight_groups, GpuLayout, Requirement, WeightGroup};
pub use safetensors::{byte_size, dtype_bits, dtype_size, read_header, Header, TensorInfo, MAX_HEADER};

use std::collections::{BTreeMap, HashSet};
use std::path::Path;

use crate::diag::Result;
use crate::valid::Validated;

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

/// True if a tensor stored as `found` can be loaded where `need` is declared:
/// the same dtype, or an f32 declaration stored as bf16 or f16, which the
/// runtime widens exactly on upload (small fp32 parameters such as `A_log`,
/// `dt_bias` or a router bias are often saved in the checkpoint's dtype).
pub fn accepts(need: &str, found: &str) -> bool {
    need == found || (need == "F32" && matches!(found, "BF16" | "F16"))
}

/// A checkpoint directory's headers, read and checked.
#[derive(Debug, Clone)]
pub struct Checkpoint {
    /// The shard files' names, sorted.
    pub files: Vec<String>,
    /// Every tensor of a readable shard, with its file's name. A tensor in
    /// two shards is here once, from the first.
    pub tensors: BTreeMap<String, (TensorInfo, String)>,
    /// What is wrong with the files, in file order: an unreadable file, or
    /// its truncated tensors, then the tensors it shares with an earlier file.
    pub problems: Vec<Problem>,
    /// The index's tensor-to-file map, if there is an index.
    pub index: Option<BTreeMap<String, String>>,
}

impl Checkpoint {
    /// Reads the headers of the checkpoint in `dir`. A broken index, or a
    /// directory with neither index nor shards, is an error; a broken shard
    /// is a problem of the result.
    pub fn open(dir: &Path) -> Result<Checkpoint> {
        let (paths, index) = index::shards(dir)?;
        let mut ckpt = Checkpoint { files: Vec::new(), tensors: BTreeMap::new(), problems: Vec::new(), index };
        for path in &paths {
            let file =
                path.file_name().map_or_else(|| path.display().to_string(), |f| f.to_string_lossy().into_owned());
            ckpt.files.push(file.clone());
            let header = match read_header(path) {
                Ok(h) => h,
                Err(detail) => {
                    ckpt.problems.push(Problem::File { file, detail });
                    continue;
                }
            };
            for (key, end) in header.truncated() {
                ckpt.problems.push(Problem::Truncated {
                    key: key.clone(),
                    file: file.clone(),
                    detail: format!(
                        "its data ends at byte {end} of the data section, which holds {} bytes",
                        header.data_len
                    ),
                });
            }
            for (key, info) in header.tensors {
                match ckpt.tensors.get(&key) {
                    Some((_, first)) => {
                        ckpt.problems.push(Problem::Duplicate { key, first: first.clone(), second: file.clone() })
                    }
                    None => {
                        ckpt.tensors.insert(key, (info, file.clone()));
                    }
                }
            }
        }
        Ok(ckpt)
    }

    /// True if the index puts `key` in a shard that could not be read (its
    /// one line covers the tensor).
    fn in_unreadable_shard(&self, key: &str) -> bool {
        self.index
            .as_ref()
            .and_then(|m| m.get(key))
            .is_some_and(|f| self.problems.iter().any(|p| matches!(p, Problem::File { file, .. } if file == f)))
    }
}

/// Checks the checkpoint in `dir` against `graph`.
pub fn check(dir: &Path, graph: &Validated) -> Result<Report> {
    let reqs = requirements(graph);
    let ckpt = Checkpoint::open(dir)?;
    let mut problems = ckpt.problems.clone();
    for need in &reqs {
        match ckpt.tensors.get(&need.key) {
            None if ckpt.in_unreadable_shard(&need.key) => {}
            None => problems.push(Problem::Missing { need: need.clone() }),
            Some((info, file)) if !accepts(need.dtype, &info.dtype) => {
                problems.push(Problem::DType { need: need.clone(), found: info.dtype.clone(), file: file.clone() })
            }
            Some((info, file)) if info.shape != need.shape => {
                problems.push(Problem::Shape { need: need.clone(), found: info.shape.clone(), file: file.clone() })
            }
            Some(_) => {}
        }
    }
    let needed: HashSet<&str> = reqs.iter().map(|r| r.key.as_str()).collect();
    let unused = ckpt.tensors.keys().filter(|k| !needed.contains(k.as_str())).count() as u64;
    Ok(Report { files: ckpt.files, tensors: ckpt.tensors.len() as u64, required: reqs.len() as u64, unused, problems })
}
