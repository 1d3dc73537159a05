//! Several GPUs of one NVLink domain (`mkc plan --gpus G --estimate`): the
//! estimate of one placement, the routed experts sharded G ways and
//! everything else replicated.
//!
//! Each GPU holds `E / G` of every MoE layer's routed experts and a copy of
//! every other weight; every GPU runs every sequence's attention, dense
//! layers, shared experts and router (the same tokens everywhere, so no
//! dispatch), its own experts' share of the routed tokens, and adds its
//! partial routed output to the others' in one all-reduce per MoE layer: the
//! step's only exchange. One GPU's work is the plan at `--expert-parallel G`
//! (its experts and the expected share of the distinct ones a step selects),
//! the all-reduces planned in it (`tile::Exchange`): per MoE layer one
//! exchange that sends the partial sums to every other GPU (`(G - 1) x batch
//! x width` fp32 out of each GPU; the width is the experts' output, K3's
//! latent) at the target's NVLink bandwidth, shared by the send tasks, and
//! its latency.
//!
//! Beside it, the tensor-parallel placement ([`TensorParallel`]) from bytes
//! alone: the planner does not split an operation's heads or rows over GPUs
//! yet, so its time is one GPU's share of the bytes at the efficiency the
//! replicated plan reaches, plus two all-reduces a layer. Not modelled: the
//! batch split over GPUs, and overlap of the exchanges with the weights.

use std::fmt::Write;

use serde::Serialize;

use super::estimate::{estimate, Estimate};
use super::fuse::FusedKind;
use super::tile::TaskKind;
use super::{plan, Options, Plan};
use crate::diag::{Error, ErrorKind, Result};
use crate::target::Target;
use crate::valid::Validated;

/// The estimate of one batch on `gpus` GPUs.
#[derive(Debug, Clone, Serialize)]
pub struct MultiEstimate {
    /// GPUs the routed experts are sharded over.
    pub gpus: u32,
    /// One GPU's step without the exchanges.
    pub per_gpu: Estimate,
    /// MoE layers: one all-reduce each.
    pub moe_layers: u64,
    /// Bytes each all-reduce moves out of one GPU (each GPU's part to every
    /// other GPU: the planned exchange).
    pub exchange_bytes: u64,
    /// Exchanges (latencies) each all-reduce takes.
    pub exchanges: u64,
    /// The planned exchanges' time in the step: each MoE layer's, from its
    /// first send to its last reduce, summed (partly overlapped by other
    /// work, so not all of it is on the critical path).
    pub comm_us: f64,
    /// One GPU's step, its planned exchanges included.
    pub step_us: f64,
    /// Tokens per second per user.
    pub tokens_per_s: f64,
    /// The same GPUs with attention, dense layers and shared experts split
    /// (estimated from bytes, not planned).
    pub tensor_parallel: TensorParallel,
}

/// Plans one GPU of `gpus` at `batch` and adds the exchanges.
pub fn estimate_on(v: &Validated, target: &Target, batch: u32, context: u64, gpus: u32) -> Result<MultiEstimate> {
    in_one_domain(target, gpus)?;
    let p = plan(v, target, Options { batch, context, expert_parallel: gpus, ..Default::default() })?;
    estimate_of(&p, target, gpus)
}

/// Plans one GPU of `gpus` for a speculative verify step (`batch` sequences
/// of `positions` positions, the program `codegen --positions` makes) and
/// adds the exchanges (the all-reduces carry every position's row).
pub fn estimate_verify(
    v: &Validated,
    target: &Target,
    batch: u32,
    positions: u32,
    context: u64,
    gpus: u32,
) -> Result<MultiEstimate> {
    in_one_domain(target, gpus)?;
    let rows = batch.checked_mul(positions).ok_or_else(|| {
        Error::new(ErrorKind::Limit, format!("batch {batch} x {positions} positions overflows a step's rows"))
    })?;
    let p = plan(v, target, Options { batch: rows, context, expert_parallel: gpus, positions })?;
    estimate_of(&p, target, gpus)
}

/// Whether `gpus` GPUs of `target` are one NVLink domain.
fn in_one_domain(target: &Target, gpus: u32) -> Result<()> {
    if gpus > target.nvlink_domain_gpus {
        return Err(Error::new(
            ErrorKind::Limit,
            format!(
                "--gpus {gpus}: one NVLink domain of {} joins {} GPUs (nvlink_domain_gpus)",
                target.name, target.nvlink_domain_gpus
            ),
        ));
    }
    Ok(())
}

