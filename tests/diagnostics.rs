//! The diagnostics corpus: malformed inputs and the diagnostics they get.
//!
//! Two kinds of case live under `tests/diagnostics/`:
//!
//! - `NAME.mkc`: a malformed graph. Its first line is `# expect: LINE:COL`
//!   (1-based, where the error's span must start) or `# expect: none` (the
//!   error has no place in the graph file); its second line is `# ...`, one
//!   sentence saying what is wrong. A sibling `NAME.json` is the config (else
//!   `{}`).
//! - `config/MODEL__NAME.json`: a broken config for the shipped graph
//!   `model_graphs/MODEL/graph.mkc`, with the expected `LINE:COL` (or `none`)
//!   in `config/MODEL__NAME.expect`.
//!
//! A case may also carry `# known-bug: LINE:COL ...` (third line of a `.mkc`,
//! or a second line of a `.expect`): where the compiler points today although
//! `expect` is right. The test then holds the compiler to the known-bug
//! position, so the bug stays visible and the test fails once it is fixed
//! (delete the line then).
//!
//! Each case must fail to compile (or to load its config), its error must
//! start at the stated place, and `mkc::diag::render` of it is an insta
//! snapshot under `tests/snapshots/`, reviewed like code. Inputs that make the
//! compiler panic are kept out of the run, in `diagnostics/known_panics.txt`.

use std::fs;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;

use mkc::config::Config;
use mkc::lower::Limits;
use mkc::Error;

/// Where a diagnostic must point.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Place {
    At(usize, usize),
    Nowhere,
}

impl std::fmt::Display for Place {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Place::At(l, c) => write!(f, "{l}:{c}"),
            Place::Nowhere => f.write_str("none"),
        }
    }
}

fn parse_place(text: &str) -> Option<Place> {
    let word = text.split_whitespace().next()?;
    if word == "none" {
        return Some(Place::Nowhere);
    }
    let (l, c) = word.split_once(':')?;
    Some(Place::At(l.parse().ok()?, c.parse().ok()?))
}

/// What a case expects: the right place, and where a known bug puts it today.
struct Expectation {
    place: Place,
    known_bug: Option<Place>,
    description: String,
}

impl Expectation {
    /// The place the compiler must report now.
    fn current(&self) -> Place {
        self.known_bug.unwrap_or(self.place)
    }
}

/// Reads the header of a `.mkc` case.
fn mkc_expectation(source: &str) -> Result<Expectation, String> {
    let mut lines = source.lines();
    let first = lines.next().unwrap_or_default();
    let place = first
        .strip_prefix("# expect:")
        .and_then(parse_place)
        .ok_or_else(|| format!("first line must be `# expect: LINE:COL` or `# expect: none`, found {first:?}"))?;
    let second = lines.next().unwrap_or_default();
    let description = second
        .strip_prefix("# ")
        .filter(|d| !d.trim().is_empty() && !d.starts_with("known-bug:"))
        .ok_or_else(|| format!("second line must be `# <what is wrong>`, found {second:?}"))?
        .trim()
        .to_string();
    let known_bug = match lines.next().and_then(|l| l.strip_prefix("# known-bug:")) {
        Some(rest) => Some(parse_place(rest).ok_or_else(|| format!("bad `# known-bug:` line: {rest:?}"))?),
        None => None,
    };
    Ok(Expectation { place, known_bug, description })
}

/// Reads a `.expect` file of a config case.
fn config_expectation(text: &str, description: String) -> Result<Expectation, String> {
    let mut lines = text.lines();
    let first = lines.next().unwrap_or_default();
    let place = parse_place(first).ok_or_else(|| format!("expected `LINE:COL` or `none`, found {first:?}"))?;
    let known_bug = match lines.next().and_then(|l| l.strip_prefix("known-bug:")) {
        Some(rest) => Some(parse_place(rest).ok_or_else(|| format!("bad `known-bug:` line: {rest:?}"))?),
        None => None,
    };
    Ok(Expectation { place, known_bug, description })
}

/// The path of `path` relative to the crate, with `/` separators, so that
/// snapshots do not depend on where the repository is checked out.
fn relative(path: &Path) -> String {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let rel = path.strip_prefix(root).unwrap_or(path);
    rel.components().map(|c| c.as_os_str().to_string_lossy().into_owned()).collect::<Vec<_>>().join("/")
}

fn read(path: &Path) -> Result<String, String> {
    fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", relative(path)))
}

/// Loads the config and compiles; the error, or why there is none.
fn compile_err(source: &str, config_text: &str, config_origin: &str) -> Result<Error, String> {
    let outcome = catch_unwind(AssertUnwindSafe(|| {
        let config = Config::parse(config_text, config_origin)?;
        mkc::compile_str(source, &config, Limits::default()).map(|_| ())
    }));
    match outcome {
        Ok(Ok(())) => Err("compiled without an error".to_string()),
        Ok(Err(e)) => Ok(e),
        Err(_) => Err("the compiler panicked (move the input to diagnostics/known_panics.txt)".to_string()),
    }
}

