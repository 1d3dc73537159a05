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

/// `plan`'s pictures (`--yaml`, `--dot`, `--html`) are written the same way:
/// a symbolic link where one goes is refused by name and its target left
/// alone; a plain path gets the file and no temporary beside it.
#[test]
fn plan_pictures_refuse_symbolic_links() {
    let graph = root("model_graphs/kimi_k2/graph.mkc").display().to_string();
    let config = root("model_graphs/kimi_k2/tiny.json").display().to_string();
    for flag in ["--yaml", "--dot", "--html"] {
        let dir = tempfile::tempdir().expect("temp dir");
        let victim = dir.path().join("victim.txt");
        std::fs::write(&victim, "precious").expect("victim");
        let link = dir.path().join("picture");
        std::os::unix::fs::symlink("victim.txt", &link).expect("link");
        let link_s = link.display().to_string();
        refuses(
            &["plan", &graph, "--config", &config, "--target", "h200", flag, &link_s],
            &[&format!("{link_s}: it is a symbolic link")],
        );
        assert_eq!(std::fs::read_to_string(&victim).expect("victim"), "precious", "{flag}");
        let plain = dir.path().join("plain");
        let plain_s = plain.display().to_string();
        let out = run(&["plan", &graph, "--config", &config, "--target", "h200", flag, &plain_s]);
        assert!(out.status.success(), "{flag}: {}", text(&out.stderr));
        assert!(std::fs::metadata(&plain).expect("written").len() > 0, "{flag}");
        assert_eq!(std::fs::read_dir(dir.path()).expect("dir").count(), 3, "{flag}: no temporary left");
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
        (
            "sync_latency_ns",
            "sync_latency_ns: 1000\ntask_overhead_ns: .nan",
            "`task_overhead_ns` is NaN; it must be a number in 0..=1e6",
        ),
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

/// The K2 tiny config with `key` set to `value`, in a temporary file.
fn k2_tiny_with(key: &str, value: serde_json::Value) -> (tempfile::TempDir, PathBuf) {
    let mut c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(root("model_graphs/kimi_k2/tiny.json")).expect("tiny"))
            .expect("json");
    c[key] = value;
    temp_file("config.json", &c.to_string())
}

/// `hidden_size: 2^40` passes lowering (no one tensor is over 2^50
/// elements) but would need an arena of terabytes: the planner refuses it,
/// naming the size, the bound and the graph line.
#[test]
fn huge_hidden_size_is_refused_by_the_arena_bound() {
    let (_dir, config) = k2_tiny_with("hidden_size", (1u64 << 40).into());
    let c = config.to_str().expect("utf-8");
    let args = ["plan", "model_graphs/kimi_k2/graph.mkc", "--config", c, "--target", "h200"];
    let err = refuses(&args, &["error[mkc::limit]", "bytes, more than the bound of 1099511627776 (1 TiB)"]);
    assert!(err.starts_with("model_graphs/kimi_k2/graph.mkc:"), "the error names the graph line:\n{err}");
    let dir = tempfile::tempdir().expect("temp dir");
    let out = dir.path().join("out");
    let o = out.to_str().expect("utf-8");
    refuses(
        &["codegen", "model_graphs/kimi_k2/graph.mkc", "--config", c, "--target", "h200", "-o", o],
        &["more than the bound of 1099511627776 (1 TiB)"],
    );
    assert!(!out.exists(), "nothing is written");
}

/// The summary of a model of more than 2^64 parameters prints the exact
/// count, never a saturated 18,446,744,073,709,551,615.
#[test]
fn summary_counts_do_not_saturate() {
    let mut c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(root("model_graphs/kimi_k2/tiny.json")).expect("tiny"))
            .expect("json");
    c["hidden_size"] = (1u64 << 36).into();
    c["moe_intermediate_size"] = (1u64 << 14).into();
    c["n_routed_experts"] = (1u64 << 14).into();
    let (_dir, config) = temp_file("config.json", &c.to_string());
    let out = run(&["check", "model_graphs/kimi_k2/graph.mkc", "--config", config.to_str().expect("utf-8")]);
    let s = text(&out.stdout);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(!s.contains("18,446,744,073,709,551,615"), "{s}");
    // 2 MoE layers of 2^14 experts of 3 matrices of 2^50 elements: 6 * 2^64 and more.
    let total = s.lines().find(|l| l.starts_with("parameters: total ")).expect("total line");
    let n: u128 = total["parameters: total ".len()..]
        .split(' ')
        .next()
        .expect("count")
        .replace(',', "")
        .parse()
        .expect("a number");
    assert!(n > 6 << 64, "{total}");
}

