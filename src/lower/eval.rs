//! Compile-time values and the evaluator of graph-file expressions.
//!
//! Integers are checked (overflow is an error, `/` must divide exactly);
//! reading a config key that is not there yields [`Const::Missing`], which
//! only `??` may absorb: any other use is an error naming the key.

use std::collections::BTreeMap;
use std::fmt;

use crate::diag::{Error, ErrorKind, Result, Span};
use crate::front::ast::{BinOp, Expr, ExprKind, UnaryOp};
use crate::ir::DType;

/// A compile-time value.
#[derive(Debug, Clone, PartialEq)]
pub enum Const {
    /// `null` (also a JSON null in the config).
    Null,
    /// A boolean.
    Bool(bool),
    /// An integer.
    Int(i64),
    /// A number.
    Float(f64),
    /// A string.
    Str(String),
    /// A list.
    List(Vec<Const>),
    /// A mapping (config sections).
    Map(BTreeMap<String, Const>),
    /// An element type.
    DType(DType),
    /// The symbolic maximum context length (only a whole state dimension).
    Ctx,
    /// A config key that is not there: its path and where it was read.
    Missing(String, Span),
}

impl Const {
    /// A short name of the value's type, for messages.
    pub fn type_name(&self) -> &'static str {
        match self {
            Const::Null => "null",
            Const::Bool(_) => "bool",
            Const::Int(_) => "int",
            Const::Float(_) => "float",
            Const::Str(_) => "string",
            Const::List(_) => "list",
            Const::Map(_) => "mapping",
            Const::DType(_) => "dtype",
            Const::Ctx => "ctx",
            Const::Missing(..) => "missing",
        }
    }
}

impl fmt::Display for Const {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Const::Null => f.write_str("null"),
            Const::Bool(b) => write!(f, "{b}"),
            Const::Int(i) => write!(f, "{i}"),
            Const::Float(x) => write!(f, "{x:?}"),
            Const::Str(s) => write!(f, "{s:?}"),
            Const::List(items) => {
                f.write_str("[")?;
                for (i, x) in items.iter().enumerate() {
                    if i > 0 {
                        f.write_str(", ")?;
                    }
                    if i == 8 {
                        return write!(f, "... {} more]", items.len() - 8);
                    }
                    write!(f, "{x}")?;
                }
                f.write_str("]")
            }
            Const::Map(_) => f.write_str("{...}"),
            Const::DType(d) => write!(f, "{d}"),
            Const::Ctx => f.write_str("ctx"),
            Const::Missing(p, _) => write!(f, "<missing {p}>"),
        }
    }
}

/// A type name with its article: `an int`, `a string`.
pub fn a(type_name: &str) -> String {
    if type_name.starts_with(['a', 'e', 'i', 'o', 'u']) {
        format!("an {type_name}")
    } else {
        format!("a {type_name}")
    }
}

/// Where names are looked up during evaluation.
pub trait Names {
    /// The compile-time value bound to `name`, or an error saying why not
    /// (unknown, or a tensor).
    fn lookup(&self, name: &str, span: Span) -> Result<Const>;
}

fn value_err(msg: impl Into<String>, span: Span) -> Error {
    Error::new(ErrorKind::Value, msg).at(span)
}

/// An error for using a missing config key where a value is needed.
pub fn missing_err(path: &str, span: Span) -> Error {
    Error::new(ErrorKind::Config, format!("config key `{path}` is missing"))
        .at(span)
        .label("read here")
        .help(format!("add `{}` to the config, or give a default with `?? value`", path.trim_start_matches("config.")))
}

/// Fails on [`Const::Missing`], passes anything else through.
pub fn present(v: Const, span: Span) -> Result<Const> {
    match v {
        Const::Missing(p, at) => Err(missing_err(&p, if at == Span::default() { span } else { at })),
        v => Ok(v),
    }
}

fn path_of(e: &Expr) -> String {
    match &e.node {
        ExprKind::Name(n) => n.clone(),
        ExprKind::Member(b, m) => format!("{}.{}", path_of(b), m.node),
        ExprKind::Index(b, _) => format!("{}[..]", path_of(b)),
        _ => "(expression)".into(),
    }
}

