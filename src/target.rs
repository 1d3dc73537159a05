//! Targets as data: one YAML file per GPU in `targets/`.
//!
//! Adding a GPU means adding a file. Every field is required except the
//! measured bandwidth; unknown fields are errors, so a typo cannot silently
//! fall back to a default.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::diag::{Error, ErrorKind, Result};
use crate::plan::schedule::TASK_OVERHEAD_NS;

/// HBM bandwidth in bytes per second.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Bandwidth {
    /// The datasheet number.
    pub datasheet: f64,
    /// What a read-bound kernel reached on the real part, if measured.
    #[serde(default)]
    pub measured: Option<f64>,
}

/// Dense math rates in operations per second.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Flops {
    /// bf16 tensor-core MMA.
    pub bf16_tensor: f64,
    /// FP8 tensor-core MMA.
    pub fp8_tensor: f64,
    /// Native block-scaled FP4 MMA (0 where the hardware has none).
    pub fp4_tensor: f64,
    /// fp32 FMA on CUDA cores (2 flops each).
    pub fp32_cuda_core: f64,
}

/// One GPU.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Target {
    /// Short name (`h200`).
    pub name: String,
    /// The nvcc architecture (`sm_90a`, `sm_100a`, `sm_103a`).
    pub arch: String,
    /// Streaming multiprocessors.
    pub sms: u32,
    /// SM clock.
    pub clock_ghz: f64,
    /// Shared memory per SM.
    pub smem_per_sm: u64,
    /// Shared memory one block may use.
    pub smem_per_block: u64,
    /// 32-bit registers per SM.
    pub regs_per_sm: u32,
    /// Threads per block.
    pub max_threads_per_block: u32,
    /// Tensor memory per SM (Blackwell), 0 if none.
    pub tensor_memory_per_sm: u64,
    /// L2 cache.
    pub l2_bytes: u64,
    /// HBM capacity.
    pub hbm_bytes: u64,
    /// HBM bandwidth.
    pub hbm_bandwidth: Bandwidth,
    /// NVLink bandwidth per GPU, one direction.
    pub nvlink_bandwidth: f64,
    /// GPUs one NVLink domain joins (all-to-all through NVSwitch); 1: none.
    #[serde(default = "one")]
    pub nvlink_domain_gpus: u32,
    /// Latency of one exchange between GPUs of the domain: a write to another
    /// GPU's memory and its signal seen there (an assumption where not measured).
    #[serde(default = "exchange_latency")]
    pub nvlink_latency_ns: f64,
    /// Math rates.
    pub flops: Flops,
    /// Latency of one dependency hand-off through a global counter.
    pub sync_latency_ns: f64,
    /// Fixed cost of one task (its waits, first pages, prologue and epilogue
    /// barriers, publish), fitted to the card's per-stage traces; default
    /// [`TASK_OVERHEAD_NS`].
    #[serde(default = "task_overhead")]
    pub task_overhead_ns: f64,
}

fn task_overhead() -> f64 {
    TASK_OVERHEAD_NS
}

fn one() -> u32 {
    1
}

fn exchange_latency() -> f64 {
    2000.0
}

impl Target {
    /// Parses a target file's text; `origin` names it in errors.
    pub fn parse(text: &str, origin: &str) -> Result<Target> {
        let t: Target = serde_yaml::from_str(text).map_err(|e| {
            let place = e.location().map(|l| format!(" (line {}, column {})", l.line(), l.column()));
            Error::new(ErrorKind::Config, format!("target {origin}: {e}{}", place.unwrap_or_default()))
        })?;
        t.check(origin)?;
        Ok(t)
    }

    /// Loads a target by name (one of [`BUILTIN`], compiled into the binary)
    /// or by path: a path if it contains `/` or ends in `.yaml` or `.yml`.
    /// An unknown name is answered with the closest name and the list.
    pub fn load(name_or_path: &str) -> Result<Target> {
        if is_path(name_or_path) {
            let text = crate::files::read_input(std::path::Path::new(name_or_path), crate::files::Input::Target)
                .map_err(|e| e.help(format!("a target is a name ({}) or a YAML file", names().join(", "))))?;
            return Target::parse(&text, name_or_path);
        }
        match BUILTIN.iter().find(|(n, _)| *n == name_or_path) {
            Some((name, text)) => Target::parse(text, name),
            None => {
                let guess = closest(name_or_path, &names());
                let hint = guess.map_or_else(|| ";".to_string(), |g| format!("; did you mean {g}?"));
                Err(Error::new(
                    ErrorKind::Config,
                    format!("unknown target {name_or_path}{hint} targets: {}", names().join(", ")),
                )
                .help("`mkc targets` lists them with their numbers; a path to a YAML file names your own"))
            }
        }
    }

