//! The estimate `mkc plan --estimate` prints: bytes moved, predicted step
//! time, tokens per second per user, and the fraction of the bandwidth floor.

use std::collections::BTreeMap;
use std::fmt::Write;

use serde::Serialize;

use super::fuse::kind_name;
use super::Plan;
use crate::report::{bytes, grouped};

/// The numbers of one plan.
#[derive(Debug, Clone, Serialize)]
pub struct Estimate {
    /// Batch planned for.
    pub batch: u32,
    /// Context planned for.
    pub context: u64,
    /// Weights read per step (moved): [`crate::sizes::GraphSizes::weights_read`],
    /// the number `mkc check` prints.
    pub weight_bytes: u64,
    /// State (KV cache, KDA state, conv windows) read and written per step (moved).
    pub state_bytes: u64,
    /// Activations written to scratch regions per step (moved, mostly in L2).
    pub activation_bytes: u64,
    /// Predicted step time.
    pub step_us: f64,
    /// The bandwidth floor: (weights + state) over the read bandwidth.
    pub floor_us: f64,
    /// The longest dependency chain.
    pub critical_path_us: f64,
    /// Tokens per second per user.
    pub tokens_per_s: f64,
    /// floor / predicted.
    pub fraction_of_floor: f64,
}

/// Computes the estimate of `plan`.
pub fn estimate(plan: &Plan) -> Estimate {
    let t = &plan.tiling;
    let s = &plan.schedule;
    let o = &plan.options;
    let sizes = crate::sizes::graph_sizes(&plan.graph, o.batch.into(), o.context, o.expert_parallel.into());
    let weight_bytes = sizes.weights_read;
    let state_bytes: u64 = t.tasks.iter().map(|x| x.state_bytes).sum();
    // The floor is the bytes printed over the read bandwidth. The schedule's
    // cost model streams the tasks' bytes, which leave out the small vectors
    // fused prologues and epilogues read (norm scales, conv weights: 0.03% of
    // K3's); its floor gives the bandwidth.
    let bandwidth = if s.floor_ns > 0.0 { s.hbm_bytes as f64 / s.floor_ns } else { 0.0 };
    let floor_ns = if bandwidth > 0.0 { (weight_bytes + state_bytes) as f64 / bandwidth } else { s.floor_ns };
    Estimate {
        batch: plan.options.batch,
        context: plan.options.context,
        weight_bytes,
        state_bytes,
        activation_bytes: t.regions.iter().map(|r| r.bytes).sum(),
        step_us: s.step_ns / 1e3,
        floor_us: floor_ns / 1e3,
        critical_path_us: s.critical_path_ns / 1e3,
        tokens_per_s: if s.step_ns.is_finite() && s.step_ns > 0.0 { 1e9 / s.step_ns } else { 0.0 },
        fraction_of_floor: if s.step_ns.is_finite() && s.step_ns > 0.0 && floor_ns.is_finite() {
            floor_ns / s.step_ns
        } else {
            0.0
        },
    }
}

