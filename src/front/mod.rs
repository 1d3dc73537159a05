//! The front end: the decode-graph language's grammar, parser and AST.

pub mod ast;
mod parser;

pub use parser::{parse_str, MAX_ELSE_IF, MAX_EXPR_DEPTH, MAX_EXPR_TERMS, MAX_NESTING};
