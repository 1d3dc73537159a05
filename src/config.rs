//! Model configs: a Hugging Face `config.json` (YAML is a superset of JSON)
//! or a YAML file of hyperparameters, read into a tree of [`Const`] values.
//!
//! A config with a nested `text_config` (multimodal wrappers such as K3's) is
//! flattened: the keys of `text_config` are visible at the top level, and win
//! over top-level keys of the same name. `config.text_config.x` still works.

use std::collections::BTreeMap;
use std::path::Path;

use crate::diag::{Error, ErrorKind, Result};
use crate::lower::Const;

/// A loaded config.
#[derive(Debug, Clone)]
pub struct Config {
    /// Where it was read from (for diagnostics).
    pub origin: String,
    /// Its top-level mapping, `text_config` merged in.
    pub root: BTreeMap<String, Const>,
}

impl Config {
    /// Reads a config file.
    pub fn load(path: &Path) -> Result<Config> {
        let text = crate::files::read_input(path, crate::files::Input::Config)?;
        Config::parse(&text, &path.display().to_string())
    }

    /// Parses config text; `origin` names it in errors.
    pub fn parse(text: &str, origin: &str) -> Result<Config> {
        if let Some((line, column)) = too_deep(text) {
            return Err(Error::new(
                ErrorKind::Limit,
                format!("config {origin} nests lists and mappings deeper than {MAX_DEPTH} levels (line {line}, column {column})"),
            )
            .help("a model config is a few levels deep"));
        }
        let value: serde_yaml::Value = serde_yaml::from_str(text).map_err(|e| {
            let place = e.location().map(|l| format!(" at line {}, column {}", l.line(), l.column()));
            Error::new(
                ErrorKind::Config,
                format!("config {origin} is not valid JSON or YAML{}: {e}", place.unwrap_or_default()),
            )
        })?;
        let Const::Map(mut root) = from_yaml(&value, origin, "")? else {
            return Err(Error::new(ErrorKind::Config, format!("config {origin} must be a mapping of keys to values")));
        };
        if let Some(Const::Map(text_config)) = root.get("text_config").cloned() {
            for (k, v) in text_config {
                root.insert(k, v);
            }
        }
        Ok(Config { origin: origin.to_string(), root })
    }
}

/// The deepest nesting of sequences and mappings a config may have (flow
/// brackets and block indentation alike). The YAML loader reads a whole
/// document before it applies its own limit (128), and libyaml's scanner
/// takes time that grows with the square of the flow nesting (100,000 `[`
/// took half a minute), so [`too_deep`] streams the document's events first
/// and stops at the first one deeper than this.
pub const MAX_DEPTH: usize = 100;

/// Where the first sequence or mapping deeper than [`MAX_DEPTH`] starts
/// (line and column, from 1), by libyaml's own reading of the text, event by
/// event. Syntax errors are left to the real parse, which reports them.
fn too_deep(text: &str) -> Option<(usize, usize)> {
    use libyaml_rs as sys;
    use std::mem::MaybeUninit;
    // SAFETY: the parser lives in a box that is not moved while libyaml holds
    // pointers into it, reads only `text` (which outlives it), is deleted
    // once, and each event is deleted after its fields are read.
    unsafe {
        let mut parser: Box<MaybeUninit<sys::yaml_parser_t>> = Box::new(MaybeUninit::uninit());
        let p = parser.as_mut_ptr();
        if sys::yaml_parser_initialize(p).fail {
            return None;
        }
        sys::yaml_parser_set_encoding(p, sys::YAML_UTF8_ENCODING);
        sys::yaml_parser_set_input_string(p, text.as_ptr(), text.len() as u64);
        let mut depth = 0usize;
        let mut found = None;
        loop {
            let mut event = MaybeUninit::<sys::yaml_event_t>::uninit();
            let e = event.as_mut_ptr();
            if sys::yaml_parser_parse(p, e).fail {
                break;
            }
            let (kind, mark) = ((*e).type_, (*e).start_mark);
            sys::yaml_event_delete(e);
            match kind {
                sys::YAML_SEQUENCE_START_EVENT | sys::YAML_MAPPING_START_EVENT => {
                    depth += 1;
                    if depth > MAX_DEPTH {
                        found = Some((mark.line as usize + 1, mark.column as usize + 1));
                        break;
                    }
                }
                sys::YAML_SEQUENCE_END_EVENT | sys::YAML_MAPPING_END_EVENT => depth = depth.saturating_sub(1),
                sys::YAML_STREAM_END_EVENT => break,
                _ => {}
            }
        }
        sys::yaml_parser_delete(p);
        found
    }
}

fn from_yaml(v: &serde_yaml::Value, origin: &str, path: &str) -> Result<Const> {
    use serde_yaml::Value as Y;
    Ok(match v {
        Y::Null => Const::Null,
        Y::Bool(b) => Const::Bool(*b),
        Y::Number(n) => match n.as_i64() {
            Some(i) => Const::Int(i),
            None => Const::Float(n.as_f64().unwrap_or(f64::NAN)),
        },
        Y::String(s) => Const::Str(s.clone()),
        Y::Sequence(items) => Const::List(
            items
                .iter()
                .enumerate()
                .map(|(i, x)| from_yaml(x, origin, &format!("{path}[{i}]")))
                .collect::<Result<_>>()?,
        ),
        Y::Mapping(m) => {
            let mut out = BTreeMap::new();
            for (k, x) in m {
                let Some(key) = k.as_str() else {
                    return Err(Error::new(
                        ErrorKind::Config,
                        format!("config {origin}: a key under `{path}` is not a string"),
                    ));
                };
                out.insert(key.to_string(), from_yaml(x, origin, &format!("{path}.{key}"))?);
            }
            Const::Map(out)
        }
        Y::Tagged(t) => from_yaml(&t.value, origin, path)?,
    })
}