/// The plan's structure in a few lines: fused operations by kind, stages,
/// tasks, counters, waits, the CTA layout and what the verifier proved.
pub fn render_structure(plan: &Plan) -> String {
    let mut s = String::new();
    let mut kinds: BTreeMap<&str, usize> = BTreeMap::new();
    for op in &plan.fusion.ops {
        *kinds.entry(kind_name(op.kind)).or_insert(0) += 1;
    }
    let covered: usize = plan.fusion.ops.iter().map(|o| o.nodes.len()).sum();
    let _ = writeln!(
        s,
        "plan {} on {} (batch {}, context {})",
        plan.model, plan.target, plan.options.batch, plan.options.context
    );
    let _ = writeln!(
        s,
        "fused operations: {} covering {} ops ({})",
        grouped(plan.fusion.ops.len() as u64),
        grouped(covered as u64),
        kinds.iter().map(|(k, n)| format!("{k} {n}")).collect::<Vec<_>>().join(", ")
    );
    let mut rules: BTreeMap<&str, usize> = BTreeMap::new();
    for op in &plan.fusion.ops {
        for a in &op.applied {
            *rules.entry(a.rule).or_insert(0) += 1;
        }
    }
    let _ = writeln!(
        s,
        "fusion rules applied: {}",
        rules.iter().map(|(k, n)| format!("{k} {n}")).collect::<Vec<_>>().join(", ")
    );
    let waits: usize = plan.schedule.sms.iter().flatten().map(|i| i.waits.len()).sum();
    let busiest = plan.schedule.sms.iter().map(Vec::len).max().unwrap_or(0);
    let _ = writeln!(
        s,
        "stages: {}, tasks: {}, counters: {}, waits: {}, longest SM list: {}",
        grouped(plan.tiling.stages.len() as u64),
        grouped(plan.tiling.tasks.len() as u64),
        grouped(plan.schedule.counters.len() as u64),
        grouped(waits as u64),
        busiest
    );
    let l = &plan.warps.layout;
    let _ = writeln!(
        s,
        "CTA: {} threads ({} producer warps, {} consumer warpgroups), registers {}/{} per thread, {} pages of 16 KiB, {} of shared memory",
        l.threads,
        l.producer_warps,
        l.consumer_warpgroups,
        l.producer_regs,
        l.consumer_regs,
        l.pages,
        bytes(l.smem_bytes)
    );
    let p = &plan.verified;
    let _ = writeln!(
        s,
        "verified: {} instructions, {} waits, {} read-after-write orders, {} buffer reuses ({} buffers, {})",
        grouped(p.instructions as u64),
        grouped(p.waits as u64),
        grouped(p.reads as u64),
        grouped(p.reuses as u64),
        plan.tiling.buffers.len(),
        bytes(plan.tiling.buffers.iter().sum::<u64>())
    );
    s
}

/// The estimate as `mkc plan --estimate` prints it.
pub fn render(e: &Estimate, bandwidth: f64) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "batch {}, moved per step: weights read {}, state read and written {}, activations written {}",
        e.batch,
        bytes(e.weight_bytes),
        bytes(e.state_bytes),
        bytes(e.activation_bytes)
    );
    let _ = writeln!(
        s,
        "batch {}: floor {:.1} us at {:.2} TB/s, predicted {:.1} us ({:.0}% of floor), critical path {:.1} us, {:.1} tokens/s per user",
        e.batch,
        e.floor_us,
        bandwidth / 1e12,
        e.step_us,
        100.0 * e.fraction_of_floor,
        e.critical_path_us,
        e.tokens_per_s
    );
    s
}

/// Speculative decoding as the estimate models it: a verify step takes
/// `tokens` positions of each sequence (its last accepted token and
/// `tokens - 1` drafts) and keeps the longest run of drafts equal to the
/// model's argmax plus the model's next token; each draft is accepted with
/// probability `acceptance`, independently, until the first rejection.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Speculation {
    /// Positions per sequence in a verify step (1: plain decoding).
    pub tokens: u32,
    /// The chance that a draft equals the model's token.
    pub acceptance: f64,
}

impl Speculation {
    /// Tokens a sequence gains per verify step, in expectation:
    /// `1 + a + a^2 + ... + a^(T-1)` (the model's own token, then each draft
    /// kept only if every draft before it was).
    pub fn expected_tokens(&self) -> f64 {
        (0..self.tokens).map(|i| self.acceptance.powi(i as i32)).sum()
    }
}

