//! The parser: graph source text to the spanned AST of [`super::ast`].
//!
//! pest does the recognising (grammar/mkc.pest); this file builds the tree
//! and turns pest's errors into diagnostics that name what was expected in
//! words a graph author knows. Nesting of every recursive construct deeper
//! than [`MAX_NESTING`] is refused before pest runs, and expression trees
//! deeper than [`MAX_EXPR_DEPTH`] as they are built, so no input can exhaust
//! the stack of the parser or of the stages that walk its tree.

use pest::iterators::{Pair, Pairs};
use pest::pratt_parser::{Assoc, Op, PrattParser};
use pest::Parser as _;

use super::ast::*;
use crate::diag::{Error, ErrorKind, Result, Span};

#[derive(pest_derive::Parser)]
#[grammar = "../grammar/mkc.pest"]
struct GraphParser;

/// Deepest nesting of brackets, `if`, prefix `-` and `not` accepted
/// (counted by [`check_nesting`] before pest runs).
pub const MAX_NESTING: usize = 64;
/// Deepest expression tree accepted (operators, calls, lists, `if`, indexing
/// and members each add a level).
pub const MAX_EXPR_DEPTH: usize = 256;
/// Most operators and operands in one expression, and most `else if` in a
/// file: both recurse in the parser and the evaluator, so they are bounded
/// to keep hostile input from exhausting the stack.
pub const MAX_EXPR_TERMS: usize = 512;
/// Most `else if` branches in one file.
pub const MAX_ELSE_IF: usize = 256;

/// Parses a graph file.
pub fn parse_str(src: &str) -> Result<File> {
    check_nesting(src)?;
    check_else_if(src)?;
    // Let pest record the literal tokens it expected, so a missing `=`, `:`
    // or `}` is named in the error.
    pest::set_error_detail(true);
    let mut pairs = GraphParser::parse(Rule::file, src).map_err(|e| syntax_error(e, src))?;
    let file = pairs.next().expect("pest returns the file rule");
    build_file(file)
}

/// An open construct of the nesting scan ([`check_nesting`]).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Open {
    /// `(`, `[` or `{`, until its closing bracket.
    Bracket,
    /// `if`, until its `then` (an `if` expression) or `{` (an `if` statement).
    IfCond,
    /// `if ... then`, until its `else`.
    IfThen,
    /// An `else` branch or a prefix `-` / `not`: until the expression ends.
    Operand,
}

/// Words that begin a statement or a section: no expression continues past them.
fn starts_statement(word: &str) -> bool {
    matches!(
        word,
        "model"
            | "params"
            | "block"
            | "graph"
            | "weight"
            | "state"
            | "input"
            | "output"
            | "for"
            | "require"
            | "let"
            | "return"
    )
}

