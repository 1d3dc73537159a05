//! The planner on every shipped model and target: plans are produced and
//! verified (snapshotted as YAML summaries), the verifier catches every
//! dependency removed from a real plan, and random small graphs always plan,
//! verify and respect the critical-path bound.

use std::collections::BTreeMap;
use std::path::Path;

use mkc::config::Config;
use mkc::lower::Limits;
use mkc::plan::fuse::FusedKind;
use mkc::plan::tile::TaskKind;
use mkc::plan::{self, estimate, verify, Options, Plan};
use mkc::target::Target;
use mkc::valid::Validated;
use proptest::prelude::*;
use serde::Serialize;

fn compile_with(source: &str, config: &Config) -> Validated {
    mkc::compile_str(source, config, Limits::default())
        .unwrap_or_else(|e| panic!("{}", mkc::diag::render(&e, "graph", source)))
}

fn compile(model: &str, config: &str) -> Validated {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("model_graphs").join(model);
    let source = std::fs::read_to_string(root.join("graph.mkc")).unwrap();
    compile_with(&source, &Config::load(&root.join(config)).unwrap())
}

#[derive(Serialize)]
struct PlanSummary {
    fused_ops: BTreeMap<&'static str, usize>,
    rules: BTreeMap<&'static str, usize>,
    stages: usize,
    tasks: usize,
    counters: usize,
    waits: usize,
    buffers: usize,
    threads: u32,
    consumer_regs: u32,
    pages: u32,
    verified: verify::Proof,
    weight_gb: String,
    floor_us: String,
    predicted_us: String,
    tokens_per_s: String,
}

fn summary(p: &Plan) -> PlanSummary {
    let mut fused_ops = BTreeMap::new();
    let mut rules = BTreeMap::new();
    for op in &p.fusion.ops {
        *fused_ops.entry(plan::fuse::kind_name(op.kind)).or_insert(0) += 1;
        for a in &op.applied {
            *rules.entry(a.rule).or_insert(0) += 1;
        }
    }
    let e = estimate::estimate(p);
    PlanSummary {
        fused_ops,
        rules,
        stages: p.tiling.stages.len(),
        tasks: p.tiling.tasks.len(),
        counters: p.schedule.counters.len(),
        waits: p.schedule.sms.iter().flatten().map(|i| i.waits.len()).sum(),
        buffers: p.tiling.buffers.len(),
        threads: p.warps.layout.threads,
        consumer_regs: p.warps.layout.consumer_regs,
        pages: p.warps.layout.pages,
        verified: p.verified,
        weight_gb: format!("{:.3}", e.weight_bytes as f64 / 1e9),
        floor_us: format!("{:.1}", e.floor_us),
        predicted_us: format!("{:.1}", e.step_us),
        tokens_per_s: format!("{:.1}", e.tokens_per_s),
    }
}

#[test]
fn every_model_plans_on_every_target() {
    for model in ["kimi_k3", "kimi_k2", "kimi_linear"] {
        let v = compile(model, "config.json");
        for target in ["h200", "b200", "gb300"] {
            let t = Target::load(target).unwrap();
            let p = plan::plan(&v, &t, Options::default()).unwrap();
            assert!(p.schedule.step_ns >= p.schedule.critical_path_ns - 1e-6);
            assert!(p.schedule.step_ns >= p.schedule.floor_ns * 0.999);
            insta::assert_yaml_snapshot!(format!("{model}_{target}"), summary(&p));
        }
    }
}

#[test]
fn batch_8_and_the_peer_configuration_plan() {
    let v = compile("kimi_k2", "bench_4l64e.json");
    let t = Target::load("h200").unwrap();
    for batch in [1, 8] {
        let p = plan::plan(&v, &t, Options { batch, context: 4096, ..Options::default() }).unwrap();
        insta::assert_yaml_snapshot!(format!("kimi_k2_bench_4l64e_h200_batch{batch}"), summary(&p));
    }
}

/// A stage waits for its slowest SM, and a task's fixed cost is several
/// microseconds: where a stage has no more tasks than SMs, no SM may run two
/// of them (the H200 profile in docs/PERFORMANCE.md measured what two or three
/// cost). Checked on the benchmark plan at batch 1 and 8 and on K3.
#[test]
fn no_sm_runs_two_tasks_of_a_stage_that_fits() {
    let t = Target::load("h200").unwrap();
    for (model, config, batch) in
        [("kimi_k2", "bench_4l64e.json", 1), ("kimi_k2", "bench_4l64e.json", 8), ("kimi_k3", "test_8l96e.json", 1)]
    {
        let v = compile(model, config);
        let p = plan::plan(&v, &t, Options { batch, context: 4096, ..Options::default() }).unwrap();
        let mut per_sm = std::collections::HashMap::new();
        for (m, list) in p.schedule.sms.iter().enumerate() {
            for ins in list {
                *per_sm.entry((ins.stage, m)).or_insert(0u32) += 1;
            }
        }
        for stage in &p.tiling.stages {
            if stage.tasks.len() > p.schedule.sms.len() {
                continue;
            }
            let most = (0..p.schedule.sms.len()).map(|m| per_sm.get(&(stage.id, m)).copied().unwrap_or(0)).max();
            assert_eq!(
                most,
                Some(1),
                "{model} {config} batch {batch}: stage {} has {} tasks and an SM with {most:?}",
                stage.id,
                stage.tasks.len()
            );
        }
    }
}

/// Every wait of a real plan is necessary: deleting it, or lowering its
/// target by one, must make the verifier fail.
fn mutate_every_wait(p: &Plan) -> usize {
    let mut tried = 0;
    for m in 0..p.schedule.sms.len() {
        for i in 0..p.schedule.sms[m].len() {
            for w in 0..p.schedule.sms[m][i].waits.len() {
                let mut s = p.schedule.clone();
                s.sms[m][i].waits.remove(w);
                assert!(
                    verify::verify(&p.fusion, &p.tiling, &s).is_err(),
                    "deleting wait {w} of SM {m} instruction {i} went unnoticed"
                );
                let mut s = p.schedule.clone();
                s.sms[m][i].waits[w].target -= 1;
                assert!(
                    verify::verify(&p.fusion, &p.tiling, &s).is_err(),
                    "lowering wait {w} of SM {m} instruction {i} went unnoticed"
                );
                tried += 2;
            }
        }
    }
    tried
}