/// The lines `--speculative` adds for one batch: the verify step (estimated
/// as a step of `batch x tokens` positions, `verify`) against the plain step
/// (`plain`), in tokens/s per user.
pub fn render_speculative(plain: &Estimate, verify: std::result::Result<&Estimate, &str>, s: Speculation) -> String {
    let gain = s.expected_tokens();
    let mut out = String::new();
    match verify {
        Ok(v) => {
            let per_user = if v.step_us > 0.0 { gain * 1e6 / v.step_us } else { 0.0 };
            let _ = writeln!(
                out,
                "batch {}, speculative {} positions at acceptance {:.2}: {:.2} tokens per verify step, verify step \
                 predicted {:.1} us ({} positions), {:.1} tokens/s per user ({:.2}x the {:.1} of plain decoding)",
                plain.batch,
                s.tokens,
                s.acceptance,
                gain,
                v.step_us,
                v.batch,
                per_user,
                if plain.tokens_per_s > 0.0 { per_user / plain.tokens_per_s } else { 0.0 },
                plain.tokens_per_s
            );
        }
        Err(why) => {
            let _ = writeln!(
                out,
                "batch {}, speculative {} positions: not estimated: a verify step of {} positions is {why}",
                plain.batch,
                s.tokens,
                u64::from(plain.batch) * u64::from(s.tokens)
            );
        }
    }
    out
}

/// What the speculative estimate assumes, printed once.
pub const SPECULATION_ASSUMPTIONS: &str = "assumptions (speculative): a verify step is costed as the plan of \
`codegen --positions` (batch x positions rows): the weights read once, every position's state traffic counted (an \
upper bound: a sequence's KV cache and recurrent state serve its positions in one pass, and the commit after the step \
reads and writes KDA's recurrent state and the conv windows once more); drafts accepted independently at the stated \
rate until the first rejection; drafting (prompt lookup on the host), the acceptance test and the commit's launch not \
costed";

/// Per kind: how many were added, and the sums of their values; `add_to_kind`
/// counts one more of `kind` and adds its values.
type KindSums<const N: usize> = Vec<(String, usize, [f64; N])>;
fn add_to_kind<const N: usize>(kinds: &mut KindSums<N>, kind: String, values: [f64; N]) {
    match kinds.iter_mut().find(|k| k.0 == kind) {
        Some(k) => {
            k.1 += 1;
            k.2.iter_mut().zip(values).for_each(|(sum, x)| *sum += x);
        }
        None => kinds.push((kind, 1, values)),
    }
}

/// Where the measured tasks that waited for weight pages spent their time
/// (the trace's splits), per kind of task: their mean pages, input staging,
/// first page wait, streaming and epilogue, and their fixed cost (all but the
/// streaming) beside the target's `task_overhead_ns`; nothing where the trace
/// has no splits.
fn render_splits(out: &mut String, plan: &Plan, measured: &super::html::trace::Measured, task_overhead_ns: f64) {
    // Per kind: tasks, and the sums of pages, staged, first page, streamed, epilogue (ns).
    let mut kinds: KindSums<5> = vec![];
    for (t, split) in measured.splits.iter().enumerate() {
        let (Some(s), Some(task)) = (split, plan.tiling.tasks.get(t)) else { continue };
        let kind = super::html::trace::kind_name(plan.tiling.stages[task.stage].kind);
        add_to_kind(&mut kinds, kind, [s.pages as f64, s.staged, s.first_page, s.streamed, s.epilogue]);
    }
    if kinds.is_empty() {
        return;
    }
    kinds.sort_by(|a, b| a.0.cmp(&b.0));
    let _ = writeln!(
        out,
        "per kind of task, where its tasks' time goes (means over the tasks that waited for weight pages, us; fixed: \
         all but streaming, the model's task_overhead_ns {:.1}):",
        task_overhead_ns / 1e3
    );
    let _ = writeln!(
        out,
        "  {:>6} {:>6} {:>7} {:>7} {:>8} {:>8} {:>7}  kind",
        "tasks", "pages", "staged", "1st pg", "streamed", "epilogue", "fixed"
    );
    for (kind, n, sums) in &kinds {
        let [pages, staged, first, streamed, epilogue] = sums.map(|x| x / *n as f64);
        let _ = writeln!(
            out,
            "  {n:>6} {pages:>6.1} {:>7.1} {:>7.1} {:>8.1} {:>8.1} {:>7.1}  {kind}",
            staged / 1e3,
            first / 1e3,
            streamed / 1e3,
            epilogue / 1e3,
            (staged + first + epilogue) / 1e3
        );
    }
}