/// Refuses sources whose constructs nest deeper than [`MAX_NESTING`], before
/// pest (whose descent recurses once per level) sees them. A lexical scan
/// keeps a stack of what is open: brackets, `if ... then ... else` (open from
/// `if` to the end of its `else` branch's expression) and prefix `-` / `not`
/// (open to the end of their expression). An expression ends at a closing
/// bracket, `,`, `then`, `else`, `{`, `..`, `=` or a statement's keyword, so
/// the stack never holds less than what the parser has open.
fn check_nesting(src: &str) -> Result<()> {
    let bytes = src.as_bytes();
    let mut stack: Vec<Open> = vec![];
    // Whether the last token ends an operand (a name, a literal, a closing
    // bracket): a `-` after one is infix, else prefix.
    let mut after_operand = false;
    let mut after_dot = false;
    let mut i = 0;
    let pop_operands = |stack: &mut Vec<Open>| {
        while stack.last() == Some(&Open::Operand) {
            stack.pop();
        }
    };
    while i < bytes.len() {
        let c = bytes[i];
        let start = i;
        let mut push = None;
        let (mut operand, mut dot) = (false, false);
        match c {
            b' ' | b'\t' | b'\r' | b'\n' => {
                i += 1;
                continue;
            }
            b'#' => {
                i = src[i..].find('\n').map_or(bytes.len(), |n| i + n);
                continue;
            }
            b'"' => {
                i += 1;
                while i < bytes.len() && bytes[i] != b'"' && bytes[i] != b'\n' {
                    i += if bytes[i] == b'\\' { 2 } else { 1 };
                }
                i += 1;
                operand = true;
            }
            b'(' | b'[' | b'{' => {
                if c == b'{' {
                    pop_operands(&mut stack);
                    if stack.last() == Some(&Open::IfCond) {
                        stack.pop();
                    }
                }
                push = Some(Open::Bracket);
                i += 1;
            }
            b')' | b']' | b'}' => {
                while let Some(o) = stack.pop() {
                    if o == Open::Bracket {
                        break;
                    }
                }
                operand = true;
                i += 1;
            }
            b',' | b'=' | b'.' => {
                let two = bytes.get(i + 1).copied();
                if c == b'=' && two == Some(b'=') {
                    i += 2;
                } else if c == b'.' && two != Some(b'.') {
                    dot = true;
                    i += 1;
                } else {
                    pop_operands(&mut stack);
                    i += if c == b'.' { 2 } else { 1 };
                }
            }
            b'-' if bytes.get(i + 1) == Some(&b'>') => i += 2,
            b'-' => {
                if !after_operand {
                    push = Some(Open::Operand);
                }
                i += 1;
            }
            b'0'..=b'9' => {
                while i < bytes.len() && bytes[i].is_ascii_digit() {
                    i += 1;
                }
                if bytes.get(i) == Some(&b'.') && bytes.get(i + 1).is_some_and(u8::is_ascii_digit) {
                    i += 1;
                    while i < bytes.len() && bytes[i].is_ascii_digit() {
                        i += 1;
                    }
                }
                if matches!(bytes.get(i), Some(b'e' | b'E')) {
                    i += 1;
                    if matches!(bytes.get(i), Some(b'+' | b'-')) {
                        i += 1;
                    }
                }
                while i < bytes.len() && (bytes[i].is_ascii_alphanumeric() || bytes[i] == b'_') {
                    i += 1;
                }
                operand = true;
            }
            _ if c.is_ascii_alphabetic() || c == b'_' => {
                while i < bytes.len() && (bytes[i].is_ascii_alphanumeric() || bytes[i] == b'_') {
                    i += 1;
                }
                match &src[start..i] {
                    _ if after_dot => operand = true,
                    "if" => push = Some(Open::IfCond),
                    "not" => push = Some(Open::Operand),
                    "then" => {
                        pop_operands(&mut stack);
                        if stack.last() == Some(&Open::IfCond) {
                            *stack.last_mut().expect("an if") = Open::IfThen;
                        }
                    }
                    "else" => {
                        pop_operands(&mut stack);
                        if stack.last() == Some(&Open::IfThen) {
                            // The `if` stays open over its `else` branch.
                            *stack.last_mut().expect("an if") = Open::Operand;
                        }
                    }
                    "and" | "or" | "in" => {}
                    w if starts_statement(w) => pop_operands(&mut stack),
                    _ => operand = true,
                }
            }
            _ => {
                // Any other operator or byte (pest judges it); step over one
                // whole character.
                i += src[i..].chars().next().map_or(1, char::len_utf8);
            }
        }
        after_operand = operand;
        after_dot = dot;
        if let Some(o) = push {
            stack.push(o);
            if stack.len() > MAX_NESTING {
                return Err(Error::new(
                    ErrorKind::Limit,
                    format!("constructs nest deeper than {MAX_NESTING} levels (brackets, `if`, prefix `-` and `not`)"),
                )
                .at(Span::new(start, i.min(src.len())))
                .label("too deep")
                .help("name the inner parts with `let`"));
            }
        }
    }
    Ok(())
}

fn check_else_if(src: &str) -> Result<()> {
    let mut count = 0;
    let mut rest = src;
    let mut offset = 0;
    while let Some(i) = rest.find("else") {
        let after = rest[i + 4..].trim_start();
        if after.starts_with("if") && !after[2..].starts_with(|c: char| c.is_ascii_alphanumeric() || c == '_') {
            count += 1;
            if count > MAX_ELSE_IF {
                return Err(Error::new(ErrorKind::Limit, format!("more than {MAX_ELSE_IF} `else if` branches"))
                    .at(Span::new(offset + i, offset + i + 4))
                    .label("one too many")
                    .help("select with a lookup instead: `if x in [...]`"));
            }
        }
        offset += i + 4;
        rest = &rest[i + 4..];
    }
    Ok(())
}

