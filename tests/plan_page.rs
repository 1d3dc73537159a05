//! The plan page (`mkc plan --html`): the full Kimi K3 on gb300 stays small
//! and readable (layers folded by kind with their counts, every fusion reason
//! carried), its compact schedule decodes to the plan's, a measured trace in
//! the runtime's format is matched to the tasks, and the tiny model's page is
//! whole. tests/browser/run.sh loads the pages in Chromium.

use std::path::Path;

use mkc::config::Config;
use mkc::lower::Limits;
use mkc::plan::{self, html, Options, Plan};
use mkc::target::Target;
use serde_json::Value;

/// The bound on the full K3's page.
const MAX_PAGE_BYTES: usize = 5_000_000;

fn plan_of(config: &str, target: &str) -> Plan {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("model_graphs/kimi_k3");
    let source = std::fs::read_to_string(root.join("graph.mkc")).unwrap();
    let v = mkc::compile_str(&source, &Config::load(&root.join(config)).unwrap(), Limits::default())
        .unwrap_or_else(|e| panic!("{}", mkc::diag::render(&e, "graph", &source)));
    plan::plan(&v, &Target::load(target).unwrap(), Options::default()).unwrap()
}

/// The JSON the page embeds.
fn data(page: &str) -> Value {
    let open = "type=\"application/json\">";
    let start = page.find(open).expect("the page embeds its data") + open.len();
    let end = page[start..].find("</script>").unwrap() + start;
    serde_json::from_str(&page[start..end]).expect("the embedded data is JSON")
}

fn assert_self_contained(page: &str) {
    assert!(page.starts_with("<!doctype html>"));
    for needle in ["drawGraph", "drawTimeline", "id=\"graph\"", "id=\"timeline\"", "id=\"details\"", "traceEvents"] {
        assert!(page.contains(needle), "missing {needle}");
    }
    for banned in ["<script src", "<link", "<img", "<iframe", "import(", "fetch(", "http://", "https://"] {
        assert!(!page.contains(banned), "the page loads something: {banned}");
    }
}

/// A trace as the runtime's profiled step writes it, with every instruction
/// taking `scale` times its predicted time.
fn trace_of(p: &Plan, scale: f64, with_task: bool) -> String {
    let mut events = vec![];
    for (sm, list) in p.schedule.sms.iter().enumerate() {
        for (n, i) in list.iter().enumerate() {
            let mut e = serde_json::json!({
                "name": html::trace::stage_name(p, i.stage), "ph": "X", "pid": 0, "tid": sm,
                "ts": i.start_ns * scale / 1e3, "dur": (i.end_ns - i.start_ns) * scale / 1e3,
            });
            if with_task {
                e["args"] = serde_json::json!({ "task": i.task, "instruction": n, "ready": i.start_ns / 1e3 });
            }
            events.push(e);
        }
    }
    serde_json::json!({ "traceEvents": events, "displayTimeUnit": "ns" }).to_string()
}

/// Decodes the page's schedule columns into (sm, task, start ns, end ns).
fn decode(d: &Value) -> Vec<(usize, usize, f64, f64)> {
    let s = &d["schedule"];
    let col = |k: &str| -> Vec<i64> { s[k].as_array().unwrap().iter().map(|x| x.as_i64().unwrap()).collect() };
    let (task, gap, dur) = (col("task"), col("gap"), col("dur"));
    let tick = s["tick_ns"].as_f64().unwrap();
    let mut out = vec![];
    let mut k = 0;
    for (sm, n) in s["len"].as_array().unwrap().iter().enumerate() {
        let (mut t, mut end) = (0i64, 0i64);
        for _ in 0..n.as_u64().unwrap() {
            t += task[k];
            let start = end + gap[k];
            end = start + dur[k];
            out.push((sm, t as usize, start as f64 * tick, end as f64 * tick));
            k += 1;
        }
    }
    out
}

