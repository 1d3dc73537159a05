//! `mkc check` summaries of every shipped model graph, snapshotted, and the
//! parameter counts the models are known by.

use std::path::Path;

use mkc::config::Config;
use mkc::lower::Limits;
use mkc::report::{summarize, Summary};

fn summary(model: &str, config: &str) -> Summary {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let graph = root.join("model_graphs").join(model).join("graph.mkc");
    let source = std::fs::read_to_string(&graph).expect("graph file");
    let config = Config::load(&root.join("model_graphs").join(model).join(config)).expect("config");
    let v = mkc::compile_str(&source, &config, Limits::default())
        .unwrap_or_else(|e| panic!("{}", mkc::diag::render(&e, &graph.display().to_string(), &source)));
    summarize(&v, 4096, &[1, 8])
}

fn within(actual: u128, expected: f64, tolerance: f64) -> bool {
    ((actual as f64 - expected) / expected).abs() <= tolerance
}

#[test]
fn kimi_k3_is_2_78t_total_104b_active() {
    let s = summary("kimi_k3", "config.json");
    // K3_DECODE_SPEC.md section 1: 2,779,484,476,000 parameters; 104B active.
    assert!(within(s.total_params, 2779.9e9, 0.01), "total {}", s.total_params);
    assert!(within(s.active_params, 104e9, 0.01), "active {}", s.active_params);
    // Section 11: about 137.0 GB of weights per batch-1 step.
    assert!(within(s.bytes_per_step[0].1.into(), 137.0e9, 0.01), "bytes {}", s.bytes_per_step[0].1);
    assert_eq!(s.ops["kda_decode"], 69);
    assert_eq!(s.ops["mla_decode"], 24);
    assert_eq!(s.ops["moe"], 92);
    // Eight attention-residual snapshots with a block size of 12.
    assert_eq!(s.ops["stack"], 8);
    insta::assert_snapshot!("kimi_k3", s.render());
}

#[test]
fn kimi_k2_is_1_03t_total_32b_active() {
    let s = summary("kimi_k2", "config.json");
    assert!(within(s.total_params, 1.03e12, 0.01), "total {}", s.total_params);
    assert!(within(s.active_params, 32e9, 0.02), "active {}", s.active_params);
    assert_eq!(s.ops["moe"], 60);
    assert_eq!(s.ops["mla_decode"], 61);
    insta::assert_snapshot!("kimi_k2", s.render());
}

#[test]
fn kimi_linear_is_48b_total_3b_active() {
    let s = summary("kimi_linear", "config.json");
    // 48B-A3B; the count includes the 0.75B of embedding and LM head.
    assert!(within(s.total_params, 48e9, 0.03), "total {}", s.total_params);
    assert!(within(s.active_params, 3e9, 0.05), "active {}", s.active_params);
    assert_eq!(s.ops["kda_decode"], 20);
    assert_eq!(s.ops["mla_decode"], 7);
    insta::assert_snapshot!("kimi_linear", s.render());
}

#[test]
fn tiny_configs_validate() {
    for model in ["kimi_k3", "kimi_k2", "kimi_linear"] {
        let s = summary(model, "tiny.json");
        assert!(s.total_params < 10_000_000, "{model} tiny has {} params", s.total_params);
        insta::assert_snapshot!(format!("{model}_tiny"), s.render());
    }
}

#[test]
fn a_yaml_config_binds_like_its_json() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("model_graphs/kimi_k2");
    let source = std::fs::read_to_string(root.join("graph.mkc")).unwrap();
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(root.join("tiny.json")).unwrap()).unwrap();
    // The same config written as YAML, comments included.
    let mut yaml = String::from("# tiny DeepSeek-V3, as YAML\n");
    for (k, v) in json.as_object().unwrap() {
        yaml += &format!("{k}: {}\n", serde_json::to_string(v).unwrap());
    }
    let from_yaml = Config::parse(&yaml, "tiny.yaml").unwrap();
    let from_json = Config::load(&root.join("tiny.json")).unwrap();
    let a = mkc::compile_str(&source, &from_yaml, Limits::default()).unwrap();
    let b = mkc::compile_str(&source, &from_json, Limits::default()).unwrap();
    assert_eq!(summarize(&a, 4096, &[1, 8]).render(), summarize(&b, 4096, &[1, 8]).render());
}

#[test]
fn a_nested_text_config_is_read() {
    // K3's config keeps its hyperparameters under `text_config`.
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("model_graphs/kimi_k3");
    let c = Config::load(&root.join("config.json")).unwrap();
    assert_eq!(c.root.get("hidden_size"), Some(&mkc::lower::Const::Int(7168)));
    assert_eq!(c.root.get("model_type"), Some(&mkc::lower::Const::Str("kimi_linear".into())));
}
