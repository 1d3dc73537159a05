//! Property tests: no input makes the compiler panic or hang.
//!
//! Every case runs its input through the library and checks the contract of
//! errors: each `Err` has a non-empty reason, a span (if any) lies within the
//! source, and `mkc::diag::render` of it does not panic. A graph that
//! validates is also run through `report::summarize`, `checkpoint::requirements`
//! and `dot::to_dot`. A watchdog thread aborts the run (printing the input) if
//! one case runs longer than `HANG_SECS`, and a case over `SLOW_SECS` fails.
//!
//! Lowering is given small [`Limits`] (`LIMITS`) so that a mutation such as a
//! huge loop bound fails fast with a `mkc::limit` error.
//!
//! The properties and their cases (CASES_* below), 101,600 in all:
//!
//! | property | cases | input |
//! |---|---|---|
//! | `random_bytes` | 30,000 | random bytes (lossy UTF-8) as a graph and as a config |
//! | `token_soup` | 30,000 | tokens of the language, after a `model` header, compiled |
//! | `expressions` | 20,000 | random compile-time expressions (extreme integers included) in params, `require`, `let`, dims, loop bounds and op attributes |
//! | `mutated_graphs` | 15,000 | the shipped graphs with 1 to 4 mutations, compiled against their tiny configs |
//! | `mutated_configs` | 6,000 | the tiny configs with 1 to 3 mutations, against the unmodified graphs |
//! | `scaled_models` | 600 | valid models: the tiny configs with 1 to 4 hyperparameters (layers, widths, heads, experts, top-k, vocabulary) set to random sizes up to 2^40, at a random batch, context and target, planned, verified and generated (one in 16 written to a temporary folder) |
//!
//! `MKC_FUZZ_SCALE` (a number, default 1) multiplies every property's cases:
//! `MKC_FUZZ_SCALE=10 cargo test --release --test fuzz` runs ten times as many.
//!
//! `deep_nesting_of_every_construct` nests each recursive construct (brackets,
//! calls, indexing, `if` in each of its three parts, `else if`, prefix `-` and
//! `not`, operators, members, `if` and `for` bodies) 65 to 40,000 deep in every
//! place, on a 2 MiB stack: each is refused, none overflows. `deep_config_nesting`
//! nests configs (flow and block lists and mappings) up to 100,000 deep: each
//! past `config::MAX_DEPTH` is refused fast.
//!
//! Full-chain cases (a shipped graph lowered and validated) cost about a
//! millisecond each in release, so most cases are the cheap kinds; the whole
//! file takes about 70 s of one core with `cargo test --release --test fuzz`
//! (docs/language.md, Fuzzing, has the measured runs).

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};
use std::thread::ThreadId;
use std::time::{Duration, Instant};

use mkc::config::Config;
use mkc::lower::Limits;
use proptest::prelude::*;
use proptest::sample::Index;
use proptest::test_runner::TestCaseError;

const CASES_BYTES: u32 = 30_000;
const CASES_SOUP: u32 = 30_000;
const CASES_EXPR: u32 = 20_000;
const CASES_GRAPHS: u32 = 15_000;
const CASES_CONFIGS: u32 = 6_000;
const CASES_SCALED: u32 = 600;

/// A case slower than this fails (and shrinks).
const SLOW_SECS: u64 = 10;
/// A case slower than this aborts the whole run with its input.
const HANG_SECS: u64 = 60;

const LIMITS: Limits = Limits {
    max_nodes: 50_000,
    max_iterations: 20_000,
    max_call_depth: 32,
    max_elements: 1 << 50,
    max_tensors: 200_000,
};
const MODELS: [&str; 3] = ["kimi_k2", "kimi_k3", "kimi_linear"];

/// `MKC_FUZZ_SCALE` (a number, default 1) multiplies every property's cases.
fn scale() -> f64 {
    std::env::var("MKC_FUZZ_SCALE").ok().and_then(|s| s.parse::<f64>().ok()).filter(|x| *x > 0.0).unwrap_or(1.0)
}

fn config_of(cases: u32) -> ProptestConfig {
    let cases = (f64::from(cases) * scale()).round().clamp(1.0, f64::from(u32::MAX)) as u32;
    ProptestConfig { cases, failure_persistence: None, ..ProptestConfig::default() }
}

// ---- the shipped graphs -----------------------------------------------------

struct Model {
    graph: String,
    tiny_text: String,
    tiny: Config,
}

fn models() -> &'static [Model] {
    static MODELS_DATA: OnceLock<Vec<Model>> = OnceLock::new();
    MODELS_DATA.get_or_init(|| {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("model_graphs");
        MODELS
            .iter()
            .map(|m| {
                let graph = std::fs::read_to_string(root.join(m).join("graph.mkc")).expect("graph file");
                let tiny_text = std::fs::read_to_string(root.join(m).join("tiny.json")).expect("tiny config");
                let tiny = Config::parse(&tiny_text, "tiny.json").expect("tiny config parses");
                Model { graph, tiny_text, tiny }
            })
            .collect()
    })
}

// ---- hang detection ---------------------------------------------------------

type Running = Mutex<HashMap<ThreadId, (Instant, String)>>;

fn running() -> &'static Running {
    static RUNNING: OnceLock<Running> = OnceLock::new();
    static WATCHDOG: OnceLock<()> = OnceLock::new();
    let map = RUNNING.get_or_init(Running::default);
    WATCHDOG.get_or_init(|| {
        std::thread::spawn(|| loop {
            std::thread::sleep(Duration::from_secs(1));
            let map = RUNNING.get().expect("set before the watchdog starts");
            let guard = map.lock().unwrap_or_else(|e| e.into_inner());
            for (start, input) in guard.values() {
                if start.elapsed() > Duration::from_secs(HANG_SECS) {
                    eprintln!("fuzz: a case has run for over {HANG_SECS} s; its input:\n{input}");
                    std::process::abort();
                }
            }
        });
    });
    map
}

