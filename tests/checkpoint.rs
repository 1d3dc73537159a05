//! The checkpoint checker against safetensors files: synthetic ones written
//! here from a graph's requirements, and real ones written by transformers'
//! `save_pretrained` (tests/fixtures/checkpoints), each also broken on
//! purpose: a missing tensor, a wrong shape, a wrong dtype, a truncated file.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

use mkc::checkpoint::{self, GpuLayout, Problem, Requirement};
use mkc::config::Config;
use mkc::lower::Limits;
use mkc::valid::Validated;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn compile(model: &str, config: &Path) -> Validated {
    let graph = root().join("model_graphs").join(model).join("graph.mkc");
    let source = std::fs::read_to_string(&graph).unwrap();
    let config = Config::load(config).unwrap();
    mkc::compile_str(&source, &config, Limits::default()).unwrap()
}

/// Writes a safetensors file holding `tensors` (zero data).
fn write_safetensors(path: &Path, tensors: &[(String, String, Vec<u64>)]) {
    let mut header = serde_json::Map::new();
    let mut offset = 0u64;
    for (name, dtype, shape) in tensors {
        let size = checkpoint::dtype_size(dtype).unwrap();
        let n = (shape.iter().product::<u64>() as f64 * size).ceil() as u64;
        header.insert(
            name.clone(),
            serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}),
        );
        offset += n;
    }
    let text = serde_json::to_string(&header).unwrap();
    let mut f = std::fs::File::create(path).unwrap();
    f.write_all(&(text.len() as u64).to_le_bytes()).unwrap();
    f.write_all(text.as_bytes()).unwrap();
    f.write_all(&vec![0u8; offset as usize]).unwrap();
}

fn as_tensors(reqs: &[Requirement]) -> Vec<(String, String, Vec<u64>)> {
    reqs.iter().map(|r| (r.key.clone(), r.dtype.to_string(), r.shape.clone())).collect()
}

fn tiny(model: &str) -> Validated {
    compile(model, &root().join("model_graphs").join(model).join("tiny.json"))
}

#[test]
fn synthetic_checkpoint_of_every_tiny_graph_passes() {
    for model in ["kimi_k2", "kimi_k3", "kimi_linear"] {
        let v = tiny(model);
        let dir = tempfile::tempdir().unwrap();
        let reqs = checkpoint::requirements(&v);
        write_safetensors(&dir.path().join("model.safetensors"), &as_tensors(&reqs));
        let r = checkpoint::check(dir.path(), &v).unwrap();
        assert!(r.problems.is_empty(), "{model}: {:?}", r.problems);
        assert_eq!(r.required, reqs.len() as u64);
        assert_eq!(r.unused, 0);
    }
}

#[test]
fn mxfp4_experts_need_packed_data_and_scales() {
    let v = tiny("kimi_k3");
    let reqs = checkpoint::requirements(&v);
    let w1: Vec<&Requirement> = reqs.iter().filter(|r| r.key.contains("layers.1.mlp.experts.3.w1.")).collect();
    // latent 64 -> 32 packed bytes and 2 scales per row; 32 rows.
    assert_eq!(w1.len(), 2, "{w1:?}");
    assert_eq!((w1[0].dtype, w1[0].shape.clone()), ("U8", vec![32, 32]));
    assert!(w1[0].key.ends_with("w1.weight_packed"));
    assert_eq!((w1[1].dtype, w1[1].shape.clone()), ("U8", vec![32, 2]));
    assert!(w1[1].key.ends_with("w1.weight_scale"));
    // The runtime reads an MXFP4 matrix's scales with its codes (clearing e8m0's NaN blocks): the
    // weights table lists the scales right after the codes, rows alike.
    let mut matrices = 0;
    for (i, r) in reqs.iter().enumerate() {
        if r.layout != GpuLayout::MxCodes {
            continue;
        }
        let s = &reqs[i + 1];
        assert_eq!(s.layout, GpuLayout::MxScales, "{} is followed by {}", r.key, s.key);
        assert_eq!(
            (&s.shape[..s.shape.len() - 1], s.shape[s.shape.len() - 1] * 16),
            (&r.shape[..r.shape.len() - 1], r.shape[r.shape.len() - 1]),
            "{}",
            r.key
        );
        matrices += 1;
    }
    assert!(matrices > 0);
    assert_eq!(matrices, reqs.iter().filter(|r| r.layout == GpuLayout::MxScales).count());
}

