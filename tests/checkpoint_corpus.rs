//! The compiler's checkpoint reader over the hostile corpus
//! (tests/fixtures/hostile_checkpoints, written by its make.py): every case
//! must come out exactly as expected.json says, message for message. The
//! runtime's reader is held to the same file by
//! runtime/tests/checkpoint_corpus_test.cpp, so the two agree on every case.
//! Also here, made in a temporary directory as they cannot be committed: a
//! FIFO as a shard or as the index is refused at once, not read; a dangling
//! link as a shard is a missing file; an index over the size limit is refused
//! without being read.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::mpsc;
use std::time::Duration;

use mkc::checkpoint::{Checkpoint, INDEX, MAX_INDEX};
use serde_json::Value;

fn corpus() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hostile_checkpoints")
}

/// What the reader makes of `dir`, in expected.json's terms.
fn outcome(dir: &Path) -> Value {
    let shown = dir.display().to_string();
    match Checkpoint::open(dir) {
        Err(e) => serde_json::json!({"outcome": "error", "error": e.reason.replace(&shown, "$DIR")}),
        Ok(c) if c.problems.is_empty() => {
            serde_json::json!({"outcome": "ok", "tensors": c.tensors.keys().collect::<Vec<_>>()})
        }
        Ok(c) => serde_json::json!({
            "outcome": "problems",
            "problems": c.problems.iter().map(|p| p.to_string()).collect::<Vec<_>>(),
        }),
    }
}

#[test]
fn every_hostile_case_comes_out_as_expected() {
    let text = std::fs::read_to_string(corpus().join("expected.json")).unwrap();
    let expected: Value = serde_json::from_str(&text).unwrap();
    let cases = expected["cases"].as_object().unwrap();
    assert!(cases.len() >= 60, "{} cases", cases.len());
    let mut listed: Vec<String> = std::fs::read_dir(corpus().join("cases"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    listed.sort();
    assert_eq!(listed, cases.keys().cloned().collect::<Vec<_>>(), "cases/ and expected.json list other cases");
    let mut wrong = Vec::new();
    for (name, want) in cases {
        let mut want = want.clone();
        want.as_object_mut().unwrap().remove("what");
        let got = outcome(&corpus().join("cases").join(name));
        if got != want {
            wrong.push(format!("{name}:\n  expected {want}\n  got      {got}"));
        }
    }
    assert!(wrong.is_empty(), "{} of {} cases differ:\n{}", wrong.len(), cases.len(), wrong.join("\n"));
}

/// Runs `f` on another thread; fails if it takes more than 10 seconds (a
/// reader blocked on a FIFO would never return).
fn within_10s<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(Duration::from_secs(10)).expect("the reader blocked")
}

fn mkfifo(path: &Path) {
    let status = Command::new("mkfifo").arg(path).status().unwrap();
    assert!(status.success(), "mkfifo {}", path.display());
}

#[test]
fn a_fifo_shard_or_index_is_refused_without_blocking() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(corpus().join("cases/ok_two_tensors/model.safetensors"), dir.path().join("a.safetensors")).unwrap();
    mkfifo(&dir.path().join("b.safetensors"));
    let path = dir.path().to_path_buf();
    let got = within_10s(move || outcome(&path));
    assert_eq!(
        got,
        serde_json::json!({"outcome": "problems", "problems": ["unreadable file b.safetensors: not a regular file"]})
    );

    mkfifo(&dir.path().join(INDEX));
    let path = dir.path().to_path_buf();
    let got = within_10s(move || outcome(&path));
    assert_eq!(got, serde_json::json!({"outcome": "error", "error": format!("$DIR/{INDEX}: not a regular file")}));
}

#[test]
fn a_dangling_link_as_a_shard_is_a_missing_file() {
    let dir = tempfile::tempdir().unwrap();
    std::os::unix::fs::symlink("nowhere", dir.path().join("model.safetensors")).unwrap();
    let want = "unreadable file model.safetensors: cannot open: No such file or directory";
    assert_eq!(outcome(dir.path()), serde_json::json!({"outcome": "problems", "problems": [want]}));
}

#[test]
fn an_index_over_the_limit_is_refused_unread() {
    let dir = tempfile::tempdir().unwrap();
    // Sparse: no disk is used, and the reader must not read it.
    let f = std::fs::File::create(dir.path().join(INDEX)).unwrap();
    f.set_len(MAX_INDEX + 1).unwrap();
    let want = format!("$DIR/{INDEX}: {} bytes, over the limit of {MAX_INDEX}", MAX_INDEX + 1);
    assert_eq!(outcome(dir.path()), serde_json::json!({"outcome": "error", "error": want}));
}
