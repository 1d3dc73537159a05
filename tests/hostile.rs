//! Hostile input (issue 20): the `mkc` command under ordinary shell misuse and
//! deliberately broken inputs ends with a clear error naming the file, line,
//! field or key, and never panics, hangs, fills memory or writes outside its
//! output folder.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

fn mkc() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_mkc"));
    c.current_dir(env!("CARGO_MANIFEST_DIR"));
    c
}

fn root(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Runs `mkc ARGS` and returns its output.
fn run(args: &[&str]) -> Output {
    mkc().args(args).output().expect("mkc runs")
}

/// Asserts `mkc ARGS` fails without a panic, its stderr holding every one of `needles`.
fn refuses(args: &[&str], needles: &[&str]) -> String {
    let out = run(args);
    let err = text(&out.stderr);
    assert!(!err.contains("panicked"), "mkc {args:?} panicked:\n{err}");
    assert_eq!(out.status.code(), Some(1), "mkc {args:?} must fail with status 1; stderr:\n{err}");
    for n in needles {
        assert!(err.contains(n), "mkc {args:?}: stderr must name {n:?}:\n{err}");
    }
    err
}

// ---- (8) standard output that cannot be written --------------------------

/// `mkc graph ... | head -c 10`: the reader goes away after 10 bytes; mkc ends
/// quietly with 141 (128 + SIGPIPE, what the shell reports for coreutils).
#[test]
fn broken_pipe_ends_quietly() {
    let mut child = mkc()
        .args(["graph", "model_graphs/kimi_k3/graph.mkc"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("mkc starts");
    let mut head = [0u8; 10];
    child.stdout.take().expect("stdout").read_exact(&mut head).expect("10 bytes");
    // The pipe's read end closes here; the K3 listing is far larger than a pipe buffer.
    let out = child.wait_with_output().expect("mkc ends");
    let err = text(&out.stderr);
    assert!(err.is_empty(), "a broken pipe ends quietly, stderr was:\n{err}");
    assert_eq!(out.status.code(), Some(141));
}

/// Standard output on a full disk: a clear error, status 1, no panic.
#[test]
fn full_disk_is_a_clear_error() {
    for args in [["graph", "model_graphs/kimi_k3/graph.mkc"], ["check", "model_graphs/kimi_k2/graph.mkc"]] {
        let full = std::fs::OpenOptions::new().write(true).open("/dev/full").expect("/dev/full");
        let out = mkc().args(args).stdout(full).output().expect("mkc runs");
        let err = text(&out.stderr);
        assert!(!err.contains("panicked"), "{err}");
        assert!(err.contains("cannot write to standard output: No space left on device"), "{err}");
        assert_eq!(out.status.code(), Some(1));
    }
}

// ---- (5) writes outside the output folder --------------------------------

const CODEGEN_OUTPUTS: [&str; 5] = ["program.cuh", "model.cu", "CMakeLists.txt", "plan_summary.txt", "plan.mkcplan"];

fn codegen_into(folder: &Path) -> Output {
    let out = folder.to_str().expect("utf-8 path");
    run(&[
        "codegen",
        "model_graphs/kimi_k2/graph.mkc",
        "--config",
        "model_graphs/kimi_k2/tiny.json",
        "--target",
        "h200",
        "-o",
        out,
    ])
}

/// Any output file that is a symbolic link is refused by name, before
/// anything is written, and the file it points at is untouched.
#[test]
fn codegen_refuses_symbolic_links_in_the_output_folder() {
    for name in CODEGEN_OUTPUTS {
        let dir = tempfile::tempdir().expect("temp dir");
        let victim = dir.path().join("victim.txt");
        std::fs::write(&victim, "precious").expect("victim");
        let folder = dir.path().join("out");
        std::fs::create_dir(&folder).expect("out");
        std::os::unix::fs::symlink("../victim.txt", folder.join(name)).expect("link");
        let out = codegen_into(&folder);
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{name}: {err}");
        assert!(err.contains(&format!("{}: it is a symbolic link", folder.join(name).display())), "{name}: {err}");
        assert_eq!(std::fs::read_to_string(&victim).expect("victim"), "precious", "{name}");
        // Nothing else was written either, and no temporary file is left.
        let left: Vec<_> = std::fs::read_dir(&folder).expect("out").map(|e| e.expect("entry").file_name()).collect();
        assert_eq!(left, [std::ffi::OsString::from(name)], "{name}");
    }
}

/// A plain run writes every file, replacing what was there, and leaves no
/// temporary file behind.
#[test]
fn codegen_replaces_files_and_leaves_no_temporaries() {
    let dir = tempfile::tempdir().expect("temp dir");
    let folder = dir.path().join("out");
    std::fs::create_dir(&folder).expect("out");
    std::fs::write(folder.join("model.cu"), "old").expect("old file");
    let out = codegen_into(&folder);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let mut names: Vec<String> = std::fs::read_dir(&folder)
        .expect("out")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    let mut want: Vec<String> = CODEGEN_OUTPUTS.iter().map(|s| s.to_string()).collect();
    want.sort();
    assert_eq!(names, want);
    assert_ne!(std::fs::read_to_string(folder.join("model.cu")).expect("model.cu"), "old");
}

// ---- (2) nesting that would overflow the stack ---------------------------

/// Writes `text` to `name` in a fresh temporary folder.
fn temp_file(name: &str, text: &str) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join(name);
    std::fs::write(&path, text).expect("write");
    (dir, path)
}

/// The 72 KB params expression of 3,600 nested `if true then ...
/// else 0`, the same nesting in a condition and in a `require`: a
/// `mkc::limit` error naming the line, not a stack overflow.
#[test]
fn deeply_nested_if_is_a_limit_error() {
    let n = 3_600;
    let sources = [
        format!("model m\nparams {{\n  x = {}1{}\n}}\n", "if true then ".repeat(n), " else 0".repeat(n)),
        format!(
            "model m\nparams {{\n  x = if {}true{} then 1 else 0\n}}\n",
            "if ".repeat(n),
            " then true else false".repeat(n)
        ),
        format!(
            "model m\ngraph {{\n  require {}true{}, \"m\"\n}}\n",
            "if true then ".repeat(n),
            " else false".repeat(n)
        ),
    ];
    for src in sources {
        let (_dir, graph) = temp_file("deep.mkc", &src);
        let (_cdir, config) = temp_file("config.json", "{}");
        let g = graph.to_str().expect("utf-8");
        let err = refuses(&["check", g, "--config", config.to_str().expect("utf-8")], &["error[mkc::limit]"]);
        assert!(err.starts_with(&format!("{g}:3:")), "the error names line 3:\n{err}");
    }
}

// ---- (3) target files --------------------------------------------------------

/// The shipped h200 target with `line` (a whole `key: value` line) replaced.
fn h200_with(key: &str, line: &str) -> String {
    let h200 = std::fs::read_to_string(root("targets/h200.yaml")).expect("h200");
    let mut found = false;
    let text: Vec<String> = h200
        .lines()
        .map(|l| {
            if l.trim_start().starts_with(&format!("{key}:")) {
                found = true;
                let indent = &l[..l.len() - l.trim_start().len()];
                format!("{indent}{line}")
            } else {
                l.to_string()
            }
        })
        .collect();
    assert!(found, "h200.yaml has no {key}");
    text.join("\n") + "\n"
}

/// Out-of-range target fields are refused, naming the file, the field and the
/// bound, before anything is sized from them.
#[test]
fn target_fields_are_bounded() {
    let cases = [
        ("sms", "sms: 4294967295", "`sms` is 4294967295; it must be in 1..=1024"),
        ("sms", "sms: 1000000", "`sms` is 1000000; it must be in 1..=1024"),
        ("hbm_bytes", "hbm_bytes: 0", "`hbm_bytes` is 0; it must be in"),
        ("fp8_tensor", "fp8_tensor: -1", "`flops.fp8_tensor` is -1; it must be a number in 0..=1e18"),
        ("datasheet", "datasheet: .nan", "`hbm_bandwidth.datasheet` is NaN; it must be a number in 1e9..=1e15"),
        ("datasheet", "datasheet: 1e-300", "`hbm_bandwidth.datasheet` is 1e-300; it must be a number in"),
        ("smem_per_sm", "smem_per_sm: 18446744073709551615", "`smem_per_sm` is 18446744073709551615; it must be in"),
        ("clock_ghz", "clock_ghz: .inf", "`clock_ghz` is inf; it must be a number in"),
    ];
    for (key, line, want) in cases {
        let (_dir, target) = temp_file("bad.yaml", &h200_with(key, line));
        let t = target.to_str().expect("utf-8");
        let args = ["plan", "model_graphs/kimi_k2/graph.mkc", "--config", "model_graphs/kimi_k2/tiny.json"];
        let err = refuses(&[&args[..], &["--target", t, "--estimate"]].concat(), &[&format!("target {t}: "), want]);
        assert!(!err.contains("inf us") && !err.contains("NaN%"), "{err}");
    }
}

/// The estimate of a valid target prints finite numbers only.
#[test]
fn estimate_is_finite() {
    let out = run(&[
        "plan",
        "model_graphs/kimi_k2/graph.mkc",
        "--config",
        "model_graphs/kimi_k2/tiny.json",
        "--target",
        "h200",
        "--estimate",
    ]);
    let s = text(&out.stdout);
    assert!(out.status.success());
    assert!(s.contains("% of floor"), "{s}");
    assert!(!s.contains("inf") && !s.contains("NaN"), "{s}");
}

// ---- (6) impossible models -----------------------------------------------------

/// `--batch 0`, a batch past the largest and a context of 2^64-1 are refused
/// by option name and bound (clap's usage error, status 2).
#[test]
fn batch_and_context_are_bounded() {
    let base = ["codegen", "model_graphs/kimi_k2/graph.mkc", "--config", "model_graphs/kimi_k2/tiny.json"];
    let cases: [(&[&str], &str); 4] = [
        (&["--batch", "0"], "'--batch <BATCH>': 0 is not in 1..=64"),
        (&["--batch", "65"], "'--batch <BATCH>': 65 is not in 1..=64"),
        (&["--context", "18446744073709551615"], "'--context <CONTEXT>': 18446744073709551615 is not in 1..=16777216"),
        (&["--context", "0"], "'--context <CONTEXT>': 0 is not in 1..=16777216"),
    ];
    let dir = tempfile::tempdir().expect("temp dir");
    let out = dir.path().join("out");
    for (extra, want) in cases {
        let args = [&base[..], &["--target", "h200", "-o", out.to_str().expect("utf-8")], extra].concat();
        let o = run(&args);
        let err = text(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{err}");
        assert!(err.contains(want), "{err}");
        assert!(!out.exists(), "nothing is written");
    }
}

/// `num_hidden_layers: -3` no longer builds a model of 0 layers: the loop
/// over the layers is refused at its line.
#[test]
fn negative_layer_count_is_refused() {
    let mut c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(root("model_graphs/kimi_k2/tiny.json")).expect("tiny"))
            .expect("json");
    c["num_hidden_layers"] = (-3).into();
    let (_dir, config) = temp_file("config.json", &c.to_string());
    let err = refuses(
        &["check", "model_graphs/kimi_k2/graph.mkc", "--config", config.to_str().expect("utf-8")],
        &["error[mkc::value]: loop range 0..-3 runs backwards"],
    );
    assert!(err.starts_with("model_graphs/kimi_k2/graph.mkc:"), "{err}");
}