/// The estimate on `gpus` GPUs of `p`, one GPU's plan (planned with
/// `expert_parallel` = `gpus`, its exchanges planned).
pub fn estimate_of(p: &Plan, target: &Target, gpus: u32) -> Result<MultiEstimate> {
    in_one_domain(target, gpus)?;
    let batch = p.options.batch;
    let per_gpu = estimate(p);
    let g = p.graph.graph();
    let mut moe_layers = 0u64;
    let mut hidden = 0u64;
    for op in &p.fusion.ops {
        if op.kind == FusedKind::Moe {
            moe_layers += 1;
            let anchor = op.anchor(g);
            hidden = hidden.max(g.node(anchor).outputs.first().map_or(0, |t| t.elements()));
        }
    }
    let layers =
        p.fusion.ops.iter().filter(|o| matches!(o.kind, FusedKind::MlaDecode | FusedKind::KdaDecode)).count() as u64;
    let (mut routed, mut other) = (0u64, 0u64);
    for t in &p.tiling.tasks {
        match p.tiling.stages[t.stage].kind {
            TaskKind::ExpertUp | TaskKind::ExpertDown => routed += t.weight_bytes,
            _ => other += t.weight_bytes,
        }
    }
    // The plan has each MoE layer's all-reduce as an exchange's send and
    // reduce stages (`tile::Exchange`: each GPU's part sent to every other
    // GPU, one exchange), in its step already; their time is from the first
    // send to the last reduce, each.
    let mut spans: Vec<(f64, f64)> = vec![(f64::INFINITY, 0.0); p.tiling.stages.len()];
    for i in p.schedule.sms.iter().flatten() {
        let stage = &p.tiling.stages[i.stage];
        if let Some(x) = stage.exchange {
            let span = &mut spans[x.send];
            *span = (span.0.min(i.start_ns), span.1.max(i.end_ns));
        }
    }
    let comm_us = spans.iter().filter(|s| s.1 > 0.0).map(|s| (s.1 - s.0) / 1e3).sum::<f64>();
    let step_us = per_gpu.step_us;
    // The tensor-parallel estimate's chain of stages: the one-GPU program's
    // (its own all-reduces are counted apart).
    let stages = p.tiling.stages.iter().filter(|s| s.exchange.is_none()).count() as u64;
    let shape = Shape { gpus, hidden, layers, stages, routed, other };
    let tensor_parallel = tensor_parallel(&per_gpu, target, shape);
    Ok(MultiEstimate {
        gpus,
        per_gpu,
        moe_layers,
        exchange_bytes: u64::from(gpus.saturating_sub(1)) * u64::from(batch) * hidden * 4,
        exchanges: u64::from(gpus > 1),
        comm_us,
        step_us,
        tokens_per_s: if step_us > 0.0 { 1e6 / step_us } else { 0.0 },
        tensor_parallel,
    })
}

/// The time of one all-reduce of `values` bytes over `gpus` GPUs (the
/// tensor-parallel estimate's), in ns: the cheaper of one exchange sending
/// them to every other GPU and a reduce-scatter and all-gather (two exchanges
/// of `2 (G - 1) / G` of them).
fn all_reduce_ns(target: &Target, gpus: u32, values: u64) -> f64 {
    let g = u64::from(gpus);
    if g <= 1 {
        return 0.0;
    }
    let form = |bytes: u64, exchanges: u64| {
        exchanges as f64 * target.nvlink_latency_ns + bytes as f64 / target.nvlink_bandwidth * 1e9
    };
    form((g - 1) * values, 1).min(form((2 * (g - 1) * values).div_ceil(g), 2))
}

/// What the tensor-parallel estimate needs of the replicated plan.
struct Shape {
    gpus: u32,
    /// The MoE output's width, the all-reduced values per token.
    hidden: u64,
    /// Attention layers: two all-reduces each.
    layers: u64,
    /// The plan's stages, each at least one task's fixed cost and one hand-off.
    stages: u64,
    /// One GPU's routed experts' bytes, and every other weight's.
    routed: u64,
    other: u64,
}

/// The tensor-parallel placement's estimate from bytes (not planned): every
/// weight but the routed experts', and the state, split `gpus` ways (heads,
/// rows, the LM head's vocabulary), the routed experts sharded as in
/// [`estimate_on`]; one GPU's bytes over the bandwidth at the efficiency its
/// replicated plan reaches (`per_gpu.fraction_of_floor`), but no less than
/// the chain of the plan's stages at one task's fixed cost and one hand-off
/// each, plus two all-reduces of `batch x hidden` fp32 per layer (attention
/// output, then the MLP's or the experts' and shared experts' output).
#[derive(Debug, Clone, Serialize)]
pub struct TensorParallel {
    /// One GPU's bytes per step: its share of the weights and state.
    pub bytes: u64,
    /// The efficiency taken from the replicated plan.
    pub efficiency: f64,
    /// The floor of the dependent stages: each at least one task's fixed cost
    /// and one hand-off, however small its share.
    pub chain_us: f64,
    /// Layers: two all-reduces each.
    pub layers: u64,
    /// The exchanges of a step.
    pub comm_us: f64,
    /// One GPU's step with its exchanges.
    pub step_us: f64,
    /// Tokens per second per user.
    pub tokens_per_s: f64,
}

