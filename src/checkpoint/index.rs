//! Which files a checkpoint directory's tensors are in: the shards listed by
//! `model.safetensors.index.json`, or, without one, every `*.safetensors`.
//!
//! The index is opened like a shard (a FIFO or other non-regular file is
//! refused at once), is at most [`MAX_INDEX`] bytes and is read with the
//! strict JSON reader. Its `weight_map` must name plain files of the
//! directory. A problem with the index is an error for the whole checkpoint;
//! a problem with a shard is the caller's, one per file.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use super::json::{self, Value};
use super::open::{open_regular, os_message, read_exact, OpenError};
use crate::diag::{Error, ErrorKind, Result};

/// The index's file name.
pub const INDEX: &str = "model.safetensors.index.json";

/// Largest index accepted (the index of a 500,000-tensor checkpoint is about 45 MB).
pub const MAX_INDEX: u64 = 256 << 20;

/// Shard files, and the index's tensor-to-file map if there is one.
pub type Shards = (Vec<PathBuf>, Option<BTreeMap<String, String>>);

fn refuse(msg: String) -> Error {
    Error::new(ErrorKind::Checkpoint, msg)
}

/// The shards of the checkpoint in `dir`, sorted by name.
pub fn shards(dir: &Path) -> Result<Shards> {
    let index = dir.join(INDEX);
    let shown = index.display();
    let (mut f, len) = match open_regular(&index) {
        Err(OpenError::NotFound) => return unindexed(dir),
        Err(OpenError::Other(e)) => return Err(refuse(format!("{shown}: {e}"))),
        Ok(opened) => opened,
    };
    if len > MAX_INDEX {
        return Err(refuse(format!("{shown}: {len} bytes, over the limit of {MAX_INDEX}")));
    }
    let mut text = vec![0u8; len as usize];
    read_exact(&mut f, &mut text).map_err(|e| refuse(format!("{shown}: {e}")))?;
    let v = json::parse(&text).map_err(|e| refuse(format!("{shown} is not valid JSON: {e}")))?;
    let Some(Value::Object(map)) = (match &v {
        Value::Object(top) => top.get("weight_map"),
        _ => None,
    }) else {
        return Err(refuse(format!("{shown} has no `weight_map` object")));
    };
    let mut weight_map = BTreeMap::new();
    for (k, f) in map {
        let Value::String(f) = f else {
            return Err(refuse(format!("{shown}: weight_map[{k}] is not a file name")));
        };
        if f.is_empty() || f.contains(['/', '\\', '\0']) || f.starts_with('.') {
            return Err(refuse(format!("{shown}: weight_map[{k}] names a file outside the directory: {f}")));
        }
        weight_map.insert(k.clone(), f.clone());
    }
    let mut files: Vec<PathBuf> = weight_map.values().map(|f| dir.join(f)).collect();
    files.sort();
    files.dedup();
    Ok((files, Some(weight_map)))
}

fn unindexed(dir: &Path) -> Result<Shards> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| {
            Error::new(ErrorKind::Io, format!("cannot read checkpoint directory {}: {}", dir.display(), os_message(&e)))
        })?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(refuse(format!(
            "{} holds no *.safetensors files and no model.safetensors.index.json",
            dir.display()
        )));
    }
    Ok((files, None))
}