    /// Every built-in target, parsed, in name order.
    pub fn builtin() -> Result<Vec<Target>> {
        BUILTIN.iter().map(|(name, text)| Target::parse(text, name)).collect()
    }

    fn check(&self, origin: &str) -> Result<()> {
        let bad =
            |field: &str, why: &str| Err(Error::new(ErrorKind::Config, format!("target {origin}: `{field}` {why}")));
        if !matches!(self.arch.as_str(), "sm_90a" | "sm_100a" | "sm_103a") {
            return bad("arch", "must be sm_90a, sm_100a or sm_103a");
        }
        if self.name.is_empty() || !self.name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-') {
            return bad("name", "must be letters, digits, `_` or `-`");
        }
        for (field, value, lo, hi) in INT_BOUNDS.iter().map(|(f, get, lo, hi)| (f, get(self), lo, hi)) {
            if !(*lo..=*hi).contains(&value) {
                return bad(field, &format!("is {value}; it must be in {lo}..={hi}"));
            }
        }
        for (field, value, lo, hi) in REAL_BOUNDS.iter().map(|(f, get, lo, hi)| (f, get(self), lo, hi)) {
            if let Some(v) = value {
                // NaN fails both comparisons.
                if !(v >= *lo && v <= *hi) {
                    return bad(
                        field,
                        &format!("is {}; it must be a number in {}..={}", real(v), real(*lo), real(*hi)),
                    );
                }
            }
        }
        if self.smem_per_block > self.smem_per_sm {
            return bad("smem_per_block", "must be at most smem_per_sm");
        }
        Ok(())
    }

    /// The read bandwidth the cost model uses: measured if known, else the datasheet.
    pub fn read_bandwidth(&self) -> f64 {
        self.hbm_bandwidth.measured.unwrap_or(self.hbm_bandwidth.datasheet)
    }
}

