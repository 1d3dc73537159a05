//! Emission: renders the plan into files through the minijinja templates in
//! `templates/`. The templates only spell what the plan decided (strict
//! undefined variables); identifiers come from [`namespace`].
//!
//! Emitted into `generated/<model>_<target>/`:
//! - `plan.mkcplan` ([`plan_file`]): the schedule, the tasks, each stage's
//!   kind and parameters, the weight table (key patterns) and the states, as
//!   a versioned binary file the runtime reads, checks and uploads;
//! - `plan_summary.txt`: that file's identity, section sizes and sha256;
//! - `program.cuh`: one device function per kind of stage ([`program`]), the
//!   constants every layer shares and the megakernel's dispatch;
//! - `model.cu`: the runtime (C ABI of `runtime/include/mkc/model.h`);
//! - `CMakeLists.txt`: builds the runtime library and the generate tool.
//!
//! The generated sources do not grow with layers, experts or tasks: those
//! are data in the plan file. With `tables_only`, only the plan file (with
//! no stage kinds) and its summary, for graphs whose operations the device
//! library does not compute yet.

pub mod plan_file;
pub mod program;

use serde::Serialize;

use crate::checkpoint::weight_groups;
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
    /// Text files: (file name, contents), in a fixed order.
    pub files: Vec<(String, String)>,
    /// The plan file (`plan.mkcplan`).
    pub plan: Vec<u8>,
}

impl Artifact {
    /// A text file by name.
    pub fn file(&self, name: &str) -> Option<&str> {
        self.files.iter().find(|(n, _)| n == name).map(|(_, t)| t.as_str())
    }
}

/// The plan file's name in a generated folder.
pub const PLAN_FILE: &str = "plan.mkcplan";

/// A legal, readable C++ identifier from any name.
pub fn namespace(name: &str) -> String {
    let mut id: String =
        name.chars().map(|c| if c.is_ascii_alphanumeric() { c.to_ascii_lowercase() } else { '_' }).collect();
    if id.is_empty() || id.starts_with(|c: char| c.is_ascii_digit()) {
        id.insert(0, 'm');
    }
    id
}

/// A kind's code as the template renders it.
#[derive(Serialize)]
struct KindView {
    name: String,
    fields: Vec<(String, &'static str)>,
    comment: String,
    code: String,
    uses: usize,
}

/// One `case` of the dispatch.
#[derive(Serialize)]
struct CaseView {
    role: u32,
    kind: String,
    call: String,
}

/// The roles of one kind whose parameters name weights: the prefetcher's
/// reads of those weights' table entries (`Step::prefetch`).
#[derive(Serialize)]
struct PrefetchView {
    roles: Vec<u32>,
    kind: String,
    weights: Vec<String>,
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
    env.add_template("program.cuh", include_str!("../../templates/program.cuh.j2"))
        .and_then(|_| env.add_template("model.cu", include_str!("../../templates/model.cu.j2")))
        .and_then(|_| env.add_template("CMakeLists.txt", include_str!("../../templates/CMakeLists.txt.j2")))
        .map_err(|e| Error::new(ErrorKind::Invalid, format!("internal error: templates do not parse: {e:#}")))?;
    let t = tables(plan);
    let ns = namespace(name);
    let id = plan_file::Identity {
        model: ns.clone(),
        target: plan.target.clone(),
        batch: plan.options.batch,
        sms: plan.schedule.sms.len() as u32,
        context: plan.options.context,
    };
    let stage_names: Vec<String> =
        (0..plan.tiling.stages.len()).map(|s| crate::plan::html::trace::stage_name(plan, s)).collect();
    let groups = weight_groups(v);
    if tables_only {
        let p = program::Program::tables_only(program::task_rows(plan));
        let file = plan_file::write(&id, &t, &p, &groups, &stage_names);
        let summary = plan_file::summary(&file, &id);
        return Ok(Artifact { name: name.to_string(), files: vec![("plan_summary.txt".into(), summary)], plan: file });
    }
    let p = program::program(&plan.graph, plan, source)?;
    let file = plan_file::write(&id, &t, &p, &groups, &stage_names);
    let summary = plan_file::summary(&file, &id);
    // What every file's header says produced it.
    let provenance = minijinja::context! {
        version => env!("CARGO_PKG_VERSION"), graph => comment_text(&from.graph), config => comment_text(&from.config),
        target => plan.target, namespace => ns,
    };
    let mut cases = vec![];
    let mut load_cases = vec![];
    let mut commit_cases = vec![];
    let mut prefetch = vec![];
    let mut role = 0u32;
    for k in &p.kinds {
        let weights: Vec<String> =
            k.fields.iter().filter(|(_, what)| *what == program::WEIGHT_INDEX).map(|(f, _)| f.clone()).collect();
        if !weights.is_empty() {
            let roles = (role..role + k.roles.len() as u32).collect();
            prefetch.push(PrefetchView { roles, kind: k.name.clone(), weights });
        }
        for r in &k.roles {
            let spell = |s: &str| s.replace("@K@", &k.name);
            cases.push(CaseView { role, kind: k.name.clone(), call: spell(&r.run) });
            if let Some(l) = &r.load {
                load_cases.push(CaseView { role, kind: k.name.clone(), call: spell(l) });
            }
            if let Some(c) = &r.commit {
                commit_cases.push(CaseView { role, kind: k.name.clone(), call: spell(c) });
            }
            role += 1;
        }
    }
    let kinds: Vec<KindView> = p
        .kinds
        .iter()
        .map(|k| KindView {
            name: k.name.clone(),
            fields: k.fields.clone(),
            comment: k.comment.clone(),
            code: k.code.replace("@K@", &k.name),
            uses: k.uses,
        })
        .collect();
    let program_h = render(
        &env,
        "program.cuh",
        minijinja::context! {
            batch => plan.options.batch, positions => plan.options.positions, context => plan.options.context,
            arena_bytes => p.arena_bytes, route_log => p.route_log, routers => p.routers.len(),
            router_top_k => p.router_top_k, route_log_ints => p.route_log_ints,
            staging_floats => p.staging_floats, pages => p.pages, ranks => p.ranks, exchanges => p.exchanges,
            exchange_floats => p.exchange_floats,
            outputs => p.outputs, next_token_output => p.next_token_output, logits_output => p.logits_output,
            vocab => p.vocab, kinds, cases, load_cases, commit_cases, prefetch, format => plan_file::FORMAT,
            stages => plan.tiling.stages.len(), tasks => plan.tiling.tasks.len(), ..provenance.clone()
        },
    )?;
    let model_cu = render(&env, "model.cu", provenance.clone())?;
    let arch = plan.arch.trim_start_matches("sm_");
    let cmake = render(&env, "CMakeLists.txt", minijinja::context! { arch, ..provenance })?;
    let files = vec![
        ("program.cuh".into(), program_h),
        ("model.cu".into(), model_cu),
        ("CMakeLists.txt".into(), cmake),
        ("plan_summary.txt".into(), summary),
    ];
    Ok(Artifact { name: name.to_string(), files, plan: file })
}

/// A path or other user text as it may stand inside a one-line comment of
/// any generated file (`//` in C++ and CUDA, `#` in CMake, `/* */` too): every
/// control character (a newline would start a line of code), every `\` (a
/// backslash ending a `//` comment continues it onto the next line) and the
/// `*` of every `*/` is shown as `?`. Every user string that emit writes into
/// a comment goes through here.
pub fn comment_text(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        let closes = c == '*' && chars.peek() == Some(&'/');
        out.push(if c.is_control() || c == '\\' || closes { '?' } else { c });
    }
    out
}
