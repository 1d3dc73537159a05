//! The op library's table: signatures and shape/dtype rules.

use super::{AttrDef, AttrKind, AttrValue, Attrs, OpDef, OpKind, OperandDef};
use crate::ir::{DType, TensorType};

type R = Result<Vec<TensorType>, String>;
type Ops<'a> = [Option<&'a TensorType>];

const fn req(name: &'static str) -> OperandDef {
    OperandDef { name, optional: false, state: false }
}
const fn opt(name: &'static str) -> OperandDef {
    OperandDef { name, optional: true, state: false }
}
const fn state(name: &'static str) -> OperandDef {
    OperandDef { name, optional: false, state: true }
}
const fn required(name: &'static str, kind: AttrKind) -> AttrDef {
    AttrDef { name, kind, default: None }
}
const fn defaulted(name: &'static str, kind: AttrKind, default: fn() -> AttrValue) -> AttrDef {
    AttrDef { name, kind, default: Some(default) }
}

const ACTS: &[&str] = &["silu", "situ"];
const NORM_ACTS: &[&str] = &["sigmoid", "silu"];
const ROPE_STYLES: &[&str] = &["interleaved", "neox", "none"];
const CONV_ACTS: &[&str] = &["silu", "none"];
const KDA_GATES: &[&str] = &["softplus", "safe"];
const SCORING: &[&str] = &["sigmoid", "softmax"];

fn eps_1e6() -> AttrValue {
    AttrValue::Float(1e-6)
}
fn one() -> AttrValue {
    AttrValue::Float(1.0)
}
fn one_int() -> AttrValue {
    AttrValue::Int(1)
}
fn bf16() -> AttrValue {
    AttrValue::DType(DType::Bf16)
}
fn yes() -> AttrValue {
    AttrValue::Bool(true)
}
fn situ_beta() -> AttrValue {
    AttrValue::Float(4.0)
}
fn no_linear_beta() -> AttrValue {
    AttrValue::Float(0.0)
}
fn sigmoid() -> AttrValue {
    AttrValue::Str("sigmoid".into())
}
fn silu() -> AttrValue {
    AttrValue::Str("silu".into())
}
fn theta() -> AttrValue {
    AttrValue::Float(10000.0)
}
fn zero() -> AttrValue {
    AttrValue::Float(0.0)
}
fn yarn_original_max() -> AttrValue {
    AttrValue::Int(4096)
}
fn yarn_beta_fast() -> AttrValue {
    AttrValue::Float(32.0)
}
fn lower_bound() -> AttrValue {
    AttrValue::Float(-5.0)
}

