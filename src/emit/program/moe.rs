//! Routing and experts: the router stage, and the routed experts' gate/up,
//! down and combine stages (bf16 or MXFP4 weights).

use super::*;

impl Gen<'_> {
    pub(super) fn router(&mut self, op: &FusedOp) -> Result<()> {
        let g = self.g;
        let stage = self.last_stage(op);
        self.place_outputs(op);
        let n = nid(op.nodes[0]);
        let (_, attrs) = self.op_of(n).expect("an op");
        let ops = g.operands(n);
        let e = g.value_type(ops[0]).elements();
        let logits = self.value(ops[0], op)?;
        let bias = if ops.len() > 1 { self.weight(ops[1].node, 0)? } else { "nullptr".into() };
        let ids = self.value(ValueRef { node: n, output: 0 }, op)?;
        let wts = self.value(ValueRef { node: n, output: 1 }, op)?;
        // This router's rows of the routing log (Program::route_log).
        let top_k = attrs.int("top_k") as u64;
        let Some(rows) = self.plan.arena.routers.iter().find(|r| r.node == g.node(n).name) else {
            return Err(internal(op, "a router without rows in the routing log"));
        };
        let log = self.param("route_log", Param::RouteLog(rows.offset));
        self.header(stage, op, "scores and top-k");
        let f = self.fname(op, stage);
        let shape = init!("RouterShape";
            experts = e,
            top_k = top_k,
            n_group = attrs.int("n_group"),
            topk_group = attrs.int("topk_group"),
            renormalize = attrs.bool("renormalize"),
            scale = float(attrs.float("scale")),
        );
        let args = init!("Router";
            shape = shape,
            logits = logits,
            bias = bias,
            ids = ids,
            wts = wts,
            log = format!("reinterpret_cast<int32_t*>(m.arena + {log})"),
        );
        let _ = writeln!(
            self.code,
            "__device__ inline void {f}(const Memory& m, const @K@_params& p) {{\n  router<kBatch>({args});\n}}"
        );
        self.role(stage, format!("{f}(m, p);"), None);
        Ok(())
    }

    pub(super) fn moe(&mut self, op: &FusedOp) -> Result<()> {
        let g = self.g;
        let stages = self.stages_of(op);
        let (up, down, combine) = (stages[0], stages[1], stages[2]);
        self.place_outputs(op);
        let n = op
            .nodes
            .iter()
            .map(|n| nid(*n))
            .find(|n| matches!(self.op_of(*n), Some((OpKind::Moe, _))))
            .expect("anchor");
        let (_, attrs) = self.op_of(n).expect("an op");
        let act_call = act_and_mul_call(attrs, "s").map_err(|a| internal(op, &format!("experts with {a}")))?;
        let ops = g.operands(n);
        let wg = g.value_type(ops[3]).clone();
        // MXFP4 and FP8 experts: each expert's codes then its scales in the
        // weight table, staged input (`paired`); bf16 rows read it in place.
        let (mx, fp8) = match wg.dtype {
            DType::Bf16 => (false, false),
            DType::Mxfp4 => (true, false),
            DType::Fp8E4m3 => (false, true),
            other => return Err(internal(op, &format!("{} expert weights", other.name()))),
        };
        let paired = mx || fp8;
        let (e, i, d) = (wg.shape[0], wg.shape[1], wg.shape[2]);
        let k = g.value_type(ops[1]).elements();
        // On one GPU of several (an expert-parallel program), its share of the
        // experts: `local` of them from the router's id `rank local` (program()
        // checked that they divide evenly).
        let ranks = u64::from(self.plan.options.expert_parallel.max(1));
        let local = e / ranks;
        let slots = (self.batch * k).min(local);
        // The input, or the input of its RMSNorm prologue.
        let (_, x, norm, eps) = self.with_norm_prologue(op, ops[0])?;
        let ids = self.value(ops[1], op)?;
        let wts = self.value(ops[2], op)?;
        let (bg, bu, bd) =
            (self.family_base(ops[3].node), self.family_base(ops[4].node), self.family_base(ops[5].node));
        // MXFP4 and FP8: each expert's codes then its scales, experts `stride` apart.
        let stride = if paired { 2 } else { 1 };
        if paired {
            for w in [ops[3].node, ops[4].node, ops[5].node] {
                let NodeKind::Weight(wt) = &g.node(w).kind else { unreachable!("a weight") };
                let base = self.weight_index[&wt.key_at(0)];
                for e in 0..wt.family.as_ref().map_or(1, |f| f.1) {
                    let code = self.weight_index[&wt.key_at(e)];
                    let scale = wt.scale_key_at(e).and_then(|k| self.weight_index.get(&k).copied());
                    if code != base + 2 * e as usize || scale != Some(code + 1) {
                        return Err(unsupported(op, "experts whose codes and scales are not listed in pairs"));
                    }
                }
            }
        }
        let out = self.value(ValueRef { node: n, output: 0 }, op)?;
        let act_at = self.block(op, up, Block::ExpertAct)?;
        let down_at = self.block(op, down, Block::ExpertDown)?;
        let shape = init!("MoeShape";
            experts = local,
            top_k = k,
            inter = i,
            hidden = d,
            slots = slots,
            gate_base = format!("uint32_t({bg})"),
            up_base = format!("uint32_t({bu})"),
            down_base = format!("uint32_t({bd})"),
            stride = stride,
        );
        // The shape, and how a task's functions call for it (this GPU's first
        // expert is the runtime's: m.peers).
        let shape_call = if ranks > 1 {
            let shape = with_field(&shape, "first", &format!("m.peers->rank * {local}u"));
            let _ = writeln!(
                self.code,
                "\n__device__ inline MoeShape @K@_shape(const Memory& m, const @K@_params& p) {{\n  return {shape};\n}}"
            );
            "@K@_shape(m, p)"
        } else {
            let _ = writeln!(
                self.code,
                "\n__device__ inline MoeShape @K@_shape(const @K@_params& p) {{\n  return {shape};\n}}"
            );
            "@K@_shape(p)"
        };
        // The row type, its loader and its consumer.
        let (rows_t, rows_fn, load_fn, compute_fn) = if mx {
            ("MxRows", "expert_mx_rows", "mx_rows_load", "mx_rows_compute")
        } else if fp8 {
            ("Fp8Rows", "expert_fp8_rows", "fp8_rows_load<kBatch>", "fp8_rows_compute")
        } else {
            ("Rows", "expert_rows", "rows_load<kBatch>", "rows_compute")
        };
        let act = format!("reinterpret_cast<float*>({})", self.arena("act", act_at));
        let dn = format!("reinterpret_cast<float*>({})", self.arena("down", down_at));
        // Expert rows stream through the page ring like a projection's; the
        // loader finds the slot's expert in the router's ids.
        // An MXFP4 or FP8 stage's input is staged whole as fp32; one that does not
        // fit the shared-memory staging goes to the SM's global staging past
        // the output tile (bf16 rows read their input in place instead).
        let spill = [self.spill(up), self.spill(down)];
        // The consumer's arguments: the rows, the input and its prologue (and
        // where an MXFP4 or FP8 stage's input spills), and for those two the
        // tokens that chose the task's expert (the rows their consumers compute).
        let compute = |x: &str, norm: &str, eps: f64, spill: &str| {
            if mx || fp8 {
                init!(if mx { "MxRowsCompute" } else { "Fp8RowsCompute" };
                    rows = "r",
                    x = x,
                    norm = norm,
                    eps = float(eps),
                    spill = spill,
                    tokens = "expert_tokens<kBatch>(a, q)",
                )
            } else {
                init!("RowsCompute"; rows = "r", x = x, norm = norm, eps = float(eps))
            }
        };
        // A task's part of the step's distinct experts' rows (expert_part,
        // device/mkc/ops/moe.cuh), found alike by the loader and the consumers.
        let expert_args = |down: bool| {
            init!("ExpertRows";
                shape = shape_call,
                part = "t.a[0]",
                parts = "t.a[1]",
                unit = "t.a[2]",
                w = "m.w",
                ids = ids,
                down = down,
            )
        };
        let span = "Span{.c0 = 0, .e0 = r.r0, .len = r.r1 - r.r0}";
        // The stage's functions: the task's arguments, its rows (the loader's),
        // and its consumers (the rows, the input, the epilogue).
        let functions = |f: &str, down: bool, x: &str, norm: &str, eps: f64, spill: &str, epilogue: &str| {
            format!(
                "__device__ inline ExpertRows {f}_args(const TaskArgs& t, const Memory& m, const @K@_params& p) {{\n  \
                 return {};\n}}\n\
                 __device__ inline {rows_t} {f}_rows(const TaskArgs& t, const Memory& m, const @K@_params& p) {{\n  \
                 const ExpertRows a = {f}_args(t, m, p);\n  return {rows_fn}<kBatch>(a, expert_part<kBatch>(a));\n}}\n\
                 __device__ inline void {f}(const TaskArgs& t, const Memory& m, const @K@_params& p, uint32_t& it, int warp) {{\n  \
                 const ExpertRows a = {f}_args(t, m, p);\n  const ExpertPart q = expert_part<kBatch>(a);\n  \
                 const {rows_t} r = {rows_fn}<kBatch>(a, q);\n  float* st = staging(m);\n  const uint32_t n = r.cols();\n  \
                 {compute_fn}<kBatch>({}, it, warp, st);\n  consumer_sync();\n{epilogue}}}",
                expert_args(down),
                compute(x, norm, eps, spill),
            )
        };
        self.header(up, op, "a part of the step's experts' gate/up rows");
        let f = self.fname(op, up);
        let code = functions(
            &f,
            false,
            &x,
            &norm,
            eps,
            &spill[0],
            &format!(
                "  const Span s = {span};\n  {act_call}\n  consumer_sync();\n  \
                 ep_store<kBatch>(st, n, s, {act} + size_t(q.slot) * kBatch * {i}, {i});\n"
            ),
        );
        let _ = writeln!(self.code, "{code}");
        self.role(up, format!("{f}(t, m, p, it, warp);"), Some(format!("{load_fn}({f}_rows(t, m, p), it);")));
        self.header(down, op, "a part of the step's experts' down rows");
        let f = self.fname(op, down);
        let code = functions(
            &f,
            true,
            &format!("{act} + size_t(q.slot) * kBatch * {i}"),
            "nullptr",
            1e-6,
            &spill[1],
            &format!("  ep_store<kBatch>(st, n, {span}, {dn} + size_t(q.slot) * kBatch * {d}, {d});\n"),
        );
        let _ = writeln!(self.code, "{code}");
        // The loader waits for the router's whole stage before reading the
        // ids (the schedule's load waits, checked by the verifier).
        if !self.plan.arena.writes.contains_key(&ops[1]) {
            return Err(unsupported(op, "ids from a router stage"));
        }
        self.role(down, format!("{f}(t, m, p, it, warp);"), Some(format!("{load_fn}({f}_rows(t, m, p), it);")));
        self.header(combine, op, "weighted sum of the slots");
        let f = self.fname(op, combine);
        // On one GPU of several, the sum of its experts' rows: its part, which
        // the exchange's stages send and add.
        let part = if ranks > 1 {
            let at = self.block(op, combine, Block::ExpertPart)?;
            Some(format!("reinterpret_cast<float*>({})", self.arena("part", at)))
        } else {
            None
        };
        let args = init!("ExpertCombine";
            shape = shape_call,
            tile = "t.a[0]",
            tiles = "t.a[1]",
            ids = ids,
            wts = wts,
            dn = dn,
            routed = part.clone().unwrap_or_else(|| out.clone()),
        );
        let _ = writeln!(
            self.code,
            "__device__ inline void {f}(const TaskArgs& t, const Memory& m, const @K@_params& p) {{\n  \
             expert_combine<kBatch>({args});\n}}"
        );
        self.role(combine, format!("{f}(t, m, p);"), None);
        if let Some(part) = part {
            self.exchange(op, &stages, &part, &out, d)?;
        }
        Ok(())
    }

    /// An expert-parallel program's exchange after a MoE combine: its send
    /// and reduce stages (`stages[3..5]`), over this GPU's part `part` of the
    /// `[batch][width]` output `out`.
    fn exchange(&mut self, op: &FusedOp, stages: &[usize], part: &str, out: &str, width: u64) -> Result<()> {
        let &[_, _, _, send, reduce] = stages else {
            return Err(internal(op, "an expert-parallel MoE operation without its exchange's two stages"));
        };
        let plan = self.plan;
        // The exchange's place among the step's (its inbox half) and its remote counter.
        let index = plan.tiling.stages[..send].iter().filter(|s| s.kind == TaskKind::ExchangeSend).count() as u64;
        let Some(counter) = plan.schedule.counters.iter().find(|c| c.remote && c.stage == send) else {
            return Err(internal(op, "an exchange without its remote counter"));
        };
        let (counter, expected) = (counter.id as u64, u64::from(counter.expected));
        self.exchange_floats = self.exchange_floats.max(self.batch * width);
        let x = init!("Exchange";
            peers = "m.peers",
            index = format!("uint32_t({})", self.param("exchange", Param::Int(index))),
            per_step = "kExchanges",
            floats = "uint32_t(kExchangeFloats)",
            width = width,
            tile = "t.a[0]",
            tiles = "t.a[1]",
            counter = format!("uint32_t({})", self.param("remote_counter", Param::Int(counter))),
        );
        self.header(send, op, "this GPU's part of a column tile to every other GPU");
        let f = self.fname(op, send);
        let _ = writeln!(
            self.code,
            "__device__ inline void {f}(const TaskArgs& t, const Memory& m, const @K@_params& p) {{\n  \
             exchange_send<kBatch>({x}, {part});\n}}"
        );
        self.role(send, format!("{f}(t, m, p);"), None);
        self.header(reduce, op, "a column tile's sum over the GPUs");
        let f = self.fname(op, reduce);
        let _ = writeln!(
            self.code,
            "__device__ inline void {f}(const TaskArgs& t, const Memory& m, const @K@_params& p) {{\n  \
             exchange_reduce<kBatch>({x}, {part}, {expected}u, {out});\n}}"
        );
        self.role(reduce, format!("{f}(t, m, p);"), None);
        Ok(())
    }
}