/// Structural punctuation worth naming when it is missing (operators are
/// summed up as "an operator").
fn is_punctuation(token: &str) -> bool {
    matches!(token, "=" | ":" | "," | ".." | "{" | "}" | "(" | ")" | "[" | "]" | "->")
}

fn rule_name(rule: &Rule) -> Option<&'static str> {
    Some(match rule {
        Rule::EOI => "end of file",
        Rule::model_decl => "`model NAME`",
        Rule::params_block => "`params { ... }`",
        Rule::block_def => "`block`",
        Rule::graph_def => "`graph`",
        Rule::ident | Rule::ident_any => "a name",
        Rule::expr | Rule::dim => "an expression",
        Rule::int => "an integer",
        Rule::float => "a number",
        Rule::string => "a string",
        Rule::tensor_type => "a tensor type like `bf16[hidden]`",
        Rule::param_type | Rule::const_type => "a type",
        Rule::block_param => "a parameter `name: type`",
        Rule::ret_types => "`->`",
        Rule::body => "`{`",
        Rule::weight_decl => "`weight`",
        Rule::state_decl => "`state`",
        Rule::input_decl => "`input`",
        Rule::output_stmt => "`output`",
        Rule::for_stmt => "`for`",
        Rule::if_stmt => "`if`",
        Rule::require_stmt => "`require`",
        Rule::let_stmt => "`let`",
        Rule::return_stmt => "`return`",
        Rule::assign => "an assignment",
        Rule::value | Rule::op_call => "a value",
        Rule::named_arg => "a named argument",
        Rule::scale_key => "`, scale`",
        Rule::weight_index => "`[`",
        Rule::param => "a parameter `name = expr`",
        Rule::coalesce
        | Rule::or
        | Rule::and
        | Rule::eq
        | Rule::ne
        | Rule::le
        | Rule::ge
        | Rule::lt
        | Rule::gt
        | Rule::in_op
        | Rule::add
        | Rule::sub
        | Rule::mul
        | Rule::floordiv
        | Rule::div
        | Rule::rem => "an operator",
        Rule::member | Rule::index => "`.` or `[`",
        Rule::kw_then => "`then`",
        Rule::kw_else => "`else`",
        Rule::kw_in => "`in`",
        Rule::kw_scale => "`scale`",
        Rule::any_dim => "`_`",
        _ => return None,
    })
}

fn syntax_error(e: pest::error::Error<Rule>, src: &str) -> Error {
    let len = src.len();
    let (mut start, mut end) = match e.location {
        pest::error::InputLocation::Pos(p) => (p, p),
        pest::error::InputLocation::Span((s, t)) => (s, t),
    };
    // pest reports where the failing rule began; when it got further and was
    // waiting for punctuation, point there instead.
    let mut punctuation_only = false;
    let mut attempt_at = start;
    if let Some(attempts) = e.parse_attempts() {
        let wanted = attempts.expected_tokens().iter().any(|t| is_punctuation(&t.to_string()));
        if wanted && attempts.max_position > start {
            start = attempts.max_position;
            attempt_at = start;
            end = start;
            punctuation_only = true;
            // Missing at the end of a line: point just after the last token.
            let before = &src[..start.min(len)];
            let trimmed = before.trim_end();
            if before[trimmed.len()..].contains('\n') {
                start = trimmed.len();
                end = start;
            }
        }
    }
    let reason = match &e.variant {
        pest::error::ErrorVariant::ParsingError { positives, .. } => {
            let mut names: Vec<String> = if punctuation_only {
                vec![]
            } else {
                positives.iter().filter_map(rule_name).map(str::to_string).collect()
            };
            // Punctuation pest tried at the failing position, e.g. a missing `=`.
            if let Some(attempts) = e.parse_attempts() {
                for t in attempts.expected_tokens() {
                    let text = t.to_string();
                    if is_punctuation(&text) && attempts.max_position == attempt_at {
                        names.push(format!("`{text}`"));
                    }
                }
            }
            names.sort_unstable();
            names.dedup();
            match names.len() {
                0 => "unexpected input".to_string(),
                1 => format!("expected {}", names[0]),
                n => format!("expected {} or {}", names[..n - 1].join(", "), names[n - 1]),
            }
        }
        pest::error::ErrorVariant::CustomError { message } => message.clone(),
    };
    // One character wide, or empty at the very end of the file.
    let end = end.max(start + 1).min(len);
    Error::new(ErrorKind::Syntax, format!("syntax error: {reason}")).at(Span::new(start.min(end), end)).label("here")
}