/// The tensor-parallel estimate beside the replicated placement's plan of one GPU.
fn tensor_parallel(per_gpu: &Estimate, target: &Target, s: Shape) -> TensorParallel {
    let g = u64::from(s.gpus.max(1));
    let bytes = s.routed + s.other.div_ceil(g) + per_gpu.state_bytes.div_ceil(g);
    let efficiency = per_gpu.fraction_of_floor.clamp(0.01, 1.0);
    let chain_us = s.stages as f64 * (target.task_overhead_ns + target.sync_latency_ns) / 1e3;
    let compute_us = (bytes as f64 / target.read_bandwidth() * 1e6 / efficiency).max(chain_us);
    let comm_us = 2.0 * s.layers as f64 * all_reduce_ns(target, s.gpus, u64::from(per_gpu.batch) * s.hidden * 4) / 1e3;
    let step_us = compute_us + comm_us;
    let tokens_per_s = if step_us > 0.0 { 1e6 / step_us } else { 0.0 };
    TensorParallel { bytes, efficiency, chain_us, layers: s.layers, comm_us, step_us, tokens_per_s }
}

/// What the estimate assumes, printed once.
pub fn assumptions(target: &Target, gpus: u32) -> String {
    format!(
        "assumptions ({gpus} GPUs of one {} NVLink domain): each MoE layer's routed experts sharded {gpus} ways; every \
         other weight, all state and every sequence's attention, dense layers, shared experts and router on every GPU; \
         one all-reduce of the routed experts' partial sums per MoE layer, planned as an exchange (each GPU's part \
         to every other GPU) at {:.0} GB/s per GPU and {:.1} us per exchange (nvlink_bandwidth, nvlink_latency_ns); \
         tensor parallelism (estimated from bytes) and the batch split not planned; no speculative decoding unless \
         --speculative says so",
        target.name,
        target.nvlink_bandwidth / 1e9,
        target.nvlink_latency_ns / 1e3
    )
}

/// The line `--speculative` adds for one batch on several GPUs: the verify
/// step (`verify`, planned with its positions) against the plain step
/// (`plain`), both placements, in tokens/s per user.
pub fn render_speculative(
    plain: &MultiEstimate,
    verify: std::result::Result<&MultiEstimate, &str>,
    s: super::estimate::Speculation,
) -> String {
    let gain = s.expected_tokens();
    let per_user = |us: f64| if us > 0.0 { gain * 1e6 / us } else { 0.0 };
    let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { 0.0 };
    match verify {
        Ok(v) => {
            let (ep, tp) = (per_user(v.step_us), per_user(v.tensor_parallel.step_us));
            format!(
                "batch {} on {} GPUs, speculative {} positions at acceptance {:.2} ({:.2} tokens per verify step): \
                 experts sharded, verify step {:.1} us, {:.1} tokens/s per user ({:.2}x plain decoding's {:.1}); tensor \
                 parallel (from bytes), verify step {:.1} us, {:.1} tokens/s per user ({:.2}x plain decoding's {:.1})\n",
                plain.per_gpu.batch,
                plain.gpus,
                s.tokens,
                s.acceptance,
                gain,
                v.step_us,
                ep,
                ratio(ep, plain.tokens_per_s),
                plain.tokens_per_s,
                v.tensor_parallel.step_us,
                tp,
                ratio(tp, plain.tensor_parallel.tokens_per_s),
                plain.tensor_parallel.tokens_per_s
            )
        }
        Err(why) => format!(
            "batch {} on {} GPUs, speculative {} positions: not estimated: a verify step of {} positions is {why}\n",
            plain.per_gpu.batch,
            plain.gpus,
            s.tokens,
            u64::from(plain.per_gpu.batch) * u64::from(s.tokens)
        ),
    }
}

/// The lines of one batch.
pub fn render(m: &MultiEstimate) -> String {
    let mut s = String::new();
    let e = &m.per_gpu;
    let _ = writeln!(
        s,
        "batch {} on {} GPUs: one GPU's step {:.1} us ({:.0}% of its floor {:.1} us), its {} planned all-reduces \
         (each {} out of a GPU in {} exchange{}) spanning {:.1} us of it, {:.1} tokens/s per user",
        e.batch,
        m.gpus,
        m.step_us,
        100.0 * e.fraction_of_floor,
        e.floor_us,
        m.moe_layers,
        crate::report::bytes(m.exchange_bytes),
        m.exchanges,
        if m.exchanges == 1 { "" } else { "s" },
        m.comm_us,
        m.tokens_per_s
    );
    let t = &m.tensor_parallel;
    let _ = writeln!(
        s,
        "batch {} on {} GPUs, tensor parallel (from bytes, not planned): {} a GPU at {:.0}% of the bandwidth, \
         at least {:.1} us for the dependent stages: {:.1} us + {} all-reduces {:.1} us = {:.1} us, {:.1} tokens/s \
         per user",
        e.batch,
        m.gpus,
        crate::report::bytes(t.bytes),
        100.0 * t.efficiency,
        t.chain_us,
        t.step_us - t.comm_us,
        2 * t.layers,
        t.comm_us,
        t.step_us,
        t.tokens_per_s
    );
    s
}
