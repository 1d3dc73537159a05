//! The page's data: the plan reduced to what the page draws, in a compact
//! shape. Strings appear once (rule reasons in a table), the 100,000-odd
//! instructions of a large model are columns of small integers (nanoseconds,
//! differences along each SM) rather than objects, and per-task sizes are
//! indices into a table of the distinct (weight, activation, state, FLOPs)
//! tuples. The page decodes the columns once when it loads.

use std::collections::HashMap;

use serde::Serialize;

use super::layers::{self, Block, Layer, LayerKind};
use super::trace::Measured;
use crate::ir::NodeId;
use crate::plan::estimate::{estimate, render_structure};
use crate::plan::fuse::kind_name;
use crate::plan::tile::TaskKind;
use crate::plan::Plan;

/// One fused operation.
#[derive(Serialize)]
pub struct Op<'a> {
    /// Its name.
    pub name: &'a str,
    /// Its kind (`proj`, `moe`, ...).
    pub kind: &'static str,
    /// Its layer, or -1.
    pub layer: i64,
    /// Its graph operations: name, op, and the index into `rules` of the
    /// rule that fused it (-1 for the operation the others joined).
    pub nodes: Vec<(String, &'static str, i64)>,
    /// The rules applied: (rule, index into the reasons, graph operations).
    pub rules: Vec<(&'static str, usize, usize)>,
    /// Its stages.
    pub stages: Vec<usize>,
    /// Tasks.
    pub tasks: usize,
    /// Weight bytes.
    pub wb: u64,
    /// Activation bytes.
    pub ab: u64,
    /// State bytes.
    pub sb: u64,
    /// FLOPs.
    pub flops: u64,
    /// Predicted first start and last end, ns.
    pub span: (u64, u64),
    /// Predicted SM time, summed over its tasks, ns.
    pub busy: u64,
}

/// One stage.
#[derive(Serialize)]
pub struct Stage {
    /// Its operation.
    pub op: usize,
    /// What its tasks do.
    pub what: &'static str,
    /// Its name in traces.
    pub name: String,
    /// Tasks.
    pub tasks: usize,
}

/// The per-SM instruction lists as columns, SM after SM; times in ticks of
/// [`TICK_NS`].
#[derive(Serialize)]
pub struct Schedule {
    /// SMs.
    pub sms: usize,
    /// Nanoseconds per tick.
    pub tick_ns: f64,
    /// Predicted step, ns.
    pub step_ns: u64,
    /// Instructions on each SM.
    pub len: Vec<usize>,
    /// Task, as the difference from the previous instruction's on the SM.
    pub task: Vec<i64>,
    /// Stage, likewise.
    pub stage: Vec<i64>,
    /// Start, as ticks after the previous instruction's end on the SM (the first: after 0).
    pub gap: Vec<i64>,
    /// End minus start.
    pub dur: Vec<u64>,
    /// Start minus the start of its weight stream.
    pub lead: Vec<i64>,
    /// Index into `shapes`.
    pub shape: Vec<usize>,
    /// Distinct (weight bytes, activation bytes, state bytes, FLOPs).
    pub shapes: Vec<(u64, u64, u64, u64)>,
    /// Measured, where a trace was given: start after the previous measured
    /// end on the SM, and duration (-1: no event).
    pub measured: Option<(Vec<i64>, Vec<i64>)>,
}

/// Everything the page shows.
#[derive(Serialize)]
pub struct Page<'a> {
    /// `model on target (batch, context)`.
    pub title: String,
    /// The plan's summary lines and the estimate.
    pub summary: Vec<String>,
    /// Fusion rule reasons, each once.
    pub reasons: Vec<&'static str>,
    /// The fused operations.
    pub ops: Vec<Op<'a>>,
    /// Their dependences.
    pub edges: &'a [(usize, usize)],
    /// The layers.
    pub layers: Vec<Layer>,
    /// Their kinds.
    pub kinds: Vec<LayerKind>,
    /// The folded top level.
    pub blocks: Vec<Block>,
    /// The stages.
    pub stages: Vec<Stage>,
    /// The schedule.
    pub schedule: Schedule,
}

fn what(kind: TaskKind) -> &'static str {
    use TaskKind::*;
    match kind {
        ProjectionRows => "rows",
        MlaAbsorb => "absorb",
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
        ExchangeSend => "send to GPUs",
        ExchangeReduce => "sum of GPUs",
    }
}

fn ns(x: f64) -> i64 {
    x.round() as i64
}

/// The schedule's unit of time: predictions and measurements are not finer.
pub const TICK_NS: f64 = 10.0;

fn ticks(x: f64) -> i64 {
    (x / TICK_NS).round() as i64
}