/// Registers the case running on this thread with the watchdog until dropped.
struct Watch {
    start: Instant,
}

impl Watch {
    fn new(input: impl FnOnce() -> String) -> Watch {
        let start = Instant::now();
        running().lock().unwrap_or_else(|e| e.into_inner()).insert(std::thread::current().id(), (start, input()));
        Watch { start }
    }

    fn check(&self, what: &str) -> Result<(), TestCaseError> {
        let t = self.start.elapsed();
        prop_assert!(t < Duration::from_secs(SLOW_SECS), "{what} took {t:?}");
        Ok(())
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        running().lock().unwrap_or_else(|e| e.into_inner()).remove(&std::thread::current().id());
    }
}

// ---- the contract -----------------------------------------------------------

fn check_error(err: &mkc::Error, source: &str) -> Result<(), TestCaseError> {
    prop_assert!(!err.reason.trim().is_empty(), "empty reason: {err:?}");
    if let Some(span) = err.span {
        prop_assert!(
            span.start <= span.end && span.end <= source.len(),
            "span {span:?} outside the source of {} bytes: {err:?}",
            source.len()
        );
    }
    let rendered = mkc::diag::render(err, "f.mkc", source);
    prop_assert!(!rendered.is_empty());
    Ok(())
}

/// Compiles `source` against `config` and, if it validates, runs every
/// consumer of the validated graph.
fn full_chain(source: &str, config: &Config) -> Result<(), TestCaseError> {
    match mkc::compile_str(source, config, LIMITS) {
        Ok(v) => {
            for context in [0, 1, 4096] {
                let s = mkc::report::summarize(&v, context, &[1, 8]);
                prop_assert!(!s.render().is_empty());
            }
            let _ = mkc::checkpoint::requirements(&v);
            prop_assert!(!mkc::dot::to_dot(&v).is_empty());
            Ok(())
        }
        Err(e) => check_error(&e, source),
    }
}

fn parse_only(source: &str) -> Result<(), TestCaseError> {
    if let Err(e) = mkc::front::parse_str(source) {
        check_error(&e, source)?;
    }
    Ok(())
}

fn empty_config() -> &'static Config {
    static EMPTY: OnceLock<Config> = OnceLock::new();
    EMPTY.get_or_init(|| Config::parse("{}", "empty").expect("empty config"))
}

// ---- the token alphabet -----------------------------------------------------

const TOKENS: &[&str] = &[
    // keywords
    "model",
    "params",
    "block",
    "graph",
    "weight",
    "state",
    "input",
    "output",
    "for",
    "in",
    "if",
    "then",
    "else",
    "require",
    "let",
    "return",
    "and",
    "or",
    "not",
    "true",
    "false",
    "null",
    "scale",
    // names, types, ops, built-ins
    "x",
    "h",
    "m",
    "p",
    "layer",
    "hidden",
    "token",
    "config",
    "ctx",
    "_",
    "int",
    "float",
    "bool",
    "str",
    "bf16",
    "f16",
    "f32",
    "i32",
    "i64",
    "u8",
    "fp8e4m3",
    "mxfp4",
    "embedding",
    "rms_norm",
    "gated_rms_norm",
    "l2_norm",
    "linear",
    "add",
    "mul",
    "silu",
    "sigmoid",
    "softplus",
    "situ",
    "act_and_mul",
    "rope",
    "conv_update",
    "mla_decode",
    "kda_decode",
    "router",
    "moe",
    "attn_res_mix",
    "stack",
    "split",
    "lm_head",
    "argmax",
    "min",
    "max",
    "cdiv",
    "len",
    "sqrt",
    "ln",
    "exp",
    "pow",
    "dtype",
    "eps",
    "heads",
    "sizes",
    "act",
    "top_k",
    // numbers
    "0",
    "1",
    "2",
    "3",
    "-1",
    "7",
    "64",
    "128",
    "4096",
    "1048576",
    "9223372036854775807",
    "9223372036854775808",
    "-9223372036854775807",
    "18446744073709551616",
    "99999999999999999999999",
    "0.0",
    "1.0",
    "2.5",
    "1e-6",
    "1e308",
    "1e309",
    "1E-400",
    "0e0",
    // punctuation and operators
    "(",
    ")",
    "[",
    "]",
    "{",
    "}",
    ",",
    ":",
    ".",
    "..",
    "->",
    "=",
    "==",
    "!=",
    "<",
    "<=",
    ">",
    ">=",
    "+",
    "-",
    "*",
    "/",
    "//",
    "%",
    "??",
    "#",
    "\n",
    "\"",
    "\\",
    // strings
    "\"\"",
    "\"x\"",
    "\"{layer}\"",
    "\"model.layers.{layer}.w\"",
    "\"{e}\"",
    "\"{\"",
    "\"}\"",
    "\"{}\"",
    "\"{{layer}}\"",
    "\"{nope}\"",
    "\"\\\"\"",
    "\"bf16\"",
    "\"silu\"",
    "\"softplus\"",
    "\"yarn\"",
    "\"\u{e9}\u{1F600}\"",
    // config paths
    "config.hidden_size",
    "config.num_hidden_layers",
    "config.vocab_size",
    "config.x.y",
    "config.model",
    "config.linear_attn_config.full_attn_layers",
    "config.layer_types[0]",
    // extreme integer expressions
    "(-9223372036854775807 - 1)",
    "(-9223372036854775807 - 1) / -1",
    "(-9223372036854775807 - 1) // -1",
    "(-9223372036854775807 - 1) % -1",
    "cdiv(-9223372036854775807 - 1, -1)",
    "-(-9223372036854775807 - 1)",
    "9223372036854775807 + 1",
    "9223372036854775807 * 2",
    "1 / 0",
    "1 // 0",
    "1 % 0",
    "1.0 / 0.0",
    "0.0 / 0.0",
    "pow(2, 1024)",
    "sqrt(-1)",
    "ln(0)",
    "exp(1000)",
];