/// The pair's span without the whitespace and comments pest may have
/// consumed at its end, so carets stop at the last token.
fn span_of(p: &Pair<Rule>) -> Span {
    let s = p.as_span();
    let mut text = p.as_str();
    loop {
        let trimmed = text.trim_end();
        let line_start = trimmed.rfind('\n').map_or(0, |nl| nl + 1);
        match comment_start(&trimmed[line_start..]) {
            Some(h) => text = &trimmed[..line_start + h],
            None => {
                text = trimmed;
                break;
            }
        }
    }
    Span::new(s.start(), s.start() + text.len().max(usize::from(s.end() > s.start())))
}

/// Where a `#` comment starts on `line`, outside string literals.
fn comment_start(line: &str) -> Option<usize> {
    let (mut in_string, mut escaped) = (false, false);
    for (i, c) in line.char_indices() {
        match c {
            _ if escaped => escaped = false,
            '\\' if in_string => escaped = true,
            '"' => in_string = !in_string,
            '#' if !in_string => return Some(i),
            _ => {}
        }
    }
    None
}

fn ident(p: Pair<Rule>) -> Ident {
    Spanned::new(p.as_str().to_string(), span_of(&p))
}

fn build_file(file: Pair<Rule>) -> Result<File> {
    let mut inner = file.into_inner();
    let model_decl = inner.next().expect("model_decl");
    let model = ident(model_decl.into_inner().next().expect("model name"));
    let mut out = File { model, params: vec![], blocks: vec![], graph: None };
    for item in inner {
        match item.as_rule() {
            Rule::params_block => {
                for p in item.into_inner() {
                    let mut pi = p.into_inner();
                    let name = ident(pi.next().expect("param name"));
                    let value = build_expr(pi.next().expect("param value"))?;
                    out.params.push(Param { name, value });
                }
            }
            Rule::block_def => out.blocks.push(build_block(item)?),
            Rule::graph_def => {
                let span = span_of(&item);
                if out.graph.is_some() {
                    return Err(Error::new(ErrorKind::Syntax, "a file has one `graph`").at(span).label("second graph"));
                }
                let body = build_body(item.into_inner().next().expect("graph body"))?;
                out.graph = Some(Spanned::new(body, span));
            }
            Rule::EOI => {}
            r => unreachable!("grammar item {r:?}"),
        }
    }
    Ok(out)
}

fn build_block(p: Pair<Rule>) -> Result<BlockDef> {
    let span = span_of(&p);
    let mut inner = p.into_inner();
    let name = ident(inner.next().expect("block name"));
    let mut block = BlockDef { name, params: vec![], returns: None, body: vec![], span };
    for part in inner {
        match part.as_rule() {
            Rule::block_params => {
                for bp in part.into_inner() {
                    let mut bi = bp.into_inner();
                    let name = ident(bi.next().expect("param name"));
                    let ty = bi.next().expect("param type").into_inner().next().expect("type");
                    let ty = match ty.as_rule() {
                        Rule::const_type => {
                            let kind = match ty.as_str() {
                                "int" => ConstKind::Int,
                                "float" => ConstKind::Float,
                                "bool" => ConstKind::Bool,
                                _ => ConstKind::Str,
                            };
                            ParamType::Const(Spanned::new(kind, span_of(&ty)))
                        }
                        _ => ParamType::Tensor(build_tensor_type(ty)?),
                    };
                    block.params.push(BlockParam { name, ty });
                }
            }
            Rule::ret_types => {
                block.returns = Some(part.into_inner().map(build_tensor_type).collect::<Result<_>>()?);
            }
            Rule::body => block.body = build_body(part)?,
            r => unreachable!("block part {r:?}"),
        }
    }
    Ok(block)
}

fn build_tensor_type(p: Pair<Rule>) -> Result<TensorTypeExpr> {
    let span = span_of(&p);
    let mut inner = p.into_inner();
    let dtype = ident(inner.next().expect("dtype"));
    let dims = inner
        .map(|d| {
            let d = d.into_inner().next().expect("dim");
            match d.as_rule() {
                Rule::any_dim => Ok(DimExpr::Any(span_of(&d))),
                _ => Ok(DimExpr::Expr(build_expr(d)?)),
            }
        })
        .collect::<Result<_>>()?;
    Ok(TensorTypeExpr { dtype, dims, span })
}

