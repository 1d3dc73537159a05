//! The op library: every op the language knows, its operands, attributes and
//! its shape and dtype rule. docs/ops.md gives each op's formula.
//!
//! Shapes are per token for activations (the batch dimension is implicit),
//! per sequence for states and as stored for weights. An expert family is
//! typed `[experts, rows, cols]`.

mod attrs;
mod rules;

pub use attrs::{AttrDef, AttrKind, AttrValue, Attrs};

use crate::ir::TensorType;
use serde::Serialize;

/// Which op a node runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OpKind {
    /// Row lookup of the token id.
    Embedding,
    /// RMS normalisation (per group of the weight's length).
    RmsNorm,
    /// RMS normalisation times an activated gate.
    GatedRmsNorm,
    /// L2 normalisation per group.
    L2Norm,
    /// `y = x W^T`.
    Linear,
    /// Element-wise sum.
    Add,
    /// Element-wise product.
    Mul,
    /// `x sigmoid(x)`.
    Silu,
    /// Logistic sigmoid.
    Sigmoid,
    /// `log(1 + e^x)`.
    Softplus,
    /// K3's soft-capped SiLU, `b tanh(x/b) sigmoid(x)`.
    Situ,
    /// `act(gate) * up` (with SiTU's capped linear branch).
    ActAndMul,
    /// Rotary position embedding of the current position.
    Rope,
    /// Short causal depthwise convolution of the new token against its state.
    ConvUpdate,
    /// Weight-absorbed MLA decode over the latent cache (appends this token).
    MlaDecode,
    /// Kimi delta attention: gated delta-rule update of the per-head state.
    KdaDecode,
    /// MoE router: scores, correction bias, group-limited top-k, weights.
    Router,
    /// Routed experts: dispatch by the router's ids, expert MLPs, weighted sum.
    Moe,
    /// Block attention-residual mix of the current stream with the bank.
    AttnResMix,
    /// Appends a row to a bank of snapshots.
    Stack,
    /// Splits a vector into consecutive pieces.
    Split,
    /// Final projection to vocabulary logits.
    LmHead,
    /// Index of the largest logit (greedy decoding).
    Argmax,
}

/// One operand in an op's signature.
#[derive(Debug, Clone, Copy)]
pub struct OperandDef {
    /// Its name in docs and diagnostics.
    pub name: &'static str,
    /// May be left out (only trailing operands).
    pub optional: bool,
    /// A state the op reads and writes in place.
    pub state: bool,
}

/// The shape and dtype rule: operand types (absent optionals are `None`) and
/// attributes to output types, or a sentence saying what does not fit.
pub type InferFn = fn(&Attrs, &[Option<&TensorType>]) -> Result<Vec<TensorType>, String>;

/// An op's definition.
#[derive(Debug, Clone, Copy)]
pub struct OpDef {
    /// Which op.
    pub kind: OpKind,
    /// Its name in graph files.
    pub name: &'static str,
    /// Operands, in order.
    pub operands: &'static [OperandDef],
    /// Attributes.
    pub attrs: &'static [AttrDef],
    /// Number of outputs.
    pub outputs: usize,
    /// The shape and dtype rule.
    pub infer: InferFn,
}

impl OpKind {
    /// The op's definition.
    pub fn def(self) -> &'static OpDef {
        rules::LIBRARY.iter().find(|d| d.kind == self).expect("every op has a definition")
    }

    /// The op's name in graph files.
    pub fn name(self) -> &'static str {
        self.def().name
    }
}

/// Looks an op up by its graph-file name.
pub fn lookup(name: &str) -> Option<&'static OpDef> {
    rules::LIBRARY.iter().find(|d| d.name == name)
}

/// Every op, in library order.
pub fn library() -> &'static [OpDef] {
    rules::LIBRARY
}
