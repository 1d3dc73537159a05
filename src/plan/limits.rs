//! The device library's limits, checked by the planner: every fused
//! operation is compared with what its device function can hold and compute
//! (device/mkc/contract.h, read into `crate::contract`), and one it cannot run
//! is refused with the graph span of the operation's anchor, before any code
//! is generated. The emitter then renders only operations that fit.
//!
//! Two checks:
//! - [`check`] (in [`super::plan`], after tiling): the sizes the device holds
//!   in registers, shared memory and scratch: MLA rows and heads per task,
//!   the KDA head size, the attention-residual bank and its partial sums,
//!   router groups, expert choices per step, MXFP4 tiles and blocks. A plan
//!   that exceeds one is never made.
//! - [`computable`] (at the start of code generation): the arithmetic each
//!   device function implements: router scoring, the KDA gate, the experts'
//!   activation and weight types. A model the library does not compute yet
//!   (K2's FP8 experts) still plans, for its estimates and plan views.
//!
//! What depends on how fusion arranged an operation's nodes (which prologue
//! or epilogue a projection has) is refused by the emitter, which walks them.

use crate::contract::{
    ACTIVATION_BYTES, CONSUMER_WARPS, FP8_ALIGN, MAX_BANK_ROWS, MAX_KDA_DIM, MAX_MLA_HEADS, MAX_POSITIONS,
    MLA_MAX_LATENT, MLA_MAX_ROW, MOE_MAX_CHOICES, MX_BLOCK, MX_TILE_ROWS, ROUTER_MAX_GROUPS, SCRATCH_BYTES,
};
use crate::diag::{Error, ErrorKind, Result};
use crate::ir::{DType, Graph, NodeId, NodeKind};
use crate::ops::Attrs;
use crate::ops::OpKind;

use super::fuse::{FusedKind, FusedOp, Fusion};
use super::tile::{TaskArgs, Tiling};
use super::{Options, Plan};

/// Checks the sizes of every fused operation of `fusion`, tiled as
/// `tiling`, against the device library; the first that does not fit is
/// refused at its anchor.
pub fn check(g: &Graph, fusion: &Fusion, tiling: &Tiling, opts: Options) -> Result<()> {
    positions(g, fusion, opts)?;
    each(g, fusion, tiling, opts, |c, op, anchor, attrs| match op.kind {
        FusedKind::MlaDecode => c.mla(anchor, attrs),
        FusedKind::KdaDecode => c.kda(attrs),
        FusedKind::AttnRes => c.attn_res(anchor),
        FusedKind::Router => c.router(anchor, attrs),
        FusedKind::Moe => c.moe(anchor),
        FusedKind::Projection | FusedKind::LmHead => c.projection(anchor),
        _ => Ok(()),
    })
}

/// The planner's bound on one stage's tasks (plan tables hold 32-bit
/// indices; a real model's largest stage has a few hundred).
pub const MAX_STAGE_TASKS: u64 = 1 << 20;

/// What must hold before the tiling, whose task counts grow with the
/// config's sizes: a MoE layer's choices a step (`batch x top_k`, the device's
/// [`MOE_MAX_CHOICES`]; its expert stages have a part per choice) and an MLA
/// layer's split tasks (head groups x KV splits, [`MAX_STAGE_TASKS`]). A
/// config past them is refused at the operation's line before the tiling
/// makes millions of tasks.
pub fn before_tiling(g: &Graph, fusion: &Fusion, target: &crate::target::Target, opts: Options) -> Result<()> {
    for op in &fusion.ops {
        let anchor = op.anchor(g);
        let Some((kind, attrs)) = g.op(anchor) else { continue };
        let what = match (op.kind, kind) {
            (FusedKind::Moe, OpKind::Moe) => {
                let k = g.value_type(g.operands(anchor)[1]).elements();
                let choices = u64::from(opts.batch).saturating_mul(k);
                (choices > MOE_MAX_CHOICES)
                    .then(|| format!("at most {MOE_MAX_CHOICES} choices per step ({choices} here: batch x top-k)"))
            }
            (FusedKind::MlaDecode, OpKind::MlaDecode) => {
                let heads = attrs.int("heads").max(1) as u64;
                let (groups, _, splits) = super::tile::mla_split_shape(heads, opts.context, target.sms);
                let tasks = groups.saturating_mul(splits);
                (tasks > MAX_STAGE_TASKS).then(|| {
                    format!("an MLA split of at most {MAX_STAGE_TASKS} tasks ({tasks} here for {heads} heads)")
                })
            }
            _ => None,
        };
        if let Some(what) = what {
            return Err(Error::new(
                ErrorKind::Invalid,
                format!(
                    "fused operation {} ({}) needs {what}, which the device library does not compute",
                    op.id, op.name
                ),
            )
            .at(g.node(anchor).span)
            .label(format!("fused operation {}", op.id)));
        }
    }
    Ok(())
}

