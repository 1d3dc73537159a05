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
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::new(ErrorKind::Io, format!("cannot read config {}: {e}", path.display())))?;
        Config::parse(&text, &path.display().to_string())
    }

    /// Parses config text; `origin` names it in errors.
    pub fn parse(text: &str, origin: &str) -> Result<Config> {
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
