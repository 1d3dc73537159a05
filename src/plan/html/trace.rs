//! A measured step, read from a Chrome trace, matched to the plan's tasks.
//!
//! The format is the one the runtime's profiled step writes
//! (`mkc_model_profile_step`, `engine.cuh`): `{"traceEvents": [...]}` (or a
//! bare array) of complete events, one per instruction:
//!
//! ```json
//! {"name": "projection_rows l.0/layer/kda/proj(out)", "ph": "X", "ts": 12.5, "dur": 3.25,
//!  "pid": 0, "tid": 7, "args": {"task": 42, "instruction": 1234, "ready": 12.1, "pages": 12,
//!  "staged": 0.4, "first_page": 0.1, "streamed": 2.1, "epilogue": 0.6}}
//! ```
//!
//! `name` is the stage's name ([`stage_name`]: the task kind and the fused
//! operation), `tid` the SM, `ts` and `dur` microseconds from the step's
//! start. An event is matched to its task by `args.task`; without it, by its
//! place among the events of its SM (the n-th event of SM s is the n-th
//! instruction of SM s). Events of other phases are ignored. A name that is
//! not the matched task's stage is an error: the trace is of another plan.
//! Where an event has `args.pages`, its `staged`, `first_page`, `streamed`
//! and `epilogue` (microseconds) split the task's time ([`Split`]).

use thiserror::Error;

use crate::plan::Plan;

/// Measured start and end of each task, in nanoseconds from the step's start.
#[derive(Debug, Clone, Default)]
pub struct Measured {
    /// Indexed by task; `None` where the trace has no event for it.
    pub tasks: Vec<Option<(f64, f64)>>,
    /// Indexed by task: where a task that waited for weight pages spent its
    /// time (the event's `args.pages` ... `args.epilogue`); `None` where the
    /// trace does not say.
    pub splits: Vec<Option<Split>>,
}

/// A task's time, split at its pages (`ProfileMark`, device/mkc/projection.cuh),
/// in nanoseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Split {
    /// The weight pages its consumers waited for.
    pub pages: u64,
    /// Its start to its first page wait: staging its input, its prologue.
    pub staged: f64,
    /// That first page wait.
    pub first_page: f64,
    /// From the first page in hand to the last page released.
    pub streamed: f64,
    /// From the last page released to its end: its epilogue and stores.
    pub epilogue: f64,
}

impl Split {
    /// What the task spent outside streaming its pages.
    pub fn fixed(&self) -> f64 {
        self.staged + self.first_page + self.epilogue
    }
}

/// Why a trace cannot be overlaid.
#[derive(Debug, Error, PartialEq)]
pub enum TraceError {
    /// Not JSON at all.
    #[error("not JSON: {0}")]
    Json(String),
    /// Neither an array nor an object with `traceEvents`.
    #[error("no `traceEvents` array")]
    NoEvents,
    /// An event lacks a field or has one of the wrong type.
    #[error("event {index}: {why}")]
    Event {
        /// Its place in the array.
        index: usize,
        /// What is wrong.
        why: String,
    },
    /// The event's name is not its task's stage.
    #[error("event {index} is named {found:?} but task {task} is in stage {expected:?}: the trace is of another plan")]
    Mismatch {
        /// Its place in the array.
        index: usize,
        /// Its task.
        task: usize,
        /// Its name.
        found: String,
        /// The stage's name.
        expected: String,
    },
}

/// The name the runtime gives stage `stage` in traces: its task kind and its
/// fused operation (`projection_rows l.0/layer/kda/proj(out)`).
pub fn stage_name(plan: &Plan, stage: usize) -> String {
    let s = &plan.tiling.stages[stage];
    format!("{} {}", kind_name(s.kind), plan.fusion.ops[s.op].name)
}

/// A kind of task as the trace and the plan name it (`expert_up`).
pub fn kind_name(kind: crate::plan::tile::TaskKind) -> String {
    serde_json::to_value(kind).ok().and_then(|v| v.as_str().map(str::to_string)).unwrap_or_default()
}

/// Reads `text`, a Chrome trace of one step of `plan`.
pub fn parse(text: &str, plan: &Plan) -> Result<Measured, TraceError> {
    let value: serde_json::Value = serde_json::from_str(text).map_err(|e| TraceError::Json(e.to_string()))?;
    let events = match &value {
        serde_json::Value::Array(a) => a,
        serde_json::Value::Object(o) => o.get("traceEvents").and_then(|v| v.as_array()).ok_or(TraceError::NoEvents)?,
        _ => return Err(TraceError::NoEvents),
    };
    let mut measured =
        Measured { tasks: vec![None; plan.tiling.tasks.len()], splits: vec![None; plan.tiling.tasks.len()] };
    let mut seen_on_sm = vec![0usize; plan.schedule.sms.len()];
    let names: Vec<String> = (0..plan.tiling.stages.len()).map(|s| stage_name(plan, s)).collect();
    for (index, e) in events.iter().enumerate() {
        if e.get("ph").and_then(|p| p.as_str()) != Some("X") {
            continue;
        }
        let bad = |why: &str| TraceError::Event { index, why: why.to_string() };
        let num = |k: &str| e.get(k).and_then(|v| v.as_f64()).filter(|x| x.is_finite());
        let ts = num("ts").ok_or_else(|| bad("no numeric `ts`"))?;
        let dur = num("dur").filter(|d| *d >= 0.0).ok_or_else(|| bad("no `dur` of zero or more"))?;
        let sm = e.get("tid").and_then(|v| v.as_u64()).ok_or_else(|| bad("no SM number in `tid`"))? as usize;
        if sm >= plan.schedule.sms.len() {
            return Err(bad(&format!("SM {sm} is not one of the plan's {}", plan.schedule.sms.len())));
        }
        let task = match e.get("args").and_then(|a| a.get("task")) {
            Some(t) => t.as_u64().ok_or_else(|| bad("`args.task` is not a task number"))? as usize,
            None => {
                let n = seen_on_sm[sm];
                let list = &plan.schedule.sms[sm];
                list.get(n)
                    .map(|i| i.task)
                    .ok_or_else(|| bad(&format!("SM {sm} runs only {} instructions", list.len())))?
            }
        };
        seen_on_sm[sm] += 1;
        if task >= plan.tiling.tasks.len() {
            return Err(bad(&format!("task {task} is not one of the plan's {}", plan.tiling.tasks.len())));
        }
        let expected = &names[plan.tiling.tasks[task].stage];
        if let Some(found) = e.get("name").and_then(|n| n.as_str()) {
            if found != expected {
                return Err(TraceError::Mismatch { index, task, found: found.to_string(), expected: expected.clone() });
            }
        }
        measured.tasks[task] = Some((ts * 1e3, (ts + dur) * 1e3));
        let args = e.get("args");
        if let Some(pages) = args.and_then(|a| a.get("pages")) {
            let pages = pages.as_u64().ok_or_else(|| bad("`args.pages` is not a count"))?;
            let part = |k: &str| {
                args.and_then(|a| a.get(k))
                    .and_then(|v| v.as_f64())
                    .filter(|x| x.is_finite() && *x >= 0.0)
                    .map(|x| x * 1e3)
                    .ok_or_else(|| bad(&format!("`args.pages` without a `args.{k}` of zero or more")))
            };
            measured.splits[task] = Some(Split {
                pages,
                staged: part("staged")?,
                first_page: part("first_page")?,
                streamed: part("streamed")?,
                epilogue: part("epilogue")?,
            });
        }
    }
    Ok(measured)
}