fn token() -> impl Strategy<Value = &'static str> {
    prop::sample::select(TOKENS)
}

/// A line-ish run of tokens joined by spaces, or glued together.
fn soup() -> impl Strategy<Value = String> {
    (prop::collection::vec((token(), any::<bool>()), 0..60)).prop_map(|ts| {
        let mut s = String::new();
        for (t, glue) in ts {
            if !glue && !s.is_empty() {
                s.push(' ');
            }
            s.push_str(t);
        }
        s
    })
}

// ---- random compile-time expressions ----------------------------------------

const ATOMS: &[&str] = &[
    "0",
    "1",
    "2",
    "-1",
    "3",
    "64",
    "9223372036854775807",
    "-9223372036854775807",
    "(-9223372036854775807 - 1)",
    "4611686018427387904",
    "2147483648",
    "1125899906842624",
    "0.0",
    "-0.0",
    "0.5",
    "1e-6",
    "1e308",
    "1e309",
    "true",
    "false",
    "null",
    "\"\"",
    "\"a\"",
    "\"{i}\"",
    "\"bf16\"",
    "\"mxfp4\"",
    "[]",
    "[1, 2]",
    "[[0]]",
    "bf16",
    "fp8e4m3",
    "mxfp4",
    "i32",
    "ctx",
    "config",
    "config.a",
    "config.n",
    "config.big",
    "config.neg",
    "config.list",
    "config.list[1]",
    "config.map.k",
    "config.s",
    "config.f",
    "config.nil",
    "a",
    "b",
    "i",
    "undefined",
];

const BINOPS: &[&str] = &["+", "-", "*", "/", "//", "%", "??", "==", "!=", "<", "<=", ">", ">=", "and", "or", "in"];

const FUNCS: &[&str] = &["min", "max", "cdiv", "len", "sqrt", "ln", "exp", "pow", "float", "dtype", "nope"];

fn expr() -> impl Strategy<Value = String> {
    let leaf = prop::sample::select(ATOMS).prop_map(str::to_string);
    leaf.prop_recursive(5, 40, 4, |inner| {
        prop_oneof![
            (inner.clone(), prop::sample::select(BINOPS), inner.clone()).prop_map(|(a, op, b)| format!("{a} {op} {b}")),
            (inner.clone(), prop::sample::select(BINOPS), inner.clone())
                .prop_map(|(a, op, b)| format!("({a} {op} {b})")),
            inner.clone().prop_map(|a| format!("-{a}")),
            inner.clone().prop_map(|a| format!("not {a}")),
            (inner.clone(), inner.clone(), inner.clone()).prop_map(|(c, a, b)| format!("if {c} then {a} else {b}")),
            (prop::sample::select(FUNCS), prop::collection::vec(inner.clone(), 0..4))
                .prop_map(|(f, args)| format!("{f}({})", args.join(", "))),
            prop::collection::vec(inner.clone(), 0..4).prop_map(|items| format!("[{}]", items.join(", "))),
            (inner.clone(), inner.clone()).prop_map(|(a, i)| format!("{a}[{i}]")),
            (inner, prop::sample::select(&["k", "x", "model", "in", "list"][..]))
                .prop_map(|(a, k)| format!("({a}).{k}")),
        ]
    })
}

const EXPR_CONFIG: &str = r#"{"a": 3, "n": 2, "big": 9223372036854775807, "neg": -9223372036854775808,
  "list": [1, 2.5, "x", null, [3]], "map": {"k": 4}, "s": "bf16", "f": 1e308, "nil": null}"#;

fn expr_config() -> &'static Config {
    static C: OnceLock<Config> = OnceLock::new();
    C.get_or_init(|| Config::parse(EXPR_CONFIG, "expr.json").expect("expression config"))
}

/// A small graph with compile-time expressions in every place one can be,
/// each `@` standing for one; with the [`SLOTS`] defaults it validates.
const EXPR_TEMPLATE: &str = "model m
params {
  a = @
  b = @
}
block f(x: bf16[_], n: int) -> bf16[_] {
  let c = @
  require @, \"r {n}\"
  y = silu(x)
  return y
}
graph {
  require @, \"msg\"
  let d = @
  input token: i32[]
  weight embed: bf16[@, @] = @
  weight w2: @[4, 4] = \"w2\", scale @
  weight nw: bf16[4] = \"nw.{a}.{d}\"
  h = embedding(token, embed)
  for i in @..@ {
    h = f(h, n: @)
  }
  if @ {
    h = rms_norm(h, nw, eps: @)
  }
  h = linear(h, w2)
  h1, h2 = split(h, sizes: @)
  output h1, h2
}
";

/// The default of each `@` of [`EXPR_TEMPLATE`], in order.
const SLOTS: [&str; 17] = [
    "3",
    "2",
    "1",
    "true",
    "a > b",
    "a * b",
    "8",
    "4",
    "\"embed.{a}\"",
    "bf16",
    "\"s\"",
    "0",
    "b",
    "i",
    "true",
    "1e-6",
    "[2, 2]",
];

fn expr_graph(es: &[Option<String>]) -> String {
    let mut out = String::new();
    let mut k = 0;
    for c in EXPR_TEMPLATE.chars() {
        if c == '@' {
            match es.get(k) {
                Some(Some(e)) => out.push_str(e),
                _ => out.push_str(SLOTS[k]),
            }
            k += 1;
        } else {
            out.push(c);
        }
    }
    out
}

// ---- mutations of the shipped graphs ---------------------------------------