#[test]
fn the_verifier_catches_every_removed_dependency() {
    let mut tried = 0;
    for model in ["kimi_k2", "kimi_linear", "kimi_k3"] {
        let v = compile(model, "tiny.json");
        // A small target keeps the plan small enough to mutate exhaustively.
        let mut t = Target::load("h200").unwrap();
        t.sms = 8;
        let p = plan::plan(&v, &t, Options::default()).unwrap();
        assert!(verify::verify(&p.fusion, &p.tiling, &p.schedule).is_ok());
        let n = mutate_every_wait(&p);
        assert!(n > 100, "{model}: only {n} mutations");
        tried += n;
    }
    // Other mutations: a lost task, a wrong expected count, a wait on a later stage.
    let v = compile("kimi_k2", "tiny.json");
    let p = plan::plan(&v, &Target::load("h200").unwrap(), Options::default()).unwrap();
    let mut s = p.schedule.clone();
    let m = s.sms.iter().position(|l| !l.is_empty()).unwrap();
    s.sms[m].pop();
    assert!(verify::verify(&p.fusion, &p.tiling, &s).is_err());
    let mut s = p.schedule.clone();
    s.counters[3].expected += 1;
    assert!(verify::verify(&p.fusion, &p.tiling, &s).is_err());
    let mut s = p.schedule.clone();
    let (m, i) = (0..s.sms.len())
        .flat_map(|m| (0..s.sms[m].len()).map(move |i| (m, i)))
        .find(|(m, i)| s.sms[*m][*i].stage == 0)
        .unwrap();
    s.sms[m][i].waits.push(plan::schedule::Wait { counter: 5, target: 1 });
    assert!(verify::verify(&p.fusion, &p.tiling, &s).is_err());
    tried += 3;
    println!("verifier mutation test: {tried} mutations, all rejected");
}

#[test]
fn bad_targets_are_refused_with_the_field_named() {
    let good = std::fs::read_to_string(mkc::target::targets_dir().join("h200.yaml")).unwrap();
    let e = Target::parse(&good.replace("sms: 132", "sms: lots"), "bad.yaml").unwrap_err();
    assert!(e.reason.contains("bad.yaml") && e.reason.contains("sms"), "{e}");
    let e = Target::parse(&good.replace("sms: 132\n", ""), "bad.yaml").unwrap_err();
    assert!(e.reason.contains("missing field `sms`"), "{e}");
    let e = Target::parse(&good.replace("arch: sm_90a", "arch: sm_80"), "bad.yaml").unwrap_err();
    assert!(e.reason.contains("`arch`"), "{e}");
    let e = Target::parse(&format!("{good}\nwarp_size: 64\n"), "bad.yaml").unwrap_err();
    assert!(e.reason.contains("warp_size"), "{e}");
    let e = Target::parse(&good.replace("smem_per_block: 232448", "smem_per_block: 40000"), "small.yaml");
    let t = e.unwrap();
    let v = compile("kimi_k2", "tiny.json");
    let e = plan::plan(&v, &t, Options::default()).unwrap_err();
    assert!(e.reason.contains("pages"), "{e}");
    let e = Target::load("h300").unwrap_err();
    assert_eq!(e.reason, "unknown target h300; did you mean h200? targets: b200, gb300, h200");
}

// ---- random small graphs ------------------------------------------------------

/// A random graph file of the shipped families (their graphs with random small
/// configs) or a random chain of projections, norms and residual adds.
fn random_config(family: usize, r: &[u64]) -> (String, String) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("model_graphs");
    let model = ["kimi_k2", "kimi_linear", "kimi_k3"][family];
    let source = std::fs::read_to_string(root.join(model).join("graph.mkc")).unwrap();
    let mut c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(root.join(model).join("tiny.json")).unwrap()).unwrap();
    let cfg = if c.get("text_config").is_some() { c.get_mut("text_config").unwrap() } else { &mut c };
    let layers = 1 + r[0] % 5;
    let experts = 4 + r[1] % 13;
    let top_k = 1 + r[2] % experts.min(4);
    cfg["num_hidden_layers"] = layers.into();
    cfg["hidden_size"] = (32 * (1 + r[3] % 4)).into();
    for key in ["n_routed_experts", "num_experts"] {
        if cfg.get(key).is_some() {
            cfg[key] = experts.into();
        }
    }
    for key in ["num_experts_per_tok", "num_experts_per_token"] {
        if cfg.get(key).is_some() {
            cfg[key] = top_k.into();
        }
    }
    for key in ["n_group", "num_expert_group"] {
        if cfg.get(key).is_some() {
            cfg[key] = 1.into();
        }
    }
    cfg["first_k_dense_replace"] = (r[4] % 2).into();
    cfg["num_attention_heads"] = (1 + r[5] % 4).into();
    if let Some(lin) = cfg.get_mut("linear_attn_config") {
        let full: Vec<u64> = (1..=layers).filter(|l| (l + r[6]).is_multiple_of(3)).collect();
        lin["full_attn_layers"] = serde_json::json!(full);
        lin["kda_layers"] = serde_json::json!((1..=layers).filter(|l| !full.contains(l)).collect::<Vec<_>>());
    }
    if let Some(obj) = cfg.as_object_mut() {
        obj.remove("layer_types");
        obj.remove("mlp_layer_types");
        if obj.contains_key("attn_res_block_size") {
            obj.insert("attn_res_block_size".into(), (1 + r[7] % 3).into());
        }
    }
    (source, c.to_string())
}

fn random_chain(r: &[u64]) -> String {
    let h = 32 * (1 + r[0] % 3);
    let mut s = format!("model chain\nparams {{\n  h = {h}\n}}\ngraph {{\n  input token: i32[]\n  weight emb: bf16[64, h] = \"emb\"\n  x = embedding(token, emb)\n");
    let n = 1 + r[1] % 12;
    for i in 0..n {
        let w = 16 * (1 + (r[2 + (i as usize % 6)] >> i) % 8);
        match (r[2 + (i as usize % 6)] >> (2 * i)) % 4 {
            0 => s += &format!("  weight n{i}: bf16[h] = \"n{i}\"\n  x = rms_norm(x, n{i})\n"),
            1 => s += &format!("  weight a{i}: bf16[{w}, h] = \"a{i}\"\n  weight b{i}: bf16[h, {w}] = \"b{i}\"\n  x = add(x, linear(silu(linear(x, a{i})), b{i}))\n"),
            2 => s += &format!("  weight g{i}: bf16[{w}, h] = \"g{i}\"\n  weight up{i}: bf16[{w}, h] = \"up{i}\"\n  weight d{i}: bf16[h, {w}] = \"d{i}\"\n  x = add(x, linear(act_and_mul(linear(x, g{i}), linear(x, up{i})), d{i}))\n"),
            _ => s += &format!("  weight p{i}: bf16[h, h] = \"p{i}\"\n  y{i} = linear(x, p{i})\n  x = mul(x, sigmoid(y{i}))\n"),
        }
    }
    s += "  weight head: bf16[64, h] = \"head\"\n  logits = lm_head(x, head)\n  next = argmax(logits)\n  output next, logits\n}\n";
    s
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn random_small_graphs_plan_verify_and_respect_the_critical_path(
        family in 0usize..4,
        r in proptest::collection::vec(any::<u64>(), 8),
        target in 0usize..3,
        batch in 1u32..9,
        sms in 4u32..140,
        context in 1u64..5000,
    ) {
        let (source, config) = if family == 3 {
            (random_chain(&r), "{}".to_string())
        } else {
            random_config(family, &r)
        };
        let config = Config::parse(&config, "random.json").unwrap();
        let v = compile_with(&source, &config);
        let mut t = Target::load(["h200", "b200", "gb300"][target]).unwrap();
        t.sms = sms;
        let p = plan::plan(&v, &t, Options { batch, context, ..Options::default() }).unwrap();
        prop_assert!(p.schedule.step_ns + 1e-6 >= p.schedule.critical_path_ns,
            "step {} below the critical path {}", p.schedule.step_ns, p.schedule.critical_path_ns);
        prop_assert!(p.schedule.step_ns * 1.000001 >= p.schedule.floor_ns,
            "step {} below the bandwidth floor {}", p.schedule.step_ns, p.schedule.floor_ns);
        // Every task is scheduled exactly once.
        let placed: usize = p.schedule.sms.iter().map(Vec::len).sum();
        prop_assert_eq!(placed, p.tiling.tasks.len());
    }
}

