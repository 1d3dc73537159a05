//! Reads the planner/device contract (`device/mkc/contract.h`) and defines
//! its constants for Rust (`src/contract.rs` includes the result): one
//! definition of every number both sides use. `kScratchBytes` becomes
//! `SCRATCH_BYTES: u64`.

use std::collections::HashMap;
use std::fmt::Write;

fn rust_name(c: &str) -> String {
    let mut out = String::new();
    for (i, ch) in c.trim_start_matches('k').chars().enumerate() {
        if ch.is_ascii_uppercase() && i > 0 {
            out.push('_');
        }
        out.push(ch.to_ascii_uppercase());
    }
    out
}

fn main() {
    let path = "device/mkc/contract.h";
    println!("cargo:rerun-if-changed={path}");
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("cannot read {path}: {e}"));
    let mut values: HashMap<String, u64> = HashMap::new();
    let mut out = String::new();
    for (n, line) in text.lines().enumerate() {
        let Some(rest) = line.trim().strip_prefix("constexpr ") else { continue };
        let (decl, expr) = rest.split_once('=').unwrap_or_else(|| panic!("{path}:{}: no value", n + 1));
        let name = decl.split_whitespace().last().unwrap_or_else(|| panic!("{path}:{}: no name", n + 1));
        let expr = expr.trim().trim_end_matches(';').trim();
        let value = |t: &str| -> u64 {
            t.parse().ok().or_else(|| values.get(t).copied()).unwrap_or_else(|| panic!("{path}:{}: {t}", n + 1))
        };
        let tokens: Vec<&str> = expr.split_whitespace().collect();
        let v = match tokens.as_slice() {
            [a] => value(a),
            [a, "*", b] => value(a) * value(b),
            [a, "<<", b] => value(a) << value(b),
            _ => panic!("{path}:{}: `{expr}` is not a number, a name, or one * or << of them", n + 1),
        };
        values.insert(name.to_string(), v);
        let _ = writeln!(out, "/// `{name}` of device/mkc/contract.h.\npub const {}: u64 = {v};", rust_name(name));
    }
    let dest = std::path::Path::new(&std::env::var("OUT_DIR").expect("cargo sets OUT_DIR")).join("contract.rs");
    std::fs::write(&dest, out).unwrap_or_else(|e| panic!("cannot write {}: {e}", dest.display()));
}