/// Evaluates `e` in `names`.
pub fn eval(e: &Expr, names: &dyn Names) -> Result<Const> {
    let span = e.span;
    Ok(match &e.node {
        ExprKind::Int(i) => Const::Int(*i),
        ExprKind::Float(x) => Const::Float(*x),
        ExprKind::Str(s) => Const::Str(s.clone()),
        ExprKind::Bool(b) => Const::Bool(*b),
        ExprKind::Null => Const::Null,
        ExprKind::Name(n) => names.lookup(n, span)?,
        ExprKind::List(items) => {
            Const::List(items.iter().map(|x| eval(x, names).and_then(|v| present(v, x.span))).collect::<Result<_>>()?)
        }
        ExprKind::Member(base, key) => match eval(base, names)? {
            Const::Map(m) => m
                .get(&key.node)
                .cloned()
                .unwrap_or_else(|| Const::Missing(format!("{}.{}", path_of(base), key.node), span)),
            Const::Missing(p, _) => Const::Missing(format!("{p}.{}", key.node), span),
            // A null section (`quantization_config: null`) has no keys.
            Const::Null => Const::Missing(format!("{}.{}", path_of(base), key.node), span),
            other => {
                return Err(value_err(
                    format!("`{}` is {}, not a config section", path_of(base), a(other.type_name())),
                    base.span,
                )
                .label(format!("has no key `{}`", key.node)))
            }
        },
        ExprKind::Index(base, idx) => {
            let b = eval(base, names)?;
            let i = present(eval(idx, names)?, idx.span)?;
            match (b, i) {
                (Const::List(items), Const::Int(i)) => {
                    if i >= 0 && (i as usize) < items.len() {
                        items[i as usize].clone()
                    } else {
                        Const::Missing(format!("{}[{i}]", path_of(base)), span)
                    }
                }
                (Const::Missing(p, _), Const::Int(i)) => Const::Missing(format!("{p}[{i}]"), span),
                (Const::List(_), i) => {
                    return Err(value_err(format!("list index must be an int, found {}", i.type_name()), idx.span))
                }
                (b, _) => {
                    return Err(value_err(format!("cannot index {}", a(b.type_name())), base.span).label("not a list"))
                }
            }
        }
        ExprKind::Unary(op, x) => {
            let v = eval(x, names)?;
            if let Const::Missing(..) = v {
                return Ok(v);
            }
            match (op, v) {
                (UnaryOp::Neg, Const::Int(i)) => {
                    Const::Int(i.checked_neg().ok_or_else(|| value_err("integer overflow", span))?)
                }
                (UnaryOp::Neg, Const::Float(f)) => Const::Float(-f),
                (UnaryOp::Not, Const::Bool(b)) => Const::Bool(!b),
                (UnaryOp::Neg, v) => return Err(value_err(format!("cannot negate a {}", v.type_name()), span)),
                (UnaryOp::Not, v) => {
                    return Err(value_err(format!("`not` needs a bool, found {}", v.type_name()), span))
                }
            }
        }
        ExprKind::Binary(op, a, b) => binary(*op, a, b, span, names)?,
        ExprKind::If(c, a, b) => match present(eval(c, names)?, c.span)? {
            Const::Bool(true) => eval(a, names)?,
            Const::Bool(false) => eval(b, names)?,
            v => return Err(value_err(format!("condition must be a bool, found {}", v.type_name()), c.span)),
        },
        ExprKind::Func(name, args) => {
            let vals =
                args.iter().map(|a| eval(a, names).and_then(|v| present(v, a.span))).collect::<Result<Vec<_>>>()?;
            builtin(&name.node, &vals, span, name.span)?
        }
    })
}

/// Evaluates `e` and requires an integer.
pub fn eval_int(e: &Expr, names: &dyn Names) -> Result<i64> {
    match present(eval(e, names)?, e.span)? {
        Const::Int(i) => Ok(i),
        Const::Float(f) if f.fract() == 0.0 && f.abs() < 9.0e15 => Ok(f as i64),
        v => Err(value_err(format!("expected an integer, found {} {v}", v.type_name()), e.span)),
    }
}

/// Evaluates `e` and requires a bool.
pub fn eval_bool(e: &Expr, names: &dyn Names) -> Result<bool> {
    match present(eval(e, names)?, e.span)? {
        Const::Bool(b) => Ok(b),
        v => Err(value_err(format!("expected a bool, found {} {v}", v.type_name()), e.span)),
    }
}

