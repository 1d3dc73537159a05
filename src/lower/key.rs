//! The characters a checkpoint key may hold. Keys reach generated output (the
//! plan file's weight table, which the runtime matches against the
//! checkpoint, and messages and comments that name a weight), and part of a
//! key can come from the config (`config.mkc_key_prefix`), so a key is
//! checked once, where lowering builds it: printable ASCII (space to `~`)
//! except `"` and `\`, at most [`MAX_KEY_BYTES`] long. No control character,
//! quote or backslash can then close a string or start a line in anything
//! generated from it.
//!
//! It does not check that the key names a tensor of the checkpoint; that is
//! `checkpoint::check`'s job.

use std::collections::BTreeMap;

use super::Const;
use crate::diag::{Error, ErrorKind, Result, Span};

/// The longest checkpoint key, in bytes (real ones are under 200): keys are
/// built once per layer and expert and stored in the plan file's string
/// table, so a long prefix from the config must not multiply into gigabytes.
pub const MAX_KEY_BYTES: usize = 1024;

/// Whether `c` may stand in a checkpoint key.
pub fn allowed(c: char) -> bool {
    matches!(c, ' '..='~') && c != '"' && c != '\\'
}

/// Checks every character of `key` (built for the weight declared at `span`);
/// an error names the first bad character, the key (escaped) and each config
/// key whose string value holds that character and is part of the key.
pub fn check(key: &str, span: Span, config: &BTreeMap<String, Const>) -> Result<()> {
    if key.len() > MAX_KEY_BYTES {
        let start: String = key.chars().take(40).collect();
        return Err(Error::new(
            ErrorKind::Limit,
            format!(
                "checkpoint key \"{}...\" is {} bytes, longer than {MAX_KEY_BYTES}",
                start.escape_debug(),
                key.len()
            ),
        )
        .at(span)
        .label("this key"));
    }
    let Some((at, bad)) = key.char_indices().find(|(_, c)| !allowed(*c)) else {
        return Ok(());
    };
    let mut sources = vec![];
    config_strings(config, "config", &mut |path, s| {
        if s.contains(bad) && key.contains(s) {
            sources.push(format!("`{path}`"));
        }
    });
    let from =
        if sources.is_empty() { String::new() } else { format!(" (it comes from config key {})", sources.join(", ")) };
    Err(Error::new(
        ErrorKind::Value,
        format!(
            "checkpoint key \"{}\" holds {:?} at byte {at}{from}; a key is printable ASCII without `\"` or `\\`",
            key.escape_debug(),
            bad
        ),
    )
    .at(span)
    .label("this key")
    .help("keys name tensors of the checkpoint and are written into generated files"))
}

/// Calls `f(path, value)` for every string in the config tree.
fn config_strings(map: &BTreeMap<String, Const>, path: &str, f: &mut dyn FnMut(&str, &str)) {
    for (k, v) in map {
        walk(v, &format!("{path}.{k}"), f);
    }
}

fn walk(v: &Const, path: &str, f: &mut dyn FnMut(&str, &str)) {
    match v {
        Const::Str(s) => f(path, s),
        Const::List(items) => {
            for (i, x) in items.iter().enumerate() {
                walk(x, &format!("{path}[{i}]"), f);
            }
        }
        Const::Map(m) => config_strings(m, path, f),
        _ => {}
    }
}