/// A verify step (`opts.positions` > 1 rows a sequence): the batch is whole
/// sequences of at most [`MAX_POSITIONS`] positions. The device library takes
/// a sequence's positions in the per-sequence state it has: MLA's cache
/// causally (ops/mla.cuh), KDA's recurrent state and the short convs' windows
/// step by step, logged and committed to the positions each sequence keeps
/// (ops/kda.cuh, ops/epilogue.cuh). Any other operation that keeps state is
/// refused at its line.
fn positions(g: &Graph, fusion: &Fusion, opts: Options) -> Result<()> {
    let p = opts.positions;
    if p == 1 {
        return Ok(());
    }
    if p == 0 || u64::from(p) > MAX_POSITIONS || !opts.batch.is_multiple_of(p) {
        return Err(Error::new(
            ErrorKind::Limit,
            format!(
                "a verify step of {p} positions a sequence at batch {} (1 to {MAX_POSITIONS} positions, the batch \
                 whole sequences of them)",
                opts.batch
            ),
        ));
    }
    for op in fusion.ops.iter().filter(|op| !matches!(op.kind, FusedKind::MlaDecode | FusedKind::KdaDecode)) {
        let stateful = op.nodes.iter().find(|n| {
            let id = NodeId::at(**n);
            !matches!(g.op(id), Some((OpKind::ConvUpdate, _)))
                && g.operands(id).iter().any(|v| matches!(g.node(v.node).kind, NodeKind::State(_)))
        });
        if let Some(n) = stateful {
            return Err(Error::new(
                ErrorKind::Invalid,
                format!(
                    "fused operation {} ({}) keeps per-sequence state, which a verify step of {p} positions would \
                     have to step through position by position; the device library does so for MLA's cache, KDA's \
                     recurrent state and the short convolutions' windows only",
                    op.id, op.name
                ),
            )
            .at(g.node(NodeId::at(*n)).span)
            .label(format!("fused operation {}", op.id)));
        }
    }
    Ok(())
}

/// Checks that the device library computes the arithmetic of every fused
/// operation of `plan`; the first it does not is refused at its anchor.
pub fn computable(plan: &Plan) -> Result<()> {
    each(plan.graph.graph(), &plan.fusion, &plan.tiling, plan.options, |c, op, anchor, attrs| match op.kind {
        FusedKind::KdaDecode => c.kda_gate(anchor, attrs),
        FusedKind::Router => match attrs.str("scoring") {
            "sigmoid" => Ok(()),
            other => Err(format!("router scoring \"{other}\"")),
        },
        FusedKind::Moe => c.expert_kind(anchor, attrs).map(|_| ()),
        FusedKind::MlaDecode => c.mla_weights(anchor),
        _ => Ok(()),
    })
}

/// Runs `lacks` on every fused operation built around an op of its kind.
fn each(
    g: &Graph,
    fusion: &Fusion,
    tiling: &Tiling,
    opts: Options,
    lacks: impl Fn(&Check, &FusedOp, NodeId, &Attrs) -> Lacks,
) -> Result<()> {
    let mut stages: Vec<Vec<usize>> = vec![vec![]; fusion.ops.len()];
    for s in &tiling.stages {
        stages[s.op].push(s.id);
    }
    for op in &fusion.ops {
        let c = Check { g, tiling, batch: u64::from(opts.batch), stages: &stages[op.id] };
        let anchor = op.anchor(g);
        let Some((kind, attrs)) = g.op(anchor) else { continue };
        if FusedKind::of_anchor(kind) != Some(op.kind) {
            continue;
        }
        lacks(&c, op, anchor, attrs).map_err(|what| {
            Error::new(
                ErrorKind::Invalid,
                format!(
                    "fused operation {} ({}) needs {what}, which the device library does not compute",
                    op.id, op.name
                ),
            )
            .at(g.node(anchor).span)
            .label(format!("fused operation {}", op.id))
        })?;
    }
    Ok(())
}

/// One fused operation's checks; each returns what the device lacks.
struct Check<'a> {
    g: &'a Graph,
    tiling: &'a Tiling,
    batch: u64,
    /// The operation's stages, in order.
    stages: &'a [usize],
}

type Lacks = std::result::Result<(), String>;

