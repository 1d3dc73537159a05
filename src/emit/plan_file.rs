//! The plan file: everything about one compiled model that grows with its
//! layers, experts or tasks, as data the runtime reads, checks and uploads
//! (the generated C++ holds only what is the same for every layer of a kind).
//!
//! Layout (format 1, little-endian; `docs/CODEGEN.md` has the table, and
//! `runtime/include/mkc/plan_file.h` reads it):
//! - a 256-byte header: magic `MKCPLAN\0`, format version (u32), section
//!   count (u32), mkc version (32 bytes), model (64), target (32), batch
//!   (u32), SMs (u32), context (u64), file size (u64), checksum (u64: FNV-1a
//!   64 of the whole file with this field zero), zeros to 256;
//! - the section table: per section `{id u32, element bytes u32, count u64,
//!   offset u64}`;
//! - the sections, each 16-byte aligned, in id order ([`Section`]).
//!
//! The text summary ([`summary`]) is what `generated/` commits for models
//! whose plan file is too large to commit: any change to the file changes its
//! sha256 there.

use sha2::{Digest, Sha256};

use crate::checkpoint::{GpuLayout, WeightGroup};
use crate::plan::tables::DeviceTables;

use super::program::Program;

/// The plan file's magic bytes.
pub const MAGIC: &[u8; 8] = b"MKCPLAN\0";
/// The plan file's format version.
pub const FORMAT: u32 = 1;
/// The header's size in bytes.
pub const HEADER_BYTES: usize = 256;
/// Most dimensions of a tensor (`MKC_MAX_DIMS`).
pub const MAX_DIMS: usize = 8;

/// The sections, by id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Section {
    /// `mkc::Instruction` (16 bytes): every SM's list, SM 0 first.
    Instructions = 1,
    /// u32 `[sms + 1]`: SM s runs instructions `[sm_begin[s], sm_begin[s + 1])`.
    SmBegin = 2,
    /// `mkc::Wait` (8 bytes): counter, bumps per step.
    Waits = 3,
    /// u32: each counter's bumps per step.
    Counters = 4,
    /// `mkc::TaskArgs` (20 bytes): stage, index in it, four arguments.
    Tasks = 5,
    /// `mkc::StageRecord` (16 bytes): role, first parameter, loader wait.
    Stages = 6,
    /// u64: the stages' parameters, each stage's in its kind's field order.
    Params = 7,
    /// `mkc::WeightGroupRecord` (16 bytes): placeholder, members, tensors.
    WeightGroups = 8,
    /// `mkc::TensorRecord` (88 bytes): key pattern, dtype, node, layout, shape.
    Tensors = 9,
    /// u64: each per-sequence state's bytes.
    States = 10,
    /// u32: each stage's name (a string offset), for profile traces.
    StageNames = 11,
    /// NUL-terminated strings, addressed by offset.
    Strings = 12,
}

const NAMES: [(Section, &str); 12] = [
    (Section::Instructions, "instructions"),
    (Section::SmBegin, "sm_begin"),
    (Section::Waits, "waits"),
    (Section::Counters, "counters"),
    (Section::Tasks, "tasks"),
    (Section::Stages, "stages"),
    (Section::Params, "params"),
    (Section::WeightGroups, "weight_groups"),
    (Section::Tensors, "tensors"),
    (Section::States, "states"),
    (Section::StageNames, "stage_names"),
    (Section::Strings, "strings"),
];

/// What the header names.
#[derive(Debug, Clone)]
pub struct Identity {
    /// The model's name (the generated namespace).
    pub model: String,
    /// The target's name.
    pub target: String,
    /// Sequences per step.
    pub batch: u32,
    /// SMs the schedule uses.
    pub sms: u32,
    /// Tokens per sequence.
    pub context: u64,
}

/// Strings, each stored once.
#[derive(Default)]
struct Strings {
    bytes: Vec<u8>,
    at: std::collections::HashMap<String, u32>,
}

impl Strings {
    fn add(&mut self, s: &str) -> u32 {
        if let Some(o) = self.at.get(s) {
            return *o;
        }
        let o = self.bytes.len() as u32;
        self.bytes.extend_from_slice(s.as_bytes());
        self.bytes.push(0);
        self.at.insert(s.to_string(), o);
        o
    }
}