/// Every op the language knows.
pub static LIBRARY: &[OpDef] = &[
    OpDef {
        kind: OpKind::Embedding,
        name: "embedding",
        operands: &[req("token"), req("table")],
        attrs: &[],
        outputs: 1,
        infer: embedding,
    },
    OpDef {
        kind: OpKind::RmsNorm,
        name: "rms_norm",
        operands: &[req("x"), req("weight")],
        attrs: &[defaulted("eps", AttrKind::Float, eps_1e6), defaulted("out", AttrKind::DType, bf16)],
        outputs: 1,
        infer: rms_norm,
    },
    OpDef {
        kind: OpKind::GatedRmsNorm,
        name: "gated_rms_norm",
        operands: &[req("x"), req("gate"), req("weight")],
        attrs: &[defaulted("eps", AttrKind::Float, eps_1e6), defaulted("act", AttrKind::Choice(NORM_ACTS), sigmoid)],
        outputs: 1,
        infer: gated_rms_norm,
    },
    OpDef {
        kind: OpKind::L2Norm,
        name: "l2_norm",
        operands: &[req("x")],
        attrs: &[required("group", AttrKind::Int), defaulted("eps", AttrKind::Float, eps_1e6)],
        outputs: 1,
        infer: l2_norm,
    },
    OpDef {
        kind: OpKind::Linear,
        name: "linear",
        operands: &[req("x"), req("weight")],
        attrs: &[defaulted("out", AttrKind::DType, bf16)],
        outputs: 1,
        infer: linear,
    },
    OpDef {
        kind: OpKind::Add,
        name: "add",
        operands: &[req("a"), req("b")],
        attrs: &[],
        outputs: 1,
        infer: same_elementwise,
    },
    OpDef {
        kind: OpKind::Mul,
        name: "mul",
        operands: &[req("a"), req("b")],
        attrs: &[],
        outputs: 1,
        infer: same_elementwise,
    },
    OpDef { kind: OpKind::Silu, name: "silu", operands: &[req("x")], attrs: &[], outputs: 1, infer: unary },
    OpDef { kind: OpKind::Sigmoid, name: "sigmoid", operands: &[req("x")], attrs: &[], outputs: 1, infer: unary },
    OpDef { kind: OpKind::Softplus, name: "softplus", operands: &[req("x")], attrs: &[], outputs: 1, infer: unary },
    OpDef {
        kind: OpKind::Situ,
        name: "situ",
        operands: &[req("x")],
        attrs: &[defaulted("beta", AttrKind::Float, situ_beta)],
        outputs: 1,
        infer: unary,
    },
    OpDef {
        kind: OpKind::ActAndMul,
        name: "act_and_mul",
        operands: &[req("gate"), req("up")],
        attrs: &[
            defaulted("act", AttrKind::Choice(ACTS), silu),
            defaulted("beta", AttrKind::Float, situ_beta),
            defaulted("linear_beta", AttrKind::Float, no_linear_beta),
        ],
        outputs: 1,
        infer: same_elementwise,
    },
    OpDef {
        kind: OpKind::Rope,
        name: "rope",
        operands: &[req("x")],
        attrs: &[
            required("heads", AttrKind::Int),
            required("head_dim", AttrKind::Int),
            required("rot", AttrKind::Int),
            required("style", AttrKind::Choice(ROPE_STYLES)),
            defaulted("theta", AttrKind::Float, theta),
            defaulted("yarn_factor", AttrKind::Float, one),
            defaulted("yarn_original_max", AttrKind::Int, yarn_original_max),
            defaulted("yarn_beta_fast", AttrKind::Float, yarn_beta_fast),
            defaulted("yarn_beta_slow", AttrKind::Float, one),
            defaulted("yarn_mscale", AttrKind::Float, one),
            defaulted("yarn_mscale_all_dim", AttrKind::Float, zero),
        ],
        outputs: 1,
        infer: rope,
    },
    OpDef {
        kind: OpKind::ConvUpdate,
        name: "conv_update",
        operands: &[req("x"), req("weight"), state("conv_state")],
        attrs: &[defaulted("act", AttrKind::Choice(CONV_ACTS), silu)],
        outputs: 1,
        infer: conv_update,
    },
    OpDef {
        kind: OpKind::MlaDecode,
        name: "mla_decode",
        operands: &[req("q"), req("c_kv"), req("k_pe"), req("w_kv_b"), state("cache")],
        attrs: &[
            required("heads", AttrKind::Int),
            required("nope", AttrKind::Int),
            required("rope", AttrKind::Int),
            required("v_dim", AttrKind::Int),
            required("scale", AttrKind::Float),
        ],
        outputs: 1,
        infer: mla_decode,
    },
    OpDef {
        kind: OpKind::KdaDecode,
        name: "kda_decode",
        operands: &[
            req("q"),
            req("k"),
            req("v"),
            req("f"),
            req("beta"),
            req("a_log"),
            req("dt_bias"),
            state("recurrent_state"),
        ],
        attrs: &[
            required("heads", AttrKind::Int),
            required("head_dim", AttrKind::Int),
            required("gate", AttrKind::Choice(KDA_GATES)),
            defaulted("lower_bound", AttrKind::Float, lower_bound),
        ],
        outputs: 1,
        infer: kda_decode,
    },
    OpDef {
        kind: OpKind::Router,
        name: "router",
        operands: &[req("logits"), opt("bias")],
        attrs: &[
            required("top_k", AttrKind::Int),
            defaulted("scoring", AttrKind::Choice(SCORING), sigmoid),
            defaulted("n_group", AttrKind::Int, one_int),
            defaulted("topk_group", AttrKind::Int, one_int),
            defaulted("renormalize", AttrKind::Bool, yes),
            defaulted("scale", AttrKind::Float, one),
        ],
        outputs: 2,
        infer: router,
    },
    OpDef {
        kind: OpKind::Moe,
        name: "moe",
        operands: &[req("x"), req("ids"), req("weights"), req("w_gate"), req("w_up"), req("w_down")],
        attrs: &[
            defaulted("act", AttrKind::Choice(ACTS), silu),
            defaulted("beta", AttrKind::Float, situ_beta),
            defaulted("linear_beta", AttrKind::Float, no_linear_beta),
        ],
        outputs: 1,
        infer: moe,
    },
    OpDef {
        kind: OpKind::AttnResMix,
        name: "attn_res_mix",
        operands: &[req("x"), req("bank"), req("proj"), req("norm")],
        attrs: &[defaulted("eps", AttrKind::Float, eps_1e6)],
        outputs: 1,
        infer: attn_res_mix,
    },
    OpDef {
        kind: OpKind::Stack,
        name: "stack",
        operands: &[req("bank"), opt("row")],
        attrs: &[],
        outputs: 1,
        infer: stack,
    },
    OpDef {
        kind: OpKind::Split,
        name: "split",
        operands: &[req("x")],
        attrs: &[required("sizes", AttrKind::IntList)],
        outputs: 0,
        infer: split,
    },
    OpDef {
        kind: OpKind::LmHead,
        name: "lm_head",
        operands: &[req("x"), req("weight")],
        attrs: &[defaulted("logit_scale", AttrKind::Float, one)],
        outputs: 1,
        infer: lm_head,
    },
    OpDef { kind: OpKind::Argmax, name: "argmax", operands: &[req("logits")], attrs: &[], outputs: 1, infer: argmax },
];

