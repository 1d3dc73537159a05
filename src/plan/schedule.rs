//! Scheduling: static per-SM instruction lists from a cost model, with the
//! dependency counters and the waits each instruction needs.
//!
//! Cost model (per SM, all SMs streaming at once): HBM bytes move at
//! `read_bandwidth / sms`; math runs at the faster of CUDA-core fp32 and
//! tensor cores at `round_up(batch, 8) / 64` of their peak (the weight operand
//! read from shared memory bounds narrow MMAs); each task costs a
//! fixed `task_overhead_ns` of the target ([`TASK_OVERHEAD_NS`] unless its
//! file fits one to the card); each dependency hand-off costs the target's
//! `sync_latency_ns`. A task's weights (and state) do not depend on
//! activations, so the loader streams them as soon as the previous task's
//! weights are in, before the task's dependencies are met, but at most a
//! ring's worth ([`MAX_PAGES`] pages) ahead of the consumers; its math starts
//! when the SM is free and its dependencies are met, and it ends when both
//! the math and its weights are done.
//!
//! Placement is list scheduling in the fused operations' topological order:
//! each task goes to the SM where it would end first. Every SM's list is
//! therefore in stage order, so waits only ever point backwards and the
//! kernel cannot deadlock.
//!
//! The predicted times replay that placement with two differences: MXFP4
//! rows cost their consumers' register decode per element
//! ([`mx_decode_cycles`], measured) instead of their FLOPs, and the MLA
//! split's scores and weighted sums run at the CUDA-core rate its code
//! reaches ([`MLA_SPLIT_FLOPS_PER_CYCLE`], measured). Placement keeps
//! FLOPs: on the H200 a placement made with the decode cost ran two stages
//! of the per-layer-dims K3 25 times slower (docs/PLANNER.md), not yet
//! understood.
//!
//! Counters: one per stage, bumped once by each of its tasks with release
//! semantics, so its expected count per step is the stage's task count; and
//! in an expert-parallel plan one remote counter per exchange, bumped by the
//! exchange's send tasks on every other GPU (`Counter::remote`), on which
//! each of its reduce tasks waits. They
//! are never reset: in step `n` (from 1) a wait targets `n * expected`.
//! Waits: an instruction waits on a stage's counter only if the program order
//! and its other waits do not already guarantee that stage is complete; a
//! second pass drops every wait the others imply, so each remaining wait is
//! necessary (the verifier's mutation test relies on it).

use serde::Serialize;

use super::specialize::{MAX_PAGES, PAGE_BYTES};
use super::tile::{TaskKind, Tiling};
use super::Options;
use crate::diag::{Error, ErrorKind, Result};
use crate::target::Target;

/// Fixed cost of one task where the target file gives none
/// (`task_overhead_ns`): decode, waits, the first pages' latency, prologue
/// and epilogue barriers, publish. Small tasks on the H200 reach about half
/// the streaming rate of large ones (docs/PERFORMANCE.md, per-stage
/// profile): several microseconds each. The H100's traces fit 14 us
/// (bench/h100.yaml, docs/PLANNER.md).
pub const TASK_OVERHEAD_NS: f64 = 5000.0;

/// The MXFP4 consumers' cost per decoded weight element on one SM, in SM
/// cycles, at `batch` tokens: a fixed part (the decode and the block scales)
/// and a part per token multiplied. Batch 1 and 2 run on the int8 tensor
/// cores (`mx_rows_pages_mma`: 0.0502 + 0.0019 x batch), 3 to 8 on the fp16
/// ones (`mx_rows_pages_hmma`: 0.0522 + 0.0031 x batch), both taking two row
/// tiles a block, fitted to `ring_bench`'s `mx`, `mx-b2`, `mx-b4` and `mx-b8`
/// on the H100 at `0a7787e` (20.2, 19.5, 16.3 and 13.7 GB/s per SM; batch 1
/// there is near the 23.5 GB/s the ring streams, so its decode may cost less);
/// larger batches on the CUDA cores (0.052 + 0.0333 x batch, fitted to its
/// `mx-fma` at batch 1 and `mx-fma-b8`, whose input is read from global
/// memory as an expert task's is at batch 8, on the H200). Cycles, so other
/// targets scale by their clock (their consumers decode the same way until a
/// native block-scaled path exists).
pub fn mx_decode_cycles(batch: u32) -> f64 {
    let (decode, token) = match batch {
        0..=2 => (0.0502, 0.0019),
        3..=8 => (0.0522, 0.0031),
        _ => (0.052, 0.0333),
    };
    decode + token * f64::from(batch)
}