fn build_body(p: Pair<Rule>) -> Result<Vec<Stmt>> {
    p.into_inner().map(build_stmt).collect()
}

fn build_stmt(p: Pair<Rule>) -> Result<Stmt> {
    let span = span_of(&p);
    let rule = p.as_rule();
    let mut inner = p.into_inner().filter(|q| !is_keyword_rule(q.as_rule())).peekable();
    Ok(match rule {
        Rule::weight_decl => {
            let name = ident(inner.next().expect("weight name"));
            let mut index = None;
            if inner.peek().map(|q| q.as_rule()) == Some(Rule::weight_index) {
                let mut wi = inner.next().expect("index").into_inner();
                let var = ident(wi.next().expect("index name"));
                index = Some((var, build_expr(wi.next().expect("index count"))?));
            }
            let ty = build_tensor_type(inner.next().expect("weight type"))?;
            let key = build_expr(inner.next().expect("weight key"))?;
            let scale = match inner.next() {
                Some(s) => {
                    let e = s.into_inner().find(|q| q.as_rule() == Rule::expr).expect("scale");
                    Some(build_expr(e)?)
                }
                None => None,
            };
            Stmt::Weight(WeightDecl { name, index, ty, key, scale, span })
        }
        Rule::state_decl | Rule::input_decl => {
            let name = ident(inner.next().expect("name"));
            let ty = build_tensor_type(inner.next().expect("type"))?;
            if rule == Rule::state_decl {
                Stmt::State { name, ty }
            } else {
                Stmt::Input { name, ty }
            }
        }
        Rule::output_stmt => Stmt::Output(inner.map(ident).collect()),
        Rule::return_stmt => Stmt::Return(inner.map(ident).collect()),
        Rule::for_stmt => {
            let var = ident(inner.next().expect("loop var"));
            let lo = build_expr(inner.next().expect("lo"))?;
            let hi = build_expr(inner.next().expect("hi"))?;
            let body = build_body(inner.next().expect("body"))?;
            Stmt::For { var, lo, hi, body }
        }
        Rule::if_stmt => {
            let cond = build_expr(inner.next().expect("cond"))?;
            let then = build_body(inner.next().expect("then"))?;
            let otherwise = match inner.next() {
                Some(q) if q.as_rule() == Rule::if_stmt => vec![build_stmt(q)?],
                Some(q) => build_body(q)?,
                None => vec![],
            };
            Stmt::If { cond, then, otherwise }
        }
        Rule::require_stmt => {
            let cond = build_expr(inner.next().expect("cond"))?;
            let message = inner.next().map(|s| Spanned::new(unquote(s.as_str()), span_of(&s)));
            Stmt::Require { cond, message }
        }
        Rule::let_stmt => {
            let name = ident(inner.next().expect("name"));
            let value = build_expr(inner.next().expect("value"))?;
            Stmt::Let { name, value }
        }
        Rule::assign => {
            let mut targets = vec![];
            let mut value = None;
            for q in inner {
                match q.as_rule() {
                    Rule::ident => targets.push(ident(q)),
                    Rule::value => value = Some(build_value(q)?),
                    r => unreachable!("assign part {r:?}"),
                }
            }
            Stmt::Assign { targets, value: value.expect("assign value") }
        }
        r => unreachable!("statement {r:?}"),
    })
}

fn is_keyword_rule(r: Rule) -> bool {
    matches!(
        r,
        Rule::kw_weight
            | Rule::kw_scale
            | Rule::kw_state
            | Rule::kw_input
            | Rule::kw_output
            | Rule::kw_for
            | Rule::kw_in
            | Rule::kw_if
            | Rule::kw_then
            | Rule::kw_else
            | Rule::kw_require
            | Rule::kw_let
            | Rule::kw_return
    )
}