// ---- helpers -----------------------------------------------------------------

fn get<'a>(ops: &Ops<'a>, i: usize) -> &'a TensorType {
    ops[i].expect("required operands are present")
}

fn vector(t: &TensorType, what: &str) -> Result<u64, String> {
    match t.shape.as_slice() {
        [n] => Ok(*n),
        _ => Err(format!("{what} must be a vector, found {t}")),
    }
}

fn float_act(t: &TensorType, what: &str) -> Result<(), String> {
    match t.dtype {
        DType::Bf16 | DType::F16 | DType::F32 => Ok(()),
        _ => Err(format!("{what} must be bf16, f16 or f32, found {t}")),
    }
}

fn dense_float(t: &TensorType, what: &str) -> Result<(), String> {
    float_act(t, what)
}

fn positive(attrs: &Attrs, name: &str) -> Result<u64, String> {
    let v = attrs.int(name);
    if v <= 0 {
        return Err(format!("`{name}` must be positive, found {v}"));
    }
    Ok(v as u64)
}

fn t(dtype: DType, shape: Vec<u64>) -> TensorType {
    TensorType::new(dtype, shape)
}

// ---- rules -------------------------------------------------------------------

fn embedding(_: &Attrs, ops: &Ops) -> R {
    let (tok, table) = (get(ops, 0), get(ops, 1));
    if tok.dtype != DType::I32 || !tok.shape.is_empty() {
        return Err(format!("token must be i32[] (one id per token), found {tok}"));
    }
    match table.shape.as_slice() {
        [_, h] => {
            dense_float(table, "the embedding table")?;
            Ok(vec![t(DType::Bf16, vec![*h])])
        }
        _ => Err(format!("the embedding table must be [vocab, hidden], found {table}")),
    }
}

fn rms_norm(attrs: &Attrs, ops: &Ops) -> R {
    let (x, w) = (get(ops, 0), get(ops, 1));
    let n = vector(x, "x")?;
    let g = vector(w, "the norm weight")?;
    float_act(x, "x")?;
    dense_float(w, "the norm weight")?;
    if g == 0 || n % g != 0 {
        return Err(format!("the norm weight's length {g} must divide x's length {n} (x {x}, weight {w})"));
    }
    Ok(vec![t(attrs.dtype("out"), vec![n])])
}