#[test]
fn device_tables_follow_the_schedule_and_the_device_opcodes() {
    let v = compile("kimi_k3", "tiny.json");
    let p = plan::plan(&v, &Target::load("h200").unwrap(), Options::default()).unwrap();
    let t = plan::tables::tables(&p);
    assert_eq!(t.sm_begin.len(), p.schedule.sms.len() + 1);
    assert_eq!(*t.sm_begin.last().unwrap() as usize, p.tiling.tasks.len());
    assert!(t.sm_begin.windows(2).all(|w| w[0] <= w[1]));
    for (s, list) in p.schedule.sms.iter().enumerate() {
        for (i, ins) in list.iter().enumerate() {
            let d = t.instructions[t.sm_begin[s] as usize + i];
            assert_eq!(d.task as usize, ins.task);
            let waits = &t.waits[d.first_wait as usize..d.first_wait as usize + d.n_waits as usize];
            let expect: Vec<(u32, u32)> = ins.waits.iter().map(|w| (w.counter as u32, w.target)).collect();
            assert_eq!(waits, expect.as_slice());
            assert_eq!(plan::tables::OPCODES[d.opcode as usize], p.tiling.stages[ins.stage].kind);
        }
    }
    // The device header lists the opcodes in the same order.
    let header =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("device/mkc/instruction.cuh")).unwrap();
    let body = &header[header.find("enum Opcode").unwrap()..];
    let body = &body[body.find('{').unwrap() + 1..body.find("};").unwrap()];
    let names: Vec<String> = body
        .split(',')
        .map(|e| e.split('=').next().unwrap().trim().trim_start_matches('k').to_string())
        .filter(|n| !n.is_empty())
        .collect();
    let expected: Vec<String> = plan::tables::OPCODES
        .iter()
        .map(|k| {
            serde_json::to_value(k)
                .unwrap()
                .as_str()
                .unwrap()
                .split('_')
                .map(|w| w[..1].to_uppercase() + &w[1..])
                .collect()
        })
        .collect();
    assert_eq!(names, expected);
}

/// The section of a plan file with id `id`.
fn section(file: &[u8], id: mkc::emit::plan_file::Section) -> mkc::emit::plan_file::SectionEntry {
    mkc::emit::plan_file::sections(file).into_iter().find(|e| e.id == id as u32).expect("every section is written")
}

#[test]
fn codegen_is_deterministic_and_names_are_legal() {
    use mkc::emit::plan_file::{Section, MAGIC};
    let v = compile("kimi_linear", "tiny.json");
    let t = Target::load("b200").unwrap();
    let from = mkc::emit::Provenance { graph: "g.mkc".into(), config: "c.json".into() };
    let a =
        mkc::emit::emit(&v, &plan::plan(&v, &t, Options::default()).unwrap(), "kimi-linear tiny/b200", &from, "", true)
            .unwrap();
    let b =
        mkc::emit::emit(&v, &plan::plan(&v, &t, Options::default()).unwrap(), "kimi-linear tiny/b200", &from, "", true)
            .unwrap();
    assert_eq!(a.files, b.files);
    assert_eq!(a.plan, b.plan);
    assert_eq!(&a.plan[..8], MAGIC);
    assert!(a.file("plan_summary.txt").unwrap().contains("model kimi_linear_tiny_b200\n"));
    assert_eq!(mkc::emit::namespace("9lives"), "m9lives");
    // Every instruction of the plan is in the table, and every task.
    let tasks: usize = plan::plan(&v, &t, Options::default()).unwrap().tiling.tasks.len();
    assert_eq!(section(&a.plan, Section::Instructions).count, tasks as u64);
    assert_eq!(section(&a.plan, Section::Tasks).count, tasks as u64);
}

/// The whole K2-family and Kimi Linear program: every stage has device code
/// in the consumers' dispatch (its kind's role), every projection and expert
/// stage a loader case, every task its arguments, and two renderings are
/// identical.
#[test]
fn k2_program_covers_every_stage() {
    use mkc::emit::plan_file::Section;
    for (model, config, batch) in [
        ("kimi_k2", "tiny.json", 1),
        ("kimi_k2", "tiny.json", 4),
        ("kimi_k2", "bench_4l64e.json", 8),
        ("kimi_linear", "tiny.json", 1),
        ("kimi_linear", "tiny.json", 4),
        ("kimi_k3", "tiny.json", 1),
        ("kimi_k3", "tiny.json", 4),
    ] {
        let v = compile(model, config);
        let config = format!("{model} {config}");
        let t = Target::load("h200").unwrap();
        let opts = Options { batch, ..Options::default() };
        let p = plan::plan(&v, &t, opts).unwrap();
        let from = mkc::emit::Provenance { graph: "g.mkc".into(), config: config.clone() };
        let a = mkc::emit::emit(&v, &p, "k2_h200", &from, "", false).unwrap();
        let b = mkc::emit::emit(&v, &plan::plan(&v, &t, opts).unwrap(), "k2_h200", &from, "", false).unwrap();
        assert_eq!(a.files, b.files, "{config}: codegen is not deterministic");
        assert_eq!(a.plan, b.plan, "{config}: the plan file is not deterministic");
        let names: Vec<&str> = a.files.iter().map(|f| f.0.as_str()).collect();
        assert_eq!(names, ["program.cuh", "model.cu", "CMakeLists.txt", "plan_summary.txt"]);
        let program = a.file("program.cuh").unwrap();
        let (load, run) = program.split_once("static __device__ void run(").unwrap();
        let stages = section(&a.plan, Section::Stages);
        assert_eq!(stages.count, p.tiling.stages.len() as u64, "{config}: one record per stage");
        let records = stages.bytes(&a.plan);
        for s in &p.tiling.stages {
            let role = u32::from_le_bytes(records[16 * s.id..16 * s.id + 4].try_into().unwrap());
            let case = format!("case {role}: {{");
            assert!(run.contains(&case), "{config}: stage {} ({:?}) has no device code", s.id, s.kind);
            use plan::tile::TaskKind as K;
            let streams = matches!(s.kind, K::ProjectionRows | K::LmHeadRows | K::ExpertUp | K::ExpertDown);
            let loads = load.split("case ").skip(1).any(|c| {
                c.starts_with(&format!("{role}: {{"))
                    && ["rows_load<kBatch>(", "mx_rows_load("]
                        .iter()
                        .any(|f| c.split("break;").next().unwrap().contains(f))
            });
            assert_eq!(loads, streams, "{config}: stage {} loader case", s.id);
        }
        assert_eq!(section(&a.plan, Section::Tasks).count, p.tiling.tasks.len() as u64, "{config}: one row per task");
        assert!(program.contains(&format!("inline constexpr int kBatch = {batch};")));
    }
}