fn build_value(p: Pair<Rule>) -> Result<Value> {
    let q = p.into_inner().next().expect("value");
    match q.as_rule() {
        Rule::ident => Ok(Value::Name(ident(q))),
        Rule::op_call => {
            let span = span_of(&q);
            let mut inner = q.into_inner();
            let callee = ident(inner.next().expect("callee"));
            let mut call = Call { callee, args: vec![], named: vec![], span };
            for a in inner {
                match a.as_rule() {
                    Rule::value => {
                        if !call.named.is_empty() {
                            return Err(Error::new(ErrorKind::Syntax, "positional arguments come before named ones")
                                .at(span_of(&a))
                                .label("positional argument after a named one"));
                        }
                        call.args.push(build_value(a)?)
                    }
                    Rule::named_arg => {
                        let mut ni = a.into_inner();
                        let name = ident(ni.next().expect("arg name"));
                        let value = build_expr(ni.next().expect("arg value"))?;
                        call.named.push((name, value));
                    }
                    r => unreachable!("call arg {r:?}"),
                }
            }
            Ok(Value::Call(call))
        }
        r => unreachable!("value {r:?}"),
    }
}

fn unquote(s: &str) -> String {
    let body = &s[1..s.len() - 1];
    let mut out = String::with_capacity(body.len());
    let mut chars = body.chars();
    while let Some(c) = chars.next() {
        if c == '\\' {
            match chars.next() {
                Some('n') => out.push('\n'),
                Some('t') => out.push('\t'),
                Some(o) => out.push(o),
                None => {}
            }
        } else {
            out.push(c);
        }
    }
    out
}

fn pratt() -> PrattParser<Rule> {
    PrattParser::new()
        .op(Op::infix(Rule::coalesce, Assoc::Left))
        .op(Op::infix(Rule::or, Assoc::Left))
        .op(Op::infix(Rule::and, Assoc::Left))
        .op(Op::prefix(Rule::not))
        .op(Op::infix(Rule::eq, Assoc::Left)
            | Op::infix(Rule::ne, Assoc::Left)
            | Op::infix(Rule::lt, Assoc::Left)
            | Op::infix(Rule::le, Assoc::Left)
            | Op::infix(Rule::gt, Assoc::Left)
            | Op::infix(Rule::ge, Assoc::Left)
            | Op::infix(Rule::in_op, Assoc::Left))
        .op(Op::infix(Rule::add, Assoc::Left) | Op::infix(Rule::sub, Assoc::Left))
        .op(Op::infix(Rule::mul, Assoc::Left)
            | Op::infix(Rule::div, Assoc::Left)
            | Op::infix(Rule::floordiv, Assoc::Left)
            | Op::infix(Rule::rem, Assoc::Left))
        .op(Op::prefix(Rule::neg))
        .op(Op::postfix(Rule::member) | Op::postfix(Rule::index))
}

thread_local! {
    static PRATT: PrattParser<Rule> = pratt();
}

fn build_expr(p: Pair<Rule>) -> Result<Expr> {
    Ok(build_deep(p)?.0)
}

/// An expression and the depth of its tree (a leaf is 1).
type Deep = (Expr, usize);

/// Builds an expression, refusing trees deeper than [`MAX_EXPR_DEPTH`]: the
/// evaluator, `Clone` and `Drop` walk them recursively.
fn build_deep(p: Pair<Rule>) -> Result<Deep> {
    let terms = p.clone().into_inner().count();
    if terms > MAX_EXPR_TERMS {
        return Err(Error::new(
            ErrorKind::Limit,
            format!("an expression of {terms} operators and operands; at most {MAX_EXPR_TERMS} are allowed"),
        )
        .at(span_of(&p))
        .label("too long")
        .help("split it with `let` bindings"));
    }
    let (e, depth) = PRATT.with(|pratt| build_expr_with(pratt, p.into_inner()))?;
    if depth > MAX_EXPR_DEPTH {
        return Err(Error::new(
            ErrorKind::Limit,
            format!("an expression nests {depth} operations deep; at most {MAX_EXPR_DEPTH} are allowed"),
        )
        .at(e.span)
        .label("too deep")
        .help("split it with `let` bindings"));
    }
    Ok((e, depth))
}