fn gated_rms_norm(_: &Attrs, ops: &Ops) -> R {
    let (x, gate, w) = (get(ops, 0), get(ops, 1), get(ops, 2));
    let n = vector(x, "x")?;
    if gate.shape != x.shape {
        return Err(format!("gate {gate} must have x's shape {x}"));
    }
    let g = vector(w, "the norm weight")?;
    if g == 0 || n % g != 0 {
        return Err(format!("the norm weight's length {g} must divide x's length {n}"));
    }
    float_act(x, "x")?;
    float_act(gate, "gate")?;
    Ok(vec![t(DType::Bf16, vec![n])])
}

fn l2_norm(attrs: &Attrs, ops: &Ops) -> R {
    let x = get(ops, 0);
    let n = vector(x, "x")?;
    let g = positive(attrs, "group")?;
    if n % g != 0 {
        return Err(format!("`group` {g} must divide x's length {n}"));
    }
    float_act(x, "x")?;
    Ok(vec![t(DType::F32, vec![n])])
}

fn linear(attrs: &Attrs, ops: &Ops) -> R {
    let (x, w) = (get(ops, 0), get(ops, 1));
    let k = vector(x, "x")?;
    float_act(x, "x")?;
    match w.shape.as_slice() {
        [n, wk] if *wk == k => {
            if !w.dtype.is_float() {
                return Err(format!("the weight must be a floating-point type, found {w}"));
            }
            let out = attrs.dtype("out");
            if !matches!(out, DType::Bf16 | DType::F32 | DType::F16) {
                return Err(format!("`out` must be bf16, f16 or f32, found {out}"));
            }
            Ok(vec![t(out, vec![*n])])
        }
        [_, wk] => Err(format!("x has {k} features but the weight {w} expects {wk}")),
        _ => Err(format!("the weight must be [out, in], found {w}")),
    }
}

fn same_elementwise(_: &Attrs, ops: &Ops) -> R {
    let (a, b) = (get(ops, 0), get(ops, 1));
    if a.shape != b.shape {
        return Err(format!("operands must have one shape, found {a} and {b}"));
    }
    float_act(a, "the first operand")?;
    float_act(b, "the second operand")?;
    let dtype = if a.dtype == DType::F32 && b.dtype == DType::F32 { DType::F32 } else { DType::Bf16 };
    Ok(vec![t(dtype, a.shape.clone())])
}

fn unary(_: &Attrs, ops: &Ops) -> R {
    let x = get(ops, 0);
    float_act(x, "x")?;
    Ok(vec![x.clone()])
}

fn rope(attrs: &Attrs, ops: &Ops) -> R {
    let x = get(ops, 0);
    let n = vector(x, "x")?;
    let heads = positive(attrs, "heads")?;
    let head_dim = positive(attrs, "head_dim")?;
    let rot = attrs.int("rot");
    if heads.checked_mul(head_dim) != Some(n) {
        return Err(format!("heads {heads} x head_dim {head_dim} must equal x's length {n}"));
    }
    if rot < 0 || rot as u64 > head_dim || rot % 2 != 0 {
        return Err(format!("`rot` must be even and at most head_dim {head_dim}, found {rot}"));
    }
    float_act(x, "x")?;
    Ok(vec![x.clone()])
}

fn conv_update(_: &Attrs, ops: &Ops) -> R {
    let (x, w, s) = (get(ops, 0), get(ops, 1), get(ops, 2));
    let c = vector(x, "x")?;
    let width = match w.shape.as_slice() {
        [wc, 1, k] if *wc == c => *k,
        [wc, k] if *wc == c => *k,
        _ => return Err(format!("the conv weight must be [{c}, 1, width] or [{c}, width], found {w}")),
    };
    if width < 2 {
        return Err(format!("the conv width must be at least 2, found {width}"));
    }
    if s.shape != [width - 1, c] {
        return Err(format!("the conv state must be [{}, {c}] (width - 1 previous inputs), found {s}", width - 1));
    }
    float_act(x, "x")?;
    Ok(vec![t(DType::Bf16, vec![c])])
}

