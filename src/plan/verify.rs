//! The verifier: proves from the schedule alone that the kernel it describes
//! is free of deadlocks and races.
//!
//! Happens-before is what the hardware guarantees: the program order of each
//! SM's list (its tasks run one after another), and a counter wait that
//! targets the counter's full expected count (every task bumping it has
//! finished and released its writes). A wait for fewer bumps orders nothing:
//! any subset of the signalling tasks could be the ones done. Vector clocks
//! (per SM, how many of its instructions are known complete) make the check
//! linear in the schedule.
//!
//! Checked, with the first failure reported as a compiler error naming both
//! tasks:
//! - every list runs in stage order and waits only on earlier stages (so no
//!   wait can block forever), no wait asks for more than the counter's count,
//!   and each counter's expected count equals the tasks that bump it;
//! - read after write: every task of a stage that reads a region runs after
//!   every task that writes it;
//! - write after read and write after write: a task writing a buffer runs
//!   after every reader and the writer of the region the buffer held before;
//! - every routed expert stage's loader waits for its router's whole stage
//!   before reading the ids, and no other stage's loader waits;
//! - across GPUs (an expert-parallel plan, every GPU running it): a remote
//!   counter is bumped by an exchange's send stage on each other GPU, once a
//!   task (its expected count is that, and no task here bumps it); every
//!   task of the exchange's reduce waits for all of it before reading its
//!   inbox (a wait on an earlier stage, so no deadlock: by induction over the
//!   stages, every GPU completes each one); and every send follows every
//!   reduce of the exchange before it, so that a send overwrites an inbox half
//!   (the exchange before the last one's) only once the other GPUs' reduces
//!   of it are done: they came before those GPUs' sends of the exchange
//!   before, which the reduce before this send waited for. A wait on a remote
//!   counter orders nothing on this GPU.
//!
//! [`arena`] checks the arena layout: each block inside its region's buffer,
//! blocks of a region disjoint, and every value a stage reads written by a
//! stage it depends on. Not checked: state buffers (each has one owning op
//! per step).

use serde::Serialize;

use super::arena::{Arena, ArenaSlot};
use super::fuse::Fusion;
use super::schedule::Schedule;
use super::tile::{TaskKind, Tiling};
use crate::diag::{Error, ErrorKind, Result};
use crate::ir::Graph;

/// What the verifier established.
#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq)]
pub struct Proof {
    /// Instructions checked.
    pub instructions: usize,
    /// Waits in the schedule.
    pub waits: usize,
    /// Read-after-write orderings proven (reader stage, writer stage pairs).
    pub reads: usize,
    /// Buffer reuses proven safe.
    pub reuses: usize,
}

fn bug(msg: String) -> Error {
    Error::new(ErrorKind::Invalid, format!("plan verification failed: {msg}"))
        .help("this is a compiler bug in the planner; the plan was not emitted")
}

