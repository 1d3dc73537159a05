//! Reading a safetensors file's header (never the tensor data) and checking
//! that it describes the file.
//!
//! A safetensors file is an 8-byte little-endian header length, a JSON header
//! mapping each tensor to `{dtype, shape, data_offsets}` (and an optional
//! `__metadata__` object of strings), and the data section. The format asks
//! that the tensors cover the data section exactly: no two overlap, and no
//! byte belongs to none (so a file cannot hide other contents between its
//! tensors). The order of the header's keys does not matter. A header that
//! breaks a rule makes the whole file unreadable, with a detail naming the
//! tensor; a file shorter than its header's data is not a header error: each
//! tensor cut off is named by the caller ([`Header::truncated`]).
//! docs/check.md lists every rule and message; the runtime's reader
//! (runtime/src/checkpoint.cpp) applies the same ones.

use std::collections::BTreeMap;
use std::path::Path;

use super::json::{self, Value};
use super::open::{open_regular, read_exact};
use super::problem::dims;

/// Largest header accepted (real headers of 1T-parameter shards are a few MB).
pub const MAX_HEADER: u64 = 256 << 20;

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

/// A file's header and how many data bytes the file really holds.
#[derive(Debug, Clone)]
pub struct Header {
    /// Tensors by name.
    pub tensors: BTreeMap<String, TensorInfo>,
    /// Bytes after the header.
    pub data_len: u64,
}

impl Header {
    /// The tensors whose data runs past the end of the file, with where it ends.
    pub fn truncated(&self) -> impl Iterator<Item = (&String, u64)> + '_ {
        self.tensors.iter().filter(|(_, t)| t.offsets.1 > self.data_len).map(|(k, t)| (k, t.offsets.1))
    }
}

/// Bits per element of a safetensors dtype, if known.
pub fn dtype_bits(dtype: &str) -> Option<u64> {
    Some(match dtype {
        "F64" | "I64" | "U64" => 64,
        "F32" | "I32" | "U32" => 32,
        "F16" | "BF16" | "I16" | "U16" => 16,
        "F8_E4M3" | "F8_E5M2" | "F8_E8M0" | "U8" | "I8" | "BOOL" => 8,
        "F4" => 4,
        _ => return None,
    })
}

/// Bytes per element of a safetensors dtype, if known.
pub fn dtype_size(dtype: &str) -> Option<f64> {
    dtype_bits(dtype).map(|b| b as f64 / 8.0)
}

/// Bytes of a tensor of `shape` with `bits`-bit elements (F4 packs two to a
/// byte, rounding up), or `None` where the element count, multiplied left to
/// right, or the byte count passes 2^64 - 1.
pub fn byte_size(shape: &[u64], bits: u64) -> Option<u64> {
    let elements = shape.iter().try_fold(1u64, |a, d| a.checked_mul(*d))?;
    if bits >= 8 {
        elements.checked_mul(bits / 8)
    } else {
        Some(elements.div_ceil(8 / bits))
    }
}

/// Reads and checks the header of the safetensors file at `path`.
pub fn read_header(path: &Path) -> Result<Header, String> {
    let (mut f, file_len) = open_regular(path).map_err(|e| e.message())?;
    if file_len < 8 {
        return Err(format!("truncated: {file_len} bytes, shorter than the 8-byte header length"));
    }
    let mut len = [0u8; 8];
    read_exact(&mut f, &mut len)?;
    let n = u64::from_le_bytes(len);
    if n > MAX_HEADER {
        return Err(format!("header length {n} is implausible (over {MAX_HEADER} bytes)"));
    }
    if 8 + n > file_len {
        return Err(format!("truncated: the header needs {} bytes but the file has {file_len}", 8 + n));
    }
    let mut buf = vec![0u8; n as usize];
    read_exact(&mut f, &mut buf)?;
    let data_len = file_len - 8 - n;
    let Value::Object(raw) = json::parse(&buf).map_err(|e| format!("the header is not valid JSON: {e}"))? else {
        return Err("the header is not a JSON object".into());
    };
    let mut tensors = BTreeMap::new();
    for (name, v) in raw {
        if name == "__metadata__" {
            let strings = matches!(&v, Value::Object(m) if m.values().all(|x| matches!(x, Value::String(_))));
            if !strings {
                return Err("__metadata__ is not an object of strings".into());
            }
            continue;
        }
        let info = entry(&v).map_err(|e| format!("tensor {name}: {e}"))?;
        tensors.insert(name, info);
    }
    check_layout(&tensors, data_len)?;
    Ok(Header { tensors, data_len })
}