#[derive(Debug, Clone, Copy, PartialEq)]
enum Tok {
    Ident,
    Number,
    Str,
}

/// The identifiers, numbers and string literals of `src`, as byte ranges.
fn lex(src: &[u8]) -> Vec<(Tok, usize, usize)> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < src.len() {
        let c = src[i];
        if c == b'#' {
            while i < src.len() && src[i] != b'\n' {
                i += 1;
            }
        } else if c == b'"' {
            let s = i;
            i += 1;
            while i < src.len() && src[i] != b'"' && src[i] != b'\n' {
                i += if src[i] == b'\\' { 2 } else { 1 };
            }
            i = (i + 1).min(src.len());
            out.push((Tok::Str, s, i));
        } else if c.is_ascii_alphabetic() || c == b'_' {
            let s = i;
            while i < src.len() && (src[i].is_ascii_alphanumeric() || src[i] == b'_') {
                i += 1;
            }
            out.push((Tok::Ident, s, i));
        } else if c.is_ascii_digit() {
            let s = i;
            while i < src.len() && (src[i].is_ascii_alphanumeric() || src[i] == b'.' && src.get(i + 1) != Some(&b'.')) {
                i += 1;
            }
            out.push((Tok::Number, s, i));
        } else {
            i += 1;
        }
    }
    out
}

const NUMBERS: &[&str] = &[
    "0",
    "-1",
    "1",
    "2",
    "3",
    "1000000",
    "1048576",
    "1048577",
    "4294967296",
    "9223372036854775807",
    "9223372036854775808",
    "-9223372036854775807",
    "(-9223372036854775807 - 1)",
    "99999999999999999999",
    "0.0",
    "-0.5",
    "1e308",
    "1e309",
    "1e-320",
];

