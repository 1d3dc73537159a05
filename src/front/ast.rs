//! The spanned syntax tree of a graph file, as the parser produces it.
//!
//! Nothing here is evaluated: expressions stay expressions until `lower`
//! binds them against the model's config.

use crate::diag::Span;

/// A value with the source span it came from.
#[derive(Debug, Clone, PartialEq)]
pub struct Spanned<T> {
    /// The value.
    pub node: T,
    /// Where it was written.
    pub span: Span,
}

impl<T> Spanned<T> {
    /// Wraps `node` with `span`.
    pub fn new(node: T, span: Span) -> Self {
        Spanned { node, span }
    }
}

/// An identifier with its span.
pub type Ident = Spanned<String>;

/// A whole graph file.
#[derive(Debug, Clone)]
pub struct File {
    /// The model's name, from `model NAME`.
    pub model: Ident,
    /// Hyperparameters, in the order written (later ones may use earlier ones).
    pub params: Vec<Param>,
    /// Reusable blocks, by name.
    pub blocks: Vec<BlockDef>,
    /// The decode step.
    pub graph: Option<Spanned<Vec<Stmt>>>,
}

/// `name = expr` inside `params { }`.
#[derive(Debug, Clone)]
pub struct Param {
    /// The bound name.
    pub name: Ident,
    /// Its definition.
    pub value: Expr,
}

/// `block name(params) -> types { body }`.
#[derive(Debug, Clone)]
pub struct BlockDef {
    /// The block's name.
    pub name: Ident,
    /// Its parameters.
    pub params: Vec<BlockParam>,
    /// Declared result types, if any.
    pub returns: Option<Vec<TensorTypeExpr>>,
    /// The body.
    pub body: Vec<Stmt>,
    /// The whole definition.
    pub span: Span,
}

/// One parameter of a block.
#[derive(Debug, Clone)]
pub struct BlockParam {
    /// Its name.
    pub name: Ident,
    /// Its type.
    pub ty: ParamType,
}

/// The type of a block parameter.
#[derive(Debug, Clone)]
pub enum ParamType {
    /// A compile-time value: `int`, `float`, `bool` or `str`.
    Const(Spanned<ConstKind>),
    /// A tensor flowing through the graph.
    Tensor(TensorTypeExpr),
}

/// Kinds of compile-time block parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConstKind {
    /// An integer.
    Int,
    /// A float.
    Float,
    /// A boolean.
    Bool,
    /// A string.
    Str,
}

/// `dtype[dim, dim, ...]` as written.
#[derive(Debug, Clone)]
pub struct TensorTypeExpr {
    /// The dtype: a dtype name or a parameter holding one.
    pub dtype: Ident,
    /// The dimensions.
    pub dims: Vec<DimExpr>,
    /// The whole type.
    pub span: Span,
}

/// One dimension of a written tensor type.
#[derive(Debug, Clone)]
pub enum DimExpr {
    /// `_`: any size (block parameters only).
    Any(Span),
    /// A compile-time integer expression (or `ctx` in a state).
    Expr(Expr),
}

/// A statement in a block or the graph.
#[derive(Debug, Clone)]
pub enum Stmt {
    /// `weight name[idx: count]: type = "key", scale "key"`.
    Weight(WeightDecl),
    /// `state name: type`.
    State {
        /// The state's name.
        name: Ident,
        /// Its per-sequence type.
        ty: TensorTypeExpr,
    },
    /// `input name: type`.
    Input {
        /// The input's name.
        name: Ident,
        /// Its per-token type.
        ty: TensorTypeExpr,
    },
    /// `output a, b`.
    Output(Vec<Ident>),
    /// `for var in lo..hi { body }`.
    For {
        /// The loop variable.
        var: Ident,
        /// Inclusive lower bound.
        lo: Expr,
        /// Exclusive upper bound.
        hi: Expr,
        /// The body, unrolled at lowering.
        body: Vec<Stmt>,
    },
    /// `if cond { then } else { otherwise }` on a compile-time condition.
    If {
        /// The condition.
        cond: Expr,
        /// Statements when true.
        then: Vec<Stmt>,
        /// Statements when false.
        otherwise: Vec<Stmt>,
    },
    /// `require cond, "message"`.
    Require {
        /// The condition that must hold.
        cond: Expr,
        /// What to say when it does not.
        message: Option<Spanned<String>>,
    },
    /// `let name = expr` (a compile-time value).
    Let {
        /// The bound name.
        name: Ident,
        /// Its value.
        value: Expr,
    },
    /// `return a, b`.
    Return(Vec<Ident>),
    /// `a, b = value`.
    Assign {
        /// The names bound.
        targets: Vec<Ident>,
        /// The value (an op call, a block call or a name).
        value: Value,
    },
}