/// `field` as a 64-bit unsigned integer.
fn integer(v: &Value, field: &str) -> Result<u64, String> {
    v.as_u64().map_err(|e| match v {
        Value::Number(text) => format!("{field} {e}: {text}"),
        _ => format!("{field} {e}"),
    })
}

/// One tensor's entry: exactly `dtype`, `shape` and `data_offsets`, their
/// byte count matching.
fn entry(v: &Value) -> Result<TensorInfo, String> {
    let Value::Object(m) = v else { return Err("the entry is not an object".into()) };
    if let Some(k) = m.keys().find(|k| !matches!(k.as_str(), "dtype" | "shape" | "data_offsets")) {
        return Err(format!("unknown field {k}"));
    }
    let dtype = match m.get("dtype") {
        None => return Err("no dtype".into()),
        Some(Value::String(s)) => s.clone(),
        Some(_) => return Err("dtype is not a string".into()),
    };
    let bits = dtype_bits(&dtype).ok_or_else(|| format!("unknown dtype {dtype}"))?;
    let shape = match m.get("shape") {
        None => return Err("no shape".into()),
        Some(Value::Array(a)) => {
            a.iter().enumerate().map(|(i, d)| integer(d, &format!("shape[{i}]"))).collect::<Result<Vec<_>, _>>()?
        }
        Some(_) => return Err("shape is not an array".into()),
    };
    let (begin, end) = match m.get("data_offsets") {
        None => return Err("no data_offsets".into()),
        Some(Value::Array(a)) if a.len() == 2 => {
            (integer(&a[0], "data_offsets[0]")?, integer(&a[1], "data_offsets[1]")?)
        }
        Some(_) => return Err("data_offsets is not a pair".into()),
    };
    if begin > end {
        return Err(format!("data_offsets run backwards: {begin} > {end}"));
    }
    let bytes = byte_size(&shape, bits).ok_or_else(|| format!("{dtype} {} is larger than 2^64 bytes", dims(&shape)))?;
    if end - begin != bytes {
        return Err(format!("data_offsets hold {} bytes, {dtype} {} needs {bytes}", end - begin, dims(&shape)));
    }
    Ok(TensorInfo { dtype, shape, offsets: (begin, end) })
}

/// The tensors, in order of their offsets, must cover the data section from
/// byte 0 without overlap or gap, up to the last tensor's end; bytes after it
/// are refused only if the file holds them (a shorter file is truncation).
fn check_layout(tensors: &BTreeMap<String, TensorInfo>, data_len: u64) -> Result<(), String> {
    let mut order: Vec<(&String, &TensorInfo)> = tensors.iter().collect();
    order.sort_by_key(|(k, t)| (t.offsets, *k));
    let mut end = 0;
    let mut last: Option<&String> = None;
    for (k, t) in order {
        let begin = t.offsets.0;
        if let (true, Some(prev)) = (begin < end, last) {
            return Err(format!(
                "tensors {prev} and {k} overlap: {prev} ends at byte {end}, {k} begins at byte {begin}"
            ));
        }
        if begin > end {
            return Err(format!("bytes {end}..{begin} of the data section belong to no tensor (a gap before {k})"));
        }
        end = t.offsets.1;
        last = Some(k);
    }
    if end < data_len {
        return Err(format!("bytes {end}..{data_len} of the data section belong to no tensor"));
    }
    Ok(())
}