/// A state whose size at the largest context passes the element bound is
/// refused at its line, so no state size wraps at any `--context`.
#[test]
fn state_size_at_the_largest_context_is_bounded() {
    let src = "model m\ngraph {\n  input t: i32[]\n  state s: f32[ctx, 1 << 30]\n  output t\n}\n";
    let src = src.replace("1 << 30", "1073741824");
    let (_dir, graph) = temp_file("g.mkc", &src);
    let (_cdir, config) = temp_file("config.json", "{}");
    let g = graph.to_str().expect("utf-8");
    let err = refuses(
        &["check", g, "--config", config.to_str().expect("utf-8")],
        &["error[mkc::limit]", "elements at the largest context (16777216 tokens) is too large"],
    );
    assert!(err.starts_with(&format!("{g}:4:")), "{err}");
}

// ---- (1) code injection ---------------------------------------------------------

/// The key prefix, which would close the plan file's string and add
/// a `#error` line to anything that pasted a key into source: refused at the
/// weight's line, naming the config key.
#[test]
fn injected_key_prefix_is_refused_naming_the_config_key() {
    let mut c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(root("model_graphs/kimi_k3/tiny.json")).expect("tiny"))
            .expect("json");
    c["mkc_key_prefix"] = "x\"}};\n#error INJECTED\n//".into();
    let (_dir, config) = temp_file("config.json", &c.to_string());
    let c = config.to_str().expect("utf-8");
    for args in [
        vec!["check", "model_graphs/kimi_k3/graph.mkc", "--config", c],
        vec!["codegen", "model_graphs/kimi_k3/graph.mkc", "--config", c, "--target", "gb300", "-o", "/nonexistent/x"],
    ] {
        let err = refuses(&args, &["error[mkc::value]", "config key `config.mkc_key_prefix`", "'\"'"]);
        assert!(err.starts_with("model_graphs/kimi_k3/graph.mkc:"), "the error names the graph line:\n{err}");
        assert!(!err.contains("\n#error"), "the key is escaped in the message:\n{err}");
    }
    // A prefix of 10 MB: refused as too long, at the first key.
    let mut c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(root("model_graphs/kimi_k3/tiny.json")).expect("tiny"))
            .expect("json");
    c["mkc_key_prefix"] = "p".repeat(10 << 20).into();
    let (_dir, config) = temp_file("config.json", &c.to_string());
    let args = ["check", "model_graphs/kimi_k3/graph.mkc", "--config", config.to_str().expect("utf-8")];
    refuses(&args, &["error[mkc::limit]", "is 10485", "bytes, longer than 1024"]);
    // A control character, a backslash and a character past ASCII as well.
    for bad in ["a\tb.", "a\\b.", "é."] {
        let mut c: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(root("model_graphs/kimi_k3/tiny.json")).expect("tiny"))
                .expect("json");
        c["mkc_key_prefix"] = bad.into();
        let (_dir, config) = temp_file("config.json", &c.to_string());
        let args = ["check", "model_graphs/kimi_k3/graph.mkc", "--config", config.to_str().expect("utf-8")];
        refuses(&args, &["config key `config.mkc_key_prefix`"]);
    }
}

/// A graph and a config path holding newlines, `*/` and a trailing
/// backslash: every generated file's header stays one line, and no line of
/// the paths becomes a line of code.
#[test]
fn paths_cannot_inject_lines_into_generated_headers() {
    let dir = tempfile::tempdir().expect("temp dir");
    // Folders `x<newline>#error INJECTED<newline>*` and ` \`: the path holds `*/ \`.
    let evil = dir.path().join("x\n#error INJECTED\n*").join(" \\");
    std::fs::create_dir_all(&evil).expect("evil folder");
    let graph = evil.join("g\n#error GRAPH\n.mkc");
    std::fs::copy(root("model_graphs/kimi_k2/graph.mkc"), &graph).expect("graph");
    let config = evil.join("c\n#error CONFIG\n*.json");
    std::fs::copy(root("model_graphs/kimi_k2/tiny.json"), &config).expect("config");
    let out = dir.path().join("out");
    let args = [
        "codegen",
        graph.to_str().expect("utf-8"),
        "--config",
        config.to_str().expect("utf-8"),
        "--target",
        "h200",
        "-o",
        out.to_str().expect("utf-8"),
    ];
    let o = run(&args);
    assert!(o.status.success(), "{}", text(&o.stderr));
    for name in ["program.cuh", "model.cu", "CMakeLists.txt", "plan_summary.txt"] {
        let t = std::fs::read_to_string(out.join(name)).expect("generated file");
        let injected = t.lines().any(|l| l.trim_start().starts_with("#error") || l.trim_start().starts_with("*/"));
        assert!(!injected, "{name} holds an injected line:\n{}", &t[..t.len().min(600)]);
        assert!(!t.contains("*/ "), "{name}: `*/` closes a comment");
        let first = t.lines().next().expect("a header");
        assert!(!first.ends_with('\\'), "{name}: the header continues onto the next line");
        if first.contains("Generated by mkc") && name != "CMakeLists.txt" {
            assert!(first.contains("?#error INJECTED?"), "{name}: the path stays in its one line:\n{first}");
        }
    }
}