#[test]
fn the_full_k3_page_is_small_folds_its_layers_and_carries_the_reasons() {
    let p = plan_of("config.json", "gb300");
    let measured = html::trace::parse(&trace_of(&p, 1.25, true), &p).unwrap();
    let page = html::to_html_measured(&p, Some(&measured));
    assert!(page.len() <= MAX_PAGE_BYTES, "the full K3 page is {} bytes, over {MAX_PAGE_BYTES}", page.len());
    assert_self_contained(&page);
    let d = data(&page);

    // 93 layers of three kinds, with their counts, and a top level of a few blocks.
    let kinds: Vec<(String, usize)> = d["kinds"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| (k["what"].as_str().unwrap().to_string(), k["layers"].as_array().unwrap().len()))
        .collect();
    assert_eq!(
        kinds,
        [
            ("kda + dense_mlp".to_string(), 1),
            ("kda + latent_moe".to_string(), 68),
            ("mla + latent_moe".to_string(), 24)
        ]
    );
    assert_eq!(d["layers"].as_array().unwrap().len(), 93);
    let blocks = d["blocks"].as_array().unwrap();
    assert!(blocks.len() <= 8, "the top level is {} blocks", blocks.len());
    assert!(blocks.iter().any(|b| b["repeat"]["times"].as_u64() >= Some(20)), "no long repeat folded: {blocks:?}");
    // Every layer is covered once by the top level.
    let mut covered = vec![0; 93];
    for b in blocks {
        if let Some(l) = b["layer"].as_u64() {
            covered[l as usize] += 1;
        }
        if let Some(r) = b.get("repeat") {
            let (first, n) = (r["first"].as_u64().unwrap(), r["unit"].as_u64().unwrap() * r["times"].as_u64().unwrap());
            (first..first + n).for_each(|l| covered[l as usize] += 1);
        }
    }
    assert!(covered.iter().all(|c| *c == 1), "layers covered {covered:?}");

    // Every rule's reason is in the page, and each operation's rules point at them.
    let reasons: Vec<&str> = d["reasons"].as_array().unwrap().iter().map(|r| r.as_str().unwrap()).collect();
    for op in &p.fusion.ops {
        for a in &op.applied {
            assert!(reasons.contains(&a.reason), "reason of {} missing: {}", a.rule, a.reason);
        }
        let page_op = &d["ops"][op.id];
        let rules: Vec<&str> = page_op["rules"].as_array().unwrap().iter().map(|r| r[0].as_str().unwrap()).collect();
        for a in &op.applied {
            assert!(rules.contains(&a.rule), "{}: rule {} not listed", op.name, a.rule);
        }
        assert_eq!(page_op["nodes"].as_array().unwrap().len(), op.nodes.len());
    }

    // The schedule's columns decode to the plan's instructions, to a tick.
    let tick = d["schedule"]["tick_ns"].as_f64().unwrap();
    let decoded = decode(&d);
    assert_eq!(decoded.len(), p.tiling.tasks.len());
    let mut k = 0;
    for (sm, list) in p.schedule.sms.iter().enumerate() {
        for i in list {
            let (s, t, a, b) = decoded[k];
            assert_eq!((s, t), (sm, i.task));
            assert!(
                (a - i.start_ns).abs() <= tick && (b - i.end_ns).abs() <= tick,
                "instruction {k}: {a} {b} vs {i:?}"
            );
            k += 1;
        }
    }
    // The measured overlay is there, one entry per instruction.
    let m = &d["schedule"]["measured"];
    assert_eq!(m[0].as_array().unwrap().len(), decoded.len());
    assert!(m[1].as_array().unwrap().iter().all(|x| x.as_i64().unwrap() >= 0), "an instruction not measured");
}

#[test]
fn the_tiny_page_is_whole() {
    let p = plan_of("tiny.json", "h200");
    let page = html::to_html(&p);
    assert_self_contained(&page);
    let d = data(&page);
    assert_eq!(d["ops"].as_array().unwrap().len(), p.fusion.ops.len());
    assert_eq!(d["stages"].as_array().unwrap().len(), p.tiling.stages.len());
    assert_eq!(decode(&d).len(), p.tiling.tasks.len());
    assert!(d["schedule"]["measured"].is_null());
    assert!(!d["kinds"].as_array().unwrap().is_empty());
    // Every operation is in a layer or is a top-level block of its own.
    let in_blocks: Vec<u64> = d["blocks"].as_array().unwrap().iter().filter_map(|b| b["op"].as_u64()).collect();
    for (i, op) in d["ops"].as_array().unwrap().iter().enumerate() {
        assert!(op["layer"].as_i64().unwrap() >= 0 || in_blocks.contains(&(i as u64)), "op {i} is drawn nowhere");
    }
}

#[test]
fn traces_match_by_task_or_by_place_and_refuse_another_plan() {
    let p = plan_of("tiny.json", "h200");
    for with_task in [true, false] {
        let m = html::trace::parse(&trace_of(&p, 2.0, with_task), &p).unwrap();
        for list in &p.schedule.sms {
            for i in list {
                let (a, b) = m.tasks[i.task].expect("every task measured");
                assert!((a - 2.0 * i.start_ns).abs() < 1.0 && (b - 2.0 * i.end_ns).abs() < 1.0);
            }
        }
    }
    // A stage name of another plan.
    let other = trace_of(&p, 1.0, true).replacen("\"name\":\"", "\"name\":\"x", 1);
    assert!(matches!(html::trace::parse(&other, &p), Err(html::TraceError::Mismatch { .. })));
    assert_eq!(html::trace::parse("{}", &p).unwrap_err(), html::TraceError::NoEvents);
    assert!(matches!(
        html::trace::parse("[{\"ph\": \"X\", \"ts\": 1}]", &p),
        Err(html::TraceError::Event { index: 0, .. })
    ));
    let far = format!("[{{\"ph\": \"X\", \"ts\": 1, \"dur\": 1, \"tid\": {}}}]", p.schedule.sms.len());
    assert!(matches!(html::trace::parse(&far, &p), Err(html::TraceError::Event { .. })));
}