/// A weight declaration.
#[derive(Debug, Clone)]
pub struct WeightDecl {
    /// The local name.
    pub name: Ident,
    /// `[expert: count]` for a family of per-expert tensors.
    pub index: Option<(Ident, Expr)>,
    /// The logical type (quantized dtypes name their packed form).
    pub ty: TensorTypeExpr,
    /// The checkpoint key pattern.
    pub key: Expr,
    /// The key of the block scales, for quantized dtypes.
    pub scale: Option<Expr>,
    /// The whole declaration.
    pub span: Span,
}

/// The right-hand side of an assignment, or a positional argument.
#[derive(Debug, Clone)]
pub enum Value {
    /// A name bound earlier.
    Name(Ident),
    /// `op(args)` or `block(args)`.
    Call(Call),
}

impl Value {
    /// The span of the whole value.
    pub fn span(&self) -> Span {
        match self {
            Value::Name(n) => n.span,
            Value::Call(c) => c.span,
        }
    }
}

/// A call of an op or a block.
#[derive(Debug, Clone)]
pub struct Call {
    /// The callee.
    pub callee: Ident,
    /// Positional arguments (tensors).
    pub args: Vec<Value>,
    /// Named arguments (compile-time attributes or block parameters).
    pub named: Vec<(Ident, Expr)>,
    /// The whole call.
    pub span: Span,
}

/// A compile-time expression.
pub type Expr = Spanned<ExprKind>;

/// Expression forms.
#[derive(Debug, Clone)]
pub enum ExprKind {
    /// An integer literal.
    Int(i64),
    /// A float literal.
    Float(f64),
    /// A string literal.
    Str(String),
    /// `true` or `false`.
    Bool(bool),
    /// `null`.
    Null,
    /// A name.
    Name(String),
    /// `[a, b]`.
    List(Vec<Expr>),
    /// `a.b` (config access).
    Member(Box<Expr>, Ident),
    /// `a[i]`.
    Index(Box<Expr>, Box<Expr>),
    /// `-a`, `not a`.
    Unary(UnaryOp, Box<Expr>),
    /// `a op b`.
    Binary(BinOp, Box<Expr>, Box<Expr>),
    /// `if c then a else b`.
    If(Box<Expr>, Box<Expr>, Box<Expr>),
    /// `f(a, b)` for a built-in function.
    Func(Ident, Vec<Expr>),
}

/// Unary operators.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnaryOp {
    /// Arithmetic negation.
    Neg,
    /// Boolean negation.
    Not,
}

/// Binary operators, loosest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BinOp {
    /// `a ?? b`: `a`, or `b` when `a` reads a missing config key or is null.
    Coalesce,
    /// `or`.
    Or,
    /// `and`.
    And,
    /// `==`.
    Eq,
    /// `!=`.
    Ne,
    /// `<`.
    Lt,
    /// `<=`.
    Le,
    /// `>`.
    Gt,
    /// `>=`.
    Ge,
    /// `a in list`.
    In,
    /// `+`.
    Add,
    /// `-`.
    Sub,
    /// `*`.
    Mul,
    /// `/`: exact for integers.
    Div,
    /// `//`: floor division.
    FloorDiv,
    /// `%`.
    Rem,
}

impl BinOp {
    /// The operator as written.
    pub fn symbol(self) -> &'static str {
        match self {
            BinOp::Coalesce => "??",
            BinOp::Or => "or",
            BinOp::And => "and",
            BinOp::Eq => "==",
            BinOp::Ne => "!=",
            BinOp::Lt => "<",
            BinOp::Le => "<=",
            BinOp::Gt => ">",
            BinOp::Ge => ">=",
            BinOp::In => "in",
            BinOp::Add => "+",
            BinOp::Sub => "-",
            BinOp::Mul => "*",
            BinOp::Div => "/",
            BinOp::FloorDiv => "//",
            BinOp::Rem => "%",
        }
    }
}