/// A whole-number field of a target and its accepted range.
type IntBound = (&'static str, fn(&Target) -> u64, u64, u64);

/// The physical ranges of the whole-number fields: generous around today's
/// parts, tight enough that nothing sized from them (per-SM tables, the
/// schedule) can exhaust memory or overflow.
const INT_BOUNDS: [IntBound; 9] = [
    ("sms", |t| t.sms.into(), 1, 1024),
    ("nvlink_domain_gpus", |t| t.nvlink_domain_gpus.into(), 1, 1024),
    ("smem_per_sm", |t| t.smem_per_sm, 1 << 10, 4 << 20),
    ("smem_per_block", |t| t.smem_per_block, 1 << 10, 4 << 20),
    ("regs_per_sm", |t| t.regs_per_sm.into(), 1 << 10, 1 << 20),
    ("max_threads_per_block", |t| t.max_threads_per_block.into(), 128, 1024),
    ("tensor_memory_per_sm", |t| t.tensor_memory_per_sm, 0, 16 << 20),
    ("l2_bytes", |t| t.l2_bytes, 1 << 20, 16 << 30),
    ("hbm_bytes", |t| t.hbm_bytes, 1 << 30, 1 << 45),
];

/// A real-valued field of a target (`None`: not given) and its accepted range.
type RealBound = (&'static str, fn(&Target) -> Option<f64>, f64, f64);

/// The ranges of the real-valued fields: finite, and positive where the cost
/// model divides by them (a zero `fp4_tensor` means no native FP4 MMA).
const REAL_BOUNDS: [RealBound; 11] = [
    ("clock_ghz", |t| Some(t.clock_ghz), 0.1, 10.0),
    ("hbm_bandwidth.datasheet", |t| Some(t.hbm_bandwidth.datasheet), 1e9, 1e15),
    ("hbm_bandwidth.measured", |t| t.hbm_bandwidth.measured, 1e9, 1e15),
    ("nvlink_bandwidth", |t| Some(t.nvlink_bandwidth), 0.0, 1e15),
    ("nvlink_latency_ns", |t| Some(t.nvlink_latency_ns), 0.0, 1e6),
    ("flops.bf16_tensor", |t| Some(t.flops.bf16_tensor), 1e9, 1e18),
    ("flops.fp8_tensor", |t| Some(t.flops.fp8_tensor), 0.0, 1e18),
    ("flops.fp4_tensor", |t| Some(t.flops.fp4_tensor), 0.0, 1e18),
    ("flops.fp32_cuda_core", |t| Some(t.flops.fp32_cuda_core), 1e9, 1e18),
    ("sync_latency_ns", |t| Some(t.sync_latency_ns), 0.0, 1e6),
    ("task_overhead_ns", |t| Some(t.task_overhead_ns), 0.0, 1e6),
];

/// A number as a target file would write it: whole numbers under a million
/// as they are, others with an exponent.
fn real(x: f64) -> String {
    if !x.is_finite() || (x.fract() == 0.0 && x.abs() < 1e6) {
        format!("{x}")
    } else {
        format!("{x:e}")
    }
}

/// The shipped targets, `(name, YAML text)` in name order, compiled into the
/// binary so that a copy of it outside the checkout knows them.
pub const BUILTIN: [(&str, &str); 3] = [
    ("b200", include_str!("../targets/b200.yaml")),
    ("gb300", include_str!("../targets/gb300.yaml")),
    ("h200", include_str!("../targets/h200.yaml")),
];

/// The targets as `mkc targets` prints them: one a line with its key numbers.
pub fn table(targets: &[Target]) -> String {
    use crate::report::bytes;
    use std::fmt::Write;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{:<8} {:<8} {:>5} {:>9} {:>11} {:>9} {:>10} {:>10} {:>10}",
        "target", "arch", "SMs", "HBM", "bandwidth", "L2", "smem/SM", "bf16", "NVLink"
    );
    for t in targets {
        let measured = t.hbm_bandwidth.measured.map_or(String::new(), |m| format!(" ({:.2} measured)", m / 1e12));
        let _ = writeln!(
            s,
            "{:<8} {:<8} {:>5} {:>9} {:>11} {:>9} {:>10} {:>10} {:>10}{measured}",
            t.name,
            t.arch,
            t.sms,
            bytes(t.hbm_bytes),
            format!("{:.2} TB/s", t.hbm_bandwidth.datasheet / 1e12),
            bytes(t.l2_bytes),
            bytes(t.smem_per_sm),
            format!("{:.0} TF/s", t.flops.bf16_tensor / 1e12),
            format!("{:.2} TB/s", t.nvlink_bandwidth / 1e12),
        );
    }
    let _ = writeln!(
        s,
        "HBM, L2 and shared memory in decimal units; bandwidth: HBM datasheet (measured, where known); \
         bf16: dense tensor-core rate; NVLink: per GPU, one direction"
    );
    s
}

/// Whether `--target` names a file rather than a built-in target.
pub fn is_path(name_or_path: &str) -> bool {
    name_or_path.contains('/') || name_or_path.ends_with(".yaml") || name_or_path.ends_with(".yml")
}

/// The folder holding the shipped targets' sources (the binary embeds them).
pub fn targets_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("targets")
}

/// Names of the built-in targets.
pub fn names() -> Vec<&'static str> {
    BUILTIN.iter().map(|(n, _)| *n).collect()
}

/// The name of `names` closest to `word` by edit distance, if any is within
/// a third of the word's length (at least 1): `gb200` finds `gb300`.
fn closest<'a>(word: &str, names: &[&'a str]) -> Option<&'a str> {
    let limit = (word.chars().count().div_ceil(3)).max(1);
    names
        .iter()
        .map(|n| (edit_distance(word, n), std::cmp::Reverse(common_prefix(word, n)), *n))
        .filter(|(d, _, _)| *d <= limit)
        .min()
        .map(|(_, _, n)| n)
}

/// Characters `a` and `b` share at their start: of names at the same
/// distance, the one that starts alike is the likelier meant.
fn common_prefix(a: &str, b: &str) -> usize {
    a.chars().zip(b.chars()).take_while(|(x, y)| x == y).count()
}

/// Levenshtein distance, by characters.
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diag = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let next = (diag + usize::from(ca != *cb)).min(row[j] + 1).min(row[j + 1] + 1);
            diag = row[j + 1];
            row[j + 1] = next;
        }
    }
    row[b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtin_names_match_their_files() {
        for t in Target::builtin().unwrap() {
            assert!(names().contains(&t.name.as_str()));
        }
        let on_disk = std::fs::read_dir(targets_dir()).unwrap().count();
        assert_eq!(on_disk, BUILTIN.len(), "every file in targets/ is built in");
    }

    #[test]
    fn closest_name() {
        assert_eq!(closest("gb200", &names()), Some("gb300"));
        assert_eq!(closest("h100", &names()), Some("h200"));
        assert_eq!(closest("mi300x", &names()), None);
        assert_eq!(edit_distance("kitten", "sitting"), 3);
    }
}