/// Runs one case: compiles, checks the place, snapshots the rendering.
/// Returns a sentence for each thing that is wrong.
fn check_case(
    kind: &str,
    case: &str,
    expectation: Result<Expectation, String>,
    graph_name: &str,
    source: &str,
    config_text: &str,
    config_origin: &str,
) -> Vec<String> {
    let expectation = match expectation {
        Ok(e) => e,
        Err(msg) => return vec![format!("{case}: {msg}")],
    };
    let err = match compile_err(source, config_text, config_origin) {
        Ok(e) => e,
        Err(msg) => return vec![format!("{case}: {msg}")],
    };
    let rendered = mkc::diag::render(&err, graph_name, source);
    let actual = match err.span {
        Some(span) => {
            let (l, c) = span.line_col(source);
            Place::At(l, c)
        }
        None => Place::Nowhere,
    };
    let mut problems = vec![];
    if actual != expectation.current() {
        let what = match expectation.known_bug {
            Some(_) => format!(
                "the known bug moved: the error is at {actual}, the case records {} (the right place is {}); \
                 if it is fixed, delete the known-bug line",
                expectation.current(),
                expectation.place
            ),
            None => format!("the error is at {actual}, expected {}", expectation.place),
        };
        problems.push(format!("{case}: {what}\n{rendered}"));
    }
    let mut settings = insta::Settings::clone_current();
    settings.set_description(expectation.description.clone());
    settings.bind(|| insta::assert_snapshot!(kind, rendered));
    problems
}

fn fail_if_any(problems: &[String]) {
    assert!(problems.is_empty(), "{} case(s) went wrong:\n\n{}", problems.len(), problems.join("\n\n"));
}

/// Fails on the cases' own problems (a case that compiles, an error in the
/// wrong place) first, then on snapshot mismatches, which insta's `glob!`
/// reports by panicking once all files ran.
fn finish(problems: Vec<String>, snapshots: std::thread::Result<()>) {
    fail_if_any(&problems);
    if let Err(panic) = snapshots {
        std::panic::resume_unwind(panic);
    }
}

/// Malformed graphs: `tests/diagnostics/*.mkc`.
#[test]
fn graph_cases() {
    let mut problems = vec![];
    let snapshots = catch_unwind(AssertUnwindSafe(|| {
        insta::glob!("diagnostics/*.mkc", |path| {
            let case = relative(path);
            let source = match read(path) {
                Ok(s) => s,
                Err(e) => return problems.push(e),
            };
            let config_path = path.with_extension("json");
            let (config_text, config_origin) = if config_path.exists() {
                match read(&config_path) {
                    Ok(t) => (t, relative(&config_path)),
                    Err(e) => return problems.push(e),
                }
            } else {
                ("{}".to_string(), "(empty config)".to_string())
            };
            problems.extend(check_case(
                "graph",
                &case,
                mkc_expectation(&source),
                &case,
                &source,
                &config_text,
                &config_origin,
            ));
        });
    }));
    finish(problems, snapshots);
}

/// Shipped graphs with broken configs: `tests/diagnostics/config/*.json`.
#[test]
fn config_cases() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut problems = vec![];
    let snapshots = catch_unwind(AssertUnwindSafe(|| {
        insta::glob!("diagnostics/config/*.json", |path| {
            let case = relative(path);
            let stem = path.file_stem().and_then(|s| s.to_str()).unwrap_or_default();
            let Some((model, name)) = stem.split_once("__") else {
                return problems.push(format!("{case}: the name must be MODEL__NAME.json"));
            };
            let graph_path = root.join("model_graphs").join(model).join("graph.mkc");
            let graph_name = relative(&graph_path);
            let (source, config_text, expect) =
                match (read(&graph_path), read(path), read(&path.with_extension("expect"))) {
                    (Ok(s), Ok(c), Ok(e)) => (s, c, e),
                    (a, b, c) => {
                        return problems
                            .extend([a.err(), b.err(), c.err()].into_iter().flatten().map(|e| format!("{case}: {e}")))
                    }
                };
            let description = format!("{model} with a broken config: {}", name.replace('_', " "));
            problems.extend(check_case(
                "config",
                &case,
                config_expectation(&expect, description),
                &graph_name,
                &source,
                &config_text,
                &case,
            ));
        });
    }));
    finish(problems, snapshots);
}

/// Every config beside a graph case belongs to one, and every config case has
/// its `.expect`.
#[test]
fn corpus_is_well_formed() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/diagnostics");
    let mut problems = vec![];
    let mut graph_cases = 0;
    for entry in fs::read_dir(&dir).expect("tests/diagnostics exists") {
        let path = entry.expect("a directory entry").path();
        match path.extension().and_then(|e| e.to_str()) {
            Some("mkc") => graph_cases += 1,
            Some("json") if !path.with_extension("mkc").exists() => {
                problems.push(format!("{} is a config without a graph case", relative(&path)));
            }
            _ => {}
        }
    }
    let mut config_cases = 0;
    for entry in fs::read_dir(dir.join("config")).expect("tests/diagnostics/config exists") {
        let path = entry.expect("a directory entry").path();
        match path.extension().and_then(|e| e.to_str()) {
            Some("json") => {
                config_cases += 1;
                if !path.with_extension("expect").exists() {
                    problems.push(format!("{} has no .expect", relative(&path)));
                }
            }
            Some("expect") if !path.with_extension("json").exists() => {
                problems.push(format!("{} has no .json", relative(&path)));
            }
            _ => {}
        }
    }
    assert!(graph_cases + config_cases >= 40, "the corpus has only {} cases", graph_cases + config_cases);
    fail_if_any(&problems);
}
