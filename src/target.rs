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
        let text = std::fs::read_to_string(&path).map_err(|e| {
            Error::new(ErrorKind::Io, format!("cannot read target {}: {e}", path.display()))
                .help(format!("targets: {}", available().join(", ")))
        })?;
        Target::parse(&text, &path.display().to_string())
    }

    fn check(&self, origin: &str) -> Result<()> {
        let bad =
            |field: &str, why: &str| Err(Error::new(ErrorKind::Config, format!("target {origin}: `{field}` {why}")));
        if !matches!(self.arch.as_str(), "sm_90a" | "sm_100a" | "sm_103a") {
            return bad("arch", "must be sm_90a, sm_100a or sm_103a");
        }
        if self.sms == 0 {
            return bad("sms", "must be positive");
        }
        if self.smem_per_block == 0 || self.smem_per_block > self.smem_per_sm {
            return bad("smem_per_block", "must be positive and at most smem_per_sm");
        }
        if self.max_threads_per_block < 128 || self.regs_per_sm == 0 {
            return bad("max_threads_per_block", "must be at least 128 (and regs_per_sm positive)");
        }
        let positive = |x: f64| x.is_finite() && x > 0.0;
        if !positive(self.hbm_bandwidth.datasheet) || self.hbm_bandwidth.measured.is_some_and(|m| !positive(m)) {
            return bad("hbm_bandwidth", "must be positive");
        }
        if !(positive(self.flops.bf16_tensor) && positive(self.flops.fp32_cuda_core) && positive(self.clock_ghz)) {
            return bad("flops", "bf16_tensor, fp32_cuda_core and clock_ghz must be positive");
        }
        if !self.sync_latency_ns.is_finite() || self.sync_latency_ns < 0.0 {
            return bad("sync_latency_ns", "must not be negative");
        }
        Ok(())
    }

    /// The read bandwidth the cost model uses: measured if known, else the datasheet.
    pub fn read_bandwidth(&self) -> f64 {
        self.hbm_bandwidth.measured.unwrap_or(self.hbm_bandwidth.datasheet)
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