// ---- (4) unbounded reads and hangs ------------------------------------------------

/// Runs `mkc ARGS` and fails the test if it has not ended within 20 s.
fn run_bounded(args: &[&str]) -> Output {
    let mut child = mkc().args(args).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("mkc starts");
    let start = std::time::Instant::now();
    while child.try_wait().expect("wait").is_none() {
        if start.elapsed() > std::time::Duration::from_secs(20) {
            let _ = child.kill();
            panic!("mkc {args:?} hangs");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    child.wait_with_output().expect("mkc ends")
}

/// `mkc` with its graph, config or target at `path`, refused with `needles`.
fn refuses_as_each_input(path: &str, needles: &[&str]) {
    let k2 = "model_graphs/kimi_k2/graph.mkc";
    let tiny = "model_graphs/kimi_k2/tiny.json";
    for (what, args) in [
        ("graph", vec!["check", path, "--config", tiny]),
        ("config", vec!["check", k2, "--config", path]),
        ("target", vec!["plan", k2, "--config", tiny, "--target", path]),
    ] {
        let o = run_bounded(&args);
        let err = text(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{what} {path}: {err}");
        assert!(!err.contains("panicked"), "{err}");
        assert!(err.contains(&format!("cannot read {what} {path}: ")), "{what}: {err}");
        for n in needles {
            assert!(err.contains(n), "{what} {path}: stderr must hold {n:?}:\n{err}");
        }
    }
}

/// `/dev/zero` and `/dev/urandom` as any input: refused at once by name,
/// before a byte is read.
#[test]
fn devices_are_refused() {
    for dev in ["/dev/zero", "/dev/urandom"] {
        refuses_as_each_input(dev, &["it is a character device; mkc reads regular files only"]);
    }
    refuses_as_each_input("/tmp", &["it is a directory"]);
}

/// A FIFO with no writer as any input: refused, without waiting for one.
#[test]
fn fifos_are_refused_without_hanging() {
    let dir = tempfile::tempdir().expect("temp dir");
    let fifo = dir.path().join("fifo.yaml");
    let status = Command::new("mkfifo").arg(&fifo).status().expect("mkfifo runs");
    assert!(status.success());
    refuses_as_each_input(fifo.to_str().expect("utf-8"), &["it is a FIFO; mkc reads regular files only"]);
}

/// A file over its kind's size limit is refused from its size alone (the
/// files here are sparse: nothing is read).
#[test]
fn large_files_are_refused() {
    let dir = tempfile::tempdir().expect("temp dir");
    let k2 = "model_graphs/kimi_k2/graph.mkc";
    let tiny = "model_graphs/kimi_k2/tiny.json";
    for (what, mib, limit) in [("graph", 17u64, 16), ("config", 65, 64), ("target", 2, 1)] {
        let path = dir.path().join(format!("big.{what}.yaml"));
        let f = std::fs::File::create(&path).expect("create");
        f.set_len(mib << 20).expect("sparse file");
        let p = path.to_str().expect("utf-8");
        let args = match what {
            "graph" => vec!["check", p, "--config", tiny],
            "config" => vec!["check", k2, "--config", p],
            _ => vec!["plan", k2, "--config", tiny, "--target", p],
        };
        let o = run_bounded(&args);
        let err = text(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{err}");
        let want = format!(
            "cannot read {what} {p}: it is {} bytes, more than the {limit} MiB a {what} file may be",
            mib << 20
        );
        assert!(err.contains(&want), "{err}");
    }
}

/// 100,000 nested `[`, `{` or `- ` as a config: refused in well under a
/// second (the YAML parser alone took 34 s), naming the line and column.
#[test]
fn deeply_nested_configs_are_refused_fast() {
    let n = 100_000;
    for (name, body) in [
        ("brackets", format!("{{\"a\": {}1{}}}", "[".repeat(n), "]".repeat(n))),
        ("braces", format!("{}{}", "{\"a\": ".repeat(n), "}".repeat(n))),
        ("dashes", format!("a:\n  {}1\n", "- ".repeat(n))),
        ("quoted", format!("a: x, \"\nb: {}1{}\n", "[".repeat(n), "]".repeat(n))),
    ] {
        let (_dir, config) = temp_file("deep.yaml", &body);
        let c = config.to_str().expect("utf-8");
        let start = std::time::Instant::now();
        let err = refuses(&["check", "model_graphs/kimi_k2/graph.mkc", "--config", c], &["error[mkc::limit]"]);
        assert!(err.contains(&format!("config {c} nests")) && err.contains("deeper than 100 levels"), "{name}: {err}");
        assert!(start.elapsed() < std::time::Duration::from_secs(5), "{name}: {:?}", start.elapsed());
    }
}