/// The verifier refuses a routed expert stage whose loader does not wait for
/// its router's whole stage, and a loader wait anywhere else.
#[test]
fn the_verifier_checks_the_loaders_waits() {
    let v = compile("kimi_k3", "tiny.json");
    let t = Target::load("h200").unwrap();
    let p = plan::plan(&v, &t, Options::default()).unwrap();
    let expert = p.tiling.stages.iter().find(|s| s.kind == plan::tile::TaskKind::ExpertUp).unwrap().id;
    let mut s = p.schedule.clone();
    s.load_waits[expert] = None;
    let err = plan::verify::verify(&p.fusion, &p.tiling, &s).unwrap_err().to_string();
    assert!(err.contains("loader wait"), "{err}");
    let mut s = p.schedule.clone();
    s.load_waits[0] = p.schedule.load_waits[expert];
    assert!(plan::verify::verify(&p.fusion, &p.tiling, &s).is_err());
    let mut s = p.schedule.clone();
    s.load_waits[expert] = s.load_waits[expert].map(|(c, n)| (c, n - 1));
    assert!(plan::verify::verify(&p.fusion, &p.tiling, &s).is_err());
    assert!(plan::verify::verify(&p.fusion, &p.tiling, &p.schedule).is_ok());
}

/// The verifier checks the arena's layout: two blocks of a region that
/// overlap, a block outside its buffer, a spill past the SM's staging and a
/// read of a value whose writer the reader does not wait for are each refused.
#[test]
fn the_verifier_checks_the_arena() {
    let v = compile("kimi_k3", "tiny.json");
    let t = Target::load("h200").unwrap();
    let p = plan::plan(&v, &t, Options::default()).unwrap();
    let g = p.graph.graph();
    assert!(plan::verify::arena(g, &p.tiling, &p.arena).unwrap() > 0);
    let check = |a: &plan::arena::Arena| plan::verify::arena(g, &p.tiling, a).map_err(|e| e.to_string());
    // Two blocks of one region, the second moved onto the first.
    let (i, j) = (0..p.arena.slots.len())
        .flat_map(|i| (i + 1..p.arena.slots.len()).map(move |j| (i, j)))
        .find(|&(i, j)| p.arena.slots[i].region == p.arena.slots[j].region)
        .expect("a region of two blocks");
    let mut a = p.arena.clone();
    a.slots[j].offset = a.slots[i].offset;
    assert!(check(&a).unwrap_err().contains("overlap"));
    // A block past its buffer's end.
    let mut a = p.arena.clone();
    let (at, bytes) = a.buffers[a.slots[0].buffer];
    a.slots[0].offset = at + bytes;
    assert!(check(&a).unwrap_err().contains("outside its buffer"));
    // A spill past the staging.
    let mut a = p.arena.clone();
    a.spills[0] = Some(a.staging_floats);
    assert!(check(&a).unwrap_err().contains("staging"));
    // The first stage reads the last stage's value: it cannot wait for it.
    let last = p.tiling.stages.len() - 1;
    let (&v, _) = p.arena.writes.iter().find(|(_, &w)| w == last).expect("the last stage writes");
    let mut a = p.arena.clone();
    a.reads[0].push(v);
    assert!(check(&a).unwrap_err().contains("without depending on it"));
}

/// The full 93-layer K3 is a program of its kinds: every layer of a kind
/// shares its code, so the generated sources stay far below the budget of
/// 12,000 lines (the layers, experts and tasks are data in the plan file).
#[test]
fn full_k3_program_is_the_size_of_its_kinds() {
    let v = compile("kimi_k3", "config.json");
    let from = mkc::emit::Provenance { graph: "g.mkc".into(), config: "config.json".into() };
    for target in ["gb300", "h200"] {
        let t = Target::load(target).unwrap();
        let p = plan::plan(&v, &t, Options::default()).unwrap();
        let a = mkc::emit::emit(&v, &p, "kimi_k3", &from, "", false).unwrap();
        let lines: usize = a.files.iter().filter(|(n, _)| !n.ends_with(".txt")).map(|(_, t)| t.lines().count()).sum();
        assert!(lines < 12_000, "{target}: {lines} lines");
        let kinds = a.file("program.cuh").unwrap().matches("_params {").count();
        assert!(kinds < 64, "{target}: {kinds} kinds for {} stages", p.tiling.stages.len());
        assert!(p.tiling.stages.len() > 1000);
    }
}

/// A config with `edit` applied, compiled.
fn compile_edited(model: &str, config: &str, edit: impl Fn(&mut serde_json::Value)) -> (Validated, String) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("model_graphs").join(model);
    let source = std::fs::read_to_string(root.join("graph.mkc")).unwrap();
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(root.join(config)).unwrap()).unwrap();
    edit(if cfg.get("text_config").is_some() { &mut cfg["text_config"] } else { &mut cfg });
    (compile_with(&source, &Config::parse(&cfg.to_string(), "edited.json").unwrap()), source)
}