/// A wait on a counter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Wait {
    /// The counter.
    pub counter: usize,
    /// The count per step it waits for.
    pub target: u32,
}

/// One instruction of an SM's list.
#[derive(Debug, Clone, Serialize)]
pub struct Instr {
    /// The task it runs.
    pub task: usize,
    /// The task's stage.
    pub stage: usize,
    /// Counters to wait on before the math starts.
    pub waits: Vec<Wait>,
    /// The counter it bumps when done.
    pub signal: usize,
    /// Predicted start of its weight stream, in ns from the step's start.
    pub load_start_ns: f64,
    /// Predicted start of its math.
    pub start_ns: f64,
    /// Predicted end.
    pub end_ns: f64,
}

/// A dependency counter.
#[derive(Debug, Clone, Serialize)]
pub struct Counter {
    /// Its index.
    pub id: usize,
    /// The stage whose tasks bump it.
    pub stage: usize,
    /// Bumps per step.
    pub expected: u32,
    /// Bumped by the other GPUs of an expert-parallel plan: their tasks of
    /// `stage` (an exchange's send stage), one bump each on every other GPU,
    /// so `expected` is the stage's tasks times the other GPUs. Every GPU runs
    /// the same plan, so a wait for all of them is a wait for that stage on
    /// every other GPU.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub remote: bool,
}

/// The schedule of one decode step.
#[derive(Debug, Clone, Serialize)]
pub struct Schedule {
    /// Per SM, its instructions in program order.
    pub sms: Vec<Vec<Instr>>,
    /// The counters.
    pub counters: Vec<Counter>,
    /// Per stage, what its loader waits for before streaming weights that
    /// activations choose (a routed expert stage: its router's whole stage,
    /// as `(counter, bumps per step)`); `None` for weights known in advance.
    pub load_waits: Vec<Option<(usize, u32)>>,
    /// Predicted time of the step.
    pub step_ns: f64,
    /// Lower bound from the longest dependency chain.
    pub critical_path_ns: f64,
    /// HBM bytes per step: weights and state.
    pub hbm_bytes: u64,
    /// The bandwidth floor: `hbm_bytes` over the read bandwidth.
    pub floor_ns: f64,
}

/// Per stage, the stages that must be complete before any of its tasks start:
/// the stages it reads, and for the buffer it writes, the readers of the
/// buffer's previous region (write after read).
pub fn needs(tiling: &Tiling) -> Vec<Vec<usize>> {
    let mut need: Vec<Vec<usize>> = tiling.stages.iter().map(|s| s.reads.clone()).collect();
    // An exchange's sends write the half of the other GPUs' inboxes that the
    // exchange before the last one used: every send after every reduce of the
    // exchange before it, whose wait saw the other GPUs' sends of that one,
    // each after their reduces of the one before (`verify`).
    let mut reduce_before: Option<usize> = None;
    for s in &tiling.stages {
        match s.kind {
            TaskKind::ExchangeSend => need[s.id].extend(reduce_before),
            TaskKind::ExchangeReduce => reduce_before = Some(s.id),
            _ => {}
        }
    }
    let mut last_in_buffer: Vec<Option<usize>> = vec![None; tiling.buffers.len()];
    for r in &tiling.regions {
        if let Some(prev) = last_in_buffer[r.buffer] {
            let prev = &tiling.regions[prev];
            need[r.writer].extend(prev.readers.iter().copied().filter(|x| *x != r.writer));
            need[r.writer].push(prev.writer);
        }
        last_in_buffer[r.buffer] = Some(r.id);
    }
    for n in &mut need {
        n.sort_unstable();
        n.dedup();
    }
    need
}

/// A task on an SM whose consumers are free at `compute_free` and whose loader
/// at `load_free`, its dependencies met at `ready`, with `load_t` ns of
/// weights and `cost` ns of work: (start, load end, end). The loader streams
/// at most `ring` ns ahead of the consumers.
fn timing(compute_free: f64, load_free: f64, ready: f64, load_t: f64, cost: f64, ring: f64) -> (f64, f64, f64) {
    let start = compute_free.max(ready);
    let load_end = (load_free + load_t).max(start + load_t - ring);
    (start, load_end, (start + cost).max(load_end))
}