fn mla_decode(attrs: &Attrs, ops: &Ops) -> R {
    let (q, ckv, kpe, wkvb, cache) = (get(ops, 0), get(ops, 1), get(ops, 2), get(ops, 3), get(ops, 4));
    let heads = positive(attrs, "heads")?;
    let nope = positive(attrs, "nope")?;
    let rope = attrs.int("rope");
    let v_dim = positive(attrs, "v_dim")?;
    if rope < 0 {
        return Err(format!("`rope` must not be negative, found {rope}"));
    }
    let rope = rope as u64;
    let big = || "head sizes overflow".to_string();
    let q_len = nope.checked_add(rope).and_then(|x| x.checked_mul(heads)).ok_or_else(big)?;
    let kv_rows = nope.checked_add(v_dim).and_then(|x| x.checked_mul(heads)).ok_or_else(big)?;
    heads.checked_mul(v_dim).ok_or_else(big)?;
    let qn = vector(q, "q")?;
    if qn != q_len {
        return Err(format!("q must be heads x (nope + rope) = {q_len}, found {q}"));
    }
    let c = vector(ckv, "c_kv")?;
    let kp = vector(kpe, "k_pe")?;
    if kp != rope {
        return Err(format!("k_pe must have `rope` = {rope} values, found {kpe}"));
    }
    if wkvb.shape != [kv_rows, c] {
        return Err(format!("w_kv_b must be [heads x (nope + v_dim), kv_lora] = [{kv_rows}, {c}], found {wkvb}"));
    }
    match cache.shape.as_slice() {
        [_, w] if Some(*w) == c.checked_add(rope) => {}
        _ => return Err(format!("the cache must be [ctx, kv_lora + rope] = [ctx, {}], found {cache}", c + rope)),
    }
    Ok(vec![t(DType::Bf16, vec![heads * v_dim])])
}

fn kda_decode(attrs: &Attrs, ops: &Ops) -> R {
    let heads = positive(attrs, "heads")?;
    let d = positive(attrs, "head_dim")?;
    let p = heads.checked_mul(d).ok_or("heads x head_dim overflows")?;
    d.checked_mul(d).and_then(|x| x.checked_mul(heads)).ok_or("the state size overflows")?;
    for (i, name) in ["q", "k", "v", "f"].iter().enumerate() {
        let x = get(ops, i);
        if x.shape != [p] {
            return Err(format!("{name} must have heads x head_dim = {p} values, found {x}"));
        }
    }
    let beta = get(ops, 4);
    if beta.shape != [heads] {
        return Err(format!("beta must have one value per head ({heads}), found {beta}"));
    }
    let a_log = get(ops, 5);
    if a_log.elements() < heads {
        return Err(format!("A_log must hold at least one value per head ({heads}), found {a_log}"));
    }
    let dt = get(ops, 6);
    if dt.elements() != p {
        return Err(format!("dt_bias must hold heads x head_dim = {p} values, found {dt}"));
    }
    let s = get(ops, 7);
    if s.shape != [heads, d, d] || s.dtype != DType::F32 {
        return Err(format!("the recurrent state must be f32[{heads}, {d}, {d}], found {s}"));
    }
    Ok(vec![t(DType::Bf16, vec![p])])
}

fn router(attrs: &Attrs, ops: &Ops) -> R {
    let logits = get(ops, 0);
    let e = vector(logits, "logits")?;
    if logits.dtype != DType::F32 {
        return Err(format!("router logits must be f32 (use `linear(x, w, out: f32)`), found {logits}"));
    }
    if let Some(b) = ops[1] {
        if b.shape != [e] {
            return Err(format!("the correction bias must have one value per expert ({e}), found {b}"));
        }
    }
    let k = positive(attrs, "top_k")?;
    let groups = positive(attrs, "n_group")?;
    let topk_group = positive(attrs, "topk_group")?;
    if k > e {
        return Err(format!("top_k {k} exceeds the {e} experts"));
    }
    if e % groups != 0 {
        return Err(format!("n_group {groups} must divide the {e} experts"));
    }
    if topk_group > groups {
        return Err(format!("topk_group {topk_group} exceeds n_group {groups}"));
    }
    if k > topk_group.saturating_mul(e / groups) {
        return Err(format!(
            "top_k {k} exceeds the {} experts left in {topk_group} of {groups} groups",
            topk_group * (e / groups)
        ));
    }
    Ok(vec![t(DType::I32, vec![k]), t(DType::F32, vec![k])])
}