/// What the device library cannot hold is refused by the planner (no plan
/// is made), by name, at the graph span of the operation's anchor: a KDA head
/// size past the device's, an MLA latent wider than a split's lanes hold, a
/// router of more groups than it ranks. Arithmetic it does not compute (a
/// softmax router) plans, and is refused the same way before code generation
/// renders anything.
#[test]
fn the_planner_refuses_what_the_device_cannot_run() {
    let t = Target::load("h200").unwrap();
    let from = mkc::emit::Provenance { graph: "g.mkc".into(), config: "c.json".into() };
    // (model, config, the edit, what the error names, the call it points at)
    type Case = (&'static str, &'static str, fn(&mut serde_json::Value), &'static str, &'static str);
    let cases: [Case; 4] = [
        ("kimi_k2", "tiny.json", |c| c["scoring_func"] = "softmax".into(), "router scoring \"softmax\"", "router("),
        (
            "kimi_linear",
            "tiny.json",
            |c| {
                c["linear_attn_config"]["head_dim"] = 512.into();
                c["linear_head_dim"] = 512.into();
            },
            "KDA head size 512 (a multiple of 4, at most 256)",
            "kda_decode(",
        ),
        ("kimi_k2", "tiny.json", |c| c["kv_lora_rank"] = 1024.into(), "an MLA latent width of 1024", "mla_decode("),
        (
            "kimi_k2",
            "tiny.json",
            |c| {
                c["n_group"] = 128.into();
                c["n_routed_experts"] = 128.into();
                c["topk_group"] = 2.into();
            },
            "a router over 128 experts in 128 groups",
            "router(",
        ),
    ];
    for (model, config, edit, needs, at) in cases {
        let (v, source) = compile_edited(model, config, edit);
        let err = match plan::plan(&v, &t, Options::default()) {
            Ok(p) if needs.starts_with("router scoring") => {
                mkc::emit::emit(&v, &p, "x_h200", &from, "", false).expect_err("codegen of a softmax router")
            }
            Ok(_) => panic!("{model}: planned with {needs}"),
            Err(e) => e,
        };
        let msg = err.to_string();
        assert!(msg.starts_with("fused operation") && msg.contains(needs), "{model}: {msg}");
        assert!(msg.contains("which the device library does not compute"), "{msg}");
        let span = err.span.unwrap_or_else(|| panic!("{model}: no span: {msg}"));
        let text = &source[span.start..span.end];
        assert!(text.contains(at), "{model}: the error points at `{text}`, not the {at}) call");
    }
}

/// K3's attention-residual mix keeps its consumer warps' partial scores in
/// the 24 KiB scratch: batch 12 fits, batch 16 is refused by the planner by
/// name rather than left to a static_assert in nvcc.
#[test]
fn attention_residual_mix_beyond_its_scratch_is_refused() {
    let from = mkc::emit::Provenance { graph: "g.mkc".into(), config: "c.json".into() };
    let t = Target::load("h200").unwrap();
    let v = compile("kimi_k3", "tiny.json");
    let p = plan::plan(&v, &t, Options { batch: 12, ..Options::default() }).unwrap();
    let a = mkc::emit::emit(&v, &p, "x_h200", &from, "", false).unwrap();
    assert!(a.file("program.cuh").unwrap().contains("attn_res_mix"), "batch 12 emits the mix");
    let err = plan::plan(&v, &t, Options { batch: 16, ..Options::default() }).unwrap_err().to_string();
    assert!(err.contains("attention-residual mix at batch 16") && err.contains("batch 12 at most"), "{err}");
}

/// The head gates join the attention stages that make their input (the
/// `head-gate` rule): KDA's gated output norm is applied by the KDA stage and
/// K3's MLA output gate by the MLA combine, so the output projections read a
/// plain input; in a verify step too. Where the gated norm's groups are not
/// KDA's heads, it stays the output projection's prologue.
#[test]
fn head_gates_join_their_attention_stage() {
    let from = mkc::emit::Provenance { graph: "g.mkc".into(), config: "c.json".into() };
    let t = Target::load("h200").unwrap();
    for (model, positions) in [("kimi_k3", 1), ("kimi_k3", 4), ("kimi_linear", 1)] {
        let v = compile(model, "tiny.json");
        let p = plan::plan(&v, &t, Options { batch: 2 * positions, positions, ..Options::default() }).unwrap();
        let a = mkc::emit::emit(&v, &p, "x_h200", &from, "", false).unwrap();
        let program = a.file("program.cuh").unwrap();
        let kda: Vec<&str> = program.lines().filter(|l| l.contains("KdaDecode{")).collect();
        assert!(!kda.is_empty(), "{model}: no KDA stage");
        for l in kda {
            assert!(l.contains(".gate = ") && l.contains(".sigmoid_act = 1"), "{model}: {l}");
        }
        assert!(!program.contains("rows_compute_gated"), "{model}: a gated-norm prologue is left");
        if model == "kimi_k3" {
            let combine: Vec<&str> = program.lines().filter(|l| l.contains("MlaCombine{")).collect();
            assert!(!combine.is_empty(), "no MLA combine");
            for l in combine {
                assert!(l.contains(".gate_sigmoid = 1"), "{l}");
            }
            assert!(!program.contains("rows_compute_mul"), "an MLA output-gate prologue is left");
        }
        let rules: Vec<&str> = p.fusion.ops.iter().flat_map(|o| o.applied.iter().map(|a| a.rule)).collect();
        assert!(rules.contains(&"head-gate"), "{model}: {rules:?}");
    }
    // Kimi Linear with the output norm over half a head: the projection's prologue.
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("model_graphs/kimi_linear");
    let source = std::fs::read_to_string(root.join("graph.mkc")).unwrap();
    let half = source.replace("weight o_norm: bf16[kda_dim] ", "weight o_norm: bf16[kda_dim / 2] ");
    assert_ne!(half, source, "the graph's o_norm declaration moved");
    let v = compile_with(&half, &Config::load(&root.join("tiny.json")).unwrap());
    let p = plan::plan(&v, &t, Options { batch: 2, ..Options::default() }).unwrap();
    let a = mkc::emit::emit(&v, &p, "x_h200", &from, "", false).unwrap();
    let program = a.file("program.cuh").unwrap();
    assert!(program.contains("rows_compute_gated"), "the half-head norm is not the projection's prologue");
    assert!(program.lines().filter(|l| l.contains("KdaDecode{")).all(|l| !l.contains(".gate = ")));
}

/// An input staged whole that does not fit the 64 KiB of shared-memory
/// staging (the MXFP4 experts' inputs of 3584 and 3072 at batch 8) is given a
/// spill in the SM's global staging past its output tile; at batch 1 it stays
/// in shared memory. (A gated input's spill, `rows_compute_gated` and
/// `rows_compute_mul` past 64 KiB, is run by ops_test.)
#[test]
fn wide_staged_inputs_spill_to_global_staging() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("model_graphs");
    let from = mkc::emit::Provenance { graph: "g.mkc".into(), config: "c.json".into() };
    let t = Target::load("h200").unwrap();
    let source = std::fs::read_to_string(root.join("kimi_k3/graph.mkc")).unwrap();
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(root.join("kimi_k3/tiny.json")).unwrap()).unwrap();
    let text = if cfg.get("text_config").is_some() { &mut cfg["text_config"] } else { &mut cfg };
    text["num_attention_heads"] = 96.into();
    text["v_head_dim"] = 128.into();
    text["routed_expert_hidden_size"] = 3584.into();
    text["moe_intermediate_size"] = 3072.into();
    let v = compile_with(&source, &Config::parse(&cfg.to_string(), "wide.json").unwrap());
    for (batch, spilled) in [(1, false), (8, true)] {
        let p = plan::plan(&v, &t, Options { batch, ..Options::default() }).unwrap();
        let a = mkc::emit::emit(&v, &p, "x_h200", &from, "", false).unwrap();
        let program = a.file("program.cuh").unwrap();
        for call in ["mx_rows_compute<kBatch>("] {
            let lines: Vec<&str> = program.lines().filter(|l| l.contains(call)).collect();
            assert!(!lines.is_empty(), "batch {batch}: no {call}");
            for l in lines {
                // The argument struct's `.spill = ...,` (the routed experts' `.tokens` after it).
                let (_, field) = l.split_once(".spill = ").unwrap_or_else(|| panic!("batch {batch}: no spill in {l}"));
                let spill = field.split(['}', ',']).next().unwrap();
                assert_eq!(spill.starts_with("st + "), spilled, "batch {batch}: {l}");
                assert_eq!(spill == "nullptr", !spilled, "batch {batch}: {l}");
            }
        }
    }
}

