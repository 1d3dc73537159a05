//! The schedule as the device reads it: flat instruction, wait and per-SM
//! offset tables in the layout of `device/mkc/instruction.cuh`
//! (`mkc::Instruction`, `mkc::Wait`, `Program::sm_begin`).
//!
//! Opcodes are the planner's [`TaskKind`]s in declaration order; the device
//! header's `Opcode` enum lists the same names in the same order, and a test
//! reads the header to keep the two in step.

use serde::Serialize;

use super::tile::TaskKind;
use super::Plan;

/// Every task kind, in opcode order.
pub const OPCODES: [TaskKind; 16] = [
    TaskKind::ProjectionRows,
    TaskKind::MlaSplit,
    TaskKind::MlaCombine,
    TaskKind::Kda,
    TaskKind::Router,
    TaskKind::ExpertUp,
    TaskKind::ExpertDown,
    TaskKind::ExpertCombine,
    TaskKind::AttnRes,
    TaskKind::Embedding,
    TaskKind::LmHeadRows,
    TaskKind::Argmax,
    TaskKind::Elementwise,
    TaskKind::MlaAbsorb,
    TaskKind::ExchangeSend,
    TaskKind::ExchangeReduce,
];

/// The device opcode of a task kind.
pub fn opcode(kind: TaskKind) -> u16 {
    OPCODES.iter().position(|k| *k == kind).expect("every task kind has an opcode") as u16
}

/// `mkc::Instruction`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct DeviceInstruction {
    /// The task kind's opcode.
    pub opcode: u16,
    /// How many waits, from `first_wait`.
    pub n_waits: u16,
    /// Index of the first wait in [`DeviceTables::waits`].
    pub first_wait: u32,
    /// The counter bumped when done.
    pub signal: u32,
    /// The task's index in the plan.
    pub task: u32,
}

/// The tables of one step's program.
#[derive(Debug, Clone, Serialize)]
pub struct DeviceTables {
    /// All SMs' instructions, SM 0's list first.
    pub instructions: Vec<DeviceInstruction>,
    /// SM `s` runs `instructions[sm_begin[s]..sm_begin[s + 1]]`.
    pub sm_begin: Vec<u32>,
    /// `(counter, bumps per step)` pairs.
    pub waits: Vec<(u32, u32)>,
    /// Each counter's bumps per step.
    pub expected: Vec<u32>,
}

/// Lays the plan's schedule out as device tables.
pub fn tables(plan: &Plan) -> DeviceTables {
    let mut t = DeviceTables { instructions: vec![], sm_begin: vec![0], waits: vec![], expected: vec![] };
    for list in &plan.schedule.sms {
        for ins in list {
            let kind = plan.tiling.stages[ins.stage].kind;
            t.instructions.push(DeviceInstruction {
                opcode: opcode(kind),
                n_waits: ins.waits.len() as u16,
                first_wait: t.waits.len() as u32,
                signal: ins.signal as u32,
                task: ins.task as u32,
            });
            t.waits.extend(ins.waits.iter().map(|w| (w.counter as u32, w.target)));
        }
        t.sm_begin.push(t.instructions.len() as u32);
    }
    t.expected = plan.schedule.counters.iter().map(|c| c.expected).collect();
    t
}