fn moe(_: &Attrs, ops: &Ops) -> R {
    let (x, ids, wts) = (get(ops, 0), get(ops, 1), get(ops, 2));
    let (wg, wu, wd) = (get(ops, 3), get(ops, 4), get(ops, 5));
    let d = vector(x, "x")?;
    let k = vector(ids, "ids")?;
    if ids.dtype != DType::I32 || wts.shape != [k] || wts.dtype != DType::F32 {
        return Err(format!("ids and weights must be i32[k] and f32[k] from a router, found {ids} and {wts}"));
    }
    let [e, i, gd] = wg.shape.as_slice() else {
        return Err(format!("w_gate must be an expert family [experts, inter, {d}], found {wg}"));
    };
    if *gd != d {
        return Err(format!("x has {d} features but the experts' w_gate {wg} expects {gd}"));
    }
    if wu.shape != wg.shape {
        return Err(format!("w_up {wu} must match w_gate {wg}"));
    }
    if wd.shape != [*e, d, *i] {
        return Err(format!("w_down must be [{e}, {d}, {i}], found {wd}"));
    }
    if k > *e {
        return Err(format!("{k} experts per token but only {e} experts"));
    }
    Ok(vec![t(DType::Bf16, vec![d])])
}

fn attn_res_mix(_: &Attrs, ops: &Ops) -> R {
    let (x, bank, proj, norm) = (get(ops, 0), get(ops, 1), get(ops, 2), get(ops, 3));
    let h = vector(x, "x")?;
    match bank.shape.as_slice() {
        [_, bh] if *bh == h => {}
        _ => return Err(format!("the bank must be [rows, {h}], found {bank}")),
    }
    if proj.elements() != h || norm.shape != [h] {
        return Err(format!("the scorer must be proj [1, {h}] and norm [{h}], found {proj} and {norm}"));
    }
    Ok(vec![t(DType::Bf16, vec![h])])
}

fn stack(_: &Attrs, ops: &Ops) -> R {
    let bank = get(ops, 0);
    match (bank.shape.as_slice(), ops[1]) {
        ([h], None) => Ok(vec![t(bank.dtype, vec![1, *h])]),
        ([n, h], Some(row)) if row.shape == [*h] => Ok(vec![t(bank.dtype, vec![n + 1, *h])]),
        ([_, h], Some(row)) => Err(format!("the row must be [{h}], found {row}")),
        _ => Err(format!("stack takes a row, or a bank [rows, n] and a row, found {bank}")),
    }
}

fn split(attrs: &Attrs, ops: &Ops) -> R {
    let x = get(ops, 0);
    let n = vector(x, "x")?;
    let sizes = attrs.int_list("sizes");
    if sizes.len() < 2 || sizes.iter().any(|s| *s <= 0) {
        return Err(format!("`sizes` must list at least two positive sizes, found {sizes:?}"));
    }
    let total = sizes.iter().try_fold(0i64, |a, s| a.checked_add(*s)).ok_or("`sizes` overflow")?;
    if total as u64 != n {
        return Err(format!("`sizes` sum to {total} but x has {n} values"));
    }
    Ok(sizes.iter().map(|s| t(x.dtype, vec![*s as u64])).collect())
}

fn lm_head(_: &Attrs, ops: &Ops) -> R {
    let (x, w) = (get(ops, 0), get(ops, 1));
    let h = vector(x, "x")?;
    match w.shape.as_slice() {
        [v, wh] if *wh == h => Ok(vec![t(DType::F32, vec![*v])]),
        _ => Err(format!("the LM head must be [vocab, {h}], found {w}")),
    }
}

fn argmax(_: &Attrs, ops: &Ops) -> R {
    let x = get(ops, 0);
    vector(x, "logits")?;
    Ok(vec![t(DType::I32, vec![])])
}