/// The page data of `plan`, with the measured step where there is one.
pub fn page<'a>(plan: &'a Plan, measured: Option<&Measured>) -> Page<'a> {
    let g = plan.graph.graph();
    let found = layers::layers(&plan.fusion);
    let mut reasons: Vec<&'static str> = vec![];
    let mut ops: Vec<Op> = plan
        .fusion
        .ops
        .iter()
        .map(|o| {
            let mut rules: Vec<(&'static str, usize, usize)> = vec![];
            let mut rule_of: HashMap<usize, i64> = HashMap::new();
            for a in &o.applied {
                let r = reasons.iter().position(|x| *x == a.reason).unwrap_or_else(|| {
                    reasons.push(a.reason);
                    reasons.len() - 1
                });
                let i =
                    rules.iter().position(|(rule, reason, _)| *rule == a.rule && *reason == r).unwrap_or_else(|| {
                        rules.push((a.rule, r, 0));
                        rules.len() - 1
                    });
                rules[i].2 += 1;
                rule_of.insert(a.node, i as i64);
            }
            let nodes = o
                .nodes
                .iter()
                .map(|n| {
                    let id = NodeId::at(*n);
                    let op = g.op(id).map_or("value", |(k, _)| k.name());
                    (g.node(id).name.clone(), op, rule_of.get(n).copied().unwrap_or(-1))
                })
                .collect();
            Op {
                name: &o.name,
                kind: kind_name(o.kind),
                layer: found.of_op[o.id].map_or(-1, |l| l as i64),
                nodes,
                rules,
                stages: vec![],
                tasks: 0,
                wb: 0,
                ab: 0,
                sb: 0,
                flops: 0,
                span: (u64::MAX, 0),
                busy: 0,
            }
        })
        .collect();
    let stages = plan
        .tiling
        .stages
        .iter()
        .map(|s| {
            let op = &mut ops[s.op];
            op.stages.push(s.id);
            op.tasks += s.tasks.len();
            for t in &s.tasks {
                let t = &plan.tiling.tasks[*t];
                op.wb += t.weight_bytes;
                op.ab += t.act_bytes;
                op.sb += t.state_bytes;
                op.flops += t.flops;
            }
            Stage { op: s.op, what: what(s.kind), name: super::trace::stage_name(plan, s.id), tasks: s.tasks.len() }
        })
        .collect();
    let mut sch = Schedule {
        sms: plan.schedule.sms.len(),
        tick_ns: TICK_NS,
        step_ns: ns(plan.schedule.step_ns) as u64,
        len: vec![],
        task: vec![],
        stage: vec![],
        gap: vec![],
        dur: vec![],
        lead: vec![],
        shape: vec![],
        shapes: vec![],
        measured: measured.map(|_| (vec![], vec![])),
    };
    let mut shape_of: HashMap<(u64, u64, u64, u64), usize> = HashMap::new();
    for list in &plan.schedule.sms {
        sch.len.push(list.len());
        let (mut task, mut stage, mut end, mut measured_end) = (0i64, 0i64, 0i64, 0i64);
        for i in list {
            let t = &plan.tiling.tasks[i.task];
            let (start, stop) = (ticks(i.start_ns), ticks(i.end_ns).max(ticks(i.start_ns)));
            sch.task.push(i.task as i64 - task);
            sch.stage.push(i.stage as i64 - stage);
            sch.gap.push(start - end);
            sch.dur.push((stop - start) as u64);
            sch.lead.push(start - ticks(i.load_start_ns));
            (task, stage, end) = (i.task as i64, i.stage as i64, stop);
            let key = (t.weight_bytes, t.act_bytes, t.state_bytes, t.flops);
            let next = sch.shapes.len();
            let s = *shape_of.entry(key).or_insert(next);
            if s == next {
                sch.shapes.push(key);
            }
            sch.shape.push(s);
            if let (Some(m), Some((starts, durs))) = (measured, sch.measured.as_mut()) {
                let (gap, dur) = match m.tasks.get(i.task).copied().flatten() {
                    Some((a, b)) => {
                        let gap = ticks(a) - measured_end;
                        measured_end = ticks(b).max(ticks(a));
                        (gap, measured_end - ticks(a))
                    }
                    None => (0, -1),
                };
                starts.push(gap);
                durs.push(dur);
            }
            let op = &mut ops[plan.tiling.stages[i.stage].op];
            op.span = (op.span.0.min(ns(i.start_ns) as u64), op.span.1.max(ns(i.end_ns) as u64));
            op.busy += ns(i.end_ns - i.start_ns).max(0) as u64;
        }
    }
    for op in &mut ops {
        if op.span.0 > op.span.1 {
            op.span = (0, 0);
        }
    }
    let e = estimate(plan);
    let mut summary: Vec<String> = render_structure(plan).lines().map(str::to_string).collect();
    summary.push(format!(
        "predicted step {:.1} us, floor {:.1} us ({:.0}%), {:.1} tokens/s per user",
        e.step_us,
        e.floor_us,
        100.0 * e.fraction_of_floor,
        e.tokens_per_s
    ));
    Page {
        title: format!(
            "{} on {} (batch {}, context {})",
            plan.model, plan.target, plan.options.batch, plan.options.context
        ),
        summary,
        reasons,
        ops,
        edges: &plan.fusion.edges,
        layers: found.layers,
        kinds: found.kinds,
        blocks: found.blocks,
        stages,
        schedule: sch,
    }
}
