//! The command line as a user meets it (issue 21): built-in targets that work
//! from a copy of the binary anywhere, the capacity check, one vocabulary of
//! sizes across `check` and `plan`, help that says what each command writes,
//! shell completions, and each error printed once.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn root(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

/// Runs the built `mkc` with `args` from the checkout's root.
fn run(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_mkc")).current_dir(env!("CARGO_MANIFEST_DIR")).args(args).output().unwrap()
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn k3() -> String {
    root("model_graphs/kimi_k3/graph.mkc").display().to_string()
}

/// A copy of the binary outside the checkout, run from another folder, knows
/// every target and plans the full K3 for each (at the expert-parallel degree
/// that fits, which it names itself).
#[test]
fn a_copy_of_the_binary_plans_k3_for_every_target() {
    let bin_dir = tempfile::tempdir().unwrap();
    let cwd = tempfile::tempdir().unwrap();
    let copy = bin_dir.path().join("mkc");
    std::fs::copy(env!("CARGO_BIN_EXE_mkc"), &copy).unwrap();
    // A test running beside this one may fork while the copy is still open for writing here; its
    // child holds the file open until it execs, and running the copy then fails with "text file
    // busy" (ETXTBSY) for that moment: try again.
    let mkc = |args: &[&str]| {
        for _ in 0..50 {
            match Command::new(&copy).current_dir(cwd.path()).args(args).output() {
                Err(e) if e.raw_os_error() == Some(26) => std::thread::sleep(std::time::Duration::from_millis(20)),
                r => return r.unwrap(),
            }
        }
        panic!("{} stayed busy", copy.display())
    };
    let list = mkc(&["targets"]);
    assert!(list.status.success(), "{}", stderr(&list));
    for name in ["b200", "gb300", "h200"] {
        assert!(stdout(&list).contains(name), "{}", stdout(&list));
        let o = mkc(&["plan", &k3(), "--target", name]);
        assert!(o.status.success(), "{name}: {}", stderr(&o));
        assert!(stdout(&o).contains(&format!("plan kimi_k3 on {name}")), "{}", stdout(&o));
    }
}

#[test]
fn targets_lists_the_key_numbers() {
    let o = run(&["targets"]);
    assert!(o.status.success());
    let out = stdout(&o);
    let gb300 = out.lines().find(|l| l.starts_with("gb300")).unwrap();
    for field in ["sm_103a", "160", "288.00 GB", "8.00 TB/s"] {
        assert!(gb300.contains(field), "{gb300}");
    }
    assert!(out.lines().any(|l| l.starts_with("h200") && l.contains("4.19 measured")), "{out}");
}

#[test]
fn an_unknown_target_gets_the_closest_name_and_the_list() {
    let o = run(&["plan", &k3(), "--target", "gb200"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o)
            .starts_with("error[mkc::config]: unknown target gb200; did you mean gb300? targets: b200, gb300, h200\n"),
        "{}",
        stderr(&o)
    );
    // A path is read as a file, never looked up by name.
    let o = run(&["plan", &k3(), "--target", "no/such.yaml"]);
    assert!(stderr(&o).contains("cannot read target no/such.yaml"), "{}", stderr(&o));
}

/// The number after `key` in `text`, up to the next space, and its unit.
fn after<'a>(text: &'a str, key: &str) -> &'a str {
    let at = text.find(key).unwrap_or_else(|| panic!("{key:?} not in:\n{text}")) + key.len();
    let rest = &text[at..];
    let end = rest.find([',', '\n', ')']).unwrap();
    rest[..end].trim()
}