/// Verifies `schedule` against the regions of `tiling`.
pub fn verify(fusion: &Fusion, tiling: &Tiling, schedule: &Schedule) -> Result<Proof> {
    let sms = schedule.sms.len();
    let name = |task: usize| {
        let t = &tiling.tasks[task];
        let s = &tiling.stages[t.stage];
        format!("`{} {:?} {}`", fusion.ops[s.op].name, s.kind, t.label)
    };
    // Where each task runs; each exactly once.
    let mut place: Vec<Option<(usize, usize)>> = vec![None; tiling.tasks.len()];
    let mut signals = vec![0u32; schedule.counters.len()];
    for (m, list) in schedule.sms.iter().enumerate() {
        let mut last_stage = 0;
        for (p, ins) in list.iter().enumerate() {
            if place[ins.task].replace((m, p)).is_some() {
                return Err(bug(format!("task {} is scheduled twice", name(ins.task))));
            }
            if ins.stage < last_stage {
                return Err(bug(format!("SM {m} runs {} after a later stage", name(ins.task))));
            }
            last_stage = ins.stage;
            signals[ins.signal] += 1;
            if let (TaskKind::ExchangeReduce, Some(x)) =
                (tiling.stages[ins.stage].kind, tiling.stages[ins.stage].exchange)
            {
                let waits_all = ins.waits.iter().any(|w| {
                    schedule
                        .counters
                        .get(w.counter)
                        .is_some_and(|c| c.remote && c.stage == x.send && w.target == c.expected)
                });
                if !waits_all {
                    return Err(bug(format!(
                        "{} reads its inbox without waiting for every other GPU's sends of the exchange",
                        name(ins.task)
                    )));
                }
            }
            for w in &ins.waits {
                let c = schedule
                    .counters
                    .get(w.counter)
                    .ok_or_else(|| bug(format!("{} waits on unknown counter {}", name(ins.task), w.counter)))?;
                if c.stage >= ins.stage {
                    return Err(bug(format!(
                        "{} on SM {m} waits on a counter of its own or a later stage: deadlock",
                        name(ins.task)
                    )));
                }
                if w.target > c.expected {
                    return Err(bug(format!(
                        "{} waits for {} bumps of a counter bumped {} times: it would wait forever",
                        name(ins.task),
                        w.target,
                        c.expected
                    )));
                }
            }
        }
    }
    if let Some(t) = place.iter().position(Option::is_none) {
        return Err(bug(format!("task {} is never scheduled", name(t))));
    }
    // The loaders' waits: a stage whose weights the router chooses streams
    // them only after the whole router stage it reads (the loader runs ahead
    // of the controller's waits, so nothing else orders its reads of the ids).
    for s in &tiling.stages {
        let routed = matches!(s.kind, TaskKind::ExpertUp | TaskKind::ExpertDown);
        let wait = schedule.load_waits.get(s.id).copied().flatten();
        let ok = match wait {
            None => !routed,
            Some((counter, target)) => schedule.counters.get(counter).is_some_and(|c| {
                routed
                    && s.reads.contains(&c.stage)
                    && tiling.stages[c.stage].kind == TaskKind::Router
                    && c.expected == target
            }),
        };
        if !ok {
            return Err(bug(format!(
                "stage {} ({:?}) has loader wait {wait:?}: a routed expert stage's loader must wait for its whole router stage, no other stage's may wait",
                s.id, s.kind
            )));
        }
    }
    for c in &schedule.counters {
        if c.remote {
            let send = &tiling.stages[c.stage];
            let ok = match (send.kind, send.exchange) {
                (TaskKind::ExchangeSend, Some(x)) => {
                    signals[c.id] == 0 && c.expected == send.tasks.len() as u32 * x.ranks.saturating_sub(1)
                }
                _ => false,
            };
            if !ok {
                return Err(bug(format!(
                    "remote counter {} expects {} bumps per step from stage {} ({:?}), which does not send them, \
                     or tasks of this GPU bump it ({})",
                    c.id, c.expected, c.stage, send.kind, signals[c.id]
                )));
            }
            continue;
        }
        if signals[c.id] != c.expected {
            return Err(bug(format!(
                "counter {} expects {} bumps per step but {} tasks bump it",
                c.id, c.expected, signals[c.id]
            )));
        }
    }
    let place: Vec<(usize, usize)> = place.into_iter().map(|p| p.expect("checked")).collect();

    // Per stage: per SM, one past its last task there.
    let mut done: Vec<Vec<u32>> = vec![vec![0; sms]; tiling.stages.len()];
    for s in &tiling.stages {
        for t in &s.tasks {
            let (m, p) = place[*t];
            done[s.id][m] = done[s.id][m].max(p as u32 + 1);
        }
    }
    let done_on: Vec<Vec<(usize, u32)>> =
        done.iter().map(|d| d.iter().enumerate().filter(|(_, n)| **n > 0).map(|(k, n)| (k, *n)).collect()).collect();
    // What each stage must see complete, and why.
    let mut must: Vec<Vec<(usize, &'static str)>> = vec![vec![]; tiling.stages.len()];
    let mut reads = 0;
    let mut reuses = 0;
    let mut tenant: Vec<Option<usize>> = vec![None; tiling.buffers.len()];
    for r in &tiling.regions {
        for reader in &r.readers {
            must[*reader].push((r.writer, "reads the result of"));
            reads += 1;
        }
        if let Some(prev) = tenant[r.buffer] {
            let prev = &tiling.regions[prev];
            for reader in prev.readers.iter().filter(|x| **x != r.writer) {
                must[r.writer].push((*reader, "overwrites a buffer still read by"));
            }
            must[r.writer].push((prev.writer, "overwrites a buffer written by"));
            reuses += 1;
        }
        tenant[r.buffer] = Some(r.id);
    }
    let mut reduce_before: Option<usize> = None;
    for s in &tiling.stages {
        match s.kind {
            TaskKind::ExchangeSend => {
                if let Some(r) = reduce_before {
                    must[s.id].push((
                        r,
                        "overwrites the other GPUs' inbox half their reduce two exchanges back reads, \
                                        ordered only after every reduce of",
                    ));
                }
            }
            TaskKind::ExchangeReduce => reduce_before = Some(s.id),
            _ => {}
        }
    }

    // Clocks, in stage order (a topological order, checked above).
    let mut order: Vec<usize> = (0..tiling.tasks.len()).collect();
    order.sort_by_key(|t| (tiling.tasks[*t].stage, place[*t]));
    let mut sm_clock: Vec<Vec<u32>> = vec![vec![0; sms]; sms];
    let mut counter_clock: Vec<Vec<u32>> = vec![vec![0; sms]; schedule.counters.len()];
    let mut waits = 0;
    for t in order {
        let (m, p) = place[t];
        let ins = &schedule.sms[m][p];
        let mut clock = sm_clock[m].clone();
        for w in &ins.waits {
            waits += 1;
            let c = &schedule.counters[w.counter];
            if w.target == c.expected && !c.remote {
                for (x, y) in clock.iter_mut().zip(&counter_clock[w.counter]) {
                    *x = (*x).max(*y);
                }
            }
        }
        for (stage, why) in &must[ins.stage] {
            if let Some((sm, _)) = done_on[*stage].iter().find(|(k, n)| clock[*k] < *n) {
                let sm = *sm;
                let other = schedule.sms[sm][done[*stage][sm] as usize - 1].task;
                return Err(bug(format!("{} {why} {}, but nothing orders them", name(t), name(other))));
            }
        }
        clock[m] = p as u32 + 1;
        for (x, y) in counter_clock[ins.signal].iter_mut().zip(&clock) {
            *x = (*x).max(*y);
        }
        sm_clock[m] = clock;
    }
    Ok(Proof { instructions: tiling.tasks.len(), waits, reads, reuses })
}

/// Verifies the arena layout against the tiling: every block lies in its
/// region's buffer and is written by the region's stage, no two blocks of a
/// region overlap, the buffers and the routing log are disjoint and inside
/// the arena, and every stage reading a value another stage writes depends
/// on that stage (so the region lists it as a reader, and the orderings and
/// buffer reuses proved above cover the read), and the arena and the staging
/// of all SMs are within [`MAX_ARENA_BYTES`](super::arena::MAX_ARENA_BYTES).
/// Returns the reads checked.
pub fn arena(g: &Graph, tiling: &Tiling, arena: &Arena) -> Result<usize> {
    // The bound first: every offset and size below is then far from 64 bits.
    let staging = || "the fp32 staging of all SMs".to_string();
    super::arena::bounded(&staging, &[arena.staging_floats, 4, 1024])?;
    super::arena::bounded(&|| "the arena".to_string(), &[arena.bytes])?;
    let mut end = 0;
    for (b, &(at, bytes)) in arena.buffers.iter().enumerate() {
        if at < end {
            return Err(bug(format!("arena buffer {b} at {at} overlaps the one before (ending at {end})")));
        }
        end = at.checked_add(bytes).filter(|e| *e <= arena.bytes).ok_or_else(|| {
            bug(format!("arena buffer {b} ({bytes} bytes at {at}) passes the arena's end {}", arena.bytes))
        })?;
    }
    if arena.route_log < end || arena.route_log.saturating_add(arena.route_log_bytes) > arena.bytes {
        return Err(bug(format!(
            "the routing log at {} ({} bytes) is not between the buffers' end {end} and the arena's end {}",
            arena.route_log, arena.route_log_bytes, arena.bytes
        )));
    }
    let mut by_region: Vec<Vec<&ArenaSlot>> = vec![vec![]; tiling.regions.len()];
    for s in &arena.slots {
        let r = &tiling.regions[s.region];
        let (at, bytes) = arena.buffers[s.buffer];
        if s.buffer != r.buffer || s.writer != r.writer {
            return Err(bug(format!(
                "{:?} of stage {} is not in stage {}'s region {}",
                s.what, s.writer, r.writer, r.id
            )));
        }
        if s.offset < at || s.offset.saturating_add(s.bytes) > at + bytes {
            return Err(bug(format!(
                "{:?} of stage {} ({} bytes at {}) is outside its buffer {} ({bytes} bytes at {at})",
                s.what, s.writer, s.bytes, s.offset, s.buffer
            )));
        }
        by_region[s.region].push(s);
    }
    for slots in &mut by_region {
        slots.sort_by_key(|s| s.offset);
        for w in slots.windows(2) {
            if w[0].offset.saturating_add(w[0].bytes) > w[1].offset {
                return Err(bug(format!("{:?} and {:?} of stage {} overlap", w[0].what, w[1].what, w[0].writer)));
            }
        }
    }
    for (s, spill) in arena.spills.iter().enumerate() {
        if spill.is_some_and(|at| at >= arena.staging_floats) {
            return Err(bug(format!("stage {s}'s input spills past the SM's staging")));
        }
    }
    let mut checked = 0;
    for (s, reads) in arena.reads.iter().enumerate() {
        for v in reads {
            let Some(&w) = arena.writes.get(v) else {
                return Err(bug(format!("stage {s} reads {}, which no stage writes", g.node(v.node).name)));
            };
            if w != s && !tiling.stages[s].reads.contains(&w) {
                return Err(bug(format!(
                    "stage {s} reads {} (written by stage {w}) without depending on it",
                    g.node(v.node).name
                )));
            }
            checked += 1;
        }
    }
    Ok(checked)
}