fn layout_code(l: GpuLayout) -> u32 {
    match l {
        GpuLayout::AsStored => 0,
        GpuLayout::MxCodes => 1,
        GpuLayout::MxScales => 2,
        GpuLayout::Fp8Bf16 => 3,
    }
}

/// FNV-1a, 64 bits.
pub fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

fn fixed(s: &str, n: usize) -> Vec<u8> {
    let mut v = s.as_bytes()[..s.len().min(n - 1)].to_vec();
    v.resize(n, 0);
    v
}

/// The plan file of a program.
pub fn write(id: &Identity, t: &DeviceTables, p: &Program, groups: &[WeightGroup], stage_names: &[String]) -> Vec<u8> {
    let mut strings = Strings::default();
    let mut sections: Vec<(Section, u32, u64, Vec<u8>)> = vec![];
    let mut push = |s: Section, elem: u32, count: usize, bytes: Vec<u8>| {
        debug_assert_eq!(bytes.len(), elem as usize * count);
        sections.push((s, elem, count as u64, bytes));
    };
    let mut b = vec![];
    for i in &t.instructions {
        b.extend(i.opcode.to_le_bytes());
        b.extend(i.n_waits.to_le_bytes());
        b.extend(i.first_wait.to_le_bytes());
        b.extend(i.signal.to_le_bytes());
        b.extend(i.task.to_le_bytes());
    }
    push(Section::Instructions, 16, t.instructions.len(), std::mem::take(&mut b));
    push(Section::SmBegin, 4, t.sm_begin.len(), t.sm_begin.iter().flat_map(|x| x.to_le_bytes()).collect());
    for (c, target) in &t.waits {
        b.extend(c.to_le_bytes());
        b.extend(target.to_le_bytes());
    }
    push(Section::Waits, 8, t.waits.len(), std::mem::take(&mut b));
    push(Section::Counters, 4, t.expected.len(), t.expected.iter().flat_map(|x| x.to_le_bytes()).collect());
    for (stage, index, a) in &p.tasks {
        b.extend((*stage as u16).to_le_bytes());
        b.extend((*index as u16).to_le_bytes());
        for x in a {
            b.extend(x.to_le_bytes());
        }
    }
    push(Section::Tasks, 20, p.tasks.len(), std::mem::take(&mut b));
    let mut params = vec![];
    for s in &p.stages {
        b.extend(s.role.to_le_bytes());
        b.extend((params.len() as u32).to_le_bytes());
        b.extend(s.load_wait.0.to_le_bytes());
        b.extend(s.load_wait.1.to_le_bytes());
        params.extend(s.params.iter().copied());
    }
    push(Section::Stages, 16, p.stages.len(), std::mem::take(&mut b));
    push(Section::Params, 8, params.len(), params.iter().flat_map(|x| x.to_le_bytes()).collect());
    let mut tensors = vec![];
    for g in groups {
        b.extend(g.var.as_deref().map_or(u32::MAX, |v| strings.add(v)).to_le_bytes());
        b.extend((g.count as u32).to_le_bytes());
        b.extend((tensors.len() as u32 / 88).to_le_bytes());
        b.extend((g.tensors.len() as u32).to_le_bytes());
        for r in &g.tensors {
            tensors.extend(strings.add(&r.key).to_le_bytes());
            tensors.extend(strings.add(r.dtype).to_le_bytes());
            tensors.extend(strings.add(&r.node).to_le_bytes());
            tensors.extend(layout_code(r.layout).to_le_bytes());
            tensors.extend((r.shape.len() as u32).to_le_bytes());
            tensors.extend(0u32.to_le_bytes());
            for d in 0..MAX_DIMS {
                tensors.extend(r.shape.get(d).copied().unwrap_or(0).to_le_bytes());
            }
        }
    }
    push(Section::WeightGroups, 16, groups.len(), std::mem::take(&mut b));
    let n_tensors = tensors.len() / 88;
    push(Section::Tensors, 88, n_tensors, tensors);
    push(Section::States, 8, p.states.len(), p.states.iter().flat_map(|(_, s)| s.to_le_bytes()).collect());
    let names: Vec<u8> = stage_names.iter().flat_map(|n| strings.add(n).to_le_bytes()).collect();
    push(Section::StageNames, 4, stage_names.len(), names);
    let n = strings.bytes.len();
    push(Section::Strings, 1, n, strings.bytes);

    // Header, section table, sections.
    let table_at = HEADER_BYTES;
    let mut at = table_at + 24 * sections.len();
    let mut offsets = vec![];
    for (_, _, _, bytes) in &sections {
        at = at.div_ceil(16) * 16;
        offsets.push(at);
        at += bytes.len();
    }
    let size = at.div_ceil(16) * 16;
    let mut f = Vec::with_capacity(size);
    f.extend_from_slice(MAGIC);
    f.extend(FORMAT.to_le_bytes());
    f.extend((sections.len() as u32).to_le_bytes());
    f.extend(fixed(env!("CARGO_PKG_VERSION"), 32));
    f.extend(fixed(&id.model, 64));
    f.extend(fixed(&id.target, 32));
    f.extend(id.batch.to_le_bytes());
    f.extend(id.sms.to_le_bytes());
    f.extend(id.context.to_le_bytes());
    f.extend((size as u64).to_le_bytes());
    f.extend(0u64.to_le_bytes()); // checksum, filled below
    f.resize(HEADER_BYTES, 0);
    for ((s, elem, count, _), off) in sections.iter().zip(&offsets) {
        f.extend((*s as u32).to_le_bytes());
        f.extend(elem.to_le_bytes());
        f.extend(count.to_le_bytes());
        f.extend((*off as u64).to_le_bytes());
    }
    for ((_, _, _, bytes), off) in sections.iter().zip(&offsets) {
        f.resize(*off, 0);
        f.extend_from_slice(bytes);
    }
    f.resize(size, 0);
    let sum = fnv1a(&f);
    f[CHECKSUM_AT..CHECKSUM_AT + 8].copy_from_slice(&sum.to_le_bytes());
    f
}