/// A vector clock: per SM, how many of its instructions are known complete.
type Clock = Vec<u32>;

/// The MLA split's FLOPs per SM cycle, on the tensor cores
/// (`Stage::mla_tensor_cores`, mla_fold_mma) with the absorbed queries in
/// shared memory (the absorption its own stage): K3 per-layer dims with 256
/// experts on the H100 at `0a7787e`, 50, 191 and 373 us at batch 1, 4 and 8
/// against 103, 368 and 722 predicted at 40 (bench/results/
/// 2026-12-07_h100_0a7787e_k3_dims_3l256e_stages.txt). Far from the MMAs'
/// peak, for reasons not yet measured. Before
/// (`ea003bf`, each split its own pass of W_UK, the queries read from global
/// memory at every k-step) it was 40, and on the CUDA cores 40 too (K2 dims at
/// batch 8 on the H100, `83f732f`), when the tensor-core rate the rest of the
/// model assumes predicted the stage eleven times too fast.
pub const MLA_SPLIT_FLOPS_PER_CYCLE: f64 = 80.0;

fn join(a: &mut Clock, b: &Clock) {
    for (x, y) in a.iter_mut().zip(b) {
        *x = (*x).max(*y);
    }
}

/// Schedules the tiled plan on `target`.
pub fn schedule(tiling: &Tiling, target: &Target, opts: Options) -> Result<Schedule> {
    let sms = target.sms as usize;
    let bw_sm = target.read_bandwidth() / f64::from(target.sms) / 1e9; // bytes per ns
                                                                       // Tensor cores on a narrow batch (the activations as the N operand, N a
                                                                       // multiple of 8) are bounded by reading the weight operand from shared
                                                                       // memory: about N/64 of peak.
    let width = f64::from(opts.batch.div_ceil(8) * 8);
    let tensor = target.flops.bf16_tensor * (width / 64.0).min(1.0);
    let rate = target.flops.fp32_cuda_core.max(tensor) / f64::from(target.sms) / 1e9;
    let sync = target.sync_latency_ns;
    let overhead = target.task_overhead_ns;
    let ring = (MAX_PAGES * PAGE_BYTES) as f64 / bw_sm; // how far ahead the loader may stream, in ns
    let need = needs(tiling);

    // Placement costs MXFP4 rows by their FLOPs, as the schedules measured on
    // the H200 were placed; the predicted times (below) by their consumers'
    // decode, which bounds them.
    let mx_ns = mx_decode_cycles(opts.batch) / target.clock_ghz;
    // An exchange's send tasks share this GPU's links to the others: a task's
    // tile to each other GPU at the link's bandwidth over the stage's tasks.
    let link_per_ns = target.nvlink_bandwidth / 1e9;
    let link = |t: usize| {
        let stage = &tiling.stages[tiling.tasks[t].stage];
        match (stage.kind, stage.exchange) {
            (TaskKind::ExchangeSend, Some(x)) => {
                (x.tile_bytes * u64::from(x.ranks - 1)) as f64 * stage.tasks.len() as f64 / link_per_ns
            }
            _ => 0.0,
        }
    };
    let compute = |t: usize| {
        let task = &tiling.tasks[t];
        overhead + task.act_bytes as f64 / bw_sm + task.flops as f64 / rate + link(t)
    };
    let mla_rate = MLA_SPLIT_FLOPS_PER_CYCLE * target.clock_ghz; // FLOPs per ns
    let predicted = |t: usize| {
        let task = &tiling.tasks[t];
        let math = if task.decoded > 0 {
            task.decoded as f64 * mx_ns
        } else if tiling.stages[task.stage].kind == TaskKind::MlaSplit {
            task.flops as f64 / mla_rate
        } else {
            task.flops as f64 / rate
        };
        overhead + task.act_bytes as f64 / bw_sm + math + link(t)
    };
    let load = |t: usize| {
        let task = &tiling.tasks[t];
        (task.weight_bytes + task.state_bytes) as f64 / bw_sm
    };

    let mut lists: Vec<Vec<Instr>> = vec![vec![]; sms];
    let mut compute_free = vec![0f64; sms];
    let mut load_free = vec![0f64; sms];
    let mut finish = vec![0f64; tiling.stages.len()];
    let mut cp = vec![0f64; tiling.stages.len()];
    // (task, SM), in placement order.
    let mut placed: Vec<(usize, usize)> = Vec::with_capacity(tiling.tasks.len());
    // When a stage's dependencies are met, given when each stage finishes. An
    // exchange's reduce also waits for the other GPUs' sends, which end when
    // this GPU's do (the same plan) and arrive one link latency later.
    let remote = |finish: &[f64], s: usize| match (tiling.stages[s].kind, tiling.stages[s].exchange) {
        (TaskKind::ExchangeReduce, Some(x)) => finish[x.send] + target.nvlink_latency_ns,
        _ => 0.0,
    };
    let ready = |finish: &[f64], s: usize| need[s].iter().map(|r| finish[*r] + sync).fold(remote(finish, s), f64::max);
    for stage in &tiling.stages {
        let (ready_t, cp_ready) = (ready(&finish, stage.id), ready(&cp, stage.id));
        let mut order: Vec<usize> = stage.tasks.clone();
        order.sort_by(|a, b| load(*b).total_cmp(&load(*a)).then(a.cmp(b)));
        let mut cp_stage = 0f64;
        for t in order {
            let (mut best, mut start, mut best_end, mut best_load_end) = (0usize, 0f64, f64::INFINITY, 0f64);
            let (load_t, cost) = (load(t), compute(t));
            for m in 0..sms {
                let (s, load_end, end) = timing(compute_free[m], load_free[m], ready_t, load_t, cost, ring);
                if end < best_end - 1e-9 {
                    (best, start, best_end, best_load_end) = (m, s, end, load_end);
                }
            }
            let load_start = load_free[best];
            load_free[best] = best_load_end;
            compute_free[best] = best_end;
            finish[stage.id] = finish[stage.id].max(best_end);
            cp_stage = cp_stage.max(predicted(t)).max(load_t - cp_ready);
            placed.push((t, best));
            lists[best].push(Instr {
                task: t,
                stage: stage.id,
                waits: vec![],
                signal: stage.id,
                load_start_ns: load_start,
                start_ns: start,
                end_ns: best_end,
            });
        }
        cp[stage.id] = cp_ready + cp_stage;
    }
    // Program order is stage order; within a stage, by start time.
    for l in &mut lists {
        l.sort_by(|a, b| a.stage.cmp(&b.stage).then(a.start_ns.total_cmp(&b.start_ns)).then(a.task.cmp(&b.task)));
    }
    // The predicted times: the same placement and the same rules, with MXFP4
    // rows at their decode cost.
    let mut times = vec![(0f64, 0f64, 0f64); tiling.tasks.len()]; // (load start, start, end)
    let (mut compute_free, mut load_free) = (vec![0f64; sms], vec![0f64; sms]);
    finish.iter_mut().for_each(|f| *f = 0.0);
    for &(t, m) in &placed {
        let stage = tiling.tasks[t].stage;
        let (start, load_end, end) =
            timing(compute_free[m], load_free[m], ready(&finish, stage), load(t), predicted(t), ring);
        times[t] = (load_free[m], start, end);
        (load_free[m], compute_free[m]) = (load_end, end);
        finish[stage] = finish[stage].max(end);
    }
    for i in lists.iter_mut().flatten() {
        (i.load_start_ns, i.start_ns, i.end_ns) = times[i.task];
    }
    assign_waits(tiling, &need, &mut lists)?;
    let mut counters: Vec<Counter> = tiling
        .stages
        .iter()
        .map(|s| Counter { id: s.id, stage: s.id, expected: s.tasks.len() as u32, remote: false })
        .collect();
    // Each exchange's remote counter, after the stages' own; every reduce task
    // waits for all its bumps (nothing on this GPU implies them).
    for s in &tiling.stages {
        if let (TaskKind::ExchangeReduce, Some(x)) = (s.kind, s.exchange) {
            let expected = tiling.stages[x.send].tasks.len() as u32 * (x.ranks - 1);
            let id = counters.len();
            counters.push(Counter { id, stage: x.send, expected, remote: true });
            for i in lists.iter_mut().flatten().filter(|i| i.stage == s.id) {
                i.waits.push(Wait { counter: id, target: expected });
            }
        }
    }
    // The loader runs ahead of the controller's waits: an expert stage's
    // loader waits for the router stage it reads, whole.
    let load_waits = tiling
        .stages
        .iter()
        .map(|s| {
            if !matches!(s.kind, TaskKind::ExpertUp | TaskKind::ExpertDown) {
                return None;
            }
            let router = s.reads.iter().copied().find(|r| tiling.stages[*r].kind == TaskKind::Router)?;
            let c = counters.iter().find(|c| c.stage == router)?;
            Some((c.id, c.expected))
        })
        .collect();
    let hbm_bytes: u64 = tiling.tasks.iter().map(|t| t.weight_bytes + t.state_bytes).sum();
    let step_ns = finish.iter().copied().fold(0f64, f64::max);
    Ok(Schedule {
        sms: lists,
        counters,
        load_waits,
        step_ns,
        critical_path_ns: cp.iter().copied().fold(0f64, f64::max),
        hbm_bytes,
        floor_ns: hbm_bytes as f64 / (target.read_bandwidth() / 1e9),
    })
}