#[test]
fn each_problem_is_reported_by_tensor_name() {
    let v = tiny("kimi_k2");
    let reqs = checkpoint::requirements(&v);
    let mut tensors = as_tensors(&reqs);
    let missing = tensors.remove(5).0;
    tensors[0].2 = vec![7, 7];
    let wrong_shape = tensors[0].0.clone();
    tensors[1].1 = "F16".into();
    let wrong_dtype = tensors[1].0.clone();
    tensors.push(("model.layers.99.extra.weight".into(), "BF16".into(), vec![2]));
    let dir = tempfile::tempdir().unwrap();
    write_safetensors(&dir.path().join("model.safetensors"), &tensors);
    let r = checkpoint::check(dir.path(), &v).unwrap();
    assert_eq!(r.unused, 1);
    let lines: Vec<String> = r.problems.iter().map(|p| p.to_string()).collect();
    assert_eq!(lines.len(), 3, "{lines:#?}");
    assert!(lines.iter().any(|l| l.starts_with("wrong shape for ") && l.contains(&wrong_shape)), "{lines:#?}");
    assert!(lines.iter().any(|l| l.starts_with("wrong dtype for ") && l.contains(&wrong_dtype)), "{lines:#?}");
    assert!(lines.iter().any(|l| l.starts_with("missing tensor ") && l.contains(&missing)), "{lines:#?}");
}

#[test]
fn f32_declarations_accept_bf16_storage_but_not_the_reverse() {
    let v = tiny("kimi_linear");
    let reqs = checkpoint::requirements(&v);
    let mut tensors = as_tensors(&reqs);
    let a_log = tensors.iter().position(|t| t.0.ends_with("A_log")).unwrap();
    tensors[a_log].1 = "BF16".into();
    let embed = tensors.iter().position(|t| t.0 == "model.embed_tokens.weight").unwrap();
    tensors[embed].1 = "F32".into();
    let dir = tempfile::tempdir().unwrap();
    write_safetensors(&dir.path().join("model.safetensors"), &tensors);
    let r = checkpoint::check(dir.path(), &v).unwrap();
    assert_eq!(r.problems.len(), 1, "{:?}", r.problems);
    assert!(matches!(&r.problems[0], Problem::DType { need, .. } if need.key == "model.embed_tokens.weight"));
}