/// Evaluates `e` and requires a string.
pub fn eval_str(e: &Expr, names: &dyn Names) -> Result<String> {
    match present(eval(e, names)?, e.span)? {
        Const::Str(s) => Ok(s),
        v => Err(value_err(format!("expected a string, found {} {v}", v.type_name()), e.span)),
    }
}

fn num(v: &Const) -> Option<f64> {
    match v {
        Const::Int(i) => Some(*i as f64),
        Const::Float(f) => Some(*f),
        _ => None,
    }
}

fn binary(op: BinOp, a: &Expr, b: &Expr, span: Span, names: &dyn Names) -> Result<Const> {
    let lhs = eval(a, names)?;
    match op {
        BinOp::Coalesce => {
            return match lhs {
                Const::Missing(..) | Const::Null => eval(b, names),
                v => Ok(v),
            }
        }
        BinOp::And | BinOp::Or => {
            if let Const::Missing(..) = lhs {
                return Ok(lhs);
            }
            let l = match lhs {
                Const::Bool(x) => x,
                v => return Err(value_err(format!("`{}` needs bools, found {}", op.symbol(), v.type_name()), a.span)),
            };
            if (op == BinOp::And && !l) || (op == BinOp::Or && l) {
                return Ok(Const::Bool(l));
            }
            return eval_bool(b, names).map(Const::Bool);
        }
        _ => {}
    }
    // A missing key flows through operators so that `??` can still catch
    // it (`(l + 1) in config.list ?? default`); it is an error only where a
    // value is finally needed, and then it points at the read.
    if let Const::Missing(..) = lhs {
        return Ok(lhs);
    }
    let rhs = eval(b, names)?;
    if let Const::Missing(..) = rhs {
        return Ok(rhs);
    }
    if matches!(lhs, Const::Ctx) || matches!(rhs, Const::Ctx) {
        return Err(value_err("`ctx` can only be a whole dimension of a state", span)
            .label("arithmetic on ctx")
            .help("write the state with `ctx` as one of its dimensions, e.g. `bf16[ctx, 576]`"));
    }
    let overflow = || value_err("integer overflow", span);
    let mismatch = |l: &Const, r: &Const| {
        value_err(format!("`{}` cannot combine {} and {}", op.symbol(), l.type_name(), r.type_name()), span)
    };
    Ok(match op {
        BinOp::Eq => Const::Bool(const_eq(&lhs, &rhs)),
        BinOp::Ne => Const::Bool(!const_eq(&lhs, &rhs)),
        BinOp::In => match &rhs {
            Const::List(items) => Const::Bool(items.iter().any(|x| const_eq(x, &lhs))),
            Const::Str(s) => match &lhs {
                Const::Str(sub) => Const::Bool(s.contains(sub.as_str())),
                _ => return Err(mismatch(&lhs, &rhs)),
            },
            _ => return Err(value_err(format!("`in` needs a list, found {}", rhs.type_name()), b.span)),
        },
        BinOp::Lt | BinOp::Le | BinOp::Gt | BinOp::Ge => {
            let (Some(l), Some(r)) = (num(&lhs), num(&rhs)) else {
                return Err(mismatch(&lhs, &rhs));
            };
            Const::Bool(match op {
                BinOp::Lt => l < r,
                BinOp::Le => l <= r,
                BinOp::Gt => l > r,
                _ => l >= r,
            })
        }
        _ => match (&lhs, &rhs) {
            (Const::Int(l), Const::Int(r)) => {
                let (l, r) = (*l, *r);
                Const::Int(match op {
                    BinOp::Add => l.checked_add(r).ok_or_else(overflow)?,
                    BinOp::Sub => l.checked_sub(r).ok_or_else(overflow)?,
                    BinOp::Mul => l.checked_mul(r).ok_or_else(overflow)?,
                    BinOp::Div | BinOp::FloorDiv | BinOp::Rem if r == 0 => {
                        return Err(value_err("division by zero", span).label("divides by 0"))
                    }
                    BinOp::Div => {
                        if l.checked_rem(r).ok_or_else(overflow)? != 0 {
                            return Err(value_err(format!("{l} is not divisible by {r}"), span)
                                .label("`/` must divide exactly")
                                .help("use `//` to round down or `cdiv(a, b)` to round up"));
                        }
                        l.checked_div(r).ok_or_else(overflow)?
                    }
                    BinOp::FloorDiv => l.checked_div_euclid(r).ok_or_else(overflow)?,
                    _ => l.checked_rem_euclid(r).ok_or_else(overflow)?,
                })
            }
            (Const::Str(l), Const::Str(r)) if op == BinOp::Add => Const::Str(format!("{l}{r}")),
            _ => {
                let (Some(l), Some(r)) = (num(&lhs), num(&rhs)) else {
                    return Err(mismatch(&lhs, &rhs));
                };
                Const::Float(match op {
                    BinOp::Add => l + r,
                    BinOp::Sub => l - r,
                    BinOp::Mul => l * r,
                    BinOp::Div => l / r,
                    BinOp::FloorDiv => (l / r).floor(),
                    _ => l % r,
                })
            }
        },
    })
}