/// The arena layout the program uses: every slot inside its buffer, buffers
/// disjoint and inside the arena, slots of one region disjoint.
#[test]
fn k2_arena_layout_is_sound() {
    for (config, batch, target) in [
        ("tiny.json", 1, "h200"),
        ("tiny.json", 4, "gb300"),
        ("bench_4l64e.json", 8, "h200"),
        ("test_2l16e.json", 1, "b200"),
    ] {
        let v = compile("kimi_k2", config);
        let t = Target::load(target).unwrap();
        let p = plan::plan(&v, &t, Options { batch, ..Options::default() }).unwrap();
        let prog = mkc::emit::program::program(&p.graph, &p, "").unwrap();
        let what = format!("{config} batch {batch} on {target}");
        let mut bufs = prog.buffers.clone();
        bufs.sort();
        for w in bufs.windows(2) {
            assert!(w[0].0 + w[0].1 <= w[1].0, "{what}: buffers overlap: {w:?}");
        }
        let last = bufs.last().unwrap();
        assert!(last.0 + last.1 <= prog.arena_bytes, "{what}: the arena is too small");
        assert!(!prog.layout.is_empty());
        for s in &prog.layout {
            let (at, size) = prog.buffers[s.buffer];
            assert!(
                s.offset >= at && s.offset + s.bytes <= at + size,
                "{what}: {s:?} outside its buffer ({at}, {size})"
            );
            assert_eq!(s.offset % 16, 0, "{what}: {s:?} is not 16-byte aligned");
        }
        for (i, a) in prog.layout.iter().enumerate() {
            for b in &prog.layout[i + 1..] {
                if a.region == b.region {
                    assert!(
                        a.offset + a.bytes <= b.offset || b.offset + b.bytes <= a.offset,
                        "{what}: {a:?} and {b:?}"
                    );
                }
            }
        }
    }
}

/// Expert parallelism: one GPU's plan streams 1/N of the routed experts'
/// expected bytes and every other weight: the expert part scales as 1/N.
#[test]
fn expert_parallel_plans_one_gpus_share() {
    let v = compile("kimi_k2", "bench_4l64e.json");
    let t = Target::load("h200").unwrap();
    let w = |ep: u32| {
        let p = plan::plan(&v, &t, Options { expert_parallel: ep, ..Options::default() }).unwrap();
        plan::estimate::estimate(&p).weight_bytes as f64
    };
    let (w1, w2, w4) = (w(1), w(2), w(4));
    assert!(w1 > w2 && w2 > w4, "{w1} {w2} {w4}");
    // experts E: w1 - w2 = E/2, w1 - w4 = 3E/4.
    let ratio = (w1 - w2) / (w1 - w4);
    assert!((ratio - 2.0 / 3.0).abs() < 0.01, "ratio {ratio}");
    // At batch 1 the expected experts are exactly top-k: 4 layers x 8 experts of 3 x 2048 x 7168 bf16.
    let experts = 4.0 * 8.0 * 3.0 * 2048.0 * 7168.0 * 2.0;
    assert!(((w1 - w2) - experts / 2.0).abs() / experts < 0.01, "{} vs {}", w1 - w2, experts / 2.0);
}

#[test]
fn mxfp4_experts_are_costed_by_their_decode() {
    use mkc::plan::tile::TaskKind;
    let t = Target::load("h200").unwrap();
    // K3's MXFP4 experts (latent width 3584, expert width 3072): at batch 1 the 16 chosen experts'
    // gate/up rows (2 x 3072 x 3584 elements each) and down rows (3584 x 3072) are decoded once, shared
    // evenly by the stage's tasks.
    let v = compile("kimi_k3", "test_8l96e.json");
    let p = plan::plan(&v, &t, Options::default()).unwrap();
    let (mut up, mut down) = (0, 0);
    for stage in &p.tiling.stages {
        let decoded: Vec<u64> = stage.tasks.iter().map(|&id| p.tiling.tasks[id].decoded).collect();
        let whole = match stage.kind {
            TaskKind::ExpertUp => {
                up += 1;
                16 * 2 * 3072 * 3584
            }
            TaskKind::ExpertDown => {
                down += 1;
                16 * 3584 * 3072
            }
            _ => {
                assert!(decoded.iter().all(|d| *d == 0), "{:?}", stage.kind);
                continue;
            }
        };
        for &id in &stage.tasks {
            let plan::tile::TaskArgs::ExpertRows { parts, .. } = p.tiling.tasks[id].args else { panic!("expert rows") };
            assert_eq!(parts as usize, stage.tasks.len());
        }
        let sum: u64 = decoded.iter().sum();
        assert!(sum.abs_diff(whole) <= decoded.len() as u64, "{sum} vs {whole}");
        assert!(decoded.iter().max() == decoded.iter().min(), "{decoded:?}");
    }
    assert!(up > 0 && down > 0);
    // The decode makes an expert task's compute longer than its bytes at the SM's share of the bandwidth.
    let bw_sm = t.read_bandwidth() / f64::from(t.sms) / 1e9;
    let instr = p.schedule.sms.iter().flatten().find(|i| p.tiling.stages[i.stage].kind == TaskKind::ExpertUp).unwrap();
    let task = &p.tiling.tasks[instr.task];
    assert!(instr.end_ns - instr.start_ns > task.weight_bytes as f64 / bw_sm * 1.5);
    // bf16 experts (K2) decode nothing.
    let v = compile("kimi_k2", "bench_4l64e.json");
    let p = plan::plan(&v, &t, Options::default()).unwrap();
    assert!(p.tiling.tasks.iter().all(|task| task.decoded == 0));
}