#[test]
fn truncated_shard_and_broken_index_are_reported() {
    let v = tiny("kimi_k2");
    let tensors = as_tensors(&checkpoint::requirements(&v));
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = tensors.split_at(tensors.len() / 2);
    write_safetensors(&dir.path().join("model-00001-of-00002.safetensors"), a);
    write_safetensors(&dir.path().join("model-00002-of-00002.safetensors"), b);
    let mut map = BTreeMap::new();
    for (name, _, _) in a {
        map.insert(name.clone(), "model-00001-of-00002.safetensors");
    }
    for (name, _, _) in b {
        map.insert(name.clone(), "model-00002-of-00002.safetensors");
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": map});
    std::fs::write(dir.path().join("model.safetensors.index.json"), index.to_string()).unwrap();
    assert!(checkpoint::check(dir.path(), &v).unwrap().problems.is_empty());

    // Cut the second shard in the middle of its data.
    let second = dir.path().join("model-00002-of-00002.safetensors");
    let len = std::fs::metadata(&second).unwrap().len();
    let f = std::fs::OpenOptions::new().write(true).open(&second).unwrap();
    f.set_len(len - 1000).unwrap();
    let r = checkpoint::check(dir.path(), &v).unwrap();
    assert!(!r.problems.is_empty());
    for p in &r.problems {
        assert!(matches!(p, Problem::Truncated { file, .. } if file == "model-00002-of-00002.safetensors"), "{p}");
    }
    // The last tensor of the shard is named.
    let last = &b.last().unwrap().0;
    assert!(r.problems.iter().any(|p| p.to_string().contains(last.as_str())));

    // A shard cut inside its header is one unreadable file; its tensors are not listed as missing.
    let f = std::fs::OpenOptions::new().write(true).open(&second).unwrap();
    f.set_len(20).unwrap();
    let r = checkpoint::check(dir.path(), &v).unwrap();
    assert_eq!(r.problems.len(), 1, "{:?}", r.problems);
    assert!(r.problems[0].to_string().starts_with("unreadable file model-00002-of-00002.safetensors"));

    std::fs::write(dir.path().join("model.safetensors.index.json"), "{\"weight_map\": 3}").unwrap();
    let e = checkpoint::check(dir.path(), &v).unwrap_err();
    assert!(e.reason.contains("weight_map"), "{e}");
}

#[test]
fn an_empty_directory_is_an_error() {
    let v = tiny("kimi_k2");
    let dir = tempfile::tempdir().unwrap();
    let e = checkpoint::check(dir.path(), &v).unwrap_err();
    assert!(e.reason.contains("no *.safetensors"), "{e}");
}

// ---- real checkpoints written by transformers 5.17 -------------------------

fn fixture(name: &str) -> PathBuf {
    root().join("tests/fixtures/checkpoints").join(name)
}

fn copy_dir(from: &Path, to: &Path) {
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

fn mkc_check(graph: &str, dir: &Path) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_mkc"))
        .args(["check", graph, "--checkpoint"])
        .arg(dir)
        .current_dir(root())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

/// Rewrites one tensor's header entry of a safetensors file in place,
/// keeping the data section as it is: `edit` changes the entry and returns
/// the key to store it under (`None` keeps the key).
fn edit_header(path: &Path, key: &str, edit: impl Fn(&mut serde_json::Value) -> Option<String>) {
    let bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let mut entry = header.remove(key).unwrap_or_else(|| panic!("{key} not in {}", path.display()));
    let new_key = edit(&mut entry).unwrap_or_else(|| key.to_string());
    header.insert(new_key, entry);
    let text = serde_json::to_string(&header).unwrap();
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(text.as_bytes());
    out.extend_from_slice(&bytes[8 + n..]);
    std::fs::write(path, out).unwrap();
}

#[test]
fn transformers_checkpoints_pass() {
    for (graph, dir) in [
        ("model_graphs/kimi_k2/graph.mkc", "deepseek_v3_tiny"),
        ("model_graphs/kimi_k2/graph.mkc", "deepseek_v3_tiny_sharded"),
        ("model_graphs/kimi_linear/graph.mkc", "kimi_linear_tiny"),
    ] {
        let (ok, text) = mkc_check(graph, &fixture(dir));
        assert!(ok, "{dir}:\n{text}");
        assert!(text.contains("checkpoint matches the graph"), "{text}");
    }
}

#[test]
fn broken_copies_of_a_transformers_checkpoint_fail_naming_each_tensor() {
    let dir = tempfile::tempdir().unwrap();
    copy_dir(&fixture("deepseek_v3_tiny"), dir.path());
    let file = dir.path().join("model.safetensors");
    let missing = "model.layers.2.mlp.experts.5.up_proj.weight";
    let reshaped = "model.layers.0.self_attn.kv_b_proj.weight";
    // Renamed, not removed: the bytes of a removed entry would be a gap in
    // the data section, which makes the whole file unreadable.
    edit_header(&file, missing, |_| Some(format!("{missing}.renamed")));
    edit_header(&file, reshaped, |e| {
        e["shape"] = serde_json::json!([256, 16]);
        None
    });
    let (ok, text) = mkc_check("model_graphs/kimi_k2/graph.mkc", dir.path());
    assert!(!ok, "{text}");
    let problems: Vec<&str> =
        text.lines().skip_while(|l| !l.starts_with("checkpoint ")).skip(1).filter(|l| l.starts_with("  ")).collect();
    assert_eq!(problems.len(), 2, "{text}");
    assert!(problems.iter().any(|l| l.contains("missing tensor") && l.contains(missing)), "{text}");
    assert!(problems.iter().any(|l| l.contains("wrong shape") && l.contains(reshaped)), "{text}");

    // A truncated file: every tensor whose bytes are cut off is named.
    let dir = tempfile::tempdir().unwrap();
    copy_dir(&fixture("deepseek_v3_tiny"), dir.path());
    let file = dir.path().join("model.safetensors");
    let len = std::fs::metadata(&file).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&file).unwrap().set_len(len / 2).unwrap();
    let (ok, text) = mkc_check("model_graphs/kimi_k2/graph.mkc", dir.path());
    assert!(!ok, "{text}");
    let truncated: Vec<&str> = text.lines().filter(|l| l.contains("truncated tensor")).collect();
    assert!(!truncated.is_empty(), "{text}");
    assert!(truncated.iter().all(|l| l.contains("model.safetensors")), "{text}");
}

#[test]
fn a_k3_checkpoint_in_k3_naming_with_mxfp4_experts_passes() {
    // Written by tests/gpu/make_k3_checkpoint.py (the project's K3 reference,
    // from K3_DECODE_SPEC.md) for model_graphs/kimi_k3/tiny.json, seed 1.
    let (ok, text) = mkc_check("model_graphs/kimi_k3/graph.mkc", &fixture("kimi_k3_tiny_mxfp4"));
    assert!(ok, "{text}");
    // Layer 0's attention-residual scorer is in the checkpoint but never read (spec section 4).
    assert!(text.contains("394 needed, 2 unused"), "{text}");
}

/// Kimi K2 as released (FP8): a checkpoint in its format passes, and a
/// missing block-scale tensor, a scale of the wrong shape and a weight
/// stored as bf16 instead of e4m3 are each reported by name.
#[test]
fn fp8_checkpoint_problems_are_named() {
    let v = compile("kimi_k2", &root().join("model_graphs/kimi_k2/tiny_fp8.json"));
    let reqs = checkpoint::requirements(&v);
    let tensors = as_tensors(&reqs);
    let dir = tempfile::tempdir().unwrap();
    write_safetensors(&dir.path().join("model.safetensors"), &tensors);
    let r = checkpoint::check(dir.path(), &v).unwrap();
    assert!(r.problems.is_empty(), "{:?}", r.problems);
    let fp8: Vec<usize> = (0..tensors.len()).filter(|i| tensors[*i].1 == "F8_E4M3").collect();
    assert!(fp8.len() > 10, "the tiny FP8 config's weights are FP8");
    for &i in &fp8 {
        let scale = &tensors[i + 1];
        assert_eq!(scale.0, format!("{}_scale_inv", tensors[i].0));
        assert_eq!(scale.1, "F32");
        let want: Vec<u64> = tensors[i].2.iter().map(|d| d.div_ceil(128)).collect();
        assert_eq!(scale.2, want, "{}", scale.0);
    }
    let (a, b, c) = (fp8[0], fp8[1], fp8[2]);
    let mut broken = tensors.clone();
    let missing = broken[a + 1].0.clone();
    broken[b + 1].2 = vec![7, 7];
    let misshaped = broken[b + 1].0.clone();
    broken[c].1 = "BF16".into();
    let bf16 = broken[c].0.clone();
    broken.remove(a + 1);
    let dir = tempfile::tempdir().unwrap();
    write_safetensors(&dir.path().join("model.safetensors"), &broken);
    let r = checkpoint::check(dir.path(), &v).unwrap();
    let lines: Vec<String> = r.problems.iter().map(|p| p.to_string()).collect();
    assert_eq!(lines.len(), 3, "{lines:#?}");
    assert!(lines.iter().any(|l| l.starts_with("missing tensor ") && l.contains(&missing)), "{lines:#?}");
    assert!(lines.iter().any(|l| l.starts_with("wrong shape for ") && l.contains(&misshaped)), "{lines:#?}");
    assert!(
        lines.iter().any(|l| l.starts_with("wrong dtype for ") && l.contains(&bf16) && l.contains("F8_E4M3")),
        "{lines:#?}"
    );
}