/// K3 does not fit one GB300 (1.56 TB of weights against 288 GB): the first
/// line of the estimate says so with both numbers and the smallest
/// expert-parallel degree that fits; at that degree it plans and fits.
#[test]
fn k3_capacity_on_gb300_names_the_expert_parallel_degree() {
    let o = run(&["plan", &k3(), "--target", "gb300", "--estimate"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    let first = out.lines().next().unwrap();
    assert!(first.contains("does not fit one gb300"), "{first}");
    assert!(first.contains("1.56 TB resident > 288.00 GB HBM"), "{first}");
    let degree = after(first, "the smallest expert-parallel degree that fits is ").split(' ').next().unwrap();
    let n: u32 = degree.parse().unwrap();
    assert!((6..=16).contains(&n), "{first}");
    let o = run(&["plan", &k3(), "--target", "gb300", "--estimate", "--expert-parallel", degree]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    let first = out.lines().next().unwrap();
    assert!(first.starts_with(&format!("capacity: one GPU's share at expert-parallel {n} fits one gb300")), "{first}");
    assert!(out.contains("batch 1, moved per step: weights read"), "{out}");
    // One fewer does not fit.
    let o = run(&["plan", &k3(), "--target", "gb300", "--expert-parallel", &(n - 1).to_string()]);
    assert!(stdout(&o).lines().next().unwrap().contains("does not fit"), "{}", stdout(&o));
}

/// `codegen` refuses a model one GPU cannot hold, unless told to ignore it.
#[test]
fn codegen_writes_the_full_k3_and_says_what_does_not_fit() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("k3");
    let o = run(&["codegen", &k3(), "--target", "h200", "-o", out.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(out.join("program.cuh").exists() && out.join("plan.mkcplan").exists(), "the program is written");
    let err = stderr(&o);
    assert!(err.starts_with("warning[mkc::limit]: the model does not fit one h200"), "{err}");
    assert!(err.contains("--ignore-capacity"), "{err}");
    // The degree that would fit is said, as the option that makes that program.
    assert!(err.contains("its experts sharded over") && err.contains("(--expert-parallel "), "{err}");
    // --ignore-capacity silences the warning.
    let o = run(&["codegen", &k3(), "--target", "h200", "--ignore-capacity", "-o", out.to_str().unwrap()]);
    assert!(o.status.success() && !stderr(&o).contains("warning"), "{}", stderr(&o));
}

/// `codegen --expert-parallel G` writes one GPU's program of G: its share of
/// each MoE layer's experts from its rank, an exchange after each layer; a
/// degree that does not divide the experts, or past the device's peer
/// tables, is refused by name.
#[test]
fn codegen_expert_parallel_writes_one_gpus_program() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("k2ep");
    let graph = root("model_graphs/kimi_k2/graph.mkc").display().to_string();
    let config = root("model_graphs/kimi_k2/tiny.json").display().to_string();
    let args = ["codegen", &graph, "--config", &config, "--target", "h200", "--expert-parallel", "2", "-o"];
    let o = run(&[&args[..], &[out.to_str().unwrap()]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let program = std::fs::read_to_string(out.join("program.cuh")).unwrap();
    for want in [
        "inline constexpr uint32_t kRanks = 2;",
        "inline constexpr uint32_t kExchanges = 2;",
        ".experts = 4,",
        ".first = m.peers->rank * 4u}",
        "exchange_send<kBatch>(Exchange{.peers = m.peers",
        "exchange_reduce<kBatch>(Exchange{.peers = m.peers",
    ] {
        assert!(program.contains(want), "the expert-parallel program has {want}");
    }
    // The full K3's 896 experts in 9 equal shares: no.
    let o = run(&["codegen", &k3(), "--target", "gb300", "--expert-parallel", "9", "-o", out.to_str().unwrap()]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("896 routed experts, which 9 GPUs cannot hold in equal shares"), "{}", stderr(&o));
    let o = run(&["codegen", &graph, "--config", &config, "--target", "h200", "--expert-parallel", "73", "-o", "x"]);
    assert!(!o.status.success() && stderr(&o).contains("--expert-parallel"), "{}", stderr(&o));
}

/// `check` and `plan` print the same weights read per step, under the same name.
#[test]
fn check_and_plan_agree_on_sizes() {
    let graph = root("model_graphs/kimi_k2/graph.mkc").display().to_string();
    let config = root("model_graphs/kimi_k2/tiny.json").display().to_string();
    let check = stdout(&run(&["check", &graph, "--config", &config, "--target", "h200"]));
    let plan = stdout(&run(&["plan", &graph, "--config", &config, "--target", "h200", "--estimate"]));
    for b in [1, 8] {
        let line =
            check.lines().find(|l| l.starts_with(&format!("weights read per step at batch {b} (moved)"))).unwrap();
        let in_check = line.rsplit('(').next().unwrap().trim_end_matches(')');
        let in_plan = after(&plan, &format!("batch {b}, moved per step: weights read "));
        assert_eq!(in_check, in_plan, "batch {b}\ncheck:\n{check}\nplan:\n{plan}");
    }
    let line = check.lines().find(|l| l.starts_with("state per sequence at context 4096: ")).unwrap();
    let per_sequence = line.rsplit('(').next().unwrap().trim_end_matches(')');
    assert!(plan.contains(&format!("({per_sequence} per sequence x batch 1)")), "{per_sequence}\n{plan}");
    assert!(check.contains("capacity: the model fits one h200"), "{check}");
}

#[test]
fn help_says_what_codegen_writes() {
    let o = run(&["codegen", "--help"]);
    let help = stdout(&o);
    for file in ["program.cuh", "model.cu", "CMakeLists.txt", "plan.mkcplan"] {
        assert!(help.contains(file), "{help}");
    }
    assert!(!help.contains("device tables and the weight list"), "{help}");
}

#[test]
fn completions_for_each_shell() {
    for shell in ["bash", "zsh", "fish"] {
        let o = run(&["completions", shell]);
        assert!(o.status.success(), "{shell}: {}", stderr(&o));
        let script = stdout(&o);
        for word in ["codegen", "targets", "expert-parallel"] {
            assert!(script.contains(word), "{shell} completion lacks {word}");
        }
    }
}

/// An error's code and reason appear once: on the first line, not again in
/// miette's frame.
#[test]
fn each_error_is_printed_once() {
    let graph = root("tests/diagnostics/call_attr_missing.mkc").display().to_string();
    let dir = tempfile::tempdir().unwrap();
    let empty = dir.path().join("config.json");
    std::fs::write(&empty, "{}").unwrap();
    let o = run(&["check", &graph, "--config", empty.to_str().unwrap()]);
    let err = stderr(&o);
    assert_eq!(err.matches("mkc::call").count(), 1, "{err}");
    assert_eq!(err.matches("needs attribute `group`").count(), 1, "{err}");
    assert!(err.contains("╰── add `group: ...`"), "the frame stays:\n{err}");
}

/// `--speculative T --acceptance A` estimates a verify step of T positions per
/// sequence beside plain decoding: the expected tokens per step are
/// 1 + A + ... + A^(T-1), tokens/s per user is that over the verify step's
/// time; a verify step the device cannot hold is named, not estimated; a
/// probability outside [0, 1] is refused.
#[test]
fn speculative_decoding_is_estimated() {
    let dims = root("model_graphs/kimi_k2/bench_4l64e.json").display().to_string();
    let graph = root("model_graphs/kimi_k2/graph.mkc").display().to_string();
    // The K2 dims estimate on the H200 with more options.
    let estimate = |more: &[&str]| {
        let mut args = vec!["plan", &graph, "--config", &dims, "--target", "h200", "--estimate"];
        args.extend_from_slice(more);
        run(&args)
    };
    let o = estimate(&["--speculative", "4", "--acceptance", "0.5"]);
    let out = stdout(&o);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(out.contains("assumptions (speculative)"), "{out}");
    let line = out.lines().find(|l| l.starts_with("batch 1, speculative 4 positions")).expect("a batch-1 line");
    // 1 + 0.5 + 0.25 + 0.125
    assert!(line.contains("1.88 tokens per verify step"), "{line}");
    let number = |after: &str| -> f64 {
        let rest = &line[line.find(after).unwrap() + after.len()..];
        rest.trim_start().split(' ').next().unwrap().parse().unwrap()
    };
    let (step_us, per_user) = (number("verify step predicted"), number("us (4 positions),"));
    assert!((per_user - 1.875e6 / step_us).abs() < 0.1, "{line}");
    assert!(out.lines().any(|l| l.starts_with("batch 8, speculative 4 positions")), "{out}");
    let o = run(&["plan", &graph, "--target", "h200", "--estimate", "--speculative", "4", "--acceptance", "1.5"]);
    assert!(!o.status.success() && stderr(&o).contains("not a probability"), "{}", stderr(&o));
    // Plain decoding's numbers are unchanged by the option.
    let plain = stdout(&estimate(&[]));
    for l in plain.lines().filter(|l| l.starts_with("batch 1:")) {
        assert!(out.contains(l), "{l}");
    }
    // On several GPUs: each batch's verify step beside its plain step, both placements.
    let o = estimate(&["--gpus", "8", "--speculative", "2", "--acceptance", "0.5"]);
    let out = stdout(&o);
    assert!(o.status.success(), "{}", stderr(&o));
    let line = out
        .lines()
        .find(|l| l.starts_with("batch 1 on 8 GPUs, speculative 2 positions at acceptance 0.50 (1.50 tokens"))
        .unwrap_or_else(|| panic!("a batch-1 line on 8 GPUs:\n{out}"));
    assert!(line.contains("experts sharded, verify step") && line.contains("tensor parallel (from bytes)"), "{line}");
}

#[test]
fn a_trace_needs_the_page_or_the_estimate() {
    let o = run(&["plan", &k3(), "--target", "h200", "--trace", "no_such_trace.json"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("--trace is read with --html"), "{}", stderr(&o));
    // With --estimate the trace is read (and this one is missing: named).
    let o = run(&["plan", &k3(), "--target", "h200", "--estimate", "--trace", "no_such_trace.json"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("no_such_trace.json"), "{}", stderr(&o));
}

/// `codegen --positions T`: a verify step of T positions a sequence, batch x T rows; the program says so
/// (kPositions, the MLA shape's positions). A model whose state is not MLA's cache alone (K3's KDA
/// layers) is refused at the operation that keeps it; more rows than a step carries, by the flags' names.
#[test]
fn codegen_positions_makes_a_verify_step_or_says_why_not() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("k2v");
    let graph = root("model_graphs/kimi_k2/graph.mkc").display().to_string();
    let config = root("model_graphs/kimi_k2/tiny.json").display().to_string();
    let args = ["codegen", &graph, "--config", &config, "--target", "h200", "--batch", "2", "--positions", "4", "-o"];
    let o = run(&[&args[..], &[out.to_str().unwrap()]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let program = std::fs::read_to_string(out.join("program.cuh")).unwrap();
    assert!(program.contains("inline constexpr int kBatch = 8;"), "batch x positions rows");
    assert!(program.contains("inline constexpr uint32_t kPositions = 4;"));
    assert!(program.contains(".positions = 4}"), "the MLA split takes a sequence's positions");

    let k3_config = root("model_graphs/kimi_k3/tiny.json").display().to_string();
    let o = run(&[
        "codegen",
        &k3(),
        "--config",
        &k3_config,
        "--target",
        "h200",
        "--positions",
        "2",
        "-o",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    // K3: KDA's recurrent state and the conv windows are left as they were during the step, logged, and
    // committed after it to the positions each sequence keeps.
    let program = std::fs::read_to_string(out.join("program.cuh")).unwrap();
    for want in [
        "kda_decode<kBatch, kPositions>",
        "kda_commit<kBatch, kPositions>",
        "ep_conv_update<kBatch, kPositions>",
        "conv_commit<kBatch, kPositions>",
        "static __device__ void commit(uint32_t task, const Memory& m, const uint32_t* keep)",
    ] {
        assert!(program.contains(want), "K3's verify step has {want}");
    }

    let o = run(&[
        "codegen",
        &graph,
        "--config",
        &config,
        "--target",
        "h200",
        "--batch",
        "16",
        "--positions",
        "8",
        "-o",
        out.to_str().unwrap(),
    ]);
    let err = stderr(&o);
    assert!(!o.status.success() && err.contains("--batch 16 x --positions 8 is 128 rows"), "{err}");
}