/// Predicted against measured, stage by stage: each stage's span (its first
/// task's start to its last task's end, in microseconds from the step's
/// start) in the plan's schedule and in a measured step (`mkc plan --trace`),
/// their ratio, how many stages the prediction meets within 15%, and the
/// step. Stages without a measured task are counted apart. Where the trace
/// splits its tasks' time, a table per kind of task says where it goes
/// (`render_splits`), beside `task_overhead_ns`, the target's fixed cost a task.
pub fn render_measured(plan: &Plan, measured: &super::html::trace::Measured, task_overhead_ns: f64) -> String {
    let stages = plan.tiling.stages.len();
    let mut predicted = vec![(f64::INFINITY, f64::NEG_INFINITY); stages];
    for i in plan.schedule.sms.iter().flatten() {
        let p = &mut predicted[i.stage];
        *p = (p.0.min(i.start_ns), p.1.max(i.end_ns));
    }
    let mut got = vec![(f64::INFINITY, f64::NEG_INFINITY); stages];
    let mut step_measured = 0f64;
    for (t, m) in measured.tasks.iter().enumerate() {
        if let (Some((a, b)), Some(task)) = (m, plan.tiling.tasks.get(t)) {
            let g = &mut got[task.stage];
            *g = (g.0.min(*a), g.1.max(*b));
            step_measured = step_measured.max(*b);
        }
    }
    let mut out = String::new();
    let _ = writeln!(out, "predicted against measured, per stage (span: first start to last end, us):");
    let _ = writeln!(out, "  {:>5} {:>10} {:>10} {:>7}  stage", "", "predicted", "measured", "ratio");
    let (mut within, mut compared, mut missing) = (0usize, 0usize, 0usize);
    // Per kind of task: stages, predicted and measured spans summed.
    let mut kinds: KindSums<2> = vec![];
    for s in 0..stages {
        let name = super::html::trace::stage_name(plan, s);
        let (p, g) = (predicted[s], got[s]);
        let pspan = (p.1 - p.0).max(0.0) / 1e3;
        if !g.0.is_finite() {
            missing += 1;
            let _ = writeln!(out, "  {s:>5} {pspan:>10.1} {:>10} {:>7}  {name}", "-", "-");
            continue;
        }
        let gspan = (g.1 - g.0).max(0.0) / 1e3;
        let ratio = if pspan > 0.0 { gspan / pspan } else { f64::INFINITY };
        compared += 1;
        if (ratio - 1.0).abs() <= 0.15 {
            within += 1;
        }
        let _ = writeln!(out, "  {s:>5} {pspan:>10.1} {gspan:>10.1} {ratio:>7.2}  {name}");
        let kind = super::html::trace::kind_name(plan.tiling.stages[s].kind);
        add_to_kind(&mut kinds, kind, [pspan, gspan]);
    }
    // Where the model misses the most time first.
    kinds.sort_by(|a, b| (b.2[1] - b.2[0]).abs().total_cmp(&(a.2[1] - a.2[0]).abs()).then(a.0.cmp(&b.0)));
    let _ = writeln!(out, "per kind of task, the stages' spans summed (us), the largest miss first:");
    let _ = writeln!(out, "  {:>6} {:>10} {:>10} {:>7}  kind", "stages", "predicted", "measured", "ratio");
    for (kind, n, [p, g]) in &kinds {
        let ratio = if *p > 0.0 { g / p } else { f64::INFINITY };
        let _ = writeln!(out, "  {n:>6} {p:>10.1} {g:>10.1} {ratio:>7.2}  {kind}");
    }
    render_splits(&mut out, plan, measured, task_overhead_ns);
    let step_predicted = plan.schedule.step_ns / 1e3;
    let _ = writeln!(
        out,
        "stages within 15% of the prediction: {within} of {compared}{}",
        if missing > 0 { format!(" ({missing} without a measured task)") } else { String::new() }
    );
    let _ = writeln!(
        out,
        "step: predicted {step_predicted:.1} us, measured {:.1} us (ratio {:.2})",
        step_measured / 1e3,
        if step_predicted > 0.0 { step_measured / 1e3 / step_predicted } else { f64::INFINITY }
    );
    out
}