fn build_expr_with(pratt: &PrattParser<Rule>, pairs: Pairs<Rule>) -> Result<Deep> {
    pratt
        .map_primary(build_primary)
        .map_prefix(|op, rhs| {
            let (rhs, d) = rhs?;
            let span = span_of(&op).join(rhs.span);
            let u = if op.as_rule() == Rule::neg { UnaryOp::Neg } else { UnaryOp::Not };
            Ok((Spanned::new(ExprKind::Unary(u, Box::new(rhs)), span), d + 1))
        })
        .map_postfix(|lhs, op| {
            let (lhs, d) = lhs?;
            let span = lhs.span.join(span_of(&op));
            match op.as_rule() {
                Rule::member => {
                    let name = ident(op.into_inner().next().expect("member name"));
                    Ok((Spanned::new(ExprKind::Member(Box::new(lhs), name), span), d + 1))
                }
                _ => {
                    let (idx, di) = build_deep(op.into_inner().next().expect("index expr"))?;
                    Ok((Spanned::new(ExprKind::Index(Box::new(lhs), Box::new(idx)), span), d.max(di) + 1))
                }
            }
        })
        .map_infix(|lhs, op, rhs| {
            let ((lhs, dl), (rhs, dr)) = (lhs?, rhs?);
            let span = lhs.span.join(rhs.span);
            let b = match op.as_rule() {
                Rule::coalesce => BinOp::Coalesce,
                Rule::or => BinOp::Or,
                Rule::and => BinOp::And,
                Rule::eq => BinOp::Eq,
                Rule::ne => BinOp::Ne,
                Rule::lt => BinOp::Lt,
                Rule::le => BinOp::Le,
                Rule::gt => BinOp::Gt,
                Rule::ge => BinOp::Ge,
                Rule::in_op => BinOp::In,
                Rule::add => BinOp::Add,
                Rule::sub => BinOp::Sub,
                Rule::mul => BinOp::Mul,
                Rule::div => BinOp::Div,
                Rule::floordiv => BinOp::FloorDiv,
                Rule::rem => BinOp::Rem,
                r => unreachable!("infix {r:?}"),
            };
            Ok((Spanned::new(ExprKind::Binary(b, Box::new(lhs), Box::new(rhs)), span), dl.max(dr) + 1))
        })
        .parse(pairs)
}

/// The deepest of `parts`, and the parts.
fn deepest(parts: Vec<Deep>) -> (Vec<Expr>, usize) {
    let depth = parts.iter().map(|(_, d)| *d).max().unwrap_or(0);
    (parts.into_iter().map(|(e, _)| e).collect(), depth)
}

fn build_primary(p: Pair<Rule>) -> Result<Deep> {
    let span = span_of(&p);
    let mut depth = 0;
    let kind = match p.as_rule() {
        Rule::int => {
            let v = p.as_str().parse::<i64>().map_err(|_| {
                Error::new(ErrorKind::Syntax, "integer literal out of range").at(span).label("does not fit in 64 bits")
            })?;
            ExprKind::Int(v)
        }
        Rule::float => ExprKind::Float(
            p.as_str()
                .parse::<f64>()
                .map_err(|_| Error::new(ErrorKind::Syntax, "bad number").at(span).label("not a number"))?,
        ),
        Rule::string => ExprKind::Str(unquote(p.as_str())),
        Rule::boolean => ExprKind::Bool(p.as_str() == "true"),
        Rule::null => ExprKind::Null,
        Rule::ident => ExprKind::Name(p.as_str().to_string()),
        Rule::paren => return build_deep(p.into_inner().next().expect("paren expr")),
        Rule::list => {
            let (items, d) = deepest(p.into_inner().map(build_deep).collect::<Result<_>>()?);
            depth = d;
            ExprKind::List(items)
        }
        Rule::if_expr => {
            let mut parts = p.into_inner().filter(|q| q.as_rule() == Rule::expr);
            let (c, dc) = build_deep(parts.next().expect("if cond"))?;
            let (a, da) = build_deep(parts.next().expect("then"))?;
            let (b, db) = build_deep(parts.next().expect("else"))?;
            depth = dc.max(da).max(db);
            ExprKind::If(Box::new(c), Box::new(a), Box::new(b))
        }
        Rule::func_call => {
            let mut inner = p.into_inner();
            let name = ident(inner.next().expect("function name"));
            let (args, d) = deepest(inner.map(build_deep).collect::<Result<_>>()?);
            depth = d;
            ExprKind::Func(name, args)
        }
        r => unreachable!("primary {r:?}"),
    };
    Ok((Spanned::new(kind, span), depth + 1))
}
