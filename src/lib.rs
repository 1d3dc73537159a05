//! mkc: a compiler from a model's decode-step graph to one persistent CUDA
//! megakernel and its runtime.
//!
//! The pipeline is a chain of pure stages with plain data between them:
//! `parse -> lower -> validate -> (plan -> schedule -> emit)`. This crate
//! currently provides the front end, the op graph and its validation, the
//! summary report and the checkpoint checker.

#![deny(missing_docs)]

pub mod checkpoint;
pub mod config;
pub mod contract;
pub mod diag;
pub mod dot;
pub mod emit;
pub mod files;
pub mod front;
pub mod ir;
pub mod lower;
pub mod ops;
pub mod plan;
pub mod report;
pub mod sizes;
pub mod target;
pub mod valid;

use std::path::Path;

pub use diag::{Error, ErrorKind, Result};

/// Parses, lowers and validates a graph source against a config.
pub fn compile_str(source: &str, config: &config::Config, limits: lower::Limits) -> Result<valid::Validated> {
    front::parse_str(source).and_then(|file| lower::lower(&file, config, limits)).and_then(valid::validate)
}

/// The config a graph file uses when none is given: `config.json` beside it.
pub fn default_config_path(graph: &Path) -> std::path::PathBuf {
    graph.parent().unwrap_or(Path::new(".")).join("config.json")
}