/// Kimi K2 as released, in FP8 (e4m3 with 128 x 128 block scales): linears
/// on one input merge only with weights of their type (the router's bf16
/// gate is not merged with the FP8 shared experts), an FP8 width that is not
/// a multiple of 16 is refused by the planner, and the program streams the
/// projections and experts as FP8 rows while the MLA's kv_b is made bf16 on
/// upload (the weight table says so).
#[test]
fn fp8_k2_plans_by_weight_type() {
    let fp8 = |c: &mut serde_json::Value| {
        c["quantization_config"] =
            serde_json::json!({"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e4m3"});
    };
    let t = Target::load("h200").unwrap();
    let (v, _) = compile_edited("kimi_k2", "tiny.json", fp8);
    let p = plan::plan(&v, &t, Options::default()).unwrap();
    let g = p.graph.graph();
    for op in &p.fusion.ops {
        let weights: std::collections::BTreeSet<&str> = op
            .nodes
            .iter()
            .map(|n| mkc::ir::NodeId::at(*n))
            .filter(|n| matches!(g.op(*n), Some((mkc::ops::OpKind::Linear, _))))
            .map(|n| g.value_type(g.operands(n)[1]).dtype.name())
            .collect();
        assert!(weights.len() <= 1, "{}: linears of {weights:?} weights in one projection", op.name);
    }
    let from = mkc::emit::Provenance { graph: "g.mkc".into(), config: "c.json".into() };
    let a = mkc::emit::emit(&v, &p, "kimi_k2_tiny_fp8", &from, "", false).unwrap();
    let program = a.file("program.cuh").unwrap();
    assert!(program.contains("fp8_rows_compute<kBatch>(") && program.contains("fp8_rows_load<kBatch>("), "FP8 rows");
    assert!(program.contains("expert_fp8_rows<kBatch>("), "FP8 experts");
    assert!(program.contains("rows_compute<kBatch>(RowsCompute{"), "the bf16 router gate");
    let reqs = mkc::checkpoint::requirements(&v);
    let kvb: Vec<_> = reqs.iter().filter(|r| r.key.contains("kv_b_proj")).collect();
    assert_eq!(kvb.len(), 3 * 2, "each layer's kv_b codes and scales");
    for pair in kvb.chunks(2) {
        assert_eq!(pair[0].layout, mkc::checkpoint::GpuLayout::Fp8Bf16, "{}", pair[0].key);
        assert!(pair[1].key.ends_with("weight_scale_inv") && pair[1].dtype == "F32", "{}", pair[1].key);
    }
    assert!(reqs
        .iter()
        .filter(|r| r.dtype == "F8_E4M3")
        .all(|r| r.key.contains("kv_b_proj") || r.layout == mkc::checkpoint::GpuLayout::AsStored));
    // The full K2 (FP8 as released): the post-attention norm, read by the bf16 router gate and the
    // FP8 shared experts, is recomputed in each (not an epilogue that would keep the attention
    // output projection on one SM): every large projection spreads over the SMs.
    let full = compile("kimi_k2", "config.json");
    let p = plan::plan(&full, &t, Options::default()).unwrap();
    for s in &p.tiling.stages {
        let bytes: u64 = s.tasks.iter().map(|t| p.tiling.tasks[*t].weight_bytes).sum();
        if s.kind == plan::tile::TaskKind::ProjectionRows && bytes > 1 << 20 {
            assert!(s.tasks.len() > 1, "stage {} ({} bytes of weights) is one task", s.id, bytes);
        }
    }
    // kv_b is held as bf16 on the GPU: its bytes there, and every size that counts them (what `check`
    // and `plan` print as resident), are bf16's.
    let g = v.graph();
    let kvb = g.nodes().find(|n| g.node(*n).name.ends_with("w_kvb")).expect("a kv_b weight");
    let mkc::ir::NodeKind::Weight(w) = &g.node(kvb).kind else { unreachable!("a weight") };
    assert_eq!(mkc::sizes::device_bytes(g, kvb), w.ty.elements() * 2);
    let resident = mkc::sizes::graph_sizes(&v, 1, 4096, 1).weights_resident;
    assert_eq!(mkc::report::summarize(&v, 4096, &[1]).weight_bytes, u128::from(resident));
    // An FP8 width the ring cannot stream in 16-byte runs.
    let (v, _) = compile_edited("kimi_k2", "tiny.json", |c| {
        fp8(c);
        c["moe_intermediate_size"] = 40.into();
    });
    let err = plan::plan(&v, &t, Options::default()).unwrap_err().to_string();
    assert!(err.contains("FP8 experts whose widths") && err.contains("16"), "{err}");
}

/// The verifier holds the arena and the staging to 1 TiB: a layout past
/// either (as a wrapped or runaway size would be) is refused by name.
#[test]
fn the_verifier_bounds_the_arena() {
    let v = compile("kimi_k2", "tiny.json");
    let p = plan::plan(&v, &Target::load("h200").unwrap(), Options::default()).unwrap();
    let g = p.graph.graph();
    assert!(verify::arena(g, &p.tiling, &p.arena).is_ok());
    let mut big = p.arena.clone();
    big.bytes = plan::arena::MAX_ARENA_BYTES + 256;
    let e = verify::arena(g, &p.tiling, &big).unwrap_err();
    assert!(e.reason.contains("the arena needs 1099511628032 bytes, more than the bound"), "{}", e.reason);
    let mut wide = p.arena.clone();
    wide.staging_floats = 1 << 40;
    let e = verify::arena(g, &p.tiling, &wide).unwrap_err();
    assert!(e.reason.contains("the fp32 staging of all SMs needs"), "{}", e.reason);
    let mut wrapped = p.arena.clone();
    wrapped.buffers[0].1 = u64::MAX;
    assert!(verify::arena(g, &p.tiling, &wrapped).is_err(), "a buffer past the arena's end");
}