#[derive(Debug, Clone)]
enum Mutation {
    /// Delete a byte range.
    Delete(Index, u8),
    /// Insert a token of the language.
    Insert(Index, &'static str),
    /// Insert arbitrary bytes.
    InsertBytes(Index, Vec<u8>),
    /// Replace a byte range by a token.
    Replace(Index, u8, &'static str),
    /// Duplicate a line.
    DuplicateLine(Index),
    /// Delete a line.
    DeleteLine(Index),
    /// Swap two lines.
    SwapLines(Index, Index),
    /// Replace a number literal.
    Number(Index, &'static str),
    /// Replace one identifier by another of the file.
    SwapIdent(Index, Index),
    /// Rename every occurrence of an identifier to another of the file.
    RenameAll(Index, Index),
    /// Replace a string literal by one of the token alphabet.
    Str(Index, &'static str),
    /// Splice a byte range of another graph in.
    Splice(usize, Index, u8, Index),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    let strings = prop::sample::select(TOKENS.iter().copied().filter(|t| t.starts_with('"')).collect::<Vec<_>>());
    prop_oneof![
        1 => (any::<Index>(), 1u8..64).prop_map(|(i, n)| Mutation::Delete(i, n)),
        1 => (any::<Index>(), token()).prop_map(|(i, t)| Mutation::Insert(i, t)),
        1 => (any::<Index>(), prop::collection::vec(any::<u8>(), 1..8)).prop_map(|(i, b)| Mutation::InsertBytes(i, b)),
        1 => (any::<Index>(), 1u8..16, token()).prop_map(|(i, n, t)| Mutation::Replace(i, n, t)),
        1 => any::<Index>().prop_map(Mutation::DuplicateLine),
        1 => any::<Index>().prop_map(Mutation::DeleteLine),
        1 => (any::<Index>(), any::<Index>()).prop_map(|(a, b)| Mutation::SwapLines(a, b)),
        3 => (any::<Index>(), prop::sample::select(NUMBERS)).prop_map(|(i, n)| Mutation::Number(i, n)),
        2 => (any::<Index>(), any::<Index>()).prop_map(|(a, b)| Mutation::SwapIdent(a, b)),
        1 => (any::<Index>(), any::<Index>()).prop_map(|(a, b)| Mutation::RenameAll(a, b)),
        1 => (any::<Index>(), strings).prop_map(|(i, s)| Mutation::Str(i, s)),
        1 => (0..MODELS.len(), any::<Index>(), 1u8..255, any::<Index>())
            .prop_map(|(m, from, n, to)| Mutation::Splice(m, from, n, to)),
    ]
}

fn line_ranges(src: &[u8]) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut s = 0;
    for (i, &c) in src.iter().enumerate() {
        if c == b'\n' {
            out.push((s, i + 1));
            s = i + 1;
        }
    }
    if s < src.len() {
        out.push((s, src.len()));
    }
    out
}

fn apply(src: &mut Vec<u8>, m: &Mutation) {
    let pos = |i: &Index, len: usize| i.index(len + 1);
    match m {
        Mutation::Delete(i, n) => {
            let s = pos(i, src.len());
            let e = (s + *n as usize).min(src.len());
            src.drain(s..e);
        }
        Mutation::Insert(i, t) => {
            let s = pos(i, src.len());
            src.splice(s..s, t.bytes());
        }
        Mutation::InsertBytes(i, b) => {
            let s = pos(i, src.len());
            src.splice(s..s, b.iter().copied());
        }
        Mutation::Replace(i, n, t) => {
            let s = pos(i, src.len());
            let e = (s + *n as usize).min(src.len());
            src.splice(s..e, t.bytes());
        }
        Mutation::DuplicateLine(i) | Mutation::DeleteLine(i) => {
            let lines = line_ranges(src);
            if lines.is_empty() {
                return;
            }
            let (s, e) = lines[i.index(lines.len())];
            if matches!(m, Mutation::DuplicateLine(_)) {
                let line = src[s..e].to_vec();
                src.splice(e..e, line);
            } else {
                src.drain(s..e);
            }
        }
        Mutation::SwapLines(a, b) => {
            let lines = line_ranges(src);
            if lines.is_empty() {
                return;
            }
            let (a, b) = (a.index(lines.len()), b.index(lines.len()));
            let (a, b) = (a.min(b), a.max(b));
            if a == b {
                return;
            }
            let (la, lb) = (lines[a], lines[b]);
            let mut out = src[..la.0].to_vec();
            out.extend_from_slice(&src[lb.0..lb.1]);
            out.extend_from_slice(&src[la.1..lb.0]);
            out.extend_from_slice(&src[la.0..la.1]);
            out.extend_from_slice(&src[lb.1..]);
            *src = out;
        }
        Mutation::Number(i, n) => replace_tok(src, Tok::Number, i, n.as_bytes()),
        Mutation::Str(i, s) => replace_tok(src, Tok::Str, i, s.as_bytes()),
        Mutation::SwapIdent(a, b) => {
            let idents: Vec<_> = lex(src).into_iter().filter(|t| t.0 == Tok::Ident).collect();
            if idents.is_empty() {
                return;
            }
            let (_, s, e) = idents[a.index(idents.len())];
            let (_, bs, be) = idents[b.index(idents.len())];
            let name = src[bs..be].to_vec();
            src.splice(s..e, name);
        }
        Mutation::RenameAll(a, b) => {
            let idents: Vec<_> = lex(src).into_iter().filter(|t| t.0 == Tok::Ident).collect();
            if idents.is_empty() {
                return;
            }
            let (_, s, e) = idents[a.index(idents.len())];
            let (_, bs, be) = idents[b.index(idents.len())];
            let (from, to) = (src[s..e].to_vec(), src[bs..be].to_vec());
            let mut out = Vec::with_capacity(src.len());
            let mut last = 0;
            for (_, s, e) in idents {
                if src[s..e] == from[..] {
                    out.extend_from_slice(&src[last..s]);
                    out.extend_from_slice(&to);
                    last = e;
                }
            }
            out.extend_from_slice(&src[last..]);
            *src = out;
        }
        Mutation::Splice(m, from, n, to) => {
            let other = models()[*m].graph.as_bytes();
            let s = from.index(other.len());
            let e = (s + *n as usize).min(other.len());
            let t = pos(to, src.len());
            src.splice(t..t, other[s..e].iter().copied());
        }
    }
}

fn replace_tok(src: &mut Vec<u8>, kind: Tok, i: &Index, with: &[u8]) {
    let toks: Vec<_> = lex(src).into_iter().filter(|t| t.0 == kind).collect();
    if toks.is_empty() {
        return;
    }
    let (_, s, e) = toks[i.index(toks.len())];
    src.splice(s..e, with.iter().copied());
}

// ---- mutations of the configs -----------------------------------------------

#[derive(Debug, Clone)]
enum ConfigMutation {
    /// Replace the value at a path (any node, containers included).
    Set(Index, Value),
    /// Remove the key at a path.
    Remove(Index),
    /// Add a key to a mapping.
    Add(Index, &'static str, Value),
}

#[derive(Debug, Clone)]
enum Value {
    Null,
    Bool(bool),
    Int(i64),
    U64(u64),
    Float(f64),
    Str(&'static str),
    EmptyList,
    List,
    EmptyMap,
}

impl Value {
    fn json(&self) -> serde_json::Value {
        use serde_json::json;
        match self {
            Value::Null => json!(null),
            Value::Bool(b) => json!(b),
            Value::Int(i) => json!(i),
            Value::U64(u) => json!(u),
            Value::Float(f) => serde_json::Number::from_f64(*f).map_or(json!(null), serde_json::Value::Number),
            Value::Str(s) => json!(s),
            Value::EmptyList => json!([]),
            Value::List => json!([0, -1, 3, 6, 100, "x", null]),
            Value::EmptyMap => json!({}),
        }
    }
}

const INTS: &[i64] = &[
    0,
    -1,
    1,
    2,
    3,
    7,
    64,
    1 << 20,
    (1 << 20) + 1,
    1 << 31,
    1 << 32,
    1 << 40,
    1 << 62,
    i64::MAX,
    i64::MIN,
    -(1 << 40),
];

const FLOATS: &[f64] = &[0.0, -0.0, 0.5, -1.5, 1e-6, 1e300, -1e300, f64::MIN_POSITIVE];

const STRS: &[&str] = &[
    "",
    "x",
    "fp8",
    "yarn",
    "silu",
    "situ",
    "gelu",
    "softmax",
    "sigmoid",
    "full_attention",
    "sparse",
    "bf16",
    "{layer}",
    "{",
    "mxfp4-pack-quantized",
];

fn value() -> impl Strategy<Value = Value> {
    prop_oneof![
        1 => Just(Value::Null),
        1 => any::<bool>().prop_map(Value::Bool),
        3 => prop::sample::select(INTS).prop_map(Value::Int),
        1 => any::<i64>().prop_map(Value::Int),
        1 => Just(Value::U64(u64::MAX)),
        1 => prop::sample::select(FLOATS).prop_map(Value::Float),
        1 => prop::sample::select(STRS).prop_map(Value::Str),
        1 => Just(Value::EmptyList),
        1 => Just(Value::List),
        1 => Just(Value::EmptyMap),
    ]
}

/// Keys the graphs read that the tiny configs may not have.
const EXTRA_KEYS: &[&str] = &[
    "quantization_config",
    "quant_method",
    "weight_block_size",
    "rope_scaling",
    "rope_theta",
    "factor",
    "type",
    "rope_type",
    "original_max_position_embeddings",
    "mscale_all_dim",
    "mlp_layer_types",
    "layer_types",
    "moe_layer_freq",
    "scoring_func",
    "num_local_experts",
    "mkc_key_prefix",
    "logit_scale",
    "attn_res_block_size",
    "a_log_len",
    "o_norm_eps",
    "use_full_rank_gate",
    "text_config",
    "linear_attn_config",
    "full_attn_layers",
    "format",
];

fn config_mutation() -> impl Strategy<Value = ConfigMutation> {
    prop_oneof![
        4 => (any::<Index>(), value()).prop_map(|(i, v)| ConfigMutation::Set(i, v)),
        2 => any::<Index>().prop_map(ConfigMutation::Remove),
        1 => (any::<Index>(), prop::sample::select(EXTRA_KEYS), value()).prop_map(|(i, k, v)| ConfigMutation::Add(i, k, v)),
    ]
}

/// Every node of `v` as a JSON pointer, the root first.
fn pointers(v: &serde_json::Value, at: String, out: &mut Vec<String>) {
    out.push(at.clone());
    match v {
        serde_json::Value::Object(m) => {
            for (k, x) in m {
                pointers(x, format!("{at}/{}", k.replace('~', "~0").replace('/', "~1")), out);
            }
        }
        serde_json::Value::Array(a) => {
            for (i, x) in a.iter().enumerate() {
                pointers(x, format!("{at}/{i}"), out);
            }
        }
        _ => {}
    }
}

fn apply_config(v: &mut serde_json::Value, m: &ConfigMutation) {
    let mut ps = Vec::new();
    pointers(v, String::new(), &mut ps);
    match m {
        ConfigMutation::Set(i, x) => {
            // Skip the root: replacing it would only test "not a mapping".
            let p = &ps[1 + i.index(ps.len() - 1)];
            if let Some(slot) = v.pointer_mut(p) {
                *slot = x.json();
            }
        }
        ConfigMutation::Remove(i) => {
            let p = &ps[1 + i.index(ps.len() - 1)];
            let (parent, key) = p.rsplit_once('/').expect("non-root pointers have a parent");
            match v.pointer_mut(parent) {
                Some(serde_json::Value::Object(m)) => {
                    m.remove(&key.replace("~1", "/").replace("~0", "~"));
                }
                Some(serde_json::Value::Array(a)) => {
                    if let Ok(k) = key.parse::<usize>() {
                        if k < a.len() {
                            a.remove(k);
                        }
                    }
                }
                _ => {}
            }
        }
        ConfigMutation::Add(i, k, x) => {
            let maps: Vec<&String> = ps.iter().filter(|p| v.pointer(p).is_some_and(|x| x.is_object())).collect();
            let p = maps[i.index(maps.len())].clone();
            if let Some(serde_json::Value::Object(m)) = v.pointer_mut(&p) {
                m.insert(k.to_string(), x.json());
            }
        }
    }
}

// ---- the properties -----------------------------------------------------------

proptest! {
    #![proptest_config(config_of(CASES_BYTES))]

    /// Random bytes, as a graph (against an empty config) and as a config.
    #[test]
    fn random_bytes(bytes in prop::collection::vec(any::<u8>(), 0..400), header in any::<bool>()) {
        let mut text = String::from_utf8_lossy(&bytes).into_owned();
        if header {
            text.insert_str(0, "model m\n");
        }
        let w = Watch::new(|| format!("{text:?}"));
        full_chain(&text, empty_config())?;
        match Config::parse(&text, "random.json") {
            Ok(c) => full_chain(&models()[0].graph, &c)?,
            Err(e) => {
                prop_assert!(!e.reason.trim().is_empty());
                prop_assert!(e.span.is_none(), "a config error points into the graph: {e:?}");
            }
        }
        w.check("random bytes")?;
    }
}

proptest! {
    #![proptest_config(config_of(CASES_SOUP))]

    /// Tokens of the language, in random order, after a `model` header and
    /// often inside a `graph { }` or `params { }`, against an empty config and
    /// the K2 tiny config.
    #[test]
    fn token_soup(body in soup(), wrap in 0u8..4) {
        let text = match wrap {
            0 => format!("model m\n{body}"),
            1 => format!("model m\ngraph {{\n{body}\n}}\n"),
            2 => format!("model m\nparams {{\n{body}\n}}\ngraph {{ input t: i32[]\n output t }}\n"),
            _ => body,
        };
        let w = Watch::new(|| text.clone());
        parse_only(&text)?;
        full_chain(&text, empty_config())?;
        full_chain(&text, &models()[0].tiny)?;
        w.check("token soup")?;
    }
}

proptest! {
    #![proptest_config(config_of(CASES_EXPR))]

    /// Random compile-time expressions in every place a graph has one.
    #[test]
    fn expressions(es in prop::collection::vec(prop::option::weighted(0.2, expr()), SLOTS.len())) {
        let text = expr_graph(&es);
        let w = Watch::new(|| text.clone());
        full_chain(&text, expr_config())?;
        w.check("expressions")?;
    }
}

proptest! {
    #![proptest_config(config_of(CASES_GRAPHS))]

    /// The shipped graphs with a few mutations, against their tiny configs.
    #[test]
    fn mutated_graphs(m in 0..MODELS.len(), ms in prop::collection::vec(mutation(), 1..5)) {
        let model = &models()[m];
        let mut src = model.graph.as_bytes().to_vec();
        for x in &ms {
            apply(&mut src, x);
        }
        let text = String::from_utf8_lossy(&src).into_owned();
        let w = Watch::new(|| text.clone());
        full_chain(&text, &model.tiny)?;
        w.check("mutated graph")?;
    }
}

proptest! {
    #![proptest_config(config_of(CASES_CONFIGS))]

    /// The tiny configs with a few mutations, against the unmodified graphs.
    #[test]
    fn mutated_configs(m in 0..MODELS.len(), ms in prop::collection::vec(config_mutation(), 1..4)) {
        let model = &models()[m];
        let mut v: serde_json::Value = serde_json::from_str(&model.tiny_text).expect("tiny config is JSON");
        for x in &ms {
            apply_config(&mut v, x);
        }
        let text = serde_json::to_string_pretty(&v).expect("JSON serializes");
        let w = Watch::new(|| text.clone());
        match Config::parse(&text, "mutated.json") {
            Ok(c) => full_chain(&model.graph, &c)?,
            Err(e) => prop_assert!(!e.reason.trim().is_empty()),
        }
        w.check("mutated config")?;
    }
}

// ---- valid models, planned and generated ------------------------------------

/// The hyperparameters `scaled_models` sets: the last key of a config path.
const SCALED_KEYS: &[&str] = &[
    "num_hidden_layers",
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "routed_expert_hidden_size",
    "n_routed_experts",
    "num_experts",
    "num_experts_per_tok",
    "num_experts_per_token",
    "n_shared_experts",
    "num_shared_experts",
    "num_attention_heads",
    "num_key_value_heads",
    "num_heads",
    "head_dim",
    "kv_lora_rank",
    "q_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "vocab_size",
    "first_k_dense_replace",
    "n_group",
    "num_expert_group",
    "topk_group",
    "short_conv_kernel_size",
    "attn_res_block_size",
];

/// A size a model might have: small counts, multiples of 8 and 32 (what the
/// device tiles), and powers of two up to 2^40 (past every bound).
fn size() -> impl Strategy<Value = i64> {
    prop_oneof![
        4 => 0i64..=9,
        4 => (1i64..=32).prop_map(|x| x * 8),
        2 => (1i64..=64).prop_map(|x| x * 32),
        1 => (0u32..=40).prop_map(|p| 1i64 << p),
    ]
}

/// What a scaled-model case plans and generates for.
#[derive(Debug, Clone)]
struct Scaled {
    model: usize,
    sets: Vec<(Index, i64)>,
    target: &'static str,
    batch: u32,
    context: u64,
    tables_only: bool,
}

fn scaled() -> impl Strategy<Value = Scaled> {
    (
        0..MODELS.len(),
        prop::collection::vec((any::<Index>(), size()), 1..5),
        prop::sample::select(&["h200", "b200", "gb300"][..]),
        prop_oneof![4 => 1u32..=8, 1 => 1u32..=64],
        prop_oneof![3 => Just(4096u64), 1 => 1u64..=(1 << 24)],
        prop::bool::weighted(0.2),
    )
        .prop_map(|(model, sets, target, batch, context, tables_only)| Scaled {
            model,
            sets,
            target,
            batch,
            context,
            tables_only,
        })
}

fn target(name: &str) -> &'static mkc::target::Target {
    static TARGETS: OnceLock<HashMap<String, mkc::target::Target>> = OnceLock::new();
    let all = TARGETS.get_or_init(|| {
        ["h200", "b200", "gb300"]
            .iter()
            .map(|t| (t.to_string(), mkc::target::Target::load(t).expect("shipped target")))
            .collect()
    });
    &all[name]
}

/// The cases `scaled_models` has written to a folder so far (one in 16 is).
static WRITTEN: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// Plans, verifies and generates `v`; every error must keep the contract.
fn plan_and_emit(v: &mkc::valid::Validated, source: &str, s: &Scaled) -> Result<(), TestCaseError> {
    let options = mkc::plan::Options { batch: s.batch, context: s.context, ..Default::default() };
    let plan = match mkc::plan::plan(v, target(s.target), options) {
        Ok(p) => p,
        Err(e) => return check_error(&e, source),
    };
    prop_assert!(!mkc::plan::estimate::render_structure(&plan).is_empty());
    let from = mkc::emit::Provenance { graph: "g\n#error x\n.mkc".into(), config: "c*/.json".into() };
    let artifact = match mkc::emit::emit(v, &plan, "fuzz", &from, source, s.tables_only) {
        Ok(a) => a,
        Err(e) => return check_error(&e, source),
    };
    prop_assert!(!artifact.plan.is_empty());
    for (name, text) in &artifact.files {
        prop_assert!(!text.lines().any(|l| l.starts_with("#error")), "{name} holds an injected line");
    }
    if WRITTEN.fetch_add(1, std::sync::atomic::Ordering::Relaxed).is_multiple_of(16) {
        let dir = tempfile::tempdir().expect("temp dir");
        let mut files: Vec<(String, Vec<u8>)> =
            artifact.files.iter().map(|(f, t)| (f.clone(), t.as_bytes().to_vec())).collect();
        files.push((mkc::emit::PLAN_FILE.to_string(), artifact.plan.clone()));
        let written = mkc::files::write_folder(&dir.path().join("out"), &files);
        prop_assert!(written.is_ok_and(|w| w.len() == files.len()));
    }
    Ok(())
}

proptest! {
    #![proptest_config(config_of(CASES_SCALED))]

    /// The three model families with their tiny configs' hyperparameters
    /// (layer counts, widths, heads, expert counts, top-k, vocabulary) set to
    /// random sizes, at a random batch, context and target: whatever
    /// validates is planned, verified and generated (sometimes into a
    /// folder), and nothing panics; errors are fine.
    #[test]
    fn scaled_models(s in scaled()) {
        let model = &models()[s.model];
        let mut v: serde_json::Value = serde_json::from_str(&model.tiny_text).expect("tiny config is JSON");
        let mut ps = Vec::new();
        pointers(&v, String::new(), &mut ps);
        ps.retain(|p| SCALED_KEYS.iter().any(|k| p.rsplit('/').next() == Some(k)));
        for (i, x) in &s.sets {
            let p = &ps[i.index(ps.len())];
            if let Some(slot) = v.pointer_mut(p) {
                *slot = (*x).into();
            }
        }
        let text = serde_json::to_string_pretty(&v).expect("JSON serializes");
        let w = Watch::new(|| format!("{s:?}\n{text}"));
        let config = Config::parse(&text, "scaled.json").expect("a config of numbers parses");
        match mkc::compile_str(&model.graph, &config, LIMITS) {
            Ok(valid) => plan_and_emit(&valid, &model.graph, &s)?,
            Err(e) => check_error(&e, &model.graph)?,
        }
        w.check("scaled model")?;
    }
}

/// The shipped graphs compile against their tiny configs, so mutations start
/// from a valid graph.
#[test]
fn shipped_graphs_compile() {
    for (name, m) in MODELS.iter().zip(models()) {
        if let Err(e) = mkc::compile_str(&m.graph, &m.tiny, LIMITS) {
            panic!("{name}: {}", mkc::diag::render(&e, "graph.mkc", &m.graph));
        }
    }
    let one = expr_graph(&[]);
    if let Err(e) = mkc::compile_str(&one, expr_config(), LIMITS) {
        panic!("{}", mkc::diag::render(&e, "expr.mkc", &one));
    }
}

/// Every recursive construct of the language nested far past the limits, in
/// every place an expression or a statement goes: each is refused with a
/// `mkc::limit` error (or another clean error), never a stack overflow, on a
/// thread with a 2 MiB stack (the test harness's default; `mkc` itself runs
/// on an 8 MiB main thread).
#[test]
fn deep_nesting_of_every_construct() {
    // (opening, closing, innermost) of one construct.
    const EXPRS: [(&str, &str, &str); 13] = [
        ("(", ")", "1"),
        ("[", "]", "1"),
        ("max(", ", 1)", "1"),
        ("[1, 2][", "]", "0"),
        ("-", "", "1"),
        ("not ", "", "true"),
        ("if true then ", " else 0", "1"),
        ("if ", " then true else false", "true"),
        ("if false then 0 else ", "", "1"),
        ("1 + ", "", "1"),
        ("", ".x", "config"),
        ("(1 + 2 * ", ")", "3"),
        ("if true then 1 else if false then 2 else ", "", "3"),
    ];
    const STMTS: [(&str, &str); 3] =
        [("if true {\n", "\n}"), ("for i in 0..1 {\n", "\n}"), ("if false {\n} else if true {\n", "\n}")];
    let places = |e: &str| {
        [
            format!("model m\nparams {{\n  x = {e}\n}}\ngraph {{\n  input t: i32[]\n  output t\n}}\n"),
            format!("model m\ngraph {{\n  require {e}, \"m\"\n  input t: i32[]\n  output t\n}}\n"),
            format!("model m\ngraph {{\n  let x = {e}\n  input t: i32[]\n  output t\n}}\n"),
            format!("model m\ngraph {{\n  input t: i32[{e}]\n  output t\n}}\n"),
            format!("model m\ngraph {{\n  for i in 0..{e} {{\n  }}\n  input t: i32[]\n  output t\n}}\n"),
        ]
    };
    let mut cases = vec![];
    for n in [65, 300, 5_000, 40_000] {
        for (open, close, inner) in EXPRS {
            let e = format!("{}{inner}{}", open.repeat(n), close.repeat(n));
            cases.extend(places(&e).map(|src| (n, src)));
        }
        for (open, close) in STMTS {
            let body = format!("{}let x = 1{}", open.repeat(n), close.repeat(n));
            cases.push((n, format!("model m\ngraph {{\n{body}\n  input t: i32[]\n  output t\n}}\n")));
        }
    }
    let run = std::thread::Builder::new()
        .stack_size(2 << 20)
        .spawn(move || {
            for (n, src) in &cases {
                let head = &src[..src.len().min(200)];
                match mkc::compile_str(src, empty_config(), LIMITS) {
                    // Past the limits, every construct is refused as too deep or too long.
                    Ok(_) => assert!(*n < 300, "a nesting of {n} compiled:\n{head}"),
                    Err(e) => {
                        assert!(!mkc::diag::render(&e, "deep.mkc", src).is_empty());
                        assert!(e.kind == mkc::ErrorKind::Limit || *n < 300, "{e:?}\n{head}");
                    }
                }
            }
        })
        .expect("thread starts");
    run.join().expect("no deep nesting crashes the compiler");
}

/// Configs nested 50 to 100,000 deep by every construct (flow lists and
/// mappings, block lists and mappings by indentation, `- ` on one line):
/// refused as a `mkc::limit` past `MAX_DEPTH`, in well under a second each,
/// and parsed below it.
#[test]
fn deep_config_nesting() {
    let max = mkc::config::MAX_DEPTH;
    for n in [50, max, max + 1, 5_000, 100_000] {
        let block_maps: String = (0..n.min(5_000)).map(|i| format!("{}k:\n", " ".repeat(i))).collect();
        for (name, text) in [
            ("flow lists", format!("{{\"a\": {}1{}}}", "[".repeat(n - 1), "]".repeat(n - 1))),
            ("flow maps", format!("{}1{}", "{\"a\": ".repeat(n), "}".repeat(n))),
            ("dashes", format!("a:\n  {}1\n", "- ".repeat(n - 1))),
            ("block maps", format!("{block_maps}{}1\n", " ".repeat(n.min(5_000)))),
        ] {
            let start = Instant::now();
            let r = Config::parse(&text, "deep.yaml");
            let t = start.elapsed();
            assert!(t < Duration::from_secs(2), "{name} {n}: {t:?}");
            let levels = if name == "block maps" { n.min(5_000) } else { n };
            match r {
                Ok(_) => assert!(levels <= max, "{name} {n}: a config nested {levels} deep parsed"),
                Err(e) => {
                    assert!(levels > max, "{name} {n}: {e:?}");
                    assert_eq!(e.kind, mkc::ErrorKind::Limit, "{name} {n}: {e:?}");
                }
            }
        }
    }
}
