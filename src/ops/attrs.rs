//! Op attributes: compile-time values given by name at a call site, checked
//! against each op's schema.

use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt;

use crate::ir::DType;

/// The kind of value an attribute takes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum AttrKind {
    /// An integer.
    Int,
    /// A number.
    Float,
    /// A boolean.
    Bool,
    /// One of the listed words.
    Choice(&'static [&'static str]),
    /// A list of integers.
    IntList,
    /// An element type.
    DType,
}

impl fmt::Display for AttrKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AttrKind::Int => f.write_str("an integer"),
            AttrKind::Float => f.write_str("a number"),
            AttrKind::Bool => f.write_str("true or false"),
            AttrKind::Choice(c) => write!(f, "one of \"{}\"", c.join("\", \"")),
            AttrKind::IntList => f.write_str("a list of integers"),
            AttrKind::DType => f.write_str("a dtype"),
        }
    }
}

/// An attribute's value.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum AttrValue {
    /// An integer.
    Int(i64),
    /// A number.
    Float(f64),
    /// A boolean.
    Bool(bool),
    /// A word from a choice.
    Str(String),
    /// Integers.
    IntList(Vec<i64>),
    /// An element type.
    DType(DType),
}

impl fmt::Display for AttrValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AttrValue::Int(v) => write!(f, "{v}"),
            AttrValue::Float(v) => write!(f, "{v:?}"),
            AttrValue::Bool(v) => write!(f, "{v}"),
            AttrValue::Str(v) => write!(f, "{v}"),
            AttrValue::IntList(v) => write!(f, "{v:?}"),
            AttrValue::DType(v) => write!(f, "{v}"),
        }
    }
}

/// One attribute in an op's schema.
#[derive(Debug, Clone, Copy)]
pub struct AttrDef {
    /// Its name at the call site.
    pub name: &'static str,
    /// What it takes.
    pub kind: AttrKind,
    /// Its value when not given; `None` makes it required.
    pub default: Option<fn() -> AttrValue>,
}

/// The attributes of one op node, complete (defaults filled in).
#[derive(Debug, Clone, PartialEq, Default, Serialize)]
pub struct Attrs(pub BTreeMap<&'static str, AttrValue>);

impl Attrs {
    /// An integer attribute (the schema guarantees its presence and kind).
    pub fn int(&self, name: &str) -> i64 {
        match self.0.get(name) {
            Some(AttrValue::Int(v)) => *v,
            other => panic!("attribute {name} is not an int: {other:?}"),
        }
    }

    /// A float attribute.
    pub fn float(&self, name: &str) -> f64 {
        match self.0.get(name) {
            Some(AttrValue::Float(v)) => *v,
            Some(AttrValue::Int(v)) => *v as f64,
            other => panic!("attribute {name} is not a float: {other:?}"),
        }
    }

    /// A word attribute.
    pub fn str(&self, name: &str) -> &str {
        match self.0.get(name) {
            Some(AttrValue::Str(v)) => v,
            other => panic!("attribute {name} is not a word: {other:?}"),
        }
    }

    /// A boolean attribute.
    pub fn bool(&self, name: &str) -> bool {
        match self.0.get(name) {
            Some(AttrValue::Bool(v)) => *v,
            other => panic!("attribute {name} is not a bool: {other:?}"),
        }
    }

    /// A list attribute.
    pub fn int_list(&self, name: &str) -> &[i64] {
        match self.0.get(name) {
            Some(AttrValue::IntList(v)) => v,
            other => panic!("attribute {name} is not a list: {other:?}"),
        }
    }

    /// A dtype attribute.
    pub fn dtype(&self, name: &str) -> DType {
        match self.0.get(name) {
            Some(AttrValue::DType(v)) => *v,
            other => panic!("attribute {name} is not a dtype: {other:?}"),
        }
    }

    /// `name = value` pairs, for printing.
    pub fn render(&self) -> String {
        self.0.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(", ")
    }
}
