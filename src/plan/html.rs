//! The plan drawn: one self-contained HTML page (no network, no external
//! scripts) with the fused graph and the per-SM timeline of the schedule.
//!
//! The page embeds the plan as JSON and draws it with inline JavaScript: the
//! fused graph as an SVG in dependency levels, the timeline on a canvas (one
//! row per SM, weight streaming as a thin bar under each task). Hovering shows
//! the task, its bytes, predicted times and counters. A Chrome trace JSON
//! (`traceEvents` with `ph: "X"`, `tid` = SM, microseconds), such as the
//! runtime's profiler writes, can be loaded to overlay the measured timeline.

use serde::Serialize;

use super::estimate::estimate;
use super::fuse::kind_name;
use super::Plan;

#[derive(Serialize)]
struct Op<'a> {
    id: usize,
    name: &'a str,
    kind: &'static str,
    nodes: usize,
    tasks: usize,
    level: usize,
    rules: Vec<&'static str>,
    weight_bytes: u64,
}

#[derive(Serialize)]
struct Ins<'a> {
    sm: usize,
    load: f64,
    start: f64,
    end: f64,
    op: usize,
    stage: &'static str,
    label: &'a str,
    weight_bytes: u64,
    act_bytes: u64,
    state_bytes: u64,
    flops: u64,
    waits: Vec<(usize, u32)>,
    signal: usize,
}

#[derive(Serialize)]
struct Page<'a> {
    title: String,
    summary: Vec<String>,
    ops: Vec<Op<'a>>,
    edges: &'a [(usize, usize)],
    sms: usize,
    step_ns: f64,
    instrs: Vec<Ins<'a>>,
}

fn stage_name(kind: super::tile::TaskKind) -> &'static str {
    use super::tile::TaskKind::*;
    match kind {
        ProjectionRows => "rows",
        MlaSplit => "kv split",
        MlaCombine => "combine",
        Kda => "heads",
        Router => "top-k",
        ExpertUp => "expert gate/up",
        ExpertDown => "expert down",
        ExpertCombine => "expert combine",
        AttnRes => "mix",
        Embedding => "lookup",
        LmHeadRows => "rows",
        Argmax => "argmax",
        Elementwise => "element-wise",
    }
}

/// Renders the plan as one HTML page.
pub fn to_html(plan: &Plan) -> String {
    let mut level = vec![0usize; plan.fusion.ops.len()];
    for (a, b) in &plan.fusion.edges {
        // Edges go forward in the topological order, so one pass suffices.
        level[*b] = level[*b].max(level[*a] + 1);
    }
    let mut tasks = vec![0usize; plan.fusion.ops.len()];
    let mut weights = vec![0u64; plan.fusion.ops.len()];
    for st in &plan.tiling.stages {
        tasks[st.op] += st.tasks.len();
        weights[st.op] += st.tasks.iter().map(|t| plan.tiling.tasks[*t].weight_bytes).sum::<u64>();
    }
    let ops = plan
        .fusion
        .ops
        .iter()
        .map(|o| {
            let mut rules: Vec<&'static str> = o.applied.iter().map(|a| a.rule).collect();
            rules.sort_unstable();
            rules.dedup();
            Op {
                id: o.id,
                name: &o.name,
                kind: kind_name(o.kind),
                nodes: o.nodes.len(),
                tasks: tasks[o.id],
                level: level[o.id],
                rules,
                weight_bytes: weights[o.id],
            }
        })
        .collect();
    let mut instrs = vec![];
    for (sm, list) in plan.schedule.sms.iter().enumerate() {
        for i in list {
            let t = &plan.tiling.tasks[i.task];
            let st = &plan.tiling.stages[t.stage];
            instrs.push(Ins {
                sm,
                load: i.load_start_ns,
                start: i.start_ns,
                end: i.end_ns,
                op: st.op,
                stage: stage_name(st.kind),
                label: &t.label,
                weight_bytes: t.weight_bytes,
                act_bytes: t.act_bytes,
                state_bytes: t.state_bytes,
                flops: t.flops,
                waits: i.waits.iter().map(|w| (w.counter, w.target)).collect(),
                signal: i.signal,
            });
        }
    }
    let e = estimate(plan);
    let page = Page {
        title: format!(
            "{} on {} (batch {}, context {})",
            plan.model, plan.target, plan.options.batch, plan.options.context
        ),
        summary: super::estimate::render_structure(plan).lines().map(str::to_string).collect(),
        ops,
        edges: &plan.fusion.edges,
        sms: plan.schedule.sms.len(),
        step_ns: plan.schedule.step_ns,
        instrs,
    };
    let mut summary = page.summary.clone();
    summary.push(format!(
        "predicted step {:.1} us, floor {:.1} us ({:.0}%), {:.1} tokens/s per user",
        e.step_us,
        e.floor_us,
        100.0 * e.fraction_of_floor,
        e.tokens_per_s
    ));
    let page = Page { summary, ..page };
    // `</` cannot appear inside the script element.
    let json = serde_json::to_string(&page).expect("plan data serialises").replace("</", "<\\/");
    let mut env = minijinja::Environment::new();
    env.set_undefined_behavior(minijinja::UndefinedBehavior::Strict);
    env.add_template("plan.html", TEMPLATE).expect("the plan page template parses");
    env.get_template("plan.html")
        .and_then(|t| t.render(minijinja::context! { title => page.title, data => json }))
        .expect("the plan page template renders")
}

/// The page template (`templates/plan.html`): it only spells what the plan decided.
const TEMPLATE: &str = include_str!("../../templates/plan.html");
