//! Reading safetensors headers (never the tensor data).
//!
//! A safetensors file is an 8-byte little-endian header length, a JSON header
//! mapping each tensor to `{dtype, shape, data_offsets}`, and the data. We
//! read the header and the file's length, which is enough to find missing,
//! mis-shaped, mis-typed and truncated tensors.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::Path;

use serde::Deserialize;

/// Largest header accepted (real headers of 1T-parameter shards are a few MB).
const MAX_HEADER: u64 = 256 << 20;

/// One tensor's entry in a header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    /// Safetensors dtype name (`BF16`, `F32`, `F8_E4M3`, `U8`, ...).
    pub dtype: String,
    /// Its shape.
    pub shape: Vec<u64>,
    /// Byte range in the data section.
    pub offsets: (u64, u64),
}

#[derive(Deserialize)]
struct RawInfo {
    dtype: String,
    shape: Vec<u64>,
    data_offsets: (u64, u64),
}

/// A file's header and how many data bytes the file really holds.
#[derive(Debug, Clone)]
pub struct Header {
    /// Tensors by name.
    pub tensors: BTreeMap<String, TensorInfo>,
    /// Bytes after the header.
    pub data_len: u64,
}

/// Bytes per element of a safetensors dtype, if known.
pub fn dtype_size(dtype: &str) -> Option<f64> {
    Some(match dtype {
        "F64" | "I64" | "U64" => 8.0,
        "F32" | "I32" | "U32" => 4.0,
        "F16" | "BF16" | "I16" | "U16" => 2.0,
        "F8_E4M3" | "F8_E5M2" | "F8_E8M0" | "U8" | "I8" | "BOOL" => 1.0,
        "F4" => 0.5,
        _ => return None,
    })
}

/// Reads the header of the safetensors file at `path`.
pub fn read_header(path: &Path) -> Result<Header, String> {
    let mut f = std::fs::File::open(path).map_err(|e| format!("cannot open: {e}"))?;
    let file_len = f.metadata().map_err(|e| format!("cannot stat: {e}"))?.len();
    let mut len = [0u8; 8];
    f.read_exact(&mut len)
        .map_err(|_| format!("truncated: {file_len} bytes, shorter than the 8-byte header length"))?;
    let n = u64::from_le_bytes(len);
    if n > MAX_HEADER {
        return Err(format!("header length {n} is implausible (over {MAX_HEADER} bytes)"));
    }
    if 8 + n > file_len {
        return Err(format!("truncated: the header needs {} bytes but the file has {file_len}", 8 + n));
    }
    let mut buf = vec![0u8; n as usize];
    f.read_exact(&mut buf).map_err(|e| format!("cannot read the header: {e}"))?;
    let raw: BTreeMap<String, serde_json::Value> =
        serde_json::from_slice(&buf).map_err(|e| format!("the header is not valid JSON: {e}"))?;
    let mut tensors = BTreeMap::new();
    for (name, v) in raw {
        if name == "__metadata__" {
            continue;
        }
        let info: RawInfo = serde_json::from_value(v).map_err(|e| format!("tensor {name}: bad header entry: {e}"))?;
        tensors.insert(name, TensorInfo { dtype: info.dtype, shape: info.shape, offsets: info.data_offsets });
    }
    Ok(Header { tensors, data_len: file_len - 8 - n })
}