#[test]
fn predicted_against_measured_counts_the_stages_within_15_percent() {
    let p = plan_of("tiny.json", "h200");
    let stages = p.tiling.stages.len();
    // The schedule itself: every stage at its prediction.
    let same = plan::estimate::render_measured(&p, &html::trace::parse(&trace_of(&p, 1.0, true), &p).unwrap(), 14e3);
    assert!(same.contains(&format!("stages within 15% of the prediction: {stages} of {stages}\n")), "{same}");
    assert!(same.contains("(ratio 1.00)"), "{same}");
    // Every instruction 1.5 times as long: no stage within 15%, the step 1.5 times its prediction.
    let slow = plan::estimate::render_measured(&p, &html::trace::parse(&trace_of(&p, 1.5, true), &p).unwrap(), 14e3);
    assert!(slow.contains(&format!("stages within 15% of the prediction: 0 of {stages}\n")), "{slow}");
    assert!(slow.contains("(ratio 1.50)"), "{slow}");
    let (per_stage, per_kind) = slow.split_once("per kind of task").expect("the per-kind table");
    assert_eq!(per_stage.lines().filter(|l| l.contains(" 1.50  ")).count(), stages, "{slow}");
    // The per-kind table: every kind 1.5 times its prediction, its stages adding up to all of them.
    let kind_rows: Vec<&str> = per_kind.lines().filter(|l| l.contains(" 1.50  ")).collect();
    let counted: usize = kind_rows.iter().map(|l| l.split_whitespace().next().unwrap().parse::<usize>().unwrap()).sum();
    assert!(!kind_rows.is_empty() && counted == stages, "{slow}");
    // A trace of the first stage alone: the others are counted apart, not compared.
    let one: Value = serde_json::from_str(&trace_of(&p, 1.0, true)).unwrap();
    let first = html::trace::stage_name(&p, 0);
    let events: Vec<Value> =
        one["traceEvents"].as_array().unwrap().iter().filter(|e| e["name"] == first.as_str()).cloned().collect();
    let part = serde_json::json!({ "traceEvents": events }).to_string();
    let partial = plan::estimate::render_measured(&p, &html::trace::parse(&part, &p).unwrap(), 14e3);
    assert!(
        partial.contains(&format!("within 15% of the prediction: 1 of 1 ({} without a measured task)", stages - 1)),
        "{partial}"
    );
}

#[test]
fn a_trace_that_splits_its_tasks_time_says_where_each_kind_spends_it() {
    let p = plan_of("tiny.json", "h200");
    // Every projection-row task: 4 pages, staged 1 us, first page 0.5, streamed 2, epilogue 0.5.
    let mut trace: Value = serde_json::from_str(&trace_of(&p, 1.0, true)).unwrap();
    let mut split = 0;
    for e in trace["traceEvents"].as_array_mut().unwrap() {
        if e["name"].as_str().unwrap().starts_with("projection_rows ") {
            for (k, v) in [("pages", 4.0), ("staged", 1.0), ("first_page", 0.5), ("streamed", 2.0), ("epilogue", 0.5)] {
                e["args"][k] = if k == "pages" { serde_json::json!(4) } else { serde_json::json!(v) };
            }
            split += 1;
        }
    }
    assert!(split > 0, "the tiny plan has projection rows");
    let m = html::trace::parse(&trace.to_string(), &p).unwrap();
    assert_eq!(m.splits.iter().flatten().count(), split);
    let s = m.splits.iter().flatten().next().unwrap();
    assert_eq!((s.pages, s.staged, s.fixed()), (4, 1000.0, 2000.0));
    let out = plan::estimate::render_measured(&p, &m, 14e3);
    let (_, splits) = out.split_once("where its tasks' time goes").unwrap_or_else(|| panic!("{out}"));
    let row = splits.lines().find(|l| l.ends_with("  projection_rows")).unwrap_or_else(|| panic!("{out}"));
    let cols: Vec<&str> = row.split_whitespace().collect();
    assert_eq!(cols[0].parse::<usize>().unwrap(), split, "{out}");
    assert_eq!(&cols[1..7], ["4.0", "1.0", "0.5", "2.0", "0.5", "2.0"], "{out}");
    assert!(out.contains("task_overhead_ns 14.0"), "{out}");
    // Without splits, no such table.
    let plain = plan::estimate::render_measured(&p, &html::trace::parse(&trace_of(&p, 1.0, true), &p).unwrap(), 14e3);
    assert!(!plain.contains("where its tasks' time goes"), "{plain}");
    // `pages` without the parts, or a negative part: the event is named.
    let e = &mut trace["traceEvents"].as_array_mut().unwrap().iter_mut().find(|e| e["args"].get("pages").is_some());
    let e = e.as_mut().unwrap();
    e["args"]["epilogue"] = serde_json::json!(-1.0);
    assert!(matches!(html::trace::parse(&trace.to_string(), &p), Err(html::TraceError::Event { .. })));
}