/// Several GPUs of one NVLink domain: the routed experts sharded G ways cost
/// one all-reduce per MoE layer at the target's NVLink bandwidth and latency;
/// one GPU is the single-GPU estimate with no exchange; a count past the
/// domain is refused; the tensor-parallel estimate is never below its
/// stages' fixed costs.
#[test]
fn several_gpus_are_estimated_with_their_exchanges() {
    let v = compile("kimi_k3", "config.json");
    let t = Target::load("gb300").unwrap();
    let m = plan::multi::estimate_on(&v, &t, 1, 4096, 72).unwrap();
    assert_eq!(m.moe_layers, 92, "K3: every layer but the first is MoE");
    // K3's experts work in its 3584-wide latent: each MoE layer's planned exchange sends (72 - 1) x
    // 3584 fp32 out of each GPU at batch 1, in one exchange, inside the step.
    assert_eq!((m.exchanges, m.exchange_bytes), (1, 71 * 3584 * 4));
    let p = plan::plan(&v, &t, Options { expert_parallel: 72, ..Default::default() }).unwrap();
    let exchanges = p.tiling.stages.iter().filter(|s| s.exchange.is_some()).count();
    assert_eq!(exchanges, 2 * 92, "a send and a reduce stage per MoE layer");
    // Each exchange at least its bytes over the links and one latency; all of them within the step.
    let per_layer_ns = t.nvlink_latency_ns + m.exchange_bytes as f64 / t.nvlink_bandwidth * 1e9;
    assert!(m.comm_us >= 92.0 * per_layer_ns / 1e3 && m.comm_us < m.step_us, "{} us", m.comm_us);
    assert_eq!(m.step_us, m.per_gpu.step_us);
    let tp = &m.tensor_parallel;
    assert!(tp.step_us >= tp.chain_us + tp.comm_us - 1e-6 && tp.step_us < m.step_us);
    let one = plan::multi::estimate_on(&v, &t, 1, 4096, 1).unwrap();
    assert_eq!((one.comm_us, one.exchanges), (0.0, 0));
    let single = estimate::estimate(&plan::plan(&v, &t, Options::default()).unwrap());
    assert_eq!(one.per_gpu.step_us, single.step_us);
    let err = plan::multi::estimate_on(&v, &Target::load("h200").unwrap(), 1, 4096, 16).unwrap_err();
    assert!(err.reason.contains("joins 8 GPUs"), "{}", err.reason);
}

/// An expert-parallel plan (one GPU of G): after each MoE operation's
/// combine, an exchange's send and reduce stages, the reduce's tasks waiting
/// for every other GPU's sends on a remote counter; the verifier proves it,
/// and catches every wait removed or lowered and a remote counter's wrong
/// count.
#[test]
fn expert_parallel_plans_exchange_the_partial_sums() {
    let v = compile("kimi_k2", "tiny.json");
    let mut t = Target::load("h200").unwrap();
    t.sms = 8;
    let p = plan::plan(&v, &t, Options { expert_parallel: 2, ..Default::default() }).unwrap();
    let stages = &p.tiling.stages;
    let moe = p.fusion.ops.iter().filter(|o| o.kind == FusedKind::Moe).count();
    let sends: Vec<usize> = stages.iter().filter(|s| s.kind == TaskKind::ExchangeSend).map(|s| s.id).collect();
    let reduces: Vec<usize> = stages.iter().filter(|s| s.kind == TaskKind::ExchangeReduce).map(|s| s.id).collect();
    assert_eq!((sends.len(), reduces.len()), (moe, moe));
    for (&send, &reduce) in sends.iter().zip(&reduces) {
        let combine = stages[send].reads[0];
        assert_eq!(stages[combine].kind, TaskKind::ExpertCombine);
        assert_eq!(stages[reduce].reads, vec![combine]);
        let x = stages[reduce].exchange.unwrap();
        assert_eq!((x.ranks, x.send), (2, send));
        // Its remote counter: the send stage's tasks on the one other GPU.
        let c = p.schedule.counters.iter().find(|c| c.remote && c.stage == send).unwrap();
        assert_eq!(c.expected as usize, stages[send].tasks.len());
        for i in p.schedule.sms.iter().flatten().filter(|i| i.stage == reduce) {
            assert!(i.waits.contains(&plan::schedule::Wait { counter: c.id, target: c.expected }));
        }
    }
    assert_eq!(p.schedule.counters.len(), stages.len() + moe);
    assert!(verify::verify(&p.fusion, &p.tiling, &p.schedule).is_ok());
    let n = mutate_every_wait(&p);
    assert!(n > 100, "only {n} mutations");
    // A remote counter's count one off, its waits with it.
    let mut s = p.schedule.clone();
    let c = s.counters.last_mut().unwrap();
    c.expected += 1;
    let id = c.id;
    for w in s.sms.iter_mut().flatten().flat_map(|i| i.waits.iter_mut()).filter(|w| w.counter == id) {
        w.target += 1;
    }
    let err = verify::verify(&p.fusion, &p.tiling, &s).unwrap_err().to_string();
    assert!(err.contains("remote counter"), "{err}");
    // (A send ordered after the reduce of the exchange before it, which the verifier also checks,
    // follows from the data here: its combine reads the layer that read that reduce's sum.)
}

/// Configs whose stages would have millions of tasks are refused at the
/// operation's line before the tiling makes them: a MoE layer's choices past
/// the device's (batch x top-k), an MLA split past the planner's bound.
#[test]
fn huge_task_counts_are_refused_before_tiling() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("model_graphs/kimi_k2");
    let source = std::fs::read_to_string(root.join("graph.mkc")).unwrap();
    let tiny: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(root.join("tiny.json")).unwrap()).unwrap();
    let t = Target::load("h200").unwrap();
    for (edits, want) in [
        (vec![("n_routed_experts", 1u64 << 20), ("num_experts_per_tok", 1 << 19)], "choices per step (524288 here"),
        (vec![("num_attention_heads", 1 << 24), ("num_key_value_heads", 1 << 24)], "an MLA split of at most"),
    ] {
        let mut c = tiny.clone();
        for (k, v) in &edits {
            c[*k] = serde_json::json!(v);
        }
        let config = Config::parse(&c.to_string(), "edited tiny.json").unwrap();
        let v = compile_with(&source, &config);
        let start = std::time::Instant::now();
        let err = plan::plan(&v, &t, Options::default()).unwrap_err().to_string();
        assert!(err.contains(want), "{edits:?}: {err}");
        assert!(start.elapsed().as_secs() < 10, "refused before the tiling");
    }
}

/// Speculation on several GPUs: the verify step is the plan `codegen
/// --positions` makes, on one GPU of the domain, its all-reduces carrying
/// every position's row; it costs more than the plain step and less than
/// plain steps for as many tokens; past the device's rows it says why.
#[test]
fn several_gpus_estimate_the_verify_step() {
    let v = compile("kimi_k3", "config.json");
    let t = Target::load("gb300").unwrap();
    let plain = plan::multi::estimate_on(&v, &t, 1, 4096, 72).unwrap();
    let verify = plan::multi::estimate_verify(&v, &t, 1, 4, 4096, 72).unwrap();
    assert_eq!((verify.per_gpu.batch, verify.moe_layers), (4, 92), "4 rows a step, the same layers");
    assert!(verify.comm_us > plain.comm_us, "every position's row in each all-reduce");
    assert!(verify.step_us > plain.step_us && verify.step_us < 4.0 * plain.step_us);
    let s = estimate::Speculation { tokens: 4, acceptance: 0.7 };
    let line = plan::multi::render_speculative(&plain, Ok(&verify), s);
    assert!(line.contains("speculative 4 positions at acceptance 0.70 (2.53 tokens per verify step)"), "{line}");
    let err = plan::multi::estimate_verify(&v, &t, 8, 4, 4096, 72).unwrap_err();
    assert!(err.reason.contains("attention-residual mix at batch 32"), "{}", err.reason);
}
