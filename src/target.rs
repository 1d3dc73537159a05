//! Targets as data: one YAML file per GPU in `targets/`.
//!
//! Adding a GPU means adding a file. Every field is required except the
//! measured bandwidth; unknown fields are errors, so a typo cannot silently
//! fall back to a default.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::diag::{Error, ErrorKind, Result};

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
    /// Math rates.
    pub flops: Flops,
    /// Latency of one dependency hand-off through a global counter.
    pub sync_latency_ns: f64,
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

    /// Loads a target by file path or by name from the `targets/` folder.
    pub fn load(name_or_path: &str) -> Result<Target> {
        let path = if name_or_path.ends_with(".yaml") || name_or_path.contains('/') {
            PathBuf::from(name_or_path)
        } else {
            targets_dir().join(format!("{name_or_path}.yaml"))
        };
        let text = crate::files::read_input(&path, crate::files::Input::Target)
            .map_err(|e| e.help(format!("targets: {}", available().join(", "))))?;
        Target::parse(&text, &path.display().to_string())
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
const INT_BOUNDS: [IntBound; 8] = [
    ("sms", |t| t.sms.into(), 1, 1024),
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
const REAL_BOUNDS: [RealBound; 9] = [
    ("clock_ghz", |t| Some(t.clock_ghz), 0.1, 10.0),
    ("hbm_bandwidth.datasheet", |t| Some(t.hbm_bandwidth.datasheet), 1e9, 1e15),
    ("hbm_bandwidth.measured", |t| t.hbm_bandwidth.measured, 1e9, 1e15),
    ("nvlink_bandwidth", |t| Some(t.nvlink_bandwidth), 0.0, 1e15),
    ("flops.bf16_tensor", |t| Some(t.flops.bf16_tensor), 1e9, 1e18),
    ("flops.fp8_tensor", |t| Some(t.flops.fp8_tensor), 0.0, 1e18),
    ("flops.fp4_tensor", |t| Some(t.flops.fp4_tensor), 0.0, 1e18),
    ("flops.fp32_cuda_core", |t| Some(t.flops.fp32_cuda_core), 1e9, 1e18),
    ("sync_latency_ns", |t| Some(t.sync_latency_ns), 0.0, 1e6),
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

/// The folder holding the shipped targets.
pub fn targets_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("targets")
}

/// Names of the shipped targets.
pub fn available() -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(targets_dir())
        .map(|d| {
            d.filter_map(|e| e.ok())
                .filter_map(|e| e.file_name().to_str().and_then(|n| n.strip_suffix(".yaml")).map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}