fn const_eq(a: &Const, b: &Const) -> bool {
    match (num(a), num(b)) {
        (Some(x), Some(y)) => x == y,
        _ => a == b,
    }
}

fn builtin(name: &str, args: &[Const], span: Span, name_span: Span) -> Result<Const> {
    let arity = |n: usize| -> Result<()> {
        if args.len() != n {
            return Err(value_err(format!("`{name}` takes {n} argument(s), found {}", args.len()), span));
        }
        Ok(())
    };
    let float_arg = |i: usize| -> Result<f64> {
        num(&args[i]).ok_or_else(|| value_err(format!("`{name}` needs numbers, found {}", args[i].type_name()), span))
    };
    Ok(match name {
        "min" | "max" => {
            if args.is_empty() {
                return Err(value_err(format!("`{name}` needs at least one argument"), span));
            }
            let mut best = args[0].clone();
            for a in &args[1..] {
                let (Some(x), Some(y)) = (num(&best), num(a)) else {
                    return Err(value_err(format!("`{name}` needs numbers"), span));
                };
                if (name == "min" && y < x) || (name == "max" && y > x) {
                    best = a.clone();
                }
            }
            num(&best).ok_or_else(|| value_err(format!("`{name}` needs numbers"), span))?;
            best
        }
        "cdiv" => {
            arity(2)?;
            match (&args[0], &args[1]) {
                (Const::Int(_), Const::Int(b)) if *b <= 0 => {
                    return Err(value_err(format!("`cdiv` needs a positive divisor, found {b}"), span))
                }
                (Const::Int(a), Const::Int(b)) => {
                    let overflow = || value_err("integer overflow", span);
                    let q = a.checked_div_euclid(*b).ok_or_else(overflow)?;
                    let r = a.checked_rem_euclid(*b).ok_or_else(overflow)?;
                    Const::Int(q.checked_add(i64::from(r != 0)).ok_or_else(overflow)?)
                }
                _ => return Err(value_err("`cdiv` needs integers", span)),
            }
        }
        "len" => {
            arity(1)?;
            match &args[0] {
                Const::List(l) => Const::Int(l.len() as i64),
                Const::Str(s) => Const::Int(s.chars().count() as i64),
                v => return Err(value_err(format!("`len` needs a list or string, found {}", v.type_name()), span)),
            }
        }
        "sqrt" | "ln" | "exp" => {
            arity(1)?;
            let x = float_arg(0)?;
            Const::Float(match name {
                "sqrt" => x.sqrt(),
                "ln" => x.ln(),
                _ => x.exp(),
            })
        }
        "pow" => {
            arity(2)?;
            Const::Float(float_arg(0)?.powf(float_arg(1)?))
        }
        "float" => {
            arity(1)?;
            Const::Float(float_arg(0)?)
        }
        "dtype" => {
            arity(1)?;
            match &args[0] {
                Const::Str(s) => Const::DType(DType::from_name(s).ok_or_else(|| {
                    value_err(format!("unknown dtype \"{s}\""), span)
                        .help(format!("dtypes: {}", DType::ALL.map(|d| d.name()).join(", ")))
                })?),
                Const::DType(d) => Const::DType(*d),
                v => return Err(value_err(format!("`dtype` needs a string, found {}", v.type_name()), span)),
            }
        }
        _ => {
            return Err(Error::new(ErrorKind::Name, format!("unknown function `{name}`"))
                .at(name_span)
                .label("not a built-in function")
                .help("built-ins: min, max, cdiv, len, sqrt, ln, exp, pow, float, dtype"))
        }
    })
}