impl Check<'_> {
    fn mla(&self, n: NodeId, attrs: &Attrs) -> Lacks {
        let ops = self.g.operands(n);
        let (nope, rope, v_dim) = (attrs.int("nope") as u64, attrs.int("rope") as u64, attrs.int("v_dim") as u64);
        let c = self.g.value_type(ops[1]).elements();
        let Some((_, hpt, _)) = self.stages.first().and_then(|s| self.tiling.stages[*s].mla_split) else {
            return Err("an MLA split the tiling did not shape".into());
        };
        // The split's scratch: its heads' absorbed queries and RoPE parts (fp32;
        // the step's new rows go in the staging area after the softmax state, up
        // to kMaxPositions of them: ops/mla.cuh's static check); the combine's
        // activation area: the latent output and W_UV's result.
        let scratch = 4 * hpt * (c + rope);
        let combine = 4 * self.batch * (c + v_dim);
        if scratch > SCRATCH_BYTES {
            return Err(format!("MLA scratch of {scratch} bytes for {hpt} heads a task (at most {SCRATCH_BYTES})"));
        }
        if combine > ACTIVATION_BYTES {
            return Err(format!("an MLA combine staging of {combine} bytes (at most {ACTIVATION_BYTES})"));
        }
        // The absorption stages its heads' no-PE queries of every token in the activation area.
        let absorbed_heads = self
            .stages
            .first()
            .map(|s| {
                self.tiling.stages[*s]
                    .tasks
                    .iter()
                    .map(|t| match self.tiling.tasks[*t].args {
                        TaskArgs::Heads { h0, h1 } => u64::from(h1.saturating_sub(h0)),
                        _ => 0,
                    })
                    .max()
                    .unwrap_or(0)
            })
            .unwrap_or(0);
        let queries = 4 * self.batch * absorbed_heads * nope;
        if queries > ACTIVATION_BYTES {
            return Err(format!(
                "MLA no-PE queries of {queries} bytes at batch {} for {absorbed_heads} heads an absorption task \
                 (at most {ACTIVATION_BYTES})",
                self.batch
            ));
        }
        if !c.is_multiple_of(8) || !rope.is_multiple_of(8) || c > MLA_MAX_LATENT || c + rope > MLA_MAX_ROW {
            return Err(format!(
                "an MLA latent width of {c} and RoPE width of {rope} (multiples of 8, the latent at most \
                 {MLA_MAX_LATENT}, together at most {MLA_MAX_ROW}: the split's lanes hold a cache row in registers)"
            ));
        }
        if !nope.is_multiple_of(4) {
            return Err(format!("an MLA no-PE width of {nope} (a multiple of 4)"));
        }
        if hpt > MAX_MLA_HEADS {
            return Err(format!("{hpt} MLA heads per task (at most {MAX_MLA_HEADS})"));
        }
        Ok(())
    }

    fn kda(&self, attrs: &Attrs) -> Lacks {
        let d = attrs.int("head_dim") as u64;
        if !d.is_multiple_of(4) || d > MAX_KDA_DIM {
            return Err(format!("KDA head size {d} (a multiple of 4, at most {MAX_KDA_DIM})"));
        }
        Ok(())
    }

    fn kda_gate(&self, n: NodeId, attrs: &Attrs) -> Lacks {
        match attrs.str("gate") {
            "softplus" | "safe" => {}
            other => return Err(format!("KDA gate \"{other}\"")),
        }
        let ops = self.g.operands(n);
        for (i, what) in [(5usize, "A_log"), (6, "dt_bias")] {
            if self.g.value_type(ops[i]).dtype != DType::F32 {
                return Err(format!("KDA {what} that is not f32"));
            }
        }
        Ok(())
    }

    fn attn_res(&self, n: NodeId) -> Lacks {
        let ops = self.g.operands(n);
        let hidden = self.g.value_type(ops[0]).elements();
        let rows = self.g.value_type(ops[1]).elements() / hidden.max(1);
        if rows > MAX_BANK_ROWS {
            return Err(format!("an attention-residual bank of {rows} rows (at most {MAX_BANK_ROWS})"));
        }
        if !hidden.is_multiple_of(4) {
            return Err(format!("an attention-residual mix of rows of {hidden} (a multiple of 4)"));
        }
        // attn_res_mix's partial sums: the consumer warps' [batch][bank rows + 1] scores, twice.
        let scratch = CONSUMER_WARPS * self.batch * (MAX_BANK_ROWS + 1) * 2 * 4;
        if scratch > SCRATCH_BYTES {
            let most = SCRATCH_BYTES / (CONSUMER_WARPS * (MAX_BANK_ROWS + 1) * 2 * 4);
            return Err(format!(
                "an attention-residual mix at batch {} ({scratch} bytes of partial sums, at most {SCRATCH_BYTES}: \
                 batch {most} at most)",
                self.batch
            ));
        }
        Ok(())
    }

    fn router(&self, n: NodeId, attrs: &Attrs) -> Lacks {
        let e = self.g.value_type(self.g.operands(n)[0]).elements();
        let n_group = attrs.int("n_group");
        // The choices of every token are staged in the activation area.
        let b = self.batch;
        if !(1..=ROUTER_MAX_GROUPS as i64).contains(&n_group)
            || !e.is_multiple_of(n_group as u64)
            || b * e * 4 > ACTIVATION_BYTES
        {
            return Err(format!(
                "a router over {e} experts in {n_group} groups at batch {b} (the device router takes up to \
                 {ROUTER_MAX_GROUPS} equal groups and batch x experts x 4 bytes up to {ACTIVATION_BYTES})"
            ));
        }
        Ok(())
    }

    /// The experts' weight type (bf16, MXFP4 or FP8), or what the library lacks.
    fn expert_kind(&self, n: NodeId, attrs: &Attrs) -> std::result::Result<DType, String> {
        match attrs.str("act") {
            "silu" | "situ" => {}
            a => return Err(format!("experts with act_and_mul with act \"{a}\"")),
        }
        match self.g.value_type(self.g.operands(n)[3]).dtype {
            t @ (DType::Bf16 | DType::Mxfp4 | DType::Fp8E4m3) => Ok(t),
            other => Err(format!("{} expert weights", other.name())),
        }
    }

    /// FP8 rows stream through the ring in 16-byte runs: a linear's input
    /// width a multiple of 16.
    fn projection(&self, n: NodeId) -> Lacks {
        let ops = self.g.operands(n);
        let (w, k) = (self.g.value_type(ops[1]), self.g.value_type(ops[0]).elements());
        if w.dtype == DType::Fp8E4m3 && !k.is_multiple_of(FP8_ALIGN) {
            return Err(format!("FP8 weight rows of {k} columns (a multiple of {FP8_ALIGN})"));
        }
        Ok(())
    }

    /// The MLA split and combine read W_UK and W_UV (kv_b) as bf16 rows: bf16
    /// weights, or FP8 ones the runtime dequantises on upload.
    fn mla_weights(&self, n: NodeId) -> Lacks {
        match self.g.value_type(self.g.operands(n)[3]).dtype {
            DType::Bf16 | DType::Fp8E4m3 => Ok(()),
            other => Err(format!("{} MLA up-projection (kv_b) weights", other.name())),
        }
    }

    fn moe(&self, n: NodeId) -> Lacks {
        let ops = self.g.operands(n);
        let wg = self.g.value_type(ops[3]);
        let mx = wg.dtype == DType::Mxfp4;
        let (i, d) = (wg.shape[1], wg.shape[2]);
        let k = self.g.value_type(ops[1]).elements();
        if mx && (!d.is_multiple_of(MX_BLOCK) || !i.is_multiple_of(MX_BLOCK)) {
            return Err(format!("MXFP4 experts whose widths ({d}, {i}) are not multiples of {MX_BLOCK}"));
        }
        if wg.dtype == DType::Fp8E4m3 && (!d.is_multiple_of(FP8_ALIGN) || !i.is_multiple_of(FP8_ALIGN)) {
            return Err(format!("FP8 experts whose widths ({d}, {i}) are not multiples of {FP8_ALIGN}"));
        }
        if !d.is_multiple_of(8) || !i.is_multiple_of(8) || self.batch * k > MOE_MAX_CHOICES {
            return Err(format!(
                "expert widths ({d}, {i}) that are multiples of 8 and at most {MOE_MAX_CHOICES} choices per step \
                 ({} here)",
                self.batch * k
            ));
        }
        if mx {
            // MXFP4 rows come in tiles (device/mkc/mx_layout.h): a task's rows
            // start on a tile and a gate/up task's are whole tiles, so the
            // units the tasks share rows in are whole tiles (and so are the
            // widths, above).
            for s in self.stages.iter().take(2) {
                for t in &self.tiling.stages[*s].tasks {
                    let TaskArgs::ExpertRows { unit, .. } = self.tiling.tasks[*t].args else {
                        return Err("expert tasks without expert rows".into());
                    };
                    if !unit.is_multiple_of(MX_TILE_ROWS as u32) {
                        return Err(format!(
                            "MXFP4 expert rows shared in units of {unit} rows: they must be whole tiles of \
                             {MX_TILE_ROWS} rows"
                        ));
                    }
                }
            }
        }
        Ok(())
    }
}

impl FusedOp {
    /// The node the operation is built around (the first of its nodes whose
    /// op gives it its kind; an element-wise one's first node): where its
    /// errors point.
    pub fn anchor(&self, g: &Graph) -> NodeId {
        let ids = || self.nodes.iter().map(|n| NodeId::at(*n));
        ids()
            .find(|n| g.op(*n).and_then(|(k, _)| FusedKind::of_anchor(k)) == Some(self.kind))
            .unwrap_or_else(|| ids().next().expect("a fused operation has nodes"))
    }
}
