//! Element types and tensor types of the op graph.

use serde::Serialize;
use std::fmt;

/// An element type, as stored in a checkpoint or in device memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, PartialOrd, Ord)]
#[serde(rename_all = "snake_case")]
pub enum DType {
    /// bfloat16.
    Bf16,
    /// IEEE half.
    F16,
    /// IEEE single.
    F32,
    /// 32-bit signed integer.
    I32,
    /// 64-bit signed integer.
    I64,
    /// Unsigned byte.
    U8,
    /// FP8 e4m3 with one f32 scale per 128x128 block (`weight_scale_inv`), as
    /// DeepSeek-V3 and Kimi K2 checkpoints store their projections.
    Fp8E4m3,
    /// MXFP4: e2m1 values packed two per byte along K, one e8m0 scale byte per
    /// 32 values of a row, as K3 stores its routed experts.
    Mxfp4,
}

impl DType {
    /// All dtypes, in the order the language lists them.
    pub const ALL: [DType; 8] =
        [DType::Bf16, DType::F16, DType::F32, DType::I32, DType::I64, DType::U8, DType::Fp8E4m3, DType::Mxfp4];

    /// The name used in graph files.
    pub fn name(self) -> &'static str {
        match self {
            DType::Bf16 => "bf16",
            DType::F16 => "f16",
            DType::F32 => "f32",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::U8 => "u8",
            DType::Fp8E4m3 => "fp8e4m3",
            DType::Mxfp4 => "mxfp4",
        }
    }

    /// Looks a dtype up by its graph-file name.
    pub fn from_name(name: &str) -> Option<DType> {
        DType::ALL.into_iter().find(|d| d.name() == name)
    }

    /// True for the block-scaled formats, whose weights carry a scale tensor.
    pub fn is_block_scaled(self) -> bool {
        matches!(self, DType::Fp8E4m3 | DType::Mxfp4)
    }

    /// True for floating-point element types (quantized ones included).
    pub fn is_float(self) -> bool {
        !matches!(self, DType::I32 | DType::I64 | DType::U8)
    }

    /// Bytes of `elements` values of a tensor whose rows are `row_len` long,
    /// scales included. Rows matter only for the block-scaled formats.
    pub fn bytes(self, rows: u64, row_len: u64) -> u64 {
        let elements = rows * row_len;
        match self {
            DType::Bf16 | DType::F16 => 2 * elements,
            DType::F32 | DType::I32 => 4 * elements,
            DType::I64 => 8 * elements,
            DType::U8 => elements,
            DType::Fp8E4m3 => elements + 4 * rows.div_ceil(128) * row_len.div_ceil(128),
            DType::Mxfp4 => elements / 2 + rows * row_len.div_ceil(32),
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The size written for a state's context dimension inside a [`TensorType`];
/// it prints as `ctx`. States' real sizes live in [`super::State`].
pub const CTX: u64 = u64::MAX;

/// The largest context a plan is made for (`--context`): 16M tokens.
/// Lowering bounds a state's elements with its `ctx` dimension at this size,
/// so every per-sequence size stays far from 64-bit overflow.
pub const MAX_CONTEXT: u64 = 1 << 24;

/// A concrete tensor type. Activations are typed per token (the batch
/// dimension is implicit); states per sequence; weights as stored.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize)]
pub struct TensorType {
    /// Element type.
    pub dtype: DType,
    /// Dimensions, outermost first.
    pub shape: Vec<u64>,
}

impl TensorType {
    /// A tensor type.
    pub fn new(dtype: DType, shape: Vec<u64>) -> Self {
        TensorType { dtype, shape }
    }

    /// Number of elements.
    pub fn elements(&self) -> u64 {
        self.shape.iter().fold(1u64, |a, d| a.saturating_mul(*d))
    }

    /// Size of the last dimension (1 for a scalar).
    pub fn row_len(&self) -> u64 {
        self.shape.last().copied().unwrap_or(1)
    }

    /// Bytes this tensor occupies, scales included.
    pub fn bytes(&self) -> u64 {
        let row_len = self.row_len();
        let rows = self.elements().checked_div(row_len).unwrap_or(0);
        self.dtype.bytes(rows, row_len)
    }
}

impl fmt::Display for TensorType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}[", self.dtype)?;
        for (i, d) in self.shape.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            if *d == CTX {
                f.write_str("ctx")?;
            } else {
                write!(f, "{d}")?;
            }
        }
        f.write_str("]")
    }
}