/// Where the checksum sits in the header.
pub const CHECKSUM_AT: usize = 168;

/// One entry of a plan file's section table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SectionEntry {
    /// The section's id ([`Section`]).
    pub id: u32,
    /// Bytes per record.
    pub elem: u32,
    /// Records.
    pub count: u64,
    /// Where its records start in the file.
    pub offset: u64,
}

impl SectionEntry {
    /// The section's name.
    pub fn name(&self) -> &'static str {
        NAMES.iter().find(|(s, _)| *s as u32 == self.id).map_or("?", |(_, n)| n)
    }

    /// Its bytes in `file`.
    pub fn bytes<'f>(&self, file: &'f [u8]) -> &'f [u8] {
        &file[self.offset as usize..(self.offset + self.count * u64::from(self.elem)) as usize]
    }
}

/// The section table of a plan file this module wrote.
pub fn sections(file: &[u8]) -> Vec<SectionEntry> {
    let u32_at = |at: usize| u32::from_le_bytes(file[at..at + 4].try_into().expect("4 bytes"));
    let u64_at = |at: usize| u64::from_le_bytes(file[at..at + 8].try_into().expect("8 bytes"));
    (0..u32_at(12) as usize)
        .map(|i| {
            let at = HEADER_BYTES + 24 * i;
            SectionEntry { id: u32_at(at), elem: u32_at(at + 4), count: u64_at(at + 8), offset: u64_at(at + 16) }
        })
        .collect()
}

/// A plan file's text summary: its identity, each section's count and
/// bytes, its size and sha256.
pub fn summary(file: &[u8], id: &Identity) -> String {
    let mut s = format!(
        "# The plan file of {} for {} (mkc codegen writes plan.mkcplan; the runtime reads it).\n\
         format {FORMAT}\nmodel {}\ntarget {}\nbatch {}\nsms {}\ncontext {}\n",
        id.model, id.target, id.model, id.target, id.batch, id.sms, id.context
    );
    for e in sections(file) {
        s += &format!("section {} {} x {} bytes\n", e.name(), e.count, e.elem);
    }
    let hash = Sha256::digest(file);
    let hex: String = hash.iter().map(|b| format!("{b:02x}")).collect();
    s += &format!("bytes {}\nsha256 {hex}\n", file.len());
    s
}
