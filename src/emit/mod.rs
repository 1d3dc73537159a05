//! Emission: renders the plan into files through the minijinja templates in
//! `templates/`. The templates only spell what the plan decided (strict
//! undefined variables); identifiers come from [`namespace`].
//!
//! Emitted into `generated/<model>_<target>/`:
//! - `plan_tables.h`: the schedule as the megakernel reads it;
//! - `weights.h`: the checkpoint tensors the runtime checks and uploads;
//! - `program.cuh`: what each task computes ([`program`]), the arena layout
//!   and the megakernel's task policy;
//! - `model.cu`: the runtime (C ABI of `runtime/include/mkc/model.h`);
//! - `CMakeLists.txt`: builds the runtime library and the generate tool.
//!
//! With `tables_only`, only the first two (for graphs whose operations the
//! device library does not compute yet).

pub mod program;

use serde::Serialize;

use crate::checkpoint::requirements;
use crate::diag::{Error, ErrorKind, Result};
use crate::plan::{tables::tables, Plan};
use crate::valid::Validated;

/// What the files say produced them.
#[derive(Debug, Clone, Serialize)]
pub struct Provenance {
    /// The graph file, as given.
    pub graph: String,
    /// The config file, as given.
    pub config: String,
}

/// A set of generated files.
#[derive(Debug, Clone)]
pub struct Artifact {
    /// The folder name, `<model>_<target>` or as asked.
    pub name: String,
    /// (file name, contents), in a fixed order.
    pub files: Vec<(String, String)>,
}

/// A legal, readable C++ identifier from any name.
pub fn namespace(name: &str) -> String {
    let mut id: String =
        name.chars().map(|c| if c.is_ascii_alphanumeric() { c.to_ascii_lowercase() } else { '_' }).collect();
    if id.is_empty() || id.starts_with(|c: char| c.is_ascii_digit()) {
        id.insert(0, 'm');
    }
    id
}

#[derive(Serialize)]
struct SmList {
    index: usize,
    instructions: Vec<crate::plan::tables::DeviceInstruction>,
}

#[derive(Serialize)]
struct WeightRow {
    key: String,
    dtype: &'static str,
    shape: Vec<u64>,
    node: String,
    layout: &'static str,
}

fn render(env: &minijinja::Environment, name: &str, ctx: minijinja::Value) -> Result<String> {
    env.get_template(name)
        .and_then(|t| t.render(ctx))
        .map_err(|e| Error::new(ErrorKind::Invalid, format!("internal error: template {name}: {e:#}")))
}

/// Renders the plan's tables and the graph's weight list and, unless
/// `tables_only`, the program, the runtime and its build file. `source` is
/// the graph file's text, for line:column comments.
pub fn emit(
    v: &Validated,
    plan: &Plan,
    name: &str,
    from: &Provenance,
    source: &str,
    tables_only: bool,
) -> Result<Artifact> {
    let mut env = minijinja::Environment::new();
    env.set_undefined_behavior(minijinja::UndefinedBehavior::Strict);
    env.set_keep_trailing_newline(true);
    env.add_template("plan_tables.h", include_str!("../../templates/plan_tables.h.j2"))
        .and_then(|_| env.add_template("weights.h", include_str!("../../templates/weights.h.j2")))
        .and_then(|_| env.add_template("program.cuh", include_str!("../../templates/program.cuh.j2")))
        .and_then(|_| env.add_template("model.cu", include_str!("../../templates/model.cu.j2")))
        .and_then(|_| env.add_template("CMakeLists.txt", include_str!("../../templates/CMakeLists.txt.j2")))
        .map_err(|e| Error::new(ErrorKind::Invalid, format!("internal error: templates do not parse: {e:#}")))?;
    let t = tables(plan);
    let mut sms_lists = vec![];
    for s in 0..plan.schedule.sms.len() {
        let (a, b) = (t.sm_begin[s] as usize, t.sm_begin[s + 1] as usize);
        sms_lists.push(SmList { index: s, instructions: t.instructions[a..b].to_vec() });
    }
    let ns = namespace(name);
    // What every file's header says produced it.
    let provenance = minijinja::context! {
        version => env!("CARGO_PKG_VERSION"), graph => from.graph, config => from.config,
        target => plan.target, namespace => ns,
    };
    let tables_h = render(
        &env,
        "plan_tables.h",
        minijinja::context! {
            batch => plan.options.batch, context => plan.options.context,
            sms => plan.schedule.sms.len(), expected => t.expected, sms_lists, sm_begin => t.sm_begin,
            waits => t.waits, ..provenance.clone()
        },
    )?;
    let weights: Vec<WeightRow> = requirements(v)
        .into_iter()
        .map(|r| WeightRow { key: r.key, dtype: r.dtype, shape: r.shape, node: r.node, layout: r.layout.cpp_name() })
        .collect();
    let weights_h = render(&env, "weights.h", minijinja::context! { weights, ..provenance.clone() })?;
    let mut files = vec![("plan_tables.h".into(), tables_h), ("weights.h".into(), weights_h)];
    if tables_only {
        return Ok(Artifact { name: name.to_string(), files });
    }
    let p = program::program(&plan.graph, plan, source)?;
    let stage_names: Vec<String> = plan
        .tiling
        .stages
        .iter()
        .map(|s| {
            let kind =
                serde_json::to_value(s.kind).ok().and_then(|v| v.as_str().map(str::to_string)).unwrap_or_default();
            format!("{} {}", kind, plan.fusion.ops[s.op].name).replace(['"', '\\'], "_")
        })
        .collect();
    let program_h = render(
        &env,
        "program.cuh",
        minijinja::context! {
            batch => plan.options.batch, context => plan.options.context,
            arena_bytes => p.arena_bytes, route_log => p.route_log, routers => p.routers,
            router_top_k => p.router_top_k, route_log_ints => p.route_log_ints,
            buffers => p.buffers, staging_floats => p.staging_floats, pages => p.pages, states => p.states,
            outputs => p.outputs, next_token_output => p.next_token_output, logits_output => p.logits_output,
            vocab => p.vocab, tasks => p.tasks, code => p.code, load_cases => p.load_cases,
            run_cases => p.run_cases, load_waits => p.load_waits, stage_names, ..provenance.clone()
        },
    )?;
    let model_cu = render(&env, "model.cu", provenance.clone())?;
    let arch = plan.arch.trim_start_matches("sm_");
    let cmake = render(&env, "CMakeLists.txt", minijinja::context! { arch, ..provenance })?;
    files.push(("program.cuh".into(), program_h));
    files.push(("model.cu".into(), model_cu));
    files.push(("CMakeLists.txt".into(), cmake));
    Ok(Artifact { name: name.to_string(), files })
}