/// Computes each instruction's minimal waits with vector clocks, processing
/// stages in order (every wait points to an earlier stage).
fn assign_waits(tiling: &Tiling, need: &[Vec<usize>], lists: &mut [Vec<Instr>]) -> Result<()> {
    let sms = lists.len();
    // Where each task sits: (sm, position).
    let mut place = vec![(0usize, 0usize); tiling.tasks.len()];
    for (m, l) in lists.iter().enumerate() {
        for (p, i) in l.iter().enumerate() {
            place[i.task] = (m, p);
        }
    }
    // Per stage: per SM, one past the last position of its tasks (what
    // "stage complete" requires of a clock), and the join of its tasks' clocks.
    let mut required: Vec<Clock> = vec![vec![0; sms]; tiling.stages.len()];
    for s in &tiling.stages {
        for t in &s.tasks {
            let (m, p) = place[*t];
            required[s.id][m] = required[s.id][m].max(p as u32 + 1);
        }
    }
    // The same, as (sm, count) pairs for the SMs a stage uses.
    let sparse: Vec<Vec<(usize, u32)>> = required
        .iter()
        .map(|r| r.iter().enumerate().filter(|(_, c)| **c > 0).map(|(m, c)| (m, *c)).collect())
        .collect();
    let covers = |c: &Clock, stage: usize| sparse[stage].iter().all(|(m, n)| c[*m] >= *n);
    let mut counter_clock: Vec<Clock> = vec![vec![0; sms]; tiling.stages.len()];
    let mut sm_clock: Vec<Clock> = vec![vec![0; sms]; sms];
    for s in &tiling.stages {
        let mut tasks = s.tasks.clone();
        tasks.sort_by_key(|t| place[*t]);
        for t in tasks {
            let (m, p) = place[t];
            let base = sm_clock[m].clone();
            debug_assert_eq!(base[m] as usize, p);
            let mut clock = base.clone();
            let mut waits: Vec<usize> = vec![];
            for r in need[s.id].iter().rev() {
                if !covers(&clock, *r) {
                    waits.push(*r);
                    join(&mut clock, &counter_clock[*r]);
                }
            }
            // Drop waits that the others imply (a lone wait is necessary: the
            // program order alone did not cover it).
            let mut i = 0;
            while waits.len() > 1 && i < waits.len() {
                let mut c = base.clone();
                for (j, w) in waits.iter().enumerate() {
                    if j != i {
                        join(&mut c, &counter_clock[*w]);
                    }
                }
                if need[s.id].iter().all(|r| covers(&c, *r)) {
                    waits.remove(i);
                } else {
                    i += 1;
                }
            }
            let mut clock = base;
            for w in &waits {
                join(&mut clock, &counter_clock[*w]);
            }
            if !need[s.id].iter().all(|r| covers(&clock, *r)) {
                return Err(Error::new(
                    ErrorKind::Invalid,
                    format!("internal error: stage {} cannot be ordered after its inputs", s.id),
                ));
            }
            clock[m] = p as u32 + 1;
            waits.sort_unstable();
            lists[m][p].waits =
                waits.iter().map(|w| Wait { counter: *w, target: tiling.stages[*w].tasks.len() as u32 }).collect();
            join(&mut counter_clock[s.id], &clock);
            sm_clock[m] = clock;
        }
    }
    Ok(())
}
