//! What can be wrong with a checkpoint, one [`Problem`] per tensor or file,
//! each naming it. The runtime prints the same lines (runtime/src/checkpoint.cpp).

use std::fmt;

use super::requirement::Requirement;

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
    /// A tensor's bytes run past the end of its file.
    Truncated {
        /// The tensor's key.
        key: String,
        /// The file.
        file: String,
        /// What is wrong.
        detail: String,
    },
    /// A tensor is in two shards of a checkpoint (which one holds it is not
    /// ours to guess).
    Duplicate {
        /// The tensor's key.
        key: String,
        /// The first file holding it (by name order).
        first: String,
        /// The other.
        second: String,
    },
    /// A shard cannot be read, or its header is malformed (the detail names
    /// the tensor where there is one); none of its tensors is used.
    File {
        /// The file.
        file: String,
        /// What is wrong.
        detail: String,
    },
}

/// `[a, b, ...]`.
pub fn dims(s: &[u64]) -> String {
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
            Problem::Duplicate { key, first, second } => {
                write!(f, "duplicate tensor {key}: in {first} and in {second}")
            }
            Problem::File { file, detail } => write!(f, "unreadable file {file}: {detail}"),
        }
    }
}
